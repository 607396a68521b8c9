"""Chapter 09: gradient compression hooks send what their formulas say and still train.

One real torchrun launch trains every method and checks itself; this module re-derives the
byte formulas by hand, checks each hook's one-step output against a reference computed here
from the ranks' own gradients, checks the wire tap that counts the bytes (on known collectives,
on torch's fp16/bf16/PowerSGD hooks, and against a hook that sends fp32 while claiming fp16),
and shows that the replica check fails for a hook whose ranks decode different payloads (all
on two spawned gloo ranks, one start). QSGD's unbiasedness is tested with its own loop,
rejecting a biased rounding with the same test.
"""

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

from chapters.ch09_compression import hooks, train, wire
from chapters.ch09_compression.wire import WireTap
from common.checkpoint import load_checkpoint
from common.data import regression_data
from common.launch import run_on_ranks, run_torchrun
from common.models import MLP

SCRIPT = Path(train.__file__)


def shapes(d_hidden: int = 64) -> list[tuple[int, ...]]:
    return [(d_hidden, 16), (d_hidden,), (d_hidden, d_hidden), (d_hidden,), (1, d_hidden), (1,)]


def by_hand_bytes(cfg: train.Config) -> dict[str, int]:
    """Each method's bytes per step, written out from the lesson's formulas (fp32 gradients)."""
    s = shapes(cfg.d_hidden)
    n = sum(math.prod(x) for x in s)
    k = math.ceil(cfg.density * n)
    chunks = math.ceil(n / cfg.chunk)
    # PowerSGD rank 1: the three weight matrices as factors, the biases (and 1x64) plain.
    psgd = 4 * ((64 + 16) + 64 + (64 + 64) + 64 + 64 + 1)
    return {"dense": 4 * n, "fp16": 2 * n, "bf16": 2 * n, "topk": 8 * k, "topk_no_ef": 8 * k,
            "qsgd": chunks * cfg.chunk + 4 * chunks, "signsgd": math.ceil(n / 8) + 4 * len(s),
            "signsgd_no_ef": math.ceil(n / 8) + 4 * len(s), "powersgd": psgd,
            "powersgd_builtin": psgd}


@pytest.mark.timeout(150)
def test_every_method_sends_its_formula_and_converges(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=140)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    cfg, figs = train.Config(), res.summary["figures"]
    dense_bytes = by_hand_bytes(cfg)["dense"]
    for method, nbytes in by_hand_bytes(cfg).items():
        # what reached the collectives at every step from step 2 on: one value, the formula's
        assert res.check(f"bytes/step {method} = formula")["measured"] == [nbytes], method
        assert figs[f"compression ratio {method}"]["measured"] == pytest.approx(dense_bytes / nbytes)
        assert figs[f"step time {method}: median, min, max"]["unit"] == "ms"  # reported, never asserted
    # torch's PowerSGD all-reduces the dense bucket until start_powerSGD_iter=2, then compresses
    assert figs["bytes sent by torch's PowerSGD, steps 0-2"]["measured"] == \
        [dense_bytes, dense_bytes, by_hand_bytes(cfg)["powersgd"]]
    assert res.check("replicas identical after every method")["tolerance"] == 0.0
    curves = load_checkpoint(tmp_path / "curves.pt")
    assert set(curves) == set(train.METHODS) and all(len(c) == cfg.steps for c in curves.values())
    final = {m: c[-1].item() for m, c in curves.items()}
    bound = final["dense"] * (1 + cfg.loss_tolerance)
    for method in ("fp16", "bf16", "topk", "qsgd", "signsgd", "powersgd", "powersgd_builtin"):
        assert final[method] <= bound, method
        assert final[method] < curves[method][0].item() / 10, f"{method} did not train"
    # Negative controls: the same hooks with the residual dropped fail the same bound, clearly.
    assert final["topk_no_ef"] > 1.5 * final["topk"] and final["topk_no_ef"] > bound
    assert final["signsgd_no_ef"] > 1.5 * final["signsgd"] and final["signsgd_no_ef"] > bound


def _local_and_mean_grads(model, x, y):
    local = copy.deepcopy(model)
    F.mse_loss(local(x), y).backward()
    grads = [p.grad.clone() for p in local.parameters()]
    mean = [g.clone() for g in grads]
    for g in mean:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads, mean


