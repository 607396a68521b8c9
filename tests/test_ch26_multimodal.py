"""Chapter 26: CLIP's contrastive loss with negatives from every rank equals one process.

The script checks itself (summary.json); this module also writes the global-batch loss out by
hand (log-sum-exp, no `cross_entropy`) and compares every gather and loss with it on 2 and 4
gloo ranks, runs the negative controls (a gather without gradients), counts the logits bytes
against b·B and B², and checks the zero-shot claim and its control (an untrained model).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from chapters.ch26_multimodal import contrastive, data, train
from chapters.ch26_multimodal.checks import (
    FIRST_STEP_TOLERANCE,
    SCALE_SUM_BOUND,
    distributed_gradients,
    first_step_gap,
    parity_tolerance,
)
from chapters.ch26_multimodal.model import CLIP
from common.launch import run_on_ranks, run_torchrun

SCRIPT = Path(train.__file__)
TOL = parity_tolerance(48, 16)  # 4.6e-11 in float64 at B = 48; the lesson derives it


def reference_loss(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The global-batch CLIP loss written out: for each row of s·I·Tᵀ and each column, the
    log-sum-exp minus the diagonal, averaged over the B rows and the B columns, halved."""
    logits = scale * img @ txt.T
    diag = logits.diagonal()
    rows = torch.logsumexp(logits, dim=1) - diag
    cols = torch.logsumexp(logits, dim=0) - diag
    return (rows.mean() + cols.mean()) / 2


def _parity(global_batch: int = 48) -> dict:
    """On every rank: the test's own one-process reference on the whole batch, then each gather
    and loss of the chapter on this rank's shard with gradients averaged over the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = CLIP().double()
    images, ids, _ = data.make_pairs(global_batch, 7, data.split_combinations()[0], dtype=torch.float64)
    model.zero_grad()
    ref = reference_loss(*model(images, ids))
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = {"ref_loss": ref.item()}
    for how in contrastive.GATHERS:
        for local in (False, True):
            loss, grads, counter, tap = distributed_gradients(model, images, ids, how, local,
                                                              rank, world)
            out[how, local] = {
                "sent": dict(tap.sent),
                "dloss": abs(loss - ref.item()),
                "dgrad": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads),
                "logits_bytes": counter.logits_bytes, "shapes": counter.shapes,
                "tower_ratio": (sum((grads[n] * ref_grads[n]).sum() for n in grads if n != "logit_scale")
                                / sum((ref_grads[n] ** 2).sum() for n in grads if n != "logit_scale")).item(),
                "scale_ratio": (grads["logit_scale"] / ref_grads["logit_scale"]).item(),
                "grads": grads,
            }
    out["skipped"] = _skipped_gather(model, images, ids, ref.item(), ref_grads, rank, world)
    out["training"] = {how: _train_steps(how, rank, world) for how in ("torch", "nograd")}
    out["first_step"] = {(how, local): _first_step(how, local, rank, world)
                         for how in ("torch", "nograd") for local in (False, True)}
    return out


def _skipped_gather(model, images, ids, ref_loss, ref_grads, rank, world) -> dict:
    """The negative control for the byte count: a hand gather whose all-gather is skipped
    (each rank fills every slot with its own rows) but that still reports what it 'sent' from
    the shapes, as a counter in the gather itself would. The tap at c10d sees nothing."""
    def local_fill(out, x, group=None):
        out.copy_(x.repeat(world, *[1] * (x.dim() - 1)))

    claimed = []
    real = contrastive.all_gather_single
    contrastive.all_gather_single = lambda out, x, group=None: (
        claimed.append(x.numel() * x.element_size()), local_fill(out, x))
    try:
        loss, grads, _, tap = distributed_gradients(model, images, ids, "hand", False, rank, world)
    finally:
        contrastive.all_gather_single = real
    return {"claimed": sum(claimed), "tapped": tap.nbytes("all_gather"),
            "dloss": abs(loss - ref_loss),
            "dgrad": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)}


def _first_step(how: str, local: bool, rank: int, world: int) -> float:
    """The script's first-training-step check (`checks.first_step_gap`) on a float32 DDP model."""
    torch.manual_seed(2)
    model = CLIP()
    ddp = DDP(model)
    images, ids, _ = data.make_pairs(48, 30, data.split_combinations()[0])
    img, txt, scale = ddp(data.shard(images, rank, world), data.shard(ids, rank, world))
    contrastive.distributed_clip_loss(img, txt, scale, how, local).backward()
    return first_step_gap(model, images, ids)


