"""Overlapping gradient communication with backward: naive, bucketed by hand, and DDP.

Chapter 03 all-reduced every gradient after backward returned, so the network sat idle during
backward and the cores sat idle during communication. Here gradients are packed into buckets in
reverse layer order and each bucket's all-reduce is launched asynchronously from a gradient hook
as soon as it is full, while backward carries on; this script trains the same model the naive
way, with the hand-written `BucketedDDP` and with torch DDP, proves all three equal one process,
records when every all-reduce was launched, writes a profiler trace of each and times them.

Run:
    python chapters/ch08_overlap/train.py                                  # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch08_overlap/train.py
    torchrun --standalone --nproc_per_node=3 chapters/ch08_overlap/train.py --sweep-kb 16 1024
    torchrun --standalone --nproc_per_node=8 chapters/ch08_overlap/train.py \\
        --d-model 1024 --n-layer 8 --dtype float32 --bucket-kb 25600      # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch08_overlap/train.py                                     # two nodes
    srun --ntasks=16 --ntasks-per-node=8 python chapters/ch08_overlap/train.py   # Slurm
"""

import copy
import json
import statistics
import sys
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from chapters.ch03_data_parallel.train import (
    all_reduce_gradients,
    counting_allreduce_hook,
    max_param_diff,
    micro_batches,
)
from chapters.ch08_overlap.bucketed import (
    BucketedDDP,
    EventLog,
    broadcast_from_rank0,
    build_buckets,
    trainable_parameters,
)
from common.checkpoint import save_checkpoint
from common.config import RunConfig, parse_config
from common.data import CharTokenizer, text_corpus, token_windows
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.models import GPTConfig, TinyGPT
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import Timer

DTYPES = {"float64": torch.float64, "float32": torch.float32}
VARIANTS = ("naive", "bucketed", "ddp")


@dataclass
class Config(RunConfig):
    steps: int = 8
    """Optimizer steps to train each variant."""
    global_batch_size: int = 12
    """Sequences per optimizer step, summed over all ranks."""
    block_size: int = 32
    """Tokens per sequence."""
    d_model: int = 64
    """Width of the TinyGPT (its head weight is tied to the token embedding)."""
    n_layer: int = 2
    """Transformer blocks."""
    lr: float = 0.1
    """Learning rate of plain SGD."""
    bucket_kb: int = 64
    """Bucket size cap in KiB of the hand-written wrapper and of DDP (DDP's default is 25 MiB)."""
    sweep_kb: list[int] = field(default_factory=lambda: [16, 256, 4096])
    """More bucket caps in KiB to time the hand-written wrapper with, beside --bucket-kb (reported, never asserted)."""
    profile_steps: int = 2
    """Steps of each variant traced by torch.profiler into <out>/trace_<variant>.json.gz (0: none)."""
    dtype: str = "float64"
    """float64 makes the parity checks exact to ~1e-12; float32 needs ~1e-6 (see the lesson)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.bucket_kb < 1 or min(self.sweep_kb) < 1:
            raise ValueError("bucket sizes (--bucket-kb, --sweep-kb) must be at least 1 KiB")
        if self.global_batch_size < 1:
            raise ValueError(f"--global-batch-size must be positive, got {self.global_batch_size}")
        if not 0 <= self.profile_steps <= self.steps:
            raise ValueError(f"--profile-steps must be between 0 and --steps ({self.steps})")


def build_model(cfg: Config, vocab_size: int, device: torch.device) -> TinyGPT:
    """A TinyGPT with a tied head and a frozen position embedding: the two cases a wrapper
    must get right (one gradient for two uses; a parameter with no gradient at all)."""
    gcfg = GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                     n_head=4, d_model=cfg.d_model)
    model = TinyGPT(gcfg).to(device, DTYPES[cfg.dtype])
    model.pos_emb.weight.requires_grad_(False)
    return model


def global_batches(cfg: Config, device: torch.device):
    """The same (steps, global_batch_size, block_size) token windows on every rank."""
    tok = CharTokenizer.fit(text_corpus())
    tokens = tok.encode(text_corpus(max_chars=100_000))
    x, y = token_windows(tokens, cfg.block_size, cfg.steps * cfg.global_batch_size, seed=cfg.seed)
    shape = (cfg.steps, cfg.global_batch_size, cfg.block_size)
    return x.view(shape).to(device), y.view(shape).to(device), tok.vocab_size


def naive_sync(model: nn.Module, world_size: int, events: EventLog, sent: dict) -> None:
    """Chapter 03's way: after backward returns, all-reduce every gradient, one at a time."""
    events.record("launch", "every gradient")
    all_reduce_gradients(model, world_size)  # blocking: each call returns when it is done
    events.record("wait", "every gradient")
    sent["bytes"] += sum(p.grad.numel() * p.grad.element_size()
                         for p in model.parameters() if p.grad is not None)


