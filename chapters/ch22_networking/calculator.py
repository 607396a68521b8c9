"""A collective cost calculator by topology and fabric (chapter 22).

The α–β model of chapter 07 (`chapters.ch07_communication.cost_model`: a message of m bytes
costs α + m·β) applied to clusters: which link each phase of an all-reduce crosses, how many
bytes leave each node, and what a fat tree's oversubscription does to the bandwidth a node
gets. Bandwidths are per direction, in bytes per second (1 GB = 10⁹ bytes).

Fabric figures are vendor line rates (sources in `FABRICS`); the latencies α are *assumptions*
of the order NCCL's tuner uses, not measurements: this machine has none of these fabrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from chapters.ch07_communication.cost_model import hierarchical_time, predicted_time


@dataclass(frozen=True)
class Fabric:
    name: str
    bandwidth: float  # bytes/s per direction, per GPU (NVLink) or per NIC port (the others)
    alpha: float  # seconds per message: an assumption, see `source`
    source: str


FABRICS = {
    "nvlink4": Fabric("NVLink 4 (H100 SXM)", 450e9, 3e-6,
                      "NVIDIA H100 datasheet: 900 GB/s NVLink per GPU, both directions together; "
                      "α assumed"),
    "ib_ndr": Fabric("InfiniBand NDR 400 Gb/s", 50e9, 5e-6,
                     "NVIDIA ConnectX-7 / Quantum-2 product briefs: 400 Gb/s per port; α assumed"),
    "roce_400": Fabric("RoCE v2, 400 GbE", 50e9, 8e-6,
                       "IEEE 802.3bs 400 GbE line rate, RDMA over Converged Ethernet (ConnectX-7);"
                       " α assumed higher than IB (lossless-Ethernet switching, PFC/ECN)"),
    "eth_100_tcp": Fabric("Ethernet 100 GbE, TCP sockets", 12.5e9, 30e-6,
                          "IEEE 802.3ba 100 GbE line rate; α assumed for the kernel TCP path "
                          "(NCCL's socket transport, gloo)"),
    "eth_25_tcp": Fabric("Ethernet 25 GbE, TCP sockets", 3.125e9, 30e-6,
                         "IEEE 802.3by 25 GbE line rate; α assumed as for 100 GbE"),
    # Cloud GPU fabrics, per GPU (the node's GPU NICs' total / 8 GPUs); NCCL reaches them through
    # a network plugin, not its own IB transport.
    "efa_p5": Fabric("AWS EFA, p5.48xlarge", 50e9, 10e-6,
                     "AWS EC2 accelerated computing instances: p5.48xlarge, 3,200 Gb/s EFA per "
                     "instance = 400 Gb/s per GPU; NCCL through the aws-ofi-nccl plugin (libfabric); "
                     "α assumed"),
    "tcpxo_a3mega": Fabric("Google Cloud A3 Mega, GPUDirect-TCPXO", 25e9, 20e-6,
                           "Google Cloud 'Networking and GPU machines': a3-megagpu-8g, 8 GPU NICs "
                           "of 200 Gb/s (1,600 Gb/s; up to 1,800 with the host NIC); NCCL through "
                           "Google's TCPXO plugin and receive daemon; α assumed"),
    "tcpx_a3high": Fabric("Google Cloud A3 High, GPUDirect-TCPX", 12.5e9, 30e-6,
                          "Google Cloud 'Networking and GPU machines': a3-highgpu-8g, 4 GPU NICs of "
                          "200 Gb/s shared by 8 GPUs (800 Gb/s; up to 1,000 with the host NIC); NCCL "
                          "through Google's TCPX plugin and receive daemon; α assumed"),
}


def beta(fabric: Fabric) -> float:
    """Seconds per byte."""
    return 1 / fabric.bandwidth


def flat_time(algorithm: str, size: float, n: int, fabric: Fabric) -> float:
    """All-reduce of `size` bytes over n ranks, every step on `fabric` (ch07's model): a flat
    ring or tree across nodes runs at the speed of its slowest link, the inter-node one."""
    return predicted_time(algorithm, size, n, fabric.alpha, beta(fabric))


def rail_time(size: float, g: int, m: int, intra: Fabric, inter: Fabric, nics: int | None = None) -> float:
    """Hierarchical all-reduce as NCCL does it on rails (ch07's `hierarchical_time`): ring
    reduce-scatter in the node, ring all-reduce of S/g across m nodes by each of the g local
    ranks on its own NIC, ring all-gather in the node. `nics` < g: only that many NICs carry the
    g rails (say NCCL_IB_HCA names 2 of 8), each shared by g/nics of them, at inter/(g/nics)."""
    share = g / min(nics or g, g)
    return hierarchical_time(size, g, m, intra.alpha, beta(intra), inter.alpha, share * beta(inter))


# The 8 compute-fabric HCAs of a DGX H100/H200 (one ConnectX-7 port per GPU): NVIDIA DGX H100
# User Guide, "Network Modules" table (OSFP ports -> default RDMA device): mlx5_0 (GPU 0),
# mlx5_3 (1), mlx5_4 (2), mlx5_5 (3), mlx5_6 (4), mlx5_9 (5), mlx5_10 (6), mlx5_11 (7). The
# node's other four mlx5 names belong to the two dual-port ConnectX-7 cards for storage and
# in-band management (12 devices in all).
DGX_H100_DEVICES = [f"mlx5_{i}" for i in range(12)]
DGX_H100_COMPUTE_HCAS = ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]


def nccl_ib_hca_selected(value: str | None, devices: list[str]) -> list[str]:
    """The HCAs (device names, optionally `name:port`) NCCL uses given NCCL_IB_HCA, transcribed from
    NCCL (src/transport/net_ib/init.cc with matchIfList in src/misc/utils.cc; NCCL docs,
    Environment Variables, NCCL_IB_HCA): unset, every device; a list of prefixes (`mlx5` takes
    mlx5_0 … mlx5_11; `mlx5_1` takes mlx5_1, mlx5_10 and mlx5_11); `=` exact names; `^` excludes;
    `name:port` restricts the port (devices given without a port match any)."""
    if not value:
        return list(devices)
    exclude = value.startswith("^")
    value = value[1:] if exclude else value
    exact = value.startswith("=")
    value = value[1:] if exact else value
    wanted = [(w.split(":")[0], w.split(":")[1] if ":" in w else None) for w in value.split(",") if w]

    def match(device: str) -> bool:
        name, _, port = device.partition(":")
        return any((name == w if exact else name.startswith(w)) and (p is None or not port or port == p)
                   for w, p in wanted)

    return [d for d in devices if match(d) != exclude]


def bus_bandwidth(size: float, seconds: float, n: int, collective: str = "all_reduce") -> float:
    """nccl-tests' bus bandwidth (NVIDIA/nccl-tests doc/PERFORMANCE.md): algbw = S/t times a
    factor that makes it comparable with one link's bandwidth whatever n: all_reduce 2(n−1)/n;
    reduce_scatter, all_gather, all_to_all (n−1)/n; broadcast, reduce 1. A ring all-reduce
    limited by links of bandwidth B has busbw = B."""
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_gather": (n - 1) / n, "all_to_all": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}
    return size / seconds * factor[collective]


def leader_time(size: float, g: int, m: int, intra: Fabric, inter: Fabric) -> float:
    """Hierarchical all-reduce through one leader per node: reduce to the leader (a pipelined
    chain: (g−1)α + Sβ), ring all-reduce of S among the m leaders on one NIC, broadcast from the
    leader ((g−1)α + Sβ). Fewer bytes leave a node than in a flat ring, but through one NIC."""
    chain = (g - 1) * intra.alpha + size * beta(intra) if g > 1 else 0.0
    return 2 * chain + predicted_time("ring", size, m, inter.alpha, beta(inter))


def bytes_leaving_node(scheme: str, size: float, g: int, m: int) -> float:
    """Bytes one node sends to other nodes in one all-reduce of `size` bytes over m nodes of g
    ranks (nodes hold consecutive ranks). flat ring: one ring edge leaves each node and carries
    2(n−1) chunks of S/n; leader: the leader's ring among m leaders, 2(m−1)/m·S; rail: g rings
    of 2(m−1)/m·S/g, the same total spread over g NICs."""
    n = g * m
    if m == 1:
        return 0.0
    if scheme == "flat_ring":
        return 2 * (n - 1) / n * size
    if scheme in ("leader", "rail"):
        return 2 * (m - 1) / m * size
    raise ValueError(f"unknown scheme {scheme!r}")


def shaped_time(size: float, n: int, rate_bit_s: float, alpha: float = 0.0) -> float:
    """A ring all-reduce over n nodes whose sending side is shaped to rate_bit_s (tc tbf): each
    node sends 2(n−1)/n·S through its shaped link. The prediction the namespace run is held to."""
    return predicted_time("ring", size, n, alpha, 8 / rate_bit_s)


def fat_tree_hosts(k: int) -> int:
    """Hosts of a three-level fat tree of k-port switches: k³/4 (Al-Fares et al., SIGCOMM 2008)."""
    return k**3 // 4


def fat_tree_switches(k: int) -> int:
    """Switches of that tree: k pods of k/2 edge + k/2 aggregation switches, (k/2)² core: 5k²/4."""
    return 5 * k * k // 4


def bisection_bandwidth(hosts: int, link: float, oversubscription: float = 1.0) -> float:
    """Bytes/s across the middle of a fat tree: half the hosts, each at link / oversubscription
    (an r:1 oversubscribed edge switch has r times more host ports than uplinks)."""
    return hosts / 2 * link / oversubscription


def cross_leaf_bandwidth(link: float, oversubscription: float, leaves_crossed: float = 1.0) -> float:
    """Per-node bandwidth when every node of a leaf sends off the leaf at once (all-to-all, or a
    ring laid out ignoring the leaves): link / oversubscription. A ring laid out leaf by leaf
    leaves each leaf on one edge only and keeps the full link (`leaves_crossed` = the fraction of
    the leaf's nodes sending upward at once; 1/nodes_per_leaf for a leaf-ordered ring)."""
    upward = leaves_crossed * oversubscription
    return link / max(1.0, upward)


def worked_examples() -> dict:
    """The lesson's worked numbers: 14 GB of bf16 gradients (a 7B model), 16 nodes × 8 GPUs."""
    size, g, m = 14e9, 8, 16
    nv, ib, eth = FABRICS["nvlink4"], FABRICS["ib_ndr"], FABRICS["eth_100_tcp"]
    return {
        "flat ring on IB (s)": flat_time("ring", size, g * m, ib),
        "flat ring on 100 GbE (s)": flat_time("ring", size, g * m, eth),
        "one node on NVLink (s)": flat_time("ring", size, g, nv),
        "leader hierarchy NVLink+IB (s)": leader_time(size, g, m, nv, ib),
        "rail hierarchy NVLink+IB (s)": rail_time(size, g, m, nv, ib),
        "bytes leaving a node, flat ring (GB)": bytes_leaving_node("flat_ring", size, g, m) / 1e9,
        "bytes leaving a node, leader (GB)": bytes_leaving_node("leader", size, g, m) / 1e9,
        "fat tree k=64 hosts": fat_tree_hosts(64),
        "fat tree k=64 switches": fat_tree_switches(64),
        "bisection k=64, 400G, 1:1 (TB/s)": bisection_bandwidth(fat_tree_hosts(64), 50e9) / 1e12,
        "bisection k=64, 400G, 2:1 (TB/s)": bisection_bandwidth(fat_tree_hosts(64), 50e9, 2) / 1e12,
        "16 MiB ring, 2 nodes, 100 Mbit/s (s)": shaped_time(16 * 2**20, 2, 100e6),
        # NCCL_IB_HCA naming 2 of a DGX H100's 8 compute HCAs (=mlx5_0,mlx5_3): 2 NICs carry 8 rails
        "rails on 2 of 8 NICs, NVLink+IB (s)": rail_time(size, g, m, nv, ib, nics=2),
        # the same 16 nodes in the clouds, rails on each machine's GPU NICs
        "rails, 16 x p5.48xlarge, EFA (s)": rail_time(size, g, m, nv, FABRICS["efa_p5"]),
        "rails, 16 x a3-megagpu-8g, TCPXO (s)": rail_time(size, g, m, nv, FABRICS["tcpxo_a3mega"]),
        "rails, 16 x a3-highgpu-8g, TCPX (s)": rail_time(size, g, m, nv, FABRICS["tcpx_a3high"]),
    }
