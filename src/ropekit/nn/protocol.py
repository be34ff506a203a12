"""The one call every rotary module answers: ``rope(q, k, positions, *, offset, tensor_format) -> (q', k')``.

:class:`RotaryModule` is what an attention layer may rely on, and all it may rely on:
:class:`~ropekit.nn.RotaryEmbedding` (integer positions), :class:`~ropekit.nn.XPosEmbedding`
(integer positions; its key factors are part of the keys it returns),
:class:`~ropekit.nn.MultiAxisRotaryEmbedding` and :class:`~ropekit.nn.MixedRotaryEmbedding`
(vector positions ``(..., n_axes)``) all honour it, so
:class:`~ropekit.nn.RotarySelfAttention` takes any of them, or a module of one's own with the
same call. :func:`check_rotary_module` is the structural check (signature, not class).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch

#: The keyword-only parameters of the call (``positions`` may also come third, positionally).
PROTOCOL_KEYWORDS = ("offset", "tensor_format")


@runtime_checkable
class RotaryModule(Protocol):
    """A rotary position embedding as a module: rotate queries and keys by their positions.

    Attributes:
        head_dim: channels per head of the q and k it takes.

    Call ``module(q, k, positions=None, *, offset=0, tensor_format=None)``:

    - ``q``: float queries in the order ``tensor_format`` names (``"bhsd"``, ``"bshd"``,
      ``"sbhd"``, ``"thd"``; ``None``: the module's documented default, ``"bhsd"`` for 4-D);
    - ``k``: keys in the same order, the same sequence length, any head count the module allows;
      or ``None``;
    - ``positions``: 1-D RoPE: integer ``(seq,)`` or ``(batch, seq)``; multi-axis RoPE:
      ``(seq, n_axes)`` or ``(batch, seq, n_axes)`` vectors. ``None``: ``offset + arange(seq)``
      where that means something (1-D), else a ``ValueError``;
    - ``offset``: shift of the default positions (a KV cache's length); a module whose positions
      are vectors refuses a non-zero offset.

    Returns ``(q', k')`` with q's and k's shapes and dtypes (``k'`` is ``None`` when ``k`` is): the
    attention scores are ``q' . k'``, whatever the module does to the keys.
    """

    head_dim: int

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor | None = None, *,
                 offset: int | torch.Tensor = 0,
                 tensor_format: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate ``q`` and ``k``; see the class docstring."""
        ...


def check_rotary_module(rope: Any, name: str = "rope") -> Any:
    """Return ``rope`` if it honours :class:`RotaryModule`, else raise a ``TypeError`` saying what is missing.

    Structural: an int ``head_dim`` and a call taking ``(q, k, positions)`` and the keywords
    ``offset`` and ``tensor_format`` (or ``**kwargs``). Any class will do.
    """
    if not callable(rope):
        raise TypeError(f"{name} must be a rotary module (ropekit.nn.RotaryModule: rope(q, k, positions, *, offset, "
                        f"tensor_format) -> (q, k)), got {type(rope).__name__}")
    head_dim = getattr(rope, "head_dim", None)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"{name} ({type(rope).__name__}) must have an int head_dim attribute to be a rotary module "
                        f"(ropekit.nn.RotaryModule), got {head_dim!r}")
    call = rope.forward if isinstance(rope, torch.nn.Module) else rope
    try:
        params = inspect.signature(call).parameters
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return rope
    kinds = [p.kind for p in params.values()]
    if inspect.Parameter.VAR_KEYWORD in kinds:
        missing = []
    else:
        missing = [kw for kw in PROTOCOL_KEYWORDS
                   if kw not in params or params[kw].kind == inspect.Parameter.POSITIONAL_ONLY]
    positional = sum(kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                     for kind in kinds)
    if positional < 3 and inspect.Parameter.VAR_POSITIONAL not in kinds:
        missing.insert(0, "positional (q, k, positions)")
    if missing:
        raise TypeError(f"{name} ({type(rope).__name__}) does not honour ropekit.nn.RotaryModule: its forward lacks "
                        f"{', '.join(missing)}; a rotary module is called rope(q, k, positions, *, offset, "
                        "tensor_format) -> (q, k)")
    return rope
