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

from chapters.ch30_frontier import fedavg, mesh_bytes, planner, real_layouts, secure_agg, train
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


# --- the planner's bytes per mesh dimension (chapter 25's composed dp x tp x pp x cp run) -------

CPU_LLAMA = mesh_bytes.Llama(vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, seq_len=64)
MESH16 = mesh_bytes.Mesh(dp=2, tp=2, pp=2, cp=2, micro_batch_size=1, micro_batches=2)
FP32 = mesh_bytes.Dtypes.of(torch.float32)
COMPOSED_LLAMA = mesh_bytes.Llama(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, seq_len=32)
"""Chapter 25's composed run's Llama (composed.py's default `Run`)."""


def test_llama_shape_is_chapter_25s():
    from types import SimpleNamespace

    from chapters.ch25_llm.model import PRESETS, n_params

    assert mesh_bytes.Llama.from_preset(PRESETS["cpu"]) == CPU_LLAMA
    # by hand: per layer q, o 64·64; k, v 32·64; gate, up, down 176·64; two norms 64
    per_layer = 2 * 4096 + 2 * 2048 + 3 * 11264 + 128
    assert CPU_LLAMA.params() == 2 * per_layer + 2 * 1024 * 64 + 64 == 223552
    for p in PRESETS.values():  # chapter 25's own closed form, both presets
        cfg = SimpleNamespace(hidden_size=p["hidden_size"], intermediate_size=p["ffn_size"],
                              num_hidden_layers=p["n_layers"], vocab_size=p["vocab_size"],
                              num_attention_heads=p["n_heads"], num_key_value_heads=p["n_kv_heads"])
        assert mesh_bytes.Llama.from_preset(p).params() == n_params(cfg)
    assert mesh_bytes.layout_error(CPU_LLAMA, MESH16) is None
    assert "tp=4" in mesh_bytes.layout_error(CPU_LLAMA, dataclasses.replace(MESH16, tp=4))  # 2 KV heads
    assert "stage would be empty" in mesh_bytes.layout_error(CPU_LLAMA, dataclasses.replace(MESH16, pp=4))


def test_model_state_bytes_by_hand_with_controls():
    """Stage 0 (embedding + layer 0), tp rank 0, shard rank 0 of dp x cp = 4, fp32 AdamW."""
    # TP-local rows, then ⌈rows/4⌉ of them: embed 512 -> 128 (x64), q 32 -> 8 (x64), k, v 16 -> 4,
    # o 64 -> 16 (x32), gate, up 88 -> 22 (x64), down 64 -> 16 (x88), norms 64 -> 16
    numel = 128 * 64 + 8 * 64 + 2 * 4 * 64 + 16 * 32 + 2 * 22 * 64 + 16 * 88 + 2 * 16
    assert numel == 13984
    want = {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel + 10 * 4}  # 10 step scalars
    got = mesh_bytes.model_state_bytes(CPU_LLAMA, MESH16, FP32)
    assert {k: got[k] for k in want} == want and got["total"] == sum(want.values())
    # every element of each stage on exactly one (tp, shard) rank, the norms (replicated over
    # tp: 2 on stage 0, 2 and the final one on stage 1) on one per tp rank
    for stage, norms in ((0, 2 * 64), (1, 3 * 64)):
        held = sum(mesh_bytes.model_state_bytes(CPU_LLAMA, MESH16, FP32, stage, t, s)["params"]
                   for t in range(2) for s in range(4))
        assert held == 4 * (sum(math.prod(sh) for _, sh, _ in CPU_LLAMA.stage_params(stage, 2)) + norms)
    # controls, rejected by the same comparison: optimizer state not divided over dp x cp, and
    # the shard group taken as dp alone (cp ranks holding the same shard)
    unsharded = mesh_bytes.model_state_bytes(CPU_LLAMA, dataclasses.replace(MESH16, dp=1, cp=1), FP32)
    assert unsharded["optimizer"] != want["optimizer"]
    dp_only = mesh_bytes.model_state_bytes(CPU_LLAMA, dataclasses.replace(MESH16, cp=1), FP32)
    assert dp_only["params"] != want["params"]
    # float64 (chapter 25's parity runs): every byte doubles, AdamW's step too
    f64 = mesh_bytes.model_state_bytes(CPU_LLAMA, MESH16, mesh_bytes.Dtypes.of(torch.float64))
    assert f64["total"] == 2 * got["total"]


