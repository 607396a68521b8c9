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
    # rails use all eight NICs: their inter-node phase is 8× shorter, the whole all-reduce 4.6×
    # (the NVLink phase and the α terms do not shrink), the lesson's figure
    assert ex["rail hierarchy NVLink+IB (s)"] < ex["flat ring on IB (s)"] < ex["leader hierarchy NVLink+IB (s)"]
    assert ex["flat ring on IB (s)"] / ex["rail hierarchy NVLink+IB (s)"] == pytest.approx(4.63, abs=0.01)
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
    # NCCL_IB_HCA naming 2 of 8 NICs: the 8 rails share 2 NICs, the inter-node phase is 4× longer
    two = 2 * 7 * 3e-6 + 2 * 7 / 8 * S / 450e9 + 2 * 15 * 5e-6 + 2 * 15 / 16 * S / 8 / (50e9 / 4)
    assert ex["rails on 2 of 8 NICs, NVLink+IB (s)"] == pytest.approx(two)
    assert ex["rails on 2 of 8 NICs, NVLink+IB (s)"] == pytest.approx(0.3171, abs=1e-4)
    # the clouds: per GPU 400 Gb/s EFA (p5: 3,200 Gb/s per instance), 200 Gb/s TCPXO (A3 Mega: 8
    # NICs of 200 Gb/s), 100 Gb/s TCPX (A3 High: 4 NICs of 200 Gb/s for 8 GPUs)
    for key, per_gpu, alpha, value in (("p5.48xlarge, EFA", 50e9, 10e-6, 0.1204),
                                       ("a3-megagpu-8g, TCPXO", 25e9, 20e-6, 0.1863),
                                       ("a3-highgpu-8g, TCPX", 12.5e9, 30e-6, 0.3179)):
        want = 2 * 7 * 3e-6 + 2 * 7 / 8 * S / 450e9 + 2 * 15 * alpha + 2 * 15 / 16 * S / 8 / per_gpu
        assert ex[f"rails, 16 x {key} (s)"] == pytest.approx(want), key
        assert ex[f"rails, 16 x {key} (s)"] == pytest.approx(value, abs=1e-4), key
    assert calculator.FABRICS["efa_p5"].bandwidth * 8 * 8 == 3200e9  # 8 GPUs, bits


