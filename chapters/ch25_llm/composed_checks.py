"""The composed run's proofs as the chapter's tests run them: one spawned job of 8 ranks trains
two layouts with their negative controls (`PLANS`) and reshards a DCP checkpoint (`RESHARD`);
`compare_plans` sets every run beside one process, `measured_figures` collects what each rank
counted for chapter 30's planner, and `record` keeps them (plots.py writes them into
figures/data.json: `python tools/figures.py --rerun ch25`).
"""

from __future__ import annotations

import dataclasses

from chapters.ch25_llm.composed import train_composed
from chapters.ch25_llm.counters import merge_stages
from chapters.ch25_llm.parallelize import build_mesh
from chapters.ch25_llm.reference import DIMS, Layout, Run, differences, tolerances


def layout_worker(run: Run, plans: list, save: str | None = None) -> list:
    """For tests: on every spawned rank, `plans` is a list of (layout, [broken...]); one mesh per
    layout, every run on it. Returns per plan per broken this rank's result. With `save`, the
    first plan's correct run also writes its DCP checkpoint there."""
    out = []
    for i, (layout, brokens) in enumerate(plans):
        mesh = build_mesh(layout)
        out.append({b: train_composed(control_run(run, b), layout, mesh, b,
                                      save=save if i == 0 and b == "none" else None)
                    for b in brokens})
    return out


CONTROL_STEPS = {"no_reduce:dp": 1, "no_reduce:cp": 1, "tp_unreduced": 1, "pp_unscaled": 1,
                 "clip_local_stage": 2}
"""Steps each negative control trains: the fewest that show its bug (the job's time is the
chapter's budget). A wrong gradient moves the weights at the first step; a doubled gradient
doubles the first pre-clip norm; clipping by the wrong norm needs a second step, because AdamW's
first step, g/(|g| + ε), does not see a gradient's scale."""


def control_run(run: Run, broken: str) -> Run:
    return dataclasses.replace(run, steps=CONTROL_STEPS.get(broken, run.steps))


def parity_worker(ckpt: str | None = None) -> dict:
    """The chapter's 8-rank job: dp2 x tp2 x pp2 (the blocks plan) with its four controls,
    pp2 x tp2 x cp2 (the sequence plan: sequence parallelism, loss parallel), dp2 x cp2 x tp2
    with its cp control; with `ckpt`, the resharding: dp2 x tp2 x pp2 trains `Run().steps`
    steps and saves a DCP checkpoint there, which dp4 x tp2 (one stage: no pipeline) loads and
    trains one step on. The same folder is then resumed by one process (`resume_one_process`), in the test."""
    run = Run()
    out = {"plans": layout_worker(run, PLANS, save=ckpt)}
    if ckpt:
        b = RESHARD[1]
        one_more = Run(steps=1)
        out["resumed"] = train_composed(one_more, b, build_mesh(b), start=run.steps, load=ckpt)
    return out


PLANS = [(Layout(dp=2, tp=2, pp=2), ["none", "no_reduce:dp", "pp_unscaled", "clip_local_stage",
                                     "tp_unreduced"]),
         (Layout(pp=2, tp=2, cp=2, tp_plan="sequence"), ["none"]),
         (Layout(dp=2, cp=2, tp=2), ["none", "no_reduce:cp"])]
# both tensor-parallel plans in one job: dp2 x tp2 x pp2 on "blocks" (Megatron's split, its
# controls), pp2 x tp2 x cp2 on torchtitan's "sequence" plan, and dp2 x cp2 x tp2, where FSDP2's
# mesh is the flattened dp x cp with two real factors: its control hands FSDP2 the dp mesh alone
# (the realistic slip: cp's ranks then hold different tokens' gradients, never averaged)


RESHARD = (PLANS[0][0], Layout(dp=4, tp=2))  # saved by, resumed on


def compare_plans(run: Run, plans: list, results_by_rank: list, references: dict) -> list[dict]:
    """One row per (layout, run) of `layout_worker`'s results on every rank: the largest
    differences from one process that trained as many steps (`references[steps]`) and whether
    all are within that many steps' `tolerances`."""
    rows = []
    for i, (layout, brokens) in enumerate(plans):
        for b in brokens:
            steps = control_run(run, b).steps
            tol = tolerances(dataclasses.replace(run, steps=steps))
            per_rank = [r[i][b] for r in results_by_rank]
            composed = {"losses": per_rank[0]["losses"], "norms": per_rank[0]["norms"],
                        "params": merge_stages(per_rank)}
            d = differences(composed, references[steps])
            rows.append({"layout": layout.name(), "broken": b, "steps": steps, **d,
                         "within": all(d[k] <= tol[k] for k in tol)})
    return rows


def measured_figures(results_by_rank: list, plans: list = None) -> list[dict]:
    """Chapter 25's measured per-layout figures for chapter 30's planner: for each correct run
    of `layout_worker` (one list per rank), each rank's coordinates, its model-state bytes
    (params, grads, AdamW moments) and the bytes it handed to collectives in one training step
    by mesh dimension ("pp", "dp", "cp", "tp", "dp_cp"), with the number of calls and the bytes
    of one-element tensors among them (the gradient norm's partial sums), and the
    activation bytes its decoder layers kept for backward at the step's peak."""
    plans = PLANS if plans is None else plans
    rows = []
    for i, (layout, _) in enumerate(plans):
        for rank, r in enumerate(results_by_rank):
            res = r[i]["none"]
            rows.append({"layout": layout.name(), "rank": rank, "coords": res["coords"],
                         "state_bytes": res["state_bytes"], "comm_bytes": res["comm_bytes"],
                         "comm_calls": res["comm_calls"],
                         "comm_scalar_bytes": res["comm_scalar_bytes"],
                         "activation_bytes": res["activation_bytes"]})
    return rows


def record(results_by_rank: list) -> dict:
    """What chapter 30 sets its planner beside: the run's shape and `measured_figures`, as the
    8-rank job measured them (kept in figures/data.json under "composed" by plots.py; the
    chapter's tests compare a fresh job with it)."""
    run = Run()
    c = run.cfg
    return {"model": {"vocab": c.vocab, "hidden": c.hidden, "layers": c.layers, "heads": c.heads,
                      "kv_heads": c.kv_heads, "ffn": c.ffn, "seq_len": run.seq_len},
            "run": {"global_batch": run.global_batch, "microbatches": run.microbatches,
                    "dtype": str(run.dtype).removeprefix("torch."),
                    "activation_checkpointing": "per block", "fsdp_reshard_after_forward": False,
                    "schedule": "1F1B", "tp_plan": "per layout"},
            "layouts": {layout.name(): {**{d: getattr(layout, d) for d in DIMS},
                                        "tp_plan": layout.tp_plan}
                        for layout, _ in PLANS},
            "ranks": measured_figures(results_by_rank)}
