"""Shared fixtures of the ``ropekit convert`` tests: small random checkpoints and ways to run the verb."""

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from ropekit.cli import convert as conv

SRC = Path(__file__).resolve().parent.parent / "src"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
HEADS, KV, HEAD_DIM, HIDDEN = 4, 2, 8, 16
H2I = ("--from", "half", "--to", "interleaved")
RECORDED = {"ropekit_heads": "4", "ropekit_kv_heads": "2", "ropekit_head_dim": "8", "ropekit_rotary_dim": "8"}


def parse(*argv):
    parser = argparse.ArgumentParser()
    conv.add_parser(parser.add_subparsers(dest="verb"))
    return parser.parse_args(["convert", *map(str, argv)])


def run(*argv):
    return conv.run(parse(*argv))


def state(layers=2, bias=False, meta=False, kv=KV, head_dim=HEAD_DIM, seed=1):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(layers):
        if meta:
            p = f"layers.{i}.attention."
            names = {"q": p + "wq", "k": p + "wk", "v": p + "wv"}
        else:
            p = f"model.layers.{i}.self_attn."
            names = {"q": p + "q_proj", "k": p + "k_proj", "v": p + "v_proj"}
        sd[names["q"] + ".weight"] = torch.randn(HEADS * head_dim, HIDDEN, generator=g).to(torch.bfloat16)
        sd[names["k"] + ".weight"] = torch.randn(kv * head_dim, HIDDEN, generator=g).to(torch.bfloat16)
        sd[names["v"] + ".weight"] = torch.randn(kv * head_dim, HIDDEN, generator=g).to(torch.float16)
        if bias:
            sd[names["q"] + ".bias"] = torch.randn(HEADS * head_dim, generator=g).to(torch.bfloat16)
            sd[names["k"] + ".bias"] = torch.randn(kv * head_dim, generator=g).to(torch.bfloat16)
    sd["model.embed_tokens.weight"] = torch.randn(32, HIDDEN, generator=g).to(torch.float16)
    sd["model.norm.weight"] = torch.randn(HIDDEN, generator=g)
    sd["step"] = torch.tensor([7], dtype=torch.int64)
    return sd


def write_sharded(sd, directory: Path):
    directory.mkdir()
    names = list(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(directory / fname), metadata={"format": "pt", "origin": fname})
        weight_map.update({k: fname for k in keys})
    index = {"metadata": {"total_size": 123}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def digest(path: Path):
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8) if a[name].dim() else a[name],
                           b[name].view(torch.uint8) if b[name].dim() else b[name]), name




def cli(*argv, cwd=None, timeout=300):
    """``python -m ropekit convert ARGV`` as a real subprocess (the same environment, threads pinned)."""
    return subprocess.run([sys.executable, "-m", "ropekit", "convert", *map(str, argv)], capture_output=True,
                          text=True, env=ENV, cwd=cwd, timeout=timeout)


def llama_config(heads=HEADS, kv=KV, head_dim=HEAD_DIM, **extra):
    """A config.json dict of the Llama family for ``state()``'s shapes."""
    return {"model_type": "llama", "hidden_size": HIDDEN, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": head_dim, "rope_theta": 10000.0, **extra}
