"""A real single-node Slurm cluster on localhost, for practice and for the course's tests.

Writes its own `slurm.conf` and munge key into a fresh folder, starts `munged` (as the munge
user, with a private socket), `slurmctld` and `slurmd -N localhost`, waits until the node is
idle, and stops the three daemons by their PIDs. It uses its own ports, folders and munge
socket, so a Slurm or munge already running on the machine is left alone; ports that are taken
are refused with a sentence. Needs root (the daemons run as root, munged as `munge`) and
Debian's `slurm-wlm` and `munge` (`./course setup --system`).

Its files are clusterconf.py's (the smallest slurm.conf that runs real jobs on a laptop or a CI
machine: no cgroup, no accounting, so `sacct` does not work: use `scontrol show job`); its
daemons are stopped by PID with daemons.py's `stop_pids`. This module starts them and follows
jobs (`sbatch`, `wait`), and is the command line.

From Python:

    from chapters.ch23_containers.slurm.localcluster import LocalSlurm
    with LocalSlurm() as cluster:                 # up, node idle; down in finally
        job = cluster.sbatch(["chapters/ch23_containers/slurm/single_node.sbatch"])
        print(cluster.wait(job, timeout=90))      # {'JobState': 'COMPLETED', ...}

From a shell (as root):

    python -m chapters.ch23_containers.slurm.localcluster up      # prints: export SLURM_CONF=...
    export SLURM_CONF=/tmp/course-slurm/slurm.conf
    sbatch chapters/ch23_containers/slurm/single_node.sbatch
    squeue; scontrol show job 1
    python -m chapters.ch23_containers.slurm.localcluster down
    python -m chapters.ch23_containers.slurm.localcluster run -- sinfo   # up, a command, down
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chapters.ch23_containers.slurm.clusterconf import (
    NODE,
    ClusterError,
    free_ports,
    write_cluster_files,
)
from chapters.ch23_containers.slurm.daemons import (
    _alive,
    missing_requirements,
    processes_under,
    stop_pids,
)

DEFAULT_DIR = Path(tempfile.gettempdir()) / "course-slurm"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def parse_fields(text: str) -> dict[str, str]:
    """`scontrol show` output ('Key=Value Key=Value ...') as a dict."""
    return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", text))


class LocalSlurm:
    """A one-node Slurm cluster in a folder of its own; a context manager (down in finally).

    `directory`: where config, key, sockets, state and logs go (default: a fresh temporary
    folder, removed at `down` unless `keep`). `cpus`: CPUs the node declares (default: the
    machine's, at least 4). `ports`: (slurmctld, slurmd); default: the first free from 16817.
    """

    def __init__(self, directory: str | Path | None = None, cpus: int | None = None,
                 ports: tuple[int, int] | None = None, start_timeout: float = 30.0,
                 keep: bool = False):
        self.own_dir = directory is None
        self.root = Path(directory) if directory else Path(
            tempfile.mkdtemp(prefix=f"course-slurm-{os.getpid()}-"))
        self.cpus = cpus or max(4, os.cpu_count() or 1)
        self.ports = ports
        self.start_timeout = start_timeout
        self.keep = keep
        self.pids: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}

    # --- the environment clients need ----------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """os.environ with SLURM_CONF pointing at this cluster (sbatch exports it to the job)."""
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        env.update(extra or {})
        return env

    def command(self, args: list[str], timeout: float = 20, check: bool = True,
                env: dict[str, str] | None = None, cwd: str | Path | None = None) -> str:
        """Run a Slurm client command against this cluster; its stdout (stderr in the error)."""
        r = subprocess.run(args, env=env or self.env(), cwd=cwd, capture_output=True, text=True,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise ClusterError(f"{' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
        return r.stdout + (r.stderr if not check else "")

    # --- up ------------------------------------------------------------------------------------
    def _write_files(self) -> None:
        if self.ports is None:
            self.ports = tuple(free_ports(2))
        write_cluster_files(self.root, self.ports, self.cpus)

    def _start(self, name: str, args: list[str], **kw) -> None:
        log = open(self.root / f"{name}.console", "wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                start_new_session=True, **kw)
        log.close()
        self.procs[name], self.pids[name] = proc, proc.pid
        (self.root / "cluster.json").write_text(json.dumps(
            {"pids": self.pids, "ports": list(self.ports), "conf": str(self.conf)}))

    def _wait_for(self, what: str, ok, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ClusterError(f"{name} exited ({proc.returncode}) while waiting for "
                                       f"{what}: {self.log_tail(name)}")
            if ok():
                return
            time.sleep(0.3)
        raise ClusterError(f"{what} did not happen within {timeout:.0f} s; logs in {self.root}: "
                           + " | ".join(self.log_tail(n) for n in self.procs))

    def log_tail(self, name: str, lines: int = 3) -> str:
        texts = []
        for suffix in ("log", "console"):
            p = self.root / f"{name}.{suffix}"
            if p.exists():
                texts += p.read_text(errors="replace").splitlines()[-lines:]
        return f"{name}: " + " / ".join(t.strip() for t in texts[-lines:])

    def node_state(self) -> str:
        r = subprocess.run(["scontrol", "show", "node", NODE], env=self.env(),
                           capture_output=True, text=True, timeout=10)
        return parse_fields(r.stdout).get("State", "") if r.returncode == 0 else ""

    def up(self) -> LocalSlurm:
        """Write the files, start munged, slurmctld and slurmd, wait for the node to be idle."""
        reason = missing_requirements()
        if reason:
            raise ClusterError(reason)
        try:
            self._write_files()
            m = self.root / "munge"
            self._start("munged", ["munged", "-F", f"--socket={m}/munge.socket",
                                   f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid",
                                   f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
                        user="munge", group="munge", cwd=m)
            self._wait_for("munged's socket", (m / "munge.socket").exists, self.start_timeout)
            self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            self._start("slurmd", ["slurmd", "-D", "-N", NODE, "-f", str(self.conf)])
            self._wait_for(f"node {NODE} idle", lambda: self.node_state().startswith("IDLE"),
                           self.start_timeout)
        except BaseException:
            self.down()
            raise
        return self

    # --- down ----------------------------------------------------------------------------------
    def down(self) -> list[str]:
        """Cancel every job of this cluster, stop the daemons by PID (TERM, then KILL after 10 s)
        and remove the folder if it is ours. Returns the names of daemons that needed KILL."""
        if self.pids.get("slurmctld") and _alive(self.pids["slurmctld"]):
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env(),
                           capture_output=True, timeout=10)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self._running_jobs():
                time.sleep(0.5)
        killed = stop_pids(self.pids, self.procs)
        killed += stop_pids({f"job process {pid}": pid for pid in processes_under(self.root)})
        self.pids, self.procs = {}, {}
        if self.own_dir and not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        return killed

    def _running_jobs(self) -> bool:
        r = subprocess.run(["squeue", "-h", "-t", "RUNNING,COMPLETING", "-o", "%i"], env=self.env(),
                           capture_output=True, text=True, timeout=10)
        return r.returncode == 0 and bool(r.stdout.strip())

    def __enter__(self) -> LocalSlurm:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # --- jobs ----------------------------------------------------------------------------------
    def sbatch(self, args: list[str], env: dict[str, str] | None = None,
               cwd: str | Path | None = None) -> int:
        """Submit (`sbatch --parsable ARGS`) and return the job id."""
        out = self.command(["sbatch", "--parsable", *args], env=self.env(env), cwd=cwd)
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, RunTime, Restarts, StdOut, ...)."""
        return parse_fields(self.command(["scontrol", "show", "job", str(job_id)]))

    def wait(self, job_id: int, timeout: float = 90, until=None) -> dict[str, str]:
        """Poll `scontrol show job` until the job ends (or `until(fields)` holds); a bounded
        wait that raises ClusterError with the job's state and its output file's tail."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            state = fields.get("JobState", "")
            if (until(fields) if until else state in FINAL_STATES):
                return fields
            if time.monotonic() > deadline:
                out = Path(fields.get("StdOut", "/nonexistent"))
                tail = out.read_text(errors="replace")[-600:] if out.exists() else "(no output)"
                raise ClusterError(f"job {job_id} still {state} after {timeout:.0f} s; "
                                   f"its output ends: {tail}")
            time.sleep(0.5)



# --- command line ------------------------------------------------------------------------------
def _cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m chapters.ch23_containers.slurm.localcluster",
        description="Bring a one-node Slurm cluster up and down on localhost (root; slurm-wlm "
                    "and munge installed). It uses its own folder, ports and munge socket.")
    sub = p.add_subparsers(dest="action", required=True)
    for name, text in (("up", "start the daemons, wait for the node, print SLURM_CONF"),
                       ("down", "stop the daemons started by 'up' (by PID) and remove the folder"),
                       ("status", "say whether the daemons of 'up' are running"),
                       ("run", "up, run a command with SLURM_CONF set, down")):
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("--dir", default=str(DEFAULT_DIR), help=f"cluster folder (default {DEFAULT_DIR})")
        if name in ("up", "run"):
            s.add_argument("--cpus", type=int, default=None, help="CPUs the node declares (default: max(4, cores))")
            s.add_argument("--ports", type=int, nargs=2, default=None, metavar=("CTLD", "SLURMD"),
                           help="slurmctld and slurmd ports (default: the first free from 16817)")
            s.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the node to be idle")
        if name == "run":
            s.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    a = p.parse_args(argv)
    root = Path(a.dir)
    state = root / "cluster.json"
    running = state.exists() and any(_alive(pid) for pid in json.loads(state.read_text())["pids"].values())
    try:
        if a.action == "status":
            print(f"running: {json.loads(state.read_text())['pids']}" if running else "not running")
            return 0 if running else 1
        if a.action == "down":
            if not state.exists():
                print(f"nothing to stop: no {state}")
                return 1
            cluster = LocalSlurm(root, keep=False)
            cluster.pids, cluster.own_dir = json.loads(state.read_text())["pids"], True
            killed = cluster.down()
            print("stopped" + (f" ({', '.join(killed)} needed SIGKILL)" if killed else ""))
            return 0
        if running:
            raise ClusterError(f"a cluster from {root} is already running: 'down' first, or pass --dir")
        cluster = LocalSlurm(root, a.cpus, tuple(a.ports) if a.ports else None, a.timeout)
        if a.action == "up":
            cluster.up()
            # Leave the daemons running: forget our Popen objects without stopping them.
            cluster.procs = {}
            print(f"node {NODE} idle; daemons {cluster.pids}\nexport SLURM_CONF={cluster.conf}")
            return 0
        cmd = [c for c in a.cmd if c != "--"] if a.cmd[:1] == ["--"] else a.cmd
        if not cmd:
            p.error("run needs a command after --")
        cluster.own_dir = True  # 'run' leaves nothing behind
        with cluster:
            return subprocess.run(cmd, env=cluster.env()).returncode
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_cli())
