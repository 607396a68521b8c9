"""Chapter 13: a killed rank, a torchrun restart, a bit-exact resume; a crash during a save;
a checkpoint that a larger world resumes; an elastic job that grows and shrinks; a hung peer
becomes an error.

The faulted runs are compared with an undisturbed run this module computes itself (plain loop,
one process playing every rank, the world size changing where the job's did), so a bug shared by
the script and its checks still fails. The negative controls resume without the optimizer state,
the RNG state or the data position and must land elsewhere; a per-rank file read by a rank that
did not exist when it was written fails. Two torchrun agents with `--nnodes=1:2`: node A alone,
node B joins (world 2), node B is killed, node A finishes at world 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch13_fault_tolerance import hang, train
from common.checkpoint import CheckpointError, load_checkpoint
from common.config import parse_config
from common.data import regression_data
from common.distributed import free_port
from common.launch import REPO_ROOT, kill_tree, run_on_ranks, run_torchrun
from common.models import MLP
from common.testing import rank_info

SCRIPT, HANG = Path(train.__file__), Path(hang.__file__)


def undisturbed_reference(cfg: train.Config, world: int = 2, resized: tuple = ()) -> dict:
    """Data-parallel SGD with momentum, written out by hand: each 'rank' has its own noise stream
    and its contiguous slice of the reshuffled-every-epoch sample order (a global cursor).
    `resized` = ((step, new world), ...): from that step on the world has another size, and every
    rank's stream starts again from seed + 1 + rank + step * 2**20."""
    X, Y = regression_data(cfg.n_samples, 8, 1, seed=cfg.seed, dtype=torch.float64)
    torch.manual_seed(cfg.seed)
    model = MLP(8, 32, 1).double()
    params = list(model.parameters())
    momentum = [torch.zeros_like(p) for p in params]

    def streams(world: int, step: int) -> list:
        out = []
        for r in range(world):
            torch.manual_seed(cfg.seed + 1 + r + step * 2**20)
            out.append(torch.get_rng_state())
        return out

    rng, cursor, sizes = streams(world, 0), 0, dict(resized)
    epochs = cfg.steps * max([world, *sizes.values()]) * cfg.batch_size // cfg.n_samples + 1
    order = torch.cat([torch.randperm(cfg.n_samples, generator=torch.Generator().manual_seed(
        cfg.seed * 1000 + e)) for e in range(epochs)])
    for step in range(cfg.steps):
        if step in sizes:
            world = sizes[step]
            rng = streams(world, step)
        grad_sum = None
        for r in range(world):
            start = cursor + r * cfg.batch_size
            idx = order[start:start + cfg.batch_size]
            torch.set_rng_state(rng[r])
            x = X[idx] + cfg.noise * torch.randn(cfg.batch_size, 8, dtype=torch.float64)
            rng[r] = torch.get_rng_state()
            loss = ((model(x) - Y[idx]) ** 2).mean()
            g = torch.autograd.grad(loss, params)
            grad_sum = g if grad_sum is None else [a + b for a, b in zip(grad_sum, g)]
        cursor += world * cfg.batch_size
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


