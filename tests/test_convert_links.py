"""``ropekit convert`` and symbolic links in SRC: never out of SRC, never a wider mode than the source's.

A model directory whose ``tokenizer.json`` links to a private file elsewhere (a ``0600`` token,
``/etc/shadow``) must not become a copy of that file in DST: such a link is refused in one line
(exit 2) before anything is written. Links that stay inside SRC, and the Hugging Face cache's own
``snapshots/<rev>/file -> ../../blobs/<hash>``, are followed. A copy keeps at most its source's
permission bits.
"""

import json
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from convert_helpers import cli, llama_config, run, state, write_sharded

torch.set_num_threads(1)

TOKEN = "hf_private_token_do_not_copy\n"


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def model_dir(directory):
    """A single-file model directory with its config, as people keep them."""
    directory.mkdir()
    save_file(state(), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(llama_config()))
    return directory


def private_token(tmp_path):
    token = tmp_path / "elsewhere" / "token"
    token.parent.mkdir()
    token.write_text(TOKEN)
    os.chmod(token, 0o600)
    return token


def assert_one_line_refusal(done, *words):
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_a_carried_link_out_of_src_is_refused(tmp_path):
    src = model_dir(tmp_path / "model")
    (src / "tokenizer.json").symlink_to(private_token(tmp_path))
    done = cli(src, tmp_path / "out", "--to", "interleaved")
    assert_one_line_refusal(done, "tokenizer.json", "outside SRC")
    assert not (tmp_path / "out").exists()
    assert TOKEN not in done.stdout + done.stderr


def test_a_shard_link_out_of_src_is_refused(tmp_path):
    outside = write_sharded(state(), tmp_path / "outside")
    src = tmp_path / "model"
    src.mkdir()
    for name in ("model.safetensors.index.json", "model-00001-of-00002.safetensors"):
        os.rename(outside / name, src / name)
    (src / "model-00002-of-00002.safetensors").symlink_to(outside / "model-00002-of-00002.safetensors")
    (src / "config.json").write_text(json.dumps(llama_config()))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors.* outside SRC"):
        run(src, tmp_path / "out", "--to", "interleaved")
    assert not (tmp_path / "out").exists()


def test_links_inside_src_are_followed(tmp_path):
    src = model_dir(tmp_path / "model")
    (src / "tokenizers").mkdir()
    (src / "tokenizers" / "tok.json").write_text('{"inside": true}')
    (src / "tokenizer.json").symlink_to("tokenizers/tok.json")
    assert run(src, tmp_path / "out", "--to", "interleaved") == 0
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"inside": true}'


def test_the_hugging_face_cache_layout_is_followed(tmp_path):
    """``models--org--name/snapshots/<rev>/<file> -> ../../blobs/<hash>``: the cache's own links."""
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    save_file(state(), str(blobs / "aaaa"))
    (blobs / "bbbb").write_text(json.dumps(llama_config()))
    (blobs / "cccc").write_text('{"tokenizer": 1}')
    for name, blob in (("model.safetensors", "aaaa"), ("config.json", "bbbb"), ("tokenizer.json", "cccc")):
        (snapshot / name).symlink_to(f"../../blobs/{blob}")
    assert run(snapshot, tmp_path / "out", "--to", "interleaved") == 0
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"tokenizer": 1}'
    assert not (tmp_path / "out" / "tokenizer.json").is_symlink()


def test_a_link_to_another_cache_repo_is_refused(tmp_path):
    hub = tmp_path / "hub"
    snapshot = hub / "models--org--tiny" / "snapshots" / "0123abcd"
    other_blobs = hub / "models--org--other" / "blobs"
    snapshot.mkdir(parents=True)
    other_blobs.mkdir(parents=True)
    save_file(state(), str(snapshot / "model.safetensors"))
    (snapshot / "config.json").write_text(json.dumps(llama_config()))
    (other_blobs / "dddd").write_text(TOKEN)
    (snapshot / "tokenizer.json").symlink_to("../../../models--org--other/blobs/dddd")
    with pytest.raises(ValueError, match="tokenizer.json.* outside SRC"):
        run(snapshot, tmp_path / "out", "--to", "interleaved")
    assert not (tmp_path / "out").exists()


def test_a_copy_never_gets_a_wider_mode_than_its_source(tmp_path):
    src = model_dir(tmp_path / "model")
    (src / "tokenizer.json").write_text('{"private": true}')
    os.chmod(src / "tokenizer.json", 0o600)
    os.chmod(src / "config.json", 0o640)
    done = cli(src, tmp_path / "out", "--to", "interleaved")  # the tests' umask is 022 or narrower
    assert done.returncode == 0, done.stderr
    assert mode(tmp_path / "out" / "tokenizer.json") == 0o600
    assert mode(tmp_path / "out" / "config.json") & ~0o640 == 0
