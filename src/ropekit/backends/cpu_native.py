"""Native CPU kernel: ``csrc/rotary.c`` compiled at first use with the system C compiler.

Same contract as :func:`ropekit.backends.torch_eager.rotate`, one pass over ``x``: in place it
reads and writes each element once; out of place it writes into ``torch.empty_like(x)`` (no
temporary of ``x``'s size). Arithmetic is float32 (float64 for float64 ``x``) without FMA
contraction, so results equal the eager backend's bit for bit.

Building, the compiler cache and the environment variables are in :mod:`.cpu_library`.
Nothing happens at import: the first :func:`is_available` or :func:`rotate`
compiles (about a second), and a failure is reported once as a ``RuntimeWarning`` and
remembered, after which :func:`is_available` is ``False``.

Threads: from ``TEAM_MIN_BYTES`` on, the rows are split over ``torch.get_num_threads()``
threads of torch's own OpenMP team (the kernel calls the ``GOMP_parallel`` of the OpenMP
runtime torch has loaded, found once in the process's memory map): no second pool competes
with torch's threads, and waking them costs what it costs torch's own parallel ops. Where no
such runtime is found, tensors from ``PARALLEL_MIN_BYTES`` on are split into chunks of rows run
by a shared Python thread pool instead (ctypes releases the GIL during the call). A child
forked from this process runs the kernel on one thread (or the Python pool for large tensors):
an OpenMP team does not survive ``fork``.
From ``PLAN_MIN_BYTES`` on, rows are visited in memory order, a few streams at a time
(:func:`_plan`): one core then moves about as many bytes per second as ``x.mul_(1.0)``.
See ``benchmarks/cpu_floor.py``.

Nothing of this changes results: every row is computed the same way whatever the order or split.
"""

from __future__ import annotations

import array
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.autograd.graph import increment_version

from . import cpu_library, torch_eager
from .cpu_library import SUFFIX

MAX_LEADING_DIMS = 8
# From this many bytes (q and k together) on, rows are split over torch's OpenMP team.
TEAM_MIN_BYTES = 128 << 10
# Without torch's OpenMP team: below this many bytes of x, one call on the calling thread beats
# handing rows to the Python pool.
PARALLEL_MIN_BYTES = 1 << 20
# The threaded path cuts the rows into this many chunks per thread (load balancing).
CHUNKS_PER_THREAD = 4
# From this many bytes of x on, rows are visited in the order of _plan (memory order, G streams).
PLAN_MIN_BYTES = 1 << 20
# Rows taken round-robin from this many separate runs of memory (see _plan).
STREAMS = 4

_FLAG_INTERLEAVED, _FLAG_CONJUGATE, _FLAG_COPY_TAIL = 1, 2, 4

_lock = threading.Lock()
# "functions"/"teams": {dtype: fn} and "openmp": bool once loaded; "error": str once failed
_state: dict[str, object] = {}
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_prepared: dict[tuple, tuple] = {}  # rotate's parameter cache, see there
# True in a child forked from this process: an OpenMP team does not survive fork (libgomp then
# waits for threads that no longer exist), so the child runs the kernel on its own thread.
_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
_pair_prepared: dict[tuple, Callable | None] = {}  # rotate_pair's prepared calls, see there


def _load() -> dict[torch.dtype, object]:
    """The per-dtype C functions, building the library on first call; raises RuntimeError."""
    functions = _state.get("functions")
    if functions is not None:
        return functions  # type: ignore[return-value]
    with _lock:
        if "functions" in _state:
            return _state["functions"]  # type: ignore[return-value]
        if "error" not in _state:
            try:
                _state["functions"], _state["teams"], _state["openmp"] = cpu_library.open_library()
                return _state["functions"]  # type: ignore[return-value]
            except Exception as exc:  # noqa: BLE001 - any failure means "not available"
                _state["error"] = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"ropekit native CPU backend unavailable, using the torch backend instead ({_state['error']})",
                    RuntimeWarning,
                    stacklevel=3,
                )
        raise RuntimeError(f"ropekit native CPU backend unavailable: {_state['error']}")


def is_available() -> bool:
    """Whether the native kernel is usable here (compiles it on first call; never raises)."""
    try:
        _load()
    except RuntimeError:
        return False
    return True


