"""Chapter 21: schedules equal their formulas; the noise scale from data parallelism's norms
equals the per-example value, and both noise scales match their closed forms.

The references here are the test's own: schedules written out again, per-example gradients
from a plain autograd loop (not the script's vmap), the closed forms checked against a million
per-example gradients sampled here, and a fit on numbers built from the law.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch21_hyperparameters import schedules as S
from chapters.ch21_hyperparameters import train
from chapters.ch21_hyperparameters.checks import CLOSED_FORM_TOLERANCE, PARTS
from chapters.ch21_hyperparameters.problem import (
    closed_form_noise_scales,
    feature_scales,
    target_point,
    teacher,
)
from chapters.ch21_hyperparameters.scaling import fit_critical_batch, scaling_experiment
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
    w = 0.3 * teacher(cfg)
    n = train.dp_step_norms(w, x, y, cfg, dist.get_rank(), dist.get_world_size())
    # the scaling experiment splits the batch sizes over the ranks: with one size, rank 1 gets
    # none and must still take part in the gather
    uneven = scaling_experiment(train.Config(batch_sizes="8", max_steps=200), dist.get_rank(),
                                dist.get_world_size())
    return {"small": n.small_sq, "big": n.big_sq, "x": x, "y": y, "w": w, "uneven": uneven}


@pytest.mark.timeout(90)
def test_noise_scale_from_rank_norms_equals_per_example_value():
    results = run_on_ranks(_norms_on_ranks, 2, 1, timeout=80)
    res = results[0]
    B = len(res["y"])
    exact = _per_example_reference(res["w"], res["x"], res["y"])
    est = train.noise_scale(res["small"], res["big"], 1, B)["b_simple"]
    assert check_ok(abs(est / exact - 1), 0.0, train.GNS_TOLERANCE), (est, exact)
    # negative control: the big-batch norm alone as |G|^2 is biased by tr(Sigma)/B
    tr = train.noise_scale(res["small"], res["big"], 1, B)["trace"]
    assert not check_ok(abs(tr / res["big"] / exact - 1), 0.0, train.GNS_TOLERANCE)
    assert abs(tr / res["big"] / exact - 1) > 0.1
    # a rank with no batch size to run: the gathered table is one process's
    alone = scaling_experiment(train.Config(batch_sizes="8", max_steps=200), 0, 1)
    assert alone["table"][8]["best_steps"] > 0
    assert all(r["uneven"]["table"] == alone["table"] for r in results)  # rank 1 ran nothing


def _sampled_noise_scales(cfg, w, n: int = 1_000_000, chunk: int = 250_000) -> dict:
    """B_simple, B_noise and their parts from n per-example gradients drawn here:
    g = 2x(x.e - eps) with x ~ N(0, diag(v)), eps ~ N(0, sigma^2), e = w - w*; Sigma and G from
    the sample (unbiased), H = 2 diag(v)."""
    gen = torch.Generator().manual_seed(11)
    v = feature_scales(cfg) ** 2
    h, e = 2 * v, w - teacher(cfg)
    s_g, s_sq, s_h = torch.zeros(cfg.d, dtype=torch.float64), 0.0, 0.0
    for _ in range(n // chunk):
        x = torch.randn(chunk, cfg.d, dtype=torch.float64, generator=gen) * v.sqrt()
        eps = cfg.label_noise * torch.randn(chunk, dtype=torch.float64, generator=gen)
        g = 2 * x * (x @ e - eps)[:, None]
        s_g, s_sq, s_h = s_g + g.sum(0), s_sq + (g * g).sum().item(), s_h + (g * g * h).sum().item()
    G = s_g / n
    tr, tr_h = (s_sq / n - G @ G) * n / (n - 1), (s_h / n - G @ (h * G)) * n / (n - 1)
    g2, g2_h = G @ G - tr / n, G @ (h * G) - tr_h / n
    return {"b_simple": (tr / g2).item(), "b_noise": (tr_h / g2_h).item(), "g2": g2.item(),
            "trace": tr.item(), "g2_h": g2_h.item(), "trace_h": tr_h.item()}


@pytest.mark.timeout(60)
def test_closed_form_noise_scales_match_a_large_sample():
    """The closed forms B_simple = 1 + L tr V/(e^T V^2 e), B_noise = 1 + L tr V^2/(e^T V^3 e)
    and their parts (|G|^2 = 4 e'V^2 e, tr Sigma = 4(L tr V + e'V^2 e), G'HG = 8 e'V^3 e,
    tr(H Sigma) = 8(L tr V^2 + e'V^3 e)), at the target point, against 10^6 per-example
    gradients (measured: the ratios within 0.16 %, the parts within 0.21 %). The review's
    numbers, 17.50 and 13.95, are the defaults'. Dropping the rank-one term of Sigma (the '1 +',
    and e'V^k e in the traces) is off by 5.9-7.8 % and fails the same 2 % bound."""
    cfg = train.Config()
    w = target_point(cfg)
    v, e = feature_scales(cfg) ** 2, w - teacher(cfg)
    assert (e * e * v).sum().item() + cfg.label_noise**2 == pytest.approx(cfg.target_loss, rel=1e-12)
    closed = closed_form_noise_scales(cfg, w)
    assert round(closed["b_simple"], 2) == 17.50 and round(closed["b_noise"], 2) == 13.95
    sampled = _sampled_noise_scales(cfg, w)
    for key in ("b_simple", "b_noise", "g2", "trace", "g2_h", "trace_h"):
        assert check_ok(sampled[key], closed[key], 0.02, relative=True), (key, sampled, closed)
    # the control: the same forms without the rank-one term V e e^T V of Sigma
    assert not check_ok(sampled["b_simple"], closed["b_simple"] - 1, 0.02, relative=True)
    assert not check_ok(sampled["b_noise"], closed["b_noise"] - 1, 0.02, relative=True)
    assert not check_ok(sampled["trace"], closed["trace"] - closed["g2"], 0.02, relative=True)
    assert not check_ok(sampled["trace_h"], closed["trace_h"] - closed["g2_h"], 0.02, relative=True)


@pytest.mark.timeout(30)
def test_critical_batch_fit_recovers_the_law():
    steps = {b: 40 * (1 + 25 / b) for b in (1, 4, 16, 64, 256)}
    s_min, b_crit = fit_critical_batch(steps)
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
    # both noise scales measured at the target point against the closed forms, within 10 %;
    # the biased estimate misses by more than that
    for name, value in (("B_simple", 17.4953), ("B_noise", 13.9511)):
        check = run.check(f"{name} at target, DP estimator == closed form (rel.)")
        assert check["ok"] and check["expected"] == pytest.approx(value, abs=1e-4)
        assert check["tolerance"] == CLOSED_FORM_TOLERANCE == 0.1 and check["relative"]
    # and the four parts each ratio is made of (a ratio alone lets its parts' errors cancel:
    # a metric 2·std instead of 2·var moved B_noise by 6.9 % but tr(H Sigma) by 24 %)
    closed = closed_form_noise_scales(train.Config(), target_point(train.Config()))
    for key, name in PARTS:
        check = run.check(f"{name} (DP estimator, rel.)")
        assert check["ok"] and check["expected"] == pytest.approx(closed[key], rel=1e-12)
        assert check["tolerance"] == 0.1 and check["relative"]
    biased = run.check("B_simple, big-batch norm alone: off the closed form (control)")
    assert biased["ok"] and biased["measured"] > 0.2
    biased = run.check("|G|^2 and G'HG, big-batch norms alone: off (control, the smaller)")
    assert biased["ok"] and biased["measured"] > 0.2
    # the metric of standard deviations: the ratio B_noise moves by less than the tolerance,
    # tr(H Sigma) by more; only the parts' check rejects it
    wrong = run.check("tr(H Sigma), metric 2·std for 2·var: off (control)")
    assert wrong["ok"] and wrong["measured"] > 0.2
    moved = run.summary["figures"]["B_noise, metric 2·std for 2·var: off the closed form (rel.)"]
    assert moved["measured"] < CLOSED_FORM_TOLERANCE
    # the knee is a figure beside B_noise, not a check (one noisy run per point; the lesson)
    b_crit = run.summary["figures"]["fitted B_crit (expected: B_noise at target)"]
    assert b_crit["expected"] == pytest.approx(13.9511, abs=1e-4)
    assert not [c for c in run.summary["checks"] if "gain" in c["name"]]
    # linear scaling from batch 1's best rate (0.0625) reaches the stability edge at 16
    assert run.summary["figures"]["linear-scaled lr: steps per batch size"]["measured"][5:] == \
        [None] * 5


TUNE = Path(train.__file__).with_name("tune.py")


@pytest.mark.timeout(30)
def test_asha_by_hand_stops_by_the_quantile_rule_and_fifo_stops_none():
    from chapters.ch21_hyperparameters import quadratic, tune, tune_checks

    cfg = tune.Config()
    order = quadratic.grid_order(cfg)
    made = tune_checks.asha_by_hand(cfg, order)
    assert sorted(made) == sorted(quadratic.lr_grid(cfg)) and made[order[0]] == cfg.max_t  # first: no rival
    assert all(t in (1, 3, 9) for t in made.values())  # a trial stops only at a rung
    assert sum(t < cfg.max_t for t in tune_checks.asha_by_hand(cfg, order, early_stopping=False).values()) == 0
    lo, hi = quadratic.known_region(cfg)
    assert lo < quadratic.best_lr(cfg) < hi and quadratic.rho(quadratic.best_lr(cfg), cfg) == pytest.approx(0.6, abs=1e-15)
    # the loss formula is gradient descent's own: 5 steps of the script's reference
    assert quadratic.loss_after(0.3, 5, cfg) == pytest.approx(tune_checks.reference_loss(cfg, 0.3, 5), rel=1e-12)


@pytest.mark.timeout(30)
def test_asha_replay_follows_the_arrival_order_and_ignores_a_stopped_trials_results():
    """Trials that run at the same time: ASHA decides on results in the order they arrive.
    Worked by hand (reduction factor 2: below the median of the rung's earlier rewards, stop)."""
    from chapters.ch21_hyperparameters import tune_checks

    # b reaches rung 1 first; a, worse, is stopped there; its rung-2 result (already on its
    # way) is ignored; c (rung 1 median of b and a: -1.5) continues; at max_t all end
    events = [("b", 1, 1.0), ("a", 1, 2.0), ("a", 2, 1.5), ("b", 2, 0.5), ("c", 1, 0.1),
              ("b", 3, 0.2), ("c", 2, 0.05), ("c", 3, 0.01)]
    assert tune_checks.asha_replay(events, 1, 2, 3) == {"a": 1, "b": 3, "c": 3}
    # the same results with a's first report first: a has no rival at rung 1, nor at rung 2
    swapped = [("a", 1, 2.0), ("b", 1, 1.0), ("a", 2, 1.5), ("b", 2, 0.5), ("a", 3, 1.2),
               ("b", 3, 0.2)]
    assert tune_checks.asha_replay(swapped, 1, 2, 3) == {"a": 3, "b": 3}
    # without stopping, a is not stopped either (its results end at 2: it has not ended)
    assert tune_checks.asha_replay(events, 1, 2, 3, early_stopping=False) == {"b": 3, "c": 3}
    # a diverging loss (inf) is the worst reward, never a NaN in the quantile
    assert tune_checks.asha_replay([("b", 1, 1.0), ("d", 1, math.inf)], 1, 2, 3) == {"d": 1}
    # a late result of a stopped trial does not count: a's good rung-2 loss must not stop b
    late = [("b", 1, 1.0), ("a", 1, 2.0), ("a", 2, 0.01), ("b", 2, 0.5), ("b", 3, 0.2)]
    assert tune_checks.asha_replay(late, 1, 2, 3) == {"a": 1, "b": 3}
    # reduction factor 3: the cutoff is the 2/3 quantile of the rung's earlier rewards: b (-2)
    # stops behind a (-1); c (-1.5) stops too, below -1.33 of (-1, -2), where the 1/3
    # quantile (-1.67) would let it pass
    three = [("a", 1, 1.0), ("b", 1, 2.0), ("c", 1, 1.5)]
    assert tune_checks.asha_replay(three, 1, 3, 9) == {"b": 1, "c": 1}


@pytest.mark.timeout(30)
def test_tune_config_refuses_trials_that_cannot_start():
    from chapters.ch21_hyperparameters import quadratic, tune

    with pytest.raises(ValueError, match="above 0"):
        tune.Config(driver_cpus=0)
    with pytest.raises(ValueError, match="never start"):
        tune.Config(worker_cpus=1.0)  # 0.2 + 2 x 1.0 > 2 CPUs
    with pytest.raises(ValueError, match="integers k"):
        tune.Config(trials="0,x")
    lrs = quadratic.trial_lrs(tune.Config())
    assert lrs[0] == quadratic.best_lr(tune.Config()) and quadratic.rho(lrs[1], tune.Config()) > 1


@pytest.mark.timeout(300)
def test_ray_tune_searches_and_torch_trainer_trials_under_asha():
    """The chapter's heavy test, one launch of Ray (measured 119 s on a quiet 2-core machine,
    202 s at a load of 10; the issue's budget is 180 s, the timeout only a guard against a
    hang). First the 12-trial search
    under ASHA and under Tune's FIFOScheduler on the same grid and order; then Tune trials that
    are each a 2-worker TorchTrainer, one at a time, under ASHA (grace 1, reduction factor 2,
    max_t 3). The script's default is four such trials; the test runs the first three (lr*, the
    diverging 2^(4/3) lr*, lr*/2), which already show both of ASHA's stops and a release (a Ray
    Train V2 trial starts eight processes: Tune's function, a queue, the controller, the
    placement-group cleaner, the synchronisation actor, the dataset manager and the two
    training workers)."""
    run = run_python(TUNE, ["--trials", "0,4,-3"], timeout=290)
    assert run.check("ASHA: trials stopped early (> half)")["measured"] > 6
    # Tune's own FIFOScheduler on the same grid stops none: the "> half" bound fails on it
    fifo = run.check("FIFOScheduler, same grid: stopped early (control)")
    assert fifo["measured"] == 0 and not check_ok(fifo["measured"], 6, compare=">")
    assert run.summary["figures"]["ASHA reports / reports without stopping"]["expected"] == 1.0
    assert run.check("Ray's ASHA == ASHA by hand (trials that differ)")["measured"] == 0
    assert run.check("ASHA by hand, ascending order, differs (control)")["measured"] > 0
    best = run.check("best trial: rho(lr) <= rho* + slack")
    assert best["ok"] and best["measured"] == pytest.approx(0.6, abs=1e-12)  # lr* itself
    assert not run.check("worst trial: rho(lr) > rho* + slack (control)")["measured"] <= 0.7
    # the trials that are training runs: 3 ran, every report from 2 DDP workers
    assert run.check("TorchTrainer trials that ran (of --trials)")["measured"] == 3
    reports = run.check("reports with 2 DDP workers (of all reports)")
    assert reports["ok"] and reports["measured"] >= 4
    assert run.check("DDP weights == one process, every report (max rel.)")["ok"]
    # the halves differ: training on one alone, or summing their gradients, ends far away
    assert run.check("one half without the all-reduce differs (control)")["measured"] > 0.1
    assert run.check("summed, not averaged, gradients differ (control)")["measured"] > 1
    # ASHA stopped the diverging trial at rung 1 and lr*/2 at rung 2 (behind lr*), as the hand
    # rule on Tune's order says
    assert run.check("ASHA stopped TorchTrainer trials (>= 1)")["measured"] == 2
    assert run.check("diverging trials stopped at the first rung (of diverging)")["measured"] == 1
    assert run.check("Ray's ASHA == ASHA by hand on Tune's result order (trials that differ)")["ok"]
    assert run.check("same replay without stopping differs (control)")["measured"] > 0
    # ... and their resources were released: both stopped trials' workers DEAD in Ray's GCS
    # because their owner died (Ray ended them with the trial), before their group was removed;
    # the diverging trial's group REMOVED when the next trial, which needs the whole machine,
    # first reported
    ended = run.check("stopped trials' workers DEAD (OWNER_DIED) before their group was removed (GCS)")
    assert ended["ok"] and ended["measured"] == 2
    released = run.check("stopped trials' placement groups REMOVED when the next trial reports (GCS)")
    assert released["ok"] and released["measured"] == 1
    control = run.check("the reporting trial's own group in the same snapshots: REMOVED (control)")
    assert control["ok"] and control["measured"] == 0
    assert run.check("placement groups not REMOVED after the search (GCS)")["ok"]
    rows = run.summary["figures"]["TorchTrainer trials (table)"]["measured"]
    assert [r["last_iteration"] for r in rows] == [3, 1, 2]
    assert all(r["workers_dead"] == 2 and r["workers_alive_at_removal"] == 0 for r in rows)
