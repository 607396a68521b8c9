"""Train a small Llama end to end: a BPE tokenizer trained here, FSDP2 with bf16 mixed precision,
activation checkpointing, warm-up + cosine, clipping, DCP checkpoints and resume, tokens/s and
MFU, samples, and a Hugging Face export that reloads to the same logits.

Everything is built on this machine: the tokenizer is trained on the course corpus (pydoc's help
topics), the model comes from a local `LlamaConfig`; nothing is downloaded. The script also runs
FSDP2 against DDP in float32, counts FLOPs with `FlopCounterMode` against the formula, and
resumes from its checkpoint to prove the resumed run continues exactly.

Run:
    python chapters/ch25_llm/train.py                                        # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch25_llm/train.py      # CPU, seconds
    torchrun --standalone --nproc_per_node=4 chapters/ch25_llm/train.py --steps 80
    python chapters/ch25_llm/train.py --preset gpu                           # one H100/H200: MFU
    torchrun --standalone --nproc_per_node=8 chapters/ch25_llm/train.py --preset gpu
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch25_llm/train.py --preset gpu --out /shared/runs/ch25   # a folder all nodes see
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch25_llm/train.py --preset gpu \\
        --out /shared/runs/ch25
"""

import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Literal

import torch
import torch.distributed as dist

from chapters.ch25_llm import checks, export, parity, tokenizer
from chapters.ch25_llm.model import (
    PRESETS,
    apply_activation_checkpointing,
    apply_fsdp,
    build_model,
    llama_config,
    lr_at,
    n_params,
)
from chapters.ch25_llm.resume import (
    cuda_determinism,
    enter_deterministic_mode,
    load_checkpoint,
    save_checkpoint,
)
from common.checkpoint import require_shared_folder
from common.config import RunConfig, parse_config
from common.distributed import (
    setup_distributed,
    teardown_distributed,
)
from common.log import library_output, log, progress, setup_logging
from common.results import RunRecorder
from common.timing import Timer

SAMPLE_PROMPT = "The "


