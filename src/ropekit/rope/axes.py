r"""Multi-axis RoPE: a position is a vector, and each rotary pair is tied to one axis and one frequency.

Vision, video and multimodal models give a token a position vector ``p = (p_0, ..., p_{A-1})``
(M-RoPE: ``(t, h, w)``; axial 2-D: ``(h, w)``; Flux: ``(index, h, w)``) and turn rotary pair ``j`` by

    angle_j = p[axis[j]] * inv_freq[j]                     (one axis, one frequency per pair)

An :class:`AxisPlan` holds ``inv_freq`` (float64, ``(pairs,)``) and ``axis`` (int, ``(pairs,)``)
plus the axes' names and the attention scale. Every scheme studied is one plan:

- :func:`mrope` -- Qwen2-VL / Qwen2.5-VL (``mrope_section`` splits the pairs into contiguous t, h,
  w runs) and Qwen3-VL (the same ladder, axes assigned pair by pair: ``interleaved=True``);
- :func:`axial` -- each axis its own sub-dimension and its own ladder ``base^(-2k/d_a)`` (Flux
  ``axes_dim``, HunyuanVideo ``rope_dim_list``, Wan, CogVideoX, EVA-02 / timm, rotary-embedding-torch
  ``get_axial_freqs``);
- :func:`axial_pixel` -- the "pixel" ladders ``pi * linspace(1, max_freq / 2, d_a / 2)`` (or
  log-spaced) for coordinates in ``[-1, 1]``;
- :func:`single_axis` -- today's 1-D RoPE as a one-axis plan (bit for bit the same tables).

The one scheme that does not fit is RoPE-Mixed (Heo et al. 2024), whose pairs turn by a dot
product ``p . f_j`` with learnable ``f_j``: :func:`matrix_angles` computes such angles, and
:class:`ropekit.nn.MixedRotaryEmbedding` owns the frequencies. Every scheme ends in the same
half-width float32 cos/sin tables (the pair order of the table is the kernel's pair index), so
``layout=`` alone picks the pairing and every kernel serves every scheme.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..validation import check_axis_positions, check_even_positive, check_positive_float
from .frequencies import NO_FLOAT64, base_inv_freq

#: Axis names given to a plan built without names, by number of axes.
DEFAULT_AXIS_NAMES = {1: ("position",), 2: ("h", "w"), 3: ("t", "h", "w")}


def default_axis_names(n_axes: int) -> tuple[str, ...]:
    """``("position",)``, ``("h", "w")``, ``("t", "h", "w")``, else ``("axis0", "axis1", ...)``."""
    return DEFAULT_AXIS_NAMES.get(n_axes, tuple(f"axis{a}" for a in range(n_axes)))


def _names(axis_names: Any) -> tuple[str, ...]:
    if isinstance(axis_names, str) or not isinstance(axis_names, Sequence):
        raise TypeError(f"axis_names must be a sequence of strings, got {axis_names!r}")
    names = tuple(axis_names)
    if not names or any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"axis_names must be distinct non-empty strings, at least one, got {axis_names!r}")
    return names


def _floats(values: Any, name: str) -> tuple[float, ...]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_complex():
            raise ValueError(f"{name} must be a 1-D real tensor (pairs,), got shape {tuple(values.shape)}")
        values = values.detach().to("cpu", torch.float64).tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a 1-D tensor or a sequence of numbers, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}[{i}] must be a finite number >= 0, got {v!r}")
        out.append(float(v))
    if not out:
        raise ValueError(f"{name} must not be empty (a plan rotates at least one pair)")
    return tuple(out)


def _axes(values: Any, n_axes: int) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(f"axis must be a 1-D integer tensor (pairs,), got {values.dtype} {tuple(values.shape)}")
        values = values.tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"axis must be a 1-D integer tensor or a sequence of ints, got {type(values).__name__}")
    out = []
    for j, a in enumerate(values):
        if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < n_axes:
            raise ValueError(f"axis[{j}] must be an int in [0, {n_axes}) (one of the {n_axes} axes), got {a!r}")
        out.append(a)
    return tuple(out)


def _rebuild(inv_freq: tuple, axis: tuple, axis_names: tuple, attention_scale: float) -> AxisPlan:
    return AxisPlan(inv_freq, axis, axis_names, attention_scale=attention_scale)


class AxisPlan:
    """Frozen multi-axis RoPE: pair ``j`` turns by ``positions[..., axis[j]] * inv_freq[j]``.

    Args:
        inv_freq: frequencies per pair (radians per unit of its axis), ``(pairs,)``, finite, ``>= 0``;
            kept in float64.
        axis: the axis each pair reads, ``(pairs,)`` ints in ``[0, len(axis_names))``.
        axis_names: one name per axis, in the order of the positions' last dimension
            (e.g. ``("t", "h", "w")``).
        attention_scale: factor folded into cos and sin (YaRN and friends), ``> 0``.

    The pair order is the kernel's pair index: pair ``j`` is channels ``(j, j + rotary_dim / 2)``
    with ``layout="half"`` and ``(2j, 2j + 1)`` with ``layout="interleaved"``. Plans are
    immutable, hashable and compare by value; :attr:`inv_freq` and :attr:`axis` return new tensors.
    """

    __slots__ = ("_inv_freq", "_axis", "axis_names", "attention_scale")

    def __init__(self, inv_freq: Any, axis: Any, axis_names: Sequence[str], *, attention_scale: float = 1.0) -> None:
        names = _names(axis_names)
        freq = _floats(inv_freq, "inv_freq")
        axes = _axes(axis, len(names))
        if len(freq) != len(axes):
            raise ValueError(f"inv_freq and axis must have one entry per pair, got {len(freq)} and {len(axes)}")
        set_ = object.__setattr__
        set_(self, "_inv_freq", freq)
        set_(self, "_axis", axes)
        set_(self, "axis_names", names)
        set_(self, "attention_scale", check_positive_float(attention_scale, "attention_scale"))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"AxisPlan is immutable (cannot set {name!r}); build a new one")

    def __reduce__(self) -> tuple:
        return _rebuild, (self._inv_freq, self._axis, self.axis_names, self.attention_scale)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AxisPlan):
            return NotImplemented
        return (self._inv_freq, self._axis, self.axis_names, self.attention_scale) == (
            other._inv_freq, other._axis, other.axis_names, other.attention_scale)

    def __hash__(self) -> int:
        return hash((self._inv_freq, self._axis, self.axis_names, self.attention_scale))

    def __repr__(self) -> str:
        counts = ", ".join(f"{n}: {c}" for n, c in zip(self.axis_names, self.counts, strict=True))
        scale = "" if self.attention_scale == 1.0 else f", attention_scale={self.attention_scale:g}"
        return f"AxisPlan(pairs={self.pairs}, axes=({counts}){scale})"

    # -- what the plan is ------------------------------------------------------------------------
    @property
    def inv_freq(self) -> torch.Tensor:
        """float64 ``(pairs,)`` on the CPU (a new tensor each time)."""
        return torch.tensor(self._inv_freq, dtype=torch.float64)

    @property
    def axis(self) -> torch.Tensor:
        """int64 ``(pairs,)`` on the CPU: the axis of each pair (a new tensor each time)."""
        return torch.tensor(self._axis, dtype=torch.int64)

    @property
    def n_axes(self) -> int:
        """Number of axes: the size of the positions' last dimension."""
        return len(self.axis_names)

    @property
    def pairs(self) -> int:
        """Number of rotary pairs (``rotary_dim // 2``)."""
        return len(self._axis)

    @property
    def rotary_dim(self) -> int:
        """Rotated channels per head: ``2 * pairs``."""
        return 2 * self.pairs

    @property
    def counts(self) -> tuple[int, ...]:
        """Pairs on each axis, in axis order."""
        return tuple(self._axis.count(a) for a in range(self.n_axes))

    def axis_index(self, name: str) -> int:
        """The index of the axis called ``name``."""
        if name not in self.axis_names:
            raise ValueError(f"no axis named {name!r}; this plan's axes are {self.axis_names}")
        return self.axis_names.index(name)

    def pairs_on(self, axis: int | str) -> torch.Tensor:
        """int64 indices of the pairs that read ``axis`` (an index or a name)."""
        a = self.axis_index(axis) if isinstance(axis, str) else axis
        return torch.tensor([j for j, b in enumerate(self._axis) if b == a], dtype=torch.int64)

    def freq_matrix(self) -> torch.Tensor:
        """float64 ``(n_axes, pairs)`` with ``inv_freq[j]`` in row ``axis[j]`` of column ``j``, zeros elsewhere.

        ``positions @ freq_matrix()`` are the angles: the form RoPE-Mixed generalises (any
        matrix, learned).
        """
        matrix = torch.zeros(self.n_axes, self.pairs, dtype=torch.float64)
        matrix[self.axis, torch.arange(self.pairs)] = self.inv_freq
        return matrix

    def with_frequencies(self, inv_freq: Any, attention_scale: float = 1.0) -> AxisPlan:
        """The same axis map with other frequencies (a scaling rule's, for instance)."""
        return AxisPlan(inv_freq, self._axis, self.axis_names, attention_scale=attention_scale)

    # -- tables -----------------------------------------------------------------------------------
    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """float64 ``(..., pairs)``: ``positions[..., axis[j]] * inv_freq[j]``.

        Args:
            positions: ``(..., n_axes)``, integer or floating, negative allowed, finite.

        Returns:
            float64 on ``positions.device`` (on the CPU for devices without float64, e.g. MPS).
        """
        check_axis_positions(positions, self.n_axes)
        device = positions.device
        work = device if device.type not in NO_FLOAT64 else torch.device("cpu")
        pos = positions.to(work, torch.float64)
        return pos.index_select(-1, self.axis.to(work)) * self.inv_freq.to(work)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` of shape ``positions.shape[:-1] + (pairs,)`` from float64 angles.

        The half-width tables :func:`ropekit.apply_rotary`, :func:`ropekit.apply_rotary_qk`,
        :func:`ropekit.rotate_qk` and every kernel take; ``attention_scale`` is folded into both.
        """
        angles = self.angles(positions)
        cos, sin = torch.cos(angles), torch.sin(angles)
        if self.attention_scale != 1.0:
            cos, sin = cos * self.attention_scale, sin * self.attention_scale
        return cos.to(torch.float32).to(positions.device), sin.to(torch.float32).to(positions.device)


def matrix_angles(positions: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Angles ``positions @ matrix`` in float64: any frequency matrix, learned ones included.

    Args:
        positions: ``(N, n_axes)`` (or ``(..., N, n_axes)``), integer or floating.
        matrix: ``(..., n_axes, pairs)``, e.g. RoPE-Mixed's per-head ``(heads, 2, pairs)``.

    Returns:
        float64 ``(..., N, pairs)``, differentiable with respect to ``matrix`` (and float
        ``positions``). With :meth:`AxisPlan.freq_matrix` it equals :meth:`AxisPlan.angles`.
    """
    if not isinstance(matrix, torch.Tensor) or matrix.dim() < 2 or not matrix.dtype.is_floating_point:
        shown = getattr(matrix, "shape", matrix)
        raise ValueError(f"matrix must be a floating tensor (..., n_axes, pairs), got {shown}")
    check_axis_positions(positions, matrix.shape[-2])
    return positions.to(torch.float64) @ matrix.to(torch.float64)


# -- builders ------------------------------------------------------------------------------------------
def single_axis(inv_freq: Any, *, attention_scale: float = 1.0, name: str = "position") -> AxisPlan:
    """1-D RoPE as a plan: every pair on one axis (positions ``(..., 1)``)."""
    freq = _floats(inv_freq, "inv_freq")
    return AxisPlan(freq, (0,) * len(freq), (name,), attention_scale=attention_scale)


def _section(section: Any) -> tuple[int, ...]:
    if isinstance(section, (str, bytes)) or not isinstance(section, Sequence) or not section:
        raise ValueError(f"mrope_section must be a non-empty list of ints, got {section!r}")
    for i, s in enumerate(section):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"mrope_section[{i}] must be an int >= 0, got {s!r} (in {list(section)})")
    return tuple(section)


def mrope(
    inv_freq: Any,
    section: Sequence[int],
    *,
    interleaved: bool = False,
    attention_scale: float = 1.0,
    axis_names: Sequence[str] = ("t", "h", "w"),
) -> AxisPlan:
    """Multimodal RoPE (M-RoPE): one frequency ladder, pairs assigned to the t, h, w axes.

    Args:
        inv_freq: the 1-D ladder (float64 ``(pairs,)``, plain or scaled, e.g. YaRN's).
        section: ``mrope_section``, pairs per axis, e.g. ``[16, 24, 24]``.
        interleaved: ``False`` (Qwen2-VL, Qwen2.5-VL): contiguous runs, pairs ``[0, s0)`` on t,
            the next ``s1`` on h, the next ``s2`` on w; the sections must add up to ``pairs``.
            ``True`` (Qwen3-VL): pair ``j`` is on h if ``j % 3 == 1 and j < 3 * s1``, on w if
            ``j % 3 == 2 and j < 3 * s2``, else on t -- transformers' rule exactly, ``s0``
            unused and the runs cut at ``pairs`` (so the counts can differ from ``section``).
        attention_scale: the scaling rule's factor on cos and sin.
        axis_names: names of the axes (as many as ``section`` has entries).
    """
    freq = _floats(inv_freq, "inv_freq")
    sections, names, pairs = _section(section), _names(axis_names), len(freq)
    if len(sections) != len(names):
        raise ValueError(f"mrope_section has {len(sections)} entries but there are {len(names)} axes {names}")
    if interleaved:
        if len(sections) != 3:
            raise ValueError(f"interleaved M-RoPE needs 3 sections (t, h, w), got {list(sections)}")
        axis = [0] * pairs
        for a in (1, 2):
            for j in range(a, min(3 * sections[a], pairs), 3):
                axis[j] = a
    else:
        if sum(sections) != pairs:
            raise ValueError(
                f"mrope_section {list(sections)} adds up to {sum(sections)} pairs, but the rotary dimension has "
                f"{pairs} pairs (rotary_dim // 2); the sections must cover every pair exactly"
            )
        axis = [a for a, s in enumerate(sections) for _ in range(s)]
    return AxisPlan(freq, axis, names, attention_scale=attention_scale)


def _per_axis(values: Any, n_axes: int, name: str) -> tuple[float, ...]:
    if isinstance(values, Sequence) and not isinstance(values, (str, bytes)):
        if len(values) != n_axes:
            raise ValueError(f"{name} must be one number or one per axis ({n_axes}), got {list(values)}")
        return tuple(check_positive_float(v, f"{name}[{a}]") for a, v in enumerate(values))
    return (check_positive_float(values, name),) * n_axes


def _dims(axes_dims: Any) -> tuple[int, ...]:
    if isinstance(axes_dims, (str, bytes)) or not isinstance(axes_dims, Sequence) or not axes_dims:
        raise ValueError(f"axes_dims must be a non-empty list of even ints (channels per axis), got {axes_dims!r}")
    return tuple(check_even_positive(d, f"axes_dims[{a}]") for a, d in enumerate(axes_dims))


def axial(
    axes_dims: Sequence[int],
    base: float | Sequence[float] = 10000.0,
    *,
    axis_names: Sequence[str] | None = None,
    attention_scale: float = 1.0,
) -> AxisPlan:
    """Axial RoPE: axis ``a`` owns ``axes_dims[a]`` channels and its own ladder ``base^(-2k/axes_dims[a])``.

    The pairs of axis 0 come first (``axes_dims[0] // 2`` of them), then those of axis 1, ...
    (the axial concatenation of Flux, HunyuanVideo, Wan, CogVideoX, timm and rotary-embedding-torch).

    Args:
        axes_dims: rotated channels per axis (even), e.g. Flux ``(16, 56, 56)``; they add up to rotary_dim.
        base: one base for every axis or one per axis.
        axis_names: default :func:`default_axis_names`.
        attention_scale: factor on cos and sin.
    """
    dims = _dims(axes_dims)
    bases = _per_axis(base, len(dims), "base")
    freq = torch.cat([base_inv_freq(d, b) for d, b in zip(dims, bases, strict=True)])
    axis = [a for a, d in enumerate(dims) for _ in range(d // 2)]
    names = default_axis_names(len(dims)) if axis_names is None else axis_names
    return AxisPlan(freq, axis, names, attention_scale=attention_scale)


def pixel_ladder(pairs: int, max_freq: float, *, spacing: str = "linear") -> torch.Tensor:
    """The "pixel" frequencies for coordinates in ``[-1, 1]``, float64 ``(pairs,)``.

    ``"linear"``: ``pi * linspace(1, max_freq / 2, pairs)`` (rotary-embedding-torch ``freqs_for="pixel"``,
    timm ``linear_bands=True``); ``"log"``: ``pi * 2 ** linspace(0, log2(max_freq) - 1, pairs)`` (timm's
    default ``pixel_freq_bands``).
    """
    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs <= 0:
        raise ValueError(f"pairs must be a positive int, got {pairs!r}")
    max_freq = check_positive_float(max_freq, "max_freq")
    if spacing == "linear":
        return torch.linspace(1.0, max_freq / 2, pairs, dtype=torch.float64) * math.pi
    if spacing == "log":
        return 2 ** torch.linspace(0.0, math.log2(max_freq) - 1, pairs, dtype=torch.float64) * math.pi
    raise ValueError(f"spacing must be 'linear' or 'log', got {spacing!r}")


def axial_pixel(
    axes_dims: Sequence[int],
    max_freq: float,
    *,
    spacing: str = "linear",
    axis_names: Sequence[str] | None = None,
) -> AxisPlan:
    """Axial RoPE with the pixel ladder of :func:`pixel_ladder` on every axis (positions in ``[-1, 1]``)."""
    dims = _dims(axes_dims)
    freq = torch.cat([pixel_ladder(d // 2, max_freq, spacing=spacing) for d in dims])
    axis = [a for a, d in enumerate(dims) for _ in range(d // 2)]
    return AxisPlan(freq, axis, default_axis_names(len(dims)) if axis_names is None else axis_names)
