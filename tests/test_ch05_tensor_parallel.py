"""Chapter 05: tensor parallelism by hand (f/g operators) and with DTensor == the dense block.

The torchrun runs check themselves (summary.json); this module also computes the dense
reference with its own functional block (scaled_dot_product_attention, its own dropout masks,
hand-written SGD) and reassembles the hand-written shards with its own code, so a bug shared by
the script and its checks still fails. On 4 ranks it tests the four operators one by one, the
parity of every version and the byte counts, and runs the negative controls: broken variants
that the same parity check must reject.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from chapters.ch05_tensor_parallel import block, dtensor_tp, tp_layers, train
from chapters.ch05_tensor_parallel.tp_layers import tp_layout_error
from common.checkpoint import load_checkpoint
from common.distributed import DistInfo
from common.launch import run_on_ranks, run_torchrun

SCRIPT = Path(train.__file__)
TOL = 1e-12  # float64: versions differ only by summation order (~1e-16)


def reference(cfg: train.Config, dropout: float) -> dict:
    """The dense model trained by one process, written independently of the chapter's code
    (only the initial weights come from the chapter's DenseModel)."""
    torch.manual_seed(cfg.seed)
    init = block.DenseModel(cfg.d_model, cfg.n_heads, cfg.ffn_mult * cfg.d_model, cfg.n_layers)
    P = {n: p.detach().double().clone() for n, p in init.named_parameters()}
    g = torch.Generator().manual_seed(cfg.seed + 1)
    shape = (cfg.steps, cfg.batch_size, cfg.seq_len, cfg.d_model)
    X, Y = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    B, S, h, H = cfg.batch_size, cfg.seq_len, cfg.d_model, cfg.n_heads

    def drop(a, seed):
        keep = torch.rand(a.shape, generator=torch.Generator().manual_seed(seed)) >= dropout
        return a * keep / (1 - dropout) if dropout else a

    def forward(x, step):
        for i in range(cfg.n_layers):
            def p(name, i=i):
                return P[f"blocks.{i}.{name}"]
            z = F.layer_norm(x, (h,), p("ln1.weight"), p("ln1.bias"))
            q, k, v = (F.linear(z, p(f"attn.{n}.weight"), p(f"attn.{n}.bias"))
                       .view(B, S, H, h // H).transpose(1, 2) for n in "qkv")
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, h)
            x = x + drop(F.linear(a, p("attn.proj.weight"), p("attn.proj.bias")), 1_000_003 * step + 2 * i)
            z = F.layer_norm(x, (h,), p("ln2.weight"), p("ln2.bias"))
            m = F.linear(F.gelu(F.linear(z, p("mlp.fc1.weight"), p("mlp.fc1.bias"))),
                         p("mlp.fc2.weight"), p("mlp.fc2.bias"))
            x = x + drop(m, 1_000_003 * step + 2 * i + 1)
        return x

    for step in range(cfg.steps):
        for t in P.values():
            t.requires_grad_(True)
        loss = ((forward(X[step], step) - Y[step]) ** 2).mean()
        grads = torch.autograd.grad(loss, list(P.values()))
        P = {n: (t - cfg.lr * gr).detach() for (n, t), gr in zip(P.items(), grads)}
    return P


def unshard(shards: list[dict]) -> dict:
    """Dense-named tensors from every rank's hand-TP tensors; replicated ones must agree."""
    out = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        prefix, param = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
        if ".qkv." in name:
            for j, p in enumerate("qkv"):
                out[f"{prefix}.attn.{p}.{param}"] = torch.cat([t.chunk(3)[j] for t in parts])
        elif name.endswith(("proj.weight", "fc2.weight")):
            out[name.replace(".proj", ".attn.proj").replace(".fc2", ".mlp.fc2")] = torch.cat(parts, dim=1)
        elif ".fc1." in name:
            out[name.replace(".fc1", ".mlp.fc1")] = torch.cat(parts)
        else:
            assert all(torch.equal(t, parts[0]) for t in parts), f"replicated {name} drifted apart"
            out[name.replace(".proj", ".attn.proj").replace(".fc2", ".mlp.fc2")] = parts[0]
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(120)
def test_two_ranks_match_an_independent_dense_reference(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, out_dir=tmp_path, timeout=90)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    assert res.summary["world_size"] == 2
    cfg = train.Config()
    expected, expected_p0 = reference(cfg, cfg.dropout), reference(cfg, 0.0)
    saved = load_checkpoint(tmp_path / "final_params.pt")
    assert max_diff(saved["dense"], expected) < TOL
    assert max_diff(unshard(saved["hand_tp"]), expected) < TOL
    assert max_diff(unshard(saved["hand_sp"]), expected) < TOL
    assert max_diff(saved["dtensor_sp"], expected_p0) < TOL
    N, b = cfg.batch_size * cfg.seq_len * cfg.d_model, 8
    assert res.check("hand TP: all_reduce elements per layer, forward = 2BSh")["measured"] == 2 * N
    assert res.check("hand TP: bytes all-reduced per layer, fwd+bwd = 4BSh*b")["measured"] == 4 * N * b
    for name in ("hand TP", "hand TP+SP"):  # ring: 2(t-1)/t per all-reduce, (t-1)/t per AG or RS
        assert res.check(f"{name}: ring bytes sent per rank per layer, fwd+bwd = 8(t-1)/t*BSh*b")[
            "measured"] == 4 * N * b
    assert res.check("DTensor TP: all_reduce calls per layer, forward")["measured"] == 2
    assert "step time, DTensor TP+SP" in res.summary["figures"]  # reported, never asserted


@contextlib.contextmanager
def patched(name: str, replacement):
    """Replace tp_layers.<name> (what the layers call at run time) for one variant."""
    original = getattr(tp_layers, name)
    setattr(tp_layers, name, replacement)
    try:
        yield
    finally:
        setattr(tp_layers, name, original)


class _Info:
    """The fields of common.distributed.DistInfo the training functions read."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size, self.is_main = rank, world_size, rank == 0
        self.device = torch.device("cpu")


def _operators(rank: int, t: int) -> dict:
    """Each operator's forward and backward on rank-dependent tensors."""
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    out = {}
    y = tp_layers.copy_to_tp(x)
    y.backward(torch.full_like(y, float(rank + 1)))
    out["f"] = (torch.equal(y, x), x.grad.unique().tolist())
    x.grad = None
    y = tp_layers.reduce_from_tp(x)
    y.backward(torch.full_like(y, float(rank + 1)))
    out["g"] = (y.unique().tolist(), x.grad.unique().tolist())
    x.grad = None
    s = torch.full((1, 1, 1), float(rank), dtype=torch.float64, requires_grad=True)
    y = tp_layers.gather_from_sp(s)
    y.backward(torch.ones_like(y))
    out["f_sp"] = (y.flatten().tolist(), s.grad.flatten().tolist())
    full = torch.arange(2 * t, dtype=torch.float64).view(1, 2 * t, 1).requires_grad_()
    y = tp_layers.reduce_scatter_to_sp(full)
    y.backward(torch.ones_like(y))
    out["g_sp"] = (y.flatten().tolist(), full.grad.flatten().tolist())
    return out


def _four_ranks() -> dict:
    """On 4 gloo ranks: operators, parity of every version, byte counts, negative controls."""
    rank, t = dist.get_rank(), dist.get_world_size()
    info = _Info(rank, t)
    cfg = train.Config(steps=2)
    out = {"ops": _operators(rank, t)}
    torch.manual_seed(cfg.seed)
    dense = block.DenseModel(cfg.d_model, cfg.n_heads, cfg.ffn_mult * cfg.d_model, cfg.n_layers,
                             cfg.dropout).double()
    refs, runs = train.train_all_versions(dense, cfg, info)
    out["parity"] = {name: train.compare(run, refs[ref], expect) for name, (run, ref, expect) in runs.items()}
    out["comm"] = {name: runs[name][0]["comm"] for name in ("hand TP", "hand TP+SP")}
    out["dtensor"] = {name: dtensor_tp.counts(runs[name][0]["counted"])
                      for name in ("DTensor TP", "DTensor TP+SP")}

    data = train.make_batches(cfg, info.device)

    def hand(sp: bool, sync: bool = True) -> dict:
        model = train.build_hand_tp(dense, cfg, rank, t, sp)
        run = train.train(model, data, cfg, info, sp, sync_grads=sp and sync)
        return train.compare(run, refs["dense"], train.Expect(rank, t, sp, sharded=True))

    controls = {}
    with patched("reduce_from_tp", lambda y: y):  # row layer: forward all-reduce skipped
        controls["g skipped"] = hand(sp=False)
    with patched("copy_to_tp", lambda x: x):  # f without its backward all-reduce
        controls["f without backward all-reduce"] = hand(sp=False)
    controls["SP without LayerNorm/bias grad sync"] = hand(sp=True, sync=False)

    def same_mask_everywhere(x, p, seed, seq_offset=0, seq_total=None):
        return block.seeded_dropout(x, p, seed, 0, seq_total)  # every rank takes rows 0..S/t

    with patched("seeded_dropout", same_mask_everywhere):
        controls["SP dropout mask not sliced per rank"] = hand(sp=True)
    out["controls"] = controls
    return out


@pytest.mark.timeout(120)
def test_four_ranks_parity_bytes_and_negative_controls():
    res = run_on_ranks(_four_ranks, 4, timeout=100)
    for rank, r in enumerate(res):  # f: identity / sum; g: sum / identity; SP: gather / scatter
        assert r["ops"]["f"] == (True, [10.0])
        assert r["ops"]["g"] == ([10.0], [rank + 1.0])
        assert r["ops"]["f_sp"] == ([0.0, 1.0, 2.0, 3.0], [4.0])
        assert r["ops"]["g_sp"] == ([4.0 * (2 * rank), 4.0 * (2 * rank + 1)], [1.0] * 8)
    r = res[0]
    for name, diffs in r["parity"].items():
        for what, d in diffs.items():
            assert d < TOL, f"{name} {what}: {d}"
    cfg, t = train.Config(), 4
    N, b, L = cfg.batch_size * cfg.seq_len * cfg.d_model, 8, cfg.n_layers
    tp_comm, sp_comm = r["comm"]["hand TP"], r["comm"]["hand TP+SP"]
    assert tp_comm.calls == {("forward", "all_reduce"): 2 * L, ("backward", "all_reduce"): 2 * L}
    assert tp_comm.total("bytes") == 4 * N * b * L
    assert sp_comm.total("calls", "forward", "all_reduce") == sp_comm.total("calls", "backward", "all_reduce") == 0
    for phase in ("forward", "backward"):
        for op in ("all_gather", "reduce_scatter"):
            assert sp_comm.calls[(phase, op)] == 2 * L and sp_comm.elements[(phase, op)] == 2 * N * L
    ring = 8 * (t - 1) / t * N * b * L  # fwd+bwd, both versions
    assert tp_comm.total("wire_bytes") == pytest.approx(ring)
    assert sp_comm.total("wire_bytes") - sp_comm.total("wire_bytes", "grad sync") == pytest.approx(ring)
    assert r["dtensor"]["DTensor TP"]["forward"] == {"all_reduce": 2 * L}
    assert r["dtensor"]["DTensor TP+SP"]["forward"] == {"all_gather": 2 * L, "reduce_scatter": 2 * L}

    c = r["controls"]
    assert c["g skipped"]["output"] > 1e6 * TOL, "a row layer without its all-reduce went unnoticed"
    f_broken = c["f without backward all-reduce"]
    assert f_broken["output"] < TOL, "f is the identity in forward: outputs still agree"
    assert f_broken["gradients"] > 1e6 * TOL, "f without its backward all-reduce went unnoticed"
    assert c["SP without LayerNorm/bias grad sync"]["output"] < TOL
    assert c["SP without LayerNorm/bias grad sync"]["gradients"] > 1e6 * TOL
    assert c["SP dropout mask not sliced per rank"]["output"] > 1e6 * TOL


def test_indivisible_degree_is_refused_in_one_sentence(tmp_path, monkeypatch):
    """main() as torchrun --nproc_per_node=3 would start it: the world size comes from the
    launcher, so a fake setup stands in for it (no group is created, nothing to hang)."""
    info = DistInfo(rank=0, local_rank=0, world_size=3, local_world_size=3,
                    device=torch.device("cpu"), backend="gloo", launcher="torchrun")
    monkeypatch.setattr(train, "setup_distributed", lambda *a: info)
    with pytest.raises(SystemExit) as e:
        train.main(train.Config(out=str(tmp_path)))
    assert str(e.value.code) == ("error: tensor-parallel degree 3 does not divide the 4 attention "
                                 "heads; use a degree that divides 4")
    assert not (tmp_path / "summary.json").exists()


def test_layout_errors_and_bad_config():
    assert tp_layout_error(2, 4, 128, 8, True) is None
    assert "does not divide the 6 attention heads" in tp_layout_error(4, 6, 128, 8, False)
    assert "MLP hidden size 30" in tp_layout_error(4, 4, 30, 8, False)
    assert "sequence length 6" in tp_layout_error(4, 4, 128, 6, True)
    assert tp_layout_error(4, 4, 128, 6, False) is None  # without SP the sequence is not split
    with pytest.raises(ValueError, match="does not divide the 6 attention heads"):
        tp_layers.TPBlock(48, 6, 192, 0.0, 0, 0, 4, False)
    with pytest.raises(SystemExit) as e:
        train.parse_config(train.Config, ["--d-model", "30", "--n-heads", "4"])
    assert e.value.code == 2


def test_shard_state_splits_whole_heads():
    torch.manual_seed(0)
    dense = block.DenseModel(d_model=8, n_heads=4, d_ff=16, n_layers=1)
    state = {k: v.clone() for k, v in dense.state_dict().items()}
    shards = [tp_layers.shard_state(state, r, 2) for r in range(2)]
    assert max_diff(unshard(shards), state) == 0
    qkv = shards[1]["blocks.0.qkv.weight"]  # rank 1: heads 2 and 3 of q, k and v
    assert torch.equal(qkv[:4], state["blocks.0.attn.q.weight"][4:])
    assert torch.equal(qkv[8:], state["blocks.0.attn.v.weight"][4:])


def test_ring_bytes_of_the_counter():
    c = tp_layers.CommCounter()
    x = torch.zeros(10, dtype=torch.float64)
    c.record("all_reduce", x, 4)
    c.phase = "backward"
    c.record("reduce_scatter", x, 4)
    assert c.total("bytes") == 160
    assert c.total("wire_bytes", "forward") == 2 * 3 / 4 * 80
    assert c.total("wire_bytes", "backward") == 3 / 4 * 80
    copy.deepcopy(c)  # the training loop snapshots it
