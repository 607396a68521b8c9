"""Chapter 27: RL fine-tuning by hand — GAE, the clipped objective, GRPO's advantages and PPO's
KL-penalised rewards against the test's own references and hand-worked numbers (with wrong
variants as controls); PPO's advantages computed once per rollout batch; the KL penalty holding
the policy nearer its reference than β = 0 (a sign-flipped penalty caught); weight pushes from a
trainer to generators bitwise (full and delta, a delta missing an element rejected, bytes
counted); the asynchronous pipeline on 2 and 3 ranks (generation of step t + k beside training
on step t, counted on the timeline; each rollout's log-probs recomputed under the version it
carries, a mislabelled generator caught; lock-step as the control); the reward model driving RL
(an untrained one as the control); and TRL's GRPOTrainer configuration.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch27_rlhf import rl, sync, train
from chapters.ch27_rlhf.checks import (
    EXAMPLE_TOLERANCE,
    MISLABEL_FLOOR,
    RECOMPUTE_TOLERANCE,
    uniform_policy_reward,
)
from common.distributed import DistInfo, setup_distributed
from common.launch import run_on_ranks, run_python, run_torchrun
from common.results import RunRecorder

SCRIPT = Path(train.__file__)
TOL = EXAMPLE_TOLERANCE


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
    assert abs(sum(levels) / 28 - uniform_policy_reward(length)) <= 1e-6
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


@pytest.mark.timeout(30)
def test_kl_penalised_rewards_and_whitening_hand_examples():
    f64 = torch.float64
    old, ref = torch.tensor([[0.5, -0.2, 0.1]], dtype=f64), torch.zeros(1, 3, dtype=f64)
    r = rl.kl_penalty_rewards(torch.tensor([1.0], dtype=f64), old, ref, beta=0.1)
    hand = torch.tensor([[-0.05, 0.02, 0.99]], dtype=f64)
    assert (r - hand).abs().max() <= TOL
    # control: the penalty with its sign flipped (a bonus for leaving the reference) misses
    assert (rl.kl_penalty_rewards(torch.tensor([1.0], dtype=f64), old, ref, -0.1) - hand).abs().max() > 0.05
    x = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=f64)  # mean 3, sample std sqrt(14/3)
    w = rl.whiten(x)
    assert (w - (x - 3) / (math.sqrt(14 / 3) + 1e-8)).abs().max() <= TOL
    assert abs(w.mean().item()) <= TOL and abs(w.std().item() - 1) <= 1e-8
    ctl = rl.AdaptiveKL(0.1, target=0.5, horizon=1000)  # KL twice the target: error clipped at 0.2
    assert abs(ctl.update(1.0, 100) - 0.1 * (1 + 0.2 * 100 / 1000)) <= 1e-15
    assert abs(ctl.update(0.45, 100) - 0.102 * (1 - 0.1 * 100 / 1000)) <= 1e-15


@pytest.mark.timeout(60)
def test_ppo_advantages_computed_once_per_rollout_batch(monkeypatch):
    """The loss of every inner step sees the advantages and returns computed before the first
    one, from the old log-probs (KL to the reference in the rewards), the critic as it was, the
    configured γ and λ, whitened; the test computes them itself."""
    cfg = train.Config(algo="ppo", gamma=0.9, lam=0.8, beta=0.1, inner_steps=3)
    torch.manual_seed(0)
    model = rl.TinyDecoder(value_head=True)
    ref = rl.TinyDecoder(value_head=True)  # another network: the KL term is far from 0
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    rows = train.rollouts(model, cfg, torch.Generator().manual_seed(1), 0, torch.device("cpu"))
    batch = train.unpack(rows, cfg)
    with torch.no_grad():
        ref_logp, _ = rl.token_logprobs(ref, batch["targets"], batch["digits"])
        _, values = rl.token_logprobs(model, batch["targets"], batch["digits"])
    rewards = -0.1 * (batch["old_logp"] - ref_logp).double()
    rewards[:, -1] += batch["scores"].double()
    adv = torch.tensor([reference_gae(r, v, 0.9, 0.8) for r, v in zip(rewards.tolist(),
                                                                     values.double().tolist())])
    white = (adv - adv.mean()) / (adv.std() + 1e-8)
    raw = rl.ppo_batch(model, ref, batch, 0.1, 0.9, 0.8, whiten_advantages=False)["advantages"]
    assert (raw.double() - adv).abs().max() <= 1e-5  # --no-whiten: GAE as it is
    seen = []
    original = rl.ppo_loss

    def spy(m, b, eps, vf_coef):
        seen.append((b["advantages"].clone(), b["returns"].clone()))
        return original(m, b, eps, vf_coef)

    monkeypatch.setattr(rl, "ppo_loss", spy)
    train.update(model, ref, opt, batch, cfg, average=False, beta=0.1)
    assert len(seen) == 3
    for a, ret in seen:
        assert (a.double() - white).abs().max() <= 1e-5
        assert (ret.double() - (adv + values.double())).abs().max() <= 1e-5
    # the critic did move: advantages recomputed from it at the last step would differ
    with torch.no_grad():
        _, moved = rl.token_logprobs(model, batch["targets"], batch["digits"])
    assert (moved - values).abs().max() > 1e-3
    assert (rl.ppo_batch(model, ref, batch, 0.1, 0.9, 0.8)["advantages"].double() - white).abs().max() > 1e-3


def _in_process(tmp_path, name: str, **options) -> dict:
    """train.train on a world of one, in this process (colocated): its figures and checks."""
    cfg = train.Config(out=str(tmp_path / name), **options)
    info = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1,
                    device=torch.device("cpu"), backend="gloo", launcher="none")
    rec = RunRecorder(cfg, train.__file__, info)
    train.train(cfg, info, rec)
    rec.finish()
    return {"figures": {k: v["measured"] for k, v in rec.figures.items()},
            "checks": {c["name"]: c for c in rec.checks}}


KL_FIGURE = "KL(π‖π_ref) per token, mean of the last 10 steps"
RISE = "mean reward rises: last 5 − first 5 >= 0.1"
KL_MARGIN = 0.5  # with the penalty, at most half the KL of the run without it (seed 0)


@pytest.mark.timeout(90)
def test_kl_penalty_keeps_the_policy_near_its_reference(tmp_path, monkeypatch):
    """PPO, seed 0, 60 updates on one process: β = 0.05 ends with at most half the KL to the
    reference that β = 0 reaches (measured 0.37 against 1.49), and still learns; the penalty
    with its sign flipped (a bonus for leaving the reference) fails the same bound."""
    common = {"algo": "ppo", "rm_steps": 0, "seed": 0}
    free = _in_process(tmp_path, "beta0", beta=0.0, **common)
    held = _in_process(tmp_path, "beta", beta=0.05, **common)
    assert held["figures"][KL_FIGURE] <= KL_MARGIN * free["figures"][KL_FIGURE]
    assert held["checks"][RISE]["ok"]
    original = rl.kl_penalty_rewards
    monkeypatch.setattr(rl, "kl_penalty_rewards", lambda s, o, r, beta: original(s, o, r, -beta))
    flipped = _in_process(tmp_path, "flipped", beta=0.05, **common)
    assert not flipped["figures"][KL_FIGURE] <= KL_MARGIN * free["figures"][KL_FIGURE]


@pytest.mark.timeout(60)
def test_adaptive_kl_moves_beta_towards_its_target(tmp_path, monkeypatch):
    """`--kl-target` in the loop: a KL above the target raises β, below it lowers β (10 PPO
    updates each; the closed form of one update is in the hand-example test), and the β the
    controller sets is the one PPO's rewards are computed with at the next update (a spy on
    `rl.ppo_batch`)."""
    common = {"algo": "ppo", "rm_steps": 0, "steps": 10, "margin": -1.0, "beta": 0.05}
    seen = []
    original = rl.ppo_batch

    def spy(model, ref, batch, beta, *args, **kwargs):
        seen.append(beta)
        return original(model, ref, batch, beta, *args, **kwargs)

    monkeypatch.setattr(rl, "ppo_batch", spy)
    tight = _in_process(tmp_path, "tight", kl_target=1e-6, **common)["figures"]
    tight_betas, seen[:] = list(seen), []
    loose = _in_process(tmp_path, "loose", kl_target=100.0, **common)["figures"]
    name = "β at the end (adaptive KL)"
    # the error is clipped to ±0.2: each batch of 128 completions (horizon 10,000) multiplies β
    # by 1 ± 0.00256; the first batch's KL is exactly 0 (the policy is the reference): down
    e = 0.2 * 128 / 10_000
    assert tight[name] == pytest.approx(0.05 * (1 - e) * (1 + e) ** 9, abs=1e-5)  # figure: 5 d.p.
    assert loose[name] == pytest.approx(0.05 * (1 - e) ** 10, abs=1e-5)
    # what PPO used at update t: β after t controller steps (update 0: the configured 0.05)
    want_tight = [0.05 * (1 - e) * (1 + e) ** (t - 1) if t else 0.05 for t in range(10)]
    assert tight_betas == pytest.approx(want_tight, rel=1e-12)
    assert seen == pytest.approx([0.05 * (1 - e) ** t for t in range(10)], rel=1e-12)


@pytest.mark.timeout(60)
def test_untrained_reward_model_drives_nothing(tmp_path):
    """The control of the 3-rank run where the reward model drives RL: the same loop driven by a
    reward model trained for one step only (ranking accuracy near chance) does not raise the
    program's reward by the margin."""
    res = _in_process(tmp_path, "rm1", algo="ppo", reward="model", rm_steps=1)
    assert not res["checks"][RISE]["ok"]
    assert res["checks"]["reward model ranks held-out pairs (accuracy) >= 0.8"]["measured"] < 0.6


