"""Key groups: Mooncake's ``ReplicateConfig.group_ids`` on a sharded master.

Behaviour follows Mooncake's ``MasterService`` (mooncake-store/src/master_service.cpp:
``RegisterGroupMember`` / ``UnregisterGroupMember``, ``GrantLeaseForGroup``, and the
group branch of eviction, ``try_evict_group_or_object``): a key written with a
non-empty group id joins that group; a read lease granted to one member is granted
to the whole group, coalesced (not once per member read); eviction takes a group as a
whole and skips it while a lease granted to it is active.  Engines group the parts of
one KV page (K and V, or per-layer parts) so that they are kept or dropped together.

Sharding.  A group lives on its *home* shard, ``owner_of(ref)`` of its ref
``NUL || tenant-scoped group id`` (so a group of one tenant never meets another
tenant's), as a :class:`GroupRecord` holding the member keys (stored form).  Each
member object carries the group's ref among its ``ObjectMeta.sessions`` refs: a NUL
first byte tells it from a session id (stored session ids never start with NUL), so
every path that drops an object (removal, eviction, a lost segment, a revoked or
refused write) already tells the home through :meth:`SessionMixin._unregister`, and
the home's ``members_removed`` hands group refs to :meth:`GroupMixin._group_left`.

Messages (all internal, best effort, never waited on except the join):

* join: a grouped batch start admits its writes, then walks to the homes
  (``group_join``) and answers when they have; a key over a bound is refused
  GROUP_LIMIT_EXCEEDED and its write undone.
* lease: a member shard that grants a lease to a grouped object tells the home
  (``group_lease``) at most once per lease period per group; the home, at most once
  per lease period too, leases every member on its shard (``group_lease_local``).
* eviction: a member evicted by pressure is reported to the home (``group_evicted``,
  after the shard's removal notices), which asks the other members' shards to evict
  them (``group_evict_local``, pages of at most :data:`MAX_GROUP_MEMBERS` keys), unless
  the group's lease is active; those shards take only members that ordinary eviction
  could take (not hard-pinned, not leased, soft-pinned ones only with
  ``--allow-evict-soft-pinned-objects``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvmaster._sessions import add_ref, drop_ref, iter_sessions, owner_of
from kvmaster._records import DEFERRED, HARD_PIN, FreeRuns, StatusError
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster._records import ClientView, ObjectMeta
    from kvmaster._shard import ShardActor

#: First byte of a group's ref in ``ObjectMeta.sessions`` (never a session id's).
GROUP_MARK = b"\x00"
#: Most members of one group (Mooncake has no bound; kvmaster bounds every record).
MAX_GROUP_MEMBERS = 256
#: Most groups a shard remembers having told a home about (coalescing leases).
LEASE_MEMO_MAX = 65536


def group_refs(refs: Any) -> list[bytes]:
    """The group refs among an object's session refs."""
    return [r for r in iter_sessions(refs) if r[:1] == GROUP_MARK]


class GroupRecord:
    """A group on its home shard: member keys and its lease state."""

    __slots__ = ("members", "lease_sent", "leased_until")

    def __init__(self) -> None:
        self.members: set[bytes] = set()
        self.lease_sent = -1e18  # when the home last leased the members
        self.leased_until = 0.0  # monotonic deadline of that lease


