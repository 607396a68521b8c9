"""A serving engine over the hand Llama whose attention reads a paged KV pool through block
tables: continuous (or static) batching, prefix caching, parallel sampling with copy-on-write,
preemption by recompute when the pool runs out, and an overlap scheduler.

Each iteration is a *plan* made by the scheduler (CPU work: which sequences run, which blocks
they write, which requests are admitted and which are preempted) and then *executed* (the model:
the admitted requests' prefills, block copies, one decode step over every running sequence).
`mode="overlap"` executes plans on a second thread, the stand-in for a GPU stream, and makes
plan t+1 while plan t executes (SGLang's overlap scheduler, vLLM's async scheduling): the
scheduler here knows which sequences finish from their lengths (the outputs have fixed lengths;
a real engine cannot know an end-of-sequence token in advance, so SGLang schedules such a request
one more step and discards the extra token), so it needs no token of step t, and the decode
inputs of step t+1 (step t's tokens) are filled in by the executor, which runs plans in order.
Every plan is made from blocks actually free, so the lookahead never admits more than the pool
holds.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from chapters.ch28_inference.model import HandLlama
from chapters.ch28_inference.paged import BlockManager

MODES = ("static", "continuous", "overlap")


@dataclass
class Request:
    prompt: list[int]
    n_decode: int
    """Decode steps: the request's output is 1 + n_decode tokens (its prefill gives the first)."""
    n: int = 1
    """Parallel samples (forked after the prefill, sharing its blocks)."""


@dataclass
class Seq:
    sid: int
    req: int
    sample: int
    ids: list[int]  # prompt + output tokens known so far
    want: int  # output tokens wanted
    fork: int = 1  # samples to fork at admission (1 after a preemption)
    planned: int = 0  # output tokens that exist once every submitted plan has run
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    n_pos: int = 0  # cache positions reserved


