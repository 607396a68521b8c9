"""Chapter 13: a killed rank, a torchrun restart, a bit-exact resume; a crash during a save;
a checkpoint that a larger world resumes; an elastic job that grows and shrinks; a hung peer
becomes an error; a damaged checkpoint is skipped for the previous one (or refused when none
verifies), another run's is refused, and two runs never share a folder.

The faulted runs are compared with an undisturbed run this module computes itself (plain loop,
one process playing every rank, the world size changing where the job's did), so a bug shared by
the script and its checks still fails. The negative controls resume without the optimizer state,
the RNG state or the data position and must land elsewhere; a per-rank file read by a rank that
did not exist when it was written fails. Two torchrun agents with `--nnodes=1:2`: node A alone,
node B joins (world 2), node B is killed, node A finishes at world 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from chapters.ch13_fault_tolerance import checkpoints, hang, train
from common.checkpoint import MANIFEST, CheckpointError, load_checkpoint, lock_folder, unlock_folder
from common.config import parse_config
from common.data import regression_data
from common.distributed import free_port
from common.launch import REPO_ROOT, kill_tree, run_on_ranks, run_torchrun
from common.log import log
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
    survivor give up on the dead node in seconds instead of ~50 s. An explicit `--ckpt-dir`:
    its lock (global rank 0's) must not refuse the job's own nodes, nor a restarted rank 0."""
    conf = (f"is_host={int(is_host)},last_call_timeout=3,keep_alive_interval=1,"
            "keep_alive_max_attempt=3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
           "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "--rdzv-id=ch13test", f"--rdzv-conf={conf}", str(SCRIPT), "--out", str(out),
           "--ckpt-dir", str(out / "elastic_ckpt"), "--device", "cpu", "--steps", str(ELASTIC_STEPS), "--step-seconds", "0.2",
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
    assert (out / "elastic_ckpt" / "latest").read_text() == str(ELASTIC_STEPS)
    assert not (out / "ckpt").exists() and "in use by another run" not in both


def _job(folder: str, cfg_args: dict) -> dict:
    """train.train on this rank (of a world that run_on_ranks started), checkpoints in `folder`."""
    info = rank_info(dist.get_rank(), dist.get_world_size())
    res = train.train(train.Config(**cfg_args), info, Path(folder))
    return {"start": res["start"], "model": res["model"].state_dict()}


CRASH_STEPS = 16


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


def _two_ranks(root: str, disk: str) -> dict:
    """Everything this module asks of 2 in-process gloo ranks, in one start (each costs seconds):
    world 2 resuming the checkpoints of the crashed world 1, the resume controls, the faults
    (`disk`: a small tmpfs, or "" where none could be mounted)."""
    return {"larger world": _job(str(Path(root, "crash")), dict(steps=CRASH_STEPS)),
            "controls": _resume_controls(str(Path(root, "controls"))),
            "faults": _fault_cases(str(Path(root, "faults")), disk)}


def small_disk(folder: Path, size: str = "256k") -> str | None:
    """Mount a tmpfs of `size` at `folder`; None (and why) where this machine will not."""
    folder.mkdir()
    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root (CI runs as root)"
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                      capture_output=True).returncode != 0:
        return "this machine refuses to mount a tmpfs (a container without CAP_SYS_ADMIN)"
    return None


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """World 1 dies halfway through writing checkpoint 10 (what its folder then holds is
    recorded), then one start of 2 ranks runs `_two_ranks`: per-rank results."""
    root = tmp_path_factory.mktemp("ch13")
    ckpt = root / "crash"
    with pytest.raises(AssertionError, match="gave no result"):
        run_on_ranks(_job, 1, str(ckpt), dict(steps=CRASH_STEPS, fail_rank=0, fail_step=10,
                                              fail_in="save"), timeout=60)
    crashed = {"latest": (ckpt / "latest").read_text(),
               "state.pt": (ckpt / "step000010" / "state.pt").exists(),
               "manifest": (ckpt / "step000010" / MANIFEST).exists(),
               "half-written": len(list((ckpt / "step000010").glob(".state.pt.*.tmp")))}
    # Negative control (this chapter's first layout, one file per rank): rank 1 of a larger
    # world has no file of its own, so a per-rank read fails.
    try:
        load_checkpoint(ckpt / "step000005" / "rng1.pt")
        crashed["per-rank read"] = "read"
    except CheckpointError as e:
        crashed["per-rank read"] = str(e)
    disk = root / "disk"
    no_disk = small_disk(disk)
    try:
        ranks = run_on_ranks(_two_ranks, 2, str(root), "" if no_disk else str(disk), timeout=100)
    finally:
        if not no_disk:
            subprocess.run(["umount", str(disk)], check=True)
    return {"crashed": crashed, "root": root, "no disk": no_disk, "ranks": ranks}