def supports(x: torch.Tensor, inplace: bool = False) -> bool:
    """Whether :func:`rotate` runs ``x`` natively (else it falls back to the eager backend).

    Needs a strided CPU tensor of float32/float64/bfloat16/float16 with last-dim stride 1 (or
    one channel), at most 8 leading dims, and for ``inplace`` no leading dim aliased by stride 0.
    """
    if x.dtype not in SUFFIX or not x.is_cpu or x.layout != torch.strided:
        return False
    shape, stride = x.shape, x.stride()
    if not 1 <= len(shape) <= MAX_LEADING_DIMS + 1 or (stride[-1] != 1 and shape[-1] > 1):
        return False
    return not (inplace and 0 in stride and any(st == 0 and n > 1 for st, n in zip(stride, shape, strict=True)))


def _table(t: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """``t`` as ``work`` dtype on the CPU with last-dim stride 1 (a copy only when needed)."""
    if t.dtype != work or not t.is_cpu:
        t = t.to(device="cpu", dtype=work)
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    return t


def _table_strides(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """Leading-dim strides of cos and sin (0 where broadcast), or None if they do not fit ``x``.

    Fitting is the contract the kernel relies on, as it does no bounds checks: ``x.dim()``
    dims, each 1 or x's size, and ``2 * cos.shape[-1] <= head_dim``. What does not fit goes to
    the eager backend, which broadcasts or raises torch's error.
    """
    x_shape, shape = x.shape, cos.shape
    if len(shape) != len(x_shape) or sin.shape != shape or 2 * shape[-1] > x_shape[-1]:
        return None
    cos_stride, sin_stride = cos.stride(), sin.stride()
    cos_strides, sin_strides = [], []
    for d in range(len(shape) - 1):
        n = shape[d]
        if n == 1:
            cos_strides.append(0)
            sin_strides.append(0)
        elif n == x_shape[d]:
            cos_strides.append(cos_stride[d])
            sin_strides.append(sin_stride[d])
        else:
            return None
    return cos_strides, sin_strides


def _plan(sizes: list[int], strides: list[list[int]], streams: int) -> tuple[list[int], list[list[int]]]:
    """Reorder the leading dims (the rows' visiting order; results do not depend on it).

    1. drop dims of size 1, sort by x's stride (memory order), merge dims that are one run
       in x, out, cos and sin alike;
    2. split the next-to-innermost dim (else the innermost) in ``streams`` blocks and visit
       them round-robin: one core then keeps several hardware prefetch streams busy, which
       beats a single stream, and rows of different heads sharing a table row (cos/sin
       broadcast over heads) read that row once for all of them.

    ``strides`` holds four lists (x, out, cos, sin); returns the new sizes and strides.
    """
    dims = [(n, tuple(st[d] for st in strides)) for d, n in enumerate(sizes) if n != 1]
    dims.sort(key=lambda dim: -abs(dim[1][0]))
    merged: list[tuple[int, tuple[int, ...]]] = []
    for n, st in dims:
        if merged and all(outer == inner * n for outer, inner in zip(merged[-1][1], st, strict=True)):
            merged[-1] = (merged[-1][0] * n, st)
        else:
            merged.append((n, st))
    split = len(merged) - 2 if len(merged) >= 2 and merged[-2][0] % streams == 0 else len(merged) - 1
    if streams > 1 and merged and merged[split][0] % streams == 0 and merged[split][0] > streams:
        n, st = merged[split]
        block = n // streams
        merged[split] = (block, st)
        merged.append((streams, tuple(s * block for s in st)))
    if not merged:
        merged = [(1, (0, 0, 0, 0))]
    return [n for n, _ in merged], [[st[k] for _, st in merged] for k in range(4)]


def _executor() -> ThreadPoolExecutor:
    """The shared worker pool (threads start on demand; a forked child makes its own)."""
    global _pool, _pool_pid
    pool = _pool
    if pool is None or _pool_pid != os.getpid():
        with _lock:
            if _pool is None or _pool_pid != os.getpid():
                _pool = ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 2), thread_name_prefix="ropekit-cpu")
                _pool_pid = os.getpid()
            pool = _pool
    return pool