def logging_allreduce_hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: log the launch of this bucket, then chapter 03's counting all-reduce."""
    state["events"].record("launch", f"bucket {bucket.index()}")
    return counting_allreduce_hook(state, bucket)


def wrap(kind: str, model: nn.Module, cap_bytes: int, info, events: EventLog):
    """(module to call, sync to run after backward, bytes sent so far) for one way of doing DP."""
    events.watch(model)  # before wrapping: its hooks fire before the wrapper's
    if kind == "naive":
        broadcast_from_rank0(model)
        sent = {"bytes": 0}
        return model, partial(naive_sync, model, info.world_size, events, sent), lambda: sent["bytes"]
    if kind == "bucketed":
        wrapped = BucketedDDP(model, cap_bytes, events)
        return wrapped, wrapped.finish_gradient_sync, lambda: wrapped.bytes_sent
    ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
              bucket_cap_mb=cap_bytes / 2**20)
    state = {"calls": 0, "bytes": 0, "events": events}
    ddp.register_comm_hook(state, logging_allreduce_hook)
    return ddp, lambda: None, lambda: state["bytes"]  # DDP waits inside backward


def train_step(model: nn.Module, sync, opt, x, y, events: EventLog) -> float:
    opt.zero_grad()
    with record_function("forward"):
        _, loss = model(x, y)
    with record_function("backward"):
        loss.backward()
    events.record("backward_end")
    with record_function("finish_gradient_sync"):
        sync()
    opt.step()
    return loss.item()


def train_variant(kind: str, init: nn.Module, X, Y, cfg: Config, info, cap_bytes: int) -> dict:
    """Train a copy of `init` on this rank's shards; keep step times and the last step's events."""
    model, events = copy.deepcopy(init), EventLog()
    wrapped, sync, sent = wrap(kind, model, cap_bytes, info, events)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)  # frozen: no .grad, SGD skips it
    times = []
    for step in range(cfg.steps):
        x, y = (micro_batches(t[step], info.rank, info.world_size, 1)[0] for t in (X, Y))
        events.start_step()
        with Timer(info.device) as t:
            train_step(wrapped, sync, opt, x, y, events)
        times.append(t.elapsed)
    return {"model": model, "ms": 1e3 * statistics.median(times[1:] or times),
            "events": events.events, "bytes_per_step": sent() / cfg.steps}


def trace_variant(kind: str, init: nn.Module, X, Y, cfg: Config, info, cap_bytes: int,
                  path) -> None:
    """A torch.profiler Chrome trace of a few steps (every rank runs them; rank 0 writes)."""
    model, events = copy.deepcopy(init), EventLog()
    wrapped, sync, _ = wrap(kind, model, cap_bytes, info, events)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for step in range(cfg.profile_steps):
            x, y = (micro_batches(t[step], info.rank, info.world_size, 1)[0] for t in (X, Y))
            train_step(wrapped, sync, opt, x, y, events)
    if info.is_main:
        prof.export_chrome_trace(str(path))  # .gz: compressed, open it in ui.perfetto.dev


def train_single(init: nn.Module, X, Y, cfg: Config) -> tuple[nn.Module, list[float]]:
    """The reference: one process, the whole global batch, the same SGD."""
    model = copy.deepcopy(init)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        opt.zero_grad()
        _, loss = model(X[step], Y[step])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def launch_order(events: list[dict]) -> dict:
    """The overlap proof, read from one step's event log: how many all-reduces were launched
    before backward returned, and how many gradients existed at the first launch."""
    end = next(e["seq"] for e in events if e["kind"] == "backward_end")
    launches = [e for e in events if e["kind"] == "launch"]
    return {"launches": len(launches),
            "before_backward_end": sum(e["seq"] < end for e in launches),
            "grads_at_first_launch": launches[0]["grads_ready"] if launches else -1,
            "grads": sum(e["kind"] == "grad" for e in events)}


