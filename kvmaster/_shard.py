"""Shard actor: sole owner of the object metadata of one hash partition.

A :class:`ShardActor` owns plain Python structures that nothing else reads or
writes: the objects whose ``crc32(tenant, key) % shards`` is its index, its
share of every mounted segment (a byte range of each, with its own
allocator), in-flight writes, deferred frees and counters.  Its only input is
its inbox; the front delivers client requests there and reads replies from
the output callback.  Handling is synchronous per message, so no lock is ever
needed and no actor waits on another while holding state.

Semantics follow Mooncake Store's master (``mooncake-store/src/master_service.cpp``:
``PutStart``/``PutEnd``/``PutRevoke``, ``GetReplicaList`` leases,
``Remove`` with ``OBJECT_HAS_LEASE``, ``BatchEvict``), with the differences
documented in ``protocol/PROTOCOL.md``.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from kvmaster import protocol as P
from kvmaster._alloc import ALIGN
from kvmaster._any_shard import AnyShardBatches
from kvmaster._ends import WriteEnds
from kvmaster._eviction import Eviction
from kvmaster._groups import Groups
from kvmaster._inspection import Inspection
from kvmaster._placement import Placement
from kvmaster._reads import Reads
from kvmaster._records import (
    DEFERRED,
    HARD_PIN,  # noqa: F401 - tests import it from here
    ClientView,
    ObjectMeta,
    Reply,
    SegmentShare,
    StatusError,
    StrandedWrite,
)
from kvmaster._removals import Removals
from kvmaster._segment_life import SegmentLifecycle
from kvmaster._sessions import Sessions
from kvmaster._shard_oplog import START_OPS, Adoption, ShardLog
from kvmaster._shard_replicas import Replicas
from kvmaster._starts import WriteStarts
from kvmaster._tagged import TaggedWrites
from kvmaster._tenancy import (
    OBJECT_OVERHEAD,
    CountedObjects,
    CountedWrites,
    Tenancy,
    TenantPool,
    prefix_of,
    prefix_of_tenant,
)
from kvmaster._walks import Walks
from kvmaster._writers import WriterRecords
from kvmaster.config import MasterConfig
from kvmaster.protocol import Op, ProtocolError, Status

log = logging.getLogger(__name__)

_monotonic = time.monotonic

INF = float("inf")

#: Per-key lists of the any-shard batch requests (split with their keys).


class ShardActor:
    """Owns one partition.  In the master's process the front calls :meth:`drain`
    between socket reads (no task or thread of its own); with ``--shard-processes`` the
    process ``kvmaster-shard-<index>`` does, in its own loop (kvmaster/_shardproc.py).

    ``deliver`` is the inbox (bounded; returns False when full so the front
    answers BUSY).  ``reply(identity, op, payload, group)`` hands a reply to the
    front.

    The actor decodes and dispatches; the state lives in components it holds in
    fields, each the only owner of its part (all run here, one message at a time):
    ``placement`` (segment shares, allocation, deferred frees), ``eviction``,
    ``walks`` (cross-shard operations), ``sessions`` (with ``sessions.updates``),
    ``writers`` (per-writer write records), ``groups`` (key groups), ``replicas`` (pending
    copies, segment labels), ``segment_life`` (mounts and the unmount's sweep); and the
    handlers ``reads``, ``starts``, ``tagged``, ``ends``, ``removals``,
    ``any_shard_batches`` and ``inspection``.  ``handlers`` maps each op to its handler,
    ``messages`` each internal message (the module's :func:`_handlers`, :func:`_messages`).
    """

    def __init__(self, index: int, shard_count: int, config: MasterConfig, reply: Reply) -> None:
        self.peers: list[ShardActor] = [self]
        #: Called after each message of a drain (a shard process sends the replies it
        #: has held past their wait there).
        self.between: Callable[[], None] | None = None
        #: (caller, op, req_id, message) of the request being handled.
        self._current: tuple[Any, bytes, int, Any] = (None, b"", 0, None)
        self.index = index
        self.shard_count = shard_count
        self.config = config
        self.reply = reply
        #: With a tenant quota the two maps count each tenant's bytes and writes
        #: (kvmaster/_tenancy.py); plain dicts otherwise.
        self.tenant_bytes: dict[bytes, int] = {}
        self.tenant_writes: dict[bytes, int] = {}
        quota_bytes = getattr(config, "tenant_quota_bytes", 0)
        quota_writes = getattr(config, "tenant_max_writes", 0)
        self._quota_bytes = -(-quota_bytes // shard_count) if quota_bytes else 0
        self._quota_writes = -(-quota_writes // shard_count) if quota_writes else 0
        self._quota_free = prefix_of_tenant(config.admin_tenant, P.DEFAULT_TENANT)
        #: Within one batch start, the smallest write the byte quota refused after
        #: eviction found nothing more to take: later keys of at least that size are
        #: refused without evicting again (None outside a batch).
        self._quota_refused: int | None = None
        if self._quota_bytes or self._quota_writes:
            self.objects: dict[bytes, ObjectMeta] = CountedObjects(self.tenant_bytes)
            self.writes: dict[bytes, ObjectMeta] = CountedWrites(self.tenant_bytes,
                                                                 self.tenant_writes)
        else:
            self.objects = {}
            self.writes = {}
        #: Writes dropped before their end: stored key -> (writer's client_id, the
        #: unmounted segment that held a replica of it, or None when it was released
        #: after ``--put-start-release-timeout``, forget-after deadline, its
        #: write_id), in the order they were dropped.  Their PUT_END/PUT_REVOKE answer
        #: SEGMENT_NOT_FOUND (a segment) or OBJECT_NOT_FOUND, also when the write's id
        #: is in :attr:`recent_ends` (see :meth:`kvmaster._ends.WriteEnds.end_one`).
        self.lost_writes: dict[bytes, tuple[str, str | None, float, int | None]] = {}
        #: The ids of the writes this shard ended last, per writer: client_id -> the
        #: last RECENT_ENDS_PER_WRITER write_ids, for at most ``--max-clients``
        #: writers (the one that ended one longest ago forgotten first; a writer is
        #: forgotten when the front forgets its client).  An end sent again whose
        #: object has gone since (evicted, removed, replaced) is answered 0 by it.
        self.recent_ends: OrderedDict[str, dict[int, dict[bytes, int] | None]] = OrderedDict()
        #: Segment shares, allocated space and deferred frees (kvmaster/_placement.py).
        self.placement = Placement(self)
        #: Eviction decisions and the objects kept for suspected clients
        #: (kvmaster/_eviction.py).
        self.eviction = Eviction(self)
        #: Write records each writer holds here (writes in progress and given-up ones),
        #: at most ``_write_cap`` (see :meth:`kvmaster._starts.WriteStarts.start_one`),
        #: and the given-up writes whose space stays allocated until their writer is
        #: done with them or leaves (kvmaster/_writers.py).
        self.writers = WriterRecords(self)
        self._write_cap = -(-config.max_writes_per_client // shard_count)
        self.inbox: deque[tuple[Any, ...]] = deque()
        self.inbox_limit = config.shard_inbox
        self.wakeup: Callable[[], None] = lambda: None
        #: Accept the batches of :data:`kvmaster.protocol.ANY_SHARD_OPS` with keys of
        #: any shard and forward the others' keys to their owners (in-process masters).
        self.any_shard = False
        #: Their splitting, forwarding and merging (kvmaster/_any_shard.py).
        self.any_shard_batches = AnyShardBatches(self)
        # The key list of the any-shard batch part being handled: its owners were
        # computed when it was split, so _ckeys need not hash its keys again.
        self._owned_keys: list[bytes] | None = None
        self.counters: dict[str, Any] = dict.fromkeys(_COUNTER_NAMES, 0)
        #: STATS and the consistency checks (kvmaster/_inspection.py).
        self.inspection = Inspection(self)
        #: The sessions homed here and the object-side session state (kvmaster/_sessions.py).
        self.sessions = sessions = Sessions(self)
        #: The cross-shard operations this shard has open (kvmaster/_walks.py).
        self.walks = Walks(self, sessions.flush_removed)
        #: The write-end and revoke handlers (kvmaster/_ends.py).
        self.ends = WriteEnds(self)
        #: The write-start handlers (kvmaster/_starts.py).
        self.starts = WriteStarts(self)
        #: The removal handlers (kvmaster/_removals.py).
        self.removals = Removals(self)
        #: The read handlers and their leases (kvmaster/_reads.py).
        self.reads = Reads(self)
        #: The write starts tagged with sessions (kvmaster/_tagged.py).
        self.tagged = TaggedWrites(self, sessions)
        #: Replica clears, probes, copies and moves, segment labels
        #: (kvmaster/_shard_replicas.py).
        self.replicas = Replicas(self)
        #: Segment mounts and the unmount's sweep (kvmaster/_segment_life.py).
        self.segment_life = SegmentLifecycle(self)
        #: Each op -> its handler (:func:`_handlers`).
        self.handlers = _handlers(self)
        #: The key groups homed here and the group notices (kvmaster/_groups.py).
        self.groups = Groups(self)
        #: The internal messages a shard takes (:meth:`post`), by name (:func:`_messages`).
        self.messages = _messages(self)
        self._lease_s = config.default_kv_lease_ttl / 1000.0
        self._lease_ms = config.default_kv_lease_ttl
        #: Each tenant's segments and eviction order (``--eviction-policy``,
        #: kvmaster/_eviction.py): every use and stored write goes through its tenant's
        #: order; ``_evict`` takes victims from it (kvmaster/_tenancy.py).
        self.tenancy = Tenancy(getattr(config, "eviction_policy", "lru"), self.objects)
        #: The HA op log (``--ha-oplog``, kvmaster/_shard_oplog.py): this shard's records
        #: and held frees while it leads; None otherwise.
        self.log: ShardLog | None = None
        #: Objects a promoted standby took over from the op log, waiting for their
        #: segments to be mounted again (None: none, or all settled).
        self.adoption: Adoption | None = None

    # ------------------------------------------------------------------ inbox

    def deliver(self, envelope: tuple[Any, ...]) -> bool:
        """Queue a client request ``(op, payload, client)``; False if the inbox is full."""
        if len(self.inbox) >= self.inbox_limit:
            return False
        self.inbox.append(envelope)
        if len(self.inbox) == 1:
            self.wakeup()
        return True

    def post(self, method: str, args: tuple[Any, ...], future: Any = None) -> None:
        """Queue an internal message (from the front or another shard): call
        ``method(*args)`` in turn.  Never refused: internal traffic is bounded by
        the client requests that cause it."""
        self.inbox.append((method, args, future))
        if len(self.inbox) == 1:
            self.wakeup()

    def drain(self) -> None:
        """Process everything queued, one message at a time."""
        inbox = self.inbox
        c = self.counters
        sessions = self.sessions
        groups = self.groups
        depth = len(inbox)
        c[_bucket("queue_depth.", QUEUE_BOUNDS, depth)] += 1
        c["queue_depth.sum"] += depth
        while inbox:
            env = inbox.popleft()
            if type(env[0]) is str:
                name, args, fut = env
                try:
                    result = self.messages[name](*args)
                except Exception as exc:  # noqa: BLE001 - becomes the future's error
                    log.exception("[shard %d] internal %s failed", self.index, name)
                    if fut is not None and not fut.done():
                        fut.set_exception(exc)
                else:
                    if fut is not None and not fut.done():
                        fut.set_result(result)
            else:
                op, payload, client = env
                t0 = _perf()
                out = self.handle(op, payload, client)
                if out is not None:
                    self.reply(client.identity, op, out, client.group)
                dt = (_perf() - t0) * 1e6
                c[_bucket("service_us.", SERVICE_BOUNDS_US, dt)] += 1
                c["service_us.sum"] += dt
            if sessions.removed_out:
                sessions.flush_removed()
            if groups.evicted_out:  # (behind the removal notices)
                groups.flush_evictions()
            if self.between is not None:
                self.between()

    def handle(self, op: bytes, payload: bytes, client: ClientView) -> bytes | None:
        """Decode, dispatch and encode one request; None when a walk answers later.
        Never raises."""
        c = self.counters
        c["requests"] += 1
        req_id = 0
        msg: Any  # (a request message of the op: its fields are the op's)
        names = _OP_COUNTERS.get(op, _UNKNOWN_OP_COUNTERS)
        c[names[0]] += 1
        try:
            req_id, msg = P.decode_request(op, payload)
            handler = self.handlers.get(op)
            if handler is None:
                raise StatusError(Status.UNSUPPORTED, f"op {op.hex()} is not served by shards")
            self._current = (client, op, req_id, msg)
            oplog = self.log
            if oplog is not None and op in START_OPS and oplog.park(
                    (op, payload, client), id(payload), op, client, msg, _monotonic(),
                    self.any_shard_batches.own_positions(op, client, msg)):
                return None  # (handled again once the held space is given back)
            if self.any_shard and op in P.ANY_SHARD_OPS:
                body = self.any_shard_batches.run(op, handler, client, msg, _monotonic())
            else:
                body = handler(client, msg, _monotonic())
            if body is DEFERRED:
                return None
            if names[2]:
                _count_items(c, names, body)
            if op in _COLUMN_OPS:
                body = _reply_form(op, body, msg.columns)
            return P.encode_reply(req_id, 0, body)
        except StatusError as exc:
            c["failures"] += 1
            c[names[1]] += 1
            return P.encode_reply(req_id, exc.status, str(exc))
        except ProtocolError as exc:
            c["failures"] += 1
            c[names[1]] += 1
            if not req_id:
                req_id = P.peek_req_id(payload)
            return P.encode_reply(req_id, exc.status, str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the shard
            c["failures"] += 1
            c[names[1]] += 1
            log.exception("[shard %d] op=%s failed", self.index, op.hex())
            return P.encode_reply(req_id, Status.INTERNAL_ERROR,
                                  f"internal error: {type(exc).__name__}")

    def _deferred_reply(self) -> Callable[..., None]:
        """A function that answers the request being handled now, later."""
        client, op, req_id, msg = self._current
        identity, group = client.identity, client.group
        send = self.reply
        names = _OP_COUNTERS.get(op, _UNKNOWN_OP_COUNTERS)

        def respond(body: Any, status: int = 0) -> None:
            if status:
                self.counters["failures"] += 1
                self.counters[names[1]] += 1
            else:
                if names[2]:
                    _count_items(self.counters, names, body)
                if op in _COLUMN_OPS:
                    body = _reply_form(op, body, msg.columns)
            send(identity, op, P.encode_reply(req_id, status, body), group)

        return respond

    # ------------------------------------------------- the owners, by their old names

    # Tests reach the write starts through this.

    def _start_one(self, client: ClientView, ck: bytes, size: int,
                   config: P.ReplicateConfigWire, now: float, upsert: bool,
                   write_id: int | None = None, tag: bytes | None = None) -> Any:
        return self.starts.start_one(client, ck, size, config, now, upsert, write_id, tag)

    # Read by the fuzz harness, the tests and the components: the owners' state.

    @property
    def stranded(self) -> dict[bytes, list[StrandedWrite]]:
        return self.writers.stranded

    @property
    def segments(self) -> dict[str, SegmentShare]:
        return self.placement.segments

    @property
    def capacity(self) -> int:
        return self.placement.capacity

    @property
    def used(self) -> int:
        return self.placement.used

    @property
    def deferred(self) -> list[tuple[float, int, str, int, int]]:
        return self.placement.deferred

    # ---------------------------------------------------------------- helpers

    def _ckey(self, client: ClientView, key: bytes) -> bytes:
        """Storage key; raises INVALID_PARAMS when the key is routed to the wrong shard."""
        if P.shard_of(key, client.seed, self.shard_count) != self.index:
            raise StatusError(Status.INVALID_PARAMS, "key routed to the wrong shard")
        return key if client.prefix is None else client.prefix + key

    def _check_batch_len(self, keys: list[bytes]) -> None:
        if len(keys) > self.config.max_batch:
            raise StatusError(Status.INVALID_PARAMS,
                              f"batch of {len(keys)} keys exceeds max_batch={self.config.max_batch}")

    def _ckeys(self, client: ClientView, keys: list[bytes]) -> list[bytes]:
        self._check_batch_len(keys)
        if keys is not self._owned_keys and self.shard_count > 1:
            seed, n, idx = client.seed, self.shard_count, self.index
            crc = P.zlib.crc32
            for k in keys:
                if crc(k, seed) % n != idx:
                    raise StatusError(Status.INVALID_PARAMS, "key routed to the wrong shard")
        prefix = client.prefix
        return keys if prefix is None else [prefix + k for k in keys]

    # ------------------------------------------------------------- tenancy

    def _touch(self, client: ClientView, cks: Any, lookup: bool = True) -> None:
        """Uses of ``cks`` (the client's tenant's keys) in its tenant's eviction order;
        ``lookup``: a lookup or read, behind whose hits the client's next write lands."""
        pool = self.tenancy.pools.get(client.prefix or b"")
        if pool is not None:  # (none: the tenant has stored nothing here)
            pool.order.touch(cks, client.client_id if lookup else None)

    def _stored(self, client: ClientView, cks: Any) -> None:
        pool = self.tenancy.pools.get(client.prefix or b"")
        if pool is not None:
            pool.order.stored(cks, client.client_id)

    def _recount(self, ck: bytes, before: int) -> None:
        """The object of ``ck`` held ``before`` bytes; its replicas changed in place."""
        objects = self.objects
        if type(objects) is CountedObjects:
            objects.recount(ck, before)

    def _order_of_key(self, ck: bytes) -> Any:
        """The eviction order of a stored key's tenant, or None."""
        return self.tenancy.order(prefix_of(ck))

    def _pool_for_write(self, client: ClientView, nbytes: int, now: float
                        ) -> TenantPool | Status:
        """The writer's pool, once its tenant's quotas admit a new write of ``nbytes``
        (all its replicas): TENANT_QUOTA_EXCEEDED when they cannot (see
        kvmaster/_tenancy.py)."""
        prefix = client.prefix or b""
        pool = self.tenancy.pool(prefix)
        if pool is None:
            return Status.TENANT_QUOTA_EXCEEDED
        if prefix == self._quota_free:
            return pool
        qw = self._quota_writes
        if qw and self.tenant_writes.get(prefix, 0) >= qw:
            self.counters["tenant_quota_refusals"] += 1
            return Status.TENANT_QUOTA_EXCEEDED
        qb = self._quota_bytes
        if qb:
            over = self.tenant_bytes.get(prefix, 0) + nbytes - qb
            if over > 0:
                refused = self._quota_refused
                if refused is None or nbytes < refused:
                    self.eviction.evict(over, now, pool)
                if self.tenant_bytes.get(prefix, 0) + nbytes > qb:
                    self.counters["tenant_quota_refusals"] += 1
                    if refused is not None and nbytes < refused:
                        self._quota_refused = nbytes
                    return Status.TENANT_QUOTA_EXCEEDED
        return pool

    def _quota_admits(self, prefix: bytes, cks: list[bytes], sizes: list[int]) -> bool:
        """Whether the tenant's quotas admit all of a batch's writes as they stand (no
        eviction needed); else each key takes the general path."""
        if prefix == self._quota_free:
            return True
        qw, qb = self._quota_writes, self._quota_bytes
        if qw and self.tenant_writes.get(prefix, 0) + len(sizes) > qw:
            return False
        return not qb or (self.tenant_bytes.get(prefix, 0) + sum(sizes) + sum(map(len, cks))
                          + (ALIGN + OBJECT_OVERHEAD) * len(sizes) <= qb)

    # ---------------------------------------------------------------- writes

    def _tombstone(self, ck: bytes, pw: ObjectMeta, segment: str | None) -> None:
        """Remember ``pw``, the write of ``ck``, as dropped before its end (with the
        unmounted ``segment`` that held a replica of it, or None: released, or taken
        over after the discard timeout), until the release timeout, MAX_LOST_WRITES
        per shard (see :attr:`lost_writes`)."""
        tombstones = self.lost_writes
        tombstones.pop(ck, None)  # re-inserted last: the dict stays in deadline order
        tombstones[ck] = (pw.writer, segment,
                          _monotonic() + self.config.put_start_release_timeout, pw.write_id)
        if len(tombstones) > MAX_LOST_WRITES:
            del tombstones[next(iter(tombstones))]

    def client_gone(self, client_id: str) -> int:
        """The front forgot a client (BYE or expiry): forget the writes it ended here,
        drop its writes in progress and free their space and that of its given-up
        writes (:meth:`WriterRecords.drop_writes_of`), free its pending copies (see
        :meth:`KeepSetUpdates.client_gone` for the rest)."""
        self.recent_ends.pop(client_id, None)
        for order in self.tenancy.orders():
            order.forget_writer(client_id)
        self.replicas.drop_copies_of(client_id)
        self.writers.drop_writes_of(client_id)
        return self.sessions.updates.client_gone(client_id)

    def _note_end(self, client_id: str, write_id: int,
                  failed: dict[bytes, int] | None = None) -> None:
        """Remember that this shard ended ``client_id``'s write ``write_id``, with the
        keys of it whose end failed and their answers (``failed``: a batch's keys
        dropped before their end, or never started), so that an end sent again gets
        the same answers (bounded: RECENT_ENDS_PER_WRITER writes per writer,
        ``--max-clients`` writers, the oldest forgotten first)."""
        ends = self.recent_ends
        ids = ends.get(client_id)
        if ids is None:
            ids = ends[client_id] = {}
            if len(ends) > self.config.max_clients:
                ends.popitem(last=False)
        else:
            ends.move_to_end(client_id)
        if write_id in ids:
            if failed:
                known = ids[write_id]
                if known is None:
                    ids[write_id] = dict(failed)
                else:
                    known.update(failed)  # (at most the write's keys: max_batch)
            return
        ids[write_id] = failed or None
        if len(ids) > RECENT_ENDS_PER_WRITER:
            del ids[next(iter(ids))]

    # --------------------------------------------------- internal (from front)

    def mount_segment(self, name: str, owner: str, size: int,
                      tenant: str | None = P.DEFAULT_TENANT) -> int:
        """Take this shard's share of a new segment (:meth:`SegmentLifecycle.mount`)."""
        return self.segment_life.mount(name, owner, size, tenant, _monotonic)

    def unmount_segment(self, name: str) -> int:
        """Drop a segment (:meth:`SegmentLifecycle.unmount`); the number of objects erased."""
        return self.segment_life.unmount(name)

    def suspect_segments(self, names: list[str], on: bool) -> int:
        """Internal: the client owning segments ``names`` is suspected (``on``) or active
        again (see :meth:`kvmaster._eviction.Eviction.suspect`)."""
        return self.eviction.suspect(names, on)

    def segment_usage(self) -> dict[str, int]:
        """Bytes allocated in this shard's share of each segment."""
        return self.placement.usage()

    def tick(self) -> None:
        """Periodic housekeeping: deferred frees, released abandoned writes, watermark."""
        now = _monotonic()
        self.placement.release_deferred(now)
        limit = self.config.put_start_release_timeout
        stale = [ck for ck, pw in self.writes.items() if now - pw.started >= limit]
        for ck in stale:
            # Dropped: the key is free, its sessions go; its space stays allocated until
            # its writer ends or revokes it, or leaves (it may be stopped mid-copy).
            pw = self.writes.pop(ck)
            self.counters["put_start_released"] += 1
            self.sessions.unregister(ck, pw.sessions)
            self._tombstone(ck, pw, None)
            self.writers.strand(ck, pw, pw.replicas())
        tombstones = self.lost_writes
        while tombstones:
            ck = next(iter(tombstones))
            if tombstones[ck][2] > now:
                break
            del tombstones[ck]
        self.sessions.updates.expire_staged(now)
        self.replicas.expire_copies(now)
        adoption = self.adoption
        if adoption is not None and (now >= adoption.deadline or not adoption.by_segment):
            for name in adoption.expire():
                if self.log is not None:
                    self.log.unmounted(name)  # (its objects are gone here too)
            self.adoption = None
        self.eviction.check_watermark(now)

    def stats(self) -> dict[str, Any]:
        return self.inspection.stats(_monotonic())

    def check_consistency(self) -> list[str]:
        """Invariants for tests: allocator accounting matches live replicas."""
        return self.inspection.check_consistency()


#: Most writes dropped before their end (lost with an unmounted segment, released, or
#: taken over after the discard timeout) that one shard remembers (for their PUT_END's
#: answer); the oldest are forgotten first.
MAX_LOST_WRITES = 65536
#: Write ids one shard remembers per writer as ended (ShardActor.recent_ends, for at
#: most ``--max-clients`` writers): an end sent again after them is answered as for a
#: write never ended (OBJECT_NOT_FOUND) once its object has gone.
RECENT_ENDS_PER_WRITER = 32
SERVICE_BOUNDS_US = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 100000)
QUEUE_BOUNDS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384)
_perf = time.perf_counter


