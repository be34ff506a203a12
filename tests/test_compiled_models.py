"""A patched model under ``torch.compile``: one graph, plain torch expressions, the eager patched model's outputs.

While ``torch.compile`` traces a patched model, the patch hands inductor expressions it can fuse
(``ropekit.integrations.transformers_compile``): the model's own q/k norms, the eager backend's
rotation (float32 arithmetic on ropekit's float32 tables, one rounding), transformers' own cache
write. The compiled model must decode the tokens of the eager patched model with logits within
float32 rounding, with DynamicCache and with ``static_cache``, in one graph per shape (no graph
break; ``fullgraph=True`` raises on one) and without compiling again at every step; the traced
rotation is checked against the float64 reference, eager and compiled by inductor. The families
with more than ``apply_rotary_pos_emb`` keep, traced, what their eager patch does: SmolLM3's and
Llama 4's NoPE layers stay unrotated, DeepSeek-V3's interleaved rope slices are rotated and put in
transformers' half order (its cached keys show the order, which the logits cannot).
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

import ropekit  # noqa: E402
import ropekit.integrations.transformers_compile as traced  # noqa: E402
import test_integration_nope as nope  # noqa: E402
import test_mla_transformers as mla  # noqa: E402
from model_compare import assert_logits_match  # noqa: E402
from ropekit.integrations.transformers import patch, static_cache, unpatch  # noqa: E402

torch.set_num_threads(1)

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, eos_token_id=None,
              bos_token_id=None)
PROMPT, NEW = 6, 5


def tiny_qwen3() -> torch.nn.Module:
    """Two layers with q/k norms whose weights are not all 1 (so that a skipped norm shows)."""
    config = transformers.Qwen3Config(**COMMON)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return model


class Graphs:
    """A ``torch.compile`` backend that keeps every graph it is given and runs it with ``aot_eager``."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    def ropekit_nodes(self) -> list[str]:
        """The ropekit operators called in the graphs."""
        return [str(n.target) for gm in self.graphs for n in gm.graph.nodes
                if n.op == "call_function" and "ropekit" in str(n.target)]


