"""What mesh_bytes.py counts over: a Llama's shape (`Llama`), a dp × tp × pp × cp layout with its
tensor-parallel plan (`Mesh`) and the bytes per element of each kind of tensor (`Dtypes`), with
the tensor-parallel plans it knows (`PLANS`), how pp stages split the layers (`stage_layers`) and
the one-line reason a layout cannot hold a Llama (`layout_error`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PLANS = ("torchtitan", "blocks")


@dataclass(frozen=True)
class Llama:
    """The shape of a Llama (HF `LlamaForCausalLM`: untied embeddings, GQA, SwiGLU, RMSNorm)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq_len: int

    @classmethod
    def from_preset(cls, p: dict) -> Llama:
        """From one of chapter 25's `model.PRESETS`."""
        return cls(p["vocab_size"], p["hidden_size"], p["n_layers"], p["n_heads"], p["n_kv_heads"],
                   p["ffn_size"], p["seq_len"])

    def layer_params(self) -> list[tuple[str, tuple[int, int], int | None]]:
        """(name, shape, tensor-parallel dim) of one decoder layer's parameters."""
        h, kv = self.hidden, self.kv_heads * (self.hidden // self.heads)
        return [("q", (h, h), 0), ("k", (kv, h), 0), ("v", (kv, h), 0), ("o", (h, h), 1),
                ("gate", (self.ffn, h), 0), ("up", (self.ffn, h), 0), ("down", (h, self.ffn), 1),
                ("input_norm", (h,), None), ("post_attention_norm", (h,), None)]

    def stage_params(self, stage: int, pp: int, plan: str = "torchtitan"
                     ) -> list[tuple[str, tuple[int, ...], int | None]]:
        """The parameters stage `stage` of `pp` holds (the embedding and head split over tp
        by rows under torchtitan's plan, whole under "blocks")."""
        ends = 0 if plan == "torchtitan" else None
        out = [("embed", (self.vocab, self.hidden), ends)] if stage == 0 else []
        out += [(f"layer{i}.{n}", s, d) for i in stage_layers(self.layers, pp, stage)
                for n, s, d in self.layer_params()]
        if stage == pp - 1:
            out += [("norm", (self.hidden,), None), ("head", (self.vocab, self.hidden), ends)]
        return out

    def params(self) -> int:
        return sum(math.prod(s) for _, s, _ in self.stage_params(0, 1))


@dataclass(frozen=True)
class Mesh:
    """A layout: dp × tp × pp × cp ranks; each dp rank's batch is micro_batches × micro_batch_size
    sequences of seq_len tokens, each cut into cp pieces of the sequence."""

    dp: int
    tp: int
    pp: int
    cp: int
    micro_batch_size: int = 1
    micro_batches: int = 1
    plan: str = "torchtitan"
    """The tensor-parallel plan: "torchtitan" (sequence parallelism: all-gathers and
    reduce-scatters; embedding and head split, loss parallel) or "blocks" (Megatron's split of the
    blocks alone with torch's ColwiseParallel/RowwiseParallel on separate q, k, v, o, gate, up,
    down: an all-reduce after attention and after the MLP, each column-parallel linear's input
    gradient all-reduced in backward; embedding, norms and head whole on every tp rank: chapter
    25's composed.py)."""

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element. FSDP2: `param` is what the sharded (master) parameters, their gradients
    and AdamW's two moments are kept in; `compute` what it all-gathers and the layers compute in
    (MixedPrecisionPolicy.param_dtype); `reduce` what gradients are reduce-scattered in; `step`
    AdamW's step counter, one scalar per parameter tensor (float32, float64 under a float64
    default dtype: torch.optim.optimizer._get_scalar_dtype)."""

    param: int = 4
    compute: int = 4
    reduce: int = 4
    step: int = 4

    @classmethod
    def of(cls, param, compute=None, reduce=None, default=None) -> Dtypes:
        """From torch dtypes: `Dtypes.of(torch.float64)`, `Dtypes.of(torch.float32, torch.bfloat16)`.
        The step counter follows torch's default dtype (`default`, else the current one), not the
        parameters': a model cast to float64 under the float32 default keeps float32 steps."""
        import torch

        compute, reduce = compute or param, reduce or param
        default = default or torch.get_default_dtype()
        return cls(param.itemsize, compute.itemsize, reduce.itemsize,
                   8 if default == torch.float64 else 4)


def layout_error(llama: Llama, mesh: Mesh) -> str | None:
    """Why this Llama cannot be laid out on this mesh, in one line, or None."""
    if mesh.plan not in PLANS:
        return f"plan must be one of {PLANS}, not {mesh.plan!r}"
    if min(mesh.dp, mesh.tp, mesh.pp, mesh.cp, mesh.micro_batch_size, mesh.micro_batches) < 1:
        return f"every size must be at least 1: {mesh}"
    if llama.heads % mesh.tp or llama.kv_heads % mesh.tp:
        return f"tp={mesh.tp} must divide the heads ({llama.heads}) and KV heads ({llama.kv_heads})"
    if llama.layers < mesh.pp:
        return f"pp={mesh.pp} stages for {llama.layers} layers: a stage would be empty"
    sp = mesh.tp if mesh.plan == "torchtitan" else 1
    if llama.seq_len % (2 * mesh.cp * sp):
        return (f"seq_len {llama.seq_len} must split into 2·cp = {2 * mesh.cp} ring chunks"
                + (f" and each rank's piece over tp={mesh.tp} (sequence parallelism)" if sp > 1 else ""))
    return None


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """The layers of one stage: L // pp each, the first L mod pp stages one more."""
    base, extra = divmod(layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))
