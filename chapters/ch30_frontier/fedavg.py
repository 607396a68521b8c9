"""Federated averaging across ranks on non-IID shards, summed by secure aggregation.

Each rank is a client holding its own shard of a procedurally generated 4-class dataset, mostly
two classes (`--skew` of its examples). Every round the clients start from the global model,
take a few local SGD steps, and the server adds the mean of their updates (McMahan et al.
2017). The updates travel as fixed-point integers modulo 2³² under pairwise masks that cancel
in the sum (secure_agg.py): one all-reduce per round, and no single client's update is ever
visible. The run checks that the masked sum equals the plain sum exactly, that a client
dropping out without the recovery step is detected, that the recovery restores the exact sum,
and that FedAvg reaches an accuracy a single client's model does not.

Run (one client per rank; two at least):
    torchrun --standalone --nproc_per_node=2 chapters/ch30_frontier/fedavg.py
    torchrun --standalone --nproc_per_node=4 chapters/ch30_frontier/fedavg.py --rounds 40
    torchrun --standalone --nproc_per_node=4 chapters/ch30_frontier/fedavg.py --clip 1 --noise-multiplier 0.2
    srun --ntasks=8 python chapters/ch30_frontier/fedavg.py
"""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from chapters.ch30_frontier import secure_agg
from common.config import RunConfig, parse_config, require_at_least_one
from common.data import classification_data
from common.distributed import reduce_number, setup_distributed, teardown_distributed
from common.log import log, progress, setup_logging
from common.models import MLP
from common.results import RunRecorder

N_CLASSES = 4


@dataclass
class Config(RunConfig):
    rounds: int = 30
    """Communication rounds (one secure all-reduce each)."""
    local_steps: int = 5
    """SGD steps each client takes per round."""
    batch_size: int = 32
    """Examples per local SGD step."""
    lr: float = 0.2
    """Learning rate of the clients' SGD."""
    shard: int = 512
    """Training examples per client."""
    features: int = 8
    """Input features of the generated data (common.data.classification_data)."""
    hidden: int = 64
    """Hidden width of the clients' MLP."""
    skew: float = 0.95
    """Fraction of a client's examples drawn from its two home classes (the rest from the others)."""
    fraction_bits: int = 16
    """Fixed-point fraction bits f: updates are rounded to multiples of 2^-f."""
    clip: float = 0.0
    """Clip each client's update to this L2 norm (0: no clipping)."""
    noise_multiplier: float = 0.0
    """Gaussian noise z: the sum of updates carries N(0, (z * clip)^2); needs --clip."""
    fedavg_accuracy: float = 0.75
    """FedAvg's global model must reach this test accuracy (the check's bound)."""
    single_accuracy: float = 0.7
    """A single client's model, trained alone as long, must stay below this (the check's bound)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least_one(self, "rounds", "local_steps", "batch_size", "shard", "features", "hidden")
        if not 0 < self.skew <= 1:
            raise ValueError(f"--skew must be in (0, 1], got {self.skew}")
        if not 1 <= self.fraction_bits <= 24:
            raise ValueError(f"--fraction-bits must be in 1..24, got {self.fraction_bits}")
        if self.noise_multiplier > 0 and self.clip <= 0:
            raise ValueError("--noise-multiplier needs --clip > 0 (the noise is scaled to the clip)")


def validate(cfg: Config, world_size: int) -> None:
    if world_size < 2:
        raise ValueError("FedAvg needs at least 2 ranks (one client each); "
                         "run it with torchrun --nproc_per_node=2")


def home_classes(rank: int) -> tuple[int, int]:
    return (2 * rank) % N_CLASSES, (2 * rank + 1) % N_CLASSES


def client_shard(X, y, rank: int, shard: int, skew: float, seed: int):
    """`shard` examples for this client: round(skew·shard) from its home classes, the rest from
    the others, drawn without replacement by a generator seeded by (seed, rank)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    home = torch.isin(y, torch.tensor(home_classes(rank)))
    n_home = round(skew * shard)
    pick = [torch.nonzero(mask).flatten() for mask in (home, ~home)]
    idx = torch.cat([p[torch.randperm(len(p), generator=g)[:n]] for p, n in zip(pick, (n_home, shard - n_home))])
    return X[idx], y[idx]


