"""Buffer handles of the facade (Mooncake ``get_buffer``, ``batch_get_buffer``,
``BufferHandle``)."""

from __future__ import annotations

import ctypes

from kvmaster.compat._common import Facade


class BufferHandle:
    """Result of ``get_buffer``: a private copy of the object's bytes, with Mooncake's
    ``ptr()`` (host address), ``size()`` (bytes) and the buffer protocol."""

    def __init__(self, data: bytearray) -> None:
        self._data = data
        self._c = (ctypes.c_char * len(data)).from_buffer(data) if data else None

    def ptr(self) -> int:
        return ctypes.addressof(self._c) if self._c is not None else 0

    def size(self) -> int:
        return len(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self._data)

    def tobytes(self) -> bytes:
        return bytes(self._data)


class BufferOps(Facade):
    """``get_buffer``: a BufferHandle, or None on a miss or any failure."""

    def get_buffer(self, key: str) -> BufferHandle | None:
        try:
            return BufferHandle(bytearray(self.client.get_buffer(key)))
        except Exception:  # noqa: BLE001
            return None
