"""The kvmaster master process: a ROUTER front and N shard actors on one event loop.

The :class:`Master` owns the lifecycle: it binds the ROUTER socket, starts the shards
(in-process actors or shard processes), the HA election, metrics and housekeeping,
and drains and stops them.  Its :class:`~kvmaster._front.Front` reads the socket and
routes each request on its first two frames (op, route), handing the undecoded
payload to the owning :class:`~kvmaster._shard.ShardActor`'s bounded inbox (a full
inbox is answered BUSY at once).  Master-level ops (HELLO, HEARTBEAT, MOUNT/UNMOUNT,
BYE, STATS) are decoded and answered by its :class:`~kvmaster._registry.Registry` of
clients and segments, which talks to shards only by internal messages.

Shutdown is a state machine: RUNNING -> DRAINING (signal: new requests get
SHUTTING_DOWN, queued ones finish) -> STOPPED (sockets closed with a linger,
then the context terminated, shared memory unlinked).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import signal
import socket
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from kvmaster import protocol as P
from kvmaster._front import REPLY_MESSAGE_BYTES, ROUTER_LINGER_S, Front, MasterState
from kvmaster._process import tune_gc  # noqa: F401 - kvmaster.master.tune_gc, as before
from kvmaster._registry import (
    FRONT_OP_COUNTERS,
    MASTER_CLIENT,
    Registry,
    SegmentRecord,
    sweep_stale_segments,
)
from kvmaster._segment import Segment, host_id, master_segment_name
from kvmaster._shard import ShardActor
from kvmaster._shardref import LocalShards, ShardRef
from kvmaster.config import MasterConfig

if TYPE_CHECKING:
    from kvmaster._shardproc import ShardProcesses

log = logging.getLogger(__name__)


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
    """The master's lifecycle: start, serve, drain and stop; runs on the event loop
    thread that calls :meth:`serve`.  It owns the shards (``shard_set``), the client
    socket's traffic (``front``), the clients and segments (``registry``), the HA
    election and op log, metrics and housekeeping."""

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
        self.counters = dict.fromkeys(
            ("rejected_busy", "rejected_unregistered", "malformed", "reply_dropped",
             "clients_expired", "clients_suspected", "clients_recovered", "hello",
             "multi_request_messages", "rate_parked", "rate_dropped", "rate_expired",
             "stalled_dropped"), 0)
        for names in FRONT_OP_COUNTERS.values():
            self.counters.update(dict.fromkeys(names, 0))
        #: Clients and segments, and the master-level ops (kvmaster/_registry.py).
        self.registry = Registry(self, config, self.counters)
        #: The client socket's traffic (kvmaster/_front.py).
        self.front = self.registry.front = Front(self, config, self.counters, self.registry)
        #: The shards' set, in-process or shard processes (kvmaster/_shardref.py).
        self.shard_set: LocalShards | ShardProcesses
        if config.shard_processes:
            from kvmaster._shardproc import ShardProcesses

            self.shard_set = ShardProcesses(config)
        else:
            self.shard_set = LocalShards(config, self.front.send_reply)
        #: Its shards by index (those of shard processes once started).
        self.shards: Sequence[ShardRef] = self.shard_set.shards
        self._ctx: zmq.Context | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._own_segment: Segment | None = None
        self._auth: Any = None
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
            loop.remove_reader(int(router.getsockopt(zmq.FD)))
            self._close()  # whatever start-up made so far: segment, shard processes, sockets
            raise
        self.front.on_readable()  # messages may have arrived before the reader was added
        stopped = self._stopped
        if stopped is None:
            raise RuntimeError("Master._serve() runs only from Master.run()")
        await stopped.wait()
        # DRAINING: stop reading; queued requests are answered by their shards, and
        # those parked by a tenant's request rate SHUTTING_DOWN at once.
        loop.remove_reader(int(router.getsockopt(zmq.FD)))
        self.front.now = time.monotonic()
        self.front.dispatch_parked(everything=True)
        for shard in self.shards:
            shard.drain()
        if not isinstance(self.shard_set, LocalShards):
            # Answers still queued in the shard processes go out before the stop.
            self._on_shard_readable()
            loop.remove_reader(self.shard_set.fd())
        housekeeping.cancel()
        for t in list(self.registry.tasks):
            t.cancel()
        self._close()

    async def _start(self, loop: asyncio.AbstractEventLoop, router: zmq.Socket) -> asyncio.Task:
        """Shards, own segment, reader, metrics and housekeeping (after the bind)."""
        shard_set = self.shard_set
        if isinstance(shard_set, LocalShards):
            self.shards = shard_set.start(self._waker)
        else:
            ctx = self._ctx
            if ctx is None:
                raise RuntimeError("Master._start() runs only after _serve() made the context")
            self.shards = shard_set.start(ctx)
            loop.add_reader(shard_set.fd(), self._on_shard_readable)
            # Edge-triggered FD: reading EVENTS once re-arms it after start()'s reads.
            self._on_shard_readable()
        if self.config.ha:
            self._start_election(loop)
        elif self.config.master_segment_size:
            await self._mount_own_segment()
        loop.add_reader(int(router.getsockopt(zmq.FD)), self.front.on_readable)
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
            loop = self._loop
            assert loop is not None  # (called on the running loop)
            self._sweep = loop.create_task(sweep_stale_segments(loop),
                                           name="kvmaster-stale-segments")

    def _start_auth(self, ctx: zmq.Context, router: zmq.Socket) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        from kvmaster import auth

        directory = self.config.curve_dir
        public, secret = auth.master_keys(directory)
        self.registry.tenant_of_key = auth.allowed_tenants(directory)
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(Path(directory) / "clients"))
        router.curve_secretkey = secret
        router.curve_publickey = public
        router.curve_server = True
        log.info("[master] CURVE on: %d allowed client keys", len(self.registry.tenant_of_key))

    def _start_election(self, loop: asyncio.AbstractEventLoop) -> None:
        from kvmaster.ha import LeaderElection

        cfg = self.config
        endpoints = [e.strip() for e in cfg.etcd_endpoints.split(",") if e.strip()]

        def lead() -> None:  # (the election thread)
            loop.call_soon_threadsafe(self._become_leader)

        def lost() -> None:  # (the election thread)
            loop.call_soon_threadsafe(self._lose_leadership)

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
            on_lost=lost)
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
            loop = self._loop
            assert loop is not None  # (called on the running loop)
            task = loop.create_task(self._mount_own_segment())
            self.registry.tasks.add(task)
            task.add_done_callback(self.registry.tasks.discard)

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
        self.shard_set.stop()
        if self._own_segment is not None:
            self._own_segment.close(unlink=True)
            self._own_segment = None
        self.registry.remove_orphan_files()
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

    async def _mount_own_segment(self) -> None:
        # The name carries this process's pid, start time and pid namespace, so that a
        # later master can tell the file is left over once this one is dead.
        seg = Segment.create(self.config.master_segment_size, master_segment_name())
        self._own_segment = seg
        rec = SegmentRecord(seg.name, MASTER_CLIENT, seg.size, self.host_id, "shm")
        rec.usable = sum(await self.ask_all("mount_segment", seg.name, MASTER_CLIENT, seg.size,
                                            None))  # (shared by every tenant)
        self.registry.segments[seg.name] = rec

    def _on_shard_readable(self) -> None:
        """Forward what the shard processes sent, then read the client socket again."""
        if not isinstance(self.shard_set, LocalShards) \
                and self.shard_set.on_readable(self.front.send_reply):
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

    def post_all(self, fn_name: str, *args: Any) -> list[asyncio.Future]:
        """Send an internal message to every shard now; -> the futures of the answers."""
        loop = self._loop
        assert loop is not None  # (called on the running loop)
        futs = []
        for shard in self.shards:
            fut = loop.create_future()
            shard.post(fn_name, args, fut)
            futs.append(fut)
        return futs

    async def ask_all(self, fn_name: str, *args: Any) -> list[Any]:
        """Send an internal message to every shard and gather the answers."""
        return list(await asyncio.gather(*self.post_all(fn_name, *args)))

    async def snapshot(self) -> dict[str, Any]:
        """Stats of every shard and the front, gathered by message (for /metrics)."""
        return (await self.registry.stats(None, None))[1]

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
                for c in self.registry.clients.values():
                    c.last_seen += lost
                log.warning("[master] paused for %.1f s; client deadlines moved", lost)
            last = now
            self.front.on_readable()
            now = time.monotonic()
            await self.registry.expire_clients(now)
            if now >= next_tick:
                next_tick = now + 1.0
                for shard in self.shards:
                    shard.post("tick", ())
                self.front.expire_groups(now)

    async def check_consistency(self) -> list[str]:
        """Invariant check over all shards (tests and the fuzzer use it): allocator
        accounting per shard, and session membership seen from both sides."""
        problems = [p for ps in await self.ask_all("check_consistency") for p in ps]
        views = await self.ask_all("session_view")
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
        code = exc.errno
        if code is None:  # (pyzmq sets errno on every error bind raises)
            raise
        raise BindError(code, f"cannot bind {addr}: {zmq.strerror(code)}") from None
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
