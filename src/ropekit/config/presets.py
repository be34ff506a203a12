"""Named model configurations for ``ropekit inspect --preset`` and ``ropekit report --preset``.

Each preset is the RoPE-relevant part of a published ``config.json`` (values copied from the
model's Hugging Face repository, the same files as ``tests/fixtures/configs``), so
:meth:`ropekit.RopeConfig.from_hf` reads a preset exactly as it reads the real file.
"""

from __future__ import annotations

import copy
from typing import Any

# microsoft/Phi-3-mini-128k-instruct, rope_scaling (first release, type "su" = LongRoPE)
_PHI3_LONG = (
    1.0299999713897705, 1.0499999523162842, 1.0499999523162842, 1.0799999237060547, 1.2299998998641968,
    1.2299998998641968, 1.2999999523162842, 1.4499999284744263, 1.5999999046325684, 1.6499998569488525,
    1.8999998569488525, 2.859999895095825, 3.68999981880188, 5.419999599456787, 5.489999771118164,
    5.489999771118164, 9.09000015258789, 11.579999923706055, 15.65999984741211, 15.769999504089355,
    15.789999961853027, 18.360000610351562, 21.989999771118164, 23.079999923706055, 30.009998321533203,
    32.35000228881836, 32.590003967285156, 35.56000518798828, 39.95000457763672, 53.840003967285156,
    56.20000457763672, 57.95000457763672, 59.29000473022461, 59.77000427246094, 59.920005798339844,
    61.190006256103516, 61.96000671386719, 62.50000762939453, 63.3700065612793, 63.48000717163086,
    63.48000717163086, 63.66000747680664, 63.850006103515625, 64.08000946044922, 64.760009765625,
    64.80001068115234, 64.81001281738281, 64.81001281738281,
)
_PHI3_SHORT = (
    1.05, 1.05, 1.05, 1.1, 1.1, 1.1, 1.2500000000000002, 1.2500000000000002, 1.4000000000000004,
    1.4500000000000004, 1.5500000000000005, 1.8500000000000008, 1.9000000000000008, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.1000000000000005, 2.1000000000000005, 2.2,
    2.3499999999999996, 2.3499999999999996, 2.3499999999999996, 2.3499999999999996, 2.3999999999999995,
    2.3999999999999995, 2.6499999999999986, 2.6999999999999984, 2.8999999999999977, 2.9499999999999975,
    3.049999999999997, 3.049999999999997, 3.049999999999997,
)

PRESETS: dict[str, dict[str, Any]] = {
    "default": {  # RoFormer / Llama-style: the configuration ``ropekit report`` shows with no arguments
        "_name_or_path": "Llama-style RoPE, head_dim 128, base 10000, 4096 tokens (built-in default)",
        "model_type": "llama", "head_dim": 128, "hidden_size": 4096, "num_attention_heads": 32,
        "max_position_embeddings": 4096, "rope_theta": 10000.0,
    },
    "llama-2-7b": {
        "_name_or_path": "meta-llama/Llama-2-7b-hf",
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_scaling": None,
    },
    "codellama-7b": {
        "_name_or_path": "codellama/CodeLlama-7b-hf",
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 16384, "rope_theta": 1000000, "rope_scaling": None,
    },
    "llama-3.1-8b": {
        "_name_or_path": "meta-llama/Llama-3.1-8B",
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    "llama-3.2-1b": {
        "_name_or_path": "meta-llama/Llama-3.2-1B",
        "model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    "mistral-7b-v0.1": {
        "_name_or_path": "mistralai/Mistral-7B-v0.1",
        "model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rope_theta": 10000.0, "sliding_window": 4096,
    },
    "qwen2.5-7b-instruct": {
        "_name_or_path": "Qwen/Qwen2.5-7B-Instruct",
        "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rope_scaling": None,
    },
    "qwen2.5-7b-instruct-yarn": {
        "_name_or_path": "Qwen/Qwen2.5-7B-Instruct with the README's YaRN rope_scaling for 128K context",
        "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
    },
    "phi-3-mini-128k-instruct": {
        "_name_or_path": "microsoft/Phi-3-mini-128k-instruct",
        "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"long_factor": list(_PHI3_LONG), "short_factor": list(_PHI3_SHORT), "type": "su"},
    },
    "gpt-neox-20b": {
        "_name_or_path": "EleutherAI/gpt-neox-20b",
        "model_type": "gpt_neox", "hidden_size": 6144, "num_attention_heads": 64,
        "max_position_embeddings": 2048, "rotary_emb_base": 10000, "rotary_pct": 0.25,
    },
    "deepseek-v3": {
        "_name_or_path": "deepseek-ai/DeepSeek-V3",
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
    },
    "gpt-oss-20b": {
        "_name_or_path": "openai/gpt-oss-20b",
        "model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
    },
    # multi-axis RoPE: M-RoPE of the Qwen VL language models (tests/fixtures/multiaxis holds the full files)
    "qwen2-vl-7b-instruct": {
        "_name_or_path": "Qwen/Qwen2-VL-7B-Instruct",
        "model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    },
    "qwen2.5-vl-7b-instruct": {
        "_name_or_path": "Qwen/Qwen2.5-VL-7B-Instruct",
        "model_type": "qwen2_5_vl", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 128000, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    },
    "qwen3-vl-8b-instruct": {
        "_name_or_path": "Qwen/Qwen3-VL-8B-Instruct",
        "model_type": "qwen3_vl",
        "text_config": {
            "model_type": "qwen3_vl_text", "head_dim": 128, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 262144, "rope_theta": 5000000,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        },
    },
    # axial RoPE of vision generators (diffusers transformer/config.json)
    "flux.1-dev": {
        "_name_or_path": "black-forest-labs/FLUX.1-dev (transformer)",
        "_class_name": "FluxTransformer2DModel", "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56],
        "num_attention_heads": 24,
    },
    "wan2.1-t2v-1.3b": {
        "_name_or_path": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers (transformer)",
        "_class_name": "WanTransformer3DModel", "attention_head_dim": 128, "num_attention_heads": 12,
        "patch_size": [1, 2, 2], "rope_max_seq_len": 1024,
    },
}

#: Short names: the family name picks its most common member.
ALIASES = {
    "llama-2": "llama-2-7b",
    "codellama": "codellama-7b",
    "llama-3.1": "llama-3.1-8b",
    "llama-3.2": "llama-3.2-1b",
    "mistral": "mistral-7b-v0.1",
    "qwen2.5": "qwen2.5-7b-instruct",
    "qwen2.5-yarn": "qwen2.5-7b-instruct-yarn",
    "phi-3": "phi-3-mini-128k-instruct",
    "gpt-neox": "gpt-neox-20b",
    "deepseek": "deepseek-v3",
    "gpt-oss": "gpt-oss-20b",
    "qwen2-vl": "qwen2-vl-7b-instruct",
    "qwen2.5-vl": "qwen2.5-vl-7b-instruct",
    "qwen3-vl": "qwen3-vl-8b-instruct",
    "flux": "flux.1-dev",
    "wan": "wan2.1-t2v-1.3b",
}


def preset_names() -> list[str]:
    """Every preset name, then the aliases."""
    return [*PRESETS, *ALIASES]


def get_preset(name: str) -> dict[str, Any]:
    """A copy of the ``config.json`` dict of preset ``name`` (case-insensitive, ``_`` read as ``-``).

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    key = str(name).strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(preset_names())}")
    return copy.deepcopy(PRESETS[key])
