"""The Chinese lessons stay true to the English ones (issue 24): tools/bilingual.py finds no
problem in any chapter or the root README, the Chinese notebooks share the English code cells, and
each rule of the check bites on a small English/Chinese pair built here."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from tools import bilingual, notebooks
from tools.bilingual_text import EN_SWITCH, glossary, read_prose, sections, stamp_of

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p for p in (ROOT / "chapters").glob("ch[0-9][0-9]_*") if p.is_dir())
ZH_NOTEBOOKS = [c for c in notebooks.chapters() if notebooks.has_zh(c)]


@pytest.mark.parametrize("folder", [ROOT, *CHAPTERS], ids=lambda p: "root" if p == ROOT else p.name)
def test_chinese_lesson_keeps_in_step_with_the_english(folder):
    """No problem between README.md and README.zh.md (or lesson.py and lesson.zh.md); a folder
    without a Chinese text passes if its English does not claim one."""
    problems = bilingual.check(folder)
    assert not problems, f"{len(problems)} problems (python tools/bilingual.py check):\n" + "\n".join(problems[:20])


@pytest.mark.parametrize("chapter", ZH_NOTEBOOKS, ids=lambda p: p.name)
def test_chinese_notebook_has_the_english_code_cells(chapter):
    path = notebooks.zh_notebook_path(chapter)
    assert path.exists(), f"no {path.name}: run python tools/notebooks.py {chapter.name[:4]}"
    zh = nbformat.read(path, as_version=4)
    en = nbformat.read(notebooks.notebook_path(chapter), as_version=4)
    assert len(zh.cells) == len(en.cells)
    assert [c for c in notebooks.cells(zh) if c[0] == "code"] == [c for c in notebooks.cells(en) if c[0] == "code"]
    assert notebooks.zh_notebook_path(chapter).read_text() == notebooks.render(notebooks.zh_notebook(chapter)), \
        f"run python tools/notebooks.py {chapter.name[:4]}"
    assert all(c.outputs == [] for c in zh.cells if c.cell_type == "code")


def test_every_chinese_notebook_has_its_lesson_zh_md():
    for path in (ROOT / "notebooks").glob("*.zh.ipynb"):
        assert (ROOT / "chapters" / path.name.removesuffix(".zh.ipynb") / "lesson.zh.md").exists(), path.name


def test_glossary_rows_have_four_columns_and_rejected_variants_never_hit_a_correct_term():
    table = [line for line in (ROOT / "GLOSSARY.md").read_text().splitlines() if line.startswith("|")]
    assert table[0].replace(" ", "") == "|English|中文|chapter|rejected|"
    for line in table[2:]:
        assert len(line.strip().strip("|").split("|")) == 4, line
    rows = glossary()
    assert len(rows) == len(table) - 2 >= 60
    accepted = [zh for _, zh, _, _ in rows]
    for en, zh, chapter, rejected in rows:
        assert en and zh and re.fullmatch(r"\d\d", chapter), (en, zh, chapter)
        for bad in rejected:
            assert bad and not any(bad in good for good in accepted), f"{en}: {bad!r} is part of a correct term"


# A small English/Chinese chapter, built in tmp_path: the check passes, then each rule bites.
EN = """\
# Chapter 99 · Fake · 假的

**Builds on:** [Chapter 98](../ch98_prev/README.md), with `torchrun`.

## The idea

Two ranks run 143,520 steps on 12,000 tokens with `torchrun --nproc-per-node 2`; the loss is
$L/W$ and

$$g = \\frac{1}{W}\\sum_r g_r$$

![the curve](figures/curve.png)

## Run it

```bash
./course run 99
# ## not a heading
```

### What you should see

