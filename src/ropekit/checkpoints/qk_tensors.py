"""Finding the tensors of a checkpoint whose rows follow the rotary layout (for ``ropekit convert``).

Three kinds of tensors carry query/key output channels, whose order within each head is the layout:

* separate projections, ``*.q_proj`` / ``*.k_proj`` (transformers) and ``*.attention.wq`` / ``*.attention.wk``
  (Meta): weight ``(heads * head_dim, in_features)``, bias ``(heads * head_dim,)``;
* fused q/k/v projections (one ``nn.Linear`` whose output is split after the matmul):

  - ``*.qkv_proj`` (Phi-3), layout ``"concat"``: rows ``[q (n_heads*hd); k (n_kv*hd); v (n_kv*hd)]``
    (``modeling_phi3``: ``qkv[..., :query_pos]``, ``qkv[..., query_pos:query_pos + n_kv*hd]``, rest);
  - ``*.query_key_value`` (GPT-NeoX), layout ``"per_head"``: rows grouped per head as
    ``[q_h; k_h; v_h]``, i.e. ``view(n_heads, 3, hd, in_features)`` (``modeling_gpt_neox``:
    ``.view(..., -1, 3 * head_size)`` then ``chunk(3, dim=-1)``);

* q/k norms applied channel-wise before RoPE, ``*.q_norm.weight`` / ``*.k_norm.weight``: shape
  ``(head_dim,)`` (per-head RMSNorm: Qwen3, Gemma 3) or ``(heads * head_dim,)`` (whole-projection
  RMSNorm: OLMo 2). The RMS is permutation invariant, so permuting the weight like the q/k rows keeps
  ``norm(P q) = P norm(q)``.

A norm is matched with the projections that share its prefix (the name with the matched suffix
removed, e.g. ``model.layers.0.self_attn``); one without a projection there is an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

#: q/k projection names in circulation: transformers (``*.q_proj.weight``) and Meta (``*.attention.wq.weight``).
Q_PATTERN = r"(?:^|\.)(?:q_proj|attention\.wq)\.(?:weight|bias)$"
K_PATTERN = r"(?:^|\.)(?:k_proj|attention\.wk)\.(?:weight|bias)$"
#: fused q/k/v projections and their row layout (see the module docstring).
FUSED_PATTERNS = {
    "concat": r"(?:^|\.)qkv_proj\.(?:weight|bias)$",
    "per_head": r"(?:^|\.)query_key_value\.(?:weight|bias)$",
}
NORM_PATTERNS = {"q": r"(?:^|\.)q_norm\.weight$", "k": r"(?:^|\.)k_norm\.weight$"}


@dataclass
class QKLayer:
    """Names of one attention layer's layout-dependent tensors; ``q``/``k``/``fused`` map kind (weight/bias) -> name."""

    prefix: str
    q: dict[str, str] = field(default_factory=dict)
    k: dict[str, str] = field(default_factory=dict)
    fused: dict[str, str] = field(default_factory=dict)
    fused_layout: str | None = None
    norm: dict[str, str] = field(default_factory=dict)  # "q"/"k" -> name


def _add(layers: dict[str, QKLayer], prefix: str, slot: str, key: str, name: str, what: str) -> None:
    layer = layers.setdefault(prefix, QKLayer(prefix))
    table = getattr(layer, slot)
    if key in table:
        raise ValueError(f"tensors {table[key]!r} and {name!r} both look like the {what} of one layer")
    table[key] = name


