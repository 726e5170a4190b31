"""Batch writes split in steps (``batch_put_start``, ``batch_write_ranges``,
``batch_put_end``, ``batch_put_revoke``) and gathered from parts or raw pointers
(:class:`SplitWriteOps`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvmaster import _fence
from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.dataplane import _copy_blocks, _memmove, _memmove_blocks, _raw_view
from kvmaster._client.records import (
    _LOST_WRITE,
    _TAGGED,
    NoWait,
    OpGen,
    PendingPuts,
    ReplicateConfig,
    Tolerant,
    _at,
    _b,
    _byte_values,
    _group_ids_wire,
    _Mappings,
    _monotonic,
    _write_failure,
    operation,
    unanswered,
)
from kvmaster._client.writes import WriteOps
from kvmaster._fence import FENCE_BLOCK, WriteFence
from kvmaster._integrity import (OVERLAP_MIN, checksum_later, checksum_parts, checksum_ptrs,
                                 settle)
from kvmaster._integrity import checksum as _checksum
from kvmaster._segment import RAW_COPY_MIN
from kvmaster.protocol import Op, Status
from kvmaster.transfer import TransferError


class SplitWriteOps(WriteOps):
    """Batch writes whose copy the caller does, or whose bytes come
    from several parts or raw pointers."""

    # ------------------------- gathered and split batch writes; ranged reads

    def _revoke_fan(self, bkeys: list[bytes], write_id: int,
                    which: dict[int, list[int]]) -> NoWait:
        """BATCH_PUT_REVOKE of the positions ``which`` (shard -> positions) of a batch
        write, sent without waiting (see :meth:`_put`)."""
        return NoWait(self._fan(Op.BATCH_PUT_REVOKE, {
            s: [_at(bkeys, idx), write_id] for s, idx in which.items() if idx}))

    def _start_batch(self, keys: Sequence[str], sizes: Sequence[int],
                     config: ReplicateConfig | None, op: str) -> OpGen:
        """BATCH_PUT_START of distinct ``keys``, ``sizes`` bytes each -> PendingPuts."""
        if len(keys) != len(sizes):
            raise E.InvalidParams("keys and sizes differ in length", op=op)
        if not all(type(s) is int and s > 0 for s in sizes):
            bad = [i for i, s in enumerate(sizes) if type(s) is not int or s <= 0]
            raise E.InvalidParams(f"sizes must be positive ints (positions {bad[:8]})", op=op)
        op_start = Op.BATCH_PUT_START
        tags = config.kv_sessions if config is not None else None
        stags, as_kv = self._tag_plan(config, len(keys), op, tags)
        if as_kv is not None:
            tags = as_kv
        gids = None if tags else _group_ids_wire(config, len(keys), op)
        bkeys, groups = self._group(keys, None if tags or gids or stags else op_start)
        if len(set(bkeys)) < len(bkeys):
            raise E.InvalidParams("a key is given more than once", op=op)
        pending = PendingPuts(bkeys, list(sizes), next(self._write_ids), self._master_instance)
        if not bkeys:
            return pending
        cfg = config.to_wire() if config is not None else None
        btags: list[list[bytes]] | None = None
        if tags:
            if len(tags) != len(keys):
                raise E.InvalidParams(f"kv_sessions has {len(tags)} lists for {len(keys)} keys",
                                      op=op)
            btags = [[_b(t) for t in ts] for ts in tags]
            op_start = _TAGGED[op_start]
        write_id = pending.write_id
        columns = self._welcome().columns
        tail = [write_id, True] if columns else [write_id]
        if (gids is not None or stags is not None) and not columns:
            tail.append(False)
        shards = list(groups)
        sent_at = _monotonic()
        try:
            starts = yield Tolerant(
                (op_start.value, P.route_for_shard(s),
                 [_at(bkeys, groups[s]), _at(pending.sizes, groups[s]), cfg,
                  *([_at(btags, groups[s])] if btags is not None else []), *tail,
                  *([_at(gids, groups[s])] if gids is not None else
                    [None] if stags is not None else []),
                  *([_at(stags, groups[s])] if stags is not None else [])])
                for s in shards)
        except GeneratorExit:
            raise
        except BaseException as exc:
            lost = unanswered(exc, len(shards))
            if lost:  # those starts may still be applied (their replies were lost)
                yield self._revoke_fan(bkeys, write_id, {shards[j]: groups[shards[j]]
                                                         for j in lost})
            raise
        pending.started_on = self._master_instance
        pending.fence = WriteFence(self, sent_at, op)
        if not columns:  # a 1.0 master answers per key
            starts = [P.replica_columns(b, False) if type(b) is list else b for b in starts]
        failed: E.RequestError | None = None
        for s, body in zip(shards, starts):
            idx = groups[s]
            for i in idx:
                pending.shard[i] = s
            if isinstance(body, E.RequestError):
                failed = failed or body
                for i in idx:
                    pending.status[i] = body.code
                continue
            names, first, offsets, more = body[:4]
            further = dict(more) if more else {}
            for pos, (i, f, off) in enumerate(zip(idx, first, offsets)):
                if f < 0:
                    pending.status[i] = f
                else:
                    pending.replicas[i] = [[names[f], off], *further.get(pos, ())]
        try:
            yield from self._know(r for rs in pending.replicas if rs for r in rs)
            if failed is not None and failed.code in (Status.INVALID_PARAMS, Status.UNSUPPORTED):
                raise failed  # a malformed request is the caller's bug
        except GeneratorExit:
            raise
        except BaseException:
            yield self._revoke_pending(pending, pending.open())
            raise
        return pending

    def _revoke_pending(self, pending: PendingPuts, positions: Iterable[int]) -> NoWait:
        which: dict[int, list[int]] = {}
        for i in positions:
            which.setdefault(pending.shard[i], []).append(i)
            pending.replicas[i] = None
            pending.status[i] = Status.INVALID_PARAMS  # no longer writable
        return self._revoke_fan(pending.bkeys, pending.write_id, which)

    def _end_pending(self, pending: PendingPuts, positions: list[int],
                     sums: dict[int, int | None] | None = None) -> OpGen:
        """BATCH_PUT_END of started positions -> {position: status}; ``sums``: the
        checksum to send per position (None: none for any)."""
        which: dict[int, list[int]] = {}
        for i in positions:
            which.setdefault(pending.shard[i], []).append(i)
        shards = list(which)
        try:
            done = yield self._fan(Op.BATCH_PUT_END, {
                s: [_at(pending.bkeys, which[s]), pending.write_id,
                    *([[sums.get(i) for i in which[s]]] if sums else [])] for s in shards})
        except GeneratorExit:
            raise
        except BaseException as exc:
            lost = unanswered(exc, len(shards))
            if lost:
                yield self._revoke_pending(pending, [i for j in lost for i in which[shards[j]]])
            raise
        if self._master_instance != pending.started_on and any(
                r in _LOST_WRITE for body in done for r in body):
            raise self._write_lost(Op.BATCH_PUT_START)
        out: dict[int, int] = {}
        for s, body in zip(shards, done):
            for i, r in zip(which[s], body):
                out[i] = int(r)
                pending.replicas[i] = None
                pending.status[i] = int(r) if r < 0 else Status.INVALID_PARAMS
        return out

    @operation
    def batch_put_start(self, keys: Sequence[str], sizes: Sequence[int],
                        config: ReplicateConfig | None = None) -> OpGen[PendingPuts]:
        """Start write-once writes of ``keys`` (distinct), ``sizes`` bytes each, whose
        bytes come later: -> :class:`PendingPuts` (its ``status``: 0 where a write was
        started, else the key's negative status, OBJECT_ALREADY_EXISTS for a key stored
        or being written already).  Copy the bytes with :meth:`batch_write_ranges`,
        then :meth:`batch_put_end` or :meth:`batch_put_revoke` them; a write neither
        ended nor revoked is dropped by the master after its
        ``--put-start-discard-timeout``, and readers see nothing before its end.
        Raises InvalidParams (lengths, sizes, a repeated key, a batch over max_batch)."""
        return (yield from self._start_batch(keys, sizes, config, "batch_put_start"))

    @operation
    def batch_write_ranges(self, pending: PendingPuts, positions: Sequence[int],
                           ranges: Sequence[Sequence[tuple[int, Any]]]) -> OpGen[list[int]]:
        """Copy byte ranges into started writes: ``ranges[k]`` is a list of
        ``(offset, buffer)`` for the write at ``positions[k]``, each buffer's bytes
        going to ``[offset, offset + len)`` of its value.  Returns per ``k`` the
        bytes copied or a negative status: INVALID_PARAMS for a position not started
        (or already ended or revoked) or a range outside the value, TRANSFER_FAIL
        for a copy that failed (nothing is revoked: end or revoke decides).  Sends
        nothing to the master, except when the writes outlived their fence (the master
        may have dropped them, or expired this client and freed their space:
        :mod:`kvmaster._fence`): then nothing more is copied, every write of
        ``pending`` still open is revoked, and LeaseExpired is raised."""
        if len(positions) != len(ranges):
            raise E.InvalidParams("positions and ranges differ in length",
                                  op="batch_write_ranges")
        lost = self._master_instance != pending.started_on
        fence = pending.fence
        try:
            limit = 0.0
            if pending.open():
                assert fence is not None  # (set once the writes are started)
                limit = fence.limit()
        except E.LeaseExpired:
            if not lost:
                yield self._revoke_pending(pending, pending.open())
                raise
            limit = 0.0  # (the master changed: said below)
        out: list[int] = []
        for i, items in zip(positions, ranges):
            replicas = pending.replicas[i] if 0 <= i < len(pending.replicas) else None
            if replicas is None:
                out.append(int(Status.INVALID_PARAMS))
                continue
            if lost:
                raise self._write_lost(Op.BATCH_PUT_START)
            size = pending.sizes[i]
            try:
                parts = _byte_values([b for _, b in items], "batch_write_ranges")
            except E.InvalidParams:
                out.append(int(Status.INVALID_PARAMS))
                continue
            if any(type(o) is not int or o < 0 or o + len(b) > size
                   for (o, _), b in zip(items, parts)):
                out.append(int(Status.INVALID_PARAMS))
                continue
            total = 0
            try:
                for (o, _), b in zip(items, parts):
                    self._write([[name, off + o] for name, off in replicas], (b,), fence,
                                limit)
                    total += len(b)
            except E.LeaseExpired:
                yield self._revoke_pending(pending, pending.open())
                raise
            except (TransferError, OSError, ValueError, E.KVMasterError):
                out.append(int(Status.TRANSFER_FAIL))
                continue
            out.append(total)
        return out

    def _segment_sums(self, pending: PendingPuts, positions: list[int]) -> dict[int, int | None]:
        """Checksums of split puts' values as their first replicas hold them now (read
        back from the segment: the ranged writes came in any order), None for a write
        whose first replica is not on this host or cannot be read (stored unverified)."""
        out: dict[int, int | None] = {}
        segs = _Mappings(self._local_seg)
        for i in positions:
            replicas = pending.replicas[i]
            assert replicas is not None  # (positions of writes still open)
            name, off = replicas[0]
            seg = segs[name]
            try:
                out[i] = None if seg is None else _checksum(seg.read(off, pending.sizes[i]))
            except (OSError, ValueError):
                out[i] = None
        return out

    @operation
    def batch_put_end(self, pending: PendingPuts, positions: Sequence[int]) -> OpGen[list[int]]:
        """End started writes (their bytes become readable): one status per position,
        0 when stored; INVALID_PARAMS for a position not started, ended or revoked.
        A write whose end got no answer is revoked and its error raised.  With
        ``write_checksums`` each value's checksum is taken from its first replica's
        bytes now (on this host; a replica elsewhere: none), so it certifies what the
        segment holds at the end, not what the ranged writes meant to copy."""
        out = [int(Status.INVALID_PARAMS)] * len(positions)
        todo = sorted({i for i in positions
                       if 0 <= i < len(pending.replicas) and pending.replicas[i] is not None})
        if todo:
            sums = self._segment_sums(pending, todo) if self.config.write_checksums else None
            done = yield from self._end_pending(pending, todo, sums)
            out = [done.get(i, out[k]) if 0 <= i < len(pending.replicas) else out[k]
                   for k, i in enumerate(positions)]
        return out

    @operation
    def batch_put_revoke(self, pending: PendingPuts, positions: Sequence[int]) -> OpGen[list[int]]:
        """Drop started writes (nothing is stored; sent without waiting, applied
        before anything this client sends to the same shards afterwards): 0 per
        position revoked, INVALID_PARAMS for one not started, ended or revoked."""
        live = [0 <= i < len(pending.replicas) and pending.replicas[i] is not None
                for i in positions]
        todo = sorted({i for i, ok in zip(positions, live) if ok})
        if todo:
            yield self._revoke_pending(pending, todo)
        return [0 if ok else int(Status.INVALID_PARAMS) for ok in live]

    @operation
    def batch_put_from_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]],
                             config: ReplicateConfig | None = None) -> OpGen[list[int]]:
        """:meth:`put_batch` where each value is given as consecutive parts
        (``parts[i]``: buffer-protocol objects), copied once from the parts into the
        segment (no join).  One status per position: 0 stored (or there already),
        INVALID_PARAMS for a position whose parts are empty or not contiguous bytes,
        else the key's negative status.  A key given more than once is written once,
        from its first position (as :meth:`put_batch`)."""
        op = "batch_put_from_parts"
        if len(keys) != len(parts):
            raise E.InvalidParams("keys and parts differ in length", op=op)
        values: list[Any] = []
        for ps in parts:
            try:
                values.append(_byte_values(ps, op))
            except E.InvalidParams:
                values.append(None)
        return (yield from self._put_gathered(op, keys, values, config, False))

    @operation
    def batch_put_from_ptrs(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                            sizes: Sequence[Sequence[int]],
                            config: ReplicateConfig | None = None) -> OpGen[list[int]]:
        """:meth:`batch_put_from_parts` with each value's parts given as host addresses
        (``ptrs[i]``) and sizes in bytes (``sizes[i]``), read with one ``memmove`` per
        part into a segment mapped here (no Python object per part).  The caller
        vouches for the addresses: memory it owns, readable for those sizes."""
        op = "batch_put_from_ptrs"
        if len(keys) != len(ptrs) or len(keys) != len(sizes):
            raise E.InvalidParams("keys, ptrs and sizes differ in length", op=op)
        values = [list(zip(p, s)) if len(p) == len(s) else None for p, s in zip(ptrs, sizes)]
        return (yield from self._put_gathered(op, keys, values, config, True))

    def _put_gathered(self, op: str, keys: Sequence[str], values: list[Any],
                      config: ReplicateConfig | None, raw: bool) -> OpGen:
        """The writes of :meth:`batch_put_from_parts` (``raw`` False: ``values[i]`` a
        list of byte buffers) and :meth:`batch_put_from_ptrs` (``raw``: a list of
        ``(address, size)``); None for a position refused as INVALID_PARAMS."""
        out = [0] * len(keys)
        chosen: dict[Any, int] = {}
        totals: list[int] = []
        for i, (k, v) in enumerate(zip(keys, values)):
            n = -1 if v is None else sum(s for _, s in v) if raw else sum(map(len, v))
            if n <= 0:
                out[i] = int(Status.INVALID_PARAMS)
                continue
            if k not in chosen:
                chosen[k] = i
                totals.append(n)
        keep = list(chosen.values())
        pending = yield from self._start_batch([keys[i] for i in keep], totals, config, op)
        exists = Status.OBJECT_ALREADY_EXISTS
        ends: list[int] = []
        bad: list[int] = []
        local = _Mappings(self._local_address)
        memmove = _memmove
        clock = _fence.clock  # (read before each block: see kvmaster._fence)
        fence = pending.fence
        later: dict[int, Callable[[], int]] = {}
        if self.config.write_checksums and max(totals, default=0) >= OVERLAP_MIN:
            of = checksum_ptrs if raw else checksum_parts  # large values: hashed while
            later = {j: checksum_later(values[i], totals[j], of)  # copied
                     for j, i in enumerate(keep) if totals[j] >= OVERLAP_MIN
                     and pending.replicas[j] is not None}
        try:
            limit = fence.limit() if pending.open() else 0.0
            for j, i in enumerate(keep):
                v = values[i]
                replicas = pending.replicas[j]
                if replicas is None:
                    st = pending.status[j]
                    out[i] = 0 if st == exists else st
                    continue
                if len(replicas) == 1:  # one replica mapped here: straight into it
                    name, pos = replicas[0]
                    mapped = local[name]
                    if mapped is not None:
                        if raw:
                            dst = mapped[1] + pos
                            for p, n in v:
                                if n > FENCE_BLOCK:
                                    _memmove_blocks(dst, p, n, fence, limit)
                                else:
                                    if clock() > limit:
                                        raise fence.expired()
                                    memmove(dst, p, n)
                                dst += n
                        else:
                            view = mapped[0]
                            for p in v:
                                n = len(p)
                                if n >= RAW_COPY_MIN:
                                    _copy_blocks(view, pos, p, n, fence, limit)
                                else:
                                    if clock() > limit:
                                        raise fence.expired()
                                    view[pos:pos + n] = p
                                pos += n
                        ends.append(j)
                        continue
                try:
                    self._write(replicas, [_raw_view(p, n) for p, n in v] if raw else v,
                                fence, limit)
                except TransferError:
                    out[i] = int(Status.TRANSFER_FAIL)  # not revoked: see _put
                    pending.replicas[j] = None
                    continue
                except E.LeaseExpired:
                    raise
                except (OSError, ValueError, E.KVMasterError) as exc:
                    out[i] = int(_write_failure(exc))
                    bad.append(j)
                    continue
                ends.append(j)
        except GeneratorExit:
            settle(later.values())
            raise
        except BaseException:
            settle(later.values())  # (before the call returns: they read the caller's memory)
            yield self._revoke_pending(pending, pending.open())
            raise
        hashed = {j: result() for j, result in later.items()}  # (all, failed ones too)
        if bad:
            yield self._revoke_pending(pending, bad)
        if ends:
            sums: dict[int, int | None] | None = None
            if self.config.write_checksums:  # (from the caller's memory, as it was copied)
                of = checksum_ptrs if raw else checksum_parts
                sums = {j: hashed[j] if j in hashed else of(values[keep[j]]) for j in ends}
            done = yield from self._end_pending(pending, ends, sums)
            for j, r in done.items():
                out[keep[j]] = r
        for i, k in enumerate(keys):  # a repeated key answers its first position's write
            first = chosen.get(k)
            if first is not None and first != i and out[i] == 0:
                out[i] = out[first]
        return out
