import os

import pytest

# Ranks started by the tests share two cores: one thread each, as torchrun gives them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import re  # noqa: E402
from collections import defaultdict  # noqa: E402

# DESIGN.md's budget: one chapter's tests and notebook in <= 60 s on a 2-core machine, <= 120 s
# where DeepSpeed, Ray, TRL, transformers, Slurm or network namespaces are involved.
BUDGET_S, HEAVY_BUDGET_S = 60, 120
HEAVY = {"06": "DeepSpeed", "12": "DeepSpeed", "18": "DeepSpeed", "19": "DeepSpeed", "21": "Ray",
         "22": "network namespaces", "23": "Slurm", "25": "transformers", "27": "TRL",
         "28": "transformers"}
# issue 20's exception: chapter 21's Tune trials are 2-worker Ray Train runs, 180 s
OWN_BUDGET_S = {"21": 180}
_chapter_seconds: dict[str, float] = defaultdict(float)


def pytest_configure(config):
    """Every successful chapter launch of this session is recorded (common.launch), so that a
    notebook executed later that launches exactly the same run reuses it (tests/test_notebooks.py)."""
    import tempfile

    if "COURSE_RUN_RECORD" not in os.environ:
        config._course_runs = tempfile.TemporaryDirectory(prefix="course-runs-")
        os.environ["COURSE_RUN_RECORD"] = config._course_runs.name
    config._course_op = _operator_state()


def _operator_state() -> int | None:
    """When DeepSpeed's CPU operator was last built (its .so's mtime), None if not built: a build
    during the tests (a minute or more) lands in whichever chapter first started DeepSpeed."""
    from common.log import extension_folder

    so = extension_folder("deepspeed_shm_comm") / "deepspeed_shm_comm.so"
    return so.stat().st_mtime_ns if so.is_file() else None


def _replays(folder: str | None) -> tuple[int, int]:
    """(runs this session recorded, how many of them a notebook was handed: common.launch)."""
    from pathlib import Path

    runs = [p for p in Path(folder).iterdir() if p.is_dir()] if folder and Path(folder).is_dir() else []
    return len(runs), sum((p / "replayed_into.txt").is_file() for p in runs)


def pytest_unconfigure(config):
    runs = getattr(config, "_course_runs", None)
    if runs is not None:
        os.environ.pop("COURSE_RUN_RECORD", None)
        runs.cleanup()


def pytest_runtest_logreport(report):
    """Add every phase of every test whose id names a chapter (its own module, its notebook, its
    structure and config checks) to that chapter's time."""
    found = re.search(r"ch(\d\d)_", report.nodeid)
    if found:
        _chapter_seconds[found.group(1)] += report.duration


def pytest_terminal_summary(terminalreporter, config):
    """Each chapter's time beside its budget, at the end of every run (reported, never failed:
    shared machines are noisy); whether DeepSpeed's operator was built during the run; how many
    recorded runs the notebooks reused."""
    if not _chapter_seconds:
        return
    write = terminalreporter.write_line
    if _operator_state() != getattr(config, "_course_op", None):
        write("DeepSpeed's CPU operator was built during these tests (its minute or more counts in "
              "the chapter that first started DeepSpeed): `./course setup` builds it ahead")
    recorded, replayed = _replays(os.environ.get("COURSE_RUN_RECORD"))
    if recorded:
        write(f"chapter runs recorded by the tests: {recorded}, of which notebooks reused {replayed}")
    write(f"chapter time, tests + notebook (budget {BUDGET_S} s; {HEAVY_BUDGET_S} s with "
          "DeepSpeed, Ray, TRL, transformers, Slurm, namespaces; "
          + ", ".join(f"ch{c} {s} s" for c, s in OWN_BUDGET_S.items()) + "):")
    for chapter, seconds in sorted(_chapter_seconds.items()):
        budget = OWN_BUDGET_S.get(chapter, HEAVY_BUDGET_S if chapter in HEAVY else BUDGET_S)
        over = f"  over its {budget} s" + (f" ({HEAVY[chapter]})" if chapter in HEAVY else "")
        write(f"  ch{chapter} {seconds:6.1f} s{over if seconds > budget else ''}")
    write(f"  total {sum(_chapter_seconds.values()):.0f} s in chapters")


