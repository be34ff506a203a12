"""Bad arguments to the fused forms: a ValueError/TypeError that names the argument, and nothing written."""

import pytest
import torch

import ropekit

torch.set_num_threads(1)


def inputs():
    inv_freq, _ = ropekit.inv_frequencies(16)
    cos, sin = ropekit.cos_sin(torch.arange(3), inv_freq)
    return torch.randn(2, 4, 3, 16), torch.randn(2, 2, 3, 16), torch.randn(16), cos, sin


NORM_CASES = [
    (dict(eps=0.0), ValueError, "eps"),
    (dict(eps=float("nan")), ValueError, "eps"),
    (dict(eps="1e-6"), TypeError, "eps"),
    (dict(weight_offset=float("inf")), ValueError, "weight_offset"),
    (dict(weight_offset=True), TypeError, "weight_offset"),
    (dict(norm="per_layer"), ValueError, "norm"),
    (dict(layout="spiral"), ValueError, "layout"),
    (dict(inplace=1), TypeError, "inplace"),
    (dict(q_weight=torch.randn(8)), ValueError, r"q_weight must have shape \(head_dim,\)"),
    (dict(k_weight=torch.randn(2, 16)), ValueError, "k_weight"),
    (dict(norm="per_token"), ValueError, r"q_weight must have shape \(heads, head_dim\)"),
    (dict(q_weight=None, weight_offset=1.0), ValueError, "q_weight is None"),
    (dict(q_weight=torch.ones(16, dtype=torch.int64)), TypeError, "q_weight"),
    (dict(k=torch.randn(2, 2, 3, 8)), ValueError, "head_dim"),
    (dict(cos=torch.randn(4, 8), sin=torch.randn(4, 8)), ValueError, "broadcast"),
    (dict(q=torch.ones(2, 4, 3, 16, dtype=torch.int32)), TypeError, "q must have a floating dtype"),
    (dict(backend="nope"), ValueError, "backend"),
]


@pytest.mark.parametrize(("change", "error", "match"), NORM_CASES)
def test_rms_norm_rotary_qk_refuses_bad_arguments(change, error, match):
    q, k, w, cos, sin = inputs()
    args = dict(q=q, k=k, q_weight=w, k_weight=w.clone(), cos=cos, sin=sin)
    options = dict(eps=1e-6)
    for name, value in change.items():
        (args if name in args else options)[name] = value
    before = [t.clone() for t in (q, k)]
    with pytest.raises(error, match=match):
        ropekit.rms_norm_rotary_qk(*args.values(), **options)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k), strict=True))


def test_eps_is_required_and_autograd_limits_are_explicit():
    q, k, w, cos, sin = inputs()
    with pytest.raises(TypeError, match="eps"):
        ropekit.rms_norm_rotary_qk(q, k, w, w, cos, sin)
    with pytest.raises(ValueError, match="inplace=True cannot be differentiated"):
        ropekit.rms_norm_rotary_qk(q, k, w.requires_grad_(), None, cos, sin, eps=1e-6, inplace=True)
    with pytest.raises(ValueError, match="cos/sin"):
        ropekit.rms_norm_rotary(q, None, cos.requires_grad_(), sin, eps=1e-6)
    with pytest.raises(ValueError, match="distinct"):
        ropekit.rms_norm_rotary_qk(q, q, None, None, cos.detach(), sin, eps=1e-6, inplace=True)
    with pytest.raises(ValueError, match="share memory"):
        ropekit.rms_norm_rotary(torch.randn(1, 1, 16).expand(2, 3, 16), None, cos.detach(), sin, eps=1e-6,
                                inplace=True)
    with pytest.raises(ValueError, match="per_token"):
        ropekit.rms_norm_rotary(torch.randn(16), None, cos.detach()[0], sin[0], eps=1e-6, norm="per_token")


CACHE_CASES = [
    (dict(slots=-1), ValueError, "slots must be >= 0"),
    (dict(slots=1.5), TypeError, "slots"),
    (dict(slots=torch.tensor([0.0, 1.0])), TypeError, "slots must be an int32 or int64"),
    (dict(slots=torch.tensor([0, 1, 2])), ValueError, r"slots must have shape"),
    (dict(v=torch.randn(2, 2, 3, 8)), ValueError, "k and v"),
    (dict(k_cache=torch.zeros(2, 2, 8, 16, dtype=torch.bfloat16)), ValueError, "k_cache and v_cache|dtypes"),
    (dict(k_cache=torch.zeros(3, 2, 8, 16), v_cache=torch.zeros(3, 2, 8, 16)), ValueError, "contiguous layout"),
    (dict(block_size=4), ValueError, "paged layout"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(k_weight=torch.ones(16)), ValueError, "pass eps"),
    (dict(eps=1e-6, k_weight=torch.ones(8)), ValueError, "k_weight"),
    (dict(eps=1e-6, weight_offset=1.0), ValueError, "k_weight is None"),
    (dict(eps=-1.0), ValueError, "eps"),
]


@pytest.mark.parametrize(("change", "error", "match"), CACHE_CASES)
def test_rotate_into_cache_refuses_bad_arguments_and_writes_nothing(change, error, match):
    _, k, _, cos, sin = inputs()
    args = dict(k=k, v=k.clone(), cos=cos, sin=sin, k_cache=torch.zeros(2, 2, 8, 16), v_cache=torch.zeros(2, 2, 8, 16),
                slots=0)
    options = {}
    for name, value in change.items():
        (args if name in args else options)[name] = value
    with pytest.raises(error, match=match):
        ropekit.rotate_into_cache(*args.values(), **options)
    assert not args["k_cache"].any() and not args["v_cache"].any()


def test_slot_mapping_refuses_bad_arguments():
    table = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="block_size"):
        ropekit.slot_mapping(table, torch.tensor([[0]]), 0)
    with pytest.raises(TypeError, match="positions"):
        ropekit.slot_mapping(table, torch.tensor([[0.0]]), 4)
    with pytest.raises(ValueError, match="past the 2 blocks"):
        ropekit.slot_mapping(table, torch.tensor([[8]]), 4)
    with pytest.raises(ValueError, match="rows"):
        ropekit.slot_mapping(table, torch.tensor([[0], [1]]), 4)