def _train_steps(how: str, rank: int, world: int, steps: int = 2) -> float:
    """DDP + the chapter's distributed local loss against one process on the global batches
    with the test's own loss, SGD, float64: max |dparam| after `steps` steps."""
    torch.manual_seed(1)
    ref = CLIP().double()
    ddp = DDP(copy.deepcopy(ref))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(steps):
        images, ids, _ = data.make_pairs(48, 20 + step, data.split_combinations()[0], dtype=torch.float64)
        opt_ref.zero_grad()
        reference_loss(*ref(images, ids)).backward()
        opt_ref.step()
        opt.zero_grad()
        img, txt, scale = ddp(data.shard(images, rank, world), data.shard(ids, rank, world))
        contrastive.distributed_clip_loss(img, txt, scale, how, local=True).backward()
        opt.step()
    return max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ddp.module.parameters()))


@pytest.fixture(scope="module", params=[2, 4])
def parity(request):
    return request.param, run_on_ranks(_parity, request.param, timeout=90)


@pytest.mark.timeout(120)
def test_gathers_with_gradients_equal_one_process(parity):
    world, results = parity
    for rank, res in enumerate(results):
        for how in ("hand", "torch"):
            for local in (False, True):
                r = res[how, local]
                assert r["dloss"] <= TOL and r["dgrad"] <= TOL, (world, rank, how, local, r)


@pytest.mark.timeout(120)
def test_hand_gather_equals_torch_gather(parity):
    world, results = parity
    for res in results:
        for local in (False, True):
            hand, lib = res["hand", local]["grads"], res["torch", local]["grads"]
            assert max((hand[n] - lib[n]).abs().max().item() for n in hand) <= TOL


@pytest.mark.timeout(120)
def test_ddp_training_with_the_distributed_loss_equals_one_process(parity):
    world, results = parity
    for res in results:
        assert res["training"]["torch"] <= TOL  # 2 SGD steps, local loss, gather with gradients
        assert res["training"]["nograd"] > 1e3 * TOL  # the control: the same check fails


@pytest.mark.timeout(120)
def test_first_training_step_check_rejects_a_gather_without_gradients(parity):
    world, results = parity
    for res in results:
        for local in (False, True):
            assert res["first_step"]["torch", local] <= FIRST_STEP_TOLERANCE
            assert res["first_step"]["nograd", local] > 10 * FIRST_STEP_TOLERANCE
        # global loss: the towers get 1/W of their gradient, a relative gap of 1 - 1/W
        assert abs(res["first_step"]["nograd", False] - (1 - 1 / world)) < 1e-3


@pytest.mark.timeout(120)
def test_gather_without_gradients_is_rejected(parity):
    world, results = parity
    for res in results:
        for local in (False, True):
            assert res["nograd", local]["dgrad"] > 1e3 * TOL  # the same check fails, by far
        # global loss: every rank computes the whole loss, but only its own embeddings are live,
        # so after averaging the towers get exactly 1/W of their gradient; the temperature
        # (live on every rank) all of it
        assert abs(res["nograd", False]["tower_ratio"] - 1 / world) < 1e-9
        assert abs(res["nograd", False]["scale_ratio"] - 1) < 1e-9
        # the local loss without gradients through the gather is not even a rescaling
        assert abs(res["nograd", True]["tower_ratio"] - 1 / world) > 1e-3


@pytest.mark.timeout(120)
def test_logits_bytes_are_b_by_B_against_B_squared(parity):
    world, results = parity
    B, b = 48, 48 // world
    for res in results:
        assert res["hand", False]["shapes"] == [(B, B)]
        assert res["hand", False]["logits_bytes"] == B * B * 8
        assert res["hand", True]["shapes"] == [(b, B), (b, B)]
        assert res["hand", True]["logits_bytes"] == 2 * b * B * 8


