"""Reads that end after their read lease (PROTOCOL.md section 13, step 4), against a
real master: a read whose copied bytes match the object's checksum stands, one that
could not be checked is discarded with LEASE_EXPIRED, and one that read space reused
once the lease ended fails LEASE_EXPIRED without reporting the replica corrupt.

The reader's pause between the master's grant and the end of its copy is real time
spent inside the reader's copy from the writer's segment (a wrapper around
:meth:`Segment.read` / :meth:`Segment.read_into` of attached segments that sleeps,
and may let the writer act, before copying)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvmaster import Client, ClientConfig, LeaseExpired
from kvmaster._segment import Segment

KiB = 1 << 10
SIZE = 64 * KiB
LEASE_MS = 300


@pytest.fixture
def pause(monkeypatch) -> Callable[..., None]:
    """``pause(then=None)``: the next copy from an attached (a peer's) segment first
    sleeps past the lease, then calls ``then()``, then copies."""
    armed: list[Callable[[], None] | None] = []
    read, read_into = Segment.read, Segment.read_into

    def stall(seg: Segment) -> None:
        if armed and not seg.owner:
            then = armed.pop()
            time.sleep(LEASE_MS / 1000 + 0.15)
            if then is not None:
                then()

    def slow_read(self: Segment, off: int, size: int) -> bytes:
        stall(self)
        return read(self, off, size)

    def slow_read_into(self: Segment, off: int, dst) -> None:
        stall(self)
        read_into(self, off, dst)

    monkeypatch.setattr(Segment, "read", slow_read)
    monkeypatch.setattr(Segment, "read_into", slow_read_into)

    def arm(then: Callable[[], None] | None = None) -> None:
        armed.append(then)
    return arm


@pytest.fixture
def pair(start_master, make_client):
    """A master with one shard and a writer whose segment holds one object (so space
    freed is the space reused), and a reader without a segment."""
    m = start_master("--shards", "1", "--eviction-high-watermark-ratio", "1.0",
                     "--default-kv-lease-ttl", str(LEASE_MS))
    writer = make_client(m, segment_bytes=SIZE)
    return m, writer, make_client


def test_a_late_read_checked_against_its_checksum_stands(pair, pause) -> None:
    m, writer, make_client = pair
    reader = make_client(m, segment_bytes=0)
    value = bytes(range(256)) * (SIZE // 256)
    writer.put("a", value)

    pause()
    assert reader.get("a") == value
    pause()
    assert reader.get_batch(["a", "none"]) == [value, None]
    dst = bytearray(SIZE)
    pause()
    assert reader.batch_get_into(["a"], [dst]) == [SIZE] and dst == value
    dst[:] = bytes(SIZE)
    pause()
    halves = memoryview(dst)
    assert reader.batch_get_into_parts(["a"], [[halves[:SIZE // 2], halves[SIZE // 2:]]]) \
        == [SIZE]
    assert dst == value
    assert reader.checksum_failures == 0


def test_a_late_read_without_a_checksum_is_discarded(pair, pause) -> None:
    m, writer, _ = pair
    reader = Client(ClientConfig(verify_checksums=False))
    reader.setup(m.addr, 0)
    try:
        _unchecked(writer, reader, pause)
    finally:
        reader.close()


def _unchecked(writer: Client, reader: Client, pause) -> None:
    writer.put("a", b"v" * SIZE)

    pause()
    with pytest.raises(LeaseExpired, match="outlived its lease"):
        reader.get("a")
    pause()
    with pytest.raises(LeaseExpired):
        reader.get_batch(["a"])
    pause()
    assert reader.batch_get_into(["a", "none"], [bytearray(SIZE)] * 2) == [-707, -704]
    # Within its lease the same read succeeds, and the reader keeps serving.
    assert reader.get("a") == b"v" * SIZE


def test_a_late_read_of_reused_space_fails_and_reports_nothing_corrupt(pair, pause) -> None:
    m, writer, make_client = pair
    reader = make_client(m, segment_bytes=0)
    writer.put("a", b"a" * SIZE)
    off = writer.query_key("a")["replicas"][0][1]

    def reuse(n=[0]) -> None:  # once the lease ended: "a" goes, "b<n>" takes its space
        writer.remove("a")
        key = f"b{n[0]}"
        writer.put(key, b"b" * SIZE)
        assert writer.query_key(key)["replicas"][0][1] == off
        n[0] += 1

    pause(reuse)
    with pytest.raises(LeaseExpired):
        reader.get("a")
    writer.remove("b0")
    writer.put("a", b"a" * SIZE)
    pause(reuse)
    assert reader.batch_get_into(["a"], [bytearray(SIZE)]) == [-707]
    writer.remove("b1")
    writer.put("a", b"a" * SIZE)
    pause(reuse)
    with pytest.raises(LeaseExpired):  # not None: "a" was there when its lease was given
        reader.get_batch(["a"])

    # The objects that took the space were not reported corrupt: still whole, still there.
    assert reader.checksum_failures == 0
    assert writer.get("b2") == b"b" * SIZE
    assert reader.get("b2") == b"b" * SIZE
    assert len(writer.query_key("b2")["replicas"]) == 1
