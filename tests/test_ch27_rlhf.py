"""Chapter 27: RL fine-tuning by hand — GAE, the clipped objective and GRPO's advantages against
the test's own references and hand-worked numbers (with wrong variants as controls), weight
pushes from a trainer to generators bitwise (full and delta, a delta missing an element
rejected, bytes counted), the script's reward rise and staleness on 2 and 3 ranks, PPO with a
value head, the Bradley–Terry loss, and TRL's GRPOTrainer configuration.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch27_rlhf import rl, sync, train
from common.launch import run_on_ranks, run_python, run_torchrun

SCRIPT = Path(train.__file__)
TOL = train.EXAMPLE_TOLERANCE


def reference_gae(rewards: list, values: list, gamma: float, lam: float) -> list:
    """A_t = Σ_l (γλ)^l δ_{t+l}, summed forwards (the chapter's function runs backwards)."""
    T = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < T else 0.0) - values[t] for t in range(T)]
    return [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, T)) for t in range(T)]


@pytest.mark.timeout(30)
def test_gae_equals_forward_sum_and_hand_example():
    g = torch.Generator().manual_seed(0)
    r, v = torch.rand(4, 6, generator=g, dtype=torch.float64), torch.rand(4, 6, generator=g, dtype=torch.float64)
    adv, ret = rl.gae(r, v, 0.99, 0.95)
    for row in range(4):
        ref = torch.tensor(reference_gae(r[row].tolist(), v[row].tolist(), 0.99, 0.95), dtype=torch.float64)
        assert (adv[row] - ref).abs().max() <= 1e-12
    assert torch.equal(ret, adv + v)
    hand = torch.tensor([0.442, 0.38, 0.2], dtype=torch.float64)
    rr, vv = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64), torch.tensor([[0.5, 0.6, 0.8]], dtype=torch.float64)
    assert (rl.gae(rr, vv, 1.0, 0.9)[0][0] - hand).abs().max() <= TOL
    # control: λ = 1 (plain returns minus values) misses the hand example
    assert (rl.gae(rr, vv, 1.0, 1.0)[0][0] - hand).abs().max() > 0.05


@pytest.mark.timeout(30)
def test_clipped_objective_and_its_controls():
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    obj = rl.clipped_objective(ratio.log(), torch.zeros(4, dtype=torch.float64), adv, 0.2)
    hand = torch.tensor([1.2, 0.5, -1.5, -0.8], dtype=torch.float64)
    assert (obj - hand).abs().max() <= TOL
    unclipped, clip_only = ratio * adv, ratio.clamp(0.8, 1.2) * adv  # the two wrong variants
    assert (unclipped - hand).abs().max() > 0.1 and (clip_only - hand).abs().max() > 0.1


@pytest.mark.timeout(30)
def test_grpo_advantages_formula_and_control():
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(5 * 8, generator=g, dtype=torch.float64)
    a = rl.grpo_advantages(rewards, 8)
    for k in range(5):
        grp = rewards[8 * k:8 * k + 8].tolist()
        mean = sum(grp) / 8
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / 7)  # sample std, as torch.std
        ref = torch.tensor([(x - mean) / (std + 1e-6) for x in grp], dtype=torch.float64)
        assert (a[8 * k:8 * k + 8] - ref).abs().max() <= 1e-12
    hand = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    s = 0.5 / (3 ** -0.5 + 1e-6)
    assert (rl.grpo_advantages(hand, 4) - torch.tensor([s, -s, -s, s], dtype=torch.float64)).abs().max() <= TOL
    population = (hand - 0.5) / (hand.std(unbiased=False) + 1e-6)  # control: population std
    assert (population - torch.tensor([s, -s, -s, s], dtype=torch.float64)).abs().max() > 0.1


