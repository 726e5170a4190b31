"""``lmcache.v1.memory_management``: memory formats, memory objects over slices of
one CPU buffer, and the allocator that hands them out and takes them back."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from enum import Enum

import torch


class MemoryFormat(Enum):
    UNDEFINED = 0
    KV_2LTD = 1     # [2, num_layers, num_tokens, hidden]
    KV_MLA_FMT = 6  # [1, num_layers, num_tokens, hidden]


def size_bytes(shapes: list[torch.Size], dtypes: list[torch.dtype]) -> int:
    return sum(s.numel() * d.itemsize for s, d in zip(shapes, dtypes, strict=True))


@dataclass
class MemoryObjMetadata:
    shape: torch.Size
    dtype: torch.dtype
    address: int
    phy_size: int
    ref_count: int
    fmt: MemoryFormat = MemoryFormat.UNDEFINED
    shapes: list[torch.Size] | None = None
    dtypes: list[torch.dtype] | None = None


class MemoryObj:
    """A chunk of KV cache: ``raw_data`` is a flat uint8 tensor (its bytes), ``meta``
    its logical shapes, dtypes and format, with a reference count that gives the
    bytes back to the allocator when it drops to zero."""

    def __init__(self, raw_data: torch.Tensor, meta: MemoryObjMetadata,
                 allocator: PinnedAllocator | None) -> None:
        self.raw_data = raw_data
        self.meta = meta
        self.allocator = allocator
        self.valid = True
        self.lock = threading.Lock()
        self.group_prefix_sum = [0, size_bytes(meta.shapes or [meta.shape],
                                               meta.dtypes or [meta.dtype])]

    def get_size(self) -> int:
        return self.group_prefix_sum[-1]

    def get_shapes(self) -> list[torch.Size]:
        assert self.meta.shapes is not None
        return self.meta.shapes

    def get_dtypes(self) -> list[torch.dtype]:
        assert self.meta.dtypes is not None
        return self.meta.dtypes

    def get_memory_format(self) -> MemoryFormat:
        return self.meta.fmt

    def get_ref_count(self) -> int:
        return self.meta.ref_count

    def ref_count_up(self) -> None:
        with self.lock:
            self.meta.ref_count += 1

    def ref_count_down(self) -> None:
        with self.lock:
            self.meta.ref_count -= 1
            last = self.meta.ref_count == 0
        if last and self.allocator is not None:
            self.allocator.free(self)

    @property
    def raw_tensor(self) -> torch.Tensor | None:
        return self.raw_data if self.valid else None

    @property
    def tensor(self) -> torch.Tensor:
        """The logical view: ``raw_data`` as ``meta.dtype`` in ``meta.shape``."""
        return self.raw_data[: self.get_size()].view(self.meta.dtype).view(self.meta.shape)

    @property
    def data_ptr(self) -> int:
        return self.raw_data.data_ptr()

    @property
    def byte_array(self) -> memoryview:
        """The object's logical bytes, in place (no copy)."""
        n = self.get_size()
        return memoryview((ctypes.c_ubyte * n).from_address(self.data_ptr)).cast("B")


class PinnedAllocator:
    """First-fit allocator over one contiguous CPU buffer (``buffer``: uint8 tensor),
    the buffer LMCache registers with the store for zero-copy transfers."""

    ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, length), sorted
        self._lock = threading.Lock()
        self.used = 0
        self.live = 0

    def allocate(self, shapes: list[torch.Size], dtypes: list[torch.dtype],
                 fmt: MemoryFormat) -> MemoryObj | None:
        need = size_bytes(shapes, dtypes)
        phy = -(-need // self.ALIGN) * self.ALIGN
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= phy:
                    if length == phy:
                        del self._free[i]
                    else:
                        self._free[i] = (off + phy, length - phy)
                    self.used += phy
                    self.live += 1
                    break
            else:
                return None
        meta = MemoryObjMetadata(shape=shapes[0], dtype=dtypes[0], address=off, phy_size=phy,
                                 ref_count=1, fmt=fmt, shapes=list(shapes),
                                 dtypes=list(dtypes))
        return MemoryObj(self.buffer[off:off + phy], meta, self)

    def free(self, obj: MemoryObj) -> None:
        if not obj.valid:
            return
        obj.valid = False
        off, phy = obj.meta.address, obj.meta.phy_size
        with self._lock:
            self.used -= phy
            self.live -= 1
            spans = sorted([*self._free, (off, phy)])
            merged: list[tuple[int, int]] = []
            for o, n in spans:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((o, n))
            self._free = merged


class MixedMemoryAllocator:
    """The CPU backend's allocator: a ``pin_allocator`` whose ``buffer`` the
    connector registers; no NUMA mapping."""

    numa_mapping = None

    def __init__(self, nbytes: int) -> None:
        self.pin_allocator = PinnedAllocator(nbytes)

    def allocate(self, shapes: list[torch.Size], dtypes: list[torch.dtype],
                 fmt: MemoryFormat) -> MemoryObj | None:
        return self.pin_allocator.allocate(shapes, dtypes, fmt)
