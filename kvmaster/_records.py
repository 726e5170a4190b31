"""Records the shard and its parts share: a leaf module (it imports nothing of the shard).

:class:`ObjectMeta` (one object or write in progress), :class:`SegmentShare` (a shard's
byte range of one segment), :class:`ClientView` (the caller as the front describes it),
:class:`StrandedWrite` (a quarantined write), :class:`FreeRuns` (frees batched run by
run), :class:`StatusError` (a handler's error answer), :data:`DEFERRED` (a handler's
"answered later"), :data:`Reply` (the output callback's shape) and :data:`Refs` with its
helpers (an object's session and group refs).  Owned and changed by
one :class:`kvmaster._shard.ShardActor` each; nothing here is shared between shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvmaster import protocol as P
from kvmaster._alloc import ALIGN, RangeAllocator
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster._shard import ShardActor

__all__ = ["DEFERRED", "HARD_PIN", "REFS_TUPLE_MAX", "START_ERRORS", "ClientView", "FreeRuns",
           "ObjectMeta", "Refs", "Reply", "SegmentShare", "StatusError", "StrandedWrite",
           "add_ref", "drop_ref", "has_ref", "iter_sessions", "ref_count"]

# ObjectMeta.flags bits
HARD_PIN = 1

#: A handler's return value meaning "the reply is sent later, by a walk".
DEFERRED = object()


class StatusError(Exception):
    """Raised inside a handler to answer with ``status`` and a one-line message."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class SegmentShare:
    """This shard's byte range of one mounted segment."""

    __slots__ = ("name", "owner", "alloc", "tenant")

    def __init__(self, name: str, owner: str, base: int, size: int,
                 tenant: bytes | None = None) -> None:
        self.name = name
        self.owner = owner
        self.alloc = RangeAllocator(base, size)
        #: Key prefix of the tenant whose writes it holds (kvmaster/_tenancy.py); None:
        #: shared by every tenant (the master's own segment, --shared-tenants).
        self.tenant = tenant


class ObjectMeta:
    """Metadata of one object, from its write's start (in ``ShardActor.writes``, a write
    in progress: PROCESSING) to its removal (in ``ShardActor.objects``: COMPLETE); the
    end of the write moves this same record from one map to the other (about 350 bytes
    with its key and map slot).

    ``seg``/``off`` hold the first replica; further replicas (replica_num > 1)
    are ``(SegmentShare, offset)`` pairs in ``more``.  ``lease`` and
    ``softpin`` are monotonic deadlines in seconds (0 = none).  ``writer`` and
    ``write_id`` name the write that stored it (the writer's client_id and the id its
    start gave; both objects shared, no copy), ``write_id`` None when the start named
    none: an end of that write sent again is answered 0 (kvmaster/_ends.py,
    ``WriteEnds.end_one``).

    While the write is in progress: ``started`` (monotonic seconds), ``config`` (its
    ReplicateConfig, None once ended), ``settled`` (False while the sessions of a
    session-tagged start are being registered: the write may still be refused, its
    start is not answered yet) and ``again_at`` (when its start was last answered
    again, see ``ShardActor._start_one``).

    ``checksum``: the xxh3_64 of the value's bytes that the writer sent with its end
    (protocol 1.4), None when it sent none (an older client, or checksums turned off):
    readers verify against it (kvmaster/_integrity.py).

    ``tag``: the session tag its write's start gave (protocol 1.5 ``session_tags``,
    Mooncake's ``session_ids``), None for none: shown by QUERY_KEY, no effect on
    eviction.
    """

    __slots__ = ("size", "seg", "off", "more", "lease", "softpin", "flags", "sessions",
                 "writer", "write_id", "started", "config", "settled", "again_at",
                 "checksum", "tag")

    def __init__(self, size: int, seg: SegmentShare, off: int, more: list | None,
                 softpin: float, flags: int, sessions: Refs,
                 writer: str = "", write_id: int | None = None, started: float = 0.0,
                 config: P.ReplicateConfigWire | None = None) -> None:
        self.size = size
        self.seg = seg
        self.off = off
        self.more = more
        self.lease = 0.0
        self.softpin = softpin
        self.flags = flags
        self.sessions = sessions
        self.writer = writer
        self.write_id = write_id
        self.started = started
        self.config = config
        self.settled = True
        self.again_at = 0.0
        self.checksum: int | None = None
        self.tag: bytes | None = None

    def replicas(self) -> list[tuple[SegmentShare, int]]:
        first = [(self.seg, self.off)]
        return first + self.more if self.more else first

    def keep(self, replicas: list[tuple[SegmentShare, int]]) -> None:
        """Point at ``replicas`` only (non-empty; the first becomes ``seg``/``off``)."""
        (self.seg, self.off), self.more = replicas[0], replicas[1:] or None

    def wire_replicas(self) -> list[list[Any]]:
        out = [[self.seg.name, self.off]]
        if self.more:
            out.extend([s.name, o] for s, o in self.more)
        return out