It prints 0.5 and 3 checks. See [the idea](#the-idea) and [chapter 01](../ch01_overview/README.md#run).
"""
ZH = """\
# 第 99 章 · 假的
[English](README.md) · 中文

**前置：** [第 98 章](../ch98_prev/README.md)，用 `torchrun`。

## 思路

两个 rank 跑 143 520 步，处理 1.2 万个 token，用 `torchrun --nproc-per-node 2` 启动；损失为
$L/W$，且

$$g = \\frac{1}{W}\\sum_r g_r$$

![曲线](figures/curve.png)

## 跑起来

```bash
./course run 99
# ## not a heading
```

### 你应该看到

输出 0.5 和 3 项检查。见[思路](#思路)和[第 01 章](../ch01_overview/README.md)。
"""
LESSON = '''\
# %% [markdown]
# # Chapter 99 · Fake
#
# Runs 2 ranks for 1,000 steps with `torchrun`.

# %%
print("hello")

# %% [markdown]
# ## 1. Memory: 16 bytes per parameter

# %%
x = 16
'''
LESSON_ZH = """\
<!-- cell 0 en: -->
# 第 99 章 · 假的

用 `torchrun` 启动 2 个 rank，跑 1000 步。

<!-- cell 1 en: -->
## 1. 内存：每个参数 16 字节
"""


@pytest.fixture
def chapter(tmp_path):
    """ch99_fake with both languages, stamped: the check passes."""
    folder = tmp_path / "chapters" / "ch99_fake"
    folder.mkdir(parents=True)
    for name, text in (("README.md", EN), ("README.zh.md", ZH), ("lesson.py", LESSON), ("lesson.zh.md", LESSON_ZH)):
        (folder / name).write_text(text)
    log = []
    assert bilingual.stamp(folder, log=log.append) == []
    assert any("README.md: added" in line for line in log)
    assert bilingual.check(folder) == []
    return folder


def problems_after(chapter: Path, name: str, old: str, new: str) -> str:
    path = chapter / name
    assert old in path.read_text(), old
    path.write_text(path.read_text().replace(old, new, 1))
    return "\n".join(bilingual.check(chapter))


def test_the_pair_passes_and_stamps_sit_under_the_headings(chapter):
    zh = (chapter / "README.zh.md").read_text().splitlines()
    assert zh[1] == bilingual.ZH_SWITCH and re.fullmatch(r"<!-- en: [0-9a-f]{10} -->", zh[2])
    assert (chapter / "README.md").read_text().splitlines()[1] == bilingual.EN_SWITCH
    en = sections((chapter / "README.md").read_text())
    assert [s.level for s in en] == [0, 1, 2, 2, 3]  # the '# ##' inside the code block is code
    assert zh[2] == f"<!-- en: {stamp_of(chr(10).join(en[1].lines))} -->"
    before = (chapter / "README.zh.md").read_text()
    assert bilingual.stamp(chapter, log=lambda *a: None) == []  # stamping twice changes nothing
    assert (chapter / "README.zh.md").read_text() == before
    assert "<!-- cell 1 en: " + stamp_of("## 1. Memory: 16 bytes per parameter") in (chapter / "lesson.zh.md").read_text()


def test_numbers_are_normalised():
    assert set(read_prose(["143,520 and 143 520 and 1\u202f234\u2009567, 1, 2, 3 and 7e9"]).numbers) == \
        {"143520", "1234567", "1", "2", "3", "7000000000"}
    zh = read_prose(["1.2 万个 token，3 亿参数，2.5万亿"], chinese=True).numbers
    assert {"12000", "300000000", "2500000000000"} <= set(zh)
    prose = read_prose(["`x = 5` and $W = 7$ and [chapter 04](../ch04_x/README.md) cost \\$2 and $3"])
    assert set(prose.numbers) == {"4", "2", "3"} and list(prose.maths) == ["$W = 7$"]
    # an English paragraph wraps a formula over two lines; the Chinese keeps it on one: the same math
    wrapped = read_prose(["bounded by $\\sqrt{1-\\beta_2}", "\\approx 3.2\\,\\mathrm{lr}$ each, at $5", "", "per$ 6"])
    one = read_prose(["以 $\\sqrt{1-\\beta_2} \\approx 3.2\\,\\mathrm{lr}$ 为界"], chinese=True)
    assert wrapped.maths == one.maths and "3.2" not in wrapped.numbers
    assert {"5", "6"} <= set(wrapped.numbers)  # a blank line ends a paragraph: no formula across it


@pytest.mark.parametrize("name, old, new, expected", [
    pytest.param("README.zh.md", "./course run 99", "./course run 98", "code block 1 differs from the English", id="code-block-changed"),
    pytest.param("README.zh.md", "```bash\n./course run 99\n# ## not a heading\n```\n", "", "0 code blocks, the English has 1", id="code-block-dropped"),
    pytest.param("README.zh.md", "输出 0.5 和", "输出一半和", "(### 你应该看到): number 0.5 of the English is missing", id="number-missing"),
    pytest.param("README.zh.md", "1.2 万", "1.3 万", "section 2 (## 思路): number 12000 of the English is missing", id="wan-wrong"),
    pytest.param("README.zh.md", "143 520", "143 52", "number 143520 of the English is missing", id="thousands-space"),
    pytest.param("README.zh.md", "损失为", "全减少损失为", "uses '全减少', a rejected variant of 'all-reduce'", id="glossary-rejected"),
    pytest.param("README.zh.md", "### 你应该看到\n", "", "3 sections, the English has 4", id="section-missing"),
    pytest.param("README.zh.md", "### 你应该看到", "## 你应该看到", "section 4 (## 你应该看到): heading level 2, the English", id="heading-level"),
    pytest.param("README.zh.md", "![曲线](figures/curve.png)", "", "images [] differ from the English's ['figures/curve.png']", id="image-dropped"),
    pytest.param("README.zh.md", "`torchrun --nproc-per-node 2`", "torchrun", "inline code 'torchrun --nproc-per-node 2' of the English is missing", id="inline-code-missing"),
    pytest.param("README.zh.md", "$L/W$", "L/W", "math '$L/W$' of the English is missing", id="math-missing"),
    pytest.param("README.zh.md", "(../ch98_prev/README.md)", "(../ch97_prev/README.md)", "link to ../ch98_prev/README.md of the English is missing", id="link-changed"),
    pytest.param("README.zh.md", "../ch01_overview/README.md", "../ch01_overview/README.zh.md", "README.zh.md, which does not exist", id="link-to-missing-zh"),
    pytest.param("README.zh.md", "[English](README.md) · 中文\n", "", "line 2 must be", id="zh-switch-missing"),
    pytest.param("README.zh.md", "输出 0.5 和", "**输出：**0.5 和", "(### 你应该看到): emphasis not rendered", id="bold-before-cjk"),
    pytest.param("lesson.zh.md", "跑 1000 步。", "跑 *1000 步（默认）*后停。", "cell 0 section 1 (# 第 99 章 · 假的): emphasis not rendered", id="italic-after-punctuation"),
    pytest.param("README.md", "Two ranks run", "Two ranks now run", "section 2 (## 思路): stale stamp en: ", id="english-edited-stale-stamp"),
    pytest.param("lesson.py", "Runs 2 ranks", "Runs 4 ranks", "lesson.zh.md cell 0: stale stamp", id="english-cell-edited-stale-stamp"),
    pytest.param("lesson.zh.md", "跑 1000 步", "跑 100 步", "lesson.zh.md cell 0 section 1 (# 第 99 章 · 假的): number 1000", id="cell-number-missing"),
    pytest.param("lesson.zh.md", "<!-- cell 1 en:", "<!-- cell 2 en:", "want <!-- cell N en: ... --> for N = 0..1", id="cell-misnumbered"),
])
def test_each_rule_reports_what_broke_it(chapter, name, old, new, expected):
    found = problems_after(chapter, name, old, new)
    assert expected in found, found


def test_stamp_refuses_until_the_sections_line_up(chapter):
    path = chapter / "README.zh.md"
    path.write_text(path.read_text().replace("### 你应该看到\n", ""))
    before = path.read_text()
    refused = bilingual.stamp(chapter, log=lambda *a: None)
    assert refused and "3 sections, the English has 4" in refused[0] and path.read_text() == before


def test_english_may_not_claim_a_chinese_twin_that_is_missing(chapter):
    (chapter / "README.zh.md").unlink()
    assert bilingual.check(chapter) == ["ch99 README.md: says 'English · [中文](README.zh.md)' "
                                        "but README.zh.md does not exist"]


def test_chinese_notebook_is_the_english_with_chinese_markdown(chapter, tmp_path):
    out = tmp_path / "nb"
    assert notebooks.write(chapter, out) == "wrote" and notebooks.write(chapter, out, zh=True) == "wrote"
    assert notebooks.write(chapter, out, zh=True) == "unchanged" and notebooks.stale(chapter, out) == []
    en = nbformat.read(notebooks.notebook_path(chapter, out), as_version=4)
    zh = nbformat.read(notebooks.zh_notebook_path(chapter, out), as_version=4)
    assert [c.cell_type for c in zh.cells] == [c.cell_type for c in en.cells]
    assert [c.source for c in zh.cells if c.cell_type == "code"] == ['print("hello")', "x = 16"]
    assert zh.cells[0].source.startswith("# 第 99 章") and zh.cells[2].source == "## 1. 内存：每个参数 16 字节"
    assert notebooks.looks_generated(notebooks.zh_notebook_path(chapter, out).read_text())
    (chapter / "lesson.zh.md").write_text(LESSON_ZH.replace("16 字节", "16 个字节"))
    assert notebooks.stale(chapter, out) == ["ch99_fake.zh.ipynb"]
    (chapter / "lesson.zh.md").unlink()
    assert notebooks.stale(chapter, out) == ["ch99_fake.zh.ipynb (no lesson.zh.md: delete it)"]


def test_cli_checks_and_refuses_to_stamp_what_has_no_chinese(chapter, capsys, monkeypatch):
    with pytest.raises(SystemExit, match="no chapter 'ch77x'"):
        bilingual.main(["check", "ch77x"])
    monkeypatch.setattr(bilingual, "REPO_ROOT", chapter.parents[1])  # the CLI finds ch99 in tmp_path
    (chapter / "README.zh.md").unlink()
    (chapter / "lesson.zh.md").unlink()
    english = chapter / "README.md"
    english.write_text(english.read_text().replace(EN_SWITCH + "\n", ""))
    assert bilingual.main(["stamp", "ch99"]) == 1
    assert "ch99: neither README.zh.md nor lesson.zh.md to stamp" in capsys.readouterr().err
    assert bilingual.main(["check", "99"]) == 0  # an English-only chapter is not a problem
    assert "0 problems in 99" in capsys.readouterr().err
