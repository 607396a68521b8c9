"""Ray kept on this machine for tune.py, and what it records: `start_ray` (no dashboard, no usage
statistics, node IP 127.0.0.1; a raylet that times out at start is retried), `result_log` (a
Tune callback that records every result in Tune's order and releases an ended trial's workers'
placement group once the GCS shows them dead) and `gcs_records` (what the checks read).
"""

from __future__ import annotations

import os
import time

from common.log import log

RAYLET_TIMEOUT = "The current node timed out during startup"


def start_ray(cfg, attempts: int = 3) -> None:
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


def gcs_records(grid, callback, started: float, finished: float) -> dict:
    """What Ray recorded of the search of training runs: Tune's results in arrival order, each
    trial's end and its group's removal (from `result_log`), the placement groups still held,
    and every worker in the GCS actor table (state, start, end, death cause)."""
    import ray

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
