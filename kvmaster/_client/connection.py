"""The client's connection state, written once for both drivers: the handshake
(HELLO/WELCOME, segment mount and re-mount after a re-handshake, HA endpoints) and the
routing of requests to the master's shards (:class:`Connection`).  The one socket made
here is the DEALER :meth:`Connection._open_dealer` opens for a driver; sending and
receiving on it are the drivers' (:mod:`kvmaster.client`, :mod:`kvmaster.aio`).
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from kvmaster import _cuda
from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.records import (
    _STR_ONLY,
    MOUNT_ATTEMPTS,
    MOUNT_RETRY_FIRST_S,
    RECONNECT,
    RECONNECT_HA,
    SPACE_OPS,
    ClientConfig,
    OpGen,
    Request,
    RoutingChanged,
    Welcome,
    _b,
    _crc32,
    _monotonic,
    check_master_address,
    endpoint_of,
    retain_heap,
)
from kvmaster._segment import (
    Segment,
    check_shm_room,
    host_id,
    new_segment_name,
    owner_fingerprint,
    segment_tag,
)
from kvmaster.protocol import Op

log = logging.getLogger(__name__)


class Connection:
    """Who this client is to the master (``client_id``, the WELCOME, its
    segment) and where each request goes (shard routing, reply trust under HA).
    Owns the state of the whole client core (:meth:`__init__`)."""

    #: Whether session tags were dropped for an older master (said once).
    _tags_dropped = False
    #: Numbers each DEALER the driver opens (set by the driver's ``__init__``).
    _connections: itertools.count[int]

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self.client_id = f"{host_id()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.welcome: Welcome | None = None
        self._segment: Segment | None = None
        self._mapped: dict[str, Segment] = {}
        # segment name -> (host_id, transport, size) as the master reported at mount time
        self._seg_info: dict[str, tuple[str, str, int]] = {}
        #: Remote segments whose transfer service reported the size they were mounted
        #: with (checked before the first transfer; see :meth:`_peer`).
        self._sized: set[str] = set()
        self._data_ctx: Any = None
        self._service: Any = None
        self._peers: dict[str, Any] = {}
        self.reconnect_count = 0
        #: Re-mounts the master refused after a re-handshake (each attempt counts; see
        #: :meth:`_mount_refused`).
        self.mount_refusals = 0
        #: WELCOMEs taken so far: each new connection (setup, re-handshake) adds one.
        self._generation = 0
        #: ``master_instance`` of the last WELCOME (None before the first).
        self._master_instance: str | None = None
        self.endpoint = ""
        self.ha = False
        #: Reply statuses that re-handshake (RECONNECT, or RECONNECT_HA).
        self._reconnect: tuple[P.Status, ...] = RECONNECT
        #: ``write_id`` of each write this client starts (unique for its client_id).
        self._write_ids = itertools.count(1)
        #: Monotonic send time of the latest request the master answered with success:
        #: it cannot expire this client before this plus ``client_ttl`` (the drivers
        #: keep it; the write fence, :mod:`kvmaster._fence`, reads it).
        self._heard = 0.0
        #: Replicas whose bytes did not match their object's checksum (each dropped on
        #: the master), and reads that found no replica that did (ChecksumMismatch).
        self.checksum_mismatches = 0
        self.checksum_failures = 0

    # ----------------------------------------------------------- handshake

    def _configure(self, **changes: Any) -> None:
        changes = {k: v for k, v in changes.items() if v is not None}
        if changes:
            self.config = ClientConfig(**{**self.config.__dict__, **changes})
        check_master_address(self.config.master_server_addr)
        self.ha = self.config.master_server_addr.startswith("etcd://")
        self._reconnect = RECONNECT_HA if self.ha else RECONNECT
        self.endpoint = "" if self.ha else endpoint_of(self.config.master_server_addr)
        if self.config.global_segment_size > 0:
            try:
                segment_tag()  # before anything is connected or registered
            except ValueError as exc:
                raise E.InvalidParams(str(exc), op="setup") from None
            check_shm_room(self.config.global_segment_size)  # InvalidParams, at once
        retain_heap(self.config.retain_heap_mb)

    def _resolve(self, timeout_s: float | None = None) -> str:
        """The master endpoint to connect to; with ``etcd://`` the current leader's,
        looked up within ``connect_timeout_s`` (or ``timeout_s`` when shorter)."""
        if not self.ha:
            return endpoint_of(self.config.master_server_addr)
        from kvmaster.ha import EtcdError, resolve_leader

        limit = self.config.connect_timeout_s
        if timeout_s is not None:
            limit = min(limit, timeout_s)
        try:
            return resolve_leader(self.config.master_server_addr, limit)
        except EtcdError as exc:
            raise E.ConnectionLost(f"no leader: {exc}", op="HELLO",
                                   endpoint=self.config.master_server_addr) from None

    def _hello_fields(self) -> list[Any]:
        cfg = self.config
        from kvmaster import __version__

        return [P.PROTOCOL_VERSION[0], P.PROTOCOL_VERSION[1], self.client_id, cfg.tenant,
                cfg.local_hostname or host_id(), __version__]

    def _open_dealer(self, ctx: Any, monitor_ctx: Any) -> tuple[Any, Any]:
        """A new DEALER of ``ctx`` to ``self.endpoint`` (see :meth:`_prepare_dealer`)
        and its :class:`~kvmaster._frames.LinkMonitor`, made before the connect on
        ``monitor_ctx`` (a plain context of the same libzmq context; None when libzmq
        cannot monitor: calls then wait out their timeout when the master goes away).
        A socket whose options or connect fail is closed, with its monitor, before the
        error is raised (left open, it made the context's term() in close() wait for
        ever)."""

        import zmq

        from kvmaster._frames import LinkMonitor

        sock = ctx.socket(zmq.DEALER)
        link = None
        try:
            self._prepare_dealer(sock, next(self._connections))
            try:
                link = LinkMonitor(sock, monitor_ctx)
            except zmq.ZMQError as exc:
                log.debug("no socket monitor: %s", exc)
            try:
                sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                raise E.InvalidParams(f"master address {self.endpoint!r}: {exc.strerror}",
                                      op="setup") from None
        except BaseException:
            if link is not None:
                link.close()
            sock.close(linger=0)
            raise
        return sock, link

    def _prepare_dealer(self, sock: Any, connection: int) -> None:
        """Options of a new DEALER to the master: routing id, linger, HWMs, CURVE keys."""
        import zmq

        sock.setsockopt(zmq.IDENTITY, f"{self.client_id}/{connection}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        cfg = self.config
        if cfg.curve_dir:
            from kvmaster import auth

            pub, sec, server = auth.client_keys(cfg.curve_dir, cfg.curve_client)
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = pub, sec, server

    def _welcomed(self, body: dict[str, Any]) -> None:
        """Take a WELCOME body as the connection's.  From another master process than
        the last WELCOME's (a restart, an HA failover, or a master that does not say
        which it is), every segment it knew is forgotten: the mappings of other
        processes' segments are dropped (a dead master's own segment file can only be
        removed once nothing maps it) and the segment table is emptied, to be filled
        again by LIST_SEGMENTS on the next read or write."""
        w = Welcome(body)
        last = self._master_instance
        if last is not None and (not w.instance or w.instance != last):
            self._forget_segments()
        self._master_instance = w.instance
        self._generation += 1
        self.welcome = w
        self._new_connection(bool(w.instance) and w.instance == last)

    def _new_connection(self, same_master: bool) -> None:
        """A WELCOME came on a new connection; ``same_master``: from the master process
        that answered the last one.  The drivers send again there the NoWait requests
        (failed puts' revokes) that got no reply on the old connection, and drop them
        for another master process, which never saw those writes."""

    def _forget_segments(self) -> None:
        """Drop every mapping but the contributed segment's, and the segment table
        (the contributed segment's entry is made again when it is mounted)."""
        own = self._segment
        self._drop_mappings(list(self._mapped))
        info = self._seg_info
        mine = {own.name: info[own.name]} if own is not None and own.name in info else {}
        info.clear()
        info.update(mine)
        self._sized.clear()

    def _drop_mappings(self, names: Iterable[str]) -> None:
        """Unmap these segments (never the contributed one).  No copy can be running
        from them: the sync client's copies and re-handshakes hold its lock, and the
        async client's copies run between two awaits of one task.  A view still
        exported (none is left by the operations) would keep its mapping until it is
        released (see :meth:`Segment.close`)."""
        own = self._segment
        for name in names:
            seg = self._mapped.get(name)
            if seg is None or seg is own:
                continue
            del self._mapped[name]
            seg.close(unlink=False)

    def _no_welcome(self, waited_s: float | None = None) -> E.Timeout:
        """Timeout of a HELLO; ``waited_s``: how long it waited, when a call's deadline
        or a short HA attempt cut ``connect_timeout_s`` short."""
        limit = self.config.connect_timeout_s
        if waited_s is None or waited_s >= limit - 0.05:  # (not cut short, or hardly)
            within = f"connect_timeout_s={limit}"
        else:
            within = (f"{max(waited_s, 0.0):.3g} s (what was left of the call's timeout_s or "
                      f"of connect_timeout_s={limit})")
        return E.Timeout(f"no WELCOME from {self.endpoint} within {within}; is the master "
                         "running?", op="HELLO", endpoint=self.endpoint)

    def _hello_gave_up(self, exc: BaseException, started: float) -> BaseException:
        """The error an HA connect raises after its last short attempt: a HELLO
        timeout or a leader look-up that found none then names the whole wait since
        ``started``, not that attempt's (the attempt's error is its cause)."""
        waited = _monotonic() - started
        if isinstance(exc, E.Timeout) and exc.op == "HELLO":
            return self._no_welcome(waited)
        if isinstance(exc, E.ConnectionLost) and exc.op == "HELLO" \
                and str(exc.args[0]).startswith("no leader"):
            last = str(exc.args[0])
            tail = "" if "no time left" in last else f"; the last look-up: {last}"
            return E.ConnectionLost(f"no leader found in {waited:.3g} s of trying{tail}",
                                    op="HELLO", endpoint=exc.endpoint)
        return exc

    def _own_segment(self) -> Segment | None:
        """Create the contributed segment on first use, or a fresh one if the master
        removed our file (it does so when it expires a client)."""
        seg = self._segment
        if seg is not None and not os.path.exists(f"/dev/shm/{seg.name}"):
            self._mapped.pop(seg.name, None)
            _cuda.forget_host(seg.buf)
            seg.close(unlink=False)
            seg = self._segment = None
        if seg is None and self.config.global_segment_size:
            seg = self._segment = Segment.create(self.config.global_segment_size,
                                                 new_segment_name(self._owner_fingerprint()))
            self._mapped[seg.name] = seg
        return seg

    def _owner_fingerprint(self) -> str:
        """The owner part of this client's segment names (``.owner-<16 hex>``): of its
        CURVE public key with CURVE, else of its client id; the master refuses a mount
        of a name with another (PROTOCOL.md section 11)."""
        cfg = self.config
        if cfg.curve_dir:
            from kvmaster import auth

            return owner_fingerprint(auth.client_keys(cfg.curve_dir, cfg.curve_client)[0].decode())
        return owner_fingerprint(self.client_id)

    def _fresh_segment(self) -> None:
        """Give up the contributed segment for a new one under a new name (its old name
        is taken on the master: see :meth:`_mount_refused`)."""
        seg = self._segment
        if seg is not None:
            self._mapped.pop(seg.name, None)
            self._seg_info.pop(seg.name, None)
            _cuda.forget_host(seg.buf)
            seg.close()
            self._segment = None

    def _mount_refused(self, exc: BaseException, attempt: int) -> float | None:
        """Attempt ``attempt`` (1-based) at re-mounting the segment after a
        re-handshake raised ``exc``.  A refusal (a status other than BUSY or a
        re-handshake's, which the callers handle as before) is logged at WARNING
        with its status and counted in ``mount_refusals``.  -> the pause before the
        next attempt (MOUNT_RETRY_FIRST_S, doubling), 0.0 when the attempts are used
        up (the caller then gives the name up for a fresh one: :meth:`_fresh_segment`),
        or None when ``exc`` is no refusal (raise it)."""
        if not isinstance(exc, E.RequestError) or isinstance(exc, E.Busy) \
                or exc.code in self._reconnect:
            return None
        self.mount_refusals += 1
        seg = self._segment
        last = attempt >= MOUNT_ATTEMPTS
        log.warning("master %s refused the re-mount of segment %s (attempt %d of %d): %s%s",
                    self.endpoint, seg.name if seg else "?", attempt, MOUNT_ATTEMPTS, exc,
                    "; giving the name up for a new segment" if last else "")
        return 0.0 if last else MOUNT_RETRY_FIRST_S * 2 ** (attempt - 1)

    def _mount_fields(self, seg: Segment) -> list[Any]:
        transport = "shm"
        if self.config.transfer_host:
            svc = self._service
            if svc is None or svc.segment is not seg:
                if svc is not None:
                    svc.close()
                from kvmaster.transfer import TransferService

                svc = self._service = TransferService(self._zmq_data(), seg,
                                                      self.config.transfer_host,
                                                      self._curve_server_keys(),
                                                      self._allowed_keys_dir())
                svc.start()
            transport = svc.endpoint
            keys = self._curve_server_keys()
            if keys is not None:
                # Peers need the service's public key to connect (it is the owner's).
                transport += "#curve=" + keys[0].decode()
        self._seg_info[seg.name] = (self._host(), transport, seg.size)
        return [seg.name, seg.size, self._host(), transport]

    def _host(self) -> str:
        return self.config.local_hostname or host_id()

    def _zmq_data(self) -> Any:
        if self._data_ctx is None:
            import zmq

            self._data_ctx = zmq.Context()
        return self._data_ctx

    def _curve_server_keys(self) -> tuple[bytes, bytes] | None:
        cfg = self.config
        if not cfg.curve_dir:
            return None
        from kvmaster import auth

        pub, sec, _ = auth.client_keys(cfg.curve_dir, cfg.curve_client)
        return pub, sec

    def _allowed_keys_dir(self) -> str | None:
        """With CURVE, the directory of client public keys the transfer service admits."""
        if not self.config.curve_dir:
            return None
        import os.path

        d = os.path.join(self.config.curve_dir, "clients")
        return d if os.path.isdir(d) else None

    def _release_segments(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        if self._service is not None:
            self._service.close()
            self._service = None
        if self._data_ctx is not None:
            self._data_ctx.term()
            self._data_ctx = None
        for seg in self._mapped.values():
            if seg.owner:
                _cuda.forget_host(seg.buf)
            seg.close()
        self._mapped.clear()
        self._segment = None

    @property
    def segment_name(self) -> str | None:
        return self._segment.name if self._segment else None

    @property
    def shard_count(self) -> int:
        return self._welcome().shard_count

    def _welcome(self) -> Welcome:
        w = self.welcome
        if w is None:
            raise E.ConnectionLost("client is not connected (setup not called, or a "
                                   "re-handshake is under way)", endpoint=self.endpoint)
        return w

    # -------------------------------------------------------------- routing

    def _trust(self, reqs: list[Request]) -> float | None:
        """How long after its sending the reply to this round may come and still be
        used (s), when the round gives out space or replica locations and the master
        is an HA leader (``Welcome.trust_s``); else None (no limit)."""
        w = self.welcome
        if w is None or w.trust_s is None:
            return None
        for op, _, _ in reqs:
            if op in SPACE_OPS:
                return w.trust_s
        return None

    def _stale(self, trust: float) -> E.Timeout:
        return E.Timeout(f"the reply came more than {trust:.3g} s (the HA leader's reply_trust_ms) "
                         "after the request: it may be a former leader's, so it was not used",
                         endpoint=self.endpoint)

    def _routing(self) -> tuple[int, int, bool, bool] | None:
        w = self.welcome
        return None if w is None else (w.shard_count, w.seed, w.any_shard, w.columns)

    def _check_routing(self, before: tuple[int, int, bool, bool] | None) -> None:
        """Raise RoutingChanged when a re-handshake changed the shard layout."""
        if self._routing() != before:
            raise RoutingChanged("the master came back with another shard layout",
                                 endpoint=self.endpoint)

    def _may_resend(self, sent_at: float, pause: float, deadline: float, limit: float) -> bool:
        """Whether a request refused BUSY goes out again: retries are on and, after the
        pause, the deadline leaves the resend room for its answer (twice the last round
        trip, at least 20 ms or a tenth of ``limit``, the call's timeout), so a request
        refused all along ends in Busy rather than Timeout.  Times are
        ``time.monotonic()``."""
        if not self.config.busy_retry:
            return False
        t = _monotonic()
        return t + pause + max(2 * (t - sent_at), 0.02, 0.1 * limit) < deadline

    def _route(self, bkey: bytes) -> bytes:
        w = self._welcome()
        return w.routes[P.shard_of(bkey, w.seed, w.shard_count)]

    def _group(self, keys: Sequence[str], op: Op | None = None
               ) -> tuple[list[bytes], dict[int, list[int]]]:
        """Encode keys and group their positions by shard (in ascending position).
        When the master takes ``op`` on any shard (WELCOME ``batch_any_shard``), one
        group holds every position, routed to the first key's shard."""
        w = self._welcome()
        if len(keys) > w.max_batch:
            raise E.InvalidParams(f"batch of {len(keys)} keys exceeds max_batch={w.max_batch}",
                                  op="batch")
        # A set of the types: an identity test per key (list.count would call a
        # metaclass's __eq__, and let a str subclass through: see _b).
        if set(map(type, keys)) <= _STR_ONLY:
            bkeys = list(map(str.encode, keys))  # the common case: all str
        else:
            bkeys = [_b(k) for k in keys]  # bytes, or a clear error for anything else
        n = w.shard_count
        if op is not None and w.any_shard and op.value in P.ANY_SHARD_OPS and bkeys:
            return bkeys, {_crc32(bkeys[0], w.seed) % n: list(range(len(bkeys)))}
        if n == 1:
            return bkeys, {0: list(range(len(bkeys)))} if bkeys else {}
        shard = P.shards_of(bkeys, w.seed, n)
        return bkeys, {s: idx for s, idx in enumerate(P.positions_by_shard(shard, n)) if idx}

    @staticmethod
    def _fan(op: Op, per_shard: dict[int, list[Any]]) -> list[Request]:
        return [(op.value, P.route_for_shard(s), f) for s, f in per_shard.items()]

    def _batch(self, op: Op, keys: Sequence[str], extra: Sequence[Any] = ()) -> OpGen:
        """Fan a per-key batch op out to shards; results back in key order."""
        bkeys, groups = self._group(keys, op)
        if not bkeys:
            return []
        if len(groups) == 1:  # one request with every key, in order: its body is the answer
            ((s, _),) = groups.items()
            (body,) = yield [(op.value, P.route_for_shard(s), [bkeys, *extra])]
            return body
        shards = list(groups)
        bodies = yield [(op.value, P.route_for_shard(s), [[bkeys[i] for i in groups[s]], *extra])
                        for s in shards]
        out: list[Any] = [None] * len(bkeys)
        for s, body in zip(shards, bodies):
            for i, r in zip(groups[s], body):
                out[i] = r
        return out
