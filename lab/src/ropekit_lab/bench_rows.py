"""Reading the rows of :func:`ropekit_lab.bench.run`: what each name and column means, which rows to distrust.

The benchmark times every row next to a floor that moves the same bytes (``x.clone()`` out of
place, ``x.mul_(1.0)`` in place, two clones for forward + backward). :func:`judge` flags the rows
whose numbers say more about the machine than about the kernel:

- ``noisy``: the time of the row or of its floor is uncertain by more than :data:`NOISE_LIMIT_PCT`
  (``error_pct``: half-width of a 95% interval, :mod:`ropekit_lab.bench_timing`) after the
  measurement's time budget; the ratio between them is then not a measurement.
- ``beats floor``: a row bound by its floor (a rotation reads and writes exactly what the copy
  reads and writes, and allocates the same output) runs faster than the floor by more than
  :data:`FLOOR_SLACK` widened by both uncertainties. No kernel can do that; a floor timed while the
  allocator faulted in fresh pages, or another job on the machine, can. Rows moving less than
  :data:`BOUND_MIN_BYTES` are exempt: there a call's fixed cost, not its bytes, sets the time.

When the machine was too busy to measure (more than :data:`BUSY_SHARE` of the rows noisy, or a
load average above its cores), :func:`busy_notice` says so in one line, and the table shows no
row's ``noisy`` flag (:func:`shown_flags`): one notice instead of a flag on most rows.
:func:`measuring` says how the rows were measured. :data:`IMPLEMENTATIONS`, :data:`MODES` and
:data:`COLUMNS` say in one line each what the implementations, the modes and the columns are;
:func:`format_table` prints the rows with them.
"""

from __future__ import annotations

from typing import Any

#: Rows that are floors or references themselves, not implementations judged against a floor.
COPY, INPLACE_PASS, ROUND_TRIP = "copy (x.clone)", "in-place pass (x.mul_)", "float32 round trip (x -> f32 -> x)"
#: The floor of a cache write: k and v copied into their slots, nothing rotated.
CACHE_COPY = "cache copy (index_copy_ of k, v)"
REFERENCES = (COPY, INPLACE_PASS, ROUND_TRIP, CACHE_COPY)
#: The fused forms' rows (decode steps): q/k norm + rotation, and keys rotated into a cache.
NORM_EAGER, NORM_COMPILE, NORM_OURS = ("transformers Qwen3RMSNorm + rotation",
                                       "transformers Qwen3RMSNorm + rotation, torch.compile",
                                       "ropekit rms_norm_rotary_qk")
CACHE_EAGER, CACHE_COMPILE, CACHE_OURS = ("transformers rotate then index_copy_",
                                          "transformers rotate then index_copy_, torch.compile",
                                          "ropekit rotate_into_cache")

NOISE_LIMIT_PCT = 10.0
#: The uncertainty (%) at which a call's time is known and it leaves the rounds: half the noise limit.
TARGET_PCT = NOISE_LIMIT_PCT / 2
FLOOR_SLACK = 0.3
BOUND_MIN_BYTES = 4 << 20
BUSY_SHARE = 1 / 3

DIMS = "batch × query heads × key heads × sequence length × head_dim"

