"""What chapter 25's run proves and measures, recorded beside theory: the tokenizer's size and
round trip, FLOPs counted against the formula, FSDP2 against DDP, the losses against ln V and the
unigram entropy (with the share of tokens already seen), tokens/s and MFU over the timed steps, the
DCP resume with its control, and the export."""

from __future__ import annotations

import statistics

import torch

from chapters.ch25_llm import parity, tokenizer
from chapters.ch25_llm.model import (
    PRESETS,
    apply_activation_checkpointing,
    build_model,
    count_flops,
    llama_config,
    six_n_d,
    train_step_flops,
)
from common.distributed import reduce_number
from common.results import RunRecorder
from common.timing import peak_flops

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
LOSS_TOL = 1e-4  # relative; derived in the lesson ("How close FSDP2 and DDP must be")


def first_order_bound(steps: int, lr: float, world_size: int,
                      dtype: torch.dtype = torch.float32, eps: float = parity.ADAM_EPS) -> float:
    """The lesson's bound k·η·(W−1)·u/ε on FSDP2-vs-DDP weights: each step the ranks' partial
    sums are added in another order ((W−1)·u relative), and AdamW's g/(√v+ε) amplifies that by
    at most 1/ε. u is the dtype's unit roundoff: 2^-24 in float32, 2^-53 in float64. At one
    rank W−1 = 0 would make it 0, but FSDP2 and DDP are still two programs, and on CUDA a rank's
    own sums need not repeat (torch documents SDPA's CUDA backward as nondeterministic): one
    reordering is always allowed, max(W−1, 1)."""
    u = torch.finfo(dtype).eps / 2
    return steps * lr * max(world_size - 1, 1) * u / eps


def param_tolerance(steps: int, lr: float, world_size: int, dtype: torch.dtype = torch.float32,
                    eps: float = parity.ADAM_EPS) -> float:
    """The weight tolerance: the first-order bound, capped at a tenth of one AdamW step (η/10).
    In float64 the bound is the tolerance (1.3e-10 at k=4, W=2); in float32 the bound (0.072 to
    1.07 at W=2..16) exceeds how far the weights move at all, so the cap holds (see the lesson)."""
    return min(lr / 10, first_order_bound(steps, lr, world_size, dtype, eps))


PARAM_TOL = param_tolerance(4, PRESETS["cpu"]["lr"], 2)  # 3e-4: the default run's (η/10)


def record_tokenizer(rec: RunRecorder, tok, cfg, train_ids, val_text: str) -> None:
    """The tokenizer's proofs: its size is the configured one, and text round-trips."""
    rec.check("tokenizer vocabulary = --vocab-size", "count", tok.get_vocab_size(), cfg.vocab_size)
    probe = val_text[:2000] + "\n中文 naïve café — ∑ 🙂\t\x00"
    rec.check("decode(encode(text)) == text (held-out + non-ASCII)", "parity",
              int(tokenizer.round_trips(tok, probe)), 1)
    rec.figure("training tokens", len(train_ids), unit="tokens")
    rec.figure("characters per token (held-out text)", round(tokenizer.chars_per_token(tok, val_text), 3))


FLOP_PROBE_TOKENS = 256


def record_flops(rec: RunRecorder, config, cfg, info) -> None:
    """FlopCounterMode on one forward + backward of an unsharded twin against the formula,
    without and with activation checkpointing; 6·N·D beside them. The probe is short
    (FLOP_PROBE_TOKENS): the formula is checked at its shape, and eager attention's T x T scores
    of an unsharded twin at the gpu preset's 2048 tokens would take every rank tens of GB."""
    b, t = 2, min(cfg.seq_len, FLOP_PROBE_TOKENS)
    probe = torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(1))
    model = build_model(config, cfg.seed, info.device)
    plain = sum(count_flops(model, probe.to(info.device)).values())
    apply_activation_checkpointing(model)
    recomputed = sum(count_flops(model, probe.to(info.device)).values())
    rec.check("FlopCounterMode = 3 x forward matmul formula", "formula", plain,
              train_step_flops(config, b, t))
    rec.check("FlopCounterMode with checkpointing = formula + recompute", "formula", recomputed,
              train_step_flops(config, b, t, recompute=True))
    rec.figure("6·N·D ÷ exact matmul FLOPs (same batch)",
               round(six_n_d(config, b, t) / train_step_flops(config, b, t), 4))
    del model


