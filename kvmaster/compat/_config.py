"""Mooncake's configuration and result types, as ``mooncake.store`` defines them
(``mooncake-integration/store/store_py.cpp``, ``mooncake-store/include/replica.h``
``ReplicateConfig``).

Attributes are type-checked on assignment the way Mooncake's pybind11 bindings
check them: a value of the wrong type raises ``TypeError``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from kvmaster._core import ReplicateConfig as _NativeConfig
from kvmaster.compat._common import report_once
from kvmaster.protocol import SoftPinAction


class ObjectDataType(enum.IntEnum):
    """What an object holds (Mooncake ``ObjectDataType``); kept with the config, no
    effect on placement or eviction in kvmaster."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, enum.IntEnum)


def _str_list(name: str, v: Any) -> list[str]:
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) and not hasattr(v, "__iter__"):
        raise TypeError(f"ReplicateConfig.{name} must be a list of str, not {type(v).__name__}")
    out = list(v)
    if not all(isinstance(s, str) for s in out):
        raise TypeError(f"ReplicateConfig.{name} must be a list of str")
    return out


def _check(name: str, v: Any) -> Any:
    """The value to store for attribute ``name``, or TypeError as pybind11 raises."""
    if name in ("replica_num", "nof_replica_num", "dfs_replica_num"):
        if not _is_int(v) or not 0 <= v < 1 << 64:
            raise TypeError(f"ReplicateConfig.{name} must be an int in [0, 2**64) (size_t)")
        return int(v)
    if name == "soft_pin_ttl_ms":
        if v is None:
            return None
        if not _is_int(v) or not 0 <= v < 1 << 64:
            raise TypeError("ReplicateConfig.soft_pin_ttl_ms must be None or an int in "
                            "[0, 2**64) (Mooncake's std::optional<uint64_t>)")
        return int(v)
    if name in ("with_hard_pin", "prefer_alloc_in_same_node"):
        if not isinstance(v, bool):
            raise TypeError(f"ReplicateConfig.{name} must be a bool")
        return v
    if name == "soft_pin_action":
        if isinstance(v, bool) or not isinstance(v, (SoftPinAction, int)):
            raise TypeError("ReplicateConfig.soft_pin_action must be a SoftPinAction")
        return SoftPinAction(v)
    if name == "data_type":
        if isinstance(v, bool) or not isinstance(v, (ObjectDataType, int)):
            raise TypeError("ReplicateConfig.data_type must be an ObjectDataType")
        return ObjectDataType(v)
    if name == "preferred_segment":
        if not isinstance(v, str):
            raise TypeError("ReplicateConfig.preferred_segment must be a str")
        return v
    if name in ("preferred_segments", "preferred_nof_segments"):
        return _str_list(name, v if v is not None else [])
    if name in ("group_ids", "session_ids"):
        return None if v is None else _str_list(name, v)
    return v


#: Fields kvmaster takes and cannot honour -> why (reported once when set non-empty).
_UNSERVED = {
    "nof_replica_num": "kvmaster has no NVMe-oF tier; the write keeps its memory replicas",
    "dfs_replica_num": "kvmaster has no DFS tier; the write keeps its memory replicas",
    "preferred_nof_segments": "kvmaster has no NVMe-oF tier",
    "prefer_alloc_in_same_node": "kvmaster places a replica by free space, not by node",
}


class ReplicateConfig(_NativeConfig):
    """Mooncake's ``ReplicateConfig``: default-constructed, attributes set after.

    replica_num (int >= 0): memory replicas on distinct segments.
    nof_replica_num, dfs_replica_num, preferred_nof_segments: NVMe-oF and DFS
    replicas; kvmaster has no such tier, so a non-zero count is reported once in
    the log and the write keeps its memory replicas only.
    soft_pin_action, soft_pin_ttl_ms (ms or None for the master's default),
    with_hard_pin: as :class:`kvmaster.ReplicateConfig`.
    preferred_segment (str, deprecated by Mooncake) is tried before
    preferred_segments (list of str).
    prefer_alloc_in_same_node (bool): accepted and reported once; kvmaster places
    a replica by free space.
    data_type (:class:`ObjectDataType`): accepted and kept.
    group_ids (list of str or None): one group per key of a batch ("" for none),
    as :class:`kvmaster.ReplicateConfig`: members share read leases and are evicted
    together (protocol/PROTOCOL.md section 14); GROUP_LIMIT_EXCEEDED (-1906) past a
    group's 256 members.
    session_ids (list of str or None): Mooncake 0.3.14's attribution tag, one per
    key.
    kv_sessions: kvmaster's session membership, one list of ids per key.
    """

    def __init__(self) -> None:
        super().__init__()
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.preferred_segments = []
        self.preferred_nof_segments: list[str] = []
        self.preferred_segment = ""
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids = None
        self.session_ids = None
        self.kv_sessions = None

    def __setattr__(self, name: str, value: Any) -> None:
        value = _check(name, value)
        if value and name in _UNSERVED:
            report_once(f"config-{name}", f"ReplicateConfig.{name}={value!r} is accepted and "
                                          f"not honoured: {_UNSERVED[name]}")
        object.__setattr__(self, name, value)

    def to_wire(self) -> list[Any]:
        pref = list(self.preferred_segments or ())
        if self.preferred_segment:
            pref.insert(0, self.preferred_segment)
        return [self.replica_num, self.with_hard_pin, int(self.soft_pin_action),
                self.soft_pin_ttl_ms, pref]

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else self.soft_pin_ttl_ms
        return (f"ReplicateConfig: {{ replica_num: {self.replica_num}, "
                f"nof_replica_num: {self.nof_replica_num}, "
                f"dfs_replica_num: {self.dfs_replica_num}, "
                f"soft_pin_action: {self.soft_pin_action.name}, soft_pin_ttl_ms: {ttl}, "
                f"with_hard_pin: {self.with_hard_pin}, "
                f"preferred_segments: {list(self.preferred_segments or ())}, "
                f"preferred_segment: {self.preferred_segment!r}, "
                f"data_type: {self.data_type.name} }}")
