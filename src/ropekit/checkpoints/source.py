"""What ``ropekit convert`` knows about its input before it permutes a row: head geometry and layout.

Sources, each named in messages:

* the checkpoint's **own config**, read by default: ``config.json`` (Hugging Face) or ``params.json``
  (Meta) in the directory of SRC (with both present, ``params.json`` goes with Meta tensor names
  ``*.attention.wq``, ``config.json`` with the others), and a ``--config`` file;
* the ``ropekit_*`` **metadata** a previous ``ropekit convert`` recorded in each safetensors file
  (the layout it wrote and the geometry it used);
* the **flags** ``--heads``, ``--kv-heads``, ``--head-dim``, ``--rotary-dim``, ``--from``.

Geometry: a value given by two sources must be the same, else ``ValueError`` naming both; what no
source gives is derived from tensor shapes (``head_dim`` from the q rows, the key/value head count
from the k rows, since q and k heads have the same size), and the result is checked against every
q/k tensor, fused q/k/v tensor and q/k norm. What the weights cannot show: with no config and no
metadata, a geometry ``(heads * c, kv_heads * c, head_dim / c)`` fits the same shapes as the true one
unless a per-head q/k norm (length ``head_dim``) or a fused projection pins ``head_dim``.

Layout: the recorded metadata decides, else the own config (the ``rope_layout`` an earlier
conversion recorded in it, else ``RopeConfig.from_hf``'s layout: half, except ``rope_interleave`` /
interleaved model types; ``params.json``: interleaved); ``--from`` must agree with it, and a
conversion to the layout SRC is already in is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from ..config.layout_record import read_layout_record
from ..validation import check_layout
from .qk_tensors import QKLayer
from .storage import Checkpoint, first_line

#: metadata keys ``ropekit convert`` writes into every safetensors file, by HeadSpec field
META_KEYS = {"n_heads": "ropekit_heads", "n_kv_heads": "ropekit_kv_heads", "head_dim": "ropekit_head_dim",
             "rotary_dim": "ropekit_rotary_dim"}
META_LAYOUT = "ropekit_layout"
#: the flag that sets each field, for messages
FLAGS = {"n_heads": "--heads", "n_kv_heads": "--kv-heads", "head_dim": "--head-dim", "rotary_dim": "--rotary-dim"}
_META_NAME = r"attention.wq."


@dataclass(frozen=True)
class HeadSpec:
    """Attention geometry: ``n_heads`` query, ``n_kv_heads`` key heads of ``head_dim`` channels; ``rotary_dim`` rotated.

    Any field may be ``None`` (unknown): :func:`resolve_geometry` fills it from a config, the
    recorded metadata or the tensor shapes. ``base`` only feeds ``--verify``'s tables.
    """

    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    rotary_dim: int | None = None
    base: float | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> HeadSpec:
        """Read a Hugging Face ``config.json`` dict (through :meth:`RopeConfig.from_hf`) or Meta ``params.json``."""
        from ..config import RopeConfig

        if not isinstance(config, dict):
            raise ValueError(f"config must be a JSON object (config.json or params.json), got {type(config).__name__}")
        text = config.get("text_config")
        if "num_attention_heads" not in config and isinstance(text, dict) and "num_attention_heads" in text:
            config = {"model_type": config.get("model_type"), **text}  # multimodal wrapper: the language model
        if "num_attention_heads" not in config and "n_heads" in config:  # Meta params.json
            heads = int(config["n_heads"])
            head_dim = int(config.get("head_dim") or int(config["dim"]) // heads)
            return cls(heads, int(config.get("n_kv_heads") or heads), head_dim, head_dim,
                       float(config.get("rope_theta", 10000.0)))
        if "num_attention_heads" not in config:
            raise ValueError(f"config needs num_attention_heads (or Meta's n_heads), got keys {sorted(config)[:12]}")
        rope = _rope_config(config, RopeConfig)
        heads = int(config["num_attention_heads"])
        return cls(heads, int(config.get("num_key_value_heads") or heads), rope.head_dim, rope.rotary_dim, rope.base)

    def describe(self) -> str:
        """``"4 query heads, 2 key/value heads, head_dim 8, rotary_dim 8"``."""
        return (f"{self.n_heads} query heads, {self.n_kv_heads} key/value heads, head_dim {self.head_dim}, "
                f"rotary_dim {self.rotary_dim}")


def _rope_config(config: dict[str, Any], rope_config: Any) -> Any:
    """``RopeConfig.from_hf``; for per-layer-type rope parameters, the one geometry all layer types share."""
    try:
        return rope_config.from_hf(config)
    except ValueError:
        kinds = sorted({str(kind) for kind in config.get("layer_types") or ()})
        if not kinds:
            raise
    ropes = [rope_config.from_hf(config, layer_type=kind) for kind in kinds]
    if len({(r.head_dim, r.rotary_dim) for r in ropes}) != 1:
        raise ValueError(f"layer types {kinds} have different head_dim/rotary_dim; convert needs one geometry")
    return ropes[0]


@dataclass
class Source:
    """What one source says: ``kind`` (``"config"``, ``"metadata"`` or ``"given"``), ``label``, geometry, layout.

    ``spec`` fields may be ``None`` (not said); ``label`` names the source in messages.
    """

    kind: str
    label: str
    spec: HeadSpec
    layout: str | None = None


def given_source(spec: HeadSpec | None, layout: str | None) -> Source:
    """The flags (``--heads``... ``--from``) or the arguments of :func:`convert_checkpoint` as a source."""
    return Source("given", "the given value", spec or HeadSpec(), layout)


def _label(source: Source, name: str) -> str:
    return f"{FLAGS[name]}" if source.kind == "given" else source.label


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {path} is not valid JSON ({first_line(exc)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


def own_config_path(directory: Path | None, names: list[str]) -> Path | None:
    """The checkpoint's own ``config.json`` / ``params.json`` in ``directory`` (see the module docstring)."""
    if directory is None:
        return None
    found = [directory / name for name in ("config.json", "params.json") if (directory / name).is_file()]
    if len(found) == 2:
        meta_names = any(_META_NAME in name for name in names)
        return found[1] if meta_names else found[0]
    return found[0] if found else None


