"""The retry and round policy of the clients, written once for both drivers.

What a round does when the master refuses, stops answering or answers too late, how
long requests refused BUSY wait before going out again, what a NoWait request (a
failed put's revoke) does when it cannot be sent or is refused, and how the
heartbeat backs off: each is decided here, and :mod:`kvmaster.client` and
:mod:`kvmaster.aio` only do the socket I/O (block or await) around the decisions.

The policy reads the time and draws its jitter from a :class:`Clock`; a test gives
one of its own (a fake time, no chance) to an object here or to a function's
``clock``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.records import (
    BUSY_FIRST_PAUSE_S,
    BUSY_MAX_PAUSE_S,
    PARTING_RETRY_S,
    Request,
    Tolerant,
    master_changed,
    op_name,
)

if TYPE_CHECKING:
    from kvmaster._client.connection import Connection
    from kvmaster._client.records import Welcome

_Sock = TypeVar("_Sock")

#: Seconds one HELLO attempt may take while looking for an HA leader.
HA_ATTEMPT_S = 1.0

#: The first and the longest pause (s) of the heartbeat between failed re-handshakes
#: (at most ``ClientConfig.reconnect_max_backoff_s``).
BEAT_FIRST_BACKOFF_S = 0.1


class Clock:
    """The monotonic time and the jitter the policy reads."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    def jitter(self, pause: float) -> float:
        """``pause`` shortened by up to half, at random: clients refused together do not
        come back in step."""
        return pause * random.uniform(0.5, 1.0)


#: The clock of every client (tests substitute theirs where a policy object takes one).
CLOCK = Clock()


def ha_reserve(timeout_s: float) -> float:
    """With HA, the part of a call's timeout (s) a round leaves for a failover: a
    quarter, at most HA_ATTEMPT_S."""
    return min(HA_ATTEMPT_S, timeout_s / 4)


def next_pause(pause: float) -> float:
    """The BUSY pause after ``pause``: doubled, at most BUSY_MAX_PAUSE_S."""
    return min(pause * 2, BUSY_MAX_PAUSE_S)


def request_error(status: int, body: Any, op: bytes, req_id: int,
                  endpoint: str) -> E.RequestError:
    """The exception of a reply with a non-zero status."""
    return E.error_for(status, body if isinstance(body, str) else str(body),
                       op=op_name(op), req_id=req_id, endpoint=endpoint)


def too_late_to_send(reqs: list[Request], limit: float, endpoint: str) -> E.Timeout:
    return E.Timeout(f"the call's timeout ({limit:.3g} s) passed before "
                     f"{op_name(reqs[0][0])} was sent", op=op_name(reqs[0][0]),
                     endpoint=endpoint)


def resend_allowed(core: Connection, routing: Any, instance: str | None,
                   sock_was: _Sock, sock_now: _Sock | None) -> _Sock:
    """After a BUSY pause, the socket to send the refused requests again on.  When
    another task or thread re-handshook meanwhile, they go out on the new connection
    if it is to the same master process with the same layout (they were not
    executed); else this raises ConnectionLost (client closed, reconnect not
    finished, another master process: no round mixes two masters' answers) or
    RoutingChanged (the call is built again)."""
    if sock_now is sock_was:
        return sock_was
    if sock_now is None:
        raise E.ConnectionLost("client closed during the call", endpoint=core.endpoint)
    if core.welcome is None:  # the reconnect has not succeeded (yet)
        raise E.ConnectionLost("the connection to the master was lost during the call",
                               endpoint=core.endpoint)
    if not instance or core._master_instance != instance:
        raise master_changed(core.endpoint)
    core._check_routing(routing)
    return sock_now


