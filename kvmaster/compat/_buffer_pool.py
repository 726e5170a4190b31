"""``BufferPool``: leases of host buffers registered with a store, as Mooncake 0.3.13's
``mooncake.store.BufferPool`` (``mooncake-integration/store/buffer_pool.cpp``,
``BufferPoolNative`` / ``BufferLeaseNative`` / ``BufferLeaseViewNative``).

``pool = BufferPool(store, max_bytes=..., ...)``; ``lease = pool.acquire(n)`` gives
``lease.ptr`` (an address of at least ``n`` writable bytes, registered with ``store``
through its ``register_buffer``), ``lease.size`` (``n``) and ``lease.buffer`` (a
``memoryview`` of ``n`` unsigned bytes whose ``obj`` is a :class:`BufferLeaseView`);
``lease.release()`` or leaving ``with pool.acquire(n) as lease:`` hands it back.  All
errors are ``RuntimeError`` with Mooncake's messages (``"timed out waiting for
buffer"``, ``"buffer pool is exhausted"``, ``"buffer pool is closed"``, ...);
negative sizes are ``TypeError`` (pybind11's ``size_t`` conversion).

Mooncake serves a lease from the client's local buffer first, then from
``posix_memalign`` memory registered with ``register_buffer``; kvmaster's facade has
no allocatable local buffer, so every region is an anonymous ``mmap`` registered with
the store.  Where Mooncake frees a region at release, kvmaster keeps released regions
of a size class (powers of two from ``min_size_class`` up to ``max_size_class``) idle
for the next lease of that class, and ``prewarm`` maps them ahead (Mooncake's
``prewarm`` does nothing); idle regions count toward ``max_bytes`` and are unmapped
first when a lease needs the room.  ``max_bytes`` bounds the bytes leased (each lease
counts ``max(size, 1)``, as Mooncake's) plus those idle; ``max_regions`` bounds the
leases at once; :data:`MAX_POOL_REGIONS` bounds the regions of a pool.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import operator
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

#: The most regions (leased and idle) one pool maps at once.
MAX_POOL_REGIONS = 4096

_PAGE = mmap.PAGESIZE


def _size_t(value: Any, name: str) -> int:
    """An ``int`` >= 0, as pybind11 converts a ``size_t`` argument (TypeError otherwise)."""
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a non-negative integer, not "
                        f"{type(value).__name__}") from None
    if n < 0:
        raise TypeError(f"{name} must be a non-negative integer, not {n}")
    return n


class BufferLeaseView:
    """What a lease's ``buffer`` exports: ``memoryview(view)`` / ``view.buffer`` are
    its bytes (format ``"B"``, writable).  While one is alive its lease cannot be
    released (``RuntimeError``), as Mooncake's ``BufferLeaseViewNative``."""

    __hash__ = object.__hash__  # by identity: its lease tracks the live ones

    @property
    def buffer(self) -> memoryview:
        return memoryview(self).cast("B")  # type: ignore[arg-type]


@functools.lru_cache(maxsize=256)
def _view_type(n: int) -> Any:
    return type("BufferLeaseView", (BufferLeaseView, ctypes.c_ubyte * n), {})


@dataclass(eq=False)
class _Region:
    mm: mmap.mmap
    ptr: int
    size: int          # bytes registered at ptr
    cls: int | None    # the size class it serves; None: oversize, unmapped at release


class BufferLease:
    """A buffer leased from a :class:`BufferPool` (Mooncake's ``BufferLeaseNative``).

    ``ptr``: its address (``RuntimeError("buffer lease is closed")`` after release);
    ``size``: the bytes asked for; ``buffer``: a new ``memoryview`` of ``size`` bytes;
    ``release()``: give it back (again: nothing; ``RuntimeError`` while a view from
    ``buffer`` is alive).  A context manager; dropped unreleased, it goes back too."""

    def __init__(self, pool: BufferPool, region: _Region, size: int) -> None:
        self._pool: BufferPool | None = pool
        self._region: _Region | None = region
        self._size = size
        self._views: weakref.WeakSet[Any] = weakref.WeakSet()

    @property
    def ptr(self) -> int:
        if self._region is None:
            raise RuntimeError("buffer lease is closed")
        return self._region.ptr

    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> memoryview:
        if self._region is None:
            raise RuntimeError("buffer lease is closed")
        v = _view_type(self._size).from_address(self._region.ptr)
        v._lease = self  # the view keeps its lease (and so the mapping) alive
        self._views.add(v)
        return v.buffer

    def release(self) -> None:
        self._release(check_views=True)

    def _release(self, check_views: bool) -> None:
        if self._region is None:
            return
        if check_views and len(self._views):
            raise RuntimeError("cannot release buffer while exported views exist")
        pool, region = self._pool, self._region
        self._pool = self._region = None
        if pool is not None:
            pool._give_back(region, max(self._size, 1))

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self._release(check_views=False)
        except Exception:  # noqa: BLE001 - nothing to report to at collection
            pass


