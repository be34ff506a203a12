"""The NoPE layer schedule under the transformers patch: a layer without RoPE is never rotated.

SmolLM3 and Llama 4 skip the rotation on the layers their config lists as NoPE
(:class:`ropekit.LayerSchedule`, read by ``RopeConfig.from_hf``); their attention modules carry the
decision as ``use_rope``. The patch takes the schedule from the model's own config (a ``rope=``
given to :func:`ropekit.integrations.transformers.patch` keeps the model's schedule, and one that
carries another schedule is refused), checks at patch time that every attention module's
``use_rope`` agrees with it, and gives each patched attention call its layer's entry
(``Call.layer_rotates``). At run time the rotation of a NoPE layer raises (:func:`start_rotation`),
and so does a RoPE layer whose attention returns without rotating (:func:`check_rotated`): a
module whose ``use_rope`` was changed after the patch fails loudly instead of computing another
model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import LayerSchedule, RopeConfig
from .transformers_norms import Call


def with_model_schedule(rope: RopeConfig, own: RopeConfig, model_name: str) -> RopeConfig:
    """``rope`` carrying the model's schedule (``own.layer_schedule``); ``ValueError`` if it carries another."""
    if rope.layer_schedule is not None and rope.layer_schedule != own.layer_schedule:
        raise ValueError(f"rope has a layer_schedule that is not {model_name}'s (its config's no_rope_layers); "
                         "pass a RopeConfig without layer_schedule (the model's own is kept) or with the model's")
    if rope.layer_schedule == own.layer_schedule:
        return rope
    return dataclasses.replace(rope, layer_schedule=own.layer_schedule)


def layer_entries(attention: list[torch.nn.Module],
                  schedule: LayerSchedule | None) -> list[tuple[int, bool] | None]:
    """Each attention module's ``(layer index, whether it rotates)``; all ``None`` without a schedule.

    Raises:
        ValueError: a module whose ``layer_idx`` is outside the schedule, or whose ``use_rope``
            disagrees with the schedule (the message names the layer and ``no_rope_layers``).
    """
    if schedule is None:
        return [None] * len(attention)
    entries = []
    for module in attention:
        index = getattr(module, "layer_idx", None)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < schedule.num_layers:
            raise ValueError(f"{type(module).__name__} has layer_idx {index!r}; the config's NoPE schedule "
                             f"(no_rope_layers) covers layers 0 to {schedule.num_layers - 1}")
        rotates = schedule.rotary[index]
        own = getattr(module, "use_rope", None)
        if own is not None and bool(own) != rotates:
            raise ValueError(f"layer {index}: the config's no_rope_layers makes it a {_kind(rotates)} layer, but "
                             f"{type(module).__name__}.use_rope is {own!r}; the model and its config disagree")
        entries.append((index, rotates))
    return entries


def _kind(rotates: bool) -> str:
    return "RoPE" if rotates else "NoPE"


def start_rotation(call: Call, function: str) -> None:
    """Called by the patched rotation function first: raise if ``call``'s layer is a NoPE layer."""
    entry = call.layer_rotates
    if entry is not None and not entry[1]:
        raise RuntimeError(f"ropekit: layer {entry[0]} is a NoPE layer (no_rope_layers) but its attention called "
                           f"{function}; its use_rope was changed after patch(), so the model no longer computes "
                           "what its config says (unpatch, restore it, patch again)")
    call.rotated = True


def check_rotated(call: Call, attention: Any) -> None:
    """Called when a patched attention call ends: raise if a RoPE layer of the schedule did not rotate."""
    entry = call.layer_rotates
    if entry is not None and entry[1] and not call.rotated:
        raise RuntimeError(f"ropekit: layer {entry[0]} is a RoPE layer (no_rope_layers) but {type(attention).__name__} "
                           "returned without rotating q and k; its use_rope was changed after patch(), so the "
                           "model no longer computes what its config says (unpatch, restore it, patch again)")
