"""ropekit against Intel Extension for PyTorch's fused rotary ops, in one process (a standalone script).

IPEX 2.8 needs torch 2.8, so it runs in a virtual environment of its own; ropekit runs there from
its sources (its C++ kernel built against that torch on first use, cached apart from other
torches' builds). From the repository root::

    python3.11 -m venv .venv-ipex
    .venv-ipex/bin/pip install torch==2.8.0 intel-extension-for-pytorch==2.8.0 ninja numpy psutil
    PYTHONPATH=src:lab/src .venv-ipex/bin/python benchmarks/ipex_peer.py --threads 1

(On Linux, PyPI's torch 2.8.0 is the CUDA build, about 4 GB with its NVIDIA libraries; it runs on a
CPU-only machine. The lab is taken from its sources for its timing, nothing else of it is needed.)

Every call of one shape and dtype is timed in the same interleaved rounds as ``ropekit bench``
(:func:`ropekit_lab.bench_timing.interleaved`, the same shapes, budget and stopping rule), q and k
of ``(batch, seq, heads, head_dim)`` (IPEX's layout; a decode step's bytes lie as in ropekit
bench's ``(batch, heads, 1, head_dim)``), "half" pairs:

- floors: ``clone`` of q and k (out of place), ``mul_(1.0)`` (in place);
- ropekit: ``apply_rotary_qk(q, k, cos, sin)`` out of place and in place (tables ``(seq, 1, d/2)``),
  and ``RotaryEmbedding(head_dim)(q, k, offset=start, tensor_format="bshd")`` (the module, its own
  cached tables, by offset);
- IPEX: ``ipex.llm.functional.rotary_embedding(q, k, sin, cos, head_dim, True)`` (in place: IPEX
  writes the results back into q and k) and ``ipex.llm.modules.RotaryEmbedding`` (its own cached
  tables, by ``position_ids``; one call for q, one for k; out of place).

Before anything is timed, each call's result is compared with the float64 reference
(:func:`ropekit_lab.bench_peers.check`). The table gives the date, the versions, the machine's
load before and after, ``ms`` (the lower quartile of the samples), ``± %`` (its 95% uncertainty),
``× copy speed`` (floor time / time) and ``× IPEX`` (IPEX's time / time in the same mode: in
place against IPEX's functional form, out of place against its module). Usage::

    python benchmarks/ipex_peer.py [--quick] [--threads N] [--budget SECONDS] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Callable

import torch

import ropekit
from ropekit_lab.bench import FULL_BUDGET_S, FULL_SHAPES, QUICK_BUDGET_S, QUICK_SHAPES, SAMPLE_S, Shape
from ropekit_lab.bench_peers import check
from ropekit_lab.bench_rows import TARGET_PCT
from ropekit_lab.bench_timing import Plan, interleaved, machine_load

# IPEX's module computes its tables from float32 angles (position * inv_freq rounded to float32): at position
# 4095 they are off by up to about 2.4e-4 radians, so its results by as much relative to the largest value.
OWN_TABLES_SLACK = 1e-3
# (impl, mode, floor, IPEX row of the same mode) of each call, in table order
ROWS = {
    "copy": ("copy (x.clone)", "out-of-place", "copy", "ipex module"),
    "mul_": ("in-place pass (x.mul_)", "in-place", "mul_", "ipex functional"),
    "ipex functional": ("IPEX llm.functional.rotary_embedding", "in-place", "mul_", "ipex functional"),
    "ipex module": ("IPEX llm.modules.RotaryEmbedding", "out-of-place", "copy", "ipex module"),
    "ropekit": ("ropekit apply_rotary_qk", "out-of-place", "copy", "ipex module"),
    "ropekit in place": ("ropekit apply_rotary_qk", "in-place", "mul_", "ipex functional"),
    "ropekit module": ("ropekit RotaryEmbedding", "out-of-place", "copy", "ipex module"),
}


def case_calls(shape: Shape, dtype: torch.dtype, ipex) -> dict[str, Callable[[], object]]:
    """Every call of one shape and dtype, each checked against the float64 reference first."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(shape.batch, shape.seq, shape.q_heads, shape.head_dim, generator=gen).to(dtype)
    k = torch.randn(shape.batch, shape.seq, shape.k_heads, shape.head_dim, generator=gen).to(dtype)
    start = 4095 if shape.seq == 1 else 0  # decode: one new token after a 4k context, as in ropekit bench
    positions = torch.arange(start, start + shape.seq)
    inv_freq, _ = ropekit.inv_frequencies(shape.head_dim)
    cos, sin = ropekit.cos_sin(positions, inv_freq)
    cos_b, sin_b = cos[:, None], sin[:, None]  # (seq, 1, d/2): broadcast over the heads of (b, s, h, d)
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # IPEX takes float32 (seq, d)
    expected = tuple(ropekit.apply_reference(x, positions[:, None], inv_freq) for x in (q, k))
    rope = ropekit.RotaryEmbedding(shape.head_dim)
    ipex_rope = ipex.llm.modules.RotaryEmbedding(start + shape.seq, shape.head_dim, base=10000,
                                                 backbone="LlamaForCausalLM")
    position_ids = positions.expand(shape.batch, shape.seq).contiguous()
    half, d = shape.head_dim // 2, shape.head_dim
    q_in, k_in, q_mul, k_mul, q_ipex, k_ipex = (t.clone() for t in (q, k, q, k, q, k))

    def ipex_module():
        return (ipex_rope(q, position_ids, shape.q_heads, d, half, d),
                ipex_rope(k, position_ids, shape.k_heads, d, half, d))

    calls = {
        "copy": lambda: (q.clone(), k.clone()),
        "mul_": lambda: (q_mul.mul_(1.0), k_mul.mul_(1.0)),
        "ipex functional": lambda: ipex.llm.functional.rotary_embedding(q_ipex, k_ipex, full_sin, full_cos, d, True),
        "ipex module": ipex_module,
        "ropekit": lambda: ropekit.apply_rotary_qk(q, k, cos_b, sin_b),
        "ropekit in place": lambda: ropekit.apply_rotary_qk(q_in, k_in, cos_b, sin_b, inplace=True),
        "ropekit module": lambda: rope(q, k, offset=start, tensor_format="bshd"),
    }
    q0, k0 = q.clone(), k.clone()
    for name in ("ipex functional", "ipex module", "ropekit", "ropekit in place", "ropekit module"):
        check(ROWS[name][0], tuple(calls[name]()), expected, relative=OWN_TABLES_SLACK if name == "ipex module" else 0)
        for q_target, k_target in ((q_ipex, k_ipex), (q_in, k_in)):  # in-place rows: back to the unrotated inputs
            q_target.copy_(q0), k_target.copy_(k0)
        if not (torch.equal(q, q0) and torch.equal(k, k0)):
            raise RuntimeError(f"{ROWS[name][0]} wrote into q or k, which it was given out of place")
    return calls


