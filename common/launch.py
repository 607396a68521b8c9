"""Launch helpers for tests and notebooks: a chapter script under torchrun, or a function on N gloo ranks.

Both are bounded by a timeout and never hang a test session: a launch that runs too long is
killed with its whole process group, and the error carries the tail of its output.

- `run_torchrun(script, nproc, args)` → `LaunchResult` with the parsed `summary.json`.
- `run_on_ranks(fn, world_size, *args)` → `[fn(*args) on rank 0, on rank 1, ...]`. Ranks are
  *spawned* (forking a process that has already run torch can hang); `fn` must therefore be
  importable (defined at module level in a chapter or test module), and reads its rank with
  `torch.distributed.get_rank()`. One start serves many assertions: group them.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
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
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        out, _ = proc.communicate()
        raise LaunchError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{out[-4000:]}") from None
    return proc.returncode, out


def _launch(cmd: list[str], out_dir: Path, timeout: float, env: dict | None,
            expect_ok: bool) -> LaunchResult:
    returncode, output = _run(cmd, timeout, env, REPO_ROOT)
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
    return _launch(cmd, out_dir, timeout, env, expect_ok)


def run_python(script: str | Path, args: list[str] = (), timeout: float = 120,
               out_dir: str | Path | None = None, env: dict | None = None,
               expect_ok: bool = True, pass_out: bool = True) -> LaunchResult:
    """`python script args...` (a world of one, or a script that starts its own ranks)."""
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="run-"))
    extra = ["--out", str(out_dir)] if pass_out else []
    cmd = [sys.executable, str(script), *extra, *map(str, args)]
    return _launch(cmd, out_dir, timeout, env, expect_ok)


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
