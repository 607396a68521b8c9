"""What the planner searches over: the model and batch (`ModelSpec`), the cluster (`Cluster`) and a
layout of the ranks (`Layout`), with the counts each implies (parameters, FLOPs per step).
planner.py prices them; mesh_bytes.py counts a composed layout's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from chapters.ch20_memory.recompute import recompute_flop_ratio

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE = ("none", "selective", "full")  # Korthikanti et al.'s selective; chapter 20's full
ORDERS = ("tp-dp-pp", "tp-pp-dp")  # rank numbering, innermost first (Megatron-Core supports both)


@dataclass(frozen=True)
class ModelSpec:
    """A stack of transformer (or MLP-only) layers and the batch it trains on."""

    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    seq_len: int
    global_batch: int  # sequences per optimizer step
    vocab: int = 0
    kv_heads: int = 0  # 0: as many as n_heads (no grouped-query attention)
    mlp_matrices: int = 2  # 3 for SwiGLU
    attention: bool = True
    param_bytes: float = 2  # bf16 weights
    grad_bytes: float = 2
    state_bytes: float = 12  # Adam: fp32 master, momentum, variance
    act_bytes: int = 2  # bytes of an activation element on the wire
    max_cp: int = 1
    """Largest context-parallel size the search may use (1: no cp, the chapter's worked pairs).
    cp ranks each hold s/cp of every sequence (ring attention, chapter 18)."""

    def params_per_layer(self) -> int:
        h = self.d_model
        attn = 0
        if self.attention:
            kv = (self.kv_heads or self.n_heads) * (h // self.n_heads)
            attn = 2 * h * h + 2 * h * kv  # q, o and k, v
        return attn + self.mlp_matrices * h * self.d_ff

    def params(self) -> int:
        """Ψ: the layers plus untied input and output embeddings (biases, norms ignored)."""
        return self.n_layers * self.params_per_layer() + 2 * self.vocab * self.d_model

    def flops_per_step(self, recompute: int = 0) -> float:
        """6Ψ per token for the matmuls and 12·L·s·h for the attention scores; full
        recomputation reruns the forward (chapter 20's 4/3), selective recomputation reruns only
        the attention scores' forward (4·L·s·h, Korthikanti et al. 2022)."""
        tokens = self.global_batch * self.seq_len
        attn = 12 * self.n_layers * self.seq_len * self.d_model if self.attention else 0
        ratio = recompute_flop_ratio("full") if RECOMPUTE[recompute] == "full" else 1.0
        extra = attn / 3 if RECOMPUTE[recompute] == "selective" else 0.0
        return (ratio * (6 * self.params() + attn) + extra) * tokens


@dataclass(frozen=True)
class Cluster:
    """n_gpus devices, gpus_per_node of them on a fast link; α in s, bandwidth in bytes/s."""

    n_gpus: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    efficiency: float  # achieved fraction of peak (MFU) the compute term assumes
    alpha_intra: float
    bw_intra: float
    alpha_inter: float
    bw_inter: float
    async_p2p: bool = False
    """False: each micro-batch slot waits for its two pipeline messages (Megatron's blocking
    sends). True: sends are asynchronous (chapter 04's `isend`), so only the 2(p − 1) messages of
    the fill and the drain are on the critical path."""
    order: str = "tp-dp-pp"
    """How ranks are numbered, innermost axis first: "tp-dp-pp" (Megatron-Core's default,
    `initialize_model_parallel(order="tp-cp-ep-dp-pp")` without ep, cp next to tp (at cp = 1: a dp
    group's ranks are tp apart, a pp group's tp·dp apart) or "tp-pp-dp" (its other order,
    tp-cp-ep-pp-dp: pp groups tp·cp apart, dp groups tp·cp·pp apart)."""

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, not {self.order!r}")


@dataclass(frozen=True, order=True)
class Layout:
    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    recompute: int  # index into RECOMPUTE
    zero: int
    cp: int = 1  # context parallelism: each sequence's tokens over cp ranks (last: cp = 1 sorts as before)

    def micro_batches(self, spec: ModelSpec) -> int:
        return spec.global_batch // (self.dp * self.micro_batch_size)

    def __str__(self) -> str:
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return (f"dp={self.dp} tp={self.tp} pp={self.pp}{cp} b={self.micro_batch_size} "
                f"rc={RECOMPUTE[self.recompute]} ZeRO-{self.zero}")
