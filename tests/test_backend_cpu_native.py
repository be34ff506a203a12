"""The native CPU backend (``csrc/rotary.c`` through ctypes) against the float64 reference and eager.

The kernel computes exactly the eager backend's expression (float32, or float64 for float64
inputs; no FMA; one rounding to the output dtype), so it is checked bit for bit against
``torch_eager.rotate`` and, independently, within one ulp of the output dtype (relative to the
largest output) against the float64 rotation matrices of ``ropekit.apply_reference``.
"""

import array
import contextlib
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from ropekit.backends import cpu_library, cpu_native, torch_eager

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(
    not cpu_native.is_available(), reason="native CPU backend unavailable (no C compiler or unsupported machine)"
)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["half", "interleaved"]


@contextlib.contextmanager
def module_setting(name, value):
    """Temporarily change a module constant of cpu_native (hypothesis and fixtures do not mix)."""
    old = getattr(cpu_native, name)
    setattr(cpu_native, name, value)
    try:
        yield
    finally:
        setattr(cpu_native, name, old)


@contextlib.contextmanager
def library(loaded):
    """Temporarily run another build of the kernel (the result of ``cpu_library.open_library``)."""
    keys = ("functions", "teams", "openmp")
    saved = {key: cpu_native._state[key] for key in keys}
    cpu_native._state.update(zip(keys, loaded, strict=True))
    cpu_native._pair_prepared.clear()
    try:
        yield
    finally:
        cpu_native._state.update(saved)
        cpu_native._pair_prepared.clear()


@contextlib.contextmanager
def torch_threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def assert_same(actual, expected):
    """Bit-equal up to NaN payloads."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def native(x, cos, sin, **kwargs):
    """cpu_native.rotate, asserting that the inputs take the native path (not the eager fallback)."""
    assert cpu_native.supports(x, kwargs.get("inplace", False)) and cpu_native._table_strides(x, cos, sin)
    return cpu_native.rotate(x, cos, sin, **kwargs)


def bits(t):
    """The raw bits of t, for bit-for-bit comparisons that also cover NaN payloads."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def tables(positions, inv_freq, dtype):
    """cos/sin as the kernels get them: float32 from ropekit.cos_sin, exact float64 for float64 x."""
    if dtype == torch.float64:
        angles = positions.to(torch.float64)[..., None] * inv_freq
        return torch.cos(angles), torch.sin(angles)
    return ropekit.cos_sin(positions, inv_freq)


def assert_near_reference(y, x, positions, inv_freq, layout, conjugate):
    """|y - reference| <= 1 ulp of y's dtype at the reference's largest magnitude."""
    pos = positions.expand(x.shape[:-1])
    ref = ropekit.apply_reference(x, -pos if conjugate else pos, inv_freq, layout=layout)
    err = (y.to(torch.float64) - ref).abs().max().item() if y.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    assert err <= torch.finfo(y.dtype).eps * scale, (err, scale)


@st.composite
def cases(draw):
    lead = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    half = draw(st.sampled_from([1, 2, 4, 8, 12, 16, 20, 32]))  # rotary_dim 24, 40 among them
    head_dim = 2 * half + draw(st.sampled_from([0, 0, 2, 6]))
    # which leading axes the table varies along (the others broadcast): seq only, batch and
    # seq, per token, one position (decode), ...
    varies = [draw(st.booleans()) for _ in lead]
    view = (draw(st.sampled_from(["contiguous", "transposed", "sliced", "fused"])), draw(st.integers(0, 3)))
    return {
        "lead": lead,
        "half": half,
        "head_dim": head_dim,
        "varies": varies,
        "view": view,
        "dtype": draw(st.sampled_from(DTYPES)),
        "layout": draw(st.sampled_from(LAYOUTS)),
        "conjugate": draw(st.booleans()),
        "inplace": draw(st.booleans()),
        "plan": draw(st.booleans()),  # the reordered row walk used for large tensors
        "seed": draw(st.integers(0, 2**16)),
    }


