"""``ropekit convert --verify``: the written files, read back, against the source.

Two checks, both on what is about to be committed (the files in the staging directory):

* :func:`compare_output`: the same tensor names in the same shards, every tensor that is not a
  q/k row bit for bit with its dtype, the converted ones with their dtype and shape, the index
  pointing at the written shards, and the ``ropekit_layout`` metadata saying the target layout;
* :func:`verify_layers`: per layer, random float64 inputs go through the q/k projections (biases,
  q/k norms, q/k rows split out of a fused projection), are rotated with explicit float64 rotation
  matrices (:func:`ropekit.rotation_matrix`, the oracle; not the kernels the library runs) in the
  source layout for the original weights and in the target layout for the converted ones, and
  the attention logits ``q k^T`` per head must agree. Heads are cut with the geometry of the
  checkpoint's config (or recorded metadata) whenever there is one, so a conversion done with any
  other head split fails this check.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..ops.reference import rotation_matrix
from ..rope.frequencies import base_inv_freq
from .qk_tensors import QKLayer, layer_parts
from .source import META_LAYOUT, HeadSpec
from .storage import Checkpoint


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def compare_output(source: Checkpoint, output: Checkpoint, shard_names: dict[str, str], converted: set[str],
                   dst_layout: str) -> list[str]:
    """Differences between the written ``output`` and ``source`` other than the converted rows (empty: none).

    ``shard_names`` maps each source shard's file name to the output file name.
    """
    problems = []
    written = {shard.name: shard for shard in output.shards}
    for shard in source.shards:
        out = written.get(shard_names[shard.name])
        if out is None:
            problems.append(f"output shard {shard_names[shard.name]} missing")
            continue
        if set(out.tensors) != set(shard.tensors):
            problems.append(f"{out.name} holds other tensors than {shard.name}")
            continue
        if (out.metadata or {}).get(META_LAYOUT) != dst_layout:
            problems.append(f"{out.name} records {META_LAYOUT}={(out.metadata or {}).get(META_LAYOUT)!r}")
        for name, tensor in shard.tensors.items():
            if name in converted:
                if out.tensors[name].dtype != tensor.dtype or out.tensors[name].shape != tensor.shape:
                    problems.append(f"converted tensor {name!r} changed its dtype or shape")
            elif not _same_bytes(out.tensors[name], tensor):
                problems.append(f"tensor {name!r} is not the source's bit for bit")
    if source.index is not None:
        expected = {name: shard_names[shard] for name, shard in source.index["weight_map"].items()}
        if output.index is None or output.index.get("weight_map") != expected:
            problems.append("the written index does not map every tensor to its written shard")
    return problems


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm of ``x`` ``(seq, heads, head_dim)`` per head (``weight`` ``(head_dim,)``) or over all heads."""
    if weight is None:
        return x
    flat = x if weight.numel() == x.shape[-1] else x.reshape(x.shape[0], -1)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    return flat.reshape(x.shape)


def rotations(seq: int, spec: HeadSpec, layout: str) -> torch.Tensor:
    """float64 ``(seq, head_dim, head_dim)``: ``R(m Theta)`` at positions ``0..seq-1``, identity past ``rotary_dim``."""
    inv_freq = base_inv_freq(spec.rotary_dim, spec.base or 10000.0)
    out = torch.eye(spec.head_dim, dtype=torch.float64).repeat(seq, 1, 1)
    for m in range(seq):
        out[m, : spec.rotary_dim, : spec.rotary_dim] = rotation_matrix(m, inv_freq, layout=layout)
    return out


def _scores(parts: dict, x: torch.Tensor, spec: HeadSpec, layout: str) -> torch.Tensor:
    """Attention logits ``(n_heads, seq, seq)`` in float64 of one layer with RoPE in ``layout``."""
    seq = x.shape[0]
    q = x @ parts["q_w"].double().T + (0 if parts["q_b"] is None else parts["q_b"].double())
    k = x @ parts["k_w"].double().T + (0 if parts["k_b"] is None else parts["k_b"].double())
    head_dim = spec.head_dim or q.shape[-1] // spec.n_heads
    spec = replace(spec, head_dim=head_dim, n_kv_heads=spec.n_kv_heads or spec.n_heads,
                   rotary_dim=spec.rotary_dim or head_dim)
    q = _rms_norm(q.reshape(seq, spec.n_heads, spec.head_dim), parts["q_norm"])
    k = _rms_norm(k.reshape(seq, spec.n_kv_heads, spec.head_dim), parts["k_norm"])
    rot = rotations(seq, spec, layout)
    q = torch.einsum("sij,shj->shi", rot, q)
    k = torch.einsum("sij,shj->shi", rot, k).repeat_interleave(spec.n_heads // spec.n_kv_heads, dim=1)
    return torch.einsum("thd,shd->hts", q, k)


def verify_layers(
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    layers: dict[str, QKLayer],
    spec: HeadSpec,
    src: str,
    dst: str,
    *,
    seq: int = 16,
    seed: int = 0,
) -> float:
    """Largest relative difference of attention logits, ``src`` layout on ``before`` vs ``dst`` on ``after``.

    ``spec`` comes from :func:`ropekit.checkpoints.source.resolve_geometry` (a missing ``head_dim``
    is read off the q rows, ``rotary_dim`` defaults to it).
    The v rows of a fused projection must be bit-identical (else the result is ``inf``).
    """
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    for layer in layers.values():
        ref_parts = layer_parts(layer, before, spec.n_heads, spec.n_kv_heads)
        out_parts = layer_parts(layer, after, spec.n_heads, spec.n_kv_heads)
        for key in ("v_w", "v_b"):
            if ref_parts[key] is not None and not _same_bytes(ref_parts[key], out_parts[key]):
                return float("inf")
        if ref_parts["q_w"] is None:
            continue
        x = torch.randn(seq, ref_parts["q_w"].shape[1], generator=generator, dtype=torch.float64)
        ref, out = _scores(ref_parts, x, spec, src), _scores(out_parts, x, spec, dst)
        scale = ref.abs().max().item() or 1.0
        worst = max(worst, (out - ref).abs().max().item() / scale)
    return worst
