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
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
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
# Packages a script imports only when it runs (inside a function), so the import scan below
# cannot see them; the module-level imports of a script and of the course modules it imports
# are found by `imported_packages`.
NEEDS = {
    "ch06_hybrid_zero/deepspeed_zero": ["deepspeed"],
    "ch12_checkpointing/deepspeed_ckpt": ["deepspeed"],
    "ch19_moe/deepspeed_moe": ["deepspeed"],
    "ch21_hyperparameters/tune": ["ray"],
    "ch27_rlhf/trl_grpo": ["trl"],
    "ch24_cloud/train": ["fsspec"],  # its checkpoint store
    "ch25_llm/train": ["tokenizers", "transformers"],  # its tokenizer, its Hugging Face export
    "ch28_inference/train": ["transformers"],  # its reference Llama
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
# The machine a dry run on a CPU plans for: the one GPU machine this course is lent now and then
# (one H200, 16 cores, its own torch 2.11 on Python 3.12, no pip).
LENT_GPUS, LENT_CORES = 1, 16
LENT_ABSENT = {"deepspeed", "ray", "trl"}  # NOTES.md; a run there probes its own interpreter
NOT_IMPORTS = {"chapters", "common", "tools", "__future__"}


def chapter_scripts(only: list[str] = ()) -> list[Path]:
    scripts = sorted(p for p in REPO_ROOT.glob("chapters/ch[0-9][0-9]_*/*.py")
                     if "__main__" in (t := p.read_text()) and "parse_config(" in t)
    return [p for p in scripts if not only or any(p.parent.name.startswith(o) for o in only)]


def script_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def _module_file(name: str) -> Path | None:
    """chapters.ch03_x.train or common.log -> its file in this checkout, if it is one."""
    base = REPO_ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _direct_imports(path: Path) -> tuple[frozenset[str], tuple[Path, ...]]:
    """(packages, this course's module files) that `path` imports at module level, outside `try`."""
    packages, own = set(), []
    for node in ast.parse(path.read_text()).body:  # module level only; a `try` is optional
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            top = name.split(".")[0]
            if top in NOT_IMPORTS:
                if (file := _module_file(name)) is not None:
                    own.append(file)
            elif top not in sys.stdlib_module_names:
                packages.add(top)
    return frozenset(packages), tuple(own)


def imported_packages(path: Path) -> set[str]:
    """The top-level packages that `path` imports when it is loaded (module-level imports, not
    those under `try` or inside functions), following this course's own modules (chapters.*,
    common.*): what must be installed for the script to start. The standard library is left out."""
    found: set[str] = set()
    todo, seen = [Path(path)], set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        packages, own = _direct_imports(file)
        found |= packages
        todo += own
    return found


def missing_packages(path: Path, absent: set[str] = frozenset()) -> list[str]:
    """The packages `path` needs (its imports, and NEEDS) that this interpreter cannot find (or
    that `absent` says the planned machine lacks)."""
    wanted = imported_packages(path) | set(NEEDS.get(script_id(path), []))
    return sorted(m for m in wanted if m in absent or importlib.util.find_spec(m) is None)


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


def run_env(threads: int, base: dict | None = None) -> dict:
    """The environment of one run: the caller's, with this checkout first on PYTHONPATH and the
    caller's entries kept after it (packages carried as wheels stay visible), OMP_NUM_THREADS
    set to the run's share of the cores, unbuffered output."""
    env = dict(os.environ if base is None else base)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != REPO_ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *kept])
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


ERROR_LINE = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception|Exit)\b.*|^error: .*|.*\bFAILED\b.*")


def first_error_line(output: str) -> str:
    """The first line that says what went wrong: an exception's line, an 'error: ...' line, a
    failed check; else the last non-empty line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        bare = re.sub(r"^\[(?:rank|default)\d+\]:\s*", "", line)
        if ERROR_LINE.match(bare) and not bare.startswith("Traceback"):
            return bare[:300]
    return lines[-1][:300] if lines else ""


def execute(run: Run, timeout: float | None = None) -> Run:
    """Run it, bounded by its cap (or `timeout`): on the cap it is killed with every process it
    started (its ranks live in sessions of their own). Then read its summary.json."""
    from common.launch import kill_tree

    cap = timeout or run.cap_s or 240.0
    out = Path(run.command[run.command.index("--out") + 1]) if "--out" in run.command else None
    if out is not None and out.exists():  # a summary left by an earlier check must not be read
        shutil.rmtree(out)
    start = time.perf_counter()
    proc = subprocess.Popen(run.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=run_env(run.threads), cwd=REPO_ROOT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=cap)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        code = None
    run.seconds = round(time.perf_counter() - start, 1)
    missing = re.search(r"No module named '([\w.]+)'", output)
    summary_path = out / "summary.json" if out else None
    try:
        summary = json.loads(summary_path.read_text()) if summary_path and summary_path.exists() else None
    except json.JSONDecodeError:  # cut short mid-write (a run killed at its cap)
        summary = None
    if summary:
        fatal = [c for c in summary["checks"] if c["kind"] != "timing"]
        timing = [c for c in summary["checks"] if c["kind"] == "timing"]
        run.checks_passed, run.checks_total = sum(c["ok"] for c in fatal), len(fatal)
        run.timing_ok, run.timing_total = sum(c["ok"] for c in timing), len(timing)
        run.figures = summary["figures"]
    message_ok = not run.expect_message or re.search(run.expect_message, output) is not None
    if (code == run.expect_exit and message_ok and summary is not None
            and run.checks_passed == run.checks_total):
        run.status, run.reason = "pass", ""
    elif missing and code not in (0, None):
        run.status, run.reason = "skipped", f"needs {missing.group(1).split('.')[0]} (not installed)"
    else:
        run.status = "FAIL"
        if code is None:
            run.reason = f"timed out after {cap:.0f} s: killed with its ranks"
        elif code != run.expect_exit:
            run.reason = f"exit {code}" + (f" (expected {run.expect_exit})" if run.expect_exit else "")
        elif not message_ok:
            run.reason = f"exit {code} without its designed message /{run.expect_message}/"
        elif summary is None:
            run.reason = f"exit {code}, no summary.json"
        else:
            run.reason = f"exit {code}, {run.checks_total - run.checks_passed} check(s) failed"
        run.error_line = first_error_line(output)
    if run.status != "pass":
        run.output_tail = output[-3000:]
    return run


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
