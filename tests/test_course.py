"""The front door, `./course`: a typo, `--help` or an unknown script is answered in one plain
process before any rank starts; two clones sharing one environment each run their own code; the
torch build is chosen for the machine, with one line when the choice could not be had; the lab
works on copies, so a learner's saved notebook never reaches the tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.name[2:4] for p in (REPO / "chapters").glob("ch[0-9][0-9]_*"))


def course(*args: str, root: Path = REPO, env: dict | None = None, timeout: float = 120):
    """`ROOT/course ARGS` with this interpreter as the course's Python (no setup step)."""
    env = {**os.environ, "COURSE_PYTHON": sys.executable, **(env or {})}
    start = time.perf_counter()
    done = subprocess.run([str(root / "course"), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    return done, time.perf_counter() - start


def functions(script: str, root: Path = REPO, env: dict | None = None):
    """Run bash `script` with the functions of ROOT/course defined (sourced, nothing dispatched)."""
    env = {**os.environ, "COURSE_FUNCTIONS_ONLY": "1", **(env or {})}
    return subprocess.run(["bash", "-c", f'source "{root}/course"; {script}'], capture_output=True,
                          text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)


def clone(tmp_path: Path, name: str = "clone_b") -> Path:
    """A second clone of this repository (its committed state)."""
    target = tmp_path / name
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(target)], check=True, timeout=120)
    return target


@pytest.mark.timeout(180)
def test_typo_help_and_unknown_names_are_answered_before_any_rank_starts():
    took = {}
    typo, took["typo"] = course("run", "03", "--bogus")
    assert typo.returncode == 2 and typo.stdout == ""
    assert typo.stderr.splitlines() == ["train.py: error: unrecognized arguments: --bogus (see --help)"]

    helped, took["help"] = course("run", "3", "--help")
    assert helped.returncode == 0 and helped.stdout.count("usage: train.py") == 1  # once, not per rank
    assert "+ torchrun" not in helped.stderr and "--global-batch-size" in helped.stdout

    script, took["script"] = course("run", "03", "nosuchscript")
    assert script.returncode == 1 and len(script.stderr.splitlines()) == 1
    assert "has no script 'nosuchscript' (its scripts: train)" in script.stderr
    assert "(its scripts: dataparallel single spawn train)" in course("run", "02", "plots")[0].stderr

    unknown, took["unknown"] = course("run", "99")
    assert unknown.returncode == 1 and "the chapters are 01 to 30" in unknown.stderr
    assert len(unknown.stderr.splitlines()) == 1
    by_name, took["by name"] = course("run", "nosuch_slug")
    assert by_name.returncode == 1 and "no chapter 'nosuch_slug'" in by_name.stderr
    # Names are answered by the shell alone; options need the script's Config (one Python process,
    # importing torch). Through torchrun each took ~17 s and printed once per rank.
    print("answered in (s):", {k: round(v, 2) for k, v in took.items()})
    assert max(took["script"], took["unknown"], took["by name"]) < 5


