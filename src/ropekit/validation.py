"""Argument validation: the one module of checks every layer uses.

Every error names the argument, what was expected and what was given, so that a
caller can fix the call without reading ropekit's source. Three groups:

- tensors and options of the public functions (``check_layout``, ``check_positions``, ...);
- module constructor arguments (``positive_int``, ``resolve_head_dim``);
- the scaling rules' parameters (``check_number``, ``check_length``, ...), whose messages name
  the rule and the parameter by its Hugging Face key, so that a bad ``config.json`` can be fixed
  without reading ropekit's source.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

LAYOUTS = ("half", "interleaved")

#: The largest rotary or head dimension accepted (real models use 64 to 576): a dimension is the
#: size of every frequency vector and table row, so a typo such as ``2**33`` must fail before it
#: allocates.
MAX_ROTARY_DIM = 1 << 16

#: The largest absolute position (a multi-axis coordinate, a context or sequence length) accepted.
#: Angles ``m * theta_i`` are computed in float64, whose rounding error grows with ``m``: below
#: ``2**40`` (about 1.1e12 tokens) it stays under ``2**40 * 2**-53 = 2**-13`` radians; far above it
#: the angle is meaningless, and near 1e308 the table itself is NaN (``cos(inf)``).
MAX_POSITION = 1 << 40

#: The largest context-extension factor a scaling rule accepts (released configs use 2 to 64).
MAX_FACTOR = float(1 << 20)

#: The names people type for the two pairings, each mapped to ropekit's own.
LAYOUT_ALIASES = {
    "neox": "half",
    "gpt-neox": "half",
    "gpt_neox": "half",
    "rotate_half": "half",
    "gptj": "interleaved",
    "gpt-j": "interleaved",
    "gpt_j": "interleaved",
    "meta": "interleaved",
    "complex": "interleaved",
}
_LAYOUT_NAMES = {**{layout: layout for layout in LAYOUTS}, **LAYOUT_ALIASES}


def check_layout(layout: str, name: str = "layout") -> str:
    """The canonical name of ``layout``: ``"half"`` or ``"interleaved"``, or an alias of one (else ``ValueError``).

    Aliases (:data:`LAYOUT_ALIASES`): ``"neox"``, ``"gpt-neox"``, ``"rotate_half"`` mean ``"half"``;
    ``"gptj"``, ``"gpt-j"``, ``"meta"``, ``"complex"`` mean ``"interleaved"``. Callers use the
    returned name, never the one they were given.
    """
    try:
        canonical = _LAYOUT_NAMES.get(layout)
    except TypeError:  # unhashable
        canonical = None
    if canonical is None:
        raise ValueError(f"{name} must be one of {LAYOUTS} (or an alias: {', '.join(map(repr, LAYOUT_ALIASES))}), "
                         f"got {layout!r}")
    return canonical


# -- tensor formats: the order of q/k's axes, named --------------------------------------------------

#: ``tensor_format`` name -> (number of dims, sequence axis). ``b`` batch, ``h`` heads, ``s`` sequence,
#: ``t`` packed tokens of variable-length sequences (with ``cu_seqlens``), ``d`` head_dim.
TENSOR_FORMATS = {
    "bhsd": (4, 2),  # transformers
    "bshd": (4, 1),  # flash-attention, TransformerEngine, timm/ViT after the head split
    "sbhd": (4, 0),  # Megatron, TransformerEngine
    "thd": (3, 0),   # packed: flash-attention varlen, vLLM, TransformerEngine
}
_FORMAT_AXES = {"b": "batch", "h": "heads", "s": "seq", "t": "tokens", "d": "head_dim"}


def spell_format(tensor_format: str) -> str:
    """``"bshd"`` -> ``"(batch, seq, heads, head_dim)"``."""
    return "(" + ", ".join(_FORMAT_AXES[c] for c in tensor_format) + ")"


def formats_with_seq_len(shape: tuple[int, ...], length: int) -> list[str]:
    """The tensor formats of ``len(shape)`` dims whose sequence axis has ``length`` entries in ``shape``."""
    return [f for f, (ndim, axis) in TENSOR_FORMATS.items() if ndim == len(shape) and shape[axis] == length]


def format_hint(shape: tuple[int, ...], length: int) -> str:
    """`` "; if x is (batch, seq, heads, head_dim) pass tensor_format='bshd'"`` when such a format fits, else ``""``."""
    fits = formats_with_seq_len(tuple(shape), length)
    return "".join(f"; if it is {spell_format(f)} pass tensor_format={f!r}" for f in fits)


def resolve_seq_dim(ndim: int, tensor_format: str | None, seq_dim: int | None, *, name: str = "q",
                    default: int | None = None) -> int:
    """The sequence axis of a ``ndim``-D q/k named by ``tensor_format`` or ``seq_dim``.

    ``tensor_format`` (one of :data:`TENSOR_FORMATS`) must describe ``ndim`` dims and gives its
    sequence axis (a non-negative int); ``seq_dim`` given alone is returned as given (its range is
    checked where it is used). Both given: they must name one axis. Neither: ``default``, or a
    ``TypeError`` when there is none (the caller must name the order).
    """
    if tensor_format is not None:
        try:
            described = TENSOR_FORMATS.get(tensor_format)
        except TypeError:
            described = None
        if described is None:
            raise ValueError(f"tensor_format must be one of {tuple(TENSOR_FORMATS)}, got {tensor_format!r}")
        want, axis = described
        if ndim != want:
            raise ValueError(f"tensor_format={tensor_format!r} describes {want}-D {name} "
                             f"{spell_format(tensor_format)}, got {name} with {ndim} dims")
        if seq_dim is not None and (isinstance(seq_dim, bool) or not isinstance(seq_dim, int)
                                    or not -ndim <= seq_dim < ndim or seq_dim % ndim != axis):
            raise ValueError(f"seq_dim={seq_dim!r} and tensor_format={tensor_format!r} disagree: the format puts the "
                             f"sequence on axis {axis}; pass one of them")
        return axis
    if seq_dim is None:
        if default is None:
            raise TypeError(f"name the order of {name}'s axes: tensor_format= one of {tuple(TENSOR_FORMATS)} "
                            "(or the sequence axis, seq_dim=)")
        return default
    return seq_dim


def full_width_message(table_width: int, head_dim: int, name: str = "cos") -> str | None:
    """The error for tables too wide for ``head_dim``; names transformers' full-width form when it fits one."""
    if 2 * table_width <= head_dim:
        return None
    if table_width <= head_dim and table_width % 2 == 0:
        return (f"{name} has {table_width} entries per row, more than head_dim // 2 = {head_dim // 2}: this looks "
                f"like full-width cos/sin (transformers' form, torch.cat((freqs, freqs), -1), of width rotary_dim = "
                f"{table_width}); ropekit takes half-width tables of rotary_dim // 2 entries: pass "
                f"cos[..., :{table_width // 2}] and sin[..., :{table_width // 2}]")
    return (f"{name} has {table_width} entries per row but head_dim is {head_dim}: rotary_dim = 2 * {table_width} "
            f"exceeds head_dim")


