"""Every script's options, checked without launching anything.

- Every chapter script defines `Config` and `validate(cfg, world_size)` and hands `validate` to
  `parse_config`, so a layout the world cannot hold is refused in one line before any rank starts.
- Every script's defaults are valid at the world sizes the course's commands use (1, 2, 3, 4, 8
  and 16); where the technique forbids a world, the refusal sentence is listed below and tested.
- Every command printed in a README or a script's docstring parses, and validates at the world
  size it launches (torchrun's --nproc_per_node × --nnodes, srun's tasks, `./course run`'s 2);
  a command the lesson shows being refused must be refused.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from common.config import build_parser
from tools.precheck import launches_itself, script_module

REPO = Path(__file__).resolve().parents[1]
WORLDS = (1, 2, 3, 4, 8, 16)


def chapter_scripts() -> list[Path]:
    """Every runnable chapter script: it has a main guard and parses a Config."""
    return sorted(p for p in REPO.glob("chapters/ch[0-9][0-9]_*/*.py")
                  if "__main__" in (text := p.read_text()) and "parse_config(" in text)


SCRIPTS = chapter_scripts()

# (script, world) -> words of the one sentence that refuses it. Only what the technique itself
# forbids belongs here, and the lesson says why.
REFUSED: dict[tuple[str, int], str] = {
    # ch28: the world is the tensor-parallel group; it must divide the 16 heads
    ("ch28_inference/train", 3): "must divide --n-heads 16",
    # ch02: single.py is the one-process reference (train.py and spawn.py are the multi-rank ones)
    **{("ch02_single_node/single", w): "one process by design" for w in (2, 3, 4, 8, 16)},
    # ch04, ch17: a pipeline needs two stages, one per rank
    ("ch04_model_parallel/train", 1): "needs at least 2 ranks",
    ("ch17_pipeline_balance/train", 1): "needs at least 2 ranks",
    # ch05: the TP degree is the world size and must split whole attention heads (16)
    ("ch05_tensor_parallel/train", 3): "does not divide the 16 attention heads",
    # ch12: resume.py is the one-process resume (resume_dcp.py is the multi-rank one)
    **{("ch12_checkpointing/resume", w): "resume.py is one process" for w in (2, 3, 4, 8, 16)},
    # ch13: a hung peer needs a peer: the hanging rank and rank 0, which reports
    ("ch13_fault_tolerance/hang", 1): "needs at least 2 ranks",
    # ch06: mesh.py's dp x tp mesh needs its tp degree (2) to divide the world
    **{("ch06_hybrid_zero/mesh", w): "--tp 2 must divide the world size" for w in (1, 3)},
    # ch21: tune.py is one process; Ray starts its own workers (the TorchTrainer's 2 included)
    **{("ch21_hyperparameters/tune", w): "one process by design" for w in (2, 3, 4, 8, 16)},
    # ch27: the TRL demonstration is one process (TRL spreads itself with accelerate launch)
    **{("ch27_rlhf/trl_grpo", w): "runs as one process" for w in (2, 3, 4, 8, 16)},
    # ch30: FedAvg needs clients to average: one per rank, two at least
    ("ch30_frontier/fedavg", 1): "needs at least 2 ranks",
}


def _id(p: Path) -> str:
    return f"{p.parent.name}/{p.stem}"


def _defaults(module, world: int):
    cfg = build_parser(module.Config).parse_args([])
    cfg = module.Config(**vars(cfg))
    if hasattr(cfg, "nprocs"):  # a script that starts its own ranks: its world is --nprocs
        cfg.nprocs = world
    return cfg


def test_scripts_found():
    assert len(SCRIPTS) >= 25, [_id(p) for p in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=_id)
def test_script_validates_before_launch(script):
    module = script_module(script)
    assert callable(getattr(module, "validate", None)), f"{_id(script)} has no validate(cfg, world_size)"
    assert "validate=validate" in script.read_text(), \
        f"{_id(script)} does not hand validate to parse_config"


@pytest.mark.parametrize("script", SCRIPTS, ids=_id)
def test_defaults_valid_at_every_world(script):
    module = script_module(script)
    for world in WORLDS:
        cfg = _defaults(module, world)
        refusal = REFUSED.get((_id(script), world))
        if refusal is None:
            try:
                module.validate(cfg, world)
            except ValueError as e:
                pytest.fail(f"{_id(script)} refuses its own defaults at world {world}: {e}")
        else:
            with pytest.raises(ValueError, match=refusal):
                module.validate(cfg, world)


# --- commands printed in the lessons and docstrings ----------------------------------------------

SCRIPT_RE = re.compile(r"chapters/(ch\d\d_\w+)/(\w+)\.py")


def _logical_lines(text: str) -> list[str]:
    """Lines with shell continuations (a trailing backslash, doubled in docstrings) joined."""
    out, cur = [], ""
    for line in text.splitlines():
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            cur += stripped.rstrip("\\") + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def _command_texts(path: Path) -> list[str]:
    """Candidate commands: fenced code lines and inline `code` spans of a Markdown lesson; the
    docstring lines of a script."""
    if path.suffix == ".py":
        out = []
        for line in _logical_lines(script_module(path).__doc__ or ""):
            spans = re.findall(r"`([^`]*)`", line)  # a command quoted inside a sentence
            out += spans if spans else [line]
        return out
    text, cmds, fenced = path.read_text(), [], False
    block: list[str] = []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if fenced:
                cmds += _logical_lines("\n".join(block))
                block = []
            fenced = not fenced
            continue
        if fenced:  # a commented-out alternative ("# srun torchrun ...") is a command too
            block.append(re.sub(r"^(\s*)#(?![!A-Z])\s?", r"\1", line))
        else:
            cmds += re.findall(r"`([^`]*(?:chapters/ch\d\d|\./course run)[^`]*)`", line)
    return cmds


def _tokens(command: str) -> tuple[list[str], str]:
    """Shell words of a command and its trailing comment."""
    code, _, comment = command.partition(" #")
    code = code.strip().removeprefix("$ ").strip()
    try:
        words = shlex.split(code)
    except ValueError:
        return [], comment
    flat: list[str] = []
    for w in words:  # srun ... bash -c 'torchrun ...': look inside the quoted command
        flat += shlex.split(w) if " " in w else [w]
    return flat, comment


def _opt(words: list[str], *names: str) -> str | None:
    for i, w in enumerate(words):
        for n in names:
            if w == n and i + 1 < len(words):
                return words[i + 1]
            if w.startswith(n + "="):
                return w.split("=", 1)[1]
    return None


def _int(value: str | None, default: int, srun_nodes: int | None = None) -> int:
    if value is None:
        return default
    if value.startswith("$"):  # $SLURM_NNODES and friends: what srun asked for
        return srun_nodes or default
    return max(int(v) for v in value.split(":"))  # an elastic range 1:2 reaches 2


def parse_command(command: str):
    """(script path, args, world size) of a command that starts a chapter script, else None."""
    words, comment = _tokens(command)
    if "course" in " ".join(words[:2]) and "run" in words[:3]:
        i = words.index("run")
        if i + 1 >= len(words):
            return None
        chapter = words[i + 1].removeprefix("ch")
        matches = sorted(REPO.glob(f"chapters/ch{int(chapter):02d}_*")) if chapter.isdigit() else []
        if not matches:
            return None
        rest = words[i + 2:]
        name = "train"
        if rest and not rest[0].startswith("-"):
            name, rest = rest[0].removesuffix(".py"), rest[1:]
        env = dict(w.split("=", 1) for w in words[:i] if "=" in w)
        script = matches[0] / f"{name}.py"
        world = int(env.get("COURSE_NPROC", 2))
        return script, _until_shell_op(rest), (1 if launches_itself(script) else world), comment
    idx = next((i for i, w in enumerate(words) if SCRIPT_RE.fullmatch(w)), None)
    if idx is None:
        return None
    script, pre, args = REPO / words[idx], words[:idx], _until_shell_op(words[idx + 1:])
    srun_nodes = _int(_opt(pre, "--nodes", "-N"), 1) if "srun" in pre else None
    if any(w in ("torchrun", "torch.distributed.run") for w in pre):
        world = (_int(_opt(pre, "--nproc_per_node", "--nproc-per-node"), 1)
                 * _int(_opt(pre, "--nnodes"), 1, srun_nodes))
    elif "srun" in pre:
        ntasks = _opt(pre, "--ntasks", "-n")
        world = int(ntasks) if ntasks else srun_nodes * _int(_opt(pre, "--ntasks-per-node"), 1)
    else:
        world = 1
    return script, args, world, comment


def _until_shell_op(words: list[str]) -> list[str]:
    for i, w in enumerate(words):
        if w in ("&&", "||", "|", ";", ">", "2>&1") or w.startswith(">"):
            return words[:i]
    return words


def documented_commands() -> list[tuple[str, str]]:
    sources = [REPO / "README.md", *sorted(REPO.glob("chapters/ch*/README.md")), *SCRIPTS]
    out = []
    for src in sources:
        for text in _command_texts(src):
            if SCRIPT_RE.search(text) or "course run" in text:
                out.append((str(src.relative_to(REPO)), " ".join(text.split())))
    return out


COMMANDS = documented_commands()


def test_commands_found():
    assert len(COMMANDS) >= 100, len(COMMANDS)


def _refusal_shown(comment: str) -> bool:
    return bool(re.search(r"refus|error|fails", comment, re.IGNORECASE))


@pytest.mark.parametrize("source,command", COMMANDS, ids=[f"{s}:{c[:60]}" for s, c in COMMANDS])
def test_documented_command_is_valid(source, command):
    parsed = parse_command(command)
    if parsed is None:
        pytest.skip("not a command that starts a chapter script (a mention in prose)")
    script, args, world, comment = parsed
    assert script.exists(), f"{source}: {command!r} names a script that does not exist"
    module = script_module(script)
    args = [a for a in args if not a.startswith("$") and a not in ("...", "…")]
    parser = build_parser(module.Config)
    if any(a in ("-h", "--help") for a in args):
        return
    refused = _refusal_shown(comment)
    try:
        ns = parser.parse_args(args)
        cfg = module.Config(**vars(ns))
        if launches_itself(script) and hasattr(cfg, "nprocs"):  # it starts its own ranks
            world = cfg.nprocs
        validate = getattr(module, "validate", None)  # chapter 01's hello.py: any world is valid
        if validate is not None:
            validate(cfg, world)
    except (ValueError, SystemExit) as e:
        if refused:
            return
        pytest.fail(f"{source}: `{command}` is refused at world {world}: {e}")
    assert not refused, f"{source}: `{command}` is shown as refused but is valid at world {world}"
