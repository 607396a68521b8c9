"""Chapter 10: mixed precision. Loss scaling saves fp16 gradients from underflow, the hand
scaler makes GradScaler's decisions exactly, bf16 and fp16 track fp32 on training that moves,
fp32 master weights keep the updates bf16 weights round away, FSDP2's MixedPrecisionPolicy
computes in bf16 and reduces in fp32 (read off the tensors sent).

One real torchrun launch checks itself (summary.json); this module also computes the fp32
single-process reference with its own plain loop, counts lost bf16 updates with its own loop,
and runs the negative controls on two spawned gloo ranks: autocast silently off, FSDP2 without
its policy and with a bf16 reduce, a scaler that never backs off, one that never skips, and
bf16 weights without a master copy.
"""

from __future__ import annotations

import ast
import copy
import math
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from chapters.ch10_mixed_precision import checks, formats, loss_scaler, train
from common.checkpoint import load_checkpoint
from common.data import regression_data
from common.launch import run_on_ranks, run_torchrun
from common.models import MLP

SCRIPT = Path(train.__file__)
INF_STEPS = {3, 4, 9, 15}


def batches(cfg: train.Config):
    X, Y = regression_data(cfg.steps * cfg.global_batch_size, cfg.d_in, 1, seed=cfg.seed)
    return X.view(cfg.steps, -1, cfg.d_in), Y.view(cfg.steps, -1, 1)


def reference_fp32(cfg: train.Config) -> tuple[dict, list[float]]:
    """One process, whole global batch, plain SGD written out: what 2-rank fp32 must equal."""
    X, Y = batches(cfg)
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.d_in, cfg.d_hidden, 1)
    losses = []
    for step in range(cfg.steps):
        loss = ((model(X[step]) - Y[step]) ** 2).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= cfg.lr * g
        losses.append(loss.item())
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


@pytest.mark.timeout(150)
def test_two_rank_run_checks_and_matches_an_independent_reference(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=140)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    cfg = train.Config()
    expected, losses = reference_fp32(cfg)
    assert losses[-1] < losses[0] / 4, "the reference must train, not sit still"
    saved = load_checkpoint(tmp_path / "final_params.pt")
    # DDP and FSDP2 in fp32 on 2 ranks == one process (float32 summation order only).
    for name, value in expected.items():
        assert torch.allclose(saved["fsdp_fp32"][name], value, atol=1e-5), name
    assert torch.allclose(saved["losses"]["fp32"], torch.tensor(losses), rtol=1e-5)
    # FSDP2 with the bf16 policy ends within the lesson's bf16 tolerance of the fp32 run ...
    gap = max(((saved["fsdp_bf16"][n] - v).norm() / v.norm()).item() for n, v in expected.items())
    assert 0 < gap < checks.LOSS_TOL["bf16"], gap
    final = saved["fsdp_losses"]["bf16"][-1].item()
    assert abs(final - losses[-1]) / losses[-1] < checks.LOSS_TOL["bf16"]
    # ... all-gathering bf16, computing in bf16, reducing and storing fp32 (read off the tensors).
    assert res.summary["figures"]["FSDP2 bf16 policy: dtypes (gather, weight, output, reduce, stored)"][
        "measured"] == "bf16 bf16 bf16 fp32 fp32"
    assert res.check("FSDP2 bf16 policy: places off the policy")["measured"] == 0
    assert res.check("control: FSDP2 without its policy is rejected")["measured"] == 3
    # bf16 and fp16 track fp32 from above and below: each forward really ran in its dtype ...
    for p in ("bf16", "fp16"):
        u = torch.finfo(train.LOW[p]).eps / 2
        low = res.check(f"DDP {p}: forward in {p} (step-0 output gap to fp32 >= u/10)")
        assert low["expected"] == pytest.approx(u / 10) and low["measured"] >= u / 10
        curve = res.check(f"DDP {p} loss curve == fp32 (max rel. gap)")
        assert curve["measured"] <= curve["tolerance"] == checks.LOSS_TOL[p]
        assert res.check(f"DDP {p}: all-reduce dtype")["measured"] == p
    n_params = sum(v.numel() for v in expected.values())
    assert res.check("DDP bf16: bytes all-reduced = steps x params x 2")["measured"] == cfg.steps * n_params * 2
    assert res.check("DDP fp32: bytes all-reduced = steps x params x 4")["measured"] == cfg.steps * n_params * 4
    # ... and bf16 weights without a master copy do not, under the same check.
    tol = res.check("DDP bf16 loss curve == fp32 (max rel. gap)")["tolerance"]
    assert res.check("control: bf16 weights without fp32 master copy rejected")["measured"] > tol
    assert res.summary["figures"]["updates lost, bf16 weights (no master copy)"]["measured"] > 0.5
    assert res.summary["figures"]["updates lost, fp32 master weights"]["measured"] < 1e-3
    for name in ("fp32 master weights", "bf16 weights (no master copy)"):  # element by element
        assert res.check(f"rounding rule wrong (outside the band), {name}")["measured"] == 0
        assert res.summary["figures"][f"updates near the threshold (2^-7), {name}"]["measured"] < 0.01
    # ... and the same count is far from 0 for a rule with the whole spacing as threshold
    broken = res.check("control: whole spacing as threshold is wrong (bf16 weights)")["measured"]
    assert broken > 0.01 * cfg.steps * n_params  # of 2 x steps x params updates
    assert res.summary["figures"]["DDP fp16 skipped steps"]["measured"] == []