_BUCKET_NAMES = {
    prefix: [f"{prefix}{b}" for b in bounds] + [f"{prefix}inf"]
    for prefix, bounds in (("service_us.", SERVICE_BOUNDS_US), ("queue_depth.", QUEUE_BOUNDS))
}


def _bucket(prefix: str, bounds: tuple[int, ...], v: float) -> str:
    """Counter name of the histogram bucket holding ``v`` (first bound >= v)."""
    return _BUCKET_NAMES[prefix][bisect_left(bounds, v)]


def _op_counter_names(op: Op) -> tuple[str, ...]:
    base = f"op.{op.name.lower()}."
    if op.name.startswith("BATCH_"):
        return (base + "requests", base + "failures", base + "items", base + "failed_items",
                base + "partial_successes")
    return (base + "requests", base + "failures", "", "", "")


_OP_COUNTERS = {op.value: _op_counter_names(op) for op in Op if op not in P.MASTER_OPS}
_UNKNOWN_OP_COUNTERS = ("op.unknown.requests", "op.unknown.failures", "", "", "")


_COUNTER_NAMES = (
    "requests", "failures", "evicted_keys", "evicted_bytes", "evicted_soft_pinned_keys",
    "eviction_rounds", "eviction_attempts", "put_start_discarded", "put_start_released",
    "alloc_failures", "leases_granted", "objects_erased_with_segment",
    "tenant_quota_refusals",
    "writes_dropped_with_segment", "writes_dropped_with_writer",
    "stranded_writes_freed_with_writer", "write_limit_rejections",
    "get_hit_keys", "get_miss_keys", "exist_hit_keys", "exist_miss_keys",
    "eviction_examined_keys", "session_tagged_writes", "alloc_held_by_oplog",
    "starts_parked_for_oplog",
    *(name for names in (*_OP_COUNTERS.values(), _UNKNOWN_OP_COUNTERS) for name in names if name),
    *(f"service_us.{b}" for b in (*SERVICE_BOUNDS_US, "inf", "sum")),
    *(f"queue_depth.{b}" for b in (*QUEUE_BOUNDS, "inf", "sum")),
)
"""The counters every shard starts with (its components add their own)."""


