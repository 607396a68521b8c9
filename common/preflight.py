"""What `parse_config` does for a real run before any process group exists: one line, not a hang.

A script started from its own command line (not a test, a notebook or `./course run`'s precheck,
which pass `argv`) is checked and prepared by `prepare_run`, in this order:

1. the device and backend: `--device cuda` without a GPU, `--backend nccl` on a CPU end the run
   in one line, as an option error does (exit 2);
2. the folders: `--out` and a checkpoint folder must be folders this rank can write (exit 2);
3. one run per folder: global rank 0 locks them (`common.files.lock_folder`); a folder another
   run holds ends this one in one line naming the holder (exit 1);
4. the library log: library warnings and logs go to `<out>/library.log` from here on
   (`common.log.library_log`);
5. one-line errors: the faults a learner can meet in a run's files end as one line
   (`common.errors.one_line_errors`).

`launch_world_size` reads the launch's world size and rank from torchrun's or Slurm's
environment, which is all a process knows before `init_process_group`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common.distributed import DistributedSetupError, choose_device_and_backend, read_launch_env
from common.errors import FolderInUseError, one_line_errors
from common.files import LOCKED_ENV, check_writable_folder, lock_folder
from common.log import library_log
from common.paths import default_out_dir


def launch_world_size() -> tuple[int, int]:
    """(world size, rank) of the launch this process belongs to, read from torchrun's or
    Slurm's environment before any process group exists; (1, 0) for a plain `python` start."""
    launch = read_launch_env()
    return launch["world_size"], launch["rank"]


def _main_script() -> str | None:
    """The file of the program this process runs (None in an interactive interpreter)."""
    return getattr(sys.modules.get("__main__"), "__file__", None)


def prepare_run(cfg, prog: str) -> None:
    """Steps 1 to 5 of this module's docstring, for the config `cfg` of the program `prog`."""
    _check_device(cfg, prog)
    _check_folders(cfg, prog)
    _lock_folders(cfg, prog)
    _start_library_log(cfg)
    one_line_errors(prog)


# The config fields that name a folder a run writes (`ckpt_url` when it is a local path)
FOLDER_OPTIONS = ("out", "ckpt_dir", "ckpt_url")


def local_folder(value: str) -> str | None:
    """The local path a folder option names: a path, or a file:// URL; None for another URL
    (an object store: s3://, gs://, memory://), which no local check or lock applies to."""
    if value.startswith("file://"):
        return value[len("file://"):]
    return None if "://" in value else value


def _check_folders(cfg, prog: str) -> None:
    """`--out` and a checkpoint folder must be folders this rank can write: a file, a read-only
    place or a full path under a file ends the run in one line on every rank, before any process
    group exists (one line a node: local rank 0 says it)."""
    for name in FOLDER_OPTIONS:
        value = local_folder(getattr(cfg, name, ""))
        if not value:
            continue
        try:
            check_writable_folder(value, "--" + name.replace("_", "-"))
        except ValueError as e:
            if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
                print(f"{prog}: error: {e}", file=sys.stderr)
            sys.exit(2)


def _check_device(cfg, prog: str) -> None:
    """A device or backend this machine cannot give the launch's processes (`--device cuda`
    without a GPU, `--backend nccl` on a CPU) ends the run in one line, as an option error does,
    before any process group exists (`./course run` asks the same question before launching)."""
    if not hasattr(cfg, "device"):
        return
    try:
        launch = read_launch_env()
        choose_device_and_backend(launch["local_rank"], launch["local_world_size"], cfg.device,
                                  getattr(cfg, "backend", "auto"))
    except DistributedSetupError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)


def _lock_folders(cfg, prog: str) -> None:
    """One run per folder: global rank 0 locks `--out` (default or given) and `--ckpt-dir`
    (`common.files.lock_folder`) before any process group exists and before anything in
    them is touched (the library log of the run that holds them stays). A folder held by another
    run ends this one in one line naming the holder; the other ranks, waiting for rank 0 in
    `init_process_group`, are stopped by their launcher. Processes this one starts itself
    (`mp.spawn`, a launcher script's torchrun) inherit the list in COURSE_LOCKED_FOLDERS and do
    not lock those again."""
    if launch_world_size()[1] != 0:
        return
    script = _main_script()
    folders = []
    if getattr(cfg, "out", "") or script:
        folders.append(("--out", cfg.out or default_out_dir(script)))
    for name in FOLDER_OPTIONS[1:]:
        folder = local_folder(getattr(cfg, name, ""))
        if folder:
            folders.append(("--" + name.replace("_", "-"), folder))
    held = [p for p in os.environ.get(LOCKED_ENV, "").split(os.pathsep) if p]
    for what, folder in folders:
        if str(Path(folder).resolve()) in held:
            continue  # a process of this launch holds it: this one was started by it
        try:
            held.append(str(lock_folder(folder, what)))
        except FolderInUseError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            sys.exit(1)
    os.environ[LOCKED_ENV] = os.pathsep.join(held)


def _start_library_log(cfg) -> None:
    """Route library warnings and logs of this run to its output folder (see `common.log`),
    from the start: the imports and setup that follow warn before any `RunRecorder` exists."""
    script = _main_script()
    if getattr(cfg, "out", "") or script:
        out = cfg.out or default_out_dir(script)
        library_log(out, launch_world_size()[1])

