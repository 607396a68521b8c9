"""The wall-clock bubble of chapter 04's hand-written GPipe on real layers (reported, never asserted).

Every rank records when each of its forward and backward computations starts and ends; the
bubble is the share of ranks × step time not spent computing: waiting for a neighbour and
communication both count as idle, which is why the measurement sits above (p−1)/(m+p−1).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from chapters.ch04_model_parallel.schedule import Event
from chapters.ch04_model_parallel.train import Config, build_stage, gpipe_step
from common.models import MLP
from common.seed import seed_everything


def measure_bubble(cfg: Config, info, n_micro: int):
    """Median wall-clock bubble of hand GPipe steps on a wider float32 model, and the
    timeline of the last step (every rank's compute intervals, gathered on every rank)."""
    seed_everything(cfg.seed)
    model = MLP(cfg.time_width, cfg.time_width, cfg.time_width, cfg.n_layers).to(info.device)
    stage = build_stage(model, info.rank, info.world_size)
    x = torch.randn(cfg.time_batch, cfg.time_width, device=info.device)
    bubbles = []
    for _ in range(cfg.time_repeats + 1):  # the first step is a warm-up
        events: list = []
        dist.barrier()
        t0 = time.perf_counter()
        gpipe_step(stage, x, x, info.rank, info.world_size, x, n_micro, events=events)
        mine = [Event(info.rank, k, mb, info.rank, a - t0, b - t0) for k, mb, a, b in events]
        timeline = [None] * info.world_size
        dist.all_gather_object(timeline, mine)
        timeline = [e for rank_events in timeline for e in rank_events]
        makespan = max(e.end for e in timeline)
        busy = sum(e.end - e.start for e in timeline)
        bubbles.append(1 - busy / (info.world_size * makespan))
    return statistics.median(bubbles[1:]), timeline
