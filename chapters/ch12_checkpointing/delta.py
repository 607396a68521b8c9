"""Delta (incremental) checkpoints: store only the elements that changed since a base.

A delta holds, per tensor, the flat indices of the changed elements and their NEW values.
Restoring writes those values into a copy of the base: bit-exact. Storing differences instead
is exact only where the subtraction is: in the tensor's own dtype (new − base) + base == new
whenever new − base is representable (Sterbenz: new within a factor 2 of base, same sign), which
small fine-tuning updates satisfy, and not in general (fp32 base 1.0, new 0.001 comes back as
0.00099998713); in a narrower dtype (bf16) almost never.
"""

import torch
import torch.nn.functional as F

from common.checkpoint import load_checkpoint, save_checkpoint


def make_delta(base: dict, new: dict) -> dict:
    """{name: {"index", "values", "shape"}} for the elements of `new` that differ from `base`."""
    delta = {}
    for name, b in base.items():
        n = new[name]
        flat = n.reshape(-1)
        changed = (flat != b.reshape(-1)).nonzero().squeeze(1)
        index_dtype = torch.int32 if flat.numel() < 2**31 else torch.int64  # 4 bytes suffice
        delta[name] = {"index": changed.to(index_dtype), "values": flat[changed].clone(),
                       "shape": list(n.shape)}
    return delta


def apply_delta(base: dict, delta: dict) -> dict:
    """The state the delta was made from: a copy of `base` with the changed elements written."""
    out = {}
    for name, b in base.items():
        flat = b.reshape(-1).clone()
        d = delta[name]
        flat[d["index"].long()] = d["values"]
        out[name] = flat.view(d["shape"])
    return out


def make_difference_delta(base: dict, new: dict, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The broken variant (a negative control): store new − base in bf16, add it back later."""
    delta = make_delta(base, new)
    for name, d in delta.items():
        d["values"] = (d["values"] - base[name].reshape(-1)[d["index"].long()]).to(dtype)
    return delta


def apply_difference_delta(base: dict, delta: dict) -> dict:
    out = {}
    for name, b in base.items():
        flat = b.reshape(-1).clone()
        d = delta[name]
        flat[d["index"].long()] += d["values"].to(flat.dtype)
        out[name] = flat.view(d["shape"])
    return out


def sterbenz(base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Where Sterbenz's lemma makes new − base exact in their dtype (so that adding base back
    gives new bit for bit): same sign and each within a factor 2 of the other, or either is 0."""
    a, b = new.abs(), base.abs()
    close = (torch.sign(new) == torch.sign(base)) & (a <= 2 * b) & (b <= 2 * a)
    return close | (a == 0) | (b == 0)


def difference_roundtrip(base: torch.Tensor, new: torch.Tensor) -> dict:
    """Store new − base in the tensors' own dtype, add base back: how many elements come back
    different, inside and outside the range where Sterbenz guarantees exactness."""
    wrong = ((new - base) + base) != new
    inside = sterbenz(base, new)
    return {"elements": new.numel(), "outside_sterbenz": int((~inside).sum()),
            "wrong_inside": int((wrong & inside).sum()), "wrong_outside": int((wrong & ~inside).sum())}


def reinitialised_rows(cfg, base: dict) -> dict:
    """The other kind of change: the touched rows re-drawn from scratch (a re-initialised head,
    a replaced adapter), so new and base are unrelated numbers."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    table = base["embedding"].clone()
    rows = torch.randperm(cfg.vocab, generator=g)[:cfg.touched_tokens]
    table[rows] = torch.randn(len(rows), table.shape[1], generator=g)
    return {"embedding": table}


def delta_bytes(delta: dict) -> int:
    """Payload of a delta: index bytes + value bytes."""
    return sum(d["index"].numel() * d["index"].element_size()
               + d["values"].numel() * d["values"].element_size() for d in delta.values())


def state_bytes(state: dict) -> int:
    """Payload of a full state dict of tensors: numel × dtype size, summed."""
    return sum(t.numel() * t.element_size() for t in state.values())


def save_delta(path, delta: dict, base_step: int, step: int):
    """A delta is useless without its base: record which one it applies to."""
    return save_checkpoint(path, {"delta": delta, "base_step": base_step, "step": step})


def load_delta(path) -> dict:
    return load_checkpoint(path)


def sparse_finetune(cfg):
    """Delta demo: an embedding table trained with plain SGD on a few tokens changes only their rows."""
    g = torch.Generator().manual_seed(cfg.seed)
    table = torch.randn(cfg.vocab, 32, generator=g)
    base = {"embedding": table.clone()}
    tokens = torch.randperm(cfg.vocab, generator=g)[:cfg.touched_tokens]
    emb = torch.nn.Embedding.from_pretrained(table, freeze=False)
    target = torch.randn(len(tokens), 32, generator=g)
    for _ in range(3):
        loss = F.mse_loss(emb(tokens), target)
        emb.zero_grad()
        loss.backward()
        with torch.no_grad():
            emb.weight -= 0.5 * emb.weight.grad
    return base, {"embedding": emb.weight.detach().clone()}, len(tokens) * 32


def record_delta(cfg, rec, out) -> None:
    """The delta section of train.py: sizes beside the formula, exact restore, lossy control."""
    base, new, n_expected = sparse_finetune(cfg)
    delta = make_delta(base, new)
    restored = apply_delta(base, load_delta(save_delta(out / "delta.pt", delta, 0, 3))["delta"])
    broken = apply_difference_delta(base, make_difference_delta(base, new))
    save_checkpoint(out / "full_embedding.pt", new)
    rec.check("delta restores bit for bit", "parity", torch.equal(restored["embedding"], new["embedding"]), True)
    rec.check("bf16 delta of differences restores bit for bit (must not)", "parity",
              torch.equal(broken["embedding"], new["embedding"]), False)
    n_changed = sum(d["index"].numel() for d in delta.values())
    rec.check("changed elements = touched rows x dim", "count", n_changed, n_expected)
    # Differences in the same dtype: exact where Sterbenz holds, not in general.
    small = difference_roundtrip(base["embedding"], new["embedding"])
    unrelated = difference_roundtrip(base["embedding"], reinitialised_rows(cfg, base)["embedding"])
    rec.figure("fp32 (new-base)+base wrong: fine-tune [inside, outside Sterbenz]",
               [small["wrong_inside"], small["wrong_outside"]], expected=[0, None])
    rec.figure("fp32 (new-base)+base wrong: re-drawn rows [inside, outside]",
               [unrelated["wrong_inside"], unrelated["wrong_outside"]], expected=[0, None])
    rec.check("fp32 differences: wrong where Sterbenz holds", "count",
              small["wrong_inside"] + unrelated["wrong_inside"], 0)
    rec.check("fp32 differences of re-drawn rows: wrong elements (> 0)", "count",
              unrelated["wrong_outside"], 0, compare=">")
    rec.check("delta payload = changed x (4 B index + 4 B value)", "formula",
              delta_bytes(delta), n_expected * 8)
    rec.figure("full embedding file", (out / "full_embedding.pt").stat().st_size,
               expected=state_bytes(new), unit="bytes")
    rec.figure("delta file", (out / "delta.pt").stat().st_size, expected=n_expected * 8, unit="bytes")