@pytest.mark.timeout(300)
def test_two_clones_sharing_one_environment_each_run_their_own_code(tmp_path):
    """The environment's editable install points at one checkout (the one that installed it);
    a second clone started through its own ./course must still run its own code."""
    b = clone(tmp_path)
    with open(b / "common" / "__init__.py", "a") as f:
        f.write('\nimport os as _os, sys as _sys\n'
                'print("marker: clone B\'s common" + (" on rank " + _os.environ["RANK"]\n'
                '      if "RANK" in _os.environ else ""), file=_sys.stderr)\n')
    train = b / "chapters" / "ch01_overview" / "train.py"
    train.write_text(train.read_text().replace('"""', '"""Clone B\'s chapter 01. ', 1))

    helped, _ = course("run", "01", "--help", root=b)  # precheck: B's script and B's common
    assert "Clone B's chapter 01." in helped.stdout and "marker: clone B" in helped.stderr
    assert "Clone B" not in course("run", "01", "--help")[0].stdout

    ran, _ = course("run", "01", "--steps", "1", "--out", str(tmp_path / "run"), root=b,
                    env={"COURSE_NPROC": "1"}, timeout=180)  # torchrun's rank: B's common
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "marker: clone B's common on rank 0" in ran.stderr  # the rank's, not precheck's
    assert "runs the code of" not in ran.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["chapter"] == "ch01_overview"

    tested, _ = course("test", "-q", "-s", "-p", "no:cacheprovider", "tests/test_common.py",
                       "-k", "requires_documented_fields", root=b, timeout=180)
    assert tested.returncode == 0 and "marker: clone B" in tested.stdout + tested.stderr

    env_line, _ = course("env", root=b)
    assert f"checkout : {b}" in env_line.stdout

    # Started directly, without ./course, B's script imports the installed checkout's `common`
    # (if the environment has one): it says so in one line.
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    installed = subprocess.run([sys.executable, "-c", "import common; print(common.__file__)"],
                               capture_output=True, text=True, env=plain, cwd=tmp_path, timeout=60)
    if installed.returncode != 0:
        pytest.skip("this environment has no installed `common` (COURSE_PYTHON without the course)")
    other = Path(installed.stdout.strip()).parents[1]
    direct = subprocess.run([sys.executable, str(train), "--help"], capture_output=True, text=True,
                            env=plain, cwd=tmp_path, timeout=60)
    said = [line for line in direct.stderr.splitlines() if line.startswith("course:")]
    assert said == [f"course: train.py is in {b} but runs the code of {other} (installed there); "
                    f"start it with {b}/course run, or set PYTHONPATH={b}"]


@pytest.mark.timeout(120)
def test_torch_build_choice_and_its_fallback(tmp_path):
    choice = "has_nvidia_gpu() { false; }; torch_choice"
    if sys.platform.startswith("linux"):
        assert functions(choice).stdout.strip() == "cpu (Linux without an NVIDIA GPU)"
        gpu = "has_nvidia_gpu() { true; }; torch_choice"
        assert functions(gpu).stdout.strip() == "cuda (an NVIDIA GPU is present)"
    assert functions(choice, env={"COURSE_TORCH": "cuda"}).stdout.startswith("cuda")
    assert functions(choice, env={"COURSE_TORCH": "cpu"}).stdout.startswith("cpu")
    bad = functions(choice, env={"COURSE_TORCH": "gpu"})
    assert bad.returncode != 0 and "COURSE_TORCH must be auto, cpu or cuda" in bad.stderr

    fake = tmp_path / "bin"  # the probe sees an nvidia-smi on PATH
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (fake / "nvidia-smi").chmod(0o755)
    probe = functions("has_nvidia_gpu && echo yes", env={"PATH": f"{fake}:{os.environ['PATH']}"})
    assert probe.stdout.strip() == "yes"

    # The CPU index does not answer (as on machines without access to it): nothing is installed
    # from it, and the build actually present is reported in one line if it is not the CPU build.
    fallback = functions(f'PY="{sys.executable}"; VENV="{tmp_path}"; install_cpu_torch; '
                         'report_torch_build cpu',
                         env={"COURSE_TORCH_INDEX": "http://127.0.0.1:9/whl/cpu"})
    lines = fallback.stderr.splitlines()
    assert fallback.returncode == 0 and lines[0].endswith("could not be reached")
    if torch.version.cuda:
        assert lines[1:] == [f"course: using the pinned torch with CUDA {torch.version.cuda} (~6 GB; "
                             "it runs on CPU too): the CPU-only build was not available"]
    else:
        assert lines[1:] == []
    wanted_cuda = functions(f'PY="{sys.executable}"; report_torch_build cuda')
    assert wanted_cuda.stderr == ""

    from tools.precheck import pinned_torch, torch_note

    assert pinned_torch() == "2.14.1" and torch_note("2.14.1+cu130", "2.14.1") is None
    assert "torch 2.11.0 found, the course is pinned to 2.14.1" in torch_note("2.11.0+cu126", "2.14.1")