class FreeRuns:
    """Frees of many objects' ranges, given back to the allocator run by run: a range
    that starts where the run before it ends (or ends where it starts: a batch evicted
    tail first), in the same segment share and with the same deadline (0.0: free now,
    else the lease's end, deferred), extends the run, anything else starts a new one.
    A batch's keys are placed one after another
    (:meth:`kvmaster._starts.WriteStarts._start_batch_simple`) and their leases share
    one deadline, so removing or evicting them costs one release instead of one per key; the
    allocator's free extents come out as after one release per range.
    :meth:`flush` gives back the last run (call it in a ``finally``)."""

    __slots__ = ("end", "seg", "shard", "start", "when")

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard
        self.seg: SegmentShare | None = None
        self.start = self.end = 0
        self.when = 0.0

    def add(self, seg: SegmentShare, off: int, size: int, when: float) -> None:
        length = (size + ALIGN - 1) & ~(ALIGN - 1)
        if seg is self.seg and when == self.when:
            if off == self.end:
                self.end += length
                return
            if off + length == self.start:  # (a chain evicted tail first: prefix-lru)
                self.start = off
                return
        self.flush()
        self.seg, self.start, self.end, self.when = seg, off, off + length, when

    def flush(self) -> None:
        seg = self.seg
        if seg is None:
            return
        self.seg = None
        if self.when:
            self.shard.placement.defer_free(self.when, seg, self.start, self.end - self.start)
        else:
            self.shard.placement.free(seg, self.start, self.end - self.start)


class StrandedWrite:
    """A write the master gave up on while its writer may still be copying into it,
    kept allocated (quarantined) until that writer is done with it: a write dropped
    with an unmounted segment (its other replicas; the writer learns of the loss only
    from its PUT_END or PUT_REVOKE, which it sends once its copies are done), taken
    over by another writer after ``--put-start-discard-timeout``, or dropped at
    ``--put-start-release-timeout``.  Freed when its writer ends or revokes it, when
    the writer leaves (BYE) or is expired (``ShardActor.client_gone``), with the
    segment holding it, or at once when its tagged start is answered
    SEGMENT_NOT_FOUND (the writer was never told where to write).  Never on a
    timer: a stopped writer that resumes must not copy into space given to another
    object; it stops copying once its registration may have lapsed (the client's
    write fence, :mod:`kvmaster._fence`), and the master frees its writes at its
    expiry."""

    __slots__ = ("record",)

    def __init__(self, record: ObjectMeta) -> None:
        #: The given-up write's record, pointing at its kept replicas only (its writer,
        #: write_id and size say whose they are); None once they are freed.
        self.record: ObjectMeta | None = record


