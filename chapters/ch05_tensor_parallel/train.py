"""Tensor parallelism by hand (Megatron's f/g operators) and with DTensor, checked against the dense block.

Each rank holds 1/t of every weight matrix of a transformer block: the first linear of the MLP
and the q, k, v projections (whole heads) split by columns, the second linear and the output
projection by rows, so each half of the block needs one all-reduce in forward and one in
backward; sequence parallelism replaces each all-reduce by an all-gather and a reduce-scatter
and shards LayerNorm and dropout along the sequence. This script trains the dense block, the
hand-written TP block with and without sequence parallelism, and the same dense block through
DTensor's `parallelize_module`, and checks outputs, gradients, trained weights and counted bytes.

Run:
    python chapters/ch05_tensor_parallel/train.py                                 # t = 1
    torchrun --standalone --nproc_per_node=2 chapters/ch05_tensor_parallel/train.py
    torchrun --standalone --nproc_per_node=4 chapters/ch05_tensor_parallel/train.py
    torchrun --standalone --nproc_per_node=8 chapters/ch05_tensor_parallel/train.py \\
        --n-heads 16 --d-model 1024 --seq-len 1024 --dtype float32                # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch05_tensor_parallel/train.py --n-heads 16                      # TP across nodes: slow
    srun --ntasks=8 --ntasks-per-node=8 python chapters/ch05_tensor_parallel/train.py --n-heads 8
"""

import copy
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chapters.ch05_tensor_parallel import dtensor_tp
from chapters.ch05_tensor_parallel.block import DenseModel
from chapters.ch05_tensor_parallel.tp_layers import (
    COMM,
    TPModel,
    shard_state,
    sync_sequence_parallel_grads,
    tp_layout_error,
)
from common.checkpoint import save_checkpoint
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import synchronize

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class Config(RunConfig):
    steps: int = 6
    """Optimizer steps to train each version."""
    batch_size: int = 4
    """Sequences per batch (B); every TP rank sees the same batch."""
    seq_len: int = 8
    """Tokens per sequence (S); sequence parallelism needs it divisible by the TP degree."""
    d_model: int = 32
    """Hidden size (h)."""
    n_heads: int = 4
    """Attention heads; the TP degree (world size) must divide them."""
    ffn_mult: int = 4
    """MLP hidden size = ffn_mult * d_model."""
    n_layers: int = 2
    """Transformer blocks."""
    dropout: float = 0.1
    """Dropout after attention and MLP (the DTensor versions run with 0, see the lesson)."""
    lr: float = 0.05
    """Learning rate of SGD."""
    dtype: str = "float64"
    """float64 makes every parity check exact to ~1e-13; float32 needs ~1e-5 (see the lesson)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        require_at_least_one(self, "batch_size", "seq_len", "d_model", "n_heads", "ffn_mult", "n_layers")
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model {self.d_model} is not divisible by --n-heads {self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")


def make_batches(cfg: Config, device: torch.device):
    """Inputs and regression targets, (steps, B, S, h), the same on every rank."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    shape = (cfg.steps, cfg.batch_size, cfg.seq_len, cfg.d_model)
    X, Y = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    return X.to(device, DTYPES[cfg.dtype]), Y.to(device, DTYPES[cfg.dtype])


