"""Figures for the chapter 28 lesson. batching.png and slots.png are counted schedules computed
at draw time from rank 0's share of train.py's 2-rank workload (nothing timed); overlap.png draws
the timelines of two engines serving 64 requests, recorded by `measure()` in figures/data.json.

    ./course figures ch28            # redraw from figures/data.json
    ./course figures --rerun ch28    # re-record the timelines (about 20 s), then redraw
"""

from __future__ import annotations

from pathlib import Path

from chapters.ch28_inference import workloads as WL
from chapters.ch28_inference.train import Config
from common.results import save_figure

MEASURE_S = 20


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    cfg = Config()
    fig_dir.mkdir(parents=True, exist_ok=True)
    # rank 0's share of the two-rank run the lesson quotes (request i on rank i mod 2)
    outs = [o for _, o in WL.workload(2 * cfg.requests_per_rank, cfg.max_decode, cfg.seed)][0::2]
    paths = []
    batches = [1, 2, 4, 8, 16, 32]
    measured = [WL.static_schedule(outs, b)["steps"] / WL.continuous_schedule(outs, b)["steps"] for b in batches]
    theory = [WL.expected_ratio(cfg.max_decode, b) for b in batches]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(batches, measured, "o-", label=f"counted on rank 0's share of the 2-rank run ({cfg.requests_per_rank} requests)")
    ax.plot(batches, theory, "k--", label=f"E[max of B] / E[mean], decode steps uniform on 1..{cfg.max_decode}")
    ax.axhline(1.5, c="gray", ls=":", label="goal 1.5")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch slots B")
    ax.set_ylabel("continuous / static (decode steps)")
    ax.set_title("Continuous batching gains what static batching pads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "batching.png")
    save_figure(fig, paths[-1])

    s, c = WL.static_schedule(outs, cfg.batch), WL.continuous_schedule(outs, cfg.batch)
    fig, ax = plt.subplots(figsize=(6.5, 3.0))
    names = ["static", "continuous"]
    ax.barh(names, [s["tokens"], c["tokens"]], label="useful token slots")
    ax.barh(names, [s["padded"], c["padded"]], left=[s["tokens"], c["tokens"]], label="padded / idle slots")
    ax.set_xlabel(f"slots = decode steps x {cfg.batch}")
    ax.set_title(f"{s['steps']} vs {c['steps']} decode steps for the same {s['tokens']} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "slots.png")
    save_figure(fig, paths[-1])
    paths.append(fig_dir / "overlap.png")
    save_figure(overlap_figure(data["timelines"]), paths[-1])
    return paths


def measure() -> dict:
    """The synchronous and the overlap engine's timelines on 64 requests of the default workload
    (one process), from their 20th plan (the first steps include one-off warm-up), 40 ms long,
    in ms from that plan's start; with each engine's overlap counts over the whole run."""
    import torch

    from chapters.ch28_inference import checks as C
    from chapters.ch28_inference import engine as E
    from chapters.ch28_inference import model as M
    from chapters.ch28_inference import train as T

    cfg = Config()
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        config, hf = T.build(cfg)
        llama = M.HandLlama(hf.state_dict(), config)
        work = WL.workload(64, cfg.max_decode, cfg.seed)
        reqs = [E.Request(C.prompt_of(cfg, config.vocab_size, 1000 + i, p)[0].tolist(), d)
                for i, (p, d) in enumerate(work)]
        runs = {mode: E.Engine(llama, cfg.n_blocks, cfg.block_size, cfg.batch, mode).run(reqs)
                for mode in ("continuous", "overlap")}
    finally:
        torch.set_default_dtype(dtype)
    out = {}
    for mode, run in runs.items():
        tl = run["timeline"]
        t0 = next(a for kind, no, a, _ in tl if kind == "schedule" and no == 20)
        after, during, _ = C.overlap_intervals(tl)
        out[mode] = {"after": after, "during": during,
                     "intervals": [[kind, round((a - t0) * 1e3, 4), round((b - t0) * 1e3, 4)]
                                   for kind, _, a, b in tl if 0 <= a - t0 < 0.04 and b - t0 < 0.04]}
    return {"timelines": out}


def overlap_figure(timelines: dict):
    """Plans (CPU) and steps (the executor) of both engines, 40 ms from their 20th plan."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(7.5, 2.8), sharex=True)
    for ax, (mode, tl) in zip(axes, timelines.items()):
        for kind, a, b in tl["intervals"]:
            ax.barh("CPU: plan" if kind == "schedule" else "executor: step", b - a, left=a,
                    color="tab:orange" if kind == "schedule" else "tab:blue")
        ax.set_title(f"{mode}: {tl['during']} of {tl['after']} plans made while the previous step ran",
                     fontsize=9)
    axes[-1].set_xlabel("ms since plan 20 began")
    fig.tight_layout()
    return fig
