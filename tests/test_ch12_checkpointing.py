"""Chapter 12: full-state resume is bit-identical, DCP reshards 2 → 1 and 2 → 4, a save killed
halfway leaves the previous checkpoint loadable, a delta is small and exact.

The scripts check themselves (summary.json); this module recomputes the references with its
own code (an uninterrupted training loop, the saved full state compared on 1 and 4 ranks) and
runs the negative controls: a resume without the RNG state or the data position, a non-atomic
save killed halfway, a plain per-rank torch.save loaded elsewhere, a lossy delta.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chapters.ch12_checkpointing import deepspeed_ckpt, resume, train
from chapters.ch12_checkpointing import delta as deltas
from common.checkpoint import CheckpointError, load_checkpoint
from common.data import regression_data
from common.launch import run_on_ranks, run_python, run_torchrun
from common.models import MLP
from common.seed import seed_everything

SCRIPT, RESUME = Path(train.__file__), Path(resume.__file__)


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ch12-dcp")
    return run_torchrun(SCRIPT, nproc=2, out_dir=out, timeout=150)


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
    cfg = train.Config()
    n = sum(p.numel() for p in MLP(cfg.d_in, cfg.d_hidden, 1, n_layers=3).parameters())
    assert n == 32 * 256 + 256 + 256 * 256 + 256 + 256 + 1
    expected = 3 * 4 * n + 6 * 4  # weights + Adam m, v (fp32) + one step scalar per tensor
    assert train.dcp_payload_bytes(res.out_dir / "dcp") == expected
    assert len(list((res.out_dir / "dcp").glob("*.distcp"))) == 2  # one file per rank
    assert res.check("async DCP reload == state at save time")["measured"] == 0
    assert res.check("training moved on during the async write")["measured"] > 0


@pytest.mark.timeout(200)
def test_two_rank_checkpoint_loads_on_one_and_four_ranks(dcp_run):
    path = dcp_run.out_dir / "dcp"
    saved = load_checkpoint(dcp_run.out_dir / "full_state.pt")
    # One process, no process group at all.
    assert train.max_state_diff(train.load_into_one_process(path), saved) == 0
    # The async checkpoint holds the same (pre-async-steps) state.
    assert train.max_state_diff(train.load_into_one_process(dcp_run.out_dir / "dcp_async"), saved) == 0
    # Four ranks: each holds a quarter of every row-sharded tensor, and the gathered whole equals.
    results = run_on_ranks(train.reshard_check, 4, str(path), timeout=150)
    assert results[0]["max_diff"] == 0
    assert [r["shards"]["0.weight"] for r in results] == [64, 64, 64, 64]
    assert [r["shards"]["4.weight"] for r in results] == [1, 0, 0, 0]  # 1 row over 4 ranks
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


def test_impossible_settings_are_refused():
    for cls, argv in ((resume.Config, ["--stop-at", "30"]), (resume.Config, ["--batch-size", "7"]),
                      (train.Config, ["--touched-tokens", "9000"])):
        with pytest.raises(SystemExit) as e:
            train.parse_config(cls, argv)
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