@pytest.mark.timeout(120)
def test_lab_works_on_copies_that_follow_the_course_unless_edited(tmp_path):
    b = clone(tmp_path)
    first = functions("prepare_lab", root=b)
    assert first.returncode == 0 and first.stderr == ""
    names = sorted(p.name for p in (b / "notebooks").glob("*.ipynb"))
    english = [n for n in names if not n.endswith(".zh.ipynb")]  # and the Chinese twins that exist
    assert sorted(p.name for p in (b / "lab").glob("*.ipynb")) == names and len(english) == len(CHAPTERS) == 30

    edited, untouched = b / "lab" / names[0], b / "lab" / names[1]
    nb = json.loads(edited.read_text())
    nb["cells"][0]["source"] = "my notes"
    edited.write_text(json.dumps(nb))
    for name in names[:2]:  # the course updates both notebooks
        path = b / "notebooks" / name
        nb = json.loads(path.read_text())
        nb["cells"].append({"cell_type": "markdown", "id": "new", "metadata": {}, "source": "new"})
        path.write_text(json.dumps(nb))
    second = functions("prepare_lab", root=b)
    assert json.loads(edited.read_text())["cells"][0]["source"] == "my notes"  # kept
    assert untouched.read_bytes() == (b / "notebooks" / names[1]).read_bytes()  # followed
    assert second.stderr.splitlines() == [
        f"course: lab/{names[0]} is your edited copy; the course's notebook changed since "
        f"(notebooks/{names[0]}). Rename yours to get the new one.",
        f"course: lab/{names[1]}: updated to the course's new version"]
    status = subprocess.run(["git", "status", "--porcelain", "--", "lab"], cwd=b,
                            capture_output=True, text=True, check=True)
    assert status.stdout == ""  # the copies are the learner's, outside git and the tests
    shutil.rmtree(b)


@pytest.mark.timeout(120)
def test_a_failed_run_ends_with_one_line_naming_the_first_failure(tmp_path):
    """`./course run` starts torchrun through tools/torchrun.py: when a rank fails, one line says
    which failed first and how, instead of torchrun's ChildFailedError traceback."""
    script = tmp_path / "fails.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "torchrun.py"), "--standalone",
                           "--nproc_per_node=2", str(script)], capture_output=True, text=True,
                          timeout=100, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 3
    assert done.stderr.splitlines()[-1] == (
        f"course: {script} failed: rank 1 exited with code 3 first; torchrun then stopped 1 other "
        "rank. Its own messages are above.")
    assert "Traceback" not in done.stderr and "SIGTERM" not in done.stderr



# The loader of the test below: DeepSpeed's own load of its operator, with torch's build lock
# made to say, as it is entered, whether another process holds it, and when it was acquired.
LOADER = """
import fcntl, os, time
import torch.utils.cpp_extension as cpp_extension
class Lock(cpp_extension.FileLock):
    def __enter__(self):
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            print("lock: free", flush=True)
        except BlockingIOError:
            print("lock: held by another process", flush=True)
        finally:
            os.close(fd)
        entered = super().__enter__()
        print(f"lock: acquired at {time.monotonic()}", flush=True)
        return entered
cpp_extension.FileLock = Lock
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
print("lock: loaded", flush=True)
"""


