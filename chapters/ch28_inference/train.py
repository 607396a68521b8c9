"""Distributed inference: a Llama with a hand-written KV cache checked against generation without
a cache and against transformers' `generate`; the same model tensor-parallel over every rank;
a paged KV block manager under a long random request stream; static against continuous batching
counted in decode steps; and an offline benchmark (TTFT, TPOT, percentiles) with the prompts
sharded over the ranks.

The model is a Llama built from a local `LlamaConfig` (random weights, float64: exact parity);
nothing is downloaded.

Run:
    python chapters/ch28_inference/train.py                                        # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch28_inference/train.py      # CPU, seconds
    torchrun --standalone --nproc_per_node=4 chapters/ch28_inference/train.py
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        chapters/ch28_inference/train.py
"""

import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chapters.ch28_inference import engine as E
from chapters.ch28_inference import model as M
from chapters.ch28_inference import paged as P
from common.config import RunConfig, parse_config
from common.distributed import gather_numbers, setup_distributed, teardown_distributed
from common.log import log, setup_logging
from common.results import RunRecorder
from common.timing import synchronize

PARITY_TOL = 1e-10  # float64: ~1e-16 per operation, a few thousand operations per logit
HF_TOL = 1e-6  # transformers computes RMSNorm and RoPE in float32 even for a float64 model


@dataclass
class Config(RunConfig):
    steps: int = 16
    """New tokens per generation (parity runs and the benchmark)."""
    n_heads: int = 16
    """Attention heads (= key/value heads); the tensor-parallel degree (the world) must divide it."""
    hidden_size: int = 64
    """Model width h."""
    n_layers: int = 2
    """Decoder layers."""
    prompt_len: int = 8
    """Prompt tokens of the parity runs."""
    requests: int = 64
    """Requests of the batching workload and of the benchmark (sharded over the ranks)."""
    max_out: int = 64
    """Output lengths of the batching workload are uniform on 1..max_out."""
    batch: int = 8
    """Batch slots of the static and continuous schedules."""
    block_size: int = 4
    """Token slots per KV block of the paged block manager."""
    n_blocks: int = 64
    """KV blocks in the block manager's pool."""
    stream_ops: int = 3000
    """Operations of the random request stream (invariants checked after each)."""


