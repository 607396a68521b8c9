"""The run-output writer: `summary.json`, `metrics.jsonl`, optional TensorBoard, the checks table.

Every script records what it measured beside what theory predicts:

    rec = RunRecorder(cfg, __file__, info)
    rec.metrics(step, loss=..., lr=...)                        # one JSON line per logged step
    rec.figure("busbw", measured=0.9, expected=1.0, unit="GB/s")
    rec.check("hand DP == DDP", "parity", measured=max_diff, expected=0.0, tolerance=1e-12)
    return rec.finish()                                         # exit status: 1 if a check failed

summary.json: {chapter, script, world_size, backend, device, versions, config, figures, checks};
each check is {name, kind, measured, expected, tolerance, ok} with kind one of parity, formula,
count, timing. Timing checks are reported, never fatal: wall clocks on a shared machine are noisy.
Only rank 0 writes; every rank may call the methods.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from common.checkpoint import atomic_write
from common.config import config_dict
from common.log import log

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECK_KINDS = ("parity", "formula", "count", "timing")


def default_out_dir(script_file: str) -> Path:
    """runs/<chapter>/<script>/ under the repository root."""
    script = Path(script_file).resolve()
    return REPO_ROOT / "runs" / script.parent.name / script.stem


def versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "platform": platform.platform(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
        v["gpu"] = torch.cuda.get_device_name()
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return v


def _plain(x):
    """JSON-ready: tensors to numbers or lists, non-finite floats kept as strings."""
    if isinstance(x, torch.Tensor):
        x = x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (list, tuple)):
        return [_plain(i) for i in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def check_ok(measured, expected, tolerance: float = 0.0, relative: bool = False) -> bool:
    """|measured − expected| ≤ tolerance (× |expected| when relative); equality for non-numbers."""
    numbers = (int, float)
    if isinstance(measured, numbers) and isinstance(expected, numbers) \
            and not isinstance(measured, bool) and not isinstance(expected, bool):
        if not (math.isfinite(measured) and math.isfinite(expected)):
            return False
        bound = tolerance * abs(expected) if relative else tolerance
        return abs(measured - expected) <= bound
    return measured == expected


def _fmt(x) -> str:
    if isinstance(x, float):
        if x.is_integer() and abs(x) < 1e15:
            return str(int(x))
        return f"{x:.4g}" if 1e-3 <= abs(x) < 1e6 else f"{x:.3e}"
    return str(x)


class RunRecorder:
    """Collects figures and checks on every rank; rank 0 writes them."""

    def __init__(self, cfg, script_file: str, info=None):
        script = Path(script_file).resolve()
        self.chapter, self.script = script.parent.name, script.stem
        self.cfg, self.info = cfg, info
        self.is_main = info is None or info.is_main
        self.out = Path(cfg.out) if getattr(cfg, "out", "") else default_out_dir(script_file)
        self.figures: dict[str, dict] = {}
        self.checks: list[dict] = []
        self.start = time.perf_counter()
        self._metrics = self._tb = None
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            self._metrics = open(self.out / "metrics.jsonl", "w")
            if getattr(cfg, "tensorboard", False):
                from torch.utils.tensorboard import SummaryWriter  # needs tensorboard

                self._tb = SummaryWriter(str(self.out / "tb"))

    def metrics(self, step: int, **values) -> None:
        """Append one line to metrics.jsonl (flushed at once: nothing lost on a crash)."""
        if not self.is_main:
            return
        line = {"step": step, "time_s": round(time.perf_counter() - self.start, 4)}
        line.update({k: _plain(v) for k, v in values.items()})
        self._metrics.write(json.dumps(line) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for k, v in line.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def figure(self, name: str, measured, expected=None, unit: str = "") -> None:
        """Record a measured figure beside the value theory predicts (if it predicts one)."""
        self.figures[name] = {"measured": _plain(measured), "expected": _plain(expected), "unit": unit}

    def check(self, name: str, kind: str, measured, expected, tolerance: float = 0.0,
              relative: bool = False, ok: bool | None = None) -> bool:
        """Record a check and return whether it passed."""
        if kind not in CHECK_KINDS:
            raise ValueError(f"check kind must be one of {CHECK_KINDS}, not {kind!r}")
        measured, expected = _plain(measured), _plain(expected)
        if ok is None:
            ok = check_ok(measured, expected, tolerance, relative)
        self.checks.append({"name": name, "kind": kind, "measured": measured,
                            "expected": expected, "tolerance": tolerance,
                            "relative": relative, "ok": bool(ok)})
        return bool(ok)

    def summary(self) -> dict:
        info = self.info
        return {
            "chapter": self.chapter, "script": self.script,
            "world_size": info.world_size if info else 1,
            "backend": info.backend if info else None,
            "device": str(info.device) if info else "cpu",
            "versions": versions(), "config": _plain(config_dict(self.cfg)),
            "figures": self.figures, "checks": self.checks,
        }

    def failed(self) -> list[dict]:
        """Checks that failed and are fatal (every kind but timing)."""
        return [c for c in self.checks if not c["ok"] and c["kind"] != "timing"]

    def print_table(self) -> None:
        rows = [("figure", "unit", "expected", "measured", "", "")]
        rows += [(n, f["unit"], _fmt(f["expected"]) if f["expected"] is not None else "-",
                  _fmt(f["measured"]), "", "") for n, f in self.figures.items()]
        rows += [("check", "kind", "expected", "measured", "tolerance", "ok")]
        rows += [(c["name"], c["kind"], _fmt(c["expected"]), _fmt(c["measured"]),
                  _fmt(c["tolerance"]) + (" rel" if c["relative"] else ""),
                  "ok" if c["ok"] else ("FAIL" if c["kind"] != "timing" else "slow"))
                 for c in self.checks]
        widths = [max(len(str(r[i])) for r in rows) for i in range(6)]
        for r in rows:
            if r[0] in ("figure", "check"):
                log.info("")
            log.info("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())

    def finish(self) -> int:
        """Write summary.json, print the table; return 1 if a fatal check failed, else 0."""
        failed = self.failed()
        if self.is_main:
            text = json.dumps(self.summary(), indent=2)
            atomic_write(self.out / "summary.json", lambda f: f.write(text.encode()))
            if self._metrics:
                self._metrics.close()
            if self._tb is not None:
                self._tb.close()
            self.print_table()
            log.info("\nwrote %s", self.out / "summary.json")
            if failed:
                names = ", ".join(c["name"] for c in failed)
                print(f"FAILED checks: {names}", file=sys.stderr)
        return 1 if failed else 0
