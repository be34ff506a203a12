"""An output that is a device, a named pipe or a socket is refused, never replaced, ``--force`` or not.

``ropekit decay --png /dev/null`` run as root used to turn ``/dev/null`` into a regular file. These
tests use a named pipe (anyone may create one) and, as root, a character device of their own
(``mknod`` in a temporary folder: ``/dev`` itself is never touched).
"""

import os
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from convert_helpers import ENV, H2I, HEADS, cli, state
from ropekit import files

torch.set_num_threads(1)


@pytest.fixture(params=["fifo", "device"])
def special(request, tmp_path):
    """A named pipe, or (as root) a character device with /dev/null's numbers, in ``tmp_path``."""
    path = tmp_path / f"special-{request.param}"
    if request.param == "fifo":
        os.mkfifo(path)
    elif os.geteuid() != 0:
        pytest.skip("needs root to create a device node (mknod)")
    else:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    kind = stat.S_IFMT(path.lstat().st_mode)
    yield path
    assert stat.S_IFMT(path.lstat().st_mode) == kind  # still what it was


def assert_one_line_refusal(done, *words):
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_decay_png_refuses_a_special_file(special):
    done = subprocess.run([sys.executable, "-m", "ropekit", "decay", "--dim", "8", "--max-distance", "4",
                           "--png", str(special)], capture_output=True, text=True, env=ENV, timeout=300)
    assert_one_line_refusal(done, "--png", "refusing to replace it")


def test_convert_force_refuses_a_special_file(special, tmp_path):
    save_file(state(), str(tmp_path / "m.safetensors"))
    done = cli(tmp_path / "m.safetensors", special, *H2I, "--heads", HEADS, "--force")
    assert_one_line_refusal(done, "DST", "refusing to replace it")


def test_convert_into_a_link_to_a_special_file_is_refused(special, tmp_path):
    save_file(state(), str(tmp_path / "m.safetensors"))
    (tmp_path / "link.safetensors").symlink_to(special)
    done = cli(tmp_path / "m.safetensors", tmp_path / "link.safetensors", *H2I, "--heads", HEADS, "--force")
    assert_one_line_refusal(done, "DST", "refusing to replace it")


def test_the_atomic_writers_refuse_a_special_file(special, tmp_path):
    with pytest.raises(files.SpecialFileError, match="refusing to replace it"):
        files.write_bytes_atomic(special, b"data")
    with files.staging_directory(tmp_path) as stage:
        (stage / "new").mkdir()
        with pytest.raises(files.SpecialFileError):
            files.replace_directory(stage / "new", special)
        (stage / "new.json").write_bytes(b"{}")
        with pytest.raises(files.SpecialFileError):
            files.replace_file(stage / "new.json", special)
