"""Records, constants and helpers of the client side (a leaf: it imports no other
client module): the config dataclasses (:class:`ClientConfig`, :class:`ReplicateConfig`),
what calls return (:class:`KvSessionInfo`, :class:`KvSessionPage`, :class:`CopyPlan`,
:class:`PendingPuts`, :class:`ReadLeases`), the round markers the drivers read
(:class:`Tolerant`, :class:`NoWait`), the retry constants both drivers share, and the
wire helpers of the operations.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._fence import WriteFence
from kvmaster.protocol import Op, SoftPinAction, Status

_monotonic = time.monotonic
_crc32 = zlib.crc32
_STR_ONLY = frozenset((str,))

Request = tuple[bytes, bytes, list[Any]]

#: First and longest pause before a request refused with BUSY is sent again, s.
BUSY_FIRST_PAUSE_S = 0.001
BUSY_MAX_PAUSE_S = 0.05
#: How long a request of a NoWait round (a failed put's revoke) refused BUSY keeps
#: being sent again, s: the master's default ``--put-start-discard-timeout``, after
#: which another writer can take the key over anyway.
PARTING_RETRY_S = 30.0
#: Most NoWait requests a client keeps to send (again); past it the oldest are dropped
#: (their writes then wait for the master's discard timeout).
MAX_PARTING = 4096
#: Most byte ranges one ``get_into_ranges`` call copies.
MAX_RANGES = 1 << 16

#: Reply statuses after which a call re-handshakes and sends its round again: the
#: master does not know the client, or is a standby.
RECONNECT = (Status.NOT_REGISTERED, Status.UNAVAILABLE_IN_CURRENT_STATUS)
#: With HA, also a master that is shutting down (a leader stepping down, or stopped by
#: an operator): the round goes to the next leader, as when a master stops answering.
RECONNECT_HA = (*RECONNECT, Status.SHUTTING_DOWN)

_T = TypeVar("_T")
#: A client operation: a generator of request rounds, sent the replies of each, whose
#: return value is the operation's result (``OpGen[bytes]``: the driver returns bytes).
OpGen = Generator[list[Request], list[Any], _T]

#: Ops whose replies give out space to write or replica locations to read: with HA,
#: their replies are used only when they come within the leader's ``reply_trust_ms``.
SPACE_OPS = frozenset(op.value for op in (
    Op.PUT_START, Op.BATCH_PUT_START, Op.UPSERT_START, Op.BATCH_UPSERT_START,
    Op.PUT_START_WITH_KV_SESSIONS, Op.BATCH_PUT_START_WITH_KV_SESSIONS,
    Op.UPSERT_START_WITH_KV_SESSIONS, Op.BATCH_UPSERT_START_WITH_KV_SESSIONS,
    Op.GET_REPLICA_LIST, Op.BATCH_GET_REPLICA_LIST, Op.COPY_REPLICAS_PREPARE))
#: Attempts at re-mounting the segment after a re-handshake that the master refuses
#: (SEGMENT_ALREADY_EXISTS, ILLEGAL_CLIENT, INVALID_PARAMS: not BUSY or a lost
#: connection), the pause before the second MOUNT_RETRY_FIRST_S and doubling (0.2,
#: 0.4, 0.8 s: 1.4 s in all, within the call's deadline).  Then the segment is given
#: up for a new one under a new name, mounted once (its objects are gone anyway:
#: the master that refuses it does not hold them).
MOUNT_ATTEMPTS = 4
MOUNT_RETRY_FIRST_S = 0.2
#: Times ``update_kv_session`` sends its keep set again from the first page (new
#: token) after the master refused a page UPDATE_DISCARDED, before raising it.
UPDATE_RESTARTS = 2


@dataclass
class ReplicateConfig:
    """Placement and pinning of a write (Mooncake ``ReplicateConfig``).

    replica_num: replicas on distinct segments (best effort beyond the first).
    with_hard_pin: never evicted.  soft_pin_action / soft_pin_ttl_ms: see
    :class:`~kvmaster.protocol.SoftPinAction`; a TTL is allowed only with ENABLE.
    preferred_segments: segment names tried first.
    """

    replica_num: int = 1
    with_hard_pin: bool = False
    soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
    soft_pin_ttl_ms: int | None = None
    preferred_segments: Sequence[str] | None = ()  # (None: none, as ())
    #: Sessions to tag each written key with: one inner list per key (a single-key
    #: write takes exactly one).  None or empty lists tag nothing.
    kv_sessions: Sequence[Sequence[str]] | None = None
    #: Key groups of a batch write (Mooncake ``ReplicateConfig.group_ids``): one id per
    #: key, "" for none.  Members of a group share read leases and are evicted together
    #: (best effort, see protocol/PROTOCOL.md section 14); a key over a group bound
    #: answers GROUP_LIMIT_EXCEEDED (-1906).  A single-key write takes one id (it is
    #: sent as a batch of one).  Not carried with ``kv_sessions`` (the session-tagged
    #: starts have no such field).
    group_ids: Sequence[str] | None = None
    #: Session tags of a batch write (Mooncake 0.3.14's ``ReplicateConfig.session_ids``):
    #: one per key, "" for none.  Kept with the object (``query_key``'s
    #: ``session_tag``, ``kvmaster ctl key``), no effect on eviction; a master run with
    #: ``--session-tags-as-kv-sessions`` makes each a membership of that session instead
    #: (as ``kv_sessions``; such a write carries no group ids).  Not carried with
    #: ``kv_sessions``.  Needs a 1.5 master.
    session_tags: Sequence[str] | None = None

    def to_wire(self) -> list[Any]:
        return [self.replica_num, self.with_hard_pin, int(self.soft_pin_action),
                self.soft_pin_ttl_ms, list(self.preferred_segments or ())]


@dataclass(frozen=True)
class CopyPlan:
    """A copy prepared by ``copy_prepare``: the object's size, its replicas to read
    (``sources``), the new ranges to write (``new``, ``[[segment, offset], ...]``), the
    master's token for the commit and the lease's monotonic deadline."""

    key: str
    size: int
    sources: list[list[Any]]
    new: list[list[Any]]
    token: int
    deadline: float
    #: The copy's write fence (its new ranges are freed when this client is expired).
    fence: WriteFence | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class KvSessionInfo:
    """``get_kv_session`` result."""

    session_id: str
    pinned: bool
    member_count: int


@dataclass(frozen=True)
class KvSessionPage:
    """``list_kv_session_keys`` result; ``next_cursor`` is "" when the walk is done."""

    keys: list[str]
    next_cursor: str


@dataclass(frozen=True)
class ClientConfig:
    """Configuration of a client (one field per setup argument)."""

    master_server_addr: str = "127.0.0.1:50051"
    global_segment_size: int = 0
    tenant: str = P.DEFAULT_TENANT
    local_hostname: str = ""
    #: Seconds one call may take, from its start: waiting for the client (the
    #: heartbeat may be reconnecting), all its round trips (a put's start, segment
    #: lookup and end; an update's pages), pauses between BUSY resends, and a
    #: re-handshake it makes; then ``Timeout`` (``Busy`` when the master refused to
    #: the end).  Not counted: the ``on_reconnect`` hook, and copying bytes through
    #: a transfer service (its own ``timeout_s`` per transfer).  A put that fails
    #: once its start was sent revokes its write (without waiting for the answer).
    #: Also the bound of setup's segment mount.
    timeout_s: float = 10.0
    #: Seconds setup's handshake (HELLO) may take, and a reconnect's; a re-handshake
    #: within a call also ends by that call's deadline.
    connect_timeout_s: float = 5.0
    #: Longest pause between the heartbeat thread's reconnect attempts, s.
    reconnect_max_backoff_s: float = 5.0
    #: With ``curve_client``: the key directory from ``kvmaster keygen`` (needs
    #: ``master.key`` and ``clients/<curve_client>.key_secret``).
    curve_dir: str = ""
    curve_client: str = ""
    #: Address the segment's transfer service binds to and advertises, so clients on
    #: other hosts can read and write it.  Off ("") by default: the service serves the
    #: segment's bytes to whoever connects unless CURVE is on (then only to keys of
    #: the key directory's clients/), so turn it on deliberately.
    transfer_host: str = ""
    #: Move bytes through transfer services even when the segment is on this host.
    force_transfer: bool = False
    #: glibc only, once per process, at setup: keep up to this many MiB of freed heap
    #: (``M_TRIM_THRESHOLD``) and serve allocations up to 32 MiB from the heap
    #: (``M_MMAP_THRESHOLD``).  Without it every get()/get_batch() of large blocks
    #: allocates fresh pages for its bytes objects and page-faults them in (a 64 KiB
    #: copy then costs ~15x a warm one).  At most 2047 (larger values are taken as
    #: 2047).  0 leaves malloc alone; so does a
    #: ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_THRESHOLD_`` in the environment.
    retain_heap_mb: int = 256
    #: Resend a request the master answered BUSY (back-pressure: nothing was done)
    #: after a pause of 1 ms, doubling up to 50 ms, while the call's ``timeout_s``
    #: leaves room; then raise Busy.  False raises Busy at the first refusal.
    busy_retry: bool = True
    #: Check every whole-object read (get, get_buffer, get_into, get_batch,
    #: batch_get_into, batch_get_into_parts, batch_get_into_ptrs and the facade's forms
    #: of them) against the checksum its writer stored (protocol 1.4): a replica whose
    #: bytes differ is skipped for the next one and the master is asked to drop it; with
    #: none left the read raises ChecksumMismatch (-801), a batch position answers -801
    #: (get_batch: None), and the buffer read into holds undefined bytes.  Objects stored
    #: without a checksum, and ranged reads (get_into_ranges, batch_read_ranges), are not
    #: checked.  Counted in ``Client.checksum_mismatches`` (replicas found corrupt) and
    #: ``checksum_failures`` (reads left without a good replica).  See RELIABILITY.md
    #: "Integrity" for the cost.
    verify_checksums: bool = True
    #: Compute the xxh3_64 of every value written (put, upsert, their batch, parts and
    #: pointer forms; a split put's from the segment at its end) and send it with the
    #: write's end, for readers to verify.  False stores objects without one (not
    #: verified by anyone).
    write_checksums: bool = True


_HEAP_TUNED = False


def retain_heap(mb: int) -> bool:
    """Apply :attr:`ClientConfig.retain_heap_mb` (process-wide, first call only).

    Returns True when malloc was tuned now.  A no-op on non-glibc systems, for
    ``mb <= 0`` and when the environment already sets glibc's malloc thresholds.
    """
    global _HEAP_TUNED
    if _HEAP_TUNED or mb <= 0 or "MALLOC_TRIM_THRESHOLD_" in os.environ \
            or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    _HEAP_TUNED = True
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    # mallopt takes a C int: 2047 MiB is the largest threshold it can express.
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(
        mallopt(m_trim_threshold, min(mb, 2047) << 20))


class Welcome:
    """What the handshake told us."""

    __slots__ = ("shard_count", "seed", "lease_ttl_ms", "client_ttl_ms", "max_batch", "tenant",
                 "master_host", "instance", "session_batch", "any_shard", "routes", "columns", "multi",
                 "trust_s", "release_s", "tags", "tags_as_sessions")

    def __init__(self, body: dict[str, Any]) -> None:
        self.shard_count = body["shard_count"]
        self.tenant = body["tenant"]
        self.seed = P.tenant_seed(self.tenant)
        self.lease_ttl_ms = body["lease_ttl_ms"]
        self.client_ttl_ms = body["client_ttl_ms"]
        #: ``--put-start-release-timeout`` in s (None from a master that does not say):
        #: a write is dropped this long after its start (the write fence, _fence.py).
        release = body.get("put_start_release_timeout_ms")
        self.release_s = release / 1000 if isinstance(release, int) and release >= 0 else None
        self.max_batch = body["limits"]["max_batch"]
        self.session_batch = body["limits"].get("kv_session_max_batch", self.max_batch)
        self.master_host = body.get("master_host_id", "")
        #: Id of the master process ("" from a master that does not say).
        self.instance = body.get("master_instance", "")
        self.any_shard = bool(body.get("batch_any_shard", False))
        #: The master takes ``columns`` in batch gets and starts (protocol 1.1).
        self.columns = tuple(body.get("protocol", ()))[:2] >= (1, 1)
        #: The master takes ``session_tags`` in batch starts (protocol 1.5), and whether
        #: it wants them sent as session memberships (``--session-tags-as-kv-sessions``).
        self.tags = tuple(body.get("protocol", ()))[:2] >= (1, 5)
        self.tags_as_sessions = bool(body["limits"].get("session_tags_as_kv_sessions"))
        #: The master takes several requests in one message (protocol 1.2).
        self.multi = tuple(body.get("protocol", ()))[:2] >= (1, 2)
        #: Route frame of each shard, by index.
        self.routes = tuple(P.route_for_shard(i) for i in range(self.shard_count))
        #: An HA leader's ``reply_trust_ms``, in s (None without HA): a reply giving out
        #: space or replica locations that comes later than this after its request may
        #: be a paused former leader's, and is not used (HA.md, "Fencing").
        trust = body.get("reply_trust_ms")
        self.trust_s = trust / 1000 if isinstance(trust, int) and trust > 0 else None


class RoutingChanged(E.ConnectionLost):
    """After a re-handshake the master has another shard layout (shard count, tenant
    seed, batch routing or batch reply form): requests built for the old one would be
    misrouted or misread, so the call was not resent.  The drivers run the operation
    again once."""


class Tolerant(list):
    """Yielded instead of a plain list when failed requests must come back as their
    exceptions, in place, instead of being thrown into the generator."""


class NoWait(list):
    """Yielded instead of a plain list for requests sent without waiting for their replies,
    whatever is left of the call's deadline: each goes out at once (non-blocking), and
    the call goes on. One that cannot be queued (a full send queue) or that the master
    refuses BUSY is sent again in the background, after a pause of 1 ms doubling to 50
    ms, for up to :data:`PARTING_RETRY_S` (the sync client sends it with its next call
    or heartbeat); one whose connection is replaced before its reply came is sent again
    on the next connection to the same master process (dropped for another process,
    which never saw the write); other replies are skipped like late ones. At most
    :data:`MAX_PARTING` are kept. The generator gets ``None`` per request. The drivers
    throw every exception of a round into the generator (transport errors and a signal
    handler's exceptions too), so an operation can undo what it started before the error
    reaches the caller."""


def master_changed(endpoint: str) -> E.ConnectionLost:
    """The error of a round whose connection went to another master process during a
    BUSY pause (a failover, a restart): the answers it already had came from the one
    before and must not be used with the new one's."""
    return E.ConnectionLost("the master changed during the call (a failover or a restart): "
                            "the answers the call already had are not used",
                            endpoint=endpoint)


def rehandshake_reason(exc: BaseException | None) -> str:
    """Why a client re-handshakes, for its log line: the error that made it (None: an
    earlier re-handshake did not finish)."""
    if exc is None:
        return "an earlier re-handshake did not finish"
    if isinstance(exc, E.NotRegistered):
        return "the master does not know this client (a restart, or it expired the client)"
    if isinstance(exc, E.ShuttingDown):
        return "the master is stopping"
    if isinstance(exc, E.Unavailable):
        return "the master does not serve (a standby)"
    return f"{exc}"


def unanswered(exc: BaseException, n: int) -> Sequence[int]:
    """Positions, among a failed round's ``n`` requests, of those that got no answer
    (no reply by the deadline, refused BUSY to the end, or never sent): what they
    asked for was not done, or may still be done.  The drivers put them in
    ``exc.unanswered`` when only some requests of a round failed; a status other
    than BUSY is an answer."""
    positions = getattr(exc, "unanswered", None)
    if positions is not None:
        return positions
    if isinstance(exc, E.RequestError) and exc.code != Status.BUSY:
        return ()
    return range(n)


def operation(fn: Callable[..., OpGen]) -> Callable[..., OpGen]:
    """Mark a generator method as a client operation (drivers wrap it by name)."""
    fn.__kv_operation__ = True  # type: ignore[attr-defined]
    return fn


def operations(cls: type) -> dict[str, Callable[..., OpGen]]:
    """The client operations of ``cls`` and its bases, by name (a base's first, as
    its method resolution order has them; a subclass's definition wins)."""
    found: dict[str, Callable[..., OpGen]] = {}
    for klass in reversed(cls.__mro__):
        for name, fn in vars(klass).items():
            if getattr(fn, "__kv_operation__", False):
                found[name] = fn
    return found


def endpoint_of(addr: str) -> str:
    return addr if "://" in addr else f"tcp://{addr}"


#: Longest wait for setup's look-up of a master host name.
RESOLVE_TIMEOUT_S = 2.0


def check_master_address(addr: object) -> None:
    """Raise InvalidParams, with one line saying what is wrong, for a master address
    that cannot name a master: not ``host:port``, ``tcp://host:port``, ``ipc://path``
    or ``etcd://host:port[,host:port...]/cluster``; a port outside 1-65535; a host
    name that does not resolve."""

    def bad(why: str) -> E.InvalidParams:
        return E.InvalidParams(f"master address {addr!r}: {why}", op="setup")

    if not isinstance(addr, str):
        raise bad(f"must be a str, not {type(addr).__name__}")
    if addr.startswith("etcd://"):
        from kvmaster.ha import parse_etcd_address

        try:
            endpoints, _ = parse_etcd_address(addr) or ([], "")
        except ValueError:
            raise bad("use etcd://host:port[,host:port...]/cluster_id") from None
        for ep in endpoints:
            _check_host_port(ep[len("http://"):], bad, resolve=False)
        return
    scheme, sep, rest = addr.partition("://")
    if not sep:
        scheme, rest = "tcp", addr
    if scheme == "ipc":
        if not rest:
            raise bad("ipc:// needs a socket path (ipc:///run/kvmaster.sock)")
        return
    if scheme != "tcp":
        raise bad(f"scheme {scheme + '://'!r} is not one of tcp://, ipc://, etcd://")
    _check_host_port(rest, bad, resolve=True)


def _check_host_port(hp: str, bad: Callable[[str], E.InvalidParams], resolve: bool) -> None:
    import ipaddress
    import socket

    host, sep, port = hp.rpartition(":")
    if not sep:
        raise bad("no port (use host:port, e.g. 127.0.0.1:50051)")
    if not port.isdigit() or not port.isascii():
        raise bad(f"port {port!r} is not a number (use host:port, e.g. 127.0.0.1:50051)")
    if not 1 <= int(port) <= 65535:
        raise bad(f"port {int(port)} is outside 1-65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise bad(f"{host} is not an IPv6 address") from None
        return
    if not host:
        raise bad("no host (use host:port, e.g. 127.0.0.1:50051)")
    if host == "*":
        return
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if ":" in host:
        raise bad("an IPv6 address goes in brackets: [::1]:50051")
    if not resolve:
        return
    # A look-up that does not end within RESOLVE_TIMEOUT_S (a resolver that does not
    # answer) says nothing: the connect then waits for the master as usual.
    failed: list[BaseException] = []

    def look_up() -> None:
        try:
            socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            failed.append(exc)

    import threading

    t = threading.Thread(target=look_up, daemon=True, name="kvmaster-resolve")
    t.start()
    t.join(RESOLVE_TIMEOUT_S)
    if failed:
        raise bad(f"host {host!r} does not resolve ({failed[0]})")


#: What an end answers for a write its master does not have.
_LOST_WRITE = frozenset((Status.OBJECT_NOT_FOUND, Status.SEGMENT_NOT_FOUND))


def _columns_replicas(body: Sequence[Any]) -> Iterator[list[Any]]:
    """The segments a columnar batch reply names, as replicas for ``_know``."""
    for name in body[0]:
        yield [name, 0]
    for _, replicas in body[3]:
        yield from replicas


def _unreadable(failed: list[Exception]) -> E.KVMasterError:
    """The error of a read none of whose replicas could be read (``failed``: why, per
    replica).  A replica whose bytes failed their checksum makes it ChecksumMismatch.
    Every replica's segment file gone from this host means their owners
    left (unmounted) after the master answered: the object went with them, so
    ObjectNotFound (a batch read answers that position as missing); anything else
    (a cut link, a peer's error, a segment its owner shrank) is TRANSFER_FAIL."""
    bad = [exc for exc in failed if isinstance(exc, E.ChecksumMismatch)]
    if bad:
        return E.ChecksumMismatch(f"{len(bad)} of {len(failed)} replicas failed their "
                                  f"checksum, none readable: {bad[-1].args[0]}", op="get")
    if all(isinstance(exc, FileNotFoundError) for exc in failed):
        return E.ObjectNotFound(f"object gone with its segment: {failed[-1]}")
    return E.KVMasterError(f"no replica readable: {failed[-1]}", code=Status.TRANSFER_FAIL)


def _lease_expired(what: str, op: str) -> E.LeaseExpired:
    return E.LeaseExpired(f"read of {what} outlived its lease; bytes discarded", op=op)


def _late_statuses(out: Sequence[int], sums: Sequence[int | None] | None) -> list[int]:
    """The statuses of a batch read that ended after its read lease (``out``: bytes
    read or a negative status per position; ``sums``: the objects' checksums as the
    lease gave them, None for none: a whole-object read with one checks the bytes it
    copied against it, so a position with a checksum and a size was checked).

    A checked position keeps its size: its bytes are the object's (xxh3_64 of what
    was copied equals what the writer stored), whatever became of the space once the
    lease ended.  Any other copied position answers LEASE_EXPIRED (-707): the master
    may have freed and reused the space meanwhile, so its bytes may be another
    object's.  A CHECKSUM_MISMATCH answers LEASE_EXPIRED too (reused space looks
    corrupt), and such a read reports no replica as corrupt.  Other statuses stay."""
    expired, mismatch = int(Status.LEASE_EXPIRED), int(Status.CHECKSUM_MISMATCH)
    if sums is None:
        return [expired if n >= 0 or n == mismatch else int(n) for n in out]
    return [expired if (n >= 0 and c is None) or n == mismatch else int(n)
            for n, c in zip(out, sums)]


def _at(items: list[Any], positions: list[int]) -> list[Any]:
    """``[items[i] for i in positions]``; ``items`` itself when ``positions`` are all of
    them (ascending positions, as in a batch's groups: a batch that goes to one shard
    whole is sent as it is)."""
    if len(positions) == len(items):
        return items
    return [items[i] for i in positions]


def _write_failure(exc: Exception) -> int:
    """A batch position's status for a copy that failed with ``exc`` (then revoked): a
    segment file gone from this host means its owner left after the start (the master
    drops such a write with the segment), so SEGMENT_NOT_FOUND, as its end would have
    answered: the write is lost and may be started again.  Else TRANSFER_FAIL."""
    return Status.SEGMENT_NOT_FOUND if isinstance(exc, FileNotFoundError) \
        else Status.TRANSFER_FAIL


class _Mappings(dict):
    """Segment name -> the buffer of its mapping on this host, or None; each name is
    looked up once (one call's reads or writes)."""

    __slots__ = ("_look_up",)

    def __init__(self, look_up: Callable[[str], Any]) -> None:
        super().__init__()
        self._look_up = look_up

    def __missing__(self, name: str) -> Any:
        view = self[name] = self._look_up(name)
        return view


_PLAIN_BYTES = frozenset((bytes, bytearray))


def _byte_values(values: Sequence[Any], op: str) -> Sequence[Any]:
    """``values`` as bytes, bytearray or one-byte-per-item memoryviews, so that ``len``
    of each is its size in bytes (a numpy array's or an ``array``'s ``len`` counts
    items).  Raises InvalidParams for a value that is not a contiguous buffer (a
    ``str``, None, a strided view), before anything is sent."""
    if set(map(type, values)) <= _PLAIN_BYTES:
        return values  # the common case, checked in C
    out = list(values)
    for i, v in enumerate(out):
        if type(v) in _PLAIN_BYTES:
            continue
        try:
            view = memoryview(v)
            out[i] = view if view.format == "B" and view.ndim == 1 and view.contiguous \
                else view.cast("B")
        except (TypeError, ValueError):  # not a buffer, strided, released, odd format
            raise E.InvalidParams(f"value at position {i} is not a contiguous bytes-like "
                                  f"object ({type(v).__name__})", op=op) from None
    return out


def _b(key: str | bytes) -> bytes:
    if type(key) is str:
        return key.encode()
    if type(key) is bytes:
        return key
    raise E.InvalidParams(f"key must be str, not {type(key).__name__}")


def _ids_wire(ids: Sequence[Any], n: int, op: str, what: str, *, none_ok: bool,
              nul_ok: bool) -> list[bytes] | None:
    """Per-key ids (``ids``, one per key of a call of ``n`` keys) as sent: one bin per
    key, or None when no key has one (all empty).  ``none_ok``: None stands for "".
    Raises InvalidParams (``what`` names the field) for a list of another length, an id
    that is not a str, one longer than KEY_MAX_BYTES, or (unless ``nul_ok``) one with
    NUL."""
    if len(ids) != n:
        raise E.InvalidParams(f"{what}: {len(ids)} ids for {n} keys", op=op)
    out = []
    for i in ids:
        if i is None and none_ok:
            i = ""
        if type(i) is not str:
            raise E.InvalidParams(f"{what}: each id must be str, not {type(i).__name__}", op=op)
        b = i.encode()
        if len(b) > P.KEY_MAX_BYTES or (not nul_ok and b"\x00" in b):
            raise E.InvalidParams(f"{what}: an id is at most {P.KEY_MAX_BYTES} bytes"
                                  + ("" if nul_ok else ", without NUL"), op=op)
        out.append(b)
    return out if any(out) else None


def _session_tags_wire(config: Any, n: int, op: str) -> list[bytes] | None:
    """``config.session_tags`` (or the compat facade's ``session_ids``) as sent: one bin
    per key (None counts as no tag), or None when no key has one.  Raises InvalidParams
    as :func:`_ids_wire`; a tag may hold NUL."""
    if config is None:
        return None
    tags = getattr(config, "session_tags", None) or getattr(config, "session_ids", None)
    if not tags:
        return None
    return _ids_wire(tags, n, op, "session tags", none_ok=True, nul_ok=True)


def _group_ids_wire(config: Any, n: int, op: str) -> list[bytes] | None:
    """``config.group_ids`` as sent (one bin per key), or None when no key has a group.
    Raises InvalidParams as :func:`_ids_wire`; an id may not hold NUL."""
    gids = getattr(config, "group_ids", None) if config is not None else None
    if not gids:
        return None
    return _ids_wire(gids, n, op, "group_ids", none_ok=False, nul_ok=False)


_TAGGED = {
    Op.PUT_START: Op.PUT_START_WITH_KV_SESSIONS,
    Op.UPSERT_START: Op.UPSERT_START_WITH_KV_SESSIONS,
    Op.BATCH_PUT_START: Op.BATCH_PUT_START_WITH_KV_SESSIONS,
    Op.BATCH_UPSERT_START: Op.BATCH_UPSERT_START_WITH_KV_SESSIONS,
}


def op_name(op: bytes) -> str:
    try:
        return Op(op).name
    except ValueError:
        return op.hex()


class PendingPuts:
    """Writes started by ``batch_put_start`` whose bytes are copied later, by
    position in its keys: ``status[i]`` is 0 while the write is open (started, not
    yet ended or revoked), else its negative status; ``replicas[i]`` the
    ``[segment, offset]`` ranges its bytes go to while open, else None."""

    __slots__ = ("bkeys", "sizes", "write_id", "started_on", "shard", "replicas", "status",
                 "fence")

    def __init__(self, bkeys: list[bytes], sizes: list[int], write_id: int,
                 started_on: str | None) -> None:
        self.bkeys = bkeys
        self.sizes = sizes
        self.write_id = write_id
        self.started_on = started_on
        self.shard = [0] * len(bkeys)
        self.replicas: list[list[list[Any]] | None] = [None] * len(bkeys)
        self.status: list[int] = [0] * len(bkeys)
        #: The writes' fence (:mod:`kvmaster._fence`), set once they are started.
        self.fence: WriteFence | None = None

    def open(self) -> list[int]:
        """Positions of the writes still open."""
        return [i for i, r in enumerate(self.replicas) if r is not None]


class ReadLeases:
    """Read leases of a batch (``batch_get_leases``), by position in its keys:
    ``sizes[i]`` (bytes) and ``replicas[i]`` (``[segment, offset]``) of each object
    found, None and its negative ``status[i]`` for the others; ``deadline`` is when
    the leases end (``time.monotonic()``); ``checksums[i]`` the object's checksum
    (None: none, or ``checksums`` None for every key; whole-object reads check it)."""

    __slots__ = ("sizes", "replicas", "status", "deadline", "checksums")

    def __init__(self, sizes: list[int], replicas: list[list[list[Any]] | None],
                 status: list[int], deadline: float,
                 checksums: list[int | None] | None = None) -> None:
        self.sizes = sizes
        self.replicas = replicas
        self.status = status
        self.deadline = deadline
        self.checksums = checksums
