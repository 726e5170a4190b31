"""kvmaster.compat.BufferPool (Mooncake 0.3.13's ``mooncake.store.BufferPool``): leases of
registered host buffers, against a real master."""

from __future__ import annotations

import ctypes
import gc
import threading
import time

import pytest

import kvmaster.compat as compat
from kvmaster.compat import (BufferLease, BufferLeaseView, BufferPool, MooncakeDistributedStore,
                             RegisteredBufferLease, RegisteredBufferLeaseView,
                             RegisteredBufferPool)
from kvmaster.compat._buffer_pool import MAX_POOL_REGIONS
from kvmaster.compat._common import host_memory

MiB = 1 << 20


@pytest.fixture
def store(make_store):
    return make_store(16 * MiB, 4 * MiB)


def test_the_family_has_mooncakes_names() -> None:
    assert RegisteredBufferPool is BufferPool and RegisteredBufferLease is BufferLease
    assert RegisteredBufferLeaseView is BufferLeaseView
    for n in ("BufferPool", "BufferLease", "BufferLeaseView", "RegisteredBufferPool",
              "RegisteredBufferLease", "RegisteredBufferLeaseView"):
        assert n in compat.__all__


def test_put_and_get_through_leased_buffers(store) -> None:
    pool = BufferPool(store, max_bytes=8 * MiB, min_size_class=4096, alignment=4096)
    keys = [f"bp-{i}" for i in range(4)]
    sizes = [1000, 4096, 70_000, 1 * MiB]
    src = [pool.acquire(n) for n in sizes]
    for i, lease in enumerate(src):
        assert lease.size == sizes[i] and lease.ptr % 4096 == 0
        assert host_memory(lease.ptr, lease.size)
        mv = lease.buffer
        assert isinstance(mv, memoryview) and mv.format == "B" and not mv.readonly
        assert mv.nbytes == sizes[i] and isinstance(mv.obj, BufferLeaseView)
        mv[:] = bytes([i + 1]) * sizes[i]
        mv.release()
    assert store.batch_put_from(keys, [x.ptr for x in src], sizes) == [0] * 4
    for x in src:
        x.release()
    with pool.acquire(2 * MiB) as dst_big:
        dst = [pool.acquire(n) for n in sizes]
        assert store.batch_get_into(keys, [x.ptr for x in dst], sizes) == sizes
        for i, x in enumerate(dst):
            assert ctypes.string_at(x.ptr, sizes[i]) == bytes([i + 1]) * sizes[i]
            x.release()
        assert store.get_into(keys[3], dst_big.ptr, dst_big.size) == sizes[3]
        view = dst_big.buffer.obj.buffer  # BufferLeaseView.buffer: another view
        assert bytes(view[:sizes[3]]) == b"\x04" * sizes[3]
        view.release()
    pool.close()


def test_exhaustion_without_blocking_and_with_a_timeout(store) -> None:
    pool = BufferPool(store, max_bytes=8 * MiB, alignment=4096, block_on_exhaustion=False)
    a = pool.acquire(6 * MiB)
    with pytest.raises(RuntimeError, match="buffer pool is exhausted"):
        pool.acquire(3 * MiB)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out waiting for buffer"):
        pool.acquire(3 * MiB, block=True, timeout=0.2)
    assert 0.15 <= time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError, match="timeout must be non-negative"):
        pool.acquire(1, timeout=-1)
    with pytest.raises(RuntimeError, match="exceeds pool capacity"):
        pool.acquire(8 * MiB + 1, block=False)
    b = pool.acquire(2 * MiB)  # what is left still serves
    a.release()
    c = pool.acquire(3 * MiB)
    b.release(), c.release()
    pool.close()


def test_a_blocked_acquire_wakes_at_a_release(store) -> None:
    pool = BufferPool(store, max_bytes=4 * MiB, alignment=4096, default_timeout=10)
    a = pool.acquire(4 * MiB)
    got: list[object] = []

    def waiter() -> None:
        got.append(pool.acquire(4 * MiB))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    assert not got
    a.release()
    t.join(5)
    assert len(got) == 1 and isinstance(got[0], BufferLease)
    got[0].release()  # type: ignore[attr-defined]
    pool.close()


