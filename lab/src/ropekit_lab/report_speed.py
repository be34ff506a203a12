"""The report's speed section: rows of :func:`ropekit_lab.bench.run` as a table that says what it shows.

At the top, once, when the machine was too busy to measure: a notice instead of a ``noisy`` flag
on most rows (:func:`ropekit_lab.bench_rows.busy_notice`). Above the table: how the rows were
measured, the shapes with their dims, the legend of its columns; below it: what each
implementation and mode that occurs is, and what each flag that occurs means. Flagged rows
carry their one-line note as a tooltip.
"""

from __future__ import annotations

from typing import Any

from .bench_rows import COLUMNS, DIMS, FLAGS, MODES, busy_notice, describe, measuring, shown_flags
from .report_html import esc, legend, table


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _flag_cell(row: dict[str, Any], busy: bool) -> str:
    flags = shown_flags(row, busy)
    if not flags:
        return ""
    return f'<span class="warn" title="{esc(row.get("note") or "")}">{esc(", ".join(flags))}</span>'


def _cells(row: dict[str, Any], busy: bool) -> list[Any]:
    """One row in the order of :data:`COLUMNS` (numbers stay numbers, text is escaped)."""
    return [esc(row["shape"]), esc(row["dtype"]), esc(row["impl"]), esc(row["mode"]), row["ms"],
            _round(row.get("error_pct"), 1), _round(row.get("spread_pct"), 0), _round(row["gbps"], 1),
            _round(row["ratio_copy"], 2), _round(row["ratio_hf"], 1), _round(row["saved_mb"], 1),
            _round(row.get("peak_mb"), 1), _flag_cell(row, busy)]


def speed_section(rows: list[dict[str, Any]]) -> str:
    """HTML of the speed section for benchmark ``rows`` (the peak-memory column only when a row has it)."""
    notice = busy_notice(rows)
    keep = [i for i, (header, _) in enumerate(COLUMNS) if header != "peak MiB"
            or any(r.get("peak_mb") is not None for r in rows)]
    columns = [COLUMNS[i] for i in keep]
    body = [[cells[i] for i in keep] for cells in (_cells(r, notice is not None) for r in rows)]
    shapes = dict.fromkeys((r["shape"], "&times;".join(str(v) for v in r["dims"])) for r in rows)
    devices = ", ".join(dict.fromkeys(r["device"] for r in rows))
    flagged = sum(bool(shown_flags(r, notice is not None)) for r in rows)
    intro = (
        (f'<p class="notice"><b>{esc(notice)}</b></p>' if notice else "")
        + f"<p>From <code>ropekit_lab.bench.run(quick=True)</code> on {esc(devices)}. RoPE is memory-bound, so "
        "each row is timed in the same rounds as a floor that moves the same bytes: the ratio to it is the "
        "measurement, the absolute time on a shared machine is not. " + esc(measuring(rows)) + " "
        + (f"<b>{flagged} of {len(rows)} rows are flagged</b>: their numbers reflect the machine, not the code."
           if flagged else "No row is flagged.")
        + "</p><p>Shapes (dims = " + esc(DIMS) + "): "
        + "; ".join(f'<b class="nw">{esc(name)}</b> <span class="nw">{dims}</span>' for name, dims in shapes)
        + ". A decode shape has one new token per sequence, after a 4,096-token context.</p>")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    flags = [flag for flag in FLAGS if any(flag in shown_flags(r, notice is not None) for r in rows)]
    after = (legend("speed-impl", [(name, esc(describe(name))) for name in impls],
                    "<b>impl</b>: what each row times.")
             + legend("speed-mode", [(name, esc(MODES.get(name, ""))) for name in modes], "<b>mode</b>:")
             + (legend("speed-flag", [(name, esc(FLAGS[name])) for name in flags],
                       "<b>flag</b> (a row's own reason shows when you point at its flag):") if flags else ""))
    meanings = [(header, esc(meaning)) for header, meaning in columns]
    text = [i for i, (header, _) in enumerate(columns) if header in ("impl", "flag")]
    return intro + table(meanings, body, name="speed", text_columns=text, stack="tablet") + after
