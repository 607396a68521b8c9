"""Chapter 14: what a run logs can be read back, follows its schema, and finds the straggler.

Two real torchrun launches: one with rank 1 slowed on purpose (its logs are read back with
TensorBoard's own EventAccumulator and from the offline W&B run file, and compared with
metrics.jsonl), one with nobody slowed. The validator and the detector also face negative
controls: broken lines must be rejected, noise and single hiccups must not be flagged.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chapters.ch14_monitoring import monitor, train
from common.checkpoint import load_checkpoint
from common.launch import run_torchrun
from common.log import setup_logging
from common.models import MLP
from common.results import RunRecorder

SCRIPT = Path(train.__file__)
GOOD = {"step": 3, "time_s": 0.5, "loss": 0.25, "lr": 0.01, "grad_norm": 1.5, "samples_per_s": 900.0,
        "step_time_s": 0.05, "mfu": 0.001, "compute_s": [0.01, 0.03], "wait_s": [0.02, 0.0]}


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    out = tmp_path_factory.mktemp("slowed")
    return run_torchrun(SCRIPT, nproc=2, args=["--slow-rank", "1", "--slow-ms", "30"], out_dir=out,
                        timeout=120)


def jsonl(out: Path) -> list[dict]:
    return [json.loads(t) for t in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(150)
def test_slowed_rank_is_flagged_and_the_others_are_not(slowed):
    failed = [c["name"] for c in slowed.summary["checks"] if not c["ok"]]
    assert not failed, slowed.output[-3000:]
    assert slowed.check("stragglers flagged (median/MAD of compute times)")["measured"] == [1]
    times = load_checkpoint(slowed.out_dir / "step_times.pt")
    assert list(times["compute"].shape) == [2, train.Config().steps]
    # The sleep makes rank 1's compute at least 30 ms every step: no clock noise can undo that.
    assert times["compute"][1].min().item() >= 0.030
    # The test's own reading of the gathered times, through the detector: rank 1 only.
    assert monitor.find_stragglers(times["compute"].tolist())["flagged"] == [1]
    # Whole step times hide the straggler: the all-reduce makes everybody as slow as rank 1, and
    # the same detector, same rule and run, flags nobody on them...
    assert times["whole"][0].median().item() >= 0.030
    assert monitor.find_stragglers(times["whole"].tolist())["flagged"] == []
    assert slowed.check("stragglers flagged from whole step times (hidden)")["measured"] == []
    # ... while it does flag rank 1 on the same step times less the wait inside the all-reduce.
    assert monitor.find_stragglers((times["whole"] - times["wait"]).tolist())["flagged"] == [1]
    # The validator counts: the script's broken copy of a line has its two errors found.
    assert slowed.check("errors in a broken line (lr missing, loss 'nan')")["measured"] == 2
    # MFU's denominator on a CPU is a measured matmul, and the run says so.
    assert slowed.summary["figures"]["peak source"]["measured"].startswith("measured 256x256 matmul")
    # Every logged throughput and MFU recomputed here from the step time, the config and the
    # peak: global batch / step, and 6 N (per-rank batch) / (step x peak), with N counted from
    # the MLP's shape (16 -> 64 -> 64 -> 1). MFU from the global batch would be 2x off.
    cfg, d = train.Config(), train.Config().d_hidden
    n_params = 16 * d + d + d * d + d + d + 1
    peak = slowed.summary["figures"]["peak used for MFU"]["measured"] * 1e9
    for line in jsonl(slowed.out_dir):
        assert line["samples_per_s"] == pytest.approx(2 * cfg.batch_size / line["step_time_s"], rel=1e-12)
        assert line["mfu"] == pytest.approx(6 * n_params * cfg.batch_size / line["step_time_s"] / peak,
                                            rel=1e-9)


@pytest.mark.timeout(150)
def test_console_says_where_the_events_went_and_holds_no_library_noise(slowed, quiet_console):
    # TensorBoard's writer and wandb start inside library_output: their messages, if any, go to
    # the library log; the console names the events' folder and the command that opens them.
    quiet_console(slowed)
    assert f"  tensorboard --logdir {slowed.out_dir / 'tb'}" in slowed.output.splitlines()


@pytest.mark.timeout(150)
def test_tensorboard_events_hold_the_logged_scalars(slowed):
    lines = jsonl(slowed.out_dir)
    scalars = monitor.read_tensorboard_scalars(slowed.out_dir / "tb")  # TensorBoard's EventAccumulator
    for tag in ("loss", "lr", "grad_norm", "samples_per_s"):
        assert [s for s, _ in scalars[tag]] == [line["step"] for line in lines], tag
        for (_, value), line in zip(scalars[tag], lines):
            assert value == pytest.approx(line[tag], rel=1e-6), tag  # events store float32


@pytest.mark.timeout(150)
def test_offline_wandb_run_holds_the_logged_history(slowed):
    run_file = monitor.wandb_run_file(slowed.out_dir)
    assert run_file.parent.name.startswith("offline-run-")  # offline: nothing was sent
    assert run_file.read_bytes()[:4] == b":W&B"
    history = monitor.read_wandb_history(slowed.out_dir)
    lines = jsonl(slowed.out_dir)
    assert [h["_step"] for h in history] == [line["step"] for line in lines]
    for h, line in zip(history, lines):
        for key in ("loss", "lr", "grad_norm", "samples_per_s", "mfu"):
            assert h[key] == line[key], key  # the same Python floats, exactly
    kinds = {r.WhichOneof("record_type") for r in monitor.read_wandb_records(run_file)}
    assert {"run", "history", "exit"} <= kinds


@pytest.mark.timeout(150)
def test_every_metrics_line_follows_the_schema(slowed):
    lines = (slowed.out_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(range(0, 40, 2)) + 1  # every log_every steps and the last
    assert monitor.validate_file(slowed.out_dir / "metrics.jsonl") == {}
    for line in map(json.loads, lines):
        assert set(monitor.METRICS_SCHEMA) <= set(line)
        assert len(line["compute_s"]) == len(line["wait_s"]) == 2  # one entry per rank


def test_the_validator_rejects_broken_lines():
    assert monitor.validate_line(json.dumps(GOOD)) == []
    assert monitor.validate_line(json.dumps({**GOOD, "extra": "fine"})) == []
    missing = {k: v for k, v in GOOD.items() if k != "grad_norm"}
    assert monitor.validate_line(json.dumps(missing)) == ["missing key 'grad_norm'"]
    for key, bad in [("loss", "0.25"), ("step", 3.0), ("step", True), ("loss", "nan"),
                     ("loss", float("nan")), ("grad_norm", float("inf")), ("lr", True),
                     ("compute_s", [0.1, float("nan")]),  # json.dumps writes NaN, Infinity, true
                     ("lr", None), ("compute_s", [0.1, "x"]), ("wait_s", 0.1), ("compute_s", [])]:
        errors = monitor.validate_line(json.dumps({**GOOD, key: bad}))
        assert len(errors) == 1 and repr(key) in errors[0], (key, bad, errors)
    assert monitor.validate_line("{not json") and monitor.validate_line("[1, 2]")


def test_detector_is_robust_to_noise_and_hiccups():
    def ranks(n, base, slow=None, extra=0.0):
        # deterministic "noise": ±10% around base, one 100 ms hiccup on every rank at step 7
        rows = [[base * (1 + 0.1 * ((r * 7 + t * 3) % 5 - 2) / 2) + (0.1 if t == 7 else 0.0)
                 for t in range(30)] for r in range(n)]
        if slow is not None:
            rows[slow] = [t + extra for t in rows[slow]]
        return rows

    for n in (2, 3, 8):
        assert monitor.find_stragglers(ranks(n, 0.002))["flagged"] == [], n
        assert monitor.find_stragglers(ranks(n, 0.002, slow=n - 1, extra=0.03))["flagged"] == [n - 1], n
    # Two ranks, one 8 ms slower on a 2 ms step: compared with the OTHER rank (2 ms + the 5 ms
    # floor) it is flagged; the median of both ranks (6 ms + 5 ms) would sit too close to it.
    two = ranks(2, 0.002, slow=1, extra=0.008)
    assert monitor.find_stragglers(two)["flagged"] == [1]
    medians = [sorted(r)[len(r) // 2] for r in two]
    assert medians[1] < statistics.median(medians) + 0.005  # the all-ranks reference misses it
    # 10% slower on a 100 ms step: below the default factor, and within the ±10% noise the MAD
    # measures, so a lower factor alone does not flag it; trusting smaller gaps (z = 1) does.
    rows = ranks(4, 0.1, slow=2, extra=0.01)
    assert monitor.find_stragglers(rows)["flagged"] == []
    assert monitor.find_stragglers(rows, factor=1.05)["flagged"] == []
    assert monitor.find_stragglers(rows, factor=1.05, z=1.0)["flagged"] == [2]
    # One rank with wild noise (a single long hiccup every third step) is not a straggler.
    noisy = ranks(3, 0.002)
    noisy[0] = [t + (0.05 if i % 3 == 0 else 0.0) for i, t in enumerate(noisy[0])]
    assert monitor.find_stragglers(noisy)["flagged"] == []
    assert monitor.find_stragglers([[0.01, 0.02]])["flagged"] == []  # a world of one


@pytest.mark.timeout(150)
def test_no_slowed_rank_nobody_is_flagged(tmp_path):
    res = run_torchrun(SCRIPT, nproc=2, args=["--no-wandb", "--no-tensorboard"], out_dir=tmp_path,
                       timeout=120)
    assert res.check("stragglers flagged (median/MAD of compute times)")["measured"] == []
    assert res.check("stragglers flagged from whole step times (hidden)")["measured"] == []
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "tb").exists()
    assert monitor.validate_file(tmp_path / "metrics.jsonl") == {}


def test_missing_wandb_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT"):
        monkeypatch.delenv(var, raising=False)
    setup_logging(0, 1)
    assert monitor.wandb_offline_init(tmp_path, {}) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "wandb is not installed" in out[0]


def test_bad_input_is_refused_in_one_sentence(capsys):
    # A slowed rank that does not exist is refused before any process group exists.
    with pytest.raises(ValueError, match="--slow-rank 3 does not exist in a world of 2 ranks"):
        train.validate(train.Config(slow_rank=3), 2)
    with pytest.raises(SystemExit) as e:
        train.parse_config(train.Config, ["--slow-rank", "3"], validate=train.validate, world_size=2)
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    for world in (1, 2, 3, 4, 8, 16):
        train.validate(train.Config(), world)
    assert not dist.is_initialized()
    for argv in (["--slow-ms", "-1"], ["--straggler-factor", "1"], ["--slow-rank", "-2"],
                 ["--straggler-min-gap-ms", "-1"]):
        with pytest.raises(SystemExit) as e:
            train.parse_config(train.Config, argv)
        assert e.value.code == 2


def test_grad_norm_check_rejects_a_norm_that_misses_a_tensor():
    torch.manual_seed(0)
    model = MLP(16, 64, 1)
    torch.nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1)).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=math.inf).item()
    assert abs(train.grad_norm(model) - total) <= 2e-5 * total  # the script's relative tolerance
    weights_only = math.sqrt(sum(p.grad.double().pow(2).sum().item()
                                 for n, p in model.named_parameters() if n.endswith("weight")))
    assert abs(weights_only - total) > 2e-5 * total  # broken: biases left out (10 % here)


def synthetic(n: int, base: float, noise: float, slow: int | None = None, extra: float = 0.0):
    """Deterministic step times: base ± noise·base in a fixed pattern, rank `slow` `extra` slower."""
    rows = [[base * (1 + noise * ((r * 7 + t * 3) % 5 - 2) / 2) for t in range(40)] for r in range(n)]
    if slow is not None:
        rows[slow] = [t + extra for t in rows[slow]]
    return rows


def test_exercise_answers():
    # 1. Three ranks, rank 2 3 ms slower on a 1 ms step: below the 5 ms floor, not flagged; with
    # the floor at 1 ms (--straggler-min-gap-ms 1) it is. A 300 ms GPU step with 1 % noise and a
    # rank 30 ms slower: the factor term (0.5 x 300 ms) decides and hides it; factor 1.05 and a
    # 1 ms floor flag it.
    cpu = synthetic(3, 0.001, 0.1, slow=2, extra=0.003)
    assert monitor.find_stragglers(cpu)["flagged"] == []
    assert monitor.find_stragglers(cpu, min_gap_s=0.001)["flagged"] == [2]
    gpu = synthetic(8, 0.300, 0.01, slow=3, extra=0.030)
    assert monitor.find_stragglers(gpu)["flagged"] == []
    assert monitor.find_stragglers(gpu, factor=1.05, min_gap_s=0.001)["flagged"] == [3]
    # 2. A new key in the schema: every old line is rejected, with one error each.
    schema = {**monitor.METRICS_SCHEMA, "tokens_per_s": "number"}
    assert monitor.validate_line(json.dumps(GOOD), schema) == ["missing key 'tokens_per_s'"]
    # 4. Sums over ranks keep the mean and spread of all ranks together, not who is slow: two
    # worlds with different stragglers give the same (sum, sum of squares, max).
    a, b = [10, 10, 40], [40, 10, 10]  # ms per rank
    stats = lambda xs: (sum(xs), sum(x * x for x in xs), max(xs))  # noqa: E731
    assert stats(a) == stats(b)
    assert monitor.find_stragglers([[x / 1e3] * 5 for x in a])["flagged"] == [2]
    assert monitor.find_stragglers([[x / 1e3] * 5 for x in b])["flagged"] == [0]


def test_exercise_3_per_rank_chart_through_the_public_writer(tmp_path):
    """Exercise 3's answer, run: per-rank compute times through RunRecorder.tensorboard_writer,
    read back with TensorBoard's own reader, one series per rank."""
    pytest.importorskip("tensorboard")
    rec = RunRecorder(train.Config(out=str(tmp_path), tensorboard=True), str(SCRIPT))
    for step, line in enumerate([{"compute_s": [0.0005, 0.0305]}, {"compute_s": [0.0004, 0.0306]}]):
        if rec.tensorboard_writer is not None:  # the answer's code, as the lesson prints it
            rec.tensorboard_writer.add_scalars("compute_ms", {f"rank{r}": t * 1e3 for r, t in
                                                             enumerate(line["compute_s"])}, step)
    rec.finish()
    series = {r: monitor.read_tensorboard_scalars(tmp_path / "tb" / f"compute_ms_rank{r}")["compute_ms"]
              for r in (0, 1)}
    assert [v for _, v in series[1]] == pytest.approx([30.5, 30.6], rel=1e-6)  # float32 events
    assert all(v1 - v0 > 29 for (_, v0), (_, v1) in zip(series[0], series[1]))


