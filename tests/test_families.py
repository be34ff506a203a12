"""One table of model families: the config layer and the transformers patch read views of its rows."""

from ropekit.config import families, multimodal, rope_config
from ropekit.integrations import transformers_norms as norms


def test_the_views_are_the_table_rows():
    assert rope_config.INTERLEAVED_MODEL_TYPES == {"deepseek_v2", "deepseek_v3", "llama4", "llama4_text", "gptj",
                                                   "codegen", "glm4v", "glm4v_text", "ernie4_5_vl_moe",
                                                   "ernie4_5_vl_moe_text"}
    assert multimodal.CONTIGUOUS_MROPE["qwen2_5_vl"] == (16, 24, 24)
    assert multimodal.INTERLEAVED_MROPE["qwen3_vl_moe_text"] == (24, 20, 20)
    assert norms.NORM_FORMS == {"Qwen3RMSNorm": 0.0, "Qwen3MoeRMSNorm": 0.0, "Olmo2RMSNorm": 0.0,
                                "Olmo3RMSNorm": 0.0, "Gemma3RMSNorm": 1.0}
    fusable = {"Qwen3Attention", "Qwen3MoeAttention", "Gemma3Attention", "Olmo2Attention", "Olmo3Attention"}
    assert norms.FUSABLE_ATTENTION == fusable
    assert norms.KEY_INTO_CACHE_ATTENTION == fusable | {"LlamaAttention", "MistralAttention", "Qwen2Attention"}


def test_a_model_type_belongs_to_one_family():
    seen = [t for f in families.FAMILIES for t in f.model_types]
    assert len(seen) == len(set(seen))


def test_the_lookups_read_the_rows(monkeypatch):
    row = families.Family("Spiral", ("spiral",), layout="interleaved")
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, row))
    assert "spiral" in families.model_types_where(layout="interleaved")
