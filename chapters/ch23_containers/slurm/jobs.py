"""Submit the course's sbatch scripts to the localhost cluster and record what happened.

Used by the system test (tests/test_ch23_containers_slurm.py) and to record the run that
slurm/README.md shows (data/localhost_run.json):

    python -m chapters.ch23_containers.slurm.jobs              # run them, print the table
    python -m chapters.ch23_containers.slurm.jobs --record     # ... and rewrite the data file

The jobs, all at once on one node declaring 8 CPUs (the multi-node scripts with --nodes=1):
- `ch03_multi_node.sbatch`: `srun torchrun`, MASTER_ADDR from `scontrol show hostnames`, c10d;
- `ch03_srun_ranks.sbatch`: two ranks started by `srun` itself (SLURM_PROCID, ...);
- `ch13_requeue.sbatch`: once its first checkpoint is written, USR1 to its batch shell (what
  `--signal=B:USR1@120` sends before the time limit): the trap requeues it; the second attempt
  resumes, and its final parameters are compared with
- `ch13_requeue.sbatch` left alone (the undisturbed reference);
- the negative control: `ch03_multi_node.sbatch` with an option train.py does not have.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from chapters.ch23_containers.slurm.localcluster import ClusterError, LocalSlurm, free_ports

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DATA = HERE / "data" / "localhost_run.json"
SCRIPTS = sorted(HERE.glob("*.sbatch"))
TEST_ONLY_OVERRIDES = ("--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0")
REQUEUE_STEP_SECONDS = 0.5  # ch13's --step-seconds: time to signal it after its first save


def seconds(runtime: str) -> int:
    """Slurm's RunTime '[D-]HH:MM:SS' in seconds."""
    days, _, hms = runtime.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def summary_of(out: Path) -> dict | None:
    """The figures a learner checks in a job's summary.json (None when there is none)."""
    path = out / "summary.json"
    if not path.exists():
        return None
    s = json.loads(path.read_text())
    return {"world_size": s["world_size"], "backend": s["backend"], "device": s["device"],
            "checks": len(s["checks"]), "checks_ok": sum(c["ok"] for c in s["checks"]),
            "figures": {k: v["measured"] for k, v in s["figures"].items()
                        if k in ("resumed from step", "final loss (rank 0's shard)")}}


def test_only(cluster: LocalSlurm, script: Path) -> str:
    """`sbatch --test-only` of a script on this one-node, GPU-less cluster: sbatch itself parses
    its #SBATCH lines (an unknown option is refused); TEST_ONLY_OVERRIDES replace the sizes one
    node without GPUs cannot give (options on the command line win over #SBATCH lines)."""
    r = subprocess.run(["sbatch", "--test-only", *TEST_ONLY_OVERRIDES, str(script)],
                       env=cluster.env({"IMAGE": "x"}), cwd=REPO, capture_output=True, text=True,
                       timeout=20)
    text = (r.stdout + r.stderr).strip()
    return "ok: " + text if r.returncode == 0 and "to start at" in text else "refused: " + text


