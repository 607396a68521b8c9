"""Launch helpers for tests and notebooks: a chapter script under torchrun, or a function on N gloo ranks.

Both are bounded by a timeout and never hang a test session: a launch that runs too long is
killed with its whole process group, and the error carries the tail of its output.

- `run_torchrun(script, nproc, args)` → `LaunchResult` with the parsed `summary.json`.
- Within one test session a launch is made once: the tests record every successful launch
  (`COURSE_RUN_RECORD`, set by tests/conftest.py), and a notebook the tests execute
  (`COURSE_RUN_REPLAY`, set for its kernel only, tests/test_notebooks.py) that launches exactly
  the same command (interpreter, script, processes, options, environment) into an empty folder
  receives that run's output folder and console instead of running it again; only runs that
  started from an empty folder and succeeded are recorded. Tests never replay, so two runs a test compares are
  always two real runs; a learner's notebook always launches for real.
- `started(cmd)` (a context manager) and `wait_until(pred, proc, what)`: a run that the caller
  acts on while it runs (signals it, waits for a file it writes); leaving the block kills
  whatever is left of it, torchrun and its ranks.
- `run_on_ranks(fn, world_size, *args)` → `[fn(*args) on rank 0, on rank 1, ...]`. Ranks are
  *spawned* (forking a process that has already run torch can hang); `fn` must therefore be
  importable (defined at module level in a chapter or test module), and reads its rank with
  `torch.distributed.get_rank()`. One start serves many assertions: group them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from common.distributed import teardown_distributed

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class LaunchResult:
    returncode: int
    output: str
    out_dir: Path
    summary: dict | None

    def check(self, name: str) -> dict:
        """The summary's check called `name` (KeyError listing the names if absent)."""
        checks = {c["name"]: c for c in (self.summary or {}).get("checks", [])}
        if name not in checks:
            raise KeyError(f"no check {name!r}; checks are {sorted(checks)}")
        return checks[name]


class LaunchError(AssertionError):
    pass


