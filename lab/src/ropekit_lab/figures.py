"""The report's figures: matplotlib, Agg canvas, returned as PNG bytes (no pyplot, no global backend).

Every function takes prepared float64 data (torch tensors or lists) and returns the PNG file's
bytes -- or a list of them, one per panel, for figures the page lays out side by side on a wide
screen and one under the other on a phone; the caller writes them (atomically) and supplies
the caption.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Sequence

import torch

WIDTH = 5.0  # inches; at DPI 120 a figure is 600 px wide, drawn at that size on a desktop, shrunk on a phone
DPI = 120
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
PANEL = 4.5  # inches (540 px): two panels side by side fill the page's 68rem column at their own size
#: mathtext of the terms of :func:`ropekit_lab.experiments.sinusoidal_terms`.
TERM_FORMULAS = {
    "content-content": r"$x_m^\top W x_n$",
    "content-position": r"$x_m^\top W p_n$",
    "position-content": r"$p_m^\top W x_n$",
    "position-position": r"$p_m^\top W p_n$",
    "total": r"$(x_m+p_m)^\top W (x_n+p_n)$",
}
REGIME_COLORS = {"extrapolated": "#1a7f37", "blended": "#bf8700", "interpolated": "#d1242f"}


#: The smallest text of any figure, in points. A phone draws a figure about 370 CSS px wide: a figure
#: :data:`WIDTH` inches wide shows it at ``SMALL_PT * 370 / (72 * WIDTH)`` = 9.8 px, a :data:`PANEL` at 10.8 px.
SMALL_PT = 9.5
#: Font sizes large enough to read on a phone (none under :data:`SMALL_PT`).
STYLE = {"font.size": 11.5, "axes.titlesize": 11.5, "axes.labelsize": 11.5, "xtick.labelsize": 10.5,
         "ytick.labelsize": 10.5, "legend.fontsize": SMALL_PT, "legend.framealpha": 0.85}


def styled(draw):
    """Run a figure function under :data:`STYLE` (a local rc context: global settings stay untouched)."""

    @functools.wraps(draw)
    def wrapper(*args, **kwargs):
        import matplotlib

        with matplotlib.rc_context(STYLE):
            return draw(*args, **kwargs)

    return wrapper


def new_figure(width: float = WIDTH, height: float = 3.6):
    """A one-axes figure on its own Agg canvas: ``(fig, ax)``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.grid(True, alpha=0.3, linewidth=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def png_bytes(fig) -> bytes:
    """The PNG file of ``fig`` at :data:`DPI`, as bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


@styled
def rotation_figure(inv_freq: torch.Tensor, n_positions: int = 9) -> list[bytes]:
    """A 2-D pair ``q = (1, 0.35)`` rotated by ``m * theta_i`` at ``n_positions`` positions: two panels.

    First: pair 0 (``theta_0 = 1`` rad/token, the fastest), ``m = 0, 1, 2, ...``. Second: the pair
    whose ``theta_i`` is closest to 0.1 rad/token, ``m = 0, s, 2s, ...`` with the step ``s``
    chosen so that the arrows spread over about 90 degrees.
    """
    from matplotlib import colormaps

    slow = int((inv_freq - 0.1).abs().argmin())
    q = complex(1.0, 0.35)
    panels = []
    for pair in (0, slow):
        fig, ax = new_figure(PANEL, 4.3)
        theta = float(inv_freq[pair])
        # a slow pair moves little per token: step the positions so that the arrows spread over ~90 degrees
        step = max(1, round(math.pi / 2 / (theta * (n_positions - 1))))
        ax.add_patch(_circle(abs(q)))
        for m in range(0, step * n_positions, step):
            z = q * complex(math.cos(m * theta), math.sin(m * theta))
            color = colormaps["viridis"](m / max(step * (n_positions - 1), 1))
            ax.annotate("", xy=(z.real, z.imag), xytext=(0, 0),
                        arrowprops={"arrowstyle": "-|>", "color": color, "lw": 1.8})
            _radial_label(ax, z, f"m={m}", color)
        ax.set_aspect("equal")
        ax.set_xlim(-1.6, 1.6)
        ax.set_ylim(-1.6, 1.6)
        ax.set_title(f"pair {pair}: θ = {theta:.3g} rad/token ({math.degrees(theta):.3g}° per token)")
        ax.set_xlabel("first channel of the pair")
        ax.set_ylabel("second channel of the pair")
        panels.append(png_bytes(fig))
    return panels


def _radial_label(ax, z: complex, text: str, color) -> None:
    """``text`` just beyond the tip of the arrow to ``z``, written along the arrow (readable side up)."""
    angle = math.degrees(math.atan2(z.imag, z.real)) % 360
    flip = 90 < angle < 270
    tip = z * 1.06
    ax.text(tip.real, tip.imag, text, color=color, fontsize=SMALL_PT, rotation=angle - 180 if flip else angle,
            rotation_mode="anchor", ha="right" if flip else "left", va="center")


def _circle(radius: float):
    from matplotlib.patches import Circle

    return Circle((0, 0), radius, fill=False, linestyle=":", color="#8c959f")


@styled
def decay_figure(curves: Sequence[tuple[str, torch.Tensor, torch.Tensor]], context: int | None = None) -> list[bytes]:
    """RoFormer's decay bound (Su et al. 2021, Figure 2) against relative distance: two panels.

    Args:
        curves: ``(label, distance (R,), bound (R,))`` per curve; the first panel shows
            distances up to 256 (as the paper's figure), the second all of them on a log axis.
        context: a vertical line at the context length (second panel), if given.
    """
    panels = []
    for far in (False, True):
        fig, ax = new_figure(PANEL, 3.5)
        for k, (label, distance, bound) in enumerate(curves):
            keep = distance >= 1 if far else distance <= 256
            ax.plot(distance[keep].tolist(), bound[keep].tolist(), color=COLORS[k], lw=0.8 if far else 1.2,
                    label=label)
        if far:
            ax.set_xscale("log")
            ax.set_title("all distances (log axis)")
            if context:
                ax.axvline(context, color="#57606a", ls="--", lw=1)
                ax.text(context, ax.get_ylim()[1], " context", va="top", fontsize=SMALL_PT)
        else:
            ax.set_title("distance 0..256, as in RoFormer's Figure 2")
        ax.set_xlabel("relative distance r = n - m")
        ax.set_ylabel(r"$\frac{1}{d/2}\sum_j |S_j|$")
        ax.legend()
        panels.append(png_bytes(fig))
    return panels


@styled
def wavelength_figure(
    theta: torch.Tensor,
    inv_freq: torch.Tensor,
    regimes: Sequence[str] | None,
    context: int,
    original: int | None = None,
) -> bytes:
    """Wavelength ``2 pi / theta_i`` per pair (log axis), unscaled and as configured, against the context."""
    fig, ax = new_figure(WIDTH, 3.6)
    pairs = list(range(len(theta)))
    ax.semilogy(pairs, (2 * math.pi / theta).tolist(), color="#8c959f", lw=1, marker=".", ms=3,
                label=r"unscaled $2\pi/\theta_i$")
    scaled = [2 * math.pi / f if f > 0 else math.nan for f in inv_freq.tolist()]
    if regimes:
        for name, color in REGIME_COLORS.items():
            idx = [i for i, r in enumerate(regimes) if r == name]
            if idx:
                ax.scatter(idx, [scaled[i] for i in idx], color=color, s=16, zorder=3, label=f"configured: {name}")
    elif not torch.equal(theta, inv_freq):
        ax.semilogy(pairs, scaled, color=COLORS[0], lw=1.2, marker=".", ms=3, label="configured")
    ax.axhline(context, color=COLORS[1], ls="--", lw=1)
    ax.text(0, context, f" context {context:,}", va="bottom", fontsize=SMALL_PT, color=COLORS[1])
    if original and original != context:
        ax.axhline(original, color=COLORS[3], ls=":", lw=1.2)
        ax.text(0, original, f" pre-training {original:,}", va="bottom", fontsize=SMALL_PT, color=COLORS[3])
    ax.set_xlabel("pair index i")
    ax.set_ylabel("wavelength (tokens)")
    ax.legend(loc="lower right")
    return png_bytes(fig)


@styled
def scaling_figure(rules: Sequence[tuple[str, torch.Tensor]], theta: torch.Tensor) -> list[bytes]:
    """Two panels: inv_freq per pair under each rule, and the interpolation ``theta_i / inv_freq_i``."""
    panels = []
    for ratio_panel in (False, True):
        fig, ax = new_figure(PANEL, 3.9)
        for k, (label, inv_freq) in enumerate(rules):
            pairs = list(range(len(inv_freq)))
            style = {"color": COLORS[k % len(COLORS)], "lw": 2.2 if k == 0 else 1.2, "label": label,
                     "ls": "-" if k < 5 else "--"}
            if ratio_panel:
                ratio = torch.where(inv_freq > 0, theta / inv_freq, torch.full_like(theta, math.nan))
                ax.plot(pairs, ratio.tolist(), **style)
            else:
                ax.semilogy(pairs, inv_freq.clamp_min(1e-300).tolist(), **style)
        if ratio_panel:
            ax.set_yscale("log")
            ax.set_ylabel(r"$\theta_i$ / inv_freq$_i$  (1 = kept)")
        else:
            ax.set_ylabel("inv_freq (rad/token)")
        ax.set_xlabel("pair index i")
        ax.legend()
        panels.append(png_bytes(fig))
    return panels


@styled
def attention_figure(
    distance: torch.Tensor,
    series: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
    theory: torch.Tensor | None = None,
    context: int | None = None,
) -> bytes:
    """Attention logit against relative distance: mean and +-1 std band per series, on a log axis.

    Args:
        distance: ``(R,)`` relative distances (>= 1).
        series: ``(label, mean (R,), std (R,))`` per series.
        theory: an expected curve to draw dashed (Men et al.'s ``2 B_r / sqrt(d)``), if given.
        context: a vertical line at the context length, if given.
    """
    fig, ax = new_figure(WIDTH, 3.6)
    x = distance.tolist()
    for k, (label, mean, std) in enumerate(series):
        ax.plot(x, mean.tolist(), color=COLORS[k], lw=1.1, label=label)
        ax.fill_between(x, (mean - std).tolist(), (mean + std).tolist(), color=COLORS[k], alpha=0.15, lw=0)
    if theory is not None:
        ax.plot(x, theory.tolist(), color="black", lw=0.9, ls="--", label=r"expected $2B_r/\sqrt{d}$ (Men et al.)")
    ax.axhline(0, color="#57606a", lw=0.8)
    if context:
        ax.axvline(context, color="#57606a", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("relative distance r")
    ax.set_ylabel(r"$q^\top R_r k\,/\sqrt{d}$")
    ax.legend()
    return png_bytes(fig)


@styled
def sinusoidal_figure(
    positions: torch.Tensor, terms: dict[str, torch.Tensor], rope: torch.Tensor, distance: int
) -> bytes:
    """The four terms of ``(x_m+p_m)^T W (x_n+p_n)`` and RoPE's single term against absolute position."""
    fig, ax = new_figure(WIDTH, 4.0)
    x = positions.tolist()
    for k, (name, values) in enumerate(terms.items()):
        label = f"{name}: {TERM_FORMULAS[name]}" if name in TERM_FORMULAS else name
        ax.plot(x, values.tolist(), color=COLORS[k], lw=1.0 if k < 4 else 1.6, label=label,
                ls=":" if k == 4 else "-")
    ax.plot(x, rope.tolist(), color="black", lw=2.2, label=r"RoPE: $(R_m W_q x_m)^\top (R_n W_k x_n)$")
    ax.set_xlabel(f"absolute position m (n = m + {distance})")
    ax.set_ylabel("score contribution")
    ax.legend(ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    return png_bytes(fig)


@styled
def margin_figure(positions: torch.Tensor, curves: Sequence[tuple[str, torch.Tensor]], context: int) -> bytes:
    """Men et al.'s ``B_m = sum_i cos(m theta_i)`` against ``m``: negative means similar tokens lose to random ones."""
    fig, ax = new_figure(WIDTH, 3.4)
    for k, (label, margin) in enumerate(curves):
        ax.plot(positions.tolist(), margin.tolist(), color=COLORS[k], lw=0.7, label=label, alpha=0.9)
    ax.axhline(0, color="black", lw=0.9)
    ax.axvline(context, color="#57606a", ls="--", lw=1)
    ax.set_xlabel("relative distance m (tokens)")
    ax.set_ylabel(r"$B_m = \sum_i \cos(m\theta_i)$")
    ax.legend()
    return png_bytes(fig)
