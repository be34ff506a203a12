"""The models ``ropekit probe`` runs: a transformers directory, a GGUF file, or the SmolLM2 example.

Every source is checked before its weights are loaded: the directory or file exists, transformers
reads its config, ropekit reads its RoPE, the config agrees with the weights' names and shapes
(read from the file headers, :mod:`ropekit_lab.probe_inputs`: the layer count before anything is
built), and the model family is one :func:`ropekit.integrations.transformers.patch` supports
(checked on a copy built on the ``meta`` device: no memory, no time). What transformers refuses,
including a crafted config it trips over (a zero head count, a negative size), becomes one
``ValueError`` naming the option, so the command line prints one line.
Remote code is never run: every transformers call passes ``trust_remote_code=False``, and a
folder that needs its own code is refused before loading (:mod:`ropekit_lab.remote_code`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ropekit import RopeConfig
from ropekit.integrations.transformers import patchable_modules

from .probe_inputs import check_gguf_layer_count, check_layer_count, check_shapes, directory_shapes, gguf_summary
from .remote_code import NO_REMOTE_CODE, refuse_remote_code

# what transformers raises on a config or file it cannot use; a crafted config.json reaches the
# arithmetic (ZeroDivisionError, OverflowError) and torch (RuntimeError) too
_TRANSFORMERS_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, LookupError, OSError, TypeError, ImportError, AttributeError, ArithmeticError, RuntimeError)
try:  # transformers 5 configs are strict dataclasses: a field of the wrong type raises huggingface_hub's error
    from huggingface_hub.errors import StrictDataclassError

    _TRANSFORMERS_ERRORS += (StrictDataclassError,)
except ImportError:  # older huggingface_hub: no strict configs
    pass


@dataclass
class LoadedModel:
    """A model ready to probe.

    ``source``: ``"model"``, ``"gguf"`` or ``"example"``; ``path``: what was loaded;
    ``file_rows``: the q/k projections as a GGUF file stores them (``{"blk.{i}.attn_q.weight": ...}``)
    or ``None``; ``seconds``: load time.
    """

    model: Any
    tokenizer: Any
    source: str
    path: str
    file_rows: dict[str, torch.Tensor] | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """``exc``'s message on one line (its lines joined), at most ``limit`` characters."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = text or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_family(config: Any, option: str, shown: str) -> Any:
    """Build the model on the ``meta`` device, check that ``patch`` finds its modules; return that model."""
    import transformers

    try:
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(config, **NO_REMOTE_CODE)
    except _TRANSFORMERS_ERRORS as exc:
        raise ValueError(f"{option} {shown!r}: transformers has no causal LM for model_type "
                         f"{getattr(config, 'model_type', None)!r} ({_one_line(exc)})") from None
    try:
        patchable_modules(skeleton)
    except ValueError as exc:
        raise ValueError(f"{option} {shown!r}: model_type {config.model_type!r} is not a family ropekit patches: "
                         f"{exc}") from None
    return skeleton


