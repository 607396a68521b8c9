"""Survive a spot preemption: SIGTERM, every rank agrees to stop, one checkpoint to object storage
within the grace period, a clean exit, and a restarted job that resumes bit-identically.

A cloud that reclaims a spot/preemptible machine first sends SIGTERM, then SIGKILL once its grace
period is over (GCP spot/preemptible: 30 s; Kubernetes: terminationGracePeriodSeconds, 30 s by
default; SageMaker's StopTrainingJob: 120 s). Behind torchrun the ranks have at most its
--shutdown-timeout (30 s by default): it SIGKILLs them that long after it forwarded the SIGTERM,
so --grace-s is the smaller of the two (SageMaker's template: 110 s of its 120). AWS spot gives
its two minutes' notice in the instance metadata instead, and SIGTERM only at the shutdown that
ends them: with `--spot-notice`, a thread on each node's local rank 0 polls it
(IMDSv2: a token by PUT, then GET spot/instance-action). The signal handler and the poller only
set a flag; at every step boundary the ranks all-reduce that flag (MAX), so every rank stops at
the same step even if only one node was told, and they write one checkpoint together, timed
against the deadline (`--grace-s` after the notice). Checkpoints go through fsspec to a URL
(a local path, `file://`, `s3://`, `gs://`, `oss://` where its fsspec package is installed): every
object is written whole, and a step counts only once its `manifest.json`, written last, exists.
Each rank then exits with code 143 (128 + SIGTERM), never 0, so that the launcher restarts it
(torchrun, if it started the ranks, exits 1 itself); the restarted run (the same command, the same
--out, which holds the run id) takes the newest step that verifies: every object read once and
checked against the manifest's size and SHA-256 and its own zip CRC-32s, loaded with
`weights_only=True`, the run id and shapes this run's. A step that fails is skipped in one line
for the one before; none left is refused in one line, as is another run's checkpoint. One run per
folder: global rank 0 locks --out and a local --ckpt-url. The training loop, data position and
per-rank noise are chapter 13's.

Run:
    python chapters/ch24_cloud/train.py                                       # one process
    torchrun --standalone --nproc_per_node=2 chapters/ch24_cloud/train.py     # no preemption
    torchrun --standalone --nproc_per_node=2 chapters/ch24_cloud/train.py --steps 200 \\
        --step-seconds 0.1 --ckpt-url /tmp/ch24-bucket --out runs/ch24a   # then: kill -TERM <pid>
    torchrun --standalone --nproc_per_node=2 chapters/ch24_cloud/train.py --steps 200 \\
        --ckpt-url /tmp/ch24-bucket --out runs/ch24a                       # resumes where it stopped
    torchrun --nnodes=2 --nproc_per_node=8 --shutdown-timeout 110 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=job24 chapters/ch24_cloud/train.py \\
        --ckpt-url s3://BUCKET/ckpt --grace-s 110 --spot-notice aws        # AWS spot, 2 nodes
"""

import contextlib
import hashlib
import io
import json
import logging
import signal
import sys
import threading
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from datetime import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F

from chapters.ch13_fault_tolerance.train import (
    all_reduce_mean_,
    batch_at,
    noise_seed,
    replica_spread,
    restart_count,
    sgd_momentum_step,
)
from common.checkpoint import (
    CheckpointError,
    atomic_write,
    check_identity,
    lock_folder,
    newest_verified,
    run_id,
    save_checkpoint,
    training_shapes,
    unlock_folder,
)
from common.config import RunConfig, parse_config
from common.data import regression_data
from common.distributed import (
    gather_numbers,
    reduce_number,
    setup_distributed,
    teardown_distributed,
)
from common.log import log, setup_logging
from common.models import MLP
from common.results import RunRecorder
from common.seed import capture_rng_state, restore_rng_state, seed_everything

STATE_PARTS = ("model", "optimizer", "rng", "data")
PREEMPTED_EXIT = 143  # 128 + SIGTERM: "stopped by a signal", never 0 ("done, do not restart")
MANIFEST = "manifest.json"


