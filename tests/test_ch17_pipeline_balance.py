"""Chapter 17: the partitioner finds the optimum, balanced stages beat uniform ones on a skewed
model, 1F1B holds at most p micro-batches of activations where GPipe holds m (interleaving a
little more), and interleaving shrinks the bubble: all counted, on timelines and in a real run
whose gradients the test checks against its own unsplit reference; wall clock only reported."""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path

import pytest
import torch

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
        best = partition.brute_force_partition(costs, k)[0]
        assert max(partition.stage_costs(costs, bounds)) == best
        assert partition.bisection_optimum(costs, k) == best  # the script's referee, refereed
        floats = [rng.random() for _ in range(n)]
        assert partition.bisection_optimum(floats, k) == pytest.approx(
            partition.brute_force_partition(floats, k)[0], abs=1e-12)
    # a known case: 1..9 in 3 stages -> [1..5] [6, 7] [8, 9], the slowest costs 17
    assert partition.balanced_partition(list(range(1, 10)), 3) == [0, 5, 7, 9]
    assert partition.bisection_optimum(list(range(1, 10)), 3) == 17
    # negative control: a cut that is not optimal is caught by the referee
    assert max(partition.stage_costs(list(range(1, 10)), [0, 4, 7, 9])) == 18 > 17


def test_the_referee_scales_to_sixteen_ranks():
    """The script checks its partition at every world; brute force would try C(63, 15) ~ 10^14
    cuts for the default model on 16 ranks, the bisection a few thousand sums."""
    cfg = train.Config()
    costs = [random.Random(p).uniform(0.1, 1.0) for p in range(64)]
    assert len(train.model_widths(cfg, 16)) == 64
    best = max(partition.stage_costs(costs, partition.balanced_partition(costs, 16)))
    assert partition.bisection_optimum(costs, 16) == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_balanced_beats_uniform_on_the_skewed_model(p):
    cfg = train.Config()
    flops = train.block_flops(train.model_widths(cfg, p), cfg.d_model)
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


def test_1f1b_step_is_at_most_the_slowest_stage_bound():
    """The lesson's bound: with forward C_s and backward 2C_s, a 1F1B step lasts at most
    3((m-1) max C + sum C), with equality when the slowest stage is the last one."""
    rng = random.Random(1)
    exact_cases = 0
    for _ in range(300):
        p, m = rng.randint(2, 5), rng.randint(5, 10)
        costs = [rng.choice([1, 2, 3, 5, 8]) for _ in range(p)]
        span = max(e.end for e in simulate(one_f_one_b_order(p, m), costs, [2 * c for c in costs]))
        bound = 3 * ((m - 1) * max(costs) + sum(costs))
        formula, exact = schedules.one_f_one_b_step(costs, m)  # the script's expected value
        assert formula == bound and exact == (costs[-1] == max(costs))
        assert span <= bound, (p, m, costs)
        if exact:
            exact_cases += 1
            assert span == bound, (p, m, costs)
            # negative control: a timeline whose backward costs what its forward does is off
            half = max(e.end for e in simulate(one_f_one_b_order(p, m), costs, costs))
            assert half != bound, (p, m, costs)
    assert exact_cases > 50


def test_exercise_answers_partitions():
    """Exercise 2: the heavy block first; exercise 4: parameters vs FLOPs on a GPT-2-medium shape."""
    heavy_first = train.block_flops((512, 256, 32, 32, 32, 32, 32, 32), 32)
    assert partition.balanced_partition(heavy_first, 2) == [0, 1, 8]
    assert partition.uniform_partition(8, 2) == [0, 4, 8]
    # d = 1024, 24 blocks, sequence 1024, vocabulary 50257, untied embedding and LM head
    d, vocab, blocks, seq = 1024, 50257, 24, 1024
    params = [vocab * d] + [12 * d * d] * blocks + [vocab * d]
    flops = [0] + [24 * d * d + 4 * seq * d] * blocks + [2 * vocab * d]  # forward, per token
    by_params, by_flops = partition.balanced_partition(params, 4), partition.balanced_partition(flops, 4)
    assert by_params == [0, 5, 13, 21, 26] and by_flops == [0, 8, 15, 22, 26]
    slow = max(partition.stage_costs(flops, by_params)) / max(partition.stage_costs(flops, by_flops))
    assert round(slow, 3) == 1.143  # the parameter-balanced step is 14% slower


