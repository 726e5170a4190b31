"""Transport-free core of the clients: request building, fan-out, data plane.

Every client operation is written once, as a generator that yields batches of
requests ``[(op, route, fields_after_req_id), ...]`` and receives the reply
bodies in the same order (an error status is thrown into the generator as its
:mod:`kvmaster.errors` exception).  :class:`~kvmaster.client.Client` drives
these generators over a blocking socket, :class:`~kvmaster.aio.AsyncClient`
over an asyncio one; both get the same methods from :func:`operation`.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import time
import uuid
import zlib
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvmaster import _cuda
from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster import _fence
from kvmaster._fence import FENCE_BLOCK, WriteFence
from kvmaster._integrity import checksum as _checksum
from kvmaster._integrity import checksum_parts, checksum_ptrs
from kvmaster._segment import Segment, check_shm_room, host_id, new_segment_name, \
    owner_fingerprint, segment_tag
from kvmaster.transfer import TransferError
from kvmaster.protocol import Op, SoftPinAction, Status

log = logging.getLogger(__name__)
_monotonic = time.monotonic
_crc32 = zlib.crc32
log = logging.getLogger(__name__)
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
    import ctypes
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
    return {name: fn for name, fn in vars(cls).items() if getattr(fn, "__kv_operation__", False)}


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


class ClientCore:
    """State and operations shared by the sync and async clients (no I/O here)."""

    #: Whether session tags were dropped for an older master (said once).
    _tags_dropped = False

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self.client_id = f"{host_id()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.welcome: Welcome | None = None
        self._segment: Segment | None = None
        self._mapped: dict[str, Segment] = {}
        # segment name -> (host_id, transport, size) as the master reported at mount time
        self._seg_info: dict[str, tuple[str, str, int]] = {}
        #: Remote segments whose transfer service reported the size they were mounted
        #: with (checked before the first transfer; see :meth:`_peer`).
        self._sized: set[str] = set()
        self._data_ctx: Any = None
        self._service: Any = None
        self._peers: dict[str, Any] = {}
        self.reconnect_count = 0
        #: Re-mounts the master refused after a re-handshake (each attempt counts; see
        #: :meth:`_mount_refused`).
        self.mount_refusals = 0
        #: WELCOMEs taken so far: each new connection (setup, re-handshake) adds one.
        self._generation = 0
        #: ``master_instance`` of the last WELCOME (None before the first).
        self._master_instance: str | None = None
        self.endpoint = ""
        self.ha = False
        #: Reply statuses that re-handshake (RECONNECT, or RECONNECT_HA).
        self._reconnect = RECONNECT
        #: ``write_id`` of each write this client starts (unique for its client_id).
        self._write_ids = itertools.count(1)
        #: Monotonic send time of the latest request the master answered with success:
        #: it cannot expire this client before this plus ``client_ttl`` (the drivers
        #: keep it; the write fence, :mod:`kvmaster._fence`, reads it).
        self._heard = 0.0
        #: Replicas whose bytes did not match their object's checksum (each dropped on
        #: the master), and reads that found no replica that did (ChecksumMismatch).
        self.checksum_mismatches = 0
        self.checksum_failures = 0

    # ----------------------------------------------------------- handshake

    def _configure(self, **changes: Any) -> None:
        changes = {k: v for k, v in changes.items() if v is not None}
        if changes:
            self.config = ClientConfig(**{**self.config.__dict__, **changes})
        check_master_address(self.config.master_server_addr)
        self.ha = self.config.master_server_addr.startswith("etcd://")
        self._reconnect = RECONNECT_HA if self.ha else RECONNECT
        self.endpoint = "" if self.ha else endpoint_of(self.config.master_server_addr)
        if self.config.global_segment_size > 0:
            try:
                segment_tag()  # before anything is connected or registered
            except ValueError as exc:
                raise E.InvalidParams(str(exc), op="setup") from None
            check_shm_room(self.config.global_segment_size)  # InvalidParams, at once
        retain_heap(self.config.retain_heap_mb)

    def _resolve(self, timeout_s: float | None = None) -> str:
        """The master endpoint to connect to; with ``etcd://`` the current leader's,
        looked up within ``connect_timeout_s`` (or ``timeout_s`` when shorter)."""
        if not self.ha:
            return endpoint_of(self.config.master_server_addr)
        from kvmaster.ha import EtcdError, resolve_leader

        limit = self.config.connect_timeout_s
        if timeout_s is not None:
            limit = min(limit, timeout_s)
        try:
            return resolve_leader(self.config.master_server_addr, limit)
        except EtcdError as exc:
            raise E.ConnectionLost(f"no leader: {exc}", op="HELLO",
                                   endpoint=self.config.master_server_addr) from None

    def _hello_fields(self) -> list[Any]:
        cfg = self.config
        from kvmaster import __version__

        return [P.PROTOCOL_VERSION[0], P.PROTOCOL_VERSION[1], self.client_id, cfg.tenant,
                cfg.local_hostname or host_id(), __version__]

    def _open_dealer(self, ctx: Any, monitor_ctx: Any) -> tuple[Any, Any]:
        """A new DEALER of ``ctx`` to ``self.endpoint`` (see :meth:`_prepare_dealer`)
        and its :class:`~kvmaster._frames.LinkMonitor`, made before the connect on
        ``monitor_ctx`` (a plain context of the same libzmq context; None when libzmq
        cannot monitor: calls then wait out their timeout when the master goes away).
        A socket whose options or connect fail is closed, with its monitor, before the
        error is raised (left open, it made the context's term() in close() wait for
        ever)."""
        import logging

        import zmq

        from kvmaster._frames import LinkMonitor

        sock = ctx.socket(zmq.DEALER)
        link = None
        try:
            self._prepare_dealer(sock, next(self._connections))
            try:
                link = LinkMonitor(sock, monitor_ctx)
            except zmq.ZMQError as exc:
                logging.getLogger(__name__).debug("no socket monitor: %s", exc)
            try:
                sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                raise E.InvalidParams(f"master address {self.endpoint!r}: {exc.strerror}",
                                      op="setup") from None
        except BaseException:
            if link is not None:
                link.close()
            sock.close(linger=0)
            raise
        return sock, link

    def _prepare_dealer(self, sock: Any, connection: int) -> None:
        """Options of a new DEALER to the master: routing id, linger, HWMs, CURVE keys."""
        import zmq

        sock.setsockopt(zmq.IDENTITY, f"{self.client_id}/{connection}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        cfg = self.config
        if cfg.curve_dir:
            from kvmaster import auth

            pub, sec, server = auth.client_keys(cfg.curve_dir, cfg.curve_client)
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = pub, sec, server

    def _welcomed(self, body: dict[str, Any]) -> None:
        """Take a WELCOME body as the connection's.  From another master process than
        the last WELCOME's (a restart, an HA failover, or a master that does not say
        which it is), every segment it knew is forgotten: the mappings of other
        processes' segments are dropped (a dead master's own segment file can only be
        removed once nothing maps it) and the segment table is emptied, to be filled
        again by LIST_SEGMENTS on the next read or write."""
        w = Welcome(body)
        last = self._master_instance
        if last is not None and (not w.instance or w.instance != last):
            self._forget_segments()
        self._master_instance = w.instance
        self._generation += 1
        self.welcome = w
        self._new_connection(bool(w.instance) and w.instance == last)

    def _new_connection(self, same_master: bool) -> None:
        """A WELCOME came on a new connection; ``same_master``: from the master process
        that answered the last one.  The drivers send again there the NoWait requests
        (failed puts' revokes) that got no reply on the old connection, and drop them
        for another master process, which never saw those writes."""

    def _forget_segments(self) -> None:
        """Drop every mapping but the contributed segment's, and the segment table
        (the contributed segment's entry is made again when it is mounted)."""
        own = self._segment
        self._drop_mappings(list(self._mapped))
        info = self._seg_info
        mine = {own.name: info[own.name]} if own is not None and own.name in info else {}
        info.clear()
        info.update(mine)
        self._sized.clear()

    def _drop_mappings(self, names: Iterable[str]) -> None:
        """Unmap these segments (never the contributed one).  No copy can be running
        from them: the sync client's copies and re-handshakes hold its lock, and the
        async client's copies run between two awaits of one task.  A view still
        exported (none is left by the operations) would keep its mapping until it is
        released (see :meth:`Segment.close`)."""
        own = self._segment
        for name in names:
            seg = self._mapped.get(name)
            if seg is None or seg is own:
                continue
            del self._mapped[name]
            seg.close(unlink=False)

    def _no_welcome(self, waited_s: float | None = None) -> E.Timeout:
        """Timeout of a HELLO; ``waited_s``: how long it waited, when a call's deadline
        or a short HA attempt cut ``connect_timeout_s`` short."""
        limit = self.config.connect_timeout_s
        if waited_s is None or waited_s >= limit - 0.05:  # (not cut short, or hardly)
            within = f"connect_timeout_s={limit}"
        else:
            within = (f"{max(waited_s, 0.0):.3g} s (what was left of the call's timeout_s or "
                      f"of connect_timeout_s={limit})")
        return E.Timeout(f"no WELCOME from {self.endpoint} within {within}; is the master "
                         "running?", op="HELLO", endpoint=self.endpoint)

    def _hello_gave_up(self, exc: BaseException, started: float) -> BaseException:
        """The error an HA connect raises after its last short attempt: a HELLO
        timeout or a leader look-up that found none then names the whole wait since
        ``started``, not that attempt's (the attempt's error is its cause)."""
        waited = _monotonic() - started
        if isinstance(exc, E.Timeout) and exc.op == "HELLO":
            return self._no_welcome(waited)
        if isinstance(exc, E.ConnectionLost) and exc.op == "HELLO" \
                and str(exc.args[0]).startswith("no leader"):
            last = str(exc.args[0])
            tail = "" if "no time left" in last else f"; the last look-up: {last}"
            return E.ConnectionLost(f"no leader found in {waited:.3g} s of trying{tail}",
                                    op="HELLO", endpoint=exc.endpoint)
        return exc

    def _own_segment(self) -> Segment | None:
        """Create the contributed segment on first use, or a fresh one if the master
        removed our file (it does so when it expires a client)."""
        seg = self._segment
        if seg is not None and not os.path.exists(f"/dev/shm/{seg.name}"):
            self._mapped.pop(seg.name, None)
            _cuda.forget_host(seg.buf)
            seg.close(unlink=False)
            seg = self._segment = None
        if seg is None and self.config.global_segment_size:
            seg = self._segment = Segment.create(self.config.global_segment_size,
                                                 new_segment_name(self._owner_fingerprint()))
            self._mapped[seg.name] = seg
        return seg

    def _owner_fingerprint(self) -> str:
        """The owner part of this client's segment names (``.owner-<16 hex>``): of its
        CURVE public key with CURVE, else of its client id; the master refuses a mount
        of a name with another (PROTOCOL.md section 11)."""
        cfg = self.config
        if cfg.curve_dir:
            from kvmaster import auth

            return owner_fingerprint(auth.client_keys(cfg.curve_dir, cfg.curve_client)[0].decode())
        return owner_fingerprint(self.client_id)

    def _fresh_segment(self) -> None:
        """Give up the contributed segment for a new one under a new name (its old name
        is taken on the master: see :meth:`_mount_refused`)."""
        seg = self._segment
        if seg is not None:
            self._mapped.pop(seg.name, None)
            self._seg_info.pop(seg.name, None)
            _cuda.forget_host(seg.buf)
            seg.close()
            self._segment = None

    def _mount_refused(self, exc: BaseException, attempt: int) -> float | None:
        """Attempt ``attempt`` (1-based) at re-mounting the segment after a
        re-handshake raised ``exc``.  A refusal (a status other than BUSY or a
        re-handshake's, which the callers handle as before) is logged at WARNING
        with its status and counted in ``mount_refusals``.  -> the pause before the
        next attempt (MOUNT_RETRY_FIRST_S, doubling), 0.0 when the attempts are used
        up (the caller then gives the name up for a fresh one: :meth:`_fresh_segment`),
        or None when ``exc`` is no refusal (raise it)."""
        if not isinstance(exc, E.RequestError) or isinstance(exc, E.Busy) \
                or exc.code in self._reconnect:
            return None
        self.mount_refusals += 1
        seg = self._segment
        last = attempt >= MOUNT_ATTEMPTS
        log.warning("master %s refused the re-mount of segment %s (attempt %d of %d): %s%s",
                    self.endpoint, seg.name if seg else "?", attempt, MOUNT_ATTEMPTS, exc,
                    "; giving the name up for a new segment" if last else "")
        return 0.0 if last else MOUNT_RETRY_FIRST_S * 2 ** (attempt - 1)

    def _mount_fields(self, seg: Segment) -> list[Any]:
        transport = "shm"
        if self.config.transfer_host:
            svc = self._service
            if svc is None or svc.segment is not seg:
                if svc is not None:
                    svc.close()
                from kvmaster.transfer import TransferService

                svc = self._service = TransferService(self._zmq_data(), seg,
                                                      self.config.transfer_host,
                                                      self._curve_server_keys(),
                                                      self._allowed_keys_dir())
                svc.start()
            transport = svc.endpoint
            keys = self._curve_server_keys()
            if keys is not None:
                # Peers need the service's public key to connect (it is the owner's).
                transport += "#curve=" + keys[0].decode()
        self._seg_info[seg.name] = (self._host(), transport, seg.size)
        return [seg.name, seg.size, self._host(), transport]

    def _host(self) -> str:
        return self.config.local_hostname or host_id()

    def _zmq_data(self) -> Any:
        if self._data_ctx is None:
            import zmq

            self._data_ctx = zmq.Context()
        return self._data_ctx

    def _curve_server_keys(self) -> tuple[bytes, bytes] | None:
        cfg = self.config
        if not cfg.curve_dir:
            return None
        from kvmaster import auth

        pub, sec, _ = auth.client_keys(cfg.curve_dir, cfg.curve_client)
        return pub, sec

    def _allowed_keys_dir(self) -> str | None:
        """With CURVE, the directory of client public keys the transfer service admits."""
        if not self.config.curve_dir:
            return None
        import os.path

        d = os.path.join(self.config.curve_dir, "clients")
        return d if os.path.isdir(d) else None

    def _release_segments(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        if self._service is not None:
            self._service.close()
            self._service = None
        if self._data_ctx is not None:
            self._data_ctx.term()
            self._data_ctx = None
        for seg in self._mapped.values():
            if seg.owner:
                _cuda.forget_host(seg.buf)
            seg.close()
        self._mapped.clear()
        self._segment = None

    @property
    def segment_name(self) -> str | None:
        return self._segment.name if self._segment else None

    @property
    def shard_count(self) -> int:
        return self._welcome().shard_count

    def _welcome(self) -> Welcome:
        w = self.welcome
        if w is None:
            raise E.ConnectionLost("client is not connected (setup not called, or a "
                                   "re-handshake is under way)", endpoint=self.endpoint)
        return w

    # -------------------------------------------------------------- routing

    def _trust(self, reqs: list[Request]) -> float | None:
        """How long after its sending the reply to this round may come and still be
        used (s), when the round gives out space or replica locations and the master
        is an HA leader (``Welcome.trust_s``); else None (no limit)."""
        w = self.welcome
        if w is None or w.trust_s is None:
            return None
        for op, _, _ in reqs:
            if op in SPACE_OPS:
                return w.trust_s
        return None

    def _stale(self, trust: float) -> E.Timeout:
        return E.Timeout(f"the reply came more than {trust:.3g} s (the HA leader's reply_trust_ms) "
                         "after the request: it may be a former leader's, so it was not used",
                         endpoint=self.endpoint)

    def _routing(self) -> tuple[int, int, bool, bool] | None:
        w = self.welcome
        return None if w is None else (w.shard_count, w.seed, w.any_shard, w.columns)

    def _check_routing(self, before: tuple[int, int, bool, bool] | None) -> None:
        """Raise RoutingChanged when a re-handshake changed the shard layout."""
        if self._routing() != before:
            raise RoutingChanged("the master came back with another shard layout",
                                 endpoint=self.endpoint)

    def _may_resend(self, sent_at: float, pause: float, deadline: float, limit: float) -> bool:
        """Whether a request refused BUSY goes out again: retries are on and, after the
        pause, the deadline leaves the resend room for its answer (twice the last round
        trip, at least 20 ms or a tenth of ``limit``, the call's timeout), so a request
        refused all along ends in Busy rather than Timeout.  Times are
        ``time.monotonic()``."""
        if not self.config.busy_retry:
            return False
        t = _monotonic()
        return t + pause + max(2 * (t - sent_at), 0.02, 0.1 * limit) < deadline

    def _route(self, bkey: bytes) -> bytes:
        w = self._welcome()
        return w.routes[P.shard_of(bkey, w.seed, w.shard_count)]

    def _group(self, keys: Sequence[str], op: Op | None = None
               ) -> tuple[list[bytes], dict[int, list[int]]]:
        """Encode keys and group their positions by shard (in ascending position).
        When the master takes ``op`` on any shard (WELCOME ``batch_any_shard``), one
        group holds every position, routed to the first key's shard."""
        w = self._welcome()
        if len(keys) > w.max_batch:
            raise E.InvalidParams(f"batch of {len(keys)} keys exceeds max_batch={w.max_batch}",
                                  op="batch")
        # A set of the types: an identity test per key (list.count would call a
        # metaclass's __eq__, and let a str subclass through: see _b).
        if set(map(type, keys)) <= _STR_ONLY:
            bkeys = list(map(str.encode, keys))  # the common case: all str
        else:
            bkeys = [_b(k) for k in keys]  # bytes, or a clear error for anything else
        n = w.shard_count
        if op is not None and w.any_shard and op.value in P.ANY_SHARD_OPS and bkeys:
            return bkeys, {_crc32(bkeys[0], w.seed) % n: list(range(len(bkeys)))}
        if n == 1:
            return bkeys, {0: list(range(len(bkeys)))} if bkeys else {}
        shard = P.shards_of(bkeys, w.seed, n)
        return bkeys, {s: idx for s, idx in enumerate(P.positions_by_shard(shard, n)) if idx}

    @staticmethod
    def _fan(op: Op, per_shard: dict[int, list[Any]]) -> list[Request]:
        return [(op.value, P.route_for_shard(s), f) for s, f in per_shard.items()]

    def _batch(self, op: Op, keys: Sequence[str], extra: Sequence[Any] = ()) -> OpGen:
        """Fan a per-key batch op out to shards; results back in key order."""
        bkeys, groups = self._group(keys, op)
        if not bkeys:
            return []
        if len(groups) == 1:  # one request with every key, in order: its body is the answer
            ((s, _),) = groups.items()
            (body,) = yield [(op.value, P.route_for_shard(s), [bkeys, *extra])]
            return body
        shards = list(groups)
        bodies = yield [(op.value, P.route_for_shard(s), [[bkeys[i] for i in groups[s]], *extra])
                        for s in shards]
        out: list[Any] = [None] * len(bkeys)
        for s, body in zip(shards, bodies):
            for i, r in zip(groups[s], body):
                out[i] = r
        return out

    # ----------------------------------------------------------- data plane

    def _know(self, replicas: Iterable[list[Any]]) -> OpGen:
        """Make sure every replica's segment is in the segment table (one LIST_SEGMENTS
        when one is not, which also drops the table entries and mappings of segments
        it no longer lists)."""
        info = self._seg_info
        if all(r[0] in info for r in replicas):
            return None
        (segments,) = yield [(Op.LIST_SEGMENTS.value, P.MASTER_ROUTE, [])]
        listed = set()
        for s in segments:
            entry = (s["host_id"], s["transport"], s["size"])
            if info.get(s["name"]) != entry:
                self._sized.discard(s["name"])
            info[s["name"]] = entry
            listed.add(s["name"])
        # Segments the master no longer has (their owners left, were expired or
        # died): their mappings would keep the memory of unlinked files, and a dead
        # master's file, for as long as this client lives.
        own = self._segment
        for name in [n for n in info if n not in listed and (own is None or n != own.name)]:
            del info[name]
            self._sized.discard(name)
        self._drop_mappings([n for n in self._mapped if n not in listed])
        return None

    def _local(self, name: str) -> Segment | None:
        """The mapping of a segment on this host, or None to go through the network."""
        seg = self._mapped.get(name)
        if seg is not None and (seg.owner or not self.config.force_transfer):
            return seg
        info = self._seg_info.get(name)
        if self.config.force_transfer or (info is not None and info[0] != self._host()):
            return None
        # A regular file of one link, not a symlink, at least as large as mounted: else
        # SegmentFileError (a ValueError), and the copy fails with TRANSFER_FAIL.
        seg = self._mapped[name] = Segment.attach(name, info[2] if info is not None else 0)
        return seg

    def _local_seg(self, name: str) -> Segment | None:
        """The segment on this host (this client's own, or a peer's opened for
        pread/pwrite), or None (another host, a forced network path, or an open that
        failed: the general read and write paths then say why)."""
        try:
            return self._local(name)
        except (OSError, ValueError, E.KVMasterError):
            return None

    def _local_view(self, name: str) -> Any:
        """The mapping of this client's own segment, or None (any other segment: a
        peer's is never copied through a mapping, see kvmaster/_segment.py)."""
        seg = self._local_seg(name)
        return seg.buf if seg is not None and seg.owner else None

    def _peer(self, name: str) -> Any:
        info = self._seg_info.get(name)
        if info is None or not info[1].startswith("tcp://"):
            raise E.KVMasterError(f"segment {name} is on another host and serves no transfers",
                                  code=Status.TRANSFER_FAIL)
        peer = self._peers.get(info[1])
        if peer is None:
            from kvmaster.transfer import TransferPeer  # noqa: PLC0415 - zmq only when needed

            endpoint, _, server_key = info[1].partition("#curve=")
            curve = None
            if self.config.curve_dir:
                if not server_key:
                    raise E.KVMasterError(f"segment {name} serves transfers without CURVE",
                                          code=Status.TRANSFER_FAIL)
                from kvmaster import auth

                pub, sec, _ = auth.client_keys(self.config.curve_dir, self.config.curve_client)
                curve = (pub, sec, server_key.encode())
            peer = self._peers[info[1]] = TransferPeer(self._zmq_data(), endpoint,
                                                       self.config.timeout_s, curve)
        if name not in self._sized:
            # At first use: a service serving less than its mount claimed (a made-up
            # size) is not written to or read from.
            served = peer.size(name)
            if served != info[2]:
                raise E.KVMasterError(
                    f"segment {name} was mounted with {info[2]} bytes but its transfer "
                    f"service {info[1].partition('#curve=')[0]} serves {served}",
                    code=Status.TRANSFER_FAIL)
            self._sized.add(name)
        return peer

    def _write(self, replicas: list[list[Any]], parts: Sequence[Any],
               fence: WriteFence | None = None, limit: float = float("inf")) -> None:
        """Copy ``parts`` (one value) into every replica, checking before each part (and
        each FENCE_BLOCK of a larger one) that the write's ``fence`` ``limit`` has not
        passed (else LeaseExpired, from ``fence``).  Every write path passes its fence;
        without one (tools driving the raw protocol) nothing is checked."""
        clock = _fence.clock  # (read before each block: see kvmaster._fence)
        for name, off in replicas:
            seg = self._local(name)
            if seg is None:
                if clock() > limit:
                    raise fence.expired()
                self._peer(name).write(name, off, list(parts))
                continue
            # (parts normalised by _byte_values: len is the size in bytes)
            _fenced_write(seg, off, parts, fence, limit)

    def _corrupt(self, name: str, off: int, bad: list[list[Any]] | None) -> E.ChecksumMismatch:
        """A replica whose bytes failed their checksum: counted, noted in ``bad`` (to
        be dropped), and its error for :func:`_unreadable`."""
        self.checksum_mismatches += 1
        if bad is not None:
            bad.append([name, off])
        return E.ChecksumMismatch(f"replica on segment {name} at offset {off} does not match "
                                  "the object's checksum", op="get")

    def _read_into(self, replicas: list[list[Any]], size: int, dst: Any,
                   want: int | None = None, bad: list[list[Any]] | None = None) -> None:
        """Copy the object (``size`` bytes) into ``dst`` from its first readable replica
        whose bytes match the checksum ``want`` (None: any); the replicas that did not
        are added to ``bad``.  Raises (see :func:`_unreadable`) when none did."""
        if type(dst) is not memoryview:
            dst = memoryview(dst)  # (a slice of it must be a view, not a copy)
        failed: list[Exception] = []
        for name, off in replicas:
            try:
                seg = self._local(name)
                if seg is None:
                    self._peer(name).read_into(name, off, size, dst)
                else:
                    seg.read_into(off, dst[:size])
            except (OSError, ValueError, E.KVMasterError) as exc:
                failed.append(exc)
                continue
            if want is None or _checksum(dst[:size]) == want:
                return
            failed.append(self._corrupt(name, off, bad))
        raise _unreadable(failed)

    def _read_bytes(self, replicas: list[list[Any]], size: int, want: int | None = None,
                    bad: list[list[Any]] | None = None) -> bytes:
        """The object's bytes, as :meth:`_read_into` finds them."""
        failed: list[Exception] = []
        for name, off in replicas:
            try:
                seg = self._local(name)
                data = self._peer(name).read(name, off, size) if seg is None \
                    else seg.read(off, size)
            except (OSError, ValueError, E.KVMasterError) as exc:
                failed.append(exc)
                continue
            if want is None or _checksum(data) == want:
                return data
            failed.append(self._corrupt(name, off, bad))
        raise _unreadable(failed)

    def _drops(self, corrupt: list[tuple[bytes, list[Any], int]]) -> NoWait:
        """DROP_CORRUPT_REPLICAS of ``(key, [segment, offset], checksum)`` per replica
        found corrupt, one request per shard, sent without waiting (applied before
        anything this client sends to those shards afterwards); logged once."""
        by_route: dict[bytes, tuple[list[bytes], list[list[Any]], list[int]]] = {}
        for bkey, rep, want in corrupt:
            keys, reps, sums = by_route.setdefault(self._route(bkey), ([], [], []))
            keys.append(bkey)
            reps.append(rep)
            sums.append(want)
        bkey, (name, off), _ = corrupt[0]
        log.warning("%d replica(s) of %d key(s) did not match their checksum (the first: key "
                    "%r on segment %s at offset %d); asked the master to drop them",
                    len(corrupt), len({c[0] for c in corrupt}), bkey, name, off)
        return NoWait([(Op.DROP_CORRUPT_REPLICAS.value, route, [keys, reps, sums])
                       for route, (keys, reps, sums) in by_route.items()])

    def _checked(self, bkey: bytes, want: int | None, read: Callable[..., Any],
                 deadline: float) -> OpGen:
        """``read(bad)`` of one object under a read lease that ends at ``deadline``,
        then the drops of the replicas it found corrupt (also when it raised
        ChecksumMismatch).  A read that ended after its lease stands only where its
        bytes matched the object's checksum (see :func:`_late_statuses`); else it
        raises LeaseExpired, and sends no drops."""
        bad: list[list[Any]] = []
        marks = self.checksum_mismatches, self.checksum_failures
        try:
            out = read(bad)
        except E.ChecksumMismatch:
            if _monotonic() > deadline:
                self._late_uncount(marks)
                raise _lease_expired(repr(bkey.decode(errors="replace")), "get") from None
            self.checksum_failures += 1
            yield self._drops([(bkey, r, want) for r in bad])
            raise
        late = _monotonic() > deadline
        if late:
            self._late_uncount(marks)
            if want is None:
                raise _lease_expired(repr(bkey.decode(errors="replace")), "get")
        elif bad:
            yield self._drops([(bkey, r, want) for r in bad])
        return out

    def _late_uncount(self, marks: tuple[int, int]) -> None:
        """Take back the checksum counts a read that ended after its lease made
        (``marks``: both counters before it): its mismatches may be reused space."""
        self.checksum_mismatches, self.checksum_failures = marks

    # ----------------------------------------------------------------- puts

    def _put(self, op_start: Op, key: str, parts: Sequence[Any],
             config: ReplicateConfig | None) -> OpGen:
        """PUT_START, copy the bytes, PUT_END.

        A write the master admitted is not left pending by a live client (a
        pending write makes other puts of the key answer success for
        ``--put-start-discard-timeout`` while nothing is readable): when a later
        step fails (the segment lookup, the copy, or an end that got no answer:
        ``Timeout``, ``Busy`` to the end, ``ConnectionLost``, a signal handler's
        exception; or the call's deadline passed before the end, which is then not
        sent), or the start itself got no answer (it may be applied later), the
        client sends PUT_REVOKE naming the write (the ``write_id`` its start gave)
        and raises the original error.

        The revoke is not waited for (:class:`NoWait`), so the call still ends at
        its deadline; waiting would not help either: the master takes a
        connection's requests to a shard in order, so the revoke is applied before
        anything this client sends to that shard afterwards (a retry of the put
        included), and a stopped master applies it when it resumes.  It cannot
        remove a stored object (an end applied although its reply was lost),
        another client's write, or a later write of the key by this client (another
        thread's or task's, started once this one had ended).  A revoke the master
        refuses BUSY (the flood that made the end fail, say) is sent again (see
        :class:`NoWait`), and so is one that could not be queued or whose
        connection was replaced before its reply came; other replies are skipped
        like late ones.  One that a closed client could not send, or still refused
        after PARTING_RETRY_S, leaves the write to the discard timeout.  Not
        revoked: a write whose bytes
        went to a transfer service that failed (they may still land; the master
        frees the range after its timeouts).
        """
        parts = _byte_values(parts, op_start.name)
        size = sum(map(len, parts))
        if size <= 0:
            raise E.InvalidParams("value must not be empty", op=op_start.name)
        bkey = _b(key)
        route = self._route(bkey)
        fields: list[Any] = [bkey, size, config.to_wire() if config is not None else None]
        tags = config.kv_sessions if config is not None else None
        if tags:
            if len(tags) != 1:
                raise E.InvalidParams("kv_sessions must hold exactly one list for a single key",
                                      op=op_start.name)
            op_start = _TAGGED[op_start]
            fields.append([_b(t) for t in tags[0]])
        else:
            gids = _group_ids_wire(config, 1, op_start.name)
            if gids is not None or _session_tags_wire(config, 1, op_start.name) is not None:
                # a grouped or session-tagged write: a batch of one (only batches carry them)
                (st,) = yield from self._write_batch(
                    Op.BATCH_UPSERT_START if op_start is Op.UPSERT_START
                    else Op.BATCH_PUT_START, [key],
                    [parts[0] if len(parts) == 1 else b"".join(parts)], config, None, gids)
                if st < 0:
                    raise E.error_for(st, f"{op_start.name} of {key!r} failed", op=op_start.name)
                return None
        write_id = next(self._write_ids)
        fields.append(write_id)
        revoke = NoWait([(Op.PUT_REVOKE.value, route, [bkey, write_id])])
        sent_at = _monotonic()
        try:
            (replicas,) = yield [(op_start.value, route, fields)]
        except E.ObjectAlreadyExists:
            return None  # write-once: the object is (being) stored already
        except GeneratorExit:
            raise
        except BaseException as exc:
            if unanswered(exc, 1):
                yield revoke  # the start may still be applied (its reply was lost)
            raise
        # From here on the write is pending on the master: whatever fails, it is
        # revoked (see the docstring) unless its bytes may still be landing.
        started_on = self._master_instance
        fence = WriteFence(self, sent_at, op_start.name)
        try:
            yield from self._know(replicas)
            if self._master_instance != started_on:
                raise self._write_lost(op_start)  # its ranges may be another key's now
            self._write(replicas, parts, fence, fence.limit())
        except TransferError as exc:
            # Bytes already handed to the network may still land after a give-up, so
            # the range is not revoked (and reused) at once: the master frees it after
            # its put-start discard/release timeouts.
            raise E.KVMasterError(f"write of {key!r} failed: {exc}",
                                  code=Status.TRANSFER_FAIL, op=op_start.name) from exc
        except GeneratorExit:
            raise
        except BaseException as exc:
            yield revoke
            if isinstance(exc, FileNotFoundError):  # (see _write_failure)
                raise E.SegmentNotFound(f"write of {key!r} lost with its segment: {exc}",
                                        op=op_start.name) from exc
            if isinstance(exc, (OSError, ValueError)):
                raise E.KVMasterError(f"write of {key!r} failed: {exc}",
                                      code=Status.TRANSFER_FAIL, op=op_start.name) from exc
            raise
        end = [bkey, write_id, checksum_parts(parts)] if self.config.write_checksums \
            else [bkey, write_id]
        try:
            yield [(Op.PUT_END.value, route, end)]
        except GeneratorExit:
            raise
        except BaseException as exc:
            if self._master_instance != started_on and isinstance(
                    exc, (E.ObjectNotFound, E.SegmentNotFound)):
                raise self._write_lost(op_start) from None
            if unanswered(exc, 1):
                yield revoke
            raise
        return None

    def _write_lost(self, op: Op) -> E.ConnectionLost:
        """A put whose master process changed after its start (an HA failover or a
        restart): before the copy, its bytes are not written (the new master may have
        given those ranges to other keys); after it, the end was sent again to the new
        master, which never saw the write.  Nothing is stored."""
        return E.ConnectionLost("the master changed between the start and the end of this "
                                "write (failover or restart): nothing was stored; write again",
                                op=op.name, endpoint=self.endpoint)

    @operation
    def put(self, key: str, value: bytes | bytearray | memoryview,
            config: ReplicateConfig | None = None) -> OpGen[None]:
        """Store ``value`` under ``key`` unless it exists (write-once; a second put
        succeeds without replacing).  Raises NoAvailableHandle, InvalidParams."""
        return (yield from self._put(Op.PUT_START, key, (value,), config))

    @operation
    def put_parts(self, key: str, *parts: bytes | bytearray | memoryview,
                  config: ReplicateConfig | None = None) -> OpGen[None]:
        """Like :meth:`put` with the value given as consecutive parts (no join copy)."""
        return (yield from self._put(Op.PUT_START, key, parts, config))

    @operation
    def put_from(self, key: str, buffer: Any, config: ReplicateConfig | None = None) -> OpGen[None]:
        """Like :meth:`put` from any buffer-protocol object (numpy array, mmap, ...)."""
        return (yield from self._put(Op.PUT_START, key, (buffer,), config))

    @operation
    def upsert(self, key: str, value: bytes | bytearray | memoryview,
               config: ReplicateConfig | None = None) -> OpGen[None]:
        """Store ``value``, replacing an existing object (readers holding a lease
        keep reading the old bytes until it ends).  When another write of the key is
        in progress, the master refuses the upsert (OBJECT_ALREADY_EXISTS) and it
        returns without storing its value (its sessions do tag the key): it is
        taken as done just before that write, whose value then replaces it (if that
        write is revoked instead, the key keeps what it held)."""
        return (yield from self._put(Op.UPSERT_START, key, (value,), config))

    @operation
    def upsert_from(self, key: str, buffer: Any, config: ReplicateConfig | None = None) -> OpGen[None]:
        """Like :meth:`upsert` from any buffer-protocol object."""
        return (yield from self._put(Op.UPSERT_START, key, (buffer,), config))

    @operation
    def upsert_parts(self, key: str, *parts: bytes | bytearray | memoryview,
                     config: ReplicateConfig | None = None) -> OpGen[None]:
        """Like :meth:`upsert` with the value given as consecutive parts (no join copy)."""
        return (yield from self._put(Op.UPSERT_START, key, parts, config))

    def _tag_plan(self, config: Any, n: int, op: str, kv: Any
                  ) -> tuple[list[bytes] | None, list[list[str]] | None]:
        """A write's session tags (``ReplicateConfig.session_tags``): ``(tags to send,
        None)``, or ``(None, kv_sessions lists)`` for a master that takes them as
        memberships (``--session-tags-as-kv-sessions``); ``(None, None)`` when there are
        none, the write has ``kv``-sessions already (those carry no tags) or the master
        is older than 1.5 (the tags are then dropped, said once in the log)."""
        stags = _session_tags_wire(config, n, op)
        if stags is None or kv:
            return None, None
        w = self._welcome()
        if w.tags_as_sessions:
            return None, [[t.decode()] if t else [] for t in stags]
        if not w.tags:
            if not self._tags_dropped:
                self._tags_dropped = True
                log.warning("the master is older than protocol 1.5: session tags are dropped")
            return None, None
        return stags, None

    def _write_batch(self, op_start: Op, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None,
                     tags: Sequence[Sequence[Any]] | None = None,
                     gids: list[bytes] | None = None,
                     stags: list[bytes] | None = None) -> OpGen:
        """A batch of puts or upserts; ``tags``: the sessions per key, when given
        instead of ``config.kv_sessions``; ``gids``: the group per key (as sent), when
        given instead of ``config.group_ids``; ``stags``: the session tags (as sent),
        when given instead of ``config.session_tags``."""
        if len(keys) != len(values):
            raise E.InvalidParams("keys and values differ in length", op=op_start.name)
        values = _byte_values(values, op_start.name)
        sizes = list(map(len, values))
        if sizes and min(sizes) <= 0:
            bad = [i for i, s in enumerate(sizes) if s <= 0]
            raise E.InvalidParams(f"empty values at positions {bad[:8]}", op=op_start.name)
        if tags is None and config is not None:
            tags = config.kv_sessions
        if stags is None and not tags:
            stags, as_kv = self._tag_plan(config, len(keys), op_start.name, tags)
            if as_kv is not None:
                tags = as_kv
        stags = stags or None  # ([] from _write_once_per_key: none, already decided)
        if gids is None and not tags:
            gids = _group_ids_wire(config, len(keys), op_start.name)
        gids = gids or None
        # Tagged and grouped writes go to each key's shard (their walks start there).
        bkeys, groups = self._group(keys, None if tags or gids or stags else op_start)
        if not bkeys:
            return []
        cfg = config.to_wire() if config is not None else None
        btags: list[list[bytes]] | None = None
        if tags:
            if len(tags) != len(keys):
                raise E.InvalidParams(f"kv_sessions has {len(tags)} lists for {len(keys)} keys",
                                      op=op_start.name)
            btags = [[_b(t) for t in ts] for ts in tags]
        if len(set(bkeys)) < len(bkeys):
            return (yield from self._write_once_per_key(op_start, keys, values, bkeys, btags,
                                                        config, gids, stags))
        if btags is not None:
            op_start = _TAGGED[op_start]
        results: list[int] = [0] * len(bkeys)
        shards = list(groups)
        write_id = next(self._write_ids)
        columns = self._welcome().columns
        tail = [write_id, True] if columns else [write_id]
        if (gids is not None or stags is not None) and not columns:
            tail.append(False)

        def revoke(which: dict[int, list[int]]) -> NoWait:
            return NoWait(self._fan(Op.BATCH_PUT_REVOKE, {
                s: [_at(bkeys, idx), write_id] for s, idx in which.items() if idx}))

        sent_at = _monotonic()
        try:
            # Tolerant: a shard that refuses its whole request must not strand the
            # writes the other shards already started.
            starts = yield Tolerant(
                (op_start.value, P.route_for_shard(s),
                 [_at(bkeys, groups[s]), _at(sizes, groups[s]), cfg,
                  *([_at(btags, groups[s])] if btags is not None else []), *tail,
                  *([_at(gids, groups[s])] if gids is not None else
                    [None] if stags is not None else []),
                  *([_at(stags, groups[s])] if stags is not None else [])])
                for s in shards)
        except GeneratorExit:
            raise
        except BaseException as exc:
            lost = unanswered(exc, len(shards))
            if lost:  # those starts may still be applied (their replies were lost)
                yield revoke({shards[j]: groups[shards[j]] for j in lost})
            raise
        # Writes pending on the master (shard -> positions): whatever fails from here
        # on, they are revoked (see _put).
        started_on = self._master_instance
        if not columns:  # a 1.0 master answers per key
            starts = [P.replica_columns(b, False) if type(b) is list else b for b in starts]
        pending: dict[int, list[int]] = {}
        for s, body in zip(shards, starts):
            if type(body) is list:
                idx = [i for i, f in zip(groups[s], body[1]) if f >= 0]
                if idx:
                    pending[s] = idx

        ends: dict[int, list[int]] = {}
        revokes: dict[int, list[int]] = {}
        views = _Mappings(self._local_seg)
        failed: E.RequestError | None = None
        fence = WriteFence(self, sent_at, op_start.name)
        clock = _fence.clock  # (read before each block: see kvmaster._fence)
        try:
            yield from self._know(r for body in starts if type(body) is list
                                  for r in _columns_replicas(body))
            if self._master_instance != started_on:
                raise self._write_lost(op_start)  # its ranges may be other keys' now
            # Past the fence's limit the loop stops (LeaseExpired), and every write it
            # started is revoked (below).
            limit = fence.limit()
            exists = Status.OBJECT_ALREADY_EXISTS
            for s, body in zip(shards, starts):
                if isinstance(body, E.RequestError):
                    failed = failed or body
                    for i in groups[s]:
                        results[i] = body.code
                    continue
                names, first, offsets, more = body[:4]
                further = dict(more) if more else None
                idx = groups[s]
                if further is None and len(names) == 1 and min(first, default=-1) == 0:
                    # Every key started, with one replica, all in one segment: when it
                    # is on this host, straight into it (a mapping of this client's own,
                    # pwrite into a peer's).
                    seg = views[names[0]]
                    if seg is not None:
                        try:
                            if seg.owner:
                                view = seg.buf
                                for i, off in zip(idx, offsets):
                                    n = sizes[i]
                                    if n > FENCE_BLOCK:
                                        _copy_blocks(view, off, values[i], n, fence, limit)
                                        continue
                                    if clock() > limit:
                                        raise fence.expired()
                                    view[off:off + n] = values[i]
                            else:  # (adjacent ranges in one pwritev per block)
                                _fenced_write_each(seg, [(off, values[i]) for i, off
                                                         in zip(idx, offsets)], fence, limit)
                        except (OSError, ValueError):  # closed or full: the loop below says why
                            pass
                        else:
                            ends[s] = idx
                            continue
                for pos, (i, f, off) in enumerate(zip(idx, first, offsets)):
                    if f < 0:
                        results[i] = 0 if f == exists else f
                        continue
                    name = names[f]
                    if further is None or pos not in further:
                        # one replica: straight into it when it is here
                        seg = views[name]
                        if seg is not None:
                            try:
                                _fenced_write(seg, off, (values[i],), fence, limit)
                            except (OSError, ValueError):  # the general path says why
                                pass
                            else:
                                ends.setdefault(s, []).append(i)
                                continue
                        r = [[name, off]]
                    else:
                        r = [[name, off], *further[pos]]
                    try:
                        self._write(r, (values[i],), fence, limit)
                    except TransferError:
                        results[i] = Status.TRANSFER_FAIL  # not revoked: see _put
                        pending[s].remove(i)
                        continue
                    except E.LeaseExpired:
                        raise
                    except (OSError, ValueError, E.KVMasterError) as exc:
                        results[i] = _write_failure(exc)
                        revokes.setdefault(s, []).append(i)
                        continue
                    ends.setdefault(s, []).append(i)
        except GeneratorExit:
            raise
        except BaseException:
            yield revoke(pending)
            raise
        if revokes:
            yield revoke(revokes)
        if ends:
            end_shards = list(ends)
            sums = self.config.write_checksums
            try:
                done = yield self._fan(Op.BATCH_PUT_END, {
                    s: [_at(bkeys, ends[s]), write_id,
                        *([[_checksum(values[i]) for i in ends[s]]] if sums else [])]
                    for s in end_shards})
            except GeneratorExit:
                raise
            except BaseException as exc:
                lost = unanswered(exc, len(end_shards))
                if lost:
                    yield revoke({end_shards[j]: ends[end_shards[j]] for j in lost})
                raise
            if self._master_instance != started_on and any(
                    r in _LOST_WRITE for body in done for r in body):
                raise self._write_lost(op_start)
            for s, body in zip(end_shards, done):
                for i, r in zip(ends[s], body):
                    results[i] = r
        if failed is not None and failed.code in (Status.INVALID_PARAMS, Status.UNSUPPORTED):
            raise failed  # a malformed request is the caller's bug, not a per-key outcome
        return results

    @operation
    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> OpGen[list[int]]:
        """Write-once puts; one status per position (0 = stored or already there).  A
        key given more than once is written once, from its first position; each of
        its positions gets that write's status (:meth:`_write_once_per_key`)."""
        return (yield from self._write_batch(Op.BATCH_PUT_START, keys, values, config))

    @operation
    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any],
                       config: ReplicateConfig | None = None) -> OpGen[list[int]]:
        """:meth:`put_batch` from buffer-protocol objects."""
        return (yield from self._write_batch(Op.BATCH_PUT_START, keys, buffers, config))

    @operation
    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None = None) -> OpGen[list[int]]:
        """Upserts; one status per position (0: stored, or refused because a write of
        the key was in progress, which replaces it: see :meth:`upsert`).  A key given
        more than once is written once, with the value and sessions of its last
        position; each of its positions gets that write's status
        (:meth:`_write_once_per_key`)."""
        return (yield from self._write_batch(Op.BATCH_UPSERT_START, keys, values, config))

    def _write_once_per_key(self, op_start: Op, keys: Sequence[str], values: Sequence[Any],
                            bkeys: list[bytes], btags: list[list[bytes]] | None,
                            config: ReplicateConfig | None,
                            gids: list[bytes] | None = None,
                            stags: list[bytes] | None = None) -> OpGen:
        """A batch (checked whole by :meth:`_write_batch`) that repeats keys: each key is
        written once, from one of its positions, with that position's value and
        sessions: the first for a put (write-once: the first write is the one kept),
        the last for an upsert (each replaces the one before); every position of the
        key answers that write's status.  Sent as they are, the later positions would
        be refused by the first one's write in progress (OBJECT_ALREADY_EXISTS) and
        answered 0 whatever became of that write."""
        if op_start is Op.BATCH_UPSERT_START:
            chosen = {k: i for i, k in enumerate(bkeys)}  # the last position of each key
        else:
            chosen = {}
            for i, k in enumerate(bkeys):
                chosen.setdefault(k, i)
        keep = sorted(chosen.values())
        got = yield from self._write_batch(
            op_start, [keys[i] for i in keep], [values[i] for i in keep], config,
            None if btags is None else [btags[i] for i in keep],
            # ([]: none; config's per-key lists are of the whole batch, not these keys)
            [] if gids is None else [gids[i] for i in keep],
            [] if stags is None else [stags[i] for i in keep])
        by_key = {bkeys[i]: r for i, r in zip(keep, got)}
        return [by_key[k] for k in bkeys]

    # ----------------------------------------------------------------- gets

    def _desc(self, key: str) -> OpGen:
        """-> ``(size, replicas, lease deadline, checksum)``; the deadline counts from
        the send; the checksum is None when the object has none, the master is older
        than 1.4 or ``verify_checksums`` is off (then it is not asked for)."""
        bkey = _b(key)
        t0 = _monotonic()
        fields = [bkey, True] if self.config.verify_checksums else [bkey]
        (desc,) = yield [(Op.GET_REPLICA_LIST.value, self._route(bkey), fields)]
        yield from self._know(desc[2])
        return desc[0], desc[2], t0 + desc[1] / 1000.0, desc[3] if len(desc) > 3 else None

    @staticmethod
    def _check_lease(deadline: float, what: str) -> None:
        if _monotonic() > deadline:
            raise _lease_expired(what, "get")

    @operation
    def get(self, key: str) -> OpGen[bytes]:
        """The object's bytes.  Raises ObjectNotFound, LeaseExpired (the read ended after
        its lease and its bytes could not be checked against a checksum, or did not
        match one), ChecksumMismatch
        (no replica matches the object's checksum, see ``ClientConfig.verify_checksums``),
        TRANSFER_FAIL (-800: no replica readable)."""
        size, replicas, deadline, want = yield from self._desc(key)
        return (yield from self._checked(
            _b(key), want, lambda bad: self._read_bytes(replicas, size, want, bad), deadline))

    @operation
    def get_buffer(self, key: str) -> OpGen[memoryview]:
        """The object's bytes as a memoryview over a private copy.  Raises as :meth:`get`."""
        size, replicas, deadline, want = yield from self._desc(key)
        dst = bytearray(size)
        yield from self._checked(
            _b(key), want, lambda bad: self._read_into(replicas, size, dst, want, bad), deadline)
        return memoryview(dst)

    @operation
    def get_into(self, key: str, buffer: Any) -> OpGen[int]:
        """Copy the object into ``buffer`` (writable, buffer protocol); returns bytes
        read.  Raises InvalidParams if the buffer is too small, else as :meth:`get` (after
        ChecksumMismatch the buffer holds undefined bytes)."""
        size, replicas, deadline, want = yield from self._desc(key)
        dst = memoryview(buffer).cast("B")
        if dst.nbytes < size:
            raise E.InvalidParams(f"buffer of {dst.nbytes} bytes < object of {size}", op="get_into")
        yield from self._checked(
            _b(key), want, lambda bad: self._read_into(replicas, size, dst, want, bad), deadline)
        return size

    @operation
    def get_into_ranges(self, key: str, buffer: Any,
                        ranges: Sequence[tuple[int, int, int]]) -> OpGen[Any]:
        """Copy byte ranges of one object into ``buffer`` (writable, buffer protocol):
        each ``(dst_offset, src_offset, size)`` copies the object's bytes
        ``[src_offset, src_offset + size)`` to ``buffer[dst_offset:dst_offset + size]``.
        Returns the bytes copied per range, or INVALID_PARAMS (-600) at a range that
        lies outside the object or the buffer (the others are still copied); at most
        MAX_RANGES ranges.  Raises ObjectNotFound, LeaseExpired, InvalidParams.  Not
        checked against the object's checksum (a range is not the whole object)."""
        if len(ranges) > MAX_RANGES:
            raise E.InvalidParams(f"{len(ranges)} ranges > {MAX_RANGES}", op="get_into_ranges")
        size, replicas, deadline, _ = yield from self._desc(key)
        dst = memoryview(buffer).cast("B")
        out: list[int] = []
        for d, s, n in ranges:
            if min(d, s, n) < 0 or s + n > size or d + n > dst.nbytes:
                out.append(int(Status.INVALID_PARAMS))
                continue
            if n:
                self._read_into([[name, off + s] for name, off in replicas], n, dst[d:d + n])
            out.append(n)
        self._check_lease(deadline, repr(key))
        return out

    def _descs(self, keys: Sequence[str]) -> OpGen:
        """Read leases of ``keys`` -> ``(columns, lease deadline)``; ``columns`` is
        ``[segments, first, offsets, more, sizes, checksums]`` in key order (see
        :func:`kvmaster.protocol.replica_columns`; ``more`` as a dict position ->
        further replicas; ``checksums`` None when no key has one, when the master is
        older than 1.4 or ``verify_checksums`` is off, else one item per key, None for
        an object without one)."""
        t0 = _monotonic()
        w = self._welcome()
        lease_ms = w.lease_ttl_ms
        op = Op.BATCH_GET_REPLICA_LIST
        bkeys, groups = self._group(keys, op)
        if not bkeys:
            return [[], [], [], {}, [], None], t0 + lease_ms / 1000.0
        columns = w.columns
        verify = self.config.verify_checksums
        tail = [columns, True] if verify else [True] if columns else []
        shards = list(groups)
        if len(shards) == 1:
            bodies = yield [(op.value, P.route_for_shard(shards[0]), [bkeys, *tail])]
        else:
            bodies = yield [(op.value, P.route_for_shard(s), [[bkeys[i] for i in groups[s]],
                                                              *tail]) for s in shards]
        if not columns:  # a 1.0 master answers per key
            bodies = [P.replica_columns(b, True) for b in bodies]
        yield from self._know(r for b in bodies for r in _columns_replicas(b))
        n_keys = len(bkeys)
        if len(bodies) == 1:
            body = bodies[0]
            names, first, offsets, more, sizes = body[:5]
            sums = body[6] if verify and len(body) > 6 and body[6].count(None) < n_keys else None
            return [names, first, offsets, dict(more), sizes, sums], t0 + lease_ms / 1000.0
        n = len(bkeys)
        names = []
        first, offsets, sizes = [0] * n, [0] * n, [0] * n
        sums = [None] * n if verify else None
        further = {}
        for s, body in zip(shards, bodies):
            base = len(names)
            names.extend(body[0])
            where = groups[s]
            for i, f, off, size in zip(where, body[1], body[2], body[4]):
                first[i] = f + base if f >= 0 else f
                offsets[i] = off
                sizes[i] = size
            for pos, replicas in body[3]:
                further[where[pos]] = replicas
            if sums is not None and len(body) > 6:
                for i, c in zip(where, body[6]):
                    sums[i] = c
        if sums is not None and sums.count(None) == n:
            sums = None
        return [names, first, offsets, further, sizes, sums], t0 + lease_ms / 1000.0

    @operation
    def get_batch(self, keys: Sequence[str]) -> OpGen[list[bytes | None]]:
        """Bytes per position; None where the object is missing, or where no replica
        matches the object's checksum (counted in ``checksum_failures``; its corrupt
        replicas are dropped, see ``ClientConfig.verify_checksums``).  Raises
        LeaseExpired (the read ended after its lease and a position's bytes had no
        checksum to be checked against; see :func:`_late_statuses`), TRANSFER_FAIL
        (-800: a replica that cannot be read)."""
        (names, first, offsets, further, sizes, sums), deadline = yield from self._descs(keys)
        out: list[bytes | None] = []
        append = out.append
        segs = _Mappings(self._local_seg)
        corrupt: list[tuple[bytes, list[Any], int]] = []
        want = None
        marks = self.checksum_mismatches, self.checksum_failures
        for pos, (f, off, size) in enumerate(zip(first, offsets, sizes)):
            if f < 0:
                append(None)
                continue
            name = names[f]
            seg = segs[name]
            if sums is not None:
                want = sums[pos]
            if seg is not None:
                try:
                    data = seg.read(off, size)
                except (OSError, ValueError):  # closed or shrunk: the general path says why
                    pass
                else:
                    if want is None or _checksum(data) == want:
                        append(data)
                        continue
            bad: list[list[Any]] = []
            try:
                append(self._read_bytes([[name, off], *further.get(pos, ())], size, want, bad))
            except E.ObjectNotFound:  # its segments went with their owners meanwhile
                append(None)
            except E.ChecksumMismatch:
                self.checksum_failures += 1
                append(None)
            if bad:
                bkey = _b(keys[pos])
                corrupt.extend((bkey, r, want) for r in bad)
        if _monotonic() > deadline:  # (see _late_statuses)
            mismatched = self.checksum_failures != marks[1]  # (a None that is no miss)
            self._late_uncount(marks)
            if mismatched or any(d is not None and (sums is None or sums[i] is None)
                                 for i, d in enumerate(out)):
                raise _lease_expired("a batch", "get")
            return out
        if corrupt:
            yield self._drops(corrupt)
        return out

    @operation
    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> OpGen[list[int]]:
        """Copy each object into its buffer; bytes read per position or a negative status
        (CHECKSUM_MISMATCH -801 where no replica matches the object's checksum: that
        buffer then holds undefined bytes)."""
        if len(keys) != len(buffers):
            raise E.InvalidParams("keys and buffers differ in length", op="batch_get_into")
        (names, first, offsets, further, sizes, sums), deadline = yield from self._descs(keys)
        out: list[int] = []
        marks = self.checksum_mismatches, self.checksum_failures
        corrupt: list[tuple[bytes, list[Any], int]] = []
        want = None
        for pos, (f, off, size, b) in enumerate(zip(first, offsets, sizes, buffers)):
            if f < 0:
                out.append(f)
                continue
            dst = memoryview(b).cast("B")
            if dst.nbytes < size:
                out.append(Status.INVALID_PARAMS)
                continue
            if sums is not None:
                want = sums[pos]
            bad: list[list[Any]] = []
            try:
                self._read_into([[names[f], off], *further.get(pos, ())], size, dst, want, bad)
            except E.ObjectNotFound as exc:  # its segments went with their owners meanwhile
                out.append(exc.code)
                continue
            except E.ChecksumMismatch as exc:
                self.checksum_failures += 1
                out.append(int(exc.code))
                continue
            finally:
                if bad:
                    bkey = _b(keys[pos])
                    corrupt.extend((bkey, r, want) for r in bad)
            out.append(size)
        if _monotonic() > deadline:
            self._late_uncount(marks)
            return _late_statuses(out, sums)
        if corrupt:
            yield self._drops(corrupt)
        return out

    # ------------------------- gathered and split batch writes; ranged reads

    def _revoke_fan(self, bkeys: list[bytes], write_id: int,
                    which: dict[int, list[int]]) -> NoWait:
        """BATCH_PUT_REVOKE of the positions ``which`` (shard -> positions) of a batch
        write, sent without waiting (see :meth:`_put`)."""
        return NoWait(self._fan(Op.BATCH_PUT_REVOKE, {
            s: [_at(bkeys, idx), write_id] for s, idx in which.items() if idx}))

    def _start_batch(self, keys: Sequence[str], sizes: Sequence[int],
                     config: ReplicateConfig | None, op: str) -> OpGen:
        """BATCH_PUT_START of distinct ``keys``, ``sizes`` bytes each -> PendingPuts."""
        if len(keys) != len(sizes):
            raise E.InvalidParams("keys and sizes differ in length", op=op)
        if not all(type(s) is int and s > 0 for s in sizes):
            bad = [i for i, s in enumerate(sizes) if type(s) is not int or s <= 0]
            raise E.InvalidParams(f"sizes must be positive ints (positions {bad[:8]})", op=op)
        op_start = Op.BATCH_PUT_START
        tags = config.kv_sessions if config is not None else None
        stags, as_kv = self._tag_plan(config, len(keys), op, tags)
        if as_kv is not None:
            tags = as_kv
        gids = None if tags else _group_ids_wire(config, len(keys), op)
        bkeys, groups = self._group(keys, None if tags or gids or stags else op_start)
        if len(set(bkeys)) < len(bkeys):
            raise E.InvalidParams("a key is given more than once", op=op)
        pending = PendingPuts(bkeys, list(sizes), next(self._write_ids), self._master_instance)
        if not bkeys:
            return pending
        cfg = config.to_wire() if config is not None else None
        btags: list[list[bytes]] | None = None
        if tags:
            if len(tags) != len(keys):
                raise E.InvalidParams(f"kv_sessions has {len(tags)} lists for {len(keys)} keys",
                                      op=op)
            btags = [[_b(t) for t in ts] for ts in tags]
            op_start = _TAGGED[op_start]
        write_id = pending.write_id
        columns = self._welcome().columns
        tail = [write_id, True] if columns else [write_id]
        if (gids is not None or stags is not None) and not columns:
            tail.append(False)
        shards = list(groups)
        sent_at = _monotonic()
        try:
            starts = yield Tolerant(
                (op_start.value, P.route_for_shard(s),
                 [_at(bkeys, groups[s]), _at(pending.sizes, groups[s]), cfg,
                  *([_at(btags, groups[s])] if btags is not None else []), *tail,
                  *([_at(gids, groups[s])] if gids is not None else
                    [None] if stags is not None else []),
                  *([_at(stags, groups[s])] if stags is not None else [])])
                for s in shards)
        except GeneratorExit:
            raise
        except BaseException as exc:
            lost = unanswered(exc, len(shards))
            if lost:  # those starts may still be applied (their replies were lost)
                yield self._revoke_fan(bkeys, write_id, {shards[j]: groups[shards[j]]
                                                         for j in lost})
            raise
        pending.started_on = self._master_instance
        pending.fence = WriteFence(self, sent_at, op)
        if not columns:  # a 1.0 master answers per key
            starts = [P.replica_columns(b, False) if type(b) is list else b for b in starts]
        failed: E.RequestError | None = None
        for s, body in zip(shards, starts):
            idx = groups[s]
            for i in idx:
                pending.shard[i] = s
            if isinstance(body, E.RequestError):
                failed = failed or body
                for i in idx:
                    pending.status[i] = body.code
                continue
            names, first, offsets, more = body[:4]
            further = dict(more) if more else {}
            for pos, (i, f, off) in enumerate(zip(idx, first, offsets)):
                if f < 0:
                    pending.status[i] = f
                else:
                    pending.replicas[i] = [[names[f], off], *further.get(pos, ())]
        try:
            yield from self._know(r for rs in pending.replicas if rs for r in rs)
            if failed is not None and failed.code in (Status.INVALID_PARAMS, Status.UNSUPPORTED):
                raise failed  # a malformed request is the caller's bug
        except GeneratorExit:
            raise
        except BaseException:
            yield self._revoke_pending(pending, pending.open())
            raise
        return pending

    def _revoke_pending(self, pending: PendingPuts, positions: Iterable[int]) -> NoWait:
        which: dict[int, list[int]] = {}
        for i in positions:
            which.setdefault(pending.shard[i], []).append(i)
            pending.replicas[i] = None
            pending.status[i] = Status.INVALID_PARAMS  # no longer writable
        return self._revoke_fan(pending.bkeys, pending.write_id, which)

    def _end_pending(self, pending: PendingPuts, positions: list[int],
                     sums: dict[int, int | None] | None = None) -> OpGen:
        """BATCH_PUT_END of started positions -> {position: status}; ``sums``: the
        checksum to send per position (None: none for any)."""
        which: dict[int, list[int]] = {}
        for i in positions:
            which.setdefault(pending.shard[i], []).append(i)
        shards = list(which)
        try:
            done = yield self._fan(Op.BATCH_PUT_END, {
                s: [_at(pending.bkeys, which[s]), pending.write_id,
                    *([[sums.get(i) for i in which[s]]] if sums else [])] for s in shards})
        except GeneratorExit:
            raise
        except BaseException as exc:
            lost = unanswered(exc, len(shards))
            if lost:
                yield self._revoke_pending(pending, [i for j in lost for i in which[shards[j]]])
            raise
        if self._master_instance != pending.started_on and any(
                r in _LOST_WRITE for body in done for r in body):
            raise self._write_lost(Op.BATCH_PUT_START)
        out: dict[int, int] = {}
        for s, body in zip(shards, done):
            for i, r in zip(which[s], body):
                out[i] = int(r)
                pending.replicas[i] = None
                pending.status[i] = int(r) if r < 0 else Status.INVALID_PARAMS
        return out

    @operation
    def batch_put_start(self, keys: Sequence[str], sizes: Sequence[int],
                        config: ReplicateConfig | None = None) -> OpGen[PendingPuts]:
        """Start write-once writes of ``keys`` (distinct), ``sizes`` bytes each, whose
        bytes come later: -> :class:`PendingPuts` (its ``status``: 0 where a write was
        started, else the key's negative status, OBJECT_ALREADY_EXISTS for a key stored
        or being written already).  Copy the bytes with :meth:`batch_write_ranges`,
        then :meth:`batch_put_end` or :meth:`batch_put_revoke` them; a write neither
        ended nor revoked is dropped by the master after its
        ``--put-start-discard-timeout``, and readers see nothing before its end.
        Raises InvalidParams (lengths, sizes, a repeated key, a batch over max_batch)."""
        return (yield from self._start_batch(keys, sizes, config, "batch_put_start"))

    @operation
    def batch_write_ranges(self, pending: PendingPuts, positions: Sequence[int],
                           ranges: Sequence[Sequence[tuple[int, Any]]]) -> OpGen[list[int]]:
        """Copy byte ranges into started writes: ``ranges[k]`` is a list of
        ``(offset, buffer)`` for the write at ``positions[k]``, each buffer's bytes
        going to ``[offset, offset + len)`` of its value.  Returns per ``k`` the
        bytes copied or a negative status: INVALID_PARAMS for a position not started
        (or already ended or revoked) or a range outside the value, TRANSFER_FAIL
        for a copy that failed (nothing is revoked: end or revoke decides).  Sends
        nothing to the master, except when the writes outlived their fence (the master
        may have dropped them, or expired this client and freed their space:
        :mod:`kvmaster._fence`): then nothing more is copied, every write of
        ``pending`` still open is revoked, and LeaseExpired is raised."""
        if len(positions) != len(ranges):
            raise E.InvalidParams("positions and ranges differ in length",
                                  op="batch_write_ranges")
        lost = self._master_instance != pending.started_on
        fence = pending.fence
        try:
            limit = fence.limit() if pending.open() else 0.0
        except E.LeaseExpired:
            if not lost:
                yield self._revoke_pending(pending, pending.open())
                raise
            limit = 0.0  # (the master changed: said below)
        out: list[int] = []
        for i, items in zip(positions, ranges):
            replicas = pending.replicas[i] if 0 <= i < len(pending.replicas) else None
            if replicas is None:
                out.append(int(Status.INVALID_PARAMS))
                continue
            if lost:
                raise self._write_lost(Op.BATCH_PUT_START)
            size = pending.sizes[i]
            try:
                parts = _byte_values([b for _, b in items], "batch_write_ranges")
            except E.InvalidParams:
                out.append(int(Status.INVALID_PARAMS))
                continue
            if any(type(o) is not int or o < 0 or o + len(b) > size
                   for (o, _), b in zip(items, parts)):
                out.append(int(Status.INVALID_PARAMS))
                continue
            total = 0
            try:
                for (o, _), b in zip(items, parts):
                    self._write([[name, off + o] for name, off in replicas], (b,), fence,
                                limit)
                    total += len(b)
            except E.LeaseExpired:
                yield self._revoke_pending(pending, pending.open())
                raise
            except (TransferError, OSError, ValueError, E.KVMasterError):
                out.append(int(Status.TRANSFER_FAIL))
                continue
            out.append(total)
        return out

    def _segment_sums(self, pending: PendingPuts, positions: list[int]) -> dict[int, int | None]:
        """Checksums of split puts' values as their first replicas hold them now (read
        back from the segment: the ranged writes came in any order), None for a write
        whose first replica is not on this host or cannot be read (stored unverified)."""
        out: dict[int, int | None] = {}
        segs = _Mappings(self._local_seg)
        for i in positions:
            name, off = pending.replicas[i][0]
            seg = segs[name]
            try:
                out[i] = None if seg is None else _checksum(seg.read(off, pending.sizes[i]))
            except (OSError, ValueError):
                out[i] = None
        return out

    @operation
    def batch_put_end(self, pending: PendingPuts, positions: Sequence[int]) -> OpGen[list[int]]:
        """End started writes (their bytes become readable): one status per position,
        0 when stored; INVALID_PARAMS for a position not started, ended or revoked.
        A write whose end got no answer is revoked and its error raised.  With
        ``write_checksums`` each value's checksum is taken from its first replica's
        bytes now (on this host; a replica elsewhere: none), so it certifies what the
        segment holds at the end, not what the ranged writes meant to copy."""
        out = [int(Status.INVALID_PARAMS)] * len(positions)
        todo = sorted({i for i in positions
                       if 0 <= i < len(pending.replicas) and pending.replicas[i] is not None})
        if todo:
            sums = self._segment_sums(pending, todo) if self.config.write_checksums else None
            done = yield from self._end_pending(pending, todo, sums)
            out = [done.get(i, out[k]) if 0 <= i < len(pending.replicas) else out[k]
                   for k, i in enumerate(positions)]
        return out

    @operation
    def batch_put_revoke(self, pending: PendingPuts, positions: Sequence[int]) -> OpGen[list[int]]:
        """Drop started writes (nothing is stored; sent without waiting, applied
        before anything this client sends to the same shards afterwards): 0 per
        position revoked, INVALID_PARAMS for one not started, ended or revoked."""
        live = [0 <= i < len(pending.replicas) and pending.replicas[i] is not None
                for i in positions]
        todo = sorted({i for i, ok in zip(positions, live) if ok})
        if todo:
            yield self._revoke_pending(pending, todo)
        return [0 if ok else int(Status.INVALID_PARAMS) for ok in live]

    @operation
    def batch_put_from_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]],
                             config: ReplicateConfig | None = None) -> OpGen[list[int]]:
        """:meth:`put_batch` where each value is given as consecutive parts
        (``parts[i]``: buffer-protocol objects), copied once from the parts into the
        segment (no join).  One status per position: 0 stored (or there already),
        INVALID_PARAMS for a position whose parts are empty or not contiguous bytes,
        else the key's negative status.  A key given more than once is written once,
        from its first position (as :meth:`put_batch`)."""
        op = "batch_put_from_parts"
        if len(keys) != len(parts):
            raise E.InvalidParams("keys and parts differ in length", op=op)
        values: list[Any] = []
        for ps in parts:
            try:
                values.append(_byte_values(ps, op))
            except E.InvalidParams:
                values.append(None)
        return (yield from self._put_gathered(op, keys, values, config, False))

    @operation
    def batch_put_from_ptrs(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                            sizes: Sequence[Sequence[int]],
                            config: ReplicateConfig | None = None) -> OpGen[list[int]]:
        """:meth:`batch_put_from_parts` with each value's parts given as host addresses
        (``ptrs[i]``) and sizes in bytes (``sizes[i]``), read with one ``memmove`` per
        part into a segment mapped here (no Python object per part).  The caller
        vouches for the addresses: memory it owns, readable for those sizes."""
        op = "batch_put_from_ptrs"
        if len(keys) != len(ptrs) or len(keys) != len(sizes):
            raise E.InvalidParams("keys, ptrs and sizes differ in length", op=op)
        values = [list(zip(p, s)) if len(p) == len(s) else None for p, s in zip(ptrs, sizes)]
        return (yield from self._put_gathered(op, keys, values, config, True))

    def _put_gathered(self, op: str, keys: Sequence[str], values: list[Any],
                      config: ReplicateConfig | None, raw: bool) -> OpGen:
        """The writes of :meth:`batch_put_from_parts` (``raw`` False: ``values[i]`` a
        list of byte buffers) and :meth:`batch_put_from_ptrs` (``raw``: a list of
        ``(address, size)``); None for a position refused as INVALID_PARAMS."""
        out = [0] * len(keys)
        chosen: dict[Any, int] = {}
        totals: list[int] = []
        for i, (k, v) in enumerate(zip(keys, values)):
            n = -1 if v is None else sum(s for _, s in v) if raw else sum(map(len, v))
            if n <= 0:
                out[i] = int(Status.INVALID_PARAMS)
                continue
            if k not in chosen:
                chosen[k] = i
                totals.append(n)
        keep = list(chosen.values())
        pending = yield from self._start_batch([keys[i] for i in keep], totals, config, op)
        exists = Status.OBJECT_ALREADY_EXISTS
        ends: list[int] = []
        bad: list[int] = []
        local = _Mappings(self._local_address)
        memmove = _memmove
        clock = _fence.clock  # (read before each block: see kvmaster._fence)
        fence = pending.fence
        try:
            limit = fence.limit() if pending.open() else 0.0
            for j, i in enumerate(keep):
                v = values[i]
                replicas = pending.replicas[j]
                if replicas is None:
                    st = pending.status[j]
                    out[i] = 0 if st == exists else st
                    continue
                if len(replicas) == 1:  # one replica mapped here: straight into it
                    name, pos = replicas[0]
                    mapped = local[name]
                    if mapped is not None:
                        if raw:
                            dst = mapped[1] + pos
                            for p, n in v:
                                if n > FENCE_BLOCK:
                                    _memmove_blocks(dst, p, n, fence, limit)
                                else:
                                    if clock() > limit:
                                        raise fence.expired()
                                    memmove(dst, p, n)
                                dst += n
                        else:
                            view = mapped[0]
                            for p in v:
                                n = len(p)
                                if n > FENCE_BLOCK:
                                    _copy_blocks(view, pos, p, n, fence, limit)
                                else:
                                    if clock() > limit:
                                        raise fence.expired()
                                    view[pos:pos + n] = p
                                pos += n
                        ends.append(j)
                        continue
                try:
                    self._write(replicas, [_raw_view(p, n) for p, n in v] if raw else v,
                                fence, limit)
                except TransferError:
                    out[i] = int(Status.TRANSFER_FAIL)  # not revoked: see _put
                    pending.replicas[j] = None
                    continue
                except E.LeaseExpired:
                    raise
                except (OSError, ValueError, E.KVMasterError) as exc:
                    out[i] = int(_write_failure(exc))
                    bad.append(j)
                    continue
                ends.append(j)
        except GeneratorExit:
            raise
        except BaseException:
            yield self._revoke_pending(pending, pending.open())
            raise
        if bad:
            yield self._revoke_pending(pending, bad)
        if ends:
            sums = None
            if self.config.write_checksums:  # (from the caller's memory, as it was copied)
                of = checksum_ptrs if raw else checksum_parts
                sums = {j: of(values[keep[j]]) for j in ends}
            done = yield from self._end_pending(pending, ends, sums)
            for j, r in done.items():
                out[keep[j]] = r
        for i, k in enumerate(keys):  # a repeated key answers its first position's write
            j = chosen.get(k)
            if j is not None and j != i and out[i] == 0:
                out[i] = out[j]
        return out

    def _local_address(self, name: str) -> tuple[Any, int, Any] | None:
        """(view, start address, the export that keeps the mapping open while held) of
        a segment mapped on this host, or None (see :meth:`_local_view`)."""
        view = self._local_view(name)
        if view is None:
            return None
        try:
            probe = ctypes.c_char.from_buffer(view)
        except (TypeError, ValueError):
            return None
        return view, ctypes.addressof(probe), probe

    def _leases(self, keys: Sequence[str]) -> OpGen:
        (names, first, offsets, further, sizes, sums), deadline = yield from self._descs(keys)
        replicas: list[list[list[Any]] | None] = []
        for pos, (f, off) in enumerate(zip(first, offsets)):
            replicas.append(None if f < 0 else [[names[f], off], *further.get(pos, ())])
        return ReadLeases(list(sizes), replicas, [min(f, 0) for f in first], deadline, sums)

    def _read_parts(self, replicas: list[list[Any]], items: Sequence[tuple[int, Any]],
                    want: int, bad: list[list[Any]]) -> None:
        """Copy a whole object across ``items`` (``(offset, dst)`` covering it in
        order) from its first readable replica whose bytes match ``want``; the replicas
        that did not are added to ``bad``.  Raises (see :func:`_unreadable`) when none
        did."""
        failed: list[Exception] = []
        dsts = [d for _, d in items]
        for name, off in replicas:
            try:
                seg = self._local(name)
                for o, d in items:
                    if seg is None:
                        self._peer(name).read_into(name, off + o, d.nbytes, d)
                    else:
                        seg.read_into(off + o, d)
            except (OSError, ValueError, E.KVMasterError) as exc:
                failed.append(exc)
                continue
            if checksum_parts(dsts) == want:
                return
            failed.append(self._corrupt(name, off, bad))
        raise _unreadable(failed)

    def _verified_parts(self, keys: Sequence[str], leases: ReadLeases, i: int,
                        items: Sequence[tuple[int, Any]], want: int,
                        corrupt: list[tuple[bytes, list[Any], int]]) -> int:
        """:meth:`_read_parts` of position ``i`` -> its result (size or status); the
        corrupt replicas it found go to ``corrupt``."""
        bad: list[list[Any]] = []
        try:
            self._read_parts(leases.replicas[i], items, want, bad)
            return leases.sizes[i]
        except E.ObjectNotFound as exc:
            return int(exc.code)
        except E.ChecksumMismatch as exc:
            self.checksum_failures += 1
            return int(exc.code)
        except (OSError, ValueError, E.KVMasterError):
            return int(Status.TRANSFER_FAIL)
        finally:
            if bad:
                bkey = _b(keys[i])
                corrupt.extend((bkey, r, want) for r in bad)

    @operation
    def batch_get_leases(self, keys: Sequence[str]) -> OpGen[ReadLeases]:
        """Read leases of ``keys`` in one round -> :class:`ReadLeases` (each found key's
        size and replicas, the others' negative status), for ranged reads with
        :meth:`batch_read_ranges` until the lease ends (``ReadLeases.deadline``,
        ``time.monotonic()``; the master's ``--default-kv-lease-ttl``)."""
        return (yield from self._leases(keys))

    def _copy_ranges(self, leases: ReadLeases, positions: Sequence[int],
                     ranges: Sequence[Sequence[tuple[int, Any]]]) -> list[int]:
        """The copies of :meth:`batch_read_ranges` (no lease check)."""
        out: list[int] = []
        views = _Mappings(self._local_view)
        n_keys = len(leases.replicas)
        for i, items in zip(positions, ranges):
            replicas = leases.replicas[i] if type(i) is int and 0 <= i < n_keys else None
            if replicas is None:
                out.append(leases.status[i] if type(i) is int and 0 <= i < n_keys
                           else int(Status.INVALID_PARAMS))
                continue
            size = leases.sizes[i]
            try:
                dsts = [memoryview(b).cast("B") for _, b in items]
            except (TypeError, ValueError):
                out.append(int(Status.INVALID_PARAMS))
                continue
            if any(type(o) is not int or o < 0 or o + d.nbytes > size or d.readonly
                   for (o, _), d in zip(items, dsts)):
                out.append(int(Status.INVALID_PARAMS))
                continue
            total = 0
            try:
                view = views[replicas[0][0]] if len(replicas) == 1 else None
                base = replicas[0][1]
                for (o, _), d in zip(items, dsts):
                    n = d.nbytes
                    if view is not None:
                        d[:] = view[base + o:base + o + n]
                    else:
                        self._read_into([[name, off + o] for name, off in replicas], n, d)
                    total += n
            except E.ObjectNotFound as exc:
                out.append(int(exc.code))
                continue
            except (TransferError, OSError, ValueError, E.KVMasterError):
                out.append(int(Status.TRANSFER_FAIL))
                continue
            out.append(total)
        return out

    @operation
    def batch_read_ranges(self, leases: ReadLeases, positions: Sequence[int],
                          ranges: Sequence[Sequence[tuple[int, Any]]]) -> OpGen[list[int]]:
        """Copy byte ranges of leased objects into buffers: ``ranges[k]`` is a list of
        ``(offset, buffer)`` for the object at ``positions[k]``, each (writable)
        buffer getting the object's bytes ``[offset, offset + len)``.  Returns per
        ``k`` the bytes copied or a negative status: the key's own (not found),
        INVALID_PARAMS for a range outside the object or a bad buffer,
        LEASE_EXPIRED when the lease ended before the copy did (the bytes may be
        another object's), TRANSFER_FAIL.  Sends nothing to the master."""
        if len(positions) != len(ranges):
            raise E.InvalidParams("positions and ranges differ in length",
                                  op="batch_read_ranges")
        out = self._copy_ranges(leases, positions, ranges)
        if _monotonic() > leases.deadline:
            return [int(Status.LEASE_EXPIRED) if n >= 0 else n for n in out]
        return out
        yield  # an operation that sends nothing

    @operation
    def batch_get_into_parts(self, keys: Sequence[str], buffers: Sequence[Sequence[Any]]
                             ) -> OpGen[list[int]]:
        """Copy each object across its buffers in order (``buffers[i]``: writable
        buffer-protocol objects), once from the segment into each buffer (buffers
        past the object's end are left alone): bytes read per position (the
        object's size) or a negative status; INVALID_PARAMS where the buffers
        together are smaller than the object or one is not a writable buffer;
        CHECKSUM_MISMATCH as :meth:`batch_get_into`."""
        if len(keys) != len(buffers):
            raise E.InvalidParams("keys and buffers differ in length",
                                  op="batch_get_into_parts")
        leases = yield from self._leases(keys)
        out = list(leases.status)
        marks = self.checksum_mismatches, self.checksum_failures
        positions: list[int] = []
        ranges: list[list[tuple[int, Any]]] = []
        corrupt: list[tuple[bytes, list[Any], int]] = []
        for i, bufs in enumerate(buffers):
            if leases.replicas[i] is None:
                continue
            size = leases.sizes[i]
            items: list[tuple[int, Any]] = []
            pos = 0
            try:
                for b in bufs:
                    if pos >= size:
                        break
                    d = memoryview(b).cast("B")
                    n = min(d.nbytes, size - pos)
                    items.append((pos, d if n == d.nbytes else d[:n]))
                    pos += n
            except (TypeError, ValueError):
                pos = -1
            if pos != size:
                out[i] = int(Status.INVALID_PARAMS)
                continue
            want = None if leases.checksums is None else leases.checksums[i]
            if want is not None:  # a whole object: checked (against every replica if need be)
                if any(d.readonly for _, d in items):
                    out[i] = int(Status.INVALID_PARAMS)
                else:
                    out[i] = self._verified_parts(keys, leases, i, items, want, corrupt)
                continue
            positions.append(i)
            ranges.append(items)
        for i, r in zip(positions, self._copy_ranges(leases, positions, ranges)):
            out[i] = r
        if _monotonic() > leases.deadline:
            self._late_uncount(marks)
            return _late_statuses(out, leases.checksums)
        if corrupt:
            yield self._drops(corrupt)
        return out

    @operation
    def batch_get_into_ptrs(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                            sizes: Sequence[Sequence[int]]) -> OpGen[list[int]]:
        """:meth:`batch_get_into_parts` with each key's buffers given as host
        addresses (``ptrs[i]``) and sizes in bytes (``sizes[i]``), filled with one
        ``memmove`` each from this client's own segment (pread from a peer's).  The caller
        vouches for the addresses: memory it owns, writable for those sizes.
        CHECKSUM_MISMATCH as :meth:`batch_get_into`."""
        if len(keys) != len(ptrs) or len(keys) != len(sizes):
            raise E.InvalidParams("keys, ptrs and sizes differ in length",
                                  op="batch_get_into_ptrs")
        leases = yield from self._leases(keys)
        out = list(leases.status)
        local = _Mappings(self._local_address)
        memmove = _memmove
        sums = leases.checksums
        marks = self.checksum_mismatches, self.checksum_failures
        corrupt: list[tuple[bytes, list[Any], int]] = []
        for i, (ps, ss) in enumerate(zip(ptrs, sizes)):
            replicas = leases.replicas[i]
            if replicas is None:
                continue
            size = leases.sizes[i]
            if len(ps) != len(ss) or sum(ss) < size:
                out[i] = int(Status.INVALID_PARAMS)
                continue
            want = None if sums is None else sums[i]
            if want is not None:
                items: list[tuple[int, Any]] = []
                pos = 0
                for p, n in zip(ps, ss):
                    n = min(n, size - pos)
                    if n <= 0:
                        if pos >= size:
                            break
                        continue
                    items.append((pos, _raw_view(p, n)))
                    pos += n
                mapped = local[replicas[0][0]]
                if mapped is not None:  # the first replica here: one memmove per part
                    src = mapped[1] + replicas[0][1]
                    for o, d in items:
                        memmove(_address_of(d), src + o, d.nbytes)
                    if checksum_parts([d for _, d in items]) == want:
                        out[i] = size
                        continue
                out[i] = self._verified_parts(keys, leases, i, items, want, corrupt)
                continue
            mapped = local[replicas[0][0]]
            pos = 0
            if mapped is not None:
                src = mapped[1] + replicas[0][1]
                for p, n in zip(ps, ss):
                    if n >= size - pos:
                        memmove(p, src + pos, size - pos)
                        break
                    memmove(p, src + pos, n)
                    pos += n
                out[i] = size
                continue
            try:
                for p, n in zip(ps, ss):
                    n = min(n, size - pos)
                    if n <= 0:
                        if pos >= size:
                            break
                        continue
                    self._read_into([[name, off + pos] for name, off in replicas], n,
                                    _raw_view(p, n))
                    pos += n
            except E.ObjectNotFound as exc:
                out[i] = int(exc.code)
                continue
            except (TransferError, OSError, ValueError, E.KVMasterError):
                out[i] = int(Status.TRANSFER_FAIL)
                continue
            out[i] = size
        if _monotonic() > leases.deadline:
            self._late_uncount(marks)
            return _late_statuses(out, leases.checksums)
        if corrupt:
            yield self._drops(corrupt)
        return out

    def register_buffer(self, buffer: Any) -> None:
        """Accepted for compatibility: shared-memory reads need no registration."""

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
    def replica_clear(self, keys: Sequence[str], segment: str = "") -> OpGen[list[int]]:
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


