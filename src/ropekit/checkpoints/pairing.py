"""The pairing detector (:mod:`ropekit.rope.pairing`) on a checkpoint, and the check ``ropekit convert`` runs with it.

:func:`detect_tensors_layout` collects every q and k projection of a state dict (separate, fused
q/k/v, with their q/k norms; :mod:`.qk_tensors`) and asks the weights which pairing they were
trained with. :func:`detect_checkpoint_layout` does the same for a checkpoint on disk (the head
geometry from its config, recorded metadata or ``spec``, as ``ropekit convert`` reads them).

:func:`check_layout_against_weights` is the second witness of a conversion: the recorded metadata,
the config or ``--from`` say which layout SRC is in; when the weights decidedly say it is already
in the target layout, the conversion would scramble them and is refused (unless the caller skips
the check). An undecided detector never refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from ..rope.pairing import LayoutEvidence, detect_layout
from .qk_tensors import K_PATTERN, Q_PATTERN, QKLayer, find_layers, layer_parts
from .source import HeadSpec, config_sources, given_source, metadata_source, resolve_geometry
from .storage import load_checkpoint

SKIP_FLAG = "--skip-layout-check"


def qk_projections(layers: Mapping[str, QKLayer], tensors: Mapping[str, torch.Tensor],
                   spec: HeadSpec) -> list[tuple[torch.Tensor, int, torch.Tensor | None]]:
    """``(weight, heads, norm weight or None)`` of every q and k projection weight in ``layers``.

    ``spec`` must be complete (as :func:`~.source.resolve_geometry` returns it).
    """
    out = []
    for layer in layers.values():
        parts = layer_parts(layer, dict(tensors), spec.n_heads, spec.n_kv_heads)
        for role, heads in (("q", spec.n_heads), ("k", spec.n_kv_heads)):
            weight = parts[f"{role}_w"]
            if weight is not None and weight.dim() == 2:
                out.append((weight, heads, parts[f"{role}_norm"]))
    return out


def detect_tensors_layout(layers: Mapping[str, QKLayer], tensors: Mapping[str, torch.Tensor],
                          spec: HeadSpec) -> LayoutEvidence:
    """What the q/k weights of ``layers`` say about their pairing (undecided when there is nothing to test)."""
    projections = qk_projections(layers, tensors, spec)
    if not projections:
        return LayoutEvidence(None, None, 0.0, 0.0, 0, "no q/k projection weights")
    if spec.rotary_dim < 4:
        return LayoutEvidence(None, None, 0.0, 0.0, 0, f"rotary_dim {spec.rotary_dim}: fewer than two pairs")
    return detect_layout(projections, head_dim=spec.head_dim, rotary_dim=spec.rotary_dim)


def detect_checkpoint_layout(src: str | Path, spec: HeadSpec | None = None, *, config: str | Path | dict | None = None,
                             q_pattern: str = Q_PATTERN, k_pattern: str = K_PATTERN) -> LayoutEvidence:
    """What the q/k weights of the checkpoint at ``src`` say about their pairing.

    Args:
        src: a ``.safetensors`` / ``.bin`` / ``.pth`` file, an ``*.index.json`` or a directory.
        spec: head geometry the caller knows (fields may be ``None``); the config next to ``src``,
            ``config`` and recorded metadata fill the rest, as for ``ropekit convert``.
        config: a ``config.json`` / ``params.json`` path or dict.
        q_pattern, k_pattern: regexes selecting the q and k projections.

    Raises:
        ValueError: unreadable input, no q/k tensors, or a geometry that cannot be told or does not fit.
    """
    ckpt = load_checkpoint(src)
    tensors = ckpt.tensors()
    layers = find_layers(list(tensors), q_pattern, k_pattern)
    if not layers:
        raise ValueError(f"no q/k projection tensors found in {src} (patterns q {q_pattern!r}, k {k_pattern!r})")
    recorded = metadata_source(ckpt)
    sources = [*config_sources(ckpt, list(tensors), config), *([recorded] if recorded else []),
               given_source(spec, None)]
    full, _ = resolve_geometry(sources, layers, tensors)
    return detect_tensors_layout(layers, tensors, full)


def already_target_message(src_layout: str, origin: str, dst: str, evidence: LayoutEvidence) -> str:
    """The refusal when ``origin`` says ``src_layout`` but the weights say ``dst`` (the target)."""
    return (f"SRC's q/k weights already look {dst} ({evidence.describe()}), although {origin} says "
            f"{src_layout}: converting them --to {dst} would scramble them; pass {SKIP_FLAG} to convert anyway")


def check_layout_against_weights(src_layout: str, origin: str, dst: str, evidence: LayoutEvidence | None, *,
                                 skip: bool = False) -> str | None:
    """Refuse a conversion the weights say is a no-op; return a warning when ``skip`` lets it through.

    Returns ``None`` when the weights agree with ``src_layout`` or are undecided, else (with
    ``skip``) the sentence to show the user. Raises ``ValueError`` (without ``skip``) when the
    weights decidedly say SRC is already in ``dst``.
    """
    if evidence is None or not evidence.decided or evidence.layout != dst or src_layout == dst:
        return None
    message = already_target_message(src_layout, origin, dst, evidence)
    if not skip:
        raise ValueError(message)
    return f"{message.split(': converting')[0]}; converting anyway ({SKIP_FLAG})"