def record_parity(rec: RunRecorder, cfg, ids, info) -> None:
    """FSDP2 and DDP in float32 on the cpu preset's model size; DDP without sync as control.
    Tolerance (the lesson derives it): 1e-4 relative on the losses; on the weights
    `param_tolerance` of this run's steps, learning rate, world size, Adam ε and dtype."""
    if cfg.parity_steps == 0:
        return
    p = PRESETS["cpu"]
    small = llama_config(cfg.vocab_size, p["hidden_size"], p["n_layers"], p["n_heads"],
                         p["n_kv_heads"], p["ffn_size"], p["seq_len"])
    runs = parity.compare(small, ids, cfg.parity_steps, p["micro_batch_size"], p["seq_len"],
                          p["lr"], cfg.seed, info.device)
    rel = max(abs(a - b) / abs(b) for a, b in zip(runs["fsdp2"]["losses"], runs["ddp"]["losses"]))
    rec.check(f"FSDP2 vs DDP float32 losses, {cfg.parity_steps} steps (max rel. diff)", "parity",
              rel, 0.0, tolerance=LOSS_TOL)
    tol = param_tolerance(cfg.parity_steps, p["lr"], info.world_size, torch.float32)
    rec.figure("first-order bound k·η·(W−1)·u/ε on the float32 weights",
               float(f"{first_order_bound(cfg.parity_steps, p['lr'], info.world_size):.3g}"))
    rec.check("FSDP2 vs DDP float32 weights (max |diff|)", "parity",
              parity.max_param_diff(runs["fsdp2"]["params"], runs["ddp"]["params"]), 0.0,
              tolerance=tol)
    if info.world_size > 1:
        rec.check("control: DDP without gradient all-reduce vs FSDP2 weights", "parity",
                  parity.max_param_diff(runs["ddp-nosync"]["params"], runs["fsdp2"]["params"]),
                  tol, compare=">")




SEEN_STEPS = 20
"""The last this many batches are counted for the share of already-trained tokens: at 5 the
sequential control (0) would lie within 4 standard errors of the formula at world 1."""


def record_seen_fraction(rec: RunRecorder, n_ids: int, steps: int, global_size: int,
                         seq_len: int, seed: int, starts=parity.batch_starts) -> float:
    """The training loss is no held-out estimate: the share of the last batches' target tokens
    that earlier batches held, counted position by position, against the closed form within four
    standard errors; and the control, windows read in order without replacement (nothing repeats
    in a first pass), which the same check rejects. The control is recorded only when the run
    reads its corpus less than once (passes < 1): past one pass the in-order sampler wraps and
    repeats as much as the formula says (the gpu preset reads its corpus 10.6 times on one GPU,
    85 on eight, and counts 1.0 = the formula), so it is no control there; the run says so in
    a figure. `starts`: the sampler counted (tests)."""
    last = range(max(0, steps - SEEN_STEPS), steps)
    expected = statistics.mean(parity.expected_seen_fraction(n_ids, s, global_size, seq_len)
                               for s in last)
    tol = parity.seen_tolerance(expected, len(last) * global_size)
    counted = parity.seen_fraction(n_ids, last, global_size, seq_len, seed, starts)
    name = f"tokens of the last {len(last)} batches already trained on (fraction) = formula"
    rec.check(name, "formula", round(counted, 4), round(expected, 4), tolerance=round(tol, 4))
    passes = steps * global_size * seq_len / n_ids
    if passes >= 1:  # the in-order sampler has wrapped: it repeats text too, no control
        rec.figure("passes over the training tokens (the in-order control needs < 1: not "
                   "recorded)", round(passes, 2))
        return counted
    control = parity.seen_fraction(n_ids, last, global_size, seq_len, seed,
                                   parity.sequential_starts)
    rec.check("control: windows read in order: |fraction - formula| > the tolerance", "formula",
              round(abs(control - expected), 4), round(tol, 4), compare=">")
    return counted


def training_passes(cfg, world_size: int, n_train_tokens: int) -> float:
    """How many times the run reads its training tokens (steps × global batch ÷ corpus)."""
    return cfg.steps * cfg.micro_batch_size * world_size * cfg.seq_len / n_train_tokens


def record_losses(rec: RunRecorder, cfg, losses: list[float], val: float, entropy: float,
                  passes: float, n_train_tokens: int, world_size: int) -> None:
    """The losses against what a model that learnt nothing would score: the first against ln V
    (a uniform guess), the trained and the held-out ones against the unigram entropy."""
    final = statistics.mean(losses[-5:])
    rec.figure("loss at step 0 (ln V for a uniform guess)", round(losses[0], 4),
               expected=round(float(torch.tensor(float(cfg.vocab_size)).log()), 4), unit="nats")
    rec.check("training loss (mean of last 5 steps) < unigram entropy", "formula", final,
              round(entropy, 6), compare="<")
    # the training loss is no held-out estimate: windows start anywhere, with replacement,
    # so part of each batch was trained on before (counted, against its closed form)
    record_seen_fraction(rec, n_train_tokens, cfg.steps, cfg.micro_batch_size * world_size,
                         cfg.seq_len, cfg.seed)
    if passes <= 1:  # under one pass over the training tokens (the gpu preset makes ~10)
        rec.check("held-out loss < unigram entropy", "formula", val, round(entropy, 6),
                  compare="<")
    else:  # it may have memorised the training text: reported, not checked
        rec.figure(f"held-out loss after {passes:.1f} passes (not checked)", round(val, 4),
                   expected=f"< {entropy:.4f}", unit="nats")


