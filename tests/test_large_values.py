"""Large values: copies that release the GIL and checksums taken while the bytes are
copied (kvmaster/_integrity.py ``checksum_later``/``copy_checked``,
kvmaster/_segment.py ``RAW_COPY_MIN``), still exact and still checked.

Unit tests call the helpers directly; the rest use a real master, real clients and
their real shared-memory segments.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvmaster import Client, ClientConfig
from kvmaster import errors as E
from kvmaster._integrity import (OVERLAP_CHUNK, OVERLAP_MIN, READ_OVERLAP_MIN, checksum,
                                 checksum_later, checksum_parts, checksum_ptrs, copy_checked)
from kvmaster._segment import RAW_COPY_MIN, Segment, raw_address
from kvmaster.protocol import Status

MiB = 1 << 20
MISMATCH = int(Status.CHECKSUM_MISMATCH)
#: Sizes around each threshold, and one of several pipeline steps with a short tail.
SIZES = [RAW_COPY_MIN - 1, RAW_COPY_MIN, OVERLAP_MIN - 1, OVERLAP_MIN,
         3 * OVERLAP_CHUNK + 12345, READ_OVERLAP_MIN + 2 * OVERLAP_CHUNK + 5]


def pattern(n: int, seed: int) -> bytes:
    block = bytes((seed * 131 + i * 7) & 0xFF for i in range(4099))
    return (block * (n // len(block) + 1))[:n]


# ------------------------------------------------------------------ helpers alone


@pytest.mark.parametrize("n", [0, 1, OVERLAP_CHUNK - 1, OVERLAP_CHUNK, OVERLAP_CHUNK + 1,
                               3 * OVERLAP_CHUNK + 12345])
def test_copy_checked_copies_everything_and_hashes_what_it_copied(n: int) -> None:
    src = pattern(n, 1)
    dst = memoryview(bytearray(n))
    steps: list[tuple[int, int]] = []

    def copy(a: int, b: int) -> None:
        steps.append((a, b))
        dst[a:b] = src[a:b]

    assert copy_checked(copy, dst, n) == checksum(src)
    assert bytes(dst) == src
    assert steps == [(a, min(n, a + OVERLAP_CHUNK)) for a in range(0, n, OVERLAP_CHUNK)]


def test_copy_checked_hashes_the_destination_not_the_source() -> None:
    """A step whose copy lands other bytes (a source overwritten meanwhile) gives the
    checksum of what landed, so the read's check fails."""
    n = 2 * OVERLAP_CHUNK + 5
    src = pattern(n, 2)
    dst = memoryview(bytearray(n))

    def copy(a: int, b: int) -> None:
        dst[a:b] = src[a:b]
        if a == OVERLAP_CHUNK:
            dst[a] ^= 0xFF

    assert copy_checked(copy, dst, n) != checksum(src)


def test_copy_checked_raises_the_copys_error_after_the_step_in_flight() -> None:
    n = 3 * OVERLAP_CHUNK
    dst = memoryview(bytearray(n))

    def copy(a: int, b: int) -> None:
        if a == 2 * OVERLAP_CHUNK:
            raise OSError("gone")
        dst[a:b] = b"x" * (b - a)

    with pytest.raises(OSError, match="gone"):
        copy_checked(copy, dst, n)


