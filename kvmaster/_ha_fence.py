"""Reply fencing of an HA leader (kvmaster/ha.py elects it; HA.md, "Fencing").

A leader's reply goes out only while its lease is surely alive for ``trust_s`` more
(the time a client trusts a reply giving out space): so a reply the client uses was
sent by a leader whose lease outlives its receipt.  Closer to the end of the lease
(after a pause: GC, SIGSTOP, a VM freeze; or slow renewals) replies are held, up to
MAX_HELD_REPLIES messages, and the election thread is asked to renew at once; the
renewal sends them (the lease never lapsed: nothing they say is stale).  Past
``valid_until`` the lease may have lapsed and another master may lead: every reply,
held or new, is replaced by SHUTTING_DOWN.
"""

from __future__ import annotations

from typing import Any

from kvmaster import protocol as P
from kvmaster.protocol import Status

#: Reply messages an HA leader holds while its lease awaits renewal; past it, replies
#: are refused SHUTTING_DOWN.
MAX_HELD_REPLIES = 65536

#: :meth:`ReplyFence.verdict`: send now, hold until the renewal, or refuse.
SEND, HOLD, LAPSED = 0, 1, 2


def fenced(frames: tuple[bytes, ...] | list[bytes]) -> list[bytes]:
    """``[op, payload, ...]`` with each reply replaced by SHUTTING_DOWN (same req_id)."""
    out: list[bytes] = []
    for i in range(0, len(frames) - 1, 2):
        out += (frames[i], P.encode_reply(P.peek_req_id(frames[i + 1]), Status.SHUTTING_DOWN,
                                          "leader lease lapsed: ask etcd for the leader"))
    return out


class ReplyFence:
    """The lease that fences a leader's replies, and the replies held for its renewal.

    Owned by the front (kvmaster/_front.py) and used on the event loop thread only;
    ``lease`` is the election once this master has led (None before, and once the
    client socket is closed)."""

    __slots__ = ("held", "lease")

    def __init__(self) -> None:
        self.lease: Any = None
        #: Replies held until the lease is renewed: ``(identity, frames)``, at most
        #: MAX_HELD_REPLIES messages.
        self.held: list[tuple[bytes, Any]] = []

    def verdict(self, now: float) -> int:
        """SEND while the lease is surely alive for ``trust_s`` more, HOLD until its
        ``valid_until``, LAPSED past it (``now``: ``time.monotonic()``)."""
        lease = self.lease
        if now <= lease.valid_until - lease.trust_s:
            return SEND
        return HOLD if now <= lease.valid_until else LAPSED

    def hold(self, identity: bytes, frames: Any) -> bool:
        """Hold a reply until the renewal (asked for at the first one held); False when
        MAX_HELD_REPLIES are held already."""
        if len(self.held) >= MAX_HELD_REPLIES:
            return False
        if not self.held:
            self.lease.renew_now()
        self.held.append((identity, frames))
        return True

    def take_held(self) -> list[tuple[bytes, Any]]:
        """The held replies, oldest first; none are held after."""
        held, self.held = self.held, []
        return held
