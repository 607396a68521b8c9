"""A learning-rate search with Ray Tune and ASHA, on a problem whose best region is known.

Gradient descent on the quadratic f(w) = 1/2 sum_i h_i (w_i - w*_i)^2, curvatures h_i from
h_min to h_max, contracts the slowest direction by rho(lr) = max(|1 - lr h_min|, |1 - lr h_max|)
per step: rho is smallest, (h_max - h_min)/(h_max + h_min), at lr* = 2/(h_min + h_max), and above
2/h_max the run diverges. A grid search over the learning rate must therefore find lr* (the
region where rho(lr) <= rho* + slack is an interval computed from the formula). ASHA
(asynchronous successive halving, Li et al., 2020) stops a trial at a rung (after 1, 3, 9 ...
reports) when it is not in the best 1/reduction of the trials seen at that rung: most trials stop
early. The same rule written out by hand predicts Ray's decisions trial for trial; with
stopping switched off (FIFO) it stops none, the control of that count.
One more trial is itself a multi-process run: Ray Train's TorchTrainer starts 2 gloo workers
that train the same problem with DDP at lr*, each on a different half of the rows, and must end
where one process ends; the same steps on one half alone, or with the gradients summed instead
of averaged, end elsewhere (the controls, computed in the same workers).

Ray stays on this machine: no dashboard, no usage statistics, node IP 127.0.0.1. The script is
one process by design: Ray starts its own workers.

Run:
    python chapters/ch21_hyperparameters/tune.py
    python chapters/ch21_hyperparameters/tune.py --grace-period 3 --reduction-factor 2
Needs `ray[tune]` (requirements.txt pins 2.60.0).
"""

# launch: python   (./course run 21 tune starts this script with python, not torchrun)

import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from common.config import RunConfig, parse_config, require_at_least_one
from common.log import library_output, log, setup_logging
from common.results import RunRecorder


