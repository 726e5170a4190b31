"""The data plane of the client: copies between the caller's buffers and the
segments replicas live in (this process's own, another's mapped on this host, or a
remote one through the transfer service), with write fencing and checksum checks
(:class:`DataPlane`).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from kvmaster import _fence
from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.connection import Connection
from kvmaster._client.records import NoWait, OpGen, _lease_expired, _monotonic, _unreadable
from kvmaster._fence import FENCE_BLOCK, WriteFence
from kvmaster._integrity import READ_OVERLAP_MIN, copy_checked
from kvmaster._integrity import checksum as _checksum
from kvmaster._segment import RAW_COPY_MIN, Segment, raw_address
from kvmaster.protocol import Op, Status

log = logging.getLogger(__name__)


class DataPlane(Connection):
    """Mapped segments and transfer peers, and the copies of replica
    bytes: writes fenced by the client's registration (:mod:`kvmaster._fence`), reads
    checked against the object's checksum (:mod:`kvmaster._integrity`)."""

    # ----------------------------------------------------------- data plane

    def _know(self, replicas: Iterable[list[Any]]) -> OpGen:
        """Make sure every replica's segment is in the segment table (one LIST_SEGMENTS
        when one is not, which also drops the table entries and mappings of segments
        it no longer lists)."""
        info = self._seg_info
        if all(r[0] in info for r in replicas):
            return None
        (segments,) = yield [(Op.LIST_SEGMENTS.value, P.MASTER_ROUTE, [])]
        listed = set()
        for s in segments:
            entry = (s["host_id"], s["transport"], s["size"])
            if info.get(s["name"]) != entry:
                self._sized.discard(s["name"])
            info[s["name"]] = entry
            listed.add(s["name"])
        # Segments the master no longer has (their owners left, were expired or
        # died): their mappings would keep the memory of unlinked files, and a dead
        # master's file, for as long as this client lives.
        own = self._segment
        for name in [n for n in info if n not in listed and (own is None or n != own.name)]:
            del info[name]
            self._sized.discard(name)
        self._drop_mappings([n for n in self._mapped if n not in listed])
        return None

    def _local(self, name: str) -> Segment | None:
        """The mapping of a segment on this host, or None to go through the network."""
        seg = self._mapped.get(name)
        if seg is not None and (seg.owner or not self.config.force_transfer):
            return seg
        info = self._seg_info.get(name)
        if self.config.force_transfer or (info is not None and info[0] != self._host()):
            return None
        # A regular file of one link, not a symlink, at least as large as mounted: else
        # SegmentFileError (a ValueError), and the copy fails with TRANSFER_FAIL.
        seg = self._mapped[name] = Segment.attach(name, info[2] if info is not None else 0)
        return seg

    def _local_seg(self, name: str) -> Segment | None:
        """The segment on this host (this client's own, or a peer's opened for
        pread/pwrite), or None (another host, a forced network path, or an open that
        failed: the general read and write paths then say why)."""
        try:
            return self._local(name)
        except (OSError, ValueError, E.KVMasterError):
            return None

    def _local_view(self, name: str) -> Any:
        """The mapping of this client's own segment, or None (any other segment: a
        peer's is never copied through a mapping, see kvmaster/_segment.py)."""
        seg = self._local_seg(name)
        return seg.buf if seg is not None and seg.owner else None

    def _local_address(self, name: str) -> tuple[Any, int, Any] | None:
        """(view, start address, the export that keeps the mapping open while held) of
        a segment mapped on this host, or None (see :meth:`_local_view`)."""
        view = self._local_view(name)
        if view is None:
            return None
        try:
            probe = ctypes.c_char.from_buffer(view)
        except (TypeError, ValueError):
            return None
        return view, ctypes.addressof(probe), probe

    def _peer(self, name: str) -> Any:
        info = self._seg_info.get(name)
        if info is None or not info[1].startswith("tcp://"):
            raise E.KVMasterError(f"segment {name} is on another host and serves no transfers",
                                  code=Status.TRANSFER_FAIL)
        peer = self._peers.get(info[1])
        if peer is None:
            from kvmaster.transfer import TransferPeer  # noqa: PLC0415 - zmq only when needed

            endpoint, _, server_key = info[1].partition("#curve=")
            curve = None
            if self.config.curve_dir:
                if not server_key:
                    raise E.KVMasterError(f"segment {name} serves transfers without CURVE",
                                          code=Status.TRANSFER_FAIL)
                from kvmaster import auth

                pub, sec, _ = auth.client_keys(self.config.curve_dir, self.config.curve_client)
                curve = (pub, sec, server_key.encode())
            peer = self._peers[info[1]] = TransferPeer(self._zmq_data(), endpoint,
                                                       self.config.timeout_s, curve)
        if name not in self._sized:
            # At first use: a service serving less than its mount claimed (a made-up
            # size) is not written to or read from.
            served = peer.size(name)
            if served != info[2]:
                raise E.KVMasterError(
                    f"segment {name} was mounted with {info[2]} bytes but its transfer "
                    f"service {info[1].partition('#curve=')[0]} serves {served}",
                    code=Status.TRANSFER_FAIL)
            self._sized.add(name)
        return peer

    def _write(self, replicas: list[list[Any]], parts: Sequence[Any],
               fence: WriteFence | None = None, limit: float = float("inf")) -> None:
        """Copy ``parts`` (one value) into every replica, checking before each part (and
        each FENCE_BLOCK of a larger one) that the write's ``fence`` ``limit`` has not
        passed (else LeaseExpired, from ``fence``).  Every write path passes its fence;
        without one (tools driving the raw protocol) nothing is checked."""
        clock = _fence.clock  # (read before each block: see kvmaster._fence)
        for name, off in replicas:
            seg = self._local(name)
            if seg is None:
                if clock() > limit:
                    assert fence is not None  # (a finite limit comes with its fence)
                    raise fence.expired()
                self._peer(name).write(name, off, list(parts))
                continue
            # (parts normalised by _byte_values: len is the size in bytes)
            _fenced_write(seg, off, parts, fence, limit)

    def _corrupt(self, name: str, off: int, bad: list[list[Any]] | None) -> E.ChecksumMismatch:
        """A replica whose bytes failed their checksum: counted, noted in ``bad`` (to
        be dropped), and its error for :func:`_unreadable`."""
        self.checksum_mismatches += 1
        if bad is not None:
            bad.append([name, off])
        return E.ChecksumMismatch(f"replica on segment {name} at offset {off} does not match "
                                  "the object's checksum", op="get")

    def _read_into(self, replicas: list[list[Any]], size: int, dst: Any,
                   want: int | None = None, bad: list[list[Any]] | None = None) -> None:
        """Copy the object (``size`` bytes) into ``dst`` from its first readable replica
        whose bytes match the checksum ``want`` (None: any); the replicas that did not
        are added to ``bad``.  Raises (see :func:`_unreadable`) when none did."""
        if type(dst) is not memoryview:
            dst = memoryview(dst)  # (a slice of it must be a view, not a copy)
        failed: list[Exception] = []
        for name, off in replicas:
            got = None
            try:
                seg = self._local(name)
                if seg is None:
                    self._peer(name).read_into(name, off, size, dst)
                elif want is not None and size >= READ_OVERLAP_MIN:  # hashed while copied
                    got = copy_checked(_step_reader(seg, off, dst), dst, size)
                else:
                    seg.read_into(off, dst[:size])
            except (OSError, ValueError, E.KVMasterError) as exc:
                failed.append(exc)
                continue
            if want is None or (got if got is not None else _checksum(dst[:size])) == want:
                return
            failed.append(self._corrupt(name, off, bad))
        raise _unreadable(failed)

    def _read_bytes(self, replicas: list[list[Any]], size: int, want: int | None = None,
                    bad: list[list[Any]] | None = None) -> bytes:
        """The object's bytes, as :meth:`_read_into` finds them."""
        failed: list[Exception] = []
        for name, off in replicas:
            try:
                seg = self._local(name)
                data = self._peer(name).read(name, off, size) if seg is None \
                    else seg.read(off, size)
            except (OSError, ValueError, E.KVMasterError) as exc:
                failed.append(exc)
                continue
            if want is None or _checksum(data) == want:
                return data
            failed.append(self._corrupt(name, off, bad))
        raise _unreadable(failed)

    def _drops(self, corrupt: list[tuple[bytes, list[Any], int]]) -> NoWait:
        """DROP_CORRUPT_REPLICAS of ``(key, [segment, offset], checksum)`` per replica
        found corrupt, one request per shard, sent without waiting (applied before
        anything this client sends to those shards afterwards); logged once."""
        by_route: dict[bytes, tuple[list[bytes], list[list[Any]], list[int]]] = {}
        for bkey, rep, want in corrupt:
            keys, reps, sums = by_route.setdefault(self._route(bkey), ([], [], []))
            keys.append(bkey)
            reps.append(rep)
            sums.append(want)
        bkey, (name, off), _ = corrupt[0]
        log.warning("%d replica(s) of %d key(s) did not match their checksum (the first: key "
                    "%r on segment %s at offset %d); asked the master to drop them",
                    len(corrupt), len({c[0] for c in corrupt}), bkey, name, off)
        return NoWait([(Op.DROP_CORRUPT_REPLICAS.value, route, [keys, reps, sums])
                       for route, (keys, reps, sums) in by_route.items()])

    def _checked(self, bkey: bytes, want: int | None, read: Callable[..., Any],
                 deadline: float) -> OpGen:
        """``read(bad)`` of one object under a read lease that ends at ``deadline``,
        then the drops of the replicas it found corrupt (also when it raised
        ChecksumMismatch).  A read that ended after its lease stands only where its
        bytes matched the object's checksum (see :func:`_late_statuses`); else it
        raises LeaseExpired, and sends no drops."""
        bad: list[list[Any]] = []
        marks = self.checksum_mismatches, self.checksum_failures
        try:
            out = read(bad)
        except E.ChecksumMismatch:
            if _monotonic() > deadline:
                self._late_uncount(marks)
                raise _lease_expired(repr(bkey.decode(errors="replace")), "get") from None
            self.checksum_failures += 1
            assert want is not None  # (replicas are found bad only against a checksum)
            yield self._drops([(bkey, r, want) for r in bad])
            raise
        late = _monotonic() > deadline
        if late:
            self._late_uncount(marks)
            if want is None:
                raise _lease_expired(repr(bkey.decode(errors="replace")), "get")
        elif bad:
            assert want is not None  # (replicas are found bad only against a checksum)
            yield self._drops([(bkey, r, want) for r in bad])
        return out

    def _late_uncount(self, marks: tuple[int, int]) -> None:
        """Take back the checksum counts a read that ended after its lease made
        (``marks``: both counters before it): its mismatches may be reused space."""
        self.checksum_mismatches, self.checksum_failures = marks


