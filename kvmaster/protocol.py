"""kvmaster wire codec: op codes, status codes, one message type per op.

This module is a leaf: it imports only the standard library and msgpack, so a
client (or a test) can use it without loading zmq or any master code.  The
language-neutral specification lives in ``protocol/PROTOCOL.md`` with golden
vectors in ``protocol/golden_vectors.json``; this codec is tested against them.

Frames (client DEALER -> master ROUTER)::

    [op (1 byte), route (0 or 2 bytes), payload (msgpack array)]

``route`` is empty for master-level ops (HELLO, HEARTBEAT, MOUNT/UNMOUNT_SEGMENT,
BYE, STATS, CHECK_CONSISTENCY)
and the big-endian shard index for object and session ops.  The master routes
on the first two frames and never decodes the payload of a routed op.

Payloads are msgpack arrays ``[req_id, *fields]`` in field order.  Replies are
``[op, payload]`` with payload ``[req_id, status, body]``: ``body`` is the
op's result when ``status == 0`` and a one-line message otherwise.

Keys and session ids travel as msgpack ``bin`` (UTF-8 bytes of the caller's
string); the master treats them as opaque bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import zlib
from dataclasses import dataclass
from collections.abc import Sequence
from itertools import repeat
from typing import Any, ClassVar

import msgpack

__all__ = [
    "COLUMN_OPS",
    "DEFAULT_TENANT",
    "HEARTBEAT_LIVENESS",
    "KEY_MAX_BYTES",
    "MASTER_OPS",
    "MASTER_ROUTE",
    "OP_TO_TYPE",
    "PROTOCOL_VERSION",
    "Op",
    "ProtocolError",
    "ReplicateConfigWire",
    "SoftPinAction",
    "Status",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "replica_columns",
    "replica_items",
    "route_for_shard",
    "shard_of",
    "tenant_seed",
]

#: (major, minor).  A different major is refused at HELLO; minor bumps only
#: append fields (with defaults) or add op codes.  1.1 added the ``columns`` field
#: of the batch get and start ops (section 16); 1.2 lets one message carry several
#: requests (section 3); 1.3 added the ``group_ids`` field of the batch start ops
#: (section 14); 1.4 added object checksums: the ``checksum(s)`` fields of the end ops,
#: the ``with_checksum`` flag of the get ops and DROP_CORRUPT_REPLICAS (section 24);
#: 1.5 added the ``session_tags`` field of the batch start ops (section 15).
PROTOCOL_VERSION = (1, 5)

#: Most requests one message may carry (protocol 1.2): ``[op, route, payload]`` repeated.
MAX_REQUESTS_PER_MESSAGE = 64

#: Route frame of master-level ops.
MASTER_ROUTE = b""

DEFAULT_TENANT = "default"

#: Upper bound on a key or session id, in bytes (UTF-8).
KEY_MAX_BYTES = 4096

#: Heartbeats a client may miss before the master expires it (client_ttl is
#: the authoritative time; the client beats every client_ttl / liveness).
HEARTBEAT_LIVENESS = 3


class Op(bytes, enum.Enum):
    """One-byte op codes.  Values are never reused or reordered."""

    # master-level (route frame empty)
    HELLO = b"\x01"
    HEARTBEAT = b"\x02"
    MOUNT_SEGMENT = b"\x03"
    UNMOUNT_SEGMENT = b"\x04"
    BYE = b"\x05"
    STATS = b"\x06"
    CHECK_CONSISTENCY = b"\x07"
    LIST_CLIENTS = b"\x08"
    LIST_SEGMENTS = b"\x09"
    GET_CONFIG = b"\x0a"
    # object ops (routed to one shard)
    EXIST_KEY = b"\x10"
    BATCH_EXIST_KEY = b"\x11"
    GET_REPLICA_LIST = b"\x12"
    BATCH_GET_REPLICA_LIST = b"\x13"
    PUT_START = b"\x14"
    BATCH_PUT_START = b"\x15"
    PUT_END = b"\x16"
    BATCH_PUT_END = b"\x17"
    PUT_REVOKE = b"\x18"
    BATCH_PUT_REVOKE = b"\x19"
    UPSERT_START = b"\x1a"
    BATCH_UPSERT_START = b"\x1b"
    REMOVE = b"\x1c"
    BATCH_REMOVE = b"\x1d"
    REMOVE_ALL = b"\x1e"
    GET_SIZE = b"\x1f"
    QUERY_KEY = b"\x20"
    # replica management (Mooncake BatchReplicaClear, copy/move tasks, ProbeKey)
    REPLICA_CLEAR = b"\x21"
    BATCH_PROBE_KEY = b"\x22"
    COPY_REPLICAS_PREPARE = b"\x23"
    COPY_REPLICAS_COMMIT = b"\x24"
    SET_SEGMENT_LABEL = b"\x25"
    SEGMENT_LABELS = b"\x26"
    REMOVE_BY_REGEX = b"\x27"
    DROP_CORRUPT_REPLICAS = b"\x28"
    # sessions (routed to the session's home shard, or the key's shard for writes)
    ATTACH_KV_SESSION = b"\x30"
    SET_KV_SESSION_PIN = b"\x31"
    UPDATE_KV_SESSION = b"\x32"
    CLOSE_KV_SESSION = b"\x33"
    GET_KV_SESSION = b"\x34"
    LIST_KV_SESSION_KEYS = b"\x35"
    PUT_START_WITH_KV_SESSIONS = b"\x36"
    BATCH_PUT_START_WITH_KV_SESSIONS = b"\x37"
    UPSERT_START_WITH_KV_SESSIONS = b"\x38"
    BATCH_UPSERT_START_WITH_KV_SESSIONS = b"\x39"


#: Ops sent with an empty route frame and handled by the master's front.
MASTER_OPS = frozenset({
    Op.HELLO, Op.HEARTBEAT, Op.MOUNT_SEGMENT, Op.UNMOUNT_SEGMENT, Op.BYE, Op.STATS,
    Op.CHECK_CONSISTENCY, Op.LIST_CLIENTS, Op.LIST_SEGMENTS, Op.GET_CONFIG,
})


class Status(enum.IntEnum):
    """Reply status codes.  Values from -1 to -1499 are Mooncake Store's ``ErrorCode``
    values (mooncake-store/include/types.h), -1700 included (its tenant quotas); -1800 and -1802 are the session codes of
    Mooncake's session design (docs/source/design/store/session-kv.md); -1900 and
    below are kvmaster's own protocol-level codes."""

    OK = 0
    INTERNAL_ERROR = -1
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    TENANT_QUOTA_EXCEEDED = -1700
    SESSION_NOT_FOUND = -1800
    SESSION_LIMIT_EXCEEDED = -1802
    # kvmaster protocol-level codes
    UNSUPPORTED = -1900
    BUSY = -1901
    VERSION_MISMATCH = -1902
    NOT_REGISTERED = -1903
    SHUTTING_DOWN = -1904
    UPDATE_DISCARDED = -1905
    GROUP_LIMIT_EXCEEDED = -1906


