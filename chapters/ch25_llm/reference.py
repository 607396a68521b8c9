"""What the composed run (composed.py) is proven against: its settings (`Run`) and the global
batch of each step, one process training the whole model on that batch (`one_process`, and
`resume_one_process` from the composed run's DCP checkpoint), the parity tolerances the lesson
derives, and the closed forms of the bytes a rank holds and hands to collectives per step.
Nothing here builds a mesh: it is the expected value the composed run is measured against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chapters.ch25_llm.llama import Cfg, Llama, reference_model

DIMS = ("pp", "dp", "cp", "tp")  # outermost to innermost: tp on neighbouring ranks (one node)


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    tp_plan: str = "blocks"  # composed.apply_tp's: "blocks", or "sequence" (torchtitan's)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sp(self) -> int:
        """The sequence-parallel degree: tp under the "sequence" plan, else 1."""
        return self.tp if self.tp_plan == "sequence" else 1

    def name(self) -> str:
        dims = " x ".join(f"{d}{getattr(self, d)}" for d in DIMS if getattr(self, d) > 1) or "1"
        return dims + (" (sequence)" if self.sp > 1 else "")


@dataclass
class Run:
    """Settings shared by the composed run and its one-process reference."""

    cfg: Cfg = field(default_factory=Cfg)
    steps: int = 3
    global_batch: int = 8
    seq_len: int = 32
    microbatches: int = 2
    lr: float = 3e-3
    max_norm: float = 0.5       # chosen below the measured norms: clipping acts at every step
    seed: int = 0
    dtype: torch.dtype = torch.float64


def batch(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch: random token windows (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(run.seed * 7919 + step)
    ids = torch.randint(0, run.cfg.vocab, (run.global_batch, run.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def make_optimizer(params, lr: float):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def reference_steps(model, opt, run: Run, steps: range) -> dict:
    """One process's steps on the whole global batch: mean cross-entropy, torch's own
    `clip_grad_norm_`, AdamW. Returns losses, pre-clip norms and the final parameters."""
    losses, norms = [], []
    for step in steps:
        x, y = batch(run, step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_norm).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def one_process(run: Run) -> dict:
    """The reference: the whole model, the whole global batch, mean cross-entropy, torch's own
    `clip_grad_norm_`, AdamW. Returns losses, pre-clip norms and the final parameters."""
    model = reference_model(run.cfg, run.seed, run.dtype)
    opt = make_optimizer(model.parameters(), run.lr)
    return reference_steps(model, opt, run, range(run.steps))


def resume_one_process(run: Run, path: str, start: int,
                       load: tuple[str, ...] = ("model", "optim")) -> dict:
    """A different world: one process, no process group, loads the composed run's DCP
    checkpoint into the whole model and AdamW and trains `run.steps` more steps from `start`.
    `load` names the parts read from the checkpoint; what it leaves out starts fresh, for the
    controls: without "model" the start weights, without "optim" a new AdamW (zero moments,
    step 0), each then trained by the same steps from `start`."""
    import torch.distributed.checkpoint as dcp

    assert set(load) <= {"model", "optim"}, load
    model = reference_model(run.cfg, run.seed, run.dtype)
    opt = make_optimizer(model.parameters(), run.lr)
    state = {}
    if "optim" in load:
        # AdamW's state exists after a first step: make it (zero gradients), then overwrite it
        # all; that step's weight decay moves the weights, so they are put back when not loaded
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        model.load_state_dict(before)
        names = {p: n for n, p in model.named_parameters()}
        state["optim"] = {"state": {names[p]: st for p, st in opt.state.items()}}
    if "model" in load:
        state["model"] = model.state_dict()
    if state:
        dcp.load(state, checkpoint_id=path, no_dist=True)
    if "model" in load:
        model.load_state_dict(state["model"])
    return reference_steps(model, opt, run, range(start, start + run.steps))


def chunk_rows(rows: int, n: int, i: int) -> int:
    """Rows piece i of torch.chunk(·, n) gets: ⌈rows/n⌉ each from the front, the last piece
    what is left, none for the pieces torch.chunk does not make (FSDP2's `_chunk_with_empty`;
    DTensor's Shard splits the same way)."""
    c = -(-rows // n)
    return max(0, min(c, rows - i * c))


def stage_param_shapes(cfg: Cfg, layout: Layout, stage: int, t: int = 0) -> list[tuple]:
    """The tp-local shape of each parameter on `stage` (tensor-parallel rank t), in the order
    (block by block, then the embedding, norm and head) FSDP2 does not care about: q, k, v, gate,
    up split by rows, o and down by columns; the embedding and head by vocabulary rows under
    the sequence plan; the norms whole."""
    h, d = cfg.hidden, cfg.head_dim

    def tp_split(shape, dim):
        return tuple(chunk_rows(n, layout.tp, t) if k == dim else n for k, n in enumerate(shape))

    block = [(h,), (h,), tp_split((cfg.heads * d, h), 0), tp_split((cfg.kv_heads * d, h), 0),
             tp_split((cfg.kv_heads * d, h), 0), tp_split((h, cfg.heads * d), 1),
             tp_split((cfg.ffn, h), 0), tp_split((cfg.ffn, h), 0), tp_split((h, cfg.ffn), 1)]
    shapes = block * (cfg.layers // layout.pp)
    vocab = (lambda shape: tp_split(shape, 0)) if layout.sp > 1 else (lambda shape: shape)
    if stage == 0:
        shapes.append(vocab((cfg.vocab, h)))
    if stage == layout.pp - 1:
        shapes += [(h,), vocab((cfg.vocab, h))]
    return shapes


def expected_state_bytes(cfg: Cfg, layout: Layout, stage: int, elem: int = 8, shard: int = 0,
                         t: int = 0) -> dict:
    """The same by formula (what chapter 30's planner predicts), for the rank at pipeline stage
    `stage`, tensor-parallel rank t and dp x cp shard index `shard` (its coords dp·cp_size + cp):
    each parameter's tp-local tensor (`stage_param_shapes`) cut along dim 0 with torch.chunk
    over the n = dp·cp ranks, as FSDP2 does (FSDP2 over TP shards the tp-local tensor): this
    rank keeps `chunk_rows(d0, n, shard)` of its d0 rows, ⌈d0/n⌉ or fewer (none, if d0 < n
    leaves it out), so ranks differ when n does not divide d0; gradients as large; AdamW two
    moments each."""
    n_shards = layout.dp * layout.cp
    n = sum(chunk_rows(s[0], n_shards, shard) * math.prod(s[1:])
            for s in stage_param_shapes(cfg, layout, stage, t))
    return {"params": n * elem, "grads": n * elem, "optimizer": 2 * n * elem}


def fsdp_handed_elements(cfg: Cfg, layout: Layout, stage: int, t: int = 0) -> tuple[int, int]:
    """Elements FSDP2 hands its collectives per parameter set once: (all-gather, reduce-
    scatter). Each is handed padded pieces: the all-gather ⌈d0/n⌉ rows of each tp-local
    parameter (the padded shard, on every rank alike), the reduce-scatter the padded whole,
    n·⌈d0/n⌉ rows."""
    n = layout.dp * layout.cp
    shard = sum(-(-s[0] // n) * math.prod(s[1:]) for s in stage_param_shapes(cfg, layout, stage, t))
    return shard, n * shard


def expected_comm_bytes(run: Run, layout: Layout, stage: int, elem: int = 8) -> dict:
    """What one training step hands to collectives, by mesh dimension, by formula; m
    micro-batches of B/(dp·m) sequences of T/cp tokens, an activation a = B/(dp·m)·T/cp·h
    elements, L/pp blocks on the stage.
    - pp: each micro-batch's activation (forward, first stage) or its gradient (backward, last
      stage): m·a; plus the 8-byte gradient-norm sum.
    - dp_cp (FSDP2, `reshard_after_forward=False`): one all-gather of this rank's padded shard
      and one reduce-scatter of the padded whole (tp-local) gradient (`fsdp_handed_elements`:
      (1 + dp·cp) × the padded shard, ⌈d0/n⌉ rows a parameter); plus one 8-byte norm sum per
      kind of sharding (1-D; 2-D when tp > 1).
    - tp, per block and micro-batch, all-reduces of one activation a: 2 forward (after o and
      down), 1 in the recomputation (activation checkpointing stops before the MLP's down
      projection: its output is not needed by backward), 5 backward (the input gradients of q,
      k, v and gate, up: each column-parallel input all-reduces its own); plus 8 (the norm).
    - tp under the sequence plan (`tp_sequence_bytes`): reduce-scatters and all-gathers in
      place of the all-reduces, plus the norms' and the loss's all-reduces.
    - pp under the sequence plan: each micro-batch's activation is sequence-sharded, a/tp.
    - cp: chapter 18's ring, `ring_bytes_per_rank`, per block and micro-batch, its forward twice
      (once more in the recomputation) and its backward once; K/V heads are repeated to the
      query heads before the ring (heads/tp of them; attention sees its whole s/cp under both
      tp plans, the sequence plan gathers it first)."""
    from chapters.ch18_long_context.ring import ring_bytes_per_rank

    cfg = run.cfg
    rows = run.global_batch // (layout.dp * run.microbatches)
    local_len = run.seq_len // layout.cp
    act = rows * local_len * cfg.hidden * elem
    blocks = cfg.layers // layout.pp
    out = {}
    if layout.pp > 1:
        piece = act // layout.sp  # (b, s/(cp·tp), h) under sequence parallelism
        out["pp"] = run.microbatches * piece * (1 if stage in (0, layout.pp - 1) else 2) + 8
    if layout.dp * layout.cp > 1:
        gathered, scattered = fsdp_handed_elements(cfg, layout, stage)
        out["dp_cp"] = (gathered + scattered) * elem + 8 * (2 if layout.tp > 1 else 1)
    if layout.tp > 1 and layout.sp > 1:
        out["tp"] = tp_sequence_bytes(run, layout, stage, elem) + 8
    elif layout.tp > 1:
        out["tp"] = blocks * run.microbatches * (2 + 1 + 5) * act + 8
    if layout.cp > 1:
        ring = ring_bytes_per_rank(rows, cfg.heads // layout.tp, local_len, cfg.head_dim, elem,
                                   layout.cp)
        out["cp"] = blocks * run.microbatches * (2 * ring["forward"] + ring["backward"])
    return out


def tp_sequence_bytes(run: Run, layout: Layout, stage: int, elem: int = 8) -> int:
    """Bytes one step hands to tp's collectives under the sequence plan, by formula (the 8-byte
    norm sum left out); a = B/(dp·m)·T/cp·h elements, the whole activation of a micro-batch,
    which a rank holds 1/tp of between the blocks' matmuls. At the boundary an all-gather is
    handed its piece (a/tp), a reduce-scatter the whole (a).
    - per block and micro-batch: attention and the MLP each all-gather their input and
      reduce-scatter their output in forward (2 + 2); backward runs each in reverse (the
      gradient of an all-gather is a reduce-scatter: 2 + 2); the recomputation gathers both
      inputs again and reduce-scatters o's output, not down's (it stops once the saved tensors
      are back, as the blocks plan's recomputation skips down's all-reduce): 6 gathers, 5
      scatters. One reduce-scatter for q, k and v together, where "blocks" all-reduced each of
      their input gradients: the three share the one gathered input, whose gradient is summed
      before it is scattered.
    - first stage, per micro-batch: the embedding's partial output reduce-scattered onto the
      sequence, its gradient all-gathered; last stage: the head's input all-gathered, its
      gradient reduce-scattered.
    - last stage, per micro-batch: loss parallel's three all-reduces of one number per token
      (B/(dp·m)·T/cp): the logits' maximum, the sum of their exponentials and the target's
      logit, each over the vocabulary shards.
    - the norms' weight gradients (h each, 2 per block, the final norm on the last stage): each
      tp rank saw its own tokens, so each holds a partial sum (DTensor's Partial), all-reduced
      ONCE per step, not once per micro-batch: the micro-batches' partial gradients accumulate
      first and FSDP2 (or `tp_grads_to_param_placements`) reduces the sum when the step's
      gradients are complete."""
    cfg, m = run.cfg, run.microbatches
    rows = run.global_batch // (layout.dp * m)
    tokens = rows * (run.seq_len // layout.cp)
    act = tokens * cfg.hidden * elem
    blocks = cfg.layers // layout.pp
    first, last = stage == 0, stage == layout.pp - 1
    gathers = m * (blocks * (4 + 2) + first + last) * (act // layout.tp)
    scatters = m * (blocks * (4 + 1) + first + last) * act
    loss = last * m * 3 * tokens * elem
    norms = (2 * blocks + last) * cfg.hidden * elem
    return gathers + scatters + loss + norms


def differences(composed: dict, reference: dict) -> dict:
    """Largest differences: loss (relative), pre-clip norm (relative), parameters (absolute)."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(composed["losses"], reference["losses"]))
    norm = max(abs(a - b) / abs(b) for a, b in zip(composed["norms"], reference["norms"]))
    params = composed["params"]
    assert set(params) == set(reference["params"]), set(params) ^ set(reference["params"])
    p = max((params[k].double() - reference["params"][k].double()).abs().max().item()
            for k in params)
    return {"loss": loss, "norm": norm, "params": p}


def tolerances(run: Run) -> dict:
    """The lesson's float64 tolerances. The composed run and one process compute the same sums
    in another order (over tokens, micro-batches, dp x cp ranks, tp shards, ring blocks): a sum
    of n terms reordered moves by at most n·u times the sum of their magnitudes, u = 2^-53. The
    loss is a sum over the B·T tokens of the global batch (relative B·T·u). The squared norm is a
    sum of P squared gradient entries, regrouped by shard, slice and stage, each entry a sum over
    the tokens: relative (P + B·T)·u. A weight moves by at most η·B·T·u/ε per AdamW step (the
    chapter's first-order bound, gradients clipped to norm <= 1), k steps."""
    u = torch.finfo(run.dtype).eps / 2
    n = run.global_batch * run.seq_len
    p = sum(t.numel() for t in Llama(run.cfg).parameters())
    return {"loss": n * u, "norm": (p + n) * u, "params": run.steps * run.lr * n * u / 1e-8}


def expected_activation_bytes(run: Run, layout: Layout, stage: int, elem: int = 8) -> int:
    """Activations a rank's decoder layers keep for backward at the peak of a step, by formula:
    with checkpointing per block each block keeps its input, one micro-batch's (B/(dp·m), T/cp,
    h) on every tp rank under the blocks plan, (B/(dp·m), T/(cp·tp), h) under the sequence plan
    (the residual stream is sequence-sharded between blocks); a 1F1B stage holds
    min(m, pp − stage) micro-batches at once (torch's Schedule1F1B warms up with that many
    forwards before its first backward). Chapter 30's `activation_band` has this as its bottom."""
    rows = run.global_batch // (layout.dp * run.microbatches)
    in_flight = min(run.microbatches, layout.pp - stage)
    blocks = run.cfg.layers // layout.pp
    tokens = run.seq_len // (layout.cp * layout.sp)
    return blocks * in_flight * rows * tokens * run.cfg.hidden * elem


def record_checks(rec, run: Run, layout: Layout, result: dict, composed: dict, info) -> None:
    """The script's checks: the composed run against one process (computed on rank 0, in the
    same program), and what every rank counted against the formulas above."""
    import torch.distributed as dist

    from common.distributed import gather_numbers

    tol, box = tolerances(run), [None]
    if info.is_main:
        box = [differences(composed, one_process(run))]
    dist.broadcast_object_list(box, src=0)
    d = box[0]
    for key, what in (("loss", "losses (relative)"), ("norm", "pre-clip grad norms (relative)"),
                      ("params", "weights")):
        rec.check(f"{layout.name()}: {what} = one process", "parity", d[key], tol[key],
                  compare="<=")
    coords = result["coords"]
    stage, shard = coords["pp"], coords["dp"] * layout.cp + coords["cp"]  # its dp x cp shard
    mine = sum(result["state_bytes"].values())
    formula = sum(expected_state_bytes(run.cfg, layout, stage, shard=shard,
                                       t=coords["tp"]).values())
    ok = gather_numbers(int(mine == formula))
    rec.check("model-state bytes per rank = formula (every rank)", "count", sum(ok),
              info.world_size)
    # the largest rank's count beside the largest rank's formula (ranks differ when dp x cp
    # does not divide a parameter's rows)
    rec.figure("model-state bytes per rank (largest)", max(gather_numbers(mine)),
               expected=max(gather_numbers(formula)), unit="B")
    expected = expected_comm_bytes(run, layout, stage)
    traffic = result["comm_bytes"] == expected
    rec.check("bytes to collectives per step, by mesh dimension = formula (every rank)",
              "count", sum(gather_numbers(int(traffic))), info.world_size)
    for dim in sorted(set(result["comm_bytes"]) | set(expected)):
        rec.figure(f"bytes to collectives per step over {dim} (rank 0)",
                   result["comm_bytes"].get(dim, 0), expected=expected.get(dim, 0), unit="B")
    acts = result["activation_bytes"] == expected_activation_bytes(run, layout, stage)
    rec.check("activation bytes kept for backward, at the peak = formula (every rank)",
              "count", sum(gather_numbers(int(acts))), info.world_size)
    rec.figure("activation bytes kept for backward, peak (rank 0)", result["activation_bytes"],
               expected=expected_activation_bytes(run, layout, stage), unit="B")
