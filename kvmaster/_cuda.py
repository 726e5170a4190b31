"""CUDA device memory for the client data plane, loaded lazily, never required.

An engine's KV cache lives in GPU memory (vLLM registers its KV tensors with
``register_buffer`` and saves and loads with ``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers`` on device pointers).  kvmaster copies with the CPU
between a caller's host memory and the shared-memory segments; a device pointer
handed to ``memmove`` would crash the process.  This module tells device memory from
host memory and copies between the two with CUDA:

* :func:`runtime` loads the CUDA runtime (``libcudart``) with ctypes the first time a
  pointer is not host memory; None when there is none, or no device, or
  ``KVMASTER_CUDA=off``.  CPU users never load it and need nothing installed.
* :class:`CudaRuntime`: ``cudaPointerGetAttributes`` (:meth:`~CudaRuntime.kind`),
  ``cudaMemcpyAsync`` of a whole call's copies over a few streams and one
  wait for them (:meth:`~CudaRuntime.copy_batch`), ``cudaHostRegister``
  of the mapped segments, so the copies run from and to page-locked memory at the
  link's speed (:meth:`~CudaRuntime.register_host`).
* :func:`classify`: which positions of a call are device memory, and why the others
  are refused (not host memory and no CUDA; unregistered or freed device memory).

:func:`use_runtime` replaces the runtime (tests use a stand-in where no GPU exists).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

log = logging.getLogger("kvmaster.cuda")

#: cudaMemcpyDefault: the direction follows from the pointers (unified addressing).
_MEMCPY_DEFAULT = 4
#: Streams a call's copies are spread over (round robin), so they overlap.
STREAMS = 4
#: Library names tried, newest first.
LIBRARIES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


class PointerKind(enum.IntEnum):
    """``cudaMemoryType`` of a pointer (``cudaPointerAttributes.type``)."""

    UNREGISTERED = 0
    HOST = 1
    DEVICE = 2
    MANAGED = 3


class CudaError(RuntimeError):
    """A CUDA runtime call failed: its name, the error number and CUDA's text."""


class Runtime(Protocol):
    """What the data plane uses of a CUDA runtime (:class:`CudaRuntime`, or a
    stand-in)."""

    def kind(self, ptr: int) -> PointerKind: ...

    def copy_batch(self, copies: Sequence[tuple[int, int, int]]) -> None: ...

    def register_host(self, ptr: int, size: int) -> bool: ...

    def unregister_host(self, ptr: int) -> None: ...


class _Attributes(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p)]


class CudaRuntime:
    """The CUDA runtime through ctypes (``lib``: the loaded ``libcudart``).

    :data:`STREAMS` streams for this process's copies; calls are serialised by a
    lock (the client's callers may be several threads).  Raises :class:`CudaError`."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_void_p]
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(_Attributes), ctypes.c_void_p]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        n = ctypes.c_int(0)
        self._check("cudaGetDeviceCount", lib.cudaGetDeviceCount(ctypes.byref(n)))
        self.devices = n.value
        self._streams = []
        for _ in range(STREAMS):
            stream = ctypes.c_void_p()
            self._check("cudaStreamCreate", lib.cudaStreamCreate(ctypes.byref(stream)))
            self._streams.append(stream)
        self._registered: dict[int, int] = {}

    def _check(self, call: str, err: int) -> None:
        if err:
            text = self._lib.cudaGetErrorString(err)
            raise CudaError(f"{call} failed: error {err} "
                            f"({text.decode() if text else 'unknown'})")

    def kind(self, ptr: int) -> PointerKind:
        """What ``ptr`` points to; UNREGISTERED for ordinary host memory and for an
        address CUDA does not know."""
        attrs = _Attributes()
        err = self._lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(ptr))
        if err:  # (an invalid pointer: cleared so the next call does not see it)
            self._lib.cudaGetLastError()
            return PointerKind.UNREGISTERED
        return PointerKind(attrs.type) if attrs.type in (0, 1, 2, 3) else \
            PointerKind.UNREGISTERED

    def copy_batch(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """``(dst, src, bytes)`` copies, any direction, queued over the streams in
        turn and waited for once (each stream synchronised, all of them even after
        an error, so no copy is left running)."""
        if not copies:
            return
        lib = self._lib
        streams = self._streams
        with self._lock:
            failed: CudaError | None = None
            for k, (dst, src, n) in enumerate(copies):
                err = lib.cudaMemcpyAsync(dst, src, n, _MEMCPY_DEFAULT,
                                          streams[k % len(streams)])
                if err:
                    try:
                        self._check("cudaMemcpyAsync", err)
                    except CudaError as exc:
                        failed = exc
                    break
            for stream in streams[:min(len(copies), len(streams))]:
                err = lib.cudaStreamSynchronize(stream)
                if err and failed is None:
                    try:
                        self._check("cudaStreamSynchronize", err)
                    except CudaError as exc:
                        failed = exc
            if failed is not None:
                lib.cudaGetLastError()  # (cleared: the caller's next CUDA check must not see it)
                raise failed

    def register_host(self, ptr: int, size: int) -> bool:
        """Page-lock ``[ptr, ptr + size)`` (a mapped segment) for fast copies; False
        when CUDA refuses (it stays usable, at pageable speed)."""
        with self._lock:
            if ptr in self._registered:
                return True
            err = self._lib.cudaHostRegister(ptr, size, 0)
            if err:
                self._lib.cudaGetLastError()
                log.warning("cudaHostRegister of %d bytes failed (error %d): copies "
                            "to and from it run at pageable speed", size, err)
                return False
            self._registered[ptr] = size
            return True

    def unregister_host(self, ptr: int) -> None:
        with self._lock:
            if self._registered.pop(ptr, None) is not None:
                self._lib.cudaHostUnregister(ptr)


_state: dict[str, Any] = {"loaded": False, "runtime": None}
_state_lock = threading.Lock()


def _load() -> CudaRuntime | None:
    if os.environ.get("KVMASTER_CUDA", "").lower() in ("0", "off", "no", "false"):
        return None
    names = list(LIBRARIES)
    found = ctypes.util.find_library("cudart")
    if found:
        names.insert(0, found)
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            rt = CudaRuntime(lib)
        except (CudaError, AttributeError) as exc:
            log.info("CUDA runtime %s unusable: %s", name, exc)
            return None
        if rt.devices < 1:
            return None
        log.info("CUDA runtime %s: %d device(s); device pointers are copied with CUDA",
                 name, rt.devices)
        return rt
    return None


def runtime() -> Runtime | None:
    """The process's CUDA runtime, loaded on the first call; None without one."""
    if not _state["loaded"]:
        with _state_lock:
            if not _state["loaded"]:
                _state["runtime"] = _load()
                _state["loaded"] = True
    return _state["runtime"]


