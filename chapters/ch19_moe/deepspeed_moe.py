"""DeepSpeed-MoE: the production MoE layer, checked against the hand-written one and trained with ZeRO.

`deepspeed.moe.layer.MoE` is a router (its "gate") plus `num_experts / ep_size` local experts; it
dispatches with `all_to_all_single` on a padded (experts × capacity × d) buffer. This script copies
the hand-written layer's weights into it and compares outputs, balancing loss and counts, checks
that its capacity rule keeps the same tokens as ours, counts the bytes it hands to all-to-all,
then trains train.py's MoE TinyGPT with DeepSpeed's engine at each ZeRO stage asked for (0-2:
ZeRO-3 refuses MoE) and compares it with one process. Needs `pip install deepspeed==0.19.8`
(CPU works; the first run compiles a small communication op, about a minute, cached).

Run (experts = --experts-per-rank x world size, expert-parallel over every rank):
    torchrun --standalone --nproc_per_node=2 chapters/ch19_moe/deepspeed_moe.py
    torchrun --standalone --nproc_per_node=3 chapters/ch19_moe/deepspeed_moe.py --stages 2
    torchrun --standalone --nproc_per_node=8 chapters/ch19_moe/deepspeed_moe.py   # 8 GPUs
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from chapters.ch19_moe import checks, train
from chapters.ch19_moe.moe import Expert, MoELayer, capacity
from chapters.ch19_moe.moe_gpt import MoEGPT
from common.config import parse_config
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import init_deepspeed, library_output, log, progress, setup_logging
from common.results import RunRecorder
from common.seed import seed_everything


@dataclass
class Config(train.Config):
    steps: int = 4
    """SGD steps of the MoE TinyGPT per ZeRO stage."""
    stages: list[int] = field(default_factory=lambda: [0, 1, 2])
    """DeepSpeed ZeRO stages to train, one after another (0, 1 or 2: ZeRO-3 refuses MoE)."""
    dtype: str = "float32"
    """DeepSpeed's gate computes in float32: the comparison is float32 (tolerance: see the lesson)."""
    z_weight: float = 0.0
    """DeepSpeed's MoE has no z-loss: both sides train without it."""
    capacity_factor: float = 1.0
    """Capacity factor of the layer check with drops (training runs without drops, see the lesson)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.stages or any(s not in (0, 1, 2) for s in self.stages):
            raise ValueError(f"--stages must be among 0 1 2 (ZeRO-3 refuses MoE), got {self.stages}")
        if self.dtype != "float32":
            raise ValueError("DeepSpeed's gate computes in float32: use --dtype float32")


validate = train.validate
# one layer in float32: sums of at most d_ff = 64 terms of size ≤ 8, u = 2⁻²⁴: 64 · 6e-8 · 8 ≈ 3e-5
LAYER_TOLERANCE = 3e-5


class DSMoE(nn.Module):
    """deepspeed.moe.layer.MoE behind the hand layer's interface (aux_loss, z_loss attributes)."""

    def __init__(self, d_model, d_ff, n_experts, k, capacity_factor, ep_size):
        super().__init__()
        from deepspeed.moe.layer import MoE

        with library_output():  # it logs its creation
            self.moe = MoE(hidden_size=d_model, expert=Expert(d_model, d_ff), num_experts=n_experts,
                           ep_size=ep_size, k=k, capacity_factor=capacity_factor, min_capacity=0,
                           drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False)
        self.z_loss = torch.zeros(())

    def forward(self, x):
        y, self.aux_loss, self.counts = self.moe(x)
        return y


def copy_from_hand(ds: DSMoE, hand: MoELayer, rank: int, world: int) -> None:
    """The hand layer's router and this rank's experts into DeepSpeed's layer."""
    m = len(ds.moe.deepspeed_moe.experts.deepspeed_experts)
    with torch.no_grad():
        ds.moe.deepspeed_moe.gate.wg.weight.copy_(hand.router.weight)
        for i, expert in enumerate(ds.moe.deepspeed_moe.experts.deepspeed_experts):
            expert.load_state_dict(hand.experts[rank * m + i].state_dict())


