"""Exact cache simulations of a trace, used as references for the master.

Access rule shared by every policy here, per request in arrival order:

1. The *prefix hit* of the request is the length of the leading run of its
   ``hash_ids`` that are in the cache when the request arrives. It is fixed
   before the request touches the cache, so nothing the request itself does
   (inserting its own blocks, evicting) can change its own count.
2. Lookup: every block of the request that is cached on arrival is accessed
   (a hit; LRU moves it to most-recent), in prompt order.
3. Fill: every block that was missing is inserted, in prompt order; while the
   cache holds more than ``capacity_blocks`` blocks, single blocks are
   evicted.

Why lookup before fill: had the blocks been accessed strictly in prompt order,
inserting the first missing block would evict the least recently used block,
which is typically a still-cached, not yet refreshed later block of the *same*
chain; that block would then miss in turn and evict its successor, destroying
the cached tail of the chain that the request was about to use. With lookup
first, a request's cached blocks are the most recent when its misses are
inserted, so the blocks of one request evict each other only when the request
alone is longer than the cache (then its oldest blocks go first). This mirrors
a store where the engine looks up all blocks at arrival and writes the missing
ones after prefill.

Belady (OPT): the victim is the cached block whose next use is furthest in the
future, *including the block just inserted* (a block never used again is not
kept: OPT with bypass, an upper bound on any policy that admits every miss).
On prefix-chained traces (each id always preceded by the same id) a block's
ancestors are always used before it, so Belady never keeps a block whose
ancestor it dropped while that block still has a future use: all its hits are
prefix hits, and it is also optimal for the prefix hit count.

Hit rate = sum of prefix hits / sum of blocks over all requests.

Retention policies (:func:`policy_prefix_hit_rate`): the same access rule on a
model of the master's eviction with soft pins: one LRU order over all blocks,
victims taken from the unpinned blocks first and from the pinned ones (again
least recently used first) only when none is left.  A block is pinned while a
pinned session holds it or while its TTL pin runs.  Sessions follow the master's
rules: tagged writes and attaches add members, an update keeps only the keep
set, an evicted block leaves its sessions, and a session that loses its last
member is gone (with its pin).  The tasks come from
:class:`~kvmaster.tools.loadgen.sessions.SessionPlanner`, as a replay with one
worker would issue them, so this is what the master should measure without
concurrency and with eviction exactly at capacity.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from sortedcontainers import SortedList

from .sessions import SessionPlanner, SessionPolicy, continued_requests
from .traces import Request

logger = logging.getLogger(__name__)

__all__ = [
    "RefResult",
    "lru_prefix_hit_rate",
    "belady_prefix_hit_rate",
    "unbounded_prefix_hit_rate",
    "policy_prefix_hit_rate",
    "order_prefix_hit_rate",
    "ORDER_POLICIES",
]


@dataclass(frozen=True, slots=True)
class RefResult:
    """Outcome of a reference simulation (all counts in blocks except ``requests``).

    ``prefix_hits``: sum over requests of the leading cached run.
    ``block_hits``: every access that found its block cached (>= prefix_hits).
    ``evictions``: blocks evicted. ``capacity_blocks`` is ``None`` if unbounded.
    """

    policy: str
    capacity_blocks: int | None
    requests: int
    blocks: int
    prefix_hits: int
    block_hits: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """Prefix hit rate: ``prefix_hits / blocks`` (0.0 for an empty trace)."""
        return self.prefix_hits / self.blocks if self.blocks else 0.0

    @property
    def block_hit_rate(self) -> float:
        """Any-position hit rate: ``block_hits / blocks``."""
        return self.block_hits / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict:
        """JSON-serialisable dict including ``hit_rate`` and ``block_hit_rate``."""
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["block_hit_rate"] = self.block_hit_rate
        return d


def _check_capacity(capacity_blocks: int) -> None:
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")


def _leading_run(hash_ids: Sequence[int], cache: object) -> int:
    n = 0
    for h in hash_ids:
        if h not in cache:  # type: ignore[operator]
            break
        n += 1
    return n


def lru_prefix_hit_rate(requests: Sequence[Request], capacity_blocks: int) -> RefResult:
    """Exact single-block LRU with ``capacity_blocks`` slots under the module's access rule."""
    _check_capacity(capacity_blocks)
    cache: OrderedDict[int, None] = OrderedDict()
    blocks = prefix_hits = block_hits = evictions = 0
    for req in requests:
        ids = req.hash_ids
        blocks += len(ids)
        prefix_hits += _leading_run(ids, cache)
        misses: list[int] = []
        for h in ids:  # lookup
            if h in cache:
                cache.move_to_end(h)
                block_hits += 1
            else:
                misses.append(h)
        for h in misses:  # fill
            if h in cache:  # repeated id within the request
                cache.move_to_end(h)
                continue
            cache[h] = None
            if len(cache) > capacity_blocks:
                cache.popitem(last=False)
                evictions += 1
    return RefResult("lru", capacity_blocks, len(requests), blocks, prefix_hits, block_hits,
                     evictions)


