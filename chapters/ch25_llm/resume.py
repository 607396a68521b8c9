"""Chapter 25's DCP checkpoint and the bitwise resume it is checked by: every rank saves and loads
its own shards (chapter 12's verified folder), and on CUDA what makes the resumed steps repeat the
first run's exactly (cuBLAS's fixed workspace, no NVLS, deterministic algorithms from the save on).
"""

from __future__ import annotations

import os

import torch

from common.checkpoint import check_identity, load_dcp, save_dcp, training_shapes, verify_dcp


def cuda_determinism(on_gpus: bool, environ=os.environ) -> dict:
    """What makes the resume check bitwise on CUDA: the environment to set before CUDA and NCCL
    start (cuBLAS's fixed workspace, which `torch.use_deterministic_algorithms` requires; no
    NVLS, whose in-switch reductions may add in any order), and whether to switch on
    deterministic algorithms (flash/memory-efficient attention backward without atomics) from
    the checkpoint on. Variables the user set are kept. On CPUs: nothing (already bitwise)."""
    if not on_gpus:
        return {"env": {}, "deterministic_from_save": False}
    wanted = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_NVLS_ENABLE": "0"}
    return {"env": {k: v for k, v in wanted.items() if k not in environ},
            "deterministic_from_save": True}


def enter_deterministic_mode() -> None:
    """Deterministic algorithms from here on; compiled code is dropped so that the layers are
    recompiled under them, as the resumed runs' will be (inductor fuses differently then)."""
    torch.use_deterministic_algorithms(True)
    torch._dynamo.reset()


def save_checkpoint(model, opt, path) -> None:
    """DCP: every rank writes its own shards of the model and the optimizer, in parallel; then
    the ranks hash what they wrote and rank 0 writes the folder's manifest last (chapter 12)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    save_dcp({"model": model_sd, "optim": optim_sd}, path, shapes=training_shapes(model, opt))


def load_checkpoint(model, opt, path, with_optimizer: bool = True) -> None:
    """DCP load into an already-sharded model (and optimizer): each rank reads its shards, after
    the folder verified against its manifest, through DCP's reader restricted to what its
    metadata may hold (common.checkpoint, chapter 12: nothing in the folder can run code)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    manifest = verify_dcp(path)  # written inside this run's --out: no run id, the shapes must match
    check_identity(manifest, None, training_shapes(model, opt), path)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd} if with_optimizer else {"model": model_sd}
    load_dcp(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"] if with_optimizer else optim_sd)