class CountAllToAll:
    """Bytes DeepSpeed hands to all_to_all_single (it calls deepspeed.comm's)."""

    def __enter__(self):
        import deepspeed.moe.sharded_moe as sm

        self.module, self.original, self.bytes, self.calls = sm.dist, sm.dist.all_to_all_single, 0, 0

        def counted(output, tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            self.calls += 1
            return self.original(output, tensor, *args, **kwargs)

        self.module.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        self.module.all_to_all_single = self.original


def layer_checks(rec: RunRecorder, cfg: Config, info) -> None:
    """DeepSpeed's layer against the hand-written one on this rank's tokens (one routing group per
    rank, as DeepSpeed routes), with no drops (capacity ≥ tokens) and with the default capacity."""
    rank, world, dev = info.rank, info.world_size, info.device
    E, n, k, d = cfg.experts_per_rank * world, cfg.layer_tokens, cfg.top_k, cfg.d_model
    g = torch.Generator().manual_seed(cfg.seed + 20)
    X = torch.randn(world * n, d, generator=g).to(dev)
    x = X[rank * n:(rank + 1) * n]
    for name, factor in (("no drops", E / k), ("drops", cfg.capacity_factor)):
        torch.manual_seed(cfg.seed + 21)
        hand = MoELayer(d, cfg.d_ff, E, k, factor, groups=world).to(dev)
        ds = DSMoE(d, cfg.d_ff, E, k, factor, world).to(dev)
        with library_output():  # it prints the expert-parallel group it creates
            ds.moe.set_deepspeed_parallelism()
        copy_from_hand(ds, hand, rank, world)
        with torch.no_grad(), CountAllToAll() as counter:
            y_ref, y = hand(X)[rank * n:(rank + 1) * n], ds(x)
        r = hand.stats.routings[rank]
        if name == "no drops":
            rec.check(f"DeepSpeed top-{k}, {name}: output == hand layer", "parity",
                      reduce_number((y - y_ref).abs().max(), "max"), 0.0, tolerance=LAYER_TOLERANCE)
            rec.check(f"DeepSpeed top-{k}: balancing loss == hand layer", "parity",
                      reduce_number(abs(ds.aux_loss.item() - r.aux_loss.item()), "max"), 0.0, tolerance=LAYER_TOLERANCE)
            rec.check(f"DeepSpeed top-{k}: choices routed per expert == hand layer", "count",
                      ds.counts.tolist(), r.routed.tolist())
        else:
            out = ds.moe.deepspeed_moe.gate(x, None, True)  # sparse routes: a dropped choice is -1
            theirs = out[3].long().view(k, n).t()
            ours = torch.where(r.keep, r.experts, -1)
            rec.check(f"DeepSpeed top-{k}, {name}: (token, choice) pairs kept differently from our rule",
                      "count", reduce_number(int((theirs != ours).sum())), 0)
            rec.check(f"DeepSpeed top-{k}, {name}: choices dropped == ours (sibling: the rule dropped some)",
                      "count", reduce_number(int((theirs < 0).sum())), reduce_number(int((~r.keep).sum())))
            if k == 2:  # DeepSpeed renormalises the gates over the KEPT choices: 1 when one is dropped
                differ = (y - y_ref).abs().amax(1) > LAYER_TOLERANCE
                one_dropped = r.keep.sum(1) == 1
                rec.check("DeepSpeed top-2, drops: tokens whose output differs from ours == tokens with "
                          "one choice dropped", "count", reduce_number(int((differ != one_dropped).sum())), 0)
                rec.check("DeepSpeed top-2, drops: tokens with one choice dropped (sibling: > 0)", "count",
                          reduce_number(int(one_dropped.sum())), 0, compare=">")
            C = capacity(n, E, k, factor)
            rec.check(f"DeepSpeed top-{k}, {name}: bytes to all_to_all = 2·E·C·d·b (padded)",
                      "formula", counter.bytes, 2 * E * C * d * 4 if world > 1 else 0)
            rec.figure(f"DeepSpeed top-{k}: rows per all_to_all, padded E·C (the hand layer's: kept)",
                       [E * C, int(r.kept.sum())], unit="rows")


def ds_config(stage: int, micro_batch_size: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


def train_deepspeed(stage: int, cfg: Config, batches, info, state: dict) -> dict:
    """The MoE TinyGPT with DeepSpeed's MoE layers and engine; returns losses and parameters."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    world, E = info.world_size, cfg.experts_per_rank * info.world_size
    model = MoEGPT(train.gpt_config(cfg, batches[2]), cfg.d_ff, E, cfg.top_k, cfg.capacity_factor, "local")
    for i, block in enumerate(model.blocks):
        hand = block.moe
        hand.load_state_dict({k.split(".moe.", 1)[1]: v for k, v in state.items() if k.startswith(f"blocks.{i}.moe.")})
        block.moe = DSMoE(cfg.d_model, cfg.d_ff, E, cfg.top_k, cfg.capacity_factor, world)
        copy_from_hand(block.moe, hand, info.rank, world)
    model.load_state_dict({k: v for k, v in state.items() if ".moe." not in k}, strict=False)
    model.to(info.device)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    opt = torch.optim.SGD(groups, lr=cfg.lr)
    with library_output():  # DeepSpeed prints its configuration
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, cfg.micro_batch_size))
    X, Y, _ = batches
    m, losses = cfg.micro_batch_size, []
    for step in range(cfg.steps):
        x, y = (t[step, info.rank * m:(info.rank + 1) * m].to(info.device) for t in (X, Y))
        loss, _ = engine(x, y, cfg.aux_weight, 0.0)
        engine.backward(loss)
        engine.step()
        losses.append(reduce_number(loss.detach()) / world)
    whole = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": whole}


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        deepspeed = init_deepspeed(info)  # its start-up noise goes to the library log
        rec = RunRecorder(cfg, __file__, info)
        world, E = info.world_size, cfg.experts_per_rank * info.world_size
        log.info("DeepSpeed %s: %d experts, %d per rank, top-%d", deepspeed.__version__, E,
                 cfg.experts_per_rank, cfg.top_k)
        layer_checks(rec, cfg, info)
        batches = train.make_batches(cfg, world)
        seed_everything(cfg.seed)
        no_drop = E / cfg.top_k  # DeepSpeed renormalises top-2 gates over the kept choices only
        tcfg = Config(**{**vars(cfg), "capacity_factor": no_drop})
        ref = MoEGPT(train.gpt_config(cfg, batches[2]), cfg.d_ff, E, cfg.top_k, no_drop, "local", groups=world)
        ref.to(info.device)
        state = {k: v.clone() for k, v in ref.state_dict().items()}
        ref_run = train.train(ref, batches, tcfg, info, expert_parallel=False)
        mine = {n: p for n, p in ref.named_parameters() if ".experts." not in n}
        m = cfg.experts_per_rank
        for n, p in ref.named_parameters():  # this rank's experts, under DeepSpeed's names
            if ".experts." in n:
                head, rest = n.split(".experts.")
                e, tail = rest.split(".", 1)
                if int(e) // m == info.rank:
                    mine[f"{head}.moe.deepspeed_moe.experts.deepspeed_experts.{int(e) % m}.{tail}"] = p
        mine = {n.replace(".moe.router.", ".moe.moe.deepspeed_moe.gate.wg."): p for n, p in mine.items()}
        for stage in progress(cfg.stages, len(cfg.stages), "DeepSpeed ZeRO stages trained", info.is_main, 1):
            got = train_deepspeed(stage, tcfg, batches, info, state)
            rec.check(f"DeepSpeed ZeRO-{stage} MoE TinyGPT: losses == one process", "parity",
                      max(abs(a - b) for a, b in zip(got["losses"], ref_run["loss"])), 0.0, tolerance=checks.TOLERANCE["float32"])
            diff = max((got["params"][n] - p).abs().max().item() for n, p in mine.items())
            rec.check(f"DeepSpeed ZeRO-{stage}: trained parameters == one process", "parity",
                      reduce_number(diff, "max"), 0.0, tolerance=checks.TOLERANCE["float32"])
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
