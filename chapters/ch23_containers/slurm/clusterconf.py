"""The local Slurm cluster's files: its ports, its munge key, its slurm.conf.

`write_cluster_files` fills the cluster's folder before any daemon starts (localcluster.py
starts them): state and spool folders, a fresh munge key that only the munge user reads, an
empty plugstack.conf and the slurm.conf that `slurm_conf` writes. Ports that are taken are
refused with a sentence before anything is written.

The config is the smallest one that runs real jobs on a laptop or a CI machine: process
tracking by /proc (`proctrack/linuxproc`), no task binding (`task/none`), CPUs as consumable
resources (`select/cons_tres`), no cgroup, no accounting (so `sacct` does not work: use
`scontrol show job`). `SlurmdParameters=config_overrides` lets the node declare more CPUs than
the machine has (default: at least 4), so a 2-core machine still runs two 2-rank jobs.
"""

from __future__ import annotations

import os
import pwd
import socket
from pathlib import Path

NODE = "localhost"


class ClusterError(RuntimeError):
    """The cluster cannot start or a job cannot be followed; the message says why and where."""


def port_free(port: int) -> bool:
    """Can a daemon bind this TCP port on every address (as slurmctld and slurmd do)?"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_ports(n: int, start: int = 16817) -> list[int]:
    """The first `n` free ports from `start` on (Slurm's own defaults are 6817 and 6818)."""
    out, port = [], start
    while len(out) < n and port < start + 2000:
        if port_free(port):
            out.append(port)
        port += 1
    if len(out) < n:
        raise ClusterError(f"no {n} free TCP ports between {start} and {start + 2000}")
    return out


def slurm_conf(root: Path, ctld_port: int, slurmd_port: int, cpus: int, memory_mb: int) -> str:
    """The cluster's slurm.conf: one node, one partition, no cgroup, no accounting."""
    host = socket.gethostname().split(".")[0]  # slurmctld must run on a host named here
    return f"""\
# Written by chapters/ch23_containers/slurm/clusterconf.py for localcluster.py: a one-node practice cluster.
ClusterName=course
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=600
InactiveLimit=0
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=course Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


def write_cluster_files(root: Path, ports: tuple[int, int], cpus: int) -> Path:
    """Write the cluster's folder `root` for a node declaring `cpus` CPUs and half the machine's
    memory (at least 1 GiB), its daemons on `ports` (slurmctld, slurmd); returns its slurm.conf."""
    taken = [p for p in ports if not port_free(p)]
    if taken:
        raise ClusterError(f"port(s) {taken} are taken (another Slurm?); pick others with --ports")
    munge = pwd.getpwnam("munge")
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)  # munged (as munge) must reach its folder inside
    for sub in ("state", "spool"):
        (root / sub).mkdir(exist_ok=True)
    mdir = root / "munge"
    mdir.mkdir(exist_ok=True)
    os.chmod(mdir, 0o755)  # munged: "execute permissions for all required" on its socket dir
    key = mdir / "munge.key"
    key.write_bytes(os.urandom(1024))  # a fresh key: this cluster trusts nothing else
    os.chmod(key, 0o400)
    for p in (mdir, key):
        os.chown(p, munge.pw_uid, munge.pw_gid)
    (root / "plugstack.conf").write_text("")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, *ports, cpus, max(1024, mem // 2)))
    return conf
