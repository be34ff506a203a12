"""``ropekit convert`` asks the q/k weights which pairing they were trained with (a second witness).

A conversion the weights decidedly call a no-op (SRC already in the ``--to`` layout, whatever the
config, metadata or ``--from`` say) is refused with one line and exit code 2, nothing written,
unless ``--skip-layout-check``; undecided weights never refuse; a contradiction between the
config and the weights is reported in the message. Weights "look trained" by construction
(tests/pairing_helpers.py); real models are in tests/test_pairing_models.py.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from convert_helpers import digest, llama_config, run, state
from pairing_helpers import smooth_heads, trained_like_state
from ropekit.checkpoints import convert_checkpoint, detect_checkpoint_layout
from ropekit.checkpoints.convert import HeadSpec
from ropekit.cli.entry import main

torch.set_num_threads(1)
GEOMETRY = {"heads": 4, "kv": 2, "head_dim": 16}


def checkpoint(tmp_path, layout, *, config=True, name="src"):
    directory = tmp_path / name
    directory.mkdir()
    save_file(trained_like_state(layout), str(directory / "model.safetensors"))
    if config:
        (directory / "config.json").write_text(json.dumps(llama_config(head_dim=16)))  # a Llama config says half
    return directory


def refused(capsys, *argv):
    code = main(["convert", *map(str, argv)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    return err


def test_rows_that_look_interleaved_under_a_half_config_are_not_converted_to_interleaved(tmp_path, capsys):
    src = checkpoint(tmp_path, "interleaved")  # e.g. llama.cpp's rows with a transformers config beside them
    before = digest(src)
    err = refused(capsys, src, tmp_path / "out", "--to", "interleaved")
    assert "q/k weights already look interleaved (interleaved (z = -" in err
    assert "although config.json next to SRC says half" in err and "--skip-layout-check" in err
    assert not (tmp_path / "out").exists() and digest(src) == before

    err = refused(capsys, src, tmp_path / "out", "--to", "half")  # the config calls this a no-op: report the conflict
    assert "already in the half layout (config.json next to SRC)" in err
    assert "but SRC's q/k weights look interleaved" in err and "contradicts it" in err
    assert not (tmp_path / "out").exists() and digest(src) == before


def test_skip_layout_check_converts_anyway_and_says_so(tmp_path, capsys):
    src = checkpoint(tmp_path, "interleaved")
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "interleaved", "--skip-layout-check"]) == 0
    captured = capsys.readouterr()
    assert "warning: SRC's q/k weights already look interleaved" in captured.err
    assert "converting anyway (--skip-layout-check)" in captured.err
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert not torch.equal(out["model.layers.0.self_attn.q_proj.weight"],
                           trained_like_state("interleaved")["model.layers.0.self_attn.q_proj.weight"])


def test_weights_that_agree_with_the_config_convert_and_the_output_reads_the_other_way(tmp_path, capsys):
    src = checkpoint(tmp_path, "half")
    assert run(src, tmp_path / "out", "--to", "interleaved") == 0
    printed = capsys.readouterr().out
    assert "SRC layout half (config.json next to SRC)" in printed and "q/k weights: half (z = +" in printed
    evidence = detect_checkpoint_layout(tmp_path / "out")
    assert evidence.layout == "interleaved" and evidence.heads == 3 * (4 + 2)
    assert detect_checkpoint_layout(src).layout == "half"


def test_from_flag_is_checked_against_the_weights(tmp_path, capsys):
    src = checkpoint(tmp_path, "interleaved", config=False)
    err = refused(capsys, src / "model.safetensors", tmp_path / "o.safetensors", "--heads", 4, "--from", "half",
                  "--to", "interleaved")
    assert "although --from says half" in err
    assert run(src / "model.safetensors", tmp_path / "o.safetensors", "--heads", 4, "--from", "interleaved", "--to",
               "half") == 0
    assert detect_checkpoint_layout(tmp_path / "o.safetensors").layout == "half"  # recorded metadata gives heads


def test_without_a_layout_source_the_message_says_what_the_weights_look_like(tmp_path, capsys):
    src = checkpoint(tmp_path, "half", config=False)
    err = refused(capsys, src / "model.safetensors", tmp_path / "o.safetensors", "--heads", 4, "--to", "interleaved")
    assert "pass --from half or --from interleaved; the q/k weights look half (z = +" in err


def test_recorded_metadata_is_checked_too(tmp_path, capsys):
    """A file whose ropekit_layout metadata says half while its rows are interleaved (edited by hand)."""
    sd = trained_like_state("interleaved")
    save_file(sd, str(tmp_path / "m.safetensors"), metadata={"ropekit_layout": "half", "ropekit_heads": "4",
                                                             "ropekit_kv_heads": "2", "ropekit_head_dim": "16"})
    err = refused(capsys, tmp_path / "m.safetensors", tmp_path / "o.safetensors", "--to", "interleaved")
    assert "although the ropekit metadata of SRC says half" in err


def test_random_weights_are_undecided_and_convert(tmp_path, capsys):
    src = tmp_path / "random"
    src.mkdir()
    save_file(state(), str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(llama_config()))
    assert run(src, tmp_path / "out", "--to", "interleaved") == 0
    assert "q/k weights: undecided (" in capsys.readouterr().out


def test_library_call_modes(tmp_path):
    src = checkpoint(tmp_path, "interleaved")
    spec = HeadSpec(4, 2, 16, 16)
    with pytest.raises(ValueError, match="already look interleaved"):
        convert_checkpoint(src, tmp_path / "a", spec, dst_layout="interleaved")
    result = convert_checkpoint(src, tmp_path / "b", spec, dst_layout="interleaved", layout_check="skip")
    assert result.layout_evidence.layout == "interleaved" and "converting anyway" in result.layout_warning
    result = convert_checkpoint(src, tmp_path / "c", spec, dst_layout="interleaved", layout_check="off")
    assert result.layout_evidence is None and result.layout_warning is None
    with pytest.raises(ValueError, match=r"layout_check must be one of \('on', 'skip', 'off'\), got 'maybe'"):
        convert_checkpoint(src, tmp_path / "d", spec, dst_layout="half", layout_check="maybe")


def test_fused_projections_and_q_norms_are_read(tmp_path):
    """Phi-3 qkv_proj rows and Qwen3-style q/k norms (per head) take part in the vote."""
    heads, kv, d, hidden = 4, 2, 16, 32
    sd = {}
    for i in range(3):
        q = smooth_heads(heads, d, layout="interleaved", in_features=hidden, seed=10 * i)
        k = smooth_heads(kv, d, layout="interleaved", in_features=hidden, seed=10 * i + 1)
        sd[f"model.layers.{i}.self_attn.qkv_proj.weight"] = torch.cat([q, k, torch.randn(kv * d, hidden).double()])
    config = {"model_type": "phi3", "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": d}
    save_file(sd, str(tmp_path / "fused.safetensors"))
    got = detect_checkpoint_layout(tmp_path / "fused.safetensors", config=config)
    assert got.layout == "interleaved" and got.heads == 3 * (heads + kv)

    flat = {}
    for i in range(3):
        for role, n in (("q", heads), ("k", kv)):
            w = torch.randn(n * d, hidden, dtype=torch.float64)
            flat[f"model.layers.{i}.self_attn.{role}_proj.weight"] = w / w.norm(dim=1, keepdim=True)
            profile = smooth_heads(1, d, layout="half", in_features=4, seed=i).norm(dim=1)
            flat[f"model.layers.{i}.self_attn.{role}_norm.weight"] = profile
    save_file(flat, str(tmp_path / "normed.safetensors"))
    got = detect_checkpoint_layout(tmp_path / "normed.safetensors", HeadSpec(heads, kv, d))
    assert got.layout == "half", got
