"""Chapter 30: the auto-parallel planner against brute force it does not share, its predicted
order against hand arithmetic, secure aggregation's masks cancelling exactly, and FedAvg.

The brute force here enumerates the layouts with its own loops (only the cost and memory
functions come from the chapter, the things being searched over). FedAvg's round is compared
with a float reference this module computes in one process; both scripts run once under torchrun.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from chapters.ch30_frontier import fedavg, planner, real_layouts, secure_agg, train
from common.launch import run_on_ranks, run_torchrun
from common.models import MLP
from common.testing import rank_info

HERE = Path(train.__file__).parent


def own_brute_force(spec: planner.ModelSpec, cluster: planner.Cluster, drop=None, memory=True):
    """Every (dp, tp, pp, b, recompute, zero) with dp·tp·pp = N that the model allows."""
    n, best = cluster.n_gpus, None
    for tp in range(1, n + 1):
        for pp in range(1, n + 1):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            heads_ok = not spec.attention or (spec.n_heads % tp == 0 and (spec.kv_heads or spec.n_heads) % tp == 0)
            if not heads_ok or spec.d_ff % tp or spec.n_layers % pp or spec.global_batch % dp:
                continue
            for b in range(1, spec.global_batch // dp + 1):
                if (spec.global_batch // dp) % b:
                    continue
                for r in ((0, 1, 2) if spec.attention else (0, 2)):
                    for z in range(4):
                        lay = planner.Layout(dp, tp, pp, b, r, z)
                        if memory and planner.memory_bytes(spec, lay) > cluster.memory_bytes:
                            continue
                        t = planner.step_time(spec, cluster, lay, drop)
                        if best is None or (t, lay) < best:
                            best = (t, lay)
    return best


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(planner.small_cases()) + list(planner.WORKED))
def test_planner_equals_brute_force(case):
    spec, cluster = {**planner.small_cases(), **planner.WORKED}[case]
    t, lay = own_brute_force(spec, cluster)
    plan_ = planner.search(spec, cluster)
    assert plan_.layout == lay and plan_.time == t  # exact: same functions, same layout
    assert plan_.memory <= cluster.memory_bytes
    assert plan_.evaluated < planner.brute_force(spec, cluster).evaluated  # the prunes prune


@pytest.mark.timeout(30)
def test_planner_negative_controls_choose_otherwise():
    spec, cluster = planner.small_cases()["7B, 32 x 40 GB"]
    right = planner.search(spec, cluster)
    greedy = planner.search(spec, cluster, ignore_memory=True)
    assert greedy.layout != right.layout and greedy.memory > cluster.memory_bytes
    assert own_brute_force(spec, cluster, memory=False)[1] == greedy.layout
    blind = planner.search(spec, cluster, drop="dp_comm")
    assert blind.layout != right.layout and blind.time > right.time
    assert own_brute_force(spec, cluster, drop="dp_comm")[1] == blind.layout


@pytest.mark.timeout(30)
def test_worked_pairs_fit_and_use_the_chapters_models():
    spec, cluster = planner.WORKED["7B on 64 GPUs of 80 GB"]
    assert abs(spec.params() - 6.738e9) < 1e6  # Llama-2 7B's 6.74B
    assert abs(planner.WORKED["70B on 512 GPUs of 80 GB"][0].params() - 68.98e9) < 1e7
    lay = planner.Layout(64, 1, 1, 1, 0, 3)  # ZeRO-3 over 64: chapter 06's (2+2+12)Ψ/64
    states = 16 * math.ceil(spec.params() / 64)
    assert planner.memory_bytes(spec, lay) - planner.activation_bytes(spec, lay) == pytest.approx(states, abs=16 * 64)


@pytest.mark.timeout(30)
def test_exercise_answers():
    import dataclasses

    spec, cluster = planner.WORKED["7B on 64 GPUs of 80 GB"]
    small = planner.search(spec, dataclasses.replace(cluster, memory_bytes=40e9))
    assert str(small.layout) == "dp=8 tp=1 pp=8 b=1 rc=selective ZeRO-0"
    assert (round(small.time, 3), round(small.memory / 1e9, 1)) == (3.732, 31.7)
    hidden = planner.search(spec, cluster, drop="dp_comm")
    assert str(hidden.layout) == "dp=64 tp=1 pp=1 b=1 rc=selective ZeRO-1"
    assert round(planner.step_time(spec, cluster, hidden.layout, "dp_comm"), 3) == 3.248
    assert (round(hidden.time, 3), round(planner.search(spec, cluster).time, 3)) == (3.913, 3.635)
    # the lesson's worked output: the choices and the control's memory
    chosen = {name: planner.search(*pair) for name, pair in planner.WORKED.items()}
    assert [str(p.layout) for p in chosen.values()] == [
        "dp=16 tp=2 pp=2 b=1 rc=none ZeRO-0", "dp=32 tp=4 pp=4 b=1 rc=selective ZeRO-1"]
    assert [(round(p.time, 2), round(p.memory / 1e9, 1)) for p in chosen.values()] == [
        (3.64, 79.0), (9.68, 41.7)]
    other = planner.search(spec, dataclasses.replace(cluster, order="tp-pp-dp"))
    assert (str(other.layout), round(other.time, 2)) == ("dp=8 tp=2 pp=4 b=1 rc=none ZeRO-0", 3.56)


def megatron_groups(n: int, tp: int, dp: int, pp: int, axis: str) -> list[list[int]]:
    """The groups Megatron-Core's default order builds, from its rank formula
    (megatron/core/parallel_state.py: global_rank = tp_rank + dp_rank·tp + pp_rank·tp·dp)."""
    coords = {t + d * tp + q * tp * dp: (t, d, q) for t in range(tp) for d in range(dp)
              for q in range(pp)}
    assert sorted(coords) == list(range(n))
    which = {"tp": 0, "dp": 1, "pp": 2}[axis]
    groups: dict[tuple, list[int]] = {}
    for rank, c in sorted(coords.items()):
        groups.setdefault(c[:which] + c[which + 1:], []).append(rank)
    return list(groups.values())


@pytest.mark.timeout(30)
def test_links_follow_megatron_cores_default_rank_order():
    spec, cluster = planner.WORKED["7B on 64 GPUs of 80 GB"]
    assert cluster.order == "tp-dp-pp"
    lay = planner.Layout(4, 2, 8, 1, 0, 0)
    per_node = cluster.gpus_per_node

    def in_one_node(groups):
        return all(len({r // per_node for r in g}) == 1 for g in groups)

    # by Megatron's formula: a dp group (4 ranks, 2 apart) stays in a node, a pp group does not
    assert in_one_node(megatron_groups(64, 2, 4, 8, "dp"))
    assert not in_one_node(megatron_groups(64, 2, 4, 8, "pp"))
    assert planner.strides(cluster, lay) == {"tp": 1, "cp": 2, "dp": 2, "pp": 8}
    # so the dp all-reduce is priced on NVLink and the pipeline sends on the network, by hand:
    ring = lambda S, n, a, bw: 2 * (n - 1) * a + 2 * (n - 1) / n * S / bw  # noqa: E731
    grads = math.ceil(spec.params() / (2 * 8)) * 2
    act = 1 * spec.seq_len * spec.d_model * 2
    m = spec.global_batch // 4
    terms = planner.step_terms(spec, cluster, lay)
    assert terms["dp_comm"] == pytest.approx(ring(grads, 4, 5e-6, 360e9), rel=1e-12)
    assert terms["pp_comm"] == pytest.approx((m + 8 - 1) * 2 * (10e-6 + act / 40e9), rel=1e-12)
    # control: the other order (tp-pp-dp) swaps them: pp neighbours 2 apart, dp 16 apart
    swapped = dataclasses.replace(cluster, order="tp-pp-dp")
    assert planner.strides(swapped, lay) == {"tp": 1, "cp": 2, "pp": 2, "dp": 16}
    other = planner.step_terms(spec, swapped, lay)
    assert other["dp_comm"] == pytest.approx(ring(grads, 4, 10e-6, 40e9), rel=1e-12)
    assert other["dp_comm"] > 5 * terms["dp_comm"]
    with pytest.raises(ValueError, match="order"):
        planner.Cluster(n_gpus=8, **planner.H100_NODE, order="pp-dp-tp")


def hand_times(h, pairs, B, m, W, F, alpha, beta):
    """The tiny MLP's three layouts by hand (float32, one row = one token, SGD)."""
    psi = pairs * 2 * h * h
    c = 6 * psi * B / F  # whole step's compute on one rank
    ring = lambda S, n: 2 * (n - 1) * alpha + 2 * (n - 1) / n * S * beta  # noqa: E731
    dp = c / W + ring(4 * psi, W)
    tp = c / W + pairs * 2 * ring(4 * B * h, W)
    micro = B // m
    pp = (m + W - 1) * c / W / m + 2 * (W - 1) * (alpha + 4 * micro * h * beta)  # isend: fill, drain
    return {"dp": dp, "tp": tp, "pp": pp}


