"""The one table of model families: what ropekit knows of each ``transformers`` architecture.

A row is data (class names as strings, nothing imported): the ``model_type`` values of the family,
its default pairing, its multi-axis position rule, and for the transformers patch its attention
class, the class of its q/k norms with their ``weight_offset`` (gains ``weight_offset + weight``)
whether its attention hands the rotated key straight to the cache, and how its config names the
layers without RoPE (NoPE). The config layer
(:mod:`.rope_config`, :mod:`.multimodal`, :mod:`.schedules`) and the patch (``integrations/transformers*``) read only
the views derived here; a new family is one row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: the family's name (for messages and docs).
        model_types: ``config.json`` ``model_type`` values of the family.
        layout: default pairing, ``"half"`` or ``"interleaved"`` (``rope_interleave`` overrides it).
        mrope: ``None`` (1-D RoPE), ``"contiguous"`` or ``"interleaved"`` M-RoPE sections, or
            ``"alternating"`` (ERNIE-4.5-VL: h and w alternate over the first pairs, t takes the last).
        mrope_section: the default ``mrope_section`` of an M-RoPE family.
        modeling_layout: the pairing transformers' own ``apply_rotary_pos_emb`` of the family rotates in
            (GLM-4V and ERNIE-4.5-VL rotate pairs ``(2i, 2i+1)``); ``patch(model)`` takes a config's
            layout without ``layout=`` only when it is this one.
        attention: the attention class name(s) the patch knows.
        norm: the class name of the q/k RMSNorm, ``None`` without q/k norms.
        norm_offset: the norm's ``weight_offset``.
        fusable: whether the attention's data flow (norm, view, transpose, rotation, cache update)
            was checked for the fused q/k norm + rotation.
        key_into_cache: whether the attention passes the rotated key straight to ``past_key_values.update``.
        nope_schedule: how the config gives the layers without RoPE (:mod:`.schedules`): ``"smollm3"``
            (``no_rope_layers``, else ``no_rope_layer_interval``), ``"llama4"`` (the same, an empty list
            meaning the interval, plus chunked attention and temperature tuning); ``None``: every layer rotates.
    """

    name: str
    model_types: tuple[str, ...] = ()
    layout: str = "half"
    mrope: str | None = None
    mrope_section: tuple[int, ...] | None = None
    modeling_layout: str = "half"
    attention: tuple[str, ...] = ()
    norm: str | None = None
    norm_offset: float = 0.0
    fusable: bool = False
    key_into_cache: bool = False
    nope_schedule: str | None = None


FAMILIES: tuple[Family, ...] = (
    Family("Llama", ("llama",), attention=("LlamaAttention",), key_into_cache=True),
    Family("Mistral", ("mistral",), attention=("MistralAttention",), key_into_cache=True),
    Family("Qwen2", ("qwen2",), attention=("Qwen2Attention",), key_into_cache=True),
    Family("Qwen3", ("qwen3",), attention=("Qwen3Attention",), norm="Qwen3RMSNorm", fusable=True,
           key_into_cache=True),
    Family("Qwen3-MoE", ("qwen3_moe",), attention=("Qwen3MoeAttention",), norm="Qwen3MoeRMSNorm", fusable=True,
           key_into_cache=True),
    Family("Gemma 3", ("gemma3", "gemma3_text"), attention=("Gemma3Attention",), norm="Gemma3RMSNorm",
           norm_offset=1.0, fusable=True, key_into_cache=True),
    Family("OLMo 2", ("olmo2",), attention=("Olmo2Attention",), norm="Olmo2RMSNorm", fusable=True,
           key_into_cache=True),
    Family("OLMo 3", ("olmo3",), attention=("Olmo3Attention",), norm="Olmo3RMSNorm", fusable=True,
           key_into_cache=True),
    Family("DeepSeek-V2/V3", ("deepseek_v2", "deepseek_v3"), layout="interleaved"),
    Family("Llama 4", ("llama4", "llama4_text"), layout="interleaved", attention=("Llama4TextAttention",),
           nope_schedule="llama4"),
    Family("GPT-J / CodeGen", ("gptj", "codegen"), layout="interleaved"),
    Family("Qwen2-VL / Qwen2.5-VL", ("qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text"),
           mrope="contiguous", mrope_section=(16, 24, 24)),
    Family("Qwen3-VL", ("qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text"),
           mrope="interleaved", mrope_section=(24, 20, 20)),
    Family("SmolLM3", ("smollm3",), attention=("SmolLM3Attention",), nope_schedule="smollm3"),
    Family("GLM-4.1V", ("glm4v", "glm4v_text"), layout="interleaved", modeling_layout="interleaved",
           mrope="contiguous", mrope_section=(8, 12, 12)),
    Family("GLM-4.5V", ("glm4v_moe", "glm4v_moe_text"), mrope="contiguous", mrope_section=(8, 12, 12)),
    Family("ERNIE-4.5-VL", ("ernie4_5_vl_moe", "ernie4_5_vl_moe_text"), layout="interleaved",
           modeling_layout="interleaved", mrope="alternating", mrope_section=(22, 22, 20)),
    Family("Qwen2.5-Omni", ("qwen2_5_omni", "qwen2_5_omni_thinker", "qwen2_5_omni_text", "qwen2_5_omni_talker"),
           mrope="contiguous", mrope_section=(16, 24, 24)),
)


def model_types_where(**match: object) -> frozenset[str]:
    """The ``model_type`` values of the families whose fields equal ``match``."""
    return frozenset(t for f in FAMILIES if all(getattr(f, k) == v for k, v in match.items()) for t in f.model_types)


def mrope_sections(kind: str) -> dict[str, tuple[int, ...]]:
    """``model_type -> default mrope_section`` of the families whose M-RoPE is ``kind`` (see :class:`Family`)."""
    return {t: f.mrope_section for f in FAMILIES if f.mrope == kind for t in f.model_types}


def attention_classes(**match: object) -> frozenset[str]:
    """The attention class names of the families whose fields equal ``match``."""
    return frozenset(a for f in FAMILIES if all(getattr(f, k) == v for k, v in match.items()) for a in f.attention)


def norm_offsets() -> dict[str, float]:
    """``q/k norm class name -> weight_offset`` of the families with q/k norms."""
    return {f.norm: f.norm_offset for f in FAMILIES if f.norm is not None}


def nope_schedules() -> dict[str, str]:
    """``model_type -> NoPE schedule convention`` (``"smollm3"`` or ``"llama4"``) of the families that have one."""
    return {t: f.nope_schedule for f in FAMILIES if f.nope_schedule is not None for t in f.model_types}


def modeling_layout(model_type: object) -> str:
    """The pairing transformers' own ``apply_rotary_pos_emb`` of ``model_type`` rotates in (``"half"`` if unknown)."""
    return next((f.modeling_layout for f in FAMILIES if model_type in f.model_types), "half")
