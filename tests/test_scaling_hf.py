"""Differential tests against transformers' own rope functions (ROPE_INIT_FUNCTIONS and the models'
compute_default_rope_parameters), over a grid of every rule and parameter combination.

Each case is one ``config.json``-style dict, read by ``RopeConfig.from_hf`` on our side and by a
``LlamaConfig`` on theirs. Two comparisons:

* as shipped: transformers computes in float32; we compute in float64. inv_freq to a relative
  ``2e-6``, widened by ``factor / 8`` past factor 8, where the reference's own float32 error in the
  YaRN ramp / Llama 3 smoothing blend grows with ``factor - 1`` (the float64 run below shows that
  the gap is all theirs); the attention scale to ``1e-6``.
* exact: the same transformers code run with ``torch.float32`` mapped to float64 must agree with
  ropekit to ``1e-12``: the formulas are identical, not merely close.
"""

import copy
import itertools
import math
import types

import pytest
import torch

from ropekit import RopeConfig
from ropekit.config.rules import RULE_KEYS

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
from transformers import GPTNeoXConfig, LlamaConfig  # noqa: E402

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
ROPE_INIT_FUNCTIONS = rope_utils.ROPE_INIT_FUNCTIONS


class _Float64Torch(types.ModuleType):
    """``torch`` with ``float`` / ``float32`` meaning float64, for running reference code exactly."""

    def __getattr__(self, name):
        return torch.float64 if name in ("float", "float32") else getattr(torch, name)


@pytest.fixture
def float64_reference(monkeypatch):
    monkeypatch.setattr(rope_utils, "torch", _Float64Torch("torch"))


def hf_inv_freq(cfg, seq_len):
    """transformers' ``(inv_freq, attention_scale)`` for a config dict."""
    config = LlamaConfig(**copy.deepcopy(cfg))
    kind = config.rope_parameters["rope_type"]
    return ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)


def llama(head_dim, base, params, *, max_positions=8192, legacy=False):
    """A config dict, in the v5 form (``rope_parameters``) or the old one (``rope_theta`` + ``rope_scaling``)."""
    cfg = {"hidden_size": head_dim * 4, "num_attention_heads": 4, "head_dim": head_dim,
           "max_position_embeddings": max_positions}
    if legacy:
        return {**cfg, "rope_theta": base, "rope_scaling": dict(params)}
    return {**cfg, "rope_parameters": {"rope_theta": base, **params}}


HEADS_AND_BASES = [(64, 10000.0), (128, 500000.0), (96, 1e6), (256, 5e6)]