@dataclass
class Config(RunConfig):
    ckpt_url: str = ""
    """Checkpoint location, an fsspec URL or a path (default: <out>/ckpt). A run resumes from its newest checkpoint that verifies and is this run's (the run id in --out); a local one is locked for the run."""
    ckpt_every: int = 5
    """Also checkpoint after every this many steps (a preemption can come without notice)."""
    grace_s: float = 30.0
    """Seconds from the notice until the job is killed (30 s: GCP spot, Kubernetes' default; 120 s: SageMaker's StopTrainingJob, AWS's spot notice before the time it names), and no more than torchrun's --shutdown-timeout, after which torchrun SIGKILLs the ranks. The save on notice is timed against it (a warning and a failed timing check when late), and a periodic save slower than it is reported at once."""
    spot_notice: str = ""
    """Poll AWS's spot interruption notice (IMDSv2) from each node's local rank 0: 'aws' (the real endpoint, http://169.254.169.254), 'auto' (the real one if this machine says it is EC2, else off), a URL (another endpoint, such as a test's), or '' (off)."""
    spot_poll_s: float = 5.0
    """Seconds between two polls of the spot notice (AWS recommends every 5 s)."""
    restore: tuple[str, ...] = STATE_PARTS
    """What a resume restores; leave parts out to see the run diverge (negative control)."""
    batch_size: int = 8
    """Samples per rank per step."""
    n_samples: int = 96
    """Size of the dataset (epochs are reshuffled, so the data position matters)."""
    lr: float = 0.05
    """Learning rate of SGD with momentum."""
    momentum: float = 0.9
    """Momentum of SGD (its buffers are the optimizer state a resume must restore)."""
    noise: float = 0.1
    """Std of Gaussian input noise drawn from each rank's RNG (the RNG state a resume must restore)."""
    step_seconds: float = 0.0
    """Sleep this long every step: time to send the signal by hand."""
    pause_save_at: int = -1
    """Test hook: in the save of this step, after the data objects and before the manifest, write <out>/paused and wait until killed (-1: off)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ckpt_every < 1:
            raise ValueError(f"--ckpt-every must be at least 1, got {self.ckpt_every}")
        if self.grace_s <= 0:
            raise ValueError(f"--grace-s must be positive, got {self.grace_s}")
        if self.spot_poll_s <= 0:
            raise ValueError(f"--spot-poll-s must be positive, got {self.spot_poll_s}")
        if self.spot_notice not in ("", "aws", "auto") and not self.spot_notice.startswith(
                ("http://", "https://")):
            raise ValueError(f"--spot-notice takes '', 'aws', 'auto' or an http:// URL, "
                             f"not {self.spot_notice!r}")
        unknown = set(self.restore) - set(STATE_PARTS)
        if unknown or "model" not in self.restore:
            raise ValueError(f"--restore takes 'model' and any of {STATE_PARTS[1:]}, not {self.restore}")
        if self.pause_save_at >= 0 and (self.pause_save_at == 0 or self.pause_save_at % self.ckpt_every):
            raise ValueError(f"--pause-save-at needs a step that is saved: a multiple of "
                             f"--ckpt-every {self.ckpt_every}")


def validate(cfg: Config, world_size: int) -> None:
    """Any world size works: the batch is per rank and the data position is global."""


# --- the grace budget (formulas) ---------------------------------------------------------------

def seconds_to_commit(step_s: float, save_s: float, agree_s: float = 0.0) -> float:
    """Worst case from the notice to a committed checkpoint: the notice lands just after a step
    began, so that step finishes, then one agreement all-reduce, then the save."""
    return step_s + agree_s + save_s


def largest_checkpoint_bytes(grace_s: float, step_s: float, bytes_per_s: float,
                             margin_s: float = 0.0) -> float:
    """Bytes one node can write after the notice: (grace - step - margin) x its upload rate."""
    return max(0.0, grace_s - step_s - margin_s) * bytes_per_s


# --- the preemption notice --------------------------------------------------------------------

class Preemption:
    """The notice that the machine is going away: SIGTERM, or AWS's spot notice (`SpotNoticePoller`,
    from a thread). Either only sets a flag and notes the time; the loop looks at it between steps
    (a handler that saved by itself could run in the middle of an all-reduce and deadlock the job).
    `deadline` is when the platform stops waiting: `grace_s` after the notice, or the time the
    spot notice names, whichever comes first."""

    def __init__(self, grace_s: float = 30.0) -> None:
        self.grace_s = grace_s
        self.signal_time: float | None = None  # wall clock of the first notice (any source)
        self.source: str | None = None
        self.action_time: float | None = None  # wall clock the spot notice names, if any
        # Re-entrant: the SIGTERM handler runs in the main thread between two bytecodes, possibly
        # while the main thread is itself inside `notify` holding this lock (StopAtStep calls it
        # there); a plain Lock would then wait for itself forever. The poller's thread still
        # waits its turn (an RLock excludes other threads), and a nested call finds the notice
        # being recorded and may only overwrite it with a time a few bytecodes apart.
        self._lock = threading.RLock()

    def install(self) -> "Preemption":
        signal.signal(signal.SIGTERM, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        self.notify("SIGTERM")

    def notify(self, source: str, action_time: float | None = None) -> None:
        """Record the first notice (later ones change nothing): its time, where it came from."""
        with self._lock:
            if self.signal_time is None:
                self.signal_time = time.time()  # wall clock: comparable with the sender's
                self.source, self.action_time = source, action_time

    def allowed_s(self) -> float | None:
        """Seconds from the notice to the deadline (None before a notice)."""
        if self.signal_time is None:
            return None
        if self.action_time is None:
            return self.grace_s
        return min(self.grace_s, self.action_time - self.signal_time)

    def deadline(self) -> float | None:
        return None if self.signal_time is None else self.signal_time + self.allowed_s()

    def requested(self, step: int) -> bool:
        return self.signal_time is not None


class StopAtStep(Preemption):
    """A notice that arrives before step `step` (in-process experiments and tests)."""

    def __init__(self, step: int, grace_s: float = 30.0) -> None:
        super().__init__(grace_s)
        self.step = step

    def requested(self, step: int) -> bool:
        if step >= self.step:
            self.notify(f"StopAtStep({self.step})")
        return self.signal_time is not None


IMDS_URL = "http://169.254.169.254"
TOKEN_TTL_S = 21600  # the longest session token IMDSv2 issues (6 h)


class SpotNoticePoller:
    """AWS's spot interruption notice, read from the instance metadata service the way AWS
    documents it (IMDSv2): `PUT {url}/latest/api/token` with the header
    `X-aws-ec2-metadata-token-ttl-seconds` gives a session token; `GET
    {url}/latest/meta-data/spot/instance-action` with the header `X-aws-ec2-metadata-token`
    answers 404 while no interruption is scheduled and `{"action": "terminate" | "stop" |
    "hibernate", "time": "<UTC>"}` about two minutes before it (hibernation: no two minutes).
    A thread polls every `interval_s` (AWS recommends 5 s) and, on a notice, calls the same
    `Preemption.notify` as the SIGTERM handler. A 401 (token expired) gets a new token.

    `imdsv2=False` polls IMDSv1-style, a plain GET without a token: what many scripts do, and
    what an instance that requires IMDSv2 answers with 401 every time (the negative control)."""

    def __init__(self, url: str, notice: Preemption, interval_s: float = 5.0,
                 timeout_s: float = 2.0, imdsv2: bool = True) -> None:
        self.url = url.rstrip("/")
        self.notice, self.interval_s, self.timeout_s, self.imdsv2 = notice, interval_s, timeout_s, imdsv2
        self.token: str | None = None
        self.token_expires = 0.0
        self.polls = 0  # GETs of instance-action answered (any status)
        self.seen: dict | None = None  # the notice's JSON, once seen
        self.errors: list[str] = []
        # never through HTTP(S)_PROXY: IMDS is link-local, a proxy cannot reach it (urlopen's
        # default opener sends every request to the proxy the environment names)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spot-notice", daemon=True)

    def _request(self, method: str, path: str, headers: dict) -> tuple[int, bytes]:
        import urllib.error
        req = urllib.request.Request(self.url + path, method=method, headers=headers,
                                     data=b"" if method == "PUT" else None)
        try:
            with self._opener.open(req, timeout=self.timeout_s) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, b""

    def _new_token(self) -> None:
        status, body = self._request("PUT", "/latest/api/token",
                                     {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
        if status != 200:
            raise OSError(f"token PUT answered {status}")
        self.token = body.decode()
        self.token_expires = time.monotonic() + TOKEN_TTL_S / 2  # renew well before it expires

    def poll_once(self) -> dict | None:
        """One look: the notice's JSON, or None (404: nothing scheduled)."""
        for attempt in (0, 1):
            headers = {}
            if self.imdsv2:
                if self.token is None or time.monotonic() > self.token_expires:
                    self._new_token()
                headers["X-aws-ec2-metadata-token"] = self.token
            status, body = self._request("GET", "/latest/meta-data/spot/instance-action", headers)
            self.polls += 1
            if status == 404:
                return None
            if status == 200:
                found = json.loads(body)
                if not isinstance(found, dict):
                    raise ValueError(f"instance-action answered {body[:60]!r}, not an object")
                return found
            if status == 401 and self.imdsv2 and attempt == 0:
                self.token = None  # expired or revoked: one new token, then try again
                continue
            raise OSError(f"instance-action GET answered {status}")
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:  # any error, not only the expected ones: a dead thread would hear nothing
                found = self.poll_once()
                if found is not None:
                    self._notify(found)
                    return
            except Exception as e:  # unreachable, refused, 401, a malformed answer ...
                self._failed(e)
            self._stop.wait(self.interval_s)

    def _notify(self, found: dict) -> None:
        self.seen = found
        when = found.get("time")
        try:
            stamp = datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
        except (AttributeError, ValueError):
            stamp = None  # no usable time: the deadline is --grace-s after the notice
        self.notice.notify(f"spot notice: {found.get('action')} at {when}", stamp)

    def _failed(self, e: Exception) -> None:
        """Log a failed poll (each new kind of failure once, then a count) and keep polling."""
        what = f"{type(e).__name__}: {e}"
        if what not in self.errors:
            log.warning("spot notice: %s: %s", self.url, what[:120])
            log.warning("  (poll %d failed; still polling every %g s)", len(self.errors) + 1,
                        self.interval_s)
        self.errors.append(what)

    def start(self) -> "SpotNoticePoller":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1)


