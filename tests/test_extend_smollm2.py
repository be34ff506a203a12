"""``ropekit extend`` on a real pretrained model: SmolLM2-135M-Instruct (the ``--example``) at a short length.

The lengths are far below the model's trained 8192 (``--context 256 --to 512``): the test checks
the machinery on real weights and a real tokenizer, not the extension itself (docs/extend.md has the
measured 16k run). The oracle is transformers' own forward of the unpatched model.
Skipped only when the package index is unreachable and the model is not cached.
"""

import json
import math

import pytest
import torch
import transformers

from probe_helpers import example_model
from ropekit import RopeConfig
from ropekit.cli.entry import main
from ropekit_lab import extend as lab_extend
from ropekit_lab.extend_eval import evaluate_window, passkey_window
from ropekit_lab.extend_rules import candidate

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def example():
    return example_model()


def test_plain_rope_evaluation_equals_the_unpatched_model_on_real_text(example):
    text, _ = lab_extend.default_text()
    ids = lab_extend.text_ids_for(example.tokenizer, text, 400, "--text")
    window = passkey_window(example.tokenizer, ids, 384, 0.5, seed=0)
    own = RopeConfig.from_hf(example.model.config)
    result = evaluate_window(example.model, window, candidate("none", own, 8192, 16384).rope(own, 384),
                             example.tokenizer)
    with torch.no_grad():
        logits = example.model(window.ids).logits[0, :-1].double()
    want = torch.nn.functional.cross_entropy(logits, window.ids[0, 1:], reduction="none")
    keep = window.text_target
    torch.testing.assert_close(result.nll[keep], want[keep], rtol=1e-4, atol=1e-4)
    assert float(want[keep].mean()) < 4.0  # real English text for a real model: far below ln(49152) = 10.8


def test_the_cli_on_the_example_at_a_short_length_writes_a_config_transformers_runs(example, tmp_path, capsys):
    out, dst = tmp_path / "extend", tmp_path / "smollm2-extended"
    assert main(["extend", "--example", "--context", "256", "--to", "512", "--rules", "yarn,linear", "--texts", "1",
                 "--json", "--no-progress", "--out", str(out), "--write-config", str(dst)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads((out / "extend.json").read_text())
    assert (doc["model"]["model_type"], doc["model"]["base"], doc["lengths"]["model_max_positions"]) == (
        "llama", 100000.0, 8192)
    assert [r["name"] for r in doc["rules"]] == ["none", "linear", "yarn"]
    for row in doc["rules"]:
        assert math.isfinite(row["trained"]["ppl"]) and math.isfinite(row["target"]["ppl"])
        assert row["passkey"]["total"] == 1 and len(row["passkey"]["trials"][0]["key"]) == 5
    # plain RoPE's slow pairs for L = 256 and base 1e5: the pairs i with 255 * 1e5^(-2i/64) < 2 pi
    slow = [i for i in range(32) if 255 * 1e5 ** (-2 * i / 64) < 2 * math.pi]
    assert doc["rules"][0]["pairs"]["beyond"] == slow
    model = transformers.AutoModelForCausalLM.from_pretrained(dst)
    assert RopeConfig.from_hf(model.config).scaling is not None or doc["choice"]["rule"] == "none"
    assert model.config.max_position_embeddings == doc["choice"]["max_position_embeddings"]
    for name, tensor in example.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_gguf_model_is_written_as_a_transformers_directory_with_the_rule(example, tmp_path, capsys):
    from ropekit_lab.smollm2 import smollm2_gguf

    gguf = smollm2_gguf()
    before = gguf.stat().st_mtime_ns, gguf.stat().st_size
    dst = tmp_path / "from-gguf"
    assert main(["extend", "--gguf", str(gguf), "--context", "128", "--to", "256", "--rules", "linear", "--texts",
                 "1", "--json", "--no-progress", "--out", str(tmp_path / "out"), "--write-config", str(dst)]) == 0
    doc = json.loads(capsys.readouterr().out)
    model = transformers.AutoModelForCausalLM.from_pretrained(dst)
    rope = RopeConfig.from_hf(model.config)
    chosen = doc["choice"]
    assert model.config.max_position_embeddings == chosen["max_position_embeddings"]
    want = candidate(chosen["rule"], RopeConfig.from_hf(example.model.config), 128, 256)
    torch.testing.assert_close(rope.inv_frequencies(256)[0], want.rope(rope, 256).inv_frequencies(256)[0])
    for name, tensor in example.model.state_dict().items():  # the GGUF's weights, as transformers reads them
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    assert (gguf.stat().st_mtime_ns, gguf.stat().st_size) == before
