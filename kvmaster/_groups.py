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
refused write) already tells the home through :meth:`Sessions.unregister`, and
the home's ``members_removed`` hands group refs to :meth:`Groups.left`.

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


class Groups:
    """The key groups of one shard (``ShardActor.groups``): the groups homed here
    (``records``), the lease notices sent to homes, and the pressure-evicted members
    waiting to be reported; the actor dispatches the ``group_*`` messages here."""

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard
        #: Group ref -> the group homed here.
        self.records: dict[bytes, GroupRecord] = {}
        #: Set once this shard meets a group (a grouped write or a group lease): until
        #: then the read and eviction paths skip every group step.
        self.active = False
        #: Group ref -> when this shard last told the home about a lease of a member.
        self.lease_sent: dict[bytes, float] = {}
        #: Home -> (group ref, key) of members evicted by pressure, sent after the
        #: message that evicted them (behind the removal notices).
        self.evicted_out: dict[int, list[tuple[bytes, bytes]]] = {}
        self.max_groups = getattr(shard.config, "max_groups_per_shard", 65536)
        counters = shard.counters
        for name in ("groups_created", "groups_deleted", "group_members_added",
                     "group_members_removed", "group_limit_rejections", "group_evicted_keys",
                     "group_evictions_skipped_leased", "group_lease_messages"):
            counters[name] = 0

    # ------------------------------------------------------------ key side

    def start(self, client: ClientView, msg: Any, now: float, upsert: bool) -> Any:
        """A batch start with ``group_ids``: admit the writes, join the groups at
        their homes, then answer (per key: replicas or a status)."""
        shard = self.shard
        keys, gids = msg.keys, msg.group_ids
        if len(gids) != len(keys):
            raise StatusError(Status.INVALID_PARAMS, "group_ids and keys differ in length "
                              "(a batch with group_ids is sent to each key's shard)")
        if len(keys) != len(msg.sizes):
            raise StatusError(Status.INVALID_PARAMS, "keys and sizes differ in length")
        cks = shard._ckeys(client, keys)
        if any(gids):
            shard.walks.check_room()
            self.active = True
        prefix = client.prefix
        config, write_id = msg.config, msg.write_id
        tags = msg.session_tags or [None] * len(cks)
        start_one = shard.starts.start_one
        results: list[Any] = [start_one(client, ck, size, config, now, upsert, write_id, tag)
                              for ck, size, tag in zip(cks, msg.sizes, tags)]
        n = shard.shard_count
        admitted: dict[int, tuple[ObjectMeta, bytes]] = {}
        by_home: dict[int, list[int]] = {}
        for i, (ck, r, g) in enumerate(zip(cks, results, gids)):
            if not g or type(r) is not list:
                continue
            pw = shard.writes[ck]
            ref = GROUP_MARK + (g if prefix is None else prefix + g)
            pw.sessions = self._with_group(ck, pw.sessions, ref)
            pw.settled = False  # answered (or refused) when joined
            admitted[i] = (pw, ref)
            by_home.setdefault(owner_of(ref, n), []).append(i)
        if not admitted:
            shard.eviction.check_watermark(now)
            return results
        homes = list(by_home)
        requests = [(h, "group_join", ([(admitted[i][1], cks[i]) for i in by_home[h]],))
                    for h in homes]
        reply = shard._deferred_reply()

        def done(answers: dict[int, list[Any]]) -> None:
            for pos, h in enumerate(homes):
                for i, code in zip(by_home[h], answers[pos]):
                    ck = cks[i]
                    pw, ref = admitted[i]
                    if shard.writers.dropped_meanwhile(ck, pw):
                        # (Its segment went: the drop told the home already.)
                        results[i] = Status.SEGMENT_NOT_FOUND
                    elif code != 0:
                        shard.writers.reject_write(client, ck, results[i])  # (leaves the group too)
                        results[i] = code
                    else:
                        pw.settled = True
            shard.sessions.flush_removed()
            shard.eviction.check_watermark(time.monotonic())
            reply(results)

        shard.walks.start(requests, done)
        return DEFERRED

    def _with_group(self, ck: bytes, refs: Any, ref: bytes) -> Any:
        """``refs`` with ``ref`` as its only group ref (another one, carried from an
        abandoned write, leaves its group)."""
        for old in group_refs(refs):
            if old != ref:
                refs = drop_ref(refs, old)
                self.shard.sessions.unregister(ck, old)
        return add_ref(refs, ref)

    def carry(self, ck: bytes, own: Any, merged: Any) -> Any:
        """An upsert ends: the replaced object's groups that are not the new write's
        (``own``, its refs) are left; ``merged`` is the stored object's refs."""
        keep = group_refs(own)
        for ref in group_refs(merged):
            if ref not in keep:
                merged = drop_ref(merged, ref)
                self.shard.sessions.unregister(ck, ref)
        return merged

    def victim(self, ck: bytes, refs: Any) -> None:
        """Pressure evicted ``ck``: its groups' homes evict the other members."""
        n = self.shard.shard_count
        out = self.evicted_out
        for ref in group_refs(refs):
            out.setdefault(owner_of(ref, n), []).append((ref, ck))

    def flush_evictions(self) -> None:
        out = self.evicted_out
        if out:
            self.evicted_out = {}
            for home, pairs in out.items():
                self.shard.peers[home].post("group_evicted", (pairs,))

    def leased(self, objs: Iterable[ObjectMeta | None], now: float) -> None:
        """Leases were granted to ``objs``: tell the homes of their groups, at most once
        per lease period per group."""
        sent = self.lease_sent
        period = self.shard._lease_s
        n = self.shard.shard_count
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
            self.shard.counters["group_lease_messages"] += 1
            self.shard.peers[home].post("group_lease", (refs,))

    def lease_local(self, cks: list[bytes]) -> None:
        """Internal: the home leases these members (a lease of another member)."""
        self.active = True
        deadline = time.monotonic() + self.shard._lease_s
        get = self.shard.objects.get
        for ck in cks:
            obj = get(ck)
            if obj is not None and obj.lease < deadline:
                obj.lease = deadline

    def evict_local(self, cks: list[bytes]) -> None:
        """Internal: another member of these keys' group was evicted; evict those that
        ordinary eviction could take now."""
        now = time.monotonic()
        shard = self.shard
        allow_soft = shard.config.allow_evict_soft_pinned_objects
        objects = shard.objects
        c = shard.counters
        runs = FreeRuns(shard)
        try:
            for ck in cks:
                obj = objects.get(ck)
                if obj is None or obj.flags & HARD_PIN or obj.lease > now:
                    continue
                if not allow_soft and shard.eviction.is_soft_pinned(obj, now):
                    continue
                if shard.tenancy.suspected and shard.eviction.kept_for_suspect(obj):
                    continue  # (its client is suspected: kept for it, as _evict keeps it)
                del objects[ck]
                if obj.more is None:
                    runs.add(obj.seg, obj.off, obj.size, 0.0)
                else:
                    shard.placement.free_object(obj, now)
                shard.sessions.unregister(ck, obj.sessions)
                c["evicted_keys"] += 1
                c["evicted_bytes"] += obj.size
                c["group_evicted_keys"] += 1
        finally:
            runs.flush()

    # ----------------------------------------------------------- home side

    def join(self, pairs: list[tuple[bytes, bytes]], reply_shard: int,
                   wid: int, pos: int) -> None:
        """Internal: writes of these (group ref, key) pairs were admitted -> per pair 0
        or GROUP_LIMIT_EXCEEDED."""
        groups = self.records
        c = self.shard.counters
        out: list[int] = []
        for ref, ck in pairs:
            rec = groups.get(ref)
            if rec is None:
                if len(groups) >= self.max_groups:
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
        self.shard.walks.answer(reply_shard, wid, pos, out)

    def left(self, ref: bytes, ck: bytes) -> None:
        """A member's object (or write) went away: it leaves; an empty group is dropped."""
        rec = self.records.get(ref)
        if rec is None or ck not in rec.members:
            return
        rec.members.discard(ck)
        self.shard.counters["group_members_removed"] += 1
        if not rec.members:
            del self.records[ref]
            self.shard.counters["groups_deleted"] += 1

    def _pages(self, members: Iterable[bytes]) -> dict[int, list[bytes]]:
        n = self.shard.shard_count
        by_shard: dict[int, list[bytes]] = {}
        for ck in members:
            by_shard.setdefault(owner_of(ck, n), []).append(ck)
        return by_shard

    def lease(self, refs: list[bytes]) -> None:
        """Internal: a member of each group was leased; lease them all (at most once
        per lease period per group)."""
        now = time.monotonic()
        period = self.shard._lease_s
        pages: dict[int, list[bytes]] = {}
        for ref in refs:
            rec = self.records.get(ref)
            # (A tenth of slack: a member shard's next notice, sent a period after its
            # last, must not be skipped because this one arrived a little later.)
            if rec is None or now - rec.lease_sent < 0.9 * period:
                continue
            rec.lease_sent = now
            rec.leased_until = now + period
            for s, cks in self._pages(rec.members).items():
                pages.setdefault(s, []).extend(cks)
        for s, cks in pages.items():
            for i in range(0, len(cks), MAX_GROUP_MEMBERS):
                self.shard.peers[s].post("group_lease_local", (cks[i:i + MAX_GROUP_MEMBERS],))

    def evicted(self, pairs: list[tuple[bytes, bytes]]) -> None:
        """Internal: these members were evicted by pressure; evict the rest of their
        groups, unless a group's lease is active."""
        now = time.monotonic()
        for ref, ck in pairs:
            rec = self.records.get(ref)
            if rec is None:
                continue
            if rec.leased_until > now:
                self.shard.counters["group_evictions_skipped_leased"] += 1
                continue
            for s, cks in self._pages(m for m in rec.members if m != ck).items():
                for i in range(0, len(cks), MAX_GROUP_MEMBERS):
                    self.shard.peers[s].post("group_evict_local", (cks[i:i + MAX_GROUP_MEMBERS],))

    # ---------------------------------------------------------- inspection

    def view(self) -> dict[bytes, set[bytes]]:
        """For tests and checks: the groups whose home is this shard -> members."""
        return {ref: set(rec.members) for ref, rec in self.records.items()}
