"""Synchronous kvmaster client with Mooncake Store's method names.

One :class:`Client` holds one DEALER connection to the master, the segment it
contributes (shared memory, owner-only), and mappings of the other segments it
reads or writes.  It is safe to share between threads: a lock serialises use
of the socket, and a call that spans shards keeps all its sub-requests in
flight at once.  A background thread sends heartbeats while the client is
idle and re-handshakes (re-mounting the segment and calling the reconnect
hook) when the master has forgotten it, e.g. after a restart.

The operations themselves live in :mod:`kvmaster._core` and are shared with
:class:`kvmaster.aio.AsyncClient`.  Errors raise the tree in
:mod:`kvmaster.errors`.  Batch calls return one result per position, in order.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import random
import select
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
import zmq

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._frames import NOBLOCK, readable, recv_frames, send_frames
from kvmaster._core import (
    BUSY_FIRST_PAUSE_S,
    BUSY_MAX_PAUSE_S,
    ClientConfig,
    ClientCore,
    KvSessionInfo,
    KvSessionPage,
    OpGen,
    ReplicateConfig,
    Request,
    RoutingChanged,
    Tolerant,
    Welcome,
    op_name,
    operations,
)
from kvmaster.protocol import Op, Status

__all__ = ["Client", "ClientConfig", "KvSessionInfo", "KvSessionPage", "ReplicateConfig"]

log = logging.getLogger(__name__)

_packb = msgpack.Packer(use_bin_type=True).pack
_monotonic = time.monotonic


#: Seconds one HELLO attempt may take while looking for an HA leader.
HA_ATTEMPT_S = 1.0
_RECONNECT = (Status.NOT_REGISTERED, Status.UNAVAILABLE_IN_CURRENT_STATUS)
_BUSY = Status.BUSY


def _reacquire(lock: Any) -> None:
    """Take ``lock`` back even if a signal handler raises while waiting for it (the
    caller's finally releases it); the handler's exception is raised afterwards."""
    exc: BaseException | None = None
    while True:
        try:
            lock.acquire()
            break
        except BaseException as e:  # noqa: BLE001
            exc = exc or e
    if exc is not None:
        raise exc


def _send_request(sock: zmq.Socket, frames: tuple[bytes, bytes, bytes], endpoint: str) -> None:
    """Never block in pyzmq on send either: a full pipe (master gone or stopped) is a
    Timeout of the call, not a hang holding the client's lock."""
    try:
        send_frames(sock, frames, NOBLOCK)
    except zmq.Again:
        raise E.Timeout("send queue to the master is full (master not reading)",
                        endpoint=endpoint) from None


class Client(ClientCore):
    """Synchronous, thread-safe client.  See the module docstring."""

    def __init__(self, config: ClientConfig | None = None) -> None:
        super().__init__(config)
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._last_sent = 0.0
        #: ``select.poll`` on the current socket's FD (made with the socket).
        self._poller: Any = None
        self._hb_thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._connections = itertools.count(1)
        self.on_reconnect: Callable[[Client], None] | None = None

    # ------------------------------------------------------------- lifecycle

    def setup(self, master_server_addr: str | None = None, global_segment_size: int | None = None,
              tenant: str | None = None, *, local_hostname: str | None = None,
              timeout_s: float | None = None, curve_dir: str | None = None,
              curve_client: str | None = None,
              on_reconnect: Callable[[Client], None] | None = None) -> None:
        """Connect, handshake and mount a segment of ``global_segment_size`` bytes
        (0 = consumer only).  ``on_reconnect(client)`` runs after every re-handshake
        (e.g. to re-attach and re-pin sessions).

        Raises VersionMismatch, Timeout (names ``connect_timeout_s``), InvalidParams.
        """
        self._configure(master_server_addr=master_server_addr,
                        global_segment_size=global_segment_size, tenant=tenant,
                        local_hostname=local_hostname, timeout_s=timeout_s, curve_dir=curve_dir,
                        curve_client=curve_client)
        if on_reconnect is not None:
            self.on_reconnect = on_reconnect
        self._ctx = zmq.Context()
        try:
            with self._lock:
                self._connect()
                self._mount()
        except BaseException:
            self.close()  # release the socket, context and segment of the failed setup
            raise
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name=f"kvmaster-heartbeat-{self.client_id}")
        self._hb_thread.start()

    def _connect(self) -> None:
        """New DEALER socket and HELLO (to the current leader with ``etcd://``, retrying
        while an election settles); raises on refusal or timeout."""
        if not self.ha:
            self._connect_once()
            return
        deadline = _monotonic() + self.config.connect_timeout_s
        while True:
            try:
                # Short attempts: the leader key may still name a dead master until
                # its lease runs out.
                self._connect_once(min(self.config.connect_timeout_s, HA_ATTEMPT_S))
                return
            except (E.Unavailable, E.Timeout, E.ConnectionLost):
                if _monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def _connect_once(self, timeout_s: float | None = None) -> None:
        assert self._ctx is not None
        self.endpoint = self._resolve()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self.welcome = None
        sock = self._open_dealer(self._ctx)
        cfg = self.config
        self._sock = sock
        self._poller = select.poll()
        self._poller.register(sock.getsockopt(zmq.FD), select.POLLIN)
        try:
            (body,) = self._exchange([(Op.HELLO.value, P.MASTER_ROUTE, self._hello_fields())],
                                     timeout_s or cfg.connect_timeout_s)
        except E.Timeout:
            raise self._no_welcome() from None
        self.welcome = Welcome(body)

    def _mount(self) -> None:
        seg = self._own_segment()
        if seg is not None:
            self._exchange([(Op.MOUNT_SEGMENT.value, P.MASTER_ROUTE, self._mount_fields(seg))])

    def close(self) -> None:
        """Unmount the segment (its objects are erased), say BYE, release everything."""
        self._closing.set()
        with self._lock:
            if self._sock is not None and self.welcome is not None:
                try:
                    self._exchange([(Op.BYE.value, P.MASTER_ROUTE, [])],
                                   min(2.0, self.config.timeout_s))
                except E.KVMasterError as exc:
                    log.debug("BYE failed: %s", exc)
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
            self.welcome = None
            self._release_segments()
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None
        if self._hb_thread is not None and self._hb_thread is not threading.current_thread():
            self._hb_thread.join(timeout=2)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- plumbing

    def _exchange(self, reqs: list[Request], timeout_s: float | None = None,
                  tolerant: bool = False, app_call: bool = False) -> list[Any]:
        """Send all requests, then collect every reply (matched by req_id).  The first
        non-zero status raises its exception, unless ``tolerant``: then failed slots
        hold their exception (NOT_REGISTERED always raises).

        Requests answered BUSY (nothing was done) are sent again, together, once every
        other reply is in, after a pause of 1 ms doubling to 50 ms (jittered), while the
        deadline leaves the resend room for its answer (``ClientConfig.busy_retry``).
        For an application call (``app_call``) the client's lock is released during the
        pause, so other threads and the heartbeat are not held up; if the connection
        was replaced meanwhile the call raises ConnectionLost."""
        sock = self._sock
        if sock is None:
            raise E.ConnectionLost("client is not connected (call setup)", endpoint=self.endpoint)
        limit = timeout_s if timeout_s is not None else self.config.timeout_s
        ids = self._ids
        if len(reqs) == 1:
            # Most calls: one request, without the bookkeeping of several.
            op, route, fields = reqs[0]
            req_id = next(ids)
            _send_request(sock, (op, route, _packb([req_id, *fields])), self.endpoint)
            self._last_sent = sent_at = now = _monotonic()
            deadline = now + limit
            pause = BUSY_FIRST_PAUSE_S
            while True:
                rid, status, body = self._next_reply(sock, deadline, limit, op)
                if rid != req_id:
                    continue  # a late reply to an earlier, timed-out request
                if not status:
                    return [body]
                if status == _BUSY and self._may_resend(sent_at, pause, deadline, limit):
                    sock = self._busy_pause(sock, pause, app_call)
                    pause = min(pause * 2, BUSY_MAX_PAUSE_S)
                    req_id = next(ids)
                    _send_request(sock, (op, route, _packb([req_id, *fields])), self.endpoint)
                    sent_at = _monotonic()
                    continue
                err = self._error(status, body, op, req_id)
                if not tolerant or err.code in _RECONNECT:
                    raise err
                return [err]
        pending: dict[int, int] = {}
        # Small frames: copying is far cheaper than zero-copy bookkeeping.
        for i, (op, route, fields) in enumerate(reqs):
            req_id = next(ids)
            pending[req_id] = i
            _send_request(sock, (op, route, _packb([req_id, *fields])), self.endpoint)
        self._last_sent = sent_at = now = _monotonic()
        deadline = now + limit
        pause = BUSY_FIRST_PAUSE_S
        out: list[Any] = [None] * len(reqs)
        refused: list[tuple[int, int]] = []  # (slot, req_id) answered BUSY this round
        error: E.RequestError | None = None
        while pending or refused:
            if not pending:
                # Every other reply is in: send the refused ones again, together.
                if not self._may_resend(sent_at, pause, deadline, limit):
                    for i, rid in refused:
                        err = self._error(_BUSY, "the master stayed busy until the timeout",
                                          reqs[i][0], rid)
                        error = error or err
                        out[i] = err
                    break
                sock = self._busy_pause(sock, pause, app_call)
                pause = min(pause * 2, BUSY_MAX_PAUSE_S)
                for i, _ in refused:
                    op, route, fields = reqs[i]
                    req_id = next(ids)
                    pending[req_id] = i
                    _send_request(sock, (op, route, _packb([req_id, *fields])), self.endpoint)
                refused = []
                sent_at = _monotonic()
            req_id, status, body = self._next_reply(
                sock, deadline, limit, reqs[next(iter(pending.values()))][0])
            i = pending.pop(req_id, None)
            if i is None:
                continue  # a late reply to an earlier, timed-out request
            if status:
                if status == _BUSY and self.config.busy_retry:
                    refused.append((i, req_id))
                    continue
                err = self._error(status, body, reqs[i][0], req_id)
                # NOT_REGISTERED (and a standby's refusal) wins: the caller re-handshakes
                # and resends everything.
                if error is None or status in _RECONNECT:
                    error = err
                out[i] = err
            else:
                out[i] = body
        if error is not None and (not tolerant or error.code in _RECONNECT):
            raise error
        return out

    def _busy_pause(self, sock: zmq.Socket, pause: float, app_call: bool) -> zmq.Socket:
        """Sleep before a resend (jittered, so refused clients do not come back in step);
        an application call lets go of the lock meanwhile (nothing of it is in flight).
        Returns the socket to resend on."""
        pause *= random.uniform(0.5, 1.0)
        if not app_call:
            time.sleep(pause)
            return sock
        routing = self._routing()  # the lock is held: the layout of this call
        lock = self._lock
        lock.release()
        try:
            time.sleep(pause)
        finally:
            _reacquire(lock)
        if self._sock is not sock:
            # Reconnected meanwhile (the heartbeat thread): the refused requests were not
            # executed, so they may go out on the new connection, unless it routes keys
            # differently (RoutingChanged: the call is built again).
            if self._sock is None:
                raise E.ConnectionLost("client closed during the call", endpoint=self.endpoint)
            if self.welcome is None:  # the reconnect has not succeeded (yet)
                raise E.ConnectionLost("the connection to the master was lost during the call",
                                       endpoint=self.endpoint)
            self._check_routing(routing)
            sock = self._sock
        return sock

    def _next_reply(self, sock: zmq.Socket, deadline: float, limit: float,
                    op: bytes) -> tuple[int, int, Any]:
        """The next well-formed reply ``(req_id, status, body)``; raises Timeout (naming
        ``op``) at ``deadline``.  Malformed messages are skipped.

        Never blocks inside pyzmq: pyzmq restarts an interrupted blocking receive with
        its whole RCVTIMEO, and an interrupted ``zmq_poll`` with its whole timeout
        (its elapsed time is counted in whole seconds), so a process taking frequent
        signals would wait far past ``deadline`` or forever.  Waits are on the
        socket's FD with :func:`select.poll`, which PEP 475 resumes with the time
        left; ZMQ_FD is edge-triggered, so EVENTS is checked before every wait."""
        while True:
            if readable(sock):
                try:
                    frames = recv_frames(sock, NOBLOCK)
                except zmq.Again:
                    continue
                if len(frames) == 2:
                    try:
                        return P.decode_reply(frames[1])
                    except P.ProtocolError:
                        pass
                continue
            left_ms = math.ceil((deadline - _monotonic()) * 1000)
            if left_ms <= 0:
                raise E.Timeout(f"no reply within {limit:.3g} s", op=op_name(op),
                                endpoint=self.endpoint) from None
            self._poller.poll(left_ms)  # on self._sock's FD, which is ``sock``

    def _error(self, status: int, body: Any, op: bytes, req_id: int) -> E.RequestError:
        return E.error_for(status, body if isinstance(body, str) else str(body),
                           op=op_name(op), req_id=req_id, endpoint=self.endpoint)

    def _drive(self, gen: OpGen) -> Any:
        """Run one operation generator to completion over this client's socket."""
        # The heartbeat thread may be reconnecting: wait for it no longer than the
        # call's own timeout.
        # An uncontended lock is taken without the (slower) timed acquire.
        if not self._lock.acquire(False) and not self._lock.acquire(timeout=self.config.timeout_s):
            gen.close()
            raise E.Timeout(f"client busy reconnecting for {self.config.timeout_s:.3g} s",
                            endpoint=self.endpoint)
        try:
            try:
                reqs = next(gen)
                while True:
                    try:
                        tolerant = type(reqs) is Tolerant
                        try:
                            bodies = self._exchange(reqs, None, tolerant, True)
                        except (E.NotRegistered, E.Unavailable):
                            before = self._routing()
                            self._rehandshake()
                            self._check_routing(before)
                            bodies = self._exchange(reqs, None, tolerant, True)
                        except E.TransportError:
                            if not self.ha:
                                raise
                            # The leader may have died: find the new one, retry once.
                            before = self._routing()
                            self._rehandshake()
                            self._check_routing(before)
                            bodies = self._exchange(reqs, None, tolerant, True)
                    except E.RequestError as exc:
                        reqs = gen.throw(exc)
                        continue
                    reqs = gen.send(bodies)
            except StopIteration as stop:
                return stop.value
        finally:
            self._lock.release()

    def _rehandshake(self) -> None:
        """The master does not know us (restart or expiry): HELLO again, remount, hook."""
        log.warning("master %s forgot client %s; re-handshaking", self.endpoint, self.client_id)
        self._connect()
        self._mount()
        self.reconnect_count += 1
        hook = self.on_reconnect
        if hook is not None:
            try:
                hook(self)
            except Exception:  # noqa: BLE001 - an application hook must not break the client
                log.exception("on_reconnect hook failed")

    def _heartbeat_loop(self) -> None:
        backoff = 0.1
        pause = 0.0
        while not self._closing.is_set():
            if pause:
                # Back off outside the lock so calls can run (and time out) meanwhile.
                if self._closing.wait(pause):
                    return
                pause = 0.0
            w = self.welcome
            interval = (w.client_ttl_ms / 1000 / P.HEARTBEAT_LIVENESS) if w else 1.0
            if self._closing.wait(min(interval, 1.0)):
                return
            if _monotonic() - self._last_sent < interval:
                continue
            if not self._lock.acquire(timeout=interval):
                continue
            try:
                if self._closing.is_set():
                    return
                try:
                    if self.welcome is None or self._sock is None:
                        # A reconnect failed earlier (e.g. a partition): finish it.
                        self._rehandshake()
                    else:
                        self._exchange([(Op.HEARTBEAT.value, P.MASTER_ROUTE, [])],
                                       min(self.config.timeout_s, max(interval, 0.5)))
                    backoff = 0.1
                except (E.NotRegistered, E.Unavailable):
                    self._rehandshake()
                except E.TransportError:
                    # Master silent: try a fresh connection, doubling the wait.
                    try:
                        self._rehandshake()
                        backoff = 0.1
                    except E.KVMasterError:
                        backoff = min(backoff * 2, self.config.reconnect_max_backoff_s)
                        pause = backoff
            except Exception:  # noqa: BLE001 - keep beating
                log.exception("heartbeat failed")
            finally:
                self._lock.release()

    # Raw access for tests and tools that speak the protocol directly.

    def _call(self, op: bytes, route: bytes, fields_after_id: list[Any]) -> Any:
        """One raw request, with the usual re-handshake; returns the body or raises."""
        def one() -> OpGen:
            (body,) = yield [(op, route, list(fields_after_id))]
            return body

        return self._drive(one())

    def _require(self) -> Welcome:
        return self._welcome()

    def _get_desc(self, key: str) -> tuple[list[Any], float]:
        """-> ``([size, replicas], lease deadline)`` after a GET_REPLICA_LIST."""
        size, replicas, deadline = self._drive(self._desc(key))
        return [size, replicas], deadline

    def iter_kv_session_keys(self, session_id: str, page: int = 1024) -> Iterable[str]:
        """Every member, page by page."""
        cursor = ""
        while True:
            p = self.list_kv_session_keys(session_id, cursor, page)
            yield from p.keys
            if not p.next_cursor:
                return
            cursor = p.next_cursor


def _sync(fn: Callable[..., OpGen]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def method(self: Client, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._drive(fn(self, *args, **kwargs))
        except RoutingChanged:
            # Built again for the new layout; the old requests were never applied.
            return self._drive(fn(self, *args, **kwargs))

    return method


for _name, _fn in operations(ClientCore).items():
    setattr(Client, _name, _sync(_fn))
del _name, _fn
