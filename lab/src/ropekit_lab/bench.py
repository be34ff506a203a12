"""Benchmark: every available backend and installed peer against a plain copy of the same bytes.

RoPE is memory-bound, so each row is timed next to its floor in the same run:

- in place: ``x.mul_(1.0)`` on q and k (one read and one write of each element);
- out of place: ``x.clone()`` of q and k (the same allocation and bytes as the output);
- forward + backward: the out-of-place floor twice (the backward reads the gradient and writes one).

ropekit is timed through :func:`ropekit.apply_rotary_qk` (q and k in one call), the
counterpart of transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``. For 16-bit dtypes one
more reference row converts q and k to float32 and back into preallocated tensors
(``x -> float32 -> x``, torch's own conversion): the least work of any kernel that computes
in float32 on a CPU without 16-bit arithmetic. On CUDA, Liger's Triton kernel
(``liger-kernel``, when installed) is timed in place.

The peers: transformers' eager recipe (its ``apply_rotary_pos_emb``) and, in the full run (not with
``--quick``: compiling takes tens of seconds a case), ``torch.compile`` of it. On a decode step
(one token), the fused forms' peers too (:mod:`ropekit_lab.bench_peers`): transformers' q/k
``Qwen3RMSNorm`` then the rotation, eager and compiled, beside :func:`ropekit.rms_norm_rotary_qk`
(mode ``norm + rotation``, against the copy floor); and the keys rotated then keys and values
``index_copy_``'d into a static cache slot, eager and compiled, beside :func:`ropekit.rotate_into_cache`
(mode ``into cache``, against the ``index_copy_`` of k and v alone). A compiled peer is compiled once
per case (``torch.compiler.reset()`` first: each case compiles its own), warmed up, then timed in the
same rounds as the other rows. Before anything is timed, every peer's result and every fused form's
is compared with the float64 reference (:func:`ropekit_lab.bench_peers.check`): a row that computes
something else raises, it is never timed.

``ratio_copy = floor_ms / ms`` (1.0 = as fast as copying the bytes) and
``ratio_hf = hf_ms / ms`` (speed-up over transformers' eager recipe
``q * cos + rotate_half(q) * sin`` with tables in the activation dtype). ``saved_mb`` is what
autograd keeps for the backward pass (measured with saved-tensor hooks), next to the recipe's;
on CUDA ``peak_mb`` adds the peak memory allocated by a forward + backward step.

The calls of one shape and dtype are timed together in interleaved rounds
(:mod:`ropekit_lab.bench_timing`) until the time of every call is known to within
:data:`~ropekit_lab.bench_rows.TARGET_PCT` or the case's share of the time budget is spent;
the cheap cases go first, so what they leave of the budget goes to the expensive ones. ``ms`` is
the lower quartile of the samples (a busy machine only ever adds time) and ``error_pct`` its
uncertainty (half-width of a 95% interval, % of ``ms``); ``median_ms`` is the median, ``min_ms``
the fastest, ``spread_pct`` the interquartile range as a percentage of the median and
``repeats`` the number of samples (a call leaves the rounds once its time is known); ``bytes`` is
what the call reads and writes. Every row also carries the run's ``load_avg`` (1-minute load
average when it started, ``None`` where the system has none), ``cores``, ``budget_s`` and
``used_s`` (seconds of timed rounds). ``flags`` (``noisy``, ``beats floor``) and ``note`` (why,
in one line) come from :func:`ropekit_lab.bench_rows.judge`: a row whose time is uncertain, or
which beats the floor that moves the same bytes by more than the uncertainty allows, is a
measurement artefact, not a speed; :func:`ropekit_lab.bench_rows.busy_notice` says, once, when
the machine was too busy for the table to mean much.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ropekit import apply_rotary, apply_rotary_qk, cos_sin, inv_frequencies, ops, rms_norm_rotary_qk, rotate_into_cache

from .bench_peers import (
    CACHE_SLOTS,
    EPS,
    check,
    copy_into_cache,
    norm_then_rotate,
    qwen3_norm,
    reference_norm,
    reference_rotation,
    rotate_then_copy,
)
from .bench_rows import (
    CACHE_COMPILE,
    CACHE_COPY,
    CACHE_EAGER,
    CACHE_OURS,
    COPY,
    INPLACE_PASS,
    NOISE_LIMIT_PCT,
    NORM_COMPILE,
    NORM_EAGER,
    NORM_OURS,
    ROUND_TRIP,
    TARGET_PCT,
    format_table,
    judge,
)
from .bench_timing import Plan, Timing, interleaved, machine_load
from .precision import rotate_half

__all__ = ["Plan", "Shape", "Timing", "bench_shape", "format_table", "judge", "run", "time_ms"]

#: Seconds of timed rounds in all (``--quick``, the full sweep): split over the cases.
QUICK_BUDGET_S, FULL_BUDGET_S = 6.0, 180.0
#: Seconds a turn of one call lasts at least: shorter calls are repeated back to back within it.
SAMPLE_S = 2e-3


@dataclass(frozen=True)
class Shape:
    """One benchmark case: q of ``(batch, q_heads, seq, head_dim)`` and k with ``k_heads``."""

    name: str
    batch: int
    q_heads: int
    k_heads: int
    seq: int
    head_dim: int

    @property
    def elements(self) -> int:
        """Elements of q and k together."""
        return self.batch * (self.q_heads + self.k_heads) * self.seq * self.head_dim


FULL_SHAPES = (
    Shape("prefill", 1, 32, 32, 4096, 128),
    Shape("training", 4, 8, 8, 1024, 64),
    Shape("decode", 16, 32, 32, 1, 128),
    Shape("gqa", 1, 32, 8, 4096, 128),
)
QUICK_SHAPES = (Shape("prefill-1k", 1, 32, 32, 1024, 128), Shape("decode", 16, 32, 32, 1, 128))


def _syncer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> Timing:
    """Wall time of ``fn()`` in milliseconds over exactly ``repeats`` calls after ``warmup`` untimed ones."""
    timings, _ = interleaved({"call": fn}, Plan(repeats, repeats, 0.0, NOISE_LIMIT_PCT), sync=_syncer(device),
                             warmup={"call": warmup})
    return timings["call"]


def _transformers_apply():
    """The own ``apply_rotary_pos_emb`` of transformers (Llama), or ``None`` when not installed."""
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        return None
    return apply_rotary_pos_emb


def _liger_rope():
    """Liger's Triton RoPE (``LigerRopeFunction.apply``), or ``None`` when liger-kernel is not installed."""
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        return None
    return LigerRopeFunction.apply


