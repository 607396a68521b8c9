"""Chapter 01 (why distributed training): the first program (hello.py) and the full run, its
all-reduce and rank views, the FLOP-counting formula, the memory/FLOPs/time calculators, and the
launch setup the chapter teaches (common.distributed's, which train.py calls)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from chapters.ch01_overview import calculators as calc
from chapters.ch01_overview import flops, hello, train
from common.config import parse_config
from common.distributed import (
    DistributedSetupError,
    choose_device_and_backend,
    read_launch_env,
    setup_distributed,
    teardown_distributed,
)
from common.launch import run_on_ranks, run_python, run_torchrun
from common.models import MLP, count_params
from common.results import check_ok

SCRIPT = Path(train.__file__)
HELLO = Path(hello.__file__)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_JOB_NODELIST",
               "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS",
               "SLURM_STEP_GPUS", "SLURM_GPUS_PER_TASK")


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    """One real `torchrun --nproc_per_node=2` launch of train.py, shared by the tests below (the
    notebook launches the same command, so the tests hand it this run: common.launch)."""
    out = tmp_path_factory.mktemp("ch01_run2")
    return run_torchrun(SCRIPT, nproc=2, args=["--steps", "6", "--log-every", "2"],
                        timeout=120, out_dir=out)


@pytest.fixture
def no_launcher(monkeypatch):
    """As if started with plain `python`: no torchrun variables, no group yet."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()


# --- the first program: hello.py --------------------------------------------------------------

def hello_lines(output: str) -> list[str]:
    """Every rank's line, sorted (two ranks writing to one pipe may run their lines together:
    with PYTHONUNBUFFERED, print writes the text and its newline separately)."""
    return sorted(re.findall(r"rank \d+ of \d+ .*?: (?:ok|WRONG)", output))


@pytest.mark.timeout(150)
def test_hello_all_reduces_the_ranks_under_torchrun(tmp_path):
    """Two processes: each prints its rank and the all-reduced sum of the ranks, 0 + 1 = 1."""
    run = run_torchrun(HELLO, nproc=2, timeout=120, out_dir=tmp_path)
    assert run.returncode == 0
    assert hello_lines(run.output) == [
        f"rank {r} of 2 (cpu, gloo): sum of ranks 1, world_size*(world_size-1)/2 = 1: ok"
        for r in (0, 1)]


@pytest.mark.timeout(90)
def test_hello_runs_as_a_world_of_one_without_torchrun(no_launcher, tmp_path):
    run = run_python(HELLO, timeout=60, out_dir=tmp_path)
    assert hello_lines(run.output) == [
        "rank 0 of 1 (cpu, gloo): sum of ranks 0, world_size*(world_size-1)/2 = 0: ok"]


