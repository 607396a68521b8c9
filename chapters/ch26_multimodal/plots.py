"""The lesson's figures: the generated pairs, the logits a rank builds against the world size,
and the training run (loss and zero-shot accuracy on held-out pairs).

    python tools/figures.py ch26           # redraws figures/*.png from figures/data.json
    python tools/figures.py --rerun ch26   # re-measures: runs train.py on 1, 2 and 4 ranks (~60 s)

`measure` runs the chapter's script and keeps what it counted (the logits bytes of each loss,
from its checks) and logged (metrics.jsonl of the 2-rank run); the formulas B² and 2·b·B are
drawn beside the counts at draw time.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from chapters.ch26_multimodal import contrastive, data
from common.launch import run_python, run_torchrun
from common.results import save_figure

SCRIPT = Path(__file__).resolve().parent / "train.py"
MEASURE_S = 60
B = 48  # the default global batch


def counted_logits(summary: dict) -> dict:
    """The counted logits bytes per rank of the global and local losses, from a run's checks."""
    found = {}
    for c in summary["checks"]:
        if c["name"].startswith("logits bytes per rank, "):
            found["local" if ", local" in c["name"] else "global"] = c["measured"]
    return found


def measure() -> dict:
    runs = {}
    for world in (1, 2, 4):
        out = Path(tempfile.mkdtemp(prefix="ch26-"))
        steps = ["--steps", "200"] if world == 2 else ["--steps", "1", "--eval-pairs", "16",
                                                         "--margin", "-1"]
        res = (run_python(SCRIPT, steps, out_dir=out) if world == 1
               else run_torchrun(SCRIPT, world, steps, out_dir=out, timeout=300))
        runs[world] = {"logits": counted_logits(res.summary)}
        if world == 2:
            runs[world]["metrics"] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            runs[world]["figures"] = res.summary["figures"]
    return {"runs": runs}


def _samples(path: Path) -> None:
    import matplotlib.pyplot as plt

    train_combos, held = data.split_combinations()
    images, _, which = data.make_pairs(8, 5, train_combos, size=32)
    held_images, _, held_which = data.make_pairs(4, 6, held, size=32)
    fig, axes = plt.subplots(2, 6, figsize=(9, 4.4))
    items = [(images[i], data.caption(*train_combos[int(which[i])]), False) for i in range(8)]
    items += [(held_images[i], data.caption(*held[int(held_which[i])]), True) for i in range(4)]
    for ax, (img, text, is_held) in zip(axes.flat, items):
        ax.imshow(img.permute(1, 2, 0).numpy())
        ax.set_xticks([])
        ax.set_yticks([])
        words = text.split()
        ax.set_title(" ".join(words[1:3]) + "\n" + " ".join(words[4:]), fontsize=8,
                     color="crimson" if is_held else "black")
    fig.suptitle("Generated pairs (32 px here; 16 px in training). Red: held-out colour/shape "
                 "pairs, never trained on", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def _logits(path: Path, runs: dict) -> None:
    import matplotlib.pyplot as plt

    worlds = [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.loglog(worlds, [contrastive.logits_bytes_formula(B, w, False, 8) for w in worlds], "-",
              color="C0", label="global loss: B² x 8 bytes")
    ax.loglog(worlds, [contrastive.logits_bytes_formula(B, w, True, 8) for w in worlds], "-",
              color="C1", label="local loss: 2·b·B x 8 bytes (b = B/W)")
    for world, run in sorted(runs.items(), key=lambda kv: int(kv[0])):
        w = int(world)
        ax.plot([w], [run["logits"]["global"]], "o", color="C0")
        ax.plot([w], [run["logits"]["local"]], "s", color="C1", mfc="none", ms=9)
    ax.plot([], [], "ok", label="counted (train.py, float64)")
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_xlabel("ranks W (global batch B = 48)")
    ax.set_ylabel("logits bytes per rank")
    ax.set_title("Logits one rank builds: the local loss falls as 2/W")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def _training(path: Path, run: dict) -> None:
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in run["metrics"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax1.plot(steps, [m["loss"] for m in run["metrics"]])
    ax1.set_xlabel("step")
    ax1.set_ylabel("global-batch contrastive loss")
    ax1.set_title("Loss (2 ranks, local loss)")
    ax2.plot(steps, [m["zero_shot"] for m in run["metrics"]], label="held-out pairs, top-1 of 64")
    ax2.axhline(1 / 64, color="k", ls=":", label="chance 1/64")
    ax2.axhline(0.25, color="grey", ls="--", label="colour+position right, shape guessed")
    ax2.axhline(1 / 64 + 0.2, color="C3", ls="-.", label="the check's bound")
    seen = run["figures"]["zero-shot accuracy, seen colour/shape pairs"]["measured"]
    ax2.plot([steps[-1]], [seen], "o", color="C2", label="seen pairs, end")
    ax2.set_xlabel("step")
    ax2.set_ylabel("retrieval accuracy")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("Zero-shot retrieval of unseen pairs")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def make_figures(fig_dir: Path, data_json: dict) -> list[Path]:
    fig_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    paths = [fig_dir / "pairs.png", fig_dir / "logits_bytes.png", fig_dir / "training.png"]
    _samples(paths[0])
    _logits(paths[1], data_json["runs"])
    _training(paths[2], data_json["runs"]["2"])
    return paths
