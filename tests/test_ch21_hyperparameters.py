"""Chapter 21: schedules equal their formulas; the noise scale from data parallelism's norms
equals the per-example value; steps to target flatten beyond the critical batch.

The references here are the test's own: schedules written out again, per-example gradients
from a plain autograd loop (not the script's vmap), and a fit on numbers built from the law.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch21_hyperparameters import schedules as S
from chapters.ch21_hyperparameters import train
from common.launch import run_on_ranks, run_python, run_torchrun
from common.results import check_ok

SCRIPT = Path(train.__file__)


@pytest.mark.timeout(30)
def test_schedules_equal_their_formulas_and_a_shift_is_rejected():
    peak, T, w, lo = 3e-4, 1000, 100, 3e-5
    for s in (0, 49, 99, 100, 300, 550, 999, 1000):
        cos = peak * (s + 1) / w if s < w else lo + (peak - lo) * (1 + math.cos(math.pi * (s - w) / (T - w))) / 2
        assert abs(S.cosine(s, peak, T, w, lo) - cos) <= 1e-18
        d = 200
        wsd = peak * (s + 1) / w if s < w else peak if s < T - d else peak - (peak - lo) * (s - T + d) / d
        assert abs(S.wsd(s, peak, T, w, d, lo) - wsd) <= 1e-18
    assert S.sqrt_scaled(0.1, 400, 100) == pytest.approx(0.2, abs=1e-16)
    assert S.linear_scaled(0.1, 400, 100) == pytest.approx(0.4, abs=1e-16)
    lrs = S.torch_cosine_lrs(1.0, 100, 10, 0.1)
    assert max(abs(a - S.cosine(s, 1.0, 100, 10, 0.1)) for s, a in enumerate(lrs)) <= 1e-12
    # the negative control: a warm-up that starts at 0 (step/warmup) fails the same bound
    shifted = [s / 10 if s < 10 else S.cosine(s, 1.0, 100, 10, 0.1) for s in range(101)]
    assert not check_ok(max(abs(a - b) for a, b in zip(lrs, shifted)), 0.0, 1e-12)


def _per_example_reference(w, x, y) -> float:
    """B_simple from per-example gradients, each from its own autograd call."""
    grads = []
    for xi, yi in zip(x, y):
        wi = w.clone().requires_grad_(True)
        grads.append(torch.autograd.grad((xi @ wi - yi) ** 2, wi)[0])
    g = torch.stack(grads)
    n, mean = len(g), g.mean(0)
    tr = sum(((gi - mean) ** 2).sum().item() for gi in g) / (n - 1)
    return tr / ((mean @ mean).item() - tr / n)


def _norms_on_ranks(micro: int) -> dict:
    cfg = train.Config(micro_batch_size=micro)
    gen = torch.Generator().manual_seed(3)
    x, y = train.sample(cfg, cfg.global_batch_size, gen)
    w = 0.3 * train.teacher(cfg)
    _, small, big, _ = train.dp_step_norms(w, x, y, cfg, dist.get_rank(), dist.get_world_size())
    return {"small": small, "big": big, "x": x, "y": y, "w": w}


@pytest.mark.timeout(90)
def test_noise_scale_from_rank_norms_equals_per_example_value():
    res = run_on_ranks(_norms_on_ranks, 2, 1, timeout=80)[0]
    B = len(res["y"])
    exact = _per_example_reference(res["w"], res["x"], res["y"])
    est = train.noise_scale(res["small"], res["big"], 1, B)["b_simple"]
    assert check_ok(abs(est / exact - 1), 0.0, train.GNS_TOLERANCE), (est, exact)
    # negative control: the big-batch norm alone as |G|^2 is biased by tr(Sigma)/B
    tr = train.noise_scale(res["small"], res["big"], 1, B)["trace"]
    assert not check_ok(abs(tr / res["big"] / exact - 1), 0.0, train.GNS_TOLERANCE)
    assert abs(tr / res["big"] / exact - 1) > 0.1


@pytest.mark.timeout(30)
def test_critical_batch_fit_recovers_the_law():
    steps = {b: 40 * (1 + 25 / b) for b in (1, 4, 16, 64, 256)}
    s_min, b_crit = train.fit_critical_batch(steps)
    assert s_min == pytest.approx(40, rel=1e-10) and b_crit == pytest.approx(25, rel=1e-10)


@pytest.mark.timeout(30)
def test_validate_refuses_uneven_micro_batches():
    with pytest.raises(ValueError, match="multiple of 16"):
        train.validate(train.Config(global_batch_size=40), 16)
    with pytest.raises(ValueError, match="at least two micro-batches"):
        train.validate(train.Config(global_batch_size=4, micro_batch_size=4), 1)


@pytest.mark.timeout(120)
def test_torchrun_two_ranks_passes_its_checks():
    run = run_torchrun(SCRIPT, 2, timeout=110)
    gns = run.check("B_simple from DP norms == per-example exact (rel.)")
    assert gns["ok"] and gns["measured"] <= 1e-12
    assert run.check("big-batch norm alone differs (biased, control)")["measured"] > 0.1
    assert run.check("doubling the largest batch: steps gain < 1.3x")["ok"]
    b_crit = run.summary["figures"]["fitted B_crit"]
    assert 0.3 < b_crit["measured"] / b_crit["expected"] < 3  # the knee near the noise scale


TUNE = Path(train.__file__).with_name("tune.py")


@pytest.mark.timeout(30)
def test_asha_by_hand_stops_by_the_quantile_rule_and_fifo_stops_none():
    from chapters.ch21_hyperparameters import tune

    cfg = tune.Config()
    order = tune.grid_order(cfg)
    made = tune.asha_by_hand(cfg, order)
    assert sorted(made) == sorted(tune.lr_grid(cfg)) and made[order[0]] == cfg.max_t  # first: no rival
    assert all(t in (1, 3, 9) for t in made.values())  # a trial stops only at a rung
    assert sum(t < cfg.max_t for t in tune.asha_by_hand(cfg, order, early_stopping=False).values()) == 0
    lo, hi = tune.known_region(cfg)
    assert lo < tune.best_lr(cfg) < hi and tune.rho(tune.best_lr(cfg), cfg) == pytest.approx(0.6, abs=1e-15)
    # the loss formula is gradient descent's own: 5 steps of the script's reference
    assert tune.loss_after(0.3, 5, cfg) == pytest.approx(tune.reference_loss(cfg, 0.3, 5), rel=1e-12)


@pytest.mark.timeout(150)
def test_ray_tune_asha_and_torch_trainer_pass_their_checks():
    run = run_python(TUNE, timeout=140)  # one launch: Ray, the ASHA search, the TorchTrainer
    assert run.check("ASHA: trials stopped early (> half)")["measured"] > 6
    assert run.check("FIFO (no early stopping): stopped early (control)")["measured"] == 0
    assert run.check("Ray's ASHA == ASHA by hand (trials that differ)")["measured"] == 0
    assert run.check("ASHA by hand, ascending order, differs (control)")["measured"] > 0
    assert run.check("TorchTrainer workers reporting")["measured"] == 2
    assert run.check("TorchTrainer DDP weights == one process (max abs)")["ok"]
    # the halves differ: training on one alone, or summing their gradients, ends far away
    assert run.check("one half without the all-reduce differs (control)")["measured"] > 0.1
    assert run.check("summed, not averaged, gradients differ (control)")["measured"] > 1e3
    best = run.check("best trial: rho(lr) <= rho* + slack")
    assert best["ok"] and best["measured"] == pytest.approx(0.6, abs=1e-12)  # lr* itself
    assert not run.check("worst trial: rho(lr) > rho* + slack (control)")["measured"] <= 0.7
