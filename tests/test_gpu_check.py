"""`./course gpu-check`: its plan on CPU, and its reading of a real run's summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tools import gpu_check

REPO = Path(__file__).resolve().parents[1]


def test_tables_name_real_scripts():
    ids = {gpu_check.script_id(p) for p in gpu_check.chapter_scripts()}
    assert gpu_check.GLOO_ON_CUDA <= ids and set(gpu_check.NEEDS) <= ids and set(gpu_check.SYSTEM) <= ids


@pytest.mark.parametrize("gpus", [1, 8])
def test_plan_covers_every_script(gpus, tmp_path):
    runs = gpu_check.plan(gpus, out_root=tmp_path)
    scripts = {gpu_check.script_id(p) for p in gpu_check.chapter_scripts()}
    assert {r.script for r in runs} == scripts
    assert {r.script for r in runs if r.world == 1} == scripts  # everyone gets a world-1 row
    for r in runs:
        assert r.status in ("planned", "n/a", "skipped"), r
        if r.status == "planned":
            assert "--device" in r.command and r.command[r.command.index("--device") + 1] == "cuda"
            assert r.command[r.command.index("--backend") + 1] == r.backend
        else:
            assert r.reason and not r.command
    if gpus == 1:  # NCCL cannot put two ranks on one GPU: only gloo-capable scripts share it
        two = [r for r in runs if r.world == 2]
        assert all(r.backend == "gloo" for r in two)
        assert {r.script for r in two if r.status == "planned"} <= gpu_check.GLOO_ON_CUDA
    else:
        assert {r.world for r in runs} == {1, 2, 8} and all(r.backend == "nccl" for r in runs)


def test_dry_run_prints_the_plan(capsys):
    assert gpu_check.main(["--dry-run", "--gpus", "1", "--only", "ch03"]) == 0
    out = capsys.readouterr().out
    assert "plan for 1 GPU(s): 2 runs" in out and "ch03_data_parallel/train" in out


@pytest.mark.timeout(180)
def test_execute_reads_a_real_run_and_writes_the_report(tmp_path):
    """One real run on CPU through the same reader the GPU check uses."""
    script = REPO / "chapters" / "ch01_overview" / "train.py"
    out = tmp_path / "ch01" / "w2"
    run = gpu_check.Run("ch01_overview/train", 2, "gloo", command=[
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(script), "--device", "cpu", "--backend", "gloo", "--out", str(out)])
    gpu_check.execute(run, timeout=150)
    summary = json.loads((out / "summary.json").read_text())
    fatal = [c for c in summary["checks"] if c["kind"] != "timing"]
    assert run.status == "pass", run.output_tail
    assert (run.checks_passed, run.checks_total) == (len(fatal), len(fatal)) and run.checks_total > 0
    assert run.figures == summary["figures"] and run.seconds > 0
    broken = gpu_check.Run("ch01_overview/train", 1, "gloo", command=[
        sys.executable, "-c", "import sys; sys.exit(3)", "--out", str(tmp_path / "none")])
    gpu_check.execute(broken, timeout=30)
    assert broken.status == "FAIL" and broken.reason == "exit 3"
    na = gpu_check.Run("ch04_model_parallel/train", 2, "gloo", status="n/a", reason="needs NCCL")
    report = gpu_check.write_report([run, broken, na], tmp_path / "report", 12.0)
    text = report.read_text()
    assert "| ch01_overview | train | 2 | gloo | pass |" in text and "| FAIL |" in text
    assert "1 pass, 1 FAIL, 1 n/a, 0 skipped" in text
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert len(data["runs"]) == 3 and "torch" in data["machine"]
