"""The run-output writer: `summary.json`, `metrics.jsonl`, optional TensorBoard, the checks table.

Every script records what it measured beside what theory predicts:

    rec = RunRecorder(cfg, __file__, info)
    rec.metrics(step, loss=..., lr=...)                        # one JSON line per logged step
    rec.figure("busbw", measured=0.9, expected=1.0, unit="GB/s")
    rec.check("hand DP == DDP", "parity", measured=max_diff, expected=0.0, tolerance=1e-12)
    rec.check("naive mean is off", "parity", measured=err, expected=1e-8, compare=">")
    return rec.finish()                                         # exit status: 1 if a check failed

summary.json: {chapter, script, world_size, backend, device, versions, config, figures, checks};
each check is {name, kind, measured, expected, compare, tolerance, relative, ok} with kind one of
parity, formula, count, timing. A check is decided by `compare`: "==" (|measured − expected| ≤
tolerance, × |expected| when relative), "<", "<=", ">", ">=" against the number `expected`, or
"between" with `expected = [low, high]` (inclusive): the bound that decided it is always in the
file. Timing checks are reported, never fatal: wall clocks on a shared machine are noisy.

Every rank records; at `finish()` the ranks exchange their verdicts, so a check that failed on
any rank fails in rank 0's summary (with `failed_on_ranks`) and every rank exits with the same
status. Only rank 0 writes. How a check is decided and how the table is laid out live in
`common.check_table`; the default output folder in `common.paths` (both re-exported here).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# check_ok, expected_text, the table's widths and the default folder are imported from here by
# chapters and tests: re-exported from the modules they live in
from common.check_table import (  # noqa: F401
    CELL_WIDTH,
    CHECK_KINDS,
    COMPARES,
    TABLE_WIDTH,
    check_ok,
    expected_text,
    fmt,
    short,
    table_lines,
)
from common.config import config_dict
from common.files import LOCKED_ENV, atomic_write, lock_folder, unlock_folder
from common.log import library_log, library_output, log, name_library_log, shown_path
from common.paths import REPO_ROOT, default_out_dir  # noqa: F401


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


def is_main_script(script_file: str) -> bool:
    """Is `script_file` the program this process runs (under torchrun, python, or a rank that
    `mp.spawn` started from it)? False when a test or notebook calls it in its own process."""
    try:
        return Path(sys.argv[0]).resolve() == Path(script_file).resolve()
    except (IndexError, OSError):
        return False


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
        self._untabled: set[str] = set()  # figures a check already shows (see `figure`)
        self.start = time.perf_counter()
        self._metrics = self._tb = None
        self._locked = False
        if self.is_main:
            # One run per folder: a second run on this --out is refused before it touches the
            # first one's files (common.files.lock_folder; released by `finish` or when the
            # process ends). `parse_config` has usually taken it already, before any process
            # group (COURSE_LOCKED_FOLDERS). A test or notebook calling a script's main in its own
            # process takes no lock: the process outlives the run.
            held = os.environ.get(LOCKED_ENV, "").split(os.pathsep)
            self._locked = is_main_script(script_file) and str(self.out.resolve()) not in held
            if self._locked:
                lock_folder(self.out, "--out")
        if is_main_script(script_file):  # not a test or notebook calling in process
            library_log(self.out, info.rank if info is not None else 0)
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            self._metrics = open(self.out / "metrics.jsonl", "w")
            if getattr(cfg, "tensorboard", False):
                with library_output():
                    from torch.utils.tensorboard import SummaryWriter  # needs tensorboard

                    self._tb = SummaryWriter(str(self.out / "tb"))
                log.info("TensorBoard events go to %s; to see them:", shown_path(self.out / "tb"))
                log.info("  tensorboard --logdir %s", shown_path(self.out / "tb"))

    @property
    def tensorboard_writer(self):
        """The TensorBoard `SummaryWriter` that `metrics` writes through on the main rank (None on
        other ranks and without `--tensorboard`): for what `metrics` does not log, such as
        `add_scalars` or `add_histogram`. `finish` closes it."""
        return self._tb

    def metrics(self, step: int, **values) -> None:
        """Append one line to metrics.jsonl (flushed at once: nothing lost on a crash)."""
        if not self.is_main:
            return
        line = {"step": step, "time_s": round(time.perf_counter() - self.start, 4)}
        line.update({k: _plain(v) for k, v in values.items()})
        try:
            self._metrics.write(json.dumps(line) + "\n")
            self._metrics.flush()
        except OSError as e:  # a full disk: say which file (a write error names none)
            raise OSError(e.errno, e.strerror, str(self.out / "metrics.jsonl")) from e
        if self._tb is not None:
            for k, v in line.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def figure(self, name: str, measured, expected=None, unit: str = "", spread=None,
               table: bool = True) -> None:
        """Record a measured figure beside the value theory predicts (if it predicts one).
        `spread=(low, high)` records the range over repeats (a timing's min and max).
        `table=False` keeps it out of the printed table (summary.json still has it): for a figure
        that a check prints with the same numbers, so the console shows each result once."""
        if not table:
            self._untabled.add(name)
        else:
            self._untabled.discard(name)
        self.figures[name] = {"measured": _plain(measured), "expected": _plain(expected), "unit": unit}
        if spread is not None:
            self.figures[name]["spread"] = [_plain(spread[0]), _plain(spread[1])]

    def check(self, name: str, kind: str, measured, expected, tolerance: float = 0.0,
              relative: bool = False, compare: str = "==") -> bool:
        """Record a check and return whether it passed on this rank (see `check_ok`)."""
        if kind not in CHECK_KINDS:
            raise ValueError(f"check kind must be one of {CHECK_KINDS}, not {kind!r}")
        measured, expected = _plain(measured), _plain(expected)
        ok = check_ok(measured, expected, tolerance, relative, compare)
        self.checks.append({"name": name, "kind": kind, "measured": measured,
                            "expected": expected, "compare": compare, "tolerance": tolerance,
                            "relative": relative, "ok": bool(ok)})
        return bool(ok)

    def _merge_ranks(self) -> None:
        """Fold every rank's verdicts into this rank's checks (a collective: every rank calls
        `finish`). A check that failed anywhere fails here, naming the ranks; a check recorded
        only on another rank is added with its rank."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        mine = [(c["name"], c["ok"], c) for c in self.checks]
        everyone: list = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(everyone, mine)
        except Exception as e:  # a peer is gone: report this rank's view, and say so
            log.warning("could not gather the other ranks' checks (%s); summary is rank %d's "
                        "view only", e, dist.get_rank())
            return
        for rank, theirs in enumerate(everyone):
            seen: dict[str, int] = {}
            for name, ok, check in theirs:
                k = seen[name] = seen.get(name, -1) + 1  # k-th check of that name on that rank
                same = [c for c in self.checks if c["name"] == name]
                if k < len(same):
                    if not ok:
                        same[k]["ok"] = False
                        same[k].setdefault("failed_on_ranks", []).append(rank)
                elif rank != dist.get_rank():
                    self.checks.append({**check, "rank": rank,
                                        **({} if ok else {"failed_on_ranks": [rank]})})

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
        rows = [("figure", "unit", "expected", "measured", "range", "")]
        rows += [(n, f["unit"], fmt(f["expected"]) if f["expected"] is not None else "-",
                  fmt(f["measured"]),
                  f"{short(f['spread'][0])}–{short(f['spread'][1])}" if "spread" in f else "", "")
                 for n, f in self.figures.items() if n not in self._untabled]
        rows += [("check", "kind", "expected", "measured", "tolerance", "ok")]
        rows += [(c["name"], c["kind"], expected_text(c), fmt(c["measured"]),
                  (fmt(c["tolerance"]) + (" rel" if c["relative"] else ""))
                  if c.get("compare", "==") == "==" else "",
                  "ok" if c["ok"] else ("FAIL" if c["kind"] != "timing" else "slow"))
                 for c in self.checks]
        split = len(self.figures) - len(self._untabled & set(self.figures)) + 1
        for part in (rows[:split], rows[split:]):
            if len(part) == 1 and part is rows[:split] and self._untabled:
                continue  # every figure is shown by a check
            log.info("")
            for line in table_lines(part):
                log.info(line)

    def finish(self) -> int:
        """Gather every rank's verdicts, write summary.json, print the table; return 1 on every
        rank if a fatal check failed on any rank, else 0. Every rank must call it."""
        self._merge_ranks()
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
            if self._locked:
                unlock_folder(self.out)
            name_library_log()
            if failed:
                names = ", ".join(c["name"] for c in failed)
                print(f"FAILED checks: {names}", file=sys.stderr)
        return 1 if failed else 0


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """Write a matplotlib figure as a PNG without matplotlib's version in its metadata (so drawing
    it again from the same data gives the same bytes: tools/figures.py) and close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    plt.close(fig)
    return Path(path)
