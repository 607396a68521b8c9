"""Where a run writes: `runs/<chapter>/<script>/` under the repository root, unless `--out` says.

`parse_config` locks this folder and opens the run's library log in it before any process group
exists (`common.preflight`); `RunRecorder` writes summary.json and metrics.jsonl there
(`common.results`, which re-exports both names).
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def default_out_dir(script_file: str) -> Path:
    """runs/<chapter>/<script>/ under the repository root."""
    script = Path(script_file).resolve()
    return REPO_ROOT / "runs" / script.parent.name / script.stem