def _handlers(shard: ShardActor) -> dict[bytes, Callable[[ClientView, Any, float], Any]]:
    """Each op a shard serves -> the handler of the component that owns its state."""
    reads, starts, ends, removals = shard.reads, shard.starts, shard.ends, shard.removals
    sessions, tagged, replicas = shard.sessions, shard.tagged, shard.replicas
    return {
        Op.EXIST_KEY.value: reads.handle_exist_key,
        Op.BATCH_EXIST_KEY.value: reads.handle_batch_exist_key,
        Op.GET_REPLICA_LIST.value: reads.handle_get_replica_list,
        Op.BATCH_GET_REPLICA_LIST.value: reads.handle_batch_get_replica_list,
        Op.PUT_START.value: starts.handle_put_start,
        Op.BATCH_PUT_START.value: starts.handle_batch_put_start,
        Op.UPSERT_START.value: starts.handle_upsert_start,
        Op.BATCH_UPSERT_START.value: starts.handle_batch_upsert_start,
        Op.PUT_END.value: ends.handle_put_end,
        Op.BATCH_PUT_END.value: ends.handle_batch_put_end,
        Op.PUT_REVOKE.value: ends.handle_put_revoke,
        Op.BATCH_PUT_REVOKE.value: ends.handle_batch_put_revoke,
        Op.REMOVE.value: removals.handle_remove,
        Op.BATCH_REMOVE.value: removals.handle_batch_remove,
        Op.REMOVE_ALL.value: removals.handle_remove_all,
        Op.REMOVE_BY_REGEX.value: removals.handle_remove_by_regex,
        Op.GET_SIZE.value: reads.handle_get_size,
        Op.QUERY_KEY.value: reads.handle_query_key,
        Op.REPLICA_CLEAR.value: replicas.handle_replica_clear,
        Op.DROP_CORRUPT_REPLICAS.value: replicas.handle_drop_corrupt_replicas,
        Op.BATCH_PROBE_KEY.value: replicas.handle_batch_probe_key,
        Op.COPY_REPLICAS_PREPARE.value: replicas.handle_copy_replicas_prepare,
        Op.COPY_REPLICAS_COMMIT.value: replicas.handle_copy_replicas_commit,
        Op.SET_SEGMENT_LABEL.value: replicas.handle_set_segment_label,
        Op.SEGMENT_LABELS.value: replicas.handle_segment_labels,
        Op.ATTACH_KV_SESSION.value: sessions.handle_attach_kv_session,
        Op.SET_KV_SESSION_PIN.value: sessions.handle_set_kv_session_pin,
        Op.UPDATE_KV_SESSION.value: sessions.updates.handle_update_kv_session,
        Op.CLOSE_KV_SESSION.value: sessions.handle_close_kv_session,
        Op.GET_KV_SESSION.value: sessions.handle_get_kv_session,
        Op.LIST_KV_SESSION_KEYS.value: sessions.handle_list_kv_session_keys,
        Op.PUT_START_WITH_KV_SESSIONS.value: tagged.handle_put_start_with_kv_sessions,
        Op.BATCH_PUT_START_WITH_KV_SESSIONS.value:
            tagged.handle_batch_put_start_with_kv_sessions,
        Op.UPSERT_START_WITH_KV_SESSIONS.value: tagged.handle_upsert_start_with_kv_sessions,
        Op.BATCH_UPSERT_START_WITH_KV_SESSIONS.value:
            tagged.handle_batch_upsert_start_with_kv_sessions,
    }


