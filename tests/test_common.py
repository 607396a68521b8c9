"""Unit tests of common/: each module's promise, checked."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
import torch.distributed as dist

from common import checkpoint, config, data, distributed, launch, models, results, seed, timing

# --- distributed ------------------------------------------------------------------------------


def test_first_slurm_host():
    assert distributed.first_slurm_host("gpu[07-09,12],cpu1") == "gpu07"
    assert distributed.first_slurm_host("node3") == "node3"
    assert distributed.first_slurm_host("a-b[1,3]") == "a-b1"


def test_read_launch_env_torchrun_slurm_single():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "n0", "MASTER_PORT": "1234"}
    got = distributed.read_launch_env(env)
    assert (got["rank"], got["local_rank"], got["world_size"], got["local_world_size"]) == (3, 1, 8, 2)
    assert (got["master_addr"], got["master_port"], got["launcher"]) == ("n0", 1234, "torchrun")

    slurm = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
             "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[10-11]", "SLURM_JOB_ID": "77"}
    got = distributed.read_launch_env(slurm)
    assert (got["rank"], got["local_rank"], got["world_size"], got["local_world_size"]) == (5, 1, 8, 4)
    assert (got["master_addr"], got["master_port"], got["launcher"]) == ("gpu10", 20077, "slurm")

    got = distributed.read_launch_env({})
    assert (got["rank"], got["world_size"], got["launcher"]) == (0, 1, "single")


def test_read_launch_env_one_process_per_pod_and_indexed_job():
    """Launchers that start `python script.py` in each pod (PyTorchJob, Volcano's pytorch plugin)
    set RANK and WORLD_SIZE but no LOCAL_*: one process per pod, local rank 0 of 1 (chapter 23)."""
    pod = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    got = distributed.read_launch_env(pod)
    assert (got["rank"], got["local_rank"], got["world_size"], got["local_world_size"]) == (3, 0, 4, 1)
    # An indexed Job gives only the pod's index; the manifest sets WORLD_SIZE and MASTER_ADDR.
    indexed = {"JOB_COMPLETION_INDEX": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "j-0.svc", "MASTER_PORT": "29500"}
    got = distributed.read_launch_env(indexed)
    assert (got["rank"], got["local_world_size"], got["master_addr"]) == (2, 1, "j-0.svc")
    # RANK wins over the index; an index without WORLD_SIZE is not a world.
    assert distributed.read_launch_env({**indexed, "RANK": "0"})["rank"] == 0
    assert distributed.read_launch_env({"JOB_COMPLETION_INDEX": "2"})["launcher"] == "single"
    # Launches that read as before chapter 23. srun torchrun (one torchrun per node, srun's
    # variables inherited by its workers): torchrun's LOCAL_WORLD_SIZE wins over srun's 1 task
    # per node, and the worker is not an srun task (4 ranks on 1 GPU are refused, not cuda:0).
    srun_torchrun = {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
                     "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_GPUS_ON_NODE": "4",
                     "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                     "GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_ADDR": "gpu01",
                     "MASTER_PORT": "29500"}
    got = distributed.read_launch_env(srun_torchrun)
    assert (got["rank"], got["local_rank"], got["world_size"], got["local_world_size"], got["launcher"]) \
        == (6, 2, 8, 4, "torchrun")
    assert distributed.choose_device_and_backend(2, 4, gpu_count=4, env=srun_torchrun)[0] == torch.device("cuda", 2)
    with pytest.raises(distributed.DistributedSetupError, match="4 processes on this node but 1 GPU"):
        distributed.choose_device_and_backend(2, 4, gpu_count=1, env=srun_torchrun)
    # LOCAL_RANK without LOCAL_WORLD_SIZE, no Slurm: every rank on this node, as before.
    got = distributed.read_launch_env({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    assert (got["local_rank"], got["local_world_size"]) == (1, 2)
    # srun in a pyxis container with enroot's 50-slurm-pytorch.sh hook: RANK, LOCAL_RANK,
    # WORLD_SIZE, MASTER_* from SLURM_*, no LOCAL_WORLD_SIZE; one GPU bound to each task.
    hook = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)",
            "SLURM_GPUS_ON_NODE": "4", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
            "MASTER_ADDR": "gpu01", "MASTER_PORT": str(4242 % 4536 + 61000)}
    got = distributed.read_launch_env(hook)
    assert (got["rank"], got["local_rank"], got["world_size"], got["local_world_size"]) == (5, 1, 8, 4)
    assert distributed.choose_device_and_backend(1, 4, gpu_count=1, env=hook)[0] == torch.device("cuda", 0)
    assert distributed.choose_device_and_backend(1, 4, gpu_count=4, env=hook)[0] == torch.device("cuda", 1)


def test_choose_device_and_backend_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only choice")
    assert distributed.choose_device_and_backend(0, 2) == (torch.device("cpu"), "gloo")
    with pytest.raises(distributed.DistributedSetupError, match="no CUDA GPU"):
        distributed.choose_device_and_backend(0, 1, device="cuda")
    with pytest.raises(distributed.DistributedSetupError, match="nccl backend needs CUDA"):
        distributed.choose_device_and_backend(0, 1, backend="nccl")
    with pytest.raises(distributed.DistributedSetupError, match="unknown device"):
        distributed.choose_device_and_backend(0, 1, device="tpu")


def test_device_choice_on_gpu_machines_and_slurm():
    """The choices a GPU machine makes, decided from a stated GPU count and environment."""
    choose = distributed.choose_device_and_backend
    cuda = torch.device
    assert choose(3, 8, gpu_count=8, env={}) == (cuda("cuda", 3), "nccl")
    # srun --gpus-per-task=1: every task sees one GPU, its own (no NVLink to the others' GPUs
    # under ConstrainDevices, which is why the course's commands use --gpus-per-node)
    slurm = {"SLURM_PROCID": "5", "SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "5"}
    assert choose(5, 8, gpu_count=1, env=slurm) == (cuda("cuda", 0), "nccl")
    # GPUs asked for, none visible: an error, not a silent CPU run
    for env, device in (({"SLURM_PROCID": "0", "SLURM_GPUS_ON_NODE": "4"}, "auto"), ({}, "cuda")):
        with pytest.raises(distributed.DistributedSetupError, match="sees no CUDA GPU"):
            choose(0, 4, device=device, gpu_count=0, env=env)
    # fewer GPUs than ranks under torchrun: refused under auto and NCCL, shared under gloo
    with pytest.raises(distributed.DistributedSetupError, match="2 GPU"):
        choose(0, 4, gpu_count=2, env={"RANK": "0"})
    with pytest.raises(distributed.DistributedSetupError, match="--backend gloo"):
        choose(1, 2, device="cuda", gpu_count=1, env={"RANK": "1"})
    assert choose(1, 2, device="cuda", backend="gloo", gpu_count=1, env={}) == (cuda("cuda", 0), "gloo")
    assert choose(1, 2, device="cpu", gpu_count=8, env={}) == (cuda("cpu"), "gloo")
    assert choose(0, 2, gpu_count=0, env={}) == (cuda("cpu"), "gloo")


def _agreed_numbers() -> dict:
    rank = dist.get_rank()
    return {
        "device": distributed.comm_device().type,
        "sum": distributed.reduce_number(rank + 1, "sum"),
        "max": distributed.reduce_number(torch.tensor(0.5 * rank), "max"),
        "min": distributed.reduce_number(float(rank), "min"),
        "bcast": distributed.broadcast_number(10.0 + rank, src=1),
        "gather": distributed.gather_numbers(rank * 2),
    }


@pytest.mark.timeout(60)
def test_numbers_agreed_across_ranks():
    got = launch.run_on_ranks(_agreed_numbers, 3)
    for r in got:
        assert r == {"device": "cpu", "sum": 6, "max": 1.0, "min": 0.0, "bcast": 11.0,
                     "gather": [0, 2, 4]}
        assert isinstance(r["sum"], int) and isinstance(r["max"], float)
    with pytest.raises(ValueError, match="op must be one of"):
        distributed.reduce_number(1, "mean")


def _checks_across_ranks(out: str) -> int:
    cfg = _Cfg(out=out)
    rec = results.RunRecorder(cfg, "/x/chapters/ch99_demo/train.py",
                              distributed.DistInfo(dist.get_rank(), dist.get_rank(), 2, 2,
                                                   torch.device("cpu"), "gloo", "torchrun"))
    rank = dist.get_rank()
    rec.check("same on all ranks", "parity", 0.0, 0.0)
    rec.check("fails on rank 1 only", "parity", float(rank), 0.0)  # rank 0 alone would pass
    if rank == 1:
        rec.check("recorded by rank 1 only", "count", 3, 3)
    return rec.finish()


@pytest.mark.timeout(60)
def test_summary_holds_every_ranks_verdict(tmp_path):
    codes = launch.run_on_ranks(_checks_across_ranks, 2, str(tmp_path))
    assert codes == [1, 1]  # every rank exits with the same status
    checks = {c["name"]: c for c in json.loads((tmp_path / "summary.json").read_text())["checks"]}
    assert checks["same on all ranks"]["ok"] and "failed_on_ranks" not in checks["same on all ranks"]
    assert not checks["fails on rank 1 only"]["ok"]
    assert checks["fails on rank 1 only"]["failed_on_ranks"] == [1]
    assert checks["recorded by rank 1 only"]["rank"] == 1 and checks["recorded by rank 1 only"]["ok"]


def _shared_folder(folders: list) -> str:
    from common.checkpoint import require_shared_folder

    try:
        require_shared_folder(folders[dist.get_rank()], "--out")
        return "ok"
    except ValueError as e:
        return str(e)


@pytest.mark.timeout(60)
def test_a_folder_some_rank_cannot_see_is_refused_on_every_rank(tmp_path):
    """Two "nodes" with a local folder each (rank 1 given another path) are refused on both
    ranks in one sentence; one shared folder passes and keeps no probe file."""
    shared = str(tmp_path / "shared")
    assert launch.run_on_ranks(_shared_folder, 2, [shared, shared]) == ["ok", "ok"]
    assert list((tmp_path / "shared").iterdir()) == []
    apart = launch.run_on_ranks(_shared_folder, 2, [shared, str(tmp_path / "node1")])
    assert apart[0] == apart[1] and "ranks 1 do not see rank 0's files" in apart[0]
    assert "\n" not in apart[0]


def test_setup_single_process_world(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    info = distributed.setup_distributed(timeout_s=10)
    try:
        assert (info.rank, info.world_size, info.launcher, info.is_main) == (0, 1, "single", True)
        x = torch.tensor([2.0])
        dist.all_reduce(x)  # a real group of one: collectives work
        assert x.item() == 2.0
    finally:
        distributed.teardown_distributed()
    assert not dist.is_initialized()


# --- config -----------------------------------------------------------------------------------


@dataclass
class _Cfg(config.RunConfig):
    lr: float = 0.1
    """Learning rate."""
    mode: Literal["a", "b"] = "a"
    """Which mode."""
    sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    """Some sizes."""
    shuffle: bool = True
    """Shuffle the data."""

    def __post_init__(self):
        super().__post_init__()
        if self.lr <= 0:
            raise ValueError("--lr must be positive")


@dataclass
class _Undocumented(config.RunConfig):
    x: int = 1


def test_config_flags_types_and_help():
    cfg = config.parse_config(_Cfg, ["--lr", "0.5", "--mode", "b", "--sizes", "3", "4",
                                     "--no-shuffle", "--steps", "7"])
    assert (cfg.lr, cfg.mode, cfg.sizes, cfg.shuffle, cfg.steps) == (0.5, "b", [3, 4], False, 7)
    assert config.parse_config(_Cfg, []) == _Cfg()
    text = config.build_parser(_Cfg).format_help()
    for flag in ("--lr", "--mode", "--sizes", "--shuffle", "--seed", "--out", "--device",
                 "--backend", "--timeout", "--steps", "--tensorboard"):
        assert flag in text
    assert "Learning rate. (default: 0.1)" in " ".join(text.split())


def test_config_rejects_bad_input_with_exit_2(capsys):
    for argv in (["--no-such-flag"], ["--lr", "-1"], ["--mode", "c"], ["--steps", "0"],
                 ["--lr", "abc"]):
        with pytest.raises(SystemExit) as e:
            config.parse_config(_Cfg, argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--lr must be positive" in err and "unrecognized arguments: --no-such-flag" in err
    assert "Traceback" not in err


def _validate(cfg, world_size):
    config.check_global_batch(cfg.steps * 4, world_size)


def test_validate_runs_at_the_launch_world_size(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert config.parse_config(_Cfg, ["--steps", "3"], validate=_validate).steps == 3  # 12 / 3
    with pytest.raises(SystemExit) as e:
        config.parse_config(_Cfg, ["--steps", "2"], validate=_validate)  # 8 / 3
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--global-batch-size 8 must divide into 3 ranks; use a multiple of 3" in err
    assert "world size 3" in err and "Traceback" not in err
    monkeypatch.setenv("RANK", "1")  # other ranks exit as well, without repeating the line
    with pytest.raises(SystemExit):
        config.parse_config(_Cfg, ["--steps", "2"], validate=_validate)
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="into 4 ranks x 2 micro-batches; use a multiple of 8"):
        config.check_global_batch(12, 4, micro_batches=2)


def test_precheck_answers_help_and_refuses_in_one_process(tmp_path):
    import subprocess

    precheck = results.REPO_ROOT / "tools" / "precheck.py"
    script = results.REPO_ROOT / "chapters" / "ch03_data_parallel" / "train.py"

    def run(*args):
        return subprocess.run([sys.executable, str(precheck), str(script), *args],
                              capture_output=True, text=True, timeout=120)

    assert run("2").returncode == 0
    helped = run("2", "--help")
    assert helped.returncode == 10 and helped.stdout.count("usage: train.py") == 1
    typo = run("2", "--bogus")
    assert typo.returncode == 2 and typo.stderr.count("\n") == 1 and "--bogus" in typo.stderr
    if not torch.cuda.is_available():
        nccl = run("2", "--backend", "nccl")
        assert nccl.returncode == 2 and nccl.stderr.count("\n") == 1
        assert "nccl backend needs CUDA" in nccl.stderr


def test_config_requires_documented_fields():
    with pytest.raises(TypeError, match="has no docstring"):
        config.build_parser(_Undocumented)


# --- seed and checkpoint ----------------------------------------------------------------------


def test_rng_state_roundtrip_through_safe_checkpoint(tmp_path):
    import random

    import numpy as np

    seed.seed_everything(3)
    state = seed.capture_rng_state()
    checkpoint.save_checkpoint(tmp_path / "rng.pt", {"rng": state})
    expected = (random.random(), torch.rand(3), np.random.rand(2))
    seed.restore_rng_state(checkpoint.load_checkpoint(tmp_path / "rng.pt")["rng"])
    got = (random.random(), torch.rand(3), np.random.rand(2))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])
    assert (got[2] == expected[2]).all()


def test_checkpoint_atomic_and_clear_errors(tmp_path):
    path = tmp_path / "ck.pt"
    checkpoint.save_checkpoint(path, {"w": torch.arange(3)})

    def crash(f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        checkpoint.atomic_write(path, crash)
    assert torch.equal(checkpoint.load_checkpoint(path)["w"], torch.arange(3))
    assert list(tmp_path.iterdir()) == [path]  # no temporary left behind

    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at"):
        checkpoint.load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    with pytest.raises(checkpoint.CheckpointError, match="truncated or not a checkpoint"):
        checkpoint.load_checkpoint(tmp_path / "bad.pt")


def test_checkpoint_refuses_arbitrary_objects(tmp_path):
    torch.save({"obj": _Cfg()}, tmp_path / "evil.pt")  # would run code on an unsafe load
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load_checkpoint(tmp_path / "evil.pt")


# --- results ----------------------------------------------------------------------------------


def test_recorder_writes_summary_and_metrics(tmp_path):
    cfg = _Cfg(out=str(tmp_path))
    rec = results.RunRecorder(cfg, "/x/chapters/ch99_demo/train.py")
    rec.metrics(1, loss=torch.tensor(0.5), lr=0.1)
    rec.figure("busbw", measured=0.9, expected=1.0, unit="GB/s")
    rec.figure("step time", measured=2.0, unit="ms", spread=(1.5, 3.0))
    assert rec.check("equal", "parity", measured=1e-13, expected=0.0, tolerance=1e-12)
    assert not rec.check("slow", "timing", measured=2.0, expected=1.0, tolerance=0.1, relative=True)
    assert rec.finish() == 0  # a failed timing check is not fatal
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"chapter", "script", "world_size", "backend", "device", "versions",
                            "config", "figures", "checks"}
    assert (summary["chapter"], summary["script"]) == ("ch99_demo", "train")
    assert summary["figures"]["busbw"] == {"measured": 0.9, "expected": 1.0, "unit": "GB/s"}
    assert summary["figures"]["step time"]["spread"] == [1.5, 3.0]
    assert [c["ok"] for c in summary["checks"]] == [True, False]
    assert set(summary["checks"][0]) >= {"name", "kind", "measured", "expected", "compare",
                                         "tolerance", "ok"}
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["step"] == 1 and line["loss"] == 0.5 and line["lr"] == 0.1 and "time_s" in line


def test_table_fits_100_columns(tmp_path, capsys):
    from common import log as course_log

    course_log.setup_logging(rank=0, world_size=1)
    rec = results.RunRecorder(_Cfg(out=str(tmp_path)), "train.py")
    long_name = "a check whose name is much longer than any table column could hold in one line"
    rec.figure("per-rank step times", [1.25, 2.5, 3.75, 4.125, 5.0, 6.0, 7.0, 8.0], unit="ms")
    rec.figure("peak", 1e11, unit="FLOP/s")
    rec.check(long_name, "parity", 1e-13, 0.0, 1e-12)
    rec.check("bound", "formula", 0.5, [0.25, 0.75], compare="between")
    rec.print_table()
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(len(line) for line in lines) <= results.TABLE_WIDTH
    text = " ".join(" ".join(line.split()) for line in lines)
    assert long_name in text or all(w in text for w in long_name.split())
    assert "in [0.25, 0.75]" in text and "[1.25, 2.5, 3.75, 4…" in text


def test_recorder_fails_on_a_failed_parity_check(tmp_path):
    rec = results.RunRecorder(_Cfg(out=str(tmp_path)), "train.py")
    rec.check("counted", "count", measured=3, expected=4)
    assert rec.finish() == 1
    with pytest.raises(ValueError):
        rec.check("x", "vibes", 1, 1)


def test_check_ok():
    assert results.check_ok(2.0, 1.0, compare=">") and not results.check_ok(1.0, 1.0, compare=">")
    assert results.check_ok(1.0, 1.0, compare="<=") and not results.check_ok(1.0, 1.0, compare="<")
    assert results.check_ok(0.5, [0.0, 1.0], compare="between")
    assert not results.check_ok(1.5, [0.0, 1.0], compare="between")
    assert not results.check_ok(float("inf"), 0.0, compare=">")
    with pytest.raises(ValueError, match="needs numbers"):
        results.check_ok(1.0, "> 0", compare=">")
    assert results.check_ok(1.05, 1.0, 0.1, relative=True)
    assert not results.check_ok(1.2, 1.0, 0.1, relative=True)
    assert not results.check_ok(float("nan"), 0.0, 1.0)
    assert results.check_ok([1, 2], [1, 2]) and not results.check_ok(True, False)


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rec = results.RunRecorder(_Cfg(out=str(tmp_path), tensorboard=True), "train.py")
    for step in range(3):
        rec.metrics(step, loss=1.0 / (step + 1))
    rec.finish()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [round(e.value, 4) for e in acc.Scalars("loss")] == [1.0, 0.5, 0.3333]


def test_tensorboard_writer_is_public_on_the_main_rank_only(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert results.RunRecorder(_Cfg(out=str(tmp_path / "off")), "train.py").tensorboard_writer is None
    info = distributed.DistInfo(1, 1, 2, 2, torch.device("cpu"), "gloo", "torchrun")
    assert results.RunRecorder(_Cfg(out=str(tmp_path / "rank1"), tensorboard=True), "train.py",
                               info).tensorboard_writer is None  # only the main rank writes
    rec = results.RunRecorder(_Cfg(out=str(tmp_path), tensorboard=True), "train.py")
    rec.tensorboard_writer.add_scalars("compute_ms", {"rank0": 1.0, "rank1": 31.0}, 0)
    rec.metrics(0, loss=0.5)
    rec.finish()
    acc = EventAccumulator(str(tmp_path / "tb" / "compute_ms_rank1"))  # add_scalars: one run per series
    acc.Reload()
    assert [e.value for e in acc.Scalars("compute_ms")] == [31.0]


# --- models and data --------------------------------------------------------------------------


def test_models_shapes_and_tied_embeddings():
    assert models.MLP(4, 8, 2, n_layers=3)(torch.randn(5, 4)).shape == (5, 2)
    assert models.SmallCNN()(torch.randn(2, 3, 16, 16)).shape == (2, 4)
    cfg = models.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, d_model=8)
    gpt = models.TinyGPT(cfg)
    idx = torch.randint(0, 11, (2, 8))
    targets = idx.clone()
    targets[:, -2:] = -100
    logits, loss = gpt(idx, targets)
    assert logits.shape == (2, 8, 11) and loss.ndim == 0
    assert gpt.head.weight is gpt.tok_emb.weight
    assert models.count_params(gpt) == sum(p.numel() for p in gpt.parameters())
    with pytest.raises(ValueError, match="not divisible"):
        models.GPTConfig(d_model=10, n_head=4)


def test_gpt_is_causal():
    torch.manual_seed(0)
    gpt = models.TinyGPT(models.GPTConfig(vocab_size=7, block_size=6, n_layer=1, n_head=1, d_model=8))
    a = torch.tensor([[1, 2, 3, 4, 5, 6]])
    b = torch.tensor([[1, 2, 3, 0, 0, 0]])
    assert torch.allclose(gpt(a)[:, :3], gpt(b)[:, :3])


def test_data_is_deterministic_and_offline():
    X1, Y1 = data.regression_data(seed=1)
    X2, Y2 = data.regression_data(seed=1)
    assert torch.equal(X1, X2) and torch.equal(Y1, Y2)
    X, y = data.classification_data(n=64, n_classes=3)
    assert X.shape == (64, 16) and set(y.tolist()) <= {0, 1, 2}
    imgs, labels = data.procedural_images(n=16, size=12)
    assert imgs.shape == (16, 3, 12, 12) and 0 <= imgs.min() and imgs.max() <= 1
    text = data.text_corpus()
    assert len(text) > 400_000 and "for" in text
    tok = data.CharTokenizer.fit(text[:5000])
    assert tok.decode(tok.encode("the loop")) == "the loop"
    assert tok.decode(tok.encode("\u2603")) == "?"
    x, y = data.token_windows(tok.encode(text[:5000]), block_size=16, n=4)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_tokenizer_save_load(tmp_path):
    tok = data.CharTokenizer.fit("hello world")
    tok.save(tmp_path / "tok.json")
    assert data.CharTokenizer.load(tmp_path / "tok.json").chars == tok.chars


# --- timing -----------------------------------------------------------------------------------


def test_benchmark_protocol():
    calls = []
    stats = timing.benchmark(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5 and stats.repeats == 3 and stats.min <= stats.median <= stats.max
    assert stats.threads == torch.get_num_threads()
    assert timing.throughput(10, 2.0) == 5.0
    assert timing.mfu(1e9, 1.0, 2e9) == 0.5
    assert timing.matmul_peak_flops(n=128, repeats=2) > 0


def test_peak_flops_datasheet_on_gpus_measured_on_cpu():
    assert timing.datasheet_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert timing.datasheet_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert timing.datasheet_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert timing.datasheet_peak_flops("NVIDIA L4", torch.bfloat16) == 121e12
    assert timing.datasheet_peak_flops("Tesla V100-SXM2-32GB", torch.bfloat16) is None
    assert timing.datasheet_peak_flops("Some Future GPU", torch.float32) is None
    peak, source = timing.peak_flops("cpu", torch.float32, matmul_size=128)
    assert peak > 0 and source.startswith("measured 128x128 matmul")


# --- launch helpers ---------------------------------------------------------------------------


def _rank_sum() -> tuple[int, float]:
    x = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(x)
    return dist.get_rank(), x.item()


def _rank_fails() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.barrier()  # rank 0 waits on a dead peer: must not hang the test


@pytest.mark.timeout(60)
def test_run_on_ranks_results_and_failures():
    assert launch.run_on_ranks(_rank_sum, 3) == [(0, 6.0), (1, 6.0), (2, 6.0)]
    with pytest.raises(AssertionError, match="rank 1 broke on purpose"):
        launch.run_on_ranks(_rank_fails, 2, timeout=30)


SCRIPT = '''
import sys, time
from dataclasses import dataclass
import torch, torch.distributed as dist
from common.config import RunConfig, parse_config
from common.distributed import setup_distributed, teardown_distributed
from common.results import RunRecorder

@dataclass
class Config(RunConfig):
    sleep: float = 0.0
    """Seconds to sleep."""

def main(cfg):
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        rec = RunRecorder(cfg, "/x/chapters/ch00_demo/hello.py", info)
        x = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(x)
        time.sleep(cfg.sleep)
        n = info.world_size
        rec.check("all-reduce sum", "parity", x.item(), n * (n + 1) / 2)
        return rec.finish()
    finally:
        teardown_distributed()

if __name__ == "__main__":
    sys.exit(main(parse_config(Config)))
'''


@pytest.mark.timeout(90)
def test_run_torchrun_and_timeout(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(SCRIPT)
    res = launch.run_torchrun(script, nproc=2, timeout=60)
    assert res.returncode == 0 and res.summary["world_size"] == 2
    assert res.check("all-reduce sum")["ok"] and res.summary["backend"] == "gloo"
    with pytest.raises(launch.LaunchError, match="timed out"):
        launch.run_python(script, args=["--sleep", "30"], timeout=8)


def test_packages_import_only_torch_and_stdlib():
    """common/ imports nothing beyond torch and the standard library at module level."""
    import ast
    import pathlib

    allowed = set(sys.stdlib_module_names) | {"torch", "common", "__future__"}
    for path in pathlib.Path(config.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name} at module level"
    assert os.path.basename(launch.__file__) == "launch.py"


def test_facades_re_export_the_same_objects():
    """checkpoint, results and log re-export names that live in smaller modules: the very same
    objects, so `except common.checkpoint.CheckpointError` catches what common.files raises."""
    from common import check_table, checkpoint_dcp, errors, files, log, manifest, paths

    same = [(checkpoint.CheckpointError, errors.CheckpointError),
            (checkpoint.FolderInUseError, errors.FolderInUseError),
            (checkpoint.atomic_write, files.atomic_write), (checkpoint.lock_folder, files.lock_folder),
            (checkpoint.verify_manifest, manifest.verify_manifest),
            (checkpoint.save_dcp, checkpoint_dcp.save_dcp), (log.one_line_errors, errors.one_line_errors),
            (results.check_ok, check_table.check_ok), (results.REPO_ROOT, paths.REPO_ROOT),
            (results.default_out_dir, paths.default_out_dir)]
    assert all(a is b for a, b in same)


def test_data_build_writes_corpus_tokens_and_tokenizer(tmp_path):
    import runpy

    import numpy as np

    build = runpy.run_path(str(results.REPO_ROOT / "data" / "build.py"))["build"]
    paths = build(tmp_path)
    tok = data.CharTokenizer.load(paths["tokenizer"])
    tokens = np.fromfile(paths["tokens"], dtype=np.int16)
    text = paths["corpus"].read_text()
    assert len(tokens) == len(text) and tok.decode(tokens[:200]) == text[:200]


# --- log --------------------------------------------------------------------------------------


def test_logging_is_rank_aware(capsys):
    from common import log as course_log

    course_log.setup_logging(rank=1, world_size=2)
    course_log.log.info("hidden")
    course_log.log.warning("shown")
    course_log.setup_logging(rank=1, world_size=2, all_ranks=True)
    course_log.log.info("everyone")
    course_log.setup_logging(rank=0, world_size=2)
    course_log.log.info("main")
    out = capsys.readouterr().out.splitlines()
    assert out == ["[rank 1] shown", "[rank 1] everyone", "main"]


def test_progress_logs_plain_lines_off_a_terminal(capsys):
    from common import log as course_log

    course_log.setup_logging(rank=0, world_size=1)
    assert list(course_log.progress(range(25), total=25, desc="train", every=10)) == list(range(25))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["train 10/25", "train 20/25", "train 25/25"]
    assert list(course_log.progress(range(3), enabled=False)) == [0, 1, 2]
    assert capsys.readouterr().out == ""


def test_require_at_least_one_names_the_flag():
    cfg = _Cfg(steps=3)
    config.require_at_least_one(cfg, "steps", "log_every")
    cfg.log_every = 0
    with pytest.raises(ValueError, match="^--log-every must be at least 1$"):
        config.require_at_least_one(cfg, "steps", "log_every")


@pytest.mark.timeout(120)
def test_a_script_started_directly_refuses_a_missing_device_in_one_line():
    """Without ./course's precheck: `python train.py --device cuda` on a machine without a GPU
    (or `--backend nccl` on a CPU) ends in one sentence and exit 2, not a setup traceback."""
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    script = results.REPO_ROOT / "chapters" / "ch03_data_parallel" / "train.py"
    for option, said in ((["--device", "cuda"], "--device cuda, but torch sees no CUDA GPU"),
                         (["--backend", "nccl"], "the nccl backend needs CUDA devices")):
        done = subprocess.run([sys.executable, str(script), *option], capture_output=True,
                              text=True, timeout=100)
        assert done.returncode == 2 and said in done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_test_doubles_decide_like_the_recorder():
    from common.testing import Verdicts, rank_info

    rec = Verdicts()
    assert rec.check("copy", "parity", 1.0, 1.0) is True
    assert rec.check("off by 1e-9", "parity", 1.0 + 1e-9, 1.0, tolerance=1e-12) is False
    assert rec.check("bound", "formula", 3, 2, compare="<=") is False
    assert rec.failed() == ["bound", "off by 1e-9"] and rec.measured["bound"] == 3
    assert rank_info(0, 2).is_main and not rank_info(1, 2).is_main
    assert rank_info(1, 2).device.type == "cpu" and rank_info(1, 2).local_world_size == 2



def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


SLEEPER = """import os, sys, time
open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w").write(str(os.getpid()))
time.sleep(120)
"""


def _rank_pids(folder: Path, proc) -> list[int]:
    """Wait until both ranks of the sleeper have written their pids, and read them."""
    def written():
        return len([p for p in folder.glob("rank*") if p.read_text()]) == 2

    launch.wait_until(written, proc, "both ranks", timeout=90)
    return [int(p.read_text()) for p in folder.glob("rank*")]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
@pytest.mark.timeout(120)
def test_started_torchrun_leaves_no_rank_behind(tmp_path):
    """torchrun starts each rank in a session of its own: killing torchrun's process group leaves
    the ranks running (the control); leaving `launch.started` kills them too."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    for how in ("group", "started"):
        (tmp_path / how).mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(tmp_path / "sleeper.py"), str(tmp_path / how)]
        with launch.started(cmd) as proc:
            pids = _rank_pids(tmp_path / how, proc)
            if how == "group":  # the control: torchrun's process group alone
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                time.sleep(0.5)
                survivors = [p for p in pids if _alive(p)]
                for p in survivors:
                    os.kill(p, signal.SIGKILL)
                assert len(survivors) == 2, "torchrun's process group held its ranks: control void"
        time.sleep(0.5)
        assert not [p for p in pids if _alive(p)], f"{how}: ranks left running"