IMPLEMENTATIONS = {
    COPY: "out-of-place floor: x.clone() of q and k, the same allocation and bytes as a rotation's output",
    INPLACE_PASS: "in-place floor: x.mul_(1.0) on q and k, one read and one write of each element",
    ROUND_TRIP: "reference for 16-bit dtypes on a CPU: q and k converted to float32 and back into preallocated "
                "tensors by torch, the least work of any kernel that computes in float32",
    "transformers eager": "transformers' own apply_rotary_pos_emb (Llama): q·cos + rotate_half(q)·sin with "
                          "full-width tables in the activation dtype",
    "transformers + torch.compile": "the same transformers recipe compiled by torch.compile (full run only)",
    CACHE_COPY: "floor of a cache write: index_copy_ of k and v into their static-cache slot, nothing rotated",
    NORM_EAGER: "transformers' Qwen3RMSNorm on q and on k, then its apply_rotary_pos_emb (eager)",
    NORM_COMPILE: "the same norms and rotation compiled by torch.compile (full run only)",
    NORM_OURS: "ropekit.rms_norm_rotary_qk: both norms and the rotation in one pass",
    CACHE_EAGER: "k rotated by transformers' recipe, then k and v index_copy_'d into their slot (StaticCache's write)",
    CACHE_COMPILE: "the same rotation and cache write compiled by torch.compile (full run only)",
    CACHE_OURS: "ropekit.rotate_into_cache: k rotated and v copied straight into their slots, one pass",
    "liger-kernel": "Liger's Triton RoPE kernel (liger-kernel, CUDA, in place)",
    "ropekit auto": "ropekit.apply_rotary_qk with backend=\"auto\", forward then backward (a rotation of the "
                    "gradient by −θ)",
    "cpu": "ropekit's native C kernel (backend=\"cpu\"): compiled at first use, q and k in one call, rows split "
           "over torch's threads",
    "torch": "ropekit's portable backend (backend=\"torch\"): plain torch ops on float32 chunks, any device",
    "triton": "ropekit's fused Triton kernel (backend=\"triton\", CUDA): q and k in one launch",
}

MODES = {
    "out-of-place": "writes new q and k tensors; timed against the copy floor",
    "in-place": "overwrites q and k; timed against the in-place floor",
    "fwd+bwd": "forward and backward with autograd; timed against two copies",
    "norm + rotation": "q and k normalised (RMSNorm per head, Qwen3's) then rotated, out of place; timed against "
                       "the copy floor (decode steps)",
    "into cache": "k rotated and written with v into the last slot of a (batch, kv_heads, 256, head_dim) cache; "
                  "timed against the cache copy floor (decode steps)",
}

#: ``(header, meaning)`` of each column of the speed table, in order.
COLUMNS = (
    ("shape", f"the case timed; its dims are {DIMS}"),
    ("dtype", "dtype of q and k (the tables stay float32 in ropekit)"),
    ("impl", "what is timed (listed below the table)"),
    ("mode", "out-of-place, in-place or fwd+bwd (forward and backward)"),
    ("ms", "wall time of one call on q and k, in milliseconds: the lower quartile of the repeats, interleaved "
           "with the other calls of the same shape and dtype"),
    ("± %", "uncertainty of ms: half-width of its 95% confidence interval, as a percentage of it"),
    ("spread %", "spread of the repeats: their interquartile range as a percentage of their median (a busy machine "
                 "keeps it wide however long one measures)"),
    ("GB/s", "bytes read and written (q and k, once each way) per second, at ms"),
    ("× copy speed", "floor time / this time: 1 = as fast as moving the same bytes, the best a rotation can do "
                     "up to noise"),
    ("× transformers", "transformers' eager time / this time, in the same mode (blank in place: it has none)"),
    ("saved MiB", "memory autograd keeps for the backward pass (forward + backward rows)"),
    ("peak MiB", "CUDA only: peak memory allocated by a forward + backward step"),
    ("flag", "noisy or beats floor: a row whose numbers are not a measurement (explained below the table)"),
)

FLAGS = {
    "noisy": f"the time of this row or of its floor is uncertain by more than {NOISE_LIMIT_PCT:.0f}% after the "
             "time budget: its ratios are not reliable; run again on a quieter machine or with a larger budget",
    "beats floor": "faster than copying the same bytes by more than the noise allows: a rotation reads and writes "
                   "what the copy does, so this is a measurement artefact, not a speed-up",
}


def describe(impl: str) -> str:
    """One line saying what ``impl`` (a row's ``impl``) times."""
    return IMPLEMENTATIONS.get(impl, "a backend registered with ropekit.ops.register")


