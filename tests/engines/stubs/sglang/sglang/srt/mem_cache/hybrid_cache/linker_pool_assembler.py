"""Stand-in for SGLang's ``DevicePoolEntry`` (the Mooncake direct linker's view of a
device pool), our own minimal code over CPU tensors: ``buffers`` are per-layer
tensors whose row ``r`` holds page ``r`` of that layer; a page's object packs the
rows of every layer, layer 0 first, so layer ``l`` of a page is the byte range
``[l * row_bytes, (l + 1) * row_bytes)`` of its object."""

from __future__ import annotations

from typing import Any

import torch


class DevicePoolEntry:
    def __init__(self, *, name: Any, buffers: list[torch.Tensor], page_size: int) -> None:
        if not buffers or any(b.shape[0] != buffers[0].shape[0] for b in buffers):
            raise ValueError("buffers must be non-empty with equal row counts")
        self.name = name
        self.indices_from_pool = name
        self.page_size = page_size
        self.kv_buffer = list(buffers)
        self.row_bytes = [b[0].nbytes for b in buffers]
        self.offsets = [sum(self.row_bytes[:i]) for i in range(len(buffers))]

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return self.kv_buffer

    def _rows(self, indices: torch.Tensor) -> list[int]:
        idx = [int(i) for i in indices.tolist()]
        if len(idx) % self.page_size or any(i % self.page_size for i in idx[::self.page_size]):
            raise ValueError("indices must be whole aligned pages")
        return [i // self.page_size for i in idx[::self.page_size]]

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        rows = self._rows(indices)
        ptrs = [b[r].data_ptr() for r in rows for b in self.kv_buffer]
        sizes = [n for _ in rows for n in self.row_bytes]
        return ptrs, sizes

    def prepare_locations(self, indices: torch.Tensor) -> list[int]:
        return self._rows(indices)

    def get_prepared_layer_range_meta(self, locations: list[int], layer: int
                                      ) -> tuple[list[list[int]], list[list[int]],
                                                 list[list[int]]] | None:
        if not 0 <= layer < len(self.kv_buffer):
            return None
        b = self.kv_buffer[layer]
        return ([[b[r].data_ptr()] for r in locations], [[self.row_bytes[layer]]
                                                         for _ in locations],
                [[self.offsets[layer]] for _ in locations])
