"""The report's multi-axis section: the score of the centre patch against every patch of a 2-D grid.

For unit query and key pairs (each pair ``(1, 0)``) the score ``<R(c) q, R(p) k> / pairs`` is the mean
of ``cos(angle_j(p) - angle_j(c))``: 1 at the centre, and a map whose shape shows what each scheme
can tell apart. Four schemes, each rotated through :func:`ropekit.apply_rotary` with its own tables:

- axial (RoPE-Axial, Heo et al. 2024, head_dim 64, base 100): half of the pairs see the row, half
  the column, so the map is a sum of a row profile and a column profile (a cross);
- RoPE-Mixed at its initial frequencies (one head): each pair sees a direction, so diagonals appear;
- M-RoPE with Qwen2-VL's contiguous sections (head_dim 128, base 1e6): the column gets the last,
  slowest pairs, so the map hardly changes along a row;
- M-RoPE with Qwen3-VL's interleave (same ladder): rows and columns share fast and slow pairs.

When the report's configuration is itself multi-axis, its own plan replaces the matching panel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ropekit import AxisPlan, apply_rotary
from ropekit.multiaxis import named_plan, patch_grid
from ropekit.nn import MixedRotaryEmbedding

from .report_html import esc, table

GRID = (33, 33)  # odd: the centre is a patch


def _plan_positions(plan: AxisPlan, grid: tuple[int, int]) -> torch.Tensor:
    """Positions of the grid for ``plan``: (h, w) for 2 axes; (0, h, w) for M-RoPE's (t, h, w) on one image."""
    rows_cols = patch_grid(grid)
    if plan.n_axes == 2:
        return rows_cols
    if plan.n_axes == 3:
        return torch.cat([torch.zeros(rows_cols.shape[0], 1, dtype=torch.int64), rows_cols], dim=1)
    raise ValueError(f"the 2-D score map needs a plan with 2 or 3 axes, got {plan!r}")


def score_map(cos: torch.Tensor, sin: torch.Tensor, grid: tuple[int, int], layout: str) -> torch.Tensor:
    """float64 ``grid`` map of ``<R(centre) q, R(p) k> / pairs`` for unit pairs, from ``(N, pairs)`` tables."""
    pairs = cos.shape[-1]
    unit = torch.zeros(2 * pairs)
    if layout == "half":
        unit[:pairs] = 1.0
    else:
        unit[0::2] = 1.0
    rotated = apply_rotary(unit.expand(cos.shape[0], -1).contiguous(), cos, sin, layout=layout).double()
    centre = (grid[0] // 2) * grid[1] + grid[1] // 2
    return (rotated @ rotated[centre] / pairs).reshape(grid)


def _schemes(config: Any) -> list[tuple[str, Callable[[], tuple[torch.Tensor, torch.Tensor]], str]]:
    """``(title, tables, layout)`` per panel; the configuration's own plan first when it has 2 or 3 axes."""
    def plan_tables(plan: AxisPlan) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        return lambda: plan.cos_sin(_plan_positions(plan, GRID))

    mixed = MixedRotaryEmbedding(64, 1, generator=torch.Generator().manual_seed(0))

    def mixed_tables() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            cos, sin = mixed.cos_sin(patch_grid(GRID, indexing="xy"))  # (heads = 1, N, pairs)
        return cos[0], sin[0]

    schemes = [
        ("axial (RoPE-Axial, base 100)", plan_tables(named_plan("rope-vit-axial")), "interleaved"),
        ("RoPE-Mixed (initial, one head)", mixed_tables, "interleaved"),
        ("M-RoPE, Qwen2-VL sections", plan_tables(named_plan("qwen2-vl")), "half"),
        ("M-RoPE, Qwen3-VL interleave", plan_tables(named_plan("qwen3-vl", base=1e6)), "half"),
    ]
    axes = getattr(config, "axes", None)
    if axes is not None and axes.n_axes in (2, 3):
        schemes.insert(0, (f"this config ({', '.join(axes.axis_names)})", plan_tables(config.axis_plan()),
                           config.layout))
    return schemes


def add_section(report: Any) -> None:
    """Append the multi-axis section (figure panels, a table, summary numbers) to a ``_Report``."""
    from . import figures_2d

    maps = []
    for title, tables, layout in _schemes(report.config):
        cos, sin = tables()
        maps.append((title, score_map(cos, sin, GRID, layout)))
    rows, summary = [], []
    for title, scores in maps:
        asymmetry = float((scores - scores.flip(0).flip(1)).abs().max())  # S(c + d) = S(c - d)
        row_profile, col_profile = scores[GRID[0] // 2], scores[:, GRID[1] // 2]
        rows.append([esc(title), float(scores.min()), float(row_profile.min()), float(col_profile.min()), asymmetry])
        summary.append({"scheme": title, "min": float(scores.min()), "asymmetry": asymmetry})
    report.summary["multiaxis"] = summary
    caption = (
        f"Score of the centre patch against every patch of a {GRID[0]}&times;{GRID[1]} grid, "
        "&lang;R(c)q, R(p)k&rang; / pairs for unit q, k (1 at the centre; each panel its own colour scale, from "
        "its lowest score, given in the table, to 1). Axial RoPE adds a row and a column "
        "profile; RoPE-Mixed's learnable directions add diagonals; Qwen2-VL's contiguous sections give the "
        "column only the slowest pairs, so the map barely changes along a row; Qwen3-VL's interleave shares "
        "fast and slow pairs between rows and columns.")
    body = ""
    axes = getattr(report.config, "axes", None)
    if axes is not None:
        body += (f"<p>This configuration is multi-axis: positions are ({esc(', '.join(axes.axis_names))}) vectors "
                 "and each pair reads one axis (<code>ropekit inspect</code> lists them). The other sections treat "
                 "it as 1-D, a token moving along every axis at once: for M-RoPE that is a text token, for an "
                 "axial model a walk along the diagonal.</p>")
    body += report.figure("multiaxis", lambda: figures_2d.score_map_figure(maps), caption,
                         "score of the centre patch against every patch, per scheme")
    body += table([("scheme", "the rotary scheme of the panel"),
                   ("min score", "the lowest score on the grid"),
                   ("min along the centre row", "the lowest score of patches in the centre's row (moving along w)"),
                   ("min along the centre column", "the lowest score of patches in the centre's column (along h)"),
                   ("max |S(c+d) - S(c-d)|", "the score depends on the displacement only and is even in it: "
                                             "0 up to float32 rounding")],
                  rows, name="multiaxis", text_columns=(0,))
    report.sections.append(("multiaxis", "Multi-axis RoPE on a 2-D grid", body))
