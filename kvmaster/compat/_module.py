"""Module-level names of ``mooncake.store`` beyond the store and its configuration
(Mooncake ``store_py.cpp``: ``bind_to_numa_node``, ``get_alloc_func_addr``,
``get_free_func_addr``, ``DiskDescriptor``, ``MooncakeDistributedNoFRegister``,
``_get_pyclient_from_wrapper``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from typing import Any

from kvmaster.compat._common import log, report_once

#: Mooncake's NOT_SUPPORTED (``mooncake-store/include/types.h`` ``ErrorCode``).
NOT_SUPPORTED = -1012

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def bind_to_numa_node(node: int) -> None:
    """Run the calling process on the CPUs of NUMA ``node`` (Linux ``sched_setaffinity``
    to ``/sys/devices/system/node/node<N>/cpulist``).  Without NUMA information, or for
    a node that does not exist, it logs a warning and changes nothing, as Mooncake's
    does.  (Mooncake also binds memory allocation to the node; kvmaster does not.)"""
    path = f"/sys/devices/system/node/node{int(node)}/cpulist"
    try:
        with open(path) as f:
            cpus = _cpulist(f.read())
    except (OSError, ValueError):
        log.warning("bind_to_numa_node(%s): no such NUMA node here; binding skipped", node)
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        log.warning("bind_to_numa_node(%s): %s; binding skipped", node, exc)


def get_alloc_func_addr() -> int:
    """Address of a C function ``void *alloc(size_t size)`` for host memory (libc's
    ``malloc``; Mooncake's allocates huge pages)."""
    return int(ctypes.cast(_libc.malloc, ctypes.c_void_p).value or 0)


def get_free_func_addr() -> int:
    """Address of the matching ``void free(void *ptr, ...)`` (libc's ``free``, which
    ignores a size argument after the pointer)."""
    return int(ctypes.cast(_libc.free, ctypes.c_void_p).value or 0)


@dataclass
class DiskDescriptor:
    """A disk replica's location (Mooncake ``DiskDescriptor``).  kvmaster keeps replicas
    in memory only, so none is ever returned; the type is here for code that names it."""

    file_path: str = ""
    object_size: int = 0


class MooncakeDistributedNoFRegister:
    """NVMe-over-Fabrics registration (Mooncake ``MooncakeDistributedNoFRegister``):
    kvmaster has no NVMe-oF tier, so both calls answer NOT_SUPPORTED (-1012) with a
    log line."""

    def real_register(self, *args: Any, **kwargs: Any) -> int:
        report_once("nof", "MooncakeDistributedNoFRegister: kvmaster has no NVMe-oF tier")
        return NOT_SUPPORTED

    def real_unregister_by_endpoint(self, *args: Any, **kwargs: Any) -> int:
        report_once("nof", "MooncakeDistributedNoFRegister: kvmaster has no NVMe-oF tier")
        return NOT_SUPPORTED


def _get_pyclient_from_wrapper(store: Any) -> Any:
    """The client behind a set-up store: kvmaster's native :class:`kvmaster.Client`
    (Mooncake returns its C++ client object), or None before ``setup``."""
    return getattr(store, "_client", None)
