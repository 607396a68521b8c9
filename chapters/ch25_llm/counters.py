"""What the composed run measures inside itself, at the boundary of the system that does the
work (DESIGN.md, "Checks that can fail"): the bytes every collective is handed, by mesh
dimension (`CommCounter`, a `TorchDispatchMode` over c10d's ops), the activation bytes autograd
keeps for backward at their peak (`ActivationCounter`, saved-tensor hooks around each decoder
layer), and the model-state bytes a rank holds (`state_bytes`, from its tensors).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist


class CommCounter:
    """Bytes this rank hands to collectives, by mesh dimension, counted at the collective
    boundary: a `TorchDispatchMode` sees every c10d op (FSDP2's all-gather and reduce-scatter,
    DTensor's functional all-reduce and all-gather, the pipeline's and the ring's send/recv) with
    its process group, which `dims` maps back to a name. Counted: the input of an all-reduce,
    all-gather or reduce-scatter, the tensor of a send (receives are the peer's sends)."""

    OPS = {"allreduce_": 0, "all_reduce": 0, "_allgather_base_": 1, "all_gather_into_tensor": 0,
           "_reduce_scatter_base_": 1, "reduce_scatter_tensor": 0, "send": 0}

    def __init__(self, mesh):
        def by_ranks(order):  # where two dimensions have the same ranks, the later one wins
            return {tuple(dist.get_process_group_ranks(mesh[d].get_group())): d
                    for d in order if mesh[d].size() > 1}

        # at dp = 1 the cp ranks are the dp_cp ranks: sends there are the ring's, collectives
        # FSDP2's (and at cp = 1 the dp ranks are dp_cp's: FSDP2 is counted as dp_cp)
        self.p2p = by_ranks(("dp", "dp_cp", "tp", "cp", "pp"))
        self.collective = by_ranks(("pp", "cp", "tp", "dp", "dp_cp"))
        self.bytes: dict = {}
        self.calls: dict = {}
        self.scalar_bytes: dict = {}  # of those bytes, one-element tensors (the norm's sums)

    def _dim(self, group, p2p: bool) -> str:
        from torch.distributed.distributed_c10d import _resolve_process_group

        # functional ops name their group; c10d ops carry it as a TorchBind object. Groups are
        # matched by their ranks: DTensor and FSDP2 make their own groups for the same ranks.
        pg = _resolve_process_group(group) if isinstance(group, str) \
            else dist.ProcessGroup.unbox(group)
        dims = self.p2p if p2p else self.collective
        return dims.get(tuple(dist.get_process_group_ranks(pg)), "other")

    # not collectives: a wait, functional collectives' autograd wrapper; receives are the
    # peer's sends
    IGNORED = {"wait_tensor", "_wrap_tensor_autograd", "recv_", "recv_any_source_"}

    def record(self, func, args) -> None:
        op = func.__name__.split(".")[0]
        if op not in self.OPS:
            # any other collective (a broadcast, a coalesced or all-to-all variant) is kept
            # under its name, so that the exact comparisons with the formulas fail on it
            if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd") \
                    and op not in self.IGNORED:
                key = f"unknown:{op}"
                self.calls[key] = self.calls.get(key, 0) + 1
                self.bytes.setdefault(key, 0)
            return
        t = args[self.OPS[op]]
        t = t[0] if isinstance(t, (list, tuple)) else t
        group = [a for a in args[1:] if isinstance(a, str) or type(a).__name__ in
                 ("ProcessGroup", "ScriptObject")][-1 if isinstance(args[-1], str) else 0]
        dim = self._dim(group, p2p=op == "send")
        self.bytes[dim] = self.bytes.get(dim, 0) + t.numel() * t.element_size()
        self.calls[dim] = self.calls.get(dim, 0) + 1
        if t.numel() == 1:
            self.scalar_bytes[dim] = self.scalar_bytes.get(dim, 0) + t.element_size()

    def __enter__(self):
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                # A mode runs before tensor subclasses, and what it calls runs with the mode
                # off: an op on DTensors would issue its collectives unseen (loss parallel's
                # all-reduces inside the cross-entropy). Declining it lets DTensor desugar the
                # op first, its collectives then reach this mode (CommDebugMode does the same).
                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented
                counter.record(func, args)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t

class _Saved:
    """What the pack hook hands autograd instead of a saved tensor: when autograd frees it (the
    micro-batch's backward is done), its finalizer takes the bytes off the live count."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class ActivationCounter:
    """Bytes of activations the decoder layers keep for backward, live and at their peak: a
    saved-tensor hook is entered around each layer's forward (a forward pre-hook and a forward
    hook on the layer as `model.layers` holds it, checkpoint wrapper included), so it sees what
    autograd saves there, counted once per storage, weights (parameters and their views) left
    out; a pipeline stage's received input is a leaf that requires grad, and is counted. Under activation checkpointing that is each layer's input, saved by the
    checkpoint; the recomputation in backward runs under the checkpoint's own hooks and is not
    seen (chapter 30's band counts it as its top). Meta tensors (shape inference) are ignored."""

    def __init__(self, layers):
        self.peak = self.now = 0
        self._live: dict[int, list[int]] = {}  # storage -> [bytes, holders]
        self._contexts: list = []
        self._handles = [h for layer in layers for h in (
            layer.register_forward_pre_hook(self._enter),
            layer.register_forward_hook(self._exit))]

    def _enter(self, module, args):
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._contexts.append(ctx)

    def _exit(self, module, args, output):
        self._contexts.pop().__exit__(None, None, None)

    def _pack(self, t):
        local = _local(t)
        if hasattr(local, "elem"):  # a functional collective's result not yet waited on
            local = local.elem      # (AsyncCollectiveTensor, under sequence parallelism)
        if local.device.type == "meta" or isinstance(t, torch.nn.Parameter) or \
                isinstance(t._base, torch.nn.Parameter):
            return t
        key = local.untyped_storage().data_ptr()
        entry = self._live.setdefault(key, [local.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, key)
        return saved

    def _release(self, key):
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self._live[key]

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def remove(self) -> None:
        for h in self._handles:
            h.remove()



def state_bytes(model, opt) -> dict:
    """Model-state bytes this rank holds after an optimizer step (before the gradients are
    freed), counted from its tensors: parameter shards, gradient shards, AdamW's two moments."""
    params = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    grads = sum(_local(p.grad).numel() * _local(p.grad).element_size()
                for p in model.parameters() if p.grad is not None)
    moments = sum(_local(t).numel() * _local(t).element_size() for st in opt.state.values()
                  for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
    return {"params": params, "grads": grads, "optimizer": moments}


def full_params(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = t.detach().cpu().clone()
    return out


def merge_stages(results: list[dict]) -> dict:
    """One run's parameters from every stage's reporting rank, as one state dict."""
    out: dict = {}
    for r in results:
        if r["params"] is not None:
            out.update(r["params"])
    return out
