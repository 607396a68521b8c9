"""Figures for the chapter 22 lesson (`python tools/figures.py ch22`; `--rerun ch22` re-measures,
as root: it brings up network namespaces and runs train.py across them).

`measure()` records, in figures/data.json: all-reduce times across namespace "nodes" with links
shaped by tc, beside bytes ÷ bandwidth, and the bytes the nodes' interfaces sent beside the
formula's; two controls of the timing band (links shaped to twice and to half the rate the
prediction assumes); and the output of a launch whose GLOO_SOCKET_IFNAME is missing (the
wrong-interface failure the lesson shows). The notebook reads the same file when it
cannot run namespaces itself.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

from chapters.ch22_networking import calculator, netns

MEASURE_S = 600  # 10 launches across namespaces, 1 to 1.5 min each on a loaded 2-core machine
SCRIPT = Path(__file__).with_name("train.py")
# nodes, ranks per node, Mbit/s, MiB per all-reduce: the figure's runs, then the system tests'
# (tests/test_ch22_networking.py: 25 Mbit/s and 1 MiB, where the link, not the CPU, sets the time)
RUNS = [(2, 1, 100, 2), (2, 1, 200, 2), (2, 1, 400, 2), (4, 1, 200, 2), (2, 2, 200, 2),
        (4, 1, 25, 1), (2, 2, 25, 1)]
# Controls of train.TIME_BAND at the tests' setting: 4 nodes whose links are shaped to `shaped`
# while train.py predicts for `predicted` (Mbit/s): a prediction 2x off either way must leave it.
CONTROLS = [(4, 1, 50, 25, 1), (4, 1, 12.5, 25, 1)]


def namespace_run(nodes: int, nproc: int, rate: float, extra: list[str] = (), set_ifname: bool = True,
                  timeout: float = 200) -> dict:
    """One run of train.py across `nodes` namespaces: exit codes, wall time, summary (if any)."""
    with tempfile.TemporaryDirectory(prefix="ch22-") as tmp:  # removed afterwards
        out = Path(tmp)
        args = ["--steps", "6", "--rate-mbit", rate, "--timeout", 30, "--device", "cpu", "--out", out,
                "--wire-bytes", *extra]
        with netns.namespaces(nodes, rate) as topo:
            cmds = netns.torchrun_commands(topo, SCRIPT, args, nproc, set_ifname=set_ifname)
            t0 = time.monotonic()
            codes, outs = netns.run_nodes(cmds, timeout)
            wall = time.monotonic() - t0
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() \
            else None
    return {"nodes": nodes, "nproc": nproc, "rate_mbit": rate, "codes": codes, "wall_s": wall,
            "summary": summary, "outputs": outs}


def key_lines(output: str, n: int = 4) -> list[str]:
    """The lines a learner should read in a failed launch: the errors, not the stack frames."""
    pat = re.compile(r"(Error|refused|timed out|timeout|Connection)", re.IGNORECASE)
    lines = [re.sub(r"^\[/\S+\] ", "", re.sub(r"retry=\d+", "retry=N", ln.strip()))[:220]
             for ln in output.splitlines()
             if pat.search(ln) and not ln.lstrip().startswith(("frame", "File", "Exception raised"))]
    return list(dict.fromkeys(lines))[:n]


def measure() -> dict:
    if os.geteuid() != 0 or netns.probe():
        raise RuntimeError("plots.measure() for ch22 needs root and network namespaces")
    runs = []
    for nodes, nproc, rate, mib in RUNS:
        r = namespace_run(nodes, nproc, rate, ["--allreduce-mib", mib])
        figs = r["summary"]["figures"]
        runs.append({"nodes": nodes, "ranks_per_node": nproc, "rate_mbit": rate, "allreduce_mib": mib,
                     "codes": r["codes"],
                     "wall_s": round(r["wall_s"], 1),
                     "times": {k: v for k, v in figs.items() if k.endswith("MiB")},
                     "wire": {k: v for k, v in figs.items() if k.endswith("bytes on the wire")},
                     "checks": [{k: c[k] for k in ("name", "kind", "measured", "expected", "ok")}
                                for c in r["summary"]["checks"]]})
    controls = []
    for nodes, nproc, shaped, predicted, mib in CONTROLS:  # links shaped to `shaped`, told `predicted`
        r = namespace_run(nodes, nproc, shaped, ["--rate-mbit", predicted, "--allreduce-mib", mib])
        times = {k: v for k, v in r["summary"]["figures"].items() if k.endswith("MiB")}
        controls.append({"nodes": nodes, "ranks_per_node": nproc, "shaped_mbit": shaped,
                         "predicted_mbit": predicted, "allreduce_mib": mib, "times": times,
                         "ratios": {k: v["measured"] / v["expected"] for k, v in times.items()}})
    bad = namespace_run(2, 1, 200, ["--timeout", 10], set_ifname=False, timeout=60)
    wrong = {"codes": bad["codes"], "wall_s": round(bad["wall_s"], 1),
             "lines": [key_lines(o) for o in bad["outputs"]]}
    return {"runs": runs, "band_controls": controls, "wrong_interface": wrong,
            "command": " ".join(map(str, netns.torchrun_commands(
                netns.Topology("c22PID", 2, 200, netns=["c22PIDn0", "c22PIDn1"],
                               ifname=["c22PIDv0", "c22PIDv1"], addr=["10.22.0.1", "10.22.0.2"]),
                "chapters/ch22_networking/train.py", ["--rate-mbit", 200, "--wire-bytes"])[0]))}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4))
    markers = {"library all_reduce": "o", "leader all-reduce": "s", "hand flat ring": "^"}
    top = 0.0
    for run in data["runs"]:
        for name, fig_ in run["times"].items():
            kind = name.split(" time")[0]
            if fig_["expected"] is None:
                continue
            top = max(top, fig_["expected"])
            ax.scatter(fig_["expected"], fig_["measured"], marker=markers.get(kind, "x"),
                       color=f"C{data['runs'].index(run)}",
                       label=f"{run['nodes']}x{run['ranks_per_node']} @ {run['rate_mbit']:g} Mbit/s, "
                       f"{run.get('allreduce_mib', 2):g} MiB"
                       if kind == "hand flat ring" else None, zorder=3)
    ax.plot([0, top * 1.05], [0, top * 1.05], "k--", lw=1, label="measured = predicted")
    lo, hi = 0.95, 1.8  # train.TIME_BAND
    ax.fill_between([0, top * 1.05], [0, lo * top * 1.05], [0, hi * top * 1.05], color="0.9",
                    label="band 0.95–1.8×", zorder=0)
    ax.set_xlabel("predicted: bytes leaving a node ÷ shaped rate (s)")
    ax.set_ylabel("measured median (s)")
    ax.set_title("All-reduces across namespaces (o library, ▲ hand ring, ■ leaders)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(fig_dir / "shaped_allreduce.png")
    fig.savefig(paths[-1], dpi=120, metadata={"Software": None})
    plt.close(fig)

    # the calculator: time of a 14 GB all-reduce vs nodes (8 GPUs each), per scheme and fabric
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    nv, S = calculator.FABRICS["nvlink4"], 14e9
    ms = [2, 4, 8, 16, 32, 64, 128]
    for key, style in (("ib_ndr", "-"), ("eth_100_tcp", ":")):
        f = calculator.FABRICS[key]
        ax.plot(ms, [calculator.flat_time("ring", S, 8 * m, f) for m in ms], "C0" + style,
                label=f"flat ring, {f.name}")
        ax.plot(ms, [calculator.leader_time(S, 8, m, nv, f) for m in ms], "C1" + style,
                label=f"leaders, {f.name}")
        ax.plot(ms, [calculator.rail_time(S, 8, m, nv, f) for m in ms], "C2" + style,
                label=f"rails, {f.name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes (8 GPUs each, NVLink inside)")
    ax.set_ylabel("all-reduce of 14 GB (s), α–β model")
    ax.set_title("Calculator: one NIC per node (flat, leaders) vs one per GPU (rails)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(fig_dir / "calculator.png")
    fig.savefig(paths[-1], dpi=120, metadata={"Software": None})
    plt.close(fig)
    return paths