def sharded_state_bytes(llama, dp: int, cp: int, tp: int, rank: int, plan: str) -> tuple[tuple, int, int]:
    """Torch's own sharding, measured: the Llama's parameters (pp = 1) under DTensor TP
    (torchtitan's plan) and FSDP2 over the flattened dp x cp mesh, on a fake process group (one
    process plays `rank`; no data moves, shapes are real), then one AdamW step on zero
    gradients. Returns (mesh coordinate, parameter bytes, optimizer-state bytes)."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    h, kv = llama.hidden, llama.kv_heads * (llama.hidden // llama.heads)

    def linear(i, o):
        return nn.Linear(i, o, bias=False)

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * cp * tp)
    try:
        mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
        class Parts(nn.Module):  # fully_shard wants modules with a forward; none runs here
            def __init__(self, **parts):
                super().__init__()
                for name, part in parts.items():
                    setattr(self, name, part)

            def forward(self, x):
                raise NotImplementedError

        layers = nn.ModuleList(Parts(
            q=linear(h, h), k=linear(h, kv), v=linear(h, kv), o=linear(h, h),
            gate=linear(h, llama.ffn), up=linear(h, llama.ffn), down=linear(llama.ffn, h),
            n1=nn.RMSNorm(h), n2=nn.RMSNorm(h)) for _ in range(llama.layers))
        model = Parts(embed=nn.Embedding(llama.vocab, h), layers=layers, norm=nn.RMSNorm(h),
                      head=linear(h, llama.vocab))
        col, row, seq = ColwiseParallel, RowwiseParallel, SequenceParallel
        if plan == "torchtitan":
            parallelize_module(model, mesh["tp"], {"embed": row(), "head": col(), "norm": seq()})
        norms = {"n1": seq(), "n2": seq()} if plan == "torchtitan" else {}
        for layer in layers:
            parallelize_module(layer, mesh["tp"], {"q": col(), "k": col(), "v": col(), "o": row(),
                                                   "gate": col(), "up": col(), "down": row(), **norms})
        shard_mesh = mesh["dp", "cp"]._flatten("dp_cp")
        for layer in layers:
            fully_shard(layer, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(model.parameters())
        opt.step()

        def local(t):
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        params = sum(local(p) for p in model.parameters())
        state = sum(local(v) for st in opt.state.values() for v in st.values())
        return tuple(mesh.get_coordinate()), params, state
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dp,cp,tp,rank,plan", [(2, 2, 2, 5, "torchtitan"), (3, 4, 2, 21, "torchtitan"),
                                                (3, 4, 2, 6, "torchtitan"), (3, 4, 2, 21, "blocks")])
def test_model_state_equals_torchs_sharding(dp, cp, tp, rank, plan):
    """At dp x cp = 12 the k and v projections' 16 TP-local rows give ranks 8-11 of the shard
    group nothing (torch.chunk makes 8 pieces of 2): rank 21 is one of them, rank 6 is not."""
    (d, c, t), params, state = sharded_state_bytes(CPU_LLAMA, dp, cp, tp, rank, plan)
    mesh = mesh_bytes.Mesh(dp, tp, 1, cp, plan=plan)
    got = mesh_bytes.model_state_bytes(CPU_LLAMA, mesh, FP32, stage=0, t=t, s=d * cp + c)
    assert (got["params"], got["optimizer"]) == (params, state)
    other = mesh_bytes.model_state_bytes(CPU_LLAMA, dataclasses.replace(mesh, plan=(
        "blocks" if plan == "torchtitan" else "torchtitan")), FP32, stage=0, t=t, s=d * cp + c)
    assert other["params"] != params  # control: the other plan's split
    if (dp, cp) == (3, 4):  # control: shards taken as an even Ψ/n per rank, the same comparison
        even = 4 * CPU_LLAMA.params() / (tp * dp * cp)
        assert even != params
        assert mesh_bytes.chunk_rows(16, 12, d * cp + c) == (0 if rank == 21 else 2)


def test_comm_bytes_by_hand_with_controls():
    """Stage 0, tp rank 0 of MESH16 (b = 1, m = 2 micro-batches, fp32, checkpointing on)."""
    comm = mesh_bytes.comm_bytes(CPU_LLAMA, MESH16, FP32)
    tot = mesh_bytes.totals(comm, MESH16)
    # dp x cp = 4: the units' padded wholes: layer 0 (q 32x64, k, v 16x64, o 64x32, gate, up
    # 88x64 -> 4·22 rows, down 64x88, norms 64) and the root (embedding's 512x64); one
    # all-gather (reshard_after_forward=False under pp) and one reduce-scatter each
    layer = 32 * 64 + 2 * 16 * 64 + 64 * 32 + 2 * 88 * 64 + 64 * 88 + 2 * 64
    whole = 4 * (layer + 512 * 64)
    assert tot["dp_cp"]["boundary"] == whole // 4 + whole == 279680  # a-g hands its shard, r-s the whole
    assert tot["dp_cp"]["wire"] == 2 * whole * 3 / 4
    # tp = 2: (b, s/cp, h) = 1·32·64 fp32 = 8192 bytes per call; per layer and micro-batch 4 a-g
    # + 4 r-s, recomputation 2 a-g + 1 r-s; the embedding's r-s and its gradient's a-g
    act = 32 * 64 * 4
    assert comm["tp"] == [("all_gather", 2 * 6 + 2, act), ("reduce_scatter", 2 * 5 + 2, act),
                          ("all_reduce", 2 * 2, 64 * 4)]  # the two norms' weight gradients
    assert tot["tp"]["wire"] == 26 * act / 2 + 4 * 64 * 4 * 2 * 1 / 2
    # pp = 2: the first stage sends each micro-batch's activation (b, s/(cp·tp), h) = 16·64·4
    assert tot["pp"]["boundary"] == 2 * 16 * 64 * 4
    # cp = 2: K and V of 2 heads x 32 tokens x 16 dims per hop: forward, recomputed forward and
    # backward 1 hop each, dK/dV 2 hops, per micro-batch
    assert tot["cp"]["boundary"] == 2 * (1 + 1 + 1 + 2) * 2 * (2 * 32 * 16 * 4)
    # chapter 18's own formula for its ring (matched there to its counter), plus the recomputation
    from chapters.ch18_long_context.ring import ring_bytes_per_rank

    ring = ring_bytes_per_rank(1, 2, 32, 16, 4, 2)
    assert tot["cp"]["boundary"] == 2 * (2 * ring["forward"] + ring["backward"])
    # sequence parallelism moves what Megatron's 4 all-reduces per layer move (Korthikanti et
    # al. 2022): without checkpointing, the layers' a-g + r-s on the wire == 4 ring all-reduces
    # of (b, s, h) per layer, at tp = 4 (at tp = 2, 2(n-1)/n = 1 and the control below is blind)
    wide, one = dataclasses.replace(CPU_LLAMA, kv_heads=4), mesh_bytes.Mesh(1, 4, 1, 1)
    plain = mesh_bytes.comm_bytes(wide, one, FP32, recompute=False)["tp"]
    full = 64 * 64 * 4
    ends = 4 * full * 3 / 4  # the one stage is first and last: the embedding's and head's a-g, r-s
    norms = 5 * 64 * 4 * mesh_bytes.WIRE["all_reduce"](4)  # the norms' weight gradients
    layers_wire = sum(c * x * mesh_bytes.WIRE[k](4) for k, c, x in plain) - ends - norms
    assert layers_wire == 2 * 4 * mesh_bytes.WIRE["all_reduce"](4) * full == 12 * full  # 2 layers
    # controls, rejected by that comparison: the all-reduce counted 1x, a-g/r-s counted whole
    assert 2 * 4 * 1.0 * full != layers_wire
    assert sum(c * x for k, c, x in plain if k != "all_reduce") - 4 * full != layers_wire
    raf = mesh_bytes.totals(mesh_bytes.comm_bytes(CPU_LLAMA, MESH16, FP32, reshard_after_forward=True), MESH16)
    assert raf["dp_cp"]["boundary"] != 279680  # all-gathers per micro-batch, forward and backward
    no_rc = mesh_bytes.totals(mesh_bytes.comm_bytes(CPU_LLAMA, MESH16, FP32, recompute=False), MESH16)
    assert no_rc["tp"]["boundary"] != tot["tp"]["boundary"] and no_rc["cp"]["boundary"] != tot["cp"]["boundary"]
    # a middle stage sends both ways, the last only gradients back; a dimension of 1 moves nothing
    four = dataclasses.replace(MESH16, pp=2, dp=1, cp=1, tp=1)
    last = mesh_bytes.totals(mesh_bytes.comm_bytes(CPU_LLAMA, four, FP32, stage=1), four)
    assert last["pp"]["boundary"] == 2 * 64 * 64 * 4
    assert last["dp_cp"]["boundary"] == last["tp"]["boundary"] == last["cp"]["boundary"] == 0


def test_activation_band_by_hand():
    """Checkpointing per layer: stage 0 keeps its one layer's input for min(m, pp) = 2 micro-batches,
    (b, s/(cp·tp), h) = 16 x 64 each; the top adds one layer whole (low 2h + 4h/t + 3f/t, high
    + 7h/t + f/t per token, 32 tokens)."""
    low, high = mesh_bytes.activation_band(CPU_LLAMA, MESH16, FP32)
    assert low == 2 * 16 * 64 * 4
    assert high == low + 32 * (2 * 64 + 4 * 32 + 3 * 88 + 7 * 32 + 88) * 4
    # controls: a count that forgets cp's cut of the sequence, or 1F1B's in-flight micro-batches
    no_cp = mesh_bytes.activation_band(CPU_LLAMA, dataclasses.replace(MESH16, cp=1), FP32)
    assert no_cp[0] == 2 * low
    one = mesh_bytes.activation_band(CPU_LLAMA, dataclasses.replace(MESH16, micro_batches=1), FP32)
    assert one[0] == low / 2
    off = mesh_bytes.activation_band(CPU_LLAMA, MESH16, FP32, recompute=False)
    assert off == (2 * 32 * (2 * 64 + 4 * 32 + 3 * 88) * 4, 2 * 32 * (2 * 64 + 11 * 32 + 4 * 88) * 4)


def test_compare_takes_equal_counts_and_rejects_the_controls():
    state = mesh_bytes.model_state_bytes(CPU_LLAMA, MESH16, FP32)
    comm = mesh_bytes.totals(mesh_bytes.comm_bytes(CPU_LLAMA, MESH16, FP32), MESH16)
    low, high = mesh_bytes.activation_band(CPU_LLAMA, MESH16, FP32)
    measured = {"model_state": {k: state[k] for k in ("params", "grads", "optimizer")},
                "comm": {d: v["boundary"] for d, v in comm.items()}, "activations": (low + high) / 2}
    assert all(r["ok"] for r in mesh_bytes.compare(CPU_LLAMA, MESH16, FP32, measured))
    bad = {**measured, "comm": {**measured["comm"], "tp": comm["tp"]["boundary"] + 4}}
    assert [r["name"] for r in mesh_bytes.compare(CPU_LLAMA, MESH16, FP32, bad) if not r["ok"]] == [
        "bytes per step at the boundary: tp"]
    bad = {**measured, "activations": 2 * high}
    assert not mesh_bytes.compare(CPU_LLAMA, MESH16, FP32, bad)[-1]["ok"]


def test_blocks_plan_by_hand():
    """Chapter 25's composed.py plan: Megatron's blocks only (all-reduces), the embedding, norms
    and head whole on every tp rank, no sequence parallelism; stage 0, tp rank 0, shard rank 0."""
    mesh = dataclasses.replace(MESH16, plan="blocks")
    numel = 256 * 64 + 8 * 64 + 2 * 4 * 64 + 16 * 32 + 2 * 22 * 64 + 16 * 88 + 2 * 16
    got = mesh_bytes.model_state_bytes(CPU_LLAMA, mesh, FP32)
    assert (got["params"], got["optimizer"]) == (4 * numel, 8 * numel + 10 * 4)
    comm = mesh_bytes.comm_bytes(CPU_LLAMA, mesh, FP32, reshard_after_forward=False)
    act = 32 * 64 * 4  # (b, s/cp, h), whole on every tp rank
    # per layer and micro-batch 2 forward, 5 backward (q, k, v, gate, up each reduce their input's
    # gradient: Megatron's fused qkv and gate-up would make it 2), o's again in the recomputation
    assert comm["tp"] == [("all_reduce", 2 * 8, act)]
    rc_off = mesh_bytes.comm_bytes(CPU_LLAMA, mesh, FP32, recompute=False)["tp"]
    assert rc_off == [("all_reduce", 2 * 7, act)]
    tot = mesh_bytes.totals(comm, mesh)
    layer = 32 * 64 + 2 * 16 * 64 + 64 * 32 + 2 * 88 * 64 + 64 * 88 + 2 * 64
    assert tot["dp_cp"]["boundary"] == 4 * (layer + 1024 * 64) * (1 + 4) // 4
    assert tot["pp"]["boundary"] == 2 * act and tot["tp"]["wire"] == 16 * act * 2 * 1 / 2
    low, high = mesh_bytes.activation_band(CPU_LLAMA, mesh, FP32)
    assert low == 2 * 32 * 64 * 4  # each layer's whole input, 2 micro-batches in flight
    assert mesh_bytes.layout_error(CPU_LLAMA, dataclasses.replace(mesh, plan="megatron")) is not None


def test_planner_panels_show_every_shape():
    """The 70B panel's tp=8 x pp bar: 80 layers do not split into 512/8 = 64 stages, so the
    deepest pipeline is 16 stages with dp = 4 (the old shape 1 x 8 x 64 had no layout at all)."""
    from chapters.ch30_frontier import plots

    spec, cluster = planner.WORKED["70B on 512 GPUs of 80 GB"]
    assert plots.deepest_tp8_pipeline(spec, 512) == (4, 8, 16)
    assert not any((lay.dp, lay.tp, lay.pp) == (1, 8, 64) for lay in planner.layouts(spec, 512))
    for name in planner.WORKED:
        lays = plots.alternatives(name)
        assert len(lays) == 4 and any(lay.tp == 8 and lay.pp > 1 for lay in lays)
    assert plots.deepest_tp8_pipeline(*planner.WORKED["7B on 64 GPUs of 80 GB"][:1], 64) == (1, 8, 8)


class BoundaryCount:
    """A TorchDispatchMode that counts, per process group, the bytes each collective is handed:
    an all-gather's input (the shard), a reduce-scatter's input, an all-reduce's tensor (FSDP2
    calls c10d's ops, DTensor the functional ones; both pass through dispatch)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, dict[str, int]] = {}

        def name(group) -> str:  # c10d's ops carry the group as a TorchScript object
            return group if isinstance(group, str) else torch.distributed.ProcessGroup.unbox(group).group_name

        def add(group, kind: str, t: torch.Tensor) -> None:
            group = name(group)
            counts.setdefault(group, {}).setdefault(kind, 0)
            counts[group][kind] += t.numel() * t.element_size()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if name == "c10d._allgather_base_.default":
                    add(args[2], "all_gather", args[1])
                elif name == "c10d._reduce_scatter_base_.default":
                    add(args[2], "reduce_scatter", args[1])
                elif name == "_c10d_functional.all_reduce.default":
                    add(args[2], "all_reduce", args[0])
                elif name == "_c10d_functional.all_gather_into_tensor.default":
                    add(args[2], "all_gather", args[0])
                elif name == "_c10d_functional.reduce_scatter_tensor.default":
                    add(args[3], "reduce_scatter", args[0])
                elif "c10d" in name and "wait" not in name and "wrap" not in name:
                    add("?", name, args[0] if isinstance(args[0], torch.Tensor) else args[0][0])
                return func(*args, **(kwargs or {}))

        self.counts, self.mode = counts, Mode()


