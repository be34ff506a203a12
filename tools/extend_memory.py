"""Time and peak memory of one ``ropekit extend`` forward of SmolLM2-135M per length, on the CPU.

    python tools/extend_memory.py --lengths 4096 8192 16384 32768 --layers 2

Each length runs in a fresh child process (so that its peak resident memory is its own): the
example model (``ropekit_lab.probe_models.load_example``) cut to its first ``--layers`` decoder
layers, one window of that many tokens of the KJV through
:func:`ropekit_lab.extend_eval.evaluate_window` (prefill with the KV cache, blockwise LM head, the
greedy passkey answer), plain RoPE. Printed per length: the child's CPU seconds and wall seconds
for the window, the CPU seconds inside the kept decoder layers (hooks on the first and last), its
peak RSS (``getrusage``), and the whole model's figures estimated from them: the rest of the
window (embedding, LM head, the passkey answer) plus the layers' time scaled to all layers, and the
peak plus the KV cache of the layers left out (``2 x kv_heads x head_dim x T x 4`` bytes each).
``--layers 0`` keeps every layer (no estimate).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, resource, sys, time
import torch
from ropekit import RopeConfig
from ropekit_lab import extend as lab_extend
from ropekit_lab.extend_eval import evaluate_window, passkey_window, peak_rss_mb
from ropekit_lab.probe_models import load_example

length, layers = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
loaded = load_example()
model = loaded.model
total = len(model.model.layers)
if layers:
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
text, _ = lab_extend.default_text()
ids = lab_extend.text_ids_for(loaded.tokenizer, text, length, "--text")
window = passkey_window(loaded.tokenizer, ids, length, 0.5, seed=0)
rope = RopeConfig.from_hf(model.config)
lab_extend.load_attention(model)
marks = []
first, last = model.model.layers[0], model.model.layers[-1]
first.register_forward_pre_hook(lambda m, a: marks.append(("in", time.process_time())))
last.register_forward_hook(lambda m, a, o: marks.append(("out", time.process_time())))
cpu, wall = time.process_time(), time.perf_counter()
evaluate_window(model, window, rope, loaded.tokenizer)
layers_cpu = next(t for kind, t in marks if kind == "out") - marks[0][1]  # the prefill: the first pass
cfg = model.config
print(json.dumps({"length": length, "layers": layers or total, "total_layers": total,
                  "cpu_s": time.process_time() - cpu, "layers_cpu_s": layers_cpu, "wall_s": time.perf_counter() - wall,
                  "peak_rss_mb": peak_rss_mb(), "kv_heads": cfg.num_key_value_heads, "head_dim": rope.head_dim,
                  "load": __import__("os").getloadavg()[0]}))
"""


def main() -> int:
    """Run each length in a child process; print one JSON line per length with the estimates."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept (0: all)")
    args = parser.parse_args()
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    for length in args.lengths:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, str(length), str(args.layers)], capture_output=True,
                              text=True, env=env, check=False)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        row = json.loads(done.stdout.strip().splitlines()[-1])
        scale = row["total_layers"] / row["layers"]
        missing = row["total_layers"] - row["layers"]
        cache_mb = missing * 2 * row["kv_heads"] * row["head_dim"] * length * 4 / 2**20
        row |= {"est_cpu_s": row["cpu_s"] + row["layers_cpu_s"] * (scale - 1),
                "est_peak_rss_mb": row["peak_rss_mb"] + cache_mb, "child_s": time.perf_counter() - start}
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
