"""Chapter 02: one process (single.py), DDP via mp.spawn (spawn.py) and DDP via torchrun (train.py)
reach the same parameters for the same global batch and seed (float64, within 1e-12), and the
classic mistakes do not."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from chapters.ch02_single_node import controls, make_diff, single, spawn, train
from chapters.ch02_single_node.task import (
    PARITY_TOLERANCE,
    TaskConfig,
    build_data,
    build_model,
    global_batch_indices,
    max_param_diff,
    misplaced_rows,
    shard_for_rank,
)
from common.checkpoint import load_checkpoint
from common.config import parse_config
from common.launch import run_on_ranks, run_python, run_torchrun
from common.results import REPO_ROOT

CH = REPO_ROOT / "chapters" / "ch02_single_node"
STEPS, SEED = 12, 3  # not the defaults: the options must reach every rank (the notebook's too)
ARGS = ["--steps", STEPS, "--seed", SEED, "--log-every", 1, "--device", "cpu"]
TOL = PARITY_TOLERANCE["float64"]  # 1e-12: same sums, different order, float64 rounding
CPU = torch.device("cpu")


def reference_history(cfg: TaskConfig) -> list[dict]:
    """One process on the whole global batch, written here without the chapter's batch, loss,
    step and optimizer code (only its data and model builders; SGD with momentum by hand, as
    torch.optim.SGD defines it): the parameters after every step."""
    X, Y = build_data(cfg, CPU)
    model = build_model(cfg, CPU)
    params = list(model.parameters())
    momentum_buffers = [None] * len(params)
    B, n = cfg.global_batch_size, cfg.n_samples
    history = []
    for step in range(cfg.steps):
        rows = [(step * B + i) % n for i in range(B)]
        loss = ((model(X[rows]) - Y[rows]) ** 2).mean()
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(params, grads)):
                buf = momentum_buffers[i]
                buf = g.clone() if buf is None else buf * cfg.momentum + g
                momentum_buffers[i] = buf
                p -= cfg.lr * buf
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return history


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three scripts, launched for real, once each, with the same options."""
    base = tmp_path_factory.mktemp("ch02")
    # Independent jobs, started together: on 2 cores this saves ~30 % of the wall time (process
    # start-up waits on I/O), and nothing here depends on timings.
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {
            "single": pool.submit(run_python, CH / "single.py", args=ARGS, out_dir=base / "single"),
            "spawn": pool.submit(run_python, CH / "spawn.py", args=[*ARGS, "--nprocs", 2],
                                 out_dir=base / "spawn"),
            "train": pool.submit(run_torchrun, CH / "train.py", nproc=2, args=ARGS,
                                 out_dir=base / "train"),
        }
        return {name: future.result() for name, future in futures.items()}


