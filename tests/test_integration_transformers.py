"""ropekit.integrations.transformers: patched tiny random models match unpatched ones."""

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model_compare import assert_bfloat16_close, assert_logits_match  # noqa: E402
from ropekit import RopeConfig  # noqa: E402
from ropekit.integrations.transformers import patch, unpatch  # noqa: E402
from ropekit.scaling import Linear  # noqa: E402

torch.set_num_threads(1)

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, intermediate_size=128,
              max_position_embeddings=256)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=2, partial_rotary_factor=0.5,
                                                   pad_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.25)),
}


def tiny(family, **extra):
    config_name, model_name, kwargs = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **kwargs, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_and_unpatch_restores(family, monkeypatch):
    import ropekit.integrations.transformers as integ

    calls = []
    for name in ("apply_rotary_qk", "rms_norm_rotary_qk"):  # rotation, or (q/k-norm families) norm + rotation
        real = getattr(integ, name)
        monkeypatch.setattr(integ, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    model = tiny(family)
    ref = logits(model, IDS)
    patch(model)
    out = logits(model, IDS)
    assert len(calls) == 2  # q and k of two layers went through ropekit
    assert_logits_match(out, ref)
    unpatch(model)
    assert torch.equal(logits(model, IDS), ref)
    for m in model.modules():
        assert "forward" not in m.__dict__
    mod = sys.modules[type(model).__module__]
    assert not hasattr(mod.apply_rotary_pos_emb, "__ropekit_original__")


def test_patch_really_uses_ropekit(monkeypatch):
    import ropekit.integrations.transformers as integ

    calls = []
    real = integ.apply_rotary_qk
    monkeypatch.setattr(integ, "apply_rotary_qk", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = patch(tiny("llama"))
    logits(model, IDS)
    assert len(calls) == 2  # q and k together, two layers
    unpatch(model)


def test_unpatched_model_of_same_family_unaffected():
    patched, other = patch(tiny("llama")), tiny("llama", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                          "rope_theta": 10000.0})
    ref = logits(other, IDS)
    unpatch(patched)
    patch(patched)
    assert torch.equal(logits(other, IDS), ref)
    unpatch(patched)


def test_greedy_generation_identical_with_kv_cache():
    model = tiny("llama")
    prompt = IDS[:1, :8]
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(prompt, **kwargs)
        patch(model)
        out = model.generate(prompt, **kwargs)
        unpatch(model)
    assert torch.equal(out, ref)


def test_rope_override_matches_model_with_scaling():
    scaled = tiny("llama", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    model = tiny("llama")  # same seed: same weights
    ref_plain, ref_scaled = logits(model, IDS), logits(scaled, IDS)
    assert not torch.allclose(ref_plain, ref_scaled, atol=1e-4)
    patch(model, rope=RopeConfig(head_dim=16, base=10000.0, scaling=Linear(factor=4.0)))
    assert_logits_match(logits(model, IDS), ref_scaled)
    unpatch(model)


QK_GAIN = 8.0


def sharp(model, gain=QK_GAIN):
    """``model`` with its q and k projection weights times ``gain``: attention that depends on position.

    At the default initialisation (std 0.02) the logits q.k are ~1e-3, attention is nearly uniform
    and a rotation one position off moves the bfloat16 logits less than rounding does (rms ratio
    1.04 in :func:`model_compare.bfloat16_mismatch`); times 8 it moves them ~13x as far, while a
    correct patch stays at ~1.0.
    """
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(gain)
            layer.self_attn.k_proj.weight.mul_(gain)
    return model


def test_bf16_model_runs_with_float32_tables():
    model = sharp(tiny("qwen2")).to(torch.bfloat16)
    exact = logits(sharp(tiny("qwen2")).to(torch.bfloat16).float(), IDS)  # the same bfloat16 weights, in float32
    ref = logits(model, IDS)
    model = patch(model)
    out = logits(model, IDS)
    unpatch(model)
    assert out.dtype == torch.bfloat16
    assert_bfloat16_close(out, ref, exact)


def test_errors():
    model = patch(tiny("llama"))
    with pytest.raises(ValueError, match="already patched"):
        patch(model)
    unpatch(model)
    with pytest.raises(ValueError, match="not patched"):
        unpatch(model)
    with pytest.raises(ValueError, match="head_dim"):
        patch(model, rope=RopeConfig(head_dim=8))
    with pytest.raises(ValueError, match="layout"):
        patch(tiny("llama", rope_interleave=True))  # config says interleaved: rope= must say so explicitly


def test_torch_compile_eager_backend():
    model = tiny("llama")
    ref = logits(model, IDS)
    patch(model)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        out = compiled(IDS).logits
    unpatch(model)
    assert_logits_match(out, ref)


# tensors ropekit convert must touch per layer (q/k projections, fused q/k/v, q/k norms)
TWIN_CASES = [
    ("llama", {}, ("q_proj.weight", "k_proj.weight")),
    ("llama", {"attention_bias": True}, ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")),
    ("mistral", {}, ("q_proj.weight", "k_proj.weight")),
    ("qwen2", {}, ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")),
    ("qwen3", {}, ("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight")),
    ("phi3", {}, ("qkv_proj.weight",)),
    ("gpt_neox", {}, ("query_key_value.weight", "query_key_value.bias")),
]


def randomize_attention_vectors(model):
    """Biases start at 0 and RMSNorm weights at 1, which no permutation changes: make them random."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("self_attn." in name or ".attention." in name):
                noise = torch.randn(p.shape, generator=generator)
                p.copy_(noise * 0.02 if name.endswith("bias") else noise.abs() + 0.5)


@pytest.mark.parametrize("family,extra,touched", TWIN_CASES,
                         ids=[f"{f}{'-bias' if e else ''}" for f, e, _ in TWIN_CASES])
def test_meta_layout_checkpoint_with_interleaved_rope_equals_hf_twin(family, extra, touched, tmp_path):
    """q/k rows converted to interleaved order (Meta / llama.cpp) + interleaved RoPE == the HF-layout model."""
    from safetensors.torch import load_file, save_file

    from ropekit.checkpoints.convert import HeadSpec, convert_checkpoint
    from ropekit.checkpoints.qk_tensors import split_fused

    hf = tiny(family, **extra)
    randomize_attention_vectors(hf)
    ref = logits(hf, IDS)
    original = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(original, tmp_path / "hf.safetensors")
    cfg = hf.config
    spec = HeadSpec.from_config(cfg.to_dict())
    result = convert_checkpoint(tmp_path / "hf.safetensors", tmp_path / "meta.safetensors", spec,
                                src_layout="half", dst_layout="interleaved", verify=True)
    assert result.verified and result.max_score_error < 1e-9
    assert sorted(result.converted) == sorted(n for n in original if n.endswith(touched))
    assert len(result.converted) == len(touched) * cfg.num_hidden_layers
    converted = load_file(tmp_path / "meta.safetensors")
    for name in result.converted:
        assert not torch.equal(converted[name], original[name]), name
        if name.endswith(("qkv_proj.weight", "query_key_value.weight", "query_key_value.bias")):
            layout = "concat" if "qkv_proj" in name else "per_head"
            hd = spec.head_dim
            _, _, v_before = split_fused(original[name], layout, spec.n_heads, spec.n_kv_heads, hd)
            _, _, v_after = split_fused(converted[name], layout, spec.n_heads, spec.n_kv_heads, hd)
            assert torch.equal(v_after, v_before), name  # v rows untouched
    for name in set(original) - set(result.converted):
        assert torch.equal(converted[name], original[name]), name
    meta = tiny(family, **extra)
    meta.load_state_dict(converted)
    assert not torch.allclose(logits(meta, IDS), ref, atol=1e-3)  # HF's half-pair RoPE is wrong for these rows
    own = RopeConfig.from_hf(cfg)
    patch(meta, rope=RopeConfig(head_dim=own.head_dim, rotary_dim=own.rotary_dim, base=own.base,
                                layout="interleaved"))
    assert_logits_match(logits(meta, IDS), ref)
    with torch.no_grad():
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(meta.generate(IDS[:1, :8], **kwargs), hf.generate(IDS[:1, :8], **kwargs))
    unpatch(meta)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gpt_neox"])
def test_twin_breaks_if_norms_or_fused_rows_are_not_converted(family, tmp_path, monkeypatch):
    """The new tensor kinds matter: --verify catches unconverted q/k norms or fused k rows."""
    from safetensors.torch import save_file

    from ropekit.checkpoints import convert as conv

    hf = tiny(family)
    randomize_attention_vectors(hf)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "hf.safetensors")
    spec = conv.HeadSpec.from_config(hf.config.to_dict())
    if family == "qwen3":  # forgetting the q/k norms
        real = conv.convert_layer
        monkeypatch.setattr(conv, "convert_layer", lambda layer, *a: {
            k: v for k, v in real(layer, *a).items() if "norm" not in k})
    else:  # forgetting the k rows of the fused projection (v rows stay untouched, so only the scores tell)
        real = conv._permute
        monkeypatch.setattr(conv, "_permute", lambda name, w, *a: w if name.endswith("(k rows)") else real(name, w, *a))
    result = conv.convert_checkpoint(tmp_path / "hf.safetensors", tmp_path / "meta.safetensors", spec,
                                     src_layout="half", dst_layout="interleaved", verify=True)
    assert result.verified is False and 1e-3 < result.max_score_error < float("inf")
    assert not (tmp_path / "meta.safetensors").exists()


def test_patch_has_no_capture_hook():
    """Measurements (the lab's probe) wrap the patched model themselves; the library has no hook for them."""
    with pytest.raises(TypeError, match="capture"):
        patch(tiny("llama"), capture=print)
