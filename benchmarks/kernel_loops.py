"""The CPU kernel's row loops alone, per element, against memcpy (a standalone script).

Compiles a small C++ driver around ``src/ropekit/ops/csrc/rotary_rows.h`` with the kernel's own
flags (:data:`ropekit.ops.build.COMMON_FLAGS`, ``-march=native``: the row loops the extension runs,
without torch, Python or threads) and times, on the rows of a decode step's q (``(16, 32, 1, 128)``,
one table row shared by every head: the loops that rotate four rows per table load), each dtype
and layout in place and out of place, and ``memcpy`` of the same bytes. Every time is the fastest
of ``--repeats`` calls (the rows stay in L2: this is the loops' cost, not the memory's), printed as
ns per element. Usage::

    python benchmarks/kernel_loops.py [--repeats 3000] [--compiler c++] [--csrc OTHER/src/ropekit/ops/csrc]

``--csrc`` builds another tree's loops (the same flags), for a before/after.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "src" / "ropekit" / "ops" / "csrc"

DRIVER = r"""
#include "rotary_rows.h"
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

typedef int (*row_fn)(void *, void *, const void *, const void *, const int64_t *, int64_t, int64_t);

static double best_ns(row_fn fn, void *x, void *out, const void *c, const void *s, const int64_t *p,
                      int64_t rows, int repeats) {
    double best = 1e30;
    for (int r = 0; r < repeats; r++) {
        auto t0 = std::chrono::steady_clock::now();
        fn(x, out, c, s, p, 0, rows);
        auto t1 = std::chrono::steady_clock::now();
        double ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
        if (ns < best) best = ns;
    }
    return best;
}

int main(int argc, char **argv) {
    const int repeats = argc > 1 ? atoi(argv[1]) : 3000;
    const int64_t batch = 16, heads = 32, d = 128, h = 64, rows = batch * heads, n = rows * d;
    std::vector<float> xf(n), of(n), c(h), s(h);
    std::vector<uint16_t> xb(n), ob(n), xh(n), oh(n);
    for (int64_t i = 0; i < n; i++) {
        float v = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
        xf[i] = v;
        uint32_t u;
        memcpy(&u, &v, 4);
        xb[i] = (uint16_t)(u >> 16);
        xh[i] = f16_store(v);
    }
    for (int64_t i = 0; i < h; i++) c[i] = cosf(0.1f * i), s[i] = sinf(0.1f * i);
    for (int interleaved = 0; interleaved < 2; interleaved++) {
        /* q of (16, 32, 1, 128): leading dims (16, 32), the tables broadcast over both */
        int64_t p[8 + 5 * 2] = {2, h, d, 4 | interleaved, 1, 1, 1, 1, batch, heads, heads * d, d, heads * d, d,
                                0, 0, 0, 0};
        const char *layout = interleaved ? "interleaved" : "half";
        struct { const char *name; row_fn fn; void *x, *o; } cases[] = {
            {"float32", ropekit_rotate_f32, xf.data(), of.data()},
            {"bfloat16", ropekit_rotate_bf16, xb.data(), ob.data()},
            {"float16", ropekit_rotate_f16, xh.data(), oh.data()},
        };
        for (auto &k : cases) {
            double out_of_place = best_ns(k.fn, k.x, k.o, c.data(), s.data(), p, rows, repeats);
            double in_place = best_ns(k.fn, k.x, k.x, c.data(), s.data(), p, rows, repeats);
            printf("%s %s %.4f %.4f\n", k.name, layout, out_of_place / n, in_place / n);
        }
    }
    for (int bytes = 2; bytes <= 4; bytes += 2) {
        double best = 1e30;
        for (int r = 0; r < repeats; r++) {
            auto t0 = std::chrono::steady_clock::now();
            memcpy(bytes == 4 ? (void *)of.data() : (void *)ob.data(),
                   bytes == 4 ? (const void *)xf.data() : (const void *)xb.data(), (size_t)(n * bytes));
            auto t1 = std::chrono::steady_clock::now();
            double ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
            if (ns < best) best = ns;
        }
        printf("memcpy-%d %.4f\n", bytes, best / n);
    }
    return 0;
}
"""


def main(argv: list[str] | None = None) -> int:
    """Build the driver, run it, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3000, help="calls of each loop; the fastest counts")
    parser.add_argument("--compiler", default=os.environ.get("CXX") or "c++")
    parser.add_argument("--csrc", type=Path, default=CSRC, help="the csrc folder whose loops to build")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(CSRC.parents[2]))
    from ropekit.ops.build import COMMON_FLAGS

    compiler = shutil.which(args.compiler)
    if compiler is None:
        print(f"no C++ compiler {args.compiler!r} here", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "loops.cpp", Path(tmp) / "loops"
        source.write_text(DRIVER, encoding="utf-8")
        subprocess.run([compiler, "-march=native", *COMMON_FLAGS, "-I", str(args.csrc), str(source), "-o", str(binary)],
                       check=True)
        lines = subprocess.run([str(binary), str(args.repeats)], check=True, capture_output=True,
                               text=True).stdout.splitlines()
    memcpy = {int(name.split("-")[1]): float(ns) for name, ns in (line.split() for line in lines
                                                                   if line.startswith("memcpy"))}
    print(f"{args.csrc}: {platform.processor() or platform.machine()}, {compiler}, flags -march=native "
          f"{' '.join(COMMON_FLAGS)}; "
          f"load average {os.getloadavg()[0]:.2f}; ns per element, fastest of {args.repeats} calls on the rows of "
          "a (16, 32, 1, 128) q (in L2)\n")
    print("| dtype | layout | out of place | in place | memcpy of the same bytes | out of place / memcpy |")
    print("|---|---|---:|---:|---:|---:|")
    for line in lines:
        if line.startswith("memcpy"):
            continue
        dtype, layout, out_of_place, in_place = line.split()
        copy = memcpy[4 if dtype == "float32" else 2]
        print(f"| {dtype} | {layout} | {float(out_of_place):.3f} | {float(in_place):.3f} | {copy:.3f} | "
              f"{float(out_of_place) / copy:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
