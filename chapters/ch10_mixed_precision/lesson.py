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
# # Chapter 10 · Mixed precision (AMP) · 混合精度训练
#
# Compute in 16 bits, keep the weights in 32. This notebook looks at the number formats, at
# an fp16 gradient that vanishes without loss scaling, at a dynamic loss scaler written by hand
# beside `torch.amp.GradScaler`, at the updates a bf16 weight cannot take, at FP8 per-tensor
# scaling, and then runs the real thing on two processes: DDP with bf16 and fp16 reduces and
# FSDP2 with a `MixedPrecisionPolicy`.
# The lesson is [chapters/ch10_mixed_precision/README.md](../chapters/ch10_mixed_precision/README.md).

# %%
import inspect
import json
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from chapters.ch10_mixed_precision import checks, formats, loss_scaler, train
from common.data import regression_data
from common.launch import run_torchrun
from common.models import MLP
from common.results import REPO_ROOT

# %% [markdown]
# ## Range and precision, from the bit layout
# With $e$ exponent bits and $m$ mantissa bits: $\epsilon = 2^{-m}$, bias $= 2^{e-1}-1$,
# smallest normal $2^{1-\text{bias}}$, largest $(2-2^{-m})\,2^{\text{bias}}$ (e4m3fn, which has no
# inf, reaches $(2-2^{1-m})\,2^{\text{bias}+1} = 448$). `torch.finfo` agrees with every formula:

# %%
print(f"{'format':10s} {'e':>2s} {'m':>3s} {'max':>11s} {'eps':>10s} {'smallest normal':>16s}")
for row in formats.format_table():
    print(f"{row['name']:10s} {row['exp_bits']:2d} {row['man_bits']:3d} {row['max']:11.4g} "
          f"{row['eps']:10.3g} {row['tiny']:16.4g}   formula ok: "
          f"{all(row[k] == row['formula'][k] for k in ('max', 'eps', 'tiny'))}")

# %% [markdown]
# bf16 has fp32's range with 8 bits of precision (≈ 2.4 decimal digits); fp16 has 11 bits
# (≈ 3.3 digits) but overflows at 65504 and stops being normal at 6e-5. That is why fp16 needs
# loss scaling and bf16 does not.

# %%
for row in formats.format_table():
    print(f"{row['name']:10s} {row['man_bits'] + 1:2d} significant bits = "
          f"{(row['man_bits'] + 1) * math.log10(2):.1f} decimal digits")

# %% [markdown]
# ## An fp16 gradient that underflows
# The constructed case: a tiny loss, so dL/dy ≈ 1e-8·y, below fp16's smallest subnormal (6e-8).
# Every loss scale from 2^0 to 2^16 (exercise 2): when do the gradients stop being zero, and when
# are they as accurate as fp16 allows?

# %%
print(inspect.getsource(formats.underflow_grads))
cpu = torch.device("cpu")
ref = formats.underflow_grads(1.0, cpu, half=False)
for k in range(17):
    g = formats.underflow_grads(2.0**k, cpu)
    print(f"loss scale 2^{k:<2d}: {int((g == 0).sum()):3d}/{g.numel()} grads are zero, "
          f"rel. error vs fp32 {((g - ref).norm() / ref.norm()).item():.2e}")

# %% [markdown]
# ## A dynamic loss scaler by hand, beside GradScaler
# Scale the loss; before the step, unscale and look for inf/NaN; overflow → skip the step and
# halve the scale; `growth_interval` clean steps → double it.

# %%
print(inspect.getsource(loss_scaler.DynamicLossScaler))

# %%
cfg = train.Config()  # the script's data and model; the trace uses its first 30 steps
X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=0)
X = X.view(cfg.steps, -1, cfg.d_in)[:checks.TRACE_STEPS]
Y = Y.view(cfg.steps, -1, 1)[:checks.TRACE_STEPS]
torch.manual_seed(0)
model = MLP(cfg.d_in, cfg.d_hidden, 1)
inf_steps = {5, 6, 12}
traces = {
    "GradScaler": loss_scaler.scaler_trace(
        model, X, Y, torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3), inf_steps),
    "hand": loss_scaler.scaler_trace(
        model, X, Y, loss_scaler.DynamicLossScaler(2.0**12, growth_interval=3), inf_steps),
    "never backs off": loss_scaler.scaler_trace(
        model, X, Y, loss_scaler.DynamicLossScaler(2.0**12, backoff_factor=1.0, growth_interval=3), inf_steps),
}
for name, t in traces.items():
    same = t["scales"] == traces["GradScaler"]["scales"] and t["skipped"] == traces["GradScaler"]["skipped"]
    print(f"{name:16s} skipped {t['skipped']}  same decisions as GradScaler: {same}")
