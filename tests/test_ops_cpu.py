"""The C++ CPU backend (``ops/csrc/rotary_cpu.cpp``) against the float64 reference and eager.

The kernel computes exactly the eager backend's expression (float32, or float64 for float64
inputs; no FMA; one rounding to the output dtype), so it is checked bit for bit against
``eager.apply_rotary`` and, independently, within one ulp of the output dtype (relative to the
largest output) against the float64 rotation matrices of ``ropekit.apply_reference``.
"""

import contextlib
import os
import platform
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ropekit
from ropekit import ops
from ropekit.ops import build
from ropekit.ops import eager as torch_eager
from ropekit.ops.cpu import CppBackend

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif("cpu" not in ops.available(), reason="C++ CPU kernel unavailable (no compiler)")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["half", "interleaved"]
KERNEL = {"backend": ops.get("cpu") if "cpu" in ops.available() else None}


@contextlib.contextmanager
def thresholds(plan_bytes=-1, parallel_bytes=-1):
    """Temporarily lower the kernel's byte thresholds (memory-order visit, thread split); -1 keeps one."""
    kernel_ops = KERNEL["backend"].operators()
    old = kernel_ops.set_thresholds(plan_bytes, parallel_bytes)
    try:
        yield
    finally:
        kernel_ops.set_thresholds(*old)


@contextlib.contextmanager
def library(backend):
    """Temporarily run another build of the kernel (a CppBackend of another namespace)."""
    saved = KERNEL["backend"]
    KERNEL["backend"] = backend
    try:
        yield
    finally:
        KERNEL["backend"] = saved


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


def native(x, cos, sin, *, layout, conjugate=False, inplace=False):
    """The C++ backend's apply_rotary, asserting that the inputs are for the kernel (not the eager fallback)."""
    backend = KERNEL["backend"]
    assert backend.takes(x)
    return backend.apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)


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

    expected = torch_eager.apply_rotary(x, cos, sin, **kwargs)
    before = x.clone()
    with thresholds(plan_bytes=0 if case["plan"] else 1 << 20):
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
    with torch_threads(3), thresholds(plan_bytes=0, parallel_bytes=0):
        threaded = native(x.clone(), cos, sin, layout=layout, inplace=inplace)
    assert torch.equal(bits(threaded), bits(single))


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
        assert x.numel() * x.element_size() >= 1 << 20  # the default thresholds: 1 MiB and 128 KiB
        expected = torch_eager.apply_rotary(x, cos, sin, layout=layout)
        with torch_threads(2):
            assert_same(native(x, cos, sin, layout=layout), expected)
            assert_same(native(x.clone(), cos, sin, layout=layout, inplace=True), expected)
            seq_major = x.transpose(1, 2).contiguous().transpose(1, 2)  # (b, s, h, d) storage
            assert_same(native(seq_major, cos, sin, layout=layout), expected)