class RoundPlan:
    """The decisions of one round of a call (its requests, by its ``deadline``):

    * with HA, the first exchange waits until :func:`ha_reserve` before the deadline
      (:attr:`wait`), leaving that for finding the new leader and sending again;
    * a reply that gives out space or replica locations is trusted only when it came
      within the leader's ``trust_s`` (:meth:`trusted`); a late one is used only if
      the same leader still answers in time (:meth:`still_leads`);
    * a failure that a re-handshake may mend (:meth:`mended_by_rehandshake`) has the
      round sent again once on the new connection, if it routes keys as the requests
      were built for (:meth:`again`), else RoutingChanged.

    The layout, trust and connection are read when the plan is made, before anything
    of the round is sent or awaited: they are those the requests were built with."""

    __slots__ = (
        "clock",
        "core",
        "deadline",
        "generation",
        "phases",
        "routing",
        "tolerant",
        "trust",
        "wait",
    )

    def __init__(self, core: Connection, reqs: list[Request], deadline: float,
                 clock: Clock = CLOCK) -> None:
        self.core = core
        self.clock = clock
        self.deadline = deadline
        self.tolerant = type(reqs) is Tolerant
        self.routing = core._routing()
        self.trust = core._trust(reqs)
        self.generation = core._generation  # the connection the round goes out on
        self.wait = deadline
        if core.ha:
            reserve = ha_reserve(core.config.timeout_s)
            if deadline - reserve > clock.now():
                self.wait = deadline - reserve
        #: Durations of the send-and-wait phases of the exchange (when trust matters).
        self.phases: list[float] | None = None if self.trust is None else []

    def trusted(self) -> bool:
        """Whether the replies of the last exchange may be used as they are."""
        phases = self.phases
        return self.trust is None or (bool(phases) and max(phases) <= self.trust)  # type: ignore[arg-type]

    def stale(self) -> E.Timeout:
        assert self.trust is not None
        return self.core._stale(self.trust)

    def past(self) -> bool:
        return self.clock.now() >= self.deadline

    def still_leads(self, phases: list[float],
                    disconnected: Callable[[], bool] | None = None) -> bool:
        """Whether a HEARTBEAT on the round's connection, answered with ``phases``,
        shows the master that sent the late reply still leads: an HA master that loses
        its lease stops for good, and sends a reply only while its lease is surely
        alive for ``trust`` more; so one answering in time now has led without a break
        since it sent the late reply (HA.md, "Fencing").  A reconnect meanwhile (another
        generation) or a closed link (``disconnected()``, asked last) says no."""
        assert self.trust is not None
        return (self.core._generation == self.generation
                and (disconnected is None or not disconnected())
                and bool(phases) and max(phases) <= self.trust)

    def mended_by_rehandshake(self, exc: BaseException, may_wait: bool = True) -> bool:
        """Whether the round's failure ``exc`` calls for a re-handshake and one more
        try: the master does not know the client or does not serve; with HA also a
        master stopping, or (while the deadline and ``may_wait`` allow: the sync
        client must still hold its lock) one silent or gone.  False: raise it."""
        if isinstance(exc, (E.NotRegistered, E.Unavailable)):
            return True
        if isinstance(exc, E.ShuttingDown):
            return self.core.ha
        if isinstance(exc, E.TransportError):
            return self.core.ha and may_wait and not self.past()
        return False

    def again(self) -> list[float] | None:
        """Before the round goes out again after a re-handshake: RoutingChanged when the
        layout changed (requests built without one, master-level, go as they are);
        returns the new exchange's phases list."""
        if self.routing is not None:
            self.core._check_routing(self.routing)
        self.phases = None if self.trust is None else []
        return self.phases

    def check_again(self) -> None:
        """After the round went out again: its replies too late to trust raise."""
        if not self.trusted():
            raise self.stale()


