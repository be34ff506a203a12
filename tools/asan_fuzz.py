"""Fuzz every C++ CPU entry point of ropekit under AddressSanitizer, against the float64 reference.

    python tools/asan_fuzz.py --calls 1500 --seed 0

1. Builds the kernel of ``src/ropekit/ops/csrc`` with ``-fsanitize=address`` (its own build key,
   operators in the namespace ``ropekit_asan``) into a private temporary cache directory
   (``--build-dir`` keeps one between runs).
2. Runs the fuzzer in a child process with the compiler's ``libasan`` preloaded: ``--calls``
   seeded random calls of the ``torch.ops.ropekit_asan`` operators (apply_rotary, apply_rotary_,
   apply_rotary_qk, apply_rotary_qk_, the rms_norm_rotary forms and their backward, rotate_into_cache contiguous with
   one start or per-row starts and paged, rotate_into_cache_scaled (FP8 caches), the rotate_offset
   forms (rows offset + t of full tables), plan_rows) on random shapes, dtypes (float32, float64,
   bfloat16, float16), layouts, strides (permuted, sliced, channel-strided, empty) and tables that
   broadcast. Valid calls are compared with the float64 reference (:mod:`ropekit.ops.reference`;
   the norm and its gradient in float64 autograd); invalid ones (starts and slots out of the cache
   or near 2**63, tables of another batch, widths past head_dim, mismatched shapes, float slots,
   ...) must raise a Python exception and leave their outputs untouched, never be accepted.
   ``slot_mapping`` is fuzzed too (hostile block ids) against its formula.
   rotate_into_cache_scaled: float32, bfloat16 and float16 keys into float8_e4m3fn, float8_e5m2 or
   plain caches (each its own), per-tensor and per-head scales from saturating to subnormal
   entries, slots up to the cache's last one and padding, norm or not. The keys must lie in the
   bracket of the float64 reference (``fp8(clamp(x / scale))`` of x = reference -+ 8 float32 ulps
   at the pair's radius: the reference's own entry wherever no rounding boundary is that close;
   the run fails if under 90% of the entries are pinned so), the values must be
   ``fp8(clamp(v.float() / scale))`` bit for bit, nothing else may change. Refused: scales of 0,
   NaN, inf, negative, of the wrong shape or dtype, missing or given for a plain cache, float64 or
   FP8 inputs, caches of another dtype, too small or of another shape, k and v of different
   shapes, and the slot misfits above.
3. Prints one line (calls, valid, invalid, seconds, findings, FP8 entries and the share pinned to
   one entry) and exits non-zero on any AddressSanitizer report, crash, mismatch or accepted
   invalid call.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer")
NAMESPACE = "ropekit_asan"
DTYPES = ("float32", "float64", "bfloat16", "float16")
TOLERANCE = {"float32": 2e-5, "float64": 2e-6, "bfloat16": 2e-2, "float16": 4e-3}  # float32 tables in all
KEY_DTYPES = ("float32", "bfloat16", "float16")  # the inputs of FP8 caches
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}  # the largest finite values (saturation)


# ---------------------------------------------------------------- parent: build, run the child

def parent(args) -> int:
    """Build the sanitizer kernel, run the worker with its runtime preloaded, print the summary."""
    sys.path.insert(0, str(ROOT / "src"))
    from ropekit.ops import build

    keep = args.build_dir is not None
    cache = Path(args.build_dir) if keep else Path(tempfile.mkdtemp(prefix="ropekit-asan-"))
    os.environ["ROPEKIT_KERNEL_CACHE_DIR"] = str(cache)
    try:
        start = time.monotonic()
        built = build.ensure_built(ASAN_FLAGS, NAMESPACE, quiet=True)
        build_s = time.monotonic() - start
        cxx = build.compiler()
        env = dict(os.environ, LD_PRELOAD=build.asan_preload(cxx), PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
                   ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86:"
                                "allocator_may_return_null=1")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(built.library),
                   "--calls", str(args.calls), "--seed", str(args.seed)]
        start = time.monotonic()
        child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        run_s = time.monotonic() - start
    finally:
        if not keep:
            shutil.rmtree(cache, ignore_errors=True)
    asan = child.stderr.count("ERROR: AddressSanitizer")
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else "no summary (the worker died)"
    ok = child.returncode == 0 and asan == 0
    if not ok:
        sys.stderr.write(child.stderr[-6000:])
    print(f"asan_fuzz: {'OK' if ok else 'FAILED'}: {summary}; AddressSanitizer reports {asan}; "
          f"worker exit {child.returncode}; build {build_s:.0f} s, run {run_s:.0f} s")
    return 0 if ok else 1


# ---------------------------------------------------------------- worker: the fuzzer itself

def bits(t):
    """A contiguous copy of ``t``'s bits as integers (FP8 and NaN compare by their bits)."""
    import torch

    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class Invalid(Exception):
    """An invalid call the kernel accepted (or a refused one that changed its outputs)."""


