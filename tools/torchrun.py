"""torchrun, as `./course run` starts it: the same launcher, with a failed run summarised in one line.

    python tools/torchrun.py --standalone --nproc_per_node=2 chapters/ch03_data_parallel/train.py

When a rank fails, torchrun stops the others and ends with a ~40-line `ChildFailedError` traceback
whose first entry is often a rank it stopped itself ("rank 1 ... SIGTERM"). The ranks have already
said what went wrong, above it; this prints which rank failed first, with its exit code, and exits
with that code.

Before starting, a rendezvous endpoint on this machine (`--rdzv-endpoint HOST:PORT`, or
`--master-addr/--master-port` without `--standalone`) whose port another program already listens on
is refused in one line naming the program: torchrun's c10d agent would find the port taken, assume
another agent hosts the store there, and block in the `TCPStore` constructor without a word, which
neither `join_timeout` nor `read_timeout` bounds (chapter 13 measured 700 s); a static rendezvous
fails with EADDRINUSE. A port held by another torchrun agent (a second node started on this
machine) is left alone. Everything else is torchrun's own `main`.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys


def describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def option(argv: list[str], *names: str) -> str | None:
    """The value of a torchrun option given as `--name=value` or `--name value` (either spelling
    of the name: torchrun accepts `--rdzv-endpoint` and `--rdzv_endpoint`)."""
    spellings = {n for name in names for n in (name, name.replace("-", "_"))}
    for i, arg in enumerate(argv):
        if arg == "--" or (not arg.startswith("-") and i and not argv[i - 1].startswith("-")):
            break  # the script and its own options begin
        key, eq, value = arg.partition("=")
        if key in spellings:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def rendezvous_endpoint(argv: list[str]) -> tuple[str, int] | None:
    """(host, port) this launch rendezvouses at, or None (--standalone picks a free port)."""
    if "--standalone" in argv:
        return None
    endpoint = option(argv, "--rdzv-endpoint")
    if endpoint:
        host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "29400")
        return host.strip("[]") or "localhost", int(port)
    port = option(argv, "--master-port")
    if port:
        return option(argv, "--master-addr") or "127.0.0.1", int(port)
    return None


def is_this_machine(host: str) -> bool:
    try:
        theirs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    mine = {"127.0.0.1", "::1"}
    for name in (socket.gethostname(), socket.getfqdn()):
        try:
            mine |= {a[4][0] for a in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    return bool(theirs & mine) or any(a.startswith("127.") for a in theirs)


def listener(port: int) -> tuple[int, str] | None:
    """(pid, command line) of the process listening on TCP `port` here, from /proc (Linux), or
    None when it cannot be told (another user's process, another OS)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else []):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
                return int(pid), cmd.decode(errors="replace").strip()
        except OSError:
            continue
    return None


AGENTS = ("torchrun", "torch.distributed.run")  # how a torchrun agent's command line reads


def held_port(argv: list[str]) -> str | None:
    """One line when the rendezvous port on this machine is held by a program that is not a
    torchrun agent (torchrun would block without a word); None when all is well."""
    endpoint = rendezvous_endpoint(argv)
    if endpoint is None or not is_this_machine(endpoint[0]):
        return None
    host, port = endpoint
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return None  # free: this agent will host the store
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return None
    holder = listener(port)
    if holder is None or any(agent in holder[1] for agent in AGENTS):
        return None  # another agent of this job (or nothing we can name): let torchrun decide
    pid, cmd = holder
    cmd = cmd if len(cmd) <= 70 else cmd[:69] + "…"
    return (f"course: the rendezvous port {host}:{port} is held by another program (pid {pid}: "
            f"{cmd}); torchrun would block there without a word. Choose another port in "
            "--rdzv-endpoint (or --master-port).")


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # The agent's per-process notices ("Sending process ... SIGTERM", "failed (exitcode ...)")
    # repeat what the summary below says.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    problem = held_port(argv)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    try:
        torchrun(argv)
    except ChildFailedError as e:
        rank, first = e.get_first_failure()
        others = len(e.failures) - 1
        stopped = f"; torchrun then stopped {others} other rank{'s' * (others > 1)}" if others else ""
        print(f"course: {e.name} failed: rank {rank} {describe(first.exitcode)} first{stopped}. "
              "Its own messages are above.", file=sys.stderr)
        return first.exitcode if first.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
