"""Client liveness in three states (``--client-suspicion-ttl``): a client silent past
``--client-ttl`` is suspected (its objects stay readable, no new write goes to its
segments), comes back with everything if heard from in time, and is expired only past
both TTLs.  Real master, a real owner process stopped with SIGSTOP, real segments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from kvmaster import ReplicateConfig
from kvmaster import errors as E
from tests.support import wait_until

MiB = 1 << 20
N = 20


def value(i: int) -> bytes:
    return bytes([i % 251]) * 4096 + str(i).encode()


class Owner:
    """A client process with a 4 MiB segment holding N objects ``own-<i>``."""

    def __init__(self, addr: str) -> None:
        code = textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {os.getcwd()!r})
            from kvmaster import Client, ReplicateConfig
            c = Client()
            c.setup({addr!r}, 4 << 20)
            cfg = ReplicateConfig(preferred_segments=[c.segment_name])
            for i in range({N}):
                c.put(f"own-{{i}}", bytes([i % 251]) * 4096 + str(i).encode(), cfg)
            print(c.client_id, c.segment_name, flush=True)
            sys.stdin.read()  # until the test closes stdin
            c.close()
        """)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        assert len(line) == 2, "the owner did not start"
        self.client_id, self.segment = line

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> int:
        self.resume()
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            return self.proc.wait(30)
        finally:
            self.proc.stdout.close()


@pytest.fixture
def owner_world(start_master, make_client):
    m = start_master("--client-ttl", "0.6", "--client-suspicion-ttl", "4")
    owner = Owner(m.addr)
    other = make_client(m, segment_bytes=4 * MiB)  # a second segment, on the same host
    reader = make_client(m, segment_bytes=0)
    yield m, owner, other, reader
    owner.close()


def state(c: Any, client_id: str) -> dict[str, Any] | None:
    return next((x for x in c.list_clients() if x["client_id"] == client_id), None)


def segment_of(c: Any, key: str) -> str:
    return c.query_key(key)["replicas"][0][0]


def test_a_silent_client_is_suspected_keeps_its_objects_and_comes_back(owner_world) -> None:
    m, owner, other, reader = owner_world
    assert state(reader, owner.client_id)["suspected"] is False
    owner.stop()
    wait_until(lambda: state(reader, owner.client_id)["suspected"], 3, "the owner suspected")
    # Its objects stay readable, exactly.
    assert [reader.get(f"own-{i}") for i in range(N)] == [value(i) for i in range(N)]
    # New writes go elsewhere, even those that ask for its segment.
    prefer = ReplicateConfig(preferred_segments=[owner.segment])
    for i in range(10):
        reader.put(f"new-{i}", value(i), prefer)
        assert segment_of(reader, f"new-{i}") == other.segment_name
    stats = reader.stats()["front"]
    assert stats["clients_suspected"] == 1 and stats["clients_expired"] == 0
    # Heard from again: active, with everything, and its segment takes writes again.
    owner.resume()
    wait_until(lambda: not state(reader, owner.client_id)["suspected"], 3, "the owner back")
    assert [reader.get(f"own-{i}") for i in range(N)] == [value(i) for i in range(N)]
    reader.put("after", value(99), prefer)
    assert segment_of(reader, "after") == owner.segment
    assert reader.stats()["front"]["clients_recovered"] == 1
    assert reader.check_consistency() == []


def test_a_client_silent_past_both_ttls_is_expired(owner_world) -> None:
    m, owner, other, reader = owner_world
    owner.stop()
    wait_until(lambda: state(reader, owner.client_id) is None, 10, "the owner expired")
    with pytest.raises(E.ObjectNotFound):
        reader.get("own-0")
    stats = reader.stats()["front"]
    assert stats["clients_suspected"] == 1 and stats["clients_expired"] == 1
    assert reader.check_consistency() == []


def test_without_a_suspicion_ttl_a_silent_client_is_expired_at_its_ttl(start_master,
                                                                      make_client) -> None:
    m = start_master("--client-ttl", "0.6")
    owner = Owner(m.addr)
    reader = make_client(m, segment_bytes=0)
    try:
        owner.stop()
        t0 = time.monotonic()
        wait_until(lambda: state(reader, owner.client_id) is None, 5, "the owner expired")
        assert time.monotonic() - t0 < 4  # (not held for a suspicion it was not given)
        assert reader.stats()["front"]["clients_suspected"] == 0
    finally:
        owner.close()


