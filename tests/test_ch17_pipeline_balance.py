"""Chapter 17: the partitioner finds the optimum, balanced stages beat uniform ones on a skewed
model, 1F1B holds at most p micro-batches of activations where GPipe holds m, and interleaving
shrinks the bubble: all counted, on timelines and in a real run; wall clock only reported."""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch04_model_parallel.schedule import (
    bubble_fraction,
    gpipe_order,
    one_f_one_b_order,
    simulate,
)
from chapters.ch17_pipeline_balance import partition, schedules, train
from common.checkpoint import load_checkpoint
from common.data import regression_data
from common.launch import run_torchrun

SCRIPT = Path(train.__file__)


# ---- the partitioner --------------------------------------------------------------------------

def test_balanced_partition_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([1, 2, 3, 5, 8, 13, 40]) for _ in range(n)]
        bounds = partition.balanced_partition(costs, k)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == k + 1
        assert all(a < b for a, b in zip(bounds, bounds[1:])), "every stage gets a layer"
        assert max(partition.stage_costs(costs, bounds)) == partition.brute_force_partition(costs, k)[0]
    # a known case: 1..9 in 3 stages -> [1..5] [6, 7] [8, 9], the slowest costs 17
    assert partition.balanced_partition(list(range(1, 10)), 3) == [0, 5, 7, 9]


@pytest.mark.parametrize("p", [2, 4])
def test_balanced_beats_uniform_on_the_skewed_model(p):
    flops = train.block_flops(train.Config())
    uniform, balanced = partition.uniform_partition(len(flops), p), partition.balanced_partition(flops, p)
    worst = {k: max(partition.stage_costs(flops, b)) for k, b in (("u", uniform), ("b", balanced))}
    assert worst["b"] < worst["u"]
    spans = {}
    for k, b in (("u", uniform), ("b", balanced)):
        c = partition.stage_costs(flops, b)
        spans[k] = max(e.end for e in simulate(one_f_one_b_order(p, 8), c, [2 * x for x in c]))
    assert spans["b"] < spans["u"], "the simulated 1F1B step is shorter with balanced stages"
    # negative control: with equal layers there is nothing to balance
    equal = [1.0] * len(flops)
    assert max(partition.stage_costs(equal, partition.balanced_partition(equal, p))) == \
        max(partition.stage_costs(equal, partition.uniform_partition(len(equal), p)))


# ---- schedules, counted -----------------------------------------------------------------------

@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_1f1b_holds_at_most_p_micro_batches_gpipe_holds_m(p, m):
    gpipe, one_f = simulate(gpipe_order(p, m)), simulate(one_f_one_b_order(p, m))
    assert max(schedules.peak_in_flight(gpipe, r) for r in range(p)) == m
    assert [schedules.peak_in_flight(one_f, r) for r in range(p)] == [p - r for r in range(p)]


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaving_shrinks_the_counted_bubble(p, m, v):
    one_f = bubble_fraction(simulate(one_f_one_b_order(p, m)), p)
    events = simulate(schedules.interleaved_order(p, m, v))
    inter = bubble_fraction(events, p)
    assert inter < one_f == Fraction(p - 1, m + p - 1)
    assert inter == Fraction(p - 1, v * m + p - 1)
    assert {e.stage % p for e in events if e.rank == 1} == {1}, "rank r holds stages r, r+p, ..."
    # negative control: one chunk per rank is plain 1F1B, no gain
    assert bubble_fraction(simulate(schedules.interleaved_order(p, m, 1)), p) == one_f


def test_interleaved_order_refuses_micro_batches_not_a_multiple_of_ranks():
    with pytest.raises(ValueError, match="multiple of ranks"):
        schedules.interleaved_order(4, 6, 2)


# ---- the real run -----------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_two_rank_run_counts_and_matches_an_independent_reference(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=100)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"] and c["kind"] != "timing"]
    assert not failed, res.output[-3000:]
    assert res.returncode == 0  # a slow timing check is reported, never fatal
    cfg = train.Config()
    assert res.check("GPipe: live activations peak at m micro-batches")["measured"] == cfg.micro_batches
    assert res.check("1F1B: live activations peak at <= p micro-batches")["measured"] <= 2
    assert res.check("torch's interleaved order: bubble (counted) < 1F1B")["ok"]
    figs = res.summary["figures"]
    assert figs["slowest stage, balanced (FLOPs)"]["measured"] < figs["slowest stage, uniform (FLOPs)"]["measured"]
    for kind in train.SCHEDULES:  # wall clock: reported, never asserted
        assert figs[f"{kind} step, balanced"]["measured"] > 0
    # the reference, computed here: unsplit blocks, plain autograd
    model = train.build_blocks(cfg)
    X, Y = regression_data(cfg.batch_size, cfg.d_model, cfg.d_model, seed=cfg.seed, dtype=torch.float64)
    loss = ((model(X) - Y) ** 2).mean()
    names = [n for n, _ in model.named_parameters()]
    ref = dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))
    saved = load_checkpoint(tmp_path / "grads.pt")
    for kind, grads in saved.items():
        assert grads.keys() == ref.keys(), f"{kind}: every parameter has a gradient"
        assert max((grads[n] - ref[n]).abs().max().item() for n in ref) < 1e-12, kind


def test_impossible_settings_are_refused_in_one_sentence(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as e:
        train.parse_config(train.Config, ["--micro-batches", "3"])
    assert e.value.code == 2
    assert "multiple of 4 ranks" in train.layout_error(train.Config(micro_batches=2), 4)
    assert "cannot fill 4 ranks x 3 chunks" in train.layout_error(train.Config(chunks=3), 4)
    assert train.layout_error(train.Config(), 2) is None
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as e:
        train.main(train.Config(out=str(tmp_path)))
    assert "torchrun --standalone --nproc_per_node=2 chapters/ch17_pipeline_balance/train.py" in str(e.value.code)
    assert not dist.is_initialized()
