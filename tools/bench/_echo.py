"""Echo servers: the transport floor for single-op latency.

``python _echo.py --mode blocking|uvloop|tcp [--lean]`` binds on 127.0.0.1 (any free
port), prints ``echo listening on tcp://127.0.0.1:PORT`` and sends every
message straight back to its sender until SIGTERM.

* ``blocking``: a plain ``recv_multipart`` / ``send_multipart`` loop; the
  cheapest way to answer from Python.
* ``uvloop``: the socket's file descriptor is watched by a uvloop event loop
  (``add_reader``), and every readiness callback drains the socket through
  ``EVENTS``/``NOBLOCK``, as an asyncio-integrated server has to.  The
  difference to ``blocking`` is the cost of event-loop integration.
* ``--lean``: the server (and, in the benchmark, the client) moves frames with
  ``kvmaster._frames`` instead of pyzmq's ``send_multipart``/``recv_multipart``,
  as kvmaster's master and client do.
* ``tcp``: no ZeroMQ at all: a plain TCP socket, one recv and one sendall
  per message, for comparison with ZeroMQ's extra I/O-thread hops.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

import zmq


def _io(lean: bool) -> tuple[Any, Any]:
    """(recv(sock, flags), send(sock, frames)): pyzmq's or kvmaster's lean ones."""
    if lean:
        from kvmaster._frames import recv_frames, send_frames

        return recv_frames, send_frames
    return (lambda sock, flags: sock.recv_multipart(flags),
            lambda sock, frames: sock.send_multipart(frames))


def _bind(ctx: zmq.Context) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    print(f"echo listening on {sock.getsockopt_string(zmq.LAST_ENDPOINT)}", flush=True)
    return sock


def serve_blocking(lean: bool) -> None:
    ctx = zmq.Context()
    sock = _bind(ctx)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    recv, send = _io(lean)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stopping:
        if not poller.poll(200):
            continue
        while True:
            try:
                frames = recv(sock, zmq.NOBLOCK)
            except zmq.Again:
                break
            send(sock, frames)
    sock.close(0)
    ctx.term()


def serve_uvloop(lean: bool) -> None:
    import asyncio

    import uvloop

    recv, send = _io(lean)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ctx = zmq.Context()
        sock = _bind(ctx)
        done = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, done.set)
        fd = sock.getsockopt(zmq.FD)
        pending = [False]

        def drain() -> None:
            pending[0] = False
            budget = 4096
            while budget and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                budget -= 1
                send(sock, recv(sock, zmq.NOBLOCK))
            # The FD is edge-triggered: look again on the next loop iteration
            # in case sends consumed the edge while input was queued.
            if not pending[0]:
                pending[0] = True
                loop.call_soon(drain_if_pending)

        def drain_if_pending() -> None:
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                drain()
            else:
                pending[0] = False

        loop.add_reader(fd, drain)
        drain()
        await done.wait()
        loop.remove_reader(fd)
        sock.close(0)
        ctx.term()

    uvloop.run(main())


def serve_tcp() -> None:
    import socket

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    print(f"echo listening on tcp://127.0.0.1:{srv.getsockname()[1]}", flush=True)
    # No SIGTERM handler: the default action ends the process, so the calls
    # below can block without timeouts (no extra poll per recv).
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["blocking", "uvloop", "tcp"], default="blocking")
    p.add_argument("--lean", action="store_true", help="frames via kvmaster._frames")
    a = p.parse_args(argv)
    if a.mode == "tcp":
        serve_tcp()
    else:
        {"blocking": serve_blocking, "uvloop": serve_uvloop}[a.mode](a.lean)
    return 0


if __name__ == "__main__":
    sys.exit(main())
