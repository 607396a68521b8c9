"""The plan of `./course gpu-check`: which runs, at which worlds and backends, in which phase.

`plan(gpus)` gives one `Run` per script and world (each planned with its command, or "n/a" or
"skipped" with its reason); `estimate` adds up the plan's seconds. The tables below say what the
scripts cannot be planned from their code alone. Part of tools/gpu_check.py (its docstring tells
the whole check); the plan is printed by `tools.gpu_report.print_plan`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

from tools.gpu_scripts import REPO_ROOT, chapter_scripts, missing_packages, script_id
from tools.precheck import launches_itself, script_module

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
# Scripts that change the machine itself (root, network namespaces): never run by this check;
# their tests run on CPU under COURSE_SYSTEM_TESTS=1 (chapter 22's lesson has the recorded runs).
SYSTEM = {
    "ch22_networking/netns": "builds network namespaces as root: run it by hand (chapter 22)",
}
# Scripts whose designed outcome is a failure: (exit status, a regular expression its output
# must hold). hang.py's rank 0 ends the run with SystemExit(message) once its checks are recorded
# (exit 1; torchrun exits 1 when a rank does).
EXPECTED = {
    "ch13_fault_tolerance/hang": (
        1, r"error: rank 1 stopped responding: all_reduce timed out after [\d.]+ s \(checks passed\)"),
}
# The timing phase: script -> (extra options, the figures that are GPU figures, cap in seconds).
# Its NCCL run on every GPU of the machine (world G, or 1 on one GPU) goes here instead of the
# correctness phase, alone on the machine. Chapter 25's
# MFU and tokens/s mean something only at its GPU preset (a 300M-parameter Llama, torch.compile),
# so it gets a run of its own at that preset; its default run stays a correctness run.
TIMING = {
    "ch07_communication/train": ([], r"busbw", 40),
    "ch08_overlap/train": ([], r"step time", 40),
    "ch15_profiling/train": ([], r"MFU|step time|peak FLOP/s", 40),
    "ch25_llm/train": (["--preset", "gpu"], r"MFU|tokens/s", 100),
    "ch28_inference/train": ([], r"tokens/s", 40),
}
# What a timing figure measured at world 1 (a machine with one GPU) is, where it is not what the
# lesson's figure is on several GPUs.
TIMING_AT_WORLD_1 = {
    "ch07_communication/train": "world 1: busbw = algbw x 2(n-1)/n is 0 by definition; the bus "
                                "bandwidth needs 2 or more GPUs under NCCL",
    "ch08_overlap/train": "world 1: nothing to communicate, so nothing to overlap; the step times "
                          "are compute alone",
}
# CUDA start-up per run, added to its measured CPU cost (CPU seconds over its ranks) in the
# estimate: creating the CUDA context and, under NCCL, the communicator. Importing torch (the
# CUDA build, 2.14.1+cu130, on the machine that measured) is in the measured CPU seconds already.
# Stated, not measured (no GPU here); the ranks of one run start at the same time, each on its
# own cores, so it counts once per run. A run not in the cost table counts UNMEASURED_S a rank.
CUDA_START_S = 5.0
UNMEASURED_S = 30.0
COSTS = Path(__file__).with_name("gpu_check_costs.json")
# The machine a dry run on a CPU plans for: the one GPU machine this course is lent now and then
# (one H200, 16 cores, its own torch 2.11 on Python 3.12, no pip).
LENT_GPUS, LENT_CORES = 1, 16
LENT_ABSENT = {"deepspeed", "ray", "trl"}  # NOTES.md; a run there probes its own interpreter


@dataclass
class Run:
    script: str
    world: int
    backend: str
    command: list[str] = field(default_factory=list)
    status: str = "planned"  # pass, FAIL, n/a, skipped
    reason: str = ""
    phase: str = "correctness"  # or "timing": alone on the machine, capped at cap_s
    expect_exit: int = 0
    expect_message: str = ""  # a regular expression the output must hold (a designed failure)
    cap_s: float = 0.0  # killed, with its ranks, after this many seconds
    estimate_s: float = 0.0
    threads: int = 1  # OMP_NUM_THREADS of each of its processes
    gpu_figures: str = ""  # timing runs: which figures are GPU figures (a regular expression)
    note: str = ""  # timing runs: what its figures mean at this world, where it differs
    checks_passed: int = 0
    checks_total: int = 0
    timing_ok: int = 0
    timing_total: int = 0
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    error_line: str = ""
    output_tail: str = ""

    @property
    def expected(self) -> str:
        """What the row expects (besides every fatal check passed, which every row needs)."""
        if not self.expect_message:
            return f"exit {self.expect_exit}"
        return f"exit {self.expect_exit} and /{self.expect_message}/"


@contextlib.contextmanager
def seeing_gpus(gpus: int):
    """torch.cuda as a machine with `gpus` GPUs shows it, for the scripts' own refusals, so that a
    plan made on a CPU says what the GPU machine will say (DataParallel: 'needs 2 GPUs')."""
    import torch

    with mock.patch.object(torch.cuda, "device_count", lambda: gpus), \
            mock.patch.object(torch.cuda, "is_available", lambda: gpus > 0):
        yield


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


def load_costs(path: Path = COSTS) -> dict[str, float]:
    """'chNN_x/script wN' -> CPU seconds (user + system, all its processes) of that run at its
    default size on CPU (tools/gpu_check_costs.json)."""
    if not path.is_file():
        return {}
    return {k: v["cpu_seconds"] for k, v in json.loads(path.read_text())["runs"].items()}


def plan(gpus: int, only: list[str] = (), python: str = sys.executable,
         out_root: Path = REPO_ROOT / "runs" / "gpu-check", cores: int | None = None,
         jobs: int | None = None, absent: set[str] = frozenset()) -> list[Run]:
    """The runs for `gpus` GPUs and `cores` CPU cores, `jobs` correctness runs at once; `absent`:
    packages the planned machine lacks although this one has them (a dry run for the lent one)."""
    cores = cores or os.cpu_count() or 2
    jobs = jobs or default_jobs(cores)
    costs = load_costs()
    runs = []
    with seeing_gpus(gpus):
        for path in chapter_scripts(only):
            runs += _plan_script(path, gpus, python, out_root, cores, jobs, costs, absent)
    return runs


def default_jobs(cores: int) -> int:
    return max(1, min(8, cores // 2))


def _plan_script(path, gpus, python, out_root, cores, jobs, costs, absent) -> list[Run]:
    sid = script_id(path)
    worlds: list[tuple[int, str]] = [(1, "nccl")]
    if gpus >= 2:
        worlds += [(w, "nccl") for w in sorted({2, gpus})]
    elif gpus == 1:
        worlds.append((2, "gloo"))
    missing = [] if sid in SYSTEM else missing_packages(path, absent)
    self_launch = launches_itself(path)
    has_nprocs = hasattr(script_module(path).Config(), "nprocs")
    runs = []
    for world, backend in worlds:
        run = Run(sid, world, backend)
        run.expect_exit, run.expect_message = EXPECTED.get(sid, (0, ""))
        runs.append(run)
        if sid in SYSTEM:
            run.status, run.reason = "skipped", SYSTEM[sid]
            continue
        if missing:
            run.status = "skipped"
            run.reason = f"needs {', '.join(missing)} (" + (
                "not on the lent machine)" if set(missing) <= set(absent) else "not installed)")
            continue
        if self_launch and not has_nprocs and world > 1:
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
        run.command = _command(path, python, world, [*device_args, "--out",
                                                     str(out_root / sid / f"w{world}-{backend}")],
                               self_launch, has_nprocs)
        # its ranks run side by side, each on cores of its own: its CPU seconds over its ranks
        run.estimate_s = round(costs.get(f"{sid} w{world}", UNMEASURED_S * world) / world
                               + CUDA_START_S, 1)
        run.threads = max(1, cores // (jobs * world))
        run.cap_s = 0.0  # the correctness phase's --timeout, set by main
        if sid in TIMING and backend == "nccl" and world == max(1, gpus):  # all its NCCL GPUs
            extra, figures, cap = TIMING[sid]
            timed = run
            if extra:  # a run of its own at another size; the default one stays a correctness run
                timed = Run(sid, world, backend, expect_exit=run.expect_exit,
                            expect_message=run.expect_message)
                timed.command = _command(path, python, world, [
                    *device_args, *extra, "--out", str(out_root / sid / f"w{world}-{backend}-timing")],
                    self_launch, has_nprocs)
                runs.append(timed)
                timed.estimate_s = cap  # not measurable on a CPU: its cap is its estimate
            timed.phase, timed.gpu_figures, timed.cap_s = "timing", figures, cap
            timed.note = TIMING_AT_WORLD_1.get(sid, "") if world == 1 else ""
            timed.threads = max(1, cores // world)
    return runs


def _command(path: Path, python: str, world: int, args: list[str], self_launch: bool,
             has_nprocs: bool) -> list[str]:
    if self_launch:  # its world is its --nprocs (default 2 in spawn.py): always say it
        return [python, str(path), *args, *(["--nprocs", str(world)] if has_nprocs else [])]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
            str(path), *args]


def estimate(runs: list[Run], jobs: int) -> dict:
    """Seconds for the plan: the correctness phase as `jobs` slots filled longest run first, then
    the timing runs one after another (each at most its cap)."""
    correct = sorted((r for r in runs if r.status == "planned" and r.phase == "correctness"),
                     key=lambda r: -r.estimate_s)
    slots = [0.0] * max(1, jobs)
    for r in correct:
        slots[slots.index(min(slots))] += r.estimate_s
    timing = [r for r in runs if r.status == "planned" and r.phase == "timing"]
    c, t = max(slots), sum(min(r.estimate_s, r.cap_s) for r in timing)
    return {"correctness_s": round(c), "timing_s": round(t), "total_s": round(c + t),
            "timing_cap_s": round(sum(r.cap_s for r in timing)),
            "correctness_runs": len(correct), "timing_runs": len(timing)}

