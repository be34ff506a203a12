"""The backend contract: one object per set of kernels, one method per rotation form.

A backend rotates the first ``rotary_dim = 2 * cos.shape[-1]`` channels of each head vector by
``y1 = x1 c - x2 s, y2 = x2 c + x1 s`` (``s -> -s`` when ``conjugate``: rotation by ``-theta``,
the backward pass) in float32 (float64 for float64 inputs), rounded once to the input dtype;
channels past ``rotary_dim`` are copied (out of place) or left alone (in place). In place, the
inputs are rotated themselves and returned; out of place, new tensors with the inputs' shapes,
dtypes and (dense) strides are returned and the inputs are not touched.

Forms (:mod:`ropekit.ops.operators` calls them after validating every argument):

- ``rotate(x, cos, sin)``: tables of shape ``(..., rotary_dim // 2)`` with at most ``x.dim()``
  dims, right-aligned against ``x.shape[:-1]``, each axis 1 or x's size (broadcast; views with
  stride 0 are fine; :func:`ropekit.ops.eager.full_rank` gives them ``x.dim()`` dims);
- ``rotate_pair(q, k, cos, sin)``: q and k of one rank, tables fitting both (GQA: size 1 on
  the heads axis);
- ``rotate_positions(x, cos_table, sin_table, where)``: full ``(max_positions, rotary_dim // 2)``
  tables, rows looked up per token as :class:`ropekit.ops.positions.Positions` says;
- ``rotate_pair_positions(q, k, cos_table, sin_table, where)``.

Each takes the keywords ``layout`` (``"half"`` or ``"interleaved"``), ``conjugate`` and
``inplace``. A subclass must implement :meth:`Backend.rotate`; the other forms default to it
(two calls for a pair, an eager gather of the table rows for the by-position forms), so a new
backend can start with one kernel and add native forms one by one. Register it with
:func:`ropekit.ops.register`; it then gets autograd, ``torch.compile`` support and every public
entry point (``apply_rotary``, ``apply_rotary_qk``, ``rotate``, ``rotate_qk``) by name.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .positions import Positions


class Backend:
    """Base class of the kernels behind ``backend=<name>`` (see the module docstring)."""

    name = "backend"

    def is_available(self) -> bool:
        """Whether the kernels can run in this process (may build or import them; never raises)."""
        return True

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor, *, layout: str, conjugate: bool, inplace: bool) -> Tensor:
        """Rotate ``x`` of shape ``(..., head_dim)`` with broadcast tables (see the module docstring)."""
        raise NotImplementedError(f"backend {self.name!r} does not implement rotate")

    def rotate_pair(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, layout: str, conjugate: bool,
                    inplace: bool) -> tuple[Tensor, Tensor]:
        """Rotate q and k with the same broadcast tables; default: two :meth:`rotate` calls."""
        return (self.rotate(q, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace),
                self.rotate(k, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace))

    def rotate_positions(self, x: Tensor, cos_table: Tensor, sin_table: Tensor, where: Positions, *, layout: str,
                         conjugate: bool, inplace: bool) -> Tensor:
        """Rotate ``x`` by the table rows of its tokens; default: gather the rows, then :meth:`rotate`."""
        rows = where.table_rows(x)
        return self.rotate(x, _gather(cos_table, rows), _gather(sin_table, rows), layout=layout,
                           conjugate=conjugate, inplace=inplace)

    def rotate_pair_positions(self, q: Tensor, k: Tensor, cos_table: Tensor, sin_table: Tensor, where: Positions, *,
                              layout: str, conjugate: bool, inplace: bool) -> tuple[Tensor, Tensor]:
        """:meth:`rotate_positions` for q and k; default: gather once, then :meth:`rotate_pair`."""
        rows = where.table_rows(q)
        return self.rotate_pair(q, k, _gather(cos_table, rows), _gather(sin_table, rows), layout=layout,
                                conjugate=conjugate, inplace=inplace)

    def prepared(self, tensors: tuple[Tensor, ...], *, layout: str, inplace: bool):
        """A call ``run(*tensors)`` for tensors of exactly these shapes, strides, dtypes and devices.

        ``tensors`` is ``(x, cos, sin)`` (:meth:`rotate`) or ``(q, k, cos, sin)`` (:meth:`rotate_pair`).
        ``ropekit.functional`` keeps it for a signature that passed every check (a decode loop
        repeats one); a backend may return a leaner call than the default one here.
        """
        if len(tensors) == 3:
            def run(x, cos, sin):
                return self.rotate(x, cos, sin, layout=layout, conjugate=False, inplace=inplace)
        else:
            def run(q, k, cos, sin):
                return self.rotate_pair(q, k, cos, sin, layout=layout, conjugate=False, inplace=inplace)
        return run

    def __repr__(self) -> str:
        return f"<ropekit backend {self.name!r}>"


def _gather(table: Tensor, rows: Tensor) -> Tensor:
    """``table[rows]``: rows of shape ``(..., 1, ...)`` give tables of ``rows.dim() + 1`` dims."""
    return torch.index_select(table, 0, rows.reshape(-1)).reshape(*rows.shape, table.shape[-1])