@pytest.mark.timeout(30)
def test_reward_uniform_level_kl_and_bradley_terry():
    length = 3
    combos = torch.tensor(list(itertools.product(range(10), repeat=length)))
    levels = [rl.reward(torch.full((len(combos),), t), combos).double().mean().item() for t in range(28)]
    assert abs(sum(levels) / 28 - train.uniform_policy_reward(length)) <= 1e-6
    assert rl.reward(torch.tensor([6]), torch.tensor([[1, 2, 3]])).item() == 1.0
    logp = torch.tensor([-1.0, -2.0])
    assert torch.equal(rl.kl_to_reference(logp, logp), torch.zeros(2))
    assert (rl.kl_to_reference(logp, logp - 0.5) > 0).all()
    # the direction: KL(π‖π_ref) sampled from π, ratio π_ref/π = e^{-0.5}: e^{-0.5} + 0.5 − 1;
    # the reversed estimator (ratio π/π_ref) would give e^{0.5} − 0.5 − 1 = 0.149, also positive
    k3 = math.exp(-0.5) + 0.5 - 1
    assert (rl.kl_to_reference(logp, logp - 0.5) - k3).abs().max().item() <= 1e-6
    loss = rl.bradley_terry_loss(torch.tensor([1.0]), torch.tensor([0.0]))
    assert abs(loss.item() - math.log(1 + math.exp(-1))) <= 1e-6


