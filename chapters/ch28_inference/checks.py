"""What chapter 28's run proves and measures: generation parity (cache, transformers, tensor
parallelism), the block manager's invariants, the engine on the chat workload (paged attention
against contiguous caches, prefix caching, preemption, the TP engine) and on the batching
workload (decode steps against the schedule model and E[max]/E[mean], the overlap timeline,
the benchmark), each with its negative control. The workloads and the models the engine's
counts are compared with are in `workloads.py`."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from chapters.ch28_inference import engine as E
from chapters.ch28_inference import model as M
from chapters.ch28_inference import paged as P
from chapters.ch28_inference import workloads as WL
from common.distributed import gather_numbers
from common.timing import synchronize

PARITY_TOL = 1e-10  # float64: ~1e-16 per operation, a few thousand operations per logit
HF_TOL = 1e-6  # transformers computes RMSNorm and RoPE in float32 even for a float64 model


def prompt_of(cfg, vocab: int, seed: int, length: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length or cfg.prompt_len), generator=g)


def wrong_position_generate(model, prompt, n_new):
    """Negative control of the cache: every cached step rotated as if it were position 0."""
    cache, step_in, toks, logits = model.new_cache(), prompt, [], []
    for _ in range(n_new):
        out = model.forward(step_in, cache, 0)[:, -1]
        step_in = out.argmax(-1, keepdim=True)
        toks.append(step_in)
        logits.append(out)
    return torch.cat(toks, 1), torch.stack(logits, 1)


def record_generation(rec, cfg, hf, config, info) -> dict:
    """Cached vs uncached vs transformers' generate, and TP over all ranks vs one device."""
    dense = M.HandLlama(hf.state_dict(), config, device=info.device)
    prompt = prompt_of(cfg, config.vocab_size, cfg.seed + 1)
    ref_t, ref_l = M.generate(dense, prompt, cfg.steps, use_cache=False)
    tok, lg = M.generate(dense, prompt, cfg.steps, use_cache=True)
    rec.check("cached = uncached: max |logit diff|", "parity", float((lg - ref_l).abs().max()), 0.0, PARITY_TOL)
    rec.check("cached = uncached: greedy tokens differing", "count", int((tok != ref_t).sum()), 0)
    bad_t, bad_l = wrong_position_generate(dense, prompt, cfg.steps)
    rec.check("control: cache at the wrong positions differs", "parity",
              float((bad_l - ref_l).abs().max()), PARITY_TOL, compare=">")
    hf_t, hf_l = M.hf_generate(hf, prompt, cfg.steps)
    margin = M.top2_margin(ref_l)
    rec.check("transformers generate: max |logit diff|", "parity", float((hf_l - ref_l.cpu()).abs().max()), 0.0, HF_TOL)
    rec.check("top-2 margin exceeds 2x the tolerance", "formula", margin, 2 * HF_TOL, compare=">")
    rec.check("transformers generate: tokens differing", "count", int((hf_t != ref_t.cpu()).sum()), 0)
    rec.check("control: transformers vs the wrong-position cache differs", "parity",
              float((hf_l - bad_l.cpu()).abs().max()), HF_TOL, compare=">")

    tp = info.world_size
    shard = M.HandLlama(hf.state_dict(), config, info.rank, tp, device=info.device)
    tp_t, tp_l = M.generate(shard, prompt, cfg.steps, use_cache=True)
    rec.check(f"TP on {tp} ranks = one device: max |logit diff|", "parity",
              float((tp_l - ref_l).abs().max()), 0.0, PARITY_TOL)
    rec.check(f"TP on {tp} ranks: tokens differing", "count", int((tp_t != ref_t).sum()), 0)
    if tp > 1:
        broken = M.HandLlama(hf.state_dict(), config, info.rank, tp, reduce=False, device=info.device)
        _, br_l = M.generate(broken, prompt, cfg.steps, use_cache=True)
        rec.check("control: TP without the all-reduce differs", "parity",
                  float((br_l - ref_l).abs().max()), PARITY_TOL, compare=">")

    # decode speed with and without the cache (one device, reported): the best of three runs,
    # since a run of a few milliseconds on a shared CPU is easily interrupted
    speeds = {}
    for use_cache in (True, False):
        M.generate(dense, prompt, 2, use_cache)  # warm-up
        best = float("inf")
        for _ in range(3):
            synchronize(info.device)
            t0 = time.perf_counter()
            M.generate(dense, prompt, cfg.steps, use_cache)
            synchronize(info.device)
            best = min(best, time.perf_counter() - t0)
        speeds[use_cache] = cfg.steps / best
    rec.figure("decode tokens/s with the KV cache", round(speeds[True], 1), unit="tok/s")
    rec.figure("decode tokens/s without it", round(speeds[False], 1), unit="tok/s")
    rec.check("the cache decodes faster (wall clock)", "timing", speeds[True] / speeds[False], 1.0, compare=">")
    return {"margin": margin, "speedup": speeds[True] / speeds[False]}


