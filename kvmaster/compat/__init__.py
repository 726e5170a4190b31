"""Mooncake-compatible facade: switch an engine's integration by changing its import.

``from kvmaster.compat import MooncakeDistributedStore, ReplicateConfig, SoftPinAction``
gives the method names, argument order and return conventions of
``mooncake.store`` (``mooncake-integration/store/store_py.cpp``): calls return
0 or a negative error code instead of raising, ``get`` returns ``b""`` on a
miss, ``is_exist`` returns 1/0, batch calls return one code per position, and
``setup`` takes Mooncake's positional arguments, the last being the master
address ``host:port``.  Pointer-based calls (``get_into``, ``put_from``, ...)
take a raw address and a size, as Mooncake's do.

``kvmaster compat-shim install`` makes ``import mooncake.store`` resolve to this
module, so an engine runs with no edit at all (see :mod:`kvmaster.compat.shim`).
"""

from __future__ import annotations

from kvmaster._core import KvSessionInfo, KvSessionPage
from kvmaster.compat._buffer_pool import (BufferLease, BufferLeaseView, BufferPool,
                                         RegisteredBufferLease, RegisteredBufferLeaseView,
                                         RegisteredBufferPool)
from kvmaster.compat._buffers import BufferHandle
from kvmaster.compat._config import ObjectDataType, ReplicateConfig
from kvmaster.compat._dummy import MooncakeHostMemAllocator
from kvmaster.compat._engram import EngramStore, EngramStoreConfig
from kvmaster.compat._module import (DiskDescriptor, MooncakeDistributedNoFRegister,
                                     _get_pyclient_from_wrapper, bind_to_numa_node,
                                     get_alloc_func_addr, get_free_func_addr)
from kvmaster.compat._mooncake_config import MooncakeConfig
from kvmaster.compat._replicas import (Descriptor, ExistOptions, MemoryDescriptor,
                                       QueryTaskResponse, ReplicaDescriptor, ReplicaStatus,
                                       TaskStatus, TaskType)
from kvmaster.compat._store import MooncakeDistributedStore
from kvmaster.compat._tensor import (ParallelAxis, ReadTarget, TensorParallelism,
                                     _deserialize_tensor, _serialize_tensor,
                                     _tensor_metadata_size)
from kvmaster.protocol import SoftPinAction


# Mooncake's binding exports the members of these enums at module level too (pybind11
# export_values, in this order: a later enum's member wins a shared name, so FAILED and
# PROCESSING are TaskStatus's).
ENUM_ALIASES = tuple(m.name for E in (ObjectDataType, ReplicaStatus, TaskType, TaskStatus)
                     for m in E)
for _enum in (ObjectDataType, ReplicaStatus, TaskType, TaskStatus):
    globals().update(_enum.__members__)
del _enum


def shim_loaded(path: str) -> None:
    """Called by the ``mooncake.store`` shim at import: warn once when a real
    ``mooncake`` is also on ``sys.path`` (the shim shadows it)."""
    from kvmaster.compat._common import report_once
    from kvmaster.compat.shim import real_mooncake

    others = real_mooncake()
    if others:
        report_once("shim-shadows", f"mooncake.store is kvmaster's compat shim ({path}); "
                                    f"a real mooncake at {others[0]} is shadowed")

__all__ = ["BufferHandle", "BufferLease", "BufferLeaseView", "BufferPool", "Descriptor",
           "DiskDescriptor", "EngramStore", "EngramStoreConfig", "ExistOptions",
           "KvSessionInfo",
           "KvSessionPage", "MemoryDescriptor", "MooncakeConfig", "MooncakeDistributedNoFRegister",
           "MooncakeDistributedStore",
           "MooncakeHostMemAllocator", "ObjectDataType", "ParallelAxis", "QueryTaskResponse",
           "ReadTarget", "RegisteredBufferLease",
           "RegisteredBufferLeaseView", "RegisteredBufferPool", "ReplicaDescriptor",
           "ReplicaStatus", "ReplicateConfig", "SoftPinAction",
           "TaskStatus", "TaskType", "TensorParallelism", "_deserialize_tensor",
           "_get_pyclient_from_wrapper", "_serialize_tensor", "_tensor_metadata_size",
           "bind_to_numa_node", "get_alloc_func_addr", "get_free_func_addr"]
