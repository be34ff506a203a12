"""What ``ropekit extend`` measures on one window of text: next-token loss by position, and a passkey.

A *window* is ``T`` token ids: real text with one passkey sentence hidden at a depth, ending in the
question (:func:`passkey_window`). One forward of the model, rotated by a candidate rule through
:func:`ropekit.integrations.transformers.patch`, gives both measurements (:func:`evaluate_window`):

- the loss of every text token (the passkey sentence, the question and the token after each
  insert are left out), from the last hidden states through the LM head in blocks of
  :data:`HEAD_BLOCK` positions: the ``T x vocab`` logits (6 GB at 32k tokens for a 49k vocabulary)
  never exist at once;
- the passkey: greedy decoding of :data:`ANSWER_TOKENS` tokens after the question, with the
  prefill's KV cache; exact match of the first run of digits with the key.

Bounded memory: the model runs with transformers' ``sdpa`` attention and no attention mask (a
causal batch of one), which PyTorch's CPU kernel computes in blocks (flash attention): memory grows
with ``T``, not ``T^2``. :func:`peak_rss_mb` reads the process's peak resident memory.
"""

from __future__ import annotations

import random
import re
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ropekit import RopeConfig
from ropekit.integrations.transformers import patch, unpatch

#: Positions sent through the LM head at once (a block of logits is HEAD_BLOCK x vocab float32).
HEAD_BLOCK = 1024
#: Tokens generated after the question; the window leaves room for them below the target length.
ANSWER_TOKENS = 8
#: Digits of a passkey.
KEY_DIGITS = 5
KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"


@dataclass
class Window:
    """One window: ``ids`` ``(1, P)`` int64 (``P = T - ANSWER_TOKENS``), which targets are text, the passkey.

    ``text_target``: bool ``(P - 1,)``, True where the token at position ``j + 1`` is text and so is
    the one before it; ``depth``: where the key sentence starts, as a share of ``P``.
    """

    ids: torch.Tensor
    text_target: torch.Tensor
    key: str
    depth: float
    key_position: int
    n_text: int


def passkey_window(tokenizer: Any, text_ids: torch.Tensor, target: int, depth: float, seed: int) -> Window:
    """A window of ``target`` tokens: text with the key sentence at ``depth``, then the question.

    ``text_ids``: ``(n,)`` int64, at least the text tokens the window needs (more are ignored).
    The key is :data:`KEY_DIGITS` random digits from ``seed`` (first digit not zero).
    """
    rng = random.Random(seed)
    key = str(rng.randint(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS - 1))
    sentence = _ids(tokenizer, KEY_SENTENCE.format(key=key))
    question = _ids(tokenizer, QUESTION)
    length = target - ANSWER_TOKENS
    n_text = length - len(sentence) - len(question)
    if n_text < 2:
        raise ValueError(f"--to {target}: too short for a passkey window ({len(sentence) + len(question)} tokens of "
                         f"key sentence and question, {ANSWER_TOKENS} of answer)")
    if text_ids.numel() < n_text:
        raise ValueError(f"the text gives {text_ids.numel()} tokens; a window of {target} needs {n_text}")
    at = min(max(1, round(depth * length)), n_text - 1)
    text = text_ids[:n_text].to(torch.int64)
    parts = [text[:at], sentence, text[at:], question]
    ids = torch.cat(parts)[None]
    is_text = torch.cat([torch.ones(at, dtype=torch.bool), torch.zeros(len(sentence), dtype=torch.bool),
                         torch.ones(n_text - at, dtype=torch.bool), torch.zeros(len(question), dtype=torch.bool)])
    return Window(ids, is_text[1:] & is_text[:-1], key, at / length, at, n_text)


def _ids(tokenizer: Any, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0].to(torch.int64)


