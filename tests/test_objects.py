"""Object semantics against a real master: data across client processes, the
buffer APIs, write-once put and upsert, leases and removal, batch results,
replica placement, and unfinished writes (PutStart without PutEnd)."""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing as mp
import random
import time
from typing import Any

import msgpack
import pytest
import zmq

from kvmaster import (
    Client,
    InvalidParams,
    ObjectHasLease,
    ObjectNotFound,
    ReplicateConfig,
    RequestError,
    SegmentNotFound,
    Status,
)
from kvmaster import protocol as P
from kvmaster._alloc import align_up
from kvmaster.protocol import Op

KiB = 1 << 10
MiB = 1 << 20


def blob(seed: Any, n: int) -> bytes:
    """Deterministic pseudo-random bytes."""
    return random.Random(str(seed)).randbytes(n)


def digest(b: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(b).hexdigest()


# ----------------------------------------------------------------- helpers: worker process


def _worker_main(conn: Any, addr: str, segment_bytes: int) -> None:
    """A client in its own process, driven by commands over a pipe."""
    c = Client()
    try:
        c.setup(addr, segment_bytes, timeout_s=10)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("err", repr(exc)))
        return
    conn.send(("ok", c.segment_name))
    try:
        while conn.poll(60):
            cmd, *args = conn.recv()
            if cmd == "close":
                break
            try:
                if cmd == "put_own":  # into this process's own segment
                    key, seed, n = args
                    c.put(key, blob(seed, n), ReplicateConfig(preferred_segments=[c.segment_name]))
                    res: Any = c.query_key(key)
                elif cmd == "get":
                    res = digest(c.get(args[0]))
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                conn.send(("ok", res))
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                conn.send(("err", repr(exc)))
    finally:
        c.close()
        conn.send(("ok", "closed"))
        conn.close()


class Worker:
    """Parent side of :func:`_worker_main`; every wait has a timeout."""

    def __init__(self, addr: str, segment_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, addr, segment_bytes),
                                daemon=True)
        self.proc.start()
        child.close()
        self.segment: str | None = None

    def ready(self, timeout: float = 30) -> str:
        self.segment = self._recv(timeout)
        return self.segment

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"worker pid {self.proc.pid} did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"worker pid {self.proc.pid} failed: {value}")
        return value

    def call(self, *cmd: Any, timeout: float = 15) -> Any:
        self.conn.send(cmd)
        return self._recv(timeout)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("close",))
                self._recv(10)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            self.conn.close()


# ------------------------------------------------------------- helpers: raw protocol


class Raw:
    """A bare DEALER speaking the wire protocol (a writer we can stall at will)."""

    def __init__(self, endpoint: str, client_id: str = "raw-writer") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)
        self.client_id = client_id
        self.shard_count = 0

    def request(self, op: Op, route: bytes, *fields: Any, timeout: float = 5) -> tuple[int, Any]:
        req_id = next(self.ids)
        self.sock.send_multipart([op.value, route, msgpack.packb([req_id, *fields])])
        assert self.sock.poll(timeout * 1000), f"no reply to {op.name} within {timeout} s"
        rop, payload = self.sock.recv_multipart()
        assert rop == op.value
        rid, status, body = P.decode_reply(payload)
        assert rid == req_id
        return status, body

    def hello(self) -> None:
        status, body = self.request(Op.HELLO, P.MASTER_ROUTE, *P.PROTOCOL_VERSION,
                                    self.client_id, "default", "raw-host", "0")
        assert status == 0, body
        self.shard_count = body["shard_count"]

    def route(self, key: bytes) -> bytes:
        return P.route_for_shard(P.shard_of(key, P.tenant_seed("default"), self.shard_count))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def raw_factory():
    made: list[Raw] = []

    def make(endpoint: str, client_id: str = "raw-writer") -> Raw:
        r = Raw(endpoint, client_id)
        made.append(r)
        r.hello()
        return r

    yield make
    for r in made:
        r.close()


# ------------------------------------------------------------------------------ tests


def test_put_get_1mib_across_two_processes(master, make_client) -> None:
    a = Worker(master.addr, 16 * MiB)
    b = Worker(master.addr, 16 * MiB)
    try:
        seg_a, seg_b = a.ready(), b.ready()
        assert seg_a != seg_b

        # A writes into its own segment, B reads it.
        info = a.call("put_own", "from-a", "seed-a", MiB)
        assert info["size"] == MiB
        assert [r[0] for r in info["replicas"]] == [seg_a]
        assert b.call("get", "from-a") == digest(blob("seed-a", MiB))

        # B writes into its own segment, A reads it.
        info = b.call("put_own", "from-b", "seed-b", MiB)
        assert [r[0] for r in info["replicas"]] == [seg_b]
        assert a.call("get", "from-b") == digest(blob("seed-b", MiB))

        # A third, consumer-only client in this process sees both.
        c = make_client(master, segment_bytes=0)
        assert c.get("from-a") == blob("seed-a", MiB)
        assert c.get("from-b") == blob("seed-b", MiB)
    finally:
        a.close()
        b.close()
    # Both segments are gone with their owners, and so are their objects.
    assert not c.is_exist("from-a") and not c.is_exist("from-b")
    assert c.stats()["segments"] == 0


