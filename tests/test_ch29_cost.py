"""Chapter 29: the cost planner's worked examples against hand arithmetic, Young's and Daly's
intervals against a numeric minimisation of their models, a simulated spot run against the
expected-waste model (with negative controls), and the seeds split over ranks.

One real torchrun launch (two ranks) and one start of three gloo ranks; the rest in process.
"""

from __future__ import annotations

import json
import math

import pytest

from chapters.ch29_cost import checks as K
from chapters.ch29_cost import cost as C
from chapters.ch29_cost import train as T
from chapters.ch29_cost import waste as W
from common.launch import REPO_ROOT, run_on_ranks, run_torchrun

SCRIPT = REPO_ROOT / "chapters" / "ch29_cost" / "train.py"
H = 3600.0


@pytest.mark.timeout(30)
def test_worked_examples_against_hand_arithmetic():
    # 7B on 1T tokens: 6 * 7e9 * 1e12 = 4.2e22 FLOPs; an H100 at 989e12 FLOP/s and MFU 0.4 does
    # 395.6e12 FLOP/s, so 4.2e22 / 395.6e12 = 1.06168e8 GPU-seconds = 29 491.07 GPU-hours
    flops = C.total_flops(7e9, 1e12)
    assert flops == 4.2e22
    p5 = C.instance("aws-p5.48xlarge")
    assert C.gpu_hours(flops, p5.peak_flops, 0.4) == pytest.approx(4.2e22 / (989e12 * 0.4) / 3600, rel=1e-12)
    assert C.gpu_hours(flops, p5.peak_flops, 0.4) == pytest.approx(29491.07, abs=0.01)
    # on 64 GPUs = 8 machines: 29 491.07 / 64 = 460.8 h = 19.2 days; 460.8 h x 8 x $98.32 = $362 445
    r = C.run_cost(flops, p5, 0.4, 64)
    assert r["machines"] == 8
    assert r["wall_hours"] == pytest.approx(29491.07 / 64, abs=1e-3)
    assert r["dollars"] == pytest.approx(29491.07 / 64 * 8 * 98.32, rel=1e-6)
    assert round(r["dollars"]) == 362445
    # spot at 60 % off: 98.32 x 0.4 = 39.328 $/h per machine
    assert C.run_cost(flops, p5, 0.4, 64, spot=True)["dollars"] == pytest.approx(29491.07 / 8 * 39.328, rel=1e-6)
    # attention: 12 * 32 * 4096 * 4096 = 6.44e9 per token against 6N = 4.2e10: x 1.1534
    with_attn = C.total_flops(7e9, 1e12, 32, 4096, 4096)
    assert with_attn == 4.2e22 + 12 * 32 * 4096 * 4096 * 1e12
    assert with_attn / flops == pytest.approx(1.15339, abs=1e-5)
    # Llama 2 (Touvron et al. 2023, table 2): 70B on 2T tokens took 1 720 320 A100-hours;
    # 6 * 70e9 * 2e12 = 8.4e23; / (312e12 * 1 720 320 * 3600) = 0.4347
    assert C.implied_mfu(C.total_flops(70e9, 2e12), 312e12, 1720320) == pytest.approx(0.43472, abs=1e-5)
    # Llama 2 7B: 184 320 A100-hours, 8.4e22 / (312e12 * 184 320 * 3600) = 0.4057
    assert C.implied_mfu(C.total_flops(7e9, 2e12), 312e12, 184320) == pytest.approx(0.40574, abs=1e-5)
    # PaLM's MFU adds attention (12 L d T per token, T = 4096): 70B (L 80, d 8192) x 1.0767,
    # 7B (L 32, d 4096) x 1.1534: both 0.468
    assert C.implied_mfu(C.total_flops(70e9, 2e12, 80, 8192, 4096), 312e12, 1720320) == pytest.approx(0.468, abs=5e-4)
    assert C.implied_mfu(C.total_flops(7e9, 2e12, 32, 4096, 4096), 312e12, 184320) == pytest.approx(0.468, abs=5e-4)
    assert 12 * 80 * 8192 * 4096 / (6 * 70e9) == pytest.approx(0.0767, abs=1e-4)
    # the 2026 list prices the lesson quotes beside the examples: 55.04 / 98.32 = 0.56;
    # p4d 21.957642 = 0.67 x 32.7726
    assert 55.04 / 98.32 == pytest.approx(0.56, abs=5e-3)
    assert 0.67 * 32.7726 == pytest.approx(21.957642, rel=1e-9)
    # 70B on 2T tokens at MFU 0.4 on H100s: 8.4e23 / (989e12 * 0.4) / 3600 = 589 821.4 GPU-hours
    assert C.gpu_hours(8.4e23, 989e12, 0.4) == pytest.approx(589_821.4, abs=0.1)