def make_x(lead, head_dim, view, dtype, gen):
    """x of shape lead + (head_dim,), as a contiguous tensor or a strided view."""
    shape = tuple(lead) + (head_dim,)
    kind, axis = view

    def rand(*size):
        return (torch.randn(size, generator=gen) * 4).to(dtype)

    if kind == "transposed" and len(lead) >= 2:  # (b, s, h, d) storage seen as (b, h, s, d)
        x = rand(*shape[:-3], shape[-2], shape[-3], head_dim).transpose(-2, -3)
    elif kind == "sliced":  # every other head (or batch, ...) of a larger tensor, from an offset
        axis %= len(lead)
        base = rand(*shape[:axis], 2 * shape[axis] + 1, *shape[axis + 1 :])
        x = base.narrow(axis, 1, 2 * shape[axis]).unflatten(axis, (shape[axis], 2)).select(axis + 1, 0)
    elif kind == "fused":  # q out of a fused qkv projection: rows further apart than head_dim
        x = rand(*shape[:-1], 3 * head_dim)[..., head_dim : 2 * head_dim]
    else:
        x = rand(*shape)
    assert x.shape == shape
    return x


@settings(max_examples=120)
@given(cases())
def test_matches_eager_and_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, layout = case["dtype"], case["layout"]
    x = make_x(case["lead"], case["head_dim"], case["view"], dtype, gen)
    table_lead = [n if v else 1 for n, v in zip(case["lead"], case["varies"], strict=True)]
    positions = torch.randint(0, 5000, table_lead, generator=gen)
    inv_freq, _ = ropekit.inv_frequencies(2 * case["half"])
    cos, sin = tables(positions, inv_freq, dtype)
    kwargs = {"layout": layout, "conjugate": case["conjugate"]}

    expected = torch_eager.rotate(x, cos, sin, **kwargs)
    before = x.clone()
    with module_setting("PLAN_MIN_BYTES", 0 if case["plan"] else cpu_native.PLAN_MIN_BYTES):
        y = native(x, cos, sin, inplace=case["inplace"], **kwargs)
    if case["inplace"]:
        assert y is x
    else:
        assert y.data_ptr() != x.data_ptr() and y.stride() == torch.empty_like(x).stride()
        assert_same(x, before)
    assert_same(y, expected)
    assert_near_reference(y, before, positions, inv_freq, layout, case["conjugate"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_conjugate_inverts(dtype, layout):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 7, 64, generator=gen).to(dtype)
    cos, sin = tables(torch.arange(7), ropekit.inv_frequencies(40)[0], dtype)
    cos, sin = cos[None, None], sin[None, None]
    y = native(x, cos, sin, layout=layout)
    back = native(y, cos, sin, layout=layout, conjugate=True)
    # two roundings to dtype (and float32 tables that are not exactly unit-norm)
    tol = 4 * torch.finfo(dtype).eps * x.abs().max().item() + 1e-6 * (dtype != torch.float64)
    assert (back.double() - x.double()).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inplace", [False, True])
def test_threaded_split_equals_single_call(dtype, layout, inplace):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 37, 40, generator=gen).to(dtype)  # rows split unevenly
    cos, sin = tables(torch.arange(37), ropekit.inv_frequencies(24)[0], dtype)
    cos, sin = cos[None, :, None], sin[None, :, None]
    x = x.transpose(1, 2)  # (3, 37, 5, 40) view, table broadcast over the heads
    single = native(x.clone(), cos, sin, layout=layout, inplace=inplace)
    with torch_threads(3), module_setting("PLAN_MIN_BYTES", 0), module_setting("PARALLEL_MIN_BYTES", 0):
        threaded = native(x.clone(), cos, sin, layout=layout, inplace=inplace)
    assert torch.equal(bits(threaded), bits(single))
    assert cpu_native._pool is not None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_large_tensors_take_the_planned_threaded_path(layout):
    """Prefill-like sizes, where the reordered walk (_plan) and the thread split kick in."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 8, 512, 64, generator=gen)
    inv_freq = ropekit.inv_frequencies(48)[0]  # partial rotary: 16 channels copied through
    for dtype in DTYPES:
        x = base.to(dtype)
        cos, sin = tables(torch.arange(512), inv_freq, dtype)
        cos, sin = cos[None, None], sin[None, None]
        assert x.numel() * x.element_size() >= max(cpu_native.PLAN_MIN_BYTES, cpu_native.PARALLEL_MIN_BYTES)
        expected = torch_eager.rotate(x, cos, sin, layout=layout)
        with torch_threads(2):
            assert_same(native(x, cos, sin, layout=layout), expected)
            assert_same(native(x.clone(), cos, sin, layout=layout, inplace=True), expected)
            seq_major = x.transpose(1, 2).contiguous().transpose(1, 2)  # (b, s, h, d) storage
            assert_same(native(seq_major, cos, sin, layout=layout), expected)


def all_16_bit_patterns(dtype):
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_16_bit_value_converts_like_torch(dtype, layout):
    """All 65536 inputs (subnormals, inf, NaN) in, and products rounding to every kind of output."""
    values = all_16_bit_patterns(dtype)
    other = values.flip(0)
    x = torch.stack([values, other], dim=-1).reshape(-1, 32, 2)  # pairs (value, other)
    if layout == "half":
        x = x.transpose(-1, -2).reshape(-1, 64).contiguous()
    x = x.reshape(-1, 64)
    gen = torch.Generator().manual_seed(4)
    for cos, sin in [
        (torch.ones(1, 32), torch.zeros(1, 32)),  # identity: load/store round trip
        (torch.rand(x.shape[0], 32, generator=gen) * 3, torch.randn(x.shape[0], 32, generator=gen)),
        (torch.full((1, 32), 1.0 + 2.0**-9), torch.full((1, 32), 2.0**-12)),  # ties and near-ties
    ]:
        expected = torch_eager.rotate(x, cos, sin, layout=layout)
        assert_same(native(x, cos, sin, layout=layout), expected)


@pytest.fixture(scope="module")
def portable_functions(tmp_path_factory):
    """The library built without the AVX2/F16C paths (what non-x86 machines run)."""
    old = os.environ.get("ROPEKIT_CACHE_DIR")
    os.environ["ROPEKIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("ropekit-cache"))
    try:
        return cpu_library.open_library(("-DROPEKIT_PORTABLE",))
    finally:
        if old is None:
            del os.environ["ROPEKIT_CACHE_DIR"]
        else:
            os.environ["ROPEKIT_CACHE_DIR"] = old


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_portable_build_matches_eager(portable_functions, dtype, layout):
    gen = torch.Generator().manual_seed(5)
    with library(portable_functions):
        for half in (1, 7, 12, 16, 20, 33, 64):
            x = (torch.randn(3, 5, 2 * half + 2, generator=gen) * 100).to(dtype)
            cos, sin = tables(torch.arange(5), ropekit.inv_frequencies(2 * half)[0], dtype)
            cos, sin = cos[None], sin[None]
            for conjugate in (False, True):
                expected = torch_eager.rotate(x, cos, sin, layout=layout, conjugate=conjugate)
                assert_same(native(x, cos, sin, layout=layout, conjugate=conjugate), expected)
                assert_same(native(x.clone(), cos, sin, layout=layout, conjugate=conjugate, inplace=True), expected)
        values = all_16_bit_patterns(dtype).reshape(-1, 64) if dtype.itemsize == 2 else None
        if values is not None:
            rows = values.shape[0]
            cos, sin = torch.rand(rows, 32, generator=gen) * 3, torch.randn(rows, 32, generator=gen)
            assert_same(native(values, cos, sin, layout=layout),
                        torch_eager.rotate(values, cos, sin, layout=layout))


def test_unsupported_inputs_fall_back_to_eager():
    gen = torch.Generator().manual_seed(6)
    cos, sin = ropekit.cos_sin(torch.arange(4), ropekit.inv_frequencies(8)[0])
    cos, sin = cos[None], sin[None]
    strided = torch.randn(2, 4, 32, generator=gen)[..., ::2]  # last-dim stride 2
    assert not cpu_native.supports(strided)
    expected = torch_eager.rotate(strided, cos, sin, layout="half")
    assert_same(cpu_native.rotate(strided, cos, sin, layout="half"), expected)
    expanded = torch.randn(1, 4, 16, generator=gen).expand(3, 4, 16)  # rows alias each other
    assert cpu_native.supports(expanded) and not cpu_native.supports(expanded, inplace=True)
    assert_same(native(expanded, cos, sin, layout="half"), torch_eager.rotate(expanded, cos, sin, layout="half"))
    assert_same(cpu_native.rotate(expanded.clone(), cos[0], sin[0], layout="half"),  # tables with fewer dims
                torch_eager.rotate(expanded, cos[0], sin[0], layout="half"))
    ints = torch.ones(4, 16, dtype=torch.int32)
    assert not cpu_native.supports(ints)


def test_tables_are_converted_and_empty_inputs_work():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 16, generator=gen)
    cos, sin = ropekit.cos_sin(torch.arange(4), ropekit.inv_frequencies(16)[0])
    cos, sin = cos[None], sin[None]
    transposed_storage = cos[0].t().contiguous().t()[None]  # last-dim stride 4
    for c, s in [(cos.double(), sin.double()), (cos.bfloat16(), sin.bfloat16()), (transposed_storage, sin)]:
        assert_same(native(x, c, s, layout="interleaved"), torch_eager.rotate(x, c, s, layout="interleaved"))
    empty = torch.empty(0, 4, 16)
    assert native(empty, cos, sin, layout="half").shape == empty.shape
    one = torch.randn(16, generator=gen)  # no leading dims at all
    assert_same(native(one, cos[0, 0], sin[0, 0], layout="half"),
                torch_eager.rotate(one, cos[0, 0], sin[0, 0], layout="half"))


def test_repeated_calls_reuse_parameters_not_data():
    gen = torch.Generator().manual_seed(8)
    inv_freq = ropekit.inv_frequencies(32)[0]
    cpu_native._prepared.clear()
    for _ in range(3):  # a decode loop: same shapes, new tokens and positions
        x = torch.randn(4, 6, 1, 40, generator=gen)
        cos, sin = ropekit.cos_sin(torch.randint(0, 100, (4,), generator=gen), inv_freq)
        cos, sin = cos[:, None, None], sin[:, None, None]
        assert_same(native(x, cos, sin, layout="half"), torch_eager.rotate(x, cos, sin, layout="half"))
        assert len(cpu_native._prepared) == 1
        converted = (cos.double(), sin.double())  # converted tables are not kept
        assert_same(native(x, *converted, layout="half"), torch_eager.rotate(x, *converted, layout="half"))
        assert len(cpu_native._prepared) == 1


def test_kernel_rejects_bad_params():
    fn = cpu_native._load()[torch.float32]
    x = torch.zeros(4, 8)
    c = torch.zeros(4, 4)
    ok = [1, 4, 8, 0, 1, 1, 1, 1, 4, 8, 8, 4, 4]

    def call(params, begin=0, end=4):
        buf = array.array("q", params)
        return fn(x.data_ptr(), x.data_ptr(), c.data_ptr(), c.data_ptr(), buf.buffer_info()[0], begin, end)

    assert call(ok) == 0
    assert call([9] + ok[1:]) == -1  # too many leading dims
    assert call(ok[:4] + [2] + ok[5:]) == -1  # last-dim stride of x not 1
    assert call([1, 5, 8] + ok[3:]) == -1  # rotary_dim > head_dim
    assert call(ok, 0, 5) == -1  # rows out of range
    assert call(ok, 3, 2) == -1


def offsets(sizes, strides):
    """Every row's (x, out, cos, sin) offsets, in visiting order."""
    rows = [(0, 0, 0, 0)]
    for d, n in enumerate(sizes):
        rows = [tuple(o + i * st[d] for o, st in zip(row, strides, strict=True)) for row in rows for i in range(n)]
    return rows


