"""Chapter 20: recomputation keeps fewer bytes for backward, as the formula predicts, with the
same gradients; offloaded training equals on-device training and its state sits on the host.

The torchrun runs check themselves (summary.json); this module recomputes the byte formula and
the saved-tensor count itself, and runs the negative controls: a "recompute" that detaches (the
byte count loves it, the gradient check rejects it) and an offload that never copies back.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from chapters.ch20_memory import offload, recompute, train
from common.distributed import setup_distributed, teardown_distributed
from common.launch import run_torchrun

SCRIPT, OFFLOAD = Path(train.__file__), Path(offload.__file__)


def hand_formula(strategy: str, T: int, d: int, f: int, L: int, b: int) -> int:
    """Written out again, independently of the chapter: per block the output (T·d) plus
    none: h and gelu(h) (2·T·f); selective: h; full: nothing; SAC: h and fc2's output."""
    inside = {"none": 2 * T * f, "selective": T * f, "full": 0, "torch_full": 0,
              "torch_selective": T * f + T * d}[strategy]
    return L * (T * d + inside) * b


def one_step(model, x, y, run_block) -> tuple[int, list[torch.Tensor]]:
    """Saved bytes (hooks, shared storage counted once) and gradients of one step."""
    model.zero_grad()
    with recompute.saved_tensor_bytes(exclude=[*model.parameters(), x, y]) as saved:
        h = x
        for block in model.blocks:
            h = run_block(block, h)
        loss = F.mse_loss(h, y)
    loss.backward()
    return sum(saved.values()), [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                                 for p in model.parameters()]


def detached_recompute(block, x):
    """Broken: 'saves memory' by running the block without a graph."""
    with torch.no_grad():
        return block(x)


def max_diff(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b))


@pytest.mark.parametrize("dtype, T, d, f, L", [(torch.float64, 16, 8, 32, 3),
                                              (torch.float32, 5, 6, 10, 2)])
def test_saved_bytes_follow_the_formula_and_gradients_are_exact(dtype, T, d, f, L):
    torch.manual_seed(0)
    model = recompute.ResidualMLP(d, f, L).to(dtype)
    x, y = torch.randn(T, d, dtype=dtype), torch.randn(T, d, dtype=dtype)
    b = torch.finfo(dtype).bits // 8
    saved, grads = {}, {}
    for s in recompute.STRATEGIES:
        saved[s], grads[s] = one_step(model, x, y, lambda blk, h, s=s: recompute.run_block(blk, h, s))
        assert saved[s] == hand_formula(s, T, d, f, L, b), s
        assert max_diff(grads[s], grads["none"]) == 0.0, f"{s} changed the gradients"
        census = recompute.StorageCensus()
        with census:
            loss = train.loss_fn(model, x, y, s)
        assert census.live_bytes([loss, *model.parameters()]) == saved[s], s
    assert saved["none"] > saved["torch_selective"] > saved["selective"] > saved["full"] > 0

    # Negative control: a "recompute" of the first block that detaches keeps less, and is wrong.
    broken_bytes, broken = one_step(
        model, x, y, lambda blk, h: detached_recompute(blk, h) if blk is model.blocks[0]
        else recompute.run_block(blk, h, "full"))
    assert broken_bytes <= saved["full"]  # the byte count alone cannot tell
    assert max_diff(broken, grads["none"]) > 1e-3, "the gradient check missed a detached graph"


def test_saved_tensor_count_dedupes_shared_storage():
    w = torch.randn(4, 4, requires_grad=True)
    with recompute.saved_tensor_bytes(exclude=[w]) as saved:
        y = w * 2
        (y * y[1:].sum()).sum()  # y saved whole and through a view: one storage
    assert sum(saved.values()) == 16 * 4 + 4  # y once, plus the scalar y[1:].sum()
    with pytest.raises(ValueError, match="unknown strategy"):
        recompute.run_block(recompute.FeedForward(4, 8), torch.randn(2, 4), "sometimes")


@pytest.mark.timeout(120)
def test_train_script_on_two_ranks(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=100)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    cfg = train.Config()
    for s in recompute.STRATEGIES:
        fig = res.summary["figures"][f"saved for backward, {s}"]
        assert fig["measured"] == hand_formula(s, cfg.tokens, cfg.d_model, cfg.d_ff, cfg.n_layers, 8)
        assert res.check(f"live bytes (census) = formula, {s}")["ok"]
    for s in recompute.STRATEGIES[1:]:
        assert res.check(f"DP training {s} == none (max |dparam|)")["measured"] == 0.0
    assert res.summary["world_size"] == 2 and res.summary["device"] == "cpu"


@pytest.mark.timeout(120)
def test_offload_script_on_two_ranks(tmp_path):
    res = run_torchrun(OFFLOAD, nproc=2, out_dir=tmp_path, timeout=100)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    cfg = offload.Config()
    psi = cfg.n_layers * (2 * cfg.d_model * cfg.d_ff + cfg.d_ff + cfg.d_model)
    check = res.check("FSDP2 + offload: host bytes summed over ranks = 4 x params x bytes")
    assert check["measured"] == 4 * psi * 8
    assert res.check("FSDP2 + offload: params, grads, Adam state not on host")["measured"] == 0
    assert res.check("FSDP2 + CPU offload == FSDP2 on device (max |dparam|)")["measured"] < 1e-12
    assert "offload moves nothing" in res.output


def test_offload_negative_control_and_placement(monkeypatch):
    """In-process, a world of one: the hand offload equals on-device Adam; forgetting the
    host→device copy-back leaves the device model untrained, and the same check rejects it."""
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    info = setup_distributed("cpu", "gloo", 30)
    try:
        cfg = offload.Config(steps=3)
        torch.manual_seed(0)
        base = recompute.ResidualMLP(8, 16, 2).double()
        X, Y = torch.randn(3, 8, 8, dtype=torch.float64), torch.randn(3, 8, 8, dtype=torch.float64)
        ref, _ = offload.train_on_device(copy.deepcopy(base), X, Y, cfg, info)
        hand, opt = offload.train_zero_offload(copy.deepcopy(base), X, Y, cfg, info)
        stale, _ = offload.train_zero_offload(copy.deepcopy(base), X, Y, cfg, info, copy_back=False)
        good = offload.max_diff(offload.full_params(hand), offload.full_params(ref))
        bad = offload.max_diff(offload.full_params(stale), offload.full_params(ref))
        state = offload.training_state(hand, opt)
        assert len(state) == 4 * len(list(base.parameters()))
        assert offload.misplaced(state, "cpu") == 0 and offload.misplaced(state, "cuda") == len(state)
        for m, p in zip(opt.param_groups[0]["params"], hand.parameters()):
            assert m.untyped_storage().data_ptr() != p.untyped_storage().data_ptr(), "a real copy"
    finally:
        teardown_distributed()
    assert good == 0.0
    assert bad > 1e-4, "an offload that never copies back went unnoticed"
    assert not dist.is_initialized()


def test_memory_formula_and_bad_input():
    table = offload.per_rank_bytes(psi=1000, elem=4, world=4)
    assert table["DDP on device"] == (16000, 0)
    assert table["ZeRO-Offload by hand"] == (8000, 16000)
    assert table["FSDP2 + CPUOffloadPolicy"] == (0, 4000)
    assert train.recompute_flop_ratio("full") == pytest.approx(4 / 3)
    for module, argv in ((train, ["--dtype", "float16"]), (train, ["--d-ff", "0"]),
                         (offload, ["--tokens", "0"])):
        with pytest.raises(SystemExit) as e:
            module.parse_config(module.Config, argv)
        assert e.value.code == 2
