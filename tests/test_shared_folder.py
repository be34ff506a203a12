"""Outputs written into a folder other people may write: nothing they plant redirects a write.

The attack: in a shared group folder (setgid, mode 2775) a user with umask 002 runs a tool; while
it works, another member of the group finds its staging directory and plants
``<staging>/<output name> -> the victim's private file``. The victim's tool must neither write into
that file nor change its mode. The attacker is a real second user (a child process that drops to
the uid and gid of ``nobody``), so these tests need root; without it they skip and say why. The
same-user tests below check the two defences (a private staging directory, files created
``O_EXCL | O_NOFOLLOW``) without a second user.
"""

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from convert_helpers import ENV, state
from ropekit import files

torch.set_num_threads(1)

SECRET = b"the victim's own private file\n"
# ropekit ARGV in a process that stops before its first file write until a line arrives on stdin
PAUSED = """
import sys
from ropekit import files
seen = []
def pause(action, path):
    seen.append(action)
    if action == "write" and seen.count("write") == 1:
        print("paused", flush=True)
        sys.stdin.readline()
files.fs_step = pause
from ropekit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _attacker_ids() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return 65534, 65534
    return entry.pw_uid, entry.pw_gid


needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="needs root: the attacker runs as a second user (setuid to nobody)")


@pytest.fixture()
def shared():
    """``(shared folder 2775 of the attacker's group, the victim's 0600 file)`` in a tree the attacker can reach."""
    uid, gid = _attacker_ids()
    base = Path(tempfile.mkdtemp(prefix="ropekit-shared-"))
    try:
        os.chmod(base, 0o711)
        folder = base / "shared"
        folder.mkdir()
        os.chown(folder, 0, gid)
        os.chmod(folder, 0o2775)
        home = base / "victim"
        home.mkdir(mode=0o700)
        secret = home / "private"
        secret.write_bytes(SECRET)
        os.chmod(secret, 0o600)
        yield folder, secret, (uid, gid)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def plant_as_attacker(link: Path, target: Path, ids: tuple[int, int]) -> subprocess.CompletedProcess:
    """``ln -s target link`` run as the attacker's uid and gid (a real second user)."""
    uid, gid = ids

    def become_attacker():
        os.setgroups([gid])
        os.setgid(gid)
        os.setuid(uid)

    return subprocess.run(["ln", "-s", str(target), str(link)], preexec_fn=become_attacker, capture_output=True,
                          text=True, timeout=60)


def attacked_run(argv: list[str], folder: Path, inside: str, name: str, secret: Path, ids) -> tuple:
    """Run ropekit ARGV with umask 002; at its first write, the attacker plants ``<stage>/<inside>/<name> -> secret``.

    Returns ``(the victim's completed process, the attacker's ln)``.
    """
    victim = subprocess.Popen([sys.executable, "-c", PAUSED, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV, preexec_fn=lambda: os.umask(0o002))
    try:
        assert victim.stdout.readline().strip() == "paused"
        [stage] = [p for p in folder.iterdir() if p.name.startswith(files.STAGING_PREFIX)]
        planted = plant_as_attacker(stage / inside / name, secret, ids)
        out, err = victim.communicate("\n", timeout=300)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.communicate()
    return subprocess.CompletedProcess(argv, victim.returncode, out, err), planted


def assert_untouched(secret: Path):
    assert secret.read_bytes() == SECRET
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


@needs_root
def test_decay_png_in_a_shared_folder_never_writes_through_a_planted_link(shared):
    pytest.importorskip("matplotlib")
    folder, secret, ids = shared
    png = folder / "decay.png"
    argv = ["decay", "--dim", "8", "--max-distance", "16", "--png", str(png)]
    done, planted = attacked_run(argv, folder, ".", png.name, secret, ids)
    assert_untouched(secret)
    assert planted.returncode != 0 and "Permission denied" in planted.stderr  # the staging directory is private
    assert done.returncode == 0, done.stderr
    assert not png.is_symlink() and png.read_bytes().startswith(b"\x89PNG")


@needs_root
def test_convert_into_a_shared_folder_never_writes_through_a_planted_link(shared, tmp_path):
    folder, secret, ids = shared
    src = tmp_path / "model"
    src.mkdir()
    save_file(state(), str(src / "model.safetensors"))
    (src / "tokenizer.json").write_text('{"attacker": "controls this text"}')
    dst = folder / "converted"
    argv = ["convert", str(src), str(dst), "--from", "half", "--to", "interleaved", "--heads", "4"]
    done, planted = attacked_run(argv, folder, "output", "tokenizer.json", secret, ids)
    assert_untouched(secret)
    assert planted.returncode != 0 and "Permission denied" in planted.stderr
    assert done.returncode == 0, done.stderr
    assert (dst / "tokenizer.json").read_text() == '{"attacker": "controls this text"}'
    assert not (dst / "tokenizer.json").is_symlink()


def test_the_staging_directory_is_private_whatever_the_umask(tmp_path, monkeypatch):
    seen = []

    def look(action, path):
        if action == "write":
            seen.append(stat.S_IMODE(path.parent.stat().st_mode))

    monkeypatch.setattr(files, "fs_step", look)
    old = os.umask(0o002)
    try:
        files.write_bytes_atomic(tmp_path / "out.json", b"{}")
    finally:
        os.umask(old)
    assert seen == [0o700]
    assert stat.S_IMODE((tmp_path / "out.json").stat().st_mode) == 0o664  # the output itself follows the umask


def test_a_link_inside_the_staging_directory_is_never_followed(tmp_path, monkeypatch):
    """Should an entry appear in the staging directory anyway, the file is created O_EXCL | O_NOFOLLOW: refused."""
    private = tmp_path / "private"
    private.write_bytes(SECRET)
    os.chmod(private, 0o600)

    def plant(action, path):
        if action == "write":
            os.symlink(private, path)

    monkeypatch.setattr(files, "fs_step", plant)
    with pytest.raises(FileExistsError):
        files.write_bytes_atomic(tmp_path / "out.png", b"new")
    assert_untouched(private)
    assert not (tmp_path / "out.png").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["private"]  # the staging directory is gone too


def test_a_staging_directory_of_another_user_is_never_removed(tmp_path):
    """Leftover cleaning removes only this user's directories (chown needs root: skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    uid, gid = _attacker_ids()
    theirs = tmp_path / f"{files.STAGING_PREFIX}0123456789abcdef"
    theirs.mkdir()
    (theirs / files.MARKER).write_bytes(b"")
    os.chown(theirs, uid, gid)
    assert files.remove_stale_staging(tmp_path) == []
    assert theirs.is_dir()