@dataclass
class Config(RunConfig):
    d: int = 8
    """Dimensions of the quadratic; curvatures spaced geometrically from h_min to h_max."""
    h_min: float = 1.0
    """Smallest curvature."""
    h_max: float = 4.0
    """Largest curvature: lr* = 2/(h_min + h_max), divergence above 2/h_max."""
    grid: int = 12
    """Learning rates tried: lr* x 2^(k/3) for k = -6 .. grid - 7 (12: 0.25 lr* to 3.2 lr*)."""
    max_t: int = 9
    """Reports (training iterations) of a trial that is never stopped."""
    steps_per_report: int = 3
    """Gradient-descent steps between two reports."""
    grace_period: int = 1
    """ASHA: reports before a trial can first be stopped."""
    reduction_factor: int = 3
    """ASHA: a trial continues past a rung only if in the best 1/reduction_factor there."""
    slack: float = 0.1
    """Known region: learning rates with rho(lr) <= rho* + slack."""
    order_seed: int = 1
    """Seed of the order in which the grid's trials start (ASHA's early stops depend on it)."""
    cpus: int = 2
    """CPUs Ray may use (also the TorchTrainer's workers)."""
    steps: int = 20
    """Steps of the TorchTrainer run (2 DDP workers at lr*)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "d", "grid", "max_t", "steps_per_report", "grace_period")
        if not 0 < self.h_min < self.h_max:
            raise ValueError(f"--h-min and --h-max must satisfy 0 < h_min < h_max, not {self.h_min}, {self.h_max}")
        if self.reduction_factor < 2:
            raise ValueError(f"--reduction-factor must be at least 2, not {self.reduction_factor}")
        if self.grid < 7:
            raise ValueError(f"--grid must be at least 7 so that it reaches lr*, not {self.grid}")
        if self.cpus < 2:
            raise ValueError(f"--cpus must be at least 2 (the TorchTrainer runs 2 workers), not {self.cpus}")


def validate(cfg: Config, world_size: int) -> None:
    """Ray starts its own processes: under torchrun every rank would start its own Ray."""
    if world_size != 1:
        raise ValueError("tune.py is one process by design (Ray starts its own workers); "
                         "run it with python, not torchrun")


# --- the problem: the best region follows from a formula -------------------------------------------

def curvatures(cfg: Config) -> list[float]:
    return [cfg.h_min * (cfg.h_max / cfg.h_min) ** (i / (cfg.d - 1)) for i in range(cfg.d)]


def best_lr(cfg: Config) -> float:
    return 2 / (cfg.h_min + cfg.h_max)


def rho(lr: float, cfg: Config) -> float:
    """Per-step contraction of the slowest direction."""
    return max(abs(1 - lr * cfg.h_min), abs(1 - lr * cfg.h_max))


def known_region(cfg: Config) -> tuple[float, float]:
    """{lr : rho(lr) <= rho* + slack} = [(1 - r)/h_min, (1 + r)/h_max], r = rho* + slack."""
    r = rho(best_lr(cfg), cfg) + cfg.slack
    return (1 - r) / cfg.h_min, (1 + r) / cfg.h_max


def lr_grid(cfg: Config) -> list[float]:
    return [best_lr(cfg) * 2 ** (k / 3) for k in range(-6, cfg.grid - 6)]


def grid_order(cfg: Config) -> list[float]:
    """The grid in a fixed shuffled order (ascending order would let every improving trial pass
    its rungs: ASHA compares a trial only with those that reached the rung before it)."""
    g = torch.Generator().manual_seed(cfg.order_seed)
    grid = lr_grid(cfg)
    return [grid[i] for i in torch.randperm(len(grid), generator=g).tolist()]


def problem_data(cfg: Config, copies: int = 2):
    """Rows X with X^T X / n = diag(h) (copies of diag(sqrt(h d))), targets y = X w*, float64."""
    h = torch.tensor(curvatures(cfg), dtype=torch.float64)
    block = torch.diag((h * cfg.d).sqrt())
    x = block.repeat(copies, 1)
    wstar = torch.ones(cfg.d, dtype=torch.float64)
    return x, x @ wstar


def loss_after(lr: float, t: int, cfg: Config) -> float:
    """f after t steps from w = 0 (error 1 in every direction): 1/2 sum h_i (1 - lr h_i)^(2t)."""
    return 0.5 * sum(h * (1 - lr * h) ** (2 * t) for h in curvatures(cfg))


# --- the trials -----------------------------------------------------------------------------------

def asha_by_hand(cfg: Config, order: list[float], early_stopping: bool = True) -> dict[float, int]:
    """Ray's asynchronous successive halving written out, trials one after another in `order`:
    at each rung (grace, grace*rf, ...) a trial stops when its reward (-loss) is below the
    (1 - 1/rf) quantile of the rewards recorded there before it. Returns lr -> reports made."""
    import numpy as np

    rungs = []
    m = cfg.grace_period
    while m <= cfg.max_t:
        rungs.append((m, {}))
        m *= cfg.reduction_factor
    made = {}
    for lr in order:
        for it in range(1, cfg.max_t + 1):
            loss = loss_after(lr, it * cfg.steps_per_report, cfg)
            reward = -(loss if math.isfinite(loss) else 1e300)
            rung = next((r for m, r in rungs if m == it), None)
            stop = False
            if early_stopping and rung is not None:
                if rung and reward < np.nanpercentile(list(rung.values()), (1 - 1 / cfg.reduction_factor) * 100):
                    stop = True
                rung[lr] = reward
            if stop or it == cfg.max_t:
                made[lr] = it
                break
    return made


def trial(config: dict) -> None:
    """One Tune trial: gradient descent on the quadratic, one report per steps_per_report steps."""
    from ray import tune

    cfg = Config(**config["cfg"])
    x, y = problem_data(cfg)
    w = torch.zeros(cfg.d, dtype=torch.float64)
    for it in range(1, cfg.max_t + 1):
        for _ in range(cfg.steps_per_report):
            w = w - config["lr"] * x.T @ (x @ w - y) / len(y)
        loss = 0.5 * ((x @ w - y) ** 2).mean().item()
        tune.report({"loss": loss if math.isfinite(loss) else 1e300, "iteration": it})


def run_search(cfg: Config, storage: str) -> list[dict]:
    """Every learning rate of the grid as a trial, one at a time, ASHA deciding who continues."""
    from dataclasses import asdict

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    scheduler = ASHAScheduler(time_attr="iteration", max_t=cfg.max_t, grace_period=cfg.grace_period,
                              reduction_factor=cfg.reduction_factor)
    tuner = tune.Tuner(
        trial,
        param_space={"lr": tune.grid_search(grid_order(cfg)), "cfg": asdict(cfg)},
        tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=scheduler,
                                    max_concurrent_trials=1, reuse_actors=True),
        run_config=tune.RunConfig(name="asha", storage_path=storage,
                                  verbose=0),
    )
    results = tuner.fit()
    return [{"lr": r.config["lr"], "loss": r.metrics["loss"], "iterations": r.metrics["iteration"]}
            for r in results]


def ddp_halves(cfg: Config, world: int = 2):
    """Rank r's rows: diag(sqrt(h d a_r)), a_r = 1 + s_r (-1)^i, s_r = +1/2, -1/2 in turn, targets
    X_r w*. The halves differ (so training on one half alone, without the all-reduce, ends
    elsewhere), and their mean X^T X / n is still diag(h): the averaged gradient is the full one."""
    h = torch.tensor(curvatures(cfg), dtype=torch.float64)
    alt = torch.tensor([(-1.0) ** i for i in range(cfg.d)], dtype=torch.float64)
    wstar = torch.ones(cfg.d, dtype=torch.float64)
    halves = []
    for r in range(world):
        s = 0.5 if r % 2 == 0 else -0.5
        if world % 2 and r == world - 1:
            s = 0.0
        x = torch.diag((h * cfg.d * (1 + s * alt)).sqrt())
        halves.append((x, x @ wstar))
    return halves


def ddp_loop(config: dict) -> None:
    """Each TorchTrainer worker: DDP over its half of the rows, a checkpoint with the report.
    Beside it, plain tensors: the same steps on its half alone (what DDP without its all-reduce
    would reach) and with the halves' gradients summed instead of averaged (the two controls)."""
    import ray.train
    import torch.distributed as dist
    from ray.train import Checkpoint
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = Config(**config["cfg"])
    rank, world = dist.get_rank(), dist.get_world_size()
    xr, yr = ddp_halves(cfg, world)[rank]
    model = torch.nn.Linear(cfg.d, 1, bias=False, dtype=torch.float64)
    torch.nn.init.zeros_(model.weight)
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    lr = config["lr"]
    alone = torch.zeros(cfg.d, dtype=torch.float64)
    summed = torch.zeros(cfg.d, dtype=torch.float64)
    for _ in range(cfg.steps):
        opt.zero_grad()
        # 1/2 mean of squares on this half; DDP averages the halves' gradients: the full gradient
        loss = 0.5 * ((model(xr).squeeze(1) - yr) ** 2).mean()
        loss.backward()
        opt.step()
        alone = alone - lr * xr.T @ (xr @ alone - yr) / len(yr)
        g = xr.T @ (xr @ summed - yr) / len(yr)
        dist.all_reduce(g)  # SUM: a DDP that forgot to divide by the world size
        summed = summed - lr * g
    w = model.module.weight.detach().squeeze(0)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(w, os.path.join(tmp, "w.pt"))
        # Ray Train V2 keeps metrics only with a checkpoint (metrics=None otherwise)
        ray.train.report({"w": w.tolist(), "alone": alone.tolist(), "summed": summed.tolist(),
                          "world_size": world},
                         checkpoint=Checkpoint.from_directory(tmp) if rank == 0 else None)