def record_block_manager(rec, cfg) -> dict:
    good = P.random_stream(P.BlockManager(cfg.n_blocks, cfg.block_size), cfg.stream_ops, cfg.seed)
    leaky = P.random_stream(P.LeakyManager(cfg.n_blocks, cfg.block_size), cfg.stream_ops, cfg.seed)
    rec.check(f"block manager: violations in {cfg.stream_ops} checked operations", "count", good["violations"], 0)
    rec.check("block manager: blocks free after every sequence finished", "count", good["free_at_end"], cfg.n_blocks)
    rec.check("control: the leaky manager is caught", "count", leaky["violations"], 0, compare=">")
    rec.figure("stream: prefix-cache hits, copy-on-write copies", [good["shared_hits"], good["copies"]])
    # the shared prefix is freed by its last user only
    m = P.BlockManager(8, cfg.block_size)
    system = list(range(2 * cfg.block_size))
    m.allocate(0, system + [100])
    m.allocate(1, system + [200])
    shared = m.tables[0][:2]
    m.finish(0)
    held = sum(b not in m.free for b in shared)
    m.finish(1)
    rec.check("shared prefix blocks held after the first user finishes", "count", held, 2)
    rec.check("... and free after the last", "count", sum(b in m.free for b in shared), 2)
    return good


def compare_runs(runs: dict, refs: dict) -> tuple[float, int]:
    """(max |logit diff|, sequences with a differing token) of engine runs against references."""
    worst, wrong = 0.0, 0
    for run in runs.values():
        for key, (tokens, logits, _) in refs.items():
            wrong += int(run["tokens"][key] != tokens)
            worst = max(worst, float((run["logits"][key].cpu() - logits.cpu()).abs().max()))
    return worst, wrong


class ScrambledTables(E.Engine):
    """Negative control: one decode row's table names its first block twice, so that row reads
    the keys of positions 0..b-1 where those of b..2b-1 belong. (Swapping two full blocks would
    not do: the keys carry their rotary positions, and attention sums over keys in any order.)"""

    def schedule(self) -> dict:
        plan = super().schedule()
        for table in plan["tables"]:
            if len(table) > 2:
                table[1] = table[0]
                break
        return plan


