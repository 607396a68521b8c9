"""The planner's bytes set beside chapter 25's composed run, as that run measured them.

Chapter 25's 8-rank job trains its Llama on three layouts of one `DeviceMesh` and counts, on every
rank, inside the run: the model state from its tensors, the bytes each mesh dimension's
collectives were handed in one step (a `TorchDispatchMode` at the collective boundary) and the
activations autograd kept for backward at the step's peak (saved-tensor hooks). Its tests keep
those counts in chapters/ch25_llm/figures/data.json ("composed") and fail when a fresh job no
longer matches them. Here each rank's counts meet `mesh_bytes`'s predictions for the same rank:
model state and bytes exactly, activations inside `activation_band`.

What the two count differently, and how it is set aside: chapter 25 counts AdamW's two moments,
not its step counters (the planner's "optimizer" has both; its "moments" is compared), and the
planner leaves out the gradient norm's one-element partial sums (chapter 25 keeps their bytes
apart, `comm_scalar_bytes`, and they are subtracted).
"""

from __future__ import annotations

import json
from pathlib import Path

from chapters.ch30_frontier import mesh_bytes

RECORD = Path(__file__).parents[1] / "ch25_llm" / "figures" / "data.json"
PLAN_NAMES = {"blocks": "blocks", "sequence": "torchtitan"}  # chapter 25's -> mesh_bytes'


def load(path: Path = RECORD) -> dict:
    """Chapter 25's recorded composed job (plain JSON, nothing executed)."""
    return json.loads(Path(path).read_text())["composed"]


def setting(record: dict, layout: str) -> tuple[mesh_bytes.Llama, mesh_bytes.Mesh, mesh_bytes.Dtypes]:
    """The planner's view of one of the recorded layouts: chapter 25's model, mesh and dtype."""
    import torch

    m, run, lay = record["model"], record["run"], record["layouts"][layout]
    llama = mesh_bytes.Llama(m["vocab"], m["hidden"], m["layers"], m["heads"], m["kv_heads"],
                             m["ffn"], m["seq_len"])
    plan = PLAN_NAMES[lay.get("tp_plan", run["tp_plan"])]
    mesh = mesh_bytes.Mesh(dp=lay["dp"], tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], plan=plan,
                           micro_batch_size=run["global_batch"] // (lay["dp"] * run["microbatches"]),
                           micro_batches=run["microbatches"])
    return llama, mesh, mesh_bytes.Dtypes.of(getattr(torch, run["dtype"]))


def measured(rank: dict) -> dict:
    """One rank's counts in `mesh_bytes.compare`'s shape."""
    state = rank["state_bytes"]
    comm = {d: n - rank["comm_scalar_bytes"].get(d, 0) for d, n in rank["comm_bytes"].items()}
    return {"model_state": {"params": state["params"], "grads": state["grads"],
                            "moments": state["optimizer"]},
            "comm": comm, "activations": rank["activation_bytes"]}


def rows(record: dict) -> list[dict]:
    """Every prediction beside its measurement, for every rank of every recorded layout: pipeline
    stage from the rank's pp coordinate, shard rank dp·cp_size + cp, tp rank. Chapter 25's run
    is pipelined (1F1B) at every pp, with FSDP2's reshard_after_forward=False and activation
    checkpointing per block."""
    out = []
    for r in record["ranks"]:
        llama, mesh, dt = setting(record, r["layout"])
        c = r["coords"]
        for row in mesh_bytes.compare(llama, mesh, dt, measured(r), stage=c["pp"], t=c["tp"],
                                      s=c["dp"] * mesh.cp + c["cp"], recompute=True,
                                      reshard_after_forward=False, pipelined=True):
            out.append({"layout": r["layout"], "rank": r["rank"], "stage": c["pp"], **row})
    return out
