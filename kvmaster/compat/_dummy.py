"""Dummy clients: stores that use a real client's store on the same host
(Mooncake ``store_py.cpp`` ``setup_dummy``, ``alloc_from_mem_pool``,
``MooncakeHostMemAllocator``; ``dummy_client.cpp``; ``real_client_main.cpp``, the
``mooncake_client`` process).

In Mooncake a real client process (``mooncake_client``, port 50052 by default)
mounts the segment and serves dummy clients over RPC, mapping the shared memory they
register.  kvmaster's data plane is shared memory already, so its equivalent is
simpler: a real client runs a small service on its address
(:class:`RealClientService`, or ``python -m kvmaster.compat.mooncake_client``, which
takes ``mooncake_client``'s flags) that tells a dummy client on the same host which
master and tenant it serves; the dummy then talks to that master itself, with no
segment of its own, so its objects are placed in the real client's segment (the
host's memory pool it shares) and its reads and writes copy between that segment and
its own buffers directly.  When the
real client leaves, its segment and the objects in it go, as in Mooncake.

The service speaks one JSON object per line over TCP (``{"op": "info"}``,
``{"op": "ping"}``); it answers only with where the master is, nothing else, and a
dummy client refuses a service on another host (its ``host_id`` differs).

``alloc_from_mem_pool`` and :class:`MooncakeHostMemAllocator` hand out shared
anonymous mappings, one per call, as Mooncake's ShmHelper does; each stays mapped
until ``free`` (or the process's end).
"""

from __future__ import annotations

import json
import mmap
import socket
import socketserver
import threading
from typing import Any

from kvmaster._core import ClientConfig
from kvmaster._segment import host_id
from kvmaster.compat._common import log

__all__ = ["MooncakeHostMemAllocator", "RealClientService", "query_real_client"]

_MAX_LINE = 4096


class _MemPool:
    """The process's shared anonymous mappings by start address (ShmHelper)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[int, tuple[mmap.mmap, Any]] = {}

    def allocate(self, size: int) -> int:
        """Map ``size`` bytes (MAP_SHARED | MAP_ANONYMOUS, faulted in lazily); the start
        address.  Raises ValueError or OSError."""
        import ctypes

        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"size must be a positive int, not {size!r}")
        mm = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        arr = (ctypes.c_char * size).from_buffer(mm)  # pins the mapping while handed out
        addr = ctypes.addressof(arr)
        with self._lock:
            self._maps[addr] = (mm, arr)
        return addr

    def free(self, addr: int) -> int:
        """Unmap what :meth:`allocate` returned at ``addr``; 0, or -1 for another address."""
        with self._lock:
            entry = self._maps.pop(addr, None)
        if entry is None:
            log.error("free: %#x was not allocated from the memory pool", addr)
            return -1
        mm = entry[0]
        del entry  # the ctypes array goes with it, and with it the export that pins mm
        try:
            mm.close()
        except BufferError:  # a view of it is still alive: unmapped when it goes
            pass
        return 0

    def size_at(self, addr: int) -> int | None:
        """Size of the mapping that starts at ``addr``, or None."""
        with self._lock:
            entry = self._maps.get(addr)
        return None if entry is None else len(entry[0])


MEM_POOL = _MemPool()


class MooncakeHostMemAllocator:
    """Mooncake's host memory allocator (``store_py.cpp``): ``alloc(size)`` -> the
    address of ``size`` bytes of shared memory (raises RuntimeError when it cannot
    be mapped), ``free(ptr)`` -> 0 or -1.  The memory can be handed to a dummy
    client's ``register_buffer`` and zero-copy calls."""

    def alloc(self, size: int) -> int:
        try:
            return MEM_POOL.allocate(size)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"Failed to allocate shared memory: {exc}") from None

    def free(self, ptr: int) -> int:
        return MEM_POOL.free(ptr)


def split_address(addr: str) -> tuple[str, int]:
    """``host:port`` -> (host, port).  Raises ValueError."""
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"real client address {addr!r}: use host:port, e.g. 127.0.0.1:50052")
    return host.strip("[]"), int(port)


def query_real_client(addr: str, op: str = "info", timeout_s: float = 5.0) -> dict[str, Any]:
    """One request to the real client service at ``addr``; its answer.  Raises
    OSError (nothing listens, a timeout) or ValueError (a bad address or answer)."""
    host, port = split_address(addr)
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(json.dumps({"op": op}).encode() + b"\n")
        f = s.makefile("rb")
        line = f.readline(_MAX_LINE)
    body = json.loads(line or b"null")
    if not isinstance(body, dict):
        raise ValueError(f"real client {addr}: unexpected answer {line[:200]!r}")  # noqa: TRY004
    return body


class _Handler(socketserver.StreamRequestHandler):
    timeout = 5.0

    def handle(self) -> None:
        service: RealClientService = self.server.service  # type: ignore[attr-defined]
        try:
            line = self.rfile.readline(_MAX_LINE)
            req = json.loads(line or b"null")
            op = req.get("op") if isinstance(req, dict) else None
        except (OSError, ValueError):
            return
        if op == "info":
            body: dict[str, Any] = service.info()
        elif op == "ping":
            body = {"ok": service.healthy()}
        else:
            body = {"error": f"unknown op {op!r}"}
        try:
            self.wfile.write(json.dumps(body).encode() + b"\n")
        except OSError:
            pass


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class RealClientService:
    """Serves dummy clients of one set-up store (a MooncakeDistributedStore) on
    ``host:port`` (a thread per connection; :meth:`close` stops it).  A wildcard host
    (``0.0.0.0``, Mooncake's default) is bound to loopback only: dummy clients are on
    this host.  Raises OSError when the address is taken."""

    def __init__(self, store: Any, host: str = "127.0.0.1", port: int = 50052) -> None:
        self.store = store
        bind = "127.0.0.1" if host in ("", "0.0.0.0", "*") else host
        self._server = _Server((bind, port), _Handler)
        self._server.service = self  # type: ignore[attr-defined]
        bound_host = str(self._server.server_address[0])
        bound_port = int(self._server.server_address[1])
        self.address = f"{bound_host}:{bound_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="kvmaster-real-client-service")
        self._thread.start()

    def info(self) -> dict[str, Any]:
        client = self.store._client
        if client is None:
            return {"error": "the real client is not set up"}
        cfg: ClientConfig = client.config
        return {"master_server_addr": cfg.master_server_addr, "tenant": cfg.tenant,
                "host_id": host_id(), "segment": client.segment_name or "",
                "hostname": self.store.get_hostname()}

    def healthy(self) -> bool:
        return self.store.health_check() == 0

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