def final_params(result) -> dict:
    return load_checkpoint(result.out_dir / "final_params.pt")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_scripts_reach_the_same_parameters(runs):
    assert {k: r.summary["world_size"] for k, r in runs.items()} == {"single": 1, "spawn": 2, "train": 2}
    params = {k: final_params(r) for k, r in runs.items()}
    initial = build_model(TaskConfig(seed=SEED), CPU).state_dict()
    assert max_param_diff(params["single"], initial) > 1e-2  # it trained: parity is not trivial
    assert max_param_diff(params["spawn"], params["single"]) <= TOL
    assert max_param_diff(params["train"], params["single"]) <= TOL
    assert max_param_diff(params["spawn"], params["train"]) <= TOL


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_scripts_match_the_reference_computed_here(runs):
    cfg = TaskConfig(steps=STEPS, seed=SEED)
    for result in runs.values():
        assert result.summary["config"]["seed"] == SEED and result.summary["config"]["steps"] == STEPS
    expected = reference_history(cfg)[-1]
    for name, result in runs.items():
        assert max_param_diff(final_params(result), expected) <= TOL, name


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_loss_curves_agree_and_scripts_own_checks_pass(runs):
    curves = {}
    for name, result in runs.items():
        lines = (result.out_dir / "metrics.jsonl").read_text().splitlines()
        curves[name] = [json.loads(line)["loss"] for line in lines]
        assert all(c["ok"] for c in result.summary["checks"]), result.summary["checks"]
        assert result.summary["figures"]["final loss"]["measured"] == pytest.approx(curves[name][-1])
        step = result.summary["figures"]["step time (median)"]  # reported with its min-max
        assert 0 < step["spread"][0] <= step["measured"] <= step["spread"][1]
    assert len(curves["single"]) == STEPS and curves["single"][-1] < curves["single"][0]
    # One process shards nothing, so single.py has no shard checks; the DDP scripts merge the
    # ranks' row counts over the first 3 steps: every row of each global batch held once.
    assert not [c for c in runs["single"].summary["checks"] if "rows" in c["name"]]
    for name in ("spawn", "train"):
        assert runs[name].check("rows the shards miss, repeat or add (3 steps)")["measured"] == 0
        assert runs[name].check("distinct rows the ranks hold (3 steps)")["measured"] == 3 * 48
        assert curves[name] == pytest.approx(curves["single"], rel=1e-12, abs=0)
        assert runs[name].check("DDP == one process on the global batch")["measured"] <= TOL
        assert runs[name].check("replicas identical on every rank")["measured"] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_negative_controls_and_ddp_design_on_two_ranks():
    results = run_on_ranks(controls.ddp_controls, 2, steps=8, exercise=True, timeout=90)
    cfg = results[0]["config"]
    reference = reference_history(cfg)
    # Positive control: DDP as train.py does it equals one process after every step, and
    # train.py's own checks (misplaced and distinct rows over 3 steps, replica spread) pass.
    B = cfg.global_batch_size
    for rank in results:
        correct = rank["variants"]["correct"]
        for got, want in zip(correct["history"], reference):
            assert max_param_diff(got, want) <= TOL
        assert correct["misplaced_rows"] == 0 and correct["distinct_rows"] == 3 * B
        assert correct["replica_spread"] == 0.0
    # Negative controls: the same parity check against one process rejects every broken variant.
    for variant in ("same_shard", "sum_loss", "no_ddp", "overlap"):
        final0 = results[0]["variants"][variant]["history"][-1]
        diff = max_param_diff(final0, reference[-1])
        assert not diff <= TOL, f"{variant} passed the parity check ({diff})"
        assert diff > 1e-3, variant
    # The replicas of the first two still agree (nothing looks wrong on the ranks); only the
    # distinct-samples count flags the unsharded data. Without DDP the replicas drift apart.
    for variant in ("same_shard", "sum_loss"):
        finals = [r["variants"][variant]["history"][-1] for r in results]
        assert max_param_diff(*finals) == 0.0 and results[0]["variants"][variant]["replica_spread"] == 0.0
    # train.py's shard checks: every rank on shard 0 holds half the rows twice and the other
    # half not at all (48 misplaced rows a step); overlapping shards (rank 0 ends one row late)
    # share one row a step while together still holding all 48 distinct rows, so only the
    # misplaced-rows count, not the distinct-rows count, rejects them. A summed loss shards right.
    shard_checks = {v: (results[0]["variants"][v]["misplaced_rows"],
                        results[0]["variants"][v]["distinct_rows"])
                    for v in ("same_shard", "overlap", "sum_loss")}
    assert shard_checks == {"same_shard": (3 * B, 3 * B // 2), "overlap": (3, 3 * B),
                            "sum_loss": (0, 3 * B)}
    assert all(r["variants"]["no_ddp"]["replica_spread"] > 1e-3 for r in results)
    # Exercise 2: DistributedSampler's strided shard (rank r takes rows r, r+W, ...) still
    # matches one process within the tolerance: the same rows per step, summed in another order.
    for r in results:
        strided = r["exercise_strided"]
        assert strided["misplaced_rows"] == 0 and strided["replica_spread"] == 0.0
        for got, want in zip(strided["history"], reference):
            assert max_param_diff(got, want) <= TOL
    # Construction broadcasts rank 0's parameters: replicas seeded differently end equal.
    before0, before1 = (r["broadcast"]["before"] for r in results)
    assert (before0 - before1).abs().max() > 1e-2
    for r in results:
        assert torch.equal(r["broadcast"]["after"], before0)
    # Gradients are all-reduced inside backward(), in buckets, each gradient exactly once.
    n = results[0]["n_params"]
    for r in results:
        for steps in (r["buckets_default"], r["buckets_small"]):
            assert all(s["before_backward"] == [] and sum(s["after_backward"]) == n for s in steps)
        assert all(len(s["after_backward"]) == 1 for s in r["buckets_default"])
        # 4 KiB buckets (524 float64) after the first step, filled in the order gradients become
        # ready (last layer first) and closed once full: the last two layers' 33 + 1056, then the
        # first layer's 544. The first step has one bucket (torch 2.14 rebuilds after it).
        assert [s["after_backward"] for s in r["buckets_small"]] == [[n], [1089, 544], [1089, 544]]
        # Exercise 5 (4,216,833 parameters): default caps, a first bucket of 1 MiB and 25 MiB
        # after it -> 2 buckets; bucket_cap_mb=1 -> every 1 MiB bucket closes after one big layer -> 5.
        assert [len(s["after_backward"]) for s in r["exercise_default"]] == [1, 2]
        assert [len(s["after_backward"]) for s in r["exercise_1mb"]] == [1, 5]
        assert sum(r["exercise_1mb"][1]["after_backward"]) == 4_216_833


def test_shards_partition_the_global_batch_in_order():
    idx = global_batch_indices(step=11, global_batch_size=48, n_samples=100)
    assert idx.tolist() == [(11 * 48 + i) % 100 for i in range(48)]
    for world_size in (1, 2, 3, 4, 6):
        shards = [shard_for_rank(idx, r, world_size) for r in range(world_size)]
        assert all(len(s) == 48 // world_size for s in shards)
        assert torch.equal(torch.cat(shards), idx)
    with pytest.raises(ValueError, match="cannot be split evenly over 5 processes"):
        shard_for_rank(idx, 0, 5)


def test_misplaced_rows_judges_any_split():
    """train.py's shard check, on row counts built here: a partition of the batch gives 0, also
    when a rank holds nothing; a shared row, a row nobody holds and a row from outside the
    batch each count once."""
    batch = torch.tensor([4, 5, 6, 7])  # the global batch: rows 4..7 of a 10-row data set

    def merged(*shards):  # what rows_held's SUM all-reduce makes of the ranks' shards
        return sum(torch.bincount(torch.tensor(s, dtype=torch.long), minlength=10) for s in shards)

    assert misplaced_rows(merged([4, 5], [6, 7]), batch) == 0
    assert misplaced_rows(merged([4, 5, 6, 7], [], [], []), batch) == 0  # 3 ranks with nothing
    assert misplaced_rows(merged([4, 5, 6], [6, 7]), batch) == 1       # overlap by one row
    assert misplaced_rows(merged([4, 5], [7]), batch) == 1             # row 6 taken by nobody
    assert misplaced_rows(merged([4, 5], [6, 8]), batch) == 2          # 8 instead of 7
    assert misplaced_rows(merged([4, 5], [4, 5]), batch) == 4          # everyone on shard 0


def test_batch_not_divisible_by_world_size_is_refused(monkeypatch, capsys):
    # spawn.py knows its world size from --nprocs; parse_config turns the refusal into exit
    # status 2 and one "error:" line (argparse's convention) before any process starts.
    with pytest.raises(SystemExit) as exit_info:
        parse_config(spawn.Config, ["--nprocs", "2", "--global-batch-size", "47"], validate=spawn.validate)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error: " in line]
    assert len(errors) == 1 and ("error: --global-batch-size 47 cannot be split evenly over 2 "
                                 "processes: choose a multiple of 2") in errors[0]
    assert "Traceback" not in err
    # train.py is validated at the world size torchrun exports, before any process group exists;
    # only rank 0 prints the line.
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_info:
            parse_config(train.Config, ["--global-batch-size", "47"], validate=train.validate)
        assert exit_info.value.code == 2
        assert ("cannot be split evenly over 2 processes" in capsys.readouterr().err) == printed
    for world in (1, 2, 3, 4, 8, 16):  # the default 48 splits over every world the course uses
        train.validate(train.Config(), world)
        spawn.validate(replace(spawn.Config(), nprocs=world), 1)
    with pytest.raises(ValueError, match="over 5 processes"):
        train.validate(train.Config(), 5)
    with pytest.raises(ValueError, match="over 4 processes"):
        spawn.validate(replace(spawn.Config(), nprocs=4, global_batch_size=50), 1)
    # single.py is one process by design.
    single.validate(single.Config(), 1)
    with pytest.raises(ValueError, match="one process by design"):
        single.validate(single.Config(), 2)


def test_setup_refuses_ranks_that_srun_started_directly(monkeypatch, capsys, tmp_path):
    """srun -n 4 python train.py would otherwise make four worlds of one, each training alone."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert train.main(train.Config(out=str(tmp_path), device="cpu")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: srun started this process directly")


def test_single_and_spawn_refuse_a_missing_gpu_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert single.main(single.Config(out=str(tmp_path), device="cuda")) == 2
    assert spawn.main(replace(spawn.Config(), out=str(tmp_path), device="cuda")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[0] for line in err if "error" in line] == ["single.py", "spawn.py"]
    assert all("--device cuda, but torch sees no CUDA GPU" in line for line in err if "error" in line)


def _rank_that_raises(rank: int, cfg) -> None:
    """Stands in for spawn.run_rank: rank 1 fails the way a bug in training would."""
    if rank == 1:
        raise ValueError("rank 1 found no rows to train on (raised on purpose)")


@pytest.mark.timeout(120)
def test_spawn_reports_a_rank_that_raised_in_one_line(monkeypatch, capfd, tmp_path):
    """mp.spawn re-raises a child's exception in the parent as ProcessRaisedException, whose
    message is the child's whole traceback: spawn.py prints one line naming the rank and the
    exception, keeps the traceback in the run's folder, and exits with status 1."""
    monkeypatch.setattr(spawn, "run_rank", _rank_that_raises)  # the children unpickle this one
    status = spawn.main(replace(spawn.Config(), nprocs=2, out=str(tmp_path), device="cpu"))
    out, err = capfd.readouterr()
    assert status == 1
    assert err.strip().splitlines() == [
        "spawn.py: error: rank 1 raised ValueError: rank 1 found no rows to train on (raised on "
        "purpose)"]
    assert "Traceback" not in out and "traceback.rank1.txt" in out
    saved = (tmp_path / "traceback.rank1.txt").read_text()
    assert saved.startswith("-- Process 1 terminated with the following error:")
    assert "Traceback" in saved and "_rank_that_raises" in saved


def test_readme_diff_is_generated_and_current():
    readme = (CH / "README.md").read_text()
    assert make_diff.START in readme and make_diff.END in readme
    assert readme == make_diff.readme_with_diff(readme, make_diff.render_diff()), \
        "the README's diff is stale: run python tools/figures.py ch02"
    assert "+        idx = shard_for_rank(batch, info.rank, info.world_size)" in readme
