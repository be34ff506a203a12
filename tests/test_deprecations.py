"""Every renamed or moved public name still works for one release: one DeprecationWarning, the same result.

Each alias is used twice: the first use warns (naming the replacement), the second does not, and
both give what the new name gives.
"""

import importlib
import warnings

import pytest
import torch

import ropekit
from ropekit import _deprecation, ops
from ropekit.ops import Backend, eager, prepared
from ropekit.rope import axes, plans
from ropekit.rope.frequencies import inv_freq_and_scale


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Every name warns again in each test (the registry is per process)."""
    _deprecation.forget()
    yield
    _deprecation.forget()


def used_twice(use):
    """``(first result, second result, the DeprecationWarning messages of both uses)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = use(), use()
    return first, second, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def assert_one_warning(messages, old, new):
    assert len(messages) == 1, messages
    assert old in messages[0] and "is deprecated; use" in messages[0] and new in messages[0], messages[0]


def test_the_helper_warns_once_per_name_and_forget_resets_it():
    def use():
        _deprecation.warn_once("old_name", "new_name")
        _deprecation.warn_once("other_old", "other_new")

    *_, messages = used_twice(use)
    assert messages == ["old_name is deprecated; use new_name", "other_old is deprecated; use other_new"]
    _deprecation.forget("old_name")
    *_, messages = used_twice(use)
    assert messages == ["old_name is deprecated; use new_name"]


# -- Backend subclasses written against the 0.x method names ------------------------------------------
def tables(n=12, rotary_dim=16):
    return ropekit.cos_sin(torch.arange(n), ropekit.inv_frequencies(rotary_dim)[0])


def legacy_backend_class():
    """A backend as 0.x documented it: ``rotate`` was the broadcast form, ``rotate_pair`` its q/k form."""

    class Legacy(Backend):
        name = "legacy"

        def __init__(self):
            self.calls = []

        def rotate(self, x, cos, sin, *, layout, conjugate, inplace):
            self.calls.append("rotate")
            return eager.EagerBackend().apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)

        def rotate_pair(self, q, k, cos, sin, *, layout, conjugate, inplace):
            self.calls.append("rotate_pair")
            q_out = self.rotate(q, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)  # its own 0.x call
            _, k_out = super().rotate_pair(q.clone(), k, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
            return q_out, k_out

        def rms_norm_rotate(self, x, weight, cos, sin, **options):
            self.calls.append("rms_norm_rotate")
            return super().rms_norm_rotate(x, weight, cos, sin, **options)

    return Legacy


@pytest.fixture
def legacy():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = legacy_backend_class()()
    ops.register("legacy", backend)
    yield backend, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    ops.dispatch._BACKENDS.pop("legacy", None)
    prepared.clear()


def test_a_legacy_backend_warns_once_per_old_name_it_defines(legacy):
    _, messages = legacy
    assert len(messages) == 3, messages
    for old, new in (("rotate(x, cos, sin, ...)", "apply_rotary(...)"), ("rotate_pair(...)", "apply_rotary_qk(...)"),
                     ("rms_norm_rotate(...)", "rms_norm_rotary(...)")):
        assert any(f"Backend method {old}" in m and f"use {new}" in m for m in messages), (old, messages)
    with warnings.catch_warnings(record=True) as caught:  # a second class: the names warned already
        warnings.simplefilter("always")
        legacy_backend_class()
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]