def test_buffer_apis(client) -> None:
    v = blob(1, 100 * KiB)
    client.put("k", v)

    buf = bytearray(200 * KiB)
    assert client.get_into("k", buf) == len(v)
    assert bytes(buf[:len(v)]) == v
    with pytest.raises(InvalidParams):
        client.get_into("k", bytearray(len(v) - 1))
    with pytest.raises(ObjectNotFound):
        client.get_into("missing", buf)

    view = client.get_buffer("k")
    assert isinstance(view, memoryview) and view.nbytes == len(v) and view == v

    # put_from: any buffer-protocol object, including a slice of a larger one.
    src = bytearray(blob(2, 64 * KiB))
    client.put_from("pf", memoryview(src)[16:16 + 4096])
    assert client.get("pf") == bytes(src[16:16 + 4096])

    # put_parts: consecutive parts make one object.
    parts = [blob(3, 1000), blob(4, 1), blob(5, 70 * KiB)]
    client.put_parts("pp", *parts)
    assert client.get("pp") == b"".join(parts)
    assert client.get_size("pp") == sum(map(len, parts))

    # batch_put_from / batch_get_into, one result per position.
    keys = [f"b{i}" for i in range(10)]
    vals = [bytearray(blob(f"b{i}", 1000 + 977 * i)) for i in range(10)]
    assert client.batch_put_from(keys, vals) == [0] * 10
    outs = [bytearray(len(x)) for x in vals]
    outs[3] = bytearray(len(vals[3]) - 1)  # too small: fails alone
    res = client.batch_get_into(keys + ["missing"], outs + [bytearray(10)])
    assert res == [len(x) if i != 3 else Status.INVALID_PARAMS for i, x in enumerate(vals)] + [
        Status.OBJECT_NOT_FOUND]
    for i in range(10):
        if i != 3:
            assert outs[i] == vals[i]


def test_put_is_write_once(client) -> None:
    client.put("k", b"first" * 100)
    client.put("k", b"second, longer" * 100)  # succeeds ...
    assert client.get("k") == b"first" * 100  # ... without replacing
    assert client.get_size("k") == 500
    assert client.put_batch(["k", "new"], [b"third", b"n"]) == [0, 0]
    assert client.get("k") == b"first" * 100
    assert client.get("new") == b"n"
    with pytest.raises(InvalidParams):
        client.put("empty", b"")


def test_upsert_replaces_and_leased_reader_keeps_old_bytes(start_master, make_client) -> None:
    m = start_master("--shards", "1", "--eviction-high-watermark-ratio", "1.0",
                     "--default-kv-lease-ttl", "800")
    writer = make_client(m, segment_bytes=MiB)  # 16 slots of 64 KiB
    reader = make_client(m, segment_bytes=0)
    old, new = b"A" * (64 * KiB), b"B" * (64 * KiB)
    writer.put("k", old)

    # The reader has been given the replica list (and with it a lease) ...
    (size, replicas), _deadline = reader._get_desc("k")
    old_off = replicas[0][1]
    # ... then the object is replaced.
    writer.upsert("k", new)
    assert writer.get("k") == new
    assert writer.query_key("k")["replicas"][0][1] != old_off

    # The old range stays allocated while leased: fill the rest of the segment.
    s = writer.stats()
    assert s["allocated_bytes"] == 2 * 64 * KiB
    for i in range(14):
        writer.put(f"f{i}", blob(i, 64 * KiB))
        assert writer.query_key(f"f{i}")["replicas"][0][1] != old_off
    assert writer.stats()["allocated_bytes"] == MiB
    dst = bytearray(size)
    reader._read_into(replicas, size, dst)
    assert dst == old  # the leased reader still reads the old bytes

    # Once the lease has run out the old range is reused, with no eviction.
    time.sleep(0.85)
    writer.put("after", blob("after", 64 * KiB))
    assert writer.query_key("after")["replicas"][0][1] == old_off
    assert writer.stats()["evicted_keys"] == 0
    assert writer.get("k") == new


def test_upsert_of_missing_key_and_batch(client) -> None:
    client.upsert("u", b"one")
    assert client.get("u") == b"one"
    assert client.upsert_batch(["u", "v"], [b"two!", b"vv"]) == [0, 0]
    assert client.get("u") == b"two!" and client.get_size("u") == 4
    assert client.get("v") == b"vv"


def test_remove_and_leases(start_master, make_client) -> None:
    m = start_master("--default-kv-lease-ttl", "300")
    c = make_client(m)
    c.put("k", b"x" * 100)
    c.remove("k")  # put grants no lease
    with pytest.raises(ObjectNotFound):
        c.remove("k")

    c.put("k", b"x" * 100)
    c.get("k")
    with pytest.raises(ObjectHasLease):
        c.remove("k")
    c.remove("k", force=True)
    assert not c.is_exist("k")

    # Each read renews the lease to now + TTL.
    c.put("k2", b"y" * 100)
    c.get("k2")
    time.sleep(0.2)
    c.get("k2")
    assert c.query_key("k2")["lease_ms_left"] > 200

    # Without force, the remove succeeds once the lease has run out.
    t0 = time.monotonic()
    c.get("k2")
    while True:
        try:
            c.remove("k2")
            break
        except ObjectHasLease:
            assert time.monotonic() - t0 < 3, "lease did not expire"
            time.sleep(0.02)
    assert 0.25 <= time.monotonic() - t0 < 2
    assert not c.is_exist("k2")


def test_is_exist_grants_no_lease(client) -> None:
    client.put("k", b"v")
    assert client.is_exist("k") is True
    client.remove("k")  # no lease was granted
    assert client.is_exist("k") is False
    client.put("k", b"v")
    client.put("j", b"w")
    assert client.batch_is_exist(["k", "j", "nope"]) == [1, 1, 0]
    assert client.batch_remove(["k", "j"]) == [0, 0]


