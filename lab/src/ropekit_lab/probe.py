"""``ropekit probe``: how a pretrained RoPE model uses its rotary pairs, and which pairing it was trained with.

The model runs once over real text, patched with ropekit (:func:`ropekit.integrations.transformers.patch`)
while :func:`ropekit_lab.capture.capturing` hands each layer's q and k, before and after the rotation,
to :func:`ropekit_lab.probe_stats.layer_statistics` (a progress bar counts the layers). The pairing
is asked twice: of the weights (:mod:`ropekit.rope.pairing`, the model's rows and, for a GGUF, the
rows as the file stores them) and of the loss (the same text rotated in each layout; the pairing
the model was trained with predicts it far better). Without ``--quick`` the loss is also measured
with the slowest pairs left unrotated (p-RoPE, Barbero et al. 2024, without training).

:func:`probe` returns the JSON document (schema ``ropekit.probe/1``, docs/probe.md), from which
the page and its figures are drawn (:mod:`ropekit_lab.probe_page`);
:func:`ropekit_lab.probe_output.write_outputs` writes ``probe.json``, the PNG figures and
``index.html`` as one folder.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import platform
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from ropekit import LayoutEvidence, RopeConfig, detect_layout
from ropekit.checkpoints import HeadSpec, detect_tensors_layout, find_layers, qk_projections
from ropekit.integrations.transformers import patch, unpatch
from ropekit.rope.pairing import frequency_index, head_log_row_norms, log_likelihood_ratio
from ropekit.scaling import Proportional

from .capture import capturing
from .probe_models import LoadedModel, file_projections
from .probe_output import check_out_folder, one_line_summary, write_outputs
from .probe_stats import SINK, THRESHOLD, Geometry, head_kind, layer_statistics, slow_pairs
from .probe_summary import claims, summarise
from .probe_text import default_text, encode, read_text, text_record

SCHEMA = "ropekit.probe/1"
QUICK_TOKENS, DEFAULT_TOKENS = 256, 1024
P_VALUES = (0.75, 0.5, 0.25, 0.0)


class LayerBar:
    """A one-line progress bar over layers on stderr (redrawn after a carriage return)."""

    def __init__(self, total: int, label: str, *, enabled: bool = True) -> None:
        self.total, self.label, self.enabled, self.done = total, label, enabled, 0
        self.start, self.drawn = time.perf_counter(), False

    def step(self) -> None:
        """One more layer done."""
        self.done += 1
        if self.enabled:
            filled = int(24 * self.done / max(1, self.total))
            self.drawn = True
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total} layers "
                             f"{time.perf_counter() - self.start:4.0f}s")
            sys.stderr.flush()

    def close(self) -> None:
        """End the line if one was drawn."""
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.drawn = False


# -- the model's own rope, the weights, the loss -----------------------------------------------------


def model_rope(model: Any) -> RopeConfig:
    """The model's rotary embedding as ropekit reads its config (``ValueError`` if it cannot)."""
    return RopeConfig.from_hf(model.config)