def test_a_legacy_backend_serves_every_form_with_the_results_of_the_new_names(legacy):
    backend, _ = legacy
    cos, sin = tables()
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 12, 16, generator=gen), torch.randn(2, 2, 12, 16, generator=gen)
    weight = torch.rand(16, generator=gen) + 0.5
    calls = {
        "apply_rotary": lambda b: (ropekit.apply_rotary(q, cos, sin, backend=b),),
        "apply_rotary_qk": lambda b: ropekit.apply_rotary_qk(q, k, cos, sin, backend=b),
        "rotate": lambda b: (ropekit.rotate(q, cos, sin, offsets=0, seq_dim=2, backend=b),),
        "rotate_qk": lambda b: ropekit.rotate_qk(q, k, cos, sin, positions=torch.arange(12), seq_dim=2, backend=b),
        "rms_norm_rotary_qk": lambda b: ropekit.rms_norm_rotary_qk(q, k, weight, weight, cos, sin, eps=1e-6,
                                                                    backend=b),
        "module": lambda b: ropekit.RotaryEmbedding(16, backend=b)(q, k),
    }
    for name, call in calls.items():
        backend.calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # the old names warned when the class was made
            got = call("legacy")
        assert backend.calls, f"{name}: the legacy backend did not run"
        for a, b in zip(got, call("torch"), strict=True):
            assert torch.equal(a, b), name
    backend.calls.clear()
    ropekit.apply_rotary_qk(q, k, cos, sin, backend="legacy")
    # its q/k form, its own call of its broadcast form, then super().rotate_pair: the base default's two calls
    assert backend.calls == ["rotate_pair", "rotate", "rotate", "rotate"]
    q_leaf = q.clone().requires_grad_()  # autograd: the operators call the legacy form with conjugate=True
    (grad,) = torch.autograd.grad(ropekit.rotate(q_leaf, cos, sin, seq_dim=2, backend="legacy").sum(), q_leaf)
    assert torch.equal(grad, ropekit.apply_rotary(torch.ones_like(q), cos, -sin, backend="torch"))


def test_a_new_style_backend_is_not_taken_for_a_legacy_one():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)

        class Modern(Backend):
            def apply_rotary(self, x, cos, sin, *, layout, conjugate, inplace):
                return eager.EagerBackend().apply_rotary(x, cos, sin, layout=layout, conjugate=conjugate,
                                                         inplace=inplace)

            def rotate(self, x, cos_table, sin_table, where, *, layout, conjugate, inplace):
                return super().rotate(x, cos_table, sin_table, where, layout=layout, conjugate=conjugate,
                                      inplace=inplace)

    assert Modern.rotate is not Backend.rotate and Modern.apply_rotary_qk is Backend.apply_rotary_qk


# -- renamed functions, methods and call forms ---------------------------------------------------------------
def test_rotary_embedding_rotate_is_rotate_one():
    rope = ropekit.RotaryEmbedding(16)
    x, positions = torch.randn(2, 3, 7, 16), torch.arange(5, 12)
    first, second, messages = used_twice(lambda: rope.rotate(x, positions))
    assert_one_warning(messages, "ropekit.RotaryEmbedding.rotate", "ropekit.RotaryEmbedding.rotate_one")
    assert torch.equal(first, rope.rotate_one(x, positions)) and torch.equal(second, first)


def test_the_old_method_name_reaches_a_subclass_override():
    xpos = ropekit.nn.XPosEmbedding(16)
    k = torch.randn(1, 2, 6, 16)
    first, _, messages = used_twice(lambda: xpos.rotate(k, torch.arange(6), key=True))
    assert_one_warning(messages, "RotaryEmbedding.rotate", "rotate_one")
    assert torch.equal(first, xpos.rotate_one(k, torch.arange(6), key=True))
    assert not torch.equal(first, ropekit.RotaryEmbedding(16).rotate_one(k, torch.arange(6)))  # xPos scaled it