class GroupMixin:
    """Group handlers of :class:`~kvmaster._shard.ShardActor`."""

    def _init_groups(self: ShardActor) -> None:
        self.groups: dict[bytes, GroupRecord] = {}
        #: Set once this shard meets a group (a grouped write or a group lease): until
        #: then the read and eviction paths skip every group step.
        self._has_groups = False
        #: Group ref -> when this shard last told the home about a lease of a member.
        self._group_lease_sent: dict[bytes, float] = {}
        #: Home -> (group ref, key) of members evicted by pressure, sent after the
        #: message that evicted them (behind the removal notices).
        self._group_evicted_out: dict[int, list[tuple[bytes, bytes]]] = {}
        self._max_groups = getattr(self.config, "max_groups_per_shard", 65536)
        for name in ("groups_created", "groups_deleted", "group_members_added",
                     "group_members_removed", "group_limit_rejections", "group_evicted_keys",
                     "group_evictions_skipped_leased", "group_lease_messages"):
            self.counters[name] = 0

    # ------------------------------------------------------------ key side

    def _grouped_start(self: ShardActor, client: ClientView, msg: Any, now: float,
                       upsert: bool) -> Any:
        """A batch start with ``group_ids``: admit the writes, join the groups at
        their homes, then answer (per key: replicas or a status)."""
        keys, gids = msg.keys, msg.group_ids
        if len(gids) != len(keys):
            raise StatusError(Status.INVALID_PARAMS, "group_ids and keys differ in length "
                              "(a batch with group_ids is sent to each key's shard)")
        if len(keys) != len(msg.sizes):
            raise StatusError(Status.INVALID_PARAMS, "keys and sizes differ in length")
        cks = self._ckeys(client, keys)
        if any(gids):
            self._check_walk_room()
            self._has_groups = True
        prefix = client.prefix
        config, write_id = msg.config, msg.write_id
        tags = msg.session_tags or [None] * len(cks)
        results: list[Any] = [self._start_one(client, ck, size, config, now, upsert, write_id,
                                              tag)
                              for ck, size, tag in zip(cks, msg.sizes, tags)]
        n = self.shard_count
        admitted: dict[int, tuple[ObjectMeta, bytes]] = {}
        by_home: dict[int, list[int]] = {}
        for i, (ck, r, g) in enumerate(zip(cks, results, gids)):
            if not g or type(r) is not list:
                continue
            pw = self.writes[ck]
            ref = GROUP_MARK + (g if prefix is None else prefix + g)
            pw.sessions = self._with_group(ck, pw.sessions, ref)
            pw.settled = False  # answered (or refused) when joined
            admitted[i] = (pw, ref)
            by_home.setdefault(owner_of(ref, n), []).append(i)
        if not admitted:
            self._check_watermark(now)
            return results
        homes = list(by_home)
        requests = [(h, "group_join", ([(admitted[i][1], cks[i]) for i in by_home[h]],))
                    for h in homes]
        reply = self._deferred_reply()

        def done(answers: dict[int, list[Any]]) -> None:
            for pos, h in enumerate(homes):
                for i, code in zip(by_home[h], answers[pos]):
                    ck = cks[i]
                    pw, ref = admitted[i]
                    if self._dropped_meanwhile(ck, pw):
                        # (Its segment went: the drop told the home already.)
                        results[i] = Status.SEGMENT_NOT_FOUND
                    elif code != 0:
                        self._reject_write(client, ck, results[i])  # (leaves the group too)
                        results[i] = code
                    else:
                        pw.settled = True
            self._flush_removed()
            self._check_watermark(time.monotonic())
            reply(results)

        self._walk(requests, done)
        return DEFERRED

    def _with_group(self: ShardActor, ck: bytes, refs: Any, ref: bytes) -> Any:
        """``refs`` with ``ref`` as its only group ref (another one, carried from an
        abandoned write, leaves its group)."""
        for old in group_refs(refs):
            if old != ref:
                refs = drop_ref(refs, old)
                self._unregister(ck, old)
        return add_ref(refs, ref)

    def _group_carry(self: ShardActor, ck: bytes, own: Any, merged: Any) -> Any:
        """An upsert ends: the replaced object's groups that are not the new write's
        (``own``, its refs) are left; ``merged`` is the stored object's refs."""
        keep = group_refs(own)
        for ref in group_refs(merged):
            if ref not in keep:
                merged = drop_ref(merged, ref)
                self._unregister(ck, ref)
        return merged

    def _group_victim(self: ShardActor, ck: bytes, refs: Any) -> None:
        """Pressure evicted ``ck``: its groups' homes evict the other members."""
        n = self.shard_count
        out = self._group_evicted_out
        for ref in group_refs(refs):
            out.setdefault(owner_of(ref, n), []).append((ref, ck))

    def _flush_group_evictions(self: ShardActor) -> None:
        out = self._group_evicted_out
        if out:
            self._group_evicted_out = {}
            for home, pairs in out.items():
                self.peers[home].post("group_evicted", (pairs,))

    def _group_leased(self: ShardActor, objs: Iterable[ObjectMeta | None], now: float) -> None:
        """Leases were granted to ``objs``: tell the homes of their groups, at most once
        per lease period per group."""
        sent = self._group_lease_sent
        period = self._lease_s
        n = self.shard_count
        out: dict[int, list[bytes]] = {}
        for obj in objs:
            if obj is None or obj.sessions is None:
                continue
            for ref in iter_sessions(obj.sessions):
                if ref[:1] != GROUP_MARK:
                    continue
                last = sent.get(ref)
                if last is not None and now - last < period:
                    continue
                sent[ref] = now
                out.setdefault(owner_of(ref, n), []).append(ref)
        if not out:
            return
        if len(sent) > LEASE_MEMO_MAX:
            for ref in [r for r, t in sent.items() if now - t >= period]:
                del sent[ref]
            if len(sent) > LEASE_MEMO_MAX:
                sent.clear()
        for home, refs in out.items():
            self.counters["group_lease_messages"] += 1
            self.peers[home].post("group_lease", (refs,))

    def group_lease_local(self: ShardActor, cks: list[bytes]) -> None:
        """Internal: the home leases these members (a lease of another member)."""
        self._has_groups = True
        deadline = time.monotonic() + self._lease_s
        get = self.objects.get
        for ck in cks:
            obj = get(ck)
            if obj is not None and obj.lease < deadline:
                obj.lease = deadline

    def group_evict_local(self: ShardActor, cks: list[bytes]) -> None:
        """Internal: another member of these keys' group was evicted; evict those that
        ordinary eviction could take now."""
        now = time.monotonic()
        allow_soft = self.config.allow_evict_soft_pinned_objects
        objects = self.objects
        c = self.counters
        runs = FreeRuns(self)
        try:
            for ck in cks:
                obj = objects.get(ck)
                if obj is None or obj.flags & HARD_PIN or obj.lease > now:
                    continue
                if not allow_soft and self._is_soft_pinned(obj, now):
                    continue
                if self.tenancy.suspected and self._kept_for_suspect(obj):
                    continue  # (its client is suspected: kept for it, as _evict keeps it)
                del objects[ck]
                if obj.more is None:
                    runs.add(obj.seg, obj.off, obj.size, 0.0)
                else:
                    self._free_object(obj, now)
                self._unregister(ck, obj.sessions)
                c["evicted_keys"] += 1
                c["evicted_bytes"] += obj.size
                c["group_evicted_keys"] += 1
        finally:
            runs.flush()

    # ----------------------------------------------------------- home side

    def group_join(self: ShardActor, pairs: list[tuple[bytes, bytes]], reply_shard: int,
                   wid: int, pos: int) -> None:
        """Internal: writes of these (group ref, key) pairs were admitted -> per pair 0
        or GROUP_LIMIT_EXCEEDED."""
        groups = self.groups
        c = self.counters
        out: list[int] = []
        for ref, ck in pairs:
            rec = groups.get(ref)
            if rec is None:
                if len(groups) >= self._max_groups:
                    c["group_limit_rejections"] += 1
                    out.append(Status.GROUP_LIMIT_EXCEEDED)
                    continue
                rec = groups[ref] = GroupRecord()
                c["groups_created"] += 1
            members = rec.members
            if ck not in members:
                if len(members) >= MAX_GROUP_MEMBERS:
                    c["group_limit_rejections"] += 1
                    out.append(Status.GROUP_LIMIT_EXCEEDED)
                    continue
                members.add(ck)
                c["group_members_added"] += 1
            out.append(0)
        self._answer_walk(reply_shard, wid, pos, out)

    def _group_left(self: ShardActor, ref: bytes, ck: bytes) -> None:
        """A member's object (or write) went away: it leaves; an empty group is dropped."""
        rec = self.groups.get(ref)
        if rec is None or ck not in rec.members:
            return
        rec.members.discard(ck)
        self.counters["group_members_removed"] += 1
        if not rec.members:
            del self.groups[ref]
            self.counters["groups_deleted"] += 1

    def _group_pages(self: ShardActor, members: Iterable[bytes]) -> dict[int, list[bytes]]:
        n = self.shard_count
        by_shard: dict[int, list[bytes]] = {}
        for ck in members:
            by_shard.setdefault(owner_of(ck, n), []).append(ck)
        return by_shard

    def group_lease(self: ShardActor, refs: list[bytes]) -> None:
        """Internal: a member of each group was leased; lease them all (at most once
        per lease period per group)."""
        now = time.monotonic()
        period = self._lease_s
        pages: dict[int, list[bytes]] = {}
        for ref in refs:
            rec = self.groups.get(ref)
            # (A tenth of slack: a member shard's next notice, sent a period after its
            # last, must not be skipped because this one arrived a little later.)
            if rec is None or now - rec.lease_sent < 0.9 * period:
                continue
            rec.lease_sent = now
            rec.leased_until = now + period
            for s, cks in self._group_pages(rec.members).items():
                pages.setdefault(s, []).extend(cks)
        for s, cks in pages.items():
            for i in range(0, len(cks), MAX_GROUP_MEMBERS):
                self.peers[s].post("group_lease_local", (cks[i:i + MAX_GROUP_MEMBERS],))

    def group_evicted(self: ShardActor, pairs: list[tuple[bytes, bytes]]) -> None:
        """Internal: these members were evicted by pressure; evict the rest of their
        groups, unless a group's lease is active."""
        now = time.monotonic()
        for ref, ck in pairs:
            rec = self.groups.get(ref)
            if rec is None:
                continue
            if rec.leased_until > now:
                self.counters["group_evictions_skipped_leased"] += 1
                continue
            for s, cks in self._group_pages(m for m in rec.members if m != ck).items():
                for i in range(0, len(cks), MAX_GROUP_MEMBERS):
                    self.peers[s].post("group_evict_local", (cks[i:i + MAX_GROUP_MEMBERS],))

    # ---------------------------------------------------------- inspection

    def group_view(self: ShardActor) -> dict[bytes, set[bytes]]:
        """For tests and checks: the groups whose home is this shard -> members."""
        return {ref: set(rec.members) for ref, rec in self.groups.items()}
