"""Tiny random transformers models kernelized through transformers' own hooks (run by test_integration_hub_kernels).

Run in a fresh process (``python -m pytest tests/hub_kernels_cases.py``): transformers decorates
its modeling classes when a modeling module is first imported, with the ``kernels`` hooks only
when the installed ``kernels`` version is one it accepts (transformers 5.23: >= 0.18.2, < 0.19).
Where the installed ``kernels`` is older (0.17.x, the same decorator/kernelize/mapping API),
``ROPEKIT_WIDEN_KERNELS_GATE=1`` makes transformers' version check accept it before any modeling
module is imported, so that the modeling code carries the hooks as with an accepted version.

Oracle: the same model (same weights) not kernelized, i.e. transformers' own code.
"""

import copy
import os
import threading

import pytest
import torch

kernels = pytest.importorskip("kernels", reason="the kernels package is not installed")

if os.environ.get("ROPEKIT_WIDEN_KERNELS_GATE") == "1":
    import transformers.utils.import_utils as import_utils

    _accepts = import_utils.is_kernels_available
    import_utils.is_kernels_available = lambda MIN_VERSION="0.17.0", MAX_VERSION=import_utils.KERNELS_MAX_VERSION: (
        _accepts(MIN_VERSION, MAX_VERSION))

import transformers  # noqa: E402

import ropekit.integrations.hub_kernels as hub  # noqa: E402
from ropekit.integrations.transformers import kernel_hooks, kernelize, patch, unkernelize, unpatch  # noqa: E402

torch.set_num_threads(1)

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              intermediate_size=128, max_position_embeddings=256)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16))}
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))


def tiny(family, seed=0):
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # non-trivial norm gains (a fresh model's are all ones)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def spy(monkeypatch):
    """Thread ids of the calls that reached ropekit's rotation and norm, by kind."""
    seen = {"rotary": [], "norm": []}
    for kind, name in (("rotary", "apply_rotary_qk"), ("norm", "rms_norm_rotary")):
        real = getattr(hub, name)
        monkeypatch.setattr(hub, name, lambda *a, real=real, kind=kind, **k: (
            seen[kind].append(threading.get_ident()) or real(*a, **k)))
    return seen


def test_the_hooks_are_there():
    model = tiny("qwen3")
    hooks = kernel_hooks(model)
    assert len(hooks["rotary_pos_emb"]) == 2  # the two attention modules
    assert len(hooks["RMSNorm"]) == 2 * 4 + 1  # per layer input, post-attention, q and k norms; the final norm


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_generation_match(family, spy):
    model = tiny(family)
    reference = copy.deepcopy(model)
    ref = logits(reference)
    assert spy == {"rotary": [], "norm": []}  # transformers' own code, not ropekit
    kernelize(model)
    out = logits(model)
    norms_per_forward = 2 * (4 if family == "qwen3" else 2) + 1
    assert len(spy["rotary"]) == 2 and len(spy["norm"]) == norms_per_forward
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    with torch.no_grad():
        want = reference.generate(IDS[:1, :8], max_new_tokens=8, do_sample=False)
        got = model.generate(IDS[:1, :8], max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    calls = len(spy["rotary"])
    torch.testing.assert_close(logits(reference), ref, rtol=0, atol=0)  # the other model: untouched, bit for bit
    assert len(spy["rotary"]) == calls


def test_gradients_match():
    model = tiny("qwen3").train()
    reference = copy.deepcopy(model)
    kernelize(model)
    for m in (model, reference):
        m(IDS, labels=IDS).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_hooked_and_plain_model_of_one_family_in_two_threads(spy):
    hooked, plain = tiny("llama", seed=1), tiny("llama", seed=2)
    want_hooked, want_plain = logits(copy.deepcopy(hooked)), logits(plain)
    kernelize(hooked)
    start = threading.Barrier(2)
    results, errors = {"hooked": [], "plain": []}, []

    def run(name, model):
        try:
            start.wait()
            for _ in range(15):
                results[name].append((threading.get_ident(), logits(model)))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in (("hooked", hooked), ("plain", plain))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for _, out in results["hooked"]:
        torch.testing.assert_close(out, want_hooked, rtol=0, atol=1e-5)
    for _, out in results["plain"]:
        assert torch.equal(out, want_plain)  # transformers' own code, bit for bit
    hooked_thread, plain_thread = results["hooked"][0][0], results["plain"][0][0]
    assert spy["rotary"].count(hooked_thread) == 15 * 2 and plain_thread not in spy["rotary"]
    assert plain_thread not in spy["norm"] and spy["norm"].count(hooked_thread) == 15 * 5


def test_two_hooked_models_and_unkernelize(spy):
    a, b = tiny("llama", seed=1), tiny("llama", seed=2)
    want_a, want_b = logits(a), logits(b)
    kernelize(a)
    kernelize(b)
    torch.testing.assert_close(logits(a), want_a, rtol=0, atol=1e-5)
    unkernelize(a)
    calls = len(spy["rotary"]), len(spy["norm"])
    assert torch.equal(logits(a), want_a)  # transformers' own code again, bit for bit
    assert (len(spy["rotary"]), len(spy["norm"])) == calls
    torch.testing.assert_close(logits(b), want_b, rtol=0, atol=1e-5)  # b is still kernelized
    assert len(spy["rotary"]) == calls[0] + 2


def test_kernelize_refuses_a_patched_model_and_twice():
    model = tiny("llama")
    kernelize(model)
    with pytest.raises(ValueError, match="already kernelized"):
        kernelize(model)
    with pytest.raises(ValueError, match="patched"):
        kernelize(patch(tiny("llama")))


def test_patch_works_with_the_hooks_on():
    """``patch`` sees through the module transformers makes of ``apply_rotary_pos_emb`` when the hooks are on."""
    model = tiny("qwen3")
    want = logits(model)
    patch(model)
    torch.testing.assert_close(logits(model), want, rtol=0, atol=1e-5)
    unpatch(model)
    assert torch.equal(logits(model), want)


def test_the_mapping_through_kernels_alone_reaches_the_norms_only(spy):
    """``kernels.kernelize`` with ropekit's mapping, without ropekit's kernelize: norms yes, rotation no.

    The rotation module is shared by every model of the family; ropekit rotates only inside
    attention modules that ropekit's kernelize hooked.
    """
    model = tiny("llama")
    want = logits(model)
    with kernels.use_kernel_mapping(hub.kernel_mapping(("cpu",)), inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
    torch.testing.assert_close(logits(model), want, rtol=0, atol=1e-5)
    assert len(spy["norm"]) == 5 and spy["rotary"] == []
