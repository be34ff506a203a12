"""``ropekit report``: one self-contained HTML page (plus PNG figures) about a RoPE configuration.

:func:`write_report` computes every section, renders the figures in memory, writes them and
``index.html`` into a temporary directory next to the output and moves each file into place
with :func:`os.replace`, ``index.html`` last: a reader never sees a half-written file, and an
error leaves the previous report as it was.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ropekit import base_inv_freq, files
from ropekit.cli.inspect_json import describe
from ropekit.rope.analysis import decay_bound, similarity_margin

from . import figures
from .experiments import attention_vs_distance, scaling_comparison, sinusoidal_terms
from .report_html import drawn_figure, esc, num, page, table
from .report_multiaxis import add_section as add_multiaxis_section
from .report_speed import speed_section

#: HTML of the terms of :func:`ropekit_lab.experiments.sinusoidal_terms`.
TERM_HTML = {
    "content-content": "x<sub>m</sub><sup>T</sup>W x<sub>n</sub>",
    "content-position": "x<sub>m</sub><sup>T</sup>W p<sub>n</sub>",
    "position-content": "p<sub>m</sub><sup>T</sup>W x<sub>n</sub>",
    "position-position": "p<sub>m</sub><sup>T</sup>W p<sub>n</sub>",
    "total": "(x<sub>m</sub>+p<sub>m</sub>)<sup>T</sup>W(x<sub>n</sub>+p<sub>n</sub>)",
}
MEN = "Men et al. 2024, <i>Base of RoPE Bounds Context Length</i>, arXiv:2405.14591"


def _sizes(quick: bool) -> dict[str, int]:
    """Problem sizes: ``--quick`` (tests, < 1 min on 2 slow cores) or the full report."""
    if quick:
        return {"samples": 64, "points": 160, "exact": 1 << 13, "sinusoidal": 256, "margin": 1 << 14}
    return {"samples": 512, "points": 600, "exact": 1 << 16, "sinusoidal": 1024, "margin": 1 << 17}


def _distances(limit: int, exact: int, points: int) -> torch.Tensor:
    """Every integer in ``[0, limit]`` if there are at most ``exact``, else ``0`` plus log-spaced integers."""
    if limit + 1 <= exact:
        return torch.arange(limit + 1)
    spaced = torch.logspace(0, torch.log10(torch.tensor(float(limit))), points * 8, dtype=torch.float64)
    return torch.cat([torch.arange(1), torch.arange(1, 257), spaced.round().to(torch.int64)]).unique()


class _Report:
    """Collects the sections, their PNG files and a JSON-ready summary."""

    def __init__(self, config: Any, label: str, quick: bool) -> None:
        self.config, self.label, self.quick = config, label, quick
        self.size = _sizes(quick)
        self.info = describe(config)
        self.context = self.info["context"]
        self.inv_freq = torch.tensor(self.info["inv_freq"], dtype=torch.float64)
        self.theta = torch.tensor(self.info["theta"], dtype=torch.float64)
        self.scaled = self.config.scaling is not None
        self.files: dict[str, bytes] = {}
        self.can_plot = importlib.util.find_spec("matplotlib") is not None
        self.sections: list[tuple[str, str, str]] = []
        self.summary: dict[str, Any] = {"config": {k: v for k, v in self.info.items() if not isinstance(v, list)},
                                        "figures": self.can_plot}

    def figure(self, name: str, draw: Callable[[], bytes | list[bytes]], caption: str, alt: str) -> str:
        """Draw, keep the PNG(s) as ``name.png`` (or ``name-1.png``, ...) and return the ``<figure>``.

        Without matplotlib (a dependency of the lab; ``ropekit report`` refuses to start without it) the page
        says so in place of the figure.
        """
        return drawn_figure(self.files, self.can_plot, name, draw, caption, alt)

    # -- sections -----------------------------------------------------------------------------------

    def rotation(self) -> None:
        slow = int((self.theta - 0.1).abs().argmin())
        caption = (
            "A 2-D pair <code>q = (1, 0.35)</code> rotated by <code>m&middot;&theta;<sub>i</sub></code>, one arrow "
            "per position m. First: pair 0, &theta;<sub>0</sub> = 1 rad/token, a full turn every 2&pi; &asymp; 6.3 "
            "tokens. "
            f"Second: pair {slow}, &theta;<sub>{slow}</sub> = {num(float(self.theta[slow]), 3)} rad/token. "
            "The score of q at m with k at n only sees the angle (n&minus;m)&theta;<sub>i</sub> between them: "
            "&lang;R<sub>m</sub>q, R<sub>n</sub>k&rang; = &lang;q, R<sub>n&minus;m</sub>k&rang;."
        )
        body = self.figure("rotation", lambda: figures.rotation_figure(self.theta), caption,
                           "arrows of a 2-D pair rotating with position")
        self.sections.append(("rotation", "A pair rotating with position", body))

    def wavelengths(self) -> None:
        info, context = self.info, self.context
        pre = info["pretraining"]
        bound = info["base_lower_bound"]
        text = [
            f"<p>{info['pairs']} rotary pairs. Wavelengths run from {num(info['wavelength'][0])} to "
            f"{num(info['wavelength'][-1])} tokens; <b>{info['pairs_without_full_rotation']} pairs never complete a "
            f"rotation</b> within the {num(context)}-token context"
        ]
        if pre:
            text.append(f" ({pre['pairs_without_full_rotation']} with the unscaled frequencies in the "
                        f"{num(pre['context'])}-token pre-training context)")
        text.append(".</p>")
        text.append(_bound_paragraph(info, bound))
        caption = ("Wavelength 2&pi;/&theta;<sub>i</sub> of each pair. A pair whose wavelength exceeds the context "
                   "never completes a rotation there: the model only ever sees part of its circle.")
        if info["regime"]:
            caption += (" Colours: the configured rule's regime per pair (extrapolated = kept, interpolated = "
                        "divided by the factor, blended = in between).")
        body = "".join(text) + self.figure(
            "wavelengths",
            lambda: figures.wavelength_figure(self.theta, self.inv_freq, info["regime"], context,
                                      pre["context"] if pre else None),
            caption, "wavelength per rotary pair on a log axis")
        columns = [("pair i", "index of the rotary pair: channels (i, i+d/2) in the half layout, (2i, 2i+1) "
                               "interleaved"),
                   ("theta_i (unscaled)", "base<sup>&minus;2i/d</sup>: radians per token before any scaling rule"),
                   ("inv_freq", "the configured frequency after the scaling rule, radians per token"),
                   ("wavelength (tokens)", "2&pi;/inv_freq: tokens per full turn of the pair"),
                   (f"rotations in {context:,}", "full turns the pair makes within the context")]
        rows = [[i, info["theta"][i], info["inv_freq"][i], info["wavelength"][i], info["rotations"][i]]
                for i in range(info["pairs"])]
        if self.scaled:
            columns.append(("theta/inv_freq", "how much the rule slows the pair down (1 = kept)"))
            rows = [row + [info["interpolation"][i]] for i, row in enumerate(rows)]
        if info["regime"]:
            columns.append(("regime", "the rule's treatment of the pair: extrapolated (kept), interpolated "
                                      "(divided by the factor) or blended (in between)"))
            rows = [row + [esc(info["regime"][i])] for i, row in enumerate(rows)]
        body += (f"<details><summary>Table per pair ({info['pairs']} rows)</summary>"
                 f"{table(columns, rows, name='pairs', stack='phone')}</details>")
        self.sections.append(("wavelengths", "Wavelengths per pair", body))

    def decay(self) -> None:
        distance = _distances(max(2 * self.context, 256), self.size["exact"], self.size["points"])
        curves = [(f"d={self.config.rotary_dim}, base {num(self.config.base)}", distance,
                   decay_bound(self.theta, distance))]
        if self.scaled:
            curves.append(("configured frequencies", distance, decay_bound(self.inv_freq, distance)))
        d2 = self.config.rotary_dim // 2
        caption = (
            "RoFormer's long-term decay bound (Su et al. 2021, eq. 37 and Figure 2): |&sum;<sub>i</sub> h<sub>i</sub> "
            "e<sup>i r &theta;<sub>i</sub></sup>| &le; (max<sub>i</sub>|h<sub>i+1</sub>&minus;h<sub>i</sub>|) "
            "&sum;<sub>j</sub>|S<sub>j</sub>|, S<sub>j</sub> = &sum;<sub>i&lt;j</sub> e<sup>i r &theta;<sub>i</sub>"
            f"</sup>; plotted: (1/(d/2)) &sum;<sub>j</sub>|S<sub>j</sub>|. At r = 0 it equals (d/2+1)/2 = "
            f"{num((d2 + 1) / 2)}. The dashed line is the context length."
        )
        self.summary["decay"] = {"at_0": float(curves[0][2][0]), "at_context": float(
            decay_bound(self.theta, torch.tensor([self.context]))[0])}
        body = self.figure("decay", lambda: figures.decay_figure(curves, self.context), caption,
                           "decay bound against relative distance")
        self.sections.append(("decay", "Long-term decay", body))

    def attention(self) -> None:
        limit = max(int(1.25 * self.context), 512)
        positions = (torch.arange(limit + 1) if limit + 1 <= self.size["margin"] else
                     torch.linspace(0, limit, self.size["margin"], dtype=torch.float64).round().to(torch.int64))
        curves = [(f"base {num(self.config.base)}", similarity_margin(self.theta, positions))]
        bound = (self.info["base_lower_bound"] or {}).get("base")  # None for axial plans (not one ladder)
        if bound:
            curves.append((f"base {num(bound, 3)} (Men et al. bound)",
                           similarity_margin(base_inv_freq(self.config.rotary_dim, bound), positions)))
        if self.scaled:
            curves.append(("configured frequencies", similarity_margin(self.inv_freq, positions)))
        body = self.figure(
            "similarity", lambda: figures.margin_figure(positions, curves, self.context),
            f"B<sub>m</sub> = &sum;<sub>i</sub> cos(m&theta;<sub>i</sub>) ({MEN}, Theorem 1): the expected logit gap "
            "between a similar key (k = q + &epsilon;) and a random key at distance m is 2&sigma;&sup2;B<sub>m</sub>. "
            "Where it is negative, a similar token gets less attention than a random one. The dashed line is the "
            "context length.", "similarity margin B_m against distance")
        distance = torch.logspace(0, torch.log10(torch.tensor(2.0 * self.context)), self.size["points"],
                                  dtype=torch.float64).round().to(torch.int64).unique()
        scores = attention_vs_distance(self.inv_freq, distance, samples=self.size["samples"],
                                       attention_scale=self.info["attention_scale"])
        series = [("aligned q = k", scores["aligned_mean"], scores["aligned_std"]),
                  ("random q, k", scores["random_mean"], scores["random_std"])]
        body += self.figure(
            "attention", lambda: figures.attention_figure(distance, series, scores["theory"], self.context),
            f"Attention logit q&middot;R<sub>r</sub>k/&radic;d against relative distance r for {self.size['samples']} "
            "draws of standard-normal q, k with the configured frequencies and attention scale: mean and &plusmn;1 "
            "std band. Aligned pairs (k = q) follow Men et al.'s expectation 2B<sub>r</sub>/&radic;d (dashed) and "
            "decay with distance; random pairs average to zero at every distance.",
            "attention logit against relative distance")
        self.sections.append(("attention", "Attention score vs relative distance", body))

    def scaling(self) -> None:
        comparison = scaling_comparison(self.config, self.context)
        rules = comparison["rules"]
        caption = (
            f"inv_freq per pair of this config (d = {self.config.rotary_dim}, base {num(self.config.base)}) under each "
            f"scaling rule at factor {num(comparison['factor'])} and original length {num(comparison['original'])} "
            "(second panel: the per-pair interpolation &theta;<sub>i</sub>/inv_freq<sub>i</sub>; 1 = kept). "
            "Linear divides every pair; NTK, dynamic NTK, YaRN and Llama 3 keep the fast pairs and slow down the "
            "slow ones.")
        panels = [(r["name"], r["inv_freq"]) for r in rules]
        body = self.figure("scaling", lambda: figures.scaling_figure(panels, self.theta), caption,
                           "inv_freq per pair per rule")
        rows = []
        for rule in rules:
            ratio = self.theta / rule["inv_freq"].clamp_min(1e-300)
            kept = int((ratio - 1).abs().lt(1e-9).sum())
            rows.append([esc(rule["name"]), rule["attention_scale"], rule["attention_scale"] ** 2, kept,
                         len(ratio) - kept, float(ratio.max())])
        body += table([("rule", "this config's own rule first, then each rule at the factor and original length "
                                "above"),
                       ("attention scale (cos, sin)", "the factor the rule multiplies cos and sin by"),
                       ("logit scale", "its square: the factor on every attention logit"),
                       ("pairs kept", "pairs whose frequency the rule leaves as it is"),
                       ("pairs changed", "pairs the rule slows down"),
                       ("max theta/inv_freq", "the largest slow-down of any pair")], rows, name="rules",
                      text_columns=(0,))
        self.summary["scaling"] = [{"name": r["name"], "attention_scale": r["attention_scale"]} for r in rules]
        self.sections.append(("scaling", "inv_freq under each scaling rule", body))

    def sinusoidal(self) -> None:
        distance = 8
        m, terms, rope = sinusoidal_terms(64, positions=self.size["sinusoidal"], distance=distance)
        caption = (
            "Why RoPE (Su's derivation): with an additive sinusoidal encoding the score "
            "(x<sub>m</sub>+p<sub>m</sub>)<sup>T</sup>W"
            "(x<sub>n</sub>+p<sub>n</sub>) splits into four terms. The same two tokens (random x, random W, d = 64) "
            f"are moved along the sequence at a fixed distance n &minus; m = {distance}: the cross terms and the "
            "total change with the absolute position, RoPE's single term (black) does not.")
        body = self.figure("sinusoidal", lambda: figures.sinusoidal_figure(m, terms, rope, distance), caption,
                           "four sinusoidal terms and RoPE's term against absolute position")
        rows = [[f"{esc(name)}: {TERM_HTML[name]}", float(v.min()), float(v.max()), float(v.max() - v.min())]
                for name, v in terms.items()]
        spread = float(rope.max() - rope.min())
        rows.append(["RoPE (R<sub>m</sub>W<sub>q</sub>x)<sup>T</sup>(R<sub>n</sub>W<sub>k</sub>x)", float(rope.min()),
                     float(rope.max()), spread])
        self.summary["sinusoidal"] = {"rope_spread": spread,
                                      "cross_term_spread": float(terms["content-position"].max()
                                                                 - terms["content-position"].min())}
        body += table([("term", "one term of the score of the two tokens; the last row is RoPE's single term"),
                       ("min over m", "its smallest value as the pair moves along the sequence (position m, fixed "
                                      "distance)"),
                       ("max over m", "its largest value over the same positions"),
                       ("spread (max - min)", "how much it depends on the absolute position: 0 for a purely "
                                              "relative score")], rows, name="terms",
                      text_columns=(0,))
        self.sections.append(("sinusoidal", "Sinusoidal PE: four terms vs RoPE's one", body))

    def checks(self) -> None:
        from .checks import run_all
        from .precision import bf16_error_comparison

        results = run_all()
        rows = [[esc(c.name), esc(c.claim), c.error, c.bound,
                 '<span class="ok">pass</span>' if c.passed else '<span class="bad">FAIL</span>'] for c in results]
        columns = [("check", "the name of the check in <code>ropekit_lab.checks</code>"),
                   ("claim", "the property, as the seeds state it"),
                   ("measured error", "the largest deviation measured now"),
                   ("bound", "the deviation the check allows (float32 rounding)"),
                   ("result", "pass when the measured error is within the bound")]
        body = ("<p>Each property the seeds prove, measured now on this machine (float32 kernels against "
                "float64 references).</p>" + table(columns, rows, name="checks", text_columns=(1,), stack="phone"))
        precision = {start: bf16_error_comparison(positions_start=start) for start in (20000, 1_000_000)}
        rows = [[num(start), 1e3 * p["ropekit_mean"], 1e3 * p["hf_mean"], 1e3 * p["floor_mean"], p["ratio_mean"]]
                for start, p in precision.items()]
        body += ("<p>bfloat16 RoPE (head_dim 128, base 10000, 256 positions) against a float64 rotation of the same "
                 "input: ropekit (float64 angles, float32 tables and math, one rounding) and the transformers recipe "
                 "(float32 angles, bf16 tables and math). The floor is the exact result rounded to bf16.</p>"
                 + table([("positions from", "the first of 256 consecutive positions"),
                          ("ropekit mean |err|", "mean absolute error of ropekit's bfloat16 output"),
                          ("transformers recipe", "the same for the transformers recipe"),
                          ("floor", "the error of the exact result rounded to bfloat16: no bfloat16 output does "
                                    "better"),
                          ("ratio", "ropekit's error / the recipe's (below 1: ropekit is closer)")], rows,
                         name="bf16", intro="Errors in units of 10<sup>&minus;3</sup>."))
        self.summary["checks"] = [c.as_dict() for c in results]
        self.summary["bf16_precision"] = {str(k): v for k, v in precision.items()}
        self.sections.append(("checks", "Properties checked live", body))

    def bench(self) -> None:
        rows, error = _bench_rows()
        self.summary["bench"] = rows
        if rows:
            body = speed_section(rows)
        else:
            body = ("<p>The benchmark is not available in this installation"
                    + (f" ({esc(error)})" if error else "") + ". Run <code>ropekit bench</code> where it is "
                    "installed; its speed table appears here once <code>ropekit_lab.bench</code> exists.</p>")
        self.sections.append(("bench", "Speed", body))

    def html(self, seconds: float) -> str:
        info = self.info
        rows = [["source", esc(self.label)], ["layout", esc(info["layout"])], ["head_dim", info["head_dim"]],
                ["rotary_dim", info["rotary_dim"]], ["base", info["base"]], ["rope type", esc(info["rope_type"])],
                ["attention scale (cos, sin)", info["attention_scale"]],
                ["context", esc(f"{info['context']:,} tokens ({info['context_source']})")]]
        for key, value in info["rope_parameters"].items():
            rows.append([esc(key), esc(f"{len(value)} values") if isinstance(value, list) else
                         (esc(value) if isinstance(value, (str, bool)) or value is None else value)])
        intro = ('<p class="muted">Rotary Position Embedding, seen from every side: every number and figure below '
                 "was computed on this machine by <code>ropekit report</code>.</p>"
                 + table(None, rows, name="config", cls="kv", terms=_config_terms(bool(info["rope_parameters"])),
                         intro="The configuration this page studies, one setting per row."))
        footer = (f"ropekit report{' --quick' if self.quick else ''}; {esc(platform.platform())}, torch "
                  f"{esc(torch.__version__)}, {seconds:.1f} s. Sources: Su et al., RoFormer, arXiv:2104.09864 "
                  f"and Su's blog derivation of RoPE; {MEN}.")
        return page(f"ropekit report \u2014 {self.label}", intro, self.sections, footer)


def _bound_paragraph(info: dict, bound: dict | None) -> str:
    if not bound:
        return ""
    base, needed = info["base"], bound["base"]
    verdict = ("not found below 1e15" if needed is None else
               f"{num(needed, 3)}: this base ({num(base)}) is " + ("above it" if base >= needed else "<b>below it</b>"))
    negative = info["similarity_negative_at"]
    return (f"<p>Base that a {num(bound['context'])}-token context needs ({MEN}): {verdict}. With the configured "
            "frequencies B<sub>m</sub> = &sum;cos(m&theta;<sub>i</sub>) "
            + (f"first turns negative at m = {num(negative)}." if negative is not None else
               "stays non-negative over the whole context.")
            + ' <span class="muted">Method: smallest base on a log grid (64 per decade, refined by bisection) with '
            "B<sub>m</sub> &ge; 0 for every integer m up to the context; the admissible bases are not an interval, "
            "so a finer grid can find a somewhat lower isolated base.</span></p>")


def _config_terms(has_parameters: bool) -> list[tuple[str, str]]:
    """What each row of the configuration table means (HTML)."""
    terms = [("source", "where the configuration comes from"),
             ("layout", "the pairing: half = channels (i, i+d/2) as transformers' <code>rotate_half</code>, "
                        "interleaved = (2i, 2i+1) as the paper"),
             ("head_dim", "channels per attention head"), ("rotary_dim", "channels rotated; the rest pass through"),
             ("base", "&theta;<sub>i</sub> = base<sup>&minus;2i/rotary_dim</sup>"),
             ("rope type", "the scaling rule (default: none)"),
             ("attention scale (cos, sin)", "the rule's factor on cos and sin"),
             ("context", "the tokens this page studies, and where that number comes from")]
    if has_parameters:
        terms.append(("further rows", "the scaling rule's own parameters, as the configuration gives them"))
    return terms


def _bench_rows() -> tuple[list[dict] | None, str | None]:
    """Rows of ``ropekit_lab.bench.run(quick=True)``, or ``(None, reason)``."""
    if importlib.util.find_spec("ropekit_lab.bench") is None:
        return None, None
    try:
        bench = importlib.import_module("ropekit_lab.bench")
        return [dict(row) for row in bench.run(quick=True)], None
    except Exception as exc:  # noqa: BLE001 -- an optional section must not lose the whole report
        return None, f"{type(exc).__name__}: {exc}"


def build(config: Any, label: str, *, quick: bool = False) -> tuple[str, dict[str, bytes], dict[str, Any]]:
    """Compute every section: ``(index.html text, {png name: bytes}, JSON-ready summary)``."""
    start = time.perf_counter()
    report = _Report(config, label, quick)
    for section in (report.rotation, report.wavelengths, report.decay, report.attention, report.scaling,
                    report.sinusoidal, lambda: add_multiaxis_section(report), report.checks, report.bench):
        section()
    seconds = time.perf_counter() - start
    report.summary["seconds"] = seconds
    return report.html(seconds), report.files, report.summary


def _check_replaceable(out: Path) -> None:
    """``out`` may be replaced only if it is missing or holds a previous report (index.html and PNGs)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir (--out) must be a directory, got the file {str(out)!r}")
    if out.is_dir():
        ours = {p.name for p in out.iterdir() if p.is_file() and (p.name == "index.html" or p.suffix == ".png")}
        foreign = sorted(p.name for p in out.iterdir() if p.name not in ours)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ValueError(f"out_dir (--out) {str(out)!r} holds files a report does not write ({shown}); the "
                             "report replaces the whole directory: choose an empty or new directory")


def write_report(out_dir: str | os.PathLike, config: Any, label: str, *, quick: bool = False) -> dict[str, Any]:
    """Build the report and write ``out_dir/index.html`` and its PNGs; returns the summary (+ ``index``).

    All or nothing (:mod:`ropekit.files`): the new report is built in a staging directory beside
    ``out_dir`` and swapped in with one atomic rename, so ``out_dir`` is always the old report or
    the new one, never a mix of the two, whenever the run is interrupted. An existing ``out_dir``
    must hold only a previous report (``index.html`` and PNG figures).
    """
    out = Path(out_dir)
    _check_replaceable(out)
    text, figures_png, summary = build(config, label, quick=quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    with files.staging_directory(out.parent) as stage:
        new = stage / "report"
        files.make_directory(new)
        for name, data in {**figures_png, "index.html": text.encode("utf-8")}.items():
            files.write_file(new / name, lambda path, data=data: path.write_bytes(data))
        files.replace_directory(new, out)
    summary["index"] = str((out / "index.html").resolve())
    return summary
