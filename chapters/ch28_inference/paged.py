"""The paged KV cache: a pool of fixed-size blocks that attention reads through block tables
(vLLM's PagedAttention), the block manager that hands the blocks out, and the random stream of
requests its invariants are checked on (the workloads and the schedules that predict the engine
are in `workloads.py`).

`KVPool` holds, per layer, keys and values of shape (n_blocks, block_size, heads, head_dim):
vLLM's layout for its FlashAttention backend. A sequence's block table lists the blocks that hold
its positions 0, 1, ...: position p lives in block table[p // block_size] at offset
p % block_size, so its flat slot is table[p // bs] * bs + p % bs.

`BlockManager` keeps the books. Full blocks are shared by content (prefix caching): a full
block's key is (the hash of the previous block's key, the block's tokens), so two sequences
share a block only when every token up to its end is the same; a partly filled last block is
never shared through the cache. Reference counts say how many block tables name a block; a
block returns to the free list when its last user lets it go (a sequence's tail first, as vLLM
frees them), and keeps its contents (and its cache entry) until the free list hands it out
again, oldest freed first, so a later request with the same prefix revives it (vLLM's evictable
blocks). A forked sequence (parallel sampling, n > 1: the PagedAttention paper's and vLLM V0's
design) shares every block; the first write into a shared block copies it (copy-on-write), and
the copy is returned as (source, destination) for the engine to apply to the pool before the
step that writes.
"""

from __future__ import annotations

import random

import torch


