"""Test doubles shared by the chapters' tests (not used by the chapters themselves).

- `rank_info(rank, world_size)`: the `DistInfo` a chapter's function expects, for a gloo rank a
  test started itself (`common.launch.run_on_ranks`): one machine, CPU, gloo.
- `Verdicts`: stands in for a script's `RunRecorder` when a test calls a chapter's check function
  directly: it decides each check with `common.results.check_ok`, exactly as the recorder does,
  and keeps the verdict and the measured value by name, so a test can assert that the right code
  passes and a deliberately broken variant fails the same check.
"""

from __future__ import annotations

import torch

from common.distributed import DistInfo
from common.results import check_ok


def rank_info(rank: int, world_size: int) -> DistInfo:
    """Rank `rank` of a one-machine CPU/gloo job of `world_size` ranks started by a test."""
    return DistInfo(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size,
                    device=torch.device("cpu"), backend="gloo", launcher="test")


class Verdicts:
    """A recorder that keeps each check's verdict (`ok`) and measured value (`measured`) by name."""

    def __init__(self):
        self.ok: dict[str, bool] = {}
        self.measured: dict = {}

    def check(self, name, kind, measured, expected, tolerance=0.0, relative=False, compare="==") -> bool:
        self.ok[name] = check_ok(measured, expected, tolerance, relative, compare)
        self.measured[name] = measured
        return self.ok[name]

    def figure(self, *args, **kwargs):
        pass

    def failed(self) -> list[str]:
        return sorted(name for name, ok in self.ok.items() if not ok)
