"""What every rank of the disaggregated pipeline did and when (`Timeline`), and the two counts
made from it (`timeline_report`): generations of batch t + k scheduled between the collectives
of training step t, and generations overlapping training on the wall clock.
"""

from __future__ import annotations

import contextlib
import json
import time

import torch.distributed as dist

from chapters.ch27_rlhf import sync
from common.results import RunRecorder
from common.timing import synchronize


class Timeline:
    """What this rank did and when: (what, index, start, end) with start and end read from
    `time.time()` after a device synchronisation (one clock for every process of a machine;
    across nodes as close as their NTP sync). The intervals are counted, not drawn only."""

    def __init__(self, device):
        self.device, self.events = device, []

    @contextlib.contextmanager
    def span(self, what: str, index: int):
        synchronize(self.device)
        t0 = time.time()
        yield
        synchronize(self.device)
        self.events.append((what, index, t0, time.time()))


def overlap(a: tuple, b: tuple) -> float:
    """Seconds two (start, end) intervals share."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def timeline_report(rec: RunRecorder, cfg, timeline: Timeline) -> None:
    """Gather every rank's events and count, per generator, the generations of batch t + k that
    ran (a) between the collectives that open and close the trainer's step t (gather t, push
    t + 1), in the order the generator's own log shows — a schedule check: T − k per generator
    for k >= 1, none in lock-step; it cannot show concurrency (a trainer that waited for the
    generation after the gather keeps it) — and (b) overlapping training t on the wall clock, the
    concurrency check: at least one for k >= 1 (fatal; all G (T − k) on a quiet machine, fewer
    when the OS runs the two processes in turn), none in lock-step (guaranteed: the generation
    ends before the gather that starts the training step)."""
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, timeline.events)
    k, T = cfg.staleness, cfg.steps
    train = {i: (s, e) for what, i, s, e in ranks[sync.TRAINER] if what == "train"}
    between = by_clock = 0
    shared = 0.0
    for events in ranks[1:]:
        order = [(what, i) for what, i, _, _ in events]
        for pos, (what, i, s, e) in enumerate(events):
            t = i - k  # the training step this generation can run beside
            if what != "generate" or t < 0 or t not in train:
                continue
            before = order.index(("gather", t)) if ("gather", t) in order else len(order)
            after = order.index(("push", t + 1)) if ("push", t + 1) in order else len(order)
            between += before < pos < after
            shared += overlap((s, e), train[t])
            by_clock += overlap((s, e), train[t]) > 0
    gens = len(ranks) - 1
    expected = gens * (T - k) if k >= 1 else 0
    rec.check(f"schedule: generations of batch t+{k} between gather t and push t+1", "count",
              between, expected)
    if k >= 1:
        rec.check(f"generations of batch t+{k} overlapping train t on the clock: at least one",
                  "count", by_clock, 1, compare=">=")
    else:
        rec.check("lock-step: generations overlapping a training step on the clock", "count",
                  by_clock, 0)
    rec.figure(f"generations of batch t+{k} overlapping train t on the clock", by_clock,
               expected=expected)
    span = max(e for evs in ranks for *_, e in evs) - min(s for evs in ranks for _, _, s, _ in evs)
    busy = sum(e - s for s, e in train.values())
    rec.figure("time generation overlapped training / training time", round(shared / max(busy, 1e-9)
                                                                            / gens, 3))
    rec.figure("RL loop wall time", round(span, 3), unit="s")
    if rec.is_main:
        t0 = min(s for evs in ranks for _, _, s, _ in evs)
        text = json.dumps({"staleness": k, "ranks": [[[w, i, round(s - t0, 6), round(e - t0, 6)]
                                                     for w, i, s, e in evs] for evs in ranks]})
        (rec.out / "timeline.json").write_text(text)
