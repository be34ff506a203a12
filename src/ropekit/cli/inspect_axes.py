"""What ``ropekit inspect --json`` says about a multi-axis plan: each pair's axis, and wavelengths per axis."""

from __future__ import annotations

import math
from typing import Any

from ..rope.axes import AxisPlan


def axis_summary(plan: AxisPlan, context: int) -> dict[str, Any]:
    """JSON-ready description of a plan's axes.

    Args:
        plan: the :class:`ropekit.AxisPlan`.
        context: the extent (in position units) against which "completes a rotation" is counted.

    Returns:
        dict: ``names`` (axis names), ``pair_axis`` (the axis name of each pair), and ``per_axis``:
        per axis its ``pairs`` (count), ``pair_indices``, ``first_pair`` / ``last_pair``, whether its
        pairs are ``contiguous``, the shortest and longest wavelength (``wavelength_min`` /
        ``wavelength_max``, position units per turn; ``None`` for a zero frequency) and
        ``pairs_without_full_rotation`` within ``context``.
    """
    lengths = [2 * math.pi / f if f > 0 else math.inf for f in plan.inv_freq.tolist()]
    per_axis = []
    for a, name in enumerate(plan.axis_names):
        pairs = plan.pairs_on(a).tolist()
        waves = [lengths[j] for j in pairs]
        finite = [w for w in waves if math.isfinite(w)]
        per_axis.append({
            "name": name,
            "pairs": len(pairs),
            "pair_indices": pairs,
            "first_pair": pairs[0] if pairs else None,
            "last_pair": pairs[-1] if pairs else None,
            "contiguous": bool(pairs) and pairs == list(range(pairs[0], pairs[-1] + 1)),
            "wavelength_min": min(finite) if finite else None,
            "wavelength_max": max(finite) if len(finite) == len(waves) and finite else None,
            "pairs_without_full_rotation": sum(1 for w in waves if w > context),
        })
    return {
        "names": list(plan.axis_names),
        "pair_axis": [plan.axis_names[a] for a in plan.axis.tolist()],
        "per_axis": per_axis,
    }