@pytest.mark.timeout(180)
def test_a_killed_operator_build_leaves_no_lock_that_blocks_a_later_load(tmp_path):
    """`./course setup` builds DeepSpeed's CPU operator once (tools/build_ops.py) and relies on
    torch's build lock being advisory: a builder that dies (a test's timeout, Slurm, the OOM
    killer) releases it with its process, while the lock file stays behind. Here a holder takes
    the lock of a copy of the built operator's folder; a loader finds it held and acquires it only
    after the holder is SIGKILLed (the control: the lock is honoured while its holder lives), then
    finishes without rebuilding, though the lock file is still there."""
    pytest.importorskip("deepspeed", reason="pip install deepspeed==0.19.8 (requirements.txt)")
    from common.log import extension_folder

    built = extension_folder("deepspeed_shm_comm")
    if not (built / "deepspeed_shm_comm.so").is_file() or torch.cuda.is_available():
        pytest.skip("DeepSpeed's CPU operator is not built here (./course setup builds it on CPU)")
    folder = tmp_path / "ext" / "deepspeed_shm_comm"  # TORCH_EXTENSIONS_DIR/NAME, no subfolder
    shutil.copytree(built, folder)  # copy2: mtimes kept, so ninja sees it up to date
    so, lock = folder / "deepspeed_shm_comm.so", folder / "lock"
    lock.touch()
    built_at = so.stat().st_mtime_ns
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('held', flush=True)\ntime.sleep(300)\n", str(lock)],
        stdout=subprocess.PIPE, text=True)
    loader = subprocess.Popen([sys.executable, "-c", LOADER], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    try:
        assert holder.stdout.readline().strip() == "held"
        said = ""
        while not said.startswith("lock:"):  # DeepSpeed prints its accelerator's name first
            said = loader.stdout.readline()
            assert said, "the loader ended without trying the lock"
        assert said.strip() == "lock: held by another process"
        time.sleep(1)
        killed_at = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on Linux
        holder.kill()  # a builder killed while it holds the lock
        holder.wait(timeout=10)
        out, _ = loader.communicate(timeout=60)
    finally:
        for proc in (holder, loader):
            if proc.poll() is None:
                proc.kill()
    assert loader.returncode == 0 and out.strip().endswith("lock: loaded")
    acquired_at = float(out.split("lock: acquired at ")[1].split()[0])
    assert acquired_at > killed_at, "the loader took the lock while its holder was alive"
    assert lock.exists() and so.stat().st_mtime_ns == built_at  # the file stayed; nothing rebuilt


def test_the_operator_build_runs_only_when_its_stamp_is_stale(tmp_path):
    """`./course` asks tools/build_ops.py to build only when its stamp (per interpreter and
    environment) is missing or names an operator no longer on disk: a check of files, no Python."""
    marker, so = tmp_path / "started", tmp_path / "ext" / "op.so"
    fake = tmp_path / "python"  # stands for the course's Python: says it was started
    fake.write_text(f"#!/bin/sh\ntouch {marker}\n")
    fake.chmod(0o755)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "COURSE_VENV": str(tmp_path / "venv")}

    def build(stamp_lines=None):
        marker.unlink(missing_ok=True)
        script = "PY=" + str(fake) + "; stamp=$(ops_stamp); mkdir -p $(dirname $stamp); "
        if stamp_lines is not None:
            script += "printf '" + "".join(f"{line}\\n" for line in stamp_lines) + "' > $stamp; "
        done = functions(script + "build_ops", env=env)
        assert done.returncode == 0, done.stderr
        return marker.exists()

    assert build() is True  # no stamp: built
    assert build([]) is False  # this machine needs no operator
    assert build([str(so)]) is True  # the operator it names is gone
    so.parent.mkdir()
    so.touch()
    assert build([str(so)]) is False


HOLD_PORT = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); " \
            "s.listen(); print('listening', flush=True); time.sleep(60)"


@pytest.mark.timeout(60)
def test_a_rendezvous_port_held_by_another_program_is_refused_in_one_line(tmp_path):
    """A raw torchrun whose `--rdzv-endpoint` port here is held by a program that is not a
    torchrun agent blocks silently (chapter 13: 700 s, no timeout bounds it); tools/torchrun.py
    names the program in one line within seconds. Controls: a free port, and a port held by a process whose
    command line reads like a torchrun agent (a second node started on this machine), pass."""
    from common.distributed import free_port
    from tools import torchrun as launcher

    port = free_port()
    argv = ["--nnodes=1", "--nproc_per_node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", str(tmp_path / "never_started.py")]
    assert launcher.held_port(argv) is None  # free
    assert launcher.held_port(["--standalone", *argv[1:]]) is None
    for extra, refused in (([], True), (["torchrun-agent"], False)):
        holder = subprocess.Popen([sys.executable, "-c", HOLD_PORT, str(port), *extra],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "listening"
            problem = launcher.held_port(argv)
            assert (problem is not None) == refused, problem
            if refused:
                assert f"127.0.0.1:{port}" in problem and f"pid {holder.pid}" in problem
                t = time.monotonic()
                done = subprocess.run([sys.executable, str(REPO / "tools" / "torchrun.py"), *argv],
                                      capture_output=True, text=True, timeout=40)
                assert done.returncode == 2 and time.monotonic() - t < 30
                assert done.stderr.strip() == problem
        finally:
            holder.kill()
            holder.wait()
