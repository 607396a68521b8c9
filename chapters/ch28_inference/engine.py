"""A small serving engine over the hand Llama: static batching, continuous batching, and
continuous batching whose next admissions are prepared on a second CPU thread while the
current decode step computes (the overlap scheduler of SGLang, vLLM's async scheduling).

Every engine runs `batch` fixed slots per decode step. A request is admitted by a prefill
(its prompt alone, B = 1), whose last logits give its first token; its keys and values are then
copied into a free slot, and each decode step extends every slot by one token.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from chapters.ch28_inference.model import HandLlama


def prefill(model: HandLlama, prompt: torch.Tensor):
    """(first token, its logits, per-layer (k, v) of the prompt): the request's admission work."""
    cache = model.new_cache()
    logits = model.forward(prompt, cache, 0)[0, -1]  # forward moves the prompt to the model's device
    return int(logits.argmax()), logits, [(k[0], v[0]) for k, v in cache]


def serve(model: HandLlama, requests: list[tuple[torch.Tensor, int]], batch: int, mode: str) -> dict:
    """Generate `n_out` greedy tokens for each (prompt (1, p), n_out); `mode` is "static",
    "continuous" or "async". Returns tokens and logits per request, decode steps, slot steps,
    TTFT and finish times (seconds from the start), and the prefills that overlapped a step."""
    if mode not in ("static", "continuous", "async"):
        raise ValueError(f"mode must be static, continuous or async, not {mode!r}")
    max_len = max(p.shape[1] + n for p, n in requests)
    kv = model.slot_cache(batch, max_len)
    tokens = {i: [] for i in range(len(requests))}
    logits = {i: [] for i in range(len(requests))}
    ttft, done_at = {}, {}
    slot_req = [None] * batch  # the request each slot serves (None: idle)
    cur = torch.zeros(batch, dtype=torch.long, device=model.device)
    pos = torch.zeros(batch, dtype=torch.long, device=model.device)
    waiting = list(range(len(requests)))
    steps, overlapped, busy = 0, [0], threading.Event()
    t0 = time.perf_counter()

    ready: queue.Queue = queue.Queue()
    if mode == "async":  # a second thread prefills the waiting requests in order, ahead of need
        order = list(waiting)

        def worker():
            for i in order:
                if busy.is_set():
                    overlapped[0] += 1
                ready.put((i, *prefill(model, requests[i][0])))
        thread = threading.Thread(target=worker, daemon=True)
        thread.start()

    def admit(slot: int) -> None:
        i = waiting.pop(0)
        got = ready.get() if mode == "async" else (i, *prefill(model, requests[i][0]))
        assert got[0] == i
        _, first, first_logits, prompt_kv = got
        ttft[i] = time.perf_counter() - t0
        tokens[i].append(first)
        logits[i].append(first_logits)
        if len(tokens[i]) == requests[i][1]:
            done_at[i] = ttft[i]
            return
        p = requests[i][0].shape[1]
        for layer, (k, v) in zip(kv, prompt_kv):
            layer[0][slot, :, :p], layer[1][slot, :, :p] = k, v
        slot_req[slot], cur[slot], pos[slot] = i, first, p

    def finish_slot(slot: int) -> None:
        done_at[slot_req[slot]] = time.perf_counter() - t0
        slot_req[slot] = None

    while waiting or any(r is not None for r in slot_req):
        if mode == "static":
            if all(r is None for r in slot_req):  # the next `batch` requests, when all are done;
                for slot in range(batch):  # one that ends at its prefill leaves its slot idle
                    if waiting:
                        admit(slot)
        else:  # iteration-level: fill every free slot before each step
            for slot in range(batch):
                while waiting and slot_req[slot] is None:
                    admit(slot)
        if all(r is None for r in slot_req):
            continue
        busy.set()
        out = model.decode_slots(cur, pos, kv)
        busy.clear()
        steps += 1
        for slot, i in enumerate(slot_req):
            if i is None:
                continue
            nxt = int(out[slot].argmax())
            tokens[i].append(nxt)
            logits[i].append(out[slot])
            cur[slot], pos[slot] = nxt, pos[slot] + 1
            if len(tokens[i]) == requests[i][1]:
                finish_slot(slot)
    return {"tokens": tokens, "logits": {i: torch.stack(v) for i, v in logits.items()},
            "steps": steps, "slot_steps": steps * batch, "ttft": ttft, "done_at": done_at,
            "seconds": time.perf_counter() - t0, "overlapped_prefills": overlapped[0]}
