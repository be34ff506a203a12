"""Whether two tensors share memory: the aliasing checks of every entry point that writes a tensor.

A kernel that writes one argument while it reads another from the same bytes (``k_cache is
v_cache``, a key that is a view of its own cache, in-place q and k that are overlapping views of
one buffer) gives results that depend on the order of its memory accesses; torch refuses the
same for its own in-place ops. :func:`overlapping` is exact: two tensors overlap when some byte
of one element of the first is a byte of an element of the second.
"""

from __future__ import annotations

from torch import Tensor

_SEARCH_BUDGET = 100_000  # search steps after which two unusual layouts are taken as overlapping


class _TooHard(Exception):
    pass


def _byte_span(t: Tensor) -> tuple[int, int]:
    """``[first, last]`` byte address of ``t``'s elements (strides are never negative in torch)."""
    size = t.element_size()
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    first = t.data_ptr()
    return first, first + (reach + 1) * size - 1


def _solvable(delta: int, terms: dict[int, list[int]]) -> bool:
    """Whether ``delta = sum(c_s * s)`` for integers ``lo_s <= c_s <= hi_s`` (``terms[s] = [lo_s, hi_s]``).

    A depth-first search from the largest stride, each coefficient bounded by what the smaller
    strides can still reach; the stride 1 term (bytes within an element) ends every branch.
    """
    dims = sorted(((s, lo, hi) for s, (lo, hi) in terms.items()), reverse=True)
    rest_lo, rest_hi = [0] * (len(dims) + 1), [0] * (len(dims) + 1)
    for d in range(len(dims) - 1, -1, -1):
        s, lo, hi = dims[d]
        rest_lo[d], rest_hi[d] = rest_lo[d + 1] + lo * s, rest_hi[d + 1] + hi * s
    budget = [_SEARCH_BUDGET]

    def search(d: int, remaining: int) -> bool:
        if d == len(dims):
            return remaining == 0
        if not rest_lo[d] <= remaining <= rest_hi[d]:
            return False
        s, lo, hi = dims[d]
        first = max(lo, -((rest_hi[d + 1] - remaining) // s))  # ceil((remaining - rest_hi) / s)
        last = min(hi, (remaining - rest_lo[d + 1]) // s)
        for c in range(first, last + 1):
            budget[0] -= 1
            if budget[0] < 0:
                raise _TooHard
            if search(d + 1, remaining - c * s):
                return True
        return False

    return search(0, delta)


def overlapping(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` share a byte of their elements (exact; the same tensor overlaps itself).

    Tensors of distinct storages never overlap; in one storage, disjoint byte spans do not; the
    rest (views interleaved in one buffer, e.g. q and k sliced from a fused qkv projection) is
    decided by solving ``address_a = address_b`` over the element indices, or, for layouts too
    irregular to decide in ``_SEARCH_BUDGET`` steps, taken as overlapping.
    """
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_first, a_last = _byte_span(a)
    b_first, b_last = _byte_span(b)
    if a_last < b_first or b_last < a_first:
        return False
    a_size, b_size = a.element_size(), b.element_size()
    terms: dict[int, list[int]] = {1: [-(b_size - 1), a_size - 1]}  # the bytes within an element
    for t, size, sign in ((a, a_size, 1), (b, b_size, -1)):
        for n, s in zip(t.shape, t.stride(), strict=True):
            if n > 1 and s > 0:
                lo, hi = terms.setdefault(s * size, [0, 0])
                terms[s * size] = [lo, hi + n - 1] if sign > 0 else [lo - (n - 1), hi]
    try:
        return _solvable(b_first - a_first, terms)
    except _TooHard:
        return True


def first_shared(written: dict[str, Tensor], others: dict[str, object]) -> tuple[str, str] | None:
    """The first pair ``(written name, other name)`` whose tensors share memory, or None.

    Pairs: each written tensor with the written tensors after it and with every other tensor
    argument (None and non-tensors skipped).
    """
    names = list(written)
    for i, name in enumerate(names):
        t = written[name]
        for other in (*names[i + 1:], *others):
            u = written[other] if other in written else others[other]
            if isinstance(u, Tensor) and overlapping(t, u):
                return name, other
    return None


def check_not_shared(written: dict[str, Tensor], others: dict[str, object], action: str) -> None:
    """Raise ValueError when a tensor the call writes (``action`` says how) shares memory with another argument."""
    pair = first_shared(written, others)
    if pair is None:
        return
    name, other = pair
    t = written[name]
    u = written[other] if other in written else others[other]
    how = "are the same tensor" if t is u else "share memory (views of one buffer whose elements overlap)"
    raise ValueError(f"{name} and {other} {how}; {action} writes {name}, so {other} must not overlap it: pass "
                     f"{other}.clone() or a tensor of its own")
