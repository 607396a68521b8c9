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
import os
import sys
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

def asha_replay(events, grace_period: int, reduction_factor: int, max_t: int,
                early_stopping: bool = True) -> dict:
    """Ray's asynchronous successive halving written out, on results in the order they arrive:
    `events` are (trial, iteration, loss). At each rung (grace, grace*rf, ... below max_t) a
    trial stops when its reward (-loss) is below the (1 - 1/rf) quantile of the rewards recorded
    there before it; at max_t it ends. Returns trial -> reports made (a stopped trial's later
    results, if any arrive, are ignored, as Tune ignores them)."""
    import numpy as np

    rungs = {}
    m = grace_period
    while m < max_t:
        rungs[m] = {}
        m *= reduction_factor
    made = {}
    for key, it, loss in events:
        if key in made:
            continue
        reward = -(loss if math.isfinite(loss) else 1e300)
        stop = it >= max_t
        rung = rungs.get(it)
        if not stop and rung is not None:
            if early_stopping and rung:
                stop = reward < np.nanpercentile(list(rung.values()), (1 - 1 / reduction_factor) * 100)
            rung[key] = reward
        if stop:
            made[key] = it
    return made


def asha_by_hand(cfg: Config, order: list[float], early_stopping: bool = True) -> dict[float, int]:
    """The in-process search's decisions: trials one after another in `order` (one at a time, so
    each trial's reports all arrive before the next trial's), losses from the formula.
    Returns lr -> reports made."""
    events = [(lr, it, loss_after(lr, it * cfg.steps_per_report, cfg))
              for lr in order for it in range(1, cfg.max_t + 1)]
    return asha_replay(events, cfg.grace_period, cfg.reduction_factor, cfg.max_t, early_stopping)


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
        param_space={"lr": tune.grid_search(grid_order(cfg)), "cfg": asdict(cfg)},
        tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=scheduler,
                                    max_concurrent_trials=1, reuse_actors=True),
        run_config=tune.RunConfig(name="asha" if early_stopping else "fifo",
                                  storage_path=storage, verbose=0),
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


def trial_lrs(cfg: Config) -> list[float]:
    if cfg.trials == "none":
        return []
    return [best_lr(cfg) * 2 ** (int(k) / 3) for k in cfg.trials.split(",")]


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
    xr, yr = ddp_halves(cfg, world)[rank]
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
        full = full_loss(w, cfg)
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


RELEASE_WAIT_S = 60.0


def result_log():
    """A Tune callback that records every result in the order Tune processes it (the order the
    scheduler sees), with the time and the state of every placement group in Ray's GCS at that
    moment; and the release of each ended trial's workers.

    Tune stops a trial by ending its function's actor; Ray then ends the actors that one owned
    (the trainer's controller) and theirs (the workers). The workers' placement group stays: Ray
    Train removes it through a PlacementGroupCleaner actor that asks Ray's State API whether the
    controller is alive, and that API is served by the dashboard's state module, which needs
    `ray[default]` and the dashboard on. This script runs `ray[tune]` with the dashboard off, so
    the cleaner never sees the controller die and the group would hold its CPUs for good
    (measured: the next trial's worker group timed out). This callback does the cleaner's job in
    the cleaner's order: at each step of Tune's loop after a trial has ended, it looks the
    trial's workers up in the GCS actor table, and removes their group only once both are DEAD.
    Workers still alive RELEASE_WAIT_S after their trial ended were not released by Ray: the
    group is removed then anyway (which kills them), and the run's checks fail on it."""
    import ray
    from ray import tune
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    class ResultLog(tune.Callback):
        def __init__(self):
            self.results, self.ended, self.groups, self.workers = [], {}, {}, {}
            self.released: dict[str, dict] = {}

        def on_trial_result(self, iteration, trials, trial, result, **info):
            groups = {k: v["state"] for k, v in ray.util.placement_group_table().items()}
            self.results.append({"trial": trial.trial_id, "time": time.time(),
                                 "placement_groups": groups, **result})
            if result.get("placement_group"):
                self.groups[trial.trial_id] = result["placement_group"]
                self.workers[trial.trial_id] = result["worker_actors"]

        def on_trial_complete(self, iteration, trials, trial, **info):
            # Tune calls this before it stops the trial's actor: record only
            self.ended[trial.trial_id] = time.time()

        def on_step_begin(self, iteration, trials, **info):
            self.release()

        def release(self) -> bool:
            """Remove the group of every ended trial whose workers are DEAD (or that waited
            RELEASE_WAIT_S); True when none is left to remove."""
            for tid, end in self.ended.items():
                if tid in self.released or tid not in self.groups:
                    continue
                alive = sum(ray._private.state.actors(actor_id=a).get("State") != "DEAD"
                            for a in self.workers[tid])
                if alive and time.time() - end < RELEASE_WAIT_S:
                    continue
                group = PlacementGroup(PlacementGroupID(bytes.fromhex(self.groups[tid])))
                state = ray.util.placement_group_table(group).get("state", "REMOVED")
                if state != "REMOVED":
                    remove_placement_group(group)
                self.released[tid] = {"time": time.time(), "workers_alive": alive,
                                      "group_before": state}
            return all(t in self.released for t in self.ended if t in self.groups)

    return ResultLog()


