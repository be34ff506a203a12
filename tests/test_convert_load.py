"""A ``ropekit convert --to interleaved`` output that transformers would load must not compute wrong: it is refused.

Tiny random Llama and Qwen2 models (random q/k biases) saved with ``save_pretrained`` and converted
with nothing but ``--to``: plain ``from_pretrained`` of the interleaved output fails loudly, naming
the layout; the documented path (``load_converted``, or the original config + ``patch(layout=...)``)
gives the original model's logits within 1e-5 and its greedy tokens; converting back ``--to half``
gives the original ``config.json`` and a directory transformers loads as it is, with identical logits.
The oracle is the original model itself (transformers' own half-pair rotation of the original rows).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from convert_helpers import digest, llama_config, run, state

transformers = pytest.importorskip("transformers")

from model_compare import assert_logits_match  # noqa: E402
from probe_helpers import word_tokenizer  # noqa: E402
from ropekit import RopeConfig  # noqa: E402
from ropekit.config.layout_record import MARKED_KEYS, hf_layout, read_layout_record, with_layout_record  # noqa: E402
from ropekit.integrations.transformers import load_converted, patch, unpatch  # noqa: E402
from ropekit.integrations.transformers_load import converted_config  # noqa: E402
from test_docs import python_blocks  # noqa: E402

torch.set_num_threads(1)

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, intermediate_size=128,
              max_position_embeddings=256)
#: the families patch supports: config class, model class, extra config
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, attention_bias=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=2, partial_rotary_factor=0.5,
                                                   pad_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.25)),
}
DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def greedy(model):
    with torch.no_grad():
        return model.generate(IDS[:1, :8], max_new_tokens=8, do_sample=False, pad_token_id=0)


def save_tiny(directory, family):
    """A random ``family`` model with random q/k biases (a permutation moves them) saved with a tokenizer."""
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "query_key_value.bias")):
                p.copy_(torch.randn(p.shape) * 0.1)  # biases start at 0, which no permutation changes
    model.save_pretrained(directory)
    word_tokenizer(directory)
    return model


@pytest.fixture(params=["llama", "qwen2"])
def converted(request, tmp_path, capsys):
    """``(family, SRC, DST, original model, digest of SRC, printed output)``: SRC converted --to interleaved."""
    src, dst = tmp_path / "hf", tmp_path / "inter"
    model = save_tiny(src, request.param)
    before = digest(src)
    capsys.readouterr()
    assert run(src, dst, "--to", "interleaved", "--verify") == 0
    return request.param, src, dst, model, before, capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")  # the record sets both keys
def test_plain_from_pretrained_refuses_the_interleaved_output(converted):
    family, src, dst, model, _, out = converted
    assert f"load_converted({str(dst)!r})" in out and "records rope_layout interleaved" in out
    original = json.loads((src / "config.json").read_text())
    written = json.loads((dst / "config.json").read_text())
    assert written["rope_layout"] == "interleaved" and written["model_type"] == "ropekit_interleaved"
    assert written["ropekit"]["original"] == {key: original[key] for key in MARKED_KEYS if key in original}
    for key in set(original) - set(MARKED_KEYS):  # every other value is the original's
        assert written[key] == original[key], key
    with pytest.raises(ValueError, match="model type `ropekit_interleaved`"):
        transformers.AutoModelForCausalLM.from_pretrained(dst)
    with pytest.raises(ValueError, match="model type `ropekit_interleaved`"):
        transformers.AutoConfig.from_pretrained(dst)
    with pytest.raises(KeyError, match="ropekit_interleaved"):  # the class named: its rotary embedding refuses
        type(model).from_pretrained(dst)
    assert transformers.AutoTokenizer.from_pretrained(dst) is not None  # the tokenizer files still load


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_patched_family_refuses_a_recorded_config(family, tmp_path):
    """Through the Auto classes (model type) and through the model class named (rope type: its own error)."""
    model = save_tiny(tmp_path, family)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(with_layout_record(config, "interleaved")))
    with pytest.raises(ValueError, match="ropekit_interleaved"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(Exception, match="ropekit_interleaved"):  # KeyError, or Phi-3's own rope validation
        type(model).from_pretrained(tmp_path)


def test_the_documented_loading_path_computes_the_original_model(converted):
    family, src, dst, model, _, _ = converted
    ref, tokens = logits(model), greedy(model)
    loaded = load_converted(dst, attn_implementation="eager").eval()
    assert type(loaded) is type(model) and loaded.config.model_type == family
    assert_logits_match(logits(loaded), ref)
    assert torch.equal(greedy(loaded), tokens)
    unpatch(loaded)  # the same weights rotated in transformers' half layout: wrong, as the refusal says
    assert (logits(loaded) - ref).abs().max() > 1e-3

    config, layout = converted_config(dst)  # the explicit path: original config + patch(layout=...)
    own = transformers.AutoConfig.from_pretrained(src).to_dict()
    assert layout == "interleaved" and config.to_dict() == {**own, "_name_or_path": ""}
    explicit = type(model).from_pretrained(dst, config=config, attn_implementation="eager").eval()
    patch(explicit, layout="interleaved")
    assert_logits_match(logits(explicit), ref)
    unpatch(explicit)


def test_the_snippets_of_the_docs_run_as_written(converted):
    _, _, dst, model, _, _ = converted
    text = DOCS.read_text(encoding="utf-8")
    blocks = python_blocks(text[text.index("### Loading an interleaved output"):text.index("### Verification")])
    assert len(blocks) == 2
    for code in blocks:
        namespace: dict = {}
        exec(compile(code.replace("path/to/llama-interleaved", str(dst)), "docs/models.md", "exec"),  # noqa: S102
             namespace)
        assert_logits_match(logits(namespace["model"].eval()), logits(model))
        unpatch(namespace["model"])  # the modeling module gets its own apply_rotary_pos_emb back


def test_converting_back_to_half_gives_an_ordinary_checkpoint(converted, tmp_path, capsys):
    family, src, dst, model, before, _ = converted
    after_first = digest(dst)
    assert run(dst, tmp_path / "back", "--to", "half", "--verify") == 0
    assert "original transformers config again" in capsys.readouterr().out
    assert (tmp_path / "back" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert digest(src) == before and digest(dst) == after_first  # the inputs are never written
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == load_file(str(src / "model.safetensors")).keys()
    assert all(torch.equal(back[k], v) for k, v in load_file(str(src / "model.safetensors")).items())
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert torch.equal(logits(plain), logits(model)) and torch.equal(greedy(plain), greedy(model))
    ordinary = load_converted(tmp_path / "back", attn_implementation="eager").eval()  # loaded as it is, unpatched
    assert getattr(ordinary, "_ropekit_patch", None) is None and torch.equal(logits(ordinary), logits(model))


def test_a_bad_record_is_refused_and_nothing_is_written(converted, tmp_path):
    _, _, dst, _, _, _ = converted
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    config = json.loads((bad / "config.json").read_text())
    config["ropekit"] = {"original": {"hidden_size": 3}}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json.*'ropekit'"):
        run(bad, tmp_path / "out", "--to", "half")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="'ropekit'"):
        load_converted(bad)
    with pytest.raises(TypeError, match="config="):
        load_converted(dst, config=object())


def test_a_recorded_config_reads_as_the_original_in_the_recorded_layout():
    original = llama_config(rope_scaling={"rope_type": "linear", "factor": 2.0}, architectures=["LlamaForCausalLM"])
    recorded = with_layout_record(original, "interleaved")
    assert read_layout_record(recorded) == (original, "interleaved")
    assert with_layout_record(recorded, "half") == original  # back: the record goes
    own, again = RopeConfig.from_hf(original), RopeConfig.from_hf(recorded)
    assert own.layout == "half" and again.layout == "interleaved"
    assert (again.head_dim, again.rotary_dim, again.base, again.scaling) == (own.head_dim, own.rotary_dim,
                                                                            own.base, own.scaling)
    assert RopeConfig.from_hf(recorded, layout="half").layout == "half"


def test_half_rows_of_an_interleaved_family_get_a_record_too():
    """The same rule the other way: ``rope_interleave: true`` means transformers rotates interleaved pairs."""
    deepseek = llama_config(rope_interleave=True)
    assert hf_layout(deepseek) == "interleaved" and with_layout_record(deepseek, "interleaved") == deepseek
    recorded = with_layout_record(deepseek, "half")
    assert recorded["rope_layout"] == "half" and recorded["model_type"] == "ropekit_half"
    assert read_layout_record(recorded) == (deepseek, "half")


def test_a_recorded_config_alone_tells_the_layout(tmp_path, capsys):
    """Without ropekit metadata in the weights, the config's record says which layout the rows are in."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file(state(), str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(with_layout_record(llama_config(), "interleaved")))
    with pytest.raises(ValueError, match=r"already in the interleaved layout \(config.json next to SRC\)"):
        run(src, tmp_path / "again", "--to", "interleaved")
    assert run(src, tmp_path / "back", "--to", "half") == 0
    assert "SRC layout interleaved (config.json next to SRC)" in capsys.readouterr().out
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == llama_config()


def test_single_file_output_says_how_to_rotate_it(tmp_path, capsys):
    from safetensors.torch import save_file

    save_file(state(), str(tmp_path / "m.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(llama_config()))
    assert run(tmp_path / "m.safetensors", tmp_path / "o.safetensors", "--to", "interleaved") == 0
    assert "patch(model, layout='interleaved')" in capsys.readouterr().out


def test_patch_layout_is_checked(tmp_path):
    model = save_tiny(tmp_path, "llama")
    with pytest.raises(ValueError, match="layout"):
        patch(model, layout="diagonal")
    assert getattr(model, "_ropekit_patch", None) is None