def config_source(config: dict[str, Any], label: str, names: list[str]) -> Source:
    """A :class:`Source` from a config dict; its layout only where the config describes these tensor names.

    A config that records a layout (written by an earlier conversion, :mod:`ropekit.config.layout_record`)
    says that layout, and the rest is read from the original config it keeps.
    """
    recorded = None
    if isinstance(config, dict):
        try:
            config, recorded = read_layout_record(config)
        except ValueError as exc:
            raise ValueError(f"{label}: {first_line(exc)}") from None
    try:
        spec = HeadSpec.from_config(config)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{label}: cannot read the head geometry ({first_line(exc)})") from None
    meta_names = any(_META_NAME in name for name in names)
    is_params = "num_attention_heads" not in config and "n_heads" in config
    layout = None
    if is_params and meta_names:
        layout = "interleaved"
    elif not is_params and not meta_names:
        from ..config import RopeConfig

        layout = recorded or _rope_config(config, RopeConfig).layout
    return Source("config", label, spec, layout)


def config_sources(ckpt: Checkpoint, names: list[str], config: str | Path | dict | None) -> list[Source]:
    """The own config next to SRC (if any) and an explicit ``--config`` (path or dict), as sources."""
    sources = []
    own = own_config_path(ckpt.directory, names)
    if own is not None:
        try:
            sources.append(config_source(_read_json(own, "config"), f"{own.name} next to SRC", names))
        except ValueError as exc:
            raise ValueError(f"{exc} (SRC's own config is always read; if it is not this checkpoint's, give the "
                             f"weights a directory of their own)") from None
    if isinstance(config, dict):
        sources.append(config_source(config, "the config passed in", names))
    elif config is not None:
        path = Path(config)
        if own is None or not path.exists() or not path.samefile(own):
            sources.append(config_source(_read_json(path, "--config file"), f"--config {path}", names))
    return sources


def metadata_source(ckpt: Checkpoint) -> Source | None:
    """What the ``ropekit_*`` metadata of the shards records (all shards must agree), or ``None``."""
    recorded = [{k: v for k, v in (shard.metadata or {}).items() if k.startswith("ropekit_")} for shard in ckpt.shards]
    if not any(recorded):
        return None
    if any(r != recorded[0] for r in recorded):
        names = [shard.name for shard in ckpt.shards]
        raise ValueError(f"the shards of SRC record different ropekit_* metadata ({names}: {recorded}); "
                         "a mixed checkpoint cannot be converted")
    values = recorded[0]
    layout = values.get(META_LAYOUT)
    if layout is not None:
        check_layout(layout, f"{META_LAYOUT} metadata of SRC")
    spec = {}
    for name, key in META_KEYS.items():
        if key in values:
            try:
                spec[name] = int(values[key])
            except ValueError:
                raise ValueError(f"{key} metadata of SRC must be an integer, got {values[key]!r}") from None
    return Source("metadata", "the ropekit metadata of SRC", HeadSpec(**spec), layout)


def _agree(sources: list[Source], name: str) -> tuple[Any, str | None]:
    """``(value, label)`` of field ``name`` across sources: the first given, or ``ValueError`` if two differ."""
    given = [(getattr(s.spec, name), _label(s, name)) for s in sources if getattr(s.spec, name) is not None]
    for value, label in given[1:]:
        if value != given[0][0]:
            hint = (" (if that config is not this checkpoint's, give the weights a directory of their own)"
                    if given[0][1].endswith("next to SRC") else "")
            raise ValueError(f"{name}: {given[0][1]} says {given[0][0]} but {label} says {value}; "
                             f"refusing to convert with a geometry the checkpoint contradicts{hint}")
    return given[0] if given else (None, None)


def _first_shapes(layers: dict[str, QKLayer], tensors: dict[str, torch.Tensor]) -> tuple[str, int, str, int]:
    """``(q name, q rows, k name, k rows)`` of the first layer with separate q/k tensors, else ``("", 0, "", 0)``."""
    for layer in layers.values():
        kind = "weight" if "weight" in layer.q else "bias"
        if kind in layer.q:
            q, k = layer.q[kind], layer.k[kind]
            return q, tensors[q].shape[0], k, tensors[k].shape[0]
    return "", 0, "", 0


def _derive(spec: HeadSpec, layers: dict[str, QKLayer], tensors: dict[str, torch.Tensor]) -> tuple[HeadSpec, list[str]]:
    """Fill ``head_dim`` and ``n_kv_heads`` from tensor shapes; ``(spec, how each was derived)``.

    Only divisions are done here; :func:`check_geometry` then checks every tensor exactly.
    """
    how: list[str] = []
    h, head_dim, kv = spec.n_heads, spec.head_dim, spec.n_kv_heads
    q, q_rows, k, k_rows = _first_shapes(layers, tensors)
    fused = next((layer for layer in layers.values() if layer.fused), None)
    if q:
        if head_dim is None:
            if q_rows % h:
                raise ValueError(f"tensor {q!r} has {q_rows} output rows, not divisible by {h} heads")
            head_dim = q_rows // h
            how.append(f"head_dim {head_dim} = rows of {q} / {h} heads")
        if kv is None:
            if k_rows % head_dim:
                raise ValueError(f"tensor {k!r} has {k_rows} output rows, not a multiple of head_dim {head_dim} "
                                 f"(from {how[-1] if how else 'the given head_dim'}); q and k heads have one size")
            kv = k_rows // head_dim
            how.append(f"{kv} key/value heads = rows of {k} / head_dim {head_dim}")
    elif fused is not None:
        name = next(iter(fused.fused.values()))
        rows = tensors[name].shape[0]
        if fused.fused_layout == "per_head":
            kv = h if kv is None else kv
            head_dim = head_dim or rows // (3 * h)
        elif head_dim is None and kv is None:
            raise ValueError(f"the fused projection {name!r} ({rows} rows = (heads + 2 kv_heads) x head_dim) does "
                             f"not tell its key/value head count: pass --kv-heads (or --head-dim) or a config")
        elif head_dim is None:
            head_dim = rows // (h + 2 * kv)
        elif kv is None:
            kv = (rows // head_dim - h) // 2
        how.append(f"head_dim {head_dim}, {kv} key/value heads from the {rows} rows of {name}")
    return replace(spec, head_dim=head_dim, n_kv_heads=kv), how


def resolve_geometry(sources: list[Source], layers: dict[str, QKLayer],
                     tensors: dict[str, torch.Tensor]) -> tuple[HeadSpec, str]:
    """The one geometry every source agrees on, completed from shapes and checked against every tensor.

    Returns ``(spec with every field set, a sentence saying where it came from)``.
    """
    for source in sources:
        for name, flag in FLAGS.items():
            value = getattr(source.spec, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{flag if source.kind == 'given' else name} must be a positive int, got {value!r} "
                                 f"({_label(source, name)})")
    values, labels = {}, {}
    for f in fields(HeadSpec):
        if f.name == "base":
            values["base"] = next((s.spec.base for s in sources if s.spec.base is not None), None)
            continue
        values[f.name], labels[f.name] = _agree(sources, f.name)
    if values["n_heads"] is None:
        raise ValueError("the head count is unknown: no config.json or params.json next to SRC, no ropekit metadata "
                         "and no --heads; pass --config PATH or --heads N")
    spec, how = _derive(HeadSpec(**values), layers, tensors)
    spec = replace(spec, rotary_dim=spec.rotary_dim or spec.head_dim)
    given = sorted({label for label in labels.values() if label})
    origin = ", ".join(given) + ("; " + "; ".join(how) if how else "")
    check_geometry(spec, layers, tensors, origin)
    return spec, origin


def _expect(name: str, tensor: torch.Tensor, rows: int, what: str, origin: str) -> None:
    if tensor.dim() not in (1, 2):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}; a projection weight is 2-D and a bias 1-D")
    if tensor.shape[0] != rows:
        raise ValueError(f"tensor {name!r} has {tensor.shape[0]} output rows, but {what} = {rows} "
                         f"(geometry from {origin}); q and k heads have the same size")


