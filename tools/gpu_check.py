"""Run every chapter script's default run on this machine's GPUs and write one report.

    ./course gpu-check                 # every script, on the GPUs this machine has
    ./course gpu-check --dry-run       # the plan and its time estimate (works on a CPU; --gpus N)
    ./course gpu-check --only ch03 ch07 --jobs 4
    COURSE_PYTHON=python3 ./course gpu-check     # a machine whose own torch must do (no setup)
    ./course gpu-check --fill-lessons runs/gpu-check/report.json   # the figures into the lessons

It runs the scripts, not pytest: each default run prints and records its own checks. The plan
for G GPUs:
- world 1 with NCCL on cuda:0, every script (a script whose technique needs two ranks says so
  and is listed "n/a" with its own reason); a script that starts its own processes gets
  `--nprocs` equal to the row's world, so a world-1 row starts one process;
- G >= 2: world 2 and world G with NCCL, one rank per GPU;
- G == 1: NCCL cannot put two ranks on one GPU ("Duplicate GPU detected"), so two ranks share it
  with `--backend gloo --device cuda` for the scripts whose collectives gloo runs on CUDA tensors
  (all-reduce, broadcast, all-gather: what DDP needs); the others are listed "n/a on one GPU".
Every row has an expected outcome: exit 0 and every fatal check passed, or, for a script that
fails by design (chapter 13's hang.py), its designed exit status and message.
A script is "skipped", before anything is launched, when a package it imports is not installed
(`importlib.util.find_spec` in the interpreter that runs the check).

Two phases. Correctness runs go several at once (`--jobs`; they share the GPU safely: each is
its own process with its own CUDA context, none reads device-wide memory or clocks into a fatal
check), each with `OMP_NUM_THREADS` set to its share of the cores. Then the timing runs
(`TIMING`: chapter 7's bus bandwidth, chapter 8's step times, chapter 15's and 25's MFU, chapter
25's and 28's tokens/s) go one at a time, each capped at its stated seconds, so that a figure
the report records as a GPU figure is a measurement, not a contention artefact. A run that
exceeds its cap is killed with every process it started (`common.launch.kill_tree`).

The estimate (`--dry-run`) is each run's CPU cost at its default size, measured on this course's
2-core CPU machine and committed in tools/gpu_check_costs.json (how: in that file), plus
CUDA_START_S per run for CUDA start-up (stated, not measured: no GPU was at hand).

The report, `runs/gpu-check/report.md` and `report.json`: per chapter passed / failed (the first
error line) / skipped (why), one row per run, the GPU figures of the timing phase, and what one
machine of this size cannot test.

This file is the command (`main`); the check lives beside it, in the order it happens:
tools/gpu_scripts.py (the scripts and the packages they need), tools/gpu_plan.py (the plan, its
tables and its estimate), tools/gpu_runner.py (running one row), tools/gpu_report.py (the plan
as printed, the report as written). Their names are re-exported here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's code, whatever is installed

# the check's parts; what main() does not use is re-exported for tests/test_gpu_check.py, which
# reads them (and patches execute and NEEDS) through this module
from tools.gpu_plan import (  # noqa: E402, F401
    CUDA_START_S,
    EXPECTED,
    GLOO_ON_CUDA,
    LENT_ABSENT,
    LENT_CORES,
    LENT_GPUS,
    SYSTEM,
    TIMING,
    UNMEASURED_S,
    Run,
    default_jobs,
    estimate,
    load_costs,
    plan,
)
from tools.gpu_report import (  # noqa: E402, F401
    ONE_GPU_CANNOT_TEST,
    machine,
    print_plan,
    write_report,
)
from tools.gpu_runner import execute, first_error_line, run_env  # noqa: E402, F401
from tools.gpu_scripts import (  # noqa: E402, F401
    NEEDS,
    chapter_scripts,
    imported_packages,
    script_id,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--gpus", type=int, default=None,
                        help="plan for this many GPUs (default: the GPUs torch sees)")
    parser.add_argument("--only", nargs="+", default=[], help="chapter prefixes, e.g. ch03 ch07")
    parser.add_argument("--jobs", type=int, default=0,
                        help="correctness runs at once (default: CPU cores / 2, at most 8)")
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds per correctness run (default 120; timing runs have their own caps)")
    parser.add_argument("--cores", type=int, default=0,
                        help="plan for this many CPU cores (default: this machine's)")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "gpu-check"),
                        help="report folder (default runs/gpu-check)")
    parser.add_argument("--fill-lessons", metavar="REPORT_JSON",
                        help="write a report's results and GPU figures into each lesson's "
                             "'on a GPU' block (between its gpu-figures markers), nothing else")
    args = parser.parse_args(argv)
    if args.fill_lessons:
        from tools.gpu_lessons import fill_lessons

        changed = fill_lessons(json.loads(Path(args.fill_lessons).read_text()))
        print(f"gpu-check: {len(changed)} lesson(s) changed" + "".join(f"\n  {p}" for p in changed))
        return 0
    import torch

    gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
    cores = args.cores or os.cpu_count() or 2
    absent: set[str] = set()
    if args.dry_run and args.gpus is None and gpus == 0:  # plan for the machine it is meant for
        gpus, cores, absent = LENT_GPUS, args.cores or LENT_CORES, LENT_ABSENT
        print(f"gpu-check: torch sees no GPU here; the plan is for the lent machine: {gpus} GPU, "
              f"{cores} cores, no {', '.join(sorted(absent))} (--gpus N --cores C to plan for "
              "another)")
    jobs = args.jobs or default_jobs(cores)
    out_root = Path(args.out)
    runs = plan(gpus, args.only, out_root=out_root, cores=cores, jobs=jobs, absent=absent)
    if args.dry_run:
        print_plan(runs, gpus, jobs, args.timeout)
        return 0
    if gpus == 0:
        print("gpu-check: torch sees no CUDA GPU here; use --dry-run to see the plan", file=sys.stderr)
        return 2
    print(f"gpu-check: {sys.executable} (Python {sys.version.split()[0]}, torch {torch.__version__}) "
          "as it is: no setup, nothing installed", flush=True)
    correct = [r for r in runs if r.status == "planned" and r.phase == "correctness"]
    timing = [r for r in runs if r.status == "planned" and r.phase == "timing"]
    for r in correct:
        r.cap_s = args.timeout
    est = estimate(runs, jobs)
    print(f"gpu-check: {len(correct)} correctness runs on {gpus} GPU(s), {jobs} at once, "
          f"{args.timeout:.0f} s each at most; then {len(timing)} timing runs one at a time "
          f"(estimate about {est['total_s']} s)", flush=True)
    start = time.perf_counter()

    def run_one(r: Run) -> Run:  # one broken run must not cost the report of all the others
        try:
            return execute(r)
        except Exception as e:  # noqa: BLE001
            r.status, r.reason, r.error_line = "FAIL", "gpu-check could not run it", f"{type(e).__name__}: {e}"
            return r

    def show(r: Run) -> None:
        print(f"  {r.status:<7} {r.script:<34} w{r.world} {r.backend:<5} {r.phase:<11} "
              f"{r.seconds:6.1f} s checks {r.checks_passed}/{r.checks_total} {r.reason}", flush=True)

    with ThreadPoolExecutor(jobs) as pool:
        for r in pool.map(run_one, correct):
            show(r)
    for r in timing:
        show(run_one(r))
    path = write_report(runs, out_root, time.perf_counter() - start, estimate_s=est)
    print(f"wrote {path} and report.json; `./course gpu-check --fill-lessons "
          f"{out_root / 'report.json'}` writes its figures into the lessons")
    return 1 if any(r.status == "FAIL" for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
