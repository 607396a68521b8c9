"""What the composed run (composed.py) is proven against: its settings (`Run`) and the global
batch of each step, one process training the whole model on that batch (`one_process`, and
`resume_one_process` from the composed run's DCP checkpoint), the parity tolerances the lesson
derives, a rank's share of each batch (`local_batch`) and why a layout cannot run
(`layout_error`). Nothing here builds a mesh: it is the expected value the composed run is
measured against; the closed forms of its bytes are in formulas.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chapters.ch25_llm.llama import Cfg, Llama, reference_model

DIMS = ("pp", "dp", "cp", "tp")  # outermost to innermost: tp on neighbouring ranks (one node)
TP_PLANS = ("blocks", "sequence")  # parallelize.apply_tp


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    tp_plan: str = "blocks"  # composed.apply_tp's: "blocks", or "sequence" (torchtitan's)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sp(self) -> int:
        """The sequence-parallel degree: tp under the "sequence" plan, else 1."""
        return self.tp if self.tp_plan == "sequence" else 1

    def name(self) -> str:
        dims = " x ".join(f"{d}{getattr(self, d)}" for d in DIMS if getattr(self, d) > 1) or "1"
        return dims + (" (sequence)" if self.sp > 1 else "")


@dataclass
class Run:
    """Settings shared by the composed run and its one-process reference."""

    cfg: Cfg = field(default_factory=Cfg)
    steps: int = 3
    global_batch: int = 8
    seq_len: int = 32
    microbatches: int = 2
    lr: float = 3e-3
    max_norm: float = 0.5       # chosen below the measured norms: clipping acts at every step
    seed: int = 0
    dtype: torch.dtype = torch.float64


def batch(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch: random token windows (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(run.seed * 7919 + step)
    ids = torch.randint(0, run.cfg.vocab, (run.global_batch, run.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def local_batch(run: Run, layout: Layout, coords: dict, step: int):
    """This rank's share of the global batch: its dp rows, its cp zigzag shard of each row."""
    from chapters.ch18_long_context.layouts import shard_sequence

    x, y = batch(run, step)
    rows = run.global_batch // layout.dp
    x, y = (t[coords["dp"] * rows:(coords["dp"] + 1) * rows] for t in (x, y))
    return tuple(shard_sequence(t, coords["cp"], layout.cp, "zigzag", dim=1) for t in (x, y))


def layout_error(layout: Layout, cfg: Cfg, global_batch: int, seq_len: int, microbatches: int,
                 world: int | None = None) -> str | None:
    """One line saying why `layout` cannot run (checked before any rank starts), else None."""
    problems = []
    if world is not None and layout.world != world:
        problems.append(f"dp*tp*pp*cp = {layout.world} != world {world}")
    if cfg.heads % layout.tp or cfg.kv_heads % layout.tp:
        problems.append(f"tp {layout.tp} must divide heads {cfg.heads} and kv heads {cfg.kv_heads}")
    if cfg.ffn % layout.tp:
        problems.append(f"tp {layout.tp} must divide ffn {cfg.ffn}")
    if cfg.layers % layout.pp:
        problems.append(f"pp {layout.pp} must divide layers {cfg.layers}")
    if microbatches < layout.pp:
        problems.append(f"1F1B needs microbatches {microbatches} >= pp {layout.pp}")
    if global_batch % (layout.dp * microbatches):
        problems.append(f"batch {global_batch} must split into dp {layout.dp} x {microbatches} "
                        f"micro-batches")
    if layout.tp_plan not in TP_PLANS:
        problems.append(f"tp plan must be one of {', '.join(TP_PLANS)}, not {layout.tp_plan!r}")
    elif seq_len % (2 * layout.cp * layout.sp):
        problems.append(f"sequence {seq_len} must split into 2 x cp {layout.cp} zigzag chunks"
                        + (f" x tp {layout.tp} sequence shards" if layout.sp > 1 else ""))
    return "; ".join(problems) or None


def make_optimizer(params, lr: float):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def reference_steps(model, opt, run: Run, steps: range) -> dict:
    """One process's steps on the whole global batch: mean cross-entropy, torch's own
    `clip_grad_norm_`, AdamW. Returns losses, pre-clip norms and the final parameters."""
    losses, norms = [], []
    for step in steps:
        x, y = batch(run, step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_norm).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def one_process(run: Run) -> dict:
    """The reference: the whole model, the whole global batch, mean cross-entropy, torch's own
    `clip_grad_norm_`, AdamW. Returns losses, pre-clip norms and the final parameters."""
    model = reference_model(run.cfg, run.seed, run.dtype)
    opt = make_optimizer(model.parameters(), run.lr)
    return reference_steps(model, opt, run, range(run.steps))


def resume_one_process(run: Run, path: str, start: int,
                       load: tuple[str, ...] = ("model", "optim")) -> dict:
    """A different world: one process, no process group, loads the composed run's DCP
    checkpoint into the whole model and AdamW and trains `run.steps` more steps from `start`.
    `load` names the parts read from the checkpoint; what it leaves out starts fresh, for the
    controls: without "model" the start weights, without "optim" a new AdamW (zero moments,
    step 0), each then trained by the same steps from `start`."""
    import torch.distributed.checkpoint as dcp

    assert set(load) <= {"model", "optim"}, load
    model = reference_model(run.cfg, run.seed, run.dtype)
    opt = make_optimizer(model.parameters(), run.lr)
    state = {}
    if "optim" in load:
        # AdamW's state exists after a first step: make it (zero gradients), then overwrite it
        # all; that step's weight decay moves the weights, so they are put back when not loaded
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        model.load_state_dict(before)
        names = {p: n for n, p in model.named_parameters()}
        state["optim"] = {"state": {names[p]: st for p, st in opt.state.items()}}
    if "model" in load:
        state["model"] = model.state_dict()
    if state:
        dcp.load(state, checkpoint_id=path, no_dist=True)
    if "model" in load:
        model.load_state_dict(state["model"])
    return reference_steps(model, opt, run, range(start, start + run.steps))


def differences(composed: dict, reference: dict) -> dict:
    """Largest differences: loss (relative), pre-clip norm (relative), parameters (absolute)."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(composed["losses"], reference["losses"]))
    norm = max(abs(a - b) / abs(b) for a, b in zip(composed["norms"], reference["norms"]))
    params = composed["params"]
    assert set(params) == set(reference["params"]), set(params) ^ set(reference["params"])
    p = max((params[k].double() - reference["params"][k].double()).abs().max().item()
            for k in params)
    return {"loss": loss, "norm": norm, "params": p}


def tolerances(run: Run) -> dict:
    """The lesson's float64 tolerances. The composed run and one process compute the same sums
    in another order (over tokens, micro-batches, dp x cp ranks, tp shards, ring blocks): a sum
    of n terms reordered moves by at most n·u times the sum of their magnitudes, u = 2^-53. The
    loss is a sum over the B·T tokens of the global batch (relative B·T·u). The squared norm is a
    sum of P squared gradient entries, regrouped by shard, slice and stage, each entry a sum over
    the tokens: relative (P + B·T)·u. A weight moves by at most η·B·T·u/ε per AdamW step (the
    chapter's first-order bound, gradients clipped to norm <= 1), k steps."""
    u = torch.finfo(run.dtype).eps / 2
    n = run.global_batch * run.seq_len
    p = sum(t.numel() for t in Llama(run.cfg).parameters())
    return {"loss": n * u, "norm": (p + n) * u, "params": run.steps * run.lr * n * u / 1e-8}