def _load(location: Path, option: str, shown: str, shapes: dict[str, tuple[int, ...]] | None = None,
          **kwargs: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from ``location`` (a directory; ``gguf_file=`` in ``kwargs`` for a GGUF).

    ``shapes``: ``{tensor name: shape}`` of the weights, in transformers' names (from the safetensors
    headers), compared with the config before anything is built; ``None`` to skip that check.
    """
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(location, **kwargs, **NO_REMOTE_CODE)
    except _TRANSFORMERS_ERRORS as exc:
        raise ValueError(f"{option} {shown!r}: transformers cannot read its config ({_one_line(exc)})") from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:  # before its RoPE: the clearer message
        raise ValueError(f"{option} {shown!r}: transformers has no causal LM for model_type "
                         f"{getattr(config, 'model_type', None)!r}")
    try:
        RopeConfig.from_hf(config)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{option} {shown!r}: ropekit cannot read its RoPE: {exc}") from None
    if shapes is not None:
        check_layer_count(config, shapes, option, shown)
    skeleton = _check_family(config, option, shown)
    if shapes is not None:
        check_shapes(skeleton, shapes, option, shown)
    del skeleton
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(location, **kwargs, **NO_REMOTE_CODE)
    except _TRANSFORMERS_ERRORS as exc:
        raise ValueError(f"{option} {shown!r}: no tokenizer transformers can load ({_one_line(exc)})") from None
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # the probe draws its own bar; one line per step is noise
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **kwargs,
                                                                   **NO_REMOTE_CODE).eval()
    except _TRANSFORMERS_ERRORS as exc:
        raise ValueError(f"{option} {shown!r}: transformers cannot load the weights ({_one_line(exc)})") from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return model, tokenizer


def load_model_dir(path: str | Path, option: str = "--model") -> LoadedModel:
    """A transformers model directory (``config.json``, weights, tokenizer), float32, eval mode."""
    start = time.perf_counter()
    directory = Path(path)
    if not directory.exists():
        raise ValueError(f"{option} {str(path)!r}: no such directory")
    if not directory.is_dir():
        raise ValueError(f"{option} {str(path)!r}: not a directory (a transformers model directory with a "
                         "config.json; use --gguf for a .gguf file)")
    if not (directory / "config.json").is_file():
        raise ValueError(f"{option} {str(path)!r}: no config.json in it: not a transformers model directory")
    refuse_remote_code(directory, option, str(path))
    model, tokenizer = _load(directory, option, str(path), directory_shapes(directory, option, str(path)))
    return LoadedModel(model, tokenizer, "model", str(directory), seconds=time.perf_counter() - start)


def load_gguf(path: str | Path, option: str = "--gguf") -> LoadedModel:
    """A ``.gguf`` file through transformers (which un-permutes LLaMA-type q/k rows), and its own q/k rows.

    Needs the ``gguf`` and ``accelerate`` packages (``ropekit probe`` checks them before any work).
    """
    from .smollm2_cache import gguf_qk_rows

    start = time.perf_counter()
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{option} {str(path)!r}: no such file")
    with open(file, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ValueError(f"{option} {str(path)!r}: not a GGUF file (it does not start with b'GGUF')")
    metadata, shapes = gguf_summary(file, option, str(path))
    check_gguf_layer_count(metadata, shapes, option, str(path))
    model, tokenizer = _load(file.parent, option, str(path), gguf_file=file.name)
    try:
        rows = gguf_qk_rows(file)
        notes = []
    except ValueError as exc:
        rows, notes = None, [str(exc)]
    return LoadedModel(model, tokenizer, "gguf", str(file), rows, time.perf_counter() - start, notes)


def load_chosen(args: Any) -> LoadedModel:
    """The model a verb's ``--example`` / ``--gguf FILE`` / ``--model DIR`` names (one of them is set)."""
    if args.example:
        return load_example()
    if args.gguf is not None:
        return load_gguf(args.gguf)
    return load_model_dir(args.model)


def load_example() -> LoadedModel:
    """SmolLM2-135M-Instruct from its cached transformers directory, built from the GGUF on first use."""
    from safetensors.torch import load_file

    from .smollm2_cache import QK_FILE, build_hf_dir, cached_hf_dir

    start = time.perf_counter()
    directory = cached_hf_dir()
    if directory is not None:
        loaded = load_model_dir(directory, "--example")
    else:
        directory, model, tokenizer = build_hf_dir()
        loaded = LoadedModel(model, tokenizer, "example", str(directory), notes=["built the example's cache"])
    loaded.source, loaded.path = "example", str(directory)
    loaded.file_rows = load_file(str(Path(directory) / QK_FILE))
    loaded.seconds = time.perf_counter() - start
    return loaded


def file_projections(rows: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> list[tuple[torch.Tensor, int]]:
    """``(weight, heads)`` of each ``blk.{i}.attn_q/k.weight`` of a GGUF, in layer order, for the detector."""
    layers = sorted({int(name.split(".")[1]) for name in rows})
    out = []
    for i in layers:
        for role, heads in (("q", n_heads), ("k", n_kv_heads)):
            name = f"blk.{i}.attn_{role}.weight"
            if name in rows:
                out.append((rows[name], heads))
    return out