def _info():
    return types.SimpleNamespace(rank=dist.get_rank(), world_size=dist.get_world_size(),
                                 device=torch.device("cpu"), backend="gloo", is_main=dist.get_rank() == 0)


def _controls_on_ranks() -> dict:
    """The negative controls, each rejected by the check that accepts the real thing."""
    cfg, info = train.Config(steps=6), _info()
    X, Y = batches(cfg)
    torch.manual_seed(0)
    model = MLP(cfg.d_in, cfg.d_hidden, 1)
    out = {}
    fp32 = train.train_ddp(copy.deepcopy(model), X, Y, cfg, info, "fp32")
    bf16 = train.train_ddp(copy.deepcopy(model), X, Y, cfg, info, "bf16")
    off = train.train_ddp(copy.deepcopy(model), X, Y, cfg, info, "bf16", autocast_enabled=False)
    out["gap_on"], out["gap_off"] = checks.output_gap(bf16, fp32), checks.output_gap(off, fp32)
    out["dtypes_off"] = off["dtypes"]  # the all-reduce still ran in bf16: dtype checks miss it
    fsdp = {}
    for name, param, reduce in (("policy", torch.bfloat16, torch.float32), ("none", None, None),
                                ("bf16 reduce", torch.bfloat16, torch.bfloat16)):
        r = train.train_fsdp(copy.deepcopy(model), X, Y, cfg, info, param, reduce)
        fsdp[name] = (checks.policy_text(r["dtypes"]), checks.policy_mismatches(r["dtypes"], info.world_size),
                      sum(r["reduced"]))
    out["fsdp"] = fsdp
    return out


@pytest.mark.timeout(90)
def test_negative_controls_on_two_ranks():
    u = torch.finfo(torch.bfloat16).eps / 2
    cfg = train.Config(steps=6)
    padded = checks.padded_numel([(64, 16), (64,), (64, 64), (64,), (1, 64), (1,)], 2)
    for r in run_on_ranks(_controls_on_ranks, 2, timeout=80):
        # autocast silently off: the forward is fp32, the step-0 outputs equal fp32's ...
        assert r["gap_on"] >= u / 10 and r["gap_off"] < u / 10
        assert r["gap_off"] == 0.0  # the same fp32 computation, same machine
        assert r["dtypes_off"] == ["torch.bfloat16"]  # ... though its gradients travel in bf16
        # FSDP2: the policy passes, no policy and a bf16 reduce are rejected, each where it is off
        assert r["fsdp"]["policy"][:2] == ("bf16 bf16 bf16 fp32 fp32", 0)
        assert r["fsdp"]["none"][:2] == ("fp32 fp32 fp32 fp32 fp32", 3)
        assert r["fsdp"]["bf16 reduce"][:2] == ("bf16 bf16 bf16 bf16 fp32", 1)
        # bytes reduce-scattered: 4 per padded element in fp32, 2 in bf16 (read off the tensors)
        assert r["fsdp"]["policy"][2] == cfg.steps * padded * 4
        assert r["fsdp"]["bf16 reduce"][2] == cfg.steps * padded * 2