def check_even_positive(value: int, name: str) -> int:
    """Return ``value`` if it is a positive even int, else raise ``TypeError``/``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0 or value % 2:
        raise ValueError(f"{name} must be a positive even number, got {value}")
    if value > MAX_ROTARY_DIM:
        raise ValueError(f"{name} must be at most {MAX_ROTARY_DIM:,} (ropekit's limit on rotary and head "
                         f"dimensions), got {value:,}")
    return value


def check_positive_float(value: float, name: str) -> float:
    """Return ``float(value)`` if it is a finite number > 0, else raise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def check_positions(positions: torch.Tensor, name: str = "positions") -> torch.Tensor:
    """Return ``positions`` if it is an integer tensor with no negative entry."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(positions).__name__}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(
            f"{name} must have an integer dtype (token indices), got {positions.dtype}; "
            "fractional positions are a scaling rule's job, not the positions'"
        )
    if positions.numel() and not torch.compiler.is_compiling() and int(positions.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got a minimum of {int(positions.min())}")
    return positions


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (without importing that module)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def check_axis_positions(positions: torch.Tensor, n_axes: int, name: str = "positions") -> torch.Tensor:
    """Return ``positions`` if it is a real ``(..., n_axes)`` tensor of finite values.

    Multi-axis positions (M-RoPE t/h/w, axial h/w) may be floats (interpolated grids, pixel
    coordinates in ``[-1, 1]``, half-patch offsets) and negative (centred grids); only NaN, inf,
    booleans, complex numbers and a last axis of the wrong size are refused.
    """
    if not isinstance(positions, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of shape (..., n_axes={n_axes}), got {type(positions).__name__}")
    if positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"{name} must have a real (integer or floating) dtype, got {positions.dtype}")
    if positions.dim() == 0 or positions.shape[-1] != n_axes:
        raise ValueError(
            f"{name} must have shape (..., n_axes={n_axes}) (one coordinate per axis, last), "
            f"got {tuple(positions.shape)}"
        )
    if positions.numel() and not torch.compiler.is_compiling():
        if positions.dtype.is_floating_point and not bool(torch.isfinite(positions).all()):
            raise ValueError(f"{name} must be finite, got NaN or inf")
        low, high = torch.aminmax(positions)
        largest = max(abs(float(low)), abs(float(high)))
        if largest > MAX_POSITION:
            raise ValueError(f"{name} must lie within +-{MAX_POSITION:,} (2**40: float64 angles stay accurate "
                             f"below it), got a coordinate of magnitude {largest:.6g}")
    return positions


def check_float_tensor(x: torch.Tensor, name: str) -> torch.Tensor:
    """Return ``x`` if it is a real floating-point tensor (a plain one: no DTensor)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if is_dtensor(x) and not torch.compiler.is_compiling():
        # Its data lives in its local shard: a kernel handed the DTensor itself would read address 0.
        raise TypeError(
            f"{name} is a DTensor; the rotation kernels take plain tensors: rotate {name}.to_local() by the global "
            "positions of its rows (ropekit.distributed.dtensor_positions), or pass DTensor q and k to "
            "ropekit.RotaryEmbedding, which does both and returns DTensors"
        )
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    return x


