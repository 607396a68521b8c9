"""The proofs tune.py records: ASHA written out (`asha_replay`, fed the formula's losses by
`asha_by_hand`), the reference runs (`reference_weights`: one process's gradient descent on all
rows), the grid search's checks (`check_search`), and the checks of the trials that are
TorchTrainer runs, from Ray's own records (`trial_table`, `check_trial_search`).
"""

from __future__ import annotations

import math

import torch

from chapters.ch21_hyperparameters.quadratic import (
    best_lr,
    full_loss,
    grid_order,
    loss_after,
    problem_data,
    rho,
    trial_lrs,
)
from common.log import log
from common.results import RunRecorder


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


def asha_by_hand(cfg, order: list[float], early_stopping: bool = True) -> dict[float, int]:
    """The in-process search's decisions: trials one after another in `order` (one at a time, so
    each trial's reports all arrive before the next trial's), losses from the formula.
    Returns lr -> reports made."""
    events = [(lr, it, loss_after(lr, it * cfg.steps_per_report, cfg))
              for lr in order for it in range(1, cfg.max_t + 1)]
    return asha_replay(events, cfg.grace_period, cfg.reduction_factor, cfg.max_t, early_stopping)


def reference_weights(cfg, lr: float, steps: int) -> torch.Tensor:
    """The same gradient descent in this process, on all rows at once."""
    x, y = problem_data(cfg)
    w = torch.zeros(cfg.d, dtype=torch.float64)
    for _ in range(steps):
        w = w - lr * x.T @ (x @ w - y) / len(y)
    return w


def reference_loss(cfg, lr: float, steps: int) -> float:
    return full_loss(reference_weights(cfg, lr, steps), cfg)


def check_search(rec: RunRecorder, cfg, asha: list[dict], fifo: list[dict]) -> None:
    """The grid search under ASHA against the formula (the best trial in the known region, the
    worst outside it), its early stops against FIFOScheduler's, and Ray's decisions against
    ASHA by hand (in the search's order; ascending order, the control, decides otherwise)."""
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


def trial_table(cfg, run: dict) -> list[dict]:
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


def check_trial_search(rec: RunRecorder, cfg, run: dict) -> None:
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
