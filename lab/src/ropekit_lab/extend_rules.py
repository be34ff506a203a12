"""The candidate rules of ``ropekit extend``, each as ropekit runs it and as a ``config.json`` states it.

With ``L`` the trained context, ``T`` the target length and ``s = T / L``, a rule is built for the
model's own :class:`ropekit.RopeConfig` (plain RoPE of base ``b``):

=========  ===============================================================  =================================
name       ropekit rule (what the evaluation rotates with)                  ``rope_parameters`` written
=========  ===============================================================  =================================
none       plain RoPE                                                       ``default``, ``rope_theta = b``
linear     :class:`~ropekit.scaling.Linear` ``(s)`` (position interpolation) ``linear``, ``factor = s``
ntk        :class:`~ropekit.scaling.NTK` ``(s)`` (NTK-aware base change)     ``default``, ``rope_theta = b'``
dynamic    :class:`~ropekit.scaling.DynamicNTK` ``(s, L)``                   ``dynamic``, ``factor = s``
yarn       :class:`~ropekit.scaling.YaRN` ``(s, L)``, its attention factor   ``yarn``, ``factor``, ``original``
llama3     :class:`~ropekit.scaling.Llama3` ``(s, 1, 4, L)``                 ``llama3``, ``factor``, ...
probe      YaRN with ``beta_fast = beta_slow = 1`` and no attention factor  ``yarn`` with those keys
=========  ===============================================================  =================================

``ntk`` is written as a new base because transformers has no ``"ntk"`` rope type: ``b' = b *
s ** (d / (d - 2))`` is exactly the rule (:class:`~ropekit.scaling.NTK`). ``dynamic`` keeps
``max_position_embeddings = L`` in the written config (transformers takes its ``L`` from there);
``none`` leaves the model's own value; the others set it to ``T``.

``probe`` is what the probe's frequency analysis says (:func:`pair_ranges`): a pair that completes
a rotation within ``L`` has seen every angle in training, so angles beyond ``L`` are nothing new to
it; a pair that never completes one (``theta_i (L - 1) < 2 pi``, the probe's *slow pairs*) sees
angles at ``T`` that training never produced. Interpolate exactly those by ``s``, keep the others:
YaRN's ramp with both edges at one rotation over ``L`` (a hard cut between two neighbouring pairs)
and no attention temperature.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ropekit import RopeConfig
from ropekit.rope.analysis import rotations
from ropekit.scaling import NTK, DynamicNTK, Linear, Llama3, YaRN

#: Every rule ``ropekit extend`` knows, in the order of its tables.
RULES = ("none", "linear", "ntk", "dynamic", "yarn", "llama3", "probe")
#: Pairs whose frequency a rule lowers by more than this share count as compressed.
COMPRESSED = 0.01


@dataclass(frozen=True)
class Candidate:
    """One rule for one extension: ``name``, the ropekit rule (``None``: plain RoPE), the config it writes.

    ``rope_parameters``: the Hugging Face dict (``rope_type``, ``rope_theta``, the rule's keys);
    ``max_position_embeddings``: the value the written config gets; ``summary``: one line for people.
    """

    name: str
    rule: Any
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    summary: str

    def rope(self, own: RopeConfig, seq_len: int) -> RopeConfig:
        """The model's RoPE under this rule for a sequence of ``seq_len`` tokens (a length-dependent rule frozen)."""
        rule = self.rule
        if isinstance(rule, DynamicNTK):
            rule = dataclasses.replace(rule, fixed_seq_len=seq_len)
        return dataclasses.replace(own, scaling=rule)


def ntk_base(base: float, rotary_dim: int, factor: float) -> float:
    """NTK-aware base: ``b * factor ** (d / (d - 2))`` (bloc97 2023)."""
    return base * factor ** (rotary_dim / (rotary_dim - 2))


def candidate(name: str, own: RopeConfig, trained: int, target: int) -> Candidate:
    """The rule ``name`` (one of :data:`RULES`) extending ``own`` from ``trained`` to ``target`` tokens."""
    if name not in RULES:
        raise ValueError(f"--rules: unknown rule {name!r}; known: {', '.join(RULES)}")
    s = target / trained
    base, theta = own.base, {"rope_theta": own.base}
    if name == "none":
        return Candidate(name, None, {"rope_type": "default", **theta}, own.max_positions or trained,
                         "plain RoPE, as trained")
    if name == "linear":
        return Candidate(name, Linear(s), {"rope_type": "linear", "factor": s, **theta}, target,
                         f"position interpolation: every frequency divided by {s:g}")
    if name == "ntk":
        new = ntk_base(base, own.rotary_dim, s)
        return Candidate(name, NTK(s), {"rope_type": "default", "rope_theta": new}, target,
                         f"NTK-aware: base {base:g} -> {new:.6g} (the slowest pair interpolated by {s:g}, the "
                         "fastest kept)")
    if name == "dynamic":
        return Candidate(name, DynamicNTK(s, trained), {"rope_type": "dynamic", "factor": s, **theta}, trained,
                         f"dynamic NTK, factor {s:g}: the base grows with the sequence beyond {trained}")
    original = {"original_max_position_embeddings": trained}
    if name == "yarn":
        rule = YaRN(s, trained)
        return Candidate(name, rule, {"rope_type": "yarn", "factor": s, **original, **theta}, target,
                         f"YaRN, factor {s:g}, beta 32/1, attention factor {rule.compute(own.rotary_dim, base)[1]:.4f}")
    if name == "llama3":
        return Candidate(name, Llama3(s, 1.0, 4.0, trained),
                         {"rope_type": "llama3", "factor": s, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          **original, **theta}, target, f"Llama 3 bands, factor {s:g}, low/high freq factor 1/4")
    rule = YaRN(s, trained, beta_fast=1.0, beta_slow=1.0, attention_factor=1.0)
    return Candidate(name, rule, {"rope_type": "yarn", "factor": s, **original, "beta_fast": 1.0, "beta_slow": 1.0,
                                  "attention_factor": 1.0, **theta}, target,
                     f"the probe's pairs: those that never turn once in {trained} tokens interpolated by {s:g}, the "
                     "others kept, no attention factor")


def candidates(names: list[str], own: RopeConfig, trained: int, target: int) -> list[Candidate]:
    """:func:`candidate` for each name (``none`` always first: it is the reference)."""
    if own.scaling is not None:
        raise ValueError(f"the model already uses {type(own.scaling).__name__} scaling; extend compares rules on a "
                         "model with plain RoPE")
    if own.axes is not None:
        raise ValueError("the model uses multi-axis RoPE; extend compares 1-D rules")
    ordered = ["none", *[n for n in RULES if n in names and n != "none"]]
    return [candidate(n, own, trained, target) for n in ordered]


def pair_ranges(candidate: Candidate, own: RopeConfig, trained: int, target: int) -> dict[str, Any]:
    """Which pairs leave the range of angles training showed them, under ``candidate`` at ``target`` tokens.

    Training at ``L = trained`` showed pair ``i`` the angles ``[0, theta_i (L - 1)]``; a pair with at
    least one full turn saw every angle. At ``T = target`` under the rule, pair ``i`` reaches
    ``theta'_i (T - 1)``. Returned (lists of pair indices, float64 maths):

    - ``slow``: pairs that never complete a rotation within ``L`` (the probe's slow pairs);
    - ``beyond``: slow pairs whose angle at ``T`` exceeds the trained maximum (by more than 0.1%):
      angles the model never saw;
    - ``compressed``: pairs with at least one turn within ``L`` whose frequency the rule lowers by
      more than :data:`COMPRESSED`: local order resolved more coarsely than in training;
    - ``angle_ratio``: ``theta'_i (T - 1) / (theta_i (L - 1))`` per pair; ``turns_trained`` per pair.
    """
    theta, _ = own.inv_frequencies()
    scaled, _ = candidate.rope(own, target).inv_frequencies(target)
    theta, scaled = theta.to(torch.float64), scaled.to(torch.float64)
    turns = rotations(theta, trained - 1)
    ratio = scaled * (target - 1) / (theta * (trained - 1))
    slow = turns < 1
    beyond = slow & (ratio > 1.001)
    compressed = ~slow & (scaled < theta * (1 - COMPRESSED))
    return {"slow": slow.nonzero().flatten().tolist(), "beyond": beyond.nonzero().flatten().tolist(),
            "compressed": compressed.nonzero().flatten().tolist(),
            "angle_ratio": [float(f"{r:.6g}") for r in ratio.tolist()],
            "turns_trained": [float(f"{t:.6g}") for t in turns.tolist()],
            "max_angle_ratio_slow": float(ratio[slow].max()) if bool(slow.any()) else None}


def written_config(config: dict[str, Any], chosen: Candidate) -> dict[str, Any]:
    """A copy of ``config`` (a ``config.json`` dict) that states ``chosen``'s rule the way it was written.

    A config with ``rope_parameters`` (transformers 5) gets the new dict there (its
    ``partial_rotary_factor`` kept); one in the older form gets ``rope_scaling`` (``None`` for plain
    RoPE) and a top-level ``rope_theta``. ``max_position_embeddings`` is the candidate's.
    """
    out = dict(config)
    params = dict(chosen.rope_parameters)
    if isinstance(config.get("rope_parameters"), dict) or "rope_theta" not in config:
        old = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
        if "partial_rotary_factor" in old:
            params["partial_rotary_factor"] = old["partial_rotary_factor"]
        out["rope_parameters"] = params
        out.pop("rope_scaling", None)
    else:
        out["rope_theta"] = params.pop("rope_theta")
        out["rope_scaling"] = None if params["rope_type"] == "default" else params
    out["max_position_embeddings"] = chosen.max_position_embeddings
    return out


def describe_factor(trained: int, target: int) -> str:
    """``2x (8192 -> 16384)``."""
    s = target / trained
    return f"{s:g}x ({trained} -> {target})" if math.isfinite(s) else f"{trained} -> {target}"
