"""Ring attention's instruments: the bytes and messages each rank hands to send ops, the chunk
products it computes, and a timeline of its events stamped on the device's clock, from which the
run reads whether each hop was in flight while a block computed (the overlap check) and how long
the products and the waits took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def stamp(device: torch.device):
    """A point in time on `device`'s clock. CUDA: an event recorded on the current stream, which
    completes when the stream reaches it (kernels and NCCL's `wait()` are asynchronous on the
    host: `wait()` only makes the stream wait, so the host clock would say nothing there); read
    after a synchronize. CPU (gloo): the host clock, since there `wait()` blocks until the
    transfer is done."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


def seconds(stamps: list) -> list[float]:
    """The stamps as seconds after the first: CUDA events' elapsed time (after a synchronize,
    in ms on the stream), or host-clock differences."""
    if not stamps:
        return []
    if isinstance(stamps[0], torch.cuda.Event):
        torch.cuda.synchronize()
        return [stamps[0].elapsed_time(e) / 1e3 for e in stamps]
    return [t - stamps[0] for t in stamps]


@dataclass
class RingCounter:
    """Bytes each rank hands to send ops (forward and backward separately), messages, chunk
    products computed (one product = c query rows against c key rows), and the timeline of the
    events (phase, "send" | "begin" | "compute" | "wait", hop id, `stamp`), from which
    `overlapped_hops` reads whether each transfer was in flight while a block computed and
    `seconds_in` how long the products and the waits took, on the device's clock."""

    bytes: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    sends: int = 0
    products: int = 0
    events: list = field(default_factory=list)

    def reset(self) -> None:
        self.bytes, self.sends, self.products, self.events = {"forward": 0, "backward": 0}, 0, 0, []

    def mark(self, phase: str, kind: str, hop, device: torch.device) -> None:
        self.events.append((phase, kind, hop, stamp(device)))

    def _timeline(self, phase: str) -> list[tuple[str, object, tuple[float, int]]]:
        """(kind, hop, (seconds, position)) of `phase`: the position breaks ties (one stream's
        events, and the host's, complete in the order they were recorded)."""
        log = [(kind, hop, s) for ph, kind, hop, s in self.events if ph == phase]
        return [(kind, hop, (t, i)) for i, ((kind, hop, _), t) in
                enumerate(zip(log, seconds([s for _, _, s in log])))]

    def overlapped_hops(self, phase: str = "forward") -> int:
        """Hops of `phase` in flight during a block product: started (send) before the product
        began and waited for after it ended, by the clock of `stamp`."""
        log = self._timeline(phase)
        begins = [t for kind, _, t in log if kind == "begin"]
        products = list(zip(begins, [t for kind, _, t in log if kind == "compute"]))
        sent = {hop: t for kind, hop, t in log if kind == "send"}
        waited = {hop: t for kind, hop, t in log if kind == "wait"}
        return sum(1 for hop, t in sent.items()
                   if hop in waited and any(t < b and e < waited[hop] for b, e in products))

    def seconds_in(self, phase: str = "forward") -> dict:
        """Seconds spent in block products and in waits for hops (from the wait's call to its
        return on the host; on CUDA, the stream's stall behind the transfer)."""
        log = self._timeline(phase)
        spans = {"products": 0.0, "waits": 0.0}
        start = None
        for kind, _, (t, _) in log:
            if kind in ("begin", "wait_start"):
                start = t
            elif kind in ("compute", "wait"):
                spans["products" if kind == "compute" else "waits"] += t - start
        return spans
