"""A warm call is a cold call: the same outcome whether or not a call of its signature came before.

The property test draws sequences of calls, valid and invalid (aliased arguments, ``inplace=1``,
dtypes that do not fit, tables of another batch, offsets outside the tables, unknown or unfit
backend names), over every public entry point (``RotaryEmbedding`` one module per backend, whose
tables grow as the calls need), and replays each sequence twice: cold (every prepared call forgotten before each call,
as in a fresh process: :func:`ropekit.ops.prepared.clear`) and warm (state kept, each call made
twice in a row, after a valid call of the same entry point, shapes and options). Outcomes must be
identical: the same exception type and message, or the same bits in every output and every input
(in-place results, caches). The values of the valid calls are the other test modules' business
(against the float64 reference); the cases the property found are spelled out one by one below.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ropekit
from ropekit import ops
from ropekit.ops import prepared

torch.set_num_threads(1)

B, H, S, D, MAX_LEN, BLOCK = 2, 2, 3, 8, 8, 4
ENTRIES = ("apply_rotary", "apply_rotary_qk", "rotate", "rotate_qk", "rotate_qk_offset", "rms_norm_rotary_qk",
           "rms_norm_rotary", "cache_contiguous", "cache_paged", "module_forward", "fp8_contiguous", "fp8_paged")
MODULES: dict[str, ropekit.RotaryEmbedding] = {}  # one per backend name, kept across calls: its calls get warm
VARIANTS = ("valid", "valid", "valid", "same_tensor", "overlap", "inplace_int", "dtype", "table_batch", "scale_zero",
            "scale_nan", "scale_kind")  # the scale_* variants: FP8 entries only (valid calls elsewhere)
SCALE_KINDS = ("per_head", "per_tensor", "float", "none", "per_head_bf16")
BACKEND_NAMES = ("auto", "torch", "cpu", "triton", "no-such-backend")


def _tables(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ropekit.cos_sin(positions, ropekit.inv_frequencies(D)[0])


def build(entry: str, variant: str, dtype: torch.dtype, inplace: bool, backend: str, seed: int):
    """``(call, inputs)``: a call of ``entry`` on fresh tensors drawn from ``seed``; the tensors to compare after it."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    flag = 1 if variant == "inplace_int" else inplace
    cos, sin = _tables(torch.arange(S))
    if variant == "table_batch":  # a batch axis of 3 against x's 2
        cos, sin = cos.expand(3, 1, S, D // 2).contiguous(), sin.expand(3, 1, S, D // 2).contiguous()
    buf = randn(B + 1, H, S, D)
    q, k = randn(B, H, S, D), randn(B, H, S, D)
    if variant == "same_tensor":
        k = q
    elif variant == "overlap":
        q, k = buf[0:B], buf[1:B + 1]
    if variant == "dtype":
        k = k.double()
    w_q, w_k = randn(D, dt=torch.float32), randn(D, dt=torch.float32)
    opts = dict(backend=backend)
    if entry == "apply_rotary":
        x = buf[0:B] if variant == "overlap" else q
        c, s = (x.float()[..., : D // 2], sin) if variant == "overlap" and dtype == torch.float32 else (cos, sin)
        return (lambda: ropekit.apply_rotary(x, c, s, inplace=flag, **opts)), [x, c, s]
    if entry == "apply_rotary_qk":
        return (lambda: ropekit.apply_rotary_qk(q, k, cos, sin, inplace=flag, **opts)), [q, k, cos, sin]
    table_cos, table_sin = _tables(torch.arange(MAX_LEN))
    if entry == "rotate":
        offsets = torch.tensor([1, 4]) if variant != "table_batch" else torch.tensor([1, 4, 2])
        return (lambda: ropekit.rotate(q, table_cos, table_sin, offsets=offsets, seq_dim=2, inplace=flag, **opts)), [q]
    if entry == "rotate_qk":
        offsets = torch.tensor([1, 4]) if variant != "table_batch" else torch.tensor([1, 4, 2])
        return (lambda: ropekit.rotate_qk(q, k, table_cos, table_sin, offsets=offsets, seq_dim=2, inplace=flag,
                                          **opts)), [q, k]
    if entry == "rms_norm_rotary_qk":
        return (lambda: ropekit.rms_norm_rotary_qk(q, k, w_q, w_k, cos, sin, eps=1e-6, inplace=flag, **opts)), [q, k]
    if entry == "rms_norm_rotary":
        x = buf[0:B] if variant == "overlap" else q
        w = x.float()[0, 0, 0] if variant == "overlap" and dtype == torch.float32 else w_q
        return (lambda: ropekit.rms_norm_rotary(x, w, cos, sin, eps=1e-6, inplace=flag, **opts)), [x, w]
    # by one int offset: valid ones of the seed, or outside the tables (-1; MAX_LEN: past the module's cached rows)
    offset = -1 if variant == "table_batch" else (MAX_LEN if seed == 3 else seed)
    if entry == "rotate_qk_offset":
        return (lambda: ropekit.rotate_qk(q, k, table_cos, table_sin, offsets=offset, seq_dim=2, inplace=flag,
                                          **opts)), [q, k]
    if entry == "module_forward":
        module = MODULES.setdefault(backend, ropekit.RotaryEmbedding(D, backend=backend, max_cached_positions=MAX_LEN))
        return (lambda: module(q, k, offset=offset, inplace=flag)), [q, k]
    if entry.startswith("fp8"):
        return build_fp8(entry == "fp8_paged", variant, dtype, backend, seed, k, randn, cos, sin)
    cache_dtype = torch.bfloat16 if variant == "dtype" else dtype  # float32 keys into bfloat16 caches
    key_in = k.to(dtype) if variant == "dtype" else k
    value = randn(*key_in.shape)
    if entry == "cache_contiguous":
        k_cache, v_cache = randn(B, H, MAX_LEN, D, dt=cache_dtype), randn(B, H, MAX_LEN, D, dt=cache_dtype)
        if variant == "same_tensor":
            v_cache = k_cache
        elif variant == "overlap":
            key_in = k_cache[:, :, :S]
        c, s = cos[:, None] if variant == "table_batch" else cos, sin[:, None] if variant == "table_batch" else sin
        slots = 1 if variant != "inplace_int" else -1
        return (lambda: ropekit.rotate_into_cache(key_in, value, c, s, k_cache, v_cache, slots, **opts)), [
            key_in, value, k_cache, v_cache]
    tokens = B * S  # paged: (tokens, heads, head_dim) keys, slots from a block table
    key_p, value_p = key_in.transpose(1, 2).reshape(tokens, H, D), value.transpose(1, 2).reshape(tokens, H, D)
    k_cache, v_cache = randn(4, BLOCK, H, D, dt=cache_dtype), randn(4, BLOCK, H, D, dt=cache_dtype)
    if variant == "same_tensor":
        v_cache = k_cache
    elif variant == "overlap":
        key_p = k_cache.view(-1, H, D)[:tokens]
    slots = ropekit.slot_mapping(torch.tensor([[0, 1], [3, 2]]), torch.arange(S).repeat(B, 1) + 2, BLOCK)
    if variant == "table_batch":
        slots = slots[:-1]
    c, s = _tables(torch.arange(S).repeat(B) + 2)
    c, s = c[:, None], s[:, None]
    return (lambda: ropekit.rotate_into_cache(key_p, value_p, c, s, k_cache, v_cache, slots, block_size=BLOCK,
                                              **opts)), [key_p, value_p, k_cache, v_cache]


def _scale(kind: str, bad: float | None, seed: int):
    """An FP8 scale of ``kind`` (``SCALE_KINDS``), with ``bad`` (0 or NaN) in one place when given."""
    values = torch.tensor([0.5, 0.25], dtype=torch.float32)[:H] * (1 + seed)
    if bad is not None:
        values[seed % H] = bad
    if kind == "per_head":
        return values
    if kind == "per_head_bf16":
        return values.bfloat16()
    if kind == "per_tensor":
        return values[seed % H].clone().reshape(())
    if kind == "float":
        return float(values[seed % H])
    return None if bad is None else float(bad)  # "none": 1.0, or a bad float


def build_fp8(paged: bool, variant: str, dtype: torch.dtype, backend: str, seed: int, k, randn, cos, sin):
    """``(call, inputs)`` of ``rotate_into_cache`` into FP8 caches (the other cache FP8 or of v's dtype).

    The seed picks the kind of the scales and the caches' FP8 dtypes; ``scale_zero``/``scale_nan``
    put 0 / NaN into one scale value, ``scale_kind`` passes the next kind of scale (per tensor
    instead of per head, a float instead of a tensor, ...); ``dtype`` gives float64 keys; ``overlap``
    a k_scale inside the k cache's memory; ``same_tensor`` k_scale for a cache that is not FP8.
    """
    kind = SCALE_KINDS[(seed + (variant == "scale_kind")) % len(SCALE_KINDS)]
    bad = {"scale_zero": 0.0, "scale_nan": float("nan")}.get(variant)
    k_fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)[seed % 2]
    v_dtype = dtype if seed == 3 else (torch.float8_e5m2, torch.float8_e4m3fn)[seed % 2]
    key_in = k.double() if variant == "dtype" else k
    value = randn(*k.shape)
    if paged:
        tokens = B * S
        key_in, value = key_in.transpose(1, 2).reshape(tokens, H, D), value.transpose(1, 2).reshape(tokens, H, D)
        shape = (4, BLOCK, H, D)
        slots = ropekit.slot_mapping(torch.tensor([[0, 1], [3, 2]]), torch.arange(S).repeat(B, 1) + 2, BLOCK)
        cos, sin = _tables(torch.arange(S).repeat(B) + 2)
        cos, sin = cos[:, None], sin[:, None]
        opts = dict(backend=backend, block_size=BLOCK)
    else:
        shape, slots, opts = (B, H, MAX_LEN, D), 1 + seed % 2, dict(backend=backend)
    k_cache = (randn(*shape, dt=torch.float32) * 4).to(k_fp8)
    v_cache = (randn(*shape, dt=torch.float32) * 4).to(v_dtype)
    k_scale = _scale(kind, bad, seed)
    v_scale = _scale(SCALE_KINDS[(seed + 1) % len(SCALE_KINDS)], None, seed) if v_dtype != dtype else None
    if variant == "overlap":
        k_scale = k_cache.view(torch.uint8).view(-1)[:4 * H].view(torch.float32)
        k_scale.view(torch.int32).fill_(0x3F000000)  # 0.5 each: a valid value, the cache's own bytes
    elif variant == "same_tensor" and v_dtype == dtype:
        v_scale = 1.0
    return (lambda: ropekit.rotate_into_cache(key_in, value, cos, sin, k_cache, v_cache, slots, k_scale=k_scale,
                                              v_scale=v_scale, **opts)), [
        key_in, value, k_cache.view(torch.uint8), v_cache.view(torch.uint8) if v_dtype != dtype else v_cache]


def outcome(step) -> tuple:
    """What one call does: ``("raise", type, message)`` or ``("ok", outputs and inputs after the call)``."""
    call, inputs = build(*step)
    try:
        result = call()
    except (ValueError, TypeError, RuntimeError) as error:
        return "raise", type(error).__name__, str(error), [t.clone() for t in inputs]
    outputs = [t for t in (result if isinstance(result, tuple) else (result,)) if t is not None]
    return "ok", [t.detach().clone() for t in (*outputs, *inputs)]


def assert_same(cold: tuple, warm: tuple, step) -> None:
    assert cold[0] == warm[0], f"{step}: cold {cold[:3]} but warm {warm[:3]}"
    if cold[0] == "raise":
        assert cold[1:3] == warm[1:3], f"{step}: cold raised {cold[1:3]}, warm {warm[1:3]}"
    tensors_cold, tensors_warm = cold[-1], warm[-1]
    assert len(tensors_cold) == len(tensors_warm)
    for a, b in zip(tensors_cold, tensors_warm, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{step}: different values"


steps = st.tuples(st.sampled_from(ENTRIES), st.sampled_from(VARIANTS), st.sampled_from([torch.float32, torch.bfloat16]),
                  st.booleans(), st.sampled_from(BACKEND_NAMES), st.integers(0, 3))


@given(st.lists(steps, min_size=2, max_size=8))
def test_warm_calls_equal_cold_calls(sequence):
    cold = []
    for step in sequence:
        prepared.clear()
        cold.append(outcome(step))
    prepared.clear()
    for step, expected in zip(sequence, cold, strict=True):
        outcome((step[0], "valid", *step[2:]))  # a valid call of the same entry, shapes and options first
        for _ in range(2):  # the second call finds what the first prepared
            assert_same(expected, outcome(step), step)


# -- the cases behind the property, one by one ------------------------------------------------------
def _qk(dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    cos, sin = _tables(torch.arange(S))
    return torch.randn(B, H, S, D, generator=gen).to(dtype), torch.randn(B, H, S, D, generator=gen).to(dtype), cos, sin


@pytest.mark.parametrize("form", ["apply_rotary_qk", "rms_norm_rotary_qk"])
def test_same_tensor_in_place_is_refused_warm_as_cold(form):
    """``f(x, x, inplace=True)`` after a valid call of the same shapes: refused, x untouched (not rotated twice)."""
    def call(q, k, cos, sin):
        if form == "apply_rotary_qk":
            return ropekit.apply_rotary_qk(q, k, cos, sin, inplace=True)
        return ropekit.rms_norm_rotary_qk(q, k, None, None, cos, sin, eps=1e-6, inplace=True)

    q, k, cos, sin = _qk()
    call(q, k, cos, sin)  # prepares the signature
    x = q.clone()
    before = x.clone()
    with pytest.raises(ValueError, match="distinct q and k"):
        call(x, x, cos, sin)
    assert torch.equal(x, before)


@pytest.mark.parametrize("form", ["apply_rotary_qk", "rms_norm_rotary_qk"])
def test_partly_overlapping_q_and_k_in_place_are_refused(form):
    """q = buf[0:2], k = buf[1:3] in place: a ValueError naming q and k, cold and warm, buf untouched."""
    q, k, cos, sin = _qk()
    call = (lambda q, k: ropekit.apply_rotary_qk(q, k, cos, sin, inplace=True)) if form == "apply_rotary_qk" else (
        lambda q, k: ropekit.rms_norm_rotary_qk(q, k, None, None, cos, sin, eps=1e-6, inplace=True))
    buf = torch.randn(B + 1, H, S, D)
    before = buf.clone()
    for _ in range(2):
        with pytest.raises(ValueError, match="^q and k share memory"):
            call(buf[0:B], buf[1:B + 1])
    assert torch.equal(buf, before)
    call(q, k)  # warm: the same signature, distinct memory
    with pytest.raises(ValueError, match="^q and k share memory"):
        call(buf[0:B], buf[1:B + 1])


def test_q_and_k_interleaved_in_one_buffer_are_not_overlapping():
    """Views of one fused qkv projection (q = qkv[..., :D], k = qkv[..., D:2D]) do not share an element: accepted."""
    qkv = torch.randn(B, H, S, 3 * D, dtype=torch.float64)
    q, k = qkv[..., :D], qkv[..., D:2 * D]
    want = [ropekit.apply_reference(t.clone(), torch.arange(S), ropekit.inv_frequencies(D)[0]) for t in (q, k)]
    cos, sin = _tables(torch.arange(S))
    ropekit.apply_rotary_qk(q, k, cos, sin, inplace=True)
    for got, expected in zip((q, k), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("form", ["apply_rotary", "apply_rotary_qk", "rms_norm_rotary_qk"])
def test_inplace_must_be_a_bool_warm_as_cold(form):
    q, k, cos, sin = _qk()
    calls = {"apply_rotary": lambda flag: ropekit.apply_rotary(q, cos, sin, inplace=flag),
             "apply_rotary_qk": lambda flag: ropekit.apply_rotary_qk(q, k, cos, sin, inplace=flag),
             "rms_norm_rotary_qk": lambda flag: ropekit.rms_norm_rotary_qk(q, k, None, None, cos, sin, eps=1e-6,
                                                                           inplace=flag)}
    calls[form](True)
    with pytest.raises(TypeError, match="inplace must be a bool, got int"):
        calls[form](1)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_cache_refuses_dtype_mismatch_warm_as_cold(layout):
    """float32 keys into bfloat16 caches (backend="torch") after a valid call of the same shapes: refused."""
    q, k, cos, sin = _qk()
    if layout == "contiguous":
        shape, k_new, slots, extra = (B, H, MAX_LEN, D), k, 1, {}
    else:
        shape, k_new, extra = (4, BLOCK, H, D), k[0].transpose(0, 1).contiguous(), {"block_size": BLOCK}
        slots, cos, sin = torch.arange(S), cos[:, None], sin[:, None]
    for cache_dtype in (torch.float32, torch.bfloat16):
        k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
        args = (k_new, k_new.clone(), cos, sin, k_cache, v_cache, slots)
        if cache_dtype == torch.float32:
            ropekit.rotate_into_cache(*args, backend="torch", **extra)
            continue
        with pytest.raises(ValueError, match="the caches must have the dtypes of k and v"):
            ropekit.rotate_into_cache(*args, backend="torch", **extra)
        assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_cache_aliasing_is_refused(backend):
    """``k_cache is v_cache``, and a key that is a view of its own cache: ValueErrors naming both, nothing written."""
    if backend not in ops.available():
        pytest.skip(f"backend {backend} unavailable")
    _, k, cos, sin = _qk()
    k_cache, v_cache = torch.zeros(B, H, MAX_LEN, D), torch.zeros(B, H, MAX_LEN, D)
    ropekit.rotate_into_cache(k, k.clone(), cos, sin, k_cache, v_cache, 1, backend=backend)  # warm from here on
    before = k_cache.clone()
    with pytest.raises(ValueError, match="^k_cache and v_cache are the same tensor"):
        ropekit.rotate_into_cache(k, k.clone(), cos, sin, k_cache, k_cache, 1, backend=backend)
    view = k_cache[:, :, 4:4 + S]
    with pytest.raises(ValueError, match="^k_cache and k share memory"):
        ropekit.rotate_into_cache(view, k.clone(), cos, sin, k_cache, v_cache, 1, backend=backend)
    assert torch.equal(k_cache, before)
    kv = torch.zeros(B, 2, H, MAX_LEN, D)  # one buffer, k and v halves interleaved per batch row: no shared element
    ropekit.rotate_into_cache(k, k, cos, sin, kv[:, 0], kv[:, 1], 1, backend=backend)
    torch.testing.assert_close(kv[:, 1, :, 1:1 + S], k, rtol=0, atol=0)


def test_explicit_backend_never_runs_another_kernel():
    """``backend="triton"`` on CPU tensors (no interpreter) and ``backend="cpu"`` on unsupported tensors raise."""
    q, k, cos, sin = _qk()
    triton = ops.dispatch._builtin("triton")
    if triton is not None and triton.is_available() and triton.cannot_run(q) is None:
        pytest.skip("Triton runs CPU tensors here (interpreter)")
    if triton is not None and triton.is_available():
        for call in (lambda: ropekit.apply_rotary(q, cos, sin, backend="triton"),
                     lambda: ropekit.apply_rotary_qk(q, k, cos, sin, backend="triton"),
                     lambda: ropekit.rotate(q, *_tables(torch.arange(MAX_LEN)), seq_dim=2, backend="triton"),
                     lambda: ropekit.rms_norm_rotary_qk(q, k, None, None, cos, sin, eps=1e-6, backend="triton")):
            with pytest.raises(ValueError, match=r"^backend='triton' cannot run (x|q) \(torch.float32 on cpu\)"):
                call()
    assert ropekit.apply_rotary(q, cos, sin, backend="auto").shape == q.shape  # "auto" chooses


def test_overlap_is_exact_for_views_of_one_buffer():
    """:func:`ropekit.ops.memory.overlapping` against brute force over every element address."""
    from ropekit.ops.memory import overlapping

    base = torch.zeros(120)
    gen = torch.Generator().manual_seed(5)
    for _ in range(300):
        views = []
        for _ in range(2):
            ndim = int(torch.randint(1, 4, (), generator=gen))
            sizes = torch.randint(1, 5, (ndim,), generator=gen).tolist()
            strides = torch.randint(0, 9, (ndim,), generator=gen).tolist()
            reach = sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
            offset = int(torch.randint(0, 120 - reach, (), generator=gen))
            views.append(base.as_strided(sizes, strides, offset))
        a, b = views
        addresses = [{t.storage_offset() + sum(i * s for i, s in zip(idx, t.stride(), strict=True))
                      for idx in torch.cartesian_prod(*[torch.arange(n) for n in t.shape]).reshape(
                          -1, t.dim()).tolist()} for t in (a, b)]
        assert overlapping(a, b) == bool(addresses[0] & addresses[1]), (a.shape, a.stride(), b.shape, b.stride())


def test_an_argument_given_twice_is_never_prepared():
    """``apply_rotary_qk(x, x, ...)`` and ``rotate_into_cache(k, k, ...)`` run the checks on every call: no key kept."""
    q, _, cos, sin = _qk()
    prepared.clear()
    for _ in range(2):
        ropekit.apply_rotary_qk(q, q, cos, sin)
        ropekit.rotate_into_cache(q, q, cos, sin, torch.zeros(B, H, MAX_LEN, D), torch.zeros(B, H, MAX_LEN, D), 1)
    assert not prepared.calls


def test_interleaved_views_in_place_are_prepared_and_exact():
    """q, k interleaved in one buffer (byte ranges intersect, no shared element): prepared, equal to cold calls."""
    qkv = torch.randn(B, H, S, 3 * D, dtype=torch.float64)
    cos, sin = _tables(torch.arange(S))
    want = qkv.clone()
    for _ in range(3):
        prepared.clear()
        ropekit.apply_rotary_qk(want[..., :D], want[..., D:2 * D], cos, sin, inplace=True)
    prepared.clear()
    for _ in range(3):
        ropekit.apply_rotary_qk(qkv[..., :D], qkv[..., D:2 * D], cos, sin, inplace=True)
    assert len(prepared.calls) == 1
    assert torch.equal(qkv, want)


def test_a_size_one_axis_stride_is_no_part_of_a_contiguous_signature():
    """Contiguous q/k whose size-1 axis has another stride share the signature; warm results are cold ones' bits."""
    gen = torch.Generator().manual_seed(9)
    cos, sin = _tables(torch.arange(1))
    plain = [torch.randn(B, H, 1, D, generator=gen) for _ in range(2)]
    odd = [torch.randn(B * H * D + 64, generator=gen).as_strided((B, H, 1, D), (H * D, D, 777, 1)) for _ in range(2)]
    assert all(t.is_contiguous() for t in odd) and odd[0].stride() != plain[0].stride()
    for inplace in (False, True):
        want = []
        for q, k in (plain, odd):
            prepared.clear()
            want.append([t.clone() for t in ropekit.apply_rotary_qk(q.clone(), k.clone(), cos, sin, inplace=inplace)])
        prepared.clear()
        for (q, k), expected in zip((plain, odd), want, strict=True):  # the second call finds the first one's
            got = ropekit.apply_rotary_qk(q.clone(), k.clone(), cos, sin, inplace=inplace)
            assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(got, expected, strict=True))
        assert len(prepared.calls) == 1


def _fp8_call(backend):
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen)
    cos, sin = _tables(torch.tensor([3]))
    k_cache = torch.zeros(B, H, MAX_LEN, D, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros(B, H, MAX_LEN, D, dtype=torch.float8_e5m2)
    return lambda k_scale, v_scale: ropekit.rotate_into_cache(k, v, cos, sin, k_cache, v_cache, 3, k_scale=k_scale,
                                                              v_scale=v_scale, backend=backend), k_cache, v_cache


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fp8_calls_are_prepared_and_a_bad_scale_is_refused_warm_as_cold(backend):
    """FP8 calls take the prepared path; a scale that turns 0, NaN or inf there is refused as in a first call."""
    call, k_cache, v_cache = _fp8_call(backend)
    good = torch.tensor([0.5, 0.25])
    messages = {}
    for bad in (0.0, float("nan"), float("inf"), -1.0):
        scale = good.clone()
        scale[1] = bad
        prepared.clear()
        with pytest.raises(ValueError) as cold:
            call(scale, 1.0)
        messages[bad] = str(cold.value)
    prepared.clear()
    call(good, 1.0)
    assert len(prepared.calls) == 1  # the FP8 signature is kept
    before = (k_cache.view(torch.uint8).clone(), v_cache.view(torch.uint8).clone())
    for bad, message in messages.items():
        scale = good.clone()
        scale[1] = bad
        with pytest.raises(ValueError) as warm:
            call(scale, 1.0)
        assert str(warm.value) == message
        assert torch.equal(k_cache.view(torch.uint8), before[0]) and torch.equal(v_cache.view(torch.uint8), before[1])
    with pytest.raises(ValueError, match="v_scale must be finite and > 0"):
        call(good, float("nan"))  # a float is part of the signature: NaN finds none, the checks refuse it


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fp8_scale_kinds_each_have_their_signature(backend):
    """Per tensor, per head, a float, None: a change of kind between warm calls writes what a first call writes."""
    kinds = [torch.tensor(0.5), torch.tensor([0.5, 0.25]), 0.125, None, torch.tensor([0.5]), torch.tensor(
        [0.5, 0.25], dtype=torch.bfloat16)]
    written = []
    for warm in (False, True):
        prepared.clear()
        out = []
        for scale in kinds * 2:
            if not warm:
                prepared.clear()
            call, k_cache, v_cache = _fp8_call(backend)
            call(scale, scale)
            out.append((k_cache.view(torch.uint8).clone(), v_cache.view(torch.uint8).clone()))
        written.append(out)
        if warm:
            assert len(prepared.calls) == len(kinds)
    for (kc, vc), (kw, vw) in zip(*written, strict=True):
        assert torch.equal(kc, kw) and torch.equal(vc, vw)