def _hook_step(method: str, model, x, y, state, tap=None):
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=100)
    ddp.register_comm_hook(state, train.METHODS[method][0] if isinstance(method, str) else method)
    with tap or WireTap():
        F.mse_loss(ddp(x), y).backward()
    return [p.grad.clone() for p in ddp.module.parameters()]


def _own_payload_only(state, bucket):
    """Broken Top-K: each rank applies its own top-k, gathered from nobody. The replicas
    receive different gradients and drift apart: the replica check must see it."""
    buf = bucket.buffer()
    values, indices = hooks.topk_compress(buf, hooks.topk_size(buf.numel(), state.density))
    buf.copy_(hooks.topk_decompress(values, indices, buf.numel()))
    return hooks.completed(buf)


def _replica_gap_after(hook, model, X, Y, steps: int = 5) -> float:
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=100)
    ddp.register_comm_hook(hooks.HookState(density=0.05), hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        x, y = X[step::steps].chunk(world)[rank], Y[step::steps].chunk(world)[rank]
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return train.replica_gap(ddp.module)


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _hooks_on_ranks() -> dict:
    """Each hand-written hook's one-step output against a reference computed here."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MLP(16, 64, 1)
    X, Y = regression_data(64, 16, 1, seed=0)
    x, y = X.chunk(world)[rank], Y.chunk(world)[rank]
    local, mean = _local_and_mean_grads(model, x, y)
    flat_local = torch.cat([g.flatten() for g in local])
    flat_mean = torch.cat([g.flatten() for g in mean])
    out = {}

    # The tap on known collectives: an all-reduce of 3 fp32 is 12 bytes; the deprecated
    # all_gather_into_tensor (which calls all_gather_single) counts once; nothing after the block.
    originals = {n: (getattr(dist, n), getattr(c10d, n)) for n in (*wire.COLLECTIVES, "batch_isend_irecv")
                 if hasattr(c10d, n)}
    with WireTap() as tap:
        dist.all_reduce(torch.ones(3))
        dist.all_gather_into_tensor(torch.empty(2 * world, dtype=torch.int8), torch.ones(2, dtype=torch.int8))
    dist.all_reduce(torch.ones(5))
    out["tap_known"] = [(s.kind, str(s.dtype), s.nbytes) for s in tap.sent]
    # A broadcast sends from its source only; send (which calls isend) and a batch of P2P ops
    # built before the block (torch checks their op by identity) count once each and still work.
    peer = (rank + 1) % world
    got = torch.zeros(3)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank)), peer),
           dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    with WireTap() as tap:
        dist.broadcast(torch.ones(4), src=1)
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if rank == 0:
            dist.send(torch.ones(2), 1)
        elif rank == 1:
            dist.recv(torch.empty(2), 0)
    out["tap_p2p"] = [(s.kind, s.nbytes) for s in tap.sent]
    out["p2p_got"] = got.tolist()
    # Nested taps each count once; a block that raises still restores torch's functions.
    try:
        with WireTap() as outer, WireTap() as inner:
            dist.all_reduce(torch.ones(2))
            raise KeyError("inside the block")
    except KeyError:
        pass
    out["tap_nested"] = (outer.nbytes(), inner.nbytes())
    out["tap_restored"] = all(getattr(dist, n) is d and getattr(c10d, n) is c
                              for n, (d, c) in originals.items())

    # Top-K: mean over ranks of each rank's own top-k; the residual is exactly what was dropped.
    state, tap = hooks.HookState(density=0.05), WireTap()
    got = torch.cat([g.flatten() for g in _hook_step("topk", model, x, y, state, tap)])
    k = math.ceil(0.05 * flat_local.numel())
    kept = torch.zeros_like(flat_local)
    idx = flat_local.abs().topk(k).indices
    kept[idx] = flat_local[idx]
    out["topk"] = (got - sum(_gathered(kept)) / world).abs().max().item()
    out["topk_residual"] = (state.residuals[0] - (flat_local - kept)).abs().max().item()
    out["topk_sent"] = tap.nbytes()
    dense = hooks.HookState(density=1.0)
    got = torch.cat([g.flatten() for g in _hook_step("topk", model, x, y, dense)])
    out["topk_density_1"] = (got - flat_mean).abs().max().item()

    # torch's fp16/bf16 hooks, and a broken "fp16" hook that sends the fp32 bucket: the bytes
    # and dtype read off the tensors sent tell them apart (the configured dtype would not).
    for name, hook in (("fp16", hooks.fp16_hook), ("bf16", hooks.bf16_hook),
                       ("fp32_as_fp16", hooks.dense_hook)):
        tap = WireTap()
        _hook_step(hook, model, x, y, hooks.HookState(), tap)
        out[f"sent_{name}"] = (tap.nbytes("all_reduce"), tap.dtypes())
    # torch's PowerSGD chains its P and Q all-reduces in future callbacks, run on another
    # thread: the tap still sees them (a thread-local tap would count the plain part only).
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=100)
    state = train.psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                     start_powerSGD_iter=2, random_seed=0)
    ddp.register_comm_hook(state, train.psgd.powerSGD_hook)
    out["psgd_builtin_sent"] = []
    for _ in range(3):
        with WireTap() as tap:
            F.mse_loss(ddp(x), y).backward()
        out["psgd_builtin_sent"].append(tap.nbytes())

    # Replicas: identical after Top-K (deterministic decode of the same gathered payloads),
    # apart after a hook whose ranks apply different payloads (the check's negative control).
    out["replica_gap_topk"] = _replica_gap_after(hooks.topk_hook, model, X, Y)
    out["replica_gap_broken"] = _replica_gap_after(_own_payload_only, model, X, Y)

    # SignSGD: mean over ranks of (per-tensor mean |g|) * sign(g).
    state = hooks.HookState()
    got = torch.cat([g.flatten() for g in _hook_step("signsgd", model, x, y, state)])
    mine = torch.cat([g.abs().mean() * torch.where(g >= 0, 1.0, -1.0).flatten() for g in local])
    out["signsgd"] = (got - sum(_gathered(mine)) / world).abs().max().item()

    # QSGD: each coordinate within norm/s of the mean (each rank errs by < its chunk norm / s).
    state = hooks.HookState(levels=8, chunk=64)
    got = torch.cat([g.flatten() for g in _hook_step("qsgd", model, x, y, state)])
    pad = torch.nn.functional.pad(flat_local, (0, -flat_local.numel() % 64)).view(-1, 64)
    norm_max = max(_gathered(pad.norm(dim=1).max()))
    out["qsgd_err"], out["qsgd_bound"] = (got - flat_mean).abs().max().item(), (norm_max / 8).item()

    # PowerSGD: each compressed matrix is the projection of the dense mean onto rank-1 P,
    # so it has rank 1 and Pythagoras holds; the plain (bias) tensors are exact.
    state = hooks.HookState(rank=1)
    got = _hook_step("powersgd", model, x, y, state)
    plan = hooks.powersgd_plan([g.shape for g in got], 1)
    out["psgd_ranks"] = [torch.linalg.matrix_rank(g.view(g.shape[0], -1)).item()
                         for g, r in zip(got, plan) if r]
    out["psgd_pythagoras"] = max(abs(m.norm() ** 2 - g.norm() ** 2 - (m - g).norm() ** 2).item()
                                 / m.norm().item() ** 2 for g, m, r in zip(got, mean, plan) if r)
    out["psgd_plain"] = max((g - m).abs().max().item() for g, m, r in zip(got, mean, plan) if not r)
    out["psgd_not_dense"] = min((g - m).abs().max().item() for g, m, r in zip(got, mean, plan) if r)
    return out


@pytest.mark.timeout(90)
def test_hooks_match_references_on_two_ranks():
    res = run_on_ranks(_hooks_on_ranks, 2, timeout=80)
    n = 5313
    for rank, r in enumerate(res):
        assert r["tap_known"] == [("all_reduce", "torch.float32", 12), ("all_gather", "torch.int8", 2)]
        broadcast = [("broadcast", 16)] if rank == 1 else []
        assert r["tap_p2p"] == broadcast + [("send", 12)] + ([("send", 8)] if rank == 0 else [])
        assert r["p2p_got"] == [float((rank - 1) % 2)] * 3
        assert r["tap_nested"] == (8, 8) and r["tap_restored"]
        assert r["sent_fp16"] == (2 * n, ["torch.float16"]) and r["sent_bf16"] == (2 * n, ["torch.bfloat16"])
        assert r["sent_fp32_as_fp16"] == (4 * n, ["torch.float32"])  # rejected by "bytes = 2n"
        assert r["psgd_builtin_sent"] == [4 * n, 4 * n, by_hand_bytes(train.Config())["powersgd"]]
        assert r["replica_gap_topk"] == 0.0  # the replicas are copies
        assert r["replica_gap_broken"] > 1e-6  # ... and the same check sees them drift
        assert r["topk"] < 1e-7 and r["topk_residual"] < 1e-7
        assert r["topk_sent"] == math.ceil(0.05 * n) * 8
        assert r["topk_density_1"] < 1e-7
        assert r["signsgd"] < 1e-7
        assert 0 < r["qsgd_err"] <= r["qsgd_bound"]
        assert r["psgd_ranks"] == [1, 1]  # the 64x16 and 64x64 weights; 1x64 is sent plain
        assert r["psgd_pythagoras"] < 1e-4
        assert r["psgd_plain"] < 1e-7
        assert r["psgd_not_dense"] > 1e-6  # it really compressed


def _qsgd_variance(v: torch.Tensor, s: int, d: int) -> float:
    """E||Q(v) - v||^2, written out: a level is floor(r) + Bernoulli(r - floor(r)) with
    r = s|x_i|/||x||, so each decoded coordinate has variance (||x||/s)^2 p(1 - p)."""
    total = 0.0
    for start in range(0, v.numel(), d):
        x = v[start:start + d]
        r = s * x.abs() / x.norm()
        p = r - r.floor()
        total += ((x.norm() / s) ** 2 * p * (1 - p)).sum().item()
    return total


def test_qsgd_is_unbiased_and_biased_variants_are_not():
    """Mean of M independent quantisations: E||mean − v||² = V/M with V the exact variance of
    one. Markov with factor 20 rejects an unbiased quantiser with probability ≤ 5% (here: fixed
    seed). Rounding to nearest, and decoding with s+1 levels (a bias of 1/(s+1)), are rejected;
    Lemma 3.1's looser bound would have let the second one through."""
    s, d, M = 16, 256, 2000
    v = torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    V = _qsgd_variance(v, s, d)
    lemma = min(d / s**2, math.sqrt(d) / s) * v.pow(2).sum().item()
    assert V <= lemma and hooks.qsgd_variance(v, s, d) == pytest.approx(V, rel=1e-9)
    bound = 20 * V / M
    g = torch.Generator().manual_seed(2)
    results, spread = {}, 0.0
    for name, stochastic, decode in (("unbiased", True, s), ("nearest", False, s), ("s+1", True, s + 1)):
        total = torch.zeros_like(v)
        for _ in range(M):
            q, norms = hooks.qsgd_quantize(v, s, d, g, stochastic=stochastic)
            assert q.dtype == torch.int8 and q.abs().max() <= s
            one = hooks.qsgd_dequantize(q, norms, decode, v.numel())
            total += one
            spread += (one - v).pow(2).sum().item() / M if name == "unbiased" else 0.0
        results[name] = (total / M - v).pow(2).sum().item()
    assert spread == pytest.approx(V, rel=0.05)  # V is the variance the draws show
    assert results["unbiased"] <= bound
    assert results["nearest"] > 10 * bound, "deterministic rounding must be rejected"
    assert results["s+1"] > bound and results["s+1"] <= 20 * lemma / M, "only the exact V sees it"
    # The chapter's own test agrees with this one, on every side.
    err, b = train.qsgd_unbiasedness(v, s, d, M, seed=3)
    assert err <= b == pytest.approx(bound)
    assert train.qsgd_unbiasedness(v, s, d, M, seed=3, stochastic=False)[0] > b
    assert train.qsgd_unbiasedness(v, s, d, M, seed=3, decode_levels=s + 1)[0] > b


def test_wiretap_restores_torch_when_it_cannot_start(monkeypatch):
    """A tap that fails half way through patching leaves nothing patched; an active tap
    cannot be entered twice; a collective argument torch renamed is an error, not a silent 0."""
    originals = {n: getattr(dist, n) for n in wire.COLLECTIVES if hasattr(dist, n)}
    monkeypatch.setitem(wire.COLLECTIVES, "scatter", ("scatter", "no_such_argument", "src"))
    with pytest.raises(TypeError, match="no_such_argument"):
        with WireTap():
            pass
    assert all(getattr(dist, n) is f for n, f in originals.items())
    monkeypatch.undo()
    with WireTap() as tap:
        with pytest.raises(RuntimeError, match="already active"):
            tap.__enter__()
    assert all(getattr(dist, n) is f for n, f in originals.items())


def test_topk_decode_is_deterministic_and_exact_in_rank_order():
    """Overlapping indices from two ranks: the decode adds rank 0's value, then rank 1's, as
    written out here, bit for bit; and the order it fixes is the same on every run."""
    values = torch.tensor([[1.0, 2.0**-30, 3.0], [2.0**-30, 5.0, -1.0]])
    indices = torch.tensor([[0, 1, 2], [1, 2, 0]], dtype=torch.int32)
    got = hooks.topk_decompress(values, indices, 4)
    want = torch.zeros(4)
    for v, i in zip(values, indices):
        for vv, ii in zip(v, i.long()):
            want[ii] += vv
    assert torch.equal(got, want) and torch.equal(got, hooks.topk_decompress(values, indices, 4))
    assert got.tolist() == [0.0, 2.0**-29, 8.0, 0.0]


def test_gathered_payloads_stop_paying_at_large_worlds():
    """All-gathered payloads arrive W-1 times; a ring all-reduce brings 2(W-1)/W of the bucket.
    Top-K at 1 % receives more than dense from W = n/K on (5313/54 = 98.4 -> 99 ranks)."""
    cfg = train.Config()
    shapes_ = [torch.Size(s) for s in shapes(cfg.d_hidden)]
    state = hooks.HookState(density=cfg.density, levels=cfg.levels, chunk=cfg.chunk, rank=cfg.rank)
    assert hooks.break_even_world("topk", shapes_, state) == 99
    assert hooks.break_even_world("qsgd", shapes_, state) == 8       # 2 x 21252 / 5460 = 7.8
    assert hooks.break_even_world("signsgd", shapes_, state) == 62   # 2 x 21252 / 689 = 61.7
    assert hooks.break_even_world("powersgd", shapes_, state) is None
    assert hooks.received_bytes("dense", shapes_, state, 2) == 21252


def test_compressors_round_trip():
    v = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    packed = hooks.pack_signs(v)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1001 / 8)
    assert torch.equal(hooks.unpack_signs(packed, 1001, v.dtype), torch.where(v >= 0, 1.0, -1.0))
    values, idx = hooks.topk_compress(v, 10)
    assert idx.dtype == torch.int32
    dense = hooks.topk_decompress(values, idx, 1001)
    assert (dense != 0).sum() == 10 and dense.abs().min() == 0
    assert torch.equal(dense[idx.long()], v[idx.long()])
    assert dense.abs().max() == v.abs().max()
    q, norms = hooks.qsgd_quantize(v, 127, 1001, stochastic=False)
    assert (hooks.qsgd_dequantize(q, norms, 127, 1001) - v).abs().max() <= norms.max() / 254 + 1e-6


def test_bad_settings_exit_with_one_line():
    for args in (["--density", "0"], ["--levels", "200"], ["--methods", "gzip"], ["--steps", "3"]):
        with pytest.raises(SystemExit) as e:
            train.parse_config(train.Config, args)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:  # refused before any rank starts
        train.parse_config(train.Config, ["--global-batch-size", "64"], validate=train.validate,
                           world_size=3)
    assert e.value.code == 2
    with pytest.raises(ValueError, match="gloo cannot all-gather CUDA tensors"):
        train.validate(train.Config(device="cuda", backend="gloo"), 2)
    train.validate(train.Config(device="cuda", backend="gloo", methods=train.ALL_REDUCE_ONLY), 2)
