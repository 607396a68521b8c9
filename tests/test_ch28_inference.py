"""Chapter 28: KV cache, tensor-parallel generation, paged KV blocks, continuous batching.

One real torchrun launch on two ranks (the script's own checks), one start of four gloo ranks
for tensor-parallel generation compared here with a one-process generation without a cache, and
in-process tests of the block manager and of the schedules.
"""

from __future__ import annotations

import heapq
import json
from types import SimpleNamespace

import pytest
import torch

from chapters.ch28_inference import model as M
from chapters.ch28_inference import paged as P
from chapters.ch28_inference import train as T
from common.launch import REPO_ROOT, run_on_ranks, run_torchrun

SCRIPT = REPO_ROOT / "chapters" / "ch28_inference" / "train.py"


def _reference(n_new=10):
    torch.set_default_dtype(torch.float64)
    cfg = T.Config()
    config, hf = T.build(cfg)
    prompt = T.prompt_of(cfg, config.vocab_size, 5)
    return cfg, config, hf, prompt, M.generate(M.HandLlama(hf.state_dict(), config), prompt, n_new, use_cache=False)


def _plain(config) -> SimpleNamespace:
    """The LlamaConfig fields HandLlama reads, as a plain object: the spawned ranks then need no
    transformers import (seconds per rank)."""
    return SimpleNamespace(hidden_size=config.hidden_size, rms_norm_eps=config.rms_norm_eps,
                           num_attention_heads=config.num_attention_heads,
                           num_hidden_layers=config.num_hidden_layers,
                           rope_theta=M.rope_theta(config))


def _tp_worker(state, config, prompt):
    """Each rank: its shard's generation, and the same without g's all-reduce (the control)."""
    import torch.distributed as dist

    torch.set_default_dtype(torch.float64)
    rank, tp = dist.get_rank(), dist.get_world_size()
    return [M.generate(M.HandLlama(state, config, rank, tp, reduce=reduce), prompt, 10)
            for reduce in (True, False)]


def _static_steps(outs, batch):
    """The test's own count: each batch of `batch` requests in order costs its longest one."""
    return sum(max(outs[i:i + batch]) for i in range(0, len(outs), batch))


def _continuous_steps(outs, batch):
    """The test's own count (list scheduling): each request, in order, takes the slot that frees
    first and holds it for its length; the schedule ends when the last slot frees."""
    free_at = [0] * batch
    for o in outs:
        heapq.heappush(free_at, heapq.heappop(free_at) + o)
    return max(free_at)


