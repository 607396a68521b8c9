"""The proofs chapter 27's run records, beside the RL loop in `train.py`: GAE, the clipped
objective, GRPO's advantages and PPO's KL-penalised rewards on hand-worked numbers; the initial
broadcast with its before-broadcast control; the push protocol (bytes against the formulas, a
delta missing an element rejected); `verify`, the bitwise comparison of every rank's weights
with the trainer's after each push; `RecomputeCheck`, the trainer's proof of each rollout's
version; and `report`, which turns a run's records into checks and figures (the timeline's
counts are in `timeline.py`).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from chapters.ch27_rlhf import rl, sync
from chapters.ch27_rlhf.timeline import timeline_report
from common.distributed import all_gather_single
from common.results import RunRecorder

# float64 hand-worked examples: a handful of operations each, so a few ulps (1e-15) would do;
# 1e-12 leaves room for a libm's exp/log; a wrong formula misses by 0.05 or more (lesson).
EXAMPLE_TOLERANCE = 1e-12
# A generator's log-probs (`rl.sample`: softmax then log, one forward per prefix) and the
# trainer's recomputation under the same weights (`rl.token_logprobs`: log_softmax, one forward
# over the whole completion) are one float32 function evaluated with other shapes and kernels:
# ~1e-6 apart on this CPU; 1e-4 leaves room for other kernels (a GPU's). Neighbouring versions
# are one update apart, `inner_steps` Adam steps (2 by default, lr 3e-3): they move the log-probs
# by 1e-2 or more, so the mislabelled control must exceed 1e-3.
RECOMPUTE_TOLERANCE = 1e-4
MISLABEL_FLOOR = 1e-3


def check_examples(rec: RunRecorder) -> None:
    """GAE, the clipped objective and GRPO's advantages on numbers worked by hand (lesson)."""
    f64 = torch.float64
    adv, _ = rl.gae(torch.tensor([[0.0, 0.0, 1.0]], dtype=f64),
                    torch.tensor([[0.5, 0.6, 0.8]], dtype=f64), gamma=1.0, lam=0.9)
    hand = torch.tensor([0.442, 0.38, 0.2], dtype=f64)
    rec.check("GAE, γ=1 λ=0.9 == [0.442, 0.38, 0.2]", "parity",
              (adv[0] - hand).abs().max().item(), 0.0, tolerance=EXAMPLE_TOLERANCE)
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5], dtype=f64)
    obj = rl.clipped_objective(ratio.log(), torch.zeros(4, dtype=f64),
                               torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=f64), eps=0.2)
    hand = torch.tensor([1.2, 0.5, -1.5, -0.8], dtype=f64)
    rec.check("clipped objective, ε=0.2 == [1.2, 0.5, -1.5, -0.8]", "parity",
              (obj - hand).abs().max().item(), 0.0, tolerance=EXAMPLE_TOLERANCE)
    a = rl.grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.2, 0.2, 0.2], dtype=f64), 4)
    s = 0.5 / (3 ** -0.5 + 1e-6)  # mean 0.5, sample std sqrt(1/3): about √3/2
    hand = torch.tensor([s, -s, -s, s, 0, 0, 0, 0], dtype=f64)
    rec.check("GRPO advantages == (r − mean)/(std + 1e-6)", "parity",
              (a - hand).abs().max().item(), 0.0, tolerance=EXAMPLE_TOLERANCE)
    # PPO's per-token reward with the KL penalty: score 1 on the last token, β = 0.1,
    # log π_old − log π_ref = (0.5, −0.2, 0.1): r = (−0.05, 0.02, −0.01 + 1)
    r = rl.kl_penalty_rewards(torch.tensor([1.0], dtype=f64), torch.tensor([[0.5, -0.2, 0.1]], dtype=f64),
                              torch.zeros(1, 3, dtype=f64), beta=0.1)
    hand = torch.tensor([-0.05, 0.02, 0.99], dtype=f64)
    rec.check("KL-penalised rewards, β=0.1 == [-0.05, 0.02, 0.99]", "parity",
              (r[0] - hand).abs().max().item(), 0.0, tolerance=EXAMPLE_TOLERANCE)


def uniform_policy_reward(length: int) -> float:
    """The expected reward of a policy that writes uniform random digits: the starting level."""
    sums = torch.ones(1, dtype=torch.float64)
    for _ in range(length):  # distribution of the sum of `length` uniform digits
        new = torch.zeros(len(sums) + 9, dtype=torch.float64)
        for k in range(10):
            new[k:k + len(sums)] += sums / 10
        sums = new
    s, t = torch.arange(len(sums), dtype=torch.float64), torch.arange(rl.MAX_TARGET + 1.0)
    r = 1 - (s[None] - t[:, None]).abs() / rl.MAX_TARGET
    return (r * sums[None]).sum(1).mean().item()


