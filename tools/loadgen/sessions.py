"""Conversation sessions of a replay: inference, lifecycle and retention policy.

The :class:`SessionPlanner` sees the requests in arrival order, one at a time,
and turns them into :class:`Task` records for the workers: one ``request``
task per request, plus ``pin``, ``unpin`` and ``close`` tasks that fall due in *trace*
time (the dispatcher passes the trace clock to :meth:`SessionPlanner.advance`,
so at ``--speed 0`` an idle time of 300 s is 300 s of the trace, not of the
wall clock).

Sessions.  A request with a ``session`` (kv-cache-tester, synthetic) belongs to
that conversation.  A request without one (Mooncake) is matched online, using
only earlier requests: it continues the conversation of the earlier request
whose full blocks are the deepest leading run of its own blocks, provided that
earlier request wrote at least one of those full blocks itself (a request that
only carries a shared system prompt starts nothing).  The match may be an
older turn of the conversation (a rollback); otherwise the request starts a
new session.  A session ends when the trace marks its last request
(``last_in_session``) or after ``end_idle_s`` of trace time without a request,
and at the end of the replay.  A conversation that comes back after its
session ended gets a new session id.

Members.  A session's members are the *full* blocks of its latest request:
written blocks are tagged, prefix hits beyond the blocks the session already
holds are attached, and when the new request does not extend the previous
one (truncation, compaction, rollback, a context reset) the session is updated
to the new keep set.  Partial last blocks are written untagged: the next turn
re-hashes them, so pinning them would only waste pinned capacity.

Retention (``--retention``):

* ``none``: no pins; the master's LRU decides.
* ``session-pin``: pin a session after each of its requests once it has had
  ``pin_min_turns`` requests (a conversation that came back once is more likely
  to come back again), unpin it after ``idle_s`` of trace time without a
  request.
* ``ttl-pin``: no session pins; every written block carries the master's native
  soft-pin TTL of ``idle_s`` trace seconds (converted to wall time by the
  dispatcher).
* ``session-oracle``: clairvoyant diagnosis, not a policy: pin a session after a
  request exactly when the trace continues that session later, unpin it when
  it does not.  It shows what perfect pin decisions would buy on the master.
* ``lifecycle``: follows the agent loop from what a serving engine sees, never
  the future.  A reply that stopped for a tool call (``stop`` = ``tool_use``)
  will be followed within the tool's run time, so the session is pinned after
  it (unpinned if ``idle_s`` passes without the next request); a reply that
  ended the turn (``end_turn``, or no stop reason) waits for a person, so the
  session stays pinned for only ``grace_s`` more.  While a sub-agent
  (``parent_session``) is open, its parent is pinned (a ``pin`` task when the
  sub-agent starts, if needed) and none of the parent's unpin timers fire;
  when its last sub-agent closes, the parent's ``idle_s`` bound starts again.
  Context resets and compactions update the session to the new keep set, as
  under every policy, and the conversation's end closes it.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .traces import Request

logger = logging.getLogger(__name__)

__all__ = [
    "RETENTIONS",
    "STOP_TOOL_USE",
    "SessionPlanner",
    "SessionPolicy",
    "Task",
    "continued_requests",
]

#: Values of ``--retention``.
RETENTIONS = ("none", "session-pin", "ttl-pin", "session-oracle", "lifecycle")
#: Stop reason of a reply that called a tool (the agent loop continues by itself).
STOP_TOOL_USE = "tool_use"


@dataclass(frozen=True)
class SessionPolicy:
    """How sessions are used (see the module docstring).  Times are trace seconds.

    ``sessions``: run the session calls at all (tag, attach, update, pin, close);
    off replays plain block traffic.  ``grace_s``: ``lifecycle``, how long a
    session stays pinned after a reply that ended the turn.
    """

    retention: str = "none"
    idle_s: float = 300.0
    end_idle_s: float = 1800.0
    pin_min_turns: int = 2
    sessions: bool = True
    grace_s: float = 5.0

    def validate(self) -> None:
        """Raise ``ValueError`` for out-of-range settings."""
        if self.retention not in RETENTIONS:
            raise ValueError(f"retention must be one of {', '.join(RETENTIONS)}, "
                             f"got {self.retention!r}")
        for name in ("idle_s", "end_idle_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0, got {v}")
        if not (self.grace_s >= 0 and math.isfinite(self.grace_s)):
            raise ValueError(f"grace_s must be a finite number >= 0, got {self.grace_s}")
        if self.pin_min_turns < 1:
            raise ValueError(f"pin_min_turns must be >= 1, got {self.pin_min_turns}")
        if self.retention in ("session-pin", "session-oracle", "lifecycle") and not self.sessions:
            raise ValueError(f"retention {self.retention} needs the session calls (--sessions)")


@dataclass(slots=True)
class Task:
    """One unit of work for a worker, in the order a session needs them.

    ``kind``: ``request``, ``pin``, ``unpin`` or ``close``.  For a request: ``index`` in
    the trace, its ``hash_ids``, ``member_prefix`` (leading blocks the session
    already holds), ``tag_blocks`` (leading blocks that become members: its full
    blocks), ``trim`` (update membership to those blocks afterwards) and ``pin``
    (True pin, False unpin, None leave).  ``session`` is the planner's session
    id; it orders and routes the tasks even when the session calls are off.
    """

    kind: str
    session: str | None
    t_ms: float
    index: int = -1
    hash_ids: list[int] = field(default_factory=list)
    member_prefix: int = 0
    tag_blocks: int = 0
    trim: bool = False
    pin: bool | None = None


class _Session:
    __slots__ = ("sid", "members", "turns", "last_ms", "pinned", "version", "index_keys",
                 "explicit", "closed", "parent", "children", "unpin_at")

    def __init__(self, sid: str, explicit: str | None) -> None:
        self.sid = sid
        self.members: list[int] = []
        self.turns = 0
        self.last_ms = 0.0
        self.pinned = False
        self.version = 0
        self.index_keys: list[int] = []
        self.explicit = explicit
        self.closed = False
        self.parent: _Session | None = None
        self.children = 0  # open sub-agent sessions started from this one
        self.unpin_at = math.nan  # due time of the one unpin timer that counts


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionPlanner:
    """Online session tracker; owned and called by the dispatcher only (one thread).

    ``continued``: for ``session-oracle``, the trace positions whose session
    has a later request (see :func:`continued_requests`).
    Counters (``created``, ``closed``, ``pins``, ``unpins``, ``trims``, ``linked``,
    ``parent_pins``: pins of a parent when its sub-agent started) describe what
    was planned; the workers report what the master answered.
    """

    def __init__(self, policy: SessionPolicy, prefix: str = "s",
                 continued: set[int] | None = None) -> None:
        policy.validate()
        if policy.retention == "session-oracle" and continued is None:
            raise ValueError("session-oracle needs the set of continued requests")
        self.policy = policy
        self.prefix = prefix
        self.continued = continued or set()
        self._live: dict[str, _Session] = {}
        self._explicit: dict[str, _Session] = {}
        self._index: dict[int, tuple[_Session, int]] = {}
        self._seen: set[int] = set()
        self._timers: list[tuple[float, int, str, _Session, int]] = []
        self._timer_seq = 0
        self.session_ids: list[str] = []
        self.session_of: list[str] = []
        self._pin_refs: dict[int, int] = {}
        #: Distinct blocks held by pinned sessions, as planned (the master may have
        #: evicted some of them).
        self.pinned_blocks = 0
        self.counters = dict.fromkeys(
            ("created", "closed", "pins", "unpins", "trims", "linked", "max_live",
             "parent_pins"), 0)
        self.now_ms = -math.inf

    # ------------------------------------------------------------- internals

    def _new(self, explicit: str | None) -> _Session:
        sid = f"{self.prefix}{len(self.session_ids)}"
        s = _Session(sid, explicit)
        self.session_ids.append(sid)
        self._live[sid] = s
        if explicit is not None:
            self._explicit[explicit] = s
        self.counters["created"] += 1
        self.counters["max_live"] = max(self.counters["max_live"], len(self._live))
        return s

    def _pin_count(self, blocks: Sequence[int], delta: int) -> None:
        refs = self._pin_refs
        for b in blocks:
            n = refs.get(b, 0) + delta
            if n:
                refs[b] = n
                if n == 1 and delta > 0:
                    self.pinned_blocks += 1
            else:
                del refs[b]
                self.pinned_blocks -= 1

    def _timer(self, due_ms: float, kind: str, s: _Session) -> None:
        if kind == "unpin":
            s.unpin_at = due_ms  # an earlier unpin timer of s no longer counts
        self._timer_seq += 1
        heapq.heappush(self._timers, (due_ms, self._timer_seq, kind, s, s.version))

    def _close(self, s: _Session, t_ms: float) -> Task:
        parent = s.parent
        if parent is not None and not parent.closed:
            parent.children -= 1
            if (not parent.children and parent.pinned
                    and self.policy.retention == "lifecycle"):
                # The sub-agent's result is back: the parent continues soon, or its
                # tool bound runs out.
                self._timer(t_ms + self.policy.idle_s * 1000.0, "unpin", parent)
        s.closed = True
        if s.pinned:
            self._pin_count(s.members, -1)
        s.pinned = False
        del self._live[s.sid]
        if s.explicit is not None and self._explicit.get(s.explicit) is s:
            del self._explicit[s.explicit]
        for h in s.index_keys:
            entry = self._index.get(h)
            if entry is not None and entry[0] is s:
                del self._index[h]
        self.counters["closed"] += 1
        return Task("close", s.sid, t_ms)

    def _match(self, req: Request) -> _Session | None:
        ids = req.hash_ids
        index = self._index
        for j in range(len(ids) - 1, -1, -1):
            entry = index.get(ids[j])
            if entry is not None and entry[1] == j + 1:
                return entry[0]
        return None

    # ------------------------------------------------------------------- API

    @property
    def live_sessions(self) -> int:
        return len(self._live)

    def advance(self, t_ms: float) -> list[Task]:
        """Tasks that fall due at or before trace time ``t_ms`` (unpins, closes)."""
        self.now_ms = max(self.now_ms, t_ms)
        out: list[Task] = []
        timers = self._timers
        while timers and timers[0][0] <= t_ms:
            due, _, kind, s, version = heapq.heappop(timers)
            if s.closed or s.version != version:
                continue  # the session was active again (or ended) since
            if kind == "unpin":
                if s.unpin_at != due:
                    continue  # re-armed since
                if s.children and self.policy.retention == "lifecycle":
                    continue  # a sub-agent still runs; its close re-arms the timer
                if s.pinned:
                    s.pinned = False
                    self._pin_count(s.members, -1)
                    self.counters["unpins"] += 1
                    out.append(Task("unpin", s.sid, due))
            else:
                out.append(self._close(s, due))
        return out

    def request(self, index: int, req: Request) -> list[Task]:
        """The request task of trace position ``index`` (plus a close if the trace
        says the conversation ends with it)."""
        pol = self.policy
        t_ms = req.timestamp_ms
        self.now_ms = max(self.now_ms, t_ms)
        ids = req.hash_ids
        full = req.full_blocks
        pre: list[Task] = []
        if req.session is not None:
            s = self._explicit.get(req.session)
            if s is None:
                s = self._new(req.session)
                parent = (self._explicit.get(req.parent_session)
                          if req.parent_session is not None else None)
                if parent is not None:
                    s.parent = parent
                    parent.children += 1
                    if (pol.retention == "lifecycle" and pol.sessions and not parent.pinned
                            and parent.members):
                        # The parent waits on this sub-agent: keep its context.
                        parent.pinned = True
                        self._pin_count(parent.members, 1)
                        self.counters["pins"] += 1
                        self.counters["parent_pins"] += 1
                        pre.append(Task("pin", parent.sid, t_ms))
        else:
            s = self._match(req)
            if s is None:
                s = self._new(None)
            else:
                self.counters["linked"] += 1
            if full and any(h not in self._seen for h in ids[:full]):
                self._index[ids[full - 1]] = (s, full)
                s.index_keys.append(ids[full - 1])
            self._seen.update(ids)
        self.session_of.append(s.sid)
        keep = ids[:full]
        member_prefix = _common_prefix(s.members, keep)
        trim = member_prefix < len(s.members)
        if trim:
            self.counters["trims"] += 1
        was_pinned = s.pinned
        if was_pinned:
            self._pin_count(s.members, -1)
        s.members = keep
        s.turns += 1
        s.last_ms = t_ms
        s.version += 1
        pin: bool | None = None
        # lifecycle: how long the session stays pinned after this request
        wait_s = pol.idle_s if req.stop == STOP_TOOL_USE or s.children else pol.grace_s
        if pol.sessions and full:
            if pol.retention == "session-pin" and s.turns >= pol.pin_min_turns:
                pin = True
            elif pol.retention == "session-oracle":
                # Pin what will be continued; unpin (only) what was pinned and will not.
                pin = True if index in self.continued else (False if s.pinned else None)
            elif pol.retention == "lifecycle":
                pin = True if wait_s > 0 else (False if s.pinned else None)
        if pin and not s.pinned:
            self.counters["pins"] += 1
        elif pin is False and s.pinned:
            self.counters["unpins"] += 1
        if pin is not None:
            s.pinned = pin
        if s.pinned:
            self._pin_count(keep, 1)
        if s.pinned and pol.retention == "session-pin":
            self._timer(t_ms + pol.idle_s * 1000.0, "unpin", s)
        elif s.pinned and pol.retention == "lifecycle":
            self._timer(t_ms + wait_s * 1000.0, "unpin", s)
        task = Task("request", s.sid, t_ms, index, ids,
                    member_prefix, full, trim and pol.sessions, pin)
        if req.last_in_session:
            return [*pre, task, self._close(s, t_ms)]
        self._timer(t_ms + pol.end_idle_s * 1000.0, "close", s)
        return [*pre, task]

    def finish(self, t_ms: float | None = None) -> list[Task]:
        """Close every session still open (end of the replay)."""
        t = self.now_ms if t_ms is None else t_ms
        out = [self._close(s, t) for s in list(self._live.values())]
        self._timers.clear()
        return out

    def plan(self, requests: Iterable[Request]) -> list[Task]:
        """Every task of a replay in trace order, as a sequential replay would issue them."""
        out: list[Task] = []
        for i, req in enumerate(requests):
            out.extend(self.advance(req.timestamp_ms))
            out.extend(self.request(i, req))
        out.extend(self.finish())
        return out


def continued_requests(requests: Sequence[Request], policy: SessionPolicy) -> set[int]:
    """Trace positions whose session (as the planner assigns them) has a later request.

    Uses the whole trace: only for the clairvoyant ``session-oracle``.
    """
    probe = SessionPlanner(SessionPolicy(idle_s=policy.idle_s, end_idle_s=policy.end_idle_s,
                                         sessions=policy.sessions))
    probe.plan(requests)
    last: dict[str, int] = {}
    for i, sid in enumerate(probe.session_of):
        last[sid] = i
    return {i for i, sid in enumerate(probe.session_of) if last[sid] != i}
