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
# # Chapter 09 · Gradient compression and quantisation · 梯度压缩与量化
#
# Data parallelism all-reduces every gradient every step (chapter 03). When the network is
# the bottleneck, send less: a few large coordinates (Top-K), a few bits per coordinate (QSGD,
# SignSGD), or a low-rank factorisation (PowerSGD). Biased compressors need **error
# feedback**: keep what was not sent and add it to the next gradient. This notebook looks at
# each compressor on one vector, then trains all of them as DDP communication hooks on two
# processes. The lesson is
# [chapters/ch09_compression/README.md](../chapters/ch09_compression/README.md).

# %%
import inspect
import math

import matplotlib.pyplot as plt
import torch

from chapters.ch09_compression import compressors, hooks, plots, train, volume
from common.checkpoint import load_checkpoint
from common.launch import run_torchrun
from common.results import REPO_ROOT

g = torch.Generator().manual_seed(0)
v = torch.randn(1000, generator=g) * torch.linspace(0.1, 2, 1000)  # a gradient-like vector

# %% [markdown]
# ## Top-K: send the K largest coordinates and where they are
# K values (fp32) plus K indices (int32) instead of n values: ratio n / 2K.

# %%
values, indices = compressors.topk_compress(v, 50)
kept = compressors.topk_decompress(values, indices, v.numel())
print(f"kept {kept.count_nonzero().item()} of {v.numel()} coordinates, "
      f"{(kept.norm() / v.norm()).item():.0%} of the norm; "
      f"payload {values.numel() * 4 + indices.numel() * 4} bytes vs {v.numel() * 4}")

# %% [markdown]
# ## QSGD: a norm and a small signed integer per coordinate
# Stochastic rounding to one of s levels makes the quantiser unbiased: the mean of many
# quantisations converges to the vector. Rounding to the nearest level does not.

# %%
for stochastic in (True, False):
    total = torch.zeros_like(v)
    for _ in range(500):
        q, norms = compressors.qsgd_quantize(v, 4, 256, g, stochastic=stochastic)
        total += compressors.qsgd_dequantize(q, norms, 4, v.numel())
    err = ((total / 500 - v).norm() / v.norm()).item()
    print(f"{'stochastic' if stochastic else 'nearest   '} rounding: "
          f"|mean of 500 draws - v| / |v| = {err:.4f}, levels used {sorted(q.unique().tolist())}")

# %% [markdown]
# The hook sends each level as int8: 8 bits. The paper codes the levels with Elias's
# variable-length codes instead, where a zero level costs nothing; with few levels most are zero:

# %%
for s in (1, 4, 16):
    q, norms = compressors.qsgd_quantize(v, s, 256, g)
    print(f"s = {s:2d}: {(q != 0).float().mean().item():4.0%} of levels non-zero, "
          f"{compressors.qsgd_code_bits(q) / v.numel():.2f} bits per coordinate in the paper's code, 8 as int8")

# %% [markdown]
# ## SignSGD / 1-bit: one bit per coordinate and a scale
# The signs are packed eight to a byte; the scale ‖p‖₁/n keeps the step's size.

# %%
packed = compressors.pack_signs(v)
print(packed[:4], "->", compressors.unpack_signs(packed[:4], 32, v.dtype)[:12].tolist())
print(f"{packed.numel()} bytes of signs for {v.numel()} coordinates (32x smaller than fp32)")

# %% [markdown]
# ## Error feedback, the whole idea in two functions
# The hook compresses gradient + residual, and keeps as the new residual what it did not send.
# Nothing is lost, only delayed. The residual belongs to a parameter, not to a place in the
# bucket: DDP rebuilds its buckets after the first step in another order, so the state is keyed
# by parameter (`keyed_gradients`). The test checks that, over three steps across the rebuild,
# everything a rank sent plus its residual equals every gradient it computed.

# %%
print(inspect.getsource(hooks.keyed_gradients))
print(inspect.getsource(hooks.add_residual))
print(inspect.getsource(hooks.keep_residual))
print(inspect.getsource(hooks.topk_hook))

# %% [markdown]
# ## signSGD with majority vote: a quantised payload that is reduced
# Votes of ±1 can be summed on the way, so they go through an all-reduce: what a rank receives
# does not grow with the world size, unlike the gathered payloads below. The sum must fit its
# dtype: int8 holds 127 votes, fp16 every integer up to 2048, int32 the rest.

# %%
print({w: compressors.vote_dtype(w) for w in (2, 127, 128, 2048, 2049)})

