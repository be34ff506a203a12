"""The backend contract: one object per set of kernels, one method per rotation form.

A backend rotates the first ``rotary_dim = 2 * cos.shape[-1]`` channels of each head vector by
``y1 = x1 c - x2 s, y2 = x2 c + x1 s`` (``s -> -s`` when ``conjugate``: rotation by ``-theta``,
the backward pass) in float32 (float64 for float64 inputs), rounded once to the input dtype;
channels past ``rotary_dim`` are copied (out of place) or left alone (in place). In place, the
inputs are rotated themselves and returned; out of place, new tensors with the inputs' shapes,
dtypes and (dense) strides are returned and the inputs are not touched.

Forms, each method named like the public function and the ``torch.ops.ropekit`` operator of the
same form (:mod:`ropekit.ops.operators` calls them after validating every argument):

- ``apply_rotary(x, cos, sin)``: tables of shape ``(..., rotary_dim // 2)`` with at most ``x.dim()``
  dims, right-aligned against ``x.shape[:-1]``, each axis 1 or x's size (broadcast; views with
  stride 0 are fine; :func:`ropekit.ops.eager.full_rank` gives them ``x.dim()`` dims);
- ``apply_rotary_qk(q, k, cos, sin)``: q and k of one rank, tables fitting both (GQA: size 1 on
  the heads axis);
- ``rotate(x, cos_table, sin_table, where)``: full ``(max_positions, rotary_dim // 2)``
  tables, rows looked up per token as :class:`ropekit.ops.positions.Positions` says;
- ``rotate_qk(q, k, cos_table, sin_table, where)``;
- the fused forms ``rms_norm_rotary``, ``rms_norm_rotary_qk`` (RMSNorm + rotation),
  ``rms_norm_rotary_backward`` and ``rotate_into_cache`` (keys rotated, values copied, into
  KV-cache slots), whose defaults compose torch ops with the backend's ``apply_rotary``
  (:mod:`ropekit.ops.fused_eager`).

The rotation forms take the keywords ``layout`` (``"half"`` or ``"interleaved"``),
``conjugate`` and ``inplace``. A subclass must implement :meth:`Backend.apply_rotary`; the other
forms default to it (two calls for q and k, an eager gather of the table rows for the by-position
forms), so a new backend can start with one kernel and add native forms one by one. Register it
with :func:`ropekit.ops.register`; it then gets autograd, ``torch.compile`` support and every
public entry point (``apply_rotary``, ``apply_rotary_qk``, ``rotate``, ``rotate_qk``) by name.

A subclass written against the 0.x method names (``rotate`` for the broadcast form,
``rotate_pair``, ``rotate_positions``, ``rotate_pair_positions``, ``rms_norm_rotate``,
``rms_norm_rotate_pair``, ``rms_norm_rotate_backward``) still works for one release: each old
name it defines serves the new one, with one ``DeprecationWarning`` per name
(:data:`LEGACY_METHODS`).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from .._deprecation import warn_once
from . import fused_eager
from .positions import Positions

#: The 0.x method names a subclass may still define (one release), and the form each now serves.
LEGACY_METHODS = {
    "rotate_pair": "apply_rotary_qk",
    "rotate_positions": "rotate",
    "rotate_pair_positions": "rotate_qk",
    "rms_norm_rotate": "rms_norm_rotary",
    "rms_norm_rotate_pair": "rms_norm_rotary_qk",
    "rms_norm_rotate_backward": "rms_norm_rotary_backward",
}


class Backend:
    """Base class of the kernels behind ``backend=<name>`` (see the module docstring)."""

    name = "backend"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _adopt_legacy_methods(cls)

    def is_available(self) -> bool:
        """Whether the kernels can run in this process (may build or import them; never raises)."""
        return True

    def cannot_run(self, x: Tensor) -> str | None:
        """None when this backend's own kernels run ``x``; else what they take (for the error of an explicit name).

        Default: None (every tensor; a backend that falls back to another kernel says so here).
        """
        return None

    def apply_rotary(self, x: Tensor, cos: Tensor, sin: Tensor, *, layout: str, conjugate: bool,
                     inplace: bool) -> Tensor:
        """Rotate ``x`` of shape ``(..., head_dim)`` with broadcast tables (see the module docstring)."""
        raise NotImplementedError(f"backend {self.name!r} does not implement apply_rotary")

    def apply_rotary_qk(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, layout: str, conjugate: bool,
                        inplace: bool) -> tuple[Tensor, Tensor]:
        """Rotate q and k with the same broadcast tables; default: two :meth:`apply_rotary` calls."""
        return (self.apply_rotary(q, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace),
                self.apply_rotary(k, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace))

    def rotate(self, x: Tensor, cos_table: Tensor, sin_table: Tensor, where: Positions, *, layout: str,
               conjugate: bool, inplace: bool) -> Tensor:
        """Rotate ``x`` by the table rows of its tokens; default: gather the rows, then :meth:`apply_rotary`."""
        rows = where.table_rows(x)
        return self.apply_rotary(x, _gather(cos_table, rows), _gather(sin_table, rows), layout=layout,
                                 conjugate=conjugate, inplace=inplace)

    def rotate_qk(self, q: Tensor, k: Tensor, cos_table: Tensor, sin_table: Tensor, where: Positions, *,
                  layout: str, conjugate: bool, inplace: bool) -> tuple[Tensor, Tensor]:
        """:meth:`rotate` for q and k; default: gather once, then :meth:`apply_rotary_qk`."""
        rows = where.table_rows(q)
        return self.apply_rotary_qk(q, k, _gather(cos_table, rows), _gather(sin_table, rows), layout=layout,
                                    conjugate=conjugate, inplace=inplace)

    # -- the fused forms: defaults composed of torch ops and this backend's apply_rotary (ops/fused_eager.py) --
    def rms_norm_rotary(self, x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor, *, eps: float,
                        weight_offset: float, per_token: bool, layout: str, inplace: bool) -> Tensor:
        """RMSNorm of ``x`` then its rotation, rounded once (see :mod:`ropekit.ops.fused_eager`).

        The norm spans the last axis (``per_token=False``; ``weight`` ``(head_dim,)``) or the
        last two (``weight`` ``(heads, head_dim)``); ``weight`` None means gains of 1.
        Default: the norm in float32 with torch ops, then :meth:`apply_rotary` of the float32 result.
        """
        return fused_eager.norm_rotate(self, x, weight, cos, sin, eps=eps, weight_offset=weight_offset,
                                       per_token=per_token, layout=layout, inplace=inplace)

    def rms_norm_rotary_qk(self, q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None,
                           cos: Tensor, sin: Tensor, *, eps: float, weight_offset: float, per_token: bool,
                           layout: str, inplace: bool) -> tuple[Tensor, Tensor]:
        """:meth:`rms_norm_rotary` of q and k with their own weights; default: two calls."""
        options = dict(eps=eps, weight_offset=weight_offset, per_token=per_token, layout=layout, inplace=inplace)
        return (self.rms_norm_rotary(q, q_weight, cos, sin, **options),
                self.rms_norm_rotary(k, k_weight, cos, sin, **options))

    def rms_norm_rotary_backward(self, grad: Tensor, x: Tensor, weight: Tensor | None, cos: Tensor, sin: Tensor, *,
                                 eps: float, weight_offset: float, per_token: bool,
                                 layout: str) -> tuple[Tensor, Tensor | None]:
        """``(grad_x, grad_weight)`` of :meth:`rms_norm_rotary` (``grad_weight`` None without a weight)."""
        return fused_eager.norm_rotate_backward(self, grad, x, weight, cos, sin, eps=eps, weight_offset=weight_offset,
                                                per_token=per_token, layout=layout)

    def rotate_into_cache(self, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                          slots: Tensor | None, start: int, *, k_weight: Tensor | None, eps: float | None,
                          weight_offset: float, per_token: bool, block_size: int, layout: str,
                          k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
        """Write rotated keys (normalised first when ``eps`` is given) and the values into cache slots.

        Contiguous layout (``block_size == 0``): k, v ``(batch, kv_heads, seq, head_dim)`` go to
        ``[s, s + seq)`` of the caches' axis 2 with ``s = slots[b]`` (``start`` when ``slots`` is
        None; one start for every row when it has one element). Paged (``block_size > 0``): k, v
        ``(tokens, kv_heads, head_dim)``, caches ``(blocks, block_size, kv_heads, head_dim)``,
        token ``t`` at slot ``slots[t]``, skipped when negative. Slots outside the caches raise
        ValueError before anything is written. Default: rotate, then copy with indexing ops.

        FP8 caches (``float8_e4m3fn``, ``float8_e5m2``; the other cache may keep its input's dtype)
        come with float32 ``k_scale``/``v_scale`` of shape ``(kv_heads,)`` (a per-tensor scale
        expanded), and hold ``fp8(clamp(x / scale, -max, max))`` of the float32 rotated keys
        (values) (:mod:`ropekit.ops.fp8`). They are passed only for FP8 caches, so an override
        written before them keeps working for the other caches.
        """
        if k_scale is not None or v_scale is not None:
            fused_eager.rotate_scaled(self, k, v, cos, sin, k_cache, v_cache, slots, start, k_scale=k_scale,
                                      v_scale=v_scale, k_weight=k_weight, eps=eps, weight_offset=weight_offset,
                                      per_token=per_token, block_size=block_size, layout=layout)
            return
        k_rot = fused_eager.rotate_keys(self, k, cos, sin, k_weight=k_weight, eps=eps, weight_offset=weight_offset,
                                        per_token=per_token, block_size=block_size, layout=layout)
        fused_eager.write_slots(k_rot, v, k_cache, v_cache, slots, start, block_size)

    def prepared_cache_write(self, *, k_weight_given: bool, eps: float | None, weight_offset: float, per_token: bool,
                             block_size: int, layout: str, like: tuple = ()):
        """A call ``run(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight)`` of :meth:`rotate_into_cache`.

        ``ropekit.rotate_into_cache`` keeps it for a signature that passed every check (a decode
        loop repeats one; :mod:`ropekit.ops.prepared`); ``like`` holds that call's tensors
        ``(k, v, cos, sin, k_cache, v_cache, slots, k_weight)`` (the signature's shapes, strides,
        dtypes and devices). A backend may return a leaner call than this default; it must do
        what :meth:`rotate_into_cache` would do for such tensors.
        """
        def run(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight):
            self.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight=k_weight, eps=eps,
                                   weight_offset=weight_offset, per_token=per_token, block_size=block_size,
                                   layout=layout)

        return run

    def prepared_scaled_cache_write(self, *, k_weight_given: bool, eps: float | None, weight_offset: float,
                                    per_token: bool, block_size: int, layout: str, like: tuple = ()):
        """:meth:`prepared_cache_write` for FP8 caches; the call also takes ``k_scale, v_scale`` (last).

        ``like`` ends with the float32 ``(kv_heads,)`` scales (None for a cache that is not FP8), as
        :meth:`rotate_into_cache` takes them. The scales' values differ from call to call: the
        call checks them (finite and > 0) before writing anything, and raises ValueError otherwise
        (this default with one reduction per scale; a backend whose kernel checks them may return
        a leaner call).
        """
        def run(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight, k_scale, v_scale):
            for scale in (k_scale, v_scale):
                if scale is not None and not bool(torch.all(torch.isfinite(scale) & (scale > 0))):
                    raise ValueError("an FP8 scale must be finite and > 0")
            self.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, start, k_weight=k_weight, eps=eps,
                                   weight_offset=weight_offset, per_token=per_token, block_size=block_size,
                                   layout=layout, k_scale=k_scale, v_scale=v_scale)

        return run

    def prepared(self, tensors: tuple[Tensor, ...], *, layout: str, inplace: bool, conjugate: bool = False):
        """A call ``run(*tensors)`` for tensors of exactly these shapes, strides, dtypes and devices.

        ``tensors`` is ``(x, cos, sin)`` (:meth:`apply_rotary`) or ``(q, k, cos, sin)``
        (:meth:`apply_rotary_qk`); ``conjugate`` rotates by ``-theta`` (the public ``inverse=True``).
        ``ropekit.functional`` keeps it for a signature that passed every check (a decode loop
        repeats one); a backend may return a leaner call than the default one here.
        """
        if len(tensors) == 3:
            def run(x, cos, sin):
                return self.apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
        else:
            def run(q, k, cos, sin):
                return self.apply_rotary_qk(q, k, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
        return run

    def prepared_by_offset(self, tensors: tuple[Tensor, ...], *, seq_dim: int, layout: str, inplace: bool,
                           conjugate: bool = False):
        """A call ``run(*tensors, offset)`` of the by-position forms with one int offset, for tensors like these.

        ``tensors`` is ``(x, cos_table, sin_table)`` (:meth:`rotate`) or ``(q, k, cos_table, sin_table)``
        (:meth:`rotate_qk`); token ``t`` along ``seq_dim`` is rotated by row ``offset + t`` (by
        ``-theta`` with ``conjugate``). ``ropekit.rotate_qk`` (and :class:`ropekit.RotaryEmbedding`)
        keep it for a signature that passed every check, the offset checked against the tables on
        every call; a backend may return a leaner call than this default.
        """
        if len(tensors) == 3:
            def run(x, cos_table, sin_table, offset):
                where = Positions(None, None, offset, None, None, seq_dim)
                return self.rotate(x, cos_table, sin_table, where, layout=layout, conjugate=conjugate,
                                   inplace=inplace)
        else:
            def run(q, k, cos_table, sin_table, offset):
                where = Positions(None, None, offset, None, None, seq_dim)
                return self.rotate_qk(q, k, cos_table, sin_table, where, layout=layout, conjugate=conjugate,
                                      inplace=inplace)
        return run

    def __repr__(self) -> str:
        return f"<ropekit backend {self.name!r}>"


def prepared_call(backend: Backend, method: str, tensors: tuple[Tensor, ...], *, conjugate: bool, **options):
    """``backend.<method>(tensors, **options)`` (``prepared`` / ``prepared_by_offset``), by ``-theta`` if ``conjugate``.

    A subclass whose override predates the ``conjugate`` keyword keeps its lean call for rotations
    by ``+theta``; for ``conjugate=True`` it gets the base class's call, which runs its own forms.
    """
    bound = getattr(backend, method)
    if not conjugate:
        return bound(tensors, **options)
    try:
        takes = "conjugate" in inspect.signature(bound).parameters
    except (TypeError, ValueError):
        takes = False
    if takes:
        return bound(tensors, conjugate=True, **options)
    return getattr(Backend, method)(backend, tensors, conjugate=True, **options)


def _gather(table: Tensor, rows: Tensor) -> Tensor:
    """``table[rows]``: rows of shape ``(..., 1, ...)`` give tables of ``rows.dim() + 1`` dims."""
    return torch.index_select(table, 0, rows.reshape(-1)).reshape(*rows.shape, table.shape[-1])


# -- subclasses written against the 0.x method names (one release) ------------------------------------------
def _warn_legacy(old: str, new: str, stacklevel: int) -> None:
    spelled = "rotate(x, cos, sin, ...) as the broadcast form" if old == "rotate" else f"{old}(...)"
    warn_once(f"the Backend method {spelled}", f"{new}(...) (same arguments)", stacklevel=stacklevel)


def _is_broadcast_rotate(method) -> bool:
    """Whether ``rotate`` is the 0.x broadcast form ``rotate(self, x, cos, sin, *, ...)`` (no ``where``)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 4 and not any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _adopt_legacy_methods(cls: type) -> None:
    """Let ``cls``'s 0.x method names serve the new forms, with one DeprecationWarning per name.

    ``rotate`` with three tensors was the broadcast form: it becomes ``apply_rotary``, and
    ``cls.rotate`` then serves both the by-position form and the subclass's own 0.x calls
    ``self.rotate(x, cos, sin, ...)`` (told apart by the ``where`` argument).
    """
    own = dict(vars(cls))  # before the loop adds the new names
    for old, new in LEGACY_METHODS.items():
        if old in own:
            _warn_legacy(old, new, stacklevel=5)
            if new not in own:
                setattr(cls, new, own[old])
    if "rotate" in own and _is_broadcast_rotate(own["rotate"]):
        _warn_legacy("rotate", "apply_rotary", stacklevel=5)
        if "apply_rotary" not in own:
            cls.apply_rotary = own["rotate"]
        by_position = own.get("rotate_positions") or super(cls, cls).rotate

        def rotate(self, x, cos, sin, where=None, **options):
            if where is None:  # the subclass's own 0.x call of the broadcast form
                return self.apply_rotary(x, cos, sin, **options)
            return by_position(self, x, cos, sin, where, **options)

        rotate.__doc__ = Backend.rotate.__doc__
        cls.rotate = rotate


def _base_alias(old: str, new: str):
    default = getattr(Backend, new)

    def alias(self, *args, **kwargs):
        _warn_legacy(old, new, stacklevel=4)
        return default(self, *args, **kwargs)

    alias.__name__ = old
    alias.__doc__ = f"Deprecated: :meth:`{new}`'s default (a 0.x subclass's ``super().{old}(...)``)."
    return alias


for _old, _new in LEGACY_METHODS.items():
    if _old != "rotate_positions":  # Backend.rotate is that form's default itself
        setattr(Backend, _old, _base_alias(_old, _new))
