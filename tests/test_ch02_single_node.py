"""Chapter 02: one process (single.py), DDP via mp.spawn (spawn.py) and DDP via torchrun (train.py)
reach the same parameters for the same global batch and seed (float64, within 1e-12), and the
classic mistakes do not."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from unittest import mock

import pytest
import torch
from torch import nn

from chapters.ch02_single_node import (
    controls,
    counting,
    dataparallel,
    make_diff,
    simulated_devices,
    single,
    spawn,
    train,
)
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
    for path in make_diff.READMES:  # the English lesson and its Chinese twin hold the same block
        text = path.read_text()
        assert make_diff.START in text and make_diff.END in text, path
        assert text == make_diff.readme_with_diff(text, make_diff.render_diff()), \
            f"{path.name}'s diff is stale: run python tools/figures.py ch02"
    readme = (CH / "README.md").read_text()
    assert "+        idx = shard_for_rank(batch, info.rank, info.world_size)" in readme


def test_regenerated_diff_keeps_the_chinese_stamps_current(tmp_path, monkeypatch):
    """A change to train.py rewrites the block in both lessons; the Chinese section's stamp follows
    the English's (the block is code, alike in both), so the pair still checks without a re-stamp."""
    import shutil

    from tools.bilingual_text import sections, stamp_of

    for name in ("README.md", "README.zh.md", "single.py", "train.py"):
        shutil.copy(CH / name, tmp_path / name)
    with open(tmp_path / "train.py", "a") as f:
        f.write("\nEXTRA = 1  # a change the diff must show\n")
    monkeypatch.setattr(make_diff, "HERE", tmp_path)
    monkeypatch.setattr(make_diff, "README", tmp_path / "README.md")
    monkeypatch.setattr(make_diff, "ZH", tmp_path / "README.zh.md")

    def stamps(path):  # the English's headed sections' stamps, the Chinese's stamp lines, in order
        en = [stamp_of("\n".join(s.lines)) for s in sections(path.read_text())[1:]]
        return en, re.findall(r"^<!-- en: ([0-9a-f]{10}) -->$", (tmp_path / "README.zh.md").read_text(), re.M)

    before_en, before_zh = stamps(tmp_path / "README.md")
    assert before_en == before_zh  # the committed pair is current
    make_diff.write_readme()
    after_en, after_zh = stamps(tmp_path / "README.md")
    assert "+EXTRA = 1" in (tmp_path / "README.zh.md").read_text()
    assert sum(a != b for a, b in zip(before_en, after_en)) == 1  # the diff's section changed ...
    assert after_zh == after_en  # ... and its Chinese stamp moved with it


# --- nn.DataParallel: its mechanism counted on simulated devices, its timing on GPUs -------------

DP_STEPS = 4  # >= 3 steps: every forward must replicate again, not only the first


def dp_config(devices: int, batch: int, steps: int = DP_STEPS) -> dataparallel.Config:
    return dataparallel.Config(steps=steps, seed=SEED, global_batch_size=batch, device="cpu",
                               devices=devices)


def assert_mechanism(cfg, tap, chunks: list[int], devices: list[str]) -> None:
    """Every step's record against closed forms written here. P parameters of 8 bytes
    (float64), B rows of d_in = 16 features in, 1 out; R = len(chunks) devices got rows:
    the whole batch scattered, R replicas of which R - 1 are fresh copies of the P parameters
    (replica 0 shares the module's storage), the whole output gathered on device 0, R - 1 sets
    of P gradients computed by the copies and found, at the receiving end, summed into device
    0's gradients (each equal to the sum of the R replicas' gradients), none of them before the
    last replica gradient of the step; R forwards in this process, each on its own thread."""
    P = sum(p.numel() for p in build_model(cfg, CPU).parameters())
    assert counting.n_params(cfg) == P
    B, size, R = cfg.global_batch_size, 8, len(chunks)
    assert len(tap.records) == cfg.steps >= 3
    for rec in tap.records:
        assert rec.calls == ["scatter", "replicate", "parallel_apply", "gather"]  # forward's order
        assert rec.chunk_rows == chunks and rec.replicas == R
        assert rec.replica_devices == devices[:R]
        assert rec.scattered_bytes == B * 16 * size
        assert rec.copied_param_bytes == (R - 1) * P * size
        assert rec.shared_param_bytes == P * size
        assert rec.replica_grad_bytes == rec.summed_grad_bytes == (R - 1) * P * size
        assert rec.grad_sum_error <= TOL and rec.replica_grads_seen == R * 2 * cfg.n_layers
        assert len(rec.seen_at_receipt) == 2 * cfg.n_layers  # every parameter received once,
        assert set(rec.seen_at_receipt) == {rec.replica_grads_seen}  # after every replica's
        assert rec.gathered_bytes == B * 1 * size and rec.gathered_device == devices[0]
        names = [name for _, name, _ in rec.forwards]
        assert {pid for pid, _, _ in rec.forwards} == {os.getpid()} and len(set(names)) == R
        assert R == 1 or "MainThread" not in names  # parallel_apply's own threads
        assert sorted(rows for *_, rows in rec.forwards) == sorted(chunks)


