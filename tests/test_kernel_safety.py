"""Hostile sizes and slots: the C++ kernels refuse them themselves (reachable through torch.ops
without ropekit's Python checks), the public functions refuse them with a ValueError naming the
argument, and valid but unusual inputs (empty, channel-strided inputs and caches) are accepted and
give the torch backend's bits."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ropekit
from ropekit import ops
from ropekit.fused.cache import slot_mapping

ROOT = Path(__file__).resolve().parent.parent
native = pytest.mark.skipif("cpu" not in ops.available(), reason="C++ CPU kernel unavailable")


def tables(positions, half):
    return ropekit.cos_sin(positions, ropekit.inv_frequencies(2 * half)[0])


def cache_call(batch=2, table_batch=None, length=4, seq=2, d=8):
    """k, v (batch, 1, seq, d), tables (table_batch or batch, 1, seq, d/2), caches of ``length``."""
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(batch, 1, seq, d, generator=gen), torch.randn(batch, 1, seq, d, generator=gen)
    cos, sin = tables(torch.arange(seq).repeat(table_batch or batch, 1), d // 2)
    k_cache, v_cache = torch.randn(batch, 1, length, d, generator=gen), torch.randn(batch, 1, length, d, generator=gen)
    return k, v, cos[:, None], sin[:, None], k_cache, v_cache


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("slots", [2**63 - 1, 2**63, 3, torch.tensor([2**63 - 1, 0]), torch.tensor([0, 3]),
                                   torch.tensor(2**62), torch.tensor([-1, 0])])
def test_starts_past_the_cache_raise_a_value_error_naming_slots_and_write_nothing(backend, slots):
    """Starts near 2**63 (start + seq overflowed in C++ and the row was written before the cache)."""
    k, v, cos, sin, k_cache, v_cache = cache_call()
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(ValueError, match="slots"):
        ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, backend=backend)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@native
@pytest.mark.parametrize("slots,start", [(torch.tensor([2**63 - 1, 0]), 0), (None, 2**63 - 1),
                                         (torch.tensor([0, 2**63 - 2]), 0), (None, -(2**63))])
def test_the_cpp_operator_itself_refuses_starts_that_overflow(slots, start):
    """torch.ops reach the kernel without the Python checks: it checks ``first <= length - seq``."""
    k, v, cos, sin, k_cache, v_cache = cache_call()
    before = k_cache.clone()
    with pytest.raises(ValueError, match="do not fit in a cache of length 4"):
        ops.get("cpu").operators().rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, start, None, None, 0.0,
                                                     False, 0, False)
    assert torch.equal(k_cache, before)


@native
def test_the_cpp_operator_refuses_tables_of_another_batch_with_per_row_starts():
    """Tables of batch 2 for keys of batch 4: the per-row branch read cos/sin past their end."""
    k, v, cos, sin, k_cache, v_cache = cache_call(batch=4, table_batch=2)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="do not broadcast against k"):
        ops.get("cpu").operators().rotate_into_cache(k, v, cos, sin, k_cache, v_cache, torch.tensor([0, 1, 2, 0]), 0,
                                                     None, None, 0.0, False, 0, False)
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_tables_of_another_batch_are_refused_after_a_valid_call(backend):
    """The same call refused cold is refused warm (after a valid call of the same kinds)."""
    k, v, cos, sin, k_cache, v_cache = cache_call(batch=4)
    ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, torch.tensor([0, 1, 2, 0]), backend=backend)
    before = k_cache.clone()
    _, _, cos2, sin2, _, _ = cache_call(batch=4, table_batch=2)
    with pytest.raises(ValueError, match="broadcast"):
        ropekit.rotate_into_cache(k, v, cos2, sin2, k_cache, v_cache, torch.tensor([0, 1, 2, 0]), backend=backend)
    assert torch.equal(k_cache, before)


@native
@pytest.mark.parametrize("slot", [8, 2**62, 2**63 - 1])
def test_the_cpp_operator_refuses_paged_slots_past_the_cache(slot):
    k, v = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    cos, sin = tables(torch.arange(2)[:, None], 4)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="outside a cache of 8 slots"):
        ops.get("cpu").operators().rotate_into_cache(k, v, cos, sin, k_cache, v_cache, torch.tensor([0, slot]), 0,
                                                     None, None, 0.0, False, 4, False)
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("block", [-1, -(2**62), 2**62, 2**63 // 4, 2**63 - 1])
def test_slot_mapping_refuses_block_ids_that_would_drop_or_wrap_tokens(block):
    """Block -1 gave negative slots (read as padding: the tokens dropped); 2**62 * 4 wrapped to block 0."""
    table = torch.tensor([[5, 6], [block, 7]])
    with pytest.raises(ValueError, match=rf"block_table must hold block ids .* got {block} for sequence 1"):
        slot_mapping(table, torch.tensor([[0, 5], [1, 4]]), 4)


def test_slot_mapping_keeps_the_largest_block_whose_slots_fit_int64_and_ignores_padding_rows():
    last = (2**63 - 4) // 4
    slots = slot_mapping(torch.tensor([[last, -1]]), torch.tensor([[3, -1]]), 4)
    assert slots.tolist() == [last * 4 + 3, -1] and last * 4 + 3 == 2**63 - 1


def empty_channel_strided(shape):
    """An empty tensor whose channels are strided (a slice of every other channel)."""
    x = torch.empty(*shape[:-1], 2 * shape[-1])[..., ::2]
    assert x.numel() == 0 and x.stride(-1) == 2
    return x


@native
@pytest.mark.parametrize("per_token", [False, True])
def test_empty_channel_strided_inputs_give_empty_results_in_every_fused_form(per_token):
    """They raised "x must have unit channel stride" in the C++ kernel."""
    norm = "per_token" if per_token else "per_head"
    q, k = empty_channel_strided((0, 2, 8)), empty_channel_strided((0, 2, 8))
    cos, sin = tables(torch.arange(0)[:, None], 4)
    w = torch.ones(2, 8) if per_token else torch.ones(8)
    for backend in ("cpu", "torch"):
        out = ropekit.rms_norm_rotary(q, w, cos, sin, eps=1e-6, norm=norm, backend=backend)
        assert out.shape == q.shape
        oq, ok = ropekit.rms_norm_rotary_qk(q, k, w, w, cos, sin, eps=1e-6, norm=norm, backend=backend)
        assert oq.shape == q.shape and ok.shape == k.shape
        k_cache, v_cache = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
        ropekit.rotate_into_cache(q, k, cos, sin, k_cache, v_cache, torch.zeros(0, dtype=torch.long), block_size=4,
                                  backend=backend)
        assert not k_cache.any() and not v_cache.any()


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_channel_strided_caches_are_written_with_the_torch_backends_bits(dtype, paged, eps):
    """They raised an undocumented RuntimeError in C++; the torch backend wrote them."""
    gen = torch.Generator().manual_seed(5)
    if paged:
        k, v = torch.randn(3, 2, 8, generator=gen).to(dtype), torch.randn(3, 2, 8, generator=gen).to(dtype)
        cos, sin = tables(torch.tensor([[4], [9], [2]]), 4)
        shape, slots, block_size = (3, 4, 2, 8), torch.tensor([5, -1, 0]), 4
    else:
        k, v = torch.randn(2, 2, 1, 8, generator=gen).to(dtype), torch.randn(2, 2, 1, 8, generator=gen).to(dtype)
        cos, sin = tables(torch.tensor([[3], [1]]), 4)
        cos, sin = cos[:, None], sin[:, None]
        shape, slots, block_size = (2, 2, 5, 8), torch.tensor([3, 1]), None
    start = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).to(dtype)
    written = []
    for backend in ("cpu", "torch"):
        k_cache, v_cache = start.clone()[..., ::2], start.clone()[..., 1::2]
        assert k_cache.stride(-1) == 2 and v_cache.stride(-1) == 2
        ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots, block_size=block_size, eps=eps,
                                  backend=backend)
        written.append((k_cache, v_cache))
    assert torch.equal(written[0][0], written[1][0]) and torch.equal(written[0][1], written[1][1])
    assert not torch.equal(written[0][0], start[..., ::2])  # something was written


def test_require_native_fails_the_session_when_the_kernel_is_unavailable(tmp_path):
    """ROPEKIT_REQUIRE_NATIVE=1 (CI) turns an unbuildable kernel into a failed run, not ~150 skips."""
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    for name in ("conftest.py", "lab_source.py"):  # the conftest and the module it imports
        (tmp_path / name).write_text((ROOT / "tests" / name).read_text())
    env = dict(os.environ, ROPEKIT_REQUIRE_NATIVE="1", ROPEKIT_DISABLE_NATIVE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode != 0
    assert "ROPEKIT_REQUIRE_NATIVE is set but ropekit's C++ CPU kernel is unavailable" in run.stdout + run.stderr
    env["ROPEKIT_REQUIRE_NATIVE"] = "0"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
