"""What chapter 10's run proves and measures, beside the training in `train.py`: the formats
table, FP8 scaling and the fp16 underflow; the hand loss scaler against `torch.amp.GradScaler`;
the DDP runs' loss curves, all-reduce dtypes and bytes against fp32; the updates that master
weights keep and the control without them; FSDP2's dtypes and bytes against its policy, with
the control without one. Each check keeps its tolerance here.

Helper module of chapter 10 (no main guard); `train.py` and the tests import it.
"""

from __future__ import annotations

import math
import statistics

import torch

from chapters.ch10_mixed_precision import formats
from chapters.ch10_mixed_precision.formats import LOW
from chapters.ch10_mixed_precision.loss_scaler import DynamicLossScaler, scaler_trace
from common.distributed import reduce_number
from common.results import RunRecorder

SHORT = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
# Largest relative gap between a loss curve and fp32's, step by step (justified in the lesson):
# measured over seeds 0-3 and worlds 1-4, with room to spare; the bf16 control without master
# weights exceeds it from step ~30 on. fp32 FSDP2 vs fp32 DDP differ by summation order only.
LOSS_TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}
TRACE_GROWTH_INTERVAL = 3  # the scaler trace grows the scale often, to show every decision
TRACE_STEPS = 30  # of the data's steps, the scaler trace uses the first 30
# What FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) must show.
POLICY = {"all-gather": "torch.bfloat16", "forward weight": "torch.bfloat16",
          "forward output": "torch.bfloat16", "reduce-scatter": "torch.float32",
          "stored": "torch.float32"}


UPDATE_COUNTS = ("moved", "lost", "predicted", "undecided", "mismatched", "mismatched_broken",
                 "master_only")


def count_updates(before: list[torch.Tensor], params: list[torch.Tensor], lr: float,
                  compute_dtype: torch.dtype) -> dict:
    """Of the elements whose SGD update −lr·g is non-zero: how many left the weight unchanged
    (lost), how many the rounding rule `formats.rounds_back` predicts lost, how many lie so
    close to the rule's threshold that the kernel's rounding decides (undecided,
    `formats.near_threshold`), on how many of the others rule and outcome disagree
    (mismatched, element by element: totals could agree by luck; mismatched_broken: the same
    count for a broken rule that takes the whole spacing as threshold, so that a counter
    stuck at 0 is seen), and, for fp32 weights, how many moved the fp32 value but not its copy
    in the compute dtype (kept only because the master is fp32)."""
    counts = dict.fromkeys(UPDATE_COUNTS, 0)
    for b, p in zip(before, params):
        update = formats.exact_update(lr, p.grad)
        nonzero = update != 0
        lost = (p.detach() == b) & nonzero
        predicted = formats.rounds_back(b, update)
        undecided = formats.near_threshold(b, update) & nonzero
        counts["moved"] += int(nonzero.sum())
        counts["lost"] += int(lost.sum())
        counts["predicted"] += int(predicted.sum())
        counts["undecided"] += int(undecided.sum())
        counts["mismatched"] += int(((lost != predicted) & ~undecided).sum())
        broken = (update.abs() < 2 * formats.half_spacing(b, update)) & nonzero & ~undecided
        counts["mismatched_broken"] += int(((lost & ~undecided) != broken).sum())
        if p.dtype == torch.float32:
            same16 = p.detach().to(compute_dtype) == b.to(compute_dtype)
            counts["master_only"] += int((same16 & (p.detach() != b) & nonzero).sum())
    return counts


WIRE = ("all-gather", "reduce-scatter")  # FSDP2 skips its collectives on a world of one


def policy_mismatches(dtypes: dict, world_size: int) -> int:
    """How many of POLICY's places used another dtype (or more than one): the check that
    accepts FSDP2 with its bf16/fp32 policy and rejects FSDP2 without it. On a world of one
    FSDP2 sends nothing, so only the forward and the stored parameters are looked at."""
    return sum(dtypes.get(place) != [dtype] for place, dtype in POLICY.items()
               if world_size > 1 or place not in WIRE)


def short(dtypes: list[str]) -> str:
    """["torch.bfloat16", "torch.float32"] -> "bf16+fp32" (for the table)."""
    return "+".join(SHORT.get(d, d) for d in dtypes) or "none"


def policy_text(dtypes: dict) -> str:
    """POLICY's places in order, each as its short dtype: "bf16 bf16 bf16 fp32 fp32"."""
    return " ".join(short(dtypes.get(place, [])) for place in POLICY)


def padded_numel(shapes, world: int) -> int:
    """Elements FSDP2 reduce-scatters per step: each parameter's dim 0 padded to a multiple of
    the world size, so that every rank gets an equal shard."""
    return sum(math.ceil(s[0] / world) * world * math.prod(s[1:]) for s in shapes)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def curve_gap(losses: list[float], reference: list[float]) -> float:
    """The largest relative gap between two loss curves, step by step."""
    return max(rel(a, b) for a, b in zip(losses, reference))