def _children() -> dict[int, list[int]]:
    """parent pid -> child pids of every process on the machine (/proc, else `ps`)."""
    children: dict[int, list[int]] = {}
    stats = list(Path("/proc").glob("[0-9]*/stat"))
    if stats:
        pairs = []
        for stat in stats:
            try:
                pairs.append((int(stat.read_text().rsplit(")", 1)[1].split()[1]), int(stat.parent.name)))
            except (OSError, IndexError, ValueError):
                continue
    else:  # macOS: no /proc
        ps = subprocess.run(["ps", "-A", "-o", "ppid=", "-o", "pid="], capture_output=True, text=True)
        pairs = [tuple(map(int, line.split())) for line in ps.stdout.splitlines() if line.strip()]
    for parent, child in pairs:
        children.setdefault(parent, []).append(child)
    return children


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid`, its process group and every descendant. torchrun starts each rank in
    a session of its own, so killing torchrun's process group alone leaves its ranks running
    (measured with torch 2.14.1); the descendants are collected first, since a killed parent's
    children are re-parented at once."""
    children, tree, i = _children(), [pid], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def _run(cmd: list[str], timeout: float, env: dict | None, cwd: Path) -> tuple[int, str]:
    # One thread per rank unless the caller chose otherwise: torchrun's default too, which it
    # otherwise announces in a 4-line banner on every launch of more than one process.
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun and every rank it started
        out, _ = proc.communicate()
        raise LaunchError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{out[-4000:]}") from None
    return proc.returncode, out


def _run_key(kind: str, script: str | Path, nproc: int, args, env: dict | None) -> str:
    """What makes two launches the same run: the script, the processes, the options and the
    environment the caller adds (not the output folder, not the timeout)."""
    what = [kind, sys.executable, str(Path(script).resolve()), nproc, [str(a) for a in args],
            sorted((env or {}).items())]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]


def _empty(folder: Path) -> bool:
    """A run into `folder` starts from nothing (a script may resume from what a folder holds)."""
    return not folder.exists() or (folder.is_dir() and not any(folder.iterdir()))


def _record(key: str, out_dir: Path, output: str) -> None:
    """Keep a successful run that started from an empty folder (its output folder as it was when
    the run ended, and its console) for an identical launch by a notebook later in this test
    session (COURSE_RUN_RECORD)."""
    folder = os.environ.get("COURSE_RUN_RECORD")
    if not folder or (Path(folder) / key).exists() or not out_dir.is_dir():
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=folder))
    shutil.copytree(out_dir, tmp / "out")
    (tmp / "console.json").write_text(json.dumps({"output": output, "out_dir": str(out_dir)}))
    try:
        tmp.rename(Path(folder) / key)
    except OSError:  # an identical run was recorded meanwhile
        shutil.rmtree(tmp, ignore_errors=True)


def _replayed(key: str, out_dir: Path) -> str | None:
    """The console of an identical run this test session recorded, its folder copied into
    `out_dir`, when replaying is on (COURSE_RUN_REPLAY: a notebook executed by the tests)."""
    folder = os.environ.get("COURSE_RUN_REPLAY")
    if not folder or not (Path(folder) / key).is_dir() or not _empty(out_dir):
        return None
    saved = Path(folder) / key
    shutil.copytree(saved / "out", out_dir, dirs_exist_ok=True)
    with open(saved / "replayed_into.txt", "a") as f:  # for whoever wonders which runs were reused
        f.write(f"{out_dir}\n")
    console = json.loads((saved / "console.json").read_text())
    return console["output"].replace(console["out_dir"], str(out_dir))


def _launch(cmd: list[str], out_dir: Path, timeout: float, env: dict | None,
            expect_ok: bool, key: str | None = None) -> LaunchResult:
    output = _replayed(key, out_dir) if key else None
    if output is not None:
        returncode = 0
    else:
        fresh = _empty(out_dir)
        returncode, output = _run(cmd, timeout, env, REPO_ROOT)
        if key and fresh and returncode == 0:
            _record(key, out_dir, output)
    summary_path = out_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if expect_ok and returncode != 0:
        raise LaunchError(f"exit status {returncode}: {' '.join(cmd)}\n{output[-6000:]}")
    return LaunchResult(returncode, output, out_dir, summary)


def run_torchrun(script: str | Path, nproc: int = 2, args: list[str] = (), timeout: float = 120,
                 out_dir: str | Path | None = None, env: dict | None = None,
                 expect_ok: bool = True) -> LaunchResult:
    """`torchrun --standalone --nproc_per_node=nproc script --out DIR args...` on CPU.

    --standalone lets the OS choose the rendezvous port, so concurrent launches never
    collide. With `expect_ok`, a non-zero exit raises `LaunchError` with the output's tail.
    """
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="run-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(script), "--out", str(out_dir), "--device", "cpu",
           *map(str, args)]
    key = _run_key("torchrun", script, nproc, args, env)
    return _launch(cmd, out_dir, timeout, env, expect_ok, key)


@contextlib.contextmanager
def started(cmd: list[str], env: dict | None = None, log: Path | None = None, cwd: Path = REPO_ROOT):
    """Start `cmd` in its own session and yield its `Popen` (text output on `proc.stdout`, or in
    the file `log`). On leaving the block, also by an error, it and every process it started
    (torchrun's ranks) are killed if still running, and it is reaped: nothing outlives the caller."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "w")) if log is not None else subprocess.PIPE
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=full_env,
                                cwd=cwd, start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:  # (a reaped pid may already belong to another process)
                kill_tree(proc.pid)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def wait_until(pred, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    """Poll `pred()` every 50 ms until it holds; `LaunchError` (with the output's tail) if the
    started run `proc` ends first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            tail = proc.stdout.read()[-3000:] if proc.stdout is not None else ""
            raise LaunchError(f"the run ended (status {proc.returncode}) before {what}\n{tail}")
        if time.monotonic() > deadline:
            raise LaunchError(f"never saw {what} within {timeout:.0f} s")
        time.sleep(0.05)


def last_logged_step(metrics: Path) -> int:
    """The step of the last complete line of a run's metrics.jsonl (-1 before the first)."""
    metrics = Path(metrics)
    if not metrics.exists():
        return -1
    lines = [ln for ln in metrics.read_text().splitlines(keepends=True) if ln.endswith("\n")]
    return json.loads(lines[-1])["step"] if lines else -1


def run_python(script: str | Path, args: list[str] = (), timeout: float = 120,
               out_dir: str | Path | None = None, env: dict | None = None,
               expect_ok: bool = True, pass_out: bool = True) -> LaunchResult:
    """`python script args...` (a world of one, or a script that starts its own ranks)."""
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="run-"))
    extra = ["--out", str(out_dir)] if pass_out else []
    cmd = [sys.executable, str(script), *extra, *map(str, args)]
    key = _run_key("python", script, 1, args, env) if pass_out else None
    return _launch(cmd, out_dir, timeout, env, expect_ok, key)


def _rank_main(fn, rank: int, world_size: int, tmp: str, args: tuple, kwargs: dict,
               timeout_s: float) -> None:
    torch.set_num_threads(1)  # as torchrun does: ranks share the cores
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            result = fn(*args, **kwargs)
        finally:
            teardown_distributed()  # lets gloo's workers go idle before this process exits
        torch.save(result, os.path.join(tmp, f"result{rank}.pt"))
    except BaseException:
        Path(tmp, f"error{rank}.txt").write_text(traceback.format_exc())
        sys.exit(1)


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` spawned gloo ranks; return their results.

    A rank that raises fails the call with that rank's traceback; the others are stopped.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(fn, r, world_size, tmp, args, kwargs, timeout))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs):
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                time.sleep(0.5)  # let the failing rank finish writing its traceback
                for p in procs:
                    p.kill()
                break
            time.sleep(0.02)
        for p in procs:
            p.join()
        errors = sorted(Path(tmp).glob("error*.txt"))
        if errors:
            raise AssertionError("rank failed:\n" + "\n".join(e.read_text() for e in errors))
        missing = [r for r in range(world_size) if not Path(tmp, f"result{r}.pt").exists()]
        if missing:
            raise AssertionError(f"ranks {missing} gave no result within {timeout:.0f} s "
                                 f"(exit codes {[p.exitcode for p in procs]})")
        return [torch.load(Path(tmp, f"result{r}.pt"), weights_only=False)
                for r in range(world_size)]
