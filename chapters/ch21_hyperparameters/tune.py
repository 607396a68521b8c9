"""A learning-rate search with Ray Tune and ASHA, on a problem whose best region is known, and
Tune trials that are themselves multi-process training runs.

Gradient descent on the quadratic f(w) = 1/2 sum_i h_i (w_i - w*_i)^2, curvatures h_i from
h_min to h_max, contracts the slowest direction by rho(lr) = max(|1 - lr h_min|, |1 - lr h_max|)
per step: rho is smallest, (h_max - h_min)/(h_max + h_min), at lr* = 2/(h_min + h_max), and above
2/h_max the run diverges. A grid search over the learning rate must therefore find lr* (the
region where rho(lr) <= rho* + slack is an interval computed from the formula). ASHA
(asynchronous successive halving, Li et al., 2020) stops a trial at a rung (after 1, 3, 9 ...
reports) when it is not in the best 1/reduction of the trials seen at that rung: most trials stop
early. The same rule written out by hand predicts Ray's decisions trial for trial; Tune's
FIFOScheduler on the same grid stops none, the control of that count.

Then a second search whose trials are training runs (Ray Train V2's pattern): each Tune trial is a
function that builds a TorchTrainer with 2 gloo workers, which train the problem with DDP, each
on a different half of the rows, and report through the trainer's TuneReportCallback. ASHA
(grace period 1, reduction factor 2, max_t 3) stops the trials that fall behind; Ray's own
records show which, when, and that the stopped trial's worker processes were ended (the GCS
actor table) while the search went on. Every report's weights must equal one process's
full-batch gradient descent; the same steps on one half alone, or with the gradients summed
instead of averaged, end elsewhere (the controls, computed in the same workers).

Ray stays on this machine: no dashboard, no usage statistics, node IP 127.0.0.1. The script is
one process by design: Ray starts its own workers.

Run:
    python chapters/ch21_hyperparameters/tune.py
    python chapters/ch21_hyperparameters/tune.py --grace-period 3 --reduction-factor 2
Needs `ray[tune]` (requirements.txt pins 2.60.0).
"""

# launch: python   (./course run 21 tune starts this script with python, not torchrun)

import math
import sys
import time
from dataclasses import dataclass

import torch