def test_a_notebook_replays_a_run_the_session_recorded_and_a_test_never_does(tmp_path, monkeypatch):
    """common.launch records each successful launch (COURSE_RUN_RECORD); with COURSE_RUN_REPLAY
    (a notebook's kernel under the tests) the same command gets that run's folder and console,
    paths moved to its own folder; another command, or a launch without replay, runs for real."""
    script = tmp_path / "draw.py"
    script.write_text("import json, os, sys\nout = sys.argv[sys.argv.index('--out') + 1]\n"
                      "os.makedirs(out, exist_ok=True)\nvalue = os.urandom(8).hex()\n"
                      "json.dump({'value': value, 'args': sys.argv[3:]}, open(out + '/summary.json', 'w'))\n"
                      "print('wrote', value, 'to', out)\n")
    monkeypatch.setenv("COURSE_RUN_RECORD", str(tmp_path / "record"))
    monkeypatch.delenv("COURSE_RUN_REPLAY", raising=False)
    (tmp_path / "record").mkdir()
    first = launch.run_python(script, ["--x", "1"], out_dir=tmp_path / "a")
    again = launch.run_python(script, ["--x", "1"], out_dir=tmp_path / "b")  # a test: real
    assert first.summary["value"] != again.summary["value"]
    monkeypatch.setenv("COURSE_RUN_REPLAY", str(tmp_path / "record"))
    replay = launch.run_python(script, ["--x", "1"], out_dir=tmp_path / "c")
    assert replay.summary == first.summary and replay.returncode == 0
    assert replay.output == first.output.replace(str(tmp_path / "a"), str(tmp_path / "c"))
    other = launch.run_python(script, ["--x", "2"], out_dir=tmp_path / "d")  # another command
    assert other.summary["value"] != first.summary["value"] and other.summary["args"] == ["--x", "2"]
    with_env = launch.run_python(script, ["--x", "1"], out_dir=tmp_path / "e", env={"K": "1"})
    assert with_env.summary["value"] != first.summary["value"]
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "checkpoint").touch()  # a folder a script could resume from: run for real
    assert launch.run_python(script, ["--x", "1"], out_dir=tmp_path / "f").summary != first.summary
    # a failed run is never recorded: the same command replayed runs again, and fails again
    failing = tmp_path / "fail.py"
    failing.write_text("import sys\nprint('failing')\nsys.exit(1)\n")
    monkeypatch.delenv("COURSE_RUN_REPLAY")
    assert launch.run_python(failing, out_dir=tmp_path / "g", expect_ok=False).returncode == 1
    monkeypatch.setenv("COURSE_RUN_REPLAY", str(tmp_path / "record"))
    assert launch.run_python(failing, out_dir=tmp_path / "h", expect_ok=False).returncode == 1


