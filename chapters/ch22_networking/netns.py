"""Several "nodes" on one Linux machine: network namespaces on a bridge, links shaped with `tc`.

Each node is a network namespace with its own network stack (its own interfaces, addresses,
ports and routing table) but the same processes, files and CPUs as the host. A veth pair joins
each namespace to one Linux bridge (the "switch"); the namespace's end gets 10.22.0.(k+1)/24 and
a `tc tbf` queue that limits what the node sends to --rate-mbit. One torchrun per namespace with
c10d rendezvous on node 0's address then trains across the nodes exactly as across real
machines: every byte between nodes crosses a shaped veth link, and the kernel counts it
(`/sys/class/net/<veth>/statistics/tx_bytes`, which train.py's --wire-bytes reads). `tc netem` (added latency, loss)
is not in this machine's kernel: latency comes from the calculator, not from the links.

Needs root and iproute2 (`ip`, `tc`). Everything created is named with this process's id and
removed when the run ends, also on error or Ctrl-C.

Run (as root):
    python chapters/ch22_networking/netns.py --help
    python chapters/ch22_networking/netns.py                       # 2 nodes, 200 Mbit/s, runs train.py
    python chapters/ch22_networking/netns.py --nodes 4 --nproc-per-node 2 --rate-mbit 400
    python chapters/ch22_networking/netns.py --hold                # bring up, print commands, wait
What it runs on every node k (here for 2 nodes; node 0 hosts the rendezvous):
    ip netns exec c22PIDn0 env GLOO_SOCKET_IFNAME=c22PIDv0 torchrun --nnodes=2 --nproc_per_node=1 \\
        --local-addr=10.22.0.1 --rdzv-backend=c10d --rdzv-endpoint=10.22.0.1:29500 \\
        --rdzv-conf=is_host=1 chapters/ch22_networking/train.py --rate-mbit 200 --wire-bytes
(c10d rendezvous numbers the nodes itself: --node-rank is for the static rendezvous only.)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.config import RunConfig, parse_config
from common.launch import kill_tree

REPO_ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.22.0"
RDZV_PORT = 29500


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one iproute2 command; a failure raises with the command and its stderr."""
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


@dataclass
class Topology:
    """What `namespaces()` created: the namespaces, their interfaces and addresses."""

    prefix: str
    nodes: int
    rate_mbit: float | None
    bridge: str = ""
    netns: list[str] = field(default_factory=list)
    ifname: list[str] = field(default_factory=list)  # the node's interface (inside its namespace)
    addr: list[str] = field(default_factory=list)

    def exec_prefix(self, k: int) -> list[str]:
        """The command prefix that runs a program on node k, with gloo told its interface."""
        return ["ip", "netns", "exec", self.netns[k], "env", f"GLOO_SOCKET_IFNAME={self.ifname[k]}",
                f"NCCL_SOCKET_IFNAME={self.ifname[k]}"]


def shape(netns: str, ifname: str, rate_mbit: float) -> None:
    """Token bucket on the node's outgoing side: at most rate_mbit leave the node. The bucket
    (burst) is 32 kbit, so a message of megabytes is paced at the rate from its first bytes."""
    sh("ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", ifname, "root", "tbf",
       "rate", f"{rate_mbit}mbit", "burst", "32kbit", "latency", "400ms")


def teardown(prefix: str, nodes: int) -> list[str]:
    """Delete everything named with `prefix` (namespaces take their veth ends with them).
    Returns the errors, never raises: it runs in `finally` blocks."""
    errors = []
    for k in range(nodes):
        for cmd in (["ip", "netns", "del", f"{prefix}n{k}"], ["ip", "link", "del", f"{prefix}p{k}"]):
            p = sh(*cmd, check=False)
            if p.returncode and "No such" not in p.stderr and "Cannot find" not in p.stderr \
                    and "not find" not in p.stderr:
                errors.append(p.stderr.strip())
    p = sh("ip", "link", "del", f"{prefix}br", check=False)
    if p.returncode and "Cannot find" not in p.stderr and "not exist" not in p.stderr:
        errors.append(p.stderr.strip())
    return errors


