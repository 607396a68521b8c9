"""Typed configs and their command lines: one dataclass per script, one `--flag` per field.

A field is documented by the string literal right below it (as in torchtitan); that text is
the flag's `--help`. Every chapter's config subclasses `RunConfig`, so the run options (seed,
output folder, device, backend, timeout, steps) are the same everywhere.

    @dataclass
    class Config(RunConfig):
        lr: float = 0.1
        \"\"\"Learning rate of SGD.\"\"\"

    cfg = parse_config(Config, description=__doc__)

A config may validate itself in `__post_init__` by raising `ValueError("one clear sentence")`:
`parse_config` turns that into a usage message and exit status 2, never a traceback.

What depends on the world size goes in the script's `validate(cfg, world_size)`, which raises
`ValueError` the same way. Every script defines one and passes it to `parse_config`, which
calls it with the launch's world size (from torchrun's or Slurm's environment) *before* any
process group exists, so an impossible layout is refused in one line by rank 0, at once:

    def validate(cfg: Config, world_size: int) -> None:
        check_global_batch(cfg.global_batch_size, world_size)

    if __name__ == "__main__":
        sys.exit(main(parse_config(Config, description=__doc__, validate=validate)))

`./course run` calls the same two functions in one plain process before it starts any rank
(`tools/precheck.py`), and a test calls `validate` on every script's defaults at worlds 1, 2,
3, 4, 8 and 16. On a script's own command line (a real run, not a test passing `argv`),
`parse_config` then prepares the run before any process group exists: device, folders, their
locks, the library log, one-line errors (`common.preflight`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Literal

from common.preflight import launch_world_size, prepare_run


@dataclass
class RunConfig:
    """Options every chapter script shares."""

    seed: int = 0
    """Seed for every random number generator (Python, torch, CUDA)."""
    steps: int = 20
    """Optimizer steps to train."""
    out: str = ""
    """Output folder for summary.json and metrics.jsonl (default: runs/<chapter>/<script>/ under the repository root)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device: auto picks CUDA when every local rank has a GPU, else CPU."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: auto picks nccl on CUDA, gloo on CPU."""
    timeout: float = 120.0
    """Seconds a collective may wait for a peer before the run fails with an error."""
    log_every: int = 5
    """Log a metrics line every this many steps."""
    tensorboard: bool = False
    """Also write TensorBoard event files to <out>/tb (needs the tensorboard package)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout}")
        if self.log_every < 1:
            raise ValueError(f"--log-every must be at least 1, got {self.log_every}")


def require_at_least_one(cfg, *names: str) -> None:
    """For `__post_init__`: refuse the first named field below 1 with "--flag must be at least 1"."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


def check_global_batch(global_batch_size: int, world_size: int, micro_batches: int = 1,
                       flag: str = "--global-batch-size") -> None:
    """For `validate`: refuse a global batch that the ranks (× micro-batches) do not divide."""
    parts = world_size * micro_batches
    if global_batch_size % parts:
        into = f"{world_size} ranks" + (f" x {micro_batches} micro-batches" if micro_batches > 1 else "")
        raise ValueError(f"{flag} {global_batch_size} must divide into {into}; "
                         f"use a multiple of {parts}")


def field_docs(cls: type) -> dict[str, str]:
    """Map each dataclass field to the string literal written below it, through the MRO."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, following in zip(body, body[1:] + [None]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _add_argument(parser: argparse.ArgumentParser, f: dataclasses.Field, hint, doc: str) -> None:
    flag = "--" + f.name.replace("_", "-")
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # Optional[X]: X, with None as default
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    kwargs: dict = dict(default=default, dest=f.name)
    if hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is Literal:
        kwargs.update(choices=list(args), type=type(args[0]))
    elif origin in (list, tuple):
        kwargs.update(nargs="+", type=args[0])
    else:
        kwargs["type"] = hint
    shown = default if default != "" else "''"
    # a field whose documentation already says its default (--out) does not get it twice
    help_text = doc if "(default:" in doc else f"{doc} (default: {shown})"
    help_text = help_text.replace("%", "%%")  # argparse %-formats help
    parser.add_argument(flag, help=help_text, **kwargs)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option gets one line and a pointer to --help, not the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(cls: type, description: str | None = None, prog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one documented flag per field of the dataclass `cls`."""
    parser = _Parser(
        prog=prog, description=description, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name not in docs:
            raise TypeError(f"{cls.__name__}.{f.name} has no docstring: every option is documented")
        _add_argument(parser, f, hints[f.name], docs[f.name])
    return parser


def parse_config(cls: type, argv: list[str] | None = None, description: str | None = None,
                 validate=None, world_size: int | None = None, prog: str | None = None):
    """Parse `argv` (default: the command line) into an instance of the dataclass `cls`.

    Unknown options and settings the config rejects end the program with exit status 2 and
    one line saying why, not a traceback. With `validate`, `validate(cfg, world_size)` is called
    too (`world_size` defaults to the launch's, see `launch_world_size`); a refusal is printed by
    rank 0 only, and every rank exits with status 2 before any collective could hang.
    """
    parser = build_parser(cls, description=description, prog=prog)
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = cls(**vars(ns))
    except ValueError as e:
        parser.error(str(e))
    if validate is not None:
        rank = 0
        if world_size is None:
            world_size, rank = launch_world_size()
        try:
            validate(cfg, world_size)
        except ValueError as e:
            if rank == 0:
                print(f"{parser.prog}: error: {e} (world size {world_size})", file=sys.stderr)
            sys.exit(2)
    if argv is None:  # a script's own command line, not a test or a precheck: a real run
        prepare_run(cfg, parser.prog)  # device, folders, locks, library log (common.preflight)
    return cfg


def config_dict(cfg) -> dict:
    """The config as plain JSON-ready values (for summary.json)."""
    return dataclasses.asdict(cfg)
