"""A catalog of named bad inputs, each with its own status code and message.

One parametrized case per named input.  Each case sends the input over the raw
protocol (a DEALER socket that said HELLO) and, where the native client lets
the input through to the master (or refuses it itself), through
:class:`kvmaster.Client` as well.  A case states the status, a word the
one-line message must contain (the field or limit at fault), and the client's
exception type and code.  After the catalog the master still serves, nothing
leaked and ``check_consistency()`` is empty.

The transport-level inputs have their own tests below: replies to unknown
request ids (a fake master), requests before HELLO, a wrong protocol version
through the native client, and huge frames (a frame declared over the master's
frame bound, twice a full batch and at least 16 MiB, is dropped with its connection;
a large but allowed 14 MiB frame is answered INVALID_PARAMS promptly and its memory
is given back).

``tests/test_bad_input.py`` covers wrong types per field, bad routes and bad
frame counts; this catalog does not repeat those.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import zmq
from conftest import MasterProcess

from kvmaster import (
    Client,
    ClientConfig,
    ConnectionLost,
    InvalidParams,
    KVMasterError,
    ReplicateConfig,
    Status,
    VersionMismatch,
)
from kvmaster import protocol as P
from kvmaster.protocol import Op

SHARDS = 2
MAX_BATCH = 8
SESSION_BATCH = 8
SEED = P.tenant_seed("default")


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def route(key: Any) -> bytes:
    k = key if type(key) is bytes else b"x"
    return P.route_for_shard(P.shard_of(k, SEED, SHARDS))


def keys_on_shard(index: int, n: int) -> list[bytes]:
    gen = (b"ck%d" % i for i in itertools.count())
    return list(itertools.islice((k for k in gen if P.shard_of(k, SEED, SHARDS) == index), n))


class Raw:
    def __init__(self, endpoint: str, client_id: str = "catalog-raw") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.client_id = client_id
        self.ids = itertools.count(1000)

    def ask(self, op: bytes, rte: bytes, fields: list[Any] | None = None,
            payload: bytes | None = None, timeout: float = 5.0) -> tuple[int, int, Any]:
        rid = next(self.ids)
        if payload is None:
            payload = packb([rid, *(fields or [])])
        self.sock.send_multipart([op, rte, payload])
        assert self.sock.poll(timeout * 1000), "no reply: the master went silent"
        frames = self.sock.recv_multipart()
        assert len(frames) == 2 and frames[0] == op
        return P.decode_reply(frames[1])

    def hello(self, major: int = 1, minor: int = 0, tenant: str = "default") -> tuple[int, Any]:
        _, status, body = self.ask(Op.HELLO.value, b"",
                                   [major, minor, self.client_id, tenant, "catalog-host", "0"])
        return status, body

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def env(request):
    extra = ("--shard-processes",) if request.config.getoption("--shard-processes",
                                                                default=False) else ()
    m = MasterProcess(*extra, "--shards", str(SHARDS), "--max-batch", str(MAX_BATCH),
                      "--kv-session-max-batch", str(SESSION_BATCH), "--log-level", "WARNING")
    c = Client()
    raw = Raw(m.endpoint)
    try:
        c.setup(m.addr, 8 << 20)
        c.put("good", b"good-value")
        assert c.attach_kv_session("good-session", ["good"]) == [0]
        assert raw.hello()[0] == 0
        yield m, c, raw
        # Nothing the catalog sent changed the store, and it still serves.
        assert c.get("good") == b"good-value"
        assert c.get_kv_session("good-session").member_count == 1
        assert c.check_consistency() == []
    finally:
        raw.close()
        c.close()
        assert m.stop() == 0, getattr(m, "stderr", "")[-3000:]
        assert "Traceback" not in getattr(m, "stderr", ""), m.stderr[-3000:]


# ---------------------------------------------------------------------------
# The catalog


@dataclass
class Case:
    name: str
    #: None: the input exists only at the client API (checked through the client only).
    op: Op | None
    fields: list[Any]
    status: int
    words: tuple[str, ...]
    #: key used to compute the route frame (None: master-level op).
    route_key: Any = None
    #: Native-client call, or None when the client cannot express the input.
    call: Callable[[Client], Any] | None = None
    exc: type[KVMasterError] = InvalidParams
    #: The client refuses this input itself (no request sent).
    client_side: bool = False
    notes: str = field(default="")


K4097 = b"k" * 4097
S4097 = "s" * 4097
BATCH = keys_on_shard(0, MAX_BATCH + 1)
SBATCH = [b"ck%d" % i for i in range(SESSION_BATCH + 1)]

CATALOG = [
    # keys
    Case("empty_key", Op.EXIST_KEY, [b""], Status.INVALID_PARAMS, ("key",), b"",
         lambda c: c.is_exist("")),
    Case("empty_key_in_batch", Op.BATCH_GET_REPLICA_LIST, [[b"good", b""]],
         Status.INVALID_PARAMS, ("keys",), b"good", lambda c: c.get_batch(["good", ""])),
    Case("oversize_key", Op.GET_SIZE, [K4097], Status.INVALID_PARAMS, ("key", "4096"), K4097,
         lambda c: c.get_size(K4097.decode())),
    Case("oversize_key_in_batch", Op.BATCH_REMOVE, [[K4097], True], Status.INVALID_PARAMS,
         ("keys", "4096"), K4097, lambda c: c.batch_remove([K4097.decode()])),
    Case("nul_in_key", Op.QUERY_KEY, [b"a\x00b"], Status.INVALID_PARAMS, ("key", "NUL"),
         b"a\x00b", lambda c: c.query_key("a\x00b")),
    Case("nul_only_key", Op.REMOVE, [b"\x00", True], Status.INVALID_PARAMS, ("key", "NUL"),
         b"\x00", lambda c: c.remove("\x00", force=True)),
    Case("nul_in_upsert_key", Op.UPSERT_START, [b"u\x00", 10, None], Status.INVALID_PARAMS,
         ("key", "NUL"), b"u\x00", lambda c: c.upsert("u\x00", b"v")),
    # session ids and cursors
    Case("empty_session_id", Op.GET_KV_SESSION, [b""], Status.INVALID_PARAMS, ("session_id",),
         b"", lambda c: c.get_kv_session("")),
    Case("oversize_session_id", Op.ATTACH_KV_SESSION, [S4097.encode(), [b"good"]],
         Status.INVALID_PARAMS, ("session_id", "4096"), S4097.encode(),
         lambda c: c.attach_kv_session(S4097, ["good"])),
    Case("nul_in_session_id", Op.SET_KV_SESSION_PIN, [b"s\x00", True], Status.INVALID_PARAMS,
         ("session_id", "NUL"), b"s\x00", lambda c: c.pin_kv_session("s\x00")),
    Case("nul_in_closed_session_id", Op.CLOSE_KV_SESSION, [b"\x00s"], Status.INVALID_PARAMS,
         ("session_id",), b"\x00s", lambda c: c.close_kv_session("\x00s")),
    Case("empty_key_in_attach", Op.ATTACH_KV_SESSION, [b"good-session", [b""]],
         Status.INVALID_PARAMS, ("keys",), b"good-session",
         lambda c: c.attach_kv_session("good-session", [""])),
    Case("nul_in_cursor", Op.LIST_KV_SESSION_KEYS, [b"good-session", b"c\x00", 4],
         Status.INVALID_PARAMS, ("cursor",), b"good-session",
         lambda c: c.list_kv_session_keys("good-session", "c\x00", 4)),
    Case("oversize_cursor", Op.LIST_KV_SESSION_KEYS, [b"good-session", K4097, 4],
         Status.INVALID_PARAMS, ("cursor", "4096"), b"good-session",
         lambda c: c.list_kv_session_keys("good-session", K4097.decode(), 4)),
    Case("empty_session_id_in_tagged_put", Op.PUT_START_WITH_KV_SESSIONS,
         [b"tp", 10, None, [b""]], Status.INVALID_PARAMS, ("sessions",), b"tp",
         lambda c: c.put("tp", b"v", ReplicateConfig(kv_sessions=[[""]]))),
    # sizes
    Case("zero_size", Op.PUT_START, [b"z", 0, None], Status.INVALID_PARAMS, ("size",), b"z",
         lambda c: c.put("z", b""), client_side=True),
    Case("zero_size_in_batch", Op.BATCH_PUT_START, [[b"z"], [0], None], Status.INVALID_PARAMS,
         ("sizes",), b"z", lambda c: c.put_batch(["z", "y"], [b"v", b""]), client_side=True),
    Case("negative_size", Op.PUT_START, [b"n", -1, None], Status.INVALID_PARAMS, ("size",), b"n"),
    Case("negative_size_in_batch", Op.BATCH_UPSERT_START, [[b"n"], [-4096], None],
         Status.INVALID_PARAMS, ("sizes",), b"n"),
    Case("size_2_48", Op.UPSERT_START, [b"h", 1 << 48, None], Status.INVALID_PARAMS, ("size",),
         b"h"),
    Case("zero_segment_size", Op.MOUNT_SEGMENT, ["kvmaster-catalog0", 0, "h", "shm"],
         Status.INVALID_PARAMS, ("size",)),
    Case("negative_segment_size", Op.MOUNT_SEGMENT, ["kvmaster-catalog1", -(1 << 20), "h", "shm"],
         Status.INVALID_PARAMS, ("size",)),
    Case("segment_smaller_than_shards", Op.MOUNT_SEGMENT,
         ["kvmaster-catalog2", 4096 * SHARDS - 1, "h", "shm"], Status.INVALID_PARAMS,
         ("segment size", str(4096 * SHARDS))),
    Case("zero_list_limit", Op.LIST_KV_SESSION_KEYS, [b"good-session", b"", 0],
         Status.INVALID_PARAMS, ("limit",), b"good-session",
         lambda c: c.list_kv_session_keys("good-session", "", 0)),
    Case("negative_update_token", Op.UPDATE_KV_SESSION, [b"good-session", [], -1, True],
         Status.INVALID_PARAMS, ("token",), b"good-session"),
    Case("zero_replica_num", Op.PUT_START, [b"r", 10, [0]], Status.INVALID_PARAMS,
         ("replica_num",), b"r", lambda c: c.put("r", b"v", ReplicateConfig(replica_num=0))),
    Case("soft_pin_ttl_over_max", Op.PUT_START, [b"t", 10, [1, False, 1, 10 ** 12]],
         Status.INVALID_PARAMS, ("soft_pin_ttl_ms",), b"t",
         lambda c: c.put("t", b"v", ReplicateConfig(soft_pin_action=P.SoftPinAction.ENABLE,
                                                      soft_pin_ttl_ms=10 ** 12))),
    # batches over the limit
    Case("batch_over_max_batch", Op.BATCH_EXIST_KEY, [BATCH], Status.INVALID_PARAMS,
         ("max_batch",), BATCH[0], lambda c: c.batch_is_exist([k.decode() for k in BATCH]),
         client_side=True),
    Case("batch_remove_over_max_batch", Op.BATCH_REMOVE, [BATCH, False], Status.INVALID_PARAMS,
         ("max_batch",), BATCH[0], lambda c: c.batch_remove([k.decode() for k in BATCH]),
         client_side=True),
    Case("attach_over_session_batch", Op.ATTACH_KV_SESSION, [b"good-session", SBATCH],
         Status.INVALID_PARAMS, ("kv_session_max_batch",), b"good-session",
         lambda c: c.attach_kv_session("good-session", [k.decode() for k in SBATCH])),
    Case("update_page_over_max_batch", Op.UPDATE_KV_SESSION,
         [b"good-session", SBATCH, 7, False], Status.INVALID_PARAMS, ("max_batch",),
         b"good-session"),
    Case("list_limit_over_session_batch", Op.LIST_KV_SESSION_KEYS,
         [b"good-session", b"", SESSION_BATCH + 1], Status.INVALID_PARAMS,
         ("kv_session_max_batch",), b"good-session",
         lambda c: c.list_kv_session_keys("good-session", "", SESSION_BATCH + 1)),
    Case("list_limit_over_2_20", Op.LIST_KV_SESSION_KEYS, [b"good-session", b"", (1 << 20) + 1],
         Status.INVALID_PARAMS, ("limit",), b"good-session"),
    # mismatched list lengths
    Case("keys_and_sizes_differ", Op.BATCH_PUT_START, [[b"a", b"a"], [10], None],
         Status.INVALID_PARAMS, ("length",), b"a"),
    Case("upsert_keys_and_sizes_differ", Op.BATCH_UPSERT_START, [[b"a"], [10, 20], None],
         Status.INVALID_PARAMS, ("length",), b"a"),
    Case("keys_and_values_differ", Op.BATCH_PUT_START, [[b"a", b"a"], [10], None],
         Status.INVALID_PARAMS, ("length",), b"a",
         lambda c: c.put_batch(["a", "b"], [b"v"]), client_side=True),
    Case("keys_and_session_lists_differ", Op.BATCH_PUT_START_WITH_KV_SESSIONS,
         [[b"a"], [10], None, [[b"s"], [b"s"]]], Status.INVALID_PARAMS, ("kv_sessions",), b"a",
         lambda c: c.put_batch(["a", "b"], [b"v", b"w"],
                               ReplicateConfig(kv_sessions=[["s"]])), client_side=True),
    Case("keys_and_buffers_differ", None, [], Status.INVALID_PARAMS, ("length",), None,
         lambda c: c.batch_get_into(["good", "x"], [bytearray(16)]), client_side=True),
    # strings with NUL or over their limits
    Case("nul_in_tenant", Op.HELLO, [1, 0, "c-nul", "ten\x00ant", "h", "0"],
         Status.INVALID_PARAMS, ("tenant", "NUL")),
    Case("oversize_tenant", Op.HELLO, [1, 0, "c-long", "t" * 257, "h", "0"],
         Status.INVALID_PARAMS, ("tenant", "256")),
    Case("empty_client_id", Op.HELLO, [1, 0, "", "default", "h", "0"], Status.INVALID_PARAMS,
         ("client_id", "empty")),
    Case("oversize_segment_name", Op.MOUNT_SEGMENT, ["g" * 256, 1 << 20, "h", "shm"],
         Status.INVALID_PARAMS, ("name", "255")),
    Case("nul_in_preferred_segment", Op.PUT_START, [b"p", 10, [1, False, 0, None, ["a\x00"]]],
         Status.INVALID_PARAMS, ("preferred_segments",), b"p",
         lambda c: c.put("p", b"v", ReplicateConfig(preferred_segments=["a\x00"]))),
    # wrong protocol version
    Case("protocol_major_2", Op.HELLO, [2, 0, "c-v2", "default", "h", "0"],
         Status.VERSION_MISMATCH, ("protocol", "2.0")),
    Case("protocol_major_0", Op.HELLO, [0, 9, "c-v0", "default", "h", "0"],
         Status.VERSION_MISMATCH, ("protocol", "0.9")),
    Case("protocol_major_256", Op.HELLO, [256, 0, "c-v256", "default", "h", "0"],
         Status.INVALID_PARAMS, ("protocol_major",)),
]


@pytest.mark.parametrize("case", CATALOG, ids=[c.name for c in CATALOG])
def test_catalog(env, case: Case) -> None:
    m, c, raw = env
    assert len({x.name for x in CATALOG}) == len(CATALOG)
    if case.op is not None:
        check_raw(m, raw, case)
    if case.call is not None:
        before = c.stats()
        with pytest.raises(case.exc) as info:
            case.call(c)
        assert info.value.code == case.status, info.value
        text = str(info.value)
        words = case.words if not case.client_side else case.words[:0]
        for word in words:
            assert word in text, f"client error {text!r} does not name {word!r}"
        after = c.stats()
        for k in ("keys", "pending_writes", "sessions", "allocated_bytes"):
            assert after[k] == before[k], k


def check_raw(m: MasterProcess, raw: Raw, case: Case) -> None:
    assert case.op is not None
    rte = b"" if case.op.value < b"\x10" else route(case.route_key)
    if case.op is Op.HELLO:
        peer = Raw(m.endpoint, "unused")  # a fresh connection: HELLO registers nothing
        try:
            rid, status, body = peer.ask(case.op.value, rte, case.fields)
            # A refused HELLO registers nothing.
            assert peer.ask(Op.HEARTBEAT.value, b"", [])[1] == Status.NOT_REGISTERED
        finally:
            peer.close()
    else:
        rid, status, body = raw.ask(case.op.value, rte, case.fields)
    assert (status, Status(status).name) == (case.status, Status(case.status).name), body
    assert rid >= 1000, "the request id is echoed"
    assert isinstance(body, str) and 0 < len(body) <= 200 and "\n" not in body, body
    for word in case.words:
        assert word in body, f"message {body!r} does not name {word!r}"


def test_catalog_names_every_required_input() -> None:
    """The issue's list of named inputs, each present in the catalog or below."""
    names = {c.name for c in CATALOG}
    for required in ("empty_key", "oversize_key", "empty_session_id", "oversize_session_id",
                     "nul_in_key", "nul_in_session_id", "negative_size", "zero_size",
                     "batch_over_max_batch", "keys_and_sizes_differ", "protocol_major_2"):
        assert required in names
    for fn in (test_requests_before_hello, test_reply_to_unknown_request_id_is_ignored,
               test_frame_over_max_message_size_drops_only_that_connection,
               test_large_allowed_frame_is_refused_promptly_and_memory_returns):
        assert callable(fn)


