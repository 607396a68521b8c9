"""Chapter 07: hand-written collectives equal torch.distributed's, send the bytes the formulas
say, and the benchmark's bandwidth columns follow nccl-tests' arithmetic.

References are computed here, independently of the chapter (sums of every rank's input built
locally), and every parity check has a negative control that the same check rejects: a ring
that skips one all-gather step, a reduce-scatter that overwrites instead of adding, and the
naive all-reduce whose counted bytes are not the ring's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch07_communication import broadcast_test, collectives, cost_model, train
from common.launch import run_on_ranks, run_python, run_torchrun

SCRIPT = Path(train.__file__)
LENGTHS = (1, 3, 12, 1001)  # 12 divides by 2, 3 and 4; 1 and 3 leave empty chunks on 4 ranks
FLOAT_TOL = 1e-12  # float64 sums of ≤ 4 normals in a different order: ~1e-16 apart


def reference_sum(numel: int, dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """The all-reduce result, computed in one process from every rank's input."""
    total = torch.zeros(numel, dtype=dtype)
    for q in range(n):
        total += train.rank_data(numel, dtype, q, seed, "cpu")
    return total


def equal(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    if a.shape != b.shape:
        return False
    return torch.equal(a, b) if not dtype.is_floating_point else torch.allclose(a, b, rtol=0, atol=FLOAT_TOL)


def ring_all_gather_skipping_last_step_(chunks, comm):
    """Broken: the last all-gather step is left out, so one chunk never arrives."""
    r, n = comm.rank, comm.world_size
    for s in range(n - 2):
        comm.exchange(chunks[(r - s) % n], (r + 1) % n, chunks[(r - s - 1) % n], (r - 1) % n)


def ring_reduce_scatter_overwriting_(chunks, comm):
    """Broken: received chunks replace the local one instead of being added to it."""
    r, n = comm.rank, comm.world_size
    for s in range(n - 1):
        comm.exchange(chunks[(r - s - 1) % n], (r + 1) % n, chunks[(r - s - 2) % n], (r - 1) % n)


def _on_ranks() -> dict:
    """On n gloo ranks: every hand collective against the library and the local reference,
    counted bytes against the formulas, and the broken variants."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = {"mismatch": [], "lib_mismatch": []}
    for dtype, lengths in ((torch.int64, LENGTHS), (torch.float64, (1001,))):  # float64: tolerance
        for numel in lengths:
            x = train.rank_data(numel, dtype, r, 0, "cpu")
            ref = reference_sum(numel, dtype, n)
            lib = x.clone()
            dist.all_reduce(lib)
            comm = collectives.P2P()
            results = {
                "ring": collectives.ring_all_reduce(x, comm),
                "tree": collectives.tree_all_reduce(x, comm),
                "naive": collectives.naive_all_reduce(x, comm),
                "reduce_scatter": collectives.ring_reduce_scatter(x, comm),
                "all_gather": collectives.ring_all_gather(
                    x.tensor_split(n)[r], comm, [len(c) for c in x.tensor_split(n)]),
            }
            expected = {"ring": ref, "tree": ref, "naive": ref,
                        "reduce_scatter": ref.tensor_split(n)[r], "all_gather": x_all(numel, dtype, n)}
            for name, got in results.items():
                if not equal(got, expected[name], dtype):
                    out["mismatch"].append((name, str(dtype), numel))
            if not equal(lib, ref, dtype):
                out["lib_mismatch"].append((str(dtype), numel))
            if numel % n == 0:  # the library's own tensor forms need equal shards
                rs = torch.empty(numel // n, dtype=dtype)
                collectives.library_reduce_scatter(rs, x.clone())
                ag = torch.empty(numel, dtype=dtype)
                collectives.library_all_gather(ag, x.tensor_split(n)[r].contiguous())
                if not equal(results["reduce_scatter"], rs, dtype) or not equal(results["all_gather"], ag, dtype):
                    out["mismatch"].append(("library tensor forms", str(dtype), numel))

    # Bytes and messages each rank sends, counted by the P2P wrapper.
    for algorithm in ("ring", "tree", "naive"):
        for numel in (12 * 64, 12 * 64 + 1):
            comm = collectives.P2P()
            train.HAND_ALL_REDUCE[algorithm](torch.ones(numel), comm)
            out[(algorithm, numel)] = (comm.bytes_sent, comm.messages)

    # Negative controls: the same equality checks must reject broken rings.
    x = train.rank_data(1001, torch.int64, r, 0, "cpu")
    ref = reference_sum(1001, torch.int64, n)
    saved_ag, saved_rs = collectives.ring_all_gather_, collectives.ring_reduce_scatter_
    try:
        collectives.ring_all_gather_ = ring_all_gather_skipping_last_step_
        out["skip_step_equal"] = equal(collectives.ring_all_reduce(x, collectives.P2P()), ref, torch.int64)
        collectives.ring_all_gather_ = saved_ag
        collectives.ring_reduce_scatter_ = ring_reduce_scatter_overwriting_
        out["overwrite_equal"] = equal(collectives.ring_all_reduce(x, collectives.P2P()), ref, torch.int64)
    finally:
        collectives.ring_all_gather_, collectives.ring_reduce_scatter_ = saved_ag, saved_rs
    out["after_restore_equal"] = equal(collectives.ring_all_reduce(x, collectives.P2P()), ref, torch.int64)

    if n == 2:  # the broadcast test's pieces: data arrives, a rank that missed it is caught
        src = broadcast_test.pattern(1000, "cpu")
        y = src.clone() if r == 0 else torch.zeros(1000, dtype=torch.bfloat16)
        seconds = broadcast_test.timed_broadcasts(y, 0, 3, torch.device("cpu"))
        out["bcast_slowest"] = broadcast_test.slowest(seconds, "cpu")
        out["bcast_own"] = seconds
        out["bcast_bad"] = broadcast_test.count_mismatches(y, "cpu")
        z = src.clone() if r == 0 else torch.zeros(1000, dtype=torch.bfloat16)  # never broadcast
        out["bcast_bad_control"] = broadcast_test.count_mismatches(z, "cpu")
    return out


def x_all(numel: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """What all-gather returns: every rank's own shard of its input, in rank order."""
    return torch.cat([train.rank_data(numel, dtype, q, 0, "cpu").tensor_split(n)[q] for q in range(n)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_hand_collectives_equal_the_library_and_send_the_formula_bytes(n):
    ranks = run_on_ranks(_on_ranks, n, timeout=90)
    for r, res in enumerate(ranks):
        assert not res["lib_mismatch"], "the independent reference itself is wrong"
        assert not res["mismatch"], f"rank {r}: {res['mismatch']}"
        # ring: 2(n−1)/n·S when n divides the length; the chunked formula otherwise
        for numel in (12 * 64, 12 * 64 + 1):
            c = [numel // n + (1 if i < numel % n else 0) for i in range(n)]
            sent, messages = res[("ring", numel)]
            assert sent == 4 * (2 * numel - c[r] - c[(r + 1) % n])
            assert messages == 2 * (n - 1)
        assert res[("ring", 12 * 64)][0] * n == 2 * (n - 1) * (12 * 64 * 4)  # 2(n−1)/n · S
        # tree: the whole tensor to the parent and to each child
        children = sum(1 for ch in (2 * r + 1, 2 * r + 2) if ch < n)
        assert res[("tree", 12 * 64)][0] == 4 * 12 * 64 * (children + (r != 0))
        # negative control: the naive all-reduce does not send the ring's bytes
        naive, ring = res[("naive", 12 * 64)][0], res[("ring", 12 * 64)][0]
        assert naive == (n - 1) * 4 * 12 * 64 if r == 0 else naive == 4 * 12 * 64
        if n > 2 and r == 0:
            assert naive != ring, "the byte check cannot tell naive from ring"
        if n == 2:  # on two ranks every algorithm sends S per rank: only the message count differs
            assert naive == ring and res[("naive", 12 * 64)][1] == 1 != res[("ring", 12 * 64)][1]
        assert res["skip_step_equal"] is False, "a ring missing an all-gather step went unnoticed"
        assert res["overwrite_equal"] is False, "a reduce-scatter that overwrites went unnoticed"
        assert res["after_restore_equal"] is True
    if n == 2:
        assert all(res["bcast_bad"] == 0 for res in ranks)
        nonzero = int((broadcast_test.pattern(1000, "cpu") != 0).sum())  # rank 1 kept its zeros
        assert all(res["bcast_bad_control"] == nonzero > 0 for res in ranks)
        assert ranks[0]["bcast_slowest"] == max(res["bcast_own"] for res in ranks)


def test_busbw_arithmetic_follows_nccl_tests():
    # 1 GB in 1 s on 8 ranks: algbw 1 GB/s; all-reduce busbw 2·7/8, all-gather 7/8, broadcast 1
    assert cost_model.alg_bandwidth(1e9, 1.0) == 1.0
    assert cost_model.bus_bandwidth("all_reduce", 1e9, 1.0, 8) == pytest.approx(1.75, abs=1e-15)
    assert cost_model.bus_bandwidth("all_gather", 1e9, 1.0, 8) == pytest.approx(0.875, abs=1e-15)
    assert cost_model.bus_bandwidth("reduce_scatter", 1e9, 1.0, 8) == pytest.approx(0.875, abs=1e-15)
    assert cost_model.bus_bandwidth("broadcast", 1e9, 1.0, 8) == 1.0
    assert cost_model.bus_bandwidth("all_reduce", 5e8, 0.25, 2) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        cost_model.bus_factor("gossip", 4)


def test_alpha_beta_model_matches_counted_messages_and_bytes():
    for n in (2, 3, 4, 8):
        numel = 24 * 5
        # β term with β = 1 s/byte: the bytes a ring rank sends; α term: its 2(n−1) messages
        assert cost_model.predicted_time("ring", numel * 4, n, 0.0, 1.0) == pytest.approx(
            collectives.expected_bytes_sent("ring", numel, n, 0, 4))
        assert cost_model.predicted_time("ring", numel * 4, n, 1.0, 0.0) == 2 * (n - 1)
        assert cost_model.predicted_time("naive", 1.0, n, 0.0, 1.0) == 2 * (n - 1)
    # a fit recovers a line it is given, and reads it as the ring's α and β
    sizes = [8 * 4**k for k in range(10)]
    times = [3e-4 + s / 1e9 for s in sizes]
    a, b = cost_model.fit_latency_bandwidth(sizes, times)
    assert a == pytest.approx(3e-4, rel=1e-9) and b == pytest.approx(1e-9, rel=1e-9)
    alpha, beta = cost_model.ring_alpha_beta(a, b, 4)
    assert alpha == pytest.approx(3e-4 / 6) and beta == pytest.approx(1e-9 / 1.5)
    # large messages: the ring beats the binary tree; small messages on many ranks: the reverse
    assert cost_model.predicted_time("ring", 2**30, 64, 5e-6, 1 / 25e9) < \
        cost_model.predicted_time("tree", 2**30, 64, 5e-6, 1 / 25e9)
    assert cost_model.predicted_time("double_tree", 1024, 64, 5e-6, 1 / 25e9) < \
        cost_model.predicted_time("ring", 1024, 64, 5e-6, 1 / 25e9)


def test_ring_schedule_forwards_what_was_received():
    for n in (2, 3, 5):
        steps = collectives.ring_schedule(n)
        assert len(steps) == 2 * (n - 1)
        for s in range(1, n - 1):  # within reduce-scatter: send what you just received
            assert all(steps[s][r][0] == steps[s - 1][r][1] for r in range(n))
        for step in steps:  # what rank r receives is what rank r−1 sends
            assert all(step[r][1] == step[(r - 1) % n][0] for r in range(n))
        assert sorted(steps[0][r][0] for r in range(n)) == list(range(n))
        assert collectives.chunk_sizes(7, 3) == [len(c) for c in torch.arange(7).tensor_split(3)]


@pytest.mark.timeout(120)
def test_benchmark_run_prints_nccl_tests_columns(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, args=["--max-bytes", "8192", "--steps", "3", "--timeout", "60"],
                       out_dir=tmp_path, timeout=100)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"] and c["kind"] != "timing"]
    assert not failed, res.output[-3000:]
    assert len([c for c in res.summary["checks"] if c["kind"] == "parity"]) == 10
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0, "all_to_all": 0.5}
    assert {row["op"] for row in rows} == set(factor)
    assert {row["impl"] for row in rows if row["op"] == "all_reduce"} == {"torch", "ring", "tree", "naive"}
    assert sorted({row["size"] for row in rows if row["op"] == "all_reduce"}) == [8, 32, 128, 512, 2048, 8192]
    for row in rows:  # the script's table follows nccl-tests' arithmetic (n = 2)
        algbw = row["size"] / (row["time_us"] * 1e-6) / 1e9
        assert math.isclose(row["algbw"], algbw, rel_tol=1e-9)
        assert math.isclose(row["busbw"], algbw * factor[row["op"]], rel_tol=1e-9)
    assert "α–β fit" in res.output and "busbw(GB/s)" in res.output
    assert res.check("hand ring busbw / torch busbw (largest size)")["kind"] == "timing"  # reported only


@pytest.mark.timeout(60)
def test_broadcast_script_alone_and_bad_input(tmp_path, monkeypatch):
    res = run_python(broadcast_test.__file__, args=["--size-mib", "1", "--steps", "2"],
                     out_dir=tmp_path, timeout=50)
    assert res.check("elements differing from the source, all ranks")["measured"] == 0
    for cls, argv in ((train.Config, ["--factor", "1"]), (train.Config, ["--dtype", "int8"]),
                      (train.Config, ["--min-bytes", "64", "--max-bytes", "8"]),
                      (broadcast_test.Config, ["--size-mib", "0"])):
        with pytest.raises(SystemExit) as e:
            train.parse_config(cls, argv)
        assert e.value.code == 2
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as e:
        broadcast_test.main(broadcast_test.Config(src=3, out=str(tmp_path)))
    assert "is not a rank of a world of 1" in str(e.value.code)
    assert not dist.is_initialized()