from chapters.ch21_hyperparameters import quadratic, tune_checks
from chapters.ch21_hyperparameters.ray_runtime import gcs_records, result_log, start_ray
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
    """CPUs Ray may use. Both searches run one trial at a time."""
    trials: str = "0,4,-3,-2"
    """Trials that are TorchTrainer runs: learning rates lr* x 2^(k/3) for these k, started in
    this order ("none": skip that search). The second, 2^(4/3) lr*, diverges."""
    trial_max_t: int = 3
    """ASHA over the training runs: reports of a trial that is never stopped."""
    trial_grace_period: int = 1
    """ASHA over the training runs: reports before a trial can first be stopped."""
    trial_reduction_factor: int = 2
    """ASHA over the training runs: keep the best 1/reduction_factor at each rung (rungs 1, 2)."""
    driver_cpus: float = 0.2
    """CPU reserved for each trial's driver, the Tune function that builds the TorchTrainer
    (Tune refuses a trial that asks for no resources at all)."""
    worker_cpus: float = 0.9
    """CPU of each of a trial's 2 TorchTrainer workers: 0.2 + 2 x 0.9 = 2, the whole machine, so
    a trial's workers can start only once the previous trial's are released."""
    report_seconds: float = 1.5
    """Seconds a TorchTrainer worker spends per report: the 3 steps take microseconds, the rest
    is a wait that stands for a longer epoch, so that ASHA's decision arrives before the next."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "d", "grid", "max_t", "steps_per_report", "grace_period",
                             "trial_max_t", "trial_grace_period")
        if not 0 < self.h_min < self.h_max:
            raise ValueError(f"--h-min and --h-max must satisfy 0 < h_min < h_max, not {self.h_min}, {self.h_max}")
        if min(self.reduction_factor, self.trial_reduction_factor) < 2:
            raise ValueError("--reduction-factor and --trial-reduction-factor must be at least 2, "
                             f"not {self.reduction_factor}, {self.trial_reduction_factor}")
        if self.grid < 7:
            raise ValueError(f"--grid must be at least 7 so that it reaches lr*, not {self.grid}")
        if self.cpus < 1:
            raise ValueError(f"--cpus must be at least 1, not {self.cpus}")
        if self.trials != "none":
            try:
                [int(k) for k in self.trials.split(",")]
            except ValueError:
                raise ValueError(f"--trials takes integers k separated by commas (lr* x 2^(k/3)) "
                                 f"or 'none', not {self.trials!r}") from None
        if self.driver_cpus <= 0 or self.worker_cpus <= 0:
            raise ValueError("--driver-cpus and --worker-cpus must be above 0 (Tune refuses a "
                             f"trial without resources), not {self.driver_cpus}, {self.worker_cpus}")
        if self.driver_cpus + 2 * self.worker_cpus > self.cpus:
            raise ValueError(f"a trial needs --driver-cpus + 2 x --worker-cpus = "
                             f"{self.driver_cpus + 2 * self.worker_cpus:g} CPUs, more than --cpus "
                             f"{self.cpus}: it would never start")


def validate(cfg: Config, world_size: int) -> None:
    """Ray starts its own processes: under torchrun every rank would start its own Ray."""
    if world_size != 1:
        raise ValueError("tune.py is one process by design (Ray starts its own workers); "
                         "run it with python, not torchrun")


def trial(config: dict) -> None:
    """One Tune trial: gradient descent on the quadratic, one report per steps_per_report steps."""
    from ray import tune

    cfg = Config(**config["cfg"])
    x, y = quadratic.problem_data(cfg)
    w = torch.zeros(cfg.d, dtype=torch.float64)
    for it in range(1, cfg.max_t + 1):
        for _ in range(cfg.steps_per_report):
            w = w - config["lr"] * x.T @ (x @ w - y) / len(y)
        loss = 0.5 * ((x @ w - y) ** 2).mean().item()
        tune.report({"loss": loss if math.isfinite(loss) else 1e300, "iteration": it})


def run_search(cfg: Config, storage: str, early_stopping: bool = True) -> list[dict]:
    """Every learning rate of the grid as a trial, one at a time, in the same order: under
    ASHAScheduler, or under FIFOScheduler (Tune's default: no trial is stopped early)."""
    from dataclasses import asdict

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if early_stopping:
        scheduler = ASHAScheduler(time_attr="iteration", max_t=cfg.max_t,
                                  grace_period=cfg.grace_period,
                                  reduction_factor=cfg.reduction_factor)
    else:
        scheduler = FIFOScheduler()
    tuner = tune.Tuner(
        trial,
        param_space={"lr": tune.grid_search(quadratic.grid_order(cfg)), "cfg": asdict(cfg)},
        tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=scheduler,
                                    max_concurrent_trials=1, reuse_actors=True),
        run_config=tune.RunConfig(name="asha" if early_stopping else "fifo",
                                  storage_path=storage, verbose=0),
    )
    results = tuner.fit()
    return [{"lr": r.config["lr"], "loss": r.metrics["loss"], "iterations": r.metrics["iteration"]}
            for r in results]


def trial_workers(config: dict) -> None:
    """Each TorchTrainer worker of a trial: DDP over its half of the rows, one report per
    steps_per_report steps. Beside it, plain tensors: the same steps on its half alone (what
    DDP without its all-reduce would reach) and with the halves' gradients summed instead of
    averaged (the two controls). Every report names both workers' Ray actors and their group."""
    import ray
    import ray.train
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg, lr = Config(**config["cfg"]), config["lr"]
    rank, world = dist.get_rank(), dist.get_world_size()
    actors: list = [None] * world
    dist.all_gather_object(actors, ray.get_runtime_context().get_actor_id())
    group = ray.util.get_current_placement_group()
    xr, yr = quadratic.ddp_halves(cfg, world)[rank]
    model = torch.nn.Linear(cfg.d, 1, bias=False, dtype=torch.float64)
    torch.nn.init.zeros_(model.weight)
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    alone = torch.zeros(cfg.d, dtype=torch.float64)
    summed = torch.zeros(cfg.d, dtype=torch.float64)
    for it in range(1, cfg.trial_max_t + 1):
        begun = time.monotonic()
        for _ in range(cfg.steps_per_report):
            opt.zero_grad()
            # 1/2 mean of squares on this half; DDP averages the halves' gradients: the full one
            loss = 0.5 * ((model(xr).squeeze(1) - yr) ** 2).mean()
            loss.backward()
            opt.step()
            alone = alone - lr * xr.T @ (xr @ alone - yr) / len(yr)
            g = xr.T @ (xr @ summed - yr) / len(yr)
            dist.all_reduce(g)  # SUM: a DDP that forgot to divide by the world size
            summed = summed - lr * g
        w = model.module.weight.detach().squeeze(0)
        full = quadratic.full_loss(w, cfg)
        time.sleep(max(0.0, cfg.report_seconds - (time.monotonic() - begun)))
        # rank 0's metrics reach Tune (TuneReportCallback passes the first worker's)
        ray.train.report({"loss": full if math.isfinite(full) else 1e300, "iteration": it,
                          "w": w.tolist(), "alone": alone.tolist(), "summed": summed.tolist(),
                          "world_size": world, "worker_actors": actors,
                          "placement_group": group.id.hex() if group else None})


