"""``ropekit convert``: move a checkpoint's q/k projections between the half and interleaved layouts.

Every q/k projection weight ``(n_heads * head_dim, in_features)`` and bias ``(n_heads * head_dim,)``
gets its output rows permuted per head with :func:`ropekit.permute_qk_weight` (the key projection
with the key/value head count under grouped-query attention; only the first ``rotary_dim``
channels of each head under partial rotary). Fused q/k/v projections (Phi-3 ``qkv_proj``, GPT-NeoX
``query_key_value``) get their q and k rows permuted and their v rows copied; per-head q/k norm
weights (Qwen3 ``q_norm``/``k_norm``) get the same channel permutation (see :mod:`.qk_tensors`).
Attention scores are unchanged because the permutation ``P`` is orthogonal and
``RoPE_dst(P q) = P RoPE_src(q)``; ``--verify`` checks exactly that on random inputs. Every other
tensor is written back bit for bit with its dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._checks import LAYOUTS, check_layout
from ..frequencies import base_inv_freq, cos_sin
from ..functional import apply_rotary
from ..layouts import permute_qk_weight
from .checkpoint_io import Checkpoint, Shard, load_checkpoint, safetensors_name, write_atomically
from .qk_tensors import K_PATTERN, Q_PATTERN, QKLayer, find_layers, fused_head_dim, join_fused, layer_parts, split_fused

__all__ = ["K_PATTERN", "Q_PATTERN", "ConvertResult", "HeadSpec", "convert_checkpoint", "find_layers"]


@dataclass(frozen=True)
class HeadSpec:
    """Attention geometry: ``n_heads`` query heads, ``n_kv_heads`` key heads, ``rotary_dim`` rotated channels.

    ``head_dim`` and ``rotary_dim`` may be ``None``: then ``head_dim`` is read off each weight and
    ``rotary_dim`` defaults to it. ``base`` only feeds ``--verify``'s tables.
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int | None = None
    rotary_dim: int | None = None
    base: float = 10000.0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> HeadSpec:
        """Read a Hugging Face ``config.json`` dict (through :meth:`RopeConfig.from_hf`) or Meta ``params.json``."""
        from ..config import RopeConfig

        if "num_attention_heads" not in config and "n_heads" in config:  # Meta params.json
            heads = int(config["n_heads"])
            head_dim = int(config["dim"]) // heads
            return cls(heads, int(config.get("n_kv_heads") or heads), head_dim, head_dim,
                       float(config.get("rope_theta", 10000.0)))
        if "num_attention_heads" not in config:
            raise ValueError(f"config needs num_attention_heads (or Meta's n_heads), got keys {sorted(config)[:12]}")
        rope = RopeConfig.from_hf(config)
        heads = int(config["num_attention_heads"])
        return cls(heads, int(config.get("num_key_value_heads") or heads), rope.head_dim, rope.rotary_dim, rope.base)


