"""Building, caching and loading the C++ CPU kernel (``csrc/rotary_cpu.cpp``).

Build ahead of time (prints the library's path and the time it took)::

    python -m ropekit.ops.build

Otherwise the first CPU rotation builds it, saying so in one line on stderr (about 10-60 s,
depending on the machine: most of it is compiling torch's headers), and later processes load
it from the cache in milliseconds.

- **Build**: ``torch.utils.cpp_extension`` (ninja and a C++ compiler: ``$CXX``, else ``c++``)
  with ``-O3 -march=native -ffp-contract=off -fno-tree-slp-vectorize`` (no FMA contraction:
  the arithmetic stays bit-identical to the eager backend) and ``-fopenmp`` when torch runs on
  OpenMP (``at::parallel_for`` then uses torch's OpenMP threads), or the same without
  ``-march=native``, then without OpenMP (one thread), where the compiler refuses them. It
  runs in a child process that is killed, with its compiler, after ``ROPEKIT_BUILD_TIMEOUT``
  seconds (default 300), in a private temporary directory; the finished library is moved into
  place atomically.
- **Cache**: ``$ROPEKIT_KERNEL_CACHE_DIR``, else torch's extension cache (``$TORCH_EXTENSIONS_DIR``,
  else ``~/.cache/torch_extensions``), one directory per build key: a hash of the sources, the
  flags, the compiler (path, size, date), the CPU (what ``-march=native`` depends on), torch and
  Python. A cache that holds a valid build is used as it is, read-only or not.
- **Trust**: the cache directory, the build's directory and the library must belong to the
  current user and must not be writable by group or others; otherwise they are refused (one
  warning) and the eager kernel runs: a library planted there by someone else is never loaded.
- ``ROPEKIT_DISABLE_NATIVE=1`` turns the C++ kernel off.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "rotary_cpu.cpp",)
HEADERS = tuple(sorted(CSRC.glob("*.h")))  # included by the source: part of the key
# -ffp-contract=off: no FMA, so the arithmetic is the eager backend's, bit for bit.
# -fno-tree-slp-vectorize: gcc's straight-line vectoriser turns the interleaved float64 pair into
# vfmaddsub (a fused multiply-add) despite -ffp-contract=off; the loop vectoriser does not.
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fno-tree-slp-vectorize")
FLAG_SETS = (("-march=native", *COMMON_FLAGS), COMMON_FLAGS)
# at::parallel_for is a header template: with torch's OpenMP backend it needs -fopenmp to run on
# torch's OpenMP threads (the library then uses the runtime torch loaded, by its soname).
OPENMP_FLAGS = ("-fopenmp",)
DEFAULT_NAMESPACE = "ropekit_cpu"
DEFAULT_TIMEOUT_S = 300.0


class UntrustedCache(RuntimeError):
    """A cache file or directory that another user could have written."""


@dataclass(frozen=True)
class Build:
    """One way to build the kernel: its name (and key), flags, operator namespace and place in the cache."""

    name: str
    flags: tuple[str, ...]
    namespace: str
    directory: Path
    link_flags: tuple[str, ...] = ()

    @property
    def library(self) -> Path:
        """Where the shared library lives once built."""
        return self.directory / f"{self.name}.so"


def disabled() -> bool:
    """``ROPEKIT_DISABLE_NATIVE`` set to anything but empty or 0."""
    return os.environ.get("ROPEKIT_DISABLE_NATIVE", "") not in ("", "0")


def compiler() -> Path | None:
    """The C++ compiler cpp_extension will run (``$CXX``, else ``c++``), resolved, or None."""
    found = shutil.which(os.environ.get("CXX") or "c++")
    return Path(found).resolve() if found else None


def cache_root() -> Path:
    """``$ROPEKIT_KERNEL_CACHE_DIR``, else torch's per-user extension cache."""
    explicit = os.environ.get("ROPEKIT_KERNEL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _cpu_signature() -> str:
    """What ``-march=native`` depends on, so a shared home never serves another CPU's build."""
    text = platform.processor() + platform.machine()
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


def _parallel_flags() -> tuple[str, ...]:
    """``-fopenmp`` when torch's own parallel backend is OpenMP (else at::parallel_for needs nothing)."""
    return OPENMP_FLAGS if "parallel backend: OpenMP" in torch.__config__.parallel_info() else ()


def builds(cxx: Path, extra_flags: tuple[str, ...] = (), namespace: str = DEFAULT_NAMESPACE) -> list[Build]:
    """The builds to try, best first: with ``-march=native``, then without; with OpenMP, then one thread."""
    info = cxx.stat()
    common = [path.read_bytes() for path in (*SOURCES, *HEADERS)] + [
        f"{cxx}:{info.st_size}:{info.st_mtime_ns}".encode(), _cpu_signature().encode(), namespace.encode(),
        torch.__version__.encode(), sys.version.encode(),
    ]
    parallel = _parallel_flags()
    flag_lists = [(*flag_set, *threads, *extra_flags) for threads in ((parallel, ()) if parallel else ((),))
                  for flag_set in FLAG_SETS]
    # the whole list in every key: a fallback cached while another list was tried first is not reused
    common.append(repr(flag_lists).encode())
    result = []
    for flags in flag_lists:
        key = hashlib.sha256(b"\0".join([*common, " ".join(flags).encode()])).hexdigest()[:16]
        name = f"ropekit_cpu_{key}"
        link_flags = tuple(f for f in flags if f in OPENMP_FLAGS or f.startswith("-fsanitize"))
        result.append(Build(name, flags, namespace, cache_root() / name, link_flags))
    return result


def check_trusted(path: Path) -> None:
    """Raise :class:`UntrustedCache` unless ``path`` is ours and not writable by group or others."""
    info = path.stat()
    if info.st_uid != os.getuid():
        raise UntrustedCache(f"{path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedCache(f"{path} is writable by group or others (mode {stat.filemode(info.st_mode)})")


def _private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) readable and writable by this user only, or check the existing one."""
    if not path.exists():
        old = os.umask(0o077)
        try:
            path.mkdir(parents=True, exist_ok=True)
        finally:
            os.umask(old)
    check_trusted(path)
    return path


def find_cached(candidates: list[Build]) -> Build | None:
    """The first build already in the cache (checked: ours, not writable by others), or None."""
    for build in candidates:
        if build.library.exists():
            check_trusted(build.directory)
            check_trusted(build.library)
            return build
    return None


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()


def asan_preload(cxx: Path) -> str:
    """``LD_PRELOAD`` for a process that loads an AddressSanitizer build made with ``cxx``.

    The compiler's own ``libasan`` (it must come first), then its ``libstdc++``: the sanitizer
    resolves ``__cxa_throw`` when it starts, and a Python process has not loaded libstdc++ yet
    (without it, the first C++ exception of an extension, triton's for one, aborts the process).
    """
    paths = []
    for name in ("libasan.so", "libstdc++.so"):
        found = subprocess.run([str(cxx), f"-print-file-name={name}"], capture_output=True, text=True,
                               check=False).stdout.strip()
        if not os.path.isabs(found) or not os.path.exists(found):
            raise RuntimeError(f"{cxx} has no {name} (it answered {found!r})")
        paths.append(os.path.realpath(found))
    return " ".join(paths)


def build_in_child(candidates: list[Build], timeout_s: float) -> Build:
    """Build the first candidate that compiles, in a child process killed after ``timeout_s`` seconds."""
    root = _private_dir(cache_root())
    scratch = Path(tempfile.mkdtemp(prefix=".ropekit-build-", dir=root))
    specs = [f"{b.name}|{b.namespace}|{' '.join(b.flags)}|{' '.join(b.link_flags)}" for b in candidates]
    command = [sys.executable, "-m", "ropekit.ops.build", "--child", str(scratch),
               *(f"--candidate={spec}" for spec in specs)]
    # the child imports this very package (not another copy on its path): it compiles these sources
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    if any("-fsanitize=address" in b.flags for b in candidates):  # cpp_extension loads what it built
        env.update(LD_PRELOAD=asan_preload(compiler()), ASAN_OPTIONS="detect_leaks=0")
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True, env=env)
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.communicate()
            raise RuntimeError(f"the C++ build took longer than {timeout_s:g} s and was stopped "
                               "(ROPEKIT_BUILD_TIMEOUT sets the limit)") from None
        if process.returncode != 0:
            raise RuntimeError(f"the C++ build failed: {err.strip()[-1500:]}")
        name = out.strip().splitlines()[-1] if out.strip() else ""
        built = next((b for b in candidates if b.name == name), None)
        if built is None:
            raise RuntimeError(f"the C++ build reported no library ({err.strip()[-500:]})")
        return built
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load(extra_flags: tuple[str, ...] = (), namespace: str = DEFAULT_NAMESPACE, *, quiet: bool = False) -> Build:
    """Load the kernel's operators into ``torch.ops.<namespace>``, building them first if needed.

    Raises:
        RuntimeError: disabled, no compiler, the build failed or timed out, or the cache is
            not trustworthy (:class:`UntrustedCache`); the message says which.
    """
    found = ensure_built(extra_flags, namespace, quiet=quiet)
    import_library(found)
    return found


def ensure_built(extra_flags: tuple[str, ...] = (), namespace: str = DEFAULT_NAMESPACE, *,
                 quiet: bool = False) -> Build:
    """The kernel built with ``extra_flags`` after the defaults (its own cache key), without loading it.

    A sanitizer build (``-fsanitize=address``: the flag is passed to the linker as well) is built
    here and loaded by another process that preloads the sanitizer's runtime. Raises as :func:`load`.
    """
    if disabled():
        raise RuntimeError("disabled by ROPEKIT_DISABLE_NATIVE")
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64") or sys.byteorder != "little":
        raise RuntimeError(f"unsupported machine {platform.machine()!r} (little-endian x86-64 and arm64 only)")
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler found ({os.environ.get('CXX') or 'c++'} is not on PATH; set CXX or "
                           "install g++ or clang++)")
    candidates = builds(cxx, tuple(extra_flags), namespace)
    root = cache_root()
    if root.exists():
        check_trusted(root)
    found = find_cached(candidates)
    if found is None:
        timeout_s = float(os.environ.get("ROPEKIT_BUILD_TIMEOUT") or DEFAULT_TIMEOUT_S)
        if not quiet:
            print(f"ropekit: building the C++ CPU kernel into {root} (once per machine and torch version; "
                  "`python -m ropekit.ops.build` does it ahead of time)", file=sys.stderr, flush=True)
        start = time.monotonic()
        found = build_in_child(candidates, timeout_s)
        check_trusted(found.directory)
        check_trusted(found.library)
        if not quiet:
            print(f"ropekit: C++ CPU kernel built in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    return found


def import_library(build: Build) -> types.ModuleType:
    """Load ``build``'s library as a Python extension module (once per process; later calls return it).

    Loading it registers the operators in ``torch.ops.<namespace>`` (its static initialisers) and
    gives the same kernels as plain Python functions (``apply_rotary``, ``apply_rotary_qk``, ... of the
    module: no dispatcher between Python and the kernel).
    """
    module = sys.modules.get(build.name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(build.name, build.library)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"{build.library} cannot be imported as an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[build.name] = module
    torch.ops.loaded_libraries.add(str(build.library))
    return module


def _child(scratch: Path, candidates: list[str]) -> int:
    """In the child: build into ``scratch``, move the library into the cache, print its name."""
    from torch.utils import cpp_extension

    os.umask(0o022)
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")  # pip's ninja
    errors = []
    for spec in candidates:
        name, namespace, flags, link_flags = spec.split("|", 3)
        work = scratch / name
        work.mkdir()
        try:
            cpp_extension.load(name, [str(s) for s in SOURCES],
                               extra_cflags=[*flags.split(), f"-DROPEKIT_CPU_NAMESPACE={namespace}"],
                               extra_ldflags=link_flags.split(), extra_include_paths=[str(CSRC)],
                               build_directory=str(work),
                               is_python_module=False, verbose=False)
        except Exception as exc:  # noqa: BLE001 - try the next flag set, report all
            errors.append(f"{flags}: {str(exc).strip()[-1500:]}")
            continue
        target = _private_dir(cache_root() / name)
        os.replace(work / f"{name}.so", target / f"{name}.so")
        print(name)
        return 0
    print("\n".join(errors), file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m ropekit.ops.build``: build (or find) the kernel, print where it is."""
    parser = argparse.ArgumentParser(prog="python -m ropekit.ops.build", description=__doc__.splitlines()[0])
    parser.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--candidate", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(Path(args.child), args.candidate)
    start = time.monotonic()
    try:
        build = load()
    except RuntimeError as exc:
        print(f"ropekit: the C++ CPU kernel is unavailable: {exc}", file=sys.stderr)
        return 1
    print(f"{build.library} ({time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
