"""The master's front: the client socket's read loop, routing, and replies.

:class:`Front` owns what the ROUTER's traffic needs between a read and a send: the
per-request routing to a shard's bounded inbox (BUSY when full), the tenant request
rate's parked messages, the peers whose replies were dropped (stalled), the reply
groups of protocol 1.2 (:class:`ReplyGroup`), and the HA reply fence
(kvmaster/_ha_fence.py).  Master-level ops go to the registry (kvmaster/_registry.py);
the socket itself is bound and closed by the master's lifecycle (kvmaster/master.py).
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, cast

import msgpack
import zmq

from kvmaster import protocol as P
from kvmaster._frames import NOBLOCK, readable, recv_frames, send_frames
from kvmaster._ha_fence import HOLD, SEND, ReplyFence, fenced
from kvmaster._limits import Admission, RequestShaper
from kvmaster.protocol import Op, Status

if TYPE_CHECKING:
    from kvmaster._records import ClientView
    from kvmaster._registry import Registry
    from kvmaster.config import MasterConfig

# (the master's logger: --log-levels names it so for every line of the front)
log = logging.getLogger("kvmaster.master")


#: Keys of a batch request that count as one request more for the tenant request rate
#: (a batch's per-key work beside a request's fixed cost: kvmaster/_limits.py).
KEYS_PER_REQUEST_UNIT = 32
_INT_WIDTH = {0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9, 0xd0: 2, 0xd1: 3, 0xd2: 5, 0xd3: 9}


def _batch_len(payload: bytes) -> int:
    """The item count of a request's first field when it is an array (a batch's keys),
    read from the msgpack headers alone; 0 for anything else."""
    if len(payload) < 3:
        return 0
    b = payload[0]
    i = 1 if 0x90 <= b <= 0x9f else 3 if b == 0xdc else 5 if b == 0xdd else 0
    if not i or i >= len(payload):
        return 0
    r = payload[i]  # the request id
    width = 1 if r < 0x80 or r >= 0xe0 else _INT_WIDTH.get(r, 0)
    i += width
    if not width or i >= len(payload):
        return 0
    h = payload[i]
    if 0x90 <= h <= 0x9f:
        return h & 0x0f
    if h == 0xdc:
        return int.from_bytes(payload[i + 1:i + 3], "big")
    if h == 0xdd:
        return int.from_bytes(payload[i + 1:i + 5], "big")
    return 0


def _hello_tenant(frames: list[bytes]) -> str:
    """The tenant a lone HELLO message names (field 4 of its payload), for the request
    rate of a peer not yet registered; "" for anything else or what does not decode."""
    if len(frames) != 4 or frames[1] != Op.HELLO.value or len(frames[3]) > 4096:
        return ""
    try:
        fields = msgpack.unpackb(frames[3], raw=False)
    except Exception:  # noqa: BLE001 - refused later, with its own error
        return ""
    if type(fields) is list and len(fields) > 4 and type(fields[4]) is str:
        return fields[4]
    return ""


#: Most reply groups open at once (see ``Front.groups``).
MAX_REPLY_GROUPS = 65536
#: A reply group still waiting after this long (s) is sent with what it has.
REPLY_GROUP_MAX_AGE_S = 60.0


class MasterState(enum.Enum):
    STANDBY = "standby"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


#: Bytes of replies after which a reply group (protocol 1.2) is sent in parts, and the
#: size a reply message is planned to stay under (LIST pages: kvmaster/_sessions.py).
REPLY_MESSAGE_BYTES = 64 << 10


#: After a reply to a peer is dropped (its queue full, or it is gone), its requests of
#: the next STALLED_PEER_S are dropped without being handled (``stalled_dropped``); then
#: one is handled as a probe, and the others dropped until its reply is sent (the peer
#: reads again) or dropped (stalled again), or STALLED_PROBE_S passed.  At most
#: MAX_STALLED_PEERS are remembered (past it, forgotten all at once).
STALLED_PEER_S = 0.1
STALLED_PROBE_S = 1.0
MAX_STALLED_PEERS = 65536
#: A read call that drops or parks this many messages ends, and reading resumes after
#: UNHANDLED_PAUSE_S: a flood of them is read at about 64,000 messages per second at most.
UNHANDLED_BURST = 64
UNHANDLED_PAUSE_S = 0.001
#: Bytes a parked message is counted for beyond its frames' own, per frame (the bytes
#: object holding each), against the request rate's parking bounds.
PARKED_FRAME_OVERHEAD = 64
#: How long the client socket keeps sending queued replies once closed, s.
ROUTER_LINGER_S = 0.1


class ReplyGroup:
    """The replies of one request message of several requests from a 1.2 client: its
    routed requests' replies go back in one message once the last is in."""

    __slots__ = ("created", "frames", "identity", "outstanding", "size", "view")

    def __init__(self, identity: bytes, view: ClientView, created: float) -> None:
        self.identity = identity
        #: Replies still to come, plus one of the group's own until every request of
        #: the message is dispatched.
        self.outstanding = 1
        #: Reply frames gathered, ``[op, payload, ...]``, not yet sent.
        self.frames: list[bytes] = []
        #: The client's view whose replies join this group.
        self.view = view
        self.created = created  # monotonic
        self.size = 0  # bytes of payload in ``frames``

    def __repr__(self) -> str:
        return (f"ReplyGroup(identity={self.identity!r}, outstanding={self.outstanding}, "
                f"replies={len(self.frames) // 2}, size={self.size})")