@pytest.mark.timeout(30)
def test_young_daly_worked_numbers():
    # chapter 13's example: delta = 30 s, M = 86 400 s: sqrt(2 * 30 * 86 400) = 2276.8 s
    assert W.young_interval(30, 86400) == pytest.approx(math.sqrt(5_184_000))
    # the script's default: delta = 180 s, M = 4 h = 14 400 s: Young sqrt(5 184 000) = 2276.8 s
    # = 0.6325 h; Daly: r = 180 / 28 800 = 0.00625, 2276.8 * (1 + 0.079057/3 + 0.00625/9) - 180
    young = math.sqrt(2 * 180 * 14400)
    daly = young * (1 + math.sqrt(0.00625) / 3 + 0.00625 / 9) - 180
    assert W.daly_interval(180, 14400) == pytest.approx(daly, rel=1e-12)
    assert daly / H == pytest.approx(0.5996, abs=1e-4)
    assert W.daly_interval(100, 40) == 40  # delta >= 2M: checkpoint every M


@pytest.mark.timeout(10)
def test_fit_optimum_finds_the_minimum_of_a_known_curve():
    # noise-free a/τ + bτ + c on the grid: the fit returns sqrt(a/b) exactly, and an SE of ~0
    a, b, c = 180.0, 1 / (2 * 4 * H), 0.01
    taus = W.interval_grid(180, 4 * H)
    assert taus[0] == 180 and taus[-1] <= 4 * H < taus[-1] * 2 ** 0.5 and len(taus) == 13
    means = [a / t + b * t + c for t in taus]
    opt, se = W.fit_optimum(taus, means, [1e-6] * len(taus))
    assert opt == pytest.approx(math.sqrt(a / b), rel=1e-9) and se < 1e-4 * opt


@pytest.mark.timeout(120)
def test_optimum_measured_on_the_simulation_is_daly_and_not_the_lost_factor_2():
    """Exercise 2's job (δ = 60 s, M = 2 h), measured in process (one rank; the split over
    ranks is tested with the waste simulation's)."""
    cfg = T.Config(save_s=60, mtbf_h=2, opt_seeds=2000)
    info = type("Info", (), {"rank": 0, "world_size": 1, "device": None})()
    m = K.measured_optimum(cfg, info)
    assert m["taus"] == W.interval_grid(60, 2 * H)
    opt, mtbf = m["optimum_s"], 2 * H
    assert m["se_s"] < 0.03 * opt  # the statistical error the band allows for
    assert abs(W.daly_interval(60, mtbf) - opt) / opt <= K.OPT_BAND
    assert abs(math.sqrt(60 * mtbf) - opt) / opt > K.OPT_BAND  # a factor 2 lost: rejected
    # the smallest simulated mean is not at the edge of the grid: a real interior minimum
    i = min(range(len(m["means"])), key=m["means"].__getitem__)
    assert 2 <= i <= len(m["taus"]) - 3


@pytest.mark.timeout(30)
def test_daly_is_the_minimum_of_the_exact_model_and_young_is_not():
    worst_daly = worst_young = 0.0
    for ratio in K.DALY_GRID:
        exact = W.golden_section(lambda t, r=ratio: W.per_work_rate(t, r, 0.5, 1.0), 1e-8, 10.0)
        worst_daly = max(worst_daly, abs(W.daly_interval(ratio, 1.0) - exact) / exact)
        worst_young = max(worst_young, abs(W.young_interval(ratio, 1.0) - exact) / exact)
        # the wrong factor 2 is rejected at every ratio
        assert abs(math.sqrt(ratio) - exact) / exact > K.DALY_TOL
    assert worst_daly <= K.DALY_TOL
    assert worst_young > K.DALY_TOL  # Young is first order: 17 % off at delta/M = 0.1