def check_geometry(spec: HeadSpec, layers: dict[str, QKLayer], tensors: dict[str, torch.Tensor], origin: str) -> None:
    """Every q/k/fused/norm tensor of ``layers`` has the rows ``spec`` implies; else ``ValueError`` naming it."""
    h, kv, d, r = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.rotary_dim
    for value, flag in ((h, "--heads"), (kv, "--kv-heads"), (d, "--head-dim"), (r, "--rotary-dim")):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{flag} must be a positive int, got {value!r} (from {origin})")
    if h % kv:
        raise ValueError(f"n_heads ({h}) must be a multiple of n_kv_heads ({kv}) (from {origin})")
    if d % 2 or r % 2 or r > d:
        raise ValueError(f"head_dim {d} and rotary_dim {r} must be even with rotary_dim <= head_dim (from {origin})")
    for layer in layers.values():
        for name in layer.q.values():
            _expect(name, tensors[name], h * d, f"{h} query heads x head_dim {d}", origin)
        for name in layer.k.values():
            _expect(name, tensors[name], kv * d, f"{kv} key/value heads x head_dim {d}", origin)
        for name in layer.fused.values():
            if layer.fused_layout == "per_head" and kv != h:
                raise ValueError(f"tensor {name!r} is a GPT-NeoX-style query_key_value (one k/v head per query "
                                 f"head), but n_kv_heads={kv} != n_heads={h} (from {origin})")
            parts = 3 * h if layer.fused_layout == "per_head" else h + 2 * kv
            _expect(name, tensors[name], parts * d, f"({parts} q/k/v heads) x head_dim {d}", origin)
        for role, name in layer.norm.items():
            heads = h if role == "q" else kv
            w = tensors[name]
            if w.dim() != 1 or w.shape[0] not in (d, heads * d):
                raise ValueError(f"q/k norm {name!r} has shape {tuple(w.shape)}; expected ({d},) (per head) or "
                                 f"({heads * d},) (whole projection) for head_dim {d} (geometry from {origin})")


def resolve_layout(given: str | None, dst: str, sources: list[Source], weights: Any = None) -> tuple[str, str]:
    """``(layout of SRC, where that came from)``; refuses a contradicting ``--from`` and a no-op conversion.

    ``weights`` (a :class:`~ropekit.rope.pairing.LayoutEvidence` or ``None``): what the q/k weights
    say, added to the refusals (a contradiction with the config is reported there, not ignored).
    """
    dst = check_layout(dst, "dst_layout (--to)")
    if given is not None:
        given = check_layout(given, "src_layout (--from)")
    told = [s for s in sources if s.layout is not None and s.kind != "given"]
    recorded = next((s for s in told if s.kind == "metadata"), None)
    if recorded is None and len({s.layout for s in told}) > 1:
        found = "; ".join(f"{s.label} says {s.layout}" for s in told)
        raise ValueError(f"the configs disagree on the layout of SRC ({found}); fix the config")
    decided = recorded or (told[0] if told else None)
    if decided is not None and given is not None and given != decided.layout:
        raise ValueError(f"--from {given} contradicts {decided.label}, which says SRC is in the {decided.layout} "
                         f"layout; drop --from")
    if decided is None and given is None:
        raise ValueError("cannot tell the layout of SRC (no ropekit_layout metadata, no config.json or params.json "
                         f"next to it): pass --from half or --from interleaved{weights_note(weights, None)}")
    layout, origin = (decided.layout, decided.label) if decided is not None else (given, "--from")
    if layout == dst:
        raise ValueError(f"SRC is already in the {dst} layout ({origin}); converting it --to {dst} would scramble it"
                         f"{weights_note(weights, layout)}")
    return layout, origin


def weights_note(evidence: Any, said: str | None) -> str:
    """A clause for a layout message: what the q/k weights say, and whether that contradicts ``said``.

    ``evidence`` is a :class:`ropekit.rope.pairing.LayoutEvidence` or ``None`` (no clause).
    """
    if evidence is None:
        return ""
    if not evidence.decided:
        return f"; the q/k weights do not tell ({evidence.describe()})"
    if said is not None and evidence.layout != said:
        return (f"; but SRC's q/k weights look {evidence.describe()}, which contradicts it: check that source "
                "against these weights")
    return f"; the q/k weights look {evidence.describe()}"
