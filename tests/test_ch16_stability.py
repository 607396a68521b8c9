"""Chapter 16: global-norm clipping over FSDP2 shards, agreed step skipping, bf16 accumulation.

The torchrun run checks itself (summary.json); this module also trains its own one-process
reference with a plain loop, checks the sharded norm on 3 ranks (uneven shards, two ranks holding
empty shards of the last layer) against an unsharded model, proves a poisoned step leaves
weights and Adam state bitwise untouched, and runs the negative controls (a shard-local norm,
ranks deciding alone on a fault only one of them sees, Kahan without its carry).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from chapters.ch16_stability import plots, precision, train
from common.checkpoint import load_checkpoint
from common.data import regression_data
from common.launch import run_on_ranks, run_torchrun
from common.models import MLP
from common.testing import rank_info

SCRIPT = Path(train.__file__)


def reference(cfg: train.Config) -> dict:
    """One process, whole batch, Adam after torch's clip, the known bad steps left out."""
    X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=cfg.seed,
                           dtype=torch.float64)
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.d_in, cfg.d_hidden, 1).double()
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        if step in (cfg.poison_step, cfg.grad_fault_step, cfg.spike_step):
            continue
        rows = slice(step * cfg.global_batch_size, (step + 1) * cfg.global_batch_size)
        ((model(X[rows]) - Y[rows]) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.timeout(150)
def test_two_ranks_match_an_independent_reference(tmp_path, quiet_console):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=120)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    quiet_console(res)  # FSDP2: the course's lines only, within 100 columns
    assert "methods 5/5" in res.output  # the slow summation loop reports its progress
    cfg = train.Config()
    assert res.check("poisoned steps skipped")["measured"] == [cfg.poison_step, cfg.grad_fault_step]
    # the batch's NaN reached both ranks' shards through the reduce-scatter; the inf written into
    # rank 0's shard after it, rank 0 alone: only the MAX all-reduce made rank 1 skip that step
    assert res.summary["figures"]["ranks seeing each skipped step bad (own view)"]["measured"] == [[0, 1], [0]]
    assert res.check("ranks that saw the gradient-shard fault themselves")["measured"] == [0]
    assert res.check("spikes detected")["measured"] == [cfg.spike_step]
    assert res.check("Adam steps taken = steps - skipped")["measured"] == cfg.steps - 3
    saved = load_checkpoint(tmp_path / "final_params.pt")
    expected = reference(cfg)
    assert max((saved["fsdp"][k] - v).abs().max().item() for k, v in expected.items()) < 1e-10
    assert ((saved["hand_norm"] - saved["torch_norm"]) / saved["hand_norm"]).abs().max() < 1e-12
    assert (saved["hand_norm"] > cfg.max_norm).any(), "clipping never acted: the test proves nothing"


def shard_local_norms(grads: list[torch.Tensor], world: int) -> list[float]:
    """Each rank's norm over its own rows only (FSDP2 shards dim 0 like torch.chunk): what a
    global_grad_norm without its all-reduce returns on each rank."""
    return [math.sqrt(sum((g.chunk(world)[r] ** 2).sum().item() for g in grads
                          if r < len(g.chunk(world)))) for r in range(world)]


