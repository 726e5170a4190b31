"""Where a tenant's writes may go on one shard, and what they may take there.

Placement stays within the tenant.  Each mounted segment share
(:class:`kvmaster._shard.SegmentShare`) has a ``tenant``: the tenant of the client that
mounted it, or None for a *shared* segment (the master's own ``--master-segment-size``
segment, and the segments of the tenants named in ``--shared-tenants``).  A write of
tenant T is placed only on T's segments and the shared ones (T's :class:`TenantPool`),
never on another tenant's, so no tenant holds, serves or can overwrite the bytes of
another's objects; preferred segments and replica-copy targets outside the pool are
treated as absent.

Eviction stays within the tenant too: each pool has its own eviction order
(``--eviction-policy``) over the tenant's objects, and a write short of space evicts
only its own tenant's objects (the space they free is in its pool: its own segments or
a shared one), so a tenant writing hard cannot flush another's cache.

Quotas (``--tenant-quota-bytes``, ``--tenant-max-writes``): with either set, the
shard's object and write maps count each tenant's bytes (every replica, rounded up to
the allocation unit, hard-pinned objects included, plus the master memory of each
record: its key and :data:`OBJECT_OVERHEAD`, so a quota also caps how many objects a
tenant keeps per byte) and writes in progress
(:class:`CountedObjects`, :class:`CountedWrites`; plain dicts when no quota is set, so
the default costs nothing).  Each shard enforces its share of a quota, ``ceil(quota /
shards)``, as it does for ``--kv-session-max-sessions``: keys hash evenly across shards,
and no shard asks another.  A write that would take its tenant past the byte quota first
evicts the tenant's own least recent objects; when none can go (leased, pinned, being
written) it is refused ``TENANT_QUOTA_EXCEEDED`` (-1700), as is a write past the writes
quota.  The quota counts all of the tenant's bytes, on its own segments too (a write
goes to the pool's segment with the most free space, which may be a shared one): set it
at least at the size of the segments a tenant brings.  The admin tenant
(``--admin-tenant``) has no quota.

Tenants are named by the prefix of their stored keys: ``tenant NUL`` (b"" for the
default tenant, whose keys are stored bare).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvmaster._eviction import EvictionOrder, make_order

if TYPE_CHECKING:
    from kvmaster._records import ObjectMeta, SegmentShare

__all__ = ["CountedObjects", "CountedWrites", "Tenancy", "TenantPool", "prefix_of",
           "OBJECT_OVERHEAD", "charge", "footprint", "prefix_of_tenant"]

#: Most tenants with a pool on one shard.  A pool goes when its tenant has no segment,
#: object or write left on the shard; past the bound, a new tenant's write is refused
#: TENANT_QUOTA_EXCEEDED (without CURVE a client names its own tenant).
MAX_TENANTS = 4096


def prefix_of_tenant(tenant: str, default: str) -> bytes:
    """The stored-key prefix of ``tenant`` (b"" for the default tenant ``default``)."""
    return b"" if tenant == default else tenant.encode() + b"\x00"


def prefix_of(ck: bytes) -> bytes:
    """The tenant prefix of a stored key (``tenant NUL``, or b"")."""
    i = ck.find(b"\x00")
    return b"" if i < 0 else ck[:i + 1]


#: Bytes of master memory an object's record costs beyond its key (measured: about
#: 4.5 KB per object with 4 KB keys), charged to its tenant's quota with the key.
OBJECT_OVERHEAD = 512


def charge(ck: bytes, obj: ObjectMeta) -> int:
    """What an object or write of ``ck`` counts against its tenant's byte quota: its
    replicas' space and the master memory of its record (key and
    :data:`OBJECT_OVERHEAD`), so a quota bounds both."""
    return footprint(obj) + len(ck) + OBJECT_OVERHEAD


def footprint(obj: ObjectMeta) -> int:
    """Bytes an object or write holds: every replica, rounded up to the unit."""
    n = (obj.size + 63) & ~63
    more = obj.more
    return n * (1 + len(more)) if more else n


_get = dict.get
_set = dict.__setitem__
_del = dict.__delitem__
_pop = dict.pop


def _less(d: dict[bytes, int], p: bytes, n: int) -> None:
    left = _get(d, p, 0) - n
    if left > 0:
        d[p] = left
    else:
        d.pop(p, None)


class CountedObjects(dict):
    """The shard's object map, counting each tenant's bytes (``usage[prefix]``).

    Only the mutators the shard uses are counted: item set and delete, ``pop``,
    ``popitem`` and ``clear``.  An object whose replicas change in place (a replica
    dropped or copied) is recounted with :meth:`recount`."""

    __slots__ = ("usage",)

    def __init__(self, usage: dict[bytes, int]) -> None:
        super().__init__()
        self.usage = usage

    def __setitem__(self, ck: bytes, obj: Any) -> None:
        old = _get(self, ck)
        i = ck.find(b"\x00")
        p = b"" if i < 0 else ck[:i + 1]
        u = self.usage
        u[p] = _get(u, p, 0) + charge(ck, obj) - (0 if old is None else charge(ck, old))
        _set(self, ck, obj)

    def __delitem__(self, ck: bytes) -> None:
        obj = _pop(self, ck)
        _less(self.usage, prefix_of(ck), charge(ck, obj))

    def pop(self, ck: bytes, *default: Any) -> Any:
        obj = _pop(self, ck, _MISSING)
        if obj is _MISSING:
            if default:
                return default[0]
            raise KeyError(ck)
        _less(self.usage, prefix_of(ck), charge(ck, obj))
        return obj

    def popitem(self) -> tuple[bytes, Any]:
        ck, obj = dict.popitem(self)
        _less(self.usage, prefix_of(ck), charge(ck, obj))
        return ck, obj

    def clear(self) -> None:
        dict.clear(self)
        self.usage.clear()

    def released(self, prefix: bytes, nbytes: int) -> None:
        """Objects of ``nbytes`` in all were deleted with ``dict.__delitem__``."""
        _less(self.usage, prefix, nbytes)

    def recount(self, ck: bytes, before: int) -> None:
        """The object of ``ck`` held ``before`` bytes and now holds what it does."""
        p = prefix_of(ck)
        self.usage[p] = _get(self.usage, p, 0) - before + footprint(dict.__getitem__(self, ck))


_MISSING = object()


class CountedWrites(dict):
    """The shard's map of writes in progress, counting each tenant's writes and bytes
    (``count[prefix]``, ``usage[prefix]``; the bytes are shared with
    :class:`CountedObjects`, so a write's bytes count from its start)."""

    __slots__ = ("usage", "count")

    def __init__(self, usage: dict[bytes, int], count: dict[bytes, int]) -> None:
        super().__init__()
        self.usage = usage
        self.count = count

    def __setitem__(self, ck: bytes, pw: Any) -> None:
        old = _get(self, ck)
        i = ck.find(b"\x00")
        p = b"" if i < 0 else ck[:i + 1]
        u, c = self.usage, self.count
        if old is not None:
            u[p] = _get(u, p, 0) - charge(ck, old)
            c[p] = _get(c, p, 0) - 1
        u[p] = _get(u, p, 0) + charge(ck, pw)
        c[p] = _get(c, p, 0) + 1
        _set(self, ck, pw)

    def __delitem__(self, ck: bytes) -> None:
        self._less(ck, _pop(self, ck))

    def started(self, prefix: bytes, n: int, nbytes: int) -> None:
        """``n`` new writes of ``nbytes`` in all (no key replaced) were set with
        ``dict.__setitem__``: count them."""
        self.count[prefix] = _get(self.count, prefix, 0) + n
        self.usage[prefix] = _get(self.usage, prefix, 0) + nbytes

    def settled(self, prefix: bytes, n: int) -> None:
        """``n`` writes of the tenant ``prefix`` were taken out with ``dict.__delitem__``
        and stored, as they are, in the :class:`CountedObjects` with
        ``dict.__setitem__``: their bytes stay counted, the writes count drops."""
        _less(self.count, prefix, n)

    def pop(self, ck: bytes, *default: Any) -> Any:
        pw = _pop(self, ck, _MISSING)
        if pw is _MISSING:
            if default:
                return default[0]
            raise KeyError(ck)
        self._less(ck, pw)
        return pw

    def clear(self) -> None:
        for ck, pw in list(self.items()):
            self._less(ck, pw)
        dict.clear(self)

    def _less(self, ck: bytes, pw: Any) -> None:
        p = prefix_of(ck)
        _less(self.usage, p, charge(ck, pw))
        _less(self.count, p, 1)


class TenantPool:
    """One tenant's view of a shard: the segments its writes may use (its own and the
    shared ones), the largest of their shares, and the eviction order of its objects."""

    __slots__ = ("prefix", "segments", "max_share", "order", "capacity")

    def __init__(self, prefix: bytes, order: EvictionOrder) -> None:
        self.prefix = prefix
        self.segments: dict[str, SegmentShare] = {}
        self.max_share = 0
        self.capacity = 0
        self.order = order

    def used(self) -> int:
        """Bytes allocated in the pool's segments (by any tenant, on shared ones)."""
        return sum(s.alloc.used for s in self.segments.values())


class Tenancy:
    """The tenants' pools of one shard (see the module docstring)."""

    def __init__(self, policy: str, objects: Any) -> None:
        self.policy = policy
        self.objects = objects
        #: prefix -> pool; segment shares by their tenant's prefix (None: shared).
        self.pools: dict[bytes, TenantPool] = {}
        self._own: dict[bytes | None, dict[str, SegmentShare]] = {}
        #: Segments of suspected clients (``--client-suspicion-ttl``): in no pool, so no
        #: write is placed there; their objects stay where they are, readable.
        self.suspected: set[str] = set()

    def pool(self, prefix: bytes) -> TenantPool | None:
        """The pool of the tenant with key prefix ``prefix``, made on first use; None
        past :data:`MAX_TENANTS`."""
        pool = self.pools.get(prefix)
        if pool is None:
            if len(self.pools) >= MAX_TENANTS:
                self._drop_empty()
                if len(self.pools) >= MAX_TENANTS:
                    return None
            pool = self.pools[prefix] = TenantPool(prefix, make_order(self.policy, self.objects))
            self._fill(pool)
        return pool

    def order(self, prefix: bytes) -> EvictionOrder | None:
        """The eviction order of a tenant, if it has a pool."""
        pool = self.pools.get(prefix)
        return None if pool is None else pool.order

    def orders(self) -> Iterable[EvictionOrder]:
        return [p.order for p in self.pools.values()]

    def mount(self, seg: SegmentShare, prefix: bytes | None) -> None:
        """A segment share was mounted for the tenant ``prefix`` (None: shared)."""
        self._own.setdefault(prefix, {})[seg.name] = seg
        for pool in self.pools.values():
            if prefix is None or prefix == pool.prefix:
                self._fill(pool)

    def unmount(self, seg: SegmentShare) -> None:
        self.suspected.discard(seg.name)
        for prefix, segs in list(self._own.items()):
            if segs.get(seg.name) is seg:
                del segs[seg.name]
                if not segs:
                    del self._own[prefix]
        for pool in self.pools.values():
            if seg.name in pool.segments:
                self._fill(pool)

    def suspect(self, name: str, on: bool) -> None:
        """Take segment ``name`` out of every pool (``on``: its client is suspected) or
        put it back.  A pool's capacity and use then count its other segments only."""
        if on:
            self.suspected.add(name)
        else:
            self.suspected.discard(name)
        for pool in self.pools.values():
            self._fill(pool)

    def _fill(self, pool: TenantPool) -> None:
        segs = dict(self._own.get(pool.prefix, {}))
        segs.update(self._own.get(None, {}))
        if self.suspected:
            for name in self.suspected:
                segs.pop(name, None)
        pool.segments = segs
        pool.max_share = max((s.alloc.size for s in segs.values()), default=0)
        pool.capacity = sum(s.alloc.size for s in segs.values())

    def _drop_empty(self) -> None:
        """Forget the pools of tenants with no segment and no object left here (a scan of
        the objects: only when the bound is reached)."""
        live = {prefix_of(ck) for ck in self.objects}
        for prefix in list(self.pools):
            if prefix not in self._own and prefix not in live:
                del self.pools[prefix]