def op_name(op: bytes) -> str:
    try:
        return Op(op).name
    except ValueError:
        return op.hex()


_memmove = ctypes.memmove


def _copy_blocks(buf: Any, pos: int, part: Any, n: int, fence: WriteFence,
                 limit: float) -> None:
    """Copy ``part`` (``n`` bytes) to ``buf[pos:]`` in FENCE_BLOCK blocks, checking
    ``fence``'s ``limit`` before each (LeaseExpired)."""
    src = memoryview(part)
    clock = _fence.clock  # (read before each block: see kvmaster._fence)
    for s in range(0, n, FENCE_BLOCK):
        if clock() > limit:
            raise fence.expired()
        e = min(n, s + FENCE_BLOCK)
        buf[pos + s:pos + e] = src[s:e]


def _fenced_write(seg: Any, pos: int, parts: Sequence[Any], fence: WriteFence | None,
                  limit: float) -> None:
    """Write ``parts`` (byte lengths) at ``pos`` of ``seg`` (a mapping of this client's
    own, written in place; a peer's, written with pwrite), checking ``fence``'s
    ``limit`` before each part and each FENCE_BLOCK of a larger one (LeaseExpired)."""
    clock = _fence.clock  # (read before each block: see kvmaster._fence)
    if seg.owner:
        buf = seg.buf
        for part in parts:
            n = len(part)
            if n > FENCE_BLOCK:
                _copy_blocks(buf, pos, part, n, fence, limit)  # type: ignore[arg-type]
            else:
                if clock() > limit:
                    raise fence.expired()  # type: ignore[union-attr]
                buf[pos:pos + n] = part
            pos += n
        return
    for part in parts:
        n = len(part)
        src = memoryview(part)
        for s in range(0, max(n, 1), FENCE_BLOCK):
            if clock() > limit:
                raise fence.expired()  # type: ignore[union-attr]
            seg.write(pos + s, (src[s:s + FENCE_BLOCK],))
        pos += n


