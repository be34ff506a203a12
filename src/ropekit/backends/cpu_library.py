"""Building and loading the native CPU kernel (``csrc/rotary.c``) and finding torch's OpenMP runtime.

The shared library is built with ``cc -O3 -march=native -ffp-contract=off ...`` (see
:data:`FLAG_SETS`) into a per-user cache (``$ROPEKIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/ropekit``, else ``~/.cache/ropekit``; a private temporary directory when that
is not writable) under a name keyed by the sources, flags, compiler version and CPU, written
atomically (temporary file, then ``os.replace``). ``ROPEKIT_CC`` (else ``CC``) picks the
compiler; ``ROPEKIT_DISABLE_NATIVE=1`` turns the backend off.

The kernel runs its threads on torch's own OpenMP team: :func:`openmp_entry_points` finds the
runtime torch loaded (``ROPEKIT_NATIVE_OPENMP=0`` turns this off).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "rotary.c"
HEADERS = (SOURCE.parent / "rotary_avx2.h",)  # included by SOURCE: part of the cache key
# -ffp-contract=off: no FMA, so the arithmetic is the eager backend's, bit for bit.
# -fno-tree-slp-vectorize: gcc 12's straight-line vectoriser turns the interleaved float64 pair
# into vfmaddsub (a fused multiply-add) despite -ffp-contract=off; the loop vectoriser does not.
_COMMON_FLAGS = ("-O3", "-std=c99", "-ffp-contract=off", "-fno-tree-slp-vectorize", "-fPIC", "-shared")
FLAG_SETS = (
    ("-march=native", *_COMMON_FLAGS),
    _COMMON_FLAGS,  # compilers without -march=native
)
SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16"}


def cache_dir() -> Path:
    """Directory holding the compiled libraries (created on demand)."""
    explicit = os.environ.get("ROPEKIT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ropekit"


def _compiler() -> str | None:
    for name in (os.environ.get("ROPEKIT_CC"), os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on, so a shared cache never serves another CPU's build."""
    text = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.split(":")[0].strip() in ("flags", "Features", "model name"):
                    text += line
                if line.strip() == "":  # the first processor's block is enough
                    break
    except OSError:
        pass
    return text


def _build(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the source (cached), trying each flag set in turn; return the library's path."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    source = b"\0".join(path.read_bytes() for path in (SOURCE, *HEADERS))
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK):
            raise PermissionError(directory)
    except OSError:  # read-only home: a private directory for this process only
        directory = Path(tempfile.mkdtemp(prefix="ropekit-"))
    errors = []
    for flag_set in FLAG_SETS:
        flags = flag_set + tuple(extra_flags)
        key = hashlib.sha256(
            b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_signature().encode(),
                        platform.machine().encode()])
        ).hexdigest()[:20]
        target = directory / f"rotary-{key}.so"
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(prefix=".rotary-", suffix=".so", dir=directory)
        os.close(fd)
        try:
            done = subprocess.run(
                [compiler, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300, check=False
            )
            if done.returncode == 0:
                os.replace(tmp, target)
                return target
            errors.append(f"{compiler} {' '.join(flags)}: {done.stderr.strip()[-2000:]}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("; ".join(errors))


def open_library(
    extra_flags: tuple[str, ...] = (),
) -> tuple[dict[torch.dtype, object], dict[torch.dtype, object], bool]:
    """Build (or find in the cache) and load the library; its functions by dtype.

    Returns ``(functions, teams, openmp)``: ``ropekit_rotate_<t>``, ``ropekit_rotate_team_<t>``
    and whether the team runs on torch's OpenMP threads (see :func:`openmp_entry_points`).
    ``extra_flags`` go to the compiler after the defaults (tests build ``-DROPEKIT_PORTABLE``).
    """
    if os.environ.get("ROPEKIT_DISABLE_NATIVE", "") not in ("", "0"):
        raise RuntimeError("disabled by ROPEKIT_DISABLE_NATIVE")
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "aarch64", "arm64"):
        raise RuntimeError(f"unsupported machine {machine!r} (x86-64 and arm64 only)")
    if sys.byteorder != "little":
        raise RuntimeError("big-endian machines are not supported")
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set ROPEKIT_CC or CC, or install cc/gcc/clang)")
    library = ctypes.CDLL(str(_build(compiler, extra_flags)))
    functions, teams = {}, {}
    for dtype, suffix in SUFFIX.items():
        fn = getattr(library, f"ropekit_rotate_{suffix}")
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int64]
        fn.restype = ctypes.c_int
        functions[dtype] = fn
        team = getattr(library, f"ropekit_rotate_team_{suffix}")
        team.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int64]
        team.restype = ctypes.c_int
        teams[dtype] = team
    entry_points = openmp_entry_points()
    if entry_points is not None:
        library.ropekit_set_openmp.argtypes = [ctypes.c_void_p] * 3
        library.ropekit_set_openmp.restype = None
        library.ropekit_set_openmp(*entry_points)
    return functions, teams, entry_points is not None


def openmp_entry_points() -> tuple[int, int, int] | None:
    """Where torch's OpenMP runtime has ``GOMP_parallel``, ``omp_get_thread_num`` and ``omp_get_num_threads``.

    None unless torch's parallel backend is OpenMP and exactly one OpenMP runtime (libgomp, or
    LLVM/Intel's, which export the same entry points) is mapped into this process: opening it
    by its path then returns the instance torch uses, and with it torch's thread team.
    ``ROPEKIT_NATIVE_OPENMP=0`` turns this off (the Python thread pool is used instead).
    """
    if os.environ.get("ROPEKIT_NATIVE_OPENMP", "1") in ("0", "false", "no", "off"):
        return None
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    runtimes = [path for path in paths if os.path.basename(path).split(".")[0].split("-")[0]
                in ("libgomp", "libomp", "libiomp5")]
    if len(runtimes) != 1:
        return None
    try:
        runtime = ctypes.CDLL(runtimes[0])
        names = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
        addresses = tuple(ctypes.cast(getattr(runtime, name), ctypes.c_void_p).value for name in names)
    except (OSError, AttributeError):
        return None
    return addresses if all(addresses) else None  # type: ignore[return-value]
