"""kvmaster: a session-aware KV-cache store master for LLM serving.

Public surface: :class:`Client`, :class:`ReplicateConfig`, :class:`SoftPinAction`,
the exception tree of :mod:`kvmaster.errors`, and :class:`MasterConfig`.
Mooncake-compatible names live in :mod:`kvmaster.compat`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker sees of the names resolved lazily below
    from kvmaster._core import ClientConfig, KvSessionInfo, KvSessionPage, ReplicateConfig
    from kvmaster.aio import AsyncClient
    from kvmaster.client import Client
    from kvmaster.config import MasterConfig
    from kvmaster.errors import (
        Busy, ChecksumMismatch, ConnectionLost, InvalidParams, KVMasterError, LeaseExpired,
        MasterDeadError, NoAvailableHandle, ObjectAlreadyExists, ObjectHasLease,
        ObjectNotFound, RequestError, SegmentNotFound, SessionLimitExceeded,
        SessionNotFound, ShuttingDown, TenantQuotaExceeded, Timeout, TransportError,
        Unavailable, Unsupported, UpdateDiscarded, VersionMismatch)
    from kvmaster.protocol import SoftPinAction, Status

# Public names resolve lazily so that importing a leaf module (the codec,
# ``kvmaster.protocol``) does not import zmq or the client.
_LAZY = {
    "AsyncClient": "kvmaster.aio",
    "Client": "kvmaster.client",
    "ClientConfig": "kvmaster._core",
    "KvSessionInfo": "kvmaster._core",
    "KvSessionPage": "kvmaster._core",
    "ReplicateConfig": "kvmaster._core",
    "MasterConfig": "kvmaster.config",
    "SoftPinAction": "kvmaster.protocol",
    "Status": "kvmaster.protocol",
}
_ERRORS = ("Busy", "ConnectionLost", "InvalidParams", "KVMasterError", "LeaseExpired",
           "MasterDeadError", "NoAvailableHandle", "ObjectAlreadyExists", "ObjectHasLease",
           "ObjectNotFound", "RequestError", "SegmentNotFound", "SessionLimitExceeded",
           "SessionNotFound", "TenantQuotaExceeded", "ChecksumMismatch",
           "ShuttingDown", "Timeout", "TransportError", "Unavailable", "Unsupported",
           "UpdateDiscarded", "VersionMismatch")
_LAZY.update(dict.fromkeys(_ERRORS, "kvmaster.errors"))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmaster' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = sorted([
    "AsyncClient",
    "Busy",
    "Client",
    "ClientConfig",
    "ChecksumMismatch",
    "ConnectionLost",
    "InvalidParams",
    "KVMasterError",
    "KvSessionInfo",
    "KvSessionPage",
    "LeaseExpired",
    "MasterConfig",
    "MasterDeadError",
    "NoAvailableHandle",
    "ObjectAlreadyExists",
    "ObjectHasLease",
    "ObjectNotFound",
    "ReplicateConfig",
    "RequestError",
    "SegmentNotFound",
    "SessionLimitExceeded",
    "SessionNotFound",
    "ShuttingDown",
    "SoftPinAction",
    "Status",
    "TenantQuotaExceeded",
    "Timeout",
    "TransportError",
    "Unavailable",
    "Unsupported",
    "UpdateDiscarded",
    "VersionMismatch",
    "__version__",
])
