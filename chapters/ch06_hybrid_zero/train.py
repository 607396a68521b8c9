"""ZeRO stages 1, 2 and 3 by hand and FSDP2, each checked against plain DDP + Adam.

ZeRO removes the N-fold redundancy of data parallelism one piece at a time: each rank keeps
only its 1/N slice of the optimizer states (stage 1), of the gradients too (stage 2), and of the
parameters too (stage 3, which is what FSDP2's `fully_shard` does). This script trains the same
tiny GPT (tied embeddings, one frozen tensor) five ways, compares the parameters and counts the
bytes each rank holds against the formula, checks ZeRO++'s int8 weight all-gather against its
error bound and reproduces the ZeRO paper's memory table.

Run:
    python chapters/ch06_hybrid_zero/train.py                                    # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch06_hybrid_zero/train.py
    torchrun --standalone --nproc_per_node=3 chapters/ch06_hybrid_zero/train.py   # uneven shards
    torchrun --standalone --nproc_per_node=8 chapters/ch06_hybrid_zero/train.py   # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch06_hybrid_zero/train.py --global-batch-size 48                # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch06_hybrid_zero/train.py --global-batch-size 48
"""

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from chapters.ch06_hybrid_zero import memory, zeropp
from chapters.ch06_hybrid_zero.zero import (
    ZeroOneOptimizer,
    ZeroThree,
    ZeroTwo,
    all_gather_flat,
    bytes_held,
)
from common.checkpoint import save_checkpoint
from common.config import RunConfig, parse_config
from common.data import CharTokenizer, text_corpus, token_windows
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import GPTConfig, TinyGPT
from common.results import RunRecorder
from common.seed import seed_everything

DTYPES = {"float64": torch.float64, "float32": torch.float32}
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


@dataclass
class Config(RunConfig):
    steps: int = 4
    """Optimizer steps to train."""
    global_batch_size: int = 12
    """Sequences per step, summed over the ranks (divisible by the world size)."""
    lr: float = 1e-2
    """Adam learning rate."""
    d_model: int = 32
    """Width of the tiny GPT."""
    n_layer: int = 2
    """Transformer blocks."""
    block_size: int = 16
    """Tokens per sequence."""
    dtype: str = "float64"
    """float64 makes parity exact to ~1e-14; float32 is checked to lr/100 (see the lesson)."""
    qwz_block: int = 64
    """Weights per int8 block (one scale each) in ZeRO++'s quantised all-gather."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.global_batch_size < 1 or self.qwz_block < 1:
            raise ValueError("--global-batch-size and --qwz-block must be at least 1")


def build_model(cfg: Config, vocab_size: int, device: torch.device) -> TinyGPT:
    """The same tiny GPT on every rank; the head is tied to the token embedding and the
    position embedding is frozen, so the wrappers meet both cases."""
    seed_everything(cfg.seed)
    model = TinyGPT(GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size,
                              n_layer=cfg.n_layer, n_head=2, d_model=cfg.d_model))
    model.pos_emb.weight.requires_grad_(False)
    return model.to(device, DTYPES[cfg.dtype])


def global_batches(cfg: Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Windows of the course's text corpus: (steps, global_batch, block) inputs and targets."""
    text = text_corpus(max_chars=20_000)
    tok = CharTokenizer.fit(text)
    x, y = token_windows(tok.encode(text), cfg.block_size, cfg.steps * cfg.global_batch_size,
                         seed=cfg.seed)
    shape = (cfg.steps, cfg.global_batch_size, cfg.block_size)
    return x.view(shape).to(device), y.view(shape).to(device), tok.vocab_size


def make_stage(stage: int, model: torch.nn.Module, cfg: Config, info):
    """(module to call, optimizer to step) for ZeRO stage 0 (DDP) to 3, all around Adam."""
    if stage == 0:
        ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                  gradient_as_bucket_view=True)  # gradients live in DDP's buckets, no second copy
        return ddp, torch.optim.Adam(ddp.parameters(), lr=cfg.lr)
    if stage == 1:
        return model, ZeroOneOptimizer(model.parameters(), torch.optim.Adam, lr=cfg.lr)
    wrapper = (ZeroTwo if stage == 2 else ZeroThree)(model, torch.optim.Adam, lr=cfg.lr)
    return wrapper, wrapper


