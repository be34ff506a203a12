"""The transformers patch on models with layers without RoPE: SmolLM3 and Llama 4 (iRoPE).

Tiny random models built by transformers' own classes; the oracle is the unpatched model. The
patched model must give logits within 1e-5 (tests/model_compare.py) and the same greedy tokens,
rotate through ropekit exactly on the RoPE layers, and leave what is not RoPE to transformers
(Llama 4's chunked attention and attention temperature, both switched on with small enough
parameters that these short sequences reach them). A NoPE layer turned into a RoPE layer, before
the patch or after, is refused; unpatch restores the model bit for bit.
"""

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import ropekit.integrations.transformers as integ  # noqa: E402
from model_compare import assert_logits_match, logits_mismatch  # noqa: E402
from ropekit import RopeConfig  # noqa: E402
from ropekit.integrations.transformers import patch, patchable_modules, unpatch  # noqa: E402

torch.set_num_threads(1)

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
              intermediate_size=64, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Llama 4: chunks of 8 tokens on the RoPE layers, a temperature that changes every 4 positions on the NoPE ones
LLAMA4 = dict(COMMON, intermediate_size_mlp=128, num_local_experts=2, attention_chunk_size=8, floor_scale=4,
              attn_scale=0.5)
MODELS = {
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", COMMON),
    "smollm3 listed": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(COMMON, no_rope_layers=[0, 1, 1, 0])),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", LLAMA4),
    "llama4 listed": ("Llama4TextConfig", "Llama4ForCausalLM", dict(LLAMA4, no_rope_layers=[0, 1, 1, 0])),
}
IDS = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(3))
PROMPT = IDS[:1, :6]


