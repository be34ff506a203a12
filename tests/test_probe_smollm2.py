"""``ropekit probe`` on a real pretrained model: SmolLM2-135M-Instruct (the ``--example``).

The statistics of the probe's run equal an independent computation from the model's own q and k
(transformers' rotation and eager attention, tests/probe_helpers.py); the pairing comes out half
for transformers' rows and interleaved for the rows the GGUF file stores, and the loss agrees.
Skipped only when the package index is unreachable and the model is not cached.
"""

import json

import pytest
import torch

from probe_helpers import PROMPT, direct_statistics, example_model
from ropekit.cli.entry import main
from ropekit_lab import probe as lab_probe

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
PAIRS, LAYERS, HEADS, KV = 32, 30, 9, 3


@pytest.fixture(scope="module")
def example():
    return example_model()


@pytest.fixture(scope="module")
def run(example):
    ids = lab_probe.encode(example.tokenizer, PROMPT, 256, "--prompt")
    document = lab_probe.probe(example, ids, text=lab_probe.text_record(PROMPT, "--prompt"), quick=True,
                               progress=False)
    return ids, document


def test_the_cli_on_the_example_with_a_short_prompt_writes_the_stated_keys(example, tmp_path, capsys):
    out = tmp_path / "probe"
    assert main(["probe", "--example", "--prompt", PROMPT, "--quick", "--json", "--no-progress", "--out",
                 str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads((out / "probe.json").read_text())
    assert {"schema", "model", "text", "rope", "pairing", "heads", "positional_heads", "summary", "claims",
            "figures", "versions", "seconds"} <= set(doc)
    assert (doc["model"]["model_type"], doc["model"]["layers"], doc["model"]["heads"], doc["model"]["kv_heads"],
            doc["model"]["head_dim"], doc["model"]["base"]) == ("llama", LAYERS, HEADS, KV, 64, 100000.0)
    n = doc["text"]["tokens"]
    heads = doc["heads"]
    assert torch.tensor(heads["q_pair_norm"]).shape == (LAYERS, HEADS, PAIRS)
    assert torch.tensor(heads["k_pair_norm"]).shape == (LAYERS, KV, PAIRS)
    assert torch.tensor(heads["attention_by_distance"]).shape == (LAYERS, HEADS, n - 1)
    for key in ("q_slow_energy_share", "diagonal", "previous_token", "sink", "fast_share_prev_logit"):
        assert torch.tensor(heads[key]).shape == (LAYERS, HEADS if key[0] != "k" else KV), key
    assert len(doc["rope"]["wavelength"]) == PAIRS and doc["rope"]["slow_pairs"] == list(range(PAIRS - len(
        doc["rope"]["slow_pairs"]), PAIRS))  # the slow pairs are the last ones
    assert isinstance(doc["claims"][0]["holds"], bool) and doc["claims"][2]["holds"] is None  # --quick: no p-RoPE
    for name in doc["figures"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pairing_half_rows_interleaved_file_and_the_loss_agrees(run):
    pairing = run[1]["pairing"]
    weights, file_rows, loss = pairing["weights"], pairing["file_rows"], pairing["loss"]
    assert weights["layout"] == "half" and weights["z"] > 10 and weights["votes"] > 0.85 and weights["heads"] == 360
    assert file_rows["layout"] == "interleaved" and file_rows["z"] < -10 and file_rows["votes"] > 0.85
    assert loss["winner"] == pairing["layout"] == pairing["config_layout"] == "half" and pairing["agree"] is True
    assert loss["interleaved"] > loss["half"] + 1 and loss["win_fraction"] > 0.7 and loss["z"] > 3
    assert pairing["confidence"] == weights["votes"]


@pytest.mark.parametrize("layer", [0, 11, 16, 29])
def test_one_layer_equals_a_direct_computation_from_the_models_own_q_and_k(example, run, layer):
    ids, document = run
    direct = direct_statistics(example.model, ids, layer)
    for key in ("q_pair_norm", "k_pair_norm", "attention_by_distance", "sink"):
        got = torch.tensor(document["heads"][key][layer], dtype=torch.float64)
        torch.testing.assert_close(got, direct[key], rtol=1e-4, atol=1e-5, msg=f"layer {layer} {key}")


def test_slow_pairs_and_energy_share_follow_their_definitions(run):
    ids, document = run
    n = ids.shape[1]
    inv_freq = torch.tensor(document["rope"]["inv_freq"], dtype=torch.float64)
    slow = (inv_freq * (n - 1) < 2 * torch.pi).nonzero().flatten().tolist()
    assert document["rope"]["slow_pairs"] == slow and document["summary"]["slow_pairs"] == len(slow)
    summary = document["summary"]
    share = torch.tensor(document["heads"]["q_slow_energy_share"])
    assert summary["slow_energy_share_q"]["mean"] == pytest.approx(float(share.mean()), rel=1e-5)


def test_gguf_file_transformers_rows_half_the_files_rows_interleaved(example, tmp_path, capsys):
    """``--gguf``: transformers loads (and un-permutes) the file; the probe reads the file's own rows too."""
    from ropekit_lab.smollm2 import smollm2_gguf

    assert main(["probe", "--gguf", str(smollm2_gguf()), "--prompt", PROMPT, "--quick", "--json", "--no-progress",
                 "--out", str(tmp_path / "gguf")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["source"] == "gguf" and doc["pairing"]["layout"] == "half"
    assert doc["pairing"]["weights"]["layout"] == "half" and doc["pairing"]["file_rows"]["layout"] == "interleaved"