def test_release_and_reuse_of_a_size_class(store) -> None:
    pool = BufferPool(store, max_bytes=8 * MiB, min_size_class=64 * 1024, alignment=4096)
    a = pool.acquire(10_000)
    ptr = a.ptr
    a.release()
    a.release()  # again: nothing
    with pytest.raises(RuntimeError, match="buffer lease is closed"):
        a.ptr
    with pytest.raises(RuntimeError, match="buffer lease is closed"):
        a.buffer
    assert a.size == 10_000
    with pool.acquire(60_000) as b:  # the same 64 KiB class: the same region
        assert b.ptr == ptr
    c = pool.acquire(10_000)
    mv = c.buffer
    with pytest.raises(RuntimeError, match="exported views exist"):
        c.release()
    del mv
    c.release()
    d = pool.acquire(1000)
    del d  # dropped unreleased: back to the pool
    gc.collect()
    pool.close()  # no lease out


def test_prewarm_maps_regions_ahead(store) -> None:
    pool = BufferPool(store, max_bytes=8 * MiB, min_size_class=MiB, alignment=4096,
                      prewarm_size=MiB, prewarm_count=3)
    assert pool._idle_count == 3
    pool.prewarm(MiB, 100)  # as many as max_bytes leaves room for
    assert pool._idle_count == 8
    leases = [pool.acquire(MiB) for _ in range(8)]
    assert pool._idle_count == 0
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(1, block=False)
    for x in leases:
        x.release()
    big = pool.acquire(6 * MiB)  # idle regions of another class are unmapped for it
    assert pool._idle_count <= 2
    big.release()
    pool.close()


def test_close_refuses_active_leases_and_then_refuses_acquire(store) -> None:
    pool = BufferPool(store, max_bytes=8 * MiB, alignment=4096)
    a = pool.acquire(MiB)
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    b = pool.acquire(MiB)  # still open
    a.release(), b.release()
    assert pool._idle_count == 2  # kept for the next 1 MiB leases
    pool.close()
    pool.close()  # again: nothing
    with pytest.raises(RuntimeError, match="buffer pool is closed"):
        pool.acquire(1)
    assert pool._idle_count == 0  # unmapped at close


def test_bounds_and_bad_arguments(store, master) -> None:
    pool = BufferPool(store, max_bytes=8 * MiB, alignment=4096, max_regions=2,
                      block_on_exhaustion=False)
    a, b = pool.acquire(1), pool.acquire(1)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(1)
    a.release(), b.release()
    pool.close()
    # max_bytes: 0 is twice the local buffer (4 MiB); below it, the local buffer
    p2 = BufferPool(store, alignment=4096, block_on_exhaustion=False)
    x = p2.acquire(8 * MiB)
    with pytest.raises(RuntimeError, match="exceeds pool capacity"):
        p2.acquire(8 * MiB + 1)
    x.release()
    p2.close()
    p3 = BufferPool(store, max_bytes=1, alignment=4096)
    with pytest.raises(RuntimeError, match="exceeds pool capacity"):
        p3.acquire(4 * MiB + 1)
    p3.close()
    assert MAX_POOL_REGIONS >= 1
    with pytest.raises(RuntimeError, match="power of two"):
        BufferPool(store, alignment=3000)
    with pytest.raises(RuntimeError, match="must be positive"):
        BufferPool(store, min_size_class=0)
    with pytest.raises(TypeError):
        BufferPool(store, max_bytes=-1)
    with pytest.raises(TypeError):
        BufferPool(store).acquire(-1)
    with pytest.raises(RuntimeError, match="not initialized"):
        BufferPool(None)
    with pytest.raises(RuntimeError, match="not initialized"):
        BufferPool(MooncakeDistributedStore())
    with pytest.raises(RuntimeError, match="store parameter"):
        BufferPool(object())
    s0 = MooncakeDistributedStore()
    assert s0.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", master.addr) == 0
    try:
        with pytest.raises(RuntimeError, match="local buffer"):
            BufferPool(s0)
    finally:
        assert s0.close() == 0


def test_default_alignment_and_zero_size(store) -> None:
    pool = BufferPool(store)
    with pool.acquire(0) as z:
        assert z.size == 0 and z.ptr % (8 * MiB) == 0 and z.buffer.nbytes == 0
    pool.close()


def test_engines_import_the_family_through_the_shim(shim, store) -> None:
    import mooncake.store as ms

    assert ms.BufferPool is BufferPool and ms.RegisteredBufferLeaseView is BufferLeaseView
    assert ms.EngramStore is compat.EngramStore
    with ms.BufferPool(store, alignment=4096).acquire(16) as lease:
        assert store.put_from("via-shim", lease.ptr, 16) == 0
