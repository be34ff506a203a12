"""Every tensor order with every position form rotates each token by its own position.

The oracle knows nothing of ``seq_dim`` handling inside ropekit: q/k are drawn in a canonical
``(batch, seq, heads, head_dim)`` order with each token's position worked out here from the
position form, rotated token by token with the float64 :func:`ropekit.rotation_matrix`, and only
then permuted into the order under test. Orders (letters: ``b`` batch, ``s`` sequence, ``h`` heads)
cover every ``seq_dim`` of 2- to 4-D q/k, positive and negative, and packed ``cu_seqlens``.
Backends: ``"torch"``, ``"cpu"`` and ``"triton"`` in Triton's CPU interpreter when triton is installed.
"""

import importlib.util
import os
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ropekit
from ropekit import base_inv_freq, cos_sin, rotation_matrix
from ropekit.multiaxis import named_plan
from ropekit.nn import MultiAxisRotaryEmbedding, XPosEmbedding
from triton_interpreter import import_interpreted

BACKENDS = ["torch", "cpu"]
if importlib.util.find_spec("triton") is not None:
    import_interpreted("ropekit.ops.triton_kernel")
    BACKENDS.append("triton")

TABLE_ROWS = 24
ATOL = 2e-6  # float32 tables and arithmetic on O(1) values; a wrong row moves a value by O(1)
# letters of q's axes before head_dim, with the seq_dim naming the sequence axis
ORDERS = {"bshd": 1, "bhsd": 2, "sbhd": 0, "bsd": 1, "shd": 0, "sd": 0}
FORMS = ("none", "int", "offsets", "positions_seq", "positions_batch")


@contextmanager
def interpreted(backend):
    """Triton's interpreter around a call on the triton backend (CPU tensors); nothing for the others."""
    previous = os.environ.get("TRITON_INTERPRET")
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def rotate_tokens(x, positions, inv_freq, layout):
    """float64 ``x`` ``(batch, seq, heads, head_dim)`` with token ``[b, t]`` turned by ``R(positions[b, t])``."""
    out = x.double().clone()
    rotary_dim = 2 * inv_freq.numel()
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            matrix = rotation_matrix(int(positions[b, t]), inv_freq, layout=layout)
            out[b, t, :, :rotary_dim] = out[b, t, :, :rotary_dim] @ matrix.T
    return out


def to_order(x, order):
    """Canonical ``(batch, seq, heads, head_dim)`` x in ``order`` (the size-1 axes the order lacks dropped)."""
    if "h" not in order:
        x = x.squeeze(2)
    if "b" not in order:
        x = x.squeeze(0)
    present = [letter for letter in "bsh" if letter in order]
    return x.permute(*[present.index(letter) for letter in order[:-1]], x.dim() - 1)


def position_kwargs(form, draw_ints, batch, seq, batched_axis):
    """``(rotate keywords, (batch, seq) positions expected)`` of one position form."""
    steps = torch.arange(seq)
    if form == "none":
        return {}, steps.expand(batch, seq)
    if form == "int":
        offset = draw_ints(0, TABLE_ROWS - seq)
        return {"offsets": offset}, (offset + steps).expand(batch, seq)
    rows = batch if batched_axis else 1
    if form == "offsets":
        offsets = torch.tensor([draw_ints(0, TABLE_ROWS - seq) for _ in range(rows)])
        return {"offsets": offsets}, (offsets[:, None] + steps).expand(batch, seq)
    if form == "positions_seq":
        positions = torch.tensor([draw_ints(0, TABLE_ROWS - 1) for _ in range(seq)], dtype=torch.long)
        return {"positions": positions}, positions.expand(batch, seq)
    positions = torch.tensor([[draw_ints(0, TABLE_ROWS - 1) for _ in range(seq)] for _ in range(rows)],
                             dtype=torch.long).reshape(rows, seq)
    return {"positions": positions}, positions.expand(batch, seq)


