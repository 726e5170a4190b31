"""Synchronous kvmaster client with Mooncake Store's method names.

One :class:`Client` holds one DEALER connection to the master, the segment it
contributes (shared memory, owner-only), and mappings of the other segments it
reads or writes.  It is safe to share between threads: a lock serialises use
of the socket, and a call that spans shards keeps all its sub-requests in
flight at once.  A background thread sends heartbeats while the client is
idle and re-handshakes (re-mounting the segment and calling the reconnect
hook) when the master has forgotten it, e.g. after a restart.

Each call has one deadline, ``ClientConfig.timeout_s`` after it starts: waiting
for the client's lock, every round trip (a put's start, a segment lookup and its
end; the pages of a session update), the pauses before resending what the master
refused BUSY, taking the lock back after such a pause, and a re-handshake the
call makes all count against it; past it the call raises ``Timeout``.  See
:meth:`Client._drive` for what is not bounded by it.

The operations themselves live in :mod:`kvmaster._core` and are shared with
:class:`kvmaster.aio.AsyncClient`.  Errors raise the tree in
:mod:`kvmaster.errors`.  Batch calls return one result per position, in order.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import random
import select
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from kvmaster import _device
from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._frames import (
    LINK_LOST,
    NOBLOCK,
    LinkMonitor,
    readable,
    recv_frames,
    send_frames,
)
from kvmaster._core import (
    BUSY_FIRST_PAUSE_S,
    BUSY_MAX_PAUSE_S,
    MAX_PARTING,
    PARTING_RETRY_S,
    ClientConfig,
    ClientCore,
    master_changed,
    rehandshake_reason,
    KvSessionInfo,
    KvSessionPage,
    NoWait,
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


_BUSY = Status.BUSY
_UNSET = object()


def ha_reserve(timeout_s: float) -> float:
    """With HA, the part of a call's timeout (s) a round leaves for a failover: a
    quarter, at most HA_ATTEMPT_S."""
    return min(HA_ATTEMPT_S, timeout_s / 4)


def _send_request(sock: zmq.Socket[Any], frames: Sequence[bytes], endpoint: str) -> None:
    """Never block in pyzmq on send either: a full pipe (master gone or stopped) is a
    Timeout of the call, not a hang holding the client's lock."""
    try:
        send_frames(sock, frames, NOBLOCK)
    except zmq.Again:
        raise E.Timeout("send queue to the master is full (master not reading)",
                        endpoint=endpoint) from None


if TYPE_CHECKING:  # the operations' real signatures (tools/gen_client_types.py)
    from kvmaster._client.typed_sync import Client as _Operations
else:
    _Operations = ClientCore


