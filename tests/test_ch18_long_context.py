"""Chapter 18: ring attention and Ulysses == full attention; sequence-parallel TinyGPT == one process.

The torchrun run checks itself (summary.json); this module computes its references itself:
attention as softmax(QKᵀ/√D)·V written out here (with its own causal mask and autograd), the
sharded results reassembled by its own code, the byte and chunk-product formulas by brute
force, and the one-process TinyGPT trained by its own SGD loop. On 2 and 4 gloo ranks (one start
each) it checks every method causal and not, the counted bytes and products, the activation
bytes per rank, both sequence-parallel trainings, and the negative controls. On the same ranks it
also checks the smallest layout allowed (two tokens and one head per rank), that impossible
layouts are refused on every rank before any message is sent, and how many score-sized
temporaries ring attention holds at once (a live-tensor count), which the lesson's memory budget
uses.
"""

from __future__ import annotations

import math
import types
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from chapters.ch18_long_context import layouts, parity, ring, timeline, train, ulysses
from common.checkpoint import load_checkpoint
from common.config import parse_config
from common.launch import run_on_ranks, run_torchrun
from common.models import TinyGPT
from common.testing import Verdicts, rank_info

SCRIPT = Path(train.__file__)
U64 = 2.0**-53  # float64 unit roundoff
TOL = 8 * (96 + 4) * U64  # the lesson's bound 8(T + D)u = 8.9e-14 (T = 96, D = 4); measured ~1e-15
TRAIN_TOL = 4 * 8 * (96 + 32) * U64  # steps x 8(T + d)u = 4.5e-13; measured ~1e-16
CASES = [("ring", "contiguous", False), ("ring", "contiguous", True), ("ring", "zigzag", False),
         ("ring", "zigzag", True), ("ulysses", "contiguous", False), ("ulysses", "contiguous", True)]


def reference_attention(q, k, v, causal: bool):
    """softmax(QKᵀ/√D)·V, written out (not the chapter's code, not SDPA)."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def my_chunks(rank: int, world: int, layout: str) -> list[int]:
    return [2 * rank, 2 * rank + 1] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def reassemble(parts: list[torch.Tensor], layout: str) -> torch.Tensor:
    """The whole sequence (dim 2) from every rank's two chunks."""
    world = len(parts)
    chunks = {}
    for rank, part in enumerate(parts):
        a, b = part.chunk(2, dim=2)
        i, j = my_chunks(rank, world, layout)
        chunks[i], chunks[j] = a, b
    return torch.cat([chunks[i] for i in range(2 * world)], dim=2)


def products_by_enumeration(world: int, layout: str) -> list[int]:
    """Chunk pairs (query chunk, key chunk) with key ≤ query, per rank, counted one by one."""
    return [sum(1 for qc in my_chunks(r, world, layout) for kc in range(2 * world) if kc <= qc)
            for r in range(world)]


BROKEN = {"ring": "no_rescale", "ring contiguous, causal": "dkv_not_returned",
          "ring zigzag, causal": "wrong_layout", "Ulysses, causal": "wrong_order"}
SERIAL = {"ring zigzag, causal": "serial"}  # right numbers, no overlap


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors created inside the block that are still alive, and their peak: each
    new storage is counted once (views share it) and uncounted when it is freed."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self._ids = 0, 0, set()

    def _free(self, key: int, n: int) -> None:
        self._ids.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self._ids:
                storage = t.untyped_storage()
                self._ids.add(id(storage))
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        return out


