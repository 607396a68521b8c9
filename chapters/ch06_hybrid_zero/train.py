"""ZeRO stages 1, 2 and 3 by hand, torch's ZeroRedundancyOptimizer and FSDP2, each checked
against plain DDP + Adam, with the bytes each one holds and moves counted from its tensors.

ZeRO removes the N-fold redundancy of data parallelism one piece at a time: each rank keeps
only its 1/N slice of the optimizer states (stage 1), of the gradients too (stage 2), and of the
parameters too (stage 3, which is what FSDP2's `fully_shard` does). This script trains the same
tiny GPT (tied embeddings, one frozen tensor) six ways and checks, per way: the parameters
against DDP + Adam, the bytes held at rest and at the peak of a step, and the bytes handed to
collectives in a step, each against the ZeRO formula. Then the hand ZeRO-2/3 in bf16 against
FSDP2 with the same mixed-precision policy (parameters, and the bytes of their bf16 gathers and
fp32 reductions), ZeRO++'s int8 weight all-gather against its error bound, and the memory
calculator against the ZeRO paper's table.

Run:
    python chapters/ch06_hybrid_zero/train.py                                    # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch06_hybrid_zero/train.py
    torchrun --standalone --nproc_per_node=3 chapters/ch06_hybrid_zero/train.py   # uneven shards
    torchrun --standalone --nproc_per_node=8 chapters/ch06_hybrid_zero/train.py   # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch06_hybrid_zero/train.py                                       # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch06_hybrid_zero/train.py
"""

import gc
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from chapters.ch06_hybrid_zero import memory
from chapters.ch06_hybrid_zero.checks import (
    check_mixed_precision,
    check_paper_table,
    check_stages,
    max_diff,
    parity_tolerance,
    qwz,
)
from chapters.ch06_hybrid_zero.probe import StepProbe
from chapters.ch06_hybrid_zero.zero import ZeroOneOptimizer, bytes_held, model_states
from chapters.ch06_hybrid_zero.zero23 import ZeroThree, ZeroTwo
from common.checkpoint import save_checkpoint
from common.config import RunConfig, check_global_batch, parse_config
from common.data import CharTokenizer, text_corpus, token_windows
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import GPTConfig, TinyGPT
from common.results import RunRecorder
from common.seed import seed_everything

DTYPES = {"float64": torch.float64, "float32": torch.float32}
# The ways to train, and the ZeRO stage each one is.
STAGES = {"DDP": 0, "ZeRO-1": 1, "ZeroRedundancyOptimizer": 1, "ZeRO-2": 2, "ZeRO-3": 3, "FSDP2": 3}


@dataclass
class Config(RunConfig):
    steps: int = 4
    """Optimizer steps to train (the last one is probed for bytes held and moved)."""
    global_batch_size: int = 48
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
    """float64 makes parity exact to ~1e-14; float32 is checked to a calibrated lr/100 (see the lesson)."""
    qwz_block: int = 64
    """Weights per int8 block (one scale each) in ZeRO++'s quantised all-gather."""
    mixed_precision: bool = True
    """Also train ZeRO-2/3 with bf16 compute against FSDP2's MixedPrecisionPolicy(bf16, fp32)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        for name in ("global_batch_size", "qwz_block", "d_model", "n_layer", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.d_model % 2:
            raise ValueError(f"--d-model {self.d_model} must be even (2 attention heads)")
        if self.steps < 3:  # Adam creates its states in step 1, DDP rebuilds its buckets in step 2
            raise ValueError(f"--steps must be at least 3 (the last step is probed once training "
                             f"is steady), got {self.steps}")


def validate(cfg: Config, world_size: int) -> None:
    """Every rank trains on an equal share of the global batch."""
    check_global_batch(cfg.global_batch_size, world_size)


def build_model(cfg: Config, vocab_size: int, device: torch.device, dtype=None) -> TinyGPT:
    """The same tiny GPT on every rank; the head is tied to the token embedding and the
    position embedding is frozen, so the wrappers meet both cases."""
    seed_everything(cfg.seed)
    model = TinyGPT(GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size,
                              n_layer=cfg.n_layer, n_head=2, d_model=cfg.d_model))
    model.pos_emb.weight.requires_grad_(False)
    return model.to(device, dtype or DTYPES[cfg.dtype])


def global_batches(cfg: Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Windows of the course's text corpus: (steps, global_batch, block) inputs and targets."""
    text = text_corpus(max_chars=20_000)
    tok = CharTokenizer.fit(text)
    x, y = token_windows(tok.encode(text), cfg.block_size, cfg.steps * cfg.global_batch_size,
                         seed=cfg.seed)
    shape = (cfg.steps, cfg.global_batch_size, cfg.block_size)
    return x.view(shape).to(device), y.view(shape).to(device), tok.vocab_size


