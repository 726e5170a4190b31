"""Reads of one shard: EXIST_KEY, GET_REPLICA_LIST (single and batch), GET_SIZE and
QUERY_KEY, with the read leases they grant.

A hit is a use of its object in the tenant's eviction order (``ShardActor._touch``);
a lease is never shortened, and leasing a key group's member leases the whole group
(kvmaster/_groups.py).
"""

from __future__ import annotations

from itertools import compress
from typing import TYPE_CHECKING, Any

from kvmaster._groups import GROUP_MARK
from kvmaster._records import HARD_PIN, StatusError, iter_sessions
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvmaster._records import ClientView, ObjectMeta, SegmentShare
    from kvmaster._shard import ShardActor

__all__ = ["Reads", "segment_index"]


def segment_index(names: list[str], index: dict[str, int], name: str) -> int:
    """Index of segment ``name`` in a columnar reply's ``segments`` (``names``),
    appended on first use; ``index`` maps names to their positions."""
    i = index.get(name, -1)
    if i < 0:
        i = index[name] = len(names)
        names.append(name)
    return i


class Reads:
    """The read handlers of one shard (``ShardActor.reads``), run by its actor; the
    objects are the shard's.  ``lease_s``/``lease_ms``: the read lease
    (``--default-kv-lease-ttl``)."""

    __slots__ = ("config", "counters", "lease_ms", "lease_s", "shard")

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard
        self.config = shard.config
        self.counters = shard.counters
        self.lease_s = shard.config.default_kv_lease_ttl / 1000.0
        self.lease_ms = shard.config.default_kv_lease_ttl

    def handle_exist_key(self, client: ClientView, msg: Any, now: float) -> int:
        ck = self.shard._ckey(client, msg.key)
        obj = self.shard.objects.get(ck)
        if obj is None:
            self.counters["exist_miss_keys"] += 1
            return 0
        self.counters["exist_hit_keys"] += 1
        self.shard._touch(client, (ck,))
        if self.config.exist_grants_lease:
            self.lease(obj, now)
        return 1

    def handle_batch_exist_key(self, client: ClientView, msg: Any, now: float) -> list[int]:
        """1 or 0 per key, in order; every hit is touched (moved to the LRU's recent end)
        in key order, and leased when ``exist_grants_lease``.  The lookups and touches
        run as C-level maps: this is the hottest loop of a batch exist."""
        cks = self.shard._ckeys(client, msg.keys)
        objs = list(map(self.shard.objects.get, cks))
        n = len(objs)
        misses = objs.count(None)
        if not misses:
            out = [1] * n
            hit: Sequence[bytes] = cks
        elif misses == n:
            out = [0] * n
            hit = ()
        else:
            out = [0 if o is None else 1 for o in objs]
            hit = list(compress(cks, out))
        self.shard._touch(client, hit)
        if hit and self.config.exist_grants_lease:
            for obj in objs:
                if obj is not None:
                    self.lease(obj, now)
        self.counters["exist_hit_keys"] += n - misses
        self.counters["exist_miss_keys"] += misses
        return out

    def lease(self, obj: ObjectMeta, now: float) -> None:
        deadline = now + self.lease_s
        if deadline > obj.lease:
            obj.lease = deadline
        self.counters["leases_granted"] += 1
        if self.shard.groups.active and obj.sessions is not None:
            self.shard.groups.leased((obj,), now)  # (the whole group is leased)

    def handle_get_replica_list(self, client: ClientView, msg: Any, now: float) -> list[Any]:
        ck = self.shard._ckey(client, msg.key)
        obj = self.shard.objects.get(ck)
        if obj is None:
            self.counters["get_miss_keys"] += 1
            raise StatusError(Status.OBJECT_NOT_FOUND, "object not found")
        self.counters["get_hit_keys"] += 1
        self.shard._touch(client, (ck,))
        self.lease(obj, now)
        if msg.with_checksum:
            return [obj.size, self.lease_ms, obj.wire_replicas(), obj.checksum]
        return [obj.size, self.lease_ms, obj.wire_replicas()]

    def handle_batch_get_replica_list(self, client: ClientView, msg: Any, now: float) -> tuple:
        """Leases per key, as the columnar body (a tuple here; the actor sends the
        per-key form to a request without ``columns``), with the ``checksums`` column
        when the request asks for it (``with_checksum``)."""
        cks = self.shard._ckeys(client, msg.keys)
        get = self.shard.objects.get
        deadline = now + self.lease_s
        missing = Status.OBJECT_NOT_FOUND
        names: list[str] = []
        index: dict[str, int] = {}
        first: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        more: list[list[Any]] = []
        put_first, put_off, put_size = first.append, offsets.append, sizes.append
        last_seg: SegmentShare | None = None
        last_i = 0
        for pos, ck in enumerate(cks):
            obj = get(ck)
            if obj is None:
                put_first(missing)
                put_off(0)
                put_size(0)
                continue
            if deadline > obj.lease:  # leases are never shortened (see _lease)
                obj.lease = deadline
            seg = obj.seg
            if seg is not last_seg:
                last_i = segment_index(names, index, seg.name)
                last_seg = seg
            put_first(last_i)
            put_off(obj.off)
            put_size(obj.size)
            if obj.more is not None:
                more.append([pos, [[s.name, o] for s, o in obj.more]])
        hits = len(sizes) - sizes.count(0)  # (sizes are >= 1: 0 marks a miss)
        sums: list[int | None] | None = None
        if msg.with_checksum:  # (a second pass: the loop above stays as it was without them)
            sums = [None if obj is None else obj.checksum for obj in map(get, cks)]
        self.shard._touch(client, cks if hits == len(cks) else list(compress(cks, sizes)))
        if self.shard.groups.active and hits:
            self.shard.groups.leased(map(get, cks), now)  # (the whole group is leased)
        c = self.counters
        c["leases_granted"] += hits
        c["get_miss_keys"] += len(sizes) - hits
        c["get_hit_keys"] += hits
        if sums is not None:
            return (names, first, offsets, more, sizes, self.lease_ms if hits else 0, sums)
        return (names, first, offsets, more, sizes, self.lease_ms if hits else 0)

    def handle_get_size(self, client: ClientView, msg: Any, now: float) -> int:
        obj = self.shard.objects.get(self.shard._ckey(client, msg.key))
        if obj is None:
            raise StatusError(Status.OBJECT_NOT_FOUND, "object not found")
        return obj.size

    def handle_query_key(self, client: ClientView, msg: Any, now: float) -> dict[str, Any]:
        ck = self.shard._ckey(client, msg.key)
        obj = self.shard.objects.get(ck)
        pw = self.shard.writes.get(ck)
        if obj is None and pw is None:
            raise StatusError(Status.OBJECT_NOT_FOUND, "object not found")
        info: dict[str, Any] = {"state": "COMPLETE" if obj is not None else "PROCESSING"}
        if obj is not None:
            info.update(size=obj.size, replicas=obj.wire_replicas(),
                        lease_ms_left=max(0, int((obj.lease - now) * 1000)),
                        soft_pinned=self.shard.eviction.is_soft_pinned(obj, now),
                        hard_pinned=bool(obj.flags & HARD_PIN),
                        sessions=sorted(
                            sck if client.prefix is None else sck[len(client.prefix):]
                            for sck in iter_sessions(obj.sessions) if sck[:1] != GROUP_MARK))
            if obj.checksum is not None:
                info["checksum"] = obj.checksum
            tag = obj.tag
            if tag:
                info["session_tag"] = tag.decode("utf-8", "replace")
        if pw is not None:
            info["pending_write"] = {"client_id": pw.writer, "size": pw.size,
                                     "age_ms": int((now - pw.started) * 1000)}
        return info