class _MetricLog:
    """Every metrics.jsonl line seen while polling. Each new rank 0 (after a restart or a resize)
    starts the file afresh, so the lines of earlier attempts survive only here."""

    def __init__(self, path: Path):
        self.path, self.lines = path, []

    def poll(self) -> list[dict]:
        if self.path.exists():
            for line in self.path.read_text().splitlines(keepends=True):
                if line.endswith("\n"):  # the writer may be mid-line
                    m = json.loads(line)
                    key = (m["world"], m["restart"], m["step"])
                    if key not in {(x["world"], x["restart"], x["step"]) for x in self.lines}:
                        self.lines.append(m)
        return self.lines

    def wait_for(self, pred, nodes: dict, what: str, timeout: float = 120) -> dict:
        """The first line satisfying `pred`; fails if a node ends early or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            hit = next((m for m in self.poll() if pred(m)), None)
            if hit is not None:
                return hit
            assert time.monotonic() < deadline, f"never saw {what}: {self.lines[-5:]}"
            assert all(p.poll() is None for p in nodes.values()), f"a node ended before {what}"
            time.sleep(0.2)


ELASTIC_STEPS = 60


def _start_node(out: Path, port: int, is_host: bool, log_file: Path) -> subprocess.Popen:
    """One torchrun agent ("node") of an elastic 1:2 job, in its own session. Node A hosts
    the c10d store (it must outlive node B); short keep-alive and last-call timeouts make the
    survivor give up on the dead node in seconds instead of ~50 s."""
    conf = (f"is_host={int(is_host)},last_call_timeout=3,keep_alive_interval=1,"
            "keep_alive_max_attempt=3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
           "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "--rdzv-id=ch13test", f"--rdzv-conf={conf}", str(SCRIPT), "--out", str(out),
           "--device", "cpu", "--steps", str(ELASTIC_STEPS), "--step-seconds", "0.2",
           "--log-every", "1"]
    # A fresh store per rendezvous round: without it, growing 1 -> 2 failed in the agents
    # themselves (both waited for the new round's MASTER_ADDR / role_info keys; torch 2.14.1).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with open(log_file, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                start_new_session=True)


@pytest.mark.timeout(300)
def test_elastic_run_grows_then_survives_losing_a_node(tmp_path):
    out, port = tmp_path / "run", free_port()
    logs = {n: tmp_path / f"node{n}.log" for n in "AB"}
    metrics = _MetricLog(out / "metrics.jsonl")
    nodes = {"A": _start_node(out, port, True, logs["A"])}
    try:
        # Node A alone (world 1) gets past its first checkpoint (step 5).
        metrics.wait_for(lambda m: m["world"] == 1 and m["step"] >= 6, nodes, "world 1 at step 6")
        # Node B joins: A's agent sees a node waiting, stops its worker, and both form world 2,
        # which resumes from world 1's last checkpoint.
        nodes["B"] = _start_node(out, port, False, logs["B"])
        grown = metrics.wait_for(lambda m: m["world"] == 2, nodes, "world 2")
        # World 2 commits a checkpoint of its own, then node B loses power.
        metrics.wait_for(lambda m: m["world"] == 2 and m["step"] >= grown["step"] + 6, nodes,
                         "world 2 past a checkpoint of its own")
        kill_tree(nodes.pop("B").pid)
        assert nodes["A"].wait(timeout=150) == 0, logs["A"].read_text()[-6000:]
    finally:
        for proc in nodes.values():
            kill_tree(proc.pid)
            proc.wait()
    lines, log_a = metrics.poll(), logs["A"].read_text()
    worlds = [m["world"] for m in lines]
    phases = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert phases == [1, 2, 1], phases
    # A node joining is a membership change, not a restart: the count moves only when B dies.
    seen = list(dict.fromkeys((m["world"], m["restart"]) for m in lines))
    assert seen == [(1, 0), (2, 0), (1, 1)], seen
    grew = next(m["step"] for m in lines if m["world"] == 2)
    shrunk = next(m["step"] for i, m in enumerate(lines) if m["world"] == 1 and 2 in worlds[:i])
    assert grew >= 5 and grew % 5 == 0, grew  # resumed from a checkpoint world 1 committed
    assert shrunk > grew and shrunk % 5 == 0, shrunk  # ... and from one world 2 committed
    both = log_a + logs["B"].read_text()  # world 2's rank 0 may be node B's worker
    assert "world 1 -> 2: noise streams re-derived" in both
    assert "world 2 -> 1: noise streams re-derived" in log_a
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["figures"]["resumed from step"]["measured"] == shrunk
    assert lines[-1]["step"] == ELASTIC_STEPS - 1


def _job(folder: str, cfg_args: dict) -> dict:
    """train.train on this rank (of a world that run_on_ranks started), checkpoints in `folder`."""
    info = rank_info(dist.get_rank(), dist.get_world_size())
    res = train.train(train.Config(**cfg_args), info, Path(folder))
    return {"start": res["start"], "model": res["model"].state_dict()}


@pytest.mark.timeout(150)
def test_crash_during_a_save_keeps_the_last_checkpoint_and_a_larger_world_resumes(tmp_path):
    ckpt, steps = tmp_path / "ckpt", 16
    # World 1: checkpoint 5 is committed; the process dies halfway through writing checkpoint 10.
    with pytest.raises(AssertionError, match="gave no result"):
        run_on_ranks(_job, 1, str(ckpt), dict(steps=steps, fail_rank=0, fail_step=10, fail_in="save"),
                     timeout=60)
    assert (ckpt / "latest").read_text() == "5"
    assert not (ckpt / "step000010" / "state.pt").exists()
    assert len(list((ckpt / "step000010").glob(".state.pt.*.tmp"))) == 1  # the half-written file
    # Negative control (this chapter's first layout, one file per rank): rank 1 of a larger
    # world has no file of its own, so a per-rank read fails.
    with pytest.raises(CheckpointError, match="rng1.pt"):
        load_checkpoint(ckpt / "step000005" / "rng1.pt")
    # World 2 resumes from the committed step 5 and ends where the hand-written reference does.
    out = run_on_ranks(_job, 2, str(ckpt), dict(steps=steps), timeout=60)
    assert [o["start"] for o in out] == [5, 5]
    assert max_diff(out[0]["model"], out[1]["model"]) == 0
    cfg = train.Config(steps=steps)
    assert max_diff(out[0]["model"], undisturbed_reference(cfg, 1, resized=((5, 2),))) <= 1e-12
    assert max_diff(out[0]["model"], undisturbed_reference(cfg, 1)) > 1e-6  # the world did change


def _resume_controls(folder: str) -> dict:
    """On 2 gloo ranks: undisturbed, then crash at step 7 and resume with each kind of restore."""
    info = rank_info(dist.get_rank(), dist.get_world_size())
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
    # The failure is the timeout's: not before it (the deadline starts inside the call), and not
    # much after. A fixed deadline, not CPU work, sets this time, so the band is asserted here.
    waited = res.summary["figures"]["seconds until all_reduce failed"]["measured"]
    assert 3 <= waited <= 6, waited
    # Negative control: timing only the launch (what a host clock around NCCL measures) falls
    # outside the band, so the check would reject it.
    assert res.summary["figures"]["launch-only timing of an all-reduce (no wait)"]["measured"] < 3
    assert res.check("launch-only timing inside [T, 2T] (must not)")["measured"] == 0


def test_impossible_settings_are_refused(capsys):
    for argv in (["--fail-rank", "1"], ["--fail-rank", "1", "--fail-step", "50"],
                 ["--restore", "optimizer"], ["--ckpt-every", "0"],
                 ["--fail-rank", "1", "--fail-step", "7", "--fail-in", "save"]):
        with pytest.raises(SystemExit) as e:
            parse_config(train.Config, argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        parse_config(hang.Config, ["--hang-rank", "0"])
    assert e.value.code == 2
    # What depends on the world size is refused before any rank starts.
    for module, argv, world in ((train, ["--fail-rank", "2", "--fail-step", "7"], 2), (hang, [], 1)):
        with pytest.raises(SystemExit) as e:
            parse_config(module.Config, argv, validate=module.validate, world_size=world)
        assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 8 and all("error:" in line for line in lines), lines


def test_young_daly_arithmetic():
    """The lesson's numbers: 1 000 nodes of MTBF 1 000 days fail every 24 h as a job; a 30 s
    save then wants a checkpoint every sqrt(2 x 30 s x 86 400 s) = 2 277 s, about 38 minutes."""
    mtbf = 1000 * 86400 / 1000
    assert mtbf == 24 * 3600
    interval = train.young_daly_interval(30, mtbf)
    assert round(interval) == 2277 and round(interval / 60) == 38
    # Its point: the interval minimises saving + expected lost work, t_c/tau + tau/(2M).
    def overhead(tau):
        return 30 / tau + tau / (2 * mtbf)
    assert overhead(interval) < min(overhead(interval * 0.8), overhead(interval * 1.25))