@pytest.mark.timeout(30)
def test_segment_time_is_daly_eq_13_and_the_restart_does_not_move_the_optimum():
    # M e^{R/M} (e^{t/M} - 1), by hand for t = 1 h, R = 0.1 h, M = 4 h
    assert W.segment_time(H, 0.1 * H, 4 * H) == pytest.approx(4 * H * math.exp(0.025) * (math.exp(0.25) - 1))
    a = W.golden_section(lambda t: W.per_work_rate(t, 180, 0, 4 * H), 1, 40 * H)
    b = W.golden_section(lambda t: W.per_work_rate(t, 180, 3000, 4 * H), 1, 40 * H)
    assert a == pytest.approx(b, rel=1e-6)


@pytest.mark.timeout(30)
def test_simulated_spot_run_matches_the_model_and_the_control_does_not():
    cfg = T.Config()
    tau = W.daly_interval(cfg.save_s, cfg.mtbf_h * H)
    args = (cfg.work_h * H, tau, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H)
    mean, se = W.mean_and_se(*W.simulate_waste(*args, range(10**6, 10**6 + 8000))[:3])
    model = W.expected_waste(*args)
    assert abs(mean - model) <= K.SIM_SIGMAS * se
    wrong = args[0] * (cfg.save_s / tau + (tau + cfg.restart_s) / args[4])  # whole interval lost
    assert abs(mean - wrong) > K.SIM_SIGMAS * se
    # without failures the waste is exactly the saves: n segments x delta
    n = len(W.segments(args[0], tau))
    assert W.simulate_run(args[0], tau, cfg.save_s, cfg.restart_s, 1e30, 0) - args[0] == pytest.approx(n * cfg.save_s)
    # a different interval (2 tau) is also matched: the model holds off the optimum
    args2 = (args[0], 2 * tau, *args[2:])
    mean2, se2 = W.mean_and_se(*W.simulate_waste(*args2, range(4000))[:3])
    assert abs(mean2 - W.expected_waste(*args2)) <= K.SIM_SIGMAS * se2


@pytest.mark.timeout(30)
def test_failures_during_restarts_are_modelled_and_simulated():
    # At the default R = 600 s, M = 4 h the e^{R/M} factor differs from "restarts never fail"
    # (M + R)(e^{t/M} - 1) by ~0.02 h in 24 h, below the simulation's 4 SE: a simulation whose
    # restarts cannot fail passes the default check. With R = M/2 the two models are ~4 h apart.
    M, R, save = 4 * H, 2 * H, 180.0
    tau = W.daly_interval(save, M)
    args = (24 * H, tau, save, R, M)
    mean, se = W.mean_and_se(*W.simulate_waste(*args, range(2 * 10**6, 2 * 10**6 + 4000))[:3])
    assert abs(mean - W.expected_waste(*args)) <= K.SIM_SIGMAS * se
    # negative control, computed here: each failure costs R once, the restart itself never fails
    never_fail = sum((M + R) * math.expm1((w + save) / M) for w in W.segments(args[0], tau)) - args[0]
    assert abs(mean - never_fail) > K.SIM_SIGMAS * se