NORMS = ("per_head", "per_token")


def check_norm(norm: str) -> bool:
    """``norm="per_head"`` (False) or ``"per_token"`` (True: one norm over a token's heads); else raise."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    return norm == "per_token"


def check_finite_float(value: Any, name: str) -> float:
    """Return ``float(value)`` if it is a finite real number (not a bool), else raise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def check_norm_weight(weight: Any, x: torch.Tensor, per_token: bool, name: str, x_name: str) -> None:
    """``weight`` is None or a float tensor of shape ``(head_dim,)`` (per head) or ``(heads, head_dim)`` (per token)."""
    if weight is None:
        return
    check_float_tensor(weight, name)
    expected = tuple(x.shape[-2:]) if per_token else tuple(x.shape[-1:])
    if tuple(weight.shape) != expected:
        kind = "(heads, head_dim) for norm='per_token'" if per_token else "(head_dim,) for norm='per_head'"
        raise ValueError(f"{name} must have shape {kind} = {expected} to fit {x_name} of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if not (weight.is_cpu and x.is_cpu) and weight.device != x.device:
        raise ValueError(f"{name} is on {weight.device} but {x_name} is on {x.device}")


# -- module arguments ----------------------------------------------------------------------------------


def positive_int(value: Any, name: str) -> int:
    """Return ``value`` if it is a positive int, else raise ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def resolve_head_dim(embed_dim: int, num_heads: int, head_dim: int | None) -> int:
    """``head_dim``, or ``embed_dim // num_heads`` when not given; always a positive even int."""
    if head_dim is None:
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}) when head_dim is not given"
            )
        head_dim = embed_dim // num_heads
        if head_dim % 2:
            raise ValueError(
                f"head_dim = embed_dim // num_heads = {embed_dim} // {num_heads} = {head_dim} must be even "
                "(RoPE rotates channel pairs); pass an even head_dim explicitly"
            )
        return head_dim
    head_dim = positive_int(head_dim, "head_dim")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates channel pairs), got {head_dim}")
    return head_dim


def check_hidden_states(x: Any, embed_dim: int) -> tuple[int, int]:
    """Check that ``x`` is a float ``(batch, seq, embed_dim)`` tensor; return ``(batch, seq)``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must have a floating dtype, got {x.dtype}")
    if x.dim() != 3 or x.shape[-1] != embed_dim:
        raise ValueError(f"x must have shape (batch, seq, embed_dim={embed_dim}), got {tuple(x.shape)}")
    return x.shape[0], x.shape[1]



# -- scaling-rule parameters (messages name the rule and the Hugging Face key) ------------------------
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_number(rule: str, key: str, value: Any, *, low: float | None = None, strict: bool = False) -> float:
    """Return ``float(value)`` if it is a finite number (``> low`` if strict, else ``>= low``)."""
    if not _is_number(value):
        raise ValueError(f"{rule}: {key} must be a finite number, got {value!r}")
    value = float(value)
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{rule}: {key} must be {'>' if strict else '>='} {low:g}, got {value!r}")
    return value


def check_optional_number(rule: str, key: str, value: Any, **bounds: Any) -> float | None:
    """Like :func:`check_number`, letting ``None`` through."""
    return None if value is None else check_number(rule, key, value, **bounds)


def check_factor(rule: str, value: Any, key: str = "factor") -> float:
    """A context-extension factor: a finite number in ``[1, MAX_FACTOR]`` (``1`` means no extension)."""
    value = check_number(rule, key, value, low=1.0)
    if value > MAX_FACTOR:
        raise ValueError(f"{rule}: {key} must be at most {MAX_FACTOR:,.0f} (2**20), got {value!r}")
    return value


def check_context(value: Any, name: str) -> int:
    """A context or sequence length in tokens: an int in ``[1, MAX_POSITION]``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value > MAX_POSITION:
        raise ValueError(f"{name} must be at most {MAX_POSITION:,} tokens (2**40: float64 angles stay accurate "
                         f"below it), got {value:,}")
    return value


