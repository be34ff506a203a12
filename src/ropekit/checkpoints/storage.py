"""Reading checkpoints for ``ropekit convert``: safetensors (single or sharded) and torch state dicts.

A checkpoint is read into a :class:`Checkpoint`: its shards (file name, tensors, safetensors
metadata), the index JSON of a sharded set, and the directory it came from. Everything read is
treated as untrusted:

* an index's ``weight_map`` must map tensor names to plain file names in the index's own
  directory (no ``..``, no separator, no absolute path), checked before any shard is opened;
  every entry must be found in the shard it names and every tensor of a shard must be listed;
* ``.bin`` / ``.pth`` / ``.pt`` files are read with ``torch.load(weights_only=True)``, which
  refuses pickles holding anything but tensors and plain containers;
* an unreadable file (empty, truncated, not the format its name says) is a one-line ``ValueError``
  naming the file;
* a file of a source directory (a shard, the index, a file carried to the output) that is a
  symbolic link leading out of the directory is refused, except the Hugging Face cache's
  ``snapshots/<rev>/file -> ../../blobs/<hash>`` (:mod:`.source_links`).

Writing goes through :mod:`ropekit.files` (see :mod:`ropekit.checkpoints.output`).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .source_links import checked_target

INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TORCH_SUFFIXES = (".bin", ".pth", ".pt")
SHARD_SUFFIXES = (".safetensors", *TORCH_SUFFIXES)
#: files of a model directory that hold weights (or optimizer state) and are never carried to the output
WEIGHT_SUFFIXES = (*SHARD_SUFFIXES, ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".pkl", ".npz", ".ot", ".index.json")


@dataclass
class Shard:
    """One file of a checkpoint: ``name`` (file name), ``tensors`` (name -> tensor), ``metadata`` (str -> str)."""

    name: str
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] | None = None


@dataclass
class Checkpoint:
    """A loaded checkpoint: ``shards`` in file order, ``index`` (the index JSON of a sharded set or ``None``).

    ``files`` are the input paths read (the index included), used to refuse writing over them;
    ``directory`` is the directory they are in; ``whole_directory`` tells whether SRC named the
    model directory (or its index), whose other files an output directory then receives.
    """

    shards: list[Shard]
    index: dict[str, Any] | None = None
    index_name: str | None = None
    files: list[Path] = field(default_factory=list)
    directory: Path | None = None
    whole_directory: bool = False

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name, across shards (a view, not a copy)."""
        return {name: t for shard in self.shards for name, t in shard.tensors.items()}


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (library messages can span paragraphs)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _load_safetensors(path: Path) -> Shard:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except OSError:
        raise
    except Exception as exc:  # safetensors raises its own SafetensorError for every malformed file
        raise ValueError(f"{path}: not a readable safetensors file ({first_line(exc)})") from None
    return Shard(path.name, tensors, metadata)


def _load_torch(path: Path) -> Shard:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except OSError:
        raise
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if found:
            raise ValueError(f"{path}: refused by torch.load(weights_only=True): it calls {found.group(1)}, not just "
                             f"tensors; ropekit never unpickles arbitrary objects") from None
        detail = str(exc).split("WeightsUnpickler error:")[-1]
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({first_line(ValueError(detail))})") from None
    except Exception as exc:  # a truncated zip, an empty file, a foreign format
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({first_line(exc)})") from None
    flat = isinstance(state, dict) and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in state.items())
    if not flat:
        raise ValueError(
            f"{path}: expected a flat state dict (str name -> tensor), got {type(state).__name__}"
            + (f" with keys {sorted(map(str, state))[:5]}" if isinstance(state, dict) else "")
        )
    return Shard(path.name, dict(state), None)


def check_regular_file(path: Path) -> None:
    """Refuse ``path`` unless it is a regular file this process can open for reading.

    A FIFO would block the read forever and a device (``/dev/zero``) never ends; a file without
    read permission would fail later inside a reader whose error names no path. Raises
    ``ValueError`` naming ``path`` and what it is.
    """
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or first_line(exc)})") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device, FIFO or socket)"
        raise ValueError(f"{path}: {kind}; expected a checkpoint file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or first_line(exc)})") from None


def _load_file(path: Path) -> Shard:
    check_regular_file(path)
    if path.suffix == ".safetensors":
        return _load_safetensors(path)
    if path.suffix in TORCH_SUFFIXES:
        return _load_torch(path)
    raise ValueError(f"{path}: unknown checkpoint format {path.suffix!r}; expected .safetensors, .bin, .pth or .pt")


def _find_in_dir(directory: Path) -> Path:
    for name in INDEX_NAMES:
        if (directory / name).is_file():
            return directory / name
    for pattern in ("*.safetensors", *(f"*{suffix}" for suffix in TORCH_SUFFIXES)):
        found = sorted(p for p in directory.glob(pattern) if not p.name.startswith(".") and p.is_file())
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(p.name for p in found[:4])
            raise ValueError(f"{directory}: {len(found)} {pattern} files ({names}) and no index file; pass one file")
    raise ValueError(f"{directory}: no checkpoint found (an index {INDEX_NAMES}, *.safetensors, *.bin or *.pth)")


