"""What `train.py`'s run records beside its saves and loads: the reloads against the state at
save time, the tensor bytes against the formula, the files, the save times with their spread,
and integrity's price (hashing, verifying) beside SHA-256's rate on this CPU; the bytes each rank
plans to read when it reshards, the state comparison every check uses, and the per-rank
`torch.save` of the local shards that DCP's metadata is contrasted with.

Helper module of chapter 12 (no main guard); `train.py` and the tests import it.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from pathlib import Path

import torch

from common.checkpoint import read_dcp_metadata, safe_load_planner, save_checkpoint
from common.distributed import gather_numbers, reduce_number
from common.results import RunRecorder


def max_state_diff(a, b) -> float:
    """Max |a − b| over every tensor of two nested state dicts (inf if their structure differs)."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return float("inf")
        return max([max_state_diff(a[k], b[k]) for k in a] or [0.0])
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return float("inf")
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return 0.0 if a == b else float("inf")


def planned_reads(state: dict, path) -> dict[str, int]:
    """What `dcp.load(state, path)` will read on this rank: bytes per data file. DCP's file
    reader reads each stored chunk that overlaps this rank's shard whole, then narrows it."""
    meta = read_dcp_metadata(path)  # the restricted unpickler: reading a plan runs no code
    planner = safe_load_planner()
    planner.set_up_planner(state, meta, is_coordinator=False)
    reads: dict[str, int] = {}
    for item in planner.create_local_plan().items:
        info = meta.storage_data[item.storage_index]
        reads[info.relative_path] = reads.get(info.relative_path, 0) + info.length
    return reads


def save_local_shards(model, path: Path, rank: int) -> Path:
    """What plain torch.save gives you under FSDP: this rank's slice of every tensor, and
    nothing saying how the slices fit together (the limit DCP's metadata removes)."""
    return save_checkpoint(path / f"rank{rank}.pt",
                           {n: p.to_local().clone() for n, p in model.named_parameters()})


def dcp_payload_bytes(path) -> int:
    """Tensor bytes the checkpoint's metadata describes (global shapes × dtype sizes)."""
    meta = read_dcp_metadata(path)
    return sum(m.size.numel() * m.properties.dtype.itemsize
               for m in meta.state_dict_metadata.values() if hasattr(m, "size"))


def expected_bytes(n_params: int, n_tensors: int, dtype_bytes: int = 4) -> int:
    """params × dtype (weights) + 2 × params × dtype (Adam's m and v) + one step scalar per tensor."""
    return n_params * dtype_bytes * 3 + n_tensors * 4


def files_bytes(path: Path, pattern: str) -> list[int]:
    return [p.stat().st_size for p in sorted(path.glob(pattern))]


def sha256_rate(n_bytes: int = 16 << 20) -> float:
    """Bytes per second this CPU hashes with SHA-256 (hashlib, one thread): the cost model of a
    manifest (each rank hashes its own shard) and of a verification (the ranks share the files)."""
    block = bytes(n_bytes)  # SHA-256's speed does not depend on the bytes
    hashlib.sha256(block[:1 << 20]).digest()  # warm-up
    t0 = time.perf_counter()
    hashlib.sha256(block).digest()
    return n_bytes / (time.perf_counter() - t0)


def spread(values: list[float]) -> list[float]:
    """[median, min, max] in ms."""
    ms = sorted(v * 1e3 for v in values)
    return [round(statistics.median(ms), 2), round(ms[0], 2), round(ms[-1], 2)]


def record_reshard(rec: RunRecorder, res: dict, world_size: int) -> None:
    """--load-from: the gathered whole equals full_state.pt; the bytes each rank read."""
    rec.check(f"loaded on {world_size} ranks == saved state", "parity",
              reduce_number(res.get("max_diff", 0.0), "max"), 0.0)
    rec.figure("bytes read from the checkpoint, per rank",
               gather_numbers(sum(res["reads"].values())), unit="bytes")


def record_reload(rec: RunRecorder, saved: dict, reloaded: dict, reloaded_async: dict,
                  moved_on: dict, is_main: bool) -> None:
    """Both reloads equal the state at save time (rank 0 holds the gathered states), and the
    state training reached meanwhile does not (the async save's copy was taken in time)."""
    blocking_diff = max_state_diff(reloaded, saved) if is_main else 0.0
    async_diff = max_state_diff(reloaded_async, saved) if is_main else 0.0
    drift = max_state_diff(moved_on["model"], saved["model"]) if is_main else 1.0
    rec.check("DCP reload == saved state (max |diff|)", "parity", blocking_diff, 0.0)
    rec.check("async DCP reload == state at save time", "parity", async_diff, 0.0)
    rec.check("training moved on during the async writes", "parity", drift, 0.0, compare=">")


def record_sizes_and_times(rec: RunRecorder, model, times: dict, world_size: int,
                           is_main: bool) -> None:
    """Sizes beside the formula, times with their spread, the manifest and verify beside SHA-256."""
    out = rec.out
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    expected = expected_bytes(n_params, n_tensors)
    rec.check("DCP tensor bytes = params x 4 x (1 + 2 Adam) + steps", "formula",
              dcp_payload_bytes(out / "dcp"), expected)
    shard_files = files_bytes(out / "dcp", "*.distcp")
    rec.figure("DCP shard files", shard_files, expected=expected / world_size, unit="bytes")
    rec.figure("DCP all files", sum(files_bytes(out / "dcp", "*")), expected=expected, unit="bytes")
    rec.figure("torch.save of the full state", (out / "full_state.pt").stat().st_size
               if is_main else 0, expected=expected, unit="bytes")
    rec.figure("first blocking save (cold)", round(times["block_cold"] * 1e3, 2), unit="ms")
    rec.figure("first async save, until written (cold)", round(times["async_cold"] * 1e3, 2), unit="ms")
    rec.figure("blocking save [median, min, max]", spread(times["block"]), unit="ms")
    rec.figure("async save: training waits [median, min, max]", spread(times["async"]), unit="ms")
    rec.figure("async save: until written [median, min, max]", spread(times["async_total"]), unit="ms")
    # Integrity's price: hashing each rank's shard (the manifest) and every file (a verify),
    # beside what SHA-256 at this CPU's rate predicts for the largest shard.
    rate, per_rank = sha256_rate(), sum(files_bytes(out / "dcp", "*")) / world_size
    rec.figure("SHA-256 rate, one thread", round(rate / 1e6, 1), unit="MB/s")
    rec.figure("manifest: hash own shard + write [median, min, max]", spread(times["manifest"]),
               expected=round(max(shard_files) / rate * 1e3, 2), unit="ms")
    rec.figure("verify before load [median, min, max]", spread(times["verify"]),
               expected=round(per_rank / rate * 1e3, 2), unit="ms")
    rec.check("async stalls training less than a blocking save (median)", "timing",
              spread(times["async"])[0], spread(times["block"])[0], compare="<")