@pytest.mark.timeout(200)
def test_script_checks_pass_on_two_ranks(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, timeout=180, out_dir=tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    checks = {c["name"]: c for c in summary["checks"]}
    assert all(c["ok"] for c in checks.values() if c["kind"] != "timing"), res.output[-3000:]
    assert checks["TP on 2 ranks = one device: max |logit diff|"]["measured"] <= T.PARITY_TOL
    assert checks["control: TP without the all-reduce differs"]["ok"]
    assert checks["benchmark: requests served over all ranks"]["measured"] == T.Config().requests


@pytest.mark.timeout(200)
def test_tensor_parallel_on_four_ranks_equals_one_device_without_cache():
    _, config, hf, prompt, (ref_t, ref_l) = _reference()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    ranks = run_on_ranks(_tp_worker, 4, state, _plain(config), prompt, timeout=180)
    for (tok, lg), (_, bad) in ranks:
        assert torch.equal(tok, ref_t)
        assert (lg - ref_l).abs().max() <= T.PARITY_TOL
        assert (bad - ref_l).abs().max() > T.PARITY_TOL  # without g the same check fails


@pytest.mark.timeout(120)
def test_cache_and_transformers_generate_match_no_cache():
    cfg, config, hf, prompt, (ref_t, ref_l) = _reference(12)
    dense = M.HandLlama(hf.state_dict(), config)
    tok, lg = M.generate(dense, prompt, 12, use_cache=True)
    assert torch.equal(tok, ref_t) and (lg - ref_l).abs().max() <= T.PARITY_TOL
    hf_t, hf_l = M.hf_generate(hf, prompt, 12)
    assert M.top2_margin(ref_l) > 2 * T.HF_TOL  # no near-tie can flip a token
    assert torch.equal(hf_t, ref_t) and (hf_l - ref_l).abs().max() <= T.HF_TOL
    _, bad = T.wrong_position_generate(dense, prompt, 12)
    assert (bad - ref_l).abs().max() > T.PARITY_TOL
    assert (hf_l - bad).abs().max() > T.HF_TOL  # the transformers tolerance tells them apart


@pytest.mark.timeout(60)
def test_block_manager_invariants_hold_and_the_leaky_one_is_caught():
    for seed in range(3):
        good = P.random_stream(P.BlockManager(48, 4), 4000, seed)
        assert good["violations"] == 0 and good["free_at_end"] == 48
        assert good["shared_hits"] > 0 and good["copies"] > 0  # sharing and CoW were exercised
        assert P.random_stream(P.LeakyManager(48, 4), 4000, seed)["violations"] > 0


@pytest.mark.timeout(60)
def test_copy_on_write_and_last_user_frees_prefix():
    m = P.BlockManager(8, 4)
    m.allocate(0, [1, 2, 3, 4, 5, 6])
    m.fork(0, 1)
    last = m.tables[0][-1]
    m.append(1, 9)  # child writes into the shared, partly filled block: a copy
    assert m.copies == 1 and m.tables[1][-1] != last and m.tables[0][-1] == last
    assert m.tokens[0] == [1, 2, 3, 4, 5, 6] and not m.check()
    m.allocate(2, [1, 2, 3, 4, 7])  # shares the first full block through the prefix cache
    first = m.tables[0][0]
    assert m.tables[2][0] == first and m.refs[first] == 3
    for seq in (0, 1):
        m.finish(seq)
        assert first not in m.free and not m.check()
    m.finish(2)
    assert first in m.free and len(m.free) == 8


@pytest.mark.timeout(60)
def test_continuous_batching_beats_static_by_the_length_distribution():
    cfg = T.Config()
    outs = [o for _, o in P.workload(cfg.requests, cfg.max_out, cfg.seed)]
    s, c = P.static_schedule(outs, cfg.batch), P.continuous_schedule(outs, cfg.batch)
    # the test's own count of static steps: each batch costs its longest request
    assert s["steps"] == _static_steps(outs, cfg.batch)
    assert c["steps"] == _continuous_steps(outs, cfg.batch)
    assert c["padded"] == c["steps"] * cfg.batch - sum(outs)
    assert s["steps"] / c["steps"] >= 1.5
    assert c["steps"] >= -(-sum(outs) // cfg.batch)
    # equal lengths: nothing to gain, the ratio is exactly 1
    same = [10] * 64
    assert P.static_schedule(same, 8)["steps"] == P.continuous_schedule(same, 8)["steps"] == 80


@pytest.mark.timeout(120)
def test_engines_equal_no_cache_generation_and_their_counted_schedules():
    from chapters.ch28_inference import engine as E

    cfg, config, hf, _, _ = _reference(1)
    llama = M.HandLlama(hf.state_dict(), config)
    work = P.workload(20, 24, seed=3)
    # requests 6, 7 and 12 end at their prefill (one output token): they must take no slot, and
    # the next waiting request takes it before the same step
    work = [(p, 1 if i in (6, 7, 12) else n) for i, (p, n) in enumerate(work)]
    reqs = [(T.prompt_of(cfg, config.vocab_size, 50 + i, p), n) for i, (p, n) in enumerate(work)]
    decode = [n - 1 for _, n in reqs]  # the prefill gives the first token
    # counted here, not by paged.py: a request done at its prefill idles its static slot, and
    # takes no continuous slot
    expect = {"static": _static_steps(decode, 4), "continuous": _continuous_steps(decode, 4)}
    expect["async"] = expect["continuous"]
    runs = {mode: E.serve(llama, reqs, 4, mode) for mode in expect}
    for mode, run in runs.items():
        assert run["steps"] == expect[mode], mode
    assert expect["static"] > expect["continuous"]
    refs = [M.generate(llama, prompt, n, use_cache=False) for prompt, n in reqs]
    for j, (ref_t, ref_l) in enumerate(refs):
        for run in runs.values():
            assert run["tokens"][j] == ref_t[0].tolist()
            assert (run["logits"][j] - ref_l[0]).abs().max() <= T.PARITY_TOL
    # control: slots whose positions never advance (each step writes and rotates at 0)
    frozen = _FrozenSlots(hf.state_dict(), config)
    bad = E.serve(frozen, reqs, 4, "continuous")
    worst = max(float((bad["logits"][j] - ref_l[0]).abs().max()) for j, (_, ref_l) in enumerate(refs))
    assert worst > T.PARITY_TOL
    with pytest.raises(ValueError):
        E.serve(llama, reqs, 4, "eager")


class _FrozenSlots(M.HandLlama):
    def decode_slots(self, tokens, pos, kv):
        return super().decode_slots(tokens, torch.zeros_like(pos), kv)
