"""Writes from and reads into CUDA device memory, on the synchronous client.

A device position's bytes never pass through Python: a write is started
(``batch_put_start``), its bytes are copied by CUDA straight from the caller's device
buffers into the replicas mapped on this host (the segments page-locked with
``cudaHostRegister`` the first time), and ended (``batch_put_end``, which takes the
checksum from the segment's bytes); a read takes the leases
(``batch_get_leases``), checks the checksum on the segment's bytes, and CUDA copies
them straight into the device buffers.  Four streams, one wait per call
(:meth:`kvmaster._cuda.CudaRuntime.copy_batch`).  A replica that is not mapped here
(another host's, through the transfer service) goes through a host staging buffer:
device to host, then the ranged write or read.

Statuses are those of ``batch_put_from_ptrs`` / ``batch_get_into_ptrs``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvmaster import _cuda
from kvmaster import _fence
from kvmaster import errors as E
from kvmaster._integrity import checksum_parts, checksum_ptrs
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster._core import ReplicateConfig
    from kvmaster.client import Client

_INVALID = int(Status.INVALID_PARAMS)


def _mapped(client: Client, rt: _cuda.Runtime, name: str) -> int | None:
    """Start address of segment ``name`` when mapped here (page-locked once), else None."""
    got = client._local_address(name)
    if got is None:
        return None
    view, addr, _probe = got
    if _cuda.HOST_REGISTER:
        rt.register_host(addr, view.nbytes)
    return int(addr)


def put(client: Client, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]], config: ReplicateConfig | None) -> list[int]:
    """Write-once puts whose buffers are all device memory: 0 per position stored or
    there already, else a negative status (INVALID_PARAMS for a position with no
    bytes or unequal pointer and size lists).  A repeated key is written once, from
    its first position.  Raises the client's errors."""
    rt = _cuda.runtime()
    if rt is None:
        return [_INVALID] * len(keys)
    if len(keys) != len(ptrs) or len(keys) != len(sizes):
        raise E.InvalidParams("keys, ptrs and sizes differ in length", op="batch_put_from_ptrs")
    out = [_INVALID] * len(keys)
    chosen: dict[str, int] = {}
    for i, k in enumerate(keys):
        if len(ptrs[i]) == len(sizes[i]) and sum(sizes[i]) > 0:
            chosen.setdefault(k, i)
    keep = list(chosen.values())
    if keep:
        with client._lock:  # (as the CPU copies: close() cannot unmap the segment under them)
            got = _put(client, rt, [keys[i] for i in keep], [ptrs[i] for i in keep],
                       [sizes[i] for i in keep], config)
        for i, r in zip(keep, got):
            out[i] = r
    for i, k in enumerate(keys):  # a repeated key answers its first position's write
        j = chosen.get(k)
        if j is not None and j != i and len(ptrs[i]) == len(sizes[i]) and sum(sizes[i]) > 0:
            out[i] = out[j]
    return out


def _groups(copies: list[tuple[int, int, int]], most: int) -> list[list[tuple[int, int, int]]]:
    """``copies`` in consecutive groups of at most ``most`` bytes (one copy may be more)."""
    out: list[list[tuple[int, int, int]]] = [[]]
    n = 0
    for c in copies:
        if out[-1] and n + c[2] > most:
            out.append([])
            n = 0
        out[-1].append(c)
        n += c[2]
    return out


#: Bytes of device copies queued between two checks of the write fence.
FENCE_GROUP = 16 * _fence.FENCE_BLOCK


def _put(client: Client, rt: _cuda.Runtime, keys: Sequence[str],
         ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
         config: ReplicateConfig | None) -> list[int]:
    totals = [sum(s) for s in sizes]
    pending = client.batch_put_start(keys, totals, config)
    open_ = pending.open()
    out = [0 if st == Status.OBJECT_ALREADY_EXISTS else int(st) for st in pending.status]
    if not open_:
        return out
    try:
        copies: list[tuple[int, int, int]] = []
        staged: list[tuple[int, bytearray]] = []
        for i in open_:
            replicas = pending.replicas[i] or []
            bases = [_mapped(client, rt, name) for name, _ in replicas]
            if replicas and all(b is not None for b in bases):
                for base, (_, off) in zip(bases, replicas):
                    dst = int(base) + off  # type: ignore[arg-type]
                    for p, n in zip(ptrs[i], sizes[i]):
                        copies.append((dst, p, n))
                        dst += n
            else:  # a replica elsewhere: device -> host, then the ranged write
                buf = bytearray(totals[i])
                host = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
                for p, n in zip(ptrs[i], sizes[i]):
                    copies.append((host, p, n))
                    host += n
                staged.append((i, buf))
        fence = pending.fence
        limit = fence.limit() if fence is not None else float("inf")
        for group in _groups(copies, FENCE_GROUP):  # (checked before each group, as
            if _fence.clock() > limit:              #  the CPU loops check each block)
                raise fence.expired()  # type: ignore[union-attr]
            rt.copy_batch(group)
        if _fence.clock() > limit:  # (the writes outlived their fence: see kvmaster._fence)
            raise E.LeaseExpired("device writes outlived their fence", op="batch_put_from_ptrs")
        if staged:
            got = client.batch_write_ranges(pending, [i for i, _ in staged],
                                            [[(0, memoryview(b))] for _, b in staged])
            failed = [i for (i, _), n in zip(staged, got) if n < 0]
            for (i, _), n in zip(staged, got):
                if n < 0:
                    out[i] = n
            if failed:
                client.batch_put_revoke(pending, failed)
                open_ = [i for i in open_ if i not in set(failed)]
        for i, st in zip(open_, client.batch_put_end(pending, open_)):
            out[i] = st
    except BaseException:  # nothing started is left open (CudaError, fence, any other)
        if pending.open():
            client.batch_put_revoke(pending, pending.open())
        raise
    return out