@st.composite
def cases(draw, order):
    """One q/k pair in ``order`` with some position form, and the expected float64 results."""
    seq_dim = ORDERS[order] - (len(order) if draw(st.booleans()) else 0)
    batch = draw(st.integers(1, 3)) if "b" in order else 1
    seq = draw(st.integers(1, 5))
    q_heads = draw(st.integers(1, 3)) if "h" in order else 1
    k_heads = draw(st.integers(1, 3)) if "h" in order else 1
    head_dim = draw(st.sampled_from([4, 6, 8]))
    rotary_dim = 2 * draw(st.integers(1, head_dim // 2))
    layout = draw(st.sampled_from(["half", "interleaved"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    form = draw(st.sampled_from(FORMS))
    kwargs, expected_positions = position_kwargs(form, lambda lo, hi: draw(st.integers(lo, hi)), batch, seq,
                                                 "b" in order)
    q = torch.randn(batch, seq, q_heads, head_dim, dtype=dtype)
    k = torch.randn(batch, seq, k_heads, head_dim, dtype=dtype)
    inv_freq = base_inv_freq(rotary_dim)
    expected = [to_order(rotate_tokens(t, expected_positions, inv_freq, layout), order) for t in (q, k)]
    q, k = to_order(q, order), to_order(k, order)
    if draw(st.booleans()):
        q, k = q.contiguous(), k.contiguous()
    return dict(q=q, k=k, kwargs=kwargs, seq_dim=seq_dim, layout=layout, inv_freq=inv_freq, expected=expected,
                form=form, order=order)


@st.composite
def packed_cases(draw):
    """Variable-length sequences packed into ``(tokens, heads, head_dim)`` with ``cu_seqlens``."""
    lengths = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
    tokens = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    head_dim = draw(st.sampled_from([4, 8]))
    rotary_dim = 2 * draw(st.integers(1, head_dim // 2))
    layout = draw(st.sampled_from(["half", "interleaved"]))
    form = draw(st.sampled_from(["none", "int", "offsets", "positions"]))
    start = [i for n in lengths for i in range(n)]  # each token's index within its own sequence
    seq_id = [b for b, n in enumerate(lengths) for _ in range(n)]
    kwargs = {"cu_seqlens": cu_seqlens}
    if form == "none":
        expected_positions = torch.tensor(start, dtype=torch.long)
    elif form == "int":
        offset = draw(st.integers(0, TABLE_ROWS - 4))
        kwargs["offsets"], expected_positions = offset, torch.tensor(start, dtype=torch.long) + offset
    elif form == "offsets":
        offsets = [draw(st.integers(0, TABLE_ROWS - 4)) for _ in lengths]
        kwargs["offsets"] = torch.tensor(offsets)
        expected_positions = torch.tensor([offsets[b] + i for b, i in zip(seq_id, start, strict=True)],
                                          dtype=torch.long)
    else:
        expected_positions = torch.tensor([draw(st.integers(0, TABLE_ROWS - 1)) for _ in range(tokens)],
                                          dtype=torch.long)
        kwargs["positions"] = expected_positions
    q = torch.randn(1, tokens, draw(st.integers(1, 3)), head_dim)
    k = torch.randn(1, tokens, draw(st.integers(1, 3)), head_dim)
    inv_freq = base_inv_freq(rotary_dim)
    expected = [rotate_tokens(t, expected_positions[None], inv_freq, layout)[0] for t in (q, k)]
    return dict(q=q[0], k=k[0], kwargs=kwargs, seq_dim=draw(st.sampled_from([0, -3])), layout=layout,
                inv_freq=inv_freq, expected=expected, form=form, order="packed")


def check(case, backend, *, pair):
    cos, sin = cos_sin(torch.arange(TABLE_ROWS), case["inv_freq"])
    options = dict(**case["kwargs"], seq_dim=case["seq_dim"], layout=case["layout"], backend=backend)
    q, k = case["q"], case["k"]
    if backend == "triton" and q.dtype == torch.float64:  # the Triton kernel takes float32, float16, bfloat16
        q, k = q.float(), k.float()
    with interpreted(backend):
        if pair:
            got = ropekit.rotate_qk(q, k, cos, sin, **options)
        else:
            got = (ropekit.rotate(q, cos, sin, **options),)
    for out, expected, x in zip(got, case["expected"], (q, k), strict=False):
        assert out.shape == x.shape and out.dtype == x.dtype
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=ATOL,
                                   msg=lambda m: f"{case['order']} seq_dim={case['seq_dim']} {case['form']}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", sorted(ORDERS))
@given(data=st.data(), pair=st.booleans())
def test_every_order_and_position_form_matches_the_rotation_matrices(backend, order, data, pair):
    check(data.draw(cases(order)), backend, pair=pair)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=packed_cases(), pair=st.booleans())
def test_packed_sequences_match_the_rotation_matrices(backend, case, pair):
    check(case, backend, pair=pair)


def test_sequence_first_per_row_positions_regression():
    """The (seq, batch, heads, head_dim) example of the bug: per-row positions and offsets went to the wrong rows."""
    inv_freq = base_inv_freq(4)
    cos, sin = cos_sin(torch.arange(16), inv_freq)
    x = torch.randn(3, 2, 1, 4)
    for kwargs, positions in (({"positions": torch.tensor([[0, 1, 2], [5, 7, 9]])}, [[0, 1, 2], [5, 7, 9]]),
                              ({"offsets": torch.tensor([0, 5])}, [[0, 1, 2], [5, 6, 7]])):
        expected = rotate_tokens(x.transpose(0, 1), torch.tensor(positions), inv_freq, "half").transpose(0, 1)
        for backend in ("torch", "cpu"):
            got = ropekit.rotate(x, cos, sin, seq_dim=0, backend=backend, **kwargs)
            torch.testing.assert_close(got.double(), expected, rtol=0, atol=ATOL)


# -- the modules ------------------------------------------------------------------------------------------
MODULE_ORDERS = {"bshd": 1, "bhsd": 2, "sbhd": 0, "bsd": 1}  # orders with a batch axis


@st.composite
def module_cases(draw, order):
    """q and k ``(batch, seq, heads, head_dim)`` to be put in ``order``, a position form and its positions."""
    seq_dim = MODULE_ORDERS[order] - (len(order) if draw(st.booleans()) else 0)
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    heads = draw(st.integers(1, 3)) if "h" in order else 1
    head_dim = draw(st.sampled_from([4, 8]))
    form = draw(st.sampled_from(FORMS))
    kwargs, expected_positions = position_kwargs(form, lambda lo, hi: draw(st.integers(lo, hi)), batch, seq, True)
    if "offsets" in kwargs:
        kwargs["offset"] = kwargs.pop("offsets")
    q = torch.randn(batch, seq, heads, head_dim)
    k = torch.randn(batch, seq, heads, head_dim)
    return dict(order=order, seq_dim=seq_dim, kwargs=kwargs, positions=expected_positions, q=q, k=k,
                layout=draw(st.sampled_from(["half", "interleaved"])), form=form)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", sorted(MODULE_ORDERS))
@given(data=st.data())
def test_rotary_embedding_every_order_and_position_form(backend, order, data):
    case = data.draw(module_cases(order))
    head_dim = case["q"].shape[-1]
    module = ropekit.RotaryEmbedding(head_dim, layout=case["layout"], backend=backend)
    q, k = to_order(case["q"], case["order"]), to_order(case["k"], case["order"])
    kwargs = dict(case["kwargs"])
    with interpreted(backend):
        got = module(q, k, kwargs.pop("positions", None), **kwargs, seq_dim=case["seq_dim"])
    for out, x in zip(got, (case["q"], case["k"]), strict=True):
        expected = to_order(rotate_tokens(x, case["positions"], module.inv_freq, case["layout"]), case["order"])
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=ATOL,
                                   msg=lambda m: f"{case['order']} seq_dim={case['seq_dim']} {case['form']}: {m}")


@pytest.mark.parametrize("order", sorted(MODULE_ORDERS))
@given(data=st.data())
def test_xpos_scales_each_token_by_its_own_position(order, data):
    """xPos: query factors ``zeta_i^(n/B)``, key factors ``zeta_i^(-n/B)`` on each pair, in any order."""
    case = data.draw(module_cases(order))
    head_dim = case["q"].shape[-1]
    module = XPosEmbedding(head_dim, layout=case["layout"], scale_base=8.0)
    q, k = to_order(case["q"], case["order"]), to_order(case["k"], case["order"])
    kwargs = dict(case["kwargs"])
    got = module(q, k, kwargs.pop("positions", None), **kwargs, seq_dim=case["seq_dim"])
    pairs = torch.arange(0, head_dim, 2, dtype=torch.float64)
    zeta = (pairs + 0.4 * head_dim) / (1.4 * head_dim)  # the xPos paper's zeta_i = (2i/d + gamma) / (1 + gamma)
    power = case["positions"].double()[..., None, None] / 8.0  # (batch, seq, 1, 1)
    per_pair = zeta ** power  # (batch, seq, 1, pairs)
    factor = torch.cat((per_pair, per_pair), -1) if case["layout"] == "half" else per_pair.repeat_interleave(2, -1)
    for out, x, sign in zip(got, (case["q"], case["k"]), (1, -1), strict=True):
        rotated = rotate_tokens(x, case["positions"], module.inv_freq, case["layout"])
        expected = to_order(rotated * factor ** sign, case["order"])
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=ATOL)


@pytest.mark.parametrize("order", sorted(MODULE_ORDERS))
@given(batch=st.integers(1, 3), seq=st.integers(1, 4), batched=st.booleans(), negative=st.booleans())
def test_multi_axis_positions_in_every_order(order, batch, seq, batched, negative):
    """Vector positions ``(seq, n_axes)`` or ``(batch, seq, n_axes)`` reach each token whatever the order."""
    plan = named_plan("qwen3-vl", head_dim=16, section=(2, 3, 3))
    module = MultiAxisRotaryEmbedding(plan, backend="cpu")
    heads = 2 if "h" in order else 1
    x = torch.randn(batch, seq, heads, 16)
    positions = torch.randint(0, 9, (batch if batched else 1, seq, plan.n_axes))
    seq_dim = MODULE_ORDERS[order] - (len(order) if negative else 0)
    got, _ = module(to_order(x, order), None, positions if batched else positions[0], seq_dim=seq_dim)
    expected = ropekit.apply_reference(x, positions[:, :, None, :], plan, layout="half")
    torch.testing.assert_close(got.double(), to_order(expected, order), rtol=0, atol=ATOL)
