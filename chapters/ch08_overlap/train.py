"""Overlapping gradient communication with backward: naive, bucketed by hand, and DDP.

Chapter 03 all-reduced every gradient after backward returned, so the network sat idle during
backward and the cores sat idle during communication. Here gradients are packed into buckets in
reverse layer order and each bucket's all-reduce is launched asynchronously from a gradient hook
as soon as it is full, while backward carries on. This script trains the same model four ways:
the naive loop, the same buckets launched only after backward (the control: fewer messages, no
overlap), the hand-written `BucketedDDP` (the same buckets, overlapped) and torch DDP; proves all
equal one process; logs when every all-reduce was launched and seen complete relative to the end
of backward; writes a profiler trace of each and times them. The checks and the one-process
reference are in checks.py; the backward sleep and the exposed-sync timer in instruments.py.

Run:
    python chapters/ch08_overlap/train.py                                  # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch08_overlap/train.py
    torchrun --standalone --nproc_per_node=2 chapters/ch08_overlap/train.py --backward-sleep-ms 20
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
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from chapters.ch03_data_parallel.data_parallel import all_reduce_gradients
from chapters.ch08_overlap.bucketed import BucketedDDP, EventLog, build_buckets
from chapters.ch08_overlap.checks import (
    VARIANTS,
    check_order,
    check_parity,
    report_timing,
    train_single,
)
from chapters.ch08_overlap.instruments import ExposedTimer, add_backward_sleep
from common.checkpoint import save_checkpoint
from common.config import RunConfig, parse_config
from common.data import CharTokenizer, text_corpus, token_windows
from common.distributed import (
    broadcast_from_rank0,
    reduce_number,
    setup_distributed,
    teardown_distributed,
    trainable_params,
)
from common.log import library_output, log, setup_logging
from common.models import GPTConfig, TinyGPT
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import Timer, synchronize

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class Config(RunConfig):
    steps: int = 8
    """Optimizer steps to train each variant."""
    micro_batch_size: int = 6
    """Sequences per rank per step; the global batch is this times the world size."""
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
    backward_sleep_ms: float = 0.0
    """A fixed sleep added to each block's backward, in every variant: a stand-in for accelerator compute, which keeps backward busy while the host's cores stay free for communication (0: off)."""
    profile_steps: int = 2
    """Steps of each variant traced by torch.profiler into <out>/trace_<variant>.json.gz (0: none)."""
    dtype: str = "float64"
    """float64: the parity checks use 1e-10 (measured ~2e-16); float32: 1e-5 (measured ~1e-7; see the lesson)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.bucket_kb < 1 or min(self.sweep_kb) < 1:
            raise ValueError("bucket sizes (--bucket-kb, --sweep-kb) must be at least 1 KiB")
        if self.micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be at least 1, got {self.micro_batch_size}")
        if self.backward_sleep_ms < 0:
            raise ValueError(f"--backward-sleep-ms must not be negative, got {self.backward_sleep_ms}")
        if not 0 <= self.profile_steps <= self.steps:
            raise ValueError(f"--profile-steps must be between 0 and --steps ({self.steps})")


def validate(cfg: Config, world_size: int) -> None:
    """Nothing here depends on the world size: the batch is given per rank, every world divides
    it. (Every collective used is an all-reduce, a broadcast or DDP's start-up all-gather.)"""


def wrap(kind: str, model: nn.Module, cap_kb: int, info):
    """(module to call, sync to run after backward) for one way of doing data parallelism."""
    cap_mb = cap_kb / 1024  # both wrappers take MiB, as DDP does
    if kind == "naive":
        broadcast_from_rank0(model)
        return model, partial(all_reduce_gradients, model, info.world_size)
    if kind in ("deferred", "bucketed"):
        wrapped = BucketedDDP(model, bucket_cap_mb=cap_mb, overlap=kind == "bucketed")
        return wrapped, wrapped.finish_gradient_sync
    ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
              bucket_cap_mb=cap_mb)
    # DDP's own default all-reduce, as a Python hook: nothing changes but that the event log
    # now sees each bucket's dist.all_reduce (DDP's built-in one is called from C++).
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return ddp, lambda: None  # DDP waits inside backward


def train_step(model: nn.Module, sync, opt, x, y, events: EventLog, device) -> float:
    """One step; returns the seconds spent in the sync after backward: the communication left
    *exposed* (all of it for the naive loop and the deferred buckets, what was not hidden for
    the overlapped wrapper, ~nothing for DDP, which waits inside backward)."""
    opt.zero_grad()
    with record_function("forward"):
        _, loss = model(x, y)
    with record_function("backward"):
        loss.backward()
    if not events.of_kind("backward_end"):
        raise RuntimeError("the event log saw no end of backward: watch() the model first")
    with record_function("finish_gradient_sync"), ExposedTimer(device) as exposed:
        sync()
    opt.step()
    synchronize(device)
    events.poll()  # whatever completed after backward
    return exposed.elapsed