def head_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Logits (float32 ``(..., vocab)``) of final hidden states, as the model's forward computes them.

    The output embedding, then the families' extras: Gemma's ``final_logit_softcapping``, Cohere's
    ``logit_scale``.
    """
    logits = model.get_output_embeddings()(hidden).float()
    config = model.config
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def blockwise_nll(model: Any, hidden: torch.Tensor, targets: torch.Tensor, block: int = HEAD_BLOCK) -> torch.Tensor:
    """Next-token NLL in nats, float64 ``(n,)``: ``hidden`` ``(n, width)`` predicts ``targets`` ``(n,)``.

    The LM head runs on ``block`` positions at a time, so that at most ``block x vocab`` logits exist.
    """
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} positions, targets {targets.shape[0]}")
    out = torch.empty(targets.shape[0], dtype=torch.float64)
    for start in range(0, targets.shape[0], block):
        stop = min(start + block, targets.shape[0])
        logits = head_logits(model, hidden[start:stop])
        out[start:stop] = F.cross_entropy(logits, targets[start:stop], reduction="none").to(torch.float64)
    return out


def backbone(model: Any) -> Any:
    """The decoder stack whose output is the final hidden states (``model.model`` for the supported families)."""
    inner = getattr(model, "model", None) or getattr(model, "gpt_neox", None)
    if inner is None:
        raise ValueError(f"{type(model).__name__}: no decoder stack (model.model) to run")
    return inner


def layer_modules(model: Any) -> list[Any]:
    """The decoder layers, for the progress bar."""
    inner = backbone(model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = getattr(getattr(inner, "language_model", None), "layers", [])
    return list(layers)


@dataclass
class WindowResult:
    """What one forward measured: per-target NLL (NaN where not text), the answer, wall and CPU seconds."""

    nll: torch.Tensor
    answer: str
    correct: bool
    seconds: float
    cpu_seconds: float = 0.0


def evaluate_window(model: Any, window: Window, rope: RopeConfig, tokenizer: Any, *,
                    on_layer: Any = None) -> WindowResult:
    """Run ``window`` once with ``model`` rotating by ``rope``; the text tokens' NLL and the passkey answer.

    ``nll``: float64 ``(P - 1,)``, NaN at targets that are not text (:attr:`Window.text_target`).
    ``on_layer``: called after each decoder layer of the prefill (a progress bar), or ``None``.
    """
    start, cpu = time.perf_counter(), time.process_time()
    hooks = []
    if on_layer is not None:
        hooks = [layer.register_forward_hook(lambda m, a, o: on_layer() if _prefill(a) else None)
                 for layer in layer_modules(model)]
    patch(model, rope=rope)
    try:
        with torch.no_grad():
            out = backbone(model)(input_ids=window.ids, use_cache=True)
            hidden = out.last_hidden_state[0]
            nll = blockwise_nll(model, hidden[:-1], window.ids[0, 1:])
            nll[~window.text_target] = float("nan")
            answer = greedy_answer(model, hidden[-1], out.past_key_values, window.ids.shape[1])
    finally:
        unpatch(model)
        for hook in hooks:
            hook.remove()
    text = tokenizer.decode(answer, skip_special_tokens=True)
    found = re.search(r"\d+", text)
    return WindowResult(nll, text, found is not None and found.group(0) == window.key, time.perf_counter() - start,
                        time.process_time() - cpu)


def _prefill(args: tuple) -> bool:
    hidden = args[0] if args else None
    return isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] > 1


def greedy_answer(model: Any, last_hidden: torch.Tensor, cache: Any, length: int) -> list[int]:
    """:data:`ANSWER_TOKENS` greedy tokens after a prefill of ``length`` tokens (its cache and last hidden state)."""
    tokens = []
    token = int(head_logits(model, last_hidden).argmax())
    eos = getattr(model.config, "eos_token_id", None)
    stop = set(eos if isinstance(eos, list) else [eos]) - {None}
    for step in range(ANSWER_TOKENS):
        tokens.append(token)
        if token in stop or step == ANSWER_TOKENS - 1:
            break
        position = torch.tensor([[length + step]])
        out = backbone(model)(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                              position_ids=position)
        cache = out.past_key_values
        token = int(head_logits(model, out.last_hidden_state[0, -1]).argmax())
    return tokens


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (``getrusage``; kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def bucket_edges(target: int, trained: int, buckets: int) -> list[int]:
    """Target-position edges of ``buckets`` equal buckets over ``[1, target)``; ``trained`` is always an edge.

    An equal edge closer to ``trained`` than a quarter of a bucket is moved onto it rather than kept
    beside it (at 4x, the equal edge falls at ``L + 1``: it would leave a bucket of one position).
    """
    width = (target - 1) / buckets
    inner = [round(1 + k * width) for k in range(1, buckets)]
    if 1 < trained < target:
        inner = [e for e in inner if abs(e - trained) >= width / 4] + [trained]
    return sorted({1, *inner, target})


def bucket_means(nll: torch.Tensor, edges: list[int]) -> list[tuple[float, int]]:
    """``(mean NLL, tokens)`` of the text targets whose position (``j + 1`` for entry ``j``) falls in each bucket."""
    out = []
    for low, high in zip(edges[:-1], edges[1:], strict=True):
        part = nll[low - 1:high - 1]
        part = part[~torch.isnan(part)]
        out.append((float(part.mean()) if part.numel() else float("nan"), int(part.numel())))
    return out


def load_attention(model: Any) -> str:
    """Switch ``model`` to transformers' ``sdpa`` attention where it can; the implementation in use."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter("sdpa")
        except (ValueError, ImportError):  # a family without sdpa: keep what it has
            pass
    return str(getattr(model.config, "_attn_implementation", "unknown"))
