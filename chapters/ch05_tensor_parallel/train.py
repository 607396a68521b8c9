"""Tensor parallelism by hand (Megatron's f/g operators) and with DTensor, checked against the dense block.

Each rank holds 1/t of every weight matrix of a transformer block: the first linear of the MLP
and the q, k, v projections (whole heads) split by columns, the second linear and the output
projection by rows, so each half of the block needs one all-reduce in forward and one in
backward; sequence parallelism replaces each all-reduce by an all-gather and a reduce-scatter
and shards LayerNorm and dropout along the sequence. This script trains the dense block, the
hand-written TP block with and without sequence parallelism, and the same dense block through
DTensor's `parallelize_module`, then the two vocabulary-parallel ends of a language model
(embedding and loss), and checks outputs, gradients, clipped and trained weights, counted
collectives and bytes, parameters held and activations saved per rank.

Run (the TP degree is the world size; it must divide the heads, the MLP width, the sequence
and the vocabulary):
    python chapters/ch05_tensor_parallel/train.py                                 # t = 1
    torchrun --standalone --nproc_per_node=2 chapters/ch05_tensor_parallel/train.py
    torchrun --standalone --nproc_per_node=4 chapters/ch05_tensor_parallel/train.py --collectives ring
    torchrun --standalone --nproc_per_node=8 chapters/ch05_tensor_parallel/train.py \\
        --d-model 1024 --seq-len 1024 --dtype float32                             # 8 GPUs, NCCL
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch05_tensor_parallel/train.py                                    # TP across nodes: slow
    srun --ntasks=8 --ntasks-per-node=8 python chapters/ch05_tensor_parallel/train.py
"""

import copy
import statistics
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from chapters.ch05_tensor_parallel import checks, dtensor_tp, tp_comm, tp_layers, vocab_parallel
from chapters.ch05_tensor_parallel.activations import SavedTensors
from chapters.ch05_tensor_parallel.block import DenseModel
from chapters.ch05_tensor_parallel.tp_layers import (
    TPModel,
    shard_state,
    sync_sequence_parallel_grads,
)
from common.checkpoint import save_checkpoint
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import Timer

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class Config(RunConfig):
    steps: int = 6
    """Optimizer steps to train each version."""
    batch_size: int = 4
    """Sequences per batch (B); every TP rank sees the same batch."""
    seq_len: int = 16
    """Tokens per sequence (S); sequence parallelism needs it divisible by the TP degree."""
    d_model: int = 64
    """Hidden size (h)."""
    n_heads: int = 16
    """Attention heads; the TP degree (world size) must divide them."""
    ffn_mult: int = 4
    """MLP hidden size = ffn_mult * d_model."""
    n_layers: int = 2
    """Transformer blocks."""
    vocab_size: int = 64
    """Vocabulary of the embedding and loss (V); the TP degree must divide it."""
    dropout: float = 0.1
    """Dropout after attention and MLP (the DTensor versions run with 0, see the lesson)."""
    lr: float = 0.05
    """Learning rate of SGD."""
    max_grad_norm: float = 0.5
    """Clip the global gradient norm to this (0: no clipping); every version clips alike."""
    collectives: str = "library"
    """library (torch.distributed) or ring (a ring written with send/recv in tp_comm.py, as
    chapter 07 teaches: the bytes each rank sends are counted; NCCL on GPUs)."""
    dtype: str = "float64"
    """float64 makes every parity check exact to ~1e-15; float32 to ~5e-7 (tolerances: see the lesson)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.collectives not in ("library", "ring"):
            raise ValueError(f"--collectives must be library or ring, not {self.collectives!r}")
        require_at_least_one(self, "batch_size", "seq_len", "d_model", "n_heads", "ffn_mult",
                             "n_layers", "vocab_size")
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model {self.d_model} is not divisible by --n-heads {self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.max_grad_norm < 0:
            raise ValueError(f"--max-grad-norm must be >= 0, got {self.max_grad_norm}")


def validate(cfg: Config, world_size: int) -> None:
    """The TP degree is the world size: it must split whole heads, MLP units, sequence slices
    (sequence parallelism) and vocabulary rows."""
    if error := tp_layers.tp_layout_error(world_size, cfg.n_heads, cfg.ffn_mult * cfg.d_model,
                                          cfg.seq_len, sequence_parallel=True):
        raise ValueError(error)
    on_gpus = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if world_size > 1 and cfg.backend == "gloo" and on_gpus:
        raise ValueError("gloo runs a reduce-scatter of CUDA tensors as an all-reduce of the whole "
                         "input, not the traffic this chapter measures: use NCCL (one GPU per "
                         "rank) or --device cpu")
    if cfg.vocab_size % world_size:
        raise ValueError(f"tensor-parallel degree {world_size} does not divide the vocabulary "
                         f"size {cfg.vocab_size}")


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


def sync_grads(model, kind: str, sp: bool) -> None:
    """Sum the gradients that are partial after backward: the hand-written SP's LayerNorms and
    row biases; DTensor's Partial(sum) gradients (its SP LayerNorms)."""
    if kind == "hand" and sp:
        sync_sequence_parallel_grads(model)
    elif kind == "dtensor":
        dtensor_tp.reduce_partial_grads(model)


