"""The pairing detector on trained models: SmolLM2 in both row orders, and tiny char-LMs trained in each layout.

SmolLM2-135M: transformers' rows (un-permuted to half when it loads the GGUF) and the rows the GGUF
file stores (llama.cpp's interleaved order), read from the file with ``gguf``. The char-LMs
(ropekit_lab.charlm) are trained here for 150 steps, one per layout; the loss under each
layout confirms what the weights say. ``ropekit convert`` refuses, on both models, the
conversion that would scramble them.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe_helpers import example_model
from ropekit import RopeConfig, detect_layout, permute_qk_weight
from ropekit.checkpoints import detect_checkpoint_layout
from ropekit.cli.entry import main
from ropekit.nn import RotaryEmbedding
from ropekit_lab.charlm import CharLM, CharLMConfig, load_corpus

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def smollm2():
    return example_model().model


@pytest.fixture(scope="module")
def file_rows(smollm2):
    from ropekit_lab.smollm2 import smollm2_gguf
    from ropekit_lab.smollm2_cache import gguf_qk_rows

    return gguf_qk_rows(smollm2_gguf())  # from the .gguf itself, not the cache


def hf_projections(model):
    att = [layer.self_attn for layer in model.model.layers]
    return [(a.q_proj.weight.detach(), 9) for a in att] + [(a.k_proj.weight.detach(), 3) for a in att]


def test_smollm2_rows_read_half_and_the_files_rows_read_interleaved(smollm2, file_rows):
    half = detect_layout(hf_projections(smollm2), head_dim=64)
    assert half.layout == "half" and half.z > 15 and half.votes > 0.9 and half.heads == 360
    roles = (("q", 9), ("k", 3))
    gguf = [(file_rows[f"blk.{i}.attn_{role}.weight"], heads) for i in range(30) for role, heads in roles]
    interleaved = detect_layout(gguf, head_dim=64)
    assert interleaved.layout == "interleaved" and interleaved.z < -15 and interleaved.votes > 0.9
    for role, heads in roles:  # the same rows, in another order
        w = getattr(smollm2.model.layers[7].self_attn, f"{role}_proj").weight.detach()
        assert torch.equal(permute_qk_weight(w, heads, src="half", dst="interleaved"),
                           file_rows[f"blk.7.attn_{role}.weight"])


def test_convert_refuses_to_scramble_smollm2(smollm2, tmp_path, capsys):
    """SmolLM2's q/k dumped with its config: --to half is refused twice over, --to interleaved gives the file's rows."""
    names = {}
    for i, layer in enumerate(smollm2.model.layers):
        for role in "qk":
            names[f"model.layers.{i}.self_attn.{role}_proj.weight"] = getattr(layer.self_attn, f"{role}_proj").weight
    src = tmp_path / "hf"
    src.mkdir()
    save_file({k: v.detach().contiguous() for k, v in names.items()}, str(src / "model.safetensors"))
    config = smollm2.config.to_dict()
    config.pop("quantization_config", None)
    (src / "config.json").write_text(json.dumps(config))
    assert main(["convert", str(src), str(tmp_path / "back"), "--to", "half"]) == 2
    err = capsys.readouterr().err
    assert "already in the half layout" in err and "the q/k weights look half (z = +" in err
    assert main(["convert", str(src), str(tmp_path / "gguf-order"), "--to", "interleaved"]) == 0
    assert "q/k weights: half (z = +" in capsys.readouterr().out
    assert detect_checkpoint_layout(tmp_path / "gguf-order").layout == "interleaved"
    assert main(["convert", str(tmp_path / "gguf-order"), str(tmp_path / "again"), "--to", "interleaved"]) == 2
    assert "already in the interleaved layout (the ropekit metadata of SRC)" in capsys.readouterr().err


def train_char_lm(encoding: str, steps: int = 150, seed: int = 0):
    corpus = load_corpus(max_chars=200_000)
    torch.manual_seed(seed)
    model = CharLM(CharLMConfig(vocab_size=len(corpus.vocab), encoding=encoding, dim=64, layers=2, heads=4,
                                context=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, corpus.train.numel() - 65, (16,), generator=g).tolist()
        loss = model.loss(torch.stack([corpus.train[s:s + 65] for s in starts]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), corpus


@pytest.fixture(scope="module", params=["rope", "rope-interleaved"])
def char_lm(request):
    return request.param, *train_char_lm(request.param)


def val_loss(model, corpus, layout):
    for block in model.blocks:
        block.attn.rope = RotaryEmbedding(16, base=10000.0, layout=layout)
    windows = corpus.val[: 64 * 65].reshape(64, 65)
    with torch.no_grad():
        return float(model.loss(windows))


def test_tiny_char_lms_are_detected_and_the_loss_agrees(char_lm):
    encoding, model, corpus = char_lm
    trained = "interleaved" if encoding == "rope-interleaved" else "half"
    other = "half" if trained == "interleaved" else "interleaved"
    projections = [(getattr(b.attn, f"{role}_proj").weight.detach(), 4) for b in model.blocks for role in "qk"]
    evidence = detect_layout(projections, head_dim=16)
    assert evidence.layout == trained and abs(evidence.z) >= 3 and evidence.heads == 16, evidence
    assert val_loss(model, corpus, trained) + 0.3 < val_loss(model, corpus, other)
    assert RopeConfig(16, layout=trained).layout == trained


def test_convert_refuses_a_char_lm_already_in_the_target_layout(char_lm, tmp_path, capsys):
    encoding, model, _ = char_lm
    trained = "interleaved" if encoding == "rope-interleaved" else "half"
    other = "half" if trained == "interleaved" else "interleaved"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors"))
    # the user believes the file is in the other layout and asks for the one it is in: refused
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "x.safetensors"), "--heads", "4",
                 "--from", other, "--to", trained]) == 2
    assert f"already look {trained}" in capsys.readouterr().err and not (tmp_path / "x.safetensors").exists()
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "y.safetensors"), "--heads", "4",
                 "--from", trained, "--to", other]) == 0
    out = load_file(str(tmp_path / "y.safetensors"))
    q = out["blocks.0.attn.q_proj.weight"]
    assert torch.equal(q, permute_qk_weight(model.state_dict()["blocks.0.attn.q_proj.weight"], 4, src=trained,
                                            dst=other))
