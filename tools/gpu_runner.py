"""Running one row of `./course gpu-check`'s plan and reading what it recorded.

`execute` starts the row's command in a session of its own, bounded by its cap (killed with every
process it started at the cap), then reads its summary.json: a row passes when it ends as it
expects and every fatal check in its summary passed. Part of tools/gpu_check.py (its docstring
tells the whole check).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from tools.gpu_plan import Run
from tools.gpu_scripts import REPO_ROOT


def run_env(threads: int, base: dict | None = None) -> dict:
    """The environment of one run: the caller's, with this checkout first on PYTHONPATH and the
    caller's entries kept after it (packages carried as wheels stay visible), OMP_NUM_THREADS
    set to the run's share of the cores, unbuffered output."""
    env = dict(os.environ if base is None else base)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != REPO_ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *kept])
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


ERROR_LINE = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception|Exit)\b.*|^error: .*|.*\bFAILED\b.*")


def first_error_line(output: str) -> str:
    """The first line that says what went wrong: an exception's line, an 'error: ...' line, a
    failed check; else the last non-empty line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        bare = re.sub(r"^\[(?:rank|default)\d+\]:\s*", "", line)
        if ERROR_LINE.match(bare) and not bare.startswith("Traceback"):
            return bare[:300]
    return lines[-1][:300] if lines else ""


def execute(run: Run, timeout: float | None = None) -> Run:
    """Run it, bounded by its cap (or `timeout`): on the cap it is killed with every process it
    started (its ranks live in sessions of their own). Then read its summary.json."""
    from common.launch import kill_tree

    cap = timeout or run.cap_s or 240.0
    out = Path(run.command[run.command.index("--out") + 1]) if "--out" in run.command else None
    if out is not None and out.exists():  # a summary left by an earlier check must not be read
        shutil.rmtree(out)
    start = time.perf_counter()
    proc = subprocess.Popen(run.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=run_env(run.threads), cwd=REPO_ROOT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=cap)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        code = None
    run.seconds = round(time.perf_counter() - start, 1)
    missing = re.search(r"No module named '([\w.]+)'", output)
    summary_path = out / "summary.json" if out else None
    try:
        summary = json.loads(summary_path.read_text()) if summary_path and summary_path.exists() else None
    except json.JSONDecodeError:  # cut short mid-write (a run killed at its cap)
        summary = None
    if summary:
        fatal = [c for c in summary["checks"] if c["kind"] != "timing"]
        timing = [c for c in summary["checks"] if c["kind"] == "timing"]
        run.checks_passed, run.checks_total = sum(c["ok"] for c in fatal), len(fatal)
        run.timing_ok, run.timing_total = sum(c["ok"] for c in timing), len(timing)
        run.figures = summary["figures"]
    message_ok = not run.expect_message or re.search(run.expect_message, output) is not None
    if (code == run.expect_exit and message_ok and summary is not None
            and run.checks_passed == run.checks_total):
        run.status, run.reason = "pass", ""
    elif missing and code not in (0, None):
        run.status, run.reason = "skipped", f"needs {missing.group(1).split('.')[0]} (not installed)"
    else:
        run.status = "FAIL"
        if code is None:
            run.reason = f"timed out after {cap:.0f} s: killed with its ranks"
        elif code != run.expect_exit:
            run.reason = f"exit {code}" + (f" (expected {run.expect_exit})" if run.expect_exit else "")
        elif not message_ok:
            run.reason = f"exit {code} without its designed message /{run.expect_message}/"
        elif summary is None:
            run.reason = f"exit {code}, no summary.json"
        else:
            run.reason = f"exit {code}, {run.checks_total - run.checks_passed} check(s) failed"
        run.error_line = first_error_line(output)
    if run.status != "pass":
        run.output_tail = output[-3000:]
    return run

