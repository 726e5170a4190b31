"""An in-process stand-in for :class:`kvmaster.Client`, to measure the load generator alone.

``kvmaster-loadgen replay ... --master none:0 --client-factory
kvmaster.tools.loadgen.memclient:MemoryClient`` runs the whole tool (trace
reading, session planning, dispatch, worker processes, payload generation and
verification, acknowledgements, statistics) with every store call answered
from a dict in the worker's own memory.  The requests per second it reaches is
the tool's ceiling on this machine: a replay against a master that runs well
below it measures the master, not the tool.

Each worker has its own store (no sharing between workers), an LRU over
``global_segment_size`` bytes; session calls are accepted and do nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MemoryClient"]

_ALREADY_EXISTS = -705


@dataclass(frozen=True)
class _Info:
    session_id: str
    pinned: bool
    member_count: int


class MemoryClient:
    """Dict-backed client with the replay's subset of the Client API (one per process)."""

    def __init__(self) -> None:
        self.store: OrderedDict[str, bytes] = OrderedDict()
        self.capacity = 0
        self.used = 0
        self.evicted_keys = 0
        self.evicted_bytes = 0

    def setup(self, master_server_addr: str, global_segment_size: int,
              tenant: str = "default") -> None:
        self.capacity = global_segment_size

    def close(self) -> None:
        self.store.clear()

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        store = self.store
        return [1 if k in store else 0 for k in keys]

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        store = self.store
        out = []
        for k in keys:
            v = store.get(k)
            if v is not None:
                store.move_to_end(k)
            out.append(v)
        return out

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: Any = None) -> list[int]:
        store = self.store
        codes = []
        for k, v in zip(keys, values):
            if k in store:
                codes.append(_ALREADY_EXISTS)
                continue
            while store and self.used + len(v) > self.capacity:
                _, old = store.popitem(last=False)
                self.used -= len(old)
                self.evicted_keys += 1
                self.evicted_bytes += len(old)
            store[k] = bytes(v)
            self.used += len(v)
            codes.append(0)
        return codes

    # Session calls: accepted, no effect.
    def attach_kv_session(self, session_id: str, keys: Sequence[str]) -> list[int]:
        return [0] * len(keys)

    def update_kv_session(self, session_id: str, keep_keys: Sequence[str]) -> int:
        return 0

    def pin_kv_session(self, session_id: str) -> None:
        return None

    def unpin_kv_session(self, session_id: str) -> None:
        return None

    def close_kv_session(self, session_id: str) -> None:
        return None

    def get_kv_session(self, session_id: str) -> _Info:
        from kvmaster.errors import SessionNotFound

        raise SessionNotFound(f"{session_id}: a MemoryClient keeps no sessions")

    def stats(self) -> dict[str, int]:
        return {"keys": len(self.store), "evicted_keys": self.evicted_keys,
                "evicted_bytes": self.evicted_bytes}
