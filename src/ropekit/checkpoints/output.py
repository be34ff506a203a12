"""Where ``ropekit convert`` writes, what it refuses to write over, and how it writes all-or-nothing.

DST is a ``.safetensors`` file (single-file input only) or a directory (created if missing). A
directory output is the model directory: the converted shards, the index of a sharded input, and
the non-weight files of the source directory (config, tokenizer, ...; see
:func:`ropekit.checkpoints.storage.carried_files`), byte for byte except a ``config.json`` that
would claim another layout than the rows' (:mod:`.carried_config`).

Everything is built in a staging directory beside DST (:mod:`ropekit.files`), optionally
checked there (``--verify`` reads the staged files back), and only then moved into place with one
rename (a file) or one atomic exchange (a directory). An interrupted run leaves DST as it was: an
old complete output, nothing, or (where the system cannot exchange directories) briefly no DST;
never a mix of old and new files. Its staging directory is removed by the next run.

Refused before anything is written: DST that is, holds or replaces an input file; an existing
output without ``force``; a directory DST that is not empty and does not look like a converted
checkpoint (files only, with weights) -- ``force`` replaces such a directory as a whole and will
not delete anything else; DST that is a device, a named pipe or a socket, with ``force`` or not.

A carried file is copied from its checked source (a link must stay inside SRC, see
:mod:`.source_links`) and gets no permission bit its source lacks: a ``0o600`` token stays ``0o600``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import files
from . import storage as checkpoint_io
from .source_links import open_source
from .storage import INDEX_NAMES, SHARD_SUFFIXES, Checkpoint, carried_files, safetensors_name


@dataclass
class OutputPlan:
    """The outputs: ``dst`` (a file or directory), ``names`` (input shard name -> output file name), index, carried."""

    dst: Path
    is_directory: bool
    names: dict[str, str]
    index_name: str | None = None
    carried: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def paths(self) -> list[Path]:
        """The final paths of every output file."""
        if not self.is_directory:
            return [self.dst]
        names = [*self.names.values(), *([self.index_name] if self.index_name else []), *(p.name for p in self.carried)]
        return [self.dst / name for name in names]


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def _input_paths(ckpt: Checkpoint, carried: list[Path]) -> list[Path]:
    """Every input path, both as given (its directory resolved) and with every symlink resolved."""
    out = []
    for path in [*ckpt.files, *carried]:
        out += [Path(os.path.realpath(path.parent)) / path.name, Path(os.path.realpath(path))]
    return out


def _holds_checkpoint(directory: Path) -> bool:
    return any(p.name in INDEX_NAMES or p.name.endswith(SHARD_SUFFIXES) for p in directory.iterdir())


def _check_directory_dst(dst: Path, inputs: list[Path], force: bool) -> None:
    files.check_not_special(dst, "DST")
    real = Path(os.path.realpath(dst))
    for path in inputs:
        if _inside(path, real):
            raise ValueError(f"DST {dst} holds the input {path}; refusing to replace the input, choose another DST")
    if not dst.exists():
        return
    if not dst.is_dir():
        raise ValueError(f"DST {dst} is a file, but this output is a directory")
    entries = sorted(p.name for p in dst.iterdir())
    if not entries:
        return
    subdirectories = sorted(p.name for p in dst.iterdir() if p.is_dir())
    if subdirectories or not _holds_checkpoint(dst):
        why = f"subdirectories {subdirectories[:4]}" if subdirectories else f"no checkpoint among {entries[:4]}"
        raise ValueError(f"DST {dst} is a directory with {why}; convert only replaces a directory that holds a "
                         f"converted checkpoint (files only); choose a new or empty directory (or name a "
                         f".safetensors file for a single-file input)")
    if not force:
        raise FileExistsError(f"output exists (pass --force to replace it): {dst} holds {', '.join(entries[:4])}")


def _check_file_dst(dst: Path, inputs: list[Path], force: bool) -> None:
    files.check_not_special(dst, "DST")
    real = Path(os.path.realpath(dst))
    for path in inputs:
        if real == path or (dst.exists() and path.exists() and dst.samefile(path)):
            raise ValueError(f"DST {dst} is the input file {path}; refusing to overwrite the input")
    if dst.exists() and not force:
        raise FileExistsError(f"output exists (pass --force to overwrite): {dst}")


def plan_output(ckpt: Checkpoint, dst: str | Path, *, force: bool) -> OutputPlan:
    """Decide the outputs for ``dst`` and refuse the unsafe ones (see the module docstring); writes nothing."""
    named_directory = str(dst).endswith(("/", os.sep))
    dst = Path(os.path.realpath(dst))  # "." and symlinks: write where they point
    sharded = ckpt.index is not None
    as_directory = dst.is_dir() or named_directory or (not dst.exists() and dst.suffix != ".safetensors")
    if sharded and not as_directory:
        raise ValueError(f"DST {dst}: a sharded checkpoint needs a directory, got a file name")
    if as_directory and not dst.exists() and dst.suffix in (*SHARD_SUFFIXES, ".json"):
        raise ValueError(f"DST {dst}: the output is always safetensors; name a .safetensors file or a directory")
    if not as_directory:
        _check_file_dst(dst, _input_paths(ckpt, []), force)
        return OutputPlan(dst, False, {ckpt.shards[0].name: dst.name})
    carried, skipped = carried_files(ckpt)
    _check_directory_dst(dst, _input_paths(ckpt, carried), force)
    names = {shard.name: safetensors_name(shard.name) for shard in ckpt.shards}
    index_name = None
    if sharded:
        index_name = ckpt.index_name.replace("pytorch_model.bin", "model.safetensors")
    return OutputPlan(dst, True, names, index_name, carried, skipped)


def _save(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Callable[[Path], None]:
    return lambda path: checkpoint_io.save_safetensors(tensors, str(path), metadata)


def _copy_carried(source: Path, directory: Path, path: Path, contents: bytes | None = None) -> None:
    """Copy the carried ``source`` of SRC ``directory`` (or ``contents``) to the staged ``path``, mode <= source's."""
    fd, mode = open_source(source, directory)
    with os.fdopen(fd, "rb") as reader:
        def copy(target: Path) -> None:
            with open(target, "r+b") as writer:
                if contents is None:
                    shutil.copyfileobj(reader, writer, 1 << 20)
                else:
                    writer.write(contents)

        files.write_file(path, copy, mode_limit=mode)