def kernel_populates() -> bool:
    """Whether this OS takes madvise(MADV_POPULATE_WRITE) (Linux 5.14 and later; older ones refuse it)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        major, minor = (int(part.split("-")[0]) for part in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


@pytest.mark.parametrize("threads", [1, 2])
def test_large_outputs_hold_the_same_values_populated_or_not(threads):
    """Out-of-place outputs of 4 MiB and more may get their pages in one call before the kernel
    writes them (fresh memory only); with the hook off, or below 4 MiB, they never do. The values
    are the same either way, and equal the eager kernel's and the in-place path's."""
    hooks = KERNEL["backend"].operators()
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(1, 16, 4352, 128, generator=gen)  # 34 MiB
    k = torch.randn(1, 4, 4352, 128, generator=gen)
    w = torch.randn(128, generator=gen)
    cos, sin = ropekit.cos_sin(torch.arange(4352), ropekit.inv_frequencies(128)[0])
    cos, sin = cos[None, None], sin[None, None]
    with torch_threads(threads):
        rotated = native(q, cos, sin, layout="half")
        normed = ropekit.rms_norm_rotary_qk(q, k, w, w, cos, sin, eps=1e-6, backend="cpu")
        before = hooks.populated_bytes()
        small = native(q[:, :1, :1024], cos[:, :, :1024], sin[:, :, :1024], layout="half")  # 512 KiB
        assert hooks.populated_bytes() == before
        in_place = ropekit.rms_norm_rotary_qk(q.clone(), k.clone(), w, w, cos, sin, eps=1e-6, inplace=True,
                                              backend="cpu")
        old = hooks.set_populate_bytes(2**62)  # turned off: the pages fault in as the kernel writes
        try:
            faulted = native(q, cos, sin, layout="half")
            faulted_normed = ropekit.rms_norm_rotary_qk(q, k, w, w, cos, sin, eps=1e-6, backend="cpu")
            assert hooks.populated_bytes() == before
        finally:
            hooks.set_populate_bytes(old)
    assert_same(rotated, torch_eager.apply_rotary(q, cos, sin, layout="half"))
    assert_same(small, torch_eager.apply_rotary(q[:, :1, :1024], cos[:, :, :1024], sin[:, :, :1024], layout="half"))
    assert_same(faulted, rotated)
    for got, off, want in zip(normed, faulted_normed, in_place, strict=True):
        assert_same(got, want)
        assert_same(off, want)


POPULATE_SCRIPT = r"""
import os, sys, torch, ropekit
from ropekit import ops
hooks = ops.get("cpu").operators()
page = os.sysconf("SC_PAGE_SIZE")
q = torch.randn(1, 16, 1024, 128, requires_grad=True)  # 8 MiB
k = torch.randn(1, 4, 1024, 128)  # 2 MiB: under the 4 MiB threshold
w = torch.randn(128)
cos, sin = ropekit.cos_sin(torch.arange(1024), ropekit.inv_frequencies(128)[0])
cos, sin = cos[None, None], sin[None, None]
for threads in (1, 2):
    torch.set_num_threads(threads)
    steps = []
    before = hooks.populated_bytes()
    with torch.no_grad():
        ropekit.apply_rotary(q, cos, sin, backend="cpu")
    steps.append(hooks.populated_bytes() - before)
    before = hooks.populated_bytes()
    with torch.no_grad():
        ropekit.rms_norm_rotary_qk(q, k, w, w, cos, sin, eps=1e-6, backend="cpu")
    steps.append(hooks.populated_bytes() - before)
    out = ropekit.rms_norm_rotary(q, None, cos, sin, eps=1e-6, backend="cpu")
    before = hooks.populated_bytes()
    out.backward(torch.ones_like(out))  # the gradient of q: a fresh 8 MiB output
    steps.append(hooks.populated_bytes() - before)
    q.grad = None
    want = q.numel() * 4 - 2 * page
    if not all(want <= step <= q.numel() * 4 for step in steps):
        sys.exit(f"threads {threads}: populated {steps}, want each in [{want}, {q.numel() * 4}]")