@dataclass
class ConvertResult:
    """What :func:`convert_checkpoint` did: converted tensor names, output paths and the verification error."""

    converted: list[str] = field(default_factory=list)
    outputs: list[Path] = field(default_factory=list)
    max_score_error: float | None = None
    verified: bool | None = None


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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm of ``x`` ``(seq, heads, head_dim)`` per head (``weight`` ``(head_dim,)``) or over all heads."""
    if weight is None:
        return x
    flat = x if weight.numel() == x.shape[-1] else x.reshape(x.shape[0], -1)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    return flat.reshape(x.shape)


def _scores(parts: dict, x: torch.Tensor, spec: HeadSpec, layout: str) -> torch.Tensor:
    """Attention logits ``(heads, seq, seq)`` in float64 of one layer with RoPE in ``layout``."""
    seq = x.shape[0]
    q = x @ parts["q_w"].double().T + (0 if parts["q_b"] is None else parts["q_b"].double())
    k = x @ parts["k_w"].double().T + (0 if parts["k_b"] is None else parts["k_b"].double())
    q = _rms_norm(q.reshape(seq, spec.n_heads, -1), parts["q_norm"])
    k = _rms_norm(k.reshape(seq, spec.n_kv_heads, -1), parts["k_norm"])
    rotary_dim = spec.rotary_dim or q.shape[-1]
    cos, sin = cos_sin(torch.arange(seq), base_inv_freq(rotary_dim, spec.base))
    cos, sin = cos.double()[:, None, :], sin.double()[:, None, :]
    q = apply_rotary(q, cos, sin, layout=layout)
    k = apply_rotary(k, cos, sin, layout=layout)
    k = k.repeat_interleave(spec.n_heads // spec.n_kv_heads, dim=1)
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
    """Largest relative difference of attention scores, source layout on ``before`` vs ``dst`` on ``after``.

    For each layer, ``seq`` random float64 inputs go through q/k (weight, bias, q/k norm), RoPE in the
    respective layout, and ``q k^T`` per query head (key heads shared under GQA). The v rows of a
    fused projection must be bit-identical (else the result is ``inf``).
    """
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    for layer in layers.values():
        ref_parts = layer_parts(layer, before, spec.n_heads, spec.n_kv_heads)
        out_parts = layer_parts(layer, after, spec.n_heads, spec.n_kv_heads)
        for key in ("v_w", "v_b"):
            if ref_parts[key] is not None and not torch.equal(ref_parts[key], out_parts[key]):
                return float("inf")
        if ref_parts["q_w"] is None:
            continue
        x = torch.randn(seq, ref_parts["q_w"].shape[1], generator=generator, dtype=torch.float64)
        ref, out = _scores(ref_parts, x, spec, src), _scores(out_parts, x, spec, dst)
        scale = ref.abs().max().item() or 1.0
        worst = max(worst, (out - ref).abs().max().item() / scale)
    return worst


def _outputs(ckpt: Checkpoint, dst: Path) -> tuple[Path, dict[str, Path]]:
    """``(directory, {input shard name: output path})`` for ``dst``."""
    if ckpt.index is not None or dst.is_dir() or str(dst).endswith(("/", "\\")):
        if dst.exists() and not dst.is_dir():
            raise ValueError(f"DST {dst} is a file, but a sharded checkpoint needs a directory")
        return dst, {s.name: dst / safetensors_name(s.name) for s in ckpt.shards}
    if dst.suffix != ".safetensors":
        raise ValueError(f"DST must be a .safetensors file or a directory, got {dst}")
    return dst.parent, {ckpt.shards[0].name: dst}


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    spec: HeadSpec,
    *,
    src_layout: str,
    dst_layout: str,
    q_pattern: str = Q_PATTERN,
    k_pattern: str = K_PATTERN,
    force: bool = False,
    verify: bool = False,
    tolerance: float = 1e-9,
) -> ConvertResult:
    """Convert the checkpoint at ``src`` and write it (safetensors, sharded like the input) to ``dst``.

    Args:
        src: a ``.safetensors`` / ``.bin`` / ``.pth`` file, an ``*.index.json`` or a directory.
        dst: a ``.safetensors`` file for a single-file input, else (or if it is a directory) a directory.
        spec: head counts and rotary width (see :class:`HeadSpec`).
        src_layout, dst_layout: ``"half"`` or ``"interleaved"``.
        q_pattern, k_pattern: regexes (``re.search``) selecting the q and k projections.
        force: overwrite existing outputs (never the input).
        verify: check attention scores before/after on random inputs; on a mismatch nothing is written.
        tolerance: largest relative score difference ``--verify`` accepts.

    Returns:
        a :class:`ConvertResult`; ``verified`` is ``False`` (and nothing written) if verification failed.

    Raises:
        ValueError: unknown layout, no or unpaired q/k tensors, head counts that do not divide a weight,
            ``dst`` that is (or would overwrite) an input file.
        FileExistsError: an output exists and ``force`` is false.
    """
    check_layout(src_layout, "src_layout (--from)")
    check_layout(dst_layout, "dst_layout (--to)")
    for value, name in ((spec.n_heads, "n_heads (--heads)"), (spec.n_kv_heads, "n_kv_heads (--kv-heads)")):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if spec.n_heads % spec.n_kv_heads:
        raise ValueError(f"n_heads ({spec.n_heads}) must be a multiple of n_kv_heads ({spec.n_kv_heads})")
    ckpt = load_checkpoint(src)
    directory, paths = _outputs(ckpt, Path(dst))
    outputs = list(paths.values()) + ([directory / ckpt.index_name] if ckpt.index is not None else [])
    for out in outputs:
        for inp in ckpt.files:
            if out.resolve() == inp.resolve() or (out.exists() and out.samefile(inp)):
                raise ValueError(f"DST {out} is the input file {inp}; refusing to overwrite the input")
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not force:
        raise FileExistsError(f"output exists (pass --force to overwrite): {', '.join(existing)}")

    before = ckpt.tensors()
    layers = find_layers(list(before), q_pattern, k_pattern)
    if not layers:
        raise ValueError(f"no q/k projection tensors found (patterns q {q_pattern!r}, k {k_pattern!r}); "
                         f"first names: {list(before)[:5]}")
    result = ConvertResult()
    converted: dict[str, torch.Tensor] = {}
    for layer in layers.values():
        converted.update(convert_layer(layer, before, spec, src_layout, dst_layout))
    result.converted = sorted(converted)
    if verify:
        after = {**before, **converted}
        result.max_score_error = verify_layers(before, after, layers, spec, src_layout, dst_layout)
        result.verified = result.max_score_error <= tolerance
        if not result.verified:
            return result

    directory.mkdir(parents=True, exist_ok=True)
    writes: dict[Path, Any] = {}
    for shard in ckpt.shards:
        tensors = {name: converted.get(name, t) for name, t in shard.tensors.items()}
        writes[paths[shard.name]] = Shard(paths[shard.name].name, tensors, shard.metadata or {"format": "pt"})
    if ckpt.index is not None:
        index = dict(ckpt.index)
        index["weight_map"] = {name: paths[shard].name for name, shard in ckpt.index["weight_map"].items()}
        writes[directory / ckpt.index_name.replace("pytorch_model.bin", "model.safetensors")] = index
    write_atomically(writes)
    result.outputs = list(writes)
    return result


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``convert`` verb on an ``argparse`` subparsers object (``func=run``)."""
    p = subparsers.add_parser(
        "convert",
        help="permute a checkpoint's q/k projections between the half and interleaved RoPE layouts",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("src", help="a .safetensors/.bin/.pth file, a *.index.json or a directory")
    p.add_argument("dst", help="a .safetensors file (single-file input) or a directory")
    p.add_argument("--to", dest="dst_layout", required=True, choices=LAYOUTS, help="layout to write")
    p.add_argument("--from", dest="src_layout", choices=LAYOUTS, help="layout of SRC (default: the other one)")
    p.add_argument("--config", help="the model's config.json (or Meta params.json): head counts and rotary_dim")
    p.add_argument("--heads", type=int, help="number of query heads")
    p.add_argument("--kv-heads", type=int, help="number of key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, help="channels per head (default: read off the weights)")
    p.add_argument("--rotary-dim", type=int, help="rotated channels per head (default: head_dim)")
    p.add_argument("--q-pattern", default=Q_PATTERN, help="regex selecting q projections (default: %(default)s)")
    p.add_argument("--k-pattern", default=K_PATTERN, help="regex selecting k projections (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="overwrite existing outputs")
    p.add_argument("--verify", action="store_true", help="check attention scores before/after on random inputs")
    p.set_defaults(func=run)
    return p


def _spec_from_args(args: argparse.Namespace) -> HeadSpec:
    if getattr(args, "config", None):
        try:
            config = json.loads(Path(args.config).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"--config file not found: {args.config}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"--config {args.config} is not valid JSON: {exc}") from None
        spec = HeadSpec.from_config(config)
        overrides = {k: v for k, v in (("rotary_dim", getattr(args, "rotary_dim", None)),
                                       ("head_dim", getattr(args, "head_dim", None))) if v is not None}
        return HeadSpec(**{**spec.__dict__, **overrides}) if overrides else spec
    heads = getattr(args, "heads", None)
    if heads is None:
        raise ValueError("pass --config config.json or --heads N (with --kv-heads M for grouped-query attention)")
    kv_heads = getattr(args, "kv_heads", None) or heads
    return HeadSpec(heads, kv_heads, getattr(args, "head_dim", None), getattr(args, "rotary_dim", None))


def run(args: argparse.Namespace) -> int:
    """Run ``ropekit convert`` for parsed ``args``: 0 on success, 1 if ``--verify`` found a mismatch."""
    dst_layout = check_layout(args.dst_layout, "--to")
    src_layout = getattr(args, "src_layout", None)
    if src_layout is None:
        src_layout = "half" if dst_layout == "interleaved" else "interleaved"
    src_layout = check_layout(src_layout, "--from")
    result = convert_checkpoint(
        args.src, args.dst, _spec_from_args(args),
        src_layout=src_layout, dst_layout=dst_layout,
        q_pattern=getattr(args, "q_pattern", None) or Q_PATTERN,
        k_pattern=getattr(args, "k_pattern", None) or K_PATTERN,
        force=bool(getattr(args, "force", False)), verify=bool(getattr(args, "verify", False)),
    )
    if result.verified is False:
        print(f"ropekit convert: verification FAILED: attention scores differ by {result.max_score_error:.3g} "
              f"(relative); nothing written", file=sys.stderr)
        return 1
    print(f"converted {len(result.converted)} q/k tensors {src_layout} -> {dst_layout}; "
          f"wrote {', '.join(str(p) for p in result.outputs)}")
    if result.verified:
        print(f"verified: attention scores equal (max relative difference {result.max_score_error:.2e})")
    return 0
