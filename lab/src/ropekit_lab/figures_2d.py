"""Figures over a 2-D grid (the report's multi-axis section): one heat map per scheme, PNG bytes per panel."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .figures import DPI, PANEL, png_bytes, styled


@styled
def score_map_figure(maps: Sequence[tuple[str, torch.Tensor]]) -> list[bytes]:
    """One panel per ``(title, (h, w) score map)``: the centre patch's score against every patch.

    Each panel has its own colour scale, from its lowest score to 1 (some schemes hardly vary on a
    small grid; a shared scale would show them flat).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = []
    for title, scores in maps:
        fig = Figure(figsize=(PANEL, PANEL * 0.92), dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        rows, cols = scores.shape
        image = ax.imshow(scores.numpy(), cmap="viridis", vmin=float(scores.min()), vmax=1.0, origin="upper",
                          extent=(-(cols // 2) - 0.5, cols // 2 + 0.5, rows // 2 + 0.5, -(rows // 2) - 0.5))
        ax.set_title(title)
        ax.set_xlabel("column offset from the centre (w)")
        ax.set_ylabel("row offset (h)")
        fig.colorbar(image, ax=ax, shrink=0.85, label="score / pairs")
        panels.append(png_bytes(fig))
    return panels
