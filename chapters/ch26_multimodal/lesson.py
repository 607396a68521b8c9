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
# # Chapter 26 · Multimodal training (CLIP) · 多模态模型训练实战
#
# CLIP learns one embedding space for images and captions: in a batch of B pairs, each image
# must pick its own caption among all B, and each caption its own image. Under data
# parallelism a rank holds only b = B / W pairs, so the ranks all-gather their embeddings to
# give every image all B candidates, and the gradient has to flow back through that gather.
# This notebook looks at the data, the gathers and the two losses, then runs the real thing
# on two processes. The lesson is
# [chapters/ch26_multimodal/README.md](../chapters/ch26_multimodal/README.md).

# %%
import inspect
import json

import matplotlib.pyplot as plt
import torch

from chapters.ch26_multimodal import checks, contrastive, data
from chapters.ch26_multimodal.model import CLIP
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## The data: shapes, colours, positions, and what is held out
# 64 captions; the 16 whose colour/shape pair lies on a diagonal are never trained on.

# %%
train_combos, held = data.split_combinations()
print(len(train_combos), "training combinations,", len(held), "held out, for example:")
for c in held[:4]:
    print("  ", data.caption(*c))
images, ids, which = data.make_pairs(6, 0, train_combos, size=32)
fig, axes = plt.subplots(1, 6, figsize=(10, 2.2))
for ax, img, k in zip(axes, images, which):
    ax.imshow(img.permute(1, 2, 0).numpy())
    ax.set_title(data.caption(*train_combos[int(k)])[2:], fontsize=7)
    ax.axis("off")
plt.show()

# %% [markdown]
# ## The loss one process computes
# Symmetric cross-entropy over the B x B matrix of scaled cosines; the diagonal holds the pairs.

# %%
print(inspect.getsource(contrastive.clip_loss))

# %% [markdown]
# ## The all-gather that carries gradients
# Forward: everyone gets every rank's rows. Backward: the adjoint of a copy is a sum, so each
# rank receives the sum over all ranks of the gradient for its own rows: a reduce-scatter.

# %%
print(inspect.getsource(contrastive.AllGatherWithGrad))

# %% [markdown]
# ## Global loss or local loss: what a rank builds
# The local loss keeps a rank's own rows: b x B for its images and b x B for its captions.
# Bytes of logits per rank for B = 48 in float64:

# %%
for world in (1, 2, 4, 8, 16):
    g = contrastive.logits_bytes_formula(48, world, False, 8)
    loc = contrastive.logits_bytes_formula(48, world, True, 8)
    print(f"W={world:2d}  global {g:6d} B   local {loc:6d} B   ratio {loc / g:.3f}")

# %% [markdown]
# ## One step on one process
# The untrained model's loss on a global batch, and the gradient of its temperature.

# %%
torch.manual_seed(0)
model = CLIP().double()
images, ids, _ = data.make_pairs(48, 1, train_combos, dtype=torch.float64)
loss, grads = checks.global_batch_gradients(model, images, ids)
print(f"loss {loss:.4f}  (ln 48 = {torch.tensor(48.0).log():.4f} would be a model that knows nothing)")
print(f"d loss / d logit_scale = {grads['logit_scale'].item():.4f}")

# %% [markdown]
# ## The real run: two processes under torchrun
# Parity of both gathers and both losses with one process, the no-gradient control, the
# counted logits bytes, then DDP training and zero-shot retrieval of the held-out pairs.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch26"
result = run_torchrun(REPO_ROOT / "chapters/ch26_multimodal/train.py", nproc=2, out_dir=out_dir)
print(result.output[result.output.index("figure"):])

# %%
steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3))
ax1.plot([s["step"] for s in steps], [s["loss"] for s in steps])
ax1.set_xlabel("step")
ax1.set_ylabel("global-batch loss")
ax2.plot([s["step"] for s in steps], [s["zero_shot"] for s in steps], label="held-out pairs")
ax2.axhline(1 / 64, color="k", ls=":", label="chance")
ax2.set_xlabel("step")
ax2.set_ylabel("zero-shot top-1")
ax2.legend()
plt.show()

# %% [markdown]
# ## Exercises
# The lesson's exercises, with hints and worked answers
# ([README.md](../chapters/ch26_multimodal/README.md#exercises)):
# 1. How many bytes of logits does a rank build at W = 8, B = 32768 in bf16, global and local?
# 2. Train on 2 ranks with `--gather nograd --no-local-loss`, then `--gather nograd` (local
#    loss), and compare with the default. Why does the first come out so close?
# 3. Why does the local loss need the gradient through the gather while the global loss
#    (almost) does not?
# 4. Hold out a whole colour instead of one pair per colour: what should zero-shot do?
