"""Buffer handles of the facade (Mooncake ``store_py.cpp``: ``get_buffer``,
``batch_get_buffer`` and the ``BufferHandle`` class; ``real_client.cpp``:
``RealClient::get_buffer``, ``RealClient::batch_get_buffer`` and, from the
client before the P2P merge, ``RealClient::get_buffer_info``)."""

from __future__ import annotations

import collections
import ctypes
import threading
from collections.abc import Sequence
from typing import Any

from kvmaster.compat._common import Facade, log

#: How many handles ``get_buffer_info`` keeps alive per store, so the addresses it
#: returned stay readable: the oldest is dropped when a further one is taken.
INFO_KEEP = 16


class BufferHandle(bytearray):
    """Result of ``get_buffer``/``batch_get_buffer``: a private copy of one object's
    bytes, with Mooncake's ``ptr()`` (host address of the first byte, 0 when empty),
    ``size()`` and ``len()`` (bytes) and the buffer protocol (1-D, one byte per item,
    writable), so ``memoryview(h)``, ``bytes(h)`` and ``torch.frombuffer(h, ...)``
    read it without another copy.

    It is a ``bytearray`` so the buffer protocol works before Python 3.12; its size
    is fixed (resizing raises ``BufferError``), so ``ptr()`` stays valid for the
    handle's lifetime."""

    __slots__ = ("_pin",)

    def __init__(self, data: Any = b"") -> None:
        super().__init__(data)
        # An exported view pins the storage: the bytearray cannot be resized or moved.
        self._pin = (ctypes.c_char * len(self)).from_buffer(self) if len(self) else None

    def ptr(self) -> int:
        """Host address of the bytes (an int), 0 for an empty object."""
        return ctypes.addressof(self._pin) if self._pin is not None else 0

    def size(self) -> int:
        """Bytes held."""
        return len(self)

    def tobytes(self) -> bytes:
        """A ``bytes`` copy."""
        return bytes(self)

    def __repr__(self) -> str:
        return f"BufferHandle(size={len(self)})"


def _handle_of(data: Any) -> BufferHandle:
    """One copy of ``data`` (bytes, bytearray or memoryview) into a handle."""
    return BufferHandle(data)


class BufferOps(Facade):
    """``get_buffer`` and ``batch_get_buffer`` return BufferHandles (None where an
    object is missing or the read failed, as Mooncake's null handle);
    ``get_buffer_info`` returns ``(address, size)``, ``(0, 0)`` on a miss."""

    _info_lock = threading.Lock()

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object's bytes as a BufferHandle; None on a miss or any failure."""
        try:
            return _handle_of(self.client.get_buffer(key))
        except Exception:  # noqa: BLE001 - Mooncake returns a null handle
            return None

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """One BufferHandle per key, in order; None where the object is missing.

        ``keys`` is a list of str (``TypeError`` otherwise, as Mooncake's binding
        raises for a wrong argument type).  The batch is bounded by the master's
        ``max_batch``; a larger batch, or a failed call, gives None at every
        position (logged), as Mooncake's batch read does."""
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise TypeError(f"batch_get_buffer(): keys must be a list of str, "
                            f"not {type(keys).__name__}")
        keys = list(keys)
        if not all(isinstance(k, str) for k in keys):
            raise TypeError("batch_get_buffer(): every key must be a str")
        if not keys:
            return []
        try:
            values = self.client.get_batch(keys)
        except Exception as exc:  # noqa: BLE001 - Mooncake answers with null handles
            log.error("batch_get_buffer of %d keys failed: %s", len(keys), exc)
            return [None] * len(keys)
        return [None if v is None else _handle_of(v) for v in values]

    def get_buffer_info(self, key: str) -> tuple[int, int]:
        """``(address, size)`` of a private copy of the object's bytes; ``(0, 0)`` on
        a miss or any failure (Mooncake ``RealClient::get_buffer_info``).

        The copy is held by this store until :data:`INFO_KEEP` later
        ``get_buffer_info`` calls (or the store's end); read it before then
        (``ctypes.string_at``).  Mooncake's address is its client buffer's, valid
        until that buffer is reused; this one is never reused while held."""
        handle = self.get_buffer(key)
        if handle is None:
            return (0, 0)
        with self._info_lock:
            kept = self.__dict__.get("_info_kept")
            if kept is None:
                kept = self.__dict__["_info_kept"] = collections.deque(maxlen=INFO_KEEP)
            kept.append(handle)
        return (handle.ptr(), handle.size())