def hf_recipe(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Eager RoPE of transformers: its ``apply_rotary_pos_emb`` when installed, else the same recipe.

    ``cos``/``sin`` are full-width ``(seq, head_dim)`` tables in the activation dtype.
    """
    apply = _transformers_apply()
    if apply is not None:
        return apply(q, k, cos[None], sin[None])  # (1, seq, d), unsqueezed to (1, 1, seq, d)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def saved_bytes(fn: Callable[[], tuple[torch.Tensor, ...]]) -> int:
    """Bytes of memory autograd keeps for the backward pass while running ``fn``.

    Counted per storage: tensors saved as views of one storage (a table viewed for q and for k)
    occupy its bytes once.
    """
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int | None:
    """Peak CUDA memory allocated while running ``fn`` beyond what was live before (``None`` off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _inputs(shape: Shape, dtype: torch.dtype, device: torch.device):
    """q, k, their half-width float32 tables, the positions ``(seq,)`` and ``inv_freq`` of one case."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(shape.batch, shape.q_heads, shape.seq, shape.head_dim, generator=gen).to(device, dtype)
    k = torch.randn(shape.batch, shape.k_heads, shape.seq, shape.head_dim, generator=gen).to(device, dtype)
    start = 4095 if shape.seq == 1 else 0  # decode: one new token after a 4k context
    inv_freq, _ = inv_frequencies(shape.head_dim)
    positions = torch.arange(start, start + shape.seq, device=device)
    cos, sin = cos_sin(positions, inv_freq)
    return q, k, cos, sin, positions, inv_freq


def _fused_peers(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, full_cos: torch.Tensor,
                 full_sin: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 compile_peer: bool) -> tuple[dict[str, Callable[[], object]], int]:
    """The calls of the fused forms and their peers on a decode step, each checked against the reference first.

    Returns ``({name: call}, bytes a cache write moves)``; names: ``norm transformers``, ``norm compile``
    (with ``compile_peer``), ``norm ropekit``, ``cache copy``, ``cache transformers``, ``cache compile``,
    ``cache ropekit``.
    """
    gen = torch.Generator(device="cpu").manual_seed(1)
    head_dim = q.shape[-1]
    q_weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(q.device, q.dtype)
    k_weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(q.device, q.dtype)
    eager_norm = norm_then_rotate(qwen3_norm(q_weight), qwen3_norm(k_weight), hf_recipe)
    calls: dict[str, Callable[[], object]] = {
        "norm transformers": lambda: eager_norm(q, k, full_cos, full_sin),
        "norm ropekit": lambda: rms_norm_rotary_qk(q, k, q_weight, k_weight, cos, sin, eps=EPS),
    }
    if compile_peer:
        compiled_norm = torch.compile(eager_norm, dynamic=False)
        calls["norm compile"] = lambda: compiled_norm(q, k, full_cos, full_sin)
    expected = (reference_rotation(reference_norm(q, q_weight), positions, inv_freq),
                reference_rotation(reference_norm(k, k_weight), positions, inv_freq))
    for name, impl in (("norm transformers", NORM_EAGER), ("norm compile", NORM_COMPILE), ("norm ropekit", NORM_OURS)):
        if name in calls:
            check(impl, calls[name](), expected)

    v = torch.randn(k.shape, generator=gen).to(k.device, k.dtype)
    batch, kv_heads, seq, _ = k.shape
    slot = CACHE_SLOTS - seq  # the last slots, every call
    k_cache = torch.zeros(batch, kv_heads, CACHE_SLOTS, head_dim, dtype=k.dtype, device=k.device)
    v_cache = torch.zeros_like(k_cache)
    index = torch.arange(slot, slot + seq, device=k.device)
    calls["cache copy"] = lambda: copy_into_cache(k, v, k_cache, v_cache, index)
    calls["cache transformers"] = lambda: rotate_then_copy(k, v, full_cos, full_sin, k_cache, v_cache, index)
    if compile_peer:
        compiled_cache = torch.compile(rotate_then_copy, dynamic=False)
        calls["cache compile"] = lambda: compiled_cache(k, v, full_cos, full_sin, k_cache, v_cache, index)
    calls["cache ropekit"] = lambda: rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slot)
    expected = (reference_rotation(k, positions, inv_freq), v.to(torch.float64))
    for name, impl in (("cache transformers", CACHE_EAGER), ("cache compile", CACHE_COMPILE),
                       ("cache ropekit", CACHE_OURS)):
        if name in calls:
            k_cache.zero_()
            v_cache.zero_()  # a row that wrote nothing fails its check
            calls[name]()
            check(impl, (k_cache[:, :, slot:], v_cache[:, :, slot:]), expected)
    return calls, 2 * (k.numel() + v.numel()) * k.element_size()


def bench_shape(
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device,
    *,
    repeats: int,
    backward: bool = True,
    compile_peer: bool = False,
    budget_s: float = 0.0,
    max_repeats: int | None = None,
) -> list[dict]:
    """All rows for one shape and dtype: floors, peers and every available backend, timed interleaved.

    ``repeats`` rounds at least, then more while a time is uncertain by more than ``TARGET_PCT``,
    ``budget_s`` seconds allow and ``max_repeats`` (default ``repeats``) is not reached.
    """
    plan = Plan(repeats, max(repeats, max_repeats or repeats), budget_s, TARGET_PCT, SAMPLE_S)
    return _case(shape, dtype, device, plan, backward=backward, compile_peer=compile_peer)[0]


def _case(shape: Shape, dtype: torch.dtype, device: torch.device, plan: Plan, *, backward: bool,
          compile_peer: bool) -> tuple[list[dict], float]:
    """``(rows, seconds of timed rounds)`` of one shape and dtype."""
    q, k, cos, sin, positions, inv_freq = _inputs(shape, dtype, device)
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()  # read + write of q and k
    full_cos = torch.cat((cos, cos), -1).to(dtype)
    full_sin = torch.cat((sin, sin), -1).to(dtype)
    qi, ki = q.clone(), k.clone()
    cos_v, sin_v = cos[:, :], sin[:, :]
    calls: dict[str, Callable[[], object]] = {
        "copy": lambda: (q.clone(), k.clone()),
        "in-place floor": lambda: (qi.mul_(1.0), ki.mul_(1.0)),
        "transformers": lambda: hf_recipe(q, k, full_cos, full_sin),
    }
    warmup = {name: 3 for name in ("compile", "norm compile", "cache compile")}
    if compile_peer:
        torch.compiler.reset()  # each case compiles its own (dynamo's recompile limit counts across cases)
    round_trip = dtype.itemsize == 2 and device.type == "cpu"
    if round_trip:
        wide_q, wide_k = torch.empty(q.shape), torch.empty(k.shape)
        back_q, back_k = torch.empty_like(q), torch.empty_like(k)
        calls["round trip"] = lambda: (wide_q.copy_(q), back_q.copy_(wide_q), wide_k.copy_(k), back_k.copy_(wide_k))
    if compile_peer:
        compiled = torch.compile(hf_recipe, dynamic=False)
        calls["compile"] = lambda: compiled(q, k, full_cos, full_sin)
    expected = (reference_rotation(q, positions, inv_freq), reference_rotation(k, positions, inv_freq))
    check("transformers eager", calls["transformers"](), expected)
    if compile_peer:
        check("transformers + torch.compile", calls["compile"](), expected)
    cache_bytes = 0
    if shape.seq == 1:  # a decode step: the fused forms and their peers
        fused, cache_bytes = _fused_peers(q, k, cos, sin, full_cos, full_sin, positions, inv_freq, compile_peer)
        calls.update(fused)
    native_to = {"cpu": "cpu", "triton": "cuda"}  # elsewhere these fall back to the torch backend
    backends = []
    for name in ops.available():
        if native_to.get(name, device.type) != device.type:
            continue
        try:
            apply_rotary(q[:1, :1, :1], cos_v[:1], sin_v[:1], backend=name)
        except (RuntimeError, ValueError, TypeError):
            continue  # backend not usable on this device / dtype
        backends.append(name)
        calls[f"{name} out-of-place"] = lambda n=name: apply_rotary_qk(q, k, cos_v, sin_v, backend=n)
        calls[f"{name} in-place"] = lambda n=name: apply_rotary_qk(qi, ki, cos_v, sin_v, backend=n, inplace=True)
    liger = _liger_rope() if device.type == "cuda" else None
    if liger is not None:
        # Liger rotates (b, h, s, d) views of (b, s, h, d) storage in place, full-width tables
        q_l, k_l = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
        calls["liger"] = lambda: liger(q_l, k_l, full_cos[None], full_sin[None])
    if backward:
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)

        def fwd_bwd(run: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
            def step() -> None:
                out_q, out_k = run()
                torch.autograd.backward((out_q, out_k), (grad_q, grad_k))
            return step

        def ours():
            return apply_rotary_qk(qg, kg, cos_v, sin_v)

        def theirs():
            return hf_recipe(qg, kg, full_cos, full_sin)

        calls["transformers fwd+bwd"], calls["ropekit fwd+bwd"] = fwd_bwd(theirs), fwd_bwd(ours)
    t, seconds = interleaved(calls, plan, sync=_syncer(device), warmup=warmup)
    rows: list[dict] = []

    def add(impl: str, mode: str, timing: Timing, floor: Timing, peer: Timing | None, saved: int | None = None,
            peak: int | None = None) -> None:
        moved = cache_bytes if mode == "into cache" else nbytes * (2 if mode == "fwd+bwd" else 1)
        ms = timing.estimate
        row = {
            "shape": shape.name, "dims": [shape.batch, shape.q_heads, shape.k_heads, shape.seq, shape.head_dim],
            "dtype": str(dtype).replace("torch.", ""), "device": device.type, "impl": impl, "mode": mode,
            "ms": ms, "error_pct": timing.error_pct, "median_ms": timing.median, "min_ms": timing.minimum,
            "spread_pct": timing.spread_pct, "repeats": timing.repeats, "bytes": moved, "gbps": moved / ms / 1e6,
            "ratio_copy": floor.estimate / ms,
            "ratio_hf": None if peer is None else peer.estimate / ms,
            "saved_mb": None if saved is None else saved / 2**20, "peak_mb": None if peak is None else peak / 2**20,
        }
        rows.append(row | judge(row, {"error_pct": floor.error_pct}))

    copy, inplace_floor, hf = t["copy"], t["in-place floor"], t["transformers"]
    add(COPY, "out-of-place", copy, copy, hf)
    add(INPLACE_PASS, "in-place", inplace_floor, inplace_floor, hf)
    add("transformers eager", "out-of-place", hf, copy, hf)
    if round_trip:
        add(ROUND_TRIP, "out-of-place", t["round trip"], copy, hf)
    if compile_peer:
        add("transformers + torch.compile", "out-of-place", t["compile"], copy, hf)
    for name in backends:
        add(name, "out-of-place", t[f"{name} out-of-place"], copy, hf)
        add(name, "in-place", t[f"{name} in-place"], inplace_floor, None)
    if liger is not None:
        add("liger-kernel", "in-place", t["liger"], inplace_floor, None)
    if cache_bytes:
        norm_eager, cache_floor, cache_eager = t["norm transformers"], t["cache copy"], t["cache transformers"]
        add(NORM_EAGER, "norm + rotation", norm_eager, copy, norm_eager)
        if compile_peer:
            add(NORM_COMPILE, "norm + rotation", t["norm compile"], copy, norm_eager)
        add(NORM_OURS, "norm + rotation", t["norm ropekit"], copy, norm_eager)
        add(CACHE_COPY, "into cache", cache_floor, cache_floor, cache_eager)
        add(CACHE_EAGER, "into cache", cache_eager, cache_floor, cache_eager)
        if compile_peer:
            add(CACHE_COMPILE, "into cache", t["cache compile"], cache_floor, cache_eager)
        add(CACHE_OURS, "into cache", t["cache ropekit"], cache_floor, cache_eager)
    if backward:
        hf_bwd = t["transformers fwd+bwd"]
        add("transformers eager", "fwd+bwd", hf_bwd, copy.scaled(2), hf_bwd, saved_bytes(theirs),
            peak_bytes(fwd_bwd(theirs), device))
        add("ropekit auto", "fwd+bwd", t["ropekit fwd+bwd"], copy.scaled(2), hf_bwd, saved_bytes(ours),
            peak_bytes(fwd_bwd(ours), device))
    return rows, seconds


def run(
    *,
    quick: bool = False,
    shapes: tuple[Shape, ...] | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: str | torch.device | None = None,
    repeats: int | None = None,
    compile_peer: bool | None = None,
    budget_s: float | None = None,
    max_repeats: int | None = None,
) -> list[dict]:
    """Run the benchmark and return one dict per row (see the module docstring for the columns).

    Args:
        quick: small shapes, few repeats and a small budget (seconds on a CPU).
        shapes, dtypes: override the sweep.
        device: ``"cpu"`` or ``"cuda"`` (default: CUDA when available).
        repeats: timed rounds per case at least (default 5 quick, 21 full).
        compile_peer: also time ``torch.compile`` of the transformers recipes (slow to compile; default: not
            with ``quick``).
        budget_s: seconds of timed rounds in all, split over the cases (default
            :data:`QUICK_BUDGET_S` or :data:`FULL_BUDGET_S`); 0 times ``repeats`` rounds only.
        max_repeats: rounds per case at most (default 20 times ``repeats``).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = shapes or (QUICK_SHAPES if quick else FULL_SHAPES)
    dtypes = dtypes or ((torch.float32, torch.bfloat16) if device.type == "cpu"
                        else (torch.float32, torch.bfloat16, torch.float16))
    repeats = repeats or (5 if quick else 21)
    budget_s = (QUICK_BUDGET_S if quick else FULL_BUDGET_S) if budget_s is None else budget_s
    max_repeats = max(repeats, max_repeats or 20 * repeats)
    compile_peer = (not quick) if compile_peer is None else compile_peer
    load, cores = machine_load()
    cases = [(shape, dtype) for shape in shapes for dtype in dtypes]
    # the cheap cases first: what they leave of their share goes to the expensive ones
    order = sorted(range(len(cases)), key=lambda i: cases[i][0].elements * cases[i][1].itemsize)
    found: dict[int, list[dict]] = {}
    used = 0.0
    for done, i in enumerate(order):
        share = max(budget_s - used, 0.0) / (len(order) - done)
        plan = Plan(repeats, max_repeats, share, TARGET_PCT, SAMPLE_S)
        found[i], seconds = _case(*cases[i], device, plan, backward=True, compile_peer=compile_peer)
        used += seconds
    machine = {"load_avg": load, "cores": cores, "budget_s": budget_s, "used_s": used}
    return [row | machine for i in range(len(cases)) for row in found[i]]
