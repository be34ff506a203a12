"""Reading and writing checkpoints for ``ropekit convert``: safetensors (single or sharded) and torch state dicts.

A checkpoint is read into a :class:`Checkpoint`: its shards (file name, tensors, safetensors
metadata) and, for a sharded set, the index JSON. Writing is always safetensors and always
atomic: every output goes to a temporary file in the destination directory and is moved into
place with :func:`os.replace` only after all of them were written; on any error the temporary
files are removed, so no half-written output ever appears under its final name.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TORCH_SUFFIXES = (".bin", ".pth", ".pt")


@dataclass
class Shard:
    """One file of a checkpoint: ``name`` (file name), ``tensors`` (name -> tensor), ``metadata`` (str -> str)."""

    name: str
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] | None = None


@dataclass
class Checkpoint:
    """A loaded checkpoint: ``shards`` in file order, ``index`` (the index JSON of a sharded set or ``None``).

    ``files`` are the input paths read (the index included), used to refuse writing over them.
    """

    shards: list[Shard]
    index: dict[str, Any] | None = None
    index_name: str | None = None
    files: list[Path] = field(default_factory=list)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name, across shards (a view, not a copy)."""
        return {name: t for shard in self.shards for name, t in shard.tensors.items()}


def _load_file(path: Path) -> Shard:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        return Shard(path.name, tensors, metadata)
    if path.suffix in TORCH_SUFFIXES:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise ValueError(
                f"{path}: expected a flat state dict (name -> tensor), got {type(state).__name__}"
                + (f" with keys {sorted(state)[:5]}" if isinstance(state, dict) else "")
            )
        return Shard(path.name, dict(state), None)
    raise ValueError(f"{path}: unknown checkpoint format {path.suffix!r}; expected .safetensors, .bin, .pth or .pt")


def _find_in_dir(directory: Path) -> Path:
    for name in INDEX_NAMES:
        if (directory / name).is_file():
            return directory / name
    for pattern in ("*.safetensors", *(f"*{suffix}" for suffix in TORCH_SUFFIXES)):
        found = sorted(directory.glob(pattern))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(p.name for p in found[:4])
            raise ValueError(f"{directory}: {len(found)} {pattern} files ({names}) and no index file; pass one file")
    raise ValueError(f"{directory}: no checkpoint found (an index {INDEX_NAMES}, *.safetensors, *.bin or *.pth)")


def load_checkpoint(src: str | os.PathLike) -> Checkpoint:
    """Read ``src``: a ``.safetensors`` / ``.bin`` / ``.pth`` file, a ``*.index.json`` or a directory holding either.

    Tensors keep their dtype and bytes. Raises ``ValueError`` for missing files or formats.
    """
    path = Path(src)
    if not path.exists():
        raise ValueError(f"SRC does not exist: {path}")
    if path.is_dir():
        path = _find_in_dir(path)
    if path.name.endswith(".index.json"):
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a checkpoint index (needs a 'weight_map' object): {exc}") from None
        shard_names = list(dict.fromkeys(weight_map.values()))
        missing = [name for name in shard_names if not (path.parent / name).is_file()]
        if missing:
            raise ValueError(f"{path}: shard files listed in weight_map are missing: {missing}")
        shards = [_load_file(path.parent / name) for name in shard_names]
        for shard in shards:
            for name in shard.tensors:
                if weight_map.get(name) != shard.name:
                    raise ValueError(f"{path}: tensor {name!r} is in {shard.name} but the index says "
                                     f"{weight_map.get(name)!r}")
        files = [path, *(path.parent / name for name in shard_names)]
        return Checkpoint(shards, index, path.name, files)
    return Checkpoint([_load_file(path)], None, None, [path])


def safetensors_name(name: str) -> str:
    """Output file name for an input shard: ``pytorch_model-00001-of-00002.bin -> model-00001-of-00002.safetensors``."""
    stem, suffix = os.path.splitext(name)
    if suffix == ".safetensors":
        return name
    if stem.startswith("pytorch_model"):
        stem = "model" + stem[len("pytorch_model"):]
    return stem + ".safetensors"


def _untie(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with no shared storage (safetensors refuses tied weights); values unchanged."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in tensors.items():
        t = t.contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() and key in seen:
            t = t.clone()
        seen.add(key)
        out[name] = t
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None) -> None:
    """Write one safetensors file (a seam the tests patch to simulate a failure)."""
    from safetensors.torch import save_file

    save_file(_untie(tensors), path, metadata=metadata)


def write_atomically(outputs: dict[Path, Any]) -> None:
    """Write every ``path -> content`` (a :class:`Shard` or a JSON-able dict) all-or-nothing.

    Each output is written to a temporary file next to it; only when all succeeded are they
    moved into place with :func:`os.replace`. On error every temporary file is removed.
    """
    temps: list[tuple[str, Path]] = []
    try:
        for path, content in outputs.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            temps.append((tmp, path))
            if isinstance(content, Shard):
                save_safetensors(content.tensors, tmp, content.metadata)
            else:
                Path(tmp).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for tmp, path in temps:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in temps:
            Path(tmp).unlink(missing_ok=True)
        raise
