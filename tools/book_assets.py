"""What every page of the book carries: its style sheet, the header's style for the notebook
pages (whose own style is nbconvert's), the fonts, and MathJax, found in Debian's libjs-mathjax and copied
in, part by part, so that the book typesets its formulas offline (tools/book.py builds it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

MATHJAX_DIRS = (Path("/usr/share/javascript/mathjax"), Path("/usr/share/mathjax"))
MATHJAX_CONFIG = "TeX-AMS_CHTML-full,Safe"
# the parts of MathJax 2 that the CommonHTML output of TeX needs (about 10 MB of the 54 MB)
MATHJAX_PARTS = ("MathJax.js", f"config/{MATHJAX_CONFIG.split(',')[0]}.js", "config/Safe.js",
                 "extensions", "jax/input/TeX", "jax/output/CommonHTML", "jax/element",
                 "fonts/HTML-CSS/TeX/woff", "fonts/HTML-CSS/TeX/otf")

# Chinese needs a CJK font: Noto Sans CJK SC (Debian's fonts-noto-cjk, `./course setup --system`),
# WenQuanYi Micro Hei (fonts-wqy-microhei), macOS's PingFang SC, Windows' Microsoft YaHei. English
# pages put the system's Latin font first, Chinese pages (lang zh-CN) the CJK fonts first.
CJK_FONTS = '"Noto Sans CJK SC", "WenQuanYi Micro Hei", "PingFang SC", "Microsoft YaHei"'
FONTS = f"system-ui, {CJK_FONTS}, sans-serif"
FONTS_ZH = f"{CJK_FONTS}, system-ui, sans-serif"

STYLE = """
body { font-family: FONTS; max-width: 60rem; margin: 2rem auto; padding: 0 1rem;
       line-height: 1.5; color: #222; }
pre { background: #f6f8fa; padding: 0.8rem; overflow-x: auto; font-size: 0.85rem; }
code { font-family: ui-monospace, monospace; }
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: 0.2rem 0.5rem; }
img { max-width: 100%; } nav { margin: 1rem 0; font-size: 0.9rem; }
header.course-header { font-size: 0.9rem; border-bottom: 1px solid #ddd; padding-bottom: 0.3rem; }
header.course-header .book { font-weight: 600; }
/* a phone's width: wide tables, formulas and long words scroll or wrap inside the page */
table { display: block; max-width: 100%; overflow-x: auto; }
p, li { overflow-wrap: anywhere; }
.MJXc-display, .MathJax_Display { overflow-x: auto; overflow-y: hidden; }
details { background: #fafafa; border-left: 3px solid #ccc; padding: 0.2rem 0.8rem; margin: 0.5rem 0; }
html:lang(zh) body { font-family: FONTS_ZH; }
header.course-header .lang { float: right; }
""".replace("FONTS_ZH", FONTS_ZH).replace("FONTS", FONTS)
# lessons: mistune's math plugin has already turned $...$ into \\(...\\) and $$...$$ blocks
MATHJAX_SCRIPT = ("""<script type="text/x-mathjax-config">
MathJax.Hub.Config({tex2jax: {inlineMath: [['\\\\(','\\\\)']], displayMath: [['$$','$$']],
  processEscapes: true}, messageStyle: 'none'});
</script>\n""" + f'<script src="mathjax/MathJax.js?config={MATHJAX_CONFIG}"></script>')


def find_mathjax() -> Path | None:
    for d in MATHJAX_DIRS:
        if (d / "MathJax.js").exists():
            return d
    return None


def copy_mathjax(src: Path, book: Path) -> None:
    for part in MATHJAX_PARTS:
        s, d = src / part, book / "mathjax" / part
        if s.is_dir():
            shutil.copytree(s, d, dirs_exist_ok=True)
        elif s.exists():
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d)


HEADER_STYLE = ("header.course-header { font-family: FONTS; font-size: 0.9rem; "
                "max-width: 60rem; margin: 1rem auto; padding: 0 1rem 0.3rem; "
                "border-bottom: 1px solid #ddd; } header.course-header .book { font-weight: 600; } "
                "header.course-header .lang { float: right; } "
                "footer nav { font-family: FONTS; max-width: 60rem; margin: 1rem auto; padding: 0 1rem; } "
                # nbconvert's fonts, with the CJK ones for the Chinese notebooks' text
                ":root { --jp-content-font-family: FONTS; --jp-ui-font-family: FONTS; } "
                "html:lang(zh) { --jp-content-font-family: FONTS_ZH; --jp-ui-font-family: FONTS_ZH; } "
                "html:lang(zh) header.course-header, html:lang(zh) footer nav { font-family: FONTS_ZH; }"
                ).replace("FONTS_ZH", FONTS_ZH).replace("FONTS", FONTS)