def trial_driver(config: dict) -> None:
    """One Tune trial that is a training run (Ray Train V2): build a TorchTrainer with 2 CPU
    workers and run it; its TuneReportCallback passes each report on to Tune, whose scheduler
    may stop the trial (and with it the trainer and its workers)."""
    from ray import tune
    from ray.train import FailureConfig, ScalingConfig
    from ray.train import RunConfig as TrainRunConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    cfg = Config(**config["cfg"])
    trainer = TorchTrainer(
        trial_workers, train_loop_config={"lr": config["lr"], "cfg": config["cfg"]},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                     resources_per_worker={"CPU": cfg.worker_cpus}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=TrainRunConfig(name=f"train_{tune.get_context().get_trial_id()}",
                                  storage_path=config["storage"], callbacks=[TuneReportCallback()],
                                  # a trial that fails is over: no new worker group in its place
                                  failure_config=FailureConfig(max_failures=0)))
    trainer.fit()


def run_trial_search(cfg: Config, storage: str) -> dict:
    """The trials that are training runs, under ASHA, one at a time. Returns Tune's results in
    arrival order, each trial's end and its group's removal, and the GCS actor table's record of
    every worker (state, start, end, death cause)."""
    from dataclasses import asdict

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    scheduler = ASHAScheduler(time_attr="iteration", max_t=cfg.trial_max_t,
                              grace_period=cfg.trial_grace_period,
                              reduction_factor=cfg.trial_reduction_factor)
    callback = result_log()
    started = time.time()
    tuner = tune.Tuner(
        tune.with_resources(trial_driver, {"cpu": cfg.driver_cpus}),
        param_space={"lr": tune.grid_search(quadratic.trial_lrs(cfg)), "cfg": asdict(cfg),
                     "storage": storage},
        # one trial at a time: Tune reserves only the driver's share, the workers' placement
        # group is the trainer's, and each trial's workers need what the last one's held
        tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=scheduler,
                                    max_concurrent_trials=1),
        run_config=tune.RunConfig(name="trials", storage_path=storage, verbose=0,
                                  callbacks=[callback]),
    )
    grid = tuner.fit()
    # the last trial ended as the search did: its workers' release is waited for here
    while not callback.release():
        time.sleep(0.2)
    finished = time.time()
    return gcs_records(grid, callback, started, finished)


def main(cfg: Config) -> int:
    setup_logging(0, 1)
    rec = RunRecorder(cfg, __file__)
    lo, hi = quadratic.known_region(cfg)
    log.info("lr* = %.4f, known region [%.4f, %.4f], %d trials", quadratic.best_lr(cfg), lo, hi,
             cfg.grid)
    storage = str((rec.out / "ray").resolve())
    try:
        t = [time.perf_counter()]
        with library_output():
            start_ray(cfg)
            t.append(time.perf_counter())
            asha = run_search(cfg, storage)
            t.append(time.perf_counter())
            fifo = run_search(cfg, storage, early_stopping=False)
            t.append(time.perf_counter())
            trials = run_trial_search(cfg, storage) if quadratic.trial_lrs(cfg) else None
            t.append(time.perf_counter())
        log.info("seconds: ray.init %.1f, ASHA search %.1f, FIFO search %.1f, TorchTrainer trials %.1f",
                 *(b - a for a, b in zip(t, t[1:])))
        tune_checks.check_search(rec, cfg, asha, fifo)
        if trials is not None:
            tune_checks.check_trial_search(rec, cfg, trials)
        return rec.finish()
    finally:
        if "ray" in sys.modules:
            sys.modules["ray"].shutdown()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
