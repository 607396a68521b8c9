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
# beside `torch.amp.GradScaler`, at FP8 per-tensor scaling, and then runs the real thing on
# two processes: DDP with a bf16 reduce and FSDP2 with a `MixedPrecisionPolicy`.
# The lesson is [chapters/ch10_mixed_precision/README.md](../chapters/ch10_mixed_precision/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt
import torch

from chapters.ch10_mixed_precision import formats, loss_scaler, train
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
# bf16 has fp32's range with 8 bits of precision; fp16 has 11 bits of precision but overflows
# at 65504 and stops being normal at 6e-5. That is why fp16 needs loss scaling and bf16 does not.
#
# ## An fp16 gradient that underflows
# The constructed case: a tiny loss, so dL/dy ≈ 1e-8, below fp16's smallest subnormal (6e-8).

# %%
print(inspect.getsource(formats.underflow_grads))
cpu = torch.device("cpu")
ref = formats.underflow_grads(1.0, cpu, half=False)
for scale in (1.0, 2.0**8, 2.0**16):
    g = formats.underflow_grads(scale, cpu)
    print(f"loss scale {scale:8.0f}: {int((g == 0).sum()):3d}/{g.numel()} grads are zero, "
          f"rel. error vs fp32 {((g - ref).norm() / ref.norm()).item():.2e}")

# %% [markdown]
# ## A dynamic loss scaler by hand, beside GradScaler
# Scale the loss; before the step, unscale and look for inf/NaN; overflow → skip the step and
# halve the scale; `growth_interval` clean steps → double it.

# %%
print(inspect.getsource(loss_scaler.DynamicLossScaler))

# %%
cfg = train.Config(steps=30)
X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=0)
X, Y = X.view(cfg.steps, -1, cfg.d_in), Y.view(cfg.steps, -1, 1)
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
# ## FP8: two formats, one scale per tensor
# Gradient-sized values (~1e-4) cast straight to e4m3 all flush to zero; multiplied first by
# `448 / amax` (and divided after), they keep ~2% relative error: the per-tensor scale is what
# makes FP8 usable. On GPUs, torchao's float8 training does this per linear layer (README).

# %%
x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-4
for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    for scaled in (False, True):
        r = formats.fp8_roundtrip_error(x, dtype, per_tensor_scale=scaled)
        print(f"{str(dtype):22s} per-tensor scale {scaled!s:5s}: rel. error {r['rel_error']:.3f}, "
              f"zeros {r['zeros']:.0%}, scale {r['scale']:.3g}")

# %% [markdown]
# ## The real run: two processes under torchrun
# DDP in fp32 and in bf16 (autocast, bf16 gradient all-reduce), the no-master-weights control,
# FSDP2 in fp32 and with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch10"
result = run_torchrun(REPO_ROOT / "chapters/ch10_mixed_precision/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("check"):])

# %%
steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
plt.figure(figsize=(5, 3))
for key in ("loss_fp32", "loss_bf16"):
    plt.plot([s["step"] for s in steps], [s[key] for s in steps], marker="o", label=key)
plt.xlabel("step")
plt.ylabel("training loss")
plt.legend()
plt.show()

# %% [markdown]
# ## Exercises
# 1. Run with `--precision fp16 --init-scale 65536 --growth-interval 3`. Which steps are skipped,
#    and why does the fp16 curve now lag the fp32 one?
# 2. Set `backoff_factor=1.0` in the hand scaler: what happens to the scale after an overflow?
# 3. Cast `x` to e5m2 and e4m3 with per-tensor scaling: which is more precise, which has the
#    wider range, and which would you use for gradients?
