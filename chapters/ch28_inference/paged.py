"""A paged KV-cache block manager (vLLM's PagedAttention bookkeeping) and the batching schedules.

Blocks of `block_size` token slots; each sequence has a block table. Full prompt blocks are
found by their token prefix (prefix caching) and shared, counted by a reference count; a
forked sequence shares every block, and the first write into a shared block copies it
(copy-on-write). A block returns to the free list only when its last user lets it go.
"""

from __future__ import annotations

import random


class BlockManager:
    def __init__(self, n_blocks: int, block_size: int):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free = list(range(n_blocks))[::-1]
        self.refs = [0] * n_blocks
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.prefix: dict[tuple, int] = {}  # full block's token prefix -> block
        self.copies = self.shared_hits = 0

    def _take(self) -> int:
        if not self.free:
            raise MemoryError("no free KV block")
        b = self.free.pop()
        self.refs[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free.append(b)
            for key in [k for k, v in self.prefix.items() if v == b]:
                del self.prefix[key]

    def allocate(self, seq: int, prompt: list[int]) -> None:
        """Blocks for a new sequence's prompt; full blocks whose prefix is cached are shared."""
        table, bs = [], self.block_size
        cached = sum(tuple(prompt[: i + bs]) in self.prefix for i in range(0, len(prompt), bs))
        if -(-len(prompt) // bs) - cached > len(self.free):  # all or nothing: no half-admitted prompt
            raise MemoryError("no free KV block")
        for i in range(0, len(prompt), bs):
            key = tuple(prompt[: i + bs])
            if len(key) == i + bs and key in self.prefix:
                b = self.prefix[key]
                self.refs[b] += 1
                self.shared_hits += 1
            else:
                b = self._take()
                if len(key) == i + bs:
                    self.prefix[key] = b
            table.append(b)
        self.tables[seq], self.tokens[seq] = table, list(prompt)

    def append(self, seq: int, token: int) -> None:
        """One decoded token: a new block when the last is full, a copy when it is shared."""
        table, n = self.tables[seq], len(self.tokens[seq])
        if n % self.block_size == 0:
            table.append(self._take())
        elif self.refs[table[-1]] > 1:  # copy-on-write: the others keep the old block
            old = table[-1]
            table[-1] = self._take()
            self.refs[old] -= 1
            self.copies += 1
        self.tokens[seq].append(token)

    def fork(self, parent: int, child: int) -> None:
        """A second sequence continuing the parent's (parallel sampling): shares every block."""
        self.tables[child] = list(self.tables[parent])
        self.tokens[child] = list(self.tokens[parent])
        for b in self.tables[child]:
            self.refs[b] += 1

    def finish(self, seq: int) -> None:
        for b in self.tables.pop(seq):
            self._release(b)
        del self.tokens[seq]

    def check(self) -> list[str]:
        """Every invariant that must hold after any operation; returns the violations."""
        errors, uses = [], [0] * self.n_blocks
        for seq, table in self.tables.items():
            for b in table:
                uses[b] += 1
            if len(table) != -(-len(self.tokens[seq]) // self.block_size):
                errors.append(f"seq {seq}: {len(table)} blocks for {len(self.tokens[seq])} tokens")
        if len(set(self.free)) != len(self.free):
            errors.append("a block is twice in the free list")
        for b in range(self.n_blocks):
            if uses[b] != self.refs[b]:
                errors.append(f"block {b}: refcount {self.refs[b]} but {uses[b]} users")
            if (b in self.free) != (uses[b] == 0):
                errors.append(f"block {b}: {'free' if b in self.free else 'lost'} with {uses[b]} users")
        if set(self.prefix.values()) & set(self.free):
            errors.append("the prefix cache points at a free block")
        return errors


class LeakyManager(BlockManager):
    """Negative control: finishing a sequence frees its blocks even when others still use them."""

    def _release(self, b: int) -> None:
        self.refs[b] = 0
        if b not in self.free:
            self.free.append(b)


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
        except MemoryError:  # a full cache: preempt the newest sequence, as vLLM does
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
            "shared_hits": manager.shared_hits}


# ---- batching schedules, counted in decode steps and padded slots --------------------------

def workload(n: int, max_out: int, seed: int = 0, max_prompt: int = 16) -> list[tuple[int, int]]:
    """(prompt length, output length) per request: outputs uniform on 1..max_out."""
    rng = random.Random(seed)
    return [(rng.randint(2, max_prompt), rng.randint(1, max_out)) for _ in range(n)]


def static_schedule(outs: list[int], batch: int) -> dict:
    """Batches of `batch` requests in order; a batch runs until its longest request ends, the
    finished rows' slots padded."""
    steps = slots = 0
    for i in range(0, len(outs), batch):
        group = outs[i: i + batch]
        steps += max(group)
        slots += max(group) * batch
    return {"steps": steps, "slots": slots, "tokens": sum(outs), "padded": slots - sum(outs)}


def continuous_schedule(outs: list[int], batch: int) -> dict:
    """`batch` slots; a finished request leaves at once and the next waiting one takes its
    slot at the next step (iteration-level scheduling, Orca)."""
    waiting, running, steps, slots = list(outs), [], 0, 0
    while waiting or running:
        while waiting and len(running) < batch:
            running.append(waiting.pop(0))
        steps += 1
        slots += batch
        running = [r - 1 for r in running if r > 1]
    return {"steps": steps, "slots": slots, "tokens": sum(outs), "padded": slots - sum(outs)}
