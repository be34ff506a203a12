"""ALiBi against the paper's definition written out here and against x-transformers, BLOOM and MPT.

Press et al. 2022 ("Train Short, Test Long"): softmax(q_i . k_j / sqrt(d) - m_h (i - j)) over j <= i,
slopes from the reference code's ``get_slopes``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropekit.nn import ALiBiSelfAttention, KVCache, alibi_bias, alibi_slopes

torch.set_num_threads(1)


def paper_slopes(n: int) -> list[float]:
    """ofirpress/attention_with_linear_biases ``get_slopes``, as the paper's code computes it."""
    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 24, 32, 40, 64])
def test_slopes_are_the_papers(heads):
    torch.testing.assert_close(alibi_slopes(heads), torch.tensor(paper_slopes(heads), dtype=torch.float64),
                               atol=0, rtol=1e-14)


def test_slopes_worked_examples():
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]
    twelve = alibi_slopes(12).tolist()
    assert twelve[:8] == [2.0 ** -k for k in range(1, 9)]
    assert twelve[8:] == pytest.approx([2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5], rel=1e-15)


def linear64(lin: torch.nn.Linear, t: torch.Tensor) -> torch.Tensor:
    out = t @ lin.weight.detach().double().T
    return out if lin.bias is None else out + lin.bias.detach().double()


