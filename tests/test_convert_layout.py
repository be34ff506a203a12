"""``ropekit convert``: the source layout is read, never assumed, and a no-op conversion is refused.

``--to half`` on a half-split checkpoint used to default ``--from`` to "the other one" and scramble it.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from convert_helpers import HEADS, KV, RECORDED, digest, llama_config, run, state, write_sharded
from ropekit import permute_qk_weight
from ropekit.cli.entry import main

torch.set_num_threads(1)

WQ = "layers.0.attention.wq.weight"


def refused(capsys, *argv):
    code = main(["convert", *map(str, argv)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    return err


def meta_dir(tmp_path):
    directory = tmp_path / "meta"
    directory.mkdir()
    torch.save(state(meta=True), directory / "consolidated.00.pth")
    params = {"dim": HEADS * 8, "n_heads": HEADS, "n_kv_heads": KV, "n_layers": 2, "rope_theta": 10000.0}
    (directory / "params.json").write_text(json.dumps(params))
    return directory


def test_hf_config_means_half_and_a_conversion_to_half_is_refused(tmp_path, capsys):
    src = write_sharded(state(), tmp_path / "hf")
    (src / "config.json").write_text(json.dumps(llama_config()))
    before = digest(src)
    err = refused(capsys, src, tmp_path / "out", "--to", "half")
    assert "already in the half layout (config.json next to SRC)" in err
    err = refused(capsys, src, tmp_path / "out", "--from", "interleaved", "--to", "half")
    assert "--from interleaved contradicts config.json next to SRC" in err
    assert not (tmp_path / "out").exists() and digest(src) == before
    assert run(src, tmp_path / "out", "--to", "interleaved") == 0  # --from read off the config
    assert "SRC layout half (config.json next to SRC)" in capsys.readouterr().out


def test_interleaved_model_types_and_rope_interleave_mean_interleaved(tmp_path, capsys):
    for name, config in (("gptj", llama_config(model_type="gptj")),
                         ("flagged", llama_config(rope_interleave=True))):
        src = tmp_path / name
        src.mkdir()
        save_file(state(), str(src / "model.safetensors"))
        (src / "config.json").write_text(json.dumps(config))
        assert "already in the interleaved layout" in refused(capsys, src, tmp_path / f"{name}-out", "--to",
                                                             "interleaved")
        assert run(src, tmp_path / f"{name}-out", "--to", "half") == 0


def test_meta_params_json_means_interleaved(tmp_path, capsys):
    src = meta_dir(tmp_path)
    sd = torch.load(src / "consolidated.00.pth", weights_only=True)
    assert "already in the interleaved layout (params.json next to SRC)" in refused(
        capsys, src / "consolidated.00.pth", tmp_path / "o.safetensors", "--to", "interleaved")
    assert run(src / "consolidated.00.pth", tmp_path / "o.safetensors", "--to", "half", "--verify") == 0
    out = load_file(str(tmp_path / "o.safetensors"))
    assert torch.equal(out[WQ], permute_qk_weight(sd[WQ], HEADS, src="interleaved", dst="half"))


def test_with_both_configs_each_goes_with_its_own_tensor_names(tmp_path, capsys):
    """Mistral repositories ship Meta-named consolidated weights, params.json, HF shards and config.json together."""
    src = meta_dir(tmp_path)
    save_file(state(), str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(llama_config()))
    assert run(src / "consolidated.00.pth", tmp_path / "a.safetensors", "--to", "half") == 0
    assert "params.json next to SRC" in capsys.readouterr().out
    assert run(src / "model.safetensors", tmp_path / "b.safetensors", "--to", "interleaved") == 0
    assert "config.json next to SRC" in capsys.readouterr().out


def test_recorded_layout_beats_the_carried_config(tmp_path, capsys):
    """The metadata of an interleaved output decides, also beside the config an older ropekit carried (saying half)."""
    src = write_sharded(state(), tmp_path / "hf")
    (src / "config.json").write_text(json.dumps(llama_config()))
    assert run(src, tmp_path / "inter", "--to", "interleaved") == 0
    assert json.loads((tmp_path / "inter" / "config.json").read_text())["rope_layout"] == "interleaved"
    (tmp_path / "inter" / "config.json").write_text((src / "config.json").read_text())  # as an older ropekit left it
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with safe_open(str(tmp_path / "inter" / shard), "pt") as f:
            assert f.metadata() == {"format": "pt", "origin": shard, "ropekit_layout": "interleaved", **RECORDED}
    capsys.readouterr()
    assert "already in the interleaved layout (the ropekit metadata of SRC)" in refused(
        capsys, tmp_path / "inter", tmp_path / "again", "--to", "interleaved")
    assert "contradicts the ropekit metadata" in refused(
        capsys, tmp_path / "inter", tmp_path / "again", "--from", "half", "--to", "half")
    assert run(tmp_path / "inter", tmp_path / "back", "--to", "half", "--verify") == 0
    assert (tmp_path / "back" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert index == json.loads((src / "model.safetensors.index.json").read_text())
    back = {}
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        back.update(load_file(str(tmp_path / "back" / shard)))
    assert all(torch.equal(back[k], v) for k, v in state().items())


def test_no_evidence_and_no_from_is_refused(tmp_path, capsys):
    save_file(state(), str(tmp_path / "m.safetensors"))
    err = refused(capsys, tmp_path / "m.safetensors", tmp_path / "o.safetensors", "--to", "half", "--heads", HEADS)
    assert "cannot tell the layout of SRC" in err and "pass --from" in err
    err = refused(capsys, tmp_path / "m.safetensors", tmp_path / "o.safetensors", "--from", "half", "--to", "half",
                  "--heads", HEADS)
    assert "already in the half layout (--from)" in err
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("second", [{"format": "pt"}, {"format": "pt", "ropekit_layout": "half", **RECORDED}])
def test_shards_recording_different_layouts_are_refused(tmp_path, capsys, second):
    src = write_sharded(state(), tmp_path / "mixed")
    first = src / "model-00001-of-00002.safetensors"
    save_file(load_file(str(first)), str(first), metadata={"format": "pt", "ropekit_layout": "interleaved", **RECORDED})
    other = src / "model-00002-of-00002.safetensors"
    save_file(load_file(str(other)), str(other), metadata=second)
    assert "a mixed checkpoint cannot be converted" in refused(capsys, src, tmp_path / "out", "--to", "half")
