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
# the paged block manager; a serving engine whose attention reads a paged KV pool (prefix caching,
# parallel samples, preemption); static against continuous batching on the engines; the overlap
# scheduler's timeline; then the real run on two processes. The lesson is
# [chapters/ch28_inference/README.md](../chapters/ch28_inference/README.md).

# %%
import json

import torch

from chapters.ch28_inference import checks as C
from chapters.ch28_inference import model as M
from chapters.ch28_inference import paged as P
from chapters.ch28_inference import train as T
from chapters.ch28_inference import workloads as WL
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
prompt = C.prompt_of(cfg, config.vocab_size, 1)
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
# ## The engine: attention reads the pool through block tables
# A chat workload (two shared system prompts, some requests with two samples) served with and
# without prefix caching, and in a pool too small for it. Every sequence's logits equal a
# contiguous cache's; prefix caching computes fewer prompt tokens; the small pool preempts.

# %%
from chapters.ch28_inference import engine as E

choose = E.Chooser(temperature=0.1, seed=0)
chat = WL.chat_workload(cfg, config.vocab_size, 7)
refs = {(i, s): E.reference(llama, r.prompt, 1 + r.n_decode, choose, i, s)
        for i, r in enumerate(chat) for s in range(r.n)}
for name, blocks, cache in (("prefix cache", 128, True), ("no prefix cache", 128, False), ("20 blocks", 20, True)):
    run = E.Engine(llama, blocks, 4, 8, "continuous", cache, choose).run(chat)
    worst, wrong = C.compare_runs({name: run}, refs)
    print(f"{name:16s} prefill tokens {run['prefill_tokens']:4d}, reused {run['cached_tokens']:4d}, "
          f"peak blocks {run['peak_blocks']:3d}, preemptions {run['preemptions']}, "
          f"max |logit diff| {worst:.1e}, tokens differing {wrong}")

# %% [markdown]
# ## Static against continuous batching: the schedule model, then the engines
# The model counts decode steps from the lengths alone; the engines must take exactly as many.

# %%
work = WL.workload(64, cfg.max_decode, cfg.seed)
decode = [d for _, d in work]
s, c = WL.static_schedule(decode, cfg.batch), WL.continuous_schedule(decode, cfg.batch)
print(f"model: static {s['steps']}, continuous {c['steps']} steps, ratio {s['steps'] / c['steps']:.3f}, "
      f"E[max]/E[mean] {WL.expected_ratio(cfg.max_decode, cfg.batch):.3f}")
reqs = [E.Request(C.prompt_of(cfg, config.vocab_size, 1000 + i, p)[0].tolist(), d) for i, (p, d) in enumerate(work)]
runs = {mode: E.Engine(llama, 128, 4, cfg.batch, mode).run(reqs) for mode in E.MODES}
for mode, run in runs.items():
    print(f"{mode:10s} {run['decode_steps']:4d} decode steps, {run['seconds'] * 1e3:7.1f} ms")

# %% [markdown]
# ## Overlap: plan t+1 is made while step t runs
# The overlap engine's timeline (the first 12 ms): scheduling intervals on the CPU thread, steps
# on the executor thread. The synchronous engine's plans never overlap a step.

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(2, 1, figsize=(8, 3), sharex=True)
for ax, mode in zip(axes, ("continuous", "overlap")):
    tl = runs[mode]["timeline"]
    t0 = min(a for _, _, a, _ in tl)
    for kind, _, a, b in tl:
        if a - t0 < 0.012:
            ax.barh(kind, (b - a) * 1e3, left=(a - t0) * 1e3, color="tab:blue" if kind == "step" else "tab:orange")
    after, during, secs = C.overlap_intervals(tl)
    ax.set_title(f"{mode}: {during} of {after} plans made while the previous step ran", fontsize=9)
axes[-1].set_xlabel("ms")
fig.tight_layout()

# %% [markdown]
# ## The real run: two processes

# %%
res = run_torchrun(REPO_ROOT / "chapters" / "ch28_inference" / "train.py", nproc=2, timeout=300)
summary = json.loads((res.out_dir / "summary.json").read_text())
for check in summary["checks"]:
    print(f"{check['name'][:60]:60s} {check['measured']!s:>12.12s} {'ok' if check['ok'] else 'FAIL'}")
