"""KV sessions against a real master over TCP, at the depth of the session RFC.

Most tests drive one in-process client (which mounts the only segment, so all
data lives there) and two worker *processes* (``spawn``), each with its own
:class:`kvmaster.Client` on its own connection and no segment of its own.  The
workers are started once per module and connected to each test's master;
commands and answers travel over queues, every ``get`` with a timeout.  A
shared barrier lets the workers fire racing operations at the same moment.

Every test ends with ``check_consistency() == []``: home records and object
refs agree and every shard's replica of the pinned-session set matches.

Eviction tests use one shard, a 1 MiB segment, 64 KiB values and a high
watermark of 1.0, so eviction happens only when an allocation does not fit and
picks least-recently-used objects in a known order.  Presence is read with
``query_key``, which does not touch recency.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import queue
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from conftest import present

from kvmaster import (
    Client,
    InvalidParams,
    KVMasterError,
    KvSessionInfo,
    KvSessionPage,
    NoAvailableHandle,
    ObjectNotFound,
    ReplicateConfig,
    SessionLimitExceeded,
    SessionNotFound,
    SoftPinAction,
    Status,
    Unsupported,
)
from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster.protocol import Op

KiB = 1 << 10
MiB = 1 << 20
SLOT = 64 * KiB
SLOTS = 16
BIG = b"v" * SLOT

ONE_SHARD_EXACT = ("--shards", "1", "--eviction-high-watermark-ratio", "1.0")
NOT_FOUND = int(Status.OBJECT_NOT_FOUND)
LIMIT = int(Status.SESSION_LIMIT_EXCEEDED)
NO_HANDLE = int(Status.NO_AVAILABLE_HANDLE)
BAD = int(Status.INVALID_PARAMS)

TIMEOUT = 60.0


# ------------------------------------------------------------------------ helpers


def tag(*sids: str) -> ReplicateConfig:
    """Config tagging one key with ``sids``."""
    return ReplicateConfig(kv_sessions=[list(sids)])


def tags(lists: Sequence[Sequence[str]]) -> ReplicateConfig:
    """Config tagging each key of a batch with its own list."""
    return ReplicateConfig(kv_sessions=[list(x) for x in lists])


def val(key: str, n: int = 24) -> bytes:
    return random.Random(key).randbytes(n)


def members(c: Client, sid: str, page: int = 1024) -> list[str]:
    """Every member of ``sid``, page by page (raises SessionNotFound)."""
    return list(c.iter_kv_session_keys(sid, page))


def info(c: Client, sid: str) -> KvSessionInfo | None:
    try:
        return c.get_kv_session(sid)
    except SessionNotFound:
        return None



def soft_pinned(c: Client, key: str) -> bool:
    return bool(c.query_key(key)["soft_pinned"])


def sessions_of(c: Client, key: str) -> list[bytes]:
    return list(c.query_key(key)["sessions"])


def consistent(c: Client) -> None:
    assert c.check_consistency() == []


def call(target: Any, name: str, *args: Any) -> Any:
    """Run ``name(*args)`` on a local Client or a Remote worker."""
    if isinstance(target, Remote):
        return target.call(name, *args)
    if name in SCRIPTS:
        return SCRIPTS[name](target, *args)
    out = getattr(target, name)(*args)
    return list(out) if name == "iter_kv_session_keys" else out


def raw_start(c: Client, key: str, size: int, sids: Sequence[str] = (),
              upsert: bool = False) -> Any:
    """PutStart (tagged when ``sids``) without writing or ending: a write in progress."""
    bkey = key.encode()
    if sids:
        op = Op.UPSERT_START_WITH_KV_SESSIONS if upsert else Op.PUT_START_WITH_KV_SESSIONS
        fields: list[Any] = [bkey, size, None, [s.encode() for s in sids]]
    else:
        op = Op.UPSERT_START if upsert else Op.PUT_START
        fields = [bkey, size, None]
    return c._call(op.value, c._route(bkey), fields)


def raw_revoke(c: Client, key: str) -> Any:
    bkey = key.encode()
    return c._call(Op.PUT_REVOKE.value, c._route(bkey), [bkey])


def home_shard(sid: str, shards: int, tenant: str = P.DEFAULT_TENANT) -> int:
    return P.shard_of(sid.encode(), P.tenant_seed(tenant), shards)


# ------------------------------------------------------------ worker processes

_BARRIER: Any = None


def _script_tag_many(c: Client, sid: str, keys: list[str], batch: int) -> list[int]:
    out: list[int] = []
    for i in range(0, len(keys), batch):
        chunk = keys[i:i + batch]
        out += c.put_batch(chunk, [val(k) for k in chunk], tags([[sid]] * len(chunk)))
    return out


def _script_plan(c: Client, steps: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
    """Run each step right after both workers reach the shared barrier."""
    out = []
    for name, args in steps:
        _BARRIER.wait(timeout=TIMEOUT)
        try:
            out.append(call(c, name, *args))
        except E.RequestError as exc:
            out.append(int(exc.code))
    return out


def _script_raw_start(c: Client, key: str, size: int, sids: list[str]) -> Any:
    return raw_start(c, key, size, sids)


def _script_raw_revoke(c: Client, key: str) -> Any:
    return raw_revoke(c, key)


SCRIPTS: dict[str, Callable[..., Any]] = {
    "tag_many": _script_tag_many,
    "plan": _script_plan,
    "raw_start": _script_raw_start,
    "raw_revoke": _script_raw_revoke,
}


def _worker_main(inq: Any, outq: Any, barrier: Any) -> None:
    """A client process driven over queues: ("connect", addr, tenant), ("disconnect",),
    a Client method name or a SCRIPTS name with its arguments; None ends it."""
    global _BARRIER
    _BARRIER = barrier
    client: Client | None = None
    while True:
        try:
            item = inq.get(timeout=600)
        except queue.Empty:
            break
        if item is None:
            break
        name, args = item
        try:
            if name == "connect":
                addr, tenant = args
                client = Client()
                # Writes stay within their tenant: a tenant other than the local
                # clients' (default) brings a segment of its own.
                client.setup(addr, 0 if tenant == "default" else 8 << 20, tenant,
                             timeout_s=TIMEOUT / 2)
                result: Any = client.client_id
            elif name == "disconnect":
                if client is not None:
                    client.close()
                client = None
                result = None
            else:
                assert client is not None, "worker is not connected"
                result = call(client, name, *args)
            outq.put(("ok", result))
        except KVMasterError as exc:
            outq.put(("err", type(exc).__name__, int(exc.code), str(exc)))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outq.put(("exc", type(exc).__name__, 0, repr(exc)))
    if client is not None:
        client.close()


class RemoteFailure(Exception):
    """A worker raised something that is not a kvmaster request error."""


class Remote:
    """One worker process; ``call`` runs a command there and returns its result
    (or raises the same kvmaster error class the worker saw)."""

    def __init__(self, ctx: Any, barrier: Any) -> None:
        self.inq = ctx.Queue()
        self.outq = ctx.Queue()
        self.proc = ctx.Process(target=_worker_main, args=(self.inq, self.outq, barrier),
                                daemon=True)
        self.proc.start()
        self.pending = 0

    def submit(self, name: str, *args: Any) -> None:
        self.pending += 1
        self.inq.put((name, args))

    def result(self, timeout: float = TIMEOUT) -> Any:
        r = self.outq.get(timeout=timeout)
        self.pending -= 1
        if r[0] == "ok":
            return r[1]
        _, cls, code, text = r
        if r[0] == "err" and code in E._BY_CODE:
            raise E.error_for(code, f"(in worker) {text}")
        raise RemoteFailure(f"{cls}: {text}")

    def call(self, name: str, *args: Any, timeout: float = TIMEOUT) -> Any:
        self.submit(name, *args)
        return self.result(timeout)

    def reset(self) -> bool:
        """Drain unread answers and disconnect; False if the worker is unusable."""
        try:
            while self.pending:
                try:
                    self.result(timeout=TIMEOUT)
                except (KVMasterError, RemoteFailure):
                    pass
            self.call("disconnect", timeout=15)
            return True
        except (queue.Empty, RemoteFailure, KVMasterError):
            return False

    def stop(self) -> None:
        try:
            self.inq.put(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.inq.close()
        self.outq.close()


class WorkerPool:
    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.workers: list[Remote] = []
        self.barrier: Any = None

    def get(self) -> list[Remote]:
        if not self.workers:
            # Kept referenced: the children open its semaphore after start() returns.
            self.barrier = self.ctx.Barrier(2)
            self.workers = [Remote(self.ctx, self.barrier) for _ in range(2)]
        return self.workers

    def reset(self) -> None:
        if not all([w.reset() for w in self.workers]):
            self.shutdown()  # a fresh pair (and barrier) next time

    def shutdown(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []


@pytest.fixture(scope="module")
def _pool() -> Iterator[WorkerPool]:
    pool = WorkerPool()
    yield pool
    pool.shutdown()


@pytest.fixture
def remotes(_pool: WorkerPool, start_master: Any, make_client: Any) -> Iterator[Callable]:
    """``remotes(master, tenants=("default", "default"))`` -> two connected worker
    processes; disconnected after the test (before the master and local clients go)."""
    used = False

    def connect(m: Any, tenants: Sequence[str] = ("default", "default")) -> list[Remote]:
        nonlocal used
        used = True
        ws = _pool.get()
        for w, t in zip(ws, tenants):
            w.submit("connect", m.addr, t)
        for w in ws:
            w.result()
        return ws

    yield connect
    if used:
        _pool.reset()


# ------------------------------------------------------ membership across clients


def test_shared_membership_across_client_processes(start_master, make_client, remotes) -> None:
    m = start_master("--shards", "4")
    c = make_client(m)
    w1, w2 = remotes(m)

    first = [f"doc/{i:02d}" for i in range(10)]
    assert w1.call("put_batch", first, [val(k) for k in first],
                   tags([["chat-a"]] * 10)) == [0] * 10
    for i in range(10, 15):
        w2.call("put", f"doc/{i:02d}", val(f"doc/{i:02d}"), tag("chat-a", "chat-b"))
    everything = [f"doc/{i:02d}" for i in range(15)]

    # Every process sees one session with all 15 members and the data of both writers.
    for who in (c, w1, w2):
        assert call(who, "get_kv_session", "chat-a") == KvSessionInfo("chat-a", False, 15)
        assert call(who, "iter_kv_session_keys", "chat-a", 4) == everything
        assert call(who, "get_kv_session", "chat-b").member_count == 5
    assert w1.call("get", "doc/12") == val("doc/12")
    assert w2.call("get", "doc/03") == val("doc/03")
    assert sessions_of(c, "doc/12") == [b"chat-a", b"chat-b"]

    # Attaching keys another process tagged is idempotent (0, no double count).
    assert w2.call("attach_kv_session", "chat-a", ["doc/00", "doc/14", "nope"]) == [0, 0, NOT_FOUND]
    assert c.get_kv_session("chat-a").member_count == 15

    # A pin set by one process is what the others see.
    w2.call("pin_kv_session", "chat-a")
    assert w1.call("get_kv_session", "chat-a").pinned is True
    assert all(soft_pinned(c, k) for k in everything)
    assert w1.call("get_kv_session", "chat-b").pinned is False

    # Both processes tag into one session at once, partly the same keys (dedup puts).
    mine1 = [f"w1/{i:03d}" for i in range(120)] + [f"both/{i:03d}" for i in range(80)]
    mine2 = [f"w2/{i:03d}" for i in range(120)] + [f"both/{i:03d}" for i in range(80)]
    w1.submit("tag_many", "chat-c", mine1, 25)
    w2.submit("tag_many", "chat-c", mine2[::-1], 25)
    assert w1.result() == [0] * 200
    assert w2.result() == [0] * 200
    want = sorted(set(mine1) | set(mine2))
    assert c.get_kv_session("chat-c").member_count == len(want) == 320
    assert members(c, "chat-c", page=64) == want
    consistent(c)


# ----------------------------------------------------------------- tagged writes


def test_tagged_writes_every_write_path(start_master, make_client, remotes) -> None:
    m = start_master("--shards", "4")
    c = make_client(m)
    w1, w2 = remotes(m)
    S = "sess"

    c.put("put", b"first", tag(S))
    c.put_parts("parts", b"ab", b"cd", config=tag(S))
    c.put_from("from", bytearray(b"xyz"), tag(S))
    c.upsert("ups", b"u1", tag(S))
    c.upsert_from("upsfrom", memoryview(b"uu"), tag(S))
    assert c.put_batch(["b0", "b1"], [b"0", b"1"], tags([[S], [S, "other"]])) == [0, 0]
    assert c.batch_put_from(["bf0"], [bytearray(b"bf")], tags([[S]])) == [0]
    assert c.upsert_batch(["ub0", "ub1"], [b"a", b"b"], tags([[S], []])) == [0, 0]
    w1.call("put", "w1put", b"w1", tag(S))
    assert w2.call("upsert_batch", ["w2a", "w2b"], [b"a", b"b"], tags([[S], [S]])) == [0, 0]

    want = sorted(["put", "parts", "from", "ups", "upsfrom", "b0", "b1", "bf0", "ub0",
                   "w1put", "w2a", "w2b"])
    assert members(c, S) == want
    assert members(c, "other") == ["b1"]
    assert sessions_of(c, "ub1") == []  # an empty inner list tags nothing
    assert c.get("parts") == b"abcd" and c.get("from") == b"xyz"

    # Deduplicated put (write-once): the value stays, the membership is added.
    w2.call("put", "put", b"DIFFERENT", tag("late"))
    assert c.get("put") == b"first"
    assert members(c, "late") == ["put"]
    w1.call("put", "put", b"again", tag(S, "late"))  # already a member of both: no change
    assert c.get_kv_session(S).member_count == len(want)
    assert c.get_kv_session("late").member_count == 1

    # Upsert (size-changing) keeps existing memberships and adds the new one.
    c.upsert("put", b"a much longer replacement value", tag("third"))
    assert c.get("put") == b"a much longer replacement value"
    assert sessions_of(c, "put") == [b"late", b"sess", b"third"]
    # Untagged writes never clear membership.
    w1.call("upsert", "ups", b"u2")
    c.put("ups", b"dedup")
    assert sessions_of(c, "ups") == [b"sess"]

    # Untagged and empty-tag writes add nothing; repeated tags count once.
    c.put("plain", b"p")
    c.put("plain2", b"p", ReplicateConfig(kv_sessions=[[]]))
    c.put("plain3", b"p", ReplicateConfig(kv_sessions=[]))
    assert [sessions_of(c, k) for k in ("plain", "plain2", "plain3")] == [[], [], []]
    c.put("dup", b"d", tag("solo", "solo", "solo"))
    assert sessions_of(c, "dup") == [b"solo"]
    assert c.get_kv_session("solo").member_count == 1

    # One tag list per key, exactly.
    with pytest.raises(InvalidParams):
        c.put_batch(["x", "y"], [b"1", b"2"], tags([[S]]))
    with pytest.raises(InvalidParams):
        c.put("x", b"1", tags([[S], [S]]))
    assert present(c, ["x", "y"]) == []
    # A native TTL soft pin and a session tag combine on one write.
    c.put("ttl", b"t", ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, kv_sessions=[[S]]))
    assert soft_pinned(c, "ttl") and S.encode() in sessions_of(c, "ttl")
    assert c.stats()["pending_writes"] == 0
    consistent(c)


def test_rejected_and_failed_writes_register_nothing(start_master, make_client,
                                                     remotes) -> None:
    m = start_master("--shards", "2", "--max-kv-soft-pin-ttl", "1000")
    c = make_client(m, segment_bytes=MiB)
    w1, w2 = remotes(m)

    # No space (larger than any segment share): refused, no session appears.
    with pytest.raises(NoAvailableHandle):
        c.put("huge", b"x" * (2 * MiB), tag("ghost"))
    assert info(c, "ghost") is None
    assert w1.call("put_batch", ["ok1", "huge", "ok2"], [b"1", b"x" * (2 * MiB), b"2"],
                   tags([["mix"], ["mixbig"], ["mix", "mixbig"]])) == [0, NO_HANDLE, 0]
    assert members(c, "mix") == ["ok1", "ok2"]
    assert members(c, "mixbig") == ["ok2"]

    # Invalid parameters: refused, nothing registered.
    too_long = ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=5000,
                               kv_sessions=[["ghost2"]])
    with pytest.raises(InvalidParams):
        c.put("k", b"v", too_long)
    too_long.kv_sessions = [["ghost2"], ["ghost2"]]
    assert c.put_batch(["a", "b"], [b"1", b"2"], too_long) == [BAD, BAD]
    assert info(c, "ghost2") is None and present(c, ["k", "a", "b"]) == []

    # Membership covers a write in progress; a revoked write loses it again, and
    # the session goes with its only member.
    raw_start(c, "pending", 8, ["tmp"])
    assert c.get_kv_session("tmp").member_count == 1
    raw_revoke(c, "pending")
    assert info(c, "tmp") is None

    # ... while a pinned session with other members keeps its pin and the rest.
    c.put("keep", b"k", tag("hot"))
    c.pin_kv_session("hot")
    raw_start(c, "pending2", 8, ["hot"])
    assert c.get_kv_session("hot") == KvSessionInfo("hot", True, 2)
    raw_revoke(c, "pending2")
    assert c.get_kv_session("hot") == KvSessionInfo("hot", True, 1)
    assert members(c, "hot") == ["keep"]

    # A tagged put of a key another process is still writing registers with that
    # write; when its writer revokes it, the failed write takes the membership along.
    w1.call("raw_start", "busy", 16, [])
    w2.call("put", "busy", b"mine", tag("pend"))  # already being written: no-op success
    assert c.get_kv_session("pend").member_count == 1
    w1.call("raw_revoke", "busy")
    assert info(c, "pend") is None
    assert present(c, ["busy"]) == []

    # A refused upsert of an existing member keeps the old object and its
    # membership, and adds nothing.
    c.put("old", b"old", tag("S1"))
    with pytest.raises(InvalidParams):
        c.upsert("old", b"new", ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE,
                                                soft_pin_ttl_ms=5000, kv_sessions=[["S2"]]))
    assert c.get("old") == b"old"
    assert sessions_of(c, "old") == [b"S1"] and info(c, "S2") is None
    # An accepted association on an existing object is not rolled back when the
    # upsert that brought it is revoked (the RFC's rule).
    raw_start(c, "old", 4, ["S3"], upsert=True)
    raw_revoke(c, "old")
    assert c.get("old") == b"old"
    assert sessions_of(c, "old") == [b"S1", b"S3"]

    assert c.stats()["pending_writes"] == 0
    consistent(c)


# ------------------------------------------------------------------------ attach


def test_attach_statuses(start_master, make_client, remotes) -> None:
    m = start_master("--shards", "4", "--kv-session-max-batch", "8")
    c = make_client(m)
    w1, w2 = remotes(m)
    keys = [f"k{i}" for i in range(8)]
    assert c.put_batch(keys, [val(k) for k in keys]) == [0] * 8
    S = "att"

    assert w1.call("attach_kv_session", S, ["k0", "k1", "missing"]) == [0, 0, NOT_FOUND]
    assert c.get_kv_session(S) == KvSessionInfo(S, False, 2)
    # Already-associated keys answer 0 again; duplicates in one call count once.
    assert w2.call("attach_kv_session", S, ["k1", "k2", "k2"]) == [0, 0, 0]
    assert c.get_kv_session(S).member_count == 3

    # Nothing is created by an empty batch or a batch of missing keys.
    assert w1.call("attach_kv_session", "empty", []) == []
    assert w1.call("attach_kv_session", "absent", ["nope1", "nope2"]) == [NOT_FOUND] * 2
    assert info(c, "empty") is None and info(c, "absent") is None
    assert w1.call("attach_kv_session", S, []) == []

    # More keys than kv_session_max_batch: refused as a whole.
    with pytest.raises(InvalidParams):
        w2.call("attach_kv_session", S, [f"k{i % 8}" for i in range(9)])
    with pytest.raises(InvalidParams):
        w2.call("attach_kv_session", "fresh", [f"k{i % 8}" for i in range(9)])
    assert c.get_kv_session(S).member_count == 3 and info(c, "fresh") is None

    # Attach preserves the pin; the new members get soft-pin priority at once.
    c.pin_kv_session(S)
    assert not soft_pinned(c, "k5")
    assert w2.call("attach_kv_session", S, ["k5"]) == [0]
    assert c.get_kv_session(S) == KvSessionInfo(S, True, 4)
    assert soft_pinned(c, "k5")

    # Attaching deletes nothing and creates no objects.
    assert present(c, keys) == keys and present(c, ["missing"]) == []
    assert members(c, S, page=8) == ["k0", "k1", "k2", "k5"]
    consistent(c)


# ------------------------------------------------------------------- pin / unpin


def test_pin_unpin_isolation_between_sessions_sharing_keys(start_master, make_client,
                                                           remotes) -> None:
    m = start_master("--shards", "4")
    c = make_client(m)
    w1, w2 = remotes(m)
    assert c.put_batch(["a0", "a1", "shared", "b0"], [b"1", b"2", b"3", b"4"],
                       tags([["A"], ["A"], ["A", "B"], ["B"]])) == [0] * 4
    pins = lambda: {k: soft_pinned(c, k) for k in ("a0", "a1", "shared", "b0")}  # noqa: E731
    assert pins() == dict.fromkeys(("a0", "a1", "shared", "b0"), False)

    w1.call("pin_kv_session", "A")
    assert pins() == {"a0": True, "a1": True, "shared": True, "b0": False}
    assert (c.get_kv_session("A").pinned, c.get_kv_session("B").pinned) == (True, False)
    w1.call("pin_kv_session", "A")  # idempotent
    w2.call("pin_kv_session", "B")
    assert all(pins().values())

    # Unpinning A leaves B's pin (and A's membership) alone.
    w1.call("unpin_kv_session", "A")
    assert pins() == {"a0": False, "a1": False, "shared": True, "b0": True}
    assert c.get_kv_session("A") == KvSessionInfo("A", False, 3)
    w1.call("unpin_kv_session", "A")  # idempotent

    # Closing B removes its contribution only.
    w2.call("close_kv_session", "B")
    assert not any(pins().values())
    assert c.get_kv_session("A").member_count == 3

    # Future members of a pinned session are covered from admission on.
    w2.call("pin_kv_session", "A")
    w1.call("put", "a2", b"5", tag("A"))
    assert soft_pinned(c, "a2")
    # A native TTL soft pin is independent of the session pin.
    c.put("ttl", b"6", ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE,
                                       kv_sessions=[["A"]]))
    c.unpin_kv_session("A")
    assert soft_pinned(c, "ttl") and not soft_pinned(c, "a2")

    # Pin/unpin need an existing session.
    for name in ("pin_kv_session", "unpin_kv_session"):
        with pytest.raises(SessionNotFound):
            w1.call(name, "B")
        with pytest.raises(SessionNotFound):
            w2.call(name, "never")
    assert info(c, "B") is None and info(c, "never") is None
    consistent(c)


def test_pinned_by_any_session_survives_pressure(start_master, make_client, remotes) -> None:
    m = start_master(*ONE_SHARD_EXACT, "--no-allow-evict-soft-pinned-objects")
    c = make_client(m, segment_bytes=MiB)
    w1, w2 = remotes(m)
    a = [f"a{i}" for i in range(4)]
    b = [f"b{i}" for i in range(4)]
    shared = [f"s{i}" for i in range(4)]
    o = [f"o{i}" for i in range(4)]
    w1.call("put_batch", a, [BIG] * 4, tags([["A"]] * 4))
    w1.call("put_batch", shared, [BIG] * 4, tags([["A", "B"]] * 4))
    w2.call("put_batch", b, [BIG] * 4, tags([["B"]] * 4))
    c.put_batch(o, [BIG] * 4)
    w1.call("pin_kv_session", "A")
    w2.call("pin_kv_session", "B")

    w1.call("unpin_kv_session", "A")  # A-only keys become ordinary; shared stay (B)
    n = [f"n{i}" for i in range(8)]
    for k in n:
        w2.call("put", k, BIG)
    assert present(c, a + o) == []
    assert present(c, shared + b) == shared + b
    assert c.get_kv_session("A") == KvSessionInfo("A", False, 4)
    assert members(c, "A") == shared
    assert c.stats()["evicted_soft_pinned_keys"] == 0
    consistent(c)


# ------------------------------------------------------------------------ update


def test_update_trims_across_clients_without_deleting(start_master, make_client,
                                                      remotes) -> None:
    m = start_master("--shards", "4")
    c = make_client(m)
    w1, w2 = remotes(m)
    S, T = "upd", "other"
    k1 = [f"w1/{i}" for i in range(10)]
    x = [f"x/{i}" for i in range(5)]
    k2 = [f"w2/{i}" for i in range(5)]
    assert w1.call("put_batch", k1, [val(k) for k in k1], tags([[S]] * 10)) == [0] * 10
    assert w1.call("put_batch", x, [val(k) for k in x], tags([[S, T]] * 5)) == [0] * 5
    assert w2.call("put_batch", k2, [val(k) for k in k2], tags([[S]] * 5)) == [0] * 5
    c.put("outsider", b"o")
    w2.call("pin_kv_session", S)
    everything = k1 + x + k2

    keep = ["w1/0", "w1/2", "x/0", "w2/1", "unknown", "outsider", "w1/0", "w2/1"]
    assert w2.call("update_kv_session", S, keep) == 16
    want = sorted(["w1/0", "w1/2", "x/0", "w2/1"])
    assert members(c, S) == want
    assert c.get_kv_session(S) == KvSessionInfo(S, True, 4)  # pin preserved
    # No data deleted; other sessions untouched; update attaches nothing.
    assert w1.call("batch_is_exist", everything + ["outsider"]) == [1] * 21
    assert w1.call("get", "w2/3") == val("w2/3")
    assert members(c, T) == x
    assert sessions_of(c, "outsider") == []
    # Dropped keys lost this session's pin contribution, kept ones still have it.
    assert [soft_pinned(c, k) for k in ("w1/1", "x/1", "w1/0", "w2/1")] == [False] * 2 + [True] * 2

    # Repeating the same keep set is idempotent; a missing session is a no-op.
    assert w1.call("update_kv_session", S, keep) == 0
    assert c.update_kv_session("never", ["w1/0"]) == 0
    assert info(c, "never") is None

    # An empty intersection deletes the session and its pin; data stays.
    assert w1.call("update_kv_session", S, ["unknown"]) == 4
    assert info(c, S) is None
    assert present(c, want) == want
    assert w2.call("attach_kv_session", S, ["w1/0"]) == [0]
    assert c.get_kv_session(S) == KvSessionInfo(S, False, 1)  # re-created unpinned
    assert c.update_kv_session(T, []) == 5
    assert info(c, T) is None
    consistent(c)


def test_keep_set_larger_than_one_page(start_master, make_client, remotes) -> None:
    m = start_master("--max-batch", "64", "--shards", "4")
    c = make_client(m)
    w1, w2 = remotes(m)
    assert c._require().max_batch == 64
    keys = {sid: [f"{sid}/{i:04d}" for i in range(1100)] for sid in ("big1", "big2")}
    w1.submit("tag_many", "big1", keys["big1"], 64)
    w2.submit("tag_many", "big2", keys["big2"], 64)
    assert w1.result() == [0] * 1100 and w2.result() == [0] * 1100

    # Two processes send 1000-key keep sets (16+ pages each) at the same time.
    rng = random.Random(7)
    plans = {}
    for sid in keys:
        keep = keys[sid][:1000] + [f"{sid}/unknown{i}" for i in range(50)]
        rng.shuffle(keep)
        plans[sid] = keep + keep[:30]  # duplicates have no extra effect
    w1.submit("update_kv_session", "big1", plans["big1"])
    w2.submit("update_kv_session", "big2", plans["big2"])
    assert w1.result() == 100 and w2.result() == 100
    for sid in keys:
        assert c.get_kv_session(sid).member_count == 1000
        assert members(c, sid, page=333) == keys[sid][:1000]
    assert all(r == 1 for sid in keys for i in range(0, 1100, 64)
               for r in c.batch_is_exist(keys[sid][i:i + 64]))
    # A keep set entirely of non-members, many pages long, empties the session.
    assert c.update_kv_session("big1", [f"none/{i}" for i in range(300)]) == 1000
    assert info(c, "big1") is None
    consistent(c)


def test_update_racing_object_removal(start_master, make_client, remotes) -> None:
    """One process removes objects while another trims their sessions; the end state is
    exact: each session holds keep-set members that survived, nothing more."""
    m = start_master("--shards", "8")
    c = make_client(m)
    w1, w2 = remotes(m)
    rounds, n = 200, 24
    keys = {r: [f"u{r}/{i:02d}" for i in range(n)] for r in range(rounds)}
    for r in range(rounds):
        assert c.put_batch(keys[r], [b"x"] * n, tags([[f"U{r}", "ALL"]] * n)) == [0] * n
    removes = [("batch_remove", (keys[r][1::2], True)) for r in range(rounds)]
    updates = [("update_kv_session", (f"U{r}", keys[r][::3] + [f"u{r}/gone"]))
               for r in range(rounds)]
    w1.submit("plan", removes)
    w2.submit("plan", updates)
    assert w1.result(timeout=120) == [[0] * (n // 2)] * rounds
    w2.result(timeout=120)

    for r in range(rounds):
        want = [k for i, k in enumerate(keys[r]) if i % 3 == 0 and i % 2 == 0]
        assert members(c, f"U{r}") == want
        assert c.batch_is_exist(keys[r]) == [1, 0] * (n // 2)  # the update deleted nothing
    assert c.get_kv_session("ALL").member_count == rounds * n // 2
    consistent(c)


def test_attach_racing_object_removal(start_master, make_client, remotes) -> None:
    """One process removes half the keys while another attaches all of them to a new
    session.  Whatever the interleaving, the session must end up with exactly the
    surviving half: an association with a removed object must not outlive it."""
    m = start_master("--shards", "8")
    c = make_client(m)
    w1, w2 = remotes(m)
    rounds, n = 400, 32
    keys = {r: [f"a{r}/{i:02d}" for i in range(n)] for r in range(rounds)}
    for r in range(0, rounds, 100):
        batch = [k for q in range(r, r + 100) for k in keys[q]]
        assert c.put_batch(batch, [b"x"] * len(batch)) == [0] * len(batch)
    removes = [("batch_remove", (keys[r][::2], True)) for r in range(rounds)]
    attaches = [("attach_kv_session", (f"A{r}", keys[r])) for r in range(rounds)]
    w1.submit("plan", removes)
    w2.submit("plan", attaches)
    assert w1.result(timeout=120) == [[0] * (n // 2)] * rounds
    w2.result(timeout=120)

    wrong = {}
    for r in range(rounds):
        got = members(c, f"A{r}")
        if got != keys[r][1::2]:
            wrong[f"A{r}"] = sorted(set(got) - set(keys[r][1::2]))
    assert wrong == {}, f"sessions holding removed objects: {wrong}"
    consistent(c)


# ------------------------------------------------------------------------- close


def test_close_keeps_data_and_is_idempotent(start_master, make_client, remotes) -> None:
    m = start_master("--shards", "4")
    c = make_client(m)
    w1, w2 = remotes(m)
    keys = [f"c{i}" for i in range(5)]
    assert w1.call("put_batch", keys, [val(k) for k in keys],
                   tags([["S", "B"]] + [["S"]] * 4)) == [0] * 5
    w1.call("pin_kv_session", "S")
    w1.call("pin_kv_session", "B")

    w2.call("close_kv_session", "S")
    with pytest.raises(SessionNotFound):
        w1.call("get_kv_session", "S")
    with pytest.raises(SessionNotFound):
        w1.call("list_kv_session_keys", "S", "", 10)
    assert [w2.call("get", k) for k in keys] == [val(k) for k in keys]
    assert [soft_pinned(c, k) for k in keys] == [True] + [False] * 4  # c0 still in B
    assert c.get_kv_session("B") == KvSessionInfo("B", True, 1)
    assert all(sessions_of(c, k) == [] for k in keys[1:])

    # Idempotent, also for a session that never existed; no tombstone is kept.
    w1.call("close_kv_session", "S")
    c.close_kv_session("never")
    w1.call("put", "c9", b"new", tag("S"))
    assert c.get_kv_session("S") == KvSessionInfo("S", False, 1)
    assert members(c, "S") == ["c9"]
    assert c.stats()["sessions"] == 2
    consistent(c)


# ---------------------------------------------------------------- last member


def test_last_member_reclaims_session_and_recreation_is_unpinned(start_master, make_client,
                                                                 remotes) -> None:
    m = start_master("--shards", "4")
    c = make_client(m)
    w1, w2 = remotes(m)
    S = "last"
    assert c.put_batch(["l0", "l1", "l2", "other"], [b"1", b"2", b"3", b"4"],
                       tags([[S]] * 3 + [[]])) == [0] * 4
    w1.call("pin_kv_session", S)
    w1.call("remove", "l0")
    assert c.get_kv_session(S) == KvSessionInfo(S, True, 2)
    assert w2.call("batch_remove", ["l1"]) == [0]
    assert c.get_kv_session(S) == KvSessionInfo(S, True, 1)
    c.remove("l2")

    # Gone with its pin: every control sees no session.
    for who in (c, w1, w2):
        with pytest.raises(SessionNotFound):
            call(who, "get_kv_session", S)
        with pytest.raises(SessionNotFound):
            call(who, "pin_kv_session", S)
        with pytest.raises(SessionNotFound):
            call(who, "unpin_kv_session", S)
        with pytest.raises(SessionNotFound):
            call(who, "list_kv_session_keys", S, "", 5)
    assert w1.call("update_kv_session", S, ["l0"]) == 0
    w2.call("close_kv_session", S)
    assert info(c, S) is None

    # Re-created by attach (unpinned) ...
    assert w2.call("attach_kv_session", S, ["other"]) == [0]
    assert c.get_kv_session(S) == KvSessionInfo(S, False, 1)
    assert not soft_pinned(c, "other")
    # ... and by a tagged write after reclaim by update.
    w1.call("pin_kv_session", S)
    assert c.update_kv_session(S, []) == 1
    w1.call("put", "l3", b"5", tag(S))
    assert c.get_kv_session(S) == KvSessionInfo(S, False, 1)
    assert not soft_pinned(c, "l3")

    # Session metadata does not accumulate once all its KV is gone.
    assert c.remove_all(force=True) == 2  # "other" and "l3"
    s = c.stats()
    assert (s["sessions"], s["pinned_sessions"], s["memberships"]) == (0, 0, 0)
    consistent(c)


# ---------------------------------------------------------------------- listing


def test_paging_through_a_changing_session(start_master, make_client, remotes) -> None:
    m = start_master("--shards", "4")
    c = make_client(m)
    w1, w2 = remotes(m)
    S = "pages"
    base = [f"p/{i:04d}" for i in range(300)] + ["p/Z", "p/z", "p/é", "p/éa", "p/€", "p/\U0001f600"]
    for i in range(0, len(base), 100):
        chunk = base[i:i + 100]
        assert c.put_batch(chunk, [b"x"] * len(chunk), tags([[S]] * len(chunk))) == [0] * len(chunk)
    assert members(c, S) == sorted(base, key=str.encode)

    seen: list[str] = []
    removed_ahead: set[str] = set()
    added_ahead: set[str] = set()
    removed: set[str] = set()
    ever = set(base)
    cursor = ""
    rng = random.Random(3)
    step = 0
    while True:
        page = w1.call("list_kv_session_keys", S, cursor, 25)
        seen += page.keys
        if not page.next_cursor:
            break
        assert page.next_cursor == page.keys[-1] and len(page.keys) == 25
        cursor = page.next_cursor
        step += 1
        # Between pages: one process removes members behind and ahead of the
        # cursor, the other tags new keys behind and ahead of it.
        live = sorted(ever - removed, key=str.encode)
        behind = [k for k in live if k.encode() <= cursor.encode()]
        ahead = [k for k in live if k.encode() > cursor.encode()]
        gone = rng.sample(behind, min(2, len(behind))) + rng.sample(ahead, min(2, len(ahead)))
        assert w2.call("batch_remove", gone, True) == [0] * len(gone)
        removed |= set(gone)
        removed_ahead |= {k for k in gone if k.encode() > cursor.encode()}
        new = [f"p/{cursor[2:]}+{step}", f"p/~{step:03d}", f"p/ {step:03d}"]
        assert c.put_batch(new, [b"y"] * 3, tags([[S]] * 3)) == [0] * 3
        ever |= set(new)
        added_ahead |= {k for k in new if k.encode() > cursor.encode()}

    raw = [k.encode() for k in seen]
    assert raw == sorted(set(raw)), "pages must be strictly increasing, without repeats"
    assert set(seen) <= ever
    assert set(base) - removed <= set(seen), "a member present throughout was missed"
    assert not (set(seen) & removed_ahead), "a member removed before the walk reached it"
    assert added_ahead - removed <= set(seen), "a member added ahead of the cursor was missed"
    assert w1.call("iter_kv_session_keys", S, 7) == sorted(ever - removed, key=str.encode)

    # The cursor is exclusive and need not be a member.
    live = sorted(ever - removed, key=str.encode)
    for cur in ("p/0100", "p/0100x", live[10]):
        want = [k for k in live if k.encode() > cur.encode()][:2]
        assert c.list_kv_session_keys(S, cur, 2) == KvSessionPage(want, want[-1])
    last = live[-1]
    assert c.list_kv_session_keys(S, last, 10) == KvSessionPage([], "")

    # A session that disappears between pages ends the walk with SessionNotFound.
    assert c.put_batch(["v0", "v1", "v2"], [b"1"] * 3, tags([["V"]] * 3)) == [0] * 3
    first = c.list_kv_session_keys("V", "", 2)
    assert first == KvSessionPage(["v0", "v1"], "v1")
    w2.call("batch_remove", ["v0", "v1", "v2"])
    with pytest.raises(SessionNotFound):
        c.list_kv_session_keys("V", first.next_cursor, 2)

    # Limits: 1..4096 (kv_session_max_batch).
    assert len(c.list_kv_session_keys(S, "", 4096).keys) == len(ever - removed)
    for bad in (4097, 0):
        with pytest.raises(InvalidParams):
            c.list_kv_session_keys(S, "", bad)
    with pytest.raises(InvalidParams):
        c.list_kv_session_keys(S, "a\x00b", 5)
    consistent(c)


# ---------------------------------------------------------------- session ids


def test_4096_byte_ids_and_invalid_ids(start_master, make_client, remotes) -> None:
    m = start_master("--shards", "4")
    c = make_client(m)
    w1, _ = remotes(m)
    ascii_id = "s" * 4096
    utf8_id = "é" * 2048  # 4096 bytes
    long_key = "k" * 4096
    for n, sid in enumerate((ascii_id, utf8_id)):
        key = f"key{n}"
        w1.call("put", key, b"v", tag(sid))
        c.put(long_key, b"L", tag(sid))
        assert w1.call("attach_kv_session", sid, [key, long_key]) == [0, 0]
        w1.call("pin_kv_session", sid)
        got = c.get_kv_session(sid)
        assert got == KvSessionInfo(sid, True, 2)
        assert members(c, sid, page=1) == sorted([key, long_key])
        assert c.list_kv_session_keys(sid, long_key, 5) == KvSessionPage([], "")
        assert w1.call("update_kv_session", sid, [long_key]) == 1
        c.unpin_kv_session(sid)
        c.close_kv_session(sid)
        assert info(c, sid) is None

    bad_ids = ["", "s" * 4097, "é" * 2049, "a\x00b"]
    for sid in bad_ids:
        for name, args in (("attach_kv_session", (sid, ["key0"])),
                           ("pin_kv_session", (sid,)), ("unpin_kv_session", (sid,)),
                           ("update_kv_session", (sid, ["key0"])),
                           ("close_kv_session", (sid,)), ("get_kv_session", (sid,)),
                           ("list_kv_session_keys", (sid, "", 5))):
            with pytest.raises(InvalidParams):
                w1.call(name, *args)
        with pytest.raises(InvalidParams):
            c.put("tagged-bad", b"v", tag("fine", sid))
        with pytest.raises(InvalidParams):
            c.put_batch(["tb0"], [b"0"], tags([["fine", sid]]))
        with pytest.raises(InvalidParams):
            c.upsert("key0", b"new", tag(sid))
    assert present(c, ["tagged-bad", "tb0"]) == []
    assert info(c, "fine") is None
    assert c.get("key0") == b"v"
    assert c.stats()["pending_writes"] == 0
    consistent(c)


# ------------------------------------------------------------------------ limits


def test_limit_max_sessions(start_master, make_client, remotes) -> None:
    m = start_master("--shards", "1", "--kv-session-max-sessions", "3")
    c = make_client(m)
    w1, w2 = remotes(m)
    keys = [f"k{i}" for i in range(6)]
    assert c.put_batch(keys, [val(k) for k in keys]) == [0] * 6
    w1.call("put", "t1", b"1", tag("s1"))
    assert w2.call("attach_kv_session", "s2", ["k0"]) == [0]
    assert w1.call("put_batch", ["t3a", "t3b"], [b"a", b"b"], tags([["s3"], ["s3"]])) == [0, 0]
    before = {s: c.get_kv_session(s) for s in ("s1", "s2", "s3")}
    stats0 = c.stats()

    # A fourth session, by every route: SESSION_LIMIT_EXCEEDED and nothing else.
    assert w2.call("attach_kv_session", "s4", ["k1", "k2"]) == [LIMIT, LIMIT]
    with pytest.raises(SessionLimitExceeded):
        w1.call("put", "new1", b"n", tag("s4"))
    with pytest.raises(SessionLimitExceeded):
        c.put("new2", b"n", tag("s1", "s4"))
    assert c.put_batch(["new3", "new4"], [b"3", b"4"], tags([["s4"], ["s1"]])) == [LIMIT, 0]
    with pytest.raises(SessionLimitExceeded):
        w1.call("put", "k3", b"dedup", tag("s4"))  # dedup put of an existing object
    with pytest.raises(SessionLimitExceeded):
        w2.call("upsert", "k4", b"replacement", tag("s4"))
    assert info(c, "s4") is None
    assert present(c, ["new1", "new2", "new3", "new4"]) == ["new4"]
    assert c.get("k4") == val("k4")
    assert [sessions_of(c, k) for k in ("k1", "k2", "k3", "k4")] == [[]] * 4
    assert c.get_kv_session("s1").member_count == before["s1"].member_count + 1  # new4
    assert c.get_kv_session("s2") == before["s2"] and c.get_kv_session("s3") == before["s3"]
    s = c.stats()
    assert s["sessions"] == 3 and s["pending_writes"] == 0
    assert s["keys"] == stats0["keys"] + 1
    assert s["allocated_bytes"] == stats0["allocated_bytes"] + 64
    assert s["session_limit_rejections"] > stats0["session_limit_rejections"]
    consistent(c)

    # Existing sessions still grow; a freed slot admits a new one.
    assert w1.call("attach_kv_session", "s2", ["k1"]) == [0]
    c.close_kv_session("s2")
    assert w2.call("attach_kv_session", "s4", ["k1"]) == [0]
    assert c.get_kv_session("s4") == KvSessionInfo("s4", False, 1)
    consistent(c)


def test_limit_max_sessions_is_a_per_shard_share(start_master, make_client) -> None:
    m = start_master("--shards", "2", "--kv-session-max-sessions", "3")  # 2 per shard
    c = make_client(m)
    c.put("k", b"v")
    ids = [f"h{i}" for i in range(40)]
    on0 = [s for s in ids if home_shard(s, 2) == 0][:3]
    on1 = [s for s in ids if home_shard(s, 2) == 1][:2]
    assert [c.attach_kv_session(s, ["k"])[0] for s in on0] == [0, 0, LIMIT]
    assert [c.attach_kv_session(s, ["k"])[0] for s in on1] == [0, 0]
    assert c.stats()["sessions"] == 4
    consistent(c)


def test_limit_max_members(start_master, make_client, remotes) -> None:
    m = start_master("--shards", "2", "--kv-session-max-members", "3", "--max-batch", "64")
    c = make_client(m)
    w1, w2 = remotes(m)
    keys = [f"k{i}" for i in range(8)]
    assert c.put_batch(keys, [val(k) for k in keys]) == [0] * 8
    S = "cap"
    assert w1.call("put_batch", ["m0", "m1", "m2"], [b"0", b"1", b"2"], tags([[S]] * 3)) == [0] * 3
    stats0 = c.stats()

    with pytest.raises(SessionLimitExceeded):
        w1.call("put", "m3", b"3", tag(S))
    assert w2.call("attach_kv_session", S, ["k3", "m0", "k4"]) == [LIMIT, 0, LIMIT]
    assert w2.call("put_batch", ["k5", "m1", "m4"], [b"5", b"1", b"4"],
                   tags([[S], [S], [S, "T"]])) == [LIMIT, 0, LIMIT]
    with pytest.raises(SessionLimitExceeded):
        c.upsert("k6", b"replacement", tag(S))
    assert c.get_kv_session(S) == KvSessionInfo(S, False, 3)
    assert members(c, S) == ["m0", "m1", "m2"]
    assert present(c, ["m3", "m4"]) == []
    assert [sessions_of(c, k) for k in ("k3", "k4", "k5", "k6")] == [[]] * 4
    assert c.get("k6") == val("k6") and c.get("k5") == val("k5")
    assert info(c, "T") is None
    s = c.stats()
    assert (s["keys"], s["pending_writes"], s["allocated_bytes"]) == \
        (stats0["keys"], 0, stats0["allocated_bytes"])
    consistent(c)

    # A complete keep set larger than the member limit is refused before any change,
    # also when it arrives in several pages.
    with pytest.raises(InvalidParams):
        w1.call("update_kv_session", S, ["m0", "m1", "m2", "x"])
    with pytest.raises(InvalidParams):
        w1.call("update_kv_session", S, ["m0"] + [f"pad{i}" for i in range(100)])
    assert c.get_kv_session(S).member_count == 3
    assert w1.call("update_kv_session", S, ["m0", "m1", "zzz"]) == 1
    assert w2.call("attach_kv_session", S, ["k3"]) == [0]  # room again
    assert members(c, S) == ["k3", "m0", "m1"]
    consistent(c)


def test_limit_max_sessions_per_object(start_master, make_client, remotes) -> None:
    m = start_master("--shards", "2", "--kv-session-max-per-object", "2")
    c = make_client(m)
    w1, w2 = remotes(m)
    c.put("k", b"value", tag("A", "B"))
    stats0 = c.stats()

    assert w1.call("attach_kv_session", "C", ["k"]) == [LIMIT]
    assert w1.call("attach_kv_session", "A", ["k"]) == [0]  # already a member: fine
    with pytest.raises(SessionLimitExceeded):
        w2.call("put", "k", b"dedup", tag("C"))
    with pytest.raises(SessionLimitExceeded):
        w2.call("upsert", "k", b"replacement", tag("C"))
    with pytest.raises(SessionLimitExceeded):
        w1.call("put", "n", b"new", tag("A", "B", "C"))
    assert info(c, "C") is None
    assert c.get("k") == b"value"
    assert present(c, ["n"]) == []
    assert sessions_of(c, "k") == [b"A", b"B"]
    assert c.get_kv_session("A").member_count == 1
    s = c.stats()
    assert (s["keys"], s["pending_writes"], s["allocated_bytes"]) == \
        (stats0["keys"], 0, stats0["allocated_bytes"])

    w1.call("put", "n", b"new", tag("A", "B", "B", "A"))  # two distinct: allowed
    assert c.get_kv_session("A").member_count == 2
    consistent(c)


def test_batch_over_per_object_limit_leaves_nothing_behind(start_master, make_client) -> None:
    """A batch spread over four shards where one key carries too many tags: whether the
    call raises or reports the key alone, no write may be left half-started and no
    session may be left holding objects that never become readable."""
    m = start_master("--shards", "4", "--kv-session-max-per-object", "2")
    c = make_client(m)
    keys = [f"b{i:02d}" for i in range(12)]
    assert {P.shard_of(k.encode(), P.tenant_seed("default"), 4) for k in keys} == {0, 1, 2, 3}
    lists = [["S"]] * 11 + [["S", "T", "U"]]
    try:
        res = c.put_batch(keys, [b"x"] * 12, tags(lists))
    except SessionLimitExceeded:
        res = None
    s = c.stats()
    states = {}
    for k in keys:
        try:
            states[k] = c.query_key(k)["state"]
        except ObjectNotFound:
            states[k] = None
    assert s["pending_writes"] == 0, f"writes left started: {states}"
    if res is None:
        assert set(states.values()) == {None}
        assert info(c, "S") is None
    else:
        assert res[-1] == LIMIT
        stored = [k for k, r in zip(keys, res) if r == 0]
        assert all(r in (0, LIMIT) for r in res)
        assert [k for k, st in states.items() if st is not None] == stored
        assert (members(c, "S") if stored else []) == stored
    assert info(c, "T") is None and info(c, "U") is None
    consistent(c)


# ------------------------------------------------------------------------ tenants


def test_query_key_reports_session_ids_as_the_tenant_wrote_them(start_master, make_client,
                                                                remotes) -> None:
    """query_key's ``sessions`` must not expose the tenant prefix of stored ids
    (list_kv_session_keys strips it from keys the same way)."""
    m = start_master("--shards", "2")
    c = make_client(m)
    t1, _ = remotes(m, tenants=("t1", "default"))
    t1.call("put", "k", b"v", tag("s", "r"))
    c.put("k", b"v", tag("s"))
    assert c.query_key("k")["sessions"] == [b"s"]
    assert t1.call("query_key", "k")["sessions"] == [b"r", b"s"]
    consistent(c)


def test_tenant_isolation(start_master, make_client, remotes) -> None:
    m = start_master("--shards", "4")
    c = make_client(m)  # default tenant; the others write to their own segments
    t1, t2 = remotes(m, tenants=("t1", "t2"))
    for who, v in ((c, b"D"), (t1, b"1"), (t2, b"2")):
        call(who, "put", "k0", v + b"0", tag("s"))
        call(who, "put", "k1", v + b"1", tag("s"))
    t1.call("put", "only-t1", b"x")

    for who in (c, t1, t2):
        assert call(who, "get_kv_session", "s") == KvSessionInfo("s", False, 2)
        assert call(who, "iter_kv_session_keys", "s", 1) == ["k0", "k1"]
    assert t2.call("get", "k0") == b"20"

    # A pin in one tenant does not reach another tenant's session or objects.
    t1.call("pin_kv_session", "s")
    assert c.get_kv_session("s").pinned is False
    assert t2.call("get_kv_session", "s").pinned is False
    assert t1.call("query_key", "k0")["soft_pinned"] is True
    assert t2.call("query_key", "k0")["soft_pinned"] is False
    assert not soft_pinned(c, "k0")

    # Keys of another tenant cannot be attached; session ids read back unprefixed.
    assert t2.call("attach_kv_session", "s", ["only-t1"]) == [NOT_FOUND]
    assert c.attach_kv_session("s", ["only-t1"]) == [NOT_FOUND]

    # Close, update and removal stay inside the tenant.
    t1.call("close_kv_session", "s")
    assert t2.call("get_kv_session", "s").member_count == 2
    assert c.get_kv_session("s").member_count == 2
    assert t2.call("update_kv_session", "s", ["k1"]) == 1
    assert c.get_kv_session("s").member_count == 2
    c.remove("k1")
    assert t2.call("iter_kv_session_keys", "s", 10) == ["k1"]
    assert members(c, "s") == ["k0"]
    with pytest.raises(SessionNotFound):
        t1.call("get_kv_session", "s")
    consistent(c)


# ---------------------------------------------------------------------- eviction


def test_eviction_keeps_pinned_sessions_objects_while_ordinary_go(start_master, make_client,
                                                                  remotes) -> None:
    # (Mooncake's order, lru: a batch's first key is its least recently used)
    m = start_master(*ONE_SHARD_EXACT, "--no-allow-evict-soft-pinned-objects",
                     "--eviction-policy", "lru")
    c = make_client(m, segment_bytes=MiB)
    w1, w2 = remotes(m)
    p = [f"p{i}" for i in range(6)]
    o = [f"o{i}" for i in range(10)]
    n = [f"n{i}" for i in range(10)]
    assert w1.call("put_batch", p, [BIG] * 6, tags([["hot"]] * 6)) == [0] * 6  # oldest
    w2.call("pin_kv_session", "hot")
    assert c.put_batch(o, [BIG] * 10) == [0] * 10
    assert c.stats()["allocated_bytes"] == MiB

    for k in n:  # each needs a slot: the least recently used *ordinary* object goes
        w2.call("put", k, BIG)
    assert present(c, p) == p
    assert present(c, o) == []
    assert c.get_kv_session("hot") == KvSessionInfo("hot", True, 6)
    s = c.stats()
    assert (s["evicted_keys"], s["evicted_soft_pinned_keys"]) == (10, 0)

    # Everything pinned, fallback not allowed: writes are refused and register nothing.
    assert w1.call("attach_kv_session", "hot", n) == [0] * 10
    with pytest.raises(NoAvailableHandle):
        c.put("x", BIG)
    with pytest.raises(NoAvailableHandle):
        w1.call("put", "y", BIG, tag("cold"))
    assert info(c, "cold") is None
    assert present(c, p + n) == p + n

    # Unpinned, the session's least recently used member is an ordinary victim again.
    w1.call("unpin_kv_session", "hot")
    c.put("x", BIG)
    assert present(c, p + n) == p[1:] + n
    assert c.get_kv_session("hot") == KvSessionInfo("hot", False, 15)
    consistent(c)


def test_eviction_falls_back_to_pinned_when_allowed(start_master, make_client, remotes) -> None:
    # allow_evict_soft_pinned_objects defaults to true; lru: a batch's first key goes first
    m = start_master(*ONE_SHARD_EXACT, "--eviction-policy", "lru")
    c = make_client(m, segment_bytes=MiB)
    w1, w2 = remotes(m)
    p = [f"p{i}" for i in range(8)]
    o = [f"o{i}" for i in range(8)]
    assert w1.call("put_batch", p, [BIG] * 8, tags([["hot"]] * 8)) == [0] * 8
    w1.call("pin_kv_session", "hot")
    assert c.put_batch(o, [BIG] * 8) == [0] * 8

    # While ordinary objects exist, they go first even though fallback is allowed.
    extra = [f"n{i}" for i in range(8)]
    for k in extra:
        w2.call("put", k, BIG)
    assert present(c, p) == p and present(c, o) == []
    assert c.stats()["evicted_soft_pinned_keys"] == 0

    # Everything pinned: the least recently used pinned object goes.
    assert w2.call("attach_kv_session", "hot", extra) == [0] * 8
    w2.call("put", "z00", BIG, tag("hot2"))
    assert present(c, p) == p[1:]
    assert c.get_kv_session("hot") == KvSessionInfo("hot", True, 15)
    assert c.stats()["evicted_soft_pinned_keys"] == 1
    w2.call("pin_kv_session", "hot2")
    for i in range(1, 16):
        w1.call("put", f"z{i:02d}", BIG, tag("hot2"))
    # Every member of "hot" is gone, and so is the session with its pin.
    assert present(c, p + extra) == []
    assert info(c, "hot") is None
    assert c.get_kv_session("hot2") == KvSessionInfo("hot2", True, 16)

    # A new write into the old id creates it afresh, unpinned.
    w1.call("put", "fresh", BIG, tag("hot"))
    assert c.get_kv_session("hot") == KvSessionInfo("hot", False, 1)
    assert not soft_pinned(c, "fresh")
    assert c.get_kv_session("hot2").member_count == 15
    assert c.stats()["evicted_soft_pinned_keys"] == 17
    consistent(c)


def test_upsert_evicting_its_own_old_version_keeps_sessions_consistent(start_master,
                                                                       make_client) -> None:
    """An upsert (or a batch) whose allocation evicts the key's own old object, while
    re-tagging the same session: the session and the object must agree afterwards."""
    m = start_master(*ONE_SHARD_EXACT)
    c = make_client(m, segment_bytes=MiB)
    c.put("k00", BIG, tag("S"))
    for i in range(1, SLOTS):
        c.put(f"k{i:02d}", BIG)
    c.upsert("k00", BIG, tag("S"))  # the old k00 is the LRU victim of its own upsert
    assert c.stats()["evicted_keys"] == 1
    assert sessions_of(c, "k00") == [b"S"]
    assert info(c, "S") == KvSessionInfo("S", False, 1)
    consistent(c)


def test_batch_evicting_a_key_it_rewrites_keeps_sessions_consistent(start_master,
                                                                    make_client) -> None:
    """A batch whose first write evicts an object the same batch then writes again,
    tagged with the session it already belonged to."""
    m = start_master(*ONE_SHARD_EXACT)
    c = make_client(m, segment_bytes=MiB)
    c.put("j00", BIG, tag("T"))
    for i in range(1, SLOTS):
        c.put(f"j{i:02d}", BIG)
    # "new" evicts j00, then j00 is written again in the same batch, tagged T again.
    assert c.put_batch(["new", "j00"], [BIG, BIG], tags([["T"], ["T"]])) == [0, 0]
    assert sessions_of(c, "j00") == [b"T"]
    assert members(c, "T") == ["j00", "new"]
    consistent(c)


# ------------------------------------------------------------ disabled sessions


def test_sessions_disabled_answer_unsupported(start_master, make_client) -> None:
    m = start_master("--no-enable-kv-sessions", "--shards", "2", "--max-batch", "16")
    c = make_client(m)
    c.put("plain", b"p")
    assert c.put_batch(["a", "b"], [b"1", b"2"]) == [0, 0]
    for name, args in (("attach_kv_session", ("s", ["plain"])), ("pin_kv_session", ("s",)),
                       ("unpin_kv_session", ("s",)), ("update_kv_session", ("s", ["plain"])),
                       ("update_kv_session", ("s", [f"k{i}" for i in range(40)])),
                       ("close_kv_session", ("s",)), ("get_kv_session", ("s",)),
                       ("list_kv_session_keys", ("s", "", 10))):
        with pytest.raises(Unsupported) as exc:
            getattr(c, name)(*args)
        assert exc.value.code == -1900
    with pytest.raises(Unsupported):
        c.put("t", b"v", tag("s"))
    with pytest.raises(Unsupported):
        c.upsert("plain", b"v", tag("s"))
    with pytest.raises(Unsupported):
        c.put_batch(["t1", "t2", "t3", "t4"], [b"1"] * 4, tags([["s"]] * 4))
    assert present(c, ["t", "t1", "t2", "t3", "t4"]) == []
    assert c.get("plain") == b"p" and c.get_batch(["a", "b"]) == [b"1", b"2"]
    assert sessions_of(c, "plain") == []
    c.upsert("plain", b"p2")
    assert c.get("plain") == b"p2"
    assert c.stats()["pending_writes"] == 0

    from kvmaster.compat import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", m.addr) == 0
    try:
        assert store.attach_kv_session("s", ["plain", "a"]) == [-1900, -1900]
        with pytest.raises(RuntimeError, match=r"UNSUPPORTED.*-1900"):
            store.pin_kv_session("s")
        assert store.get("plain") == b"p2"
    finally:
        store.close()
    consistent(c)


# ------------------------------------------------------------------ compat API


def test_compat_session_api(start_master) -> None:
    from kvmaster.compat import MooncakeDistributedStore
    from kvmaster.compat import ReplicateConfig as MooncakeConfig

    m = start_master("--shards", "4", "--kv-session-max-members", "4")
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", m.addr) == 0
    try:
        a, b = "conversation-a", "conversation-b"
        config = MooncakeConfig()
        config.kv_sessions = [[a]]
        assert store.put("shared-prefix", b"kv-payload", config) == 0
        assert store.pin_kv_session(a) == 0
        assert store.attach_kv_session(b, ["shared-prefix"]) == [0]
        assert store.attach_kv_session(b, ["shared-prefix", "missing"]) == [0, -704]
        assert store.pin_kv_session(b) == 0
        assert store.unpin_kv_session(a) == 0
        assert store.close_kv_session(a) == 0
        config.kv_sessions = [[b], [b]]
        assert store.put_batch(["block-2", "block-3"], [b"kv2", b"kv3"], config) == 0
        got = store.get_kv_session(b)
        assert isinstance(got, KvSessionInfo) and got == KvSessionInfo(b, True, 3)
        page = store.list_kv_session_keys(b, "", 2)
        assert isinstance(page, KvSessionPage) and page == KvSessionPage(["block-2", "block-3"],
                                                                          "block-3")
        assert store.list_kv_session_keys(b, page.next_cursor) == KvSessionPage(
            ["shared-prefix"], "")
        assert store.get("shared-prefix") == b"kv-payload"

        # put_from with a raw pointer carries tags too.
        buf = ctypes.create_string_buffer(b"raw-bytes", 9)
        one = MooncakeConfig()
        one.kv_sessions = [[b]]
        assert store.put_from("raw", ctypes.addressof(buf), 9, one) == 0
        assert store.get("raw") == b"raw-bytes"
        assert store.get_kv_session(b).member_count == 4
        # Over the member limit: attach reports the code, a write returns it.
        assert store.put("more", b"m") == 0
        assert store.attach_kv_session(b, ["more"]) == [-1802]
        assert store.put("more2", b"m", one) == -1802
        assert store.is_exist("more2") == 0

        assert store.update_kv_session(b, ["shared-prefix", "block-3"]) == 0
        assert store.get_kv_session(b).member_count == 2
        assert store.update_kv_session("nope", ["x"]) == 0
        assert store.close_kv_session("nope") == 0  # idempotent

        # Failed control calls raise RuntimeError naming the code.
        for fn, args in ((store.pin_kv_session, ("nope",)), (store.unpin_kv_session, ("nope",)),
                         (store.get_kv_session, ("nope",)),
                         (store.list_kv_session_keys, ("nope", "", 5))):
            with pytest.raises(RuntimeError, match=r"SESSION_NOT_FOUND.*-1800"):
                fn(*args)
        for fn, args in ((store.pin_kv_session, ("",)), (store.close_kv_session, ("a\x00",)),
                         (store.update_kv_session, ("x" * 4097, [])),
                         (store.list_kv_session_keys, (b, "", 4097))):
            with pytest.raises(RuntimeError, match=r"INVALID_PARAMS.*-600"):
                fn(*args)
        assert store.attach_kv_session("", ["raw"]) == [-600]
        assert store.close_kv_session(b) == 0
        assert store.is_exist("shared-prefix") == 1
        assert store.client.check_consistency() == []
    finally:
        store.close()


# ------------------------------------------------------------ threads, one client


def test_one_client_shared_between_threads(start_master, make_client) -> None:
    """The client is thread-safe: session calls from many threads interleave cleanly."""
    m = start_master("--shards", "4")
    c = make_client(m)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            keys = [f"t{t}/{i}" for i in range(30)]
            assert c.put_batch(keys, [b"x"] * 30, tags([[f"T{t}", "common"]] * 30)) == [0] * 30
            c.pin_kv_session(f"T{t}")
            assert c.update_kv_session(f"T{t}", keys[:10]) == 20
            assert c.attach_kv_session(f"T{t}", keys[20:]) == [0] * 10
            c.unpin_kv_session(f"T{t}")
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert not errors, errors
    for t in range(6):
        assert c.get_kv_session(f"T{t}") == KvSessionInfo(f"T{t}", False, 20)
    assert c.get_kv_session("common").member_count == 180
    consistent(c)


def test_a_key_repeated_in_a_tagged_batch_stays_within_the_session_limit(start_master,
                                                                          make_client) -> None:
    """The limit on sessions per object counts what the earlier positions of the same
    key in one batch register: a later position that would pass it is refused
    SESSION_LIMIT_EXCEEDED (each position used to be checked alone, so a key could end
    up in more sessions than the limit)."""
    m = start_master("--kv-session-max-per-object", "2")
    c = make_client(m)
    # Raw, as a client that sends repeats would (the Python client sends a key once).
    body = c._call(Op.BATCH_PUT_START_WITH_KV_SESSIONS.value, c._route(b"q"),
                   [[b"q", b"q"], [100, 100], None, [[b"s1", b"s2"], [b"s3"]]])
    assert type(body[0]) is list and body[1] == Status.SESSION_LIMIT_EXCEEDED, body
    assert c._call(Op.BATCH_PUT_END.value, c._route(b"q"), [[b"q"]]) == [0]
    assert sorted(c.query_key("q")["sessions"]) == [b"s1", b"s2"]
    assert c.check_consistency() == []
