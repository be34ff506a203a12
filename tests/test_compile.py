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