@given(st.lists(st.integers(1, 6), min_size=1, max_size=5), st.data())
def test_plan_visits_every_row_once(sizes, data):
    contiguous = []
    step = 64
    for n in reversed(sizes):
        contiguous.insert(0, step)
        step *= n
    order = data.draw(st.permutations(range(len(sizes))))
    x_strides = [contiguous[i] for i in order]  # a permuted (transposed) view
    table = [data.draw(st.sampled_from([0, 32 * (d + 1)])) for d in range(len(sizes))]
    strides = [x_strides, contiguous, table, table]
    new_sizes, new_strides = cpu_native._plan(list(sizes), [list(s) for s in strides], 4)
    assert len(new_sizes) <= cpu_native.MAX_LEADING_DIMS
    assert sorted(offsets(new_sizes, new_strides)) == sorted(offsets(sizes, strides))


def test_unavailable_backend_warns_once_and_raises(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_native, "_state", {})
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ROPEKIT_CC", "false")  # a "compiler" that always fails
    with pytest.warns(RuntimeWarning, match="unavailable"):
        assert not cpu_native.is_available()
    assert not cpu_native.is_available()  # no second warning (pytest's filter would raise here)
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_native.rotate(torch.zeros(2, 4), torch.ones(1, 2), torch.zeros(1, 2), layout="half")
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(cpu_native, "_state", {})
    monkeypatch.setenv("ROPEKIT_DISABLE_NATIVE", "1")
    with pytest.warns(RuntimeWarning, match="ROPEKIT_DISABLE_NATIVE"):
        assert not cpu_native.is_available()