def throughput_meter(config, cfg, info) -> dict:
    """What turns a step time into tokens/s and MFU: tokens per step (all ranks), model FLOPs
    per device per step (the formula: 3 x forward, recomputation not counted) and the peak
    (datasheet on a known GPU, else a measured matmul, see `common.timing.peak_flops`)."""
    peak, source = peak_flops(info.device, DTYPES[cfg.param_dtype])
    return {"tokens": cfg.micro_batch_size * cfg.seq_len * info.world_size,
            "flops": train_step_flops(config, cfg.micro_batch_size, cfg.seq_len),
            "peak": peak, "source": source}


RATE_BAND = (0.5, 1.1)
"""tokens/s from the wall clock over tokens/s from the median step: at most 1 (the wall clock also
holds the batch slicing, the loss all-reduce, the logging, and steps slower than the median), by
1.1 allowing for a few fast steps; below 0.5 the machine was busy elsewhere (a timing check)."""


def timed_steps(cfg, deterministic_from_save: bool) -> tuple[int, int]:
    """The steps whose times give tokens/s and MFU: from --timed-from to the end, or to the
    checkpoint when the steps after it run under deterministic algorithms (slower kernels)."""
    return cfg.timed_from, cfg.save_step() if deterministic_from_save else cfg.steps


def record_throughput(rec: RunRecorder, run: dict, meter: dict, window: tuple[int, int]) -> None:
    """tokens/s and MFU over the timed steps `window` (first, end): the median; warm-up and
    compilation excluded, and on CUDA the deterministic steps after the checkpoint. Beside it,
    independently: the tokens the model was fed (counted at its input embedding, all ranks)
    against the meter's tokens per step, and those tokens over the wall clock of the window."""
    first, end = window
    timed = run["times"][first:end]
    step_s = reduce_number(statistics.median(timed), "max")  # the slowest rank sets the pace
    rec.figure("step time (median of timed steps)", round(step_s * 1e3, 2), unit="ms",
               spread=(min(timed) * 1e3, max(timed) * 1e3))
    rec.figure("tokens/s (all ranks)", round(meter["tokens"] / step_s), unit="tokens/s")
    rec.figure("model TFLOP/s per device", round(meter["flops"] / step_s / 1e12, 4), unit="TFLOP/s")
    rec.figure(f"MFU (peak: {meter['source']})", round(meter["flops"] / step_s / meter["peak"], 4))
    counted = reduce_number(sum(run["tokens"][first:end]))
    rec.check("tokens fed to the model in the timed steps (counted at the embedding, all ranks) "
              "= steps x micro-batch x T x ranks", "count", counted, meter["tokens"] * (end - first))
    wall = reduce_number(run["stamps"][end] - run["stamps"][first], "max")
    rec.figure("tokens/s from the wall clock (counted tokens / window)", round(counted / wall),
               unit="tokens/s")
    if run.get("outside_s"):  # the DCP save, left out of the window above
        rec.figure("DCP save (on the wall clock, outside the window)",
                   round(reduce_number(run["outside_s"], "max"), 3), unit="s")
    rec.check("tokens/s: wall clock (counted tokens) / median step (meter)", "timing",
              round((counted / wall) / (meter["tokens"] / step_s), 4), list(RATE_BAND),
              compare="between")


def record_resume(rec: RunRecorder, save_step: int, good: dict, bad: dict) -> None:
    """The resumed run (`train.resume_and_compare`) against the first, and the control that
    resumes without the optimizer state."""
    rec.check(f"DCP resume at step {save_step}: losses (same machine)", "parity",
              good["loss_diff"], 0.0)
    rec.check("DCP resume: final weights", "parity", good["param_diff"], 0.0)
    rec.check("control: resume without the optimizer state differs", "parity",
              bad["param_diff"], 0.0, compare=">")


def record_export(rec: RunRecorder, hf: dict, trained_params: dict, sample_tokens: int) -> None:
    """The exported model is the trained one: its weights equal the FSDP2 model's gathered
    parameters, its logits and greedy tokens equal those of the weights it was saved from; a
    config with another RoPE base (same weights) is rejected by the same logits check."""
    lg = hf["logits"]
    rec.check("AutoModelForCausalLM reload: weights = FSDP2 full params", "parity",
              parity.max_param_diff(trained_params, hf["reloaded_params"]), 0.0)
    rec.check("AutoModelForCausalLM reload: logits (a copy)", "parity",
              (lg["reloaded"] - lg["trained"]).abs().max().item(), 0.0)
    rec.check("reload: greedy tokens equal", "count",
              int((hf["gen"]["reloaded"] == hf["gen"]["trained"]).sum()), sample_tokens)
    rec.check("control: reload with another RoPE base differs", "parity",
              (lg["wrong rope"] - lg["trained"]).abs().max().item(), 0.0, compare=">")