def forget_host(buf: Any) -> None:
    """A mapping (``buf``, a writable buffer) is about to go: its page-locking, if this
    process's runtime did it, is undone first (so a later mapping at the same address
    is registered afresh).  Loads nothing."""
    rt = _state["runtime"] if _state["loaded"] else None
    if rt is None:
        return
    try:
        probe = ctypes.c_char.from_buffer(buf)
    except (TypeError, ValueError):
        return
    addr = ctypes.addressof(probe)
    del probe
    rt.unregister_host(addr)


def use_runtime(rt: Runtime | None) -> Runtime | None:
    """Make ``rt`` the process's runtime (None: none); returns the one before."""
    with _state_lock:
        old = _state["runtime"] if _state["loaded"] else None
        _state["runtime"], _state["loaded"] = rt, True
    return old


#: Page-lock mapped segments for device copies (``KVMASTER_CUDA_HOST_REGISTER=0``:
#: no, the copies then run at pageable speed; tools/gpu_check.py measures both).
HOST_REGISTER = os.environ.get("KVMASTER_CUDA_HOST_REGISTER", "1") not in ("0", "off", "no")


def reset() -> None:
    """Forget the runtime: the next :func:`runtime` loads it again."""
    with _state_lock:
        _state["runtime"], _state["loaded"] = None, False


#: Why a position is refused, by cause.
NO_CUDA = "not host memory of this process, and no CUDA runtime is loaded"
NOT_DEVICE = "neither host memory of this process nor CUDA device memory (freed or made up)"
MIXED = "its buffers mix host and device memory"


def classify(positions: Iterable[int], all_ptrs: Sequence[Sequence[int]],
             all_sizes: Sequence[Sequence[int]]) -> tuple[set[int], dict[int, str]]:
    """Of ``positions`` (a call's positions whose buffers are not all host memory),
    those whose buffers are all CUDA device (or managed) memory, and the others with
    the reason each is refused."""
    positions = list(positions)
    if not positions:
        return set(), {}
    rt = runtime()
    if rt is None:
        return set(), dict.fromkeys(positions, NO_CUDA)
    device: set[int] = set()
    refused: dict[int, str] = {}
    for i in positions:
        kinds = {rt.kind(p) for p, n in zip(all_ptrs[i], all_sizes[i]) if n > 0}
        on_device = kinds <= {PointerKind.DEVICE, PointerKind.MANAGED}
        if kinds and on_device:
            device.add(i)
        elif kinds & {PointerKind.DEVICE, PointerKind.MANAGED}:
            refused[i] = MIXED
        else:
            refused[i] = NOT_DEVICE
    return device, refused
