"""ALiBi against the paper's definition written out here and against x-transformers, BLOOM and MPT.

Press et al. 2022 ("Train Short, Test Long"): softmax(q_i . k_j / sqrt(d) - m_h (i - j)) over j <= i,
slopes from the reference code's ``get_slopes``.

Each property is one comparison (``*_mismatch``: ``None`` when it holds, else what differs) run
over fixed cases (``*_CASES``) by a test here; tests/test_mutations.py breaks the module and runs
the same comparisons over the same cases to show that each one notices. The comparisons reach the
module's functions through ``ropekit.nn.alibi`` at call time, so a replaced function is the one checked.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropekit.nn import ALiBiSelfAttention, KVCache, alibi_bias, alibi_slopes
from ropekit.nn import alibi as alibi_module

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


def bloom_slopes(heads: int) -> torch.Tensor | None:
    """transformers' BLOOM ``build_alibi_tensor`` slopes (float32): its bias is ``m_h j``, so key 1's entry is m_h."""
    try:
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    except ImportError:
        return None
    return build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)[:, 0, 1].double()


def slopes_mismatch(heads: int) -> str | None:
    """``alibi_slopes`` and a module's ``slopes`` against the paper's ``get_slopes``, 2^(-8(h+1)/n) and BLOOM's."""
    expected = torch.tensor(paper_slopes(heads), dtype=torch.float64)
    if heads & (heads - 1) == 0:  # a power of two: the geometric sequence 2^(-8/n), 2^(-16/n), ...
        closed = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float64)
        if not torch.allclose(expected, closed, rtol=1e-14, atol=0):
            return f"the paper's slopes for {heads} heads are not 2^(-8(h+1)/n)"  # the oracle itself
    peer = bloom_slopes(heads)
    module = ALiBiSelfAttention(2 * heads, heads)
    for name, got in (("alibi_slopes", alibi_module.alibi_slopes(heads)), ("module.slopes", module.slopes)):
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-14, atol=0):
            return f"{name}({heads}) = {got.tolist()}, the paper's {expected.tolist()}"
        if peer is not None and not torch.allclose(got, peer, rtol=1e-6, atol=0):
            return f"{name}({heads}) = {got.tolist()}, BLOOM's {peer.tolist()}"
    return None


SLOPE_HEADS = [1, 2, 3, 5, 6, 8, 12, 16, 20, 24, 32, 40, 64]


@pytest.mark.parametrize("heads", SLOPE_HEADS)
def test_slopes_are_the_papers_and_blooms(heads):
    problem = slopes_mismatch(heads)
    assert problem is None, problem


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


def attention_mismatch(num_heads: int, kv_heads: int, causal: bool, batch: int, seq: int,
                       starts: list[int] | None, seed: int) -> str | None:
    """The module's output (float64, with projection biases) against :func:`oracle`.

    ``starts``: each row's first position (positions ``start + arange(seq)``); ``None`` leaves
    the module its default positions ``0 .. seq - 1``.
    """
    torch.manual_seed(seed)
    module = ALiBiSelfAttention(4 * num_heads, num_heads, num_kv_heads=kv_heads, causal=causal, bias=True).double()
    x = torch.randn(batch, seq, 4 * num_heads, dtype=torch.float64)
    first = torch.zeros(batch, dtype=torch.long) if starts is None else torch.tensor(starts)
    positions = first[:, None] + torch.arange(seq)
    got = module(x) if starts is None else module(x, positions)
    error = (got - oracle(module, x, positions)).abs().max().item()
    return None if error <= 1e-10 else f"output differs from the float64 softmax with the paper's bias by {error:.3g}"


# (num_heads, kv_heads, causal, batch, seq, starts, seed): default positions (from 0) and given ones,
# a power of two and other head counts, grouped keys, causal and not
ATTENTION_CASES = [
    (4, 2, True, 2, 6, None, 0),
    (3, 3, True, 1, 7, None, 1),
    (6, 3, False, 2, 5, None, 2),
    (8, 8, True, 2, 6, [0, 40], 3),
    (5, 1, False, 1, 6, [7], 4),
]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_module_matches_the_definition_fixed_cases(case):
    problem = attention_mismatch(*case)
    assert problem is None, problem