def test_library_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(tmp_path))
    compiler = cpu_library._compiler()
    first = cpu_library._build(compiler, ("-DROPEKIT_PORTABLE",))
    stamp = first.stat().st_mtime_ns
    assert cpu_library._build(compiler, ("-DROPEKIT_PORTABLE",)) == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


# -- rows sharing a table row (heads at decode) and q/k in one call ---------------------------------------
def decode_case(dtype, layout, half, tail, heads, gen, batch=3):
    """x of (batch, heads, 1, 2*half + tail) with tables (batch, 1, 1, half): every table row is
    shared by ``heads`` rows, which the kernel takes four at a time."""
    x = (torch.randn(batch, heads, 1, 2 * half + tail, generator=gen) * 4).to(dtype)
    positions = torch.randint(0, 5000, (batch, 1, 1), generator=gen)
    inv_freq = ropekit.inv_frequencies(2 * half)[0]
    cos, sin = tables(positions, inv_freq, dtype)
    return x, cos, sin, positions, inv_freq


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_sharing_a_table_row_match_eager_and_reference(dtype, layout):
    gen = torch.Generator().manual_seed(11)
    for half, tail, heads in [(4, 0, 4), (8, 0, 9), (16, 6, 7), (20, 2, 5), (64, 0, 32), (33, 0, 6)]:
        x, cos, sin, positions, inv_freq = decode_case(dtype, layout, half, tail, heads, gen)
        for conjugate in (False, True):
            expected = torch_eager.rotate(x, cos, sin, layout=layout, conjugate=conjugate)
            out = native(x, cos, sin, layout=layout, conjugate=conjugate)
            assert_same(out, expected)
            assert_same(native(x.clone(), cos, sin, layout=layout, conjugate=conjugate, inplace=True), expected)
            assert_near_reference(out, x, positions, inv_freq, layout, conjugate)
        # (b, s, h, d) storage seen as (b, h, s, d), and every other head of a larger tensor
        wide = (torch.randn(3, 2 * heads, 1, 2 * half + tail, generator=gen) * 4).to(dtype)
        for view in (x.transpose(1, 2).contiguous().transpose(1, 2), wide[:, ::2]):
            assert_same(native(view, cos, sin, layout=layout), torch_eager.rotate(view, cos, sin, layout=layout))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_portable_build_rows_sharing_a_table_row(portable_functions, dtype, layout):
    gen = torch.Generator().manual_seed(12)
    with library(portable_functions):
        for half, tail, heads in [(8, 0, 9), (16, 6, 7), (64, 0, 32)]:
            x, cos, sin, _, _ = decode_case(dtype, layout, half, tail, heads, gen)
            for conjugate in (False, True):
                expected = torch_eager.rotate(x, cos, sin, layout=layout, conjugate=conjugate)
                assert_same(native(x, cos, sin, layout=layout, conjugate=conjugate), expected)
                assert_same(native(x.clone(), cos, sin, layout=layout, conjugate=conjugate, inplace=True), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inplace", [False, True])
def test_rotate_pair_equals_two_rotates(dtype, layout, inplace):
    gen = torch.Generator().manual_seed(13)
    for half, tail, q_heads, k_heads in [(64, 0, 32, 32), (64, 0, 32, 8), (16, 6, 7, 1), (8, 0, 4, 4)]:
        q, cos, sin, _, _ = decode_case(dtype, layout, half, tail, q_heads, gen)
        k = (torch.randn(3, k_heads, 1, 2 * half + tail, generator=gen) * 4).to(dtype)
        for conjugate in (False, True):
            expected = [torch_eager.rotate(t, cos, sin, layout=layout, conjugate=conjugate) for t in (q, k)]
            q_in, k_in = q.clone(), k.clone()
            cpu_native._pair_prepared.clear()
            q_out, k_out = cpu_native.rotate_pair(q_in, k_in, cos, sin, cos, sin, layout=layout,
                                                  conjugate=conjugate, inplace=inplace)
            assert cpu_native._pair_prepared and all(plan is not None for plan in cpu_native._pair_prepared.values())
            assert (q_out is q_in and k_out is k_in) == inplace
            assert_same(q_out, expected[0])
            assert_same(k_out, expected[1])


def test_rotate_pair_falls_back_to_two_calls():
    gen = torch.Generator().manual_seed(14)
    cos, sin = ropekit.cos_sin(torch.arange(300), ropekit.inv_frequencies(64)[0])
    cases = {
        "dtypes differ": (torch.randn(2, 4, 300, 64, generator=gen),
                          torch.randn(2, 4, 300, 64, generator=gen).to(torch.bfloat16)),
        "empty k": (torch.randn(2, 4, 300, 64, generator=gen), torch.randn(2, 0, 300, 64, generator=gen)),
        "strided channels": (torch.randn(1, 2, 300, 128, generator=gen)[..., ::2],
                             torch.randn(1, 2, 300, 64, generator=gen)),
    }
    for name, (q, k) in cases.items():
        cpu_native._pair_prepared.clear()
        q_out, k_out = cpu_native.rotate_pair(q, k, cos, sin, cos, sin, layout="half")
        assert list(cpu_native._pair_prepared.values()) == [None], name
        assert_same(q_out, torch_eager.rotate(q, cos, sin, layout="half"))
        assert_same(k_out, torch_eager.rotate(k, cos, sin, layout="half"))
    large = torch.randn(1, 8, 300, 64, generator=gen), torch.randn(1, 8, 300, 64, generator=gen)
    with module_setting("_state", {**cpu_native._state, "openmp": False}):  # no OpenMP team: the Python pool
        cpu_native._pair_prepared.clear()
        q_out, k_out = cpu_native.rotate_pair(*large, cos, sin, cos, sin, layout="half")
        assert list(cpu_native._pair_prepared.values()) == [None]
        assert_same(k_out, torch_eager.rotate(large[1], cos, sin, layout="half"))
    converted = (cos.double(), sin.double())  # tables that would need converting
    q, k = torch.randn(2, 3, 300, 64, generator=gen), torch.randn(2, 3, 300, 64, generator=gen)
    cpu_native._pair_prepared.clear()
    assert_same(cpu_native.rotate_pair(q, k, *converted, *converted, layout="half")[1],
                torch_eager.rotate(k, *converted, layout="half"))
    assert list(cpu_native._pair_prepared.values()) == [None]


def test_team_kernel_reports_bad_params():
    cpu_native._load()
    team = cpu_native._state["teams"][torch.float32]
    x, c = torch.zeros(4, 8), torch.zeros(4, 4)
    ok = array.array("q", [1, 4, 8, 0, 1, 1, 1, 1, 4, 8, 8, 4, 4])
    bad = array.array("q", [1, 5, 8, 0, 1, 1, 1, 1, 4, 8, 8, 4, 4])  # rotary_dim > head_dim
    ptrs = (x.data_ptr(), x.data_ptr(), c.data_ptr(), c.data_ptr())
    none = (None,) * 5
    for threads in (1, 2, 3):
        assert team(*ptrs, ok.buffer_info()[0], *ptrs, ok.buffer_info()[0], threads) == 0
        assert team(*ptrs, ok.buffer_info()[0], *none, threads) == 0
        assert team(*ptrs, ok.buffer_info()[0], *ptrs, bad.buffer_info()[0], threads) == -1
        assert team(*ptrs, bad.buffer_info()[0], *ptrs, ok.buffer_info()[0], threads) == -1
        assert team(*ptrs, bad.buffer_info()[0], *none, threads) == -1


# -- torch's OpenMP team ----------------------------------------------------------------------------
def test_openmp_team_is_torchs_own():
    """On a torch built with OpenMP (the Linux wheels), the kernel finds torch's runtime."""
    cpu_native._load()
    expected = ("parallel backend: OpenMP" in torch.__config__.parallel_info() and os.path.exists("/proc/self/maps"))
    assert cpu_native._state["openmp"] == expected
    if expected:
        maps = open("/proc/self/maps", encoding="utf-8").read()
        assert sum(os.path.basename(line.split()[-1]).startswith(("libgomp", "libomp", "libiomp5"))
                   for line in {ln for ln in maps.splitlines() if "/" in ln}) >= 1


def test_openmp_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("ROPEKIT_NATIVE_OPENMP", "0")
    assert cpu_library.openmp_entry_points() is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inplace", [False, True])
def test_team_split_equals_one_thread(dtype, layout, inplace):
    """Rows of q and k split over 1-3 threads: the same bits as one thread, every split point."""
    gen = torch.Generator().manual_seed(15)
    for q_heads, k_heads, seq in [(5, 3, 1), (7, 1, 3), (4, 4, 2)]:  # odd row counts: uneven splits
        q = (torch.randn(3, q_heads, seq, 40, generator=gen) * 4).to(dtype)
        k = (torch.randn(3, k_heads, seq, 40, generator=gen) * 4).to(dtype)
        cos, sin = tables(torch.randint(0, 500, (3, 1, seq), generator=gen), ropekit.inv_frequencies(24)[0], dtype)
        expected = [torch_eager.rotate(t, cos, sin, layout=layout) for t in (q, k)]
        for threads in (1, 2, 3):
            with torch_threads(threads), module_setting("TEAM_MIN_BYTES", 0):
                cpu_native._pair_prepared.clear()
                got = cpu_native.rotate_pair(q.clone(), k.clone(), cos, sin, cos, sin, layout=layout, inplace=inplace)
                alone = native(q.clone(), cos, sin, layout=layout, inplace=inplace)
            assert_same(got[0], expected[0])
            assert_same(got[1], expected[1])
            assert_same(alone, expected[0])


def test_cache_key_covers_the_included_header(monkeypatch, tmp_path):
    """A change to rotary_avx2.h alone must build a new library, not reuse the cached one."""
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(tmp_path / "cache"))
    sources = tmp_path / "csrc"
    sources.mkdir()
    for path in (cpu_library.SOURCE, *cpu_library.HEADERS):
        (sources / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(cpu_library, "SOURCE", sources / cpu_library.SOURCE.name)
    monkeypatch.setattr(cpu_library, "HEADERS", tuple(sources / p.name for p in cpu_library.HEADERS))
    compiler = cpu_library._compiler()
    first = cpu_library._build(compiler, ("-DROPEKIT_PORTABLE",))
    header = cpu_library.HEADERS[0]
    header.write_text(header.read_text() + "\n/* changed */\n")
    assert cpu_library._build(compiler, ("-DROPEKIT_PORTABLE",)) != first


FORK_SCRIPT = r"""
import os, sys, torch, ropekit
torch.set_num_threads(2)
q, k = torch.randn(16, 32, 1, 128), torch.randn(16, 8, 1, 128)
cos, sin = ropekit.cos_sin(torch.arange(16)[:, None, None] * 7, ropekit.inv_frequencies(128)[0])
expected = ropekit.apply_rotary_qk(q, k, cos, sin, backend="torch")
ropekit.apply_rotary_qk(q, k, cos, sin)  # the parent's OpenMP team is up
big = torch.randn(8, 32, 64, 128)
ropekit.apply_rotary(big, cos[:1, 0], sin[:1, 0])
pid = os.fork()
if pid == 0:
    got = ropekit.apply_rotary_qk(q, k, cos, sin)  # prepared in the parent (fast path)
    fresh = ropekit.apply_rotary_qk(q[:8], k[:8], cos[:8], sin[:8])  # prepared here
    alone = ropekit.apply_rotary(big, cos[:1, 0], sin[:1, 0])
    torch.set_num_threads(1)  # torch's own ops would wait for the parent's threads too
    ok = all(torch.equal(a, b) for a, b in zip(got, expected)) and torch.equal(fresh[1], expected[1][:8])
    ok = ok and torch.equal(alone, ropekit.apply_rotary(big, cos[:1, 0], sin[:1, 0], backend="torch"))
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_runs_the_kernel_without_the_parents_threads(tmp_path):
    """libgomp's team does not survive fork: a child must not wait for the parent's threads."""
    import subprocess
    import sys

    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
