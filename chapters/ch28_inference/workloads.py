"""The two workloads the engine serves and the models that predict what it does with them,
fixed before anything is measured: the batching workload with the static and continuous
schedules counted in decode steps, E[max]/E[mean] and the queueing delay; the chat workload
with prefix caching's expected saving; the KV cache's bytes per token and the sequences that
fit in a device's memory. `checks.py` compares the engine's counts with these, and the
exercises use them.
"""

from __future__ import annotations

import random

from chapters.ch28_inference.engine import Request

# ---- the batching workload and the batching schedules, counted in decode steps --------------

def workload(n: int, max_decode: int, seed: int = 0, max_prompt: int = 16) -> list[tuple[int, int]]:
    """(prompt length, decode steps) per request, fixed before anything is measured: decode
    steps uniform on 1..max_decode (the request's output is 1 + that many tokens: its prefill
    gives the first), prompts uniform on 2..max_prompt."""
    rng = random.Random(seed)
    return [(rng.randint(2, max_prompt), rng.randint(1, max_decode)) for _ in range(n)]


def static_schedule(outs: list[int], batch: int) -> dict:
    """Batches of `batch` requests in order; a batch runs until its longest request ends, the
    finished rows' slots padded."""
    steps = slots = 0
    for i in range(0, len(outs), batch):
        group = outs[i: i + batch]
        steps += max(group)
        slots += max(group) * batch
    return {"steps": steps, "slots": slots, "tokens": sum(outs), "padded": slots - sum(outs)}


def continuous_schedule(outs: list[int], batch: int) -> dict:
    """`batch` slots; a finished request leaves at once and the next waiting one takes its
    slot at the next step (iteration-level scheduling, Orca)."""
    waiting, running, steps, slots = list(outs), [], 0, 0
    while waiting or running:
        while waiting and len(running) < batch:
            running.append(waiting.pop(0))
        steps += 1
        slots += batch
        running = [r - 1 for r in running if r > 1]
    return {"steps": steps, "slots": slots, "tokens": sum(outs), "padded": slots - sum(outs)}


def expected_ratio(max_decode: int, batch: int) -> float:
    """E[max of `batch` draws] / E[one draw] for decode steps uniform on 1..max_decode: static
    batching pays each batch's longest request, continuous (nearly) only the mean."""
    n = max_decode
    e_max = sum(1 - ((k - 1) / n) ** batch for k in range(1, n + 1))
    return e_max / ((n + 1) / 2)


def admitted_at(outs: list[int], batch: int) -> list[int]:
    """The decode step (0-based) before which each request takes a slot under continuous
    batching: its queueing delay, counted in steps (TTFT ~ this x the step time + its prefill)."""
    free_at, at = [0] * batch, []
    for o in outs:
        start = min(free_at)
        free_at[free_at.index(start)] = start + o
        at.append(start)
    return at


# ---- the chat workload and prefix caching's saving -----------------------------------------

def chat_workload(cfg, vocab: int, seed: int) -> list[Request]:
    """Chat requests: one of two system prompts of `system_len` tokens, then 1-8 user tokens;
    4-12 decode steps; every fourth request asks for two samples (n = 2, forked)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(cfg.system_len)] for _ in range(2)]
    return [Request(systems[i % 2] + [rng.randrange(vocab) for _ in range(rng.randint(1, 8))],
                      rng.randint(4, 12), n=2 if i % 4 == 0 else 1) for i in range(cfg.chat_requests)]


def expected_cached_tokens(reqs: list[Request], block_size: int) -> int:
    """Prefix caching's saving from the prompts alone: each request reuses its longest run of
    leading full blocks equal to an earlier request's (its last token always recomputed)."""
    total = 0
    for i, r in enumerate(reqs):
        best = 0
        for earlier in reqs[:i]:
            same = 0
            while (same + 1) * block_size <= min(len(r.prompt) - 1, len(earlier.prompt)) and \
                    r.prompt[: (same + 1) * block_size] == earlier.prompt[: (same + 1) * block_size]:
                same += 1
            best = max(best, same)
        total += best * block_size
    return total


# ---- KV cache memory -----------------------------------------------------------------------

def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer: 2 x L x kv_heads x head_dim x bytes."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def sequences_that_fit(memory: float, weights: float, per_token: int, seq_len: int,
                       utilization: float = 0.9) -> int:
    """Whole sequences of `seq_len` tokens whose KV cache fits in `utilization` of the device's
    memory after the weights (vLLM's --gpu-memory-utilization; activations ignored)."""
    return int((utilization * memory - weights) // (per_token * seq_len))