@pytest.fixture(autouse=True)
def _torch_default_dtype_restored():
    """A test that sets torch's default dtype (chapter 28's float64 references) sets it for the
    rest of the pytest process: a later test's model would then be initialised differently from
    its spawned ranks' (it happened: ch30's FedAvg reference after ch28). Restore it after each test."""
    import torch

    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)

# What a library prints when it is left on the console (DESIGN.md, "Running a chapter"): a
# Python warning, a C++ log line ("[W1130 ...", "[rank0]:[E1130 ..."), a dumped JSON object, a
# traceback, torchrun's OMP_NUM_THREADS banner, DeepSpeed's "[2026-11-30 16:32:48,172] [WARNING]".
LIBRARY_NOISE = re.compile(r"Warning|warnings\.warn|^\[[WIE]\d|^\[rank\d+\]:\[?[WIE]\d|^[WIE]\d{4} "
                           r"|^\s*\{|Traceback|OMP_NUM_THREADS|^\*{10,}|^\[\d{4}-\d\d-\d\d ")
CONSOLE_WIDTH = 100


def assert_quiet_console(res, routed: tuple[str, ...] = ()) -> None:
    """The run's console (a `LaunchResult`) holds only the course's own lines, each within 100
    columns; the library log is named on the console exactly when rank 0's holds something, and
    it holds each text in `routed` (what the run is known to make the libraries say: the test
    fails if that was dropped instead of routed)."""
    lines = res.output.splitlines()
    long = [f"[{len(line)}] {line}" for line in lines if len(line) > CONSOLE_WIDTH]
    noise = [line for line in lines if LIBRARY_NOISE.search(line)]
    assert not long, "console lines over 100 columns:\n" + "\n".join(long)
    assert not noise, "library noise on the console:\n" + "\n".join(noise[:20])
    path = res.out_dir / "library.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    named = [lines[i + 1].strip() for i, line in enumerate(lines[:-1])
             if line.startswith("library warnings and logs")]  # the path is on the next line
    if text:
        from common.launch import REPO_ROOT  # launches run there: a relative path is from there

        assert len(named) == 1, f"the library log should be named once on the console: {named}"
        assert (REPO_ROOT / named[0]).resolve() == path.resolve(), (named, path)
    else:
        assert not named, f"a library log is named but {path} is empty or missing: {named}"
    for want in routed:
        assert want in text, f"{want!r} is not in {path} (dropped instead of routed?)"


@pytest.fixture
def quiet_console():
    """`assert_quiet_console`, for chapter tests to apply to the launches they already make."""
    return assert_quiet_console


def require_system(*commands: str, probe=None) -> None:
    """Skip the calling test, with the reason, unless it may use this machine's system: the
    tests that need root and system packages (Slurm, network namespaces, `tc`, a browser) run
    when `COURSE_SYSTEM_TESTS=1` (`.ci/run` sets it after `./course setup --system`), the
    process is root, every one of `commands` is on PATH, and `probe()` (a capability check that
    returns None when it works, else the reason) succeeds. DESIGN.md, "Tests"."""
    import shutil

    if os.environ.get("COURSE_SYSTEM_TESTS") != "1":
        pytest.skip("system test: set COURSE_SYSTEM_TESTS=1 after ./course setup --system (as root)")
    if os.geteuid() != 0:
        pytest.skip("system test: needs root")
    missing = [c for c in commands if shutil.which(c) is None]
    if missing:
        pytest.skip(f"system test: {', '.join(missing)} not installed (./course setup --system)")
    if probe is not None:
        reason = probe()
        if reason:
            pytest.skip(f"system test: {reason}")