def tiny(name, layers=4, **extra):
    config_name, model_name, kwargs = MODELS[name]
    config = getattr(transformers, config_name)(**{**kwargs, "num_hidden_layers": layers, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def greedy(model):
    with torch.no_grad():  # 20 new tokens: past the 8-token chunks, through five temperature steps
        return model.generate(PROMPT, max_new_tokens=20, do_sample=False, min_new_tokens=20)


def rope_layer_count(model):
    return sum(bool(a.use_rope) for a in patchable_modules(model)[1])


def counting(monkeypatch):
    calls = []
    real = integ.apply_rotary_qk  # the rotation of the plain path; Llama 4's module has its own reference
    monkeypatch.setattr(integ, "apply_rotary_qk", lambda *a, **k: calls.append(1) or real(*a, **k))
    import ropekit.integrations.transformers_llama4 as llama4

    real4 = llama4.apply_rotary_qk
    monkeypatch.setattr(llama4, "apply_rotary_qk", lambda *a, **k: calls.append(1) or real4(*a, **k))
    return calls


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_greedy_tokens_and_unpatch(name, monkeypatch):
    calls = counting(monkeypatch)
    model = tiny(name)
    rotation = sys.modules[type(patchable_modules(model)[1][0]).__module__]
    function = "apply_rotary_emb" if name.startswith("llama4") else "apply_rotary_pos_emb"
    original = getattr(rotation, function)
    ref, ref_tokens = logits(model), greedy(model)
    patch(model)
    assert not hasattr(original, "__ropekit_original__")
    assert getattr(rotation, function).__ropekit_original__ is original
    out = logits(model)
    assert len(calls) == rope_layer_count(model) > 0  # each RoPE layer once (q and k together), no NoPE layer
    assert_logits_match(out, ref)
    assert torch.equal(greedy(model), ref_tokens)
    unpatch(model)
    assert torch.equal(logits(model), ref)
    assert getattr(rotation, function) is original
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("name", ["smollm3", "llama4"])
def test_a_nope_layer_flipped_to_rope_after_patch_is_caught(name):
    model = tiny(name)
    layer = model.model.layers[3].self_attn
    assert not layer.use_rope  # every fourth layer is NoPE
    ref = logits(model)
    layer.use_rope = 1
    # the unpatched model now rotates layer 3: silently another model (its logits move far beyond 1e-5)
    assert logits_mismatch(logits(model), ref) is not None
    layer.use_rope = 0
    patch(model)
    layer.use_rope = 1
    with pytest.raises(RuntimeError, match="layer 3 is a NoPE layer"):
        logits(model)
    layer.use_rope = 0
    assert_logits_match(logits(model), ref)
    unpatch(model)


@pytest.mark.parametrize("name", ["smollm3", "llama4"])
def test_a_rope_layer_flipped_to_nope_after_patch_is_caught(name):
    model = patch(tiny(name))
    model.model.layers[1].self_attn.use_rope = 0
    with pytest.raises(RuntimeError, match="layer 1 is a RoPE layer"):
        logits(model)
    unpatch(model)


@pytest.mark.parametrize("name", ["smollm3", "llama4"])
def test_attention_that_disagrees_with_the_config_is_refused_at_patch(name):
    model = tiny(name)
    model.model.layers[3].self_attn.use_rope = 1
    with pytest.raises(ValueError, match=r"layer 3: the config's no_rope_layers makes it a NoPE layer, but"):
        patch(model)
    assert not hasattr(model, "_ropekit_patch") and all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("name", ["smollm3", "llama4"])
def test_rope_override_keeps_the_models_schedule(name):
    model = tiny(name)
    ref = logits(model)
    own = RopeConfig.from_hf(model.config)
    assert own.layer_schedule.nope_layers == (3,)
    bare = RopeConfig(head_dim=own.head_dim, base=own.base, layout=own.layout)  # no layer_schedule
    patch(model, rope=bare)
    assert model._ropekit_patch["rope"].layer_schedule == own.layer_schedule
    assert_logits_match(logits(model), ref)
    unpatch(model)
    other = RopeConfig(head_dim=own.head_dim, base=own.base, layout=own.layout,
                       layer_schedule=type(own.layer_schedule)((True,) * 4))
    with pytest.raises(ValueError, match="layer_schedule"):
        patch(model, rope=other)


def test_llama4_is_rotated_in_the_interleaved_layout(monkeypatch):
    model = tiny("llama4")
    ref = logits(model)
    patch(model)
    assert model._ropekit_patch["rope"].layout == "interleaved"
    unpatch(model)
    # the other pairing computes another model: the comparison sees it
    patch(model, layout="half")
    assert logits_mismatch(logits(model), ref) is not None
    unpatch(model)
    # a different base too (the tables are ropekit's, not transformers')
    rope = RopeConfig.from_hf(model.config)
    patch(model, rope=RopeConfig(head_dim=16, base=rope.base * 1000, layout="interleaved"))
    assert logits_mismatch(logits(model), ref) is not None
    unpatch(model)
    assert torch.equal(logits(model), ref)


def test_llama4_chunked_attention_and_temperature_are_exercised_and_kept():
    """Each setting the other tests rely on changes the logits here, and the patched model keeps it."""
    ref = logits(tiny("llama4"))
    for change in (dict(attn_temperature_tuning=False), dict(attention_chunk_size=64)):
        other = tiny("llama4", **change)
        plain = logits(other)
        assert logits_mismatch(plain, ref) is not None, change  # the feature acts on these inputs
        patch(other)
        assert_logits_match(logits(other), plain)
        unpatch(other)


def test_llama4_patched_and_unpatched_models_side_by_side():
    patched, plain = patch(tiny("llama4")), tiny("llama4")
    ref = logits(plain)
    assert_logits_match(logits(patched), ref)
    assert torch.equal(logits(plain), ref)  # the dispatcher falls through for the unpatched model
    unpatch(patched)


def test_llama4_multimodal_model_patches_its_text_model_only():
    config = transformers.Llama4Config(
        text_config=dict(LLAMA4, num_hidden_layers=4),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                           image_size=28, patch_size=14, projector_input_dim=64, projector_output_dim=64,
                           vision_output_dim=64, pixel_shuffle_ratio=0.5),
        image_token_index=100)
    for sub in (config, config.text_config, config.vision_config):
        sub._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    ids = IDS.clamp(max=99)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    rotary, attention = patchable_modules(model)
    assert {type(m).__name__ for m in rotary + attention} == {"Llama4TextRotaryEmbedding", "Llama4TextAttention"}
    patch(model)
    with torch.no_grad():
        assert_logits_match(model(input_ids=ids).logits, ref)
    unpatch(model)


def test_patch_twice_and_unpatch_unpatched_are_refused():
    model = patch(tiny("llama4"))
    with pytest.raises(ValueError, match="already patched"):
        patch(model)
    unpatch(model)
    with pytest.raises(ValueError, match="not patched"):
        unpatch(model)


@pytest.mark.parametrize("name", ["smollm3", "llama4"])
def test_torch_compile_eager_backend(name):
    model = tiny(name)
    ref = logits(model)
    compiled = torch.compile(patch(model), backend="eager")
    assert_logits_match(logits(compiled), ref)
    unpatch(model)
