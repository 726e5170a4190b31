"""Stand-in for SGLang's ``MLATokenToKVPoolHost``: one latent-KV object per page.

page_first / page_first_direct: ``kv_buffer`` is ``(size, layer_num, 1,
kv_cache_dim)``: a page is one contiguous run.  layer_first: ``(layer_num, size, 1,
kv_cache_dim)``: a page is ``layer_num`` runs, one per layer, that the backend stores
as one object through ``batch_put_from_multi_buffers``."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.pool_host import HostKVCache, HostTensorAllocator


class MLATokenToKVPoolHost(HostKVCache):
    def __init__(self, size: int, page_size: int, layer_num: int, kv_cache_dim: int,
                 dtype: torch.dtype = torch.bfloat16, layout: str = "page_first",
                 allocator: HostTensorAllocator | None = None) -> None:
        super().__init__(size, page_size, layer_num, dtype, layout, allocator)
        self.kv_cache_dim = kv_cache_dim
        if layout == "layer_first":
            dims = (layer_num, size, 1, kv_cache_dim)
        else:
            dims = (size, layer_num, 1, kv_cache_dim)
        self.kv_buffer = self.allocator.allocate(dims, dtype)

    def get_ksize_per_token(self) -> int:
        return self.layer_num * self.kv_cache_dim * self.dtype.itemsize

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        base = self.kv_buffer.data_ptr()
        tok = self.kv_cache_dim * self.dtype.itemsize
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for start in self._page_starts(indices):
                for layer in range(self.layer_num):
                    ptrs.append(base + layer * self.size * tok + start * tok)
            return ptrs, [self.page_size * tok] * len(ptrs)
        if self.layout not in ("page_first", "page_first_direct"):
            raise ValueError(f"Unsupported layout: {self.layout}")
        for start in self._page_starts(indices):
            ptrs.append(base + start * self.layer_num * tok)
        return ptrs, [self.layer_num * self.page_size * tok] * len(ptrs)

    def page_bytes(self, page_start: int) -> list[bytes]:
        """The page's one object (its per-layer runs joined, for layer_first)."""
        return [b"".join(super().page_bytes(page_start))]
