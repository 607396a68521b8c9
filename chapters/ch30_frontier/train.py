"""An auto-parallel planner: search (dp, tp, pp, micro-batch, recomputation, ZeRO stage) with the
course's own cost and memory models under a memory limit, then run three layouts for real.

The planner (planner.py) prices every layout with chapter 04's bubble, chapter 05's activation
count and Megatron all-reduces, chapter 06's ZeRO memory and volumes and chapter 07's α–β ring,
keeps those that fit in memory and returns the fastest, pruning most of the space. This script
prints its choice for worked cluster/model pairs (7B on 64 GPUs, 70B on 512 GPUs), checks it
against brute force over the whole space on small cases, then measures this machine (a matmul,
two all-reduces), predicts dp = W, tp = W and pp = W of a tiny MLP, runs the three for real on
the W ranks and reports whether the measured order is the predicted one for the layouts
predicted at least 1.5x apart (closer predictions are not ranked). It also sets the planner's
bytes per mesh dimension beside chapter 25's composed dp x tp x pp x cp run, as that run counted
them on each of its 8 ranks (against_ch25).

Run:
    python chapters/ch30_frontier/train.py                                  # planner only
    torchrun --standalone --nproc_per_node=2 chapters/ch30_frontier/train.py
    torchrun --standalone --nproc_per_node=4 chapters/ch30_frontier/train.py --width 512
    torchrun --standalone --nproc_per_node=8 chapters/ch30_frontier/train.py --width 4096 --batch 64
    srun --ntasks=8 python chapters/ch30_frontier/train.py
"""

import sys
from dataclasses import dataclass

import torch

from chapters.ch30_frontier import against_ch25, planner, real_layouts
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder

KINDS = ("dp", "tp", "pp")


@dataclass
class Config(RunConfig):
    width: int = 144
    """Width h of the tiny MLP run for real (tp needs the world size to divide it)."""
    pairs: int = 8
    """Megatron pairs of linears (the MLP has 2 x pairs linears; pp needs the world to divide them)."""
    batch: int = 16
    """Rows per step (the global batch; dp needs the world size to divide it)."""
    micro_batches: int = 2
    """Micro-batches of the pp layout (GPipe, chapter 04)."""
    warmup: int = 2
    """Untimed steps before timing each layout."""
    repeats: int = 7
    """Timed steps per layout (median reported)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "width", "pairs", "batch", "micro_batches", "repeats")
        if self.batch % self.micro_batches:
            raise ValueError(f"--micro-batches {self.micro_batches} must divide --batch {self.batch}")


def validate(cfg: Config, world_size: int) -> None:
    """Any world runs: a layout the world cannot split is skipped and said so."""
    if world_size > 1 and not any(real_layouts.possible(k, world_size, cfg.width, cfg.pairs, cfg.batch,
                                                        cfg.micro_batches) for k in KINDS):
        raise ValueError(f"none of dp, tp, pp splits this model over {world_size} ranks; "
                         f"use a --width and --batch that {world_size} divides")


def gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def plan_worked_pairs(rec: RunRecorder) -> None:
    """The planner's choice for each worked pair, and what the two negative controls choose."""
    for name, (spec, cluster) in planner.WORKED.items():
        plan = planner.search(spec, cluster)
        full = planner.brute_force(spec, cluster)
        log.info("%s (Psi = %.2fB): %s", name, spec.params() / 1e9, plan.layout)
        log.info("    predicted step %.2f s, memory per GPU %s of %s; %d of %d layouts evaluated",
                 plan.time, gb(plan.memory), gb(cluster.memory_bytes), plan.evaluated, full.evaluated)
        rec.figure(f"{name}: chosen layout", str(plan.layout))
        rec.figure(f"{name}: predicted step time", round(plan.time, 4), unit="s")
        rec.figure(f"{name}: predicted memory per GPU", round(plan.memory / 1e9, 2), unit="GB")
        rec.figure(f"{name}: layouts evaluated (pruned / all)", [plan.evaluated, full.evaluated])
        rec.check(f"{name}: planner == brute force (layout, time)", "parity",
                  [str(plan.layout), plan.time], [str(full.layout), full.time])
        wrong = planner.search(spec, cluster, ignore_memory=True)
        log.info("    control, memory limit ignored: %s needs %s", wrong.layout, gb(wrong.memory))
        rec.check(f"{name}: control, memory limit ignored: its choice needs more (GB)", "parity",
                  round(wrong.memory / 1e9, 2), cluster.memory_bytes / 1e9, compare=">")


def check_small_cases(rec: RunRecorder) -> None:
    for name, (spec, cluster) in planner.small_cases().items():
        plan, full = planner.search(spec, cluster), planner.brute_force(spec, cluster)
        rec.check(f"small case {name}: planner == brute force", "parity",
                  [str(plan.layout), plan.time], [str(full.layout), full.time])
    spec, cluster = planner.small_cases()["7B, 32 x 40 GB"]
    right, blind = planner.search(spec, cluster), planner.search(spec, cluster, drop="dp_comm")
    rec.check("control: a planner blind to the gradient all-reduce picks another layout", "parity",
              int(blind.layout != right.layout), 1)