def fsdp2(model: torch.nn.Module, info, mp_policy=None) -> torch.nn.Module:
    """The production ZeRO-3: `fully_shard` each block, then the root (the tied weights and the
    frozen tensor go to the root's group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    policy = {"mp_policy": mp_policy or MixedPrecisionPolicy()}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **policy)
    return fully_shard(model, mesh=mesh, **policy)


def make_stage(name: str, model: torch.nn.Module, cfg: Config, info, compute_dtype=None):
    """(module to call, optimizer to step) for each way to train, all around Adam. With a
    `compute_dtype`, ZeRO-2/3 gather and compute in it and FSDP2 gets the same policy,
    MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=the model's dtype)."""
    adam = {"lr": cfg.lr}
    if name in ("DDP", "ZeroRedundancyOptimizer"):
        ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                  gradient_as_bucket_view=True)  # gradients live in DDP's buckets, no second copy
        if name == "DDP":
            return ddp, torch.optim.Adam(ddp.parameters(), **adam)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, **adam)
    if name == "ZeRO-1":
        return model, ZeroOneOptimizer(model.parameters(), torch.optim.Adam, **adam)
    if name == "FSDP2":
        policy = None
        if compute_dtype is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            policy = MixedPrecisionPolicy(param_dtype=compute_dtype,
                                          reduce_dtype=model.tok_emb.weight.dtype)
        model = fsdp2(model, info, policy)
        return model, torch.optim.Adam(model.parameters(), **adam)
    wrapper = (ZeroTwo if name == "ZeRO-2" else ZeroThree)(model, compute_dtype=compute_dtype)
    return wrapper, torch.optim.Adam(wrapper.parameters(), **adam)  # the caller's optimizer


def train_steps(model, optimizer, X, Y, rank: int, world_size: int,
                probe: StepProbe | None = None) -> list[float]:
    """The loop is the same for every way: forward, backward, (ZeRO-2/3: reduce the gradients),
    step. Each rank trains on its contiguous shard of the batch; the last step runs inside
    `probe`. The loss logged is the global mean (one all-reduce of a number, outside the probe)."""
    losses = []
    for step, (x, y) in enumerate(zip(X, Y)):
        with probe if probe is not None and step == len(X) - 1 else nullcontext():
            optimizer.zero_grad()
            _, loss = model(x.chunk(world_size)[rank], y.chunk(world_size)[rank])
            loss.backward()
            if hasattr(model, "reduce_gradients"):
                model.reduce_gradients()  # ZeRO-2/3: the explicit after-backward call
            optimizer.step()
        losses.append(reduce_number(loss.detach(), "sum") / world_size)
    return losses


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Whole parameters by name, whatever the wrapper (a collective for ZeRO-2/3 and FSDP2:
    every rank calls it)."""
    if hasattr(model, "full_parameters"):
        return model.full_parameters()
    module = model.module if isinstance(model, DDP) else model
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}


# The probe's names for the collectives of each kind (the hand ZeRO-3 all-gathers with
# all_to_all_single, which gloo accepts with uneven pieces).
GATHERS = ("allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "alltoall_base_")
REDUCE_SCATTERS = ("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_")


def traffic(volume: dict[str, int]) -> list[int]:
    """[all-gather, reduce-scatter, anything else] bytes from a probe's volume by operation."""
    gather = sum(v for k, v in volume.items() if k in GATHERS)
    reduce = sum(v for k, v in volume.items() if k in REDUCE_SCATTERS)
    return [gather, reduce, sum(volume.values()) - gather - reduce]


