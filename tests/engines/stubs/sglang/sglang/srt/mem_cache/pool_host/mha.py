"""Stand-in for SGLang's ``MHATokenToKVPoolHost``: one K and one V object per page.

page_first / page_first_direct: ``kv_buffer`` is ``(2, size, layer_num, head_num,
head_dim)``, so a page's K (and V) for every layer is one contiguous run.
layer_first: ``(2, layer_num, size, head_num, head_dim)``, a page's K and V per layer
(the Mooncake backend refuses it for MHA, as SGLang's does)."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.pool_host import HostKVCache, HostTensorAllocator


class MHATokenToKVPoolHost(HostKVCache):
    def __init__(self, size: int, page_size: int, layer_num: int, head_num: int,
                 head_dim: int, dtype: torch.dtype = torch.bfloat16,
                 layout: str = "page_first",
                 allocator: HostTensorAllocator | None = None) -> None:
        super().__init__(size, page_size, layer_num, dtype, layout, allocator)
        self.head_num, self.head_dim = head_num, head_dim
        if layout == "layer_first":
            dims = (2, layer_num, size, head_num, head_dim)
        else:
            dims = (2, size, layer_num, head_num, head_dim)
        self.kv_buffer = self.allocator.allocate(dims, dtype)

    def _token_bytes(self) -> int:
        return self.head_num * self.head_dim * self.dtype.itemsize

    def get_ksize_per_token(self) -> int:
        return self.layer_num * self._token_bytes()

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        base = self.kv_buffer.data_ptr()
        tok = self._token_bytes()
        v_off = self.layer_num * self.size * tok
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for start in self._page_starts(indices):
                for layer in range(self.layer_num):
                    k = base + layer * self.size * tok + start * tok
                    ptrs += [k, k + v_off]
            return ptrs, [self.page_size * tok] * len(ptrs)
        if self.layout not in ("page_first", "page_first_direct"):
            raise ValueError(f"Unsupported layout: {self.layout}")
        for start in self._page_starts(indices):
            k = base + start * self.layer_num * tok
            ptrs += [k, k + v_off]
        return ptrs, [self.layer_num * self.page_size * tok] * len(ptrs)