class KVPool:
    """Preallocated keys and values per layer: [K, V], each (n_blocks, block_size, heads, d)."""

    def __init__(self, n_layers: int, n_blocks: int, block_size: int, heads: int, head_dim: int,
                 dtype=torch.float64, device="cpu"):
        self.n_blocks, self.block_size = n_blocks, block_size
        shape = (n_blocks, block_size, heads, head_dim)
        self.layers = [[torch.zeros(shape, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device)] for _ in range(n_layers)]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: the new block starts as a copy of the shared one, in every layer."""
        for k, v in self.layers:
            k[dst], v[dst] = k[src], v[src]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)


class BlockManager:
    """Block tables, reference counts and the prefix cache of a pool of `n_blocks` blocks."""

    def __init__(self, n_blocks: int, block_size: int, prefix_cache: bool = True):
        self.n_blocks, self.block_size, self.prefix_cache = n_blocks, block_size, prefix_cache
        self.free: dict[int, None] = dict.fromkeys(range(n_blocks))  # ordered: oldest freed first
        self.refs = [0] * n_blocks
        self.key_of: list[tuple | None] = [None] * n_blocks  # the cache key a full block holds
        self.cached: dict[tuple, int] = {}  # (hash of the previous key, block tokens) -> block
        self.tables: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}  # positions reserved per sequence
        self.tokens: dict[int, list[int]] = {}  # token ids known per sequence (for the keys)
        self.hashed: dict[int, int] = {}  # leading blocks of a sequence already keyed
        self.copies = self.hit_blocks = self.taken = 0

    # -- blocks ------------------------------------------------------------------------------
    def _take(self) -> int:
        if not self.free:
            raise MemoryError("no free KV block")
        b = next(iter(self.free))  # the block freed longest ago: its cached prefix is the coldest
        del self.free[b]
        if self.key_of[b] is not None:  # evict its old contents from the prefix cache
            if self.cached.get(self.key_of[b]) == b:
                del self.cached[self.key_of[b]]
            self.key_of[b] = None
        self.refs[b] = 1
        self.taken += 1
        return b

    def _release(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free[b] = None  # contents and cache key kept until the block is taken again

    def _keys(self, tokens: list[int], n_blocks: int) -> list[tuple]:
        keys, prev = [], 0  # hash() of a tuple of ints is the same in every process
        for i in range(n_blocks):
            key = (prev, tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))
            keys.append(key)
            prev = hash(key)
        return keys

    def hits(self, prompt: list[int]) -> list[int]:
        """Cached blocks for the prompt's leading full blocks, stopping at the first miss. The
        last prompt token is always computed (its logits give the first output token), so a
        prompt of whole blocks reuses at most all but its last."""
        found = []
        if not self.prefix_cache:
            return found
        for key in self._keys(prompt, (len(prompt) - 1) // self.block_size):
            b = self.cached.get(key)
            if b is None:
                break
            found.append(b)
        return found

    def blocks_needed(self, prompt: list[int]) -> int:
        """Free blocks an allocation of `prompt` would consume (a revived cached block counts)."""
        hit = self.hits(prompt)
        return -(-len(prompt) // self.block_size) - len(hit) + sum(b in self.free for b in hit)

    # -- sequences ---------------------------------------------------------------------------
    def allocate(self, seq: int, prompt: list[int]) -> int:
        """Blocks for a new sequence's prompt, all or nothing; returns the number of leading
        prompt tokens whose keys and values are already in the pool (prefix-cache hits)."""
        if self.blocks_needed(prompt) > len(self.free):
            raise MemoryError("no free KV block")
        table = []
        for b in self.hits(prompt):
            if b in self.free:  # an evictable block with the right contents: revive it
                del self.free[b]
            self.refs[b] += 1
            table.append(b)
        cached = len(table) * self.block_size
        self.hit_blocks += len(table)
        while len(table) < -(-len(prompt) // self.block_size):
            table.append(self._take())
        self.tables[seq], self.slots[seq], self.tokens[seq] = table, len(prompt), list(prompt)
        self.hashed[seq] = len(self.hits(prompt))  # cached blocks are keyed already
        self._key_full_blocks(seq)
        return cached

    def needs_block(self, seq: int) -> bool:
        """Whether reserving the next position takes a free block (a new or a copied one)."""
        n = self.slots[seq]
        return n % self.block_size == 0 or self.refs[self.tables[seq][-1]] > 1

    def append_slot(self, seq: int) -> tuple[int, tuple[int, int] | None]:
        """Reserve the next position: (its flat slot, the (source, destination) block copy to
        apply first, or None). A new block when the last is full; a copy when it is shared."""
        table, n, copy = self.tables[seq], self.slots[seq], None
        if n % self.block_size == 0:
            table.append(self._take())
        elif self.refs[table[-1]] > 1:  # copy-on-write: the others keep the old block
            old = table[-1]
            table[-1] = self._take()
            self.refs[old] -= 1
            self.copies += 1
            copy = (old, table[-1])
        self.slots[seq] = n + 1
        return self.slot(seq, n), copy

    def add_tokens(self, seq: int, ids: list[int]) -> None:
        """Token ids now known for the reserved positions: full blocks enter the prefix cache."""
        self.tokens[seq].extend(ids)
        self._key_full_blocks(seq)

    def _key_full_blocks(self, seq: int) -> None:
        full = min(len(self.tokens[seq]), self.slots[seq]) // self.block_size
        if full <= self.hashed[seq] or not self.prefix_cache:
            return
        table = self.tables[seq]
        for i, key in enumerate(self._keys(self.tokens[seq], full)):
            if i >= self.hashed[seq] and key not in self.cached and self.key_of[table[i]] is None:
                self.cached[key], self.key_of[table[i]] = table[i], key
        self.hashed[seq] = full

    def append(self, seq: int, token: int) -> tuple[int, int] | None:
        """One decoded token whose id is known now (the bookkeeping-only path)."""
        _, copy = self.append_slot(seq)
        self.add_tokens(seq, [token])
        return copy

    def fork(self, parent: int, child: int) -> None:
        """A second sequence continuing the parent's (parallel sampling): shares every block."""
        self.tables[child] = list(self.tables[parent])
        self.slots[child], self.tokens[child] = self.slots[parent], list(self.tokens[parent])
        self.hashed[child] = self.hashed[parent]
        for b in self.tables[child]:
            self.refs[b] += 1

    def finish(self, seq: int) -> None:
        for b in reversed(self.tables.pop(seq)):  # the tail first: evicted before the prefix
            self._release(b)
        del self.slots[seq], self.tokens[seq], self.hashed[seq]

    def slot(self, seq: int, pos: int) -> int:
        return self.tables[seq][pos // self.block_size] * self.block_size + pos % self.block_size

    def held(self) -> int:
        return self.n_blocks - len(self.free)

    def check(self) -> list[str]:
        """Every invariant that must hold after any operation; returns the violations."""
        errors, uses = [], [0] * self.n_blocks
        for seq, table in self.tables.items():
            for b in table:
                uses[b] += 1
            if len(table) != -(-self.slots[seq] // self.block_size):
                errors.append(f"seq {seq}: {len(table)} blocks for {self.slots[seq]} positions")
        for b in range(self.n_blocks):
            if uses[b] != self.refs[b]:
                errors.append(f"block {b}: refcount {self.refs[b]} but {uses[b]} users")
            if (b in self.free) != (uses[b] == 0):
                errors.append(f"block {b}: {'free' if b in self.free else 'lost'} with {uses[b]} users")
        for key, b in self.cached.items():
            if self.key_of[b] != key:
                errors.append(f"the prefix cache names block {b} for contents it does not hold")
        return errors


class LeakyManager(BlockManager):
    """Negative control: finishing a sequence frees its blocks even when others still use them."""

    def _release(self, b: int) -> None:
        self.refs[b] = 0
        self.free[b] = None


def random_stream(manager: BlockManager, n_ops: int, seed: int = 0, prefixes: int = 3,
                  prefix_len: int = 12) -> dict:
    """A long random stream of admit / decode / fork / finish operations, the invariants
    checked after every one. Prompts start with one of a few shared system prompts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(prefix_len)] for _ in range(prefixes)]
    live, next_id, counts, violations = [], 0, {"admit": 0, "decode": 0, "fork": 0, "finish": 0}, []
    for _ in range(n_ops):
        op = rng.choices(["admit", "decode", "fork", "finish"], [3, 10, 1, 2.5])[0]
        try:
            if op == "admit" or not live:
                op = "admit"
                prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
                manager.allocate(next_id, prompt)
                live.append(next_id)
                next_id += 1
            elif op == "decode":
                manager.append(rng.choice(live), rng.randrange(1000))
            elif op == "fork":
                manager.fork(rng.choice(live), next_id)
                live.append(next_id)
                next_id += 1
            else:
                manager.finish(live.pop(rng.randrange(len(live))))
        except MemoryError:  # a full pool: preempt the newest sequence, as vLLM does
            op = "finish"
            manager.finish(live.pop())
        counts[op] += 1
        errs = manager.check()
        if errs:
            violations.append(errs[0])
    for seq in list(live):
        manager.finish(seq)
    return {"counts": counts, "violations": len(violations), "first_violation": violations[:1],
            "free_at_end": len(manager.free), "copies": manager.copies,
            "shared_hits": manager.hit_blocks}