@pytest.mark.timeout(60)
def test_dataparallel_mechanism_on_simulated_devices():
    """torch's own DataParallel.forward drives the simulated devices: the tap sees its four
    calls in order, and what they moved equals the closed forms at every step, also where a
    device gets no rows (torch.chunk: 5 rows over 4 devices make 2, 2, 1; 3 rows make 1, 1, 1);
    the trained parameters equal one process's on the whole batch."""
    assert simulated_devices.SimulatedDataParallel.forward is nn.DataParallel.forward
    for devices, batch, chunks in ((2, 48, [24, 24]), (4, 48, [12] * 4), (4, 5, [2, 2, 1]),
                                   (4, 3, [1, 1, 1])):
        cfg = dp_config(devices, batch)
        model, tap, losses, _ = dataparallel.train_data_parallel(cfg, "cpu", devices)
        assert_mechanism(cfg, tap, chunks, ["cpu"] * devices)
        measured = [counting.measured_per_step(r) for r in tap.records]
        assert measured == [counting.expected_per_step(cfg, devices, 8)] * cfg.steps
        reference = reference_history(cfg)
        assert max_param_diff(model.state_dict(), reference[-1]) <= TOL, (devices, batch)
        assert max_param_diff(model.state_dict(), reference[0]) > 1e-3  # it trained
    # Without an accelerator torch's own DataParallel keeps no devices and calls the module
    # (torch/nn/parallel/data_parallel.py: _get_available_device_type() is None; made so here,
    # since on one GPU it would keep device_ids [0] and move the model to cuda:0); the
    # simulated one computes the same output through scatter, replicas and gather.
    cfg = dp_config(2, 48)
    model = build_model(cfg, CPU)
    X, _ = build_data(cfg, CPU)
    with mock.patch("torch.nn.parallel.data_parallel._get_available_device_type",
                    return_value=None):
        plain = nn.DataParallel(model)
    assert plain.device_ids == [] and torch.equal(plain(X[:48]), model(X[:48]))
    simulated = simulated_devices.SimulatedDataParallel(model, 2)
    tap = counting.MechanismTap(simulated)
    assert (simulated(X[:48]) - model(X[:48])).abs().max().item() <= TOL
    assert len(tap.records) == 1 and tap.records[0].chunk_rows == [24, 24]


class ReplicateOnce(simulated_devices.SimulatedDataParallel):
    """Broken: the copies on devices 1.. are made at the first forward and reused ever after
    (replica 0 is rebuilt: reused, its views of the parameters, which the optimizer changes
    in place, make autograd refuse the next forward, as torch's Broadcast outputs would)."""

    def replicate(self, module, device_ids):
        replicas = super().replicate(module, device_ids)
        if not hasattr(self, "kept"):
            self.kept = replicas
        return [replicas[0], *self.kept[1:]]


def broadcast_without_graph(tensors, devices, detach=False):
    """simulated_devices.simulated_broadcast, broken: the copies leave the autograd graph."""
    return [[t.view_as(t) if j == 0 else t.detach().clone() for t in tensors]
            for j in range(len(devices))]


