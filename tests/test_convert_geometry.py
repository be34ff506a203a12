"""``ropekit convert``: the head geometry comes from the checkpoint, not from flags that can be wrong.

A 4-query-head / 2-key-value-head model (head_dim 8) converted with ``--heads 2 --kv-heads 1`` or
``--heads 8 --kv-heads 4`` has the same tensor shapes, so only the config (read by default from the
checkpoint's directory), recorded metadata or a tensor that pins ``head_dim`` can tell.
"""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from convert_helpers import H2I, HEAD_DIM, HEADS, HIDDEN, KV, llama_config, run, state
from ropekit import permute_qk_weight
from ropekit.checkpoints import convert as conv
from ropekit.checkpoints.qk_tensors import find_layers
from ropekit.checkpoints.source import HeadSpec
from ropekit.cli.entry import main

torch.set_num_threads(1)

Q0, K0 = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"


def model_dir(tmp_path, config=None, sd=None):
    directory = tmp_path / "model"
    directory.mkdir()
    save_file(sd or state(bias=True), str(directory / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def one_line_error(capsys, argv):
    code = main(["convert", *map(str, argv)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("ropekit convert: error: "), err
    return err


@pytest.mark.parametrize("flags", [("--heads", 2, "--kv-heads", 1), ("--heads", 8, "--kv-heads", 4),
                                   ("--heads", 4, "--kv-heads", 4), ("--kv-heads", 1), ("--head-dim", 16)])
def test_flags_that_contradict_the_config_next_to_src_are_refused(tmp_path, capsys, flags):
    src = model_dir(tmp_path, llama_config())
    err = one_line_error(capsys, [src, tmp_path / "out", "--to", "interleaved", *flags, "--verify"])
    assert "config.json next to SRC says" in err and "--" in err
    assert not (tmp_path / "out").exists()


def test_config_next_to_src_gives_the_geometry_without_flags(tmp_path, capsys):
    sd = state(bias=True)
    src = model_dir(tmp_path, llama_config(), sd)
    assert run(src, tmp_path / "out", "--to", "interleaved", "--verify") == 0
    out = capsys.readouterr().out
    assert "4 query heads, 2 key/value heads, head_dim 8" in out and "config.json next to SRC" in out
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(got[K0], permute_qk_weight(sd[K0], KV, src="half", dst="interleaved"))
    assert torch.equal(got[Q0], permute_qk_weight(sd[Q0], HEADS, src="half", dst="interleaved"))


def test_heads_alone_derives_the_kv_heads_from_the_k_rows(tmp_path, capsys):
    """``--kv-heads`` left out: q and k heads have one size, so the k rows give 2 key/value heads (not 4)."""
    sd = state(bias=True)
    save_file(sd, str(tmp_path / "m.safetensors"))
    assert run(tmp_path / "m.safetensors", tmp_path / "o.safetensors", *H2I, "--heads", HEADS) == 0
    captured = capsys.readouterr()
    assert "2 key/value heads = rows of model.layers.0.self_attn.k_proj.weight / head_dim 8" in captured.out
    assert "note: no config.json" in captured.err  # flags only: said so
    got = load_file(str(tmp_path / "o.safetensors"))
    for name in (K0, "model.layers.1.self_attn.k_proj.bias"):
        assert torch.equal(got[name], permute_qk_weight(sd[name], KV, src="half", dst="interleaved")), name


def test_explicit_kv_heads_that_misfit_the_k_rows_are_refused(tmp_path, capsys):
    save_file(state(), str(tmp_path / "m.safetensors"))
    err = one_line_error(capsys, [tmp_path / "m.safetensors", tmp_path / "o.safetensors", *H2I,
                                  "--heads", HEADS, "--kv-heads", HEADS, "--verify"])
    assert "k_proj.weight' has 16 output rows, but 4 key/value heads x head_dim 8 = 32" in err


@pytest.mark.parametrize("role", ["q", "k"])
def test_a_per_head_norm_pins_head_dim_without_a_config(tmp_path, capsys, role):
    sd = state()
    sd[f"model.layers.0.self_attn.{role}_norm.weight"] = torch.rand(HEAD_DIM) + 0.5
    save_file(sd, str(tmp_path / "m.safetensors"))
    err = one_line_error(capsys, [tmp_path / "m.safetensors", tmp_path / "o.safetensors", *H2I,
                                  "--heads", 2, "--kv-heads", 1])
    assert f"{role}_norm.weight' has shape (8,)" in err and "head_dim 16" in err


def test_a_fused_projection_without_kv_heads_is_refused_not_guessed(tmp_path, capsys):
    """Phi-3 medium's 40 heads / 10 kv heads x 128 has as many rows as 40 / 40 x 64: never guess."""
    rows = (HEADS + 2 * KV) * HEAD_DIM
    sd = {"model.layers.0.self_attn.qkv_proj.weight": torch.randn(rows, HIDDEN)}
    save_file(sd, str(tmp_path / "m.safetensors"))
    err = one_line_error(capsys, [tmp_path / "m.safetensors", tmp_path / "o.safetensors", *H2I, "--heads", HEADS])
    assert "pass --kv-heads" in err
    assert run(tmp_path / "m.safetensors", tmp_path / "o.safetensors", *H2I, "--heads", HEADS, "--kv-heads", KV,
               "--verify") == 0


def test_recorded_geometry_is_a_source_too(tmp_path, capsys):
    """A file converted once records the geometry it used: flags or a config that contradict it are refused."""
    save_file(state(), str(tmp_path / "m.safetensors"))
    assert run(tmp_path / "m.safetensors", tmp_path / "i.safetensors", *H2I, "--heads", HEADS) == 0
    capsys.readouterr()
    with safe_open(str(tmp_path / "i.safetensors"), "pt") as f:
        assert f.metadata()["ropekit_kv_heads"] == "2"
    err = one_line_error(capsys, [tmp_path / "i.safetensors", tmp_path / "b.safetensors", "--to", "half",
                                  "--heads", 8, "--kv-heads", 4])
    assert "the ropekit metadata of SRC says 4 but --heads says 8" in err
    (tmp_path / "wrong.json").write_text(json.dumps(llama_config(heads=2, kv=1, head_dim=16)))
    err = one_line_error(capsys, [tmp_path / "i.safetensors", tmp_path / "b.safetensors", "--to", "half",
                                  "--config", tmp_path / "wrong.json"])
    assert "--config" in err and "says 2" in err


def test_verify_catches_a_conversion_done_with_another_head_split(tmp_path, monkeypatch, capsys):
    """--verify cuts heads with the config's geometry, whatever geometry the conversion used."""
    src = model_dir(tmp_path, llama_config())
    real = conv.convert_layer
    monkeypatch.setattr(conv, "convert_layer", lambda layer, tensors, spec, *a: real(
        layer, tensors, HeadSpec(2, 1, 16, 16), *a))
    assert run(src, tmp_path / "out", "--to", "interleaved", "--verify") == 1
    assert "verification FAILED: attention scores differ" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@given(kv=st.integers(1, 3), group=st.sampled_from([1, 2]), half_dim=st.sampled_from([2, 4]),
       split=st.sampled_from([2, 4]), partial=st.booleans(), src=st.sampled_from(["half", "interleaved"]),
       bias=st.booleans())
def test_every_other_head_split_fails_verification(kv, group, half_dim, split, partial, src, bias):
    """Property: the true geometry verifies to 1e-12; (heads*c, kv*c, head_dim/c, rotary_dim/c) fails.

    (Moving only pass-through channels, past rotary_dim, would be harmless: q and k move alike.)
    """
    heads, head_dim = kv * group, 2 * half_dim * split
    rotary_dim = head_dim // 2 if partial else head_dim  # partial: the wrong split keeps the rotary fraction
    dst = "interleaved" if src == "half" else "half"
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    sd = {Q0: torch.randn(heads * head_dim, HIDDEN, generator=g, dtype=torch.float64),
          K0: torch.randn(kv * head_dim, HIDDEN, generator=g, dtype=torch.float64)}
    if bias:
        sd[Q0.replace("weight", "bias")] = torch.randn(heads * head_dim, generator=g, dtype=torch.float64)
        sd[K0.replace("weight", "bias")] = torch.randn(kv * head_dim, generator=g, dtype=torch.float64)
    layers = find_layers(list(sd))
    true = HeadSpec(heads, kv, head_dim, rotary_dim)
    wrong = HeadSpec(heads * split, kv * split, head_dim // split, rotary_dim // split)

    def convert(spec):
        return {**sd, **conv.convert_layer(layers["model.layers.0.self_attn"], sd, spec, src, dst)}

    assert conv.verify_layers(sd, convert(true), layers, true, src, dst) < 1e-12
    assert conv.verify_layers(sd, convert(wrong), layers, true, src, dst) > 1e-3


def test_the_true_geometry_passes_and_the_wrong_one_verifies_only_against_itself():
    """Why flags alone cannot be checked: a wrong split verifies against its own wrong geometry."""
    sd = state(layers=1, bias=True)
    sd = {k: v.double() if v.is_floating_point() else v for k, v in sd.items()}
    layers = find_layers(list(sd))
    wrong = HeadSpec(2, 1, 16, 16)
    after = {**sd, **conv.convert_layer(layers["model.layers.0.self_attn"], sd, wrong, "half", "interleaved")}
    assert conv.verify_layers(sd, after, layers, wrong, "half", "interleaved") < 1e-12
    assert conv.verify_layers(sd, after, layers, HeadSpec(HEADS, KV, HEAD_DIM, HEAD_DIM), "half", "interleaved") > 1e-3


def test_an_unreadable_config_next_to_src_is_refused_not_skipped(tmp_path, capsys):
    src = model_dir(tmp_path, {"architectures": ["Something"], "vocab_size": 10})
    err = one_line_error(capsys, [src, tmp_path / "out", *H2I, "--heads", HEADS])
    assert "config.json next to SRC: cannot read the head geometry" in err and "directory of their own" in err


@pytest.mark.parametrize("flags", [("--heads", 0), ("--heads", -4), ("--heads", 4, "--kv-heads", 0),
                                   ("--heads", 4, "--head-dim", -8)])
def test_non_positive_flags_are_refused(tmp_path, capsys, flags):
    save_file(state(), str(tmp_path / "m.safetensors"))
    err = one_line_error(capsys, [tmp_path / "m.safetensors", tmp_path / "o.safetensors", *H2I, *flags])
    assert "must be a positive int" in err
