"""ZeRO-2 and ZeRO-3 written by hand (chapter 06): module wrappers whose gradients, and under
ZeRO-3 whose parameters too, are sharded over the ranks, on the flat layout of zero.py.

`ZeroTwo(module)` keeps the whole parameters in one flat buffer and only its slice of the
gradients: each gradient is reduce-scattered by owner (`reduce_scatter_param_grad`) the moment
backward produces it, then freed. `ZeroThree(module)` also frees the parameters: every module
that owns some all-gathers them just before its forward, and again before its backward, and
frees them after. Both step an fp32 master slice (`_Sharded`), the only parameter an optimizer
sees; with `compute_dtype=torch.bfloat16` they gather and compute in bf16 and reduce in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from chapters.ch06_hybrid_zero.zero import FlatLayout, all_gather_flat, flatten_into_buffer
from common.distributed import broadcast_from_rank0, trainable_params


def reduce_scatter_param_grad(grad: torch.Tensor, i: int, layout: FlatLayout,
                              grad_shard: torch.Tensor) -> None:
    """ZeRO-2/3: reduce-scatter one parameter's gradient by owner, in the gradient slice's
    dtype (fp32 when computing in bf16), and add this rank's piece, summed over the ranks, into
    the slice. Pieces are uneven, some empty: the list form of reduce_scatter takes that."""
    flat = grad.reshape(-1).to(grad_shard.dtype)
    pieces = [flat[lo:hi].contiguous() for lo, hi in layout.pieces(i)]
    start, end = layout.my_range(i)
    mine = torch.empty(end - start, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter(mine, pieces, op=dist.ReduceOp.SUM)
    grad_shard[start:end] += mine


def _free(p: torch.Tensor) -> None:
    p.untyped_storage().resize_(0)


def _cast_inputs(args, kwargs, dtype):
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


class _Sharded(nn.Module):
    """What ZeRO-2 and ZeRO-3 share: the fp32 master slice as the only trainable parameter,
    gradients reduce-scattered in backward hooks into an fp32 slice, and `reduce_gradients()`."""

    def _setup(self, module: nn.Module, compute_dtype: torch.dtype | None,
               slice_is_view: bool) -> torch.Tensor:
        """Broadcast rank 0's weights, build the layout and the master slice (a view of the flat
        buffer when `slice_is_view`, else a copy); return the flat buffer of the whole
        parameters (master dtype), each parameter a view of it."""
        self.module = module
        broadcast_from_rank0(module)
        self.layout = FlatLayout(trainable_params(module.parameters()),
                                 dist.get_world_size(), dist.get_rank())
        flat = flatten_into_buffer(self.layout)
        self.master_dtype = flat.dtype
        self.compute_dtype = compute_dtype or flat.dtype
        r, S = self.layout.rank, self.layout.shard
        mine = flat[r * S:(r + 1) * S]
        self.shard = nn.Parameter(mine if slice_is_view else mine.clone())  # what the optimizer steps
        self._acc: torch.Tensor | None = None  # gradient slice, summed over ranks, during backward
        # Frozen tensors are not sharded; under a compute dtype they are used in it (as FSDP2
        # casts them), and their full-precision values are kept for full_parameters().
        self._frozen = {}
        for name, p in module.named_parameters():
            if not p.requires_grad and p.dtype != self.compute_dtype and p.is_floating_point():
                self._frozen[name] = p.detach().clone()
                p.data = p.data.to(self.compute_dtype)
        for i, p in enumerate(self.layout.params):
            p.register_post_accumulate_grad_hook(self._grad_ready(i))
        # state_dict(): the slice, not the module's sharded parameters (empty under ZeRO-3,
        # rebuilt from the slices under ZeRO-2); every name of a tied weight.
        ids = {id(p) for p in self.layout.params}
        self._sharded_names = [f"module.{n}" for n, p in module.named_parameters(remove_duplicate=False)
                               if id(p) in ids]
        self.register_load_state_dict_post_hook(_Sharded._not_missing)
        return flat

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """This rank's checkpoint: the master slice (`shard`), frozen parameters, buffers, and
        which rank of which world saved it. Save one per rank; `full_parameters()` gives the
        whole model."""
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for name in self._sharded_names:
            out.pop(prefix + name, None)
        return out

    @staticmethod
    def _not_missing(module: _Sharded, incompatible) -> None:
        """load_state_dict(strict=True) must not ask for the parameters state_dict() leaves out."""
        def sharded(key):
            return any(key == n or key.endswith("." + n) for n in module._sharded_names)
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not sharded(k)]

    def get_extra_state(self) -> dict:
        return {"rank": self.layout.rank, "world_size": self.layout.world_size,
                "numel": self.layout.numel}

    def set_extra_state(self, state: dict) -> None:
        here = self.get_extra_state()
        if state != here:
            raise ValueError(f"this slice was saved by rank {state['rank']} of {state['world_size']} "
                             f"for {state['numel']} numbers; this is rank {here['rank']} of "
                             f"{here['world_size']} with {here['numel']}")

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """What an optimizer steps: the master slice only. (The module's own parameters are
        views of the gathered buffer, or empty placeholders under ZeRO-3.)"""
        yield (f"{prefix}." if prefix else "") + "shard", self.shard

    def forward(self, *args, **kwargs):
        if self.compute_dtype != self.master_dtype:  # as FSDP2's cast_forward_inputs
            args, kwargs = _cast_inputs(args, kwargs, self.compute_dtype)
        return self.module(*args, **kwargs)

    def _reduce(self, p: torch.Tensor, i: int) -> None:
        if self._acc is None:
            self._acc = torch.zeros_like(self.shard, memory_format=torch.contiguous_format)
        reduce_scatter_param_grad(p.grad, i, self.layout, self._acc)
        p.grad = None  # the full gradient is gone as soon as it is reduced

    def reduce_gradients(self) -> None:
        """Call after `backward()`, before `optimizer.step()`: every gradient was
        reduce-scattered during backward as it appeared; average the slice over the ranks and
        hand it to the master slice's `.grad` (added, if the optimizer did not clear it)."""
        if self._acc is None:
            raise RuntimeError("reduce_gradients() needs a backward() first: no gradient was reduced")
        grad, self._acc = self._acc.div_(self.layout.world_size), None
        if self.shard.grad is None:
            self.shard.grad = grad
        else:
            self.shard.grad += grad

    def states(self) -> dict[str, list]:
        """The tensors that are model states now: parameters (the module's, gathered or not,
        the master slice, frozen originals) and gradients (the module's, the slices)."""
        params = [*self.module.parameters(), self.shard, *self._frozen.values()]
        grads = [p.grad for p in self.module.parameters()] + [self.shard.grad, self._acc]
        return {"params": params, "grads": grads}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Whole parameters in the master dtype, on every rank (a collective: every rank calls
        it), gathered from the master slices."""
        S, N = self.layout.shard, self.layout.world_size
        flat = torch.empty(N * S, dtype=self.master_dtype, device=self.shard.device)
        all_gather_flat(flat, self.shard)
        index = {id(p): i for i, p in enumerate(self.layout.params)}
        out = {}
        for name, p in self.module.named_parameters():
            if id(p) in index:
                i = index[id(p)]
                out[name] = flat[self.layout.offsets[i]:self.layout.offsets[i + 1]].view(p.shape).clone()
            else:
                out[name] = self._frozen.get(name, p).detach().clone()
        return out


class ZeroTwo(_Sharded):
    """ZeRO-2 (P_os+g): wrap any module; build the optimizer on `wrapper.parameters()`.

        model = ZeroTwo(module)                       # compute_dtype=torch.bfloat16 for bf16
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        loss = model(x).loss; loss.backward(); model.reduce_gradients(); opt.step()

    Each gradient is reduce-scattered as backward finishes it (a post-accumulate-grad hook per
    parameter) and freed, so a rank keeps only its gradient slice. The whole parameters stay in
    one flat buffer (of the compute dtype); the next forward all-gathers the updated slices into
    it (once per optimizer step: it notices the slice changed)."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        same = compute_dtype in (None, next(p for p in module.parameters() if p.requires_grad).dtype)
        flat = self._setup(module, compute_dtype, slice_is_view=same)  # no second copy if it can
        if same:
            self.flat = flat
        else:
            self.flat = flatten_into_buffer(self.layout, self.compute_dtype)  # params now bf16 views
            del flat
        self._gathered_version = self.shard._version
        self.register_forward_pre_hook(lambda _m, _a: self.gather_parameters())

    def _grad_ready(self, i: int):
        return lambda p: self._reduce(p, i)

    def gather_parameters(self) -> None:
        """All-gather the slices into the flat buffer if the optimizer changed this rank's."""
        if self.shard._version != self._gathered_version:
            all_gather_flat(self.flat, self.shard)
            self._gathered_version = self.shard._version


