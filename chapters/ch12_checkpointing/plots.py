"""Figures for the chapter 12 lesson (`python tools/figures.py ch12`; `--rerun` re-measures).

`measure` trains (resume curves) and builds deltas (their sizes); figures/data.json holds what
it recorded and the figures are drawn from it.
"""

from __future__ import annotations

from pathlib import Path

from chapters.ch12_checkpointing import delta as deltas
from chapters.ch12_checkpointing import resume, train
from common.data import regression_data
from common.results import save_figure
from common.seed import seed_everything


def resume_curves(cfg: resume.Config) -> dict[str, list[float]]:
    """Loss per step: uninterrupted, and resumed at cfg.stop_at with and without parts of the state."""
    X, Y = regression_data(cfg.n_samples, 16, 1, seed=cfg.seed)
    seed_everything(cfg.seed)
    curves = {"uninterrupted": resume.train(cfg, resume.new_run(cfg), X, Y, cfg.steps)}
    seed_everything(cfg.seed)
    run = resume.new_run(cfg)
    head = resume.train(cfg, run, X, Y, cfg.stop_at)
    state = resume.training_state(run, rid="")  # kept in memory, never written: no run id
    for name, rng, data in (("resumed, full state", True, True), ("resumed, no RNG state", False, True),
                            ("resumed, no data position", True, False)):
        seed_everything(cfg.seed + 1)
        fresh = resume.new_run(cfg)
        resume.restore(fresh, state, rng=rng, data=data)
        curves[name] = head + resume.train(cfg, fresh, X, Y, cfg.steps)
    return curves


def delta_sizes(cfg: train.Config, touched: list[int]) -> tuple[list[int], int]:
    """Measured delta payload for each number of touched rows, and the full table's bytes."""
    sizes = []
    for n in touched:
        c = train.Config(vocab=cfg.vocab, touched_tokens=n, seed=cfg.seed)
        base, new, _ = deltas.sparse_finetune(c)
        sizes.append(deltas.delta_bytes(deltas.make_delta(base, new)))
    return sizes, deltas.state_bytes(new)


MEASURE_S = 15
TOUCHED = [16, 64, 256, 1024, 4096, 8192]


def measure() -> dict:
    sizes, full = delta_sizes(train.Config(), TOUCHED)
    return {"resume_curves": {k: [float(x) for x in v] for k, v in resume_curves(resume.Config()).items()},
            "delta_bytes": sizes, "full_bytes": full}


def make_figures(fig_dir: Path, data: dict) -> list[Path]:
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    cfg = resume.Config()
    curves = data["resume_curves"]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    styles = {"uninterrupted": dict(lw=4, alpha=0.35, color="k"), "resumed, full state": dict(ls="--")}
    for name, losses in curves.items():
        ax.plot(range(len(losses)), losses, label=name, **styles.get(name, dict(lw=1)))
    ax.axvline(cfg.stop_at - 0.5, color="grey", ls=":")
    ax.annotate("save / kill / load", (cfg.stop_at - 0.5, ax.get_ylim()[1]), ha="center", va="top", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Resume: only the full state (RNG + data position) continues the same run")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [fig_dir / "resume_curves.png"]
    save_figure(fig, paths[0])

    tcfg = train.Config()
    touched, sizes, full = TOUCHED, data["delta_bytes"], data["full_bytes"]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    frac = [n / tcfg.vocab for n in touched]
    ax.loglog(frac, [s / 2**10 for s in sizes], "o-", label="delta (measured): changed × 8 B")
    ax.axhline(full / 2**10, color="k", ls="--", label="full table: elements × 4 B")
    ax.set_xlabel("fraction of embedding rows changed since the base")
    ax.set_ylabel("checkpoint payload (KiB)")
    ax.set_title("A delta pays off while fewer than half the elements change")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(fig_dir / "delta_size.png")
    save_figure(fig, paths[1])
    return paths