# ---------------------------------------------------------------------------
# Requests before HELLO


BEFORE_HELLO = [
    (Op.HEARTBEAT, b"", []), (Op.STATS, b"", []), (Op.CHECK_CONSISTENCY, b"", []),
    (Op.LIST_SEGMENTS, b"", []), (Op.BYE, b"", []),
    (Op.UNMOUNT_SEGMENT, b"", ["kvmaster-none"]),
    (Op.GET_SIZE, route(b"good"), [b"good"]),
    (Op.PUT_START, route(b"k"), [b"k", 10, None]),
    (Op.ATTACH_KV_SESSION, route(b"good-session"), [b"good-session", [b"good"]]),
    (Op.LIST_KV_SESSION_KEYS, route(b"good-session"), [b"good-session", b"", 4]),
    (Op.REMOVE_ALL, P.route_for_shard(1), [True]),
]


def test_requests_before_hello(env) -> None:
    """Every op before HELLO: NOT_REGISTERED naming HELLO, the request id echoed,
    nothing changed.  The native client refuses calls before setup itself."""
    m, c, _ = env
    peer = Raw(m.endpoint, "before-hello")
    try:
        for op, rte, fields in BEFORE_HELLO:
            rid, status, body = peer.ask(op.value, rte, fields)
            assert status == Status.NOT_REGISTERED, (op, body)
            assert rid >= 1000 and "HELLO" in body, (op, rid, body)
    finally:
        peer.close()
    assert c.get("good") == b"good-value"
    fresh = Client()
    try:
        for call in (lambda: fresh.get("good"), lambda: fresh.put("k", b"v"),
                     lambda: fresh.attach_kv_session("s", ["good"]), lambda: fresh.stats()):
            with pytest.raises(ConnectionLost) as info:
                call()
            assert info.value.code == Status.RPC_FAIL and "setup" in str(info.value)
    finally:
        fresh.close()


