"""The course's shape stays true: every chapter has its parts, every script explains itself and
refuses bad input, every README link resolves, the environment files agree."""

from __future__ import annotations

import ast
import functools
import io
import re
import runpy
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p for p in (ROOT / "chapters").glob("ch[0-9][0-9]_*") if p.is_dir())
SCRIPTS = sorted(p for c in CHAPTERS for p in c.glob("*.py")
                 if 'if __name__ == "__main__":' in p.read_text())
READMES = sorted([ROOT / "README.md", ROOT / "data" / "README.md", *(c / "README.md" for c in CHAPTERS)])


def index_table() -> dict[str, tuple[str, str | None]]:
    """Chapter number -> (slug, link target or None) from the top README's table."""
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"\|\s*(\d\d)\s*\|(.*?)\|", line)
        if m:
            link = re.search(r"\]\((chapters/ch\d\d_[a-z_]+)/?(README\.md)?\)", line)
            slug = re.search(r"ch\d\d_([a-z_]+)", line)
            rows[m.group(1)] = (slug.group(1) if slug else m.group(2).strip(),
                                link.group(1) if link else None)
    return rows


def test_readme_lists_all_thirty_chapters_linking_exactly_the_written_ones():
    table = index_table()
    assert sorted(table) == [f"{i:02d}" for i in range(1, 31)]
    written = {c.name for c in CHAPTERS}
    linked = {Path(link).name for _, link in table.values() if link}
    assert linked == written, "link every written chapter, and only those"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_chapter_has_every_part(chapter):
    for part in ("README.md", "train.py", "lesson.py", "__init__.py"):
        assert (chapter / part).is_file(), f"{chapter.name} lacks {part}"
    assert (ROOT / "notebooks" / f"{chapter.name}.ipynb").is_file()
    number = chapter.name[2:4]
    assert list((ROOT / "tests").glob(f"test_ch{number}_*.py")), f"no tests for {chapter.name}"
    heading = (chapter / "README.md").read_text().splitlines()[0]
    assert heading.startswith(f"# Chapter {number} ") and re.search(r"[\u4e00-\u9fff]", heading), \
        "lesson heading: '# Chapter NN · English · 中文'"