def _fenced_write_each(seg: Any, items: list[tuple[int, Any]], fence: WriteFence,
                       limit: float) -> None:
    """``(offset, value)`` pairs into a peer's segment ``seg``: runs of at most
    FENCE_BLOCK bytes each with one ``write_each`` (adjacent ranges in one pwritev),
    ``fence``'s ``limit`` checked before each run (a larger value alone, in blocks)."""
    clock = _fence.clock
    run: list[tuple[int, Any]] = []
    run_bytes = 0
    for off, value in items:
        n = len(value)
        if n > FENCE_BLOCK:
            _fenced_write(seg, off, (value,), fence, limit)
            continue
        if run_bytes + n > FENCE_BLOCK:
            if clock() > limit:
                raise fence.expired()
            seg.write_each(run)
            run, run_bytes = [], 0
        run.append((off, value))
        run_bytes += n
    if run:
        if clock() > limit:
            raise fence.expired()
        seg.write_each(run)


def _memmove_blocks(dst: int, src: int, n: int, fence: WriteFence, limit: float) -> None:
    """:func:`_copy_blocks` between host addresses."""
    clock = _fence.clock  # (read before each block: see kvmaster._fence)
    for s in range(0, n, FENCE_BLOCK):
        if clock() > limit:
            raise fence.expired()
        _memmove(dst + s, src + s, min(FENCE_BLOCK, n - s))


def _raw_view(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at host address ``ptr``."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def _address_of(view: memoryview) -> int:
    """Start address of a :func:`_raw_view` (the ctypes array it views)."""
    return ctypes.addressof(view.obj)


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