class SoftPinAction(enum.IntEnum):
    """What a write does to the object's soft pin (Mooncake ``SoftPinAction``).

    PRESERVE keeps an upserted object's still-active soft pin (a new object
    starts unpinned); ENABLE pins for ``soft_pin_ttl_ms`` (or the master's
    default) from the moment the object becomes readable; DISABLE clears it.
    """

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ProtocolError(ValueError):
    """A frame or payload does not follow the spec; carries the status to reply with."""

    def __init__(self, message: str, status: Status = Status.INVALID_PARAMS) -> None:
        super().__init__(message)
        self.status = status


def tenant_seed(tenant: str) -> int:
    """CRC-32 of ``tenant + NUL``: the running CRC that :func:`shard_of` continues."""
    return zlib.crc32(tenant.encode() + b"\x00")


def shard_of(key: bytes, seed: int, shard_count: int) -> int:
    """Shard owning ``key`` of the tenant whose :func:`tenant_seed` is ``seed``.

    ``crc32(tenant || 0x00 || key) mod shard_count`` (zlib's CRC-32).
    """
    return zlib.crc32(key, seed) % shard_count


def shards_of(keys: list[bytes], seed: int, shard_count: int) -> list[int]:
    """:func:`shard_of` of every key of a batch, in order."""
    return [crc % shard_count for crc in map(zlib.crc32, keys, repeat(seed, len(keys)))]


def positions_by_shard(owner: list[int], shard_count: int) -> list[list[int]]:
    """``owner[i]``, the shard of a batch's i-th key -> each shard's positions,
    ascending (an empty list for a shard with none).  One pass over ``owner``."""
    groups: list[list[int]] = [[] for _ in range(shard_count)]
    for i, s in enumerate(owner):
        groups[s].append(i)
    return groups


#: Batch ops a master announcing ``batch_any_shard`` in WELCOME accepts on any
#: shard's route with keys of all shards (section 8): the receiving shard forwards
#: the other shards' keys and answers once, in key order.
ANY_SHARD_OPS = frozenset(op.value for op in (
    Op.BATCH_EXIST_KEY, Op.BATCH_GET_REPLICA_LIST, Op.BATCH_PUT_START, Op.BATCH_UPSERT_START,
    Op.BATCH_PUT_END, Op.BATCH_PUT_REVOKE, Op.BATCH_REMOVE))


#: Batch ops whose request may ask for the columnar reply (field ``columns``,
#: protocol 1.1): the per-key replica lists of a batch as a few flat arrays.
COLUMN_OPS = frozenset(op.value for op in (
    Op.BATCH_GET_REPLICA_LIST, Op.BATCH_PUT_START, Op.BATCH_UPSERT_START,
    Op.BATCH_PUT_START_WITH_KV_SESSIONS, Op.BATCH_UPSERT_START_WITH_KV_SESSIONS))


def replica_columns(items: list[Any], get: bool) -> list[Any]:
    """Per-key replies of a batch start (``get`` False: replicas or a status per key)
    or of BATCH_GET_REPLICA_LIST (``get`` True: ``[size, lease_ttl_ms, replicas]`` or
    a status) -> the columnar body (section 16):

    ``[segments, first, offsets, more]``, and for a get ``+ [sizes, lease_ttl_ms]``:

    * ``segments``: the segments of the keys' first replicas, each once (array of str;
      ``more`` names its segments itself);
    * ``first``: per key, the index in ``segments`` of the first replica's segment
      (>= 0), or the key's negative status;
    * ``offsets``: per key, the first replica's offset in bytes (0 for a failed key);
    * ``more``: ``[position, [[segment, offset], ...]]`` pairs, the further replicas
      of keys with more than one (ascending positions);
    * ``sizes``: per key, the object's size in bytes (0 for a failed key);
    * ``lease_ttl_ms``: the lease every hit was granted (0 when nothing was found);
    * ``checksums`` (1.4, only when the per-key items carry one, i.e. the request asked
      with ``with_checksum``): per key the object's checksum, nil for a failed key or an
      object stored without one.
    """
    names: list[str] = []
    index: dict[str, int] = {}
    first: list[int] = []
    offsets: list[int] = []
    more: list[list[Any]] = []
    sizes: list[int] = []
    sums: list[int | None] | None = None
    lease_ms = 0
    for pos, item in enumerate(items):
        if type(item) is not list:  # a status (int or Status)
            first.append(int(item))
            offsets.append(0)
            sizes.append(0)
            if sums is not None:
                sums.append(None)
            continue
        if get:
            size, lease_ms, replicas = item[:3]
            sizes.append(size)
            if len(item) > 3:
                if sums is None:
                    sums = [None] * pos
                sums.append(item[3])
            elif sums is not None:
                sums.append(None)
        else:
            replicas = item
        name, off = replicas[0]
        i = index.get(name)
        if i is None:
            i = index[name] = len(names)
            names.append(name)
        first.append(i)
        offsets.append(off)
        if len(replicas) > 1:
            more.append([pos, [list(r) for r in replicas[1:]]])
    if not get:
        return [names, first, offsets, more]
    body = [names, first, offsets, more, sizes, lease_ms]
    if sums is not None:
        body.append(sums)
    return body