def test_is_exist_grants_lease_with_flag(start_master, make_client) -> None:
    m = start_master("--exist-grants-lease")
    c = make_client(m)
    c.put("k", b"v")
    c.put("j", b"w")
    assert c.is_exist("k") is True
    with pytest.raises(ObjectHasLease):
        c.remove("k")
    assert c.batch_is_exist(["j"]) == [1]
    assert c.batch_remove(["j"]) == [Status.OBJECT_HAS_LEASE]
    assert c.batch_remove(["k", "j"], force=True) == [0, 0]


def test_batch_results_per_position(client) -> None:
    keys = [f"key-{i}" for i in range(40)]  # spread over all shards
    present = {k: blob(k, 100 + i) for i, k in enumerate(keys) if i % 3}
    assert client.put_batch(list(present), list(present.values())) == [0] * len(present)

    probe = keys + keys[::-1] + ["key-1", "key-1", "key-0"]
    want = [present.get(k) for k in probe]
    assert client.get_batch(probe) == want
    assert client.batch_is_exist(probe) == [int(w is not None) for w in want]

    # Duplicate keys in one put batch: the first value wins, the rest succeed.
    res = client.put_batch(["d", "e", "d", "key-1", "d"], [b"d1", b"e1", b"d2", b"zz", b"d3"])
    assert res == [0, 0, 0, 0, 0]
    assert client.get("d") == b"d1" and client.get("e") == b"e1"
    assert client.get("key-1") == present["key-1"]

    # Removal: a missing key and a repeated key fail alone.
    res = client.batch_remove(["d", "key-0", "d", "e"], force=True)
    assert res == [0, Status.OBJECT_NOT_FOUND, Status.OBJECT_NOT_FOUND, 0]
    assert client.batch_is_exist(["d", "e", "key-2"]) == [0, 0, 1]
    assert client.get_batch([]) == [] and client.batch_is_exist([]) == []


def test_get_size(client) -> None:
    client.put("k", blob(0, 12345))
    assert client.get_size("k") == 12345
    client.remove("k")  # get_size grants no lease
    with pytest.raises(ObjectNotFound):
        client.get_size("k")


def test_remove_all_keeps_leased_unless_force(client) -> None:
    assert client.remove_all() == 0
    for i in range(12):
        client.put(f"k{i}", b"v" * (i + 1))
    client.get("k3")
    client.get("k7")
    assert client.remove_all() == 10
    assert client.batch_is_exist([f"k{i}" for i in range(12)]) == [
        int(i in (3, 7)) for i in range(12)]
    assert client.remove_all(force=True) == 2
    s = client.stats()
    # The two force-removed objects were leased: their bytes (64 B aligned each) stay
    # allocated until the leases end, so a reader in flight is not overwritten.
    assert s["keys"] == 0 and s["allocated_bytes"] == 2 * 64


def test_replica_num_two_on_distinct_segments(master, make_client) -> None:
    a = make_client(master, segment_bytes=8 * MiB)
    b = make_client(master, segment_bytes=8 * MiB)
    v = blob("r", 200 * KiB)
    a.put("r", v, ReplicateConfig(replica_num=2))
    reps = a.query_key("r")["replicas"]
    assert sorted(seg for seg, _ in reps) == sorted([a.segment_name, b.segment_name])
    for seg, off in reps:  # every replica holds the bytes
        assert bytes(a._local(seg).buf[off:off + len(v)]) == v

    # More replicas than segments: one per segment.
    a.put("r3", v, ReplicateConfig(replica_num=3))
    assert len({seg for seg, _ in a.query_key("r3")["replicas"]}) == 2

    # Losing one segment keeps the object readable from the other.
    b.close()
    assert [seg for seg, _ in a.query_key("r")["replicas"]] == [a.segment_name]
    assert a.get("r") == v


def test_put_start_of_key_being_written(start_master, make_client, raw_factory) -> None:
    m = start_master("--put-start-discard-timeout", "0.5")
    c = make_client(m)
    raw = raw_factory(m.endpoint, "stalled-writer")
    key = b"contended"
    t0 = time.monotonic()
    status, replicas = raw.request(Op.PUT_START, raw.route(key), key, 4096, None)
    assert status == 0 and len(replicas) == 1

    # Another writer: the key is taken (ObjectAlreadyExists), which put treats as success
    # without storing anything; the object is not readable yet.
    other = raw_factory(m.endpoint, "second-writer")
    status, body = other.request(Op.PUT_START, other.route(key), key, 4096, None)
    assert status == Status.OBJECT_ALREADY_EXISTS and isinstance(body, str)
    c.put("contended", b"mine")
    with pytest.raises(ObjectNotFound):
        c.get("contended")
    q = c.query_key("contended")
    assert q["state"] == "PROCESSING" and q["pending_write"]["client_id"] == "stalled-writer"
    with pytest.raises(RequestError) as ei:
        c.remove("contended")
    assert ei.value.code == Status.REPLICA_IS_NOT_READY

    # After the discard timeout another writer takes the key over.
    time.sleep(max(0.0, 0.55 - (time.monotonic() - t0)))
    c.put("contended", b"mine")
    assert c.get("contended") == b"mine"
    assert c.stats()["put_start_discarded"] == 1
    # The stalled writer can no longer finish (or clobber) the object.
    status, _ = raw.request(Op.PUT_END, raw.route(key), key)
    assert status == Status.OBJECT_NOT_FOUND
    assert c.get("contended") == b"mine"


