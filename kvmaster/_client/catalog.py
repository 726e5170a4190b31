"""The operations that move no object bytes through the caller: existence and
size queries, replica management, removal, sessions and the admin calls
(:class:`CatalogOps`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.reads import ReadOps
from kvmaster._client.records import (
    UPDATE_RESTARTS,
    CopyPlan,
    KvSessionInfo,
    KvSessionPage,
    NoWait,
    OpGen,
    Request,
    _b,
    _monotonic,
    operation,
)
from kvmaster._fence import WriteFence
from kvmaster.protocol import Op


class CatalogOps(ReadOps):
    """Queries, replica management, removal, KV sessions and admin."""

    # -------------------------------------------------------------- queries

    def _single(self, op: Op, key: str, *fields: Any) -> OpGen:
        bkey = _b(key)
        (body,) = yield [(op.value, self._route(bkey), [bkey, *fields])]
        return body

    @operation
    def is_exist(self, key: str) -> OpGen[bool]:
        """Whether the object exists and is readable.  Refreshes recency; no lease."""
        return bool((yield from self._single(Op.EXIST_KEY, key)))

    @operation
    def batch_is_exist(self, keys: Sequence[str]) -> OpGen[list[int]]:
        """1 / 0 / negative status per position."""
        return (yield from self._batch(Op.BATCH_EXIST_KEY, keys))

    @operation
    def get_size(self, key: str) -> OpGen[int]:
        """Size in bytes.  Raises ObjectNotFound."""
        return (yield from self._single(Op.GET_SIZE, key))

    @operation
    def query_key(self, key: str) -> OpGen[dict[str, Any]]:
        """Replicas, lease, pins and sessions of one object, without touching it."""
        return (yield from self._single(Op.QUERY_KEY, key))

    # ------------------------------------------------- replica management

    @operation
    def probe_key(self, key: str) -> OpGen[bool]:
        """Whether the object exists at this instant: no lease, no LRU touch (Mooncake
        ``ProbeKey``): it may be evicted before a later get."""
        return bool((yield from self._batch(Op.BATCH_PROBE_KEY, [key]))[0])

    @operation
    def batch_probe_key(self, keys: Sequence[str]) -> OpGen[list[int]]:
        """1 / 0 per position, as :meth:`probe_key`."""
        return (yield from self._batch(Op.BATCH_PROBE_KEY, keys))

    @operation
    def replica_list(self, key: str) -> OpGen[tuple[int, list[list[Any]]]]:
        """-> ``(size, [[segment, offset], ...])`` of the object, with a read lease
        (Mooncake ``Client::Query``).  Raises ObjectNotFound."""
        size, replicas, _, _ = yield from self._desc(key)
        return size, replicas

    @operation
    def batch_replica_list(self, keys: Sequence[str]) -> OpGen[list[Any]]:
        """Per position ``(size, replicas)``, or None where the object is missing; each
        found object is leased (Mooncake ``Client::BatchQuery``)."""
        (names, first, offsets, further, sizes, _), _ = yield from self._descs(keys)
        return [None if f < 0 else (size, [[names[f], off], *further.get(pos, ())])
                for pos, (f, off, size) in enumerate(zip(first, offsets, sizes))]

    @operation
    def replica_clear(self, keys: Sequence[str], segment: str = "") -> OpGen[list[str]]:
        """Clear replicas of this client's own objects whose read lease has run out
        (Mooncake ``MasterService::BatchReplicaClear``): every replica (``segment``
        "": the object goes), or only those on ``segment`` (a segment's name or label;
        the object goes with its last replica).  Returns the keys cleared, in request
        order, each once; missing keys, other clients' objects, leased objects and
        objects without a replica on ``segment`` are skipped.  At most ``max_batch``
        keys (InvalidParams)."""
        bkeys, groups = self._group(keys)
        if not bkeys:
            return []
        shards = list(groups)
        bodies = yield [(Op.REPLICA_CLEAR.value, P.route_for_shard(s),
                         [[bkeys[i] for i in groups[s]], segment]) for s in shards]
        cleared = {k for body in bodies for k in body}
        out: list[str] = []
        for k, b in zip(keys, bkeys):
            if b in cleared:
                cleared.discard(b)
                out.append(k)
        return out

    @operation
    def label_segment(self, label: str) -> OpGen[None]:
        """Give this client's segment a second name (Mooncake's segment name, the
        client's ``local_hostname``) that placement (``preferred_segments``), replica
        clears, copies and moves accept; "" removes it.  Raises InvalidParams without a
        segment, SegmentAlreadyExists when another mounted segment has that name.  The
        label goes with the segment (unmount, expiry)."""
        seg = self._segment
        if seg is None:
            raise E.InvalidParams("this client contributes no segment to label",
                                  op="SET_SEGMENT_LABEL")
        yield self._label_requests(seg.name, label)
        self._segment_label = label
        return None

    #: The label :meth:`label_segment` gave this client's segment: given again to the
    #: segment each later mount makes (a re-handshake after expiry, a new master).
    _segment_label = ""

    def _label_requests(self, name: str, label: str) -> list[Request]:
        n = self._welcome().shard_count
        return self._fan(Op.SET_SEGMENT_LABEL, {s: [name, label] for s in range(n)})

    @operation
    def segment_labels(self) -> OpGen[dict[str, str]]:
        """Segment name -> label, for the mounted segments that have one."""
        (body,) = yield [(Op.SEGMENT_LABELS.value, P.route_for_shard(0), [])]
        return dict(body)

    @operation
    def copy_prepare(self, key: str, targets: Sequence[str], source: str = "") -> OpGen[CopyPlan]:
        """First half of a copy: see :meth:`_copy_prepare`."""
        return (yield from self._copy_prepare(key, targets, source))

    @operation
    def copy_finish(self, plan: CopyPlan) -> OpGen[None]:
        """Second half of a copy: see :meth:`_copy_finish`."""
        return (yield from self._copy_finish(plan))

    def _copy_prepare(self, key: str, targets: Sequence[str], source: str = "") -> OpGen:
        """First half of a copy (or, with ``source``, a move) of ``key``'s replica to
        ``targets`` (segment names or labels): the master allocates a range on each
        target without a replica and leases the object.  Returns a :class:`CopyPlan`
        for :meth:`copy_finish`.  Raises ObjectNotFound, InvalidParams (unknown
        segments; a move's source without a replica, or equal to its target),
        NoAvailableHandle."""
        bkey = _b(key)
        t0 = _monotonic()
        (body,) = yield [(Op.COPY_REPLICAS_PREPARE.value, self._route(bkey),
                          [bkey, list(targets), source])]
        size, lease_ms, sources, new, token = body
        return CopyPlan(key, size, sources, new, token, t0 + lease_ms / 1000.0,
                        WriteFence(self, t0, "copy_replicas"))

    def _copy_finish(self, plan: CopyPlan) -> OpGen:
        """Second half: copy the bytes into the plan's new ranges and commit them (a
        move's source replica then leaves the object).  On any failure the ranges are
        freed (commit ``done`` false) and the error raised; LeaseExpired when the copy
        outlived the object's lease (its source bytes could have been reused)."""
        bkey = _b(plan.key)
        route = self._route(bkey)
        try:
            if plan.new:
                yield from self._know([*plan.sources, *plan.new])
                data = self._read_bytes(plan.sources, plan.size)
                fence = plan.fence or WriteFence(self, _monotonic(), "copy_replicas")
                self._write(plan.new, (data,), fence, fence.limit())
                self._check_lease(plan.deadline, repr(plan.key))
        except GeneratorExit:
            raise
        except BaseException:
            yield NoWait([(Op.COPY_REPLICAS_COMMIT.value, route, [bkey, plan.token, False])])
            raise
        yield [(Op.COPY_REPLICAS_COMMIT.value, route, [bkey, plan.token, True])]
        return None

    @operation
    def copy_replicas(self, key: str, targets: Sequence[str]) -> OpGen[None]:
        """Copy ``key``'s object to every target segment that has no replica of it."""
        plan = yield from self._copy_prepare(key, targets)
        return (yield from self._copy_finish(plan))

    @operation
    def move_replica(self, key: str, source: str, target: str) -> OpGen[None]:
        """Move ``key``'s replica on segment ``source`` to segment ``target``."""
        plan = yield from self._copy_prepare(key, [target], source)
        return (yield from self._copy_finish(plan))

    # -------------------------------------------------------------- removal

    @operation
    def remove(self, key: str, force: bool = False) -> OpGen[None]:
        """Raises ObjectNotFound, ObjectHasLease (unless force)."""
        yield from self._single(Op.REMOVE, key, force)
        return None

    @operation
    def batch_remove(self, keys: Sequence[str], force: bool = False) -> OpGen[list[int]]:
        """One status per position."""
        return (yield from self._batch(Op.BATCH_REMOVE, keys, [force]))

    @operation
    def remove_all(self, force: bool = False) -> OpGen[int]:
        """Remove every removable object of this tenant; returns how many."""
        n = self._welcome().shard_count
        bodies = yield self._fan(Op.REMOVE_ALL, {s: [force] for s in range(n)})
        return sum(bodies)

    @operation
    def remove_by_regex(self, pattern: str, force: bool = False) -> OpGen[int]:
        """Remove every removable object of this tenant whose key the RE2 ``pattern``
        matches anywhere (a search; leased objects stay unless ``force``); returns how
        many.  Raises InvalidParams for a pattern RE2 refuses (backreferences,
        lookaround) or one over ``REGEX_MAX_CHARS``.  Mooncake ``RemoveByRegex``."""
        if not isinstance(pattern, str) or not pattern or len(pattern) > P.REGEX_MAX_CHARS:
            raise E.InvalidParams(f"pattern must be a str of 1..{P.REGEX_MAX_CHARS} chars")
        n = self._welcome().shard_count
        bodies = yield self._fan(Op.REMOVE_BY_REGEX, {s: [pattern, force] for s in range(n)})
        return sum(bodies)

    # ------------------------------------------------------------- sessions

    def _session(self, op: Op, session_id: str, *fields: Any) -> OpGen:
        sid = _b(session_id)
        (body,) = yield [(op.value, self._route(sid), [sid, *fields])]
        return body

    @operation
    def attach_kv_session(self, session_id: str, keys: Sequence[str]) -> OpGen[list[int]]:
        """Associate existing objects; per key 0, OBJECT_NOT_FOUND (-704) or
        SESSION_LIMIT_EXCEEDED (-1802).  Creates the session on its first association.
        At most ``kv_session_max_batch`` keys (InvalidParams otherwise)."""
        return (yield from self._session(Op.ATTACH_KV_SESSION, session_id, [_b(k) for k in keys]))

    @operation
    def pin_kv_session(self, session_id: str) -> OpGen[None]:
        """Give current and future members soft-pin priority (no TTL).
        Raises SessionNotFound for an unknown session."""
        yield from self._session(Op.SET_KV_SESSION_PIN, session_id, True)
        return None

    @operation
    def unpin_kv_session(self, session_id: str) -> OpGen[None]:
        """Withdraw this session's pin; membership and other sessions' pins stay."""
        yield from self._session(Op.SET_KV_SESSION_PIN, session_id, False)
        return None

    @operation
    def update_kv_session(self, session_id: str, keep_keys: Iterable[str]) -> OpGen[int]:
        """Make membership its intersection with one complete keep set (sent in pages
        of ``max_batch`` keys when larger); deletes no data; a missing session is a
        no-op.  Returns the number of members removed.

        When the master discarded the pages sent so far (this client was expired, e.g.
        paused past ``client_ttl``, and re-handshook between two pages; a newer update
        of the same session by this client replaced them; or they outlived the
        master's ``--kv-session-update-staging-ttl``), the whole keep set is sent again
        from its first page under a new token, up to :data:`UPDATE_RESTARTS` times,
        all within the call's one deadline; then UpdateDiscarded is raised, with
        nothing changed.  Raises InvalidParams, changing nothing, for a keep set
        larger than the master's ``--kv-session-max-members``."""
        keep = list(dict.fromkeys(_b(k) for k in keep_keys))
        restarts = 0
        while True:
            page = self._welcome().max_batch  # a re-handshake may have changed it
            token = int.from_bytes(os.urandom(7), "big")
            out = 0
            try:
                for i in range(0, max(len(keep), 1), page):
                    out = yield from self._session(Op.UPDATE_KV_SESSION, session_id,
                                                   keep[i:i + page], token,
                                                   i + page >= len(keep), i // page)
            except E.UpdateDiscarded:
                if restarts >= UPDATE_RESTARTS:
                    raise
                restarts += 1
                continue
            return out

    @operation
    def close_kv_session(self, session_id: str) -> OpGen[None]:
        """Drop every association and the pin; cached data stays; idempotent."""
        yield from self._session(Op.CLOSE_KV_SESSION, session_id)
        return None

    @operation
    def get_kv_session(self, session_id: str) -> OpGen[KvSessionInfo]:
        """-> KvSessionInfo.  Raises SessionNotFound."""
        body = yield from self._session(Op.GET_KV_SESSION, session_id)
        return KvSessionInfo(session_id, body[1], body[2])

    @operation
    def list_kv_session_keys(self, session_id: str, cursor: str = "", limit: int = 1024) -> OpGen[KvSessionPage]:
        """One page of member keys after ``cursor`` (exclusive, lexical by UTF-8 bytes);
        weakly consistent; grants no lease.  ``limit`` at most 4096."""
        body = yield from self._session(Op.LIST_KV_SESSION_KEYS, session_id,
                                        _b(cursor) if cursor else b"", limit)
        return KvSessionPage([k.decode() for k in body[0]], body[1].decode())

    # ---------------------------------------------------------------- admin

    def _master(self, op: Op) -> OpGen:
        (body,) = yield [(op.value, P.MASTER_ROUTE, [])]
        return body

    @operation
    def check_consistency(self) -> OpGen[list[Any]]:
        """The master's invariant check (O(objects)); empty list when consistent."""
        return (yield from self._master(Op.CHECK_CONSISTENCY))

    @operation
    def list_clients(self) -> OpGen[list[Any]]:
        """Registered clients (this tenant's; every tenant's for the admin tenant)."""
        return (yield from self._master(Op.LIST_CLIENTS))

    @operation
    def list_segments(self) -> OpGen[list[Any]]:
        """Mounted segments with their size and allocated bytes."""
        return (yield from self._master(Op.LIST_SEGMENTS))

    @operation
    def get_config(self) -> OpGen[dict[str, Any]]:
        """The master's configuration (every flag's value)."""
        return (yield from self._master(Op.GET_CONFIG))

    @operation
    def stats(self) -> OpGen[dict[str, Any]]:
        """Master counters: ``total`` summed over shards (``keys``, ``evicted_keys``,
        ``evicted_bytes``, ...) merged at the top level, per-shard ``shards``,
        ``clients``, ``segments``."""
        s = yield from self._master(Op.STATS)
        return {**s["total"], **{k: v for k, v in s.items() if k != "total"}}