def lesson_sections(text: str) -> dict[str, str]:
    """'## Heading' -> the text under it."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_lesson_opens_with_objectives_needs_and_time(chapter):
    """Before the first section: 'What you will learn' (three to five objectives), then what it
    needs and how long it takes to read and to run."""
    head = (chapter / "README.md").read_text().split("\n## ", 1)[0]
    assert "**What you will learn**" in head, f"{chapter.name}: no 'What you will learn' block"
    after = head.split("**What you will learn**", 1)[1]
    objectives = re.findall(r"^>?\s*[-*] ", after.split("**Needs:**")[0], flags=re.MULTILINE)
    assert 3 <= len(objectives) <= 5, f"{chapter.name}: {len(objectives)} objectives, want 3-5"
    needs = re.search(r"\*\*Needs:\*\*(.+)", head)
    time = re.search(r"\*\*Time:\*\*(.+)", head)
    assert needs and time, f"{chapter.name}: say what it needs (**Needs:**) and how long (**Time:**)"
    assert re.search(r"\d+\s*min", time.group(1)), f"{chapter.name}: **Time:** in minutes"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_every_exercise_has_a_hint_and_an_answer(chapter):
    exercises = lesson_sections((chapter / "README.md").read_text()).get("Exercises")
    assert exercises, f"{chapter.name} has no '## Exercises' section"
    numbered = re.findall(r"^(\d+)\. ", exercises, flags=re.MULTILINE)
    hints = re.findall(r"<summary>\s*Hint", exercises)
    answers = re.findall(r"<summary>\s*Answer", exercises)
    assert numbered, f"{chapter.name}: no numbered exercises"
    assert len(hints) == len(answers) == len(numbered), (
        f"{chapter.name}: {len(numbered)} exercises, {len(hints)} hints, {len(answers)} answers "
        "(each exercise: <details><summary>Hint</summary>...</details> and "
        "<details><summary>Answer</summary>...</details>)")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_next_section_links_the_next_chapter(chapter):
    """'## Next' links the chapter that follows once it is written (DESIGN: a link to a chapter
    that is not written yet stays plain text until the chapter exists); the last chapter points
    beyond the course, to no chapter 31."""
    following = [c for c in CHAPTERS if int(c.name[2:4]) == int(chapter.name[2:4]) + 1]
    text = lesson_sections((chapter / "README.md").read_text()).get("Next")
    assert text, f"{chapter.name} has no '## Next' section"
    if following:
        assert f"](../{following[0].name}/" in text, f"{chapter.name}: 'Next' should link {following[0].name}"
    assert "not written yet" not in text, f"{chapter.name}: 'Next' says a written chapter is not written"
    assert "Chapter 31" not in text


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_notebook_source_defines_nothing(chapter):
    """A notebook is a client of its chapter: functions and classes live in the scripts."""
    tree = ast.parse((chapter / "lesson.py").read_text())
    defined = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert not defined, f"{chapter.name}/lesson.py defines {defined}; move them into the chapter"


def run_script(path: Path, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv
    sys.argv = [str(path), *argv]
    try:
        with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as e:
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved
    return e.value.code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_help_and_bad_option(script):
    code, out, _ = run_script(script, "--help")
    assert code == 0
    for flag in ("--seed", "--out", "--device", "--backend", "--timeout", "--steps"):
        assert flag in out, f"--help of {script.name} lacks {flag}"
    assert "torchrun" in out or "python" in out, "the docstring shows how to run it"
    code, _, err = run_script(script, "--no-such-option")
    assert code == 2 and "unrecognized arguments: --no-such-option" in err
    assert len(err.strip().splitlines()) == 1, "a bad option gets one line, no traceback"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_links_resolve(readme):
    assert readme.is_file()
    for target in LINK.findall(readme.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # web links and in-page anchors
        path = (readme.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{readme.relative_to(ROOT)} links to missing {target}"


def pins(lines) -> dict[str, str]:
    found = {}
    for line in lines:
        m = re.match(r"\s*-?\s*([A-Za-z0-9_.\-\[\]]+)==([^\s#]+)", line)
        if m:
            found[m.group(1).lower()] = m.group(2)
    return found


def test_environment_files_agree():
    req = pins((ROOT / "requirements.txt").read_text().splitlines())
    env = pins((ROOT / "environment.yml").read_text().splitlines())
    assert req == env and req["torch"] == "2.14.1" and req["torchvision"] == "0.29.1"
    assert "-e ." in (ROOT / "requirements.txt").read_text()
    assert "python=3.11" in (ROOT / "environment.yml").read_text()


def test_ci_runs_the_readme_test_command():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    assert "./course test" in readme and "./course test" in ci
    assert "ruff check" in ci and (ROOT / "LICENSE").is_file()


def lesson_minutes(chapter: Path) -> tuple[int, int]:
    """(read, run) minutes from the lesson's '**Time:** about R min to read, M min to run'."""
    text = " ".join((chapter / "README.md").read_text().split())
    m = re.search(r"\*\*Time:\*\* about (\d+) min to read, (\d+) min to run", text)
    assert m, f"{chapter.name}: no '**Time:** about R min to read, M min to run'"
    return int(m.group(1)), int(m.group(2))


