"""The closed forms chapter 25's composed run is measured against: the bytes of model state a
rank holds (`expected_state_bytes`, with FSDP2's uneven torch.chunk shards), the bytes it hands
to each mesh dimension's collectives in a step (`expected_comm_bytes`, `tp_sequence_bytes`) and
the activations autograd keeps for a block (`expected_activation_bytes`), written from the
model's shapes and the layout alone; and the composed script's checks (`record_checks`): its
run against one process, and what counters.py measured on every rank against these formulas.
"""

from __future__ import annotations

import math

from chapters.ch25_llm.llama import Cfg
from chapters.ch25_llm.reference import Layout, Run, differences, one_process, tolerances


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