@pytest.mark.timeout(30)
def test_a_wait_for_capacity_is_not_restart_time():
    """An hour's wait for capacity after each preemption, with no machine up (nothing can be
    preempted in it): waste = Daly's waste at R + D x E[failures], E[failures] = E[wall] / M.
    The simulation draws no failure during the wait; folding the wait into R (failures strike
    it, the e^{R/M} factor) is the control it rejects."""
    save, R, M, D = 180.0, 600.0, 4 * H, 1 * H
    tau = W.daly_interval(save, M)
    args = (24 * H, tau, save, R, M)
    mean, se = W.mean_and_se(*W.simulate_waste(*args, range(3 * 10**6, 3 * 10**6 + 4000),
                                               wait_s=D)[:3])
    model = W.expected_waste(*args, wait_s=D)
    assert model == pytest.approx(W.expected_waste(*args) + D * W.expected_failures(*args))
    assert abs(mean - model) <= K.SIM_SIGMAS * se
    folded = W.expected_waste(24 * H, tau, save, R + D, M)  # the wait as restart time
    assert abs(mean - folded) > K.SIM_SIGMAS * se
    # E[failures] = E[wall] / M, counted in the simulation: a wait of 1 s draws no random number,
    # so the same seed with and without it differs by 1 s per failure. One segment of t = M with
    # R = 0 has e - 1 expected failures (a task restarted from scratch)
    assert W.expected_failures(M - save, M, save, 0.0, M) == pytest.approx(math.e - 1)
    counts = [round(W.simulate_run(M - save, M, save, 0.0, M, seed, wait_s=1.0)
                    - W.simulate_run(M - save, M, save, 0.0, M, seed)) for seed in range(20000)]
    f_mean, f_se = W.mean_and_se(sum(counts), sum(c * c for c in counts), len(counts))
    assert abs(f_mean - (math.e - 1)) <= K.SIM_SIGMAS * f_se


@pytest.mark.timeout(30)
def test_layout_times_against_hand_arithmetic():
    m = C.Model(7e9, 32, 4096, 4096)
    p5 = C.instance("aws-p5.48xlarge")
    r = C.layout_times(m, p5, 8, 8, 1, 1, 1024, 0.4, alpha=10e-6)
    assert r["n_micro"] == 128
    # compute: 6 * 7e9 * 1024 * 4096 / (64 * 989e12 * 0.4) s
    assert r["compute_s"] == pytest.approx(6 * 7e9 * 1024 * 4096 / (64 * 989e12 * 0.4), rel=1e-12)
    # tp = 8 inside a machine (450 GB/s): 128 micro-batches x 32 layers x 4 all-reduces of
    # 4096 * 4096 * 2 bytes, each 2*7*alpha + 2*7/8 * S / 450e9
    S = 4096 * 4096 * 2
    per = 14 * 10e-6 + 14 / 8 * S / 450e9
    assert r["tp_s"] == pytest.approx(128 * 32 * 4 * per, rel=1e-12)
    # chapter 05's byte count: 8 (t-1)/t * B S h b per layer = the bytes of those 4 all-reduces
    assert r["tp_bytes_per_layer"] == pytest.approx(128 * 4 * 14 / 8 * S, rel=1e-12)
    # dp = 8 ranks 8 apart span machines (50 GB/s per GPU): 2*7*alpha + 2 * 7/8 * (7e9/8 * 2) / 50e9
    assert r["dp_s"] == pytest.approx(14 * 10e-6 + 2 * 7 / 8 * 7e9 / 8 * 2 / 50e9, rel=1e-12)
    assert r["pp_s"] == 0 and r["bubble"] == 0
    # pp = 4: bubble (4-1)/(m+4-1) with m = 1024 / (2 * 1) = 512 micro-batches
    r = C.layout_times(m, p5, 2, 8, 4, 1, 1024, 0.4)
    assert r["bubble"] == pytest.approx(3 / 515)
    with pytest.raises(ValueError, match="does not divide"):
        C.layout_times(m, p5, 3, 1, 1, 1, 1024, 0.4)


@pytest.mark.timeout(30)
def test_spot_break_even_and_priority_preemption_numbers():
    # spot at 0.4 x the price with 22.8 % waste: 0.4 * 1.228 = 0.491; break-even at 1/0.4 - 1 = 150 %
    be = C.spot_break_even(10.0, 4.0, 0.228)
    assert be["cost_ratio"] == pytest.approx(0.4912) and be["break_even_overhead"] == pytest.approx(1.5)
    # job MTBF: 16 machines of 64 h each -> 4 h
    assert W.job_mtbf(64 * H, 16) == 4 * H
    # the lesson's default job: waste fraction at Daly's tau, and a low-priority job preempted
    # every 12 h (same model, M = 12 h)
    cfg = T.Config()
    tau = W.daly_interval(180, 4 * H)
    assert W.expected_waste(24 * H, tau, 180, 600, 4 * H) / (24 * H) == pytest.approx(0.2284, abs=1e-4)
    tau12 = W.daly_interval(180, 12 * H)
    assert W.expected_waste(24 * H, tau12, 180, 600, 12 * H) / (24 * H) == pytest.approx(0.1128, abs=1e-4)
    assert cfg.save_s == 180 and cfg.restart_s == 600 and cfg.mtbf_h == 4