def run_stage(name: str, cfg: Config, X, Y, vocab: int, info, dtype=None, compute_dtype=None) -> dict:
    """Train one way; return its losses, whole parameters, bytes held at rest after the last
    step, and what the probe counted during it (peak held, volume moved), plus, on CUDA, the
    allocator's peak during training above what was allocated before (activations included)."""
    model, opt = make_stage(name, build_model(cfg, vocab, info.device, dtype), cfg, info, compute_dtype)
    probe = StepProbe(lambda: model_states(model, opt))
    if info.device.type == "cuda":
        gc.collect()  # the previous way's DDP sits in a reference cycle: free it first
        torch.cuda.synchronize(info.device)
        torch.cuda.reset_peak_memory_stats(info.device)
        before = torch.cuda.memory_allocated(info.device)
    losses = train_steps(model, opt, X, Y, info.rank, info.world_size, probe)
    cuda_peak = None
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
        cuda_peak = torch.cuda.max_memory_allocated(info.device) - before
    return {"losses": losses, "params": full_parameters(model), "rest": bytes_held(model, opt),
            "peak": probe.peak, "peak_total": probe.peak_total, "volume": probe.total_volume,
            "traffic": traffic(probe.volume), "calls": probe.calls, "cuda_peak": cuda_peak}


def mixed_precision_runs(cfg: Config, X, Y, vocab: int, info) -> dict[str, dict]:
    """An fp32 model trained with bf16 compute: FSDP2 with MixedPrecisionPolicy(param_dtype=
    bf16, reduce_dtype=fp32) and the hand ZeRO-2 and ZeRO-3 with compute_dtype=bf16 (fp32 master
    slices, gradients reduced in fp32); and two controls that compute in fp32: FSDP2 without
    the policy and ZeRO-3 without a compute dtype. Each run as `run_stage` returns it, plus
    "diff": the max |dparam| from FSDP2 with the policy, agreed over the ranks."""
    bf16, fp32 = torch.bfloat16, torch.float32
    runs = {f"{name} bf16": run_stage(name, cfg, X, Y, vocab, info, fp32, bf16)
            for name in ("FSDP2", "ZeRO-2", "ZeRO-3")}
    runs["FSDP2 fp32"] = run_stage("FSDP2", cfg, X, Y, vocab, info, fp32)
    runs["ZeRO-3 fp32"] = run_stage("ZeRO-3", cfg, X, Y, vocab, info, fp32)
    for r in runs.values():
        r["diff"] = reduce_number(max_diff(r["params"], runs["FSDP2 bf16"]["params"]), "max")
    return runs


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        X, Y, vocab = global_batches(cfg, info.device)
        N, tol = info.world_size, parity_tolerance(cfg)
        z = memory.sizes(build_model(cfg, vocab, info.device))
        runs = {}
        for name in STAGES:
            runs[name] = run_stage(name, cfg, X, Y, vocab, info)
            log.info("%-23s loss %s", name, " ".join(f"{v:.4f}" for v in runs[name]["losses"]))
        for step, loss in enumerate(runs["DDP"]["losses"]):
            rec.metrics(step, loss=loss, lr=cfg.lr)

        def fresh_model(dtype=None):  # the same seeded model, anew, for the formulas' sizes
            return build_model(cfg, vocab, info.device, dtype)

        check_stages(rec, runs, STAGES, z, N, tol, fresh_model)

        if cfg.mixed_precision:
            check_mixed_precision(rec, mixed_precision_runs(cfg, X, Y, vocab, info), fresh_model, N)
        z3 = ZeroThree(build_model(cfg, vocab, info.device))
        qwz(z3.shard.detach(), cfg.qwz_block, rec)

        check_paper_table(rec)
        rec.figure("trainable parameters psi", z["psi"])
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt",
                            {"params": {n: r["params"] for n, r in runs.items()},
                             "rest": {n: r["rest"] for n, r in runs.items()},
                             "peak": {n: r["peak"] for n, r in runs.items()},
                             "volume": {n: r["volume"] for n, r in runs.items()},
                             "calls": {n: r["calls"] for n, r in runs.items()}})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
