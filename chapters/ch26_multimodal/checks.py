"""The proofs chapter 26's run records, beside the training loop in `train.py`: every gather
and loss against one process on the global batch in float64 (`check_parity`, through
`global_batch_gradients` and `distributed_gradients`, at the bound `parity_tolerance` derives),
the gather without gradients as the control, the logits and gathered bytes against their
formulas; the training loop's first step against one process (`first_step_gap`); and zero-shot
retrieval of held-out colour/shape pairs (`zero_shot` on an `eval_set`, `check_zero_shot`).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from chapters.ch26_multimodal import contrastive, data
from chapters.ch26_multimodal.contrastive import (
    BACKWARD_KINDS,
    CollectiveTap,
    Counter,
    clip_loss,
    distributed_clip_loss,
)
from chapters.ch26_multimodal.data import shard
from chapters.ch26_multimodal.model import CLIP
from common.distributed import reduce_number
from common.results import RunRecorder
from common.seed import seed_everything

# float64 parity: two results of one sum of n terms taken in different orders differ by at most
# 2(n-1)·u·sum|terms| (each is within (n-1)·u·sum|terms| of the exact sum; u = 2^-53). The split
# reorders two long sums. The first convolution's weight gradients: n = B x image_size² terms
# (48 x 16 x 16 = 12,288 by default), magnitudes adding up to at most GRAD_SUM_BOUND (16.7 at
# B = 48, 16.4 at B = 1024, the untrained model). The temperature's gradient: sum over both
# directions of dL/dlogit_ij x logit_ij, n = 2B² terms (4,608 at B = 48, 2,097,152 at B = 1024),
# magnitudes adding up to at most SCALE_SUM_BOUND (7.79 at B = 48, 7.53 at B = 1024, the
# untrained model; at most 2/0.07 = 28.6 at CLIP's initial temperature). Worst cases at B = 48:
# 4.6e-11 (convolution), 8.2e-12 (temperature); at B = 1024: 9.9e-10 and 3.7e-9 (the
# temperature's bound is the larger above B = 272). Usual estimate sqrt(n)·u·bound: ~2e-13 and
# ~1e-12; measured ~1e-15. See the lesson.
GRAD_SUM_BOUND = 17.0
SCALE_SUM_BOUND = 8.0


def parity_tolerance(global_batch: int, image_size: int) -> float:
    """The worst case 2(n-1)·u·bound of reordering the longer of the two sums the split reorders
    (the first convolution's weight gradients, n = B·image_size²; the temperature's, n = 2B²):
    4.6e-11 at B = 48, 3.7e-9 at B = 1024 (16-pixel images); it grows with B because they do."""
    u = torch.finfo(torch.float64).eps / 2
    conv, temp = global_batch * image_size**2, 2 * global_batch**2
    return max(2 * (conv - 1) * u * GRAD_SUM_BOUND, 2 * (temp - 1) * u * SCALE_SUM_BOUND)


# The first training step in float32, relative to the largest gradient: 3e-7 measured on CPU;
# room for TF32 convolutions on GPUs; a gather without gradients misses by 0.5 or more (lesson).
FIRST_STEP_TOLERANCE = 1e-2
VARIANTS = (("hand", False), ("torch", False), ("hand", True), ("torch", True))


def average_gradients(model: torch.nn.Module) -> None:
    """Chapter 03's data parallelism: sum every gradient over the ranks, divide by the world."""
    world = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world


def global_batch_gradients(model: CLIP, images, ids) -> tuple[float, dict]:
    """One process on the whole global batch: the reference loss and gradients."""
    model.zero_grad()
    loss = clip_loss(*model(images, ids))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def distributed_gradients(model: CLIP, images, ids, gather_how: str, local: bool,
                          rank: int, world: int) -> tuple[float, dict, Counter, CollectiveTap]:
    """This rank's shard through the distributed loss, then the gradients averaged over the
    ranks (as DDP would): the mean loss over the ranks, the averaged gradients, the logits
    built and what the loss's forward and backward handed to collectives (counted at c10d)."""
    model.zero_grad()
    counter = Counter()
    img, txt, scale = model(shard(images, rank, world), shard(ids, rank, world))
    with CollectiveTap() as tap:  # the gathers and their backward, nothing else
        loss = distributed_clip_loss(img, txt, scale, gather_how, local, counter)
        loss.backward()
    average_gradients(model)
    mean_loss = reduce_number(loss.detach()) / world
    return mean_loss, {n: p.grad.clone() for n, p in model.named_parameters()}, counter, tap