def _sharded_checks() -> dict:
    """On gloo ranks: norms and clipped gradients of FSDP2 shards vs one unsharded model;
    a poisoned step skipped bitwise; the negative controls."""
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    info = rank_info(rank, world)
    cfg = train.Config(steps=10, poison_step=5, spike_step=-1, global_batch_size=12, max_norm=0.05)
    X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, dtype=torch.float64)
    X, Y = X.view(cfg.steps, cfg.global_batch_size, -1), Y.view(cfg.steps, cfg.global_batch_size, 1)
    torch.manual_seed(0)
    plain = MLP(cfg.d_in, cfg.d_hidden, 1).double()
    fsdp = train.fully_shard_model(copy.deepcopy(plain), info)
    F.mse_loss(plain(X[0]), Y[0]).backward()
    F.mse_loss(fsdp(X[0].chunk(world)[rank]), Y[0].chunk(world)[rank]).backward()
    params = list(fsdp.parameters())
    out = {"shard_sizes": [train.local_shard(p).numel() for p in params],
           "grad_shard_sizes": [train.local_shard(p.grad).numel() for p in params],
           "all_dtensor": all(isinstance(p.grad, DTensor) for p in params)}
    ref_norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in plain.parameters()])).item()
    out["ref_norm"] = ref_norm
    out["hand_norm"] = train.global_grad_norm(params).item()
    out["local_only_norm"] = train.global_grad_norm(params, sharded=False).item()  # broken
    out["chunk_model_norm"] = shard_local_norms([p.grad for p in plain.parameters()], world)[rank]
    saved = [train.local_shard(p.grad).clone() for p in params]
    train.clip_by_global_norm(params, cfg.max_norm)
    hand_clipped = [p.grad.full_tensor() for p in params]
    for p, g in zip(params, saved):
        train.local_shard(p.grad).copy_(g)
    out["torch_norm"] = torch.nn.utils.clip_grad_norm_(params, cfg.max_norm).full_tensor().item()
    torch_clipped = [p.grad.full_tensor() for p in params]
    for p, g in zip(params, saved):
        train.local_shard(p.grad).copy_(g)
    train.clip_by_global_norm(params, cfg.max_norm, sharded=False)  # broken: local norm
    local_clipped = [p.grad.full_tensor() for p in params]
    torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.max_norm)
    ref_clipped = [p.grad for p in plain.parameters()]
    diff = lambda a, b: max((x - y).abs().max().item() for x, y in zip(a, b))  # noqa: E731
    out["hand_vs_ref"], out["torch_vs_ref"] = diff(hand_clipped, ref_clipped), diff(torch_clipped, ref_clipped)
    out["local_vs_ref"] = diff(local_clipped, ref_clipped)

    # A NaN in rank 1's batch at step 5: skipped on every rank, state bitwise unchanged.
    out["poison"] = _poisoned_run(cfg, X, Y, plain, info)
    # Exercise 1 on 3 ranks: an inf on rank 0 (3 steps: one before the poison, one after).
    short = dataclasses.replace(cfg, steps=3, poison_step=1)
    out["poison_inf_rank0"] = _poisoned_run(
        dataclasses.replace(short, poison_rank=0, poison_value=float("inf")), X, Y, plain, info)
    # An inf written into rank 1's own gradient shard after the reduce-scatter: only rank 1 sees it.
    # Agreed (the MAX all-reduce), every rank skips; deciding alone (the negative control), rank 1
    # skips and ranks 0 and 2 step, and the model is no longer the one-process reference's.
    fault = dataclasses.replace(short, poison_step=-1, grad_fault_step=1, grad_fault_rank=1)
    reference = copy.deepcopy(plain)
    for p in reference.parameters():
        p.grad = None
    train.train(reference, torch.optim.Adam(reference.parameters(), lr=fault.lr), X, Y, fault, 0, 1,
                sharded=False)  # one process, whole batch: the fault is in its gradient, skipped
    out["ref_params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    for name, agree in (("fault_agreed", True), ("fault_alone", False)):
        out[name] = _poisoned_run(fault, X, Y, plain, info, agree)
    # Broken: each rank looks only at its own loss and nobody agrees. Running that step would
    # hang (rank 0 enters clip_grad_norm_'s collectives alone), so the check compares decisions.
    model = train.fully_shard_model(copy.deepcopy(plain), info)
    x, y = train.make_batch(X, Y, cfg.poison_step, cfg, rank, world)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    params = list(model.parameters())
    out["decision_local_loss"] = not torch.isfinite(loss).item()
    out["decision_agreed"] = train.all_ranks_agree(train.step_is_bad(loss, params))
    out["grad_shard_finite"] = bool(torch.isfinite(train.local_grad_sq_norm(params)))
    return out


def _poisoned_run(cfg, X, Y, plain, info, agree: bool = True) -> dict:
    """Train cfg.steps steps with the fault at step `bad` (the batch poison or the gradient-shard
    fault), snapshotting this rank's weights and Adam state around it; the final parameters are
    gathered whole (every rank calls full_tensor)."""
    bad = cfg.poison_step if cfg.poison_step >= 0 else cfg.grad_fault_step
    model = train.fully_shard_model(copy.deepcopy(plain), info)
    for p in model.parameters():
        p.grad = None
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    run = lambda steps, log=None: train.train(model, opt, X, Y, cfg, info.rank, info.world_size,  # noqa: E731
                                              True, steps, log, agree=agree)
    log = run(range(bad))
    before = train.snapshot(model, opt)
    run(range(bad, bad + 1), log)
    after = train.snapshot(model, opt)
    run(range(bad + 1, cfg.steps), log)
    end = train.snapshot(model, opt)
    return {"skipped": log["skipped_bad"], "bad_here": log["bad_here"], "n_state": len(before),
            "untouched": len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)),
            "moved_after": any(not torch.equal(a, b) for a, b in zip(after, end)),
            "finite_after": all(math.isfinite(v) for v in log["loss"]) and all(torch.isfinite(t).all() for t in end),
            "adam_step": [float(s["step"]) for s in opt.state.values()],
            "params": train.full_params(model)}


