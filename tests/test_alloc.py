"""Unit tests of the offset allocator (no master)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmaster._alloc import ALIGN, RangeAllocator, align_up


def test_alloc_until_full_then_reuse() -> None:
    a = RangeAllocator(4096, 64 * 1024)
    offs = [a.alloc(4096) for _ in range(16)]
    assert None not in offs and len(set(offs)) == 16
    assert all(4096 <= o < 4096 + 64 * 1024 for o in offs)
    assert a.alloc(1) is None and a.free == 0
    a.release(offs[3], 4096)
    assert a.alloc(4096) == offs[3]


def test_coalescing_gives_back_one_extent() -> None:
    a = RangeAllocator(0, 1 << 20)
    offs = [a.alloc(1000) for _ in range(100)]
    for o in offs[::2] + offs[1::2]:
        a.release(o, 1000)
    assert a.used == 0 and a.largest_free() == 1 << 20


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 20000)), max_size=200))
def test_random_alloc_free_never_overlaps(ops: list[tuple[bool, int]]) -> None:
    a = RangeAllocator(128, 256 * 1024)
    live: dict[int, int] = {}
    for is_alloc, n in ops:
        if is_alloc or not live:
            off = a.alloc(n)
            if off is None:
                assert a.largest_free() < align_up(n)
                continue
            assert off % ALIGN == 0 and 128 <= off and off + n <= 128 + a.size
            for o, m in live.items():
                assert off + n <= o or o + m <= off, "overlapping allocation"
            live[off] = n
        else:
            off = next(iter(live))
            a.release(off, live.pop(off))
        assert a.used == sum(align_up(m) for m in live.values())
    for off, n in list(live.items()):
        a.release(off, n)
    assert a.used == 0 and a.largest_free() == a.size


def _state(a: RangeAllocator) -> tuple:
    return (a.used, a._wild, dict(a._start), dict(a._end),
            {n: set(b) for n, b in a._buckets.items()}, list(a._lengths))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12000)), max_size=120),
       st.integers(1, 9000), st.integers(2, 40))
def test_alloc_run_places_ranges_as_one_alloc_per_range(history: list[tuple[bool, int]],
                                                        nbytes: int, count: int) -> None:
    """alloc_run(n, k) takes the k ranges k calls of alloc(n) would take, one after
    another, and leaves the allocator as they would; or takes nothing and says None."""
    a, b = RangeAllocator(0, 192 * 1024), RangeAllocator(0, 192 * 1024)
    live: list[tuple[int, int]] = []
    for is_alloc, n in history:  # the same history on both
        if is_alloc or not live:
            off = a.alloc(n)
            assert b.alloc(n) == off
            if off is not None:
                live.append((off, n))
        else:
            off, n = live.pop(len(live) // 2)
            a.release(off, n)
            b.release(off, n)
    before = _state(a)
    start = a.alloc_run(nbytes, count)
    if start is None:
        assert _state(a) == before
        return
    need = align_up(nbytes)
    assert [b.alloc(nbytes) for _ in range(count)] == [start + i * need for i in range(count)]
    assert _state(a)[:4] == _state(b)[:4]
    assert {n: set(x) for n, x in a._buckets.items()} == {n: set(x) for n, x in b._buckets.items()}
    # each range is released on its own, and all of it coalesces back
    for i in range(count):
        a.release(start + i * need, nbytes)
    for off, n in live:
        a.release(off, n)
    assert a.used == 0 and a.largest_free() == a.size