def test_master_weights_keep_the_updates_bf16_weights_lose():
    """bf16 weights trained with plain SGD, counted by a loop written here: ~70 % of the
    non-zero updates leave the weight unchanged, each one the rounding rule predicts (element by
    element, outside the band where the kernel's rounding of lr decides); the same updates on
    fp32 weights are (almost) all kept."""
    cfg = train.Config(steps=20)
    X, Y = batches(cfg)
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        model = MLP(cfg.d_in, cfg.d_hidden, 1).to(dtype)
        moved = lost = wrong = wrong_naive = undecided = 0
        for step in range(cfg.steps):
            model.zero_grad()
            F.mse_loss(model(X[step].to(dtype)).float(), Y[step]).backward()
            with torch.no_grad():
                for p in model.parameters():
                    before = p.clone()
                    update = torch.tensor(-cfg.lr, dtype=torch.float32).double() * p.grad.double()
                    p.add_(p.grad, alpha=-cfg.lr)
                    gone = (p == before) & (update != 0)
                    near = formats.near_threshold(before, update)
                    moved += int((update != 0).sum())
                    lost += int(gone.sum())
                    undecided += int((near & (update != 0)).sum())
                    wrong += int(((gone != formats.rounds_back(before, update)) & ~near).sum())
                    # broken rule: the whole spacing instead of half of it
                    naive = (update.abs() < 2 * formats.half_spacing(before, update)) & (update != 0)
                    wrong_naive += int(((gone != naive) & ~near).sum())
        assert wrong == 0, (dtype, wrong)
        assert undecided < 0.01 * moved
        if dtype == torch.bfloat16:
            assert wrong_naive > 0.01 * moved  # the same comparison rejects a wrong rule
            assert 0.5 < lost / moved < 0.95, lost / moved
        else:
            assert lost / moved < 1e-3


def test_rounding_rule_at_a_power_of_two():
    """Below 1.0 bf16's spacing halves: an update of 0.003 toward zero moves 1.0 to 1 - 2^-8,
    the same update away from zero is lost (1.003 rounds back to 1.0)."""
    w = torch.tensor([1.0, 1.0], dtype=torch.bfloat16)
    update = torch.tensor([-0.003, 0.003])
    after = (w.float() + update).to(torch.bfloat16)
    assert after.tolist() == [1 - 2**-8, 1.0]
    assert formats.rounds_back(w, update).tolist() == [False, True]


def test_rounding_rule_at_a_tie_and_the_undecided_band():
    """An update of exactly half the spacing rounds to the even neighbour: lost from 1.0 (last
    significand bit 0), kept from 1 + 2^-7 (bit 1); below a power of two the tie is at a quarter.
    A rule without ties (`<` only) calls the first kept; one with `<=` calls the second lost."""
    w = torch.tensor([1.0, 1.0 + 2**-7, 1.0], dtype=torch.bfloat16)
    update = torch.tensor([2**-8, 2**-8, -(2**-9)], dtype=torch.float64)
    after = (w.double() + update).to(torch.bfloat16)
    lost = (after == w).tolist()
    assert lost == [True, False, True]
    assert formats.rounds_back(w, update).tolist() == lost
    assert formats.near_threshold(w, update).all()
    # Why the band: 0.02 * 0.09765625 is just below 2^-9 with lr in fp32 (lost from a bf16
    # 1.0) and just above it with lr rounded to bf16 (0.0200195: moved). torch's vectorised CPU
    # kernel rounds lr to bf16, its scalar tail does not: of 33 equal weights, the same update
    # moves those in full vector lanes and not the last one (any vectorised CPU).
    one, g = torch.ones(33, dtype=torch.bfloat16), torch.full((33,), 0.09765625, dtype=torch.bfloat16)
    update = formats.exact_update(0.02, g)
    assert formats.rounds_back(one, update).all() and formats.near_threshold(one, update).all()
    after = one.clone().add_(g, alpha=-0.02)
    assert set(after.tolist()) == {1.0, 1 - 2**-8} and after[-1].item() == 1.0


