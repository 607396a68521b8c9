"""Chapter 12: full-state resume is bit-identical (one process, and several ranks with DCP), DCP
reshards 2 → 1 and 2 → 4, a save killed halfway leaves the previous checkpoint loadable, a delta
is small and exact; every checkpoint is verified before use and nothing loaded runs code.

The scripts check themselves (summary.json); this module recomputes the references with its
own code (an uninterrupted training loop, the saved full state compared on 1 and 4 ranks, a
multi-rank resume in new processes compared with the uninterrupted run of another launch) and
runs the negative controls: a resume without the RNG state or the data position, per-rank state
under one DCP key, a loader drawing from the global RNG, a non-atomic save killed halfway, a
plain per-rank torch.save loaded elsewhere, an unfinished DCP folder, lossy deltas.

The faults (issue 18), each with its outcome and the previous checkpoint proven intact: flipped
bytes, truncation, a missing shard, a torn or missing manifest (fall back to the newest that
verifies, one line naming the bad one, the resumed run equal to a resume from there); every
checkpoint bad, another run's, another model's, another world's (refused in one line); a crafted
`.metadata` or bytes entry whose pickle creates a marker file (refused, the marker never appears,
while DCP's own reader runs it: the control); two runs on one --out or --ckpt-dir (the second
refused naming the first's pid); a full disk (one line naming the file).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chapters.ch12_checkpointing import (
    checkpoint_files,
    checks,
    deepspeed_ckpt,
    resumable,
    resume,
    resume_dcp,
    train,
)
from chapters.ch12_checkpointing import delta as deltas
from common.checkpoint import (
    MANIFEST,
    CheckpointError,
    FolderInUseError,
    file_entry,
    load_checkpoint,
    load_dcp,
    lock_folder,
    read_dcp_metadata,
    read_manifest,
    sha256_file,
    training_shapes,
    unlock_folder,
    verify_dcp,
    verify_manifest,
    write_manifest,
)
from common.data import regression_data
from common.launch import run_on_ranks, run_python, run_torchrun, started, wait_until
from common.models import MLP
from common.seed import capture_rng_state, restore_rng_state, seed_everything

SCRIPT, RESUME, RESUME_DCP = Path(train.__file__), Path(resume.__file__), Path(resume_dcp.__file__)


# --- faults, made the way a disk, a crash or an attacker makes them ------------------------------

def flip(path: Path, offset: int, n: int = 16) -> None:
    """Invert `n` bytes of `path` from `offset` (a bad sector, a bit-flipping link)."""
    data = bytearray(path.read_bytes())
    data[offset:offset + n] = bytes(b ^ 0xFF for b in data[offset:offset + n])
    path.write_bytes(bytes(data))


def zip_weight_offset(data: bytes) -> int:
    """Where the first tensor's bytes (member .../data/0, the first weight) start in a torch.save
    archive (stored uncompressed: header, name, extra field, then the bytes)."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len


def flip_weight(path: Path) -> None:
    """16 flipped bytes inside the first weight of a .pt checkpoint."""
    flip(path, zip_weight_offset(path.read_bytes()) + 64)


def flip_dcp_weight(folder: Path, fqn: str = "model.0.weight") -> str:
    """16 flipped bytes inside one stored chunk of weight `fqn` of a DCP folder; returns the file."""
    meta = read_dcp_metadata(folder)
    info = next(v for k, v in meta.storage_data.items() if k.fqn == fqn)
    shard = folder / info.relative_path
    with open(shard, "rb") as f:
        f.seek(info.offset)
        chunk = f.read(info.length)  # DCP stores each tensor as its own torch.save archive
    flip(shard, info.offset + zip_weight_offset(chunk) + 64)
    return info.relative_path


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


class Payload:
    """Un-pickling this creates the file `marker`: what a crafted checkpoint does with any code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def reseal(folder: Path, *names: str, **meta) -> None:
    """Rewrite the manifest's entries of `names` to match the files, and its `meta` (run id,
    shapes) to say anything: whoever crafts a folder can."""
    manifest = read_manifest(folder)
    files = manifest.pop("files")
    manifest.pop("format", None)
    files.update({name: file_entry(folder / name) for name in names})
    write_manifest(folder, files, **{**manifest, **meta})


def craft_metadata(folder: Path, marker: Path) -> None:
    """The folder's genuine metadata with a payload riding along (`planner_data`): DCP's reader
    un-pickles it, runs the payload and loads normally. The manifest is resealed to match."""
    meta = read_dcp_metadata(folder)
    meta.planner_data = Payload(marker)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    reseal(folder, ".metadata")


def craft_bytes_entry(folder: Path, fqn: str, marker: Path) -> None:
    """Point the non-tensor entry `fqn` at a torch.save'd payload appended to its shard: DCP's
    default planner loads such entries with torch.load(weights_only=False). Resealed."""
    meta = read_dcp_metadata(folder)
    index = next(k for k in meta.storage_data if k.fqn == fqn)
    info = meta.storage_data[index]
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    meta.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    reseal(folder, ".metadata", info.relative_path)


def shas(folder: Path) -> dict[str, str]:
    """Every file's SHA-256 (a checkpoint proven untouched: same bytes before and after)."""
    folder = Path(folder)
    if folder.is_file():
        return {folder.name: sha256_file(folder)}
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir())
            if p.is_file() and p.name != ".lock"}  # the lock file is the run's, not the checkpoint's