def test_exercise_answer_message_cost_where_interleaving_stops_paying():
    """Exercise 3: a message delay c (in units of one stage's forward; backward = 2) at which
    interleaved 1F1B (v = 2, chunks half a stage) stops beating 1F1B."""
    def spans(p, m, c):
        one_f = max(e.end for e in simulate(one_f_one_b_order(p, m), 1, 2, comm=c))
        inter = max(e.end for e in simulate(schedules.interleaved_order(p, m, 2), Fraction(1, 2), 1, comm=c))
        return one_f, inter
    for p, m, even in ((2, 4, Fraction(5, 8)), (4, 8, Fraction(11, 8))):
        one_f, inter = spans(p, m, 0)
        assert inter < one_f  # free messages: interleaving wins
        one_f, inter = spans(p, m, even - Fraction(1, 8))
        assert inter < one_f
        one_f, inter = spans(p, m, even)
        assert inter == one_f  # break-even
        one_f, inter = spans(p, m, 2 * even)
        assert inter > one_f


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
    # the memory price: rank r holds (2(p-r-1) + (v-1)p + 1)/v stages' worth, rank 0 p + (p-1)/v
    peaks = [schedules.peak_in_flight(events, r, v) for r in range(p)]
    assert peaks == [schedules.interleaved_peak(p, m, v, r) for r in range(p)]
    if m >= 2 * p:
        assert peaks[0] == p + (p - 1) / v > schedules.one_f_one_b_peak(p, m, 0) == p
    # negative control: one chunk per rank is plain 1F1B, no gain
    assert bubble_fraction(simulate(schedules.interleaved_order(p, m, 1)), p) == one_f