def test_readme_times_and_routes_are_the_lessons_own():
    """The chapter table's 'read · run' column is each lesson's Time line, and each start-here
    route's hours are the sum of its chapters' reading times, to the nearest quarter hour."""
    minutes = {c.name[2:4]: lesson_minutes(c) for c in CHAPTERS}
    readme = (ROOT / "README.md").read_text()
    rows = [row for line in readme.splitlines()
            if (row := re.match(r"\| (\d\d) \| .* \| (?:(\d+) · (\d+) min)? ?\|$", line))]
    assert len(rows) == 30
    for row in rows:
        if row:
            shown = (int(row.group(2)), int(row.group(3))) if row.group(2) else None
            assert shown == minutes.get(row.group(1)), f"README row {row.group(1)}: {shown}"
    routes = re.findall(r"^\| [^|]+ \| ((?:\d\d → )+\d\d)[^|]* \| ([\d¼½¾]+) h \|$", readme, re.M)
    assert len(routes) == 5
    quarters = {"": 0, "¼": 0.25, "½": 0.5, "¾": 0.75}
    for chapters, hours in routes:
        total = sum(minutes[n][0] for n in chapters.split(" → ")) / 60
        stated = int(re.match(r"\d+", hours).group()) + quarters[hours.lstrip("0123456789")]
        assert abs(total - stated) <= 0.125, f"route {chapters}: {total:.2f} h, README says {hours} h"


COMMAND_START = re.compile(r"^\s*(?:\$\s*)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
                           r"(?:#SBATCH\b|srun\b|sbatch\b|salloc\b|torchrun\b|python\b)")


def per_task_gpu_commands(text: str) -> list[str]:
    """Commands (srun/sbatch/salloc/#SBATCH/torchrun/python at the line's start, after any
    VAR=value, with their backslash-continued lines joined) that bind one GPU to each task: where
    Slurm confines devices, a task then cannot reach its neighbours' GPUs and NCCL has no NVLink
    between ranks (chapter 22's pitfall). Prose may name the option."""
    commands = re.sub(r"\\\n\s*", " ", text).splitlines()  # one line per command
    return [line.strip() for line in commands
            if "--gpus-per-task" in line and COMMAND_START.match(line)]


def test_no_command_binds_one_gpu_per_task():
    files = [p for p in (ROOT / "README.md", *(ROOT / "chapters").rglob("*"))
             if p.is_file() and p.suffix in (".md", ".py", ".sbatch", ".sh", ".yaml", ".json")]
    found = {str(p.relative_to(ROOT)): hits for p in files if (hits := per_task_gpu_commands(p.read_text()))}
    assert not found, f"commands with --gpus-per-task (use --gpus-per-node): {found}"
    # negative controls: a command line is caught in a README block, a docstring and an sbatch
    # header; prose naming the option is not
    assert per_task_gpu_commands("    srun --nodes=2 --gpus-per-task=1 python train.py")
    assert per_task_gpu_commands("#SBATCH --gpus-per-task=1")
    assert per_task_gpu_commands("$ sbatch --gpus-per-task=1 job.sbatch")
    assert per_task_gpu_commands("    srun --nodes=2 \\\n        --gpus-per-task=1 python train.py")
    assert per_task_gpu_commands("NCCL_DEBUG=INFO srun --gpus-per-task=1 python train.py")
    assert not per_task_gpu_commands("- **`srun --gpus-per-task=1` for the ranks of one job.**")


# Issue 23: files a reader can hold in their head, and an import graph without circles.
LONG_FILE_LINES, LONG_FILES_ALLOWED = 300, 5
WHY_WHOLE = "Why this file stays whole:"
CODE = sorted(p for d in ("chapters", "common", "tools") for p in (ROOT / d).rglob("*.py"))


def test_files_stay_under_300_lines_or_say_why_they_stay_whole():
    """STYLE.md: 80-300 lines a script. A longer file is one cohesive story, says so at its top
    (WHY_WHOLE in its first 40 lines), and there are at most LONG_FILES_ALLOWED of them. What a
    reader reads is counted: chapters/, common/, tools/; tests/ are not (a test module is a list of
    checks, not a story)."""
    long = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in CODE
            if len(p.read_text().splitlines()) > LONG_FILE_LINES}
    unexplained = [f"{p} ({n} lines)" for p, n in long.items()
                   if WHY_WHOLE not in "\n".join((ROOT / p).read_text().splitlines()[:40])]
    assert not unexplained, f"over {LONG_FILE_LINES} lines without '{WHY_WHOLE}' at the top: {unexplained}"
    assert len(long) <= LONG_FILES_ALLOWED, f"{len(long)} files over {LONG_FILE_LINES} lines: {long}"


