"""``lmcache.v1.storage_backend.local_cpu_backend.LocalCPUBackend``: the config,
metadata and memory allocator a remote connector is built from."""

from __future__ import annotations

import torch

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, MixedMemoryAllocator
from lmcache.v1.metadata import LMCacheMetadata


class LocalCPUBackend:
    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheMetadata,
                 buffer_bytes: int = 64 << 20) -> None:
        self.config = config
        self.metadata = metadata
        self.memory_allocator = MixedMemoryAllocator(buffer_bytes)

    def allocate(self, shapes: list[torch.Size], dtypes: list[torch.dtype],
                 fmt: MemoryFormat = MemoryFormat.KV_2LTD) -> MemoryObj | None:
        return self.memory_allocator.allocate(shapes, dtypes, fmt)