def _smallest_and_refused(rank: int, world: int) -> dict:
    """Every method at the smallest layout allowed (T = 2N: one token per chunk, two per rank;
    H = N: one head per rank), and the impossible ones, each refused by every rank at once."""
    cfg = train.Config(seq_len=2 * world, heads=world, head_dim=2, batch_size=1)
    qkvw = parity.make_qkv(cfg, torch.device("cpu"), torch.float64)
    out = {"qkvw": qkvw, "cases": {}, "refused": []}
    for method, layout, causal in CASES:
        ring.COUNTER.reset()
        ulysses.COUNTER.reset()
        res = parity.run_method(method, layout, causal, qkvw, rank, world)
        counter = ring.COUNTER if method == "ring" else ulysses.COUNTER
        out["cases"][(method, layout, causal)] = {"res": res, "bytes": dict(counter.bytes)}
    q = qkvw[0]
    for attempt in (lambda: layouts.shard_sequence(torch.zeros(1, 1, 2 * world + 2, 1), rank, world, "zigzag", 2),
                    lambda: ring.ring_attention(q[..., :3, :], q[..., :3, :], q[..., :3, :]),
                    lambda: ulysses.ulysses_attention(*(q[:, :world // 2 or 1, :2] for _ in range(3)))):
        try:
            attempt()
            out["refused"].append(None)
        except ValueError as e:
            out["refused"].append(str(e))
    return out


def _transient_blocks(rank: int, world: int) -> dict:
    """Peak bytes alive during one causal ring attention forward, then backward, at T/N = 512, in
    units of one score block B·H·c·2c·e (c = T/2N): what the lesson's memory budget assumes."""
    T = 512 * world
    g = torch.Generator().manual_seed(3)
    q, k, v = (layouts.shard_sequence(torch.randn(1, 2, T, 4, generator=g, dtype=torch.float64), rank, world,
                                   "zigzag", dim=2).requires_grad_() for _ in range(3))
    block = ring.score_block_bytes(1, 2, T, world, 8)
    with LiveBytes() as fwd:
        out = ring.ring_attention(q, k, v, "zigzag", True)
    with LiveBytes() as bwd:
        out.backward(torch.ones_like(out))
    return {"forward": fwd.peak / block, "backward": bwd.peak / block}


def _deepspeed_uneven_heads(info, dtype) -> dict:
    """DeepSpeed 0.19.8 with 2N + 1 heads on N ranks (the hand version refuses them): it splits
    them unevenly (`uneven_heads_all2all`, ranks hold ⌈H/N⌉ or ⌊H/N⌋), but reads the rank's place
    from its own sequence-parallel registry (`groups._get_sequence_parallel_rank`), which says 0
    on every rank unless an mpu or a mesh is registered: register a minimal one for the call."""
    from deepspeed.utils import groups

    heads = 2 * info.world_size + 1
    cfg = train.Config(heads=heads, seq_len=8 * info.world_size)
    saved, groups.mpu = groups.mpu, types.SimpleNamespace(get_sequence_parallel_rank=dist.get_rank)
    try:
        out = {"qkvw": parity.make_qkv(cfg, info.device, dtype),
               "results": parity.deepspeed_parity(Verdicts(), cfg, info, dtype)}
    finally:
        groups.mpu = saved
    out["controls"] = _deepspeed_uneven_controls(cfg, info, dtype)
    return out


def _deepspeed_uneven_controls(cfg, info, dtype) -> dict:
    """The same call with the ranks registered swapped (N − 1 − r), then with none registered
    (DeepSpeed takes every rank for rank 0): what each rank raised. Both run on a group with a
    5 s timeout, so a rank left waiting in the all-to-all returns with an error, never hangs.
    gloo only: the failures read are gloo's (its local length check in alltoallv, then its
    timeout). On NCCL nothing checks that the split sizes agree across ranks: the bare group
    would hang until the watchdog aborts it, or fill the wrong heads without an error."""
    from deepspeed.utils import groups

    from chapters.ch18_long_context.deepspeed_ulysses import deepspeed_ulysses_attention

    assert dist.get_backend() == "gloo", "these controls read gloo's failure modes"
    rank, world = info.rank, info.world_size
    q, k, v = (layouts.shard_sequence(t, rank, world, "contiguous", dim=2)
               for t in parity.make_qkv(cfg, info.device, dtype)[:3])
    dist.barrier()  # both ranks build the short-timeout group together
    short = dist.new_group(timeout=timedelta(seconds=5))
    raised = {}
    saved = groups.mpu
    for mode, mpu in (("swapped", types.SimpleNamespace(get_sequence_parallel_rank=lambda: world - 1 - rank)),
                      ("none registered", None)):
        groups.mpu = mpu
        try:
            deepspeed_ulysses_attention(q, k, v, False, group=short)
            raised[mode] = None
        except RuntimeError as e:
            raised[mode] = str(e)
        finally:
            groups.mpu = saved
    dist.barrier()  # the rank that failed at once waits here for the one that timed out
    return raised


def _ranks(train_too: bool) -> dict:
    """On every rank: each method's shard results, counted bytes and products, the chapter's own
    checks (clean and broken), and (train_too) the sequence-parallel trainings (clean and
    broken) and the activation bytes (at 2 ranks the torchrun test covers those)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    info, cfg, dtype = rank_info(rank, world), train.Config(), torch.float64
    qkvw = parity.make_qkv(cfg, info.device, dtype)
    out = {"qkvw": qkvw if rank == 0 else None, "cases": {},
           "smallest": _smallest_and_refused(rank, world), "transient": _transient_blocks(rank, world)}
    for method, layout, causal in CASES:
        ring.COUNTER.reset()
        ulysses.COUNTER.reset()
        res = parity.run_method(method, layout, causal, qkvw, rank, world)
        counter = ring.COUNTER if method == "ring" else ulysses.COUNTER
        out["cases"][(method, layout, causal)] = {
            "res": res, "bytes": dict(counter.bytes), "products": ring.COUNTER.products}
    clean, broken, serial = Verdicts(), Verdicts(), Verdicts()
    parity.attention_parity(clean, cfg, info, dtype)
    parity.attention_parity(broken, cfg, info, dtype, broken=BROKEN)
    parity.attention_parity(serial, cfg, info, dtype, broken=SERIAL)
    out["clean"], out["broken"], out["serial"] = clean.ok, broken.ok, serial.ok
    if not train_too:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return out
        ds_clean, ds_broken = Verdicts(), Verdicts()
        out["deepspeed"] = parity.deepspeed_parity(ds_clean, cfg, info, dtype)
        parity.deepspeed_parity(ds_broken, cfg, info, dtype, broken="no_permute")
        out["deepspeed verdicts"] = (ds_clean.ok, ds_broken.ok)
        out["deepspeed uneven"] = _deepspeed_uneven_heads(info, dtype)
        return out
    X, Y, vocab = train.make_data(cfg, info.device)
    out["trained"] = {}
    for attention in ("ring", "ulysses"):
        for bug in ("none", "local_positions", "no_grad_sync"):
            if bug != "none" and attention == "ulysses":
                continue
            c = train.Config(train_attention=attention)
            _, sp = train.build_models(c, vocab, info, dtype)
            train.train_sequence_parallel(sp, X, Y, c, info, broken=bug)
            out["trained"][(attention, bug)] = {k: v.detach().clone() for k, v in sp.state_dict().items()}
    _, sp = train.build_models(cfg, vocab, info, dtype)
    acts = Verdicts()
    train.record_activations(acts, sp, X, Y, cfg, info)
    out["activations"] = acts.ok
    sp.attention, gathered = "allgather", Verdicts()  # whole K/V on every rank: must fail
    train.record_activations(gathered, sp, X, Y, cfg, info)
    out["activations allgather"] = gathered.ok
    x, y = (layouts.shard_sequence(t[0], rank, world, "zigzag", dim=1) for t in (X, Y))
    out["allgather loss"] = sp(x, layouts.positions(cfg.seq_len, rank, world, "zigzag"), y, Y[0].numel())
    out["saved"] = train.saved_bytes(sp, X, Y, cfg, rank, world, None)
    return out


def reference_training(cfg: train.Config) -> dict:
    """One process, whole sequences, SGD written here."""
    X, Y, vocab = train.make_data(cfg, torch.device("cpu"))
    torch.manual_seed(cfg.seed)
    model = TinyGPT(train.gpt_config(cfg, vocab)).double()
    for step in range(cfg.steps):
        logits = model(X[step])
        loss = F.cross_entropy(logits.flatten(0, 1), Y[step].flatten())
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= cfg.lr * p.grad
    return model.state_dict()


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def _assert_world(results: list[dict], world: int) -> None:
    cfg = train.Config()
    q, k, v, w = results[0]["qkvw"]
    B, H, T, D = q.shape
    block = B * H * (T // world) * D * 8
    for method, layout, causal in CASES:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ref = reference_attention(qq, kk, vv, causal)
        (ref * w).sum().backward()
        refs = {"out": ref.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
        cases = [r["cases"][(method, layout, causal)] for r in results]
        for key, expected in refs.items():
            got = reassemble([c["res"][key] for c in cases], layout)
            err = ((got - expected).abs().max() / expected.abs().max()).item()
            assert err < TOL, (method, layout, causal, key, err)
        if method == "ring":
            assert all(c["bytes"] == {"forward": 2 * (world - 1) * block,
                                      "backward": 2 * (world - 1) * block + 2 * world * block}
                       for c in cases)
            want = products_by_enumeration(world, layout) if causal else [4 * world] * world
            assert [c["products"] for c in cases] == want
        else:
            sent = 4 * block * (world - 1) // world
            assert all(c["bytes"] == {"forward": sent, "backward": sent} for c in cases)
    zig = products_by_enumeration(world, "zigzag")
    contiguous = products_by_enumeration(world, "contiguous")
    assert len(set(zig)) == 1 and len(set(contiguous)) == world  # balanced vs not
    for r in results:
        assert all(r["clean"].values()), r["clean"]
        failed = {n for n, ok in r["broken"].items() if not ok}
        # no_rescale also spoils lse (hence the gradients); wrong_layout also the zigzag count
        assert failed == {"ring: output = SDPA", "ring: dq, dk, dv = SDPA",
                          "ring contiguous, causal: dq, dk, dv = SDPA",
                          "causal chunk products per rank, zigzag",
                          "ring zigzag, causal: output = SDPA", "ring zigzag, causal: dq, dk, dv = SDPA",
                          "Ulysses, causal: output = SDPA", "Ulysses, causal: dq, dk, dv = SDPA"}, failed
        assert {n for n, ok in r["serial"].items() if not ok} == {
            "ring forward: hops in flight during a block product",
            "ring backward: hops in flight during a block product"}
    _assert_smallest(results, world)
    for r in results:  # score-sized temporaries alive at once (causal): ~3 in forward; in backward
        # at most ring.TRANSIENT_BLOCKS, the count the lesson's memory budget uses, and more than
        # one block fewer (so the budget neither undercounts nor pads a whole block)
        t = r["transient"]
        assert 2.5 < t["forward"] < 3.5, t
        assert ring.TRANSIENT_BLOCKS - 1 < t["backward"] <= ring.TRANSIENT_BLOCKS, (t, ring.TRANSIENT_BLOCKS)
    if "trained" not in results[0]:
        return
    assert all(r["activations"]["activation bytes per rank x N = one rank's"] for r in results)
    assert all(r["activations"]["one rank's activation bytes >= q, k, v, O"]
               for r in results)  # the counter counts: 0 = 0 would pass the check above
    assert not any(r["activations allgather"]["activation bytes per rank x N = one rank's"] for r in results)
    X, Y, vocab = train.make_data(cfg, torch.device("cpu"))  # the all-gather control is right,
    torch.manual_seed(cfg.seed)                               # only its memory is not
    model = TinyGPT(train.gpt_config(cfg, vocab)).double()
    loss = F.cross_entropy(model(X[0]).flatten(0, 1), Y[0].flatten()).item()
    assert abs(sum(r["allgather loss"].item() for r in results) - loss) < TOL
    ref = reference_training(cfg)
    for (attention, bug), state in results[0]["trained"].items():
        diff = max_diff(state, ref)
        assert (diff < TRAIN_TOL) == (bug == "none"), (attention, bug, diff)
        if bug != "none":
            assert diff > 1e-3, (attention, bug, diff)  # the lesson: ~1e-2
    assert len({r["saved"] for r in results}) == 1  # every rank keeps the same bytes


def _assert_smallest(results: list[dict], world: int) -> None:
    """Two tokens and one head per rank: every method equals the reference, bytes by the formulas;
    the impossible layouts were refused by every rank, each in one sentence."""
    q, k, v, w = results[0]["smallest"]["qkvw"]
    B, H, T, D = q.shape
    assert (T, H) == (2 * world, world)
    for method, layout, causal in CASES:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ref = reference_attention(qq, kk, vv, causal)
        (ref * w).sum().backward()
        for key, expected in {"out": ref.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}.items():
            got = reassemble([r["smallest"]["cases"][(method, layout, causal)]["res"][key] for r in results], layout)
            assert ((got - expected).abs().max() / expected.abs().max()).item() < TOL, (method, layout, causal, key)
        formula = (ring.ring_bytes_per_rank if method == "ring" else ulysses.ulysses_bytes_per_rank)(B, H, 2, D, 8, world)
        assert all(r["smallest"]["cases"][(method, layout, causal)]["bytes"] == formula for r in results)
    for r in results:
        refused = r["smallest"]["refused"]
        assert refused[0].startswith("ring attention cuts a sequence into 2N chunks"), refused
        assert refused[1].startswith("ring attention needs q, k, v of one shape with two equal chunks"), refused
        assert refused[2].startswith("DeepSpeed-Ulysses gives each rank whole attention heads"), refused
        assert all("\n" not in m for m in refused)


def _assert_deepspeed(results: list[dict]) -> None:
    """DeepSpeed's DistributedAttention on 2 ranks == the reference; its negative control fails."""
    q, k, v, w = results[0]["qkvw"]
    for causal in (False, True):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ref = reference_attention(qq, kk, vv, causal)
        (ref * w).sum().backward()
        for key, expected in {"out": ref.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}.items():
            got = reassemble([r["deepspeed"][causal][key] for r in results], "contiguous")
            assert ((got - expected).abs().max() / expected.abs().max()).item() < TOL, (causal, key)
    for clean, broken in (r["deepspeed verdicts"] for r in results):
        assert len(clean) == 2 and all(clean.values()), clean
        assert not any(broken.values()), broken
    q, k, v, w = results[0]["deepspeed uneven"]["qkvw"]  # 5 heads on 2 ranks: 3 and 2
    assert q.shape[1] % len(results)
    for causal in (False, True):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ref = reference_attention(qq, kk, vv, causal)
        (ref * w).sum().backward()
        for key, expected in {"out": ref.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}.items():
            got = reassemble([r["deepspeed uneven"]["results"][causal][key] for r in results], "contiguous")
            assert ((got - expected).abs().max() / expected.abs().max()).item() < TOL, ("uneven", causal, key)
    # negative controls (gloo only: its length check and its timeout; NCCL checks neither and
    # would hang or mix heads): the registered rank is what makes it work (the lesson)
    length_check = "inLengthPerRank[myRank] == outLengthPerRank[myRank]"
    swapped = [r["deepspeed uneven"]["controls"]["swapped"] for r in results]
    assert all(m is not None and length_check in m for m in swapped), swapped  # both at once
    bare = [r["deepspeed uneven"]["controls"]["none registered"] for r in results]
    assert bare[1] is not None and length_check in bare[1], bare  # rank 1 expects rank 0's 3 heads
    assert bare[0] is not None and "Timed out" in bare[0], bare  # rank 0's check passes: it waits


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_ulysses_equal_full_attention(world):
    results = run_on_ranks(_ranks, world, world == 4, timeout=130)
    _assert_world(results, world)
    if world == 2:
        if "deepspeed" not in results[0]:
            pytest.skip("DeepSpeed not installed: pip install deepspeed==0.19.8 (requirements.txt); "
                        "ring and Ulysses passed")
        _assert_deepspeed(results)


@pytest.mark.timeout(150)
def test_torchrun_two_ranks_matches_an_independent_reference(tmp_path, quiet_console):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=120)
    quiet_console(res)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    assert res.summary["world_size"] == 2
    assert max_diff(load_checkpoint(tmp_path / "final_params.pt"), reference_training(train.Config())) < TRAIN_TOL
    assert res.check("causal chunk products per rank, zigzag")["measured"] == products_by_enumeration(2, "zigzag")
    assert res.check("activation bytes per rank x N = one rank's")["measured"] > 0
    assert "ring T=96: fwd+bwd time (median)" in res.summary["figures"]  # reported, never asserted


def test_online_softmax_merge_in_one_process():
    """Two key blocks merged by the log-sum-exp rule give attention over both."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    scale = 4 ** -0.5
    o1, l1, n1 = ring.block_forward(q, k[..., :4, :], v[..., :4, :], [0, 1], [0, 1], scale, False)
    o2, l2, n2 = ring.block_forward(q, k[..., 4:, :], v[..., 4:, :], [0, 1], [2, 3], scale, False)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    assert (merged - reference_attention(q, k, v, False)).abs().max() < TOL
    assert (o1 + o2 - reference_attention(q, k, v, False)).abs().max() > 0.1  # unweighted: wrong
    assert n1 == n2 == 4


def test_formulas_against_enumeration():
    for world in range(1, 9):
        for layout in layouts.LAYOUTS:
            assert ring.causal_products_per_rank(world, layout) == products_by_enumeration(world, layout)
        block = 2 * 3 * (96 // world) * 5 * 8
        b = ring.ring_bytes_per_rank(2, 3, 96 // world, 5, 8, world)
        assert b == {"forward": (world - 1) * 2 * block,
                     "backward": (4 * world - 2) * block if world > 1 else 0}
        u = ulysses.ulysses_bytes_per_rank(2, 3, 96 // world, 5, 8, world)
        assert u["forward"] == u["backward"] == 4 * block * (world - 1) // world


def test_sharding_round_trip_and_positions():
    x = torch.arange(2 * 24).view(2, 1, 24, 1)
    for layout in layouts.LAYOUTS:
        parts = [layouts.shard_sequence(x, r, 4, layout, dim=2) for r in range(4)]
        assert torch.equal(layouts.unshard_sequence(parts, layout, dim=2), x)
        assert torch.equal(reassemble(parts, layout), x)
    assert layouts.positions(16, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]
    assert layouts.positions(16, 1, 4, "contiguous").tolist() == [4, 5, 6, 7]
    # fewer tokens than 2N chunks, or a length 2N does not divide: refused, not split unevenly
    for length, world in ((6, 4), (10, 4), (26, 4)):
        with pytest.raises(ValueError, match=f"^ring attention cuts a sequence into 2N chunks: {world} ranks"):
            layouts.shard_sequence(torch.zeros(1, 1, length, 1), 0, world, "zigzag", dim=2)


def test_validate_refuses_in_one_sentence(capsys, monkeypatch):
    cfg = train.Config()
    for world in (1, 2, 3, 4, 8, 16):
        train.validate(cfg, world)
    with pytest.raises(ValueError, match="need sequence lengths divisible by 10, not 96"):
        train.validate(cfg, 5)
    with pytest.raises(ValueError, match="^DeepSpeed-Ulysses gives each rank whole attention heads: "
                                         "5 ranks do not divide 48 heads"):
        train.validate(train.Config(seq_len=100), 5)
    with pytest.raises(ValueError, match="3 ranks do not divide 4 heads$"):
        train.validate(train.Config(train_attention="ulysses"), 3)
    # 8 ranks: 8 tokens would leave every rank half a chunk; 4 heads would leave 4 ranks none
    with pytest.raises(ValueError, match="8 ranks need sequence lengths divisible by 16, not 8$"):
        train.validate(train.Config(seq_len=8), 8)
    with pytest.raises(ValueError, match=r"8 ranks do not divide 4 heads \(fewer heads than ranks: a rank would get none\)$"):
        train.validate(train.Config(train_attention="ulysses"), 8)
    train.validate(train.Config(train_attention="ulysses"), 4)
    train.validate(train.Config(train_attention="ulysses", d_model=48, n_head=6), 3)  # exercise 4
    with pytest.raises(ValueError, match="divisible by 4, not 250"):
        train.validate(train.Config(sweep_lengths=[256, 250]), 2)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(ValueError, match="gloo sends and receives CPU tensors only"):
            train.validate(train.Config(backend="gloo"), 2)
        train.validate(train.Config(), 2)
    with pytest.raises(SystemExit) as e:
        parse_config(train.Config, [], validate=train.validate, world_size=5)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "divisible by 10" in lines[0]
    with pytest.raises(SystemExit):
        parse_config(train.Config, ["--train-attention", "flash"])


def _timeline(*rows) -> timeline.RingCounter:
    counter = timeline.RingCounter()
    counter.events = [("forward", kind, hop, t) for kind, hop, t in rows]
    return counter


def test_hops_in_flight_and_waits_are_read_from_the_clock():
    """A hop counts when its send's time precedes a product's start and its wait's return follows
    the product's end; products and waits are timed from their stamps (host seconds here)."""
    overlapped = _timeline(("send", 1, 0.0), ("begin", None, 1.0), ("compute", None, 3.0),
                           ("wait_start", 1, 3.0), ("wait", 1, 3.5))
    assert overlapped.overlapped_hops("forward") == 1
    assert overlapped.seconds_in("forward") == {"products": 2.0, "waits": 0.5}
    serial = _timeline(("send", 1, 0.0), ("wait_start", 1, 0.0), ("wait", 1, 2.5),
                       ("begin", None, 2.5), ("compute", None, 4.5))  # control: waited first
    assert serial.overlapped_hops("forward") == 0
    assert serial.seconds_in("forward") == {"products": 2.0, "waits": 2.5}
    assert isinstance(timeline.stamp(torch.device("cpu")), float)


def test_on_cuda_the_timeline_is_cuda_events_read_after_a_synchronize(monkeypatch):
    """NCCL's wait() returns on the host at once, so on CUDA every stamp is an event recorded on
    the current stream, and times are read (elapsed_time) only after torch.cuda.synchronize().
    Fakes stand in for CUDA here (no GPU on the test machine)."""
    state = {"synced": False, "clock": 0.0}

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.stream, self.at = None, None

        def record(self, stream=None):
            self.stream, state["clock"] = stream, state["clock"] + 2.0
            self.at = state["clock"]

        def elapsed_time(self, end):  # ms, valid only once both have completed
            assert state["synced"], "elapsed_time read before torch.cuda.synchronize()"
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream", device))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: state.update(synced=True))
    cuda = torch.device("cuda", 0)
    counter = timeline.RingCounter()
    for kind, hop in (("send", 1), ("begin", None), ("compute", None), ("wait_start", 1), ("wait", 1)):
        counter.mark("forward", kind, hop, cuda)
    events = [e[3] for e in counter.events]
    assert all(isinstance(e, FakeEvent) and e.stream == ("stream", cuda) for e in events)
    assert counter.overlapped_hops("forward") == 1
    assert counter.seconds_in("forward") == {"products": 2e-3, "waits": 2e-3}
