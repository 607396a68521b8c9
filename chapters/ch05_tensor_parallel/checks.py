"""The checks of chapter 05's run: every version against the dense block, and every counted
collective, byte, parameter and saved activation against the lesson's formulas.

Each `record_*` takes a recorder (`common.results.RunRecorder`, or anything with the same
`check` and `figure` methods: the tests pass a collector and run the same checks on broken
variants). Expected values come from the configuration and the theory, never from the run.
"""

from __future__ import annotations

import math

import torch

from chapters.ch05_tensor_parallel import dtensor_tp
from chapters.ch05_tensor_parallel.tp_layers import shard_state
from common.distributed import reduce_number

# Parity tolerance (the lesson derives it): the versions differ only in the order of
# floating-point additions. Each addition rounds by at most u times the partial sum (u the
# unit roundoff: 2^-53 = 1.1e-16 in float64, 2^-24 = 6.0e-8 in float32; ulp(1) is twice that),
# so with partial sums below M a sum of n terms is off by at most ~n·u·M;
# the longest sums are the widest of d_ff (MLP), h (linears), S (attention) and B·S (the tokens
# a weight gradient sums over): d_ff = 256 with the defaults. Values stay below M = 8, and the
# error passes through n_layers blocks: tolerance = u · n · 8 · n_layers. A budget of the worst case's
# order, not a proof (LayerNorm and the SGD steps can amplify errors): the versions differ
# ~400x below it, a broken variant far above (exercise 2's bias before g: 0.34).
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24}
VALUE_BOUND = 8.0  # M: the run records the largest |value| it met (figure), 4.7 with the defaults


def longest_sum(cfg) -> int:
    return max(cfg.ffn_mult * cfg.d_model, cfg.d_model, cfg.seq_len, cfg.batch_size * cfg.seq_len)


def tolerance(cfg) -> float:
    return UNIT_ROUNDOFF[cfg.dtype] * longest_sum(cfg) * VALUE_BOUND * cfg.n_layers


def largest_value(model: torch.nn.Module, x: torch.Tensor) -> float:
    """The largest |value| entering or leaving a linear or LayerNorm in one forward: the M
    that the parity tolerance assumes (VALUE_BOUND)."""
    seen = [0.0]

    def hook(module, inputs, output):
        seen[0] = max(seen[0], inputs[0].abs().max().item(), output.abs().max().item())

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm))]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return seen[0]


class Expect:
    """How a variant's local tensors relate to the dense ones."""

    def __init__(self, rank, tp, sp, sharded):
        self.rank, self.tp, self.sp, self.sharded = rank, tp, sp, sharded

    def act(self, t):
        return t.chunk(self.tp, dim=1)[self.rank] if self.sp else t

    def params(self, state):
        return shard_state(state, self.rank, self.tp) if self.sharded else state


def max_diff(local: dict, expected: dict) -> float:
    """max |a − b| over the tensors, then over the ranks (every rank gets the same answer).
    Shapes must match (broadcasting would hide a wrong shard); a NaN counts as infinitely far
    (a max over ranks may drop a NaN, never an inf)."""
    assert local.keys() == expected.keys(), sorted(set(local) ^ set(expected))
    for k in expected:
        assert local[k].shape == expected[k].shape, f"{k}: {tuple(local[k].shape)} != {tuple(expected[k].shape)}"
    d = max((local[k] - expected[k]).abs().max().item() for k in expected)
    return reduce_number(d if d == d else math.inf, "max")


def norm_diff(run_norms: list, ref_norms: list) -> float:
    """max |a − b| over the steps' gradient norms; both NaN (no clipping) is a match, one NaN
    is infinitely far."""
    assert len(run_norms) == len(ref_norms)
    def diff(a, b):
        if a != a and b != b:
            return 0.0
        d = abs(a - b)
        return d if d == d else math.inf
    return max((diff(a, b) for a, b in zip(run_norms, ref_norms)), default=0.0)


