"""The same training with DeepSpeed's ZeRO stages, checked against plain DDP + Adam.

DeepSpeed implements ZeRO as a training engine configured by a JSON file: the stage is one
number in it. This script builds that config (written to <out>/ds_config.json), trains train.py's tiny GPT
with each stage and compares the parameters with DDP + Adam; a broken run (every rank fed the
same shard) must fail the same comparison. Needs `pip install deepspeed==0.19.8` (CPU works; the
first run compiles a small communication op, about a minute, cached in ~/.cache/torch_extensions).

Run:
    torchrun --standalone --nproc_per_node=2 chapters/ch06_hybrid_zero/deepspeed_zero.py
    torchrun --standalone --nproc_per_node=3 chapters/ch06_hybrid_zero/deepspeed_zero.py --stages 3
    torchrun --standalone --nproc_per_node=8 chapters/ch06_hybrid_zero/deepspeed_zero.py   # 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch06_hybrid_zero/deepspeed_zero.py
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch06_hybrid_zero/deepspeed_zero.py
(DeepSpeed's own launcher, `deepspeed --num_gpus=8 deepspeed_zero.py`, sets the same variables.)
"""

import json
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from chapters.ch06_hybrid_zero import checks, train
from chapters.ch06_hybrid_zero.probe import StepProbe
from common.config import check_global_batch, parse_config
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import (
    init_deepspeed,
    library_output,
    log,
    progress,
    setup_logging,
)
from common.results import RunRecorder


@dataclass
class Config(train.Config):
    stages: list[int] = field(default_factory=lambda: [1, 2, 3])
    """DeepSpeed ZeRO stages to train, one after another."""
    dtype: str = "float32"
    """float32 (ZeRO-3 refuses float64); parity within a calibrated lr/100 (see the lesson)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.stages or any(s not in (0, 1, 2, 3) for s in self.stages):
            raise ValueError(f"--stages must be among 0 1 2 3, got {self.stages}")
        if self.dtype == "float64" and 3 in self.stages:
            raise ValueError("DeepSpeed ZeRO-3 accepts only float32, float16 and bfloat16 parameters")


def validate(cfg: Config, world_size: int) -> None:
    """Every rank trains on an equal share of the global batch."""
    check_global_batch(cfg.global_batch_size, world_size)


def ds_config(stage: int, micro_batch_size: int) -> dict:
    """DeepSpeed's JSON config: the whole of ZeRO is the "zero_optimization" block."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips to norm 1.0 unless told otherwise
        "zero_optimization": {
            "stage": stage,
            "reduce_scatter": True,        # stages 1-2: each rank gets only its slice's sum
            "contiguous_gradients": True,  # copy gradients into one buffer as they arrive
            "overlap_comm": False,         # True overlaps the reduction with backward (GPUs)
            # stages 1-2: send each slice to its owner with a reduce (Ψ in all); the default
            # (True) all-reduces the bucket and keeps a slice (2Ψ), so a step moves 3Ψ, not 2Ψ
            "use_multi_rank_bucket_allreduce": False,
            # stage 3 keeps tensors under stage3_param_persistence_threshold (1e5 numbers: all of
            # this tiny model's) whole on every rank and all-gathers them once per step: 2Ψ
        },
        "zero_allow_untested_optimizer": True,  # we pass torch.optim.Adam, not DeepSpeed's
        "steps_per_print": 10**9,
    }


PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold


def expected_volume(stage: int, model: torch.nn.Module) -> float:
    """Bytes to collectives in a step, in units of Ψ bytes, for this config: stages 1-2 send each
    slice to its owner (reduce, Ψ) and all-gather the updated slices (Ψ). Stage 3 reduce-scatters
    (Ψ) and gathers each tensor before forward and backward (2Ψ, the paper's 3Ψ) unless it has
    fewer than PERSISTENCE_THRESHOLD numbers: such a tensor stays whole on every rank and is
    all-gathered once, after the update, the frozen ones too. (Padding and a scalar all-reduce
    per step add a little.)"""
    trainable = [p for p in model.parameters() if p.requires_grad]
    psi_bytes = sum(p.numel() * p.element_size() for p in trainable)
    if stage < 3:
        return 2.0
    gathered = sum(p.numel() * p.element_size() * (1 if p.numel() < PERSISTENCE_THRESHOLD else 2)
                   for p in model.parameters())
    return 1 + gathered / psi_bytes


