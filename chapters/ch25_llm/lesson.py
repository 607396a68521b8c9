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
# # Chapter 25 · Training an LLM · 大语言模型 (LLM) 训练实战
#
# A byte-level BPE tokenizer trained here, a Llama built from a local `LlamaConfig`, trained with
# FSDP2, bf16 layers, activation checkpointing, warm-up + cosine and clipping, checkpointed with
# DCP and exported to Hugging Face format. This notebook looks at each piece in one process, then
# runs the real thing on two processes. The lesson is
# [chapters/ch25_llm/README.md](../chapters/ch25_llm/README.md).

# %%
import inspect
import json
import math

import matplotlib.pyplot as plt
import torch

from chapters.ch25_llm import model, tokenizer
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## A tokenizer in one second
# Byte-level BPE starts from 256 byte symbols and merges frequent pairs. Trained on the first
# nine tenths of the course corpus (pydoc's help topics), 512 entries:

# %%
train_text, val_text = tokenizer.corpus_split()
tok = tokenizer.train_tokenizer(train_text, 512)
sample = "The print() function writes 中文 too."
ids = tok.encode(sample).ids
print(tok.get_vocab_size(), "entries;", len(sample.encode()), "bytes ->", len(ids), "tokens")
print([tok.id_to_token(i) for i in ids])
print("round trip:", tokenizer.round_trips(tok, sample))

# %% [markdown]
# What the loss has to beat: the unigram entropy (a model that knows token frequencies and
# nothing else), against $\ln V$ (a uniform guess).

# %%
train_ids = tokenizer.encode(tok, train_text)
print(f"ln V = {math.log(512):.3f} nats, unigram entropy = {tokenizer.unigram_entropy(train_ids):.3f} nats")

# %% [markdown]
# ## FLOPs: the formula and what PyTorch counts
# One forward + backward of the `cpu` preset's model on 2 sequences of 64 tokens.

# %%
config = model.llama_config(512, 64, 2, 4, 2, 176, 64)
llama = model.build_model(config, seed=0)
x = torch.randint(0, 512, (2, 64))
print("counted (eager attention):", model.count_flops(llama, x))
print("counted (fused CPU attention):", model.count_flops(llama, x, attention="sdpa"), "<- attention missing")
print("formula:", model.train_step_flops(config, 2, 64), " 6ND:", model.six_n_d(config, 2, 64))

# %% [markdown]
# The learning-rate schedule of the default run: 10 warm-up steps, cosine to a tenth.

# %%
plt.figure(figsize=(6, 2.5))
plt.plot([model.lr_at(s, 3e-3, 10, 80) for s in range(80)])
plt.xlabel("step")
plt.ylabel("learning rate")
plt.show()

# %% [markdown]
# ## The FSDP2 wrapping
# One `fully_shard` per decoder layer, then the root, with a bf16 `MixedPrecisionPolicy`:

# %%
print(inspect.getsource(model.apply_fsdp))

# %% [markdown]
# ## The real run: two processes under torchrun
# Tokenizer, FLOP check, FSDP2-vs-DDP parity, 80 training steps, DCP resume, Hugging Face export;
# every check must say `ok`.

# %%
out_dir = REPO_ROOT / "runs" / "notebooks" / "ch25"
result = run_torchrun(REPO_ROOT / "chapters/ch25_llm/train.py", nproc=2, out_dir=out_dir, timeout=300)
print(result.output[result.output.index("sample"):])

# %%

losses = [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
entropy = result.summary["figures"]["unigram entropy of the training tokens"]["measured"]
plt.figure(figsize=(6, 3))
plt.plot(losses, label="training loss")
plt.axhline(math.log(1024), ls=":", c="gray", label="ln V")
plt.axhline(entropy, ls="--", c="k", label="unigram entropy")
plt.xlabel("step")
plt.ylabel("nats per token")
plt.legend()
plt.show()

# %% [markdown]
# ## All four at once: dp × tp × pp × cp
# [`composed.py`](../chapters/ch25_llm/composed.py) trains a small course-owned Llama (HF's
# weights load into it one to one and give HF's logits) with pipeline stages, tensor parallelism, chapter 18's ring attention as
# context parallelism and FSDP2 on one named mesh. A layout the world or the model cannot hold is
# refused in one line, before any rank starts:

# %%
from chapters.ch25_llm import composed, formulas, reference

run = composed.Run()
sequence = composed.Layout(pp=2, tp=2, cp=2, tp_plan="sequence")  # torchtitan's plan
for layout in (composed.Layout(dp=2, tp=2, pp=2), sequence, composed.Layout(dp=2, tp=4, pp=2)):
    print(f"{layout.name():>27}:", composed.layout_error(layout, run.cfg, run.global_batch,
                                                         run.seq_len, run.microbatches, 8) or "ok")

# %% [markdown]
# What each rank of the two test layouts holds and sends per step, by formula (the 8-rank test
# counts the same bytes from the tensors, from autograd's saved tensors and at the collective
# boundary, on every rank). The second runs torchtitan's sequence-parallel plan: beside it, the
# same layout on the blocks plan (not run by the test) shows what sequence parallelism changes:

# %%
import dataclasses

for layout in (composed.Layout(dp=2, tp=2, pp=2), sequence,
               dataclasses.replace(sequence, tp_plan="blocks")):
    for stage in range(layout.pp):
        state = sum(formulas.expected_state_bytes(run.cfg, layout, stage).values())
        acts = formulas.expected_activation_bytes(run, layout, stage)
        print(f"{layout.name():>27} stage {stage}: model state {state} B, activations {acts} B,",
              formulas.expected_comm_bytes(run, layout, stage))

# %% [markdown]
# The reference every layout is checked against: one process, the whole global batch, float64.
# The tolerances are derived in the lesson (a reordered sum of 256 token terms, AdamW's 1/ε).

# %%
ref = reference.one_process(run)
print("losses", [round(x, 9) for x in ref["losses"]])
print("pre-clip norms", [round(x, 9) for x in ref["norms"]])
print("tolerances", reference.tolerances(run))

# %% [markdown]
# ## Exercises
# 1. What fraction of the `gpu` preset's FLOPs is the head, and what fraction attention?
# 2. Why does the loss plateau near 5.9 before it falls further?
# 3. How much does activation checkpointing add to a step's hardware FLOPs, and why less than 4/3?
# 4. Run on four processes: do the FSDP2-vs-DDP differences stay 0?
# 5. In the composed run, why does a micro-batch loss that is not divided by the number of
#    micro-batches leave the weights (almost) unchanged, and which check catches it?
#
# Hints and answers are in the lesson, [README.md](../chapters/ch25_llm/README.md#exercises).