def check_against_chapter_25(rec: RunRecorder) -> None:
    """The planner's bytes beside chapter 25's composed run, as its 8-rank job counted them on
    every rank (against_ch25): model state and bytes per mesh dimension exactly, activations
    inside the band. Rank 0 of each layout is shown figure by figure."""
    record = against_ch25.load()
    rows = against_ch25.rows(record)
    parts = (("model state", "model state (params, grads, AdamW moments)"),
             ("bytes per step", "bytes per step at the boundary, every dimension"),
             ("activations", "activations kept for backward, in the band"))
    for layout in record["layouts"]:
        mine = [r for r in rows if r["layout"] == layout]
        ranks = sorted({r["rank"] for r in mine})
        for prefix, what in parts:
            bad = {r["rank"] for r in mine if r["name"].startswith(prefix) and not r["ok"]}
            rec.check(f"chapter 25, {layout}: {what} = planner (ranks)", "count",
                      len(ranks) - len(bad), len(ranks))
        for r in (r for r in mine if r["rank"] == ranks[0]):
            expected = r["predicted"]
            if isinstance(expected, list):  # the activation band
                expected = f"{expected[0]:.0f}-{expected[1]:.0f}"
            rec.figure(f"chapter 25, {layout}, rank {ranks[0]}: {r['name']}", r["measured"],
                       expected, unit="B")


def predict_and_run(cfg: Config, info, rec: RunRecorder) -> None:
    """Measure this machine, predict the three layouts' step times, run them, compare the order."""
    world = info.world_size
    kinds = [k for k in KINDS if real_layouts.possible(k, world, cfg.width, cfg.pairs, cfg.batch,
                                                       cfg.micro_batches)]
    if "pp" in kinds and info.backend == "gloo" and info.device.type == "cuda":
        kinds.remove("pp")  # gloo sends and receives CPU tensors only (one GPU, several ranks)
        log.info("pp skipped: gloo cannot send CUDA tensors point to point")
    for k in sorted(set(KINDS) - set(kinds)):
        log.info("%s = %d is not run here: skipped", k, world)
    const = real_layouts.calibrate(cfg.width, cfg.pairs, cfg.batch, cfg.repeats, info.device)
    log.info("this machine: %.2f GFLOP/s per rank (%dx%dx%d matmul), all-reduce alpha %.0f us, "
             "%.2f GB/s", const["flops"] / 1e9, cfg.batch // world, cfg.width, cfg.width,
             const["alpha"] * 1e6,
             1e-9 / const["beta"] if const["beta"] else float("inf"))
    rec.figure("measured matmul rate per rank", round(const["flops"] / 1e9, 3), unit="GFLOP/s")
    rec.figure("measured all-reduce alpha", round(const["alpha"] * 1e6, 1), unit="us")
    rec.figure("measured all-reduce bandwidth (1/beta)",
               round(1e-9 / const["beta"], 3) if const["beta"] else None, unit="GB/s")
    spec = real_layouts.tiny_spec(cfg.width, cfg.pairs, cfg.batch)
    cluster = real_layouts.cpu_cluster(world, const["flops"], const["alpha"], const["beta"])
    predicted = {k: planner.step_time(spec, cluster, real_layouts.layout_for(k, world, cfg.batch, cfg.micro_batches))
                 for k in kinds}
    measured = real_layouts.time_layouts(kinds, cfg.width, cfg.pairs, cfg.batch, cfg.micro_batches,
                                         cfg.warmup, cfg.repeats, cfg.seed, info.device)
    for k in kinds:
        log.info("%s=%d: predicted %.2f ms, measured %.2f ms", k, world, predicted[k] * 1e3,
                 measured[k]["median_s"] * 1e3)
        rec.figure(f"{k}={world} step time", round(measured[k]["median_s"] * 1e3, 3),
                   round(predicted[k] * 1e3, 3), unit="ms",
                   spread=(round(measured[k]["min_s"] * 1e3, 3), round(measured[k]["max_s"] * 1e3, 3)))
    choice = planner.search(spec, cluster)
    rec.figure("planner's choice for the tiny MLP on this machine", str(choice.layout))
    order_p = sorted(kinds, key=lambda k: predicted[k])
    order_m = sorted(kinds, key=lambda k: measured[k]["median_s"])
    log.info("predicted order %s, measured order %s", " < ".join(order_p), " < ".join(order_m))
    pairs = ranked_pairs(predicted)
    if pairs:
        gaps = [predicted[b] / predicted[a] for a, b in zip(order_p, order_p[1:])]
        rec.figure("smallest ratio of neighbouring predictions", round(min(gaps), 2), unit="x")
        rec.check(f"measured order == predicted, layouts predicted >= {RANK_RATIO}x apart", "timing",
                  ", ".join(f"{a} < {b}" if measured[a]["median_s"] < measured[b]["median_s"]
                            else f"{b} < {a}" for a, b in pairs),
                  ", ".join(f"{a} < {b}" for a, b in pairs))
    unranked = [(a, b) for i, a in enumerate(order_p) for b in order_p[i + 1:] if (a, b) not in pairs]
    for a, b in unranked:
        log.info("%s and %s predicted %.2fx apart: not ranked (closer than %sx)", a, b,
                 predicted[b] / predicted[a], RANK_RATIO)


RANK_RATIO = 1.5
"""Two predictions closer than this are not ranked: the step times of one layout vary more than
that between runs on a shared 2-core machine (the committed run's spreads)."""


def ranked_pairs(predicted: dict[str, float], ratio: float = RANK_RATIO) -> list[tuple[str, str]]:
    """The pairs (faster, slower) whose predicted times are at least `ratio` apart, fastest first."""
    order = sorted(predicted, key=predicted.get)
    return [(a, b) for i, a in enumerate(order) for b in order[i + 1:]
            if predicted[b] >= ratio * predicted[a]]


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        torch.manual_seed(cfg.seed)
        rec = RunRecorder(cfg, __file__, info)
        plan_worked_pairs(rec)
        check_small_cases(rec)
        check_against_chapter_25(rec)
        if info.world_size > 1:
            predict_and_run(cfg, info, rec)
        else:
            log.info("one process: no layouts to run for real (use torchrun --nproc_per_node=2)")
            rec.figure("real layouts", "n/a at world size 1")
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
