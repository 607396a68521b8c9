"""DeepSpeed-Ulysses, the production version of `ulysses.py`: `deepspeed.sequence.layer.
DistributedAttention` wraps any attention function with the same two all-to-alls. It runs on
CPU (gloo), so the tests compare it with the hand-written version here; DeepSpeed is optional
(imported only when called).

DeepSpeed's layout puts the sequence first: [T/N, B, H, D] in, attention sees [T, B, H/N, D],
[T/N, B, H, D] out (`scatter_idx=2`, the heads; `gather_idx=0`, the sequence).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _local_attention(causal: bool):
    def attend(q, k, v, *args, **kwargs):  # [T, B, H/N, D] each
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return out.permute(2, 0, 1, 3).contiguous()
    return attend


def deepspeed_ulysses_attention(q, k, v, causal: bool = True, group=None,
                                broken: str = "none") -> torch.Tensor:
    """Same contract as `ulysses.ulysses_attention`: (B, H, T/N, D) shards in, shard out.
    broken="no_permute" hands DeepSpeed our (B, H, T/N, D) layout as if it were its own (a
    negative control: the all-to-all then splits the wrong dimension)."""
    from common.log import library_output

    with library_output():  # DeepSpeed announces its accelerator and initialisation
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend=dist.get_backend(group))
    attention = DistributedAttention(_local_attention(causal), group or dist.group.WORLD,
                                     scatter_idx=2, gather_idx=0)
    if broken == "no_permute":
        return attention(q, k, v, batch_dim_idx=1)
    to_seq_first = [t.permute(2, 0, 1, 3) for t in (q, k, v)]  # [T/N, B, H, D]
    out = attention(*to_seq_first, batch_dim_idx=1)
    return out.permute(1, 2, 0, 3)
