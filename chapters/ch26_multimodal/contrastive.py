"""CLIP's contrastive loss with negatives from every rank: the gathers, the global and local losses.

Each rank holds b of the B = W·b image/caption pairs of a global batch. The loss one process
would compute on the global batch is the symmetric cross-entropy over the B x B matrix of
scaled cosines. To give every rank's images all B captions as candidates (B − 1 negatives), the
ranks all-gather their embeddings. Three gathers:

- `AllGatherWithGrad` (by hand): forward all-gathers, backward **reduce-scatters** (sums) the
  gradient of the gathered tensor, so each rank receives what every rank's loss says about its
  own embeddings;
- `torch.distributed.nn.functional.all_gather`: the same, from torch (on gloo its backward is
  an all-to-all and a sum);
- `gather_no_grad`: a plain `all_gather` (no autograd), with the rank's own slice put back so
  that at least the local embeddings carry gradients: the negative control.

Two losses over the gathered embeddings:
- **global**: every rank builds the whole B x B logits and computes the whole loss;
- **local** (open_clip's `local_loss`): rank r builds only its own rows, b x B for images
  against all captions and b x B for captions against all images, and takes the mean over them.
Either way the ranks then average their parameter gradients (DDP), which makes the gradient
the one of the global-batch loss (see the lesson for why the factor W works out).

What the gathers send is counted where it leaves: `CollectiveTap` is a `TorchDispatchMode` that
sees every c10d operation the process group is given (forward and backward, whichever Python
name called it) and adds up the bytes of the tensors this rank hands in.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common.distributed import all_gather_single, reduce_scatter_single

GATHERS = ("hand", "torch", "nograd")


@dataclass
class Counter:
    """Bytes and shapes of the logits matrices the loss builds, read off the tensors built."""

    logits_bytes: int = 0
    shapes: list = field(default_factory=list)

    def logits(self, t: torch.Tensor) -> torch.Tensor:
        self.logits_bytes += t.numel() * t.element_size()
        self.shapes.append(tuple(t.shape))
        return t


# c10d operation -> (kind, index of the argument holding what this rank hands in). A scatter's
# input list is empty except on its source; an all-gather's input is this rank's piece; a
# reduce-scatter's is the whole vector it reduces.
HANDED_IN = {
    "_allgather_base_": ("all_gather", 1), "allgather_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "scatter_": ("scatter", 1), "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1),
    "allreduce_": ("all_reduce", 0),
}
# torch's differentiable all-gather sends its gradient back with a reduce-scatter on NCCL and
# with one scatter per rank on gloo (an all-to-all elsewhere): each is "the gather's backward".
BACKWARD_KINDS = ("reduce_scatter", "scatter", "all_to_all")


class CollectiveTap(TorchDispatchMode):
    """`with CollectiveTap() as tap: ...`, then `tap.nbytes("all_gather")`: the bytes of the
    tensors this rank handed to each kind of c10d collective inside the block, read from the
    operation's own arguments. Autograd carries the mode to the threads backward runs on, so
    the backward's collectives are counted too. A gather that skips the collective counts 0."""

    def __init__(self):
        super().__init__()
        self.sent: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            kind, arg = HANDED_IN.get(func.__name__.split(".")[0], (None, None))
            if kind is not None:
                self.sent[kind] += sum(t.numel() * t.element_size()
                                       for t in tree_leaves(args[arg]) if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))

    def nbytes(self, *kinds: str) -> int:
        return sum(self.sent[k] for k in kinds)


class AllGatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0 whose backward sums every rank's gradient for this rank's slice
    (a reduce-scatter): the adjoint of "copy my rows to everyone"."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        mine = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        reduce_scatter_single(mine, grad.contiguous(), op=dist.ReduceOp.SUM)
        return mine


def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """A plain all-gather: the other ranks' rows arrive as constants; this rank's own slice is
    put back as the live tensor (the common shortcut)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x.detach().contiguous())
    parts = list(out.chunk(world))
    parts[rank] = x
    return torch.cat(parts)


def gather(x: torch.Tensor, how: str) -> torch.Tensor:
    """Every rank's rows of `x`, in rank order, by one of GATHERS."""
    if how == "hand":
        return AllGatherWithGrad.apply(x)
    if how == "torch":
        return torch.cat(dist_fn.all_gather(x))
    if how == "nograd":
        return gather_no_grad(x)
    raise ValueError(f"gather must be one of {GATHERS}, not {how!r}")


def clip_loss(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor,
              counter: Counter | None = None) -> torch.Tensor:
    """The single-process loss on a whole batch: symmetric cross-entropy over the B x B logits,
    pair i's image and caption the positives (the diagonal)."""
    logits = scale * img @ txt.T
    if counter is not None:
        counter.logits(logits)  # the caption direction is logits.T: a view, no new bytes
    labels = torch.arange(len(img), device=img.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def local_clip_loss(img: torch.Tensor, txt: torch.Tensor, all_img: torch.Tensor,
                    all_txt: torch.Tensor, scale: torch.Tensor, rank: int,
                    counter: Counter | None = None) -> torch.Tensor:
    """Rank `rank`'s rows only: its b images against all B captions and its b captions against
    all B images (two b x B matrices); the positives sit at columns rank·b + i."""
    b = len(img)
    per_image = scale * img @ all_txt.T
    per_text = scale * txt @ all_img.T
    if counter is not None:
        counter.logits(per_image)
        counter.logits(per_text)
    labels = torch.arange(b, device=img.device) + rank * b
    return (F.cross_entropy(per_image, labels) + F.cross_entropy(per_text, labels)) / 2


def distributed_clip_loss(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor,
                          gather_how: str = "torch", local: bool = False,
                          counter: Counter | None = None) -> torch.Tensor:
    """This rank's contrastive loss with negatives from all ranks; its mean over the ranks is
    the global-batch loss, and after averaging the parameter gradients over the ranks (DDP) so
    is its gradient (for the gathers that carry gradients)."""
    all_img, all_txt = gather(img, gather_how), gather(txt, gather_how)
    if local:
        return local_clip_loss(img, txt, all_img, all_txt, scale, dist.get_rank(), counter)
    return clip_loss(all_img, all_txt, scale, counter)


def logits_bytes_formula(global_batch: int, world: int, local: bool, element_size: int) -> int:
    """Bytes of logits one rank builds: B² (global; the other direction is its transpose view)
    or 2·b·B (local: b x B per direction, b = B / W)."""
    b = global_batch // world
    return (2 * b * global_batch if local else global_batch ** 2) * element_size
