"""Chapter 30's bytes per mesh dimension against what is measured: torch's own sharding (FSDP2 and
DTensor on a fake process group), the collectives torch issues for one training step (counted at
the boundary by a dispatch mode), the bytes autograd saves in one process, and the per-rank counts
chapter 25's composed run recorded inside its 8-rank job (against_ch25.py).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from chapters.ch30_frontier import mesh_bytes

CPU_LLAMA = mesh_bytes.Llama(vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, seq_len=64)
MESH16 = mesh_bytes.Mesh(dp=2, tp=2, pp=2, cp=2, micro_batch_size=1, micro_batches=2)
FP32 = mesh_bytes.Dtypes.of(torch.float32)
COMPOSED_LLAMA = mesh_bytes.Llama(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, seq_len=32)
"""Chapter 25's composed run's Llama (composed.py's default `Run`)."""


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

        from torch.distributed.tensor import DTensor

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                # an op on DTensors is declined: DTensor then runs it and the collectives it
                # issues inside (loss parallel's all-reduces) reach this mode (as CommDebugMode)
                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented
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
        loss_parallel,
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
            with loss_parallel() if plan == "torchtitan" else contextlib.nullcontext():
                F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
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
        # the five norms' partial gradients (h each) all-reduced, and loss parallel's three
        # all-reduces of one value per position (max, sum of exponentials, target logit);
        # controls: no early stop, a cross-entropy on vocabulary shards that reduces nothing
        assert got[True]["tp"] == {"all_gather": 14 * act // 2, "reduce_scatter": 12 * act,
                                   "all_reduce": 5 * 64 * 4 + 3 * llama.seq_len * 4}
        assert got[True]["tp"]["reduce_scatter"] != (2 * 6 + 2) * act
        assert got[True]["tp"]["all_reduce"] != 5 * 64 * 4



# --- against chapter 25's composed run (the per-rank counts its 8-rank job recorded) ----------

@pytest.mark.timeout(60)
def test_planner_against_chapter_25s_composed_run():
    """Every rank of chapter 25's three layouts (dp2 x tp2 x pp2, pp2 x cp2 x tp2 with sequence
    parallelism, dp2 x cp2 x tp2; float64, 1F1B, FSDP2 without resharding, checkpointing per
    block), as its job counted them inside the run
    (chapter 25's tests fail when a fresh job no longer matches the record): model state and the
    bytes each dimension's collectives were handed in one step equal `mesh_bytes` exactly, the
    activations lie in `activation_band`, at its bottom (each block's input)."""
    from chapters.ch30_frontier import against_ch25

    record = against_ch25.load()
    assert len(record["ranks"]) == 24
    rows = against_ch25.rows(record)
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {r["name"] for r in rows} == {
        "model state: params", "model state: grads", "model state: moments", "activations (band)",
        *(f"bytes per step at the boundary: {d}" for d in ("dp_cp", "tp", "pp", "cp"))}
    acts = [r for r in rows if r["name"] == "activations (band)"]
    assert all(r["measured"] == r["predicted"][0] for r in acts)
    # 1F1B: stage 0 holds both micro-batches, stage 1 one (GPipe would hold two on both); a block
    # input is (b, s/cp, h) = (2, 32, 64) = (4, 16, 64) float64, cut over tp = 2 by sequence
    # parallelism
    for name, tokens in (("pp2 x dp2 x tp2", 2 * 32), ("pp2 x cp2 x tp2 (sequence)", 4 * 16 // 2)):
        mine = [r for r in acts if r["layout"] == name]
        assert len(mine) == 8
        assert {r["measured"] for r in mine if r["stage"] == 0} == {2 * tokens * 64 * 8}
        assert {r["measured"] for r in mine if r["stage"] == 1} == {tokens * 64 * 8}
    # one stage (dp2 x cp2 x tp2, still 1F1B): one micro-batch at a time, 2 blocks of 2 x 16 tokens
    assert {r["measured"] for r in acts if r["layout"] == "dp2 x cp2 x tp2"} == {2 * 2 * 16 * 64 * 8}
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
