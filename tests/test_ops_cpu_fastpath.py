"""The C++ kernel's two doors: the ``torch.ops`` operators and the extension's plain Python functions.

The backend's eager calls (nothing to record or trace) use the plain functions, which skip the
dispatcher; autograd and ``torch.compile`` go through the ``ropekit::*`` operators. Both doors
run the same C++ function, so their results must be equal bit for bit; the eager path must not
cross the dispatcher for the rotation; the compiled graph must keep the operator.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.profiler import profile

import ropekit
from ropekit import ops

pytestmark = pytest.mark.skipif("cpu" not in ops.available(), reason="C++ CPU kernel unavailable (no compiler)")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@given(st.sampled_from(DTYPES), st.booleans(), st.booleans(), st.integers(1, 5), st.integers(1, 4),
       st.sampled_from([4, 8, 16]), st.sampled_from([0, 2]), st.booleans(), st.integers(0, 2**16))
def test_plain_functions_equal_the_operators(dtype, interleaved, conjugate, batch, kv_heads, half, tail,
                                             transposed, seed):
    gen = torch.Generator().manual_seed(seed)
    head_dim = 2 * half + tail
    q = (torch.randn(batch, 5, 2 * kv_heads, head_dim, generator=gen) * 3).to(dtype)
    k = (torch.randn(batch, 5, kv_heads, head_dim, generator=gen) * 3).to(dtype)
    if transposed:  # (b, s, h, d) storage seen as (b, h, s, d)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cos = torch.rand(batch, 1, 5, half, generator=gen, dtype=table_dtype)
    sin = torch.rand(batch, 1, 5, half, generator=gen, dtype=table_dtype)
    if not transposed:
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
    backend = ops.get("cpu")
    module, operators = backend.module, backend.operators()
    for name in ("apply_rotary_qk", "apply_rotary"):
        qk = name == "apply_rotary_qk"
        args = (q, k, cos, sin) if qk else (q, cos, sin)
        plain = getattr(module, name)(*args, interleaved, conjugate)
        via_op = getattr(operators, name)(*args, interleaved, conjugate)
        for a, b in zip(plain if qk else (plain,), via_op if qk else (via_op,), strict=True):
            assert a.dtype == dtype and torch.equal(bits(a), bits(b))
        copies = [t.clone() for t in args[: 2 if qk else 1]]
        inplace_args = (*copies, *args[len(copies):])
        getattr(module, name + "_")(*inplace_args, interleaved, conjugate)
        for got, want in zip(copies, plain if qk else (plain,), strict=True):
            assert torch.equal(bits(got), bits(want))


def dispatched(fn):
    """Names of the operators ``fn()`` called through the dispatcher (the profiler records each call)."""
    with profile() as prof:
        fn()
    return [event.name for event in prof.events()]


def test_eager_call_skips_the_dispatcher_and_autograd_takes_the_operator():
    inv_freq, _ = ropekit.inv_frequencies(32)
    cos, sin = ropekit.cos_sin(torch.tensor([[7], [11]]), inv_freq)
    cos, sin = cos[:, None], sin[:, None]
    q, k = torch.randn(2, 4, 1, 32), torch.randn(2, 2, 1, 32)
    backend = ops.get("cpu")
    # the probe sees a dispatcher call: the operator door is recorded, the plain function is not
    assert "ropekit_cpu::apply_rotary_qk" in dispatched(lambda: backend.operators().apply_rotary_qk(q, k, cos, sin,
                                                                                                     False, False))
    for inplace in (False, True, False, True):  # the second call of a signature takes the prepared call
        names = dispatched(lambda inplace=inplace: ropekit.apply_rotary_qk(q, k, cos, sin, inplace=inplace))
        assert not [n for n in names if n.startswith("ropekit")], names
    q_grad = q.clone().requires_grad_()
    holder = []
    names = dispatched(lambda: holder.append(ropekit.apply_rotary_qk(q_grad, k, cos, sin)))
    assert "ropekit::apply_rotary_qk" in names
    holder[0][0].sum().backward()
    assert torch.equal(q_grad.grad, ropekit.apply_rotary(torch.ones_like(q), cos, -sin))


def test_compiled_graph_keeps_the_operator_and_matches_the_plain_call():
    inv_freq, _ = ropekit.inv_frequencies(16)
    cos, sin = ropekit.cos_sin(torch.arange(6), inv_freq)
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes])
        return gm.forward

    eager = ropekit.apply_rotary_qk(q, k, cos, sin)
    compiled = torch.compile(lambda a, b: ropekit.apply_rotary_qk(a, b, cos, sin), fullgraph=True, backend=record)
    got = compiled(q, k)
    assert any("ropekit.apply_rotary_qk" in target for graph in graphs for target in graph), graphs
    for a, b in zip(got, eager, strict=True):
        assert torch.equal(a, b)