def test_the_shards_neither_place_on_nor_evict_from_a_suspected_segment() -> None:
    """One shard actor: a suspected segment leaves its tenant's pool (no placement;
    the pool's capacity counts the others) and eviction passes over its objects."""
    from kvmaster import protocol as P
    from kvmaster._shard import ClientView, ShardActor
    from kvmaster.config import MasterConfig

    cfg = MasterConfig(client_suspicion_ttl=5.0, eviction_high_watermark_ratio=1.0)
    shard = ShardActor(0, 1, cfg, lambda *a: None)
    me = ClientView("c1", P.DEFAULT_TENANT, b"id1")
    shard.mount_segment("a", "c1", 1 << 20)
    shard.mount_segment("b", "c2", 1 << 20)
    now = time.monotonic()
    config = P.ReplicateConfigWire()
    # Fill "a" (preferred) with objects, then suspect it.
    for i in range(8):
        r = shard._start_one(me, f"a{i}".encode(), 64 << 10,
                             P.ReplicateConfigWire(preferred_segments=("a",)), now, False)
        assert r[0][0] == "a"
        shard.ends.end_one(me, f"a{i}".encode(), now)
    assert shard.suspect_segments(["a", "zz"], True) == 1
    pool = shard.tenancy.pool(b"")
    assert set(pool.segments) == {"b"} and pool.capacity == shard.segments["b"].alloc.size
    # Writes fill "b" and then evict; none lands on "a", none of "a"'s objects goes.
    for i in range(40):
        r = shard._start_one(me, f"b{i}".encode(), 64 << 10, config, now, False)
        assert type(r) is list and r[0][0] == "b", r
        shard.ends.end_one(me, f"b{i}".encode(), now)
    assert all(f"a{i}".encode() in shard.objects for i in range(8))
    assert shard.counters["evicted_keys"] > 0
    shard.suspect_segments(["a"], False)
    assert set(shard.tenancy.pool(b"").segments) == {"a", "b"}


# ------------------------------------------------------------------ one shard actor

K = 64 << 10


def _shard(**kw: Any) -> tuple[Any, Any]:
    from kvmaster import protocol as P
    from kvmaster._shard import ClientView, ShardActor
    from kvmaster.config import MasterConfig

    cfg = MasterConfig(client_suspicion_ttl=30.0, eviction_high_watermark_ratio=1.0, **kw)
    shard = ShardActor(0, 1, cfg, lambda *a: None)
    shard.mount_segment("a", "c1", 512 << 10)
    shard.mount_segment("b", "c2", 512 << 10)
    return shard, ClientView("c1", P.DEFAULT_TENANT, b"id1")


def _put(shard: Any, me: Any, key: bytes, now: float, cfg: Any = None) -> Any:
    from kvmaster import protocol as P

    r = shard._start_one(me, key, K, cfg or P.ReplicateConfigWire(), now, False)
    if type(r) is list:
        assert shard.ends.end_one(me, key, now) == 0
    return r


def test_objects_passed_over_while_suspected_are_evictable_again_once_back() -> None:
    """Eviction passed over a suspected segment's objects; its client back, they are
    in the eviction order again at their places (oldest first), not held on a timer."""
    from kvmaster import protocol as P

    shard, me = _shard()
    now = time.monotonic()
    on_a = P.ReplicateConfigWire(preferred_segments=("a",))
    for i in range(8):
        assert _put(shard, me, f"a{i}".encode(), now, on_a)[0][0] == "a"
    shard.suspect_segments(["a"], True)
    for i in range(9):  # fills b; the 9th evicts b0, passing over a's objects
        assert type(_put(shard, me, f"b{i}".encode(), now + 0.001 * i)) is list
    assert all(f"a{i}".encode() in shard.objects for i in range(8))
    shard.suspect_segments(["a"], False)
    assert type(_put(shard, me, b"x", now + 1)) is list
    assert b"a0" not in shard.objects  # the least recent goes first again
    shard.unmount_segment("b")  # with only a left, full of evictable objects
    assert type(_put(shard, me, b"after", now + 2)) is list
    assert shard.check_consistency() == []


