"""Sequence parallelism: ring attention and DeepSpeed-Ulysses by hand, checked against full attention.

Each rank holds T/N tokens of every sequence. Ring attention passes K/V blocks around the ranks
and merges partial softmaxes (causal work balanced by the zigzag split); Ulysses swaps sequence
sharding for head sharding with an all-to-all. This script checks both against full
scaled_dot_product_attention (outputs and q/k/v gradients, causal and not), counts the bytes and
chunk products per rank against their formulas, counts the activation bytes a rank keeps, and
trains a TinyGPT with its sequence sharded against one process on the whole sequence.

Run (N ranks need --seq-len divisible by 2N, and --heads divisible by N for Ulysses):
    python chapters/ch18_long_context/train.py                                  # N = 1
    torchrun --standalone --nproc_per_node=2 chapters/ch18_long_context/train.py
    torchrun --standalone --nproc_per_node=4 chapters/ch18_long_context/train.py --train-attention ulysses
    torchrun --standalone --nproc_per_node=2 chapters/ch18_long_context/train.py --deepspeed   # + DeepSpeed
    torchrun --standalone --nproc_per_node=2 chapters/ch18_long_context/train.py \\
        --sweep-lengths 192 384 768                                             # time vs length
    torchrun --standalone --nproc_per_node=8 chapters/ch18_long_context/train.py \\
        --seq-len 16384 --head-dim 64 --heads 16 --dtype float32 --steps 2      # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch18_long_context/train.py                                     # two nodes
    srun --ntasks=8 --ntasks-per-node=8 python chapters/ch18_long_context/train.py   # Slurm
"""

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from chapters.ch03_data_parallel.data_parallel import max_param_diff
from chapters.ch05_tensor_parallel.activations import SavedTensors
from chapters.ch18_long_context import layouts, parity, ring, ulysses
from chapters.ch18_long_context.sp_gpt import SequenceParallelGPT
from common.checkpoint import save_checkpoint
from common.config import RunConfig, parse_config, require_at_least_one
from common.data import CharTokenizer, text_corpus, token_windows
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, progress, setup_logging, torch_extension_built
from common.models import GPTConfig, TinyGPT
from common.results import RunRecorder
from common.timing import benchmark

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class Config(RunConfig):
    steps: int = 4
    """Optimizer steps of the sequence-parallel TinyGPT (and of its one-process reference)."""
    seq_len: int = 96
    """Tokens per sequence (T); N ranks need it divisible by 2N (the zigzag split's chunks)."""
    batch_size: int = 2
    """Sequences per batch (B), the same on every rank: the ranks split sequences, not batches."""
    heads: int = 48
    """Attention heads of the parity tensors; Ulysses needs the world size to divide them."""
    head_dim: int = 4
    """Size of one head (D) in the parity tensors."""
    d_model: int = 32
    """TinyGPT width."""
    n_head: int = 4
    """TinyGPT heads (with --train-attention ulysses the world size must divide them)."""
    n_layer: int = 2
    """TinyGPT blocks."""
    train_attention: str = "ring"
    """Attention of the sequence-parallel TinyGPT: ring (zigzag layout) or ulysses."""
    lr: float = 0.1
    """Learning rate of SGD."""
    dtype: str = "float64"
    """float64 makes parity hold to ~1e-14; float32 to ~1e-5 (tolerance: see the lesson)."""
    memory_budget_mib: float = 64.0
    """Per-rank activation budget for the 'longest sequence that fits' figure."""
    deepspeed: bool = False
    """Also check DeepSpeed's DistributedAttention (the production Ulysses; needs deepspeed)."""
    sweep_lengths: list[int] = field(default_factory=list)
    """Also time ring and Ulysses (causal, forward + backward) at these sequence lengths."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.train_attention not in ("ring", "ulysses"):
            raise ValueError(f"--train-attention must be ring or ulysses, not {self.train_attention!r}")
        require_at_least_one(self, "seq_len", "batch_size", "heads", "head_dim", "d_model",
                             "n_head", "n_layer")
        if self.d_model % self.n_head:
            raise ValueError(f"--d-model {self.d_model} is not divisible by --n-head {self.n_head}")
        if self.memory_budget_mib <= 0:
            raise ValueError("--memory-budget-mib must be positive")


def validate(cfg: Config, world_size: int) -> None:
    """The sequence splits into 2N chunks; Ulysses splits whole heads; gloo cannot send CUDA tensors."""
    for length in [cfg.seq_len, *cfg.sweep_lengths]:
        if error := layouts.length_error(length, world_size):
            raise ValueError(error)
    for heads in [cfg.heads] + ([cfg.n_head] if cfg.train_attention == "ulysses" else []):
        if error := ulysses.heads_error(heads, world_size):
            raise ValueError(error)
    on_gpus = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if world_size > 1 and cfg.backend == "gloo" and on_gpus:
        raise ValueError("gloo sends and receives CPU tensors only, and ring attention sends: "
                         "use NCCL (one GPU per rank) or --device cpu")


def gpt_config(cfg: Config, vocab_size: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, block_size=cfg.seq_len, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, d_model=cfg.d_model)


def make_data(cfg: Config, device):
    """(steps, B, T) input and target tokens from the course corpus, the same on every rank."""
    text = text_corpus(max_chars=60_000)
    tok = CharTokenizer.fit(text)
    x, y = token_windows(tok.encode(text), cfg.seq_len, cfg.steps * cfg.batch_size, seed=cfg.seed)
    shape = (cfg.steps, cfg.batch_size, cfg.seq_len)
    return x.view(shape).to(device), y.view(shape).to(device), tok.vocab_size


def sum_gradients(model: torch.nn.Module) -> int:
    """Every rank's loss is its share of one mean, so the gradient is the SUM of the ranks'
    gradients (not the mean, as in data parallelism). Returns the bytes handed to all-reduce."""
    sent = 0
    for p in model.parameters():
        dist.all_reduce(p.grad)
        sent += p.grad.numel() * p.grad.element_size()
    return sent


def train_reference(model: TinyGPT, X, Y, cfg: Config) -> list[float]:
    """One process, whole sequences, torch's own attention: what sequence parallelism must equal."""
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        _, loss = model(X[step], Y[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_sequence_parallel(model: SequenceParallelGPT, X, Y, cfg: Config, info,
                            broken: str = "none") -> list[float]:
    """Each rank trains on its tokens at their global positions; gradients are summed.
    broken: "local_positions" (positions counted from 0 on every rank), "no_grad_sync"."""
    rank, world, layout = info.rank, info.world_size, model.layout
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    pos = layouts.positions(cfg.seq_len, rank, world, layout).to(info.device)
    if broken == "local_positions":
        pos = torch.arange(cfg.seq_len // world, device=info.device)
    losses = []
    for step in progress(range(cfg.steps), total=cfg.steps, desc="sequence-parallel step",
                         enabled=info.is_main, every=max(1, cfg.log_every)):
        x, y = (layouts.shard_sequence(t[step], rank, world, layout, dim=1) for t in (X, Y))
        loss = model(x, pos, y, n_tokens=Y[step].numel())
        loss.backward()
        if broken != "no_grad_sync":
            sum_gradients(model)
        opt.step()
        opt.zero_grad()
        losses.append(reduce_number(loss.detach()))  # the ranks' shares add up to the mean
    return losses


def build_models(cfg: Config, vocab: int, info, dtype):
    torch.manual_seed(cfg.seed)
    ref = TinyGPT(gpt_config(cfg, vocab)).to(info.device, dtype)
    layout = "zigzag" if cfg.train_attention == "ring" else "contiguous"
    sp = SequenceParallelGPT(gpt_config(cfg, vocab), cfg.train_attention, layout).to(info.device, dtype)
    sp.load_state_dict(ref.state_dict())
    return ref, sp


class SequenceSavedTensors(SavedTensors):
    """Chapter 05's count of the storages autograd saves, without 0-d tensors: the one scalar
    saved per forward (cross-entropy's total weight, 8 bytes) does not grow with the sequence."""

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() == 0 else super()._pack(t)


def saved_bytes(model: SequenceParallelGPT, X, Y, cfg: Config, rank: int, world: int, group) -> int:
    """Bytes autograd keeps for backward in one forward of this rank's shard (chapter 05's
    `SavedTensors`, as chapter 20 counts them), parameters and scalars excluded."""
    model.group = group
    x, y = (layouts.shard_sequence(t[0], rank, world, model.layout, dim=1) for t in (X, Y))
    pos = layouts.positions(cfg.seq_len, rank, world, model.layout).to(X.device)
    with SequenceSavedTensors(exclude=model.parameters()) as saved:
        model(x, pos, y, n_tokens=Y[0].numel())
    model.group = None
    return saved.nbytes


def longest_sequence(saved_per_token: float, score_block_per_token2: float, budget: float) -> float:
    """Largest T/N whose per-rank bytes fit `budget`: saved activations a·(T/N) plus, when
    score_block_per_token2 > 0, the transient score blocks b·(T/N)² (the positive root of
    b·u² + a·u = budget). Both terms depend on T/N only, so the longest T grows as N."""
    a, b = saved_per_token, score_block_per_token2
    return budget / a if b == 0 else (math.sqrt(a * a + 4 * b * budget) - a) / (2 * b)


def record_activations(rec, sp: SequenceParallelGPT, X, Y, cfg: Config, info) -> None:
    """Saved bytes per rank at N ranks against one rank holding the whole sequence (a group of
    one), and the longest sequence a fixed budget allows: measured from the busiest rank's count
    at this run's N, expected (projected for N = 1, 2, 4) from one rank's count times N; once for
    the saved activations alone, once with ring attention's transient score blocks beside them."""
    world = info.world_size
    alone = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    whole = saved_bytes(sp, X, Y, cfg, 0, 1, alone[info.rank])
    mine = saved_bytes(sp, X, Y, cfg, info.rank, world, None)
    worst = reduce_number(mine, "max")
    rec.check("activation bytes per rank x N = one rank's", "count", worst * world, whole)
    elem = next(sp.parameters()).element_size()  # the sibling: the counter counts (0 = 0 passes above)
    floor = cfg.n_layer * 4 * cfg.batch_size * cfg.seq_len * cfg.d_model * elem
    if not rec.check("one rank's activation bytes >= q, k, v, O", "count", whole, floor,
                     compare=">="):
        return  # nothing (or too little) counted: no budget figure can be drawn from it
    per_token = whole / (cfg.batch_size * cfg.seq_len)
    budget = cfg.memory_budget_mib * 2**20
    # bytes per rank per token of T/N: saved (linear) and TRANSIENT_BLOCKS score blocks (quadratic)
    saved_u = {"expected": cfg.batch_size * per_token, "measured": worst * world / cfg.seq_len}
    blocks_u2 = ring.TRANSIENT_BLOCKS * cfg.batch_size * cfg.n_head * elem / 2  # B·H·(u/2)·u·e per u²
    for what, quad in (("saved activations", 0.0), (f"saved + {ring.TRANSIENT_BLOCKS} score blocks", blocks_u2)):
        for n in (1, 2, 4):  # bytes per rank depend on T/N only: scale the count
            counted = int(n * longest_sequence(saved_u["measured"], quad, budget)) if n == world and worst else "not run"
            rec.figure(f"longest T in {cfg.memory_budget_mib:g} MiB per rank, {what}, N = {n}",
                       counted, int(n * longest_sequence(saved_u["expected"], quad, budget)), unit="tokens")
    rec.figure("activation bytes per token (one rank, whole sequence)", round(per_token, 1), unit="B")
    rec.figure("score block per rank at this T, N (transient, formula)",
               ring.score_block_bytes(cfg.batch_size, cfg.n_head, cfg.seq_len, world, elem), unit="B")


def time_methods(cfg: Config, info, dtype, lengths: list[int]) -> dict:
    """Median forward + backward time and bytes per rank of causal ring (zigzag) and Ulysses."""
    rows = {}
    for length in progress(lengths, total=len(lengths), desc="timed lengths",
                           enabled=info.is_main and len(lengths) > 1, every=1):
        qkvw = parity.make_qkv(dataclasses.replace(cfg, seq_len=length), info.device, dtype)
        for method, layout in (("ring", "zigzag"), ("ulysses", "contiguous")):
            ring.COUNTER.reset()
            ulysses.COUNTER.reset()
            step = functools.partial(parity.run_method, method, layout, True, qkvw, info.rank, info.world_size)
            stats = benchmark(step, warmup=1, repeats=3, device=info.device)
            counter = ring.COUNTER if method == "ring" else ulysses.COUNTER
            sent = sum(counter.bytes.values()) // 4  # 4 calls: 1 warm-up + 3 repeats
            ms = reduce_number(stats.median * 1e3, "max")  # the slowest rank sets the pace
            spread = (reduce_number(stats.min * 1e3, "min"), reduce_number(stats.max * 1e3, "max"))
            rows[f"{method} T={length}"] = {"ms": ms, "spread": spread, "bytes": reduce_number(sent, "max")}
    return rows


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        dtype, N = DTYPES[cfg.dtype], info.world_size
        log.info("sequence parallel over %d rank(s) on %s/%s: T=%d (%d per rank), B=%d, %d heads "
                 "of %d", N, info.device, info.backend, cfg.seq_len, cfg.seq_len // N,
                 cfg.batch_size, cfg.heads, cfg.head_dim)

        parity.attention_parity(rec, cfg, info, dtype)
        if cfg.deepspeed:
            first = "" if torch_extension_built("deepspeed_shm_comm") else " (building its communication op first: ~1 min)"
            log.info("DeepSpeed's DistributedAttention against full SDPA%s", first)
            parity.deepspeed_parity(rec, cfg, info, dtype)

        X, Y, vocab = make_data(cfg, info.device)
        ref, sp = build_models(cfg, vocab, info, dtype)
        record_activations(rec, sp, X, Y, cfg, info)
        ref_losses = train_reference(ref, X, Y, cfg)
        sp_losses = train_sequence_parallel(sp, X, Y, cfg, info)
        for step, (a, b) in enumerate(zip(ref_losses, sp_losses)):
            rec.metrics(step, loss=b, loss_one_process=a, lr=cfg.lr)
            log.info("step %d  loss %.6f  (one process %.6f)", step, b, a)
        if info.is_main:  # for the tests, which train their own reference
            save_checkpoint(rec.out / "final_params.pt", {k: v.cpu() for k, v in sp.state_dict().items()})
        tol = cfg.steps * parity.parity_tolerance(cfg.seq_len, cfg.d_model, dtype)
        rec.check(f"{cfg.train_attention} TinyGPT: parameters = one process", "parity",
                  reduce_number(max_param_diff(sp, ref), "max"), tol, compare="<=")

        for name, row in time_methods(cfg, info, dtype, [cfg.seq_len, *cfg.sweep_lengths]).items():
            rec.figure(f"{name}: fwd+bwd time (median)", round(row["ms"], 2), unit="ms",
                       spread=[round(t, 2) for t in row["spread"]])
            rec.figure(f"{name}: bytes sent per rank", row["bytes"], unit="B")
        rec.figure("threads per rank (the times' conditions)", torch.get_num_threads())
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