def check_initial_broadcast(rec: RunRecorder, model, info) -> None:
    """The trainer's initial weights reach every rank by a broadcast, verified bitwise; before it,
    ranks initialised with their own seeds differ (the control: the check can see a difference)."""
    if info.world_size == 1:
        rec.figure("initial weights broadcast to the other ranks", "n/a: one process")
        return
    flat = sync.flatten(model).to(info.device)
    differ_before = not verify(flat)
    stats = sync.SyncStats()
    sync.push(flat, "full", stats, flat)  # the trainer's vector, broadcast into every rank's
    sync.unflatten_into(model, flat)
    equal_after = verify(sync.flatten(model).to(info.device))
    rec.figure("initial broadcast: bytes", stats.full_bytes, expected=4 * flat.numel(), unit="B")
    rec.check("initial weights: every rank == the trainer's after the broadcast (bitwise)",
              "count", int(equal_after), 1)
    rec.check("control: before the broadcast the ranks' own initial weights differ", "count",
              int(differ_before), 1)


def check_sync_protocol(rec: RunRecorder, cfg, model, info) -> None:
    """Full and delta pushes of a model whose trainer changed only `sparse_changes` elements:
    bytes counted against the formulas, bitwise equality after each, and a delta with one
    element missing rejected (then repaired by a full push)."""
    flat = sync.flatten(model).to(info.device)
    stats = sync.SyncStats()
    new = flat.clone()
    if info.rank == sync.TRAINER:
        which = torch.randperm(len(flat), generator=torch.Generator().manual_seed(cfg.seed))
        new[which[:cfg.sparse_changes].to(info.device)] += 1e-3
    sync.push(flat, "full", stats, new)
    equal_full = verify(flat)
    new2 = new.clone()
    if info.rank == sync.TRAINER:
        new2[:cfg.sparse_changes] -= 1e-3
    accepted = sync.push(flat, "delta", stats, new2)
    equal_delta = verify(flat)
    full_bytes = len(flat) * flat.element_size()
    rec.check("full push: bytes broadcast = N x 4", "count", stats.full_bytes, full_bytes)
    rec.check(f"delta push, {cfg.sparse_changes} changed: bytes = 16 + 12 x changed", "count",
              stats.delta_bytes, sync.delta_bytes_formula(cfg.sparse_changes, flat))
    rec.figure("delta / full bytes, few changed", round(stats.delta_bytes / full_bytes, 4),
               expected=round(sync.delta_bytes_formula(cfg.sparse_changes, flat) / full_bytes, 4))
    rec.check("full and delta push: every generator == trainer (bitwise)", "count",
              int(equal_full and equal_delta and accepted), 1)
    bad = new2.clone()
    if info.rank == sync.TRAINER:
        bad[-3:] += 1e-3
    accepted = sync.push(flat, "delta", stats, bad, drop=1)
    rec.check("delta missing one element: rejected (control)", "count", int(not accepted), 1)
    rec.check("after the rejection, the full push repairs it (bitwise)", "count",
              int(verify(flat)), 1)


class VerifyCost:
    """Bytes `verify` hands to collectives: the course's check, not part of a weight sync."""

    def __init__(self):
        self.bytes, self.calls = 0, 0


