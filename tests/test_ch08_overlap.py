"""Chapter 08: naive, deferred-bucket, hand-bucketed and DDP data parallelism give one process's
parameters; the bucketed all-reduces are launched, and complete, while backward is still running.

The torchrun run checks itself (summary.json); this module recomputes the one-process reference
with its own plain loop, reads the run's event logs and profiler traces step by step, and runs
the negative controls on two gloo ranks: a bucket never all-reduced, an optimizer step without
the wait, the naive loop, a wrapper that launches its buckets only after backward, and one that
launches them during backward but waits for each inside its hook (launched early, never
overlapped), which the same checks must reject.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from chapters.ch08_overlap import bucketed, checks, instruments, train
from chapters.ch08_overlap.bucketed import BucketedDDP, EventLog
from common import distributed as common_distributed
from common.checkpoint import load_checkpoint
from common.data import CharTokenizer, text_corpus, token_windows
from common.launch import run_torchrun
from common.models import GPTConfig, TinyGPT

SCRIPT = Path(train.__file__)
TOL = 1e-10  # float64: the variants differ from one process only by summation order (~1e-16)
BROKEN = 1e-6  # a real bug moves parameters by far more than this


def data(cfg: train.Config, world: int):
    """The script's global batches, rebuilt from common.data without the script's helper."""
    batch = cfg.micro_batch_size * world
    tok = CharTokenizer.fit(text_corpus())
    x, y = token_windows(tok.encode(text_corpus(max_chars=100_000)), cfg.block_size,
                         cfg.steps * batch, seed=cfg.seed)
    shape = (cfg.steps, batch, cfg.block_size)
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


def backward_end(events: list[dict]) -> int:
    ends = [e["seq"] for e in events if e["kind"] == "backward_end"]
    assert len(ends) == 1, "one step's log holds exactly one end of backward"
    return ends[0]


def overlapped(events: list[dict]) -> bool:
    """The test's own reading of ONE step's event log: some all-reduce was launched before
    backward ended, while some gradient was still to be computed."""
    end = backward_end(events)
    n_grads = sum(e["kind"] == "grad" for e in events)
    return any(e["kind"] == "launch" and e["seq"] < end and e["grads_ready"] < n_grads
               for e in events)


def hidden(events: list[dict]) -> int:
    """The test's own reading of completion in ONE step's log: all-reduces launched, then at
    least one more gradient produced, then seen complete, all before backward ended (in flight
    while backward computed, and finished inside it)."""
    end = backward_end(events)
    launch = {e["what"]: e["seq"] for e in events if e["kind"] == "launch"}
    grads = [e["seq"] for e in events if e["kind"] == "grad"]
    done = [e for e in events if e["kind"] == "done" and e["seq"] < end]
    return sum(any(launch[e["what"]] < g < e["seq"] for g in grads) for e in done)


def spans(trace: dict, name: str) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
            if e.get("name") == name and e.get("ph") == "X"]


@pytest.mark.timeout(180)
def test_run_matches_reference_and_buckets_launch_during_backward(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=160)
    assert res.summary["world_size"] == 2
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"] and c["kind"] != "timing"]
    assert not failed, res.output[-3000:]

    cfg = train.Config()
    X, Y, vocab = data(cfg, 2)
    init = gpt(cfg, vocab, cfg.seed)
    expected = reference(init, X, Y, cfg.steps, cfg.lr).state_dict()
    saved = load_checkpoint(tmp_path / "final_params.pt")
    for name in ("single", *train.VARIANTS):
        assert max_diff(saved[name], expected) < TOL, name
        assert torch.equal(saved[name]["pos_emb.weight"], init.pos_emb.weight), "frozen moved"

    logs = json.loads((tmp_path / "events.json").read_text())
    assert overlapped(logs["bucketed"]) and overlapped(logs["ddp"])
    assert not overlapped(logs["naive"]), "the naive loop cannot launch before backward ends"
    assert not overlapped(logs["deferred"]), "the deferred buckets go after backward"
    for kind in ("naive", "deferred"):  # and its launches are really there, after the end
        end = backward_end(logs[kind])
        assert all(e["seq"] > end for e in logs[kind] if e["kind"] == "launch")
        assert hidden(logs[kind]) == 0
    # the script counts what this module reads in the same log (rank 0's last step)
    assert res.summary["figures"]["bucketed: hidden under backward, rank 0's steps"]["measured"][-1] \
        == hidden(logs["bucketed"])
    # DDP's first step: one bucket (find_unused_parameters=False); later steps: several
    assert sum(e["kind"] == "launch" for e in logs["ddp_first_step"]) == 1
    assert sum(e["kind"] == "launch" for e in logs["ddp"]) > 1
    # Reverse order: the launches carry the buckets' bytes in bucket order, bucket 0 holding the
    # last layer; the tied embedding, whose gradient is complete only when backward reaches the
    # input, is in the last bucket. Bytes are the sizes of the model's own parameters.
    shapes = dict(init.named_parameters())
    sizes = [sum(shapes[n].numel() * 8 for n in b) for b in logs["buckets"]]
    for kind in ("bucketed", "deferred"):
        assert [e["bytes"] for e in logs[kind] if e["kind"] == "launch"] == sizes, kind
    assert [e["bytes"] for e in logs["naive"] if e["kind"] == "launch"] == \
        [p.numel() * 8 for p in init.parameters() if p.requires_grad]
    assert "ln_f.weight" in logs["buckets"][0] and "tok_emb.weight" in logs["buckets"][-1]
    names = [n for b in logs["buckets"] for n in b]
    assert len(names) == len(set(names)) == 27
    assert "head.weight" not in names and "pos_emb.weight" not in names  # tied once, frozen none

    # The profiler traces tell the same story on one thread's clock: all-reduces start inside
    # the backward span for the overlapped versions, after it for the others.
    for kind, inside in (("naive", False), ("deferred", False), ("bucketed", True), ("ddp", True)):
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
        fig = figures[f"{kind} step time (median, min-max)"]
        assert fig["unit"] == "ms" and fig["spread"][0] <= fig["measured"] <= fig["spread"][1]
    assert any(name.startswith("bucketed step time, cap") for name in figures)  # reported only
    assert res.check("bucketed / deferred step time (overlap alone)")["kind"] == "timing"


class SkipFirstBucket(BucketedDDP):
    """Broken: bucket 0 is marked sent but never all-reduced."""

    def _launch_bucket(self, i: int) -> None:
        if i != 0:
            super()._launch_bucket(i)


class WaitInHook(BucketedDDP):
    """Broken: launches each bucket during backward, then waits for it inside the same hook, so
    backward stands still while it travels. Launch order looks overlapped; nothing is hidden."""

    def _launch_bucket(self, i: int) -> None:
        super()._launch_bucket(i)
        self._works[-1][2].wait()


class NoSyncBucketedDDP(BucketedDDP):
    """Exercise 3's worked answer: `no_sync()` for gradient accumulation. Inside it the hooks do
    nothing and the gradients accumulate in .grad; the next backward launches the buckets."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sync = True

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _grad_ready(self, p):
        if self._sync:
            super()._grad_ready(p)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 1).double(), nn.Linear(4, 1).double()

    def forward(self, x):
        return self.used(x).sum()


