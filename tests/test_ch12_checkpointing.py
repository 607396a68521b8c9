"""Chapter 12: full-state resume is bit-identical (one process, and several ranks with DCP), DCP
reshards 2 → 1 and 2 → 4, a save killed halfway leaves the previous checkpoint loadable, a delta
is small and exact.

The scripts check themselves (summary.json); this module recomputes the references with its
own code (an uninterrupted training loop, the saved full state compared on 1 and 4 ranks, a
multi-rank resume in new processes compared with the uninterrupted run of another launch) and
runs the negative controls: a resume without the RNG state or the data position, per-rank state
under one DCP key, a loader drawing from the global RNG, a non-atomic save killed halfway, a
plain per-rank torch.save loaded elsewhere, an unfinished DCP folder, lossy deltas.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chapters.ch12_checkpointing import deepspeed_ckpt, resume, resume_dcp, train
from chapters.ch12_checkpointing import delta as deltas
from common.checkpoint import CheckpointError, load_checkpoint
from common.data import regression_data
from common.launch import run_on_ranks, run_python, run_torchrun
from common.models import MLP
from common.seed import seed_everything

SCRIPT, RESUME, RESUME_DCP = Path(train.__file__), Path(resume.__file__), Path(resume_dcp.__file__)


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ch12-dcp")
    return run_torchrun(SCRIPT, nproc=2, out_dir=out, timeout=150)


@pytest.fixture(scope="module")
def resume_dcp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ch12-resume-dcp")
    return run_torchrun(RESUME_DCP, nproc=2, out_dir=out, timeout=150)


def n_params() -> int:
    cfg = train.Config()
    return sum(p.numel() for p in MLP(cfg.d_in, cfg.d_hidden, 1, n_layers=3).parameters())


def _reshard_and_live_step(path: str) -> dict:
    """On each of N ranks: reshard_check, then whether get_state_dict(full) returns Adam's live
    `step` tensor (rank 0: [is it the optimizer's own object, its value after one more step])."""
    out = train.reshard_check(path)
    model, opt = train.build_sharded(train.Config(), torch.device("cpu"))
    data = regression_data(8, train.Config().d_in, 1)
    train.train_steps(model, opt, data, 1)
    _, optim_sd = train.get_state_dict(model, opt, options=train.FULL)
    train.train_steps(model, opt, data, 1)  # the gathered copy of step moves on with training
    if torch.distributed.get_rank() == 0:
        step = optim_sd["state"]["0.weight"]["step"]
        live = opt.state[next(iter(model.parameters()))]["step"]
        out["step_is_live"] = [step is live, step.item()]
    return out


def uninterrupted_losses(cfg: resume.Config) -> list[float]:
    """The reference, written here: one run of cfg.steps steps, no checkpoint anywhere."""
    X, Y = regression_data(cfg.n_samples, 16, 1, seed=cfg.seed)
    model, opt, sched = resume.build(cfg)  # seeds torch, builds model, AdamW, cosine schedule
    per_epoch, losses = cfg.n_samples // cfg.batch_size, []
    for step in range(cfg.steps):
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(cfg.n_samples, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        rows = order[i * cfg.batch_size:(i + 1) * cfg.batch_size]
        loss = F.mse_loss(model(X[rows]), Y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(200)
def test_dcp_script_checks_and_sizes(dcp_run):
    res = dcp_run
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"] and c["kind"] != "timing"]
    assert not failed, res.output[-3000:]
    n = n_params()
    assert n == 32 * 256 + 256 + 256 * 256 + 256 + 256 + 1
    expected = 3 * 4 * n + 6 * 4  # weights + Adam m, v (fp32) + one step scalar per tensor
    assert train.dcp_payload_bytes(res.out_dir / "dcp") == expected
    assert len(list((res.out_dir / "dcp").glob("*.distcp"))) == 2  # one file per rank
    assert res.check("async DCP reload == state at save time")["measured"] == 0
    assert res.check("training moved on during the async writes")["measured"] > 0
    # Same-dtype differences: never wrong where Sterbenz holds, wrong for re-drawn rows.
    assert res.check("fp32 differences: wrong where Sterbenz holds")["measured"] == 0
    assert res.check("fp32 differences of re-drawn rows: wrong elements (> 0)")["measured"] > 0
    # Timings are reported with their spread, each kind warmed up first; never asserted.
    assert len(res.summary["figures"]["blocking save [median, min, max]"]["measured"]) == 3


@pytest.mark.timeout(200)
def test_two_rank_checkpoint_loads_on_one_and_four_ranks(dcp_run):
    path = dcp_run.out_dir / "dcp"
    saved = load_checkpoint(dcp_run.out_dir / "full_state.pt")
    # One process, no process group at all.
    assert train.max_state_diff(train.load_into_one_process(path), saved) == 0
    # The async checkpoint holds the same (pre-async-steps) state.
    assert train.max_state_diff(train.load_into_one_process(dcp_run.out_dir / "dcp_async"), saved) == 0
    # Four ranks: each holds a quarter of every row-sharded tensor, and the gathered whole equals.
    results = run_on_ranks(_reshard_and_live_step, 4, str(path), timeout=150)
    assert results[0]["max_diff"] == 0
    assert [r["shards"]["0.weight"] for r in results] == [64, 64, 64, 64]
    assert [r["shards"]["4.weight"] for r in results] == [1, 0, 0, 0]  # 1 row over 4 ranks
    # What each rank reads (exercise 1): ranks 2 and 3 hold rows 128-255, which rank 1 of the
    # 2-rank run wrote; DCP reads each stored chunk whole, so a quarter costs a half.
    for r in (2, 3):
        assert set(results[r]["reads"]) == {"__1_0.distcp"}, results[r]["reads"]
    shard_bytes = train.expected_bytes(n_params(), 6) / 4
    assert all(sum(r["reads"].values()) > 1.8 * shard_bytes for r in results)
    # Exercise 2: the full state dict hands out Adam's live `step` tensor, not a copy.
    assert results[0]["step_is_live"] == [True, 2.0]
    # Negative controls: a fresh model is not the saved state, and rank 0's plain torch.save of
    # its shards cannot be loaded by one process (half of each tensor, no layout).
    cfg = train.Config()
    torch.manual_seed(cfg.seed)
    fresh = MLP(cfg.d_in, cfg.d_hidden, 1, n_layers=3)
    assert train.max_state_diff(fresh.state_dict(), saved["model"]) > 0
    shard = load_checkpoint(dcp_run.out_dir / "torch_save_per_rank" / "rank0.pt")
    assert shard["0.weight"].shape == (128, 32)
    with pytest.raises(RuntimeError, match="size mismatch"):
        fresh.load_state_dict(shard)


@pytest.mark.timeout(200)
def test_multi_rank_resume_is_bit_exact_and_per_rank_state_needs_its_own_key(resume_dcp_run):
    res = resume_dcp_run
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"] and c["kind"] != "timing"]
    assert not failed, res.output[-3000:]
    losses = load_checkpoint(res.out_dir / "losses.pt")
    assert losses["resumed"] == losses["reference"]  # every rank, every step, bit for bit
    assert losses["reference"][0] != losses["reference"][1]  # the ranks' batches and dropout differ
    # One key for per-rank state: every rank loads the same (one rank's) value.
    one_key = res.summary["figures"]["pos loaded by each rank, one key"]["measured"]
    assert len(set(one_key)) == 1, one_key
    assert res.summary["figures"]["pos loaded by each rank, rank-keyed"]["measured"] == [0, 1]
    # One entry, one kept copy: on the CPU exactly W - 1 ranks got another rank's dropout stream
    # (read off the metadata), and exactly those diverge at once.
    assert res.summary["figures"]["one key: ranks whose rng.torch was stored by another rank"]["measured"] == 1
    differs = res.check("one key: ranks diverging at once = ranks given another's stream")
    assert differs["measured"] == differs["expected"] == 1
    for control in ("resume without RNG", "resume without data position",
                    "loader on the global RNG: resume"):
        assert res.check(f"{control} == uninterrupted (must not)")["measured"] > 0


def _resume_phase(ckpt_dir: str, kill_at: int) -> dict:
    """One start of the job on this rank: resume from the newest complete checkpoint, save every
    4 steps, end at kill_at (a crash) or at the last step."""
    cfg = resume_dcp.Config(ckpt_dir=ckpt_dir, save_every=4, kill_at=kill_at)
    resume.make_deterministic(cfg.deterministic)
    return resume_dcp.run_with_checkpoints(cfg, torch.device("cpu"))


@pytest.mark.timeout(200)
def test_multi_rank_resume_in_new_processes_equals_uninterrupted(resume_dcp_run, tmp_path):
    ckpt = tmp_path / "ck"
    first = run_on_ranks(_resume_phase, 2, str(ckpt), 10, timeout=150)  # saves 4 and 8, dies at 10
    # A save killed before the coordinator wrote .metadata: the folder exists, the save does not.
    (ckpt / "step_000012").mkdir()
    (ckpt / "step_000012" / "__0_0.distcp").write_bytes(b"half a shard")
    assert resume_dcp.latest_complete(ckpt).name == "step_000008"
    second = run_on_ranks(_resume_phase, 2, str(ckpt), 0, timeout=150)  # new processes
    reference = load_checkpoint(resume_dcp_run.out_dir / "losses.pt")["reference"]  # other launch
    for rank in (0, 1):
        assert first[rank]["first_step"] == 0 and first[rank]["losses"] == reference[rank][:10]
        assert second[rank]["first_step"] == 8
        assert second[rank]["losses"] == reference[rank][8:], rank
    # Per-rank RNG and data positions belong to the world that saved them: another world is
    # refused before any rank starts, the same one is not.
    resume_dcp.validate(resume_dcp.Config(ckpt_dir=str(ckpt)), 2)
    with pytest.raises(ValueError, match="saved by 2 ranks"):
        resume_dcp.validate(resume_dcp.Config(ckpt_dir=str(ckpt)), 4)


@pytest.mark.timeout(150)
def test_killed_save_keeps_previous_and_resume_in_new_process_is_bit_identical(tmp_path):
    atomic, naive = tmp_path / "atomic", tmp_path / "naive"
    common_args = ["--steps", "12", "--stop-at", "4", "--save-every", "4"]
    kill = {"CH12_KILL_SAVE_AT_STEP": "8"}
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_python, RESUME, args=[*common_args, "--ckpt-dir", str(d), *extra],
                            out_dir=tmp_path / f"out-{d.name}", env=kill, expect_ok=False, timeout=90)
                for d, extra in ((atomic, []), (naive, ["--naive-save"]))]
        killed = [j.result() for j in jobs]
    assert [r.returncode for r in killed] == [-signal.SIGKILL] * 2, killed[0].output[-2000:]
    # Atomic: step 4 whole and loadable, step 8 never appeared, its partial .tmp is detected.
    assert load_checkpoint(atomic / "step_000004.pt")["step"] == 4
    assert not (atomic / "step_000008.pt").exists()
    tmp_files = list(atomic.glob(".*.tmp"))
    assert len(tmp_files) == 1 and tmp_files[0].stat().st_size == resume.KILL_AFTER_BYTES
    # Negative control: torch.save straight over the file lost the previous checkpoint too.
    with pytest.raises(CheckpointError):
        load_checkpoint(naive / "latest.pt")

    # A new process resumes from step 4 (cleaning the .tmp) and continues bit for bit.
    res = run_python(RESUME, args=[*common_args, "--ckpt-dir", str(atomic)], out_dir=tmp_path / "out2",
                     timeout=90)
    assert res.summary["figures"]["resumed from step"]["measured"] == 4
    assert res.summary["figures"]["incomplete saves found and removed"]["measured"] == 1
    assert not list(atomic.glob(".*.tmp"))
    out = load_checkpoint(tmp_path / "out2" / "losses.pt")
    reference = uninterrupted_losses(resume.Config(steps=12, stop_at=4))
    assert out["first_step"] == 4
    assert out["losses"].tolist() == reference[4:]


def test_resume_needs_rng_and_data_position(tmp_path):
    cfg = resume.Config()
    reference = uninterrupted_losses(cfg)
    X, Y = regression_data(cfg.n_samples, 16, 1, seed=cfg.seed)
    run = resume.new_run(cfg)
    head = resume.train(cfg, run, X, Y, cfg.stop_at)
    assert head == reference[:cfg.stop_at]
    path = resume.save_training_state(tmp_path, resume.training_state(run))
    tails = {}
    for name, rng, data in (("full", True, True), ("rng", False, True), ("data", True, False)):
        torch.manual_seed(12345)  # what a new process's generator holds: anything
        fresh = resume.new_run(cfg)
        resume.restore(fresh, load_checkpoint(path), rng=rng, data=data)
        tails[name] = resume.train(cfg, fresh, X, Y, cfg.steps)
    assert head + tails["full"] == reference
    assert head + tails["rng"] != reference, "dropout masks did not depend on the RNG state"
    assert head + tails["data"] != reference, "the data order did not depend on the position"
    assert resume.Config().steps > cfg.n_samples // cfg.batch_size  # crosses an epoch boundary


def test_latest_checkpoint_skips_and_cleans_incomplete(tmp_path):
    for step in (2, 10):
        resume.save_training_state(tmp_path, {"step": step})
    (tmp_path / ".step_000012.pt.abc.tmp").write_bytes(b"half a file")
    path, incomplete = resume.latest_checkpoint(tmp_path)
    assert path.name == "step_000010.pt" and len(incomplete) == 1
    assert not incomplete[0].exists()
    assert resume.latest_checkpoint(tmp_path / "empty") == (None, [])


def test_delta_is_small_and_exact():
    cfg = train.Config()
    base, new, n_expected = deltas.sparse_finetune(cfg)
    rows_changed = (new["embedding"] != base["embedding"]).any(dim=1).sum().item()
    assert rows_changed == cfg.touched_tokens
    delta = deltas.make_delta(base, new)
    assert sum(d["index"].numel() for d in delta.values()) == rows_changed * 32 == n_expected
    assert deltas.delta_bytes(delta) * 50 < deltas.state_bytes(new)  # 16 KiB vs 1 MiB
    assert torch.equal(deltas.apply_delta(base, delta)["embedding"], new["embedding"])
    # Negative controls: a lossy bf16 difference, and the right delta on the wrong base.
    lossy = deltas.apply_difference_delta(base, deltas.make_difference_delta(base, new))
    assert not torch.equal(lossy["embedding"], new["embedding"])
    other = {"embedding": base["embedding"] + 1}
    assert not torch.equal(deltas.apply_delta(other, delta)["embedding"], new["embedding"])
    # Differences in the same dtype: exact where the subtraction is. Sterbenz's range, checked
    # here in float64 (where every fp32 difference is exact): no inexact difference inside it.
    redrawn = deltas.reinitialised_rows(cfg, base)["embedding"]
    for b32, n32 in ((base["embedding"], new["embedding"]), (base["embedding"], redrawn)):
        inexact = (n32 - b32).double() != n32.double() - b32.double()
        assert not (inexact & deltas.sterbenz(b32, n32)).any()
    assert (inexact & ~deltas.sterbenz(b32, n32)).any()  # the re-drawn rows: some are inexact
    rt = deltas.difference_roundtrip(base["embedding"], redrawn)
    assert rt["wrong_inside"] == 0 and rt["wrong_outside"] > 0
    one, small = torch.tensor(1.0), torch.tensor(0.001)
    assert (small - one) + one != small and (torch.tensor(0.75) - one) + one == 0.75


def test_impossible_settings_are_refused():
    for cls, argv in ((resume.Config, ["--stop-at", "30"]), (resume.Config, ["--batch-size", "7"]),
                      (train.Config, ["--touched-tokens", "9000"]),
                      (resume_dcp.Config, ["--stop-at", "16"]), (resume_dcp.Config, ["--kill-at", "-1"])):
        with pytest.raises(SystemExit) as e:
            train.parse_config(cls, argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:  # one process by design
        train.parse_config(resume.Config, [], validate=resume.validate, world_size=2)
    assert e.value.code == 2


@pytest.mark.timeout(600)
def test_deepspeed_zero_checkpoint_layout_and_zero_to_fp32(tmp_path):
    pytest.importorskip("deepspeed", reason="pip install deepspeed==0.19.8 (requirements.txt)")
    # the first run on a machine compiles DeepSpeed's communication op (~60 s, then cached)
    res = run_torchrun(Path(deepspeed_ckpt.__file__), nproc=2, out_dir=tmp_path, timeout=540)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    scripts = ["latest", "zero_to_fp32.py", "zero_to_torch.py"]
    optim = [f"step3/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    assert res.summary["figures"]["ZeRO-2 files"]["measured"] == sorted(
        scripts + optim + ["step3/mp_rank_00_model_states.pt"])
    assert res.summary["figures"]["ZeRO-3 files"]["measured"] == sorted(
        scripts + optim + [f"step3/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)])
    assert (tmp_path / "zero2" / "latest").read_text().strip() == "step3"
    for stage in (2, 3):
        assert res.check(f"ZeRO-{stage}: zero_to_fp32 state dict == engine parameters at save")["measured"] == 0
        # Recomputed here: convert with DeepSpeed's function in this process, compare with the
        # parameters the engine held at save; negative control: the untrained initial parameters.
        plain = deepspeed_ckpt.convert(tmp_path / f"zero{stage}", "step3")
        saved = load_checkpoint(tmp_path / f"zero{stage}_params.pt")
        assert deepspeed_ckpt.max_diff(plain, saved) == 0
        seed_everything(0)
        initial = dict(MLP(16, 33, 1).named_parameters())
        assert deepspeed_ckpt.max_diff(plain, {n: p.detach() for n, p in initial.items()}) > 1e-3
    with pytest.raises(SystemExit) as e:
        train.parse_config(deepspeed_ckpt.Config, ["--stages", "0"])
    assert e.value.code == 2
