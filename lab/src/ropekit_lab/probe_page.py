"""The HTML page of ``ropekit probe``: the probe's JSON document as sections, tables and figures.

Built with the report's blocks (:mod:`ropekit_lab.report_html`: escaped text, tables that say what
their columns mean, captioned figures, one self-contained page) and passes the same headless
browser layout test as the report.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from . import probe_figures
from .report_html import drawn_figure, esc, num, page, table

PAPER = ("Barbero et al. 2024, <i>Round and Round We Go! What makes Rotary Positional Encodings useful?</i>, "
         "arXiv:2410.06205")


class _Page:
    def __init__(self, document: dict[str, Any], figures: bool) -> None:
        self.doc, self.files, self.sections = document, {}, []
        self.can_plot = figures and importlib.util.find_spec("matplotlib") is not None

    def figure(self, name: str, draw: Callable[[], bytes | list[bytes]], caption: str, alt: str) -> str:
        return drawn_figure(self.files, self.can_plot, name, draw, caption, alt)

    def pairing(self) -> None:
        pairing = self.doc["pairing"]
        loss = pairing["loss"]
        columns = [("evidence", "what was asked"), ("says", "the layout it points to (undecided: no verdict)"),
                   ("confidence", "weights: z over heads of the per-head log-likelihood ratio and the share of "
                                  "heads that agree; loss: the share of tokens predicted better and the paired z")]
        rows = [[esc("q/k weights as loaded"), esc(pairing["weights"]["layout"] or "undecided"),
                 esc(_weights_confidence(pairing["weights"]))]]
        if pairing["file_rows"]:
            rows.append([esc("q/k rows as the GGUF file stores them"),
                         esc(pairing["file_rows"]["layout"] or "undecided"),
                         esc(_weights_confidence(pairing["file_rows"]))])
        rows.append([esc(f"loss on the text: half {loss['half']:.4f}, interleaved {loss['interleaved']:.4f} "
                         "nats/token"), esc(loss["winner"]),
                     esc(f"{100 * loss['win_fraction']:.1f}% of {loss['tokens']} tokens, z = {loss['z']:+.1f}")])
        rows.append([esc("the model's config"), esc(pairing["config_layout"]), esc("what transformers rotates with")])
        agree = {True: "The weights and the loss agree.", False: "<b>The weights and the loss disagree.</b>",
                 None: "The weights alone do not decide; the loss does."}[pairing["agree"]]
        body = (f"<p>This model rotates its q/k in the <b>{esc(pairing['layout'])}</b> layout. {agree} The weights "
                "are asked with ropekit's detector (<code>ropekit.detect_layout</code>): in a trained RoPE model "
                "the norm of a q/k row grows or shrinks smoothly with the frequency of its pair, so reading the rows "
                "in the true pairing gives a smooth profile and the other pairing a scrambled one; each head votes, "
                "and the verdict needs |z| &ge; 3 and 75% of the heads. The loss is the confirmation: the same text, "
                "rotated in each layout.</p>"
                + table(columns, rows, name="pairing", text_columns=(0, 2)))
        body += self.figure(
            "pairing", lambda: probe_figures.pairing_figure(self.doc),
            "First: the k heads' mean log row norm per pair, the rows read as half (solid) and as interleaved "
            "(dotted). Read in their own layout the rows give a smooth curve; read in the other, a sawtooth or a "
            "jumble. (For a GGUF, the file's rows read interleaved are the model's rows read half: the same rows in "
            "another order, so the two curves coincide.) "
            "Second: each head's log-likelihood ratio of the two readings (its vote; &gt; 0 for half).",
            "row-norm profile under each reading, and the per-head votes")
        self.sections.append(("pairing", "Which pairing was this model trained with?", body))

    def energy(self) -> None:
        summary, tokens = self.doc["summary"], self.doc["text"]["tokens"]
        q, k = summary["slow_energy_share_q"], summary["slow_energy_share_k"]
        body = (f"<p>{summary['slow_pairs']} of {summary['pairs']} pairs never complete a rotation within the "
                f"{num(tokens)} tokens. They hold <b>{100 * q['mean']:.1f}%</b> of the q energy (heads from "
                f"{100 * q['min']:.0f}% to {100 * q['max']:.0f}%) and {100 * k['mean']:.1f}% of the k energy, "
                f"against {100 * summary['slow_pair_fraction']:.1f}% if every pair had the same.</p>")
        body += self.figure(
            "pair_norms", lambda: probe_figures.pair_norm_figure(self.doc),
            "Mean norm of each rotary pair of q and k before the rotation (the rotation keeps it), over tokens, heads "
            "and layers, against the pair's wavelength. Pairs right of the dashed line never complete a rotation "
            "within the text.", "mean pair norm against wavelength")
        self.sections.append(("energy", "Which frequencies carry the energy", body))

    def heads(self) -> None:
        kinds, threshold = self.doc["summary"]["head_kinds"], self.doc["positional_heads"]["threshold"]
        body = (f"<p>Of {sum(kinds.values())} heads: {kinds['previous-token']} previous-token and "
                f"{kinds['diagonal']} diagonal heads (mass above {threshold:g} at distance 1 or 0), {kinds['sink']} "
                f"that put more than half their attention on the first token, {kinds['other']} others.</p>")
        body += self.figure("heads", lambda: probe_figures.heads_figure(self.doc),
                            "Per layer and head: mean attention on the token itself, on the previous token (first "
                            "token excluded), and on the first token.", "layer by head heat maps")
        picks = self.doc["positional_heads"]
        rows = [[f"L{h['layer']} H{h['head']}", esc(kind), h["mass"], h["fast_share_prev_logit"], h["prev_fast_only"],
                 h["prev_slow_only"]] for kind, key in (("previous token", "previous_token"), ("diagonal", "diagonal"))
                for h in picks[key][:8]]
        if rows:
            body += table([("head", "layer and head"), ("kind", "what the head attends to"),
                           ("mass", "mean attention at its distance"),
                           ("fast share", "share of its previous-token logit from the fast pairs"),
                           ("prev, fast only", "previous-token mass with the slow pairs of q and k zeroed"),
                           ("prev, slow only", "previous-token mass with the fast pairs zeroed")], rows,
                          name="positional", stack="phone")
        body += self.figure("distance", lambda: probe_figures.distance_figure(self.doc),
                            "Mean attention against distance, the first token excluded (it collects attention "
                            "at every distance), for all heads and for the strongest positional heads.",
                            "attention against distance")
        self.sections.append(("heads", "Positional heads and attention by distance", body))

    def claims(self) -> None:
        verdict = {True: '<span class="ok">holds</span>', False: '<span class="bad">does not hold</span>',
                   None: '<span class="warn">not measured</span>'}
        rows = [[esc(c["claim"]), esc(c["measured"]), esc(c["rule"]), verdict[c["holds"]]] for c in self.doc["claims"]]
        body = (f"<p>The claims of {PAPER}, measured on this model and this text.</p>"
                + table([("claim", "as the paper states it for Gemma"), ("measured here", "the numbers"),
                         ("rule", "when the claim counts as holding here"), ("verdict", "the rule applied")], rows,
                        name="claims", text_columns=(0, 1, 2), stack="phone"))
        if self.doc["p_rope"]:
            body += self.figure("p_rope", lambda: probe_figures.p_rope_figure(self.doc),
                                "Loss on the text with only the fastest share p of the pairs rotated and the others "
                                "left as they are (p-RoPE, no training): p = 1 is the model as trained, p = 0 no "
                                "rotation at all.", "loss against the share of pairs rotated")
        self.sections.append(("claims", "The paper's claims, measured", body))

    def html(self) -> str:
        doc, model = self.doc, self.doc["model"]
        rows = [["model", esc(f"{model['class']} ({model['model_type']}), {model['parameters']:,} parameters")],
                ["source", esc(f"{model['source']}: {model['path']}")],
                ["geometry", esc(f"{model['layers']} layers, {model['heads']} query / {model['kv_heads']} key-value "
                                 f"heads, head_dim {model['head_dim']}, rotary_dim {model['rotary_dim']}")],
                ["rope", esc(f"base {num(model['base'])}, {model['rope_type']}")],
                ["text", esc(f"{doc['text']['tokens']} tokens of {doc['text']['source']}: "
                             f"\u201c{doc['text']['preview']}\u2026\u201d")]]
        intro = table(None, rows, name="probe", cls="kv", terms=[
            ("model", "the class transformers built and its size"), ("source", "where it was loaded from"),
            ("geometry", "attention heads and channels"), ("rope", "the base and scaling rule from its config"),
            ("text", "what the model read")], intro="What was probed.")
        seconds = ", ".join(f"{k} {v:.1f} s" for k, v in doc["seconds"].items())
        versions = ", ".join(f"{k} {esc(v)}" for k, v in doc["versions"].items())
        footer = (f"ropekit probe{' --quick' if doc['quick'] else ''}; {seconds}; {doc['threads']} thread(s); "
                  f"{versions}. Source of the claims: {PAPER}.")
        return page(f"ropekit probe \u2014 {model['class']}", intro, self.sections, footer)


def _weights_confidence(record: dict[str, Any]) -> str:
    z = record["z"]
    z_text = "z infinite" if z is None else f"z = {z:+.1f}"
    text = f"{z_text}, {100 * record['votes']:.0f}% of {record['heads']} heads agree"
    return text if record["decided"] else f"{text} ({record['reason']})"


def render(document: dict[str, Any], *, figures: bool = True) -> tuple[str, dict[str, bytes]]:
    """``(index.html text, {png name: bytes})`` of the probe's document."""
    built = _Page(document, figures)
    for section in (built.pairing, built.energy, built.heads, built.claims):
        section()
    return built.html(), built.files
