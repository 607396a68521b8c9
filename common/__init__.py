"""Shared plumbing for the course, one module per concern (nothing here is a lesson):

distributed  setup/teardown: torchrun, Slurm or one process; device and backend choice
collectives  one number reduced/broadcast/gathered, broadcast_from_rank0 (re-exported by distributed)
config       typed dataclass configs and their documented --flags
log          rank-aware logging and progress
seed         seeding and RNG state capture
results      summary.json, metrics.jsonl, TensorBoard and the checks table
models       MLP, SmallCNN, TinyGPT
data         offline synthetic, image and text data
checkpoint   atomic save, safe load (and the names of checkpoint_dcp, manifest, files and errors, re-exported)
checkpoint_dcp  DCP saved with a manifest, loaded safely
manifest     manifest.json: every file's size and SHA-256
files        atomic writes, one run per folder (locks), folder checks
errors       the errors a run's files raise, and one_line_errors
paths        REPO_ROOT and the default output folder runs/<chapter>/<script>/
preflight    what parse_config checks and locks before a real run
check_table  a check's verdict and the printed table
timing       timers, throughput, matmul peak, MFU
launch       torchrun launches and N-rank gloo runs, for tests and notebooks
"""


def _say_if_another_checkout() -> None:
    """One line when a chapter script of one checkout imports this `common` from another (the
    environment's editable install points at the clone that installed it). `./course` always runs
    the checkout it lives in; a script started directly with python or torchrun may not."""
    import os
    import sys
    from pathlib import Path

    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not script or os.environ.get("RANK", "0") != "0":
        return
    here = Path(__file__).resolve().parents[1]
    for parent in Path(script).resolve().parents:
        if (parent / "common" / "__init__.py").is_file() and (parent / "chapters").is_dir():
            if parent != here:
                print(f"course: {Path(script).name} is in {parent} but runs the code of {here} "
                      f"(installed there); start it with {parent}/course run, or set "
                      f"PYTHONPATH={parent}", file=sys.stderr)
            return


_say_if_another_checkout()
