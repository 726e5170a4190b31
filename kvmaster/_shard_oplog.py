"""One shard's side of the HA operation log (``--ha-oplog``, :mod:`kvmaster._oplog`).

:class:`ShardLog` (on a leader): records the shard's object changes, and holds each
range the shard frees until the batch recording the free is in etcd, so no standby
replaying the log can point a reader at reused space.

:class:`Adoption` (on a promoted standby): the objects the log says the shard held,
waiting for their segments to be mounted again; each is made readable (COMPLETE,
with its checksum, size, hard pin and a fresh read lease) when its segment comes
back with the size it had, its range reserved in the new share's allocator.
Objects of a segment not back within ``--ha-remount-grace`` are dropped.  Sessions,
soft pins and leases are runtime-only (as the session design says): clients rebuild
sessions in ``on_reconnect``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvmaster import protocol as P
from kvmaster._alloc import ALIGN, align_up
from kvmaster._records import HARD_PIN, ObjectMeta, SegmentShare
from kvmaster._tenancy import footprint, prefix_of
from kvmaster.protocol import Op, Status

if TYPE_CHECKING:
    from kvmaster._oplog import OpLogWriter, ShardReplica
    from kvmaster._shard import ShardActor

__all__ = ["START_OPS", "Adoption", "ShardLog"]

#: Write starts, which wait for held space (:meth:`ShardLog.park`).
START_OPS = frozenset(op.value for op in (
    Op.PUT_START, Op.BATCH_PUT_START, Op.UPSERT_START, Op.BATCH_UPSERT_START,
    Op.PUT_START_WITH_KV_SESSIONS, Op.BATCH_PUT_START_WITH_KV_SESSIONS,
    Op.UPSERT_START_WITH_KV_SESSIONS, Op.BATCH_UPSERT_START_WITH_KV_SESSIONS))
_UPSERTS = frozenset(op.value for op in (
    Op.UPSERT_START, Op.BATCH_UPSERT_START, Op.UPSERT_START_WITH_KV_SESSIONS,
    Op.BATCH_UPSERT_START_WITH_KV_SESSIONS))

log = logging.getLogger(__name__)


class ShardLog:
    """A leader shard's records, and the frees it holds until they are durable."""

    __slots__ = ("held", "held_by_segment", "held_bytes", "index", "parked", "retry", "shard",
                 "writer")

    def __init__(self, shard: ShardActor, writer: OpLogWriter) -> None:
        self.shard = shard
        self.writer = writer
        self.index = shard.index
        #: (batch, segment share, offset, size) of each range freed and not yet durable,
        #: in batch order
        self.held: deque[tuple[int, SegmentShare, int, int]] = deque()
        self.held_bytes = 0
        #: segment -> bytes of it held
        self.held_by_segment: dict[str, int] = {}
        #: write starts waiting for held space: (the batch whose durability gives back
        #: all the space it counted on, its inbox envelope); at most the inbox's bound
        #: (past it a start is handled at once, refused if nothing is free)
        self.parked: list[tuple[int, tuple[bytes, bytes, Any]]] = []
        #: ids of the parked requests' payloads: handled as usual when they come back
        self.retry: set[int] = set()

    def put(self, ck: bytes, obj: ObjectMeta) -> None:
        """``obj`` is ``ck``'s object now (stored, or its replicas changed)."""
        w, i = self.writer, self.index
        if obj.more is None:
            w.record(i, ("S", ck, obj.size, w.segment(i, obj.seg.name), obj.off,
                         obj.checksum, obj.flags & HARD_PIN))
            return
        reps = [[w.segment(i, obj.seg.name), obj.off]]
        reps.extend([w.segment(i, s.name), o] for s, o in obj.more)
        w.record(i, ("P", ck, obj.size, reps, obj.checksum, obj.flags & HARD_PIN))

    def puts(self, cks: list[bytes]) -> None:
        """:meth:`put` of each of ``cks`` (a batch end): one-replica objects as ``S``
        records built here, appended at once."""
        objects = self.shard.objects
        w, i = self.writer, self.index
        table = w.table(i)
        out: list[Any] = []
        append = out.append
        nbytes = 0
        most_bytes, most = w.batch_bytes // 2, max(1, w.max_batch // 2)
        for ck in cks:
            o = objects[ck]
            if o.more is not None:
                if out:
                    w.extend(i, out, nbytes)
                    out, nbytes = [], 0
                    append = out.append
                self.put(ck, o)
                table = w.table(i)  # (a full batch may have been cut)
                continue
            name = o.seg.name
            si = table.get(name)
            if si is None:
                si = table[name] = len(table)
            append(("S", ck, o.size, si, o.off, o.checksum, o.flags & HARD_PIN))
            nbytes += len(ck)
            if nbytes >= most_bytes or len(out) >= most:
                w.extend(i, out, nbytes)  # (may cut the batch: its table goes with it)
                out, nbytes = [], 0
                append = out.append
                table = w.table(i)
        if out:
            w.extend(i, out, nbytes)

    def removed(self, ck: bytes) -> None:
        """``ck``'s object was removed while its ranges stay allocated (a read lease)."""
        self.writer.record(self.index, ["D", ck])

    def free(self, seg: SegmentShare, off: int, size: int) -> None:
        """Record the free of ``[off, off + size)`` and hold the range until it is durable."""
        w, i = self.writer, self.index
        length = align_up(size)
        seq = w.record(i, ["F", w.segment(i, seg.name), off, length])
        self.held.append((seq, seg, off, size))
        self.held_bytes += length
        by = self.held_by_segment
        by[seg.name] = by.get(seg.name, 0) + length

    def mounted(self, name: str, size: int, tenant: str | None) -> None:
        w, i = self.writer, self.index
        w.record(i, ["M", w.segment(i, name), size, tenant])

    def unmounted(self, name: str) -> None:
        w, i = self.writer, self.index
        w.record(i, ["U", w.segment(i, name)])

    def durable(self, seq: int) -> None:
        """Batch ``seq`` is in etcd: give back the ranges it freed (on segments still
        mounted)."""
        held, shard = self.held, self.shard
        segments = shard.placement.segments
        by = self.held_by_segment
        while held and held[0][0] <= seq:
            _, seg, off, size = held.popleft()
            length = align_up(size)
            self.held_bytes -= length
            left = by[seg.name] - length
            if left:
                by[seg.name] = left
            else:
                del by[seg.name]
            if segments.get(seg.name) is seg:
                seg.alloc.release(off, size)
                shard.placement.used -= length
        if self.parked:
            # The starts that waited for this space are handled next, in their order.
            ready = [env for wait, env in self.parked if wait <= seq]
            if ready:
                self.parked = [(w, env) for w, env in self.parked if w > seq]
                shard.inbox.extendleft(reversed(ready))
                shard.wakeup()

    def held_in(self, pool: Any) -> int:
        """Bytes held in the segments of a tenant pool."""
        by = self.held_by_segment
        return sum(by.get(name, 0) for name in pool.segments) if by else 0

    def park(self, envelope: tuple[Any, ...], key: int, op: bytes, client: Any, msg: Any,
             now: float, own: Callable[[], list[int]] | None = None) -> bool:
        """Whether the write start ``msg`` (op ``op``) waits for held space: True when
        its writes fit only once the held bytes of its tenant's segments are given back
        (after evicting what else they need, held in turn); ``envelope`` (the inbox
        entry: a client request, or a forwarded batch part) is then handled again, as
        usual, right after the batch that frees the space is durable.  False: handle it
        now.  ``key`` tells the envelope when it comes back (the id of an object it
        holds); ``own``: the positions of this shard's keys, for a batch of any shard's
        (called only when space is short)."""
        if key in self.retry:
            self.retry.discard(key)
            return False
        shard = self.shard
        if len(self.parked) >= shard.inbox_limit:
            return False
        pool = shard.tenancy.pools.get(client.prefix or b"")
        if pool is None or not pool.segments:
            return False
        free = pool.capacity - pool.used()
        sizes = msg.sizes if hasattr(msg, "sizes") else (msg.size,)
        reps = max(1, min(getattr(msg.config, "replica_num", 1) or 1, len(pool.segments)))
        if (sum(sizes) + ALIGN * len(sizes)) * reps <= free:  # (the common case, in C)
            return False
        keys = msg.keys if hasattr(msg, "keys") else (msg.key,)
        if own is not None:  # (the other shards' keys are theirs to place)
            mine = own()
            keys = [keys[i] for i in mine]
            sizes = [sizes[i] for i in mine]
        need = sum(map(align_up, sizes)) * reps
        if need <= free:
            return False
        if op not in _UPSERTS:  # (a key stored already takes no space)
            objects = shard.objects
            prefix = client.prefix
            need = reps * sum(align_up(sz) for k, sz in zip(keys, sizes)
                              if (k if prefix is None else prefix + k) not in objects)
            if need <= free:
                return False
        short = need - free
        held = self.held_in(pool)
        if short > held:
            shard.eviction.evict(short - held, now, pool)  # (what it frees is held too)
            held = self.held_in(pool)
            if short > held:
                return False  # (no room even then: the start refuses what does not fit)
        self.parked.append((self.held[-1][0], envelope))
        self.retry.add(key)
        shard.counters["starts_parked_for_oplog"] += 1
        self.writer.flush()
        return True

    def refuse_parked(self, why: str) -> None:
        """The log stopped (this master steps down): answer every parked start
        SHUTTING_DOWN rather than leave its client to its timeout."""
        parked, self.parked = self.parked, []
        self.retry.clear()
        shard = self.shard
        for _, env in parked:
            if type(env[0]) is str:  # a forwarded batch part: its walk gets the status
                _, args, _ = env
                shard.walks.answer(args[4], args[5], args[6], int(Status.SHUTTING_DOWN))
            else:
                op, payload, client = env
                shard.reply(client.identity, op,
                            P.encode_reply(P.peek_req_id(payload), Status.SHUTTING_DOWN, why),
                            client.group)

    def held_ranges(self) -> list[tuple[SegmentShare, int]]:
        """(share, size) of each held range (for check_consistency)."""
        return [(seg, size) for _, seg, _, size in self.held]


