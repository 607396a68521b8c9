"""Chapter 04: a model split into pipeline stages computes the unsplit model's loss and gradients,
and the bubble counted on the schedule's timeline is (p−1)/(m+p−1).

The torchrun run checks itself (summary.json); this module also computes the unsplit reference
with its own plain loop, runs 4 stages on 4 gloo ranks, and runs the negative controls: broken
pipelines that the same gradient-parity check must reject.
"""

from __future__ import annotations

import copy
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from chapters.ch04_model_parallel import schedule, train
from common.checkpoint import load_checkpoint
from common.data import regression_data
from common.launch import run_on_ranks, run_torchrun
from common.models import MLP

SCRIPT = Path(train.__file__)
TOL = 1e-12  # float64: split and unsplit differ only in summation order (~1e-16)


def reference_model(cfg: train.Config) -> MLP:
    torch.manual_seed(cfg.seed)
    return MLP(cfg.d_in, cfg.d_hidden, 1, cfg.n_layers).double()


def batches(cfg: train.Config):
    X, Y = regression_data(cfg.steps * cfg.batch_size, cfg.d_in, 1, seed=cfg.seed, dtype=torch.float64)
    return X.view(cfg.steps, cfg.batch_size, -1), Y.view(cfg.steps, cfg.batch_size, -1)


def reference_grads(cfg: train.Config) -> tuple[float, dict]:
    """Loss and gradients of the unsplit model on the first batch, by plain autograd."""
    model = reference_model(cfg)
    X, Y = batches(cfg)
    loss = ((model(X[0]) - Y[0]) ** 2).mean()
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.item(), dict(zip(names, grads))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), "every parameter must have a gradient"
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---- the bubble, counted on a deterministic timeline ------------------------------------------

@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_bubble_counted_from_the_timeline_equals_the_formula(p, m):
    for order in (schedule.gpipe_order, schedule.one_f_one_b_order):
        events = schedule.simulate(order(p, m))
        slots = schedule.grid(events, p)
        idle = sum(row.count(".") for row in slots)
        assert Fraction(idle, p * len(slots[0])) == Fraction(p - 1, m + p - 1), order.__name__
        assert len(slots[0]) == 2 * (m + p - 1)  # makespan: m + p − 1 forward and backward slots
        # equal stages, whatever the backward costs: the formula still holds
        assert schedule.bubble_fraction(schedule.simulate(order(p, m), 1, 2), p) == Fraction(p - 1, m + p - 1)


def test_simulated_timeline_respects_dataflow_and_one_op_per_rank():
    events = schedule.simulate(schedule.one_f_one_b_order(4, 8))
    end = {(e.kind, e.mb, e.stage): e.end for e in events}
    for e in events:
        if e.kind == "F" and e.stage > 0:
            assert e.start >= end[("F", e.mb, e.stage - 1)]
        if e.kind == "B":
            assert e.start >= end[("F", e.mb, e.stage)]
            if e.stage < 3:
                assert e.start >= end[("B", e.mb, e.stage + 1)]
    for r in range(4):
        mine = sorted((e.start, e.end) for e in events if e.rank == r)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:])), "a rank runs one op at a time"


def test_bubble_negative_controls():
    # No micro-batch overlap (each rank runs F_i then B_i before F_{i+1}): not the GPipe bubble.
    serial = [[op for i in range(8) for op in (schedule.Op("F", i, s), schedule.Op("B", i, s))]
              for s in range(4)]
    assert schedule.bubble_fraction(schedule.simulate(serial), 4) != schedule.bubble_formula(4, 8)
    # Naive model parallelism is m = 1: only one rank busy at a time.
    assert schedule.bubble_fraction(schedule.simulate(schedule.gpipe_order(4, 1)), 4) == Fraction(3, 4)
    # A backward queued before its own forward can never run.
    with pytest.raises(ValueError, match="deadlocks"):
        schedule.simulate([[schedule.Op("B", 0, 0), schedule.Op("F", 0, 0)]])


# ---- the real pipelines -----------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_two_stage_run_matches_an_independent_unsplit_reference(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=90)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    assert res.summary["world_size"] == 2 and len(res.summary["checks"]) == 10
    cfg = train.Config()
    model = reference_model(cfg)
    X, Y = batches(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        opt.zero_grad()
        ((model(X[step]) - Y[step]) ** 2).mean().backward()
        opt.step()
    saved = load_checkpoint(tmp_path / "final_params.pt")["params"]
    assert max_diff(saved, dict(model.named_parameters())) < 1e-10
    for m in (1, 2, 4, 8):  # reported beside the formula, never asserted
        fig = res.summary["figures"][f"wall-clock bubble, m={m}"]
        assert fig["expected"] == pytest.approx(1 / (m + 1)) and 0 <= fig["measured"] <= 1
    assert (tmp_path / "timeline.json").is_file()


def _stage_grads(model, stage) -> dict:
    mine = {id(p) for p in stage.parameters()}
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters() if id(p) in mine}