_memmove = ctypes.memmove


def _copy_blocks(buf: Any, pos: int, part: Any, n: int, fence: WriteFence,
                 limit: float) -> None:
    """Copy ``part`` (``n`` bytes) to ``buf[pos:]`` (a writable view of a mapping) in
    FENCE_BLOCK blocks, checking ``fence``'s ``limit`` before each (LeaseExpired).  With
    an address for both (:func:`~kvmaster._segment.raw_address`) each block is a
    ``memmove`` that releases the GIL (a checksum of the value, taken by a helper
    thread meanwhile, then overlaps the copy); else a slice assignment."""
    clock = _fence.clock  # (read before each block: see kvmaster._fence)
    src = raw_address(part)
    dst = raw_address(buf) if src is not None else None
    if src is None or dst is None:
        view = memoryview(part)
        for s in range(0, n, FENCE_BLOCK):
            if clock() > limit:
                raise fence.expired()
            e = min(n, s + FENCE_BLOCK)
            buf[pos + s:pos + e] = view[s:e]
        return
    if pos < 0 or pos + n > dst[2]:
        raise ValueError(f"range {pos}+{n} is outside the segment")
    if n > src[2]:  # (the caller's buffer shrank since its size was taken)
        raise ValueError(f"value of {src[2]} bytes, {n} expected: it changed during the write")
    _memmove_blocks(dst[0] + pos, src[0], n, fence, limit)
    del src, dst  # (the exports: held until the copy is done)


