"""Shard actors in their own processes (``kvmaster master --shard-processes``).

The actor code is the same as in-process; only the transport of its inbox
changes.  Each shard process binds one PULL socket (``ipc://DIR/shard-<i>``)
that receives, in order per sender, client requests forwarded by the front
and internal messages from the front or from other shards.  It sends replies
and answers to the front's PULL socket (``ipc://DIR/front``) and internal
messages to its peers through one PUSH socket per peer, so messages between
two actors keep their order, as the session walks require.

Frames (all multipart):

* ``[b"R", identity, op, payload, group]``: a client request (front -> shard);
  ``group`` is its reply group as ASCII digits, "0" for none.
* ``[b"r" + group (8 bytes) + len(identity) (1 byte) + identity + op (1 byte) +
  payload]``: the same in one frame, used whenever the identity is at most 255
  bytes and the op one byte (always, for well-formed clients): one frame costs
  the front a third of the ZeroMQ calls of five.
* ``[b"I", method, msgpack(args), future_id]``: an internal message; a non-zero
  ``future_id`` asks for ``[b"F", future_id, msgpack([ok, result])]`` back.
* ``[b"C", identity, client_id, tenant]`` / ``[b"X", identity]``: a client
  registered with / left the front (shards keep a view of each client).
* ``[b"Q"]``: stop.

Replies from a shard carry its index: ``[b"R", identity, op, payload, index,
group]`` or ``[b"r" + index (2 bytes) + group (8 bytes) + len(identity) +
identity + op + payload]``.  The front forwards the reply undecoded, alone or in
its group's message (see ``Front.groups``): a client's request message of
several requests (protocol 1.2) is answered in one message.

Coalescing: a message whose first frame starts with ``b"r"`` is a list of
one-frame envelopes, one per frame.  The front queues the requests it reads in
one pass over the ROUTER and sends each shard's queue as one message (at most
:data:`COALESCE_MAX` envelopes) when the ROUTER is empty, every 16 requests
read, and before any other message to that shard; a shard process sends the
replies of one drain of its inbox the same way, before any other message to the
front; a reply waits only for short requests, and at most
:data:`COALESCE_WAIT_S` plus one of them.  Order per channel is kept, and no
payload is decoded.  Each ZeroMQ message costs the front a wake-up of its I/O
thread and a system call or two, more than the Python that builds it, so under
load a shard gets several requests for the price of one.
"""


from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from kvmaster import protocol as P
from kvmaster._frames import NOBLOCK, readable, recv_frames, send_frames
from kvmaster.config import MasterConfig

log = logging.getLogger(__name__)

COALESCE_MAX = 64
"""Most envelopes in one coalesced message (front -> shard and shard -> front)."""

COALESCE_WAIT_S = 0.0002
"""A shard process holds a reply for the others of the same drain only while less
than this long (s) has passed since the first, and only for requests that are short
(see ``COALESCE_NEXT_MAX``); the front holds a request at most until it has read 16
more."""

COALESCE_NEXT_MAX = 1024
"""Largest payload (bytes) of a request a held reply may wait for: at most about 340
keys of one byte, a few dozen real ones (8 KiB let a batch of 1,800 two-byte keys
hold a fast reply 1.5 ms)."""

_SHORT_OPS = frozenset(op.value for op in P.Op
                       if b"\x10" <= op.value <= b"\x20" and op is not P.Op.REMOVE_ALL)

_packb = msgpack.Packer(use_bin_type=True).pack


def _unpack(b: bytes) -> Any:
    return msgpack.unpackb(b, raw=False, use_list=True, strict_map_key=False)


