"""``MooncakeDistributedStore``: the facade's families in one class."""

from __future__ import annotations

from kvmaster.compat._buffers import BufferOps
from kvmaster.compat._multibuf import MultiBufferOps
from kvmaster.compat._objects import ObjectOps
from kvmaster.compat._ranges import RangeOps
from kvmaster.compat._replicas import ReplicaOps
from kvmaster.compat._safetensors import SafetensorOps
from kvmaster.compat._segments import SegmentOps
from kvmaster.compat._sessions import SessionOps
from kvmaster.compat._setup import SetupOps
from kvmaster.compat._tensor_parallel import ParallelTensorOps


class MooncakeDistributedStore(SetupOps, RangeOps, ObjectOps, BufferOps, MultiBufferOps,
                               ParallelTensorOps, SafetensorOps, ReplicaOps, SegmentOps, SessionOps):
    """Drop-in for ``mooncake.store.MooncakeDistributedStore`` backed by kvmaster.

    Each family of methods lives in its own module of :mod:`kvmaster.compat`; they
    share nothing but the native client that ``setup`` makes."""

    def __init__(self) -> None:
        self._client = None

    def close(self) -> int:
        """Unmount the extra segments (:meth:`allocate_and_mount_segment`), then close
        the store's own client -> 0."""
        self._close_extras()
        return super().close()
