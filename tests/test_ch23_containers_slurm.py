"""Chapter 23, "Slurm, for real": the course's sbatch scripts and a real Slurm cluster on localhost.

Everywhere: every sbatch script is valid bash, its #SBATCH lines name options sbatch has and come
before the first command, and every course script it starts is started with options that
script accepts, at the world size the directives give (tests/test_configs.py's parser and the
script's own `validate`); the localhost cluster's config and command line; the README's table
is the recorded run's.

System test (COURSE_SYSTEM_TESTS=1, root, slurm-wlm and munge): a real one-node cluster comes up,
`sbatch --test-only` accepts every script (and refuses an unknown directive), an `srun torchrun`
job and a direct-`srun` job of chapter 03 complete with 2 gloo ranks and all checks ok, chapter
13's job requeued by its own USR1 trap resumes and ends with the undisturbed job's parameters,
a job with a wrong command ends FAILED; the daemons are stopped by PID and nothing is left.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "chapters" / "ch23_containers" / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))

# sbatch 22.05's options, from `sbatch --help` (plus --open-mode, documented in `man sbatch`
# but not listed by --help). The system test has sbatch itself parse every script.
SBATCH_OPTIONS = set("""
account array bb bbf begin chdir cluster-constraint clusters comment constraint container
contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot
dependency distribution error exclude exclusive export export-file extra-node-info get-user-env
gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags help hold
ignore-pbs input job-name licenses mail-type mail-user mcs-label mem mem-per-cpu mem-per-gpu
mincpus nice no-kill no-requeue nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-node
ntasks-per-socket output overcommit oversubscribe parsable partition power priority profile
propagate qos quiet reboot requeue reservation signal sockets-per-node spread-job switches
thread-spec threads-per-core time time-min tmp uid usage use-min-nodes verbose version wait
wckey wrap open-mode
""".split())


# --- reading an sbatch script ----------------------------------------------------------------------
def directives(text: str) -> dict[str, str]:
    """#SBATCH options of a script as {name: value}; sbatch reads them only above the first
    command, so one below it is an error here."""
    out, started = {}, False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#SBATCH"):
            if started:
                raise ValueError(f"#SBATCH after the first command is ignored by sbatch: {s}")
            m = re.fullmatch(r"#SBATCH\s+--([a-z][a-z0-9-]*)(?:[= ](\S+))?(\s+#.*)?", s)
            if not m:
                raise ValueError(f"not a long #SBATCH option: {s}")
            out[m.group(1)] = m.group(2) or ""
        elif s and not s.startswith("#"):
            started = True
    return out


def unknown_directives(text: str) -> list[str]:
    return sorted(set(directives(text)) - SBATCH_OPTIONS)


SRUN_CPUS = "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK"


def cluster_problems(text: str) -> list[str]:
    """What a real cluster needs of a script: in Slurm 22.05 and 23.02 srun does not inherit
    --cpus-per-task but reads SRUN_CPUS_PER_TASK (RELEASE_NOTES 22.05; 23.11 reads
    SLURM_CPUS_PER_TASK again and ignores it), so SRUN_CPUS_PER_TASK is exported before the first
    srun; and no --gpus-per-task (with devices confined, a task sees only its own GPU: NCCL was
    reported not to work that way, NVIDIA/nccl#1066, and without P2P it has no NVLink between the
    ranks; under pyxis one of two tasks got no GPU, NVIDIA/pyxis#73)."""
    lines = [line.strip() for line in text.splitlines()]
    srun = next((i for i, line in enumerate(lines) if re.match(r"srun\b", line)), None)
    export = next((i for i, line in enumerate(lines) if line == SRUN_CPUS), None)
    problems = []
    if srun is not None and "cpus-per-task" in directives(text) and (export is None or export > srun):
        problems.append("srun without SRUN_CPUS_PER_TASK: its tasks get one CPU each (Slurm 22.05-23.02)")
    if "--gpus-per-task" in text:
        problems.append("--gpus-per-task: ranks cannot reach each other's GPUs (use --gpus-per-node)")
    return problems


def expand(text: str, variables: dict[str, str]) -> str:
    """Shell parameter expansion as far as the test needs it: ${X:-d}, ${X:?msg}, ${X}, $X,
    "$@" (dropped) and $(...) (a placeholder host)."""
    text = text.replace('"$@"', "").replace("$(", "HOST$(")
    text = re.sub(r"HOST\$\([^)]*\)", "HOST", text)
    pattern = re.compile(r"\$\{(\w+)(?::([-?])((?:[^{}]|\$\{[^}]*\})*))?\}|\$(\w+)")
    for _ in range(4):  # nested defaults: ${A:-${B:-2}}
        def sub(m):
            name = m.group(1) or m.group(4)
            if name in variables:
                return variables[name]
            if m.group(2) == "-":
                return m.group(3)
            return "x"  # ${X:?...} must be set by the user: any value
        text = pattern.sub(sub, text)
    return text


def launches(path: Path) -> list[tuple[str, int]]:
    """(command, world size) of every line that starts a course script, with the variables the
    script sets expanded and the world size from its #SBATCH lines (torchrun: nodes x NPROC;
    srun alone: nodes x tasks per node)."""
    text = path.read_text()
    d = directives(text)
    nodes, per_node = int(d.get("nodes", 1)), int(d.get("ntasks-per-node", 1))
    variables = {"SLURM_NNODES": str(nodes), "SLURM_JOB_ID": "1", "SLURM_JOB_NAME": d["job-name"]}
    lines = []
    for line in text.replace("\\\n", " ").splitlines():
        m = re.match(r"\s*(\w+)=(\S+)\s*$", line)
        if m:
            variables[m.group(1)] = expand(m.group(2), variables).strip('"')
        elif "chapters/ch" in line and not line.lstrip().startswith("#"):
            lines.append(" ".join(expand(line, variables).replace("&", " ").split()))
    out = []
    for cmd in lines:
        words = shlex.split(cmd)
        if "torchrun" in words:
            nproc = next(int(w.split("=")[1]) for w in words if w.startswith("--nproc_per_node="))
            out.append((cmd, nodes * nproc))
        else:
            out.append((cmd, nodes * per_node))
    return out


def validate_command(cmd: str, world: int) -> None:
    """Raise ValueError/SystemExit unless the course script accepts these options at `world`."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_configs import parse_command

    from common.config import build_parser
    from tools.precheck import script_module

    script, args, _, _ = parse_command(cmd)
    assert script.exists(), f"{cmd}: no such script {script}"
    module = script_module(script)
    cfg = module.Config(**vars(build_parser(module.Config).parse_args(args)))
    module.validate(cfg, world)


# --- everywhere ------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_scripts_found_and_bash_syntax():
    names = {p.name for p in SCRIPTS}
    assert {"ch03_single_node.sbatch", "ch03_multi_node.sbatch", "ch03_srun_ranks.sbatch",
            "ch13_requeue.sbatch", "ch03_pyxis.sbatch"} <= names, names
    for p in SCRIPTS:
        r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, f"{p.name}: {r.stderr}"
        assert p.read_text().startswith("#!/bin/bash\n"), p.name


@pytest.mark.timeout(60)
def test_directives_are_sbatch_options():
    for p in SCRIPTS:
        text = p.read_text()
        assert not unknown_directives(text), f"{p.name}: {unknown_directives(text)}"
        assert "job-name" in directives(text) and "time" in directives(text), p.name
    # negative controls: the same reader rejects an unknown option and a directive too late
    assert unknown_directives("#!/bin/bash\n#SBATCH --gpus-per-nod=8\n") == ["gpus-per-nod"]
    with pytest.raises(ValueError, match="after the first command"):
        directives("#!/bin/bash\necho hi\n#SBATCH --nodes=2\n")


@pytest.mark.timeout(30)
def test_scripts_are_right_for_a_real_cluster():
    for p in SCRIPTS:
        text = p.read_text()
        assert cluster_problems(text) == [], (p.name, cluster_problems(text))
        assert SRUN_CPUS in text, p.name
    # negative controls: the same script without the export, with the export after srun, and
    # with GPUs per task, is refused
    text = (SLURM / "ch03_multi_node.sbatch").read_text()
    assert cluster_problems(text.replace(SRUN_CPUS, ""))[0].startswith("srun without SRUN_CPUS")
    late = text.replace(SRUN_CPUS + "\n", "") + "\n" + SRUN_CPUS + "\n"
    assert cluster_problems(late)[0].startswith("srun without SRUN_CPUS")
    assert cluster_problems(text.replace("--gpus-per-node=8", "--gpus-per-task=1"))[0].startswith("--gpus-per-task")
    # the lessons show no --gpus-per-task in a command (the pitfalls name it in prose only)
    for readme in (SLURM / "README.md", SLURM.parent / "README.md", REPO / "chapters/ch22_networking/README.md"):
        commands = " ".join(re.findall(r"```(?:bash)?\n(.*?)```", readme.read_text(), re.S))
        assert "--gpus-per-task" not in commands and "--gpus-per-node" in commands, readme


@pytest.mark.timeout(60)
def test_sbatch_help_lists_the_options():
    """Where sbatch is installed, its own --help (with a throwaway config) lists every option
    the scripts use (--open-mode excepted: man-page only in 22.05, parsed by the system test)."""
    if shutil.which("sbatch") is None:
        pytest.skip("sbatch not installed (./course setup --system); the list above is 22.05's")
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "slurm.conf"
        conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost\n"
                        "PartitionName=p Nodes=localhost\n")
        r = subprocess.run(["sbatch", "--help"], env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True, timeout=20)
    listed = set(re.findall(r"--([a-z][a-z0-9-]+)", r.stdout))
    used = {name for p in SCRIPTS for name in directives(p.read_text())} - {"open-mode"}
    assert used <= listed, used - listed


@pytest.mark.timeout(90)
def test_launch_commands_are_valid():
    seen = {}
    for p in SCRIPTS:
        cmds = launches(p)
        assert cmds, f"{p.name} starts no course script"
        for cmd, world in cmds:
            validate_command(cmd, world)
            seen[p.name] = (cmd, world)
    assert seen["ch03_multi_node.sbatch"][1] == 4 and "--rdzv-backend=c10d" in seen["ch03_multi_node.sbatch"][0]
    assert seen["ch03_srun_ranks.sbatch"][1] == 4 and "torchrun" not in seen["ch03_srun_ranks.sbatch"][0]
    assert seen["ch03_single_node.sbatch"][1] == 2
    assert "ch13_fault_tolerance/train.py" in seen["ch13_requeue.sbatch"][0]
    # negative control: an option the script does not have, and a world it refuses
    with pytest.raises(SystemExit):
        validate_command("srun python chapters/ch03_data_parallel/train.py --no-such-option", 2)
    with pytest.raises(ValueError):
        validate_command("srun python chapters/ch13_fault_tolerance/train.py --fail-rank 5 "
                         "--fail-step 3", 2)


@pytest.mark.timeout(60)
def test_requeue_script_traps_and_resumes_in_one_folder():
    text = (SLURM / "ch13_requeue.sbatch").read_text()
    d = directives(text)
    assert "requeue" in d and d["signal"].startswith("B:USR1@"), d
    assert "trap requeue USR1" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    # the folder depends on the job id only, which a requeued job keeps
    assert 'OUT="${COURSE_OUT:-runs/slurm}/$SLURM_JOB_NAME-$SLURM_JOB_ID"' in text


@pytest.mark.timeout(60)
def test_multi_node_rendezvous_on_first_host():
    text = (SLURM / "ch03_multi_node.sbatch").read_text()
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"' in text and "--ntasks-per-node=1" in text


@pytest.mark.timeout(60)
def test_cluster_config_and_command_line(capsys):
    from chapters.ch23_containers.slurm import clusterconf
    from chapters.ch23_containers.slurm import localcluster as lc

    conf = clusterconf.slurm_conf(Path("/tmp/x"), 16817, 16818, 8, 4096)
    for line in ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
                 "SelectType=select/cons_tres", "AccountingStorageType=accounting_storage/none",
                 "SlurmctldPort=16817", "SlurmdPort=16818", "AuthInfo=socket=/tmp/x/munge/munge.socket",
                 "NodeName=localhost NodeAddr=127.0.0.1 CPUs=8"):
        assert line in conf.splitlines() or any(x.startswith(line) for x in conf.splitlines()), line
    assert "cgroup" not in conf.lower()
    with pytest.raises(SystemExit) as e:
        lc._cli(["--help"])
    assert e.value.code == 0 and "up" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        lc._cli(["sideways"])
    assert e.value.code == 2
    from chapters.ch23_containers.slurm.jobs import seconds

    assert seconds("1-02:03:04") == 93784 and lc.parse_fields("JobState=FAILED Reason=None") == {
        "JobState": "FAILED", "Reason": "None"}
    # a taken port is refused with a sentence, before anything is written or started
    with socket.socket() as s, tempfile.TemporaryDirectory() as tmp:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not clusterconf.port_free(port)
        with pytest.raises(lc.ClusterError, match="taken"):
            lc.LocalSlurm(Path(tmp) / "c", ports=(port, port + 1))._write_files()
        assert not (Path(tmp) / "c").exists()


@pytest.mark.timeout(60)
def test_readme_shows_the_recorded_run():
    from chapters.ch23_containers.slurm.jobs import DATA, table

    data = json.loads(DATA.read_text())
    readme = (SLURM / "README.md").read_text()
    assert table(data) in readme, "slurm/README.md's table is not the recorded run's"
    jobs = data["jobs"]
    assert jobs["srun torchrun (c10d)"]["state"] == "COMPLETED"
    assert jobs["wrong command"]["state"] == "FAILED"
    assert data["requeue"]["final parameters == undisturbed run"] is True
    for figure in (f"{data['total_s']} s", f"{data['cluster_up_s']} s",
                   f"{data['requeue']['requeue hold (EligibleTime - SubmitTime), s']} s",
                   data["slurm"]):
        assert str(figure) in readme, figure


@pytest.mark.timeout(60)
def test_readme_links_resolve():
    readme = SLURM / "README.md"
    links = [m for m in re.findall(r"\]\(([^)#\s]+)\)", readme.read_text()) if "://" not in m]
    assert len(links) >= 8 and not [m for m in links if not (readme.parent / m).exists()]


@pytest.mark.timeout(90)
def test_readme_commands_are_valid():
    sys.path.insert(0, str(REPO / "tests"))
    from test_configs import _command_texts, parse_command

    n = 0
    for text in _command_texts(SLURM / "README.md"):
        parsed = parse_command(" ".join(text.split()))
        if parsed is None:
            continue
        script, args, world, comment = parsed
        args = [a for a in args if not a.startswith("$")]
        validate_command(" ".join([str(script.relative_to(REPO)), *args]), world)
        n += 1
    assert n >= 2, n


# --- the real cluster ------------------------------------------------------------------------------
def _probe():
    from chapters.ch23_containers.slurm.localcluster import missing_requirements

    return missing_requirements()


@pytest.mark.timeout(150)
def test_real_slurm_cluster_on_localhost():
    from conftest import require_system

    require_system("slurmctld", "slurmd", "munged", "sbatch", "scontrol", probe=_probe)
    from chapters.ch23_containers.slurm import jobs as J
    from chapters.ch23_containers.slurm.localcluster import LocalSlurm, _alive, processes_under

    cluster = LocalSlurm(cpus=8)
    root = cluster.root
    pids = {}
    try:
        with tempfile.TemporaryDirectory(prefix="course-slurm-test-") as tmp:
            cluster.up()
            pids = dict(cluster.pids)
            assert set(pids) == {"munged", "slurmctld", "slurmd"}
            for p in SCRIPTS:
                assert J.test_only(cluster, p).startswith("ok:"), (p.name, J.test_only(cluster, p))
            # negative control: an option sbatch does not have is refused; a prefix of one is
            # not (getopt takes an unambiguous abbreviation), which the name check above refuses
            bad, prefix = Path(tmp) / "bad.sbatch", Path(tmp) / "prefix.sbatch"
            bad.write_text("#!/bin/bash\n#SBATCH --gpus-per-gpu=8\nsrun hostname\n")
            prefix.write_text("#!/bin/bash\n#SBATCH --gpus-per-nod=8\nsrun hostname\n")
            assert J.test_only(cluster, bad).startswith("refused:"), J.test_only(cluster, bad)
            assert J.test_only(cluster, prefix).startswith("ok:"), J.test_only(cluster, prefix)
            assert unknown_directives(prefix.read_text()) == ["gpus-per-nod"]
            result = J.run_jobs(cluster, Path(tmp) / "out", timeout=100)
    finally:
        cluster.down()
    jobs = result["jobs"]
    for name in ("srun torchrun (c10d)", "srun ranks", "requeued", "undisturbed"):
        j = jobs[name]
        assert j["state"] == "COMPLETED" and j["exit_code"] == "0:0", (name, j)
        s = j["summary"]
        assert s and s["world_size"] == 2 and s["backend"] == "gloo", (name, s)
        assert s["checks_ok"] == s["checks"] >= 1, (name, s)
    assert jobs["requeued"]["restarts"] == 1 and jobs["undisturbed"]["restarts"] == 0
    assert jobs["requeued"]["summary"]["figures"]["resumed from step"] == \
        result["requeue"]["checkpoint step when signalled"] >= 5
    assert jobs["undisturbed"]["summary"]["figures"]["resumed from step"] == 0
    assert result["requeue"]["final parameters == undisturbed run"] is True
    # negative control: a wrong command fails the job, and scontrol says so
    assert jobs["wrong command"]["state"] == "FAILED" and jobs["wrong command"]["summary"] is None
    # nothing left: the daemons by PID, any process still using the folder, the folder itself
    assert not [n for n, pid in pids.items() if _alive(pid)]
    assert not processes_under(root) and not root.exists()


@pytest.mark.timeout(90)
def test_command_line_up_status_down():
    """A learner's session: `up` leaves the daemons running and prints SLURM_CONF, a second `up`
    on the same folder is refused, a client command works, `down` stops them by PID."""
    from conftest import require_system

    require_system("slurmctld", "slurmd", "munged", "sinfo", probe=_probe)
    from chapters.ch23_containers.slurm.localcluster import _alive, processes_under

    root = Path(tempfile.gettempdir()) / f"course-slurm-cli-{__import__('os').getpid()}"
    cli = [sys.executable, "-m", "chapters.ch23_containers.slurm.localcluster"]

    def run(*args, **kw):
        return subprocess.run([*cli, *args, "--dir", str(root)], cwd=REPO, capture_output=True,
                              text=True, timeout=60, **kw)

    pids = {}
    try:
        up = run("up")
        assert up.returncode == 0, up.stderr
        assert f"export SLURM_CONF={root}/slurm.conf" in up.stdout
        pids = json.loads((root / "cluster.json").read_text())["pids"]
        assert run("status").returncode == 0
        again = run("up")
        assert again.returncode == 2 and "already running" in again.stderr
        sinfo = subprocess.run(["sinfo", "-h", "-o", "%P %t %N"], capture_output=True, text=True,
                               env={"SLURM_CONF": str(root / "slurm.conf"), "PATH": "/usr/bin:/bin"},
                               timeout=20)
        assert sinfo.stdout.split() == ["course*", "idle", "localhost"], sinfo
    finally:
        down = run("down")
    assert down.returncode == 0 and down.stdout.startswith("stopped"), (down.stdout, down.stderr)
    assert pids and not [n for n, pid in pids.items() if _alive(pid)]
    assert not root.exists() and not processes_under(root)
    assert run("status").returncode == 1
