# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 28 · Distributed inference · 推理阶段的分布式技术
#
# A Llama with a KV cache, checked against generation without one and against `transformers`;
# a paged KV block manager; static against continuous batching; then the real run on two
# processes (tensor-parallel generation and a sharded benchmark). The lesson is
# [chapters/ch28_inference/README.md](../chapters/ch28_inference/README.md).

# %%
import json

import torch

from chapters.ch28_inference import model as M
from chapters.ch28_inference import paged as P
from chapters.ch28_inference import train as T
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## The KV cache changes the work, not the answer
# Float64, so the cached and uncached logits agree to a few ulps.

# %%
torch.set_default_dtype(torch.float64)
cfg = T.Config()
config, hf = T.build(cfg)
llama = M.HandLlama(hf.state_dict(), config)
prompt = T.prompt_of(cfg, config.vocab_size, 1)
ref_t, ref_l = M.generate(llama, prompt, 12, use_cache=False)
tok, lg = M.generate(llama, prompt, 12, use_cache=True)
hf_t, hf_l = M.hf_generate(hf, prompt, 12)
print("cache:", torch.equal(tok, ref_t), f"{(lg - ref_l).abs().max():.1e}")
print("transformers:", torch.equal(hf_t, ref_t), f"{(hf_l - ref_l).abs().max():.1e}",
      f"top-2 margin {M.top2_margin(ref_l):.1e}")

# %% [markdown]
# ## Paged blocks: a long random stream, every invariant checked after each operation

# %%
print(P.random_stream(P.BlockManager(64, 4), 3000))
print(P.random_stream(P.LeakyManager(64, 4), 3000)["first_violation"])

# %% [markdown]
# ## Static against continuous batching, counted in decode steps

# %%
outs = [o for _, o in P.workload(cfg.requests, cfg.max_out, cfg.seed)]
s, c = P.static_schedule(outs, cfg.batch), P.continuous_schedule(outs, cfg.batch)
print(s, c, f"ratio {s['steps'] / c['steps']:.3f}, theory {T.expected_ratio(cfg.max_out, cfg.batch):.3f}")

# %% [markdown]
# ## The same schedules on the real model
# Three engines serve 16 requests in 4 slots; each one's tokens equal generation without a cache.

# %%
from chapters.ch28_inference import engine as E

work = P.workload(16, 24, seed=3)
reqs = [(T.prompt_of(cfg, config.vocab_size, 50 + i, p), n) for i, (p, n) in enumerate(work)]
for mode in ("static", "continuous", "async"):
    run = E.serve(llama, reqs, 4, mode)
    same = all(run["tokens"][j] == M.generate(llama, p, n, use_cache=False)[0][0].tolist()
               for j, (p, n) in enumerate(reqs))
    print(f"{mode:10s} {run['steps']:3d} decode steps, {run['seconds'] * 1e3:6.1f} ms, tokens = no-cache: {same}")

# %% [markdown]
# ## The real run: two processes

# %%
res = run_torchrun(REPO_ROOT / "chapters" / "ch28_inference" / "train.py", nproc=2, timeout=300)
summary = json.loads((res.out_dir / "summary.json").read_text())
for check in summary["checks"]:
    print(f"{check['name'][:60]:60s} {check['measured']!s:>12.12s} {'ok' if check['ok'] else 'FAIL'}")
