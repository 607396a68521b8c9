"""Figures for the chapter 06 lesson (`python tools/figures.py ch06`; `--rerun` re-measures).

The paper's panel is the formula; the tiny model's panels are measured (recorded in
figures/data.json by `measure`): train.py runs on two CPU processes and its counts (bytes held
at rest and at the peak of a step, bytes handed to collectives) are drawn beside what the
formulas predict.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from chapters.ch06_hybrid_zero import memory, zeropp
from common.results import save_figure

PARTS = (("params", "parameters"), ("grads", "gradients"), ("optim", "optimizer states"),
         ("buffers", "collective buffers"))
WAYS = ("DDP", "ZeRO-1", "ZeroRedundancyOptimizer", "ZeRO-2", "ZeRO-3", "FSDP2")
SHORT = {"ZeroRedundancyOptimizer": "ZeRO-1\n(torch ZeRO\nRedundancy\nOptimizer)", "FSDP2": "FSDP2"}


def paper_bars(ax) -> None:
    """Per-device GB at each stage for Ψ = 7.5B on 64 GPUs: the formula (paper's table 1)."""
    bottoms = [0.0] * 4
    for key, label in PARTS[:3]:
        heights = [memory.per_rank_bytes(s, int(7.5e9), 64, 2, 2, 12)[key] / 1e9 for s in range(4)]
        ax.bar(memory.STAGES, heights, bottom=bottoms, label=label)
        bottoms = [a + h for a, h in zip(bottoms, heights)]
    for x, total in enumerate(bottoms):
        ax.annotate(f"{total:.3g}", (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GB per device (formula)")
    ax.set_title("ZeRO paper, table 1: Ψ = 7.5B, N_d = 64, K = 12 (formula)", fontsize=9)
    ax.legend(fontsize=8)


def measured_bars(ax, saved: dict, ways: tuple[str, ...]) -> None:
    """Bytes one rank held, counted from the tensors: at rest after a step (left bar of each
    pair) and each category's peak during the step (right bar; the categories' peaks need not
    fall on the same moment)."""
    for j, (key, label) in enumerate(PARTS):
        for k, when in enumerate(("rest", "peak")):
            xs = [i + (k - 0.5) * 0.4 for i in range(len(ways))]
            bottom = [sum(saved[when][w].get(c, 0) for c, _ in PARTS[:j]) / 1e3 for w in ways]
            height = [saved[when][w].get(key, 0) / 1e3 for w in ways]
            ax.bar(xs, height, 0.38, bottom=bottom, color=f"C{j}", alpha=1.0 if k else 0.55,
                   label=label if k else None)
    ax.set_xticks(range(len(ways)), [SHORT.get(w, w) for w in ways], fontsize=7)
    ax.set_ylabel("kB per rank (measured)")
    ax.set_title("Tiny GPT, 2 CPU ranks, float64 (measured): at rest (pale) | each category's "
                 "highest in a step (solid)", fontsize=9)
    ax.legend(fontsize=7)


def volume_bars(ax, saved: dict, psi_bytes: int) -> None:
    """Bytes handed to collectives in one step, counted by the probe, in units of Ψ bytes,
    beside the paper's 2Ψ / 3Ψ."""
    stage = {"DDP": 0, "ZeRO-1": 1, "ZeroRedundancyOptimizer": 1, "ZeRO-2": 2, "ZeRO-3": 3, "FSDP2": 3}
    measured = [saved["volume"][w] / psi_bytes for w in WAYS]
    ax.bar(range(len(WAYS)), measured, color="C4", label="measured (tensors handed to collectives)")
    ax.scatter(range(len(WAYS)), [memory.paper_volume(stage[w]) for w in WAYS], color="k",
               marker="_", s=400, label="paper: 2Ψ, 2Ψ, 2Ψ, 3Ψ (formula)", zorder=3)
    for i, v in enumerate(measured):
        ax.annotate(f"{v:.3g}", (i, v + 0.08), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(WAYS)), [SHORT.get(w, w) for w in WAYS], fontsize=7)
    ax.set_ylabel("volume per step / (Ψ bytes)")
    ax.set_ylim(0, 4.2)
    ax.set_title("Communication in one step, 2 CPU ranks (measured)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")


MEASURE_S = 40


def measure() -> dict:
    """train.py on two CPU processes: the bytes each way held and handed to collectives, and Ψ bytes."""
    from chapters.ch06_hybrid_zero.train import Config, build_model, global_batches
    from common.checkpoint import load_checkpoint
    from common.launch import run_torchrun

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(__file__).with_name("train.py")
        run_torchrun(script, nproc=2, args=["--no-mixed-precision"], out_dir=tmp, timeout=300)
        saved = load_checkpoint(Path(tmp) / "final_params.pt")
    cfg = Config()
    vocab = global_batches(cfg, torch.device("cpu"))[2]
    z = memory.sizes(build_model(cfg, vocab, torch.device("cpu")))
    return {**{when: {w: saved[when][w] for w in WAYS} for when in ("rest", "peak", "volume")},
            "psi_bytes": int(z["psi"] * z["b"])}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    saved, psi_bytes = data, data["psi_bytes"]

    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [2, 3]})
    paper_bars(axes[0])
    measured_bars(axes[1], saved, WAYS[:5])
    fig.tight_layout()
    paths = [fig_dir / "memory_per_stage.png"]
    save_figure(fig, paths[0])

    fig, ax = plt.subplots(figsize=(7, 3.4))
    volume_bars(ax, saved, psi_bytes)
    fig.tight_layout()
    paths.append(fig_dir / "comm_volume.png")
    save_figure(fig, paths[1])

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, generator=g, dtype=torch.float64) * torch.linspace(0.1, 2, 512, dtype=torch.float64)
    q, scale = zeropp.quantize_blockwise(x, 64)
    err = (x - zeropp.dequantize_blockwise(q, scale, 512, torch.float64)).abs()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(err.numpy(), ".", ms=2, label="|x − x̂| (int8, blocks of 64), measured")
    ax.step(range(512), (scale.double().repeat_interleave(64) / 2).numpy(), where="post",
            color="C3", label="bound: scale / 2 = max|x| / 254 per block")
    ax.set_xlabel("weight index")
    ax.set_ylabel("absolute error")
    ax.set_title("ZeRO++ qwZ: block-wise int8 weights stay within half a step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "qwz_error.png")
    save_figure(fig, paths[2])
    return paths