@dataclass
class Config(RunConfig):
    preset: Literal["cpu", "gpu"] = "cpu"
    """Size preset: cpu (seconds on two CPU processes) or gpu (a 300M-parameter Llama,
    sequence 2048, torch.compile: MFU on one H100/H200). Options set to 0 take the preset's value."""
    steps: int = 0
    """Optimizer steps to train (0: the preset's, 80 on cpu, 60 on gpu)."""
    vocab_size: int = 0
    """BPE vocabulary size, also the model's (0: the preset's, 1024 / 8192)."""
    hidden_size: int = 0
    """Model width h (0: the preset's, 64 / 1024)."""
    n_layers: int = 0
    """Decoder layers L (0: the preset's, 2 / 24)."""
    n_heads: int = 0
    """Attention heads (0: the preset's, 4 / 16)."""
    n_kv_heads: int = 0
    """Key/value heads of grouped-query attention (0: the preset's, 2 / 8)."""
    ffn_size: int = 0
    """SwiGLU hidden size (0: the preset's, 176 / 2816)."""
    seq_len: int = 0
    """Tokens per sequence T (0: the preset's, 64 / 2048)."""
    micro_batch_size: int = 0
    """Sequences per rank per step (0: the preset's, 8); global batch = this x world size."""
    lr: float = 0.0
    """Peak learning rate of AdamW (0: the preset's, 3e-3 / 6e-4)."""
    warmup_steps: int = 0
    """Linear warm-up steps before the cosine decay (0: the preset's, 10)."""
    timed_from: int = 0
    """First step whose time counts for tokens/s and MFU (0: the preset's, 3 / 20): warm-up and
    compilation excluded."""
    compile: bool | None = None
    """torch.compile each decoder layer (default: the preset's, off on cpu, on on gpu)."""
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """What the layers compute in (FSDP2 MixedPrecisionPolicy); master weights stay float32."""
    activation_checkpointing: bool = True
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this."""
    save_at: int = -4
    """Save a DCP checkpoint after this many steps (negative: counted from the end) and resume
    from it at the end to check that the resumed run continues exactly."""
    parity_steps: int = 4
    """Steps of the float32 FSDP2-vs-DDP comparison (on the cpu preset's model size; 0: skip)."""
    sample_tokens: int = 40
    """Tokens to generate at the end (greedy) from the exported model."""

    def __post_init__(self) -> None:
        preset = PRESETS[self.preset]
        for f in fields(self):
            if f.name in preset and getattr(self, f.name) in (0, None):
                setattr(self, f.name, preset[f.name])
        super().__post_init__()
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads",
                     "ffn_size", "seq_len", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.hidden_size % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("--hidden-size must be divisible by --n-heads, and --n-heads by "
                             "--n-kv-heads")
        if self.vocab_size < 258:
            raise ValueError("--vocab-size must be at least 258 (256 bytes, one special token, "
                             "one merge)")
        if not 1 <= self.save_step() < self.steps:
            raise ValueError(f"--save-at {self.save_at} must leave at least one step before and "
                             f"after the checkpoint of a {self.steps}-step run")

    def save_step(self) -> int:
        return self.save_at if self.save_at >= 0 else self.steps + self.save_at


def validate(cfg: Config, world_size: int) -> None:
    """The batch is per rank, so every world divides it. FSDP2 reduce-scatters, which gloo runs on
    CUDA tensors as an all-reduce of the whole input (torch 2.14.1's ProcessGroupGloo), untested
    here: ranks sharing a GPU through gloo are refused."""
    on_gpus = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if world_size > 1 and cfg.backend == "gloo" and on_gpus:
        raise ValueError("FSDP2 reduce-scatters, which gloo runs on CUDA tensors as an all-reduce "
                         "of the whole input (untested): use NCCL (one GPU per rank) or --device cpu")
    if cfg.timed_from >= cfg.steps:
        raise ValueError(f"--timed-from {cfg.timed_from} leaves no timed step of {cfg.steps}")
    if on_gpus and cfg.timed_from >= cfg.save_step():
        raise ValueError(f"--timed-from {cfg.timed_from} leaves no timed step before the "
                         f"checkpoint at step {cfg.save_step()} (later steps are deterministic)")


def model_config(cfg: Config):
    return llama_config(cfg.vocab_size, cfg.hidden_size, cfg.n_layers, cfg.n_heads,
                        cfg.n_kv_heads, cfg.ffn_size, cfg.seq_len)


def build_fsdp_model(cfg: Config, config, info, seed: int):
    """The Llama with activation checkpointing, compiled layers (if asked) and FSDP2 units."""
    model = build_model(config, seed, info.device)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.compile:
        for layer in model.model.layers:
            layer.compile()  # per layer, before sharding: what torchtitan does
    apply_fsdp(model, param_dtype=checks.DTYPES[cfg.param_dtype])
    # foreach AdamW (the default) steps DTensor shards on every torch the course supports
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def train_steps(model, opt, cfg: Config, ids, info, first: int, last: int, rec=None,
                on_step=None, meter=None) -> dict:
    """Steps first..last-1: the step's slice of the global batch, warm-up + cosine learning rate,
    forward/backward, clipping, AdamW. Returns the losses, gradient norms and step times, the
    tokens each step fed to the model (counted by a hook on its input embedding, this rank's) and
    wall-clock stamps (`stamps[k]`: after k steps, once the device is synchronised); logs each
    step's tokens/s and MFU when given a `meter` (see `checks.throughput_meter`). Time spent in
    `on_step` (the DCP save) is taken out of the stamps and returned as `outside_s`: the wall
    clock counts training steps only."""
    losses, norms, times, tokens, outside = [], [], [], [], [0.0]
    fed = [0]
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: fed.__setitem__(0, fed[0] + args[0].numel()))
    stamps = [time.perf_counter()]
    steps = range(first, last)
    for step in progress(steps, total=len(steps), desc="step", enabled=rec is not None and info.is_main):
        before = fed[0]
        x, y = parity.rank_slice(parity.global_batch(ids, step, cfg.micro_batch_size * info.world_size,
                                                     cfg.seq_len, cfg.seed), info.rank, info.world_size)
        lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        with Timer(info.device) as timer:
            loss = parity.lm_loss(model, x.to(info.device), y.to(info.device))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)  # on info.device (NCCL takes CUDA tensors only)
        losses.append(total.item() / info.world_size)  # .item(): the device has finished
        stamps.append(time.perf_counter() - outside[0])
        tokens.append(fed[0] - before)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        times.append(timer.elapsed)
        if rec is not None:
            speed = {} if meter is None else {
                "tokens_per_s": meter["tokens"] / times[-1],
                "mfu": meter["flops"] / times[-1] / meter["peak"]}
            rec.metrics(step, loss=losses[-1], lr=lr, grad_norm=norms[-1], step_s=times[-1], **speed)
        if on_step is not None:
            t = time.perf_counter()
            on_step(step + 1)
            outside[0] += time.perf_counter() - t  # off the clock of the steps that follow
    hook.remove()
    return {"losses": losses, "norms": norms, "times": times, "tokens": tokens, "stamps": stamps,
            "outside_s": outside[0]}


