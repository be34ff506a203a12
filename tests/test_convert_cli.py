"""``ropekit convert`` as a real subprocess: every failure is one line on stderr and exit code 2.

The subprocesses are started together and awaited together (each pays for ``import torch``).
"""

import json
import subprocess
import sys

import torch
from safetensors.torch import save_file

from convert_helpers import ENV, llama_config, state, write_sharded
from ropekit.cli.entry import main

torch.set_num_threads(1)


class Payload:
    """A pickle that creates a file when unpickled: what ``weights_only=True`` must refuse."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def launch(*argv):
    return subprocess.Popen([sys.executable, "-m", "ropekit", "convert", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def test_every_failure_is_one_line_and_exit_code_2_in_a_subprocess(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file(state(), str(good))
    data = good.read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.safetensors").write_bytes(b"")
    (tmp_path / "bad-index").mkdir()
    (tmp_path / "bad-index" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 5}}))
    escape = write_sharded(state(), tmp_path / "escape")
    index = json.loads((escape / "model.safetensors.index.json").read_text())
    index["weight_map"]["x"] = "../good.safetensors"
    (escape / "model.safetensors.index.json").write_text(json.dumps(index))
    pwned = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "payload": Payload(pwned)}, tmp_path / "evil.bin")
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(state(), str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps(llama_config()))
    out = tmp_path / "out"
    cases = {
        "truncated": ([tmp_path / "truncated.safetensors", out, "--from", "half", "--to", "interleaved"],
                      "not a readable safetensors file"),
        "empty": ([tmp_path / "empty.safetensors", out, "--from", "half", "--to", "interleaved"],
                  "not a readable safetensors file"),
        "index": ([tmp_path / "bad-index", out, "--from", "half", "--to", "interleaved"],
                  "weight_map must map tensor names to shard file names"),
        "escape": ([escape, out, "--from", "half", "--to", "interleaved"], "refusing to read outside"),
        "pickle": ([tmp_path / "evil.bin", out, "--from", "half", "--to", "interleaved"],
                   "refused by torch.load(weights_only=True)"),
        "geometry": ([hf, out, "--to", "interleaved", "--heads", 2, "--kv-heads", 1], "--heads says 2"),
        "no-op": ([hf, out, "--to", "half"], "already in the half layout"),
    }
    procs = {name: launch(*argv) for name, (argv, _) in cases.items()}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, stderr)
        assert stderr.startswith("ropekit convert: error: ") and stderr.count("\n") == 1, (name, stderr)
        assert cases[name][1] in stderr, (name, stderr)
        assert "Traceback" not in stderr and stdout == "", (name, stdout)
    assert not pwned.exists()  # the pickle's payload never ran
    assert not out.exists()


def test_more_failures_are_one_line_and_exit_code_2(tmp_path, capsys):
    """The same through ``ropekit.cli.entry`` in-process (an exception it does not handle would fail here too)."""
    good = tmp_path / "good.safetensors"
    save_file(state(), str(good))
    (tmp_path / "garbage.bin").write_bytes(b"not a zip and not a pickle")
    (tmp_path / "exists.safetensors").write_bytes(b"mine")
    (tmp_path / "bad.json").write_text("{")
    torch.save({0: torch.ones(2)}, tmp_path / "int-keys.pth")
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "nested.pth")
    out = tmp_path / "out"
    cases = [
        (tmp_path / "garbage.bin", out, ["--from", "half"], "not a readable PyTorch checkpoint (Unsupported operand"),
        (good, tmp_path / "exists.safetensors", ["--from", "half", "--heads", 4], "pass --force"),
        (tmp_path / "nope", out, ["--from", "half"], "SRC does not exist"),
        (good, out, ["--from", "half", "--config", tmp_path / "bad.json"], "is not valid JSON"),
        (good, out, ["--from", "half", "--config", tmp_path / "none.json"], "--config file not found"),
        (good, out, ["--from", "half", "--heads", 3], "not divisible by 3 heads"),
        (good, out, ["--heads", 4], "cannot tell the layout of SRC"),
        (tmp_path / "int-keys.pth", out, ["--from", "half"], "expected a flat state dict (str name -> tensor)"),
        (tmp_path / "nested.pth", out, ["--from", "half"], "got dict with keys ['model']"),
    ]
    for src, dst, argv, message in cases:
        code = main(["convert", str(src), str(dst), "--to", "interleaved", *map(str, argv)])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("ropekit convert: error: ") and err.count("\n") == 1, (argv, err)
        assert message in err, (argv, err)
    assert (tmp_path / "exists.safetensors").read_bytes() == b"mine"
    assert not (tmp_path / "out").exists()


def test_success_and_the_way_back_through_the_console_script(tmp_path):
    hf = write_sharded(state(bias=True), tmp_path / "hf")
    (hf / "config.json").write_text(json.dumps(llama_config()))
    assert main(["convert", str(hf), str(tmp_path / "inter"), "--to", "interleaved"]) == 0
    there = launch(hf, tmp_path / "inter2", "--to", "interleaved", "--verify")
    back = launch(tmp_path / "inter", tmp_path / "back", "--to", "half", "--verify")
    stdout, stderr = there.communicate(timeout=300)
    assert there.returncode == 0 and stderr == "", stderr
    assert "SRC layout half (config.json next to SRC)" in stdout and "verified: written files read back" in stdout
    stdout, stderr = back.communicate(timeout=300)
    assert back.returncode == 0 and "SRC layout interleaved (the ropekit metadata of SRC)" in stdout, stderr