def _sync_worker(n_changed: int, out: str) -> dict:
    """Trainer (rank 0) and generators: a full push, a delta push of n_changed elements, then a
    delta with one element dropped (no repair), returning every rank's vectors; then two short
    RL runs (`_train_checks`)."""
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
    result = {"same_checksum": bool(sync.checksum(collision) == sync.checksum(new)),
              "verify_collision": train.verify(collision), "verify_equal": train.verify(new.clone()),
              "full": after_full, "delta": after_delta, "target": target, "new": new, "bad": bad,
              "after_bad": flat.clone(), "ok": ok, "ok_bad": ok_bad, "stats": stats}
    # the RL loop itself on these 3 ranks (one start serves them all): lock-step, the control of
    # the asynchronous pipeline, then generators that label their rollouts one version too old
    result["lockstep"] = _train_checks(out, "lockstep", staleness=0, steps=5)
    # generation and training made long (a 0.2 s sleep in each): every generation of batch t + 1
    # must overlap training t on the clock, G (T − k) = 2 × 3 of them
    plain_rollouts, plain_update = train.rollouts, train.update

    def slow(fn):
        def wrapped(*args, **kwargs):
            time.sleep(0.2)
            return fn(*args, **kwargs)
        return wrapped

    train.rollouts, train.update = slow(plain_rollouts), slow(plain_update)
    try:
        result["slow"] = _train_checks(out, "slow", staleness=1, steps=4)
    finally:
        train.rollouts, train.update = plain_rollouts, plain_update
    # colocated with --kl-target: each rank samples its own batch, so its own KL differs; the
    # controller must see their mean (a spy records the KL each rank's controller is given)
    given, plain_ctl = [], rl.AdaptiveKL.update

    def ctl_spy(self, kl, n):
        given.append(kl)
        return plain_ctl(self, kl, n)

    rl.AdaptiveKL.update = ctl_spy
    try:
        _train_checks(out, "colocated_kl", placement="colocated", steps=3, algo="ppo",
                      kl_target=1e-6)
    finally:
        rl.AdaptiveKL.update = plain_ctl
    result["kl_given"] = given
    labelled = train.rollouts
    train.rollouts = lambda m, cfg, gen, version, dev: labelled(m, cfg, gen, max(version - 1, 0), dev)
    try:
        result["mislabelled"] = _train_checks(out, "mislabelled", staleness=1, steps=5)
    finally:
        train.rollouts = labelled
    return result