@pytest.mark.timeout(30)
def test_predicted_order_matches_hand_arithmetic():
    cfg = train.Config()
    F, alpha, beta = 50e9, 200e-6, 1 / 1e9  # stated round constants (the lesson quotes them)
    cluster = real_layouts.cpu_cluster(2, F, alpha, beta)
    spec = real_layouts.tiny_spec(cfg.width, cfg.pairs, cfg.batch)
    got = {k: planner.step_time(spec, cluster, real_layouts.layout_for(k, 2, cfg.batch, cfg.micro_batches))
           for k in train.KINDS}
    want = hand_times(cfg.width, cfg.pairs, cfg.batch, cfg.micro_batches, 2, F, alpha, beta)
    for k in train.KINDS:
        assert got[k] == pytest.approx(want[k], rel=1e-12)
    assert sorted(got, key=got.get) == ["pp", "dp", "tp"]
    assert train.ranked_pairs(got) == [("pp", "dp"), ("pp", "tp"), ("dp", "tp")]
    # Megatron's blocking sends (the worked pairs' default): every slot waits for two messages
    blocking = planner.step_time(spec, dataclasses.replace(cluster, async_p2p=False),
                                 real_layouts.layout_for("pp", 2, cfg.batch, cfg.micro_batches))
    micro = cfg.batch // cfg.micro_batches
    extra = (cfg.micro_batches + 2 - 1 - 1) * 2 * (alpha + 4 * micro * cfg.width * beta)
    assert blocking == pytest.approx(got["pp"] + extra, rel=1e-12)


