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

from chapters.ch28_inference import checks as C
from chapters.ch28_inference import engine as E
from chapters.ch28_inference import model as M
from chapters.ch28_inference import paged as P
from chapters.ch28_inference import train as T
from chapters.ch28_inference import workloads as WL
from common.launch import REPO_ROOT, run_on_ranks, run_torchrun

SCRIPT = REPO_ROOT / "chapters" / "ch28_inference" / "train.py"


def _reference(n_new=10):
    torch.set_default_dtype(torch.float64)
    cfg = T.Config()
    config, hf = T.build(cfg)
    prompt = C.prompt_of(cfg, config.vocab_size, 5)
    return cfg, config, hf, prompt, M.generate(M.HandLlama(hf.state_dict(), config), prompt, n_new, use_cache=False)


def _plain(config) -> SimpleNamespace:
    """The LlamaConfig fields HandLlama reads, as a plain object: the spawned ranks then need no
    transformers import (seconds per rank)."""
    return SimpleNamespace(hidden_size=config.hidden_size, rms_norm_eps=config.rms_norm_eps,
                           num_attention_heads=config.num_attention_heads,
                           num_hidden_layers=config.num_hidden_layers,
                           rope_theta=M.rope_theta(config))


def _tp_worker(state, config, prompt, reqs):
    """Each rank: its shard's generation, the same without g's all-reduce (the control), and
    the serving engine tensor-parallel over all ranks (each rank's pool holds its heads)."""
    import torch.distributed as dist

    torch.set_default_dtype(torch.float64)
    rank, tp = dist.get_rank(), dist.get_world_size()
    gens = [M.generate(M.HandLlama(state, config, rank, tp, reduce=reduce), prompt, 10)
            for reduce in (True, False)]
    shard = M.HandLlama(state, config, rank, tp)
    run = E.Engine(shard, 64, 4, 4, "continuous", choose=E.Chooser(0.1, 0)).run(reqs)
    return gens, run["tokens"], run["logits"], shard.kv_pool(64, 4).bytes()


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
    assert checks["TP on 2 ranks = one device: max |logit diff|"]["measured"] <= C.PARITY_TOL
    assert checks["control: TP without the all-reduce differs"]["ok"]
    assert checks["control: one block table scrambled differs"]["measured"] > C.PARITY_TOL
    assert checks["TP engine on 2 ranks: tokens differing from one device"]["measured"] == 0
    assert checks[f"pool of {T.Config().tight_blocks} blocks: preemptions"]["measured"] > 0
    # the headline, measured on the engines: the test recomputes the prediction and the counts
    cfg = T.Config()
    work = [d for _, d in WL.workload(cfg.requests_per_rank * 2, cfg.max_decode, cfg.seed)]
    static = sum(_static_steps(work[r::2], cfg.batch) for r in range(2))
    cont = sum(_continuous_steps(work[r::2], cfg.batch) for r in range(2))
    figure = summary["figures"]["engine decode steps summed over ranks: static, continuous"]
    assert figure["measured"] == [static, cont]
    ratio = checks["engines: static / continuous decode steps >= 1.5"]["measured"]
    assert ratio == pytest.approx(static / cont) and ratio >= 1.5
    assert abs(ratio / _expected_ratio(cfg.max_decode, cfg.batch) - 1) <= 0.05
    assert checks["overlap engine: plans made while the previous step ran"]["measured"] > 0
    assert checks["control: the synchronous engine's plans never overlap a step"]["measured"] == 0
    assert checks["benchmark: requests served over all ranks"]["measured"] == 2 * cfg.requests_per_rank


def _expected_ratio(m, b):
    """E[max of b draws uniform on 1..m] / E[draw], from the maximum's own distribution
    (P(max <= k) = (k/m)^b), not from the lesson's tail-sum form that paged.py uses."""
    from fractions import Fraction

    e_max = sum(k * (Fraction(k, m) ** b - Fraction(k - 1, m) ** b) for k in range(1, m + 1))
    return float(e_max / Fraction(m + 1, 2))


@pytest.mark.timeout(200)
def test_tensor_parallel_on_four_ranks_equals_one_device_without_cache():
    cfg, config, hf, prompt, (ref_t, ref_l) = _reference()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    reqs = WL.chat_workload(T.Config(chat_requests=6, system_len=8), config.vocab_size, 11)
    ranks = run_on_ranks(_tp_worker, 4, state, _plain(config), prompt, reqs, timeout=180)
    dense = M.HandLlama(hf.state_dict(), config)
    one = E.Engine(dense, 64, 4, 4, "continuous", choose=E.Chooser(0.1, 0)).run(reqs)
    for ((tok, lg), (_, bad)), tokens, logits, pool_bytes in ranks:
        assert torch.equal(tok, ref_t)
        assert (lg - ref_l).abs().max() <= C.PARITY_TOL
        assert (bad - ref_l).abs().max() > C.PARITY_TOL  # without g the same check fails
        assert tokens == one["tokens"]
        assert max(float((logits[k] - one["logits"][k]).abs().max()) for k in logits) <= C.PARITY_TOL
        assert 4 * pool_bytes == dense.kv_pool(64, 4).bytes()  # a quarter of the heads per rank


