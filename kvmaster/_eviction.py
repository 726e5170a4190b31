"""Eviction order of one shard: which evictable object goes first (``--eviction-policy``).

The shard (:class:`kvmaster._shard.ShardActor`) owns one :class:`EvictionOrder` and sends
it every use of an object: the hits of a lookup or read (:meth:`EvictionOrder.touch`) and
the objects a write stored (:meth:`EvictionOrder.stored`), each call's keys in the
caller's order, which engines send as a prefix chain (block 0 first).  Its
:class:`Eviction` (``ShardActor.eviction``) takes candidates oldest first from
:meth:`EvictionOrder.pop` (:meth:`Eviction.evict`) and decides on pins and leases,
which always come first:

* hard-pinned: dropped from the order; it comes back only when it is used again;
* leased: held until the lease ends (:meth:`EvictionOrder.hold`), then back at its place;
* soft-pinned (TTL soft pin, or a member of a pinned session): held
  (:meth:`EvictionOrder.hold_soft`) until the TTL ends, the session is unpinned
  (:meth:`EvictionOrder.unpinned`) or the object leaves a session
  (:meth:`EvictionOrder.recheck`), then back at its place; with
  ``--allow-evict-soft-pinned-objects`` the held ones are victims, least recent first
  (:meth:`EvictionOrder.pop_soft`), once no ordinary object is left.

So an object is examined once per use or per pin/lease change, never again in each
round: a round costs O(victims) plus the held objects met for the first time.  Nothing
is shared between shards (each order sees only its shard's keys, in the same relative
order as the whole chain).

Policies:

* ``lru`` (Mooncake's master): every use moves the object to the recent end, in the
  call's key order, so a chain's head, used first, is its least recent block.
* ``prefix-lru``: a call's keys are used back to front, so a chain's tail is older than
  its head; and the objects a write stores land just behind the least recent hit of the
  writer's last lookup or read on this shard (the deepest cached block of the chain it
  extends), deeper blocks older.  Under pressure a chain loses its tail first; a prefix
  hit, which stops at the first missing block, keeps its head.
* ``depth-lru``: a call's keys are used back to front and each key's stamp is lowered
  by :data:`DEPTH_AGE` uses per block of chain depth (its position in the call; a
  write's keys continue after the hits of the writer's last lookup on the shard):
  deep blocks of any chain go before shallow ones of about the same age.

Measured on the Mooncake conversation trace and the kv-cache-tester agentic traces with
``kvmaster-loadgen reference --orders`` (tools/loadgen/reference.py, ``order:*``; the
simulated ``depth-lru-4`` is ``depth-lru``).

Implementation: ``last`` maps each key in the order to its stamp (an int; larger is more
recent); ``stamps``/``keys`` hold the use entries in increasing stamp order (uses take
stamps from the clock; two deques extended by C-level passes, no tuple per entry) and
``late`` is a heap of the entries placed below the clock (writes
behind a hit, objects coming back from a hold).  An entry whose stamp is not the key's
in ``last`` is stale and skipped; removals elsewhere (remove, replace, unmount) leave
entries that :meth:`pop` skips and :meth:`_compact` drops.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvmaster._alloc import align_up
from kvmaster._records import HARD_PIN, FreeRuns, ObjectMeta, iter_sessions

if TYPE_CHECKING:
    from kvmaster._shard import ShardActor
    from kvmaster._tenancy import TenantPool

__all__ = ["EVICTION_POLICIES", "DepthLRUOrder", "Eviction", "EvictionOrder", "PrefixLRUOrder",
           "make_order"]

#: Stamp units per used key; the writes placed behind a hit take the units below it.
STEP = 1 << 20
#: Most writers whose last lookup's place (anchor) is kept per shard.
MAX_ANCHORS = 4096
#: Stale entries (keys used again or removed) an order keeps beyond twice its shard's
#: objects before it drops them all in one pass (amortised O(1) per use).
SLACK = 16384


class EvictionOrder:
    """Plain LRU (``lru``); the base of the other policies (see the module docstring).

    ``objects`` is the shard's key -> object map, read only here.  :attr:`examined`
    counts the objects :meth:`pop` and :meth:`pop_soft` handed out (victims and
    objects set aside), :attr:`stale` the entries skipped.
    """

    name = "lru"
    #: Use each call's keys back to front.
    reverse = False
    #: A write lands behind its writer's last lookup (see :class:`PrefixLRUOrder`).
    behind = False

    def __init__(self, objects: Mapping[bytes, Any]) -> None:
        self.objects = objects
        self.last: dict[bytes, int] = {}
        self.stamps: deque[int] = deque()
        self.keys: deque[bytes] = deque()
        self.late: list[tuple[int, bytes]] = []
        self.clock = 0
        #: Largest stamp popped so far: an anchor at or below it is gone.
        self.floor = 0
        #: (deadline, stamp, key) of held objects that come back at the deadline.
        self.timers: list[tuple[float, int, bytes]] = []
        #: Soft-pinned keys held aside -> their stamp; ``soft`` is their heap.
        self.aside: dict[bytes, int] = {}
        self.soft: list[tuple[int, bytes]] = []
        #: Pinned session -> (key, stamp) held aside because of it.
        self.held: dict[bytes, list[tuple[bytes, int]]] = {}
        #: Writer -> [stamp of its last lookup's least recent hit (depth-lru: its hit
        #: count), 0], taken by the writer's next write (one write per lookup: later
        #: writes without a lookup between are no continuation of that chain).
        self.anchors: OrderedDict[str, list[int]] = OrderedDict()
        self.examined = 0
        self.stale = 0

    def __len__(self) -> int:
        """Keys in the order (held and removed ones excluded once popped)."""
        return len(self.last)

    # ------------------------------------------------------------------ uses

    def touch(self, keys: Sequence[bytes], writer: str | None = None) -> None:
        """The hits of one lookup or read, in the caller's order (all present now).
        ``writer``: the caller's client id, whose next write lands behind these hits
        (``prefix-lru``); None for a use that is no lookup (a deduplicated put)."""
        n = len(keys)
        if n:
            c = self.clock
            stamps = list(range(c + STEP, c + (n + 1) * STEP, STEP))
            self.clock = c + n * STEP
            ks = keys[::-1] if self.reverse else keys
            self.last.update(zip(ks, stamps))
            self.stamps.extend(stamps)
            self.keys.extend(ks)
            if len(self.stamps) > 2 * len(self.objects) + SLACK:
                self._compact()
        if self.behind and writer is not None:
            anchors = self.anchors
            if n:
                anchors[writer] = [c + STEP, 0]  # (the last key's stamp: used first)
                anchors.move_to_end(writer)
                if len(anchors) > MAX_ANCHORS:
                    anchors.popitem(last=False)
            else:
                anchors.pop(writer, None)

    def stored(self, keys: Sequence[bytes], writer: str | None = None) -> None:
        """Objects one write stored (ended), in the caller's order (all present now)."""
        self.touch(keys)

    def forget_writer(self, writer: str) -> None:
        """The client left: its anchor goes."""
        self.anchors.pop(writer, None)

    # --------------------------------------------------------------- victims

    def pop(self) -> tuple[int, bytes, Any] | None:
        """The least recent ``(stamp, key, object)`` still in the order, taken out of it
        (the caller evicts it or holds it), or None when the order is empty."""
        qs, qk, late = self.stamps, self.keys, self.late
        while True:
            if late and (not qs or late[0][0] < qs[0]):
                s, k = heapq.heappop(late)
            elif qs:
                s = qs.popleft()
                k = qk.popleft()
            else:
                return None
            got = self._claim(s, k)
            if got is not None:
                return got

    def _claim(self, s: int, k: bytes) -> tuple[int, bytes, Any] | None:
        """The entry ``(stamp, key, object)`` taken from the order, or None when it is
        stale (the key was used again since, or its object is gone)."""
        last = self.last
        if last.get(k) != s:
            self.stale += 1
            return None
        del last[k]
        obj = self.objects.get(k)
        if obj is None:
            self.stale += 1
            return None
        self.examined += 1
        if s > self.floor:
            self.floor = s
        return s, k, obj

    def hold(self, key: bytes, stamp: int, until: float) -> None:
        """Keep a leased object out of the order until ``until`` (monotonic seconds)."""
        heapq.heappush(self.timers, (until, stamp, key))

    def hold_soft(self, key: bytes, stamp: int, until: float,
                  sessions: Iterable[bytes], evictable: bool) -> None:
        """Keep a soft-pinned object out of the order until its TTL pin ends (``until``,
        0 for none) or the pinned ``sessions`` holding it are unpinned.  ``evictable``:
        it stays a victim of :meth:`pop_soft`."""
        self.aside[key] = stamp
        if evictable:
            heapq.heappush(self.soft, (stamp, key))
        if until:
            heapq.heappush(self.timers, (until, stamp, key))
        held = self.held
        for sck in sessions:
            held.setdefault(sck, []).append((key, stamp))

    def pop_soft(self, is_soft: Any) -> tuple[int, bytes, Any] | None:
        """The least recent held soft-pinned object still soft-pinned (``is_soft(obj)``),
        taken out, or None.  One found unpinned goes back to the order."""
        soft, aside, last, objects = self.soft, self.aside, self.last, self.objects
        while soft:
            s, k = heapq.heappop(soft)
            if aside.get(k) != s or k in last:
                self.stale += 1
                continue
            del aside[k]
            obj = objects.get(k)
            if obj is None:
                self.stale += 1
                continue
            if not is_soft(obj):
                self._back(k, s)
                continue
            self.examined += 1
            return s, k, obj
        return None

    def expire(self, now: float) -> None:
        """Held objects whose lease or TTL pin ended by ``now`` go back to their place."""
        timers = self.timers
        while timers and timers[0][0] <= now:
            _, s, k = heapq.heappop(timers)
            a = self.aside.get(k)
            if a is not None:
                if a != s:
                    continue  # held again since, under a later use
                del self.aside[k]
            self._back(k, s)

    def unpinned(self, sck: bytes) -> None:
        """Session ``sck`` is no longer pinned: what it held goes back to its place."""
        for k, s in self.held.pop(sck, ()):
            if self.aside.get(k) == s:
                del self.aside[k]
                self._back(k, s)

    def recheck(self, key: bytes) -> None:
        """``key`` left a session: if held as soft-pinned, it goes back (to be judged
        again when it comes up)."""
        s = self.aside.pop(key, None)
        if s is not None:
            self._back(key, s)

    def back(self, key: bytes, stamp: int) -> None:
        """``key``, held with :meth:`hold`, goes back to its place now (its timer later
        finds it back and does nothing)."""
        if self.aside.get(key) is None:
            self._back(key, stamp)

    def _back(self, k: bytes, s: int) -> None:
        if k in self.last or k not in self.objects:
            return  # used since (its newer entry counts), or gone
        self.last[k] = s
        heapq.heappush(self.late, (s, k))

    def _compact(self) -> None:
        """Drop the stale entries: keys gone, entries superseded by a later use."""
        objects = self.objects
        last = {k: s for k, s in self.last.items() if k in objects}
        self.last = last
        live = sorted(zip(last.values(), last.keys()))
        self.stamps = deque(s for s, _ in live)
        self.keys = deque(k for _, k in live)
        self.late = []
        self.aside = {k: s for k, s in self.aside.items() if k in objects}
        aside = self.aside
        if self.soft:
            self.soft = [(s, k) for k, s in aside.items()]
            heapq.heapify(self.soft)
        for sck in list(self.held):
            kept = [(k, s) for k, s in self.held[sck] if aside.get(k) == s]
            if kept:
                self.held[sck] = kept
            else:
                del self.held[sck]
        if len(self.timers) > 2 * len(objects) + SLACK:
            self.timers = [t for t in self.timers if t[2] in objects]
            heapq.heapify(self.timers)