def _messages(shard: ShardActor) -> dict[str, Callable[..., Any]]:
    """The internal messages a shard takes (:meth:`ShardActor.post`), by name: the one
    list of them; any other name is refused (logged, and its future, if any, fails)."""
    sessions, walks, groups = shard.sessions, shard.walks, shard.groups
    return {
        # From the front.
        "mount_segment": shard.mount_segment,
        "unmount_segment": shard.unmount_segment,
        "suspect_segments": shard.suspect_segments,
        "client_gone": shard.client_gone,
        "tick": shard.tick,
        "stats": shard.stats,
        "segment_usage": shard.segment_usage,
        "check_consistency": shard.check_consistency,
        "session_view": sessions.view,
        "group_view": groups.view,
        # From other shards: walk steps, their answers, and broadcasts.
        "walk_reply": walks.reply,
        "batch_part": shard.any_shard_batches.part,
        "attach_local": sessions.attach_local,
        "detach_local": sessions.detach_local,
        "set_pin_local": sessions.set_pin_local,
        "add_members": sessions.add_members,
        "members_removed": sessions.members_removed,
        "group_join": groups.join,
        "group_lease": groups.lease,
        "group_lease_local": groups.lease_local,
        "group_evicted": groups.evicted,
        "group_evict_local": groups.evict_local,
    }

