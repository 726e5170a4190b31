"""Asyncio kvmaster client: the same methods as :class:`kvmaster.Client`, as coroutines.

:class:`AsyncClient` keeps many requests in flight on one DEALER connection: each
call sends its requests and awaits futures that one reader task resolves by
``req_id``.  It runs on any asyncio loop, uvloop included.  Heartbeats are a
task; a master that forgot the client (restart, expiry) triggers a
re-handshake, a re-mount and the ``on_reconnect`` hook, as in the sync client.
Use it from one event loop (it is not thread-safe).

Each call has one deadline, ``ClientConfig.timeout_s`` after it starts, for all
its round trips, BUSY pauses and the re-handshake it waits for (which goes on in
the background when the call gives up); see :meth:`AsyncClient._drive`.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import msgpack
import zmq
import zmq.asyncio

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._frames import LINK_LOST, NOBLOCK, LinkMonitor, readable, recv_frames
from kvmaster._core import (
    BUSY_FIRST_PAUSE_S,
    BUSY_MAX_PAUSE_S,
    MAX_PARTING,
    PARTING_RETRY_S,
    ClientConfig,
    ClientCore,
    master_changed,
    rehandshake_reason,
    NoWait,
    OpGen,
    Request,
    RoutingChanged,
    Tolerant,
    op_name,
    operations,
)
from kvmaster.protocol import Op, Status

__all__ = ["AsyncClient"]

log = logging.getLogger(__name__)

_packb = msgpack.Packer(use_bin_type=True).pack


#: Seconds one HELLO attempt may take while looking for an HA leader.
HA_ATTEMPT_S = 1.0


_BUSY = Status.BUSY
_LIST_SEGMENTS = Op.LIST_SEGMENTS.value


def ha_reserve(timeout_s: float) -> float:
    """With HA, the part of a call's timeout (s) a round leaves for a failover: a
    quarter, at most HA_ATTEMPT_S."""
    return min(HA_ATTEMPT_S, timeout_s / 4)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def _unanswered(slots: list[int], futs: list[asyncio.Future[Any]]) -> list[int]:
    """The slots of a round's requests with no answer yet: not sent, no reply, or BUSY."""
    out = []
    for n, i in enumerate(slots):
        fut = futs[n] if n < len(futs) else None
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None \
                or fut.result()[0] == _BUSY:
            out.append(i)
    return out


def _end_message(sock: zmq.asyncio.Socket) -> None:
    """End a message an exception may have left open (pyzmq runs Python signal handlers
    after queuing each frame; one that raises can stop ``send_multipart`` half way, and
    the next request's frames would be glued on): an empty frame, which the master
    refuses as malformed with req_id 0.  Not awaited: a non-blocking send is done at
    once (Again, when the message never started on a full pipe, is dropped)."""
    f = cast("asyncio.Future[Any]", sock.send(b"", flags=zmq.NOBLOCK))
    f.add_done_callback(_retrieve)


if TYPE_CHECKING:  # the operations' real signatures (tools/gen_client_types.py)
    from kvmaster._client.typed_async import AsyncClient as _Operations
else:
    _Operations = ClientCore


