"""Chapter 30's bytes per mesh dimension (mesh_bytes.py) by hand: the model state, the bytes each
dimension's collectives are handed and the activation band of a Llama on a dp x tp x pp x cp
mesh, worked out in the tests' own arithmetic with controls, and the planner's search over cp
against a brute force of this module's own. test_ch30_frontier_measured.py holds the same
predictions against what torch and chapter 25's composed run measure.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from chapters.ch30_frontier import mesh_bytes, planner

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
    # float64 under a float64 default dtype: every byte doubles, AdamW's step too; a model cast
    # to float64 under the float32 default (chapter 25's composed run) keeps float32 steps, as
    # torch does (checked on a real AdamW step)
    f64 = mesh_bytes.model_state_bytes(CPU_LLAMA, MESH16, mesh_bytes.Dtypes.of(torch.float64, default=torch.float64))
    assert f64["total"] == 2 * got["total"]
    cast = mesh_bytes.model_state_bytes(CPU_LLAMA, MESH16, mesh_bytes.Dtypes.of(torch.float64, default=torch.float32))
    tensors = len(CPU_LLAMA.stage_params(0, 2))
    assert cast["total"] == 2 * got["total"] - 4 * tensors != f64["total"]
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    w.grad = torch.ones_like(w)
    opt = torch.optim.AdamW([w])
    opt.step()
    assert torch.get_default_dtype() == torch.float32 and opt.state[w]["step"].dtype == torch.float32


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
    # the two norms' weight gradients, all-reduced once a step: the pipeline schedule holds
    # FSDP2's reduction to the last micro-batch (2 x 2 without a schedule, the control)
    assert comm["tp"] == [("all_gather", 2 * 6 + 2, act), ("reduce_scatter", 2 * 5 + 2, act),
                          ("all_reduce", 2, 64 * 4)]
    assert tot["tp"]["wire"] == 26 * act / 2 + 2 * 64 * 4 * 2 * 1 / 2
    unpiped = mesh_bytes.comm_bytes(CPU_LLAMA, MESH16, FP32, pipelined=False)["tp"]
    assert unpiped[2] == ("all_reduce", 2 * 2, 64 * 4) != comm["tp"][2]
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
    loss = 3 * 64 * 4 * mesh_bytes.WIRE["all_reduce"](4)  # loss parallel: 3 values a position
    layers_wire = sum(c * x * mesh_bytes.WIRE[k](4) for k, c, x in plain) - ends - norms - loss
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
