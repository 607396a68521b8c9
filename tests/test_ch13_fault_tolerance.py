"""Chapter 13: a killed rank, a torchrun restart, a bit-exact resume; a hung peer becomes an error.

The faulted torchrun run is compared with an undisturbed run this module computes itself (plain
loop, one process playing both ranks), so a bug shared by the script and its checks still fails.
The negative controls resume without the optimizer state, the RNG state or the data position and
must land elsewhere. Two torchrun agents with `--nnodes=1:2` lose one node and the survivor
finishes at world 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch13_fault_tolerance import hang, train
from common.checkpoint import load_checkpoint
from common.config import parse_config
from common.data import regression_data
from common.distributed import free_port
from common.launch import REPO_ROOT, run_on_ranks, run_torchrun
from common.models import MLP

SCRIPT, HANG = Path(train.__file__), Path(hang.__file__)


def undisturbed_reference(cfg: train.Config, world: int = 2) -> dict:
    """Data-parallel SGD with momentum, written out by hand: each 'rank' has its own noise stream
    and its contiguous slice of the reshuffled-every-epoch sample order."""
    X, Y = regression_data(cfg.n_samples, 8, 1, seed=cfg.seed, dtype=torch.float64)
    torch.manual_seed(cfg.seed)
    model = MLP(8, 32, 1).double()
    params = list(model.parameters())
    momentum = [torch.zeros_like(p) for p in params]
    rng = []
    for r in range(world):
        torch.manual_seed(cfg.seed + 1 + r)
        rng.append(torch.get_rng_state())
    per_step = world * cfg.batch_size
    epochs = cfg.steps * per_step // cfg.n_samples + 1
    order = torch.cat([torch.randperm(cfg.n_samples, generator=torch.Generator().manual_seed(
        cfg.seed * 1000 + e)) for e in range(epochs)])
    for step in range(cfg.steps):
        grad_sum = None
        for r in range(world):
            start = step * per_step + r * cfg.batch_size
            idx = order[start:start + cfg.batch_size]
            torch.set_rng_state(rng[r])
            x = X[idx] + cfg.noise * torch.randn(cfg.batch_size, 8, dtype=torch.float64)
            rng[r] = torch.get_rng_state()
            loss = ((model(x) - Y[idx]) ** 2).mean()
            g = torch.autograd.grad(loss, params)
            grad_sum = g if grad_sum is None else [a + b for a, b in zip(grad_sum, g)]
        with torch.no_grad():
            for p, g, m in zip(params, grad_sum, momentum):
                m.mul_(cfg.momentum).add_(g / world)
                p.sub_(cfg.lr * m)
    return model.state_dict()


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(150)
def test_killed_rank_restarts_and_resumes_to_the_same_parameters(tmp_path):
    # PET_MAX_RESTARTS is torchrun's --max-restarts; no TORCH_DISABLE_SHARE_RDZV_TCP_STORE here:
    # the restarted group forms thanks to common.distributed's PrefixStore alone.
    res = run_torchrun(SCRIPT, nproc=2, args=["--fail-rank", "1", "--fail-step", "7"], timeout=120,
                       out_dir=tmp_path, env={"PET_MAX_RESTARTS": "2"})
    assert "injected fault at step 7" in res.output
    assert res.summary["figures"]["restarts (TORCHELASTIC_RESTART_COUNT)"]["measured"] == 1
    assert res.check("resumed from the last committed checkpoint")["measured"] == 5
    assert res.check("replicas identical (max |dparam| across ranks)")["ok"]
    saved = load_checkpoint(tmp_path / "final_params.pt")
    assert saved["restarts"] == 1 and saved["start"] == 5
    expected = undisturbed_reference(train.Config())
    assert max_diff(saved["model"], expected) <= 1e-12  # bitwise in practice (0.0 measured)


def _metric_lines(path: Path) -> list[dict]:
    """The complete lines of metrics.jsonl so far (the writer may be mid-line)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n")]


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun starts its workers in their own
    sessions, so killing the agent's process group would leave the worker running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, i = [pid], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    for p in tree:  # collected first: a killed parent's children are re-parented at once
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start_node(out: Path, port: int, is_host: bool, log_file: Path) -> subprocess.Popen:
    """One torchrun agent ("node") of an elastic 1:2 job, in its own session. Node A hosts
    the c10d store (it must outlive node B); short keep-alive and last-call timeouts make the
    survivor give up on the dead node in seconds instead of ~50 s."""
    conf = (f"is_host={int(is_host)},last_call_timeout=10,keep_alive_interval=2,"
            "keep_alive_max_attempt=3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
           "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "--rdzv-id=ch13test", f"--rdzv-conf={conf}", str(SCRIPT), "--out", str(out),
           "--device", "cpu", "--steps", "30", "--step-seconds", "0.3", "--log-every", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with open(log_file, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                start_new_session=True)


@pytest.mark.timeout(240)
def test_elastic_run_survives_losing_a_node(tmp_path):
    out, port = tmp_path / "run", free_port()
    logs = {n: tmp_path / f"node{n}.log" for n in "AB"}
    nodes = {"A": _start_node(out, port, True, logs["A"])}
    nodes["B"] = _start_node(out, port, False, logs["B"])
    try:
        deadline, before = time.monotonic() + 120, []
        while not any(m["step"] >= 7 and m["world"] == 2 for m in before):  # past checkpoint 5
            assert time.monotonic() < deadline, "the 2-node world never got to step 7"
            assert nodes["A"].poll() is None and nodes["B"].poll() is None, "a node ended early"
            time.sleep(0.2)
            before = _metric_lines(out / "metrics.jsonl")
        assert {m["world"] for m in before} == {2}
        _kill_tree(nodes["B"].pid)  # node B loses power: its agent and its worker
        assert nodes["A"].wait(timeout=150) == 0, logs["A"].read_text()[-6000:]
    finally:
        for proc in nodes.values():
            _kill_tree(proc.pid)
            proc.wait()
    log_a = logs["A"].read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1
    assert summary["figures"]["restarts (TORCHELASTIC_RESTART_COUNT)"]["measured"] >= 1
    start = summary["figures"]["resumed from step"]["measured"]
    assert start >= 5 and start % 5 == 0, start  # a committed checkpoint of the world of 2
    after = _metric_lines(out / "metrics.jsonl")  # rewritten by the survivor's new rank 0
    assert after[0]["step"] == start and after[-1]["step"] == 29
    assert {m["world"] for m in after} == {1}, log_a[-3000:]
    assert "world 1 on cpu/gloo" in log_a and f"resumed from step {start}" in log_a


class _Info:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")


def _resume_controls(folder: str) -> dict:
    """On 2 gloo ranks: undisturbed, then crash at step 7 and resume with each kind of restore."""
    info = _Info(dist.get_rank(), dist.get_world_size())
    cfg = train.Config(steps=12)
    clean = train.train(cfg, info, Path(folder, "clean"))["model"].state_dict()
    out = {}
    for name, restore in [("full", train.STATE_PARTS), ("no optimizer", ("model", "rng", "data")),
                          ("no rng", ("model", "optimizer", "data")),
                          ("no data position", ("model", "optimizer", "rng"))]:
        ckpt = Path(folder, name.replace(" ", "_"))
        train.train(cfg, info, ckpt, stop_at=7)  # the crash: steps 5 and 6 are lost
        resumed = train.train(dataclasses.replace(cfg, restore=restore), info, ckpt)
        out[name] = (resumed["start"], max_diff(resumed["model"].state_dict(), clean))
    out["reference"] = max_diff(clean, undisturbed_reference(cfg))
    return out


@pytest.mark.timeout(90)
def test_resume_needs_optimizer_rng_and_data_position():
    with tempfile.TemporaryDirectory() as folder:
        res = run_on_ranks(_resume_controls, 2, folder, timeout=60)[0]
    assert res["reference"] <= 1e-12
    assert res["full"] == (5, 0.0), res
    for broken in ("no optimizer", "no rng", "no data position"):
        start, diff = res[broken]
        assert start == 5 and diff > 1e-6, f"resuming with {broken} went unnoticed: {res}"


@pytest.mark.timeout(90)
def test_hung_peer_becomes_a_timeout_error_naming_it(tmp_path):
    # The launch's own timeout (60 s) fails this test if the run hangs instead of failing.
    res = run_torchrun(HANG, nproc=2, args=["--timeout", "3"], timeout=60, out_dir=tmp_path,
                       expect_ok=False)
    assert res.returncode != 0
    assert "error: rank 1 stopped responding: all_reduce timed out" in res.output
    assert res.check("all_reduce raised a timeout error")["ok"]
    assert res.check("monitored_barrier names the hung rank")["measured"] == [1]
    assert "failed to pass monitoredBarrier" in res.summary["figures"]["monitored_barrier error"]["measured"]


def test_impossible_settings_are_refused(capsys):
    for argv in (["--fail-rank", "1"], ["--fail-rank", "1", "--fail-step", "50"],
                 ["--restore", "optimizer"], ["--ckpt-every", "0"]):
        with pytest.raises(SystemExit) as e:
            parse_config(train.Config, argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        parse_config(hang.Config, ["--hang-rank", "0"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 5 and all("error:" in line for line in lines)
