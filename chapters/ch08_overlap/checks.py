"""The proofs chapter 08's run records, and the reference they compare with.

`train_single` is the one-process reference. `check_parity`: every variant, at every bucket
size, ends where it does. `check_order` reads each variant's event log (`launch_order`,
`hidden_under_backward`): how many all-reduces were launched, how many before backward ended,
how many bytes, and DDP's rebuilt buckets (`ddp_rebuilt_bucket_count`). `report_timing`: step
times and the communication left exposed, reported, never fatal.
"""

from __future__ import annotations

import copy
import statistics

import torch
import torch.distributed as dist
from torch import nn

from chapters.ch03_data_parallel.data_parallel import max_param_diff
from chapters.ch08_overlap.bucketed import build_buckets
from common.distributed import gather_numbers
from common.results import RunRecorder

VARIANTS = ("naive", "deferred", "bucketed", "ddp")


def train_single(init: nn.Module, X, Y, cfg) -> tuple[nn.Module, list[float]]:
    """The reference: one process, the whole global batch, the same SGD."""
    model = copy.deepcopy(init)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        opt.zero_grad()
        _, loss = model(X[step], Y[step])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def hidden_under_backward(events: list[dict]) -> int:
    """All-reduces of one step's log that overlapped backward's compute: launched, then at least
    one more gradient produced, then seen complete, all before backward ended. An all-reduce
    waited for inside the hook that launched it is seen complete before the next gradient
    (`EventLog.watch_wrapper`), so it does not count; nor does one launched after backward."""
    end = next(e["seq"] for e in events if e["kind"] == "backward_end")
    launched = {e["what"]: e["seq"] for e in events if e["kind"] == "launch"}
    grads = [e["seq"] for e in events if e["kind"] == "grad"]
    return sum(1 for e in events if e["kind"] == "done" and e["seq"] < end
               and any(launched[e["what"]] < g < e["seq"] for g in grads))


def launch_order(events: list[dict]) -> dict:
    """The overlap evidence, read from one step's event log: all-reduces launched, and hidden
    under backward, before backward ended; gradients that existed at the first launch; bytes."""
    end = next(e["seq"] for e in events if e["kind"] == "backward_end")
    launches = [e for e in events if e["kind"] == "launch"]
    return {"launches": len(launches),
            "before_backward_end": sum(e["seq"] < end for e in launches),
            "hidden": hidden_under_backward(events),
            "grads_at_first_launch": launches[0]["grads_ready"] if launches else -1,
            "grads": sum(e["kind"] == "grad" for e in events),
            "bytes": sum(e["bytes"] for e in launches)}


def grad_arrival_order(events: list[dict], model: nn.Module) -> list[nn.Parameter]:
    """The parameters in the order their gradients became ready (one step's log)."""
    params = dict(model.named_parameters())
    return [params[e["what"]] for e in events if e["kind"] == "grad"]


def ddp_rebuilt_bucket_count(first_step: list[dict], model: nn.Module, cap_kb: int) -> int:
    """How many buckets DDP uses from its second step on: it rebuilds them after the first step
    from the order the gradients arrived, packed with its own rule (a bucket closes once it
    reaches the cap), which `_compute_bucket_assignment_by_size` exposes."""
    order = grad_arrival_order(first_step, model)
    buckets, _ = dist._compute_bucket_assignment_by_size(order, [cap_kb * 1024])
    return len(buckets)


def check_parity(rec: RunRecorder, runs: dict, sweep: dict, single: nn.Module, dtype: str) -> None:
    """Every variant, at every bucket size, ends where one process does (float64: 1e-10,
    float32: 1e-5; see the lesson)."""
    tol = 1e-10 if dtype == "float64" else 1e-5
    for kind in VARIANTS:
        rec.check(f"{kind} == one process (max |dparam|)", "parity",
                  max_param_diff(runs[kind]["model"], single), 0.0, tol)
    rec.check("bucketed == one process, every swept bucket size", "parity",
              max(max_param_diff(r["model"], single) for r in sweep.values()), 0.0, tol)


