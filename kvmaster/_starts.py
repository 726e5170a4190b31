"""Write starts of one shard: PUT_START and UPSERT_START, single and batch.

A start admits a write: it checks the key (OBJECT_ALREADY_EXISTS unless an upsert),
the writer's share of ``--max-writes-per-client`` and its tenant's quotas, places the
replicas (:class:`kvmaster._placement.Placement`, evicting when space is short) and
records the write in progress until its PUT_END or PUT_REVOKE.  A batch of one-replica
writes without preferences is placed in one pass, one key after another.
"""

from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING, Any, cast

from kvmaster import protocol as P
from kvmaster._alloc import ALIGN, align_up
from kvmaster._placement import free_space
from kvmaster._reads import segment_index
from kvmaster._records import START_ERRORS, ObjectMeta, StatusError
from kvmaster._tenancy import OBJECT_OVERHEAD, CountedWrites, TenantPool
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster._records import ClientView, SegmentShare
    from kvmaster._shard import ShardActor

__all__ = ["WriteStarts"]


class WriteStarts:
    """The write-start handlers of one shard (``ShardActor.starts``), run by its actor;
    the writes, quotas and the writers' counts are the shard's."""

    __slots__ = ("shard",)

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard

    def start_one(self, client: ClientView, ck: bytes, size: int,
                   config: P.ReplicateConfigWire, now: float, upsert: bool,
                   write_id: int | None = None, tag: bytes | None = None) -> Any:
        """One PutStart/UpsertStart: replicas list or a negative status; ``tag``: the
        session tag of the write it starts (protocol 1.5)."""
        obj = self.shard.objects.get(ck)
        if obj is not None and not upsert:
            self.shard._touch(client, (ck,), False)  # a deduplicated put counts as a use
            return Status.OBJECT_ALREADY_EXISTS
        if config.soft_pin_ttl_ms is not None and config.soft_pin_ttl_ms > self.shard.config.max_kv_soft_pin_ttl:
            return Status.INVALID_PARAMS
        pw = self.shard.writes.get(ck)
        carried = None
        if pw is not None:
            if write_id is not None and pw.write_id == write_id and pw.settled \
                    and pw.writer == client.client_id and pw.size == size \
                    and pw.started < now and pw.again_at < now:
                # The same write started again by a later request (its first answer was
                # lost, e.g. a round sent again to a leader that was only slow): the same
                # answer, once per request (a key repeated in one batch, the first
                # request's or this one's, is refused as it was).  Not while a tagged
                # start's registration may still refuse the write.
                pw.again_at = now
                return pw.wire_replicas()
            if now - pw.started < self.shard.config.put_start_discard_timeout \
                    or pw.again_at == now or pw.started == now:
                # (Nor is a write taken over by the request that started it or answered
                # it again: a key repeated in a batch, its first position's answer.)
                return Status.OBJECT_ALREADY_EXISTS
        held = self.shard.writers.held
        if held.get(client.client_id, 0) >= self.shard._write_cap:
            self.shard.counters["write_limit_rejections"] += 1
            return Status.NO_AVAILABLE_HANDLE  # (nothing changed: the key is as it was)
        if pw is not None:
            carried = pw.sessions
            # Abandoned write: the new writer takes the key; the old space stays
            # allocated until its writer is done with it or leaves (it may still write).
            del self.shard.writes[ck]
            self.shard.counters["put_start_discarded"] += 1
            self.shard._tombstone(ck, pw, None)
            self.shard.writers.strand(ck, pw, pw.replicas())
        pool = self.shard._pool_for_write(
            client, align_up(size) * config.replica_num + len(ck) + OBJECT_OVERHEAD, now)
        if type(pool) is not TenantPool:
            self.shard.sessions.unregister(ck, carried)
            return pool
        replicas = self.shard.placement.allocate(size, config, now, pool)
        if replicas is None:
            self.shard.sessions.unregister(ck, carried)
            return Status.NO_AVAILABLE_HANDLE
        (seg, off), more = replicas[0], replicas[1:] or None
        cid = client.client_id
        rec = self.shard.writes[ck] = ObjectMeta(size, seg, off, more, 0.0, 0, carried, cid,
                                           write_id, now, config)
        if tag:
            rec.tag = tag
            self.shard.counters["session_tagged_writes"] += 1
        held[cid] = held.get(cid, 0) + 1
        if self.shard.lost_writes:
            self._forget_unnamed_loss(ck)
        return [[seg.name, off] for seg, off in replicas]

    def _forget_unnamed_loss(self, ck: bytes) -> None:
        """A new write of ``ck`` started: a dropped write of it whose start named no
        write_id is forgotten (ends and revokes naming none cannot tell the two
        apart); one with an id stays, for that write's end sent again."""
        lost = self.shard.lost_writes.get(ck)
        if lost is not None and lost[3] is None:
            del self.shard.lost_writes[ck]

    def _start_single(self, client: ClientView, msg: Any, now: float, upsert: bool) -> Any:
        ck = self.shard._ckey(client, msg.key)
        r = self.start_one(client, ck, msg.size, msg.config, now, upsert, msg.write_id)
        if type(r) is not list:
            raise StatusError(r, START_ERRORS[r])
        self.shard.eviction.check_watermark(now, self.shard.tenancy.pools.get(client.prefix or b""))
        return r

    def _start_batch(self, client: ClientView, msg: Any, now: float, upsert: bool) -> tuple:
        """One write per key, as the columnar body (a tuple here; :meth:`handle` sends
        the per-key form to a request without ``columns``)."""
        if len(msg.keys) != len(msg.sizes):
            raise StatusError(Status.INVALID_PARAMS, "keys and sizes differ in length")
        cks = self.shard._ckeys(client, msg.keys)
        out = self._start_columns(client, cks, msg.sizes, msg.config, now, upsert,
                                  msg.write_id, msg.session_tags)
        self.shard.eviction.check_watermark(now, self.shard.tenancy.pool(client.prefix or b""))
        return out

    def _start_columns(self, client: ClientView, cks: list[bytes], sizes: list[int],
                       config: P.ReplicateConfigWire, now: float, upsert: bool,
                       write_id: int | None, tags: list[bytes] | None = None) -> tuple:
        """:meth:`_start_one` of each key (``tags``: their protocol 1.5 session tags), as
        the columnar body: in one pass (:meth:`_start_batch_simple`) when the batch
        allows it, key by key otherwise.  No eviction to the watermark here."""
        pool = self.shard.tenancy.pool(client.prefix or b"")
        if (config.replica_num != 1 or config.preferred_segments or pool is None
                or not pool.segments or config.soft_pin_ttl_ms is not None
                or self.shard.writers.held.get(client.client_id, 0) + len(cks) > self.shard._write_cap
                or ((self.shard._quota_bytes or self.shard._quota_writes)
                    and not self.shard._quota_admits(pool.prefix, cks, sizes))):
            self.shard._quota_refused = 1 << 62  # (set lower by the first key refused)
            try:
                return tuple(P.replica_columns(
                    [self.start_one(client, ck, size, config, now, upsert, write_id, tag)
                     for ck, size, tag in zip(cks, sizes, tags or repeat(None))],
                    False))
            finally:
                self.shard._quota_refused = None
        return self._start_batch_simple(client, cks, sizes, config, now, upsert, write_id,
                                        pool, tags)

    def start_each(self, client: ClientView, cks: list[bytes], sizes: list[int],
                    config: P.ReplicateConfigWire, now: float, upsert: bool,
                    write_id: int | None) -> list[Any]:
        """:meth:`_start_columns` answered per key, as :meth:`_start_one` answers: the
        replica list ``[[segment, offset]]`` or a negative status."""
        names, first, offsets, more = self._start_columns(client, cks, sizes, config, now,
                                                          upsert, write_id)
        if more:  # (replica_num > 1: the per-key path's further replicas)
            further = dict(more)
            return [f if f < 0 else [[names[f], off], *further.get(i, ())]
                    for i, (f, off) in enumerate(zip(first, offsets))]
        return [f if f < 0 else [[names[f], off]] for f, off in zip(first, offsets)]

    def _start_batch_simple(self, client: ClientView, cks: list[bytes], sizes: list[int],
                            config: P.ReplicateConfigWire, now: float, upsert: bool,
                            write_id: int | None, pool: TenantPool,
                            tags: list[bytes] | None = None) -> tuple:
        """:meth:`_start_one` per key, inlined for the common case (one replica, no
        preferred segment, no soft-pin TTL): a fresh key whose space is free right
        away, in the segments of its tenant's ``pool``.  Any other key (existing object,
        pending write, full segment) takes the general path.  -> the columnar body
        (``more`` stays empty: one replica)."""
        objects, writes, segs = self.shard.objects, self.shard.writes, pool.segments
        lost = self.shard.lost_writes
        new_record = object.__new__
        one = len(segs) == 1
        share = next(iter(segs.values()))
        client_id = client.client_id
        mask = ~(ALIGN - 1)
        names: list[str] = []
        index: dict[str, int] = {}
        first: list[int] = []
        offsets: list[int] = []
        put_first, put_off = first.append, offsets.append
        last_seg: SegmentShare | None = None
        last_i = 0
        # Keys of one size (KV blocks): one allocator call for a run of them where one
        # call per key would have placed them the same way, one after another in one
        # free extent of the segment that key after key has the most free space
        # (RangeAllocator.alloc_run); one range per key otherwise.  The run's slots go
        # to the fresh keys in order.  Before a key that may allocate on the general
        # path (it replaces a pending write), and at the end, the unused rest of the
        # run is given back, so every key sees the space it would have seen.
        n = len(sizes)
        uniform = n > 1 and min(sizes) == max(sizes)
        need = (sizes[0] + ALIGN - 1) & mask if uniform else 0
        run_next = run_end = 0
        run_share = share
        # Counted maps (tenant quotas): plain sets, the batch's writes counted once.
        counted = type(writes) is CountedWrites
        dset = dict.__setitem__
        taken = taken_bytes = 0
        made = 0  # records made here (the general path counts its own)
        try:
            for pos, (ck, size) in enumerate(zip(cks, sizes)):
                if ck in writes or (not upsert and ck in objects):
                    if run_next < run_end and ck in writes:
                        run_share.alloc.release(run_next, run_end - run_next)
                        run_next = run_end = 0
                    r = self.start_one(client, ck, size, config, now, upsert, write_id,
                                        tags[pos] if tags else None)
                else:
                    if run_next >= run_end:
                        if not one:
                            share = max(segs.values(), key=free_space)
                        if uniform and n - pos > 1:
                            count = n - pos
                            if not one:  # as many keys as would go to this segment in a row
                                rest = max((free_space(g) for g in segs.values()
                                            if g is not share), default=0)
                                count = min(count, (free_space(share) - rest + need - 1) // need)
                            start = share.alloc.alloc_run(need, count) if count > 1 else None
                            if start is None:
                                uniform = False  # fragmented or spread: one range per key
                            else:
                                run_share, run_next, run_end = share, start, start + need * count
                    if run_next < run_end:
                        share = run_share
                        off: int | None = run_next
                        run_next += need
                    else:
                        off = share.alloc.alloc(size)
                    if off is None:
                        r = self.start_one(client, ck, size, config, now, upsert, write_id,
                                        tags[pos] if tags else None)
                    else:
                        self.shard.placement.used += (size + ALIGN - 1) & mask
                        # ObjectMeta(size, share, off, None, 0.0, 0, None, client_id,
                        # write_id, now, config), slot by slot (a call per key costs more
                        # here; test_a_batch_starts_records_match_object_meta_init).
                        rec = new_record(ObjectMeta)
                        rec.size, rec.seg, rec.off, rec.more = size, share, off, None
                        rec.lease = rec.softpin = 0.0
                        rec.flags, rec.sessions, rec.writer = 0, None, client_id
                        rec.write_id, rec.started, rec.config = write_id, now, config
                        rec.settled, rec.again_at, rec.checksum = True, 0.0, None
                        rec.tag = tags[pos] or None if tags else None
                        if rec.tag:
                            self.shard.counters["session_tagged_writes"] += 1
                        if counted:
                            dset(writes, ck, rec)
                            taken += 1
                            taken_bytes += ((size + ALIGN - 1) & mask) + len(ck)
                        else:
                            writes[ck] = rec
                        made += 1
                        if lost:
                            self._forget_unnamed_loss(ck)
                        if share is not last_seg:
                            last_i = segment_index(names, index, share.name)
                            last_seg = share
                        put_first(last_i)
                        put_off(off)
                        continue
                # The general path's answer: a status, or one replica (replica_num is 1).
                if type(r) is not list:
                    put_first(int(r))
                    put_off(0)
                    continue
                name, off = r[0]
                put_first(segment_index(names, index, name))
                put_off(off)
        finally:  # the run's unused rest, whatever happened
            if run_next < run_end:
                run_share.alloc.release(run_next, run_end - run_next)
            if taken:
                # (taken counts only the sets into counted maps)
                cast(CountedWrites, writes).started(pool.prefix, taken,
                                                    taken_bytes + OBJECT_OVERHEAD * taken)
            if made:
                held = self.shard.writers.held
                held[client_id] = held.get(client_id, 0) + made
        return (names, first, offsets, [])

    def handle_put_start(self, client: ClientView, msg: Any, now: float) -> Any:
        return self._start_single(client, msg, now, False)

    def handle_upsert_start(self, client: ClientView, msg: Any, now: float) -> Any:
        return self._start_single(client, msg, now, True)

    def handle_batch_put_start(self, client: ClientView, msg: Any, now: float) -> list[Any]:
        return self._batch_start(client, msg, now, False)

    def handle_batch_upsert_start(self, client: ClientView, msg: Any, now: float) -> list[Any]:
        return self._batch_start(client, msg, now, True)

    def _batch_start(self, client: ClientView, msg: Any, now: float, upsert: bool) -> Any:
        """A batch start; with ``session_tags`` (protocol 1.5) each write this client
        has in progress for its keys afterwards carries its key's tag (``ObjectMeta.tag``,
        kept by the object the write stores)."""
        tags = msg.session_tags
        if tags is not None and len(tags) != len(msg.keys):
            raise StatusError(Status.INVALID_PARAMS, "session_tags and keys differ in length")
        if msg.group_ids is not None:
            out = self.shard.groups.start(client, msg, now, upsert)
        else:
            out = self._start_batch(client, msg, now, upsert)
        return out