def grid():
    """``(case id, config dict, seq_lens)`` for every rule and parameter combination."""
    cases = []

    def add(name, params, seq_lens=(None,), heads=HEADS_AND_BASES, **kw):
        for i, (head_dim, base) in enumerate(heads):
            legacy = i % 2 == 1 and "partial_rotary_factor" not in params
            cases.append((f"{name}-d{head_dim}", llama(head_dim, base, params, legacy=legacy, **kw), seq_lens))

    for factor, share in itertools.product((1.0, 2.0, 8.0, 32.0), (1.0, 0.5)):
        add(f"linear-f{factor}-p{share}", {"rope_type": "linear", "factor": factor, "partial_rotary_factor": share})
    for factor, share in itertools.product((1.0, 2.0, 4.0, 16.0), (1.0, 0.25)):
        add(f"dynamic-f{factor}-p{share}", {"rope_type": "dynamic", "factor": factor, "partial_rotary_factor": share},
            seq_lens=(None, 1, 4096, 8192, 8193, 20000, 131072))
    mscales = [(None, None), (0.707, 0.707), (1.0, 0.707), (0.707, 1.0), (1.0, None), (None, 1.0), (0.5, 0.0)]
    for factor, (fast, slow), truncate, (ms, msa) in itertools.product(
        (1.0, 2.0, 4.0, 16.0, 40.0), ((32, 1), (64, 2), (16, 1), (8, 8)), (True, False, None), mscales[:3]
    ):
        params = {"rope_type": "yarn", "factor": factor, "beta_fast": fast, "beta_slow": slow,
                  "original_max_position_embeddings": 2048, "mscale": ms, "mscale_all_dim": msa}
        if truncate is not None:
            params["truncate"] = truncate
        add(f"yarn-f{factor}-b{fast}/{slow}-t{truncate}-m{ms}/{msa}", params, heads=HEADS_AND_BASES[:2])
    for ms, msa in mscales:
        add(f"yarn-mscale{ms}/{msa}", {"rope_type": "yarn", "factor": 40, "mscale": ms, "mscale_all_dim": msa,
                                       "original_max_position_embeddings": 4096}, max_positions=163840)
    add("yarn-attention_factor", {"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.8,
                                  "original_max_position_embeddings": 4096})
    add("yarn-no-original", {"rope_type": "yarn", "factor": 4.0})  # original length = max_position_embeddings
    add("yarn-factor-from-lengths", {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024})
    add("yarn-partial", {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5,
                         "original_max_position_embeddings": 4096})
    add("yarn-beta-null", {"rope_type": "yarn", "factor": 4.0, "beta_fast": None, "beta_slow": None,
                           "original_max_position_embeddings": 4096})
    for factor, (low, high), length, share in itertools.product(
        (1.0, 2.0, 8.0, 32.0), ((1.0, 4.0), (1.0, 2.0), (0.5, 8.0), (2.0, 3.0), (1.0, 1.0)), (2048, 8192), (1.0, 0.5)
    ):
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                  "original_max_position_embeddings": length, "partial_rotary_factor": share}
        add(f"llama3-f{factor}-{low}/{high}-L{length}-p{share}", params, heads=HEADS_AND_BASES[:2],
            max_positions=length * 16)
    for head_dim, base in HEADS_AND_BASES:
        half = head_dim // 2
        short = [1.0 + 0.05 * i for i in range(half)]
        long = [1.0 + 2.0 * i for i in range(half)]
        for extra in ({}, {"factor": 8.0}, {"factor": 1.0}, {"attention_factor": 0.9},
                      {"factor": 4.0, "attention_factor": 1.3}):
            params = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                      "original_max_position_embeddings": 4096, **extra}
            cases.append((f"longrope-{extra}-d{head_dim}",
                          llama(head_dim, base, params, max_positions=131072),
                          (None, 1, 4096, 4097, 131072)))
    for head_dim, base in HEADS_AND_BASES[:2]:  # Phi-4-mini: longrope on 75% of the head
        rotary = int(head_dim * 0.75)
        params = {"rope_type": "longrope", "short_factor": [1.5] * (rotary // 2),
                  "long_factor": [1.0 + i for i in range(rotary // 2)], "partial_rotary_factor": 0.75,
                  "original_max_position_embeddings": 4096}
        cases.append((f"longrope-partial-d{head_dim}", llama(head_dim, base, params, max_positions=131072),
                      (None, 4097)))
    for share, factor in itertools.product((0.25, 0.5, 1.0, 0.3), (1.0, 2.0)):
        add(f"proportional-p{share}-f{factor}",
            {"rope_type": "proportional", "partial_rotary_factor": share, "factor": factor})
    return cases


GRID = grid()


def test_every_transformers_rope_type_is_implemented():
    assert set(ROPE_INIT_FUNCTIONS) <= set(RULE_KEYS)
    names = {config["rope_parameters" if "rope_parameters" in config else "rope_scaling"]["rope_type"]
             for _, config, _ in GRID}
    assert set(ROPE_INIT_FUNCTIONS) <= names


def float32_rtol(cfg):
    params = cfg.get("rope_parameters") or cfg["rope_scaling"]
    return 2e-6 * max(1.0, (params.get("factor") or 1.0) / 8.0)


FAMILIES = sorted({name.split("-")[0] for name, _, _ in GRID})


def family(kind):
    return [case for case in GRID if case[0].split("-")[0] == kind]


@pytest.mark.parametrize("kind", FAMILIES)
def test_matches_transformers_as_shipped(kind):
    for name, cfg, seq_lens in family(kind):
        rope = RopeConfig.from_hf(cfg)
        for seq_len in seq_lens:
            expected, expected_scale = hf_inv_freq(cfg, seq_len)
            inv_freq, scale = rope.inv_frequencies(seq_len)
            message = f"{name} seq_len={seq_len}"
            torch.testing.assert_close(inv_freq, expected.double(), rtol=float32_rtol(cfg), atol=0.0, msg=message)
            assert scale == pytest.approx(expected_scale, rel=1e-6, abs=0.0), message


@pytest.mark.parametrize("kind", FAMILIES)
def test_matches_transformers_formulas_exactly(kind, float64_reference):
    for name, cfg, seq_lens in family(kind):
        rope = RopeConfig.from_hf(cfg)
        for seq_len in seq_lens:
            expected, expected_scale = hf_inv_freq(cfg, seq_len)
            assert expected.dtype == torch.float64
            # the reference's longrope builds its exponent with Tensor.float(), which stays float32
            rtol = 2e-6 if kind == "longrope" else 1e-12
            inv_freq, scale = rope.inv_frequencies(seq_len)
            message = f"{name} seq_len={seq_len}"
            torch.testing.assert_close(inv_freq, expected, rtol=rtol, atol=0.0, msg=message)
            assert scale == pytest.approx(expected_scale, rel=1e-14, abs=0.0), message


# -- the models' default rope (no scaling): compute_default_rope_parameters --------------------------


@pytest.mark.parametrize(
    "module, cls, cfg",
    [
        ("llama", "LlamaRotaryEmbedding", {"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 10000.0}),
        ("llama", "LlamaRotaryEmbedding", {"hidden_size": 2048, "num_attention_heads": 16, "head_dim": 64,
                                           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
        ("mistral", "MistralRotaryEmbedding", {"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 1e6}),
        ("qwen2", "Qwen2RotaryEmbedding", {"hidden_size": 3584, "num_attention_heads": 28, "rope_theta": 1e6}),
        ("gpt_neox", "GPTNeoXRotaryEmbedding", {"hidden_size": 6144, "num_attention_heads": 64, "rotary_pct": 0.25}),
        ("gpt_neox", "GPTNeoXRotaryEmbedding", {"hidden_size": 2560, "num_attention_heads": 32,
                                                "rotary_emb_base": 25000, "rotary_pct": 0.5}),
        ("phi3", "Phi3RotaryEmbedding", {"hidden_size": 3072, "num_attention_heads": 32, "partial_rotary_factor": 0.5}),
    ],
)
def test_matches_the_models_default_rope(module, cls, cfg):
    models = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    config = transformers.AutoConfig.for_model(module, **copy.deepcopy(cfg))
    expected, expected_scale = getattr(models, cls).compute_default_rope_parameters(config)
    for source in ({**cfg, "model_type": module}, config):
        inv_freq, scale = RopeConfig.from_hf(source).inv_frequencies()
        torch.testing.assert_close(inv_freq, expected.double(), rtol=2e-6, atol=0.0)
        assert scale == expected_scale == 1.0


def test_gpt_neox_config_defaults():
    config = GPTNeoXConfig(hidden_size=6144, num_attention_heads=64)
    rope = RopeConfig.from_hf(config)
    assert rope.rotary_dim == 24 and rope.head_dim == 96
    plain = {"model_type": "gpt_neox", "hidden_size": 6144, "num_attention_heads": 64, "max_position_embeddings": 2048}
    assert RopeConfig.from_hf(plain) == rope


# -- transformers' own snapshot values (tests/utils/test_modeling_rope_utils.py) ----------------------
# LlamaConfig() defaults: hidden 4096, 32 heads (head_dim 128), rope_theta 10000, max_position_embeddings 2048.
# The expected tensors are printed to 5 significant digits: compare to a relative 5.1e-5.

DEFAULT_SNAPSHOT = [
    1.0000e00, 8.6596e-01, 7.4989e-01, 6.4938e-01, 5.6234e-01, 4.8697e-01, 4.2170e-01, 3.6517e-01, 3.1623e-01,
    2.7384e-01, 2.3714e-01, 2.0535e-01, 1.7783e-01, 1.5399e-01, 1.3335e-01, 1.1548e-01, 1.0000e-01, 8.6596e-02,
    7.4989e-02, 6.4938e-02, 5.6234e-02, 4.8697e-02, 4.2170e-02, 3.6517e-02, 3.1623e-02, 2.7384e-02, 2.3714e-02,
    2.0535e-02, 1.7783e-02, 1.5399e-02, 1.3335e-02, 1.1548e-02, 1.0000e-02, 8.6596e-03, 7.4989e-03, 6.4938e-03,
    5.6234e-03, 4.8697e-03, 4.2170e-03, 3.6517e-03, 3.1623e-03, 2.7384e-03, 2.3714e-03, 2.0535e-03, 1.7783e-03,
    1.5399e-03, 1.3335e-03, 1.1548e-03, 1.0000e-03, 8.6596e-04, 7.4989e-04, 6.4938e-04, 5.6234e-04, 4.8697e-04,
    4.2170e-04, 3.6517e-04, 3.1623e-04, 2.7384e-04, 2.3714e-04, 2.0535e-04, 1.7783e-04, 1.5399e-04, 1.3335e-04,
    1.1548e-04,
]
DYNAMIC_SNAPSHOT = [  # factor 10, seq_len 16384
    1.0000e00, 8.0931e-01, 6.5498e-01, 5.3008e-01, 4.2900e-01, 3.4720e-01, 2.8099e-01, 2.2741e-01, 1.8404e-01,
    1.4895e-01, 1.2055e-01, 9.7558e-02, 7.8955e-02, 6.3899e-02, 5.1714e-02, 4.1853e-02, 3.3872e-02, 2.7413e-02,
    2.2185e-02, 1.7955e-02, 1.4531e-02, 1.1760e-02, 9.5176e-03, 7.7027e-03, 6.2339e-03, 5.0451e-03, 4.0831e-03,
    3.3045e-03, 2.6744e-03, 2.1644e-03, 1.7517e-03, 1.4176e-03, 1.1473e-03, 9.2852e-04, 7.5146e-04, 6.0817e-04,
    4.9220e-04, 3.9834e-04, 3.2238e-04, 2.6091e-04, 2.1115e-04, 1.7089e-04, 1.3830e-04, 1.1193e-04, 9.0585e-05,
    7.3312e-05, 5.9332e-05, 4.8018e-05, 3.8861e-05, 3.1451e-05, 2.5453e-05, 2.0600e-05, 1.6672e-05, 1.3492e-05,
    1.0920e-05, 8.8374e-06, 7.1522e-06, 5.7883e-06, 4.6845e-06, 3.7912e-06, 3.0683e-06, 2.4832e-06, 2.0097e-06,
    1.6265e-06,
]
YARN_SNAPSHOT = [  # factor 10, beta_fast 32, beta_slow 1, original length 2048
    1.0000e00, 8.6596e-01, 7.4989e-01, 6.4938e-01, 5.6234e-01, 4.8697e-01, 4.2170e-01, 3.6517e-01, 3.1623e-01,
    2.7384e-01, 2.3714e-01, 2.0535e-01, 1.7783e-01, 1.5399e-01, 1.3335e-01, 1.1548e-01, 1.0000e-01, 8.3479e-02,
    6.9590e-02, 5.7925e-02, 4.8136e-02, 3.9931e-02, 3.3061e-02, 2.7315e-02, 2.2515e-02, 1.8512e-02, 1.5177e-02,
    1.2403e-02, 1.0101e-02, 8.1924e-03, 6.6143e-03, 5.3120e-03, 4.2400e-03, 3.3599e-03, 2.6396e-03, 2.0520e-03,
    1.5746e-03, 1.1882e-03, 8.7713e-04, 6.2810e-04, 4.3007e-04, 2.7384e-04, 2.3714e-04, 2.0535e-04, 1.7783e-04,
    1.5399e-04, 1.3335e-04, 1.1548e-04, 1.0000e-04, 8.6596e-05, 7.4989e-05, 6.4938e-05, 5.6234e-05, 4.8697e-05,
    4.2170e-05, 3.6517e-05, 3.1623e-05, 2.7384e-05, 2.3714e-05, 2.0535e-05, 1.7783e-05, 1.5399e-05, 1.3335e-05,
    1.1548e-05,
]
LLAMA3_SNAPSHOT = [  # factor 10, low 1, high 4, original length 2048
    1.0000e00, 8.6596e-01, 7.4989e-01, 6.4938e-01, 5.6234e-01, 4.8697e-01, 4.2170e-01, 3.6517e-01, 3.1623e-01,
    2.7384e-01, 2.3714e-01, 2.0535e-01, 1.7783e-01, 1.5399e-01, 1.3335e-01, 1.1548e-01, 1.0000e-01, 8.6596e-02,
    7.4989e-02, 6.4938e-02, 5.6234e-02, 4.8697e-02, 4.2170e-02, 3.6517e-02, 3.1623e-02, 2.7384e-02, 2.3714e-02,
    2.0535e-02, 1.7783e-02, 1.5399e-02, 1.3335e-02, 1.0730e-02, 7.7785e-03, 5.6009e-03, 3.9991e-03, 2.8248e-03,
    1.9675e-03, 1.3449e-03, 8.9549e-04, 5.7363e-04, 3.4539e-04, 2.7384e-04, 2.3714e-04, 2.0535e-04, 1.7783e-04,
    1.5399e-04, 1.3335e-04, 1.1548e-04, 1.0000e-04, 8.6596e-05, 7.4989e-05, 6.4938e-05, 5.6234e-05, 4.8697e-05,
    4.2170e-05, 3.6517e-05, 3.1623e-05, 2.7384e-05, 2.3714e-05, 2.0535e-05, 1.7783e-05, 1.5399e-05, 1.3335e-05,
    1.1548e-05,
]
SNAPSHOT_CONFIG = {"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 10000.0,
                   "max_position_embeddings": 2048}


def snapshot(values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize(
    "rope_scaling, seq_len, expected",
    [
        (None, None, DEFAULT_SNAPSHOT),
        ({"rope_type": "dynamic", "factor": 10.0}, 16384, DYNAMIC_SNAPSHOT),
        ({"rope_type": "yarn", "factor": 10.0, "beta_fast": 32, "beta_slow": 1}, None, YARN_SNAPSHOT),
        ({"rope_type": "llama3", "factor": 10.0, "original_max_position_embeddings": 2048, "low_freq_factor": 1,
          "high_freq_factor": 4}, None, LLAMA3_SNAPSHOT),
    ],
)
def test_transformers_snapshots(rope_scaling, seq_len, expected):
    inv_freq, _ = RopeConfig.from_hf({**SNAPSHOT_CONFIG, "rope_scaling": rope_scaling}).inv_frequencies(seq_len)
    torch.testing.assert_close(inv_freq, snapshot(expected), rtol=5.1e-5, atol=0.0)


def test_transformers_snapshot_properties():
    default = snapshot(DEFAULT_SNAPSHOT)
    exact_default = RopeConfig.from_hf(SNAPSHOT_CONFIG).inv_frequencies()[0]

    def read(params, seq_len=None):
        return RopeConfig.from_hf({**SNAPSHOT_CONFIG, "rope_scaling": params}).inv_frequencies(seq_len)

    for factor in (2.0, 10.0, 20.0):
        inv_freq, scale = read({"rope_type": "linear", "factor": factor})
        torch.testing.assert_close(inv_freq, exact_default / factor, rtol=1e-15, atol=0.0)
        for seq_len in (None, 1):  # dynamic: no change up to max_position_embeddings
            inv_freq, scale = read({"rope_type": "dynamic", "factor": factor}, seq_len)
            torch.testing.assert_close(inv_freq, default, rtol=5.1e-5, atol=0.0)
            assert scale == 1.0
        assert read({"rope_type": "yarn", "factor": factor})[1] == 0.1 * math.log(factor) + 1.0
        assert read({"rope_type": "yarn", "factor": factor, "attention_factor": 0.5}, 1)[1] == 0.5
    dynamic = read({"rope_type": "dynamic", "factor": 10.0}, 16384)[0]
    assert not torch.allclose(dynamic, exact_default / 10.0)  # it is NOT a linear factor
    # yarn: bounded by PI and plain RoPE; huge beta_fast interpolates everything but the first pair
    inv_freq = read({"rope_type": "yarn", "factor": 10.0, "beta_fast": 32, "beta_slow": 1})[0]
    assert bool(((inv_freq >= exact_default / 10 - 1e-8) & (inv_freq <= exact_default + 1e-8)).all())
    inv_freq = read({"rope_type": "yarn", "factor": 10.0, "beta_fast": 1000, "beta_slow": 1})[0]
    assert inv_freq[0] == exact_default[0] and bool((inv_freq[1:] < exact_default[1:]).all())
    torch.testing.assert_close(inv_freq[-20:], exact_default[-20:] / 10, rtol=1e-14, atol=0.0)
    # longrope: the documented attention factor; short factor below the original length
    half = 64
    short, long = [2.0] * half, torch.ones(half).cumsum(0).tolist()
    for factor in (2.0, 10.0, 20.0):
        params = {"rope_type": "longrope", "factor": factor, "short_factor": short, "long_factor": long}
        assert read(params)[1] == math.sqrt(1 + math.log(factor) / math.log(2048))
        assert read({**params, "attention_factor": 0.5}, 1)[1] == 0.5
        torch.testing.assert_close(read(params)[0], exact_default / 2.0, rtol=1e-15, atol=0.0)
        torch.testing.assert_close(read(params, 2049)[0], exact_default / torch.tensor(long, dtype=torch.float64),
                                   rtol=1e-15, atol=0.0)
    # llama3: bounded by the factor; a huge high_freq_factor scales every frequency
    llama3 = {"rope_type": "llama3", "factor": 10.0, "original_max_position_embeddings": 2048,
              "low_freq_factor": 1, "high_freq_factor": 4}
    for factor in (2.0, 10.0, 20.0):
        assert read({**llama3, "factor": factor})[1] == 1.0
    inv_freq = read(llama3)[0]
    assert bool(((inv_freq >= exact_default / 10) & (inv_freq <= exact_default)).all())
    inv_freq = read({**llama3, "high_freq_factor": 1000})[0]
    assert bool((inv_freq < exact_default).all())


def test_nested_yarn_truncate_is_honoured():
    """transformers reads ``truncate`` from the top of ``rope_parameters``, so a per-layer-type
    ``truncate: false`` is lost there; ropekit reads it where it is, like the flat config does."""
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "truncate": False,
            "rope_theta": 150000.0}
    nested = {"hidden_size": 512, "num_attention_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
              "layer_types": ["sliding_attention", "full_attention"],
              "rope_parameters": {"full_attention": dict(yarn),
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    flat = {**{k: v for k, v in nested.items() if k not in ("layer_types", "rope_parameters")},
            "rope_parameters": dict(yarn)}
    expected, scale = hf_inv_freq(flat, None)
    inv_freq, ours = RopeConfig.from_hf(nested, layer_type="full_attention").inv_frequencies()
    torch.testing.assert_close(inv_freq, expected.double(), rtol=2e-6, atol=0.0)
    assert ours == pytest.approx(scale, rel=1e-6)
