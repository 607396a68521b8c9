"""The pieces of RL fine-tuning, written out: the verifiable task, a tiny decoder, sampling and
log-probabilities, GAE, the clipped PPO objective, PPO's batch preparation (the per-token KL
penalty in the reward, values and advantages once per rollout batch, whitening), GRPO's
group-relative advantages, the KL to a frozen reference, and a Bradley–Terry reward model.

The task: the prompt is a target T in 0..27; the model writes `length` digits (0–9) and is
rewarded by how close their sum is to T: r = 1 − |sum − T| / 27, exact and cheap (no judge).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIGITS = 10
MAX_TARGET = 27  # three digits sum to at most 27


def reward(targets: torch.Tensor, digits: torch.Tensor) -> torch.Tensor:
    """The verifiable reward of each completion: 1 − |Σ digits − T| / 27, in [0, 1]."""
    return 1.0 - (digits.sum(dim=1) - targets).abs().to(torch.float32) / MAX_TARGET


class TinyDecoder(nn.Module):
    """A one-layer causal transformer over [target token, digit_1, ..., digit_L]: token id
    0..27 is a target, 28..37 the digits; it predicts the next digit at every position.
    `value_head=True` adds PPO's critic: one number per position."""

    def __init__(self, length: int = 3, dim: int = 32, value_head: bool = False):
        super().__init__()
        self.length = length
        self.embed = nn.Embedding(MAX_TARGET + 1 + DIGITS, dim)
        self.pos = nn.Parameter(torch.randn(length + 1, dim) * 0.02)
        self.block = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=2 * dim,
                                                dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, DIGITS)
        self.value = nn.Linear(dim, 1) if value_head else None

    def forward(self, tokens: torch.Tensor):
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=tokens.device), diagonal=1)
        h = self.block(self.embed(tokens) + self.pos[:n], src_mask=mask)
        values = self.value(h).squeeze(-1) if self.value is not None else None
        return self.head(h), values


def as_tokens(targets: torch.Tensor, digits: torch.Tensor) -> torch.Tensor:
    """[T, d_1, ..., d_k] as token ids (digits are shifted past the target ids)."""
    return torch.cat([targets[:, None], digits + MAX_TARGET + 1], dim=1)


@torch.no_grad()
def sample(model: TinyDecoder, targets: torch.Tensor, generator: torch.Generator) -> tuple:
    """Sample `length` digits per target, one at a time; return the digits and the sampling
    policy's log-probability of each (the "old" log-probs PPO and GRPO need)."""
    digits = torch.empty(len(targets), 0, dtype=torch.long, device=targets.device)
    logps = []
    for _ in range(model.length):
        logits, _ = model(as_tokens(targets, digits))
        probs = logits[:, -1].float().softmax(-1)
        d = torch.multinomial(probs.cpu(), 1, generator=generator).to(targets.device)
        logps.append(probs.gather(1, d).log())
        digits = torch.cat([digits, d], dim=1)
    return digits, torch.cat(logps, dim=1)


def token_logprobs(model: TinyDecoder, targets: torch.Tensor, digits: torch.Tensor):
    """Log-probability of each generated digit under `model` (with gradients), and the value
    estimate before each digit (None without a value head)."""
    logits, values = model(as_tokens(targets, digits[:, :-1]))
    logp = F.log_softmax(logits.float(), dim=-1).gather(2, digits[:, :, None]).squeeze(-1)
    return logp, (values if values is not None else None)


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al., 2016) over T steps per row:
    δ_t = r_t + γ V_{t+1} − V_t (V_T = 0: the episode ends), A_t = Σ_l (γλ)^l δ_{t+l};
    returns (advantages, returns = A + V), computed backwards."""
    T = rewards.shape[1]
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        adv[:, t] = running
    return adv, adv + values


def clipped_objective(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """PPO's clipped surrogate per token: min(ρ A, clip(ρ, 1−ε, 1+ε) A), ρ = π/π_old.
    To be maximised (its negative mean is the loss)."""
    ratio = (logp - old_logp).exp()
    return torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al., 2024): each prompt's G completions form a group, and a completion's
    advantage is its reward standardised within the group, (r − mean) / (std + ε); no critic.
    `rewards` holds the groups one after another."""
    r = rewards.view(-1, group_size)
    mean, std = r.mean(dim=1, keepdim=True), r.std(dim=1, keepdim=True)
    return ((r - mean) / (std + eps)).view(-1)


def kl_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The per-token KL estimate GRPO uses (Schulman's k3): exp(q − p) − (q − p) − 1 with
    p = log π, q = log π_ref; non-negative, zero where the policies agree."""
    d = ref_logp - logp
    return d.exp() - d - 1


def grpo_loss(model, batch: dict, eps: float, beta: float, ref_model=None) -> tuple:
    """GRPO's loss on a batch of completions: minus the clipped objective with each completion's
    group advantage on all its tokens, plus β·KL to the frozen reference; mean over tokens."""
    logp, _ = token_logprobs(model, batch["targets"], batch["digits"])
    adv = batch["advantages"][:, None].expand_as(logp)
    objective = clipped_objective(logp, batch["old_logp"], adv, eps)
    kl = torch.zeros_like(logp)
    if ref_model is not None and beta > 0:
        with torch.no_grad():
            ref_logp, _ = token_logprobs(ref_model, batch["targets"], batch["digits"])
        kl = kl_to_reference(logp, ref_logp)
    return (-objective + beta * kl).mean(), kl.mean().item()


def kl_penalty_rewards(scores: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
                       beta: float) -> torch.Tensor:
    """RLHF's per-token rewards (InstructGPT; OpenRLHF's `compute_reward`): every token pays
    −β·(log π_old − log π_ref), the sampled estimate of its KL to the frozen reference, and the
    last token also earns the completion's score."""
    rewards = -beta * (old_logp - ref_logp)
    rewards[:, -1] += scores
    return rewards