def output_gap(run: dict, reference: dict) -> float:
    """Relative difference (norm) of the step-0 outputs, computed from the same weights and
    inputs: 0 when both forwards ran in the same precision, ~u of the lower one otherwise.
    The smallest over the ranks (each rank's forward must show it)."""
    a, b = run["first_output"], reference["first_output"]
    return reduce_number(((a - b).norm() / b.norm()).item(), "min")


def timing_figure(rec: RunRecorder, name: str, step_ms: list[float]) -> None:
    """Step time after the warm-up: median, min, max (reported, never checked)."""
    rec.figure(f"time per step {name}: median, min, max",
               [round(x, 3) for x in (statistics.median(step_ms), min(step_ms), max(step_ms))],
               unit="ms")


def record_formats(rec: RunRecorder, device: torch.device) -> None:
    """Range/precision table, FP8 per-tensor scaling, fp16 underflow with and without scaling."""
    mismatches = 0
    for row in formats.format_table():
        for key in ("max", "eps", "tiny"):
            rec.figure(f"{row['name']} {key}", row[key], expected=row["formula"][key])
            mismatches += row[key] != row["formula"][key]
    rec.check("torch.finfo == bit-layout formula (5 formats x max, eps, tiny)", "count", mismatches, 0)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-4  # gradient-sized
    e4m3 = torch.float8_e4m3fn
    u = torch.finfo(e4m3).eps / 2
    raw = formats.fp8_roundtrip_error(x, e4m3, per_tensor_scale=False)
    scaled = formats.fp8_roundtrip_error(x, e4m3, per_tensor_scale=True)
    rec.figure("e4m3 round trip: zeros, unscaled", raw["zeros"])
    rec.figure("e4m3 round trip: mean rel. error, per-tensor scale", scaled["rel_error"],
               expected=formats.mean_rounding_error(e4m3))
    rec.figure("e4m3 round trip: elements in the normal range", scaled["in_range"])
    rec.check("e4m3 scaled: max rel. error in the normal range <= u", "formula",
              scaled["max_rel_in_range"], u, compare="<=")
    outlier = x.clone()
    outlier[0] = 1e5 * x.abs().max()  # amax/|x| > 448/2^-6 for almost every other element
    spoiled = formats.fp8_roundtrip_error(outlier, e4m3, per_tensor_scale=True)
    rec.figure("e4m3 with a 1e5x outlier: elements in the normal range", spoiled["in_range"])
    rec.check("e4m3 with a 1e5x outlier: the others exceed u", "formula",
              spoiled["max_rel_out_of_range"], u, compare=">")
    ref = formats.underflow_grads(1.0, device, half=False)
    plain = formats.underflow_grads(1.0, device)
    scaled_g = formats.underflow_grads(2.0**16, device)
    rec.check("fp16 grads flushed to zero, no loss scaling", "count",
              int((plain == 0).sum()), ref.numel())
    rec.check("fp16 grads flushed to zero, loss scale 2^16", "count", int((scaled_g == 0).sum()), 0)
    rec.check("scaled fp16 grad == fp32 grad (rel. norm)", "parity",
              ((scaled_g - ref).norm() / ref.norm()).item(), 0.0, 5e-3)


def record_updates(rec: RunRecorder, name: str, counts: dict) -> dict:
    """Lost updates, measured and predicted by the rounding rule, over every rank; the check
    compares them element by element, outside the band where the kernel's rounding decides."""
    total = {k: reduce_number(v, "sum") for k, v in counts.items()}
    moved = max(total["moved"], 1)
    rec.figure(f"updates lost, {name}", total["lost"] / moved,
               expected=total["predicted"] / moved)
    rec.figure(f"updates near the threshold (2^-7), {name}", total["undecided"] / moved)
    rec.check(f"rounding rule wrong (outside the band), {name}", "count",
              total["mismatched"], 0)
    return total


def record_rule_control(rec: RunRecorder, total: dict) -> None:
    """The same element-by-element count, for a rule with the whole spacing as threshold."""
    rec.check("control: whole spacing as threshold is wrong (bf16 weights)", "count",
              total["mismatched_broken"], 0, compare=">")


def record_scalers(rec: RunRecorder, model, X, Y, cfg, device: torch.device) -> None:
    """The hand-written dynamic scaler against GradScaler, decision by decision, on the first
    TRACE_STEPS steps of the data with overflows injected."""
    inf_steps = {5, 6, 12}  # injected overflows: both scalers must back off and skip there
    hand_scaler = DynamicLossScaler(cfg.init_scale, growth_interval=TRACE_GROWTH_INTERVAL)
    torch_scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_scale,
                                        growth_interval=TRACE_GROWTH_INTERVAL)
    hand = scaler_trace(model, X[:TRACE_STEPS], Y[:TRACE_STEPS], hand_scaler, inf_steps)
    ref = scaler_trace(model, X[:TRACE_STEPS], Y[:TRACE_STEPS], torch_scaler, inf_steps)
    rec.check("hand scaler == GradScaler: scale at every step", "count",
              sum(a != b for a, b in zip(hand["scales"], ref["scales"])), 0)
    rec.check("hand scaler == GradScaler: skipped steps", "count", hand["skipped"], ref["skipped"])
    rec.figure("skipped steps (injected inf at 5, 6, 12)", hand["skipped"], table=False)  # its check shows it