plt.figure(figsize=(6, 3))
for name, t in traces.items():
    plt.semilogy(t["scales"], label=name)
plt.xlabel("step")
plt.ylabel("loss scale")
plt.legend()
plt.show()

# %% [markdown]
# ## Master weights: the updates a bf16 weight cannot take
# An SGD update smaller than half the spacing of the weight's format next to it rounds away.
# One step on bf16 weights and the same step on fp32 weights, counted, beside the rule's
# prediction (`formats.rounds_back`), element by element. Updates within 2^-7 of the threshold
# are left to the kernel (`formats.near_threshold`: how it rounds lr·g decides them).

# %%
print(inspect.getsource(formats.rounds_back))
for dtype in (torch.bfloat16, torch.float32):
    net = MLP(cfg.d_in, cfg.d_hidden, 1)
    net.load_state_dict(model.state_dict())
    net = net.to(dtype)
    F.mse_loss(net(X[0].to(dtype)).float(), Y[0]).backward()
    with torch.no_grad():
        moved = lost = wrong = near = 0
        for p in net.parameters():
            before, update = p.clone(), formats.exact_update(cfg.lr, p.grad)
            p.add_(p.grad, alpha=-cfg.lr)
            gone, band = (p == before) & (update != 0), formats.near_threshold(before, update)
            moved += int((update != 0).sum())
            lost += int(gone.sum())
            near += int((band & (update != 0)).sum())
            wrong += int(((gone != formats.rounds_back(before, update)) & ~band).sum())
    print(f"{str(dtype):15s} {lost / moved:6.1%} of {moved} non-zero updates lost; the rule is "
          f"wrong on {wrong} of them ({near} left to the kernel)")

# %% [markdown]
# ## Reducing in bf16 over many ranks
# A ring adds the ranks' gradients one at a time, rounding each sum to the reduce dtype
# (exercise 3):

# %%
for world in (2, 8, 64, 256):
    print(f"W = {world:3d}: bf16 sum rel. error {formats.low_precision_sum_error(world):.1e}, "
          f"fp32 {formats.low_precision_sum_error(world, torch.float32):.1e}")

# %% [markdown]
# ## FP8: two formats, one scale per tensor
# Gradient-sized values (~1e-4) cast straight to e4m3 all flush to zero; multiplied first by
# `448 / amax` (and divided after), they keep ~2% mean relative error and at most u = eps/2 per
# element, for the elements whose scaled value is a normal number of the format. One outlier
# (exercise 4) pushes the others out of e4m3's range. On GPUs, torchao's float8 training does
# this per linear layer (README).

# %%
x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-4
outlier = x.clone()
outlier[0] = 1e5 * x.abs().max()
for name, data in (("gradient-sized", x), ("with a 1e5x outlier", outlier)):
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for scaled in (False, True):
            r = formats.fp8_roundtrip_error(data, dtype, per_tensor_scale=scaled)
            print(f"{name:19s} {str(dtype):22s} scaled {scaled!s:5s}: mean rel. error "
                  f"{r['rel_error']:.3f}, max in range {r['max_rel_in_range']:.3f} "
                  f"(u = {torch.finfo(dtype).eps / 2}), in range {r['in_range']:.1%}, "
                  f"zeros {r['zeros']:.0%}")

# %% [markdown]
# ## The real run: two processes under torchrun
# DDP in fp32, bf16 and fp16 (autocast, gradient all-reduce in the compute dtype, the hand
# scaler for fp16), the no-master-weights control, FSDP2 in fp32 and with
# `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`. The dtypes and bytes of the
# collectives are read off the tensors sent (chapter 09's `WireTap`).

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch10"
result = run_torchrun(REPO_ROOT / "chapters/ch10_mixed_precision/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("check"):])

# %%
steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
plt.figure(figsize=(5, 3))
for key in ("loss_fp32", "loss_bf16", "loss_fp16"):
    plt.plot([s["step"] for s in steps], [s[key] for s in steps], marker="o", label=key)
plt.xlabel("step")
plt.ylabel("training loss")
plt.legend()
plt.show()

# %% [markdown]
# ## Exercises
# (Hints and worked answers are in the lesson, README.md.)
# 1. Run with `--precision fp16 --init-scale 65536 --growth-interval 3`. Which steps are skipped,
#    and why? How far does the fp16 curve fall behind fp32? Does a smaller `--init-scale` fix it?
# 2. Predict the smallest loss scale that keeps every gradient of `underflow_grads` non-zero,
#    and the one from which it is as accurate as fp16 allows (the loop above).
# 3. How much accuracy does a bf16 reduction lose on 2, 8, 64 and 256 ranks?
# 4. Compare e4m3 and e5m2 on the tensor with an outlier. What would a per-row scale change?
