"""``ropekit.files``: the whole file or the old one, modes that follow the umask, no leftovers that pile up."""

import json
import os
import signal
import stat

import pytest
import torch
from safetensors.torch import save_file

from convert_helpers import llama_config, run, state, write_sharded
from ropekit import files

torch.set_num_threads(1)


def staging(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(files.STAGING_PREFIX))


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


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=lambda u: f"umask-{u:03o}")
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_follow_the_umask(tmp_path, umask):
    files.write_bytes_atomic(tmp_path / "results.json", b"{}")
    files.write_atomic(tmp_path / "model.pt", lambda path: torch.save({"w": torch.ones(2)}, path))
    for name in ("results.json", "model.pt"):
        assert mode(tmp_path / name) == 0o666 & ~umask, name


def test_convert_outputs_follow_the_umask(tmp_path, umask):
    src = write_sharded(state(), tmp_path / "src")
    (src / "config.json").write_text(json.dumps(llama_config()))
    os.chmod(src / "config.json", 0o640)  # a carried file: the umask's mode, never more than its source's
    assert run(src, tmp_path / "out", "--to", "interleaved", "--verify") == 0
    outputs = sorted((tmp_path / "out").iterdir())
    assert [p.name for p in outputs] == ["config.json", "model-00001-of-00002.safetensors",
                                         "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    for path in outputs:
        assert mode(path) == 0o666 & ~umask & (0o640 if path.name == "config.json" else 0o666), path.name
    assert mode(tmp_path / "out") == 0o777 & ~umask
    save_file(state(), str(tmp_path / "m.safetensors"))
    assert run(tmp_path / "m.safetensors", tmp_path / "one.safetensors", "--from", "half", "--to", "interleaved",
               "--heads", 4) == 0
    assert mode(tmp_path / "one.safetensors") == 0o666 & ~umask


def killed_inside_staging(parent, stop):
    """A forked child writes ``parent/out`` and ``SIGKILL``s itself at file-system step ``stop``."""
    pid = os.fork()
    if pid == 0:
        try:
            seen = []

            def kill(action, path):
                seen.append(action)
                if len(seen) == stop:
                    os.kill(os.getpid(), signal.SIGKILL)

            files.fs_step = kill
            files.write_bytes_atomic(parent / "out", b"new")
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


def test_a_killed_write_leaves_old_or_new_and_the_next_write_removes_its_leftovers(tmp_path):
    for stop in range(1, 5):  # mkdir, write, replace, remove
        (tmp_path / "out").write_bytes(b"old")
        assert killed_inside_staging(tmp_path, stop)
        assert (tmp_path / "out").read_bytes() in (b"old", b"new")
        assert len(staging(tmp_path)) == (0 if stop == 1 else 1), stop
        files.write_bytes_atomic(tmp_path / "other", b"x")  # any later write into the directory
        assert staging(tmp_path) == []
    assert not killed_inside_staging(tmp_path, 99)  # the whole write, not killed
    assert (tmp_path / "out").read_bytes() == b"new"


def test_only_provable_leftovers_are_removed(tmp_path):
    """Never a live run's directory, a symlink, a directory without the marker, or anything else."""
    prefix = files.STAGING_PREFIX
    (tmp_path / f"{prefix}foreign").mkdir()
    (tmp_path / f"{prefix}foreign" / "data").write_bytes(b"not ours")  # the name but no marker
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / files.MARKER).write_bytes(b"")
    (elsewhere / "data").write_bytes(b"precious")
    (tmp_path / f"{prefix}link").symlink_to(elsewhere)
    (tmp_path / ".ropekit-other").mkdir()
    (tmp_path / f"{prefix}empty").mkdir()  # a run killed right after mkdir: empty, unlocked
    dead = tmp_path / f"{prefix}dead"
    dead.mkdir()
    (dead / files.MARKER).write_bytes(b"")
    (dead / "half-written").write_bytes(b"x" * 100)
    with files.staging_directory(tmp_path) as live:  # entering it removes the provable leftovers
        (live / "in-progress").write_bytes(b"y")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [".ropekit-other", f"{prefix}foreign", f"{prefix}link", live.name, "elsewhere"])
        assert files.remove_stale_staging(tmp_path) == []  # a live run's directory is locked
        assert (live / "in-progress").read_bytes() == b"y"
    assert not live.exists()
    assert (elsewhere / "data").read_bytes() == b"precious"


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_replace_directory_swaps_and_the_old_content_goes(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    target = tmp_path / "model"
    target.mkdir()
    (target / "old").write_bytes(b"old")
    with files.staging_directory(tmp_path) as stage:
        files.make_directory(stage / "new")
        files.write_file(stage / "new" / "weights", lambda p: p.write_bytes(b"new"))
        files.replace_directory(stage / "new", target)
        assert sorted(p.name for p in target.iterdir()) == ["weights"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
