"""Ranged and zero-copy reads: read leases of a batch, byte ranges copied from
them, reads into parts and raw pointers (:class:`RangeReadOps`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmaster import errors as E
from kvmaster._client.dataplane import _address_of, _memmove, _raw_view
from kvmaster._client.reads import ReadOps
from kvmaster._client.records import (
    OpGen,
    ReadLeases,
    _b,
    _late_statuses,
    _Mappings,
    _monotonic,
    _unreadable,
    operation,
)
from kvmaster._integrity import checksum_parts
from kvmaster.protocol import Status
from kvmaster.transfer import TransferError


class RangeReadOps(ReadOps):
    """Reads by lease
    and range, and into the caller's parts or raw pointers."""

    def _leases(self, keys: Sequence[str]) -> OpGen:
        (names, first, offsets, further, sizes, sums), deadline = yield from self._descs(keys)
        replicas: list[list[list[Any]] | None] = []
        for pos, (f, off) in enumerate(zip(first, offsets)):
            replicas.append(None if f < 0 else [[names[f], off], *further.get(pos, ())])
        return ReadLeases(list(sizes), replicas, [min(f, 0) for f in first], deadline, sums)

    def _read_parts(self, replicas: list[list[Any]], items: Sequence[tuple[int, Any]],
                    want: int, bad: list[list[Any]]) -> None:
        """Copy a whole object across ``items`` (``(offset, dst)`` covering it in
        order) from its first readable replica whose bytes match ``want``; the replicas
        that did not are added to ``bad``.  Raises (see :func:`_unreadable`) when none
        did."""
        failed: list[Exception] = []
        dsts = [d for _, d in items]
        for name, off in replicas:
            try:
                seg = self._local(name)
                for o, d in items:
                    if seg is None:
                        self._peer(name).read_into(name, off + o, d.nbytes, d)
                    else:
                        seg.read_into(off + o, d)
            except (OSError, ValueError, E.KVMasterError) as exc:
                failed.append(exc)
                continue
            if checksum_parts(dsts) == want:
                return
            failed.append(self._corrupt(name, off, bad))
        raise _unreadable(failed)

    def _verified_parts(self, keys: Sequence[str], leases: ReadLeases, i: int,
                        items: Sequence[tuple[int, Any]], want: int,
                        corrupt: list[tuple[bytes, list[Any], int]]) -> int:
        """:meth:`_read_parts` of position ``i`` -> its result (size or status); the
        corrupt replicas it found go to ``corrupt``."""
        bad: list[list[Any]] = []
        replicas = leases.replicas[i]
        assert replicas is not None  # (called for objects found: they have replicas)
        try:
            self._read_parts(replicas, items, want, bad)
            return leases.sizes[i]
        except E.ObjectNotFound as exc:
            return int(exc.code)
        except E.ChecksumMismatch as exc:
            self.checksum_failures += 1
            return int(exc.code)
        except (OSError, ValueError, E.KVMasterError):
            return int(Status.TRANSFER_FAIL)
        finally:
            if bad:
                bkey = _b(keys[i])
                corrupt.extend((bkey, r, want) for r in bad)

    @operation
    def batch_get_leases(self, keys: Sequence[str]) -> OpGen[ReadLeases]:
        """Read leases of ``keys`` in one round -> :class:`ReadLeases` (each found key's
        size and replicas, the others' negative status), for ranged reads with
        :meth:`batch_read_ranges` until the lease ends (``ReadLeases.deadline``,
        ``time.monotonic()``; the master's ``--default-kv-lease-ttl``)."""
        return (yield from self._leases(keys))

    def _copy_ranges(self, leases: ReadLeases, positions: Sequence[int],
                     ranges: Sequence[Sequence[tuple[int, Any]]]) -> list[int]:
        """The copies of :meth:`batch_read_ranges` (no lease check)."""
        out: list[int] = []
        views = _Mappings(self._local_view)
        n_keys = len(leases.replicas)
        for i, items in zip(positions, ranges):
            replicas = leases.replicas[i] if type(i) is int and 0 <= i < n_keys else None
            if replicas is None:
                out.append(leases.status[i] if type(i) is int and 0 <= i < n_keys
                           else int(Status.INVALID_PARAMS))
                continue
            size = leases.sizes[i]
            try:
                dsts = [memoryview(b).cast("B") for _, b in items]
            except (TypeError, ValueError):
                out.append(int(Status.INVALID_PARAMS))
                continue
            if any(type(o) is not int or o < 0 or o + d.nbytes > size or d.readonly
                   for (o, _), d in zip(items, dsts)):
                out.append(int(Status.INVALID_PARAMS))
                continue
            total = 0
            try:
                view = views[replicas[0][0]] if len(replicas) == 1 else None
                base = replicas[0][1]
                for (o, _), d in zip(items, dsts):
                    n = d.nbytes
                    if view is not None:
                        d[:] = view[base + o:base + o + n]
                    else:
                        self._read_into([[name, off + o] for name, off in replicas], n, d)
                    total += n
            except E.ObjectNotFound as exc:
                out.append(int(exc.code))
                continue
            except (TransferError, OSError, ValueError, E.KVMasterError):
                out.append(int(Status.TRANSFER_FAIL))
                continue
            out.append(total)
        return out

    @operation
    def batch_read_ranges(self, leases: ReadLeases, positions: Sequence[int],
                          ranges: Sequence[Sequence[tuple[int, Any]]]) -> OpGen[list[int]]:
        """Copy byte ranges of leased objects into buffers: ``ranges[k]`` is a list of
        ``(offset, buffer)`` for the object at ``positions[k]``, each (writable)
        buffer getting the object's bytes ``[offset, offset + len)``.  Returns per
        ``k`` the bytes copied or a negative status: the key's own (not found),
        INVALID_PARAMS for a range outside the object or a bad buffer,
        LEASE_EXPIRED when the lease ended before the copy did (the bytes may be
        another object's), TRANSFER_FAIL.  Sends nothing to the master."""
        if len(positions) != len(ranges):
            raise E.InvalidParams("positions and ranges differ in length",
                                  op="batch_read_ranges")
        out = self._copy_ranges(leases, positions, ranges)
        if _monotonic() > leases.deadline:
            return [int(Status.LEASE_EXPIRED) if n >= 0 else n for n in out]
        return out
        yield  # an operation that sends nothing

    @operation
    def batch_get_into_parts(self, keys: Sequence[str], buffers: Sequence[Sequence[Any]]
                             ) -> OpGen[list[int]]:
        """Copy each object across its buffers in order (``buffers[i]``: writable
        buffer-protocol objects), once from the segment into each buffer (buffers
        past the object's end are left alone): bytes read per position (the
        object's size) or a negative status; INVALID_PARAMS where the buffers
        together are smaller than the object or one is not a writable buffer;
        CHECKSUM_MISMATCH as :meth:`batch_get_into`."""
        if len(keys) != len(buffers):
            raise E.InvalidParams("keys and buffers differ in length",
                                  op="batch_get_into_parts")
        leases = yield from self._leases(keys)
        out = list(leases.status)
        marks = self.checksum_mismatches, self.checksum_failures
        positions: list[int] = []
        ranges: list[list[tuple[int, Any]]] = []
        corrupt: list[tuple[bytes, list[Any], int]] = []
        for i, bufs in enumerate(buffers):
            if leases.replicas[i] is None:
                continue
            size = leases.sizes[i]
            items: list[tuple[int, Any]] = []
            pos = 0
            try:
                for b in bufs:
                    if pos >= size:
                        break
                    d = memoryview(b).cast("B")
                    n = min(d.nbytes, size - pos)
                    items.append((pos, d if n == d.nbytes else d[:n]))
                    pos += n
            except (TypeError, ValueError):
                pos = -1
            if pos != size:
                out[i] = int(Status.INVALID_PARAMS)
                continue
            want = None if leases.checksums is None else leases.checksums[i]
            if want is not None:  # a whole object: checked (against every replica if need be)
                if any(d.readonly for _, d in items):
                    out[i] = int(Status.INVALID_PARAMS)
                else:
                    out[i] = self._verified_parts(keys, leases, i, items, want, corrupt)
                continue
            positions.append(i)
            ranges.append(items)
        for i, r in zip(positions, self._copy_ranges(leases, positions, ranges)):
            out[i] = r
        if _monotonic() > leases.deadline:
            self._late_uncount(marks)
            return _late_statuses(out, leases.checksums)
        if corrupt:
            yield self._drops(corrupt)
        return out

    @operation
    def batch_get_into_ptrs(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                            sizes: Sequence[Sequence[int]]) -> OpGen[list[int]]:
        """:meth:`batch_get_into_parts` with each key's buffers given as host
        addresses (``ptrs[i]``) and sizes in bytes (``sizes[i]``), filled with one
        ``memmove`` each from this client's own segment (pread from a peer's).  The caller
        vouches for the addresses: memory it owns, writable for those sizes.
        CHECKSUM_MISMATCH as :meth:`batch_get_into`."""
        if len(keys) != len(ptrs) or len(keys) != len(sizes):
            raise E.InvalidParams("keys, ptrs and sizes differ in length",
                                  op="batch_get_into_ptrs")
        leases = yield from self._leases(keys)
        out = list(leases.status)
        local = _Mappings(self._local_address)
        memmove = _memmove
        sums = leases.checksums
        marks = self.checksum_mismatches, self.checksum_failures
        corrupt: list[tuple[bytes, list[Any], int]] = []
        for i, (ps, ss) in enumerate(zip(ptrs, sizes)):
            replicas = leases.replicas[i]
            if replicas is None:
                continue
            size = leases.sizes[i]
            if len(ps) != len(ss) or sum(ss) < size:
                out[i] = int(Status.INVALID_PARAMS)
                continue
            want = None if sums is None else sums[i]
            if want is not None:
                items: list[tuple[int, Any]] = []
                pos = 0
                for p, n in zip(ps, ss):
                    n = min(n, size - pos)
                    if n <= 0:
                        if pos >= size:
                            break
                        continue
                    items.append((pos, _raw_view(p, n)))
                    pos += n
                mapped = local[replicas[0][0]]
                if mapped is not None:  # the first replica here: one memmove per part
                    src = mapped[1] + replicas[0][1]
                    for o, d in items:
                        memmove(_address_of(d), src + o, d.nbytes)
                    if checksum_parts([d for _, d in items]) == want:
                        out[i] = size
                        continue
                out[i] = self._verified_parts(keys, leases, i, items, want, corrupt)
                continue
            mapped = local[replicas[0][0]]
            pos = 0
            if mapped is not None:
                src = mapped[1] + replicas[0][1]
                for p, n in zip(ps, ss):
                    if n >= size - pos:
                        memmove(p, src + pos, size - pos)
                        break
                    memmove(p, src + pos, n)
                    pos += n
                out[i] = size
                continue
            try:
                for p, n in zip(ps, ss):
                    n = min(n, size - pos)
                    if n <= 0:
                        if pos >= size:
                            break
                        continue
                    self._read_into([[name, off + pos] for name, off in replicas], n,
                                    _raw_view(p, n))
                    pos += n
            except E.ObjectNotFound as exc:
                out[i] = int(exc.code)
                continue
            except (TransferError, OSError, ValueError, E.KVMasterError):
                out[i] = int(Status.TRANSFER_FAIL)
                continue
            out[i] = size
        if _monotonic() > leases.deadline:
            self._late_uncount(marks)
            return _late_statuses(out, leases.checksums)
        if corrupt:
            yield self._drops(corrupt)
        return out

    def register_buffer(self, buffer: Any) -> None:
        """Accepted for compatibility: shared-memory reads need no registration."""