def looks_like_ec2(dmi: str = "/sys/devices/virtual/dmi/id") -> bool:
    """Does this machine say it is an EC2 instance? Nitro instances report "Amazon EC2" as
    the DMI system vendor; older Xen ones, "Xen" with a BIOS version ending in "amazon"."""
    from pathlib import Path
    read = lambda name: (Path(dmi, name).read_text().strip() if Path(dmi, name).is_file()  # noqa: E731
                         else "")
    return (read("sys_vendor") == "Amazon EC2" or read("board_vendor") == "Amazon EC2"
            or read("bios_version").lower().endswith("amazon"))


def spot_notice_url(option: str, dmi: str = "/sys/devices/virtual/dmi/id") -> str | None:
    """--spot-notice: '' off; 'aws' the real endpoint; 'auto' the real one on an EC2-looking
    machine, else off; anything else a URL (a test's fake endpoint)."""
    if option == "":
        return None
    if option == "aws":
        return IMDS_URL
    if option == "auto":
        return IMDS_URL if looks_like_ec2(dmi) else None
    return option


def stop_agreed(notice: Preemption, step: int, device: torch.device) -> bool:
    """Does any rank want to stop? One MAX all-reduce of a flag on `device`, so every rank
    stops at the same step even when only one node received the signal."""
    flag = torch.tensor([1.0 if notice.requested(step) else 0.0], device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


# --- checkpoints on object storage --------------------------------------------------------------

def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def step_folder(step: int) -> str:
    return f"step{step:06d}"


def run_identity(out, model, buffers) -> dict:
    """Whose checkpoint this run may resume: the run id kept in `out` (created there on the first
    start, `common.checkpoint.run_id`; collective when a process group exists) and the global
    shapes of the model and of the momentum buffers (the world size is not part of it: a
    checkpoint resumes at any world size)."""
    shapes = training_shapes(model)
    shapes["optimizer"] = {"kind": "sgd_momentum", "buffers": [list(b.shape) for b in buffers]}
    return {"run_id": run_id(out), "shapes": shapes}


def names_to_check(names, rank: int, world_size: int, own: set[str]) -> list[str]:
    """The objects of a checkpoint this rank verifies: the ones it loads (`own`) and every
    world_size-th of all of them from `rank` (the ranks share the rest; at any world size their
    union is every object, and a rank whose share is empty still checks what it loads)."""
    return sorted(set(own) | set(sorted(names)[rank::world_size]))


def check_zip_bytes(where: str, data: bytes) -> None:
    """Every member of a `torch.save` archive against its CRC-32 (as `common.checkpoint.verify_zip`
    does for a file; `torch.load` checks none). The CRCs are written by `torch.save` itself: they
    catch an archive damaged before its manifest entry was computed, which the SHA-256 cannot."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            bad = z.testzip()
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{where} is truncated or not a checkpoint ({e})") from None
    except Exception as e:  # a damaged local header
        raise CheckpointError(f"{where} is damaged ({type(e).__name__}: {e})") from None
    if bad is not None:
        raise CheckpointError(f"{where} is damaged: member {bad} fails its CRC-32 check")


def load_blob(where: str, data: bytes):
    """`torch.load` of verified bytes with `weights_only=True`: tensors, numbers, strings, lists,
    dicts, nothing that runs code; anything else is refused in one line naming the object."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError (a forbidden global), RuntimeError, EOFError ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{where} is not a safe checkpoint ({type(e).__name__}: "
                              f"{first[:160]})") from None