@pytest.mark.timeout(30)
def test_nccl_ib_hca_selects_like_nccl():
    """NCCL_IB_HCA as NCCL parses it (src/transport/net_ib/init.cc, matchIfList in
    src/misc/utils.cc): prefixes unless '=', '^' excludes, ':port' restricts the port."""
    sel = calculator.nccl_ib_hca_selected
    eight = [f"mlx5_{i}" for i in range(8)]  # one NIC per GPU, nothing else
    assert sel(None, eight) == sel("", eight) == eight  # unset: NCCL takes every HCA
    assert sel("mlx5_0,mlx5_1", eight) == ["mlx5_0", "mlx5_1"]  # 2 of 8
    assert sel("mlx5", eight) == eight
    # a DGX H100 (NVIDIA's user guide): 12 mlx5 devices, 8 of them the compute HCAs
    dgx, compute = calculator.DGX_H100_DEVICES, calculator.DGX_H100_COMPUTE_HCAS
    assert len(dgx) == 12 and len(compute) == 8 and set(compute) < set(dgx)
    others = [d for d in dgx if d not in compute]
    assert others == ["mlx5_1", "mlx5_2", "mlx5_7", "mlx5_8"]
    # the lesson's trap: copied from a 2-NIC machine, a prefix list takes 3 compute HCAs + 1 other
    assert sel("mlx5_0,mlx5_1", dgx) == ["mlx5_0", "mlx5_1", "mlx5_10", "mlx5_11"]
    assert sel("mlx5_1", dgx) == ["mlx5_1", "mlx5_10", "mlx5_11"]  # a prefix, not a name
    assert sel("=mlx5_1", dgx) == ["mlx5_1"]
    # the lesson's two safe forms: the compute HCAs by exact name, or the others excluded
    assert sel("=" + ",".join(compute), dgx) == compute
    assert sel("^=" + ",".join(others), dgx) == compute
    assert sel("^" + ",".join(others), dgx) == ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9"]  # prefixes!
    assert sel("^mlx5_1", dgx) == [d for d in dgx if d not in ("mlx5_1", "mlx5_10", "mlx5_11")]
    assert sel("mlx5_0:1", ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1"]) == ["mlx5_0:1"]
    readme = (SCRIPT.parent / "README.md").read_text()
    assert "=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11" in readme
    assert "^=mlx5_1,mlx5_2,mlx5_7,mlx5_8" in readme
    # what the rails lose: 2 NICs for 8 rails
    nv, ib, S = calculator.FABRICS["nvlink4"], calculator.FABRICS["ib_ndr"], 14e9
    nics = len(sel("=mlx5_0,mlx5_3", dgx))
    assert calculator.rail_time(S, 8, 16, nv, ib, nics=nics) > 2.5 * calculator.rail_time(S, 8, 16, nv, ib)
    assert calculator.rail_time(S, 8, 16, nv, ib, nics=8) == calculator.rail_time(S, 8, 16, nv, ib)
    # the lesson's multi-node command leaves NCCL_IB_HCA unset
    command = readme[readme.index("Real nodes, GPUs (NCCL)"):]
    command = command[command.index("```bash"):command.index("```", command.index("```bash") + 3)]
    assert "NCCL_IB_HCA" not in command and "NCCL_SOCKET_IFNAME" in command


@pytest.mark.timeout(30)
def test_bus_bandwidth_is_nccl_tests_and_equals_the_link_for_a_ring():
    """nccl-tests' busbw (doc/PERFORMANCE.md): algbw × 2(n−1)/n for all-reduce, (n−1)/n for
    all-gather / reduce-scatter / all-to-all, 1 for broadcast / reduce. A ring limited by links
    of R bit/s gives busbw = R/8 bytes/s whatever the size and the number of nodes."""
    S, t = 2**30, 0.5
    assert calculator.bus_bandwidth(S, t, 8) == pytest.approx(S / t * 1.75)
    assert calculator.bus_bandwidth(S, t, 8, "all_gather") == pytest.approx(S / t * 7 / 8)
    assert calculator.bus_bandwidth(S, t, 8, "reduce_scatter") == pytest.approx(S / t * 7 / 8)
    assert calculator.bus_bandwidth(S, t, 8, "broadcast") == S / t
    for n in (2, 3, 4, 16):
        for size in (2**20, 14e9):
            assert calculator.bus_bandwidth(size, calculator.shaped_time(size, n, 100e6), n) == pytest.approx(100e6 / 8)
    # the control: a wrong factor (2 instead of 2(n-1)/n) overstates the link by n/(n-1)
    assert S / t * 2 / calculator.bus_bandwidth(S, t, 4) == pytest.approx(4 / 3)


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


@pytest.mark.timeout(30)
def test_timing_band_rejects_a_rate_off_by_two():
    """train.TIME_BAND against the recorded namespace runs (figures/data.json, tools/figures.py
    --rerun ch22) at the system tests' setting (RATE_MBIT, MIB): the runs lie inside it, and the
    control launches whose links were shaped to twice and to half the rate train.py was told lie
    outside it, for every all-reduce timed (a link 2x faster than assumed: below; 2x slower: above)."""
    data = json.loads((SCRIPT.parent / "figures" / "data.json").read_text())
    lo, hi = train.TIME_BAND
    runs = [r for r in data["runs"] if (r["rate_mbit"], r.get("allreduce_mib")) == (RATE_MBIT, MIB)]
    assert sorted((r["nodes"], r["ranks_per_node"]) for r in runs) == [(2, 2), (4, 1)]
    for r in runs:
        for name, f in r["times"].items():
            assert lo <= f["measured"] / f["expected"] <= hi, (r["nodes"], name)
    controls = data["band_controls"]
    assert sorted(c["shaped_mbit"] / c["predicted_mbit"] for c in controls) == [0.5, 2.0]
    for c in controls:
        assert (c["predicted_mbit"], c["allreduce_mib"], c["nodes"]) == (RATE_MBIT, MIB, 4)
        assert len(c["ratios"]) == 3
        for name, ratio in c["ratios"].items():
            assert (ratio < lo) if c["shaped_mbit"] > c["predicted_mbit"] else (ratio > hi), (c, name)

    # the lesson's ranges of the controls, recomputed
    ratios = {c["shaped_mbit"]: sorted(c["ratios"].values()) for c in controls}
    readme = (SCRIPT.parent / "README.md").read_text()
    assert f"gives {ratios[50][0]:.2f}–{ratios[50][-1]:.2f}× (below 0.95)" in readme
    assert f"{ratios[12.5][0]:.2f}–{ratios[12.5][-1]:.2f}× (above" in readme


@pytest.mark.timeout(30)
def test_excess_is_not_a_link_latency():
    """The lesson keeps α = 0 for the shaped links and says why: the recorded excess over
    bytes ÷ rate, read as a latency per ring step, differs by scheme and run (figures/data.json),
    so no single α fits it. The numbers the lesson quotes are recomputed here."""
    data = json.loads((SCRIPT.parent / "figures" / "data.json").read_text())
    per_step, ratios = {}, []
    for r in data["runs"]:
        n, m = r["nodes"] * r["ranks_per_node"], r["nodes"]
        for name, f in r["times"].items():
            steps = 2 * (m - 1) if name.startswith("leader") else 2 * (n - 1)
            per_step.setdefault(r["rate_mbit"], []).append((f["measured"] - f["expected"]) / steps)
            if r["rate_mbit"] == RATE_MBIT:
                ratios.append(f["measured"] / f["expected"])
    slow, every = per_step[RATE_MBIT], [x for v in per_step.values() for x in v]
    readme = (SCRIPT.parent / "README.md").read_text()
    assert f"lie {round(100 * (min(ratios) - 1))}–{round(100 * (max(ratios) - 1))} % above it" in readme
    assert f"would be {1e3 * min(slow):.0f}–{1e3 * max(slow):.0f} ms" in readme
    assert f"and {1e3 * min(every):.0f}–{1e3 * max(every):.0f} ms over all the recordings" in readme
    assert max(slow) > 3 * min(slow)  # no single α: a latency would add the same per step

def _hierarchy_worker(g: int) -> dict:
    from chapters.ch09_compression.wire import WireTap

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(NUMEL, generator=gen, dtype=torch.float64)
    nodes = hierarchical.make_nodes(g)
    with WireTap() as tap:  # counted where the tensors reach torch.distributed
        out = hierarchical.leader_all_reduce(x, nodes)
    inter = hierarchical.inter_node_bytes(nodes, rank)
    with WireTap() as skipped:
        broken = hierarchical.leader_all_reduce(x, nodes, skip_inter=True)
    lib = x.clone()
    dist.all_reduce(lib)
    # the wire decision with rank 1's interface missing, then with every rank's present: one
    # decision for all (the per-rank reading, what each rank would decide alone, is the control)
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo" if rank != 1 else "c22-no-such-if"
    wire = [(train.interface_tx_bytes() is not None, train.wire_agreed(True))]
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    wire.append((train.interface_tx_bytes() is not None, train.wire_agreed(True)))
    wire.append((None, train.wire_agreed(False)))
    if saved is None:
        del os.environ["GLOO_SOCKET_IFNAME"]
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = saved
    return {"x": x, "out": out, "broken": broken, "lib": lib, "inter": inter, "wire": wire,
            "tapped": {k: tap.nbytes(k) for k in ("reduce", "broadcast", "send")},
            "skipped": {k: skipped.nbytes(k) for k in ("reduce", "broadcast", "send")}}


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
    # at the boundary (WireTap): each rank hands S to its node's reduce, each leader S to the
    # broadcast and its ring's sends; the skipped inter-node step sends nothing (the control)
    assert [r["tapped"] for r in res] == [{"reduce": S, "broadcast": S, "send": r["inter"]} if k % g == 0
                                          else {"reduce": S, "broadcast": 0, "send": 0}
                                          for k, r in enumerate(res)]
    assert sum(r["tapped"]["send"] for r in res) == 2 * (m - 1) * S
    # --wire-bytes is decided once for the world: one node without its interface turns it off on
    # every rank (alone, ranks 0, 2, 3 would read the wire and wait in a sum rank 1 never joins)
    if Path("/sys/class/net/lo/statistics/tx_bytes").exists():
        assert [r["wire"][0] for r in res] == [(True, False), (False, False), (True, False), (True, False)]
        assert [r["wire"][1] for r in res] == [(True, True)] * n
    assert [r["wire"][2] for r in res] == [(None, False)] * n
    assert sum(r["skipped"]["send"] for r in res) == 0 and sum(r["skipped"]["reduce"] for r in res) == n * S


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


# The namespace tests' setting: links shaped to 25 Mbit/s, all-reduces of 1 MiB. Slow enough that
# the link, not the CPU of a loaded 2-core machine, sets the time: at a load of 17-20, 4 nodes took
# 1.15-1.17x bytes ÷ rate here, links twice as fast as predicted 0.59-0.61x and twice as slow
# 2.31-2.47x, both outside train.TIME_BAND; at 200 Mbit/s and 2 MiB the same load gave 2.6-3.2x
# (figures/data.json, test_timing_band_rejects_a_rate_off_by_two).
RATE_MBIT, MIB = 25, 1


def _launch(nodes: int, nproc: int, rate: float, out: Path) -> dict:
    args = ["--steps", "6", "--rate-mbit", rate, "--timeout", 30, "--device", "cpu", "--out", out,
            "--wire-bytes", "--allreduce-mib", MIB]
    with netns.namespaces(nodes, rate) as topo:
        codes, outs = netns.run_nodes(netns.torchrun_commands(topo, SCRIPT, args, nproc), 100)
    assert codes == [0] * nodes, "\n".join(o[-3000:] for o in outs)
    return json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(120)
def test_two_namespace_nodes_train_and_all_reduce_at_the_shaped_rate(tmp_path):
    _system()
    s = _launch(2, 2, RATE_MBIT, tmp_path)  # 2 nodes × 2 ranks: the hierarchy over real links
    checks = {c["name"]: c for c in s["checks"]}
    assert all(c["ok"] for c in checks.values() if c["kind"] != "timing"), checks
    assert checks["inter-node bytes, leaders = 2(m-1)S"]["measured"] == 2 * NUMEL * 8
    params = load_checkpoint(tmp_path / "final_params.pt")
    assert max_diff(params["dp"], reference_params(train.Config(steps=6))) <= 1e-12
    # the leaders' ring between 2 nodes (left neighbour = right neighbour) within the band
    # 0.95-1.8 of bytes ÷ rate: chapter 07's P2P.exchange posting its isend before its irecv ran
    # the two directions one after the other, 2.16x at 200 Mbit/s (figures/data.json before the
    # fix), the receive first 1.24x
    lead = checks["leader all-reduce: measured / (bytes / rate)"]
    assert lead["ok"] and lead["expected"] == list(train.TIME_BAND), lead
    # The bytes the nodes' veth interfaces sent, read from the kernel's counters around the timed
    # calls, against the formula: within the stated TCP/IP header bound (train.WIRE_OVERHEAD).
    for name in ("leader all-reduce", "hand flat ring"):
        c = checks[f"{name}: wire bytes / formula bytes"]
        assert c["ok"] and c["expected"][0] == 1.0 and c["expected"][1] < 1.1, c
    figs = s["figures"]
    lead, flat = figs["leader all-reduce: bytes on the wire"], figs["hand flat ring: bytes on the wire"]
    assert flat["expected"] == 1.5 * lead["expected"] == 1.5 * 4 * 2 * MIB * 2**20  # 4 calls, 2 nodes
    # Controls: each scheme's measured bytes against the other's formula leave the band (the
    # leaders send S per node, the flat ring 2(n-1)/n S = 1.5 S): the counter tells them apart.
    lo, hi = train.wire_band(flat["expected"])
    assert not lo <= lead["measured"] / flat["expected"] <= hi
    lo, hi = train.wire_band(lead["expected"])
    assert not lo <= flat["measured"] / lead["expected"] <= hi


@pytest.mark.timeout(120)
def test_four_namespace_nodes_follow_the_ring_factor(tmp_path):
    _system()
    s = _launch(4, 1, RATE_MBIT, tmp_path)
    fig = s["figures"][f"library all_reduce time, {MIB:.2f} MiB"]
    ratio = fig["measured"] / fig["expected"]
    # the DESIGN exception: a shaped link dominates the time, so a band is asserted. Lower side:
    # tbf passes no more than the rate but a 4 KB burst; upper side: CPU time on 2 loaded cores
    assert fig["expected"] == pytest.approx(2 * 3 / 4 * MIB * 2**20 * 8 / (RATE_MBIT * 1e6))
    assert 0.95 <= ratio <= 1.8, ratio
    # gloo's own all_reduce sends what a ring sends: 2(n-1)/n S from every node, on the wire
    wire = {c["name"]: c for c in s["checks"]}["library all_reduce: wire bytes / formula bytes"]
    assert wire["ok"], wire
    assert s["figures"]["library all_reduce: bytes on the wire"]["expected"] == 4 * 4 * 1.5 * MIB * 2**20
