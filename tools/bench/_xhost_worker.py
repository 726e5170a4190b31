"""One process of ``bench xhost``, run inside a host's network namespace.

It reads one JSON command per line on stdin and answers one JSON line on stdout
(``{"result": ...}`` or ``{"error": ...}``), so the bench drives it step by step with
a bounded wait on every answer.  Values never travel over the pipe: every value is
:func:`payload` of its key and size, which every process computes alike.

Role ``a`` (``--role a``): the client that owns the segment and serves it through its
transfer service, plus the TCP floor's server (a thread per connection).  Role ``b``:
a client with no segment (every byte it reads or writes crosses to A's service) and
the TCP floor's client.

Commands: ``setup``, ``store`` (role a: put the get objects into its own segment),
``transfer`` (role b: a timed loop of gets or puts), ``tcp`` (role b: the same bytes
over one plain TCP connection to A's floor server), ``close``.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

#: The floor's request: direction (b"G": A sends, b"P": B sends) and byte count.
_HEADER = 9


def payload(key: str, size: int) -> bytes:
    """The value stored under ``key``: deterministic bytes of ``size``."""
    return random.Random(f"{key}/{size}").randbytes(size)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the floor connection")
        got += n


def _wait_until(t: float) -> None:
    d = t - time.monotonic()
    if d > 0:
        time.sleep(d)


class FloorServer:
    """A's end of the plain TCP floor: sends or receives the asked bytes, block by block."""

    def __init__(self, host: str, block: int) -> None:
        self.buf = bytearray(block)
        self.sock = socket.create_server((host, 0), backlog=16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="floor-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(60)
            try:
                head = memoryview(bytearray(_HEADER))
                _recv_exact(conn, head)
                kind, total = bytes(head[:1]), int.from_bytes(head[1:], "big")
                view = memoryview(self.buf if kind == b"G" else bytearray(len(self.buf)))
                left = total
                while left:
                    n = min(left, len(view))
                    if kind == b"G":
                        conn.sendall(view[:n])
                    else:
                        _recv_exact(conn, view[:n])
                    left -= n
                if kind == b"P":
                    conn.sendall(b"\x00")  # all bytes arrived
            except OSError:
                pass


class Worker:
    def __init__(self, role: str) -> None:
        self.role = role
        self.client: Any = None
        self.floor: FloorServer | None = None
        self.cfg: Any = None

    def setup(self, master: str, host: str, transfer_host: str, segment: int,
              checksums: bool, max_block: int) -> dict[str, Any]:
        from kvmaster import Client, ClientConfig

        c = Client(ClientConfig(local_hostname=host, transfer_host=transfer_host,
                                timeout_s=30.0, connect_timeout_s=10.0,
                                verify_checksums=checksums, write_checksums=checksums))
        c.setup(master, segment)
        self.client = c
        out: dict[str, Any] = {"segment": c.segment_name}
        if self.role == "a":
            # The segment's pages are allocated and faulted in by a background thread:
            # let it finish, so that it does not share the CPUs with the timed rows.
            t = time.monotonic()
            seg = c._segment
            if seg is not None and not seg.wait_populated(300):
                raise RuntimeError("the segment's pages were not faulted in within 300 s")
            out["populate_s"] = time.monotonic() - t
            self.floor = FloorServer(transfer_host, max_block)
            out["floor_port"] = self.floor.port
        return out

    def store(self, items: list[list[Any]]) -> int:
        from kvmaster import ReplicateConfig

        cfg = ReplicateConfig(preferred_segments=[self.client.segment_name])
        for key, size in items:
            self.client.put_from(key, payload(key, size), cfg)
        return len(items)

    def transfer(self, op: str, key: str, size: int, count: int, segment: str,
                 start_at: float) -> dict[str, Any]:
        """``count`` gets of ``key`` into one buffer, or ``count`` puts (of fresh keys
        ``<key>-<i>``) of one buffer into ``segment``; then the bytes are checked (the
        last get's buffer; two puts read back) and the put keys removed."""
        from kvmaster import ReplicateConfig

        c = self.client
        if op == "get":
            want = payload(key, size)
            buf = bytearray(size)
            c.get_into(key, buf)  # the connection to A's service is up before the clock
            _wait_until(start_at)
            t0 = time.monotonic()
            for _ in range(count):
                if c.get_into(key, buf) != size:
                    raise RuntimeError("short get_into")
            t1 = time.monotonic()
            ok = buf == want
        else:
            cfg = ReplicateConfig(preferred_segments=[segment])
            buf = bytearray(payload(key, size))
            keys = [f"{key}-{i}" for i in range(count)]
            c.put_from(f"{key}-warm", buf, cfg)
            _wait_until(start_at)
            t0 = time.monotonic()
            for k in keys:
                c.put_from(k, buf, cfg)
            t1 = time.monotonic()
            ok = all(c.get(k) == buf for k in {keys[0], keys[-1]})
            c.batch_remove([f"{key}-warm", *keys], True)
        return {"t0": t0, "t1": t1, "bytes": size * count, "ok": ok}

    def tcp(self, op: str, host: str, port: int, size: int, count: int,
            start_at: float) -> dict[str, Any]:
        """The same bytes over a plain TCP connection: ``get`` A sends, ``put`` B sends,
        ``size`` bytes a ``sendall``/``recv_into``.  ``get`` checks nothing (A sends one
        reused buffer); both check the byte count."""
        total = size * count
        buf = memoryview(bytearray(size))
        with socket.create_connection((host, port), timeout=60) as s:
            _wait_until(start_at)
            t0 = time.monotonic()
            s.sendall((b"G" if op == "get" else b"P") + total.to_bytes(8, "big"))
            for _ in range(count):
                if op == "get":
                    _recv_exact(s, buf)
                else:
                    s.sendall(buf)
            if op == "put":
                ack = bytearray(1)
                _recv_exact(s, memoryview(ack))
            t1 = time.monotonic()
        return {"t0": t0, "t1": t1, "bytes": total, "ok": True}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.floor is not None:
            self.floor.sock.close()
            self.floor = None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="one process of bench xhost (driven on stdin)")
    p.add_argument("--role", choices=["a", "b"], required=True)
    w = Worker(p.parse_args(argv).role)
    handlers: dict[str, Callable[..., Any]] = {"setup": w.setup, "store": w.store,
                                               "transfer": w.transfer, "tcp": w.tcp}
    # A SIGTERM (the bench giving up) still closes the client: A's segment file is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            msg = json.loads(line)
            cmd = msg.pop("cmd")
            if cmd == "close":
                break
            try:
                reply: dict[str, Any] = {"result": handlers[cmd](**msg)}
            except Exception as exc:  # noqa: BLE001 - reported to the bench, which stops
                reply = {"error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()[-3000:]}
            print(json.dumps(reply), flush=True)
    finally:
        w.close()


if __name__ == "__main__":
    main()
