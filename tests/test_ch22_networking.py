"""Chapter 22: the calculator's worked numbers, the leader hierarchy against all_reduce with its
inter-node bytes counted, and (as root, COURSE_SYSTEM_TESTS=1) real launches across network
namespaces with links shaped by tc.

Everywhere: nodes are simulated by groups of consecutive ranks on loopback. The reference sums
and the one-process training are computed here, not taken from the script's own checks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch22_networking import calculator, hierarchical, netns, train
from common.checkpoint import load_checkpoint
from common.data import regression_data
from common.launch import run_on_ranks, run_torchrun
from common.models import MLP

SCRIPT = Path(train.__file__)
NUMEL = 12288


def reference_params(cfg: train.Config) -> dict:
    """One process, whole batch, plain SGD written out here."""
    X, Y = regression_data(cfg.steps * cfg.global_batch_size, 8, 1, seed=cfg.seed, dtype=torch.float64)
    torch.manual_seed(cfg.seed)
    model = MLP(8, 32, 1).double()
    for step in range(cfg.steps):
        rows = slice(step * cfg.global_batch_size, (step + 1) * cfg.global_batch_size)
        loss = ((model(X[rows]) - Y[rows]) ** 2).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= cfg.lr * g
    return model.state_dict()


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(30)
def test_calculator_worked_numbers():
    ex = calculator.worked_examples()
    S = 14e9
    # flat ring on 400 Gb/s InfiniBand: 2·127·5 µs + 2·127/128·14e9 / 50e9
    assert ex["flat ring on IB (s)"] == pytest.approx(2 * 127 * 5e-6 + 2 * 127 / 128 * S / 50e9)
    assert ex["flat ring on IB (s)"] == pytest.approx(0.5569, abs=1e-4)
    assert ex["flat ring on 100 GbE (s)"] == pytest.approx(2 * 127 * 30e-6 + 2 * 127 / 128 * S / 12.5e9)
    # leader: reduce and broadcast chains on NVLink (7·3 µs + S/450e9 each) + ring of 16 on IB
    leader = 2 * (7 * 3e-6 + S / 450e9) + 2 * 15 * 5e-6 + 2 * 15 / 16 * S / 50e9
    assert ex["leader hierarchy NVLink+IB (s)"] == pytest.approx(leader)
    # rail: ring in the node (2·7/8·S on NVLink) + ring of 16 on S/8 per NIC
    rail = 2 * 7 * 3e-6 + 2 * 7 / 8 * S / 450e9 + 2 * 15 * 5e-6 + 2 * 15 / 16 * S / 8 / 50e9
    assert ex["rail hierarchy NVLink+IB (s)"] == pytest.approx(rail)
    # one NIC per node: the leader saves only 2(n−1)/n − 2(m−1)/m of S and adds the NVLink chains;
    # rails use all eight NICs and win by ~8×
    assert ex["rail hierarchy NVLink+IB (s)"] < ex["flat ring on IB (s)"] < ex["leader hierarchy NVLink+IB (s)"]
    assert ex["leader hierarchy NVLink+IB (s)"] == pytest.approx(0.5874, abs=1e-4)
    assert ex["bytes leaving a node, flat ring (GB)"] == pytest.approx(2 * 127 / 128 * 14)
    assert ex["bytes leaving a node, leader (GB)"] == pytest.approx(2 * 15 / 16 * 14)
    assert (ex["fat tree k=64 hosts"], ex["fat tree k=64 switches"]) == (65536, 5120)
    assert ex["bisection k=64, 400G, 1:1 (TB/s)"] == pytest.approx(65536 / 2 * 50e9 / 1e12)
    assert ex["bisection k=64, 400G, 2:1 (TB/s)"] == pytest.approx(ex["bisection k=64, 400G, 1:1 (TB/s)"] / 2)
    # NOTES.md: 16 MiB between two namespaces at 100 Mbit/s, 1.34 s predicted (1.39 s measured)
    assert ex["16 MiB ring, 2 nodes, 100 Mbit/s (s)"] == pytest.approx(16 * 2**20 * 8 / 100e6)
    assert calculator.cross_leaf_bandwidth(50e9, 2) == 25e9
    assert calculator.cross_leaf_bandwidth(50e9, 2, leaves_crossed=1 / 16) == 50e9
    for f in calculator.FABRICS.values():
        assert "assumed" in f.source, f"{f.name}: α is an assumption and must say so"


@pytest.mark.timeout(30)
def test_exercise_answers():
    S = NUMEL * 8
    assert 4 * calculator.bytes_leaving_node("leader", S, 2, 4) == 589824  # exercise 1
    assert 4 * calculator.bytes_leaving_node("flat_ring", S, 2, 4) == 688128
    rate = 1.5 * 16 * 2**20 * 8  # exercise 2: 2(n−1)/n·S·8 / R = 1 s
    assert calculator.shaped_time(16 * 2**20, 4, rate) == pytest.approx(1.0)
    assert rate / 1e6 == pytest.approx(201.3, abs=0.05)
    hosts = calculator.fat_tree_hosts(32)  # exercise 3
    assert hosts == 8192
    assert calculator.bisection_bandwidth(hosts, 50e9, 2) / 1e12 == pytest.approx(102.4)
    assert calculator.bisection_bandwidth(hosts, 50e9) / 1e12 == pytest.approx(204.8)


def _hierarchy_worker(g: int) -> dict:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(NUMEL, generator=gen, dtype=torch.float64)
    nodes = hierarchical.make_nodes(g)
    out = hierarchical.leader_all_reduce(x, nodes)
    inter = hierarchical.inter_node_bytes(nodes, rank)
    broken = hierarchical.leader_all_reduce(x, nodes, skip_inter=True)
    lib = x.clone()
    dist.all_reduce(lib)
    return {"x": x, "out": out, "broken": broken, "lib": lib, "inter": inter,
            "intra": nodes.intra_bytes}


@pytest.mark.timeout(90)
def test_leader_all_reduce_equals_the_sum_and_sends_the_formula_bytes():
    n, g = 4, 2
    res = run_on_ranks(_hierarchy_worker, n, g, timeout=80)
    exact = torch.stack([r["x"] for r in res]).sum(0)  # the reference, summed here
    # two orders of summing n numbers ≤ M differ by ≤ 2(n−1)·u·n·M (u = 2^-53)
    tol = 2 * (n - 1) * 2**-53 * n * max(r["x"].abs().max().item() for r in res)
    for r in res:
        assert (r["out"] - exact).abs().max().item() <= tol
        assert (r["out"] - r["lib"]).abs().max().item() <= tol
        assert (r["broken"] - exact).abs().max().item() > tol  # the negative control fails it
    m, S = n // g, NUMEL * 8
    assert sum(r["inter"] for r in res) == 2 * (m - 1) * S  # counted == formula
    assert [r["inter"] > 0 for r in res] == [True, False, True, False]  # only leaders cross
    assert all(r["intra"] == 2 * 2 * S for r in res)  # two calls: reduce + broadcast each


@pytest.mark.timeout(90)
def test_simulated_nodes_train_to_one_process(tmp_path):
    run = run_torchrun(SCRIPT, 4, ["--steps", "6"], out_dir=tmp_path, timeout=80)
    checks = {c["name"]: c for c in run.summary["checks"]}
    assert all(c["ok"] for c in checks.values() if c["kind"] != "timing"), checks
    assert checks["leader all-reduce == all_reduce (2 nodes x 2)"]["ok"]
    assert checks["inter-node bytes, flat ring = 2m(n-1)/n S"]["measured"] == 2 * 2 * 3 / 4 * NUMEL * 8
    params = load_checkpoint(tmp_path / "final_params.pt")
    assert max_diff(params["dp"], reference_params(train.Config(steps=6))) <= 1e-12


@pytest.mark.timeout(30)
def test_validate_and_netns_refuses_without_root():
    with pytest.raises(ValueError, match="must divide the world"):
        train.validate(train.Config(ranks_per_node=3), 4)
    train.validate(train.Config(), 16)
    with pytest.raises(ValueError, match="--nodes"):
        netns.Config(nodes=0)
    if os.geteuid() != 0:
        assert netns.main(netns.Config()) == 2


# --- system tests: root, iproute2, tc (COURSE_SYSTEM_TESTS=1) -----------------------------------


def _system():
    from conftest import require_system

    require_system("ip", "tc", probe=netns.probe)


@pytest.mark.timeout(60)
def test_namespaces_are_removed_even_on_failure():
    _system()
    prefix = f"c22t{os.getpid()}"
    with pytest.raises(RuntimeError, match="boom"):
        with netns.namespaces(2, 100, prefix=prefix) as topo:
            assert netns.sh("ip", "netns", "list").stdout.count(prefix) == 2
            assert "tbf" in netns.sh("ip", "netns", "exec", topo.netns[0], "tc", "qdisc", "show",
                                     "dev", topo.ifname[0]).stdout
            raise RuntimeError("boom")
    assert prefix not in netns.sh("ip", "netns", "list").stdout
    assert prefix not in netns.sh("ip", "link").stdout


def _launch(nodes: int, nproc: int, rate: float, out: Path) -> dict:
    args = ["--steps", "6", "--rate-mbit", rate, "--timeout", 30, "--device", "cpu", "--out", out]
    with netns.namespaces(nodes, rate) as topo:
        codes, outs = netns.run_nodes(netns.torchrun_commands(topo, SCRIPT, args, nproc), 100)
    assert codes == [0] * nodes, "\n".join(o[-3000:] for o in outs)
    return json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(120)
def test_two_namespace_nodes_train_and_all_reduce_at_the_shaped_rate(tmp_path):
    _system()
    s = _launch(2, 2, 200, tmp_path)  # 2 nodes × 2 ranks: the hierarchy over real links
    checks = {c["name"]: c for c in s["checks"]}
    assert all(c["ok"] for c in checks.values() if c["kind"] != "timing"), checks
    assert checks["inter-node bytes, leaders = 2(m-1)S"]["measured"] == 2 * NUMEL * 8
    params = load_checkpoint(tmp_path / "final_params.pt")
    assert max_diff(params["dp"], reference_params(train.Config(steps=6))) <= 1e-12
    # the leaders' ring between 2 nodes (left neighbour = right neighbour) within the band
    # 0.95-1.8 of bytes ÷ rate: chapter 07's P2P.exchange posting its isend before its irecv
    # gave 2.16 here (figures/data.json before the fix), the receive first 1.24
    lead = checks["leader all-reduce: measured / (bytes / rate)"]
    assert lead["ok"] and lead["expected"] == list(train.TIME_BAND), lead


@pytest.mark.timeout(120)
def test_four_namespace_nodes_follow_the_ring_factor(tmp_path):
    _system()
    # 100 Mbit/s: slow enough that the link, not the CPU, sets the time (a review run with the
    # links shaped to 400 Mbit/s while 200 was predicted still gave 0.94 at 200 Mbit/s)
    s = _launch(4, 1, 100, tmp_path)
    fig = s["figures"]["library all_reduce time, 2.00 MiB"]
    ratio = fig["measured"] / fig["expected"]
    # the DESIGN exception: a shaped link dominates the time, so a band is asserted. Lower side:
    # tbf passes no more than the rate but a 4 KB burst; upper side: CPU time on 2 loaded cores
    assert fig["expected"] == pytest.approx(2 * 3 / 4 * 2 * 2**20 * 8 / 100e6)
    assert 0.95 <= ratio <= 1.8, ratio