def belady_prefix_hit_rate(requests: Sequence[Request], capacity_blocks: int) -> RefResult:
    """Clairvoyant (Belady/OPT with bypass) bound under the module's access rule.

    Next uses are precomputed over the flat reference string (request-major,
    prompt order); the cache is a dict ``block -> next use`` plus a max-heap of
    ``(-next_use, block)`` entries with lazy deletion. O(R log R) for R references.
    A next use inside the same request (an id repeated within one prompt) is
    treated like any other: such traces are not prefix-chained anyway.
    """
    _check_capacity(capacity_blocks)
    flat: list[int] = [h for req in requests for h in req.hash_ids]
    n_refs = len(flat)
    never = n_refs  # "next use" of a block that is not referenced again
    next_use = [never] * n_refs
    last_seen: dict[int, int] = {}
    for pos in range(n_refs - 1, -1, -1):
        h = flat[pos]
        next_use[pos] = last_seen.get(h, never)
        last_seen[h] = pos
    del last_seen

    cache: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    prefix_hits = block_hits = evictions = 0
    start = 0
    for req in requests:
        ids = req.hash_ids
        prefix_hits += _leading_run(ids, cache)
        misses: list[int] = []
        for pos in range(start, start + len(ids)):  # lookup
            h = flat[pos]
            if h in cache:
                block_hits += 1
                nxt = next_use[pos]
                cache[h] = nxt
                heapq.heappush(heap, (-nxt, h))
            else:
                misses.append(pos)
        start += len(ids)
        if capacity_blocks == 0:
            continue
        for pos in misses:  # fill
            h = flat[pos]
            nxt = next_use[pos]
            cache[h] = nxt
            heapq.heappush(heap, (-nxt, h))
            if len(cache) > capacity_blocks:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if cache.get(victim) == -neg:
                        del cache[victim]
                        evictions += 1
                        break
        if len(heap) > 4 * capacity_blocks + 1024:  # drop stale entries
            heap = [(-v, k) for k, v in cache.items()]
            heapq.heapify(heap)
    return RefResult("belady", capacity_blocks, len(requests), n_refs, prefix_hits, block_hits,
                     evictions)


def unbounded_prefix_hit_rate(requests: Sequence[Request]) -> RefResult:
    """Infinite cache: the prefix hit is the leading run of blocks seen before."""
    seen: set[int] = set()
    blocks = prefix_hits = block_hits = 0
    for req in requests:
        ids = req.hash_ids
        blocks += len(ids)
        prefix_hits += _leading_run(ids, seen)
        for h in ids:
            if h in seen:
                block_hits += 1
            else:
                seen.add(h)
    return RefResult("unbounded", None, len(requests), blocks, prefix_hits, block_hits, 0)


