"""The console rule (DESIGN.md, "Running a chapter"): the console holds the course's own lines;
library warnings, log records and C++/subprocess output go to `<out>/library.log`, named once.

The facility is proven here in one plain process (cheap: `common.log` imports only the standard
library); chapter runs are checked where their tests already launch them (`quiet_console` in
conftest.py: ch03 plain DDP, ch06 DeepSpeed, ch14 with TensorBoard, ch16 FSDP2)."""

import subprocess
import sys
import textwrap

import pytest
from conftest import LIBRARY_NOISE, assert_quiet_console

from common.config import build_parser
from common.launch import REPO_ROOT, LaunchResult

# A stand-in for a run: the course speaks, and so do a library's warning, a library's logger
# with its own console handler (as DeepSpeed's and torch's have), and C++ writing to fd 1 and 2.
RUN = textwrap.dedent("""
    import logging, os, sys, warnings
    from common.log import library_log, library_output, log, name_library_log, setup_logging

    setup_logging(0, 1)
    if sys.argv[2] == "route":
        library_log(sys.argv[1], rank=0)
    noisy = logging.getLogger("somelib")
    noisy.addHandler(logging.StreamHandler(sys.stderr))
    noisy.propagate = False
    log.info("course line 1")
    if sys.argv[3] == "noise":
        warnings.warn("somelib: this API is deprecated", FutureWarning)
        with library_output():
            log.info("course line 2 (inside the block)")
            os.write(1, b"[W1130 12:00:00] c++ says hello on fd 1\\n")
            os.write(2, b"ninja: building the operator on fd 2\\n")
            print("{\\"a\\": 1}", flush=True)
            logging.getLogger("lateimport").addHandler(logging.StreamHandler(sys.stdout))
        noisy.warning("somelib warning record")
        logging.getLogger("lateimport").warning("record of a logger made inside the block")
    else:
        with library_output():
            log.info("course line 2 (inside the block)")
    log.info("course line 3")
    name_library_log()
""")


def run(tmp_path, route: bool, noise: bool) -> LaunchResult:
    proc = subprocess.run([sys.executable, "-c", RUN, str(tmp_path), "route" if route else "off",
                           "noise" if noise else "quiet"], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return LaunchResult(proc.returncode, proc.stdout + proc.stderr, tmp_path, None)


@pytest.mark.timeout(60)
def test_library_messages_go_to_the_named_log_and_the_course_stays_on_the_console(tmp_path):
    res = run(tmp_path, route=True, noise=True)
    lines = res.output.splitlines()
    assert lines[:3] == ["course line 1", "course line 2 (inside the block)", "course line 3"]
    assert lines[3] == "library warnings and logs:" and len(lines) == 5
    assert lines[4] == f"  {tmp_path / 'library.log'}"
    text = (tmp_path / "library.log").read_text()
    for said in ("FutureWarning: somelib: this API is deprecated", "c++ says hello on fd 1",
                 "ninja: building the operator on fd 2", '{"a": 1}', "somelib warning record",
                 "record of a logger made inside the block"):
        assert said in text, said
    assert "course line" not in text
    assert_quiet_console(res, routed=("somelib: this API is deprecated", "ninja: building"))


@pytest.mark.timeout(60)
def test_without_routing_the_same_run_fails_the_console_check(tmp_path):
    """The negative control: the same noise, not routed, is caught by the console check."""
    res = run(tmp_path, route=False, noise=True)
    assert sum(bool(LIBRARY_NOISE.search(line)) for line in res.output.splitlines()) >= 3
    with pytest.raises(AssertionError, match="library noise on the console"):
        assert_quiet_console(res)
    assert not (tmp_path / "library.log").exists()


@pytest.mark.timeout(60)
def test_a_quiet_run_names_no_log_and_leaves_no_file(tmp_path):
    res = run(tmp_path, route=True, noise=False)
    assert res.output.splitlines() == ["course line 1", "course line 2 (inside the block)",
                                       "course line 3"]
    assert not (tmp_path / "library.log").exists()
    assert_quiet_console(res)


def test_help_states_each_default_once():
    """--out documents its default in words; argparse's "(default: '')" must not follow it."""
    from common.config import RunConfig

    parser = build_parser(RunConfig)
    for action in parser._actions:
        if action.dest != "help":
            assert action.help.count("(default:") == 1, (action.dest, action.help)
    assert "runs/<chapter>/<script>/" in next(a.help for a in parser._actions if a.dest == "out")


def test_a_figure_that_a_check_repeats_is_printed_once(tmp_path, capsys):
    """One table per result: `figure(..., table=False)` keeps the figure in summary.json and out
    of the printed table, where its check already shows the same numbers."""
    import json

    from common.config import RunConfig
    from common.log import setup_logging
    from common.results import RunRecorder

    setup_logging(0, 1)
    rec = RunRecorder(RunConfig(out=str(tmp_path)), __file__)
    rec.figure("MFU (achieved / peak)", 0.4375, table=False)
    rec.figure("step time", 12.5, unit="ms")
    rec.check("MFU <= 1", "timing", 0.4375, 1.0, compare="<=")
    assert rec.finish() == 0
    out = capsys.readouterr().out
    assert out.count("0.4375") == 1 and "step time" in out and "MFU (achieved" not in out
    assert "MFU (achieved / peak)" in json.loads((tmp_path / "summary.json").read_text())["figures"]
