"""The model side of chapter 25: a Llama built from a local `LlamaConfig`, its FSDP2 wrapping with
activation checkpointing, the learning-rate schedule, and its FLOPs by formula and by counting."""

from __future__ import annotations

import math

import torch

# Two sizes. "cpu" trains on two CPU processes in seconds; "gpu" is sized for one H100/H200
# (a 300M-parameter Llama, sequence 2048, bf16, torch.compile) to measure MFU.
PRESETS = {
    "cpu": dict(vocab_size=1024, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                ffn_size=176, seq_len=64, micro_batch_size=8, steps=80, warmup_steps=10,
                lr=3e-3, compile=False, timed_from=3),
    "gpu": dict(vocab_size=8192, hidden_size=1024, n_layers=24, n_heads=16, n_kv_heads=8,
                ffn_size=2816, seq_len=2048, micro_batch_size=8, steps=60, warmup_steps=10,
                lr=6e-4, compile=True, timed_from=20),
}


def llama_config(vocab_size: int, hidden_size: int, n_layers: int, n_heads: int,
                 n_kv_heads: int, ffn_size: int, seq_len: int):
    """A `transformers.LlamaConfig` built locally (nothing is downloaded): untied embeddings,
    grouped-query attention, SwiGLU MLP, RoPE, RMSNorm, PyTorch's fused attention (sdpa)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                       intermediate_size=ffn_size, num_hidden_layers=n_layers,
                       num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                       max_position_embeddings=seq_len, tie_word_embeddings=False,
                       attn_implementation="sdpa", bos_token_id=None, eos_token_id=0,
                       pad_token_id=None)


def build_model(config, seed: int, device: torch.device | str = "cpu"):
    """`LlamaForCausalLM(config)` with weights from `seed`: every rank builds the same model."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.float()


def decoder_layers(model) -> list[torch.nn.Module]:
    return list(model.model.layers)


def apply_activation_checkpointing(model) -> None:
    """Wrap every decoder layer so that its activations are recomputed in backward instead of
    kept (torch's checkpoint wrapper, non-reentrant; chapter 20 teaches the idea)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(decoder_layers(model)):
        model.model.layers[i] = checkpoint_wrapper(layer)


def apply_fsdp(model, param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
               mesh=None, reshard_after_forward: bool = True) -> None:
    """FSDP2: one `fully_shard` unit per decoder layer, then the root (embeddings, final norm,
    head). Each unit's parameters are all-gathered just before its forward, freed again after it
    (`reshard_after_forward`; False keeps them whole until backward: the negative control of
    `parity.layers_resharded_after_forward`) and its gradients reduce-scattered right after its
    backward; `param_dtype` is what the layers compute in, `reduce_dtype` what gradients are
    summed in, the sharded fp32 master weights stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps to `peak`, then cosine decay to `min_ratio`·peak at
    `total` steps (the schedule of GPT-3, Chinchilla, Llama)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def n_params(config, embeddings: bool = True) -> int:
    """Parameters of the Llama, by formula (the 6·N·D rule uses N without the input embedding)."""
    h, f, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * f + 2 * h  # q, o; k, v; gate, up, down; 2 norms
    return L * per_layer + h + h * V + (h * V if embeddings else 0)


def forward_matmul_flops(config, batch: int, seq: int) -> dict[str, int]:
    """FLOPs of one forward's matrix products (2 per multiply-add), by part:
    - linear: per token 2·(h·h [q] + 2·h·kv [k, v] + h·h [o] + 3·h·f [MLP]) per layer + 2·h·V [head]
    - attention: per layer, per head, q·kᵀ and p·v: 2 × 2·T²·d (the full square: the counter and
      this formula both ignore that the causal mask makes half of it zeros)."""
    h, f, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    H = config.num_attention_heads
    d = h // H
    kv = config.num_key_value_heads * d
    tokens = batch * seq
    layers_linear = 2 * tokens * L * (2 * h * h + 2 * h * kv + 3 * h * f)
    head = 2 * tokens * h * V
    attention = L * 2 * (2 * batch * H * seq * seq * d)
    return {"layers_linear": layers_linear, "head": head, "attention": attention}


def train_step_flops(config, batch: int, seq: int, recompute: bool = False) -> int:
    """Model FLOPs of one forward + backward: every product's backward is two products as large
    as its forward (grad input, grad weight; for attention dq, dk and dp, dv), so 3 × forward.
    With activation checkpointing per decoder layer (`recompute`), each layer's forward runs
    again in backward, except its last product (MLP down): non-reentrant checkpointing stops
    recomputing once every tensor backward needs is back ("early stop"), and the down
    projection's output is not one of them. Recomputation is hardware work, not model FLOPs:
    MFU leaves it out."""
    fw = forward_matmul_flops(config, batch, seq)
    total = 3 * sum(fw.values())
    if recompute:
        down = 2 * batch * seq * config.hidden_size * config.intermediate_size
        total += fw["layers_linear"] - config.num_hidden_layers * down + fw["attention"]
    return int(total)


def six_n_d(config, batch: int, seq: int) -> int:
    """Kaplan's approximation: 6 FLOPs per non-embedding parameter per token (no attention)."""
    return 6 * n_params(config, embeddings=False) * batch * seq


def count_flops(model, input_ids: torch.Tensor, attention: str = "eager") -> dict[str, int]:
    """FLOPs that `torch.utils.flop_counter.FlopCounterMode` counts in one forward + backward,
    by operator. `attention="eager"` runs attention as two batched products (bmm) for the count:
    on a CPU the counter has no formula for the fused kernel
    (`aten._scaled_dot_product_flash_attention_for_cpu`) and silently counts it as zero; on a
    GPU it counts the fused kernel's backward as 2.5 × its forward (the recomputed q·kᵀ)."""
    from torch.utils.flop_counter import FlopCounterMode

    saved = model.config._attn_implementation
    model.config._attn_implementation = attention
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            logits = model(input_ids=input_ids, use_cache=False).logits
            logits.float().sum().backward()
    finally:
        model.config._attn_implementation = saved
        model.zero_grad(set_to_none=True)
    return {str(op).removeprefix("aten."): n for op, n in counter.get_flop_counts()["Global"].items()}
