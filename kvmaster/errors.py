"""The client's exception tree.

::

    KVMasterError                  every error a client call raises
    ├── RequestError               the master answered with a non-zero status (.code)
    │   ├── ObjectNotFound             -704
    │   ├── ObjectAlreadyExists        -705
    │   ├── ObjectHasLease             -706
    │   ├── LeaseExpired               -707 (also raised by the client itself)
    │   ├── NoAvailableHandle          -200
    │   ├── SegmentNotFound            -101 (a put's segment was unmounted before its end)
    │   ├── InvalidParams              -600
    │   ├── SessionNotFound            -1800
    │   ├── SessionLimitExceeded       -1802
    │   ├── TenantQuotaExceeded        -1700 (a per-tenant quota of the master)
    │   ├── ChecksumMismatch           -801 (a replica's bytes failed their checksum)
    │   ├── Unavailable                -1010 (a standby master; find the leader)
    │   ├── Unsupported                -1900
    │   ├── Busy                       -1901 (retry later)
    │   ├── VersionMismatch            -1902
    │   ├── NotRegistered              -1903
    │   ├── ShuttingDown               -1904
    │   └── UpdateDiscarded            -1905 (a session update's earlier pages are gone)
    └── TransportError             no usable answer
        ├── Timeout                    no reply within the call's timeout
        ├── ConnectionLost             the connection closed while waiting (master gone)
        └── MasterDeadError            the master stopped answering heartbeats

Each carries ``code`` (a :class:`~kvmaster.protocol.Status` value), ``op``,
``req_id`` and ``endpoint`` where known.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmaster.protocol import Status

__all__ = [
    "Busy",
    "ConnectionLost",
    "InvalidParams",
    "KVMasterError",
    "LeaseExpired",
    "MasterDeadError",
    "NoAvailableHandle",
    "NotRegistered",
    "ObjectAlreadyExists",
    "ObjectHasLease",
    "ObjectNotFound",
    "RequestError",
    "SegmentNotFound",
    "SessionLimitExceeded",
    "SessionNotFound",
    "TenantQuotaExceeded",
    "ChecksumMismatch",
    "ShuttingDown",
    "Timeout",
    "TransportError",
    "Unavailable",
    "Unsupported",
    "UpdateDiscarded",
    "VersionMismatch",
    "error_for",
]


class KVMasterError(Exception):
    """Base of every kvmaster client error."""

    code: int = Status.INTERNAL_ERROR
    #: Positions, among the requests of a round that failed only in part, of those that
    #: got no answer (set by the drivers; see ``kvmaster._core.unanswered``).
    unanswered: Sequence[int] | None = None

    def __init__(self, message: str, *, code: int | None = None, op: str = "",
                 req_id: int = 0, endpoint: str = "") -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.op = op
        self.req_id = req_id
        self.endpoint = endpoint

    def __str__(self) -> str:
        name = Status(self.code).name if self.code in Status._value2member_map_ else str(self.code)
        where = f" [{self.op}]" if self.op else ""
        return f"{name} ({self.code}){where}: {self.args[0]}"


class RequestError(KVMasterError):
    """The master refused the request; ``code`` says why."""


class ObjectNotFound(RequestError):
    code = Status.OBJECT_NOT_FOUND


class ObjectAlreadyExists(RequestError):
    code = Status.OBJECT_ALREADY_EXISTS


class ObjectHasLease(RequestError):
    code = Status.OBJECT_HAS_LEASE


class LeaseExpired(RequestError):
    code = Status.LEASE_EXPIRED


class NoAvailableHandle(RequestError):
    code = Status.NO_AVAILABLE_HANDLE


class SegmentNotFound(RequestError):
    """A segment is not mounted: UNMOUNT_SEGMENT of a segment that is not the caller's,
    or a put (or upsert) whose segment was unmounted between its start and its end
    (its owner left or was expired); that write is dropped and may be started again."""

    code = Status.SEGMENT_NOT_FOUND


class InvalidParams(RequestError):
    code = Status.INVALID_PARAMS


class SessionNotFound(RequestError):
    code = Status.SESSION_NOT_FOUND


class SessionLimitExceeded(RequestError):
    code = Status.SESSION_LIMIT_EXCEEDED


class TenantQuotaExceeded(RequestError):
    """The caller's tenant holds as much as its quota allows of what the request would
    add (capacity, writes in progress, clients, sessions or session members: the
    message names which); as Mooncake's ``TENANT_QUOTA_EXCEEDED``."""

    code = Status.TENANT_QUOTA_EXCEEDED


class ChecksumMismatch(RequestError):
    """Bytes read from a replica do not match the checksum its writer recorded; the
    replica is dropped and no other replica was readable."""

    code = Status.CHECKSUM_MISMATCH


class Unavailable(RequestError):
    code = Status.UNAVAILABLE_IN_CURRENT_STATUS


class Unsupported(RequestError):
    code = Status.UNSUPPORTED


class Busy(RequestError):
    code = Status.BUSY


class VersionMismatch(RequestError):
    code = Status.VERSION_MISMATCH


class NotRegistered(RequestError):
    code = Status.NOT_REGISTERED


class ShuttingDown(RequestError):
    code = Status.SHUTTING_DOWN


class UpdateDiscarded(RequestError):
    """A page of a multi-page ``update_kv_session`` whose earlier pages the master
    discarded (the client was expired or said BYE, a newer update of the same session
    by the client replaced them, or they outlived ``--kv-session-update-staging-ttl``):
    nothing changed; the keep set must be sent again from its first page with a new
    token.  The clients do that themselves a couple of times before raising it."""

    code = Status.UPDATE_DISCARDED


class TransportError(KVMasterError):
    """No usable answer from the master."""

    code = Status.RPC_FAIL


class Timeout(TransportError):
    pass


class ConnectionLost(TransportError):
    pass


class MasterDeadError(TransportError):
    pass


_BY_CODE: dict[int, type[RequestError]] = {
    cls.code: cls
    for cls in (ObjectNotFound, ObjectAlreadyExists, ObjectHasLease, LeaseExpired,
                NoAvailableHandle, InvalidParams, SegmentNotFound, SessionNotFound,
                SessionLimitExceeded, TenantQuotaExceeded, ChecksumMismatch,
                Unsupported, Busy, VersionMismatch, NotRegistered, ShuttingDown, Unavailable,
                UpdateDiscarded)
}


def error_for(code: int, message: str, *, op: str = "", req_id: int = 0,
              endpoint: str = "") -> RequestError:
    """The exception for a status ``code`` from the master."""
    cls = _BY_CODE.get(code, RequestError)
    return cls(message, code=code, op=op, req_id=req_id, endpoint=endpoint)
