"""Replica calls of the facade (Mooncake store_py.cpp: get_replica_desc, batch_get_replica_desc, batch_replica_clear, create_copy_task, create_move_task, query_task)."""

from __future__ import annotations

from kvmaster.compat._common import Facade


class ReplicaOps(Facade):
    pass
