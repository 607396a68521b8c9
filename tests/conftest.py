import os

import pytest

# Ranks started by the tests share two cores: one thread each, as torchrun gives them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import re  # noqa: E402

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