class Fuzzer:
    """Seeded random calls of every operator, each checked (valid) or required to fail (invalid)."""

    def __init__(self, ops, seed: int):
        import torch

        self.torch = torch
        self.ops = ops
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.valid = self.invalid = 0
        self.fp8_entries = self.fp8_exact = 0  # FP8 key entries checked, and those whose bracket is one entry
        self.kind = ""  # the last invalid argument made (in reports)

    # -- values and layouts
    def values(self, shape, dtype):
        """Random values of ``shape`` in ``dtype`` (a name)."""
        torch = self.torch
        return (torch.randn(*shape, generator=self.gen, dtype=torch.float64) * 2).to(getattr(torch, dtype))

    def strided(self, shape, dtype, *, channels=True):
        """A tensor of ``shape`` and random strides: contiguous, permuted, sliced or channel-strided."""
        kind = self.rng.choice(("contiguous", "permuted", "sliced", "channels" if channels else "sliced"))
        if kind == "contiguous" or len(shape) == 0:
            return self.values(shape, dtype)
        if kind == "permuted":
            order = list(range(len(shape)))
            self.rng.shuffle(order)
            base = self.values([shape[i] for i in order], dtype)
            return base.permute(*[order.index(i) for i in range(len(shape))])
        steps = [self.rng.choice((1, 2)) for _ in shape]
        if kind == "channels":
            steps[-1] = self.rng.choice((2, 3))
        base = self.values([n * s for n, s in zip(shape, steps, strict=True)], dtype)
        return base[tuple(slice(None, None, s) for s in steps)]

    def tables(self, lead, h, *, positions=None):
        """cos/sin (float32) right-aligned against ``lead`` (each axis 1 or lead's), with their positions."""
        torch = self.torch
        import ropekit

        dims = self.rng.randint(0, len(lead))
        shape = [n if self.rng.random() < 0.6 else 1 for n in lead[len(lead) - dims:]]
        if positions is None:
            positions = torch.randint(0, 4096, shape, generator=self.gen)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(h, dtype=torch.float64) / max(h, 1)))
        cos, sin = ropekit.cos_sin(positions, inv_freq)
        cos, sin = cos.reshape(*shape, h), sin.reshape(*shape, h)
        return cos, sin, positions, inv_freq

    def shape(self, ndim, head_dim):
        """Leading sizes (sometimes 0) and ``head_dim``."""
        return [self.rng.choice((0, 1, 2, 3, 4)) if self.rng.random() < 0.05 else self.rng.randint(1, 4)
                for _ in range(ndim - 1)] + [head_dim]

    def head(self):
        """``(head_dim, rotary half width)``."""
        head_dim = self.rng.choice((2, 4, 6, 8, 16, 34))
        h = self.rng.randint(0, head_dim // 2) if self.rng.random() < 0.3 else head_dim // 2
        return head_dim, h

    def cache_options(self):
        """A cache write's ``(interleaved, paged, kv heads, normalise, per-token norm)``."""
        rng = self.rng
        interleaved = rng.random() < 0.5
        paged = rng.random() < 0.5
        heads = rng.randint(1, 3)
        normalise = rng.random() < 0.3
        return interleaved, paged, heads, normalise, normalise and rng.random() < 0.5

    # -- the float64 oracles
    def rotated(self, x64, positions, inv_freq, lead, h, interleaved, conjugate):
        """``x64`` rotated by the reference's float64 rotation matrices (tables' positions broadcast)."""
        from ropekit.ops.reference import apply_reference

        torch = self.torch
        if h == 0 or x64.numel() == 0:
            return x64.clone()
        pos = positions.reshape([1] * (len(lead) - positions.dim()) + list(positions.shape))
        pos = torch.broadcast_to(pos, lead)
        return apply_reference(x64, -pos if conjugate else pos, inv_freq,
                               layout="interleaved" if interleaved else "half")

    def rotate_table(self, x64, cos, sin, h, interleaved):
        """Differentiable float64 rotation by the tables (for the gradient oracle)."""
        from ropekit.ops.reference import pair_indices

        first, second = pair_indices(2 * h, "interleaved" if interleaved else "half")
        c, s = cos.to(self.torch.float64), sin.to(self.torch.float64)
        a, b = x64[..., first], x64[..., second]
        out = x64.clone()
        out[..., first] = a * c - b * s
        out[..., second] = b * c + a * s
        return out

    @staticmethod
    def normed(x64, w64, eps, offset, per_token):
        """The float64 RMSNorm (over the last axis, or the last two per token)."""
        dims = (-2, -1) if per_token else (-1,)
        gains = 1.0 if w64 is None else offset + w64
        return x64 * (x64.pow(2).mean(dim=dims, keepdim=True) + eps).rsqrt() * gains

    def close(self, got, want, dtype, what):
        """Raise AssertionError unless ``got`` is within the dtype's tolerance of the float64 ``want``."""
        torch = self.torch
        if got.shape != want.shape:
            raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        tol = TOLERANCE[dtype]
        scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
        err = float((got.to(torch.float64) - want).abs().max()) if want.numel() else 0.0
        if not err <= tol * scale:
            raise AssertionError(f"{what}: {dtype} off the float64 reference by {err:.3g} "
                                 f"(tolerance {tol * scale:.3g})")

    def refused(self, call, *outputs):
        """``call`` must raise, and leave ``outputs`` as they were."""
        before = [bits(t) for t in outputs]
        try:
            call()
        except (RuntimeError, ValueError, TypeError, IndexError):
            for t, b in zip(outputs, before, strict=True):
                if not self.torch.equal(bits(t), b):
                    raise Invalid(f"a refused call changed its output ({self.kind})") from None
            self.invalid += 1
            return
        raise Invalid(f"an invalid call was accepted ({self.kind})")

    # -- entry points
    def case_apply_rotary(self):
        """apply_rotary, apply_rotary_, apply_rotary_qk, apply_rotary_qk_."""
        rng, ops = self.rng, self.ops
        dtype, (head_dim, h) = rng.choice(DTYPES), self.head()
        interleaved, conjugate = rng.random() < 0.5, rng.random() < 0.3
        form = rng.choice(("apply_rotary", "apply_rotary_", "apply_rotary_qk", "apply_rotary_qk_"))
        pair = form.startswith("apply_rotary_qk")
        shape = self.shape(rng.randint(1, 5), head_dim)
        q = self.strided(shape, dtype)
        k = self.strided(shape, dtype) if pair else None
        cos, sin, positions, inv_freq = self.tables(shape[:-1], h)
        if rng.random() < 0.3:
            cos, sin = cos.to(self.torch.float64), sin.to(self.torch.float64)
        op = getattr(ops, form)
        args = (cos, sin, interleaved, conjugate)
        if rng.random() < 0.25:  # invalid: tables that do not fit
            bad = self.bad_tables(cos, sin, shape, h)
            inputs = (q, k) if pair else (q,)
            self.refused(lambda: op(*inputs, *bad, interleaved, conjugate), *[t for t in inputs if form.endswith("_")])
            return
        want = [self.rotated(t.to(self.torch.float64), positions, inv_freq, shape[:-1], h, interleaved, conjugate)
                for t in ((q, k) if pair else (q,))]
        if form.endswith("_"):
            op(*((q, k) if pair else (q,)), *args)
            got = (q, k) if pair else (q,)
        else:
            got = op(*((q, k) if pair else (q,)), *args)
            got = got if pair else (got,)
        for g, w in zip(got, want, strict=True):
            self.close(g, w, dtype, form)
        self.valid += 1

    def bad_tables(self, cos, sin, shape, h):
        """cos/sin that do not fit x of ``shape`` (one kind of misfit at random)."""
        torch, rng = self.torch, self.rng
        kind = self.kind = rng.choice(("wide", "huge", "mismatch", "sin", "rank", "int"))
        if kind == "wide":  # rotary_dim past head_dim
            c = torch.zeros(shape[-1] // 2 + 1)
            return c, c.clone()
        if kind == "huge":  # an empty table whose width wraps 2 * h
            c = torch.zeros(0, 2**62)
            return c, c.clone()
        if kind == "mismatch" and len(shape) > 1:  # an axis of neither 1 nor x's size
            c = torch.zeros(*shape[:-1], h)
            c = torch.zeros(*c.shape[:-2], shape[-2] + 2, h) if c.dim() >= 2 else c
            return c, c.clone()
        if kind == "sin":
            return cos, torch.zeros(*sin.shape[:-1], sin.shape[-1] + 1)
        if kind == "rank":
            c = torch.zeros(2, 1, *shape[:-1], h)
            return c, c.clone()
        c = torch.zeros(shape[-1] // 2 + 1, dtype=torch.int64)  # converted like float tables: too wide
        return c, c.clone()

    def case_norm(self):
        """The rms_norm_rotary forms and their backward."""
        torch, rng, ops = self.torch, self.rng, self.ops
        dtype, (head_dim, h) = rng.choice(DTYPES), self.head()
        interleaved, per_token = rng.random() < 0.5, rng.random() < 0.5
        form = rng.choice(("rms_norm_rotary", "rms_norm_rotary_", "rms_norm_rotary_qk", "rms_norm_rotary_qk_",
                           "rms_norm_rotary_backward"))
        pair = form.startswith("rms_norm_rotary_qk")
        shape = self.shape(rng.randint(2, 5), head_dim)
        wshape = shape[-2:] if per_token else shape[-1:]
        x = self.strided(shape, dtype)
        k = self.strided(shape, dtype) if pair else None
        weight = self.values(wshape, rng.choice(("float32", dtype))) if rng.random() < 0.7 else None
        offset = 0.0 if weight is None else rng.choice((0.0, 1.0))
        eps = rng.choice((1e-6, 1e-5, 0.1))
        cos, sin, positions, inv_freq = self.tables(shape[:-1], h)
        op = getattr(ops, form)
        if rng.random() < 0.25:
            kind = rng.choice(("weight", "tables") + (("grad",) if form == "rms_norm_rotary_backward" else ()))
            self.kind = f"{form} {kind}"
            bad_weight = self.values([wshape[-1] + 1], "float32") if kind == "weight" else weight
            c, s = self.bad_tables(cos, sin, shape, h) if kind == "tables" else (cos, sin)
            opts = (eps, offset if bad_weight is not None else 0.0, per_token, interleaved)
            if form == "rms_norm_rotary_backward":
                grad = self.values(shape[:-1] + [head_dim + (2 if kind == "grad" else 0)], dtype)
                self.refused(lambda: op(grad, x, bad_weight, c, s, *opts))
            elif pair:
                self.refused(lambda: op(x, k, bad_weight, weight, c, s, *opts), *((x, k) if form.endswith("_") else ()))
            else:
                self.refused(lambda: op(x, bad_weight, c, s, *opts), *((x,) if form.endswith("_") else ()))
            return
        opts = (eps, offset, per_token, interleaved)
        w64 = None if weight is None else weight.to(torch.float64)
        if form == "rms_norm_rotary_backward":
            grad = self.values(shape, dtype)
            x64 = x.to(torch.float64).requires_grad_(True)
            w_req = None if w64 is None else w64.clone().requires_grad_(True)
            y = self.rotate_table(self.normed(x64, w_req, eps, offset, per_token), cos, sin, h, interleaved)
            inputs = [x64] + ([] if w_req is None else [w_req])
            grads = torch.autograd.grad(y, inputs, grad.to(torch.float64), allow_unused=True)
            got_x, got_w = op(grad, x, weight, cos, sin, *opts)
            self.close(got_x, grads[0], dtype, form + " grad_x")
            if weight is not None:
                self.close(got_w, grads[1], "bfloat16" if dtype in ("bfloat16", "float16") else "float32",
                           form + " grad_weight")
            self.valid += 1
            return
        want = [self.rotated(self.normed(t.to(torch.float64), w64, eps, offset, per_token), positions, inv_freq,
                             shape[:-1], h, interleaved, False) for t in ((x, k) if pair else (x,))]
        if pair:
            result = op(x, k, weight, weight, cos, sin, *opts)
            got = (x, k) if form.endswith("_") else result
        else:
            result = op(x, weight, cos, sin, *opts)
            got = (x,) if form.endswith("_") else (result,)
        for g, w in zip(got, want, strict=True):
            self.close(g, w, "bfloat16" if dtype == "bfloat16" else ("float16" if dtype == "float16" else "float32"),
                       form)
        self.valid += 1

    def geometry(self, paged, heads, head_dim, *, edge=False):
        """A cache write's shapes and slots: ``(k_shape, cache_shape, block_size, slots, start, written, positions)``.

        Paged: ``written`` is the slot of each token (-1: padding); contiguous: the first row each batch
        row writes (one start, a ``()`` tensor or per-row starts). ``edge``: often a slot at the cache's end.
        """
        torch, rng = self.torch, self.rng
        if paged:
            block_size, blocks = rng.choice((1, 2, 4)), rng.randint(1, 4)
            tokens = rng.randint(0, blocks * block_size)
            k_shape, cache_shape = [tokens, heads, head_dim], [blocks, block_size, heads, head_dim]
            slot_list = rng.sample(range(blocks * block_size), tokens)
            if edge and tokens and blocks * block_size - 1 not in slot_list and rng.random() < 0.5:
                slot_list[rng.randrange(tokens)] = blocks * block_size - 1  # the last slot of the last block
            slot_list = [s if rng.random() < 0.85 else -1 for s in slot_list]
            slots, start = torch.tensor(slot_list, dtype=rng.choice((torch.int64, torch.int32))), 0
            positions = torch.randint(0, 4096, [tokens, 1], generator=self.gen)
            return k_shape, cache_shape, block_size, slots, start, slot_list, positions
        block_size, batch, seq, length = 0, rng.randint(1, 4), rng.randint(0, 3), rng.randint(3, 6)
        k_shape, cache_shape = [batch, heads, seq, head_dim], [batch, heads, length, head_dim]
        starts = [rng.randint(0, length - seq) for _ in range(batch)]
        if edge and rng.random() < 0.5:
            starts[rng.randrange(batch)] = length - seq  # rows up to the cache's last one
        choice = rng.random()
        if choice < 0.3:
            slots, start, starts = None, starts[0], [starts[0]] * batch
        elif choice < 0.5:
            slots, starts = torch.tensor(starts[0]), [starts[0]] * batch
            start = 0
        else:
            slots, start = torch.tensor(starts, dtype=rng.choice((torch.int64, torch.int32))), 0
        positions = torch.randint(0, 4096, [batch if rng.random() < 0.5 else 1, 1, seq, 1], generator=self.gen)[..., 0]
        return k_shape, cache_shape, block_size, slots, start, starts, positions

    def case_cache(self):
        """rotate_into_cache: contiguous (one start, per-row starts) and paged, keys normalised or not."""
        torch, rng = self.torch, self.rng
        dtype, (head_dim, h) = rng.choice(DTYPES), self.head()
        interleaved, paged, heads, normalise, per_token = self.cache_options()
        k_shape, cache_shape, block_size, slots, start, written, positions = self.geometry(paged, heads, head_dim)
        slot_list = starts = written
        seq = 0 if paged else k_shape[2]
        k, v = self.strided(k_shape, dtype), self.strided(k_shape, dtype)
        k_cache = self.strided(cache_shape, dtype, channels=rng.random() < 0.3)
        v_cache = self.strided(cache_shape, dtype, channels=rng.random() < 0.3)
        lead_t = positions.shape
        inv_freq = 1.0 / (10000.0 ** (torch.arange(h, dtype=torch.float64) / max(h, 1)))
        import ropekit

        cos, sin = ropekit.cos_sin(positions, inv_freq)
        cos, sin = cos.reshape(*lead_t, h), sin.reshape(*lead_t, h)
        weight_shape = [heads, head_dim] if per_token else [head_dim]
        weight = self.values(weight_shape, "float32") if normalise and rng.random() < 0.7 else None
        eps = 1e-5 if normalise else None
        offset = 1.0 if weight is not None and rng.random() < 0.5 else 0.0
        call = [k, v, cos, sin, k_cache, v_cache, slots, start, weight, eps, offset, per_token, block_size,
                interleaved]
        if rng.random() < 0.35:
            self.bad_cache(call, paged, k_shape, cache_shape, h)
            return
        expect_k, expect_v = k_cache.to(torch.float64), v_cache.to(torch.float64)
        k64 = k.to(torch.float64)
        if normalise:
            axes = k64 if paged else k64.transpose(1, 2)
            w64 = None if weight is None else weight.to(torch.float64)
            k64 = self.normed(axes, w64, eps, offset, per_token)
            k64 = k64 if paged else k64.transpose(1, 2)
        lead = list(k_shape[:-1])
        rot = self.rotated(k64, positions, inv_freq, lead, h, interleaved, False)
        if paged:
            for t, s in enumerate(slot_list):
                if s >= 0:
                    expect_k[s // block_size, s % block_size] = rot[t]
                    expect_v[s // block_size, s % block_size] = v[t].to(torch.float64)
        else:
            for b, first in enumerate(starts):
                expect_k[b, :, first:first + seq] = rot[b]
                expect_v[b, :, first:first + seq] = v[b].to(torch.float64)
        self.ops.rotate_into_cache(*call)
        tol_dtype = dtype if dtype in ("bfloat16", "float16") else "float32"
        self.close(k_cache, expect_k, tol_dtype, "rotate_into_cache keys")
        if not torch.equal(v_cache.to(torch.float64), expect_v):
            raise AssertionError("rotate_into_cache: the values are not copied bit for bit into their slots")
        self.valid += 1

    def bad_cache(self, call, paged, k_shape, cache_shape, h, op=None):
        """``call`` of ``op`` (rotate_into_cache by default) made invalid: slots out of the cache, tables misfit, ...

        Slots out of the cache or near 2**63, tables of another batch, a block size that is not the cache's.
        """
        torch, rng = self.torch, self.rng
        op = op or self.ops.rotate_into_cache
        call = list(call)
        big = rng.choice((2**63 - 1, 2**62, 2**63 - 2))
        if paged:
            kind = self.kind = rng.choice(("slot", "huge", "count", "float", "tables", "block", "none"))
            tokens = k_shape[0]
            if kind in ("slot", "huge") or tokens == 0:
                slots = call[6].to(torch.int64).clone() if tokens else torch.zeros(0, dtype=torch.int64)
                if tokens:
                    slots[rng.randrange(tokens)] = cache_shape[0] * cache_shape[1] if kind == "slot" else abs(big)
                else:
                    slots = torch.tensor([0])
                call[6] = slots
            elif kind == "count":
                call[6] = torch.zeros(tokens + 1, dtype=torch.int64)
            elif kind == "float":
                call[6] = call[6].to(torch.float32)
            elif kind == "tables":
                call[2] = torch.zeros(tokens + 1, 1, h)
                call[3] = torch.zeros(tokens + 1, 1, h)
            elif kind == "block":
                call[12] = cache_shape[1] + 1
            else:
                call[6] = None
        else:
            kind = self.kind = rng.choice(("start", "huge", "rows", "count", "tables", "negative"))
            batch, seq, length = k_shape[0], k_shape[2], cache_shape[2]
            if kind == "start":
                call[6], call[7] = None, length - seq + 1
            elif kind == "negative":
                call[6], call[7] = None, -1
            elif kind == "huge":
                call[6], call[7] = None, rng.choice((big, -(2**63)))
            elif kind == "rows":  # per-row starts, one of them out of the cache
                starts = [0] * max(batch, 2)
                starts[rng.randrange(len(starts))] = rng.choice((abs(big), length - seq + 1, -1))
                call[6] = torch.tensor(starts[:batch] if batch > 1 else [starts[0]])
                if batch == 1:
                    call[6] = torch.tensor([rng.choice((abs(big), length - seq + 1, -1))])
            elif kind == "count":
                call[6] = torch.zeros(batch + 1, dtype=torch.int64)
            else:  # tables of another batch (per-row starts: the branch that read past them)
                call[6] = torch.zeros(batch, dtype=torch.int64)
                other = batch + 1 if batch < 2 else batch // 2 if batch % 2 == 0 and batch > 2 else batch + 1
                call[2] = torch.zeros(other, 1, seq, h)
                call[3] = torch.zeros(other, 1, seq, h)
        self.refused(lambda: op(*call), call[4], call[5])

    # -- FP8 caches: rotate_into_cache_scaled
    def scale(self, heads):
        """A valid float32 ``(heads,)`` scale: per tensor (one value, a stride-0 view), per head, or a strided view."""
        torch, rng = self.torch, self.rng
        values = [2.0 ** rng.uniform(-14, 4) for _ in range(heads)]  # saturating ... subnormal entries
        kind = rng.choice(("tensor", "head", "strided"))
        if kind == "tensor":
            return torch.tensor([values[0]], dtype=torch.float32).expand(heads)
        if kind == "head":
            return torch.tensor(values, dtype=torch.float32)
        return torch.tensor([v for value in values for v in (value, -1.0)], dtype=torch.float32)[::2]

    @staticmethod
    def entry(x64, cache_dtype, s64):
        """The cache entry (as float64) of float64 ``x64``: ``fp8(clamp(x / s, -max, max))``, or x in the dtype."""
        import torch

        dtype = getattr(torch, cache_dtype)
        if cache_dtype in FP8_MAX:
            return (x64 / s64).clamp(-FP8_MAX[cache_dtype], FP8_MAX[cache_dtype]).to(dtype).to(torch.float64)
        return x64.to(dtype).to(torch.float64)

    def float32_bound(self, y64, h, interleaved):
        """8 float32 ulps at each element's pair radius (its own magnitude on the tail) of the exact keys ``y64``.

        Room for the float32 tables' and the kernel's own rounding, and the quotient's float32 rounding.
        """
        torch = self.torch
        r = y64.abs()
        if h:
            first = torch.arange(0, 2 * h, 2) if interleaved else torch.arange(h)
            second = first + 1 if interleaved else first + h
            radius = torch.hypot(y64[..., first], y64[..., second])
            r = r.clone()
            r[..., first], r[..., second] = radius, radius
        exponent = torch.floor(torch.log2(r.clamp_min(1e-300))).clamp_min(-126)
        return 8 * torch.exp2(exponent - 23)

    def case_cache_scaled(self):
        """rotate_into_cache_scaled into FP8 (float8_e4m3fn, float8_e5m2) and plain caches, or refusing.

        Per-tensor and per-head scales, contiguous and paged, keys normalised or not. The keys must lie in
        the bracket of the float64 reference (one rounding from a float32 within 8 ulps of it: the very
        entry of the reference's wherever no rounding boundary is that close); the values are
        ``fp8(clamp(v.float() / v_scale))`` (or v) bit for bit; nothing else changes.
        """
        torch, rng = self.torch, self.rng
        dtype, (head_dim, h) = rng.choice(KEY_DTYPES), self.head()
        interleaved, paged, heads, normalise, per_token = self.cache_options()
        cache_dtypes = [rng.choice(("float8_e4m3fn", "float8_e5m2", "float8_e4m3fn", "float8_e5m2", dtype))
                        for _ in range(2)]
        k_shape, cache_shape, block_size, slots, start, written, positions = self.geometry(paged, heads, head_dim,
                                                                                           edge=True)
        k, v = self.strided(k_shape, dtype), self.strided(k_shape, dtype)
        k_cache = self.strided(cache_shape, cache_dtypes[0], channels=rng.random() < 0.3)
        v_cache = self.strided(cache_shape, cache_dtypes[1], channels=rng.random() < 0.3)
        scales = [self.scale(heads) if c in FP8_MAX else None for c in cache_dtypes]
        inv_freq = 1.0 / (10000.0 ** (torch.arange(h, dtype=torch.float64) / max(h, 1)))
        import ropekit

        cos, sin = ropekit.cos_sin(positions, inv_freq)
        cos, sin = cos.reshape(*positions.shape, h), sin.reshape(*positions.shape, h)
        weight_shape = [heads, head_dim] if per_token else [head_dim]
        weight = self.values(weight_shape, "float32") if normalise and rng.random() < 0.7 else None
        eps = 1e-5 if normalise else None
        offset = 1.0 if weight is not None and rng.random() < 0.5 else 0.0
        call = [k, v, cos, sin, k_cache, v_cache, slots, start, weight, eps, offset, per_token, block_size,
                interleaved, *scales]
        if rng.random() < 0.35:
            self.bad_scaled(call, paged, k_shape, cache_shape, h, cache_dtypes)
            return
        k_in, v_in = bits(k), bits(v)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        self.ops.rotate_into_cache_scaled(*call)
        if not (torch.equal(bits(k), k_in) and torch.equal(bits(v), v_in)):
            raise AssertionError("rotate_into_cache_scaled changed k or v")
        # where the call writes: cache index -> k index, per batch row (contiguous) or token (paged)
        if paged:
            places = [((s // block_size, s % block_size), t) for t, s in enumerate(written) if s >= 0]
        else:
            places = [((b, slice(None), slice(first, first + k_shape[2])), b) for b, first in enumerate(written)]
        s64 = [None if s is None else s.to(torch.float64).reshape([-1] + [1] * (len(k_shape) - 2)) for s in scales]
        # the keys: in the bracket of the float64 reference, one rounding from x in [y64 - tol, y64 + tol]
        k64 = k.to(torch.float64)
        if normalise:
            axes = k64 if paged else k64.transpose(1, 2)
            w64 = None if weight is None else weight.to(torch.float64)
            k64 = self.normed(axes, w64, eps, offset, per_token)
            k64 = k64 if paged else k64.transpose(1, 2)
        y64 = self.rotated(k64, positions, inv_freq, list(k_shape[:-1]), h, interleaved, False)
        tol = self.float32_bound(y64, h, interleaved)
        low = self.entry(y64 - tol, cache_dtypes[0], s64[0])
        high = self.entry(y64 + tol, cache_dtypes[0], s64[0])
        got = k_cache.to(torch.float64)
        untouched = torch.ones(cache_shape, dtype=torch.bool)
        for where, i in places:
            if not bool(((got[where] >= low[i]) & (got[where] <= high[i])).all()):
                bad = ~((got[where] >= low[i]) & (got[where] <= high[i]))
                raise AssertionError(f"rotate_into_cache_scaled keys into {cache_dtypes[0]} ({dtype} keys): "
                                     f"{got[where][bad][0].item()!r} outside the one-rounding bracket "
                                     f"[{low[i][bad][0].item()!r}, {high[i][bad][0].item()!r}] of the float64 "
                                     f"reference")
            untouched[where] = False
            if cache_dtypes[0] in FP8_MAX:
                self.fp8_entries += low[i].numel()
                self.fp8_exact += int((low[i] == high[i]).sum())
        if not torch.equal(bits(k_cache)[untouched], bits(k_before)[untouched]):
            raise AssertionError("rotate_into_cache_scaled wrote keys outside their slots")
        # the values: fp8(clamp(v.float() / v_scale)) in float32 torch ops, or v itself, bit for bit
        if cache_dtypes[1] in FP8_MAX:
            limit = FP8_MAX[cache_dtypes[1]]
            v_scale = scales[1].reshape([-1] + [1] * (len(k_shape) - 2))  # along the heads axis
            want_v = (v.to(torch.float32) / v_scale).clamp(-limit, limit).to(getattr(torch, cache_dtypes[1]))
        else:
            want_v = v
        expect_v = bits(v_before)
        for where, i in places:
            expect_v[where] = bits(want_v[i])
        if not torch.equal(bits(v_cache), expect_v):
            raise AssertionError(f"rotate_into_cache_scaled values into {cache_dtypes[1]} ({dtype} values): not "
                                 f"the one rounding of v / v_scale in their slots, or other entries changed")
        self.valid += 1

    def bad_scaled(self, call, paged, k_shape, cache_shape, h, cache_dtypes):
        """A rotate_into_cache_scaled call made invalid: bad scales, dtypes or shapes, or (bad_cache) slots."""
        torch, rng = self.torch, self.rng
        op = self.ops.rotate_into_cache_scaled
        kind = rng.choice(("slots", "slots", "scale", "scale", "missing", "plain", "scale_shape", "scale_dtype",
                           "input_dtype", "cache_dtype", "float64", "shape", "small"))
        if kind == "slots":  # slots past the end or negative (not padding), huge, tables of another batch ...
            self.bad_cache(call, paged, k_shape, cache_shape, h, op=op)
            self.kind = "scaled " + self.kind
            return
        self.kind = f"scaled {kind}"
        call = list(call)
        heads = k_shape[-2] if paged else k_shape[1]
        which = rng.randrange(2)  # the k (0) or v (1) side
        cache_at, scale_at = 4 + which, 14 + which
        fp8 = [c in FP8_MAX for c in cache_dtypes]
        if kind in ("scale", "missing", "scale_shape", "scale_dtype") and not fp8[which]:
            call[cache_at] = self.values(cache_shape, "float8_e4m3fn")  # an FP8 cache: these kinds need one
            call[scale_at] = self.scale(heads)
        if kind == "scale":  # a value of 0, NaN, inf or negative (one head's, or a view's)
            scale = call[scale_at].clone()
            scale[rng.randrange(heads)] = rng.choice((0.0, -0.0, float("nan"), float("inf"), -float("inf"), -1.0,
                                                      -(2.0**-20)))
            call[scale_at] = scale
        elif kind == "missing":
            call[scale_at] = None
        elif kind == "plain":  # a scale for a cache that is not FP8 (in the input's dtype)
            call[cache_at] = self.strided(cache_shape, str(call[which].dtype).removeprefix("torch."))
            call[scale_at] = self.scale(heads)
        elif kind == "scale_shape":
            call[scale_at] = rng.choice((torch.ones(heads + 1), torch.ones(heads, 1), torch.ones(1, heads),
                                         torch.tensor(1.0), torch.ones(0), torch.ones(2 * heads + 2)))
        elif kind == "scale_dtype":
            call[scale_at] = torch.ones(heads, dtype=rng.choice((torch.float64, torch.bfloat16, torch.float16,
                                                                 torch.int32, torch.int64)))
        elif kind == "input_dtype":  # float64 or FP8 keys/values into an FP8 cache
            bad = rng.choice(("float64", "float8_e4m3fn"))
            call[0], call[1] = self.values(k_shape, bad), self.values(k_shape, bad)
            call[4] = self.values(cache_shape, "float8_e5m2")
            call[14] = self.scale(heads)
        elif kind == "cache_dtype":  # a plain cache of another dtype than its input's
            other = rng.choice([d for d in ("float32", "bfloat16", "float16", "float64", "int32")
                                if getattr(torch, d) != call[which].dtype])
            call[cache_at], call[scale_at] = self.values(cache_shape, other), None
        elif kind == "float64":  # float64 into a float64 cache beside an FP8 one (the kernel stores from float32)
            call[which], call[cache_at], call[scale_at] = (self.values(k_shape, "float64"),
                                                           self.values(cache_shape, "float64"), None)
            call[5 - which], call[15 - which] = self.values(cache_shape, "float8_e4m3fn"), self.scale(heads)
        elif kind == "shape":  # v of another shape than k
            v_shape = list(k_shape)
            v_shape[rng.randrange(len(v_shape))] += 1
            call[1] = self.values(v_shape, str(call[1].dtype).removeprefix("torch."))
        else:  # caches too small (fewer rows or heads, narrower) or of different shapes
            small = list(cache_shape)
            axis = rng.choice((1, 2, 3)) if paged else rng.choice((0, 1, 2, 3))
            if not paged and axis == 2:
                small[2] = max(k_shape[2] - 1, 0)  # shorter than the new tokens
                if k_shape[2] == 0:
                    small[3] += 1
            else:
                small[axis] = small[axis] - 1 if small[axis] > 1 else small[axis] + 1
            if paged and axis == 1:
                small[3] += 1  # also another width: a smaller block alone only moves the slots' bound
            targets = (4, 5) if rng.random() < 0.5 else (4 + which,)
            for at in targets:
                call[at] = self.values(small, str(call[at].dtype).removeprefix("torch."))
        self.refused(lambda: op(*call), call[4], call[5])

    def case_offset(self):
        """rotate_offset, rotate_offset_, rotate_qk_offset, rotate_qk_offset_: rows offset + t of full tables."""
        torch, rng, ops = self.torch, self.rng, self.ops
        dtype, (head_dim, h) = rng.choice(DTYPES), self.head()
        interleaved, conjugate = rng.random() < 0.5, rng.random() < 0.3
        form = rng.choice(("rotate_offset", "rotate_offset_", "rotate_qk_offset", "rotate_qk_offset_"))
        pair = form.startswith("rotate_qk")
        shape = self.shape(rng.randint(2, 5), head_dim)
        seq_axis = rng.randrange(len(shape) - 1)
        tokens = shape[seq_axis]
        rows = tokens + rng.randint(0, 40)
        offset = rng.randint(0, rows - tokens)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(h, dtype=torch.float64) / max(h, 1)))
        table_dtype = rng.choice((torch.float32, torch.float32, torch.float64, torch.bfloat16))
        angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq
        cos, sin = angles.cos().to(table_dtype), angles.sin().to(table_dtype)
        if rng.random() < 0.3:  # tables that are views: every other row, or channel-strided
            dim = rng.choice((0, 1))
            cos, sin = (t.repeat_interleave(2, dim=dim) for t in (cos, sin))
            cos, sin = (cos[::2], sin[::2]) if dim == 0 else (cos[:, ::2], sin[:, ::2])
        q = self.strided(shape, dtype)
        k = self.strided(shape, dtype) if pair else None
        inputs = (q, k) if pair else (q,)
        op = getattr(ops, form)
        if rng.random() < 0.3:  # invalid: rows past the tables, a wrong axis, misfit tables
            kind = self.kind = rng.choice(("past", "negative", "huge", "axis", "last", "wide", "sin", "rank"))
            args = [cos, sin, offset, seq_axis]
            if kind == "past":
                args[2] = rows - tokens + rng.randint(1, 3)
            elif kind == "negative":
                args[2] = -rng.randint(1, 2**62)
            elif kind == "huge":
                args[2] = rng.choice((2**63 - 1, 2**62, 2**63 - tokens))
            elif kind == "axis":
                args[3] = rng.choice((-1, -2, len(shape) - 1, len(shape), 2**40))
            elif kind == "last":
                args[3] = len(shape) - 1
            elif kind == "wide":
                c = torch.zeros(rows, head_dim // 2 + 1)
                args[0], args[1] = c, c.clone()
            elif kind == "sin":
                args[1] = torch.zeros(rows + 1, h)
            else:
                args[0], args[1] = cos.reshape(-1), sin.reshape(-1)
            self.refused(lambda: op(*inputs, *args, interleaved, conjugate),
                         *[t for t in inputs if form.endswith("_")])
            return
        positions = torch.arange(offset, offset + tokens)
        view = [1] * (len(shape) - 1)
        view[seq_axis] = tokens
        positions = torch.broadcast_to(positions.reshape(view), shape[:-1])
        want = [self.rotated(t.to(torch.float64), positions, inv_freq, shape[:-1], h, interleaved, conjugate)
                for t in inputs]
        if table_dtype == torch.bfloat16:  # the oracle rotates by the rounded tables, row = position
            c64, s64 = cos.to(torch.float64)[positions], sin.to(torch.float64)[positions]
            want = [self.rotate_table(t.to(torch.float64), c64, -s64 if conjugate else s64, h, interleaved)
                    for t in inputs]
        if form.endswith("_"):
            op(*inputs, cos, sin, offset, seq_axis, interleaved, conjugate)
            got = inputs
        else:
            got = op(*inputs, cos, sin, offset, seq_axis, interleaved, conjugate)
            got = got if pair else (got,)
        for g, w in zip(got, want, strict=True):
            self.close(g, w, dtype, form)
        self.valid += 1

    def case_plan_rows(self):
        """plan_rows (a test hook, reachable like the rest)."""
        n = self.rng.randint(0, 4)
        sizes = [self.rng.randint(1, 4) for _ in range(n)]
        lists = [[self.rng.randint(0, 64) for _ in range(n)] for _ in range(4)]
        if self.rng.random() < 0.5:  # invalid: a stride list shorter than the sizes
            lists[self.rng.randrange(4)] = []
            if n == 0:
                sizes = [1]
            self.refused(lambda: self.ops.plan_rows(sizes, *lists))
            return
        result = self.ops.plan_rows(sizes, *lists)
        if result[0] < 0 or len(result) != 1 + 5 * result[0]:
            raise AssertionError(f"plan_rows returned {result}")
        self.valid += 1

    def case_slot_mapping(self):
        """slot_mapping (which feeds the paged writes): hostile block ids are refused, others mapped exactly."""
        torch, rng = self.torch, self.rng
        from ropekit.fused.cache import slot_mapping

        block_size = rng.choice((1, 2, 16))
        batch, blocks, seq = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 4)
        table = torch.randint(0, 64, (batch, blocks), generator=self.gen)
        hostile = rng.random() < 0.5
        if hostile:
            table[rng.randrange(batch), 0] = rng.choice((-1, -(2**62), 2**62, min(2**63 // block_size, 2**63 - 1),
                                                         2**63 - 1))
        positions = torch.randint(0, blocks * block_size, (batch, seq), generator=self.gen)
        positions[:, 0] = 0  # every row reaches its first block
        try:
            slots = slot_mapping(table, positions, block_size)
        except ValueError:
            if not hostile:
                raise AssertionError("slot_mapping refused a valid block table") from None
            self.invalid += 1
            return
        flat = positions.reshape(-1)
        rows = torch.arange(batch).repeat_interleave(seq)
        for s, b, p in zip(slots.tolist(), rows.tolist(), flat.tolist(), strict=True):
            block = int(table[b, p // block_size])
            if s < 0 or s // block_size != block or s % block_size != p % block_size:
                raise Invalid(f"slot_mapping put position {p} of sequence {b} (block {block}) at slot {s}")
        self.valid += 1

    def run(self, calls: int) -> list[str]:
        """Make ``calls`` calls; the findings, one line each."""
        cases = (self.case_apply_rotary, self.case_apply_rotary, self.case_norm, self.case_norm, self.case_cache,
                 self.case_cache, self.case_cache_scaled, self.case_cache_scaled, self.case_offset, self.case_offset,
                 self.case_plan_rows, self.case_slot_mapping)
        failures = []
        for i in range(calls):
            case = self.rng.choice(cases)
            self.ops.set_thresholds(self.rng.choice((0, 1 << 20)), -1)  # small tensors take the planned path too
            try:
                case()
            except (AssertionError, Invalid) as exc:
                failures.append(f"call {i} ({case.__name__}): {exc}")
            except Exception as exc:  # noqa: BLE001 - a valid call must not raise
                failures.append(f"call {i} ({case.__name__}): a valid call raised {type(exc).__name__}: "
                                f"{str(exc)[:300]}")
        if self.fp8_entries >= 1000 and self.fp8_exact < 0.9 * self.fp8_entries:
            failures.append(f"the FP8 brackets are too wide to test anything: {self.fp8_exact} of "
                            f"{self.fp8_entries} entries pinned to one value")
        return failures


def worker(args) -> int:
    """In the child (sanitizer runtime preloaded): load the library, fuzz, print the summary."""
    import torch

    torch.set_num_threads(1)
    torch.ops.load_library(args.worker)
    ops = getattr(torch.ops, NAMESPACE)
    fuzzer = Fuzzer(ops, args.seed)
    start = time.monotonic()
    failures = fuzzer.run(args.calls)
    for line in failures[:20]:
        print(line, file=sys.stderr)
    exact = f"{100 * fuzzer.fp8_exact / fuzzer.fp8_entries:.1f}%" if fuzzer.fp8_entries else "none"
    print(f"{args.calls} calls (seed {args.seed}): {fuzzer.valid} valid checked against the float64 reference, "
          f"{fuzzer.invalid} invalid refused, {len(failures)} findings in {time.monotonic() - start:.1f} s "
          f"(FP8 key entries {fuzzer.fp8_entries}, one-entry brackets {exact})")
    return 1 if failures else 0


def main(argv=None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1500, help="random calls to make (default 1500)")
    parser.add_argument("--seed", type=int, default=0, help="the random seed (default 0)")
    parser.add_argument("--build-dir", help="keep the sanitizer build in this directory (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the fuzzing child may run")
    parser.add_argument("--worker", metavar="LIBRARY", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return worker(args) if args.worker else parent(args)


if __name__ == "__main__":
    sys.exit(main())
