"""RL fine-tuning of a tiny decoder with GRPO, written by hand, on generator and trainer ranks.

The task is verifiable: the prompt is a target T, the model writes three digits, the reward is
1 − |sum − T| / 27. The script first checks GAE, PPO's clipped objective and GRPO's advantages
against hand-worked examples. Then, disaggregated (the default on 2+ ranks), the generator
ranks sample groups of completions and rank 0 trains on them and pushes its weights back, in
full (broadcast) or as a delta (indices + values), verified bitwise after every push; a delta
that lost an element is rejected. With `--staleness k` the generators sample with weights k
updates old, as an asynchronous pipeline does; the importance ratio corrects for it. With
`--placement colocated` every rank generates and trains (gradients averaged). Last, a reward
model learns the same preferences from pairs (Bradley–Terry); `--algo ppo` trains with a value
head and GAE instead of groups.

Run:
    python chapters/ch27_rlhf/train.py                                        # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch27_rlhf/train.py      # 1 trainer, 1 generator
    torchrun --standalone --nproc_per_node=4 chapters/ch27_rlhf/train.py --sync full
    torchrun --standalone --nproc_per_node=2 chapters/ch27_rlhf/train.py --placement colocated
    torchrun --standalone --nproc_per_node=8 chapters/ch27_rlhf/train.py --steps 200   # 8 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch27_rlhf/train.py                                            # on each node
    srun --ntasks=8 --ntasks-per-node=8 --gpus-per-node=8 python chapters/ch27_rlhf/train.py
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from chapters.ch27_rlhf import rl, sync
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import gather_numbers, setup_distributed, teardown_distributed
from common.log import log, progress, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything

# float64 hand-worked examples: a handful of operations each, so a few ulps (1e-15) would do;
# 1e-12 leaves room for a libm's exp/log; a wrong formula misses by 0.05 or more (lesson).
EXAMPLE_TOLERANCE = 1e-12


@dataclass
class Config(RunConfig):
    steps: int = 60
    """GRPO (or PPO) updates of the policy."""
    algo: Literal["grpo", "ppo"] = "grpo"
    """grpo: group-relative advantages, no critic; ppo: a value head and GAE."""
    placement: Literal["auto", "disaggregated", "colocated"] = "auto"
    """disaggregated: rank 0 trains, the others generate; colocated: every rank does both;
    auto: disaggregated on 2+ ranks, colocated on one."""
    sync: Literal["delta", "full"] = "delta"
    """How the trainer pushes weights to the generators (disaggregated only)."""
    staleness: int = 1
    """Updates by which the generators' weights lag the trainer's (0: on-policy); disaggregated
    only, colocated runs are on-policy."""
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
    """Weight of the KL penalty to the frozen reference (the initial policy)."""
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


def verify(flat: torch.Tensor) -> bool:
    """Every rank's vector equals the trainer's bit for bit: the trainer broadcasts its vector and
    each rank compares the integer views, element by element (not the checksum `delta_sync`
    accepts with, so a checksum that missed a difference cannot also pass this check). All ranks
    agree on the answer. One process has nothing to compare: True."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    trainers = flat.clone()
    dist.broadcast(trainers, src=sync.TRAINER)
    same = torch.equal(sync.bits(trainers), sync.bits(flat))
    return all(gather_numbers(int(same)))


def rollouts(model, cfg: Config, gen: torch.Generator, version: int, device) -> torch.Tensor:
    """`prompts_per_rank` targets, each repeated group_size times, sampled from `model`; packed
    as float64 rows [target, digits, old log-probs, weights version] for the trip to the trainer."""
    targets = torch.randint(0, rl.MAX_TARGET + 1, (cfg.prompts_per_rank,), generator=gen)
    targets = targets.repeat_interleave(cfg.group_size).to(device)
    digits, logp = rl.sample(model, targets, gen)
    v = torch.full_like(targets, version)
    return torch.cat([targets[:, None], digits, logp, v[:, None]], dim=1).to(torch.float64)


def unpack(rows: torch.Tensor, cfg: Config) -> dict:
    L = cfg.length
    batch = {"targets": rows[:, 0].long(), "digits": rows[:, 1:1 + L].long(),
             "old_logp": rows[:, 1 + L:1 + 2 * L].float(), "version": rows[:, -1].long()}
    batch["rewards"] = rl.reward(batch["targets"], batch["digits"])
    return batch


def update(model, ref, opt, batch: dict, cfg: Config, average: bool) -> dict:
    """`inner_steps` optimizer steps on one batch; gradients averaged over ranks if colocated."""
    if cfg.algo == "grpo":
        batch["advantages"] = rl.grpo_advantages(batch["rewards"], cfg.group_size)
    for _ in range(cfg.inner_steps):
        if cfg.algo == "grpo":
            loss, extra = rl.grpo_loss(model, batch, cfg.clip, cfg.beta, ref)
        else:
            loss, extra = rl.ppo_loss(model, batch, cfg.clip, 1.0, 0.95, 0.5)
        opt.zero_grad()
        loss.backward()
        if average:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
    return {"loss": loss.item(), ("kl" if cfg.algo == "grpo" else "value_loss"): extra}