class Adoption:
    """Objects taken over from the op log, waiting for their segments to come back."""

    __slots__ = ("adopted", "by_segment", "deadline", "dropped", "objects", "segments")

    def __init__(self, replica: ShardReplica, deadline: float) -> None:
        #: segment -> (size, tenant) as the old leader had it mounted
        self.segments = dict(replica.segments)
        #: key -> [size, [(segment, offset), ...], checksum, flags]
        self.objects = replica.objects
        self.by_segment: dict[str, list[tuple[bytes, int]]] = {}
        for ck, obj in self.objects.items():
            for name, off in obj[1]:
                self.by_segment.setdefault(name, []).append((ck, off))
        self.deadline = deadline
        #: key -> the ObjectMeta made for it (a later write of the key replaces it)
        self.adopted: dict[bytes, ObjectMeta] = {}
        self.dropped = 0

    def waiting(self) -> int:
        """Objects none of whose segments is back yet."""
        return sum(1 for ck in self.objects if ck not in self.adopted)

    def mount(self, shard: ShardActor, seg: SegmentShare, size: int, now: float,
              lease_s: float) -> list[bytes]:
        """Segment ``seg`` (mounted with ``size`` bytes) came back: reserve its objects'
        ranges and make them readable; -> the keys that gained a replica."""
        started = time.perf_counter()
        entries = self.by_segment.pop(seg.name, None)
        known = self.segments.pop(seg.name, None)
        if not entries:
            return []
        if known is None or known[0] != size:
            self.dropped += len(entries)
            return []
        objects, writes, adopted = shard.objects, shard.writes, self.adopted
        ranges: list[tuple[int, int]] = []
        take: list[tuple[bytes, int]] = []
        #: keys with a replica here not taken: the log must say what the shard holds
        #: instead (a standby promoted later must not believe the range is theirs)
        skipped: list[bytes] = []
        records = self.objects
        for ck, off in entries:
            if ck not in records:
                continue  # (removed while waiting: forget)
            mine = adopted.get(ck)
            cur = objects.get(ck)
            # A write of the key since the promotion has the last word.
            if (cur is not None and cur is not mine) or ck in writes \
                    or (mine is not None and cur is None):
                self.dropped += 1
                skipped.append(ck)
                continue
            take.append((ck, off))
            ranges.append((off, self.objects[ck][0]))
        refused = set(seg.alloc.reserve_all(ranges))
        shard.placement.used += seg.alloc.used
        fresh: list[bytes] = []
        gained: list[bytes] = []
        for i, (ck, off) in enumerate(take):
            size_, _, checksum, flags = self.objects[ck]
            if i in refused:
                self.dropped += 1
                skipped.append(ck)
                continue
            obj = adopted.get(ck)
            if obj is None:
                obj = ObjectMeta(size_, seg, off, None, 0.0, flags, None)
                obj.checksum = checksum
                obj.lease = now + lease_s  # (a reader of the old leader may be copying)
                adopted[ck] = obj
                objects[ck] = obj
                fresh.append(ck)
            else:
                before = footprint(obj)
                obj.more = [*(obj.more or ()), (seg, off)]
                shard._recount(ck, before)  # (tenant quotas count every replica)
            gained.append(ck)
        by_prefix: dict[bytes, list[bytes]] = {}
        for ck in fresh:
            by_prefix.setdefault(prefix_of(ck), []).append(ck)
        for prefix, cks in by_prefix.items():
            pool = shard.tenancy.pool(prefix)
            if pool is not None:
                pool.order.stored(cks)
        oplog = shard.log
        if oplog is not None:
            for ck in skipped:
                cur = objects.get(ck)
                if cur is None:
                    oplog.removed(ck)
                elif cur is adopted.get(ck):
                    oplog.put(ck, cur)  # (its replicas here and elsewhere, as they are)
        log.info("[ha] shard %d: segment %s is back: %d objects adopted in %.3f s "
                 "(%d dropped so far)", shard.index, seg.name, len(gained),
                 time.perf_counter() - started, self.dropped)
        return gained

    def forget(self, ck: bytes) -> bool:
        """A removal of ``ck`` while none of its segments is back: it is not adopted
        later.  True if it was waiting."""
        if ck in self.objects and ck not in self.adopted:
            del self.objects[ck]
            return True
        return False

    def expire(self) -> list[str]:
        """The grace is over: the segments not back are given up; -> their names."""
        gone = list(self.by_segment)
        for name in gone:
            self.dropped += len(self.by_segment[name])
        self.by_segment.clear()
        self.segments.clear()
        return gone

    def status(self) -> dict[str, Any]:
        return {"adopted": len(self.adopted), "waiting": self.waiting(),
                "segments_waiting": len(self.by_segment), "dropped": self.dropped}