class Chooser:
    """Greedy (temperature 0) or Gumbel-max sampling with noise fixed by (seed, request, sample,
    output index): the same draw in the engine and in the reference, whatever the schedule."""

    def __init__(self, temperature: float = 0.0, seed: int = 0):
        self.t, self.seed = temperature, seed

    def perturbed(self, logits: torch.Tensor, req: int, sample: int, k: int) -> torch.Tensor:
        if self.t == 0:
            return logits
        g = torch.Generator().manual_seed(hash((self.seed, req, sample, k)) % 2**62)
        u = torch.rand(logits.shape[-1], generator=g, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
        return logits + self.t * -torch.log(-torch.log(u)).to(logits.device, logits.dtype)

    def __call__(self, logits, req, sample, k) -> int:
        return int(self.perturbed(logits, req, sample, k).argmax())


def reference(model: HandLlama, prompt: list[int], n_out: int, choose: Chooser, req: int = 0,
              sample: int = 0):
    """One request alone with a contiguous KV cache (chapter 28's `generate`): tokens, logits
    (n_out, V) and the smallest top-2 gap of the choices (a token can flip only inside it)."""
    cache, step_in, start, toks, logits, margin = model.new_cache(), torch.tensor([prompt]), 0, [], [], float("inf")
    for k in range(n_out):
        out = model.forward(step_in, cache, start)[0, -1]
        start += step_in.shape[1]
        top = choose.perturbed(out, req, sample, k).topk(2).values
        margin = min(margin, float(top[0] - top[1]))
        toks.append(choose(out, req, sample, k))
        logits.append(out)
        step_in = torch.tensor([[toks[-1]]])
    return toks, torch.stack(logits), margin


class Engine:
    def __init__(self, model: HandLlama, n_blocks: int, block_size: int, batch: int,
                 mode: str = "continuous", prefix_cache: bool = True, choose: Chooser | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.model, self.batch, self.mode = model, batch, mode
        self.pool = model.kv_pool(n_blocks, block_size)
        self.mgr = BlockManager(n_blocks, block_size, prefix_cache)
        self.choose = choose or Chooser()
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []  # oldest admitted first: the newest is preempted first
        self.last: dict[int, int] = {}  # each sequence's newest token, kept by the executor
        self.stats = dict(decode_steps=0, prefills=0, prefill_tokens=0, cached_tokens=0,
                          preemptions=0, copies=0, peak_blocks=0, plans=0)
        self.timeline: list[tuple[str, int, float, float]] = []  # (kind, plan, start, end)

    # -- the scheduler (CPU) -----------------------------------------------------------------
    def _preempt(self, seq: Seq) -> None:
        """Recompute preemption (vLLM's default): free the blocks, keep the tokens, requeue first."""
        self.running.remove(seq)
        self.mgr.finish(seq.sid)
        seq.fork = 1
        self.waiting.insert(0, seq)
        self.stats["preemptions"] += 1

    def _admissible(self, seq: Seq) -> bool:
        if len(seq.out) != seq.planned:  # a token of it still in flight: its prompt is not known
            return False
        need = self.mgr.blocks_needed(seq.ids) + seq.fork  # + each sample's first decode block
        return need <= len(self.mgr.free) and len(self.running) + seq.fork <= self.batch

    def schedule(self) -> dict:
        plan = {"no": self.stats["plans"], "copies": [], "prefills": [], "decode": []}
        for seq in [s for s in self.running if s.planned == s.want]:  # done: release the blocks
            self.running.remove(seq)
            self.mgr.finish(seq.sid)
        preempted = self.stats["preemptions"]
        for seq in list(self.running):  # every running sequence writes its next position
            while seq in self.running and self.mgr.needs_block(seq.sid) and not self.mgr.free:
                self._preempt(self.running[-1])
            if seq in self.running:
                self._decode_slot(plan, seq)
        # no admission in a plan that preempted, as vLLM V1's scheduler does: the pool was just
        # short of blocks, and a preempted sequence must not come straight back (in overlap mode
        # its token of the step in flight is not known yet; `_admissible` checks that too)
        if self.stats["preemptions"] == preempted and (self.mode != "static" or not self.running):
            while self.waiting and self._admissible(self.waiting[0]):
                self._admit(plan, self.waiting.pop(0))  # `_admissible` keeps it to `batch`
        # the block tables as this plan sees them: the next plan may change them while it runs
        plan["tables"] = [list(self.mgr.tables[s.sid]) for s, *_ in plan["decode"]]
        self.stats["peak_blocks"] = max(self.stats["peak_blocks"], self.mgr.held())
        self.stats["plans"] += 1
        return plan

    def _decode_slot(self, plan: dict, seq: Seq) -> None:
        slot, copy = self.mgr.append_slot(seq.sid)
        if copy:
            plan["copies"].append(copy)
            self.stats["copies"] += 1
        plan["decode"].append((seq, seq.n_pos, slot, seq.planned))
        seq.n_pos += 1
        seq.planned += 1

    def _admit(self, plan: dict, seq: Seq) -> None:
        cached = self.mgr.allocate(seq.sid, seq.ids)
        seq.n_pos = len(seq.ids)
        pos = list(range(cached, len(seq.ids)))
        samples = [seq]
        for s in range(1, seq.fork):  # parallel sampling: the samples share the prompt's blocks
            child = Seq(self._new_sid(), seq.req, s, list(seq.ids), seq.want, n_pos=seq.n_pos)
            self.mgr.fork(seq.sid, child.sid)
            samples.append(child)
        for s in samples:
            self.everyone[(s.req, s.sample)] = s
        plan["prefills"].append({"ids": seq.ids[cached:], "pos": pos,
                                 "slots": [self.mgr.slot(seq.sid, p) for p in pos],
                                 "table": list(self.mgr.tables[seq.sid]),
                                 "samples": [(s, s.planned) for s in samples]})
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += len(pos)
        self.stats["cached_tokens"] += cached
        for s in samples:
            s.planned += 1
            self.running.append(s)
            if s.planned < s.want:
                self._decode_slot(plan, s)

    def _new_sid(self) -> int:
        self.next_sid += 1
        return self.next_sid - 1

    # -- the executor (the model) ------------------------------------------------------------
    def execute(self, plan: dict) -> list:
        t0, dev, out = time.perf_counter(), self.model.device, []
        for pf in plan["prefills"]:
            t = lambda xs: torch.tensor([xs], device=dev)  # noqa: E731
            logits = self.model.forward_paged(t(pf["ids"]), t(pf["pos"]), t(pf["slots"]),
                                              t(pf["table"]), self.pool)[0, -1]
            for seq, k in pf["samples"]:
                out.append((seq, k, self._pick(seq, logits, k)))
        for src, dst in plan["copies"]:  # after the prefills: a fork copies a block they filled
            self.pool.copy_block(src, dst)
        if plan["decode"]:
            rows = plan["decode"]
            width = max(len(t) for t in plan["tables"])  # padded with block 0: masked by position
            tables = [t + [0] * (width - len(t)) for t in plan["tables"]]
            col = lambda xs: torch.tensor(xs, device=dev)[:, None]  # noqa: E731
            logits = self.model.forward_paged(col([self.last[s.sid] for s, *_ in rows]),
                                              col([p for _, p, _, _ in rows]), col([sl for _, _, sl, _ in rows]),
                                              torch.tensor(tables, device=dev), self.pool)[:, 0]
            greedy = logits.argmax(-1).tolist() if self.choose.t == 0 else None  # one sync
            for j, ((seq, _, _, k), row) in enumerate(zip(rows, logits)):
                out.append((seq, k, self._pick(seq, row, k, None if greedy is None else greedy[j])))
        self.timeline.append(("step", plan["no"], t0, time.perf_counter()))
        return out

    def _pick(self, seq: Seq, logits: torch.Tensor, k: int, token: int | None = None):
        """The sequence's k-th output token. Reading it as a Python int waits for the device, so
        the clocks read after a step are synchronised (and the next step's input is known)."""
        if token is None:
            token = self.choose(logits, seq.req, seq.sample, k)
        self.last[seq.sid] = token
        return token, logits

    def postprocess(self, results: list) -> None:
        now = time.perf_counter() - self.t0
        for seq, k, (token, logits) in results:
            assert k == len(seq.out), "tokens must arrive in order"
            seq.out.append(token)
            seq.ids.append(token)
            seq.logits.append(logits)
            if k == 0:
                self.ttft[(seq.req, seq.sample)] = now
            if len(seq.out) == seq.want:
                self.done_at[(seq.req, seq.sample)] = now
            if seq.sid in self.mgr.tables:
                self.mgr.add_tokens(seq.sid, [token])

    # -- the loop ----------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> dict:
        bs, pool = self.mgr.block_size, self.mgr.n_blocks
        for i, r in enumerate(requests):
            if -(-(len(r.prompt) + r.n_decode + 1) // bs) + r.n > pool or r.n > self.batch:
                raise ValueError(f"request {i} needs more KV blocks than the pool's {pool} or more "
                                 f"samples than the batch's {self.batch}")
        self.next_sid = 0
        self.waiting = [Seq(self._new_sid(), i, 0, list(r.prompt), 1 + r.n_decode, fork=r.n)
                        for i, r in enumerate(requests)]
        self.ttft, self.done_at, self.t0 = {}, {}, time.perf_counter()
        self.everyone: dict[tuple[int, int], Seq] = {}
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor") as device:
            inflight = None
            while self.waiting or self.running or inflight is not None:
                t0 = time.perf_counter()
                plan = self.schedule()
                self.timeline.append(("schedule", plan["no"], t0, time.perf_counter()))
                empty = not plan["prefills"] and not plan["decode"]
                if plan["decode"]:
                    self.stats["decode_steps"] += 1
                if self.mode == "overlap":
                    nxt = None if empty else device.submit(self.execute, plan)
                    if inflight is not None:
                        self.postprocess(inflight.result())
                    inflight = nxt
                elif not empty:
                    self.postprocess(self.execute(plan))
                if empty and inflight is None and not self.running and self.waiting \
                        and not self._admissible(self.waiting[0]):
                    raise RuntimeError("the scheduler cannot admit the next request (pool too small)")
        seqs = {k: self.everyone[k] for k in sorted(self.everyone)}
        return {"tokens": {k: s.out for k, s in seqs.items()},
                "logits": {k: torch.stack(s.logits) for k, s in seqs.items()},
                "ttft": self.ttft, "done_at": self.done_at, "seconds": time.perf_counter() - self.t0,
                **self.stats, "timeline": self.timeline}