@pytest.mark.timeout(120)
def test_sharded_norm_clipping_and_skipping_on_three_uneven_ranks():
    results = run_on_ranks(_sharded_checks, 3, timeout=100)
    sizes = [r["shard_sizes"] for r in results]
    assert len({tuple(s) for s in sizes}) > 1, "shards should be uneven on 3 ranks"
    # The last layer (one row of 64, and its bias) has fewer rows than ranks: FSDP2 gives it to
    # rank 0, and ranks 1 and 2 hold empty shards of it (their norm sums nothing there).
    assert [s[-2:] for s in sizes] == [[64, 1], [0, 0], [0, 0]]
    assert [r["grad_shard_sizes"] for r in results] == sizes
    for r in results:
        assert r["all_dtensor"]
        assert r["hand_norm"] == pytest.approx(r["ref_norm"], rel=1e-12, abs=0)
        assert r["torch_norm"] == pytest.approx(r["ref_norm"], rel=1e-12, abs=0)
        assert r["ref_norm"] > 0.05, "clipping must act for the clipped-gradient check to mean anything"
        assert r["hand_vs_ref"] < 1e-14 and r["torch_vs_ref"] < 1e-14
        # Negative control: a norm from the local shard only is smaller and the check rejects it.
        assert abs(r["local_only_norm"] - r["ref_norm"]) > 1e-3 * r["ref_norm"]
        # ... and it is the norm of this rank's rows (torch.chunk on dim 0), as exercise 3 uses.
        assert r["local_only_norm"] == pytest.approx(r["chunk_model_norm"], rel=1e-12)
        assert r["local_vs_ref"] > 1e-6
        p = r["poison"]
        assert p["skipped"] == [5] and p["untouched"] and p["n_state"] == 4 * 6
        assert p["moved_after"] and p["finite_after"]
        assert p["adam_step"] == [9.0] * 6  # 10 steps, 1 skipped
        q = r["poison_inf_rank0"]  # exercise 1, on 3 ranks
        assert q["skipped"] == [1] and q["untouched"] and q["moved_after"] and q["adam_step"] == [2.0] * 6
        assert q["bad_here"] == [1]  # the reduce-scatter spread rank 0's poison to every shard
        # The gradient-shard fault, agreed: skipped everywhere, state untouched, and the model is
        # the one-process reference's (which skipped the step too).
        a = r["fault_agreed"]
        assert a["skipped"] == [1] and a["untouched"] and a["moved_after"] and a["adam_step"] == [2.0] * 6
        assert max((a["params"][k] - v).abs().max().item() for k, v in r["ref_params"].items()) < 1e-10
        # Deciding alone: the same fault, the same checks, and the shards drift apart.
        alone = r["fault_alone"]
        assert max((alone["params"][k] - v).abs().max().item() for k, v in r["ref_params"].items()) > 1e-4
    assert [r["fault_agreed"]["bad_here"] for r in results] == [[], [1], []]  # only rank 1 saw it
    assert [r["fault_alone"]["bad_here"] for r in results] == [[], [1], []]
    assert [r["fault_alone"]["skipped"] for r in results] == [[], [1], []]  # only rank 1 skipped
    assert [r["fault_alone"]["untouched"] for r in results] == [False, True, False]
    assert [r["fault_alone"]["adam_step"][0] for r in results] == [3.0, 2.0, 3.0]
    # Negative control: deciding on the local loss alone, only the poisoned rank would skip,
    # while the others (whose gradient shards the reduce-scatter filled with NaN) would step.
    local = [r["decision_local_loss"] for r in results]
    assert local == [False, True, False], "a rank deciding alone went unnoticed"
    assert all(r["decision_agreed"] for r in results)
    assert not any(r["grad_shard_finite"] for r in results)