def params_equal(a: Path, b: Path) -> bool:
    import torch

    from common.checkpoint import load_checkpoint  # CRC-checked, weights_only

    pa, pb = load_checkpoint(a)["model"], load_checkpoint(b)["model"]
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def run_jobs(cluster: LocalSlurm, out: Path, timeout: float = 100) -> dict:
    """Submit the jobs, requeue one, wait for all (bounded by `timeout` s in total), and return
    what `scontrol show job` and the summaries say."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    out.mkdir(parents=True, exist_ok=True)
    ports = iter(free_ports(5, start=24000 + (hash(str(out)) % 1000) * 5))
    # the environment running this (COURSE_VENV may put it outside the checkout) comes first
    path = f"{Path(sys.executable).parent}:{cluster.env()['PATH']}"

    def submit(name: str, extra: list[str], args: list[str] = ()) -> int:
        env = {"COURSE_OUT": str(out), "MASTER_PORT": str(next(ports)), "PATH": path,
               "OMP_NUM_THREADS": "1"}
        return cluster.sbatch([f"--output={out}/%x-%j.out", *extra,
                               str(HERE / name), *args], env=env, cwd=REPO)

    jobs = {
        "srun torchrun (c10d)": submit("ch03_multi_node.sbatch", ["--nodes=1"]),
        "srun ranks": submit("ch03_srun_ranks.sbatch", ["--nodes=1"]),
        "requeued": submit("ch13_requeue.sbatch", [],
                           ["--step-seconds", str(REQUEUE_STEP_SECONDS)]),
        "undisturbed": submit("ch13_requeue.sbatch", ["--job-name=ch13-undisturbed"]),
        "wrong command": submit("ch03_multi_node.sbatch", ["--nodes=1", "--job-name=ch03-wrong"],
                                ["--no-such-option"]),
    }
    submitted = {k: time.monotonic() for k in jobs}
    rq = jobs["requeued"]
    latest = out / f"ch13-requeue-{rq}" / "ckpt" / "latest"
    while not latest.exists():
        if time.monotonic() > deadline:
            raise ClusterError(f"job {rq} wrote no checkpoint in {timeout:.0f} s")
        if cluster.job(rq).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
            raise ClusterError(f"job {rq} ended before its first checkpoint: {cluster.job(rq)}")
        time.sleep(0.3)
    signalled_at = int(latest.read_text().strip())
    cluster.command(["scancel", "--batch", "--signal=USR1", str(rq)])
    pending = cluster.wait(rq, max(1, deadline - time.monotonic()),
                           until=lambda f: f.get("Restarts") == "1" and f["JobState"] == "PENDING")
    requeue_delay = None
    if "EligibleTime" in pending and "SubmitTime" in pending:  # Slurm holds a requeued job back
        requeue_delay = _epoch(pending["EligibleTime"]) - _epoch(pending["SubmitTime"])
    cluster.command(["scontrol", "update", f"JobId={rq}", "StartTime=now"])

    result: dict = {"jobs": {}}
    for name, job_id in jobs.items():
        fields = cluster.wait(job_id, max(1, deadline - time.monotonic()))
        wall = time.monotonic() - submitted[name]
        run_out = out / f"{fields['JobName']}-{job_id}"
        result["jobs"][name] = {
            "job_id": job_id, "script": fields["Command"].split("/")[-1],
            "state": fields["JobState"], "exit_code": fields["ExitCode"],
            "restarts": int(fields.get("Restarts", 0)), "run_time_s": seconds(fields["RunTime"]),
            "submit_to_end_s": round(wall, 1), "summary": summary_of(run_out)}
    a = out / f"ch13-requeue-{rq}" / "final_params.pt"
    b = out / f"ch13-undisturbed-{jobs['undisturbed']}" / "final_params.pt"
    result["requeue"] = {"checkpoint step when signalled": signalled_at,
                         "requeue hold (EligibleTime - SubmitTime), s": requeue_delay,
                         "final parameters == undisturbed run": a.exists() and b.exists()
                         and params_equal(a, b)}
    result["total_s"] = round(time.monotonic() - t0, 1)
    return result


def _epoch(stamp: str) -> int:
    return int(time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S")))


def table(result: dict) -> str:
    """The Markdown table slurm/README.md shows (a test checks the README holds exactly this)."""
    rows = ["| job | id | script | state | exit | restarts | run time | ranks | backend | checks ok |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, j in result["jobs"].items():
        s = j["summary"] or {}
        rows.append(f"| {name} | {j['job_id']} | `{j['script']}` | {j['state']} | {j['exit_code']} | "
                    f"{j['restarts']} | {j['run_time_s']} s | {s.get('world_size', '—')} | "
                    f"{s.get('backend', '—')} | "
                    + (f"{s['checks_ok']}/{s['checks']}" if s else "no summary") + " |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    import argparse
    import tempfile

    p = argparse.ArgumentParser(prog="python -m chapters.ch23_containers.slurm.jobs",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--record", action="store_true", help=f"rewrite {DATA.relative_to(REPO)}")
    p.add_argument("--timeout", type=float, default=100, help="seconds for all the jobs together")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="course-slurm-jobs-") as tmp, LocalSlurm(cpus=8) as c:
        up = time.monotonic() - t0
        tests = {s.name: test_only(c, s) for s in SCRIPTS}
        result = run_jobs(c, Path(tmp), a.timeout)
        version = c.command(["sbatch", "--version"]).strip()
    result = {"slurm": version,
              "cluster_up_s": round(up, 1), "test_only": tests, **result}
    print(json.dumps(result, indent=1))
    print(table(result))
    if a.record:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {DATA.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
