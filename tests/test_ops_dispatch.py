"""The operators and the backend registry: a third-party backend gets every form by name,
``torch.compile`` keeps the C++ kernel in the graph, in-place rotation of overlapping elements is
refused on every backend, and a far position cannot make RotaryEmbedding allocate a huge table.
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ropekit
from ropekit import ops
from ropekit.ops import eager
from ropekit.ops.backend import Backend

torch.set_num_threads(1)
BACKENDS = ["torch", "cpu", "triton"]


def reference_rotation(x, rows, inv_freq, layout):
    """float64 oracle: each token multiplied by its rotation matrix, rows broadcast against x.shape[:-1]."""
    return ropekit.apply_reference(x, rows.expand(x.shape[:-1]), inv_freq, layout=layout)


class RecordingBackend(Backend):
    """A third-party backend with every form of its own (float64 arithmetic), recording its calls."""

    name = "recording"

    def __init__(self):
        self.calls = []

    def _rotate(self, x, cos, sin, layout, conjugate, inplace):
        cos, sin = eager.full_rank(x, cos, sin)
        out = eager.apply_rotary(x, cos.double(), sin.double(), layout=layout, conjugate=conjugate, inplace=inplace)
        return out

    def apply_rotary(self, x, cos, sin, *, layout, conjugate, inplace):
        self.calls.append("apply_rotary")
        return self._rotate(x, cos, sin, layout, conjugate, inplace)

    def apply_rotary_qk(self, q, k, cos, sin, *, layout, conjugate, inplace):
        self.calls.append("apply_rotary_qk")
        return self._rotate(q, cos, sin, layout, conjugate, inplace), self._rotate(k, cos, sin, layout, conjugate,
                                                                                   inplace)

    def rotate(self, x, cos_table, sin_table, where, *, layout, conjugate, inplace):
        self.calls.append("rotate")
        rows = where.table_rows(x)
        return self._rotate(x, cos_table[rows], sin_table[rows], layout, conjugate, inplace)

    def rotate_qk(self, q, k, cos_table, sin_table, where, *, layout, conjugate, inplace):
        self.calls.append("rotate_qk")
        rows = where.table_rows(q)
        c, s = cos_table[rows], sin_table[rows]
        return self._rotate(q, c, s, layout, conjugate, inplace), self._rotate(k, c, s, layout, conjugate, inplace)


@pytest.fixture
def recording():
    backend = RecordingBackend()
    ops.register("recording", backend)
    yield backend
    ops.dispatch._BACKENDS.pop("recording", None)


def test_a_registered_backend_gets_every_form_by_name(recording):
    gen = torch.Generator().manual_seed(0)
    inv_freq = ropekit.inv_frequencies(16)[0]
    cos_table, sin_table = ropekit.cos_sin(torch.arange(64), inv_freq)
    q, k = torch.randn(2, 4, 5, 16, generator=gen, dtype=torch.float64), torch.randn(2, 2, 5, 16, generator=gen,
                                                                                      dtype=torch.float64)
    rows = torch.arange(5).reshape(1, 1, 5)
    out = ropekit.apply_rotary(q, cos_table[:5], sin_table[:5], backend="recording")
    pair = ropekit.apply_rotary_qk(q, k, cos_table[:5], sin_table[:5], backend="recording")
    by_pos = ropekit.rotate(q, cos_table, sin_table, offsets=3, seq_dim=2, backend="recording")
    by_pos_pair = ropekit.rotate_qk(q, k, cos_table, sin_table, offsets=3, seq_dim=2, backend="recording")
    module = ropekit.RotaryEmbedding(16, backend="recording")(q, k, offset=3)
    assert recording.calls == ["apply_rotary", "apply_rotary_qk", "rotate", "rotate_qk", "rotate_qk"]
    for got, x, shift in ((out, q, 0), (pair[0], q, 0), (pair[1], k, 0), (by_pos, q, 3), (by_pos_pair[0], q, 3),
                          (by_pos_pair[1], k, 3), (module[0], q, 3), (module[1], k, 3)):
        torch.testing.assert_close(got, reference_rotation(x, rows + shift, inv_freq, "half"), rtol=0, atol=1e-6)
    # autograd reaches it through the operators: the backward is its own conjugate rotation
    q_leaf = q.clone().requires_grad_()
    recording.calls.clear()
    (grad,) = torch.autograd.grad(ropekit.rotate(q_leaf, cos_table, sin_table, seq_dim=2, backend="recording").sum(),
                                  q_leaf)
    assert recording.calls == ["rotate", "rotate"]
    torch.testing.assert_close(grad, reference_rotation(torch.ones_like(q), rows, -inv_freq, "half"), rtol=0,
                               atol=1e-6)


def test_default_forms_of_a_minimal_backend(recording):
    """A backend with only ``apply_rotary`` gets q/k (two calls) and positions (a gather) from the base class."""

    class Minimal(Backend):
        def __init__(self):
            self.calls = 0

        def apply_rotary(self, x, cos, sin, *, layout, conjugate, inplace):
            self.calls += 1
            return eager.EagerBackend().apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)

    minimal = Minimal()
    ops.register("recording", minimal)
    cos, sin = ropekit.cos_sin(torch.arange(32), ropekit.inv_frequencies(8)[0])
    q, k = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    got = ropekit.rotate_qk(q, k, cos, sin, positions=torch.arange(6) * 5, seq_dim=0, backend="recording")
    want = ropekit.rotate_qk(q, k, cos, sin, positions=torch.arange(6) * 5, seq_dim=0, backend="torch")
    assert minimal.calls == 2
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_register_checks_its_arguments():
    with pytest.raises(ValueError, match="name"):
        ops.register("auto", eager.EagerBackend())
    with pytest.raises(TypeError, match="ropekit.ops.Backend"):
        ops.register("mine", object())
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        ropekit.apply_rotary(torch.randn(2, 8), torch.ones(2, 4), torch.zeros(2, 4), backend="nope")


def test_auto_picks_by_device():
    assert ops.resolve("auto", "cpu") == ("cpu" if "cpu" in ops.available() else "torch")
    assert ops.resolve("auto", "meta") == "torch"
    assert ops.resolve("torch", "cpu") == "torch"


@pytest.mark.skipif("cpu" not in ops.available(), reason="C++ CPU kernel unavailable")
def test_compile_fullgraph_keeps_the_cpp_kernel_in_the_graph(monkeypatch):
    """torch.compile on the CPU: one ropekit operator node per call, run by the C++ kernel."""
    torch._dynamo.reset()
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    cpu = ops.get("cpu")
    calls = []
    real_qk, real_one = cpu._qk, cpu._one
    monkeypatch.setattr(cpu, "_qk", lambda *args: calls.append("qk") or real_qk(*args))
    monkeypatch.setattr(cpu, "_one", lambda *args: calls.append("one") or real_one(*args))
    inv_freq = ropekit.inv_frequencies(32)[0]
    cos, sin = ropekit.cos_sin(torch.arange(7), inv_freq)

    def step(q, k, x):
        q, k = ropekit.apply_rotary_qk(q, k, cos, sin, layout="interleaved")
        return q, k, ropekit.apply_rotary(x, cos, sin)

    q, k, x = torch.randn(2, 4, 7, 40), torch.randn(2, 1, 7, 40), torch.randn(3, 7, 32)
    got = torch.compile(step, fullgraph=True, backend=recording_backend)(q, k, x)
    assert len(graphs) == 1
    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "ropekit" in str(n.target)]
    assert [str(n.target) for n in nodes] == ["ropekit.apply_rotary_qk", "ropekit.apply_rotary"]
    assert all(n.args[-1] == "cpu" for n in nodes)  # "auto" resolved to the C++ kernel while tracing
    assert calls == ["qk", "one"]
    rows = torch.arange(7).reshape(1, 1, 7)
    for out, inp, layout in ((got[0], q, "interleaved"), (got[1], k, "interleaved"), (got[2], x, "half")):
        torch.testing.assert_close(out.double(), reference_rotation(inp, rows[0] if inp.dim() == 3 else rows,
                                                                    inv_freq, layout), rtol=0, atol=1e-5)
    eager_out = step(q, k, x)
    assert all(torch.equal(a, b) for a, b in zip(got, eager_out, strict=True))


@pytest.mark.parametrize("backend", BACKENDS + ["recording"])
def test_in_place_rotation_of_overlapping_elements_is_refused(backend, recording):
    """An as_strided view whose rows overlap: refused (ValueError naming it) on every backend, untouched."""
    if backend not in ops.available() or ops.get(backend).cannot_run(torch.zeros(1)) is not None:
        pytest.skip(f"backend {backend} unavailable or not for CPU tensors")
    base = torch.randn(40)
    overlapping = base.as_strided((4, 3, 8), (4, 8, 1))  # row i starts 4 elements after row i - 1
    other = torch.randn(4, 3, 8)
    before = base.clone()
    cos, sin = ropekit.cos_sin(torch.arange(16), ropekit.inv_frequencies(8)[0])
    calls = [
        lambda: ropekit.apply_rotary(overlapping, cos[:3], sin[:3], inplace=True, backend=backend),
        lambda: ropekit.apply_rotary_qk(other.clone(), overlapping, cos[:3], sin[:3], inplace=True, backend=backend),
        lambda: ropekit.rotate(overlapping, cos, sin, seq_dim=1, inplace=True, backend=backend),
        lambda: ropekit.rotate_qk(overlapping, other.clone(), cos, sin, seq_dim=1, inplace=True, backend=backend),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"^(x|q|k) has elements that share memory"):
            call()
    assert torch.equal(base, before)
    assert recording.calls == []
    # out of place the same view is only read: fine, and equal to rotating a copy
    got = ropekit.apply_rotary(overlapping, cos[:3], sin[:3], backend=backend)
    assert torch.equal(got, ropekit.apply_rotary(overlapping.clone(), cos[:3], sin[:3], backend=backend))


HUGE_POSITION_SCRIPT = r"""
import resource, sys, torch, ropekit
torch.set_num_threads(1)
rope = ropekit.RotaryEmbedding(128)
q, k = torch.randn(1, 4, 3, 128), torch.randn(1, 2, 3, 128)
rope(q, k)  # the cache as a server has it after its first requests
in_use = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (in_use + (1 << 30), resource.RLIM_INFINITY))  # 1 GiB more, no 34 GB
positions = torch.tensor([10**9, 2**31 + 1, 5])
q_out, k_out = rope(q, k, positions=positions)
decode_q, decode_k = rope(q[:, :, :1], k[:, :, :1], offset=2**40)
near_q, _ = rope(q, k, positions=torch.tensor([100, 2**31 + 1, 5]))
inv_freq = rope.inv_freq
for x, y, pos in ((q, q_out, positions), (k, k_out, positions), (q[:, :, :1], decode_q, torch.tensor([2**40]))):
    ref = ropekit.apply_reference(x, pos.expand(x.shape[:-1]), inv_freq)
    err = (y.double() - ref).abs().max().item()
    assert err < 1e-5, err