@pytest.mark.parametrize("n", [OVERLAP_MIN - 1, OVERLAP_MIN, 5 * MiB + 3])
def test_checksum_later_equals_the_checksum_at_once(n: int) -> None:
    parts = [pattern(n // 3, 3), bytearray(pattern(n - n // 3, 4))]
    assert checksum_later(parts)() == checksum_parts(parts) == checksum(b"".join(parts))
    raw = [ctypes.create_string_buffer(bytes(p), len(p)) for p in parts]
    ptrs = [(ctypes.addressof(b), len(p)) for b, p in zip(raw, parts)]
    assert checksum_later(ptrs, n, checksum_ptrs)() == checksum_parts(parts)


def test_the_helper_threads_work_in_a_forked_child() -> None:
    """A child forked after the parent used the helper threads makes its own (the
    parent's are not in it): its checksums come back, they do not hang."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.getcwd()!r})
        from kvmaster._integrity import checksum, checksum_later
        v = os.urandom(3 << 20)
        assert checksum_later([v])() == checksum(v)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if checksum_later([v])() == checksum(v) else 3)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "0", out.stderr


def test_raw_copies_into_and_out_of_a_segment_stay_inside_it() -> None:
    seg = Segment.create(8 * MiB)
    try:
        data = pattern(2 * RAW_COPY_MIN + 9, 5)
        seg.write(MiB, [data])
        assert seg.read(MiB, len(data)) == data
        out = bytearray(len(data))
        seg.read_into(MiB, out)
        assert out == data
        with pytest.raises(ValueError):
            seg.write(8 * MiB - RAW_COPY_MIN + 1, [data[:RAW_COPY_MIN]])
        with pytest.raises(ValueError):
            seg.read_into(8 * MiB - 10, bytearray(RAW_COPY_MIN))
        assert raw_address(memoryview(data)) is None  # a read-only view: slice copies
        assert raw_address(data) is not None and raw_address(out) is not None
    finally:
        seg.close()


def test_a_close_during_a_raw_copy_leaves_the_mapping_in_place() -> None:
    """The export a raw copy holds makes a close meanwhile leave the mapping mapped
    (the copy ends, nothing crashes); the segment then counts as closed."""
    seg = Segment.create(4 * MiB)
    base, keep = seg.raw()
    seg.close()
    ctypes.memmove(base, b"still mapped", 12)  # would fault had it been unmapped
    assert ctypes.string_at(base, 12) == b"still mapped"
    del keep
    with pytest.raises(ValueError):
        seg.read_into(0, bytearray(RAW_COPY_MIN))


# ------------------------------------------------------------------ through a master


def _values() -> list[bytes]:
    return [pattern(n, i) for i, n in enumerate(SIZES)]


def test_every_put_form_of_a_large_value_stores_its_checksum(start_master, make_client
                                                             ) -> None:
    m = start_master("--default-kv-lease-ttl", "50")  # (removed values' space comes back)
    c = make_client(m, segment_bytes=256 * MiB)
    values = _values()
    forms = {
        "put": lambda k, v: c.put(k, v),
        "put_from": lambda k, v: c.put_from(k, bytearray(v)),
        "put_parts": lambda k, v: c.put_parts(k, v[:len(v) // 2], v[len(v) // 2:]),
        "put_batch": lambda k, v: c.put_batch([k], [v]),
        "batch_put_from_parts": lambda k, v: c.batch_put_from_parts([k], [[v[:7], v[7:]]]),
    }
    keep = []
    for name, put in forms.items():
        for i, v in enumerate(values):
            key = f"{name}-{i}"
            got = put(key, v)
            assert got in (None, [0]), (key, got)
            assert c.query_key(key)["checksum"] == checksum(v), key
            assert c.get(key) == v, key
        c.batch_remove([f"{name}-{i}" for i in range(len(values))], True)
    raw = [ctypes.create_string_buffer(v, len(v)) for v in values]
    keys = [f"ptr-{i}" for i in range(len(values))]
    keep.append(raw)
    assert c.batch_put_from_ptrs(keys, [[ctypes.addressof(b)] for b in raw],
                                 [[len(v)] for v in values]) == [0] * len(values)
    for k, v in zip(keys, values):
        assert c.query_key(k)["checksum"] == checksum(v), k


@pytest.mark.parametrize("where", ["own", "peer"])
def test_large_values_read_back_exact_and_a_changed_byte_is_caught(start_master, make_client,
                                                                   where) -> None:
    """Values written into the reader's own segment (memmove) or another client's on
    this host (pread): every read form returns them exactly; a byte changed in the last
    pipeline step of one fails its check (-801) and its replica is dropped."""
    m = start_master()
    owner = make_client(m, segment_bytes=96 * MiB)
    reader = owner if where == "own" else make_client(m, segment_bytes=0)
    values = _values()
    keys = [f"{where}-{i}" for i in range(len(values))]
    assert owner.put_batch(keys, values) == [0] * len(values)
    for k, v in zip(keys, values):
        buf = bytearray(len(v))
        assert reader.get_into(k, buf) == len(v) and buf == v, k
    bufs = [bytearray(len(v)) for v in values]
    assert reader.batch_get_into(keys, bufs) == [len(v) for v in values]
    assert bufs == values
    # One byte near the end of the largest value, changed behind the master's back.
    last = len(values) - 1
    (seg_name, off), = owner.query_key(keys[last])["replicas"]
    assert seg_name == owner.segment_name
    pos = off + len(values[last]) - 3
    owner._segment.buf[pos] ^= 0x5A
    bufs = [bytearray(len(v)) for v in values]
    got = reader.batch_get_into(keys, bufs)
    assert got[:last] == [len(v) for v in values[:last]] and got[last] == MISMATCH
    assert bufs[:last] == values[:last]
    with pytest.raises(E.KVMasterError) as exc:
        reader.get_into(keys[last], bytearray(len(values[last])))
    assert exc.value.code in (MISMATCH, int(Status.OBJECT_NOT_FOUND))


def test_many_threads_share_the_helpers(start_master, make_client) -> None:
    """Eight threads of one client putting and reading 2 MiB values at once: every
    value comes back exact (the helper threads serve them all)."""
    m = start_master()
    c = make_client(m, segment_bytes=128 * MiB)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for r in range(4):
                v = pattern(2 * MiB + t, t * 10 + r)
                k = f"t{t}-{r}"
                c.put(k, v)
                buf = bytearray(len(v))
                c.get_into(k, buf)
                assert buf == v
                c.remove(k, True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors


def test_with_checksums_off_large_values_go_unhashed(start_master) -> None:
    m = start_master()
    c = Client(ClientConfig(write_checksums=False, verify_checksums=False))
    try:
        c.setup(m.addr, 32 * MiB)
        v = pattern(3 * MiB, 9)
        c.put("off", v)
        assert c.query_key("off").get("checksum") is None
        buf = bytearray(len(v))
        assert c.get_into("off", buf) == len(v) and buf == v
    finally:
        c.close()


# ------------------------------------------------------------------ the caller's memory


def test_a_failed_pointer_batch_returns_only_after_its_hashes(start_master, make_client,
                                                              monkeypatch) -> None:
    """``batch_put_from_ptrs`` that fails at its first fence check (LeaseExpired) waits
    for the hashes it started before it returns: the caller may free that memory then."""
    import kvmaster._client.batches as batches
    from kvmaster import _fence

    m = start_master()
    c = make_client(m, segment_bytes=64 * MiB)
    n, k = OVERLAP_MIN, 6
    bufs = [ctypes.create_string_buffer(pattern(n, i), n) for i in range(k)]
    running = {"started": 0, "done": 0}
    real_hash = batches.checksum_ptrs

    def slow(parts):  # a hash that takes longer than the failed call's way out
        running["started"] += 1
        time.sleep(0.05)
        try:
            return real_hash(parts)
        finally:
            running["done"] += 1

    monkeypatch.setattr(batches, "checksum_ptrs", slow)
    real_clock = _fence.clock
    monkeypatch.setattr(_fence, "clock", lambda: real_clock() + 60.0)  # as if paused 60 s
    with pytest.raises(E.LeaseExpired):
        c.batch_put_from_ptrs([f"ptr-{i}" for i in range(k)],
                              [[ctypes.addressof(b)] for b in bufs], [[n]] * k)
    assert running["started"] == k and running["done"] == k


def test_a_value_shrunk_during_its_write_is_refused_not_over_read(start_master) -> None:
    """A bytearray shrunk (by another thread) between a batch's start and its copy:
    nothing is read past its end (the process lives), and what was stored is not read
    back as the value (its checksum, of the shrunk bytes, fails the read)."""
    m = start_master()
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.getcwd()!r})
        from kvmaster import Client
        from kvmaster._fence import WriteFence
        n = 64 << 20  # (an over-read that large runs off the heap: SIGSEGV)
        c = Client(); c.setup({m.addr!r}, 4 * n)
        a, b = bytearray(b"a" * n), bytearray(b"b" * n)
        real = WriteFence.limit
        def limit(self):  # after the starts came back, before the copy
            del a[4096:]; del b[4096:]
            return real(self)
        WriteFence.limit = limit
        out = c.put_batch(["ka", "kb"], [a, b])
        WriteFence.limit = real
        from kvmaster import errors as E
        for k in ("ka", "kb"):
            try:
                c.get(k)
                print(k, "read")
            except E.KVMasterError as exc:
                print(k, int(exc.code))
        c.close()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["ka", str(MISMATCH), "kb", str(MISMATCH)], r.stdout


def test_a_batch_hashes_only_what_it_writes_and_waits_for_it(start_master, make_client
                                                             ) -> None:
    """``put_batch`` of keys that exist already copies nothing and hashes nothing: no
    hash is left running on the caller's buffers (a bytearray can be resized after)."""
    from kvmaster import _integrity

    m = start_master()
    c = make_client(m, segment_bytes=64 * MiB)
    vals = [bytearray(pattern(OVERLAP_MIN + i, i)) for i in range(6)]
    keys = [f"k{i}" for i in range(6)]
    assert c.put_batch(keys, vals) == [0] * 6
    assert c.put_batch(keys, vals) == [0] * 6  # all there already
    pool = _integrity._pool
    assert pool is None or pool._work_queue.qsize() == 0
    vals[-1].extend(b"x")  # (BufferError while a helper still held it)
