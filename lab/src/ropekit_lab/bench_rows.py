"""Reading the rows of :func:`ropekit_lab.bench.run`: what each name and column means, which rows to distrust.

The benchmark times every row next to a floor that moves the same bytes (``x.clone()`` out of
place, ``x.mul_(1.0)`` in place, two clones for forward + backward). :func:`judge` flags the rows
whose numbers say more about the machine than about the kernel:

- ``noisy``: the interquartile range of the repeats exceeds :data:`NOISE_LIMIT_PCT` of the
  median, for the row or for its floor; the ratio between them is then not a measurement.
- ``beats floor``: a row bound by its floor (a rotation reads and writes exactly what the copy
  reads and writes, and allocates the same output) runs faster than the floor by more than
  :data:`FLOOR_SLACK` widened by both spreads. No kernel can do that; a floor timed while the
  allocator faulted in fresh pages, or another job on the machine, can. Rows moving less than
  :data:`BOUND_MIN_BYTES` are exempt: there a call's fixed cost, not its bytes, sets the time.

:data:`IMPLEMENTATIONS`, :data:`MODES` and :data:`COLUMNS` say in one line each what the
implementations, the modes and the columns are; :func:`format_table` prints the rows with them.
"""

from __future__ import annotations

from typing import Any

#: Rows that are floors or references themselves, not implementations judged against a floor.
COPY, INPLACE_PASS, ROUND_TRIP = "copy (x.clone)", "in-place pass (x.mul_)", "float32 round trip (x -> f32 -> x)"
REFERENCES = (COPY, INPLACE_PASS, ROUND_TRIP)

NOISE_LIMIT_PCT = 10.0
FLOOR_SLACK = 0.3
BOUND_MIN_BYTES = 4 << 20

DIMS = "batch × query heads × key heads × sequence length × head_dim"

IMPLEMENTATIONS = {
    COPY: "out-of-place floor: x.clone() of q and k, the same allocation and bytes as a rotation's output",
    INPLACE_PASS: "in-place floor: x.mul_(1.0) on q and k, one read and one write of each element",
    ROUND_TRIP: "reference for 16-bit dtypes on a CPU: q and k converted to float32 and back into preallocated "
                "tensors by torch, the least work of any kernel that computes in float32",
    "transformers eager": "transformers' own apply_rotary_pos_emb (Llama): q·cos + rotate_half(q)·sin with "
                          "full-width tables in the activation dtype",
    "transformers + torch.compile": "the same transformers recipe compiled by torch.compile",
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
}

#: ``(header, meaning)`` of each column of the speed table, in order.
COLUMNS = (
    ("shape", f"the case timed; its dims are {DIMS}"),
    ("dtype", "dtype of q and k (the tables stay float32 in ropekit)"),
    ("impl", "what is timed (listed below the table)"),
    ("mode", "out-of-place, in-place or fwd+bwd (forward and backward)"),
    ("ms", "median wall time of one call on q and k over the repeats, in milliseconds"),
    ("spread %", "interquartile range of the repeats as a percentage of the median"),
    ("GB/s", "bytes read and written (q and k, once each way) per second, at the median"),
    ("× copy speed", "floor time / this time: 1 = as fast as moving the same bytes, the best a rotation can do "
                     "up to noise"),
    ("× transformers", "transformers' eager time / this time, in the same mode (blank in place: it has none)"),
    ("saved MiB", "memory autograd keeps for the backward pass (forward + backward rows)"),
    ("peak MiB", "CUDA only: peak memory allocated by a forward + backward step"),
    ("flag", "noisy or beats floor: a row whose numbers are not a measurement (explained below the table)"),
)

FLAGS = {
    "noisy": f"the spread of this row or of its floor is over {NOISE_LIMIT_PCT:.0f}% of the median: its ratios "
             "are not reliable; run again on a quieter machine or with more repeats",
    "beats floor": "faster than copying the same bytes by more than the noise allows: a rotation reads and writes "
                   "what the copy does, so this is a measurement artefact, not a speed-up",
}


def describe(impl: str) -> str:
    """One line saying what ``impl`` (a row's ``impl``) times."""
    return IMPLEMENTATIONS.get(impl, "a backend registered with ropekit.ops.register")


def judge(row: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    """``{"flags": [...], "note": str | None}`` for a row against its floor.

    Args:
        row: a row's ``impl``, ``ratio_copy`` (floor time / its time), ``spread_pct`` (``None``
            when unknown) and ``bytes`` (moved by the call).
        floor: the floor's ``spread_pct``.
    """
    spreads = [s for s in (row.get("spread_pct"), floor.get("spread_pct")) if s is not None]
    flags, notes = [], []
    if spreads and max(spreads) > NOISE_LIMIT_PCT:
        flags.append("noisy")
        notes.append(f"spread {max(spreads):.0f}% of the median (limit {NOISE_LIMIT_PCT:.0f}%)")
    bound = row["impl"] not in REFERENCES and row["bytes"] >= BOUND_MIN_BYTES
    limit = (1 + FLOOR_SLACK) * (1 + sum(spreads) / 100)
    if bound and row["ratio_copy"] > limit:
        flags.append("beats floor")
        notes.append(f"{row['ratio_copy']:.2f}x the speed of a floor that moves the same bytes, above the "
                     f"{limit:.2f}x noise allows: a measurement artefact")
    return {"flags": flags, "note": "; ".join(notes) or None}


def _number(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def format_table(rows: list[dict]) -> str:
    """Rows as a Markdown table (the :data:`COLUMNS`), then one line per flag that occurs."""
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = [r["shape"], r["dtype"], r["impl"], r["mode"], f"{r['ms']:.3f}", _number(r.get("spread_pct"), 0),
                 f"{r['gbps']:.1f}", f"{r['ratio_copy']:.2f}", _number(r["ratio_hf"], 1),
                 _number(r["saved_mb"], 1), _number(r.get("peak_mb"), 1), ", ".join(r.get("flags", ()))]
        lines.append("| " + " | ".join(cells) + " |")
    seen = {flag for r in rows for flag in r.get("flags", ())}
    lines += [f"{flag}: {FLAGS[flag]}" for flag in FLAGS if flag in seen]
    return "\n".join(lines)
