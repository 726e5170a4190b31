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
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from kvmaster import _device
from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.policy import (
    CLOCK,
    RoundPlan,
    heartbeat_request,
    next_pause,
    request_error,
    resend_allowed,
    too_late_to_send,
)
from kvmaster._client.sync_handshake import Handshake
from kvmaster._client.sync_tasks import Heartbeat, PartingQueue
from kvmaster._client.sync_wire import Wire
from kvmaster._core import (
    BUSY_FIRST_PAUSE_S,
    ClientConfig,
    ClientCore,
    KvSessionInfo,
    KvSessionPage,
    NoWait,
    OpGen,
    ReplicateConfig,
    Request,
    RoutingChanged,
    Welcome,
    operations,
)
from kvmaster._frames import (
    NOBLOCK,
    LinkMonitor,
    send_frames,
)
from kvmaster.protocol import Op, Status

__all__ = ["Client", "ClientConfig", "KvSessionInfo", "KvSessionPage", "ReplicateConfig"]

log = logging.getLogger(__name__)

_packb = msgpack.Packer(use_bin_type=True).pack
_monotonic = time.monotonic


_BUSY = Status.BUSY
_UNSET = object()


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
        super().__init__(config)
        self._ctx: zmq.Context[Any] | None = None
        #: The current connection: its DEALER, monitor and poll
        #: (:class:`~kvmaster._client.sync_wire.Wire`); None when not connected.
        self._wire: Wire | None = None
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._last_sent = 0.0
        self._closing = threading.Event()
        self._heartbeat = Heartbeat(self)
        self._handshake = Handshake(self)
        self._connections = itertools.count(1)
        #: NoWait requests (failed puts' revokes) to send, and those sent until
        #: answered (:class:`~kvmaster._client.sync_tasks.PartingQueue`).
        self._parts = PartingQueue()
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
                self._handshake.connect()
                self._handshake.mount()
        except BaseException:
            self.close()  # release the socket, context and segment of the failed setup
            raise
        self._heartbeat.start()

    def _connect_once(self, timeout_s: float) -> None:
        assert self._ctx is not None
        if timeout_s <= 0:
            raise self._no_welcome(timeout_s)
        self.endpoint = self._resolve(timeout_s)
        self._close_socket()
        self.welcome = None
        self._wire = Wire(*self._open_dealer(self._ctx, self._ctx))
        try:
            (body,) = self._exchange([(Op.HELLO.value, P.MASTER_ROUTE, self._hello_fields())],
                                     timeout_s)
        except E.Timeout:
            raise self._no_welcome(timeout_s) from None
        self._welcomed(body)

    @property
    def _sock(self) -> zmq.Socket[Any] | None:
        """The current connection's DEALER (None: not connected)."""
        return None if self._wire is None else self._wire.sock

    @property
    def _link(self) -> LinkMonitor | None:
        """The current connection's monitor."""
        return None if self._wire is None else self._wire.link

    def _close_socket(self) -> None:
        wire, self._wire = self._wire, None
        if wire is not None:
            wire.close()

    def _disconnected(self) -> bool:
        """True if the connection to the master closed since the requests being waited
        for were sent (:meth:`Wire.disconnected`)."""
        return self._wire is not None and self._wire.disconnected()

    def _remount(self, deadline: float | None = None) -> None:
        """Mount the segment again after a re-handshake (:meth:`Handshake.remount`)."""
        self._handshake.remount(deadline)

    def close(self) -> None:
        """Unmount the segment (its objects are erased), say BYE, release everything."""
        self._closing.set()
        with self._lock:
            if self._parts.queue and self._sock is not None:
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
        self._heartbeat.join()

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
        wire = self._wire
        if wire is None:
            raise E.ConnectionLost("client is not connected (call setup)", endpoint=self.endpoint)
        sock = wire.sock
        limit = self.config.timeout_s if timeout_s is None else timeout_s
        if deadline is not None and _monotonic() >= deadline:
            raise too_late_to_send(reqs, limit, self.endpoint)
        wire.before_send()  # and before the BUSY resends below
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
                rid, status, body = wire.next_reply(deadline, deadline - sent_at, op,
                                                    self.endpoint)
                if rid != req_id:
                    # A late reply to an earlier, timed-out request, or a revoke's.
                    if self._parts.sent:
                        self._parts.reply(rid, status)
                    continue
                if phases is not None:
                    phases.append(_monotonic() - began)
                if not status:
                    if began > self._heard:
                        self._heard = began  # (the write fence: kvmaster/_fence.py)
                    return [body]
                if status == _BUSY and self._may_resend(sent_at, pause, deadline, limit):
                    sock = self._busy_pause(sock, pause, app_call, deadline)
                    pause = next_pause(pause)
                    wire = self._wire  # (the one of ``sock``: see resend_allowed)
                    assert wire is not None
                    wire.before_send()
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
            wire.send_all(reqs, range(len(reqs)), pending, self._ids, self._per_message(),
                          _send_request, self.endpoint)
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
                    pause = next_pause(pause)
                    wire = self._wire  # (the one of ``sock``: see resend_allowed)
                    assert wire is not None
                    wire.before_send()
                    began = _monotonic()
                    wire.send_all(reqs, [i for i, _ in refused], pending, self._ids,
                                  self._per_message(), _send_request, self.endpoint)
                    refused.clear()
                    sent_at = _monotonic()
                req_id, status, body = wire.next_reply(
                    deadline, deadline - sent_at, reqs[next(iter(pending.values()))][0],
                    self.endpoint)
                i = pending.pop(req_id, -1)  # (positions are >= 0)
                if i < 0:
                    # A late reply to an earlier, timed-out request, or a revoke's.
                    if self._parts.sent:
                        self._parts.reply(req_id, status)
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

    def _per_message(self) -> int:
        """How many requests one message may carry: MAX_REQUESTS_PER_MESSAGE when the
        master takes that (protocol 1.2), else one."""
        welcome = self.welcome
        return P.MAX_REQUESTS_PER_MESSAGE if welcome is not None and welcome.multi else 1

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
        pause = CLOCK.jitter(pause)
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
        return resend_allowed(self, routing, instance, sock, self._sock)

    def _error(self, status: int, body: Any, op: bytes, req_id: int) -> E.RequestError:
        return request_error(status, body, op, req_id, self.endpoint)

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
            if self._parts:
                self._tend_parting()
            reqs = next(gen)
            while True:
                if type(reqs) is NoWait:
                    self._parts.add(reqs)
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
        SHUTTING_DOWN, or sent a reply too late to trust): the decisions are the
        :class:`~kvmaster._client.policy.RoundPlan`'s.  The plan reads the layout the
        requests were built with now (a BUSY pause in the exchange lets the heartbeat
        thread re-handshake, and its failure leaves no layout to read afterwards).
        Without the lock (a BUSY pause could not take it back) nothing is retried."""
        plan = RoundPlan(self, reqs, deadline)
        try:
            out = self._exchange(reqs, None, plan.tolerant, app_call, plan.wait, plan.phases)
            if plan.trusted():
                return out
            # Too late to be sure the leader that gave it still leads (it may have been
            # paused and replaced): ask it, else find the leader again.
            if plan.past() or (app_call and not self._owns_lock()):
                raise plan.stale()
            if self._still_leading(plan, app_call):
                return out
            why: BaseException = plan.stale()  # (logged by the re-handshake)
        except (E.NotRegistered, E.Unavailable, E.ShuttingDown, E.TransportError) as e:
            if not plan.mended_by_rehandshake(e, not app_call or self._owns_lock()):
                raise
            why = e
        self._rehandshake(deadline, why)
        phases = plan.again()
        out = self._exchange(reqs, None, plan.tolerant, app_call, deadline, phases)
        plan.check_again()
        return out

    def _owns_lock(self) -> bool:
        owned: bool = self._lock._is_owned()  # type: ignore[attr-defined]  # (CPython RLock)
        return owned

    def _still_leading(self, plan: RoundPlan, app_call: bool) -> bool:
        """Whether the master that sent the round's reply too late to be trusted still
        leads: a HEARTBEAT on the same connection answered within the trust
        (:meth:`RoundPlan.still_leads`); another connection (a reconnect meanwhile) is
        not asked."""
        if self._generation != plan.generation:
            return False
        phases: list[float] = []
        try:
            self._exchange([heartbeat_request()], None, False, app_call, plan.wait, phases)
        except E.KVMasterError:
            return False
        return plan.still_leads(phases, self._disconnected)

    @property
    def _parting(self) -> collections.deque[tuple[float, Request, float, float]]:
        """The NoWait requests queued to send (``PartingQueue.queue``)."""
        return self._parts.queue

    @property
    def _parting_sent(self) -> dict[int, tuple[Request, float, float, float]]:
        """The NoWait requests sent and not answered (``PartingQueue.sent``)."""
        return self._parts.sent

    def _tend_parting(self) -> None:
        """With the lock held: send the NoWait requests due (PartingQueue.tend)."""
        sock = self._sock
        if sock is not None:
            last = self._parts.tend(sock, self._ids, _send_request, self.endpoint)
            if last is not None:
                self._last_sent = last

    def _new_connection(self, same_master: bool) -> None:
        self._parts.new_connection(same_master)

    def _rehandshake(self, deadline: float | None = None,
                     why: BaseException | None = None) -> None:
        """HELLO again, remount, hook (:meth:`Handshake.rehandshake`), with the lock."""
        self._handshake.rehandshake(deadline, why)

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