def oracle(module: ALiBiSelfAttention, x: torch.Tensor, positions: torch.Tensor,
           key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The paper's attention, one head and one query at a time, float64; key_mask (batch, seq), True = attend."""
    x = x.double()
    batch, seq, _ = x.shape
    d, heads, group = module.head_dim, module.num_heads, module.num_heads // module.num_kv_heads
    q = linear64(module.q_proj, x).view(batch, seq, heads, d)
    k = linear64(module.k_proj, x).view(batch, seq, -1, d)
    v = linear64(module.v_proj, x).view(batch, seq, -1, d)
    slopes = paper_slopes(heads)
    out = torch.zeros(batch, seq, heads, d, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                keys = [j for j in range(seq) if (j <= i or not module.causal)
                        and (key_mask is None or bool(key_mask[b, j]))]
                if not keys:
                    continue  # a query that sees no key gives zeros
                logits = torch.stack([
                    q[b, i, h] @ k[b, j, h // group] / math.sqrt(d)
                    - slopes[h] * abs(int(positions[b, i]) - int(positions[b, j])) for j in keys])
                weights = torch.softmax(logits, dim=0)
                out[b, i, h] = sum(w * v[b, j, h // group] for w, j in zip(weights, keys, strict=True))
    return linear64(module.o_proj, out.reshape(batch, seq, heads * d))


@settings(max_examples=20, deadline=None)
@given(data=st.data(), heads=st.sampled_from([(1, 1), (2, 2), (3, 3), (4, 2), (6, 3), (4, 1)]),
       causal=st.booleans(), batch=st.integers(1, 2), seq=st.integers(1, 7))
def test_module_matches_the_definition(data, heads, causal, batch, seq):
    num_heads, kv_heads = heads
    seed = data.draw(st.integers(0, 2**16), label="seed")
    torch.manual_seed(seed)
    module = ALiBiSelfAttention(4 * num_heads, num_heads, num_kv_heads=kv_heads, causal=causal, bias=True).double()
    x = torch.randn(batch, seq, 4 * num_heads, dtype=torch.float64)
    starts = data.draw(st.lists(st.integers(0, 500), min_size=batch, max_size=batch), label="starts")
    positions = torch.tensor(starts)[:, None] + torch.arange(seq)
    torch.testing.assert_close(module(x, positions), oracle(module, x, positions), atol=1e-12, rtol=1e-10)
    # the bias depends on i - j only: default positions give the same result
    torch.testing.assert_close(module(x), module(x, positions), atol=1e-12, rtol=0)


def test_padding_mask_and_rows_without_keys():
    torch.manual_seed(3)
    module = ALiBiSelfAttention(16, 4, num_kv_heads=2).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    key_mask = torch.ones(2, 6, dtype=torch.bool)
    key_mask[0, :2] = False  # left padding: the first two queries of row 0 see no key
    positions = torch.arange(6).expand(2, 6)
    got = module(x, attention_mask=key_mask)
    torch.testing.assert_close(got, oracle(module, x, positions, key_mask), atol=1e-12, rtol=1e-10)
    assert torch.isfinite(got).all() and got[0, :2].abs().max() == 0


def test_kv_cache_decoding_equals_the_full_forward():
    torch.manual_seed(4)
    module = ALiBiSelfAttention(24, 6, num_kv_heads=3).double()
    x = torch.randn(2, 10, 24, dtype=torch.float64)
    cache = KVCache()
    steps = [module(x[:, :3], cache=cache)] + [module(x[:, t:t + 1], cache=cache) for t in range(3, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), module(x), atol=1e-12, rtol=0)
    assert cache.length == 10
    with pytest.raises(ValueError, match="positions: with a non-empty cache"):
        module(x[:, :1], torch.tensor([10]), cache=cache)


def test_bias_tensor_matches_x_transformers():
    """x-transformers 2.31 ``AlibiPositionalBias``: slopes and the (heads, i, j) bias -m_h |i - j|."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    for heads in (1, 3, 4, 6, 8, 12):
        peer = xt.AlibiPositionalBias(heads=heads)
        torch.testing.assert_close(peer.slopes.flatten().double(), alibi_slopes(heads), rtol=1e-7, atol=0)
        positions = torch.arange(9)
        ours = alibi_bias(alibi_slopes(heads), positions, positions)
        torch.testing.assert_close(peer(9, 9).double(), ours, rtol=1e-6, atol=1e-6)
        # with a cache, x-transformers' queries are the last i of j keys
        torch.testing.assert_close(peer(2, 9).double(), alibi_bias(alibi_slopes(heads), positions[-2:], positions),
                                   rtol=1e-6, atol=1e-6)


def test_bloom_and_mpt_give_the_same_attention():
    """BLOOM adds +m_h j (a per-row shift of ours: the same softmax under the causal mask); MPT's slopes are ours."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    mpt = pytest.importorskip("transformers.models.mpt.modeling_mpt")
    heads, seq = 6, 8
    peer_bias = bloom.build_alibi_tensor(torch.ones(1, seq, dtype=torch.long), heads, torch.float32)
    peer_bias = peer_bias.view(1, heads, 1, seq)
    ours = alibi_bias(alibi_slopes(heads), torch.arange(seq), torch.arange(seq))
    assert (peer_bias.double() - ours).abs().max() > 1  # not the same tensor ...
    scores = torch.randn(1, heads, seq, seq, dtype=torch.float64)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    softmax = [(scores + b).masked_fill(~causal, -math.inf).softmax(-1) for b in (peer_bias.double(), ours)]
    torch.testing.assert_close(softmax[0], softmax[1], atol=1e-6, rtol=0)  # ... but the same attention
    for n in (4, 6, 12):
        mpt_slopes = -mpt.build_mpt_alibi_tensor(n, 2)[:, 0, 0].double()
        torch.testing.assert_close(mpt_slopes, alibi_slopes(n), rtol=1e-6, atol=0)


def test_far_keys_fade_and_the_head_order_is_by_slope():
    """The paper's point: each head looks back over about 1/m_h tokens; nothing past the training length changes."""
    bias = alibi_bias(alibi_slopes(4), torch.tensor([1000]), torch.arange(1001))[:, 0]
    weights = bias.softmax(-1)  # uniform content: attention by distance alone
    reach = (weights * (1000 - torch.arange(1001)).double()).sum(-1)  # mean distance looked back
    assert torch.all(reach[1:] > reach[:-1])
    torch.testing.assert_close(reach[0], torch.tensor(1 / math.expm1(0.25), dtype=torch.float64), rtol=1e-6, atol=0)


def test_float32_and_bfloat16_and_backward():
    module = ALiBiSelfAttention(16, 4)
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = module(x)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and all(p.grad is not None for p in module.parameters())
    half = ALiBiSelfAttention(16, 4).to(torch.bfloat16)
    half.load_state_dict(module.state_dict())
    torch.testing.assert_close(half(x.detach().bfloat16()).float(), module(x).detach(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"embed_dim": 8, "num_heads": 0}, ValueError, "num_heads"),
    ({"embed_dim": 8, "num_heads": 4, "num_kv_heads": 3}, ValueError, "num_kv_heads"),
    ({"embed_dim": 10, "num_heads": 4}, ValueError, "embed_dim"),
    ({"embed_dim": 8, "num_heads": 2, "causal": 1}, TypeError, "causal"),
    ({"embed_dim": 8, "num_heads": 2, "dropout": 1.0}, ValueError, "dropout"),
])
def test_constructor_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        ALiBiSelfAttention(**kwargs)


def test_forward_errors_name_the_argument():
    module = ALiBiSelfAttention(8, 2)
    with pytest.raises(ValueError, match="x must have shape"):
        module(torch.randn(4, 8))
    with pytest.raises(ValueError, match="positions must have shape"):
        module(torch.randn(1, 4, 8), torch.arange(3))
    with pytest.raises(ValueError, match="positions"):
        module(torch.randn(1, 4, 8), torch.tensor([0, 1, -1, 2]))
    with pytest.raises(TypeError, match="attention_mask"):
        module(torch.randn(1, 4, 8), attention_mask=torch.ones(1, 4))
    with pytest.raises(TypeError, match="cache"):
        module(torch.randn(1, 4, 8), cache={})
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)