def resume_and_compare(cfg, config, ids, info, path, reference: dict, with_optimizer: bool) -> dict:
    """A fresh model (another seed: the load must overwrite everything) loads the checkpoint
    and trains the remaining steps; its losses and final weights against the first run's."""
    model, opt = build_fsdp_model(cfg, config, info, seed=cfg.seed + 1)
    load_checkpoint(model, opt, path, with_optimizer)
    run = train_steps(model, opt, cfg, ids, info, cfg.save_step(), cfg.steps)
    ref_losses = reference["losses"][cfg.save_step():]
    loss_diff = max(abs(a - b) for a, b in zip(run["losses"], ref_losses))
    params = parity.full_params(model)
    param_diff = parity.max_param_diff(params, reference["params"])
    return {"loss_diff": loss_diff, "param_diff": param_diff}


def main(cfg: Config) -> int:
    on_gpus = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    determinism = cuda_determinism(on_gpus)
    os.environ.update(determinism["env"])  # before CUDA's first matmul and NCCL's first comm
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        # the DCP checkpoint's shards are written by every rank and read by all: on several
        # nodes --out must be a shared folder; refused in one line before training if it is not
        require_shared_folder(rec.out, "--out")
        tok, train_ids, val_ids, val_text = tokenizer.shared_tokenizer(cfg.vocab_size, rec.out, info.is_main)
        checks.record_tokenizer(rec, tok, cfg, train_ids, val_text)
        config = model_config(cfg)
        log.info("Llama: %.2fM parameters, L=%d h=%d heads=%d/%d kv, T=%d, %d x %d sequences "
                 "per step on %s/%s", n_params(config) / 1e6, cfg.n_layers, cfg.hidden_size,
                 cfg.n_heads, cfg.n_kv_heads, cfg.seq_len, cfg.micro_batch_size, info.world_size,
                 info.device, info.backend)
        checks.record_flops(rec, config, cfg, info)
        checks.record_parity(rec, cfg, train_ids, info)

        if cfg.compile:
            log.info("compiling the decoder layers: the first steps take a while")
        with library_output() if cfg.compile else nullcontext():
            model, opt = build_fsdp_model(cfg, config, info, cfg.seed)
        ckpt = rec.out / "checkpoint"

        def maybe_save(done: int) -> None:
            if done == cfg.save_step():
                with library_output():
                    save_checkpoint(model, opt, ckpt)
                if determinism["deterministic_from_save"]:
                    enter_deterministic_mode()  # the run's tail and the resumed runs alike

        meter = checks.throughput_meter(config, cfg, info)
        run = train_steps(model, opt, cfg, train_ids, info, 0, cfg.steps, rec, maybe_save, meter)
        run["params"] = parity.full_params(model)
        val = parity.eval_loss(model, val_ids, cfg.micro_batch_size, cfg.seq_len, cfg.seed, info.device)
        entropy = tokenizer.unigram_entropy(train_ids)
        passes = checks.training_passes(cfg, info.world_size, len(train_ids))
        checks.record_losses(rec, cfg, run["losses"], val, entropy, passes, len(train_ids),
                             info.world_size)
        checks.record_throughput(rec, run, meter,
                                 checks.timed_steps(cfg, determinism["deterministic_from_save"]))

        good = resume_and_compare(cfg, config, train_ids, info, ckpt, run, with_optimizer=True)
        bad = resume_and_compare(cfg, config, train_ids, info, ckpt, run, with_optimizer=False)
        checks.record_resume(rec, cfg.save_step(), good, bad)

        probe = parity.global_batch(val_ids, 20_000, 2, cfg.seq_len, cfg.seed)[0]
        with library_output():  # the library's progress bars
            hf = export.export_and_reload(model, config, rec.out, probe,
                                   tokenizer.encode(tok, SAMPLE_PROMPT)[None], cfg, info)
        if hf is not None:
            checks.record_export(rec, hf, run["params"], cfg.sample_tokens)
            sample = tok.decode(hf["sample"].tolist())
            log.info("\nsample (top-40, temperature 0.8, after %d steps):\n  %s", cfg.steps,
                     repr(SAMPLE_PROMPT + sample)[:96])
            rec.figure("sample: prompt + continuation", SAMPLE_PROMPT + sample, table=False)
        for step, loss in enumerate(run["losses"]):
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                log.info("step %3d  loss %.4f  grad norm %.3f  %7.0f tokens/s  MFU %.4f", step,
                         loss, run["norms"][step], meter["tokens"] / run["times"][step],
                         meter["flops"] / run["times"][step] / meter["peak"])
        rec.figure("unigram entropy of the training tokens", round(entropy, 4), unit="nats")
        if passes <= 1:
            rec.figure("held-out loss", round(val, 4), unit="nats")
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