def check_length(rule: str, key: str, value: Any) -> int:
    """A sequence length: a positive int (an integral float from JSON is accepted)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{rule}: {key} must be a positive int, got {value!r}")
    if value > MAX_POSITION:
        raise ValueError(f"{rule}: {key} must be at most {MAX_POSITION:,} tokens (2**40), got {value:,}")
    return value


def check_optional_length(rule: str, key: str, value: Any) -> int | None:
    """Like :func:`check_length`, letting ``None`` through."""
    return None if value is None else check_length(rule, key, value)


def check_factor_list(rule: str, key: str, value: Any) -> tuple[float, ...]:
    """A non-empty list of finite numbers ``> 0`` (LongRoPE's per-frequency rescale factors)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{rule}: {key} must be a list of numbers, got {value!r}")
    items = tuple(value)
    if not items:
        raise ValueError(f"{rule}: {key} must not be empty, got {value!r}")
    for i, item in enumerate(items):
        if not _is_number(item) or item <= 0:
            raise ValueError(f"{rule}: {key}[{i}] must be a finite number > 0, got {item!r}")
    return tuple(float(item) for item in items)


def check_base_above_one(rule: str, base: float) -> None:
    """Rules that take ``log(base)`` need ``base > 1``."""
    if not base > 1.0:
        raise ValueError(f"{rule}: base (rope_theta) must be > 1, got {base!r}")


# Checks shared by the rotation entry points (functional, fused).

EXACT_OVERLAP_MAX = 1 << 22  # elements up to which an unusual layout is checked element by element


def overlaps_itself(x: torch.Tensor) -> bool:
    """Whether two indices of ``x`` address one element (torch's own test, then an exact one where it gives up).

    Strides that each pass the reach of the smaller ones (every dense, transposed or sliced view)
    cannot overlap; other layouts are checked element by element, or, past
    ``EXACT_OVERLAP_MAX`` elements, taken as overlapping.
    """
    status = torch._debug_has_internal_overlap(x)  # 0: no, 1: yes, 2: too hard for torch
    if status != 2:
        return status == 1
    reach = 0  # the farthest offset the axes of smaller stride reach: each next stride must pass it
    for stride, size in sorted((st, n) for st, n in zip(x.stride(), x.shape, strict=True) if n > 1):
        if stride <= reach:
            break
        reach += (size - 1) * stride
    else:
        return False
    if x.numel() > EXACT_OVERLAP_MAX:
        return True
    offsets = torch.zeros((), dtype=torch.long)
    for stride, size in zip(x.stride(), x.shape, strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
    return offsets.unique().numel() < x.numel()


def check_inplace(x: torch.Tensor, name: str) -> None:
    """In place needs each element of ``x`` stored once (torch refuses the same for its own ops)."""
    if not torch.compiler.is_compiling() and overlaps_itself(x):
        raise ValueError(
            f"{name} has elements that share memory (an expand or as_strided view of shape {tuple(x.shape)} and "
            f"strides {x.stride()}); in-place rotation needs each element stored once: pass {name}.clone() or "
            "use inplace=False"
        )


def check_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Check the tables against ``x``: ``(..., rotary_dim // 2)`` broadcasting against ``x.shape[:-1]``."""
    check_float_tensor(cos, "cos")
    check_float_tensor(sin, "sin")
    table_shape, x_shape = cos.shape, x.shape
    if table_shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(table_shape)} and {tuple(sin.shape)}")
    ndim, x_ndim = len(table_shape), len(x_shape)
    if ndim == 0:
        raise ValueError("cos must have at least one dimension (rotary_dim // 2,), got a scalar")
    if ndim > x_ndim:
        raise ValueError(
            f"cos has {ndim} dimensions, more than x ({x_ndim}): tables must broadcast against x; "
            f"got cos {tuple(table_shape)} and x {tuple(x_shape)}"
        )
    too_wide = full_width_message(table_shape[-1], x_shape[-1])
    if too_wide is not None:
        raise ValueError(f"x has {x_shape[-1]} channels in its last dimension, fewer than rotary_dim = 2 * "
                         f"cos.shape[-1] = {2 * table_shape[-1]}: {too_wide}")
    lead = x_ndim - ndim
    for axis in range(ndim - 1):
        t, n = table_shape[axis], x_shape[lead + axis]
        if t != 1 and t != n:
            raise ValueError(
                f"cos/sin of shape {tuple(table_shape)} do not broadcast against x of shape {tuple(x_shape)} "
                f"(axis {lead + axis}: {t} vs {n})"
            )
    if not (cos.is_cpu and x.is_cpu) and cos.device != x.device:
        raise ValueError(f"cos is on {cos.device} but x is on {x.device}")