def train(cfg: Config, info, rec: RunRecorder) -> None:
    """The RL loop. Disaggregated: generators sample with the weights they were last pushed,
    rank 0 gathers the rollouts, trains, and pushes version t + 1 − staleness."""
    rank, world = info.rank, info.world_size
    where = placement(cfg, world)
    seed_everything(cfg.seed)
    model = rl.TinyDecoder(cfg.length, value_head=cfg.algo == "ppo").to(info.device)
    ref = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    if where == "disaggregated":
        check_sync_protocol(rec, cfg, model, info)
    flat = sync.flatten(model).to(info.device)  # generators: the weights they sample with
    history, version, stats = {0: flat.clone()}, 0, sync.SyncStats()
    rewards, stale, verified, pushes, accepted = [], [], 0, 0, 0
    for step in progress(range(cfg.steps), total=cfg.steps, desc="rl", enabled=info.is_main, every=20):
        generates = where == "colocated" or rank != sync.TRAINER
        if where == "colocated":
            version = step  # on-policy: sampled with the weights about to be trained
        mine = rollouts(model, cfg, gen, version, info.device) if generates else None
        if where == "colocated":
            batch = unpack(mine, cfg)
            out = update(model, ref, opt, batch, cfg, average=world > 1)
            verified += verify(sync.flatten(model).to(info.device))
            pushes += 1
        else:
            batch, out = exchange_and_train(model, ref, opt, mine, cfg, info)
            v = step + 1 - cfg.staleness
            if rank == sync.TRAINER:
                history[step + 1] = sync.flatten(model).to(info.device)
            if v >= 1:
                accepted += sync.push(flat, cfg.sync, stats, history.get(v))
                pushes += 1
                version = v
                if rank != sync.TRAINER:
                    sync.unflatten_into(model, flat)
                # the weights the generators will sample with (their model, not the received
                # vector) against the version the trainer pushed
                held = flat if rank == sync.TRAINER else sync.flatten(model).to(info.device)
                verified += verify(held)
            history = {k: h for k, h in history.items() if k >= step + 1 - cfg.staleness}
        mean_reward = sum(gather_numbers(batch["rewards"].mean().item() if batch else 0.0)[g]
                          for g in range(world)) / (world if where == "colocated" else 1)
        lag = max(gather_numbers(int((step - batch["version"]).max()) if batch else 0))
        rewards.append(mean_reward)
        stale.append(lag)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            rec.metrics(step, loss=out.get("loss", 0.0) if out else 0.0, lr=cfg.lr,
                        reward=mean_reward, staleness=lag)
    report(rec, cfg, where, world, rewards, stale, verified, pushes, stats, flat)
    if where == "disaggregated":  # a rejected push was repaired by a full one: still a failure
        rec.check("pushes accepted at the first attempt (no repair needed)", "count",
                  f"{accepted}/{pushes}", f"{pushes}/{pushes}")


def exchange_and_train(model, ref, opt, mine, cfg: Config, info) -> tuple:
    """Generators send their rollouts to the trainer (a gather); the trainer trains on all."""
    rows = cfg.prompts_per_rank * cfg.group_size
    send = mine if mine is not None else torch.zeros(rows, 2 + 2 * cfg.length, dtype=torch.float64,
                                                      device=info.device)
    parts = [torch.empty_like(send) for _ in range(info.world_size)] if info.is_main else None
    dist.gather(send, parts, dst=sync.TRAINER)
    if info.rank != sync.TRAINER:
        return None, None
    batch = unpack(torch.cat(parts[1:]), cfg)
    return batch, update(model, ref, opt, batch, cfg, average=False)


def report(rec, cfg, where, world, rewards, stale, verified, pushes, stats, flat) -> None:
    """Reward rise, staleness against its bound, every push verified, bytes per push."""
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    rec.figure("mean reward, first 5 steps", round(first, 4),
               expected=round(uniform_policy_reward(cfg.length), 4))
    rec.check(f"mean reward rises: last 5 − first 5 >= {cfg.margin}", "count",
              round(last - first, 4), cfg.margin, compare=">=")
    bound = cfg.staleness if where == "disaggregated" else 0
    rec.check("max staleness (updates) == the bound", "count", max(stale), bound)
    expected_lag = [min(t, bound) for t in range(cfg.steps)]
    rec.check("staleness at every step == min(step, bound)", "count",
              sum(a != b for a, b in zip(stale, expected_lag)), 0)
    expected_pushes = cfg.steps - bound if where == "disaggregated" else cfg.steps
    if world > 1:
        rec.check("weights equal the trainer's (bitwise) after every sync", "count",
                  f"{verified}/{pushes}", f"{expected_pushes}/{expected_pushes}")
    else:  # one process compares its weights with themselves: not a check
        rec.figure("weights equal the trainer's (bitwise) after every sync", "n/a: one process")
    if where == "disaggregated":
        full = len(flat) * flat.element_size()
        per_push = (stats.full_bytes + stats.delta_bytes) / max(pushes, 1)
        rec.figure(f"bytes per {cfg.sync} push in training", round(per_push),
                   expected=full if cfg.sync == "full" else None, unit="B")
        if stats.changed:
            rec.figure("elements changed per update (of N)", f"{sum(stats.changed) / len(stats.changed):.0f}"
                       f" / {len(flat)}")
    rec.figure("placement", f"{where}, W={world}")


def check_reward_model(rec: RunRecorder, cfg: Config) -> None:
    """Bradley–Terry on preference pairs labelled by the verifiable reward: ranking accuracy."""
    if not cfg.rm_steps:
        return
    _, accuracy = rl.train_reward_model(cfg.rm_steps, cfg.length, cfg.seed)
    rec.check("reward model ranks held-out pairs (accuracy) >= 0.8", "count", round(accuracy, 4),
              0.8, compare=">=")


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        where = placement(cfg, info.world_size)
        log.info("%s on %d rank(s), %s/%s, %s: %d prompts x %d completions per generating rank, "
                 "%s sync, staleness %d", cfg.algo.upper(), info.world_size, info.device,
                 info.backend, where, cfg.prompts_per_rank, cfg.group_size, cfg.sync, cfg.staleness)
        check_examples(rec)
        train(cfg, info, rec)
        check_reward_model(rec, cfg)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