def _rank_sums(seeds: int):
    """Each rank: its share of the seeds, all-reduced, as the script does it."""
    import torch
    import torch.distributed as dist

    cfg = T.Config(seeds=seeds, opt_seeds=300)
    info = type("Info", (), {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                             "device": torch.device("cpu")})()
    tau = W.daly_interval(cfg.save_s, cfg.mtbf_h * H)
    return K.simulate(cfg, info, tau), K.measured_optimum(cfg, info)


@pytest.mark.timeout(120)
def test_seeds_split_over_three_ranks_give_the_one_process_mean():
    cfg = T.Config(seeds=3001)
    tau = W.daly_interval(cfg.save_s, cfg.mtbf_h * H)
    ref = W.simulate_waste(cfg.work_h * H, tau, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H, range(3001))
    results, results_opt = zip(*run_on_ranks(_rank_sums, 3, 3001, timeout=100))
    for s, s2, n, seeds in results:
        assert n == 3001 and seeds == K.seed_sum(cfg) == 3001 * 3000 // 2
        assert s == pytest.approx(ref[0], rel=1e-12) and s2 == pytest.approx(ref[1], rel=1e-12)
    # control: one rank's share alone is not the whole
    one = W.simulate_waste(cfg.work_h * H, tau, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H, range(0, 3001, 3))
    assert one[2] == 1001 and one[0] != pytest.approx(ref[0], rel=1e-3)
    # the seed sum is added by simulate_waste as it runs each seed, not computed beside it
    assert one[3] == sum(range(0, 3001, 3)) and ref[3] == K.seed_sum(cfg)
    # control of the seed check: with 3000 seeds, three ranks that forgot their offset (each
    # running range(0, 3000, 3)) run 3000 runs, so a count passes, but the seed sum does not
    wrong = [range(0, 3000, 3)] * 3
    assert sum(len(r) for r in wrong) == 3000
    assert sum(sum(r) for r in wrong) != K.seed_sum(T.Config(seeds=3000))
    # the measured optimum's sums over three ranks (one all-reduce of every interval's sums)
    # equal one process's
    one = K.measured_optimum(T.Config(opt_seeds=300), type("Info", (), {"rank": 0, "world_size": 1,
                                                                       "device": None})())
    for r in results_opt:
        assert r["means"] == pytest.approx(one["means"], rel=1e-12)
        assert r["optimum_s"] == pytest.approx(one["optimum_s"], rel=1e-9)