def _sync_worker(n_changed: int) -> dict:
    """Trainer (rank 0) and generators: a full push, a delta push of n_changed elements, then a
    delta with one element dropped (no repair), returning every rank's vectors."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = rl.TinyDecoder()
    flat = sync.flatten(model) if rank == 0 else torch.zeros_like(sync.flatten(model))
    target = sync.flatten(model) + 0.01
    stats = sync.SyncStats()
    sync.push(flat, "full", stats, target)
    after_full = flat.clone()
    new = target.clone()
    new[torch.randperm(len(new), generator=torch.Generator().manual_seed(3))[:n_changed]] *= 1.5
    ok = sync.push(flat, "delta", stats, new)
    after_delta = flat.clone()
    bad = new.clone()
    bad[:4] += 1.0
    ok_bad = sync.delta_sync(flat, stats, bad, drop=1)
    # two wrong elements whose checksum terms cancel (1·(+2) + 2·(−1) = 0) on rank 1 only:
    # the checksum cannot see it, the script's bitwise `verify` must
    collision = new.clone()
    if rank == 1:
        collision.view(torch.int32)[0] += 2
        collision.view(torch.int32)[1] -= 1
    return {"same_checksum": bool(sync.checksum(collision) == sync.checksum(new)),
            "verify_collision": train.verify(collision), "verify_equal": train.verify(new.clone()),
            "full": after_full, "delta": after_delta, "target": target, "new": new, "bad": bad,
            "after_bad": flat.clone(), "ok": ok, "ok_bad": ok_bad, "stats": stats}


@pytest.fixture(scope="module")
def synced():
    return run_on_ranks(_sync_worker, 3, 50, timeout=90)


@pytest.mark.timeout(120)
def test_full_and_delta_push_are_bitwise_copies(synced):
    trainer = synced[0]
    for res in synced[1:]:
        assert res["ok"]
        assert torch.equal(res["full"].view(torch.int32), trainer["target"].view(torch.int32))
        assert torch.equal(res["delta"].view(torch.int32), trainer["new"].view(torch.int32))


@pytest.mark.timeout(120)
def test_delta_missing_an_element_is_rejected(synced):
    for res in synced[1:]:
        assert not res["ok_bad"] and res["stats"].rejected == 1
        # the check caught a real difference: the generator is one element off the trainer
        assert (res["after_bad"] != res["bad"]).sum().item() == 1
    assert synced[0]["ok_bad"]  # the trainer itself holds the right vector


@pytest.mark.timeout(120)
def test_verify_is_bitwise_not_the_checksum(synced):
    assert synced[1]["same_checksum"]  # the collision fools the checksum...
    assert all(not r["verify_collision"] for r in synced)  # ...not verify, on every rank
    assert all(r["verify_equal"] for r in synced)


@pytest.mark.timeout(120)
def test_delta_bytes_counted_far_below_full(synced):
    stats, n = synced[1]["stats"], len(synced[1]["target"])
    assert stats.full_bytes == 4 * n
    first_delta = 16 + 12 * 50
    assert stats.delta_bytes == first_delta + 16 + 12 * 3  # then the control's 3 of 4 elements
    assert first_delta < 4 * n / 20
    assert stats.changed == [50, 3]


@pytest.mark.timeout(120)
def test_script_two_ranks_disaggregated_delta():
    res = run_torchrun(SCRIPT, 2, timeout=150)
    s = res.summary
    assert all(c["ok"] for c in s["checks"]), [c for c in s["checks"] if not c["ok"]]
    rise = res.check("mean reward rises: last 5 − first 5 >= 0.1")
    assert rise["measured"] >= 0.1
    assert res.check("max staleness (updates) == the bound")["measured"] == 1
    assert res.check("delta missing one element: rejected (control)")["measured"] == 1
    assert res.check("weights equal the trainer's (bitwise) after every sync")["measured"] == "59/59"
    assert res.check("pushes accepted at the first attempt (no repair needed)")["measured"] == "59/59"


@pytest.mark.timeout(120)
def test_script_three_ranks_full_sync_staleness_two():
    res = run_torchrun(SCRIPT, 3, ["--sync", "full", "--staleness", "2", "--steps", "20",
                                   "--rm-steps", "0", "--margin", "-1"], timeout=150)
    assert all(c["ok"] for c in res.summary["checks"])
    assert res.check("max staleness (updates) == the bound")["measured"] == 2
    assert res.check("weights equal the trainer's (bitwise) after every sync")["measured"] == "18/18"
    n = int(res.summary["figures"]["bytes per full push in training"]["expected"])
    assert res.summary["figures"]["bytes per full push in training"]["measured"] == n


@pytest.mark.timeout(120)
def test_ppo_with_value_head_one_process():
    res = run_python(SCRIPT, ["--algo", "ppo", "--rm-steps", "0"], timeout=150)
    assert all(c["ok"] for c in res.summary["checks"])
    assert res.check("mean reward rises: last 5 − first 5 >= 0.1")["measured"] >= 0.1


@pytest.mark.timeout(30)
def test_config_refuses_disaggregation_on_one_rank():
    cfg = train.Config(placement="disaggregated")
    with pytest.raises(ValueError, match="at least 2 ranks"):
        train.validate(cfg, 1)
    train.validate(cfg, 2)
    with pytest.raises(ValueError):
        train.Config(staleness=60)


@pytest.mark.timeout(30)
def test_exercise_numbers():
    flat32 = sync.flatten(rl.TinyDecoder())
    n = len(flat32)
    assert n == 10_218
    k32 = max(k for k in range(n) if sync.delta_bytes_formula(k, flat32) < 4 * n)
    flat16 = flat32.to(torch.bfloat16)
    k16 = max(k for k in range(n) if sync.delta_bytes_formula(k, flat16) < 2 * n)
    assert (k32, k16) == (3404, 2041)


@pytest.mark.timeout(30)
def test_trl_reward_function_is_the_chapters_reward():
    from chapters.ch27_rlhf import trl_grpo

    got = trl_grpo.digit_sum_reward(["T6", "T20", "T6", "T6"], ["1 2 3", "9 9 2", "1 2", "T3 1 2"])
    assert got == [1.0, rl.reward(torch.tensor([20]), torch.tensor([[9, 9, 2]])).item(), 0.0, 0.0]


@pytest.mark.timeout(150)
def test_trl_grpo_trainer_few_cpu_steps():
    pytest.importorskip("trl")
    res = run_python(Path(train.__file__).with_name("trl_grpo.py"), timeout=150)
    assert all(c["ok"] for c in res.summary["checks"]), res.summary["checks"]
    assert res.check("optimizer steps TRL took == --steps")["measured"] == 4
    figs = res.summary["figures"]
    assert figs["GRPOConfig.num_generations (train.py --group-size)"]["measured"] == train.Config().group_size
    assert figs["GRPOConfig.epsilon (train.py --clip)"]["measured"] == train.Config().clip
    assert figs["GRPOConfig.num_iterations (train.py --inner-steps)"]["measured"] == train.Config().inner_steps