def check_order(rec: RunRecorder, runs: dict, n_params: int, n_bytes: int, nb: int,
                bucket_kb: int) -> int:
    """What was launched (and finished) before backward ended, in the last step, against the
    buckets (nb), the trainable tensors and their bytes; returns DDP's rebuilt bucket count."""
    order = {kind: launch_order(runs[kind]["logs"][-1]) for kind in VARIANTS}
    b, d = order["bucketed"], order["deferred"]
    rec.check("gradients per step = trainable tensors", "count", b["grads"], n_params)
    rec.check("bucketed launches per step = buckets", "count", b["launches"], nb)
    rec.check("bucketed launches before backward returned", "count", b["before_backward_end"], nb)
    rec.check("bucketed: gradients ready at first launch", "count", b["grads_at_first_launch"],
              [1, n_params - 1], compare="between")
    rec.check("deferred launches per step = buckets", "count", d["launches"], nb)
    rec.check("deferred launches before backward returned", "count", d["before_backward_end"], 0)
    rec.check("naive launches per step = trainable tensors", "count", order["naive"]["launches"],
              n_params)
    rec.check("naive launches before backward returned", "count", order["naive"]["before_backward_end"], 0)
    ddp_first = launch_order(runs["ddp"]["logs"][0])
    rec.check("DDP launches in its first step (one bucket)", "count", ddp_first["launches"], 1)
    ddp_buckets = ddp_rebuilt_bucket_count(runs["ddp"]["logs"][0], runs["ddp"]["model"], bucket_kb)
    rec.check("DDP launches before backward returned, last step", "count",
              order["ddp"]["before_backward_end"], ddp_buckets)
    for kind in VARIANTS:
        rec.check(f"{kind} bytes per step = trainable params x bytes", "formula",
                  order[kind]["bytes"], n_bytes)
    return ddp_buckets


def report_timing(rec: RunRecorder, runs: dict, sweep: dict, params: list, nb: int,
                  ddp_buckets: int) -> None:
    """Time (reported, never fatal): overlap alone, and overlap plus fewer messages; then the
    step times, exposed syncs and bucket counts as figures, and the bucket-size sweep."""
    # A bucket completes only when every rank has launched it: the rank that runs ahead
    # sees fewer complete before its own backward ends. Per rank, the median over steps.
    done = [launch_order(log_)["hidden"] for log_ in runs["bucketed"]["logs"][1:]]
    done_per_rank = gather_numbers(statistics.median(done or [0]))
    rec.check("bucketed: hidden under backward (median step, min rank)", "timing",
              min(done_per_rank), 0, compare=">")
    ratio = {k: runs[k]["ms"] / runs[ref]["ms"] for k, ref in
             (("bucketed", "deferred"), ("deferred", "naive"), ("ddp", "naive"))}
    hidden = runs["bucketed"]["exposed_ms"] / runs["deferred"]["exposed_ms"]
    rec.check("bucketed / deferred exposed sync (overlap alone)", "timing", hidden, 1.0, compare="<")
    rec.check("bucketed / deferred step time (overlap alone)", "timing", ratio["bucketed"], 1.0, compare="<")
    rec.check("deferred / naive step time (fewer messages alone)", "timing", ratio["deferred"], 1.0, compare="<")

    for kind in VARIANTS:
        r = runs[kind]
        rec.figure(f"{kind} step time (median, min-max)", r["ms"], unit="ms",
                   spread=(r["ms_min"], r["ms_max"]))
    for kind in ("naive", "deferred", "bucketed"):  # DDP waits inside backward: nothing to time
        rec.figure(f"{kind} exposed sync (median, last rank in)", runs[kind]["exposed_ms"], unit="ms")
    rec.figure("bucketed / deferred step time", ratio["bucketed"], table=False)  # its check shows it
    rec.figure("deferred / naive step time", ratio["deferred"], table=False)
    rec.figure("DDP / naive step time", ratio["ddp"])
    rec.figure("buckets (BucketedDDP)", nb)
    rec.figure("DDP buckets per step after the first", ddp_buckets)
    rec.figure("bucketed: hidden under backward, rank 0's steps", done)
    rec.figure("bucketed: hidden under backward, median per rank", done_per_rank)
    for kb, r in sweep.items():
        n = len(build_buckets(params, kb * 1024))
        rec.figure(f"bucketed step time, cap {kb} KiB ({n} bucket{'s' * (n != 1)})", r["ms"],
                   unit="ms")
        rec.figure(f"bucketed / naive, cap {kb} KiB", r["ms"] / runs["naive"]["ms"])