def _train_checks(out: str, name: str, **options) -> dict:
    info = setup_distributed("cpu", "gloo")  # the group run_on_ranks made
    cfg = train.Config(out=f"{out}/{name}", rm_steps=0, margin=-1.0, **options)
    rec = RunRecorder(cfg, train.__file__, info)
    train.train(cfg, info, rec)
    rec.finish()  # every rank's verdicts, merged
    return {c["name"]: c for c in rec.checks}


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    # ~15 s on a quiet machine: three spawned ranks import torch and, for the two RL runs, build
    # Adam (whose first construction imports torch._dynamo, ~900 modules, seconds per rank)
    return run_on_ranks(_sync_worker, 3, 50, str(tmp_path_factory.mktemp("ch27")), timeout=110)


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


LOCKSTEP_BETWEEN = "schedule: generations of batch t+0 between gather t and push t+1"
LOCKSTEP_CLOCK = "lock-step: generations overlapping a training step on the clock"
CLOCK = "generations of batch t+{k} overlapping train t on the clock: at least one"
RECOMPUTED = "rollout log-probs recomputed under their version: max |Δ|"


@pytest.mark.timeout(120)
def test_lockstep_control_has_no_generation_beside_training(synced):
    """Lock-step (staleness 0) on 3 ranks: the pipeline's counts say 0 generations beside a
    training step (the same count is 2 × (T − 1) when asynchronous), and it is on-policy."""
    checks = synced[0]["lockstep"]
    assert checks[LOCKSTEP_BETWEEN]["measured"] == 0 and checks[LOCKSTEP_BETWEEN]["ok"]
    assert checks[LOCKSTEP_CLOCK]["measured"] == 0 and checks[LOCKSTEP_CLOCK]["ok"]
    assert checks["max staleness (updates) == the bound"]["measured"] == 0
    assert checks[RECOMPUTED]["ok"] and checks[RECOMPUTED]["measured"] <= RECOMPUTE_TOLERANCE
    assert checks["mislabelled-version controls run (every step but the first)"]["measured"] == 4
    assert all(c["ok"] for c in checks.values() if c["kind"] != "timing"), checks


