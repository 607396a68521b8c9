"""The local Slurm cluster's processes: what the machine needs for them, and how they stop.

`missing_requirements` says why this machine cannot run the daemons (not root, a command or the
munge user missing), or None. `stop_pids` stops daemons by their PIDs (TERM, then KILL), never by
name, so a Slurm or munge already running on the machine is left alone; `processes_under` finds
the job processes that outlived slurmd (they still use the cluster's folder).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = (*DAEMONS, "sbatch", "srun", "scontrol", "scancel")


def missing_requirements() -> str | None:
    """None when this machine can run the cluster, else the reason (for a test's probe)."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (its daemons run as root, munged as munge)"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"{', '.join(missing)} not installed (./course setup --system installs slurm-wlm and munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "there is no munge user (the munge package creates it)"
    return None


def processes_under(root: Path) -> list[int]:
    """PIDs of processes that still use this cluster's folder (a job step or batch script that
    outlived slurmd: its command line, working directory or an open file lies under `root`)."""
    root_s, out = str(Path(root).resolve()), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            text = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            links = [os.readlink(d / "cwd")] + [os.readlink(f) for f in (d / "fd").iterdir()]
        except OSError:
            continue
        if root_s in text or any(link.startswith(root_s + "/") for link in links):
            out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    """Is the process there and not a zombie?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop_pids(pids: dict[str, int], procs: dict[str, subprocess.Popen] | None = None,
              grace: float = 10.0) -> list[str]:
    """SIGTERM each daemon by PID (slurmd, slurmctld, then munged), SIGKILL what is left after
    `grace` s; reap our own children. Returns the names that needed SIGKILL."""
    procs = procs or {}
    order = [n for n in reversed(DAEMONS) if n in pids] + [n for n in pids if n not in DAEMONS]
    for name in order:
        try:
            os.kill(pids[name], signal.SIGTERM)
        except ProcessLookupError:
            pass
    killed = []
    for name in order:
        deadline = time.monotonic() + grace
        while _alive(pids[name]) and time.monotonic() < deadline:
            if name in procs and procs[name].poll() is not None:
                break
            time.sleep(0.1)
        if name in procs and procs[name].poll() is None or name not in procs and _alive(pids[name]):
            try:
                os.kill(pids[name], signal.SIGKILL)
                killed.append(name)
            except ProcessLookupError:
                pass
        if name in procs:
            procs[name].wait(timeout=5)
    return killed
