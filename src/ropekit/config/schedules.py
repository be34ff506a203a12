"""Layer schedules without RoPE: which attention layers of a model rotate q/k and which do not (NoPE).

SmolLM3 and Llama 4 (its "iRoPE") leave every ``no_rope_layer_interval``-th layer without a
rotation. Their ``config.json`` says so with ``no_rope_layers``, one entry per layer, ``1`` where the
layer **uses** RoPE and ``0`` where it does not (the name notwithstanding), or, without that list,
with the interval: layer ``i`` rotates unless ``(i + 1) % interval == 0`` (default 4: layers 3, 7,
11, ... are NoPE). Llama 4 also attends in chunks of ``attention_chunk_size`` tokens on its RoPE
layers and scales the queries of its NoPE layers with a temperature that grows with the position
(``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``); neither is RoPE, and both are read
here only so that a schedule says what a layer of each kind does.

:func:`read_layer_schedule` turns a config dict into a :class:`LayerSchedule` (``RopeConfig.from_hf``
stores it as ``RopeConfig.layer_schedule``); the conventions per family are a column of
:mod:`.families` (``nope_schedule``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .families import nope_schedules

#: Hugging Face's default interval (``SmolLM3Config`` and ``Llama4TextConfig``: a NoPE layer every 4).
DEFAULT_INTERVAL = 4
#: The keys that give the interval: Hugging Face's, then the name of Meta's ``params.json``.
INTERVAL_KEYS = ("no_rope_layer_interval", "nope_layer_interval")
#: ``Llama4TextConfig``'s defaults for the keys a hand-written Llama 4 config may leave out.
LLAMA4_DEFAULTS = {"attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192,
                   "attn_scale": 0.1}


@dataclass(frozen=True)
class LayerSchedule:
    """Which attention layers of a model apply RoPE (and what Llama 4 does instead on the others).

    Args:
        rotary: one bool per layer, layer 0 first: ``True`` where the layer rotates q and k
            (RoPE), ``False`` where it leaves them unrotated (NoPE).
        attention_chunk_size: Llama 4: the RoPE layers attend within chunks of this many tokens;
            ``None`` for full attention (SmolLM3).
        temperature_tuning: Llama 4: ``(floor_scale, attn_scale)`` of the temperature its NoPE
            layers put on the queries, ``q * (1 + attn_scale * log(1 + floor((p + 1) / floor_scale)))``
            at position ``p``; ``None`` without.

    Raises:
        TypeError: ``rotary`` is not a sequence of bools.
        ValueError: ``rotary`` is empty, or a chunk size or temperature parameter is not positive.
    """

    rotary: tuple[bool, ...]
    attention_chunk_size: int | None = None
    temperature_tuning: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        rotary = self.rotary
        if isinstance(rotary, (str, bytes)) or not isinstance(rotary, Sequence):
            raise TypeError(f"rotary must be a sequence of bools (one per layer), got {type(rotary).__name__}")
        if not rotary:
            raise ValueError("rotary must have one entry per layer, got an empty sequence")
        for index, value in enumerate(rotary):
            if not isinstance(value, bool):
                raise TypeError(f"rotary[{index}] must be a bool, got {value!r}")
        object.__setattr__(self, "rotary", tuple(rotary))
        chunk = self.attention_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
            raise ValueError(f"attention_chunk_size must be a positive int or None, got {chunk!r}")
        tuning = self.temperature_tuning
        if tuning is not None:
            if not isinstance(tuning, tuple) or len(tuning) != 2 or not all(_positive_number(v) for v in tuning):
                raise ValueError("temperature_tuning must be None or (floor_scale, attn_scale), two positive "
                                 f"numbers, got {tuning!r}")

    @property
    def num_layers(self) -> int:
        """The number of layers the schedule covers."""
        return len(self.rotary)

    @property
    def rope_layers(self) -> tuple[int, ...]:
        """The indices of the layers that rotate q and k."""
        return tuple(i for i, rotates in enumerate(self.rotary) if rotates)

    @property
    def nope_layers(self) -> tuple[int, ...]:
        """The indices of the layers that leave q and k unrotated."""
        return tuple(i for i, rotates in enumerate(self.rotary) if not rotates)

    def rotates(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) applies RoPE; ``ValueError`` outside ``0 .. num_layers - 1``."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return self.rotary[layer]


def _positive_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and value > 0)


def _interval(cfg: Mapping[str, Any]) -> int:
    """Every ``interval``-th layer is NoPE: the config's interval, else :data:`DEFAULT_INTERVAL`."""
    given = {key: cfg[key] for key in INTERVAL_KEYS if cfg.get(key) is not None}
    if len(set(map(repr, given.values()))) > 1:
        found = ", ".join(f"{key}={value!r}" for key, value in given.items())
        raise ValueError(f"the config gives two different NoPE intervals: {found}")
    if not given:
        return DEFAULT_INTERVAL
    key, interval = next(iter(given.items()))
    if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
        raise ValueError(f"{key} must be a positive int, got {interval!r}")
    return interval