def compare(run: dict, ref: dict, expect: Expect) -> dict:
    """Max differences of output, gradients (input and parameters, before clipping), the global
    gradient norm at every step, and the trained parameters."""
    return {
        "output": max_diff({"y": run["output"]}, {"y": expect.act(ref["output"])}),
        "gradients": max(max_diff({"x": run["input_grad"]}, {"x": expect.act(ref["input_grad"])}),
                         max_diff(run["grads"], expect.params(ref["grads"]))),
        "grad norm": reduce_number(norm_diff(run["norms"], ref["norms"]), "max"),
        "trained": max_diff(run["final"], expect.params(ref["final"])),
    }


def record_parity(rec, refs: dict, runs: dict, cfg) -> None:
    tol = tolerance(cfg)
    for name, (run, ref_name, expect) in runs.items():
        for what, d in compare(run, refs[ref_name], expect).items():
            rec.check(f"{name}: {what} == dense", "parity", d, 0.0, tol)
    if "largest value" in refs["dense"]:
        rec.figure("largest |value| in or out of a linear/LayerNorm, dense (tolerance: < M)",
                   refs["dense"]["largest value"], expected=VALUE_BOUND)
    norms = [n for n in refs["dense"]["norms"] if n == n]
    if norms:  # clipping acted: without this the clipped parity above could pass unclipped
        rec.check("dense: steps whose gradient norm exceeded --max-grad-norm", "count",
                  sum(n > cfg.max_grad_norm for n in norms), 1, compare=">=")


def record_bytes(rec, comms: dict, cfg, tp: int) -> None:
    """Counted collectives of the hand-written versions per layer against the lesson's
    formulas (N = B·S·h elements of b bytes). `bytes_in` is the size of the tensor this rank
    handed to each collective; `wire_bytes` what its sends carried (ring mode)."""
    L, N = cfg.n_layers, cfg.batch_size * cfg.seq_len * cfg.d_model
    b = torch.finfo(dtype_of(cfg)).bits // 8
    tp_comm, sp_comm = comms["hand TP"], comms["hand TP+SP"]
    for phase in ("forward", "backward"):
        rec.check(f"hand TP: all_reduce calls per layer, {phase}", "count",
                  tp_comm.total("calls", phase, "all_reduce") / L, 2)
        for op in ("all_gather", "reduce_scatter"):
            rec.check(f"hand TP+SP: {op} calls per layer, {phase}", "count",
                      sp_comm.total("calls", phase, op) / L, 2)
    rec.check("hand TP: all_reduce elements per layer, forward = 2BSh", "formula",
              tp_comm.total("elements", "forward", "all_reduce") / L, 2 * N)
    rec.check("hand TP: bytes handed to all-reduce per layer, fwd+bwd = 4BSh*b", "formula",
              fwd_bwd(tp_comm, "bytes_in", "all_reduce") / L, 4 * N * b)
    rec.check("hand TP+SP: bytes handed to all-gather per layer, fwd+bwd = 4BSh*b/t", "formula",
              fwd_bwd(sp_comm, "bytes_in", "all_gather") / L, 4 * N * b / tp, tolerance=1e-9)
    rec.check("hand TP+SP: bytes handed to reduce-scatter per layer, fwd+bwd = 4BSh*b", "formula",
              fwd_bwd(sp_comm, "bytes_in", "reduce_scatter") / L, 4 * N * b)
    rec.check("hand TP+SP: all-reduces in forward and backward", "count",
              fwd_bwd(sp_comm, "calls", "all_reduce"), 0)
    rec.check("hand TP+SP: grad-sync all-reduces per layer (2 LayerNorms x 2, 2 biases)", "count",
              sp_comm.total("calls", "grad sync") / L, 6)
    rec.check("hand TP+SP: grad-sync elements per layer = 6h", "formula",
              sp_comm.total("elements", "grad sync") / L, 6 * cfg.d_model)
    ring = 8 * (tp - 1) / tp * N * b
    for name, comm in comms.items():
        label = f"{name}: ring bytes sent per rank per layer, fwd+bwd = 8(t-1)/t*BSh*b"
        if cfg.collectives == "ring":
            rec.check(label, "formula", fwd_bwd(comm, "wire_bytes") / L, ring, tolerance=1e-9)
        else:
            rec.figure(label, "n/a with library collectives (run --collectives ring)",
                       expected=ring, unit="bytes")