@pytest.mark.timeout(30)
def test_ranked_pairs_leave_close_predictions_unranked():
    got = train.ranked_pairs({"a": 1.0, "b": 1.49, "c": 1.5, "d": 3.0})
    assert got == [("a", "c"), ("a", "d"), ("b", "d"), ("c", "d")]
    assert train.ranked_pairs({"a": 1.0, "b": 1.2}) == []


@pytest.mark.timeout(30)
def test_masks_cancel_in_one_process():
    world, n = 5, 1000
    xs = [torch.randn(n, dtype=torch.float64) * 10 for _ in range(world)]
    masked = [torch.remainder(secure_agg.payload(x, 16) + secure_agg.mask_for(r, world, n + 1, 3, 7), secure_agg.MOD)
              for r, x in enumerate(xs)]
    plain = [secure_agg.payload(x, 16) for x in xs]
    assert torch.equal(torch.remainder(sum(masked), secure_agg.MOD), torch.remainder(sum(plain), secure_agg.MOD))
    total = secure_agg.decode(sum(masked)[1:], 16)
    assert (total - sum(xs)).abs().max() <= world * 2.0 ** -17
    assert secure_agg.decode(sum(masked)[:1], 0).item() == world
    # one client missing: its partners' masks stay; slot 0 is no longer the survivors' count
    partial = torch.remainder(sum(masked[:-1]), secure_agg.MOD)
    assert secure_agg.decode(partial[:1], 0).item() != world - 1
    # a single masked vector says nothing obvious: its values spread over [0, 2^32)
    assert masked[0].double().mean().item() == pytest.approx(2.0 ** 31, rel=0.05)
    assert secure_agg.decode(secure_agg.encode(torch.tensor([-1.5, 2.25]), 16), 16).tolist() == [-1.5, 2.25]


@pytest.mark.timeout(30)
def test_clip_and_noise_give_the_stated_variance():
    g = torch.Generator().manual_seed(0)
    big = torch.full((1000,), 1.0, dtype=torch.float64)  # norm 31.6: clipped to 2
    clipped = secure_agg.clip_and_noise(big, 2.0, 0.0, 4, g)
    assert clipped.norm().item() == pytest.approx(2.0, rel=1e-12)
    zero = torch.zeros(200_000, dtype=torch.float64)
    noisy = secure_agg.clip_and_noise(zero, 2.0, 0.5, 4, g)  # per client z·C/√W = 0.5
    assert noisy.std().item() == pytest.approx(0.5, rel=0.01)
    total = sum(secure_agg.clip_and_noise(zero[:50_000], 2.0, 0.5, 4, g) for _ in range(4))
    assert total.std().item() == pytest.approx(1.0, rel=0.02)  # the sum carries z·C