@pytest.mark.timeout(120)
def test_script_on_two_ranks(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, timeout=100, out_dir=tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    checks = {c["name"]: c for c in summary["checks"]}
    assert all(c["ok"] for c in checks.values()), res.output[-3000:]
    assert len(checks) == 7
    optimum = summary["figures"]["measured optimum interval (simulation, fit) ± SE"]
    assert optimum["expected"] == pytest.approx(W.daly_interval(180, 4 * H) / H)
    assert abs(optimum["measured"][0] - optimum["expected"]) <= K.OPT_BAND * optimum["measured"][0]
    # the lesson's figures of this (seeded) measurement: 0.597 ± 0.006 h; Daly 0.4 % away, Young
    # 5.9 % above, the lost factor 2 25 % below
    assert [round(x, 3) for x in optimum["measured"]] == [0.597, 0.006]
    assert round(checks["Daly's τ vs the optimum measured on the simulation, relative"]["measured"], 3) == 0.004
    young = summary["figures"]["Young's τ vs the measured optimum, relative (not checked)"]
    assert round(young["measured"], 3) == 0.059
    assert round(checks["control: sqrt(δM) (a factor 2 lost) vs the measured optimum"]["measured"], 2) == 0.25
    # the all-reduced sums equal one process's sums over the same seeds (the test's own reference)
    cfg = T.Config()
    tau = W.daly_interval(cfg.save_s, cfg.mtbf_h * H)
    s, s2, n, _ = W.simulate_waste(cfg.work_h * H, tau, cfg.save_s, cfg.restart_s, cfg.mtbf_h * H,
                                   range(cfg.seeds))
    mean = summary["figures"]["simulated waste: mean, standard error"]["measured"][0]
    assert mean == pytest.approx(s / n / H, rel=1e-12)
    assert summary["figures"]["GPU-hours at the MFU (formula)"]["measured"] == pytest.approx(29491.07, abs=0.01)
    # spot is priced over the planned run's 460.8 useful hours (22.64 %), not the 24 h run's 22.84 %
    spot_waste = summary["figures"]["spot waste of the planned run, fraction (model)"]["measured"]
    assert spot_waste == pytest.approx(0.2264, abs=1e-4)


@pytest.mark.timeout(30)
def test_exercise_answers():
    # 1: 6 * 13e9 * 2e12 = 1.56e23; / (989e12 * 0.35 * 3600) = 125 186.6 GPU-hours; x 98.32 / 8
    f = C.total_flops(13e9, 2e12)
    assert f == pytest.approx(1.56e23)
    g = C.gpu_hours(f, 989e12, 0.35)
    assert g == pytest.approx(1.56e23 / (989e12 * 0.35 * 3600)) and round(g) == 125187
    assert round(C.run_cost(f, C.instance("aws-p5.48xlarge"), 0.35, 8)["dollars"]) == 1538543
    # 2: sqrt(2 * 60 * 7200) = 929.5 s = 0.258 h; Daly 0.247 h; waste 5.78 h in 24 h
    assert W.young_interval(60, 2 * H) / H == pytest.approx(math.sqrt(2 * 60 * 7200) / H) == pytest.approx(0.2582, abs=1e-4)
    assert W.daly_interval(60, 2 * H) / H == pytest.approx(0.2472, abs=1e-4)
    assert W.expected_waste(24 * H, W.daly_interval(60, 2 * H), 60, 600, 2 * H) / H == pytest.approx(5.780, abs=1e-3)
    # 3: p (1 + 0.226) = 1
    assert C.spot_break_even(1.0, 1 / 1.226, 0.226)["cost_ratio"] == pytest.approx(1.0)
    assert 1 / 1.226 == pytest.approx(0.8157, abs=1e-4) and 1 - 1 / 1.226 == pytest.approx(0.184, abs=1e-3)


@pytest.mark.timeout(30)
def test_the_lessons_other_numbers():
    # worked example 2: 589 821.4 GPU-hours x 98.32 / 8 = $7.249 M
    assert C.gpu_hours(8.4e23, 989e12, 0.4) * 98.32 / 8 == pytest.approx(7.2489e6, rel=1e-4)
    # worked example 4: the waste of the run's own 460.8 useful hours (22.64 %, not the 24 h run's
    # 22.84 %); spot $ = 29 491.07 / 8 x 39.328 x (1 + waste) -> $177 800
    p5 = C.instance("aws-p5.48xlarge")
    tau = W.daly_interval(180, 4 * H)
    work = 29491.07 / 64 * H
    waste = W.expected_waste(work, tau, 180, 600, 4 * H) / work
    assert waste == pytest.approx(0.2264, abs=1e-4)
    assert W.expected_waste(24 * H, tau, 180, 600, 4 * H) / (24 * H) == pytest.approx(0.2284, abs=1e-4)
    spot = C.run_cost(4.2e22, p5, 0.4, 64, spot=True, overhead=waste)["dollars"]
    assert spot == pytest.approx(29491.07 / 8 * 39.328 * (1 + waste), rel=1e-6) and round(spot) == 177800
    # worked example 5: Daly's tau at M = 12 h: sqrt(2*180*43200) = 3943.6 s, r = 180/86400
    r = 180 / 86400
    assert W.daly_interval(180, 12 * H) == pytest.approx(math.sqrt(2 * 180 * 43200) * (1 + math.sqrt(r) / 3 + r / 9) - 180)
    assert W.daly_interval(180, 12 * H) / H == pytest.approx(1.062, abs=1e-3)
    # the layouts the lesson quotes (7B, 64 H100s, global batch 1024): tp 8 -> 0.646, dp 64 -> 0.079
    m = C.Model(7e9, 32, 4096, 4096)
    assert C.layout_times(m, p5, 8, 8, 1, 1, 1024, 0.4)["ratio"] == pytest.approx(0.646, abs=1e-3)
    assert C.layout_times(m, p5, 64, 1, 1, 1, 1024, 0.4)["ratio"] == pytest.approx(0.079, abs=1e-3)
    # a finite 24 h run: 5.44 h of waste at Young's tau, 5.48 h at Daly's; per useful second
    # Daly's tau is lower (1.22637 against 1.22663)
    young = W.young_interval(180, 4 * H)
    assert W.expected_waste(24 * H, young, 180, 600, 4 * H) / H == pytest.approx(5.439, abs=1e-3)
    assert W.expected_waste(24 * H, tau, 180, 600, 4 * H) / H == pytest.approx(5.482, abs=1e-3)
    assert W.per_work_rate(tau, 180, 600, 4 * H) == pytest.approx(1.22637, abs=1e-5)
    assert W.per_work_rate(young, 180, 600, 4 * H) == pytest.approx(1.22663, abs=1e-5)
    # Young's first-order waste at Daly's tau: 24 x (180/tau + (tau/2 + 600)/14 400) = 4.80 h
    assert 24 * W.first_order_overhead(tau, 180, 600, 4 * H) == pytest.approx(4.800, abs=1e-3)
    # what R and M leave out: an hour's wait for capacity after each preemption, no machine up,
    # nothing preempted in it (D = 3600 s beside R = 600 s): 5.482 h + 7.371 failures x 1 h =
    # 12.85 h (53.6 %) of a 24 h run; 53.3 % of the planned 460.8 h (141.3 failures)
    fails24 = W.expected_failures(24 * H, tau, 180, 600, 4 * H)
    assert fails24 == pytest.approx(7.371, abs=1e-3)
    assert W.expected_waste(24 * H, tau, 180, 600, 4 * H, wait_s=H) / H == pytest.approx(12.85, abs=5e-3)
    assert W.expected_waste(24 * H, tau, 180, 600, 4 * H, wait_s=H) / (24 * H) == pytest.approx(0.536, abs=5e-4)
    late = W.expected_waste(work, tau, 180, 600, 4 * H, wait_s=H) / work
    assert late == pytest.approx(0.533, abs=5e-4)
    assert W.expected_failures(work, tau, 180, 600, 4 * H) == pytest.approx(141.3, abs=0.05)
    # dollars: spot price x (useful + exposed waste + billed share of the wait); the whole job
    # reclaimed bills nothing while it waits (0.49 x on demand); one of the 8 machines reclaimed
    # with the 7 others kept bills 7/8 of the wait (0.60 x)
    wait = late - waste
    assert C.spot_break_even(98.32, 98.32 * 0.4, waste + 0 * wait)["cost_ratio"] == pytest.approx(0.49, abs=5e-3)
    assert C.spot_break_even(98.32, 98.32 * 0.4, waste + 7 / 8 * wait)["cost_ratio"] == pytest.approx(0.60, abs=5e-3)
    # 16 machines of 64 h: independent, M = 4 h (22.8 %); always together, M = 64 h, tau 2.50 h:
    # 4.4 % at R = 600 s, 6.0 % with the hour's wait
    assert W.job_mtbf(64 * H, 16) == 4 * H
    tau64 = W.daly_interval(180, 64 * H)
    assert tau64 / H == pytest.approx(2.50, abs=5e-3)
    assert W.expected_waste(24 * H, tau64, 180, 600, 64 * H) / (24 * H) == pytest.approx(0.044, abs=5e-4)
    assert W.expected_waste(24 * H, tau64, 180, 600, 64 * H, wait_s=H) / (24 * H) == pytest.approx(0.060, abs=5e-4)
    # the capacity-block rate: $39.33 per instance-hour = 8 x $4.916 per accelerator-hour (the
    # page's two columns), and the assumed spot price 0.4 x $98.32 = 39.328 rounds to it
    cb = C.instance("aws-p5-capacity-block")
    assert cb.on_demand_per_h == 39.33 and round(8 * 4.916, 2) == 39.33
    assert round(C.instance("aws-p5.48xlarge").spot_per_h, 2) == 39.33
