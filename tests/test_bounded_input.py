"""Bad input ends at once: one line, exit code 2, in bounded time and memory, before any large allocation.

Each row of the table is a command line that once ran for minutes or allocated gigabytes before
it failed (or never failed: a FIFO, ``/dev/zero``), or ended in a traceback. Each runs in its own
child process under a small runner that reports the child's peak resident memory
(``getrusage(RUSAGE_CHILDREN).ru_maxrss``); the wall time is measured around it. The bounds are
generous (a loaded shared machine starts torch and transformers slowly); the old behaviour
missed them by minutes and gigabytes.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ropekit

# the children run in a scratch folder: they import this ropekit, wherever the tests found it
SOURCE = str(Path(ropekit.__file__).resolve().parents[1])
ENV = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [SOURCE, os.environ.get("PYTHONPATH")]))}
SECONDS = 60.0
PEAK_BYTES = 1.5 * 2**30

# runs argv, prints the child's peak RSS in kB on the last line of stdout; exits with the child's code
RUNNER = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(done.returncode)
"""


def tiny_variant(base: Path, target: Path, **changes) -> Path:
    """A copy of the tiny model directory ``base`` whose config.json has ``changes``."""
    shutil.copytree(base, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def tiny_gguf(path: Path, block_count: int, layers: int = 2) -> Path:
    """A GGUF file of ``layers`` blocks of q weights whose metadata claims ``block_count`` blocks."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(block_count)
    writer.add_embedding_length(32)
    writer.add_head_count(4)
    writer.add_context_length(64)
    writer.add_feed_forward_length(64)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((32, 32), np.float32))
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Crafted files: configs, model directories, GGUFs, a FIFO, device links."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    from probe_helpers import tiny_model_dir

    root = tmp_path_factory.mktemp("bounded")
    llama = tiny_model_dir(root / "llama")
    good = tiny_gguf(root / "good.gguf", block_count=2)
    truncated = root / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-100])
    fifo = root / "fifo.safetensors"
    os.mkfifo(fifo)
    text_fifo = root / "fifo.txt"
    os.mkfifo(text_fifo)
    urandom = root / "random.safetensors"
    urandom.symlink_to("/dev/urandom")
    configs = {
        "head_dim": {"hidden_size": 64, "num_attention_heads": 1, "head_dim": 2**33},
        "yarn": {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 4096,
                 "rope_scaling": {"rope_type": "yarn", "factor": 1e20, "original_max_position_embeddings": 4096}},
    }
    for name, config in configs.items():
        (root / f"{name}.json").write_text(json.dumps(config))
    return {
        "root": root, "llama": llama, "fifo": fifo, "text_fifo": text_fifo, "urandom": urandom,
        "truncated": truncated, "blocks": tiny_gguf(root / "blocks.gguf", block_count=1_000_000),
        "layers": tiny_variant(llama, root / "layers", num_hidden_layers=1_000_000),
        "heads0": tiny_variant(llama, root / "heads0", num_attention_heads=0),
        "kv0": tiny_variant(llama, root / "kv0", num_key_value_heads=0),
        "wide": tiny_variant(llama, root / "wide", hidden_size=4096),
        "vocab": tiny_variant(llama, root / "vocab", vocab_size=10**9),
        "negative": tiny_variant(llama, root / "negative", intermediate_size=-5),
        "layers_str": tiny_variant(llama, root / "layers_str", num_hidden_layers="2"),
        **{name: root / f"{name}.json" for name in configs},
    }


def cases(f) -> dict[str, tuple[tuple[str, ...], str]]:
    """Case name -> (command line, words its one-line error must contain)."""
    prompt = ("--prompt", "In the beginning God created the heaven and the earth")

    def probe(option, path, *rest):
        return ("probe", option, str(path), *(rest or prompt), "--out", str(f["root"] / "probe-out"))

    return {
        "inspect-context-1e23": (("inspect", "--context", str(10**23), "--no-bound"),
                                 "--context: expected a positive int <= 1,099,511,627,776"),
        "inspect-head-dim-2**33": (("inspect", "--config", str(f["head_dim"])), "head_dim must be at most 65,536"),
        "inspect-yarn-factor-1e20": (("inspect", "--config", str(f["yarn"])), "YaRN: factor must be at most 1,048,576"),
        "decay-dim-1e9": (("decay", "--dim", str(10**9), "--max-distance", "10"),
                          "--dim must be a positive even number"),
        "decay-work": (("decay", "--dim", "65536", "--max-distance", "10000000"), "terms; at most"),
        "convert-fifo": (("convert", str(f["fifo"]), str(f["root"] / "a.safetensors"), "--to", "half", "--heads", "2"),
                         "not a regular file"),
        "convert-device": (("convert", str(f["urandom"]), str(f["root"] / "b.safetensors"), "--to", "half", "--heads",
                            "2"), "not a regular file"),
        "train-context-1e12": (("train", "--quick", "--context", str(10**12), "--out", str(f["root"] / "train-out")),
                               "--context: expected an integer <= 4,096"),
        "extrapolate-finetune-steps-1e15": (("extrapolate", "--quick", "--finetune-steps", str(10**15)),
                                            "--finetune-steps: expected an integer <="),
        "probe-1e6-layers": (probe("--model", f["layers"]),
                             "the config says num_hidden_layers=1,000,000 but the weights hold 2 layers"),
        "probe-hidden-size": (probe("--model", f["wide"]), "the weights hold (64, 32)"),
        "probe-vocab-1e9": (probe("--model", f["vocab"]), "the weights hold (64, 32)"),
        "probe-zero-heads": (probe("--model", f["heads0"]), "transformers cannot read its config"),
        "probe-zero-kv-heads": (probe("--model", f["kv0"]), "by zero"),
        "probe-negative-size": (probe("--model", f["negative"]), "negative dimension"),
        "probe-layers-as-string": (probe("--model", f["layers_str"]), "transformers cannot read its config"),
        "probe-gguf-1e6-blocks": (probe("--gguf", f["blocks"]),
                                  "llama.block_count=1,000,000 but the weights hold 2 layers"),
        "probe-gguf-truncated": (probe("--gguf", f["truncated"]), "not a readable GGUF file, truncated or corrupt"),
        "probe-text-dev-zero": (probe("--model", f["llama"], "--text", "/dev/zero"), "not a regular file"),
        "probe-text-fifo": (probe("--model", f["llama"], "--text", str(f["text_fifo"])), "not a regular file"),
    }


CASES = list(cases(dict.fromkeys(("root", "llama", "fifo", "text_fifo", "urandom", "truncated", "blocks", "layers",
                                  "heads0", "kv0", "wide", "vocab", "negative", "layers_str", "head_dim", "yarn"),
                                 Path("."))))


def run_bounded(argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float, int]:
    """``(completed, seconds, peak RSS bytes)`` of ``python -m ropekit *argv`` (killed after twice the bound)."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", RUNNER, sys.executable, "-m", "ropekit", *argv], cwd=cwd,
                              capture_output=True, text=True, env=ENV, timeout=2 * SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv}: still running after {2 * SECONDS:.0f} s")
    seconds = time.perf_counter() - start
    *out, peak_kb = done.stdout.splitlines() or ["0"]
    return subprocess.CompletedProcess(argv, done.returncode, "\n".join(out), done.stderr), seconds, int(peak_kb) * 1024


@pytest.mark.parametrize("case", CASES)
def test_bad_input_fails_fast_in_one_line_without_a_large_allocation(inputs, case):
    argv, words = cases(inputs)[case]
    done, seconds, peak = run_bounded(list(argv), inputs["root"])
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, (argv, done.returncode, done.stderr[-2000:])
    assert lines[0].startswith(f"ropekit {argv[0]}: error: ") and words in lines[0], lines[0]
    assert seconds < SECONDS, f"{seconds:.1f} s"
    assert peak < PEAK_BYTES, f"peak RSS {peak / 2**20:.0f} MiB"
