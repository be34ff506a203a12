"""Building and loading the C++ kernel: a cache someone else could write is refused, a hanging
compiler is cut off, a read-only cache with a valid build is used as it is.

Each promise is broken on purpose: a library planted in the cache (whose constructor would
leave a mark if it ever ran), directories writable by others, a "compiler" that sleeps.
"""

import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch

from ropekit import ops
from ropekit.ops import build
from ropekit.ops.cpu import CppBackend

CXX = build.compiler()
pytestmark = pytest.mark.skipif(CXX is None or shutil.which("cc") is None, reason="needs a C and a C++ compiler")

PLANTED_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("ROPEKIT_KERNEL_CACHE_DIR", str(root))
    return root


def plant(cache, tmp_path, namespace):
    """A shared library where the loader would look for the build of ``namespace``; returns (library, marker)."""
    marker = tmp_path / "constructor-ran"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_C)
    target = build.builds(CXX, namespace=namespace)[0]
    target.directory.mkdir(mode=0o700)
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(target.library), str(source)],
                   check=True, capture_output=True)
    os.chmod(target.library, 0o755)
    return target, marker


def refused(namespace, match):
    backend = CppBackend(namespace=namespace)
    with pytest.warns(RuntimeWarning, match=match):
        assert not backend.is_available()
    return backend


def test_the_planted_library_would_run_if_loaded(cache, tmp_path):
    """The probe itself works: loading the planted file runs its constructor (so the tests below mean something)."""
    target, marker = plant(cache, tmp_path, "ropekit_cpu_probe")
    import ctypes

    ctypes.CDLL(str(target.library))
    assert marker.read_text() == "ran"


def test_library_of_another_user_is_refused(cache, tmp_path):
    target, marker = plant(cache, tmp_path, "ropekit_cpu_planted_file")
    os.chown(target.library, 12345, 12345)
    backend = refused("ropekit_cpu_planted_file", "belongs to uid 12345")
    assert not marker.exists()
    x = torch.randn(2, 3, 8)
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    with pytest.raises(RuntimeError, match="unavailable"):
        backend.apply_rotary(x, cos, sin, layout="half", conjugate=False, inplace=False)


def test_directory_of_another_user_is_refused(cache, tmp_path):
    target, marker = plant(cache, tmp_path, "ropekit_cpu_planted_dir")
    os.chown(target.directory, 12345, 12345)
    refused("ropekit_cpu_planted_dir", "belongs to uid 12345")
    assert not marker.exists()


@pytest.mark.parametrize("what", ["library", "directory", "root"])
def test_writable_by_others_is_refused(cache, tmp_path, what):
    namespace = f"ropekit_cpu_writable_{what}"
    target, marker = plant(cache, tmp_path, namespace)
    path = {"library": target.library, "directory": target.directory, "root": cache}[what]
    os.chmod(path, os.stat(path).st_mode | stat.S_IWOTH)
    refused(namespace, "writable by group or others")
    assert not marker.exists()


def test_hanging_compiler_is_cut_off(cache, tmp_path, monkeypatch, capsys):
    fake = tmp_path / "bin" / "c++"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nsleep 600\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("ROPEKIT_BUILD_TIMEOUT", "3")
    start = time.monotonic()
    refused("ropekit_cpu_hanging", "longer than 3 s")
    assert "ropekit: building the C++ CPU kernel" in capsys.readouterr().err  # the first call says why it waits
    assert time.monotonic() - start < 30  # child start-up plus the 3 s bound, not the compiler's 600 s
    assert [p for p in cache.iterdir() if p.name.startswith(".ropekit-build-")] == []
    leftover = subprocess.run(["pgrep", "-f", str(fake)], capture_output=True, text=True, check=False)
    assert leftover.stdout.strip() == "", "the compiler was left running"


READ_ONLY_SCRIPT = r"""
import sys, torch, ropekit
from ropekit.ops import build
backend = ropekit.ops.get("cpu")
assert backend.build.directory.parent == build.cache_root(), backend.build
x = torch.randn(2, 4, 16)
cos, sin = ropekit.cos_sin(torch.arange(4), ropekit.inv_frequencies(16)[0])
got = ropekit.apply_rotary(x, cos, sin, backend="cpu")
assert torch.equal(got, ropekit.apply_rotary(x, cos, sin, backend="torch"))
print("loaded", backend.build.library)
"""


def test_read_only_cache_with_a_valid_build_is_used(tmp_path):
    """Another process finds the build in a read-only cache: loaded as it is, nothing built or written."""
    if "cpu" not in ops.available():
        pytest.skip("the C++ kernel is unavailable here")
    built = ops.get("cpu").build
    root = tmp_path / "read-only-cache"
    (root / built.directory.name).mkdir(parents=True)
    shutil.copy2(built.library, root / built.directory.name / built.library.name)
    os.chmod(root / built.directory.name / built.library.name, 0o555)
    for directory in (root / built.directory.name, root):
        os.chmod(directory, 0o555)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*"))
    script = tmp_path / "load.py"
    script.write_text(READ_ONLY_SCRIPT)
    env = os.environ | {"ROPEKIT_KERNEL_CACHE_DIR": str(root), "ROPEKIT_BUILD_TIMEOUT": "0.001"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"loaded {root}" in done.stdout
    assert "building" not in done.stderr
    assert sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*")) == before


def test_build_command_prints_the_library(tmp_path):
    """``python -m ropekit.ops.build`` (ahead of time): the library's path and the time it took."""
    if "cpu" not in ops.available():
        pytest.skip("the C++ kernel is unavailable here")
    done = subprocess.run([sys.executable, "-m", "ropekit.ops.build"], capture_output=True, text=True, timeout=600,
                          env=os.environ.copy(), check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert str(ops.get("cpu").build.library) in done.stdout and " s)" in done.stdout


def test_the_data_cache_variable_does_not_move_the_kernel(tmp_path, monkeypatch):
    """``ROPEKIT_CACHE_DIR`` (downloads) leaves the kernel where it was: moving it forced a rebuild."""
    monkeypatch.delenv("ROPEKIT_KERNEL_CACHE_DIR", raising=False)
    before = build.cache_root()
    monkeypatch.setenv("ROPEKIT_CACHE_DIR", str(tmp_path / "data"))
    assert build.cache_root() == before
    monkeypatch.setenv("ROPEKIT_KERNEL_CACHE_DIR", str(tmp_path / "kernel"))
    assert build.cache_root() == tmp_path / "kernel"