@pytest.mark.timeout(120)
def test_cache_and_transformers_generate_match_no_cache():
    cfg, config, hf, prompt, (ref_t, ref_l) = _reference(12)
    dense = M.HandLlama(hf.state_dict(), config)
    tok, lg = M.generate(dense, prompt, 12, use_cache=True)
    assert torch.equal(tok, ref_t) and (lg - ref_l).abs().max() <= C.PARITY_TOL
    hf_t, hf_l = M.hf_generate(hf, prompt, 12)
    assert M.top2_margin(ref_l) > 2 * C.HF_TOL  # no near-tie can flip a token
    assert torch.equal(hf_t, ref_t) and (hf_l - ref_l).abs().max() <= C.HF_TOL
    _, bad = C.wrong_position_generate(dense, prompt, 12)
    assert (bad - ref_l).abs().max() > C.PARITY_TOL
    assert (hf_l - bad).abs().max() > C.HF_TOL  # the transformers tolerance tells them apart


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
def test_prefix_keys_need_the_whole_prefix_and_full_blocks():
    m = P.BlockManager(16, 4)
    assert m.allocate(0, [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 0
    # the same second block after a different first one: nothing shared
    assert m.allocate(1, [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0
    assert m.tables[1][1] != m.tables[0][1]
    # the same tokens at another position: a different block (its keys were rotated elsewhere)
    assert m.allocate(6, [5, 6, 7, 8, 1]) == 0
    m.finish(6)
    # a partly filled block is never shared: [1..5] leaves block 1 with one token
    assert m.allocate(2, [1, 2, 3, 4, 5]) == 4
    assert m.allocate(3, [1, 2, 3, 4, 5, 6, 7, 9, 1]) == 4 and m.tables[3][1] != m.tables[2][1]
    # a prompt of whole cached blocks still computes its last block (its last token's logits)
    assert m.allocate(4, [1, 2, 3, 4, 5, 6, 7, 8]) == 4
    # finished blocks stay cached until reused: a later request revives them
    for seq in range(5):
        m.finish(seq)
    assert m.allocate(5, [1, 2, 3, 4, 5, 6, 7, 8, 3]) == 8 and not m.check()
    # a block filled by decoding enters the cache once full
    m.allocate(7, [1, 2, 3, 4, 10, 11])
    m.append(7, 12)
    assert m.allocate(8, [1, 2, 3, 4, 10, 11, 12, 0, 2]) == 4  # block 1 holds 3 tokens: not cached
    m.append(7, 13)
    assert m.allocate(9, [1, 2, 3, 4, 10, 11, 12, 13, 2]) == 8 and not m.check()
    off = P.BlockManager(16, 4, prefix_cache=False)
    off.allocate(0, [1, 2, 3, 4, 5])
    assert off.allocate(1, [1, 2, 3, 4, 5]) == 0


@pytest.mark.timeout(60)
def test_continuous_batching_beats_static_by_the_length_distribution():
    cfg = T.Config()
    outs = [o for _, o in WL.workload(cfg.requests_per_rank, cfg.max_decode, cfg.seed)]
    s, c = WL.static_schedule(outs, cfg.batch), WL.continuous_schedule(outs, cfg.batch)
    # the test's own count of static steps: each batch costs its longest request
    assert s["steps"] == _static_steps(outs, cfg.batch)
    assert c["steps"] == _continuous_steps(outs, cfg.batch)
    assert c["padded"] == c["steps"] * cfg.batch - sum(outs)
    assert s["steps"] / c["steps"] >= 1.5
    assert c["steps"] >= -(-sum(outs) // cfg.batch)
    # equal lengths: nothing to gain, the ratio is exactly 1
    same = [10] * 64
    assert WL.static_schedule(same, 8)["steps"] == WL.continuous_schedule(same, 8)["steps"] == 80


def _requests(config, n=20, max_decode=12, seed=3):
    cfg = T.Config()
    work = WL.workload(n, max_decode, seed=seed)
    return [E.Request(C.prompt_of(cfg, config.vocab_size, 50 + i, p)[0].tolist(), d)
            for i, (p, d) in enumerate(work)]


def _worst(run, refs):
    """(max |logit diff|, sequences with a differing token) of a run against references."""
    worst = max(float((run["logits"][k] - lg).abs().max()) for k, (_, lg, _) in refs.items())
    return worst, sum(run["tokens"][k] != t for k, (t, _, _) in refs.items())


@pytest.mark.timeout(120)
def test_engines_equal_contiguous_cache_and_their_counted_schedules():
    _, config, hf, _, _ = _reference(1)
    llama = M.HandLlama(hf.state_dict(), config)
    reqs = _requests(config)
    decode = [r.n_decode for r in reqs]
    # counted here, not by paged.py
    expect = {"static": _static_steps(decode, 4), "continuous": _continuous_steps(decode, 4)}
    expect["overlap"] = expect["continuous"]
    refs = {(j, 0): E.reference(llama, r.prompt, 1 + r.n_decode, E.Chooser(), j) for j, r in enumerate(reqs)}
    runs = {mode: E.Engine(llama, 64, 4, 4, mode).run(reqs) for mode in expect}
    for mode, run in runs.items():
        assert run["decode_steps"] == expect[mode], mode
        assert _worst(run, refs)[0] <= C.PARITY_TOL and _worst(run, refs)[1] == 0, mode
    assert expect["static"] > expect["continuous"]
    # the overlap engine made plans while a step ran; the synchronous one never did
    assert C.overlap_intervals(runs["overlap"]["timeline"])[1] > 0
    assert C.overlap_intervals(runs["continuous"]["timeline"])[1] == 0
    # control: a block table that names a wrong block
    bad = C.ScrambledTables(llama, 64, 4, 4, "continuous").run(reqs)
    assert _worst(bad, refs)[0] > C.PARITY_TOL
    with pytest.raises(ValueError):
        E.Engine(llama, 64, 4, 4, "eager")


class _NoCopy(E.Engine):
    """Control: copy-on-write that forgets to copy (the new block's keys are whatever it held)."""

    def execute(self, plan):
        return super().execute({**plan, "copies": []})


class _PromptOnlyRecompute(E.Engine):
    """Control: a preempted sequence recomputes its prompt only, dropping its output so far."""

    def _preempt(self, seq):
        super()._preempt(seq)
        del seq.ids[len(seq.ids) - len(seq.out):]


@pytest.mark.timeout(120)
def test_prefix_cache_forks_and_preemption_keep_every_token():
    cfg, config, hf, _, _ = _reference(1)
    llama = M.HandLlama(hf.state_dict(), config)
    small = T.Config(chat_requests=10)
    reqs = WL.chat_workload(small, config.vocab_size, 5)
    choose = E.Chooser(0.1, 0)
    refs = {(i, s): E.reference(llama, r.prompt, 1 + r.n_decode, choose, i, s)
            for i, r in enumerate(reqs) for s in range(r.n)}
    assert min(m for _, _, m in refs.values()) > 2 * C.PARITY_TOL
    run = lambda blocks, cache=True, cls=E.Engine, mode="continuous": cls(  # noqa: E731
        llama, blocks, 4, 8, mode, cache, choose).run(reqs)
    on, off, tight, tight_overlap = run(128), run(128, False), run(small.tight_blocks), \
        run(small.tight_blocks, mode="overlap")
    tighter = [run(blocks, mode=mode) for blocks in (16, 17) for mode in ("continuous", "overlap")]
    for r in (on, off, tight, tight_overlap, *tighter):
        assert _worst(r, refs)[0] <= C.PARITY_TOL and _worst(r, refs)[1] == 0
    # prefix caching: the prompts' shared full blocks (counted here from the token lists) are
    # not recomputed; the prefill tokens fall by exactly that many
    shared = 0
    for i, r in enumerate(reqs):
        earlier = [q.prompt for q in reqs[:i]]
        full = (len(r.prompt) - 1) // 4
        shared += 4 * max((max(k for k in range(full + 1) if e[:4 * k] == r.prompt[:4 * k]) for e in earlier),
                          default=0)
    assert shared > 0 and on["cached_tokens"] == shared and off["cached_tokens"] == 0
    assert off["prefill_tokens"] - on["prefill_tokens"] == shared
    assert on["peak_blocks"] < off["peak_blocks"]
    # forks shared the prompt's blocks: the partial last block was copied, and that copy matters
    assert on["copies"] > 0
    assert _worst(run(128, cls=_NoCopy), refs)[0] > C.PARITY_TOL
    # a pool too small: preempted, recomputed, nothing lost, never more blocks than the pool
    for r in (tight, tight_overlap):
        assert r["preemptions"] > 0 and r["peak_blocks"] == small.tight_blocks < on["peak_blocks"]
        assert all(len(t) == 1 + reqs[i].n_decode for (i, _), t in r["tokens"].items())
        assert len(r["tokens"]) == len(refs)
    assert _worst(run(small.tight_blocks, cls=_PromptOnlyRecompute), refs)[0] > C.PARITY_TOL


@pytest.mark.timeout(60)
def test_exercise_answers():
    # 1: the gain for B = 32
    assert round(WL.expected_ratio(16, 32), 3) == 1.866 == round(_expected_ratio(16, 32), 3)
    # 3: Llama-3.1-8B's KV bytes per token and the 4096-token sequences an H200 holds
    per_token = WL.kv_bytes_per_token(32, 8, 128, 2)
    assert per_token == 131072
    assert WL.sequences_that_fit(141e9, 2 * 8.03e9, per_token, 4096) == 206
    assert WL.sequences_that_fit(141e9, 2 * 8.03e9, WL.kv_bytes_per_token(32, 32, 128, 2), 4096) == 51
    # 4: admission steps are the continuous schedule's: the last request ends when it does
    cfg = T.Config()
    work = [d for _, d in WL.workload(cfg.requests_per_rank * 2, cfg.max_decode, cfg.seed)][0::2]
    at = WL.admitted_at(work, cfg.batch)
    assert max(a + d for a, d in zip(at, work)) == WL.continuous_schedule(work, cfg.batch)["steps"]
    assert at[: cfg.batch] == [0] * cfg.batch and sorted(at) == at
    # 5: a 2,000-token system prompt before 200 user tokens, blocks of 16 and of 32
    system = list(range(2000))
    reqs = [E.Request(system + [3000 + u] * 200, 1) for u in range(2)]
    assert WL.expected_cached_tokens(reqs, 16) == 2000
    assert WL.expected_cached_tokens(reqs, 32) == 1984


@pytest.mark.timeout(120)
def test_a_block_is_shared_only_once_its_keys_are_written():
    """Request B's prompt is A's prompt and A's first three outputs, and B is admitted (when C
    ends) just after A's 2nd output is known: A's second block then has all its token ids but
    not yet the keys of its last position (the next decode step writes them). The manager
    reuses only A's first block; one that keys a block as soon as its ids are known lets B's
    prefill, which runs before that step, read keys not written yet: the logits catch it."""
    _, config, hf, _, _ = _reference(1)
    llama = M.HandLlama(hf.state_dict(), config)
    a = [5, 17, 33, 2, 60, 41]
    a_out = E.reference(llama, a, 12, E.Chooser())[0]
    reqs = [E.Request(a, 11), E.Request([9, 9, 1], 1), E.Request(a + a_out[:3] + [3], 3)]
    refs = {(i, 0): E.reference(llama, r.prompt, 1 + r.n_decode, E.Chooser(), i) for i, r in enumerate(reqs)}

    class EarlyKeys(P.BlockManager):
        def _key_full_blocks(self, seq):
            slots = self.slots[seq]
            self.slots[seq] = len(self.tokens[seq])  # as if every known token's slot were written
            try:
                super()._key_full_blocks(seq)
            finally:
                self.slots[seq] = slots

    for manager in (P.BlockManager, EarlyKeys):
        engine = E.Engine(llama, 64, 4, 2, "continuous")
        engine.mgr = manager(64, 4)
        run = engine.run(reqs)
        assert run["cached_tokens"] == (4 if manager is P.BlockManager else 8)
        worst = _worst(run, refs)[0]
        assert (worst <= C.PARITY_TOL) if manager is P.BlockManager else (worst > C.PARITY_TOL)


@pytest.mark.timeout(60)
def test_overlap_guards_hold_back_a_sequence_in_flight():
    _, config, hf, _, _ = _reference(1)
    llama = M.HandLlama(hf.state_dict(), config)
    engine = E.Engine(llama, 8, 4, 4, "overlap")
    seq = E.Seq(0, 0, 0, [1, 2, 3], want=5, planned=2, out=[7])  # its 2nd token still in flight
    assert not engine._admissible(seq)
    seq.out.append(8)
    assert engine._admissible(seq)
    # a plan that preempts admits nothing: two running sequences fill the pool at a boundary
    engine.running = [E.Seq(i, i, 0, [1, 2, 3, 4], want=9, planned=1, n_pos=4) for i in (1, 2)]
    for s in engine.running:
        engine.mgr.allocate(s.sid, s.ids)
    engine.waiting = [E.Seq(3, 3, 0, [5, 6], want=2)]
    engine.everyone = {}
    while engine.mgr.free:
        engine.mgr._take()
    plan = engine.schedule()
    assert engine.stats["preemptions"] == 1 and not plan["prefills"]
    assert [s.sid for s in engine.waiting] == [2, 3]
