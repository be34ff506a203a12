"""One comparison of a patched model's logits with the unpatched model's (a helper, not a test).

The integration tests assert it and tests/test_mutations.py checks that it reports a broken
rotation, so the bound that the integration tests use is the one shown to detect mutations.

- float32: patched and unpatched models compute the same function with float32 tables on both
  sides; their logits (O(1) values after a few layers) differ by float32 rounding, about 1e-6,
  so :data:`FLOAT32_ATOL` = 1e-5 leaves room for that and nothing for a wrong rotation (a swapped
  pairing moves them by ~6e-3, a base 1000x too large by ~8e-2).
- bfloat16: both models round every activation to bfloat16, so they differ from each other by
  bfloat16 noise; what holds is that the patched model (float32 tables, one rounding per rotation)
  is no farther (root-mean-square) from the float32 run of the same weights than transformers' own
  bfloat16 run is, within :data:`BFLOAT16_SLACK` (20%: a correct patch measures 0.95 to 1.01).
"""

from __future__ import annotations

import torch

FLOAT32_ATOL = 1e-5
BFLOAT16_SLACK = 1.2


def logits_mismatch(out: torch.Tensor, ref: torch.Tensor, *, atol: float = FLOAT32_ATOL) -> str | None:
    """None when float ``out`` and ``ref`` (same shape) agree within ``atol`` everywhere, else what differs."""
    if out.shape != ref.shape:
        return f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}"
    error = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    return None if error <= atol else f"logits differ by up to {error:.3g} (> {atol:g})"


def assert_logits_match(out: torch.Tensor, ref: torch.Tensor, *, atol: float = FLOAT32_ATOL) -> None:
    """Fail with :func:`logits_mismatch`'s message."""
    problem = logits_mismatch(out, ref, atol=atol)
    assert problem is None, problem


def _rms(error: torch.Tensor) -> float:
    return error.double().pow(2).mean().sqrt().item() if error.numel() else 0.0


def bfloat16_mismatch(out: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> str | None:
    """None when bfloat16 ``out`` is no farther from float32 ``exact`` than bfloat16 ``ref`` is (times the slack).

    Distances are root-mean-square over all logits (rounding noise averages out, a wrong
    rotation does not); measured ratios of a correct patch are 0.95 to 1.01.
    """
    own, theirs = _rms(out.double() - exact.double()), _rms(ref.double() - exact.double())
    if own <= BFLOAT16_SLACK * theirs:
        return None
    return (f"bfloat16 logits {own:.3g} (rms) from the float32 run, transformers' own {theirs:.3g} "
            f"(slack {BFLOAT16_SLACK})")


def assert_bfloat16_close(out: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> None:
    """Fail with :func:`bfloat16_mismatch`'s message."""
    problem = bfloat16_mismatch(out, ref, exact)
    assert problem is None, problem
