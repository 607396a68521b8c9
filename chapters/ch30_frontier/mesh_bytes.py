"""The planner's bytes per mesh dimension: for a Llama on a dp × tp × pp × cp mesh (chapter 25's
composed run), what one rank holds and what each dimension's collectives move in one step, in
the run's dtypes. planner.py prices a layout in seconds; this module counts the bytes those
seconds are made of, so that they can be set beside a run that counts them too. The shapes it counts over (the
Llama, the mesh, the dtypes) are in mesh_spec.py.

The parallel plan counted is torchtitan's (Llama `parallelize`, `pipeline`), the one issue 21
asks chapter 25 to build:

- pp: the layers split into `pp` stages (the first `L mod pp` stages one layer more), the input
  embedding on the first stage, the final norm and the output head on the last; 1F1B schedules
  send each micro-batch's activation forward and its gradient back (torch.distributed.pipelining).
- tp (Megatron with sequence parallelism, chapter 05): q, k, v, gate, up and the head split by
  output features (Shard(0)), o and down by input features (Shard(1)), the embedding by rows
  (vocabulary, Shard(0)), norms replicated. Per layer and micro-batch the forward all-gathers the
  sequence-sharded input of attention and of the MLP and reduce-scatters their outputs; the
  backward does the reverse; activation checkpointing repeats the forward's but for the MLP's
  reduce-scatter (the recomputation stops early, once every saved tensor is back). The embedding's
  output is reduce-scattered, the head's input all-gathered (loss parallel: logits stay sharded,
  and the cross-entropy all-reduces three values per position); the replicated norm weights'
  partial gradients are all-reduced where FSDP2 reduces gradients (once a step under a pipeline
  schedule). Chapter 25's composed.py runs both plans ("blocks" and, as "sequence", this one;
  `Mesh.plan`). Both plans' counts are measured against the collectives torch issues in
  tests/test_ch30_frontier_measured.py, and against chapter 25's run (against_ch25.py).
- cp: chapter 18's ring attention (`ring.RingAttention`): forward cp − 1 hops of K and V;
  backward cp − 1 hops of K and V and cp hops of dK, dV; its K and V have as many heads as q
  (chapter 18's ring needs q, k, v of one shape: grouped-query K/V are repeated before it).
- dp × cp: FSDP2 per decoder layer plus the root, on the flattened dp × cp mesh. Each parameter
  (its TP-local part) is cut on dim 0 with torch.chunk over the n = dp·cp ranks, so a rank may get
  fewer rows, or none; the all-gather's output and the reduce-scatter's input are the padded
  whole, n·⌈d0/n⌉ rows.

Counted "at the collective boundary": the bytes of the tensor a rank hands to the collective,
in the dtype it is sent in: an all-gather's input (its 1/n piece), a reduce-scatter's or an
all-reduce's input (the whole), a send's tensor (receives are the peer's sends); chapter 25's
`CommCounter` counts the same. `wire` is what a ring algorithm then sends per rank, of the whole
S: (n − 1)/n·S for an all-gather or a reduce-scatter, 2(n − 1)/n·S for an all-reduce (chapter
07), all of a send. Scalars (the loss, the gradient norm's partial sums) are left out.
"""

from __future__ import annotations

import math

# PLANS and layout_error are re-exported: lesson.py, against_ch25.py and tests/test_ch30_frontier_*.py
# read the layout's rules through this module, the one the lesson names for the bytes
from chapters.ch30_frontier.mesh_spec import (  # noqa: F401
    PLANS,
    Dtypes,
    Llama,
    Mesh,
    layout_error,
    stage_layers,
)

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send")
HANDED = {"all_gather": lambda n: n, "reduce_scatter": lambda n: 1, "all_reduce": lambda n: 1,
          "send": lambda n: 1}  # the whole over this: what a rank hands to the collective
WIRE = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_reduce": lambda n: 2 * (n - 1) / n, "send": lambda n: 1.0}


