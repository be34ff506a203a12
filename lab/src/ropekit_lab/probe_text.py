"""The text ``ropekit probe`` reads: ``--prompt``, ``--text FILE`` or a default passage of the lab's KJV corpus."""

from __future__ import annotations

import codecs
import hashlib
import os
import stat
from typing import Any

import torch

#: The most bytes of ``--text FILE`` read: far more than the probe's tokens need (it keeps 32
#: characters per token at most).
MAX_TEXT_BYTES = 16 * 1024 * 1024


def default_text() -> tuple[str, str]:
    """``(text, label)``: the held-out chapters of the lab's KJV split (:mod:`ropekit_lab.charlm`), in order."""
    from .charlm import fetch_kjv, read_verses, split_verses

    _, val = split_verses(read_verses(fetch_kjv()))
    return val, "KJV, the held-out chapters of the lab's split (every 20th chapter from Genesis 20 on)"


def encode(tokenizer: Any, text: str, limit: int, option: str) -> torch.Tensor:
    """The first ``limit`` token ids of ``text``, ``(1, N)`` int64; ``ValueError`` naming ``option`` below 3 tokens."""
    if not text.strip():
        raise ValueError(f"{option}: the text is empty")
    head = text[: 32 * limit]  # no token is 32 characters long on average: the cut never shortens the ids
    ids = tokenizer(head, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :limit]
    if ids.shape[1] < 3:
        raise ValueError(f"{option}: the text gives {ids.shape[1]} token(s); the probe needs at least 3")
    return ids.to(torch.int64)


def read_text(path: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of ``--text FILE``: at most its first ``max_bytes`` bytes (a character cut there is dropped).

    The probe reads its first few thousand tokens only, so a longer file is read in part, never
    whole. ``ValueError`` naming the option for a missing, unreadable, binary or non-regular file
    (a FIFO would block forever, ``/dev/zero`` never ends).
    """
    try:
        # O_NONBLOCK: opening a FIFO no one writes would block; its mode is checked on the open file
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(descriptor, "rb") as handle:
            mode = os.fstat(descriptor).st_mode
            if stat.S_ISDIR(mode):
                raise ValueError(f"--text {path!r}: a directory, not a text file")
            if not stat.S_ISREG(mode):
                raise ValueError(f"--text {path!r}: not a regular file (a device, FIFO or socket); expected a text "
                                 "file")
            os.set_blocking(descriptor, True)
            data = handle.read(max_bytes + 1)
    except FileNotFoundError:
        raise ValueError(f"--text {path!r}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"--text {path!r}: a directory, not a text file") from None
    except OSError as exc:
        raise ValueError(f"--text {path!r}: cannot read it ({exc.strerror or exc})") from None
    cut = len(data) > max_bytes
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        return decoder.decode(data[:max_bytes], final=not cut)  # a cut inside a character leaves it undecoded
    except UnicodeDecodeError as exc:
        raise ValueError(f"--text {path!r}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def text_record(text: str, label: str) -> dict[str, Any]:
    """The ``text`` section of the document (source, SHA-256 of the UTF-8 text, a preview)."""
    return {"source": label, "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "preview": " ".join(text.split())[:160]}