@pytest.mark.timeout(200)
def test_crash_during_a_save_keeps_the_last_checkpoint_and_a_larger_world_resumes(two_ranks):
    # World 1: checkpoint 5 is committed; the process died halfway through writing checkpoint 10.
    crashed = two_ranks["crashed"]
    assert crashed["latest"] == "5" and not crashed["state.pt"] and not crashed["manifest"]
    assert crashed["half-written"] == 1  # the half-written file
    assert "rng1.pt" in crashed["per-rank read"]
    # World 2 resumes from the committed step 5 and ends where the hand-written reference does.
    out = [r["larger world"] for r in two_ranks["ranks"]]
    assert [o["start"] for o in out] == [5, 5]
    assert max_diff(out[0]["model"], out[1]["model"]) == 0
    cfg = train.Config(steps=CRASH_STEPS)
    assert max_diff(out[0]["model"], undisturbed_reference(cfg, 1, resized=((5, 2),))) <= 1e-12
    assert max_diff(out[0]["model"], undisturbed_reference(cfg, 1)) > 1e-6  # the world did change


@pytest.mark.timeout(200)
def test_resume_needs_optimizer_rng_and_data_position(two_ranks):
    res = two_ranks["ranks"][0]["controls"]
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


FAULT_CFG = dict(steps=15)  # saves steps 5 and 10, "crashes" at 12; a resume ends at 15


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def shas(folder: Path) -> dict:
    return {p.name: sha(p) for p in sorted(Path(folder).iterdir())}