@contextlib.contextmanager
def said_by_rank0(rank: int):
    """The verdicts of a collective load are the same on every rank (`ObjectStoreCheckpoints.load`):
    rank 0 says which steps were skipped, the others keep quiet while they walk."""
    level = log.level
    if rank != 0:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class ObjectStoreCheckpoints:
    """Checkpoints under an fsspec URL: `stepNNNNNN/state.pt` (what the replicas share, written by
    rank 0), `stepNNNNNN/rng<r>.pt` (each rank's RNG) and, written last by rank 0 once every rank
    has finished, `stepNNNNNN/manifest.json` with each object's size and SHA-256 and whose run it
    is (run id, shapes). An object store has no rename: an object appears whole or not at all, so
    the manifest is the commit. On a local file system each object is still written to a
    temporary name and renamed (`common.checkpoint.atomic_write`, chapter 12).

    A load trusts nothing it has not checked: the newest manifest whose objects are all there,
    of the listed size and SHA-256, whose archives pass their CRC-32s and unpickle with
    `weights_only=True`; a step that fails is skipped with one line saying why, for the one
    before it (`common.checkpoint.newest_verified`), and a manifest of another run is refused."""

    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs
        from fsspec.implementations.local import LocalFileSystem
        self.url = url
        self.fs, self.root = url_to_fs(url)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.puts = 0  # objects written (a count the tests read)

    def _path(self, key: str) -> str:
        return f"{self.root.rstrip('/')}/{key}"

    def put(self, key: str, data: bytes) -> dict:
        """Write one object whole; return its manifest entry (size and SHA-256 of these bytes)."""
        if self.local:
            atomic_write(self._path(key), lambda f: f.write(data))
        else:
            self.fs.pipe_file(self._path(key), data)  # one PUT: whole or nothing
        self.puts += 1
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def get(self, key: str) -> bytes:
        return self.fs.cat_file(self._path(key))

    def committed_steps(self) -> list[int]:
        """Steps whose manifest exists, oldest first (a listing, no `latest` pointer to update).
        Global rank 0 lists and tells the others: every rank must walk the same steps."""
        steps = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            found = self.fs.glob(self._path(f"step*/{MANIFEST}"))
            steps = sorted(int(p.rstrip("/").split("/")[-2][4:]) for p in found)
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [steps]
            dist.broadcast_object_list(box, src=0)
            steps = box[0]
        return steps

    def save(self, step: int, shared: dict, rng: dict, rank: int, meta: dict, pause=None) -> dict:
        """Every rank writes its objects; their entries are gathered; rank 0 writes the manifest
        (with `meta`: run id and shapes) last; a barrier keeps every rank until the step is
        committed. Only this step's objects are written: older steps are never touched. `pause`
        (a test hook) runs on rank 0 between the data objects and the manifest."""
        folder = step_folder(step)
        mine = {"state.pt": self.put(f"{folder}/state.pt", _bytes(shared))} if rank == 0 else {}
        mine[f"rng{rank}.pt"] = self.put(f"{folder}/rng{rank}.pt", _bytes(rng))
        world = dist.get_world_size() if dist.is_initialized() else 1
        everyone: list = [mine]
        if dist.is_initialized():
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)  # also: every rank's objects are written
        files = {name: entry for part in everyone for name, entry in part.items()}
        manifest = {"format": 1, "step": step, "world_size": world, **meta,
                    "files": dict(sorted(files.items()))}
        if rank == 0:
            if pause is not None:
                pause()
            self.put(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        if dist.is_initialized():
            dist.barrier()
        return manifest

    def read_manifest(self, step: int) -> dict:
        """The manifest of `step`; `CheckpointError` in one line if it is gone or torn."""
        where = self._path(f"{step_folder(step)}/{MANIFEST}")
        try:
            manifest = json.loads(self.get(f"{step_folder(step)}/{MANIFEST}"))
        except FileNotFoundError:
            raise CheckpointError(f"{where} is missing (listed, then gone)") from None
        except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
            raise CheckpointError(f"{where} is torn or not a manifest ({e})") from None
        if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)
                and isinstance(manifest.get("world_size"), int)):
            raise CheckpointError(f"{where} is not a manifest of this chapter (no 'files' table)")
        return manifest

    def verified_bytes(self, step: int, name: str, entry: dict) -> bytes:
        """The object `name` of `step`, read once and checked, as read, against its manifest entry
        (size, SHA-256) and its own CRC-32s: the bytes that are checked are the bytes loaded."""
        key = f"{step_folder(step)}/{name}"
        where = self._path(key)
        if "/" in name or name.startswith("."):
            raise CheckpointError(f"the manifest of {self._path(step_folder(step))} names an "
                                  f"object outside its step: {name}")
        try:
            data = self.get(key)
        except FileNotFoundError:
            raise CheckpointError(f"{where} is in the manifest but missing") from None
        if len(data) != entry.get("bytes"):
            raise CheckpointError(f"{where} has {len(data)} bytes, its manifest says "
                                  f"{entry.get('bytes')} (truncated or changed)")
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise CheckpointError(f"{where} does not match its manifest (SHA-256 differs: "
                                  f"damaged or changed)")
        check_zip_bytes(where, data)
        return data

    def read_step(self, step: int, rank: int, world_size: int) -> dict:
        """This rank's part of verifying `step` (see `names_to_check`), and its state loaded
        from the verified bytes. `state["rng"]` is this rank's stream when the world size is the
        one that saved it, else None; `state["manifest"]` is the manifest."""
        manifest = self.read_manifest(step)
        files, folder = manifest["files"], self._path(step_folder(step))
        same_world = manifest["world_size"] == world_size
        own = {"state.pt"} | ({f"rng{rank}.pt"} if same_world else set())
        blobs = {}
        for name in names_to_check(files, rank, world_size, own):
            if name not in files:
                raise CheckpointError(f"the manifest of {folder} lists no {name}")
            blobs[name] = self.verified_bytes(step, name, files[name])
        state = load_blob(f"{folder}/state.pt", blobs["state.pt"])
        if not (isinstance(state, dict) and {"step", "cursor", "model", "optimizer"} <= set(state)):
            raise CheckpointError(f"{folder}/state.pt holds no training state")
        state["rng"] = (load_blob(f"{folder}/rng{rank}.pt", blobs[f"rng{rank}.pt"])
                        if same_world else None)
        state["manifest"] = manifest
        return state

    def load(self, step: int, rank: int, world_size: int) -> dict:
        """`read_step` on every rank, and one verdict for all of them (collective): a rank that
        found a problem (the RNG object only it reads, its share of the others) makes every rank
        skip the step, so that no two ranks resume from different steps."""
        try:
            state, problem = self.read_step(step, rank, world_size), None
        except CheckpointError as e:
            state, problem = None, str(e)
        problems = [problem]
        if dist.is_initialized() and dist.get_world_size() > 1:
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
        problems = [p for p in problems if p]
        if problems:
            raise CheckpointError(problems[0], collective=True)
        return state

    def keep_aside(self, step: int) -> str:
        """Move a committed step that failed verification to `skipped-stepNNNNNN` (numbered if
        that is taken): kept whole for a post-mortem, no longer listed, and its name free for the
        resumed run to save that step anew. On an object store a move is a copy and a delete."""
        src = self._path(step_folder(step))
        dst, n = self._path(f"skipped-{step_folder(step)}"), 0
        while self.fs.exists(dst):
            n += 1
            dst = self._path(f"skipped-{step_folder(step)}-{n}")
        self.fs.mv(src, dst, recursive=True)
        return dst

    def load_latest(self, rank: int, world_size: int, identity: dict) -> dict | None:
        """The newest step that verifies on every rank (each one skipped is logged in one line,
        `newest_verified`), if it is this run's (`identity`: `run_identity`, else refused in
        one line); None when nothing is committed; `CheckpointError` when none verifies (then
        nothing is moved). The newer steps that failed are kept aside by rank 0 (`keep_aside`)."""
        steps = self.committed_steps()
        with said_by_rank0(rank):
            step, state = newest_verified(steps, lambda s: self.load(s, rank, world_size),
                                          describe=step_folder)  # each reason names the file
        if step is None:
            return None
        check_identity(state["manifest"], identity["run_id"], identity["shapes"],
                       self._path(step_folder(step)))
        if rank == 0:
            for bad in (s for s in steps if s > step):
                log.info("kept %s aside as %s", step_folder(bad), self.keep_aside(bad))
        if dist.is_initialized():
            dist.barrier()  # nobody saves into a step folder before it is moved aside
        return state