def test_an_object_with_a_replica_elsewhere_is_still_evictable() -> None:
    """An object whose first replica is on a suspected segment and another on a live
    one frees live space when evicted: eviction takes it."""
    from kvmaster import protocol as P

    shard, me = _shard()
    now = time.monotonic()
    two = P.ReplicateConfigWire(replica_num=2, preferred_segments=("a",))
    for i in range(8):
        assert [s for s, _ in _put(shard, me, f"k{i}".encode(), now, two)] == ["a", "b"]
    shard.suspect_segments(["a"], True)
    assert type(_put(shard, me, b"new", now + 1)) is list
    assert shard.counters["evicted_keys"] >= 1


def test_a_group_evicted_elsewhere_leaves_its_member_on_a_suspected_segment() -> None:
    """Key groups: pressure evicts ``gb`` (on b); its group's other member ``ga``, on a
    suspected segment, stays (eviction passes over it, as over any of its objects)."""
    import msgpack

    from kvmaster import protocol as P
    from kvmaster.protocol import Op

    shard, me = _shard(shards=1)
    shard.peers = [shard]
    replies: dict[int, Any] = {}
    shard.reply = lambda identity, op, payload, group: replies.__setitem__(
        *(lambda r: (r[0], r[1:]))(P.decode_reply(payload)))
    seq = iter(range(1, 1000))

    def call(op: Op, *fields: Any) -> Any:
        req = next(seq)
        shard.deliver((op.value, msgpack.packb([req, *fields], use_bin_type=True), me))
        while shard.inbox:
            shard.drain()
        return replies.pop(req)

    for key, seg in ((b"ga", "a"), (b"gb", "b")):
        st, body = call(Op.BATCH_PUT_START, [key], [K], [1, False, 0, None, [seg]], None,
                        False, [b"g1"], None)
        assert st == 0 and body[0][0][0] == seg, body
    assert call(Op.BATCH_PUT_END, [b"ga", b"gb"], None)[1] == [0, 0]
    shard.suspect_segments(["a"], True)
    for i in range(8):  # fills b: gb, the oldest there, goes
        call(Op.BATCH_PUT_START, [b"x%d" % i], [K], None, None, False, None, None)
        call(Op.BATCH_PUT_END, [b"x%d" % i], None)
    assert b"gb" not in shard.objects and b"ga" in shard.objects


def test_a_client_paused_under_load_loses_nothing_and_takes_no_new_writes(owner_world,
                                                                           make_client) -> None:
    """While the owner is stopped past its active TTL (within the suspicion TTL), two
    other clients keep writing (more than the other segment holds: eviction makes room)
    and reading the owner's objects: every call succeeds, no write lands on the owner's
    segment, its objects stay exact, and it serves again after SIGCONT."""
    import threading

    m, owner, other, reader = owner_world
    writers = [make_client(m, segment_bytes=0) for _ in range(2)]
    owner.stop()
    wait_until(lambda: state(reader, owner.client_id)["suspected"], 3, "the owner suspected")
    stop = threading.Event()
    placed: list[str] = []
    errors: list[str] = []

    def load(c: Any, tag: str) -> None:
        n = 0
        while not stop.is_set():
            key = f"{tag}-{n}"
            try:
                c.put(key, value(n))  # (no read of it: no lease, so eviction makes room)
                placed.append(segment_of(c, key))
                if c.get(f"own-{n % N}") != value(n % N):  # the owner's, while it is stopped
                    errors.append(f"own-{n % N}: other bytes")
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                errors.append(f"{key}: {exc!r}")
            n += 1

    threads = [threading.Thread(target=load, args=(c, f"load{i}")) for i, c in
               enumerate(writers)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # (the owner stays suspected: its suspicion TTL is 4 s)
    stop.set()
    for t in threads:
        t.join(10)
    assert state(reader, owner.client_id)["suspected"] is True
    assert not errors, errors[:3]
    assert len(placed) > 50 and owner.segment not in placed
    assert [reader.get(f"own-{i}") for i in range(N)] == [value(i) for i in range(N)]
    owner.resume()
    wait_until(lambda: not state(reader, owner.client_id)["suspected"], 3, "the owner back")
    assert [reader.get(f"own-{i}") for i in range(N)] == [value(i) for i in range(N)]
    assert reader.check_consistency() == []