@contextlib.contextmanager
def namespaces(nodes: int, rate_mbit: float | None = None, prefix: str | None = None):
    """Bring up `nodes` namespaces on a bridge, yield the `Topology`, tear it all down after.

    Names: c22<pid>n<k> (namespace), c22<pid>v<k> (its interface), c22<pid>p<k> (the bridge's
    port), c22<pid>br (the bridge); interface names stay within Linux's 15 characters."""
    prefix = prefix or f"c22{os.getpid()}"
    topo = Topology(prefix, nodes, rate_mbit, bridge=f"{prefix}br")
    try:
        sh("ip", "link", "add", topo.bridge, "type", "bridge")
        sh("ip", "link", "set", topo.bridge, "up")
        for k in range(nodes):
            ns, inner, port = f"{prefix}n{k}", f"{prefix}v{k}", f"{prefix}p{k}"
            addr = f"{SUBNET}.{k + 1}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", inner, "type", "veth", "peer", "name", port)
            sh("ip", "link", "set", inner, "netns", ns)
            sh("ip", "link", "set", port, "master", topo.bridge)
            sh("ip", "link", "set", port, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", inner)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            if rate_mbit:
                shape(ns, inner, rate_mbit)
            topo.netns.append(ns)
            topo.ifname.append(inner)
            topo.addr.append(addr)
        yield topo
    finally:
        teardown(prefix, nodes)


def probe() -> str | None:
    """None if this process can create and delete a network namespace and shape a veth, else
    the reason (for the tests' `require_system`)."""
    try:
        with namespaces(1, rate_mbit=100, prefix=f"c22q{os.getpid()}"):
            pass
    except (RuntimeError, OSError) as e:
        return f"cannot create a network namespace here: {e}"
    return None


def torchrun_commands(topo: Topology, script: str, args: list[str], nproc_per_node: int = 1,
                      port: int = RDZV_PORT, set_ifname: bool = True) -> list[list[str]]:
    """One torchrun per node, inside its namespace, c10d rendezvous on node 0's address.
    `set_ifname=False` leaves GLOO_SOCKET_IFNAME unset: the failure the lesson shows."""
    cmds = []
    for k in range(topo.nodes):
        prefix = topo.exec_prefix(k) if set_ifname else ["ip", "netns", "exec", topo.netns[k]]
        cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", f"--nnodes={topo.nodes}",
               f"--nproc_per_node={nproc_per_node}", f"--local-addr={topo.addr[k]}",
               "--rdzv-backend=c10d",
               f"--rdzv-endpoint={topo.addr[0]}:{port}", "--rdzv-id=ch22",
               *(["--rdzv-conf=is_host=1"] if k == 0 else []), str(script), *map(str, args)]
        cmds.append(cmd)
    return cmds


def run_nodes(cmds: list[list[str]], timeout: float = 120) -> tuple[list[int], list[str]]:
    """Start every node's command, wait for all (each in its own session; on timeout its whole
    process tree is killed with `common.launch.kill_tree`: torchrun starts each rank in a session
    of its own, so killing the agent's process group alone would leave the ranks running).
    Returns the exit codes (None: killed at the timeout) and the outputs."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=REPO_ROOT, env=env, start_new_session=True) for c in cmds]
    deadline = time.monotonic() + timeout
    codes, outs = [], []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                codes.append(p.returncode)
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
                out, _ = p.communicate()
                codes.append(None)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
    return codes, outs


@dataclass
class Config(RunConfig):
    nodes: int = 2
    """Network namespaces ("nodes") on the bridge."""
    nproc_per_node: int = 1
    """torchrun processes in every namespace (ranks per node)."""
    rate_mbit: float = 200.0
    """Bandwidth every node may send at, in Mbit/s (tc tbf on its link); 0: unshaped."""
    hold: bool = False
    """Bring the nodes up, print the command for each, wait for Enter, tear down (run nothing)."""
    launch_timeout: float = 120.0
    """Seconds the whole multi-node run may take before every node is killed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.nodes <= 200:
            raise ValueError(f"--nodes must be between 1 and 200, got {self.nodes}")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.rate_mbit < 0:
            raise ValueError(f"--rate-mbit must be 0 or positive, got {self.rate_mbit}")


def validate(cfg: Config, world_size: int) -> None:
    """A launcher, not a rank: it starts its own ranks (nodes × nproc-per-node) in namespaces."""


def main(cfg: Config) -> int:
    if os.geteuid() != 0:
        print("netns.py: error: network namespaces need root (run it with sudo)", file=sys.stderr)
        return 2
    script = REPO_ROOT / "chapters" / "ch22_networking" / "train.py"
    args = ["--steps", cfg.steps, "--seed", cfg.seed, "--timeout", min(cfg.timeout, 60),
            "--rate-mbit", cfg.rate_mbit, "--device", "cpu", "--wire-bytes"] \
        + (["--out", cfg.out] if cfg.out else [])
    with namespaces(cfg.nodes, cfg.rate_mbit or None) as topo:
        print(f"{cfg.nodes} nodes on bridge {topo.bridge}: " + ", ".join(
            f"{ns} {a} ({i})" for ns, a, i in zip(topo.netns, topo.addr, topo.ifname)))
        cmds = torchrun_commands(topo, script, args, cfg.nproc_per_node)
        if cfg.hold:
            for c in cmds:
                print(" ".join(c))
            input("Up. Run the commands above in other terminals; press Enter to tear down. ")
            return 0
        codes, outs = run_nodes(cmds, cfg.launch_timeout)
        print(outs[0], end="")
        for k, (c, o) in enumerate(zip(codes, outs)):
            if c != 0:
                print(f"node {k} exited with {c}:\n{o[-3000:]}", file=sys.stderr)
        return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
