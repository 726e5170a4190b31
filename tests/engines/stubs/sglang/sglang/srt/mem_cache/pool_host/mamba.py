"""Stand-in for SGLang's Mamba host pool: per state slot (``page_size`` 1) one
temporal-state object and one object per conv state, in the order
mooncake_store.py names them (``_temporal``, then ``_conv_<i>``)."""

from __future__ import annotations

import torch

from sglang.srt.mem_cache.pool_host import HostKVCache


class MambaPoolHost(HostKVCache):
    def __init__(self, size: int, layer_num: int, temporal_elems: int,
                 conv_elems: list[int], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(size, 1, layer_num, dtype, "page_first")
        self.temporal_buffer = torch.zeros((size, layer_num, temporal_elems), dtype=dtype)
        self.conv_buffer = [torch.zeros((size, layer_num, n), dtype=dtype) for n in conv_elems]
        self.temporal_state_elem_size = temporal_elems
        self.kv_buffer = self.temporal_buffer

    def buffers(self) -> list[torch.Tensor]:
        return [self.temporal_buffer, *self.conv_buffer]

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return self.buffers()

    def get_ksize_per_token(self) -> int:
        return sum(b[0].nbytes for b in self.buffers())

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        ptrs: list[int] = []
        sizes: list[int] = []
        for slot in self._page_starts(indices):
            for b in self.buffers():
                row = b[slot]
                ptrs.append(row.data_ptr())
                sizes.append(row.nbytes)
        return ptrs, sizes
