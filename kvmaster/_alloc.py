"""Offset allocator over one byte range (a shard's share of one segment)."""

from __future__ import annotations

from sortedcontainers import SortedList  # type: ignore[import-untyped]  # (ships no type hints)

#: Allocation granularity in bytes; every range starts and ends on it.
ALIGN = 64


def align_up(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class RangeAllocator:
    """Best-fit allocator of ``[base, base + size)`` with coalescing of free extents.

    Free extents are bucketed by exact length (``length -> {start: None}``), and
    the lengths that have a non-empty bucket are kept sorted.  KV blocks mostly
    share one size, so an allocation usually pops an exact fit in O(1); otherwise
    the smallest larger extent is split (O(log L) in the number of distinct free
    lengths L); only then is the never-used top of the range (the *wilderness*)
    cut, in O(1).  Freeing merges with free neighbours in O(1).  Owned by one
    shard actor; never shared.  Sizes are rounded up to :data:`ALIGN`.
    """

    __slots__ = (
        "_buckets",
        "_end",
        "_lengths",
        "_start",
        "_top",
        "_wild",
        "base",
        "size",
        "used",
    )

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.size = size - size % ALIGN
        self.used = 0
        self._buckets: dict[int, dict[int, None]] = {}
        self._lengths: SortedList = SortedList()
        self._start: dict[int, int] = {}  # start -> length of a free extent
        self._end: dict[int, int] = {}  # end -> start of a free extent
        self._top = base + self.size
        self._wild = base  # start of the free extent that reaches _top (== _top: none)
        if self.size > 0:
            self._start[base] = self.size
            self._end[self._top] = base

    @property
    def free(self) -> int:
        return self.size - self.used

    def _add(self, start: int, length: int) -> None:
        bucket = self._buckets.get(length)
        if bucket is None:
            bucket = self._buckets[length] = {}
            self._lengths.add(length)
        bucket[start] = None
        self._start[start] = length
        self._end[start + length] = start

    def _drop(self, start: int, length: int) -> None:
        bucket = self._buckets[length]
        del bucket[start]
        if not bucket:
            del self._buckets[length]
            self._lengths.remove(length)
        del self._start[start]
        del self._end[start + length]

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free range of ``nbytes`` (rounded up), or None if no extent fits."""
        need = (nbytes + ALIGN - 1) & ~(ALIGN - 1)
        bucket = self._buckets.get(need)
        if bucket is not None:
            start, _ = bucket.popitem()
            if not bucket:
                del self._buckets[need]
                self._lengths.remove(need)
            del self._start[start]
            del self._end[start + need]
            self.used += need
            return start
        lengths = self._lengths
        i = lengths.bisect_left(need) if lengths else 0
        if i < len(lengths):
            length = lengths[i]
            start = next(iter(self._buckets[length]))
            self._drop(start, length)
            self._add(start + need, length - need)
            self.used += need
            return start
        return self._cut_wild(need)

    def _cut_wild(self, length: int) -> int | None:
        """Cut ``length`` bytes (aligned) from the bottom of the never-used top of the
        range; None if it is shorter."""
        start = self._wild
        top = self._top
        if top - start < length:
            return None
        del self._start[start]
        self._wild = start + length
        if self._wild < top:
            self._start[self._wild] = top - self._wild
            self._end[top] = self._wild
        else:
            del self._end[top]
        self.used += length
        return start

    def release(self, start: int, nbytes: int) -> None:
        """Return a range obtained from :meth:`alloc` (same ``nbytes``)."""
        length = (nbytes + ALIGN - 1) & ~(ALIGN - 1)
        self.used -= length
        prev_start = self._end.get(start)
        if prev_start is not None:
            prev_len = self._start[prev_start]
            self._drop(prev_start, prev_len)
            start, length = prev_start, prev_len + length
        end = start + length
        if end == self._wild:
            # Give the range back to the wilderness.
            top = self._top
            if self._wild < top:
                del self._start[self._wild]
            self._wild = start
            self._start[start] = top - start
            self._end[top] = start
            return
        nxt_len = self._start.get(end)
        if nxt_len is not None:
            self._drop(end, nxt_len)
            length += nxt_len
        self._add(start, length)

    def alloc_run(self, nbytes: int, count: int) -> int | None:
        """Start of ``count`` consecutive ranges of ``nbytes`` (rounded up) each, when
        ``count`` calls of :meth:`alloc` would place them so, all cut in order from the
        one free extent the first call would take; None (nothing taken) otherwise:
        a free extent of exactly one range exists (alloc takes those first), or the
        extent alloc would cut is too short for all of them.  Each range is released
        on its own like any other.  One call instead of ``count``: the smallest extent
        longer than one range, split range by range, stays the smallest until it is
        shorter than a range, so alloc would keep cutting it."""
        need = (nbytes + ALIGN - 1) & ~(ALIGN - 1)
        total = need * count
        if need in self._buckets:
            return None
        lengths = self._lengths
        i = lengths.bisect_left(need) if lengths else 0
        if i < len(lengths):
            length = lengths[i]
            if length < total:
                return None
            start = next(iter(self._buckets[length]))
            self._drop(start, length)
            if length > total:
                self._add(start + total, length - total)
            self.used += total
            return start
        return self._cut_wild(total)

    def reserve_all(self, ranges: list[tuple[int, int]]) -> list[int]:
        """On an allocator with nothing allocated yet, mark each ``(start, nbytes)`` used
        (a promoted HA standby taking over the objects of a re-mounted segment); returns
        the positions in ``ranges`` refused: unaligned, outside ``[base, base + size)`` or
        overlapping one before it in start order.  O(n log n)."""
        if self.used:
            raise ValueError("reserve_all needs an allocator with nothing allocated")
        refused: list[int] = []
        self._buckets.clear()
        self._lengths.clear()
        self._start.clear()
        self._end.clear()
        pos, top = self.base, self._top
        for i in sorted(range(len(ranges)), key=ranges.__getitem__):
            start, nbytes = ranges[i]
            length = (nbytes + ALIGN - 1) & ~(ALIGN - 1)
            if start < pos or start % ALIGN or start + length > top or length <= 0:
                refused.append(i)
                continue
            if start > pos:
                self._add(pos, start - pos)
            pos = start + length
            self.used += length
        self._wild = pos
        if pos < top:
            self._start[pos] = top - pos
            self._end[top] = pos
        return refused

    def largest_free(self) -> int:
        return max(self._lengths[-1] if self._lengths else 0, self._top - self._wild)
