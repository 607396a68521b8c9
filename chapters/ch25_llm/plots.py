"""Figures for the chapter 25 lesson (redraw with `python tools/figures.py ch25`; re-measure the
loss curve with `python tools/figures.py --rerun ch25`, which runs train.py on two processes and
the composed run's 8-rank job, whose per-rank counts chapter 30 sets its planner beside)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from chapters.ch25_llm.model import PRESETS, forward_matmul_flops, llama_config, n_params
from common.results import save_figure

MEASURE_S = 120


def data_from_run(out_dir: Path) -> dict:
    """The loss curve and the reference lines of one run of train.py."""
    out_dir = Path(out_dir)
    summary = json.loads((out_dir / "summary.json").read_text())
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    figures = summary["figures"]
    return {"losses": [json.loads(line)["loss"] for line in lines],
            "lr": [json.loads(line)["lr"] for line in lines],
            "vocab_size": summary["config"]["vocab_size"],
            "unigram_entropy": figures["unigram entropy of the training tokens"]["measured"],
            "held_out_loss": figures["held-out loss"]["measured"],
            "world_size": summary["world_size"], "torch": summary["versions"]["torch"]}


def measure_composed() -> dict:
    """The composed run's 8-rank job (about a minute on two idle cores): what every rank counted
    (model state, bytes per mesh dimension, activations kept), for chapter 30's planner."""
    from chapters.ch25_llm.composed_checks import parity_worker, record
    from common.launch import run_on_ranks

    ranks = run_on_ranks(parity_worker, 8, None, timeout=600)
    return record([r["plans"] for r in ranks])


def measure() -> dict:
    from common.launch import REPO_ROOT, run_torchrun

    with tempfile.TemporaryDirectory() as tmp:
        run_torchrun(REPO_ROOT / "chapters" / "ch25_llm" / "train.py", nproc=2, out_dir=tmp,
                     timeout=600)
        data = data_from_run(Path(tmp))
    data["composed"] = measure_composed()
    return data


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(data["losses"], label=f"training loss ({data['world_size']} CPU ranks)")
    ax.axhline(math.log(data["vocab_size"]), ls=":", c="gray", label=f"ln V = ln {data['vocab_size']}")
    ax.axhline(data["unigram_entropy"], ls="--", c="k",
               label=f"unigram entropy {data['unigram_entropy']:.2f}")
    ax.scatter([len(data["losses"]) - 1], [data["held_out_loss"]], c="C3", zorder=3,
               label=f"held-out loss {data['held_out_loss']:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per token")
    ax.set_title("A Llama under FSDP2 learns context: below the unigram entropy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "loss.png")
    save_figure(fig, paths[-1])

    # formula only (computed at draw time): FLOPs per token of the gpu preset against T
    p = PRESETS["gpu"]
    config = llama_config(p["vocab_size"], p["hidden_size"], p["n_layers"], p["n_heads"],
                          p["n_kv_heads"], p["ffn_size"], p["seq_len"])
    lengths = [256, 512, 1024, 2048, 4096, 8192, 16384]
    parts = {k: [] for k in ("layers_linear", "head", "attention")}
    for t in lengths:
        for k, v in forward_matmul_flops(config, 1, t).items():
            parts[k].append(3 * v / t / 1e9)
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.stackplot(lengths, parts["layers_linear"], parts["head"], parts["attention"],
                 labels=["layers' linear products", "output head", "attention (full T×T)"])
    ax.axhline(6 * n_params(config, embeddings=False) / 1e9, c="k", ls="--", label="6·N")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("GFLOP per token (fwd + bwd)")
    ax.set_title("gpu preset (300M Llama): exact matmul FLOPs per token vs 6N")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    paths.append(fig_dir / "flops.png")
    save_figure(fig, paths[-1])
    return paths