class Front:
    """The client socket's traffic; runs on the master's event loop thread.

    ``master`` (kvmaster/master.py) holds the lifecycle: state, loop, shards, the
    CURVE authenticator and the HA election, which the front reads."""

    def __init__(self, master: Any, config: MasterConfig, counters: dict[str, int],
                 registry: Registry) -> None:
        self.master = master
        #: Clients and segments; answers the master-level ops (kvmaster/_registry.py).
        self.registry = registry
        self.config = config
        self.counters = counters
        #: The ROUTER, once bound (kvmaster/master.py).
        self.router: zmq.Socket | None = None
        #: Reply groups by id.  At most MAX_REPLY_GROUPS (past it, replies go one by
        #: one); a group still open after REPLY_GROUP_MAX_AGE_S (a reply lost with a
        #: shard process) is sent as it is by the housekeeping, and its late replies go
        #: one by one.
        self.groups: dict[int, ReplyGroup] = {}
        self._group_ids = itertools.count(1)
        #: identity -> its messages parked by the request rate (not expired meanwhile)
        self.parked_peers: dict[bytes, int] = {}
        #: ``time.monotonic()`` of the current read.
        self.now = time.monotonic()
        #: With CURVE, the z85 public key (ZAP User-Id) of the message being handled.
        self.user_id: str | None = None
        #: Inside :meth:`on_readable` (which drains every inbox before it returns).
        self.reading = False
        self._recheck_scheduled = False
        rate = config.tenant_max_requests_per_s
        #: --tenant-max-requests-per-s (kvmaster/_limits.py); its parked messages are
        #: ``(user_id, frames)`` and go out from the read loop, woken by ``_release``.
        self.shaper = RequestShaper(rate, max(64, int(rate / 4))) if rate > 0 else None
        self._release: Any = None
        self._pause: Any = None
        #: identity -> monotonic time until which its requests are dropped
        #: (STALLED_PEER_S); negated while one of them is handled as a probe
        self.stalled: dict[bytes, float] = {}
        self.fence = ReplyFence()

    def schedule_recheck(self) -> None:
        # The zmq FD is edge-triggered: a send outside the read loop may consume
        # the edge of a message that is already queued, so look once more.
        if not self._recheck_scheduled and self.master._loop is not None:
            self._recheck_scheduled = True
            self.master._loop.call_soon(self.on_readable)

    def drain_shards(self) -> bool:
        """Run every shard with queued work (walks may queue more); False if none had any."""
        ran = False
        shards = self.master.shards
        while True:
            busy = [shard for shard in shards if shard.inbox]
            if not busy:
                return ran
            ran = True
            for shard in busy:
                shard.drain()

    def on_readable(self) -> None:
        """Read what the ROUTER has queued, up to a budget, and run the shards.

        ``EVENTS`` is asked before every read, so no read ends in EAGAIN (a raised
        ``zmq.Again`` costs more than the check).  The shards run when the socket is
        empty and every 256 requests (shard processes get the requests queued for
        them every 16); their replies are sent before the last ``EVENTS`` check,
        which re-arms the edge-triggered FD.
        """
        self._recheck_scheduled = False
        router = self.router
        if router is None or self.master.state is MasterState.STOPPED or router.closed:
            return
        # Requests per call (a message may carry several: protocol 1.2); fewer while
        # master-level requests are answered by tasks, which run between calls (else a
        # stream of requests makes a MOUNT or LIST_SEGMENTS wait seconds).
        budget = 256 if self.registry.tasks else 4096
        unrun = 0  # requests read since the shards last ran
        unhandled = 0  # messages dropped or parked in this call
        unsent = 0  # value of unrun when queued requests last went to shard processes
        dispatch = self.dispatch
        shaper = self.shaper
        stalled = self.stalled
        auth = self.master._auth is not None
        remote = self.master.shards if self.master.shard_set.remote else ()
        self.reading = True
        try:
            self.now = time.monotonic()
            election = self.master._election
            if election is not None and self.master.state is MasterState.RUNNING \
                    and self.now > election.valid_until:
                # Our lease may have lapsed (this process was paused): another master may
                # lead, so what is queued is refused, not served.
                self.master._lose_leadership()
            if shaper is not None:
                unrun += self.dispatch_parked()
            while budget > 0:
                if not readable(router):
                    if self.drain_shards():
                        self.now = time.monotonic()
                        continue
                    break
                if unrun >= 256:
                    unrun = unsent = 0
                    self.drain_shards()
                    self.now = time.monotonic()
                    if shaper is not None:
                        unrun += self.dispatch_parked()
                elif remote and unrun >= unsent + 16:
                    # Shard processes work meanwhile: send what is queued for them.
                    unsent = unrun
                    for shard in remote:
                        shard.drain()
                try:
                    if auth:
                        parts = router.recv_multipart(NOBLOCK, copy=False)
                        # ZAP's User-Id is the client's z85 public key.
                        # (a string property: pyzmq types Frame.get as int | str)
                        self.user_id = cast(str, parts[-1].get("User-Id"))
                        frames = [p.bytes for p in parts]
                    else:
                        frames = recv_frames(router, NOBLOCK)
                except zmq.Again:
                    continue
                n = len(frames) // 3 or 1
                budget -= n
                unrun += n  # (dropped ones too: the shards still run every 256 reads)
                if stalled:
                    until = stalled.get(frames[0])
                    if until is not None:
                        if abs(until) > self.now:
                            self.counters["stalled_dropped"] += n
                            unhandled += 1
                            if unhandled >= UNHANDLED_BURST:
                                break
                            continue
                        # This one is handled as a probe; the peer's next ones are
                        # dropped until its reply is sent (the peer is forgotten) or
                        # dropped (stalled again), or for STALLED_PROBE_S.
                        stalled[frames[0]] = -(self.now + STALLED_PROBE_S)
                if shaper is not None:
                    try:
                        admitted = self._admit(frames, n)
                    except Exception:  # noqa: BLE001 - a bug here must not stop the reader
                        log.exception("[master] request rate check failed")
                        admitted = True
                    if not admitted:
                        unhandled += 1
                        if unhandled >= UNHANDLED_BURST:
                            break
                        continue
                try:
                    dispatch(frames)
                except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                    log.exception("[master] dispatch failed")
            if unhandled >= UNHANDLED_BURST:
                # Mostly messages dropped or parked: read on after a pause, so a peer
                # flooding them waits on its full queue instead of the master reading
                # (and the others' requests between them still come within it).
                self.drain_shards()
                if self._pause is None and self.master._loop is not None:
                    self._pause = self.master._loop.call_later(UNHANDLED_PAUSE_S, self._resume)
            elif budget <= 0:
                self.drain_shards()
                self.schedule_recheck()
        finally:
            self.reading = False
            if shaper is not None and shaper.parked_total and self._release is None \
                    and self.master._loop is not None:
                wait = shaper.next_due(time.monotonic())
                self._release = self.master._loop.call_later(max(0.001, wait or 0.0),
                                                      self._release_parked)

    def _resume(self) -> None:
        self._pause = None
        self.on_readable()

    def _release_parked(self) -> None:
        self._release = None
        self.on_readable()

    def _admit(self, frames: list[bytes], requests: int) -> bool:
        """Pass one message through its tenant's request rate (``--tenant-max-requests-
        per-s``): True to dispatch it now; False if it was parked, or dropped at a full
        parking (kvmaster/_limits.py).  The admin tenant is not shaped.  A registered peer's tenant is its
        own; an unregistered one's is its CURVE key's, or without CURVE the tenant its
        HELLO names (else "").  A batch request counts one more for every
        KEYS_PER_REQUEST_UNIT keys.  A registered client is seen alive when its message
        is read, parked or not (a parked HEARTBEAT must not let it expire).  A message
        the front refuses as malformed (frame count, requests per message) is not
        shaped: it gets its one error reply at once."""
        shaper = self.shaper
        assert shaper is not None
        nframes = len(frames)
        if nframes < 4 or (nframes - 1) % 3 or nframes // 3 > P.MAX_REQUESTS_PER_MESSAGE:
            return True
        identity = frames[0]
        client = self.registry.clients.get(identity)
        if client is not None and (self.master._auth is None or client.user_id == self.user_id):
            tenant = client.tenant
            client.last_seen = self.now
        elif self.master._auth is not None:
            tenant = self.registry.tenant_of_key.get(self.user_id or "", "")
        else:
            tenant = _hello_tenant(frames)
        if tenant == self.config.admin_tenant:
            return True
        units = requests + sum(_batch_len(frames[i]) for i in range(3, len(frames), 3)
                               ) // KEYS_PER_REQUEST_UNIT
        # (bytes held: the frames, and a bound on what each frame's object costs)
        size = sum(map(len, frames)) + PARKED_FRAME_OVERHEAD * nframes
        verdict = shaper.admit(tenant, (self.user_id, frames), size, units, self.now)
        if verdict is Admission.NOW:
            return True
        if verdict is Admission.PARKED:
            self.counters["rate_parked"] += 1
            self.parked_peers[identity] = self.parked_peers.get(identity, 0) + 1
            return False
        self.counters["rate_dropped"] += 1
        return False

    def dispatch_parked(self, everything: bool = False) -> int:
        """Dispatch the parked messages whose turn has come (``everything``: all of
        them, as when the master stops and each is to be answered); -> requests
        dispatched.  Messages parked too long are dropped (``rate_expired``)."""
        shaper = self.shaper
        if shaper is None or not shaper.parked_total:
            return 0
        own_user_id = self.user_id
        n = 0
        expired: list[Any] = []
        due = shaper.drain() if everything else shaper.due(self.now, expired=expired)
        self.counters["rate_expired"] += len(expired)
        peers = self.parked_peers
        for _, frames in itertools.chain(expired, due):
            left = peers.pop(frames[0], 1) - 1
            if left:
                peers[frames[0]] = left
        for user_id, frames in due:
            self.user_id = user_id
            n += len(frames) // 3 or 1
            try:
                self.dispatch(frames)
            except Exception:  # noqa: BLE001
                log.exception("[master] dispatch failed")
        self.user_id = own_user_id
        return n

    def send_reply(self, identity: bytes, op: bytes, payload: bytes, group: int = 0) -> None:
        """Send one reply, or with ``group`` add it to that reply group, which is sent
        as one message when its last reply is in."""
        if group:
            g = self.groups.get(group)
            if g is not None:
                g.frames += (op, payload)
                g.outstanding -= 1
                g.size += len(payload)
                if not g.outstanding:
                    del self.groups[group]
                    self.send_message(g.identity, g.frames)
                elif g.size > REPLY_MESSAGE_BYTES:
                    # A reply message stays small (the peer's queue is bounded in
                    # messages): what is in goes now, the rest follows.
                    self.send_message(g.identity, g.frames)
                    g.frames, g.size = [], 0
                return
        self.send_message(identity, (op, payload))

    def send_message(self, identity: bytes, frames: tuple[bytes, ...] | list[bytes]) -> None:
        """Send ``[op, payload]`` (one reply, or several) to ``identity``.

        With HA, a reply goes out only while the lease is surely alive for ``trust_s``
        more (the time a client trusts a reply giving out space): so a reply the client
        uses was sent by a leader whose lease outlives its receipt.  Closer to the end
        of the lease (after a pause: GC, SIGSTOP, a VM freeze; or slow renewals) replies
        are held, up to MAX_HELD_REPLIES messages, and the election thread is asked to
        renew at once; the renewal sends them (the lease never lapsed: nothing they say
        is stale).  Past ``valid_until`` the lease may have lapsed and another master may
        lead: every reply, held or new (including answers to requests read before a
        pause), is replaced by SHUTTING_DOWN, and the master steps down.  A reply
        already handed to libzmq when the process was paused goes out when it resumes:
        the client does not use it if it came more than ``trust_s`` after its request
        (HA.md, "Fencing")."""
        router = self.router
        if router is None or router.closed:
            return
        fence = self.fence
        if fence.lease is not None:
            verdict = fence.verdict(time.monotonic())
            if verdict != SEND:
                if verdict == HOLD and self.master.exit_code != 3:
                    if fence.hold(identity, frames):
                        return
                elif self.master.state is MasterState.RUNNING:
                    self.master._lose_leadership()
                frames = fenced(frames)
            elif fence.held:
                self.release_held()  # renewed: the held replies go first
        try:
            send_frames(router, (identity, *frames), NOBLOCK)
            if self.stalled and identity in self.stalled:
                del self.stalled[identity]
        except zmq.ZMQError:
            # Peer gone (EHOSTUNREACH) or its queue full (EAGAIN): the client
            # times out and retries; counting it is all the master can do.  Its
            # requests of the next STALLED_PEER_S are dropped unread (a peer that does
            # not read its replies must not keep the master busy answering).
            self.counters["reply_dropped"] += len(frames) // 2
            stalled = self.stalled
            if len(stalled) >= MAX_STALLED_PEERS:
                stalled.clear()
            stalled[identity] = time.monotonic() + STALLED_PEER_S

    def reject(self, identity: bytes, op: bytes, payload: bytes, status: Status, text: str) -> None:
        self.send_reply(identity, op, P.encode_reply(P.peek_req_id(payload), status, text))

    def reject_state(self, identity: bytes, op: bytes, req_id: int) -> None:
        if self.master.state is MasterState.STANDBY:
            status, text = Status.UNAVAILABLE_IN_CURRENT_STATUS, "standby master: ask etcd for the leader"
        else:
            status, text = Status.SHUTTING_DOWN, "master is shutting down"
        self.send_reply(identity, op, P.encode_reply(req_id, status, text))

    def dispatch(self, frames: list[bytes]) -> None:
        n = len(frames)
        if n != 4:
            if n > 4 and n % 3 == 1:
                # Several requests in one message (protocol 1.2): each as if alone.
                identity = frames[0]
                if n // 3 > P.MAX_REQUESTS_PER_MESSAGE:
                    # One answer for the whole message (one per request would let a
                    # message of millions of empty frames cost that many replies).
                    self.counters["malformed"] += 1
                    self.reject(identity, frames[1][:1] or b"\xff", frames[3],
                                Status.INVALID_PARAMS,
                                f"at most {P.MAX_REQUESTS_PER_MESSAGE} requests per message, "
                                f"got {n // 3}")
                    return
                self.counters["multi_request_messages"] += 1
                client = self.registry.clients.get(identity)
                hello = Op.HELLO.value
                group = None
                # The replies of the routed requests go back together, unless the client
                # said 1.1 (a HELLO in the message may say so too).  The group holds one
                # count of its own until every request is dispatched.
                if client is not None and client.multi_reply \
                        and len(self.groups) < MAX_REPLY_GROUPS \
                        and not any(frames[i] == hello for i in range(1, n, 3)):
                    gid = next(self._group_ids)
                    group = self.groups[gid] = ReplyGroup(identity, client.view.grouped(gid),
                                                          self.now)
                one = self.dispatch_one
                for i in range(1, n, 3):
                    one(identity, frames[i], frames[i + 1], frames[i + 2], group)
                if group is not None:
                    group.outstanding -= 1
                    if not group.outstanding:  # nothing was delivered (or, were a reply
                        del self.groups[gid]  # ever sent during dispatch, all is answered)
                        if group.frames:
                            self.send_message(identity, group.frames)
                return
            self.counters["malformed"] += 1
            if len(frames) >= 2:
                self.reject(frames[0], frames[1][:1] or b"\xff", frames[-1] if len(frames) > 2 else b"",
                            Status.INVALID_PARAMS,
                            f"malformed message: expected 3 frames [op, route, payload] (or 3 per request), "
                            f"got {len(frames) - 1}")
            return
        identity, op, route, payload = frames
        self.dispatch_one(identity, op, route, payload)

    def dispatch_one(self, identity: bytes, op: bytes, route: bytes, payload: bytes,
                     group: ReplyGroup | None = None) -> None:
        """Handle one request; a routed one delivered to its shard joins reply group
        ``group`` (its entry in ``groups``) when given."""
        if route:
            master = self.master
            client = self.registry.clients.get(identity)
            if client is not None and master._auth is not None \
                    and client.user_id != self.user_id:
                client = None  # another key on a reused routing id is not this client
            if client is None:
                self.counters["rejected_unregistered"] += 1
                self.reject(identity, op, payload, Status.NOT_REGISTERED,
                            "send HELLO before other requests")
                return
            client.last_seen = self.now
            shards = master.shards
            shard = int.from_bytes(route, "big")
            if len(route) != 2 or shard >= len(shards):
                self.counters["malformed"] += 1
                self.reject(identity, op, payload, Status.INVALID_PARAMS,
                            f"route frame must be a 2-byte shard index < {len(shards)}")
                return
            if master.state is not MasterState.RUNNING:
                self.reject_state(identity, op, P.peek_req_id(payload))
                return
            view = client.view if group is None else group.view
            if not shards[shard].deliver((op, payload, view)):
                self.counters["rejected_busy"] += 1
                self.reject(identity, op, payload, Status.BUSY, "shard inbox full, retry later")
            elif group is not None:
                group.outstanding += 1
            return
        self.registry.handle_master_op(identity, op, payload)

    def expire_groups(self, now: float) -> None:
        """Send what reply groups older than REPLY_GROUP_MAX_AGE_S gathered."""
        old = [gid for gid, g in self.groups.items() if now - g.created > REPLY_GROUP_MAX_AGE_S]
        for gid in old:
            g = self.groups.pop(gid)
            if g.frames:
                self.send_message(g.identity, g.frames)

    def cancel_timers(self) -> None:
        """Stop the read loop's pending wake-ups (the master is stopping)."""
        for timer in (self._release, self._pause):
            if timer is not None:
                timer.cancel()
        self._release = self._pause = None

    def release_held(self) -> None:
        """After a renewal (or a step-down): send the held replies, or hold them again,
        or refuse them (see :meth:`send_message`)."""
        held = self.fence.take_held()
        for i, (identity, frames) in enumerate(held):
            try:
                self.send_message(identity, frames)
            except Exception:  # noqa: BLE001 - a bug must not lose the others
                log.exception("[ha] a held reply could not be sent")
                self.fence.held[:0] = held[i + 1:]
                raise

    def close_router(self) -> None:
        """Refuse the held replies (no renewal came), close the client socket."""
        if self.router is None or self.router.closed:
            return
        held = self.fence.take_held()
        self.fence.lease = None
        for identity, frames in held:
            self.send_message(identity, fenced(frames))
        self.router.close(linger=int(ROUTER_LINGER_S * 1000))