# %%
print(inspect.getsource(hooks.majority_vote_hook))

# %% [markdown]
# ## PowerSGD: a rank-r factorisation M ≈ P Qᵀ
# One power iteration per step, warm-started from last step's Q: two small all-reduces
# (P, then Q) instead of one of the whole matrix. Vectors (biases) go uncompressed.

# %%
U, V = torch.randn(64, 2, generator=g), torch.randn(64, 2, generator=g)
M = U @ torch.diag(torch.tensor([3.0, 1.0])) @ V.T + 0.1 * torch.randn(64, 64, generator=g)
# M is nearly rank 2 with one dominant direction, like many gradient matrices
Q = torch.randn(64, 1, generator=g)
for it in range(4):
    P = compressors.orthonormalise(M @ Q)
    Q = M.T @ P
    print(f"power iteration {it}: relative error of rank-1 approximation "
          f"{((M - P @ Q.T).norm() / M.norm()).item():.3f}")
print("best rank-1 error (SVD):", f"{(torch.linalg.svdvals(M)[1:].norm() / M.norm()).item():.3f}")
print(compressors.powersgd_plan([torch.Size([64, 16]), torch.Size([64]), torch.Size([1, 64])], rank=1),
      "<- rank per tensor, 0 = sent plain")

# %% [markdown]
# ## Bytes per step: the formulas
# For the course MLP (16 → 64 → 64 → 1, one DDP bucket), what each method's hook must send:

# %%
cfg = train.Config()
shapes = [torch.Size(s) for s in [(64, 16), (64,), (64, 64), (64,), (1, 64), (1,)]]
n = sum(math.prod(s) for s in shapes)
state = hooks.HookState(density=cfg.density, levels=cfg.levels, chunk=cfg.chunk, rank=cfg.rank)
for method in train.METHODS:
    nbytes = volume.expected_bytes(method, shapes, state)
    print(f"{method:17s} {nbytes:6d} bytes/step   ratio {4 * n / nbytes:5.1f}")

# %% [markdown]
# ## ... and what a rank receives
# A ring all-reduce of B bytes brings 2(W−1)/W·B into each rank; an all-gather of B-byte
# payloads brings (W−1)·B. Gathered payloads (Top-K, QSGD, SignSGD) stop paying at some world
# size; all-reduced ones (PowerSGD, fp16) never do, and the majority vote only where its votes
# have widened to int32 (from 2049 ranks):

# %%
print(f"{'method':13s}" + "".join(f"{'W=' + str(w):>10s}" for w in (2, 8, 64, 256)) + "   break-even W")
for method in ("dense", "topk", "qsgd", "signsgd", "majority_vote", "powersgd"):
    row = "".join(f"{volume.received_bytes(method, shapes, state, w):10.0f}" for w in (2, 8, 64, 256))
    print(f"{method:13s}{row}   {volume.break_even_world(method, shapes, state)}")

# %% [markdown]
# ## The real run: every method as a DDP hook on two processes
# A `WireTap` (chapters/ch09_compression/wire.py) records every tensor handed to a
# `torch.distributed` collective during each step, whoever calls it; the script checks those
# bytes against the formulas, and each method's final loss against dense training.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch09"
result = run_torchrun(REPO_ROOT / "chapters/ch09_compression/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("\nmethod "):result.output.index("figure")])

# %%
for check in result.summary["checks"]:
    print(f"{'ok ' if check['ok'] else 'FAIL'} {check['name']}: {check['measured']}")
print("torch's PowerSGD, bytes at steps 0-2:",
      result.summary["figures"]["bytes sent by torch's PowerSGD, steps 0-2"]["measured"])

# %%
curves = load_checkpoint(out_dir / "curves.pt")
for path in plots.draw(curves, result.summary, out_dir / "figures"):
    plt.figure(figsize=(8, 4.5))
    plt.imshow(plt.imread(path))
    plt.axis("off")
plt.show()

# %% [markdown]
# ## Exercises
# (Hints and worked answers are in the lesson, README.md.)
# 1. Run with `--density 0.001`. Does Top-K with error feedback still converge in 80 steps?
#    With `--steps 400`?
# 2. Run with `--levels 1` (ternary QSGD). What happens to the variance bound and the loss?
# 3. Run with `--momentum 0.9 --lr 0.02`. Which methods suffer, and why does error feedback
#    interact with momentum (hint: DeepSpeed's 1-bit Adam compresses the momentum instead)?
# 4. From which world size does each method make a rank receive more than the dense all-reduce?
# 5. Make `topk_hook` asynchronous and compare the step time.