def whiten(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / (std + ε) over the whole batch (advantage whitening: the step size no longer
    depends on the reward's scale; OpenRLHF and TRL do the same before the PPO epochs)."""
    return (x - x.mean()) / (x.std() + eps)


@torch.no_grad()
def ppo_batch(model, ref_model, batch: dict, beta: float, gamma: float, lam: float,
              whiten_advantages: bool = True) -> dict:
    """Everything PPO needs from a rollout batch, computed ONCE, before the inner steps: the
    reference's log-probs, the critic's values V_old, the per-token rewards with the KL penalty,
    GAE advantages (whitened) and returns A + V_old (not whitened: the critic's target)."""
    ref_logp, _ = token_logprobs(ref_model, batch["targets"], batch["digits"])
    _, values = token_logprobs(model, batch["targets"], batch["digits"])
    rewards = kl_penalty_rewards(batch["scores"], batch["old_logp"], ref_logp, beta)
    adv, returns = gae(rewards, values, gamma, lam)
    return {"advantages": whiten(adv) if whiten_advantages else adv, "returns": returns,
            "values": values, "ref_logp": ref_logp, "token_rewards": rewards}


def ppo_loss(model, batch: dict, eps: float, vf_coef: float) -> tuple:
    """PPO with a value head on a batch `ppo_batch` prepared: loss = −clipped objective with the
    fixed advantages + c·(V − return)², mean over tokens. Only log π and V carry gradients."""
    logp, values = token_logprobs(model, batch["targets"], batch["digits"])
    objective = clipped_objective(logp, batch["old_logp"], batch["advantages"], eps)
    value_loss = ((values - batch["returns"]) ** 2).mean()
    return -objective.mean() + vf_coef * value_loss, value_loss.item()


@torch.no_grad()
def kl_exact(model, ref_model, targets: torch.Tensor, digits: torch.Tensor) -> float:
    """The measured KL(π‖π_ref) per token: at every position the rollouts visited, the exact
    KL of the next-digit distributions, Σ_a π(a|s)·(log π(a|s) − log π_ref(a|s)), averaged."""
    tokens = as_tokens(targets, digits[:, :-1])
    logp = F.log_softmax(model(tokens)[0].float(), dim=-1)
    ref = F.log_softmax(ref_model(tokens)[0].float(), dim=-1)
    return (logp.exp() * (logp - ref)).sum(-1).mean().item()


class AdaptiveKL:
    """Ziegler et al. (2019)'s controller, as in OpenRLHF and TRL: β ← β·(1 + e·n/horizon),
    e = clip(KL/target − 1, −0.2, 0.2), after each batch of n completions whose KL was measured."""

    def __init__(self, beta: float, target: float, horizon: int = 10_000):
        self.beta, self.target, self.horizon = beta, target, horizon

    def update(self, kl: float, n: int) -> float:
        error = min(max(kl / self.target - 1, -0.2), 0.2)
        self.beta *= 1 + error * n / self.horizon
        return self.beta


class RewardModel(nn.Module):
    """Scores a (target, digits) pair with one number; trained on preference pairs."""

    def __init__(self, length: int = 3, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(MAX_TARGET + 1 + DIGITS, dim)
        self.mlp = nn.Sequential(nn.Linear((length + 1) * dim, dim), nn.Tanh(), nn.Linear(dim, 1))

    def forward(self, targets, digits):
        return self.mlp(self.embed(as_tokens(targets, digits)).flatten(1)).squeeze(-1)


def bradley_terry_loss(score_chosen: torch.Tensor, score_rejected: torch.Tensor) -> torch.Tensor:
    """Bradley–Terry: P(chosen ≻ rejected) = σ(s_c − s_r); the loss is −log σ(s_c − s_r)."""
    return -F.logsigmoid(score_chosen - score_rejected).mean()


def preference_pairs(n: int, length: int, generator: torch.Generator) -> tuple:
    """n random prompts with two random completions each, ordered by the true reward (ties
    dropped): what a human labeller would give, here from the verifiable reward."""
    targets = torch.randint(0, MAX_TARGET + 1, (n,), generator=generator)
    a = torch.randint(0, DIGITS, (n, length), generator=generator)
    b = torch.randint(0, DIGITS, (n, length), generator=generator)
    ra, rb = reward(targets, a), reward(targets, b)
    keep = ra != rb
    a_wins = (ra > rb)[:, None]
    chosen, rejected = torch.where(a_wins, a, b), torch.where(a_wins, b, a)
    return targets[keep], chosen[keep], rejected[keep]


def train_reward_model(steps: int, length: int, seed: int, lr: float = 3e-3) -> tuple:
    """Fit a reward model on preference pairs; return it and its accuracy on fresh pairs
    (how often it ranks the better completion higher)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    rm = RewardModel(length)
    opt = torch.optim.Adam(rm.parameters(), lr=lr)
    for _ in range(steps):
        t, c, r = preference_pairs(128, length, g)
        loss = bradley_terry_loss(rm(t, c), rm(t, r))
        opt.zero_grad()
        loss.backward()
        opt.step()
    t, c, r = preference_pairs(1024, length, g)
    with torch.no_grad():
        accuracy = (rm(t, c) > rm(t, r)).float().mean().item()
    return rm, accuracy
