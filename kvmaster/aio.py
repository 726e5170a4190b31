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
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgpack
import zmq
import zmq.asyncio

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.aio_handshake import AsyncHandshake
from kvmaster._client.aio_tasks import AsyncParting, HeartbeatTask, end_message, retrieve
from kvmaster._client.policy import (
    CLOCK,
    RoundPlan,
    heartbeat_request,
    next_pause,
    request_error,
    resend_allowed,
    too_late_to_send,
)
from kvmaster._core import (
    BUSY_FIRST_PAUSE_S,
    ClientConfig,
    ClientCore,
    NoWait,
    OpGen,
    Request,
    RoutingChanged,
    op_name,
    operations,
)
from kvmaster._frames import LINK_LOST, NOBLOCK, LinkMonitor, readable, recv_frames
from kvmaster.protocol import Op, Status

__all__ = ["AsyncClient"]

log = logging.getLogger(__name__)

_packb = msgpack.Packer(use_bin_type=True).pack


_BUSY = Status.BUSY
_LIST_SEGMENTS = Op.LIST_SEGMENTS.value


def _unanswered(slots: list[int], futs: list[asyncio.Future[Any]]) -> list[int]:
    """The slots of a round's requests with no answer yet: not sent, no reply, or BUSY."""
    out = []
    for n, i in enumerate(slots):
        fut = futs[n] if n < len(futs) else None
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None \
                or fut.result()[0] == _BUSY:
            out.append(i)
    return out


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
        #: NoWait requests (failed puts' revokes): sent from the event loop, tried
        #: again when refused or lost (:class:`~kvmaster._client.aio_tasks.AsyncParting`).
        self._parts = AsyncParting(self)
        #: The LIST_SEGMENTS in flight, which concurrent calls share (see _exchange).
        self._listing: asyncio.Future[Any] | None = None
        self._reader: asyncio.Task[Any] | None = None
        #: The current socket's monitor: its connection to the master closing ends the
        #: calls waiting on it (see :meth:`_check_monitor`).
        self._link: LinkMonitor | None = None
        self._heartbeat: asyncio.Task[Any] | None = None
        self._connections = itertools.count(1)
        #: Connect, mount, re-mount, and the re-handshake that calls share
        #: (:class:`~kvmaster._client.aio_handshake.AsyncHandshake`).
        self._handshake = AsyncHandshake(self)
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
        self._handshake.lock = asyncio.Lock()
        try:
            await self._handshake.connect()
            await self._handshake.mount()
        except BaseException:
            await self.close()
            raise
        self._heartbeat = asyncio.get_running_loop().create_task(
            HeartbeatTask(self).run(), name=f"kvmaster-heartbeat-{self.client_id}")

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
        for task in (self._heartbeat, self._handshake.task):
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
                listing.add_done_callback(retrieve)
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
            raise too_late_to_send(reqs, limit, self.endpoint)
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
                            end_message(sock)
                        raise
                self._last_sent = sent_at = time.monotonic()
                gathered = asyncio.gather(*futs)
                # Retrieved whatever happens (a close() cancelling this call mid-wait
                # otherwise prints "exception was never retrieved" at exit).
                gathered.add_done_callback(retrieve)
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
                await asyncio.sleep(CLOCK.jitter(pause))  # jitter: not in step
                pause = next_pause(pause)
                # Reconnected meanwhile (heartbeat, another task)?  Then only to the
                # same master, with the same layout.
                sock = resend_allowed(self, routing, instance, sock, self._sock)
            except BaseException as exc:
                setattr(exc, "unanswered", slots)  # noqa: B010
                raise
        out: list[Any] = []
        error: E.RequestError | None = None
        for (op, _, _), req_id, (status, body) in zip(reqs, ids, replies):
            if status:
                err = request_error(status, body, op, req_id, self.endpoint)
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
                    await self._handshake.wait(deadline)
                except BaseException:
                    gen.close()
                    raise
            reqs = next(gen)
            while True:
                if type(reqs) is NoWait:
                    self._parts.send(reqs)
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
        SHUTTING_DOWN, or sent a reply too late to trust): the decisions are the
        :class:`~kvmaster._client.policy.RoundPlan`'s, as in the sync client.

        The round is sent again after a re-handshake, one shared by every task
        (:meth:`AsyncHandshake.reconnected_since`), and only when the new connection routes keys as
        the requests were built for: the plan reads the layout before anything is
        awaited, so it is the one the generator built them with (another task's
        re-handshake may be under way when this one fails); else RoutingChanged."""
        plan = RoundPlan(self, reqs, deadline)
        try:
            out = await self._exchange(reqs, None, plan.tolerant, plan.wait, plan.phases)
            if plan.trusted():
                return out
            # Too late to be sure the leader that gave it still leads (it may have been
            # paused and replaced): ask it, else find the leader again.
            if plan.past():
                raise plan.stale()
            if await self._still_leading(plan):
                return out
            why: BaseException = plan.stale()  # (logged by the re-handshake)
            plan.generation = self._generation  # one from now on, not an earlier one
        except (E.NotRegistered, E.Unavailable, E.ShuttingDown, E.TransportError) as e:
            if not plan.mended_by_rehandshake(e):
                raise
            why = e
        await self._handshake.reconnected_since(plan.generation, deadline, why)
        phases = plan.again()
        out = await self._exchange(reqs, None, plan.tolerant, deadline, phases)
        plan.check_again()
        return out

    async def _still_leading(self, plan: RoundPlan) -> bool:
        """Whether the master that sent a reply too late to be trusted still leads: a
        HEARTBEAT on the round's connection answered within the trust (see
        :meth:`RoundPlan.still_leads`).  (A new master process at the endpoint would not
        know this connection: it answers NOT_REGISTERED, so an answer is from the one
        that sent the reply.)"""
        if self._generation != plan.generation:
            return False
        phases: list[float] = []
        try:
            await self._exchange([heartbeat_request()], None, False, plan.wait, phases)
        except E.KVMasterError:
            return False
        return plan.still_leads(phases)

    @property
    def _rehandshaking(self) -> asyncio.Future[Any] | None:
        """The re-handshake in progress (or the last one)."""
        return self._handshake.task

    def _rehandshake_shared(self, why: BaseException | None = None) -> asyncio.Future[Any]:
        """The re-handshake in progress, or a new one (:meth:`AsyncHandshake.shared`)."""
        return self._handshake.shared(why)

    def _new_connection(self, same_master: bool) -> None:
        self._parts.new_connection(same_master)

    async def _rehandshake(self, why: BaseException | None = None) -> None:
        """HELLO again, remount, hook (:meth:`AsyncHandshake.rehandshake`)."""
        await self._handshake.rehandshake(why)

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