class DetachedReplicas(simulated_devices.SimulatedDataParallel):
    """Broken: the copies on devices 1.. carry no gradient back, so only device 0's rows train."""

    broadcast = staticmethod(broadcast_without_graph)

    def replicate(self, module, device_ids):
        with mock.patch.object(simulated_devices._REPLICATE, "_broadcast_coalesced_reshape",
                               self.broadcast):
            return simulated_devices._REPLICATE.replicate(module, list(device_ids))


def broadcast_as_leaves(tensors, devices, detach=False):
    """Broken: the copies are fresh leaves that require grad. They compute gradients (their
    hooks see them), which reach nobody: device 0 gets replica 0's alone."""
    return [[t.view_as(t) if j == 0 else t.detach().clone().requires_grad_() for t in tensors]
            for j in range(len(devices))]


class CopiesAsLeaves(DetachedReplicas):
    broadcast = staticmethod(broadcast_as_leaves)


class BroadcastDroppingCopies(simulated_devices.SimulatedBroadcast):
    """Broken: one node, as torch's, but its reduction returns replica 0's gradients alone."""

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, *(g.clone() for g in grad_outputs[:ctx.num_inputs]))


def broadcast_dropping_copies(tensors, devices, detach=False):
    if not tensors:  # the module's buffers (none)
        return []
    n = len(tensors)
    copies = BroadcastDroppingCopies.apply(len(devices), *tensors)
    return [list(copies[j:j + n]) for j in range(0, len(copies), n)]


class ReductionDropsCopies(DetachedReplicas):
    broadcast = staticmethod(broadcast_dropping_copies)


def broadcast_per_parameter(tensors, devices, detach=False):
    """Not torch's: a copy per parameter and replica, each its own autograd node, so a
    parameter's gradients are summed into the module's as soon as the replicas have computed
    them, during the backward (right values, DDP's timing, not DataParallel's)."""
    return [[t.view_as(t) if j == 0 else t.clone() for t in tensors] for j in range(len(devices))]


class PerParameterBroadcast(DetachedReplicas):
    broadcast = staticmethod(broadcast_per_parameter)


@pytest.mark.timeout(60)
def test_dataparallel_negative_controls():
    """The same counts and parity reject a DataParallel that keeps its first replicas (stale
    copies from step 1 on: no bytes copied, parameters off), one whose copies carry no
    gradient back to device 0 (nothing reduced: device 0's rows alone train the model), and
    one whose copies are fresh leaves (they compute gradients, so the copies' count passes,
    but the receiving end finds none of them in device 0's gradients), and one whose reduction
    drops the copies' gradients (all computed before it runs, as they should be, but device 0's
    gradient is not their sum: only the value comparison finds it). A broadcast with one
    autograd node per parameter trains right but reduces during the backward: the early
    reductions count rejects it (torch's Broadcast is one node for every parameter)."""
    cfg = dp_config(2, 48)
    P8 = 1633 * 8
    reference = reference_history(cfg)[-1]
    model, tap, *_ = dataparallel.train_data_parallel(cfg, "cpu", 2, dp_class=ReplicateOnce)
    assert [r.copied_param_bytes for r in tap.records] == [P8, 0, 0, 0]
    assert max_param_diff(model.state_dict(), reference) > 1e-3
    model, tap, *_ = dataparallel.train_data_parallel(cfg, "cpu", 2, dp_class=DetachedReplicas)
    assert [r.replica_grad_bytes for r in tap.records] == [0] * cfg.steps
    assert [r.summed_grad_bytes for r in tap.records] == [0] * cfg.steps
    assert [r.copied_param_bytes for r in tap.records] == [P8] * cfg.steps  # copies were made
    assert max_param_diff(model.state_dict(), reference) > 1e-3
    model, tap, *_ = dataparallel.train_data_parallel(cfg, "cpu", 2, dp_class=CopiesAsLeaves)
    assert [r.replica_grad_bytes for r in tap.records] == [P8] * cfg.steps  # the hollow count
    assert [r.summed_grad_bytes for r in tap.records] == [0] * cfg.steps
    assert max_param_diff(model.state_dict(), reference) > 1e-3
    model, tap, *_ = dataparallel.train_data_parallel(cfg, "cpu", 2,
                                                      dp_class=ReductionDropsCopies)
    measured = [counting.measured_per_step(r) for r in tap.records]
    assert all(m["replica_grad_bytes"] == P8 and m["early_reductions"] == 0 for m in measured)
    assert [m["summed_grad_bytes"] for m in measured] == [0] * cfg.steps
    assert all(r.grad_sum_error > 1e-3 for r in tap.records)
    assert max_param_diff(model.state_dict(), reference) > 1e-3
    model, tap, *_ = dataparallel.train_data_parallel(cfg, "cpu", 2,
                                                      dp_class=PerParameterBroadcast)
    measured = [counting.measured_per_step(r) for r in tap.records]
    # Every parameter but the one whose gradient is computed last: 5 of the 6 tensors.
    assert all(m["summed_grad_bytes"] == P8 and m["early_reductions"] == 5 for m in measured)
    assert max_param_diff(model.state_dict(), reference) <= TOL


