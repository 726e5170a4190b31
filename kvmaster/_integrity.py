"""Object checksums: what a writer computes at the end of its write and a reader checks
after every whole-object read (protocol 1.4, section 24 of protocol/PROTOCOL.md).

As Mooncake's optional object checksum (kvcache-ai/Mooncake PR #3003, RFC #3140: the
client hashes the value before ``put``/``upsert``, the master keeps the checksum in the
object's metadata, full-object ``get`` paths verify it and report ``CHECKSUM_MISMATCH``,
range reads are not verified, objects stored without one are read unverified), with two
differences: the hash is xxh3_64 (the ``xxhash`` package; about twice as fast as CRC-32C
here, 15 GB/s on 4 KiB and 32-38 GB/s on 64 KiB..2 MiB values against 7-20 GB/s, see
BENCHMARKS.md "Integrity"), and it is on by default
(``ClientConfig.write_checksums`` / ``verify_checksums``).  A reader that finds a
replica's bytes wrong tries the object's next replica and asks the master to drop the
bad one (DROP_CORRUPT_REPLICAS); with no good replica left the read fails
``ChecksumMismatch`` (-801) (a batch position answers -801).

Checksums are 64-bit integers (``xxh3_64`` of the bytes with seed 0, as
``xxhash.xxh3_64_intdigest`` returns it).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

__all__ = ["OVERLAP_MIN", "READ_OVERLAP_MIN", "checksum", "checksum_later", "checksum_parts", "checksum_ptrs",
           "copy_checked", "settle"]

#: A value of at least this many bytes is hashed by a helper thread while it is written
#: (:func:`checksum_later`): xxh3 and the copies (ctypes memmove, pread, pwrite) release
#: the GIL, so the hash costs about no time beside the copy; a smaller one is hashed in
#: the calling thread (a hand-off costs more than its hash).
OVERLAP_MIN = 2 << 20
#: A read of at least this many bytes hashes each copied step while it copies the next
#: (:func:`copy_checked`); a smaller one hashes after its copy.  Measured with
#: ``bench blocks`` (BENCHMARKS.md, "Big blocks"): the steps' hand-offs cost more than
#: they save below about 16 MiB, and 64 MiB reads gain a fifth.
READ_OVERLAP_MIN = 16 << 20
#: Bytes per step of :func:`copy_checked`'s copy-then-hash pipeline.
OVERLAP_CHUNK = 1 << 20
#: Helper threads (shared by every client of the process; made again after a fork).
OVERLAP_THREADS = 2

#: xxh3_64 of one bytes-like object -> int in [0, 2^64).
checksum = xxhash.xxh3_64_intdigest
_Stream = xxhash.xxh3_64


def checksum_parts(parts: Sequence[Any]) -> int:
    """xxh3_64 of the byte buffers ``parts`` one after another (the value they form)."""
    if len(parts) == 1:
        return checksum(parts[0])
    h = _Stream()
    for p in parts:
        h.update(p)
    return h.intdigest()


def checksum_ptrs(parts: Iterable[tuple[int, int]]) -> int:
    """xxh3_64 of the memory ``(address, size)`` parts, one after another (the caller
    vouches for the addresses, as for ``batch_put_from_ptrs``)."""
    h = _Stream()
    for ptr, n in parts:
        if n > 0:
            h.update((ctypes.c_char * n).from_address(ptr))
    return h.intdigest()


_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads, and a lock the parent's other
    threads held stays held: both are made anew."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _executor() -> ThreadPoolExecutor:
    """The helper threads of this process (a forked child makes its own: the parent's
    threads are not there)."""
    global _pool, _pool_pid
    pool = _pool
    if pool is None or _pool_pid != os.getpid():
        with _pool_lock:
            if _pool is None or _pool_pid != os.getpid():
                _pool = ThreadPoolExecutor(OVERLAP_THREADS, thread_name_prefix="kvmaster-checksum")
                _pool_pid = os.getpid()
            pool = _pool
    return pool


def checksum_later(parts: Any, nbytes: int | None = None,
                   of: Callable[[Any], int] = checksum_parts) -> Callable[[], int]:
    """Start ``of(parts)``, the xxh3_64 of one value (by default byte buffers whose
    ``len`` is their size; ``of=checksum_ptrs`` for ``(address, size)`` parts, with
    ``nbytes`` their total), and return a function that gives it (waiting for it).  A
    value of :data:`OVERLAP_MIN` bytes or more is hashed by a helper thread, so that the
    caller copies it meanwhile; a smaller one at once."""
    if (sum(map(len, parts)) if nbytes is None else nbytes) < OVERLAP_MIN:
        value = of(parts)
        return lambda: value
    try:
        return _executor().submit(of, parts).result
    except RuntimeError:  # (the interpreter is shutting down: no new threads)
        value = of(parts)
        return lambda: value


def settle(pending: Iterable[Callable[[], int]]) -> None:
    """Wait for the hashes ``pending`` (from :func:`checksum_later`), their errors
    ignored: a call that gives up on a write must not return while a helper thread
    still reads the caller's memory."""
    for result in pending:
        try:
            result()
        except Exception:  # noqa: BLE001, S110 - the write failed anyway
            pass


def copy_checked(copy: Callable[[int, int], None], dst: memoryview, size: int) -> int:
    """Run ``copy(start, end)`` over ``[0, size)`` in steps of :data:`OVERLAP_CHUNK`,
    each step filling ``dst[start:end]``, and return the xxh3_64 of ``dst[:size]``: each
    step's bytes are hashed by a helper thread while the next step is copied (what a
    read checks is what it copied).  ``copy`` should release the GIL (memmove through
    ctypes, preadv).  Raises what ``copy`` raises (a hash started is waited for)."""
    h = _Stream()
    pending = None
    try:
        for start in range(0, size, OVERLAP_CHUNK):
            end = min(size, start + OVERLAP_CHUNK)
            copy(start, end)
            if pending is not None:
                pending.result()
                pending = None
            chunk = dst[start:end]
            try:
                pending = _executor().submit(h.update, chunk)
            except RuntimeError:  # (the interpreter is shutting down: hashed here)
                h.update(chunk)
        if pending is not None:
            pending.result()
            pending = None
    finally:
        if pending is not None:  # (copy raised: wait for the step that reads dst)
            pending.exception()
    return h.intdigest()
