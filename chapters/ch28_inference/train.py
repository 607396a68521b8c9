"""Distributed inference: a Llama with a hand-written KV cache checked against generation without
a cache and against transformers' `generate`; the same model tensor-parallel over every rank; and
a serving engine (engine.py) whose attention reads a paged KV pool through block tables, with
prefix caching, parallel samples that copy on write, preemption when the pool runs out, and
static, continuous and overlapped continuous batching. The engine serves a chat workload (every
logit checked against a contiguous cache) and the batching workload, request i on rank i mod
world, whose decode steps are predicted by the schedule model and by E[max]/E[mean].

The model is a Llama built from a local `LlamaConfig` (random weights, float64: exact parity);
nothing is downloaded.

Run:
    python chapters/ch28_inference/train.py                                        # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch28_inference/train.py      # CPU, a minute
    torchrun --standalone --nproc_per_node=4 chapters/ch28_inference/train.py
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch28_inference/train.py
"""

import sys
from dataclasses import dataclass

import torch

from chapters.ch28_inference import checks as C
from chapters.ch28_inference import model as M
from common.config import RunConfig, parse_config
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder


@dataclass
class Config(RunConfig):
    steps: int = 16
    """New tokens per generation (parity runs and the benchmark)."""
    n_heads: int = 16
    """Attention heads (= key/value heads); the tensor-parallel degree (the world) must divide it."""
    hidden_size: int = 64
    """Model width h."""
    n_layers: int = 2
    """Decoder layers."""
    prompt_len: int = 8
    """Prompt tokens of the parity runs."""
    requests_per_rank: int = 256
    """Requests of the batching workload per engine replica (one replica per rank)."""
    max_decode: int = 16
    """Decode steps per request are uniform on 1..max_decode (fixed before anything is measured)."""
    batch: int = 8
    """Sequences one decode step runs at most (the engines' batch slots)."""
    block_size: int = 4
    """Token positions per KV block."""
    n_blocks: int = 128
    """KV blocks in each engine's pool (enough for the batching workload: no preemption)."""
    tight_blocks: int = 20
    """A pool too small for the chat workload: the scheduler must preempt."""
    chat_requests: int = 16
    """Requests of the chat workload (shared system prompts, some with parallel samples)."""
    system_len: int = 24
    """Tokens of each of the chat workload's two system prompts."""
    stream_ops: int = 3000
    """Operations of the random request stream (invariants checked after each)."""


def validate(cfg: Config, world_size: int) -> None:
    if cfg.n_heads % world_size:
        raise ValueError(f"the tensor-parallel degree {world_size} (the world size) must divide "
                         f"--n-heads {cfg.n_heads}")
    if cfg.hidden_size % cfg.n_heads or (cfg.hidden_size // cfg.n_heads) % 2:
        raise ValueError("--hidden-size / --n-heads must be an even head size")
    if (2 * cfg.hidden_size) % world_size:
        raise ValueError("the world size must divide the FFN size 2 x --hidden-size")
    for name in ("prompt_len", "requests_per_rank", "max_decode", "batch", "block_size", "n_blocks",
                 "tight_blocks", "chat_requests", "system_len", "stream_ops"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.batch < 2:
        raise ValueError("--batch must be at least 2 (a chat request's two samples run together)")
    longest = -(-(16 + cfg.max_decode + 1) // cfg.block_size) + 1  # prompts have up to 16 tokens
    if cfg.n_blocks < cfg.batch * longest:  # the batching workload must never preempt
        raise ValueError(f"--n-blocks {cfg.n_blocks} cannot hold --batch {cfg.batch} requests of up "
                         f"to {16 + cfg.max_decode + 1} tokens ({longest} blocks each)")
    chat = -(-(cfg.system_len + 8 + 13) // cfg.block_size) + 2
    if cfg.tight_blocks < chat:
        raise ValueError(f"--tight-blocks must hold one chat request ({chat} blocks)")


def build(cfg: Config):
    config = M.llama_config(hidden_size=cfg.hidden_size, n_layers=cfg.n_layers,
                            n_heads=cfg.n_heads, ffn_size=2 * cfg.hidden_size,
                            max_len=cfg.prompt_len + cfg.steps + 32)
    hf = M.hf_model(config, cfg.seed)
    return config, hf


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        torch.set_default_dtype(torch.float64)
        rec = RunRecorder(cfg, __file__, info)
        log.info("building a Llama from LlamaConfig (transformers import, a few seconds)")
        config, hf = build(cfg)
        log.info("Llama h=%d layers=%d heads=%d, TP over %d ranks on %s/%s", cfg.hidden_size,
                 cfg.n_layers, cfg.n_heads, info.world_size, info.device, info.backend)
        gen = C.record_generation(rec, cfg, hf, config, info)
        log.info("generation parity done (top-2 margin %.2e)", gen["margin"])
        C.record_block_manager(rec, cfg)
        C.record_serving(rec, cfg, hf, config, info)
        log.info("chat workload served: paged, prefix cache, preemption, TP")
        bat = C.record_batching(rec, cfg, hf, config, info)
        log.info("engines: static %d, continuous %d decode steps over all ranks (ratio %.3f, "
                 "E[max]/E[mean] %.3f)", bat["total"]["static"], bat["total"]["continuous"],
                 bat["ratio"], bat["predicted"])
        rec.metrics(0, loss=None, lr=None, ratio=bat["ratio"])
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