def flip_weight_bytes(path: Path, n: int = 16) -> None:
    """XOR `n` bytes in the middle of the first layer's weight inside a `torch.save` archive
    (found by its bytes), leaving the archive's structure alone: only a checksum can tell."""
    data = bytearray(path.read_bytes())
    weight = torch.load(path, weights_only=True)["model"]["0.weight"].numpy().tobytes()
    at = data.find(weight)
    assert at > 0 and len(weight) > 32 + n
    for i in range(at + 32, at + 32 + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def unlist_rng1(folder: Path) -> None:
    """rng1.pt gone, and gone from the manifest too (an edited manifest still lists only files
    that match): only the completeness check (every rank of the saving world) can tell."""
    (folder / "rng1.pt").unlink()
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["files"]["rng1.pt"]
    (folder / MANIFEST).write_text(json.dumps(manifest))


# Damage done to step 10 of a run that saved steps 5 and 10 (latest = 10): each must make the
# resume skip it, in one line naming it, for step 5.
STEP10_FAULTS = {
    "flipped bytes": lambda f: flip_weight_bytes(f / "state.pt"),
    "flipped bytes in rank 1's RNG file": lambda f: flip_weight_bytes_rng(f / "rng1.pt"),
    "truncated": lambda f: truncate(f / "state.pt"),
    "missing rng file": lambda f: (f / "rng1.pt").unlink(),
    "rng file missing from the manifest too": unlist_rng1,
    "torn manifest": lambda f: truncate(f / MANIFEST),
    "manifest lost (latest names the folder)": lambda f: (f / MANIFEST).unlink(),
}


def flip_weight_bytes_rng(path: Path, n: int = 16) -> None:
    """XOR `n` bytes of the CPU generator's state tensor in a rank's RNG file."""
    data = bytearray(path.read_bytes())
    at = data.find(torch.load(path, weights_only=True)["torch"].numpy().tobytes()[:256])
    assert at > 0
    for i in range(at + 64, at + 64 + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _fault_cases(folder: str, disk: str) -> dict:
    """On 2 gloo ranks: a run that saves steps 5 and 10 and "crashes" at 12, then, each on a
    copy of its folder, every fault above and a resume; then the refusals. Rank 0 damages the
    copies; each rank reports what it resumed from, its parameters and the warnings it logged."""
    info, rank = rank_info(dist.get_rank(), dist.get_world_size()), dist.get_rank()
    cfg, root = train.Config(**FAULT_CFG), Path(folder)
    root.mkdir(exist_ok=True)
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    log.addHandler(handler)

    def resume(ckpt: Path, rec=None) -> dict:
        said.clear()
        try:
            res = train.train(cfg, info, ckpt, rec)
        except CheckpointError as e:
            return {"error": str(e), "collective": e.collective, "said": list(said)}
        return {"start": res["start"], "from": Path(res["resumed_from"]).name, "said": list(said),
                "model": res["model"].state_dict()}

    def prepared(name: str, damage=None) -> Path:
        """A copy of the pristine folder, damaged by rank 0 (`damage(copy)`), seen by both."""
        ckpt = root / name.replace(" ", "_").replace("'", "")
        if rank == 0:
            shutil.copytree(root / "pristine", ckpt)
            if damage is not None:
                damage(ckpt)
        dist.barrier()
        return ckpt

    train.train(cfg, info, root / "pristine", stop_at=12)
    out = {"pristine": shas(root / "pristine" / "step000005") if rank == 0 else None}
    # Rank 0 lists the folder and reads `latest` for every rank: rank 1, given a stale view of it
    # (here an empty folder), still walks rank 0's list.
    view = root / ("pristine" if rank == 0 else "stale_view")
    view.mkdir(exist_ok=True)
    out["candidates"] = [p.name for p in checkpoints.candidates(view)]
    for name, fault in STEP10_FAULTS.items():
        ckpt = prepared(name, lambda c, fault=fault: fault(c / "step000010"))
        damaged = shas(ckpt / "step000010") if rank == 0 else None
        out[name] = resume(ckpt)
        if rank == 0:  # the previous checkpoint untouched, the damaged one kept aside as it was
            out[name]["step 5 after"] = shas(ckpt / "step000005")
            out[name]["damaged"], out[name]["kept"] = damaged, shas(ckpt / "step000010.rejected")
            out[name]["resaved"] = (ckpt / "step000010" / MANIFEST).exists()
    # After a fallback (and before any new save), `latest` names the step used, not a folder
    # that was moved aside.
    ckpt = prepared("load only", lambda c: flip_weight_bytes(c / "step000010" / "state.pt"))
    used = checkpoints.load_state(ckpt, rank, 2)["step"]
    out["load only"] = (used, (ckpt / "latest").read_text(), sorted(p.name for p in ckpt.glob("step*")))
    # `latest` is a hint: torn, the folders speak for themselves (no fallback needed).
    out["torn latest"] = resume(prepared("torn latest", lambda c: (c / "latest").write_bytes(b"1\xff")))
    # Refusals: every checkpoint bad; another run's (another --out: another run id); another model.
    both = prepared("all bad", lambda c: [flip_weight_bytes(c / s / "state.pt")
                                          for s in ("step000005", "step000010")])
    before = {s: shas(both / s) for s in ("step000005", "step000010")} if rank == 0 else None
    out["all bad"] = resume(both)
    if rank == 0:
        out["all bad"]["untouched"] = before == {s: shas(both / s) for s in before}
        out["all bad"]["listing"] = sorted(p.name for p in both.iterdir())
    out["another run"] = resume(prepared("another run", lambda c: (c / "run_id").write_text("0123456789ab\n")))
    # A real run keeps its id in --out (train() with a recorder): a run with another --out is
    # refused, one whose --out holds the writer's id resumes.
    def recorder(name: str, rid: str | None = None) -> SimpleNamespace:
        if rid is not None and rank == 0:
            (root / name).mkdir(exist_ok=True)
            (root / name / "run_id").write_text(rid)
        return SimpleNamespace(out=root / name, metrics=lambda *a, **k: None)

    writer = (root / "pristine" / "run_id").read_text()
    out["another --out"] = resume(prepared("another out"), recorder("other_out"))
    theirs = root / "other_out" / "run_id"
    out["another --out"]["its id"] = theirs.read_text().strip() if theirs.exists() else None
    out["the writer's --out"] = resume(prepared("writer out"), recorder("writer_out", writer))
    # Step 10 saved again, for a model with a wider first layer: a re-save of a committed step.
    # Rank 0 takes its time to uncommit the folder; rank 1 must not write into it before that.
    other = prepared("another model")
    saved = load_checkpoint(other / "step000010" / "state.pt")
    saved["shapes"]["model"]["0.weight"] = [64, 8]
    uncommit, write_file, seen = checkpoints.uncommit, checkpoints.write_file, []
    if rank == 0:
        checkpoints.uncommit = lambda folder: (time.sleep(0.2), uncommit(folder))[1]
    else:
        checkpoints.write_file = lambda path, *a, **k: (seen.append((path.parent / MANIFEST).exists()),
                                                 write_file(path, *a, **k))[1]
    try:
        checkpoints.save_state(other, 10, saved, load_checkpoint(other / "step000010" / f"rng{rank}.pt"), rank)
    finally:
        checkpoints.uncommit, checkpoints.write_file = uncommit, write_file
    out["committed folder seen by rank 1's write"] = seen
    out["another model"] = resume(other)
    if disk:  # a full disk (a 256 KiB tmpfs) under the save of step 10, on rank 1 only
        out["full disk"] = _full_disk(Path(disk), root / "pristine", rank)
    log.removeHandler(handler)
    return out


def _full_disk(disk: Path, pristine: Path, rank: int) -> dict:
    """Step 5 of the fault run on a small tmpfs, then step 10 saved there with 1 MB more in rank
    1's RNG file: rank 1's write fails, rank 0's files fit; then step 15, whose manifest meets
    the full disk. Every rank must raise the same collective error naming the file (no rank left
    waiting in a collective), step 5 untouched and resumed."""
    if rank == 0:
        for name in ("step000005", "latest", "run_id"):
            copy = shutil.copytree if (pristine / name).is_dir() else shutil.copy
            copy(pristine / name, disk / name)
    dist.barrier()
    before = shas(disk / "step000005") if rank == 0 else None
    state = load_checkpoint(disk / "step000005" / "state.pt")
    rng = load_checkpoint(disk / "step000005" / f"rng{rank}.pt")
    if rank == 1:
        rng["ballast"] = torch.zeros(1 << 18)  # 1 MB: more than the tmpfs has

    def save(step: int, rng: dict) -> dict:
        try:
            checkpoints.save_state(disk, step, state, rng, rank)
            return {"error": None}
        except CheckpointError as e:
            return {"error": str(e), "collective": e.collective}

    if rank == 1:
        # the tmpfs is shared: rank 1's 1 MB write fills it, and a file rank 0 writes at the same
        # moment would meet it full too (a CI run saw rank 0's rng0.pt named). Rank 1 starts
        # once rank 0's small files are written (they take milliseconds); save_state's
        # collective agreement then waits for both.
        time.sleep(2.0)
    out = save(10, rng)
    # Phase 2: the data files of step 15 fit, then the disk fills up (a file takes what is left)
    # just before rank 0 writes the manifest.
    write_manifest = checkpoints.write_manifest

    def fill_then_write(folder, *a, **k):
        try:
            with open(disk / "ballast", "wb") as f:
                while True:
                    f.write(bytes(1 << 12))
                    f.flush()
        except OSError:  # ENOSPC: the disk is full
            pass
        return write_manifest(folder, *a, **k)

    if rank == 0:
        checkpoints.write_manifest = fill_then_write
    try:
        out["manifest"] = save(15, load_checkpoint(disk / "step000005" / f"rng{rank}.pt"))
    finally:
        checkpoints.write_manifest = write_manifest
    dist.barrier()
    if rank == 0:
        (disk / "ballast").unlink()
        out["step 5 untouched"] = before == shas(disk / "step000005")
        out["listing"] = {s: sorted(p.name for p in (disk / s).iterdir())
                          for s in ("step000010", "step000015")}
    out["resumes from"] = checkpoints.load_state(disk, rank, 2)["step"]
    return out


@pytest.mark.timeout(200)
def test_damaged_checkpoints_fall_back_and_foreign_ones_are_refused(two_ranks):
    res, other = (r["faults"] for r in two_ranks["ranks"])
    expected = undisturbed_reference(train.Config(**FAULT_CFG))
    why = {"flipped bytes": "state.pt does not match its manifest",
           "flipped bytes in rank 1's RNG file": "rng1.pt does not match its manifest",
           "truncated": "state.pt has", "missing rng file": "rng1.pt is in the manifest but missing",
           "rng file missing from the manifest too": "lists no rng1.pt",
           "torn manifest": "manifest.json is torn",
           "manifest lost (latest names the folder)": "has no manifest.json"}
    for name in STEP10_FAULTS:
        r, r1 = res[name], other[name]
        assert "error" not in r, (name, r)
        # Both ranks fell back to step 5, together, and end where an undisturbed run does.
        assert (r["start"], r["from"], r1["start"], r1["from"]) == (5, "step000005", 5, "step000005"), name
        assert max_diff(r["model"], expected) <= 1e-12 and max_diff(r1["model"], expected) <= 1e-12, name
        # One line naming the bad checkpoint and its file, said by rank 0 alone, and one saying
        # where it was kept.
        skipped = [line for line in r["said"] if line.startswith("skipping checkpoint step000010:")]
        assert len(skipped) == 1 and why[name] in skipped[0], (name, r["said"])
        assert r["said"] == [skipped[0], "kept the rejected step000010 as step000010.rejected"], r["said"]
        assert r1["said"] == [], (name, r1["said"])
        # The previous checkpoint is untouched, the damaged one kept as it was, step 10 saved anew.
        assert r["step 5 after"] == res["pristine"] and r["kept"] == r["damaged"], name
        assert r["resaved"], name
    assert res["load only"] == (5, "5", ["step000005", "step000010.rejected"]), res["load only"]
    assert other["load only"][0] == 5
    # A torn `latest` is said, and step 10 (which verifies) is used.
    torn = res["torn latest"]
    assert torn["start"] == 10 and max_diff(torn["model"], expected) <= 1e-12
    assert len(torn["said"]) == 1 and "latest is torn" in torn["said"][0], torn["said"]
    assert other["torn latest"]["said"] == [], other["torn latest"]["said"]  # rank 0 reads it
    # Every rank walks rank 0's list (rank 1's own view was an empty folder).
    assert res["candidates"] == other["candidates"] == ["step000005", "step000010"], other["candidates"]
    # The run id of a real run lives in its --out: another --out is refused, the writer's resumes.
    theirs = res["another --out"]
    assert f"not to this run '{theirs['its id']}' (the run id in --out)" in theirs.get("error", ""), theirs
    assert theirs["error"] == other["another --out"]["error"] and theirs["collective"]
    assert res["the writer's --out"]["start"] == other["the writer's --out"]["start"] == 10
    assert max_diff(res["the writer's --out"]["model"], expected) <= 1e-12
    # A re-save of a committed step: rank 1 wrote its file only after rank 0 had uncommitted it.
    assert other["committed folder seen by rank 1's write"] == [False]
    # Refusals: one collective error, the same on both ranks; nothing used, nothing renamed.
    for name, words in (("all bad", "none of the 2 checkpoints verifies (the newest: "),
                        ("another run", "not to this run '0123456789ab' (the run id in --out)"),
                        ("another model", "was written for another model or optimizer: "
                                          "model.0.weight is [32, 8] here, [64, 8] in the checkpoint")):
        assert words in res[name].get("error", ""), (name, res[name])
        assert res[name]["error"] == other[name]["error"] and res[name]["collective"], name
    assert res["all bad"]["untouched"], "a refused resume changed the checkpoints"
    assert res["all bad"]["listing"] == ["latest", "run_id", "step000005", "step000010"]
    assert "step000010/state.pt does not match its manifest" in res["all bad"]["error"]
    assert sum(line.startswith("skipping checkpoint") for line in res["all bad"]["said"]) == 2


def test_a_full_disk_fails_the_save_on_every_rank_in_one_line(two_ranks):
    """Rank 1 alone meets a full disk while saving step 10 (`_full_disk`): both ranks raise the
    one collective error naming rank 1's file (at the console rank 0 says it, in one line), the
    step stays uncommitted, no temporary is left, and step 5 is untouched and resumed."""
    if two_ranks["no disk"]:
        pytest.skip(two_ranks["no disk"])
    res, other = (r["faults"]["full disk"] for r in two_ranks["ranks"])
    assert "step000010/rng1.pt: No space left on device" in (res["error"] or ""), res
    assert res["error"] == other["error"] and res["collective"] and other["collective"]
    assert res["error"].startswith("cannot write "), res["error"]
    # The disk fills up before rank 0 writes step 15's manifest: rank 1 hears it too.
    late, late1 = res["manifest"], other["manifest"]
    assert "step000015/manifest.json: No space left on device" in (late["error"] or ""), late
    assert late["error"] == late1["error"] and late["collective"] and late1["collective"], late1
    assert res["step 5 untouched"], res
    assert res["listing"] == {"step000010": ["rng0.pt", "state.pt"],
                              "step000015": ["rng0.pt", "rng1.pt", "state.pt"]}, res["listing"]
    assert res["resumes from"] == other["resumes from"] == 5


def _console(cmd: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO_ROOT, start_new_session=True)


@pytest.mark.timeout(200)
def test_a_second_run_is_refused_and_all_bad_checkpoints_end_in_one_line(two_ranks, tmp_path):
    """Real launches, as a learner meets them, side by side: a job of 2 ranks (started by the
    course's launcher, tools/torchrun.py) on a `--ckpt-dir` that another process holds, and a run
    whose checkpoints (the fault tests' run, copied) are all damaged, each end in one line and
    exit non-zero. (A second run on a running run's `--out`, which completes whole:
    tests/test_common.py; the same lock_folder holds a `--ckpt-dir`.)"""
    ckpt, bad = tmp_path / "ckpt", tmp_path / "all_bad"
    shutil.copytree(two_ranks["root"] / "faults" / "pristine", bad)
    committed = sorted(p.parent for p in bad.glob(f"step*/{MANIFEST}"))
    for folder in committed:
        flip_weight_bytes(folder / "state.pt")
    damaged = {p.name: shas(p) for p in committed}
    launcher = [sys.executable, str(REPO_ROOT / "tools" / "torchrun.py"), "--standalone",
                "--nproc_per_node=2", str(SCRIPT), "--device", "cpu"]
    lock_folder(ckpt, "--ckpt-dir")  # this process holds it, as a running run would
    try:
        others = {"same --ckpt-dir": _console([*launcher, "--out", str(tmp_path / "B"),
                                               "--ckpt-dir", str(ckpt)]),
                  "all bad": _console([sys.executable, str(SCRIPT), "--device", "cpu", "--out",
                                       str(tmp_path / "D"), "--ckpt-dir", str(bad)])}
        said = {}
        for name, proc in others.items():
            try:
                said[name] = (proc.communicate(timeout=120)[0], proc.returncode)
            finally:
                kill_tree(proc.pid)
    finally:
        unlock_folder(ckpt)
    for name, (console, code) in said.items():
        errors = [line for line in console.splitlines() if "error" in line.lower()]
        assert code != 0 and len(errors) == 1 and "Traceback" not in console, (name, console)
        # (torch's init_process_group prefixes an uncaught error with "[rank0]: ")
        assert errors[0].removeprefix("[rank0]: ").startswith("train.py: error: "), (name, console)
    # The 2-rank job: rank 0's line (before any process group: the launcher stops rank 1), the
    # launcher's; nothing written to its --out but the lock file (parse_config locks --out first).
    lines = said["same --ckpt-dir"][0].strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("course: "), lines
    assert f"--ckpt-dir {ckpt} is in use by another run (pid {os.getpid()} on " in lines[0]
    assert [p.name for p in (tmp_path / "B").iterdir()] == [".lock"]
    assert f"none of the {len(committed)} checkpoints verifies" in said["all bad"][0]
    assert damaged == {p.name: shas(p) for p in committed}  # a refused run changes nothing
    assert sorted(p.name for p in bad.iterdir() if p.name != ".lock") == [
        "latest", "run_id", "step000005", "step000010"]  # nothing renamed


def test_the_wait_carries_the_timeout(monkeypatch):
    """Under NCCL an all-reduce returns at launch: only the wait's own timeout turns a hung peer
    into an error the code sees. On gloo the group's timeout (the same --timeout in hang.py) fails
    the collective at the same moment, so the launch test passes without it (a mutant waiting
    with no timeout did): the call itself is checked here, with a stand-in for the work."""
    seen = []

    class Work:
        def wait(self, timeout=None):
            seen.append(timeout)

    monkeypatch.setattr(hang.dist, "all_reduce", lambda x, group=None, async_op=False: Work())
    hang.all_reduce_and_wait(torch.ones(1), 3.0)
    assert seen == [timedelta(seconds=3)]


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
    interval = checkpoints.young_daly_interval(30, mtbf)
    assert round(interval) == 2277 and round(interval / 60) == 38
    # Its point: the interval minimises saving + expected lost work, t_c/tau + tau/(2M).
    def overhead(tau):
        return 30 / tau + tau / (2 * mtbf)
    assert overhead(interval) < min(overhead(interval * 0.8), overhead(interval * 1.25))