class ClientView:
    """What a shard knows of the caller: given by the front, read-only here."""

    __slots__ = ("client_id", "tenant", "prefix", "seed", "identity", "group")

    def __init__(self, client_id: str, tenant: str, identity: bytes) -> None:
        self.client_id = client_id
        self.tenant = tenant
        self.identity = identity
        # Keys of the default tenant are stored bare; others are prefixed with
        # "tenant NUL" (keys never contain NUL, so the two never collide).
        self.prefix = None if tenant == P.DEFAULT_TENANT else tenant.encode() + b"\x00"
        self.seed = P.tenant_seed(tenant)
        #: Reply group of the front (0: none); replies carry it back.
        self.group = 0

    def grouped(self, group: int) -> ClientView:
        """The same caller, with replies to be gathered in the front's ``group``."""
        v = ClientView.__new__(ClientView)
        v.client_id, v.tenant, v.prefix, v.seed, v.identity = (
            self.client_id, self.tenant, self.prefix, self.seed, self.identity)
        v.group = group
        return v


#: ``reply(identity, op, payload, group)``: ``group`` is the request's reply group
#: (:attr:`ClientView.group`, 0 for none).
Reply = Callable[[bytes, bytes, bytes, int], None]

#: The one-line message of each status a write's start may be refused with.
START_ERRORS = {
    Status.OBJECT_ALREADY_EXISTS: "object already exists or is being written",
    Status.SEGMENT_NOT_FOUND: "the write's segment was unmounted while its sessions "
                              "were being registered; nothing to write",
    Status.NO_AVAILABLE_HANDLE: "no space: insufficient segment capacity after eviction",
    Status.INVALID_PARAMS: "soft_pin_ttl_ms exceeds max_kv_soft_pin_ttl",
    Status.TENANT_QUOTA_EXCEEDED: "the tenant's quota is full (--tenant-quota-bytes or "
                                  "--tenant-max-writes) and nothing of its own can be evicted",
}


#: Object-side session refs are None, one id (bytes), a tuple of 2..REFS_TUPLE_MAX
#: ids, or a set beyond that: a 2-id set costs 216 bytes, a tuple 56, and adding
#: to a tuple this short is as cheap as to a set.
REFS_TUPLE_MAX = 8

Refs = bytes | tuple[bytes, ...] | set[bytes] | None


def iter_sessions(refs: Refs) -> Iterable[bytes]:
    if refs is None:
        return ()
    if type(refs) is bytes:
        return (refs,)
    # A tuple or a set here: mypy does not narrow bytes out on `type(...) is bytes`.
    return refs  # type: ignore[return-value]


def add_ref(refs: Refs, sck: bytes) -> Refs:
    """``refs`` plus ``sck`` (a new value for tuples; sets grow in place)."""
    if refs is None:
        return sck
    # The branches below go by ``kind``, which mypy does not narrow ``refs`` by (and
    # an isinstance per call would cost on every key): the ignores say so.
    kind = type(refs)
    if kind is bytes:
        return refs if refs == sck else (refs, sck)  # type: ignore[return-value]
    if kind is tuple:
        if sck in refs:
            return refs
        if len(refs) < REFS_TUPLE_MAX:
            return refs + (sck,)  # type: ignore[operator]
        grown: set[bytes] = set(refs)  # type: ignore[arg-type]
        grown.add(sck)
        return grown
    refs.add(sck)  # type: ignore[union-attr]
    return refs


def drop_ref(refs: Refs, sck: bytes) -> Refs:
    if refs is None:
        return None
    # As in add_ref: ``kind`` says what ``refs`` is; mypy does not narrow by it.
    kind = type(refs)
    if kind is bytes:
        return None if refs == sck else refs
    if kind is tuple:
        if sck not in refs:
            return refs
        rest = tuple(r for r in refs if r != sck)
        return rest[0] if len(rest) == 1 else rest  # type: ignore[return-value]
    refs.discard(sck)  # type: ignore[union-attr]
    if len(refs) == 1:
        return next(iter(refs))  # type: ignore[return-value]
    return refs or None


def has_ref(refs: Refs, sck: bytes) -> bool:
    if refs is None:
        return False
    if type(refs) is bytes:
        return refs == sck
    return sck in refs


def ref_count(refs: Refs) -> int:
    if refs is None:
        return 0
    return 1 if type(refs) is bytes else len(refs)
