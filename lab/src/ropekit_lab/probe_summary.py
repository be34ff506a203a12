"""What ``ropekit probe``'s per-head tables add up to, and the paper's claims measured against them.

Barbero et al. 2024 (*Round and Round We Go! What makes Rotary Positional Encodings useful?*,
arXiv:2410.06205) found in Gemma that the lowest frequencies carry most of the q/k norm (semantic
channels), that the highest frequencies build the positional heads (diagonal, previous-token),
and that the slowest pairs' rotation can be dropped (p-RoPE). :func:`claims` states each claim,
what was measured, the rule that calls it holding or not, and the verdict.
"""

from __future__ import annotations

from typing import Any

import torch


def _spread(values: list) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64).flatten()
    return {"mean": float(t.mean()), "min": float(t.min()), "max": float(t.max())}


def _mean(values: list[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


def summarise(tables: dict[str, Any], slow: torch.Tensor) -> dict[str, Any]:
    """Model-wide figures from the ``[layer][head]`` tables; ``slow`` is the bool ``(P,)`` of slow pairs."""
    pairs, n_slow = slow.numel(), int(slow.sum())
    out: dict[str, Any] = {"pairs": pairs, "slow_pairs": n_slow, "slow_pair_fraction": n_slow / pairs}
    for role in ("q", "k"):
        norms = torch.tensor(tables[f"{role}_pair_norm"], dtype=torch.float64)  # (layers, heads, P)
        out[f"slow_energy_share_{role}"] = _spread(tables[f"{role}_slow_energy_share"])
        out[f"pair_norm_{role}"] = norms.mean(dim=(0, 1)).tolist()
        fast = norms[..., ~slow].mean() if n_slow < pairs else torch.tensor(float("nan"))
        out[f"slow_to_fast_norm_{role}"] = float(norms[..., slow].mean() / fast) if 0 < n_slow < pairs else None
    kinds = [kind for row in tables["kind"] for kind in row]
    out["head_kinds"] = {kind: kinds.count(kind) for kind in ("previous-token", "diagonal", "sink", "other")}
    cells = [(layer, head) for layer, row in enumerate(tables["kind"]) for head in range(len(row))]
    prev = [(lay, h) for lay, h in cells if tables["kind"][lay][h] == "previous-token"]
    rest = [(lay, h) for lay, h in cells if tables["kind"][lay][h] != "previous-token"]

    def column(name: str, which: list) -> list[float]:
        return [tables[name][lay][h] for lay, h in which]

    out["fast_share_prev_logit"] = {"previous_token_heads": _mean(column("fast_share_prev_logit", prev)),
                                    "other_heads": _mean(column("fast_share_prev_logit", rest))}
    out["prev_ablation"] = {"heads": len(prev), "full": _mean(column("previous_token", prev)),
                            "fast_only": _mean(column("prev_fast_only", prev)),
                            "slow_only": _mean(column("prev_slow_only", prev)),
                            "fast_beats_slow": sum(f > s for f, s in zip(column("prev_fast_only", prev),
                                                                          column("prev_slow_only", prev),
                                                                          strict=True))}
    out["mean_attention_by_distance"] = torch.tensor(tables["attention_by_distance"],
                                                     dtype=torch.float64).mean(dim=(0, 1)).tolist()
    out["sink"] = _spread(tables["sink"])
    return out


def claims(summary: dict[str, Any], truncation: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The paper's claims, each with what was measured here, the rule applied and ``holds`` (``None``: not measured)."""
    q, k, fraction = summary["slow_energy_share_q"], summary["slow_energy_share_k"], summary["slow_pair_fraction"]
    energy = {
        "claim": "The low-frequency pairs carry most of the q/k norm (the model prefers them: semantic channels).",
        "measured": f"the {summary['slow_pairs']} of {summary['pairs']} pairs that never complete a rotation within "
                    f"the text hold {100 * q['mean']:.1f}% of the q energy (heads from {100 * q['min']:.0f}% to "
                    f"{100 * q['max']:.0f}%) and {100 * k['mean']:.1f}% of the k energy; equal energy per pair "
                    f"would give {100 * fraction:.1f}%",
        "rule": "holds when the mean share of q and of k exceeds the slow pairs' share of the pairs",
        "holds": (q["mean"] > fraction and k["mean"] > fraction) if 0 < fraction < 1 else None,
    }
    shares, ablation = summary["fast_share_prev_logit"], summary["prev_ablation"]
    positional = {
        "claim": "The high-frequency pairs build the positional heads (previous-token, diagonal).",
        "rule": "holds when previous-token heads take a larger share of their previous-token logit from the fast "
                "pairs than the other heads do, and keep more previous-token mass with only their fast pairs than "
                "with only their slow pairs in most of them",
    }
    if ablation["heads"] and shares["other_heads"] is not None:
        positional["measured"] = (
            f"{ablation['heads']} previous-token heads take {100 * shares['previous_token_heads']:.0f}% of their "
            f"previous-token logit from the {summary['pairs'] - summary['slow_pairs']} fast pairs (other heads: "
            f"{100 * shares['other_heads']:.0f}%); their previous-token mass {ablation['full']:.2f} becomes "
            f"{ablation['fast_only']:.2f} with only the fast pairs and {ablation['slow_only']:.2f} with only the "
            f"slow pairs (fast beats slow in {ablation['fast_beats_slow']} of {ablation['heads']})")
        positional["holds"] = (shares["previous_token_heads"] > shares["other_heads"]
                               and 2 * ablation["fast_beats_slow"] > ablation["heads"])
    else:
        positional["measured"], positional["holds"] = "no previous-token head above the threshold", None
    truncate = {
        "claim": "Rotating only the fastest pairs (p-RoPE) loses little: the slow pairs' rotation is dispensable.",
        "rule": "holds when the loss with p = 0.75 is within 2% of the full loss and below the loss without any "
                "rotation (p = 0); measured without training, on this text",
        "measured": "not measured (--quick, or a model with a scaling rule)", "holds": None,
    }
    if truncation:
        loss = {row["p"]: row["loss"] for row in truncation["rows"]}
        truncate["measured"] = ", ".join(f"p = {p:g}: {value:.4f}" for p, value in loss.items()) + " nats/token"
        truncate["holds"] = loss[0.75] <= 1.02 * loss[1.0] and loss[0.75] < loss[0.0]
    return [energy, positional, truncate]
