"""The checks of chapter 16's run: the hand-written global norm against torch's and against one
unsharded process, the FSDP2 parameters against that process, the skipped and spiking steps
against the faults the configuration injected, and the bf16 accumulation table against its
bounds.

Expected values come from the configuration (which steps were poisoned, on which rank) and
from the one-process reference, never from the sharded run itself.
"""

from __future__ import annotations

import torch

from chapters.ch16_stability import precision
from common.distributed import gather_numbers
from common.results import RunRecorder


def record_training(rec: RunRecorder, cfg, world_size: int, run: dict, ref: dict, params: dict,
                    reference: torch.nn.Module, adam_steps: int) -> None:
    """The FSDP2 run (`run`, gathered `params`, the optimizer's `adam_steps`) against the
    one-process run (`ref`, `reference`) and the injected faults. Every rank must call it (it
    gathers which ranks saw each bad step)."""
    hand, ref_torch = torch.tensor(run["hand_norm"]), torch.tensor(ref["torch_norm"])
    # Relative differences: two float64 roots of sums of 4801 squares in different orders are
    # within ~6e-13 of each other even summed one by one (gamma_4800, see the lesson).
    rec.check("hand global norm == torch clip_grad_norm_ (max rel. diff)", "parity",
              ((hand - torch.tensor(run["torch_norm"])) / hand).abs().max().item(), 0.0, 1e-12)
    rec.check("sharded global norm == unsharded norm (max rel. diff)", "parity",
              ((hand - ref_torch) / ref_torch).abs().max().item(), 0.0, 1e-10)
    diff = max((params[k] - v.cpu()).abs().max().item() for k, v in reference.state_dict().items())
    rec.check("FSDP2 params == one process (max |dparam|)", "parity", diff, 0.0, 1e-10)
    expected_bad = sorted({s for s in (cfg.poison_step, cfg.grad_fault_step) if 0 <= s < cfg.steps})
    rec.check("poisoned steps skipped", "count", run["skipped_bad"], expected_bad)
    # Which ranks saw each bad step before agreeing: a NaN in a batch reaches every rank's
    # gradient shard through the reduce-scatter; an inf written after it only its own rank's.
    saw = {s: [r for r, flag in enumerate(gather_numbers(int(s in run["bad_here"]))) if flag]
           for s in expected_bad}
    if 0 <= cfg.grad_fault_step < cfg.steps:
        rec.check("ranks that saw the gradient-shard fault themselves", "count",
                  saw[cfg.grad_fault_step], [cfg.grad_fault_rank % world_size])
    rec.figure("ranks seeing each skipped step bad (own view)", [saw[s] for s in expected_bad])
    expected_spikes = [cfg.spike_step] if (cfg.spike_window <= cfg.spike_step < cfg.steps
                                           and cfg.spike_step not in expected_bad) else []
    rec.check("spikes detected", "count", run["spikes"], expected_spikes)
    rec.check("Adam steps taken = steps - skipped", "count", adam_steps,
              cfg.steps - len(expected_bad) - len(expected_spikes))
    rec.figure("global grad norm, first step (hand)", run["hand_norm"][0], ref["torch_norm"][0])
    rec.figure("final loss", run["loss"][-1])
    rec.figure("steps clipped (norm > max_norm)", sum(n > cfg.max_norm for n in run["hand_norm"]))
    rec.figure("skipped steps (non-finite)", len(run["skipped_bad"]), len(expected_bad))
    rec.figure("spikes detected", len(run["spikes"]), len(expected_spikes))


def record_accumulation(rec: RunRecorder, cfg) -> None:
    """The bf16 accumulation table beside Higham's bounds, checked where a bound says something
    (below 1), and the two stagnation points a broken sum would miss."""
    errors = precision.accumulation_errors(cfg.sum_terms, cfg.seed, show_progress=rec.is_main)
    for name, e in errors.items():
        bound = e["bound"] if e["bound"] < 1 else "none below 1"
        rec.figure(f"rel. error {name}", e["rel_error"], bound, table=e["bound"] >= 1)  # else: its check
        if e["bound"] < 1:
            rec.check(f"{name} error within bound", "formula", e["rel_error"], e["bound"], compare="<=")
    naive = errors["bf16 naive"]
    rec.check("bf16 running sum stagnates at 2^ceil(log2(256 max x))", "formula",
              naive["sum"], naive["stagnation"])
    # Kahan's bound is 2u + O(n u²); at n = 10⁵ in bf16 the second term exceeds 1 and the bound
    # says nothing. What compensation does achieve here (its carry keeps up with these terms) is
    # the first-order term 2u, which the sum without its carry misses by 100x; and where the
    # compensation itself stops, for a constant term.
    rec.check("bf16 Kahan error <= 2u (the bound's first-order term)", "formula",
              errors["bf16 Kahan"]["rel_error"], 2 * precision.U_BF16_OP, compare="<=")
    v = 2.0**-12
    rec.check("bf16 Kahan of 2^17 x 2^-12 stops at 2^16 v (naive: 2^8 v)", "formula",
              precision.kahan_sum([v] * 2**17), precision.kahan_stagnation_point(v))
    worst_fix = max(e["rel_error"] for name, e in errors.items() if name != "bf16 naive")
    rec.check("every fix cuts the bf16 error 100x", "formula", worst_fix,
              naive["rel_error"] / 100, compare="<")