# rows computed alone equal the cached rows bit for bit
cached, _ = rope(q, k, positions=torch.tensor([100, 7, 5]))
assert torch.equal(near_q[..., 0, :], cached[..., 0, :]) and torch.equal(near_q[..., 2, :], cached[..., 2, :])
assert rope.tables(1)[0].shape[0] <= ropekit.nn.rotary.MAX_CACHED_POSITIONS
print("ok")
"""


def test_a_far_position_does_not_allocate_a_huge_table(tmp_path):
    """RotaryEmbedding(128)(q, k, positions=[10**9]) under a 1 GiB address-space margin: exact results."""
    script = tmp_path / "far.py"
    script.write_text(HUGE_POSITION_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=os.environ | {"OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_far_rows_equal_cached_rows_bit_for_bit():
    """Past max_cached_positions the rows are computed alone: the same bits as a cache holding them."""
    gen = torch.Generator().manual_seed(3)
    small = ropekit.RotaryEmbedding(64, max_cached_positions=16)
    large = ropekit.RotaryEmbedding(64)
    q, k = torch.randn(2, 4, 5, 64, generator=gen), torch.randn(2, 1, 5, 64, generator=gen)
    for kwargs in ({"positions": torch.tensor([[3, 40, 1000, 7, 9], [0, 1, 2, 3, 4000]])}, {"offset": 300},
                   {"offset": torch.tensor([0, 5000])}):
        for a, b in zip(small(q, k, **kwargs), large(q, k, **kwargs), strict=True):
            assert torch.equal(a, b)
    assert small.tables(1)[0].shape[0] <= 16
    with pytest.raises(ValueError, match="max_cached_positions"):
        ropekit.RotaryEmbedding(64, max_cached_positions=-1)


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 12)), min_size=1, max_size=4))
def test_overlap_check_is_exact(dims):
    """The in-place overlap check against brute force: every element offset of random strided views."""
    from ropekit.validation import overlaps_itself

    sizes, strides = [n for n, _ in dims], [s for _, s in dims]
    view = torch.zeros(200).as_strided(sizes, strides)
    offsets = [sum(i * s for i, s in zip(index, strides, strict=True)) for index in itertools.product(
        *(range(n) for n in sizes))]
    assert overlaps_itself(view) == (len(set(offsets)) < len(offsets))


def test_registering_again_replaces_prepared_calls(recording):
    """A decode loop's prepared call follows the name: a backend registered under it takes the next call."""
    x = torch.randn(2, 3, 8)
    cos, sin = ropekit.cos_sin(torch.arange(3), ropekit.inv_frequencies(8)[0])
    for _ in range(2):  # the second call is a prepared one
        ropekit.apply_rotary(x, cos, sin, backend="recording")
    assert recording.calls == ["apply_rotary", "apply_rotary"]
    replacement = RecordingBackend()
    ops.register("recording", replacement)
    ropekit.apply_rotary(x, cos, sin, backend="recording")
    assert recording.calls == ["apply_rotary", "apply_rotary"] and replacement.calls == ["apply_rotary"]
