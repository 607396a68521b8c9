"""Chapter 13: a killed rank, a torchrun restart, a bit-exact resume; a hung peer becomes an error.

The faulted torchrun run is compared with an undisturbed run this module computes itself (plain
loop, one process playing both ranks), so a bug shared by the script and its checks still fails.
The negative controls resume without the optimizer state, the RNG state or the data position and
must land elsewhere.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch13_fault_tolerance import hang, train
from common.checkpoint import load_checkpoint
from common.config import parse_config
from common.data import regression_data
from common.launch import run_on_ranks, run_torchrun
from common.models import MLP

SCRIPT, HANG = Path(train.__file__), Path(hang.__file__)


def undisturbed_reference(cfg: train.Config, world: int = 2) -> dict:
    """Data-parallel SGD with momentum, written out by hand: each 'rank' has its own noise stream
    and its contiguous slice of the reshuffled-every-epoch sample order."""
    X, Y = regression_data(cfg.n_samples, 8, 1, seed=cfg.seed, dtype=torch.float64)
    torch.manual_seed(cfg.seed)
    model = MLP(8, 32, 1).double()
    params = list(model.parameters())
    momentum = [torch.zeros_like(p) for p in params]
    rng = []
    for r in range(world):
        torch.manual_seed(cfg.seed + 1 + r)
        rng.append(torch.get_rng_state())
    per_step = world * cfg.batch_size
    epochs = cfg.steps * per_step // cfg.n_samples + 1
    order = torch.cat([torch.randperm(cfg.n_samples, generator=torch.Generator().manual_seed(
        cfg.seed * 1000 + e)) for e in range(epochs)])
    for step in range(cfg.steps):
        grad_sum = None
        for r in range(world):
            start = step * per_step + r * cfg.batch_size
            idx = order[start:start + cfg.batch_size]
            torch.set_rng_state(rng[r])
            x = X[idx] + cfg.noise * torch.randn(cfg.batch_size, 8, dtype=torch.float64)
            rng[r] = torch.get_rng_state()
            loss = ((model(x) - Y[idx]) ** 2).mean()
            g = torch.autograd.grad(loss, params)
            grad_sum = g if grad_sum is None else [a + b for a, b in zip(grad_sum, g)]
        with torch.no_grad():
            for p, g, m in zip(params, grad_sum, momentum):
                m.mul_(cfg.momentum).add_(g / world)
                p.sub_(cfg.lr * m)
    return model.state_dict()


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(150)
def test_killed_rank_restarts_and_resumes_to_the_same_parameters(tmp_path):
    # PET_MAX_RESTARTS is torchrun's --max-restarts; no TORCH_DISABLE_SHARE_RDZV_TCP_STORE here:
    # the restarted group forms thanks to common.distributed's PrefixStore alone.
    res = run_torchrun(SCRIPT, nproc=2, args=["--fail-rank", "1", "--fail-step", "7"], timeout=120,
                       out_dir=tmp_path, env={"PET_MAX_RESTARTS": "2"})
    assert "injected fault at step 7" in res.output
    assert res.summary["figures"]["restarts (TORCHELASTIC_RESTART_COUNT)"]["measured"] == 1
    assert res.check("resumed from the last committed checkpoint")["measured"] == 5
    assert res.check("replicas identical (max |dparam| across ranks)")["ok"]
    saved = load_checkpoint(tmp_path / "final_params.pt")
    assert saved["restarts"] == 1 and saved["start"] == 5
    expected = undisturbed_reference(train.Config())
    assert max_diff(saved["model"], expected) <= 1e-12  # bitwise in practice (0.0 measured)


class _Info:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")


def _resume_controls(folder: str) -> dict:
    """On 2 gloo ranks: undisturbed, then crash at step 7 and resume with each kind of restore."""
    info = _Info(dist.get_rank(), dist.get_world_size())
    cfg = train.Config(steps=12)
    clean = train.train(cfg, info, Path(folder, "clean"))["model"].state_dict()
    out = {}
    for name, restore in [("full", train.STATE_PARTS), ("no optimizer", ("model", "rng", "data")),
                          ("no rng", ("model", "optimizer", "data")),
                          ("no data position", ("model", "optimizer", "rng"))]:
        ckpt = Path(folder, name.replace(" ", "_"))
        train.train(cfg, info, ckpt, stop_at=7)  # the crash: steps 5 and 6 are lost
        resumed = train.train(dataclasses.replace(cfg, restore=restore), info, ckpt)
        out[name] = (resumed["start"], max_diff(resumed["model"].state_dict(), clean))
    out["reference"] = max_diff(clean, undisturbed_reference(cfg))
    return out


@pytest.mark.timeout(90)
def test_resume_needs_optimizer_rng_and_data_position():
    with tempfile.TemporaryDirectory() as folder:
        res = run_on_ranks(_resume_controls, 2, folder, timeout=60)[0]
    assert res["reference"] <= 1e-12
    assert res["full"] == (5, 0.0), res
    for broken in ("no optimizer", "no rng", "no data position"):
        start, diff = res[broken]
        assert start == 5 and diff > 1e-6, f"resuming with {broken} went unnoticed: {res}"


@pytest.mark.timeout(90)
def test_hung_peer_becomes_a_timeout_error_naming_it(tmp_path):
    # The launch's own timeout (60 s) fails this test if the run hangs instead of failing.
    res = run_torchrun(HANG, nproc=2, args=["--timeout", "3"], timeout=60, out_dir=tmp_path,
                       expect_ok=False)
    assert res.returncode != 0
    assert "error: rank 1 stopped responding: all_reduce timed out" in res.output
    assert res.check("all_reduce raised a timeout error")["ok"]
    assert res.check("monitored_barrier names the hung rank")["measured"] == [1]
    assert "failed to pass monitoredBarrier" in res.summary["figures"]["monitored_barrier error"]["measured"]


def test_impossible_settings_are_refused(capsys):
    for argv in (["--fail-rank", "1"], ["--fail-rank", "1", "--fail-step", "50"],
                 ["--restore", "optimizer"], ["--ckpt-every", "0"]):
        with pytest.raises(SystemExit) as e:
            parse_config(train.Config, argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        parse_config(hang.Config, ["--hang-rank", "0"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 5 and all("error:" in line for line in lines)