class ZeroThree(_Sharded):
    """ZeRO-3 (P_os+g+p): as ZeRO-2, and the parameters themselves are sharded. Every module
    that owns parameters all-gathers them (in the compute dtype) in a forward pre-hook, frees
    them after its forward, gathers them again when the gradient of its output arrives (before
    its backward needs them), and frees them once their gradients are reduce-scattered."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        flat = self._setup(module, compute_dtype, slice_is_view=False)
        for p in self.layout.params:
            p.data = torch.empty(p.shape, dtype=self.compute_dtype, device=p.device)  # own storage
            _free(p)
        del flat  # the slice is the only copy a rank keeps
        self.index = {id(p): i for i, p in enumerate(self.layout.params)}
        for m in module.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) in self.index]
            if own:
                m.register_forward_pre_hook(lambda _m, _a, own=own: self.gather(own))
                m.register_forward_hook(lambda _m, _a, out, own=own: self._after_forward(own, out))

    @torch.no_grad()
    def gather(self, params: list[torch.Tensor]) -> None:
        """All-gather whole parameters from every rank's slice. The pieces are uneven, which
        gloo's all_gather refuses, so it is an all_to_all_single that sends my piece to all."""
        for p in params:
            if p.untyped_storage().nbytes() > 0:
                continue  # already whole (a tied weight used twice)
            i = self.index[id(p)]
            sizes = [hi - lo for lo, hi in self.layout.pieces(i)]
            start, end = self.layout.my_range(i)
            mine = self.shard.detach()[start:end].to(self.compute_dtype)
            p.untyped_storage().resize_(p.numel() * p.element_size())
            dist.all_to_all_single(p.data.view(-1), mine.repeat(self.layout.world_size),
                                   output_split_sizes=sizes,
                                   input_split_sizes=[end - start] * self.layout.world_size)

    def _after_forward(self, params: list[torch.Tensor], output) -> None:
        for p in params:
            _free(p)
        for t in tree_leaves(output):  # a tensor, or tuples, lists, dicts of them
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, params=params: self.gather(params))

    def _grad_ready(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self._reduce(p, i)
            _free(p)
        return hook

    def reduce_gradients(self) -> None:
        super().reduce_gradients()
        for p in self.layout.params:
            _free(p)  # a parameter gathered but given no gradient this step
