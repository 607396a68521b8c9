"""RL fine-tuning of a tiny decoder with GRPO or PPO, written by hand, on generator and trainer
ranks that run at the same time.

The task is verifiable: the prompt is a target T, the model writes three digits, the reward is
1 − |sum − T| / 27 (or, with `--reward model`, the score of a Bradley–Terry reward model trained
first on preference pairs). The script first checks GAE, PPO's clipped objective and GRPO's
advantages against hand-worked examples. Then, disaggregated (the default on 2+ ranks), the
trainer (rank 0) broadcasts its initial weights to the generator ranks and verifies them; the
generators sample groups of completions, rank 0 trains on them and pushes its weights back, in
full (broadcast) or as a delta (indices + values), verified bitwise after every push. With
`--staleness k` the generators run k batches ahead: they sample the batch of step t + k while the
trainer trains on step t (k = 1: one step off-policy, as asynchronous RL systems run; k = 0:
lock-step). Every rank records a timeline of what it did; the trainer recomputes each rollout's
log-probabilities under the weights of the version the rollout carries, and under a mislabelled
version as the control. PPO (`--algo ppo`) puts −β·log(π_old/π_ref) on every token's reward and
computes values and GAE advantages once per rollout batch; GRPO adds β·KL to its loss. With
`--placement colocated` every rank generates and trains (gradients averaged).

Run:
    python chapters/ch27_rlhf/train.py                                        # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch27_rlhf/train.py      # 1 trainer, 1 generator
    torchrun --standalone --nproc_per_node=4 chapters/ch27_rlhf/train.py --sync full
    torchrun --standalone --nproc_per_node=2 chapters/ch27_rlhf/train.py --placement colocated
    torchrun --standalone --nproc_per_node=3 chapters/ch27_rlhf/train.py --algo ppo --reward model
    torchrun --standalone --nproc_per_node=8 chapters/ch27_rlhf/train.py --steps 200   # 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch27_rlhf/train.py                                            # on each node
    srun --ntasks=8 --ntasks-per-node=8 --gpus-per-node=8 python chapters/ch27_rlhf/train.py
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from chapters.ch27_rlhf import rl, sync
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import (
    all_gather_single,
    broadcast_from_rank0,
    gather_numbers,
    setup_distributed,
    teardown_distributed,
)
from common.log import log, progress, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything
from common.timing import synchronize

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


@dataclass
class Config(RunConfig):
    steps: int = 60
    """GRPO (or PPO) updates of the policy."""
    algo: Literal["grpo", "ppo"] = "grpo"
    """grpo: group-relative advantages, no critic; ppo: a value head, GAE and the KL penalty in
    the per-token reward."""
    reward: Literal["verifiable", "model"] = "verifiable"
    """What drives RL: the program's reward, or a Bradley–Terry reward model trained first on
    preference pairs (the program's reward is still what the reward-rise check measures)."""
    placement: Literal["auto", "disaggregated", "colocated"] = "auto"
    """disaggregated: rank 0 trains, the others generate; colocated: every rank does both;
    auto: disaggregated on 2+ ranks, colocated on one."""
    sync: Literal["delta", "full"] = "delta"
    """How the trainer pushes weights to the generators (disaggregated only)."""
    staleness: int = 1
    """Batches the generators run ahead (disaggregated only): the batch trained at step t was
    sampled with weights version max(0, t − k). 0: lock-step (generators wait for each push);
    1: generation of step t + 1 runs while the trainer trains on step t."""
    prompts_per_rank: int = 16
    """Prompts each generating rank samples per step."""
    group_size: int = 8
    """Completions per prompt (GRPO's group G; PPO uses them as independent samples)."""
    length: int = 3
    """Digits per completion."""
    lr: float = 3e-3
    """Learning rate of Adam."""
    inner_steps: int = 2
    """Optimizer steps on each batch of rollouts (the second one is off-policy: clipping acts)."""
    clip: float = 0.2
    """PPO/GRPO clip range ε."""
    beta: float = 0.02
    """Weight β of the KL penalty to the frozen reference (the initial policy): GRPO adds β·k3 to
    its loss, PPO puts −β·log(π_old/π_ref) on every token's reward. 0 turns it off."""
    kl_target: float = 0.0
    """Adaptive KL (Ziegler et al.): steer β so that the measured KL per token nears this value;
    0 keeps β fixed."""
    gamma: float = 1.0
    """PPO's discount γ in GAE."""
    lam: float = 0.95
    """PPO's GAE λ (1: Monte-Carlo returns minus values; 0: one-step TD errors)."""
    whiten: bool = True
    """PPO: whiten the advantages of each rollout batch (mean 0, std 1)."""
    vf_coef: float = 0.5
    """PPO: weight of the value loss."""
    margin: float = 0.1
    """The mean reward of the last 5 steps must beat that of the first 5 by this much."""
    sparse_changes: int = 100
    """Elements the sync demonstration changes before a delta push (few, on purpose)."""
    rm_steps: int = 150
    """Steps of reward-model training on preference pairs (0 skips it)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "prompts_per_rank", "group_size", "length", "inner_steps",
                             "sparse_changes")
        if self.group_size < 2 and self.algo == "grpo":
            raise ValueError("GRPO needs --group-size of at least 2 (a group's std)")
        if self.staleness < 0 or self.staleness >= self.steps:
            raise ValueError(f"--staleness must be in [0, --steps), got {self.staleness}")
        if self.lr <= 0 or not 0 < self.clip < 1:
            raise ValueError("--lr must be positive and --clip in (0, 1)")
        if self.beta < 0 or self.kl_target < 0 or not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError("--beta and --kl-target must be >= 0, --gamma and --lam in [0, 1]")
        if self.reward == "model" and self.rm_steps < 1:
            raise ValueError("--reward model needs --rm-steps of at least 1 (the model to train)")


def validate(cfg: Config, world_size: int) -> None:
    """Disaggregation needs a generator besides the trainer."""
    if cfg.placement == "disaggregated" and world_size < 2:
        raise ValueError("--placement disaggregated needs at least 2 ranks (a trainer and a "
                         "generator); use torchrun --nproc_per_node=2 or --placement colocated")


def placement(cfg: Config, world: int) -> str:
    return cfg.placement if cfg.placement != "auto" else ("disaggregated" if world > 1 else "colocated")


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


def check_sync_protocol(rec: RunRecorder, cfg: Config, model, info) -> None:
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


class Timeline:
    """What this rank did and when: (what, index, start, end) with start and end read from
    `time.time()` after a device synchronisation (one clock for every process of a machine;
    across nodes as close as their NTP sync). The intervals are counted, not drawn only."""

    def __init__(self, device):
        self.device, self.events = device, []

    @contextlib.contextmanager
    def span(self, what: str, index: int):
        synchronize(self.device)
        t0 = time.time()
        yield
        synchronize(self.device)
        self.events.append((what, index, t0, time.time()))


def rollouts(model, cfg: Config, gen: torch.Generator, version: int, device) -> torch.Tensor:
    """`prompts_per_rank` targets, each repeated group_size times, sampled from `model`; packed
    as float64 rows [target, digits, old log-probs, weights version] for the trip to the trainer."""
    targets = torch.randint(0, rl.MAX_TARGET + 1, (cfg.prompts_per_rank,), generator=gen)
    targets = targets.repeat_interleave(cfg.group_size).to(device)
    digits, logp = rl.sample(model, targets, gen)
    v = torch.full_like(targets, version)
    return torch.cat([targets[:, None], digits, logp, v[:, None]], dim=1).to(torch.float64)


def unpack(rows: torch.Tensor, cfg: Config, rm=None) -> dict:
    """Rows back to a batch; `rewards` is the program's reward (what the lesson measures),
    `scores` what drives RL (the same, or the reward model's score)."""
    L = cfg.length
    batch = {"targets": rows[:, 0].long(), "digits": rows[:, 1:1 + L].long(),
             "old_logp": rows[:, 1 + L:1 + 2 * L].float(), "version": rows[:, -1].long()}
    batch["rewards"] = rl.reward(batch["targets"], batch["digits"])
    if rm is None:
        batch["scores"] = batch["rewards"]
    else:
        with torch.no_grad():
            batch["scores"] = rm(batch["targets"], batch["digits"]).float()
    return batch


def update(model, ref, opt, batch: dict, cfg: Config, average: bool, beta: float) -> dict:
    """`inner_steps` optimizer steps on one batch; gradients averaged over ranks if colocated.
    PPO's advantages, returns and the KL-penalised rewards are computed once, here, from the
    policy that sampled (old log-probs) and the critic as it is before these steps."""
    if cfg.algo == "grpo":
        batch["advantages"] = rl.grpo_advantages(batch["scores"], cfg.group_size)
    else:
        batch.update(rl.ppo_batch(model, ref, batch, beta, cfg.gamma, cfg.lam, cfg.whiten))
    for _ in range(cfg.inner_steps):
        if cfg.algo == "grpo":
            loss, extra = rl.grpo_loss(model, batch, cfg.clip, beta, ref)
        else:
            loss, extra = rl.ppo_loss(model, batch, cfg.clip, cfg.vf_coef)
        opt.zero_grad()
        loss.backward()
        if average:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
    return {"loss": loss.item(), ("kl_loss" if cfg.algo == "grpo" else "value_loss"): extra}


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


def train(cfg: Config, info, rec: RunRecorder) -> None:
    """Set up the policy, its frozen reference, the reward model; broadcast the initial weights;
    then run the RL loop of the placement and report."""
    rank, world = info.rank, info.world_size
    where = placement(cfg, world)
    seed_everything(cfg.seed + rank)  # other ranks start from other weights: the broadcast fixes it
    model = rl.TinyDecoder(cfg.length, value_head=cfg.algo == "ppo").to(info.device)
    check_initial_broadcast(rec, model, info)
    ref = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    rm = reward_model(rec, cfg, info, where)
    if where == "disaggregated":
        check_sync_protocol(rec, cfg, model, info)
    run = (run_disaggregated if where == "disaggregated" else run_colocated)(
        cfg, info, rec, model, ref, opt, gen, rm)
    report(rec, cfg, where, world, run)


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


def reward_model(rec: RunRecorder, cfg: Config, info, where: str):
    """Bradley–Terry on preference pairs labelled by the verifiable reward, trained on rank 0 and
    checked by its ranking accuracy; returned where it scores rollouts (`--reward model`): on the
    trainer, and on every rank when colocated (broadcast from rank 0)."""
    if not cfg.rm_steps:
        return None
    if info.rank == 0:
        rm, accuracy = rl.train_reward_model(cfg.rm_steps, cfg.length, cfg.seed)
        rec.check("reward model ranks held-out pairs (accuracy) >= 0.8", "count", round(accuracy, 4),
                  0.8, compare=">=")
    else:
        rm = rl.RewardModel(cfg.length)
    if cfg.reward != "model":
        return None
    rm = rm.to(info.device).requires_grad_(False)
    if where == "colocated" and info.world_size > 1:
        broadcast_from_rank0(rm)
    return rm


def run_colocated(cfg, info, rec, model, ref, opt, gen, rm) -> dict:
    """Every rank samples with the weights it is about to train (on-policy), gradients averaged;
    after each update `verify` compares every rank's weights with rank 0's."""
    world = info.world_size
    run = new_run(cfg)
    for step in progress(range(cfg.steps), total=cfg.steps, desc="rl", enabled=info.is_main, every=20):
        batch = unpack(rollouts(model, cfg, gen, step, info.device), cfg, rm)
        # every rank's KL, averaged (as the gradients are): one β for all ranks under --kl-target
        kl = sum(gather_numbers(rl.kl_exact(model, ref, batch["targets"], batch["digits"]))) / world
        out = update(model, ref, opt, batch, cfg, average=world > 1, beta=run["beta"])
        run["verified"] += verify(sync.flatten(model).to(info.device), run["verify_cost"])
        run["pushes"] += 1
        mean_reward = sum(gather_numbers(batch["rewards"].mean().item())) / world
        log_step(rec, cfg, run, step, out, batch, mean_reward, kl, lag=0)
    return run


def new_run(cfg: Config) -> dict:
    return {"rewards": [], "scores": [], "stale": [], "kl": [], "betas": [], "verified": 0,
            "pushes": 0, "accepted": 0, "stats": sync.SyncStats(), "verify_cost": VerifyCost(),
            "beta": cfg.beta, "kl_ctl": rl.AdaptiveKL(cfg.beta, cfg.kl_target) if cfg.kl_target else None,
            "timeline": None, "recompute": None, "n": 0}


def log_step(rec, cfg, run, step, out, batch, mean_reward, kl, lag) -> None:
    run["rewards"].append(mean_reward)
    run["stale"].append(lag)
    run["kl"].append(kl)
    run["betas"].append(run["beta"])
    if batch is not None:
        run["scores"].append(batch["scores"].mean().item())
    if run["kl_ctl"] is not None and batch is not None:
        run["beta"] = run["kl_ctl"].update(kl, len(batch["targets"]))
    if step % cfg.log_every == 0 or step == cfg.steps - 1:
        rec.metrics(step, loss=out.get("loss", 0.0) if out else 0.0, lr=cfg.lr,
                    reward=mean_reward, staleness=lag, kl=kl, beta=run["betas"][-1])


def run_disaggregated(cfg, info, rec, model, ref, opt, gen, rm) -> dict:
    """The asynchronous pipeline. Generators (ranks 1..W−1) first sample batches 0..k−1 (k =
    `staleness`, at least batch 0) with version 0, then at step t: send batch t (a gather to the
    trainer), sample batch t + k with the weights they hold (version t) while the trainer trains
    on batch t, receive version t + 1 (a push), and, in lock-step (k = 0) only, sample batch t + 1
    after it. The trainer: receive batch t, recompute its log-probs under the version it carries,
    train, push. Every rank records its timeline."""
    rank, k, T = info.rank, cfg.staleness, cfg.steps
    is_trainer = rank == sync.TRAINER
    run = new_run(cfg)
    tl = run["timeline"] = Timeline(info.device)
    flat = sync.flatten(model).to(info.device)  # generators: the weights they sample with
    history, version, queue = {0: flat.clone()}, 0, deque()
    probe = run["recompute"] = RecomputeCheck(model) if is_trainer else None

    def produce(b: int) -> None:
        with tl.span("generate", b):
            queue.append(rollouts(model, cfg, gen, version, info.device))

    if not is_trainer:
        for b in range(max(k, 1)):
            produce(b)
    for step in progress(range(T), total=T, desc="rl", enabled=info.is_main, every=20):
        with tl.span("gather", step):
            parts = exchange(queue.popleft() if queue else None, cfg, info)
        batch = out = kl = None
        if is_trainer:  # the trainer's step: score, check the versions, measure KL, update
            with tl.span("train", step):
                batch = unpack(torch.cat(parts[1:]), cfg, rm)
                probe(batch, history, step)
                kl = rl.kl_exact(model, ref, batch["targets"], batch["digits"])
                out = update(model, ref, opt, batch, cfg, average=False, beta=run["beta"])
                history[step + 1] = sync.flatten(model).to(info.device)
            history = {v: w for v, w in history.items() if v >= step - k}
        elif k >= 1 and step + k < T:
            produce(step + k)  # runs while the trainer trains on `step`
        if step + 1 < T:
            with tl.span("push", step + 1):
                run["accepted"] += sync.push(flat, cfg.sync, run["stats"], history.get(step + 1))
            run["pushes"] += 1
            version = step + 1
            if not is_trainer:
                sync.unflatten_into(model, flat)
            # the weights the generators will sample with (their model, not the received
            # vector) against the version the trainer pushed
            held = flat if is_trainer else sync.flatten(model).to(info.device)
            run["verified"] += verify(held, run["verify_cost"])
            if not is_trainer and k == 0:
                produce(step + 1)
        lag = max(gather_numbers(int((step - batch["version"]).max()) if batch else 0))
        mean_reward = gather_numbers(batch["rewards"].mean().item() if batch else 0.0)[sync.TRAINER]
        log_step(rec, cfg, run, step, out, batch, mean_reward, kl if kl is not None else 0.0, lag)
    run["flat"] = flat
    return run


def exchange(mine, cfg: Config, info) -> list | None:
    """Generators send their rollouts to the trainer (a gather); the trainer receives them all."""
    rows = cfg.prompts_per_rank * cfg.group_size
    send = mine if mine is not None else torch.zeros(rows, 2 + 2 * cfg.length, dtype=torch.float64,
                                                      device=info.device)
    parts = [torch.empty_like(send) for _ in range(info.world_size)] if info.is_main else None
    dist.gather(send, parts, dst=sync.TRAINER)
    return parts


def overlap(a: tuple, b: tuple) -> float:
    """Seconds two (start, end) intervals share."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def timeline_report(rec: RunRecorder, cfg: Config, timeline: Timeline) -> None:
    """Gather every rank's events and count, per generator, the generations of batch t + k that
    ran (a) between the collectives that open and close the trainer's step t (gather t, push
    t + 1), in the order the generator's own log shows — a schedule check: T − k per generator
    for k >= 1, none in lock-step; it cannot show concurrency (a trainer that waited for the
    generation after the gather keeps it) — and (b) overlapping training t on the wall clock, the
    concurrency check: at least one for k >= 1 (fatal; all G (T − k) on a quiet machine, fewer
    when the OS runs the two processes in turn), none in lock-step (guaranteed: the generation
    ends before the gather that starts the training step)."""
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, timeline.events)
    k, T = cfg.staleness, cfg.steps
    train = {i: (s, e) for what, i, s, e in ranks[sync.TRAINER] if what == "train"}
    between = by_clock = 0
    shared = 0.0
    for events in ranks[1:]:
        order = [(what, i) for what, i, _, _ in events]
        for pos, (what, i, s, e) in enumerate(events):
            t = i - k  # the training step this generation can run beside
            if what != "generate" or t < 0 or t not in train:
                continue
            before = order.index(("gather", t)) if ("gather", t) in order else len(order)
            after = order.index(("push", t + 1)) if ("push", t + 1) in order else len(order)
            between += before < pos < after
            shared += overlap((s, e), train[t])
            by_clock += overlap((s, e), train[t]) > 0
    gens = len(ranks) - 1
    expected = gens * (T - k) if k >= 1 else 0
    rec.check(f"schedule: generations of batch t+{k} between gather t and push t+1", "count",
              between, expected)
    if k >= 1:
        rec.check(f"generations of batch t+{k} overlapping train t on the clock: at least one",
                  "count", by_clock, 1, compare=">=")
    else:
        rec.check("lock-step: generations overlapping a training step on the clock", "count",
                  by_clock, 0)
    rec.figure(f"generations of batch t+{k} overlapping train t on the clock", by_clock,
               expected=expected)
    span = max(e for evs in ranks for *_, e in evs) - min(s for evs in ranks for _, _, s, _ in evs)
    busy = sum(e - s for s, e in train.values())
    rec.figure("time generation overlapped training / training time", round(shared / max(busy, 1e-9)
                                                                            / gens, 3))
    rec.figure("RL loop wall time", round(span, 3), unit="s")
    if rec.is_main:
        t0 = min(s for evs in ranks for _, _, s, _ in evs)
        text = json.dumps({"staleness": k, "ranks": [[[w, i, round(s - t0, 6), round(e - t0, 6)]
                                                     for w, i, s, e in evs] for evs in ranks]})
        (rec.out / "timeline.json").write_text(text)


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


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        where = placement(cfg, info.world_size)
        log.info("%s on %d rank(s), %s/%s, %s: %d prompts x %d completions per generating rank, "
                 "%s reward, %s sync, staleness %d, β %g", cfg.algo.upper(), info.world_size,
                 info.device, info.backend, where, cfg.prompts_per_rank, cfg.group_size,
                 cfg.reward, cfg.sync, cfg.staleness, cfg.beta)
        check_examples(rec)
        train(cfg, info, rec)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
