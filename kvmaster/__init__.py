"""kvmaster: a session-aware KV-cache store master for LLM serving.

Public surface: :class:`Client`, :class:`ReplicateConfig`, :class:`SoftPinAction`,
the exception tree of :mod:`kvmaster.errors`, and :class:`MasterConfig`.
Mooncake-compatible names live in :mod:`kvmaster.compat`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from kvmaster.client import Client, ClientConfig, KvSessionInfo, KvSessionPage, ReplicateConfig
from kvmaster.config import MasterConfig
from kvmaster.errors import (
    Busy,
    ConnectionLost,
    InvalidParams,
    KVMasterError,
    LeaseExpired,
    MasterDeadError,
    NoAvailableHandle,
    ObjectAlreadyExists,
    ObjectHasLease,
    ObjectNotFound,
    RequestError,
    SessionLimitExceeded,
    SessionNotFound,
    ShuttingDown,
    Timeout,
    TransportError,
    Unsupported,
    VersionMismatch,
)
from kvmaster.protocol import SoftPinAction, Status

__all__ = sorted([
    "Busy",
    "Client",
    "ClientConfig",
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
    "SessionLimitExceeded",
    "SessionNotFound",
    "ShuttingDown",
    "SoftPinAction",
    "Status",
    "Timeout",
    "TransportError",
    "Unsupported",
    "VersionMismatch",
    "__version__",
])
