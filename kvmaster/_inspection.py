"""What one shard reports about itself: its STATS snapshot, and the invariants the
tests check (allocator accounting against live replicas, writer and tenant counts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmaster._alloc import align_up
from kvmaster._records import HARD_PIN
from kvmaster._tenancy import CountedObjects, charge, prefix_of

if TYPE_CHECKING:
    from kvmaster._shard import ShardActor

__all__ = ["PIN_GAUGE_MAX_AGE_S", "Inspection"]

#: The pinned-key gauges scan every object: a STATS reuses them for this long.
PIN_GAUGE_MAX_AGE_S = 5.0


class Inspection:
    """The STATS snapshot and consistency checks of one shard (``ShardActor.inspection``),
    run by its actor; ``pin_gauges``: (when, gauges) of the last pinned-key scan."""

    __slots__ = ("pin_gauges", "shard")

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard
        self.pin_gauges: tuple[float, dict[str, int]] = (-1e9, {})

    def pins(self, now: float) -> dict[str, int]:
        """Pinned key counts and bytes: a scan of every object, so cached for 5 s."""
        when, gauges = self.pin_gauges
        if now - when < PIN_GAUGE_MAX_AGE_S:
            return gauges
        soft = hard = soft_b = hard_b = 0
        for obj in self.shard.objects.values():
            nbytes = obj.size * (1 + (len(obj.more) if obj.more else 0))
            if self.shard.eviction.is_soft_pinned(obj, now):
                soft += 1
                soft_b += nbytes
            if obj.flags & HARD_PIN:
                hard += 1
                hard_b += nbytes
        gauges = {"soft_pinned_keys": soft, "hard_pinned_keys": hard,
                  "soft_pinned_bytes": soft_b, "hard_pinned_bytes": hard_b}
        self.pin_gauges = (now, gauges)
        return gauges

    def stats(self, now: float) -> dict[str, Any]:
        return {
            "shard": self.shard.index,
            "keys": len(self.shard.objects),
            **self.pins(now),
            "pending_writes": len(self.shard.writes),
            # Writes given up on whose space is held for their writer (StrandedWrite).
            "given_up_writes": sum(map(len, self.shard.writers.stranded.values())),
            "capacity_bytes": self.shard.placement.capacity,
            "allocated_bytes": self.shard.placement.used,
            "inbox_depth": len(self.shard.inbox),
            "sessions": len(self.shard.sessions),
            "pinned_sessions": sum(1 for r in self.shard.sessions.records.values() if r.pinned),
            "memberships": sum(len(r.members) for r in self.shard.sessions.records.values()),
            "open_walks": len(self.shard.walks),
            "staged_updates": len(self.shard.sessions.updates.staged),
            **({"oplog_held_bytes": self.shard.log.held_bytes} if self.shard.log is not None else {}),
            **({f"adoption_{k}": v for k, v in self.shard.adoption.status().items()}
               if self.shard.adoption is not None else {}),
            **self.shard.counters,
        }

    def check_consistency(self) -> list[str]:
        """Invariants for tests: allocator accounting matches live replicas."""
        problems = []
        per_seg: dict[str, int] = {}
        for obj in self.shard.objects.values():
            for seg, _ in obj.replicas():
                per_seg[seg.name] = per_seg.get(seg.name, 0) + align_up(obj.size)
        for pw in self.shard.writes.values():
            for seg, _ in pw.replicas():
                per_seg[seg.name] = per_seg.get(seg.name, 0) + align_up(pw.size)
        for _, _, name, _, size in self.shard.placement.deferred:
            if name in self.shard.placement.segments:
                per_seg[name] = per_seg.get(name, 0) + align_up(size)
        for ws in self.shard.writers.stranded.values():
            for sw in ws:
                rec = sw.record
                assert rec is not None, "a stranded write in the lists is not yet freed"
                for seg, _ in rec.replicas():
                    if self.shard.placement.segments.get(seg.name) is seg:
                        per_seg[seg.name] = per_seg.get(seg.name, 0) + align_up(rec.size)
        held: dict[str, int] = {}
        for pw in self.shard.writes.values():
            held[pw.writer] = held.get(pw.writer, 0) + 1
        for ws in self.shard.writers.stranded.values():
            for sw in ws:
                rec = sw.record
                assert rec is not None, "a stranded write in the lists is not yet freed"
                held[rec.writer] = held.get(rec.writer, 0) + 1
        if held != self.shard.writers.held:
            writer = next(w for w in {*held, *self.shard.writers.held}
                          if held.get(w, 0) != self.shard.writers.held.get(w, 0))
            problems.append(f"shard {self.shard.index}: writer {writer} counted with "
                            f"{self.shard.writers.held.get(writer, 0)} write records, holds "
                            f"{held.get(writer, 0)}")
        for writer, cks in self.shard.writers.stranded_by.items():
            if any(writer not in {sw.record.writer for sw in self.shard.writers.stranded.get(ck, ())
                                 if sw.record is not None}
                   for ck in cks):
                problems.append(f"shard {self.shard.index}: stranded index of {writer} is stale")
        for seg, size in [*self.shard.replicas.copy_ranges(), *(self.shard.log.held_ranges() if self.shard.log else ())]:
            if self.shard.placement.segments.get(seg.name) is seg:
                per_seg[seg.name] = per_seg.get(seg.name, 0) + align_up(size)
        for name, seg in self.shard.placement.segments.items():
            if seg.alloc.used != per_seg.get(name, 0):
                problems.append(f"shard {self.shard.index} segment {name}: allocator used "
                                f"{seg.alloc.used} != live {per_seg.get(name, 0)}")
        if self.shard.placement.used != sum(s.alloc.used for s in self.shard.placement.segments.values()):
            problems.append(f"shard {self.shard.index}: used counter {self.shard.placement.used} drifted")
        if type(self.shard.objects) is CountedObjects:
            problems += self._check_tenant_counts()
        return problems

    def _check_tenant_counts(self) -> list[str]:
        """The tenants' byte and write counts (tenant quotas) match a recount."""
        nbytes: dict[bytes, int] = {}
        nwrites: dict[bytes, int] = {}
        for ck, obj in [*self.shard.objects.items(), *self.shard.writes.items()]:
            p = prefix_of(ck)
            nbytes[p] = nbytes.get(p, 0) + charge(ck, obj)
        for ck in self.shard.writes:
            p = prefix_of(ck)
            nwrites[p] = nwrites.get(p, 0) + 1
        out = []
        for what, counted, real in (("bytes", self.shard.tenant_bytes, nbytes),
                                    ("writes", self.shard.tenant_writes, nwrites)):
            if {k: v for k, v in counted.items() if v} != real:
                out.append(f"shard {self.shard.index}: tenant {what} counted {counted} != {real}")
        return out
