"""Read operations: ``get`` and its buffer and batch forms (:class:`ReadOps`;
Mooncake's ``Get``/``BatchGet``, real_client.cpp).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.dataplane import DataPlane
from kvmaster._client.records import (
    MAX_RANGES,
    OpGen,
    _b,
    _columns_replicas,
    _late_statuses,
    _lease_expired,
    _Mappings,
    _monotonic,
    operation,
)
from kvmaster._integrity import checksum as _checksum
from kvmaster.protocol import Op, Status


class ReadOps(DataPlane):
    """``get`` of one key and of a
    batch: replica lists with a read lease, then a checked copy."""

    # ----------------------------------------------------------------- gets

    def _desc(self, key: str) -> OpGen:
        """-> ``(size, replicas, lease deadline, checksum)``; the deadline counts from
        the send; the checksum is None when the object has none, the master is older
        than 1.4 or ``verify_checksums`` is off (then it is not asked for)."""
        bkey = _b(key)
        t0 = _monotonic()
        fields = [bkey, True] if self.config.verify_checksums else [bkey]
        (desc,) = yield [(Op.GET_REPLICA_LIST.value, self._route(bkey), fields)]
        yield from self._know(desc[2])
        return desc[0], desc[2], t0 + desc[1] / 1000.0, desc[3] if len(desc) > 3 else None

    @staticmethod
    def _check_lease(deadline: float, what: str) -> None:
        if _monotonic() > deadline:
            raise _lease_expired(what, "get")

    @operation
    def get(self, key: str) -> OpGen[bytes]:
        """The object's bytes.  Raises ObjectNotFound, LeaseExpired (the read ended after
        its lease and its bytes could not be checked against a checksum, or did not
        match one), ChecksumMismatch
        (no replica matches the object's checksum, see ``ClientConfig.verify_checksums``),
        TRANSFER_FAIL (-800: no replica readable)."""
        size, replicas, deadline, want = yield from self._desc(key)
        return (yield from self._checked(
            _b(key), want, lambda bad: self._read_bytes(replicas, size, want, bad), deadline))

    @operation
    def get_buffer(self, key: str) -> OpGen[memoryview]:
        """The object's bytes as a memoryview over a private copy.  Raises as :meth:`get`."""
        size, replicas, deadline, want = yield from self._desc(key)
        dst = bytearray(size)
        yield from self._checked(
            _b(key), want, lambda bad: self._read_into(replicas, size, dst, want, bad), deadline)
        return memoryview(dst)

    @operation
    def get_into(self, key: str, buffer: Any) -> OpGen[int]:
        """Copy the object into ``buffer`` (writable, buffer protocol); returns bytes
        read.  Raises InvalidParams if the buffer is too small, else as :meth:`get` (after
        ChecksumMismatch the buffer holds undefined bytes)."""
        size, replicas, deadline, want = yield from self._desc(key)
        dst = memoryview(buffer).cast("B")
        if dst.nbytes < size:
            raise E.InvalidParams(f"buffer of {dst.nbytes} bytes < object of {size}", op="get_into")
        yield from self._checked(
            _b(key), want, lambda bad: self._read_into(replicas, size, dst, want, bad), deadline)
        return size

    @operation
    def get_into_ranges(self, key: str, buffer: Any,
                        ranges: Sequence[tuple[int, int, int]]) -> OpGen[Any]:
        """Copy byte ranges of one object into ``buffer`` (writable, buffer protocol):
        each ``(dst_offset, src_offset, size)`` copies the object's bytes
        ``[src_offset, src_offset + size)`` to ``buffer[dst_offset:dst_offset + size]``.
        Returns the bytes copied per range, or INVALID_PARAMS (-600) at a range that
        lies outside the object or the buffer (the others are still copied); at most
        MAX_RANGES ranges.  Raises ObjectNotFound, LeaseExpired, InvalidParams.  Not
        checked against the object's checksum (a range is not the whole object)."""
        if len(ranges) > MAX_RANGES:
            raise E.InvalidParams(f"{len(ranges)} ranges > {MAX_RANGES}", op="get_into_ranges")
        size, replicas, deadline, _ = yield from self._desc(key)
        dst = memoryview(buffer).cast("B")
        out: list[int] = []
        for d, s, n in ranges:
            if min(d, s, n) < 0 or s + n > size or d + n > dst.nbytes:
                out.append(int(Status.INVALID_PARAMS))
                continue
            if n:
                self._read_into([[name, off + s] for name, off in replicas], n, dst[d:d + n])
            out.append(n)
        self._check_lease(deadline, repr(key))
        return out

    def _descs(self, keys: Sequence[str]) -> OpGen:
        """Read leases of ``keys`` -> ``(columns, lease deadline)``; ``columns`` is
        ``[segments, first, offsets, more, sizes, checksums]`` in key order (see
        :func:`kvmaster.protocol.replica_columns`; ``more`` as a dict position ->
        further replicas; ``checksums`` None when no key has one, when the master is
        older than 1.4 or ``verify_checksums`` is off, else one item per key, None for
        an object without one)."""
        t0 = _monotonic()
        w = self._welcome()
        lease_ms = w.lease_ttl_ms
        op = Op.BATCH_GET_REPLICA_LIST
        bkeys, groups = self._group(keys, op)
        if not bkeys:
            return [[], [], [], {}, [], None], t0 + lease_ms / 1000.0
        columns = w.columns
        verify = self.config.verify_checksums
        tail = [columns, True] if verify else [True] if columns else []
        shards = list(groups)
        if len(shards) == 1:
            bodies = yield [(op.value, P.route_for_shard(shards[0]), [bkeys, *tail])]
        else:
            bodies = yield [(op.value, P.route_for_shard(s), [[bkeys[i] for i in groups[s]],
                                                              *tail]) for s in shards]
        if not columns:  # a 1.0 master answers per key
            bodies = [P.replica_columns(b, True) for b in bodies]
        yield from self._know(r for b in bodies for r in _columns_replicas(b))
        n_keys = len(bkeys)
        if len(bodies) == 1:
            body = bodies[0]
            names, first, offsets, more, sizes = body[:5]
            sums = body[6] if verify and len(body) > 6 and body[6].count(None) < n_keys else None
            return [names, first, offsets, dict(more), sizes, sums], t0 + lease_ms / 1000.0
        n = len(bkeys)
        names = []
        first, offsets, sizes = [0] * n, [0] * n, [0] * n
        sums = [None] * n if verify else None
        further = {}
        for s, body in zip(shards, bodies):
            base = len(names)
            names.extend(body[0])
            where = groups[s]
            for i, f, off, size in zip(where, body[1], body[2], body[4]):
                first[i] = f + base if f >= 0 else f
                offsets[i] = off
                sizes[i] = size
            for pos, replicas in body[3]:
                further[where[pos]] = replicas
            if sums is not None and len(body) > 6:
                for i, c in zip(where, body[6]):
                    sums[i] = c
        if sums is not None and sums.count(None) == n:
            sums = None
        return [names, first, offsets, further, sizes, sums], t0 + lease_ms / 1000.0

    @operation
    def get_batch(self, keys: Sequence[str]) -> OpGen[list[bytes | None]]:
        """Bytes per position; None where the object is missing, or where no replica
        matches the object's checksum (counted in ``checksum_failures``; its corrupt
        replicas are dropped, see ``ClientConfig.verify_checksums``).  Raises
        LeaseExpired (the read ended after its lease and a position's bytes had no
        checksum to be checked against; see :func:`_late_statuses`), TRANSFER_FAIL
        (-800: a replica that cannot be read)."""
        (names, first, offsets, further, sizes, sums), deadline = yield from self._descs(keys)
        out: list[bytes | None] = []
        append = out.append
        segs = _Mappings(self._local_seg)
        corrupt: list[tuple[bytes, list[Any], int]] = []
        want = None
        marks = self.checksum_mismatches, self.checksum_failures
        for pos, (f, off, size) in enumerate(zip(first, offsets, sizes)):
            if f < 0:
                append(None)
                continue
            name = names[f]
            seg = segs[name]
            if sums is not None:
                want = sums[pos]
            if seg is not None:
                try:
                    data = seg.read(off, size)
                except (OSError, ValueError):  # closed or shrunk: the general path says why
                    pass
                else:
                    if want is None or _checksum(data) == want:
                        append(data)
                        continue
            bad: list[list[Any]] = []
            try:
                append(self._read_bytes([[name, off], *further.get(pos, ())], size, want, bad))
            except E.ObjectNotFound:  # its segments went with their owners meanwhile
                append(None)
            except E.ChecksumMismatch:
                self.checksum_failures += 1
                append(None)
            if bad:
                assert want is not None  # (replicas are found bad only against a checksum)
                bkey = _b(keys[pos])
                corrupt.extend((bkey, r, want) for r in bad)
        if _monotonic() > deadline:  # (see _late_statuses)
            mismatched = self.checksum_failures != marks[1]  # (a None that is no miss)
            self._late_uncount(marks)
            if mismatched or any(d is not None and (sums is None or sums[i] is None)
                                 for i, d in enumerate(out)):
                raise _lease_expired("a batch", "get")
            return out
        if corrupt:
            yield self._drops(corrupt)
        return out

    @operation
    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> OpGen[list[int]]:
        """Copy each object into its buffer; bytes read per position or a negative status
        (CHECKSUM_MISMATCH -801 where no replica matches the object's checksum: that
        buffer then holds undefined bytes)."""
        if len(keys) != len(buffers):
            raise E.InvalidParams("keys and buffers differ in length", op="batch_get_into")
        (names, first, offsets, further, sizes, sums), deadline = yield from self._descs(keys)
        out: list[int] = []
        marks = self.checksum_mismatches, self.checksum_failures
        corrupt: list[tuple[bytes, list[Any], int]] = []
        want = None
        for pos, (f, off, size, b) in enumerate(zip(first, offsets, sizes, buffers)):
            if f < 0:
                out.append(f)
                continue
            dst = memoryview(b).cast("B")
            if dst.nbytes < size:
                out.append(Status.INVALID_PARAMS)
                continue
            if sums is not None:
                want = sums[pos]
            bad: list[list[Any]] = []
            try:
                self._read_into([[names[f], off], *further.get(pos, ())], size, dst, want, bad)
            except E.ObjectNotFound as exc:  # its segments went with their owners meanwhile
                out.append(exc.code)
                continue
            except E.ChecksumMismatch as exc:
                self.checksum_failures += 1
                out.append(int(exc.code))
                continue
            finally:
                if bad:
                    assert want is not None  # (replicas are found bad only against a checksum)
                    bkey = _b(keys[pos])
                    corrupt.extend((bkey, r, want) for r in bad)
            out.append(size)
        if _monotonic() > deadline:
            self._late_uncount(marks)
            return _late_statuses(out, sums)
        if corrupt:
            yield self._drops(corrupt)
        return out