@pytest.mark.timeout(60)
def test_dataparallel_script_counts_match_closed_forms(tmp_path, monkeypatch):
    """The script's run (its main, in this process: one process by design, and a launch costs
    seconds), with the options the other scripts' runs get: its checks, its numbers, its
    parameters against the reference computed here; and its checks fail for a broken
    DataParallel (copies that send no gradient back)."""
    cfg = parse_config(dataparallel.Config, [*map(str, ARGS), "--out", str(tmp_path)],
                       validate=dataparallel.validate)
    assert dataparallel.main(cfg) == 0
    assert max_param_diff(load_checkpoint(tmp_path / "final_params.pt"),
                          reference_history(cfg)[-1]) <= TOL
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["device"] == "cpu"
    assert all(c["ok"] for c in summary["checks"]), summary["checks"]
    checks = {c["name"]: c for c in summary["checks"]}
    P8, B = 1633 * 8, 48
    want = {"replicas built": 2 * STEPS, "replica forwards, a thread each": 2 * STEPS,
            "rows through the replicas": B * STEPS, "batch bytes scattered": B * 16 * 8 * STEPS,
            "parameter bytes copied": P8 * STEPS, "device 0 replica: shared bytes": P8 * STEPS,
            "output bytes gathered": B * 8 * STEPS, "gradient bytes the copies computed": P8 * STEPS,
            "gradient bytes summed into device 0": P8 * STEPS,
            "parameters reduced during the backward": 0}
    for name, value in want.items():
        check = checks[f"{name} ({STEPS} steps)"]
        assert check["measured"] == check["expected"] == value, name
    assert checks["DataParallel == one process on the batch"]["measured"] <= TOL
    figures = summary["figures"]
    assert figures["DataParallel vs DDP on GPUs"]["measured"] == "not measured (CPU)"
    assert figures["rows per device, step 0"]["measured"] == [24, 24]
    # the losses one process computes on the same batches (written here, without the chapter)
    X, Y = build_data(cfg, CPU)
    model = build_model(cfg, CPU)
    model.load_state_dict(reference_history(cfg)[-2])
    rows = [((STEPS - 1) * 48 + i) % cfg.n_samples for i in range(48)]
    last = ((model(X[rows]) - Y[rows]) ** 2).mean().item()
    assert figures["final loss"]["measured"] == pytest.approx(last, rel=1e-12)
    # The negative control: the same run with DetachedReplicas fails its own checks.
    monkeypatch.setattr(dataparallel, "wrap_data_parallel",
                        lambda model, kind, n: DetachedReplicas(model, n))
    broken = replace(cfg, out=str(tmp_path / "broken"))
    assert dataparallel.main(broken) == 1
    summary = json.loads((tmp_path / "broken" / "summary.json").read_text())
    assert sorted(c["name"] for c in summary["checks"] if not c["ok"]) == [
        "DataParallel == one process on the batch",
        f"gradient bytes summed into device 0 ({STEPS} steps)",
        f"gradient bytes the copies computed ({STEPS} steps)",
        f"parameters reduced during the backward ({STEPS} steps)"]  # replica 0's alone: at once