def validate(cfg: Config, world_size: int) -> None:
    if cfg.n_heads % world_size:
        raise ValueError(f"the tensor-parallel degree {world_size} (the world size) must divide "
                         f"--n-heads {cfg.n_heads}")
    if cfg.hidden_size % cfg.n_heads or (cfg.hidden_size // cfg.n_heads) % 2:
        raise ValueError("--hidden-size / --n-heads must be an even head size")
    if (2 * cfg.hidden_size) % world_size:
        raise ValueError("the world size must divide the FFN size 2 x --hidden-size")
    for name in ("prompt_len", "requests", "max_out", "batch", "block_size", "n_blocks", "stream_ops"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


def build(cfg: Config):
    config = M.llama_config(hidden_size=cfg.hidden_size, n_layers=cfg.n_layers,
                            n_heads=cfg.n_heads, ffn_size=2 * cfg.hidden_size,
                            max_len=cfg.prompt_len + cfg.steps + 32)
    hf = M.hf_model(config, cfg.seed)
    return config, hf


def prompt_of(cfg: Config, vocab: int, seed: int, length: int | None = None) -> torch.Tensor:
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


def expected_ratio(max_out: int, batch: int) -> float:
    """E[max of `batch` draws] / E[one draw] for outputs uniform on 1..max_out: static pays
    the longest request of each batch, continuous (nearly) only the mean."""
    n = max_out
    e_max = sum(1 - ((k - 1) / n) ** batch for k in range(1, n + 1))
    return e_max / ((n + 1) / 2)


def record_batching(rec, cfg) -> dict:
    outs = [o for _, o in P.workload(cfg.requests, cfg.max_out, cfg.seed)]
    s, c = P.static_schedule(outs, cfg.batch), P.continuous_schedule(outs, cfg.batch)
    ratio = s["steps"] / c["steps"]
    rec.figure("decode steps: static, continuous", [s["steps"], c["steps"]])
    rec.figure("padded slots: static, continuous", [s["padded"], c["padded"]])
    rec.figure("continuous / static throughput (steps)", round(ratio, 3),
               expected=round(expected_ratio(cfg.max_out, cfg.batch), 3))
    rec.check("continuous / static throughput >= 1.5", "formula", ratio, 1.5, compare=">=")
    rec.check("continuous steps >= ceil(tokens / batch)", "formula", c["steps"],
              -(-sum(outs) // cfg.batch), compare=">=")
    return {"static": s, "continuous": c, "outs": outs, "ratio": ratio}


def benchmark(rec, cfg, hf, config, info) -> dict:
    """Offline benchmark: the default workload's request i is served by rank i mod world (one
    model replica per rank, `cfg.batch` slots) with static, continuous and asynchronous
    continuous batching; each engine's tokens are checked against generation without a cache,
    its decode steps against the counted schedule; TTFT and TPOT gathered to rank 0."""
    model = M.HandLlama(hf.state_dict(), config, device=info.device)
    work = P.workload(cfg.requests, cfg.max_out, cfg.seed)
    mine = [i for i in range(cfg.requests) if i % info.world_size == info.rank]
    reqs = [(prompt_of(cfg, config.vocab_size, 1000 + i, work[i][0]), work[i][1]) for i in mine]
    runs = {}
    for mode in ("static", "continuous", "async"):
        synchronize(info.device)
        runs[mode] = E.serve(model, reqs, cfg.batch, mode)
    worst, wrong = 0.0, 0
    for j, (prompt, n_out) in enumerate(reqs):
        ref_t, ref_l = M.generate(model, prompt, n_out, use_cache=False)
        for run in runs.values():
            wrong += int(run["tokens"][j] != ref_t[0].tolist())
            worst = max(worst, float((run["logits"][j] - ref_l[0]).abs().max()))
    rec.check("engines (3 modes) = no-cache generation: max |logit diff|", "parity", worst, 0.0, PARITY_TOL)
    rec.check("engines: requests with a differing token", "count", wrong, 0)
    decode = [n - 1 for _, n in reqs]  # the prefill gives the first token
    expect = {"static": P.static_schedule(decode, cfg.batch)["steps"],
              "continuous": P.continuous_schedule([d for d in decode if d], cfg.batch)["steps"]}
    expect["async"] = expect["continuous"]
    for mode, run in runs.items():
        rec.check(f"engine decode steps, {mode} (rank {info.rank})", "count", run["steps"], expect[mode])
    seconds = {mode: max(gather_numbers(run["seconds"])) for mode, run in runs.items()}
    rec.figure("engine wall clock: static, continuous, async", [round(seconds[m], 3) for m in runs], unit="s")
    rec.check("continuous / static wall-clock throughput", "timing", seconds["static"] / seconds["continuous"],
              1.0, compare=">")
    rec.figure("async: prefills that overlapped a decode step (rank 0)", runs["async"]["overlapped_prefills"])

    cont = runs["continuous"]
    ttft = [cont["ttft"][j] for j in range(len(reqs))]
    tpot = [(cont["done_at"][j] - cont["ttft"][j]) / (n - 1) for j, (_, n) in enumerate(reqs) if n > 1]
    all_ttft = [x for r in gather_numbers_list(ttft, info) for x in r]
    all_tpot = [x for r in gather_numbers_list(tpot, info) for x in r]
    rec.check("benchmark: requests served over all ranks", "count", len(all_ttft), cfg.requests)
    wall = seconds["continuous"]
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1e3 if len(xs) > 1 else xs[0] * 1e3  # noqa: E731
    rec.figure("TTFT p50, p99 (continuous)", [round(q(all_ttft, 50), 2), round(q(all_ttft, 99), 2)], unit="ms")
    rec.figure("TPOT p50, p99 (continuous)", [round(q(all_tpot, 50), 3), round(q(all_tpot, 99), 3)], unit="ms")
    total = sum(n for _, n in work)
    rec.figure("requests/s, output tokens/s (continuous)", [round(cfg.requests / wall, 1), round(total / wall, 1)])
    return {"ttft": all_ttft, "tpot": all_tpot, "seconds": seconds}


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


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        torch.set_default_dtype(torch.float64)
        rec = RunRecorder(cfg, __file__, info)
        log.info("building a Llama from LlamaConfig (transformers import, a few seconds)")
        config, hf = build(cfg)
        log.info("Llama h=%d layers=%d heads=%d, TP over %d ranks on %s/%s", cfg.hidden_size,
                 cfg.n_layers, cfg.n_heads, info.world_size, info.device, info.backend)
        gen = record_generation(rec, cfg, hf, config, info)
        log.info("generation parity done (top-2 margin %.2e)", gen["margin"])
        record_block_manager(rec, cfg)
        bat = record_batching(rec, cfg)
        log.info("static %d steps, continuous %d steps", bat["static"]["steps"], bat["continuous"]["steps"])
        benchmark(rec, cfg, hf, config, info)
        rec.metrics(0, loss=None, lr=None, ratio=bat["ratio"])
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
