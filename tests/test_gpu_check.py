"""`./course gpu-check` on CPU: its plan (worlds, expected outcomes, phases, skips), the runs it
launches (environment, caps that kill every rank, how an outcome is judged), its report, and the
filler that writes a report into the lessons' "on a GPU" blocks."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tools import gpu_check, gpu_lessons

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)  # bounds, not budgets: the machine is shared


def rows(runs, script, world=None):
    return [r for r in runs if r.script == script and (world is None or r.world == world)]


def flag(run, name):
    return run.command[run.command.index(name) + 1]


def test_tables_name_real_scripts():
    ids = {gpu_check.script_id(p) for p in gpu_check.chapter_scripts()}
    for table in (gpu_check.GLOO_ON_CUDA, gpu_check.NEEDS, gpu_check.SYSTEM, gpu_check.EXPECTED,
                  gpu_check.TIMING):
        assert set(table) <= ids, set(table) - ids


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    return {g: gpu_check.plan(g, out_root=out, cores=16, jobs=8) for g in (1, 8)}


@pytest.mark.parametrize("gpus", [1, 8])
def test_plan_worlds_and_commands(plans, gpus):
    runs = plans[gpus]
    scripts = {gpu_check.script_id(p) for p in gpu_check.chapter_scripts()}
    assert {r.script for r in runs if r.world == 1} == scripts  # everyone gets a world-1 row
    for r in runs:
        assert r.status in ("planned", "n/a", "skipped"), r
        if r.status != "planned":
            assert r.reason and not r.command, r
            continue
        assert flag(r, "--device") == "cuda" and flag(r, "--backend") == r.backend
        if "torch.distributed.run" in r.command:
            assert f"--nproc_per_node={r.world}" in r.command, r.command
        elif "--nprocs" in r.command:  # a script that starts its own ranks: its world is --nprocs
            assert int(flag(r, "--nprocs")) == r.world, r.command
        else:  # one process by design
            assert r.world == 1, r.command
    if gpus == 1:  # NCCL cannot put two ranks on one GPU: only gloo-capable scripts share it
        two = [r for r in runs if r.world == 2]
        assert all(r.backend == "gloo" for r in two) and {r.world for r in runs} == {1, 2}
        assert {r.script for r in two if r.status == "planned"} <= gpu_check.GLOO_ON_CUDA
        na = [r for r in two if r.status == "n/a"]
        assert any("not run over gloo" in r.reason for r in na)
    else:
        assert {r.world for r in runs} == {1, 2, 8} and all(r.backend == "nccl" for r in runs)


def test_spawn_at_world_one_starts_one_process(plans):
    """spawn.py's own default is 2 processes: a world-1 row must say --nprocs 1 (NCCL refuses two
    ranks on one GPU)."""
    (w1,) = rows(plans[1], "ch02_single_node/spawn", 1)
    assert w1.status == "planned" and flag(w1, "--nprocs") == "1"
    assert "torch.distributed.run" not in w1.command  # it starts its own processes
    (w2,) = rows(plans[1], "ch02_single_node/spawn", 2)
    assert flag(w2, "--nprocs") == "2" and w2.backend == "gloo"


def test_expected_outcomes(plans):
    """hang.py fails by design: exit 1 and its message; it cannot run at world 1 (no peer)."""
    for runs in plans.values():
        hang = rows(runs, "ch13_fault_tolerance/hang")
        (w1,) = [r for r in hang if r.world == 1]
        assert w1.status == "n/a" and "needs at least 2 ranks" in w1.reason
        planned = [r for r in hang if r.status == "planned"]
        assert planned and all(r.expect_exit == 1 for r in planned)
        message = "error: rank 1 stopped responding: all_reduce timed out after 5.0 s (checks passed)"
        assert all(re.search(r.expect_message, message) for r in planned)
        assert not re.search(planned[0].expect_message, message.replace("passed", "FAILED"))
        # the message is hang.py's own
        source = (REPO / "chapters/ch13_fault_tolerance/hang.py").read_text()
        assert "stopped responding: all_reduce timed out " in source
        others = [r for r in runs if r.status == "planned" and r.script != "ch13_fault_tolerance/hang"]
        assert all(r.expect_exit == 0 and not r.expect_message for r in others)


def test_one_gpu_refusals_are_the_planned_machines(plans):
    """Scripts refuse by what torch sees: the plan shows what the planned machine would see."""
    (dp1,) = rows(plans[1], "ch02_single_node/dataparallel", 1)
    assert dp1.status == "n/a" and "torch sees 1" in dp1.reason
    (dp8,) = rows(plans[8], "ch02_single_node/dataparallel", 1)
    assert dp8.status == "planned"


def test_phases_caps_and_threads(plans):
    runs = plans[1]
    timing = [r for r in runs if r.phase == "timing"]
    assert sorted(r.script for r in timing) == sorted(gpu_check.TIMING)
    for r in timing:
        extra, figures, cap = gpu_check.TIMING[r.script]
        assert r.world == 1 and r.cap_s == cap > 0 and r.threads == 16
        assert all(a in r.command for a in extra) and r.gpu_figures == figures
    # chapter 25's timing run is at its GPU preset; its default run stays a correctness run
    ch25 = rows(runs, "ch25_llm/train", 1)
    assert sorted(r.phase for r in ch25) == ["correctness", "timing"]
    assert len({flag(r, "--out") for r in ch25}) == 2
    correct = [r for r in runs if r.status == "planned" and r.phase == "correctness"]
    assert {(r.world, r.threads) for r in correct} == {(1, 2), (2, 1)}  # 16 cores, 8 at once
    # every planned run writes its own folder
    outs = [flag(r, "--out") for r in runs if r.command]
    assert len(outs) == len(set(outs))
    notes = {r.script: r.note for r in timing if r.note}
    assert set(notes) == {"ch07_communication/train", "ch08_overlap/train"}  # what world 1 means
    # on 8 GPUs the timing runs use all of them (busbw is 0 by definition at world 1)
    eight = [r for r in plans[8] if r.phase == "timing"]
    assert sorted(r.script for r in eight) == sorted(gpu_check.TIMING)
    assert all(r.world == 8 and r.backend == "nccl" and r.threads == 2 and not r.note for r in eight)


def test_estimate_adds_start_up_and_fills_slots():
    def run(est, phase="correctness", cap=0.0):
        return gpu_check.Run("ch01_overview/train", 1, "nccl", command=["x"], estimate_s=est,
                             phase=phase, cap_s=cap)

    runs = [run(10), run(10), run(20), run(5, "timing", 40), run(90, "timing", 60)]
    est = gpu_check.estimate(runs, jobs=2)
    assert est["correctness_s"] == 20 and est["timing_s"] == 5 + 60 and est["total_s"] == 85
    assert est["timing_cap_s"] == 100
    planned = gpu_check.plan(1, only=["ch01"], cores=16, jobs=8)
    costs = gpu_check.load_costs()
    (w2,) = rows(planned, "ch01_overview/train", 2)
    cpu = costs.get("ch01_overview/train w2", gpu_check.UNMEASURED_S * 2)
    assert w2.estimate_s == pytest.approx(cpu / 2 + gpu_check.CUDA_START_S, abs=0.051)


def test_costs_table_covers_the_lent_plan(plans):
    """Every run the lent machine would start has a measured cost, except those marked."""
    costs = gpu_check.load_costs()
    lent = gpu_check.plan(1, cores=16, jobs=8, absent=gpu_check.LENT_ABSENT)
    missing = [f"{r.script} w{r.world}" for r in lent if r.status == "planned" and r.phase ==
               "correctness" and f"{r.script} w{r.world}" not in costs]
    assert not missing, missing


def test_missing_package_is_skipped_before_launch(monkeypatch, tmp_path):
    monkeypatch.setitem(gpu_check.NEEDS, "ch03_data_parallel/train", ["no_such_package_xyz"])
    runs = gpu_check.plan(1, only=["ch03"], out_root=tmp_path, cores=16, jobs=8)
    assert runs and all(r.status == "skipped" and not r.command for r in runs)
    assert all("needs no_such_package_xyz (not installed)" == r.reason for r in runs)
    # a module-level import is found through the course's own modules
    script = tmp_path / "s.py"
    script.write_text("import json\nimport torch\nfrom common.config import parse_config\n"
                      "try:\n    import optional_thing\nexcept ImportError:\n    pass\n"
                      "def f():\n    import lazy_thing\n")
    assert gpu_check.imported_packages(script) == {"torch"}
    other = tmp_path / "t.py"
    other.write_text("import no_such_package_xyz.sub\n")
    assert gpu_check.imported_packages(other) == {"no_such_package_xyz"}
    # a dry run for the lent machine from here: what it lacks is skipped, saying so
    lent = gpu_check.plan(1, only=["ch21"], out_root=tmp_path, cores=16, jobs=8,
                          absent=gpu_check.LENT_ABSENT)
    (tune,) = rows(lent, "ch21_hyperparameters/tune", 1)
    assert tune.status == "skipped" and tune.reason == "needs ray (not on the lent machine)"


def test_run_environment_keeps_pythonpath(tmp_path):
    env = gpu_check.run_env(3, {"PYTHONPATH": f"/wheels{os.pathsep}{REPO}{os.pathsep}/more", "X": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/wheels", "/more"]
    assert env["OMP_NUM_THREADS"] == "3" and env["X"] == "1"
    assert gpu_check.run_env(1, {})["PYTHONPATH"] == str(REPO)


def fake_script(tmp_path, body: str) -> Path:
    path = tmp_path / "fake.py"
    path.write_text(textwrap.dedent("""\
        import json, os, sys, pathlib
        out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1]); out.mkdir(parents=True)
        def summary(ok=True, **figures):
            checks = [{"name": "a", "kind": "exact", "ok": ok}, {"name": "t", "kind": "timing", "ok": False}]
            figs = {k: {"measured": v, "expected": None, "unit": "s"} for k, v in figures.items()}
            (out / "summary.json").write_text(json.dumps({"checks": checks, "figures": figs}))
        """) + textwrap.dedent(body))
    return path


def fake_run(tmp_path, body, name="out", **kw) -> gpu_check.Run:
    script = fake_script(tmp_path, body)
    return gpu_check.Run("ch01_overview/train", 1, "nccl", command=[
        sys.executable, str(script), "--out", str(tmp_path / name)], **kw)


def test_the_run_sees_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/carried/wheels")
    run = fake_run(tmp_path, """\
        summary(pythonpath=os.environ["PYTHONPATH"], omp=os.environ["OMP_NUM_THREADS"])
        """, threads=4)
    gpu_check.execute(run, timeout=30)
    assert run.status == "pass", run.output_tail
    assert run.figures["pythonpath"]["measured"] == f"{REPO}{os.pathsep}/carried/wheels"
    assert run.figures["omp"]["measured"] == "4"
    assert (run.checks_passed, run.checks_total, run.timing_ok, run.timing_total) == (1, 1, 0, 1)


def test_outcomes_are_judged_by_what_the_row_expects(tmp_path):
    hang = dict(expect_exit=1, expect_message=gpu_check.EXPECTED["ch13_fault_tolerance/hang"][1])
    designed = """\
        summary()
        sys.exit("error: rank 1 stopped responding: all_reduce timed out after 5.2 s (checks passed)")
        """
    run = gpu_check.execute(fake_run(tmp_path, designed, "a", **hang), timeout=30)
    assert run.status == "pass", run.output_tail
    run = gpu_check.execute(fake_run(tmp_path, "summary()\n", "b", **hang), timeout=30)
    assert run.status == "FAIL" and run.reason == "exit 0 (expected 1)"
    run = gpu_check.execute(fake_run(tmp_path, "summary()\nsys.exit('error: other')\n", "c", **hang),
                            timeout=30)
    assert run.status == "FAIL" and "without its designed message" in run.reason
    run = gpu_check.execute(fake_run(tmp_path, designed, "d"), timeout=30)  # an ordinary row
    assert run.status == "FAIL" and run.reason == "exit 1"
    assert run.error_line.startswith("error: rank 1 stopped responding")
    run = gpu_check.execute(fake_run(tmp_path, "summary(ok=False)\n", "e"), timeout=30)
    assert run.status == "FAIL" and run.reason == "exit 0, 1 check(s) failed"
    crash = "print('step 1 ok')\nraise ValueError('bad shape (3, 4)')\n"
    run = gpu_check.execute(fake_run(tmp_path, crash, "f"), timeout=30)
    assert run.status == "FAIL" and run.error_line == "ValueError: bad shape (3, 4)"
    run = gpu_check.execute(fake_run(tmp_path, "import no_such_package_xyz\n", "g"), timeout=30)
    assert run.status == "skipped" and run.reason == "needs no_such_package_xyz (not installed)"


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child not yet reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.timeout(30)
def test_a_run_past_its_cap_is_killed_with_every_rank(tmp_path):
    """Like torchrun: the parent starts a child in a session of its own (so killing the parent's
    process group alone would leave it) and both sleep. At the cap both must be gone."""
    pids = tmp_path / "pids"
    run = fake_run(tmp_path, f"""\
        import subprocess, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 start_new_session=True)
        pathlib.Path({str(pids)!r}).write_text(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(120)
        """)
    start = time.monotonic()
    gpu_check.execute(run, timeout=4)
    assert time.monotonic() - start < 15
    assert run.status == "FAIL" and run.reason == "timed out after 4 s: killed with its ranks"
    parent, child = map(int, pids.read_text().split())
    deadline = time.monotonic() + 5
    while (alive(parent) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(parent) and not alive(child)


def sample_runs():
    R = gpu_check.Run
    return [
        R("ch03_data_parallel/train", 1, "nccl", status="pass", checks_passed=4, checks_total=4,
          seconds=9.5),
        R("ch03_data_parallel/train", 2, "gloo", status="FAIL", reason="exit 1",
          error_line="RuntimeError: Duplicate GPU detected", seconds=3.0),
        R("ch07_communication/train", 1, "nccl", status="pass", phase="timing", gpu_figures="busbw",
          figures={"all-reduce busbw at 64 MiB, torch": {"measured": 351.2, "unit": "GB/s"},
                   "ring steps": {"measured": 7, "unit": ""}}, seconds=20.0),
        R("ch21_hyperparameters/tune", 1, "nccl", status="skipped", reason="needs ray (not installed)"),
        R("ch04_model_parallel/train", 1, "nccl", status="n/a", reason="refused at world 1: needs 2"),
    ]


MACHINE = {"torch": "2.11.0", "python": "3.12.1", "interpreter": "python3", "gpus": 1,
           "gpu": "NVIDIA H200", "cuda": "12.8", "nccl": "2.27.3"}


def test_report_format(tmp_path):
    path = gpu_check.write_report(sample_runs(), tmp_path, 210.0, mach=MACHINE,
                                  estimate_s={"total_s": 250})
    text = path.read_text()
    assert text.startswith("# GPU check: NVIDIA H200 x 1, torch 2.11.0, CUDA 12.8, NCCL 2.27.3")
    assert "5 runs in 210 s: 2 pass, 1 FAIL, 1 n/a, 1 skipped" in text
    assert "chapters: 1 passed, 1 failed, 2 skipped" in text
    assert ("| ch03_data_parallel | failed | train w2 gloo: exit 1: RuntimeError: Duplicate GPU "
            "detected |") in text
    assert "| ch21_hyperparameters | skipped | tune: needs ray (not installed) |" in text
    assert "| ch07_communication | passed |  |" in text
    # GPU figures: the timing run's figures that its pattern names, no others
    assert "| ch07_communication | train | all-reduce busbw at 64 MiB, torch | 351.2 GB/s | pass |" in text
    assert "ring steps" not in text.split("## What this machine")[0]
    for what, _ in gpu_check.ONE_GPU_CANNOT_TEST:
        assert f"- **{what}**: " in text
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["machine"] == MACHINE and len(data["runs"]) == 5 and data["estimate"]["total_s"] == 250
    assert data["chapters"]["ch03_data_parallel"]["status"] == "failed"
    assert list(data["chapters"]["ch07_communication"]["figures"]) == ["all-reduce busbw at 64 MiB, torch"]
    assert [c["what"] for c in data["cannot_test"]][:5] == [w for w, _ in gpu_check.ONE_GPU_CANNOT_TEST]
    eight = gpu_check.write_report(sample_runs(), tmp_path / "8", 1.0, mach={**MACHINE, "gpus": 8})
    assert "P2P ordering" not in eight.read_text() and "more than one node" in eight.read_text()


LESSON = """# Chapter 3

Some prose.

{block}
## How the code works

More prose, and an unrelated comment <!-- keep -->.
"""


def test_fill_lessons_round_trip(tmp_path):
    report = json.loads(gpu_check.write_report(sample_runs(), tmp_path / "r", 1.0, mach=MACHINE)
                        .with_suffix(".json").read_text())
    empty = LESSON.format(block="")
    with_block = gpu_lessons.add_block(empty)
    assert gpu_lessons.add_block(with_block) == with_block
    assert gpu_lessons.NOT_MEASURED in with_block
    for name in ("ch03_data_parallel", "ch07_communication", "ch30_frontier"):
        folder = tmp_path / "chapters" / name
        folder.mkdir(parents=True)
        (folder / "README.md").write_text(with_block)
        (folder / "README.zh.md").write_text(with_block.replace("Some prose.", "一些文字。"))
    (tmp_path / "chapters" / "ch01_overview").mkdir()
    (tmp_path / "chapters" / "ch01_overview" / "README.md").write_text(empty)  # no block: left alone
    changed = gpu_lessons.fill_lessons(report, tmp_path)
    names = sorted(str(p.relative_to(tmp_path)) for p in changed)
    assert names == [f"chapters/{c}/README{s}.md" for c in ("ch03_data_parallel", "ch07_communication")
                     for s in ("", ".zh")]
    ch07 = (tmp_path / "chapters/ch07_communication/README.md").read_text()
    before, rest = with_block.split(gpu_lessons.BEGIN)
    after = rest.split(gpu_lessons.END)[1]
    assert ch07.startswith(before + gpu_lessons.BEGIN) and ch07.endswith(gpu_lessons.END + after)
    inner = ch07.split(gpu_lessons.BEGIN)[1].split(gpu_lessons.END)[0]
    assert "NVIDIA H200 x 1, torch 2.11.0" in inner and "passed" in inner
    assert "| all-reduce busbw at 64 MiB, torch (train, world 1) | 351.2 GB/s | pass |" in inner
    assert "not yet measured" not in inner and "P2P ordering" in inner
    ch03 = (tmp_path / "chapters/ch03_data_parallel/README.md").read_text()
    assert "failed: train w2 gloo: exit 1: RuntimeError: Duplicate GPU detected" in ch03
    assert (tmp_path / "chapters/ch30_frontier/README.md").read_text() == with_block  # not in report
    assert (tmp_path / "chapters/ch01_overview/README.md").read_text() == empty
    assert "一些文字。" in (tmp_path / "chapters/ch07_communication/README.zh.md").read_text()
    snapshot = {p: p.read_text() for p in (tmp_path / "chapters").rglob("*.md")}
    assert gpu_lessons.fill_lessons(report, tmp_path) == []  # idempotent
    assert {p: p.read_text() for p in snapshot} == snapshot
    with pytest.raises(ValueError):
        gpu_lessons.replace_block(with_block + with_block, "x\n")


def test_every_lesson_says_its_gpu_figures_are_not_yet_measured():
    """One block per lesson, saying so until a report fills it."""
    lessons = gpu_lessons.lessons()
    assert len({p.parent for p in lessons}) == 30
    for path in lessons:
        text = path.read_text()
        n = text.count(gpu_lessons.BEGIN)
        assert n == 1 and text.count(gpu_lessons.END) == 1, path
        inner = text.split(gpu_lessons.BEGIN)[1].split(gpu_lessons.END)[0]
        said = ("尚未测量", "**GPU 上**（") if path.name == "README.zh.md" else ("not yet measured", "**On a GPU** (")
        assert inner.strip() and any(s in inner for s in said), path


def test_dry_run_prints_the_plan(capsys):
    assert gpu_check.main(["--dry-run", "--gpus", "1", "--cores", "16", "--only", "ch02", "ch13"]) == 0
    out = capsys.readouterr().out
    assert "plan for 1 GPU(s):" in out
    spawn1 = [line for line in out.splitlines() if "ch02_single_node/spawn" in line and " w1 " in line]
    assert len(spawn1) == 1 and spawn1[0].rstrip().endswith("--nprocs 1")
    hang2 = [line for line in out.splitlines() if "ch13_fault_tolerance/hang" in line and " w2 " in line]
    assert len(hang2) == 1 and "expect exit 1 and /error: rank 1 stopped responding" in hang2[0]
    assert re.search(r"estimate: correctness \d+ s \(\d+ runs, 8 at once\), then timing 0 s", out)
    assert f"+ {gpu_check.CUDA_START_S:.0f} s CUDA start-up" in out
    assert "one GPU cannot test: NCCL with more than one rank; P2P ordering" in out


@pytest.mark.timeout(120)
def test_execute_reads_a_real_run(plans, tmp_path):
    """The plan's own world-1 row of spawn.py, run on CPU (gloo) through the same reader the GPU
    check uses: one process, its checks read from its summary."""
    (row,) = rows(plans[1], "ch02_single_node/spawn", 1)
    command = list(row.command)
    command[command.index("--device") + 1], command[command.index("--backend") + 1] = "cpu", "gloo"
    out = tmp_path / "spawn"
    command[command.index("--out") + 1] = str(out)
    run = gpu_check.execute(gpu_check.Run(row.script, 1, "gloo", command=command), timeout=100)
    summary = json.loads((out / "summary.json").read_text())
    assert run.status == "pass", run.output_tail
    assert summary["world_size"] == 1
    fatal = [c for c in summary["checks"] if c["kind"] != "timing"]
    assert (run.checks_passed, run.checks_total) == (len(fatal), len(fatal)) and run.checks_total > 0
    assert run.figures == summary["figures"] and run.seconds > 0


def test_timing_runs_go_alone_after_the_correctness_runs(monkeypatch, tmp_path):
    """main: correctness runs overlap (several at once), each timing run has the machine to itself
    and starts only when every correctness run has ended."""
    import threading

    spans, lock = [], threading.Lock()

    def fake_execute(run, timeout=None):
        start = time.monotonic()
        time.sleep(0.3)
        with lock:
            spans.append((run.phase, start, time.monotonic(), run.cap_s))
        run.status = "pass"
        return run

    monkeypatch.setattr(gpu_check, "execute", fake_execute)
    code = gpu_check.main(["--gpus", "1", "--cores", "16", "--jobs", "4", "--timeout", "50",
                           "--only", "ch03", "ch07", "ch08", "--out", str(tmp_path)])
    assert code == 0 and (tmp_path / "report.md").exists()
    correct = [s for s in spans if s[0] == "correctness"]
    timing = sorted((s for s in spans if s[0] == "timing"), key=lambda s: s[1])
    assert len(correct) >= 4 and [s[3] for s in correct] == [50.0] * len(correct)
    assert len(timing) == 2 and {s[3] for s in timing} == {gpu_check.TIMING["ch07_communication/train"][2]}
    first = sorted(correct, key=lambda s: s[1])[:4]
    assert max(s[1] for s in first) < min(s[2] for s in first)  # 4 at once
    assert min(s[1] for s in timing) >= max(s[2] for s in correct)
    assert timing[1][1] >= timing[0][2]  # one at a time


def test_first_error_line_is_the_cause_not_the_launchers_summary():
    output = "\n".join([
        "step 1 loss 2.3", "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "train.py", line 9, in <module>',
        "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered",
        "E1202 10:00:00 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: 1)",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "train.py FAILED",
        "  exitcode  : 1 (pid: 123)"])
    assert gpu_check.first_error_line(output) == (
        "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert gpu_check.first_error_line("all fine\nbut exit 3\n") == "but exit 3"


def test_fill_lessons_writes_chinese_and_keeps_current_stamps_current(tmp_path):
    """A Chinese lesson gets the block in Chinese with the same figures; the stamp of its section
    follows the English section's new text when it was current, and a stale stamp stays stale."""
    from tools.bilingual_text import sections, stamp_of

    report = json.loads(gpu_check.write_report(sample_runs(), tmp_path / "r", 1.0, mach=MACHINE)
                        .with_suffix(".json").read_text())
    english = gpu_lessons.add_block(LESSON.format(block=""))
    stamps = [stamp_of("\n".join(s.lines)) for s in sections(english)]
    chinese = (f"# 第 3 章\n<!-- en: {stamps[1]} -->\n\n一些文字。\n\n{gpu_lessons.BEGIN}\n尚未测量。\n"
               f"{gpu_lessons.END}\n## 代码解读\n<!-- en: 0000000000 -->\n\n更多文字。\n")
    for name in ("ch07_communication", "ch03_data_parallel"):
        folder = tmp_path / "chapters" / name
        folder.mkdir(parents=True)
        (folder / "README.md").write_text(english)
        (folder / "README.zh.md").write_text(chinese)
    gpu_lessons.fill_lessons(report, tmp_path)
    en = (tmp_path / "chapters/ch07_communication/README.md").read_text()
    zh = (tmp_path / "chapters/ch07_communication/README.zh.md").read_text()
    inner = zh.split(gpu_lessons.BEGIN)[1].split(gpu_lessons.END)[0]
    assert inner.lstrip("\n").startswith("**GPU 上**（NVIDIA H200 x 1") and "On a GPU" not in inner
    assert "| 351.2 GB/s | pass |" in inner and "单节点上 1 张 GPU 测不了的：" in inner
    new = [stamp_of("\n".join(s.lines)) for s in sections(en)]
    assert new[1] != stamps[1] and f"<!-- en: {new[1]} -->" in zh  # current before: follows
    assert "<!-- en: 0000000000 -->" in zh  # stale before: still stale
