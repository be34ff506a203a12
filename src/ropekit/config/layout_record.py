"""A ``config.json`` that records the RoPE layout of the q/k rows beside it, so that transformers cannot misread them.

transformers rotates each model type in one layout (:func:`hf_layout`: half pairs, except
``rope_interleave`` and the interleaved model types). Rows permuted into the other layout
(``ropekit convert --to interleaved``) still fit the same architecture, so a plain
``from_pretrained`` would load them and compute wrong numbers. The ``config.json`` written beside
such rows (:func:`with_layout_record`) keeps every value of the original and adds a record that
transformers cannot get past:

* ``"rope_layout"``: the layout of the rows (``"interleaved"``);
* ``"model_type"``: ``"ropekit_interleaved"`` (:data:`MARKER_PREFIX` + layout), a type no version of
  transformers knows: ``AutoConfig`` / ``AutoModel*.from_pretrained`` raise ``ValueError`` naming it;
  ``"architectures"``: ``["RopekitInterleavedLayout"]``, which other converters (llama.cpp's) refuse;
* ``"rope_scaling"`` and ``"rope_parameters"``: ``{"rope_type": "ropekit_interleaved"}``, a rope type no
  version of transformers computes: a model class named explicitly (``LlamaForCausalLM.from_pretrained``),
  which only warns about the model type, fails building its rotary embedding (``KeyError:
  'ropekit_interleaved'``; Phi-3's config validation refuses it first);
* ``"ropekit"``: ``{"original": {...}, "load_with": ...}``: the replaced keys' original values
  (a key absent there was absent) and the loading path that works.

:func:`read_layout_record` gives the original config and the recorded layout back
(``RopeConfig.from_hf`` and ``ropekit convert`` read a recorded config through it); converting the
rows back to the layout transformers rotates in writes the original config again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..validation import check_layout
from .families import model_types_where

#: The keys a layout record replaces (their original values are kept under ``ropekit.original``).
MARKED_KEYS = ("model_type", "architectures", "rope_scaling", "rope_parameters")
#: ``model_type`` and ``rope_type`` of a recorded config: this prefix and the layout.
MARKER_PREFIX = "ropekit_"
#: The top-level key naming the layout of the rows, and the key of the record itself.
LAYOUT_KEY, RECORD_KEY = "rope_layout", "ropekit"
#: The loading path that works, as the record names it.
LOAD_WITH = "ropekit.integrations.transformers.load_converted"
_INTERLEAVED_TYPES = model_types_where(layout="interleaved")


def hf_layout(config: Mapping[str, Any]) -> str:
    """The layout transformers rotates a model of this (unrecorded) ``config.json`` dict in.

    ``"interleaved"`` for ``rope_interleave: true`` (at the top or in ``text_config``) and the
    interleaved model types of :mod:`.families` (GPT-J, CodeGen, ...), else ``"half"``.
    """
    interleave = config.get("rope_interleave")
    text = config.get("text_config")
    if interleave is None and isinstance(text, Mapping):
        interleave = text.get("rope_interleave")
    if interleave is not None:
        return "interleaved" if interleave else "half"
    return "interleaved" if config.get("model_type") in _INTERLEAVED_TYPES else "half"


def read_layout_record(config: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``(the original config, the recorded layout)``; ``(config, None)`` for a config with no record.

    Raises:
        ValueError: a record that is not the one :func:`with_layout_record` writes (the message
            names the key).
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a config.json dict, got {type(config).__name__}")
    cfg = dict(config)
    if LAYOUT_KEY not in cfg and RECORD_KEY not in cfg:
        return cfg, None
    layout = check_layout(cfg.pop(LAYOUT_KEY, None) or "", f"config.json {LAYOUT_KEY!r}")
    record = cfg.pop(RECORD_KEY, None)
    original = record.get("original") if isinstance(record, Mapping) else None
    if not isinstance(original, Mapping) or set(original) - set(MARKED_KEYS):
        raise ValueError(f"config.json {RECORD_KEY!r} must be a dict whose 'original' holds the replaced keys "
                         f"(of {MARKED_KEYS}), got {record!r}")
    for key in MARKED_KEYS:
        cfg.pop(key, None)
        if key in original:
            cfg[key] = original[key]
    return cfg, layout


def with_layout_record(config: Mapping[str, Any], layout: str) -> dict[str, Any]:
    """The ``config.json`` dict to write beside q/k rows in ``layout``: the original, recorded where needed.

    ``config`` may itself carry a record (rows converted before). The original config comes back
    unrecorded when transformers rotates it in ``layout`` (:func:`hf_layout`); otherwise it gets
    the record of the module docstring.
    """
    layout = check_layout(layout)
    original, _ = read_layout_record(config)
    if hf_layout(original) == layout:
        return original
    marker = MARKER_PREFIX + layout
    recorded = {key: value for key, value in original.items() if key not in MARKED_KEYS}
    recorded.update({
        "model_type": marker,
        "architectures": ["Ropekit" + layout.capitalize() + "Layout"],
        "rope_scaling": {"rope_type": marker},  # what transformers v4 reads, and v5 before rope_parameters
        "rope_parameters": {"rope_type": marker},
        LAYOUT_KEY: layout,
        RECORD_KEY: {
            "original": {key: original[key] for key in MARKED_KEYS if key in original},
            "load_with": f"{LOAD_WITH}(path) (q/k rows in the {layout} RoPE layout, which transformers does not "
                         f"rotate {original.get('model_type') or 'this model'} in)",
        },
    })
    return recorded