def pause_until_killed(out, timeout_s: float):
    """The test hook: announce the pause in <out>/paused, then wait (a save slower than the grace)."""
    def pause() -> None:
        from pathlib import Path
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "paused").write_text(str(time.time()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise TimeoutError(f"--pause-save-at: nobody killed this run within {timeout_s:.0f} s")
    return pause


# --- the training loop ------------------------------------------------------------------------

def new_model(cfg: Config, device) -> MLP:
    seed_everything(cfg.seed)  # same initial model on every rank
    return MLP(8, 32, 1).to(device, torch.float64)


def resume(cfg: Config, state: dict, model, buffers, rank: int) -> int:
    """Put a loaded checkpoint back; return the data cursor. Parts left out of --restore stay as
    a fresh run would have them (the negative controls)."""
    model.load_state_dict(state["model"])
    if "optimizer" in cfg.restore:
        for b, s in zip(buffers, state["optimizer"]):
            b.copy_(s)
    if "rng" in cfg.restore and state["rng"] is not None:
        restore_rng_state(state["rng"])
    elif "rng" in cfg.restore:  # another world size: streams re-derived as chapter 13 does
        seed_everything(noise_seed(cfg, rank, state["step"]))
    return state["cursor"] if "data" in cfg.restore else 0


def train(cfg: Config, info, store: ObjectStoreCheckpoints, notice: Preemption, out,
          rec=None) -> dict:
    """Chapter 13's data-parallel SGD, checking for a preemption notice before every step. `out`
    is the run's folder: its run id (`run_identity`) goes into every manifest, and a checkpoint
    is resumed only if it carries the same."""
    X, Y = regression_data(cfg.n_samples, 8, 1, seed=cfg.seed, dtype=torch.float64)
    X, Y = X.to(info.device), Y.to(info.device)
    model = new_model(cfg, info.device)
    params = list(model.parameters())
    buffers = [torch.zeros_like(p) for p in params]
    seed_everything(noise_seed(cfg, info.rank))  # each rank its own noise stream
    identity = run_identity(out, model, buffers)
    start, cursor = 0, 0
    state = store.load_latest(info.rank, info.world_size, identity)
    if state is not None:
        start = state["step"]
        cursor = resume(cfg, state, model, buffers, info.rank)
        log.info("resumed from step %d of %s, restoring %s", start, store.url, ", ".join(cfg.restore))

    def save(step: int) -> None:
        pause = pause_until_killed(out, cfg.timeout) if step == cfg.pause_save_at else None
        store.save(step, {"step": step, "cursor": cursor, "model": model.state_dict(),
                          "optimizer": [b.clone() for b in buffers]},
                   capture_rng_state(), info.rank, meta=identity, pause=pause)

    losses, preempted_at, committed_time, step_s, save_s = [], None, None, [], []
    last_saved, previous, warned = start, start, False
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        if stop_agreed(notice, step, info.device):
            previous = last_saved  # what a restart finds if this save does not finish in time
            if step != last_saved:  # every rank holds the same value: no listing to disagree on
                t = time.perf_counter()
                save(step)
                save_s.append(time.perf_counter() - t)
            preempted_at, committed_time = step, time.time()
            break
        x, y = batch_at(X, Y, cursor, info.rank, info.world_size, cfg)
        cursor += cfg.batch_size * info.world_size
        x = x + cfg.noise * torch.randn_like(x)
        loss = F.mse_loss(model(x), y)
        grads = list(torch.autograd.grad(loss, params))
        all_reduce_mean_(grads, info.world_size)
        sgd_momentum_step(params, grads, buffers, cfg)
        losses.append(loss.item())
        time.sleep(cfg.step_seconds)
        step_s.append(time.perf_counter() - t0)
        if rec is not None and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            rec.metrics(step, loss=loss.item(), lr=cfg.lr, restart=restart_count())
            log.info("step %3d  loss %.5f (rank 0's shard)", step, loss.item())
        if (step + 1) % cfg.ckpt_every == 0 or step == cfg.steps - 1:
            t = time.perf_counter()
            save(step + 1)
            save_s.append(time.perf_counter() - t)
            last_saved = step + 1
            worst = seconds_to_commit(max(step_s), max(save_s))
            if worst > notice.grace_s and not warned and info.is_main:
                log.warning("a step takes %.3f s and a save %.3f s: a save on notice would end "
                            "after --grace-s %g s", max(step_s), max(save_s), notice.grace_s)
                log.warning("  (a preemption would fall back to the last periodic checkpoint)")
                warned = True
    return {"model": model, "start": start, "losses": losses, "preempted_at": preempted_at,
            "signal_time": notice.signal_time, "allowed_s": notice.allowed_s(),
            "committed_time": committed_time, "previous_commit": previous,
            "step_s": step_s, "save_s": save_s}


def notice_to_commit(result: dict) -> tuple[float, float] | None:
    """(seconds from the earliest notice any rank had to the committed checkpoint, seconds the
    platform allowed: the earliest deadline any rank had, from that notice)."""
    inf = float("inf")
    noticed = result["signal_time"] is not None
    times = gather_numbers(result["signal_time"] if noticed else inf)
    allowed = gather_numbers(result["allowed_s"] if noticed else inf)
    earliest = min(times)
    if result["committed_time"] is None or earliest == inf:
        return None
    # each rank's deadline counted from the earliest notice (exactly its allowance on that rank)
    return (result["committed_time"] - earliest,
            min(a + (t - earliest) for t, a in zip(times, allowed) if t != inf))


def main(cfg: Config) -> int:
    notice = Preemption(cfg.grace_s).install()  # before anything slow: a notice can come any time
    info = setup_distributed(cfg.device, cfg.backend, cfg.timeout)
    poller = ckpt_lock = None
    try:
        setup_logging(info.rank, info.world_size)
        rec = RunRecorder(cfg, __file__, info)
        store = ObjectStoreCheckpoints(cfg.ckpt_url or str(rec.out / "ckpt"))
        if store.local and info.rank == 0:  # one run per checkpoint folder, as per --out
            ckpt_lock = lock_folder(store.root, "--ckpt-url")
        log.info("world %d on %s/%s, checkpoints in %s, grace %g s", info.world_size,
                 info.device, info.backend, store.url, cfg.grace_s)
        url = spot_notice_url(cfg.spot_notice)
        if url is not None and info.local_rank == 0:  # one poller per node
            poller = SpotNoticePoller(url, notice, cfg.spot_poll_s).start()
            log.info("polling the spot interruption notice at %s every %g s", url, cfg.spot_poll_s)
        elif cfg.spot_notice == "auto" and url is None:
            log.info("--spot-notice auto: this machine does not say it is EC2, no notice to poll")
        result = train(cfg, info, store, notice, rec.out, rec)

        rec.figure("resumed from step", result["start"])
        if poller is not None:
            rec.figure("spot notice: polls answered (this node's local rank 0)", poller.polls)
        rec.check("replicas identical (max |dparam| across ranks)", "parity",
                  replica_spread(result["model"]), 0.0)
        if result["preempted_at"] is not None:
            stops = gather_numbers(result["preempted_at"])
            log.info("preempted: every rank stopped before step %d and saved it", stops[0])
            log.info("  the notice on this rank: %s", notice.source or "none, another rank's")
            rec.figure("preempted, checkpoint committed at step", stops[0])
            rec.check("every rank stopped at the same step (max - min)", "count",
                      max(stops) - min(stops), 0)
            worst = seconds_to_commit(reduce_number(max(result["step_s"], default=0.0), "max"),
                                      reduce_number(max(result["save_s"], default=0.0), "max"))
            rec.figure("bound: slowest step + slowest save (formula, this run's times)",
                       round(worst, 3), unit="s")
            timing = notice_to_commit(result)
            if timing is not None:
                elapsed, allowed = timing
                rec.figure("notice -> checkpoint committed (expected: the time allowed)",
                           round(elapsed, 4), expected=allowed, unit="s")
                rec.check("notice -> checkpoint committed before the deadline (s)", "timing",
                          round(elapsed, 4), allowed, compare="<=")
                if elapsed > allowed:
                    log.warning("committed %.3f s after the notice, past the %.4g s allowed "
                                "(--grace-s %g):", elapsed, allowed, cfg.grace_s)
                    log.warning("  the platform would have killed this save; a restart would "
                                "resume from step %d", result["previous_commit"])
            code = rec.finish() or PREEMPTED_EXIT
            log.info("exit code %d: stopped by the preemption notice, resume from %s", code, store.url)
            return code
        rec.figure("final loss (rank 0's shard)", result["losses"][-1] if result["losses"] else None)
        if info.is_main:
            save_checkpoint(rec.out / "final_params.pt",
                            {"model": result["model"].state_dict(), "start": result["start"]})
        return rec.finish()
    finally:
        if poller is not None:
            poller.stop()
        if ckpt_lock is not None:
            unlock_folder(ckpt_lock)
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))