def judge(row: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    """``{"flags": [...], "note": str | None}`` for a row against its floor.

    Args:
        row: a row's ``impl``, ``ratio_copy`` (floor time / its time), ``error_pct`` (``None``
            when unknown) and ``bytes`` (moved by the call).
        floor: the floor's ``error_pct``.
    """
    errors = [e for e in (row.get("error_pct"), floor.get("error_pct")) if e is not None]
    flags, notes = [], []
    if errors and max(errors) > NOISE_LIMIT_PCT:
        flags.append("noisy")
        notes.append(f"time uncertain by {max(errors):.0f}% (limit {NOISE_LIMIT_PCT:.0f}%)")
    bound = row["impl"] not in REFERENCES and row["bytes"] >= BOUND_MIN_BYTES
    limit = (1 + FLOOR_SLACK) * (1 + sum(errors) / 100)
    if bound and row["ratio_copy"] > limit:
        flags.append("beats floor")
        notes.append(f"{row['ratio_copy']:.2f}x the speed of a floor that moves the same bytes, above the "
                     f"{limit:.2f}x the uncertainty allows: a measurement artefact")
    return {"flags": flags, "note": "; ".join(notes) or None}


def _noisy(rows: list[dict]) -> int:
    return sum("noisy" in (r.get("flags") or ()) for r in rows)


def busy_notice(rows: list[dict]) -> str | None:
    """One line saying the machine was too busy to measure, or ``None`` when it was not.

    Too busy: more than :data:`BUSY_SHARE` of the rows noisy, or the load average at the start
    above the cores (a row's ``load_avg`` and ``cores``).
    """
    if not rows:
        return None
    noisy, load, cores = _noisy(rows), rows[0].get("load_avg"), rows[0].get("cores")
    overloaded = load is not None and cores is not None and load > cores
    if not (overloaded or noisy > BUSY_SHARE * len(rows)):
        return None
    load_text = "" if load is None else f"; load average {load:.1f} on {cores} cores"
    return (f"This machine was too busy to measure: {noisy} of {len(rows)} rows stayed noisy{load_text}. "
            "Their ratios are indicative only (per-row noise flags are left out); run again on a quieter machine.")


def shown_flags(row: dict[str, Any], busy: bool) -> list[str]:
    """The flags a table shows for ``row``: all of them, or all but ``noisy`` when :func:`busy_notice` spoke."""
    return [flag for flag in row.get("flags") or () if not (busy and flag == "noisy")]


def measuring(rows: list[dict]) -> str:
    """One sentence on how ``rows`` were measured (budget, seconds used, repeats, rows still noisy, load)."""
    if not rows or rows[0].get("budget_s") is None:
        return ""
    first, repeats = rows[0], [r["repeats"] for r in rows if r.get("repeats") is not None]
    rounds = f"{min(repeats)}-{max(repeats)}" if repeats and min(repeats) != max(repeats) else f"{max(repeats or [0])}"
    load = "" if first.get("load_avg") is None else f"; load average {first['load_avg']:.1f} on {first['cores']} cores"
    return (f"Timed in interleaved rounds until each time was known to within {TARGET_PCT:g}% or the "
            f"{first['budget_s']:g} s budget was spent: {first['used_s']:.1f} s used, {rounds} repeats per row, "
            f"{_noisy(rows)} of {len(rows)} rows still noisy{load}.")


def _number(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def format_table(rows: list[dict]) -> str:
    """The rows as text: the busy notice (if any), a Markdown table, the flags and the measuring.

    The table has the :data:`COLUMNS`; below it, one line per flag shown, then :func:`measuring`.
    """
    notice = busy_notice(rows)
    lines = [notice] if notice else []
    lines += ["| " + " | ".join(name for name, _ in COLUMNS) + " |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    shown = set()
    for r in rows:
        flags = shown_flags(r, notice is not None)
        shown.update(flags)
        cells = [r["shape"], r["dtype"], r["impl"], r["mode"], f"{r['ms']:.3f}", _number(r.get("error_pct"), 1),
                 _number(r.get("spread_pct"), 0), f"{r['gbps']:.1f}", f"{r['ratio_copy']:.2f}",
                 _number(r["ratio_hf"], 1), _number(r["saved_mb"], 1), _number(r.get("peak_mb"), 1), ", ".join(flags)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"{flag}: {FLAGS[flag]}" for flag in FLAGS if flag in shown]
    summary = measuring(rows)
    return "\n".join(lines + ([summary] if summary else []))