def one_round(cfg: fedavg.Config, pairwise: bool):
    """Worker: one FedAvg round on the shards; returns the new global parameters."""
    import torch.distributed as dist

    info = rank_info(dist.get_rank(), dist.get_world_size())
    (X, y), _ = fedavg.split_data(cfg, info.world_size)
    Xc, yc = fedavg.client_shard(X, y, info.rank, cfg.shard, cfg.skew, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.features, cfg.hidden, fedavg.N_CLASSES, n_layers=2).double()
    if pairwise:
        fedavg.fedavg_round(model, Xc, yc, cfg, info, 0, secure_agg.CountingAllReduce())
    else:  # the broken variant: masks that do not pair up
        start = parameters_to_vector(model.parameters()).detach().clone()
        g = torch.Generator().manual_seed(cfg.seed * 7919 + info.rank)
        fedavg.local_train(model, Xc, yc, cfg.local_steps, cfg, g)
        delta = parameters_to_vector(model.parameters()).detach() - start
        total, count, _ = secure_agg.secure_sum(delta, info.rank, info.world_size, cfg.seed, 0, cfg.fraction_bits,
                                                secure_agg.CountingAllReduce(), info.device, pairwise=False)
        vector_to_parameters(start + total / info.world_size, model.parameters())
    return parameters_to_vector(model.parameters()).detach()


def both_rounds(cfg):
    return one_round(cfg, True), one_round(cfg, False)


@pytest.mark.timeout(60)
def test_secure_fedavg_round_equals_float_reference():
    cfg, world = fedavg.Config(), 2
    results = run_on_ranks(both_rounds, world, cfg, timeout=50)
    (X, y), _ = fedavg.split_data(cfg, world)
    torch.manual_seed(cfg.seed)
    start = parameters_to_vector(MLP(cfg.features, cfg.hidden, fedavg.N_CLASSES, n_layers=2).double().parameters()).detach()
    deltas = []
    for r in range(world):  # each client by hand: plain SGD on its shard from the global start
        Xc, yc = fedavg.client_shard(X, y, r, cfg.shard, cfg.skew, cfg.seed)
        torch.manual_seed(cfg.seed)
        m = MLP(cfg.features, cfg.hidden, fedavg.N_CLASSES, n_layers=2).double()
        g = torch.Generator().manual_seed(cfg.seed * 7919 + r)
        for _ in range(cfg.local_steps):
            idx = torch.randint(0, len(Xc), (cfg.batch_size,), generator=g)
            m.zero_grad()
            torch.nn.functional.cross_entropy(m(Xc[idx]), yc[idx]).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= cfg.lr * p.grad
        deltas.append(parameters_to_vector(m.parameters()).detach() - start)
    reference = start + sum(deltas) / world
    bound = 2.0 ** -(cfg.fraction_bits + 1) + 1e-12  # rounding to the fixed-point grid
    for secure, broken in results:
        assert (secure - reference).abs().max().item() <= bound
        assert (broken - reference).abs().max().item() > 1.0  # unpaired masks: garbage
    assert all(torch.equal(results[0][0], r[0]) for r in results)  # every client, one model


@pytest.mark.timeout(90)
def test_fedavg_script(tmp_path):
    run = run_torchrun(HERE / "fedavg.py", nproc=2, out_dir=tmp_path, timeout=85)
    checks = {c["name"]: c for c in run.summary["checks"]}
    assert all(c["ok"] for c in checks.values())
    assert checks["all-reduces, one per round"]["measured"] == fedavg.Config().rounds
    assert checks["FedAvg test accuracy"]["measured"] >= 0.75
    assert checks["best single client's test accuracy (trained alone as long)"]["measured"] < 0.7
    assert checks["masked sum == plain sum (integers mod 2^32, elements differing)"]["measured"] == 0
    assert checks["control: unpaired masks, elements differing from the plain sum"]["measured"] > 0


@pytest.mark.timeout(90)
def test_plan_script(tmp_path):
    run = run_torchrun(HERE / "train.py", nproc=2, out_dir=tmp_path, timeout=85,
                       args=["--repeats", "3", "--warmup", "1"])
    checks = run.summary["checks"]
    assert all(c["ok"] for c in checks if c["kind"] != "timing")
    assert [c["kind"] for c in checks].count("timing") == 1
    figures = run.summary["figures"]
    for k in train.KINDS:
        assert figures[f"{k}=2 step time"]["expected"] > 0 and figures[f"{k}=2 step time"]["measured"] > 0
