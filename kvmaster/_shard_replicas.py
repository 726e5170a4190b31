"""Replica management on a shard: clearing a client's own replicas, existence probes,
copies and moves of replicas between segments, and segment labels (Mooncake
``MasterService::BatchReplicaClear``, ``CreateCopyTask`` / ``CreateMoveTask``,
``BatchProbeKey``, and segment names that are the clients' ``local_hostname``).

A copy is two requests of the client that does it: COPY_REPLICAS_PREPARE allocates a
range on each target segment that holds no replica of the object yet and leases the
object (its source bytes stay put while they are read); the client copies the bytes;
COPY_REPLICAS_COMMIT adds the new replicas to the object, or frees them.  A target
without room gets it as a put's segment does, by evicting least recently used objects
(the leased object being copied is never one of them).  Between the
two the ranges are a *pending copy* (bounded per shard: :data:`MAX_PENDING_COPIES`,
BUSY beyond), freed when its client leaves or after ``--put-start-release-timeout``.
A move is a copy to one target whose commit also takes the source replica out of the
object (freed once the object's lease has run out, as a removal's are).
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING, Any

from kvmaster._alloc import align_up
from kvmaster._records import StatusError
from kvmaster._tenancy import footprint
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster._records import ClientView, ObjectMeta, SegmentShare
    from kvmaster._shard import ShardActor

#: Copies prepared and not yet committed, per shard; a prepare beyond them is BUSY.
MAX_PENDING_COPIES = 4096
#: Most target segments one COPY_REPLICAS_PREPARE may name.
MAX_COPY_TARGETS = 64
#: Eviction rounds a prepare runs for the space of one target, at most.
COPY_EVICT_ROUNDS = 16


class PendingCopy:
    """A prepared copy: the object record it copies (identity: a record replaced by an
    upsert or removed is not the same one), the new ranges, the copying client, the
    source segment of a move (None for a copy) and the monotonic deadline."""

    __slots__ = ("ck", "record", "new", "client_id", "source", "deadline")

    def __init__(self, ck: bytes, record: ObjectMeta, new: list[tuple[SegmentShare, int]],
                 client_id: str, source: SegmentShare | None, deadline: float) -> None:
        self.ck = ck
        self.record = record
        self.new = new
        self.client_id = client_id
        self.source = source
        self.deadline = deadline


def _error(status: Status, text: str) -> Exception:
    return StatusError(status, text)


class Replicas:
    """The replica ops of one shard (``ShardActor.replicas``, see the module docstring):
    the pending copies and the segment labels are its own."""

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard
        #: token -> prepared copy.
        self.copies: dict[int, PendingCopy] = {}
        # Tokens start at a random point: a token of a master that restarted is unknown.
        self._copy_tokens = itertools.count(int.from_bytes(os.urandom(4), "big") + 1)
        #: label -> segment name, and segment name -> label (mounted segments only).
        self.labels: dict[str, str] = {}
        self.label_of: dict[str, str] = {}
        shard.counters["replicas_cleared_keys"] = 0
        shard.counters["corrupt_replicas_dropped"] = 0

    # ---------------------------------------------------------------- names

    def segment_named(self, name: str) -> SegmentShare | None:
        """The mounted segment called ``name`` (its name, or else its label)."""
        shard = self.shard
        seg = shard.placement.segments.get(name)
        if seg is None and name in self.labels:
            seg = shard.placement.segments.get(self.labels[name])
        return seg

    def preferred(self, preferred: tuple[str, ...]) -> tuple[str, ...]:
        """Preferred segments with labels replaced by their segments' names."""
        if not preferred or not self.labels:
            return preferred
        labels = self.labels
        segments = self.shard.placement.segments
        return tuple(n if n in segments else labels.get(n, n) for n in preferred)

    def handle_set_segment_label(self, client: ClientView, msg: Any,
                                 now: float) -> int:
        shard = self.shard
        seg = shard.placement.segments.get(msg.name)
        if seg is None or seg.owner != client.client_id:
            raise _error(Status.SEGMENT_NOT_FOUND,
                         f"segment {msg.name!r} is not a mounted segment of this client")
        label = msg.label
        if label:
            holder = self.labels.get(label)
            segments = shard.placement.segments
            if (holder is not None and holder != seg.name and holder in segments) or \
                    (label in segments and label != seg.name):
                raise _error(Status.SEGMENT_ALREADY_EXISTS,
                             f"segment name {label!r} is taken by another mounted segment")
        self.forget_label(seg.name)
        if label:
            self.labels[label] = seg.name
            self.label_of[seg.name] = label
        return 0

    def handle_segment_labels(self, client: ClientView, msg: Any,
                              now: float) -> dict[str, str]:
        return dict(self.label_of)

    def forget_label(self, name: str) -> None:
        """Drop the label of segment ``name`` (unmounted or relabelled)."""
        label = self.label_of.pop(name, None)
        if label is not None and self.labels.get(label) == name:
            del self.labels[label]

    # ---------------------------------------------------------------- reads

    def handle_batch_probe_key(self, client: ClientView, msg: Any,
                               now: float) -> list[int]:
        """1 or 0 per key; no lease, no LRU touch, no hit/miss counters."""
        shard = self.shard
        objects = shard.objects
        return [1 if ck in objects else 0 for ck in shard._ckeys(client, msg.keys)]

    # ---------------------------------------------------------------- clear

    def handle_replica_clear(self, client: ClientView, msg: Any,
                             now: float) -> list[bytes]:
        """Mooncake's BatchReplicaClear on this shard's keys (see ReplicaClearRequest).
        Pins do not keep an object: the clear is its writer's explicit request, like a
        removal.  With no segment, an object whose upsert is in progress is skipped (its
        replicas are not all complete, as Mooncake skips)."""
        shard = self.shard
        cks = shard._ckeys(client, msg.keys)
        target: SegmentShare | None = None
        if msg.segment:
            target = self.segment_named(msg.segment)
            if target is None:
                return []  # no replica can be on a segment that is not mounted
        objects = shard.objects
        me = client.client_id
        out: list[bytes] = []
        for key, ck in zip(msg.keys, cks):
            obj = objects.get(ck)
            if obj is None or obj.writer != me or obj.lease > now:
                continue
            if target is None:
                if ck in shard.writes:
                    continue
                del objects[ck]
                if shard.log is not None and obj.lease > now:
                    shard.log.removed(ck)
                shard.placement.free_object(obj, now)
                shard.sessions.unregister(ck, obj.sessions)
            else:
                reps = obj.replicas()
                keep = [r for r in reps if r[0] is not target]
                if len(keep) == len(reps):
                    continue
                for seg, off in reps:
                    if seg is target:
                        shard.placement.free(seg, off, obj.size)
                if keep:
                    before = footprint(obj)
                    obj.keep(keep)
                    shard._recount(ck, before)
                    if shard.log is not None:
                        shard.log.put(ck, obj)
                else:
                    del objects[ck]
                    shard.sessions.unregister(ck, obj.sessions)
            out.append(key)
        shard.counters["replicas_cleared_keys"] += len(out)
        return out

    # ------------------------------------------------------- corrupt replicas

    def handle_drop_corrupt_replicas(self, client: ClientView, msg: Any,
                                     now: float) -> list[int]:
        """Take replicas a reader found corrupt out of their objects (see
        DropCorruptReplicasRequest).  A replica is dropped only while the object still
        has it and still carries the checksum the reader compared against (a replica
        of an object replaced meanwhile is another object's).  Its range is freed once
        the object's leases have run out (readers in flight keep reading it, and find
        it corrupt themselves); the last replica takes the object with it."""
        shard = self.shard
        keys = msg.keys
        if len(msg.replicas) != len(keys) or len(msg.expected_checksums) != len(keys):
            raise _error(Status.INVALID_PARAMS, "replicas, checksums and keys differ in length")
        cks = shard._ckeys(client, keys)
        objects = shard.objects
        missing = int(Status.OBJECT_NOT_FOUND)
        out: list[int] = []
        for ck, (name, off), want in zip(cks, msg.replicas, msg.expected_checksums):
            obj = objects.get(ck)
            if obj is None or obj.checksum != want:
                out.append(missing)
                continue
            reps = obj.replicas()
            keep = [r for r in reps if r[0].name != name or r[1] != off]
            if len(keep) == len(reps):
                out.append(missing)
                continue
            seg = next(r[0] for r in reps if r[0].name == name and r[1] == off)
            if obj.lease > now:
                shard.placement.defer_free(obj.lease, seg, off, obj.size)
            else:
                shard.placement.free(seg, off, obj.size)
            if keep:
                obj.keep(keep)
                if shard.log is not None:
                    shard.log.put(ck, obj)
            else:
                del objects[ck]
                if shard.log is not None:
                    shard.log.removed(ck)
                shard.sessions.unregister(ck, obj.sessions)
            out.append(0)
        shard.counters["corrupt_replicas_dropped"] += out.count(0)
        return out

    # --------------------------------------------------------------- copies

    def handle_copy_replicas_prepare(self, client: ClientView, msg: Any,
                                     now: float) -> list[Any]:
        shard = self.shard
        ck = shard._ckey(client, msg.key)
        if not msg.targets or len(msg.targets) > MAX_COPY_TARGETS:
            raise _error(Status.INVALID_PARAMS,
                         f"a copy names 1..{MAX_COPY_TARGETS} target segments")
        obj = shard.objects.get(ck)
        if obj is None:
            raise _error(Status.OBJECT_NOT_FOUND, "object not found")
        targets: list[SegmentShare] = []
        pool = shard.tenancy.pool(client.prefix or b"")
        for name in msg.targets:
            seg = self.segment_named(name)
            if seg is not None and (pool is None or pool.segments.get(seg.name) is not seg):
                seg = None  # another tenant's segment: as if not mounted (kvmaster/_tenancy.py)
            if seg is None:
                raise _error(Status.INVALID_PARAMS, f"unknown target segment {name!r}")
            if seg not in targets:
                targets.append(seg)
        assert pool is not None  # (without one, every target was refused above)
        held = [s for s, _ in obj.replicas()]
        source: SegmentShare | None = None
        if msg.source:
            source = self.segment_named(msg.source)
            if source is None:
                raise _error(Status.INVALID_PARAMS, f"unknown source segment {msg.source!r}")
            if len(targets) != 1:
                raise _error(Status.INVALID_PARAMS, "a move has exactly one target segment")
            if targets[0] is source:
                raise _error(Status.INVALID_PARAMS, "source and target are the same segment")
            if source not in held:
                raise _error(Status.INVALID_PARAMS,
                             f"the object has no replica on segment {msg.source!r}")
        if len(self.copies) >= MAX_PENDING_COPIES:
            raise _error(Status.BUSY, f"{MAX_PENDING_COPIES} copies in progress on this shard")
        size = obj.size
        shard.reads.lease(obj, now)  # (before any eviction below: a leased object is not taken)
        new: list[tuple[SegmentShare, int]] = []
        for seg in targets:
            if seg in held:
                continue
            off = seg.alloc.alloc(size)
            if off is None:
                shard.placement.release_deferred(now)
                off = seg.alloc.alloc(size)
            # As a put does: evict least recently used objects for the space (they may
            # free space elsewhere first: a bounded number of rounds).
            rounds = 0
            while off is None and rounds < COPY_EVICT_ROUNDS and \
                    align_up(size) <= seg.alloc.size and \
                    shard.eviction.evict(align_up(size), now, pool):
                off = seg.alloc.alloc(size)
                rounds += 1
            if off is None:
                for s, o in new:
                    shard.placement.free(s, o, size)
                shard.counters["alloc_failures"] += 1
                raise _error(Status.NO_AVAILABLE_HANDLE,
                             f"no space for {size} bytes on segment {seg.name!r}")
            shard.placement.used += align_up(size)
            new.append((seg, off))
        token = next(self._copy_tokens)
        self.copies[token] = PendingCopy(ck, obj, new, client.client_id, source,
                                         now + shard.config.put_start_release_timeout)
        return [size, shard._lease_ms, obj.wire_replicas(), [[s.name, o] for s, o in new],
                token]

    def _free_copy(self, pc: PendingCopy) -> None:
        shard = self.shard
        size = pc.record.size
        for seg, off in pc.new:
            shard.placement.free(seg, off, size)  # (nothing if that segment was unmounted)

    def handle_copy_replicas_commit(self, client: ClientView, msg: Any,
                                    now: float) -> int:
        shard = self.shard
        ck = shard._ckey(client, msg.key)
        pc = self.copies.get(msg.token)
        if pc is None or pc.ck != ck:
            raise _error(Status.OBJECT_NOT_FOUND, "no such copy in progress")
        if pc.client_id != client.client_id:
            raise _error(Status.ILLEGAL_CLIENT, "the copy is another client's")
        del self.copies[msg.token]
        obj = shard.objects.get(ck)
        if not msg.done or obj is not pc.record:
            self._free_copy(pc)
            if not msg.done:
                return 0
            raise _error(Status.OBJECT_NOT_FOUND,
                         "the object was removed or replaced during the copy")
        reps = obj.replicas()
        held = [s for s, _ in reps]
        for seg, off in pc.new:
            if shard.placement.segments.get(seg.name) is not seg:
                continue  # unmounted meanwhile
            if seg in held:
                shard.placement.free(seg, off, obj.size)
            else:
                reps.append((seg, off))
                held.append(seg)
        src = pc.source
        if src is not None:
            rest = [r for r in reps if r[0] is not src]
            if rest and len(rest) < len(reps):
                for seg, off in reps:
                    if seg is src:
                        if obj.lease > now:
                            shard.placement.defer_free(obj.lease, seg, off, obj.size)
                        else:
                            shard.placement.free(seg, off, obj.size)
                reps = rest
        before = footprint(obj)
        obj.keep(reps)
        shard._recount(ck, before)
        if shard.log is not None:
            shard.log.put(ck, obj)
        return 0

    def expire_copies(self, now: float) -> None:
        """Free the copies that outlived their deadline (their client stopped)."""
        if not self.copies:
            return
        for token in [t for t, pc in self.copies.items() if pc.deadline <= now]:
            self._free_copy(self.copies.pop(token))

    def drop_copies_of(self, client_id: str) -> None:
        """Free the copies of a client that left (BYE or expiry)."""
        if not self.copies:
            return
        for token in [t for t, pc in self.copies.items() if pc.client_id == client_id]:
            self._free_copy(self.copies.pop(token))

    def copy_ranges(self) -> list[tuple[SegmentShare, int]]:
        """(segment, size) of every range a pending copy holds (for check_consistency)."""
        return [(seg, pc.record.size) for pc in self.copies.values() for seg, _ in pc.new]
