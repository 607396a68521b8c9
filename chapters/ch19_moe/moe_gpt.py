"""A TinyGPT whose MLPs are mixture-of-experts layers (chapter 19), on one process or expert-parallel.

The attention, embeddings and norms are `common.models`' TinyGPT pieces; only the MLP changes.
`kind="local"` puts every expert on this process (`MoELayer`, tokens cut into `groups` routing
groups); `kind="ep"` keeps this rank's experts (`ExpertParallelMoE`). The training loss is the
cross-entropy plus α · Σ balancing losses plus β · Σ z-losses over the layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chapters.ch19_moe.moe import ExpertParallelMoE, MoELayer
from common.models import CausalSelfAttention, GPTConfig


class MoEBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, moe: nn.Module):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln2, self.moe = nn.LayerNorm(cfg.d_model), moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(nn.Module):
    """TinyGPT with an MoE layer in every block (tied embeddings, learned positions)."""

    def __init__(self, cfg: GPTConfig, d_ff: int, n_experts: int, k: int, capacity_factor: float,
                 kind: str = "local", groups: int = 1, rank: int = 0, world: int = 1, group=None):
        super().__init__()
        self.cfg = cfg

        def moe():
            if kind == "local":
                return MoELayer(cfg.d_model, d_ff, n_experts, k, capacity_factor, groups)
            return ExpertParallelMoE(cfg.d_model, d_ff, n_experts, k, capacity_factor, rank, world, group)

        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(MoEBlock(cfg, moe()) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def moe_layers(self) -> list[nn.Module]:
        return [b.moe for b in self.blocks]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, aux_weight: float = 0.0,
                z_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(total loss, cross-entropy): CE + aux_weight · Σ aux + z_weight · Σ z."""
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        aux = sum(m.aux_loss for m in self.moe_layers())
        z = sum(m.z_loss for m in self.moe_layers())
        return ce + aux_weight * aux + z_weight * z, ce


def is_expert_param(name: str) -> bool:
    """Expert weights live on one rank each; everything else is replicated (data-parallel)."""
    return ".experts." in name
