"""Activation memory of a transformer layer: Korthikanti et al.'s count, and a measurement of
what autograd actually keeps for backward.

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models", §4)
count the bytes one layer keeps, with 16-bit activations (2 bytes) and 1-byte dropout masks,
for sequence s, micro-batch b, hidden h, a heads. `BREAKDOWN` lists their terms in units of
s·b·h bytes (and a·s²·b bytes for the attention matrices) with where each lives under TP:

- "split": inside the attention/MLP, divided by t under tensor parallelism;
- "ln": the LayerNorm inputs, "mask": the two dropout masks after attention and MLP, "linear
  input": the inputs of the QKV and first MLP linears. These stay whole on every rank under
  TP; sequence parallelism divides them by t too (Megatron saves the linear inputs sharded and
  all-gathers them again in backward).
"""

from __future__ import annotations

import torch

BREAKDOWN = [  # (what, bytes per s·b·h, bytes per a·s²·b, region)
    ("attention: QKV input (LayerNorm output)", 2, 0, "linear input"),
    ("attention: Q and K (for QKᵀ)", 4, 0, "split"),
    ("attention: softmax output", 0, 2, "split"),
    ("attention: softmax dropout mask", 0, 1, "split"),
    ("attention: dropout output and V", 2, 2, "split"),
    ("attention: output projection input", 2, 0, "split"),
    ("attention: dropout mask", 1, 0, "mask"),
    ("MLP: first linear input", 2, 0, "linear input"),
    ("MLP: GeLU input", 8, 0, "split"),
    ("MLP: second linear input", 8, 0, "split"),
    ("MLP: dropout mask", 1, 0, "mask"),
    ("LayerNorm inputs (two)", 4, 0, "ln"),
]


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                           sequence_parallel: bool = False) -> float:
    """Bytes one rank keeps for one layer: sbh(34 + 5as/h) on one device, sbh(10 + 24/t +
    5as/(ht)) with t-way TP, sbh(34/t + 5as/(ht)) with TP + SP (Korthikanti et al., eqs. 1-3)."""
    total = 0.0
    for _, per_sbh, per_as2b, region in BREAKDOWN:
        nbytes = per_sbh * s * b * h + per_as2b * a * s * s * b
        total += nbytes / t if region == "split" or sequence_parallel else nbytes
    return total


class SavedTensors:
    """`with SavedTensors(exclude=model.parameters()) as saved: loss = model(x)`, then
    `saved.nbytes`: the bytes of every storage autograd saved for backward, each storage once
    (q, k and v are views of one qkv output), parameters excluded. It counts what is kept
    alive, so a narrowed view of a larger tensor counts the whole storage."""

    def __init__(self, exclude=()):
        self.skip = {p.untyped_storage().data_ptr() for p in exclude}
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