def test_learning_rate_warms_up_then_decays_to_ten_percent():
    cfg = train.Config(lr=0.1, warmup_steps=4, steps=20)
    lrs = [train.learning_rate(s, cfg) for s in range(20)]
    assert lrs[:4] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert train.learning_rate(cfg.steps, cfg) == pytest.approx(0.01)


def _quoted(xs, decimals=None, sig=None, dash="–") -> str:
    """A range as the README writes it: min and max of `xs`, each to `decimals` decimals or to
    `sig` significant figures (0.297 -> 0.30, 16.78 -> 17)."""
    def one(x):
        d = decimals if sig is None else max(0, sig - 1 - math.floor(math.log10(abs(x))))
        return f"{x:.{d}f}"
    return f"{one(min(xs))}{dash}{one(max(xs))}"


def test_the_ranges_the_lesson_quotes_are_the_recorded_runs():
    """figures/runs.json (`plots.record_runs`) holds the six runs "What you should see" sums up:
    every range the README quotes is built here from that file and must appear in the README
    (an edited number, or a re-recorded runs.json with other numbers, fails), and every logged
    MFU in it is 6·N·(B/W) / (t·P) recomputed from the step time and the run's measured peak."""
    data = json.loads((SCRIPT.parent / "figures" / "runs.json").read_text())
    readme = " ".join((SCRIPT.parent / "README.md").read_text().split())
    slowed = [r for r in data["runs"] if r["args"]]
    plain = [r for r in data["runs"] if not r["args"]]
    assert len(slowed) == len(plain) == 3

    def fig(runs, key, ranks=(0, 1)):
        return [r["figures"][key] if ranks is None else r["figures"][key][i]
                for r in runs for i in ([0] if ranks is None else ranks)]

    peak, compute = "peak used for MFU", "median compute per rank"
    wait, whole = "median wait in all-reduce per rank", "median whole step per rank"
    mfu_median = {name: [100 * statistics.median(x["mfu"] for x in r["logged"]) for r in runs]
                  for name, runs in (("slowed", slowed), ("plain", plain))}
    mfu_step = {name: [100 * x["mfu"] for r in runs for x in r["logged"]]
                for name, runs in (("slowed", slowed), ("plain", plain))}
    step_ms = {name: [1e3 * x["step_time_s"] for r in runs for x in r["logged"]]
               for name, runs in (("slowed", slowed), ("plain", plain))}

    def flagged(runs, check):  # what every run of `runs` flagged, the same in all of them
        found = {json.dumps(r["checks"][check]) for r in runs}
        assert len(found) == 1, (check, found)
        return f"`{found.pop()}`"

    by_compute = "stragglers flagged (median/MAD of compute times)"
    by_step = "stragglers flagged from whole step times (hidden)"
    quoted = [
        f"{flagged(slowed, by_compute)} flagged from compute times and "
        f"{flagged(slowed, by_step)} from whole step times in all three",
        f"flagged {flagged(plain, by_compute)} from compute and from whole step times",
        f"{_quoted(fig(data['runs'], peak, None), 0, dash=' to ')} GFLOP/s over the six runs",
        f"load {_quoted([x for r in slowed for x in r['load_1min']], 0)};",
        f"rank 1 computed {_quoted(fig(slowed, compute, [1]), 1)} ms",
        f"rank 0 {_quoted(fig(slowed, compute, [0]), 2)} ms",
        f"rank 0 waited {_quoted(fig(slowed, wait, [0]), 0)} ms",
        f"rank 1 {_quoted(fig(slowed, wait, [1]), sig=2)} ms; whole steps",
        f"whole steps {_quoted(fig(slowed, whole), 0)} ms",
        f'"peak" {_quoted(fig(slowed, peak, None), 0)} GFLOP/s. Three runs with nobody slowed',
        f"compute {_quoted(fig(plain, compute), 2)} ms on both ranks",
        f"thresholds {_quoted(fig(plain, 'straggler threshold per rank'), 1)} ms",
        f"each rank waiting {_quoted(fig(plain, wait), 0)} ms",
        f'the "peak" {_quoted(fig(plain, peak, None), 0)} GFLOP/s.',
        f"({_quoted(fig(slowed, wait, [1]), sig=2)} ms in the three recorded runs)",
        f"median logged MFU was {_quoted(mfu_median['slowed'], sig=2)} %",
        f"(single logged steps {_quoted(mfu_step['slowed'], sig=2)} %, "
        f"steps of {_quoted(step_ms['slowed'], sig=2)} ms",
        f"with nobody slowed {_quoted(mfu_median['plain'], sig=2)} % "
        f"(single steps {_quoted(mfu_step['plain'], sig=2)} %, {_quoted(step_ms['plain'], sig=2)} ms)",
    ]
    missing = [q for q in quoted if q not in readme]
    assert not missing, f"README does not quote these ranges from figures/runs.json: {missing}"

    assert all(r["checks"][by_compute] == [1] for r in slowed)
    assert all(r["checks"][by_compute] == [] for r in plain)
    for r in data["runs"]:
        assert r["checks"][by_step] == []
        for line in r["logged"]:
            want = 6 * 5313 * 64 / (line["step_time_s"] * r["figures"][peak] * 1e9)
            assert line["mfu"] == pytest.approx(want, rel=1e-9)