def run(shapes: tuple[Shape, ...], dtypes: tuple[torch.dtype, ...], repeats: int, budget_s: float, ipex) -> list[dict]:
    """One row per call of every shape and dtype (the budget split over the cases, cheap ones first)."""
    cases = sorted(((s, d) for s in shapes for d in dtypes), key=lambda c: c[0].elements * c[1].itemsize)
    rows, used = [], 0.0
    for done, (shape, dtype) in enumerate(cases):
        plan = Plan(repeats, 20 * repeats, max(budget_s - used, 0.0) / (len(cases) - done), TARGET_PCT, SAMPLE_S)
        timings, seconds = interleaved(case_calls(shape, dtype, ipex), plan)
        used += seconds
        for name, (impl, mode, floor, peer) in ROWS.items():
            t = timings[name]
            rows.append({"shape": shape.name, "dtype": str(dtype).replace("torch.", ""), "impl": impl, "mode": mode,
                         "ms": t.estimate, "error_pct": t.error_pct, "median_ms": t.median, "repeats": t.repeats,
                         "ratio_copy": timings[floor].estimate / t.estimate,
                         "ratio_ipex": timings[peer].estimate / t.estimate})
    asked = [(s.name, str(d).replace("torch.", "")) for s in shapes for d in dtypes]
    return sorted(rows, key=lambda r: asked.index((r["shape"], r["dtype"])))


def header(ipex, threads: int, load: tuple[float | None, float | None], cores: int, used: str) -> list[str]:
    """The lines above the table: date, versions, threads, load."""
    before, after = ("n/a" if v is None else f"{v:.2f}" for v in load)
    now = datetime.datetime.now(datetime.timezone.utc)
    return [f"Measured {now:%Y-%m-%d %H:%M} UTC: ropekit from this checkout's sources, torch {torch.__version__}, "
            f"intel-extension-for-pytorch {ipex.__version__}, Python "
            f"{platform.python_version()}, {platform.processor() or platform.machine()}; {threads} thread(s); load "
            f"average {before} before and {after} after the run on {cores} cores; {used}.", ""]


def main(argv: list[str] | None = None) -> int:
    """Parse the options, time every case, print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="ropekit bench --quick's shapes, repeats and budget")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timed rounds in all")
    parser.add_argument("--json", action="store_true", help="rows as JSON")
    args = parser.parse_args(argv)
    try:
        import intel_extension_for_pytorch as ipex
    except ImportError as error:
        print(f"intel_extension_for_pytorch does not import here ({error}); see this script's docstring",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = args.budget if args.budget is not None else (QUICK_BUDGET_S if args.quick else FULL_BUDGET_S)
    before, cores = machine_load()
    rows = run(QUICK_SHAPES if args.quick else FULL_SHAPES, (torch.float32, torch.bfloat16), 5 if args.quick else 21,
               budget, ipex)
    after, _ = machine_load()
    if args.json:
        print(json.dumps({"torch": torch.__version__, "ipex": ipex.__version__, "threads": torch.get_num_threads(),
                          "load_avg": [before, after], "cores": cores, "rows": rows}, indent=1))
        return 0
    repeats = [r["repeats"] for r in rows]
    lines = header(ipex, torch.get_num_threads(), (before, after), cores,
                   f"{min(repeats)}-{max(repeats)} repeats per row, budget {budget:g} s")
    lines += ["| shape | dtype | impl | mode | ms | ± % | × copy speed | × IPEX |",
              "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        error = "" if r["error_pct"] is None else f"{r['error_pct']:.1f}"
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['impl']} | {r['mode']} | {r['ms']:.4f} | {error} | "
                     f"{r['ratio_copy']:.2f} | {r['ratio_ipex']:.2f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
