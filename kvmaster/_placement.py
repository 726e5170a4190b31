"""One shard's space: where its replicas go, and when their space comes back.

:class:`Placement` owns the shard's share of each mounted segment, what those shares
hold and have allocated, and the frees deferred until a read lease ends.  Space freed
while the shard leads with ``--ha-oplog`` goes to the op log first
(:meth:`kvmaster._shard_oplog.ShardLog.free`), which gives it back once durable.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from kvmaster._alloc import align_up

if TYPE_CHECKING:
    from kvmaster import protocol as P
    from kvmaster._records import ObjectMeta, SegmentShare
    from kvmaster._shard import ShardActor
    from kvmaster._tenancy import TenantPool

__all__ = ["Placement", "free_space"]


def free_space(seg: SegmentShare) -> int:
    return seg.alloc.size - seg.alloc.used


class Placement:
    """The segment shares of one shard (``segments``: name -> share), their bytes
    (``capacity``) and allocated bytes (``used``), and the frees waiting for a lease
    to end (``deferred``: a heap of (deadline, seq, segment name, offset, size)).
    Run by the shard's actor; eviction, when space is short, is the shard's
    :class:`kvmaster._eviction.Eviction`."""

    __slots__ = ("_deferred_seq", "capacity", "deferred", "segments", "shard", "used")

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard
        self.segments: dict[str, SegmentShare] = {}
        self.capacity = 0
        self.used = 0
        self.deferred: list[tuple[float, int, str, int, int]] = []  # heap
        self._deferred_seq = 0

    # ------------------------------------------------------------- segments

    def mount(self, seg: SegmentShare) -> None:
        self.segments[seg.name] = seg
        self.capacity += seg.alloc.size

    def unmount(self, name: str) -> SegmentShare | None:
        """Forget a segment share (None if none): its bytes, what was allocated in it,
        and the frees deferred there (its space went with it)."""
        seg = self.segments.pop(name, None)
        if seg is None:
            return None
        self.capacity -= seg.alloc.size
        if seg.alloc.used:
            self.used -= seg.alloc.used
            self.deferred = [d for d in self.deferred if d[2] != name]
            heapq.heapify(self.deferred)
        return seg

    def usage(self) -> dict[str, int]:
        """Bytes allocated in this shard's share of each segment."""
        return {name: seg.alloc.used for name, seg in self.segments.items()}

    # ----------------------------------------------------------------- frees

    def free(self, seg: SegmentShare, off: int, size: int) -> None:
        if self.segments.get(seg.name) is seg:
            oplog = self.shard.log
            if oplog is not None:
                oplog.free(seg, off, size)  # (given back once its record is durable)
                return
            seg.alloc.release(off, size)
            self.used -= align_up(size)

    def free_object(self, obj: ObjectMeta, now: float) -> None:
        """Free an object's replicas now, or once its lease has run out."""
        if obj.lease > now:
            for seg, off in obj.replicas():
                self.defer_free(obj.lease, seg, off, obj.size)
        else:
            for seg, off in obj.replicas():
                self.free(seg, off, obj.size)

    def defer_free(self, when: float, seg: SegmentShare, off: int, size: int) -> None:
        self._deferred_seq += 1
        heapq.heappush(self.deferred, (when, self._deferred_seq, seg.name, off, size))

    def release_deferred(self, now: float) -> None:
        d = self.deferred
        while d and d[0][0] <= now:
            _, _, name, off, size = heapq.heappop(d)
            seg = self.segments.get(name)
            if seg is not None:
                self.free(seg, off, size)

    # ------------------------------------------------------------ allocation

    def allocate(self, size: int, config: P.ReplicateConfigWire, now: float,
                 pool: TenantPool) -> list[tuple[SegmentShare, int]] | None:
        """Place up to ``config.replica_num`` replicas on distinct segments of ``pool``
        (the writer's tenant's and the shared ones; best effort beyond the first),
        evicting the tenant's least recent objects when space is short."""
        segs = pool.segments
        shard = self.shard
        if not segs:
            return None
        # Never evict for a request that could not fit even into empty segments.
        if align_up(size) > pool.max_share:
            shard.counters["alloc_failures"] += 1
            return None
        want = min(config.replica_num, len(segs))
        preferred = config.preferred_segments
        if preferred:  # (labels replaced by their segments' names)
            preferred = shard.replicas.preferred(preferred)
        for attempt in range(64):
            got = self.try_allocate(size, want, preferred, segs)
            if got is not None:
                return got
            if attempt == 0:
                self.release_deferred(now)
                continue
            oplog = shard.log
            if oplog is not None and oplog.held_in(pool) >= align_up(size):
                # Space freed (by eviction, removals) is held until its record is in
                # etcd, an etcd write away: refuse this one rather than evict more.
                oplog.writer.flush()
                shard.counters["alloc_held_by_oplog"] += 1
                break
            if not shard.eviction.evict(align_up(size), now, pool):
                break
        shard.counters["alloc_failures"] += 1
        return None

    def try_allocate(self, size: int, want: int, preferred: tuple[str, ...],
                     segs: dict[str, SegmentShare]) -> list[tuple[SegmentShare, int]] | None:
        if want == 1 and not preferred:
            # Common case: one replica, most free space first.
            first = max(segs.values(), key=free_space) if len(segs) > 1 else \
                next(iter(segs.values()))
            off = first.alloc.alloc(size)
            if off is not None:
                self.used += align_up(size)
                return [(first, off)]
            if len(segs) == 1:
                return None
        order: list[SegmentShare] = [segs[n] for n in dict.fromkeys(preferred) if n in segs]
        order.extend(sorted((s for s in segs.values() if s.name not in preferred),
                            key=free_space, reverse=True))
        got: list[tuple[SegmentShare, int]] = []
        for seg in order:
            off = seg.alloc.alloc(size)
            if off is not None:
                got.append((seg, off))
                if len(got) == want:
                    break
        if not got:
            return None
        # Best effort beyond the first replica, as Mooncake places replicas.
        self.used += align_up(size) * len(got)
        return got