def seq_shard(x: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's contiguous slice of the sequence (dim 1)."""
    return x.chunk(tp, dim=1)[rank]


def build_hand_tp(dense: DenseModel, cfg: Config, rank: int, tp: int, sequence_parallel: bool) -> TPModel:
    """A TPModel holding this rank's shards of the dense model's weights."""
    model = TPModel(cfg.d_model, cfg.n_heads, cfg.ffn_mult * cfg.d_model, cfg.n_layers,
                    cfg.dropout, rank, tp, sequence_parallel)
    ref = next(dense.parameters())
    model.to(ref.device, ref.dtype).load_state_dict(shard_state(dense.state_dict(), rank, tp))
    return model


def train(model, data, cfg: Config, info, sp: bool, sync_grads: bool = False, count=None) -> dict:
    """SGD on the mean squared error over the whole batch. Under sequence parallelism each rank
    sees its slice of the sequence and divides its summed error by the GLOBAL element count.
    Step 0's output, input gradient and parameter gradients are kept for the parity checks."""
    X, Y = data
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    rank, tp = info.rank, info.world_size
    out, times, losses = {}, [], []
    for step in range(cfg.steps):
        x, y = (seq_shard(t[step], rank, tp) if sp else t[step] for t in (X, Y))
        x = x.clone().requires_grad_(step == 0)
        COMM.reset()
        counted = {p: count() if count and step == 0 else nullcontext() for p in ("forward", "backward")}
        t0 = time.perf_counter()
        COMM.phase = "forward"
        with counted["forward"]:
            pred = model(x, step)
            loss = ((pred - y) ** 2).sum() / Y[step].numel()
        COMM.phase = "backward"
        with counted["backward"]:
            loss.backward()
        COMM.phase = "grad sync"
        if sync_grads:
            sync_sequence_parallel_grads(model)
        if step == 0:
            out.update(output=pred.detach(), input_grad=x.grad,
                       grads={n: dtensor_tp.to_full(p.grad) for n, p in model.named_parameters()},
                       comm=copy.deepcopy(COMM), counted=counted)
        opt.step()
        opt.zero_grad()
        synchronize(info.device)
        times.append(time.perf_counter() - t0)
        loss = loss.detach()
        if sp:
            dist.all_reduce(loss)  # the logged loss only: not part of the technique
        losses.append(loss.item())
    out.update(final=dtensor_tp.full_state(model), losses=losses, step_ms=statistics.median(times[1:] or times) * 1e3)
    return out


def train_all_versions(dense: DenseModel, cfg: Config, info) -> tuple[dict, dict]:
    """Train the dense references and the four tensor-parallel versions from the same weights.
    DTensor's versions run without dropout: on CPU, DTensor does not keep a sharded dropout
    mask consistent with the dense one, so they are compared with a dense run at p = 0."""
    rank, tp = info.rank, info.world_size
    dense_p0 = copy.deepcopy(dense)
    for block in dense_p0.blocks:
        block.p = 0.0
    data = make_batches(cfg, info.device)
    refs = {"dense": train(copy.deepcopy(dense), data, cfg, info, sp=False),
            "dense p=0": train(copy.deepcopy(dense_p0), data, cfg, info, sp=False)}
    runs, mesh = {}, dtensor_tp.make_mesh(info)
    for name, sp in (("hand TP", False), ("hand TP+SP", True)):
        model = build_hand_tp(dense, cfg, rank, tp, sp)
        runs[name] = (train(model, data, cfg, info, sp, sync_grads=sp), "dense",
                      Expect(rank, tp, sp, sharded=True))
    for name, sp in (("DTensor TP", False), ("DTensor TP+SP", True)):
        model = dtensor_tp.parallelize(copy.deepcopy(dense_p0), mesh, sp)
        runs[name] = (train(model, data, cfg, info, sp, count=dtensor_tp.comm_mode), "dense p=0",
                      Expect(rank, tp, sp, sharded=False))
    return refs, runs


def max_diff(local: dict, expected: dict) -> float:
    """max |a − b| over the tensors, then over the ranks (every rank gets the same answer)."""
    d = max((local[k] - expected[k]).abs().max().item() for k in expected)
    worst = torch.tensor(d, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def compare(run: dict, ref: dict, expect) -> dict:
    """Max differences of output, gradients (input and parameters) and trained parameters;
    `expect` maps the reference's tensors to what this rank should hold."""
    return {
        "output": max_diff({"y": run["output"]}, {"y": expect.act(ref["output"])}),
        "gradients": max(max_diff({"x": run["input_grad"]}, {"x": expect.act(ref["input_grad"])}),
                         max_diff(run["grads"], expect.params(ref["grads"]))),
        "trained": max_diff(run["final"], expect.params(ref["final"])),
    }


class Expect:
    """How a variant's local tensors relate to the dense ones."""

    def __init__(self, rank, tp, sp, sharded):
        self.rank, self.tp, self.sp, self.sharded = rank, tp, sp, sharded

    def act(self, t):
        return seq_shard(t, self.rank, self.tp) if self.sp else t

    def params(self, state):
        return shard_state(state, self.rank, self.tp) if self.sharded else state


def record_bytes(rec: RunRecorder, comms: dict, cfg: Config, tp: int) -> None:
    """Counted collectives per layer against the lesson's formulas (N = B·S·h elements)."""
    L, N = cfg.n_layers, cfg.batch_size * cfg.seq_len * cfg.d_model
    b = torch.finfo(DTYPES[cfg.dtype]).bits // 8
    ring = (tp - 1) / tp
    for name, comm in comms.items():
        sp = "SP" in name
        for op in ("all_gather", "reduce_scatter") if sp else ("all_reduce",):
            rec.check(f"{name}: {op} calls per layer, forward", "count",
                      comm.total("calls", "forward", op) / L, 2)
            rec.check(f"{name}: {op} elements per layer, forward = 2BSh", "formula",
                      comm.total("elements", "forward", op) / L, 2 * N)
        if not sp:
            rec.check(f"{name}: bytes all-reduced per layer, fwd+bwd = 4BSh*b", "formula",
                      (comm.total("bytes", "forward") + comm.total("bytes", "backward")) / L, 4 * N * b)
        rec.check(f"{name}: ring bytes sent per rank per layer, fwd+bwd = 8(t-1)/t*BSh*b", "formula",
                  (comm.total("wire_bytes", "forward") + comm.total("wire_bytes", "backward")) / L,
                  8 * ring * N * b, tolerance=1e-6)
        rec.figure(f"{name}: ring bytes per rank per layer, forward",
                   comm.total("wire_bytes", "forward") / L, expected=4 * ring * N * b, unit="bytes")
    sp_comm = comms["hand TP+SP"]
    rec.check("hand TP+SP: all-reduces in forward and backward", "count",
              sp_comm.total("calls", op="all_reduce") - sp_comm.total("calls", "grad sync"), 0)
    rec.check("hand TP+SP: grad-sync elements per layer = 6h (2 LayerNorms, 2 biases)",
              "formula", sp_comm.total("elements", "grad sync") / L, 6 * cfg.d_model)


def record_dtensor_counts(rec: RunRecorder, modes: dict, hand_comm, cfg: Config, tp: int) -> None:
    """DTensor's collectives (CommDebugMode) per layer: forward checked against Megatron's two;
    backward reported beside the hand-written version's (a mesh of one rank needs none)."""
    L = cfg.n_layers
    hand_bwd = {op: hand_comm.total("calls", "backward", op) / L for op in ("all_reduce",)}
    for name, counted in modes.items():
        counts = dtensor_tp.counts(counted)
        for op in ("all_gather", "reduce_scatter") if "SP" in name else ("all_reduce",):
            rec.check(f"{name}: {op} calls per layer, forward", "count",
                      counts["forward"].get(op, 0) / L, 2 if tp > 1 else 0)
        rec.figure(f"{name}: collectives per layer, backward",
                   {op: n / L for op, n in counts["backward"].items()},
                   expected=hand_bwd if "SP" not in name else None)


def save_final(rec: RunRecorder, refs: dict, runs: dict, info) -> None:
    """Trained weights for the tests: dense, DTensor (full tensors) and every rank's hand shards."""
    def cpu(state):
        return {k: v.cpu() for k, v in state.items()}

    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, {n: cpu(runs[n][0]["final"]) for n in ("hand TP", "hand TP+SP")})
    if info.is_main:
        save_checkpoint(rec.out / "final_params.pt", {
            "dense": cpu(refs["dense"]["final"]), "dtensor_sp": cpu(runs["DTensor TP+SP"][0]["final"]),
            "hand_tp": [g["hand TP"] for g in gathered], "hand_sp": [g["hand TP+SP"] for g in gathered],
            "losses": torch.tensor(refs["dense"]["losses"])})


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        tp = info.world_size
        d_ff = cfg.ffn_mult * cfg.d_model
        if error := tp_layout_error(tp, cfg.n_heads, d_ff, cfg.seq_len, sequence_parallel=True):
            raise SystemExit(f"error: {error}")
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        dense = DenseModel(cfg.d_model, cfg.n_heads, d_ff, cfg.n_layers, cfg.dropout).to(info.device, DTYPES[cfg.dtype])
        log.info("TP degree %d on %s/%s: B=%d S=%d h=%d heads=%d (%d per rank) d_ff=%d (%d per rank)",
                 tp, info.device, info.backend, cfg.batch_size, cfg.seq_len, cfg.d_model,
                 cfg.n_heads, cfg.n_heads // tp, d_ff, d_ff // tp)

        refs, runs = train_all_versions(dense, cfg, info)
        for step, (loss, loss_p0) in enumerate(zip(refs["dense"]["losses"], refs["dense p=0"]["losses"])):
            rec.metrics(step, loss=loss, loss_no_dropout=loss_p0, lr=cfg.lr)
            log.info("step %2d  loss %.6f  (no dropout %.6f)", step, loss, loss_p0)

        tol = 1e-12 if cfg.dtype == "float64" else 1e-5
        for name, (run, ref_name, expect) in runs.items():
            for what, d in compare(run, refs[ref_name], expect).items():
                rec.check(f"{name}: {what} == dense", "parity", d, 0.0, tol)
        record_bytes(rec, {n: runs[n][0]["comm"] for n in ("hand TP", "hand TP+SP")}, cfg, tp)
        record_dtensor_counts(rec, {n: runs[n][0]["counted"] for n in ("DTensor TP", "DTensor TP+SP")},
                              runs["hand TP"][0]["comm"], cfg, tp)
        rec.figure("final loss (dense, dropout)", refs["dense"]["losses"][-1])
        for name, run in [("dense", refs["dense"])] + [(n, r[0]) for n, r in runs.items()]:
            rec.figure(f"step time, {name}", run["step_ms"], unit="ms")
        save_final(rec, refs, runs, info)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__)))
