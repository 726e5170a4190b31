"""The kvmaster master process: a ROUTER front and N shard actors on one event loop.

The :class:`Master` front owns the ROUTER socket and the client/segment
registry.  It routes each request on its first two frames (op, route) and
hands the undecoded payload to the owning :class:`~kvmaster._shard.ShardActor`'s
bounded inbox; a full inbox is answered BUSY at once.  Master-level ops
(HELLO, HEARTBEAT, MOUNT/UNMOUNT, BYE, STATS) are decoded by the front, which
talks to shards only by internal messages.

Shutdown is a state machine: RUNNING -> DRAINING (signal: new requests get
SHUTTING_DOWN, queued ones finish) -> STOPPED (sockets closed with a linger,
then the context terminated, shared memory unlinked).
"""

from __future__ import annotations

import asyncio
import errno
import glob
import os
import secrets
import socket
import stat
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from kvmaster import __version__
from kvmaster import protocol as P
from kvmaster._front import REPLY_MESSAGE_BYTES, ROUTER_LINGER_S, Front, MasterState
from kvmaster._mounts import MountProof, admit_mount
from kvmaster._process import tune_gc  # noqa: F401 - kvmaster.master.tune_gc, as before
from kvmaster._segment import NAME_PREFIX, SHM_DIR, Segment, host_id, master_segment_name, \
    name_fingerprint, remove_stale_segments, segment_tag, unlink_segment
from kvmaster._limits import WALK_BURST, WALK_RATE, ClientCounts, TokenBuckets
from kvmaster._shard import ClientView, ShardActor
from kvmaster.config import MasterConfig
from kvmaster.protocol import Op, ProtocolError, Status

log = logging.getLogger(__name__)

_MASTER_CLIENT = "master"


_FRONT_OP_COUNTERS = {op.value: (f"op.{op.name.lower()}.requests", f"op.{op.name.lower()}.failures")
                      for op in P.MASTER_OPS if op is not Op.HELLO}



def _file_id(name: str) -> tuple[int, int, int] | None:
    """Identity ``(st_dev, st_ino, st_uid)`` of a same-host segment file, if it is a
    regular kvmaster segment file (``lstat``: a symlink is none)."""
    if "/" in name or not name.startswith(NAME_PREFIX):
        return None
    try:
        st = os.lstat(os.path.join(SHM_DIR, name))
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_uid) if stat.S_ISREG(st.st_mode) else None


def _owners_file(rec: SegmentRecord, client_id: str) -> bool:
    """Whether ``/dev/shm/<rec.name>`` may be unlinked for the expired client
    ``client_id``: the record is that client's mount of a file on this host, the name
    still carries the fingerprint the mount proved, and the name still holds the file
    (same device, inode and owning uid) that was mounted."""
    return (rec.file_id is not None and rec.owner == client_id
            and bool(rec.fingerprint) and name_fingerprint(rec.name) == rec.fingerprint
            and _file_id(rec.name) == rec.file_id)



class ClientInfo:
    """A registered client, keyed by its DEALER identity."""

    __slots__ = ("client_id", "identity", "tenant", "host_id", "view", "last_seen", "segments",
                 "user_id", "front_ops", "multi_reply", "suspected")

    def __init__(self, client_id: str, identity: bytes, tenant: str, host: str, now: float) -> None:
        self.client_id = client_id
        self.identity = identity
        self.tenant = tenant
        self.host_id = host
        self.view = ClientView(client_id, tenant, identity)
        self.last_seen = now
        self.segments: set[str] = set()
        self.user_id: str | None = None
        self.front_ops = 0  # master-level requests of this client being answered
        #: Its HELLO said protocol 1.2 or later: a reply message may carry several replies.
        self.multi_reply = False
        #: Silent past --client-ttl, within --client-suspicion-ttl: its segments take no
        #: new writes (the shards were told), its objects stay.
        self.suspected = False


class SegmentRecord:
    """A mounted segment and what its mount proved (kvmaster._mounts): ``owner`` the
    client id, ``key`` the CURVE key that mounted it (None without CURVE),
    ``fingerprint`` the owner fingerprint its name carries, ``file_id``."""

    __slots__ = ("name", "owner", "size", "usable", "host_id", "transport", "file_id", "key",
                 "fingerprint")

    def __init__(self, name: str, owner: str, size: int, host: str, transport: str) -> None:
        self.name = name
        self.owner = owner
        self.size = size
        self.usable = 0
        self.host_id = host
        self.transport = transport
        # (st_dev, st_ino, st_uid) of /dev/shm/<name> when it was mounted on this host:
        # the master unlinks an expired client's file only if it is still that file.
        self.file_id: tuple[int, int, int] | None = None
        self.key: str | None = None
        self.fingerprint = ""

    def same_mount(self, owner: str, key: str | None, msg: Any,
                   file_id: tuple[int, int, int] | None) -> bool:
        """Whether a mount of this name by ``owner`` (authenticated with ``key``) is
        this one again (a re-mount after reconnecting): same owner, key, size, host,
        transport and file."""
        return (self.owner == owner and self.key == key and self.size == msg.size
                and self.host_id == msg.host_id and self.transport == msg.transport
                and self.file_id == file_id)


#: Looks for segment files of dead masters while some are still in use: the first
#: again after STALE_SEGMENT_RECHECK_S seconds, each later one after twice the last
#: pause, at most STALE_SEGMENT_RECHECK_MAX_S, until STALE_SEGMENT_RECHECK_FOR_S
#: after the start (then ``kvmaster ctl clean-segments`` is left to remove them).
#: Clients of the dead master drop their mappings when they re-handshake with a
#: new master, usually within seconds.
STALE_SEGMENT_RECHECK_S = 2.0
STALE_SEGMENT_RECHECK_MAX_S = 900.0
STALE_SEGMENT_RECHECK_FOR_S = 86400.0