def train_variant(kind: str, init: nn.Module, X, Y, cfg: Config, info, cap_kb: int) -> dict:
    """Train a copy of `init` on this rank's shards; keep step times and the first and last
    steps' event logs."""
    model, events = copy.deepcopy(init), EventLog()
    add_backward_sleep(model, cfg.backward_sleep_ms)
    events.watch(model)  # before wrapping: its hooks fire before the wrapper's
    wrapped, sync = wrap(kind, model, cap_kb, info)
    events.watch_wrapper(model)  # after wrapping: a poll right after the wrapper's hooks
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)  # frozen: no .grad, SGD skips it
    times, exposed, logs = [], [], []
    with events.observe_all_reduce():
        for step in range(cfg.steps):
            x, y = (rank_shard(t[step], info.rank, info.world_size) for t in (X, Y))
            events.start_step()
            with Timer(info.device) as t:
                exposed.append(train_step(wrapped, sync, opt, x, y, events, info.device))
            times.append(t.elapsed)
            logs.append(events.events)
    timed, exposed = times[1:] or times, exposed[1:] or exposed  # step 0 builds buffers: left out
    # A data-parallel step is as slow as its slowest rank: agree on the slowest rank's figures.
    # The exposed sync is the smallest over ranks: the rank that reaches it last waits only for
    # the communication itself, the others also for it (skew, not communication).
    return {"model": model, "ms": 1e3 * reduce_number(statistics.median(timed), "max"),
            "ms_min": 1e3 * reduce_number(min(timed), "max"),
            "ms_max": 1e3 * reduce_number(max(timed), "max"),
            "exposed_ms": 1e3 * reduce_number(statistics.median(exposed), "min"), "logs": logs}


def trace_variant(kind: str, init: nn.Module, X, Y, cfg: Config, info, cap_kb: int, path) -> None:
    """A torch.profiler Chrome trace of a few steps (every rank runs them; rank 0 writes)."""
    model, events = copy.deepcopy(init), EventLog()
    add_backward_sleep(model, cfg.backward_sleep_ms)
    events.watch(model)
    wrapped, sync = wrap(kind, model, cap_kb, info)
    events.watch_wrapper(model)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    # the profiler's own C++ log lines (kineto) go to the library log, not the console
    with library_output(), profile(activities=activities) as prof:
        for step in range(cfg.profile_steps):
            x, y = (rank_shard(t[step], info.rank, info.world_size) for t in (X, Y))
            events.start_step()
            train_step(wrapped, sync, opt, x, y, events, info.device)
    if info.is_main:
        with library_output():
            prof.export_chrome_trace(str(path))  # .gz: compressed, open it in ui.perfetto.dev


def build_model(cfg: Config, vocab_size: int, device: torch.device) -> TinyGPT:
    """A TinyGPT with a tied head and a frozen position embedding: the two cases a wrapper
    must get right (one gradient for two uses; a parameter with no gradient at all)."""
    gcfg = GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                     n_head=4, d_model=cfg.d_model)
    model = TinyGPT(gcfg).to(device, DTYPES[cfg.dtype])
    model.pos_emb.weight.requires_grad_(False)
    return model


def global_batches(cfg: Config, world_size: int, device: torch.device):
    """The same (steps, micro_batch_size × world_size, block_size) token windows on every rank."""
    batch = cfg.micro_batch_size * world_size
    tok = CharTokenizer.fit(text_corpus())
    tokens = tok.encode(text_corpus(max_chars=100_000))
    x, y = token_windows(tokens, cfg.block_size, cfg.steps * batch, seed=cfg.seed)
    shape = (cfg.steps, batch, cfg.block_size)
    return x.view(shape).to(device), y.view(shape).to(device), tok.vocab_size


def rank_shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous share of a global batch (chapter 03's layout)."""
    return t.chunk(world_size)[rank]


def bucket_names(model: nn.Module, cap_bytes: int) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in b] for b in build_buckets(trainable_params(model.parameters()), cap_bytes)]


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        X, Y, vocab = global_batches(cfg, info.world_size, info.device)
        init = build_model(cfg, vocab, info.device)
        params = trainable_params(init.parameters())
        n_bytes = sum(p.numel() * p.element_size() for p in params)
        buckets = bucket_names(init, cfg.bucket_kb * 1024)
        log.info("world %d on %s/%s: %d trainable tensors, %d bytes of gradient, global batch %d",
                 info.world_size, info.device, info.backend, len(params), n_bytes, X.shape[1])
        log.info("%d buckets of <= %d KiB%s", len(buckets), cfg.bucket_kb,
                 f", {cfg.backward_sleep_ms:g} ms sleep per block in backward" if cfg.backward_sleep_ms else "")

        single, losses = train_single(init, X, Y, cfg)
        runs = {kind: train_variant(kind, init, X, Y, cfg, info, cfg.bucket_kb) for kind in VARIANTS}
        sweep = {kb: train_variant("bucketed", init, X, Y, cfg, info, kb)
                 for kb in cfg.sweep_kb if kb != cfg.bucket_kb}
        sweep = dict(sorted({**sweep, cfg.bucket_kb: runs["bucketed"]}.items()))
        for step, loss in enumerate(losses):
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                rec.metrics(step, loss=loss, lr=cfg.lr)
                log.info("step %3d  loss %.5f", step, loss)

        check_parity(rec, runs, sweep, single, cfg.dtype)
        ddp_buckets = check_order(rec, runs, len(params), n_bytes, len(buckets), cfg.bucket_kb)
        report_timing(rec, runs, sweep, params, len(buckets), ddp_buckets)
        if cfg.profile_steps:
            for kind in VARIANTS:
                trace_variant(kind, init, X, Y, cfg, info, cfg.bucket_kb, rec.out / f"trace_{kind}.json.gz")
        if info.is_main:
            logs = {kind: runs[kind]["logs"][-1] for kind in VARIANTS}
            (rec.out / "events.json").write_text(json.dumps(
                {**logs, "ddp_first_step": runs["ddp"]["logs"][0], "buckets": buckets}, indent=1))
            save_checkpoint(rec.out / "final_params.pt", {
                "single": single.state_dict(), "losses": torch.tensor(losses),
                **{kind: runs[kind]["model"].state_dict() for kind in VARIANTS}})
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