def decode(model, forward, cache) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding as ``generate`` runs it: the prompt eager, then ``NEW`` tokens through ``forward``."""
    ids = torch.randint(1, COMMON["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, cache_position=torch.arange(PROMPT)).logits[:, -1:]
        tokens, every = [], [logits]
        for step in range(NEW):
            token = logits.argmax(-1)
            tokens.append(int(token))
            position = torch.tensor([PROMPT + step])
            logits = forward(token, past_key_values=cache, cache_position=position, position_ids=position[None]).logits
            every.append(logits)
    return tokens, every


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("cache", ["DynamicCache", "static_cache"])
def test_the_compiled_patched_model_decodes_as_the_eager_one_in_one_graph(cache):
    model = patch(tiny_qwen3())
    try:
        new_cache = (lambda: DynamicCache()) if cache == "DynamicCache" else (lambda: static_cache(model, PROMPT + NEW))
        want_tokens, want_logits = decode(model, model, new_cache())
        graphs = Graphs()
        compiled = torch.compile(model.forward, backend=graphs, fullgraph=True, dynamic=cache == "DynamicCache")
        tokens, logits = decode(model, compiled, new_cache())
    finally:
        unpatch(model)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits, strict=True):
        assert_logits_match(got, want)
    assert graphs.graphs and graphs.ropekit_nodes() == []  # the traced rotation is plain torch ops
    assert len(graphs.graphs) <= (2 if cache == "DynamicCache" else 1)  # DynamicCache: one static, one dynamic shape


def test_a_compiled_step_has_no_graph_break_and_the_eager_steps_after_it_continue():
    """``explain`` finds one graph; eager steps after compiled ones write the slots after theirs."""
    model = patch(tiny_qwen3())
    try:
        want_tokens, _ = decode(model, model, static_cache(model, PROMPT + NEW))
        cache = static_cache(model, PROMPT + NEW)
        compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=True, dynamic=False)
        steps = iter([compiled, compiled, model, compiled, model])  # compiled and eager steps, mixed

        def forward(*args, **kwargs):
            return next(steps)(*args, **kwargs)

        tokens, _ = decode(model, forward, cache)
        position = torch.tensor([PROMPT + NEW])
        explained = torch._dynamo.explain(model.forward)(torch.tensor([[tokens[-1]]]),
                                                         past_key_values=static_cache(model, PROMPT + NEW + 1),
                                                         cache_position=position, position_ids=position[None])
    finally:
        unpatch(model)
    assert tokens == want_tokens
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    layer = cache.layers[0]
    assert layer.filled == int(layer.cumulative_length) == PROMPT + NEW  # the prompt and one slot per step


def test_the_compiled_model_is_the_unpatched_model_within_float32_rounding():
    """Compiled patched and unpatched logits over a prompt (the traced tables and rotation are ropekit's)."""
    model = tiny_qwen3()
    ids = torch.randint(1, COMMON["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        patch(model)
        try:
            got = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
        finally:
            unpatch(model)
    assert_logits_match(got, want)


def traced_logits(model, ids):
    """Logits and the values each cache layer holds: eager unpatched, then compiled patched (one graph).

    Returns ``(want, got, graphs)``: the unpatched ``(logits, cached values)``, the compiled
    patched ones, and the :class:`Graphs` the compiled forward was traced into.
    """
    def run(forward):
        out = forward(ids, use_cache=True)
        return out.logits, [layer.values.clone() for layer in out.past_key_values.layers]

    with torch.no_grad():
        want = run(model)
        patch(model)
        try:
            graphs = Graphs()
            got = run(torch.compile(model, backend=graphs, fullgraph=True))
        finally:
            unpatch(model)
    return want, got, graphs


@pytest.mark.parametrize("name", ["smollm3 listed", "llama4 listed"])
def test_a_compiled_nope_schedule_rotates_the_rope_layers_only(name, monkeypatch):
    """Layers 0 and 3 of ``no_rope_layers=[0, 1, 1, 0]`` are NoPE: two traced rotations, the unpatched logits."""
    calls = []
    real = traced.rotated_qk
    monkeypatch.setattr(traced, "rotated_qk", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = nope.tiny(name)
    (want, _), (got, _), graphs = traced_logits(model, nope.IDS)
    assert len(calls) == nope.rope_layer_count(model) == 2
    assert_logits_match(got, want)
    assert len(graphs.graphs) == 1 and graphs.ropekit_nodes() == []


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("case", ["plain", "yarn-v3"])
def test_compiled_deepseek_v3_caches_the_keys_of_the_unpatched_model(interleave, case):
    """MLA traced: logits within 1e-5 and the cached rotated keys in transformers' order (the pairing shows there)."""
    model = mla.tiny(mla.ROPE_CASES[case], rope_interleave=interleave)
    (want, want_keys), (got, keys), graphs = traced_logits(model, mla.IDS)
    assert_logits_match(got, want)
    for got_keys, cached in zip(keys, want_keys, strict=True):
        torch.testing.assert_close(got_keys, cached, rtol=0, atol=1e-5)
    assert len(graphs.graphs) == 1 and graphs.ropekit_nodes() == []


@pytest.mark.parametrize(("layout", "dtype", "rotary_dim"), [("half", torch.float32, 16),
                                                            ("interleaved", torch.float32, 8),
                                                            ("half", torch.bfloat16, 8),
                                                            ("interleaved", torch.bfloat16, 16)])
def test_the_traced_rotation_against_the_float64_reference(layout, dtype, rotary_dim):
    """``rotated`` eager and compiled by inductor: the reference rotation rounded once to x's dtype."""
    inv_freq, _ = ropekit.inv_frequencies(rotary_dim)
    positions = torch.tensor([[0, 3, 17, 200, 4095]])  # (batch, seq)
    cos, sin = ropekit.cos_sin(positions, inv_freq)
    cos, sin = cos[:, None], sin[:, None]  # (batch, 1, seq, rotary_dim // 2), as the patch passes them
    x = (torch.randn(1, 3, 5, 16, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    want = ropekit.apply_reference(x, positions[:, None].expand(1, 3, 5), inv_freq, layout=layout)
    ulp = torch.finfo(dtype).eps * want.abs().amax(-1, keepdim=True).clamp(min=1.0)  # at the head's magnitude
    compiled = torch.compile(traced.rotated, backend="inductor", fullgraph=True, dynamic=False)
    for got in (traced.rotated(x, cos, sin, layout), compiled(x, cos, sin, layout)):
        assert got.dtype == dtype and got.shape == x.shape
        assert ((got.double() - want).abs() <= (1.0 if dtype == torch.bfloat16 else 4.0) * ulp).all()
        assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])