def test_dataparallel_needs_two_gpus_for_real(monkeypatch, capsys, tmp_path):
    """--device cuda with fewer than two GPUs is refused in one line (gpu-check reports it
    n/a); the simulated devices need none; --devices N beyond the GPUs is refused under
    --device auto too (with 2+ GPUs auto means them); --devices 1 would not be DataParallel."""
    for gpus in (0, 1):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        with pytest.raises(ValueError, match=f"needs 2 GPUs and torch sees {gpus}"):
            dataparallel.validate(dataparallel.Config(device="cuda"), 1)
        dataparallel.validate(dataparallel.Config(device="cpu"), 1)
        assert dataparallel.data_parallel_devices(dataparallel.Config()) == ("cpu", 2)
        dataparallel.validate(dataparallel.Config(devices=4), 1)  # auto: 4 simulated devices
        assert dataparallel.data_parallel_devices(dataparallel.Config(devices=4)) == ("cpu", 4)
    assert dataparallel.main(dataparallel.Config(device="cuda", out=str(tmp_path))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dataparallel.py: error: --device cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    dataparallel.validate(dataparallel.Config(device="cuda"), 1)
    with pytest.raises(ValueError, match="needs 8 GPUs and torch sees 4"):
        dataparallel.validate(dataparallel.Config(device="cuda", devices=8), 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    dataparallel.validate(dataparallel.Config(devices=3), 1)
    assert dataparallel.data_parallel_devices(dataparallel.Config()) == ("cuda", 3)
    with pytest.raises(ValueError, match="--device auto: nn.DataParallel needs 4 GPUs and torch "
                                         "sees 3"):
        dataparallel.validate(dataparallel.Config(devices=4), 1)
    with pytest.raises(ValueError, match="--devices must be 0"):
        dataparallel.Config(devices=1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="torch's nn.DataParallel needs 2 GPUs")
@pytest.mark.timeout(120)
def test_real_dataparallel_moves_what_the_simulation_moves():
    """On GPUs the tap wraps torch's own scatter, replicate, parallel_apply and gather: the
    same closed forms hold (the GPU run of the simulation's model)."""
    n = torch.cuda.device_count()
    cfg = replace(dp_config(n, 48), device="cuda")
    model, tap, *_ = dataparallel.train_data_parallel(cfg, "cuda", n)
    chunks = [len(c) for c in torch.arange(48).chunk(n)]
    assert_mechanism(cfg, tap, chunks, [f"cuda:{j}" for j in range(n)])
    reference = reference_history(cfg)[-1]
    assert max_param_diff(model.state_dict(), reference) <= TOL


def test_exercise_4_bytes_per_step():
    """Exercise 4's numbers: the ~100 M-parameter MLP in float64; DataParallel's parameter
    copies created and replica gradients summed per step, (W - 1) · P · 8 bytes each (totals
    over all links, the same with NCCL's ring or without), against DDP's ring all-reduce,
    2(W - 1)/W · P · 8 bytes sent per GPU, 2(W - 1) · P · 8 over all W GPUs."""
    cfg = dataparallel.Config(d_hidden=4096, n_layers=8)
    P = 16 * 4096 + 4096 + 6 * (4096 * 4096 + 4096) + 4096 + 1
    assert counting.n_params(cfg) == P == 100_761_601
    two, eight = (counting.expected_per_step(cfg, w, 8) for w in (2, 8))
    assert two["copied_param_bytes"] == two["summed_grad_bytes"] == P * 8 == 806_092_808
    assert eight["copied_param_bytes"] == eight["summed_grad_bytes"] == 5_642_649_656
    # The lesson's arithmetic for DDP, checked here (no code of the chapter computes it): per
    # GPU on 8, and the total over 8 GPUs, equal to DataParallel's copies plus its reduction.
    assert 2 * (8 - 1) * P * 8 // 8 == 1_410_662_414
    assert 8 * 1_410_662_414 == 2 * 5_642_649_656 == 11_285_299_312
