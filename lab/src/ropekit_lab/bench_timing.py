"""Timing calls on a busy machine: interleaved rounds until the times are known or the time budget is spent.

Another job on a shared machine slows a call down (it takes the core, the cache, the memory bus);
it never speeds one up. So :func:`interleaved` times the calls of one case (a rotation, the floor it
is judged against, its peers) in rounds: each call once per round, in an order that turns by one
call every round, so that every call sees the machine in the same states as the others. A call
shorter than :attr:`Plan.sample_s` is repeated back to back within its turn until the turn lasts
about that long (a decode step takes microseconds; one call is mostly timer and Python).

The time of a call (:attr:`Timing.estimate`) is the lower quartile of its samples: the turns that
ran undisturbed set it, yet no single lucky turn does. Its uncertainty (:attr:`Timing.error_pct`)
is the half-width of a 95% confidence interval of that quartile, from the order statistics of the
samples (no assumption about their distribution), as a percentage of it. Unlike the spread of
the samples (:attr:`Timing.spread_pct`), which a busy machine keeps wide however long one
measures, the uncertainty shrinks as samples come in. After each round from
:attr:`Plan.min_repeats` on, a call whose uncertainty is at most :attr:`Plan.target_pct` leaves
the rounds (its time is known: the budget goes to the others); the rounds stop when no call is
left, when :attr:`Plan.budget_s` seconds of rounds are spent, or after :attr:`Plan.max_repeats`
rounds.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["MAX_BATCH", "Plan", "Timing", "interleaved", "machine_load", "quantile_interval"]

MAX_BATCH = 1000  # calls in one turn at most
TAIL = 0.025  # each tail of the 95% confidence interval


@functools.lru_cache(maxsize=4096)
def _ranks(n: int, p: float) -> tuple[int, int]:
    """1-based ranks ``(l, u)``: ``P(B < l) <= 2.5%`` and ``P(B >= u) <= 2.5%`` for ``B ~ Binomial(n, p)``.

    ``l`` is as high and ``u`` as low as that allows, within ``1..n``.
    """
    log_p, log_q = math.log(p), math.log1p(-p)
    pmf = [math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q)
           for k in range(n + 1)]
    below, low = 0.0, 1
    for k in range(1, n + 1):  # P(B < k) = P(B <= k - 1)
        below += pmf[k - 1]
        if below > TAIL:
            break
        low = k
    above, high = 0.0, n
    for k in range(n, 0, -1):  # P(B >= k)
        above += pmf[k]
        if above > TAIL:
            break
        high = k
    return low, max(low, high)


def quantile_interval(ordered: list[float], p: float) -> tuple[float, float]:
    """A distribution-free 95% confidence interval of the ``p``-quantile of sorted ``ordered`` samples.

    The number ``B`` of samples below the quantile is Binomial(n, p): the interval runs from the
    ``l``-th to the ``u``-th smallest sample, with ``P(B < l)`` and ``P(B >= u)`` each at most 2.5%
    (at the ends of the samples where too few samples leave no such rank).
    """
    low, high = _ranks(len(ordered), p)
    return ordered[low - 1], ordered[high - 1]


@dataclass(frozen=True)
class Timing:
    """Wall times of ``repeats`` samples in milliseconds: median, quartiles and minimum.

    ``low`` and ``high`` bound a 95% confidence interval of the lower quartile (``None``: not known).
    """

    median: float
    q1: float
    q3: float
    minimum: float
    repeats: int
    low: float | None = None
    high: float | None = None

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        """The timing of ``samples`` (milliseconds, at least one); quartiles by the inclusive method."""
        if not samples:
            raise ValueError("samples must hold at least one time, got none")
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else samples * 3
        low, high = quantile_interval(sorted(samples), 0.25)
        return cls(statistics.median(samples), q1, q3, min(samples), len(samples), low, high)

    @property
    def estimate(self) -> float:
        """The time of one call on this machine, undisturbed: the lower quartile of the samples."""
        return self.q1

    @property
    def spread_pct(self) -> float | None:
        """Interquartile range as a percentage of the median (``None`` under 3 repeats: no quartiles)."""
        if self.repeats < 3:
            return None
        return 100.0 * (self.q3 - self.q1) / self.median

    @property
    def error_pct(self) -> float | None:
        """Half-width of the 95% interval of :attr:`estimate` as a percentage of it (``None`` under 3 repeats)."""
        if self.repeats < 3 or self.low is None or self.high is None:
            return None
        return 100.0 * (self.high - self.low) / 2 / self.q1

    def scaled(self, factor: float) -> Timing:
        """The same measurement as the time of ``factor`` calls (the floor of a step that copies twice)."""
        low, high = (None if v is None else v * factor for v in (self.low, self.high))
        return Timing(self.median * factor, self.q1 * factor, self.q3 * factor, self.minimum * factor, self.repeats,
                      low, high)


@dataclass(frozen=True)
class Plan:
    """How long to time one case.

    At least ``min_repeats`` rounds, at most ``max_repeats``; in between, a call leaves the rounds
    once its :attr:`Timing.error_pct` is at most ``target_pct``, and the rounds stop when none is
    left or ``budget_s`` seconds of rounds are spent.
    A call is repeated within its turn until the turn lasts ``sample_s`` seconds (at most
    :data:`MAX_BATCH` calls; 0: one call per turn).
    """

    min_repeats: int
    max_repeats: int
    budget_s: float
    target_pct: float
    sample_s: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_repeats <= self.max_repeats:
            raise ValueError(f"min_repeats and max_repeats must satisfy 1 <= min_repeats <= max_repeats, got "
                             f"{self.min_repeats} and {self.max_repeats}")
        for name in ("budget_s", "target_pct", "sample_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _known(timing: Timing, target_pct: float) -> bool:
    error = timing.error_pct
    return error is not None and error <= target_pct


def interleaved(
    calls: Mapping[str, Callable[[], object]],
    plan: Plan,
    *,
    sync: Callable[[], None] = lambda: None,
    warmup: Mapping[str, int] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, Timing], float]:
    """Time ``calls`` in interleaved rounds as ``plan`` says: ``({name: Timing of one call}, seconds of rounds)``.

    Args:
        calls: ``{name: call}``; a turn is timed from before its first call to after ``sync()``
            returns (a CUDA synchronisation; nothing on the CPU), divided by its calls.
        plan: when to stop, and how long a turn lasts (see the module docstring).
        warmup: untimed turns of one call per name before the rounds (default 2, at least 1:
            the fastest of them sizes the name's turns).
        clock: seconds, monotonic (a test passes a fake one).
    """
    if not calls:
        raise ValueError("calls must name at least one call, got none")
    names = list(calls)
    batch = {}
    for name in names:
        fastest = math.inf
        for _ in range(max(1, (warmup or {}).get(name, 2))):
            begin = clock()
            calls[name]()
            sync()
            fastest = min(fastest, clock() - begin)
        batch[name] = (1 if plan.sample_s == 0 else MAX_BATCH if fastest <= 0
                       else max(1, min(MAX_BATCH, math.ceil(plan.sample_s / fastest))))
    samples: dict[str, list[float]] = {name: [] for name in names}
    start, active = clock(), names
    for done in range(1, plan.max_repeats + 1):
        turn = (done - 1) % len(active)
        for name in active[turn:] + active[:turn]:
            call, times = calls[name], batch[name]
            begin = clock()
            for _ in range(times):
                call()
            sync()
            samples[name].append((clock() - begin) * 1e3 / times)
        if done >= plan.min_repeats:
            active = [name for name in active if not _known(Timing.of(samples[name]), plan.target_pct)]
            if not active or clock() - start >= plan.budget_s:
                break
    return {name: Timing.of(s) for name, s in samples.items()}, clock() - start


def machine_load() -> tuple[float | None, int]:
    """``(1-minute load average or None where the system has none, CPUs this process may run on)``."""
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows; a system without the figure
        load = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return load, cores
