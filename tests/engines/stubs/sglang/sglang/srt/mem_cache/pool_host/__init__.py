"""Stand-ins for SGLang's host KV pools (``sglang.srt.mem_cache.pool_host``), our own
minimal code: real torch CPU tensors in the layouts SGLang's HiCache storage backends
address (page_first, page_first_direct, layer_first), and ``get_page_buffer_meta``
giving the (pointer, bytes) of each stored object of a page, in the order
mooncake_store.py zips them with its keys."""

from __future__ import annotations

import ctypes
from typing import Any

import torch


class HostTensorAllocator:
    """Plain host tensors (SGLang's default allocator)."""

    def __init__(self) -> None:
        self.dims: tuple = ()
        self.dtype: torch.dtype = torch.uint8

    def allocate(self, dims: tuple, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
        self.dims, self.dtype = dims, dtype
        return torch.zeros(dims, dtype=dtype, device=device)


class HostKVCache:
    """Base of the stand-in pools: ``size`` token slots, ``page_size`` tokens a page."""

    def __init__(self, size: int, page_size: int, layer_num: int, dtype: torch.dtype,
                 layout: str, allocator: HostTensorAllocator | None = None) -> None:
        if size % page_size:
            raise ValueError("size must be a whole number of pages")
        self.size = size
        self.page_size = page_size
        self.layer_num = layer_num
        self.dtype = dtype
        self.layout = layout
        self.allocator = allocator or HostTensorAllocator()
        self.kv_buffer: Any = None

    def _page_starts(self, indices: torch.Tensor) -> list[int]:
        idx = [int(i) for i in indices.tolist()]
        if len(idx) % self.page_size:
            raise ValueError("indices must cover whole pages")
        return idx[::self.page_size]

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for buf in self.buffers():
            flat = buf.view(torch.uint8).view(-1)
            flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))

    def buffers(self) -> list[torch.Tensor]:
        return [self.kv_buffer]

    def page_bytes(self, page_start: int) -> list[bytes]:
        """The bytes of each buffer run of the page starting at slot ``page_start``, in
        ``get_page_buffer_meta``'s order."""
        ptrs, sizes = self.get_page_buffer_meta(
            torch.arange(page_start, page_start + self.page_size))
        out = []
        for p, s in zip(ptrs, sizes):
            if isinstance(p, (list, tuple)):
                out.append(b"".join(ctypes.string_at(q, n) for q, n in zip(p, s)))
            else:
                out.append(ctypes.string_at(p, s))
        return out
