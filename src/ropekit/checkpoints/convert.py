"""Move a checkpoint's q/k projections between the half and interleaved layouts.

Every q/k projection weight ``(n_heads * head_dim, in_features)`` and bias ``(n_heads * head_dim,)``
gets its output rows permuted per head with :func:`ropekit.permute_qk_weight` (the key projection
with the key/value head count under grouped-query attention; only the first ``rotary_dim``
channels of each head under partial rotary). Fused q/k/v projections (Phi-3 ``qkv_proj``, GPT-NeoX
``query_key_value``) get their q and k rows permuted and their v rows copied; per-head q/k norm
weights (Qwen3 ``q_norm``/``k_norm``) get the same channel permutation (see :mod:`.qk_tensors`).
Attention scores are unchanged because the permutation ``P`` is orthogonal and
``RoPE_dst(P q) = P RoPE_src(q)``. Every other tensor is written back bit for bit with its dtype.

The head geometry and the source layout come from the checkpoint's own config and recorded
metadata before the flags (:mod:`.source`); the q/k weights themselves are a second witness of
the layout (:mod:`.pairing`): a conversion they say would scramble them is refused; outputs are
written all-or-nothing (:mod:`.output`), with a carried ``config.json`` that transformers refuses
when it would rotate the written rows in the other layout (:mod:`.carried_config`); ``--verify``
reads the written files back and checks them with the float64 rotation-matrix oracle (:mod:`.verify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..rope.layouts import permute_qk_weight
from ..rope.pairing import LayoutEvidence
from ..validation import check_layout
from .carried_config import rewrite_config
from .output import plan_output, write_output
from .pairing import check_layout_against_weights, detect_tensors_layout
from .qk_tensors import K_PATTERN, Q_PATTERN, QKLayer, find_layers, fused_head_dim, join_fused, split_fused
from .source import (
    META_KEYS,
    META_LAYOUT,
    HeadSpec,
    config_sources,
    given_source,
    metadata_source,
    resolve_geometry,
    resolve_layout,
)
from .storage import load_checkpoint
from .verify import compare_output, verify_layers

__all__ = ["K_PATTERN", "Q_PATTERN", "ConvertResult", "HeadSpec", "convert_checkpoint", "find_layers",
           "verify_layers"]
LAYOUT_CHECKS = ("on", "skip", "off")


@dataclass
class ConvertResult:
    """What :func:`convert_checkpoint` did.

    ``converted``: the tensor names whose rows moved; ``outputs``: the files written (empty when
    verification failed); ``src_layout`` and ``spec`` with where each came from (``layout_origin``,
    ``geometry_origin``); ``geometry_pinned``: whether a config or recorded metadata fixed the
    geometry (else only the flags and tensor shapes did); ``carried``/``skipped``: the source
    directory's other files copied / left out; ``max_score_error``, ``problems`` and ``verified``
    from ``verify``; ``layout_evidence``: what the q/k weights say about their pairing (``None``
    when not asked), ``layout_warning``: the contradiction a skipped check let through;
    ``config_record``: ``"recorded"`` when the carried ``config.json`` was written with a layout record
    (transformers refuses it; :mod:`.carried_config`), ``"restored"`` when it lost one (an ordinary
    transformers config again), else ``None`` (copied as it was, or none carried).
    """

    converted: list[str] = field(default_factory=list)
    outputs: list[Path] = field(default_factory=list)
    src_layout: str | None = None
    layout_origin: str = ""
    spec: HeadSpec | None = None
    geometry_origin: str = ""
    geometry_pinned: bool = False
    carried: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    max_score_error: float | None = None
    problems: list[str] = field(default_factory=list)
    verified: bool | None = None
    layout_evidence: LayoutEvidence | None = None
    layout_warning: str | None = None
    config_record: str | None = None


def _permute(name: str, w: torch.Tensor, heads: int, spec: HeadSpec, src: str, dst: str) -> torch.Tensor:
    if w.dim() not in (1, 2):
        raise ValueError(f"tensor {name!r} has shape {tuple(w.shape)}; a q/k weight is 2-D and a bias 1-D")
    rows = w.shape[0]
    if rows % heads:
        raise ValueError(f"tensor {name!r} has {rows} output rows, not divisible by {heads} heads")
    if spec.head_dim is not None and rows != heads * spec.head_dim:
        raise ValueError(f"tensor {name!r} has {rows} output rows, expected {heads} heads x head_dim {spec.head_dim}")
    try:
        return permute_qk_weight(w, heads, src=src, dst=dst, rotary_dim=spec.rotary_dim)
    except ValueError as exc:
        raise ValueError(f"tensor {name!r}: {exc}") from None


def convert_layer(layer: QKLayer, tensors: dict[str, torch.Tensor], spec: HeadSpec, src: str,
                  dst: str) -> dict[str, torch.Tensor]:
    """The converted tensors of one layer: q/k rows permuted, fused v rows and everything else as they were."""
    out: dict[str, torch.Tensor] = {}
    for role, heads in (("q", spec.n_heads), ("k", spec.n_kv_heads)):
        for name in getattr(layer, role).values():
            out[name] = _permute(name, tensors[name], heads, spec, src, dst)
    head_dim = None
    for name in layer.fused.values():
        w = tensors[name]
        if w.dim() not in (1, 2):
            raise ValueError(f"tensor {name!r} has shape {tuple(w.shape)}; a fused weight is 2-D and a bias 1-D")
        head_dim = fused_head_dim(name, w.shape[0], layer.fused_layout, spec.n_heads, spec.n_kv_heads)
        q, k, v = split_fused(w, layer.fused_layout, spec.n_heads, spec.n_kv_heads, head_dim)
        q = _permute(f"{name} (q rows)", q, spec.n_heads, spec, src, dst)
        k = _permute(f"{name} (k rows)", k, spec.n_kv_heads, spec, src, dst)
        out[name] = join_fused(q, k, v, layer.fused_layout, spec.n_heads)
    if "weight" in layer.q:
        head_dim = tensors[layer.q["weight"]].shape[0] // spec.n_heads
    for role, name in layer.norm.items():
        w, heads = tensors[name], spec.n_heads if role == "q" else spec.n_kv_heads
        if w.dim() != 1 or w.shape[0] not in (head_dim, heads * head_dim):
            raise ValueError(f"q/k norm {name!r} has shape {tuple(w.shape)}; expected ({head_dim},) (per head) "
                             f"or ({heads * head_dim},) (whole projection)")
        out[name] = _permute(name, w, 1 if w.shape[0] == head_dim else heads,
                             HeadSpec(1, 1, None, spec.rotary_dim), src, dst)
    return out


def _sources(ckpt: Any, names: list[str], spec: HeadSpec | None, src_layout: str | None, config: Any) -> list:
    recorded = metadata_source(ckpt)
    return [*config_sources(ckpt, names, config), *([recorded] if recorded else []), given_source(spec, src_layout)]


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    spec: HeadSpec | None = None,
    *,
    dst_layout: str,
    src_layout: str | None = None,
    config: str | Path | dict | None = None,
    q_pattern: str = Q_PATTERN,
    k_pattern: str = K_PATTERN,
    force: bool = False,
    verify: bool = False,
    tolerance: float = 1e-9,
    layout_check: str = "on",
) -> ConvertResult:
    """Convert the checkpoint at ``src`` and write it (safetensors, sharded like the input) to ``dst``.

    Args:
        src: a ``.safetensors`` / ``.bin`` / ``.pth`` file, an ``*.index.json`` or a directory.
        dst: a ``.safetensors`` file for a single-file input, else a directory (created if
            missing) that receives the converted weights and the source directory's other files
            (a ``config.json`` with a layout record where transformers would rotate the written
            rows in the other layout: ``from_pretrained`` refuses it, ``load_converted`` loads it).
        spec: the geometry the caller knows (the CLI's ``--heads`` ...); fields may be ``None``.
        dst_layout: ``"half"`` or ``"interleaved"``.
        src_layout: the layout of ``src`` if the caller knows it; by default it is read from the
            recorded ``ropekit_layout`` metadata or the config next to ``src``.
        config: a ``config.json`` / ``params.json`` path or dict, in addition to the one next to ``src``.
        q_pattern, k_pattern: regexes (``re.search``) selecting the q and k projections.
        force: replace an existing output (never the input, never a directory that holds anything
            but a checkpoint).
        verify: read the written files back and check them (see :mod:`.convert_verify`) before
            they are moved into place; on a mismatch nothing is written.
        tolerance: largest relative logit difference ``verify`` accepts.
        layout_check: ``"on"``: ask the q/k weights which pairing they were trained with
            (:mod:`ropekit.rope.pairing`) and refuse when they decidedly say SRC is already in
            ``dst_layout``, whatever the config or ``src_layout`` say; ``"skip"``: ask, but convert
            anyway (``layout_warning`` says so; the CLI's ``--skip-layout-check``); ``"off"``: do not ask.

    Returns:
        a :class:`ConvertResult`; ``verified`` is ``False`` (and nothing written) if verification failed.

    Raises:
        ValueError: unreadable or unsafe input; a config, metadata or ``spec`` that contradict
            each other or the tensor shapes; a layout that cannot be told or equals ``dst_layout``
            (by its sources, or by the weights under ``layout_check="on"``); ``dst`` that is,
            holds or would replace an input.
        FileExistsError: an output exists and ``force`` is false.
    """
    dst_layout = check_layout(dst_layout, "dst_layout (--to)")
    if layout_check not in LAYOUT_CHECKS:
        raise ValueError(f"layout_check must be one of {LAYOUT_CHECKS}, got {layout_check!r}")
    ckpt = load_checkpoint(src)
    before = ckpt.tensors()
    layers = find_layers(list(before), q_pattern, k_pattern)
    if not layers:
        raise ValueError(f"no q/k projection tensors found (patterns q {q_pattern!r}, k {k_pattern!r}); "
                         f"first names: {list(before)[:5]}")
    sources = _sources(ckpt, list(before), spec, src_layout, config)
    spec, geometry_origin = resolve_geometry(sources, layers, before)
    evidence = detect_tensors_layout(layers, before, spec) if layout_check != "off" else None
    src_layout, layout_origin = resolve_layout(src_layout, dst_layout, sources, evidence)
    warning = check_layout_against_weights(src_layout, layout_origin, dst_layout, evidence,
                                           skip=layout_check == "skip")
    plan = plan_output(ckpt, dst, force=force)
    rewritten, config_record = rewrite_config(plan.carried, ckpt.directory, dst_layout) if plan.carried else ({}, None)
    result = ConvertResult(src_layout=src_layout, layout_origin=layout_origin, spec=spec,
                           geometry_origin=geometry_origin, carried=[p.name for p in plan.carried],
                           skipped=plan.skipped, layout_evidence=evidence, layout_warning=warning,
                           geometry_pinned=any(s.kind != "given" and s.spec.n_heads for s in sources),
                           config_record=config_record)
    converted: dict[str, torch.Tensor] = {}
    for layer in layers.values():
        converted.update(convert_layer(layer, before, spec, src_layout, dst_layout))
    result.converted = sorted(converted)
    metadata = {META_LAYOUT: dst_layout, **{key: str(getattr(spec, name)) for name, key in META_KEYS.items()}}

    def check(staged: Path) -> bool:
        written = load_checkpoint(staged)
        result.problems = compare_output(ckpt, written, plan.names, set(converted), dst_layout)
        result.max_score_error = verify_layers(before, written.tensors(), layers, spec, src_layout, dst_layout)
        result.verified = not result.problems and result.max_score_error <= tolerance
        return result.verified

    result.outputs = write_output(plan, ckpt, converted, metadata, check if verify else None, rewritten)
    return result