def test_hello_is_short_and_the_lesson_shows_its_code():
    """The first program stays short (docstring, imports and all), and the lesson's walk-through
    shows its code as it is: the README's block is a verbatim excerpt of hello.py."""
    source = HELLO.read_text()
    assert len(source.splitlines()) <= 50
    readme = (HELLO.parent / "README.md").read_text()
    block = readme.split("<!-- hello.py -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "dist.all_reduce(total" in block and "dist.destroy_process_group()" in block
    assert block in source, "the README's hello.py block differs from hello.py"


# --- the real two-process run --------------------------------------------------------------

@pytest.mark.timeout(150)
def test_all_reduce_result_in_a_real_two_process_run(run2):
    s = run2.summary
    assert (s["world_size"], s["backend"], s["device"]) == (2, "gloo", "cpu")
    check = run2.check("all-reduce SUM of rank+1 = n(n+1)/2")
    assert check["ok"] and check["measured"] == 3 == 2 * 3 / 2 and check["tolerance"] == 0
    assert all(c["ok"] for c in s["checks"] if c["kind"] != "timing"), s["checks"]


@pytest.mark.timeout(150)
def test_rank_views_cover_every_rank(run2):
    views = json.loads((run2.out_dir / "ranks.json").read_text())
    assert [v["rank"] for v in views] == [0, 1]
    assert [v["local_rank"] for v in views] == [0, 1]
    assert {v["world_size"] for v in views} == {2}
    assert {(v["backend"], v["device"]) for v in views} == {("gloo", "cpu")}
    assert len({v["pid"] for v in views}) == 2, "two ranks must be two processes"
    assert all(v["host"] for v in views)
    assert {v["threads"] for v in views} == {1}  # torchrun's OMP_NUM_THREADS=1
    assert run2.check("rank views cover ranks 0..n-1")["ok"]
    header = "rank  local_rank  world_size  backend  device"
    assert header in run2.output and run2.output.count(header) == 1  # printed once, by rank 0


@pytest.mark.timeout(150)
def test_step_flops_of_the_run_match_the_formula_computed_here(run2):
    cfg = run2.summary["config"]
    dims = [cfg["d_in"]] + [cfg["d_hidden"]] * (cfg["n_layers"] - 1) + [cfg["d_out"]]
    B = cfg["batch_size"]
    expected = 6 * B * sum(a * b for a, b in zip(dims, dims[1:])) - 2 * B * dims[0] * dims[1]
    check = run2.check("step FLOPs = 6·B·Σ in·out − 2·B·in₀·out₀")
    assert check["ok"] and check["measured"] == expected == check["expected"]
    assert check["tolerance"] == 0 and check["kind"] == "formula"
    naive = run2.summary["figures"]["step FLOPs counted vs plain 6·N·B"]
    assert naive["measured"] == expected and naive["expected"] != expected


@pytest.mark.timeout(150)
def test_projection_and_metrics_of_the_run(run2):
    f = run2.summary["figures"]
    # Formula outputs sit in the expected column: nothing measured them.
    assert f["projected: bf16 weights"]["expected"] == pytest.approx(14.0)
    assert f["projected: mixed-precision Adam state"]["expected"] == pytest.approx(112.0)
    assert f["projected: devices to hold it (80 GB each)"]["expected"] == 2
    assert f["projected: training FLOPs 6·N·D"]["expected"] == pytest.approx(4.2e22)
    assert all(v["measured"] == "-" for k, v in f.items()
               if k.startswith("projected") and "this run's rate" not in k)
    # 4.2e22 FLOP / (8 devices · 989e12 FLOP/s · 0.4) = 1.327e7 s = 153.6 days, by hand.
    assumed = f["projected: days on 8 devices at 9.89e+14 FLOP/s × MFU 0.4"]["expected"]
    assert assumed == pytest.approx(4.2e22 / (8 * 989e12 * 0.4) / 86400) == pytest.approx(153.6, abs=0.05)
    # MFU: against the datasheet peak on a known GPU, a measured matmul on a CPU (labelled so).
    assert f["peak FLOP/s is"]["measured"] == ("measured matmul" if run2.summary["device"] == "cpu"
                                               else "datasheet")
    mfu = f["MFU (achieved / peak)"]["measured"]
    assert mfu == pytest.approx(f["achieved FLOP/s per rank"]["measured"] / f["peak FLOP/s per rank"]["measured"])
    assert run2.check("MFU <= 1")["kind"] == "timing"  # reported, never fatal
    # The step time comes with its spread: every rank's fastest and slowest timed step.
    step = f["step time, median (slowest rank)"]
    assert 0 < step["spread"][0] <= step["measured"] <= step["spread"][1]
    rate = f["achieved FLOP/s per rank"]["measured"]
    measured = f["projected: days on 8 devices at this run's rate"]["measured"]
    assert rate > 0 and measured == pytest.approx(4.2e22 / (8 * rate) / 86400)
    lines = [json.loads(x) for x in (run2.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [2, 4, 6, 8, 9]  # 1 counted + 2 warm-up + 6 timed
    assert all({"step", "time_s", "loss", "lr"} <= m.keys() and math.isfinite(m["loss"]) for m in lines)


# --- the all-reduce on three ranks, with a negative control --------------------------------

@pytest.mark.timeout(90)
def test_all_reduce_on_three_ranks_and_skipped_all_reduce_is_caught():
    results = run_on_ranks(train.all_reduce_sum, 3, torch.device("cpu"), timeout=60)
    for rank, (local, total, expected) in enumerate(results):
        assert local == rank + 1 and expected == 6
        assert check_ok(total, expected, tolerance=0)
        # Negative control: a rank that skipped the all-reduce holds its own rank+1, and the
        # same check rejects it.
        assert not check_ok(local, expected, tolerance=0)


# --- FLOP counting: FlopCounterMode against the formula, computed here ---------------------

def counted_step_flops(dims, batch, input_requires_grad=False):
    torch.manual_seed(0)
    model = MLP(dims[0], dims[1], dims[-1], len(dims) - 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, dims[0], requires_grad=input_requires_grad)
    y = torch.randn(batch, dims[-1])
    with FlopCounterMode(display=False) as counter:
        train.train_step(model, opt, x, y)
    return counter.get_total_flops(), count_params(model)


@pytest.mark.parametrize("dims,batch", [([16, 32, 32, 1], 8), ([7, 3], 4), ([64, 48, 48, 48, 10], 32)])
def test_flop_counter_matches_the_formula_exactly(dims, batch):
    counted, n_params = counted_step_flops(dims, batch)
    # Layer by layer: forward 2·B·a·b; backward 2·B·a·b for the weight gradient and, except
    # for the first layer (its input needs no gradient), 2·B·a·b for the input gradient.
    by_hand = sum((4 if i == 0 else 6) * batch * a * b for i, (a, b) in enumerate(zip(dims, dims[1:])))
    assert counted == by_hand == flops.mlp_step_flops(dims, batch)
    # Negative control: the textbook 6·N·B (N with biases) is close but not exact.
    assert counted != 6 * n_params * batch
    assert 0.5 < counted / (6 * n_params * batch) < 1
    # The first-layer exception is real: an input that needs a gradient adds 2·B·in₀·out₀.
    with_input_grad, _ = counted_step_flops(dims, batch, input_requires_grad=True)
    assert with_input_grad == by_hand + 2 * batch * dims[0] * dims[1] != flops.mlp_step_flops(dims, batch)


def test_count_flops_counts_a_function():
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    assert flops.count_flops(lambda: a @ b) == 2 * 5 * 7 * 3


# --- calculators against hand-worked numbers ----------------------------------------------

def test_bytes_per_parameter_of_each_recipe():
    assert calc.bytes_per_param("fp32_adam") == 4 + 4 + 4 + 4 == 16
    assert calc.bytes_per_param("mixed_adam") == 2 + 2 + 4 + 4 + 4 == 16
    assert calc.bytes_per_param("bf16_inference") == 2
    assert sorted(calc.recipe_breakdown("mixed_adam").values()) == [2, 2, 4, 4, 4]
    with pytest.raises(ValueError, match="unknown recipe 'fp8'"):
        calc.bytes_per_param("fp8")


def test_7b_model_memory_by_hand():
    assert calc.training_state_bytes(7e9, "bf16_inference") == 14e9
    assert calc.to_gb(calc.training_state_bytes(7e9, "bf16_inference")) == pytest.approx(14.0)
    assert calc.to_gib(14e9) == pytest.approx(13.04, abs=0.005)  # 14e9 / 2**30
    assert calc.to_gb(calc.training_state_bytes(7e9, "mixed_adam")) == pytest.approx(112.0)
    assert calc.to_gb(calc.training_state_bytes(7e9, "fp32_adam")) == pytest.approx(112.0)
    assert calc.to_gib(112e9) == pytest.approx(104.31, abs=0.005)
    parts = calc.state_breakdown_gb(7e9, "mixed_adam")
    assert parts == pytest.approx({"bf16 weights": 14, "bf16 gradients": 14,
                                   "fp32 master weights": 28, "Adam m (fp32)": 28,
                                   "Adam v (fp32)": 28})


def test_devices_needed_to_hold_the_state():
    assert calc.devices_to_hold(7e9, 80) == 2      # 112 GB / 80 GB = 1.4
    assert calc.devices_to_hold(7e9, 24) == 5      # 112 / 24 = 4.67
    assert calc.devices_to_hold(7e9, 112) == 1     # exactly full
    assert calc.devices_to_hold(70e9, 80) == 14    # 1120 / 80
    assert calc.devices_to_hold(7e9, 80, "bf16_inference") == 1


def test_training_flops_and_time_to_train_by_hand():
    assert calc.training_flops(7e9, 1e12) == pytest.approx(4.2e22, rel=1e-15)
    # 1B params, 10B tokens: 6e19 FLOP; 4 devices at 1e15 FLOP/s and MFU 0.5 do 2e15 FLOP/s.
    assert calc.time_to_train_s(1e9, 1e10, 4, 1e15, 0.5) == pytest.approx(30_000, rel=1e-12)
    # 7B on 1T tokens, 8 H100s (989e12 bf16 dense) at MFU 0.4: 3.1648e15 FLOP/s in all,
    # 4.2e22 / 3.1648e15 = 1.3271e7 s = 153.6 days; on one H100, 8 times longer (3.4 years).
    t8 = calc.time_to_train_s(7e9, 1e12, 8, 989e12, 0.4)
    assert t8 == pytest.approx(1.32710e7, rel=1e-5)
    assert calc.days(t8) == pytest.approx(153.60, abs=0.005)
    t1 = calc.time_to_train_s(7e9, 1e12, 1, 989e12, 0.4)
    assert calc.days(t1) / 365 == pytest.approx(3.366, abs=0.001)
    assert calc.time_to_train_s(7e9, 1e12, 8, 989e12 * 0.4) == pytest.approx(t8)  # mfu=1 default


@pytest.mark.parametrize("call,message", [
    (lambda: calc.time_to_train_s(7e9, 1e12, 0, 1e15, 0.4), "n_devices must be at least 1"),
    (lambda: calc.time_to_train_s(7e9, 1e12, 8, 1e15, 1.5), r"mfu must be in \(0, 1\]"),
    (lambda: calc.training_flops(-1, 1e12), "n_params must be positive"),
    (lambda: calc.devices_to_hold(7e9, 0), "device_memory_gb must be positive"),
])
def test_calculators_reject_impossible_inputs(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- the inline setup and the command line -------------------------------------------------

def test_setup_falls_back_to_a_world_of_one(no_launcher):
    info = setup_distributed("cpu", "auto", timeout_s=30)
    try:
        assert (info.rank, info.world_size, info.launcher) == (0, 1, "single")
        assert (info.device, info.backend) == (torch.device("cpu"), "gloo")
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert train.all_reduce_sum(info.device) == (1.0, 1.0, 1.0)  # a real collective works
    finally:
        teardown_distributed()
    assert not dist.is_initialized()


def test_main_runs_as_one_process(no_launcher, tmp_path):
    cfg = train.Config(out=str(tmp_path), steps=2, warmup=0, matmul_size=64)
    assert train.main(cfg) == 0
    assert not dist.is_initialized()  # destroyed in finally
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 1
    assert {c["name"]: c["ok"] for c in summary["checks"] if c["kind"] != "timing"} == {
        "rank views cover ranks 0..n-1": True, "all-reduce SUM of rank+1 = n(n+1)/2": True,
        "step FLOPs = 6·B·Σ in·out − 2·B·in₀·out₀": True}


def test_nccl_is_refused_on_a_cpu_only_machine(no_launcher, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a CPU-only machine
    with pytest.raises(DistributedSetupError, match="nccl backend needs CUDA"):
        setup_distributed("auto", "nccl", timeout_s=10)
    with pytest.raises(DistributedSetupError, match="--device cuda, but torch sees no CUDA GPU"):
        setup_distributed("cuda", "auto", timeout_s=10)
    assert not dist.is_initialized()
    assert train.main(train.Config(out=str(tmp_path), backend="nccl")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["train.py: error: the nccl backend needs CUDA devices: use --backend gloo on CPU"]


# --- the launch setup train.py calls (common.distributed), against rules written here ----------

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
            "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
        "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "42"}
ENVS = {
    "plain python": {},
    "torchrun": TORCHRUN,
    "srun, no GPUs": SRUN,
    "srun, one GPU per task": {**SRUN, "SLURM_GPUS_PER_TASK": "1", "SLURM_STEP_GPUS": "1"},
    "srun, GPUs per node": {**SRUN, "SLURM_NTASKS_PER_NODE": "8", "SLURM_GPUS_ON_NODE": "8"},
    "srun torchrun": {**SRUN, **TORCHRUN, "SLURM_GPUS_ON_NODE": "8"},
}
# (rank, local_rank, world_size, local_world_size, launcher), read off each environment by hand
# (Slurm's "8(x2)" tasks per node: 8 on this node)
LAUNCHES = {
    "plain python": (0, 0, 1, 1, "single"),
    "torchrun": (3, 3, 16, 8, "torchrun"),
    "srun, no GPUs": (9, 1, 16, 8, "slurm"),
    "srun, one GPU per task": (9, 1, 16, 8, "slurm"),
    "srun, GPUs per node": (9, 1, 16, 8, "slurm"),
    "srun torchrun": (3, 3, 16, 8, "torchrun"),
}


@pytest.mark.parametrize("name", list(ENVS))
def test_launch_reading_of_every_launcher(name):
    got = read_launch_env(ENVS[name])
    keys = ("rank", "local_rank", "world_size", "local_world_size", "launcher")
    assert tuple(got[k] for k in keys) == LAUNCHES[name], name
    assert got["launcher"] == {"plain python": "single", "torchrun": "torchrun",
                               "srun torchrun": "torchrun"}.get(name, "slurm")


def _decide(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except DistributedSetupError as e:
        return f"refused: {e}"


def _rule(local_rank, local_world, device="auto", backend="auto", gpu_count=0, env=None):
    """The device choice the lesson states, written here from its sentences: CUDA when every
    local rank has a GPU; cuda:0 when srun bound one GPU to each task; GPUs asked for (--device
    cuda, or Slurm allocated some) but none visible: refused; fewer GPUs than local ranks:
    refused unless --device cuda --backend gloo shares them; else the CPU. The backend follows
    the device, and nccl without CUDA is refused."""
    env = env or {}
    slurm_gpus = any(env.get(k, "") not in ("", "0") for k in (
        "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_PER_TASK"))
    srun_task = "SLURM_PROCID" in env and "LOCAL_WORLD_SIZE" not in env
    if device != "cpu" and gpu_count == 0 and (device == "cuda" or slurm_gpus):
        return "refused: sees no GPU"
    if device == "cpu" or (device == "auto" and gpu_count == 0):
        dev = torch.device("cpu")
    elif gpu_count >= local_world:
        dev = torch.device("cuda", local_rank)
    elif gpu_count == 1 and srun_task:
        dev = torch.device("cuda", 0)
    elif device == "cuda" and backend == "gloo":
        dev = torch.device("cuda", local_rank % gpu_count)
    else:
        return "refused: too few GPUs"
    if backend == "nccl" and dev.type != "cuda":
        return "refused: nccl needs CUDA"
    return dev, (("nccl" if dev.type == "cuda" else "gloo") if backend == "auto" else backend)


REFUSALS = {"refused: sees no GPU": "but torch sees no CUDA GPU",
            "refused: too few GPUs": "processes on this node but",
            "refused: nccl needs CUDA": "the nccl backend needs CUDA devices"}


@pytest.mark.parametrize("name", list(ENVS))
def test_device_choice_follows_the_lessons_rules(name):
    """Every combination of GPUs visible, local layout and overrides: the same device and
    backend as the rules written here, or a refusal for the same reason."""
    env, seen = ENVS[name], set()
    for gpus in (0, 1, 2, 8):
        for local_rank, local_world in ((0, 1), (1, 2), (3, 8), (7, 8)):
            for device in ("auto", "cpu", "cuda"):
                for backend in ("auto", "gloo", "nccl"):
                    args = (local_rank, local_world, device, backend)
                    mine = _rule(*args, gpu_count=gpus, env=env)
                    theirs = _decide(choose_device_and_backend, *args, gpu_count=gpus, env=env)
                    if isinstance(mine, str):
                        assert isinstance(theirs, str) and REFUSALS[mine] in theirs, (name, gpus, args)
                    else:
                        assert mine == theirs, (name, gpus, args)
                    seen.add(str(mine))
    assert any(s.startswith("refused") for s in seen) and any("cuda" in s for s in seen)


def _old_choice(local_rank, local_world, device="auto", backend="auto", gpu_count=0, env=None):
    """The rule this chapter had before: CUDA only if every local rank has a GPU, else the CPU."""
    if device == "auto":
        device = "cuda" if gpu_count >= local_world else "cpu"
    dev = torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")
    return dev, ("nccl" if dev.type == "cuda" else "gloo") if backend == "auto" else backend


def test_the_agreement_check_rejects_the_old_rule():
    """Negative control: the old rule silently ran srun's one-GPU-per-task ranks on the CPU,
    and the comparison with the choice the setup makes catches it."""
    env = ENVS["srun, one GPU per task"]
    assert _old_choice(5, 8, gpu_count=1, env=env) == (torch.device("cpu"), "gloo")
    assert _old_choice(5, 8, gpu_count=1, env=env) != choose_device_and_backend(5, 8, gpu_count=1, env=env)
    assert _old_choice(5, 8, gpu_count=1, env=env) != _rule(5, 8, gpu_count=1, env=env)


def test_srun_with_one_gpu_per_task_and_missing_gpus():
    choose_device = choose_device_and_backend
    one_per_task = ENVS["srun, one GPU per task"]
    # Slurm bound one GPU to each of 8 tasks on the node: each task's cuda:0 is its own.
    assert choose_device(5, 8, gpu_count=1, env=one_per_task) == (torch.device("cuda", 0), "nccl")
    # ... and the same 8 local ranks under torchrun with one GPU would collide: refused.
    with pytest.raises(DistributedSetupError, match="8 processes on this node but 1 GPU"):
        choose_device(5, 8, gpu_count=1, env=TORCHRUN)
    # Slurm allocated GPUs but torch sees none (a CPU-only torch): loud, not a silent CPU run.
    with pytest.raises(DistributedSetupError, match="Slurm allocated GPUs to this job, but torch sees no"):
        choose_device(0, 8, gpu_count=0, env=one_per_task)
    assert choose_device(0, 8, "cpu", gpu_count=0, env=one_per_task) == (torch.device("cpu"), "gloo")
    # Two ranks sharing one GPU: only gloo allows it.
    assert choose_device(1, 2, "cuda", "gloo", gpu_count=1, env={}) == (torch.device("cuda", 0), "gloo")


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_teardown_collects_and_lets_gloo_go_idle(no_launcher, monkeypatch, backend):
    """The teardown train.py calls: destroy the group, collect reference cycles, and under gloo
    give its worker threads 50 ms (a teardown that dropped the collection or the wait, or waited
    under NCCL, would differ); without a group it does nothing."""
    import gc
    import time

    steps = []
    destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: (steps.append("destroy"), destroy(*a)))
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)  # the group's backend, as reported
    monkeypatch.setattr(gc, "collect", lambda *a: steps.append("gc") or 0)
    monkeypatch.setattr(time, "sleep", lambda s: steps.append(f"sleep {s}"))
    assert train.teardown_distributed is teardown_distributed  # one implementation
    setup_distributed("cpu", "gloo", timeout_s=30)
    teardown_distributed()
    assert not dist.is_initialized()
    teardown_distributed()  # without a group: nothing to do
    expected = ["destroy", "gc"] + (["sleep 0.05"] if backend == "gloo" else [])
    assert steps == expected


def test_setup_reads_an_srun_launch_of_one_task(monkeypatch):
    """srun starting the rank itself (no torchrun): rank 0 hosts the store, the group forms."""
    from common.distributed import free_port

    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    for k, v in {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
                 "SLURM_TASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "localhost",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    info = setup_distributed("cpu", "auto", timeout_s=30)
    try:
        assert (info.launcher, info.rank, info.world_size, info.device) == ("slurm", 0, 1, torch.device("cpu"))
        assert train.all_reduce_sum(info.device) == (1.0, 1.0, 1.0)
    finally:
        teardown_distributed()


@pytest.mark.parametrize("argv,message", [
    (["--project-devices", "0"], "--project-devices must be at least 1, got 0"),
    (["--mfu", "1.5"], "--mfu is a fraction of peak in (0, 1], got 1.5"),
    (["--project-params=-7e9"], "--project-params must be positive, got -7000000000.0"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
])
def test_bad_option_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(train.Config, argv, description=train.__doc__)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"error: {message}" in err[-1]  # the last line says why (argparse may add usage above)
    assert not any("Traceback" in line for line in err)


# --- the exercises' numbers ----------------------------------------------------------------

def test_exercise_answers():
    # 1. 70B: 1120 GB of mixed-precision Adam state -> 14 GPUs of 80 GB; at 8 B/param, 560 GB -> 7.
    assert calc.devices_to_hold(70e9, 80) == 14
    assert math.ceil(70e9 * 8 / 80e9) == 7
    # 2. Llama 3 405B on 15T tokens: 6ND = 3.645e25 (Meta: 3.8e25 for 15.6T tokens);
    #    16,384 H100s at MFU 0.4: 65.1 days.
    assert calc.training_flops(405e9, 15e12) == pytest.approx(3.645e25)
    assert calc.training_flops(405e9, 15.6e12) == pytest.approx(3.79e25, rel=1e-3)
    assert calc.days(calc.time_to_train_s(405e9, 15e12, 16384, 989e12, 0.4)) == pytest.approx(65.1, abs=0.05)
    # 3. --d-in 1: counted 102,367,232 vs 6·N·B 103,028,736 (ratio 0.9936); with the input's
    #    gradient 2·B·1·256 = 65,536 more.
    dims, B = [1, 256, 256, 256, 8], 128
    counted, n_params = counted_step_flops(dims, B)
    assert (counted, 6 * n_params * B) == (102_367_232, 103_028_736)
    assert 6 * n_params * B - counted == 6 * B * (3 * 256 + 8) + 2 * B * 1 * 256  # biases + first layer
    assert counted_step_flops(dims, B, input_requires_grad=True)[0] == 102_432_768
    # The default MLP, as the lesson quotes it.
    assert counted_step_flops([128, 256, 256, 256, 8], 128) == (119_013_376, 166_664)