def run_torch_trainer(cfg: Config, storage: str) -> dict:
    from dataclasses import asdict

    from ray.train import RunConfig as TrainRunConfig
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(ddp_loop, train_loop_config={"lr": best_lr(cfg), "cfg": asdict(cfg)},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           torch_config=TorchConfig(backend="gloo"),
                           run_config=TrainRunConfig(name="ddp", storage_path=storage))
    result = trainer.fit()
    return dict(result.metrics or {})


def reference_weights(cfg: Config, lr: float, steps: int) -> torch.Tensor:
    """The same gradient descent in this process, on all rows at once."""
    x, y = problem_data(cfg)
    w = torch.zeros(cfg.d, dtype=torch.float64)
    for _ in range(steps):
        w = w - lr * x.T @ (x @ w - y) / len(y)
    return w


def full_loss(w: torch.Tensor, cfg: Config) -> float:
    x, y = problem_data(cfg)
    return 0.5 * ((x @ w - y) ** 2).mean().item()


def reference_loss(cfg: Config, lr: float, steps: int) -> float:
    return full_loss(reference_weights(cfg, lr, steps), cfg)


def start_ray(cfg: Config) -> None:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    import ray

    ray.init(num_cpus=cfg.cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)


def main(cfg: Config) -> int:
    setup_logging(0, 1)
    rec = RunRecorder(cfg, __file__)
    lo, hi = known_region(cfg)
    log.info("lr* = %.4f, known region [%.4f, %.4f], %d trials", best_lr(cfg), lo, hi, cfg.grid)
    storage = str((rec.out / "ray").resolve())
    try:
        with library_output():
            t0 = time.perf_counter()
            start_ray(cfg)
            t1 = time.perf_counter()
            asha = run_search(cfg, storage)
            t2 = time.perf_counter()
            ddp = run_torch_trainer(cfg, storage)
            t3 = time.perf_counter()
        log.info("seconds: ray.init %.1f, ASHA search %.1f, TorchTrainer %.1f", t1 - t0, t2 - t1, t3 - t2)
        for r in sorted(asha, key=lambda r: r["lr"]):
            log.info("lr %.4f  iterations %d  loss %.3g", r["lr"], r["iterations"], r["loss"])
        best = min(asha, key=lambda r: r["loss"])
        worst = max(asha, key=lambda r: r["loss"])
        bound = rho(best_lr(cfg), cfg) + cfg.slack  # rho <= bound: lr in the known region
        rec.check("best trial: rho(lr) <= rho* + slack", "formula", rho(best["lr"], cfg), bound,
                  compare="<=")
        rec.check("worst trial: rho(lr) > rho* + slack (control)", "formula",
                  rho(worst["lr"], cfg), bound, compare=">")
        stopped = sum(r["iterations"] < cfg.max_t for r in asha)
        rec.check("ASHA: trials stopped early (> half)", "count", stopped, cfg.grid / 2, compare=">")
        fifo = asha_by_hand(cfg, grid_order(cfg), early_stopping=False)
        rec.check("FIFO (no early stopping): stopped early (control)", "count",
                  sum(t < cfg.max_t for t in fifo.values()), cfg.grid / 2, compare="<=")
        hand = asha_by_hand(cfg, grid_order(cfg))
        rec.check("Ray's ASHA == ASHA by hand (trials that differ)", "count",
                  sum(hand[r["lr"]] != r["iterations"] for r in asha), 0)
        ascending = asha_by_hand(cfg, sorted(grid_order(cfg)))
        rec.check("ASHA by hand, ascending order, differs (control)", "count",
                  sum(ascending[r["lr"]] != r["iterations"] for r in asha), 0, compare=">")
        iters = sum(r["iterations"] for r in asha)
        rec.figure("ASHA reports / reports without stopping", iters / (cfg.grid * cfg.max_t))
        rec.figure("best lr / lr*", best["lr"] / best_lr(cfg), expected=1.0)
        ref = reference_weights(cfg, best_lr(cfg), cfg.steps)
        nan = torch.full((cfg.d,), math.nan, dtype=torch.float64)

        def off(key: str) -> float:  # max |w - w_ref| over the coordinates (nan if not reported)
            w = torch.tensor(ddp[key], dtype=torch.float64) if key in ddp else nan
            return (w - ref).abs().max().item()

        rec.check("TorchTrainer workers reporting", "count", ddp.get("world_size", 0), 2)
        # 20 steps of sums of 8 products of order one, float64: ~1e-14 from different orders
        rec.check("TorchTrainer DDP weights == one process (max abs)", "parity", off("w"), 0.0, 1e-12)
        rec.check("one half without the all-reduce differs (control)", "parity", off("alone"),
                  1e-12, compare=">")
        rec.check("summed, not averaged, gradients differ (control)", "parity",
                  off("summed"), 1e-12, compare=">")
        loss = full_loss(torch.tensor(ddp["w"], dtype=torch.float64), cfg) if "w" in ddp else math.nan
        rec.figure("TorchTrainer loss after steps", loss,
                   expected=loss_after(best_lr(cfg), cfg.steps, cfg))
        return rec.finish()
    finally:
        if "ray" in sys.modules:
            sys.modules["ray"].shutdown()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
