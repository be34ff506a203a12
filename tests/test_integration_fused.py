"""The transformers patch with fused q/k norms and keys rotated into a static cache: tiny random models.

Qwen3 (per-head norm), Qwen3-MoE, Gemma 3 (``1 + weight``, sliding and full layers with their own
rope parameters), OLMo 2 and OLMo 3 (norm over the whole projection): patched logits within 1e-5 of
the unpatched model's (float32), the same greedy generation with transformers' default cache and
with ropekit's static cache, every q/k norm fused and every full-attention key written by the fused
cache write (counted). A changed data flow must fail loudly.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ropekit.integrations.transformers as integ  # noqa: E402
import ropekit.integrations.transformers_cache as integ_cache  # noqa: E402
from model_compare import assert_bfloat16_close, assert_logits_match  # noqa: E402
from ropekit.integrations.transformers import patch, static_cache, unpatch  # noqa: E402

torch.set_num_threads(1)

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=None,
              bos_token_id=None)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=32, sliding_window=8,
                                                             layer_types=["sliding_attention", "full_attention"])),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(sliding_window=8,
                                                      layer_types=["sliding_attention", "full_attention"])),
}
FULL_LAYERS = {"qwen3": 2, "qwen3_moe": 2, "gemma3": 1, "olmo2": 2, "olmo3": 1}
IDS = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(3))


def tiny(family, dtype=torch.float32):
    config_name, model_name, kwargs = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # norm weights start at 1 (0 for Gemma): make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return model.to(dtype)


@pytest.fixture
def counts(monkeypatch):
    """Calls of the fused norm + rotation and of the fused cache write."""
    seen = {"norm": 0, "cache": 0}
    real_norm, real_cache = integ.rms_norm_rotary_qk, integ_cache.rotate_into_cache
    real_one = integ.rms_norm_rotary

    def norm(*a, **k):
        seen["norm"] += 2
        return real_norm(*a, **k)

    def one(*a, **k):
        seen["norm"] += 1
        return real_one(*a, **k)

    def cache(*a, **k):
        seen["cache"] += 1
        return real_cache(*a, **k)

    monkeypatch.setattr(integ, "rms_norm_rotary_qk", norm)
    monkeypatch.setattr(integ, "rms_norm_rotary", one)
    monkeypatch.setattr(integ_cache, "rotate_into_cache", cache)
    return seen


def run(model, cache=None):
    generate = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(IDS))
    with torch.no_grad():
        logits = model(IDS).logits
        tokens = model.generate(IDS, past_key_values=cache, **generate)
    return logits, tokens


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_patch_matches_the_model_and_fuses_every_norm_and_cache_write(family, counts):
    model = tiny(family)
    ref_logits, ref_tokens = run(model)
    patch(model)
    logits, tokens = run(model)
    layers = model.config.num_hidden_layers
    assert counts["norm"] == 2 * layers * 7  # q and k of every layer: one forward, six generation steps
    assert_logits_match(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)
    counts["norm"] = 0
    _, cached_tokens = run(model, static_cache(model, 32))
    assert torch.equal(cached_tokens, ref_tokens)
    assert counts["cache"] == FULL_LAYERS[family] * 6  # prefill and five decode steps of the full layers
    assert counts["norm"] == (2 * layers - FULL_LAYERS[family]) * 6 + 2 * layers  # q (and the sliding layers' k)
    unpatch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert torch.equal(run(model)[0], ref_logits)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo2"])
def test_bfloat16_models_stay_close_and_fuse_false_keeps_transformers_norms(family, counts):
    model = tiny(family, torch.bfloat16)
    exact, _ = run(tiny(family, torch.bfloat16).float())  # the same bfloat16 weights, computed in float32
    ref_logits, _ = run(model)
    patch(model)
    logits, _ = run(model)
    unpatch(model)
    assert_bfloat16_close(logits, ref_logits, exact)
    assert counts["norm"] > 0
    counts["norm"] = 0
    patch(model, fuse=False)
    unfused_logits, _ = run(model, static_cache(model, 32))
    unpatch(model)
    assert counts == {"norm": 0, "cache": 0}
    assert_bfloat16_close(unfused_logits, ref_logits, exact)


def test_a_changed_data_flow_fails_loudly(monkeypatch):
    """Something between the norm and the rotation, or a norm whose output never reaches it: RuntimeError."""
    from transformers.models.qwen3 import modeling_qwen3

    model = tiny("qwen3")
    original = modeling_qwen3.Qwen3Attention.forward

    def scaled_query(self, hidden_states, *args, **kwargs):  # q_norm's output scaled before the rotation
        real_norm = self.q_norm.forward
        self.q_norm.forward = lambda x: real_norm(x) * 1.0
        try:
            return original(self, hidden_states, *args, **kwargs)
        finally:
            self.q_norm.forward = real_norm

    def norm_only(self, hidden_states, *args, **kwargs):  # the norm runs, its result is never rotated
        self.k_norm(hidden_states.view(*hidden_states.shape[:-1], -1, self.head_dim))
        return original(self, hidden_states, *args, **kwargs)

    for replacement, match in ((scaled_query, "not the output of the deferred q_norm"),
                               (norm_only, "ran twice|never reached")):
        monkeypatch.setattr(modeling_qwen3.Qwen3Attention, "forward", replacement)
        patch(model)
        try:
            with pytest.raises(RuntimeError, match=match), torch.no_grad():
                model(IDS)
        finally:
            unpatch(model)
    monkeypatch.setattr(modeling_qwen3.Qwen3Attention, "forward", original)


def test_gemma3_tables_follow_each_layer_type():
    """Gemma 3's sliding layers rotate with base 1e4 and its full layers with 1e6: one table per layer type."""
    model = tiny("gemma3")
    patch(model)
    rotary = model.model.rotary_emb
    x, positions = torch.zeros(1, 3, 64), torch.arange(3)[None] + 1000
    with torch.no_grad():
        local = rotary(x, positions, "sliding_attention")[0]
        full = rotary(x, positions, "full_attention")[0]
    unpatch(model)
    with torch.no_grad():
        own_local = rotary(x, positions, "sliding_attention")[0]
        own_full = rotary(x, positions, "full_attention")[0]
    torch.testing.assert_close(local, own_local[..., :16], rtol=0, atol=2e-4)  # HF's float32 angles at 1000
    torch.testing.assert_close(full, own_full[..., :16], rtol=0, atol=2e-4)
    assert not torch.allclose(local, full)