def clip(model, kind: str, max_norm: float) -> float:
    """The global gradient norm before clipping; clip it to `max_norm` (if > 0)."""
    fn = {"dense": torch.nn.utils.clip_grad_norm_, "hand": tp_layers.clip_grad_norm_,
          "dtensor": dtensor_tp.clip_grad_norm_}[kind]
    if max_norm <= 0:
        return float("nan")
    return float(fn(model.parameters(), max_norm) if kind == "dense" else fn(model, max_norm))


def train(model, data, cfg: Config, info, kind: str, sp: bool, sync: bool = True) -> dict:
    """SGD on the mean squared error over the whole batch, gradient sync, clipping. Under
    sequence parallelism each rank sees its slice of the sequence and divides its summed error
    by the GLOBAL element count. Step 0 keeps the output, the input gradient and the gradients
    before clipping, the collectives of each phase and the bytes saved for backward."""
    X, Y = data
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    rank, tp = info.rank, info.world_size
    out, times, losses, norms = {"modes": {}}, [], [], []
    for step in range(cfg.steps):
        x, y = (seq_shard(t[step], rank, tp) if sp else t[step] for t in (X, Y))
        x = x.clone().requires_grad_(step == 0)
        tp_comm.COMM.reset()
        modes = out["modes"] if kind == "dtensor" and step == 0 else None
        saved = SavedTensors(exclude=model.parameters()) if kind != "dtensor" else nullcontext()
        with Timer(info.device) as timer:
            with dtensor_tp.phase("forward", modes):
                with saved:  # the block's activations; the loss's own are not the lesson's
                    pred = model(x, step)
                loss = ((pred - y) ** 2).sum() / Y[step].numel()
            with dtensor_tp.phase("backward", modes):
                loss.backward()
            with dtensor_tp.phase("grad sync", modes):
                if sync:
                    sync_grads(model, kind, sp)
            if step == 0:  # whole gradients for the parity check (their gathers are not counted)
                with dtensor_tp.phase("inspection"):
                    out.update(output=pred.detach(), input_grad=x.grad, saved_bytes=getattr(saved, "nbytes", 0),
                               grads={n: dtensor_tp.to_full(p.grad) for n, p in model.named_parameters()})
            with dtensor_tp.phase("clip", modes):
                norms.append(clip(model, kind, cfg.max_grad_norm))
            with dtensor_tp.phase("optimizer step", modes):
                opt.step()
            opt.zero_grad()
        if step == 0:
            out["comm"] = copy.deepcopy(tp_comm.COMM)
        times.append(timer.elapsed * 1e3)
        # the logged loss only (not part of the technique): under SP each rank holds a share
        losses.append(reduce_number(loss.detach()) if sp else loss.item())
    steady = times[1:] or times
    out.update(final=dtensor_tp.full_state(model), losses=losses, norms=norms,
               params_held=dtensor_tp.local_numel(model),
               step_ms=statistics.median(steady), step_ms_range=[min(steady), max(steady)])
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
    refs = {"dense": train(copy.deepcopy(dense), data, cfg, info, "dense", sp=False),
            "dense p=0": train(copy.deepcopy(dense_p0), data, cfg, info, "dense", sp=False)}
    refs["dense"]["largest value"] = checks.largest_value(dense, data[0][0])
    runs, mesh = {}, dtensor_tp.make_mesh(info)
    tp_comm.use_ring(cfg.collectives == "ring")
    try:
        for name, sp in (("hand TP", False), ("hand TP+SP", True)):
            model = build_hand_tp(dense, cfg, rank, tp, sp)
            runs[name] = (train(model, data, cfg, info, "hand", sp), "dense",
                          checks.Expect(rank, tp, sp, sharded=True))
    finally:
        tp_comm.use_ring(False)
    for name, sp in (("DTensor TP", False), ("DTensor TP+SP", True)):
        model = dtensor_tp.parallelize(copy.deepcopy(dense_p0), mesh, sp)
        runs[name] = (train(model, data, cfg, info, "dtensor", sp), "dense p=0",
                      checks.Expect(rank, tp, sp, sharded=False))
    return refs, runs


