"""Offset allocator over one byte range (a shard's share of one segment)."""

from __future__ import annotations

from sortedcontainers import SortedList

#: Allocation granularity in bytes; every range starts and ends on it.
ALIGN = 64


def align_up(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class RangeAllocator:
    """Best-fit allocator of ``[base, base + size)`` with coalescing of free extents.

    Owned by one shard actor; never shared.  ``alloc`` is O(log n) in the number
    of free extents.  Sizes are rounded up to :data:`ALIGN`.
    """

    __slots__ = ("base", "size", "used", "_by_size", "_start", "_end")

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.size = size - size % ALIGN
        self.used = 0
        self._by_size: SortedList = SortedList()  # (length, start)
        self._start: dict[int, int] = {}  # start -> length
        self._end: dict[int, int] = {}  # end -> start
        if self.size > 0:
            self._add(base, self.size)

    @property
    def free(self) -> int:
        return self.size - self.used

    def _add(self, start: int, length: int) -> None:
        self._by_size.add((length, start))
        self._start[start] = length
        self._end[start + length] = start

    def _drop(self, start: int, length: int) -> None:
        self._by_size.remove((length, start))
        del self._start[start]
        del self._end[start + length]

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free range of ``nbytes`` (rounded up), or None if no extent fits."""
        need = align_up(nbytes)
        i = self._by_size.bisect_left((need, -1))
        if i == len(self._by_size):
            return None
        length, start = self._by_size[i]
        self._drop(start, length)
        if length > need:
            self._add(start + need, length - need)
        self.used += need
        return start

    def release(self, start: int, nbytes: int) -> None:
        """Return a range obtained from :meth:`alloc` (same ``nbytes``)."""
        length = align_up(nbytes)
        self.used -= length
        prev_start = self._end.get(start)
        if prev_start is not None:
            prev_len = self._start[prev_start]
            self._drop(prev_start, prev_len)
            start, length = prev_start, prev_len + length
        nxt_len = self._start.get(start + length)
        if nxt_len is not None:
            self._drop(start + length, nxt_len)
            length += nxt_len
        self._add(start, length)

    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0
