"""KV sessions: many-to-many membership between session ids and object keys.

Behaviour follows Mooncake's session design (``docs/source/design/store/session-kv.md``,
RFC #4518): tag on write, attach, pin/unpin (soft-pin priority, no TTL),
update to a complete keep set, close, get, list with an exclusive lexical
cursor; last-member loss deletes the session and its pin.

Sharding.  A session lives on its *home* shard, ``crc32(tenant NUL session_id)
% shards`` (the same rule as keys), as a :class:`SessionRecord` holding the
sorted member keys and the pin flag.  Each object keeps the ids of its
sessions in ``ObjectMeta.sessions`` on the object's own shard.  Every shard
also holds a replica of the set of pinned session ids (``pinned_sessions``),
changed only by broadcasts from the home, so eviction decides an object's pin
state from local data without a round trip.

Cross-shard work (attach, update, close, pin, and the registration of tagged writes,
kvmaster/_tagged.py) is a *walk* (kvmaster/_walks.py): the initiating shard posts
messages to the other shards' inboxes and finishes when every answer has come back
through its own inbox.  No actor waits while holding another's state; each step is
one message handled to completion.  Messages between two actors arrive in the order sent, which keeps
registration and removal of one (session, key) pair ordered.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import TYPE_CHECKING, Any

from sortedcontainers import SortedList  # type: ignore[import-untyped]  # (ships no type hints)

from kvmaster import protocol as P
from kvmaster._records import (
    DEFERRED,
    StatusError,
    add_ref,
    drop_ref,
    has_ref,
    iter_sessions,
    ref_count,
)
from kvmaster._tenancy import prefix_of
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster._records import ClientView, Refs
    from kvmaster._shard import ShardActor

log = logging.getLogger(__name__)

DEFAULT_SEED = P.tenant_seed(P.DEFAULT_TENANT)
#: Most key bytes in one LIST_KV_SESSION_KEYS page (a page holds at least one key).
LIST_PAGE_BYTES = 64 << 10

#: Most update keep sets staged (across clients) on one shard.  An unfinished one is
#: kept for ``--kv-session-update-staging-ttl`` seconds after its last page.
MAX_STAGED_UPDATES = 64
#: Most discarded keep sets one shard remembers (to refuse their later pages).
MAX_DISCARDED_UPDATES = 4096


def owner_of(ckey: bytes, shard_count: int) -> int:
    """Shard of a stored key or session id (tenant prefix included, if any).

    ``crc32(tenant NUL key)``: the default tenant's ids are stored bare, so its
    prefix CRC is the starting value; prefixed ids already carry it.
    """
    return zlib.crc32(ckey, 0 if b"\x00" in ckey else DEFAULT_SEED) % shard_count


class SessionRecord:
    """A session on its home shard: sorted member keys (stored form) and the pin flag.

    ``provisional`` holds members an attach walk added before their shards answered;
    the walk takes them out again only if they are still provisional then (a tagged
    write or another attach confirming the member makes it permanent)."""

    __slots__ = ("members", "pinned", "provisional")

    def __init__(self) -> None:
        self.members: SortedList = SortedList()
        self.pinned = False
        self.provisional: set[bytes] = set()


class Sessions(Mapping[bytes, SessionRecord]):
    """The sessions of one shard, run by its actor (:class:`~kvmaster._shard.ShardActor`
    holds it in ``sessions`` and dispatches the session ops and messages to it).

    Owns the records of the sessions homed here (read as a mapping: session id ->
    :class:`SessionRecord`), the replica of the pinned session ids (``pinned``), the
    removal notices not yet sent (``removed_out``) and the UPDATE keep sets being
    staged (``updates``: :class:`KeepSetUpdates`).  Object-side refs live on the
    shard's objects (``ObjectMeta.sessions``); cross-shard steps go through the
    shard's walks."""

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard
        cfg = self.config = shard.config
        self.counters = shard.counters
        self.index = shard.index
        n = self.shard_count = shard.shard_count
        self.records: dict[bytes, SessionRecord] = {}
        self.pinned: set[bytes] = set()
        #: Removal notices for the sessions' homes (home -> (session, key) pairs), sent
        #: after the message that queued them, or ahead of a walk's posts.
        self.removed_out: dict[int, list[tuple[bytes, bytes]]] = {}
        self._max_sessions = -(-cfg.kv_session_max_sessions // n)
        tms = getattr(cfg, "tenant_max_sessions", 0)
        self._tenant_max_sessions = -(-tms // n) if tms else 0
        #: Live sessions homed here per tenant key prefix (kvmaster/_tenancy.py).
        self._tenant_sessions: dict[bytes, int] = {}
        self._session_refusal = Status.SESSION_LIMIT_EXCEEDED
        #: The keep sets of UPDATE_KV_SESSION being staged (:class:`KeepSetUpdates`).
        self.updates = KeepSetUpdates(self)
        for name in ("sessions_created", "sessions_deleted", "session_walk_pages",
                     "session_limit_rejections", "memberships_added", "memberships_removed",
                     "session_updates_discarded"):
            self.counters[name] = 0

    # The mapping: the session records homed here.

    def __getitem__(self, sck: bytes) -> SessionRecord:
        return self.records[sck]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    # ------------------------------------------------------------- plumbing

    def _pages(self, cks: Iterable[bytes]) -> list[tuple[int, list[bytes]]]:
        """Group stored keys by owning shard, in pages of at most max_batch keys."""
        by_shard: dict[int, list[bytes]] = {}
        n = self.shard_count
        for ck in cks:
            by_shard.setdefault(owner_of(ck, n), []).append(ck)
        size = self.config.kv_session_max_batch
        return [(s, keys[i:i + size]) for s, keys in by_shard.items()
                for i in range(0, len(keys), size)]

    def _sck(self, client: ClientView, sid: bytes) -> bytes:
        if not self.config.enable_kv_sessions:
            raise StatusError(Status.UNSUPPORTED, "sessions are disabled on this master")
        if P.shard_of(sid, client.seed, self.shard_count) != self.index:
            raise StatusError(Status.INVALID_PARAMS, "session routed to the wrong shard")
        return sid if client.prefix is None else client.prefix + sid

    # ---------------------------------------------- object side (any shard)

    def pinned_by(self, refs: bytes | tuple[bytes, ...] | set[bytes]) -> bool:
        pinned = self.pinned
        if not pinned:
            return False
        if type(refs) is bytes:
            return refs in pinned
        return not pinned.isdisjoint(refs)

    def unregister(self, ck: bytes, refs: Refs) -> None:
        """An object (or failed write) is gone: tell each session's home, batched."""
        if refs is None:
            return
        n = self.shard_count
        out = self.removed_out
        for sck in iter_sessions(refs):
            out.setdefault(owner_of(sck, n), []).append((sck, ck))

    def flush_removed(self) -> None:
        out = self.removed_out
        if out:
            self.removed_out = {}
            for home, pairs in out.items():
                self.shard.peers[home].post("members_removed", (pairs,))

    def set_pin_local(self, sck: bytes, pinned: bool, reply_shard: int = -1,
                      wid: int = 0, pos: int = 0) -> None:
        if pinned:
            self.pinned.add(sck)
        else:
            self.pinned.discard(sck)
            order = self.shard._order_of_key(sck)
            if order is not None:
                order.unpinned(sck)  # what the pin held goes back to its place
        if reply_shard >= 0:
            self.shard.walks.answer(reply_shard, wid, pos, 0)

    def attach_local(self, sck: bytes, cks: list[bytes], reply_shard: int,
                     wid: int, pos: int) -> None:
        """Per key: 0 newly associated, 1 already, OBJECT_NOT_FOUND, SESSION_LIMIT_EXCEEDED."""
        get = self.shard.objects.get
        limit = self.config.kv_session_max_per_object
        out: list[int] = []
        for ck in cks:
            obj = get(ck)
            if obj is None:
                out.append(Status.OBJECT_NOT_FOUND)
            elif has_ref(obj.sessions, sck):
                out.append(1)
            elif ref_count(obj.sessions) >= limit:
                self.counters["session_limit_rejections"] += 1
                out.append(Status.SESSION_LIMIT_EXCEEDED)
            else:
                obj.sessions = add_ref(obj.sessions, sck)
                out.append(0)
        self.shard.walks.answer(reply_shard, wid, pos, out)

    def detach_local(self, sck: bytes, cks: list[bytes], reply_shard: int,
                     wid: int, pos: int) -> None:
        """Drop ``sck`` from these objects (and pending writes); answers how many had it."""
        n = 0
        for ck in cks:
            for target in (self.shard.objects.get(ck), self.shard.writes.get(ck)):
                if target is not None and has_ref(target.sessions, sck):
                    target.sessions = drop_ref(target.sessions, sck)
                    n += 1
                    order = self.shard._order_of_key(ck)
                    if order is not None:
                        order.recheck(ck)  # (if it was held for that session's pin)
        self.counters["memberships_removed"] += n
        if reply_shard >= 0:
            self.shard.walks.answer(reply_shard, wid, pos, n)

    # ------------------------------------------------- home side (session owner)

    def _create_session(self, sck: bytes) -> SessionRecord | None:
        """A new session record, or None with the status of the refusal in
        ``_session_refusal``: SESSION_LIMIT_EXCEEDED past this shard's share of
        ``--kv-session-max-sessions``, TENANT_QUOTA_EXCEEDED past its tenant's share of
        ``--tenant-max-sessions`` (the admin tenant has none)."""
        if len(self.records) >= self._max_sessions:
            self.counters["session_limit_rejections"] += 1
            self._session_refusal = Status.SESSION_LIMIT_EXCEEDED
            return None
        prefix = prefix_of(sck)
        counts = self._tenant_sessions
        if self._tenant_max_sessions and prefix != self.shard._quota_free \
                and counts.get(prefix, 0) >= self._tenant_max_sessions:
            self.counters["tenant_quota_refusals"] += 1
            self._session_refusal = Status.TENANT_QUOTA_EXCEEDED
            return None
        counts[prefix] = counts.get(prefix, 0) + 1
        rec = self.records[sck] = SessionRecord()
        self.counters["sessions_created"] += 1
        return rec

    def _delete_session(self, sck: bytes) -> None:
        rec = self.records.pop(sck, None)
        if rec is None:
            return
        prefix = prefix_of(sck)
        left = self._tenant_sessions.get(prefix, 0) - 1
        if left > 0:
            self._tenant_sessions[prefix] = left
        else:
            self._tenant_sessions.pop(prefix, None)
        self.counters["sessions_deleted"] += 1
        if rec.pinned:
            for peer in self.shard.peers:
                peer.post("set_pin_local", (sck, False))

    def members_removed(self, pairs: list[tuple[bytes, bytes]]) -> None:
        """Objects went away on another shard (or this one): drop them from their sessions."""
        sessions = self.records
        for sck, ck in pairs:
            rec = sessions.get(sck)
            if rec is None:
                if sck[:1] == b"\x00":  # a key group's ref (kvmaster/_groups.py)
                    self.shard.groups.left(sck, ck)
                continue
            rec.members.discard(ck)
            rec.provisional.discard(ck)
            self.counters["memberships_removed"] += 1
            if not rec.members:
                self._delete_session(sck)

    def add_members(self, pairs: list[tuple[bytes, bytes]], reply_shard: int,
                    wid: int, pos: int) -> None:
        """Registration from a tagged write: 0 accepted, SESSION_LIMIT_EXCEEDED refused."""
        out: list[int] = []
        max_members = self.config.kv_session_max_members
        for sck, ck in pairs:
            rec = self.records.get(sck)
            if rec is None:
                rec = self._create_session(sck)
                if rec is None:
                    out.append(self._session_refusal)
                    continue
            members = rec.members
            if ck in members:
                rec.provisional.discard(ck)  # the write confirms an attach's member
            else:
                if len(members) >= max_members:
                    self.counters["session_limit_rejections"] += 1
                    out.append(Status.SESSION_LIMIT_EXCEEDED)
                    if not members:
                        self._delete_session(sck)
                    continue
                members.add(ck)
                self.counters["memberships_added"] += 1
            out.append(0)
        self.shard.walks.answer(reply_shard, wid, pos, out)

    # ------------------------------------------------------ client handlers

    def handle_attach_kv_session(self, client: ClientView, msg: Any, now: float
                                 ) -> Any:
        """Attach walk.  The home adds the keys first (tentatively) and then asks the
        keys' shards; a removal that races the walk then finds the member and drops
        it, and keys the shards refuse are taken out again when the walk ends."""
        sck = self._sck(client, msg.session_id)
        keys = msg.keys
        if len(keys) > self.config.kv_session_max_batch:
            raise StatusError(Status.INVALID_PARAMS, f"attach of {len(keys)} keys exceeds "
                              f"kv_session_max_batch={self.config.kv_session_max_batch}")
        if not keys:
            return []
        self.shard.walks.check_room()
        prefix = client.prefix
        cks = keys if prefix is None else [prefix + k for k in keys]
        statuses: list[int] = [0] * len(cks)
        rec = self.records.get(sck)
        if rec is None:
            rec = self._create_session(sck)
            if rec is None:
                return [self._session_refusal] * len(keys)
        members = rec.members
        room = self.config.kv_session_max_members - len(members)
        added: set[bytes] = set()
        n = self.shard_count
        positions: dict[int, list[int]] = {}
        for i, ck in enumerate(cks):
            if ck not in members:
                if room <= 0:
                    statuses[i] = Status.SESSION_LIMIT_EXCEEDED
                    self.counters["session_limit_rejections"] += 1
                    continue
                members.add(ck)
                added.add(ck)
                rec.provisional.add(ck)
                room -= 1
                self.counters["memberships_added"] += 1
            positions.setdefault(owner_of(ck, n), []).append(i)
        if not positions:
            if not members:
                self._delete_session(sck)
            return statuses
        shards = list(positions)
        requests = [(s, "attach_local", (sck, [cks[i] for i in positions[s]])) for s in shards]
        reply = self.shard._deferred_reply()

        def done(results: dict[int, list[Any]]) -> None:
            current = self.records.get(sck)
            for pos, s in enumerate(shards):
                for i, r in zip(positions[s], results[pos]):
                    ck = cks[i]
                    if r in (0, 1):
                        if ck in added:
                            rec.provisional.discard(ck)
                        continue
                    statuses[i] = r
                    if current is rec and ck in added and ck in rec.provisional:
                        rec.provisional.discard(ck)
                        rec.members.discard(ck)
                        self.counters["memberships_removed"] += 1
            if not rec.provisional:
                # An emptied set keeps its grown table (~32 KB after a 1,000-key attach).
                rec.provisional = set()
            if current is rec and not rec.members:
                self._delete_session(sck)
            reply(statuses)

        self.shard.walks.start(requests, done)
        return DEFERRED

    def handle_set_kv_session_pin(self, client: ClientView, msg: Any, now: float
                                  ) -> Any:
        sck = self._sck(client, msg.session_id)
        rec = self.records.get(sck)
        if rec is None:
            raise StatusError(Status.SESSION_NOT_FOUND, "session not found (register KV first)")
        self.shard.walks.check_room()
        rec.pinned = msg.pinned
        reply = self.shard._deferred_reply()
        self.shard.walks.start([(s, "set_pin_local", (sck, msg.pinned)) for s in range(self.shard_count)],
                   lambda results: reply(0))
        return DEFERRED

    def handle_close_kv_session(self, client: ClientView, msg: Any, now: float
                                ) -> Any:
        sck = self._sck(client, msg.session_id)
        rec = self.records.get(sck)
        if rec is None:
            return 0
        self.shard.walks.check_room()
        members = list(rec.members)
        self._delete_session(sck)
        reply = self.shard._deferred_reply()
        self.shard.walks.start([(s, "detach_local", (sck, cks)) for s, cks in self._pages(members)],
                   lambda results: reply(0))
        return DEFERRED

    def handle_get_kv_session(self, client: ClientView, msg: Any, now: float
                              ) -> list[Any]:
        rec = self.records.get(self._sck(client, msg.session_id))
        if rec is None:
            raise StatusError(Status.SESSION_NOT_FOUND, "session not found")
        return [msg.session_id, rec.pinned, len(rec.members)]

    def handle_list_kv_session_keys(self, client: ClientView, msg: Any, now: float
                                    ) -> list[Any]:
        sck = self._sck(client, msg.session_id)
        if msg.limit > self.config.kv_session_max_batch:
            raise StatusError(Status.INVALID_PARAMS, f"limit {msg.limit} exceeds "
                              f"kv_session_max_batch={self.config.kv_session_max_batch}")
        rec = self.records.get(sck)
        if rec is None:
            raise StatusError(Status.SESSION_NOT_FOUND, "session not found")
        prefix = client.prefix
        if msg.cursor:
            start = msg.cursor if prefix is None else prefix + msg.cursor
            it = rec.members.irange(minimum=start, inclusive=(False, True))
        else:
            it = iter(rec.members)
        page = list(islice(it, msg.limit + 1))
        more = len(page) > msg.limit
        page = page[:msg.limit]
        # A page also ends at LIST_PAGE_BYTES of keys, so that one reply stays small
        # (a peer's queue holds a bounded number of replies: --max-reply-bytes-per-peer).
        total = 0
        for i, ck in enumerate(page):
            total += len(ck)
            if total > LIST_PAGE_BYTES and i:
                page = page[:i]
                more = True
                break
        if prefix is not None:
            cut = len(prefix)
            page = [ck[cut:] for ck in page]
        return [page, page[-1] if more else b""]

    # ---------------------------------------------------------- inspection

    def view(self) -> dict[str, Any]:
        """For consistency checks: home records and object-side refs of this shard."""
        return {
            "sessions": {sck: set(rec.members) for sck, rec in self.records.items()},
            "pinned_home": {sck for sck, rec in self.records.items() if rec.pinned},
            "pinned_replica": set(self.pinned),
            "refs": {ck: {r for r in iter_sessions(o.sessions) if r[:1] != b"\x00"}
                     for ck, o in list(self.shard.objects.items()) + list(self.shard.writes.items())
                     if o.sessions},
        }


class KeepSetUpdates:
    """UPDATE_KV_SESSION on a session's home: the keep sets being staged page by page
    (``staged``: (client_id, token, session) -> (time of the last page, keys so far,
    pages so far)) and those discarded before their final page (``discarded_updates``:
    slot -> (forget-after deadline, over the member limit), in discard order; their
    later pages are refused, so a final page never applies a partial keep set).  Held
    by the shard's :class:`Sessions` in ``updates``; run by the shard's actor."""

    __slots__ = ("config", "counters", "discarded_updates", "sessions", "shard", "staged")

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self.shard = sessions.shard
        self.config = sessions.config
        self.counters = sessions.counters
        self.staged: dict[tuple[str, int, bytes], tuple[float, set[bytes], int]] = {}
        self.discarded_updates: dict[tuple[str, int, bytes], tuple[float, bool]] = {}

    def handle_update_kv_session(self, client: ClientView, msg: Any, now: float
                                 ) -> Any:
        """UPDATE_KV_SESSION ``session_id, keep_keys, token, final``: pages of one keep
        set (same client and token) are accumulated here; the final page applies it.

        A client has at most one keep set being accumulated per session: the first page
        of a new token replaces the client's earlier unfinished one (an update it gave
        up, e.g. after its final page was refused BUSY).  A page whose earlier pages
        were discarded (replaced, expired after ``--kv-session-update-staging-ttl``, or
        dropped when the client left: BYE or expiry) is refused with UPDATE_DISCARDED
        and changes nothing: the client may send the whole keep set again under a new
        token.  A keep set that would exceed ``--kv-session-max-members`` is refused
        with INVALID_PARAMS, and so are its later pages (sending it again cannot help).
        A final page refused BUSY keeps the staged pages, so it can be sent again.
        A page that says its index (``page``, from 0) is taken only after all the pages
        before it (or again, right after it was taken: its reply may have been lost);
        a later one finds its earlier pages gone and is refused UPDATE_DISCARDED
        whenever they went, not only within a TTL of their discard.
        Returns the keys accumulated so far (non-final page) or the members removed
        (final page)."""
        sck = self.sessions._sck(client, msg.session_id)
        cfg = self.config
        if len(msg.keep_keys) > cfg.max_batch:
            raise StatusError(Status.INVALID_PARAMS, f"keep-set page of {len(msg.keep_keys)} keys "
                              f"exceeds max_batch={cfg.max_batch}")
        prefix = client.prefix
        page = msg.keep_keys if prefix is None else [prefix + k for k in msg.keep_keys]
        slot = (client.client_id, msg.token, sck)
        discarded = self.discarded_updates.get(slot)
        if discarded is not None:
            if discarded[1]:
                raise StatusError(Status.INVALID_PARAMS, "the earlier pages of this keep set "
                                  "were discarded: it exceeds kv_session_max_members="
                                  f"{cfg.kv_session_max_members}; nothing changed")
            raise StatusError(Status.UPDATE_DISCARDED, "the earlier pages of this keep set "
                              "were discarded (expired, replaced by a newer update of the "
                              "session, or the client left); nothing changed; send the keep "
                              "set again from its first page with a new token")
        staged = self.staged.get(slot)
        pages = staged[2] if staged is not None else 0
        if msg.page is not None:
            if msg.page > pages or msg.page < pages - 1:
                raise StatusError(Status.UPDATE_DISCARDED, f"page {msg.page} of this keep set "
                                  f"does not follow the {pages} pages staged (earlier pages "
                                  "were discarded: expired, replaced by a newer update of the "
                                  "session, or the client left); nothing changed; send the "
                                  "keep set again from its first page with a new token")
            pages = max(pages, msg.page + 1)
        else:
            pages += 1
        if staged is not None:
            del self.staged[slot]
        keep = staged[1] if staged is not None else set()
        keep.update(page)
        if len(keep) > cfg.kv_session_max_members:
            if staged is not None:
                self._discard_staged(slot, staged, now, over_limit=True)
            raise StatusError(Status.INVALID_PARAMS, "keep set exceeds kv_session_max_members="
                              f"{cfg.kv_session_max_members}; nothing changed")
        older = self._older_staging(slot) if staged is None else None
        if not msg.final:
            if older is None and len(self.staged) >= MAX_STAGED_UPDATES:
                self.expire_staged(now)
                if len(self.staged) >= MAX_STAGED_UPDATES:
                    raise StatusError(Status.BUSY, "too many session updates being staged")
            if older is not None:
                self._discard_staged(older, self.staged.pop(older), now)
            self.staged[slot] = (now, keep, pages)
            return len(keep)
        rec = self.sessions.records.get(sck)
        if rec is not None and self.shard.walks.full():
            if staged is not None:
                # BUSY must leave nothing done: keep the earlier pages for the resent final
                # page (this page's keys are in the set too; adding them again is harmless).
                self.staged[slot] = (staged[0], keep, staged[2])
            self.shard.walks.check_room()
        if older is not None:
            self._discard_staged(older, self.staged.pop(older), now)
        if rec is None:
            return 0
        drop = [m for m in rec.members if m not in keep]
        if not drop:
            return 0
        if len(drop) == len(rec.members):
            self.sessions._delete_session(sck)
        else:
            rec.members = SortedList(m for m in rec.members if m in keep)
            rec.provisional &= keep
        reply = self.shard._deferred_reply()
        self.shard.walks.start([(s, "detach_local", (sck, cks)) for s, cks in self.sessions._pages(drop)],
                   lambda results: reply(len(drop)))
        return DEFERRED

    def _older_staging(self, slot: tuple[str, int, bytes]
                       ) -> tuple[str, int, bytes] | None:
        """The same client's unfinished keep set of the same session under another
        token, if any (at most one: a new token replaces it)."""
        client_id, _, sck = slot
        for other in self.staged:
            if other[0] == client_id and other[2] == sck:
                return other
        return None

    def _discard_staged(self, slot: tuple[str, int, bytes],
                        staged: tuple[float, set[bytes], int], now: float,
                        over_limit: bool = False) -> None:
        """Forget a staged keep set (already taken out of ``staged``) and remember its
        slot for ``--kv-session-update-staging-ttl``, so its later pages are refused
        (INVALID_PARAMS when it was discarded for exceeding the member limit,
        UPDATE_DISCARDED otherwise)."""
        done = self.discarded_updates
        done.pop(slot, None)  # re-inserted last: the dict stays in deadline order
        done[slot] = (now + self.config.kv_session_update_staging_ttl, over_limit)
        while len(done) > MAX_DISCARDED_UPDATES:
            del done[next(iter(done))]
        self.counters["session_updates_discarded"] += 1

    def expire_staged(self, now: float) -> None:
        ttl = self.config.kv_session_update_staging_ttl
        for slot in [s for s, (t, _, _) in self.staged.items() if now - t > ttl]:
            self._discard_staged(slot, self.staged.pop(slot), now)
        done = self.discarded_updates
        while done:
            slot = next(iter(done))
            if done[slot][0] > now:
                break
            del done[slot]

    def client_gone(self, client_id: str) -> int:
        """The front forgot a client (BYE or expiry): discard its staged keep sets,
        freeing their slots.  Returns how many were discarded."""
        now = _now()
        mine = [slot for slot in self.staged if slot[0] == client_id]
        for slot in mine:
            self._discard_staged(slot, self.staged.pop(slot), now)
        return len(mine)


def _now() -> float:
    import time

    return time.monotonic()