def test_bf16_emulation_matches_torch():
    g = torch.Generator().manual_seed(3)
    xs = (torch.rand(500, generator=g) * 1e-2).bfloat16()
    s = torch.zeros((), dtype=torch.bfloat16)
    for x in xs:
        s = s + x
    assert s.item() == precision.naive_sum(xs.float().tolist())
    for v in (1.0 + 2**-9, 3.14159, 1e-3, 65537.0):
        assert precision.round_bf16(v) == torch.tensor(v).bfloat16().item()


def test_bf16_running_sum_stagnates_where_the_formula_says():
    v, n = 2.0**-10, 100_000
    assert precision.naive_sum([v] * n) == precision.stagnation_point(v) == 2**8 * v
    assert precision.naive_sum([v] * n, precision.round_fp32) == n * v  # exact in fp32


def test_accumulation_bounds_hold_and_broken_sums_break_them():
    errors = precision.accumulation_errors(100_000, seed=1)
    naive = errors["bf16 naive"]
    assert naive["rel_error"] > 0.9 and naive["sum"] == naive["stagnation"]
    # Higham's bounds: those below 1 say something at n = 10⁵ and hold; naive bf16 has none
    # ((n−1)u ≥ 1) and Kahan's 2u + n·u² is above 1, so the script checks them otherwise.
    meaningful = {name for name, e in errors.items() if e["bound"] < 1}
    assert meaningful == {"bf16 inputs, fp32 accumulator", "bf16 pairwise", "fp32 naive"}
    for name, e in errors.items():
        assert e["rel_error"] <= e["bound"], name
        if name != "bf16 naive":
            assert e["rel_error"] < naive["rel_error"] / 100, name
    assert errors["bf16 Kahan"]["rel_error"] <= 2 * precision.U_BF16_OP
    # The bounds recomputed by hand: γ_k = k·u / (1 − k·u).
    n, u, u32 = 100_000, precision.U_BF16_OP, 2.0**-24
    assert errors["bf16 pairwise"]["bound"] == pytest.approx(17 * u / (1 - 17 * u), rel=1e-15)
    assert errors["fp32 naive"]["bound"] == pytest.approx((n - 1) * u32 / (1 - (n - 1) * u32), rel=1e-15)

    # Negative controls: each broken sum breaks the check that guards it.
    broken = precision.accumulation_errors(100_000, seed=1, methods={
        "bf16 inputs, fp32 accumulator": (precision.naive_sum, "bf16"),      # accumulates in bf16
        "bf16 pairwise": (precision.naive_sum, "bf16"),                      # sequential after all
        "fp32 naive": (precision.naive_sum, "fp32"),                         # rounds to bf16
        "bf16 Kahan": (lambda v: precision.kahan_sum(v, compensate=False), "bf16"),  # no carry
    })
    for name in meaningful:
        assert broken[name]["rel_error"] > broken[name]["bound"], name
    assert broken["bf16 Kahan"]["rel_error"] > 2 * precision.U_BF16_OP

    # Kahan's own limit: a constant power of two v stops at 2¹⁶·v (naive: 2⁸·v); without the
    # carry it is the naive sum again.
    v = 2.0**-12
    assert precision.kahan_sum([v] * 2**17) == precision.kahan_stagnation_point(v) == 2**16 * v
    assert precision.kahan_sum([v] * 2**15) == 2**15 * v  # exact below it
    assert precision.kahan_sum([v] * 2**17, compensate=False) == precision.naive_sum([v] * 2**17) == 2**8 * v


