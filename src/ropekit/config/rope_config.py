"""``RopeConfig``: everything that fixes a model's rotary embedding, and how to read it from ``config.json``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..rope.axes import AxisPlan, single_axis
from ..rope.scaling import DynamicNTK, LongRoPE, Proportional
from ..validation import check_even_positive, check_layout, check_length, check_positive_float
from .diffusers import diffusers_rope
from .families import model_types_where
from .layout_record import hf_layout, read_layout_record
from .multimodal import mrope_layout, mrope_plan, multi_axis_keys
from .rules import METADATA_KEYS, PLAIN_ROPE_TYPES, RULE_KEYS, inv_frequencies, rope_type_of, rule_from_dict
from .schedules import LayerSchedule, read_layer_schedule

#: Model types whose Hugging Face checkpoints pair channels ``(2i, 2i+1)`` (complex / interleaved
#: apply). ``rope_interleave`` in a config overrides this table either way.
INTERLEAVED_MODEL_TYPES = model_types_where(layout="interleaved")  # rows of :mod:`.families`
#: Older names of the keys from_hf reads.
_ALIASES = {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_positions": "max_position_embeddings"}
#: ``rotary_pct`` of configs that leave it out (Hugging Face's GPTNeoXConfig default).
_DEFAULT_ROTARY_PCT = {"gpt_neox": 0.25}


@dataclass(frozen=True)
class RopeConfig:
    """The rotary embedding of one attention layer (type): dimensions, base, layout and scaling.

    Args:
        head_dim: channels per attention head (even).
        rotary_dim: rotated channels (even, ``<= head_dim``); default ``head_dim``.
        base: RoPE base (``rope_theta``).
        layout: ``"half"`` (HF / GPT-NeoX ``rotate_half``) or ``"interleaved"`` (RoFormer / Meta).
        scaling: ``None`` or a rule from :mod:`ropekit.scaling` (a rope dict is converted with
              :func:`ropekit.config.rules.rule_from_dict`).
        max_positions: the model's ``max_position_embeddings`` (informational; ``None`` if unknown).
        axes: ``None`` for 1-D RoPE, or an :class:`ropekit.AxisPlan` (multi-axis RoPE: M-RoPE,
            axial) with ``rotary_dim // 2`` pairs. With a ``scaling`` rule too, the plan's
            frequencies must be the rule's (``from_hf`` builds it so) and the rule stays the source
            of length-dependent frequencies (:meth:`axis_plan`).
        layer_schedule: ``None`` when every layer rotates, or a :class:`ropekit.LayerSchedule`
            saying which layers apply this RoPE and which apply none (SmolLM3's and Llama 4's NoPE
            layers); ``from_hf`` reads it from ``no_rope_layers`` / ``no_rope_layer_interval``.

    Construction checks everything, including that the rule fits ``rotary_dim`` (LongRoPE lists).
    """

    head_dim: int
    rotary_dim: int | None = None
    base: float = 10000.0
    layout: str = "half"
    scaling: Any = None
    max_positions: int | None = None
    axes: AxisPlan | None = None
    layer_schedule: LayerSchedule | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        check_even_positive(self.head_dim, "head_dim")
        rotary_dim = self.head_dim if self.rotary_dim is None else check_even_positive(self.rotary_dim, "rotary_dim")
        if rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must not exceed head_dim ({self.head_dim}), got {rotary_dim}")
        set_(self, "rotary_dim", rotary_dim)
        set_(self, "base", check_positive_float(self.base, "base"))
        set_(self, "layout", check_layout(self.layout))
        max_positions = self.max_positions
        if max_positions is not None and (isinstance(max_positions, bool) or not isinstance(max_positions, int)
                                          or max_positions <= 0):
            raise ValueError(f"max_positions must be a positive int or None, got {max_positions!r}")
        if isinstance(self.scaling, Mapping):
            rule = rule_from_dict(self.scaling, max_position_embeddings=max_positions, rotary_dim=rotary_dim)
            set_(self, "scaling", rule)
        if self.scaling is not None and not callable(getattr(self.scaling, "compute", None)):
            raise TypeError(f"scaling must be None or a ropekit.scaling rule, got {type(self.scaling).__name__}")
        if self.axes is not None:
            self._check_axes()
        if self.layer_schedule is not None and not isinstance(self.layer_schedule, LayerSchedule):
            raise TypeError(f"layer_schedule must be None or a ropekit.LayerSchedule, got "
                            f"{type(self.layer_schedule).__name__}")
        self.inv_frequencies()  # the rule's own checks against rotary_dim and base

    def _check_axes(self) -> None:
        if not isinstance(self.axes, AxisPlan):
            raise TypeError(f"axes must be None or a ropekit.AxisPlan, got {type(self.axes).__name__}")
        if self.axes.pairs != self.rotary_dim // 2:
            raise ValueError(f"axes has {self.axes.pairs} pairs but rotary_dim={self.rotary_dim} has "
                             f"{self.rotary_dim // 2}")
        if self.scaling is not None and callable(getattr(self.scaling, "compute", None)):
            inv_freq, scale = inv_frequencies(self.rotary_dim, self.base, self.scaling)
            if not torch.equal(inv_freq, self.axes.inv_freq) or scale != self.axes.attention_scale:
                raise ValueError("axes must carry the scaling rule's frequencies and attention scale "
                                 "(axes.with_frequencies(*inv_frequencies(rotary_dim, base, scaling)))")

    @property
    def is_multi_axis(self) -> bool:
        """Whether positions are vectors (an axis plan is set)."""
        return self.axes is not None

    def inv_frequencies(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """``(inv_freq, attention_scale)`` as :func:`ropekit.inv_frequencies` (float64, ``(rotary_dim // 2,)``).

        For a multi-axis config without a scaling rule, the plan's per-pair frequencies.
        """
        if self.axes is not None and self.scaling is None:
            return self.axes.inv_freq, self.axes.attention_scale
        return inv_frequencies(self.rotary_dim, self.base, self.scaling, seq_len=seq_len)

    def axis_plan(self, seq_len: int | None = None) -> AxisPlan:
        """The :class:`ropekit.AxisPlan` of this config (a one-axis plan for 1-D RoPE).

        ``seq_len`` reaches length-dependent scaling rules, as in :meth:`inv_frequencies`.
        """
        if self.axes is None:
            inv_freq, scale = self.inv_frequencies(seq_len)
            return single_axis(inv_freq, attention_scale=scale)
        if self.scaling is None:
            return self.axes
        return self.axes.with_frequencies(*self.inv_frequencies(seq_len))

    @classmethod
    def from_hf(
        cls,
        config: Any,
        *,
        layer_type: str | None = None,
        layout: str | None = None,
        fixed_seq_len: int | None = None,
    ) -> RopeConfig:
        """Read a Hugging Face ``config.json`` dict or ``transformers`` config object.

        Every form in circulation: ``rope_theta`` + ``rope_scaling`` (``type`` or ``rope_type``);
        v5 ``rope_parameters``, flat or nested per layer type; ``head_dim`` or
        ``hidden_size / num_attention_heads`` (``qk_rope_head_dim`` for DeepSeek MLA,
        ``global_head_dim`` for Gemma 4 full attention); ``partial_rotary_factor``, GPT-NeoX
        ``rotary_pct`` / ``rotary_emb_base``, GPT-J ``rotary_dim``; a top-level
        ``original_max_position_embeddings`` (Phi-3, which wins as in Hugging Face); Gemma 3's
        ``rope_local_base_freq``; multimodal configs through ``text_config``.

        Multi-axis RoPE (:attr:`axes` set): the M-RoPE of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni
        (the thinker's, through ``thinker_config``), GLM-4.1V / 4.5V and ERNIE-4.5-VL (``mrope_section``,
        ``"type": "mrope"``, ``mrope_interleaved``; the pair-to-axis map follows the model type, see
        :mod:`ropekit.config.multimodal`), and diffusers transformer configs
        (``_class_name``: FLUX.1, FLUX.2, HunyuanVideo, Wan, CogVideoX; axial, interleaved pairing).
        A config with multi-axis keys ropekit cannot represent raises; it never becomes 1-D RoPE.

        Layers without RoPE (:attr:`layer_schedule`): SmolLM3's and Llama 4's ``no_rope_layers``
        (``1``: the layer uses RoPE), else ``no_rope_layer_interval`` (see :mod:`ropekit.config.schedules`).

        Args:
            config: a ``config.json`` dict or an object with ``to_dict()``.
            layer_type: which entry of per-layer-type rope parameters to read (e.g.
                ``"full_attention"``, ``"sliding_attention"``); required when there are several.
            layout: ``"half"`` or ``"interleaved"``; default: the ``rope_layout`` a config written by
                ``ropekit convert`` records (:mod:`.layout_record`), else ``"half"`` except for configs
                with ``rope_interleave: true`` and the model types in :data:`INTERLEAVED_MODEL_TYPES`.
            fixed_seq_len: freeze a length-dependent rule (dynamic NTK, LongRoPE) at this length
                so that a KV cache stays consistent; ignored for static rules.

        Raises:
            ValueError: missing or inconsistent keys; the message names the key and the value (a
                ``no_rope_layers`` whose length is not ``num_hidden_layers`` too).
        """
        if isinstance(config, Mapping):  # a config.json that ropekit convert recorded a layout in
            config, recorded = read_layout_record(config)
            layout = recorded if layout is None else layout
        cfg = _as_dict(config)
        if cfg.get("_class_name") is not None:  # a diffusers transformer config: axial RoPE
            kwargs = diffusers_rope(cfg)
            return cls(**{**kwargs, "layout": kwargs["layout"] if layout is None else check_layout(layout)})
        params, layer_type, nested = _rope_params(cfg, layer_type)
        axis_keys = multi_axis_keys(cfg, params)
        head_dim = _head_dim(cfg, layer_type)
        max_positions = cfg.get("max_position_embeddings")
        kind = rope_type_of(params)
        base = _first(params.get("rope_theta"), cfg.get("rope_theta"), cfg.get("rotary_emb_base"), 10000.0)
        if params.get("partial_rotary_factor") is None and cfg.get("partial_rotary_factor") is not None:
            params["partial_rotary_factor"] = cfg["partial_rotary_factor"]  # as Hugging Face standardizes it
        top_original = cfg.get("original_max_position_embeddings")
        if top_original is not None and not nested and "original_max_position_embeddings" in RULE_KEYS.get(kind, ()):
            # Phi-3: a top-level key wins for every rule that reads one, as in Hugging Face
            params["original_max_position_embeddings"] = top_original
        scaling = None
        if kind not in PLAIN_ROPE_TYPES:
            scaling = rule_from_dict(params, max_position_embeddings=max_positions)
        elif set(params) - METADATA_KEYS:
            found = ", ".join(f"{key!r}={params[key]!r}" for key in sorted(set(params) - METADATA_KEYS))
            raise ValueError(f"rope_type {kind!r} (plain RoPE) takes no scaling parameters, got {found}")
        rotary_dim = head_dim if isinstance(scaling, Proportional) else _rotary_dim(cfg, params, head_dim)
        if fixed_seq_len is not None:
            fixed_seq_len = check_length("RopeConfig.from_hf", "fixed_seq_len", fixed_seq_len)
            if isinstance(scaling, (DynamicNTK, LongRoPE)):
                scaling = dataclasses.replace(scaling, fixed_seq_len=fixed_seq_len)
        axes = None
        if axis_keys is not None:
            section, kind = mrope_layout(cfg.get("model_type"), axis_keys)
            inv_freq, scale = inv_frequencies(rotary_dim, base, scaling)
            axes = mrope_plan(inv_freq, section, kind, scale)
        return cls(
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            base=base,
            layout=_layout(cfg, layout),
            scaling=scaling,
            max_positions=max_positions,
            axes=axes,
            layer_schedule=read_layer_schedule(cfg),
        )


def _first(*values: Any) -> Any:
    return next(value for value in values if value is not None)


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        cfg = dict(config)
    elif callable(getattr(config, "to_dict", None)):
        cfg = config.to_dict()
    else:
        raise TypeError(f"config must be a config.json dict or a transformers config, got {type(config).__name__}")
    thinker = cfg.get("thinker_config")  # Qwen2.5-Omni: the thinker's language model (the talker has its own)
    if isinstance(thinker, Mapping) and not any(key in cfg for key in ("text_config", "hidden_size", "head_dim")):
        cfg = {"model_type": cfg.get("model_type"), **thinker}
    text = cfg.get("text_config")
    if isinstance(text, Mapping) and not any(key in cfg for key in ("hidden_size", "head_dim", "n_embd")):
        cfg = {"model_type": cfg.get("model_type"), **text}  # multimodal wrapper: the language model's rope
    for alias, key in _ALIASES.items():  # GPT-2 style names (GPT-J, CodeGen)
        if key not in cfg and alias in cfg:
            cfg[key] = cfg[alias]
    return cfg


def _is_nested(params: Mapping[str, Any], layer_types: Any) -> bool:
    if not params:
        return False
    if layer_types and any(key in layer_types for key in params):
        return True
    return all(isinstance(value, Mapping) or value is None for value in params.values())


def _rope_params(cfg: Mapping[str, Any], layer_type: str | None) -> tuple[dict[str, Any], str | None, bool]:
    """``(flat rope dict for layer_type, layer_type, whether it came from a per-layer-type entry)``."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_scaling / rope_parameters must be a dict, got {params!r}")
    layer_types = cfg.get("layer_types") or ()
    if _is_nested(params, layer_types):
        if layer_type is None:
            if len(params) != 1:
                raise ValueError(
                    f"rope_parameters is given per layer type {sorted(params)}; pass layer_type= one of them"
                )
            layer_type = next(iter(params))
        if layer_type not in params:
            raise ValueError(f"layer_type {layer_type!r} is not in rope_parameters, which has {sorted(params)}")
        chosen = params[layer_type]
        if chosen is None:
            raise ValueError(f"rope_parameters[{layer_type!r}] is None: layers of that type use no RoPE")
        return dict(chosen), layer_type, True
    if layer_type is not None and layer_types and layer_type not in layer_types:
        raise ValueError(f"layer_type {layer_type!r} is not in layer_types, which has {sorted(set(layer_types))}")
    local_base = cfg.get("rope_local_base_freq")
    if local_base is not None:  # Gemma 3 before v5: sliding layers plain RoPE with their own base
        if layer_type is None:
            raise ValueError(
                f"this config has two RoPE setups (rope_theta={cfg.get('rope_theta')!r} for full attention, "
                f"rope_local_base_freq={local_base!r} for sliding attention); pass layer_type="
                "'full_attention' or 'sliding_attention'"
            )
        if layer_type == "sliding_attention":
            return {"rope_type": "default", "rope_theta": local_base}, layer_type, False
    return dict(params), layer_type, False


def _head_dim(cfg: Mapping[str, Any], layer_type: str | None) -> int:
    if cfg.get("qk_rope_head_dim"):  # DeepSeek MLA: the rotary part is its own slice of each head
        return _int_key(cfg, "qk_rope_head_dim")
    if layer_type is not None:
        override = _layer_override(cfg, layer_type, "head_dim")
        if override is not None:
            return override
        if layer_type == "full_attention" and cfg.get("global_head_dim"):  # Gemma 4
            return _int_key(cfg, "global_head_dim")
    if cfg.get("head_dim"):
        return _int_key(cfg, "head_dim")
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if hidden is None or heads is None:
        raise ValueError(
            f"config needs head_dim or hidden_size and num_attention_heads, got head_dim={cfg.get('head_dim')!r}, "
            f"hidden_size={hidden!r}, num_attention_heads={heads!r}"
        )
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or hidden % heads:
        raise ValueError(
            f"hidden_size must be a multiple of num_attention_heads, got hidden_size={hidden!r}, "
            f"num_attention_heads={heads!r}"
        )
    return hidden // heads


def _layer_override(cfg: Mapping[str, Any], layer_type: str, key: str) -> Any:
    """A v5 ``per_layer_config`` override (keyed by layer index) for the first layer of ``layer_type``."""
    per_layer, layer_types = cfg.get("per_layer_config"), cfg.get("layer_types")
    if not isinstance(per_layer, Mapping) or not layer_types:
        return None
    for index, overrides in per_layer.items():
        if int(index) < len(layer_types) and layer_types[int(index)] == layer_type and key in overrides:
            return overrides[key]
    return None


def _int_key(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive int, got {value!r}")
    return value


def _rotary_dim(cfg: Mapping[str, Any], params: Mapping[str, Any], head_dim: int) -> int:
    explicit = cfg.get("rotary_dim")  # GPT-J, CodeGen
    if explicit is not None:
        return check_even_positive(explicit, "rotary_dim")
    for key in ("partial_rotary_factor", "rotary_pct"):
        share = params.get(key, cfg.get(key))
        if share is not None:
            break
    else:
        key, share = "rotary_pct", _DEFAULT_ROTARY_PCT.get(cfg.get("model_type"), 1.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"{key} must be a number in (0, 1], got {share!r}")
    rotary_dim = int(head_dim * share)  # Hugging Face's truncation
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(
            f"{key}={share!r} with head_dim={head_dim} gives rotary_dim={rotary_dim}; it must be even and positive"
        )
    return rotary_dim


def _layout(cfg: Mapping[str, Any], layout: str | None) -> str:
    if layout is not None:
        return check_layout(layout)
    return hf_layout(cfg)