@pytest.mark.timeout(120)
def test_gathered_bytes_are_counted_at_c10d_and_a_skipped_gather_counts_nothing(parity):
    """Bytes handed to c10d by the gathers (this rank's b x d of each embedding) and by the
    gathers' backward (the whole B x d gradient of each), computed here from B, W and d; the
    backward of the no-gradient gather hands nothing to c10d; a gather that skips the collective but counts what it meant to
    send is caught by the tap (and by parity)."""
    world, results = parity
    B, b, d, e = 48, 48 // world, 32, 8  # d: CLIP()'s default embedding width
    for res in results:
        for how in ("hand", "torch"):
            for local in (False, True):
                sent = res[how, local]["sent"]
                assert sent["all_gather"] == 2 * b * d * e
                back = sum(sent.get(k, 0) for k in contrastive.BACKWARD_KINDS)
                assert back == 2 * B * d * e, (how, local, sent)
        assert res["hand", False]["sent"].get("reduce_scatter") == 2 * B * d * e  # by hand
        assert res["torch", False]["sent"].get("scatter") == 2 * B * d * e  # gloo: scatters
        nograd = res["nograd", False]["sent"]
        assert nograd["all_gather"] == 2 * b * d * e
        assert sum(nograd.get(k, 0) for k in contrastive.BACKWARD_KINDS) == 0
        skipped = res["skipped"]
        assert skipped["claimed"] == 2 * b * d * e  # what a counter in the gather would say
        assert skipped["tapped"] == 0  # what reached c10d
        assert skipped["dgrad"] > 1e3 * TOL


def _temperature_sum(B: int) -> tuple[float, float]:
    """The script's untrained model on B pairs of its parity batch: the sum of |terms| of the
    temperature's gradient, both directions of dL/dlogit_ij x logit_ij (2B² terms, written out
    here from the softmax), and that gradient against autograd's."""
    cfg = train.Config()
    torch.manual_seed(cfg.seed)
    model = CLIP(cfg.embed_dim, cfg.image_size).double()
    images, ids, _ = data.make_pairs(B, cfg.seed + 100, data.split_combinations()[0],
                                     cfg.image_size, torch.float64)
    img, txt, scale = model(images, ids)
    contrastive.clip_loss(img, txt, scale).backward()
    logits, eye = (scale * img @ txt.T).detach(), torch.eye(B, dtype=torch.float64)
    per_image, per_text = (logits.softmax(1) - eye) / (2 * B), (logits.softmax(0) - eye) / (2 * B)
    terms = torch.cat([(per_image * logits).flatten(), (per_text * logits).flatten()])
    return terms.abs().sum().item(), abs(terms.sum().item() / model.logit_scale.grad.item() - 1)


def test_parity_tolerance_follows_the_batch():
    """The lesson's numbers: the worst case 2(n-1)·u·bound of the longer sum the split reorders,
    the first convolution's (n = B x 16 x 16, bound 17) or the temperature's (n = 2B², bound 8),
    and the temperature's bound against its terms summed here at B = 48 and 1024."""
    u = 2.0**-53
    assert parity_tolerance(48, 16) == pytest.approx(2 * (12_288 - 1) * u * 17)  # conv
    assert 4.6e-11 < parity_tolerance(48, 16) < 4.7e-11
    b2 = 2 * 1024**2  # at B = 1024 the temperature's sum: 2,097,152 terms
    assert parity_tolerance(1024, 16) == pytest.approx(2 * (b2 - 1) * u * 8)
    assert 3.7e-9 < parity_tolerance(1024, 16) < 3.8e-9
    assert parity_tolerance(1024, 16) > 2 * (1024 * 256 - 1) * u * 17  # conv: 9.9e-10
    for B, lo in ((48, 7.7), (1024, 7.5)):  # 7.79 and 7.53, under the bound 8
        total, rel = _temperature_sum(B)
        assert rel < 1e-12 and lo < total <= SCALE_SUM_BOUND, (B, total, rel)


def test_caption_set_and_held_out_split():
    bank, texts = data.caption_bank()
    assert len(set(texts)) == 64 and bank.shape == (64, data.CAPTION_LEN)
    train_combos, held = data.split_combinations()
    assert len(train_combos) == 48 and len(held) == 16 and not set(train_combos) & set(held)
    # every held-out pair combines a shape and a colour that training shows in other pairs
    for shape, colour, _ in held:
        assert any(s == shape for s, c, _ in train_combos) and any(c == colour for s, c, _ in train_combos)
    a = data.make_pairs(8, 3, held)
    b = data.make_pairs(8, 3, held)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # a pure function of the seed