class AsyncClient(_Operations):
    """Asyncio client.  ``await client.setup(...)``, then ``await client.put(...)`` etc."""

    def __init__(self, config: ClientConfig | None = None) -> None:
        super().__init__(config)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        #: NoWait requests (failed puts' revokes) whose connection was replaced before
        #: their reply came (or that a new connection got before its WELCOME): ``(request,
        #: first sent, next pause, master instance)``, sent again on the next connection
        #: to the same master process (:meth:`_new_connection`).
        self._parting_lost: collections.deque[tuple[Request, float, float, str | None]] = \
            collections.deque(maxlen=MAX_PARTING)
        #: The LIST_SEGMENTS in flight, which concurrent calls share (see _exchange).
        self._listing: asyncio.Future[Any] | None = None
        self._reader: asyncio.Task[Any] | None = None
        #: The current socket's monitor: its connection to the master closing ends the
        #: calls waiting on it (see :meth:`_check_monitor`).
        self._link: LinkMonitor | None = None
        self._heartbeat: asyncio.Task[Any] | None = None
        self._connections = itertools.count(1)
        self._reconnecting: asyncio.Lock | None = None
        #: The re-handshake in progress, which every call that needs one waits for.
        self._rehandshaking: asyncio.Future[Any] | None = None
        self._last_sent = 0.0
        self._closing = False
        self.on_reconnect: Callable[[AsyncClient], Awaitable[None] | None] | None = None

    async def setup(self, master_server_addr: str | None = None,
                    global_segment_size: int | None = None, tenant: str | None = None, *,
                    local_hostname: str | None = None, timeout_s: float | None = None,
                    curve_dir: str | None = None, curve_client: str | None = None,
                    on_reconnect: Callable[[AsyncClient], Awaitable[None] | None] | None = None,
                    ) -> None:
        """Connect, handshake and mount the segment; see :meth:`kvmaster.Client.setup`."""
        self._configure(master_server_addr=master_server_addr,
                        global_segment_size=global_segment_size, tenant=tenant,
                        local_hostname=local_hostname, timeout_s=timeout_s, curve_dir=curve_dir,
                        curve_client=curve_client)
        if on_reconnect is not None:
            self.on_reconnect = on_reconnect
        self._ctx = zmq.asyncio.Context()
        self._reconnecting = asyncio.Lock()
        try:
            await self._connect()
            await self._mount()
        except BaseException:
            await self.close()
            raise
        self._heartbeat = asyncio.get_running_loop().create_task(
            self._heartbeat_loop(), name=f"kvmaster-heartbeat-{self.client_id}")

    async def _connect(self) -> None:
        if not self.ha:
            await self._connect_once()
            return
        started = time.monotonic()
        deadline = started + self.config.connect_timeout_s
        while True:
            try:
                # Short attempts: the leader key may still name a dead master until
                # its lease runs out.  None past connect_timeout_s.
                await self._connect_once(min(self.config.connect_timeout_s, HA_ATTEMPT_S,
                                             max(0.001, deadline - time.monotonic())))
                return
            except (E.Unavailable, E.ShuttingDown, E.Timeout, E.ConnectionLost) as exc:
                if time.monotonic() + 0.05 >= deadline:
                    final = self._hello_gave_up(exc, started)
                    if final is exc:
                        raise
                    raise final from exc
                await asyncio.sleep(0.05)

    async def _connect_once(self, timeout_s: float | None = None) -> None:
        assert self._ctx is not None
        self.endpoint = await asyncio.get_running_loop().run_in_executor(
            None, self._resolve, timeout_s)
        await self._drop_socket(E.ConnectionLost("reconnecting", endpoint=self.endpoint))
        self.welcome = None
        sock, link = self._open_dealer(self._ctx, zmq.Context.shadow(self._ctx.underlying))
        cfg = self.config
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_loop(sock), name="kvmaster-reader")
        self._link = link
        if link is not None:
            loop.add_reader(link.socket.getsockopt(zmq.FD), self._check_monitor)
        try:
            (body,) = await self._exchange(
                [(Op.HELLO.value, P.MASTER_ROUTE, self._hello_fields())],
                timeout_s or cfg.connect_timeout_s)
        except E.Timeout:
            raise self._no_welcome(timeout_s) from None
        self._welcomed(body)

    async def _mount(self) -> None:
        seg = self._own_segment()
        if seg is not None:
            await self._exchange([(Op.MOUNT_SEGMENT.value, P.MASTER_ROUTE,
                                   self._mount_fields(seg))])
            if self._segment_label:  # (label_segment's, for this new mount)
                try:
                    await self._exchange(self._label_requests(seg.name, self._segment_label))
                except E.KVMasterError as exc:
                    log.warning("segment %s not labelled %r again: %s", seg.name,
                                self._segment_label, exc)

    async def _remount(self) -> None:
        """Mount the segment again after a re-handshake; refusals are retried, then the
        segment is replaced by a fresh one (see :meth:`kvmaster.Client._remount`)."""
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._mount()
                return
            except E.KVMasterError as exc:
                pause = self._mount_refused(exc, attempt)
                if pause is None:
                    raise
                if not pause:
                    break
            await asyncio.sleep(pause)
        self._fresh_segment()
        await self._mount()

    async def _drop_socket(self, exc: BaseException) -> None:
        if self._link is not None:
            asyncio.get_running_loop().remove_reader(self._link.socket.getsockopt(zmq.FD))
            self._link.close()
            self._link = None
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._reader = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    async def close(self) -> None:
        """Say BYE (the segment's objects are erased), release everything."""
        self._closing = True
        for task in (self._heartbeat, self._rehandshaking):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    pass
        if self._sock is not None and self.welcome is not None:
            try:
                await self._exchange([(Op.BYE.value, P.MASTER_ROUTE, [])],
                                     min(2.0, self.config.timeout_s))
            except E.KVMasterError as exc:
                log.debug("BYE failed: %s", exc)
        await self._drop_socket(E.ConnectionLost("client closed", endpoint=self.endpoint))
        self.welcome = None
        self._release_segments()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --------------------------------------------------------------- plumbing

    async def _read_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            self._deliver(await sock.recv_multipart())

    def _deliver(self, frames: list[bytes]) -> None:
        """Hand the replies of one message to the calls waiting for them."""
        if len(frames) & 1:  # one reply is [op, payload]; 1.2 allows several
            return
        pending = self._pending
        for i in range(1, len(frames), 2):
            try:
                req_id, status, body = P.decode_reply(frames[i])
            except P.ProtocolError:
                continue
            fut = pending.pop(req_id, None)
            if fut is not None and not fut.done():
                fut.set_result((status, body))

    def _check_monitor(self) -> None:
        """Read the monitor's events; after a disconnect, fail every request waiting
        for a reply with ConnectionLost (the master stopped or died: what it had not
        answered will not be answered; a request may or may not have been applied).
        Called when the monitor has events and before every send, so a disconnect
        older than a request never fails it (the socket queues that request until it
        reconnects).  Only a connection whose handshake had succeeded counts (see
        :meth:`kvmaster._frames.LinkMonitor.lost`)."""
        link = self._link
        if link is None or not link.lost():
            return
        # Replies that came before the close go to their calls first: those still in
        # the socket now, and one the read loop has taken but not handed over yet
        # (its turn is already scheduled, so the calls are failed after it).
        sock = self._sock
        while sock is not None and readable(sock):
            try:
                frames = recv_frames(sock, NOBLOCK)
            except zmq.Again:
                break
            self._deliver(frames)
        waiting = [fut for fut in self._pending.values() if not fut.done()]
        if waiting:
            asyncio.get_running_loop().call_soon(self._fail_waiting, waiting)

    def _fail_waiting(self, waiting: list[asyncio.Future[Any]]) -> None:
        for fut in waiting:
            if not fut.done():
                fut.set_exception(E.ConnectionLost(LINK_LOST, endpoint=self.endpoint))

    async def _exchange(self, reqs: list[Request], timeout_s: float | None = None,
                        tolerant: bool = False, deadline: float | None = None,
                        phases: list[float] | None = None) -> list[Any]:
        """Send ``reqs`` and gather their replies by ``deadline`` (a call's, for all its
        rounds), else within ``timeout_s`` (see Client._exchange).  Concurrent calls
        that miss the segment table share one LIST_SEGMENTS: a burst of reads on a
        fresh client would otherwise send one each, and exceed the master's bound on
        master-level requests in progress (256 per client).  The shared lookup has its
        own ``timeout_s``; each call waits for it until its own deadline.  ``phases``:
        see Client._exchange."""
        if len(reqs) == 1 and reqs[0][0] == _LIST_SEGMENTS:
            listing = self._listing
            if listing is None or listing.done():
                listing = self._listing = asyncio.ensure_future(
                    self._send_and_gather(reqs, None, tolerant, None))
                listing.add_done_callback(_retrieve)
            if deadline is None:
                return await asyncio.shield(listing)
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                return await asyncio.wait_for(asyncio.shield(listing), left)
            except asyncio.TimeoutError:
                raise self._timeout(reqs[0][0]) from None
        return await self._send_and_gather(reqs, timeout_s, tolerant, deadline, phases)

    def _timeout(self, op: bytes) -> E.Timeout:
        return E.Timeout(f"no reply within the call's timeout ({self.config.timeout_s:.3g} s)",
                         op=op_name(op), endpoint=self.endpoint)

    async def _send_and_gather(self, reqs: list[Request], timeout_s: float | None,
                               tolerant: bool, deadline: float | None,
                               phases: list[float] | None = None) -> list[Any]:
        sock = self._sock
        if sock is None:
            raise E.ConnectionLost("client is not connected (call setup)", endpoint=self.endpoint)
        loop = asyncio.get_running_loop()
        limit = timeout_s if timeout_s is not None else self.config.timeout_s
        if deadline is None:
            deadline = time.monotonic() + limit
        elif time.monotonic() >= deadline:
            raise E.Timeout(f"the call's timeout ({limit:.3g} s) passed before "
                            f"{op_name(reqs[0][0])} was sent", op=op_name(reqs[0][0]),
                            endpoint=self.endpoint)
        ids: list[int] = [0] * len(reqs)
        replies: list[Any] = [None] * len(reqs)
        slots = list(range(len(reqs)))
        pause = BUSY_FIRST_PAUSE_S
        routing = self._routing()
        instance = self._master_instance
        sent_at = 0.0
        while True:
            if self._link is not None:
                self._check_monitor()  # a disconnect before this send is not its concern
            futs: list[asyncio.Future[Any]] = []
            pending = self._pending
            # A 1.2 master takes up to MAX_REQUESTS_PER_MESSAGE requests per message.
            welcome = self.welcome
            step = P.MAX_REQUESTS_PER_MESSAGE if welcome is not None and welcome.multi else 1
            began = time.monotonic()  # (for ``phases``: before the sends)
            try:
                for start in range(0, len(slots), step):
                    frames: list[bytes] = []
                    for i in slots[start:start + step]:
                        op, route, fields = reqs[i]
                        req_id = ids[i] = next(self._ids)
                        fut = loop.create_future()
                        pending[req_id] = fut
                        futs.append(fut)
                        frames += (op, route, _packb([req_id, *fields]))
                    try:  # a full pipe must not hang the call past its timeout
                        await sock.send_multipart(frames, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        raise E.Timeout("send queue to the master is full",
                                        op=op_name(frames[0]), endpoint=self.endpoint) from None
                    except BaseException as exc:
                        if not isinstance(exc, zmq.ZMQError):
                            _end_message(sock)
                        raise
                self._last_sent = sent_at = time.monotonic()
                gathered = asyncio.gather(*futs)
                # Retrieved whatever happens (a close() cancelling this call mid-wait
                # otherwise prints "exception was never retrieved" at exit).
                gathered.add_done_callback(_retrieve)
                got = await asyncio.wait_for(gathered, max(0.0, deadline - time.monotonic()))
                if phases is not None:
                    phases.append(time.monotonic() - began)
            except asyncio.TimeoutError:
                # (the time it waited: less than the call's timeout when HA keeps a
                # part of it for finding a new leader)
                err: E.KVMasterError = E.Timeout(
                    f"no reply within {max(0.0, deadline - sent_at) if sent_at else limit:.3g} s",
                                                 op=op_name(reqs[0][0]),
                                                 endpoint=self.endpoint)
                err.unanswered = _unanswered(slots, futs)
                raise err from None
            except zmq.ZMQError as exc:  # the socket was closed under us (reconnect, close)
                err = E.ConnectionLost(f"connection replaced during the call: {exc}",
                                       endpoint=self.endpoint)
                err.unanswered = _unanswered(slots, futs)
                raise err from None
            except BaseException as exc:  # cancelled, or a signal handler's exception
                setattr(exc, "unanswered", _unanswered(slots, futs))  # noqa: B010
                raise
            finally:
                for i in slots:
                    pending.pop(ids[i], None)
            for i, reply in zip(slots, got):
                replies[i] = reply
            if began > self._heard and any(not status for status, _ in got):
                self._heard = began  # (the write fence: kvmaster/_fence.py)
            # BUSY: nothing was done; send those again after a growing pause.
            slots = [i for i, (status, _) in zip(slots, got) if status == _BUSY]
            if not slots or not self._may_resend(sent_at, pause, deadline, limit):
                break
            try:
                await asyncio.sleep(pause * random.uniform(0.5, 1.0))  # jitter: not in step
                pause = min(pause * 2, BUSY_MAX_PAUSE_S)
                if self._sock is not sock:
                    # Reconnected meanwhile (heartbeat, another task): the refused
                    # requests were not executed, so they may go out on the new
                    # connection, unless it routes keys differently.
                    sock = self._sock
                    if sock is None:
                        raise E.ConnectionLost("client closed during the call",
                                               endpoint=self.endpoint)
                    if self.welcome is None:  # the reconnect has not succeeded (yet)
                        raise E.ConnectionLost("the connection to the master was lost during "
                                               "the call", endpoint=self.endpoint)
                    if not instance or self._master_instance != instance:
                        raise master_changed(self.endpoint)
                    self._check_routing(routing)
            except BaseException as exc:
                setattr(exc, "unanswered", slots)  # noqa: B010
                raise
        out: list[Any] = []
        error: E.RequestError | None = None
        for (op, _, _), req_id, (status, body) in zip(reqs, ids, replies):
            if status:
                err = E.error_for(status, body if isinstance(body, str) else str(body),
                                  op=op_name(op), req_id=req_id, endpoint=self.endpoint)
                if error is None or status in self._reconnect:
                    error = err
                out.append(err)
            else:
                out.append(body)
        if error is not None and (not tolerant or error.code in self._reconnect):
            error.unanswered = slots  # refused BUSY to the end
            raise error
        return out

    async def _drive(self, gen: OpGen[Any], deadline: float | None = None) -> Any:
        """Run one operation generator by one deadline, ``ClientConfig.timeout_s`` from
        now, for all its rounds and BUSY pauses (see :meth:`kvmaster.Client._drive`).
        A re-handshake the call needs is awaited until the deadline; it is not cut
        short (other calls may be waiting for it): it goes on in the background.
        Every exception of a round, cancellation included, is thrown into the
        generator; a :class:`~kvmaster._core.NoWait` round it yields goes out at once."""
        if deadline is None:
            deadline = time.monotonic() + self.config.timeout_s
        try:
            if self.welcome is None and self._sock is not None and not self._closing:
                # A re-handshake failed earlier: finish it first, by this deadline.
                try:
                    await self._rehandshake_by(deadline)
                except BaseException:
                    gen.close()
                    raise
            reqs = next(gen)
            while True:
                if type(reqs) is NoWait:
                    self._send_no_wait(reqs)
                    reqs = gen.send([None] * len(reqs))
                    continue
                try:
                    bodies = await self._round(reqs, deadline)
                except BaseException as exc:  # noqa: BLE001 - the generator decides
                    reqs = gen.throw(exc)
                    continue
                reqs = gen.send(bodies)
        except StopIteration as stop:
            return stop.value

    async def _round(self, reqs: list[Request], deadline: float) -> list[Any]:
        """One round of a call: its requests' replies, after a re-handshake when the
        master does not know the client (or, with HA, stopped answering or answered
        SHUTTING_DOWN: the round waits until :func:`ha_reserve` before the deadline,
        as in the sync client).

        The round is sent again after a re-handshake, one shared by every task
        (:meth:`_reconnected_since`), and only when the new connection routes keys as
        the requests were built for: the layout is read here, before anything is
        awaited, so it is the one the generator built them with (another task's
        re-handshake may be under way when this one fails); else RoutingChanged."""
        tolerant = type(reqs) is Tolerant
        routing = self._routing()
        trust = self._trust(reqs)
        generation = self._generation
        wait = deadline
        if self.ha and deadline - ha_reserve(self.config.timeout_s) > time.monotonic():
            wait = deadline - ha_reserve(self.config.timeout_s)  # room for a failover
        phases: list[float] | None = None if trust is None else []
        try:
            out = await self._exchange(reqs, None, tolerant, wait, phases)
            if trust is None or (phases and max(phases) <= trust):
                return out
            # Too late to be sure the leader that gave it still leads (it may have been
            # paused and replaced): ask it, else find the leader again.
            if time.monotonic() >= deadline:
                raise self._stale(trust)
            if await self._still_leading(trust, wait, generation):
                return out
            why: BaseException = self._stale(trust)  # (logged by the re-handshake)
            generation = self._generation  # one from now on, not an earlier one
        except (E.NotRegistered, E.Unavailable) as e:
            why = e
        except E.ShuttingDown as e:
            if not self.ha:
                raise
            why = e
        except E.TransportError as e:
            if not self.ha or time.monotonic() >= deadline:
                raise
            why = e
        await self._reconnected_since(generation, deadline, why)
        # Requests built without a connection (master-level ones: no layout) go as
        # they are.
        if routing is not None:
            self._check_routing(routing)
        phases = None if trust is None else []
        out = await self._exchange(reqs, None, tolerant, deadline, phases)
        if trust is not None and (not phases or max(phases) > trust):
            raise self._stale(trust)
        return out

    async def _still_leading(self, trust: float, deadline: float, generation: int) -> bool:
        """Whether the master that sent a reply too late to be trusted still leads: a
        HEARTBEAT on the same connection (``generation``: the one the round went out
        on) answered within ``trust`` (see :meth:`kvmaster.Client._still_leading`)."""
        if self._generation != generation:
            return False
        phases: list[float] = []
        try:
            await self._exchange([(Op.HEARTBEAT.value, P.MASTER_ROUTE, [])], None, False,
                                 deadline, phases)
        except E.KVMasterError:
            return False
        # (A new master process at the endpoint would not know this connection: it
        # answers NOT_REGISTERED, so an answer is from the one that sent the reply.)
        return self._generation == generation and bool(phases) and max(phases) <= trust

    def _rehandshake_shared(self, why: BaseException | None = None) -> asyncio.Future[Any]:
        """The re-handshake in progress, or a new one (``why``: the error that calls
        for it, for the log): calls and the heartbeat that need one at the same time
        share it."""
        task = self._rehandshaking
        if task is None or task.done():
            task = self._rehandshaking = asyncio.ensure_future(self._rehandshake(why))
            task.add_done_callback(_retrieve)
        return task

    def _rehandshake_since(self, generation: int, why: BaseException | None = None
                           ) -> asyncio.Future[Any] | None:
        """The re-handshake a request sent on connection ``generation`` (the
        ``_generation`` when it was sent) needs after it failed: the one in
        progress; none (None) when one has completed since (each re-handshake replaces
        the socket and fails every request in flight on it, so a task must not start
        another for a failure the last one caused or already repaired); else a new
        one."""
        task = self._rehandshaking
        if task is not None and not task.done():
            return task
        if self._generation != generation and self.welcome is not None:
            return None
        return self._rehandshake_shared(why)

    async def _reconnected_since(self, generation: int, deadline: float,
                                 why: BaseException | None = None) -> None:
        """Return once the client has a connection newer than ``generation`` with a
        WELCOME, waiting for (or starting: see :meth:`_rehandshake_since`) the
        re-handshake until ``deadline``; past it raise Timeout (the re-handshake goes
        on); a failed re-handshake raises its error."""
        while True:
            task = self._rehandshake_since(generation, why)
            if task is None:
                return
            await self._rehandshake_by(deadline, task)
            if self.welcome is not None:
                return
            # Another re-handshake began as soon as this one ended: wait for it too.

    async def _rehandshake_by(self, deadline: float, task: asyncio.Future[Any] | None = None
                              ) -> None:
        """Wait for a re-handshake (``task``, else the one in progress or a new one)
        until ``deadline``; past it raise Timeout, and the re-handshake goes on.  When
        :meth:`close` cancels the re-handshake, the waiting calls raise ConnectionLost
        (their own tasks were not cancelled)."""
        if task is None:
            task = self._rehandshake_shared()
        left = deadline - time.monotonic()
        if left > 0:
            # (asyncio.wait neither cancels the shared task nor passes its cancellation
            # on: only this call's own cancellation raises CancelledError here.)
            await asyncio.wait((task,), timeout=left)
        if not task.done():
            raise E.Timeout("the call's timeout passed during a re-handshake (it goes on)",
                            op="HELLO", endpoint=self.endpoint)
        if task.cancelled():
            raise E.ConnectionLost("client closed during a re-handshake", op="HELLO",
                                   endpoint=self.endpoint)
        task.result()  # its error, if it failed

    def _send_no_wait(self, reqs: list[Request]) -> None:
        """Send requests without waiting for their replies (see NoWait)."""
        now = time.monotonic()
        for req in reqs:
            self._part(req, now, BUSY_FIRST_PAUSE_S, self._master_instance)

    def _part(self, req: Request, since: float, pause: float, instance: str | None) -> None:
        """Send one NoWait request now (non-blocking); when it cannot be queued (a full
        send queue) or its reply is BUSY, again after ``pause`` (jittered, doubling),
        until PARTING_RETRY_S after ``since``; when its connection is replaced before
        the reply came, on the next connection to the same master process.
        ``instance``: the master process it is for; never sent to another."""
        sock = self._sock
        if sock is None or self._closing or instance != self._master_instance:
            return
        op, route, fields = req
        req_id = next(self._ids)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending[req_id] = fut
        try:
            sent = cast("asyncio.Future[Any]", sock.send_multipart(
                (op, route, _packb([req_id, *fields])), flags=zmq.NOBLOCK))
        except zmq.ZMQError as exc:
            self._pending.pop(req_id, None)
            log.debug("%s not sent: %s", op_name(op), exc)
            self._part_later(req, since, pause, instance)
            return
        except BaseException:
            self._pending.pop(req_id, None)
            _end_message(sock)
            raise
        sent.add_done_callback(_retrieve)
        if sent.done() and (sent.cancelled() or sent.exception() is not None):
            self._pending.pop(req_id, None)  # Again: the send queue is full
            self._part_later(req, since, pause, instance)
            return
        fut.add_done_callback(functools.partial(self._parted, req, since, pause, instance))
        # A reply that never comes (master gone): forget the request.
        loop.call_later(PARTING_RETRY_S, self._forget, req_id, fut)

    def _parted(self, req: Request, since: float, pause: float, instance: str | None,
                fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            if isinstance(exc, E.ConnectionLost) and not self._closing:
                self._parting_lost.append((req, since, pause, instance))
            return
        status = fut.result()[0]
        if status == _BUSY:
            self._part_later(req, since, pause, instance)
        elif status == Status.NOT_REGISTERED and not self._closing:
            # Sent on a new connection before its WELCOME: again once it comes.
            self._parting_lost.append((req, since, pause, instance))

    def _part_later(self, req: Request, since: float, pause: float,
                    instance: str | None) -> None:
        if self._closing or time.monotonic() + pause - since >= PARTING_RETRY_S:
            return
        asyncio.get_running_loop().call_later(pause * random.uniform(0.5, 1.0), self._part,
                                              req, since, min(pause * 2, BUSY_MAX_PAUSE_S),
                                              instance)

    def _new_connection(self, same_master: bool) -> None:
        lost, self._parting_lost = self._parting_lost, collections.deque(maxlen=MAX_PARTING)
        if not same_master:
            return
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        for req, since, pause, instance in lost:
            if now - since < PARTING_RETRY_S:
                loop.call_soon(self._part, req, since, pause, instance)

    def _forget(self, req_id: int, fut: asyncio.Future[Any]) -> None:
        if self._pending.get(req_id) is fut:
            del self._pending[req_id]
        fut.cancel()

    async def _rehandshake(self, why: BaseException | None = None) -> None:
        assert self._reconnecting is not None
        async with self._reconnecting:
            log.warning("re-handshaking with master %s as client %s: %s", self.endpoint,
                        self.client_id, rehandshake_reason(why))
            await self._connect()
            # No WELCOME until the segment is mounted again: calls starting meanwhile
            # wait for this re-handshake (a put would otherwise find no space on a
            # master that knows no segment yet).  The hook's calls run after it.
            welcome, self.welcome = self.welcome, None
            try:
                await self._remount()
            except (E.TransportError, E.Busy):
                # Unconnected, as in the sync client: the next call or heartbeat does it
                # all again (registered but not mounted, the segment would stay unused).
                raise
            except BaseException:
                self.welcome = welcome  # cancelled (close): registered, so BYE goes out
                raise
            self.welcome = welcome
            self.reconnect_count += 1
            hook = self.on_reconnect
            if hook is not None:
                try:
                    result = hook(self)
                    if inspect.isawaitable(result):
                        await result
                except Exception:  # noqa: BLE001 - an application hook must not break the client
                    log.exception("on_reconnect hook failed")

    async def _heartbeat_loop(self) -> None:
        backoff = 0.1
        while not self._closing:
            w = self.welcome
            interval = (w.client_ttl_ms / 1000 / P.HEARTBEAT_LIVENESS) if w else 1.0
            await asyncio.sleep(min(interval, 1.0))
            if time.monotonic() - self._last_sent < interval:
                continue
            generation = self._generation
            try:
                if self.welcome is None or self._sock is None:
                    await self._rehandshake_shared()
                else:
                    await self._exchange([(Op.HEARTBEAT.value, P.MASTER_ROUTE, [])],
                                         min(self.config.timeout_s, max(interval, 0.5)))
                backoff = 0.1
            except (E.NotRegistered, E.Unavailable) as e:
                task = self._rehandshake_since(generation, e)
                if task is not None:
                    await task
            except (E.TransportError, E.ShuttingDown) as e:  # master silent or stopping
                try:
                    task = self._rehandshake_since(generation, e)
                    if task is not None:
                        await task
                    backoff = 0.1
                except E.KVMasterError:
                    backoff = min(backoff * 2, self.config.reconnect_max_backoff_s)
                    await asyncio.sleep(backoff)
            except asyncio.CancelledError:
                raise
            except E.RequestError as exc:
                # A re-handshake whose re-mount the master refused to the end (see
                # _remount): said, and the beat goes on after a pause.
                backoff = min(backoff * 2, self.config.reconnect_max_backoff_s)
                log.warning("re-handshake with master %s incomplete: %s", self.endpoint, exc)
                await asyncio.sleep(backoff)
            except Exception:  # noqa: BLE001 - keep beating
                log.exception("heartbeat failed")

    async def iter_kv_session_keys(self, session_id: str, page: int = 1024
                                   ) -> AsyncIterator[str]:
        """Every member, page by page."""
        cursor = ""
        while True:
            p = await self.list_kv_session_keys(session_id, cursor, page)
            for k in p.keys:
                yield k
            if not p.next_cursor:
                return
            cursor = p.next_cursor


def _async(fn: Callable[..., OpGen[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def method(self: AsyncClient, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.config.timeout_s
        try:
            return await self._drive(fn(self, *args, **kwargs), deadline)
        except RoutingChanged:
            # Built again for the new layout (the old requests were never applied),
            # by the same deadline.
            return await self._drive(fn(self, *args, **kwargs), deadline)

    return method


for _name, _fn in operations(ClientCore).items():
    setattr(AsyncClient, _name, _async(_fn))
del _name, _fn