def test_fp16_gradients_underflow_without_scaling_and_survive_with_it():
    cpu = torch.device("cpu")
    ref = formats.underflow_grads(1.0, cpu, half=False)
    assert ref.abs().min() > 0 and ref.abs().max() < torch.finfo(torch.float16).tiny  # below fp16's normals
    assert torch.count_nonzero(formats.underflow_grads(1.0, cpu)) == 0        # all lost
    scaled = formats.underflow_grads(2.0**16, cpu)
    assert torch.count_nonzero(scaled) == ref.numel()                         # all kept
    assert ((scaled - ref).norm() / ref.norm()) < 5e-3                        # ≈ fp16 rounding
    assert torch.count_nonzero(formats.underflow_grads(2.0**4, cpu)) < ref.numel()  # too small a scale


def test_exercise_answers():
    """The numbers the lesson's exercises 2 to 4 quote."""
    cpu = torch.device("cpu")
    ref = formats.underflow_grads(1.0, cpu, half=False)
    zeros = {k: int((formats.underflow_grads(2.0**k, cpu) == 0).sum()) for k in range(17)}
    err = {k: ((formats.underflow_grads(2.0**k, cpu) - ref).norm() / ref.norm()).item() for k in range(17)}
    assert min(k for k in range(17) if zeros[k] == 0) == 5       # exercise 2: subnormals reached
    assert zeros[4] == 3 and zeros[7] == 1                        # one sum cancels to zero again
    assert round(err[5], 3) == 0.054 and round(err[8], 4) == 0.0079  # the error halves per doubling
    floor = err[16]
    assert 3e-4 < floor < 4e-4                                    # fp16 rounding, u = 4.9e-4
    assert min(k for k in range(17) if err[k] < 1.2 * floor) == 13  # normal range reached
    # exercise 3: a sequential bf16 sum over W ranks loses accuracy as W grows; fp32 does not
    bf16 = [formats.low_precision_sum_error(w) for w in (2, 8, 64, 256)]
    assert bf16 == sorted(bf16) and 1e-3 < bf16[0] < 4e-3 and 1e-2 < bf16[-1] < 3e-2
    assert [float(f"{e:.2g}") for e in bf16] == [2.5e-3, 4.1e-3, 9.8e-3, 1.9e-2]  # quoted values
    assert formats.low_precision_sum_error(256, torch.float32) < 1e-6
    # exercise 4: one outlier 1e5x the rest: e4m3 flushes most of the others, e5m2 keeps them
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-4
    x[0] = 1e5 * x.abs().max()
    e4m3 = formats.fp8_roundtrip_error(x, torch.float8_e4m3fn, per_tensor_scale=True)
    e5m2 = formats.fp8_roundtrip_error(x, torch.float8_e5m2, per_tensor_scale=True)
    assert e4m3["in_range"] == 1 / 4096 and round(e4m3["zeros"], 2) == 0.64  # only the outlier
    assert e5m2["in_range"] == 1.0 and e5m2["zeros"] == 0.0
    assert round(e5m2["max_rel_in_range"], 3) == 0.111 <= torch.finfo(torch.float8_e5m2).eps / 2


