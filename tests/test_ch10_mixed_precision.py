"""Chapter 10: mixed precision. Loss scaling saves fp16 gradients from underflow, the hand
scaler makes GradScaler's decisions exactly, bf16 tracks fp32, FSDP2's MixedPrecisionPolicy
computes in bf16 on fp32 master weights.

One real torchrun launch checks itself (summary.json); this module also computes the fp32
single-process reference with its own plain loop, and runs the negative controls: a scaler
that never backs off, one that never skips, and bf16 weights without a master copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chapters.ch10_mixed_precision import formats, loss_scaler, train
from common.checkpoint import load_checkpoint
from common.data import regression_data
from common.launch import run_torchrun
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


@pytest.mark.timeout(120)
def test_two_rank_run_checks_and_matches_an_independent_reference(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=100)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    cfg = train.Config()
    expected, losses = reference_fp32(cfg)
    saved = load_checkpoint(tmp_path / "final_params.pt")
    # FSDP2 in fp32 on 2 ranks == one process (float32 summation order only).
    for name, value in expected.items():
        assert torch.allclose(saved["fsdp_fp32"][name], value, atol=1e-5), name
    assert torch.allclose(saved["losses"]["fp32"], torch.tensor(losses), rtol=1e-5)
    # FSDP2 with the bf16 policy ends within the lesson's bf16 tolerance of the fp32 run ...
    gap = max(((saved["fsdp_bf16"][n] - v).norm() / v.norm()).item() for n, v in expected.items())
    assert 0 < gap < train.LOSS_TOL["bf16"], gap
    final = saved["fsdp_losses"]["bf16"][-1].item()
    assert abs(final - losses[-1]) / losses[-1] < train.LOSS_TOL["bf16"]
    # ... storing fp32 parameters while its forward ran in bf16 (recorded on the tensors).
    assert res.check("FSDP2 bf16: stored parameter dtypes")["measured"] == ["torch.float32"]
    assert res.check("FSDP2 bf16: forward weight/output dtypes")["measured"] == ["torch.bfloat16"] * 2
    # bf16 tracks fp32; pure bf16 weights (no master copy) do not, under the same check.
    bf16 = res.check("DDP bf16 loss curve == fp32 (max rel. gap)")
    assert bf16["measured"] < bf16["tolerance"] == train.LOSS_TOL["bf16"]
    assert res.check("control: bf16 weights without fp32 master copy rejected")["measured"] > bf16["tolerance"]
    n_params = sum(v.numel() for v in expected.values())
    assert res.check("DDP bytes reduced in bf16 = steps x params x bytes")["measured"] == cfg.steps * n_params * 2


def test_fp16_gradients_underflow_without_scaling_and_survive_with_it():
    cpu = torch.device("cpu")
    ref = formats.underflow_grads(1.0, cpu, half=False)
    assert ref.abs().min() > 0 and ref.abs().max() < torch.finfo(torch.float16).tiny  # below fp16's normals
    assert torch.count_nonzero(formats.underflow_grads(1.0, cpu)) == 0        # all lost
    scaled = formats.underflow_grads(2.0**16, cpu)
    assert torch.count_nonzero(scaled) == ref.numel()                         # all kept
    assert ((scaled - ref).norm() / ref.norm()) < 5e-3                        # ≈ fp16 rounding
    assert torch.count_nonzero(formats.underflow_grads(2.0**4, cpu)) < ref.numel()  # too small a scale


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


def test_fp8_per_tensor_scaling():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 1e-4
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raw = formats.fp8_roundtrip_error(x, dtype, per_tensor_scale=False)
        scaled = formats.fp8_roundtrip_error(x, dtype, per_tensor_scale=True)
        assert scaled["rel_error"] < torch.finfo(dtype).eps / 2 < raw["rel_error"]
        assert scaled["zeros"] == 0
        assert (x.abs().max() * scaled["scale"]).item() == pytest.approx(torch.finfo(dtype).max, rel=1e-6)


def test_autocast_runs_matmuls_low_and_keeps_fp32_weights():
    layer = torch.nn.Linear(4, 4)
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        with train.autocast(precision, torch.device("cpu")):
            out = layer(torch.randn(2, 4))
        assert out.dtype == dtype and layer.weight.dtype == torch.float32
        F.mse_loss(out.float(), torch.zeros(2, 4)).backward()
        assert layer.weight.grad.dtype == torch.float32


def test_bad_input_is_refused_in_one_sentence():
    for argv in (["--precision", "fp8"], ["--init-scale", "0"], ["--lr", "-1"]):
        with pytest.raises(SystemExit) as e:
            train.parse_config(train.Config, argv)
        assert e.value.code == 2
