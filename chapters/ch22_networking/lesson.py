# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 22 · Multi-node networking · 多节点训练网络配置
#
# An all-reduce across nodes is as fast as the bytes it pushes through the slowest link. This
# notebook uses the chapter's calculator on real fabrics, runs the hierarchical all-reduce through
# node leaders on 4 CPU processes (2 simulated nodes) and counts its inter-node bytes, and shows
# the namespace launch: live when you are root with `COURSE_SYSTEM_TESTS=1`, otherwise the command
# and the result recorded by a real run. The lesson is
# [chapters/ch22_networking/README.md](../chapters/ch22_networking/README.md).

# %%
import json
import os

import matplotlib.pyplot as plt

from chapters.ch22_networking import calculator, netns, plots
from common.launch import run_torchrun
from common.results import REPO_ROOT

# %% [markdown]
# ## The calculator
# 14 GB of bf16 gradients (a 7B model) on 16 nodes of 8 GPUs. Bandwidths are vendor line rates;
# the latencies α are assumptions (see each fabric's `source`).

# %%
for name, value in calculator.worked_examples().items():
    print(f"{name:40s} {value:,.4g}")
for f in calculator.FABRICS.values():
    print(f"{f.name:32s} {f.bandwidth / 1e9:7.3g} GB/s  α {f.alpha * 1e6:g} µs  ({f.source})")

# %% [markdown]
# `NCCL_IB_HCA` is a list of prefixes (NCCL's `matchIfList`), and leaving it unset uses every
# adapter. What five settings select on a DGX H100 (12 mlx5 devices; the 8 compute HCAs are
# `calculator.DGX_H100_COMPUTE_HCAS`, from NVIDIA's user guide), and what 2 of 8 NICs cost the
# rails of the worked example:

# %%
devices, compute = calculator.DGX_H100_DEVICES, calculator.DGX_H100_COMPUTE_HCAS
for value in (None, "mlx5_0,mlx5_1", "mlx5_1", "=" + ",".join(compute), "^=mlx5_1,mlx5_2,mlx5_7,mlx5_8"):
    chosen = calculator.nccl_ib_hca_selected(value, devices)
    print(f"NCCL_IB_HCA={value!s:16.16} -> {len(chosen):2d} HCAs, {len(set(chosen) & set(compute))} of 8 compute, "
          f"{len(set(chosen) - set(compute))} others: {','.join(d[5:] for d in chosen)}")
nv, ib = calculator.FABRICS["nvlink4"], calculator.FABRICS["ib_ndr"]
for nics in (8, 2):
    print(f"rails on {nics} NICs: {calculator.rail_time(14e9, 8, 16, nv, ib, nics=nics):.3f} s")

# %% [markdown]
# Time against the number of nodes, per scheme: a flat ring and the leader hierarchy push the
# data through one NIC per node; rails use one NIC per GPU.

# %%
data = json.loads((REPO_ROOT / "chapters/ch22_networking/figures/data.json").read_text())
plots.make_figures(REPO_ROOT / "runs/ch22_networking/notebook_figures", data)
plt.imshow(plt.imread(REPO_ROOT / "runs/ch22_networking/notebook_figures/calculator.png"))
plt.axis("off")
plt.show()

# %% [markdown]
# ## The leader hierarchy on 4 processes (2 simulated nodes of 2)
# Reduce to each node's leader, ring all-reduce among the leaders (bytes counted), broadcast
# back; checked against `all_reduce`, with a negative control that skips the inter-node step.

# %%
run = run_torchrun(REPO_ROOT / "chapters/ch22_networking/train.py", 4, ["--steps", "6"], timeout=120)
for c in run.summary["checks"]:
    print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['name']:55s} {c['measured']}")

# %% [markdown]
# ## Real nodes: network namespaces and `tc`
# As root with `COURSE_SYSTEM_TESTS=1` this cell brings up two namespaces shaped to 200 Mbit/s
# and runs train.py across them. Otherwise it prints the command each node runs and the result
# **recorded** by `python tools/figures.py --rerun ch22` (as root) in figures/data.json: it is not
# live.

# %%
live = os.geteuid() == 0 and os.environ.get("COURSE_SYSTEM_TESTS") == "1" and netns.probe() is None
print("command on node 0:", data["command"])
if live:
    result = plots.namespace_run(2, 1, 200)
    figs = result["summary"]["figures"]
    runs = [{"nodes": 2, "ranks_per_node": 1, "rate_mbit": 200,
             "times": {k: v for k, v in figs.items() if k.endswith("MiB")},
             "wire": {k: v for k, v in figs.items() if k.endswith("bytes on the wire")}}]
    print("live run, exit codes", result["codes"])
else:
    runs = data["runs"]
    print("recorded runs (not live):")
for r in runs:
    for name, f in r["times"].items():
        if f["expected"]:
            print(f"{r['nodes']} nodes x {r['ranks_per_node']} @ {r['rate_mbit']:g} Mbit/s  {name:38s} "
                  f"measured {f['measured']:.3f} s, predicted {f['expected']:.3f} s, "
                  f"ratio {f['measured'] / f['expected']:.2f}")
    for name, f in r.get("wire", {}).items():  # the kernel's tx_bytes of the nodes' interfaces
        print(f"    {name:44s} {f['measured']:,} bytes, formula {f['expected']:,.0f} "
              f"({f['measured'] / f['expected']:.3f}x)")

# %% [markdown]
# The recorded failure of a launch without `GLOO_SOCKET_IFNAME` (each namespace's hostname
# resolves to loopback, so gloo advertises an address its peer cannot reach):

# %%
for k, lines in enumerate(data["wrong_interface"]["lines"]):
    print(f"node {k} (exit {data['wrong_interface']['codes'][k]}):")
    for line in lines:
        print("   ", line)