#: Master-level requests (MOUNT_SEGMENT, STATS, ...) being answered at once: per
#: client and in all.  Beyond either, the request is answered BUSY.
FRONT_OPS_PER_CLIENT = 256
FRONT_OPS_MAX = 4096

def max_request_bytes(config: MasterConfig) -> int:
    """The largest request frame the client socket takes: a batch of ``--max-batch``
    keys of the largest size with their fields, or a session page of
    ``--kv-session-max-batch`` keys (at least 16 MiB)."""
    keys = max(config.max_batch, config.kv_session_max_batch)
    return max(16 << 20, 2 * keys * (P.KEY_MAX_BYTES + 64))


def reply_queue_messages(config: MasterConfig) -> int:
    """The per-peer send queue of the client socket, in messages:
    ``--max-reply-bytes-per-peer`` over :data:`REPLY_MESSAGE_BYTES` (1,024 by default),
    at least 256 (a client pipelining thousands of small calls must not lose replies)."""
    return max(256, config.max_reply_bytes_per_peer // REPLY_MESSAGE_BYTES)


#: After a reply to a peer is dropped (its queue full, or it is gone), its requests of

#: Longest wait of a clean stop for the op log's last records to reach etcd, s.
OPLOG_DRAIN_S = 2.0


class Master:
    """Front of the master; runs on the event loop thread that calls :meth:`serve`."""

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.state = MasterState.STANDBY if config.ha else MasterState.RUNNING
        self.exit_code = 0
        self._election: Any = None
        #: --ha-oplog: the op log's follower, then writer (kvmaster/_oplog.py)
        self._standby: Any = None
        self.host_id = host_id()
        #: New at every start (WELCOME ``master_instance``): a client that re-handshakes
        #: with another one knows the master restarted (its segments were forgotten).
        self.instance = secrets.token_hex(8)
        self.endpoint = ""
        self.clients: dict[bytes, ClientInfo] = {}
        self.client_ids: dict[str, bytes] = {}
        self.segments: dict[str, SegmentRecord] = {}
        self.counters = dict.fromkeys(
            ("rejected_busy", "rejected_unregistered", "malformed", "reply_dropped",
             "clients_expired", "clients_suspected", "clients_recovered", "hello",
             "multi_request_messages", "rate_parked", "rate_dropped", "rate_expired",
             "stalled_dropped"), 0)
        for names in _FRONT_OP_COUNTERS.values():
            self.counters.update(dict.fromkeys(names, 0))
        #: The client socket's traffic (kvmaster/_front.py).
        self.front = Front(self, config, self.counters)
        self.shards: list[Any] = []
        if not config.shard_processes:
            self.shards = [ShardActor(i, config.shard_count, config, self.front.send_reply)
                           for i in range(config.shard_count)]
            for shard in self.shards:
                shard.peers = self.shards
        self._procs: Any = None
        self._ctx: zmq.Context | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._own_segment: Segment | None = None
        self._tasks: set[asyncio.Task] = set()
        self._auth: Any = None
        self._tenant_of_key: dict[str, str] = {}
        self._client_counts = ClientCounts()
        self._walk_buckets = TokenBuckets(WALK_RATE, WALK_BURST)
        self._checking = False
        self._shared_tenants = frozenset(
            t.strip() for t in config.shared_tenants.split(",") if t.strip())
        self._metrics: Any = None
        self.metrics_endpoint = ""
        #: ``ipc://PATH`` when ``ipc_path`` is set, else "".
        self.ipc_endpoint = ""
        self._ipc_inode = 0
        self._sweep: asyncio.Task | None = None

    # ------------------------------------------------------------- lifecycle

    async def serve(self, on_started: Callable[[str], None] | None = None,
                    install_signals: bool = True) -> None:
        """Bind, serve until :meth:`request_stop` (or SIGTERM/SIGINT), then clean up.

        The signal handlers come first: a SIGTERM or SIGINT during start-up (binding,
        creating ``--master-segment-size``, starting shard processes) stops the master
        cleanly once start-up is done, instead of being lost or killing it uncleaned."""
        loop = self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            await self._serve(loop, on_started)
        finally:
            if install_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)

    async def _serve(self, loop: asyncio.AbstractEventLoop,
                     on_started: Callable[..., None] | None) -> None:
        ctx = self._ctx = zmq.Context()
        router = self.front.router = ctx.socket(zmq.ROUTER)
        # A reply to a vanished peer must raise rather than disappear silently.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Per-peer queues: a client that stops reading its replies costs at most this
        # many queued reply messages (beyond it they are dropped and counted: it is cut
        # off, the master is not grown), each at most about REPLY_MESSAGE_BYTES (pages
        # end there, a reply group is sent in parts past it; a batch reply is about 40
        # bytes per key, bounded by --max-batch): --max-reply-bytes-per-peer in all.
        router.setsockopt(zmq.SNDHWM, reply_queue_messages(self.config))
        router.setsockopt(zmq.RCVHWM, 10_000)
        router.setsockopt(zmq.LINGER, 0)
        # Bound any single frame: a larger one is dropped by libzmq with the
        # connection instead of being buffered and decoded (a 200 MiB one stalled
        # every other client for seconds).
        router.setsockopt(zmq.MAXMSGSIZE, max_request_bytes(self.config))
        if self.config.curve_dir:
            self._start_auth(ctx, router)
        try:
            self.endpoint = _bind(router, f"tcp://{self.config.host}:{self.config.port}")
            if self.config.ipc_path:
                path = self.config.ipc_path
                _check_ipc_path(path)
                self.ipc_endpoint = _bind(router, f"ipc://{path}")
                if not path.startswith("@"):  # an abstract name leaves no file
                    self._ipc_inode = os.stat(path).st_ino
        except BindError:
            router.close(0)
            self.front.router = None
            if self._auth is not None:
                self._auth.stop()
                self._auth = None
            ctx.term()
            self._ctx = None
            raise
        try:
            housekeeping = await self._start(loop, router)
            log.info("[master] listening endpoint=%s%s shards=%d", self.endpoint,
                     f" and {self.ipc_endpoint}" if self.ipc_endpoint else "", len(self.shards))
            if on_started is not None:  # may raise (e.g. BrokenPipeError on stdout)
                if self.metrics_endpoint:
                    on_started(self.endpoint, self.metrics_endpoint)
                else:
                    on_started(self.endpoint)
        except BaseException:
            loop.remove_reader(router.getsockopt(zmq.FD))
            self._close()  # whatever start-up made so far: segment, shard processes, sockets
            raise
        self.front.on_readable()  # messages may have arrived before the reader was added
        await self._stopped.wait()
        # DRAINING: stop reading; queued requests are answered by their shards, and
        # those parked by a tenant's request rate SHUTTING_DOWN at once.
        loop.remove_reader(router.getsockopt(zmq.FD))
        self.front.now = time.monotonic()
        self.front.dispatch_parked(everything=True)
        for shard in self.shards:
            shard.drain()
        if self._procs is not None:
            # Answers still queued in the shard processes go out before the stop.
            self._on_shard_readable()
            loop.remove_reader(self._procs.pull.getsockopt(zmq.FD))
        housekeeping.cancel()
        for t in list(self._tasks):
            t.cancel()
        self._close()

    async def _start(self, loop: asyncio.AbstractEventLoop, router: zmq.Socket) -> asyncio.Task:
        """Shards, own segment, reader, metrics and housekeeping (after the bind)."""
        ctx = self._ctx
        if self.config.shard_processes:
            from kvmaster._shardproc import ShardProcesses

            self._procs = ShardProcesses(self.config, ctx)
            self.shards = self._procs.start()
            loop.add_reader(self._procs.pull.getsockopt(zmq.FD), self._on_shard_readable)
            # Edge-triggered FD: reading EVENTS once re-arms it after start()'s reads.
            self._on_shard_readable()
        else:
            for shard in self.shards:
                shard.wakeup = self._waker(shard)
                shard.any_shard = True
        if self.config.ha:
            self._start_election(loop)
        elif self.config.master_segment_size:
            await self._mount_own_segment()
        loop.add_reader(router.getsockopt(zmq.FD), self.front.on_readable)
        if self.config.metrics_port >= 0:
            from kvmaster.metrics import MetricsServer

            self._metrics = MetricsServer(self, loop, self.config.metrics_host,
                                          self.config.metrics_port)
            try:
                self.metrics_endpoint = self._metrics.start()
            except OSError as exc:
                # Serving KV traffic matters more than the metrics page.
                log.warning("[master] metrics server not started on %s:%d: %s",
                            self.config.metrics_host, self.config.metrics_port, exc)
                self._metrics = None
        if self.config.clean_stale_segments:
            self._start_sweep()
        return loop.create_task(self._housekeeping(), name="kvmaster-housekeeping")

    def _start_sweep(self) -> None:
        """Look for segment files of dead masters (in a thread: it reads /proc)."""
        if self._sweep is None or self._sweep.done():
            self._sweep = self._loop.create_task(self._sweep_stale_segments(),
                                                 name="kvmaster-stale-segments")

    async def _sweep_stale_segments(self) -> None:
        """Remove the segment files that masters of this host (same KVMASTER_SEGMENT_TAG,
        user and pid namespace) left when they died: never one whose master is alive or
        that any process maps or holds open.  While some are still mapped (clients of the
        dead master that have not re-handshaken yet, or that never will), look again
        after STALE_SEGMENT_RECHECK_S seconds, doubling the pause up to
        STALE_SEGMENT_RECHECK_MAX_S, until STALE_SEGMENT_RECHECK_FOR_S after the first
        look (each look reads every process's maps and open files in /proc)."""
        told: set[str] = set()
        pause = STALE_SEGMENT_RECHECK_S
        give_up = time.monotonic() + STALE_SEGMENT_RECHECK_FOR_S
        while True:
            try:
                report = await self._loop.run_in_executor(
                    None, remove_stale_segments, segment_tag())
            except Exception:  # noqa: BLE001 - a failed look must not stop the master
                log.exception("[master] looking for segment files of dead masters failed")
                return
            for name in report["removed"]:
                log.warning("[master] removed segment file of a dead master name=%s", name)
            waiting = [k for k in report["kept"] if k["reason"].startswith(("mapped", "locked"))]
            for k in waiting:
                if k["name"] not in told:
                    told.add(k["name"])
                    log.info("[master] segment file of a dead master kept while in use "
                             "name=%s: %s", k["name"], k["reason"])
            if not waiting:
                return
            if time.monotonic() + pause > give_up:
                log.warning("[master] segment files of dead masters still in use after %.0f s; "
                            "no longer looking (kvmaster ctl clean-segments removes them once "
                            "unused): %s", STALE_SEGMENT_RECHECK_FOR_S,
                            " ".join(sorted(k["name"] for k in waiting)))
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, STALE_SEGMENT_RECHECK_MAX_S)

    def _start_auth(self, ctx: zmq.Context, router: zmq.Socket) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        from kvmaster import auth

        directory = self.config.curve_dir
        public, secret = auth.master_keys(directory)
        self._tenant_of_key = auth.allowed_tenants(directory)
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(Path(directory) / "clients"))
        router.curve_secretkey = secret
        router.curve_publickey = public
        router.curve_server = True
        log.info("[master] CURVE on: %d allowed client keys", len(self._tenant_of_key))

    def _start_election(self, loop: asyncio.AbstractEventLoop) -> None:
        from kvmaster.ha import LeaderElection

        cfg = self.config
        endpoints = [e.strip() for e in cfg.etcd_endpoints.split(",") if e.strip()]

        def lead() -> None:  # (the election thread)
            loop.call_soon_threadsafe(self._become_leader)

        on_elected: Callable[[], None] = lead
        if cfg.ha_oplog:
            from kvmaster._oplog import HotStandby

            standby = self._standby = HotStandby(cfg, loop)
            advertise = cfg.advertise_address or self.endpoint

            def reporter() -> tuple[str, int]:  # (the follower's thread)
                election = self._election
                return advertise, (election._lease if election is not None else 0)

            standby.start(reporter)

            def catch_up_then_lead() -> None:  # (the election thread)
                election = self._election
                standby.elected(lambda: election is not None and election.is_leader,
                                self._caught_up)

            on_elected = catch_up_then_lead
        self._election = LeaderElection(
            endpoints, cfg.cluster_id, cfg.advertise_address or self.endpoint, cfg.ha_lease_ttl,
            on_elected=on_elected,
            on_lost=lambda: loop.call_soon_threadsafe(self._lose_leadership))
        self._election.on_renewed = lambda: loop.call_soon_threadsafe(self.front.release_held)
        self._election.start()
        log.info("[ha] standing by cluster=%s etcd=%s", cfg.cluster_id, cfg.etcd_endpoints)

    def _caught_up(self, refusal: str | None) -> None:
        """--ha-oplog: the op log was read to its end (or cannot be led by this master)."""
        if refusal is not None:
            log.error("[ha] not leading: %s (exit status 3)", refusal)
            self.exit_code = 3
            self.request_stop()  # (which gives the leader key up)
            return
        self._become_leader()

    def _oplog_stopped(self, reason: str) -> None:
        """The op log can no longer be written (fenced, refused, etcd away too long): the
        starts waiting for held space are refused, and this master steps down."""
        for shard in self.shards:
            if shard.log is not None:
                shard.log.refuse_parked(f"the master is stepping down: {reason}")
        self._lose_leadership()

    def _become_leader(self) -> None:
        if self.state is not MasterState.STANDBY:
            return
        if self._standby is not None:
            self._standby.promote(self.shards, self._election._lease, self._oplog_stopped)
        self.state = MasterState.RUNNING
        self.front.fence.lease = self._election
        log.info("[ha] leading: serving requests")
        if self.config.master_segment_size:
            task = self._loop.create_task(self._mount_own_segment())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _lose_leadership(self) -> None:
        if self.state in (MasterState.RUNNING, MasterState.STANDBY):
            log.error("[ha] leadership lost: stopping (exit status 3)")
        else:
            log.error("[ha] leadership lost while stopping (exit status 3)")
        self.exit_code = 3
        if self.state in (MasterState.RUNNING, MasterState.STANDBY):
            # (a standby loses the lease only after winning it, while it reads the op log
            # to its end: it neither leads nor campaigns again, so it stops too)
            self.request_stop()
        self.front.dispatch_parked(everything=True)  # (each refused SHUTTING_DOWN)
        self.front.release_held()  # as SHUTTING_DOWN now

    def request_stop(self) -> None:
        """Signal-safe: RUNNING (or STANDBY) -> DRAINING."""
        if self.state in (MasterState.RUNNING, MasterState.STANDBY):
            log.info("[master] draining")
            self.state = MasterState.DRAINING
            if self._stopped is not None:
                self._stopped.set()

    def _close(self) -> None:
        self.front.cancel_timers()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        election, self._election = self._election, None
        if election is not None and election.is_leader and self.front.router is not None:
            # A clean stop gives the lease up at once, so a standby may lead right
            # after.  A reply sent just before (still in libzmq's queue or in flight)
            # is used by a client up to trust_s after its request, and its copy takes
            # up to margin_s more: the router goes first, and the lease is kept (and
            # renewed) until the replies it sent are stale (HA.md, "Fencing").
            self.front.close_router()
            time.sleep(election.trust_s + election.margin_s + ROUTER_LINGER_S)
        if election is not None and election.is_leader and self._standby is not None:
            # A clean stop loses nothing: what the op log holds goes to etcd while the
            # lease still fences it, before the key is given up.
            self._standby.drain(OPLOG_DRAIN_S)
        if election is not None:
            election.stop()
        if self._standby is not None:
            self._standby.stop()
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None
        if self._procs is not None:
            self._procs.stop()
            self._procs = None
        if self._own_segment is not None:
            self._own_segment.close(unlink=True)
            self._own_segment = None
        self._remove_orphan_files()
        self.front.close_router()
        self._remove_ipc_file()
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()
        self.state = MasterState.STOPPED
        log.info("[master] stopped")

    def _remove_ipc_file(self) -> None:
        """libzmq leaves an ipc socket's file behind: remove ours (not one that another
        master has bound at the same path since)."""
        path = self.config.ipc_path
        if not self._ipc_inode:
            return
        try:
            if os.stat(path).st_ino == self._ipc_inode:
                os.unlink(path)
        except OSError:
            pass
        self._ipc_inode = 0

    def _remove_orphan_files(self) -> None:
        """Segment files on this host whose owner died before it expired: nobody maps
        them any more (a live owner always maps its own segment)."""
        ours = {os.path.join(SHM_DIR, r.name): r for r in self.segments.values()
                if r.file_id is not None and r.owner != _MASTER_CLIENT}
        if not ours:
            return
        mapped: set[str] = set()
        for maps in glob.glob("/proc/[0-9]*/maps"):
            try:
                with open(maps) as f:
                    mapped.update(line.rsplit(None, 1)[-1] for line in f if SHM_DIR in line)
            except OSError:
                continue
        for path, rec in ours.items():
            if path not in mapped and _file_id(rec.name) == rec.file_id and \
                    unlink_segment(rec.name):
                log.info("[master] removed segment file of a dead client name=%s", rec.name)

    async def _mount_own_segment(self) -> None:
        # The name carries this process's pid, start time and pid namespace, so that a
        # later master can tell the file is left over once this one is dead.
        seg = Segment.create(self.config.master_segment_size, master_segment_name())
        self._own_segment = seg
        rec = SegmentRecord(seg.name, _MASTER_CLIENT, seg.size, self.host_id, "shm")
        rec.usable = sum(await self._ask_all("mount_segment", seg.name, _MASTER_CLIENT, seg.size,
                                             None))  # (shared by every tenant)
        self.segments[seg.name] = rec

    def _on_shard_readable(self) -> None:
        if self._procs is not None and self._procs.on_readable(self.front.send_reply):
            self.front.on_readable()

    def _waker(self, shard: ShardActor) -> Callable[[], None]:
        loop = self._loop
        assert loop is not None

        def wake() -> None:
            # Inside the read loop the front drains every inbox before it returns.
            if not self.front.reading:
                loop.call_soon(self._run_shard, shard)

        return wake

    def _run_shard(self, shard: ShardActor) -> None:
        if shard.inbox:
            shard.drain()
            self.front.schedule_recheck()

    # ------------------------------------------------------- master-level ops

    def _handle_master_op(self, identity: bytes, op: bytes, payload: bytes) -> None:
        names = _FRONT_OP_COUNTERS.get(op)
        if names is not None:
            self.counters[names[0]] += 1
        try:
            req_id, msg = P.decode_request(op, payload)
        except ProtocolError as exc:
            self.counters["malformed"] += 1
            self._count_failure(op)
            self.front.reject(identity, op, payload, exc.status, str(exc))
            return
        if self.state is not MasterState.RUNNING:
            self.front.reject_state(identity, op, req_id)
            return
        if op == Op.HELLO.value:
            status, body = self._hello(identity, msg)
            if status:
                self._count_failure(op)
            self.front.send_reply(identity, op, P.encode_reply(req_id, status, body))
            return
        client = self.clients.get(identity)
        if client is not None and self._auth is not None and client.user_id != self.front.user_id:
            client = None
        if client is None:
            self.counters["rejected_unregistered"] += 1
            self.front.send_reply(identity, op, P.encode_reply(req_id, Status.NOT_REGISTERED,
                                                          "send HELLO before other requests"))
            return
        client.last_seen = self.front.now
        if op == Op.HEARTBEAT.value:
            self.front.send_reply(identity, op, P.encode_reply(req_id, 0, 0))
            return
        handler = {
            Op.MOUNT_SEGMENT.value: self._mount,
            Op.UNMOUNT_SEGMENT.value: self._unmount,
            Op.BYE.value: self._bye,
            Op.STATS.value: self._stats,
            Op.CHECK_CONSISTENCY.value: self._check,
            Op.LIST_CLIENTS.value: self._list_clients,
            Op.LIST_SEGMENTS.value: self._list_segments,
            Op.GET_CONFIG.value: self._get_config,
        }.get(op)
        if handler is None:
            self.front.send_reply(identity, op, P.encode_reply(
                req_id, Status.UNSUPPORTED, f"op {op.hex()} needs a route frame (shard index)"))
            return
        # Master-level requests are answered by tasks that hold their results until
        # sent: bound them per client and in all, so a peer that pipelines thousands
        # (and never reads) costs bounded memory.
        if client.front_ops >= FRONT_OPS_PER_CLIENT or len(self._tasks) >= FRONT_OPS_MAX:
            self.counters["rejected_busy"] += 1
            self.front.send_reply(identity, op, P.encode_reply(
                req_id, Status.BUSY, "too many master-level requests in progress, retry later"))
            return
        refusal = self._walk_refusal(client, op)
        if refusal is not None:
            self._count_failure(op)
            self.front.send_reply(identity, op, P.encode_reply(req_id, *refusal))
            return
        client.front_ops += 1
        task = self._loop.create_task(self._answer(identity, op, req_id, handler(client, msg)))
        self._tasks.add(task)

        def done(t: asyncio.Task, client: ClientInfo = client) -> None:
            self._tasks.discard(t)
            client.front_ops -= 1

        task.add_done_callback(done)

    def _count_failure(self, op: bytes) -> None:
        names = _FRONT_OP_COUNTERS.get(op)
        if names is not None:
            self.counters[names[1]] += 1

    async def _answer(self, identity: bytes, op: bytes, req_id: int, coro: Any) -> None:
        try:
            status, body = await coro
        except Exception as exc:  # noqa: BLE001
            log.exception("[master] op=%s failed", op.hex())
            status, body = Status.INTERNAL_ERROR, f"internal error: {type(exc).__name__}"
        if status:
            self._count_failure(op)
        self.front.send_reply(identity, op, P.encode_reply(req_id, status, body))
        self.front.schedule_recheck()

    def _hello(self, identity: bytes, msg: Any) -> tuple[int, Any]:
        self.counters["hello"] += 1
        if msg.protocol_major != P.PROTOCOL_VERSION[0]:
            return Status.VERSION_MISMATCH, (
                f"protocol {msg.protocol_major}.{msg.protocol_minor} not supported; "
                f"master speaks {P.PROTOCOL_VERSION[0]}.x")
        if msg.protocol_minor != P.PROTOCOL_VERSION[1]:
            log.info("[master] client %s speaks protocol minor %d (master %d)",
                     msg.client_id, msg.protocol_minor, P.PROTOCOL_VERSION[1])
        tenant = msg.tenant
        if self._auth is not None:
            tenant = self._tenant_of_key.get(self.front.user_id or "", "")
            if not tenant:
                return Status.ILLEGAL_CLIENT, "client key has no tenant on this master"
        old_identity = self.client_ids.get(msg.client_id)
        if identity in self.clients:
            # HELLO again on a registered connection: the registration stands as it is,
            # for the key that made it.
            if self._auth is not None and self.clients[identity].user_id != self.front.user_id:
                return Status.ILLEGAL_CLIENT, "routing id registered under another key"
        elif old_identity is not None and old_identity != identity:
            # The same client reconnected on a new socket: move its registration.
            old = self.clients[old_identity]
            if self._auth is not None and old.user_id != self.front.user_id:
                return Status.ILLEGAL_CLIENT, "client id registered under another key"
            if old.tenant != tenant:
                return Status.ILLEGAL_CLIENT, "a client cannot change tenant on reconnect"
            del self.clients[old_identity]
            self._shard_forget(old_identity)
            old.identity = identity
            old.view = ClientView(old.client_id, old.tenant, identity)
            self._shard_register(old)
            self.clients[identity] = old
            self.client_ids[msg.client_id] = identity
        elif identity not in self.clients:
            if len(self.clients) >= self.config.max_clients:
                return Status.UNAVAILABLE_IN_CURRENT_STATUS, (
                    f"client limit reached (max_clients={self.config.max_clients})")
            if tenant != self.config.admin_tenant:
                why = self._client_counts.refusal(tenant, self.front.user_id,
                                                  self.config.tenant_max_clients,
                                                  self.config.max_clients_per_key)
                if why is not None:
                    return Status.TENANT_QUOTA_EXCEEDED, why
            self.clients[identity] = ClientInfo(msg.client_id, identity, tenant,
                                                msg.host_id, self.front.now)
            self.clients[identity].user_id = self.front.user_id
            self._client_counts.add(tenant, self.front.user_id)
            self.client_ids[msg.client_id] = identity
            self._shard_register(self.clients[identity])
        client = self.clients[identity]
        client.last_seen = self.front.now
        client.multi_reply = msg.protocol_minor >= 2
        return 0, {
            "master_version": __version__,
            "protocol": list(P.PROTOCOL_VERSION),
            "shard_count": len(self.shards),
            "tenant": client.tenant,
            "lease_ttl_ms": self.config.default_kv_lease_ttl,
            "client_ttl_ms": int(self.config.client_ttl * 1000),
            "put_start_release_timeout_ms": int(self.config.put_start_release_timeout * 1000),
            "limits": {"max_batch": self.config.max_batch, "max_key_bytes": P.KEY_MAX_BYTES,
                       "kv_session_max_batch": self.config.kv_session_max_batch,
                       "kv_sessions": self.config.enable_kv_sessions,
                       # (memberships only where sessions are served: tags otherwise)
                       "session_tags_as_kv_sessions": self.config.session_tags_as_kv_sessions
                       and self.config.enable_kv_sessions},
            "master_host_id": self.host_id,
            "master_instance": self.instance,
            # In-process shards forward a batch's other keys to their owners through
            # their inboxes; shard processes would pay an ipc hop each.
            "batch_any_shard": self._procs is None,
            **({"reply_trust_ms": int(self._election.trust_s * 1000)}
               if self._election is not None else {}),
        }

    def _shard_register(self, client: ClientInfo) -> None:
        if self._procs is not None:
            for shard in self.shards:
                shard.register_client(client.identity, client.client_id, client.tenant)

    def _shard_forget(self, identity: bytes) -> None:
        if self._procs is not None:
            for shard in self.shards:
                shard.forget_client(identity)

    def _post_all(self, fn_name: str, *args: Any) -> list[asyncio.Future]:
        """Send an internal message to every shard now; -> the futures of the answers."""
        loop = self._loop
        futs = []
        for shard in self.shards:
            fut = loop.create_future()
            shard.post(fn_name, args, fut)
            futs.append(fut)
        return futs

    async def _ask_all(self, fn_name: str, *args: Any) -> list[Any]:
        """Send an internal message to every shard and gather the answers."""
        return list(await asyncio.gather(*self._post_all(fn_name, *args)))

    async def _mount(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        if self.clients.get(client.identity) is not client:
            # A BYE (or expiry) pipelined ahead of this MOUNT already forgot the client.
            return Status.NOT_REGISTERED, "client is no longer registered"
        key = client.user_id if self._auth is not None else None
        existing = self.segments.get(msg.name)
        proof = admit_mount(msg, client.client_id, key, self.host_id, self.config,
                            sum(r.size for r in self.segments.values() if r is not existing))
        if not isinstance(proof, MountProof):
            # Another owner's name or service is worth an operator's look.
            log.log(logging.WARNING if proof[0] == Status.ILLEGAL_CLIENT else logging.INFO,
                    "[master] mount refused segment=%s client=%s: %s", msg.name,
                    client.client_id, proof[1])
            return proof
        if existing is not None:
            if existing.same_mount(client.client_id, key, msg, proof.file_id):
                client.segments.add(msg.name)  # a re-mount after reconnecting: idempotent
                return 0, existing.usable
            return Status.SEGMENT_ALREADY_EXISTS, (
                f"segment {msg.name} is already mounted"
                + (" (by this client, with another size, host, transport or file)"
                   if existing.owner == client.client_id else ""))
        if len(client.segments) >= self.config.max_segments_per_client:
            return Status.INVALID_PARAMS, (
                f"segment limit reached (max_segments_per_client={self.config.max_segments_per_client})")
        if msg.size < 4096 * len(self.shards):
            return Status.INVALID_PARAMS, f"segment size must be at least {4096 * len(self.shards)} bytes"
        rec = SegmentRecord(msg.name, client.client_id, msg.size, msg.host_id, msg.transport)
        rec.file_id, rec.key, rec.fingerprint = proof.file_id, proof.key, proof.fingerprint
        self.segments[msg.name] = rec
        client.segments.add(msg.name)
        # Placement stays within the tenant (kvmaster/_tenancy.py): the segment holds its
        # tenant's writes only, or every tenant's for a --shared-tenants tenant.
        shared = client.tenant in self._shared_tenants
        rec.usable = sum(await self._ask_all("mount_segment", msg.name, client.client_id,
                                             msg.size, None if shared else client.tenant))
        if self.clients.get(client.identity) is not client:
            client.segments.discard(msg.name)
            if self.segments.get(msg.name) is rec:  # else its leaving unmounted it already,
                await self._drop_segment(msg.name)  # and the name may be mounted anew
            return Status.NOT_REGISTERED, "client left while its segment was being mounted"
        log.info("[master] mounted segment=%s client=%s size=%d", msg.name, client.client_id, msg.size)
        return 0, rec.usable

    async def _drop_segment(self, name: str) -> int:
        self.segments.pop(name, None)
        return sum(await self._ask_all("unmount_segment", name))

    async def _unmount(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        rec = self.segments.get(msg.name)
        # The client's own mounts only (not a name another client, or the master, holds
        # under the same client id), and with CURVE only from the key that mounted it.
        if rec is None or rec.owner != client.client_id or msg.name not in client.segments \
                or rec.key != (client.user_id if self._auth is not None else None):
            return Status.SEGMENT_NOT_FOUND, f"segment {msg.name} is not mounted by this client"
        client.segments.discard(msg.name)
        return 0, await self._drop_segment(msg.name)

    def _bye(self, client: ClientInfo, msg: Any) -> Any:
        """Forget the client now, as the BYE is read: what the connection sends next (in
        the same message or later) finds it unregistered, and a HELLO that follows
        registers it anew instead of being undone by the BYE.  -> the coroutine that
        answers once the shards have unmounted its segments (unlike the other
        handlers, not a coroutine function: its first part must not wait for the
        task to start)."""
        futures = self._forget_now(client, unlink=False)

        async def answer() -> tuple[int, Any]:
            await asyncio.gather(*futures)
            return 0, 0

        return answer()

    async def _forget(self, client: ClientInfo, unlink: bool) -> int:
        """Unmount a client's segments and drop its registration; -> objects erased."""
        return sum(await asyncio.gather(*self._forget_now(client, unlink)))

    def _forget_now(self, client: ClientInfo, unlink: bool) -> list[asyncio.Future]:
        """Everything of :meth:`_forget` that is done at once: the client's registration
        goes, and every shard is told to drop its staged session updates and to
        unmount its segments, in that order; -> futures of the shards' counts of
        objects erased.  Nothing waits in between, so a request the same connection
        sends next (a new HELLO, a MOUNT of the same segment) is handled after all of
        it, on every shard.  A client already forgotten is left alone (its connection
        may be registered anew, under the same identity and client id)."""
        if self.clients.get(client.identity) is not client:
            return []
        del self.clients[client.identity]
        self._client_counts.remove(client.tenant, client.user_id)
        self._shard_forget(client.identity)
        if self.client_ids.get(client.client_id) == client.identity:
            del self.client_ids[client.client_id]
        names = sorted(client.segments)
        client.segments.clear()
        for shard in self.shards:
            shard.post("client_gone", (client.client_id,))
        if unlink:
            for name in names:
                rec = self.segments.get(name)
                if rec is not None and _owners_file(rec, client.client_id) \
                        and unlink_segment(name):
                    log.info("[master] unlinked segment file of expired client name=%s", name)
        futures: list[asyncio.Future] = []
        for name in names:
            self.segments.pop(name, None)
            futures += self._post_all("unmount_segment", name)
        return futures

    async def _stats(self, client: ClientInfo | None, msg: Any) -> tuple[int, Any]:
        shards = await self._ask_all("stats")
        total: dict[str, Any] = {}
        for s in shards:
            for k, v in s.items():
                if k != "shard":
                    total[k] = total.get(k, 0) + v
        out = {"state": self.state.value, "clients": len(self.clients),
               "segments": len(self.segments), "front": dict(self.counters),
               "total": total, "shards": shards}
        if self._standby is not None:
            out["oplog"] = self._standby.status()
        return 0, out

    async def _list_clients(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        now = time.monotonic()
        admin = client.tenant == self.config.admin_tenant
        return 0, [{"client_id": c.client_id, "tenant": c.tenant, "host_id": c.host_id,
                    "idle_ms": int((now - c.last_seen) * 1000), "segments": sorted(c.segments),
                    "suspected": c.suspected}
                   for c in self.clients.values() if admin or c.tenant == client.tenant]

    async def _list_segments(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        allocated: dict[str, int] = {}
        for per_shard in await self._ask_all("segment_usage"):
            for name, used in per_shard.items():
                allocated[name] = allocated.get(name, 0) + used
        return 0, [{"name": r.name, "owner": r.owner, "size": r.size, "usable": r.usable,
                    "host_id": r.host_id, "transport": r.transport,
                    "allocated": allocated.get(r.name, 0)} for r in self.segments.values()]

    async def _get_config(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        import dataclasses

        cfg = dataclasses.asdict(self.config)
        cfg.pop("curve_dir", None)
        cfg["curve"] = bool(self.config.curve_dir)
        return 0, cfg

    async def snapshot(self) -> dict[str, Any]:
        """Stats of every shard and the front, gathered by message (for /metrics)."""
        return (await self._stats(None, None))[1]

    def _walk_refusal(self, client: ClientInfo, op: bytes) -> tuple[Status, str] | None:
        """Why a request that walks the shards may not run now (kvmaster/_limits.py)."""
        admin = client.tenant == self.config.admin_tenant
        if op == Op.CHECK_CONSISTENCY.value:
            if not admin:
                return Status.ILLEGAL_CLIENT, "CHECK_CONSISTENCY is for the admin tenant only"
            if self._checking:
                return Status.BUSY, "a consistency check is running, retry later"
        elif op in (Op.MOUNT_SEGMENT.value, Op.UNMOUNT_SEGMENT.value) and not admin:
            if not self._walk_buckets.take(client.tenant, self.front.now):
                self.counters["rejected_busy"] += 1
                return Status.BUSY, (f"tenant {client.tenant!r} sends more than {WALK_RATE:g} "
                                     f"mounts and unmounts per second, retry later")
        return None

    async def _check(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        self._checking = True
        try:
            return 0, await self.check_consistency()
        finally:
            self._checking = False

    async def _expire_clients(self, now: float) -> None:
        """Forget the clients silent for more than ``--client-ttl`` at ``now``
        (``time.monotonic()``), one after another; with ``--client-suspicion-ttl``, a
        client silent past ``--client-ttl`` is first suspected (no new writes on its
        segments, its objects kept and readable), forgotten only once silent past both,
        and active again (its segments take writes again) once heard from.  A client
        with a message parked by its tenant's request rate is waiting on the master, not
        silent (a client blocked in a call sends no HEARTBEAT): it is kept until the
        message is handled or dropped (at most PARKED_MAX_AGE_S)."""
        ttl = self.config.client_ttl
        grace = self.config.client_suspicion_ttl
        parked = self.front.parked_peers
        if grace > 0:
            for c in list(self.clients.values()):
                silent = now - c.last_seen > ttl and c.identity not in parked
                if silent and not c.suspected and now - c.last_seen <= ttl + grace:
                    self._suspect(c, True)
                elif c.suspected and not silent:
                    self._suspect(c, False)
        for client in [c for c in self.clients.values()
                       if now - c.last_seen > ttl + grace and c.identity not in parked]:
            # Forgetting one waits on the shards: meanwhile the next may have left (BYE)
            # or shown it is alive (a request, a HELLO from a new socket).
            if self.clients.get(client.identity) is not client \
                    or time.monotonic() - client.last_seen <= ttl + grace \
                    or client.identity in parked:
                continue
            self.counters["clients_expired"] += 1
            log.warning("[master] client expired client=%s segments=%d",
                        client.client_id, len(client.segments))
            await self._forget(client, unlink=True)

    def _suspect(self, client: ClientInfo, on: bool) -> None:
        """Mark ``client`` suspected (``on``) or active again, and tell every shard to
        stop or resume placing writes on its segments."""
        client.suspected = on
        if on:
            self.counters["clients_suspected"] += 1
            log.warning("[master] client suspected (silent for more than %.1f s; its "
                        "objects stay, no new writes on its segments) client=%s segments=%d",
                        self.config.client_ttl, client.client_id, len(client.segments))
        else:
            self.counters["clients_recovered"] += 1
            log.warning("[master] suspected client heard from again client=%s",
                        client.client_id)
        if client.segments:
            self._post_all("suspect_segments", sorted(client.segments), on)

    async def _housekeeping(self) -> None:
        period = min(1.0, self.config.client_ttl / 4)
        next_tick = last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            if now - last > 2 * period:
                # The master itself was paused (SIGSTOP, a VM freeze): its clients were
                # not silent, it was.  Credit them the lost time, then read what they
                # sent meanwhile before judging anyone.
                lost = now - last - period
                for c in self.clients.values():
                    c.last_seen += lost
                log.warning("[master] paused for %.1f s; client deadlines moved", lost)
            last = now
            self.front.on_readable()
            now = time.monotonic()
            await self._expire_clients(now)
            if now >= next_tick:
                next_tick = now + 1.0
                for shard in self.shards:
                    shard.post("tick", ())
                self.front.expire_groups(now)

    async def check_consistency(self) -> list[str]:
        """Invariant check over all shards (tests and the fuzzer use it): allocator
        accounting per shard, and session membership seen from both sides."""
        problems = [p for ps in await self._ask_all("check_consistency") for p in ps]
        views = await self._ask_all("session_view")
        members = {sck: set(m) for v in views for sck, m in v["sessions"].items()}
        refs: dict[bytes, set[bytes]] = {}
        for v in views:
            for ck, scks in v["refs"].items():
                for sck in scks:
                    refs.setdefault(sck, set()).add(ck)
        for sck in set(members) | set(refs):
            if members.get(sck, set()) != refs.get(sck, set()):
                problems.append(f"session {sck!r}: home members {len(members.get(sck, ()))} "
                                f"!= object refs {len(refs.get(sck, ()))}")
        pinned = {sck for v in views for sck in v["pinned_home"]}
        for v in views:
            if set(v["pinned_replica"]) != pinned:
                problems.append("replicated pinned-session set differs from the homes'")
                break
        return problems


class BindError(OSError):
    """The ROUTER socket could not bind one of its endpoints (address in use, no
    such directory, permission denied ...)."""


def _check_ipc_path(path: str) -> None:
    """Refuse an ipc path libzmq would misuse: the wildcard ``*`` (a random path that
    clients cannot know), a file that is not a socket (libzmq would delete it), and
    a socket another process is listening on (libzmq would take it over).  A stale
    socket file, left by a process that died, is fine: the bind replaces it.
    ``@name`` is Linux's abstract namespace (no file; a taken name fails the bind).
    Raises BindError."""
    addr = f"ipc://{path}"
    if path == "*" or not path:
        raise BindError(errno.EINVAL, f"cannot bind {addr}: give a path or an @abstract name")
    if path.startswith("@"):
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise BindError(exc.errno, f"cannot bind {addr}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise BindError(errno.EEXIST, f"cannot bind {addr}: a file that is not a socket is "
                                      "in the way")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # nobody listens: a stale file
    finally:
        probe.close()
    raise BindError(errno.EADDRINUSE, f"cannot bind {addr}: another process is listening "
                                      "there")


def _bind(sock: zmq.Socket, addr: str) -> str:
    """Bind ``sock`` to ``addr``; returns the bound endpoint.  Raises BindError."""
    try:
        sock.bind(addr)
    except zmq.ZMQError as exc:
        raise BindError(exc.errno, f"cannot bind {addr}: {zmq.strerror(exc.errno)}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def run_master(config: MasterConfig, on_started: Callable[..., None] | None = None) -> int:
    """Run a master on a fresh uvloop event loop until it is stopped; returns the exit
    status (0, or 3 when an HA leader lost its lease).  Leaves the process's garbage
    collector alone (see :func:`kvmaster._process.tune_gc`)."""
    try:
        import uvloop
        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - platforms without uvloop
        runner = asyncio.run
    master = Master(config)
    runner(master.serve(on_started))
    return master.exit_code