def _trace(scaler, steps: int = 20):
    cfg = train.Config(steps=steps)
    X, Y = batches(cfg)
    torch.manual_seed(0)
    return loss_scaler.scaler_trace(MLP(cfg.d_in, cfg.d_hidden, 1), X, Y, scaler, INF_STEPS)


def test_hand_scaler_makes_gradscalers_decisions_and_broken_ones_do_not():
    def torch_scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)

    ref = _trace(torch_scaler())
    hand = _trace(loss_scaler.DynamicLossScaler(2.0**16, growth_interval=3))
    assert set(INF_STEPS) <= set(ref["skipped"])
    assert max(ref["scales"]) > 2.0**16 or len(set(ref["scales"])) > 3  # it grew and backed off
    assert hand["scales"] == ref["scales"] and hand["skipped"] == ref["skipped"]
    assert hand["finite"] and ref["finite"]
    never_back_off = _trace(loss_scaler.DynamicLossScaler(2.0**16, backoff_factor=1.0, growth_interval=3))
    assert never_back_off["scales"] != ref["scales"]
    never_skip = _trace(loss_scaler.DynamicLossScaler(2.0**16, growth_interval=3, skip_on_inf=False))
    assert never_skip["skipped"] != ref["skipped"]
    assert not never_skip["finite"], "an inf applied to the weights must poison them"


def test_hand_scaler_update_rule():
    s = loss_scaler.DynamicLossScaler(8.0, growth_interval=2)
    seen = []
    for found_inf in (False, False, False, True, False, False):
        s.update(found_inf)
        seen.append(s.scale)
    assert seen == [8.0, 16.0, 16.0, 8.0, 8.0, 16.0]


def test_format_table_matches_bit_layout_formulas():
    rows = {r["name"]: r for r in formats.format_table()}
    for row in rows.values():
        assert (row["max"], row["eps"], row["tiny"]) == tuple(row["formula"][k] for k in ("max", "eps", "tiny"))
    assert rows["fp16"]["max"] == 65504 and rows["fp8 e4m3"]["max"] == 448
    assert rows["bf16"]["tiny"] == rows["fp32"]["tiny"]      # bf16: fp32's range ...
    assert rows["bf16"]["eps"] > rows["fp16"]["eps"]        # ... with less precision than fp16
    # significant decimal digits: (mantissa bits + 1) x log10(2)
    digits = {n: (r["man_bits"] + 1) * math.log10(2) for n, r in rows.items()}
    assert round(digits["bf16"], 1) == 2.4 and round(digits["fp16"], 1) == 3.3