class PrefixLRUOrder(EvictionOrder):
    """``prefix-lru`` (see the module docstring): uses back to front; the writer's first
    write after a lookup lands just behind that lookup's least recent hit on this shard,
    its first key nearest to it; at the recent end (back to front) when that lookup had
    no hit here, its place has been evicted since, or another write took it."""

    name = "prefix-lru"
    reverse = True
    behind = True

    def stored(self, keys: Sequence[bytes], writer: str | None = None) -> None:
        n = len(keys)
        a = self.anchors.pop(writer, None) if writer is not None and n else None
        if a is None or a[0] <= self.floor:
            self.touch(keys)
            return
        top = a[0] - 1
        stamps = range(top, top - n, -1)
        last, late = self.last, self.late
        last.update(zip(keys, stamps))
        push = heapq.heappush
        for s, k in zip(stamps, keys):
            push(late, (s, k))
        if len(late) > 2 * len(self.objects) + SLACK:
            self._compact()


class DepthLRUOrder(EvictionOrder):
    """``depth-lru``: uses back to front, each key's stamp lowered by :data:`DEPTH_AGE`
    keys of age per block of chain depth (its position in the call; the keys of the
    writer's first write after a lookup continue after that lookup's hits on this
    shard).  Deep blocks of
    any chain go before shallow ones of about the same age (the shallow blocks are the
    prefixes that many requests share), and a chain's tail before its head.

    A call's stamps rise in the order its keys are used but may lie below earlier
    calls' stamps, so each call is one sorted *run* (two deques) and :meth:`pop` takes
    the least stamp over a heap of the runs' heads: O(1) per key and O(log runs) per
    call and per victim."""

    name = "depth-lru"
    reverse = True

    def __init__(self, objects: Mapping[bytes, Any]) -> None:
        super().__init__(objects)
        #: (head stamp, seq, stamps, keys) per run, a heap.
        self.runs: list[tuple[int, int, deque[int], deque[bytes]]] = []
        self.entries = 0
        self._seq = 0

    def _run(self, stamps: list[int], keys: Sequence[bytes]) -> None:
        self.last.update(zip(keys, stamps))
        self._seq += 1
        heapq.heappush(self.runs, (stamps[0], self._seq, deque(stamps), deque(keys)))
        self.entries += len(stamps)
        if self.entries > 2 * len(self.objects) + SLACK:
            self._compact()

    def _stamps(self, n: int, depth0: int) -> list[int]:
        """Stamps of ``n`` keys at depths ``depth0..``, in use order (deepest first)."""
        c = self.clock
        self.clock = c + n * STEP
        per = STEP + DEPTH_AGE * STEP  # (one clock step and the depth's lowering)
        top = c + n * STEP - depth0 * DEPTH_AGE * STEP  # (the key at depth0)
        return list(range(top - (n - 1) * per, top + 1, per))

    def touch(self, keys: Sequence[bytes], writer: str | None = None) -> None:
        n = len(keys)
        if n:
            self._run(self._stamps(n, 0), keys[::-1])
        if writer is not None:
            anchors = self.anchors
            anchors[writer] = [n, 0]  # (the depth of the writer's next write here)
            anchors.move_to_end(writer)
            if len(anchors) > MAX_ANCHORS:
                anchors.popitem(last=False)

    def stored(self, keys: Sequence[bytes], writer: str | None = None) -> None:
        n = len(keys)
        if not n:
            return
        a = self.anchors.pop(writer, None) if writer is not None else None
        self._run(self._stamps(n, a[0] if a is not None else 0), keys[::-1])

    def pop(self) -> tuple[int, bytes, Any] | None:
        runs, late = self.runs, self.late
        while True:
            if late and (not runs or late[0][0] < runs[0][0]):
                s, k = heapq.heappop(late)
            elif runs:
                _, seq, ss, kk = runs[0]
                s = ss.popleft()
                k = kk.popleft()
                self.entries -= 1
                if ss:
                    heapq.heapreplace(runs, (ss[0], seq, ss, kk))
                else:
                    heapq.heappop(runs)
            else:
                return None
            got = self._claim(s, k)
            if got is not None:
                return got

    def _compact(self) -> None:
        super()._compact()  # (the live entries are now one sorted run in stamps/keys)
        stamps, keys = self.stamps, self.keys
        self.stamps, self.keys = deque(), deque()
        self.runs = [(stamps[0], 0, stamps, keys)] if stamps else []
        self.entries = len(stamps)


