"""Cross-host data path: a client's transfer service and the matching fetcher.

A client that contributes a segment runs a :class:`TransferService`: a ROUTER
socket on its own thread that reads and writes ranges of that segment for
clients on other hosts.  Same-host clients map the segment file instead and
never use it.  Reads are sent straight out of the shared mapping
(``copy=False``: no copy into the message); writes land in the mapping from
the received frame.

Frames (DEALER -> ROUTER)::

    [b"R", segment, offset(8 bytes BE), size(8 bytes BE)]        -> [b"\\x00", data]
    [b"W", segment, offset(8 bytes BE), data]                   -> [b"\\x00"]
    [b"S", segment]                                             -> [b"\\x00", size(8 bytes BE)]

``S`` reports the size of the segment served: a client checks it against the
size the segment was mounted with before its first transfer to or from it (a
service whose segment is smaller than its mount claimed is not used).

An error answers ``[b"\\x01", message]``.  Ranges are checked against the
segment's size.  With CURVE on, the service uses its client's key pair and
admits only the public keys in the key directory's ``clients/``; without
CURVE it serves whoever connects, so it is off unless the client sets
``transfer_host``.  The service does not check which ranges the master
granted a peer: an admitted peer is trusted like a same-host client that can
map the segment file.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from kvmaster._segment import Segment

__all__ = ["TransferError", "TransferPeer", "TransferService"]

log = logging.getLogger(__name__)

_OK = b"\x00"
_ERR = b"\x01"


class TransferError(OSError):
    """A remote read or write failed (peer gone, link cut, bad range)."""


def _u64(b: bytes) -> int:
    return int.from_bytes(b, "big")


def _b64(n: int) -> bytes:
    return n.to_bytes(8, "big")


class TransferService:
    """Serves one segment's ranges on ``tcp://<bind>:<port>`` from a daemon thread."""

    def __init__(self, ctx: zmq.Context, segment: Segment, bind_host: str,
                 curve: tuple[bytes, bytes] | None = None,
                 allowed_keys_dir: str | None = None) -> None:
        self.segment = segment
        self._ctx = ctx
        self._auth = None
        if curve is not None:
            # Only peers holding a client key of the cluster may connect.
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=allowed_keys_dir or "/nonexistent")
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, segment.size + 4096)
        if curve is not None:
            self._sock.curve_publickey, self._sock.curve_secretkey = curve
            self._sock.curve_server = True
        self._sock.bind(f"tcp://{bind_host}:0")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = ctx.socket(zmq.PAIR)
        self._stop_addr = f"inproc://kvmaster-transfer-stop-{id(self)}"
        self._stop.bind(self._stop_addr)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvmaster-transfer-{segment.name}")
        self.served = 0

    def start(self) -> str:
        self._thread.start()
        return self.endpoint

    def _run(self) -> None:
        stop = self._ctx.socket(zmq.PAIR)
        stop.connect(self._stop_addr)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        sock = self._sock
        seg = self.segment
        try:
            while True:
                events = dict(poller.poll())
                if stop in events:
                    return
                frames = sock.recv_multipart(copy=False)
                peer = frames[0].bytes
                try:
                    reply = self._serve(seg, frames[1:])
                except (ValueError, IndexError) as exc:
                    reply = [_ERR, str(exc).encode()]
                self.served += 1  # before the answer, so a peer that got it sees the count
                sock.send_multipart([peer, *reply], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:
                log.exception("transfer service failed")
        finally:
            stop.close(linger=0)

    @staticmethod
    def _serve(seg: Segment, frames: list[Any]) -> list[Any]:
        kind = frames[0].bytes
        if frames[1].bytes.decode(errors="replace") != seg.name:
            raise ValueError(f"segment {frames[1].bytes!r} is not served here")
        if kind == b"S":
            return [_OK, _b64(seg.size)]
        off = _u64(frames[2].bytes)
        if kind == b"R":
            size = _u64(frames[3].bytes)
            if off + size > seg.size:
                raise ValueError("range beyond the segment")
            return [_OK, seg.buf[off:off + size]]
        if kind == b"W":
            data = frames[3].buffer
            if off + data.nbytes > seg.size:
                raise ValueError("range beyond the segment")
            seg.buf[off:off + data.nbytes] = data
            return [_OK]
        raise ValueError(f"unknown transfer op {kind!r}")

    def close(self) -> None:
        if self._thread.is_alive():
            self._stop.send(b"")
            self._thread.join(timeout=2)
        self._stop.close(linger=0)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class TransferPeer:
    """A DEALER connection to one remote transfer service (one request at a time)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout_s: float,
                 curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = ctx
        self._curve = curve
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                s.curve_publickey, s.curve_secretkey, s.curve_serverkey = self._curve
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def _ask(self, frames: list[Any]) -> list[zmq.Frame]:
        with self._lock:
            sock = self._socket()
            sock.send_multipart(frames, copy=False)
            if not sock.poll(self.timeout_ms):
                # The link or the peer is gone: drop the socket so a late answer can
                # never be taken for the next request's.
                sock.close(linger=0)
                self._sock = None
                raise TransferError(f"no answer from {self.endpoint} within "
                                    f"{self.timeout_ms} ms")
            reply = sock.recv_multipart(copy=False)
        if reply[0].bytes != _OK:
            raise TransferError(f"{self.endpoint}: {reply[1].bytes.decode(errors='replace')}")
        return reply

    def read_into(self, segment: str, offset: int, size: int, dst: memoryview) -> None:
        reply = self._ask([b"R", segment.encode(), _b64(offset), _b64(size)])
        data = reply[1].buffer
        if data.nbytes != size:
            raise TransferError(f"{self.endpoint}: short read ({data.nbytes} of {size})")
        dst[:size] = data

    def read(self, segment: str, offset: int, size: int) -> bytes:
        reply = self._ask([b"R", segment.encode(), _b64(offset), _b64(size)])
        data = reply[1].bytes
        if len(data) != size:
            raise TransferError(f"{self.endpoint}: short read ({len(data)} of {size})")
        return data

    def size(self, segment: str) -> int:
        """The size of ``segment`` as its service reports it, bytes."""
        reply = self._ask([b"S", segment.encode()])
        if len(reply) != 2 or len(reply[1].bytes) != 8:
            raise TransferError(f"{self.endpoint}: malformed size answer")
        return _u64(reply[1].bytes)

    def write(self, segment: str, offset: int, parts: list[Any]) -> None:
        data = parts[0] if len(parts) == 1 else b"".join(bytes(p) for p in parts)
        self._ask([b"W", segment.encode(), _b64(offset), data])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
