"""What ``ropekit probe`` checks before it builds a model: the weights' names and shapes, read cheaply.

A config that claims a million layers, or a width the weights do not have, would otherwise make
transformers build (minutes) and allocate (gigabytes) a model before it notices. So the probe
first reads what the weights hold without reading the weights themselves:

- a safetensors file: its header (8 bytes of length, then JSON: name -> dtype, shape, offsets);
- a sharded directory: the index's ``weight_map`` and each shard's header;
- a GGUF file: its metadata and tensor infos (``gguf.GGUFReader`` maps the file, reads no data).

and compares them with the config: the number of layers first (from the names alone), then, once
transformers has built the model on the ``meta`` device (no memory), every shape. A malformed or
truncated file is a ``ValueError`` naming the option, as is every disagreement.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

#: The largest safetensors header read (the safetensors library refuses larger ones too).
MAX_HEADER_BYTES = 100 * 1024 * 1024

_HF_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")  # model.layers.N, transformer.h.N, ...
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")


def safetensors_shapes(path: Path, option: str, shown: str) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` from the header of the safetensors file ``path`` (no tensor data read)."""
    where = f"{option} {shown!r}: {path.name}"
    try:
        with open(path, "rb") as handle:
            size = path.stat().st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{where}: not a safetensors file ({size} bytes, shorter than its header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"{where}: not a safetensors file (a header of {length:,} bytes in a file of "
                                 f"{size:,}: truncated or corrupt)")
            header = json.loads(handle.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: not a safetensors file (its header is not JSON: {exc})") from None
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: not a safetensors file (its header is not a JSON object)")
    shapes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"{where}: not a safetensors file (tensor {name!r} has no valid shape)")
        shapes[name] = tuple(shape)
    return shapes


def directory_shapes(directory: Path, option: str, shown: str) -> dict[str, tuple[int, ...]] | None:
    """``{tensor name: shape}`` of a transformers directory's safetensors weights; ``None`` without any.

    Reads ``model.safetensors.index.json`` and the headers of the shards it names, else the header
    of every ``*.safetensors`` file (``.bin`` weights cannot be read without unpickling: ``None``).
    """
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"{option} {shown!r}: {index.name} is not a readable index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{option} {shown!r}: {index.name} has no weight_map of shard file names")
        names = list(dict.fromkeys(weight_map.values()))
        bad = [n for n in names if n in ("", ".", "..") or "/" in n or "\\" in n or not (directory / n).is_file()]
        files = [directory / name for name in names]
        if bad:
            raise ValueError(f"{option} {shown!r}: {index.name} names shard files that are not in it: {bad[:3]}")
    else:
        files = sorted(p for p in directory.glob("*.safetensors") if p.is_file() and not p.name.startswith("."))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        shapes.update(safetensors_shapes(file, option, shown))
    return shapes


def gguf_summary(path: Path, option: str, shown: str) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """``(metadata, {tensor name: shape})`` of a GGUF file, read from its header (no tensor data read).

    ``metadata`` holds ``general.architecture`` and ``{arch}.block_count`` (``None`` when absent).
    Shapes are in GGUF's own order (``ne``: the fastest-varying dimension first).
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        arch_field = reader.fields.get("general.architecture")
        arch = arch_field.contents() if arch_field is not None else None
        count_field = reader.fields.get(f"{arch}.block_count")
        metadata = {"general.architecture": arch,
                    f"{arch}.block_count": count_field.contents() if count_field is not None else None}
        shapes = {t.name: tuple(int(s) for s in t.shape) for t in reader.tensors}
    except OSError as exc:
        raise ValueError(f"{option} {shown!r}: cannot read it ({exc.strerror or exc})") from None
    except Exception as exc:  # noqa: BLE001 -- gguf's parser of an untrusted file fails in any way: struct, numpy
        raise ValueError(f"{option} {shown!r}: not a readable GGUF file, truncated or corrupt "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    return metadata, shapes


def _layer_indices(names: Any, pattern: re.Pattern) -> set[int]:
    return {int(found.group(1)) for name in names if (found := pattern.search(name))}


def _check_count(claimed: Any, indices: set[int], key: str, option: str, shown: str) -> None:
    if isinstance(claimed, bool) or not isinstance(claimed, int) or claimed <= 0:
        raise ValueError(f"{option} {shown!r}: {key} must be a positive int, got {claimed!r}")
    if not indices:
        raise ValueError(f"{option} {shown!r}: the weights hold no per-layer tensors; the config says {key}="
                         f"{claimed:,}")
    if claimed != len(indices) or max(indices) != claimed - 1:
        raise ValueError(f"{option} {shown!r}: the config says {key}={claimed:,} but the weights hold "
                         f"{len(indices):,} layers (indices {min(indices)}..{max(indices)})")


def check_layer_count(config: Any, shapes: dict[str, tuple[int, ...]], option: str, shown: str) -> None:
    """The config's ``num_hidden_layers`` equals the layer indices (``layers.{i}.``, ``h.{i}.``) in the weights."""
    _check_count(getattr(config, "num_hidden_layers", None), _layer_indices(shapes, _HF_LAYER),
                 "num_hidden_layers", option, shown)


def check_gguf_layer_count(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], option: str,
                           shown: str) -> None:
    """The GGUF's ``{arch}.block_count`` equals the number of ``blk.{i}.`` found in its tensor infos."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{option} {shown!r}: no general.architecture in the GGUF metadata")
    key = f"{arch}.block_count"
    _check_count(metadata.get(key), _layer_indices(shapes, _GGUF_LAYER), key, option, shown)


def check_shapes(skeleton: Any, shapes: dict[str, tuple[int, ...]], option: str, shown: str) -> None:
    """Every tensor of the ``meta`` model that the weights also name has the weights' shape."""
    for name, tensor in skeleton.state_dict().items():
        stored = shapes.get(name)
        if stored is not None and tuple(tensor.shape) != stored:
            raise ValueError(f"{option} {shown!r}: the config gives {name} the shape {tuple(tensor.shape)}, the "
                             f"weights hold {stored}")
