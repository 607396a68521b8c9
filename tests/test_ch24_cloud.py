"""Chapter 24: a preempted run (SIGTERM to the torchrun agent, as a cloud sends it) checkpoints
within the grace period and the restarted run ends with the parameters of an undisturbed run; a
SIGTERM during a save (then SIGKILL when the grace is over) leaves the previous checkpoint; the
cloud launcher templates validate against their request schemas and start a real script with
options it accepts. The script's exit status after a notice (143 on every rank) is read from `main`
on spawned ranks: torchrun exits 1 after a signal, whatever its workers returned.

Checkpoints that cannot lie: faults injected into a saved run's newest step (objects missing, a
missing shard, 16 flipped bytes, truncation, a torn manifest, damage before hashing, a crafted
pickle with a matching manifest) are each skipped in one line for the step before, which is left
byte-identical and from which the run ends exactly as a resume from it does; all steps bad, another
run's or another model's checkpoint are refused in one line; a second run on a busy --out or
--ckpt-url is refused naming the first one's pid; two ranks agree on one verdict.

References are computed here: an undisturbed run of the same code on two spawned gloo ranks (the
same computation: tolerance 0) and a hand-written one-process loop (another summation order:
1e-12). Negative controls: resuming without the data position or without the RNG state lands
elsewhere; a manifest written before the data objects commits a step whose objects are missing;
the crafted pickle runs when loaded without `weights_only`; a wrong field, a wrong type, an unknown
script, an unknown option and an --out on the container's disk each fail a template.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch24_cloud import launchers, train
from chapters.ch24_cloud.fake_imds import FakeIMDS
from chapters.ch24_cloud.object_store import (
    MANIFEST,
    ObjectStoreCheckpoints,
    names_to_check,
    run_identity,
    step_folder,
)
from chapters.ch24_cloud.preemption import (
    Preemption,
    StopAtStep,
    largest_checkpoint_bytes,
    seconds_to_commit,
)
from chapters.ch24_cloud.spot_notice import TOKEN_TTL_S, SpotNoticePoller, spot_notice_url
from common.checkpoint import CheckpointError, FolderInUseError, load_checkpoint, lock_folder
from common.data import regression_data
from common.launch import (
    last_logged_step,
    run_on_ranks,
    run_torchrun,
    started,
    wait_until,
)
from common.log import log as course_log
from common.models import MLP
from common.testing import rank_info

SCRIPT = Path(train.__file__)
STEPS = 30
ARM_AFTER_STEP = 2  # the fake endpoint schedules the notice once the run has logged this step
GRACE_TOO_SHORT = 1e-4  # seconds: shorter than any save (the deadline check's control)


def hand_reference(cfg: train.Config, world: int = 2) -> dict:
    """Data-parallel SGD with momentum written out in one process: each 'rank' its own noise
    stream (seed + 1 + rank) and its slice of the reshuffled-every-epoch order."""
    X, Y = regression_data(cfg.n_samples, 8, 1, seed=cfg.seed, dtype=torch.float64)
    torch.manual_seed(cfg.seed)
    model = MLP(8, 32, 1).double()
    params = list(model.parameters())
    momentum = [torch.zeros_like(p) for p in params]
    rng = []
    for r in range(world):
        torch.manual_seed(cfg.seed + 1 + r)
        rng.append(torch.get_rng_state())
    epochs = cfg.steps * world * cfg.batch_size // cfg.n_samples + 1
    order = torch.cat([torch.randperm(cfg.n_samples, generator=torch.Generator().manual_seed(
        cfg.seed * 1000 + e)) for e in range(epochs)])
    cursor = 0
    for _ in range(cfg.steps):
        grad_sum = None
        for r in range(world):
            idx = order[cursor + r * cfg.batch_size:cursor + (r + 1) * cfg.batch_size]
            torch.set_rng_state(rng[r])
            x = X[idx] + cfg.noise * torch.randn(cfg.batch_size, 8, dtype=torch.float64)
            rng[r] = torch.get_rng_state()
            g = torch.autograd.grad(((model(x) - Y[idx]) ** 2).mean(), params)
            grad_sum = g if grad_sum is None else [a + b for a, b in zip(grad_sum, g)]
        cursor += world * cfg.batch_size
        with torch.no_grad():
            for p, g, m in zip(params, grad_sum, momentum):
                m.mul_(cfg.momentum).add_(g / world)
                p.sub_(cfg.lr * m)
    return model.state_dict()


def _opt_value(words: list[str], option: str) -> str:
    return words[words.index(option) + 1]


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def logged():
    """The course log's lines (what the console shows) while the block runs."""
    handler = _Lines()
    course_log.addHandler(handler)
    try:
        yield handler.lines
    finally:
        course_log.removeHandler(handler)