def replica_items(columns: Sequence[Any], get: bool) -> list[Any]:
    """Inverse of :func:`replica_columns`: the per-key body of the same reply."""
    names, first, offsets, more = columns[:4]
    further = {pos: replicas for pos, replicas in more}
    sums = columns[6] if get and len(columns) > 6 else None
    out: list[Any] = []
    for pos, (f, off) in enumerate(zip(first, offsets)):
        if f < 0:
            out.append(f)
            continue
        replicas = [[names[f], off], *further.get(pos, ())]
        if not get:
            out.append(replicas)
        elif sums is None:
            out.append([columns[4][pos], columns[5], replicas])
        else:
            out.append([columns[4][pos], columns[5], replicas, sums[pos]])
    return out


def route_for_shard(index: int) -> bytes:
    """The route frame for shard ``index``: 2 bytes, big-endian."""
    return index.to_bytes(2, "big")


# --------------------------------------------------------------------------
# Field validation.  Each checker returns the value or raises ProtocolError.


def _int(name: str, lo: int = 0, hi: int = (1 << 63) - 1) -> Any:
    def check(v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise ProtocolError(f"{name}: expected an integer in [{lo}, {hi}]")
        return v

    return check


def _bool(name: str) -> Any:
    def check(v: Any) -> bool:
        if type(v) is not bool:
            raise ProtocolError(f"{name}: expected a boolean")
        return v

    return check


def _str(name: str, max_len: int = 1024, allow_empty: bool = True) -> Any:
    def check(v: Any) -> str:
        if type(v) is not str or len(v) > max_len or "\x00" in v:
            raise ProtocolError(f"{name}: expected a string of at most {max_len} chars, no NUL")
        if not allow_empty and not v:
            raise ProtocolError(f"{name}: must not be empty")
        return v

    return check


def check_key(v: Any, name: str = "key") -> bytes:
    """A key or session id: non-empty bytes, at most KEY_MAX_BYTES, no NUL."""
    if type(v) is not bytes or not v or len(v) > KEY_MAX_BYTES or b"\x00" in v:
        raise ProtocolError(
            f"{name}: expected 1..{KEY_MAX_BYTES} bytes without NUL", Status.INVALID_PARAMS
        )
    return v


def _key(name: str) -> Any:
    return lambda v: check_key(v, name)


_BYTES_ONLY = frozenset((bytes,))


def _lengths_ok(lengths: set[int]) -> bool:
    return 0 < min(lengths) and max(lengths) <= KEY_MAX_BYTES


def _keys(name: str) -> Any:
    # Whole-list checks run in C (map/set/join): about 3x cheaper per key than a
    # Python loop, which matters for 1024-key batches.  The length bounds are checked
    # on the set of lengths (a batch's keys mostly share a few): one pass, not two.
    def check(v: Any) -> list[bytes]:
        if type(v) is not list:
            raise ProtocolError(f"{name}: expected a list of keys")
        if v and not (set(map(type, v)) <= _BYTES_ONLY and _lengths_ok(set(map(len, v)))
                      and b"\x00" not in b"".join(v)):
            raise ProtocolError(f"{name}: each key must be 1..{KEY_MAX_BYTES} bytes, no NUL")
        return v

    def bounded(v: Any) -> list[bytes]:
        # The variant for a payload unpacked with bins of at most KEY_MAX_BYTES (see
        # decode_request): the join fails on anything but bytes (msgpack makes no other
        # buffer), and only empty keys remain to be found.  Any doubt: the full check,
        # whose error names the fault.
        if type(v) is list:
            try:
                if b"\x00" not in b"".join(v) and b"" not in v:
                    return v
            except TypeError:
                pass
        return check(v)

    check.bounded = bounded  # type: ignore[attr-defined]
    return check


def _sizes(name: str) -> Any:
    def check(v: Any) -> list[int]:
        if type(v) is not list:
            raise ProtocolError(f"{name}: expected a list of sizes")
        # In C: the types counted (no bool, no float), then, when every size is the
        # first (a batch of one block size), one range check instead of min and max.
        if v and not (list(map(type, v)).count(int) == len(v) and (
                0 < v[0] < 1 << 48 if v.count(v[0]) == len(v)
                else min(v) > 0 and max(v) < 1 << 48)):
            raise ProtocolError(f"{name}: each size must be an integer in [1, 2^48)")
        return v

    return check


def _strs(name: str) -> Any:
    def check(v: Any) -> list[str]:
        if type(v) is not list or any(type(s) is not str or "\x00" in s for s in v):
            raise ProtocolError(f"{name}: expected a list of strings")
        return v

    return check


def _any(v: Any) -> Any:
    return v


def _columns(v: Any) -> bool:
    """Optional ``columns`` flag of the batch get and start ops (protocol 1.1): nil or
    false asks for the per-key reply, true for the columnar one (section 16)."""
    if v is None or v is False:
        return False
    if v is True:
        return True
    raise ProtocolError("columns: expected nil or a boolean")


def _write_id(v: Any) -> int | None:
    """Optional id of a write, chosen by its client (``write_id`` of the start ops)."""
    if v is None:
        return None
    if type(v) is not int or not 1 <= v < 1 << 63:
        raise ProtocolError("write_id: expected nil or an integer in [1, 2^63)")
    return v


_U64_MAX = (1 << 64) - 1


def _checksum(v: Any) -> int | None:
    """Optional object checksum of PUT_END (protocol 1.4): nil, or the xxh3_64 of the
    value's bytes, an integer in [0, 2^64) (section 24)."""
    if v is None:
        return None
    if type(v) is not int or not 0 <= v <= _U64_MAX:
        raise ProtocolError("checksum: expected nil or an integer in [0, 2^64)")
    return v


_SUM_TYPES = frozenset((int, type(None)))


def _checksums(v: Any) -> list[int | None] | None:
    """Optional per-key checksums of BATCH_PUT_END (protocol 1.4): nil, or one item per
    key, each nil (that key's object is stored without one) or an integer in [0, 2^64)."""
    if v is None:
        return None
    if type(v) is not list or not set(map(type, v)) <= _SUM_TYPES:
        raise ProtocolError("checksums: expected nil or a list of nil or integers in [0, 2^64)")
    if v:
        ints = v if None not in v else [x for x in v if x is not None]
        if ints and (min(ints) < 0 or max(ints) > _U64_MAX):
            raise ProtocolError("checksums: each checksum must be an integer in [0, 2^64)")
    return v


def _flag(name: str) -> Any:
    """An optional bool request field appended by a minor version: nil or absent is
    false."""
    def check(v: Any) -> bool:
        if v is None or v is False:
            return False
        if v is True:
            return True
        raise ProtocolError(f"{name}: expected nil or a boolean")

    return check


def _replica_refs(v: Any) -> list[list[Any]]:
    """``[[segment, offset], ...]``: one replica per key (DROP_CORRUPT_REPLICAS)."""
    if type(v) is not list or not all(
            type(r) is list and len(r) == 2 and type(r[0]) is str and 0 < len(r[0]) <= 255
            and "\x00" not in r[0] and type(r[1]) is int and 0 <= r[1] < 1 << 63 for r in v):
        raise ProtocolError("replicas: expected a list of [segment (str 1..255), offset (uint)]")
    return v


def _sums(v: Any) -> list[int]:
    """One checksum per key, each an integer in [0, 2^64) (DROP_CORRUPT_REPLICAS)."""
    if type(v) is not list or not set(map(type, v)) <= _INT_ONLY or (
            v and (min(v) < 0 or max(v) > _U64_MAX)):
        raise ProtocolError("expected_checksums: expected a list of integers in [0, 2^64)")
    return v


_INT_ONLY = frozenset((int,))


def _page(v: Any) -> int | None:
    """Optional index of a keep-set page (``page`` of UPDATE_KV_SESSION)."""
    if v is None:
        return None
    if type(v) is not int or not 0 <= v < 1 << 31:
        raise ProtocolError("page: expected nil or an integer in [0, 2^31)")
    return v


def _group_ids(v: Any) -> list[bytes] | None:
    """Optional ``group_ids`` of the batch start ops (protocol 1.3): nil, or one group id
    per key (bin of 0..KEY_MAX_BYTES bytes without NUL; empty: the key joins no group)."""
    if v is None:
        return None
    if type(v) is not list or not (set(map(type, v)) <= _BYTES_ONLY) or (
            v and (max(map(len, v)) > KEY_MAX_BYTES or b"\x00" in b"".join(v))):
        raise ProtocolError(f"group_ids: expected nil or a list of 0..{KEY_MAX_BYTES}-byte "
                            "bins without NUL")
    return v


def _session_tags(v: Any) -> list[bytes] | None:
    """Optional ``session_tags`` of the batch start ops (protocol 1.5): nil, or one tag per
    key (bin of 0..KEY_MAX_BYTES bytes; empty: none), Mooncake's ``session_ids``."""
    if v is None:
        return None
    if type(v) is not list or not (set(map(type, v)) <= _BYTES_ONLY) or (
            v and max(map(len, v)) > KEY_MAX_BYTES):
        raise ProtocolError(f"session_tags: expected nil or a list of 0..{KEY_MAX_BYTES}-byte "
                            "bins")
    return v


@dataclass(frozen=True, slots=True)
class ReplicateConfigWire:
    """``ReplicateConfig`` as it travels: ``[replica_num, with_hard_pin,
    soft_pin_action, soft_pin_ttl_ms|nil, preferred_segments]``."""

    replica_num: int = 1
    with_hard_pin: bool = False
    soft_pin_action: int = SoftPinAction.PRESERVE
    soft_pin_ttl_ms: int | None = None
    preferred_segments: tuple[str, ...] = ()

    def to_wire(self) -> list[Any]:
        return [
            self.replica_num,
            self.with_hard_pin,
            int(self.soft_pin_action),
            self.soft_pin_ttl_ms,
            list(self.preferred_segments),
        ]

    @classmethod
    def from_wire(cls, v: Any) -> ReplicateConfigWire:
        if v is None:
            return DEFAULT_CONFIG
        if type(v) is not list or not 1 <= len(v) <= 16:
            raise ProtocolError("config: expected an array [replica_num, with_hard_pin, ...]")
        n = _int("config.replica_num", 1, 64)(v[0])
        hard = _bool("config.with_hard_pin")(v[1]) if len(v) > 1 else False
        action = _int("config.soft_pin_action", 0, 2)(v[2]) if len(v) > 2 else 0
        ttl = v[3] if len(v) > 3 else None
        if ttl is not None:
            _int("config.soft_pin_ttl_ms", 1)(ttl)
            if action != SoftPinAction.ENABLE:
                raise ProtocolError("config.soft_pin_ttl_ms is only allowed with soft_pin_action=ENABLE")
        pref = tuple(_strs("config.preferred_segments")(v[4])) if len(v) > 4 else ()
        if n == 1 and not hard and action == 0 and ttl is None and not pref:
            return DEFAULT_CONFIG
        return cls(n, hard, action, ttl, pref)


DEFAULT_CONFIG = ReplicateConfigWire()


def _config(v: Any) -> ReplicateConfigWire:
    return ReplicateConfigWire.from_wire(v)


# --------------------------------------------------------------------------
# Messages: one request type per op.  Field order is wire order.

OP_TO_TYPE: dict[bytes, type[Message]] = {}


class Message:
    """Base of request messages.  Subclasses are frozen slotted dataclasses
    with ``OP`` and ``CHECKS`` (one validator per field, in order)."""

    __slots__ = ()
    OP: ClassVar[Op]
    CHECKS: ClassVar[tuple[Any, ...]]
    BOUNDED_CHECKS: ClassVar[tuple[Any, ...]]
    N_REQUIRED: ClassVar[int]

    def to_wire(self, req_id: int) -> list[Any]:
        """``[req_id, *fields]``; optional fields left at their default (nil, or false
        for ``columns``) at the end are not sent."""
        out: list[Any] = [req_id]
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        for f in fields:
            v = getattr(self, f.name)
            out.append(v.to_wire() if isinstance(v, ReplicateConfigWire) else v)
        while len(out) > 1 + self.N_REQUIRED and out[-1] is fields[len(out) - 2].default:
            out.pop()
        return out


def _register(op: Op, *checks: Any) -> Any:
    def deco(plain: type) -> Any:
        cls: Any = dataclass(frozen=True, slots=True)(plain)
        if op.value in OP_TO_TYPE:
            raise RuntimeError(f"duplicate op code {op!r}")
        fields = dataclasses.fields(cls)
        if len(checks) != len(fields):
            raise RuntimeError(f"{cls.__name__}: {len(fields)} fields but {len(checks)} checks")
        cls.OP = op
        cls.CHECKS = checks
        # For payloads whose bins are all within KEY_MAX_BYTES (decode_request).
        cls.BOUNDED_CHECKS = tuple(getattr(c, "bounded", c) for c in checks)
        # Fields with a default (appended by a later revision) may be left out.
        cls.N_REQUIRED = sum(1 for f in fields if f.default is dataclasses.MISSING)
        OP_TO_TYPE[op.value] = cls
        return cls

    return deco


@_register(Op.HELLO, _int("protocol_major", 0, 255), _int("protocol_minor", 0, 255),
           _str("client_id", 128, False), _str("tenant", 256, False), _str("host_id", 256),
           _str("client_version", 64))
class HelloRequest(Message):
    """-> body ``{"master_version", "protocol", "shard_count", "tenant", "limits",
    "lease_ttl_ms", "client_ttl_ms", "put_start_release_timeout_ms", "master_host_id",
    "master_instance", "batch_any_shard"}``; ``limits`` has ``max_batch``, ``max_key_bytes``,
    ``kv_session_max_batch``, ``kv_sessions`` (enabled) and
    ``session_tags_as_kv_sessions`` (1.5)."""

    protocol_major: int
    protocol_minor: int
    client_id: str
    tenant: str
    host_id: str
    client_version: str


@_register(Op.HEARTBEAT)
class HeartbeatRequest(Message):
    """-> body ``0``.  Any request refreshes liveness; this one exists for idle clients."""


#: Largest segment size MOUNT_SEGMENT carries (2^48 bytes): sizes of every mounted
#: segment add up without overflow (the master bounds the sum, and its own flags
#: ``--max-segment-size``, ``--max-remote-segment-size`` may bound each lower).
MAX_SEGMENT_SIZE = 1 << 48


@_register(Op.MOUNT_SEGMENT, _str("name", 255, False), _int("size", 1, MAX_SEGMENT_SIZE),
           _str("host_id", 256), _str("transport", 512))
class MountSegmentRequest(Message):
    """Register a segment of ``size`` bytes (1 .. 2^48; a shared-memory file
    ``/dev/shm/<name>``) -> body ``size`` actually usable (rounded down to the
    allocation alignment).  The name must end with ``.owner-<fingerprint>`` of the
    mounting key (with CURVE) or client id (PROTOCOL.md section 11): ILLEGAL_CLIENT
    for another owner's name or transfer service, INVALID_PARAMS for a bound or a
    same-host name that is not the owner's regular segment file."""

    name: str
    size: int
    host_id: str
    transport: str


@_register(Op.UNMOUNT_SEGMENT, _str("name", 255, False))
class UnmountSegmentRequest(Message):
    """Unmount a segment of this client; objects left without a replica are erased
    -> body number of objects erased."""

    name: str


@_register(Op.BYE)
class ByeRequest(Message):
    """Clean close: unmount every segment of this client and forget it -> body 0."""


@_register(Op.STATS)
class StatsRequest(Message):
    """-> body ``{"shards": [per-shard counters], "clients": n, "segments": n, ...}``."""


@_register(Op.CHECK_CONSISTENCY)
class CheckConsistencyRequest(Message):
    """Verify the master's invariants (allocator accounting equals live replicas;
    session members and object refs agree; pinned-session replicas agree)
    -> body list of problems (empty when consistent).  O(objects): for tests and
    operators, not for the hot path."""


@_register(Op.LIST_CLIENTS)
class ListClientsRequest(Message):
    """-> body list of maps ``{client_id, tenant, host_id, idle_ms, segments}`` for the
    caller's tenant (all tenants for a client of the master's admin tenant)."""


@_register(Op.LIST_SEGMENTS)
class ListSegmentsRequest(Message):
    """-> body list of maps ``{name, owner, size, usable, host_id, transport,
    allocated}`` (allocated summed over shards)."""


@_register(Op.GET_CONFIG)
class GetConfigRequest(Message):
    """-> body map of the master's configuration (every CLI flag's value)."""


@_register(Op.EXIST_KEY, _key("key"))
class ExistKeyRequest(Message):
    """-> body ``1`` or ``0``.  Refreshes recency; grants no lease unless the master
    runs with ``--exist-grants-lease`` (Mooncake's behaviour)."""

    key: bytes


@_register(Op.BATCH_EXIST_KEY, _keys("keys"))
class BatchExistKeyRequest(Message):
    """-> body list, one item per key: ``1``, ``0`` or a negative status."""

    keys: list[bytes]


@_register(Op.GET_REPLICA_LIST, _key("key"), _flag("with_checksum"))
class GetReplicaListRequest(Message):
    """Grant a read lease -> body ``[size, lease_ttl_ms, [[segment, offset], ...]]``;
    with ``with_checksum`` (optional, 1.4) a fourth item, the object's checksum (nil
    when its writer sent none).  Errors: OBJECT_NOT_FOUND (absent or still being
    written)."""

    key: bytes
    with_checksum: bool = False


@_register(Op.BATCH_GET_REPLICA_LIST, _keys("keys"), _columns, _flag("with_checksum"))
class BatchGetReplicaListRequest(Message):
    """-> body list, one item per key: ``[size, lease_ttl_ms, replicas]`` or a negative
    status; with ``columns`` (1.1) the columnar body of :func:`replica_columns`.  With
    ``with_checksum`` (optional, 1.4) each item gains the object's checksum (nil: none),
    or the columnar body a ``checksums`` column."""

    keys: list[bytes]
    columns: bool = False
    with_checksum: bool = False


@_register(Op.PUT_START, _key("key"), _int("size", 1, (1 << 48) - 1), _config, _write_id)
class PutStartRequest(Message):
    """Allocate replica space; the object is PROCESSING until PUT_END.
    -> body ``[[segment, offset], ...]``.  Errors: OBJECT_ALREADY_EXISTS (write-once:
    the client treats it as success), NO_AVAILABLE_HANDLE, INVALID_PARAMS.
    ``write_id`` (optional, every start op): the client's name for this write, which a
    PUT_REVOKE can give to revoke this write only."""

    key: bytes
    size: int
    config: ReplicateConfigWire
    write_id: int | None = None


@_register(Op.BATCH_PUT_START, _keys("keys"), _sizes("sizes"), _config, _write_id, _columns,
           _group_ids, _session_tags)
class BatchPutStartRequest(Message):
    """-> body list per key: replicas or a negative status; with ``columns`` (1.1) the
    columnar body of :func:`replica_columns`.  One ``write_id`` for every key's write.
    ``group_ids`` (optional, 1.3): one group per key (b"" none); an admitted write joins
    its group at the group's home shard, GROUP_LIMIT_EXCEEDED at the bounds (section 14).
    ``session_tags`` (optional, 1.5): one tag per key (b"" none), kept with the object
    its write stores (Mooncake's ``ReplicateConfig.session_ids``; section 15)."""

    keys: list[bytes]
    sizes: list[int]
    config: ReplicateConfigWire
    write_id: int | None = None
    columns: bool = False
    group_ids: list[bytes] | None = None
    session_tags: list[bytes] | None = None


@_register(Op.PUT_END, _key("key"), _write_id, _checksum)
class PutEndRequest(Message):
    """Mark the object COMPLETE (readable) -> body 0.  With ``write_id`` (optional),
    only the write its start named so: an end of that write sent again after it was
    applied (its answer lost) is answered 0 again while the object it stored is the
    key's (section 12); a write of the key by the same client under another id is left
    alone (OBJECT_NOT_FOUND).  ``checksum`` (optional, 1.4): the xxh3_64 of the value's
    bytes, kept with the object for its readers to verify (section 24)."""

    key: bytes
    write_id: int | None = None
    checksum: int | None = None


@_register(Op.BATCH_PUT_END, _keys("keys"), _write_id, _checksums)
class BatchPutEndRequest(Message):
    """-> body list of statuses.  ``write_id`` (optional) as for PUT_END, for every key;
    ``checksums`` (optional, 1.4): one per key (nil: none), as PUT_END's ``checksum``."""

    keys: list[bytes]
    write_id: int | None = None
    checksums: list[int | None] | None = None


@_register(Op.PUT_REVOKE, _key("key"), _write_id)
class PutRevokeRequest(Message):
    """Abandon the caller's PROCESSING write and free its space -> body 0.  With
    ``write_id`` (optional), only the write its start named so: a later write of the
    key by the same client, or one whose start named no id, is left alone
    (OBJECT_NOT_FOUND)."""

    key: bytes
    write_id: int | None = None


@_register(Op.BATCH_PUT_REVOKE, _keys("keys"), _write_id)
class BatchPutRevokeRequest(Message):
    """-> body list of statuses.  ``write_id`` (optional) as for PUT_REVOKE, for every key."""

    keys: list[bytes]
    write_id: int | None = None


@_register(Op.UPSERT_START, _key("key"), _int("size", 1, (1 << 48) - 1), _config, _write_id)
class UpsertStartRequest(Message):
    """Like PUT_START but replaces a COMPLETE object; the old replicas stay readable
    until UPSERT's PUT_END and are freed once no lease covers them."""

    key: bytes
    size: int
    config: ReplicateConfigWire
    write_id: int | None = None


@_register(Op.BATCH_UPSERT_START, _keys("keys"), _sizes("sizes"), _config, _write_id, _columns,
           _group_ids, _session_tags)
class BatchUpsertStartRequest(Message):
    """-> body list per key: replicas or a negative status (columnar with ``columns``).
    ``group_ids`` (optional, 1.3) as for BATCH_PUT_START; the replaced object leaves its
    group when the upsert ends.  ``session_tags`` (optional, 1.5) as for BATCH_PUT_START."""

    keys: list[bytes]
    sizes: list[int]
    config: ReplicateConfigWire
    write_id: int | None = None
    columns: bool = False
    group_ids: list[bytes] | None = None
    session_tags: list[bytes] | None = None


@_register(Op.REMOVE, _key("key"), _bool("force"))
class RemoveRequest(Message):
    """-> body 0.  Errors: OBJECT_NOT_FOUND, OBJECT_HAS_LEASE (unless force),
    REPLICA_IS_NOT_READY (being written)."""

    key: bytes
    force: bool


@_register(Op.BATCH_REMOVE, _keys("keys"), _bool("force"))
class BatchRemoveRequest(Message):
    """-> body list of statuses."""

    keys: list[bytes]
    force: bool


@_register(Op.REMOVE_ALL, _bool("force"))
class RemoveAllRequest(Message):
    """Remove every removable object of the caller's tenant on this shard -> body count."""

    force: bool


#: Longest pattern a REMOVE_BY_REGEX may carry, in characters.
REGEX_MAX_CHARS = 1024


@_register(Op.REMOVE_BY_REGEX, _str("pattern", REGEX_MAX_CHARS, False), _bool("force"))
class RemoveByRegexRequest(Message):
    """Remove every removable object of the caller's tenant on this shard whose key
    the RE2 ``pattern`` matches anywhere (a search, as Mooncake's
    ``MasterService::RemoveByRegex`` searches with ``std::regex_search``) -> body
    count.  Leased objects stay unless ``force``.  Errors: INVALID_PARAMS (a pattern
    RE2 cannot compile, e.g. one with a backreference)."""

    pattern: str
    force: bool


@_register(Op.DROP_CORRUPT_REPLICAS, _keys("keys"), _replica_refs, _sums)
class DropCorruptReplicasRequest(Message):
    """Drop replicas whose bytes a reader found not matching the object's checksum
    (protocol 1.4, section 24) -> body list, per key: 0 (the replica is out of the
    object; the object is removed with its last replica) or OBJECT_NOT_FOUND (no such
    object, or it no longer has that replica or that checksum: dropped already, or
    replaced).  ``replicas[i]`` ``[segment, offset]`` and ``expected_checksums[i]`` (the
    checksum the reader compared against) go with ``keys[i]``; INVALID_PARAMS when the
    lengths differ.  A dropped range is freed once the object's read leases have run
    out.  Any client of the tenant may send it (as it may REMOVE with force)."""

    keys: list[bytes]
    replicas: list[list[Any]]
    expected_checksums: list[int]


@_register(Op.GET_SIZE, _key("key"))
class GetSizeRequest(Message):
    """-> body size in bytes (no lease).  Errors: OBJECT_NOT_FOUND."""

    key: bytes


@_register(Op.QUERY_KEY, _key("key"))
class QueryKeyRequest(Message):
    """Inspect one object without touching it -> body map (size, state, replicas,
    lease_ms_left, soft_pinned, hard_pinned)."""

    key: bytes


@_register(Op.REPLICA_CLEAR, _keys("keys"), _str("segment", 255))
class ReplicaClearRequest(Message):
    """Clear replicas of the caller's own objects whose read lease has run out
    (Mooncake ``MasterService::BatchReplicaClear``) -> body array of bin: the keys
    cleared, in request order.  ``segment`` "" clears whole objects; a segment's name
    or label clears only the replicas on it (the object goes with its last replica).
    Skipped, not failed: missing keys, keys written by another client, leased objects,
    and (with a segment) objects without a replica there."""

    keys: list[bytes]
    segment: str


@_register(Op.BATCH_PROBE_KEY, _keys("keys"))
class BatchProbeKeyRequest(Message):
    """-> body list, ``1`` or ``0`` per key: existence at this instant; grants no lease
    and leaves the LRU order alone (Mooncake ``BatchProbeKey``, PR #3801)."""

    keys: list[bytes]


@_register(Op.COPY_REPLICAS_PREPARE, _key("key"), _strs("targets"), _str("source", 255))
class CopyReplicasPrepareRequest(Message):
    """Begin copying an object to ``targets`` (segment names or labels): allocate a range
    in each target without a replica of it and lease the object -> body
    ``[size, lease_ttl_ms, sources, new, token]`` (``sources``/``new``: replicas).
    ``source`` "" for a copy; a move's source segment (INVALID_PARAMS unless it holds a
    replica and differs from the one target).  Errors: OBJECT_NOT_FOUND,
    INVALID_PARAMS (unknown or no targets), NO_AVAILABLE_HANDLE, BUSY (too many copies
    in progress on the shard)."""

    key: bytes
    targets: list[str]
    source: str


@_register(Op.COPY_REPLICAS_COMMIT, _key("key"), _int("token"), _bool("done"))
class CopyReplicasCommitRequest(Message):
    """End a copy begun by COPY_REPLICAS_PREPARE -> body 0.  ``done`` true: its new
    replicas join the object (a move's source replica then leaves it, freed once the
    object's lease has run out); false: they are freed.  Errors: OBJECT_NOT_FOUND
    (unknown token, or the object was removed or replaced meanwhile: the new ranges are
    freed), ILLEGAL_CLIENT (another client's copy)."""

    key: bytes
    token: int
    done: bool


@_register(Op.SET_SEGMENT_LABEL, _str("name", 255, False), _str("label", 255))
class SetSegmentLabelRequest(Message):
    """Give the caller's segment a second name, its Mooncake segment name (the client's
    ``local_hostname``), on the shard it is sent to (a client sends it to every shard)
    -> body 0.  "" removes it.  Errors: SEGMENT_NOT_FOUND (not the caller's mounted
    segment), SEGMENT_ALREADY_EXISTS (another mounted segment has that name or label)."""

    name: str
    label: str


@_register(Op.SEGMENT_LABELS)
class SegmentLabelsRequest(Message):
    """-> body map: segment name -> label, for the mounted segments that have one."""


def _cursor(v: Any) -> bytes:
    if type(v) is not bytes or len(v) > KEY_MAX_BYTES or b"\x00" in v:
        raise ProtocolError(f"cursor: expected 0..{KEY_MAX_BYTES} bytes without NUL")
    return v


def _tag_lists(name: str) -> Any:
    def check(v: Any) -> list[list[bytes]]:
        if type(v) is not list:
            raise ProtocolError(f"{name}: expected a list of session-id lists")
        inner = _keys(name)
        for ids in v:
            inner(ids)
        return v

    return check


@_register(Op.ATTACH_KV_SESSION, _key("session_id"), _keys("keys"))
class AttachKvSessionRequest(Message):
    """Associate existing objects with a session (route: the session's home shard).
    -> body list per key: 0, OBJECT_NOT_FOUND or SESSION_LIMIT_EXCEEDED."""

    session_id: bytes
    keys: list[bytes]


@_register(Op.SET_KV_SESSION_PIN, _key("session_id"), _bool("pinned"))
class SetKvSessionPinRequest(Message):
    """Pin (soft-pin priority for current and future members, no TTL) or unpin.
    -> body 0.  Errors: SESSION_NOT_FOUND."""

    session_id: bytes
    pinned: bool


@_register(Op.UPDATE_KV_SESSION, _key("session_id"), _keys("keep_keys"), _int("token"),
           _bool("final"), _page)
class UpdateKvSessionRequest(Message):
    """One page of the complete keep set.  Pages with the same ``token`` are staged
    until ``final``; then membership becomes its intersection with the keep set.
    ``page`` (optional): this page's index in the keep set, from 0; a page after the
    first whose earlier pages are not all staged is refused UPDATE_DISCARDED.
    -> body: staged key count (non-final page) or members removed (final page)."""

    session_id: bytes
    keep_keys: list[bytes]
    token: int
    final: bool
    page: int | None = None


@_register(Op.CLOSE_KV_SESSION, _key("session_id"))
class CloseKvSessionRequest(Message):
    """Drop every association and the pin; data stays cached; idempotent -> body 0."""

    session_id: bytes


@_register(Op.GET_KV_SESSION, _key("session_id"))
class GetKvSessionRequest(Message):
    """-> body ``[session_id, pinned, member_count]``.  Errors: SESSION_NOT_FOUND."""

    session_id: bytes


@_register(Op.LIST_KV_SESSION_KEYS, _key("session_id"), _cursor, _int("limit", 1, 1 << 20))
class ListKvSessionKeysRequest(Message):
    """Members after ``cursor`` (exclusive, lexical by bytes), at most ``limit``
    -> body ``[keys, next_cursor]`` (next_cursor empty when done).  No lease."""

    session_id: bytes
    cursor: bytes
    limit: int


@_register(Op.PUT_START_WITH_KV_SESSIONS, _key("key"), _int("size", 1, (1 << 48) - 1), _config,
           _keys("sessions"), _write_id)
class PutStartWithKvSessionsRequest(Message):
    """PUT_START that also tags the key with sessions at admission."""

    key: bytes
    size: int
    config: ReplicateConfigWire
    sessions: list[bytes]
    write_id: int | None = None


@_register(Op.BATCH_PUT_START_WITH_KV_SESSIONS, _keys("keys"), _sizes("sizes"), _config,
           _tag_lists("kv_sessions"), _write_id, _columns)
class BatchPutStartWithKvSessionsRequest(Message):
    """BATCH_PUT_START with one session-id list per key (same length as keys)."""

    keys: list[bytes]
    sizes: list[int]
    config: ReplicateConfigWire
    kv_sessions: list[list[bytes]]
    write_id: int | None = None
    columns: bool = False


@_register(Op.UPSERT_START_WITH_KV_SESSIONS, _key("key"), _int("size", 1, (1 << 48) - 1),
           _config, _keys("sessions"), _write_id)
class UpsertStartWithKvSessionsRequest(Message):
    """UPSERT_START that also tags the key with sessions."""

    key: bytes
    size: int
    config: ReplicateConfigWire
    sessions: list[bytes]
    write_id: int | None = None


@_register(Op.BATCH_UPSERT_START_WITH_KV_SESSIONS, _keys("keys"), _sizes("sizes"), _config,
           _tag_lists("kv_sessions"), _write_id, _columns)
class BatchUpsertStartWithKvSessionsRequest(Message):
    """BATCH_UPSERT_START with one session-id list per key."""

    keys: list[bytes]
    sizes: list[int]
    config: ReplicateConfigWire
    kv_sessions: list[list[bytes]]
    write_id: int | None = None
    columns: bool = False


# --------------------------------------------------------------------------
# Encoding and decoding

_packb = msgpack.Packer(use_bin_type=True).pack
_MAX_ITEMS = 1 << 20


def encode_request(msg: Message, req_id: int) -> bytes:
    """Payload frame for ``msg`` with request id ``req_id``."""
    return msgpack.packb(msg.to_wire(req_id), use_bin_type=True)


def unpack_payload(payload: bytes) -> Any:
    """Unpack a payload frame with bounds on container sizes."""
    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            use_list=True,
            strict_map_key=True,
            # Every item takes a byte at least: a longer array cannot be complete, and
            # msgpack would allocate its declared length before finding that out.
            max_array_len=min(_MAX_ITEMS, len(payload)),
            max_map_len=1024,
            max_str_len=1 << 20,
            max_bin_len=1 << 20,
        )
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        # msgpack's own errors only: an exception from a signal handler that runs
        # meanwhile (e.g. a watchdog's TimeoutError) must reach the caller, not turn a
        # good reply into a "malformed" one.
        raise ProtocolError(f"payload is not valid msgpack: {type(exc).__name__}") from None