class _PinnedLRU:
    """Block cache with two eviction classes (see the module docstring).

    ``stamp[b]``: recency of cached block ``b``; ``ref[b]``: pinned sessions
    holding ``b``; ``ttl[b]``: trace ms until which ``b`` is TTL-pinned.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.clock = 0
        self.stamp: dict[int, int] = {}
        self.plain: SortedList = SortedList()
        self.pinned: SortedList = SortedList()
        self.ref: dict[int, int] = {}
        self.ttl: dict[int, float] = {}
        self.ttl_timers: list[tuple[float, int]] = []
        self.now = 0.0
        self.evictions = 0
        self.evicted_pinned = 0
        self.on_evict = None  # callable(block) -> None

    def is_pinned(self, b: int) -> bool:
        return self.ref.get(b, 0) > 0 or self.ttl.get(b, -1.0) > self.now

    def _list(self, b: int) -> SortedList:
        return self.pinned if self.is_pinned(b) else self.plain

    def reclassify(self, b: int, was_pinned: bool) -> None:
        """Move ``b`` between the classes after its pin state may have changed."""
        st = self.stamp.get(b)
        if st is None:
            return
        now_pinned = self.is_pinned(b)
        if now_pinned != was_pinned:
            (self.pinned if was_pinned else self.plain).remove((st, b))
            (self.pinned if now_pinned else self.plain).add((st, b))

    def add_ref(self, b: int, delta: int) -> None:
        was = self.is_pinned(b)
        n = self.ref.get(b, 0) + delta
        if n:
            self.ref[b] = n
        else:
            self.ref.pop(b, None)
        self.reclassify(b, was)

    def set_ttl(self, b: int, until: float) -> None:
        was = self.is_pinned(b)
        self.ttl[b] = until
        heapq.heappush(self.ttl_timers, (until, b))
        self.reclassify(b, was)

    def advance(self, t_ms: float) -> None:
        """Trace time moves to ``t_ms``: TTL pins that ran out stop counting."""
        timers = self.ttl_timers
        while timers and timers[0][0] <= t_ms:
            until, b = heapq.heappop(timers)
            if self.ttl.get(b) != until:
                continue  # rewritten (new TTL) or evicted since
            # Pinned until now (its TTL was still running); re-check without it.
            del self.ttl[b]
            self.reclassify(b, True)
        self.now = max(self.now, t_ms)

    def touch(self, b: int) -> None:
        self.clock += 1
        lst = self._list(b)
        old = self.stamp.get(b)
        if old is not None:
            lst.remove((old, b))
        self.stamp[b] = self.clock
        lst.add((self.clock, b))

    def insert(self, b: int) -> None:
        """Add ``b``, first evicting others to make room (the master allocates, evicting
        if needed, before the new object exists, so a write never evicts itself)."""
        while len(self.stamp) >= self.capacity:
            if self.plain:
                _, victim = self.plain.pop(0)
            else:
                _, victim = self.pinned.pop(0)
                self.evicted_pinned += 1
            del self.stamp[victim]
            self.ttl.pop(victim, None)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(victim)
        self.touch(b)


def policy_prefix_hit_rate(requests: Sequence[Request], capacity_blocks: int,
                           policy: SessionPolicy) -> RefResult:
    """Model of a retention policy on the master (see the module docstring).

    ``policy.retention == "none"`` gives exactly :func:`lru_prefix_hit_rate`.
    The result's ``policy`` is ``"model:<retention>"``.
    """
    _check_capacity(capacity_blocks)
    continued = (continued_requests(requests, policy)
                 if policy.retention == "session-oracle" else None)
    planner = SessionPlanner(policy, continued=continued)
    cache = _PinnedLRU(capacity_blocks)
    members: dict[str, set[int]] = {}
    pinned: set[str] = set()
    holders: dict[int, set[str]] = {}
    ttl_ms = policy.idle_s * 1000.0 if policy.retention == "ttl-pin" else None

    def join(sid: str, b: int) -> None:
        m = members.setdefault(sid, set())
        if b in m:
            return
        m.add(b)
        holders.setdefault(b, set()).add(sid)
        if sid in pinned:
            cache.add_ref(b, 1)

    def leave(sid: str, b: int) -> None:
        m = members.get(sid)
        if m is None or b not in m:
            return
        m.discard(b)
        hs = holders[b]
        hs.discard(sid)
        if not hs:
            del holders[b]
        if sid in pinned:
            cache.add_ref(b, -1)
        if not m:  # last member gone: the session and its pin go with it
            del members[sid]
            pinned.discard(sid)

    def drop_session(sid: str) -> None:
        for b in list(members.get(sid, ())):
            leave(sid, b)
        pinned.discard(sid)

    def on_evict(b: int) -> None:
        for sid in list(holders.get(b, ())):
            leave(sid, b)

    cache.on_evict = on_evict
    blocks = prefix_hits = block_hits = 0
    tasks = planner.plan(requests) if capacity_blocks else []
    for task in tasks:
        cache.advance(task.t_ms)
        sid = task.session
        if task.kind == "close":
            drop_session(sid)
            continue
        if task.kind == "pin":
            if sid in members and sid not in pinned:
                pinned.add(sid)
                for b in members[sid]:
                    cache.add_ref(b, 1)
            continue
        if task.kind == "unpin":
            if sid in pinned:
                pinned.discard(sid)
                for b in members.get(sid, ()):
                    cache.add_ref(b, -1)
            continue
        ids = task.hash_ids
        blocks += len(ids)
        prefix = _leading_run(ids, cache.stamp)
        prefix_hits += prefix
        tagged = set(ids[:task.tag_blocks]) if policy.sessions else set()
        misses: list[int] = []
        for h in ids:  # lookup
            if h in cache.stamp:
                cache.touch(h)
                block_hits += 1
            else:
                misses.append(h)
        for h in misses:  # fill
            if h in cache.stamp:
                cache.touch(h)
                continue
            cache.insert(h)
            if h in tagged:
                join(sid, h)
            if ttl_ms is not None:
                cache.set_ttl(h, task.t_ms + ttl_ms)
        if not policy.sessions:
            continue
        for h in ids[task.member_prefix:min(prefix, task.tag_blocks)]:  # attach
            if h in cache.stamp:
                join(sid, h)
        if task.trim and sid in members:
            for b in [b for b in members[sid] if b not in tagged]:
                leave(sid, b)
        if task.pin and sid in members and sid not in pinned:
            pinned.add(sid)
            for b in members[sid]:
                cache.add_ref(b, 1)
        elif task.pin is False and sid in pinned:
            pinned.discard(sid)
            for b in members.get(sid, ()):
                cache.add_ref(b, -1)
    if not capacity_blocks:
        blocks = sum(len(r.hash_ids) for r in requests)
    return RefResult(f"model:{policy.retention}", capacity_blocks, len(requests), blocks,
                     prefix_hits, block_hits, cache.evictions)


# --------------------------------------------------------------------------- eviction orders
#
# Candidate eviction orders for the master (issue 24), simulated on the calls an engine
# makes for one request: a lookup of all its blocks (the cached ones are touched), a
# read of the hits, a write of the misses (each block allocated, evicting first, then
# stored).  The keys of each call are a prefix chain in prompt order.  None reads the
# future; each is O(log n) per touch and O(victims) per eviction, one cache (= one shard).


class _StampOrder:
    """Blocks with an integer stamp each, evicted smallest stamp first (a heap with lazy
    deletion: an entry whose stamp is no longer the block's is skipped)."""

    def __init__(self) -> None:
        self.stamp: dict[int, int] = {}
        self.heap: list[tuple[int, int]] = []

    def __contains__(self, b: int) -> bool:
        return b in self.stamp

    def __len__(self) -> int:
        return len(self.stamp)

    def set(self, b: int, st: int) -> None:
        self.stamp[b] = st
        heapq.heappush(self.heap, (st, b))
        if len(self.heap) > 4 * len(self.stamp) + 1024:
            self.heap = [(s, k) for k, s in self.stamp.items()]
            heapq.heapify(self.heap)

    def pop(self) -> int:
        heap, stamp = self.heap, self.stamp
        while True:
            st, b = heapq.heappop(heap)
            if stamp.get(b) == st:
                del stamp[b]
                return b


#: Stamp units per touched key; the writes placed behind a hit take the units below it.
_STEP = 1 << 16


class OrderPolicy:
    """Base of the simulated eviction orders: ``lookup``/``read`` touch the cached keys of
    a call, ``write`` stores missing keys (evicting down to ``capacity - 1`` first)."""

    name = "?"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.evictions = 0

    def __contains__(self, b: int) -> bool:
        raise NotImplementedError

    def lookup(self, keys: Sequence[int]) -> None:
        raise NotImplementedError

    def read(self, keys: Sequence[int]) -> None:
        self.lookup(keys)

    def write(self, keys: Sequence[int]) -> None:
        raise NotImplementedError


class _StampPolicy(OrderPolicy):
    reverse = False  # touch a call's keys back to front
    behind = False  # a write lands behind the least recent hit of the last lookup/read

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.order = _StampOrder()
        self.clock = 0
        self.anchor: int | None = None

    def __contains__(self, b: int) -> bool:
        return b in self.order

    def _touch(self, keys: Sequence[int]) -> list[int]:
        order = self.order
        hit = [b for b in keys if b in order]
        for b in (reversed(hit) if self.reverse else hit):
            self.clock += _STEP
            order.set(b, self.clock)
        return hit

    def lookup(self, keys: Sequence[int]) -> None:
        hit = self._touch(keys)
        if self.behind:
            self.anchor = self.order.stamp[hit[-1]] if hit else None

    def write(self, keys: Sequence[int]) -> None:
        order = self.order
        todo = [b for b in keys if b not in order]
        if self.behind and self.anchor is not None:
            base = self.anchor
            stamps = [base - 1 - min(i, _STEP - 2) for i in range(len(todo))]
        else:
            stamps = []
            for _ in todo:
                self.clock += _STEP
                stamps.append(self.clock)
            if self.reverse:
                stamps.reverse()
        for b, st in zip(todo, stamps):
            if not self.capacity:
                return
            while len(order) >= self.capacity:
                order.pop()
                self.evictions += 1
            order.set(b, st)


class LRUOrder(_StampPolicy):
    """Plain LRU (Mooncake's): every call touches its keys in order."""

    name = "lru"


class ReverseLRU(_StampPolicy):
    """LRU touching each call's keys back to front: a chain's tail is older than its head."""

    name = "lru-reverse"
    reverse = True


class PrefixLRU(_StampPolicy):
    """Reverse LRU where a write lands just behind the least recent hit of the caller's
    last lookup or read (its chain's deepest cached block), deeper blocks older; a write
    after a lookup without hits goes to the recent end, back to front."""

    name = "prefix-lru"
    reverse = True
    behind = True


class SegmentedLRU(OrderPolicy):
    """2Q / segmented LRU: a write enters *probation*; a hit moves the block to
    *protected* (at most ``protected`` of the capacity; its least recent block is demoted
    to probation's recent end).  Victims come from probation first.  Calls touch their
    keys back to front when ``reverse``."""

    def __init__(self, capacity: int, protected: float = 0.8, reverse: bool = True) -> None:
        super().__init__(capacity)
        self.name = f"slru-{int(protected * 100)}{'-rev' if reverse else ''}"
        self.prob: OrderedDict[int, None] = OrderedDict()
        self.prot: OrderedDict[int, None] = OrderedDict()
        self.limit = int(protected * capacity)
        self.reverse = reverse

    def __contains__(self, b: int) -> bool:
        return b in self.prot or b in self.prob

    def lookup(self, keys: Sequence[int]) -> None:
        prob, prot = self.prob, self.prot
        for b in (reversed(keys) if self.reverse else keys):
            if b in prot:
                prot.move_to_end(b)
            elif b in prob:
                del prob[b]
                prot[b] = None
                if len(prot) > self.limit:
                    old, _ = prot.popitem(last=False)
                    prob[old] = None

    def read(self, keys: Sequence[int]) -> None:
        self.lookup(keys)

    def write(self, keys: Sequence[int]) -> None:
        prob, prot = self.prob, self.prot
        for b in (reversed(keys) if self.reverse else keys):
            if b in self or not self.capacity:
                continue
            while len(prob) + len(prot) >= self.capacity:
                (prob or prot).popitem(last=False)
                self.evictions += 1
            prob[b] = None


class DepthLRU(_StampPolicy):
    """Reverse LRU where a block's stamp is lowered by ``depth`` keys of age per block of
    depth (its position in the request's chain): deep blocks of any chain go before
    shallow ones of about the same age (shallow blocks are the shared prefixes)."""

    reverse = True

    def __init__(self, capacity: int, depth: float = 4.0) -> None:
        super().__init__(capacity)
        self.name = f"depth-lru-{depth:g}"
        self.per_depth = int(depth * _STEP)
        self.hits = 0

    def lookup(self, keys: Sequence[int]) -> None:
        order = self.order
        hit = [(i, b) for i, b in enumerate(keys) if b in order]
        for i, b in reversed(hit):
            self.clock += _STEP
            order.set(b, self.clock - i * self.per_depth)
        self.hits = len(hit)

    def read(self, keys: Sequence[int]) -> None:
        pass  # (the lookup used them, at their depth)

    def write(self, keys: Sequence[int]) -> None:
        order = self.order
        todo = [b for b in keys if b not in order]
        stamps = []
        for _ in todo:
            self.clock += _STEP
            stamps.append(self.clock)
        stamps.reverse()
        for j, (b, st) in enumerate(zip(todo, stamps)):
            if not self.capacity:
                return
            while len(order) >= self.capacity:
                order.pop()
                self.evictions += 1
            order.set(b, st - (self.hits + j) * self.per_depth)


class AdaptiveLRU(OrderPolicy):
    """ARC (Megiddo and Modha, FAST'03): recency list ``t1`` (blocks seen once since
    they entered) and frequency list ``t2``, with ghost lists ``b1``/``b2`` of evicted
    keys steering the target size ``p`` of ``t1``.  O(1) per use.  Calls use their keys
    back to front when ``reverse``."""

    def __init__(self, capacity: int, reverse: bool = True) -> None:
        super().__init__(capacity)
        self.name = "arc-rev" if reverse else "arc"
        self.reverse = reverse
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.p = 0.0

    def __contains__(self, b: int) -> bool:
        return b in self.t1 or b in self.t2

    def lookup(self, keys: Sequence[int]) -> None:
        t1, t2 = self.t1, self.t2
        for b in (reversed(keys) if self.reverse else keys):
            if b in t1:
                del t1[b]
                t2[b] = None
            elif b in t2:
                t2.move_to_end(b)

    def _replace(self, in_b2: bool) -> None:
        t1, t2 = self.t1, self.t2
        if t1 and (len(t1) > self.p or (in_b2 and len(t1) == self.p)) or not t2:
            k, _ = t1.popitem(last=False)
            self.b1[k] = None
        else:
            k, _ = t2.popitem(last=False)
            self.b2[k] = None
        self.evictions += 1

    def write(self, keys: Sequence[int]) -> None:
        c = self.capacity
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        for x in (reversed(keys) if self.reverse else keys):
            if x in self or not c:
                continue
            ghost2 = x in b2
            if ghost2 or x in b1:  # a ghost hit: adapt p, then x enters t2
                if ghost2:
                    self.p = max(0.0, self.p - max(len(b1) / len(b2), 1))
                    del b2[x]
                else:
                    self.p = min(c, self.p + max(len(b2) / len(b1), 1))
                    del b1[x]
                if len(t1) + len(t2) >= c:
                    self._replace(ghost2)
                t2[x] = None
                continue
            if len(t1) + len(b1) >= c:
                if len(t1) < c:
                    b1.popitem(last=False)
                    if len(t1) + len(t2) >= c:
                        self._replace(False)
                else:
                    t1.popitem(last=False)
                    self.evictions += 1
            elif len(t1) + len(t2) >= c:
                if len(t1) + len(t2) + len(b1) + len(b2) >= 2 * c and b2:
                    b2.popitem(last=False)
                self._replace(False)
            t1[x] = None


def _order_policies() -> dict[str, Callable[[int], OrderPolicy]]:
    return {
        "lru": LRUOrder,
        "lru-reverse": ReverseLRU,
        "prefix-lru": PrefixLRU,
        "slru-80-rev": lambda c: SegmentedLRU(c, 0.8, True),
        "slru-50-rev": lambda c: SegmentedLRU(c, 0.5, True),
        "slru-80": lambda c: SegmentedLRU(c, 0.8, False),
        "depth-lru-4": lambda c: DepthLRU(c, 4.0),
        "arc": lambda c: AdaptiveLRU(c, False),
        "arc-rev": lambda c: AdaptiveLRU(c, True),
    }


#: Names of the simulated eviction orders (``reference --orders``).
ORDER_POLICIES = tuple(_order_policies())


def order_prefix_hit_rate(requests: Sequence[Request], capacity_blocks: int,
                          order: str) -> RefResult:
    """Prefix hit rate of the eviction order ``order`` (one of :data:`ORDER_POLICIES`):
    per request a lookup of all its blocks, a read of the cached ones, a write of the
    missing ones.  The result's ``policy`` is ``"order:<name>"``; ``order:lru`` equals
    :func:`lru_prefix_hit_rate` on prefix-chained traces."""
    _check_capacity(capacity_blocks)
    cache = _order_policies()[order](capacity_blocks)
    blocks = prefix_hits = block_hits = 0
    for req in requests:
        ids = req.hash_ids
        blocks += len(ids)
        prefix_hits += _leading_run(ids, cache)
        hits = [h for h in ids if h in cache]
        block_hits += len(hits)
        misses = list(dict.fromkeys(h for h in ids if h not in cache))
        cache.lookup(ids)
        cache.read(hits)
        cache.write(misses)
    return RefResult(f"order:{order}", capacity_blocks, len(requests), blocks, prefix_hits,
                     block_hits, cache.evictions)
