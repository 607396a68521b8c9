"""Run every chapter script's default run on this machine's GPUs and write one report.

    ./course gpu-check                 # every script, on the GPUs this machine has
    ./course gpu-check --dry-run       # the plan only (works on a CPU; --gpus N to plan for N GPUs)
    ./course gpu-check --only ch03 ch07 --jobs 4 --timeout 300
    COURSE_PYTHON=python3 ./course gpu-check     # a machine whose own torch must do (no setup)

It runs the scripts, not pytest: each default run prints and records its own checks. The plan
for G GPUs:
- world 1 with NCCL on cuda:0, every script (a script whose technique needs two ranks says so
  and is reported "n/a");
- G >= 2: world 2 and world G with NCCL, one rank per GPU;
- G == 1: NCCL cannot put two ranks on one GPU ("Duplicate GPU detected"), so two ranks share it
  with `--backend gloo --device cuda` for the scripts whose collectives gloo runs on CUDA tensors
  (all-reduce, broadcast, all-gather: what DDP needs); the others are reported "n/a on one GPU".
A script whose optional package is missing (DeepSpeed, transformers, ...) is reported "skipped"
with the package's name. Several runs go at once (`--jobs`); each is bounded by `--timeout`.

The report, `runs/gpu-check/report.md` and `report.json`: one row per run with chapter, script,
world, backend, status (pass / FAIL / n/a / skipped), fatal checks passed/total, timing checks
within their expectation/total, wall time, and the run's GPU figures (every figure its
summary.json records, with units); `report.json` adds the machine (GPU name and count, torch,
CUDA and NCCL versions) and the last lines of output of every run that did not pass.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # this checkout's code, whatever is installed

from tools.precheck import launches_itself, script_module  # noqa: E402

# Scripts whose collectives on device tensors gloo runs on CUDA, so two ranks can share one GPU
# over gloo. torch's backend table marks gloo's broadcast, all-reduce, reduce, all-gather, gather,
# scatter and reduce-scatter for GPUs (not send/recv, all-to-all or barrier); torch 2.14.1's
# ProcessGroupGloo runs them on CUDA tensors through host memory (reduce-scatter as an all-reduce of
# the whole input; coalesced collectives are CPU-only), and has a CUDA all-to-all the table does not
# list, but no CUDA path for send/recv. Object collectives and common.distributed's number
# helpers use CPU tensors under gloo. Left out: scripts that send/recv (pipelines, rings; chapter 22's leaders), and
# DTensor/FSDP2 and sequence parallelism, untested under gloo on CUDA (chapter 10 skips its FSDP2
# stage there and says so; chapter 05 refuses; chapter 30 skips its pipeline layout).
GLOO_ON_CUDA = {
    "ch01_overview/train", "ch02_single_node/train", "ch02_single_node/spawn",
    "ch03_data_parallel/train", "ch07_communication/broadcast_test", "ch08_overlap/train",
    "ch09_compression/train",
    "ch10_mixed_precision/train", "ch11_data_loading/train", "ch13_fault_tolerance/train",
    "ch13_fault_tolerance/hang", "ch14_monitoring/train", "ch15_profiling/train",
    "ch20_memory/train", "ch23_containers/train", "ch24_cloud/train", "ch29_cost/train",
    "ch30_frontier/train", "ch30_frontier/fedavg",
}
# Packages a script cannot run without (checked before launching; a run that still fails on a
# missing module is reported "skipped" too).
NEEDS = {
    "ch06_hybrid_zero/deepspeed_zero": ["deepspeed"],
    "ch12_checkpointing/deepspeed_ckpt": ["deepspeed"],
    "ch19_moe/deepspeed_moe": ["deepspeed"],
    "ch21_hyperparameters/tune": ["ray"],
    "ch27_rlhf/trl_grpo": ["trl"],
}
# Scripts that change the machine itself (root, network namespaces): never run by this check;
# their tests run on CPU under COURSE_SYSTEM_TESTS=1 (chapter 22's lesson has the recorded runs).
SYSTEM = {
    "ch22_networking/netns": "builds network namespaces as root: run it by hand (chapter 22)",
}


def chapter_scripts(only: list[str] = ()) -> list[Path]:
    scripts = sorted(p for p in REPO_ROOT.glob("chapters/ch[0-9][0-9]_*/*.py")
                     if "__main__" in (t := p.read_text()) and "parse_config(" in t)
    return [p for p in scripts if not only or any(p.parent.name.startswith(o) for o in only)]


def script_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


@dataclass
class Run:
    script: str
    world: int
    backend: str
    command: list[str] = field(default_factory=list)
    status: str = "planned"  # pass, FAIL, n/a, skipped
    reason: str = ""
    checks_passed: int = 0
    checks_total: int = 0
    timing_ok: int = 0
    timing_total: int = 0
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    output_tail: str = ""


def refusal(path: Path, world: int, args: list[str] = ()) -> str | None:
    """The script's own one-sentence refusal of its defaults (plus `args`, the device and
    backend of the run) at this world size, if any."""
    module = script_module(path)
    validate = getattr(module, "validate", None)
    if validate is None:
        return None
    from common.config import build_parser

    cfg = module.Config(**vars(build_parser(module.Config).parse_args(list(args))))
    if hasattr(cfg, "nprocs"):
        cfg.nprocs = world
    try:
        validate(cfg, world)
    except ValueError as e:
        return str(e)
    return None


def plan(gpus: int, only: list[str] = (), python: str = sys.executable,
         out_root: Path = REPO_ROOT / "runs" / "gpu-check") -> list[Run]:
    runs = []
    for path in chapter_scripts(only):
        sid = script_id(path)
        worlds: list[tuple[int, str]] = [(1, "nccl")]
        if gpus >= 2:
            worlds += [(w, "nccl") for w in sorted({2, gpus})]
        elif gpus == 1:
            worlds.append((2, "gloo"))
        for world, backend in worlds:
            run = Run(sid, world, backend)
            runs.append(run)
            if sid in SYSTEM:
                run.status, run.reason = "skipped", SYSTEM[sid]
                continue
            missing = [m for m in NEEDS.get(sid, []) if importlib.util.find_spec(m) is None]
            if missing:
                run.status, run.reason = "skipped", f"needs {', '.join(missing)} (not installed)"
                continue
            self_launch = launches_itself(path)
            if self_launch and not hasattr(script_module(path).Config(), "nprocs") and world > 1:
                run.status, run.reason = "n/a", "one process by design"
                continue
            if backend == "gloo" and sid not in GLOO_ON_CUDA:
                run.status = "n/a"
                run.reason = ("on one GPU: not run over gloo (send/recv, which gloo cannot do on CUDA "
                              "tensors, or DTensor/FSDP2, untested there)")
                continue
            device_args = ["--device", "cuda", "--backend", backend]
            why = refusal(path, world, device_args)
            if why:
                run.status, run.reason = "n/a", f"refused at world {world}: {why}"
                continue
            out = out_root / sid / f"w{world}-{backend}"
            args = [*device_args, "--out", str(out)]
            if self_launch:
                extra = ["--nprocs", str(world)] if world > 1 else []
                run.command = [python, str(path), *args, *extra]
            else:
                run.command = [python, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={world}", str(path), *args]
    return runs


def execute(run: Run, timeout: float) -> Run:
    out = Path(run.command[run.command.index("--out") + 1])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(run.command, capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=REPO_ROOT)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code = None
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    run.seconds = round(time.perf_counter() - start, 1)
    missing = re.search(r"No module named '([\w.]+)'", output)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if summary:
        fatal = [c for c in summary["checks"] if c["kind"] != "timing"]
        timing = [c for c in summary["checks"] if c["kind"] == "timing"]
        run.checks_passed, run.checks_total = sum(c["ok"] for c in fatal), len(fatal)
        run.timing_ok, run.timing_total = sum(c["ok"] for c in timing), len(timing)
        run.figures = summary["figures"]
    if code == 0 and summary is not None and run.checks_passed == run.checks_total:
        run.status = "pass"
    elif missing and code not in (0, None):
        run.status, run.reason = "skipped", f"needs {missing.group(1).split('.')[0]} (not installed)"
    else:
        run.status = "FAIL"
        run.reason = "timed out" if code is None else (
            f"exit {code}" if summary is None else f"exit {code}, {run.checks_total - run.checks_passed} check(s) failed")
    if run.status != "pass":
        run.output_tail = output[-3000:]
    return run


def machine() -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0],
            "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def report_rows(runs: list[Run]) -> list[str]:
    rows = ["| chapter | script | world | backend | status | checks | timing | time (s) | note |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        chapter, script = r.script.split("/")
        checks = f"{r.checks_passed}/{r.checks_total}" if r.checks_total else "-"
        timing = f"{r.timing_ok}/{r.timing_total}" if r.timing_total else "-"
        note = r.reason.replace("|", "/")[:120]
        rows.append(f"| {chapter} | {script} | {r.world} | {r.backend} | {r.status} | {checks} | "
                    f"{timing} | {r.seconds or '-'} | {note} |")
    return rows


def write_report(runs: list[Run], out_root: Path, seconds: float) -> Path:
    out_root.mkdir(parents=True, exist_ok=True)
    mach = machine()
    counts = {s: sum(r.status == s for r in runs) for s in ("pass", "FAIL", "n/a", "skipped")}
    lines = [f"# GPU check: {mach.get('gpu', 'no GPU')} x {mach['gpus']}, torch {mach['torch']}",
             "", f"{len(runs)} runs in {seconds:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items()),
             "", *report_rows(runs), "", "## Figures", ""]
    for r in runs:
        if r.figures:
            lines.append(f"**{r.script}**, world {r.world}, {r.backend}: " + "; ".join(
                f"{name} = {f['measured']}{(' ' + f['unit']) if f.get('unit') else ''}"
                for name, f in r.figures.items()))
            lines.append("")
    (out_root / "report.md").write_text("\n".join(lines) + "\n")
    (out_root / "report.json").write_text(json.dumps(
        {"machine": mach, "seconds": round(seconds, 1), "runs": [asdict(r) for r in runs]}, indent=1))
    return out_root / "report.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--gpus", type=int, default=None,
                        help="plan for this many GPUs (default: the GPUs torch sees)")
    parser.add_argument("--only", nargs="+", default=[], help="chapter prefixes, e.g. ch03 ch07")
    parser.add_argument("--jobs", type=int, default=0,
                        help="runs at once (default: CPU cores / 2, at most 8)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run (default 240)")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "gpu-check"),
                        help="report folder (default runs/gpu-check)")
    args = parser.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
    out_root = Path(args.out)
    runs = plan(gpus, args.only, out_root=out_root)
    todo = [r for r in runs if r.status == "planned"]
    if args.dry_run:
        print(f"plan for {gpus} GPU(s): {len(todo)} runs, {len(runs) - len(todo)} not run")
        for r in runs:
            what = " ".join(Path(c).name if "/" in c and not c.startswith("--") else c
                            for c in r.command) if r.command else f"{r.status}: {r.reason}"
            print(f"  {r.script:<36} w{r.world} {r.backend:<5} {what}")
        return 0
    if gpus == 0:
        print("gpu-check: torch sees no CUDA GPU here; use --dry-run to see the plan", file=sys.stderr)
        return 2
    jobs = args.jobs or max(1, min(8, (os.cpu_count() or 2) // 2))
    print(f"gpu-check: {len(todo)} runs on {gpus} GPU(s), {jobs} at once, "
          f"{args.timeout:.0f} s each at most", flush=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:
        for r in pool.map(lambda r: execute(r, args.timeout), todo):
            print(f"  {r.status:<7} {r.script:<36} w{r.world} {r.backend:<5} {r.seconds:6.1f} s "
                  f"checks {r.checks_passed}/{r.checks_total} {r.reason}", flush=True)
    path = write_report(runs, out_root, time.perf_counter() - start)
    print(f"wrote {path} and report.json")
    return 1 if any(r.status == "FAIL" for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