_unpack_request = functools.partial(
    msgpack.unpackb, raw=False, use_list=True, strict_map_key=True, max_map_len=1024,
    max_str_len=1 << 20, max_bin_len=KEY_MAX_BYTES)


def peek_req_id(payload: bytes) -> int:
    """Best-effort request id of an undecodable or rejected payload (0 if unknown)."""
    try:
        obj = unpack_payload(payload)
    except ProtocolError:
        return 0
    if isinstance(obj, list) and obj and type(obj[0]) is int and 0 <= obj[0] < 1 << 63:
        return obj[0]
    return 0


def decode_request(op: bytes, payload: bytes) -> tuple[int, Message]:
    """Decode and validate a request payload -> ``(req_id, message)``.

    Raises ProtocolError (status UNSUPPORTED for an unknown op, INVALID_PARAMS
    otherwise).
    """
    cls = OP_TO_TYPE.get(op)
    if cls is None:
        raise ProtocolError(f"unknown op {op.hex() or '<empty>'}", Status.UNSUPPORTED)
    # Every bin of a request is a key, a session id or a cursor, at most
    # KEY_MAX_BYTES long.  Unpacked with that bound, the key lists need no length
    # check of their own; a payload with a longer bin is unpacked again with the
    # general bounds, so that its error names the field at fault.
    try:
        obj = _unpack_request(payload, max_array_len=min(_MAX_ITEMS, len(payload)))
        checks = cls.BOUNDED_CHECKS
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        if "max_bin_len" not in str(exc):
            # The general bounds would meet the same fault at the same place.
            raise ProtocolError(f"payload is not valid msgpack: {type(exc).__name__}") from None
        obj = unpack_payload(payload)
        checks = cls.CHECKS
    if type(obj) is not list or not obj:
        raise ProtocolError(f"{cls.OP.name}: payload must be an array [req_id, ...]")
    req_id = obj[0]
    if type(req_id) is not int or not 0 <= req_id < 1 << 63:
        raise ProtocolError(f"{cls.OP.name}: req_id must be a non-negative integer")
    n = len(obj) - 1
    if n < cls.N_REQUIRED:
        at_least = "" if cls.N_REQUIRED == len(checks) else "at least "
        raise ProtocolError(f"{cls.OP.name}: expected {at_least}{cls.N_REQUIRED} fields, got {n}")
    # Extra trailing fields are ignored: a newer minor version may append fields.
    return req_id, cls(*[c(v) for c, v in zip(checks, obj[1:])])


def encode_reply(req_id: int, status: int, body: Any) -> bytes:
    """Reply payload ``[req_id, status, body]``."""
    return _packb([req_id, int(status), body])


def decode_reply(payload: bytes) -> tuple[int, int, Any]:
    """-> ``(req_id, status, body)``.  Raises ProtocolError on a malformed reply."""
    obj = unpack_payload(payload)
    if type(obj) is not list or len(obj) != 3 or type(obj[0]) is not int or type(obj[1]) is not int:
        raise ProtocolError("reply must be an array [req_id, status, body]")
    return obj[0], obj[1], obj[2]