def _check_shard_name(index_path: Path, tensor: Any, shard: Any) -> None:
    """A weight_map entry must map a tensor name to a plain shard file name beside the index."""
    if not isinstance(tensor, str) or not isinstance(shard, str):
        raise ValueError(f"{index_path}: weight_map must map tensor names to shard file names (strings), "
                         f"got {tensor!r}: {shard!r}")
    plain = (shard not in ("", ".", "..") and "/" not in shard and "\\" not in shard and "\0" not in shard
             and not os.path.isabs(shard) and os.path.basename(shard) == shard)
    if not plain:
        raise ValueError(f"{index_path}: weight_map entry {tensor!r} names {shard!r}; a shard must be a file name "
                         f"in the index's own directory (no path), refusing to read outside the checkpoint")
    if not shard.endswith(SHARD_SUFFIXES) or shard == index_path.name:
        raise ValueError(f"{index_path}: weight_map entry {tensor!r} names {shard!r}; expected a "
                         f"{'/'.join(SHARD_SUFFIXES)} shard file")


def read_index(path: Path) -> dict[str, Any]:
    """The parsed index JSON at ``path``, its ``weight_map`` checked (see the module docstring); opens no shard."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a checkpoint index, invalid JSON ({first_line(exc)})") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        got = type(index.get("weight_map")).__name__ if isinstance(index, dict) else type(index).__name__
        raise ValueError(f"{path}: not a checkpoint index: needs a 'weight_map' object, got {got}")
    if not index["weight_map"]:
        raise ValueError(f"{path}: the index's weight_map is empty")
    for tensor, shard in index["weight_map"].items():
        _check_shard_name(path, tensor, shard)
    return index


def _load_sharded(path: Path) -> Checkpoint:
    index = read_index(path)
    weight_map = index["weight_map"]
    shard_names = list(dict.fromkeys(weight_map.values()))
    missing = [name for name in shard_names if not (path.parent / name).is_file()]
    if missing:
        raise ValueError(f"{path}: shard files listed in weight_map are missing: {missing}")
    for name in shard_names:
        checked_target(path.parent / name, path.parent)
    shards = [_load_file(path.parent / name) for name in shard_names]
    for shard in shards:
        for name in shard.tensors:
            if weight_map.get(name) != shard.name:
                raise ValueError(f"{path}: tensor {name!r} is in {shard.name} but the index says "
                                 f"{weight_map.get(name)!r}")
    by_name = {shard.name: shard for shard in shards}
    for name, shard_name in weight_map.items():
        if name not in by_name[shard_name].tensors:
            raise ValueError(f"{path}: weight_map lists tensor {name!r} in {shard_name}, which does not hold it")
    files = [path, *(path.parent / name for name in shard_names)]
    return Checkpoint(shards, index, path.name, files, path.parent, whole_directory=True)


def load_checkpoint(src: str | os.PathLike) -> Checkpoint:
    """Read ``src``: a ``.safetensors`` / ``.bin`` / ``.pth`` file, a ``*.index.json`` or a directory holding either.

    Tensors keep their dtype and bytes. Raises ``ValueError`` (one line, naming the file) for a
    missing, unreadable, refused or inconsistent input.
    """
    path = Path(src)
    if not path.exists():
        raise ValueError(f"SRC does not exist: {path}")
    whole_directory = path.is_dir()
    if whole_directory:
        found = _find_in_dir(path)
        checked_target(found, path)
        path = found
    if path.name.endswith(".index.json"):
        check_regular_file(path)
        return _load_sharded(path)
    return Checkpoint([_load_file(path)], None, None, [path], path.parent, whole_directory=whole_directory)


def carried_files(ckpt: Checkpoint) -> tuple[list[Path], list[str]]:
    """``(files to copy, skipped)``: the non-weight files of the model directory an output directory receives.

    Only when SRC named a directory or an index: every regular file at its top level (hidden files
    left out) except the inputs and weight files of any format (another format's copy of the
    weights would not be converted); ``skipped`` names those left out. A symbolic link is followed
    only inside SRC (or its Hugging Face cache, :mod:`.source_links`); one that leads out of it is
    a ``ValueError``.
    """
    if not ckpt.whole_directory or ckpt.directory is None:
        return [], []
    inputs = {p.name for p in ckpt.files}
    carried, skipped = [], []
    for path in sorted(ckpt.directory.iterdir()):
        if path.name.startswith(".") or path.name in inputs or not path.is_file():
            continue
        if path.name.endswith(WEIGHT_SUFFIXES):
            skipped.append(path.name)
        else:
            checked_target(path, ckpt.directory)
            carried.append(path)
    return carried, skipped


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
