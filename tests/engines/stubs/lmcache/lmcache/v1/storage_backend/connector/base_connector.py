"""``lmcache.v1.storage_backend.connector.base_connector.RemoteConnector``: what a
remote connector inherits: the metadata mode (``save_chunk_meta``: chunk metadata
stored in front of the bytes unless ``extra_config["save_chunk_meta"]`` is false),
the full-chunk layout, and ``reshape_partial_chunk`` for a read shorter than a full
chunk."""

from __future__ import annotations

import abc

import torch

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, size_bytes
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.protocol import get_remote_metadata_bytes, init_remote_metadata_info


class RemoteConnector(metaclass=abc.ABCMeta):
    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheMetadata | None) -> None:
        assert metadata is not None
        extra = config.extra_config
        self.save_chunk_meta = bool(extra is None or extra.get("save_chunk_meta", True)
                                    or config.use_layerwise)
        self.meta_shapes = metadata.get_shapes()
        self.meta_dtypes = metadata.get_dtypes()
        self.meta_fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        self.full_chunk_size_bytes = size_bytes(self.meta_shapes, self.meta_dtypes)
        assert self.full_chunk_size_bytes % metadata.chunk_size == 0
        self.single_token_size = self.full_chunk_size_bytes // metadata.chunk_size
        init_remote_metadata_info(metadata.get_num_groups())
        self.remote_metadata_bytes = get_remote_metadata_bytes()

    def reshape_partial_chunk(self, memory_obj: MemoryObj, bytes_read: int) -> MemoryObj:
        """A full chunk as it is; a shorter read (a whole number of tokens) narrows the
        object to ``bytes_read`` bytes and its token dimension to match."""
        if (bytes_read <= 0 or bytes_read % self.single_token_size
                or bytes_read > self.full_chunk_size_bytes):
            raise ValueError(f"bytes_read {bytes_read} is not a whole number of tokens "
                             f"of {self.single_token_size} bytes up to a full chunk")
        if bytes_read == self.full_chunk_size_bytes:
            return memory_obj
        shape = list(memory_obj.meta.shape)
        shape[2] = bytes_read // self.single_token_size  # [kv, layers, tokens, hidden]
        memory_obj.raw_data = memory_obj.raw_data[:bytes_read]
        memory_obj.meta.shape = torch.Size(shape)
        memory_obj.meta.shapes = [torch.Size(shape)]
        memory_obj.group_prefix_sum = [0, bytes_read]
        return memory_obj

    @abc.abstractmethod
    async def exists(self, key): ...

    @abc.abstractmethod
    def exists_sync(self, key): ...

    @abc.abstractmethod
    async def get(self, key): ...

    @abc.abstractmethod
    async def put(self, key, memory_obj): ...

    @abc.abstractmethod
    async def close(self): ...