@pytest.mark.timeout(150)
def test_training_run_checks_and_zero_shot(tmp_path):
    # the defaults (200 steps), as the notebook launches them: a test session hands it this run
    assert train.Config().steps == 200
    res = run_torchrun(SCRIPT, 2, timeout=140, out_dir=tmp_path)
    checks = res.summary["checks"]
    assert checks and all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]
    zs = res.check("zero-shot accuracy, held-out pairs >= chance + 0.2")
    assert zs["expected"] == round(1 / 64 + 0.2, 4) and zs["measured"] >= zs["expected"]
    # the control: the same model before training does not pass the same bound
    before = res.summary["figures"]["zero-shot accuracy before training (held-out)"]["measured"]
    assert before < zs["expected"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["loss"] < 0.5 * lines[0]["loss"]
    assert res.check("largest logits matrix per rank, local = b·B x 8")["measured"] == 24 * 48 * 8
    # the bytes the tap saw at c10d, and the float64 parity at the batch's own tolerance
    B, b, d, e = 48, 24, 32, 8
    for how in ("hand", "torch", "nograd"):
        assert res.check(f"bytes the gather hands to c10d's all-gather, {how} = 2·b·d x 8")[
            "measured"] == 2 * b * d * e
    for how in ("hand", "torch"):
        assert res.check(f"bytes the gather's backward hands to c10d, {how} = 2·B·d x 8")[
            "measured"] == 2 * B * d * e
        parity = res.check(f"{how} gather, global loss == one process (max |dloss|, |dgrad|)")
        assert parity["tolerance"] == pytest.approx(TOL) and parity["measured"] <= 1e-13
    control = res.check("bytes the gather's backward hands to c10d, nograd < 2·B·d x 8 (control)")
    assert control["ok"] and control["measured"] == 0
    first = res.check("first training step, torch gather: gradient == one process (float32, relative)")
    assert first["tolerance"] == FIRST_STEP_TOLERANCE and first["ok"]
    # the last batch's loss floor, counted here from the regenerated captions: no loss goes below
    _, ids, _ = data.make_pairs(200 * 48, 1, data.split_combinations()[0])
    last = [tuple(c) for c in ids[-48:].tolist()]
    floor = sum(torch.tensor(float(last.count(c))).log().item() for c in last) / 48
    final = res.summary["figures"]["final loss (global batch); expected: its floor"]
    assert abs(final["expected"] - floor) < 1e-4 and final["measured"] >= floor


def test_exercise_numbers():
    """Exercise 1: logits bytes per rank at W = 8, B = 32768, bf16."""
    assert contrastive.logits_bytes_formula(32768, 8, False, 2) == 2_147_483_648
    assert contrastive.logits_bytes_formula(32768, 8, True, 2) == 536_870_912


def test_loss_floor_of_duplicate_captions():
    ids = torch.tensor([[1, 2], [1, 2], [3, 4]])
    assert abs(data.loss_floor(ids) - 2 * math.log(2) / 3) < 1e-12
    # the lesson's numbers: B = 48 and B = 1024 drawn from the 48 training captions
    assert round(data.expected_loss_floor(48, 48), 3) == 0.565
    assert round(data.expected_loss_floor(1024, 48), 3) == 3.083


def test_saved_log_softmax_bytes():
    """What autograd keeps beside the logits (the lesson's 3·B² against 4·b·B): one log-softmax
    per direction, a new matrix of each direction's logits shape, counted by storage."""
    B, world, d = 48, 4, 20  # d differs from b and B, so embeddings are not mistaken for logits
    b = B // world
    img, txt = torch.randn(B, d, dtype=torch.float64), torch.randn(B, d, dtype=torch.float64)
    img.requires_grad_(True)
    txt.requires_grad_(True)
    scale = torch.tensor(14.3, dtype=torch.float64, requires_grad=True)

    def saved_logits_bytes(loss_fn) -> int:
        storages = {}

        def pack(t):
            if t.dim() == 2 and t.shape[1] == B and t.shape[0] in (b, B):
                storages[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn()
        return sum(storages.values())

    assert saved_logits_bytes(lambda: contrastive.clip_loss(img, txt, scale)) == 2 * B * B * 8
    local = saved_logits_bytes(lambda: contrastive.local_clip_loss(img[:b], txt[:b], img, txt, scale, 0))
    assert local == 2 * b * B * 8