def test_record_runs_stops_with_one_sentence_when_a_run_leaves_no_summary(tmp_path, monkeypatch):
    """`plots.record_runs` (how runs.json is re-recorded) refuses a run that crashed before writing
    summary.json instead of a TypeError, and writes nothing; a run that has one is recorded."""
    import common.launch
    from chapters.ch14_monitoring import plots

    line = {"step": 0, "step_time_s": 0.01, "mfu": 0.001}
    summary = {"figures": {"peak used for MFU": {"measured": 50.0}},
               "checks": [{"name": "stragglers flagged (median/MAD of compute times)", "measured": []}]}

    def fake(script, nproc, out_dir, timeout, args, expect_ok):
        (Path(out_dir) / "metrics.jsonl").write_text(json.dumps(line) + "\n")
        return common.launch.LaunchResult(0 if ok else 1, "Traceback ...\nBoom", Path(out_dir),
                                          summary if ok else None)

    monkeypatch.setattr(common.launch, "run_torchrun", fake)
    out = tmp_path / "runs.json"
    ok = False
    with pytest.raises(RuntimeError, match=r"exited 1 without writing summary.json(.|\n)*Boom"):
        plots.record_runs(1, out)
    assert not out.exists()
    ok = True  # the control: with a summary the same call records both runs
    data = plots.record_runs(1, out)
    assert json.loads(out.read_text()) == data and len(data["runs"]) == 2
    assert data["runs"][0]["figures"] == {"peak used for MFU": 50.0} and data["runs"][1]["logged"] == [line]