class Client(_Operations):
    """Synchronous, thread-safe client.  See the module docstring."""

    def __init__(self, config: ClientConfig | None = None) -> None:
        #: Replies received in a message of several and not yet taken (protocol 1.2).
        self._stash: collections.deque[tuple[int, int, Any]] = collections.deque()
        super().__init__(config)
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._last_sent = 0.0
        #: ``select.poll`` on the current socket's FD and its monitor's (made with the
        #: socket).
        self._poller: Any = None
        #: The current socket's monitor: its TCP or ipc connection to the master closing
        #: while a call waits ends the call (see :meth:`_next_reply`).
        self._link: LinkMonitor | None = None
        #: The connection closed since the requests being waited for were sent.
        self._link_down = False
        self._hb_thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._connections = itertools.count(1)
        #: Requests of NoWait rounds (failed puts' revokes) to send: ``(due, request,
        #: first sent, next pause)``; whoever holds the lock sends those due (a call
        #: at its start, the heartbeat thread).  Appended to without the lock by a
        #: call that could not take it back after a BUSY pause.
        self._parting: collections.deque[tuple[float, Request, float, float]] = \
            collections.deque(maxlen=MAX_PARTING)
        #: req_id -> ``(request, first sent, next pause, sent)`` of those sent, until
        #: answered.
        self._parting_sent: dict[int, tuple[Request, float, float, float]] = {}
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

    def _connect(self, deadline: float | None = None) -> None:
        """New DEALER socket and HELLO (to the current leader with ``etcd://``, retrying
        while an election settles) within ``connect_timeout_s`` and, when given,
        ``deadline`` (``time.monotonic()``); raises on refusal or timeout."""
        limit = self.config.connect_timeout_s
        end = _monotonic() + limit
        if deadline is not None:
            end = min(end, deadline)
        if not self.ha:
            self._connect_once(end - _monotonic())
            return
        started = _monotonic()
        while True:
            try:
                # Short attempts: the leader key may still name a dead master until
                # its lease runs out.
                self._connect_once(min(limit, HA_ATTEMPT_S, end - _monotonic()))
                return
            except (E.Unavailable, E.ShuttingDown, E.Timeout, E.ConnectionLost) as exc:
                if _monotonic() + 0.05 >= end:
                    final = self._hello_gave_up(exc, started)
                    if final is exc:
                        raise
                    raise final from exc
                time.sleep(0.05)

    def _connect_once(self, timeout_s: float) -> None:
        assert self._ctx is not None
        if timeout_s <= 0:
            raise self._no_welcome(timeout_s)
        self.endpoint = self._resolve(timeout_s)
        self._close_socket()
        self.welcome = None
        sock, self._link = self._open_dealer(self._ctx, self._ctx)
        self._sock = sock
        self._stash.clear()
        self._poller = select.poll()
        self._poller.register(sock.getsockopt(zmq.FD), select.POLLIN)
        if self._link is not None:
            self._poller.register(self._link.socket.getsockopt(zmq.FD), select.POLLIN)
        try:
            (body,) = self._exchange([(Op.HELLO.value, P.MASTER_ROUTE, self._hello_fields())],
                                     timeout_s)
        except E.Timeout:
            raise self._no_welcome(timeout_s) from None
        self._welcomed(body)

    def _close_socket(self) -> None:
        """Close the DEALER and its monitor (left open, the monitor would make the
        context's term() wait for ever)."""
        if self._link is not None:
            self._link.close()
            self._link = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _disconnected(self) -> bool:
        """True if the connection to the master closed since the requests being waited
        for were sent (see :meth:`kvmaster._frames.LinkMonitor.lost`)."""
        link = self._link
        if link is not None and link.lost():
            self._link_down = True
        return self._link_down

    def _before_send(self) -> None:
        """Read the monitor's events before a send with nothing in flight: a disconnect
        before it says nothing of the requests it sends, which the socket queues until
        it reconnects (a master restarted on the endpoint then answers NOT_REGISTERED,
        and the call re-handshakes)."""
        link = self._link
        if link is not None:
            link.lost()
        self._link_down = False

    def _mount(self, deadline: float | None = None) -> None:
        seg = self._own_segment()
        if seg is not None:
            self._exchange([(Op.MOUNT_SEGMENT.value, P.MASTER_ROUTE, self._mount_fields(seg))],
                           deadline=deadline)
            if self._segment_label:  # (label_segment's, for this new mount)
                try:
                    self._exchange(self._label_requests(seg.name, self._segment_label),
                                   deadline=deadline)
                except E.KVMasterError as exc:
                    log.warning("segment %s not labelled %r again: %s", seg.name,
                                self._segment_label, exc)

    def _remount(self, deadline: float | None = None) -> None:
        """Mount the segment again after a re-handshake.  A refusal is retried
        MOUNT_ATTEMPTS times with growing pauses (each logged and counted: see
        :meth:`_mount_refused`), then the segment is replaced by a fresh one under a new
        name, mounted once; a refusal of that one is raised (the client stays
        registered, contributing no segment, until its next re-handshake).  Pauses end
        by ``deadline``: a refusal that leaves no room for the next attempt is raised."""
        attempt = 0
        while True:
            attempt += 1
            try:
                self._mount(deadline)
                return
            except E.KVMasterError as exc:
                pause = self._mount_refused(exc, attempt)
                if pause is None or (deadline is not None
                                     and _monotonic() + pause >= deadline):
                    raise
                if not pause:
                    break
            time.sleep(pause)
        self._fresh_segment()
        self._mount(deadline)

    def close(self) -> None:
        """Unmount the segment (its objects are erased), say BYE, release everything."""
        self._closing.set()
        with self._lock:
            if self._parting and self._sock is not None:
                self._tend_parting()
            if self._sock is not None and self.welcome is not None:
                try:
                    self._exchange([(Op.BYE.value, P.MASTER_ROUTE, [])],
                                   min(2.0, self.config.timeout_s))
                except E.KVMasterError as exc:
                    log.debug("BYE failed: %s", exc)
            self._close_socket()
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
                  tolerant: bool = False, app_call: bool = False,
                  deadline: float | None = None, phases: list[float] | None = None
                  ) -> list[Any]:
        """Send all requests, then collect every reply (matched by req_id).  The first
        non-zero status raises its exception, unless ``tolerant``: then failed slots
        hold their exception (NOT_REGISTERED always raises).

        Replies are awaited until ``deadline`` (``time.monotonic()``; an application
        call's deadline, set once for all its rounds), else for ``timeout_s`` from the
        send (default ``ClientConfig.timeout_s``; HELLO, heartbeats and BYE have their
        own).  With a ``deadline`` already past nothing is sent (Timeout).

        Requests answered BUSY (nothing was done) are sent again, together, once every
        other reply is in, after a pause of 1 ms doubling to 50 ms (jittered), while the
        deadline leaves the resend room for its answer (``ClientConfig.busy_retry``).
        For an application call (``app_call``) the client's lock is released during the
        pause, so other threads and the heartbeat are not held up, and taken back by
        the deadline (else Timeout, without the lock: see :meth:`_busy_pause`); if the
        connection was replaced meanwhile the call raises ConnectionLost.

        When some requests of several fail, the exception raised carries
        ``unanswered``: the positions in ``reqs`` of those that got no answer (no
        reply, or BUSY to the end).

        ``phases``, when given, gets the duration (s) of each send-and-wait phase: from
        a (re)send to the last reply it brought, BUSY pauses left out."""
        sock = self._sock
        if sock is None:
            raise E.ConnectionLost("client is not connected (call setup)", endpoint=self.endpoint)
        limit = self.config.timeout_s if timeout_s is None else timeout_s
        if deadline is not None and _monotonic() >= deadline:
            raise E.Timeout(f"the call's timeout ({limit:.3g} s) passed before "
                            f"{op_name(reqs[0][0])} was sent", op=op_name(reqs[0][0]),
                            endpoint=self.endpoint)
        self._before_send()  # and before the BUSY resends below
        ids = self._ids
        if len(reqs) == 1:
            # Most calls: one request, without the bookkeeping of several.
            op, route, fields = reqs[0]
            req_id = next(ids)
            began = _monotonic()  # (for ``phases``: before the send, never after)
            _send_request(sock, (op, route, _packb([req_id, *fields])), self.endpoint)
            self._last_sent = sent_at = now = _monotonic()
            if deadline is None:
                deadline = now + limit
            pause = BUSY_FIRST_PAUSE_S
            while True:
                rid, status, body = self._next_reply(sock, deadline, deadline - sent_at, op)
                if rid != req_id:
                    # A late reply to an earlier, timed-out request, or a revoke's.
                    if self._parting_sent:
                        self._parting_reply(rid, status)
                    continue
                if phases is not None:
                    phases.append(_monotonic() - began)
                if not status:
                    if began > self._heard:
                        self._heard = began  # (the write fence: kvmaster/_fence.py)
                    return [body]
                if status == _BUSY and self._may_resend(sent_at, pause, deadline, limit):
                    sock = self._busy_pause(sock, pause, app_call, deadline)
                    pause = min(pause * 2, BUSY_MAX_PAUSE_S)
                    self._before_send()
                    req_id = next(ids)
                    began = _monotonic()
                    _send_request(sock, (op, route, _packb([req_id, *fields])), self.endpoint)
                    sent_at = _monotonic()
                    continue
                err = self._error(status, body, op, req_id)
                if not tolerant or err.code in self._reconnect:
                    raise err
                return [err]
        pending: dict[int, int] = {}
        refused: list[tuple[int, int]] = []  # (slot, req_id) answered BUSY this round
        out: list[Any] = [_UNSET] * len(reqs)
        heard = 0.0  # send time of the requests answered with success
        try:
            # Small frames: copying is far cheaper than zero-copy bookkeeping.
            began = _monotonic()
            self._send_all(sock, reqs, range(len(reqs)), pending)
            self._last_sent = sent_at = now = _monotonic()
            if deadline is None:
                deadline = now + limit
            pause = BUSY_FIRST_PAUSE_S
            error: E.RequestError | None = None
            while pending or refused:
                if not pending:
                    if phases is not None:
                        phases.append(_monotonic() - began)
                    # Every other reply is in: send the refused ones again, together.
                    if not self._may_resend(sent_at, pause, deadline, limit):
                        for i, rid in refused:
                            err = self._error(_BUSY, "the master stayed busy until the timeout",
                                              reqs[i][0], rid)
                            error = error or err
                            out[i] = err
                        break
                    sock = self._busy_pause(sock, pause, app_call, deadline)
                    pause = min(pause * 2, BUSY_MAX_PAUSE_S)
                    self._before_send()
                    began = _monotonic()
                    self._send_all(sock, reqs, [i for i, _ in refused], pending)
                    refused.clear()
                    sent_at = _monotonic()
                req_id, status, body = self._next_reply(
                    sock, deadline, deadline - sent_at, reqs[next(iter(pending.values()))][0])
                i = pending.pop(req_id, -1)  # (positions are >= 0)
                if i < 0:
                    # A late reply to an earlier, timed-out request, or a revoke's.
                    if self._parting_sent:
                        self._parting_reply(req_id, status)
                    continue
                if status:
                    if status == _BUSY and self.config.busy_retry:
                        refused.append((i, req_id))
                        continue
                    err = self._error(status, body, reqs[i][0], req_id)
                    # NOT_REGISTERED (and a standby's refusal) wins: the caller
                    # re-handshakes and resends everything.
                    if error is None or status in self._reconnect:
                        error = err
                    out[i] = err
                else:
                    out[i] = body
                    if not heard:
                        heard = began
        except BaseException as exc:
            setattr(exc, "unanswered", [i for i, v in enumerate(out) if v is _UNSET])  # noqa: B010
            raise
        finally:
            if heard > self._heard:
                self._heard = heard  # (the write fence: kvmaster/_fence.py)
        if phases is not None:
            phases.append(_monotonic() - began)
        if error is not None and (not tolerant or error.code in self._reconnect):
            error.unanswered = [i for i, _ in refused]
            raise error
        return out

    def _send_all(self, sock: zmq.Socket[Any], reqs: list[Request], slots: Iterable[int],
                  pending: dict[int, int]) -> None:
        """Send ``reqs[i]`` for each slot, recording ``pending[req_id] = i``: as one
        message of up to MAX_REQUESTS_PER_MESSAGE requests when the master takes that
        (protocol 1.2), else one message each.  A slot is recorded only once sent."""
        ids = self._ids
        welcome = self.welcome
        cap = P.MAX_REQUESTS_PER_MESSAGE if welcome is not None and welcome.multi else 1
        frames: list[bytes] = []
        sent: list[tuple[int, int]] = []
        for i in slots:
            op, route, fields = reqs[i]
            req_id = next(ids)
            frames += (op, route, _packb([req_id, *fields]))
            sent.append((req_id, i))
            if len(sent) == cap:
                _send_request(sock, frames, self.endpoint)
                pending.update(sent)
                frames, sent = [], []
        if sent:
            _send_request(sock, frames, self.endpoint)
            pending.update(sent)

    def _busy_pause(self, sock: zmq.Socket[Any], pause: float, app_call: bool,
                    deadline: float) -> zmq.Socket[Any]:
        """Sleep before a resend (jittered, so refused clients do not come back in step);
        an application call lets go of the lock meanwhile (nothing of it is in flight)
        and takes it back by ``deadline``: the heartbeat thread may hold it for a
        re-handshake with a stalled master (up to ``connect_timeout_s``).  When another
        thread re-handshook meanwhile, the refused requests go out on the new
        connection if it is to the same master process; to another one (a failover, a
        restart) this raises ConnectionLost, so that no round mixes two masters'
        answers (space from one with space from the other).  Past the
        deadline this raises Timeout without the lock; so does a signal handler's
        exception during the sleep or the wait (or with it, raised just after the lock
        was taken): :meth:`_drive` asks the lock whether this thread holds it before
        using the socket or releasing it.  Returns the socket to resend on."""
        pause *= random.uniform(0.5, 1.0)
        if not app_call:
            time.sleep(pause)
            return sock
        routing = self._routing()  # the lock is held: the layout of this call
        instance = self._master_instance
        lock = self._lock
        lock.release()
        time.sleep(pause)
        left = deadline - _monotonic()
        if not (lock.acquire(timeout=left) if left > 0 else lock.acquire(False)):
            raise E.Timeout("the call's timeout passed while it waited for the client (held "
                            "by a reconnect) between BUSY resends", endpoint=self.endpoint)
        if self._sock is not sock:
            # Reconnected meanwhile (the heartbeat thread): the refused requests were not
            # executed, so they may go out on the new connection, unless it routes keys
            # differently (RoutingChanged: the call is built again).
            if self._sock is None:
                raise E.ConnectionLost("client closed during the call", endpoint=self.endpoint)
            if self.welcome is None:  # the reconnect has not succeeded (yet)
                raise E.ConnectionLost("the connection to the master was lost during the call",
                                       endpoint=self.endpoint)
            if not instance or self._master_instance != instance:
                raise master_changed(self.endpoint)
            self._check_routing(routing)
            sock = self._sock
        return sock

    def _next_reply(self, sock: zmq.Socket[Any], deadline: float, limit: float,
                    op: bytes) -> tuple[int, int, Any]:
        """The next well-formed reply ``(req_id, status, body)``; raises Timeout (naming
        ``op`` and ``limit``, the seconds it waited since the send: less than the call's
        timeout when HA keeps a part of it for finding a new leader) at ``deadline``,
        and ConnectionLost as soon as the connection to the
        master closes while waiting (the master stopped or died: what it had not
        answered will not be answered; a request sent may or may not have been
        applied).  Malformed messages are skipped.

        Never blocks inside pyzmq: pyzmq restarts an interrupted blocking receive with
        its whole RCVTIMEO, and an interrupted ``zmq_poll`` with its whole timeout
        (its elapsed time is counted in whole seconds), so a process taking frequent
        signals would wait far past ``deadline`` or forever.  Waits are on the
        socket's FD with :func:`select.poll`, which PEP 475 resumes with the time
        left; ZMQ_FD is edge-triggered, so EVENTS is checked before every wait."""
        stash = self._stash
        while True:
            if stash:
                return stash.popleft()
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
                elif not len(frames) & 1:  # several replies in one message (protocol 1.2)
                    for i in range(1, len(frames), 2):
                        try:
                            stash.append(P.decode_reply(frames[i]))
                        except P.ProtocolError:
                            pass
                continue
            if self._disconnected():
                if readable(sock):  # a reply that came before the close: take it first
                    continue
                raise E.ConnectionLost(LINK_LOST, op=op_name(op), endpoint=self.endpoint)
            left_ms = math.ceil((deadline - _monotonic()) * 1000)
            if left_ms <= 0:
                raise E.Timeout(f"no reply within {limit:.3g} s", op=op_name(op),
                                endpoint=self.endpoint) from None
            self._poller.poll(left_ms)  # on the FDs of self._sock (``sock``) and its monitor

    def _error(self, status: int, body: Any, op: bytes, req_id: int) -> E.RequestError:
        return E.error_for(status, body if isinstance(body, str) else str(body),
                           op=op_name(op), req_id=req_id, endpoint=self.endpoint)

    def _drive(self, gen: OpGen[Any], deadline: float | None = None) -> Any:
        """Run one operation generator to completion over this client's socket, by one
        ``deadline`` (``time.monotonic()``; default ``ClientConfig.timeout_s`` from now).

        The deadline bounds the wait for the client's lock (the heartbeat thread may
        be reconnecting), every round trip and BUSY pause of the call, taking the
        lock back after a pause, and a re-handshake the call makes (NOT_REGISTERED,
        a standby's refusal, a lost HA leader): its HELLO and mount get what is left
        (a re-handshake cut short is finished by the next call or the heartbeat
        thread).  Not
        bounded by it: the ``on_reconnect`` hook (its own calls have their own
        timeouts), an etcd leader look-up's last request (up to 0.2 s more), copying
        the bytes (a transfer service's read or write has its own ``timeout_s``),
        and the requests a failed put sends without waiting (see ``_core``'s
        ``_put``).

        Every exception of a round, and a signal handler's raised while it waits, is
        thrown into the generator; a :class:`~kvmaster._core.NoWait` round it yields
        then goes out at once, or, when the call no longer holds the lock (a BUSY
        pause that could not take it back), with the next call or heartbeat."""
        limit = self.config.timeout_s
        if deadline is None:
            deadline = _monotonic() + limit
        lock = self._lock
        # A call from an on_reconnect hook runs under the lock of the re-handshake
        # that runs the hook: it keeps the lock in its BUSY pauses (nobody else could
        # take it meanwhile).
        outer = not lock._is_owned()  # type: ignore[attr-defined]  # (CPython RLock)
        # The heartbeat thread may be reconnecting: wait for it no longer than the
        # call's own timeout.
        # An uncontended lock is taken without the (slower) timed acquire.
        if not lock.acquire(False) and not lock.acquire(
                timeout=max(0.0, deadline - _monotonic())):
            gen.close()
            raise E.Timeout(f"client busy reconnecting for {limit:.3g} s",
                            endpoint=self.endpoint)
        held = True
        try:
            if self.welcome is None and self._sock is not None and not self._closing.is_set():
                # A re-handshake failed earlier (cut short by a call's deadline, or the
                # master away): finish it first, within this call's deadline.
                self._rehandshake(deadline)
            if self._parting or self._parting_sent:
                self._tend_parting()
            reqs = next(gen)
            while True:
                if type(reqs) is NoWait:
                    now = _monotonic()
                    self._parting.extend((now, r, now, BUSY_FIRST_PAUSE_S) for r in reqs)
                    if held:
                        self._tend_parting()
                    reqs = gen.send([None] * len(reqs))
                    continue
                try:
                    if not held:
                        raise E.Timeout("the call lost the client's lock", endpoint=self.endpoint)
                    bodies = self._round(reqs, deadline, outer)
                except BaseException as exc:  # noqa: BLE001 - the generator decides
                    if outer:
                        held = lock._is_owned()  # type: ignore[attr-defined]  # (BUSY pause)
                    reqs = gen.throw(exc)
                    continue
                reqs = gen.send(bodies)
        except StopIteration as stop:
            return stop.value
        finally:
            if held:
                lock.release()

    def _round(self, reqs: list[Request], deadline: float, app_call: bool) -> list[Any]:
        """One round of a call: its requests' replies, after a re-handshake when the
        master does not know the client (or, with HA, stopped answering or answered
        SHUTTING_DOWN: the round then waits for its replies until :func:`ha_reserve`
        before the deadline, leaving that for finding the new leader and sending the
        round again)."""
        tolerant = type(reqs) is Tolerant
        # The layout the requests were built with (a BUSY pause in the exchange lets
        # the heartbeat thread re-handshake, and its failure leaves no layout to read
        # afterwards).
        routing = self._routing()
        trust = self._trust(reqs)
        wait = deadline
        if self.ha and deadline - ha_reserve(self.config.timeout_s) > _monotonic():
            wait = deadline - ha_reserve(self.config.timeout_s)
        phases: list[float] | None = None if trust is None else []
        generation = self._generation  # the connection the round goes out on
        try:
            out = self._exchange(reqs, None, tolerant, app_call, wait, phases)
            if trust is None or (phases and max(phases) <= trust):
                return out
            # Too late to be sure the leader that gave it still leads (it may have been
            # paused and replaced): ask it, else find the leader again.
            if _monotonic() >= deadline or (
                    app_call and not self._lock._is_owned()):  # type: ignore[attr-defined]
                raise self._stale(trust)
            if self._still_leading(trust, wait, app_call, generation):
                return out
            why: BaseException = self._stale(trust)  # (logged by the re-handshake)
        except (E.NotRegistered, E.Unavailable) as e:
            why = e
        except E.ShuttingDown as e:
            if not self.ha:
                raise
            why = e
        except E.TransportError as e:
            if not self.ha or _monotonic() >= deadline or (
                    app_call and not self._lock._is_owned()):  # type: ignore[attr-defined]
                raise  # (without the lock: a BUSY pause could not take it back)
            # The leader may have died: find the new one, retry once.
            why = e
        self._rehandshake(deadline, why)
        if routing is not None:  # (master-level requests have no layout)
            self._check_routing(routing)
        phases = None if trust is None else []
        out = self._exchange(reqs, None, tolerant, app_call, deadline, phases)
        if trust is not None and (not phases or max(phases) > trust):
            raise self._stale(trust)
        return out

    def _still_leading(self, trust: float, deadline: float, app_call: bool,
                       generation: int) -> bool:
        """Whether the master that sent a reply too late to be trusted still leads: a
        HEARTBEAT on the same connection answered within ``trust``.  An HA master
        that loses its lease stops for good, and it sends a reply only while its lease
        is surely alive for ``trust`` more; so one answering in time now has led
        without a break since it sent the late reply, and what that reply gave out
        is still its to give (HA.md, "Fencing").  ``generation``: the connection the
        round went out on; another one (a reconnect meanwhile) is not asked."""
        if self._generation != generation:
            return False
        phases: list[float] = []
        try:
            self._exchange([(Op.HEARTBEAT.value, P.MASTER_ROUTE, [])], None, False, app_call,
                           deadline, phases)
        except E.KVMasterError:
            return False
        return (self._generation == generation and not self._disconnected()
                and bool(phases) and max(phases) <= trust)

    def _tend_parting(self) -> None:
        """With the lock held: read the replies already waiting (a NoWait request
        refused BUSY goes back in the queue, due after its pause), send the queued
        NoWait requests that are due, without waiting for replies, and forget those
        sent more than PARTING_RETRY_S ago.  One that cannot be queued on the socket
        (a full send queue: the master is not reading) is queued again after its
        pause, like one refused BUSY; one sent on a connection that is replaced
        before its reply came is sent again on the new one (:meth:`_new_connection`)."""
        sock = self._sock
        sent = self._parting_sent
        if sock is None:
            return
        if sent:
            while readable(sock):
                try:
                    frames = recv_frames(sock, NOBLOCK)
                except zmq.Again:
                    continue
                for payload in frames[1::2]:  # [op, payload], once or more (1.2)
                    try:
                        rid, status, _ = P.decode_reply(payload)
                    except P.ProtocolError:
                        continue
                    self._parting_reply(rid, status)
        now = _monotonic()
        parting = self._parting
        for _ in range(len(parting)):
            item = parting.popleft()
            due, (op, route, fields), since, pause = item
            if due > now:
                parting.append(item)
                continue
            req_id = next(self._ids)
            try:
                _send_request(sock, (op, route, _packb([req_id, *fields])), self.endpoint)
            except (E.Timeout, zmq.ZMQError) as exc:
                log.debug("%s not sent: %s", op_name(op), exc)
                self._part_later(item[1], since, pause, now)
                continue
            self._last_sent = now
            sent[req_id] = (item[1], since, pause, now)
        for rid in [rid for rid, v in sent.items() if now - v[1] > PARTING_RETRY_S]:
            del sent[rid]
        while len(sent) > MAX_PARTING:
            del sent[next(iter(sent))]

    def _new_connection(self, same_master: bool) -> None:
        sent, self._parting_sent = self._parting_sent, {}
        if not same_master:
            self._parting.clear()
            return
        now = _monotonic()
        self._parting.extend((now, req, since, pause) for req, since, pause, _ in sent.values()
                             if now - since < PARTING_RETRY_S)

    def _parting_reply(self, req_id: int, status: int) -> None:
        """A reply to a NoWait request: refused BUSY, it is queued again, due a pause
        after it was sent (the reply may have waited in the socket); refused
        NOT_REGISTERED (the master forgot this client), it waits for the next WELCOME
        from the same master process (:meth:`_new_connection`)."""
        item = self._parting_sent.pop(req_id, None)
        if item is None:
            return
        if status == Status.NOT_REGISTERED:
            self._parting_sent[req_id] = item
            return
        if status == _BUSY:
            req, since, pause, sent_at = item
            self._part_later(req, since, pause, sent_at)

    def _part_later(self, req: Request, since: float, pause: float, after: float) -> None:
        """Queue a NoWait request again, due ``pause`` (jittered) after ``after``, the
        next pause doubled; not past PARTING_RETRY_S after ``since``."""
        due = after + pause * random.uniform(0.5, 1.0)
        if due - since < PARTING_RETRY_S:
            self._parting.append((due, req, since, min(pause * 2, BUSY_MAX_PAUSE_S)))

    def _rehandshake(self, deadline: float | None = None,
                     why: BaseException | None = None) -> None:
        """HELLO again, remount, hook: the master does not know us (restart or expiry),
        or (HA) did not answer, is stopping, or sent a reply too late to trust; ``why``
        is that error (None: an earlier re-handshake did not finish).  Within a call,
        HELLO and mount end by the call's ``deadline``; a mount that fails for want of
        an answer leaves the client unconnected (``welcome`` None), so that the next
        call or the heartbeat thread does it all again."""
        if deadline is not None and _monotonic() >= deadline:
            raise E.Timeout("the call's timeout passed before the client could re-handshake",
                            op="HELLO", endpoint=self.endpoint)
        log.warning("re-handshaking with master %s as client %s: %s", self.endpoint,
                    self.client_id, rehandshake_reason(why))
        self._connect(deadline)
        try:
            self._remount(deadline)
        except (E.TransportError, E.Busy):
            self.welcome = None
            raise
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
            if (self._parting or self._parting_sent) and self._lock.acquire(timeout=interval):
                # Revokes of failed puts refused BUSY go out again while the client is
                # idle too.
                try:
                    if not self._closing.is_set():
                        self._tend_parting()
                except Exception:  # noqa: BLE001 - keep beating
                    log.exception("sending revokes failed")
                finally:
                    self._lock.release()
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
                except (E.NotRegistered, E.Unavailable) as e:
                    self._rehandshake(None, e)
                except (E.TransportError, E.ShuttingDown) as e:
                    # Master silent or stopping: try a fresh connection, doubling the
                    # wait.
                    try:
                        self._rehandshake(None, e)
                        backoff = 0.1
                    except E.KVMasterError:
                        backoff = min(backoff * 2, self.config.reconnect_max_backoff_s)
                        pause = backoff
            except E.RequestError as exc:
                # A re-handshake whose re-mount the master refused to the end (see
                # _remount): said, and the beat goes on after a pause.
                backoff = min(backoff * 2, self.config.reconnect_max_backoff_s)
                pause = backoff
                log.warning("re-handshake with master %s incomplete: %s", self.endpoint, exc)
            except Exception:  # noqa: BLE001 - keep beating
                log.exception("heartbeat failed")
            finally:
                self._lock.release()

    # Raw access for tests and tools that speak the protocol directly.

    def _call(self, op: bytes, route: bytes, fields_after_id: list[Any]) -> Any:
        """One raw request, with the usual re-handshake; returns the body or raises."""
        def one() -> OpGen[Any]:
            (body,) = yield [(op, route, list(fields_after_id))]
            return body

        return self._drive(one())

    def _require(self) -> Welcome:
        return self._welcome()

    def _get_desc(self, key: str) -> tuple[list[Any], float]:
        """-> ``([size, replicas], lease deadline)`` after a GET_REPLICA_LIST."""
        size, replicas, deadline, _ = self._drive(self._desc(key))
        return [size, replicas], deadline

    def batch_put_from_device(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                              sizes: Sequence[Sequence[int]],
                              config: ReplicateConfig | None = None) -> list[int]:
        """:meth:`batch_put_from_ptrs` from CUDA device memory (every buffer of every
        key): copied by CUDA straight into the replicas mapped here, through host
        staging for a replica elsewhere (kvmaster/_device.py).  Keys distinct.  One
        status per position; INVALID_PARAMS everywhere when no CUDA runtime loads.
        Raises as :meth:`batch_put_from_ptrs`, and ``kvmaster._cuda.CudaError``."""
        return _device.put(self, keys, ptrs, sizes, config)

    def batch_get_into_device(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                              sizes: Sequence[Sequence[int]]) -> list[int]:
        """:meth:`batch_get_into_ptrs` into CUDA device memory (every buffer): bytes
        read per position or a negative status, as :meth:`batch_put_from_device`."""
        return _device.get(self, keys, ptrs, sizes)

    def iter_kv_session_keys(self, session_id: str, page: int = 1024) -> Iterable[str]:
        """Every member, page by page."""
        cursor = ""
        while True:
            p = self.list_kv_session_keys(session_id, cursor, page)
            yield from p.keys
            if not p.next_cursor:
                return
            cursor = p.next_cursor


def _sync(fn: Callable[..., OpGen[Any]]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def method(self: Client, *args: Any, **kwargs: Any) -> Any:
        deadline = _monotonic() + self.config.timeout_s
        try:
            return self._drive(fn(self, *args, **kwargs), deadline)
        except RoutingChanged:
            # Built again for the new layout (the old requests were never applied),
            # by the same deadline.
            return self._drive(fn(self, *args, **kwargs), deadline)

    return method


for _name, _fn in operations(ClientCore).items():
    setattr(Client, _name, _sync(_fn))
del _name, _fn