def test_torch_compile_runs_the_patched_model_without_deferring():
    model = tiny("qwen3")
    ref = run(model)[0]
    patch(model)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        out = compiled(IDS).logits
    unpatch(model)
    assert_logits_match(out, ref)


@pytest.mark.parametrize(("family", "norm_class", "bound"), [("qwen3", "Qwen3RMSNorm", 2.0),
                                                              ("gemma3", "Gemma3RMSNorm", 1.0),
                                                              ("olmo2", "Olmo2RMSNorm", 1.0)])
def test_bfloat16_fused_norm_against_each_family_s_own_norm(family, norm_class, bound):
    """The model's norm module then ropekit's rotation vs the fused op: Qwen3's norm rounds twice (<= 2 ulps
    at the pair's magnitude), Gemma 3's and OLMo 2's once (<= 1)."""
    import importlib

    import ropekit
    from fused_helpers import normalized64, radius_ulps

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    gen = torch.Generator().manual_seed(7)
    heads, d = 4, 64
    per_token = family == "olmo2"
    norm = getattr(module, norm_class)(heads * d if per_token else d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=gen) * 0.3 + (0.0 if family == "gemma3" else 1.0))
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(2, 64, heads, d, generator=gen) * 3).to(torch.bfloat16)  # (batch, seq, heads, dim)
    inv_freq, _ = ropekit.inv_frequencies(d, base=1e6)
    cos, sin = ropekit.cos_sin(torch.arange(64) + 3000, inv_freq)
    cos, sin = cos[:, None], sin[:, None]
    with torch.no_grad():
        own = norm(x.flatten(-2)).view_as(x) if per_token else norm(x)
        theirs = ropekit.apply_rotary(own, cos, sin)
        weight = norm.weight.view(heads, d) if per_token else norm.weight
        offset = 1.0 if family == "gemma3" else 0.0
        fused = ropekit.rms_norm_rotary(x, weight, cos, sin, eps=1e-6, weight_offset=offset,
                                        norm="per_token" if per_token else "per_head")
    y64 = normalized64(x, weight, eps=1e-6, weight_offset=offset, per_token=per_token)
    assert radius_ulps(fused, theirs, y64, d, "half").max() <= bound