def train_steps(model, optimizer, X, Y, rank: int, world_size: int) -> list[float]:
    """The loop is the same for every stage: forward, backward, step. Each rank trains on its
    contiguous shard; the loss logged is the global mean (one all-reduce of a number)."""
    losses = []
    for x, y in zip(X, Y):
        optimizer.zero_grad()
        _, loss = model(x.chunk(world_size)[rank], y.chunk(world_size)[rank])
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def train_fsdp2(model: torch.nn.Module, X, Y, cfg: Config, info) -> tuple[dict, dict]:
    """The production ZeRO-3: `fully_shard` each block, then the root (tied weights and the
    frozen tensor go to the root's group). Returns (whole parameters, bytes held)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    train_steps(model, opt, X, Y, info.rank, info.world_size)
    held = bytes_held(model, opt)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}, held


def full_parameters(model, optimizer) -> dict[str, torch.Tensor]:
    """Whole parameters by name, whatever the wrapper (a collective for ZeRO-3: every rank)."""
    if hasattr(model, "full_parameters"):
        return model.full_parameters()
    module = model.module if isinstance(model, DDP) else model
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def expected_bytes(stage: int, model: torch.nn.Module, world_size: int) -> dict[str, int]:
    """The ZeRO formula with this model's real numbers: Ψ trainable parameters of b bytes,
    Adam's two states of b bytes each (K = 2b), one 4-byte step counter per tensor it updates,
    frozen parameters kept whole on every rank."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    psi = sum(p.numel() for p in trainable)
    b = trainable[0].element_size()
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    f = memory.per_rank_bytes(stage, psi, world_size, b, b, 2 * b)
    counters = len(trainable) if stage == 0 else 1  # the wrappers update one flat slice
    return {"params": int(f["params"]) + frozen, "grads": int(f["grads"]),
            "optim": int(f["optim"]) + 4 * counters}


def parity_tolerance(cfg: Config) -> float:
    """float64: the runs differ by summation order only (~1e-14). float32: Adam divides each
    gradient by its own RMS, so an element whose gradient nearly cancels over the ranks can
    carry a relative rounding error near 1 into its update, which is at most ~lr per step:
    the tolerance is 1% of one step."""
    return 1e-10 if cfg.dtype == "float64" else cfg.lr / 100


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def qwz_error(shard: torch.Tensor, block: int) -> tuple[float, int]:
    """Quantised all-gather of ZeRO-3's weight slices against the exact one: the worst
    |x − x̂| / (scale/2) over all weights (≤ 1 is the bound), and bytes sent per rank."""
    exact = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype, device=shard.device)
    all_gather_flat(exact, shard)
    approx, scales, sent = zeropp.quantized_all_gather(shard, block)
    return ((exact - approx).abs() / (scales / 2)).max().item(), sent


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        if cfg.global_batch_size % info.world_size:
            raise SystemExit(f"error: --global-batch-size {cfg.global_batch_size} must divide "
                             f"into {info.world_size} ranks; use a multiple of {info.world_size}")
        rec = RunRecorder(cfg, __file__, info)
        X, Y, vocab = global_batches(cfg, info.device)
        tol = parity_tolerance(cfg)
        params, held, models = {}, {}, {}
        for stage, name in STAGE_NAMES.items():
            model, opt = make_stage(stage, build_model(cfg, vocab, info.device), cfg, info)
            losses = train_steps(model, opt, X, Y, info.rank, info.world_size)
            held[name], models[name] = bytes_held(model, opt), (model, opt)
            params[name] = full_parameters(model, opt)
            log.info("%-7s loss %s", name, " ".join(f"{v:.4f}" for v in losses))
            if stage == 0:
                for step, loss in enumerate(losses):
                    rec.metrics(step, loss=loss, lr=cfg.lr)
        params["FSDP2"], held["FSDP2"] = train_fsdp2(build_model(cfg, vocab, info.device), X, Y, cfg, info)

        for name in ("ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2"):
            rec.check(f"{name} == DDP + Adam (max |dparam|)", "parity",
                      max_diff(params[name], params["DDP"]), 0.0, tol)
        reference = build_model(cfg, vocab, info.device)
        for stage, name in STAGE_NAMES.items():
            exp = expected_bytes(stage, reference, info.world_size)
            got = held[name]
            rec.check(f"{name} bytes [params, grads, optim] = formula", "formula",
                      [got["params"], got["grads"], got["optim"]],
                      [exp["params"], exp["grads"], exp["optim"]])
            rec.figure(f"{name} bytes per rank", sum(got.values()), sum(exp.values()), "bytes")
        rec.figure("FSDP2 bytes per rank", sum(held["FSDP2"].values()), unit="bytes")

        z3 = models["ZeRO-3"][1]
        ratio, sent = qwz_error(z3.shard_param, cfg.qwz_block)
        rec.check("qwZ int8 all-gather: max |x - x^| / (scale/2)", "formula", ratio, 1 + 1e-9,
                  compare="<=")
        rec.figure("qwZ bytes sent per rank", sent, z3.shard_param.numel() * z3.shard_param.element_size(),
                   "bytes (expected: unquantised)")

        paper = {"baseline": 120.0, "P_os": 31.4, "P_os+g": 16.6, "P_os+g+p": 1.88}
        calc = memory.paper_table(7.5e9, 64, 12)
        rec.check("paper table 1 (7.5B, N_d=64, K=12), max |GB diff|", "formula",
                  max(abs(calc[k] - paper[k]) for k in paper), 0.0, 0.05)
        for k in paper:
            rec.figure(f"paper {k}", round(calc[k], 3), paper[k], "GB")
        rec.figure("trainable parameters psi", sum(p.numel() for p in reference.parameters()
                                                   if p.requires_grad))
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt", {"params": params, "held": held})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__)))
