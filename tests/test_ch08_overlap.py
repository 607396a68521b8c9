"""Chapter 08: naive, hand-bucketed and DDP data parallelism give one process's parameters, and
the bucketed all-reduces are launched while backward is still running.

The torchrun run checks itself (summary.json); this module recomputes the one-process reference
with its own plain loop, reads the run's event logs and profiler traces, and runs the negative
controls on two gloo ranks: a bucket never all-reduced, an optimizer step without the wait, and
the naive loop, which the same checks must reject.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from chapters.ch08_overlap import bucketed, train
from chapters.ch08_overlap.bucketed import BucketedDDP, EventLog
from common.checkpoint import load_checkpoint
from common.data import CharTokenizer, text_corpus, token_windows
from common.launch import run_torchrun
from common.models import GPTConfig, TinyGPT

SCRIPT = Path(train.__file__)
TOL = 1e-10  # float64: the variants differ from one process only by summation order (~1e-16)
BROKEN = 1e-6  # a real bug moves parameters by far more than this


def data(cfg: train.Config):
    """The script's global batches, rebuilt from common.data without the script's helper."""
    tok = CharTokenizer.fit(text_corpus())
    x, y = token_windows(tok.encode(text_corpus(max_chars=100_000)), cfg.block_size,
                         cfg.steps * cfg.global_batch_size, seed=cfg.seed)
    shape = (cfg.steps, cfg.global_batch_size, cfg.block_size)
    return x.view(shape), y.view(shape), tok.vocab_size


def gpt(cfg: train.Config, vocab: int, seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(vocab_size=vocab, block_size=cfg.block_size, n_layer=cfg.n_layer,
                              n_head=4, d_model=cfg.d_model)).double()
    model.pos_emb.weight.requires_grad_(False)
    return model


def reference(init: nn.Module, X, Y, steps: int, lr: float) -> nn.Module:
    """One process, the whole global batch, SGD written out by hand."""
    model = copy.deepcopy(init)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        _, loss = model(X[step], Y[step])
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= lr * g
    return model


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def overlapped(events: list[dict]) -> bool:
    """The test's own reading of an event log: some all-reduce was launched before backward
    returned, while some gradient was still to be computed."""
    end = next(e["seq"] for e in events if e["kind"] == "backward_end")
    n_grads = sum(e["kind"] == "grad" for e in events)
    return any(e["kind"] == "launch" and e["seq"] < end and e["grads_ready"] < n_grads
               for e in events)


def spans(trace: dict, name: str) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
            if e.get("name") == name and e.get("ph") == "X"]


@pytest.mark.timeout(150)
def test_run_matches_reference_and_buckets_launch_during_backward(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=120)
    assert res.summary["world_size"] == 2
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"] and c["kind"] != "timing"]
    assert not failed, res.output[-3000:]

    cfg = train.Config()
    X, Y, vocab = data(cfg)
    init = gpt(cfg, vocab, cfg.seed)
    expected = reference(init, X, Y, cfg.steps, cfg.lr).state_dict()
    saved = load_checkpoint(tmp_path / "final_params.pt")
    for name in ("single", "naive", "bucketed", "ddp"):
        assert max_diff(saved[name], expected) < TOL, name
        assert torch.equal(saved[name]["pos_emb.weight"], init.pos_emb.weight), "frozen moved"

    logs = json.loads((tmp_path / "events.json").read_text())
    assert overlapped(logs["bucketed"]) and overlapped(logs["ddp"])
    assert not overlapped(logs["naive"]), "the naive loop cannot launch before backward ends"
    end = next(e["seq"] for e in logs["naive"] if e["kind"] == "backward_end")
    assert all(e["seq"] > end for e in logs["naive"] if e["kind"] == "launch")
    # Reverse order: bucket 0 holds the last layer and is launched first; the tied embedding,
    # whose gradient is complete only when backward reaches the input, is in the last bucket.
    launches = [e["what"] for e in logs["bucketed"] if e["kind"] == "launch"]
    assert launches == [f"bucket {i}" for i in range(len(logs["buckets"]))]
    assert "ln_f.weight" in logs["buckets"][0] and "tok_emb.weight" in logs["buckets"][-1]
    names = [n for b in logs["buckets"] for n in b]
    assert len(names) == len(set(names)) == 27
    assert "head.weight" not in names and "pos_emb.weight" not in names  # tied once, frozen none

    # The profiler traces tell the same story on one thread's clock: all-reduces start inside
    # the backward span for the bucketed version, after it for the naive one.
    for kind, inside in (("naive", False), ("bucketed", True), ("ddp", True)):
        path = tmp_path / f"trace_{kind}.json.gz"
        assert path.stat().st_size < 500_000, "keep the traces small"
        trace = json.load(gzip.open(path))
        backward = spans(trace, "backward")
        starts = [s for s, _ in spans(trace, "c10d::allreduce_")]
        assert len(backward) == cfg.profile_steps and starts
        during = sum(any(b0 <= s <= b1 for b0, b1 in backward) for s in starts)
        assert (during > 0) is inside, kind

    figures = res.summary["figures"]
    for kind in train.VARIANTS:
        assert figures[f"{kind} step time"]["unit"] == "ms"
    assert any(name.startswith("bucketed step time, cap") for name in figures)  # reported only


class SkipFirstBucket(BucketedDDP):
    """Broken: bucket 0 is marked sent but never all-reduced."""

    def _launch_bucket(self, i: int) -> None:
        if i != 0:
            super()._launch_bucket(i)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 1).double(), nn.Linear(4, 1).double()

    def forward(self, x):
        return self.used(x).sum()


def train_wrapped(wrapper, model, X, Y, steps, lr, finish=True):
    """Plain SGD by hand (torch.optim would import torch._dynamo: seconds per rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        for p in model.parameters():
            p.grad = None
        _, loss = wrapper(X[step].chunk(world)[rank], Y[step].chunk(world)[rank])
        loss.backward()
        if finish:
            wrapper.finish_gradient_sync()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad


def _controls() -> dict:
    """On 2 gloo ranks: the wrapper on a tied + frozen model from DIFFERENT initial weights per
    rank, then each broken variant measured by the same parity check."""
    rank = dist.get_rank()
    cfg = train.Config(steps=3)
    X, Y, vocab = data(cfg)
    init = gpt(cfg, vocab, seed=0)  # rank 0's model: what the wrapper must broadcast
    ref = reference(init, X, Y, cfg.steps, cfg.lr).state_dict()
    ref1 = reference(init, X, Y, 1, cfg.lr).state_dict()
    out = {}

    model, events = gpt(cfg, vocab, seed=rank), EventLog()
    out["differed_before_wrap"] = max_diff(model.state_dict(), init.state_dict())
    events.watch(model)
    wrapper = BucketedDDP(model, bucket_cap_bytes=16 * 1024, events=events)
    out["frozen_broadcast"] = torch.equal(model.pos_emb.weight, init.pos_emb.weight)
    out["tied"] = model.head.weight is model.tok_emb.weight
    out["hooks"] = len(wrapper._hooks)
    out["in_buckets"] = sorted(id(p) for b in wrapper.buckets for p in b) == \
        sorted(id(p) for p in model.parameters() if p.requires_grad)
    train_wrapped(wrapper, model, X, Y, cfg.steps, cfg.lr)
    out["good"] = max_diff(model.state_dict(), ref)
    out["frozen_kept"] = torch.equal(model.pos_emb.weight, init.pos_emb.weight)
    out["grads_per_step"] = len(events.of_kind("grad"))
    out["bucketed_overlapped"] = overlapped(events.events + [{"seq": len(events.events),
                                                             "kind": "backward_end"}])

    model = gpt(cfg, vocab, seed=0)
    train_wrapped(SkipFirstBucket(model, 16 * 1024), model, X, Y, cfg.steps, cfg.lr)
    out["skip_bucket"] = max_diff(model.state_dict(), ref)

    model = gpt(cfg, vocab, seed=0)
    wrapper = BucketedDDP(model, 16 * 1024)
    train_wrapped(wrapper, model, X, Y, 1, cfg.lr, finish=False)  # step without waiting
    out["no_wait"] = max_diff(model.state_dict(), ref1)
    try:
        wrapper(X[1], Y[1])
        out["no_wait_error"] = ""
    except RuntimeError as e:
        out["no_wait_error"] = str(e)
    wrapper.finish_gradient_sync()  # drain the outstanding all-reduces on both ranks

    naive, events = gpt(cfg, vocab, seed=0), EventLog()
    events.watch(naive)
    _, loss = naive(X[0], Y[0])
    loss.backward()
    events.record("backward_end")
    train.naive_sync(naive, dist.get_world_size(), events, {"bytes": 0})
    out["naive_overlapped"] = overlapped(events.events)

    unused = WithUnused()
    wrapper = BucketedDDP(unused, bucket_cap_bytes=1)
    wrapper(torch.ones(2, 4, dtype=torch.float64)).backward()
    try:
        wrapper.finish_gradient_sync()
        out["unused_error"] = ""
    except RuntimeError as e:
        out["unused_error"] = str(e)
    return out


@pytest.mark.timeout(120)
def test_wrapper_tied_frozen_and_negative_controls():
    from common.launch import run_on_ranks

    results = run_on_ranks(_controls, 2, timeout=90)
    assert results[1]["differed_before_wrap"] > 1e-3, "rank 1 must start from other weights"
    for res in results:
        assert res["frozen_broadcast"] and res["frozen_kept"] and res["tied"]
        assert res["hooks"] == res["grads_per_step"] // 3 == 27 and res["in_buckets"]
        assert res["good"] < TOL
        assert res["bucketed_overlapped"]
        assert res["skip_bucket"] > BROKEN, "a bucket never all-reduced went unnoticed"
        assert res["no_wait"] > BROKEN, "an optimizer step before the wait went unnoticed"
        assert "finish_gradient_sync()" in res["no_wait_error"]
        assert not res["naive_overlapped"], "the ordering check must reject the naive loop"
        assert "unused.weight" in res["unused_error"] and "never became ready" in res["unused_error"]


def test_build_buckets_packs_in_reverse_order_under_the_cap():
    sizes = [10, 30, 5, 100, 20, 20]  # float32: 4 bytes per element
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    buckets = bucketed.build_buckets(params, cap_bytes=160)
    assert [[p.numel() for p in b] for b in buckets] == [[20, 20], [100], [5, 30], [10]]
    assert [p for b in buckets for p in b] == params[::-1]
    assert all(sum(p.numel() * 4 for p in b) <= 160 or len(b) == 1 for b in buckets)
    assert len(bucketed.build_buckets(params, cap_bytes=10**9)) == 1


def test_trainable_parameters_counts_a_tied_weight_once_and_skips_frozen():
    model = TinyGPT(GPTConfig(n_layer=1))
    model.pos_emb.weight.requires_grad_(False)
    params = bucketed.trainable_parameters(model)
    assert sum(p is model.tok_emb.weight for p in params) == 1
    assert all(p is not model.pos_emb.weight for p in params)


def test_bad_settings_are_refused_in_one_sentence():
    for argv in (["--bucket-kb", "0"], ["--sweep-kb", "64", "0"], ["--dtype", "float16"],
                 ["--steps", "2", "--profile-steps", "3"]):
        with pytest.raises(SystemExit) as e:
            train.parse_config(train.Config, argv)
        assert e.value.code == 2
