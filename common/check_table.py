"""A check's verdict and the table a run prints: the half of `common.results` that writes nothing.

`check_ok` decides a check by its `compare`: "==" (|measured - expected| <= tolerance, x
|expected| when relative), "<", "<=", ">", ">=" against the number `expected`, or "between"
with `expected = [low, high]` (inclusive); `expected_text` is how that expectation reads in the
table; `table_lines` lays out the rows of figures and checks in TABLE_WIDTH columns.
`common.results` re-exports these names, where chapters import them from.
"""

from __future__ import annotations

import math
import textwrap

CHECK_KINDS = ("parity", "formula", "count", "timing")
COMPARES = ("==", "<", "<=", ">", ">=", "between")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_ok(measured, expected, tolerance: float = 0.0, relative: bool = False,
             compare: str = "==") -> bool:
    """Decide a check. "==": |measured − expected| ≤ tolerance (× |expected| when relative), or
    equality for non-numbers; "<", "<=", ">", ">=": measured against the bound `expected`;
    "between": low ≤ measured ≤ high for `expected = [low, high]`. Non-finite numbers fail."""
    if compare not in COMPARES:
        raise ValueError(f"compare must be one of {COMPARES}, not {compare!r}")
    if compare == "==" and not (_is_number(measured) and _is_number(expected)):
        return measured == expected
    bounds = expected if compare == "between" else [expected]
    if compare == "between" and (not isinstance(expected, (list, tuple)) or len(expected) != 2):
        raise ValueError("compare='between' needs expected=[low, high]")
    if not all(_is_number(b) for b in [measured, *bounds]):
        raise ValueError(f"compare={compare!r} needs numbers, got {measured!r} and {expected!r}")
    if not all(math.isfinite(b) for b in [measured, *bounds]):
        return False
    if compare == "==":
        bound = tolerance * abs(expected) if relative else tolerance
        return abs(measured - expected) <= bound
    if compare == "between":
        return bounds[0] <= measured <= bounds[1]
    return {"<": measured < expected, "<=": measured <= expected,
            ">": measured > expected, ">=": measured >= expected}[compare]


def expected_text(check: dict) -> str:
    """How a check's expectation reads in the table: "0", "> 0.01", "in [0.1, 0.5]"."""
    compare, expected = check.get("compare", "=="), check["expected"]
    if compare == "between":
        return f"in [{fmt(expected[0])}, {fmt(expected[1])}]"
    return fmt(expected) if compare == "==" else f"{compare} {fmt(expected)}"


def fmt(x) -> str:
    """A number as the table shows it: integers whole, 4 significant digits, else exponent."""
    if isinstance(x, float):
        if x.is_integer() and abs(x) < 1e15:
            return str(int(x))
        return f"{x:.4g}" if 1e-3 <= abs(x) < 1e6 else f"{x:.3e}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(fmt(i) for i in x) + "]"
    return str(x)


def short(x) -> str:
    """Three significant digits: the ends of a spread."""
    return f"{x:.3g}" if isinstance(x, float) else fmt(x)


TABLE_WIDTH = 100  # the console rule: the table fits 100 columns
CELL_WIDTH = 20  # a value longer than this is cut in the table (summary.json keeps it whole)


def _cell(text: str, width: int = CELL_WIDTH) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def table_lines(rows: list[tuple], width: int = TABLE_WIDTH) -> list[str]:
    """Rows of (name, *values) as aligned lines no wider than `width`: values are cut to
    CELL_WIDTH, names wrap onto continuation lines."""
    rows = [(str(r[0]), *(_cell(str(v)) for v in r[1:])) for r in rows]
    value_widths = [max(len(r[i]) for r in rows) for i in range(1, len(rows[0]))]
    room = width - sum(value_widths) - 2 * len(value_widths)
    name_width = max(16, min(max(len(r[0]) for r in rows), room))
    lines = []
    for r in rows:
        names = textwrap.wrap(r[0], name_width) or [""]
        first = "  ".join([names[0].ljust(name_width),
                           *(v.ljust(w) for v, w in zip(r[1:], value_widths))])
        lines.append(first.rstrip())
        lines += ["  " + n for n in names[1:]]
    return lines
