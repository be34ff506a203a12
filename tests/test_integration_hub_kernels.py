"""ropekit through transformers' own kernel hooks (the ``kernels`` package): layers, mapping, models.

The model cases (tests/hub_kernels_cases.py) run in a fresh process: transformers decides at
the first import of a modeling module whether its classes carry the hooks.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

kernels = pytest.importorskip("kernels", reason="the kernels package is not installed (pip install 'ropekit[hf]'): "
                                                "transformers' kernel hooks need it")

import ropekit.integrations.hub_kernels as hub  # noqa: E402
from ropekit.integrations.transformers import kernelize  # noqa: E402

TESTS = Path(__file__).parent


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def _half_layout(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' ``apply_rotary_pos_emb`` (the Llama form), written out here as the oracle."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _interleaved(q, k, cos, sin, unsqueeze_dim=1):
    """A rotation ropekit's layer must not replace: pairs (0, 1), (2, 3), ... with the same tables."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rot(x):
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _attention_using(function):
    """A module that calls a hooked function the way transformers' attention modules do."""
    hooked = kernels.use_kernel_forward_from_hub("rotary_pos_emb")(function)

    @kernels.use_kernelized_func(hooked)
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, q, k, cos, sin):
            return hooked(q, k, cos, sin)

    return Attention


def _tables(seq=5, dim=16, dtype=torch.float32):
    angles = torch.rand(2, seq, dim // 2, generator=torch.Generator().manual_seed(1)) * 6
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)


def test_the_mapping_serves_ropekit_layers():
    mapping = hub.kernel_mapping()
    assert set(mapping) == {"RMSNorm", "rotary_pos_emb"}
    assert set(mapping["RMSNorm"]) == {"cpu", "cuda"}
    assert mapping["RMSNorm"]["cpu"].load() is hub.layers.RMSNorm
    assert mapping["rotary_pos_emb"]["cuda"].load() is hub.layers.RotaryPosEmb
    assert hub.RopekitRepository("RMSNorm") == hub.RopekitRepository("RMSNorm")
    assert len({hub.RopekitRepository("RMSNorm"), hub.RopekitRepository("RMSNorm")}) == 1
    with pytest.raises(ValueError, match="no kernel layer"):
        hub.RopekitRepository("LayerNorm")
    with pytest.raises(ValueError, match="unknown layer names"):
        hub.kernel_mapping(layer_names=("SiLU",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_layer_matches_transformers_form_inside_a_hooked_module_only(dtype):
    attention = _attention_using(_half_layout)()
    with kernels.use_kernel_mapping(hub.kernel_mapping(("cpu",)), inherit_mapping=False):
        kernels.kernelize(attention, mode=kernels.Mode.INFERENCE, device="cpu")
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16, generator=gen).to(dtype), torch.randn(2, 2, 5, 16, generator=gen).to(dtype)
    cos, sin = _tables(dtype=dtype)
    want = _half_layout(q.double(), k.double(), cos.double(), sin.double())
    outside = attention(q, k, cos, sin)  # not hooked by ropekit's kernelize: the function's own result
    assert all(torch.equal(o, w) for o, w in zip(outside, _half_layout(q, k, cos, sin), strict=True))
    handles = [attention.register_forward_pre_hook(hub.enter_attention),
               attention.register_forward_hook(hub.exit_attention, always_call=True)]
    got = attention(q, k, cos, sin)
    for h in handles:
        h.remove()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=0, atol=tol)
    assert not hub.active()


def test_rotary_layer_keeps_a_function_it_does_not_compute(monkeypatch):
    calls = []
    real = hub.apply_rotary_qk
    monkeypatch.setattr(hub, "apply_rotary_qk", lambda *a, **k: calls.append(1) or real(*a, **k))
    attention = _attention_using(_interleaved)()
    with kernels.use_kernel_mapping(hub.kernel_mapping(("cpu",)), inherit_mapping=False):
        kernels.kernelize(attention, mode=kernels.Mode.INFERENCE, device="cpu")
    attention.register_forward_pre_hook(hub.enter_attention)
    attention.register_forward_hook(hub.exit_attention, always_call=True)
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    cos, sin = _tables()
    got = attention(q, k, cos[:1], sin[:1])
    want = _interleaved(q, k, cos[:1], sin[:1])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)) and calls == []


class _Norm(torch.nn.Module):
    def __init__(self, n, offset, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(n) + 0.5)
        self.variance_epsilon, self.offset = eps, offset

    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((self.offset + self.weight.float()) * x).to(hidden_states.dtype)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norm_layer_computes_both_forms_and_keeps_others(offset, monkeypatch):
    calls = []
    real = hub.rms_norm_rotary
    monkeypatch.setattr(hub, "rms_norm_rotary", lambda *a, **k: calls.append(1) or real(*a, **k))

    @kernels.use_kernel_forward_from_hub("RMSNorm")
    class Norm(_Norm):
        pass

    @kernels.use_kernel_forward_from_hub("RMSNorm")
    class Scaled(_Norm):  # not an RMSNorm formula ropekit computes
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    model = torch.nn.Sequential(Norm(32, offset), Scaled(32, offset))
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(2))
    want = model(x)
    with kernels.use_kernel_mapping(hub.kernel_mapping(("cpu",)), inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")
    got = model(x)
    assert len(calls) == 1  # the first norm only
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kernelize_says_when_there_is_no_hook():
    with pytest.raises(ValueError, match="carries none of transformers' kernel hooks.*patch"):
        kernelize(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def _hooks_accepted() -> bool:
    from transformers.utils import import_utils

    return import_utils.is_kernels_available()


@pytest.mark.slow
def test_transformers_models_through_the_hooks():
    """Llama and Qwen3 through transformers' hooks: logits, generation, gradients, two threads, patch alongside."""
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), str(TESTS),
                                                       os.environ.get("PYTHONPATH", "")]))
    if not _hooks_accepted():
        # transformers 5.23 accepts kernels >= 0.18.2; 0.17 has the same decorator, kernelize and mapping API
        env["ROPEKIT_WIDEN_KERNELS_GATE"] = "1"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                          "ignore::DeprecationWarning", str(TESTS / "hub_kernels_cases.py")],
                         capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=600)
    assert run.returncode == 0 and "skipped" not in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
