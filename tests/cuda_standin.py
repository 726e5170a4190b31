"""A CUDA stand-in for machines with no GPU (named as such wherever it is used).

It behaves as the part of the CUDA runtime kvmaster uses (:class:`kvmaster._cuda.
Runtime`) over "device memory" that the process cannot touch: each allocation is an
address range reserved with ``0)``, as CUDA reserves its own, so any CPU
access to it crashes the process exactly as a real device pointer would.  Its bytes
live in a host shadow buffer that only :meth:`CudaStandIn.copy_batch` (the stand-in's
``cudaMemcpyAsync``) reaches."""

from __future__ import annotations

import ctypes
import mmap  # (mmap.PROT_NONE is 0)
from collections.abc import Sequence

from kvmaster._cuda import PointerKind

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class CudaStandIn:
    """Device allocations, pointer kinds, copies, and a record of host registrations."""

    def __init__(self) -> None:
        #: device address -> (size, shadow host buffer)
        self.allocs: dict[int, tuple[int, ctypes.Array]] = {}
        self.registered: dict[int, int] = {}
        self.copies = 0
        self.batches = 0

    def alloc(self, size: int) -> int:
        addr = _libc.mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                          -1, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        self.allocs[addr] = (size, (ctypes.c_char * size)())
        return addr

    def free(self, addr: int) -> None:
        size, _ = self.allocs.pop(addr)
        _libc.munmap(addr, size)

    def _find(self, ptr: int, n: int = 1) -> int | None:
        for base, (size, shadow) in self.allocs.items():
            if base <= ptr and ptr + n <= base + size:
                return ctypes.addressof(shadow) + (ptr - base)
        return None

    def write(self, addr: int, data: bytes) -> None:
        """Fill device memory (the test's cudaMemcpy host-to-device)."""
        ctypes.memmove(self._find(addr, len(data)), data, len(data))

    def read(self, addr: int, n: int) -> bytes:
        return ctypes.string_at(self._find(addr, n), n)

    def close(self) -> None:
        for addr in list(self.allocs):
            self.free(addr)

    # ----------------------------------------------------- kvmaster._cuda.Runtime

    def kind(self, ptr: int) -> PointerKind:
        return PointerKind.DEVICE if self._find(ptr) is not None else PointerKind.UNREGISTERED

    def copy_batch(self, copies: Sequence[tuple[int, int, int]]) -> None:
        self.batches += 1
        for dst, src, n in copies:
            d, s = self._find(dst, n), self._find(src, n)
            ctypes.memmove(dst if d is None else d, src if s is None else s, n)
            self.copies += 1

    def register_host(self, ptr: int, size: int) -> bool:
        self.registered[ptr] = size
        return True

    def unregister_host(self, ptr: int) -> None:
        self.registered.pop(ptr, None)