def test_fp8_per_tensor_scaling():
    """Every element in the format's normal range keeps relative error <= u = eps/2 (the
    per-element maximum, not the mean); the mean follows eps/(8 ln 2)."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 1e-4
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        u = torch.finfo(dtype).eps / 2
        raw = formats.fp8_roundtrip_error(x, dtype, per_tensor_scale=False)
        scaled = formats.fp8_roundtrip_error(x, dtype, per_tensor_scale=True)
        # a Gaussian's smallest elements can fall below the range (e4m3: 2 of these 4096)
        assert scaled["in_range"] > 0.999 and scaled["max_rel_in_range"] <= u < raw["rel_error"]
        assert scaled["rel_error"] == pytest.approx(formats.mean_rounding_error(dtype), rel=0.05)
        assert scaled["zeros"] == 0
        assert (x.abs().max() * scaled["scale"]).item() == pytest.approx(torch.finfo(dtype).max, rel=1e-6)
    # Outside the range (an outlier makes amax/|x| > 448/2^-6 for the others) the bound fails.
    x[0] = 1e5 * x.abs().max()
    spoiled = formats.fp8_roundtrip_error(x, torch.float8_e4m3fn, per_tensor_scale=True)
    assert spoiled["max_rel_out_of_range"] > torch.finfo(torch.float8_e4m3fn).eps / 2


def test_autocast_runs_matmuls_low_and_keeps_fp32_weights():
    layer = torch.nn.Linear(4, 4)
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        with train.autocast(precision, torch.device("cpu")):
            out = layer(torch.randn(2, 4))
        assert out.dtype == dtype and layer.weight.dtype == torch.float32
        F.mse_loss(out.float(), torch.zeros(2, 4)).backward()
        assert layer.weight.grad.dtype == torch.float32
    with train.autocast("bf16", torch.device("cpu"), enabled=False):  # the broken variant
        assert layer(torch.randn(2, 4)).dtype == torch.float32


def _autocast_lists(cls: str) -> dict[str, set[str]]:
    """The op lists of torch's own autocast tests (torch/testing/_internal/autocast_test_lists.py,
    which mirror aten/src/ATen/autocast_mode.cpp), read with `ast` (importing it needs expecttest)."""
    path = Path(torch.__file__).parent / "testing" / "_internal" / "autocast_test_lists.py"
    if not path.is_file():
        pytest.skip(f"{path} is not in this torch build")
    lists: dict[str, set[str]] = {}
    for node in ast.walk(next(n for n in ast.parse(path.read_text()).body
                              if isinstance(n, ast.ClassDef) and n.name == cls)):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute) \
                and isinstance(node.value, ast.List):
            lists[node.targets[0].attr] = {e.elts[0].value for e in node.value.elts
                                           if isinstance(e, ast.Tuple) and isinstance(e.elts[0], ast.Constant)}
    return lists


def test_cpu_autocast_fp32_list_is_shorter_than_cudas():
    """What the lesson's pitfall says, on this torch: CPU autocast runs mse_loss and
    cross_entropy in fp32 but sum, exp, softmax, log_softmax and layer_norm in bf16; CUDA
    autocast's fp32 list holds all of them (torch's own lists) and not mm."""
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = torch.nn.Linear(4, 4)(x)
        assert F.mse_loss(o, torch.zeros_like(o)).dtype == torch.float32
        assert F.cross_entropy(o, torch.arange(4)).dtype == torch.float32
        assert {t.dtype for t in (o.sum(), o.exp(), o.softmax(-1), o.log_softmax(-1),
                                  F.layer_norm(o, (4,)))} == {torch.bfloat16}
    cuda, cpu = _autocast_lists("AutocastTestLists"), _autocast_lists("AutocastCPUTestLists")
    cuda_fp32, cpu_fp32 = cuda["torch_fp32"] | cuda["nn_fp32"], cpu["torch_fp32"] | cpu["nn_fp32"]
    lesson = {"softmax", "log_softmax", "exp", "log", "pow", "sum", "norm", "layer_norm",
              "mse_loss", "nll_loss", "l1_loss"}
    assert lesson <= cuda_fp32 and "mm" not in cuda_fp32 and "mm" in cuda["torch_fp16"]
    assert "mse_loss" in cpu_fp32 and not {"sum", "exp", "softmax", "layer_norm"} & cpu_fp32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_autocast_runs_the_fp32_list_in_fp32():
    """The CUDA side of the pitfall, run where a GPU exists: matmuls in bf16, these ops in fp32."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        o = torch.nn.Linear(8, 8).cuda()(torch.randn(8, 8, device="cuda"))
        assert o.dtype == torch.bfloat16
        for t in (o.sum(), o.exp(), o.softmax(-1), F.layer_norm(o, (8,)), F.mse_loss(o, o.detach())):
            assert t.dtype == torch.float32


def test_bad_input_is_refused_in_one_sentence():
    for argv in (["--precision", "fp8"], ["--precision", "fp32"], ["--init-scale", "0"],
                 ["--lr", "-1"], ["--steps", "3"]):
        with pytest.raises(SystemExit) as e:
            train.parse_config(train.Config, argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:  # refused before any rank starts
        train.parse_config(train.Config, ["--global-batch-size", "64"], validate=train.validate,
                           world_size=3)
    assert e.value.code == 2