"""


@pytest.mark.skipif(not kernel_populates(), reason="needs Linux 5.14 or later (MADV_POPULATE_WRITE)")
def test_fresh_large_outputs_are_populated_in_one_call(tmp_path):
    """In a process whose allocator maps every allocation of 1 MiB or more afresh (glibc's
    MALLOC_MMAP_THRESHOLD_), each out-of-place output of 4 MiB or more (rotation, fused norm and
    rotation, the fused backward's gradient) is populated, at 1 and 2 threads, and a 2 MiB one
    is not."""
    result = run_script(tmp_path, POPULATE_SCRIPT, env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert result.returncode == 0, result.stdout + result.stderr


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
        expected = torch_eager.apply_rotary(x, cos, sin, layout=layout)
        actual = native(x, cos, sin, layout=layout)
        assert_same(actual, expected)
        if dtype == torch.bfloat16:  # NaN payloads too: every NaN rounds to 0x7FC0, as c10::BFloat16 does
            want = torch.where(expected.isnan(), torch.tensor(0x7FC0, dtype=torch.int16), bits(expected))
            assert torch.equal(bits(actual), want)
            assert torch.equal(bits(native(x.clone(), cos, sin, layout=layout, inplace=True)), want)


@pytest.fixture(scope="module")
def portable_functions(tmp_path_factory):
    """The library built without the AVX2/F16C paths (what non-x86 machines run), in its own cache."""
    cache = tmp_path_factory.mktemp("ropekit-cache")
    old = os.environ.get("ROPEKIT_KERNEL_CACHE_DIR")
    os.environ["ROPEKIT_KERNEL_CACHE_DIR"] = str(cache)
    try:
        backend = CppBackend(namespace="ropekit_cpu_portable", extra_flags=("-DROPEKIT_PORTABLE",))
        assert backend.is_available(), backend.error
        return backend
    finally:
        if old is None:
            del os.environ["ROPEKIT_KERNEL_CACHE_DIR"]
        else:
            os.environ["ROPEKIT_KERNEL_CACHE_DIR"] = old


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
                expected = torch_eager.apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate)
                assert_same(native(x, cos, sin, layout=layout, conjugate=conjugate), expected)
                assert_same(native(x.clone(), cos, sin, layout=layout, conjugate=conjugate, inplace=True), expected)
        values = all_16_bit_patterns(dtype).reshape(-1, 64) if dtype.itemsize == 2 else None
        if values is not None:
            rows = values.shape[0]
            cos, sin = torch.rand(rows, 32, generator=gen) * 3, torch.randn(rows, 32, generator=gen)
            assert_same(native(values, cos, sin, layout=layout),
                        torch_eager.apply_rotary(values, cos, sin, layout=layout))


def test_strided_overlapping_and_unsupported_inputs():
    gen = torch.Generator().manual_seed(6)
    cos, sin = ropekit.cos_sin(torch.arange(4), ropekit.inv_frequencies(8)[0])
    cos, sin = cos[None], sin[None]
    strided = torch.randn(2, 4, 32, generator=gen)[..., ::2]  # channel stride 2: rotated through a copy
    expected = torch_eager.apply_rotary(strided, cos, sin, layout="half")
    assert_same(native(strided, cos, sin, layout="half"), expected)
    base = torch.zeros(2, 4, 32)
    view = base[..., ::2]
    view.copy_(strided)
    assert native(view, cos, sin, layout="half", inplace=True) is view
    assert_same(view, expected)
    assert torch.equal(base[..., 1::2], torch.zeros(2, 4, 16))  # the elements between untouched
    expanded = torch.randn(1, 4, 16, generator=gen).expand(3, 4, 16)  # rows alias each other: read-only is fine
    assert_same(native(expanded, cos, sin, layout="half"), torch_eager.apply_rotary(expanded, cos, sin, layout="half"))
    assert_same(native(expanded.clone(), cos[0], sin[0], layout="half"),  # tables with fewer dims
                torch_eager.apply_rotary(expanded, cos[0], sin[0], layout="half"))
    with pytest.raises(ValueError, match="share memory"):  # in place they would be rotated several times
        ropekit.apply_rotary(expanded, cos, sin, inplace=True, backend="cpu")
    ints = torch.ones(4, 16, dtype=torch.int32)
    assert not KERNEL["backend"].takes(ints)


def test_more_leading_axes_than_the_kernel_walks():
    """Nine leading axes that do not merge: split along the first, same bits as eager."""
    gen = torch.Generator().manual_seed(16)
    x = torch.randn([2] * 9 + [3, 8], generator=gen)[..., :2, :].transpose(0, 9)  # axes that cannot merge
    cos, sin = ropekit.cos_sin(torch.randint(0, 99, [2] * 9 + [2], generator=gen), ropekit.inv_frequencies(8)[0])
    cos, sin = cos.transpose(0, 9), sin.transpose(0, 9)
    assert_same(native(x, cos, sin, layout="interleaved"), torch_eager.apply_rotary(x, cos, sin, layout="interleaved"))


def test_tables_are_converted_and_empty_inputs_work():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 16, generator=gen)
    cos, sin = ropekit.cos_sin(torch.arange(4), ropekit.inv_frequencies(16)[0])
    cos, sin = cos[None], sin[None]
    transposed_storage = cos[0].t().contiguous().t()[None]  # last-dim stride 4
    for c, s in [(cos.double(), sin.double()), (cos.bfloat16(), sin.bfloat16()), (transposed_storage, sin)]:
        assert_same(native(x, c, s, layout="interleaved"), torch_eager.apply_rotary(x, c, s, layout="interleaved"))
    empty = torch.empty(0, 4, 16)
    assert native(empty, cos, sin, layout="half").shape == empty.shape
    one = torch.randn(16, generator=gen)  # no leading dims at all
    assert_same(native(one, cos[0, 0], sin[0, 0], layout="half"),
                torch_eager.apply_rotary(one, cos[0, 0], sin[0, 0], layout="half"))


def test_repeated_calls_reuse_checks_not_data(monkeypatch):
    """A decode loop: the checks of a signature are kept (ropekit.ops.prepared), never the data."""
    from ropekit.ops import prepared

    gen = torch.Generator().manual_seed(8)
    inv_freq = ropekit.inv_frequencies(32)[0]
    prepared.clear()
    for step in range(3):  # same shapes, new tokens and positions
        x = torch.randn(4, 6, 1, 40, generator=gen)
        cos, sin = ropekit.cos_sin(torch.randint(0, 100, (4,), generator=gen), inv_freq)
        cos, sin = cos[:, None, None], sin[:, None, None]
        assert_same(ropekit.apply_rotary(x, cos, sin, backend="cpu"),
                    torch_eager.apply_rotary(x, cos, sin, layout="half"))
        assert len(prepared.calls) == (1 if step == 0 else 2)
        converted = (cos.double(), sin.double())
        assert_same(ropekit.apply_rotary(x, *converted, backend="cpu"),
                    torch_eager.apply_rotary(x, *converted, layout="half"))
        assert len(prepared.calls) == 2


def test_kernel_rejects_bad_arguments():
    """The operators check what their memory accesses rely on (ropekit.functional checks first)."""
    kernel_ops = KERNEL["backend"].operators()
    x, c = torch.zeros(4, 8), torch.zeros(4, 4)
    before = x.clone()
    bad = [
        ((x, torch.zeros(4, 5), torch.zeros(4, 5)), "rotary_dim"),  # rotary_dim > head_dim
        ((x, torch.zeros(3, 4), torch.zeros(3, 4)), "broadcast"),  # 3 rows against 4
        ((x, torch.zeros(1, 4, 4), torch.zeros(1, 4, 4)), "do not fit"),  # more dims than x
        ((x, c, torch.zeros(4, 2)), "do not fit"),  # cos and sin differ
        ((x.int(), c, c), "float32"),
    ]
    for args, message in bad:
        with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
            kernel_ops.apply_rotary(*args, False, False)
        with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
            kernel_ops.apply_rotary_qk_(args[0], x.clone(), *args[1:], False, False)
    assert torch.equal(x, before)
    assert kernel_ops.apply_rotary(x, c, c, False, False).shape == x.shape


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
    plan = KERNEL["backend"].operators().plan_rows(sizes, *strides)
    n = plan[0]
    new_sizes = plan[1:1 + n]
    new_strides = [plan[1 + n * (k + 1):1 + n * (k + 2)] for k in range(4)]
    assert n <= 8
    assert sorted(offsets(new_sizes, new_strides)) == sorted(offsets(sizes, strides))


def test_unavailable_backend_warns_once_and_raises(monkeypatch, tmp_path):
    monkeypatch.setenv("ROPEKIT_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    backend = CppBackend(namespace="ropekit_cpu_never")
    with pytest.warns(RuntimeWarning, match="unavailable"):
        assert not backend.is_available()
    assert not backend.is_available()  # no second warning (pytest's filter would raise here)
    with pytest.raises(RuntimeError, match="unavailable"):
        backend.apply_rotary(torch.zeros(2, 4), torch.ones(1, 2), torch.zeros(1, 2), layout="half", conjugate=False,
                             inplace=False)
    assert list(tmp_path.iterdir()) == []  # no half-written library (nor build directory) left behind


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("ROPEKIT_DISABLE_NATIVE", "1")
    backend = CppBackend(namespace="ropekit_cpu_disabled")
    with pytest.warns(RuntimeWarning, match="ROPEKIT_DISABLE_NATIVE"):
        assert not backend.is_available()


def test_library_is_cached(portable_functions, monkeypatch):
    """A second load finds the build in the cache: same file, not rebuilt, nothing else written."""
    directory = portable_functions.build.directory
    monkeypatch.setenv("ROPEKIT_KERNEL_CACHE_DIR", str(directory.parent))
    stamp = portable_functions.build.library.stat().st_mtime_ns
    monkeypatch.setattr(build, "build_in_child", lambda *args: pytest.fail("rebuilt a cached library"))
    again = build.load(("-DROPEKIT_PORTABLE",), "ropekit_cpu_portable", quiet=True)
    assert again == portable_functions.build
    assert again.library.stat().st_mtime_ns == stamp
    assert [p.name for p in directory.parent.iterdir()] == [directory.name]
    assert [p.name for p in directory.iterdir()] == [again.library.name]


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
            expected = torch_eager.apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate)
            out = native(x, cos, sin, layout=layout, conjugate=conjugate)
            assert_same(out, expected)
            assert_same(native(x.clone(), cos, sin, layout=layout, conjugate=conjugate, inplace=True), expected)
            assert_near_reference(out, x, positions, inv_freq, layout, conjugate)
        # (b, s, h, d) storage seen as (b, h, s, d), and every other head of a larger tensor
        wide = (torch.randn(3, 2 * heads, 1, 2 * half + tail, generator=gen) * 4).to(dtype)
        for view in (x.transpose(1, 2).contiguous().transpose(1, 2), wide[:, ::2]):
            assert_same(native(view, cos, sin, layout=layout), torch_eager.apply_rotary(view, cos, sin, layout=layout))


@pytest.mark.parametrize("dtype", DTYPES)


@pytest.mark.parametrize("layout", LAYOUTS)


def test_portable_build_rows_sharing_a_table_row(portable_functions, dtype, layout):
    gen = torch.Generator().manual_seed(12)
    with library(portable_functions):
        for half, tail, heads in [(8, 0, 9), (16, 6, 7), (64, 0, 32)]:
            x, cos, sin, _, _ = decode_case(dtype, layout, half, tail, heads, gen)
            for conjugate in (False, True):
                expected = torch_eager.apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate)
                assert_same(native(x, cos, sin, layout=layout, conjugate=conjugate), expected)
                assert_same(native(x.clone(), cos, sin, layout=layout, conjugate=conjugate, inplace=True), expected)


@pytest.mark.parametrize("dtype", DTYPES)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inplace", [False, True])


def test_apply_rotary_qk_equals_two_calls(dtype, layout, inplace):
    gen = torch.Generator().manual_seed(13)
    for half, tail, q_heads, k_heads in [(64, 0, 32, 32), (64, 0, 32, 8), (16, 6, 7, 1), (8, 0, 4, 4)]:
        q, cos, sin, _, _ = decode_case(dtype, layout, half, tail, q_heads, gen)
        k = (torch.randn(3, k_heads, 1, 2 * half + tail, generator=gen) * 4).to(dtype)
        for conjugate in (False, True):
            expected = [torch_eager.apply_rotary(t, cos, sin, layout=layout, conjugate=conjugate) for t in (q, k)]
            q_in, k_in = q.clone(), k.clone()
            q_out, k_out = KERNEL["backend"].apply_rotary_qk(q_in, k_in, cos, sin, layout=layout, conjugate=conjugate,
                                                             inplace=inplace)
            assert (q_out is q_in and k_out is k_in) == inplace
            assert_same(q_out, expected[0])
            assert_same(k_out, expected[1])


def test_apply_rotary_qk_of_mixed_inputs():
    """q and k that differ in dtype, emptiness or channel stride: still one call, each its own rows."""
    gen = torch.Generator().manual_seed(14)
    cos, sin = ropekit.cos_sin(torch.arange(300), ropekit.inv_frequencies(64)[0])
    cases = {
        "dtypes differ": (torch.randn(2, 4, 300, 64, generator=gen),
                          torch.randn(2, 4, 300, 64, generator=gen).to(torch.bfloat16)),
        "empty k": (torch.randn(2, 4, 300, 64, generator=gen), torch.randn(2, 0, 300, 64, generator=gen)),
        "strided channels": (torch.randn(1, 2, 300, 128, generator=gen)[..., ::2],
                             torch.randn(1, 2, 300, 64, generator=gen)),
        "large, two threads": (torch.randn(1, 8, 300, 64, generator=gen), torch.randn(1, 8, 300, 64, generator=gen)),
    }
    for name, (q, k) in cases.items():
        with torch_threads(2):
            q_out, k_out = KERNEL["backend"].apply_rotary_qk(q, k, cos, sin, layout="half", conjugate=False,
                                                             inplace=False)
        assert_same(q_out, torch_eager.apply_rotary(q, cos[None, None], sin[None, None], layout="half")), name
        assert_same(k_out, torch_eager.apply_rotary(k, cos[None, None], sin[None, None], layout="half")), name
    converted = (cos.double(), sin.double())  # tables that need converting
    q, k = torch.randn(2, 3, 300, 64, generator=gen), torch.randn(2, 3, 300, 64, generator=gen)
    assert_same(KERNEL["backend"].apply_rotary_qk(q, k, *converted, layout="half", conjugate=False, inplace=False)[1],
                torch_eager.apply_rotary(k, converted[0][None, None], converted[1][None, None], layout="half"))


@pytest.mark.parametrize("dtype", DTYPES)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inplace", [False, True])


def test_thread_split_equals_one_thread(dtype, layout, inplace):
    """Rows of q and k split over 1-3 of torch's threads: the same bits as one thread, every split point."""
    gen = torch.Generator().manual_seed(15)
    for q_heads, k_heads, seq in [(5, 3, 1), (7, 1, 3), (4, 4, 2)]:  # odd row counts: uneven splits
        q = (torch.randn(3, q_heads, seq, 40, generator=gen) * 4).to(dtype)
        k = (torch.randn(3, k_heads, seq, 40, generator=gen) * 4).to(dtype)
        cos, sin = tables(torch.randint(0, 500, (3, 1, seq), generator=gen), ropekit.inv_frequencies(24)[0], dtype)
        expected = [torch_eager.apply_rotary(t, cos, sin, layout=layout) for t in (q, k)]
        for threads in (1, 2, 3):
            with torch_threads(threads), thresholds(parallel_bytes=0):
                got = KERNEL["backend"].apply_rotary_qk(q.clone(), k.clone(), cos, sin, layout=layout, conjugate=False,
                                                        inplace=inplace)
                alone = native(q.clone(), cos, sin, layout=layout, inplace=inplace)
            assert_same(got[0], expected[0])
            assert_same(got[1], expected[1])
            assert_same(alone, expected[0])


def test_cache_key_covers_the_included_header(monkeypatch, tmp_path):
    """A change to rotary_avx2.h alone must build a new library, not reuse the cached one."""
    monkeypatch.setenv("ROPEKIT_KERNEL_CACHE_DIR", str(tmp_path / "cache"))
    sources = tmp_path / "csrc"
    sources.mkdir()
    for path in (*build.SOURCES, *build.HEADERS):
        (sources / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(build, "SOURCES", tuple(sources / p.name for p in build.SOURCES))
    monkeypatch.setattr(build, "HEADERS", tuple(sources / p.name for p in build.HEADERS))
    cxx = build.compiler()
    first = build.builds(cxx)
    assert build.builds(cxx) == first  # the key is stable
    header = build.HEADERS[-1]
    header.write_text(header.read_text() + "\n/* changed */\n")
    second = build.builds(cxx)
    assert all(a.library != b.library for a, b in zip(first, second, strict=True))
    assert {"-march=native" in b.flags for b in first} == {True, False}  # -march=native is part of the key
    assert len({b.name for b in first}) == len(first)


# -- the process around the kernel: fork, other OpenMP runtimes, no compiler ------------------------------
def run_script(tmp_path, script, env=None, timeout=300):
    path = tmp_path / "script.py"
    path.write_text(script)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                          env=os.environ | (env or {}), check=False)


FORK_SCRIPT = r"""
import os, sys, torch, ropekit
torch.set_num_threads(2)
q, k = torch.randn(16, 32, 1, 128), torch.randn(16, 8, 1, 128)
cos, sin = ropekit.cos_sin(torch.arange(16)[:, None, None] * 7, ropekit.inv_frequencies(128)[0])
expected = ropekit.apply_rotary_qk(q, k, cos, sin, backend="torch")
ropekit.apply_rotary_qk(q, k, cos, sin)  # torch's thread pool is up
big = torch.randn(8, 32, 64, 128)
ropekit.apply_rotary(big, cos[:1, 0], sin[:1, 0])
pid = os.fork()
if pid == 0:
    torch.set_num_threads(1)  # what torch's own parallel ops need after fork; the kernel uses the same pool
    got = ropekit.apply_rotary_qk(q, k, cos, sin)  # prepared in the parent (fast path)
    fresh = ropekit.apply_rotary_qk(q[:8], k[:8], cos[:8], sin[:8])  # prepared here
    alone = ropekit.apply_rotary(big, cos[:1, 0], sin[:1, 0])
    ok = all(torch.equal(a, b) for a, b in zip(got, expected)) and torch.equal(fresh[1], expected[1][:8])
    ok = ok and torch.equal(alone, ropekit.apply_rotary(big, cos[:1, 0], sin[:1, 0], backend="torch"))
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def test_forked_child_runs_the_kernel(tmp_path):
    """After fork the kernel behaves like torch's own CPU ops (same thread pool)."""
    done = run_script(tmp_path, FORK_SCRIPT, {"OMP_NUM_THREADS": "2"}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


TWO_RUNTIMES_SCRIPT = r"""
import ctypes, os, sys
import torch, ropekit
from ropekit.ops import eager
extra = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # a second OpenMP runtime beside torch's
assert extra.omp_get_max_threads() >= 1
maps = open("/proc/self/maps").read()
runtimes = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line or "iomp" in line or "libomp" in line}
assert len({os.path.realpath(p) for p in runtimes}) >= 2, runtimes
torch.set_num_threads(2)
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    q, k = torch.randn(2, 16, 512, 128, generator=gen).to(dtype), torch.randn(2, 4, 512, 128, generator=gen).to(dtype)
    cos, sin = ropekit.cos_sin(torch.arange(512), ropekit.inv_frequencies(128)[0])
    got = ropekit.apply_rotary_qk(q, k, cos, sin, backend="cpu")
    for x, y in zip((q, k), got):
        assert torch.equal(y, eager.apply_rotary(x, cos[None, None], sin[None, None], layout="half"))
print("ok")
"""


def test_two_openmp_runtimes_in_one_process(tmp_path):
    """A second OpenMP runtime (the system's libgomp beside the one torch loaded) changes nothing."""
    candidates = ["/usr/lib/x86_64-linux-gnu/libgomp.so.1", "/usr/lib/aarch64-linux-gnu/libgomp.so.1",
                  "/usr/lib64/libgomp.so.1", "/usr/lib/libgomp.so.1"]
    extra = next((path for path in candidates if os.path.exists(path)), None)
    if extra is None:
        pytest.skip("no system libgomp to load beside torch's")
    done = run_script(tmp_path, TWO_RUNTIMES_SCRIPT.replace("sys.argv[1]", repr(extra)))
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


NO_COMPILER_SCRIPT = r"""
import warnings
import torch, ropekit
from ropekit.ops import eager
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 8, 32, generator=gen), torch.randn(2, 2, 8, 32, generator=gen)
    cos, sin = ropekit.cos_sin(torch.arange(8), ropekit.inv_frequencies(32)[0])
    for _ in range(3):
        got = ropekit.apply_rotary_qk(q, k, cos, sin)
        assert torch.equal(got[0], eager.apply_rotary(q, cos[None, None], sin[None, None], layout="half"))
        assert torch.equal(ropekit.apply_rotary(k, cos, sin), got[1])
    rope = ropekit.RotaryEmbedding(32)
    rope(q, k)
    assert ropekit.ops.resolve("auto", "cpu") == "torch"
ours = [w for w in caught if "ropekit" in str(w.message)]
assert len(ours) == 1, [str(w.message) for w in caught]
print(ours[0].message)
"""


def test_no_compiler_means_eager_and_one_warning(tmp_path):
    """PATH without c++/g++/cc and an empty cache: correct results and exactly one warning saying why."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {"PATH": str(bin_dir), "ROPEKIT_KERNEL_CACHE_DIR": str(tmp_path / "cache"), "CXX": ""}
    done = run_script(tmp_path, NO_COMPILER_SCRIPT, env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no C++ compiler" in done.stdout
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


DISABLED_SCRIPT = r"""
import warnings
import torch, ropekit
from ropekit.ops import eager
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    x = torch.randn(2, 3, 8)
    cos, sin = ropekit.cos_sin(torch.arange(3), ropekit.inv_frequencies(8)[0])
    assert torch.equal(ropekit.apply_rotary(x, cos, sin), eager.apply_rotary(x, cos[None], sin[None], layout="half"))
    assert ropekit.ops.resolve("auto", "cpu") == "torch" and "cpu" not in ropekit.ops.available()
ours = [str(w.message) for w in caught if "ropekit" in str(w.message)]
assert len(ours) == 1 and "ROPEKIT_DISABLE_NATIVE" in ours[0], ours
print("ok")
"""


def test_disabled_by_environment_in_a_fresh_process(tmp_path):
    """ROPEKIT_DISABLE_NATIVE=1: "auto" runs the eager kernel, one warning says why, nothing is built."""
    done = run_script(tmp_path, DISABLED_SCRIPT, {"ROPEKIT_DISABLE_NATIVE": "1",
                                                  "ROPEKIT_KERNEL_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("dtype", DTYPES)


@pytest.mark.parametrize("layout", LAYOUTS)


def test_portable_build_fused_kernels_give_the_same_bits(portable_functions, dtype, layout):
    """The AVX2 loops of norm_rows.h and the portable ones: the same products, sums and lane order."""
    gen = torch.Generator().manual_seed(12)
    native_backend = KERNEL["backend"]
    for head_dim, half, heads in ((128, 64, 4), (40, 12, 3), (20, 10, 5), (72, 36, 2)):
        x = (torch.randn(2, 9, heads, head_dim, generator=gen) * 3).to(dtype)
        cos, sin = tables(torch.arange(9), ropekit.inv_frequencies(2 * half)[0], dtype)
        cos, sin = cos[:, None], sin[:, None]
        grad = torch.randn(x.shape, generator=gen).to(dtype)
        for per_token in (False, True):
            weight = torch.randn((heads, head_dim) if per_token else (head_dim,), generator=gen).to(dtype)
            options = dict(eps=1e-6, weight_offset=1.0, per_token=per_token, layout=layout)
            results = []
            for backend in (native_backend, portable_functions):
                out = backend.rms_norm_rotary(x, weight, cos, sin, inplace=False, **options)
                grads = backend.rms_norm_rotary_backward(grad, x, weight, cos, sin, **options)
                results.append((out, *grads))
            for a, b in zip(*results, strict=True):
                assert torch.equal(bits(a), bits(b))
def test_empty_tensors_with_any_strides_rotate_forward_and_backward():
    """A rank holding no token of a sequence (uneven contiguous shards) rotates an empty q whose gradient
    comes with strides the kernel's layout checks would refuse: nothing to compute, nothing refused."""
    rope = ropekit.RotaryEmbedding(8)
    hidden = torch.randn(2, 0, 32, requires_grad=True)
    q = hidden.unflatten(-1, (4, 8)).transpose(1, 2)  # (2, 4, 0, 8), as RotarySelfAttention splits heads
    q_rot, k_rot = rope(q, q * 2, torch.arange(0))
    (q_rot.sum() + k_rot.sum()).backward()
    assert hidden.grad.shape == (2, 0, 32)
    odd = torch.empty(2, 4, 0, 8).as_strided((2, 4, 0, 8), (0, 0, 0, 0))
    for inplace in (False, True):
        assert ropekit.apply_rotary(odd, torch.ones(1, 4), torch.zeros(1, 4), inplace=inplace).shape == odd.shape
