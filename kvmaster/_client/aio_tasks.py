"""The async client's work besides its calls: NoWait requests (failed puts'
revokes) sent from the event loop and tried again when refused or lost
(:class:`AsyncParting`), and the heartbeat task (:class:`HeartbeatTask`).  The
decisions (when a refused or unsent request goes out again, how the heartbeat paces
and backs off) are :mod:`kvmaster._client.policy`'s."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import msgpack
import zmq
import zmq.asyncio

from kvmaster import errors as E
from kvmaster._client.policy import (
    BEAT_FIRST_BACKOFF_S,
    BUSY_FIRST_PAUSE_S,
    CLOCK,
    Clock,
    beat_backoff,
    beat_interval,
    beat_timeout,
    heartbeat_request,
    part_again,
    still_parting,
)
from kvmaster._client.records import MAX_PARTING, PARTING_RETRY_S, Request, op_name
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster.aio import AsyncClient

log = logging.getLogger("kvmaster.aio")

_packb = msgpack.Packer(use_bin_type=True).pack


def retrieve(fut: asyncio.Future[Any]) -> None:
    """Take a future's exception, so that none is reported as never retrieved."""
    if not fut.cancelled():
        fut.exception()


def end_message(sock: zmq.asyncio.Socket) -> None:
    """End a message an exception may have left open (pyzmq runs Python signal handlers
    after queuing each frame; one that raises can stop ``send_multipart`` half way, and
    the next request's frames would be glued on): an empty frame, which the master
    refuses as malformed with req_id 0.  Not awaited: a non-blocking send is done at
    once (Again, when the message never started on a full pipe, is dropped)."""
    f = cast("asyncio.Future[Any]", sock.send(b"", flags=zmq.NOBLOCK))
    f.add_done_callback(retrieve)


class AsyncParting:
    """NoWait requests of an :class:`~kvmaster.aio.AsyncClient`, each sent at once
    (non-blocking) and, when it cannot be queued (a full send queue) or its reply is
    BUSY, again after a pause (:func:`~kvmaster._client.policy.part_again`); one whose
    connection is replaced before its reply came goes in :attr:`lost`, sent again on
    the next connection to the same master process (:meth:`new_connection`)."""

    def __init__(self, client: AsyncClient, clock: Clock = CLOCK) -> None:
        self.client = client
        self.clock = clock
        #: ``(request, first sent, next pause, master instance)`` of those to send again
        #: on the next connection (also those a new connection got before its WELCOME).
        self.lost: collections.deque[tuple[Request, float, float, str | None]] = \
            collections.deque(maxlen=MAX_PARTING)

    def send(self, reqs: Iterable[Request]) -> None:
        """Send requests without waiting for their replies (see NoWait)."""
        now = self.clock.now()
        instance = self.client._master_instance
        for req in reqs:
            self.part(req, now, BUSY_FIRST_PAUSE_S, instance)

    def part(self, req: Request, since: float, pause: float, instance: str | None) -> None:
        """Send one request now; ``since``: its first send; ``instance``: the master
        process it is for, never sent to another."""
        c = self.client
        sock = c._sock
        if sock is None or c._closing or instance != c._master_instance:
            return
        op, route, fields = req
        req_id = next(c._ids)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        c._pending[req_id] = fut
        try:
            sent = cast("asyncio.Future[Any]", sock.send_multipart(
                (op, route, _packb([req_id, *fields])), flags=zmq.NOBLOCK))
        except zmq.ZMQError as exc:
            c._pending.pop(req_id, None)
            log.debug("%s not sent: %s", op_name(op), exc)
            self.later(req, since, pause, instance)
            return
        except BaseException:
            c._pending.pop(req_id, None)
            end_message(sock)
            raise
        sent.add_done_callback(retrieve)
        if sent.done() and (sent.cancelled() or sent.exception() is not None):
            c._pending.pop(req_id, None)  # Again: the send queue is full
            self.later(req, since, pause, instance)
            return
        fut.add_done_callback(functools.partial(self.parted, req, since, pause, instance))
        # A reply that never comes (master gone): forget the request.
        loop.call_later(PARTING_RETRY_S, self.forget, req_id, fut)

    def parted(self, req: Request, since: float, pause: float, instance: str | None,
               fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        closing = self.client._closing
        exc = fut.exception()
        if exc is not None:
            if isinstance(exc, E.ConnectionLost) and not closing:
                self.lost.append((req, since, pause, instance))
            return
        status = fut.result()[0]
        if status == Status.BUSY:
            self.later(req, since, pause, instance)
        elif status == Status.NOT_REGISTERED and not closing:
            # Sent on a new connection before its WELCOME: again once it comes.
            self.lost.append((req, since, pause, instance))

    def later(self, req: Request, since: float, pause: float, instance: str | None) -> None:
        if self.client._closing:
            return
        now = self.clock.now()
        again = part_again(since, pause, now, self.clock)
        if again is not None:
            asyncio.get_running_loop().call_later(again[0] - now, self.part, req, since,
                                                  again[1], instance)

    def new_connection(self, same_master: bool) -> None:
        lost, self.lost = self.lost, collections.deque(maxlen=MAX_PARTING)
        if not same_master:
            return
        loop = asyncio.get_running_loop()
        now = self.clock.now()
        for req, since, pause, instance in lost:
            if still_parting(since, now):
                loop.call_soon(self.part, req, since, pause, instance)

    def forget(self, req_id: int, fut: asyncio.Future[Any]) -> None:
        pending = self.client._pending
        if pending.get(req_id) is fut:
            del pending[req_id]
        fut.cancel()


class HeartbeatTask:
    """The heartbeat of an :class:`~kvmaster.aio.AsyncClient`, a task: while the
    client is idle it sends HEARTBEATs, finishes a re-handshake that did not, and
    re-handshakes (one shared with the calls) when the master forgot the client or
    went silent, backing off between failed attempts."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def run(self) -> None:
        c = self.client
        backoff = BEAT_FIRST_BACKOFF_S
        while not c._closing:
            interval = beat_interval(c.welcome)
            await asyncio.sleep(min(interval, 1.0))
            if CLOCK.now() - c._last_sent < interval:
                continue
            generation = c._generation
            try:
                if c.welcome is None or c._sock is None:
                    await c._rehandshake_shared()
                else:
                    await c._exchange([heartbeat_request()],
                                      beat_timeout(c.config.timeout_s, interval))
                backoff = BEAT_FIRST_BACKOFF_S
            except (E.NotRegistered, E.Unavailable) as e:
                task = c._handshake.since(generation, e)
                if task is not None:
                    await task
            except (E.TransportError, E.ShuttingDown) as e:  # master silent or stopping
                try:
                    task = c._handshake.since(generation, e)
                    if task is not None:
                        await task
                    backoff = BEAT_FIRST_BACKOFF_S
                except E.KVMasterError:
                    backoff = beat_backoff(backoff, c.config.reconnect_max_backoff_s)
                    await asyncio.sleep(backoff)
            except asyncio.CancelledError:
                raise
            except E.RequestError as exc:
                # A re-handshake whose re-mount the master refused to the end (see
                # AsyncHandshake.remount): said, and the beat goes on after a pause.
                backoff = beat_backoff(backoff, c.config.reconnect_max_backoff_s)
                log.warning("re-handshake with master %s incomplete: %s", c.endpoint, exc)
                await asyncio.sleep(backoff)
            except Exception:
                log.exception("heartbeat failed")
