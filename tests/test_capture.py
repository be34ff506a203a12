"""``ropekit_lab.capture.capturing``: q and k before and after the rotation in every layer; all as before after it.

The oracle is what transformers' attention function receives (the rotated q and k), registered as
an attention interface, and the patched model's logits without the capture.
"""

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropekit import RopeConfig  # noqa: E402
from ropekit.integrations.transformers import patch, unpatch  # noqa: E402
from ropekit_lab.capture import capturing  # noqa: E402
from test_integration_transformers import FAMILIES, IDS, logits, tiny  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_capture_sees_q_and_k_before_and_after_rotation(family):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen, received = {}, {}

    def capture(module, q, k, q_rot, k_rot):
        seen[module.layer_idx] = (q.clone(), k.clone(), q_rot.clone(), k_rot.clone())

    def attention(module, query, key, value, attention_mask, **kwargs):
        received[module.layer_idx] = (query.clone(), key.clone())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("ropekit_test_capture", attention)
    model = tiny(family)
    model.set_attn_implementation("ropekit_test_capture")
    patch(model, fuse=False)  # the modeling code's own q/k norms (Qwen3): the captured q/k are its tensors
    modeling = sys.modules[type(model).__module__]
    rotation = modeling.apply_rotary_pos_emb
    forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    try:
        ref = logits(model, IDS)
        received.clear()
        with capturing(model, capture):
            assert torch.equal(logits(model, IDS), ref)  # the callback changed nothing
        assert modeling.apply_rotary_pos_emb is rotation  # put back on exit ...
        assert {name: m.__dict__.get("forward") for name, m in model.named_modules()} == forwards  # ... all of it
        count = len(seen)
        logits(model, IDS)
        assert len(seen) == count  # outside the context nothing is captured
    finally:
        unpatch(model)
    assert sorted(seen) == sorted(received) == [0, 1]
    rope = RopeConfig.from_hf(model.config)
    r = rope.rotary_dim
    for layer, (q, k, q_rot, k_rot) in seen.items():
        heads, kv = model.config.num_attention_heads, getattr(model.config, "num_key_value_heads", None)
        assert q.shape == (2, heads, 24, rope.head_dim) and k.shape[1] == (kv or heads)
        assert torch.equal(q_rot, received[layer][0]) and torch.equal(k_rot, received[layer][1])
        assert torch.equal(q[..., r:], q_rot[..., r:])  # partial rotary: the tail passes through
        for x, y in ((q, q_rot), (k, k_rot)):  # a rotation keeps each (i, i + r/2) pair's norm
            norms = [t[..., :r // 2].hypot(t[..., r // 2:r]) for t in (x, y)]
            torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=1e-6)


def test_an_error_inside_puts_everything_back():
    model = tiny("llama")
    patch(model, fuse=False)
    modeling = sys.modules[type(model).__module__]
    rotation = modeling.apply_rotary_pos_emb
    try:
        with pytest.raises(ZeroDivisionError), capturing(model, lambda *tensors: 1 / 0):
            logits(model, IDS)
        assert modeling.apply_rotary_pos_emb is rotation
    finally:
        unpatch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())  # unpatch still finds ropekit's own forwards


def test_the_callback_must_be_callable():
    with pytest.raises(TypeError, match="callback must be callable, got int"):
        with capturing(tiny("llama"), 3):
            pass