def train_wrapped(wrapper, model, X, Y, steps, lr, finish=True, events: EventLog | None = None):
    """Plain SGD by hand (torch.optim would import torch._dynamo: seconds per rank). Returns the
    event log of every step when `events` watches the model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    logs = []
    with events.observe_all_reduce() if events else _nothing():
        for step in range(steps):
            if events:
                events.start_step()
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
            if events:
                events.poll()
                logs.append(events.events)
    return logs


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _controls() -> dict:
    """On 2 gloo ranks: the wrapper on a tied + frozen model from DIFFERENT initial weights per
    rank, the deferred control, the sleep demonstration, then each broken variant measured by
    the same checks."""
    rank = dist.get_rank()
    cfg = train.Config(steps=3)
    X, Y, vocab = data(cfg, 2)
    init = gpt(cfg, vocab, seed=0)  # rank 0's model: what the wrapper must broadcast
    ref = reference(init, X, Y, cfg.steps, cfg.lr).state_dict()
    ref1 = reference(init, X, Y, 1, cfg.lr).state_dict()
    out = {}

    for overlap in (True, False):
        model, events = gpt(cfg, vocab, seed=rank), EventLog()
        out[f"differed_before_wrap_{overlap}"] = max_diff(model.state_dict(), init.state_dict())
        events.watch(model)
        wrapper = BucketedDDP(model, bucket_cap_mb=16 / 1024, overlap=overlap)
        events.watch_wrapper(model)
        out[f"frozen_broadcast_{overlap}"] = torch.equal(model.pos_emb.weight, init.pos_emb.weight)
        out["tied"] = model.head.weight is model.tok_emb.weight
        out["hooks"] = len(wrapper._hooks)
        out["in_buckets"] = sorted(id(p) for b in wrapper.buckets for p in b) == \
            sorted(id(p) for p in model.parameters() if p.requires_grad)
        params = [p for p in model.parameters() if p.requires_grad]
        out["same_buckets_as_16384_bytes"] = [[id(p) for p in b] for b in wrapper.buckets] == \
            [[id(p) for p in b] for b in bucketed.build_buckets(params, 16384)]
        logs = train_wrapped(wrapper, model, X, Y, cfg.steps, cfg.lr, events=events)
        out[f"good_{overlap}"] = max_diff(model.state_dict(), ref)
        out[f"frozen_kept_{overlap}"] = torch.equal(model.pos_emb.weight, init.pos_emb.weight)
        out[f"grads_per_step_{overlap}"] = [sum(e["kind"] == "grad" for e in log) for log in logs]
        out[f"overlapped_{overlap}"] = [overlapped(log) for log in logs]
        out[f"launches_{overlap}"] = [sum(e["kind"] == "launch" for e in log) for log in logs]
        out[f"hidden_{overlap}"] = [hidden(log) for log in logs]
        out["n_buckets"] = len(wrapper.buckets)

    # With a fixed sleep in each block's backward (the CPU stays free, as while a GPU computes),
    # the early buckets finish while backward still runs; the deferred ones cannot, and a
    # wrapper that waits inside its hook finishes them while backward stands still.
    for kind, cls, overlap in (("True", BucketedDDP, True), ("False", BucketedDDP, False),
                               ("wait_in_hook", WaitInHook, True)):
        model, events = gpt(cfg, vocab, seed=0), EventLog()
        instruments.add_backward_sleep(model, 20.0)
        events.watch(model)
        wrapper = cls(model, 16 / 1024, overlap=overlap)
        events.watch_wrapper(model)
        logs = train_wrapped(wrapper, model, X, Y, cfg.steps, cfg.lr, events=events)
        out[f"sleep_hidden_{kind}"] = [hidden(log) for log in logs]
        out[f"sleep_overlapped_{kind}"] = [overlapped(log) for log in logs]
        out[f"sleep_launches_{kind}"] = [sum(e["kind"] == "launch" for e in log) for log in logs]
        out[f"sleep_good_{kind}"] = max_diff(model.state_dict(), ref)

    # Exercise 3: accumulation over 3 micro-batches with no_sync() equals one process.
    model, events = gpt(cfg, vocab, seed=0), EventLog()
    events.watch(model)
    wrapper, k, launches = NoSyncBucketedDDP(model, 16 / 1024), 3, []
    with events.observe_all_reduce():
        for step in range(cfg.steps):
            events.start_step()
            for p in model.parameters():
                p.grad = None
            xs, ys = (t[step].chunk(2)[rank].chunk(k) for t in (X, Y))
            for i in range(k):
                with wrapper.no_sync() if i < k - 1 else contextlib.nullcontext():
                    _, loss = wrapper(xs[i], ys[i])
                    (loss / k).backward()
            wrapper.finish_gradient_sync()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= cfg.lr * p.grad
            launches.append(sum(e["kind"] == "launch" for e in events.events))
    out["no_sync_good"] = max_diff(model.state_dict(), ref)
    out["no_sync_launches"] = launches

    model = gpt(cfg, vocab, seed=0)
    train_wrapped(SkipFirstBucket(model, 16 / 1024), model, X, Y, cfg.steps, cfg.lr)
    out["skip_bucket"] = max_diff(model.state_dict(), ref)

    model = gpt(cfg, vocab, seed=0)
    wrapper = BucketedDDP(model, 16 / 1024)
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
    with events.observe_all_reduce():
        events.start_step()
        _, loss = naive(X[0], Y[0])
        loss.backward()
        train.all_reduce_gradients(naive, dist.get_world_size())
        events.poll()
    out["naive_overlapped"] = overlapped(events.events)
    out["naive_launches"] = sum(e["kind"] == "launch" for e in events.events)

    # DDP: its rebuilt layout, predicted from the gradients' arrival order, is the one DDP
    # reports; and the first step used one bucket.
    model, events = gpt(cfg, vocab, seed=0), EventLog()
    events.watch(model)
    ddp, _ = train.wrap("ddp", model, 16, type("I", (), {"device": torch.device("cpu"), "world_size": 2}))
    logs = []
    with events.observe_all_reduce():
        for step in range(3):  # DDP fills its logging data from the third step on
            events.start_step()
            _, loss = ddp(X[step].chunk(2)[rank], Y[step].chunk(2)[rank])
            loss.backward()
            events.poll()
            logs.append(events.events)
    out["ddp_launches"] = [sum(e["kind"] == "launch" for e in log) for log in logs]
    out["ddp_predicted"] = checks.ddp_rebuilt_bucket_count(logs[0], model, 16)
    out["ddp_reported"] = len(ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "").split(","))
    out["ddp_overlapped"] = overlapped(logs[1])

    unused = WithUnused()
    wrapper = BucketedDDP(unused, bucket_cap_mb=1 / 2**20)  # one byte: a bucket per tensor
    wrapper(torch.ones(2, 4, dtype=torch.float64)).backward()
    try:
        wrapper.finish_gradient_sync()
        out["unused_error"] = ""
    except RuntimeError as e:
        out["unused_error"] = str(e)
    return out


@pytest.mark.timeout(150)
def test_wrapper_tied_frozen_overlap_and_negative_controls():
    from common.launch import run_on_ranks

    results = run_on_ranks(_controls, 2, timeout=120)
    assert results[1]["differed_before_wrap_True"] > 1e-3, "rank 1 must start from other weights"
    for res in results:
        for overlap in (True, False):
            assert res[f"frozen_broadcast_{overlap}"] and res[f"frozen_kept_{overlap}"]
            assert res[f"good_{overlap}"] < TOL and res[f"sleep_good_{overlap}"] < TOL
            assert res[f"grads_per_step_{overlap}"] == [27, 27, 27]
            assert res[f"launches_{overlap}"] == [res["n_buckets"]] * 3  # the counter counts
        assert res["tied"] and res["hooks"] == 27 and res["in_buckets"]
        assert res["same_buckets_as_16384_bytes"], "16/1024 MiB must be exactly 16384 bytes"
        # judged step by step, on the real end of backward
        assert res["overlapped_True"] == [True, True, True]
        assert res["overlapped_False"] == [False, False, False], "deferred launches judged overlapped"
        assert res["hidden_False"] == [0, 0, 0] == res["sleep_hidden_False"]
        # completion, not only launch: with backward busy (sleeping) the early buckets finish
        # inside it, on every rank, in most steps (a fixed-sleep mechanism; see DESIGN.md)
        assert sum(d > 0 for d in res["sleep_hidden_True"]) >= 2, res["sleep_hidden_True"]
        # waiting inside the hook: launched during backward on every step (the launch check is
        # fooled) and the sum is right, but nothing is ever hidden (the completion check is not)
        assert res["sleep_overlapped_wait_in_hook"] == [True, True, True]
        assert res["sleep_launches_wait_in_hook"] == [res["n_buckets"]] * 3
        assert res["sleep_good_wait_in_hook"] < TOL
        assert res["sleep_hidden_wait_in_hook"] == [0, 0, 0], res["sleep_hidden_wait_in_hook"]
        assert res["no_sync_good"] < TOL and res["no_sync_launches"] == [res["n_buckets"]] * 3
        assert res["skip_bucket"] > BROKEN, "a bucket never all-reduced went unnoticed"
        assert res["no_wait"] > BROKEN, "an optimizer step before the wait went unnoticed"
        assert "finish_gradient_sync()" in res["no_wait_error"]
        assert not res["naive_overlapped"], "the ordering check must reject the naive loop"
        assert res["naive_launches"] == 27, "the observer sees chapter 03's all-reduces"
        assert res["ddp_launches"][0] == 1
        assert res["ddp_launches"][1] == res["ddp_launches"][2] == res["ddp_predicted"] > 1
        assert res["ddp_predicted"] == res["ddp_reported"]
        assert res["ddp_overlapped"]
        assert "unused.weight" in res["unused_error"] and "never became ready" in res["unused_error"]


def test_build_buckets_packs_in_reverse_order_under_the_cap():
    sizes = [10, 30, 5, 100, 20, 20]  # float32: 4 bytes per element
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    buckets = bucketed.build_buckets(params, cap_bytes=160)
    assert [[p.numel() for p in b] for b in buckets] == [[20, 20], [100], [5, 30], [10]]
    assert [p for b in buckets for p in b] == params[::-1]
    assert all(sum(p.numel() * 4 for p in b) <= 160 or len(b) == 1 for b in buckets)
    assert len(bucketed.build_buckets(params, cap_bytes=10**9)) == 1
    # MiB as DDP reads bucket_cap_mb: int(mb * 1024 * 1024), fractions included
    for mb, nbytes in ((25, 25 * 2**20), (16 / 1024, 16384), (0.0625, 65536), (1 / 3, 349525)):
        assert bucketed.cap_bytes_of(mb) == nbytes


def test_shared_helpers_come_from_common():
    """Written once: ch08 uses common's helpers and keeps no copies of its own."""
    assert bucketed.trainable_params is common_distributed.trainable_params
    assert bucketed.broadcast_from_rank0 is common_distributed.broadcast_from_rank0
    assert not hasattr(bucketed, "trainable_parameters")
    assert "def broadcast_from_rank0" not in Path(bucketed.__file__).read_text()


def test_bad_settings_are_refused_in_one_sentence():
    for argv in (["--bucket-kb", "0"], ["--sweep-kb", "64", "0"], ["--dtype", "float16"],
                 ["--steps", "2", "--profile-steps", "3"], ["--micro-batch-size", "0"],
                 ["--backward-sleep-ms", "-1"]):
        with pytest.raises(SystemExit) as e:
            train.parse_config(train.Config, argv)
        assert e.value.code == 2
    for world in (1, 2, 3, 4, 8, 16):  # a per-rank batch: every world is valid
        train.validate(train.Config(), world)
