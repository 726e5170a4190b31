"""The sync client's work besides its calls: the queue of NoWait requests (failed
puts' revokes) that whoever holds the client's lock sends (:class:`PartingQueue`),
and the heartbeat thread (:class:`Heartbeat`).  The decisions (when a refused or
unsent request goes out again, how the heartbeat paces and backs off) are
:mod:`kvmaster._client.policy`'s."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from kvmaster import errors as E
from kvmaster import protocol as P
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
from kvmaster._frames import NOBLOCK, readable, recv_frames
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster.client import Client

log = logging.getLogger("kvmaster.client")

_packb = msgpack.Packer(use_bin_type=True).pack

#: How a request is sent: ``send(sock, frames, endpoint)``, never blocking (a full
#: send queue raises Timeout).
Send = Callable[[Any, Sequence[bytes], str], None]


class PartingQueue:
    """NoWait requests to send without waiting for their replies.

    ``queue`` holds ``(due, request, first sent, next pause)`` of those to send;
    whoever holds the client's lock sends those due (:meth:`tend`: a call at its start,
    the heartbeat thread).  A call that could not take the lock back after a BUSY
    pause appends to it without the lock.  ``sent`` maps the req_id of each one sent to
    ``(request, first sent, next pause, sent)``, until answered."""

    def __init__(self, clock: Clock = CLOCK) -> None:
        self.clock = clock
        self.queue: collections.deque[tuple[float, Request, float, float]] = \
            collections.deque(maxlen=MAX_PARTING)
        self.sent: dict[int, tuple[Request, float, float, float]] = {}

    def __bool__(self) -> bool:
        return bool(self.queue or self.sent)

    def add(self, reqs: Iterable[Request]) -> None:
        """Queue requests due now (a NoWait round)."""
        now = self.clock.now()
        self.queue.extend((now, r, now, BUSY_FIRST_PAUSE_S) for r in reqs)

    def tend(self, sock: Any, ids: Iterable[int], send: Send, endpoint: str) -> float | None:
        """With the lock held: read the replies already waiting (a NoWait request
        refused BUSY goes back in the queue, due after its pause), send the queued
        requests that are due, without waiting for replies, and forget those sent more
        than PARTING_RETRY_S ago.  One that cannot be queued on the socket (a full send
        queue: the master is not reading) is queued again after its pause, like one
        refused BUSY; one sent on a connection that is replaced before its reply came
        is sent again on the new one (:meth:`new_connection`).  Returns when it sent
        the last one (None: none sent)."""
        sent = self.sent
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
                    self.reply(rid, status)
        now = self.clock.now()
        last: float | None = None
        parting = self.queue
        counter = iter(ids)
        for _ in range(len(parting)):
            item = parting.popleft()
            due, (op, route, fields), since, pause = item
            if due > now:
                parting.append(item)
                continue
            req_id = next(counter)
            try:
                send(sock, (op, route, _packb([req_id, *fields])), endpoint)
            except (E.Timeout, zmq.ZMQError) as exc:
                log.debug("%s not sent: %s", op_name(op), exc)
                self.later(item[1], since, pause, now)
                continue
            last = now
            sent[req_id] = (item[1], since, pause, now)
        for rid in [rid for rid, v in sent.items() if now - v[1] > PARTING_RETRY_S]:
            del sent[rid]
        while len(sent) > MAX_PARTING:
            del sent[next(iter(sent))]
        return last

    def new_connection(self, same_master: bool) -> None:
        """A WELCOME on a new connection: those sent and not answered go out again
        there if it is the same master process, else every request is dropped."""
        sent, self.sent = self.sent, {}
        if not same_master:
            self.queue.clear()
            return
        now = self.clock.now()
        self.queue.extend((now, req, since, pause) for req, since, pause, _ in sent.values()
                          if still_parting(since, now))

    def reply(self, req_id: int, status: int) -> None:
        """A reply to a NoWait request: refused BUSY, it is queued again, due a pause
        after it was sent (the reply may have waited in the socket); refused
        NOT_REGISTERED (the master forgot this client), it waits for the next WELCOME
        from the same master process (:meth:`new_connection`)."""
        item = self.sent.pop(req_id, None)
        if item is None:
            return
        if status == Status.NOT_REGISTERED:
            self.sent[req_id] = item
            return
        if status == Status.BUSY:
            req, since, pause, sent_at = item
            self.later(req, since, pause, sent_at)

    def later(self, req: Request, since: float, pause: float, after: float) -> None:
        """Queue a request again as :func:`~kvmaster._client.policy.part_again` says."""
        again = part_again(since, pause, after, self.clock)
        if again is not None:
            self.queue.append((again[0], req, since, again[1]))


class Heartbeat:
    """The heartbeat thread of a :class:`~kvmaster.Client`: while the client is idle it
    sends HEARTBEATs (and the NoWait requests due), finishes a re-handshake that did
    not, and re-handshakes when the master forgot the client or went silent, backing
    off between failed attempts.  It takes the client's lock for each, never waiting
    for it longer than a beat."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, daemon=True,
                                       name=f"kvmaster-heartbeat-{self.client.client_id}")
        self.thread.start()

    def join(self) -> None:
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=2)

    def run(self) -> None:
        c = self.client
        closing = c._closing
        lock = c._lock
        backoff = BEAT_FIRST_BACKOFF_S
        pause = 0.0
        while not closing.is_set():
            if pause:
                # Back off outside the lock so calls can run (and time out) meanwhile.
                if closing.wait(pause):
                    return
                pause = 0.0
            interval = beat_interval(c.welcome)
            if closing.wait(min(interval, 1.0)):
                return
            if c._parts and lock.acquire(timeout=interval):
                # Revokes of failed puts refused BUSY go out again while the client is
                # idle too.
                try:
                    if not closing.is_set():
                        c._tend_parting()
                except Exception:
                    log.exception("sending revokes failed")
                finally:
                    lock.release()
            if CLOCK.now() - c._last_sent < interval:
                continue
            if not lock.acquire(timeout=interval):
                continue
            try:
                if closing.is_set():
                    return
                try:
                    if c.welcome is None or c._sock is None:
                        # A reconnect failed earlier (e.g. a partition): finish it.
                        c._rehandshake()
                    else:
                        c._exchange([heartbeat_request()],
                                    beat_timeout(c.config.timeout_s, interval))
                    backoff = BEAT_FIRST_BACKOFF_S
                except (E.NotRegistered, E.Unavailable) as e:
                    c._rehandshake(None, e)
                except (E.TransportError, E.ShuttingDown) as e:
                    # Master silent or stopping: try a fresh connection, doubling the
                    # wait.
                    try:
                        c._rehandshake(None, e)
                        backoff = BEAT_FIRST_BACKOFF_S
                    except E.KVMasterError:
                        backoff = beat_backoff(backoff, c.config.reconnect_max_backoff_s)
                        pause = backoff
            except E.RequestError as exc:
                # A re-handshake whose re-mount the master refused to the end (see
                # Handshake.remount): said, and the beat goes on after a pause.
                backoff = beat_backoff(backoff, c.config.reconnect_max_backoff_s)
                pause = backoff
                log.warning("re-handshake with master %s incomplete: %s", c.endpoint, exc)
            except Exception:
                log.exception("heartbeat failed")
            finally:
                lock.release()
