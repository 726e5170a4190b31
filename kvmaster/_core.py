"""Transport-free core of the clients: every operation written once.

Every client operation is a generator that yields rounds of requests
``[(op, route, fields_after_req_id), ...]`` and receives the reply bodies in the same
order (an error status is thrown into the generator as its :mod:`kvmaster.errors`
exception).  :class:`~kvmaster.client.Client` drives these generators over a blocking
socket, :class:`~kvmaster.aio.AsyncClient` over an asyncio one; both get the same
methods from :func:`~kvmaster._client.records.operation`.

:class:`ClientCore` is assembled from parts that each own one concern
(``kvmaster/_client/``), each part building on the ones it uses:

* :class:`~kvmaster._client.connection.Connection`: identity, handshake, segment
  mount, routing to shards;
* :class:`~kvmaster._client.dataplane.DataPlane`: mapped segments, transfer peers,
  fenced and checked copies;
* :class:`~kvmaster._client.writes.WriteOps` and
  :class:`~kvmaster._client.batches.SplitWriteOps`: puts and upserts, whole and in steps;
* :class:`~kvmaster._client.reads.ReadOps` and
  :class:`~kvmaster._client.ranges.RangeReadOps`: gets, whole, by range and zero-copy;
* :class:`~kvmaster._client.catalog.CatalogOps`: queries, replicas, removal, sessions,
  admin.

The names other modules use from the parts are re-exported here.
"""

from __future__ import annotations

from kvmaster._client.batches import SplitWriteOps
from kvmaster._client.catalog import CatalogOps
from kvmaster._client.ranges import RangeReadOps
from kvmaster._client.records import (
    BUSY_FIRST_PAUSE_S,
    BUSY_MAX_PAUSE_S,
    MAX_PARTING,
    MOUNT_ATTEMPTS,
    PARTING_RETRY_S,
    UPDATE_RESTARTS,
    ClientConfig,
    CopyPlan,
    KvSessionInfo,
    KvSessionPage,
    NoWait,
    OpGen,
    PendingPuts,
    ReadLeases,
    ReplicateConfig,
    Request,
    RoutingChanged,
    Tolerant,
    Welcome,
    _write_failure,
    check_master_address,
    master_changed,
    op_name,
    operation,
    operations,
    rehandshake_reason,
)

__all__ = [
    "BUSY_FIRST_PAUSE_S", "BUSY_MAX_PAUSE_S", "MAX_PARTING", "MOUNT_ATTEMPTS",
    "PARTING_RETRY_S", "UPDATE_RESTARTS", "ClientConfig", "ClientCore", "CopyPlan",
    "KvSessionInfo", "KvSessionPage", "NoWait", "OpGen", "PendingPuts", "ReadLeases",
    "ReplicateConfig", "Request", "RoutingChanged", "Tolerant", "Welcome",
    "_write_failure", "check_master_address", "master_changed", "op_name", "operation",
    "operations", "rehandshake_reason",
]


class ClientCore(CatalogOps, RangeReadOps, SplitWriteOps):
    """State and operations shared by the sync and async clients: each operation is a
    generator of request rounds (the module docstring); the drivers do the I/O."""