def flip_bytes(path: Path, n: int = 16) -> None:
    """Flip `n` bytes in the middle of the largest member of a `torch.save` archive (a tensor's
    raw data: torch stores members uncompressed), as a bad disk or a bad copy would."""
    import zipfile
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = (int.from_bytes(data[info.header_offset + k:info.header_offset + k + 2],
                                          "little") for k in (26, 28))
    start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    for i in range(start, start + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _ranks(folder: str, imds_url: str) -> dict:
    """On 2 gloo ranks: an undisturbed run; a run whose notice reaches rank 1 only, before step 8;
    its resume restoring everything, without the data position, without the RNG state; then the
    newest checkpoint damaged where only rank 1 reads it (its RNG object) and resumed: both ranks
    must fall back to the same step; last, the script's own `main` polling AWS's spot notice at
    a fake metadata endpoint (rank 0 is local rank 0, the one poller), with a grace too short
    for any save (the deadline's control), then its resume."""
    info, cfg = rank_info(dist.get_rank(), dist.get_world_size()), train.Config(steps=STEPS)
    full = train.train(cfg, info, ObjectStoreCheckpoints(f"{folder}/full"), Preemption(),
                       f"{folder}/full-out")
    out = {"full": {k: v.clone() for k, v in full["model"].state_dict().items()}}
    for name, restore in (("all", train.STATE_PARTS), ("no_data", ("model", "optimizer", "rng")),
                          ("no_rng", ("model", "optimizer", "data"))):
        store = ObjectStoreCheckpoints(f"{folder}/{name}")
        notice = StopAtStep(8) if info.rank == 1 else Preemption()
        first = train.train(cfg, info, store, notice, f"{folder}/{name}-out")
        out.setdefault("stopped_at", []).append(first["preempted_at"])
        resumed = train.train(train.Config(steps=STEPS, restore=restore), info, store,
                              Preemption(), f"{folder}/{name}-out")
        out[name] = {k: v.clone() for k, v in resumed["model"].state_dict().items()}
        out.setdefault("start", []).append(resumed["start"])
    # the newest step of "all" damaged in rank 1's RNG object, which rank 0 neither loads nor
    # checks (its share is rng0.pt and state.pt): one verdict for both, or they would resume
    # from different steps
    store = ObjectStoreCheckpoints(f"{folder}/all")
    newest = store.committed_steps()[-1]
    if info.rank == 0:
        flip_bytes(Path(folder, "all", step_folder(newest), "rng1.pt"))
    dist.barrier()
    with logged() as lines:
        again = train.train(cfg, info, store, Preemption(), f"{folder}/all-out")
    out["agreed"] = {"newest": newest, "start": again["start"], "lines": lines,
                     "model": {k: v.clone() for k, v in again["model"].state_dict().items()}}
    # main's return value is the script's exit status (`sys.exit(main(...))`), which torchrun
    # does not pass on (it exits 1 after a signal): read it here, on every rank. main tears the
    # group down at its end; here the group must outlive it for the resume below.
    bucket = f"{folder}/main-bucket"
    teardown = train.teardown_distributed
    train.teardown_distributed = lambda: None
    try:
        out["main_code"] = train.main(train.Config(
            steps=STEPS, device="cpu", out=f"{folder}/main", ckpt_url=bucket, step_seconds=0.05,
            log_every=1, spot_notice=imds_url, spot_poll_s=0.02, grace_s=GRACE_TOO_SHORT))
    finally:
        train.teardown_distributed = teardown
    store = ObjectStoreCheckpoints(bucket)
    out["main_committed"] = store.committed_steps()
    resumed = train.train(train.Config(steps=STEPS), info, store, Preemption(),
                          f"{folder}/main")
    out["main_resumed"] = {k: v.clone() for k, v in resumed["model"].state_dict().items()}
    out["main_resumed_from"] = resumed["start"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("ranks")
    armed_at: list[int] = []

    def mid_run() -> bool:
        """True once `main` has logged training step ARM_AFTER_STEP (its metrics line is written
        after the step): the notice is scheduled mid-run, never before the first step."""
        step = last_logged_step(folder / "main" / "metrics.jsonl")
        if step >= ARM_AFTER_STEP:
            armed_at.append(step)
        return step >= ARM_AFTER_STEP

    with FakeIMDS(arm_when=mid_run) as imds:
        results = run_on_ranks(_ranks, 2, str(folder), imds.url, timeout=90)
    summary = json.loads((folder / "main" / "summary.json").read_text())
    return {**results[0], "main_codes": [r["main_code"] for r in results], "folder": folder,
            "agreed": [r["agreed"] for r in results],
            "main_summary": summary, "imds_requests": imds.requests,
            "armed_at_step": armed_at[0] if armed_at else None,
            "polls_before_notice": imds.armed_after_polls}


@pytest.mark.timeout(120)
def test_in_process_preemption_resumes_exactly_and_controls_diverge(reference):
    # rank 1 alone got the notice, yet both ranks stopped before step 8 and saved step 8
    assert reference["stopped_at"] == [8, 8, 8] and reference["start"] == [8, 8, 8]
    assert max_diff(reference["all"], reference["full"]) == 0.0  # same computation: exact
    assert max_diff(reference["no_data"], reference["full"]) > 1e-6
    assert max_diff(reference["no_rng"], reference["full"]) > 1e-6
    # the script's loop against a loop written here (another summation order: a few ulps)
    assert max_diff(reference["full"], hand_reference(train.Config(steps=STEPS))) <= 1e-12
    # the newest step damaged where rank 1 alone reads it: both ranks skip it, say so, and
    # resume from the step before, ending where the undisturbed run ends
    newest = reference["agreed"][0]["newest"]
    assert newest == STEPS
    for rank in (0, 1):
        agreed = reference["agreed"][rank]
        assert agreed["start"] == newest - train.Config().ckpt_every
        skipped = [line for line in agreed["lines"] if line.startswith("skipping checkpoint")]
        if rank == 0:  # rank 0 says it, in one line naming the object rank 1 found damaged
            assert len(skipped) == 1 and "step000030/rng1.pt" in skipped[0], agreed["lines"]
        else:  # the same verdict: not said twice
            assert skipped == [], agreed["lines"]
        assert max_diff(agreed["model"], reference["full"]) == 0.0


@pytest.mark.timeout(120)
def test_spot_notice_checkpoints_exits_143_and_resumes_to_the_undisturbed_result(reference):
    # every rank's exit status is 128 + SIGTERM (literal: never the code's own constant), never 0
    assert reference["main_codes"] == [143, 143]
    summary = reference["main_summary"]
    stopped = summary["figures"]["preempted, checkpoint committed at step"]["measured"]
    # the notice was scheduled only after the run had logged step ARM_AFTER_STEP (the poller had
    # been told 404 until then), so it arrived mid-run, and the run stopped after that step
    armed = reference["armed_at_step"]
    assert armed is not None and ARM_AFTER_STEP <= armed < stopped < STEPS
    assert reference["main_committed"][-1] == stopped
    assert reference["main_resumed_from"] == stopped
    assert max_diff(reference["main_resumed"], reference["full"]) == 0.0  # the same computation
    # the requests the fake endpoint received: one token by PUT (one poller: rank 0 is the node's
    # local rank 0; rank 1 learnt of the notice from the agreement all-reduce), then GETs that
    # carry it, answered 404 until the notice
    reqs = reference["imds_requests"]
    assert [(r["method"], r["path"], r["ttl"]) for r in reqs[:1]] == [
        ("PUT", "/latest/api/token", str(TOKEN_TTL_S))]
    assert sum(r["method"] == "PUT" for r in reqs) == 1
    assert reqs[0]["token"] is None
    token = reqs[1]["token"]
    gets = [r for r in reqs if r["method"] == "GET"]
    assert all(r["path"] == "/latest/meta-data/spot/instance-action" and r["token"] == token
               for r in gets)
    waited = reference["polls_before_notice"]
    assert waited >= 1  # the poller was polling (and told 404) before the notice existed
    assert [r["status"] for r in gets][:waited + 1] == [404] * waited + [200]
    polls = summary["figures"]["spot notice: polls answered (this node's local rank 0)"]
    assert polls["measured"] == waited + 1
    # the deadline check can fail: with --grace-s 1e-4 no save commits in time
    checks = {c["name"]: c for c in summary["checks"]}
    late = checks["notice -> checkpoint committed before the deadline (s)"]
    assert late["expected"] == GRACE_TOO_SHORT and late["measured"] > GRACE_TOO_SHORT
    assert not late["ok"] and late["kind"] == "timing"


@pytest.mark.timeout(60)
def test_spot_notice_poller_speaks_imdsv2_and_a_tokenless_poller_never_sees_the_notice():
    import urllib.error
    import urllib.request

    def raw(url, method="GET", headers=None):
        req = urllib.request.Request(url, method=method, headers=headers or {},
                                     data=b"" if method == "PUT" else None)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""

    action = "/latest/meta-data/spot/instance-action"
    with FakeIMDS(notice_in_s=10) as imds:
        # the fake enforces AWS's rules (checked with plain requests, not with the poller):
        # a token PUT needs its TTL header (1..21600), a GET needs a valid token
        assert raw(imds.url + "/latest/api/token", "PUT")[0] == 400
        ttl = "X-aws-ec2-metadata-token-ttl-seconds"
        assert raw(imds.url + "/latest/api/token", "PUT", {ttl: "21601"})[0] == 400
        assert raw(imds.url + action)[0] == 401
        assert raw(imds.url + action, headers={"X-aws-ec2-metadata-token": "forged"})[0] == 401
        status, token = raw(imds.url + "/latest/api/token", "PUT", {ttl: "60"})
        assert status == 200 and raw(imds.url + action, headers={
            "X-aws-ec2-metadata-token": token})[0] == 404
        # the poller: a token, 404 (no notice); an expired token is replaced (401, new PUT, 404)
        notice = Preemption(grace_s=30.0)
        poller = SpotNoticePoller(imds.url, notice, interval_s=0.02)
        assert poller.poll_once() is None
        imds.expire_tokens()
        assert poller.poll_once() is None
        assert imds.statuses("PUT", "/latest/api/token")[-2:] == [200, 200]
        assert imds.statuses("GET", action)[-3:] == [404, 401, 404]
        # control: IMDSv1's plain GET is refused (401) when IMDSv2 is required, and never
        # becomes a notice, even once one is scheduled
        imds.arm()
        blind_notice = Preemption(grace_s=30.0)
        blind = SpotNoticePoller(imds.url, blind_notice, interval_s=0.02, imdsv2=False)
        with pytest.raises(OSError, match="401"):
            blind.poll_once()
        blind.start()
        # the real poller, in its thread, sets the flag the SIGTERM handler sets
        poller.start()
        assert wait_for(lambda: notice.signal_time is not None, 10)
        time.sleep(0.2)  # the blind poller keeps polling meanwhile
        blind.stop()
        poller.stop()
        assert blind_notice.signal_time is None and blind.polls >= 2 and blind.errors
        assert poller.seen["action"] == "terminate" and notice.source.startswith("spot notice")
        # the deadline: the earlier of notice + grace (30 s) and the time the notice names (~10 s)
        assert 5 < notice.deadline() - notice.signal_time <= 11


@pytest.mark.timeout(60)
def test_spot_notice_poller_bypasses_proxies_and_survives_a_broken_answer(monkeypatch):
    """IMDS is link-local: a proxy named by the environment cannot reach it, so the poller must
    not use one (the control: urllib's default opener does, and fails). A poll that fails in a
    way that is no OSError (a line that is not HTTP: `http.client.BadStatusLine`) is logged and
    the thread keeps polling until it hears the notice."""
    import urllib.request

    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # the discard port: nothing listens
    with FakeIMDS(notice_after=1, broken_polls=2, notice_in_s=60) as imds:
        proxied = SpotNoticePoller(imds.url, Preemption(), interval_s=0.02)
        proxied._opener = urllib.request.build_opener()  # urlopen's default: the proxy
        with pytest.raises(OSError):
            proxied.poll_once()
        assert imds.requests == []  # it went to the proxy, never to the endpoint
        notice = Preemption(grace_s=30.0)
        poller = SpotNoticePoller(imds.url, notice, interval_s=0.02).start()
        assert wait_for(lambda: notice.signal_time is not None, 10), poller.errors
        poller.stop()
    assert [e.split(":")[0] for e in poller.errors] == ["BadStatusLine"] * 2
    assert imds.statuses("GET", "/latest/meta-data/spot/instance-action") == [
        "not HTTP", "not HTTP", 404, 200]
    assert poller.seen["action"] == "terminate"


class _TimedLock:
    """A lock whose acquire gives up after 1 s with an error instead of waiting forever: a
    deadlock becomes a failure this process survives."""

    def __init__(self, lock) -> None:
        self.lock = lock

    def __enter__(self):
        if not self.lock.acquire(timeout=1.0):
            raise RuntimeError("the lock waited for its own holder: a deadlock")
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()


@pytest.mark.timeout(30)
def test_a_sigterm_while_the_main_thread_records_a_notice_does_not_deadlock():
    """Python runs a signal handler in the main thread between two bytecodes; when that thread is
    inside `notify` (holding the notice's lock), the handler's `notify` must get the lock again:
    a re-entrant lock. Control: a plain Lock in the same place waits for itself."""
    def signal_while_holding(notice: Preemption) -> None:
        old = signal.getsignal(signal.SIGTERM)
        try:
            notice.install()
            with notice._lock:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in this thread
                for _ in range(1000):
                    if notice.signal_time is not None:
                        break
                    time.sleep(0.001)
        finally:
            signal.signal(signal.SIGTERM, old)

    notice = Preemption()
    notice._lock = _TimedLock(notice._lock)  # the lock the class made, behind a time limit
    signal_while_holding(notice)
    assert notice.source == "SIGTERM" and notice.signal_time is not None
    import threading
    plain = Preemption()
    plain._lock = _TimedLock(threading.Lock())
    with pytest.raises(RuntimeError, match="deadlock"):
        signal_while_holding(plain)


@pytest.mark.timeout(10)
def test_spot_notice_option_and_ec2_detection(tmp_path):
    assert spot_notice_url("") is None
    assert spot_notice_url("aws") == "http://169.254.169.254"
    assert spot_notice_url("http://127.0.0.1:8080") == "http://127.0.0.1:8080"
    ec2, other = tmp_path / "ec2", tmp_path / "other"
    ec2.mkdir()
    other.mkdir()
    (ec2 / "sys_vendor").write_text("Amazon EC2\n")
    (other / "sys_vendor").write_text("QEMU\n")
    assert spot_notice_url("auto", str(ec2)) == "http://169.254.169.254"
    assert spot_notice_url("auto", str(other)) is None
    with pytest.raises(ValueError, match="--spot-notice"):
        train.Config(spot_notice="169.254.169.254")


@pytest.mark.timeout(150)
def test_sigterm_to_torchrun_saves_within_grace_and_resume_matches_undisturbed(tmp_path, reference):
    bucket, out = f"file://{tmp_path}/bucket", tmp_path / "preempted"
    grace = 30.0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(SCRIPT), "--device", "cpu", "--steps", str(STEPS), "--step-seconds", "0.05",
           "--log-every", "1", "--ckpt-url", bucket, "--grace-s", str(grace), "--out", str(out)]
    with started(cmd) as proc:
        wait_until(lambda: last_logged_step(out / "metrics.jsonl") >= 7, proc, "step 7")
        sent = time.time()
        proc.send_signal(signal.SIGTERM)  # to the agent, as a cloud does; it forwards to the ranks
        output, _ = proc.communicate(timeout=60)
    done = time.time()
    summary = json.loads((out / "summary.json").read_text())
    checks = {c["name"]: c for c in summary["checks"]}
    stopped = summary["figures"]["preempted, checkpoint committed at step"]["measured"]
    assert 7 < stopped < STEPS, output[-3000:]
    assert checks["every rank stopped at the same step (max - min)"]["ok"]
    timing = checks["notice -> checkpoint committed before the deadline (s)"]
    # measured by the ranks from their SIGTERM handler's clock, bounded by this process's clock
    # from before the signal to after torchrun ended; the deadline is the grace
    assert 0 < timing["measured"] < done - sent and timing["expected"] == grace and timing["ok"]
    # torchrun itself exits 1 (it re-raises the signal, torch 2.14.1): the launcher sees a failure;
    # the script's 143 reaches it only in this log line (test_main_exits_143... checks the status)
    assert proc.returncode != 0 and "exit code 143: stopped by the preemption notice" in output
    store = ObjectStoreCheckpoints(bucket)
    assert store.committed_steps()[-1] == stopped
    print(f"\nSIGTERM -> committed: {timing['measured']:.3f} s (grace {grace:.0f} s); "
          f"torchrun exit {proc.returncode}")

    # the restart is the same command: the same --out, whose run id the checkpoints carry
    res = run_torchrun(SCRIPT, nproc=2, out_dir=out, timeout=90,
                       args=["--steps", STEPS, "--ckpt-url", bucket])
    assert res.summary["figures"]["resumed from step"]["measured"] == stopped
    final = load_checkpoint(out / "final_params.pt")["model"]
    assert max_diff(final, reference["full"]) == 0.0  # the undisturbed run: same computation
    assert max_diff(reference["no_data"], final) > 1e-6  # the controls land elsewhere


@pytest.mark.timeout(150)
def test_sigterm_during_a_save_leaves_the_previous_checkpoint_and_a_second_run_is_refused(
        tmp_path, saved):
    """A run parked in the save of step 10 (its data objects written, no manifest) holds --out
    and --ckpt-url. Meanwhile, each in one line on the console and a non-zero status: a second
    run on its --out is refused naming its pid, and a run whose checkpoints are all damaged (a
    copy of `saved`) is refused; its --ckpt-url's lock names it too (taken here, in process: a
    third run would meet the same lock). The first run's metrics are untouched; the SIGTERM
    mid-save, then SIGKILL, leave step 5 the one to resume."""
    bucket, out, grace = tmp_path / "bucket", tmp_path / "run", 1.0
    base = [sys.executable, str(SCRIPT), "--device", "cpu", "--steps", "20", "--timeout", "60"]
    cmd = [*base, "--ckpt-every", "5", "--log-every", "1", "--pause-save-at", "10",
           "--ckpt-url", str(bucket), "--out", str(out), "--grace-s", str(grace)]
    bad_bucket, bad_out = copy_saved(saved, tmp_path / "bad")
    flip_bytes(bad_bucket / "step000005" / "state.pt")
    tear(bad_bucket / "step000010" / MANIFEST)
    bad_before = shas(bad_bucket)
    all_bad = [*base, "--ckpt-url", str(bad_bucket), "--out", str(bad_out)]
    same_out = [*base, "--ckpt-url", str(bucket), "--out", str(out)]
    with started(cmd) as proc, started(all_bad) as bad:  # the second touches none of its folders
        # its first metrics line comes after RunRecorder locked --out and main locked --ckpt-url
        wait_until(lambda: last_logged_step(out / "metrics.jsonl") >= 0, proc, "step 0")
        with started(same_out) as second:
            with pytest.raises(FolderInUseError) as in_use:  # what `main` meets on --ckpt-url
                lock_folder(bucket, "--ckpt-url", wait_s=0.2)
            procs = {"same --out": second, "all bad": bad}
            consoles = {k: p.communicate(timeout=60)[0] for k, p in procs.items()}
        wait_until(lambda: (out / "paused").exists(), proc, "the paused save of step 10")
        # the first run's metrics.jsonl: whole lines, steps 0 to 9, nothing truncated or mixed
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == list(range(10))
        proc.send_signal(signal.SIGTERM)  # the notice arrives mid-save ...
        time.sleep(grace)
        assert proc.poll() is None  # ... the save is slower than the grace ...
        proc.send_signal(signal.SIGKILL)  # ... and the cloud pulls the plug
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    for name, console in consoles.items():
        errors = [line for line in console.splitlines() if "error:" in line]
        assert procs[name].returncode != 0 and len(errors) == 1, console[-2000:]
        assert "Traceback" not in console, console[-2000:]
        consoles[name] = errors[0]
    assert f"--out {out.resolve()} is in use by another run (pid {proc.pid} " in consoles["same --out"]
    assert f"--ckpt-url {bucket.resolve()} is in use by another run (pid {proc.pid} " in str(
        in_use.value)
    assert "none of the 2 checkpoints verifies" in consoles["all bad"]
    assert shas(bad_bucket) == bad_before  # refused, nothing deleted or rewritten
    assert (bucket / "step000010" / "state.pt").exists()  # the data objects were written ...
    assert not (bucket / "step000010" / MANIFEST).exists()  # ... the commit was not
    store = ObjectStoreCheckpoints(str(bucket))
    assert store.committed_steps() == [5]
    model = train.new_model(train.Config(), "cpu")
    state = store.load_latest(0, 1, run_identity(out, model, list(model.parameters())))
    assert state["step"] == 5 and state["cursor"] == 5 * 8


# --- checkpoints that cannot lie: faults injected into a world of one, in this process ----------

FAULT_STEPS = 20


@contextlib.contextmanager
def world_of_one():
    """A gloo group of one process (chapter 13's loop all-reduces even then), left at the end."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield rank_info(0, 1)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """A run of 10 steps with checkpoints at steps 5 and 10 (its bucket and its --out, which
    holds the run id), and the parameters after resuming it from step 5 to step FAULT_STEPS:
    what every fall-back to step 5 must give."""
    root = tmp_path_factory.mktemp("saved")
    with world_of_one() as info:
        train.train(train.Config(steps=10), info, ObjectStoreCheckpoints(str(root / "bucket")),
                    Preemption(), root / "out")
        bucket, out = copy_saved({"root": root}, root / "from5")
        shutil.rmtree(bucket / "step000010")
        resumed = train.train(train.Config(steps=FAULT_STEPS), info,
                              ObjectStoreCheckpoints(str(bucket)), Preemption(), out)
    assert resumed["start"] == 5
    return {"root": root, "from5": {k: v.clone() for k, v in resumed["model"].state_dict().items()}}


def copy_saved(saved: dict, to: Path) -> tuple[Path, Path]:
    shutil.copytree(saved["root"] / "bucket", to / "bucket")
    shutil.copytree(saved["root"] / "out", to / "out")
    return to / "bucket", to / "out"


def shas(folder: Path) -> dict:
    """Every file's SHA-256 but the lock a run takes on the folder (`.lock`)."""
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def tear(path: Path) -> None:
    """Keep the first half of a file: a write cut short (a manifest landed torn)."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def rehash(folder: Path, name: str) -> None:
    """Rewrite `name`'s manifest entry for the bytes it now holds: a damaged file hashed and
    uploaded faithfully (the store's own checksums would pass too)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][name] = {"bytes": (folder / name).stat().st_size,
                               "sha256": sha256(folder / name)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


class Crafted:
    """Unpickled, it calls `open(marker, "w")`: a harmless stand-in for code a crafted checkpoint
    would run (creating the marker file is the proof that it ran)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def crafted_state(folder: Path, marker: Path) -> None:
    """state.pt replaced by a pickle that creates `marker` when loaded, with the manifest entry
    (and the archive's CRCs) to match: a checksum proves integrity, not honesty."""
    state = torch.load(folder / "state.pt", weights_only=True)
    torch.save({**state, "payload": Crafted(marker)}, folder / "state.pt")
    rehash(folder, "state.pt")


FAULTS = {  # what is done to step 10, and the reason its skipped line must give
    "objects missing (the manifest landed first)": (
        lambda d, tmp: [(d / n).unlink() for n in ("rng0.pt", "state.pt")],
        "rng0.pt is in the manifest but missing"),
    "a missing shard (one rank's object)": (
        lambda d, tmp: (d / "rng0.pt").unlink(), "rng0.pt is in the manifest but missing"),
    "16 flipped bytes in a weight": (
        lambda d, tmp: flip_bytes(d / "state.pt"), "SHA-256 differs"),
    "truncated object": (
        lambda d, tmp: tear(d / "state.pt"), "bytes, its manifest says"),
    "torn manifest": (
        lambda d, tmp: tear(d / MANIFEST), "is torn or not a manifest"),
    "damaged before it was hashed (manifest matches)": (
        lambda d, tmp: (flip_bytes(d / "state.pt"), rehash(d, "state.pt")),
        "fails its CRC-32 check"),
    "a crafted pickle (manifest and CRCs match)": (
        lambda d, tmp: crafted_state(d, tmp / "marker"), "is not a safe checkpoint (Unpickling"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(saved, tmp_path, fault):
    """Each fault in the newest step (10): skipped in one line naming it and why, the run resumes
    from step 5 and ends exactly where a resume from step 5 ends; step 5 is untouched."""
    bucket, out = copy_saved(saved, tmp_path)
    step5 = shas(bucket / "step000005")
    damage, reason = FAULTS[fault]
    damage(bucket / "step000010", tmp_path)
    damaged = shas(bucket / "step000010")
    with world_of_one() as info, logged() as lines:
        resumed = train.train(train.Config(steps=FAULT_STEPS), info,
                              ObjectStoreCheckpoints(str(bucket)), Preemption(), out)
    skipped = [line for line in lines if line.startswith("skipping checkpoint")]
    assert len(skipped) == 1, lines
    assert skipped[0].startswith("skipping checkpoint step000010: ") and reason in skipped[0]
    assert str(bucket / "step000010") in skipped[0]  # the reason names the file
    assert "\n" not in skipped[0] and len(skipped[0]) < 400
    assert resumed["start"] == 5
    assert max_diff(resumed["model"].state_dict(), saved["from5"]) == 0.0
    assert shas(bucket / "step000005") == step5  # the previous checkpoint: its bytes unchanged
    assert shas(bucket / "skipped-step000010") == damaged  # the bad one kept aside as it was
    assert ObjectStoreCheckpoints(str(bucket)).committed_steps() == [5, 10, 15, 20]
    assert not (tmp_path / "marker").exists()  # nothing a checkpoint carried ran


@pytest.mark.timeout(30)
def test_the_crafted_pickle_runs_code_when_loaded_without_weights_only(saved, tmp_path):
    """The control for the crafted case above: the same file loaded by a plain
    `torch.load(weights_only=False)` (what DCP's default planner does for non-tensor entries)
    creates its marker, and its manifest entry and zip CRCs pass: only `weights_only` stops it."""
    bucket, _ = copy_saved(saved, tmp_path)
    folder, marker = bucket / "step000010", tmp_path / "ran"
    crafted_state(folder, marker)
    store = ObjectStoreCheckpoints(str(bucket))
    entry = store.read_manifest(10)["files"]["state.pt"]
    data = store.verified_bytes(10, "state.pt", entry)  # size, SHA-256 and CRC-32s all pass
    assert not marker.exists()
    torch.load(io.BytesIO(data), weights_only=False)
    assert marker.exists()


@pytest.mark.timeout(30)
def test_all_checkpoints_bad_is_refused_in_one_line_and_nothing_is_deleted(saved, tmp_path):
    bucket, out = copy_saved(saved, tmp_path)
    flip_bytes(bucket / "step000005" / "state.pt")
    tear(bucket / "step000010" / MANIFEST)
    before = shas(bucket)
    with world_of_one() as info, logged() as lines, pytest.raises(CheckpointError) as refused:
        train.train(train.Config(steps=FAULT_STEPS), info, ObjectStoreCheckpoints(str(bucket)),
                    Preemption(), out)
    message = str(refused.value)
    assert message.startswith("none of the 2 checkpoints verifies (the newest: ")
    assert "step000010/manifest.json is torn" in message and "\n" not in message
    assert refused.value.collective  # every rank raises it from one verdict: rank 0 says it
    assert [line.split(":")[0] for line in lines if line.startswith("skipping")] == [
        "skipping checkpoint step000010", "skipping checkpoint step000005"]
    assert shas(bucket) == before  # never started over silently, never deleted a bad one


@pytest.mark.timeout(30)
def test_another_runs_or_another_models_checkpoint_is_refused(saved, tmp_path):
    """Run identity: the run id comes from --out (another --out is another run); the shapes from
    the model and its momentum buffers. Control: this run's own identity loads step 10."""
    bucket, out = copy_saved(saved, tmp_path)
    before = shas(bucket)
    store = ObjectStoreCheckpoints(str(bucket))
    with world_of_one() as info:
        with pytest.raises(CheckpointError) as refused:
            train.train(train.Config(steps=FAULT_STEPS), info, store, Preemption(),
                        tmp_path / "another-out")
    message = str(refused.value)
    assert f"{bucket}/step000010 belongs to run " in message and "\n" not in message
    assert (out / "run_id").read_text().strip() in message
    wider = MLP(8, 64, 1).double()
    with pytest.raises(CheckpointError, match="written for another model or optimizer: "
                       r"model\.0\.bias is \[64\] here, \[32\] in the checkpoint"):
        store.load_latest(0, 1, run_identity(out, wider, list(wider.parameters())))
    model = train.new_model(train.Config(), "cpu")
    assert store.load_latest(0, 1, run_identity(out, model, list(model.parameters())))[
        "step"] == 10
    assert shas(bucket) == before


@pytest.mark.timeout(30)
def test_a_checkpoint_of_two_ranks_resumes_on_one(reference, tmp_path):
    """World size is not part of a checkpoint's identity: the two-rank run of `main` resumes in a
    world of one (its RNG streams re-derived, chapter 13), and is accepted as this run's."""
    folder = Path(reference["folder"])
    shutil.copytree(folder / "main-bucket", tmp_path / "bucket")
    shutil.copytree(folder / "main", tmp_path / "main")
    store = ObjectStoreCheckpoints(str(tmp_path / "bucket"))
    stopped = reference["main_summary"]["figures"]["preempted, checkpoint committed at step"][
        "measured"]
    for later in store.committed_steps():  # the steps its two-rank resume saved after that
        if later > stopped:
            shutil.rmtree(tmp_path / "bucket" / step_folder(later))
    with world_of_one() as info:
        resumed = train.train(train.Config(steps=STEPS), info, store, Preemption(),
                              tmp_path / "main")
    assert resumed["start"] == stopped and len(resumed["losses"]) == STEPS - stopped
    assert store.read_manifest(stopped)["world_size"] == 2


@pytest.mark.timeout(10)
def test_every_object_is_checked_by_some_rank_at_any_world_size():
    """The ranks share the hashing: each checks what it loads and every world-th object; at 4
    ranks over a 2-rank checkpoint (3 objects) rank 3's share is empty, and it still checks the
    state it loads."""
    names = ["rng0.pt", "rng1.pt", "state.pt"]
    for world in (1, 2, 3, 4, 8):
        same = world == 2
        parts = [names_to_check(names, r, world, {"state.pt"} | ({f"rng{r}.pt"} if same
                                                                       else set()))
                 for r in range(world)]
        assert set().union(*parts) == set(names)
        assert all("state.pt" in p for p in parts)
    assert names_to_check(names, 3, 4, {"state.pt"}) == ["state.pt"]


@pytest.mark.timeout(30)
def test_manifest_last_is_the_commit_on_an_object_store():
    """memory:// is an object store without rename: each pipe_file is one whole object."""
    store = ObjectStoreCheckpoints(f"memory://ch24-{os.getpid()}")
    model = MLP(8, 32, 1).double()
    identity = {"run_id": "r1", "shapes": {"model": {}}}
    shared = {"step": 5, "cursor": 40, "model": model.state_dict(), "optimizer": []}
    store.save(5, shared, {"noise": torch.get_rng_state()}, rank=0, meta=identity)
    assert store.puts == 3 and store.committed_steps() == [5]

    class Killed(BaseException):
        pass

    def kill():
        raise Killed

    with pytest.raises(Killed):  # the process dies between the data objects and the manifest
        store.save(10, {**shared, "step": 10}, {"noise": torch.get_rng_state()}, rank=0,
                   meta=identity, pause=kill)
    assert store.committed_steps() == [5] and store.load_latest(0, 1, identity)["step"] == 5

    # negative control: the commit first, then the data (a `latest` pointer updated too early):
    # the step counts as committed, its object is missing; the load says so and falls back
    store.put("step000015/" + MANIFEST, json.dumps({"step": 15, "world_size": 1, **identity,
              "files": {n: {"bytes": 1, "sha256": "0"} for n in ("rng0.pt", "state.pt")}}).encode())
    assert store.committed_steps() == [5, 15]
    with logged() as lines:
        assert store.load_latest(0, 1, identity)["step"] == 5
    skipped = [line for line in lines if line.startswith("skipping")]
    assert len(skipped) == 1 and "step000015/rng0.pt is in the manifest but missing" in skipped[0]
    # kept aside whole (an object store's move: a copy and a delete), no longer listed
    assert store.committed_steps() == [5]
    assert store.get("skipped-step000015/" + MANIFEST)
    # and objects that changed after their manifest was written are caught by their digest
    store.put("step000020/" + MANIFEST, json.dumps({"step": 20, "world_size": 1, **identity,
              "files": {n: {"bytes": 1, "sha256": "0"} for n in ("rng0.pt", "state.pt")}}).encode())
    for name in ("rng0.pt", "state.pt"):
        store.put(f"step000020/{name}", b"x")
    with logged() as lines:
        assert store.load_latest(0, 1, identity)["step"] == 5
    skipped = [line for line in lines if line.startswith("skipping")]
    assert len(skipped) == 1 and "does not match its manifest (SHA-256 differs" in skipped[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cloud", sorted(launchers.TEMPLATES))
def test_launcher_template_validates_and_starts_a_real_script(cloud):
    cfg, world = launchers.check_template(cloud)
    assert world == 8 and isinstance(cfg, train.Config) and cfg.ckpt_url
    request = launchers.load_template(cloud)

    def broken(edit) -> dict:
        r = copy.deepcopy(request)
        edit(r)
        return r

    wrong_field, wrong_type, bad_script, bad_option = {
        "sagemaker": (lambda r: r.update(EnableSpot=True),
                      lambda r: r["ResourceConfig"].update(InstanceCount="1"),
                      lambda r: r["AlgorithmSpecification"]["ContainerArguments"].__setitem__(
                          4, "chapters/ch24_cloud/trian.py"),
                      lambda r: r["AlgorithmSpecification"]["ContainerArguments"].append("--spot")),
        "vertex": (lambda r: r["jobSpec"].update(workerPools=[]),
                   lambda r: r["jobSpec"]["workerPoolSpecs"][0]["machineSpec"].update(acceleratorCount="8"),
                   lambda r: r["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]["args"].__setitem__(
                       2, "chapters/ch24_cloud/trian.py"),
                   lambda r: r["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]["args"].append("--spot")),
        "pai": (lambda r: r.update(JobSpec=r["JobSpecs"]),
                lambda r: r["JobSpecs"][0].update(PodCount="2"),
                lambda r: r.update(UserCommand=r["UserCommand"].replace("train.py", "trian.py")),
                lambda r: r.update(UserCommand=r["UserCommand"] + " --spot")),
    }[cloud]
    for edit in (wrong_field, wrong_type):
        with pytest.raises(launchers.TemplateError):
            launchers.validate_request(cloud, broken(edit))
    # the image is the one chapter 23 builds, pinned by its tag; `:latest` or no tag is refused
    image = launchers.template_image(cloud, request)
    assert image.endswith("/" + launchers.IMAGE_TAG)
    dockerfile = (Path(launchers.REPO) / "chapters/ch23_containers/Dockerfile").read_text()
    assert f"-t {launchers.IMAGE_TAG} " in dockerfile
    for unpinned in (image.replace(":ch23", ":latest"), image.replace(":ch23", "")):
        with pytest.raises(launchers.TemplateError, match="not pinned"):
            launchers.check_image(unpinned)
    launchers.check_image(image.replace(":ch23", "@sha256:" + "0" * 64))
    with pytest.raises(launchers.TemplateError, match="does not exist"):
        launchers.check_template(cloud, broken(bad_script))
    with pytest.raises(launchers.TemplateError, match="does not accept"):
        launchers.check_template(cloud, broken(bad_option))
    # --grace-s promises no more than torchrun's --shutdown-timeout (it SIGKILLs the ranks then:
    # 110 s under SageMaker's documented 120 s, torchrun's default 30 s elsewhere), and torchrun
    # must end before SageMaker kills it; one second more of either is refused
    words, _ = launchers.template_command(cloud, request)
    limit = {"sagemaker": 110, "vertex": 30, "pai": 30}[cloud]
    assert launchers.check_grace(cloud, words, cfg) == limit == cfg.grace_s

    def longer_grace(r):
        if cloud == "sagemaker":
            args = r["AlgorithmSpecification"]["ContainerArguments"]
            args[args.index("--grace-s") + 1] = str(limit + 1)
        elif cloud == "vertex":
            args = r["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]["args"]
            args[args.index("--grace-s") + 1] = str(limit + 1)
        else:
            r["UserCommand"] = r["UserCommand"].replace(f"--grace-s {limit}", f"--grace-s {limit + 1}")
    with pytest.raises(launchers.TemplateError, match="--grace-s"):
        launchers.check_template(cloud, broken(longer_grace))

    # --out holds the run id the checkpoints carry, so it must outlive the machine, as must a
    # local --ckpt-url: the container's own disk is refused
    def moved(option: str):
        def edit(r):
            if cloud == "pai":
                value = _opt_value(r["UserCommand"].split(), option)
                r["UserCommand"] = r["UserCommand"].replace(f"{option} {value}",
                                                            f"{option} /workspace/ch24")
            else:
                args = (r["AlgorithmSpecification"]["ContainerArguments"] if cloud == "sagemaker"
                        else r["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]["args"])
                args[args.index(option) + 1] = "/workspace/ch24"
        return edit
    for option in ("--out", "--ckpt-url"):
        with pytest.raises(launchers.TemplateError, match=f"{option} /workspace/ch24 is not kept"):
            launchers.check_template(cloud, broken(moved(option)))
    if cloud == "sagemaker":
        def longer_shutdown(r):
            args = r["AlgorithmSpecification"]["ContainerArguments"]
            args[args.index("--shutdown-timeout") + 1] = "121"
        with pytest.raises(launchers.TemplateError, match="outlives sagemaker's 120 s"):
            launchers.check_template(cloud, broken(longer_shutdown))


@pytest.mark.timeout(30)
def test_torchrun_shutdown_timeout_is_read_from_the_templates_environment(monkeypatch):
    """torchrun takes its shutdown timeout from --shutdown-timeout, else PET_SHUTDOWN_TIMEOUT,
    else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s: `torchrun_shutdown_s` agrees with torch's own
    parser and LaunchConfig under each environment, and `check_template` reads the template's
    environment (SageMaker's Environment, Vertex's containerSpec.env): a Vertex template whose
    environment shortens torchrun's timeout below --grace-s, or a SageMaker one without the
    option whose environment outlives the platform's 120 s, is refused."""
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.run import parse_args

    for name in launchers.TORCHRUN_SHUTDOWN_ENV:
        monkeypatch.delenv(name, raising=False)
    bare = ["torchrun", "--standalone", "--nproc_per_node=8", "chapters/ch24_cloud/train.py"]
    given = bare[:3] + ["--shutdown-timeout", "110"] + bare[3:]
    envs = [{}, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "20"}, {"PET_SHUTDOWN_TIMEOUT": "45"},
            {"PET_SHUTDOWN_TIMEOUT": "45", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "20"}]
    seen = []
    for words in (bare, given):
        for env in envs:
            with monkeypatch.context() as m:
                for k, v in env.items():
                    m.setenv(k, v)
                args = parse_args(words[1:])  # PET_* are read when the parser is built
                torch_s = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=8,
                                       shutdown_timeout=args.shutdown_timeout).shutdown_timeout
            assert launchers.torchrun_shutdown_s(words, env)[0] == torch_s, (words, env)
            seen.append(torch_s)
    assert seen == [30, 20, 45, 45, 110, 110, 110, 110]
    # the image sets neither variable (chapter 23's Dockerfile)
    dockerfile = (Path(launchers.REPO) / "chapters/ch23_containers/Dockerfile").read_text()
    assert not any(name in dockerfile for name in launchers.TORCHRUN_SHUTDOWN_ENV)

    vertex = launchers.load_template("vertex")  # --grace-s 30, torchrun's default 30 s
    spec = vertex["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]
    assert launchers.template_env("vertex", vertex) == {}
    spec["env"] = [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "30"}]
    launchers.check_template("vertex", vertex)
    spec["env"][0]["value"] = "20"  # control: the ranks are killed 20 s after SIGTERM
    with pytest.raises(launchers.TemplateError, match="--grace-s 30 but the ranks are killed 20"):
        launchers.check_template("vertex", vertex)
    sagemaker = launchers.load_template("sagemaker")  # --shutdown-timeout 110 --grace-s 110
    sagemaker["Environment"] = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "200"}
    launchers.check_template("sagemaker", sagemaker)  # the option wins
    args = sagemaker["AlgorithmSpecification"]["ContainerArguments"]
    del args[args.index("--shutdown-timeout"):args.index("--shutdown-timeout") + 2]
    sagemaker["Environment"] = {"PET_SHUTDOWN_TIMEOUT": "110"}
    launchers.check_template("sagemaker", sagemaker)
    sagemaker["Environment"] = {"PET_SHUTDOWN_TIMEOUT": "121"}
    with pytest.raises(launchers.TemplateError, match="PET_SHUTDOWN_TIMEOUT .*outlives"):
        launchers.check_template("sagemaker", sagemaker)
    sagemaker["Environment"] = {}  # no option, no environment: 30 s < --grace-s 110
    with pytest.raises(launchers.TemplateError, match="--grace-s 110 but the ranks are killed 30"):
        launchers.check_template("sagemaker", sagemaker)


@pytest.mark.timeout(10)
def test_grace_budget_worked_example():
    """The lesson's worked example: 7e9 parameters x 12 B (fp32 weights, Adam m and v) over two
    nodes is 42 GB per node; at 1 GB/s per node and a 5 s step."""
    per_node = 7e9 * 12 / 2
    assert per_node == 42e9
    assert seconds_to_commit(step_s=5, save_s=per_node / 1e9) == 47
    assert largest_checkpoint_bytes(30, 5, 1e9) == 25e9  # GCP spot, K8s default: too small
    assert largest_checkpoint_bytes(120, 5, 1e9) == 115e9  # AWS spot: fits
    assert largest_checkpoint_bytes(30, 31, 1e9) == 0.0  # a step longer than the grace
    # exercise 1: 60 GB per node at 2 GB/s, 3 s steps; 2 s margin
    assert seconds_to_commit(step_s=3, save_s=60e9 / 2e9) == 33
    assert largest_checkpoint_bytes(30, 3, 2e9, margin_s=2) == 50e9


@pytest.mark.timeout(10)
def test_the_lessons_measured_numbers_are_the_committed_data():
    """The save and verification times and the signal-to-commit figures the lesson quotes, read
    from figures/data.json (what `plots.measure` recorded)."""
    data = json.loads((SCRIPT.parent / "figures" / "data.json").read_text())
    medians = {int(mb): sorted(v)[len(v) // 2] for mb, v in data["save_s"].items()}
    readme = (SCRIPT.parent / "README.md").read_text()
    quoted = ", ".join(f"{medians[mb]:.3f} s for {mb}" for mb in (1, 4, 16, 64))
    assert quoted.replace(" s for 1,", " s for 1 MiB,") in readme.replace("\n", " "), quoted
    rate = round(64 * 2**20 / medians[64] / 1e6)
    assert f"about {rate} MB/s at 64 MiB" in readme.replace("\n", " ")
    verify = {int(mb): sorted(v)[len(v) // 2] for mb, v in data["verify_s"].items()}
    load = sorted(data["load_s"]["64"])[1]
    quoted = (f"{verify[1]:.3f} s for 1 MiB to {verify[64]:.3f} s for 64 MiB, about "
              f"{round(64 * 2**20 / verify[64] / 1e6, -1):.0f} MB/s")
    assert quoted in readme.replace("\n", " "), quoted
    assert f"took {verify[64]:.3f} s, a save {medians[64]:.3f} s" in readme.replace("\n", " ")
    assert verify[64] < medians[64] / 5  # "under a fifth of the save"
    whole = f"64 MiB (read, check, `torch.load(weights_only=True)`) took {load:.3f} s"
    assert whole in readme.replace("\n", " "), whole
    for key in ("sigterm", "spot"):
        run = data[key]
        assert 0 < run["seconds"] < run["allowed_s"] and run["torchrun_exit"] != 0
        assert f"{run['seconds']:.3f} s" in readme.replace("\n", " "), key