class HelloPlan:
    """The HELLO attempts of one connect, which ends by ``connect_timeout_s`` (and, when
    given, ``deadline``): without HA one attempt; with ``etcd://`` short ones (at most
    HA_ATTEMPT_S: the leader key may still name a dead master until its lease runs
    out), 50 ms apart while an election settles, until the end."""

    #: The errors of an attempt that another one may mend (with HA).
    RETRY = (E.Unavailable, E.ShuttingDown, E.Timeout, E.ConnectionLost)

    __slots__ = ("clock", "core", "end", "limit", "started")

    def __init__(self, core: Connection, deadline: float | None = None,
                 clock: Clock = CLOCK) -> None:
        self.core = core
        self.clock = clock
        self.limit = core.config.connect_timeout_s
        self.started = clock.now()
        self.end = self.started + self.limit
        if deadline is not None:
            self.end = min(self.end, deadline)

    def left(self) -> float:
        return self.end - self.clock.now()

    def attempt(self, least: float = float("-inf")) -> float:
        """The timeout of the next HA attempt (at least ``least``)."""
        return min(self.limit, HA_ATTEMPT_S, max(least, self.left()))

    def pause(self, exc: BaseException) -> float:
        """The pause before the next attempt after ``exc``; none is left: raises the
        error of the whole connect (:meth:`Connection._hello_gave_up`)."""
        if self.clock.now() + 0.05 >= self.end:
            final = self.core._hello_gave_up(exc, self.started)
            if final is exc:
                raise exc
            raise final from exc
        return 0.05


def remount_pause(core: Connection, exc: BaseException, attempt: int,
                  deadline: float | None = None, clock: Clock = CLOCK) -> float | None:
    """After the master refused re-mount ``attempt`` with ``exc``: the pause before the
    next attempt, 0 to replace the segment by a fresh one and mount that once, None to
    raise ``exc`` (the refusal is final, or the pause would pass ``deadline``); see
    :meth:`Connection._mount_refused`."""
    pause = core._mount_refused(exc, attempt)
    if pause is None or (deadline is not None and clock.now() + pause >= deadline):
        return None
    return pause


def heartbeat_request() -> Request:
    return (P.Op.HEARTBEAT.value, P.MASTER_ROUTE, [])


def beat_interval(welcome: Welcome | None) -> float:
    """Seconds between heartbeats of an idle client: HEARTBEAT_LIVENESS per client TTL
    (1 s before the first WELCOME)."""
    return (welcome.client_ttl_ms / 1000 / P.HEARTBEAT_LIVENESS) if welcome else 1.0


def beat_timeout(timeout_s: float, interval: float) -> float:
    """How long a heartbeat waits for its reply."""
    return min(timeout_s, max(interval, 0.5))


def beat_backoff(backoff: float, most: float) -> float:
    """The heartbeat's next pause after a failed re-handshake: doubled, at most
    ``most`` (``ClientConfig.reconnect_max_backoff_s``)."""
    return min(backoff * 2, most)


def part_again(since: float, pause: float, after: float,
               clock: Clock = CLOCK) -> tuple[float, float] | None:
    """When a NoWait request that could not be sent, or was refused BUSY, goes out
    again: ``(due, next pause)``, due ``pause`` (jittered) after ``after``, the next
    pause doubled; None when that is PARTING_RETRY_S or more after ``since`` (its first
    send): it is dropped."""
    due = after + clock.jitter(pause)
    if due - since >= PARTING_RETRY_S:
        return None
    return due, next_pause(pause)


def still_parting(since: float, now: float) -> bool:
    """Whether a NoWait request first sent at ``since`` is still worth sending."""
    return now - since < PARTING_RETRY_S


__all__ = [
    "BEAT_FIRST_BACKOFF_S", "BUSY_FIRST_PAUSE_S", "CLOCK", "HA_ATTEMPT_S", "Clock",
    "HelloPlan", "RoundPlan", "beat_backoff", "beat_interval", "beat_timeout", "ha_reserve",
    "heartbeat_request", "next_pause", "part_again", "remount_pause", "request_error",
    "resend_allowed", "still_parting", "too_late_to_send",
]