def bucket_names(model: nn.Module, cap_bytes: int) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in b] for b in build_buckets(trainable_parameters(model), cap_bytes)]


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        if cfg.global_batch_size % info.world_size:
            raise SystemExit(f"error: --global-batch-size {cfg.global_batch_size} must divide into "
                             f"{info.world_size} ranks; use a multiple of {info.world_size}")
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        X, Y, vocab = global_batches(cfg, info.device)
        init = build_model(cfg, vocab, info.device)
        cap, params = cfg.bucket_kb * 1024, trainable_parameters(init)
        n_bytes = sum(p.numel() * p.element_size() for p in params)
        buckets = bucket_names(init, cap)
        log.info("world %d on %s/%s: %d trainable tensors, %d bytes of gradient, %d buckets of <= %d KiB",
                 info.world_size, info.device, info.backend, len(params), n_bytes, len(buckets),
                 cfg.bucket_kb)

        single, losses = train_single(init, X, Y, cfg)
        runs = {kind: train_variant(kind, init, X, Y, cfg, info, cap) for kind in VARIANTS}
        sweep = {kb: train_variant("bucketed", init, X, Y, cfg, info, kb * 1024)
                 for kb in cfg.sweep_kb if kb != cfg.bucket_kb}
        sweep = dict(sorted({**sweep, cfg.bucket_kb: runs["bucketed"]}.items()))
        for step, loss in enumerate(losses):
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                rec.metrics(step, loss=loss, lr=cfg.lr)
                log.info("step %3d  loss %.5f", step, loss)

        tol = 1e-10 if cfg.dtype == "float64" else 1e-6
        for kind in VARIANTS:
            rec.check(f"{kind} == one process (max |dparam|)", "parity",
                      max_param_diff(runs[kind]["model"], single), 0.0, tol)
        rec.check("bucketed == one process, every swept bucket size", "parity",
                  max(max_param_diff(r["model"], single) for r in sweep.values()), 0.0, tol)
        order = {kind: launch_order(runs[kind]["events"]) for kind in VARIANTS}
        rec.check("gradients per step = trainable tensors", "count", order["bucketed"]["grads"], len(params))
        rec.check("bucketed launches per step = buckets", "count", order["bucketed"]["launches"], len(buckets))
        rec.check("bucketed launches before backward returned", "count",
                  order["bucketed"]["before_backward_end"], len(buckets))
        first = order["bucketed"]["grads_at_first_launch"]
        rec.check("bucketed: gradients ready at first launch", "count", first, [1, len(params) - 1],
                  compare="between")
        rec.check("naive launches before backward returned", "count", order["naive"]["before_backward_end"], 0)
        rec.check("DDP launches before backward returned", "count", order["ddp"]["before_backward_end"],
                  order["ddp"]["launches"])
        for kind in ("bucketed", "ddp"):
            rec.check(f"{kind} bytes per step = trainable params x bytes", "formula",
                      runs[kind]["bytes_per_step"], n_bytes)
        ratio = runs["bucketed"]["ms"] / runs["naive"]["ms"]
        rec.check("bucketed / naive step time", "timing", ratio, 1.0, compare="<")

        for kind in VARIANTS:
            rec.figure(f"{kind} step time", runs[kind]["ms"], unit="ms")
        rec.figure("bucketed / naive step time", ratio)
        rec.figure("DDP / naive step time", runs["ddp"]["ms"] / runs["naive"]["ms"])
        rec.figure("DDP buckets per step", order["ddp"]["launches"])
        for kb, r in sweep.items():
            n = len(build_buckets(params, kb * 1024))
            rec.figure(f"bucketed step time, cap {kb} KiB ({n} buckets)", r["ms"], unit="ms")
            rec.figure(f"bucketed / naive, cap {kb} KiB", r["ms"] / runs["naive"]["ms"])
        if cfg.profile_steps:
            for kind in VARIANTS:
                trace_variant(kind, init, X, Y, cfg, info, cap, rec.out / f"trace_{kind}.json.gz")
        if info.is_main:
            log_json = {kind: runs[kind]["events"] for kind in VARIANTS}
            (rec.out / "events.json").write_text(json.dumps({**log_json, "buckets": buckets}, indent=1))
            save_checkpoint(rec.out / "final_params.pt", {
                "single": single.state_dict(), "losses": torch.tensor(losses),
                **{kind: runs[kind]["model"].state_dict() for kind in VARIANTS}})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__)))
