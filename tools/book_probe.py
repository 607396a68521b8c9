"""What a reader's browser shows of the book, read from the page's DOM in headless Chromium once its
scripts ran (MathJax included), and what is wrong with it; tests/test_notebooks.py's book tests
use it.

    python tools/book_probe.py build/book index.html ch07_communication.html   # what each shows
    python tools/book_probe.py build/book index.html --no-cjk   # as on a machine without a CJK font

Chinese must render as glyphs, not as boxes: the probe takes the first run of Chinese characters
on the page and draws it in the font of the element that holds it, beside the same number of
U+0378 (an unassigned code point: every font draws its missing-glyph box). Where a CJK font
serves the text, each character's bitmap differs from the others' and from the box, and the run
is about one em wide per character; without one, every character is the same box.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from urllib.parse import unquote

PROBE_JS = r"""(function () {
  function glyphs() {  // the first run of Chinese on the page, drawn beside missing-glyph boxes
    var walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT, null), found = [];
    for (var n = walker.nextNode(); n; n = walker.nextNode()) {
      if (n.parentElement.closest("script, style, #course-probe")) continue;
      var m = n.nodeValue.match(/[\u4e00-\u9fff]{2,8}/);
      if (m) found.push([m[0], n.parentElement]);
    }
    if (!found.length) return null;
    var pick = found.filter(function (f) { return f[0].length >= 4; })[0] || found[0];
    var sample = pick[0], holder = pick[1], tofu = sample.replace(/./g, "\u0378");
    function width(text) {
      var s = document.createElement("span");
      s.style.whiteSpace = "pre"; s.textContent = text; holder.appendChild(s);
      var w = s.getBoundingClientRect().width; holder.removeChild(s); return w;
    }
    var style = getComputedStyle(holder), size = parseFloat(style.fontSize);
    var canvas = document.createElement("canvas"), ctx = canvas.getContext("2d");
    canvas.width = canvas.height = Math.ceil(size * 2);
    ctx.font = style.fontStyle + " " + style.fontWeight + " " + style.fontSize + " " + style.fontFamily;
    function bitmap(ch) {
      ctx.clearRect(0, 0, canvas.width, canvas.height); ctx.fillText(ch, 0, size * 1.5);
      return Array.prototype.join.call(ctx.getImageData(0, 0, canvas.width, canvas.height).data, "");
    }
    var chars = Array.from(new Set(sample)), maps = chars.map(bitmap), box = bitmap("\u0378");
    return {sample: sample, font: style.fontFamily, em: size, width: width(sample),
            tofu_width: width(tofu), chars: chars.length, distinct: new Set(maps).size,
            as_box: maps.filter(function (m) { return m === box; }).length,
            boxes_alike: box === bitmap("\u0379")};
  }
  function report() {
    var imgs = Array.prototype.slice.call(document.images);
    var broken = imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); })
                     .map(function (i) { return i.getAttribute("src"); });
    var walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT, null), raw = [];
    for (var n = walker.nextNode(); n; n = walker.nextNode()) {
      if (n.parentElement.closest("pre, code, script, style, textarea")) continue;
      if (/\\\(|\\\[|\$\$/.test(n.nodeValue)) raw.push(n.nodeValue.trim().slice(0, 60));
    }
    var header = document.querySelector("header.course-header");
    var next = document.querySelector("header.course-header a.next");
    var lang = document.querySelector("header.course-header .lang");
    var el = document.createElement("pre");
    el.id = "course-probe";
    el.textContent = JSON.stringify({
      images: imgs.length, broken: broken, raw_tex: raw.slice(0, 5),
      math: document.querySelectorAll(".mjx-chtml, .MathJax_CHTML").length,
      header: header ? header.textContent.replace(/\s+/g, " ").trim() : null,
      next: next ? next.getAttribute("href") : null,
      html_lang: document.documentElement.lang,
      lang: lang ? {text: lang.textContent.replace(/\s+/g, " ").trim(),
                    links: Array.prototype.map.call(lang.querySelectorAll("a"),
                                                    function (a) { return a.getAttribute("href"); })}
                 : null,
      glyphs: glyphs(),
      width: window.innerWidth, scroll_width: document.documentElement.scrollWidth});
    document.body.appendChild(el);
  }
  window.addEventListener("load", function () {
    if (window.MathJax && MathJax.Hub) MathJax.Hub.Queue(report); else report();
  });
})();
"""
DESKTOP, NARROW = "1280,900", "390,844"  # headless Chromium widens the narrow one to 500 px


def probe_page(browser: str, book_dir: Path, page: str, size: str, env: dict | None = None) -> dict:
    """Open `page` of the built book at a window `size` and return what PROBE_JS saw (`env`: the
    browser's environment, e.g. a FONTCONFIG_FILE)."""
    (book_dir / "_probe.js").write_text(PROBE_JS)
    probed = book_dir / f"_probe_{page}"
    probed.write_text((book_dir / page).read_text().replace(
        "</body>", '<script src="_probe.js"></script></body>', 1))
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--virtual-time-budget=15000", f"--window-size={size}", "--dump-dom",
                          probed.as_uri()], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **(env or {})}).stdout
    found = re.search(r'<pre id="course-probe">(.*?)</pre>', dom, re.S)
    assert found, f"{page} at {size}: the probe did not report (the page's scripts did not finish)"
    return json.loads(html.unescape(found.group(1)))