def _call_threaded(fn, args: tuple, rows: int) -> int:
    """Run the rows on torch's thread count: the calling thread and pool threads take chunks.

    Chunks are handed out first come, first served (``next`` on a shared iterator is atomic
    under the GIL), so a core that is busy elsewhere (say an OpenMP thread of the previous torch
    op still spinning) just takes fewer of them instead of holding everyone up.
    """
    threads = min(torch.get_num_threads(), rows)
    if threads <= 1:
        return fn(*args, 0, rows)
    n_chunks = min(rows, CHUNKS_PER_THREAD * threads)
    bounds = [rows * i // n_chunks for i in range(n_chunks + 1)]
    chunks = iter(range(n_chunks))

    def work() -> int:
        status = 0
        for i in chunks:
            status = min(status, fn(*args, bounds[i], bounds[i + 1]))
        return status

    pool = _executor()
    futures = [pool.submit(work) for _ in range(threads - 1)]
    status = work()
    return min([status] + [f.result() for f in futures])


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    layout: str,
    conjugate: bool = False,
    inplace: bool = False,
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of ``x``; the eager backend's contract.

    Args:
        x: tensor of shape ``(..., head_dim)`` on the CPU.
        cos, sin: tables broadcastable to ``x.shape[:-1] + (rotary_dim // 2,)`` with
            ``x.dim()`` dimensions (float32; float64 for float64 ``x``; others are converted).
        layout: ``"half"`` or ``"interleaved"``.
        conjugate: rotate by ``-theta`` (the backward pass).
        inplace: write into ``x`` and return it; otherwise return ``torch.empty_like(x)`` filled.

    Returns:
        ``x`` itself (in place) or a new tensor with ``x``'s shape, dtype and strides.
        Inputs the kernel does not take (see :func:`supports`) go to the eager backend.

    Raises:
        RuntimeError: the native library could not be built or loaded.
    """
    fn = (_state.get("functions") or _load()).get(x.dtype)  # type: ignore[union-attr]
    strided = x.layout == cos.layout == sin.layout == torch.strided
    if fn is None or not strided or x.numel() == 0:
        return torch_eager.rotate(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
    # Everything the kernel's parameters depend on (out's strides follow from x's): a decode
    # loop calls with the same key every step and skips the checks and the planning.
    key = (x.dtype, x.shape, x.stride(), x.is_cpu, cos.dtype, cos.shape, cos.stride(), cos.is_cpu,
           sin.dtype, sin.shape, sin.stride(), sin.is_cpu, layout, conjugate, inplace, PLAN_MIN_BYTES, STREAMS)
    prepared = _prepared.get(key)
    if prepared is None:
        prepared = _prepare(x, cos, sin, layout, conjugate, inplace)
        if prepared is None:
            return torch_eager.rotate(x, cos, sin, layout=layout, conjugate=conjugate, inplace=inplace)
        if prepared[3] is cos and prepared[4] is sin:  # no converted tables held: safe to keep
            if len(_prepared) >= 256:
                _prepared.clear()
            _prepared[key] = prepared[:3]
    else:
        prepared = (*prepared, cos, sin)
    params, rows, nbytes, cos, sin = prepared
    out = x if inplace else torch.empty_like(x)
    args = (x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), params.buffer_info()[0])
    if _state["openmp"] and nbytes >= TEAM_MIN_BYTES and not _forked:
        status = _state["teams"][x.dtype](*args, None, None, None, None, None, torch.get_num_threads())  # type: ignore[index]
    elif nbytes < PARALLEL_MIN_BYTES:
        status = fn(*args, 0, rows)
    else:
        status = _call_threaded(fn, args, rows)
    if status != 0:
        raise RuntimeError(f"ropekit native kernel rejected its arguments (status {status}); this is a bug")
    if inplace:  # what torch's own in-place ops do: autograd then sees that x changed
        increment_version(x)
    return out


def rotate_pair(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_q: torch.Tensor,
    sin_q: torch.Tensor,
    cos_k: torch.Tensor,
    sin_k: torch.Tensor,
    *,
    layout: str,
    conjugate: bool = False,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotate` for q (with ``cos_q``/``sin_q``) and k (with ``cos_k``/``sin_k``) at once.

    q and k of one dtype go to the kernel in a single call (``ropekit_rotate_team_<t>``), which
    halves the fixed cost of crossing into C and, from ``TEAM_MIN_BYTES`` on, splits the rows of
    both over torch's OpenMP threads; the parameters of each signature are prepared once and
    cached. Other pairs (and, without torch's OpenMP team, pairs from ``PARALLEL_MIN_BYTES`` on)
    are two :func:`rotate` calls.

    Returns:
        ``(q_out, k_out)``: q and k themselves in place, else new tensors.
    """
    if not (q.layout is k.layout is cos_q.layout is sin_q.layout is cos_k.layout is sin_k.layout is torch.strided):
        return (rotate(q, cos_q, sin_q, layout=layout, conjugate=conjugate, inplace=inplace),
                rotate(k, cos_k, sin_k, layout=layout, conjugate=conjugate, inplace=inplace))
    key = (q.dtype, q.shape, q.stride(), q.is_cpu, k.dtype, k.shape, k.stride(), k.is_cpu,
           cos_q.dtype, cos_q.shape, cos_q.stride(), cos_q.is_cpu, sin_q.dtype, sin_q.stride(), sin_q.is_cpu,
           cos_k.dtype, cos_k.shape, cos_k.stride(), cos_k.is_cpu, sin_k.dtype, sin_k.stride(), sin_k.is_cpu,
           layout, conjugate, inplace, TEAM_MIN_BYTES, PARALLEL_MIN_BYTES, PLAN_MIN_BYTES, STREAMS)
    run = _pair_prepared.get(key, False)
    if run is False:
        plan = _prepare_pair(q, k, cos_q, sin_q, cos_k, sin_k, layout, conjugate, inplace)
        run = None if plan is None else _team_call(plan, inplace)
        if len(_pair_prepared) >= 256:
            _pair_prepared.clear()
        _pair_prepared[key] = run
    if run is None:
        return (rotate(q, cos_q, sin_q, layout=layout, conjugate=conjugate, inplace=inplace),
                rotate(k, cos_k, sin_k, layout=layout, conjugate=conjugate, inplace=inplace))
    return run(q, k, cos_q, sin_q, cos_k, sin_k)


def runner(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: str, inplace: bool
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """A prepared call ``run(x, cos, sin)`` for tensors shaped and strided like these, or None.

    ``run`` skips every check and the parameter lookup: the caller (``apply_rotary``'s decode
    fast path) vouches that its arguments have exactly the shapes, strides, dtypes and devices
    of the ones given here, with ``cos``/``sin`` possibly viewed with fewer leading dims (the
    same memory). None unless ``x`` is for the kernel, the tables need no conversion, and its
    size needs no Python thread pool.
    """
    plan = _prepare_pair(x, None, cos, sin, None, None, layout, False, inplace)
    if plan is None:
        return None
    team, address, _, nbytes = plan[:4]
    empty = (None,) * 5

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan=plan) -> torch.Tensor:
        out = x if inplace else torch.empty_like(x)
        threads = torch.get_num_threads() if nbytes >= TEAM_MIN_BYTES and not _forked else 1
        status = team(x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), address, *empty, threads)
        if status != 0:
            raise RuntimeError(f"ropekit native kernel rejected its arguments (status {status}); this is a bug")
        if inplace:  # what torch's own in-place ops do: autograd then sees that x changed
            increment_version(x)
        return out

    return run


def pair_runner(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_q: torch.Tensor,
    sin_q: torch.Tensor,
    cos_k: torch.Tensor,
    sin_k: torch.Tensor,
    *,
    layout: str,
    inplace: bool,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """:func:`runner` for q and k: ``run(q, k, cos, sin)`` makes one native call, or None.

    ``cos_k``/``sin_k`` must be views of the memory of ``cos_q``/``sin_q`` (``run`` gets one
    tensor per table and passes it for both).
    """
    if cos_k.data_ptr() != cos_q.data_ptr() or sin_k.data_ptr() != sin_q.data_ptr():
        return None
    plan = _prepare_pair(q, k, cos_q, sin_q, cos_k, sin_k, layout, False, inplace)
    if plan is None:
        return None
    return _team_call(plan, inplace)


def _team_call(plan: tuple, inplace: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``run(q, k, cos_q, sin_q, cos_k=cos_q, sin_k=sin_q) -> (q_out, k_out)``: one kernel call.

    The plan (see :func:`_prepare_pair`) holds the parameter blocks the kernel reads; the
    closure keeps it alive. This is the decode hot path: nothing here that a step can skip.
    """
    team, address_q, address_k, nbytes = plan[:4]

    def run(q, k, cos_q, sin_q, cos_k=None, sin_k=None, plan=plan):
        if cos_k is None:
            cos_k, sin_k = cos_q, sin_q
        q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
        threads = torch.get_num_threads() if nbytes >= TEAM_MIN_BYTES and not _forked else 1
        status = team(q.data_ptr(), q_out.data_ptr(), cos_q.data_ptr(), sin_q.data_ptr(), address_q,
                      k.data_ptr(), k_out.data_ptr(), cos_k.data_ptr(), sin_k.data_ptr(), address_k, threads)
        if status != 0:
            raise RuntimeError(f"ropekit native kernel rejected its arguments (status {status}); this is a bug")
        if inplace:  # what torch's own in-place ops do: autograd then sees that they changed
            increment_version((q, k))
        return q_out, k_out

    return run


def _prepare_pair(q, k, cos_q, sin_q, cos_k, sin_k, layout, conjugate, inplace) -> tuple | None:
    """``(team_fn, params_q address, params_k address or None, total bytes, params arrays...)``, or None.

    ``k`` may be None (q alone). None means "not one team call": the dtypes differ, a tensor
    is empty or not for the kernel, a table would need converting, or the pair is large and
    torch's OpenMP team is not available (the Python thread pool of :func:`rotate` takes it).
    """
    _load()
    tensors = (q,) if k is None else (q, k)
    if q.dtype not in SUFFIX or any(t.dtype is not q.dtype or t.numel() == 0 for t in tensors):
        return None
    nbytes = sum(t.numel() for t in tensors) * q.element_size()
    if nbytes >= PARALLEL_MIN_BYTES and (not _state["openmp"] or _forked):
        return None
    prepared = [_prepare(t, c, s, layout, conjugate, inplace) for t, c, s in ((q, cos_q, sin_q), (k, cos_k, sin_k))
                if t is not None]
    if any(p is None for p in prepared):
        return None
    if any(p[3] is not c or p[4] is not s for p, c, s in zip(prepared, (cos_q, cos_k), (sin_q, sin_k), strict=False)):
        return None  # a table was converted: the prepared call would read the caller's
    params = [p[0] for p in prepared]
    addresses = [a.buffer_info()[0] for a in params] + [None]
    return (_state["teams"][q.dtype], addresses[0], addresses[1], nbytes, *params)  # type: ignore[index]


def _prepare(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str, conjugate: bool, inplace: bool
) -> tuple[array.array, int, int, torch.Tensor, torch.Tensor] | None:
    """Kernel parameters for a non-empty strided ``x``: ``(params, rows, nbytes, cos, sin)``, or None.

    None means "not for the kernel" (see :func:`supports` and :func:`_table_strides`); the
    returned tables are ``cos``/``sin`` themselves unless they had to be converted.
    """
    fit = _table_strides(x, cos, sin) if supports(x, inplace) else None
    if fit is None:
        return None
    cos_strides, sin_strides = fit
    work = torch.float64 if x.dtype is torch.float64 else torch.float32
    if cos.dtype is not work or sin.dtype is not work or not (cos.is_cpu and sin.is_cpu):
        cos, sin = _table(cos, work), _table(sin, work)  # same shapes; strides can change
        cos_strides, sin_strides = _table_strides(x, cos, sin)  # type: ignore[misc]
    elif (cos.stride(-1) != 1 or sin.stride(-1) != 1) and cos.shape[-1] > 1:
        cos, sin = cos.contiguous(), sin.contiguous()
        cos_strides, sin_strides = _table_strides(x, cos, sin)  # type: ignore[misc]
    flags = (_FLAG_INTERLEAVED if layout == "interleaved" else 0) | (_FLAG_CONJUGATE if conjugate else 0)
    if not inplace:
        flags |= _FLAG_COPY_TAIL
    # x's size-1 dims may carry any stride (the kernel drops them); the tables' read 0 there
    sizes = x.shape[:-1]
    x_strides = x.stride()[:-1]
    out_strides = x_strides if inplace else torch.empty_like(x, device="meta").stride()[:-1]
    numel = x.numel()
    nbytes = numel * x.element_size()
    if nbytes >= PLAN_MIN_BYTES:
        sizes, (x_strides, out_strides, cos_strides, sin_strides) = _plan(
            list(sizes), [list(x_strides), list(out_strides), cos_strides, sin_strides], STREAMS
        )
    params = array.array("q", (len(sizes), cos.shape[-1], x.shape[-1], flags, 1, 1, 1, 1, *sizes, *x_strides,
                               *out_strides, *cos_strides, *sin_strides))
    return params, numel // x.shape[-1], nbytes, cos, sin
