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

``ratio_copy = floor_ms / ms`` (1.0 = as fast as copying the bytes) and
``ratio_hf = hf_ms / ms`` (speed-up over transformers' eager recipe
``q * cos + rotate_half(q) * sin`` with tables in the activation dtype). ``saved_mb`` is what
autograd keeps for the backward pass (measured with saved-tensor hooks), next to the recipe's;
on CUDA ``peak_mb`` adds the peak memory allocated by a forward + backward step.

``ms`` is the median over the repeats, ``min_ms`` the fastest and ``spread_pct`` the
interquartile range as a percentage of the median; ``bytes`` is what the call reads and writes.
``flags`` (``noisy``, ``beats floor``) and ``note`` (why, in one line) come from
:func:`ropekit_lab.bench_rows.judge`: a row whose spread is large, or which beats the floor
that moves the same bytes by more than the noise allows, is a measurement artefact, not a speed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ropekit import apply_rotary, apply_rotary_qk, cos_sin, inv_frequencies, ops

from .bench_rows import COPY, INPLACE_PASS, ROUND_TRIP, format_table, judge
from .precision import rotate_half

__all__ = ["Shape", "Timing", "bench_shape", "format_table", "judge", "run", "time_ms"]


@dataclass(frozen=True)
class Shape:
    """One benchmark case: q of ``(batch, q_heads, seq, head_dim)`` and k with ``k_heads``."""

    name: str
    batch: int
    q_heads: int
    k_heads: int
    seq: int
    head_dim: int


FULL_SHAPES = (
    Shape("prefill", 1, 32, 32, 4096, 128),
    Shape("training", 4, 8, 8, 1024, 64),
    Shape("decode", 16, 32, 32, 1, 128),
    Shape("gqa", 1, 32, 8, 4096, 128),
)
QUICK_SHAPES = (Shape("prefill-1k", 1, 32, 32, 1024, 128), Shape("decode", 16, 32, 32, 1, 128))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Wall times of ``repeats`` calls in milliseconds: median, quartiles and minimum."""

    median: float
    q1: float
    q3: float
    minimum: float
    repeats: int

    @property
    def spread_pct(self) -> float | None:
        """Interquartile range as a percentage of the median (``None`` under 3 repeats: no quartiles)."""
        if self.repeats < 3:
            return None
        return 100.0 * (self.q3 - self.q1) / self.median

    def scaled(self, factor: float) -> Timing:
        """The same measurement as the time of ``factor`` calls (the floor of a step that copies twice)."""
        return Timing(self.median * factor, self.q1 * factor, self.q3 * factor, self.minimum * factor, self.repeats)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> Timing:
    """Wall time of ``fn()`` in milliseconds over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive") if repeats > 1 else samples * 3
    return Timing(statistics.median(samples), q1, q3, min(samples), repeats)


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
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(shape.batch, shape.q_heads, shape.seq, shape.head_dim, generator=gen).to(device, dtype)
    k = torch.randn(shape.batch, shape.k_heads, shape.seq, shape.head_dim, generator=gen).to(device, dtype)
    start = 4095 if shape.seq == 1 else 0  # decode: one new token after a 4k context
    inv_freq, _ = inv_frequencies(shape.head_dim)
    cos, sin = cos_sin(torch.arange(start, start + shape.seq, device=device), inv_freq)
    return q, k, cos, sin