def test_cos_sin_of_a_plan_is_the_plans_own_cos_sin():
    plan = ropekit.multiaxis.named_plan("qwen2-vl", head_dim=32, section=(8, 4, 4))
    positions = torch.randint(0, 50, (9, 3))
    first, second, messages = used_twice(lambda: ropekit.cos_sin(positions, plan))
    assert_one_warning(messages, "ropekit.cos_sin(positions, plan)", "plan.cos_sin(positions)")
    want = plan.cos_sin(positions)
    assert all(torch.equal(a, b) for a, b in zip((*first, *second), (*want, *want), strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="attention_scale must be left at 1.0 with an AxisPlan"):
            ropekit.cos_sin(positions, plan, attention_scale=2.0)


def test_the_rule_object_inv_frequencies_of_the_maths_layer():
    frequencies = importlib.import_module("ropekit.rope.frequencies")
    rule = ropekit.scaling.YaRN(factor=4.0, original_max_position_embeddings=1024)
    first, second, messages = used_twice(lambda: frequencies.inv_frequencies(64, 1e4, rule))
    assert_one_warning(messages, "ropekit.rope.frequencies.inv_frequencies", "ropekit.inv_frequencies")
    for got in (first, second, ropekit.inv_frequencies(64, 1e4, rule)):
        want = inv_freq_and_scale(64, 1e4, rule)
        assert torch.equal(got[0], want[0]) and got[1] == want[1]


# -- moved module attributes ------------------------------------------------------------------------------
MOVED = [
    ("ropekit", "backends", ops, "ropekit.ops"),
    ("ropekit.scaling", "RULE_KEYS", importlib.import_module("ropekit.config.rules").RULE_KEYS,
     "ropekit.config.rules.RULE_KEYS"),
    ("ropekit.scaling", "PLAIN_ROPE_TYPES", importlib.import_module("ropekit.config.rules").PLAIN_ROPE_TYPES,
     "ropekit.config.rules.PLAIN_ROPE_TYPES"),
    ("ropekit.scaling", "rope_type_of", importlib.import_module("ropekit.config.rules").rope_type_of,
     "ropekit.config.rules.rope_type_of"),
    ("ropekit.scaling", "ntk_base", importlib.import_module("ropekit.rope.scaling").ntk_base,
     "ropekit.rope.scaling.ntk_base"),
    ("ropekit.scaling", "yarn_mscale", importlib.import_module("ropekit.rope.scaling").yarn_mscale,
     "ropekit.rope.scaling.yarn_mscale"),
    ("ropekit.multiaxis", "DEFAULT_AXIS_NAMES", axes.DEFAULT_AXIS_NAMES, "ropekit.rope.axes.DEFAULT_AXIS_NAMES"),
    ("ropekit.multiaxis", "default_axis_names", axes.default_axis_names, "ropekit.rope.axes.default_axis_names"),
    ("ropekit.multiaxis", "pixel_ladder", axes.pixel_ladder, "ropekit.rope.axes.pixel_ladder"),
    ("ropekit.multiaxis", "wan_axes_dims", plans.wan_axes_dims, "ropekit.rope.plans.wan_axes_dims"),
    ("ropekit.multiaxis", "cogvideox_axes_dims", plans.cogvideox_axes_dims, "ropekit.rope.plans.cogvideox_axes_dims"),
]


@pytest.mark.parametrize("module, name, home, new", MOVED, ids=[f"{m}.{n}" for m, n, *_ in MOVED])
def test_a_moved_name_is_its_home_object_with_one_warning(module, name, home, new):
    namespace = importlib.import_module(module)
    assert name not in namespace.__all__
    first, second, messages = used_twice(lambda: getattr(namespace, name))
    assert_one_warning(messages, f"{module}.{name}", new)
    assert first is home and second is home


PLAN_FUNCTIONS = {"qwen2_vl": "qwen2-vl", "qwen3_vl": "qwen3-vl", "qwen_vl_vision": "qwen-vl-vision", "eva02": "eva02",
                  "rope_vit_axial": "rope-vit-axial", "dinov3": "dinov3", "flux": "flux", "flux2": "flux2",
                  "hunyuan_video": "hunyuan-video", "wan": "wan", "cogvideox": "cogvideox"}


@pytest.mark.parametrize("old, key", PLAN_FUNCTIONS.items())
def test_a_model_plan_function_is_named_plan_of_its_model(old, key):
    multiaxis = ropekit.multiaxis
    assert old not in multiaxis.__all__ and key in multiaxis.NAMED_PLANS
    first, second, messages = used_twice(lambda: getattr(multiaxis, old)())
    assert_one_warning(messages, f"ropekit.multiaxis.{old}", f"ropekit.multiaxis.named_plan({key!r}")
    assert first == second == multiaxis.named_plan(key)


def test_the_removed_shim_module_is_gone_and_unknown_names_still_raise():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ropekit.backends")
    for namespace in (ropekit.scaling, ropekit.multiaxis):
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            namespace.nope  # noqa: B018
    assert "backends" not in ropekit.__all__ and "backends" not in dir(ropekit)