def composed_step_bytes(llama, dp_cp: int, tp: int, recompute: bool,
                        plan: str = "blocks") -> dict[str, dict[str, int]]:
    """One forward and backward of the Llama (pp = 1, one micro-batch of one sequence) on a fake
    process group (rank 0 of dp_cp x tp; no data moves), FSDP2 per block and root with
    reshard_after_forward=False, checkpointing per block (non-reentrant, torch's default early
    stop), under a tensor-parallel plan: "blocks" (chapter 25's composed.py: torch's
    Colwise/RowwiseParallel on the blocks' linears) or "torchtitan" (its Llama plan: sequence
    parallel norms, PrepareModuleInput gathering attention's and the MLP's input once, row-wise
    outputs reduce-scattered, the embedding and the head split, loss parallel). Returns the
    bytes handed to collectives per mesh dimension and kind."""
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.checkpoint import checkpoint

    h, d = llama.hidden, llama.hidden // llama.heads

    def linear(i, o):
        return nn.Linear(i, o, bias=False)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            kv = llama.kv_heads * d
            self.q, self.k, self.v, self.o = (linear(h, n) for n in (h, kv, kv, h))

        def forward(self, y):
            B, T, _ = y.shape
            q, k, v = (m(y).view(B, T, -1, d).transpose(1, 2) for m in (self.q, self.k, self.v))
            rep = q.shape[1] // k.shape[1]  # grouped-query K/V repeated to the local heads
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                               v.repeat_interleave(rep, 1), is_causal=True)
            return self.o(a.transpose(1, 2).reshape(B, T, -1))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = linear(h, llama.ffn), linear(h, llama.ffn), linear(llama.ffn, h)

        def forward(self, y):
            return self.down(F.silu(self.gate(y)) * self.up(y))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.attn, self.n2, self.mlp = nn.RMSNorm(h), Attention(), nn.RMSNorm(h), MLP()

        def layer(self, x):
            x = x + self.attn(self.n1(x))
            return x + self.mlp(self.n2(x))

        def forward(self, x):
            return checkpoint(self.layer, x, use_reentrant=False) if recompute else self.layer(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.norm = nn.Embedding(llama.vocab, h), nn.RMSNorm(h)
            self.layers = nn.ModuleList(Block() for _ in range(llama.layers))
            self.head = linear(h, llama.vocab)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp_cp * tp)
    try:
        mesh = init_device_mesh("cpu", (dp_cp, tp), mesh_dim_names=("dp_cp", "tp"))
        model = Model()
        col, row = ColwiseParallel, RowwiseParallel
        linears = {"attn.q": col(), "attn.k": col(), "attn.v": col(), "attn.o": row(),
                   "mlp.gate": col(), "mlp.up": col(), "mlp.down": row()}
        if plan == "torchtitan":
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            parallelize_module(model, mesh["tp"], {
                "embed": row(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "head": col(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
            linears.update({"attn.o": row(output_layouts=Shard(1)), "mlp.down": row(output_layouts=Shard(1)),
                            "n1": SequenceParallel(), "n2": SequenceParallel(), "attn": gather, "mlp": gather})
        for block in model.layers:
            parallelize_module(block, mesh["tp"], linears)
            fully_shard(block, mesh=mesh["dp_cp"], reshard_after_forward=False)
        fully_shard(model, mesh=mesh["dp_cp"], reshard_after_forward=False)
        tokens = torch.randint(0, llama.vocab, (1, llama.seq_len))
        count = BoundaryCount()
        with count.mode:
            logits = model(tokens)
            logits = logits.to_local() if plan == "torchtitan" else logits  # loss parallel
            logits.float().square().mean().backward()
        names = {mesh[dim].get_group().group_name: dim for dim in ("dp_cp", "tp")}
        return {names.get(g, g): kinds for g, kinds in count.counts.items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plan", mesh_bytes.PLANS)
def test_comm_bytes_equal_the_collectives_torch_issues(plan):
    """Both tensor-parallel plans' bytes per dimension against the collectives torch itself
    issues, counted at the boundary (a dispatch mode) on a fake process group, with and without
    checkpointing."""
    llama = CPU_LLAMA if plan == "torchtitan" else COMPOSED_LLAMA
    mesh = mesh_bytes.Mesh(dp=2, tp=2, pp=1, cp=1, plan=plan)
    got = {}
    for recompute in (True, False):
        got[recompute] = composed_step_bytes(llama, 2, 2, recompute, plan)
        want = mesh_bytes.comm_bytes(llama, mesh, FP32, recompute=recompute,
                                     reshard_after_forward=False)
        for dim in ("dp_cp", "tp"):
            predicted: dict[str, int] = {}
            for kind, calls, size in want[dim]:
                handed = size // mesh_bytes.HANDED[kind](2)  # an all-gather is handed its half
                predicted[kind] = predicted.get(kind, 0) + calls * handed
            assert got[recompute][dim] == predicted, (plan, dim, recompute)
        assert set(got[recompute]) == {"dp_cp", "tp"}  # nothing on another group
    act = llama.seq_len * 64 * 4  # (1, s, h) fp32
    if plan == "blocks":
        # controls, rejected by the same comparison: Megatron's fused count (4 all-reduces per
        # layer and micro-batch), a recomputation that reruns every forward all-reduce
        assert got[False]["tp"]["all_reduce"] == 2 * 7 * act != 2 * 4 * act
        assert got[True]["tp"]["all_reduce"] == 2 * 8 * act != 2 * (7 + 2) * act
    else:
        # 2 layers x (4 + 2 recomputed) + embedding/head a-g of half; 2 x (4 + 1) + 2 r-s;
        # the five norms' partial gradients (h each) all-reduced; control: no early stop
        assert got[True]["tp"] == {"all_gather": 14 * act // 2, "reduce_scatter": 12 * act,
                                   "all_reduce": 5 * 64 * 4}
        assert got[True]["tp"]["reduce_scatter"] != (2 * 6 + 2) * act



def own_brute_force_cp(spec: planner.ModelSpec, cluster: planner.Cluster):
    """Every (dp, tp, pp, cp, b, recompute, zero) with dp·tp·pp·cp = N, cp ≤ max_cp and 2·cp
    dividing the sequence; the fastest that fits (the tests' own loops)."""
    n, best = cluster.n_gpus, None
    for tp in range(1, n + 1):
        for pp in range(1, n + 1):
            for cp in range(1, spec.max_cp + 1):
                if n % (tp * pp * cp) or (cp > 1 and spec.seq_len % (2 * cp)):
                    continue
                dp = n // (tp * pp * cp)
                if (spec.n_heads % tp or (spec.kv_heads or spec.n_heads) % tp or spec.d_ff % tp
                        or spec.n_layers % pp or spec.global_batch % dp):
                    continue
                for b in (b for b in range(1, spec.global_batch // dp + 1) if (spec.global_batch // dp) % b == 0):
                    for r in range(3):
                        for z in range(4):
                            lay = planner.Layout(dp, tp, pp, b, r, z, cp)
                            if planner.memory_bytes(spec, lay) <= cluster.memory_bytes:
                                t = planner.step_time(spec, cluster, lay)
                                if best is None or (t, lay) < best:
                                    best = (t, lay)
    return best


@pytest.mark.timeout(60)
def test_planner_with_cp_equals_brute_force_and_chooses_cp():
    spec, cluster = planner.cp_case()
    t, lay = own_brute_force_cp(spec, cluster)
    plan_ = planner.search(spec, cluster)
    assert (plan_.layout, plan_.time) == (lay, t)
    assert str(lay) == "dp=4 tp=2 pp=1 cp=2 b=1 rc=selective ZeRO-1" and round(t, 3) == 2.481
    # control: the same planner without cp (max_cp = 1) picks another layout, slower
    no_cp = planner.search(dataclasses.replace(spec, max_cp=1), cluster)
    assert no_cp.layout.cp == 1 and no_cp.time > plan_.time
    assert (str(no_cp.layout), round(no_cp.time, 3)) == ("dp=4 tp=4 pp=1 b=1 rc=selective ZeRO-0", 2.523)


def test_cp_terms_by_hand():
    """7B at 32,768 tokens on 64 GPUs: dp=2 tp=4 pp=2 cp=4 (ranks tp, then cp, then dp, then pp)."""
    spec = dataclasses.replace(planner.LLAMA_7B, seq_len=32768, global_batch=64, max_cp=8)
    cluster = planner.WORKED["7B on 64 GPUs of 80 GB"][1]
    lay = planner.Layout(2, 4, 2, 1, 0, 1, cp=4)
    assert planner.strides(cluster, lay) == {"tp": 1, "cp": 4, "dp": 16, "pp": 32}
    ring = lambda S, n, a, bw: 2 * (n - 1) * a + 2 * (n - 1) / n * S / bw  # noqa: E731
    m, slots = 32, 32 + 2 - 1
    act = 32768 // 4 * 4096 * 2  # (b, s/cp, h) in bf16
    want = {
        "compute": slots * spec.flops_per_step(0) / 64 / m / (989e12 * 0.5),
        "tp_comm": slots * 16 * 4 * ring(act, 4, 5e-6, 360e9),  # in a node
        "pp_comm": slots * 2 * (10e-6 + act / 40e9),  # 32 apart: across nodes
        # ZeRO-1 over dp·cp = 8 ranks (cp ranks hold the same weights), across nodes
        "dp_comm": ring(math.ceil(spec.params() / 8) * 2, 8, 10e-6, 40e9),
        # K and V of 8192 tokens x 32·128/4 dims, 2(cp-1) + cp hops per layer, across nodes (cp·tp = 16)
        "cp_comm": slots * 16 * 10 * (10e-6 + 2 * 8192 * 1024 * 2 / 40e9),
    }
    got = planner.step_terms(spec, cluster, lay)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12), k
    # memory: ZeRO-1 over 8 ranks of Ψ/8, activations at s/cp tokens (chapter 05's count), 2 in flight
    from chapters.ch05_tensor_parallel.activations import layer_activation_bytes
    from chapters.ch06_hybrid_zero.memory import per_rank_bytes

    local = math.ceil(spec.params() / 8)
    states = per_rank_bytes(1, local, 8, 2, 2, 12)["total"]
    acts = 16 * 2 * layer_activation_bytes(8192, 1, 4096, 32, 4, sequence_parallel=True)
    assert planner.memory_bytes(spec, lay) == pytest.approx(states + acts, rel=1e-12)
    # controls, rejected by the same comparisons: optimizer sharded over dp alone, activations
    # at the whole sequence, the gradient ring over dp alone
    assert per_rank_bytes(1, local, 2, 2, 2, 12)["total"] + acts != pytest.approx(planner.memory_bytes(spec, lay))
    whole = 16 * 2 * layer_activation_bytes(32768, 1, 4096, 32, 4, sequence_parallel=True)
    assert states + whole != pytest.approx(planner.memory_bytes(spec, lay))
    assert ring(math.ceil(spec.params() / 8) * 2, 2, 10e-6, 40e9) != pytest.approx(got["dp_comm"])



# --- against chapter 25's composed run (the per-rank counts its 8-rank job recorded) ----------

@pytest.mark.timeout(60)
def test_planner_against_chapter_25s_composed_run():
    """Every rank of chapter 25's two layouts (dp2 x tp2 x pp2, pp2 x cp2 x tp2; float64, 1F1B,
    FSDP2 without resharding, checkpointing per block), as its job counted them inside the run
    (chapter 25's tests fail when a fresh job no longer matches the record): model state and the
    bytes each dimension's collectives were handed in one step equal `mesh_bytes` exactly, the
    activations lie in `activation_band`, at its bottom (each block's input)."""
    from chapters.ch30_frontier import against_ch25

    record = against_ch25.load()
    assert len(record["ranks"]) == 16
    rows = against_ch25.rows(record)
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {r["name"] for r in rows} == {
        "model state: params", "model state: grads", "model state: moments", "activations (band)",
        *(f"bytes per step at the boundary: {d}" for d in ("dp_cp", "tp", "pp", "cp"))}
    acts = [r for r in rows if r["name"] == "activations (band)"]
    assert all(r["measured"] == r["predicted"][0] for r in acts)
    # 1F1B: stage 0 holds both micro-batches, stage 1 one (GPipe would hold two on both)
    assert {r["measured"] for r in acts if r["stage"] == 0} == {2 * 2 * 32 * 64 * 8}
    assert {r["measured"] for r in acts if r["stage"] == 1} == {2 * 32 * 64 * 8}
    # controls, each rejected by the same comparison: a planner that does not shard over dp x cp,
    # FSDP2 resharding after forward (gathers per micro-batch), a ring without its dK/dV hops,
    # Megatron's fused count of tp all-reduces, a band that forgets cp's cut of the sequence
    by_layout = {r["layout"]: r for r in record["ranks"] if r["rank"] == 0}
    for name, rank0 in by_layout.items():
        llama, mesh, dt = against_ch25.setting(record, name)
        got = against_ch25.measured(rank0)
        flat = mesh_bytes.model_state_bytes(llama, dataclasses.replace(mesh, dp=1, cp=1), dt)
        assert flat["params"] != got["model_state"]["params"]
        raf = mesh_bytes.totals(mesh_bytes.comm_bytes(llama, mesh, dt, 0, reshard_after_forward=True,
                                                      pipelined=True), mesh)
        assert raf["dp_cp"]["boundary"] != got["comm"]["dp_cp"]
        if mesh.cp == 2:
            block = 4 * 2 * 16 * 16 * 8  # b x heads/tp (repeated) x s/cp x head dim, float64
            assert got["comm"]["cp"] == 2 * (1 * 3 + 2) * 2 * block
            assert got["comm"]["cp"] != 2 * (1 * 3) * 2 * block
            low, high = mesh_bytes.activation_band(llama, dataclasses.replace(mesh, cp=1), dt)
            assert not low <= got["activations"] <= high
        if mesh.plan == "blocks" and mesh.tp == 2:
            act = 2 * 32 * 64 * 8  # (b, s, h) float64, whole on each tp rank
            assert got["comm"]["tp"] == 2 * 1 * (2 + 5 + 1) * act  # 2 micro-batches, 1 block
            assert got["comm"]["tp"] != 2 * 1 * (4 + 1) * act


@pytest.mark.timeout(60)
def test_activation_band_holds_what_autograd_saves():
    """The course's Llama block (as in the fake-process-group test: RMSNorm, GQA with K/V repeated,
    SDPA, SwiGLU) in float64, one process: the bytes autograd saves inside the layers (unique
    storages, the weights and their transposed views left out) lie in `activation_band`, with
    checkpointing exactly at its bottom (each layer's input)."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    llama = COMPOSED_LLAMA
    h, d = llama.hidden, llama.hidden // llama.heads

    def linear(i, o):
        return nn.Linear(i, o, bias=False, dtype=torch.float64)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            kv = llama.kv_heads * d
            self.q, self.k, self.v, self.o = (linear(h, n) for n in (h, kv, kv, h))
            self.gate, self.up, self.down = linear(h, llama.ffn), linear(h, llama.ffn), linear(llama.ffn, h)
            self.n1, self.n2 = nn.RMSNorm(h, dtype=torch.float64), nn.RMSNorm(h, dtype=torch.float64)

        def forward(self, x):
            B, T, _ = x.shape
            y = self.n1(x)
            q, k, v = (m(y).view(B, T, -1, d).transpose(1, 2) for m in (self.q, self.k, self.v))
            rep = q.shape[1] // k.shape[1]
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                               v.repeat_interleave(rep, 1), is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(B, T, -1))
            y = self.n2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    def is_weight(t):
        base = t._base if t._base is not None else t
        return base.is_leaf and base.requires_grad

    torch.manual_seed(0)
    blocks = [Block() for _ in range(llama.layers)]
    mesh = mesh_bytes.Mesh(1, 1, 1, 1, micro_batch_size=4)
    dt = mesh_bytes.Dtypes.of(torch.float64)
    measured = {}
    for recompute in (False, True):
        saved: dict[int, int] = {}

        def pack(t, saved=saved):
            if not is_weight(t):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(4, llama.seq_len, h, dtype=torch.float64, requires_grad=True) * 1.0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        low, high = mesh_bytes.activation_band(llama, mesh, dt, recompute=recompute)
        measured[recompute] = sum(saved.values())
        assert low <= measured[recompute] <= high, (recompute, low, measured[recompute], high)
    assert measured[True] == 2 * 4 * 32 * 64 * 8  # each layer's input
    # control: a band that forgets cp's cut (taken at cp = 2 here, half the tokens) rejects it
    low, high = mesh_bytes.activation_band(llama, dataclasses.replace(mesh, cp=2), dt, recompute=False)
    assert not low <= measured[False] <= high