def max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def check_parity(rec: RunRecorder, cfg, info) -> None:
    """Loss and gradients of every gather and loss against one process on the global batch
    (float64, the same weights and batch on every rank), the no-gradient gather as the control,
    and the logits and gathered bytes against their formulas."""
    rank, world, B = info.rank, info.world_size, cfg.global_batch_size
    tol = parity_tolerance(B, cfg.image_size)
    seed_everything(cfg.seed)
    model = CLIP(cfg.embed_dim, cfg.image_size).to(info.device, torch.float64)
    train_combos, _ = data.split_combinations()
    images, ids, _ = data.make_pairs(B, cfg.seed + 100, train_combos, cfg.image_size, torch.float64)
    images, ids = images.to(info.device), ids.to(info.device)
    ref_loss, ref_grads = global_batch_gradients(model, images, ids)
    rec.figure("global-batch loss at the start (one process)", round(ref_loss, 6))
    e, b, d = 8, B // world, cfg.embed_dim  # float64 bytes per element; pairs per rank
    for how, local in VARIANTS + (("nograd", False), ("nograd", True)):
        loss, grads, counter, tap = distributed_gradients(model, images, ids, how, local, rank, world)
        name = f"{how} gather, {'local' if local else 'global'} loss"
        worst = reduce_number(max(abs(loss - ref_loss), max_diff(grads, ref_grads)), "max")
        if not local:  # what the gathers handed to c10d: the embeddings, and in backward their
            # gradients (the whole B x d of each, reduce-scattered; on gloo torch scatters them)
            rec.check(f"bytes the gather hands to c10d's all-gather, {how} = 2·b·d x 8", "formula",
                      tap.nbytes("all_gather"), 2 * b * d * e)
            if how == "nograd":  # nothing goes back: the control, rejected by the same formula
                rec.check("bytes the gather's backward hands to c10d, nograd < 2·B·d x 8 (control)",
                          "formula", tap.nbytes(*BACKWARD_KINDS), 2 * B * d * e, compare="<")
            else:
                rec.check(f"bytes the gather's backward hands to c10d, {how} = 2·B·d x 8", "formula",
                          tap.nbytes(*BACKWARD_KINDS), 2 * B * d * e)
        if how == "nograd" and world > 1:
            rec.check(f"{name} != one process (control)", "parity", worst, tol, compare=">")
            if not local:  # the towers get 1/W of their gradient; the temperature all of it
                tower = [n for n in grads if n != "logit_scale"]
                ratio = sum((grads[n] * ref_grads[n]).sum() for n in tower) / \
                    sum((ref_grads[n] ** 2).sum() for n in tower)
                rec.check("no-grad gather, global loss: tower gradient / true", "formula",
                          ratio.item(), 1 / world, tolerance=1e-9)
        elif how != "nograd":
            rec.check(f"{name} == one process (max |dloss|, |dgrad|)", "parity", worst, 0.0,
                      tolerance=tol)
        if how == "hand":
            kind, rows = ("local", b) if local else ("global", B)
            rec.check(f"largest logits matrix per rank, {kind} = {'b·B' if local else 'B²'} x 8",
                      "formula", max(r * c for r, c in counter.shapes) * e, rows * B * e)
            rec.check(f"logits bytes per rank, {kind} = {'2·b·B' if local else 'B²'} x 8",
                      "formula", counter.logits_bytes,
                      contrastive.logits_bytes_formula(B, world, local, e))
    if world == 1:
        rec.figure("no-grad gather control", "n/a at world 1 (nothing to gather)")


def first_step_gap(model: CLIP, images, ids) -> float:
    """The training loop's own gradients (after DDP's averaging) against one process's on the
    same weights and global batch: max |difference| over max |gradient|, the worst rank's."""
    ref_model = copy.deepcopy(model)
    _, ref = global_batch_gradients(ref_model, images, ids)
    scale = max(g.abs().max().item() for g in ref.values())
    gap = max((p.grad - ref[n]).abs().max().item() for n, p in model.named_parameters())
    return reduce_number(gap / scale, "max")


def zero_shot(model: CLIP, images, truth, device) -> float:
    """Top-1 accuracy of retrieving each image's caption among all 64 captions."""
    bank, _ = data.caption_bank()
    with torch.no_grad():
        sims = model.encode_image(images.to(device)) @ model.encode_text(bank.to(device)).T
    return (sims.argmax(dim=1).cpu() == truth).float().mean().item()


def eval_set(cfg, combos: list, seed: int):
    """Fresh images of the given combinations and the index of their caption in the bank."""
    images, _, which = data.make_pairs(cfg.eval_pairs, seed, combos, cfg.image_size)
    everything = data.all_combinations()
    return images, torch.tensor([everything.index(combos[int(k)]) for k in which])


def check_zero_shot(rec: RunRecorder, cfg, model: CLIP, info) -> None:
    """Retrieval of held-out colour/shape pairs against chance, beside seen pairs."""
    train_combos, held = data.split_combinations()
    chance = 1 / len(data.all_combinations())
    acc = zero_shot(model, *eval_set(cfg, held, cfg.seed + 2), info.device)
    seen = zero_shot(model, *eval_set(cfg, train_combos, cfg.seed + 3), info.device)
    rec.figure("zero-shot accuracy, seen colour/shape pairs", round(seen, 4), unit="top-1")
    rec.check(f"zero-shot accuracy, held-out pairs >= chance + {cfg.margin}", "count",
              round(acc, 4), round(chance + cfg.margin, 4), compare=">=")
