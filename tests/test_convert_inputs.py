"""``ropekit convert`` reads nothing outside its input and refuses outputs that would harm it.

Hostile indexes (a ``weight_map`` naming ``../../x.safetensors`` or an absolute path, an entry no
shard holds) are refused before any file outside the checkpoint is opened: a tripwire file there
records every attempt to open it.
"""

import builtins
import io
import json
import os

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

from convert_helpers import H2I, HEADS, digest, llama_config, run, state, write_sharded

torch.set_num_threads(1)

EXTRA = "model.layers.9.self_attn.o_proj.weight"


@pytest.fixture
def tripwire(tmp_path, monkeypatch):
    """A valid safetensors file outside the checkpoint; opening it by any route fails the test."""
    outside = tmp_path / "outside"
    outside.mkdir()
    path = outside / "x.safetensors"
    save_file({EXTRA: torch.ones(2, 2)}, str(path))
    opened = []

    def guard(real):
        def wrapper(file, *args, **kwargs):
            if isinstance(file, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(file)) == str(path):
                opened.append(file)
                raise AssertionError(f"opened the tripwire {file}")
            return real(file, *args, **kwargs)
        return wrapper

    for module, name in ((builtins, "open"), (io, "open"), (os, "open"), (safetensors, "safe_open"), (torch, "load")):
        monkeypatch.setattr(module, name, guard(getattr(module, name)))
    yield path
    assert opened == []


@pytest.mark.parametrize("entry", ["../../outside/x.safetensors", "ABSOLUTE", "../outside/../outside/x.safetensors",
                                   "sub/x.safetensors", "..", "model.safetensors.index.json", "x.txt"])
def test_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, tripwire, entry):
    (tmp_path / "models").mkdir()
    src = write_sharded(state(), tmp_path / "models" / "m")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][EXTRA] = str(tripwire) if entry == "ABSOLUTE" else entry
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="weight_map entry .*o_proj.weight.* names"):
        run(src, tmp_path / "out", *H2I, "--heads", HEADS)
    assert not (tmp_path / "out").exists()


def test_an_index_entry_no_shard_holds_is_refused(tmp_path):
    src = write_sharded(state(), tmp_path / "m")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lists tensor 'ghost.weight' in model-00001-of-00002.safetensors, which"):
        run(src, tmp_path / "out", *H2I, "--heads", HEADS)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("index", [{"weight_map": {"a": 5}}, {"weight_map": ["a"]}, [], {"weight_map": {}},
                                   {"metadata": {}}])
def test_malformed_indexes_are_value_errors(tmp_path, index):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        run(tmp_path / "m", tmp_path / "out", *H2I, "--heads", HEADS)


def test_dst_directory_is_created_with_its_parents(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    save_file(state(), str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(llama_config()))
    assert run(src, tmp_path / "a" / "b" / "new", "--to", "interleaved") == 0
    assert sorted(p.name for p in (tmp_path / "a" / "b" / "new").iterdir()) == ["config.json", "model.safetensors"]


def test_an_existing_empty_directory_needs_no_force_and_a_checkpoint_directory_does(tmp_path):
    save_file(state(), str(tmp_path / "m.safetensors"))
    (tmp_path / "empty").mkdir()
    assert run(tmp_path / "m.safetensors", tmp_path / "empty", *H2I, "--heads", HEADS) == 0
    assert load_file(str(tmp_path / "empty" / "m.safetensors")).keys() == state().keys()
    with pytest.raises(FileExistsError, match="--force"):
        run(tmp_path / "m.safetensors", tmp_path / "empty", *H2I, "--heads", HEADS)


@pytest.mark.parametrize("content", ["subdirectory", "no checkpoint"])
def test_force_never_replaces_a_directory_that_is_not_a_converted_checkpoint(tmp_path, content):
    save_file(state(), str(tmp_path / "m.safetensors"))
    dst = tmp_path / "project"
    dst.mkdir()
    (dst / "notes.txt").write_text("precious")
    if content == "subdirectory":
        save_file(state(), str(dst / "model.safetensors"))
        (dst / "src").mkdir()
        (dst / "src" / "code.py").write_text("precious")
    before = digest(dst)
    with pytest.raises(ValueError, match="convert only replaces a directory that holds a converted checkpoint"):
        run(tmp_path / "m.safetensors", dst, *H2I, "--heads", HEADS, "--force")
    assert digest(dst) == before


def test_dst_that_holds_the_input_is_refused_even_with_force(tmp_path):
    (tmp_path / "models").mkdir()
    src = write_sharded(state(), tmp_path / "models" / "m")
    before = digest(tmp_path / "models")
    for dst in (src, tmp_path / "models", tmp_path):
        with pytest.raises(ValueError, match="holds the input"):
            run(src, dst, *H2I, "--heads", HEADS, "--force")
    (tmp_path / "models" / "link").symlink_to(src)
    with pytest.raises(ValueError, match="holds the input"):
        run(src, tmp_path / "models" / "link", *H2I, "--heads", HEADS, "--force")
    assert digest(tmp_path / "models") == before


@pytest.mark.parametrize("dst", ["x.safetensors", "x.bin", "x.json"])
def test_dst_names_that_cannot_hold_the_output_are_refused(tmp_path, dst):
    src = write_sharded(state(), tmp_path / "m")
    with pytest.raises(ValueError, match="DST"):
        run(src, tmp_path / dst, *H2I, "--heads", HEADS)
    assert not (tmp_path / dst).exists()


def test_dst_symlink_is_written_through(tmp_path):
    save_file(state(), str(tmp_path / "m.safetensors"))
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert run(tmp_path / "m.safetensors", tmp_path / "link", *H2I, "--heads", HEADS) == 0
    assert (tmp_path / "link").is_symlink()
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["m.safetensors"]