def _to_wire(v: Any) -> Any:
    """Make results msgpack-friendly (sets become sorted lists)."""
    if isinstance(v, (set, frozenset)):
        return sorted(_to_wire(x) for x in v)
    if isinstance(v, dict):
        return {k: _to_wire(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_to_wire(x) for x in v]
    return v


#: Head of a one-frame envelope from the front (a shard process's own adds its index).
ENVELOPE = b"r"


def pack_envelope(head: bytes, group: int, identity: bytes, op: bytes, payload: bytes) -> bytes:
    """A client request or reply in one frame: ``head`` (:data:`ENVELOPE`, plus the
    shard's index in 2 bytes from a shard process), ``group`` in 8 bytes, the identity
    after its length (1 byte), the op (1 byte) and the payload.  Only for an identity
    of at most 255 bytes and a one-byte op (:func:`fits_envelope`)."""
    return b"".join((head, group.to_bytes(8, "big"), len(identity).to_bytes(1, "big"),
                     identity, op, payload))


def unpack_envelope(frame: bytes, start: int) -> tuple[bytes, bytes, bytes, int]:
    """The ``(identity, op, payload, group)`` of :func:`pack_envelope`'s frame whose head
    is ``start`` bytes long (1 from the front, 3 from a shard process)."""
    end = start + 9 + frame[start + 8]
    return (frame[start + 9:end], frame[end:end + 1], frame[end + 1:],
            int.from_bytes(frame[start:start + 8], "big"))


def fits_envelope(identity: bytes, op: bytes) -> bool:
    """Whether a request or reply goes in one frame (:func:`pack_envelope`)."""
    return len(identity) < 256 and len(op) == 1


class PeerLink:
    """Inside a shard process: another shard, reachable by ``post`` only."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.inbox = ()

    def post(self, method: str, args: tuple[Any, ...], future: Any = None) -> None:
        send_frames(self.sock, (b"I", method.encode(), _packb(_to_wire(args)), b"0"))


class RemoteShard:
    """In the front: a shard process, with the same ``deliver``/``post`` surface as a
    :class:`~kvmaster._shard.ShardActor`.  The inbox bound is enforced here by counting
    requests forwarded and not yet answered."""

    #: No op log: ``--ha-oplog`` refuses ``--shard-processes`` (ShardRef ``log``).
    log: None = None

    def __init__(self, index: int, sock: zmq.Socket, limit: int) -> None:
        self.index = index
        self.sock = sock
        self.limit = limit
        self.in_flight = 0
        # Requests queued for the next coalesced send; the front's read loop sees a
        # non-empty inbox as work and calls ``drain``, which sends them.
        self.inbox: list[bytes] = []
        self.futures: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)

    def deliver(self, envelope: tuple[Any, ...]) -> bool:
        if self.in_flight >= self.limit:
            return False
        op, payload, client = envelope
        self.in_flight += 1
        identity = client.identity
        if fits_envelope(identity, op):
            queued = self.inbox
            queued.append(pack_envelope(ENVELOPE, client.group, identity, op, payload))
            if len(queued) >= COALESCE_MAX:
                self.drain()
        else:
            self.drain()
            self.sock.send_multipart((b"R", identity, op, payload, str(client.group).encode()))
        return True

    def drain(self) -> None:
        """Send the queued requests as one message (the front calls this when its
        ROUTER is empty, every 16 requests read, and before any other send here)."""
        queued = self.inbox
        if queued:
            self.inbox = []
            send_frames(self.sock, queued)

    def post(self, method: str, args: tuple[Any, ...], future: Any = None) -> None:
        self.drain()
        fid = 0
        if future is not None:
            fid = next(self._ids)
            self.futures[fid] = future
        self.sock.send_multipart((b"I", method.encode(), _packb(_to_wire(args)),
                                  str(fid).encode()))

    def register_client(self, identity: bytes, client_id: str, tenant: str) -> None:
        self.drain()
        self.sock.send_multipart((b"C", identity, client_id.encode(), tenant.encode()))

    def forget_client(self, identity: bytes) -> None:
        self.drain()
        self.sock.send_multipart((b"X", identity))


class ShardProcesses:
    """Starts, links and stops the shard processes of one master (the process
    counterpart of :class:`~kvmaster._shardref.LocalShards`)."""

    #: Requests are sent to other processes (the front sends what it queued for them
    #: every 16 requests read; a batch goes to its keys' shards).
    remote = True

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.ctx: zmq.Context | None = None
        self.dir = ""
        self.procs: list[multiprocessing.process.BaseProcess] = []
        #: The front's PULL socket for the shards' replies and answers (from :meth:`start`).
        self.pull: zmq.Socket | None = None
        self.shards: list[RemoteShard] = []

    def start(self, ctx: zmq.Context, timeout_s: float = 30.0) -> list[RemoteShard]:
        """Start the processes, link them and wait until each is ready; -> the shards."""
        self.ctx = ctx
        self.dir = tempfile.mkdtemp(prefix="kvmaster-ipc-")
        os.chmod(self.dir, 0o700)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.bind(f"ipc://{self.dir}/front")
        mp = multiprocessing.get_context("spawn")
        n = self.config.shard_count
        for i in range(n):
            p = mp.Process(target=shard_process_main, args=(i, self.config, self.dir),
                           name=f"kvmaster-shard-{i}", daemon=True)
            p.start()
            self.procs.append(p)
        ready: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(ready) < n:
            dead = [p.name for p in self.procs if p.exitcode is not None]
            if dead:  # e.g. a terminal's SIGINT reached them while they were importing
                raise RuntimeError(f"shard processes exited during start-up: {dead}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"shard processes not ready within {timeout_s} s")
            if not self.pull.poll(int(min(left, 0.1) * 1000)):  # (ms; pyzmq int()s a float)
                continue
            frames = self.pull.recv_multipart()
            if frames[0] == b"READY":
                ready.add(int(frames[1]))
        for i in range(n):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(f"ipc://{self.dir}/shard-{i}")
            self.shards.append(RemoteShard(i, sock, self.config.shard_inbox))
        return self.shards

    def fd(self) -> int:
        """The file descriptor of the front's socket for the shards' messages, once
        started (edge-triggered, as any zmq socket's)."""
        assert self.pull is not None
        return int(self.pull.getsockopt(zmq.FD))

    def register_client(self, identity: bytes, client_id: str, tenant: str) -> None:
        """Tell every shard process of a client registered with the front."""
        for shard in self.shards:
            shard.register_client(identity, client_id, tenant)

    def forget_client(self, identity: bytes) -> None:
        """Tell every shard process that a client left the front."""
        for shard in self.shards:
            shard.forget_client(identity)

    def on_readable(self, send_reply: Callable[..., None]) -> int:
        """Forward everything the shards sent; returns how many messages."""
        pull = self.pull
        n = 0
        if pull is None:  # stopped
            return n
        while readable(pull):
            try:
                frames = recv_frames(pull, NOBLOCK)
            except zmq.Again:
                break
            n += 1
            kind = frames[0][:1]
            if kind == ENVELOPE:
                shard = self.shards[int.from_bytes(frames[0][1:3], "big")]
                shard.in_flight = max(0, shard.in_flight - len(frames))
                for frame in frames:
                    send_reply(*unpack_envelope(frame, 3))
            elif frames[0] == b"R":
                sender = self.shards[int(frames[4])] if len(frames) > 4 else None
                if sender is not None:
                    sender.in_flight = max(0, sender.in_flight - 1)
                send_reply(frames[1], frames[2], frames[3], int(frames[5]))
            elif kind == b"F":
                shard = self.shards[int(frames[3])]
                fut = shard.futures.pop(int(frames[1]), None)
                ok, result = _unpack(frames[2])
                if fut is not None and not fut.done():
                    if ok:
                        fut.set_result(result)
                    else:
                        fut.set_exception(RuntimeError(result))
        return n

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the processes (killed after ``timeout_s``) and close the sockets; once."""
        if self.pull is None:
            if self.dir:  # (start-up failed before the front's socket was bound)
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = ""
            return
        for shard in self.shards:
            try:
                shard.sock.send_multipart((b"Q",), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1)
        for shard in self.shards:
            shard.sock.close(linger=0)
        self.pull.close(linger=0)
        self.pull = None
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = ""


def shard_process_main(index: int, config: MasterConfig, ipc_dir: str) -> None:
    """Entry point of one shard process: a blocking loop over its PULL socket."""
    from kvmaster._shard import ClientView, ShardActor
    from kvmaster._process import tune_gc

    tune_gc(config.gc_threshold)
    # The front owns shutdown; a terminal's SIGINT must not kill shards first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    _die_with_parent()

    def on_term(signum: int, _frame: Any) -> None:
        # The death signal of a master killed outright (SIGKILL): nobody else will
        # remove the ipc directory.  It comes while the master's threads exit, before
        # this process is given another parent, so wait (up to 1 s) to tell it from a
        # SIGTERM sent while the master lives.  Then die of the signal, as without a
        # handler.
        for _ in range(100):
            if os.getppid() != parent:
                shutil.rmtree(ipc_dir, ignore_errors=True)
                break
            time.sleep(0.01)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        from kvmaster.logging_setup import configure_logging_from_config

        configure_logging_from_config(config)
    except ImportError:  # pragma: no cover - the module ships with the package
        logging.basicConfig(level=config.log_level.upper())
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(f"ipc://{ipc_dir}/shard-{index}")
    front = ctx.socket(zmq.PUSH)
    front.setsockopt(zmq.SNDHWM, 0)
    front.connect(f"ipc://{ipc_dir}/front")
    tag = str(index).encode()

    head = ENVELOPE + index.to_bytes(2, "big")
    replies: list[bytes] = []
    clock = time.perf_counter
    first = 0.0  # when the oldest queued reply was queued

    def flush() -> None:
        if replies:
            send_frames(front, replies)
            replies.clear()

    def reply(identity: bytes, op: bytes, payload: bytes, group: int) -> None:
        nonlocal first
        if fits_envelope(identity, op):
            replies.append(pack_envelope(head, group, identity, op, payload))
            if len(replies) == 1:
                first = clock()
            elif len(replies) >= COALESCE_MAX or clock() - first > COALESCE_WAIT_S:
                flush()
        else:
            flush()
            front.send_multipart((b"R", identity, op, payload, tag, str(group).encode()))

    actor = ShardActor(index, config.shard_count, config, reply)

    def between() -> None:
        # Queued replies wait for the next request only if it is short: an object op of
        # at most COALESCE_NEXT_MAX payload bytes, started within COALESCE_WAIT_S of
        # the first reply (not REMOVE_ALL, a session op or an internal message).
        if not replies:
            return
        inbox = actor.inbox
        if inbox:
            nxt = inbox[0]
            if clock() - first <= COALESCE_WAIT_S and type(nxt[0]) is bytes \
                    and nxt[0] in _SHORT_OPS and len(nxt[1]) <= COALESCE_NEXT_MAX:
                return
        flush()

    actor.between = between
    peers: list[Any] = []
    for j in range(config.shard_count):
        if j == index:
            peers.append(actor)
            continue
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(f"ipc://{ipc_dir}/shard-{j}")
        peers.append(PeerLink(s))
    actor.peers = peers
    views: dict[bytes, ClientView] = {}

    def take(identity: bytes, op: bytes, payload: bytes, group: int) -> None:
        """Queue a client request for the actor (NOT_REGISTERED if the front has not
        told this process of the client)."""
        view = views.get(identity)
        if view is None:
            reply(identity, op, P.encode_reply(P.peek_req_id(payload), P.Status.NOT_REGISTERED,
                                               "send HELLO before other requests"), group)
        else:
            actor.inbox.append((op, payload, view.grouped(group) if group else view))
    front.send_multipart((b"READY", tag))
    running = True
    # Blocking reads with a timeout: no poll() and no EAGAIN per message; the
    # timeout only serves to notice a vanished master.
    pull.setsockopt(zmq.RCVTIMEO, 1000)
    while running:
        try:
            frames = recv_frames(pull)
        except zmq.Again:
            if os.getppid() != parent:
                # The master died without stopping us (SIGKILL): nobody will.
                log.error("[shard %d] master gone; exiting", index)
                shutil.rmtree(ipc_dir, ignore_errors=True)
                break
            continue
        kind = frames[0][:1]
        if kind == ENVELOPE:
            for frame in frames:
                take(*unpack_envelope(frame, 1))
        elif kind == b"R":
            take(frames[1], frames[2], frames[3], int(frames[4]))
        elif kind == b"I":
            method = frames[1].decode()
            fid = int(frames[3])
            args = _unpack(frames[2])
            actor.inbox.append((method, tuple(args), _Answer(flush, front, fid, tag) if fid else None))
        elif kind == b"C":
            views[frames[1]] = ClientView(frames[2].decode(), frames[3].decode(), frames[1])
        elif kind == b"X":
            views.pop(frames[1], None)
        elif kind == b"Q":
            running = False
        if actor.inbox:
            actor.drain()
        flush()
    for s in peers:
        if isinstance(s, PeerLink):
            s.sock.close(linger=1000)
    front.close(linger=1000)
    pull.close(linger=0)
    ctx.term()


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class _Answer:
    """Future-like object that sends an internal call's result back to the front."""

    __slots__ = ("flush", "front", "fid", "tag", "_done")

    def __init__(self, flush: Callable[[], None], front: zmq.Socket, fid: int, tag: bytes) -> None:
        self.flush = flush  # replies queued before this answer go first
        self.front = front
        self.fid = fid
        self.tag = tag
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, result: Any) -> None:
        self._done = True
        self.flush()
        self.front.send_multipart((b"F", str(self.fid).encode(), _packb([True, _to_wire(result)]),
                                   self.tag))

    def set_exception(self, exc: BaseException) -> None:
        self._done = True
        self.flush()
        self.front.send_multipart((b"F", str(self.fid).encode(),
                                   _packb([False, f"{type(exc).__name__}: {exc}"]), self.tag))
