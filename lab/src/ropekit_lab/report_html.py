"""Minimal HTML building blocks for the report: escaped text, tables with their legends, captioned figures, the page.

The page is self-contained: inline CSS, no script, no external font, image or stylesheet;
images are PNG files next to ``index.html``, referenced by relative name.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

#: Where a table too wide for the screen stacks its rows (:func:`table`'s ``stack``): the widest viewport, in rem.
STACK_BELOW_REM = {"phone": 40, "tablet": 70}

_STACKED = (  # the rules of a stacked table inside its media query; {box} is its box's class
    ".{box} table,.{box} tbody{{display:block;width:100%}}.{box} thead{{display:none}}"
    ".{box} tr{{display:flex;flex-wrap:wrap;gap:.1rem 1.2rem;padding:.4rem .15rem;border-bottom:1px solid var(--line)}}"
    ".{box} td{{display:block;padding:0;border:0;text-align:left;white-space:nowrap}}"
    ".{box} td.text{{white-space:normal;min-width:0}}.{box} td:first-child{{flex-basis:100%;font-weight:600}}"
    ".{box} td:empty{{display:none}}"
    '.{box} td::before{{content:attr(data-label) ": ";font-weight:400;color:var(--muted)}}'
)

CSS = """
:root{color-scheme:light dark;--fg:#1f2328;--bg:#fff;--muted:#59636e;--line:#d1d9e0;--ok:#1a7f37;--bad:#d1242f;
--warn:#9a6700;--code:#eff2f5}
@media (prefers-color-scheme:dark){:root{--fg:#e6edf3;--bg:#0d1117;--muted:#9198a1;--line:#3d444d;--ok:#3fb950;
--bad:#f85149;--warn:#d29922;--code:#1f242c}}
*{box-sizing:border-box}
body{margin:0 auto;max-width:70rem;padding:1rem 1rem 3rem;font:16px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,
sans-serif;color:var(--fg);background:var(--bg);overflow-wrap:break-word}
h1{font-size:1.55rem;line-height:1.25;margin:.5rem 0}
h2{font-size:1.2rem;border-bottom:1px solid var(--line);padding-bottom:.2rem;margin-top:2.2rem}
p,li,dl.legend{max-width:48rem}
.muted{color:var(--muted);font-size:.9rem}
figure{margin:1rem 0}
img{max-width:100%;width:auto;height:auto;display:block;background:#fff;border:1px solid var(--line);border-radius:4px}
.panels{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,24rem),1fr));gap:.5rem;align-items:start}
figcaption{font-size:.9rem;color:var(--muted);margin-top:.35rem;max-width:48rem}
.scroll{overflow-x:auto;-webkit-overflow-scrolling:touch;margin:.3rem 0 1rem;max-width:100%}
table{border-collapse:collapse;font-size:.86rem;font-variant-numeric:tabular-nums}
th,td{border-bottom:1px solid var(--line);padding:.22rem .5rem;text-align:right;vertical-align:top}
td{white-space:nowrap}th{background:var(--code);font-weight:600;vertical-align:bottom}
th:first-child,td:first-child,.text,.str{text-align:left}td.text{white-space:normal}
.nw{white-space:nowrap}
table.kv{width:100%}table.kv td{text-align:left;white-space:normal;overflow-wrap:anywhere}
table.kv td:first-child{color:var(--muted);width:38%}
dl.legend{font-size:.86rem;color:var(--muted);margin:.4rem 0 .2rem}
dl.legend div{margin:.1rem 0}dl.legend dt{display:inline;font-weight:600;color:var(--fg)}
dl.legend dt::after{content:": "}dl.legend dd{display:inline;margin:0}
.ok{color:var(--ok);font-weight:600}.bad{color:var(--bad);font-weight:600}.warn{color:var(--warn);font-weight:600}
p.notice{border-left:3px solid var(--warn);padding:.3rem .7rem;background:var(--code)}
code{background:var(--code);padding:0 .25rem;border-radius:3px;font-size:.88em}
nav ol{columns:2;padding-left:1.4rem;margin:.3rem 0}
details{margin:.5rem 0}summary{cursor:pointer;color:var(--muted)}
@media (max-width:640px){body{font-size:15px;padding:.7rem .6rem 2rem}nav ol{columns:1}h1{font-size:1.3rem}
table{font-size:.8rem}th,td{padding:.2rem .3rem}}
""" + "".join(f"@media (max-width:{rem}rem){{{_STACKED.format(box=f'stack-{name}')}}}\n"
              for name, rem in STACK_BELOW_REM.items())


TEXT, STR = ' class="text"', ' class="str"'


def esc(value: Any) -> str:
    """``value`` as escaped HTML text."""
    return html.escape(str(value), quote=True)


def num(value: Any, digits: int = 4) -> str:
    """A compact number: integral values with thousands separators, others with ``digits`` significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value.is_integer() and abs(value) < 1e9:
            return f"{int(value):,}"
        if 1e3 <= abs(value) < 1e9:
            return f"{value:,.0f}"
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}"
    return esc(value)


def legend(name: str, terms: Sequence[tuple[str, str]], intro: str = "") -> str:
    """A ``<dl class="legend" id="{name}-legend">``, one line per ``(term, meaning)``; meaning and intro are HTML."""
    items = "".join(f"<div><dt>{esc(term)}</dt><dd>{meaning}</dd></div>" for term, meaning in terms)
    lead = f"<div>{intro}</div>" if intro else ""
    return f'<dl class="legend" id="{esc(name)}-legend">{lead}{items}</dl>'


