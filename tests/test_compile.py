"""apply_rotary under torch.compile(fullgraph=True) on the CPU: traced without a graph break."""

import torch

import ropekit

torch.set_num_threads(1)


def test_apply_rotary_traces_fullgraph_and_matches_reference():
    inv_freq, _ = ropekit.inv_frequencies(32)
    positions = torch.arange(6)
    cos, sin = ropekit.cos_sin(positions, inv_freq)
    compiled = torch.compile(lambda x: ropekit.apply_rotary(x, cos, sin, layout="interleaved"),
                             fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 3, 6, 40)
    got = compiled(x).double()
    want = ropekit.apply_reference(x, positions, inv_freq, layout="interleaved")
    assert (got - want).abs().max() < 1e-5


def test_apply_rotary_qk_traces_fullgraph_after_eager_calls():
    """The decode fast path (a cache of prepared native calls) must stay out of traced code:
    eager calls first fill the cache, then the compiled function traces the plain ops."""
    inv_freq, _ = ropekit.inv_frequencies(16)
    positions = torch.tensor([[5], [9]])
    cos, sin = ropekit.cos_sin(positions, inv_freq)
    cos, sin = cos[:, None], sin[:, None]  # (batch, 1, 1, 8): one position per sequence
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 1, 16)
    eager = ropekit.apply_rotary_qk(q, k, cos, sin)
    ropekit.apply_rotary_qk(q, k, cos, sin)  # the second eager call takes the fast path
    compiled = torch.compile(lambda a, b: ropekit.apply_rotary_qk(a, b, cos, sin), fullgraph=True,
                             backend="aot_eager")
    got = compiled(q, k)
    for x, y, e in zip((q, k), got, eager, strict=True):
        want = ropekit.apply_reference(x, positions[:, None].expand(x.shape[:-1]), inv_freq)
        assert (y.double() - want).abs().max() < 1e-5
        torch.testing.assert_close(y, e, rtol=0, atol=1e-6)