_COLUMN_OPS = P.COLUMN_OPS
_GET_OP = Op.BATCH_GET_REPLICA_LIST.value
_ZERO_GT = (0).__gt__  # f -> 0 > f: counts the negative statuses of a column


def _count_items(c: dict[str, Any], names: tuple[str, ...], body: Any) -> None:
    """Batch item counters: items, failed items (negative codes), partial successes.
    ``body``: the per-key list, or the columnar tuple (its ``first`` column)."""
    if type(body) is tuple:
        first = body[1]
        n = len(first)
        failed = sum(map(_ZERO_GT, first))
    elif type(body) is list:
        n = len(body)
        # All 0 (every key done: the common case) is counted in C; otherwise per item
        # (an int, a Status, or a per-key start's replica list).
        zeros = body.count(0)
        # All 0 or 1 (a batch exist) too.
        failed = 0 if zeros == n or zeros + body.count(1) == n else sum(
            1 for r in body if type(r) is not list and r < 0)
    else:
        return
    c[names[2]] += n
    c[names[3]] += failed
    if 0 < failed < n:
        c[names[4]] += 1


def _reply_form(op: bytes, body: Any, columns: bool) -> Any:
    """The body of a COLUMN_OPS reply in the form the request asked for: columnar
    (``columns`` true) or per key.  Handlers answer either form: the fast paths the
    columnar tuple, the session-tagged starts and merged any-shard batches per key."""
    if type(body) is tuple:
        return body if columns else P.replica_items(body, op == _GET_OP)
    if columns and type(body) is list:
        return P.replica_columns(body, op == _GET_OP)
    return body