def train_deepspeed(stage: int, cfg: Config, X, Y, vocab: int, info, data_rank: int) -> tuple[dict, StepProbe]:
    """Train with one ZeRO stage; return the whole parameters and the probe of the last step
    (the collectives it called, the bytes it handed them). `data_rank` picks the shard (the
    negative control passes 0 on every rank)."""
    import deepspeed

    model = train.build_model(cfg, vocab, info.device)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    config = ds_config(stage, cfg.global_batch_size // info.world_size)
    with library_output():  # DeepSpeed prints its whole configuration here
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    probe = StepProbe()
    for step, (x, y) in enumerate(zip(X, Y)):
        with probe if step == len(X) - 1 else nullcontext():
            _, loss = engine(x.chunk(info.world_size)[data_rank], y.chunk(info.world_size)[data_rank])
            engine.backward(loss)  # the engine reduces (stage 1-2: reduce-scatters) the gradients
            engine.step()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):  # whole again
        whole = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()  # its hooks and buffers go now, while the process group still exists
    return whole, probe


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        deepspeed = init_deepspeed(info)  # its start-up noise goes to the library log
        rec = RunRecorder(cfg, __file__, info)
        X, Y, vocab = train.global_batches(cfg, info.device)
        config = ds_config(cfg.stages[-1], cfg.global_batch_size // info.world_size)
        if info.is_main:
            (rec.out / "ds_config.json").write_text(json.dumps(config, indent=2) + "\n")
        log.info("DeepSpeed %s; its config for ZeRO-%d is ds_config.json in the output folder",
                 deepspeed.__version__, cfg.stages[-1])
        model, opt = train.make_stage("DDP", train.build_model(cfg, vocab, info.device), cfg, info)
        losses = train.train_steps(model, opt, X, Y, info.rank, info.world_size)
        for step, loss in enumerate(losses):
            rec.metrics(step, loss=loss, lr=cfg.lr)
        reference = train.full_parameters(model)
        tol = checks.parity_tolerance(cfg)
        psi_bytes = sum(p.numel() * p.element_size() for p in reference.values()) - \
            reference["pos_emb.weight"].numel() * reference["pos_emb.weight"].element_size()
        for stage in progress(cfg.stages, len(cfg.stages), "DeepSpeed ZeRO stages trained", info.is_main, 1):
            got, probe = train_deepspeed(stage, cfg, X, Y, vocab, info, info.rank)
            rec.check(f"DeepSpeed ZeRO-{stage} == DDP + Adam (max |dparam|)", "parity",
                      reduce_number(checks.max_diff(got, reference), "max"), 0.0, tol)
            rec.figure(f"DeepSpeed ZeRO-{stage} volume / (psi b)", round(probe.total_volume / psi_bytes, 3),
                       round(expected_volume(stage, train.build_model(cfg, vocab, info.device)), 3),
                       "x psi bytes")
            rec.figure(f"DeepSpeed ZeRO-{stage} collectives in a step",
                       " ".join(f"{k}x{v}" for k, v in sorted(probe.calls.items()))
                       + "".join(f" {k}(not counted)" for k in sorted(probe.uncounted)))
        if info.world_size > 1:  # negative control: the same check must reject unsharded data
            got, _ = train_deepspeed(cfg.stages[-1], cfg, X, Y, vocab, info, 0)
            diff = reduce_number(checks.max_diff(got, reference), "max")
            rec.check(f"negative control: ZeRO-{cfg.stages[-1]} on one shard differs", "parity",
                      diff, 10 * tol, compare=">")
        rec.figure("final loss", losses[-1])
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