def save_final(rec: RunRecorder, refs: dict, runs: dict, lm: dict, info) -> None:
    """Trained weights for the tests: dense, DTensor (full tensors) and every rank's hand shards."""
    def cpu(state):
        return {k: v.cpu() for k, v in state.items()}

    mine = {n: cpu(runs[n][0]["final"]) for n in ("hand TP", "hand TP+SP")} | {"lm": cpu(lm["hand"]["final"])}
    gathered = [None] * info.world_size
    torch.distributed.all_gather_object(gathered, mine)  # CPU tensors inside: pickled, not sent as tensors
    if info.is_main:
        save_checkpoint(rec.out / "final_params.pt", {
            "dense": cpu(refs["dense"]["final"]), "dtensor_tp": cpu(runs["DTensor TP"][0]["final"]),
            "dtensor_sp": cpu(runs["DTensor TP+SP"][0]["final"]),
            "hand_tp": [g["hand TP"] for g in gathered], "hand_sp": [g["hand TP+SP"] for g in gathered],
            "lm_dense": cpu(lm["dense"]["final"]), "lm_hand": [g["lm"] for g in gathered],
            "lm_dtensor": cpu(lm["DTensor"]["final"]),
            "losses": torch.tensor(refs["dense"]["losses"]), "norms": torch.tensor(refs["dense"]["norms"])})


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        tp, d_ff = info.world_size, cfg.ffn_mult * cfg.d_model
        rec = RunRecorder(cfg, __file__, info)
        seed_everything(cfg.seed)
        dense = DenseModel(cfg.d_model, cfg.n_heads, d_ff, cfg.n_layers, cfg.dropout).to(info.device, DTYPES[cfg.dtype])
        log.info("TP degree %d on %s/%s: B=%d S=%d h=%d heads=%d (%d per rank) d_ff=%d (%d per rank)",
                 tp, info.device, info.backend, cfg.batch_size, cfg.seq_len, cfg.d_model,
                 cfg.n_heads, cfg.n_heads // tp, d_ff, d_ff // tp)
        log.info("collectives: %s", cfg.collectives)

        refs, runs = train_all_versions(dense, cfg, info)
        for step, (loss, loss_p0, norm) in enumerate(zip(refs["dense"]["losses"], refs["dense p=0"]["losses"],
                                                         refs["dense"]["norms"])):
            rec.metrics(step, loss=loss, loss_no_dropout=loss_p0, grad_norm=norm, lr=cfg.lr)
            log.info("step %2d  loss %.6f  (no dropout %.6f)  grad norm %.4f", step, loss, loss_p0, norm)
        lm = vocab_parallel.train_lm_versions(cfg, info, DTYPES[cfg.dtype])

        checks.record_parity(rec, refs, runs, cfg)
        checks.record_bytes(rec, {n: runs[n][0]["comm"] for n in ("hand TP", "hand TP+SP")}, cfg, tp)
        checks.record_dtensor_counts(rec, {n: runs[n][0]["modes"] for n in ("DTensor TP", "DTensor TP+SP")}, cfg, tp)
        checks.record_params_held(rec, runs, cfg, tp)
        checks.record_activations(rec, runs, cfg, tp)
        vocab_parallel.record_lm(rec, lm, cfg, info.rank, tp)
        rec.figure("final loss (dense, dropout)", refs["dense"]["losses"][-1])
        rec.figure("threads per rank (the step times' conditions)", torch.get_num_threads())
        for name, run in [("dense", refs["dense"])] + [(n, r[0]) for n, r in runs.items()]:
            rec.figure(f"step time, {name}: median of steps 1-{cfg.steps - 1}", round(run["step_ms"], 2), unit="ms")
            rec.figure(f"step time, {name}: min, max", [round(t, 2) for t in run["step_ms_range"]], unit="ms")
        save_final(rec, refs, runs, lm, info)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