def _torch_interleaved_order(p: int, m: int, v: int) -> list:
    """The order torch's ScheduleInterleaved1F1B computes, without a process group (its private
    per-rank planner; the script replays the public `pipeline_order` of a real schedule)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    s = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    s.pp_group_size, s.n_local_stages, s._n_microbatches = p, v, m
    s.number_of_rounds = max(1, m // p)
    s.microbatches_per_round = m // s.number_of_rounds
    s.pipeline_order = {r: s._calculate_single_rank_operations(r) for r in range(p)}
    return schedules.torch_order(s, p)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
def test_torch_interleaved_order_is_megatrons_and_has_its_bubble(p, v):
    for m in (p, 2 * p, 3 * p):
        order = _torch_interleaved_order(p, m, v)
        assert order == schedules.interleaved_order(p, m, v), (p, m, v)
        assert bubble_fraction(simulate(order), p) == schedules.interleaved_bubble_formula(p, m, v)
    # torch's "flexible" rounds also run m that p does not divide, with the same bubble
    m = 2 * p + 2 if p > 2 else 3
    assert m % p and m % max(1, m // p) == 0  # not Megatron's m, but a whole number of rounds
    assert bubble_fraction(simulate(_torch_interleaved_order(p, m, v)), p) == \
        schedules.interleaved_bubble_formula(p, m, v)


def test_interleaved_order_refuses_micro_batches_not_a_multiple_of_ranks():
    with pytest.raises(ValueError, match="multiple of ranks"):
        schedules.interleaved_order(4, 6, 2)


# ---- the real run -----------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_two_rank_run_counts_and_matches_an_independent_reference(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=130)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"] and c["kind"] != "timing"]
    assert not failed, res.output[-3000:]
    assert res.returncode == 0  # a slow timing check is reported, never fatal
    cfg, p = train.Config(), 2
    m = train.n_micro_batches(cfg, p)
    assert res.check("GPipe: live activations per rank == m")["measured"] == [m, m]
    assert res.check("1F1B: live activations per rank == min(p-r, m)")["measured"] == [2, 1]
    assert res.check("Interleaved1F1B: live activations per rank == (2(p-r-1)+(v-1)p+1)/v")["measured"] == [2.5, 1.5]
    assert res.check("torch's interleaved order: bubble (counted) == (p-1)/(vm+p-1)")["measured"] == \
        pytest.approx(1 / 9, abs=1e-12)
    figs = res.summary["figures"]
    assert figs["slowest stage, balanced (FLOPs, counted)"]["measured"] < \
        figs["slowest stage, uniform (FLOPs, counted)"]["measured"]
    # The simulated 1F1B steps against their closed form, recomputed here from the widths: the
    # optimum by brute force (not the script's DP), the slowest stage last in both cuts.
    flops = train.block_flops(train.model_widths(cfg, p), cfg.d_model)
    for label, bounds in (("uniform", [0, 4, 8]), ("balanced", partition.brute_force_partition(flops, p)[1])):
        c = partition.stage_costs(flops, bounds)
        assert c[-1] == max(c)
        check = res.check(f"simulated 1F1B step, {label} (FLOPs) == 3((m-1) max C + sum C)")
        assert check["measured"] == check["expected"] == 3 * ((m - 1) * max(c) + sum(c)), label
    # The bubbles, each counted on its own schedule's timeline (GPipe's on GPipe's).
    for kind, v in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", cfg.chunks)):
        assert figs[f"{kind} bubble (counted)"]["measured"] == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert res.check("GPipe bubble (counted) == (p-1)/(m+p-1)")["ok"]
    assert res.check("GPipe timeline: live activations per rank == m")["measured"] == [m, m]
    for kind in train.SCHEDULES:  # wall clock: reported beside the simulator's lower bound, never asserted
        assert figs[f"{kind} step, balanced"]["measured"] > 0 and figs[f"{kind} step, balanced"]["expected"] > 0
    # the reference, computed here: unsplit blocks, plain autograd
    model = train.build_blocks(train.model_widths(cfg, p), cfg.d_model, cfg.seed)
    X, Y = regression_data(m * cfg.micro_batch_size, cfg.d_model, cfg.d_model, seed=cfg.seed, dtype=torch.float64)
    loss = ((model(X) - Y) ** 2).mean()
    names = [n for n, _ in model.named_parameters()]
    ref = dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))
    saved = load_checkpoint(tmp_path / "grads.pt")
    assert set(saved) == {*train.SCHEDULES, "control: 1F1B without 1/m"}
    for kind, grads in saved.items():
        assert grads.keys() == ref.keys(), f"{kind}: every parameter has a gradient"
        scale = m if kind.startswith("control") else 1  # the control forgot the 1/m: m times too large
        assert max((grads[n] - scale * ref[n]).abs().max().item() for n in ref) < 1e-12, kind
        if scale != 1:
            assert max((grads[n] - ref[n]).abs().max().item() for n in ref) > 1e-3, "control = reference"


def test_impossible_settings_are_refused_in_one_sentence(capsys):
    cfg = train.Config()
    for world in (2, 3, 4, 8, 16):
        train.validate(cfg, world)  # the defaults: m = 2 x ranks, 4 blocks per rank
    with pytest.raises(ValueError, match="multiple of the 4 ranks"):
        train.validate(train.Config(micro_batches=6), 4)
    with pytest.raises(ValueError, match="cannot fill 4 ranks x 3 chunks"):
        train.validate(train.Config(widths=(32,) * 8, chunks=3), 4)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        train.validate(cfg, 1)
    for argv, world in ((["--widths", "0"], 2), ([], 1), (["--micro-batches", "3"], 2),
                        (["--device", "cuda", "--backend", "gloo"], 2)):
        with pytest.raises(SystemExit) as e:
            train.parse_config(train.Config, argv, validate=train.validate, world_size=world)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "torchrun --standalone --nproc_per_node=2 chapters/ch17_pipeline_balance/train.py" in err
    assert "gloo cannot carry" in err
    assert len([line for line in err.splitlines() if line.strip()]) == 4, "one line per refusal"