def find_layers(names: list[str], q_pattern: str = Q_PATTERN, k_pattern: str = K_PATTERN) -> dict[str, QKLayer]:
    """Group the layout-dependent tensor names by layer prefix (see the module docstring).

    Raises ``ValueError`` when a name matches both q and k patterns, a q has no k (or the reverse),
    a layer has both separate and fused projections, or a q/k norm has no projection next to it.
    """
    q_re, k_re = re.compile(q_pattern), re.compile(k_pattern)
    fused_res = {layout: re.compile(p) for layout, p in FUSED_PATTERNS.items()}
    norm_res = {role: re.compile(p) for role, p in NORM_PATTERNS.items()}
    layers: dict[str, QKLayer] = {}
    for name in names:
        kind = "bias" if name.endswith("bias") else "weight"
        q_match, k_match = q_re.search(name), k_re.search(name)
        if q_match and k_match:
            raise ValueError(f"tensor {name!r} matches both the q pattern {q_pattern!r} "
                             f"and the k pattern {k_pattern!r}")
        if q_match or k_match:
            role, match = ("q", q_match) if q_match else ("k", k_match)
            _add(layers, name[: match.start()] + name[match.end():], role, kind, name, f"{role} {kind}")
            continue
        for layout, regex in fused_res.items():
            if match := regex.search(name):
                prefix = name[: match.start()] + name[match.end():]
                _add(layers, prefix, "fused", kind, name, f"fused q/k/v {kind}")
                layers[prefix].fused_layout = layout
                break
        else:
            for role, regex in norm_res.items():
                if match := regex.search(name):
                    _add(layers, name[: match.start()] + name[match.end():], "norm", role, name, f"{role} norm")
    for layer in layers.values():
        for kind in ("weight", "bias"):
            if (kind in layer.q) != (kind in layer.k):
                have, want = ("q", "k") if kind in layer.q else ("k", "q")
                raise ValueError(f"found the {have} {kind} {getattr(layer, have)[kind]!r} but no matching {want} "
                                 f"tensor (pattern {k_pattern if want == 'k' else q_pattern!r})")
        if layer.fused and (layer.q or layer.k):
            raise ValueError(f"layer {layer.prefix!r} has both a fused q/k/v projection {layer.fused} and separate "
                             f"q/k projections {layer.q | layer.k}")
        if layer.norm and "weight" not in layer.q and "weight" not in layer.fused:
            raise ValueError(f"q/k norm {sorted(layer.norm.values())} has no q/k projection weight next to it "
                             f"(prefix {layer.prefix!r}); pass --q-pattern/--k-pattern matching its projections")
    return layers


def fused_head_dim(name: str, rows: int, layout: str, n_heads: int, n_kv_heads: int) -> int:
    """``head_dim`` of a fused q/k/v tensor with ``rows`` output rows; ``ValueError`` if the heads do not fit."""
    if layout == "per_head":
        if n_kv_heads != n_heads:
            raise ValueError(f"tensor {name!r} is a GPT-NeoX-style query_key_value (one k/v head per query "
                             f"head), but n_kv_heads={n_kv_heads} != n_heads={n_heads}")
        parts = 3 * n_heads
    else:
        parts = n_heads + 2 * n_kv_heads
    if rows % parts or (rows // parts) % 2:
        raise ValueError(f"tensor {name!r} has {rows} output rows, not an even head_dim times {parts} "
                         f"(fused q/k/v, {layout} layout, {n_heads} query / {n_kv_heads} key-value heads)")
    return rows // parts


def split_fused(w: torch.Tensor, layout: str, n_heads: int, n_kv_heads: int, head_dim: int):
    """``(q, k, v)`` rows of a fused weight/bias, each head-major ``(heads * head_dim, ...)``."""
    rest = w.shape[1:]
    if layout == "concat":
        return w.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=0)
    groups = w.reshape(n_heads, 3, head_dim, *rest)
    return tuple(groups[:, i].reshape(n_heads * head_dim, *rest) for i in range(3))


def join_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`split_fused`."""
    if layout == "concat":
        return torch.cat((q, k, v), dim=0)
    rest = q.shape[1:]
    parts = [t.reshape(n_heads, 1, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def layer_parts(layer: QKLayer, tensors: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> dict:
    """``q_w, q_b, k_w, k_b, v_w, v_b, q_norm, k_norm`` of ``layer`` in ``tensors`` (``None`` where absent).

    ``v_w``/``v_b`` are only set for fused projections (the rows the conversion must not touch).
    """
    parts = dict.fromkeys(("q_w", "q_b", "k_w", "k_b", "v_w", "v_b"))
    if layer.fused:
        head_dim = None
        for kind, name in layer.fused.items():
            w = tensors[name]
            head_dim = fused_head_dim(name, w.shape[0], layer.fused_layout, n_heads, n_kv_heads)
            q, k, v = split_fused(w, layer.fused_layout, n_heads, n_kv_heads, head_dim)
            suffix = "w" if kind == "weight" else "b"
            parts.update({f"q_{suffix}": q, f"k_{suffix}": k, f"v_{suffix}": v})
    else:
        for role in ("q", "k"):
            for kind, suffix in (("weight", "w"), ("bias", "b")):
                name = getattr(layer, role).get(kind)
                parts[f"{role}_{suffix}"] = None if name is None else tensors[name]
    parts["q_norm"] = tensors[layer.norm["q"]] if "q" in layer.norm else None
    parts["k_norm"] = tensors[layer.norm["k"]] if "k" in layer.norm else None
    return parts
