"""RotaryEmbedding(seq_len=): the length dynamic scaling rules decide from, for shards of a sequence.

A rank holding a shard rotates its tokens by their global positions; a dynamic rule must see the
global length, not one past the shard's largest position (which differs from rank to rank).
"""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ropekit
from ropekit.rope.shards import SCHEMES, shard_positions
from ropekit.scaling import DynamicNTK, LongRoPE, YaRN

ORIGINAL = 16
RULES = {
    "dynamic": DynamicNTK(factor=4.0, original_max_position_embeddings=ORIGINAL),
    "longrope": LongRoPE(short_factor=[1.0] * 8, long_factor=[1.0 + i for i in range(8)], factor=4.0,
                         original_max_position_embeddings=ORIGINAL),
}


def qk(seq_len, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seq_len)
    return (torch.randn(2, 4, seq_len, 16, generator=gen, dtype=dtype),
            torch.randn(2, 2, seq_len, 16, generator=gen, dtype=dtype))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("cp_size", [2, 4])
def test_a_shard_with_the_global_length_is_the_shard_of_the_whole_rotation(rule, scheme, cp_size):
    seq_len = 64  # past the rule's original context of 16
    q, k = qk(seq_len)
    whole_q, whole_k = ropekit.RotaryEmbedding(16, scaling=RULES[rule])(q, k)
    diverged = []
    for rank in range(cp_size):
        pos = shard_positions(seq_len, cp_size, rank, scheme=scheme)
        rope = ropekit.RotaryEmbedding(16, scaling=RULES[rule])
        got_q, got_k = rope(q[:, :, pos], k[:, :, pos], pos, seq_len=seq_len)
        assert torch.equal(got_q, whole_q[:, :, pos]) and torch.equal(got_k, whole_k[:, :, pos])
        local_q, _ = ropekit.RotaryEmbedding(16, scaling=RULES[rule])(q[:, :, pos], k[:, :, pos], pos)
        diverged.append(not torch.allclose(local_q, whole_q[:, :, pos], atol=1e-3))
    # Without seq_len the rule decides from this rank's max(position) + 1, which differs from rank to rank:
    # DynamicNTK then picks other frequencies on some rank; LongRoPE only where a shard ends inside the
    # original context (contiguous on 4 ranks: rank 0 holds positions 0-15), elsewhere it diverges by luck not.
    assert any(diverged) == (rule == "dynamic" or (scheme, cp_size) == ("contiguous", 4))


@given(positions=st.lists(st.integers(0, 200), min_size=1, max_size=12), extra=st.integers(0, 300))
def test_seq_len_sets_the_frequencies_of_the_rule_in_float64(positions, extra):
    """Against the float64 oracle: rotation matrices of the frequencies the rule gives at seq_len."""
    pos = torch.tensor(positions)
    seq_len = int(pos.max()) + 1 + extra
    rule = RULES["dynamic"]
    x = torch.randn(1, 2, len(positions), 16, dtype=torch.float64)
    got = ropekit.RotaryEmbedding(16, scaling=rule).rotate_one(x, pos, seq_len=seq_len)
    inv_freq, scale = rule.compute(16, 10000.0, seq_len)
    assert scale == 1.0
    torch.testing.assert_close(got, ropekit.apply_reference(x, pos, inv_freq, layout="half"), rtol=0, atol=1e-6)


def test_seq_len_does_not_stick_to_the_module():
    rope = ropekit.RotaryEmbedding(16, scaling=RULES["dynamic"])
    q, k = qk(8)
    fresh = ropekit.RotaryEmbedding(16, scaling=RULES["dynamic"])(q, k)
    rope(q, k, seq_len=1000)
    again = rope(q, k)
    assert torch.equal(again[0], fresh[0]) and torch.equal(again[1], fresh[1])
    assert not torch.allclose(rope(q, k, seq_len=1000)[0], fresh[0])


def test_static_rules_ignore_seq_len_and_cos_sin_takes_it():
    q, k = qk(8)
    for scaling in (None, YaRN(factor=4.0, original_max_position_embeddings=16)):
        rope = ropekit.RotaryEmbedding(16, scaling=scaling)
        assert torch.equal(rope(q, k, seq_len=4096)[0], rope(q, k)[0])
    rope = ropekit.RotaryEmbedding(16, scaling=RULES["dynamic"])
    pos = torch.tensor([3, 9])
    cos, _ = rope.cos_sin(pos, seq_len=64)
    inv_freq, _ = RULES["dynamic"].compute(16, 10000.0, 64)
    torch.testing.assert_close(cos, torch.cos(pos[:, None].double() * inv_freq).float(), rtol=0, atol=1e-7)


def test_seq_len_must_cover_the_positions():
    rope = ropekit.RotaryEmbedding(16, scaling=RULES["dynamic"])
    q, k = qk(8)
    pos = torch.arange(24, 32)
    with pytest.raises(ValueError, match=r"seq_len .* must exceed every position: got seq_len=8 but a position of 31"):
        rope(q, k, pos, seq_len=8)  # a shard's own length where the global one belongs
    with pytest.raises(TypeError, match="seq_len must be None or an int >= 1, got float 32.0"):
        rope(q, k, pos, seq_len=32.0)
    with pytest.raises(ValueError, match="seq_len"):
        rope.rotate_one(q, pos, seq_len=31)
    with pytest.raises(ValueError, match="shard_scheme applies to DTensor q and k only"):
        rope(q, k, pos, shard_scheme="zigzag")


def test_importing_ropekit_distributed_leaves_dtensor_unimported():
    """ropekit.distributed loads torch.distributed.tensor on a DTensor's first use only."""
    code = (
        "import sys, torch, ropekit.distributed\n"
        "print('torch.distributed.tensor' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
