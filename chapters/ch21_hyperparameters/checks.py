"""The proofs chapter 21's run records, beside the training run in `train.py`: the learning-rate
schedules against their formulas and torch's schedulers (`check_schedules`), and, at the
target point, both noise scales and their four parts measured the data-parallel way
(`measure_noise_scales`) against their closed forms, with the biased estimates and a metric of
the wrong kind as controls (`check_noise_scales`).
"""

from __future__ import annotations

import torch

from chapters.ch21_hyperparameters import schedules as S
from chapters.ch21_hyperparameters.gns import dp_step_norms, noise_scale
from chapters.ch21_hyperparameters.problem import (
    closed_form_noise_scales,
    feature_scales,
    sample,
    target_point,
)
from common.results import RunRecorder

# The noise scales and their four parts measured at the target point against their closed
# forms: a sample of noise_batches x B per-example gradients, so a statistical tolerance. Over 10
# problems (seeds 0-9) at 800 batches of 48 (micro-batches of 1 and of 4) the parts fell within
# 4.4 % of their closed forms and the ratios within 5.7 % (standard error about 2.5 %); the
# big-batch norm taken for |G|^2 misses by 23-39 %, a metric of standard deviations instead of
# variances puts tr(H Sigma) 23-29 % off (the lesson).
CLOSED_FORM_TOLERANCE = 0.10  # relative


def measure_noise_scales(w: torch.Tensor, cfg, info,
                         h: torch.Tensor | None = None) -> dict:
    """The noise scales at fixed weights `w`, measured the data-parallel way over
    `noise_batches` fresh global batches: each batch's two norms give unbiased estimates of
    |G|^2 and tr(Sigma) (and, in the Hessian's metric h = 2v, of G^T H G and tr(H Sigma));
    numerators and denominators are averaged separately, then divided. Also the biased
    versions that take the big-batch norm alone for |G|^2 and G^T H G (the controls)."""
    g = torch.Generator().manual_seed(cfg.seed + 54321)  # the same batches on every rank
    if h is None:
        h = 2 * feature_scales(cfg) ** 2  # the Hessian of the loss, diagonal
    h = h.to(info.device)
    B, m, sums = cfg.global_batch_size, cfg.micro_batch_size, torch.zeros(6, dtype=torch.float64)
    for _ in range(cfg.noise_batches):
        x, y = sample(cfg, B, g)
        n = dp_step_norms(w.to(info.device), x.to(info.device), y.to(info.device), cfg,
                          info.rank, info.world_size, h)
        plain, metric = noise_scale(n.small_sq, n.big_sq, m, B), noise_scale(n.small_h, n.big_h, m, B)
        sums += torch.tensor([plain["trace"], plain["g2"], metric["trace"], metric["g2"], n.big_sq,
                              n.big_h], dtype=torch.float64)
    tr, g2, tr_h, g2_h, big, big_h = (s / cfg.noise_batches for s in sums.tolist())
    return {"b_simple": tr / g2, "b_noise": tr_h / g2_h, "b_simple_biased": tr / big,
            "g2": g2, "trace": tr, "g2_h": g2_h, "trace_h": tr_h, "g2_biased": big,
            "g2_h_biased": big_h}


PARTS = (("g2", "|G|^2 at target == 4 e'V^2 e"),
         ("trace", "tr(Sigma) at target == 4(L trV + e'V^2 e)"),
         ("g2_h", "G'HG at target == 8 e'V^3 e"),
         ("trace_h", "tr(H Sigma) at target == 8(L trV^2 + e'V^3 e)"))