def run_trial_search(cfg: Config, storage: str) -> dict:
    """The trials that are training runs, under ASHA, one at a time. Returns Tune's results in
    arrival order, each trial's end and its group's removal, and the GCS actor table's record of
    every worker (state, start, end, death cause)."""
    from dataclasses import asdict

    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    scheduler = ASHAScheduler(time_attr="iteration", max_t=cfg.trial_max_t,
                              grace_period=cfg.trial_grace_period,
                              reduction_factor=cfg.trial_reduction_factor)
    callback = result_log()
    started = time.time()
    tuner = tune.Tuner(
        tune.with_resources(trial_driver, {"cpu": cfg.driver_cpus}),
        param_space={"lr": tune.grid_search(trial_lrs(cfg)), "cfg": asdict(cfg), "storage": storage},
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
    held = sum(v["state"] != "REMOVED" for v in ray.util.placement_group_table().values())
    trials = {}
    for r in grid:
        tid = r.metrics.get("trial_id") if r.metrics else None
        trials[tid] = {"lr": r.config["lr"], "error": None if r.error is None else repr(r.error)}
    workers = {}
    for res in callback.results:
        for aid in res.get("worker_actors", []):
            if aid not in workers:
                info = ray._private.state.actors(actor_id=aid)
                cause = info.get("DeathCause")
                died = cause.actor_died_error_context if cause is not None else None
                workers[aid] = {"trial": res["trial"], "state": info.get("State"),
                                "start": info.get("StartTime", 0) / 1e3,
                                "end": info.get("EndTime", 0) / 1e3,
                                "reason": None if died is None else died.Reason.Name(died.reason),
                                "cause": None if died is None else died.error_message}
    return {"started": started, "finished": finished, "trials": trials, "held_after": held,
            "released": callback.released,
            "results": callback.results, "ended": callback.ended, "workers": workers}


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


RAYLET_TIMEOUT = "The current node timed out during startup"


def start_ray(cfg: Config, attempts: int = 3) -> None:
    """ray.init on this machine. Under load Ray's raylet can exit at start when its dashboard
    agent takes more than a fixed 15 s to write its port file (ray-project/ray#65983); ray.init
    then raises after 30 s. That one error is retried (twice at most), and said."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    # Tune's default loggers (CSV, JSON, TensorBoard) are not read here
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    # a worker group that has not started in 60 s fails its trial (Ray Train's default); a
    # loaded 2-core machine starting two trials' processes at once can take longer
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "150")
    # one process less per trial: the watcher of spot-instance preemption notices
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(num_cpus=cfg.cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=False, configure_logging=False)
            return
        except Exception as e:
            if RAYLET_TIMEOUT not in str(e) or attempt == attempts:
                raise
            log.warning("ray.init: the raylet did not start (its dashboard agent was slower than "
                        "Ray's 15 s, ray#65983); starting Ray again")
            ray.shutdown()


def trial_table(cfg: Config, run: dict) -> list[dict]:
    """One row per trial that is a training run, from Ray's records: Tune's results (reports,
    losses), when Tune ended the trial, its workers in the GCS actor table (start, end, why they
    died) and when their group was removed; seconds from the search's start."""
    t0 = run["started"]
    rows = []
    for tid, t in run["trials"].items():
        mine = [r for r in run["results"] if r["trial"] == tid]
        ws = [w for w in run["workers"].values() if w["trial"] == tid]
        released = run["released"].get(tid, {})
        rows.append({
            "trial": tid, "lr": t["lr"], "rho": rho(t["lr"], cfg), "reports": len(mine),
            "last_iteration": mine[-1]["iteration"] if mine else 0,
            "loss": mine[-1]["loss"] if mine else math.nan,
            "first_report_s": mine[0]["time"] - t0 if mine else math.nan,
            "last_report_s": mine[-1]["time"] - t0 if mine else math.nan,
            "ended_s": run["ended"].get(tid, math.nan) - t0,
            "workers_start_s": min((w["start"] - t0 for w in ws), default=math.nan),
            "workers_end_s": max((w["end"] - t0 for w in ws), default=math.nan),
            "workers_dead": sum(w["state"] == "DEAD" for w in ws),
            "death_reasons": sorted({str(w["reason"]) for w in ws}),
            "death_causes": sorted({str(w["cause"]) for w in ws}),
            "placement_group": mine[0].get("placement_group") if mine else None,
            "group_removed_s": released.get("time", math.nan) - t0,
            "workers_alive_at_removal": released.get("workers_alive"),
            "group_before_removal": released.get("group_before"),
            "error": t["error"],
        })
    return sorted(rows, key=lambda r: r["first_report_s"])


def check_trial_search(rec: RunRecorder, cfg: Config, run: dict) -> None:
    lrs = trial_lrs(cfg)
    rows = trial_table(cfg, run)
    made = {r["trial"]: r["last_iteration"] for r in rows}
    log.info("TorchTrainer trials (seconds from the search's start; workers from Ray's actor table):")
    log.info("%-6s %-7s %-6s %-8s %-10s %-8s %-9s %-9s %s", "lr", "rho", "reports", "loss",
             "reports at", "ended", "workers", "up to", "")
    for r in rows:
        stopped = r["last_iteration"] < cfg.trial_max_t
        log.info("%-6.3f %-7.3f %-7d %-8.3g %-10s %-8.1f %-9.1f %-9.1f %s", r["lr"], r["rho"],
                 r["reports"], r["loss"], f"{r['first_report_s']:.1f}-{r['last_report_s']:.1f}",
                 r["ended_s"], r["workers_start_s"], r["workers_end_s"],
                 "stopped by ASHA" if stopped else "ran to max_t")
    rec.figure("TorchTrainer trials (table)", rows, table=False)
    rec.check("TorchTrainer trials that ran (of --trials)", "count",
              sum(r["reports"] > 0 and r["error"] is None for r in rows), len(lrs))
    rec.check("reports with 2 DDP workers (of all reports)", "count",
              sum(r.get("world_size") == 2 for r in run["results"]), len(run["results"]))
    # every report's weights against one process's gradient descent on all rows
    def off(key: str) -> float:
        worst = 0.0
        for r in run["results"]:
            if key not in r:
                return math.nan
            ref = reference_weights(cfg, run["trials"][r["trial"]]["lr"], r["iteration"] * cfg.steps_per_report)
            w = torch.tensor(r[key], dtype=torch.float64)
            worst = max(worst, ((w - ref).abs().max() / ref.abs().max().clamp(min=1)).item())
        return worst

    # 9 steps of sums of 8 products, float64: a few ulps (relative to the weights, which grow
    # in the diverging trial)
    rec.check("DDP weights == one process, every report (max rel.)", "parity", off("w"), 0.0, 1e-12)
    rec.check("one half without the all-reduce differs (control)", "parity", off("alone"), 1e-12,
              compare=">")
    rec.check("summed, not averaged, gradients differ (control)", "parity", off("summed"), 1e-12,
              compare=">")
    stopped = [r for r in rows if r["last_iteration"] < cfg.trial_max_t]
    rec.check("ASHA stopped TorchTrainer trials (>= 1)", "count", len(stopped), 1, compare=">=")
    diverging = [r for r in rows if rho(r["lr"], cfg) > 1]
    rec.check("diverging trials stopped at the first rung (of diverging)", "count",
              sum(r["last_iteration"] == cfg.trial_grace_period for r in diverging), len(diverging))
    events = [(r["trial"], r["iteration"], r["loss"]) for r in run["results"]]
    hand = asha_replay(events, cfg.trial_grace_period, cfg.trial_reduction_factor, cfg.trial_max_t)
    rec.check("Ray's ASHA == ASHA by hand on Tune's result order (trials that differ)", "count",
              sum(hand.get(k) != v for k, v in made.items()), 0)
    fifo = asha_replay(events, cfg.trial_grace_period, cfg.trial_reduction_factor, cfg.trial_max_t,
                       early_stopping=False)
    rec.check("same replay without stopping differs (control)", "count",
              sum(fifo.get(k) != v for k, v in made.items()), 0, compare=">")
    # released: Tune ends a stopped trial's actor and Ray its controller and workers. The GCS
    # actor table: both workers DEAD because their owner died (not WORKER_DIED, as when their
    # group's removal kills them), and ended before the group was removed (result_log removes
    # it only then, or after RELEASE_WAIT_S with the workers still alive, which fails here: a
    # trainer whose workers outlive their trial)
    released = sum(r["workers_dead"] == 2 and r["death_reasons"] == ["OWNER_DIED"]
                   and r["workers_alive_at_removal"] == 0
                   and r["workers_end_s"] <= r["group_removed_s"] for r in stopped)
    rec.check("stopped trials' workers DEAD (OWNER_DIED) before their group was removed (GCS)",
              "count", released, len(stopped))
    # each trial needs the whole machine, so the next one's workers start only once a stopped
    # trial's group is removed. Ray's GCS, sampled when the next trial first reports
    order = [r["trial"] for r in rows]  # by first report: one trial at a time, in start order
    pg = {r["trial"]: r["placement_group"] for r in rows}
    after = [(s, order[order.index(s["trial"]) + 1]) for s in stopped if s["trial"] != order[-1]]
    removed = own = 0
    for s, nxt in after:
        first = next(r for r in run["results"] if r["trial"] == nxt)
        removed += first["placement_groups"].get(pg[s["trial"]]) == "REMOVED"
        own += first["placement_groups"].get(pg[nxt]) == "REMOVED"
    rec.check("stopped trials' placement groups REMOVED when the next trial reports (GCS)",
              "count", removed, len(after))
    rec.check("the reporting trial's own group in the same snapshots: REMOVED (control)", "count",
              own, 0)
    rec.check("placement groups not REMOVED after the search (GCS)", "count", run["held_after"], 0)
    gaps = [rows[order.index(n)]["workers_start_s"] - s["workers_end_s"] for s, n in after]
    rec.figure("seconds from a stopped trial's workers' end to the next trial's workers", gaps)


def main(cfg: Config) -> int:
    setup_logging(0, 1)
    rec = RunRecorder(cfg, __file__)
    lo, hi = known_region(cfg)
    log.info("lr* = %.4f, known region [%.4f, %.4f], %d trials", best_lr(cfg), lo, hi, cfg.grid)
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
            trials = run_trial_search(cfg, storage) if trial_lrs(cfg) else None
            t.append(time.perf_counter())
        log.info("seconds: ray.init %.1f, ASHA search %.1f, FIFO search %.1f, TorchTrainer trials %.1f",
                 *(b - a for a, b in zip(t, t[1:])))
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
        rec.check("FIFOScheduler, same grid: stopped early (control)", "count",
                  sum(r["iterations"] < cfg.max_t for r in fifo), cfg.grid / 2, compare="<=")
        hand = asha_by_hand(cfg, grid_order(cfg))
        rec.check("Ray's ASHA == ASHA by hand (trials that differ)", "count",
                  sum(hand[r["lr"]] != r["iterations"] for r in asha), 0)
        ascending = asha_by_hand(cfg, sorted(grid_order(cfg)))
        rec.check("ASHA by hand, ascending order, differs (control)", "count",
                  sum(ascending[r["lr"]] != r["iterations"] for r in asha), 0, compare=">")
        iters = sum(r["iterations"] for r in asha)
        rec.figure("ASHA reports / reports without stopping", iters / (cfg.grid * cfg.max_t),
                   expected=sum(r["iterations"] for r in fifo) / (cfg.grid * cfg.max_t))
        rec.figure("best lr / lr*", best["lr"] / best_lr(cfg), expected=1.0)
        if trials is not None:
            check_trial_search(rec, cfg, trials)
        return rec.finish()
    finally:
        if "ray" in sys.modules:
            sys.modules["ray"].shutdown()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
