"""Synchronous kvmaster client with Mooncake Store's method names.

One :class:`Client` holds one DEALER connection to the master, the segment it
contributes (shared memory, owner-only), and mappings of the other segments it
reads or writes.  It is safe to share between threads: a lock serialises use
of the socket, and a call that spans shards keeps all its sub-requests in
flight at once.  A background thread sends heartbeats while the client is
idle and re-handshakes (re-mounting the segment and calling the reconnect
hook) when the master has forgotten it, e.g. after a restart.

Errors raise the tree in :mod:`kvmaster.errors`.  Batch calls return one
result per position, in order.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._segment import Segment, host_id
from kvmaster.protocol import Op, SoftPinAction, Status

__all__ = ["Client", "ClientConfig", "KvSessionInfo", "KvSessionPage", "ReplicateConfig"]

log = logging.getLogger(__name__)

_packb = msgpack.Packer(use_bin_type=True).pack
_monotonic = time.monotonic
_OK_PUT = (0, Status.OBJECT_ALREADY_EXISTS)


@dataclass
class ReplicateConfig:
    """Placement and pinning of a write (Mooncake ``ReplicateConfig``).

    replica_num: replicas on distinct segments (fewer if fewer are mounted).
    with_hard_pin: never evicted.  soft_pin_action / soft_pin_ttl_ms: see
    :class:`~kvmaster.protocol.SoftPinAction`; a TTL is allowed only with ENABLE.
    preferred_segments: segment names tried first.
    """

    replica_num: int = 1
    with_hard_pin: bool = False
    soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
    soft_pin_ttl_ms: int | None = None
    preferred_segments: Sequence[str] = ()
    #: Sessions to tag each written key with: one inner list per key (a single-key
    #: write takes exactly one).  None or empty lists tag nothing.
    kv_sessions: Sequence[Sequence[str]] | None = None

    def to_wire(self) -> list[Any]:
        return [self.replica_num, self.with_hard_pin, int(self.soft_pin_action),
                self.soft_pin_ttl_ms, list(self.preferred_segments)]


@dataclass(frozen=True)
class KvSessionInfo:
    """``get_kv_session`` result."""

    session_id: str
    pinned: bool
    member_count: int


@dataclass(frozen=True)
class KvSessionPage:
    """``list_kv_session_keys`` result; ``next_cursor`` is "" when the walk is done."""

    keys: list[str]
    next_cursor: str


@dataclass(frozen=True)
class ClientConfig:
    """Configuration of a client (one field per setup argument)."""

    master_server_addr: str = "127.0.0.1:50051"
    global_segment_size: int = 0
    tenant: str = P.DEFAULT_TENANT
    local_hostname: str = ""
    timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    reconnect_max_backoff_s: float = 5.0
    #: With ``curve_client``: the key directory from ``kvmaster keygen`` (needs
    #: ``master.key`` and ``clients/<curve_client>.key_secret``).
    curve_dir: str = ""
    curve_client: str = ""


def _endpoint(addr: str) -> str:
    return addr if "://" in addr else f"tcp://{addr}"


class _Conn:
    """Socket plus handshake results; replaced wholesale on reconnect."""

    __slots__ = ("sock", "identity", "shard_count", "seed", "lease_ttl_ms", "client_ttl_ms",
                 "max_batch", "tenant", "master_host", "session_batch")

    def __init__(self, sock: zmq.Socket, identity: bytes) -> None:
        self.sock = sock
        self.identity = identity


class Client:
    """Synchronous, thread-safe client.  See the module docstring."""

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self.client_id = f"{host_id()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._ctx: zmq.Context | None = None
        self._conn: _Conn | None = None
        self._welcomed = False
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._segment: Segment | None = None
        self._mapped: dict[str, Segment] = {}
        self._last_sent = 0.0
        self._hb_thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._reconnects = itertools.count(1)
        self.reconnect_count = 0
        self.on_reconnect: Callable[[Client], None] | None = None
        self.endpoint = ""

    # ------------------------------------------------------------- lifecycle

    def setup(self, master_server_addr: str | None = None, global_segment_size: int | None = None,
              tenant: str | None = None, *, local_hostname: str | None = None,
              timeout_s: float | None = None, curve_dir: str | None = None,
              curve_client: str | None = None,
              on_reconnect: Callable[[Client], None] | None = None) -> None:
        """Connect, handshake and mount a segment of ``global_segment_size`` bytes
        (0 = consumer only).  ``on_reconnect(client)`` runs after every re-handshake
        (e.g. to re-attach and re-pin sessions).

        Raises VersionMismatch, Timeout (names ``connect_timeout_s``), InvalidParams.
        """
        cfg = self.config
        changes = {k: v for k, v in (("master_server_addr", master_server_addr),
                                     ("global_segment_size", global_segment_size),
                                     ("tenant", tenant), ("local_hostname", local_hostname),
                                     ("timeout_s", timeout_s), ("curve_dir", curve_dir),
                                     ("curve_client", curve_client)) if v is not None}
        if changes:
            self.config = cfg = ClientConfig(**{**cfg.__dict__, **changes})
        if on_reconnect is not None:
            self.on_reconnect = on_reconnect
        self.endpoint = _endpoint(cfg.master_server_addr)
        self._ctx = zmq.Context()
        with self._lock:
            self._connect()
            if cfg.global_segment_size:
                self._segment = Segment.create(cfg.global_segment_size)
                self._mapped[self._segment.name] = self._segment
                self._mount()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name=f"kvmaster-heartbeat-{self.client_id}")
        self._hb_thread.start()

    def _connect(self) -> None:
        """New DEALER socket and HELLO; raises on refusal or timeout."""
        assert self._ctx is not None
        if self._conn is not None:
            self._conn.sock.close(linger=0)
            self._conn = None
        identity = f"{self.client_id}/{next(self._reconnects)}".encode()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        cfg = self.config
        if cfg.curve_dir:
            from kvmaster import auth

            pub, sec, server = auth.client_keys(cfg.curve_dir, cfg.curve_client)
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = pub, sec, server
        sock.connect(self.endpoint)
        conn = _Conn(sock, identity)
        self._conn = conn
        hello = [next(self._ids), P.PROTOCOL_VERSION[0], P.PROTOCOL_VERSION[1], self.client_id,
                 cfg.tenant, cfg.local_hostname or host_id(), _client_version()]
        try:
            body = self._roundtrip(Op.HELLO.value, P.MASTER_ROUTE, hello, cfg.connect_timeout_s)
        except E.Timeout:
            raise E.Timeout(f"no WELCOME from {self.endpoint} within connect_timeout_s="
                            f"{cfg.connect_timeout_s}; is the master running?",
                            op="HELLO", endpoint=self.endpoint) from None
        self._welcomed = True
        conn.shard_count = body["shard_count"]
        conn.tenant = body["tenant"]
        conn.seed = P.tenant_seed(conn.tenant)
        conn.lease_ttl_ms = body["lease_ttl_ms"]
        conn.client_ttl_ms = body["client_ttl_ms"]
        conn.max_batch = body["limits"]["max_batch"]
        conn.session_batch = body["limits"].get("kv_session_max_batch", conn.max_batch)
        conn.master_host = body.get("master_host_id", "")

    def _mount(self) -> None:
        seg = self._segment
        assert seg is not None
        self._roundtrip(Op.MOUNT_SEGMENT.value, P.MASTER_ROUTE,
                        [next(self._ids), seg.name, seg.size,
                         self.config.local_hostname or host_id(), "shm"])

    def close(self) -> None:
        """Unmount the segment (its objects are erased), say BYE, release everything."""
        self._closing.set()
        with self._lock:
            if self._conn is not None and self._welcomed:
                try:
                    self._roundtrip(Op.BYE.value, P.MASTER_ROUTE, [next(self._ids)],
                                    min(2.0, self.config.timeout_s))
                except E.KVMasterError as exc:
                    log.debug("BYE failed: %s", exc)
            if self._conn is not None:
                self._conn.sock.close(linger=0)
                self._conn = None
            for seg in self._mapped.values():
                seg.close()
            self._mapped.clear()
            self._segment = None
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None
        if self._hb_thread is not None and self._hb_thread is not threading.current_thread():
            self._hb_thread.join(timeout=2)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def segment_name(self) -> str | None:
        return self._segment.name if self._segment else None

    @property
    def shard_count(self) -> int:
        return self._require().shard_count

    # --------------------------------------------------------------- plumbing

    def _require(self) -> _Conn:
        conn = self._conn
        if conn is None:
            raise E.ConnectionLost("client is not connected (call setup)", endpoint=self.endpoint)
        return conn

    def _roundtrip(self, op: bytes, route: bytes, fields: list[Any],
                   timeout_s: float | None = None) -> Any:
        """Send one request and wait for its reply; returns the body or raises."""
        return self._exchange([(op, route, fields)], timeout_s)[0]

    def _exchange(self, reqs: list[tuple[bytes, bytes, list[Any]]],
                  timeout_s: float | None = None, raise_errors: bool = True) -> list[Any]:
        """Send all requests, then collect every reply (matched by req_id).

        With ``raise_errors`` the first non-zero status raises; otherwise a failed
        request's slot holds its RequestError.
        """
        conn = self._require()
        sock = conn.sock
        pending: dict[int, int] = {}
        for i, (op, route, fields) in enumerate(reqs):
            pending[fields[0]] = i
            sock.send_multipart((op, route, _packb(fields)), copy=False)
        self._last_sent = _monotonic()
        out: list[Any] = [None] * len(reqs)
        deadline = self._last_sent + (timeout_s if timeout_s is not None else self.config.timeout_s)
        while pending:
            remaining = deadline - _monotonic()
            if remaining <= 0 or not sock.poll(remaining * 1000):
                op = Op(reqs[next(iter(pending.values()))][0]).name
                raise E.Timeout(f"no reply within {timeout_s or self.config.timeout_s:.3g} s",
                                op=op, endpoint=self.endpoint)
            frames = sock.recv_multipart()
            if len(frames) != 2:
                continue
            try:
                req_id, status, body = P.decode_reply(frames[1])
            except P.ProtocolError:
                continue
            i = pending.pop(req_id, None)
            if i is None:
                continue  # a late reply to an earlier, timed-out request
            if status:
                err = E.error_for(status, body if isinstance(body, str) else str(body),
                                  op=_op_name(reqs[i][0]), req_id=req_id, endpoint=self.endpoint)
                if raise_errors and status != Status.NOT_REGISTERED:
                    raise err
                out[i] = err
            else:
                out[i] = body
        for i, v in enumerate(out):
            if isinstance(v, E.NotRegistered):
                raise v
        return out

    def _call(self, op: bytes, route: bytes, fields_after_id: list[Any]) -> Any:
        """One request with automatic re-handshake if the master forgot this client."""
        with self._lock:
            try:
                return self._roundtrip(op, route, [next(self._ids), *fields_after_id])
            except E.NotRegistered:
                self._rehandshake()
                return self._roundtrip(op, route, [next(self._ids), *fields_after_id])

    def _call_shards(self, op: bytes, per_shard: dict[int, list[Any]]) -> dict[int, Any]:
        """One request per shard (fields after req_id), all in flight at once."""
        with self._lock:
            for attempt in (0, 1):
                reqs = [(op, P.route_for_shard(s), [next(self._ids), *f])
                        for s, f in per_shard.items()]
                try:
                    bodies = self._exchange(reqs)
                except E.NotRegistered:
                    if attempt:
                        raise
                    self._rehandshake()
                    continue
                return dict(zip(per_shard, bodies))
        raise AssertionError("unreachable")

    def _rehandshake(self) -> None:
        """The master does not know us (restart or expiry): HELLO again, remount, hook."""
        log.warning("master %s forgot client %s; re-handshaking", self.endpoint, self.client_id)
        self._connect()
        seg = self._segment
        if seg is not None:
            if not os.path.exists(f"/dev/shm/{seg.name}"):
                # The master expired us and removed the file: others can no longer
                # map it, so contribute a fresh segment instead.
                self._mapped.pop(seg.name, None)
                seg.close(unlink=False)
                self._segment = Segment.create(seg.size)
                self._mapped[self._segment.name] = self._segment
            self._mount()
        self.reconnect_count += 1
        hook = self.on_reconnect
        if hook is not None:
            try:
                hook(self)
            except Exception:  # noqa: BLE001 - an application hook must not break the client
                log.exception("on_reconnect hook failed")

    def _heartbeat_loop(self) -> None:
        backoff = 0.1
        while not self._closing.is_set():
            conn = self._conn
            interval = (conn.client_ttl_ms / 1000 / P.HEARTBEAT_LIVENESS) if conn else 1.0
            if self._closing.wait(min(interval, 1.0)):
                return
            if _monotonic() - self._last_sent < interval:
                continue
            if not self._lock.acquire(timeout=interval):
                continue
            try:
                if self._closing.is_set() or self._conn is None:
                    return
                try:
                    self._roundtrip(Op.HEARTBEAT.value, P.MASTER_ROUTE, [next(self._ids)],
                                    min(self.config.timeout_s, max(interval, 0.5)))
                    backoff = 0.1
                except E.NotRegistered:
                    self._rehandshake()
                except E.TransportError:
                    # Master silent: try a fresh connection, doubling the wait.
                    try:
                        self._rehandshake()
                        backoff = 0.1
                    except E.KVMasterError:
                        backoff = min(backoff * 2, self.config.reconnect_max_backoff_s)
                        self._closing.wait(backoff)
            except Exception:  # noqa: BLE001 - keep beating
                log.exception("heartbeat failed")
            finally:
                self._lock.release()

    # ------------------------------------------------------------ key routing

    def _group(self, keys: Sequence[str]) -> tuple[list[bytes], dict[int, list[int]]]:
        """Encode keys and group their positions by shard."""
        conn = self._require()
        if len(keys) > conn.max_batch:
            raise E.InvalidParams(f"batch of {len(keys)} keys exceeds max_batch={conn.max_batch}",
                                  op="batch")
        bkeys = [_b(k) for k in keys]
        n, seed = conn.shard_count, conn.seed
        groups: dict[int, list[int]] = {}
        crc = P.zlib.crc32
        for i, k in enumerate(bkeys):
            groups.setdefault(crc(k, seed) % n, []).append(i)
        return bkeys, groups

    def _route(self, bkey: bytes) -> bytes:
        conn = self._require()
        return P.route_for_shard(P.shard_of(bkey, conn.seed, conn.shard_count))

    def _batch(self, op: Op, keys: Sequence[str], extra: list[Any] | None = None
               ) -> tuple[list[bytes], list[Any]]:
        """Fan a per-key batch op out to shards; results back in key order."""
        bkeys, groups = self._group(keys)
        if not bkeys:
            return bkeys, []
        per_shard = {s: [[bkeys[i] for i in idx], *(extra or [])] for s, idx in groups.items()}
        bodies = self._call_shards(op.value, per_shard)
        out: list[Any] = [None] * len(bkeys)
        for s, idx in groups.items():
            for i, r in zip(idx, bodies[s]):
                out[i] = r
        return bkeys, out

    # ------------------------------------------------------------ data plane

    def _seg(self, name: str) -> Segment:
        seg = self._mapped.get(name)
        if seg is None:
            seg = self._mapped[name] = Segment.attach(name)
        return seg

    def _write(self, replicas: list[list[Any]], parts: Sequence[Any]) -> None:
        for name, off in replicas:
            buf = self._seg(name).buf
            pos = off
            for part in parts:
                n = len(part) if not isinstance(part, memoryview) else part.nbytes
                buf[pos:pos + n] = part
                pos += n

    def _read_into(self, replicas: list[list[Any]], size: int, dst: Any) -> None:
        last: Exception | None = None
        for name, off in replicas:
            try:
                dst[:size] = self._seg(name).buf[off:off + size]
                return
            except (FileNotFoundError, OSError, ValueError) as exc:
                last = exc
        raise E.KVMasterError(f"no replica readable: {last}", code=Status.TRANSFER_FAIL)

    def _read_bytes(self, replicas: list[list[Any]], size: int) -> bytes:
        last: Exception | None = None
        for name, off in replicas:
            try:
                return self._seg(name).buf[off:off + size].tobytes()
            except (FileNotFoundError, OSError, ValueError) as exc:
                last = exc
        raise E.KVMasterError(f"no replica readable: {last}", code=Status.TRANSFER_FAIL)

    # ------------------------------------------------------------------ puts

    def _put_parts_list(self, op_start: Op, key: str, parts: Sequence[Any],
                        config: ReplicateConfig | None) -> None:
        size = sum(len(p) if not isinstance(p, memoryview) else p.nbytes for p in parts)
        if size <= 0:
            raise E.InvalidParams("value must not be empty", op=op_start.name)
        bkey = _b(key)
        route = self._route(bkey)
        cfg = config.to_wire() if config is not None else None
        fields: list[Any] = [bkey, size, cfg]
        tags = config.kv_sessions if config is not None else None
        if tags:
            if len(tags) != 1:
                raise E.InvalidParams("kv_sessions must hold exactly one list for a single key",
                                      op=op_start.name)
            op_start = _TAGGED[op_start]
            fields.append([_b(t) for t in tags[0]])
        with self._lock:
            try:
                replicas = self._call(op_start.value, route, fields)
            except E.ObjectAlreadyExists:
                return  # write-once: the object is (being) stored already
            try:
                self._write(replicas, parts)
            except BaseException:
                self._call(Op.PUT_REVOKE.value, route, [bkey])
                raise
            self._call(Op.PUT_END.value, route, [bkey])

    def put(self, key: str, value: bytes | bytearray | memoryview,
            config: ReplicateConfig | None = None) -> None:
        """Store ``value`` under ``key`` unless it exists (write-once; a second put
        succeeds without replacing).  Raises NoAvailableHandle, InvalidParams."""
        self._put_parts_list(Op.PUT_START, key, (value,), config)

    def put_parts(self, key: str, *parts: bytes | bytearray | memoryview,
                  config: ReplicateConfig | None = None) -> None:
        """Like :meth:`put` with the value given as consecutive parts (no join copy)."""
        self._put_parts_list(Op.PUT_START, key, parts, config)

    def put_from(self, key: str, buffer: Any, config: ReplicateConfig | None = None) -> None:
        """Like :meth:`put` from any buffer-protocol object (numpy array, mmap, ...)."""
        self._put_parts_list(Op.PUT_START, key, (memoryview(buffer).cast("B"),), config)

    def upsert(self, key: str, value: bytes | bytearray | memoryview,
               config: ReplicateConfig | None = None) -> None:
        """Store ``value``, replacing an existing object (readers holding a lease
        keep reading the old bytes until it ends)."""
        self._put_parts_list(Op.UPSERT_START, key, (value,), config)

    def upsert_from(self, key: str, buffer: Any, config: ReplicateConfig | None = None) -> None:
        self._put_parts_list(Op.UPSERT_START, key, (memoryview(buffer).cast("B"),), config)

    def _write_batch(self, op_start: Op, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None) -> list[int]:
        if len(keys) != len(values):
            raise E.InvalidParams("keys and values differ in length", op=op_start.name)
        sizes = [len(v) if not isinstance(v, memoryview) else v.nbytes for v in values]
        if any(s <= 0 for s in sizes):
            bad = [i for i, s in enumerate(sizes) if s <= 0]
            raise E.InvalidParams(f"empty values at positions {bad[:8]}", op=op_start.name)
        bkeys, groups = self._group(keys)
        if not bkeys:
            return []
        cfg = config.to_wire() if config is not None else None
        tags = config.kv_sessions if config is not None else None
        btags: list[list[bytes]] | None = None
        if tags:
            if len(tags) != len(keys):
                raise E.InvalidParams(f"kv_sessions has {len(tags)} lists for {len(keys)} keys",
                                      op=op_start.name)
            btags = [[_b(t) for t in ts] for ts in tags]
            op_start = _TAGGED[op_start]
        results: list[int] = [0] * len(bkeys)
        with self._lock:
            starts = self._call_shards(op_start.value, {
                s: [[bkeys[i] for i in idx], [sizes[i] for i in idx], cfg,
                    *([[btags[i] for i in idx]] if btags is not None else [])]
                for s, idx in groups.items()})
            ends: dict[int, list[int]] = {}
            revokes: dict[int, list[int]] = {}
            for s, idx in groups.items():
                for i, r in zip(idx, starts[s]):
                    if type(r) is int:
                        results[i] = 0 if r == Status.OBJECT_ALREADY_EXISTS else r
                        continue
                    try:
                        self._write(r, (values[i],))
                    except (OSError, ValueError) as exc:
                        log.warning("write of %r failed: %s", keys[i], exc)
                        results[i] = Status.TRANSFER_FAIL
                        revokes.setdefault(s, []).append(i)
                        continue
                    ends.setdefault(s, []).append(i)
            if revokes:
                self._call_shards(Op.BATCH_PUT_REVOKE.value,
                                  {s: [[bkeys[i] for i in idx]] for s, idx in revokes.items()})
            if ends:
                done = self._call_shards(Op.BATCH_PUT_END.value,
                                         {s: [[bkeys[i] for i in idx]] for s, idx in ends.items()})
                for s, idx in ends.items():
                    for i, r in zip(idx, done[s]):
                        results[i] = r
        return results

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> list[int]:
        """Write-once puts; one status per position (0 = stored or already there)."""
        return self._write_batch(Op.BATCH_PUT_START, keys, values, config)

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any],
                       config: ReplicateConfig | None = None) -> list[int]:
        return self._write_batch(Op.BATCH_PUT_START, keys,
                                 [memoryview(b).cast("B") for b in buffers], config)

    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None = None) -> list[int]:
        return self._write_batch(Op.BATCH_UPSERT_START, keys, values, config)

    # ------------------------------------------------------------------ gets

    def _get_desc(self, key: str) -> tuple[list[Any], float]:
        bkey = _b(key)
        t0 = _monotonic()
        desc = self._call(Op.GET_REPLICA_LIST.value, self._route(bkey), [bkey])
        return [desc[0], desc[2]], t0 + desc[1] / 1000.0

    def _check_lease(self, deadline: float, key: str) -> None:
        if _monotonic() > deadline:
            raise E.LeaseExpired(f"read of {key!r} outlived its lease; bytes discarded", op="get")

    def get(self, key: str) -> bytes:
        """The object's bytes.  Raises ObjectNotFound, LeaseExpired."""
        (size, replicas), deadline = self._get_desc(key)
        data = self._read_bytes(replicas, size)
        self._check_lease(deadline, key)
        return data

    def get_buffer(self, key: str) -> memoryview:
        """The object's bytes as a memoryview over a private copy."""
        (size, replicas), deadline = self._get_desc(key)
        dst = bytearray(size)
        self._read_into(replicas, size, dst)
        self._check_lease(deadline, key)
        return memoryview(dst)

    def get_into(self, key: str, buffer: Any) -> int:
        """Copy the object into ``buffer`` (writable, buffer protocol); returns bytes
        read.  Raises InvalidParams if the buffer is too small."""
        (size, replicas), deadline = self._get_desc(key)
        dst = memoryview(buffer).cast("B")
        if dst.nbytes < size:
            raise E.InvalidParams(f"buffer of {dst.nbytes} bytes < object of {size}", op="get_into")
        self._read_into(replicas, size, dst)
        self._check_lease(deadline, key)
        return size

    def _batch_descs(self, keys: Sequence[str]) -> tuple[list[Any], float]:
        t0 = _monotonic()
        conn = self._require()
        _, descs = self._batch(Op.BATCH_GET_REPLICA_LIST, keys)
        return descs, t0 + conn.lease_ttl_ms / 1000.0

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """Bytes per position; None where the object is missing."""
        descs, deadline = self._batch_descs(keys)
        out: list[bytes | None] = []
        for d in descs:
            if type(d) is int:
                out.append(None)
                continue
            out.append(self._read_bytes(d[2], d[0]))
        if _monotonic() > deadline:
            raise E.LeaseExpired("batch read outlived its lease; bytes discarded", op="get_batch")
        return out

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Copy each object into its buffer; bytes read per position or a negative status."""
        if len(keys) != len(buffers):
            raise E.InvalidParams("keys and buffers differ in length", op="batch_get_into")
        descs, deadline = self._batch_descs(keys)
        out: list[int] = []
        for d, b in zip(descs, buffers):
            if type(d) is int:
                out.append(d)
                continue
            size, replicas = d[0], d[2]
            dst = memoryview(b).cast("B")
            if dst.nbytes < size:
                out.append(Status.INVALID_PARAMS)
                continue
            self._read_into(replicas, size, dst)
            out.append(size)
        if _monotonic() > deadline:
            return [Status.LEASE_EXPIRED if n >= 0 else n for n in out]
        return out

    def register_buffer(self, buffer: Any) -> None:
        """Accepted for compatibility: shared-memory reads need no registration."""

    # ---------------------------------------------------------------- queries

    def is_exist(self, key: str) -> bool:
        """Whether the object exists and is readable.  Refreshes recency; no lease."""
        bkey = _b(key)
        return bool(self._call(Op.EXIST_KEY.value, self._route(bkey), [bkey]))

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 / negative status per position."""
        return self._batch(Op.BATCH_EXIST_KEY, keys)[1]

    def get_size(self, key: str) -> int:
        bkey = _b(key)
        return self._call(Op.GET_SIZE.value, self._route(bkey), [bkey])

    def query_key(self, key: str) -> dict[str, Any]:
        """Replicas, lease and pins of one object, without touching it."""
        bkey = _b(key)
        return self._call(Op.QUERY_KEY.value, self._route(bkey), [bkey])

    # --------------------------------------------------------------- removal

    def remove(self, key: str, force: bool = False) -> None:
        """Raises ObjectNotFound, ObjectHasLease (unless force)."""
        bkey = _b(key)
        self._call(Op.REMOVE.value, self._route(bkey), [bkey, force])

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return self._batch(Op.BATCH_REMOVE, keys, [force])[1]

    def remove_all(self, force: bool = False) -> int:
        """Remove every removable object of this tenant; returns how many."""
        n = self._require().shard_count
        return sum(self._call_shards(Op.REMOVE_ALL.value, {s: [force] for s in range(n)}).values())

    # -------------------------------------------------------------- sessions

    def _session_route(self, session_id: str) -> tuple[bytes, bytes]:
        sid = _b(session_id)
        return sid, self._route(sid)

    def attach_kv_session(self, session_id: str, keys: Sequence[str]) -> list[int]:
        """Associate existing objects; per key 0, OBJECT_NOT_FOUND (-704) or
        SESSION_LIMIT_EXCEEDED (-1802).  Creates the session on its first association.
        At most ``kv_session_max_batch`` keys (InvalidParams otherwise)."""
        sid, route = self._session_route(session_id)
        return self._call(Op.ATTACH_KV_SESSION.value, route, [sid, [_b(k) for k in keys]])

    def pin_kv_session(self, session_id: str) -> None:
        """Give current and future members soft-pin priority (no TTL).
        Raises SessionNotFound for an unknown session."""
        sid, route = self._session_route(session_id)
        self._call(Op.SET_KV_SESSION_PIN.value, route, [sid, True])

    def unpin_kv_session(self, session_id: str) -> None:
        """Withdraw this session's pin; membership and other sessions' pins stay."""
        sid, route = self._session_route(session_id)
        self._call(Op.SET_KV_SESSION_PIN.value, route, [sid, False])

    def update_kv_session(self, session_id: str, keep_keys: Iterable[str]) -> int:
        """Make membership its intersection with one complete keep set (sent in pages
        when larger than a message); deletes no data; a missing session is a no-op.
        Returns the number of members removed."""
        sid, route = self._session_route(session_id)
        keep = list(dict.fromkeys(_b(k) for k in keep_keys))
        page = self._require().max_batch
        token = int.from_bytes(os.urandom(7), "big")
        with self._lock:
            for i in range(0, max(len(keep), 1), page):
                final = i + page >= len(keep)
                out = self._call(Op.UPDATE_KV_SESSION.value, route,
                                 [sid, keep[i:i + page], token, final])
        return out

    def close_kv_session(self, session_id: str) -> None:
        """Drop every association and the pin; cached data stays; idempotent."""
        sid, route = self._session_route(session_id)
        self._call(Op.CLOSE_KV_SESSION.value, route, [sid])

    def get_kv_session(self, session_id: str) -> KvSessionInfo:
        """Raises SessionNotFound."""
        sid, route = self._session_route(session_id)
        body = self._call(Op.GET_KV_SESSION.value, route, [sid])
        return KvSessionInfo(session_id, body[1], body[2])

    def list_kv_session_keys(self, session_id: str, cursor: str = "",
                             limit: int = 1024) -> KvSessionPage:
        """One page of member keys after ``cursor`` (exclusive, lexical by UTF-8 bytes);
        weakly consistent; grants no lease.  ``limit`` at most 4096."""
        sid, route = self._session_route(session_id)
        body = self._call(Op.LIST_KV_SESSION_KEYS.value, route,
                          [sid, _b(cursor) if cursor else b"", limit])
        return KvSessionPage([k.decode() for k in body[0]], body[1].decode())

    def iter_kv_session_keys(self, session_id: str, page: int = 1024) -> Iterable[str]:
        """Every member, page by page."""
        cursor = ""
        while True:
            p = self.list_kv_session_keys(session_id, cursor, page)
            yield from p.keys
            if not p.next_cursor:
                return
            cursor = p.next_cursor

    def check_consistency(self) -> list[str]:
        """The master's invariant check (O(objects)); empty list when consistent."""
        return self._call(Op.CHECK_CONSISTENCY.value, P.MASTER_ROUTE, [])

    def list_clients(self) -> list[dict[str, Any]]:
        """Registered clients (this tenant's; every tenant's for the admin tenant)."""
        return self._call(Op.LIST_CLIENTS.value, P.MASTER_ROUTE, [])

    def list_segments(self) -> list[dict[str, Any]]:
        """Mounted segments with their size and allocated bytes."""
        return self._call(Op.LIST_SEGMENTS.value, P.MASTER_ROUTE, [])

    def get_config(self) -> dict[str, Any]:
        """The master's configuration (every flag's value)."""
        return self._call(Op.GET_CONFIG.value, P.MASTER_ROUTE, [])

    def stats(self) -> dict[str, Any]:
        """Master counters: ``total`` summed over shards (``keys``, ``evicted_keys``,
        ``evicted_bytes``, ...), per-shard ``shards``, ``clients``, ``segments``."""
        s = self._call(Op.STATS.value, P.MASTER_ROUTE, [])
        total = s["total"]
        return {**total, **{k: v for k, v in s.items() if k != "total"}}


_TAGGED = {
    Op.PUT_START: Op.PUT_START_WITH_KV_SESSIONS,
    Op.UPSERT_START: Op.UPSERT_START_WITH_KV_SESSIONS,
    Op.BATCH_PUT_START: Op.BATCH_PUT_START_WITH_KV_SESSIONS,
    Op.BATCH_UPSERT_START: Op.BATCH_UPSERT_START_WITH_KV_SESSIONS,
}


def _b(key: str | bytes) -> bytes:
    if type(key) is str:
        return key.encode()
    if type(key) is bytes:
        return key
    raise E.InvalidParams(f"key must be str, not {type(key).__name__}")


def _op_name(op: bytes) -> str:
    try:
        return Op(op).name
    except ValueError:
        return op.hex()


def _client_version() -> str:
    from kvmaster import __version__

    return __version__


def iter_chunks(seq: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i:i + n]
