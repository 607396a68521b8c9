"""The monitoring toolkit of chapter 14: a metrics-line schema and its validator, a robust
straggler detector, and readers that load what TensorBoard and W&B wrote back from disk.

Only the standard library and torch at module level; tensorboard and wandb are imported inside
the functions that need them, so the chapter still runs where they are not installed.
"""

from __future__ import annotations

import json
import math
import statistics
import struct
from pathlib import Path

# One metrics.jsonl line = one JSON object with exactly these keys and types (extra keys are
# allowed: a later chapter may add its own). "number" is an int or a float, never a bool;
# "list[number]" has one entry per rank.
METRICS_SCHEMA: dict[str, str] = {
    "step": "int",                    # optimizer step, 0-based
    "time_s": "number",               # seconds since the run started (RunRecorder adds it)
    "loss": "number",                 # training loss, averaged over all ranks
    "lr": "number",                   # learning rate used at this step
    "grad_norm": "number",            # L2 norm of the averaged gradient
    "samples_per_s": "number",        # global throughput of this step
    "step_time_s": "number",          # wall time of this step on rank 0
    "mfu": "number",                  # model FLOPs utilisation, 0..1
    "compute_s": "list[number]",      # per rank: time to reach the all-reduce
    "wait_s": "list[number]",         # per rank: time spent inside the all-reduce
}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _type_ok(value, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return _is_number(value)
    if kind == "list[number]":
        return isinstance(value, list) and len(value) > 0 and all(_is_number(v) for v in value)
    raise ValueError(f"unknown schema type {kind!r}")


def validate_line(line: str, schema: dict[str, str] = METRICS_SCHEMA) -> list[str]:
    """Every way one JSONL line breaks the schema (empty list: the line is valid)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return [f"not JSON: {e}"]
    if not isinstance(obj, dict):
        return [f"not a JSON object but {type(obj).__name__}"]
    errors = [f"missing key {k!r}" for k in schema if k not in obj]
    errors += [f"{k!r} should be {kind}, got {obj[k]!r}"
               for k, kind in schema.items() if k in obj and not _type_ok(obj[k], kind)]
    return errors


def validate_file(path: str | Path, schema: dict[str, str] = METRICS_SCHEMA) -> dict[int, list[str]]:
    """{line number: errors} for every invalid line of a JSONL file (empty dict: all valid)."""
    lines = Path(path).read_text().splitlines()
    bad = {i: validate_line(text, schema) for i, text in enumerate(lines, 1)}
    return {i: e for i, e in bad.items() if e}


def mad(xs: list[float]) -> float:
    """Median absolute deviation: the robust cousin of the standard deviation."""
    m = statistics.median(xs)
    return statistics.median(abs(x - m) for x in xs)


def find_stragglers(step_times: list[list[float]], factor: float = 1.5, z: float = 4.0,
                    min_gap_s: float = 0.005) -> dict:
    """Flag the ranks whose typical step is slower than the others' beyond noise.

    step_times[r][t] is rank r's time at step t. Rank r is a straggler when its median m_r
    exceeds ref_r, the median of the OTHER ranks' medians (leave-one-out, so 2 ranks work),
    by more than max((factor - 1) * ref_r, z * sigma, min_gap_s), where
    sigma = 1.4826 * median over ranks of each rank's MAD (the noise of one step time).
    """
    if len(step_times) < 2:
        return {"medians": [statistics.median(step_times[0])], "flagged": [], "thresholds": [math.inf]}
    medians = [statistics.median(ts) for ts in step_times]
    sigma = 1.4826 * statistics.median(mad(ts) for ts in step_times)
    flagged, thresholds = [], []
    for r, m in enumerate(medians):
        ref = statistics.median(medians[:r] + medians[r + 1:])
        threshold = ref + max((factor - 1) * ref, z * sigma, min_gap_s)
        thresholds.append(threshold)
        if m > threshold:
            flagged.append(r)
    return {"medians": medians, "flagged": flagged, "thresholds": thresholds, "sigma": sigma}


def wandb_offline_init(out: Path, config: dict, project: str = "course-ch14"):
    """An offline W&B run under <out>/wandb, or None (one line) when wandb is not installed.

    Offline mode never opens a network connection; `wandb sync <run dir>` uploads it later.
    """
    import os

    from common.log import library_output, log

    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_DIR"] = str(out)
    os.environ["WANDB_SILENT"] = "true"
    try:
        import wandb
    except ImportError:
        log.info("wandb is not installed: continuing without W&B (pip install wandb to enable)")
        return None
    out.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(console="off", silent=True, disable_git=True, save_code=False,
                              x_disable_stats=True, x_disable_meta=True)
    with library_output():  # what wandb still says (its service starting) goes to the library log
        return wandb.init(project=project, dir=str(out), mode="offline", config=config,
                          settings=settings)


def wandb_run_file(out: Path) -> Path:
    """The .wandb file of the latest offline run written under <out>/wandb."""
    files = list(Path(out).glob("wandb/offline-run-*/run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no offline W&B run under {out}/wandb")
    return max(files, key=lambda p: p.stat().st_mtime)


def read_wandb_records(path: str | Path) -> list:
    """Decode a .wandb file: a LevelDB-style log (32 KiB blocks of CRC, length, type, payload)
    of `wandb_internal_pb2.Record` protobufs, W&B's own schema. wandb 0.31 ships no Python
    reader any more (its Go core writes the file), so the 20-line framing is done here."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path} is not a .wandb file (header {data[:7]!r})")
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # padding to the end of the block
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record is assembled
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def read_wandb_history(out: Path) -> list[dict]:
    """The `run.log` history of the offline run under <out>, one dict per logged step."""
    rows = []
    for record in read_wandb_records(wandb_run_file(out)):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def read_tensorboard_scalars(tb_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} read back with TensorBoard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