def test_put_start_release_timeout_drops_the_write_and_its_writer_frees_the_space(
        start_master, make_client, raw_factory) -> None:
    """At the release timeout an unfinished write is dropped (the key is free, the
    write no longer pending) but its space stays allocated while its writer is
    registered: a stopped writer may resume and copy into it.  The writer's revoke (or
    end) of it, or its leaving, frees it."""
    m = start_master("--shards", "1", "--put-start-release-timeout", "0.3")
    c = make_client(m, segment_bytes=MiB)
    for finish in ("revoke", "bye"):
        raw = raw_factory(m.endpoint, f"raw-{finish}")
        status, _ = raw.request(Op.PUT_START, P.route_for_shard(0), b"abandoned", 64 * KiB,
                                None)
        assert status == 0
        assert c.stats()["allocated_bytes"] == 64 * KiB
        deadline = time.monotonic() + 5
        while c.stats()["pending_writes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        s = c.stats()
        assert s["pending_writes"] == 0 and s["allocated_bytes"] == 64 * KiB
        assert s["put_start_released"] == (1 if finish == "revoke" else 2)
        with pytest.raises(ObjectNotFound):
            c.query_key("abandoned")
        if finish == "revoke":
            status, _ = raw.request(Op.PUT_REVOKE, P.route_for_shard(0), b"abandoned")
            assert status == Status.OBJECT_NOT_FOUND  # dropped; and its space given back
        else:
            assert raw.request(Op.BYE, P.MASTER_ROUTE)[0] == 0
        s = c.stats()
        assert s["allocated_bytes"] == 0
        assert c.check_consistency() == []


def test_revoke_frees_space(start_master, make_client, raw_factory) -> None:
    m = start_master("--shards", "1", "--eviction-high-watermark-ratio", "1.0")
    c = make_client(m, segment_bytes=MiB)
    raw = raw_factory(m.endpoint)
    route = P.route_for_shard(0)
    keys = [f"w{i}".encode() for i in range(16)]
    status, res = raw.request(Op.BATCH_PUT_START, route, keys, [64 * KiB] * 16, None)
    assert status == 0 and all(type(r) is list for r in res)
    s = c.stats()
    assert s["allocated_bytes"] == MiB and s["pending_writes"] == 16

    # Full of unfinished writes: nothing can be evicted.
    with pytest.raises(RequestError) as ei:
        c.put("x", b"x" * (64 * KiB))
    assert ei.value.code == Status.NO_AVAILABLE_HANDLE

    # Only the writer may revoke its write.
    with pytest.raises(RequestError) as ei:
        c._call(Op.PUT_REVOKE.value, route, [b"w0"])
    assert ei.value.code == Status.ILLEGAL_CLIENT

    status, body = raw.request(Op.PUT_REVOKE, route, b"w0")
    assert (status, body) == (0, 0)
    status, body = raw.request(Op.BATCH_PUT_REVOKE, route, [b"w1", b"w2", b"nope", b"w1"])
    assert status == 0
    assert body == [0, 0, Status.OBJECT_NOT_FOUND, Status.OBJECT_NOT_FOUND]
    s = c.stats()
    assert s["allocated_bytes"] == MiB - 3 * 64 * KiB and s["pending_writes"] == 13
    assert not c.is_exist("w0")

    # The freed space takes new objects.
    for k in ("x", "y", "w0"):
        c.put(k, b"z" * (64 * KiB))
    assert c.get("w0") == b"z" * (64 * KiB)


def test_client_setup_retains_freed_heap_once_per_process() -> None:
    """ClientConfig.retain_heap_mb tunes glibc's malloc on the first setup only, and
    not at all when it is 0 or the environment already sets a threshold."""
    import os
    import subprocess
    import sys

    probe = ("from kvmaster._client.records import retain_heap; "
             "print(retain_heap(int(os.environ['MB'])), retain_heap(256))")
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def run(mb: int, **env: str) -> str:
        full = {**base, "MB": str(mb), **env}
        out = subprocess.run([sys.executable, "-c", "import os; " + probe], env=full,
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout.strip()

    assert run(256) == "True False"  # tuned once; the second call is a no-op
    assert run(0) == "False True"  # 0 leaves malloc alone (a later non-zero call tunes)
    assert run(256, MALLOC_TRIM_THRESHOLD_="131072") == "False False"


def test_batch_is_one_request_when_the_master_takes_any_shard(request, master, make_client) -> None:
    """An in-process master offers any-shard batches and the client sends a batch as
    one request; a master with shard processes does not, and the client fans out one
    request per shard. Results are the same either way."""
    c = make_client(master, segment_bytes=4 * MiB)
    in_process = not request.config.getoption("--shard-processes")
    assert c.welcome.any_shard is in_process
    keys = [f"one-request-{i}" for i in range(64)]
    shards_hit = {P.shard_of(k.encode(), c.welcome.seed, c.welcome.shard_count) for k in keys}
    assert len(shards_hit) == c.welcome.shard_count
    assert c.put_batch(keys, [b"x" * 100] * 64) == [0] * 64

    def requests() -> int:
        return c.stats()["requests"]

    before = requests()
    assert c.batch_is_exist([*keys, "missing"]) == [1] * 64 + [0]
    sent = requests() - before
    assert sent == (1 if in_process else len(shards_hit))
    assert c.get_batch(keys) == [b"x" * 100] * 64
    assert c.batch_remove(keys, force=True) == [0] * 64
    assert c.batch_is_exist(keys) == [0] * 64


def test_batch_keys_follow_the_single_key_type_rule(client) -> None:
    """Keys are str or bytes, exactly: a str subclass is refused by batches as by
    single-key calls (it would otherwise be stored under its encoded text)."""
    import enum

    class Color(str, enum.Enum):
        RED = "red"

    with pytest.raises(InvalidParams):
        client.is_exist(Color.RED)
    with pytest.raises(InvalidParams):
        client.batch_is_exist([Color.RED, "a"])
    assert client.batch_is_exist([b"raw", "text"]) == [0, 0]


def test_put_end_after_the_segment_owner_left_answers_segment_not_found(
        start_master, make_client, raw_factory) -> None:
    """A write placed in another client's segment, whose owner leaves (BYE) between
    PUT_START and PUT_END: the write is dropped with the segment, and its end (single,
    batch, upsert, tagged; and its revoke) answers SEGMENT_NOT_FOUND naming the segment,
    not OBJECT_NOT_FOUND.  Other clients, and keys never started, still get
    OBJECT_NOT_FOUND; a new write of the key clears the memory of the lost one."""
    m = start_master("--shards", "1")
    route = P.route_for_shard(0)
    owner = make_client(m, segment_bytes=4 * MiB)
    seg = owner.segment_name
    owner.put("k-up", b"old value")
    raw = raw_factory(m.endpoint, "writer")
    status, reps = raw.request(Op.PUT_START, route, b"k-single", 4096, None)
    assert status == 0 and reps[0][0] == seg
    status, reps = raw.request(Op.BATCH_PUT_START, route, [b"k-b1", b"k-b2"], [4096, 8192], None)
    assert status == 0 and [r[0][0] for r in reps] == [seg, seg]
    status, reps = raw.request(Op.UPSERT_START, route, b"k-up", 4096, None)
    assert status == 0 and reps[0][0] == seg
    status, reps = raw.request(Op.PUT_START_WITH_KV_SESSIONS, route, b"k-tag", 4096, None,
                               [b"sess"])
    assert status == 0 and reps[0][0] == seg
    status, reps = raw.request(Op.BATCH_UPSERT_START, route, [b"k-ub"], [4096], None)
    assert status == 0

    owner.close()  # BYE: the segment is unmounted with every write placed in it

    status, body = raw.request(Op.PUT_END, route, b"k-single")
    assert status == Status.SEGMENT_NOT_FOUND, (status, body)
    assert seg in body and "unmounted" in body and "\n" not in body
    # Asked again (a resend after a lost reply): the same answer.
    assert raw.request(Op.PUT_END, route, b"k-single")[0] == Status.SEGMENT_NOT_FOUND
    status, body = raw.request(Op.BATCH_PUT_END, route, [b"k-b1", b"never", b"k-b2"])
    assert status == 0
    assert body == [Status.SEGMENT_NOT_FOUND, Status.OBJECT_NOT_FOUND, Status.SEGMENT_NOT_FOUND]
    assert raw.request(Op.PUT_END, route, b"k-up")[0] == Status.SEGMENT_NOT_FOUND
    assert raw.request(Op.BATCH_PUT_END, route, [b"k-ub"])[1] == [Status.SEGMENT_NOT_FOUND]
    status, body = raw.request(Op.PUT_REVOKE, route, b"k-tag")
    assert status == Status.SEGMENT_NOT_FOUND, (status, body)
    # Never started: still OBJECT_NOT_FOUND.  Another client: not its write.
    assert raw.request(Op.PUT_END, route, b"never")[0] == Status.OBJECT_NOT_FOUND
    other = raw_factory(m.endpoint, "someone-else")
    assert other.request(Op.PUT_END, route, b"k-single")[0] == Status.OBJECT_NOT_FOUND

    # Nothing of the lost writes is stored, no membership is left, nothing leaks.
    watcher = make_client(m, segment_bytes=0)
    assert watcher.batch_is_exist(["k-single", "k-b1", "k-b2", "k-up", "k-tag", "k-ub"]) == [0] * 6
    s = watcher.stats()
    assert s["pending_writes"] == 0 and s["sessions"] == 0
    assert s["writes_dropped_with_segment"] == 6
    assert watcher.check_consistency() == []

    # A new write of the key (in a new segment) replaces the memory of the lost one.
    owner2 = make_client(m, segment_bytes=4 * MiB)
    status, reps = raw.request(Op.PUT_START, route, b"k-single", 4096, None)
    assert status == 0 and reps[0][0] == owner2.segment_name
    assert raw.request(Op.PUT_END, route, b"k-single") == (0, 0)
    assert raw.request(Op.PUT_END, route, b"k-single")[0] == Status.OBJECT_NOT_FOUND
    owner2.close()

    # The client API: the owner leaves once the writer has looked its segment up, so
    # the bytes go into a mapping of a segment the master no longer has.
    writer = make_client(m, segment_bytes=0)
    for call in ("put", "upsert", "put_batch", "upsert_batch"):
        owner3 = make_client(m, segment_bytes=4 * MiB)
        seg3 = owner3.segment_name
        local = writer._local

        def look_up_then_owner_leaves(name, local=local, owner3=owner3, seg3=seg3):
            mapping = local(name)
            assert name == seg3 and mapping is not None
            owner3.close()
            return mapping

        writer._local = look_up_then_owner_leaves
        try:
            if call in ("put", "upsert"):
                with pytest.raises(SegmentNotFound) as ei:
                    getattr(writer, call)(f"c-{call}", b"v" * 5000)
                assert ei.value.code == Status.SEGMENT_NOT_FOUND == -101
                assert seg3 in str(ei.value)
            else:
                assert getattr(writer, call)([f"c-{call}"], [b"v" * 5000]) == \
                    [Status.SEGMENT_NOT_FOUND]
        finally:
            del writer._local
        assert not watcher.is_exist(f"c-{call}")
    assert watcher.check_consistency() == []


def test_a_write_dropped_with_one_segment_keeps_its_other_replica_until_its_end(
        start_master, make_client, raw_factory) -> None:
    """A write with two replicas, in the segments of A and B, is dropped when A leaves
    before the writer has copied; the writer learns of it only at its PUT_END.  Its
    replica in B must stay allocated until then: it used to be freed at the unmount,
    the next write placed another key there, and the writer's late copy overwrote
    that key's bytes (a reviewer's threads-in-one-process stress: 5-68 reads per run
    of another key's bytes or garbage, with replica_num 2 and clients closing)."""
    m = start_master("--shards", "1")
    route = P.route_for_shard(0)
    a = make_client(m, segment_bytes=4 * MiB)
    b = make_client(m, segment_bytes=4 * MiB)
    seg_b = b.segment_name
    other = make_client(m, segment_bytes=0)
    raw = raw_factory(m.endpoint, "writer")
    size = 64 * KiB
    status, reps = raw.request(Op.PUT_START, route, b"w", size, [2, False, 0, None, []], 1)
    assert status == 0 and sorted(r[0] for r in reps) == sorted([a.segment_name, seg_b])
    off_b = next(off for name, off in reps if name == seg_b)

    a.close()  # BYE: the write is dropped with A's segment; the writer does not know yet

    victim = blob("victim", size)
    other.put("victim", victim, ReplicateConfig(preferred_segments=[seg_b]))
    (name, off), = other.query_key("victim")["replicas"]
    assert name == seg_b and not (off < off_b + size and off_b < off + size), \
        "the dropped write's replica was given to another key while its writer may copy"
    other._local(seg_b).buf[off_b:off_b + size] = b"W" * size  # the writer's late copy
    assert raw.request(Op.PUT_END, route, b"w", 1)[0] == Status.SEGMENT_NOT_FOUND
    assert other.get("victim") == victim
    assert other.check_consistency() == []

    # The end gave the range back: the next write of its size may take it.
    used = {s["name"]: s["allocated"] for s in other.list_segments()}[seg_b]
    assert used == align_up(size)
    # A revoke does too.
    c = make_client(m, segment_bytes=4 * MiB)
    status, reps = raw.request(Op.PUT_START, route, b"w2", size, [2, False, 0, None, []], 2)
    assert status == 0
    c.close()
    assert raw.request(Op.PUT_REVOKE, route, b"w2", 2)[0] == Status.SEGMENT_NOT_FOUND
    assert {s["name"]: s["allocated"] for s in other.list_segments()}[seg_b] == align_up(size)
    assert other.check_consistency() == []


def test_a_batch_read_of_an_object_whose_segment_file_went_answers_it_missing(
        start_master, make_client) -> None:
    """Between the master's answer to a batch read and the reader's mapping of a
    segment it has not mapped yet, the segment's owner may leave and its file go:
    that object is missing (None, OBJECT_NOT_FOUND, ObjectNotFound), the other
    positions are read as usual.  It used to fail the whole batch TRANSFER_FAIL
    ("no replica readable"), losing the positions that were readable."""
    import os

    m = start_master("--shards", "1")
    a = make_client(m, segment_bytes=MiB)
    b = make_client(m, segment_bytes=MiB)
    in_a, in_b = blob("in-a", 4 * KiB), blob("in-b", 4 * KiB)
    a.put("in-a", in_a, ReplicateConfig(preferred_segments=[a.segment_name]))
    a.put("in-b", in_b, ReplicateConfig(preferred_segments=[b.segment_name]))
    # b has not mapped a's segment; its file goes (as when a leaves) while the master
    # still lists it.
    os.unlink(os.path.join("/dev/shm", a.segment_name))
    assert b.get_batch(["in-a", "in-b", "never"]) == [None, in_b, None]
    bufs = [bytearray(4 * KiB), bytearray(4 * KiB)]
    assert b.batch_get_into(["in-a", "in-b"], bufs) == [Status.OBJECT_NOT_FOUND, 4 * KiB]
    assert bytes(bufs[1]) == in_b
    with pytest.raises(ObjectNotFound):
        b.get("in-a")
    assert b.get("in-b") == in_b


def test_a_write_into_a_segment_whose_file_went_answers_segment_not_found(
        start_master, make_client) -> None:
    """The segment a write was placed in loses its file before the writer maps it (its
    owner left after the start): the write is revoked and answered SEGMENT_NOT_FOUND
    (the answer its end gets when the master has already dropped it), not
    TRANSFER_FAIL; nothing is left pending, and writes elsewhere go on."""
    import os

    m = start_master("--shards", "1")
    a = make_client(m, segment_bytes=MiB)
    b = make_client(m, segment_bytes=MiB)
    os.unlink(os.path.join("/dev/shm", a.segment_name))
    in_a = ReplicateConfig(preferred_segments=[a.segment_name])
    with pytest.raises(SegmentNotFound):
        b.put("k", b"v" * 100, in_a)
    assert b.put_batch(["k1", "k2"], [b"1" * 100, b"2" * 100], in_a) == \
        [Status.SEGMENT_NOT_FOUND] * 2
    assert not any(b.batch_is_exist(["k", "k1", "k2"]))
    in_b = ReplicateConfig(preferred_segments=[b.segment_name])
    assert b.put_batch(["k3"], [b"3" * 100], in_b) == [0] and b.get("k3") == b"3" * 100
    assert b.stats()["pending_writes"] == 0 and b.check_consistency() == []


def test_values_are_stored_by_their_size_in_bytes_whatever_the_buffer(client) -> None:
    """put, put_batch, upsert and upsert_batch take any contiguous buffer and store its
    bytes (an ``array`` or a typed memoryview counts items in ``len``); a value that is
    not a contiguous buffer is InvalidParams before anything is sent, so no write is
    left pending."""
    import array

    from kvmaster import InvalidParams

    ints = array.array("i", range(1000))
    doubles = memoryview(array.array("d", [1.5] * 300))
    grid = memoryview(bytearray(range(256)) * 4).cast("B", (32, 32))
    values = [ints, doubles, grid, b"plain", bytearray(b"mutable")]
    expected = [ints.tobytes(), doubles.tobytes(), grid.tobytes(), b"plain", b"mutable"]
    keys = [f"buf-{i}" for i in range(len(values))]
    assert client.put_batch(keys, values) == [0] * len(values)
    assert client.get_batch(keys) == expected
    client.put("buf-one", ints)
    assert client.get("buf-one") == ints.tobytes()
    client.upsert("buf-one", doubles)
    assert client.get("buf-one") == doubles.tobytes()
    assert client.upsert_batch(keys[:2], [grid, ints]) == [0, 0]
    assert client.get_batch(keys[:2]) == [grid.tobytes(), ints.tobytes()]
    strided = memoryview(bytearray(100))[::2]
    released = memoryview(b"gone")
    released.release()
    for bad in ("text", None, strided, released):
        with pytest.raises(InvalidParams, match="not a contiguous bytes-like"):
            client.put_batch(["bad-a", "bad-b"], [b"ok", bad])
        with pytest.raises(InvalidParams, match="not a contiguous bytes-like"):
            client.put("bad-c", bad)
    with pytest.raises(InvalidParams, match="not a contiguous bytes-like"):
        client.put_from("bad-c", strided)
    with pytest.raises(InvalidParams, match="not a contiguous bytes-like"):
        client.batch_put_from(["bad-a"], [strided])
    client.put_from("buf-from", doubles)
    assert client.get("buf-from") == doubles.tobytes()
    assert client.batch_is_exist(["bad-a", "bad-b", "bad-c"]) == [0, 0, 0]
    assert client.stats()["pending_writes"] == 0
    assert client.check_consistency() == []


@pytest.mark.parametrize("multi", [True, False], ids=["one-message", "message-each"])
def test_calls_of_several_requests(master, make_client, multi) -> None:
    """A call of several requests (a batch split by shard, an op sent to every shard)
    sends them in one message to a protocol 1.2 master, and one message each to an
    older one (simulated by the WELCOME flag); the results are the same."""
    a = make_client(master, segment_bytes=8 * MiB)
    assert a.welcome.multi  # this master speaks 1.2
    a.welcome.multi = multi
    a.welcome.any_shard = False  # split batches by shard, as with shard processes
    before = a.stats()["front"]["multi_request_messages"]
    keys = [f"several-{i}" for i in range(40)]
    assert len({P.shard_of(k.encode(), a.welcome.seed, a.welcome.shard_count)
                for k in keys}) == a.welcome.shard_count
    vals = [blob(k, 300 + i) for i, k in enumerate(keys)]
    assert a.put_batch(keys, vals) == [0] * 40
    assert a.batch_is_exist([*keys, "several-x"]) == [1] * 40 + [0]
    assert a.get_batch(keys) == vals
    bufs = [bytearray(400) for _ in keys]
    assert a.batch_get_into(keys, bufs) == [len(v) for v in vals]
    assert a.batch_remove(keys[:10], force=True) == [0] * 10
    assert a.remove_all(force=True) == 30
    assert a.batch_is_exist(keys) == [0] * 40
    sent = a.stats()["front"]["multi_request_messages"] - before
    # put_batch (start, end), is_exist, get, get_into, remove, remove_all, is_exist
    assert sent == (8 if multi else 0)
    assert a.check_consistency() == []


@pytest.mark.parametrize("columns", [True, False], ids=["columnar", "per-key"])
def test_batches_read_both_reply_forms(master, make_client, columns) -> None:
    """Batch gets and starts ask a protocol 1.1 master for columnar replies; with a
    master that answers per key (1.0: WELCOME ``protocol`` [1, 0], simulated here)
    the client reads that form instead. Same results either way, for objects with
    one and two replicas, missing keys, repeats, and keys of every shard."""
    a = make_client(master, segment_bytes=8 * MiB)
    b = make_client(master, segment_bytes=8 * MiB)
    assert a.welcome.columns  # this master speaks 1.1
    a.welcome.columns = columns
    keys = [f"form-{i}" for i in range(24)]
    vals = [blob(k, 500 + i) for i, k in enumerate(keys)]
    assert a.put_batch(keys[:20], vals[:20]) == [0] * 20
    two = ReplicateConfig(replica_num=2)
    assert a.put_batch(keys[20:], vals[20:], two) == [0] * 4
    assert len(a.query_key(keys[21])["replicas"]) == 2
    assert a.put_batch(keys[:2], [b"other"] * 2) == [0, 0]  # write-once: kept
    probe = [*keys, "form-missing", keys[3], keys[22]]
    want = [*vals, None, vals[3], vals[22]]
    assert a.get_batch(probe) == want
    assert b.get_batch(probe) == want
    bufs = [bytearray(600) for _ in probe]
    got = a.batch_get_into(probe, bufs)
    assert got == [len(w) if w is not None else Status.OBJECT_NOT_FOUND for w in want]
    assert all(bytes(buf[:n]) == w for buf, n, w in zip(bufs, got, want) if w is not None)
    # the second replica serves the read once the first's segment is gone
    b.close()
    assert a.get_batch(keys[20:]) == vals[20:]


def test_preferred_segments_none_means_none(master, make_client) -> None:
    """``ReplicateConfig(preferred_segments=None)`` is taken as no preference, like
    ``kv_sessions=None`` (it raised TypeError; a new user's report)."""
    from kvmaster.compat import ReplicateConfig as MooncakeConfig

    c = make_client(master, segment_bytes=4 * MiB)
    c.put("pref-none", b"v" * 100, ReplicateConfig(preferred_segments=None))
    assert c.get("pref-none") == b"v" * 100
    facade = MooncakeConfig()
    facade.preferred_segments = None
    assert facade.to_wire()[4] == []


def test_a_batch_copy_that_fails_midway_goes_key_by_key(client) -> None:
    """put_batch copies a shard's keys straight into the local mapping of their segment;
    when a copy fails there (a mapping closed meanwhile), the keys go one by one through
    the general write path, and every key is stored with its own bytes."""
    real = client._local_seg
    failed: list[int] = []

    class Flaky:
        """The mapping, failing its fifth copy once."""

        def __init__(self, view: Any) -> None:
            self.view, self.copies = view, 0

        def __setitem__(self, where: slice, value: Any) -> None:
            self.copies += 1
            if self.copies == 5 and not failed:
                failed.append(self.copies)
                raise ValueError("mapping closed")
            self.view[where] = value

    class FlakySegment:
        """This client's own segment, its mapping flaky."""

        owner = True

        def __init__(self, seg: Any) -> None:
            self.buf, self.write = Flaky(seg.buf), seg.write

    client._local_seg = lambda name: FlakySegment(real(name))  # type: ignore[method-assign]
    try:
        keys = [f"flaky-{i}" for i in range(16)]
        values = [bytes([i]) * (100 + i) for i in range(16)]
        assert client.put_batch(keys, values) == [0] * 16
    finally:
        client._local_seg = real  # type: ignore[method-assign]
    assert failed == [5]
    assert client.get_batch(keys) == values


def test_a_key_given_twice_in_an_upsert_batch_keeps_its_last_value(client) -> None:
    """upsert_batch stores a repeated key once, with its last position's value and
    sessions, as the upserts one after another would leave the value; every position of
    it answers that write's status."""
    client.put("dup", b"old")
    keys = ["dup", "other", "dup", b"dup", "solo"]
    values = [b"A", b"O", b"B", b"C", b"S"]
    assert client.upsert_batch(keys, values) == [0] * 5
    assert client.get_batch(["dup", "other", "solo"]) == [b"C", b"O", b"S"]
    tags = [["s1"], [], ["s2"], ["s1", "s3"], ["s4"]]
    assert client.upsert_batch(keys, [b"x", b"y", b"z", b"w", b"v"],
                               ReplicateConfig(kv_sessions=tags)) == [0] * 5
    assert client.get("dup") == b"w"
    assert sorted(client.query_key("dup")["sessions"]) == [b"s1", b"s3"]
    assert client.query_key("other")["sessions"] == []
    with pytest.raises(InvalidParams):
        client.upsert_batch(["a", "a"], [b"1", b"2"], ReplicateConfig(kv_sessions=[["s"]]))


def test_an_upsert_batch_with_repeated_keys_checks_every_position_first(start_master,
                                                                         make_client) -> None:
    """Positions left out because their key repeats later are still checked, as in a
    batch without repeats: a key that is not str or bytes, an empty or non-buffer value,
    more positions than max_batch: InvalidParams, and nothing is stored."""
    m = start_master("--max-batch", "4")
    c = make_client(m)
    for keys, values in (([bytearray(b"k"), "k"], [b"1", b"2"]), ([["k"], "k"], [b"1", b"2"]),
                         (["k", "k"], [b"", b"x"]), (["k", "k"], ["text", b"x"]),
                         (["k", "a", "k", "b", "k"], [b"1"] * 5)):
        with pytest.raises(InvalidParams):
            c.upsert_batch(keys, values)
    assert c.batch_is_exist(["k", "a", "b"]) == [0, 0, 0]


def test_a_key_given_twice_in_a_put_batch_answers_as_its_first_write(start_master,
                                                                      make_client) -> None:
    """put_batch writes a repeated key once, from its first position, and every position
    of it answers that write's status: a refused first write is not reported stored at
    the later positions (which the master refuses OBJECT_ALREADY_EXISTS while the first
    is in progress)."""
    m = start_master("--kv-session-max-per-object", "1")
    c = make_client(m)
    assert c.put_batch(["p", "q", "p"], [b"1", b"2", b"3"]) == [0, 0, 0]
    assert c.get_batch(["p", "q"]) == [b"1", b"2"]
    tags = ReplicateConfig(kv_sessions=[["s1", "s2"], ["s3"]])  # the first: over the limit
    assert c.put_batch(["r", "r"], [b"A", b"B"], tags) == [Status.SESSION_LIMIT_EXCEEDED] * 2
    assert c.batch_is_exist(["r"]) == [0]