def glyph_problem(glyphs: dict | None) -> str | None:
    """None when the probe's Chinese run rendered as glyphs, else what it saw instead."""
    if not glyphs:
        return "no Chinese text on the page"
    g, n = glyphs, len(glyphs["sample"])
    if not g["boxes_alike"]:
        return f"two unassigned code points drew different boxes: cannot tell glyphs from boxes ({g})"
    if g["as_box"] or g["distinct"] < g["chars"]:
        return (f"{g['sample']!r} drew {g['as_box']} of {g['chars']} characters as the missing-glyph "
                f"box ({g['distinct']} distinct bitmaps; {g['width']:.0f} px wide, the boxes "
                f"{g['tofu_width']:.0f} px): no CJK font for {g['font']}")
    if not 0.8 * n * g["em"] <= g["width"] <= 1.2 * n * g["em"]:
        return f"{g['sample']!r} is {g['width']:.0f} px wide, not about {n} em of {g['em']:.0f} px"
    return None


@cache
def cjk_fonts() -> tuple[str, ...]:
    """The font families fontconfig has for Chinese (empty: no CJK font installed)."""
    try:
        out = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return ()
    return tuple(sorted({line.split(",")[0].strip() for line in out.splitlines() if line.strip()}))


def without_cjk_fonts(folder: Path) -> Path:
    """A fontconfig file (for FONTCONFIG_FILE) that sees this machine's fonts but the CJK ones:
    the machine as it is without fonts-noto-cjk. Returns its path."""
    def files(*query):
        out = subprocess.run(["fc-list", *query, "--format", "%{file}\n"], capture_output=True,
                             text=True).stdout
        return set(out.split())

    fonts = folder / "fonts"
    fonts.mkdir(parents=True, exist_ok=True)
    for i, path in enumerate(sorted(files() - files(":lang=zh"))):
        (fonts / f"{i:03d}_{Path(path).name}").symlink_to(path)
    conf = folder / "fonts.conf"
    conf.write_text(f'<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "fonts.dtd">\n<fontconfig>'
                    f"<dir>{fonts}</dir><cachedir>{folder / 'cache'}</cachedir></fontconfig>\n")
    return conf


def local_links(page: Path) -> list[str]:
    """The local href/src targets of an HTML page (no scheme, not a pure anchor)."""
    from html.parser import HTMLParser

    found = []

    class Links(HTMLParser):
        def handle_starttag(self, tag, attrs):
            for key, value in attrs:
                if key in ("href", "src") and value and not value.startswith("#") \
                        and not re.match(r"^[a-z][a-z0-9+.-]*:|^//", value, re.I):
                    found.append(value)

    Links().feed(page.read_text())
    return found


def missing_targets(root: Path) -> list[str]:
    """Every local link or image of every page under `root` whose target does not exist."""
    missing = []
    for page in sorted(root.glob("*.html")):
        for url in local_links(page):
            target = (page.parent / unquote(url.split("#")[0].split("?")[0])).resolve()
            if not target.exists():
                missing.append(f"{page.name}: {url}")
    return missing


def page_problems(out: Path, page: str, got: dict, done: dict) -> list[str]:
    """What is wrong with `page` as the probe saw it: images, raw TeX, next link, width, the
    language switch ('English · 中文' linking the twin page, or saying the Chinese is not yet
    written where the twin does not exist) and the page's lang, Chinese drawn as boxes."""
    where, problems = f"{page} at {got['width']} px", []
    if got["broken"]:
        problems.append(f"{where}: images not loaded: {got['broken'][:3]}")
    if got["raw_tex"] and done["mathjax"]:  # without MathJax they stay TeX
        problems.append(f"{where}: raw TeX left untypeset: {got['raw_tex'][:2]}")
    if got["next"] is None:
        problems.append(f"{where}: no next link in the header")
    if got["scroll_width"] > got["width"]:
        problems.append(f"{where}: the page is {got['scroll_width']} px wide, wider than the window")
    zh = ".zh." in page
    twin = page.replace(".zh.", ".", 1) if zh else page.replace(".", ".zh.", 1)
    lang, want = got["lang"], [twin] if (out / twin).exists() else []
    if not lang or not lang["text"].startswith("English · 中文") or lang["links"] != want:
        problems.append(f"{where}: language switch {lang} should read 'English · 中文' and link {want}")
    elif not want and "尚未写成" not in lang["text"]:
        problems.append(f"{where}: language switch {lang['text']!r} does not say the Chinese is not yet written")
    if got["html_lang"] != ("zh-CN" if zh else "en"):
        problems.append(f"{where}: <html lang={got['html_lang']!r}>")
    if cjk_fonts() and got["glyphs"] and glyph_problem(got["glyphs"]):
        problems.append(f"{where}: {glyph_problem(got['glyphs'])}")
    return problems


def main(argv: list[str] | None = None) -> int:
    import shutil
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("book", type=Path)
    parser.add_argument("pages", nargs="+")
    parser.add_argument("--size", default=DESKTOP)
    parser.add_argument("--no-cjk", action="store_true", help="hide the CJK fonts from the browser")
    args = parser.parse_args(argv)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("no chromium (./course setup --system)")
    with tempfile.TemporaryDirectory() as tmp:
        env = {"FONTCONFIG_FILE": str(without_cjk_fonts(Path(tmp)))} if args.no_cjk else None
        for page in args.pages:
            got = probe_page(browser, args.book, page, args.size, env)
            print(page, json.dumps(got, ensure_ascii=False))
            print(f"  Chinese: {glyph_problem(got['glyphs']) or 'renders as glyphs'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
