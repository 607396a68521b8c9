"""Chapter 15: a profiled DDP step, its compute/communication/idle breakdown read from the
trace, MFU from the FLOPs formula, and torch.compile against eager.

The torchrun run checks itself (summary.json); this module re-reads the exported trace with
its own, differently written interval arithmetic (a 1 µs occupancy grid), recomputes the FLOPs
and MFU from the config and the recorded figures, and runs the negative controls: a trace
without DDP has no collectives, a compiled model trained differently fails the parity check.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest
import torch

from chapters.ch15_profiling import compiled, train
from chapters.ch15_profiling.trace_breakdown import breakdown, load_trace
from common.launch import run_on_ranks, run_torchrun
from common.models import MLP

SCRIPT = Path(train.__file__)


def grid_comm_us(events: list[dict]) -> float:
    """Communication µs inside the train_step ranges, by marking a 1 µs grid (no interval merging)."""
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "train_step"]
    t0 = min(a for a, _ in steps)
    busy = torch.zeros(int(max(b for _, b in steps) - t0) + 2, dtype=torch.bool)
    inside = torch.zeros_like(busy)
    for a, b in steps:
        inside[int(a - t0):int(b - t0)] = True
    for e in events:
        name = e["name"].lower()
        if "all_reduce" in name or "allreduce" in name:
            busy[int(e["ts"] - t0):int(e["ts"] + e["dur"] - t0)] = True
    return float((busy & inside).sum())


@pytest.mark.timeout(150)
def test_profiled_ddp_run(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, args=["--compile", "--compile-backend", "aot_eager"],
                       out_dir=tmp_path, timeout=140)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"] and c["kind"] != "timing"]
    assert not failed, res.output[-3000:]
    cfg, fig = train.Config(), res.summary["figures"]

    # The trace holds the collectives: one c10d all-reduce per DDP bucket per profiled step.
    with gzip.open(tmp_path / "trace.json.gz", "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    calls = [e for e in events if e["name"] == "c10d::allreduce_"]
    assert len(calls) == len(fig["bucket sizes"]["measured"]) * cfg.profile_steps
    assert any(e["name"].startswith("gloo:all_reduce") for e in events)  # the transfer itself

    # The breakdown's communication time equals an independent 1 µs-grid count (±1 µs/event).
    comm_ms = grid_comm_us(events) / cfg.profile_steps / 1e3
    assert comm_ms == pytest.approx(fig["comm per step (trace)"]["measured"], abs=0.02)
    # Sanity, not timing: trace and a separately timed run agree within 100x (a unit slip,
    # µs vs ms, would be 1000x). The script's own 3x check is reported, never fatal.
    assert 1 / 100 < comm_ms / fig["all-reduce per step (timed alone)"]["measured"] < 100

    # MFU follows from the formula: 6·B·Σ in·out − 2·B·in₀·out₀ (chapter 01) / step / peak.
    dims = [cfg.d_in] + [cfg.d_hidden] * (cfg.n_layers - 1) + [1]
    pairs = list(zip(dims, dims[1:]))
    flops = 6 * cfg.batch_size * sum(a * b for a, b in pairs) - 2 * cfg.batch_size * dims[0] * dims[1]
    assert fig["model FLOPs per step per rank"]["measured"] == flops
    util = flops / (fig["step time, median"]["measured"] / 1e3) / fig["matmul peak, same threads"]["measured"]
    assert util == pytest.approx(fig["MFU"]["measured"], rel=1e-9)
    assert 0 < util <= 1
    assert fig["threads per rank"]["measured"] == 1  # torchrun's OMP_NUM_THREADS=1, peak alike

    # torch.compile under DDP: no graph breaks in the model, one with .item(), same training.
    assert res.check("graph breaks in the model's forward")["measured"] == 0
    assert fig["graph breaks with .item() in forward"]["measured"] >= 1
    assert res.check("compiled DDP == eager DDP (max |dparam|)")["measured"] <= 1e-5


def test_breakdown_of_a_hand_made_trace_and_a_trace_without_ddp(tmp_path):
    ev = [  # one 100 µs step: nested ops 0–30, an all-reduce 20–60 on another thread, op 70–80
        {"name": "train_step", "ts": 0, "dur": 100, "cat": "user_annotation"},
        {"name": "aten::linear", "ts": 0, "dur": 30, "cat": "cpu_op"},
        {"name": "aten::addmm", "ts": 5, "dur": 20, "cat": "cpu_op"},
        {"name": "gloo:all_reduce", "ts": 20, "dur": 40, "cat": "user_annotation", "tid": 2},
        {"name": "c10d::allreduce_", "ts": 18, "dur": 4, "cat": "cpu_op"},
        {"name": "aten::mul", "ts": 70, "dur": 10, "cat": "cpu_op"},
        {"name": "aten::mul", "ts": 150, "dur": 10, "cat": "cpu_op"},  # outside the step
    ]
    b = breakdown(ev)
    assert (b["comm_us"], b["compute_us"], b["idle_us"], b["collective_calls"]) == (42, 28, 30, 1)

    # Negative control: a step profiled without DDP holds no collective, so the script's
    # "all-reduce calls in the trace = buckets x steps" check (1 x steps) rejects it.
    model = MLP(8, 16, 1)
    with torch.profiler.profile() as prof, torch.profiler.record_function("train_step"):
        model(torch.randn(4, 8)).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    plain = breakdown(load_trace(tmp_path / "t.json"))
    assert plain["collective_calls"] == 0 and plain["comm_us"] == 0 and plain["compute_us"] > 0


def test_compiled_parity_check_rejects_a_different_step():
    torch.manual_seed(0)
    model = MLP(8, 16, 1)
    xs, ys = torch.randn(3, 4, 8), torch.randn(3, 4, 1)
    good = compiled.compiled_vs_eager(model, xs, ys, lr=0.01, backend="aot_eager")
    assert good["max_param_diff"] <= 1e-5
    eager, other = copy.deepcopy(model), copy.deepcopy(model)  # broken: compiled with lr x 1.01
    compiled.sgd_steps(eager, eager, xs, ys, 0.01)
    compiled.sgd_steps(other, torch.compile(other, backend="aot_eager"), xs, ys, 0.0101)
    diff = max((a - b).abs().max().item() for a, b in zip(eager.parameters(), other.parameters()))
    assert diff > 1e-5


@pytest.mark.timeout(180)
def test_compiled_fsdp2_matches_eager_fsdp2_and_compiled_autograd_does_not():
    # float64: compiled FSDP2 == eager FSDP2 to 1e-12. Measured in torch 2.14.1 (CPU, gloo): the
    # FSDP2 hooks are torch._dynamo.disable'd ("skipping FSDP hooks"), one graph break, and no
    # graph reaches the backend, so the "compiled" model runs eagerly. If a torch upgrade starts
    # capturing graphs, this assertion fails and the README's account must be revised.
    for rank in run_on_ranks(compiled.fsdp2_compile_experiment, 2, timeout=120):
        good = rank["compiled"]
        assert good["graphs"] == 0 and good["breaks"] >= 1 and good["still_sharded"]
        assert good["max_param_diff"] <= 1e-12 and good["max_loss_diff"] <= 1e-12
        # Negative control: a compiled copy with lr x 1.01 is far outside the tolerance.
        assert rank["compiled, lr x 1.01"]["max_param_diff"] > 1e-6
        # torch 2.14.1, CPU: the config flag only covers backwards run inside the compiled call
        # (ours runs outside it), so nothing is captured and training is the plain compiled one.
        cfg = rank["compiled autograd via config"]
        assert cfg["ca_captures"] == 0 and cfg["max_param_diff"] <= 1e-12
        # _enable around the loop does capture the backward, but FSDP2's post-backward
        # (reduce-scatter, reshard) is lost: full unsharded parameters, un-averaged gradients.
        ena = rank["compiled autograd via _enable"]
        assert ena["ca_captures"] >= 1 and ena["graphs"] >= 1 and not ena["still_sharded"]
        assert ena["max_param_diff"] > 1e-6


def test_bad_input_exits_with_one_line():
    with pytest.raises(SystemExit) as e:
        train.parse_config(train.Config, ["--profile-steps", "0"])
    assert e.value.code == 2