# --- checkpoints that cannot lie (common/checkpoint.py) ----------------------------------------

def _flip(path: Path, offset: int, n: int = 16) -> None:
    """Overwrite n bytes at `offset` with their complement (a damaged sector, a bad copy)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _member_offset(path: Path, suffix: str) -> int:
    """Where the bytes of the zip member ending in `suffix` start (a tensor's storage)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:  # local header: 30 bytes + name + extra field
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_len + extra_len


def test_flipped_bytes_load_silently_in_torch_and_are_caught_by_their_crc(tmp_path):
    """`torch.load` never checks the CRC-32s of its zip members: 16 flipped bytes of a weight
    load as other weights. `load_checkpoint` checks them first and names the member; a
    truncated file is named too. The control: the intact file loads and verifies."""
    path = tmp_path / "w.pt"
    w = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    checkpoint.save_checkpoint(path, {"w": w})
    assert torch.equal(checkpoint.load_checkpoint(path)["w"], w)
    _flip(path, _member_offset(path, "data/0") + 64)
    silently = torch.load(path, weights_only=True)["w"]  # the problem: no error, other numbers
    assert not torch.equal(silently, w)
    with pytest.raises(checkpoint.CheckpointError, match=r"w\.pt is damaged: member .*data/0 fails"):
        checkpoint.load_checkpoint(path)
    checkpoint.save_checkpoint(path, {"w": w})
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(checkpoint.CheckpointError, match="truncated or not a checkpoint"):
        checkpoint.load_checkpoint(path)


def _folder_checkpoint(folder: Path, step: int) -> Path:
    folder.mkdir(parents=True)
    for name in ("a.bin", "b.bin"):
        (folder / name).write_bytes(bytes([step]) * 1000)
    checkpoint.write_manifest(folder, {n: checkpoint.file_entry(folder / n) for n in ("a.bin", "b.bin")},
                              step=step)
    return folder


def test_newest_verified_falls_back_past_every_kind_of_damage(tmp_path, caplog):
    """Five checkpoints, the newest four damaged four ways (flipped bytes, truncated, a missing
    file, a torn manifest) and one never finished: the walk takes the oldest, naming each one
    it skipped; with that one damaged too it refuses in one line; with none it returns None."""
    folders = [_folder_checkpoint(tmp_path / f"step{s}", s) for s in range(1, 6)]
    before = (folders[0] / "a.bin").read_bytes()
    _flip(folders[4] / "a.bin", 100)
    os.truncate(folders[3] / "b.bin", 10)
    (folders[2] / "a.bin").unlink()
    (folders[1] / checkpoint.MANIFEST).write_text('{"format": 1, "files": {"a.b')
    unfinished = tmp_path / "step6"
    unfinished.mkdir()
    (unfinished / "a.bin").write_bytes(b"x")
    with caplog.at_level("WARNING", logger="course"):
        got, manifest = checkpoint.newest_verified([*folders, unfinished], checkpoint.verify_manifest)
    assert got == folders[0] and manifest["step"] == 1
    assert (folders[0] / "a.bin").read_bytes() == before  # the one used is untouched
    reasons = [r.getMessage() for r in caplog.records]
    assert len(reasons) == 5
    for needle in ("a save that did not finish", "SHA-256 differs", "10 bytes, its manifest says 1000",
                   "in the manifest but missing", "torn or not a manifest"):
        assert sum(needle in r for r in reasons) == 1, (needle, reasons)
    _flip(folders[0] / "b.bin", 0)
    with pytest.raises(checkpoint.CheckpointError, match="none of the 6 checkpoints verifies"):
        checkpoint.newest_verified([*folders, unfinished], checkpoint.verify_manifest)
    assert checkpoint.newest_verified([], checkpoint.verify_manifest) == (None, None)
    outside = _folder_checkpoint(tmp_path / "evil", 7)
    checkpoint.write_manifest(outside, {"../step1/a.bin": checkpoint.file_entry(folders[0] / "a.bin")})
    with pytest.raises(checkpoint.CheckpointError, match="outside the folder"):
        checkpoint.verify_manifest(outside)


MARKER_PICKLE = """
import os, pickle, sys
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
pickle.dump(Evil(), open(sys.argv[1], "wb"))
"""


def _dcp_on_ranks(folder: str, marker: str) -> dict:
    """Save an FSDP2 model, optimizer, scheduler and plain values with save_dcp; verify; load
    into a model built from another seed; damage one rank's shard; read a crafted .metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def build(seed_):
        torch.manual_seed(seed_)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        fully_shard(m)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        return m, o, torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)

    rank, out = dist.get_rank(), {}
    m, o, s = build(0)
    m(torch.randn(4, 8)).sum().backward()
    o.step()
    s.step()
    msd, osd = get_state_dict(m, o)
    shapes = checkpoint.training_shapes(m, o)
    state = {"model": msd, "optim": osd, "scheduler": s.state_dict(), "progress": {"step": 7, "pos": [3, 1]}}
    checkpoint.save_dcp(state, Path(folder) / "good", run_id="r1", step=7, shapes=shapes)
    manifest = checkpoint.verify_dcp(Path(folder) / "good")
    out["files"] = sorted(manifest["files"])
    m2, o2, s2 = build(1)
    msd2, osd2 = get_state_dict(m2, o2)
    target = {"model": msd2, "optim": osd2, "scheduler": s2.state_dict(), "progress": {"step": 0, "pos": [0, 0]}}
    checkpoint.check_identity(manifest, "r1", checkpoint.training_shapes(m2, o2), "good")
    checkpoint.load_dcp(target, Path(folder) / "good")
    set_state_dict(m2, o2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    out["weights_equal"] = all(torch.equal(a.to_local(), b.to_local())
                               for a, b in zip(m.parameters(), m2.parameters()))
    out["progress"] = target["progress"]
    out["last_epoch"] = target["scheduler"]["last_epoch"]
    # a damaged shard: rank 1's file, damaged by rank 1; both ranks must refuse, with one verdict
    dcp.save({"x": torch.arange(1000.0) + rank}, checkpoint_id=str(Path(folder) / "raw"))  # no manifest
    checkpoint.save_dcp(state, Path(folder) / "bad", run_id="r1", step=8, shapes=shapes)
    if rank == dist.get_world_size() - 1:
        _flip(Path(folder) / "bad" / f"__{rank}_0.distcp", 200)
    dist.barrier()
    for name in ("bad", "raw"):
        try:
            checkpoint.verify_dcp(Path(folder) / name)
            out[name] = None
        except checkpoint.CheckpointError as e:
            out[name] = (str(e), e.collective)
    if rank == 0:
        (Path(folder) / "evil").mkdir()
        import subprocess

        subprocess.run([sys.executable, "-c", MARKER_PICKLE, str(Path(folder) / "evil" / ".metadata"),
                        marker], check=True)
    dist.barrier()
    for what, call in (("read", lambda: checkpoint.read_dcp_metadata(Path(folder) / "evil")),
                       ("load", lambda: checkpoint.load_dcp({"x": torch.zeros(1)}, Path(folder) / "evil"))):
        try:
            call()
            out[what] = None
        except checkpoint.CheckpointError as e:
            out[what] = str(e)
    # a manifest that leaves out a shard the metadata points to (re-sealed: its own entries verify)
    if rank == 0:
        import shutil

        shutil.copytree(Path(folder) / "good", Path(folder) / "unlisted")
        manifest = checkpoint.read_manifest(Path(folder) / "unlisted")
        del manifest["files"]["__1_0.distcp"]
        checkpoint.write_manifest(Path(folder) / "unlisted", manifest.pop("files"), **manifest)
    dist.barrier()
    try:
        checkpoint.verify_dcp(Path(folder) / "unlisted")
        out["unlisted"] = None
    except checkpoint.CheckpointError as e:
        out["unlisted"] = str(e)
    return out


@pytest.mark.timeout(120)
def test_dcp_saved_with_a_manifest_verified_and_loaded_safely(tmp_path):
    """On 2 ranks: save_dcp writes every rank's shard and a manifest naming all of them; the
    load restores weights, optimizer, scheduler and plain values (the planner's weights_only
    path) into another seed's model; one rank's damaged shard is refused on both ranks with one
    verdict; a folder without a manifest is unfinished; a crafted .metadata whose pickle would
    create a marker file is refused by the reader and by the load, and the marker never appears.
    Then 1 rank verifies and loads the 2-rank checkpoint (a resharded load)."""
    marker = tmp_path / "PWNED"
    got = launch.run_on_ranks(_dcp_on_ranks, 2, str(tmp_path), str(marker), timeout=100)
    for r in got:
        assert r["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert r["weights_equal"] and r["progress"] == {"step": 7, "pos": [3, 1]} and r["last_epoch"] == 1
        assert r["bad"] == (f"{tmp_path}/bad/__1_0.distcp does not match its manifest "
                            "(SHA-256 differs: damaged or changed)", True)
        assert "a save that did not finish" in r["raw"][0]
        assert "posix.system is not allowed in DCP metadata" in r["read"]
        assert "posix.system is not allowed" in r["load"]
        assert r["unlisted"] == f"{tmp_path}/unlisted: __1_0.distcp is read by a load but not in its manifest"
    assert not marker.exists()
    one = launch.run_on_ranks(_load_resharded, 1, str(tmp_path / "good"), timeout=60)
    assert one == [{"step": 7, "params": 8 * 16 + 16 + 16 + 1}]


# BUILD on the class pathlib.PosixPath itself: with C's unpickler, every later Path in the process
# reads "/tmp/evil" (open(), torch.save() of any path would go there): a rewrite, not a call.
REWRITE_PATHLIB = b"\x80\x02cpathlib\nPosixPath\nN}X\x04\x00\x00\x00_strX\t\x00\x00\x00/tmp/evils\x86b."


def test_restricted_unpickler_sets_state_on_dcp_instances_only(tmp_path):
    """Restricting the globals is not enough: pickle's BUILD sets attributes on whatever is on
    the stack, an allowed class included. The control: C's unpickler, given the same 50 bytes,
    rewrites pathlib.PosixPath for the whole process (checked in a child process). The safe
    reader refuses them, and a .metadata that is not a Metadata (None, a dict) in one line."""
    import pickle
    import subprocess

    control = subprocess.run([sys.executable, "-c", "import pickle, pathlib, sys; "
                              f"pickle.loads({REWRITE_PATHLIB!r}); print(pathlib.Path('/x/y'))"],
                             capture_output=True, text=True, timeout=60)
    assert control.stdout.strip() == "/tmp/evil"
    for payload, reason in ((REWRITE_PATHLIB, "may not set state on type"),
                            (pickle.dumps(None), "it holds a NoneType"),
                            (pickle.dumps({"storage_data": {}}), "it holds a dict")):
        (tmp_path / ".metadata").write_bytes(payload)
        with pytest.raises(checkpoint.CheckpointError, match=reason):
            checkpoint.read_dcp_metadata(tmp_path)
    assert str(Path("/x/y")) == "/x/y"


def _load_resharded(folder: str) -> dict:
    import torch.distributed.checkpoint as dcp  # noqa: F401 (registers the planner modules)
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    fully_shard(m)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    manifest = checkpoint.verify_dcp(folder)
    checkpoint.check_identity(manifest, "r1", checkpoint.training_shapes(m, o), folder)
    msd, _ = get_state_dict(m, o)
    state = {"model": msd, "progress": {"step": 0, "pos": [0, 0]}}
    checkpoint.load_dcp(state, folder)
    return {"step": state["progress"]["step"], "params": sum(p.numel() for p in m.parameters())}


def test_run_identity_refuses_another_run_or_model(tmp_path):
    rid = checkpoint.run_id(tmp_path)
    assert len(rid) == 12 and checkpoint.run_id(tmp_path) == rid  # kept across restarts
    assert checkpoint.run_id(tmp_path / "other") != rid
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    saved = {"run_id": rid, "shapes": checkpoint.training_shapes(model, opt)}
    checkpoint.check_identity(saved, rid, checkpoint.training_shapes(model, opt), "ck")
    with pytest.raises(checkpoint.CheckpointError, match=f"ck belongs to run '{rid}', not to this run 'x"):
        checkpoint.check_identity(saved, "x" * 12, saved["shapes"], "ck")
    wider = torch.nn.Linear(4, 3)
    with pytest.raises(checkpoint.CheckpointError, match=r"model\.bias is \[3\] here, \[2\] in the checkpoint"):
        checkpoint.check_identity(saved, rid, checkpoint.training_shapes(wider, opt), "ck")
    sgd = torch.optim.SGD(model.parameters())
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.kind is SGD here, AdamW"):
        checkpoint.check_identity(saved, rid, checkpoint.training_shapes(model, sgd), "ck")


HOLD_LOCK = ("import sys, time; from common.checkpoint import lock_folder; "
             "lock_folder(sys.argv[1]); print('locked', flush=True); time.sleep(60)")


def test_lock_refuses_a_second_holder_and_dies_with_its_process(tmp_path):
    """A folder locked by another process is refused, naming that process; SIGKILL releases it
    (the kernel drops a dead process's flock), so a restarted run takes it at once."""
    import subprocess

    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, cwd=results.REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(results.REPO_ROOT)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(checkpoint.FolderInUseError, match=f"in use by another run \\(pid {holder.pid} on"):
            checkpoint.lock_folder(tmp_path, "--out", wait_s=0.5)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    checkpoint.lock_folder(tmp_path, "--out", wait_s=0)
    checkpoint.lock_folder(tmp_path, "--out", wait_s=0)  # re-entrant in one process
    checkpoint.unlock_folder(tmp_path)


def test_out_must_be_a_writable_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--out .*file is a file, not a folder"):
        checkpoint.check_writable_folder(tmp_path / "file", "--out")
    with pytest.raises(ValueError, match="is not a folder this run can write"):
        checkpoint.check_writable_folder(tmp_path / "file" / "sub", "--ckpt-dir")
    checkpoint.check_writable_folder(tmp_path / "new" / "deeper", "--out")
    assert (tmp_path / "new" / "deeper").is_dir()


FAULTS = """
import sys
from dataclasses import dataclass
from common.checkpoint import CheckpointError
from common.config import RunConfig, parse_config

cfg = parse_config(dataclass(type("Config", (RunConfig,), {})))
raise CheckpointError("/x/step_000008.pt is damaged: member archive/data/0 fails its CRC-32 check")
"""


@pytest.mark.timeout(120)
def test_faults_end_in_one_line(tmp_path, monkeypatch, capsys):
    """A run's file faults end as one line naming the file (DCP's CheckpointException unwrapped
    to its first rank's error); a collective error is said by rank 0 alone; a bug keeps its
    traceback. End to end: a script's CheckpointError is its only line on stderr, exit 1, and
    --out that is a file is refused before anything starts."""
    import errno
    import subprocess

    from torch.distributed.checkpoint.api import CheckpointException

    from common.log import one_line_errors

    # Python's own hook underneath (an in-process init_process_group earlier in the session
    # leaves torch's "[rank0]:" wrapper installed)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    one_line_errors("demo.py")

    def said(error, rank="0") -> list[str]:
        monkeypatch.setenv("RANK", rank)
        try:
            raise error
        except BaseException as e:  # noqa: BLE001 (CheckpointException is a BaseException)
            sys.excepthook(type(e), e, e.__traceback__)
        return capsys.readouterr().err.strip().splitlines()

    full = OSError(errno.ENOSPC, "No space left on device", "/full/__1_0.distcp")
    assert said(OSError(errno.ENOSPC, "No space left on device", "/full/metrics.jsonl")) == [
        "demo.py: error: No space left on device: /full/metrics.jsonl"]
    assert said(CheckpointException("boom", {1: (full, None), 3: (full, None)})) == [
        "demo.py: error: failed on ranks 1, 3: No space left on device: /full/__1_0.distcp"]
    collective = checkpoint.CheckpointError("none of the 2 checkpoints verifies", collective=True)
    assert said(collective, rank="1") == []
    assert said(collective) == ["demo.py: error: none of the 2 checkpoints verifies"]
    assert said(checkpoint.CheckpointError("rank 3's own file", collective=False), rank="3") == [
        "demo.py: error (rank 3): rank 3's own file"]
    lines = said(KeyError("a bug keeps its traceback"))
    assert lines[0].startswith("Traceback") and lines[-1].startswith("KeyError")

    script = tmp_path / "faults.py"
    script.write_text(FAULTS)
    env = {**os.environ, "PYTHONPATH": str(results.REPO_ROOT)}
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert (done.returncode, done.stderr.strip()) == (1, "faults.py: error: /x/step_000008.pt is "
                                                         "damaged: member archive/data/0 fails its CRC-32 check")
    (tmp_path / "afile").write_text("")
    done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "afile")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert (done.returncode, done.stderr.strip()) == (2, f"faults.py: error: --out {tmp_path}/afile is a "
                                                         "file, not a folder")


TWO_RUNS = """
import sys, time
from dataclasses import dataclass
from pathlib import Path
from common.config import RunConfig, parse_config
from common.distributed import setup_distributed, teardown_distributed
from common.results import RunRecorder

@dataclass
class Config(RunConfig):
    until: str = ""
    \"\"\"Log a metrics line every 0.05 s until this file exists.\"\"\"

def main(cfg):
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        rec = RunRecorder(cfg, __file__, info)
        step = 0
        while step < cfg.steps or (cfg.until and not Path(cfg.until).exists()):
            rec.metrics(step, loss=1.0 / (step + 1))
            step += 1
            time.sleep(0.05)
        rec.check("ran", "count", step >= cfg.steps, True)
        return rec.finish()
    finally:
        teardown_distributed()

if __name__ == "__main__":
    sys.exit(main(parse_config(Config)))
"""


@pytest.mark.timeout(180)
def test_a_second_run_on_the_same_out_is_refused_and_the_first_is_intact(tmp_path):
    """Two runs on one --out used to interleave metrics.jsonl: now a second run, one process or
    two ranks under the course's launcher, is refused in one line naming the first's pid (the
    two-rank one: that line and the launcher's summary, no traceback from the other rank), and
    the first's metrics and library log are whole. When the first has ended, the folder is free."""
    import socket
    import subprocess

    script = tmp_path / "two.py"
    script.write_text(TWO_RUNS)
    out, release = tmp_path / "out", tmp_path / "release"
    env = {**os.environ, "PYTHONPATH": str(results.REPO_ROOT), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, str(script), "--out", str(out), "--steps", "3",
                              "--until", str(release)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.1)
        (out / "library.log").write_text("the first run's library log\n")
        refusal = (f"two.py: error: --out {out} is in use by another run (pid {first.pid} on "
                   f"{socket.gethostname()}): wait for it to end, or give this run another --out")
        second = subprocess.run([sys.executable, str(script), "--out", str(out)],
                                capture_output=True, text=True, timeout=60, env=env)
        assert (second.returncode, second.stderr.strip().splitlines()) == (1, [refusal])
        ranks = subprocess.run([sys.executable, str(results.REPO_ROOT / "tools" / "torchrun.py"),
                                "--standalone", "--nproc_per_node=2", str(script), "--out", str(out)],
                               capture_output=True, text=True, timeout=90, env=env)
        assert ranks.returncode == 1
        assert ranks.stderr.strip().splitlines() == [
            refusal, f"course: {script} failed: rank 0 exited with code 1 first; torchrun then "
                     "stopped 1 other rank. Its own messages are above."]
        assert first.poll() is None, "the first run must still be running"
        assert (out / "library.log").read_text() == "the first run's library log\n"
    finally:
        release.write_text("")
    assert first.wait(timeout=60) == 0, first.stderr.read()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps))) and len(steps) >= 3
    again = subprocess.run([sys.executable, str(script), "--out", str(out), "--steps", "2"],
                           capture_output=True, text=True, timeout=60, env=env)
    assert again.returncode == 0, again.stderr


@pytest.mark.timeout(60)
def test_a_full_disk_is_named_and_leaves_the_previous_checkpoint(tmp_path):
    """A save onto a full file system (a 256 KiB tmpfs) raises one CheckpointError naming the
    file; no temporary is left and the previous checkpoint still verifies and loads."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("this machine refuses to mount a tmpfs (a container without CAP_SYS_ADMIN)")
    try:
        small = {"w": torch.arange(1000.0)}
        checkpoint.save_checkpoint(disk / "step_1.pt", small)
        with pytest.raises(checkpoint.CheckpointError,
                           match=f"cannot write {disk}/step_2.pt: No space left on device"):
            checkpoint.save_checkpoint(disk / "step_2.pt", {"w": torch.zeros(1_000_000)})
        assert sorted(p.name for p in disk.iterdir()) == ["step_1.pt"]
        assert torch.equal(checkpoint.load_checkpoint(disk / "step_1.pt")["w"], small["w"])
    finally:
        subprocess.run(["umount", str(disk)], check=True)
