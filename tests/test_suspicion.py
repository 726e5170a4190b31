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
        shard._end_one(me, f"a{i}".encode(), now)
    assert shard.suspect_segments(["a", "zz"], True) == 1
    pool = shard.tenancy.pool(b"")
    assert set(pool.segments) == {"b"} and pool.capacity == shard.segments["b"].alloc.size
    # Writes fill "b" and then evict; none lands on "a", none of "a"'s objects goes.
    for i in range(40):
        r = shard._start_one(me, f"b{i}".encode(), 64 << 10, config, now, False)
        assert type(r) is list and r[0][0] == "b", r
        shard._end_one(me, f"b{i}".encode(), now)
    assert all(f"a{i}".encode() in shard.objects for i in range(8))
    assert shard.counters["evicted_keys"] > 0
    shard.suspect_segments(["a"], False)
    assert set(shard.tenancy.pool(b"").segments) == {"a", "b"}