@settings(max_examples=20, deadline=None)
@given(data=st.data(), heads=st.sampled_from([(1, 1), (2, 2), (3, 3), (4, 2), (6, 3), (4, 1)]),
       causal=st.booleans(), batch=st.integers(1, 2), seq=st.integers(1, 7))
def test_module_matches_the_definition(data, heads, causal, batch, seq):
    seed = data.draw(st.integers(0, 2**16), label="seed")
    starts = data.draw(st.none() | st.lists(st.integers(0, 500), min_size=batch, max_size=batch), label="starts")
    problem = attention_mismatch(*heads, causal, batch, seq, starts, seed)
    assert problem is None, problem


def bias_mismatch(num_heads: int, causal: bool, seq: int, past: int, positions: list[int] | None) -> str | None:
    """The bias the module adds to the scaled logits (``score_bias``) against ``-m_h |i - j|`` written out.

    ``m_h`` are the paper's slopes; under the causal mask keys after the query get ``-inf`` (where
    the module leaves the mask to SDPA's ``is_causal`` it is applied here to both sides). ``past``:
    cached keys before the ``seq`` new tokens, whose positions continue at ``past``.
    """
    module = ALiBiSelfAttention(2 * num_heads, num_heads, causal=causal)
    given_positions = None if positions is None else torch.tensor(positions)
    got, _ = module.score_bias(1, seq, past, given_positions, None, torch.float64, torch.device("cpu"))
    query_pos = list(range(past, past + seq)) if positions is None else positions
    key_pos = list(range(past + seq)) if positions is None else positions
    slopes = paper_slopes(num_heads)
    expected = torch.tensor([[[-slopes[h] * abs(i - j) for j in key_pos] for i in query_pos]
                             for h in range(num_heads)], dtype=torch.float64)
    if causal:
        later = torch.ones(seq, past + seq, dtype=torch.bool).tril(diagonal=past).logical_not()
        expected = expected.masked_fill(later, -math.inf)
        got = got.masked_fill(later, -math.inf)
    if got.shape != (1, *expected.shape):
        return f"bias of shape {tuple(got.shape)}, expected {(1, *expected.shape)}"
    if not torch.allclose(got[0], expected, rtol=1e-14, atol=0, equal_nan=False):
        error = (got[0] - expected).nan_to_num(posinf=math.inf, neginf=math.inf).abs().max().item()
        return f"bias differs from -m_h |i - j| by {error:.3g}"
    return None


# (num_heads, causal, seq, past, positions)
BIAS_CASES = [
    (4, True, 6, 0, None),
    (3, False, 5, 0, None),
    (6, True, 3, 4, None),
    (12, False, 4, 0, [0, 1, 5, 9]),
    (2, True, 1, 7, None),
]


@pytest.mark.parametrize("case", BIAS_CASES)
def test_bias_is_minus_slope_times_distance(case):
    problem = bias_mismatch(*case)
    assert problem is None, problem


def shift_mismatch(num_heads: int, causal: bool, seq: int, shift: int, seed: int) -> str | None:
    """Only distances matter: the output at positions ``shift + arange(seq)`` equals that at the default ``0 ..``."""
    torch.manual_seed(seed)
    module = ALiBiSelfAttention(4 * num_heads, num_heads, causal=causal).double()
    x = torch.randn(2, seq, 4 * num_heads, dtype=torch.float64)
    error = (module(x, shift + torch.arange(seq)) - module(x)).abs().max().item()
    return None if error <= 1e-12 else f"positions shifted by {shift} move the output by {error:.3g}"


# (num_heads, causal, seq, shift, seed)
SHIFT_CASES = [(4, True, 6, 1, 0), (3, False, 5, 500, 1), (8, True, 7, 37, 2)]


@pytest.mark.parametrize("case", SHIFT_CASES)
def test_output_depends_on_distances_only(case):
    problem = shift_mismatch(*case)
    assert problem is None, problem


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