def _breakable(header: str) -> str:
    """``header`` with a break opportunity after a slash between words (``theta/<wbr>inv_freq``, not ``GB/s``)."""
    return re.sub(r"(?<=\w{3})/(?=\w{3})", "/<wbr>", header)


def table(
    columns: Sequence[tuple[str, str]] | None,
    rows: Iterable[Sequence[Any]],
    *,
    name: str,
    terms: Sequence[tuple[str, str]] = (),
    intro: str = "",
    text_columns: Sequence[int] = (),
    cls: str = "",
    stack: str | None = None,
) -> str:
    """A table that says what its columns mean and shows every cell on a phone as on a desktop.

    ``columns`` are ``(header, meaning)`` pairs: the header row, and a :func:`legend` above the table
    listing each header with its meaning (HTML). A table without a header row (``columns=None``, a
    list of settings) explains its rows in ``terms`` instead; ``intro`` (HTML) leads the legend.
    ``name`` makes the ids (``{name}-legend``, referenced by ``aria-describedby``).

    Cells are numbers (formatted by :func:`num`, right-aligned, never broken) or raw HTML strings (the
    caller escapes text with :func:`esc`; left-aligned, as is the header of a column whose first cell
    is one). Cells do not wrap, except in ``text_columns``: prose that wraps at spaces.

    ``stack`` is for a table with more columns than a narrow screen shows: up to the width of a
    ``"phone"`` (40rem) or of a ``"tablet"`` (below a desktop's 70rem) each row becomes a block of
    ``header: value`` lines, its first cell on a line of its own and its empty cells left out (a
    ``None`` cell of such a table is empty, not ``-``); ``None``: the table fits every screen as a
    grid. The box around the table scrolls sideways only as a last resort.
    """
    if columns is None and not terms:
        raise ValueError(f"table {name!r}: a table without columns needs terms that explain its rows")
    if stack is not None and stack not in STACK_BELOW_REM:
        raise ValueError(f"table {name!r}: stack must be None or one of {sorted(STACK_BELOW_REM)}, got {stack!r}")
    if stack is not None and columns is None:
        raise ValueError(f"table {name!r}: a stacked table needs columns (their headers label the values)")
    rows = [list(row) for row in rows]
    head = ""
    if columns is not None:
        left = {i for i, cell in enumerate(rows[0] if rows else ()) if isinstance(cell, str)}
        cells = "".join(
            f"<th{TEXT if i in text_columns else STR if i in left else ''}>{_breakable(esc(h))}</th>"
            for i, (h, _) in enumerate(columns))
        head = f"<thead><tr>{cells}</tr></thead>"
    labels = [f' data-label="{esc(h)}"' for h, _ in columns] if stack is not None else []
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            kind = "text" if i in text_columns else "str" if isinstance(cell, str) else ""
            content = cell if isinstance(cell, str) else "" if cell is None and stack else num(cell)
            attrs = (f' class="{kind}"' if kind else "") + (labels[i] if i < len(labels) else "")
            cells.append(f"<td{attrs}>{content}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    ident = esc(name)
    table_cls = f' class="{cls}"' if cls else ""
    box = f'<div class="scroll stack-{stack}">' if stack else '<div class="scroll">'
    return (legend(name, list(columns or ()) + list(terms), intro)
            + f'{box}<table{table_cls} aria-describedby="{ident}-legend">{head}<tbody>{"".join(body)}</tbody>'
            "</table></div>")


def figure(sources: Sequence[str], caption: str, alt: str) -> str:
    """A ``<figure>`` with relative images (panels side by side, stacked on a narrow screen) and a caption.

    ``caption`` is HTML, ``alt`` plain text (numbered per panel when there are several).
    """
    images = "".join(
        f'<img src="{esc(src)}" alt="{esc(alt if len(sources) == 1 else f"{alt} ({k + 1} of {len(sources)})")}">'
        for k, src in enumerate(sources))
    if len(sources) > 1:
        images = f'<div class="panels">{images}</div>'
    return f"<figure>{images}<figcaption>{caption}</figcaption></figure>"


def drawn_figure(files: dict[str, bytes], can_plot: bool, name: str, draw: Callable[[], bytes | list[bytes]],
                 caption: str, alt: str) -> str:
    """Draw, keep the PNG(s) in ``files`` as ``name.png`` (or ``name-1.png``, ...) and return the ``<figure>``.

    Without matplotlib (``can_plot`` false; a dependency of the lab) nothing is drawn and the page
    says so in place of the figure.
    """
    if not can_plot:
        return (f'<p class="muted">[Figure left out: matplotlib is not installed; <code>pip install '
                f"matplotlib</code> draws it.] {caption}</p>")
    png = draw()
    panels = [png] if isinstance(png, bytes) else png
    names = [f"{name}.png"] if len(panels) == 1 else [f"{name}-{k + 1}.png" for k in range(len(panels))]
    files.update(zip(names, panels, strict=True))
    return figure(names, caption, alt)


def page(title: str, intro: str, sections: Sequence[tuple[str, str, str]], footer: str) -> str:
    """The whole document: ``sections`` are ``(id, title, body html)``."""
    nav = "".join(f'<li><a href="#{esc(sid)}">{esc(stitle)}</a></li>' for sid, stitle, _ in sections)
    body = "".join(f'<section id="{esc(sid)}"><h2>{esc(stitle)}</h2>{content}</section>'
                   for sid, stitle, content in sections)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        f"<header><h1>{esc(title)}</h1>{intro}</header>"
        f"<nav><ol>{nav}</ol></nav><main>{body}</main>"
        f'<footer><p class="muted">{footer}</p></footer></body></html>\n'
    )
