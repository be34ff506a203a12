"""``ropekit.tools.files.write_bytes_atomic``: the whole file or the old one, never half."""

import pytest

from ropekit.tools import files


def test_write_replaces_whole_and_failure_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "out.png"
    files.write_bytes_atomic(target, b"first")
    files.write_bytes_atomic(target, b"second")
    assert target.read_bytes() == b"second"

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        files.write_bytes_atomic(target, b"third")
    assert target.read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["out.png"]  # no temporary file left
