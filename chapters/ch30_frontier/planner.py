"""An auto-parallel planner: search (dp, tp, pp, micro-batch size, ZeRO stage, and with
`ModelSpec.max_cp` context parallelism cp) with the course's own models of step time and memory,
under a memory limit. mesh_bytes.py counts the bytes of a composed dp × tp × pp × cp layout.

Nothing here is new theory; every term is imported from the chapter that taught it:

- compute: 6·Ψ FLOPs per token plus 12·L·s·h for the attention scores (Narayanan et al. 2021),
  at a stated fraction of the device's peak (chapter 01's MFU);
- pipeline: m micro-batches take m·t_mb / (1 − bubble) with chapter 04's GPipe/1F1B bubble
  (p−1)/(m+p−1) (`bubble_formula`), i.e. (m + p − 1)·t_mb;
- tensor parallelism: Megatron's all-reduces of b·s·h activations per layer (chapter 05),
  priced by chapter 07's α–β ring model (`predicted_time`);
- data parallelism / ZeRO: chapter 06's volume (2Ψ, 2Ψ, 2Ψ, 3Ψ: `paper_volume`) priced as ring
  all-reduces; model states per rank from chapter 06's `per_rank_bytes`;
- activations: chapter 05's Korthikanti et al. count (`layer_activation_bytes`), times the
  micro-batches a 1F1B stage holds at once (min(m, p), chapter 17).

What is missing from those chapters and written here: which link a group of ranks uses (ranks
numbered tp innermost, then cp, then dp, then pp: Megatron-Core's default order `tp-cp-ep-dp-pp`
without its ep axis; its other supported order, tp-cp-ep-pp-dp, is `Cluster(order="tp-pp-dp")`), the
activation count of a layer without attention (the MLP rows of Korthikanti's table with any
d_ff), and the search itself. What it searches over (the model, the cluster, a layout) is in
specs.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from chapters.ch04_model_parallel.schedule import bubble_formula
from chapters.ch05_tensor_parallel.activations import layer_activation_bytes
from chapters.ch06_hybrid_zero.memory import paper_volume, per_rank_bytes
from chapters.ch07_communication.cost_model import predicted_time
from chapters.ch30_frontier.specs import RECOMPUTE, ZERO_STAGES, Cluster, Layout, ModelSpec

TERMS = ("compute", "tp_comm", "pp_comm", "dp_comm", "cp_comm")


def link(cluster: Cluster, size: int, stride: int) -> tuple[float, float]:
    """(α, β) of a group of `size` ranks `stride` apart: inside a node if it fits in one."""
    if size * stride <= cluster.gpus_per_node:
        return cluster.alpha_intra, 1 / cluster.bw_intra
    return cluster.alpha_inter, 1 / cluster.bw_inter


def strides(cluster: Cluster, lay: Layout) -> dict[str, int]:
    """How far apart the ranks of one group of each axis are, from the cluster's rank order:
    tp innermost (stride 1), cp next (stride tp; Megatron-Core's "tp-cp-ep-dp-pp" and
    "tp-cp-ep-pp-dp"), then the middle axis (stride tp·cp), then the outer one."""
    middle, outer = ("dp", "pp") if cluster.order == "tp-dp-pp" else ("pp", "dp")
    inner = lay.tp * lay.cp
    return {"tp": 1, "cp": lay.tp, middle: inner, outer: inner * getattr(lay, middle)}


def step_terms(spec: ModelSpec, cluster: Cluster, lay: Layout) -> dict[str, float]:
    """Seconds per optimizer step, by term. compute, tp_comm and pp_comm are per micro-batch
    slot and stretched by the pipeline's (m + p − 1) slots; dp_comm follows once (not overlapped)."""
    m, n = lay.micro_batches(spec), lay.dp * lay.tp * lay.pp * lay.cp
    stretch = m / (1 - float(bubble_formula(lay.pp, m)))  # = m + p − 1 (chapter 04)
    compute = spec.flops_per_step(lay.recompute) / n / m / (cluster.peak_flops * cluster.efficiency)
    act = lay.micro_batch_size * spec.seq_len // lay.cp * spec.d_model * spec.act_bytes
    per_layer = 4 if spec.attention else 2  # Megatron: (attention, MLP) × (forward, backward)
    apart = strides(cluster, lay)
    a, b = link(cluster, lay.tp, apart["tp"])
    tp = spec.n_layers // lay.pp * per_layer * predicted_time("ring", act, lay.tp, a, b)
    a, b = link(cluster, lay.pp, apart["pp"])  # the slowest hop paces every slot
    pp = 2 * (a + act * b) if lay.pp > 1 else 0.0  # activation forward, its gradient back
    pp *= (lay.pp - 1) if cluster.async_p2p else stretch
    # gradients are reduced over dp·cp (cp ranks hold the same weights); the ring is paced by
    # the slower of the two groups' links (the larger α: the network's)
    a, b = link(cluster, lay.dp, apart["dp"])
    if lay.cp > 1:
        a, b = max((a, b), link(cluster, lay.cp, apart["cp"]))
    grads = math.ceil(spec.params() / (lay.tp * lay.pp)) * spec.grad_bytes
    dp = paper_volume(lay.zero) / 2 * predicted_time("ring", grads, lay.dp * lay.cp, a, b)
    cp = 0.0
    if lay.cp > 1 and spec.attention:  # ring attention, not overlapped (as nothing here is)
        kv = (spec.kv_heads or spec.n_heads) * (spec.d_model // spec.n_heads) // lay.tp
        block = 2 * act // spec.d_model * kv  # K and V of this rank's s/cp tokens
        a, b = link(cluster, lay.cp, apart["cp"])
        hops = 2 * (lay.cp - 1) + lay.cp  # K/V forward and backward, dK/dV back home
        cp = spec.n_layers // lay.pp * hops * (a + block * b)
    return {"compute": stretch * compute, "tp_comm": stretch * tp, "pp_comm": pp, "dp_comm": dp,
            "cp_comm": stretch * cp}


def step_time(spec: ModelSpec, cluster: Cluster, lay: Layout, drop: str | None = None) -> float:
    """Predicted seconds per step; `drop` leaves one term out (the planner's negative control)."""
    terms = step_terms(spec, cluster, lay)
    return sum(v for k, v in terms.items() if k != drop)


def activation_bytes(spec: ModelSpec, lay: Layout) -> float:
    """Activations one rank of the first stage holds: its L/p layers for min(m, p) micro-batches
    (1F1B). With tp > 1 sequence parallelism is on (Megatron-LM's practice; same bytes moved).
    selective: the a·s²·b attention terms are recomputed, not kept; full: only each layer's
    input is kept, plus one layer's whole activations while it is recomputed. With cp > 1 the
    count is taken at s/cp tokens (its a·s²·b terms then stand for a ring step's (s/cp)² score
    blocks, an approximation)."""
    s, b, h, t = spec.seq_len // lay.cp, lay.micro_batch_size, spec.d_model, lay.tp
    if spec.attention:
        whole = layer_activation_bytes(s, b, h, spec.n_heads, t, sequence_parallel=t > 1)
    else:  # Korthikanti's MLP rows with any d_ff: input and dropout mask whole, the rest split
        whole = s * b * (2 * h + h + 2 * h + (2 + 2) * spec.d_ff / t)
    kind = RECOMPUTE[lay.recompute]
    if kind == "selective":
        per_layer = whole - 5 * spec.n_heads * s * s * b / t
    elif kind == "full":
        per_layer = 2 * s * b * h / (t if spec.attention and t > 1 else 1)
    else:
        per_layer = whole
    held = spec.n_layers // lay.pp * per_layer * min(lay.micro_batches(spec), lay.pp)
    return held + (whole if kind == "full" else 0.0)


def memory_bytes(spec: ModelSpec, lay: Layout) -> float:
    """Model states (chapter 06, ZeRO over dp) of this rank's Ψ/(tp·pp) plus activations."""
    local = math.ceil(spec.params() / (lay.tp * lay.pp))
    states = per_rank_bytes(lay.zero, local, lay.dp * lay.cp, spec.param_bytes, spec.grad_bytes,
                            spec.state_bytes)["total"]
    return states + activation_bytes(spec, lay)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def recompute_options(spec: ModelSpec) -> tuple[int, ...]:
    return (0, 1, 2) if spec.attention else (0, 2)


def cp_options(spec: ModelSpec, n: int) -> list[int]:
    """cp sizes up to `max_cp` that divide n and cut each sequence into 2·cp equal chunks."""
    return [c for c in divisors(n) if c <= spec.max_cp and spec.seq_len % (2 * c if c > 1 else 1) == 0]


def layouts(spec: ModelSpec, n_gpus: int):
    """Every valid layout: dp·tp·pp·cp = n, tp divides the heads and d_ff, pp the layers, dp·b
    the batch, 2·cp the sequence (cp ≤ spec.max_cp)."""
    for tp in divisors(n_gpus):
        if spec.d_ff % tp or (spec.attention and (spec.n_heads % tp or (spec.kv_heads or spec.n_heads) % tp)):
            continue
        for pp in divisors(n_gpus // tp):
            for cp in cp_options(spec, n_gpus // (tp * pp)):
                dp = n_gpus // (tp * pp * cp)
                if spec.n_layers % pp or spec.global_batch % dp:
                    continue
                for b in divisors(spec.global_batch // dp):
                    for r in recompute_options(spec):
                        for z in ZERO_STAGES:
                            yield Layout(dp, tp, pp, b, r, z, cp)


@dataclass
class Plan:
    layout: Layout | None
    time: float
    memory: float
    evaluated: int

    def as_dict(self) -> dict:
        return {"layout": asdict(self.layout) if self.layout else None, "time_s": self.time,
                "memory_bytes": self.memory, "evaluated": self.evaluated}


def brute_force(spec: ModelSpec, cluster: Cluster) -> Plan:
    """The reference: every layout evaluated; the fastest that fits, ties to the smallest Layout."""
    best, evaluated = None, 0
    for lay in layouts(spec, cluster.n_gpus):
        evaluated += 1
        t, mem = step_time(spec, cluster, lay), memory_bytes(spec, lay)
        if mem <= cluster.memory_bytes and (best is None or (t, lay) < best[:2]):
            best = (t, lay, mem)
    return Plan(best[1], best[0], best[2], evaluated) if best else Plan(None, math.inf, math.inf, evaluated)


def search(spec: ModelSpec, cluster: Cluster, ignore_memory: bool = False,
           drop: str | None = None) -> Plan:
    """The planner: the same answer as `brute_force`, fewer layouts evaluated. Three prunes:
    1. ZeRO: for a fixed (dp, tp, pp, b, recompute) time never falls and memory never rises
       with the stage, so the first stage that fits is the best of the four (ties go to the
       lower stage, as in brute force).
    2. Micro-batch size: memory never falls as b grows (min(m, p)·b = min(B/dp, p·b)), so once
       b does not fit even with ZeRO-3 and full recomputation, no larger b will.
    3. Bound: no layout of (dp, tp, pp) is faster than its compute with no bubble and no
       recomputation plus its ZeRO-0 gradient all-reduce; if that exceeds the best found, skip.
    `ignore_memory` and `drop` (one term of the time left out) are negative controls."""
    limit = math.inf if ignore_memory else cluster.memory_bytes
    best: tuple | None = None
    evaluated = 0
    groups: dict[tuple[int, int, int, int], list[int]] = {}
    for lay in layouts(spec, cluster.n_gpus):
        bs = groups.setdefault((lay.dp, lay.tp, lay.pp, lay.cp), [])
        if lay.micro_batch_size not in bs:
            bs.append(lay.micro_batch_size)
    for (dp, tp, pp, cp), bs in groups.items():
        if best is not None and drop is None:
            probe = Layout(dp, tp, pp, spec.global_batch // dp, 0, 0, cp)
            terms, m = step_terms(spec, cluster, probe), probe.micro_batches(spec)
            bound = terms["compute"] * m / (m + pp - 1) + terms["dp_comm"]
            if bound > best[0] * (1 + 1e-9):
                continue
        for b in sorted(bs):
            fitted = False
            for r in recompute_options(spec):
                for z in ZERO_STAGES:
                    lay = Layout(dp, tp, pp, b, r, z, cp)
                    evaluated += 1
                    mem = memory_bytes(spec, lay)
                    if mem > limit:
                        continue
                    t = step_time(spec, cluster, lay, drop)
                    if best is None or (t, lay) < best[:2]:
                        best = (t, lay, mem)
                    fitted = True
                    break
            if not fitted:
                break
    if best is None:
        return Plan(None, math.inf, math.inf, evaluated)
    return Plan(best[1], step_time(spec, cluster, best[1]), best[2], evaluated)


# --- worked cluster/model pairs (stated figures, not measured here) -----------------------------

H100_NODE = dict(gpus_per_node=8, memory_bytes=80e9, peak_flops=989e12, efficiency=0.5,
                 alpha_intra=5e-6, bw_intra=360e9, alpha_inter=10e-6, bw_inter=40e9)
"""An H100 SXM node: 989 TFLOP/s dense bf16 (datasheet) at an assumed MFU of 50%; NVLink ring
bus bandwidth 360 GB/s and one 400 Gb/s NIC per GPU giving 40 GB/s (typical nccl-tests figures,
assumed); α 5 µs in a node, 10 µs between nodes (assumed)."""

LLAMA_7B = ModelSpec(n_layers=32, d_model=4096, n_heads=32, d_ff=11008, seq_len=4096,
                     global_batch=512, vocab=32000, mlp_matrices=3)
LLAMA_70B = ModelSpec(n_layers=80, d_model=8192, n_heads=64, d_ff=28672, seq_len=4096,
                      global_batch=1024, vocab=32000, kv_heads=8, mlp_matrices=3)

WORKED = {
    "7B on 64 GPUs of 80 GB": (LLAMA_7B, Cluster(n_gpus=64, **H100_NODE)),
    "70B on 512 GPUs of 80 GB": (LLAMA_70B, Cluster(n_gpus=512, **H100_NODE)),
}


def small_cases() -> dict[str, tuple[ModelSpec, Cluster]]:
    """Spaces small enough to brute-force in a test: a 1.3B-like model on 16 GPUs of 24 and 80 GB,
    and the 7B on 32 GPUs of 40 GB."""
    gpt = ModelSpec(n_layers=24, d_model=2048, n_heads=16, d_ff=8192, seq_len=2048,
                    global_batch=64, vocab=50257)
    return {
        "1.3B, 16 x 24 GB": (gpt, Cluster(n_gpus=16, **{**H100_NODE, "memory_bytes": 24e9})),
        "1.3B, 16 x 80 GB": (gpt, Cluster(n_gpus=16, **H100_NODE)),
        "7B, 32 x 40 GB": (replace(LLAMA_7B, global_batch=64), Cluster(n_gpus=32, **{**H100_NODE, "memory_bytes": 40e9})),
    }


def cp_case() -> tuple[ModelSpec, Cluster]:
    """Long sequences, where context parallelism pays: the 1.3B-like model at 32,768 tokens, 16
    sequences per step, cp up to 8, on 16 GPUs of 24 GB."""
    spec, cluster = small_cases()["1.3B, 16 x 24 GB"]
    return replace(spec, seq_len=32768, global_batch=16, max_cp=8), cluster