def check_noise_scales(rec: RunRecorder, cfg, info) -> dict:
    """Both noise scales at the target point, and the four unbiased estimates they are ratios
    of, measured, against their closed forms (a ratio alone lets errors in its two parts
    cancel); the biased estimates (big-batch norm alone) fail the same tolerance."""
    w = target_point(cfg)
    exact, meas = closed_form_noise_scales(cfg, w), measure_noise_scales(w, cfg, info)
    for key, name in PARTS:
        rec.check(f"{name} (DP estimator, rel.)", "formula", meas[key], exact[key],
                  CLOSED_FORM_TOLERANCE, relative=True)
    for key, name in (("b_simple", "B_simple"), ("b_noise", "B_noise")):
        rec.check(f"{name} at target, DP estimator == closed form (rel.)", "formula", meas[key],
                  exact[key], CLOSED_FORM_TOLERANCE, relative=True)
    off = abs(meas["b_simple_biased"] / exact["b_simple"] - 1)
    rec.check("B_simple, big-batch norm alone: off the closed form (control)", "formula", off,
              CLOSED_FORM_TOLERANCE, compare=">")
    off = min(abs(meas["g2_biased"] / exact["g2"] - 1), abs(meas["g2_h_biased"] / exact["g2_h"] - 1))
    rec.check("|G|^2 and G'HG, big-batch norms alone: off (control, the smaller)", "formula", off,
              CLOSED_FORM_TOLERANCE, compare=">")
    # the metric of standard deviations, 2 sqrt(v), for the Hessian 2v: the ratio B_noise moves
    # less than the tolerance, tr(H Sigma) more, so only the parts catch it
    wrong = measure_noise_scales(w, cfg, info, h=2 * feature_scales(cfg))
    rec.figure("B_noise, metric 2·std for 2·var: off the closed form (rel.)",
               round(abs(wrong["b_noise"] / exact["b_noise"] - 1), 4))
    off = abs(wrong["trace_h"] / exact["trace_h"] - 1)
    rec.check("tr(H Sigma), metric 2·std for 2·var: off (control)", "formula", off,
              CLOSED_FORM_TOLERANCE, compare=">")
    return exact


def check_schedules(rec: RunRecorder) -> None:
    """Each schedule at chosen steps against its formula worked out by hand."""
    peak, T, w, floor = 1.0, 100, 10, 0.1
    hand = {  # step -> value, worked out from the formulas in the lesson
        "warmup": [(0, 0.1), (4, 0.5), (9, 1.0), (50, 1.0)],
        "cosine": [(0, 0.1), (10, 1.0), (55, 0.55), (100, 0.1)],
        "wsd": [(0, 0.1), (9, 1.0), (80, 1.0), (90, 0.55), (100, 0.1)],
    }
    got = {"warmup": lambda s: S.linear_warmup(s, peak, w),
           "cosine": lambda s: S.cosine(s, peak, T, w, floor),
           "wsd": lambda s: S.wsd(s, peak, T, w, 20, floor)}
    for name, points in hand.items():
        err = max(abs(got[name](s) - v) for s, v in points)
        rec.check(f"{name} == formula at {len(points)} steps", "formula", err, 0.0, 1e-15)
    err = max(abs(S.linear_scaled(0.1, b, 256) - v) for b, v in ((256, 0.1), (1024, 0.4), (4096, 1.6)))
    err2 = max(abs(S.sqrt_scaled(0.1, b, 256) - v) for b, v in ((256, 0.1), (1024, 0.2), (4096, 0.4)))
    rec.check("linear and sqrt scaling == formula", "formula", max(err, err2), 0.0, 1e-15)
    torch_lrs = S.torch_cosine_lrs(peak, T, w, floor)
    diff = max(abs(a - S.cosine(s, peak, T, w, floor)) for s, a in enumerate(torch_lrs))
    rec.check("cosine == torch LinearLR+CosineAnnealingLR", "parity", diff, 0.0, 1e-12)
    shifted = max(abs(a - S.cosine(s - 1, peak, T, w, floor)) for s, a in enumerate(torch_lrs) if s)
    rec.check("off-by-one cosine differs from torch (control)", "parity", shifted, 1e-12, compare=">")