def _step_reader(seg: Segment, off: int, dst: memoryview) -> Callable[[int, int], None]:
    """``copy(start, end)`` for :func:`~kvmaster._integrity.copy_checked`: the bytes of
    ``seg`` at ``off + start`` into ``dst[start:end]``."""
    def copy(start: int, end: int) -> None:
        seg.read_into(off + start, dst[start:end])
    return copy


def _fenced_write(seg: Any, pos: int, parts: Sequence[Any], fence: WriteFence | None,
                  limit: float) -> None:
    """Write ``parts`` (byte lengths) at ``pos`` of ``seg`` (a mapping of this client's
    own, written in place; a peer's, written with pwrite), checking ``fence``'s
    ``limit`` before each part and each FENCE_BLOCK of a larger one (LeaseExpired)."""
    clock = _fence.clock  # (read before each block: see kvmaster._fence)
    if seg.owner:
        buf = seg.buf
        for part in parts:
            n = len(part)
            if n >= RAW_COPY_MIN:
                _copy_blocks(buf, pos, part, n, fence, limit)  # type: ignore[arg-type]
            else:
                if clock() > limit:
                    raise fence.expired()  # type: ignore[union-attr]
                buf[pos:pos + n] = part
            pos += n
        return
    for part in parts:
        n = len(part)
        src = memoryview(part)
        for s in range(0, max(n, 1), FENCE_BLOCK):
            if clock() > limit:
                raise fence.expired()  # type: ignore[union-attr]
            seg.write(pos + s, (src[s:s + FENCE_BLOCK],))
        pos += n