@pytest.mark.timeout(120)
def test_clock_counts_every_overlap_when_generation_and_training_are_long(synced):
    """3 ranks, staleness 1, 4 steps, 0.2 s slept in every generation and every training step:
    the clock count of generations overlapping a training step equals the schedule, 2 × 3."""
    checks = synced[0]["slow"]
    assert checks[CLOCK.format(k=1)]["measured"] == 2 * 3 and checks[CLOCK.format(k=1)]["ok"]
    assert checks["schedule: generations of batch t+1 between gather t and push t+1"]["measured"] == 6


@pytest.mark.timeout(120)
def test_colocated_adaptive_kl_keeps_one_beta_on_every_rank(synced):
    """Colocated on 3 ranks with --kl-target: the KL the controller sees is averaged across the
    ranks, so β stays equal everywhere (per-rank KL would let it drift per rank)."""
    given = [r["kl_given"] for r in synced]
    assert len(given[0]) == 3 and given[0][1] > 0  # one KL per update; 0 only at the first
    assert all(g == given[0] for g in given), given  # bit for bit the same on every rank


@pytest.mark.timeout(120)
def test_mislabelled_generator_is_caught(synced):
    """Generators whose rollouts carry a version one older than the weights that sampled them:
    the recomputation under the carried version no longer matches."""
    checks = synced[0]["mislabelled"]
    assert not checks[RECOMPUTED]["ok"]
    assert checks[RECOMPUTED]["measured"] > MISLABEL_FLOOR


