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

import copy
import sys
from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from chapters.ch27_rlhf import checks, rl, sync
from chapters.ch27_rlhf.checks import RecomputeCheck, VerifyCost, verify
from chapters.ch27_rlhf.rollout import exchange, reward_model, rollouts, unpack
from chapters.ch27_rlhf.timeline import Timeline
from common.config import RunConfig, parse_config, require_at_least_one
from common.distributed import gather_numbers, setup_distributed, teardown_distributed
from common.log import log, progress, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything


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


def train(cfg: Config, info, rec: RunRecorder) -> None:
    """Set up the policy, its frozen reference, the reward model; broadcast the initial weights;
    then run the RL loop of the placement and report."""
    rank, world = info.rank, info.world_size
    where = placement(cfg, world)
    seed_everything(cfg.seed + rank)  # other ranks start from other weights: the broadcast fixes it
    model = rl.TinyDecoder(cfg.length, value_head=cfg.algo == "ppo").to(info.device)
    checks.check_initial_broadcast(rec, model, info)
    ref = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    rm = reward_model(rec, cfg, info, where)
    if where == "disaggregated":
        checks.check_sync_protocol(rec, cfg, model, info)
    run = (run_disaggregated if where == "disaggregated" else run_colocated)(
        cfg, info, rec, model, ref, opt, gen, rm)
    checks.report(rec, cfg, where, world, run)


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
        checks.check_examples(rec)
        train(cfg, info, rec)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
