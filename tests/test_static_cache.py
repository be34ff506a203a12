"""``static_cache``: the slots a CPU model's layers hand attention in eager mode, against ``DynamicCache``.

In eager mode the rotating layers return the slots written so far and size the mask for them (and
are not compileable, so transformers may leave one query token unmasked); while ``torch.compile``
traces them they are transformers' ``StaticLayer``. Either way greedy decoding must give the
tokens that transformers' own caches give.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers.cache_utils import StaticCache  # noqa: E402

from ropekit.integrations.transformers import patch, static_cache, unpatch  # noqa: E402
from ropekit.integrations.transformers_cache import RotatingStaticLayer  # noqa: E402

torch.set_num_threads(1)

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, eos_token_id=None,
              bos_token_id=None)


def tiny(family: str, attention: str) -> torch.nn.Module:
    config = (transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig)(**COMMON)
    config._attn_implementation = attention
    torch.manual_seed(0)
    model_class = transformers.Qwen3ForCausalLM if family == "qwen3" else transformers.LlamaForCausalLM
    return model_class(config).eval()


def decode(model, ids, mask, cache=None, new=8):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                              min_new_tokens=new, do_sample=False)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_decodes_the_tokens_of_transformers_caches(family, attention, padded):
    """Patched + ``static_cache`` = unpatched with ``DynamicCache`` and with ``StaticCache`` (left padding too)."""
    model = tiny(family, attention)
    ids = torch.randint(1, 96, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :3], mask[0, :3] = 0, 0
    dynamic = decode(model, ids, mask)
    assert torch.equal(decode(model, ids, mask, StaticCache(config=model.config, max_cache_len=20)), dynamic)
    patch(model)
    try:
        cache = static_cache(model, 20)
        assert torch.equal(decode(model, ids, mask, cache), dynamic)
        assert torch.equal(decode(model, ids, mask), dynamic)
    finally:
        unpatch(model)
    layers = [layer for layer in cache.layers if isinstance(layer, RotatingStaticLayer)]
    assert len(layers) == model.config.num_hidden_layers
    for layer in layers:  # the prompt and the 7 tokens fed back: the last generated one is never written
        assert layer.filled == int(layer.cumulative_length) == ids.shape[1] + 7


def test_eager_layers_hand_attention_the_written_slots_and_compiled_ones_every_slot(monkeypatch):
    """``update`` and ``get_mask_sizes`` in eager mode, under ``torch.compile`` (faked), after ``reset``."""
    layer = RotatingStaticLayer(max_cache_len=10, attend_written=True)
    assert not layer.is_compileable
    key, value = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    assert layer.get_mask_sizes(3) == (3, 0)
    keys, values = layer.update(key, value)
    assert keys.shape[2] == values.shape[2] == 3 and torch.equal(keys, key) and torch.equal(values, value)
    assert layer.get_mask_sizes(1) == (4, 0)
    assert layer.get_mask_sizes(torch.arange(3, 4)) == (4, 0)  # transformers before 4.57 passes cache_position
    keys, _ = layer.update(key[:, :, :1], value[:, :, :1])
    assert keys.shape[2] == 4 and keys.data_ptr() == layer.keys.data_ptr()
    assert type(layer.get_seq_length()) is int and layer.get_seq_length() == 4
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert layer.is_compileable
    assert layer.get_mask_sizes(1) == (10, 0)
    assert layer.get_seq_length() is layer.cumulative_length and int(layer.cumulative_length) == 4
    assert layer.update(key[:, :, :1], value[:, :, :1])[0] is layer.keys
    monkeypatch.undo()
    layer.reset()
    assert layer.filled == 0 and int(layer.cumulative_length) == 0 and not layer.keys.any()
    assert layer.get_mask_sizes(2) == (2, 0)
    plain = RotatingStaticLayer(max_cache_len=10)  # a model off the CPU: transformers' StaticLayer behaviour
    assert plain.is_compileable
    assert plain.update(key, value)[0] is plain.keys
    assert plain.get_mask_sizes(1) == (10, 0)


def test_a_compiled_forward_with_the_static_cache_matches_eager():
    """Traced by torch.compile the layers return every slot behind transformers' mask: the same logits."""
    model = tiny("qwen3", "sdpa")
    ids = torch.randint(1, 96, (1, 6), generator=torch.Generator().manual_seed(5))
    patch(model)
    try:
        with torch.no_grad():
            want = model(ids, past_key_values=static_cache(model, 16)).logits
            compiled = torch.compile(model, backend="eager")
            got = compiled(ids, past_key_values=static_cache(model, 16)).logits
    finally:
        unpatch(model)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
