"""``lmcache.v1.metadata.LMCacheMetadata``: model and KV layout of one worker."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LMCacheMetadata:
    model_name: str
    world_size: int
    worker_id: int
    kv_dtype: torch.dtype
    #: (num_layers, 2, chunk_size, num_kv_heads, head_size)
    kv_shape: tuple[int, int, int, int, int]
    use_mla: bool = False

    @property
    def chunk_size(self) -> int:
        return self.kv_shape[2]

    def get_shapes(self, num_tokens: int | None = None) -> list[torch.Size]:
        """One group: ``[kv (2, or 1 with MLA), layers, tokens, heads * head_size]``."""
        layers, _, chunk, heads, head_size = self.kv_shape
        n = chunk if num_tokens is None else num_tokens
        return [torch.Size([1 if self.use_mla else 2, layers, n, heads * head_size])]

    def get_dtypes(self) -> list[torch.dtype]:
        return [self.kv_dtype]

    def get_num_groups(self) -> int:
        return 1