#: Keys of age a block of chain depth is worth (``depth-lru``; 4 measured best of
#: 0.25, 1, 4 and 16 with ``kvmaster-loadgen reference``).
DEPTH_AGE = 4

#: ``--eviction-policy`` values -> their order class.
EVICTION_POLICIES: dict[str, type[EvictionOrder]] = {
    "lru": EvictionOrder,
    "prefix-lru": PrefixLRUOrder,
    "depth-lru": DepthLRUOrder,
}


def make_order(policy: str, objects: Mapping[bytes, Any]) -> EvictionOrder:
    """The order of ``--eviction-policy`` ``policy`` over ``objects``; ValueError if unknown."""
    try:
        cls = EVICTION_POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown eviction policy {policy!r} "
                         f"(one of {', '.join(EVICTION_POLICIES)})") from None
    return cls(objects)


class Eviction:
    """One shard's eviction decisions: which objects of a tenant pool go when space is
    short (:meth:`evict`, taking candidates from the pool's :class:`EvictionOrder`),
    the watermark check that starts it, the pin tests (leases, hard and soft pins,
    pinned sessions) and the objects kept for a suspected client (``suspect_held``:
    segment -> the (key, stamp, order) of its objects passed over, put back at their
    places when its client is active again).  Run by the shard's actor
    (:class:`kvmaster._shard.ShardActor` holds it in ``eviction``)."""

    __slots__ = ("shard", "suspect_held")

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard
        self.suspect_held: dict[str, list[tuple[bytes, int, Any]]] = {}

    def forget_segment(self, name: str) -> None:
        """A segment was unmounted: nothing of it is kept for its client any more."""
        self.suspect_held.pop(name, None)

    def is_soft_pinned(self, obj: ObjectMeta, now: float) -> bool:
        return obj.softpin > now or (obj.sessions is not None
                                     and self.shard.sessions.pinned_by(obj.sessions))

    def evict(self, need_bytes: int, now: float, pool: TenantPool) -> int:
        """Evict evictable objects of ``pool``'s tenant, oldest first in its eviction order
        (``--eviction-policy``, the orders above), until ``need_bytes`` are freed
        (a tenant's write never evicts another tenant's objects: kvmaster/_tenancy.py).

        Victims: not hard-pinned, not leased (objects being written are not in
        the map).  Ordinary objects go first; soft-pinned ones (TTL pin or a pinned
        session) only when ``allow_evict_soft_pinned_objects`` and no ordinary victim is
        left, again oldest first.  Leased, hard-pinned and soft-pinned objects met on the
        way leave the order (hard-pinned ones until used again, the others until their
        lease or TTL ends, their session is unpinned or they leave it, then back at their
        place), so no round examines them again: a round costs O(victims) plus the objects
        newly set aside (``eviction_examined_keys``).  Returns bytes freed.
        """
        c = self.shard.counters
        c["eviction_attempts"] += 1
        order = pool.order
        order.expire(now)
        examined = order.examined
        objects = self.shard.objects
        victims: list[bytes] = []
        freed = 0
        pinned_sessions = self.shard.sessions.pinned
        allow_soft = self.shard.config.allow_evict_soft_pinned_objects
        # Objects on a suspected client's segments (--client-suspicion-ttl) are kept
        # for it: freeing them frees no space that writes may use meanwhile.
        suspected = self.shard.tenancy.suspected
        while freed < need_bytes:
            got = order.pop()
            if got is None:
                break
            stamp, ck, obj = got
            if obj.flags & HARD_PIN:
                continue  # out of the order until used again
            if obj.lease > now:
                order.hold(ck, stamp, obj.lease)
                continue
            if suspected and self.kept_for_suspect(obj):
                order.hold(ck, stamp, now + self.shard.config.client_suspicion_ttl)
                self.suspect_held.setdefault(obj.seg.name, []).append((ck, stamp, order))
                continue
            refs = obj.sessions
            by_session = (refs is not None and pinned_sessions
                          and self.shard.sessions.pinned_by(refs))
            if obj.softpin > now or by_session:
                order.hold_soft(ck, stamp, obj.softpin if obj.softpin > now else 0.0,
                                [r for r in iter_sessions(refs) if r in pinned_sessions]
                                if by_session else (), allow_soft)
                continue
            victims.append(ck)
            freed += align_up(obj.size) * (1 + (len(obj.more) if obj.more else 0))
        soft_taken = 0
        if freed < need_bytes and allow_soft and order.soft:
            is_soft = lambda o: self.is_soft_pinned(o, now)  # noqa: E731
            while freed < need_bytes:
                got = order.pop_soft(is_soft)
                if got is None:
                    break
                stamp, ck, obj = got
                if obj.flags & HARD_PIN:
                    continue  # (pinned since: back when used again)
                if obj.lease > now:
                    order.hold(ck, stamp, obj.lease)  # (leased since)
                    continue
                victims.append(ck)
                soft_taken += 1
                freed += align_up(obj.size) * (1 + (len(obj.more) if obj.more else 0))
        c["eviction_examined_keys"] += order.examined - examined
        if not victims:
            return 0
        c["eviction_rounds"] += 1
        runs = FreeRuns(self.shard)  # (victims hold no lease: freed now)
        groups = self.shard.groups
        try:
            for ck in victims:
                obj = objects.pop(ck)
                if obj.more is None and obj.lease <= now:
                    runs.add(obj.seg, obj.off, obj.size, 0.0)
                else:
                    self.shard.placement.free_object(obj, now)
                self.shard.sessions.unregister(ck, obj.sessions)
                if groups.active and obj.sessions is not None:
                    groups.victim(ck, obj.sessions)  # (the rest of its group follows)
                c["evicted_keys"] += 1
                c["evicted_bytes"] += obj.size
        finally:
            runs.flush()
        c["evicted_soft_pinned_keys"] += soft_taken
        return freed

    def check_watermark(self, now: float, pool: TenantPool | None = None) -> None:
        """Evict down to the low mark in each pool (``pool``'s alone if given) filled past
        ``eviction_high_watermark_ratio`` of its capacity, from its tenant's objects."""
        cfg = self.shard.config
        high = cfg.eviction_high_watermark_ratio
        pools = (pool,) if pool is not None else list(self.shard.tenancy.pools.values())
        for p in pools:
            cap = p.capacity
            if not cap:
                continue
            used = p.used()
            if self.shard.log is not None:
                used -= self.shard.log.held_in(p)  # (freed, given back once durable)
            if used > high * cap:
                target = max(0.0, high - cfg.eviction_ratio) * cap
                self.evict(int(used - target), now, p)

    def suspect(self, names: list[str], on: bool) -> int:
        """The client owning segments ``names`` is suspected (``on``) or active
        again (``--client-suspicion-ttl``): no write is placed on them meanwhile
        (:meth:`kvmaster._tenancy.Tenancy.suspect`) and eviction passes over the objects
        held there alone (:meth:`kept_for_suspect`); once active again those go back
        to their places in the eviction order.  -> how many of them this shard holds a
        share of."""
        held = 0
        for name in names:
            if name in self.shard.placement.segments:
                self.shard.tenancy.suspect(name, on)
                held += 1
            if not on:
                for ck, stamp, order in self.suspect_held.pop(name, ()):
                    order.back(ck, stamp)
        return held

    def kept_for_suspect(self, obj: ObjectMeta) -> bool:
        """Every replica of ``obj`` is on a suspected client's segment: evicting it would
        free no space writes may use, and take what the client may come back for."""
        suspected = self.shard.tenancy.suspected
        if obj.seg.name not in suspected:
            return False
        return not obj.more or all(seg.name in suspected for seg, _ in obj.more)
