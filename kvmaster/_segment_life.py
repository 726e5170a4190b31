"""Segment lifecycle on a shard: taking a share of a mounted segment, and the sweep
an unmount makes through the objects, the writes in progress and the kept replicas
of dropped writes (``ShardActor.segment_life``; the actor's ``mount_segment`` and
``unmount_segment`` messages come here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmaster import protocol as P
from kvmaster._alloc import ALIGN
from kvmaster._records import SegmentShare
from kvmaster._tenancy import footprint, prefix_of_tenant

if TYPE_CHECKING:
    from kvmaster._shard import ShardActor


class SegmentLifecycle:
    """Mounts and unmounts of one shard's segment shares; the state stays with its
    owners (placement, tenancy, eviction, replicas' labels, writers, sessions)."""

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard

    def mount(self, name: str, owner: str, size: int, tenant: str | None,
              clock: Callable[[], float]) -> int:
        """Take this shard's share of a new segment, which holds the writes of ``tenant``
        alone (None: of every tenant, kvmaster/_tenancy.py); returns the share's size.
        ``clock``: the actor's monotonic clock (read only for an adoption)."""
        shard = self.shard
        share = (size // shard.shard_count) & ~(ALIGN - 1)
        prefix = None if tenant is None else prefix_of_tenant(tenant, P.DEFAULT_TENANT)
        seg = SegmentShare(name, owner, shard.index * share, share, prefix)
        shard.placement.mount(seg)
        shard.tenancy.mount(seg, prefix)
        if shard.log is not None:
            shard.log.mounted(name, size, tenant)
        if shard.adoption is not None:
            shard.adoption.mount(shard, seg, size, clock(), shard._lease_s)
        return seg.alloc.size

    def unmount(self, name: str) -> int:
        """Drop a segment: replicas on it vanish, objects left without one are erased,
        writes with a replica on it are dropped (kept replicas elsewhere stay allocated
        until their writer is done with them).

        Returns the number of objects erased.
        """
        shard = self.shard
        seg = shard.placement.unmount(name)
        if seg is None:
            return 0
        empty = not seg.alloc.used  # (nothing is on it: no walk of the objects)
        if shard.log is not None:
            shard.log.unmounted(name)
        shard.tenancy.unmount(seg)
        shard.eviction.forget_segment(name)
        shard.replicas.forget_label(name)
        if empty:
            return 0
        erased = []
        for ck, obj in shard.objects.items():
            if obj.seg is seg or (obj.more and any(s is seg for s, _ in obj.more)):
                erased.append(ck)
        for ck in erased:
            obj = shard.objects[ck]
            keep = [(s, o) for s, o in obj.replicas() if s is not seg]
            if keep:
                before = footprint(obj)
                obj.seg, obj.off = keep[0]
                obj.more = keep[1:] or None
                shard._recount(ck, before)
            else:
                del shard.objects[ck]
                shard.sessions.unregister(ck, obj.sessions)
        # Kept replicas of dropped writes on this segment went with it.
        for ck, ws in list(shard.writers.stranded.items()):
            for sw in ws:
                rec = sw.record
                if rec is None:  # (freed: no longer kept)
                    continue
                rest = [(s, o) for s, o in rec.replicas() if s is not seg]
                if not rest:  # (freeing is a no-op on the unmounted segment)
                    shard.writers.drop_stranded(ck, sw)
                elif len(rest) <= len(rec.more or ()):  # one went: no reference to it kept
                    rec.keep(rest)
        lost = [ck for ck, pw in shard.writes.items() if any(s is seg for s, _ in pw.replicas())]
        for ck in lost:
            pw = shard.writes.pop(ck)
            # Its writer may still be copying (it learns of the loss at its end): the
            # other replicas stay allocated until then.
            rest = [(s, o) for s, o in pw.replicas() if s is not seg]
            if rest:
                shard.writers.strand(ck, pw, rest)
            else:
                shard.writers.unheld(pw.writer)
            shard.sessions.unregister(ck, pw.sessions)
            shard._tombstone(ck, pw, name)
        n = sum(1 for ck in erased if ck not in shard.objects)
        shard.counters["objects_erased_with_segment"] += n
        shard.counters["writes_dropped_with_segment"] += len(lost)
        return n
