"""Write fencing: the space of a write the master gave up on is never given to another
object while its writer may still copy into it, and the space of writers that left
comes back at once (RELIABILITY.md, "Write fencing").

Real master processes and real writer processes (spawned, stopped and killed by pid);
the shard-level tests at the end call a shard actor directly.  A paused writer is
stopped at a block boundary of its copy loop, deterministically, by wrapping the clock
the loop reads before each block (``kvmaster._fence.clock``, which still returns the
real time): the process stops inside that read, and the check that follows sees the
time after it resumed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import psutil
import pytest
from test_shard_unit import Harness

from kvmaster import Client, LeaseExpired, NoAvailableHandle, ReplicateConfig
from kvmaster import protocol as P
from kvmaster._alloc import align_up
from kvmaster.protocol import Op, Status

KiB = 1 << 10
MiB = 1 << 20
CTX = mp.get_context("spawn")


def wait_until(pred, timeout: float, what: str, step: float = 0.02) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def other_value(key: str, size: int) -> bytes:
    body = (key.encode() + b"|") * (size // (len(key) + 1) + 1)
    return body[:size]


class Child:
    """A spawned process running ``_role_<name>(conn, *args)`` of this module."""

    def __init__(self, role: str, *args: Any) -> None:
        self.conn, end = CTX.Pipe()
        self.proc = CTX.Process(target=_child_main, args=(end, role, args), daemon=True)
        self.proc.start()
        end.close()
        self.pid = self.proc.pid

    def recv(self, timeout: float = 60.0) -> Any:
        assert self.conn.poll(timeout), f"child {self.pid} did not report within {timeout} s"
        msg = self.conn.recv()
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            raise AssertionError(f"child {self.pid} failed: {msg[1]}")
        return msg

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def stopped(self) -> bool:
        return psutil.Process(self.pid).status() == psutil.STATUS_STOPPED

    def cleanup(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.join(10)
        self.conn.close()


def _child_main(conn: Any, role: str, args: tuple[Any, ...]) -> None:
    try:
        globals()[f"_role_{role}"](conn, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        try:
            conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
        except OSError:
            pass


# ------------------------------------------------------------------ child roles


def _role_paused_writer(conn: Any, addr: str, keys: list[str], size: int, stop_at: int) -> None:
    """put_batch of ``keys`` (0xEE bytes), stopping itself (SIGSTOP) right before copying
    block ``stop_at``; reports how the call ended."""
    from kvmaster import _fence

    c = Client()
    c.setup(addr, 0, timeout_s=10.0)
    real = _fence.clock
    reads = [0]

    def clock() -> float:
        reads[0] += 1
        if reads[0] == stop_at:
            conn.send(("stopping", stop_at))
            os.kill(os.getpid(), signal.SIGSTOP)
        return real()

    _fence.clock = clock
    try:
        out = c.put_batch(keys, [b"\xee" * size] * len(keys))
        conn.send(("returned", out))
    except Exception as exc:  # noqa: BLE001 - the outcome is the report
        conn.send(("raised", type(exc).__name__, getattr(exc, "code", None), str(exc)))
    finally:
        _fence.clock = real
    conn.recv()
    c.close()


def _role_pending_writer(conn: Any, addr: str, keys: list[str], size: int) -> None:
    """batch_put_start, then (told to) wait for a re-handshake and copy a range."""
    c = Client()
    c.setup(addr, 0, timeout_s=10.0)
    pending = c.batch_put_start(keys, [size] * len(keys))
    assert list(pending.status) == [0] * len(keys)
    conn.send(("started", c.reconnect_count))
    conn.recv()
    wait_until(lambda: c.reconnect_count > 0, 20, "the heartbeat to re-handshake")
    try:
        out = c.batch_write_ranges(pending, [0], [[(0, b"\xee" * size)]])
        conn.send(("returned", out))
    except Exception as exc:  # noqa: BLE001
        conn.send(("raised", type(exc).__name__, getattr(exc, "code", None), str(exc)))
    conn.recv()
    c.close()


def _role_abandoner(conn: Any, addr: str, keys: list[str], size: int) -> None:
    """Start writes of ``keys`` and never copy, end or revoke them; wait to be killed."""
    c = Client()
    c.setup(addr, 0, timeout_s=20.0)
    pending = c.batch_put_start(keys, [size] * len(keys))
    conn.send(("started", list(pending.status)))
    conn.recv()


# ------------------------------------------------------------------------ tests


def test_a_paused_writer_resuming_after_its_expiry_copies_nothing(start_master,
                                                                  make_client) -> None:
    """The attack: a writer stopped mid-copy past every timeout resumes and writes into
    space released and reused meanwhile (673 of another client's objects read back its
    bytes).  Now: the stopped writer is expired after --client-ttl and its writes'
    space freed (not held for the release timeout); another client fills that space
    and reads it back; the writer resumes, sees its fence passed before its next block,
    copies nothing more and fails with LeaseExpired; every object of the other client
    reads back intact.  (The writer stops at a block boundary here; one stopped in the
    middle of a block finishes that block when it resumes: RELIABILITY.md.)"""
    m = start_master("--shards", "1", "--client-ttl", "1", "--put-start-discard-timeout", "1",
                     "--put-start-release-timeout", "2", "--master-segment-size", str(40 * MiB),
                     "--eviction-high-watermark-ratio", "1.0")
    size = 256 * KiB
    keys = [f"w{i}" for i in range(128)]  # 32 MiB
    w = Child("paused_writer", m.addr, keys, size, 6)
    try:
        assert w.recv()[0] == "stopping"
        wait_until(w.stopped, 10, "the writer to stop")
        obs = make_client(m, segment_bytes=0)
        wait_until(lambda: obs.stats()["clients"] == 1, 10, "the stopped writer to expire")
        s = obs.stats()
        assert s["pending_writes"] == 0 and s["allocated_bytes"] == 0
        assert s["writes_dropped_with_writer"] == len(keys) and s["put_start_released"] == 0

        mine = [f"o{i}" for i in range(128)]
        assert obs.put_batch(mine, [other_value(k, size) for k in mine]) == [0] * len(mine)
        offsets = [obs.query_key(k)["replicas"][0][1] for k in mine]
        assert min(offsets) < len(keys) * size  # in the range the writer was given
        assert all(v == other_value(k, size) for k, v in zip(mine, obs.get_batch(mine)))

        os.kill(w.pid, signal.SIGCONT)
        kind, *how = w.recv()
        assert kind == "raised" and how[0] == "LeaseExpired" and how[1] == Status.LEASE_EXPIRED, \
            (kind, how)
        wrong = [k for k, v in zip(mine, obs.get_batch(mine)) if v != other_value(k, size)]
        assert wrong == []
        w.send("close")
        w.proc.join(20)
        assert w.proc.exitcode == 0
        assert obs.batch_is_exist(keys) == [0] * len(keys)
        s = obs.stats()
        assert s["allocated_bytes"] == len(mine) * align_up(size) and s["pending_writes"] == 0
        assert obs.check_consistency() == []
    finally:
        w.cleanup()


def test_a_pending_write_across_an_expiry_and_rehandshake_is_not_copied(start_master,
                                                                        make_client) -> None:
    """batch_put_start, then the writer is stopped past --client-ttl (expired: its
    writes dropped and freed) and resumes; its heartbeat re-handshakes, which makes its
    liveness fresh again, but the writes started on the old registration are fenced:
    batch_write_ranges copies nothing and raises LeaseExpired."""
    m = start_master("--shards", "1", "--client-ttl", "1", "--master-segment-size", str(8 * MiB))
    obs = make_client(m, segment_bytes=0)
    w = Child("pending_writer", m.addr, ["p0", "p1"], 64 * KiB)
    try:
        assert w.recv() == ("started", 0)
        assert obs.stats()["pending_writes"] == 2
        os.kill(w.pid, signal.SIGSTOP)
        wait_until(lambda: obs.stats()["clients"] == 1, 10, "the stopped writer to expire")
        assert obs.stats()["allocated_bytes"] == 0
        os.kill(w.pid, signal.SIGCONT)
        w.send("write")
        kind, *how = w.recv()
        assert kind == "raised" and how[0] == "LeaseExpired", (kind, how)
        assert "re-registered" in how[2]
        w.send("close")
        w.proc.join(20)
        assert obs.stats()["pending_writes"] == 0 and obs.check_consistency() == []
    finally:
        w.cleanup()


def test_a_client_without_a_segment_holding_abandoned_writes_frees_them_at_bye(
        start_master, make_client) -> None:
    """The attack: a client with no segment reserved 71 of 72 MiB with abandoned writes,
    and after its BYE every other put failed NO_AVAILABLE_HANDLE for the release
    timeout.  Now its writes hold the space while it is registered (past the release
    timeout too: they are dropped then, their space quarantined), and its BYE frees
    all of it at once."""
    m = start_master("--shards", "1", "--master-segment-size", str(72 * MiB),
                     "--put-start-discard-timeout", "0.5", "--put-start-release-timeout", "1",
                     "--eviction-high-watermark-ratio", "1.0")
    hog = make_client(m, segment_bytes=0)
    other = make_client(m, segment_bytes=0)
    keys = [f"hog{i}" for i in range(71)]
    pending = hog.batch_put_start(keys, [MiB] * len(keys))
    assert list(pending.status) == [0] * len(keys)
    with pytest.raises(NoAvailableHandle):
        other.put("big", b"x" * (8 * MiB))
    # Past the release timeout the writes are dropped, but their writer is registered:
    # the space stays held.
    wait_until(lambda: other.stats()["put_start_released"] == len(keys), 10,
               "the release timeout")
    s = other.stats()
    assert s["pending_writes"] == 0 and s["allocated_bytes"] == len(keys) * MiB
    assert s["given_up_writes"] == len(keys)
    with pytest.raises(NoAvailableHandle):
        other.put("big", b"x" * (8 * MiB))
    hog.close()
    mine = [f"o{i}" for i in range(64)]
    assert other.put_batch(mine, [other_value(k, MiB) for k in mine]) == [0] * len(mine)
    assert all(v == other_value(k, MiB) for k, v in zip(mine, other.get_batch(mine)))
    s = other.stats()
    assert s["stranded_writes_freed_with_writer"] == len(keys) and s["given_up_writes"] == 0
    assert s["allocated_bytes"] == len(mine) * MiB
    assert other.check_consistency() == []


def test_killed_writers_space_comes_back_at_their_expiry(start_master, make_client) -> None:
    """The attack: 20 killed writers left 832 writes holding 208 of 256 MiB until the
    release timeout (600 s).  Now it comes back when they are expired (--client-ttl),
    with the release timeout left at its default."""
    m = start_master("--client-ttl", "1", "--master-segment-size", str(64 * MiB),
                     "--eviction-high-watermark-ratio", "1.0")
    obs = make_client(m, segment_bytes=0)
    writers = [Child("abandoner", m.addr, [f"k{j}-{i}" for i in range(10)], 256 * KiB)
               for j in range(20)]
    try:
        for w in writers:
            kind, status = w.recv()
            assert kind == "started" and status == [0] * 10
        s = obs.stats()
        assert s["pending_writes"] == 200 and s["allocated_bytes"] == 200 * 256 * KiB
        for w in writers:
            os.kill(w.pid, signal.SIGKILL)
        wait_until(lambda: obs.stats()["allocated_bytes"] == 0, 60,
                   "the killed writers' space to come back")
        s = obs.stats()
        assert s["pending_writes"] == 0 and s["writes_dropped_with_writer"] == 200
        assert s["put_start_released"] == 0 and s["clients"] == 1
        mine = [f"o{i}" for i in range(200)]
        assert obs.put_batch(mine, [other_value(k, 256 * KiB) for k in mine]) == [0] * 200
        assert obs.check_consistency() == []
    finally:
        for w in writers:
            w.cleanup()


def test_a_put_copying_past_its_release_timeout_stops_and_revokes(start_master,
                                                                   make_client) -> None:
    """A writer that stays registered (its own client heartbeats between calls) but
    whose copy runs past the master's --put-start-release-timeout: it stops before the
    next block, revokes, raises LeaseExpired; nothing is stored and no space is held."""
    m = start_master("--shards", "1", "--put-start-release-timeout", "1",
                     "--master-segment-size", str(8 * MiB))
    obs = make_client(m, segment_bytes=0)
    # (8 x 256 KiB into the master's segment, a peer's: one pwritev run, one check)
    w = Child("paused_writer", m.addr, [f"r{i}" for i in range(8)], 256 * KiB, 1)
    try:
        assert w.recv()[0] == "stopping"
        wait_until(w.stopped, 10, "the writer to stop")
        wait_until(lambda: obs.stats()["put_start_released"] == 8, 10, "the release timeout")
        assert obs.stats()["allocated_bytes"] == 8 * align_up(256 * KiB)  # held: registered
        os.kill(w.pid, signal.SIGCONT)
        kind, *how = w.recv()
        assert kind == "raised" and how[0] == "LeaseExpired", (kind, how)
        assert "release-timeout" in how[2]
        # Its revoke acknowledged the writes: their space is back.
        wait_until(lambda: obs.stats()["allocated_bytes"] == 0, 10, "the revoke")
        assert obs.batch_is_exist([f"r{i}" for i in range(8)]) == [0] * 8
        w.send("close")
        w.proc.join(20)
        assert obs.check_consistency() == []
    finally:
        w.cleanup()


# ------------------------------------------------------- shard actor, called directly


def test_a_taken_over_write_keeps_its_space_until_its_writer_is_done_or_gone(
        monkeypatch) -> None:
    """After the discard timeout another writer takes the key over; the old write's
    range stays allocated (not freed at the release timeout) until its writer ends or
    revokes it, or leaves."""
    from kvmaster import _shard
    from kvmaster._shard import ClientView

    clock = [1000.0]
    monkeypatch.setattr(_shard, "_monotonic", lambda: clock[0])
    for finish in ("revoke", "end", "gone"):
        h = Harness(1, eviction_high_watermark_ratio=1.0, put_start_discard_timeout=1.0,
                    put_start_release_timeout=2.0)
        shard = h.shards[0]
        shard.mount_segment("seg", "s", 1 << 20)
        a, b = h.client, ClientView("c2", "default", b"id-2")
        st, reps = h.call(Op.PUT_START, b"k", b"k", 4096, None, 1)
        assert st == 0 and reps == [["seg", 0]]
        h.client = b
        st, _ = h.call(Op.PUT_START, b"k", b"k", 4096, None, 1)
        assert st == Status.OBJECT_ALREADY_EXISTS
        clock[0] += 1.5  # past the discard timeout
        st, reps = h.call(Op.PUT_START, b"k", b"k", 4096, None, 1)
        assert st == 0 and reps == [["seg", 4096]]  # not the old range
        assert h.call(Op.PUT_END, b"k", b"k", 1) == (0, 0)
        clock[0] += 100.0
        shard.tick()
        assert shard.segments["seg"].alloc.used == 2 * 4096  # still held
        assert not shard.check_consistency()
        h.client = a
        if finish == "revoke":
            assert h.call(Op.PUT_REVOKE, b"k", b"k", 1)[0] == Status.OBJECT_NOT_FOUND
        elif finish == "end":
            assert h.call(Op.PUT_END, b"k", b"k", 1)[0] == Status.OBJECT_NOT_FOUND
        else:
            shard.client_gone("c1")
        assert shard.segments["seg"].alloc.used == 4096, finish
        assert not shard.stranded and not shard.check_consistency()
        assert h.call(Op.GET_SIZE, b"k", b"k")[1] == 4096


def test_a_writer_leaving_drops_its_writes_and_frees_their_space() -> None:
    """client_gone (BYE or expiry) drops the writer's writes in progress (tagged ones
    included: their memberships go) and frees their space at once; other writers'
    writes stay."""
    h = Harness(2, eviction_high_watermark_ratio=1.0)
    h.mount("seg", 1 << 20)
    tagged = [1, False, 0, None, []]
    assert h.call(Op.PUT_START_WITH_KV_SESSIONS, b"t", b"t", 1000, tagged, [b"s1"], 1)[0] == 0
    assert h.call(Op.PUT_START, b"u", b"u", 1000, None, 1)[0] == 0
    from kvmaster._shard import ClientView

    me, h.client = h.client, ClientView("c2", "default", b"id-2")
    assert h.call(Op.PUT_START, b"v", b"v", 1000, None, 1)[0] == 0
    h.client = me
    for s in h.shards:
        s.post("client_gone", ("c1",))  # as the front tells them
    h.run()
    assert sum(len(s.writes) for s in h.shards) == 1
    assert sum(s.used for s in h.shards) == align_up(1000)
    assert sum(s.counters["writes_dropped_with_writer"] for s in h.shards) == 2
    assert all(not s.check_consistency() for s in h.shards)
    assert not any(s.sessions for s in h.shards)  # the membership went


def test_writes_per_client_are_bounded() -> None:
    """--max-writes-per-client bounds a client's write records (writes in progress plus
    given-up ones held): starts beyond answer NO_AVAILABLE_HANDLE, other clients are not
    limited, and an end makes room again."""
    h = Harness(1, eviction_high_watermark_ratio=1.0, max_writes_per_client=4)
    h.mount("seg", 1 << 20)
    keys = [f"k{i}".encode() for i in range(6)]
    st, body = h.call(Op.BATCH_PUT_START, keys[0], keys, [100] * 6, None, 1)
    assert st == 0
    assert [type(r) is list for r in body] == [True] * 4 + [False] * 2
    assert body[4:] == [Status.NO_AVAILABLE_HANDLE] * 2
    assert h.call(Op.PUT_START, b"x", b"x", 100, None, 2)[0] == Status.NO_AVAILABLE_HANDLE
    from kvmaster._shard import ClientView

    me, h.client = h.client, ClientView("c2", "default", b"id-2")
    assert h.call(Op.PUT_START, b"y", b"y", 100, None, 1)[0] == 0
    h.client = me
    assert h.call(Op.BATCH_PUT_END, keys[0], keys[:1], 1) == (0, [0])
    assert h.call(Op.PUT_START, b"x", b"x", 100, None, 2)[0] == 0
    shard = h.shards[0]
    assert shard.counters["write_limit_rejections"] == 3
    assert shard.writers.held == {"c1": 4, "c2": 1} and not shard.check_consistency()


def test_the_welcome_tells_the_release_timeout(start_master, make_client) -> None:
    """WELCOME carries put_start_release_timeout_ms (the client's write fence uses it)."""
    m = start_master("--put-start-release-timeout", "2.5")
    c = make_client(m, segment_bytes=0)
    assert c.welcome.release_s == 2.5
    body = c._call(Op.HELLO.value, P.MASTER_ROUTE, c._hello_fields())
    assert body["put_start_release_timeout_ms"] == 2500


def test_writes_into_own_segment_are_fenced_too(start_master, make_client) -> None:
    """A put whose copy would start past its fence (here: a client TTL already spent
    before the copy, by a clock that jumps) is revoked and raises LeaseExpired, with
    nothing stored; the next put succeeds."""
    from kvmaster import _fence

    m = start_master("--client-ttl", "2")
    c = make_client(m, segment_bytes=4 * MiB)
    real = _fence.clock
    _fence.clock = lambda: real() + 10.0  # as if the process had been stopped 10 s
    try:
        with pytest.raises(LeaseExpired):
            c.put("k", b"v" * 1000, ReplicateConfig(preferred_segments=[c.segment_name]))
        with pytest.raises(LeaseExpired):
            c.put_batch(["a", "b"], [b"1" * 100, b"2" * 100])
    finally:
        _fence.clock = real
    wait_until(lambda: c.stats()["pending_writes"] == 0, 5, "the revokes")
    assert c.batch_is_exist(["k", "a", "b"]) == [0, 0, 0]
    assert c.put_batch(["a", "b"], [b"1" * 100, b"2" * 100]) == [0, 0]
    assert c.get("a") == b"1" * 100
    assert c.stats()["allocated_bytes"] == 2 * align_up(100)
