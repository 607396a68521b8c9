"""Figures for the chapter 30 lesson (redraw with `python tools/figures.py ch30`; re-measure with
`python tools/figures.py --rerun ch30`, which runs train.py and fedavg.py on 2 CPU ranks)."""

from __future__ import annotations

import json
from pathlib import Path

from chapters.ch30_frontier import planner
from common.results import save_figure

MEASURE_S = 40
COLORS = {"compute": "#4c72b0", "tp_comm": "#dd8452", "pp_comm": "#55a868", "dp_comm": "#c44e52",
          "cp_comm": "#8172b3"}


def measure() -> dict:
    """Run both scripts on 2 CPU ranks; keep what the figures draw."""
    import tempfile

    from common.launch import run_torchrun

    here = Path(__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        p = run_torchrun(here / "train.py", nproc=2, out_dir=Path(tmp) / "plan", timeout=300).summary
        run_torchrun(here / "fedavg.py", nproc=2, out_dir=Path(tmp) / "fed", timeout=300)
        fed = json.loads((Path(tmp) / "fed" / "summary.json").read_text())
        curve = [json.loads(line)["test_accuracy"]
                 for line in (Path(tmp) / "fed" / "metrics.jsonl").read_text().splitlines()]
    steps = {k: {"predicted_ms": p["figures"][f"{k}=2 step time"]["expected"],
                 "measured_ms": p["figures"][f"{k}=2 step time"]["measured"],
                 "spread_ms": p["figures"][f"{k}=2 step time"]["spread"]} for k in ("dp", "tp", "pp")}
    checks = {c["name"]: c["measured"] for c in fed["checks"]}
    constants = {k: p["figures"][k]["measured"] for k in (
        "measured matmul rate per rank", "measured all-reduce alpha", "measured all-reduce bandwidth (1/beta)")}
    timing = [c for c in p["checks"] if c["kind"] == "timing"]
    ranking = {k: timing[0][k] for k in ("name", "expected", "measured", "ok")} if timing else None
    return {"steps": steps, "constants": constants, "ranking": ranking, "fedavg_accuracy": curve,
            "single_accuracy": checks["best single client's test accuracy (trained alone as long)"],
            "bounds": [fed["config"]["fedavg_accuracy"], fed["config"]["single_accuracy"]]}


def deepest_tp8_pipeline(spec: planner.ModelSpec, n_gpus: int) -> tuple[int, int, int]:
    """(dp, 8, pp) with the deepest pipeline whose pp divides both n/8 and the layers: pp = n/8
    where it can (7B on 64: 1 x 8 x 8), else fewer stages and a little dp (70B on 512: 80 layers,
    so pp = 16 and dp = 4, not pp = 64)."""
    pp = max(p for p in planner.divisors(n_gpus // 8) if spec.n_layers % p == 0)
    return n_gpus // (8 * pp), 8, pp


def alternatives(name: str) -> list[planner.Layout]:
    """The planner's choice and the fastest layout that fits of a few other shapes."""
    spec, cluster = planner.WORKED[name]
    best = planner.search(spec, cluster).layout
    out = [best]
    for shape in ((cluster.n_gpus, 1, 1), (cluster.n_gpus // 8, 8, 1),
                  deepest_tp8_pipeline(spec, cluster.n_gpus)):
        fits = [lay for lay in planner.layouts(spec, cluster.n_gpus)
                if (lay.dp, lay.tp, lay.pp) == shape
                and planner.memory_bytes(spec, lay) <= cluster.memory_bytes]
        if fits:
            lay = min(fits, key=lambda lay: (planner.step_time(spec, cluster, lay), lay))
            if lay not in out:
                out.append(lay)
    return out


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    drawn = set()
    for ax, name in zip(axes, planner.WORKED):
        spec, cluster = planner.WORKED[name]
        lays = alternatives(name)
        longest = 0.0
        for i, lay in enumerate(lays):
            terms, left = planner.step_terms(spec, cluster, lay), 0.0
            if lay.cp == 1:  # no cp group: the term is not drawn nor labelled
                terms.pop("cp_comm")
            drawn.update(terms)
            for term, value in terms.items():
                ax.barh(i, value, left=left, color=COLORS[term])
                left += value
            longest = max(longest, left)
            # every term by value: a segment a few pixels wide is still read here
            values = "  ".join(f"{t.replace('_comm', '')} {v:.2f}" for t, v in terms.items())
            ax.text(left, i, f" {left:.2f} s, {planner.memory_bytes(spec, lay) / 1e9:.0f} GB\n"
                    f" {values}", va="center", fontsize=6.5)
        ax.set_xlim(0, longest * 2.0)  # room for the labels right of the longest bar
        ax.set_yticks(range(len(lays)), [str(lay).replace(" rc=", "\nrc=") for lay in lays], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("predicted step time (s)")
        ax.set_title(f"{name}: chosen (top) vs best of other shapes", fontsize=9)
    shown = [t for t in COLORS if t in drawn]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[t]) for t in shown]
    fig.legend(handles, [t if t == "compute" else f"{t} ({t.replace('_comm', '')})" for t in shown],
               loc="lower center", ncol=len(shown), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # the legend below both panels, over no bar
    paths.append(save_figure(fig, fig_dir / "planner_terms.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    kinds = list(data["steps"])
    x = range(len(kinds))
    pred = [data["steps"][k]["predicted_ms"] for k in kinds]
    meas = [data["steps"][k]["measured_ms"] for k in kinds]
    lo = [m - data["steps"][k]["spread_ms"][0] for k, m in zip(kinds, meas)]
    hi = [data["steps"][k]["spread_ms"][1] - m for k, m in zip(kinds, meas)]
    a1.bar([i - 0.2 for i in x], pred, 0.4, label="predicted (planner, measured constants)", color="#4c72b0")
    a1.bar([i + 0.2 for i in x], meas, 0.4, yerr=[lo, hi], label="measured median (min-max)", color="#dd8452")
    a1.set_xticks(list(x), [f"{k}=2" for k in kinds])
    a1.set_ylabel("ms per step")
    rank = data.get("ranking")
    a1.set_title("tiny MLP on 2 CPU ranks (one run)" + (
        f"\npairs >= 1.5x apart, predicted: {rank['expected']}\nmeasured: {rank['measured']}"
        if rank else ""), fontsize=8)
    a1.legend(fontsize=7)
    curve = data["fedavg_accuracy"]
    a2.plot(range(len(curve)), curve, label="FedAvg global model (secure sum)", color="#55a868")
    a2.axhline(data["single_accuracy"], color="#c44e52", ls="--", label="best single client, alone")
    a2.axhline(data["bounds"][0], color="gray", ls=":", lw=1, label="bounds of the checks")
    a2.axhline(data["bounds"][1], color="gray", ls=":", lw=1)
    a2.set_xlabel("round")
    a2.set_ylabel("test accuracy (1024 held-out, 4 classes)")
    a2.set_title("2 clients, 95% of each shard from two classes", fontsize=9)
    a2.legend(fontsize=7)
    fig.tight_layout()
    paths.append(save_figure(fig, fig_dir / "measured.png"))
    return paths