def record_serving(rec, cfg, hf, config, info) -> dict:
    """The engine on the chat workload: paged attention against contiguous caches, prefix
    caching on and off, a pool that forces preemption, and tensor parallelism over all ranks."""
    dense = M.HandLlama(hf.state_dict(), config, device=info.device)
    choose = E.Chooser(temperature=0.1, seed=cfg.seed)
    reqs = WL.chat_workload(cfg, config.vocab_size, cfg.seed + 7)
    refs = {(i, s): E.reference(dense, r.prompt, 1 + r.n_decode, choose, i, s)
            for i, r in enumerate(reqs) for s in range(r.n)}
    engine = lambda blocks, cache=True, cls=E.Engine, model=dense: cls(  # noqa: E731
        model, blocks, cfg.block_size, cfg.batch, "continuous", cache, choose).run(reqs)
    runs = {"cache": engine(cfg.n_blocks), "no cache": engine(cfg.n_blocks, False),
            "tight": engine(cfg.tight_blocks)}
    worst, wrong = compare_runs(runs, refs)
    margin = min(m for _, _, m in refs.values())
    rec.check("paged engine = contiguous cache: max |logit diff|", "parity", worst, 0.0, PARITY_TOL)
    rec.check(f"paged engine: sequences with a differing token (of {len(refs)})", "count", wrong, 0)
    rec.check("top-2 margin of the sampled choices > 2x the tolerance", "formula", margin,
              2 * PARITY_TOL, compare=">")
    bad, _ = compare_runs({"bad": engine(cfg.n_blocks, cls=ScrambledTables)}, refs)
    rec.check("control: one block table scrambled differs", "parity", bad, PARITY_TOL, compare=">")

    on, off = runs["cache"], runs["no cache"]
    rec.check("prefix cache: prompt tokens reused", "count", on["cached_tokens"],
              WL.expected_cached_tokens(reqs, cfg.block_size))
    rec.check("no prefix cache: prompt tokens reused", "count", off["cached_tokens"], 0)
    rec.figure("prefill tokens computed: with, without prefix caching",
               [on["prefill_tokens"], off["prefill_tokens"]], expected=sum(len(r.prompt) for r in reqs))
    rec.figure("peak KV blocks held: with, without prefix caching", [on["peak_blocks"], off["peak_blocks"]])
    rec.figure("copy-on-write block copies (parallel samples)", on["copies"])
    tight = runs["tight"]
    rec.check(f"pool of {cfg.tight_blocks} blocks: preemptions", "count", tight["preemptions"], 0, compare=">")
    rec.check(f"the pool was the limit: unconstrained peak > {cfg.tight_blocks} blocks", "formula",
              on["peak_blocks"], cfg.tight_blocks, compare=">")
    rec.check(f"pool of {cfg.tight_blocks} blocks: peak blocks held", "count", tight["peak_blocks"],
              cfg.tight_blocks)
    rec.check("preempted run: sequences finished whole", "count",
              sum(len(t) == 1 + reqs[i].n_decode for (i, _), t in tight["tokens"].items()), len(refs))
    rec.figure("preempted run: prefill tokens computed (recompute included)", tight["prefill_tokens"])

    W = info.world_size
    if W > 1:  # the same engine tensor-parallel over every rank: each rank holds its heads' blocks
        shard = M.HandLlama(hf.state_dict(), config, info.rank, W, device=info.device)
        tp = engine(cfg.n_blocks, model=shard)
        rec.check(f"TP engine on {W} ranks: tokens differing from one device", "count",
                  sum(tp["tokens"][k] != on["tokens"][k] for k in refs), 0)
        rec.check(f"TP engine on {W} ranks: max |logit diff|", "parity",
                  max(float((tp["logits"][k] - on["logits"][k]).abs().max()) for k in refs), 0.0, PARITY_TOL)
        broken = M.HandLlama(hf.state_dict(), config, info.rank, W, reduce=False, device=info.device)
        bad = engine(cfg.n_blocks, model=broken)
        rec.check("control: the TP engine without the all-reduce differs", "parity",
                  max(float((bad["logits"][k] - on["logits"][k]).abs().max()) for k in refs), PARITY_TOL,
                  compare=">")
        per_rank = shard.kv_pool(cfg.n_blocks, cfg.block_size).bytes()
        rec.check("TP: KV pool bytes per rank x ranks = 2 L blocks b h 8", "formula", per_rank * W,
                  2 * cfg.n_layers * cfg.n_blocks * cfg.block_size * cfg.hidden_size * 8)
    return {"runs": runs, "margin": margin}


def overlap_intervals(timeline: list) -> tuple[int, int, float]:
    """From an engine's timeline: (plans made after a previous step, of them made while that step
    executed, seconds of that overlap). Plan t+1's scheduling overlaps step t's execution."""
    steps = {no: (a, b) for kind, no, a, b in timeline if kind == "step"}
    after = during = 0
    seconds = 0.0
    for kind, no, a, b in timeline:
        if kind == "schedule" and no - 1 in steps:
            after += 1
            s0, s1 = steps[no - 1]
            if min(b, s1) > max(a, s0):
                during += 1
                seconds += min(b, s1) - max(a, s0)
    return after, during, seconds