def pairing_details(projections: list, head_dim: int, rotary_dim: int) -> dict[str, Any]:
    """Per-head log-likelihood ratios and the k heads' mean log row norm per frequency index under each reading.

    ``projections``: ``(weight, heads, ...)`` with q and k alternating, as the detector reads them.
    """
    logs = [head_log_row_norms(w, n, head_dim=head_dim, rotary_dim=rotary_dim) for w, n, *_ in projections]
    llr = torch.cat([log_likelihood_ratio(x) for x in logs])
    keys = torch.cat(logs[1::2]) if len(logs) > 1 else logs[0]
    profile = {}
    for reading in ("half", "interleaved"):
        index = frequency_index(reading, rotary_dim)
        profile[reading] = [float(keys[:, index == i].mean()) for i in range(rotary_dim // 2)]
    return {"llr": _rounded(llr), "profile_k": _rounded(profile)}


def weights_evidence(model: Any, rope: RopeConfig) -> tuple[LayoutEvidence, dict[str, Any]]:
    """What the model's q/k weights say about the pairing: the verdict, and its figures (``z`` per layer, votes)."""
    state = {name: t.detach() for name, t in model.state_dict().items()}
    config = model.config.to_dict()
    heads = config.get("num_attention_heads")
    spec = HeadSpec(heads, config.get("num_key_value_heads") or heads, rope.head_dim, rope.rotary_dim)
    layers = find_layers(list(state))
    evidence = detect_tensors_layout(layers, state, spec)
    record = evidence.as_dict()
    if evidence.heads:
        per_layer = [detect_tensors_layout({key: layer}, state, spec).z for key, layer in layers.items()]
        record["per_layer_z"] = [_rounded(z) if math.isfinite(z) else None for z in per_layer]
        record.update(pairing_details(qk_projections(layers, state, spec), rope.head_dim, rope.rotary_dim))
    return evidence, record


def file_evidence(loaded: LoadedModel, rope: RopeConfig) -> dict[str, Any] | None:
    """The verdict on the q/k rows as the GGUF file stores them (``None`` without a file)."""
    if not loaded.file_rows:
        return None
    config = loaded.model.config
    heads = config.num_attention_heads
    projections = file_projections(loaded.file_rows, heads, getattr(config, "num_key_value_heads", None) or heads)
    evidence = detect_layout(projections, head_dim=rope.head_dim, rotary_dim=rope.rotary_dim)
    return {**evidence.as_dict(), **pairing_details(projections, rope.head_dim, rope.rotary_dim)}


def token_losses(model: Any, ids: torch.Tensor, rope: RopeConfig, capture: Any = None) -> torch.Tensor:
    """Per-token next-token NLL (nats, float64 ``(N - 1,)``) with the model patched to rotate by ``rope``.

    ``capture``: a :func:`ropekit_lab.capture.capturing` callback, or ``None``. With one, the model is
    patched with ``fuse=False`` (its own q/k norms run), so that the captured tensors are the modeling code's.
    """
    patch(model, rope=rope, fuse=capture is None)
    try:
        watching = capturing(model, capture) if capture is not None else contextlib.nullcontext()
        with torch.no_grad(), watching:
            logits = model(ids).logits[0, :-1].float()
    finally:
        unpatch(model)
    return F.cross_entropy(logits, ids[0, 1:], reduction="none").to(torch.float64)


def compare_losses(nll: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Mean loss per layout, the winner, the share of tokens it predicts better, and the paired ``z``."""
    diff = nll["interleaved"] - nll["half"]  # > 0: half predicts the token better
    winner = "half" if float(diff.mean()) > 0 else "interleaved"
    wins = float((diff > 0).double().mean()) if winner == "half" else float((diff < 0).double().mean())
    std = float(diff.std())
    z = float(diff.mean()) / (std / math.sqrt(diff.numel())) if std > 0 else 0.0
    return {"half": float(nll["half"].mean()), "interleaved": float(nll["interleaved"].mean()),
            "tokens": diff.numel(), "winner": winner, "win_fraction": wins, "z": z}


# -- capture -----------------------------------------------------------------------------------------


class Capture:
    """The :func:`ropekit_lab.capture.capturing` callback: each layer's statistics, keyed by ``layer_idx``.

    The statistics are :func:`ropekit_lab.probe_stats.layer_statistics` of the layer's q and k.
    """

    def __init__(self, rope: RopeConfig, inv_freq: torch.Tensor, bar: LayerBar) -> None:
        self.rope, self.inv_freq, self.bar = rope, inv_freq, bar
        self.layers: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, module: Any, q: torch.Tensor, k: torch.Tensor, q_rot: torch.Tensor, k_rot: torch.Tensor):
        """Called by the patched attention of each layer (batch 1): compute and keep the layer's statistics."""
        config = getattr(module, "config", None)
        # Qwen2-style layers carry their own window (None on full-attention layers); Mistral's is in the config
        window = module.sliding_window if hasattr(module, "sliding_window") else getattr(config, "sliding_window", None)
        geometry = Geometry(self.rope.layout, self.rope.rotary_dim, self.inv_freq,
                            float(getattr(module, "scaling", self.rope.head_dim**-0.5)),
                            window if isinstance(window, int) and window < q.shape[-2] else None,
                            getattr(config, "attn_logit_softcapping", None))
        self.layers[module.layer_idx] = layer_statistics(q[0], k[0], q_rot[0], k_rot[0], geometry)
        self.bar.step()


def capture_run(model: Any, ids: torch.Tensor, rope: RopeConfig, *, progress: bool) -> tuple[dict, torch.Tensor]:
    """``(per-layer statistics, per-token NLL)`` from one forward rotated by ``rope``."""
    inv_freq, _ = rope.inv_frequencies()
    bar = LayerBar(model.config.num_hidden_layers, f"probe ({rope.layout})", enabled=progress)
    capture = Capture(rope, inv_freq, bar)
    try:
        nll = token_losses(model, ids, rope, capture)
    finally:
        bar.close()
    return capture.layers, nll


def _rounded(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return float(f"{x:.6g}") if isinstance(x, float) else x


def head_tables(layers: dict[int, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """``[layer][head][...]`` lists of every statistic, and each head's kind."""
    order = sorted(layers)
    tables = {name: [_rounded(layers[i][name]) for i in order] for name in layers[order[0]]}
    tables["kind"] = [[head_kind(d, p, s) for d, p, s in zip(dia, prev, sink, strict=True)]
                      for dia, prev, sink in zip(tables["diagonal"], tables["previous_token"], tables["sink"],
                                                 strict=True)]
    return tables


# -- the whole probe ---------------------------------------------------------------------------------


def probe(loaded: LoadedModel, ids: torch.Tensor, *, text: dict, quick: bool = False,
          progress: bool = True) -> dict[str, Any]:
    """Run every measurement on ``ids`` ``(1, N)``; return the JSON document (schema ``ropekit.probe/1``)."""
    model, seconds = loaded.model, {"load": loaded.seconds}
    start = time.perf_counter()
    own = model_rope(model)
    evidence, weights = weights_evidence(model, own)
    file_rows = file_evidence(loaded, own)
    seconds["detector"] = time.perf_counter() - start
    first = evidence.layout or own.layout
    start = time.perf_counter()
    layers, nll_first = capture_run(model, ids, dataclasses.replace(own, layout=first), progress=progress)
    seconds["capture"] = time.perf_counter() - start
    start = time.perf_counter()
    other = "interleaved" if first == "half" else "half"
    nll = {first: nll_first, other: token_losses(model, ids, dataclasses.replace(own, layout=other))}
    loss = compare_losses(nll)
    if loss["winner"] != first:  # the weights and the loss disagree: measure in the layout the model runs with
        layers, _ = capture_run(model, ids, dataclasses.replace(own, layout=loss["winner"]), progress=progress)
    layout = loss["winner"]
    truncation = None if quick else p_rope_curve(model, ids, dataclasses.replace(own, layout=layout), loss[layout])
    seconds["loss"] = time.perf_counter() - start
    n = ids.shape[1]
    inv_freq, _ = own.inv_frequencies()
    slow = slow_pairs(inv_freq, n)
    tables = head_tables(layers)
    summary = summarise(tables, slow)
    agree = None if not evidence.decided else evidence.layout == layout
    document = {
        "schema": SCHEMA,
        "model": model_section(loaded, own),
        "text": {**text, "tokens": n},
        "rope": {"pairs": len(inv_freq), "inv_freq": _rounded(inv_freq),
                 "wavelength": _rounded(2 * math.pi / inv_freq),
                 "rotations_in_context": _rounded(inv_freq * (n - 1) / (2 * math.pi)),
                 "slow_pairs": slow.nonzero().flatten().tolist()},
        "pairing": {"weights": weights, "file_rows": file_rows, "loss": loss, "config_layout": own.layout,
                    "layout": layout, "agree": agree, "confidence": evidence.votes if evidence.decided else None},
        "heads": tables,
        "positional_heads": positional_heads(tables),
        "summary": summary,
        "claims": claims(summary, truncation),
        "p_rope": truncation,
        "thresholds": {"positional": THRESHOLD, "sink": SINK},
        "notes": loaded.notes,
        "versions": versions(),
        "quick": quick,
        "threads": torch.get_num_threads(),
    }
    document["seconds"] = {k: round(v, 2) for k, v in seconds.items()}
    return document


def p_rope_curve(model: Any, ids: torch.Tensor, rope: RopeConfig, full_loss: float) -> dict[str, Any] | None:
    """Loss with only the fastest share ``p`` of the pairs rotated (p-RoPE without training); ``None`` if scaled."""
    if rope.scaling is not None:
        return None
    rows = [{"p": 1.0, "rotated_pairs": rope.rotary_dim // 2, "loss": full_loss}]
    for p in P_VALUES:
        rule = Proportional(partial_rotary_factor=p)
        loss = float(token_losses(model, ids, dataclasses.replace(rope, scaling=rule)).mean())
        rows.append({"p": p, "rotated_pairs": int(p * rope.rotary_dim // 2), "loss": loss})
    return {"rows": rows}


def positional_heads(tables: dict[str, Any]) -> dict[str, Any]:
    """The diagonal and previous-token heads, strongest first, with their fast-pair figures."""
    out: dict[str, Any] = {"threshold": THRESHOLD}
    for kind, key in (("diagonal", "diagonal"), ("previous_token", "previous_token")):
        found = [{"layer": layer, "head": head, "mass": mass,
                  "fast_share_prev_logit": tables["fast_share_prev_logit"][layer][head],
                  "prev_fast_only": tables["prev_fast_only"][layer][head],
                  "prev_slow_only": tables["prev_slow_only"][layer][head]}
                 for layer, row in enumerate(tables[key]) for head, mass in enumerate(row) if mass > THRESHOLD]
        out[kind] = sorted(found, key=lambda h: -h["mass"])
    return out


def model_section(loaded: LoadedModel, rope: RopeConfig) -> dict[str, Any]:
    """What was probed: source, family, geometry and RoPE config."""
    config = loaded.model.config
    heads = config.num_attention_heads
    return {"source": loaded.source, "path": loaded.path, "model_type": config.model_type,
            "class": type(loaded.model).__name__, "layers": config.num_hidden_layers, "heads": heads,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads, "head_dim": rope.head_dim,
            "rotary_dim": rope.rotary_dim, "base": rope.base,
            "rope_type": type(rope.scaling).__name__ if rope.scaling else "default",
            "max_positions": rope.max_positions, "dtype": "float32",
            "parameters": sum(p.numel() for p in loaded.model.parameters())}


def versions() -> dict[str, str]:
    """Versions of the pieces that produced the numbers."""
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    try:
        ropekit_version = version("ropekit")
    except PackageNotFoundError:  # a source tree that was never installed
        ropekit_version = "0+unknown"
    return {"ropekit": ropekit_version, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def run(args: argparse.Namespace) -> int:
    """The ``probe`` verb: load, probe, write; print the page's path (or, with ``--json``, the document)."""
    from .probe_models import load_chosen

    torch.set_num_threads(args.threads or 1)
    check_out_folder(args.out)
    limit = args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    if args.prompt is not None:
        text, label, option = args.prompt, "--prompt", "--prompt"
    elif args.text is not None:
        text, label, option = read_text(args.text), f"--text {args.text}", "--text"
    else:
        text, label, option = *default_text(), "the default text"
    if not text.strip():
        raise ValueError(f"{option}: the text is empty")
    loaded = load_chosen(args)
    rope = model_rope(loaded.model)
    limit = min(limit, rope.max_positions or limit)
    ids = encode(loaded.tokenizer, text, limit, option)
    document = probe(loaded, ids, text=text_record(text, label), quick=args.quick, progress=not args.no_progress)
    index = write_outputs(args.out, document)
    if args.json:
        print(json.dumps(document, indent=1, allow_nan=False))
    else:
        print(index)
        print(one_line_summary(document), file=sys.stderr)
    return 0