def verify(flat: torch.Tensor, cost: VerifyCost | None = None) -> bool:
    """Every rank's vector equals the trainer's bit for bit: the trainer broadcasts its vector and
    each rank compares the integer views, element by element (not the checksum `delta_sync`
    accepts with, so a checksum that missed a difference cannot also pass this check). All ranks
    agree on the answer. It costs a full push (4N bytes) plus one int64 per rank, the tensors
    handed to the two collectives counted in `cost`. One process has nothing to compare: True."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    trainers = flat.clone()
    dist.broadcast(trainers, src=sync.TRAINER)
    same = torch.equal(sync.bits(trainers), sync.bits(flat))
    answers = torch.empty(dist.get_world_size(), dtype=torch.int64, device=flat.device)
    all_gather_single(answers, torch.tensor([int(same)], dtype=torch.int64, device=flat.device))
    if cost is not None:
        cost.bytes += trainers.numel() * trainers.element_size()
        cost.bytes += answers.numel() * answers.element_size()
        cost.calls += 1
    return bool(answers.all())


class RecomputeCheck:
    """The trainer's proof of staleness: each rollout's log-probs recomputed under the weights of
    the version it carries (they must match the generator's) and under a mislabelled version, one
    newer (or older where none is newer yet): they must not."""

    def __init__(self, model):
        self.probe = copy.deepcopy(model).requires_grad_(False)
        self.worst, self.control, self.controls = 0.0, float("inf"), 0

    def _diff(self, weights, batch, rows) -> float:
        sync.unflatten_into(self.probe, weights)
        logp, _ = rl.token_logprobs(self.probe, batch["targets"][rows], batch["digits"][rows])
        return (logp - batch["old_logp"][rows]).abs().max().item()

    @torch.no_grad()
    def __call__(self, batch: dict, history: dict, step: int) -> None:
        for v in batch["version"].unique().tolist():
            rows = batch["version"] == v
            self.worst = max(self.worst, self._diff(history[v], batch, rows))
            wrong = v + 1 if v + 1 <= step else v - 1
            if wrong in history:
                self.control = min(self.control, self._diff(history[wrong], batch, rows))
                self.controls += 1


def report(rec, cfg, where, world, run) -> None:
    """Reward rise, KL to the reference, staleness and its proof, every push verified, bytes."""
    rewards, stale = run["rewards"], run["stale"]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    rec.figure("mean reward, first 5 steps", round(first, 4),
               expected=round(uniform_policy_reward(cfg.length), 4))
    rec.check(f"mean reward rises: last 5 − first 5 >= {cfg.margin}", "count",
              round(last - first, 4), cfg.margin, compare=">=")
    tail = run["kl"][-10:]
    rec.figure("KL(π‖π_ref) per token, mean of the last 10 steps", round(sum(tail) / len(tail), 5))
    if run["kl_ctl"] is not None:
        rec.figure("β at the end (adaptive KL)", round(run["beta"], 5), expected=None)
    if cfg.reward == "model":
        sc = run["scores"]
        rec.figure("reward model's score: last 5 − first 5", round(sum(sc[-5:]) / 5 - sum(sc[:5]) / 5, 4))
    k = cfg.staleness if where == "disaggregated" else 0
    rec.check("max staleness (updates) == the bound", "count", max(stale), k)
    expected_lag = [min(t, k) for t in range(cfg.steps)]
    rec.check("staleness at every step == min(step, bound)", "count",
              sum(a != b for a, b in zip(stale, expected_lag)), 0)
    pushes = cfg.steps - 1 if where == "disaggregated" else cfg.steps
    if world > 1:
        rec.check("weights equal the trainer's (bitwise) after every sync", "count",
                  f"{run['verified']}/{run['pushes']}", f"{pushes}/{pushes}")
        cost = run["verify_cost"]
        rec.figure("verify's bytes per sync (a check, kept out of the sync bytes)",
                   round(cost.bytes / max(cost.calls, 1)), unit="B")
    else:  # one process compares its weights with themselves: not a check
        rec.figure("weights equal the trainer's (bitwise) after every sync", "n/a: one process")
    if where != "disaggregated":
        rec.figure("placement", f"{where}, W={world}")
        return
    probe = run["recompute"]
    if probe is not None:
        rec.check("rollout log-probs recomputed under their version: max |Δ|", "parity",
                  probe.worst, 0.0, tolerance=RECOMPUTE_TOLERANCE)
        rec.check(f"control: under a mislabelled version, min over steps of max |Δ| >= "
                  f"{MISLABEL_FLOOR}", "count", round(probe.control, 6), MISLABEL_FLOOR, compare=">=")
        rec.check("mislabelled-version controls run (every step but the first)", "count",
                  probe.controls, cfg.steps - 1)
    timeline_report(rec, cfg, run["timeline"])
    stats, flat = run["stats"], run["flat"]
    full = len(flat) * flat.element_size()
    per_push = (stats.full_bytes + stats.delta_bytes) / max(run["pushes"], 1)
    rec.figure(f"bytes per {cfg.sync} push in training", round(per_push),
               expected=full if cfg.sync == "full" else None, unit="B")
    if stats.changed:
        rec.figure("elements changed per update (of N)", f"{sum(stats.changed) / len(stats.changed):.0f}"
                   f" / {len(flat)}")
    rec.figure("placement", f"{where}, W={world}")
    # a rejected push was repaired by a full one: still a failure
    rec.check("pushes accepted at the first attempt (no repair needed)", "count",
              f"{run['accepted']}/{run['pushes']}", f"{pushes}/{pushes}")