def fwd_bwd(comm, what: str, op: str | None = None) -> float:
    return comm.total(what, "forward", op) + comm.total(what, "backward", op)


def dtype_of(cfg) -> torch.dtype:
    return {"float64": torch.float64, "float32": torch.float32}[cfg.dtype]


def record_dtensor_counts(rec, modes: dict, cfg, tp: int) -> None:
    """DTensor's collectives (CommDebugMode) per layer and phase against the plan's (a mesh of
    one rank needs none), and the clip's for the whole model: one all-reduce of the sharded
    gradients' norm, once every gradient is whole (Partial ones left to DTensor add more)."""
    L = cfg.n_layers
    for name, counted in modes.items():
        got = dtensor_tp.counts(counted)
        expected = dtensor_tp.expected_counts("SP" in name)
        for phase in ("forward", "backward", "grad sync", "optimizer step"):
            want = expected[phase] if tp > 1 else {}
            rec.check(f"{name}: collectives per layer, {phase}", "count",
                      {op: n / L for op, n in sorted(got.get(phase, {}).items())}, dict(sorted(want.items())))
        if cfg.max_grad_norm > 0:
            rec.check(f"{name}: collectives in clip_grad_norm_ (whole model)", "count",
                      got.get("clip", {}), {"all_reduce": 1} if tp > 1 else {})


def params_per_rank(cfg, tp: int) -> int:
    """Parameter elements one rank holds: q, k, v, proj and the MLP weights, q/k/v/fc1 biases
    split t ways; LayerNorms and the row-parallel biases (6h per layer) whole."""
    h, d_ff = cfg.d_model, cfg.ffn_mult * cfg.d_model
    split = 4 * h * h + 3 * h + 2 * h * d_ff + d_ff
    return cfg.n_layers * (split // tp + 6 * h)


def record_params_held(rec, runs: dict, cfg, tp: int) -> None:
    for name, (run, _, _) in runs.items():
        rec.check(f"{name}: parameter elements held per rank", "formula", run["params_held"],
                  params_per_rank(cfg, tp))


def replicated_region_bytes(cfg) -> float:
    """Per layer, what sequence parallelism divides by t in the hand-written block: the two
    LayerNorm inputs (BSh·b each) and their mean and 1/std (2·BS·b each), and the two dropout
    masks (BSh bytes each, bool). The linears' gathered inputs stay whole (see the lesson)."""
    B, S, h = cfg.batch_size, cfg.seq_len, cfg.d_model
    b = torch.finfo(dtype_of(cfg)).bits // 8
    masks = 2 * B * S * h if cfg.dropout > 0 else 0
    return 2 * B * S * h * b + 2 * 2 * B * S * b + masks


def record_activations(rec, runs: dict, cfg, tp: int) -> None:
    """Bytes autograd saved for backward at step 0, per rank per layer: SP saves less by
    (1 − 1/t) × the replicated region."""
    L = cfg.n_layers
    tp_bytes, sp_bytes = (runs[n][0]["saved_bytes"] / L for n in ("hand TP", "hand TP+SP"))
    rec.figure("hand TP: activation bytes saved per rank per layer", tp_bytes, unit="bytes")
    rec.figure("hand TP+SP: activation bytes saved per rank per layer", sp_bytes, unit="bytes")
    rec.check("activation bytes SP saves per rank per layer = (1-1/t)(2BSh*b + 4BS*b + 2BSh)",
              "formula", tp_bytes - sp_bytes,
              (1 - 1 / tp) * replicated_region_bytes(cfg), tolerance=1e-6)