def _four_stages() -> dict:
    """On 4 gloo ranks: every pipeline's gradients for this rank's stage, and the broken ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = train.Config()
    info = _Info(rank, world)
    model = reference_model(cfg)
    X, Y = batches(cfg)
    act_like = torch.empty(cfg.batch_size, cfg.d_hidden, dtype=torch.float64)
    m = cfg.micro_batches
    methods = {
        "naive": lambda s: train.naive_step(s, X[0], Y[0], rank, world, act_like),
        "gpipe": lambda s: train.gpipe_step(s, X[0], Y[0], rank, world, act_like, m),
        "pipe_gpipe": lambda s: train.pipelining_step(s, X[0], Y[0], info, m, ScheduleGPipe),
        "pipe_1f1b": lambda s: train.pipelining_step(s, X[0], Y[0], info, m, Schedule1F1B),
        # Broken 1: GPipe that forgets to scale each micro-batch loss by 1/m.
        "no_1_over_m": lambda s: train.gpipe_step(s, X[0], Y[0], rank, world, act_like, m, loss_scale=1.0),
    }
    out = {}
    for name, step in methods.items():
        copy_ = copy.deepcopy(model)
        stage = train.build_stage(copy_, rank, world)
        out[name] = {"loss": step(stage), "grads": _stage_grads(copy_, stage)}

    # Broken 2: a stage that sends back no gradient (zeros in its place).
    original = train.send_backward
    train.send_backward = lambda grad, r: dist.isend(torch.zeros_like(grad), dst=r - 1)
    try:
        copy_ = copy.deepcopy(model)
        stage = train.build_stage(copy_, rank, world)
        train.gpipe_step(stage, X[0], Y[0], rank, world, act_like, m)
        out["no_grad_sent"] = {"grads": _stage_grads(copy_, stage)}
    finally:
        train.send_backward = original
    return out


class _Info:
    """The fields of common.distributed.DistInfo that pipelining_step reads."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cpu")


def _merge(results: list[dict], name: str) -> dict:
    return {n: g for r in results for n, g in r[name]["grads"].items()}


@pytest.mark.timeout(120)
def test_four_stages_match_the_unsplit_model_and_broken_pipelines_do_not():
    results = run_on_ranks(_four_stages, 4, timeout=90)
    ref_loss, ref_grads = reference_grads(train.Config())
    for name in ("naive", "gpipe", "pipe_gpipe", "pipe_1f1b"):
        assert results[-1][name]["loss"] == pytest.approx(ref_loss, abs=TOL), name
        assert max_diff(_merge(results, name), ref_grads) < TOL, name
    assert max_diff(_merge(results, "no_1_over_m"), ref_grads) > 1e3 * TOL, "missing 1/m went unnoticed"
    assert max_diff(_merge(results, "no_grad_sent"), ref_grads) > 1e3 * TOL, "a lost gradient went unnoticed"


# ---- bad input --------------------------------------------------------------------------------

def test_impossible_settings_are_refused_in_one_sentence(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as e:
        train.parse_config(train.Config, ["--batch-size", "16", "--micro-batches", "3"])
    assert e.value.code == 2
    cfg = train.Config()
    assert "does not split into 5 equal stages" in train.layout_error(cfg, 5)
    assert "at least as many micro-batches as stages" in train.layout_error(train.Config(micro_batches=2), 3)
    assert train.layout_error(cfg, 2) is None and train.layout_error(cfg, 4) is None
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as e:  # plain `python train.py`: a world of one
        train.main(train.Config(out=str(tmp_path)))
    assert "torchrun --standalone --nproc_per_node=2 chapters/ch04_model_parallel/train.py" in str(e.value.code)
    assert not dist.is_initialized()  # torn down in finally


def test_stages_cover_the_model_once():
    model = MLP(4, 8, 1, 12)
    for p in (1, 2, 3, 4, 6):
        stages = [train.build_stage(model, r, p) for r in range(p)]
        ids = [id(q) for s in stages for q in s.parameters()]
        assert ids == [id(q) for q in model.parameters()]
    x = torch.randn(3, 4)
    torch.testing.assert_close(torch.nn.Sequential(*stages)(x), model(x))
    assert F.mse_loss(model(x), torch.zeros(3, 1)) >= 0