def repo_module(name: str, importer: Path) -> Path | None:
    """The repository file an `import name` in `importer` resolves to, or None (a library)."""
    parts = name.split(".")
    if parts[0] in ("chapters", "common", "tools"):
        for cand in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts) / "__init__.py"):
            if cand.exists():
                return cand
        return None
    if not importer.is_relative_to(ROOT / "chapters"):
        return None  # common/ and tools/ are imported as packages: no bare sibling imports
    sibling = importer.parent / f"{parts[0]}.py"  # a script's own folder is on its sys.path
    return sibling if sibling.exists() and sibling != importer else None


@functools.cache
def import_graph() -> dict[Path, set[Path]]:
    """Every import in every file, at any depth (a function-level import that dodges a circle is
    still an edge), `from package import module` resolved to the module."""
    graph: dict[Path, set[Path]] = {}
    for path in CODE:
        edges = graph.setdefault(path, set())
        for node in ast.walk(ast.parse(path.read_text())):
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path}: a relative import"
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges.update(t for t in (repo_module(n, path) for n in names) if t and t.name != "__init__.py")
    return graph


def find_circles(graph: dict) -> list[str]:
    """Every back edge of a depth-first walk, as the circle it closes."""
    state: dict = {}  # 1 on the stack, 2 done
    circles = []

    def visit(node: Path, stack: list[Path]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(p.relative_to(ROOT).as_posix()
                                           for p in stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return circles


def test_import_graph_has_no_circle():
    graph = import_graph()
    # the graph was read: over a thousand edges today, and one known import among them
    assert sum(map(len, graph.values())) > 500
    assert ROOT / "chapters/ch03_data_parallel/train.py" in graph[ROOT / "chapters/ch23_containers/train.py"]
    a, b, c = (ROOT / n for n in ("a.py", "b.py", "c.py"))  # the walk finds a circle it is shown
    assert len(find_circles({a: {b}, b: {c}, c: {a}})) == 1 and not find_circles({a: {b}, b: {c}})
    circles = find_circles(graph)
    assert not circles, "import circles:\n" + "\n".join(circles)


def chapter_number(path: Path) -> int | None:
    m = re.match(r"ch(\d\d)_", path.relative_to(ROOT).parts[1]) if path.is_relative_to(ROOT / "chapters") else None
    return int(m.group(1)) if m else None


# Where a chapter's workload *is* an earlier chapter's training run, it imports that script.
RUNS_ANOTHER_CHAPTERS_TRAINING = {
    "chapters/ch23_containers/train.py": "chapters/ch03_data_parallel/train.py",  # ch03's run, containerised
}


def test_chapters_build_on_earlier_chapters_only_and_never_on_a_training_script():
    """A chapter imports common/ and earlier chapters' technique modules: never a later chapter,
    never another chapter's train.py (launch plumbing lives in common/; the one exception is a
    chapter whose workload is that chapter's run, RUNS_ANOTHER_CHAPTERS_TRAINING), and common/
    no chapter."""
    wrong = []
    for src, targets in import_graph().items():
        n = chapter_number(src)
        for dst in targets:
            m = chapter_number(dst)
            if m is None:
                continue
            if n is None and src.is_relative_to(ROOT / "common"):
                wrong.append(f"{src.relative_to(ROOT)} imports a chapter: {dst.relative_to(ROOT)}")
            elif n is not None and m > n:
                wrong.append(f"{src.relative_to(ROOT)} imports a later chapter: {dst.relative_to(ROOT)}")
            elif (n is not None and m != n and dst.name == "train.py" and RUNS_ANOTHER_CHAPTERS_TRAINING.get(
                    src.relative_to(ROOT).as_posix()) != dst.relative_to(ROOT).as_posix()):
                wrong.append(f"{src.relative_to(ROOT)} imports another chapter's training script: "
                             f"{dst.relative_to(ROOT)}")
    assert not wrong, "\n".join(wrong)
