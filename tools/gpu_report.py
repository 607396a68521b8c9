"""What `./course gpu-check` says: the plan a dry run prints, and the report a real run writes.

`print_plan` prints the rows and the estimate (`--dry-run`); `write_report` writes
runs/gpu-check/report.md and report.json: per chapter passed / failed (the first error line) /
skipped (why), one row per run, the GPU figures of the timing phase, and what one machine of this
size cannot test. Part of tools/gpu_check.py (its docstring tells the whole check).
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tools.gpu_plan import COSTS, CUDA_START_S, UNMEASURED_S, Run, estimate

# What one GPU cannot test (a machine with one GPU runs NCCL at world 1 only).
ONE_GPU_CANNOT_TEST = [
    ("NCCL with more than one rank", "NCCL refuses two ranks on one GPU, so every multi-rank run "
     "here is gloo on CUDA tensors (all-reduce, broadcast, all-gather), never NCCL"),
    ("P2P ordering", "send/recv between ranks under NCCL (chapter 4's and 17's pipelines, chapter "
     "7's and 18's rings, chapter 22's leaders) is not run at all"),
    ("per-rank device placement", "every rank is on cuda:0, so a rank put on the wrong device "
     "(cuda:LOCAL_RANK, DDP's device_ids) cannot show"),
    ("uneven collectives", "all-to-all with uneven splits (chapter 19's experts), uneven "
     "all-gather and reduce-scatter under NCCL"),
    ("NVLS", "NVLink SHARP (chapters 20 and 25 set NCCL_ALGO=^NVLS for bitwise reproducibility) "
     "needs several GPUs on an NVSwitch"),
]
MULTI_NODE_CANNOT_TEST = [("more than one node", "inter-node NCCL (chapter 22) and the two-node "
                           "commands (chapter 25's shared --out)")]


def machine() -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0],
            "interpreter": sys.executable, "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def chapter_results(runs: list[Run]) -> dict[str, dict]:
    """Per chapter: 'failed' (with the first failing run and its first error line) if a run
    failed, else 'passed' if one passed, else 'skipped' (why); and the GPU figures of its timing
    runs that passed or failed (a measurement either way; the status says which)."""
    chapters: dict[str, list[Run]] = {}
    for r in runs:
        chapters.setdefault(r.script.split("/")[0], []).append(r)
    result = {}
    for name, rs in sorted(chapters.items()):
        failed = [r for r in rs if r.status == "FAIL"]
        passed = [r for r in rs if r.status == "pass"]
        if failed:
            f = failed[0]
            entry = {"status": "failed", "why": f"{f.script.split('/')[1]} w{f.world} {f.backend}: "
                     f"{f.reason}" + (f": {f.error_line}" if f.error_line else "")}
        elif passed:  # and what of it was skipped
            entry = {"status": "passed", "why": "; ".join(dict.fromkeys(
                f"{r.script.split('/')[1]} skipped: {r.reason}" for r in rs if r.status == "skipped"))}
        elif any(r.status == "planned" for r in rs):
            entry = {"status": "not run", "why": "planned runs did not run"}
        else:
            entry = {"status": "skipped", "why": "; ".join(dict.fromkeys(
                f"{r.script.split('/')[1]}: {r.reason}" for r in rs if r.reason))}
        entry["runs"] = {s: sum(r.status == s for r in rs) for s in ("pass", "FAIL", "n/a", "skipped")}
        entry["figures"] = {}
        for r in rs:
            if r.phase == "timing" and r.gpu_figures:
                for fname, f in r.figures.items():
                    if re.search(r.gpu_figures, fname):
                        entry["figures"][fname] = {**f, "script": r.script.split("/")[1],
                                                   "world": r.world, "run": r.status}
                if r.note:
                    entry["figures_note"] = r.note
        result[name] = entry
    return result


def report_rows(runs: list[Run]) -> list[str]:
    rows = ["| chapter | script | world | backend | phase | status | checks | timing | time (s) | note |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        chapter, script = r.script.split("/")
        checks = f"{r.checks_passed}/{r.checks_total}" if r.checks_total else "-"
        timing = f"{r.timing_ok}/{r.timing_total}" if r.timing_total else "-"
        note = (r.reason + (f": {r.error_line}" if r.error_line else "")).replace("|", "/")[:160]
        rows.append(f"| {chapter} | {script} | {r.world} | {r.backend} | {r.phase} | {r.status} | "
                    f"{checks} | {timing} | {r.seconds or '-'} | {note} |")
    return rows


def _value(f: dict) -> str:
    return f"{f['measured']}{(' ' + f['unit']) if f.get('unit') else ''}"


def cannot_test(gpus: int) -> list[dict]:
    """What a check on `gpus` GPUs of one node cannot test: [{"what": ..., "why": ...}]."""
    return [{"what": w, "why": y} for w, y in
            (ONE_GPU_CANNOT_TEST if gpus <= 1 else []) + MULTI_NODE_CANNOT_TEST]


def write_report(runs: list[Run], out_root: Path, seconds: float, mach: dict | None = None,
                 estimate_s: dict | None = None) -> Path:
    out_root.mkdir(parents=True, exist_ok=True)
    mach = mach or machine()
    chapters = chapter_results(runs)
    counts = {s: sum(r.status == s for r in runs) for s in ("pass", "FAIL", "n/a", "skipped")}
    per = {s: sum(c["status"] == s for c in chapters.values()) for s in ("passed", "failed", "skipped")}
    gpu = f"{mach.get('gpu', 'no GPU')} x {mach['gpus']}"
    lines = [f"# GPU check: {gpu}, torch {mach['torch']}, CUDA {mach.get('cuda', '-')}, "
             f"NCCL {mach.get('nccl', '-')}", "",
             f"{len(runs)} runs in {seconds:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items()),
             "chapters: " + ", ".join(f"{v} {k}" for k, v in per.items()), "",
             "## Chapters", "", "| chapter | status | why |", "|---|---|---|"]
    for name, c in chapters.items():
        lines.append(f"| {name} | {c['status']} | {c['why'].replace('|', '/')[:200]} |")
    lines += ["", "## GPU figures (timing phase: one run at a time)", ""]
    figs = [(name, fname, f) for name, c in chapters.items() for fname, f in c["figures"].items()]
    if figs:
        lines += ["| chapter | script | figure | measured | run |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {f['script']} | {fname} | {_value(f)} | {f['run']} |"
                  for name, fname, f in figs]
        notes = [f"- {name}: {c['figures_note']}" for name, c in chapters.items() if c.get("figures_note")]
        lines += ["", *notes] if notes else []
    else:
        lines.append("none measured")
    lines += ["", f"## What this machine cannot test ({mach['gpus']} GPU(s), one node)", ""]
    lines += [f"- **{c['what']}**: {c['why']}" for c in cannot_test(mach["gpus"])]
    lines += ["", "## Runs", "", *report_rows(runs), ""]
    (out_root / "report.md").write_text("\n".join(lines) + "\n")
    (out_root / "report.json").write_text(json.dumps(
        {"machine": mach, "seconds": round(seconds, 1), "estimate": estimate_s,
         "date": time.strftime("%Y-%m-%d", time.gmtime()), "chapters": chapters,
         "cannot_test": cannot_test(mach["gpus"]), "runs": [asdict(r) for r in runs]}, indent=1))
    return out_root / "report.md"


def print_plan(runs: list[Run], gpus: int, jobs: int, timeout: float) -> None:
    est = estimate(runs, jobs)
    todo = [r for r in runs if r.status == "planned"]
    print(f"plan for {gpus} GPU(s): {len(todo)} runs, {len(runs) - len(todo)} not run; a run "
          "passes when it ends as it expects and every fatal check in its summary passed")
    for r in runs:
        if r.command:
            what = " ".join(Path(c).name if "/" in c and not c.startswith("--") else c
                            for c in r.command[1:])
            what = what.replace("-m torch.distributed.run --standalone ", "torchrun ")
            cap = f"cap {r.cap_s:.0f} s" if r.phase == "timing" else f"OMP {r.threads}"
            what += f"  ({r.note})" if r.note else ""
            print(f"  {r.script:<34} w{r.world} {r.backend:<5} {r.phase:<11} ~{r.estimate_s:3.0f} s "
                  f"{cap:<9} expect {r.expected}: {what}")
        else:
            print(f"  {r.script:<34} w{r.world} {r.backend:<5} {r.status}: {r.reason}")
    print(f"estimate: correctness {est['correctness_s']} s ({est['correctness_runs']} runs, {jobs} at "
          f"once), then timing {est['timing_s']} s ({est['timing_runs']} runs one at a time, capped at "
          f"{est['timing_cap_s']} s in all): about {est['total_s']} s; at most "
          f"{est['correctness_s'] + est['timing_cap_s']} s if every timing run reaches its cap")
    print(f"  (each run: its CPU seconds at its default size, measured on CPU ({COSTS.name}), "
          f"over its ranks, + {CUDA_START_S:.0f} s CUDA start-up, stated, not measured; a run "
          f"not measured counts {UNMEASURED_S:.0f} s a rank)")
    if gpus <= 1:
        print("one GPU cannot test: " + "; ".join(w for w, _ in ONE_GPU_CANNOT_TEST)
              + " (the report says why)")