class BufferPool:
    """Leases of host buffers registered with ``store`` (Mooncake's ``BufferPool``;
    ``RegisteredBufferPool`` is the same class).

    ``store``: a set-up :class:`~kvmaster.compat.MooncakeDistributedStore` (one with a
    ``local_buffer_size``, as Mooncake requires; ``RuntimeError`` otherwise).
    ``max_bytes``: 0 for twice the store's local buffer size, else at least it.
    ``min_size_class`` / ``max_size_class`` (None: ``max_bytes``): the size classes
    of regions kept for reuse; a lease above ``max_size_class`` gets a region of its
    own.  ``alignment``: of every ``ptr`` (a power of two >= 8).
    ``block_on_exhaustion`` / ``default_timeout`` (seconds, None: wait forever): what
    ``acquire`` does by default when the pool is full.  ``max_regions``: leases at
    once (None: no bound but :data:`MAX_POOL_REGIONS`).  ``prewarm_size`` /
    ``prewarm_count``: :meth:`prewarm` at construction."""

    def __init__(self, store: Any, max_bytes: int = 0, min_size_class: int = 64 * 1024,
                 max_size_class: int | None = None, alignment: int = 8 * 1024 * 1024,
                 block_on_exhaustion: bool = True, default_timeout: float | None = None,
                 max_regions: int | None = None, prewarm_size: int | None = None,
                 prewarm_count: int = 0) -> None:
        self._lock = threading.Condition(threading.Lock())
        self._closed = True  # until constructed
        max_bytes = _size_t(max_bytes, "max_bytes")
        min_size_class = _size_t(min_size_class, "min_size_class")
        alignment = _size_t(alignment, "alignment")
        prewarm_count = _size_t(prewarm_count, "prewarm_count")
        if store is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if not (callable(getattr(store, "register_buffer", None))
                and callable(getattr(store, "unregister_buffer", None))):
            raise RuntimeError("BufferPool store parameter must be a MooncakeDistributedStore "
                               "(with register_buffer and unregister_buffer)")
        try:
            client = store.client
        except Exception:  # noqa: BLE001 - a store that was never set up, or closed
            client = None
        if client is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if min_size_class == 0 or alignment == 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment < ctypes.sizeof(ctypes.c_void_p) or alignment & (alignment - 1):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        local = int(getattr(client, "local_buffer_size", 0) or 0)
        if local <= 0:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        self._store = store
        self._max_bytes = 2 * local if max_bytes == 0 else max(max_bytes, local)
        self._min_class = min_size_class
        self._max_class = (self._max_bytes if max_size_class is None
                           else _size_t(max_size_class, "max_size_class"))
        self._alignment = alignment
        self._block = bool(block_on_exhaustion)
        self._timeout = None if default_timeout is None else float(default_timeout)
        self._max_regions = None if max_regions is None else _size_t(max_regions, "max_regions")
        self._in_use: set[_Region] = set()
        self._idle: dict[int, list[_Region]] = {}
        self._idle_count = 0
        self._idle_bytes = 0
        self._used_bytes = 0       # max(size, 1) of each lease
        self._reserved_bytes = 0   # leases being mapped
        self._reserved = 0
        self._closed = self._closing = False
        if prewarm_size is not None and prewarm_count > 0:
            self.prewarm(prewarm_size, prewarm_count)

    # ----------------------------------------------------------------- leases

    def acquire(self, size: int, block: bool | None = None,
                timeout: float | None = None) -> BufferLease:
        """A lease of ``size`` bytes.  When the pool is full: waits (``block``, None:
        the pool's ``block_on_exhaustion``) at most ``timeout`` seconds (None: the
        pool's ``default_timeout``), then ``RuntimeError("timed out waiting for
        buffer")``; not waiting: ``RuntimeError("buffer pool is exhausted")``.  A
        ``size`` above ``max_bytes``: ``RuntimeError("requested buffer size exceeds
        pool capacity")``; a negative ``timeout``: ``RuntimeError``.  (Mooncake
        ``BufferPoolNative::acquire``.)"""
        size = _size_t(size, "size")
        wait = self._block if block is None else bool(block)
        limit = self._timeout if timeout is None else float(timeout)
        if limit is not None and limit < 0:
            raise RuntimeError("timeout must be non-negative")
        charge = max(size, 1)
        if charge > self._max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        cls = self._class_of(size)
        deadline = None if limit is None else time.monotonic() + limit
        with self._lock:
            while True:
                self._raise_if_not_open()
                got = self._try_take(charge, cls)
                if got is not None:
                    break
                if not wait:
                    raise RuntimeError("buffer pool is exhausted")
                if deadline is None:
                    self._lock.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RuntimeError("timed out waiting for buffer")
                    self._lock.wait(left)
        region, evicted = got
        self._free(evicted)
        if region is None:  # room reserved: map and register outside the lock
            try:
                region = self._map(cls if cls is not None else charge, cls)
            finally:
                with self._lock:
                    self._reserved -= 1
                    self._reserved_bytes -= charge
                    self._lock.notify_all()
            with self._lock:
                if self._closed or self._closing:
                    closing = True
                else:
                    closing = False
                    self._used_bytes += charge
                    self._in_use.add(region)
            if closing:
                self._free([region])
                raise RuntimeError("buffer pool is closing")
        return BufferLease(self, region, size)

    def buffer(self, size: int, block: bool | None = None,
               timeout: float | None = None) -> BufferLease:
        """:meth:`acquire` (Mooncake's second name for it)."""
        return self.acquire(size, block, timeout)

    def prewarm(self, size: int, count: int) -> None:
        """Map and register up to ``count`` idle regions of ``size``'s class, as many
        as ``max_bytes`` and :data:`MAX_POOL_REGIONS` leave room for (Mooncake's
        ``prewarm`` does nothing; a closed pool or a size above ``max_size_class``:
        nothing here either)."""
        size, count = _size_t(size, "size"), _size_t(count, "count")
        cls = self._class_of(size)
        if cls is None or max(size, 1) > self._max_bytes:
            return
        for _ in range(min(count, MAX_POOL_REGIONS)):
            with self._lock:
                if (self._closed or self._closing or self._regions() >= MAX_POOL_REGIONS
                        or self._total() + cls > self._max_bytes):
                    return
                self._reserved += 1
                self._reserved_bytes += cls
            try:
                region = self._map(cls, cls)
            finally:
                with self._lock:
                    self._reserved -= 1
                    self._reserved_bytes -= cls
                    self._lock.notify_all()
            with self._lock:
                keep = not (self._closed or self._closing)
                if keep:
                    self._idle.setdefault(cls, []).append(region)
                    self._idle_count += 1
                    self._idle_bytes += cls
            if not keep:
                self._free([region])
                return

    def close(self) -> None:
        """Unregister and unmap the idle regions; then :meth:`acquire` raises
        ``RuntimeError("buffer pool is closed")``.  With a lease out:
        ``RuntimeError("cannot close buffer pool with active leases")`` and the pool
        stays open.  Again: nothing.  (Mooncake ``BufferPoolNative::close``.)"""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            while self._reserved:
                self._lock.wait()
            self._closing = False
            if self._in_use:
                self._lock.notify_all()
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            idle = [r for rs in self._idle.values() for r in rs]
            self._idle.clear()
            self._idle_count = self._idle_bytes = 0
            self._lock.notify_all()
        self._free(idle)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to at collection
            pass

    # --------------------------------------------------------------- internals

    def _class_of(self, size: int) -> int | None:
        """The size class of a lease of ``size`` bytes; None above ``max_size_class``."""
        if size > self._max_class:
            return None
        c = max(self._min_class, 1 << (max(size, 1) - 1).bit_length())
        return max(min(c, self._max_class, self._max_bytes), size, 1)

    def _regions(self) -> int:
        return len(self._in_use) + self._reserved + self._idle_count

    def _total(self) -> int:
        return self._used_bytes + self._reserved_bytes + self._idle_bytes

    def _raise_if_not_open(self) -> None:
        if self._closed:
            raise RuntimeError("buffer pool is closed")
        if self._closing:
            raise RuntimeError("buffer pool is closing")

    def _pop_idle(self, avoid: int | None) -> _Region:
        """Take an idle region out of the books (of a class other than ``avoid`` when
        there is one), for unmapping."""
        key = next((k for k in self._idle if k != avoid), avoid)
        rs = self._idle[key]  # type: ignore[index]
        r = rs.pop()
        if not rs:
            del self._idle[key]  # type: ignore[arg-type]
        self._idle_count -= 1
        self._idle_bytes -= key  # type: ignore[operator]
        return r

    def _try_take(self, charge: int, cls: int | None
                  ) -> tuple[_Region | None, list[_Region]] | None:
        """Under the lock: (an idle region now leased, or None with room reserved for
        a new one; idle regions evicted to make room), or None when the pool is full."""
        if self._max_regions is not None and len(self._in_use) + self._reserved >= \
                self._max_regions:
            return None
        if self._used_bytes + self._reserved_bytes + charge > self._max_bytes:
            return None
        if cls is not None and self._idle.get(cls):
            rs = self._idle[cls]
            region = rs.pop()
            if not rs:
                del self._idle[cls]
            self._idle_count -= 1
            self._idle_bytes -= cls
            self._used_bytes += charge
            self._in_use.add(region)
            return region, []
        evicted: list[_Region] = []
        while self._idle_count and (self._total() + charge > self._max_bytes
                                    or self._regions() >= MAX_POOL_REGIONS):
            evicted.append(self._pop_idle(cls))
        if self._regions() >= MAX_POOL_REGIONS:
            return None
        self._reserved += 1
        self._reserved_bytes += charge
        return None, evicted

    def _give_back(self, region: _Region, charge: int) -> None:
        """A lease's release: keep its region idle for its class, or unmap it."""
        with self._lock:
            self._in_use.discard(region)
            self._used_bytes -= charge
            evicted: list[_Region] = []
            if region.cls is not None and not (self._closed or self._closing):
                self._idle.setdefault(region.cls, []).append(region)
                self._idle_count += 1
                self._idle_bytes += region.cls
                while self._idle_count and self._total() > self._max_bytes:
                    evicted.append(self._pop_idle(region.cls))
            else:
                evicted.append(region)
            self._lock.notify_all()
        self._free(evicted)

    def _map(self, nbytes: int, cls: int | None) -> _Region:
        """An anonymous mapping of ``nbytes`` (rounded up to pages) at ``alignment``,
        registered with the store."""
        size = -(-max(nbytes, 1) // _PAGE) * _PAGE
        slack = self._alignment - _PAGE if self._alignment > _PAGE else 0
        try:
            mm = mmap.mmap(-1, size + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, OverflowError) as exc:
            raise RuntimeError(f"buffer pool could not map {size} bytes: {exc}") from None
        first = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(first)
        del first  # no export left: the mapping can be closed
        ptr = (base + self._alignment - 1) & ~(self._alignment - 1)
        try:
            rc = self._store.register_buffer(ptr, size)
        except Exception:  # noqa: BLE001 - a store's failure is a registration failure
            rc = -1
        if rc != 0:
            mm.close()
            raise RuntimeError("overflow buffer registration failed")
        return _Region(mm, ptr, size, cls)

    def _free(self, regions: list[_Region]) -> None:
        """Unregister and unmap regions no lease holds any more."""
        failed = False
        for r in regions:
            try:
                failed |= self._store.unregister_buffer(r.ptr) != 0
            except Exception:  # noqa: BLE001
                failed = True
            r.mm.close()
        if failed:
            raise RuntimeError("overflow buffer unregistration failed")


#: Mooncake 0.3.13 exports the family under these names too (the same classes).
RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView
