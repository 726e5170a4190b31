"""One connection of the sync client: its DEALER, the monitor of its TCP or ipc
link, and a :func:`select.poll` on both (:class:`Wire`).  Requests are sent and
replies read without ever blocking inside pyzmq."""

from __future__ import annotations

import collections
import math
import select
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgpack
import zmq

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.policy import CLOCK, Clock
from kvmaster._client.records import Request, op_name
from kvmaster._frames import LINK_LOST, NOBLOCK, LinkMonitor, readable, recv_frames

_packb = msgpack.Packer(use_bin_type=True).pack

#: How a message is sent: ``send(sock, frames, endpoint)``, never blocking (a full
#: send queue raises Timeout).
Send = Callable[[Any, Sequence[bytes], str], None]


class Wire:
    """The socket of one connection to the master, with its monitor (None without
    one): the connection closing while a call waits ends the call
    (:meth:`next_reply`)."""

    def __init__(self, sock: zmq.Socket[Any], link: LinkMonitor | None,
                 clock: Clock = CLOCK) -> None:
        self.sock = sock
        self.link = link
        self.clock = clock
        #: Replies received in a message of several and not yet taken (protocol 1.2).
        self.stash: collections.deque[tuple[int, int, Any]] = collections.deque()
        #: The connection closed since the requests being waited for were sent.
        self.down = False
        self.poller = select.poll()
        self.poller.register(int(sock.getsockopt(zmq.FD)), select.POLLIN)
        if link is not None:
            self.poller.register(int(link.socket.getsockopt(zmq.FD)), select.POLLIN)

    def close(self) -> None:
        """Close the monitor and the DEALER (left open, the monitor would make the
        context's term() wait for ever)."""
        if self.link is not None:
            self.link.close()
            self.link = None
        self.sock.close(linger=0)

    def disconnected(self) -> bool:
        """True if the connection to the master closed since the requests being waited
        for were sent (see :meth:`kvmaster._frames.LinkMonitor.lost`)."""
        link = self.link
        if link is not None and link.lost():
            self.down = True
        return self.down

    def before_send(self) -> None:
        """Read the monitor's events before a send with nothing in flight: a disconnect
        before it says nothing of the requests it sends, which the socket queues until
        it reconnects (a master restarted on the endpoint then answers NOT_REGISTERED,
        and the call re-handshakes)."""
        link = self.link
        if link is not None:
            link.lost()
        self.down = False

    def send_all(self, reqs: list[Request], slots: Iterable[int], pending: dict[int, int],
                 ids: Iterable[int], cap: int, send: Send, endpoint: str) -> None:
        """Send ``reqs[i]`` for each slot, recording ``pending[req_id] = i``: as one
        message of up to ``cap`` requests (MAX_REQUESTS_PER_MESSAGE when the master takes
        that, protocol 1.2, else 1).  A slot is recorded only once sent."""
        counter = iter(ids)
        sock = self.sock
        frames: list[bytes] = []
        sent: list[tuple[int, int]] = []
        for i in slots:
            op, route, fields = reqs[i]
            req_id = next(counter)
            frames += (op, route, _packb([req_id, *fields]))
            sent.append((req_id, i))
            if len(sent) == cap:
                send(sock, frames, endpoint)
                pending.update(sent)
                frames, sent = [], []
        if sent:
            send(sock, frames, endpoint)
            pending.update(sent)

    def next_reply(self, deadline: float, limit: float, op: bytes,
                   endpoint: str) -> tuple[int, int, Any]:
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
        sock = self.sock
        stash = self.stash
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
            if self.disconnected():
                if readable(sock):  # a reply that came before the close: take it first
                    continue
                raise E.ConnectionLost(LINK_LOST, op=op_name(op), endpoint=endpoint)
            left_ms = math.ceil((deadline - self.clock.now()) * 1000)
            if left_ms <= 0:
                raise E.Timeout(f"no reply within {limit:.3g} s", op=op_name(op),
                                endpoint=endpoint) from None
            self.poller.poll(left_ms)  # on the FDs of the socket and its monitor