def record_ddp(rec: RunRecorder, cfg, runs: dict, n_params: int) -> None:
    """Each low precision against fp32: forward really in the low dtype, the loss curve within
    LOSS_TOL, the all-reduce's dtype and bytes read off the wire."""
    fp32 = runs["fp32"]
    for p in cfg.precision:
        run, u = runs[p], torch.finfo(LOW[p]).eps / 2
        rec.check(f"DDP {p}: forward in {p} (step-0 output gap to fp32 >= u/10)", "parity",
                  output_gap(run, fp32), u / 10, compare=">=")
        rec.check(f"DDP {p} loss curve == fp32 (max rel. gap)", "parity",
                  curve_gap(run["losses"], fp32["losses"]), 0.0, LOSS_TOL[p])
        rec.check(f"DDP {p}: all-reduce dtype", "count", short(run["dtypes"]), p)
        rec.check(f"DDP {p}: bytes all-reduced = steps x params x {LOW[p].itemsize}",
                  "formula", sum(run["sent"]), cfg.steps * n_params * LOW[p].itemsize)
        rec.figure(f"final loss {p}", run["losses"][-1])
        if p == "fp16":
            rec.figure("DDP fp16 skipped steps", run["skipped"])
    rec.check("DDP fp32: all-reduce dtype", "count", short(fp32["dtypes"]), "fp32")
    rec.check("DDP fp32: bytes all-reduced = steps x params x 4", "formula",
              sum(fp32["sent"]), cfg.steps * n_params * 4)
    rec.figure("final loss fp32", fp32["losses"][-1])
    rec.figure("loss fp32, first and last step", [round(fp32["losses"][0], 4),
                                                   round(fp32["losses"][-1], 4)])


def record_master_weights(rec: RunRecorder, cfg, runs: dict, pure: dict | None) -> None:
    """fp32 master weights keep the updates that bf16 weights round away; `pure` is the control
    trained with bf16 weights and no master copy (None when bf16 is not among the precisions)."""
    low = cfg.precision[0]
    master = record_updates(rec, "fp32 master weights", runs[low]["updates"])
    rec.figure(f"updates that move the fp32 master but not its {low} copy",
               master["master_only"] / max(master["moved"], 1))
    if pure is not None:
        record_rule_control(rec, record_updates(rec, "bf16 weights (no master copy)",
                                                pure["updates"]))
        rec.check("control: bf16 weights without fp32 master copy rejected", "parity",
                  curve_gap(pure["losses"], runs["fp32"]["losses"]), LOSS_TOL["bf16"], compare=">")
        rec.figure("final loss bf16 weights (no master copy)", pure["losses"][-1])


def record_fsdp(rec: RunRecorder, cfg, world_size: int, fp32: dict, fsdp32: dict, fsdp16: dict,
                shapes) -> None:
    """FSDP2 against DDP fp32 and its bf16 policy against fp32 FSDP2; the dtypes at POLICY's
    places (the run without a policy is the control) and the bytes reduce-scattered."""
    rec.check("FSDP2 fp32 final loss == DDP fp32 (rel.)", "parity",
              rel(fsdp32["losses"][-1], fp32["losses"][-1]), 0.0, LOSS_TOL["fp32"])
    rec.check("FSDP2 bf16 policy final loss == fp32 (rel.)", "parity",
              rel(fsdp16["losses"][-1], fsdp32["losses"][-1]), 0.0, LOSS_TOL["bf16"])
    rec.figure("FSDP2 bf16 policy: dtypes (gather, weight, output, reduce, stored)",
               policy_text(fsdp16["dtypes"]),
               expected=policy_text({k: [v] for k, v in POLICY.items()}))
    rec.figure("FSDP2 without a policy: dtypes (same places)", policy_text(fsdp32["dtypes"]))
    rec.check("FSDP2 bf16 policy: places off the policy", "count",
              policy_mismatches(fsdp16["dtypes"], world_size), 0)
    rec.check("control: FSDP2 without its policy is rejected", "count",
              policy_mismatches(fsdp32["dtypes"], world_size), 0, compare=">")
    # On a world of one FSDP2 sends nothing (and says so: 0 bytes).
    rec.check("FSDP2 bf16 policy: bytes reduce-scattered = steps x padded x 4",
              "formula", sum(fsdp16["reduced"]), cfg.steps * 4
              * (padded_numel(shapes, world_size) if world_size > 1 else 0))
    timing_figure(rec, "FSDP2 bf16", fsdp16["step_ms"])