def split_data(cfg: Config, world: int):
    """One pool from common.data (one teacher): the last 1024 rows are the test set (all four classes, as the teacher labels them)."""
    X, y = classification_data(n=world * cfg.shard * 2 + 1024, d_in=cfg.features, n_classes=N_CLASSES,
                               seed=cfg.seed, dtype=torch.float64)
    return (X[:-1024], y[:-1024]), (X[-1024:], y[-1024:])


def accuracy(model, X, y) -> float:
    with torch.no_grad():
        return (model(X).argmax(1) == y).double().mean().item()


def local_train(model, X, y, steps: int, cfg: Config, g: torch.Generator) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for _ in range(steps):
        idx = torch.randint(0, len(X), (cfg.batch_size,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()


def fedavg_round(model, X, y, cfg: Config, info, round_: int, all_reduce) -> dict:
    """Local steps from the global model, then the global model moves by the securely summed
    mean of the clients' updates."""
    start = parameters_to_vector(model.parameters()).detach().clone()
    g = torch.Generator().manual_seed(cfg.seed * 7919 + round_ * 101 + info.rank)
    local_train(model, X, y, cfg.local_steps, cfg, g)
    delta = parameters_to_vector(model.parameters()).detach() - start
    delta = secure_agg.clip_and_noise(delta, cfg.clip, cfg.noise_multiplier, info.world_size, g)
    total, count, _ = secure_agg.secure_sum(delta, info.rank, info.world_size, cfg.seed, round_,
                                            cfg.fraction_bits, all_reduce, info.device)
    vector_to_parameters(start + total / count, model.parameters())
    return {"delta": delta, "count": count}


def check_masks(rec: RunRecorder, delta, cfg: Config, info) -> None:
    """Masked sum == plain sum (exact integers); a control with unpaired masks differs; a client
    dropping out without recovery is detected; the recovery restores the survivors' exact sum."""
    r, w, dev, f = info.rank, info.world_size, info.device, cfg.fraction_bits
    plain = secure_agg.plain_sum(delta, f, dev)
    counter = secure_agg.CountingAllReduce()
    args = (delta, r, w, cfg.seed, 10**6, f, counter, dev)
    _, count, masked = secure_agg.secure_sum(*args)
    rec.check("masked sum == plain sum (integers mod 2^32, elements differing)", "parity",
              int((masked != plain).sum()), 0)
    rec.check("clients counted in slot 0 (masks cancelled)", "count", count, w)
    exact = delta.to(dev).clone()
    torch.distributed.all_reduce(exact)  # diagnostic: the float sum the fixed point approximates
    error = (secure_agg.decode(masked[1:], f) - exact.cpu()).abs().max().item() / w
    # each client rounds to the 2^-f grid (error <= 2^-(f+1)), so the mean's error is at most that,
    # plus the float sum's own rounding (a few ulps of values below 1: 1e-15 covers it)
    rec.check("decoded mean - float mean, max |.| (bound 2^-(f+1))", "parity", error, 0.0,
              tolerance=2.0 ** -(f + 1) + 1e-15)
    wrong = (secure_agg.decode(masked[1:], f - 1) - exact.cpu()).abs().max().item() / w
    rec.check("control: decoded with f-1 bits, max |.|", "parity", wrong, 2.0 ** -(f + 1), compare=">")
    _, _, broken = secure_agg.secure_sum(*args, pairwise=False)
    rec.check("control: unpaired masks, elements differing from the plain sum", "parity",
              int((broken != plain).sum()), 1, compare=">=")
    dropped = w - 1
    survivors = secure_agg.plain_sum(delta, f, dev, include=r != dropped)
    calls = counter.calls
    _, seen, _ = secure_agg.secure_sum(*args, dropped=dropped)
    rec.check("client dropped, no recovery: detected (slot 0 != survivors)", "count",
              int(seen != w - 1), 1)
    rec.figure("slot 0 after a dropout without recovery", seen, w - 1)
    one_round = counter.calls - calls
    calls = counter.calls
    _, seen, fixed = secure_agg.secure_sum(*args, dropped=dropped, recover=True)
    rec.check("client dropped, recovered: sum == survivors' plain sum (elements differing)", "parity",
              int((fixed != survivors).sum()) + int(seen != w - 1), 0)
    rec.check("all-reduces in a round with a dropout and recovery (the counter counts)", "count",
              counter.calls - calls, 2)
    rec.check("all-reduces in a round without recovery", "count", one_round, 1)


def single_client_accuracy(X, y, Xt, yt, cfg: Config, rank: int) -> float:
    """The control: this client's model trained alone for as many steps as FedAvg took."""
    torch.manual_seed(cfg.seed)
    model = MLP(cfg.features, cfg.hidden, N_CLASSES, n_layers=2).double()
    local_train(model, X, y, cfg.rounds * cfg.local_steps, cfg,
                torch.Generator().manual_seed(cfg.seed * 7919 + rank))
    return accuracy(model, Xt, yt)


def central_accuracy(X, y, Xt, yt, cfg: Config, world: int) -> float:
    """For comparison: one model trained on the union of every client's shard, as long."""
    shards = [client_shard(X, y, r, cfg.shard, cfg.skew, cfg.seed) for r in range(world)]
    return single_client_accuracy(torch.cat([a for a, _ in shards]), torch.cat([b for _, b in shards]),
                                  Xt, yt, cfg, 0)


def main(cfg: Config) -> int:
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        (X, y), (Xt, yt) = split_data(cfg, info.world_size)
        Xc, yc = client_shard(X, y, info.rank, cfg.shard, cfg.skew, cfg.seed)
        log.info("%d clients, %d examples each, %.0f%% from two home classes (client 0: %s)",
                 info.world_size, cfg.shard, 100 * cfg.skew, home_classes(0))
        torch.manual_seed(cfg.seed)  # every client starts from the same global model
        model = MLP(cfg.features, cfg.hidden, N_CLASSES, n_layers=2).double()
        rounds = secure_agg.CountingAllReduce()
        for round_ in progress(range(cfg.rounds), total=cfg.rounds, desc="rounds"):
            out = fedavg_round(model, Xc, yc, cfg, info, round_, rounds)
            acc = accuracy(model, Xt, yt)
            rec.metrics(round_, loss=F.cross_entropy(model(Xt), yt).item(), lr=cfg.lr,
                        test_accuracy=acc, clients=out["count"])
            if round_ % cfg.log_every == 0 or round_ == cfg.rounds - 1:
                log.info("round %3d  test accuracy %.3f", round_, acc)
        rec.check("all-reduces, one per round", "count", rounds.calls, cfg.rounds)
        numel = sum(p.numel() for p in model.parameters())
        rec.check("bytes handed to all-reduce per round per client", "formula",
                  rounds.bytes // cfg.rounds, 8 * (numel + 1))
        fed = accuracy(model, Xt, yt)
        single = single_client_accuracy(Xc, yc, Xt, yt, cfg, info.rank)
        best_single = reduce_number(single, "max")
        rec.figure("one process on every shard, as many steps: test accuracy",
                   round(central_accuracy(X, y, Xt, yt, cfg, info.world_size), 4))
        rec.check("FedAvg test accuracy", "formula", round(fed, 4), cfg.fedavg_accuracy, compare=">=")
        rec.check("best single client's test accuracy (trained alone as long)", "formula",
                  round(best_single, 4), cfg.single_accuracy, compare="<")
        check_masks(rec, out["delta"], cfg, info)
        return rec.finish()
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
