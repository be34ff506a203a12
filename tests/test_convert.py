"""``ropekit convert``: layout conversion of checkpoints (safetensors single/sharded, torch .bin)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from convert_helpers import (
    H2I,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV,
    RECORDED,
    assert_identical,
    digest,
    parse,
    run,
    state,
    write_sharded,
)
from ropekit.checkpoints import convert as conv
from ropekit.checkpoints import storage as checkpoint_io
from ropekit.cli import convert as cli_convert

torch.set_num_threads(1)


def test_single_file_round_trip_bit_exact(tmp_path):
    sd = state(bias=True)
    src = tmp_path / "model.safetensors"
    save_file(sd, str(src), metadata={"format": "pt", "note": "keep me"})
    before = digest(src)
    assert run(src, tmp_path / "inter.safetensors", *H2I,
               "--heads", HEADS, "--kv-heads", KV) == 0
    # the way back needs no flags: the first run recorded the layout and the geometry it used
    assert run(tmp_path / "inter.safetensors", tmp_path / "back.safetensors", "--to", "half") == 0
    assert digest(src) == before  # input untouched
    inter = load_file(str(tmp_path / "inter.safetensors"))
    assert_identical(load_file(str(tmp_path / "back.safetensors")), sd)
    for name in sd:
        changed = not torch.equal(inter[name].float(), sd[name].float())
        assert changed == (("q_proj" in name) or ("k_proj" in name)), name
        assert inter[name].dtype == sd[name].dtype
    with safe_open(str(tmp_path / "inter.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "keep me", **RECORDED, "ropekit_layout": "interleaved"}
    with safe_open(str(tmp_path / "back.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "keep me", **RECORDED, "ropekit_layout": "half"}


def test_permutation_matches_layouts_permute(tmp_path):
    sd = state(bias=True)
    src = tmp_path / "m.safetensors"
    save_file(sd, str(src))
    run(src, tmp_path / "o.safetensors", *H2I, "--heads", HEADS, "--kv-heads", KV)
    out = load_file(str(tmp_path / "o.safetensors"))
    from ropekit import permute_qk_weight

    cases = (("model.layers.0.self_attn.q_proj.weight", HEADS), ("model.layers.1.self_attn.k_proj.bias", KV))
    for name, heads in cases:
        assert torch.equal(out[name], permute_qk_weight(sd[name], heads, src="half", dst="interleaved"))


def test_sharded_with_index(tmp_path):
    sd = state(layers=3, bias=True)
    src = write_sharded(sd, tmp_path / "src")
    before = digest(src)
    assert run(src / "model.safetensors.index.json", tmp_path / "dst", *H2I,
               "--heads", HEADS, "--kv-heads", KV, "--verify") == 0
    assert run(tmp_path / "dst", tmp_path / "back", "--to", "half", "--verify") == 0
    assert digest(src) == before
    for d in ("dst", "back"):
        index = json.loads((tmp_path / d / "model.safetensors.index.json").read_text())
        assert index == json.loads((src / "model.safetensors.index.json").read_text())
        layout = "interleaved" if d == "dst" else "half"
        for fname in set(index["weight_map"].values()):
            with safe_open(str(tmp_path / d / fname), "pt") as f:
                assert f.metadata() == {"format": "pt", "origin": fname, **RECORDED, "ropekit_layout": layout}
                assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == fname}
    back = {}
    for fname in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        back.update(load_file(str(tmp_path / "back" / fname)))
    assert_identical(back, sd)


def test_torch_bin_meta_names(tmp_path):
    sd = state(meta=True)
    sd["tok_embeddings.weight"] = sd.pop("model.embed_tokens.weight")
    sd["output.weight"] = sd["tok_embeddings.weight"]  # tied: shares storage
    src = tmp_path / "consolidated.00.pth"
    torch.save(sd, src)
    before = digest(src)
    assert run(src, tmp_path / "hf.safetensors", "--from", "interleaved", "--to", "half",
               "--heads", HEADS, "--kv-heads", KV, "--verify") == 0
    assert digest(src) == before
    out = load_file(str(tmp_path / "hf.safetensors"))
    from ropekit import permute_qk_weight

    assert torch.equal(out["layers.0.attention.wq.weight"],
                       permute_qk_weight(sd["layers.0.attention.wq.weight"], HEADS, src="interleaved", dst="half"))
    assert torch.equal(out["layers.1.attention.wk.weight"],
                       permute_qk_weight(sd["layers.1.attention.wk.weight"], KV, src="interleaved", dst="half"))
    assert torch.equal(out["output.weight"], sd["output.weight"])


def test_bin_into_directory_and_config(tmp_path):
    sd = state(bias=True)
    (tmp_path / "in").mkdir()
    torch.save(sd, tmp_path / "in" / "pytorch_model.bin")
    config = {"model_type": "qwen2", "hidden_size": HEADS * HEAD_DIM, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "rope_theta": 1e6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "out").mkdir()
    assert run(tmp_path / "in", tmp_path / "out", "--to", "interleaved", "--config", tmp_path / "config.json",
               "--verify") == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_partial_rotary_leaves_tail(tmp_path):
    sd = state(bias=True, head_dim=8)
    src = tmp_path / "m.safetensors"
    save_file(sd, str(src))
    config = {"model_type": "phi3", "hidden_size": HEADS * 8, "num_attention_heads": HEADS, "num_key_value_heads": KV,
              "partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert run(src, tmp_path / "o.safetensors", "--to", "interleaved", "--config", tmp_path / "config.json",
               "--verify") == 0
    out = load_file(str(tmp_path / "o.safetensors"))
    q = out["model.layers.0.self_attn.q_proj.weight"].reshape(HEADS, 8, HIDDEN)
    q0 = sd["model.layers.0.self_attn.q_proj.weight"].reshape(HEADS, 8, HIDDEN)
    assert torch.equal(q[:, 4:], q0[:, 4:])  # channels past rotary_dim untouched
    assert torch.equal(q[:, [0, 1, 2, 3]], q0[:, [0, 2, 1, 3]])  # half (0,2),(1,3) -> interleaved (0,1),(2,3)


def test_verify_detects_a_wrong_conversion(tmp_path, monkeypatch, capsys):
    src = tmp_path / "m.safetensors"
    save_file(state(), str(src))
    monkeypatch.setattr(conv, "permute_qk_weight", lambda w, n, **kw: w.flip(0).contiguous())
    assert run(src, tmp_path / "o.safetensors", *H2I, "--heads", HEADS, "--kv-heads", KV,
               "--verify") == 1
    assert "FAILED" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


def test_refuses_overwrite_without_force(tmp_path):
    src = tmp_path / "m.safetensors"
    save_file(state(), str(src))
    dst = tmp_path / "o.safetensors"
    dst.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="--force"):
        run(src, dst, *H2I, "--heads", HEADS, "--kv-heads", KV)
    assert dst.read_bytes() == b"precious"
    assert run(src, dst, *H2I, "--heads", HEADS, "--kv-heads", KV, "--force") == 0
    assert load_file(str(dst)).keys() == state().keys()


def test_refuses_to_write_over_input(tmp_path):
    sd = state()
    src = tmp_path / "m.safetensors"
    save_file(sd, str(src))
    before = digest(src)
    with pytest.raises(ValueError, match="input"):
        run(src, src, *H2I, "--heads", HEADS, "--kv-heads", KV, "--force")
    (tmp_path / "link.safetensors").hardlink_to(src)
    with pytest.raises(ValueError, match="input"):
        run(src, tmp_path / "link.safetensors", *H2I, "--heads", HEADS, "--kv-heads", KV, "--force")
    shard_dir = write_sharded(sd, tmp_path / "sharded")
    with pytest.raises(ValueError, match="input"):
        run(shard_dir, shard_dir, *H2I, "--heads", HEADS, "--kv-heads", KV, "--force")
    assert digest(src) == before


def test_atomic_on_failure_mid_write(tmp_path, monkeypatch):
    src = write_sharded(state(), tmp_path / "src")
    calls = []
    real = checkpoint_io.save_safetensors

    def failing(tensors, path, metadata):
        calls.append(path)
        if len(calls) == 2:
            Path(path).write_bytes(b"half a file")
            raise OSError("disk full")
        real(tensors, path, metadata)

    monkeypatch.setattr(checkpoint_io, "save_safetensors", failing)
    with pytest.raises(OSError, match="disk full"):
        run(src, tmp_path / "dst", *H2I, "--heads", HEADS, "--kv-heads", KV)
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no staging directory left


@pytest.mark.parametrize(
    ("argv", "error", "match"),
    [
        (["--heads", 3, "--kv-heads", 1], ValueError, "not divisible by 3 heads"),
        (["--heads", 4, "--kv-heads", 4], ValueError, r"k_proj.weight' has 16 output rows, but 4 key/value heads"),
        (["--heads", 4, "--kv-heads", 3], ValueError, "multiple of n_kv_heads"),
        (["--heads", 4, "--kv-heads", 2, "--head-dim", 4], ValueError, "head_dim 4"),
        (["--heads", 4, "--kv-heads", 2, "--q-pattern", r"nothing$", "--k-pattern", r"nada$"], ValueError,
         "no q/k projection"),
        ([], ValueError, "no --heads"),
    ],
)
def test_errors(tmp_path, argv, error, match):
    src = tmp_path / "m.safetensors"
    save_file(state(), str(src))
    with pytest.raises(error, match=match):
        run(src, tmp_path / "o.safetensors", *H2I, *argv)
    assert not (tmp_path / "o.safetensors").exists()


def test_error_missing_k_and_unknown_layout(tmp_path):
    sd = state()
    del sd["model.layers.1.self_attn.k_proj.weight"]
    src = tmp_path / "m.safetensors"
    save_file(sd, str(src))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight.*no matching k"):
        run(src, tmp_path / "o.safetensors", *H2I, "--heads", HEADS, "--kv-heads", KV)
    args = parse(src, tmp_path / "o.safetensors", "--to", "interleaved", "--heads", HEADS)
    args.dst_layout = "spiral"
    with pytest.raises(ValueError, match="spiral"):
        cli_convert.run(args)
    with pytest.raises(ValueError, match="SRC does not exist"):
        run(tmp_path / "nope.safetensors", tmp_path / "o.safetensors", "--to", "half", "--heads", HEADS)


def fused_state(layout, heads=HEADS, kv=KV, head_dim=HEAD_DIM, bias=True):
    g = torch.Generator().manual_seed(2)
    name = "model.layers.0.self_attn.qkv_proj" if layout == "concat" else "gpt_neox.layers.0.attention.query_key_value"
    rows = (heads + 2 * kv) * head_dim
    sd = {name + ".weight": torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16),
          "gpt_neox.embed_in.weight": torch.randn(32, HIDDEN, generator=g)}
    if bias:
        sd[name + ".bias"] = torch.randn(rows, generator=g)
    return name, sd


@pytest.mark.parametrize("layout", ["concat", "per_head"])
def test_fused_qkv_permutes_q_and_k_rows_only(tmp_path, layout):
    from ropekit import permute_qk_weight

    kv = KV if layout == "concat" else HEADS  # GPT-NeoX has one k/v head per query head
    name, sd = fused_state(layout, kv=kv)
    save_file(sd, str(tmp_path / "m.safetensors"))
    assert run(tmp_path / "m.safetensors", tmp_path / "o.safetensors", *H2I, "--heads", HEADS,
               "--kv-heads", kv, "--rotary-dim", 4, "--verify") == 0
    out = load_file(str(tmp_path / "o.safetensors"))
    for kind in ("weight", "bias"):
        w, got = sd[f"{name}.{kind}"], out[f"{name}.{kind}"]
        if layout == "concat":  # rows [q (HEADS*hd); k (kv*hd); v (kv*hd)]
            q, k, v = w.split([HEADS * HEAD_DIM, kv * HEAD_DIM, kv * HEAD_DIM])
            q2, k2, v2 = got.split([HEADS * HEAD_DIM, kv * HEAD_DIM, kv * HEAD_DIM])
        else:  # rows per head [q_h; k_h; v_h]
            q, k, v = (w.reshape(HEADS, 3, HEAD_DIM, *w.shape[1:])[:, i].reshape(HEADS * HEAD_DIM, *w.shape[1:])
                       for i in range(3))
            q2, k2, v2 = (got.reshape(HEADS, 3, HEAD_DIM, *w.shape[1:])[:, i].reshape(HEADS * HEAD_DIM, *w.shape[1:])
                          for i in range(3))
        assert torch.equal(q2, permute_qk_weight(q, HEADS, src="half", dst="interleaved", rotary_dim=4))
        assert torch.equal(k2, permute_qk_weight(k, kv, src="half", dst="interleaved", rotary_dim=4))
        assert torch.equal(v2.view(torch.uint8) if v2.dtype == torch.bfloat16 else v2,
                           v.view(torch.uint8) if v.dtype == torch.bfloat16 else v)
        assert got.dtype == w.dtype
    assert run(tmp_path / "o.safetensors", tmp_path / "back.safetensors", "--to", "half", "--heads", HEADS,
               "--kv-heads", kv, "--rotary-dim", 4) == 0
    assert_identical(load_file(str(tmp_path / "back.safetensors")), sd)


def test_qk_norms_permuted_with_the_head_channels(tmp_path):
    from ropekit import channel_permutation

    sd = state(bias=False)
    g = torch.Generator().manual_seed(4)
    for i in range(2):
        for role in ("q", "k"):
            sd[f"model.layers.{i}.self_attn.{role}_norm.weight"] = torch.rand(HEAD_DIM, generator=g) + 0.5
    sd["model.layers.0.input_layernorm.weight"] = torch.rand(HIDDEN, generator=g)
    save_file(sd, str(tmp_path / "m.safetensors"))
    assert run(tmp_path / "m.safetensors", tmp_path / "o.safetensors", *H2I, "--heads", HEADS,
               "--kv-heads", KV, "--verify") == 0
    out = load_file(str(tmp_path / "o.safetensors"))
    perm = channel_permutation(HEAD_DIM, "half", "interleaved")
    for i in range(2):
        for role in ("q", "k"):
            name = f"model.layers.{i}.self_attn.{role}_norm.weight"
            assert torch.equal(out[name], sd[name][perm]), name
    assert torch.equal(out["model.layers.0.input_layernorm.weight"], sd["model.layers.0.input_layernorm.weight"])


def test_verify_catches_unpermuted_norm_and_changed_v(tmp_path, monkeypatch):
    from ropekit.checkpoints.qk_tensors import find_layers

    sd = state(layers=1)
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.rand(HEAD_DIM) + 0.5
    sd["model.layers.0.self_attn.k_norm.weight"] = torch.rand(HEAD_DIM) + 0.5
    spec = conv.HeadSpec(HEADS, KV)
    layers = find_layers(list(sd))
    after = {**sd, **{k: v for k, v in conv.convert_layer(layers["model.layers.0.self_attn"], sd, spec, "half",
                                                          "interleaved").items() if "norm" not in k}}
    assert conv.verify_layers(sd, after, layers, spec, "half", "interleaved") > 1e-3
    name, fused = fused_state("concat")
    layers = find_layers(list(fused))
    after = {**fused, name + ".weight": fused[name + ".weight"].flip(0)}  # v rows moved too
    assert conv.verify_layers(fused, after, layers, spec, "half", "interleaved") == float("inf")


@pytest.mark.parametrize(
    ("extra", "heads", "kv", "match"),
    [
        ({"model.layers.9.self_attn.q_norm.weight": torch.ones(HEAD_DIM)}, HEADS, KV, "no q/k projection weight"),
        ({"model.layers.0.self_attn.q_norm.weight": torch.ones(3)}, HEADS, KV, r"q/k norm .* shape \(3,\)"),
        ({"model.layers.0.self_attn.qkv_proj.weight": torch.ones(64, HIDDEN)}, HEADS, KV, "both a fused"),
        ({"gpt_neox.layers.0.attention.query_key_value.weight": torch.ones(96, HIDDEN)}, HEADS, KV, "n_kv_heads=2"),
        ({"layers.0.qkv_proj.weight": torch.ones(50, HIDDEN)}, HEADS, KV, "50 output rows"),
    ],
)
def test_fused_and_norm_errors(tmp_path, extra, heads, kv, match):
    sd = {**state(), **extra}
    save_file(sd, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=match):
        run(tmp_path / "m.safetensors", tmp_path / "o.safetensors", *H2I, "--heads", heads,
            "--kv-heads", kv)
    assert not (tmp_path / "o.safetensors").exists()