def record_batching(rec, cfg, hf, config, info) -> dict:
    """The batching workload, request i on rank i mod world: static, continuous and overlapped
    continuous engines, their decode steps against the schedule model and summed over ranks
    against E[max]/E[mean]; tokens against a contiguous cache; TTFT and TPOT."""
    model = M.HandLlama(hf.state_dict(), config, device=info.device)
    W, choose = info.world_size, E.Chooser()
    work = WL.workload(cfg.requests_per_rank * W, cfg.max_decode, cfg.seed)
    mine = [(i, p, d) for i, (p, d) in enumerate(work) if i % W == info.rank]
    reqs = [E.Request(prompt_of(cfg, config.vocab_size, 1000 + i, p)[0].tolist(), d) for i, p, d in mine]
    E.Engine(model, cfg.n_blocks, cfg.block_size, cfg.batch).run(reqs[:cfg.batch])  # warm-up
    runs = {}
    for mode in E.MODES:
        synchronize(info.device)
        runs[mode] = E.Engine(model, cfg.n_blocks, cfg.block_size, cfg.batch, mode).run(reqs)
    # every 8th request against a contiguous cache (the chat workload checked every one), and
    # every request of the other engines against the continuous one
    refs = {(j, 0): E.reference(model, r.prompt, 1 + r.n_decode, choose, j) for j, r in enumerate(reqs)
            if j % 8 == 0}
    worst, wrong = compare_runs({"continuous": runs["continuous"]}, refs)
    same = {k: (t, runs["continuous"]["logits"][k], None) for k, t in runs["continuous"]["tokens"].items()}
    worst2, wrong2 = compare_runs({m: runs[m] for m in ("static", "overlap")}, same)
    rec.check(f"continuous engine = contiguous cache ({len(refs)} requests): max |logit diff|", "parity",
              worst, 0.0, PARITY_TOL)
    rec.check(f"static, overlap engines = continuous ({len(reqs)} requests): max |logit diff|", "parity",
              worst2, 0.0, PARITY_TOL)
    rec.check("engines: requests with a differing token", "count", wrong + wrong2, 0)
    decode = [r.n_decode for r in reqs]
    expect = {"static": WL.static_schedule(decode, cfg.batch)["steps"],
              "continuous": WL.continuous_schedule(decode, cfg.batch)["steps"]}
    expect["overlap"] = expect["continuous"]
    for mode, run in runs.items():
        rec.check(f"engine decode steps = schedule model, {mode} (rank {info.rank})", "count",
                  run["decode_steps"], expect[mode])
    total = {mode: sum(gather_numbers(run["decode_steps"])) for mode, run in runs.items()}
    ratio, predicted = total["static"] / total["continuous"], WL.expected_ratio(cfg.max_decode, cfg.batch)
    rec.figure("engine decode steps summed over ranks: static, continuous", [total["static"], total["continuous"]])
    rec.check("engines: static / continuous decode steps >= 1.5", "formula", ratio, 1.5, compare=">=")
    rec.check("... within 5% of E[max]/E[mean]", "formula", ratio, round(predicted, 4), 0.05, relative=True)
    seconds = {mode: max(gather_numbers(run["seconds"])) for mode, run in runs.items()}
    rec.figure("engine wall clock: static, continuous, overlap", [round(seconds[m], 3) for m in runs], unit="s")
    rec.check("continuous / static wall-clock throughput", "timing", seconds["static"] / seconds["continuous"],
              1.0, compare=">")

    after, during, secs = overlap_intervals(runs["overlap"]["timeline"])
    sync = overlap_intervals(runs["continuous"]["timeline"])
    rec.figure("overlap: plans made while the previous step ran, of plans (rank 0)", [during, after])
    rec.figure("overlap: seconds of scheduling hidden behind steps (rank 0)", round(secs, 4), unit="s")
    rec.check("overlap engine: plans made while the previous step ran", "count", during, 0, compare=">")
    rec.check("control: the synchronous engine's plans never overlap a step", "count", sync[1], 0)

    cont = runs["continuous"]
    keys = [(j, 0) for j in range(len(reqs))]
    ttft = [cont["ttft"][k] for k in keys]
    tpot = [(cont["done_at"][k] - cont["ttft"][k]) / r.n_decode for k, r in zip(keys, reqs)]
    all_ttft = [x for r in gather_numbers_list(ttft, info) for x in r]
    all_tpot = [x for r in gather_numbers_list(tpot, info) for x in r]
    rec.check("benchmark: requests served over all ranks", "count", len(all_ttft), len(work))
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1e3 if len(xs) > 1 else xs[0] * 1e3  # noqa: E731
    rec.figure("TTFT p50, p99 (continuous)", [round(q(all_ttft, 50), 2), round(q(all_ttft, 99), 2)], unit="ms")
    rec.figure("TPOT p50, p99 (continuous)", [round(q(all_tpot, 50), 3), round(q(all_tpot, 99), 3)], unit="ms")
    tokens = sum(1 + d for _, d in work)
    wall = seconds["continuous"]
    rec.figure("requests/s, output tokens/s (continuous)", [round(len(work) / wall, 1), round(tokens / wall, 1)])
    return {"ratio": ratio, "predicted": predicted, "total": total, "seconds": seconds,
            "overlap": (during, after, secs)}


def gather_numbers_list(values: list[float], info) -> list[list[float]]:
    """Every rank's list of floats (lengths may differ), on every rank: padded to the longest,
    all-gathered as one tensor on the communication device."""
    if info.world_size == 1:
        return [list(values)]
    n = max(gather_numbers(len(values)))
    t = torch.full((n,), float("nan"), dtype=torch.float64, device=info.device)
    t[: len(values)] = torch.tensor(values, dtype=torch.float64)
    parts = [torch.empty_like(t) for _ in range(info.world_size)]
    dist.all_gather(parts, t)
    return [[float(x) for x in p.cpu() if x == x] for p in parts]
