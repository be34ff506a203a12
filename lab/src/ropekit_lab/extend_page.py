"""The HTML page of ``ropekit extend``: the choice, the table of rules, and figures of where each rule breaks.

Built with the report's blocks (:mod:`ropekit_lab.report_html`) like the probe's page.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from .figures import new_figure, png_bytes, styled
from .report_html import drawn_figure, esc, num, page, table

SOURCES = ("Peng et al. 2023, <i>YaRN: Efficient Context Window Extension of Large Language Models</i>, "
           "arXiv:2309.00071; bloc97 2023, NTK-aware scaled RoPE; emozilla 2023, dynamically scaled RoPE; "
           "Chen et al. 2023, position interpolation, arXiv:2306.15595")


def _fmt(value: Any) -> str:
    return "\u2013" if value is None else f"{value:.4g}"


def _spread(cell: dict[str, Any] | None) -> str:
    if not cell or cell["ppl"] is None:
        return "\u2013"
    if cell["min"] is None or cell["min"] == cell["max"]:
        return _fmt(cell["ppl"])
    return f"{_fmt(cell['ppl'])} ({_fmt(cell['min'])}\u2013{_fmt(cell['max'])})"


@styled
def buckets_figure(document: dict[str, Any]) -> bytes:
    """Perplexity by position bucket, one line per rule; the trained context marked."""
    fig, ax = new_figure(height=3.8)
    for row in document["rules"]:
        xs = [(b["start"] + b["end"]) / 2 for b in row["buckets"] if b["ppl"] is not None]
        ys = [b["ppl"] for b in row["buckets"] if b["ppl"] is not None]
        ax.plot(xs, ys, marker="o", markersize=3, label=row["name"])
    ax.axvline(document["lengths"]["trained"], color="0.4", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("position in the window (tokens)")
    ax.set_ylabel("perplexity (log scale)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return png_bytes(fig)


@styled
def pairs_figure(document: dict[str, Any]) -> bytes:
    """Per pair: the largest angle at the target over the largest angle in training, one line per rule."""
    fig, ax = new_figure(height=3.6)
    first = document["rules"][0]["pairs"]
    slow = first["slow"]
    if slow:
        ax.axvspan(min(slow) - 0.5, max(slow) + 0.5, color="0.9", label="slow pairs")
    for row in document["rules"]:
        ratio = row["pairs"]["angle_ratio"]
        ax.plot(range(len(ratio)), ratio, linewidth=1.2, label=row["name"])
    ax.axhline(1.0, color="0.3", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("rotary pair (fast \u2192 slow)")
    ax.set_ylabel("max angle: target / training")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return png_bytes(fig)


class _Page:
    def __init__(self, document: dict[str, Any], figures: bool) -> None:
        self.doc, self.files, self.sections = document, {}, []
        self.can_plot = figures and importlib.util.find_spec("matplotlib") is not None

    def figure(self, name: str, draw: Callable[[], bytes | list[bytes]], caption: str, alt: str) -> str:
        return drawn_figure(self.files, self.can_plot, name, draw, caption, alt)

    def choice(self) -> None:
        choice, lengths = self.doc["choice"], self.doc["lengths"]
        params = ", ".join(f"{k}: {v!r}" for k, v in choice["rope_parameters"].items())
        body = (f"<p>For {esc(lengths['label'])}: <b>{esc(choice['rule'])}</b>. {esc(choice['reason'])}.</p>"
                f"<p>The rule: {esc(choice['criterion'])}.</p>"
                f"<p>In <code>config.json</code>: <code>rope_parameters</code> {{{esc(params)}}}, "
                f"<code>max_position_embeddings</code> {choice['max_position_embeddings']}.</p>")
        if choice["dropped"]:
            body += (f"<p>Left out for raising the trained-context perplexity beyond the tolerance: "
                     f"{esc(', '.join(choice['dropped']))}.</p>")
        if self.doc.get("written_config"):
            body += f"<p>Written: <code>{esc(self.doc['written_config'])}</code>.</p>"
        self.sections.append(("choice", "The choice", body))

    def rules(self) -> None:
        trained, target = self.doc["lengths"]["trained"], self.doc["lengths"]["target"]
        rows = [[esc(r["name"]), esc(_spread(r["trained"])), esc(_spread(r["target"])), esc(_spread(r["beyond"])),
                 esc(f"{r['passkey']['correct']}/{r['passkey']['total']}"),
                 len(r["pairs"]["beyond"]), len(r["pairs"]["compressed"]), esc(r["summary"])]
                for r in self.doc["rules"]]
        columns = [("rule", "the scaling rule"),
                   ("ppl at L", f"perplexity of the text tokens below the trained context ({trained}); in brackets "
                                "the lowest and highest over the windows"),
                   ("ppl at T", f"perplexity over the whole windows of {target} tokens"),
                   ("ppl beyond L", f"perplexity of the positions from {trained} to {target - 1}"),
                   ("passkey", "keys retrieved exactly / windows (one key per window, at its depth)"),
                   ("pairs beyond", "pairs that never turned once in training and now reach larger angles"),
                   ("pairs compressed", "pairs that turned in training whose frequency the rule lowers (coarser "
                                        "local order)"),
                   ("what it does", "the rule's parameters")]
        body = table(columns, rows, name="rules", text_columns=(0, 7), stack="tablet")
        body += self.figure("buckets", lambda: buckets_figure(self.doc),
                            "Perplexity of the text tokens in each position bucket of the windows, per rule; the "
                            "dashed line is the trained context. Where a line rises past it, the rule breaks. The "
                            "text itself is harder in some buckets than in others: compare rules within a bucket.",
                            "perplexity against position per rule")
        edges = self.doc["buckets"]
        spans = zip(edges[:-1], edges[1:], strict=True)
        columns = [("rule", "the scaling rule"),
                   *[(f"{a}\u2013{b - 1}", f"perplexity of the text tokens at positions {a} to {b - 1}")
                     for a, b in spans]]
        rows = [[esc(r["name"]), *[esc(_fmt(b["ppl"])) for b in r["buckets"]]] for r in self.doc["rules"]]
        body += table(columns, rows, name="buckets", text_columns=(0,), stack="tablet",
                      intro="Perplexity by position bucket (the numbers of the figure).")
        self.sections.append(("rules", "Every rule, measured", body))

    def pairs(self) -> None:
        first = self.doc["rules"][0]["pairs"]
        slow = first["slow"]
        body = (f"<p>{len(slow)} of {len(first['angle_ratio'])} pairs never complete a rotation within the "
                f"{self.doc['lengths']['trained']} trained tokens (pairs {esc(_ranges(slow))}): training showed "
                "them only part of the circle. A pair that turned at least once has seen every angle, so a longer "
                "sequence shows it nothing new; a slow pair pushed past its largest trained angle is out of "
                "distribution. The probe's rule interpolates exactly the slow pairs.</p>")
        rows = [[esc(r["name"]), esc(_ranges(r["pairs"]["beyond"]) or "none"),
                 esc(_ranges(r["pairs"]["compressed"]) or "none"), esc(_fmt(r["pairs"]["max_angle_ratio_slow"]))]
                for r in self.doc["rules"]]
        body += table([("rule", "the scaling rule"), ("beyond", "slow pairs past their trained angle"),
                       ("compressed", "fast pairs slowed by more than 1%"),
                       ("max ratio", "the slow pairs' largest angle at the target over the trained one")], rows,
                      name="pairs", text_columns=(0, 1, 2))
        body += self.figure("pairs", lambda: pairs_figure(self.doc),
                            "Per pair, the largest angle the target length reaches under each rule over the "
                            "largest angle training reached. Shaded: the slow pairs, which never complete a rotation "
                            "in training; above 1 there, angles the model never saw.",
                            "angle ratio per pair per rule")
        self.sections.append(("pairs", "Why: the pairs out of their trained range", body))

    def html(self) -> str:
        doc, model = self.doc, self.doc["model"]
        rows = [["model", esc(f"{model['class']} ({model['model_type']}), {model['parameters']:,} parameters")],
                ["source", esc(f"{model['source']}: {model['path']}")],
                ["rope", esc(f"base {num(model['base'])}, head_dim {model['head_dim']}, rotary_dim "
                             f"{model['rotary_dim']}")],
                ["lengths", esc(f"trained {doc['lengths']['trained']}, target {doc['lengths']['target']}")],
                ["text", esc(f"{doc['text']['windows']} window(s) of {doc['text'].get('source', 'text')}")]]
        intro = table(None, rows, name="extend", cls="kv", terms=[
            ("model", "the class transformers built"), ("source", "where it was loaded from"),
            ("rope", "its rotary embedding"), ("lengths", "trained context and target, tokens"),
            ("text", "what the model read")], intro="What was measured.")
        seconds = ", ".join(f"{k} {v:.1f} s" for k, v in doc["seconds"].items())
        versions = ", ".join(f"{k} {esc(v)}" for k, v in doc["versions"].items())
        footer = (f"ropekit extend{' --quick' if doc['quick'] else ''}; {seconds}; peak memory "
                  f"{doc['peak_rss_mb']:.0f} MiB; attention {esc(doc['attention'])}; {doc['threads']} thread(s); "
                  f"{versions}. Sources of the rules: {SOURCES}.")
        return page(f"ropekit extend \u2014 {model['class']}", intro, self.sections, footer)


def _ranges(indices: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``1-3, 7``."""
    out, start = [], None
    for k, i in enumerate(indices):
        if start is None:
            start = i
        if k + 1 == len(indices) or indices[k + 1] != i + 1:
            out.append(f"{start}" if start == i else f"{start}\u2013{i}")
            start = None
    return ", ".join(out)


def render(document: dict[str, Any], *, figures: bool = True) -> tuple[str, dict[str, bytes]]:
    """``(index.html text, {png name: bytes})`` of extend's document."""
    built = _Page(document, figures)
    for section in (built.choice, built.rules, built.pairs):
        section()
    return built.html(), built.files