def write_output(
    plan: OutputPlan,
    ckpt: Checkpoint,
    converted: dict[str, torch.Tensor],
    metadata: dict[str, str],
    check: Callable[[Path], bool] | None = None,
    rewritten: dict[str, bytes] | None = None,
) -> list[Path]:
    """Write the outputs of ``plan`` all-or-nothing; return their final paths, or ``[]`` if ``check`` refused.

    Each shard gets ``converted`` tensors in place of the source's, and its own metadata updated
    with ``metadata``; a carried file named in ``rewritten`` gets those contents instead of its
    source's (``config.json``, see :mod:`.carried_config`). ``check(path)`` sees the staged output
    (the directory, or the file) before it is moved into place; returning ``False`` discards it.
    """
    parent = plan.dst.parent
    parent.mkdir(parents=True, exist_ok=True)
    with files.staging_directory(parent) as stage:
        root = stage / "output" if plan.is_directory else stage
        if plan.is_directory:
            files.make_directory(root)
        for shard in ckpt.shards:
            tensors = {name: converted.get(name, t) for name, t in shard.tensors.items()}
            shard_metadata = {"format": "pt", **(shard.metadata or {}), **metadata}
            files.write_file(root / plan.names[shard.name], _save(tensors, shard_metadata))
        if plan.index_name is not None:
            index = dict(ckpt.index)
            index["weight_map"] = {name: plan.names[shard] for name, shard in ckpt.index["weight_map"].items()}
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            files.write_file(root / plan.index_name, lambda path: path.write_text(text, encoding="utf-8"))
        for source in plan.carried:
            _copy_carried(source, ckpt.directory, root / source.name, (rewritten or {}).get(source.name))
        staged = root if plan.is_directory else root / plan.dst.name
        if check is not None and not check(staged):
            return []
        if plan.is_directory:
            files.replace_directory(root, plan.dst)
        else:
            files.replace_file(staged, plan.dst)
    return plan.paths()
