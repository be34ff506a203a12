"""Figures of ``ropekit probe`` (matplotlib on an Agg canvas, PNG bytes), in the report's style.

Each function takes the probe's JSON document (:mod:`ropekit_lab.probe`) and returns PNG bytes,
or a list of them for panels the page lays side by side on a wide screen and stacks on a phone.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .figures import COLORS, PANEL, new_figure, png_bytes, styled


@styled
def pair_norm_figure(document: dict[str, Any]) -> bytes:
    """Mean q and k pair norm (over layers, heads, tokens) against the pair's wavelength, context marked."""
    summary, rope, tokens = document["summary"], document["rope"], document["text"]["tokens"]
    fig, ax = new_figure(height=3.6)
    for k, role in enumerate(("q", "k")):
        norms = torch.tensor(document["heads"][f"{role}_pair_norm"], dtype=torch.float64)  # (layers, heads, P)
        per_layer = norms.mean(dim=1)
        ax.fill_between(rope["wavelength"], per_layer.min(dim=0).values.tolist(),
                        per_layer.max(dim=0).values.tolist(), color=COLORS[k], alpha=0.15, lw=0)
        ax.plot(rope["wavelength"], summary[f"pair_norm_{role}"], color=COLORS[k], marker="o", ms=3,
                label=f"{role}: mean over heads and layers (band: layer means)")
    ax.axvline(tokens - 1, color="#59636e", ls="--", lw=1, label=f"text length ({tokens} tokens)")
    ax.set_xscale("log")
    ax.set_xlabel("wavelength 2π/θᵢ of the pair (tokens, log axis): fast pairs left, slow right")
    ax.set_ylabel("mean pair norm √(xₐ² + x_b²)")
    ax.legend(loc="upper left")
    return png_bytes(fig)


@styled
def heads_figure(document: dict[str, Any]) -> list[bytes]:
    """Layer x head heat maps of the diagonal, previous-token and sink mass (three panels)."""
    heads = document["heads"]
    panels = []
    for key, title in (("diagonal", "diagonal: mass at distance 0"), ("previous_token", "previous token: distance 1"),
                       ("sink", "sink: mass on the first token")):
        values = torch.tensor(heads[key], dtype=torch.float64)
        fig, ax = new_figure(PANEL * 0.75, 4.0)
        ax.grid(False)
        image = ax.imshow(values.tolist(), aspect="auto", origin="lower", vmin=0, vmax=1, cmap="viridis",
                          interpolation="nearest")
        ax.set_title(title)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax, fraction=0.08)
        panels.append(png_bytes(fig))
    return panels


@styled
def distance_figure(document: dict[str, Any], top: int = 4) -> bytes:
    """Attention mass against distance (log-log): the mean over all heads and the strongest positional heads."""
    profiles = document["heads"]["attention_by_distance"]
    mean = document["summary"]["mean_attention_by_distance"]
    distance = list(range(len(mean)))
    fig, ax = new_figure(height=3.8)

    def plot(values, **style):
        ax.plot([d + 1 for d in distance], [max(v, 1e-6) for v in values], **style)

    plot(mean, color="black", lw=2, label="mean over all heads")
    picks = [(h["layer"], h["head"], "previous-token") for h in document["positional_heads"]["previous_token"][:top]]
    picks += [(h["layer"], h["head"], "diagonal") for h in document["positional_heads"]["diagonal"][:top]]
    for k, (layer, head, kind) in enumerate(picks):
        plot(profiles[layer][head], color=COLORS[k % len(COLORS)], lw=1, alpha=0.85,
             ls="-" if kind == "previous-token" else ":", label=f"L{layer} H{head} ({kind})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(bottom=1e-6)
    ax.set_xlabel("distance + 1 (tokens, log axis; 1 = the token itself)")
    ax.set_ylabel("mean attention (first token excluded)")
    ax.legend(fontsize=8, ncol=2, loc="lower left")
    return png_bytes(fig)


@styled
def pairing_figure(document: dict[str, Any]) -> list[bytes]:
    """The detector explained, for the model's rows and (GGUF) the file's rows: two panels.

    First: the k heads' mean log row norm per frequency index, the rows read in each layout
    (smooth under the true pairing, a sawtooth or a jumble under the other). Second: the
    per-head log-likelihood ratios (the votes).
    """
    pairing = document["pairing"]
    sources = [("model's rows", pairing["weights"])]
    if pairing.get("file_rows"):
        sources.append(("file's rows (GGUF)", pairing["file_rows"]))
    sources = [(label, record) for label, record in sources if "profile_k" in record]
    profile, ax = new_figure(PANEL, 3.6)
    for k, (label, record) in enumerate(sources):
        for reading, style in (("half", "-"), ("interleaved", ":")):
            ax.plot(record["profile_k"][reading], color=COLORS[k], ls=style, marker=".",
                    label=f"{label}, read {reading}")
    ax.set_xlabel("pair index i each reading gives the channel")
    ax.set_ylabel("mean ln ‖row‖ (k heads)")
    ax.legend(fontsize=8)
    votes, bx = new_figure(PANEL, 3.6)
    for k, (label, record) in enumerate(sources):
        llr = torch.tensor(record["llr"], dtype=torch.float64)
        limit = float(llr.abs().quantile(0.99))
        bx.hist(llr.clamp(-limit, limit).tolist(), bins=40, color=COLORS[k], alpha=0.6, label=label)
    bx.axvline(0, color="black", lw=1)
    bx.set_xlabel("per-head log-likelihood ratio (> 0: half)")
    bx.set_ylabel("heads")
    bx.legend(fontsize=8)
    return [png_bytes(profile), png_bytes(votes)]


@styled
def p_rope_figure(document: dict[str, Any]) -> bytes:
    """Loss against the share ``p`` of pairs rotated (p-RoPE without training)."""
    rows = document["p_rope"]["rows"]
    fig, ax = new_figure(height=3.2)
    ax.plot([r["p"] for r in rows], [r["loss"] for r in rows], marker="o", color=COLORS[0])
    for r in rows:
        ax.annotate(f"{r['rotated_pairs']} pairs", (r["p"], r["loss"]), textcoords="offset points", xytext=(4, 6),
                    fontsize=8)
    ax.set_xlabel("p: share of the pairs still rotated (the fastest ones)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_xlim(-0.05, 1.12)
    return png_bytes(fig)


def wavelength_label(wavelength: float) -> str:
    """``"6.3"`` / ``"1.2e+05"`` for tables."""
    return f"{wavelength:.3g}" if math.isfinite(wavelength) else "inf"