def test_fp32_master_weights_keep_updates_below_half_an_ulp():
    d = precision.master_weight_demo(1.0, 1e-3, 1000)
    assert 1e-3 < d["half_ulp"] == 2**-8
    assert d["bf16 weight"] == 1.0  # every update rounded away
    assert abs(d["fp32 master"] - d["expected"]) < 1e-3
    assert d["bf16 copy of master"] == 2.0
    control = precision.master_weight_demo(1.0, 5e-3, 10)  # above half an ulp: bf16 moves
    assert control["bf16 weight"] > 1.0


def test_fp16_overflows_and_underflows_where_bf16_does_not():
    d = precision.fp16_range_demo()
    assert d["fp16 grad"] == 0.0 and d["fp16 scaled grad / scale"] == pytest.approx(1e-8, rel=1e-3)
    assert math.isinf(d["fp16 of big"]) and math.isfinite(d["bf16 of big"])


def test_impossible_settings_are_refused():
    for argv in (["--max-norm", "0"], ["--spike-factor", "0.5"], ["--sum-terms", "1"]):
        with pytest.raises(SystemExit) as e:
            train.parse_config(train.Config, argv)
        assert e.value.code == 2
    for world in (1, 2, 3, 4, 8, 16):
        train.validate(train.Config(), world)
    with pytest.raises(ValueError, match="must divide into 5 ranks"):
        train.validate(train.Config(), 5)


def test_exercise_answers():
    cfg = train.Config()
    # 1. inf instead of NaN: the same steps are skipped (a world of one here; an inf on rank 0 of 3
    # ranks is run by test_sharded_norm_clipping_and_skipping_on_three_uneven_ranks).
    assert plots.one_process_run(train.Config(poison_value=float("inf")))["skipped_bad"] == [8, 17]
    # 2. False spikes: none at factor 1.5 with a window of 5; a shorter window (3) or a lower
    # factor (1.2) flags ordinary steps; the mean of the window instead of its median too.
    assert plots.one_process_run(train.Config(spike_factor=1.5))["spikes"] == [13]
    assert plots.one_process_run(train.Config(spike_factor=1.5, spike_window=3))["spikes"] == [13, 19]
    assert plots.one_process_run(train.Config(spike_factor=1.2))["spikes"] == [11, 12, 13, 14]
    mean_rule = lambda loss, history, c: (len(history[-c.spike_window:]) == c.spike_window  # noqa: E731
                                          and loss > c.spike_factor * statistics.mean(history[-c.spike_window:]))
    original = train.is_spike
    try:
        train.is_spike = mean_rule
        assert plots.one_process_run(train.Config(spike_factor=1.5))["spikes"] == [11, 12, 13]
    finally:
        train.is_spike = original
    # 3. Without the all-reduce each rank's norm covers its own rows only: on the first step's
    # gradient (0.9915), 0.889 and 0.440 on 2 ranks, 0.838, 0.420 and 0.322 on 3 (rank 0 holds
    # the last layer's single row, where most of the norm is).
    X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=cfg.seed,
                           dtype=torch.float64)
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.d_in, cfg.d_hidden, 1).double()
    F.mse_loss(model(X[:cfg.global_batch_size]), Y[:cfg.global_batch_size]).backward()
    grads = [p.grad for p in model.parameters()]
    assert shard_local_norms(grads, 1)[0] == pytest.approx(0.9915, abs=5e-5)
    assert shard_local_norms(grads, 2) == pytest.approx([0.8886, 0.4398], abs=5e-5)
    assert shard_local_norms(grads, 3) == pytest.approx([0.8381, 0.4204, 0.3224], abs=5e-5)
    # 4. Signed terms in [-1e-3, 1e-3): the running sum stays small, so naive bf16 loses little
    # relative to Σ|x| (4.2e-4, against 0.99 for positive terms); relative to the sum itself
    # (0.055) its error is 38 %: cancellation, which the bounds (relative to Σ|x|) do not see.
    signed = precision.accumulation_errors(100_000, seed=0, low=-1e-3)
    naive = signed["bf16 naive"]
    assert naive["rel_error"] == pytest.approx(4.236e-4, rel=1e-3)
    assert abs(naive["sum"] - naive["exact"]) / abs(naive["exact"]) == pytest.approx(0.384, abs=1e-3)
    assert signed["bf16 inputs, fp32 accumulator"]["rel_error"] == pytest.approx(2.275e-6, rel=1e-2)
