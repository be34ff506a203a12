"""``ropekit convert`` on a directory written by ``save_pretrained``: the round trip loads with ``from_pretrained``.

A tiny random Llama (4 query / 2 key-value heads, random q/k biases) converted to interleaved and
back, with no flag but ``--to``: the geometry and the layout come from its ``config.json``, the
other files are carried (the config with a layout record in the interleaved output, see
tests/test_convert_load.py), and the round trip gives the original logits exactly.
"""

import json

import pytest
import torch
from safetensors import safe_open

from convert_helpers import run

transformers = pytest.importorskip("transformers")

from ropekit import RopeConfig  # noqa: E402
from ropekit.integrations.transformers import patch, unpatch  # noqa: E402
from ropekit.integrations.transformers_load import converted_config  # noqa: E402

torch.set_num_threads(1)

IDS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3))


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture
def saved(tmp_path):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                      max_position_embeddings=64, rope_theta=500.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias")):
                p.copy_(torch.randn(p.shape) * 0.1)  # biases start at 0, which no permutation changes
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    torch.save(model.state_dict(), tmp_path / "hf" / "pytorch_model.bin")  # the same weights in another format
    return tmp_path / "hf", logits(model)


def test_round_trip_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, saved, capsys):
    src, ref = saved
    assert run(src, tmp_path / "inter", "--to", "interleaved", "--verify") == 0
    out = capsys.readouterr().out
    assert "SRC layout half (config.json next to SRC)" in out and "not carried (weights): pytorch_model.bin" in out
    assert sorted(p.name for p in (tmp_path / "inter").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "inter" / name).read_bytes() == (src / name).read_bytes(), name
    assert json.loads((tmp_path / "inter" / "config.json").read_text())["rope_layout"] == "interleaved"
    with safe_open(str(tmp_path / "inter" / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["ropekit_layout"] == "interleaved"

    assert run(tmp_path / "inter", tmp_path / "back", "--to", "half", "--verify") == 0
    assert (tmp_path / "back" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert torch.equal(logits(back), ref)

    config, layout = converted_config(tmp_path / "inter")  # the original config, and the rows' layout
    inter = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "inter", config=config,
                                                          attn_implementation="eager").eval()
    assert not torch.allclose(logits(inter), ref, atol=1e-3)  # interleaved rows need interleaved RoPE
    own = RopeConfig.from_hf(inter.config)
    patch(inter, rope=RopeConfig(head_dim=own.head_dim, rotary_dim=own.rotary_dim, base=own.base, layout=layout))
    torch.testing.assert_close(logits(inter), ref, rtol=0, atol=1e-5)
    unpatch(inter)