# ---------------------------------------------------------------------------
# Wrong protocol version through the native client


def test_wrong_protocol_version_native_client(env, monkeypatch) -> None:
    m, c, _ = env
    monkeypatch.setattr(P, "PROTOCOL_VERSION", (2, 0))
    newer = Client(ClientConfig(connect_timeout_s=3.0))
    try:
        with pytest.raises(VersionMismatch) as info:
            newer.setup(m.addr, 0)
        assert info.value.code == Status.VERSION_MISMATCH
        assert "protocol 2.0" in str(info.value) and "1.x" in str(info.value)
    finally:
        newer.close()
    # A newer minor of the same major is accepted.
    monkeypatch.setattr(P, "PROTOCOL_VERSION", (1, 7))
    with Client(ClientConfig(connect_timeout_s=3.0)) as minor:
        minor.setup(m.addr, 0)
        assert minor.get("good") == b"good-value"


# ---------------------------------------------------------------------------
# Replies to unknown request ids: a fake master


WELCOME = {"master_version": "0.1.0", "protocol": [1, 0], "shard_count": 1, "tenant": "default",
           "lease_ttl_ms": 10000, "client_ttl_ms": 10000,
           "limits": {"max_batch": 64, "max_key_bytes": 4096, "kv_session_max_batch": 64,
                      "kv_sessions": True},
           "master_host_id": "fake"}


