"""The figure of ``ropekit decay --png``: the decay bound against distance, as PNG bytes (needs matplotlib)."""

from __future__ import annotations

import io

import torch

#: Font sizes large enough to read when the figure is shown at half its pixel width.
STYLE = {"font.size": 11.5, "axes.titlesize": 11.5, "axes.labelsize": 11.5, "xtick.labelsize": 10.5,
         "ytick.labelsize": 10.5, "legend.fontsize": 9.5, "legend.framealpha": 0.85}
DPI = 120


def decay_curve_figure(distance: torch.Tensor, bound: torch.Tensor, label: str) -> bytes:
    """One decay curve on a linear distance axis, as seed 001's Figure 2: the PNG file's bytes.

    Args:
        distance: relative distances ``r``, shape ``(n,)``.
        bound: :func:`ropekit.rope.analysis.decay_bound` at those distances, float64 ``(n,)``.
        label: the legend entry (``d`` and the base).
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.rc_context(STYLE):  # a local style: global settings stay untouched
        fig = Figure(figsize=(6.4, 3.6), dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        ax.grid(True, alpha=0.3, linewidth=0.6)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.plot(distance.tolist(), bound.tolist(), color="#1f77b4", lw=1.0, label=label)
        ax.set_xlabel("relative distance r = n - m")
        ax.set_ylabel(r"$\frac{1}{d/2}\sum_j |S_j|$")
        ax.set_title(r"RoFormer long-term decay bound, $S_j = \sum_{i<j} e^{\mathrm{i} r \theta_i}$")
        ax.legend()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()