def _listed(listed: Any, layers: int) -> tuple[bool, ...]:
    """``no_rope_layers`` (``1``: the layer uses RoPE, ``0``: NoPE) as one bool per layer."""
    if isinstance(listed, (str, bytes)) or not isinstance(listed, Sequence):
        raise ValueError(f"no_rope_layers must be a list of 0/1 (1: the layer uses RoPE), got {listed!r}")
    if len(listed) != layers:
        raise ValueError(f"no_rope_layers has {len(listed)} entries but num_hidden_layers is {layers}; it needs "
                         "one entry per layer (1: the layer uses RoPE, 0: NoPE)")
    for index, value in enumerate(listed):
        if value not in (0, 1) or not isinstance(value, (int, bool)):
            raise ValueError(f"no_rope_layers[{index}] must be 0 (NoPE) or 1 (RoPE), got {value!r}")
    return tuple(bool(value) for value in listed)


def read_layer_schedule(cfg: Mapping[str, Any]) -> LayerSchedule | None:
    """The NoPE layer schedule of a flat ``config.json`` dict (a multimodal one's ``text_config``), or ``None``.

    ``None`` when the model type has no schedule (:func:`ropekit.config.families.nope_schedules`)
    and the config carries no ``no_rope_layers``: every layer rotates. A config of another model
    type that does carry the list gets it read (SmolLM3's convention), never ignored.

    Conventions: ``"smollm3"``: ``no_rope_layers`` when given (``null`` or absent: every
    ``no_rope_layer_interval``-th layer is NoPE); ``"llama4"``: the same, where an empty list also
    means the interval (as ``Llama4TextConfig`` reads it), plus ``attention_chunk_size`` and the
    temperature tuning (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``), with
    ``Llama4TextConfig``'s defaults for keys left out. The interval may also be spelled
    ``nope_layer_interval`` (Meta's ``params.json``).

    Raises:
        ValueError: ``num_hidden_layers`` missing or not a positive int; ``no_rope_layers`` whose
            length is not ``num_hidden_layers`` or whose entries are not 0/1; a bad interval; two
            intervals that differ; a chunk size or temperature parameter that is not positive.
    """
    convention = nope_schedules().get(cfg.get("model_type"))
    listed = cfg.get("no_rope_layers")
    if convention is None:
        if listed is None:
            return None
        convention = "smollm3"
    layers = cfg.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers <= 0:
        raise ValueError(f"num_hidden_layers must be a positive int to read the NoPE layer schedule "
                         f"(no_rope_layers / no_rope_layer_interval), got {layers!r}")
    if listed is None or (convention == "llama4" and isinstance(listed, Sequence) and len(listed) == 0):
        interval = _interval(cfg)
        rotary = tuple((i + 1) % interval != 0 for i in range(layers))
    else:
        _interval(cfg)  # a bad interval is an error even where the list decides
        rotary = _listed(listed, layers)
    if convention != "llama4":
        return LayerSchedule(rotary)
    values = {key: cfg.get(key, default) for key, default in LLAMA4_DEFAULTS.items()}
    chunk = values["attention_chunk_size"]
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
        raise ValueError(f"attention_chunk_size must be a positive int or null, got {chunk!r}")
    tuning = None
    if values["attn_temperature_tuning"]:  # Llama 4 checkpoints write 4 here, which transformers reads as true
        for key in ("floor_scale", "attn_scale"):
            if not _positive_number(values[key]):
                raise ValueError(f"{key} must be a positive number while attn_temperature_tuning is on, "
                                 f"got {values[key]!r}")
        tuning = (values["floor_scale"], values["attn_scale"])
    return LayerSchedule(rotary, attention_chunk_size=chunk, temperature_tuning=tuning)