class FakeMaster:
    """A ROUTER that answers like a master, but first sends stray and broken replies."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"127.0.0.1:{port}"
        self.stop = threading.Event()
        self.seen: list[tuple[bytes, int]] = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        deadline = time.monotonic() + 30
        r = self.router
        while not self.stop.is_set() and time.monotonic() < deadline:
            if not r.poll(50):
                continue
            ident, op, _, payload = r.recv_multipart()
            rid = msgpack.unpackb(payload)[0]
            self.seen.append((op, rid))
            # Strays: unknown ids (success and error), id 0, broken payloads, bad frame counts.
            r.send_multipart([ident, op, packb([rid + 1000, 0, "stray success"])])
            r.send_multipart([ident, op, packb([rid + 1, -704, "stray error"])])
            r.send_multipart([ident, op, packb([0, -600, "stray id 0"])])
            r.send_multipart([ident, op, b"\xc1 not msgpack"])
            r.send_multipart([ident, op, packb([rid, 0])])  # the right id, two items
            r.send_multipart([ident, op])  # one frame
            r.send_multipart([ident, op, packb([rid, -1, "extra frame"]), b"x"])
            if op == Op.HELLO.value:
                body: Any = WELCOME
            elif op == Op.EXIST_KEY.value:
                body = 1
            else:
                body = 0
            r.send_multipart([ident, op, packb([rid, 0, body])])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.router.close(linger=0)
        self.ctx.term()


def test_reply_to_unknown_request_id_is_ignored() -> None:
    """Section 2: a client ignores replies whose req_id it is not waiting for, and
    replies that are not exactly two frames or not a valid [req_id, status, body]."""
    fake = FakeMaster()
    c = Client(ClientConfig(connect_timeout_s=5.0, timeout_s=5.0))
    try:
        c.setup(fake.addr, 0)
        assert c.is_exist("k") is True
        assert c.get_size("k") == 0
        assert [op for op, _ in fake.seen][:3] == [Op.HELLO.value, Op.EXIST_KEY.value,
                                                   Op.GET_SIZE.value]
    finally:
        c.close()
        fake.close()


# ---------------------------------------------------------------------------
# Huge frames


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _zmtp_connect(addr: str) -> socket.socket:
    """A raw TCP connection that speaks ZMTP 3.0 (NULL mechanism) as a DEALER."""
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    greeting = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
                + b"\x00" + b"\x00" * 31)
    s.sendall(greeting)
    got = b""
    while len(got) < 64:
        chunk = s.recv(64 - len(got))
        assert chunk, "master closed during the greeting"
        got += chunk
    assert got[0] == 0xFF and got[10] == 3, got
    props = (b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
             + b"\x08Identity" + struct.pack(">I", 0))
    body = b"\x05READY" + props
    s.sendall(bytes([0x04, len(body)]) + body)
    return s


def _recv_until(s: socket.socket, needle: bytes, timeout: float) -> bytes:
    s.settimeout(0.2)
    data = b""
    deadline = time.monotonic() + timeout
    while needle not in data and time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        data += chunk
    return data


def test_frame_over_max_message_size_drops_only_that_connection(env) -> None:
    """A frame declared larger than the master's frame bound: ZeroMQ drops
    that connection at once (without buffering the frame) and the master keeps
    serving everyone else."""
    m, c, _ = env
    s = _zmtp_connect(m.addr)
    try:
        # Control: a small message on this hand-made connection is answered.
        payload = packb([7])
        s.sendall(b"\x01\x01" + Op.HEARTBEAT.value + b"\x01\x00"
                  + bytes([0x00, len(payload)]) + payload)
        answer = _recv_until(s, b"\x93\x07\xd1\xf8\x91", 5)  # [7, NOT_REGISTERED, ...]
        assert b"\x93\x07\xd1\xf8\x91" in answer, answer
        # Now a frame header declaring 300 MiB, followed by a little of it.
        s.sendall(b"\x01\x01" + Op.HEARTBEAT.value + b"\x01\x00"
                  + b"\x02" + struct.pack(">Q", 300 << 20) + b"\x00" * 4096)
        t0 = time.monotonic()
        s.settimeout(5)
        try:
            closed = s.recv(65536) == b""
        except ConnectionResetError:
            closed = True
        assert closed, "the master kept a connection that announced an oversize frame"
        assert time.monotonic() - t0 < 5
    finally:
        s.close()
    assert m.proc.poll() is None
    assert c.get("good") == b"good-value"


def test_large_allowed_frame_is_refused_promptly_and_memory_returns(env) -> None:
    """14 MiB payloads under the socket's frame bound (16 MiB for this master's small
    batches; master.max_request_bytes): random junk, a bin over the 1 MiB decoder
    limit, and 13 valid 1 MiB bins as 'keys' (a complete, decodable message) each get
    INVALID_PARAMS within a few seconds, and the master's memory comes back.

    Sent in 8 rounds: the C allocator may keep a freed frame or two for reuse (on a
    loaded machine up to ~62 MiB was seen right after one round of 32 MiB frames), but
    a master that kept any one kind of frame would hold 8 x 14 MiB, above the 96 MiB
    bound."""
    m, c, raw = env
    base = _rss_kib(m.proc.pid)
    junk = os.urandom(14 << 20)
    payloads = {
        "junk": junk,
        "bin_over_limit": packb([5, junk]),
        "decodable_keys": packb([6, [junk[i << 20:(i + 1) << 20] for i in range(13)]]),
    }
    del junk
    for _ in range(8):
        for name, payload in payloads.items():
            t0 = time.monotonic()
            _, status, body = raw.ask(Op.BATCH_EXIST_KEY.value, P.route_for_shard(0),
                                      payload=payload, timeout=15)
            took = time.monotonic() - t0
            assert status == Status.INVALID_PARAMS, (name, body)
            assert took < 5, f"{name}: answered after {took:.1f} s"
            assert m.proc.poll() is None
    payloads.clear()
    bound = 96 * 1024
    deadline = time.monotonic() + 5
    while _rss_kib(m.proc.pid) > base + bound and time.monotonic() < deadline:
        time.sleep(0.1)
    grown = _rss_kib(m.proc.pid) - base
    assert grown <= bound, f"master RSS grew by {grown} KiB after 4 rounds of 32 MiB frames"
    assert c.get("good") == b"good-value"