@contextmanager
def course_log():
    """The course logger's warning lines (the loaders' one line per skipped checkpoint)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, logger = Keep(logging.WARNING), logging.getLogger("course")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if ": error" in line]


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ch12-dcp")
    return run_torchrun(SCRIPT, nproc=2, out_dir=out, timeout=150)


@pytest.fixture(scope="module")
def resume_dcp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ch12-resume-dcp")
    return run_torchrun(RESUME_DCP, nproc=2, out_dir=out, timeout=150)


def n_params() -> int:
    cfg = train.Config()
    return sum(p.numel() for p in MLP(cfg.d_in, cfg.d_hidden, 1, n_layers=3).parameters())


def _refusal(load) -> list | None:
    """[message, collective] of the CheckpointError `load()` raises, None if it loads."""
    try:
        load()
    except CheckpointError as e:
        return [str(e), e.collective]
    return None


def _reshard_and_live_step(path: str, rid: str, damaged: str) -> dict:
    """On each of N ranks: reshard_check and load_sharded refuse another run's checkpoint and a
    damaged copy (one verdict on every rank); reshard_check (verified first, the ranks sharing
    the hashing); then whether get_state_dict(full) returns Adam's live `step` tensor (rank 0:
    [is it the optimizer's own object, its value after one more step])."""
    model, opt = train.build_sharded(train.Config(), torch.device("cpu"))
    refused = {"reshard another run": _refusal(lambda: train.reshard_check(path, "another")),
               "reshard damaged": _refusal(lambda: train.reshard_check(damaged, rid)),
               "load another run": _refusal(lambda: train.load_sharded(path, model, opt, "another")),
               "load damaged": _refusal(lambda: train.load_sharded(damaged, model, opt, rid))}
    out = train.reshard_check(path, rid)
    out["refused"] = refused
    data = regression_data(8, train.Config().d_in, 1)
    train.train_steps(model, opt, data, 1)
    _, optim_sd = train.get_state_dict(model, opt, options=train.FULL)
    train.train_steps(model, opt, data, 1)  # the gathered copy of step moves on with training
    if torch.distributed.get_rank() == 0:
        step = optim_sd["state"]["0.weight"]["step"]
        live = opt.state[next(iter(model.parameters()))]["step"]
        out["step_is_live"] = [step is live, step.item()]
    return out


def uninterrupted_losses(cfg: resume.Config) -> list[float]:
    """The reference, written here: one run of cfg.steps steps, no checkpoint anywhere."""
    X, Y = regression_data(cfg.n_samples, 16, 1, seed=cfg.seed)
    model, opt, sched = resume.build(cfg)  # seeds torch, builds model, AdamW, cosine schedule
    per_epoch, losses = cfg.n_samples // cfg.batch_size, []
    for step in range(cfg.steps):
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(cfg.n_samples, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        rows = order[i * cfg.batch_size:(i + 1) * cfg.batch_size]
        loss = F.mse_loss(model(X[rows]), Y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(200)
def test_dcp_script_checks_and_sizes(dcp_run):
    res = dcp_run
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"] and c["kind"] != "timing"]
    assert not failed, res.output[-3000:]
    n = n_params()
    assert n == 32 * 256 + 256 + 256 * 256 + 256 + 256 + 1
    expected = 3 * 4 * n + 6 * 4  # weights + Adam m, v (fp32) + one step scalar per tensor
    assert checks.dcp_payload_bytes(res.out_dir / "dcp") == expected
    assert len(list((res.out_dir / "dcp").glob("*.distcp"))) == 2  # one file per rank
    assert res.check("async DCP reload == state at save time")["measured"] == 0
    assert res.check("training moved on during the async writes")["measured"] > 0
    # Same-dtype differences: never wrong where Sterbenz holds, wrong for re-drawn rows.
    assert res.check("fp32 differences: wrong where Sterbenz holds")["measured"] == 0
    assert res.check("fp32 differences of re-drawn rows: wrong elements (> 0)")["measured"] > 0
    # Timings are reported with their spread, each kind warmed up first; never asserted.
    assert len(res.summary["figures"]["blocking save [median, min, max]"]["measured"]) == 3
    assert len(res.summary["figures"]["verify before load [median, min, max]"]["measured"]) == 3
    # Every folder the run wrote, the async ones too (manifest after the future), verifies here,
    # in another process with no process group; the manifest covers every file the metadata
    # points to (a resharded load may read any of them).
    rid = (res.out_dir / "run_id").read_text().strip()
    for name in ("dcp", "dcp_async", "timing/block1", "timing/async2", "warmup/async"):
        manifest = verify_dcp(res.out_dir / name)
        assert manifest["run_id"] == rid and set(manifest["files"]) == {
            ".metadata", "__0_0.distcp", "__1_0.distcp"}, name


@pytest.mark.timeout(200)
def test_two_rank_checkpoint_loads_on_one_and_four_ranks(dcp_run, tmp_path):
    path = dcp_run.out_dir / "dcp"
    rid = (dcp_run.out_dir / "run_id").read_text().strip()
    saved = load_checkpoint(dcp_run.out_dir / "full_state.pt")
    # One process, no process group at all.
    assert train.max_state_diff(train.load_into_one_process(path, rid), saved) == 0
    # The async checkpoint holds the same (pre-async-steps) state.
    assert train.max_state_diff(train.load_into_one_process(dcp_run.out_dir / "dcp_async", rid), saved) == 0
    # Resharding is not another identity; another run or another model is: refused in one line.
    with pytest.raises(CheckpointError, match="belongs to run .*not to this run 'another'"):
        train.load_into_one_process(path, "another")
    other_model = r"another model or optimizer: model.0.bias is \[128\] here, \[256\]"
    with pytest.raises(CheckpointError, match=other_model):
        train.load_into_one_process(path, rid, train.Config(d_hidden=128))
    # A damaged copy is refused before DCP reads it (DCP alone loads the flipped weight).
    bad = tmp_path / "dcp"
    shutil.copytree(path, bad)
    name = flip_dcp_weight(bad)
    with pytest.raises(CheckpointError, match=f"{name} does not match its manifest"):
        train.load_into_one_process(bad, rid)
    # A crafted copy (a hyper-parameter entry is a pickle that creates a file), resealed: it
    # verifies, and the load refuses it; DCP's own load runs it (the control).
    shutil.rmtree(bad)
    shutil.copytree(path, bad)
    marker = tmp_path / "marker"
    craft_bytes_entry(bad, "optim.param_groups.0.lr", marker)
    with pytest.raises(CheckpointError, match="Weights only load failed"):
        train.load_into_one_process(bad, rid)
    assert not marker.exists()
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():  # "no process group: assuming one process" is the intent here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"optim": {"param_groups": [{"lr": 0.0}]}}, checkpoint_id=str(bad))
    assert marker.exists()
    # Four ranks: each holds a quarter of every row-sharded tensor, and the gathered whole equals.
    # First, another run's checkpoint and a damaged copy: refused on every rank, one verdict.
    shutil.rmtree(bad)
    shutil.copytree(path, bad)
    name = flip_dcp_weight(bad)
    results = run_on_ranks(_reshard_and_live_step, 4, str(path), rid, str(bad), timeout=150)
    for r in results:
        for case, verdict in r["refused"].items():
            assert verdict is not None, f"{case}: loaded"
            message, collective = verdict
            reason = "belongs to run" if "another" in case else f"{name} does not match its manifest"
            assert reason in message and collective, (case, message)
    assert results[0]["max_diff"] == 0
    assert [r["shards"]["0.weight"] for r in results] == [64, 64, 64, 64]
    assert [r["shards"]["4.weight"] for r in results] == [1, 0, 0, 0]  # 1 row over 4 ranks
    # What each rank reads (exercise 1): ranks 2 and 3 hold rows 128-255, which rank 1 of the
    # 2-rank run wrote; DCP reads each stored chunk whole, so a quarter costs a half.
    for r in (2, 3):
        assert set(results[r]["reads"]) == {"__1_0.distcp"}, results[r]["reads"]
    shard_bytes = checks.expected_bytes(n_params(), 6) / 4
    assert all(sum(r["reads"].values()) > 1.8 * shard_bytes for r in results)
    # Exercise 2: the full state dict hands out Adam's live `step` tensor, not a copy.
    assert results[0]["step_is_live"] == [True, 2.0]
    # Negative controls: a fresh model is not the saved state, and rank 0's plain torch.save of
    # its shards cannot be loaded by one process (half of each tensor, no layout).
    cfg = train.Config()
    torch.manual_seed(cfg.seed)
    fresh = MLP(cfg.d_in, cfg.d_hidden, 1, n_layers=3)
    assert train.max_state_diff(fresh.state_dict(), saved["model"]) > 0
    shard = load_checkpoint(dcp_run.out_dir / "torch_save_per_rank" / "rank0.pt")
    assert shard["0.weight"].shape == (128, 32)
    with pytest.raises(RuntimeError, match="size mismatch"):
        fresh.load_state_dict(shard)


@pytest.mark.timeout(200)
def test_multi_rank_resume_is_bit_exact_and_per_rank_state_needs_its_own_key(resume_dcp_run):
    res = resume_dcp_run
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"] and c["kind"] != "timing"]
    assert not failed, res.output[-3000:]
    losses = load_checkpoint(res.out_dir / "losses.pt")
    assert losses["resumed"] == losses["reference"]  # every rank, every step, bit for bit
    assert losses["reference"][0] != losses["reference"][1]  # the ranks' batches and dropout differ
    # One key for per-rank state: every rank loads the same (one rank's) value.
    one_key = res.summary["figures"]["pos loaded by each rank, one key"]["measured"]
    assert len(set(one_key)) == 1, one_key
    assert res.summary["figures"]["pos loaded by each rank, rank-keyed"]["measured"] == [0, 1]
    # One entry, one kept copy: on the CPU exactly W - 1 ranks got another rank's dropout stream
    # (read off the metadata), and exactly those diverge at once.
    assert res.summary["figures"]["one key: ranks whose rng.torch was stored by another rank"]["measured"] == 1
    differs = res.check("one key: ranks diverging at once = ranks given another's stream")
    assert differs["measured"] == differs["expected"] == 1
    for control in ("resume without RNG", "resume without data position",
                    "loader on the global RNG: resume"):
        assert res.check(f"{control} == uninterrupted (must not)")["measured"] > 0
    # What it loaded, it had verified: each folder carries a manifest that still verifies.
    for name in ("rank_keyed", "one_key", "pos/one_key", "pos/rank_keyed"):
        assert verify_dcp(res.out_dir / "ckpt" / name)["files"], name


def _resume_phase(ckpt_dir: str, out: str, kill_at: int, held: str = "", crafted: str = "") -> dict:
    """One start of the job on this rank: take --ckpt-dir, resume from the newest checkpoint that
    verifies, save every 4 steps, end at kill_at (a crash) or at the last step. First, with
    `held` (a folder another process has locked): the same job on that folder, which every rank
    must refuse; with `crafted` (a folder whose bytes entry runs code): load it, which every rank
    must refuse."""
    cfg, result = resume_dcp.Config(ckpt_dir=ckpt_dir, save_every=4, kill_at=kill_at), {}
    resume.make_deterministic(cfg.deterministic)
    if held:
        try:
            resume_dcp.run_with_checkpoints(dataclasses.replace(cfg, ckpt_dir=held),
                                            torch.device("cpu"), Path(out), lock_wait_s=0.2)
            result["refused"] = None
        except FolderInUseError as e:
            result["refused"] = [str(e), getattr(e, "collective", False)]
    if crafted:
        try:
            resume_dcp.load_training_state(crafted, resume_dcp.new_run(cfg, torch.device("cpu"), 1))
            result["crafted"] = None
        except CheckpointError as e:
            result["crafted"] = str(e)
    result.update(resume_dcp.run_with_checkpoints(cfg, torch.device("cpu"), Path(out)))
    return result


def dcp_shapes(cfg: resume_dcp.Config) -> dict:
    """The training shapes of resume_dcp.py's run, from an unsharded copy of its model: global
    shapes, whatever the world."""
    model = resumable.mlp(cfg)
    return training_shapes(model, torch.optim.AdamW(model.parameters()))


@pytest.mark.timeout(200)
def test_multi_rank_resume_in_new_processes_equals_uninterrupted(resume_dcp_run, tmp_path):
    ckpt, out, held = tmp_path / "ck", tmp_path / "out", tmp_path / "held"
    lock_folder(held, "--ckpt-dir")  # this process holds it: the ranks' own attempt is refused
    try:
        first = run_on_ranks(_resume_phase, 2, str(ckpt), str(out), 13, str(held), timeout=150)
    finally:
        unlock_folder(held)
    for rank in (0, 1):  # one verdict: every rank refused, only rank 0 says it (collective)
        message, collective = first[rank]["refused"]
        assert f"pid {os.getpid()}" in message and collective, first[rank]["refused"]
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [
        "step_000004", "step_000008", "step_000012"]
    rid, shapes = (out / "run_id").read_text().strip(), dcp_shapes(resume_dcp.Config())
    good = {step: shas(ckpt / f"step_0000{step:02d}") for step in (4, 8, 12)}

    # The faults, in this process (one verifying rank), each on a copy of the three checkpoints:
    # the newest is skipped in one line naming it, step 8 is taken, its bytes unchanged.
    def half_shard(folder):  # a save killed before its manifest (and before DCP's .metadata)
        for p in folder.iterdir():
            p.unlink()
        (folder / "__0_0.distcp").write_bytes(b"half a shard")

    faults = {
        "flipped bytes": (lambda f: flip_dcp_weight(f), "does not match its manifest"),
        "truncated shard": (lambda f: truncate(f / "__0_0.distcp"), "truncated or changed"),
        "missing shard": (lambda f: (f / "__1_0.distcp").unlink(), "in the manifest but missing"),
        "torn manifest": (lambda f: truncate(f / MANIFEST), "torn or not a manifest"),
        "no manifest": (lambda f: (f / MANIFEST).unlink(), "a save that did not finish"),
        "half a shard": (half_shard, "a save that did not finish"),
    }
    for name, (make, reason) in faults.items():
        case = tmp_path / name.replace(" ", "_")
        shutil.copytree(ckpt, case, ignore=shutil.ignore_patterns(".lock"))
        make(case / "step_000012")
        with course_log() as lines:
            path, manifest = resume_dcp.newest_checkpoint(case, rid, shapes)
        assert path.name == "step_000008" and manifest["step"] == 8, name
        assert len(lines) == 1 and "step_000012" in lines[0] and reason in lines[0], (name, lines)
        assert shas(case / "step_000008") == good[8], name
    # Refused in one line: another run's, another model's, another world's, all bad.
    # (identity is checked on the newest that verifies: refused, not walked past as damage)
    with course_log() as lines, pytest.raises(CheckpointError,
                                              match="step_000012 belongs to run .*not to this run 'another'"):
        resume_dcp.newest_checkpoint(ckpt, "another", shapes)
    assert lines == [], lines
    with pytest.raises(CheckpointError, match="step_000012 was written for another model or optimizer"):
        resume_dcp.newest_checkpoint(ckpt, rid, dcp_shapes(resume_dcp.Config(d_hidden=32)))
    assert resume_dcp.newest_checkpoint(ckpt, rid, shapes, 2)[0].name == "step_000012"
    for world in (1, 3):  # resharding resume_dcp.py's per-rank state is refused (train.py reshards)
        with pytest.raises(CheckpointError, match=f"saved by 2 ranks .* not {world}"):
            resume_dcp.newest_checkpoint(ckpt, rid, shapes, world)
    all_bad = tmp_path / "all_bad"
    shutil.copytree(ckpt, all_bad, ignore=shutil.ignore_patterns(".lock"))
    for step in (4, 8, 12):
        flip_dcp_weight(all_bad / f"step_0000{step:02d}")
    damaged = {step: shas(all_bad / f"step_0000{step:02d}") for step in (4, 8, 12)}
    with pytest.raises(CheckpointError, match="none of the 3 checkpoints verifies") as e:
        resume_dcp.newest_checkpoint(all_bad, rid, shapes)
    assert e.value.collective and "\n" not in str(e.value)
    assert damaged == {step: shas(all_bad / f"step_0000{step:02d}") for step in (4, 8, 12)}

    # The real thing, in new processes: the newest checkpoint has 16 flipped bytes in a weight.
    # The job skips it, keeps it aside (never saved over), resumes from step 8, and equals an
    # uninterrupted run of another launch bit for bit. Before, each rank loads a copy of step 8
    # whose step counter is a pickle that creates a file: refused, the file never appears.
    crafted, marker = tmp_path / "crafted" / "step_000008", tmp_path / "marker"
    shutil.copytree(ckpt / "step_000008", crafted)
    craft_bytes_entry(crafted, "progress.step", marker)
    flip_dcp_weight(ckpt / "step_000012")
    flipped = shas(ckpt / "step_000012")
    second = run_on_ranks(_resume_phase, 2, str(ckpt), str(out), 0, "", str(crafted), timeout=150)
    assert not marker.exists()
    assert all("Weights only load failed" in second[rank]["crafted"] for rank in (0, 1)), second[0]
    reference = load_checkpoint(resume_dcp_run.out_dir / "losses.pt")["reference"]  # other launch
    for rank in (0, 1):
        assert first[rank]["first_step"] == 0 and first[rank]["losses"] == reference[rank][:13]
        assert second[rank]["first_step"] == 8
        assert second[rank]["losses"] == reference[rank][8:], rank
    assert shas(ckpt / "step_000012.rejected") == flipped  # kept, as it was
    assert shas(ckpt / "step_000008") == good[8]
    assert verify_dcp(ckpt / "step_000016")["step"] == 16  # what the resumed job saved verifies


@pytest.mark.timeout(120)
def test_crafted_dcp_folders_run_no_code(resume_dcp_run, tmp_path):
    """A crafted `.metadata` (and a crafted bytes entry) with a manifest that matches, as whoever
    crafts a folder can write: DCP's own reader and planner run the payload (the controls); every
    reader of this chapter refuses in one line and the marker never appears."""
    cfg, rid = resume_dcp.Config(), "r-crafted"
    shapes, marker = dcp_shapes(cfg), tmp_path / "marker"
    genuine = resume_dcp_run.out_dir / "ckpt" / "rank_keyed"
    folder = tmp_path / "ck"
    for step in ("step_000004", "step_000008"):
        shutil.copytree(genuine, folder / step)
        reseal(folder / step, run_id=rid, shapes=shapes, step=int(step[-2:]))
    crafted = folder / "step_000008"
    craft_metadata(crafted, marker)
    verify_manifest(crafted)  # every hash matches: integrity, not honesty
    # Control: DCP's reader runs it, and returns metadata that works.
    import torch.distributed.checkpoint as dcp
    assert dcp.FileSystemReader(str(crafted)).read_metadata().state_dict_metadata
    assert marker.exists()
    marker.unlink()
    # The path: the script validating its arguments on a folder holding it.
    train.parse_config(resume_dcp.Config, ["--ckpt-dir", str(folder)], validate=resume_dcp.validate,
                       world_size=2)
    for read in (resume_dcp.stored_keys, lambda p, _: read_dcp_metadata(p),
                 lambda p, _: checks.dcp_payload_bytes(p)):
        with pytest.raises(CheckpointError, match="is not DCP metadata .*not allowed"):
            read(crafted, ".rng.torch")
    with course_log() as lines:
        path, _ = resume_dcp.newest_checkpoint(folder, rid, shapes)
    assert path.name == "step_000004" and len(lines) == 1 and "step_000008" in lines[0]
    shutil.rmtree(folder / "step_000004")
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints verifies .*not allowed"):
        resume_dcp.newest_checkpoint(folder, rid, shapes)
    assert not marker.exists()

    # A crafted bytes entry (the step counter) in an honest-looking folder: it verifies and is
    # this run's, so the loader takes it; the load refuses (weights_only=True), the control runs it.
    shutil.rmtree(crafted)
    shutil.copytree(genuine, crafted)
    craft_bytes_entry(crafted, "progress.step", marker)
    reseal(crafted, run_id=rid, shapes=shapes, step=8)
    assert resume_dcp.newest_checkpoint(folder, rid, shapes)[0] == crafted
    template = {"progress": {"step": 0, "epoch": 0, "index": 0}}
    with pytest.raises(CheckpointError, match="Weights only load failed|Unsupported global"):
        load_dcp(dict(template), crafted)
    assert not marker.exists()
    dcp.load({"progress": dict(template["progress"])}, checkpoint_id=str(crafted))  # the control
    assert marker.exists()


def saved_steps(cfg: resume.Config, folder: Path, rid: str, steps) -> list[Path]:
    """resume.py's job run in this process, saving at `steps` (its training state, run id and
    shapes); the caller's RNG states are left as they were."""
    rng = capture_rng_state()
    X, Y = regression_data(cfg.n_samples, 16, 1, seed=cfg.seed)
    run, paths = resume.new_run(cfg), []
    for step in steps:
        resume.train(cfg, run, X, Y, step)
        paths.append(resume.save_training_state(folder, resume.training_state(run, rid)))
    restore_rng_state(rng)
    return paths


def test_pt_loader_falls_back_refuses_and_cleans(tmp_path):
    cfg, rid = resume.Config(steps=12, stop_at=4), "r-pt"
    model, opt, _ = resume.build(cfg)
    shapes = training_shapes(model, opt)
    two, six, ten = saved_steps(cfg, tmp_path, rid, (2, 6, 10))
    (tmp_path / ".step_000012.pt.abc.tmp").write_bytes(b"half a file")
    removed = resume.remove_incomplete(tmp_path)
    assert [p.name for p in removed] == [".step_000012.pt.abc.tmp"] and not removed[0].exists()
    assert resume.newest_checkpoint(tmp_path, rid, shapes)[1]["step"] == 10
    before = shas(two) | shas(six)
    # Flipped bytes in a weight: torch.load alone takes it (the control), the loader skips it.
    flip_weight(ten)
    assert torch.load(ten, weights_only=True)["step"] == 10
    with course_log() as lines:
        path, state = resume.newest_checkpoint(tmp_path, rid, shapes)
    assert path == six and state["step"] == 6
    assert len(lines) == 1 and "step_000010.pt" in lines[0] and "CRC-32" in lines[0], lines
    # Truncated: skipped too, in one line.
    truncate(six)
    with course_log() as lines:
        assert resume.newest_checkpoint(tmp_path, rid, shapes)[0] == two
    assert "truncated" in lines[1], lines
    assert shas(two) == {two.name: before[two.name]}
    # A crafted file with good CRCs whose pickle creates a marker: weights_only refuses it.
    marker, crafted = tmp_path / "marker", tmp_path / "step_000012.pt"
    torch.save({"step": 12, "model": Payload(marker)}, crafted)
    with course_log() as lines:
        assert resume.newest_checkpoint(tmp_path, rid, shapes)[0] == two
    assert "step_000012.pt" in lines[0] and "not a readable checkpoint" in lines[0], lines
    assert not marker.exists()
    torch.load(crafted, weights_only=False)  # the control: an ordinary load runs it
    assert marker.exists()
    # Another run's, another model's: refused in one line.
    with pytest.raises(CheckpointError, match="belongs to run 'r-pt', not to this run 'r-other'"):
        resume.load_verified(two, "r-other", shapes)
    # Another run's newest checkpoint beside this run's older one: no damage to walk past but the
    # wrong folder: refused in one line, nothing skipped, nothing set aside or changed.
    mixed = tmp_path / "mixed"
    saved_steps(cfg, mixed, rid, (2,))
    saved_steps(cfg, mixed, "r-other", (6,))
    before_mixed = shas(mixed)
    with course_log() as lines, pytest.raises(
            CheckpointError, match="step_000006.pt belongs to run 'r-other', not to this run 'r-pt'") as e:
        resume.newest_checkpoint(mixed, rid, shapes)
    assert e.value.collective and lines == [] and shas(mixed) == before_mixed, lines
    other = json.loads(json.dumps(shapes))
    other["model"]["0.weight"] = [32, 16]
    with pytest.raises(CheckpointError, match="another model or optimizer: model.0.weight"):
        resume.load_verified(two, rid, other)
    # All bad: refused in one line, nothing deleted or changed.
    flip_weight(two)
    damaged = {p.name: sha256_file(p) for p in resume.step_files(tmp_path)}
    with pytest.raises(CheckpointError, match="none of the 4 checkpoints verifies") as e:
        resume.newest_checkpoint(tmp_path, rid, shapes)
    assert e.value.collective and "\n" not in str(e.value)
    assert damaged == {p.name: sha256_file(p) for p in resume.step_files(tmp_path)}
    # Set aside, not saved over: a skipped checkpoint is renamed, its bytes kept.
    resume.set_aside([ten])
    assert sha256_file(tmp_path / "step_000010.pt.rejected") == damaged[ten.name] and not ten.exists()
    assert resume.newest_checkpoint(tmp_path / "empty", rid, shapes) == (None, None)


def _stopped(pid: int) -> bool:
    """The process has stopped itself (state T in /proc/<pid>/stat)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.timeout(200)
def test_killed_save_keeps_previous_and_resume_in_new_process_is_bit_identical(tmp_path):
    atomic, naive, bad = tmp_path / "atomic", tmp_path / "naive", tmp_path / "bad"
    common_args = ["--steps", "12", "--stop-at", "4", "--save-every", "4"]
    cfg = resume.Config(steps=12, stop_at=4, save_every=4)
    # Every checkpoint bad (a run of its own, in this process: step 4 truncated, 8 flipped).
    (tmp_path / "out-bad").mkdir()
    (tmp_path / "out-bad" / "run_id").write_text("r-bad\n")
    four, eight = saved_steps(cfg, bad, "r-bad", (4, 8))
    truncate(four)
    flip_weight(eight)
    damaged = shas(bad)
    kill = {"CH12_KILL_SAVE_AT_STEP": "8"}
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_python, RESUME, args=[*common_args, "--ckpt-dir", str(d), *extra],
                            out_dir=tmp_path / f"out-{d.name}", env=kill, expect_ok=False, timeout=90)
                for d, extra in ((atomic, []), (naive, ["--naive-save"]))]
        killed = [j.result() for j in jobs]
    assert [r.returncode for r in killed] == [-signal.SIGKILL] * 2, killed[0].output[-2000:]
    # Atomic: step 4 whole and loadable, step 8 never appeared, its partial .tmp is detected.
    assert load_checkpoint(atomic / "step_000004.pt")["step"] == 4
    assert not (atomic / "step_000008.pt").exists()
    tmp_files = list(atomic.glob(".*.tmp"))
    assert len(tmp_files) == 1 and tmp_files[0].stat().st_size == checkpoint_files.KILL_AFTER_BYTES
    # Negative control: torch.save straight over the file lost the previous checkpoint too.
    with pytest.raises(CheckpointError):
        load_checkpoint(naive / "latest.pt")

    # Plant a real step 8 of this run (the run id in its --out) with 16 flipped bytes in a weight.
    rid = (tmp_path / "out-atomic" / "run_id").read_text().strip()
    good4 = shas(atomic / "step_000004.pt")
    planted = saved_steps(cfg, tmp_path / "plant", rid, (8,))[0]
    shutil.move(planted, atomic / "step_000008.pt")
    flip_weight(atomic / "step_000008.pt")
    flipped = sha256_file(atomic / "step_000008.pt")
    # A new process resumes (same --out: the same run). It stops itself once it holds the
    # folder; meanwhile a second run on the same --ckpt-dir and a third on the same --out are
    # each refused in one line naming its pid (and, beside them, a run whose every checkpoint is
    # bad). Then it goes on and completes.
    cmd = [sys.executable, str(RESUME), *common_args, "--ckpt-dir", str(atomic),
           "--out", str(tmp_path / "out-atomic")]
    with started(cmd, env={"CH12_STOP_AFTER_LOCK": "1"}) as first:
        wait_until(lambda: _stopped(first.pid), first, "the resumed run holding --ckpt-dir")
        try:
            with ThreadPoolExecutor(3) as pool:
                jobs = [pool.submit(run_python, RESUME, args=[*common_args, "--ckpt-dir", str(d)],
                                    out_dir=o, expect_ok=False, timeout=90)
                        for d, o in ((atomic, tmp_path / "out-second"),
                                     (tmp_path / "other", tmp_path / "out-atomic"),
                                     (bad, tmp_path / "out-bad"))]
                *others, refused = [j.result() for j in jobs]
        finally:
            os.kill(first.pid, signal.SIGCONT)
        output, _ = first.communicate(timeout=90)
    assert first.returncode == 0, output[-3000:]
    # All bad: one line skipping each, one refusal naming the newest, non-zero, nothing touched.
    assert refused.returncode == 1 and "Traceback" not in refused.output, refused.output[-3000:]
    errors = error_lines(refused.output)
    assert len(errors) == 1 and "none of the 2 checkpoints verifies" in errors[0], refused.output
    assert "step_000008.pt is damaged" in errors[0]
    assert sum("skipping checkpoint" in line for line in refused.output.splitlines()) == 2
    assert shas(bad) == damaged
    for other, what in zip(others, ("--ckpt-dir", "--out")):
        errors = error_lines(other.output)
        assert other.returncode == 1 and "Traceback" not in other.output, other.output[-3000:]
        assert len(errors) == 1 and f"{what} " in errors[0] and f"pid {first.pid}" in errors[0], errors
    lines = output.splitlines()
    skipped = [line for line in lines if line.startswith("skipping checkpoint")]
    assert len(skipped) == 1 and "step_000008.pt is damaged" in skipped[0], output
    summary = json.loads((tmp_path / "out-atomic" / "summary.json").read_text())
    assert summary["figures"]["resumed from step"]["measured"] == 4
    assert summary["figures"]["incomplete saves found and removed"]["measured"] == 1
    assert not list(atomic.glob(".*.tmp"))
    out = load_checkpoint(tmp_path / "out-atomic" / "losses.pt")
    reference = uninterrupted_losses(cfg)
    assert out["first_step"] == 4
    assert out["losses"].tolist() == reference[4:]
    # The first run's metrics: valid JSON lines, steps 4..11 in order, not interleaved.
    metrics = [json.loads(line) for line in (tmp_path / "out-atomic" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == list(range(4, 12))
    # The damaged step 8 kept aside as it was, step 4 unchanged, the new saves verify.
    assert sha256_file(atomic / "step_000008.pt.rejected") == flipped
    assert shas(atomic / "step_000004.pt") == good4
    assert [load_checkpoint(atomic / f"step_0000{s:02d}.pt")["step"] for s in (8, 12)] == [8, 12]


@pytest.mark.timeout(120)
def test_full_disk_ends_in_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    """A save that meets a full disk (a 160 KiB tmpfs: room for one 86 KB checkpoint, not two)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (the full disk)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        res = run_python(RESUME, args=["--steps", "12", "--stop-at", "4", "--save-every", "4",
                                       "--ckpt-dir", str(disk)], out_dir=tmp_path / "out",
                         expect_ok=False, timeout=90)
        assert res.returncode == 1 and "Traceback" not in res.output, res.output[-3000:]
        errors = error_lines(res.output)  # (torch's process group prefixes "[rank0]: ")
        assert len(errors) == 1 and errors[0].endswith(
            f"resume.py: error: cannot write {disk / 'step_000008.pt'}: No space left on device"), errors
        assert sorted(p.name for p in disk.iterdir()) == [".lock", "step_000004.pt"]  # no .tmp
        # The previous checkpoint is whole, this run's, and resumes to the uninterrupted losses.
        cfg = resume.Config(steps=12, stop_at=4)
        rng = capture_rng_state()
        run = resume.new_run(cfg)
        rid = (tmp_path / "out" / "run_id").read_text().strip()
        state = resume.load_verified(disk / "step_000004.pt", rid,
                                     training_shapes(run["model"], run["opt"]))
        resume.restore(run, state)
        X, Y = regression_data(cfg.n_samples, 16, 1, seed=cfg.seed)
        tail = resume.train(cfg, run, X, Y, cfg.steps)
        restore_rng_state(rng)
        assert tail == uninterrupted_losses(cfg)[4:]
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_resume_needs_rng_and_data_position(tmp_path):
    cfg = resume.Config()
    reference = uninterrupted_losses(cfg)
    X, Y = regression_data(cfg.n_samples, 16, 1, seed=cfg.seed)
    run = resume.new_run(cfg)
    head = resume.train(cfg, run, X, Y, cfg.stop_at)
    assert head == reference[:cfg.stop_at]
    path = resume.save_training_state(tmp_path, resume.training_state(run, "r"))
    shapes = training_shapes(run["model"], run["opt"])
    tails = {}
    for name, rng, data in (("full", True, True), ("rng", False, True), ("data", True, False)):
        torch.manual_seed(12345)  # what a new process's generator holds: anything
        fresh = resume.new_run(cfg)
        resume.restore(fresh, resume.load_verified(path, "r", shapes), rng=rng, data=data)
        tails[name] = resume.train(cfg, fresh, X, Y, cfg.steps)
    assert head + tails["full"] == reference
    assert head + tails["rng"] != reference, "dropout masks did not depend on the RNG state"
    assert head + tails["data"] != reference, "the data order did not depend on the position"
    assert resume.Config().steps > cfg.n_samples // cfg.batch_size  # crosses an epoch boundary


def test_delta_is_small_and_exact():
    cfg = train.Config()
    base, new, n_expected = deltas.sparse_finetune(cfg)
    rows_changed = (new["embedding"] != base["embedding"]).any(dim=1).sum().item()
    assert rows_changed == cfg.touched_tokens
    delta = deltas.make_delta(base, new)
    assert sum(d["index"].numel() for d in delta.values()) == rows_changed * 32 == n_expected
    assert deltas.delta_bytes(delta) * 50 < deltas.state_bytes(new)  # 16 KiB vs 1 MiB
    assert torch.equal(deltas.apply_delta(base, delta)["embedding"], new["embedding"])
    # Negative controls: a lossy bf16 difference, and the right delta on the wrong base.
    lossy = deltas.apply_difference_delta(base, deltas.make_difference_delta(base, new))
    assert not torch.equal(lossy["embedding"], new["embedding"])
    other = {"embedding": base["embedding"] + 1}
    assert not torch.equal(deltas.apply_delta(other, delta)["embedding"], new["embedding"])
    # Differences in the same dtype: exact where the subtraction is. Sterbenz's range, checked
    # here in float64 (where every fp32 difference is exact): no inexact difference inside it.
    redrawn = deltas.reinitialised_rows(cfg, base)["embedding"]
    for b32, n32 in ((base["embedding"], new["embedding"]), (base["embedding"], redrawn)):
        inexact = (n32 - b32).double() != n32.double() - b32.double()
        assert not (inexact & deltas.sterbenz(b32, n32)).any()
    assert (inexact & ~deltas.sterbenz(b32, n32)).any()  # the re-drawn rows: some are inexact
    rt = deltas.difference_roundtrip(base["embedding"], redrawn)
    assert rt["wrong_inside"] == 0 and rt["wrong_outside"] > 0
    one, small = torch.tensor(1.0), torch.tensor(0.001)
    assert (small - one) + one != small and (torch.tensor(0.75) - one) + one == 0.75


def test_impossible_settings_are_refused():
    for cls, argv in ((resume.Config, ["--stop-at", "30"]), (resume.Config, ["--batch-size", "7"]),
                      (train.Config, ["--touched-tokens", "9000"]),
                      (resume_dcp.Config, ["--stop-at", "16"]), (resume_dcp.Config, ["--kill-at", "-1"])):
        with pytest.raises(SystemExit) as e:
            train.parse_config(cls, argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:  # one process by design
        train.parse_config(resume.Config, [], validate=resume.validate, world_size=2)
    assert e.value.code == 2


def test_failed_dcp_save_is_one_line_naming_the_folder(tmp_path):
    """train.py's timed DCP saves fail as save_dcp's do: one collective CheckpointError naming the
    folder (here a folder under a file, in one process)."""
    import torch.distributed.checkpoint as dcp
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    target = blocker / "dcp"
    with pytest.raises(CheckpointError, match=f"saving {target} ") as e, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: one process
        with train.saving(target):
            dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(target))
    assert e.value.collective and "\n" not in str(e.value), str(e.value)


@pytest.mark.timeout(600)
def test_deepspeed_zero_checkpoint_layout_and_zero_to_fp32(tmp_path):
    pytest.importorskip("deepspeed", reason="pip install deepspeed==0.19.8 (requirements.txt)")
    # A reused --out: a file of an earlier 4-rank save (a pickle that creates a marker) is there
    # BEFORE this save. The save empties the folder first: it never enters the manifest and is
    # never un-pickled (DeepSpeed's glob would load it, see the dropped file below).
    marker = tmp_path / "marker"
    for stage in (2, 3):
        stale = tmp_path / f"zero{stage}" / "step3" / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
        stale.parent.mkdir(parents=True)
        torch.save({"optimizer_state_dict": Payload(marker)}, stale)
    # the first run on a machine compiles DeepSpeed's communication op (~60 s, then cached)
    res = run_torchrun(Path(deepspeed_ckpt.__file__), nproc=2, out_dir=tmp_path, timeout=540)
    failed = [c["name"] for c in res.summary["checks"] if not c["ok"]]
    assert not failed, res.output[-3000:]
    assert not marker.exists()
    scripts = ["latest", "zero_to_fp32.py", "zero_to_torch.py"]
    optim = [f"step3/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    assert res.summary["figures"]["ZeRO-2 files"]["measured"] == sorted(
        scripts + optim + ["step3/mp_rank_00_model_states.pt"])
    assert res.summary["figures"]["ZeRO-3 files"]["measured"] == sorted(
        scripts + optim + [f"step3/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)])
    assert (tmp_path / "zero2" / "latest").read_text().strip() == "step3"
    rid = (tmp_path / "run_id").read_text().strip()
    seed_everything(0)
    initial = MLP(16, 33, 1)
    shapes = training_shapes(initial, torch.optim.Adam(initial.parameters()))
    for stage in (2, 3):
        assert res.check(f"ZeRO-{stage}: zero_to_fp32 state dict == engine parameters at save")["measured"] == 0
        # Recomputed here: convert with DeepSpeed's function in this process (after verifying the
        # folder against its manifest), compare with the parameters the engine held at save;
        # negative control: the untrained initial parameters.
        save_dir = tmp_path / f"zero{stage}"
        assert set(read_manifest(save_dir)["files"]) == set(deepspeed_ckpt.list_checkpoint(save_dir))
        plain = deepspeed_ckpt.convert(save_dir, "step3", rid, shapes)
        saved = load_checkpoint(tmp_path / f"zero{stage}_params.pt")
        assert deepspeed_ckpt.max_diff(plain, saved) == 0
        params = {n: p.detach() for n, p in initial.named_parameters()}
        assert deepspeed_ckpt.max_diff(plain, params) > 1e-3
    # DeepSpeed un-pickles (weights_only=False): only a folder this run wrote and that verifies.
    # Why it must: its optimizer partitions hold DeepSpeed objects that weights_only refuses.
    save_dir = tmp_path / "zero2"
    for stage in (2, 3):
        with pytest.raises(CheckpointError, match="not a readable checkpoint .*Weights only load"):
            load_checkpoint(tmp_path / f"zero{stage}/step3/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="belongs to run"):
        deepspeed_ckpt.convert(save_dir, "step3", "another", shapes)
    optim = save_dir / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    original = optim.read_bytes()
    flip(optim, len(original) // 2)
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt does not match"):
        deepspeed_ckpt.convert(save_dir, "step3", rid, shapes)
    optim.write_bytes(original)
    # A file dropped in beside them, which DeepSpeed's glob would load: refused, never un-pickled;
    # the control: DeepSpeed's own conversion runs it.
    dropped = save_dir / "step3" / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Payload(marker)}, dropped)
    with pytest.raises(CheckpointError, match="zero_pp_rank_2_mp_rank_00_optim_states.pt is not in"):
        deepspeed_ckpt.convert(save_dir, "step3", rid, shapes)
    assert not marker.exists()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    with suppress(Exception):  # whatever it says after un-pickling the dropped file
        get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag="step3")
    assert marker.exists()
    with pytest.raises(SystemExit) as e:
        train.parse_config(deepspeed_ckpt.Config, ["--stages", "0"])
    assert e.value.code == 2