@pytest.mark.timeout(120)
def test_script_two_ranks_asynchronous_delta():
    res = run_torchrun(SCRIPT, 2, ["--log-every", "1"], timeout=150)  # the notebook's run
    s = res.summary
    assert all(c["ok"] for c in s["checks"] if c["kind"] != "timing"), \
        [c for c in s["checks"] if not c["ok"]]
    assert res.check(RISE)["measured"] >= 0.1
    assert res.check("max staleness (updates) == the bound")["measured"] == 1
    assert res.check("delta missing one element: rejected (control)")["measured"] == 1
    assert res.check("weights equal the trainer's (bitwise) after every sync")["measured"] == "59/59"
    assert res.check("pushes accepted at the first attempt (no repair needed)")["measured"] == "59/59"
    assert res.check("schedule: generations of batch t+1 between gather t and push t+1")[
        "measured"] == 59
    assert res.check(CLOCK.format(k=1))["ok"]  # concurrency: at least one on the clock
    assert res.check(RECOMPUTED)["measured"] <= RECOMPUTE_TOLERANCE
    assert res.check("control: under a mislabelled version, min over steps of max |Δ| >= 0.001")[
        "measured"] >= MISLABEL_FLOOR
    for name in ("initial weights: every rank == the trainer's after the broadcast (bitwise)",
                 "control: before the broadcast the ranks' own initial weights differ"):
        assert res.check(name)["measured"] == 1
    n = len(sync.flatten(rl.TinyDecoder()))
    figs = s["figures"]
    assert figs["verify's bytes per sync (a check, kept out of the sync bytes)"]["measured"] == 4 * n + 16
    assert figs["initial broadcast: bytes"]["measured"] == 4 * n
    timeline = json.loads((res.out_dir / "timeline.json").read_text())
    trains = [e for e in timeline["ranks"][0] if e[0] == "train"]
    gens = [e for e in timeline["ranks"][1] if e[0] == "generate"]
    assert [e[1] for e in trains] == list(range(60)) and [e[1] for e in gens] == list(range(60))


@pytest.mark.timeout(120)
def test_script_three_ranks_ppo_reward_model_staleness_two():
    """PPO with the KL penalty, driven by the reward model, two generators running two batches
    ahead, full pushes: the program's reward rises all the same (the control with an untrained
    reward model is `test_untrained_reward_model_drives_nothing`)."""
    res = run_torchrun(SCRIPT, 3, ["--algo", "ppo", "--reward", "model", "--sync", "full",
                                   "--staleness", "2", "--beta", "0.05"], timeout=150)
    assert all(c["ok"] for c in res.summary["checks"] if c["kind"] != "timing")
    assert res.check(RISE)["measured"] >= 0.1
    assert res.check("max staleness (updates) == the bound")["measured"] == 2
    assert res.check("weights equal the trainer's (bitwise) after every sync")["measured"] == "59/59"
    assert res.check("schedule: generations of batch t+2 between gather t and push t+1")[
        "measured"] == 2 * 58
    assert res.check(CLOCK.format(k=2))["ok"]
    assert res.check(RECOMPUTED)["measured"] <= RECOMPUTE_TOLERANCE
    n = int(res.summary["figures"]["bytes per full push in training"]["expected"])
    assert res.summary["figures"]["bytes per full push in training"]["measured"] == n
    assert res.summary["figures"]["reward model's score: last 5 − first 5"]["measured"] > 0


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
