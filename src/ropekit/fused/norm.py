r"""RMSNorm of q and k fused with their rotation: one read and one write of every element.

Models with q/k norms (Qwen3, Gemma 3, OLMo 2, ...) normalise q and k and then rotate them: two
passes over memory, and on the CPU ``F.rms_norm`` alone makes several more. These functions do
both in one pass, forward and backward, on every backend (the C++ kernel on the CPU, Triton on
CUDA, a torch composite elsewhere).

Per normalised row ``x`` of ``n`` channels (``norm="per_head"``: a head vector, ``n = head_dim``;
``norm="per_token"``: all heads of a token, ``n = heads * head_dim``, as OLMo 2 normalises the
whole projection):

.. math::
    r = \big(\tfrac{1}{n}\textstyle\sum_j x_j^2 + \epsilon\big)^{-1/2},\quad
    y_j = (x_j r)\, g_j,\quad g = w \text{ or } (\text{weight\_offset} + w),\quad
    \text{out} = R(\theta)\, y \text{ on the first rotary\_dim channels, } y \text{ on the rest}

computed in float32 (float64 for float64 inputs) and rounded once to the input dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import operators_fused, prepared, prepared_keys
from ..ops.dispatch import check_runs, resolve
from ..ops.dispatch import get as get_backend
from ..ops.memory import check_not_shared
from ..validation import (
    check_finite_float,
    check_float_tensor,
    check_inplace,
    check_layout,
    check_norm,
    check_norm_weight,
    check_positive_float,
    check_tables,
)


def _check_options(eps, weight_offset, norm, layout, inplace, weights: dict) -> tuple[float, float, bool]:
    eps = check_positive_float(eps, "eps")
    weight_offset = check_finite_float(weight_offset, "weight_offset")
    per_token = check_norm(norm)
    check_layout(layout)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    for name, weight in weights.items():
        if weight is None and weight_offset != 0.0:
            raise ValueError(f"{name} is None (no weight: gains of 1) but weight_offset={weight_offset!r} is not 0; "
                             f"pass the weight that weight_offset shifts (Gemma's (1 + weight)), or weight_offset=0")
    return eps, weight_offset, per_token


def _check_grad(tensors: dict, cos: Tensor, sin: Tensor, inplace: bool) -> None:
    if not torch.is_grad_enabled():
        return
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("the fused RMSNorm + rotation does not differentiate cos/sin; pass cos.detach() and "
                         "sin.detach() (or use F.rms_norm and ropekit.apply_rotary for learned tables)")
    grads = [name for name, t in tensors.items() if t is not None and t.requires_grad]
    if inplace and grads:
        raise ValueError(f"inplace=True cannot be differentiated ({', '.join(grads)} requires grad): the backward "
                         "pass needs the input the in-place call overwrites; use inplace=False")


def _check_rows(x: Tensor, name: str, per_token: bool) -> None:
    check_float_tensor(x, name)
    if x.dim() < (2 if per_token else 1):
        raise ValueError(f"{name} must have shape (..., heads, head_dim) for norm='per_token', got {tuple(x.shape)}")


def rms_norm_rotary_qk(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    *,
    eps: float,
    norm: str = "per_head",
    layout: str = "half",
    weight_offset: float = 0.0,
    inplace: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    r"""RMSNorm of q and of k, then their rotation, in one pass over each (see the module docstring).

    ``rms_norm_rotary_qk(q, k, wq, wk, cos, sin, eps=eps)`` computes what
    ``ropekit.apply_rotary_qk(F.rms_norm(q, (D,), wq, eps), F.rms_norm(k, (D,), wk, eps), cos, sin)``
    computes, without rounding the normalised values to q's dtype in between.

    Args:
        q: queries ``(..., heads, head_dim)`` or ``(..., heads, seq, head_dim)``, any float dtype
            and strides; ``norm="per_token"`` needs the heads on axis ``-2``
            (``(batch, seq, heads, head_dim)``).
        k: keys, the same ``head_dim``; any head count (GQA).
        q_weight, k_weight: the norms' weights (any float dtype), ``(head_dim,)`` for
            ``norm="per_head"`` and ``(heads, head_dim)`` for ``norm="per_token"`` (OLMo 2's
            ``(heads * head_dim,)`` weight viewed so); None: no weight (gains of 1).
        cos, sin: half-width float32 tables broadcast against q and k as for
            :func:`ropekit.apply_rotary_qk` (``rotary_dim = 2 * cos.shape[-1]``: partial rotary
            rotates the first ``rotary_dim`` normalised channels and leaves the rest normalised).
        eps: added to the mean square (required: 1e-6 for Qwen3 and Gemma 3, 1e-5 for OLMo 2).
        norm: ``"per_head"`` (one norm per head vector: Qwen3, Gemma 3) or ``"per_token"``
            (one norm over the token's heads: OLMo 2, OLMo 3).
        layout: ``"half"`` or ``"interleaved"``.
        weight_offset: the gains are ``weight_offset + weight``, added in float32 (Gemma's
            ``(1 + weight)``: ``weight_offset=1.0``); needs the weights.
        inplace: write q and k themselves (not with autograd: the backward needs the inputs).
        backend: ``"auto"`` or a name from :func:`ropekit.ops.available`.

    Returns:
        ``(q_out, k_out)`` with the shapes and dtypes of q and k.

    Precision (tested): against the unfused composition ``apply_rotary(F.rms_norm(...))``, the
    result is within one unit in the last place of the output dtype for bfloat16 and float16,
    and within 8 for float32, each measured at the rotated pair's magnitude
    ``sqrt(y1^2 + y2^2)``; against a float64 reference it is at least as close as the unfused
    composition (its largest and its mean error). An element's own ulp is the wrong yardstick
    after a rotation: ``y1 c - y2 s`` can cancel to nearly zero while its pair is large, and then
    both results, each rounded at the pair's scale, differ by many of the tiny element's ulps. In
    float32 the sum of squares is added in a fixed order of its own (torch's depends on the
    machine), so the two differ by a few ulps.

    Autograd: gradients reach q, k and the weights (not cos/sin); the backward recomputes the
    norm from q and k (nothing else of their size is saved).
    """
    key, run = prepared_keys.rms_norm_rotary_qk(q, k, q_weight, k_weight, cos, sin, eps, norm, layout, weight_offset,
                                                inplace, backend)  # the layout as given
    if run is not None:
        return run(q, k, q_weight, k_weight, cos, sin)
    layout = check_layout(layout)
    eps, weight_offset, per_token = _check_options(eps, weight_offset, norm, layout, inplace,
                                                   {"q_weight": q_weight, "k_weight": k_weight})
    _check_rows(q, "q", per_token)
    _check_rows(k, "k", per_token)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    if not (q.is_cpu and k.is_cpu) and q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    check_norm_weight(q_weight, q, per_token, "q_weight", "q")
    check_norm_weight(k_weight, k, per_token, "k_weight", "k")
    check_tables(q, cos, sin)
    check_tables(k, cos, sin)
    _check_grad({"q": q, "k": k, "q_weight": q_weight, "k_weight": k_weight}, cos, sin, inplace)
    if inplace:
        if q is k:
            raise ValueError("inplace=True needs distinct q and k tensors (the same tensor would be written twice)")
        check_inplace(q, "q")
        check_inplace(k, "k")
        check_not_shared({"q": q, "k": k}, {"q_weight": q_weight, "k_weight": k_weight, "cos": cos, "sin": sin},
                         "inplace=True")
    name = resolve(backend, q.device.type)
    check_runs(backend, name, {"q": q, "k": k})
    call = dict(eps=eps, weight_offset=weight_offset, per_token=per_token, layout=layout, backend=name,
                inplace=inplace)
    if operators_fused.direct_with_weights(q, k, cos, sin, weights=(q_weight, k_weight)):
        kernel = get_backend(name)
        options_of_kernel = {n: v for n, v in call.items() if n != "backend"}
        prepared.keep(key, lambda *tensors: kernel.rms_norm_rotary_qk(*tensors, **options_of_kernel),
                      (q, k, cos, sin, q_weight, k_weight))
    return operators_fused.rms_norm_rotary_qk(q, k, q_weight, k_weight, cos, sin, **call)


def rms_norm_rotary(
    x: Tensor,
    weight: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    *,
    eps: float,
    norm: str = "per_head",
    layout: str = "half",
    weight_offset: float = 0.0,
    inplace: bool = False,
    backend: str = "auto",
) -> Tensor:
    """:func:`rms_norm_rotary_qk` for one tensor (e.g. a model that normalises and rotates q and k apart).

    Arguments, result and precision as there, with ``x`` and ``weight`` for q and ``q_weight``.
    """
    key, run = prepared_keys.rms_norm_rotary(x, weight, cos, sin, eps, norm, layout, weight_offset, inplace,
                                             backend)  # the layout as given
    if run is not None:
        return run(x, weight, cos, sin)
    layout = check_layout(layout)
    eps, weight_offset, per_token = _check_options(eps, weight_offset, norm, layout, inplace, {"weight": weight})
    _check_rows(x, "x", per_token)
    check_norm_weight(weight, x, per_token, "weight", "x")
    check_tables(x, cos, sin)
    _check_grad({"x": x, "weight": weight}, cos, sin, inplace)
    if inplace:
        check_inplace(x, "x")
        check_not_shared({"x": x}, {"weight": weight, "cos": cos, "sin": sin}, "inplace=True")
    name = resolve(backend, x.device.type)
    check_runs(backend, name, {"x": x})
    call = dict(eps=eps, weight_offset=weight_offset, per_token=per_token, layout=layout, backend=name,
                inplace=inplace)
    if operators_fused.direct_with_weights(x, cos, sin, weights=(weight,)):
        kernel = get_backend(name)
        options_of_kernel = {n: v for n, v in call.items() if n != "backend"}
        prepared.keep(key, lambda *tensors: kernel.rms_norm_rotary(*tensors, **options_of_kernel),
                      (x, cos, sin, weight))
    return operators_fused.rms_norm_rotary(x, weight, cos, sin, **call)