def _staged(client: Client, leases: Any, key: str, i: int, size: int,
            want: int | None) -> tuple[int, bytearray]:
    """Position ``i`` read into a host buffer: from its replicas through the ranged
    read, and checked (``want``); a mismatch is read again with every replica tried
    (``batch_get_into_parts``: corrupt replicas reported, CHECKSUM_MISMATCH if none is
    good)."""
    buf = bytearray(size)
    got = client.batch_read_ranges(leases, [i], [[(0, memoryview(buf))]])[0]
    if got >= 0 and want is not None and checksum_parts([buf]) != want:
        got = client.batch_get_into_parts([key], [[buf]])[0]
        if got >= 0 and got != size:
            got = int(Status.TRANSFER_FAIL)
    return got, buf


def get(client: Client, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]]) -> list[int]:
    """Reads into device buffers: the object's size per position, or a negative
    status (INVALID_PARAMS when the buffers are smaller than the object,
    CHECKSUM_MISMATCH, LEASE_EXPIRED when the copies outlived the read lease)."""
    rt = _cuda.runtime()
    if rt is None:
        return [_INVALID] * len(keys)
    if len(keys) != len(ptrs) or len(keys) != len(sizes):
        raise E.InvalidParams("keys, ptrs and sizes differ in length", op="batch_get_into_ptrs")
    with client._lock:  # (as the CPU copies: close() cannot unmap the segment under them)
        return _get(client, rt, keys, ptrs, sizes)


def _get(client: Client, rt: _cuda.Runtime, keys: Sequence[str],
         ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
    leases = client.batch_get_leases(keys)
    out = list(leases.status)
    verify = client.config.verify_checksums and leases.checksums is not None
    copies: list[tuple[int, int, int]] = []
    staged: list[tuple[int, bytearray]] = []
    for i, replicas in enumerate(leases.replicas):
        if replicas is None:
            continue
        size = leases.sizes[i]
        if len(ptrs[i]) != len(sizes[i]) or sum(sizes[i]) < size:
            out[i] = _INVALID
            continue
        want = leases.checksums[i] if verify and leases.checksums is not None else None
        name, off = replicas[0]
        base = _mapped(client, rt, name)
        src = -1
        if base is not None:
            src = base + off
            if want is not None and checksum_ptrs([(src, size)]) != want:
                src = -1  # (corrupt here: every replica tried through host staging)
        if src < 0:
            got, buf = _staged(client, leases, keys[i], i, size, want)
            if got < 0:
                out[i] = got
                continue
            src = ctypes.addressof((ctypes.c_char * size).from_buffer(buf))
            staged.append((i, buf))
        pos = 0
        for p, n in zip(ptrs[i], sizes[i]):
            if pos >= size:
                break
            n = min(n, size - pos)
            if n > 0:
                copies.append((p, src + pos, n))
                pos += n
        out[i] = size
    rt.copy_batch(copies)
    del staged  # (kept alive through the copies)
    if _fence.clock() > leases.deadline:
        return [int(Status.LEASE_EXPIRED) if n >= 0 else n for n in out]
    return out


def split(all_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]],
          bad: set[int]) -> tuple[set[int], dict[int, str]]:
    """Of the positions ``bad`` whose buffers are not host memory: those on the
    device, and the refused ones with their reasons (:func:`kvmaster._cuda.classify`)."""
    return _cuda.classify(sorted(bad), all_ptrs, all_sizes)


def merge(n: int, parts: Sequence[tuple[Sequence[int], Sequence[Any]]]) -> list[int]:
    """One result list of ``n`` positions from ``(positions, results)`` parts."""
    out = [_INVALID] * n
    for positions, results in parts:
        for i, r in zip(positions, results):
            out[i] = int(r)
    return out