def chunk_rows(rows: int, n: int, i: int) -> int:
    """Rows piece i of torch.chunk(·, n) gets, 0 for the pieces torch.chunk does not make
    (FSDP2's `_chunk_with_empty`; DTensor's Shard splits the same way)."""
    c = -(-rows // n)
    return max(0, min(c, rows - i * c))


def local_shape(shape: tuple[int, ...], tp_dim: int | None, tp: int, t: int) -> tuple[int, ...]:
    if tp_dim is None:
        return shape
    return tuple(chunk_rows(d, tp, t) if k == tp_dim else d for k, d in enumerate(shape))


def model_state_bytes(llama: Llama, mesh: Mesh, dt: Dtypes, stage: int = 0, t: int = 0,
                      s: int = 0) -> dict[str, int]:
    """Parameters, gradients and AdamW state one rank keeps between steps: pipeline stage
    `stage`, tensor-parallel rank t, rank s of the dp × cp shard group."""
    n, numel, tensors = mesh.dp * mesh.cp, 0, 0
    for _, shape, tp_dim in llama.stage_params(stage, mesh.pp, mesh.plan):
        local = local_shape(shape, tp_dim, mesh.tp, t)
        numel += chunk_rows(local[0], n, s) * math.prod(local[1:])
        tensors += 1
    return {"params": numel * dt.param, "grads": numel * dt.param,
            "optimizer": 2 * numel * dt.param + tensors * dt.step,
            "moments": 2 * numel * dt.param,  # of the optimizer's: AdamW's exp_avg, exp_avg_sq
            "total": 4 * numel * dt.param + tensors * dt.step}


def fsdp_units(llama: Llama, mesh: Mesh, stage: int, t: int) -> list[int]:
    """Padded elements of each FSDP2 unit's whole (n·⌈d0/n⌉ rows of each TP-local parameter):
    one unit per decoder layer, then the root with what is left (embedding, norm, head)."""
    n = mesh.dp * mesh.cp
    units: dict[str, int] = {}
    for name, shape, tp_dim in llama.stage_params(stage, mesh.pp, mesh.plan):
        local = local_shape(shape, tp_dim, mesh.tp, t)
        unit = name.split(".")[0] if name.startswith("layer") else "root"
        units[unit] = units.get(unit, 0) + n * -(-local[0] // n) * math.prod(local[1:])
    return list(units.values())


def in_flight(mesh: Mesh, stage: int) -> int:
    """Micro-batches a 1F1B stage holds activations for at once: min(m, pp − stage)."""
    return min(mesh.micro_batches, mesh.pp - stage)


def comm_bytes(llama: Llama, mesh: Mesh, dt: Dtypes, stage: int = 0, t: int = 0,
               recompute: bool = True, reshard_after_forward: bool | None = None,
               pipelined: bool | None = None) -> dict[str, list]:
    """Collectives one rank of `stage` (tensor-parallel rank t) joins in one optimizer step, by
    mesh dimension: {dim: [(kind, calls, bytes of each call's whole tensor S)]}. `recompute`: activation
    checkpointing per layer (its forward's tp collectives and cp ring again in backward).
    `reshard_after_forward`: FSDP2's; default torchtitan's (False under pp, True without).
    `pipelined`: whether a torch.distributed.pipelining schedule runs the micro-batches (default:
    pp > 1; chapter 25's composed.py runs one at pp = 1 too), which holds FSDP2's gradient
    reduction to the last micro-batch."""
    m, b, h = mesh.micro_batches, mesh.micro_batch_size, llama.hidden
    s_local = llama.seq_len // mesh.cp
    layers = len(stage_layers(llama.layers, mesh.pp, stage))
    first, last = stage == 0, stage == mesh.pp - 1
    out: dict[str, list] = {"dp_cp": [], "tp": [], "pp": [], "cp": []}
    piped = mesh.pp > 1 if pipelined is None else pipelined
    if mesh.dp * mesh.cp > 1:
        raf = mesh.pp == 1 if reshard_after_forward is None else reshard_after_forward
        # under a pipelining schedule torch's PipelineStage defers gradient sync to the last
        # micro-batch and keeps the parameters gathered between micro-batches
        gathers = 2 * m if raf else (1 if piped else m)
        scatters = 1 if piped else m
        for unit in fsdp_units(llama, mesh, stage, t):
            out["dp_cp"] += [("all_gather", gathers, unit * dt.compute),
                             ("reduce_scatter", scatters, unit * dt.reduce)]
    act = b * s_local * h * dt.compute  # one micro-batch's (b, s/cp, h) on a tp rank, gathered
    if mesh.tp > 1 and mesh.plan == "blocks":
        # per layer and micro-batch: o's and down's outputs all-reduced in forward; in backward
        # the input gradient of each column-parallel linear on its own (q, k, v, gate, up: five,
        # where Megatron's fused qkv and gate-up have two: DTensor's ColwiseParallel turns each
        # module's input into a Replicate DTensor separately, so each reduces its own); the
        # recomputation reruns o's, not down's (measured on a fake process group in the tests)
        out["tp"].append(("all_reduce", m * layers * (7 + recompute), act))
    elif mesh.tp > 1:
        # per layer and micro-batch: attention and MLP each all-gather their input and
        # reduce-scatter their output in forward, the reverse in backward; the recomputed forward
        # stops early (torch.utils.checkpoint's default) before the MLP's reduce-scatter, whose
        # output no backward needs (chapter 25's `train_step_flops` counts the same early stop)
        calls = {"all_gather": m * layers * (4 + 2 * recompute),
                 "reduce_scatter": m * layers * (4 + recompute)}
        for kind in ("all_gather", "reduce_scatter"):
            calls[kind] += m * (first + last)  # embedding out (r-s / a-g), head in (a-g / r-s)
        out["tp"] += [(k, c, act) for k, c in calls.items()]
        # the norms' weights are replicated over tp but see only a piece of the sequence: their
        # partial gradients (h each) are all-reduced where FSDP2 reduces the gradients, every
        # micro-batch, or once a step under a pipelining schedule, which holds FSDP2's reduction
        # to the last micro-batch (measured: the fake process group below, chapter 25's run)
        norms = 2 * layers + last
        out["tp"].append(("all_reduce", (1 if piped else m) * norms, h * dt.compute))
        if last:  # loss parallel: the cross-entropy on vocabulary shards all-reduces, for each
            # position, the logits' maximum, the sum of exponentials and the target's logit
            out["tp"].append(("all_reduce", 3 * m, b * s_local * dt.compute))
    if mesh.pp > 1:
        sp = mesh.tp if mesh.plan == "torchtitan" else 1  # sequence parallel: (b, s/(cp·tp), h)
        piece = b * (s_local // sp) * h * dt.compute
        sends = m * ((not last) + (not first))  # activations forward, their gradients back
        out["pp"].append(("send", sends, piece))
    if mesh.cp > 1:
        block = b * (llama.heads // mesh.tp) * s_local * (h // llama.heads) * dt.compute
        hops = m * layers * ((mesh.cp - 1) * (2 + recompute) + mesh.cp)  # K/V; dK/dV in backward
        out["cp"].append(("send", hops, 2 * block))  # K and V (dK and dV) in one message
    return out


def totals(comm: dict[str, list], mesh: Mesh) -> dict[str, dict[str, float]]:
    """Per dimension: bytes at the collective boundary and bytes a ring sends per rank."""
    size = {"dp_cp": mesh.dp * mesh.cp, "tp": mesh.tp, "pp": mesh.pp, "cp": mesh.cp}
    return {d: {"boundary": sum(c * (x // HANDED[k](size[d])) for k, c, x in entries),
                "wire": sum(c * x * WIRE[k](size[d]) for k, c, x in entries)}
            for d, entries in comm.items()}


def activation_band(llama: Llama, mesh: Mesh, dt: Dtypes, stage: int = 0,
                    recompute: bool = True) -> tuple[float, float]:
    """(low, high) bytes of activations one rank of `stage` keeps for backward at its peak.
    Per layer and token, on a tp rank (x = h/tp; r = x with sequence parallelism, h without):
    low counts what the matmuls and attention must keep: the whole inputs of q/k/v and of
    gate/up (2h), q, k, v and the attention output (4x, K/V repeated), the MLP's gate, up and
    their product (3·ffn/tp); high adds every other intermediate of the eager graph: the two
    norms' inputs and normalised values (4r, RMSNorm in the compute dtype), q and k before RoPE
    (2x), o's input copy (x) and silu(gate) (ffn/tp).
    With `recompute` (checkpointing per layer) each layer keeps only its input (r per token)
    and the band's top adds one layer whole, rebuilt in backward. The first stage holds
    min(m, pp) micro-batches (1F1B)."""
    x, f = llama.hidden / mesh.tp, llama.ffn / mesh.tp
    r = x if mesh.plan == "torchtitan" else llama.hidden
    tokens = mesh.micro_batch_size * llama.seq_len / mesh.cp
    low = 2 * llama.hidden + 4 * x + 3 * f
    high = low + 4 * r + 3 * x + f
    layers = len(stage_layers(llama.layers, mesh.pp, stage)) * in_flight(mesh, stage)
    e = dt.compute
    if recompute:
        kept = layers * tokens * r * e
        return kept, kept + tokens * high * e
    return layers * tokens * low * e, layers * tokens * high * e


def compare(llama: Llama, mesh: Mesh, dt: Dtypes, measured: dict, stage: int = 0, t: int = 0,
            s: int = 0, recompute: bool = True, reshard_after_forward: bool | None = None,
            pipelined: bool | None = None) -> list[dict]:
    """The predictions beside a run's measured figures for one rank: `measured` holds
    "model_state" (bytes of some of `model_state_bytes`'s parts: "params", "grads", "optimizer"
    or "moments"), "comm" ({dim: bytes handed to that dimension's collectives in one step}) and
    "activations" (bytes kept for backward at the peak). Model state and communication must be
    equal (they are counts, not timings), every dimension the prediction moves bytes over
    included; the activations must lie in `activation_band`."""
    rows = []
    state = model_state_bytes(llama, mesh, dt, stage, t, s)
    for part, got in measured["model_state"].items():
        rows.append({"name": f"model state: {part}", "predicted": state[part], "measured": got})
    comm = totals(comm_bytes(llama, mesh, dt, stage, t, recompute, reshard_after_forward,
                             pipelined), mesh)
    for dim in sorted(set(measured["comm"]) | {d for d, v in comm.items() if v["boundary"]}):
        rows.append({"name": f"bytes per step at the boundary: {dim}",
                     "predicted": comm[dim]["boundary"] if dim in comm else 0,
                     "measured": measured["comm"].get(dim, 0)})
    for row in rows:
        row["ok"] = row["predicted"] == row["measured"]
    low, high = activation_band(llama, mesh, dt, stage, recompute)
    rows.append({"name": "activations (band)", "predicted": [low, high],
                 "measured": measured["activations"], "ok": low <= measured["activations"] <= high})
    return rows


def report(llama: Llama, mesh: Mesh, dt: Dtypes, recompute: bool = True) -> list[str]:
    """Lines for the lesson: per pipeline stage (tp rank 0, shard rank 0), the model state, the
    bytes per step of each dimension (at the boundary / on a ring's wire) and the activation band."""
    lines = [f"dp={mesh.dp} tp={mesh.tp} pp={mesh.pp} cp={mesh.cp}, b={mesh.micro_batch_size}, "
             f"m={mesh.micro_batches}, {mesh.plan} plan, recompute={recompute}: bytes per rank "
             "(kB = 1000 B)"]
    for stage in range(mesh.pp):
        st = model_state_bytes(llama, mesh, dt, stage)
        tot = totals(comm_bytes(llama, mesh, dt, stage, recompute=recompute), mesh)
        low, high = activation_band(llama, mesh, dt, stage, recompute)
        lines.append(f"stage {stage}: params {st['params'] / 1e3:.1f}, grads {st['grads'] / 1e3:.1f}, "
                     f"AdamW {st['optimizer'] / 1e3:.1f} kB; activations {low / 1e3:.1f}-{high / 1e3:.1f} kB")
        lines.append("   per step, boundary / wire (kB): " + ", ".join(
            f"{d} {v['boundary'] / 1e3:.1f} / {v['wire'] / 1e3:.1f}" for d, v in tot.items()))
    return lines