def bench_shape(
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device,
    *,
    repeats: int,
    backward: bool = True,
    compile_peer: bool = False,
) -> list[dict]:
    """All rows for one shape and dtype: floors, peers and every available backend."""
    q, k, cos, sin = _inputs(shape, dtype, device)
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()  # read + write of q and k
    full_cos = torch.cat((cos, cos), -1).to(dtype)
    full_sin = torch.cat((sin, sin), -1).to(dtype)
    copy = time_ms(lambda: (q.clone(), k.clone()), device, repeats)
    qi, ki = q.clone(), k.clone()
    inplace_floor = time_ms(lambda: (qi.mul_(1.0), ki.mul_(1.0)), device, repeats)
    hf = time_ms(lambda: hf_recipe(q, k, full_cos, full_sin), device, repeats)
    rows: list[dict] = []

    def add(impl: str, mode: str, timing: Timing, floor: Timing, peer: Timing | None, saved: int | None = None,
            peak: int | None = None) -> None:
        moved = nbytes * (2 if mode == "fwd+bwd" else 1)
        row = {
            "shape": shape.name, "dims": [shape.batch, shape.q_heads, shape.k_heads, shape.seq, shape.head_dim],
            "dtype": str(dtype).replace("torch.", ""), "device": device.type, "impl": impl, "mode": mode,
            "ms": timing.median, "min_ms": timing.minimum, "spread_pct": timing.spread_pct, "bytes": moved,
            "gbps": moved / timing.median / 1e6, "ratio_copy": floor.median / timing.median,
            "ratio_hf": None if peer is None else peer.median / timing.median,
            "saved_mb": None if saved is None else saved / 2**20, "peak_mb": None if peak is None else peak / 2**20,
        }
        rows.append(row | judge(row, {"spread_pct": floor.spread_pct}))

    add(COPY, "out-of-place", copy, copy, hf)
    add(INPLACE_PASS, "in-place", inplace_floor, inplace_floor, hf)
    add("transformers eager", "out-of-place", hf, copy, hf)
    if dtype.itemsize == 2 and device.type == "cpu":
        wide_q, wide_k = torch.empty(q.shape), torch.empty(k.shape)
        back_q, back_k = torch.empty_like(q), torch.empty_like(k)
        add(ROUND_TRIP, "out-of-place",
            time_ms(lambda: (wide_q.copy_(q), back_q.copy_(wide_q), wide_k.copy_(k), back_k.copy_(wide_k)),
                    device, repeats), copy, hf)
    if compile_peer:
        compiled = torch.compile(hf_recipe, dynamic=False)
        add("transformers + torch.compile", "out-of-place",
            time_ms(lambda: compiled(q, k, full_cos, full_sin), device, repeats, warmup=3), copy, hf)
    cos_v, sin_v = cos[:, :], sin[:, :]
    native_to = {"cpu": "cpu", "triton": "cuda"}  # elsewhere these fall back to the torch backend
    for name in ops.available():
        if native_to.get(name, device.type) != device.type:
            continue
        try:
            apply_rotary(q[:1, :1, :1], cos_v[:1], sin_v[:1], backend=name)
        except (RuntimeError, ValueError, TypeError):
            continue  # backend not usable on this device / dtype
        out = time_ms(lambda n=name: apply_rotary_qk(q, k, cos_v, sin_v, backend=n), device, repeats)
        add(name, "out-of-place", out, copy, hf)
        inplace = time_ms(lambda n=name: apply_rotary_qk(qi, ki, cos_v, sin_v, backend=n, inplace=True), device,
                          repeats)
        add(name, "in-place", inplace, inplace_floor, None)
    liger = _liger_rope() if device.type == "cuda" else None
    if liger is not None:
        # Liger rotates (b, h, s, d) views of (b, s, h, d) storage in place, full-width tables
        q_l, k_l = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
        add("liger-kernel", "in-place", time_ms(lambda: liger(q_l, k_l, full_cos[None], full_sin[None]), device,
                                                repeats), inplace_floor, None)
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

        hf_bwd = time_ms(fwd_bwd(theirs), device, repeats)
        ours_bwd = time_ms(fwd_bwd(ours), device, repeats)
        add("transformers eager", "fwd+bwd", hf_bwd, copy.scaled(2), hf_bwd, saved_bytes(theirs),
            peak_bytes(fwd_bwd(theirs), device))
        add("ropekit auto", "fwd+bwd", ours_bwd, copy.scaled(2), hf_bwd, saved_bytes(ours),
            peak_bytes(fwd_bwd(ours), device))
    return rows


def run(
    *,
    quick: bool = False,
    shapes: tuple[Shape, ...] | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: str | torch.device | None = None,
    repeats: int | None = None,
    compile_peer: bool | None = None,
) -> list[dict]:
    """Run the benchmark and return one dict per row (see the module docstring for the columns).

    Args:
        quick: small shapes and few repeats (seconds on a CPU).
        shapes, dtypes: override the sweep.
        device: ``"cpu"`` or ``"cuda"`` (default: CUDA when available).
        repeats: timed repetitions per row (median reported).
        compile_peer: also time ``torch.compile`` of the transformers recipe (slow to compile).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = shapes or (QUICK_SHAPES if quick else FULL_SHAPES)
    dtypes = dtypes or ((torch.float32, torch.bfloat16) if device.type == "cpu"
                        else (torch.float32, torch.bfloat16, torch.float16))
    repeats = repeats or (5 if quick else 21)
    compile_peer = (not quick) if compile_peer is None else compile_peer
    rows: list[dict] = []
    for shape in shapes:
        for dtype in dtypes:
            rows.extend(bench_shape(shape, dtype, device, repeats=repeats, compile_peer=compile_peer))
    return rows