def _fenced_write_each(seg: Any, items: list[tuple[int, Any]], fence: WriteFence,
                       limit: float) -> None:
    """``(offset, value)`` pairs into a peer's segment ``seg``: runs of at most
    FENCE_BLOCK bytes each with one ``write_each`` (adjacent ranges in one pwritev),
    ``fence``'s ``limit`` checked before each run (a larger value alone, in blocks)."""
    clock = _fence.clock
    run: list[tuple[int, Any]] = []
    run_bytes = 0
    for off, value in items:
        n = len(value)
        if n > FENCE_BLOCK:
            _fenced_write(seg, off, (value,), fence, limit)
            continue
        if run_bytes + n > FENCE_BLOCK:
            if clock() > limit:
                raise fence.expired()
            seg.write_each(run)
            run, run_bytes = [], 0
        run.append((off, value))
        run_bytes += n
    if run:
        if clock() > limit:
            raise fence.expired()
        seg.write_each(run)


def _memmove_blocks(dst: int, src: int, n: int, fence: WriteFence, limit: float) -> None:
    """:func:`_copy_blocks` between host addresses."""
    clock = _fence.clock  # (read before each block: see kvmaster._fence)
    for s in range(0, n, FENCE_BLOCK):
        if clock() > limit:
            raise fence.expired()
        _memmove(dst + s, src + s, min(FENCE_BLOCK, n - s))


def _raw_view(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at host address ``ptr``."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def _address_of(view: memoryview) -> int:
    """Start address of a :func:`_raw_view` (the ctypes array it views)."""
    # (view.obj is typed as a Buffer; a _raw_view's is the ctypes array it was made from)
    return ctypes.addressof(cast("ctypes.Array[ctypes.c_char]", view.obj))
