"""Faults with real processes: clients SIGKILLed or stopped at every step of a
write or a read, a master killed or paused, clients that flood or never read,
and writers racing on one key.

Every test checks the same things afterwards: no key stays stuck, space comes
back (``allocated_bytes``), nothing partial or stale is ever readable, the
master's invariants hold (``check_consistency``) and no segment file is left
behind (the autouse fixture in conftest).  Children are spawned processes that
talk to the test over a pipe; the test kills them by pid.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import threading
import time
from typing import Any

import msgpack
import psutil
import pytest
import zmq
from conftest import keys_on_shard

from kvmaster import (
    Busy,
    Client,
    ClientConfig,
    ConnectionLost,
    ObjectHasLease,
    ObjectNotFound,
    ReplicateConfig,
    RequestError,
    SessionNotFound,
    Timeout,
)
from kvmaster import protocol as P
from kvmaster._alloc import align_up
from kvmaster.protocol import Op, Status
from tests.support import wait_until

KiB = 1 << 10
MiB = 1 << 20
CTX = mp.get_context("spawn")
_packb = msgpack.Packer(use_bin_type=True).pack


# ------------------------------------------------------------------ helpers


def shm(name: str) -> str:
    return os.path.join("/dev/shm", name)


def value(key: str, size: int, tag: bytes = b"") -> bytes:
    """Self-checking payload: 8-byte blake2b of (key, body) then the body."""
    body = (tag + key.encode() + b":") * (size // (len(key) + len(tag) + 1) + 1)
    body = body[:size - 8]
    return hashlib.blake2b(key.encode() + body, digest_size=8).digest() + body


def intact(key: str, data: bytes | None) -> bool:
    return data is not None and len(data) > 8 and \
        hashlib.blake2b(key.encode() + data[8:], digest_size=8).digest() == data[:8]


def master_segment(c: Client) -> str:
    (seg,) = [s["name"] for s in c.list_segments() if s["owner"] == "master"]
    return seg


def space_of(c: Client, keys) -> int:
    """Bytes the allocator should hold for these stored keys (one replica each)."""
    return sum(align_up(c.get_size(k)) for k in keys if c.is_exist(k))


class Orphans(list):
    """Former children of a SIGKILLed master, and the ipc directory they used."""

    dirs: set[str]


def sigkill_master(m: Any) -> Orphans:
    """SIGKILL a master; returns its former child processes (shard processes with
    --shard-processes), which the caller must pass to :func:`reap`."""
    out = Orphans()
    out.dirs = set()
    try:
        out.extend(psutil.Process(m.proc.pid).children(recursive=True))
    except psutil.Error:
        pass
    for p in out:
        try:
            out.dirs.update(os.path.dirname(u.laddr) for u in p.net_connections(kind="unix")
                            if u.laddr and "kvmaster-ipc-" in u.laddr)
        except psutil.Error:
            pass
    m.kill()
    return out


def reap(kids: Orphans) -> None:
    """Kill what a SIGKILLed master left running (finding 4); remove its ipc directory."""
    for p in kids:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(kids, timeout=5)
    for d in kids.dirs:
        shutil.rmtree(d, ignore_errors=True)


class Child:
    """A spawned process running ``_role_<name>(conn, *args)`` from this module."""

    def __init__(self, role: str, *args: Any) -> None:
        self.conn, end = CTX.Pipe()
        self.proc = CTX.Process(target=_child_main, args=(end, role, args), daemon=True)
        self.proc.start()
        end.close()
        self.pid = self.proc.pid

    def recv(self, timeout: float = 30.0) -> Any:
        assert self.conn.poll(timeout), f"child {self.pid} did not report within {timeout} s"
        msg = self.conn.recv()
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            raise AssertionError(f"child {self.pid} failed: {msg[1]}")
        return msg

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def leftover(self) -> Any:
        """A message the (dead) child sent and nobody read, or None."""
        try:
            return self.conn.recv() if self.conn.poll(0) else None
        except (EOFError, OSError):
            return None

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)

    def join(self, timeout: float = 20.0) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode

    def cleanup(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.kill()
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


class RawDealer:
    """A bare DEALER speaking the wire protocol (for floods and stalled readers)."""

    def __init__(self, endpoint: str, client_id: str, ctx: zmq.Context, rcvhwm: int = 100_000
                 ) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(endpoint)
        self.client_id = client_id
        self.ids = iter(range(1, 1 << 62))

    def send(self, op: Op, route: bytes, *fields: Any) -> int:
        req_id = next(self.ids)
        self.sock.send_multipart((op.value, route, _packb([req_id, *fields])))
        return req_id

    def recv(self, timeout: float = 10.0) -> tuple[int, int, Any]:
        assert self.sock.poll(timeout * 1000), "no reply"
        frames = self.sock.recv_multipart()
        return P.decode_reply(frames[-1])

    def call(self, op: Op, route: bytes, *fields: Any, timeout: float = 10.0) -> tuple[int, Any]:
        want = self.send(op, route, *fields)
        while True:
            req_id, status, body = self.recv(timeout)
            if req_id == want:
                return status, body

    def hello(self) -> dict[str, Any]:
        status, body = self.call(Op.HELLO, P.MASTER_ROUTE, *P.PROTOCOL_VERSION, self.client_id,
                                 "default", "test-host", "0")
        assert status == 0, body
        return body

    def close(self) -> None:
        self.sock.close(linger=0)


# --------------------------------------------------------------- child roles


def _role_writer(conn: Any, addr: str, seg_bytes: int, place: str, keys: list[str], size: int,
                 mode: str) -> None:
    """PUT_START every key through the raw path, then: ``start`` idle (killed by the
    test), ``write`` write the first key slowly in chunks (killed part way), ``stall``
    write half, stop itself, and after SIGCONT finish and try PUT_END."""
    c = Client()
    c.setup(addr, seg_bytes, timeout_s=5.0)
    cfg = None
    if place == "own":
        cfg = ReplicateConfig(preferred_segments=[c.segment_name]).to_wire()
    starts = []
    for k in keys:
        bk = k.encode()
        t0 = time.monotonic()
        replicas = c._call(Op.PUT_START.value, c._route(bk), [bk, size, cfg])
        starts.append((k, replicas, t0))
    (name, off) = starts[0][1][0]
    c._drive(c._know(starts[0][1]))
    seg = c._local(name)
    conn.send(("started", starts, c.segment_name))
    if mode == "start":
        conn.poll(60)
        c.close()
        return
    chunk = 32 * KiB
    if mode == "write":
        for pos in range(0, size, chunk):
            seg.buf[off + pos:off + pos + chunk] = b"\xee" * chunk
            if pos == chunk:
                conn.send(("writing", pos))
            time.sleep(0.01)
        conn.poll(60)  # killed before it would ever send PUT_END
        c.close()
        return
    # stall: half written, then stopped; finishes the write late
    half = size // 2
    seg.buf[off:off + half] = b"\xee" * half
    conn.send(("stalling", half))
    os.kill(os.getpid(), signal.SIGSTOP)
    seg.buf[off + half:off + size] = b"\xdd" * (size - half)
    bk = keys[0].encode()
    try:
        c._call(Op.PUT_END.value, c._route(bk), [bk])
        conn.send(("put_end", 0))
    except RequestError as exc:
        conn.send(("put_end", exc.code))
    conn.poll(30)
    c.close()


def _role_reader(conn: Any, addr: str, seg_bytes: int, keys: list[str]) -> None:
    """Read ``keys`` in a loop, checking every payload, until killed."""
    c = Client()
    c.setup(addr, seg_bytes, timeout_s=5.0)
    n = 0
    while True:
        got = c.get_batch(keys)
        bad = [k for k, v in zip(keys, got) if not intact(k, v)]
        if bad:
            conn.send(("corrupt", bad))
            return
        n += 1
        if n == 1:
            conn.send(("reading", c.segment_name))
        if n > 100_000:
            return


def _role_owner(conn: Any, addr: str, keys: list[str], pending: str) -> None:
    """Objects in its own segment, in sessions it pins, plus a tagged write it never ends."""
    c = Client()
    c.setup(addr, 2 * MiB, timeout_s=5.0)
    own = ReplicateConfig(preferred_segments=[c.segment_name],
                          kv_sessions=[["solo", "mixed"]] * len(keys))
    assert c.put_batch(keys, [value(k, 8 * KiB) for k in keys], own) == [0] * len(keys)
    c.pin_kv_session("solo")
    c.pin_kv_session("mixed")
    assert c.attach_kv_session("attached", keys[:2]) == [0, 0]
    bk = pending.encode()
    cfg = ReplicateConfig(preferred_segments=[master_segment(c)]).to_wire()
    c._call(Op.PUT_START_WITH_KV_SESSIONS.value, c._route(bk), [bk, 64 * KiB, cfg, [b"pend-s"]])
    conn.send(("ready", c.segment_name))
    conn.poll(60)
    c.close()


def _role_stalled_owner(conn: Any, addr: str) -> None:
    """Own segment with one object; after the test stops and resumes us, report what
    the store looks like from here."""
    c = Client()
    c.setup(addr, MiB, timeout_s=5.0)
    c.put("mine", value("mine", 4 * KiB), ReplicateConfig(preferred_segments=[c.segment_name]))
    conn.send(("ready", c.segment_name))
    assert conn.poll(60)
    conn.recv()
    out: dict[str, Any] = {}
    try:
        c.get("mine")
        out["old"] = "readable"
    except ObjectNotFound:
        out["old"] = "missing"
    c.put("mine2", value("mine2", 4 * KiB), ReplicateConfig(preferred_segments=[c.segment_name]))
    out.update(seg=c.segment_name, file=os.path.exists(shm(c.segment_name)),
               reconnects=c.reconnect_count, where=c.query_key("mine2")["replicas"][0][0])
    conn.send(("after", out))
    conn.poll(60)
    c.close()


def _role_raw_racer(conn: Any, addr: str, wid: int, keys: list[str], barrier: Any) -> None:
    """Per key: see it absent, meet the other racer, PUT_START; the winner writes and
    ends, the loser tries to end a write it does not own."""
    c = Client()
    c.setup(addr, 0, timeout_s=10.0)
    out = []
    for i, k in enumerate(keys):
        bk = k.encode()
        size = 4 * KiB + 64 * i + wid
        assert not c.is_exist(k)
        barrier.wait(30)
        try:
            replicas = c._call(Op.PUT_START.value, c._route(bk), [bk, size, None])
        except RequestError as exc:
            try:
                c._call(Op.PUT_END.value, c._route(bk), [bk])
                end = 0
            except RequestError as e2:
                end = e2.code
            out.append((k, "lost", exc.code, end))
        else:
            c._drive(c._know(replicas))
            c._write(replicas, [value(k, size, b"w%d" % wid)])
            c._call(Op.PUT_END.value, c._route(bk), [bk])
            out.append((k, "won", size, 0))
        barrier.wait(30)
    conn.send(("done", out))
    c.close()


def _role_racer(conn: Any, addr: str, wid: int, keys: list[str], seed: int, barrier: Any) -> None:
    """Both racers write every key through put, put_batch or upsert at the same moments."""
    c = Client()
    c.setup(addr, 0, timeout_s=10.0)
    rng = random.Random(seed)
    results = []
    for r in range(0, len(keys), 8):
        group = keys[r:r + 8]
        assert c.batch_is_exist(group) == [0] * len(group)
        vals = [value(k, 2 * KiB + 512 * wid + 8 * (i % 7), b"w%d" % wid)
                for i, k in enumerate(group)]
        barrier.wait(30)
        how = rng.choice(("put", "put_batch", "upsert", "upsert_batch"))
        if how == "put":
            results += [c.put(k, v) for k, v in zip(group, vals)]
        elif how == "upsert":
            results += [c.upsert(k, v) for k, v in zip(group, vals)]
        elif how == "put_batch":
            results += c.put_batch(group, vals)
        else:
            results += c.upsert_batch(group, vals)
        barrier.wait(30)
    conn.send(("done", results))
    c.close()


# ------------------------------------------------------ clients killed (SIGKILL)


@pytest.mark.parametrize("mode,place", [("start", "master"), ("write", "master"),
                                        ("write", "own")])
def test_writer_killed_after_put_start_or_mid_write(start_master, make_client, mode: str,
                                                    place: str) -> None:
    """A writer SIGKILLed after PUT_START (nothing written) or part way through its
    bytes: the key is never readable, not even partly; another writer can take it once
    the discard timeout passes or the dead writer is expired (at once when the write was
    in the dead client's own segment, which goes with it); the space comes back when the
    dead writer is expired (not at the release timeout, which would be later here)."""
    m = start_master("--client-ttl", "0.5", "--master-segment-size", str(4 * MiB),
                     "--shards", "2", "--put-start-discard-timeout", "0.5",
                     "--put-start-release-timeout", "30")
    obs = make_client(m, segment_bytes=0)
    size = 256 * KiB
    w = Child("writer", m.addr, MiB if place == "own" else 0, place, ["victim", "orphan"], size,
              mode)
    try:
        _, starts, child_seg = w.recv()
        if mode == "write":
            w.recv()  # at least one chunk of 0xEE written
        w.kill()
        assert w.proc.exitcode == -signal.SIGKILL
    finally:
        w.cleanup()
    t_start = starts[0][2]
    victim_seg = starts[0][1][0][0]
    assert victim_seg == (child_seg if place == "own" else master_segment(obs))

    # Never readable while unfinished, through any read path.
    assert not obs.is_exist("victim")
    assert obs.batch_is_exist(["victim", "orphan"]) == [0, 0]
    with pytest.raises(ObjectNotFound):
        obs.get("victim")
    assert obs.get_batch(["victim"]) == [None]
    assert obs.batch_get_into(["victim"], [bytearray(size)]) == [Status.OBJECT_NOT_FOUND]
    with pytest.raises(ObjectNotFound):
        obs.get_size("victim")

    if place == "master":
        assert obs.query_key("victim")["state"] == "PROCESSING"
        assert obs.stats()["allocated_bytes"] == 2 * align_up(size)
        if time.monotonic() - t_start < 0.4:
            # Within the discard timeout the key is someone else's write.
            bk = b"victim"
            with pytest.raises(RequestError) as ei:
                obs._call(Op.PUT_START.value, obs._route(bk), [bk, 100, None])
            assert ei.value.code == Status.OBJECT_ALREADY_EXISTS

    new = value("victim", 100 * KiB, b"new")

    def taken() -> bool:
        obs.put("victim", new)  # a no-op answer while the dead write still holds the key
        return obs.is_exist("victim")

    took = wait_until(taken, 5, "another writer to take over the key")
    if place == "master":
        assert time.monotonic() - t_start >= 0.5, "taken over before the discard timeout"
        assert took < 3
    assert obs.get("victim") == new

    # The abandoned writes' space comes back when the dead writer is expired: both
    # writes are dropped then, or "victim"'s was taken over first and is freed then.
    wait_until(lambda: obs.stats()["allocated_bytes"] == align_up(len(new)), 5,
               "the abandoned writes' space to be freed")
    s = obs.stats()
    assert s["pending_writes"] == 0 and s["keys"] == 1
    if place == "master":
        assert s["put_start_released"] == 0
        assert (s["put_start_discarded"], s["stranded_writes_freed_with_writer"],
                s["writes_dropped_with_writer"]) in ((1, 1, 1), (0, 0, 2))
        if s["put_start_discarded"]:
            # Taken over while the dead writer was not yet expired: its space was held
            # (it may still have been copying), so the new write went elsewhere.  (When
            # it was expired first, both writes were dropped and the space may be reused.)
            assert obs.query_key("victim")["replicas"][0][1] != starts[0][1][0][1]
    else:
        wait_until(lambda: not os.path.exists(shm(child_seg)), 5, "the segment file to go")
    with pytest.raises(ObjectNotFound):
        obs.query_key("orphan")
    obs.put("orphan", value("orphan", 300))
    assert intact("orphan", obs.get("orphan"))
    assert obs.check_consistency() == []


def test_reader_killed_holding_leases_blocks_remove_and_eviction_only_for_the_ttl(
        start_master, make_client) -> None:
    """A reader SIGKILLed in the middle of a read loop leaves leases behind: remove
    answers OBJECT_HAS_LEASE, eviction steps over the objects and a forced remove
    keeps the bytes, but only until the lease TTL (500 ms) runs out."""
    m = start_master("--client-ttl", "0.5", "--default-kv-lease-ttl", "500", "--shards", "1")
    owner = make_client(m, segment_bytes=2 * MiB)
    keys = [f"leased-{i}" for i in range(6)]
    assert owner.put_batch(keys, [value(k, 256 * KiB) for k in keys]) == [0] * 6
    r = Child("reader", m.addr, 0, keys)
    try:
        r.recv()
        time.sleep(random.uniform(0.0, 0.05))
        r.kill()
        t_kill = time.monotonic()
        assert r.leftover() is None  # no corrupt read reported
    finally:
        r.cleanup()

    # The dead reader's leases still count for a while ...
    fresh = time.monotonic() - t_kill < 0.3  # its last lease is surely still running
    held = owner.stats()["allocated_bytes"]
    owner.remove(keys[5], force=True)
    if fresh:
        with pytest.raises(ObjectHasLease):
            owner.remove(keys[0])
        assert owner.batch_remove(keys[1:2]) == [Status.OBJECT_HAS_LEASE]
        assert owner.stats()["allocated_bytes"] == held  # forced: freed at lease end
    big = value("big", MiB)  # only fits by evicting, and every object is leased
    try:
        owner.put("big", big)
        blocked = False
    except RequestError as exc:
        assert exc.code == Status.NO_AVAILABLE_HANDLE, exc
        blocked = True
    assert blocked or time.monotonic() - t_kill > 0.5, "eviction took a leased object"

    # ... and no longer than the TTL.
    def stored() -> bool:
        try:
            owner.put("big", big)
        except RequestError as exc:
            assert exc.code == Status.NO_AVAILABLE_HANDLE, exc
        return owner.is_exist("big")

    wait_until(stored, 3, "eviction to proceed once the leases ran out")
    assert time.monotonic() - t_kill < 2.5, "leases of a dead reader outlived their TTL"
    assert owner.get("big") == big
    assert owner.stats()["evicted_keys"] >= 1
    assert owner.batch_remove(keys[:1])[0] in (0, Status.OBJECT_NOT_FOUND)
    live = ["big"] + [k for k in keys if owner.is_exist(k)]
    assert owner.stats()["allocated_bytes"] == space_of(owner, live)
    assert all(intact(k, owner.get(k)) for k in live if k != "big")
    wait_until(lambda: owner.stats()["clients"] == 1, 5, "the reader to expire")
    assert owner.check_consistency() == []


def test_killed_owner_objects_sessions_and_pending_write_are_cleaned_up(
        start_master, make_client) -> None:
    """A client SIGKILLed while owning objects in pinned sessions and a tagged write
    in another segment: at expiry its objects, memberships and file go, sessions left
    empty are deleted with their pins; the pending write's membership goes with it
    (at expiry, since the write fencing: the release timeout before); other clients'
    objects and memberships stay."""
    m = start_master("--client-ttl", "0.5", "--master-segment-size", str(4 * MiB),
                     "--put-start-discard-timeout", "0.3", "--put-start-release-timeout", "1.0")
    live = make_client(m, segment_bytes=0)
    mine = [f"live-{i}" for i in range(3)]
    cfg = ReplicateConfig(preferred_segments=[master_segment(live)], kv_sessions=[["mixed"]] * 3)
    assert live.put_batch(mine, [value(k, 4 * KiB) for k in mine], cfg) == [0, 0, 0]
    dead = [f"dead-{i}" for i in range(5)]
    o = Child("owner", m.addr, dead, "pend")
    try:
        _, seg = o.recv()
        assert live.get_kv_session("solo").member_count == 5
        assert live.get_kv_session("mixed").member_count == 8
        assert live.get_kv_session("pend-s").member_count == 1
        o.kill()
    finally:
        o.cleanup()

    wait_until(lambda: live.stats()["clients"] == 1, 5, "the owner to expire")
    assert live.batch_is_exist(dead) == [0] * 5
    assert live.get_batch(dead) == [None] * 5
    with pytest.raises(SessionNotFound):
        live.get_kv_session("solo")
    with pytest.raises(SessionNotFound):
        live.get_kv_session("attached")
    info = live.get_kv_session("mixed")
    assert info.member_count == 3 and info.pinned
    assert sorted(live.iter_kv_session_keys("mixed")) == mine
    wait_until(lambda: not os.path.exists(shm(seg)), 5, "the owner's segment file to go")
    assert seg not in [s["name"] for s in live.list_segments()]
    assert live.check_consistency() == []

    # The unfinished tagged write in the master's segment went at the expiry.
    def released() -> bool:
        try:
            live.get_kv_session("pend-s")
            return False
        except SessionNotFound:
            return True

    wait_until(released, 4, "the abandoned write's membership to go")
    s = live.stats()
    assert s["pending_writes"] == 0 and s["sessions"] == 1 and s["keys"] == 3
    assert s["allocated_bytes"] == space_of(live, mine)
    assert all(intact(k, v) for k, v in zip(mine, live.get_batch(mine)))
    assert live.check_consistency() == []


# --------------------------------------------------------- master killed / paused


def test_master_killed_silent_then_restarted(start_master) -> None:
    """SIGKILL the master; for a while something on its port accepts connections but
    never answers; then a new master starts there.  The client retries with backoff
    (no tight loop), notices the new master by itself, re-mounts the same segment,
    and its hook re-publishes and re-pins its session; keys written before the crash
    are misses for everyone, never stale bytes from the old mapping."""
    first = start_master("--client-ttl", "1.5")
    port = first.addr.rsplit(":", 1)[1]
    published: dict[str, bytes] = {}
    hooks: list[float] = []

    def on_reconnect(cl: Client) -> None:
        hooks.append(time.monotonic())
        keys = sorted(published)
        cfg = ReplicateConfig(kv_sessions=[["app"]] * len(keys),
                              preferred_segments=[cl.segment_name])
        assert cl.put_batch(keys, [published[k] for k in keys], cfg) == [0] * len(keys)
        cl.pin_kv_session("app")

    c = Client(ClientConfig(connect_timeout_s=0.5, reconnect_max_backoff_s=1.0))
    c.setup(first.addr, 2 * MiB, timeout_s=1.0, on_reconnect=on_reconnect)
    reader = Client(ClientConfig(connect_timeout_s=0.5, reconnect_max_backoff_s=1.0))
    reader.setup(first.addr, 0, timeout_s=1.0)
    ctx = zmq.Context()
    orphans = Orphans()
    orphans.dirs = set()
    try:
        seg = c.segment_name
        for i in range(4):
            published[f"pub-{i}"] = value(f"pub-{i}", 16 * KiB)
        cfg = ReplicateConfig(kv_sessions=[["app"]] * 4)
        assert c.put_batch(sorted(published), [published[k] for k in sorted(published)],
                           cfg) == [0] * 4
        c.pin_kv_session("app")
        c.put("transient", value("transient", 16 * KiB))  # not re-published by the hook
        assert intact("transient", reader.get("transient"))

        orphans = sigkill_master(first)
        silent = ctx.socket(zmq.ROUTER)
        silent.setsockopt(zmq.LINGER, 0)
        silent.bind(first.endpoint)
        hellos: list[float] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0:
            if silent.poll(100):
                frames = silent.recv_multipart()
                if frames[1] == Op.HELLO.value and frames[0].startswith(c.client_id.encode()):
                    hellos.append(time.monotonic() - t0)
        silent.close(linger=0)
        gaps = [b - a for a, b in zip(hellos, hellos[1:])]
        # Keeps trying, but not in a tight loop: attempts at least a connect timeout
        # (0.5 s) apart, and far fewer than a retry per connect timeout overall.
        assert 2 <= len(hellos) <= 8, hellos
        assert min(gaps) >= 0.4, gaps

        second = start_master("--port", port, "--client-ttl", "1.5")
        assert second.addr == first.addr
        # No application call needed: the heartbeat thread finds the new master.
        wait_until(lambda: c.reconnect_count >= 1 and hooks, 8, "the client to re-handshake")
        wait_until(lambda: reader.reconnect_count >= 1, 8, "the reader to re-handshake")
        s = c.stats()
        assert s["clients"] >= 1 and c.segment_name == seg
        assert [x["name"] for x in c.list_segments()] == [seg]
        info = c.get_kv_session("app")
        assert info.pinned and info.member_count == 4
        for getter in (c, reader):
            with pytest.raises(ObjectNotFound):
                getter.get("transient")  # its bytes are still in the mapping: never served
            assert not getter.is_exist("transient")
            got = getter.get_batch(sorted(published))
            assert got == [published[k] for k in sorted(published)]
        assert c.check_consistency() == []
    finally:
        reader.close()
        c.close()
        ctx.term()
        reap(orphans)


def test_calls_honour_their_timeout_while_the_master_is_stopped(start_master) -> None:
    """A stopped (SIGSTOP) master: every kind of call ends within its timeout_s with
    Timeout or ConnectionLost, never hangs, also while the heartbeat thread is busy
    reconnecting between the calls; after SIGCONT calls succeed again."""
    m = start_master("--client-ttl", "1.5")
    c = Client(ClientConfig(connect_timeout_s=1.5, reconnect_max_backoff_s=2.0))
    c.setup(m.addr, MiB, timeout_s=0.4)
    c.put("k", b"v" * 100)
    calls = [
        ("put", lambda: c.put("k2", b"x" * 100)),
        ("get", lambda: c.get("k")),
        ("is_exist", lambda: c.is_exist("k")),
        ("get_batch", lambda: c.get_batch(["k", "k3"])),
        ("put_batch", lambda: c.put_batch(["a", "b"], [b"1", b"2"])),
        ("upsert", lambda: c.upsert("k", b"y")),
        ("remove", lambda: c.remove("k")),
        ("attach", lambda: c.attach_kv_session("s", ["k"])),
        ("pin", lambda: c.pin_kv_session("s")),
        ("stats", lambda: c.stats()),
        ("query_key", lambda: c.query_key("k")),
    ]
    took: list[tuple[str, float, str]] = []
    os.kill(m.proc.pid, signal.SIGSTOP)
    try:
        t_end = time.monotonic() + 5.0
        i = 0
        while time.monotonic() < t_end and i < 40:
            name, fn = calls[i % len(calls)]
            i += 1
            t0 = time.monotonic()
            try:
                fn()
                outcome = "ok"
            except (Timeout, ConnectionLost) as exc:
                outcome = type(exc).__name__
            took.append((name, time.monotonic() - t0, outcome))
            time.sleep(0.6)  # idle long enough for the heartbeat thread to act
    finally:
        os.kill(m.proc.pid, signal.SIGCONT)
    assert all(o != "ok" for _, _, o in took), took
    c.close()
    slow = [(n, round(t, 2)) for n, t, _ in took if t > 0.4 + 0.5]
    assert not slow, f"calls overran timeout_s=0.4 (waiting for the heartbeat thread): {slow}"


def test_client_recovers_when_a_stopped_master_resumes(start_master) -> None:
    """The master stops (SIGSTOP) long enough for the client's heartbeat to time out
    and its re-handshake HELLO to time out too; then the master resumes (well within
    --client-ttl) and answers that HELLO late.  The client must come back by itself:
    calls succeed again within a few heartbeat intervals."""
    m = start_master("--client-ttl", "6")
    c = Client(ClientConfig(connect_timeout_s=1.0, reconnect_max_backoff_s=1.0))
    c.setup(m.addr, MiB, timeout_s=0.4)
    try:
        c.put("k", value("k", 4 * KiB))
        os.kill(m.proc.pid, signal.SIGSTOP)
        try:
            # The heartbeat thread noticed and is re-handshaking (welcome cleared) ...
            wait_until(lambda: c.welcome is None, 6, "the heartbeat to time out", step=0.05)
            time.sleep(1.3)  # ... and its HELLO has timed out as well.
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)

        def works() -> bool:
            try:
                return intact("k", c.get("k"))
            except (Timeout, ConnectionLost):
                return False

        wait_until(works, 10, "calls to succeed after the master resumed", step=0.1)
        s = c.stats()
        assert s["front"]["clients_expired"] == 0 and s["segments"] == 1
        assert c.check_consistency() == []
    finally:
        c.close()


def test_master_pause_longer_than_client_ttl_keeps_live_clients(start_master) -> None:
    """A master stopped for longer than --client-ttl (a VM or GC pause): on resuming it
    must not expire clients whose heartbeats were waiting in its socket, erasing
    their objects and unlinking their segment files."""
    m = start_master("--client-ttl", "1.0")
    c = Client()
    c.setup(m.addr, MiB, timeout_s=5.0)
    reader = Client()
    reader.setup(m.addr, 0, timeout_s=5.0)
    try:
        c.put("k", value("k", 4 * KiB))
        seg = c.segment_name
        for _ in range(2):
            os.kill(m.proc.pid, signal.SIGSTOP)
            time.sleep(2.5)
            os.kill(m.proc.pid, signal.SIGCONT)
            time.sleep(1.0)
        s = reader.stats()
        expired = s["front"]["clients_expired"]
        on_host = [x["name"] for x in reader.list_segments()]
        missing = [n for n in on_host if not os.path.exists(shm(n))]
        assert missing == [], f"mounted segments without a file: {missing}"
        assert expired == 0, f"{expired} live clients expired after the master's own pause"
        assert c.segment_name == seg and intact("k", reader.get("k"))
    finally:
        reader.close()
        c.close()


def test_expiry_racing_a_rehandshake_never_unlinks_a_mounted_segment(tmp_path) -> None:
    """The master expires a client (unmount, then unlink its file) while the same
    client says HELLO again and re-mounts its segment, whose file still exists at
    that moment (the client checks before re-mounting).  Driven step by step on an
    in-process master so the interleaving is exact; seen with real processes after
    a master pause (test above)."""
    from kvmaster._segment import Segment, host_id, new_segment_name, owner_fingerprint
    from kvmaster.config import MasterConfig
    from kvmaster.master import Master

    seg = Segment.create(MiB, new_segment_name(owner_fingerprint("cid")))  # client "cid"'s
    try:
        async def scenario() -> tuple[bool, bool]:
            m = Master(MasterConfig(port=0, metrics_port=-1, shards=2, client_ttl=0.5))
            m._loop = asyncio.get_running_loop()
            for shard in m.shards:
                shard.wakeup = m._waker(shard)
            hello_fields = [*P.PROTOCOL_VERSION, "cid", "default", host_id(), "0"]
            _, hello = P.decode_request(Op.HELLO.value, _packb([1, *hello_fields]))
            _, mount = P.decode_request(Op.MOUNT_SEGMENT.value,
                                        _packb([2, seg.name, seg.size, host_id(), "shm"]))
            assert m.registry.hello(b"cid/1", hello)[0] == 0
            assert (await m.registry._mount(m.registry.clients[b"cid/1"], mount))[0] == 0
            expiry = asyncio.ensure_future(m.registry.forget(m.registry.clients[b"cid/1"], unlink=True))
            await asyncio.sleep(0)  # the expiry has started: unmount messages posted
            assert m.registry.hello(b"cid/2", hello)[0] == 0  # the client is back, new connection
            file_seen = os.path.exists(shm(seg.name))
            status, _ = await m.registry._mount(m.registry.clients[b"cid/2"], mount)
            await expiry
            mounted = status == 0 and seg.name in m.registry.segments
            return file_seen, mounted

        file_seen, mounted = asyncio.run(scenario())
        # The expiry removes the file before it awaits anything, so the returning
        # client finds it gone (a real client then makes a fresh segment) and the
        # master refuses to mount a missing file.
        assert not file_seen and not mounted
        if mounted:
            assert os.path.exists(shm(seg.name)), \
                "segment re-mounted by a live client but its file was unlinked by the expiry"
    finally:
        seg.close(unlink=True)


def test_master_shutdown_removes_files_of_crashed_clients(start_master, make_client) -> None:
    """A client SIGKILLed shortly before the master stops (so before --client-ttl
    expired it): the master's shutdown removes the dead owner's segment file, as it
    does at expiry; a clean client's file is its owner's to remove."""
    m = start_master("--client-ttl", "30", "--master-segment-size", str(MiB))
    o = Child("owner", m.addr, ["d-0", "d-1"], "pend")
    try:
        _, seg = o.recv()
        o.kill()
    finally:
        o.cleanup()
    assert os.path.exists(shm(seg))
    assert m.stop() == 0, m.stderr
    assert not os.path.exists(shm(seg)), "segment file of a crashed client left behind"


def _own_segment_of(m: Any) -> str:
    """Name of a master's own segment (--master-segment-size), asked by a client that
    mounts nothing and reads nothing (so maps nothing)."""
    c = Client(ClientConfig(timeout_s=5))
    c.setup(m.addr, 0)
    try:
        return next(s["name"] for s in c.list_segments() if s["owner"] == "master")
    finally:
        c.close()


def _clean_segments(*flags: str) -> dict[str, Any]:
    """``kvmaster ctl clean-segments --json`` in a process of its own (this run's tag)."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvmaster", "ctl", "clean-segments", "--json",
                        *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_segment_files_of_killed_masters_are_removed_but_never_one_in_use(
        start_master, make_client) -> None:
    """SIGKILL leaves a master's own segment file behind.  A master started later (same
    KVMASTER_SEGMENT_TAG) removes the files of dead masters that nothing maps, and
    keeps a dead master's file still mapped by a client, a live master's file and
    clients' files; `kvmaster ctl clean-segments` removes the rest once unmapped (and,
    with --clients, a dead client's file), never one a live process maps."""
    import subprocess
    import sys

    from kvmaster._segment import MASTER_NAME

    def exists(name: str) -> bool:
        return os.path.exists(f"/dev/shm/{name}")

    m1 = start_master("--master-segment-size", str(MiB))
    seg1 = _own_segment_of(m1)
    assert MASTER_NAME.fullmatch(seg1).group(2) == str(m1.proc.pid)
    reader = make_client(m1, segment_bytes=0, timeout_s=0.5)
    reader.put("k", b"in the master's segment")
    assert reader.get("k") == b"in the master's segment"  # this process maps seg1 now
    m2 = start_master("--master-segment-size", str(MiB))
    seg2 = _own_segment_of(m2)  # nobody maps it
    m4 = start_master("--master-segment-size", str(MiB))
    seg4 = _own_segment_of(m4)  # a live master's
    live = make_client(m4, segment_bytes=MiB)  # a live client's
    dead = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from kvmaster._segment import Segment\n"
         "print(Segment.create(1 << 20).name, flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        dead_client = dead.stdout.readline().strip()
    finally:
        dead.kill()
        dead.wait()
        dead.stdout.close()
    m1.kill()
    m2.kill()
    assert exists(seg1) and exists(seg2) and exists(dead_client)

    m3 = start_master()
    wait_until(lambda: not exists(seg2), 10, "the new master to remove the dead master's file")
    time.sleep(0.2)
    assert exists(seg1), "removed a file a live process maps"
    assert exists(seg4), "removed a live master's file"
    assert exists(live.segment_name) and exists(dead_client), "a master removed a client's file"

    report = _clean_segments("--clients", "--min-age", "0")
    assert report["removed"] == [dead_client]
    kept = {k["name"]: k["reason"] for k in report["kept"]}
    assert kept[seg1] == f"mapped or open by pid {os.getpid()}"
    assert kept[seg4] == f"its master (pid {m4.proc.pid}) is alive"
    assert kept[live.segment_name] == f"mapped or open by pid {os.getpid()}"
    assert exists(seg1) and exists(seg4) and exists(live.segment_name)
    # Stopped first: it looks again (after 2 s, then longer pauses) while seg1 is in use.
    assert m3.stop() == 0
    assert f"removed segment file of a dead master name={seg2}" in m3.stderr
    assert f"segment file of a dead master kept while in use name={seg1}" in m3.stderr

    reader.close()  # the last mapping of seg1 goes
    assert _clean_segments("--dry-run")["removed"] == [seg1] and exists(seg1)
    assert _clean_segments()["removed"] == [seg1]
    assert not exists(seg1) and exists(seg4) and exists(live.segment_name)


def _mapped_here(name: str) -> bool:
    """Whether this process maps /dev/shm/<name> or holds it open (a peer's segment is
    read through a descriptor, not mapped), also once the file is unlinked."""
    path = f"/dev/shm/{name}"
    with open("/proc/self/maps") as f:
        if path in f.read():
            return True
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)") == path:
                return True
        except OSError:
            continue
    return False


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_clients_unmap_a_killed_masters_segment_when_they_reconnect(start_master,
                                                                    mode: str) -> None:
    """A long-lived client read from a master's own segment; the master is SIGKILLed
    and a new one starts on its port.  When the client re-handshakes (its heartbeat
    finds the new master, whose WELCOME names another master instance) it drops its
    mappings of other processes' segments and its segment table, so the dead master's
    file is mapped by nobody: the new master removes it (sync case), or, with
    --no-clean-stale-segments, `kvmaster ctl clean-segments` does (async case).  A
    re-handshake with the same master keeps the mappings."""
    from kvmaster import AsyncClient

    flags = ("--master-segment-size", str(MiB), "--client-ttl", "2")
    m1 = start_master(*flags)
    port = m1.addr.rsplit(":", 1)[1]
    seg1 = _own_segment_of(m1)
    cfg = ClientConfig(timeout_s=2.0, connect_timeout_s=1.0, reconnect_max_backoff_s=0.5)
    data = value("k", 4 * KiB)
    orphans = Orphans()
    orphans.dirs = set()

    def restart() -> Any:
        nonlocal orphans
        orphans = sigkill_master(m1)
        extra = () if mode == "sync" else ("--no-clean-stale-segments",)
        return start_master("--port", port, *flags, *extra)

    def after(c: Any, m2: Any) -> str:
        assert not _mapped_here(seg1), "the dead master's segment is still mapped"
        assert seg1 not in c._mapped and seg1 not in c._seg_info
        assert os.path.exists(shm(seg1))
        return _own_segment_of(m2)

    try:
        if mode == "sync":
            c = Client(cfg)
            c.setup(m1.addr, 0)  # consumer only: objects go to the master's segment
            try:
                c.put("k", data)
                assert c.get("k") == data and _mapped_here(seg1)
                with c._lock:
                    c._rehandshake()  # the same master: nothing is dropped
                assert c.reconnect_count == 1 and _mapped_here(seg1)
                m2 = restart()
                wait_until(lambda: c.reconnect_count >= 2, 15, "the client to re-handshake")
                seg2 = after(c, m2)
                c.put("k2", data)
                assert c.get("k2") == data and _mapped_here(seg2)
                wait_until(lambda: not os.path.exists(shm(seg1)), 30,
                           "the new master to remove the dead master's file")
                assert c.get("k2") == data
            finally:
                c.close()
            assert m2.stop() == 0
            assert f"removed segment file of a dead master name={seg1}" in m2.stderr
        else:
            async def run() -> None:
                c = AsyncClient(cfg)
                await c.setup(m1.addr, 0)
                try:
                    await c.put("k", data)
                    assert await c.get("k") == data and _mapped_here(seg1)
                    m2 = restart()
                    t0 = time.monotonic()
                    while c.reconnect_count < 1:
                        assert time.monotonic() - t0 < 15, "the client did not re-handshake"
                        await asyncio.sleep(0.05)
                    seg2 = after(c, m2)
                    await c.put("k2", data)
                    assert await c.get("k2") == data and _mapped_here(seg2)
                    report = _clean_segments()
                    assert report["removed"] == [seg1], report
                    assert not os.path.exists(shm(seg1))
                    assert await c.get("k2") == data
                finally:
                    await c.close()

            asyncio.run(run())
    finally:
        reap(orphans)


def test_a_segment_the_master_no_longer_lists_is_unmapped(start_master, make_client) -> None:
    """A reader maps the segments it reads from; when a segment look-up (LIST_SEGMENTS)
    no longer lists one (its owner left, and unlinked its file), the reader unmaps it,
    so the file's memory is freed instead of lasting as long as the reader."""
    m = start_master()
    reader = make_client(m, segment_bytes=0)
    first = make_client(m, segment_bytes=MiB)
    first.put("a", b"first")
    assert reader.get("a") == b"first"
    gone = first.segment_name
    assert _mapped_here(gone)
    first.close()  # unmounts and unlinks; the reader still maps it
    assert _mapped_here(gone) and not os.path.exists(shm(gone))
    second = make_client(m, segment_bytes=MiB)
    second.put("b", b"second")
    assert reader.get("b") == b"second"  # an unknown segment: looked up
    assert not _mapped_here(gone) and gone not in reader._seg_info
    assert _mapped_here(second.segment_name)


def test_clean_up_sees_a_mapping_by_its_lock_alone(monkeypatch) -> None:
    """Every process that maps a segment holds a shared lock on it for as long as the
    mapping lasts, so a file mapped only by processes the clean-up cannot inspect
    (another pid namespace, a process that is not dumpable) is still kept."""
    from kvmaster import _segment as S

    seg = S.Segment.create(MiB)
    reader = S.Segment.attach(seg.name)
    try:
        monkeypatch.setattr(S, "_shm_users", lambda: {})  # as if no mapper were visible

        def clean() -> dict[str, Any]:
            return S.remove_stale_segments(S.segment_tag(), masters_only=False, min_age=0)

        assert clean() == {"removed": [], "kept": [
            {"name": seg.name, "reason": "locked by a process that maps it (not visible here)"}]}
        seg.close(unlink=False)  # the owner unmaps; the reader still maps it
        assert clean()["removed"] == []
        reader.close()
        assert clean() == {"removed": [seg.name], "kept": []}
        assert not os.path.exists(f"/dev/shm/{seg.name}")
    finally:
        reader.close()
        seg.close(unlink=True)


def test_master_killed_with_shard_processes_leaves_no_orphans(start_master) -> None:
    """SIGKILL a master running --shard-processes: its shard processes must not
    outlive it (a restarted master would start a second set next to them)."""
    m = start_master("--shard-processes", "--shards", "2")
    c = Client()
    c.setup(m.addr, 0, timeout_s=5.0)
    c.close()
    kids = sigkill_master(m)
    assert kids and kids.dirs
    try:
        gone, alive = psutil.wait_procs(kids, timeout=5)
        left = [(p.pid, " ".join(p.cmdline()[-2:])) for p in alive]
        assert not alive, f"processes outlived their master: {left}"
        # ... nor their ipc directory (the shard processes' death signal removes it).
        assert not [d for d in kids.dirs if os.path.exists(d)], kids.dirs
    finally:
        reap(kids)


# ------------------------------------------------------ stalled and flooding clients


def test_full_shard_inbox_answers_busy_while_others_are_served(start_master, make_client) -> None:
    """One client pipelines thousands of requests at shard 0 (inbox bound 8): the
    overflow is answered BUSY, every request gets exactly one reply, and another
    client's calls keep being served meanwhile (shard 1 never refuses it; at shard 0
    its client sends refused requests again until they are served)."""
    m = start_master("--shard-inbox", "8", "--shards", "2")
    other = make_client(m, segment_bytes=4 * MiB)
    k1 = keys_on_shard(1, 2, 20, "one-")
    k0 = keys_on_shard(0, 2, 2000, "zero-")
    ctx = zmq.Context()
    flood = RawDealer(m.endpoint, "flooder", ctx)
    flood.hello()
    stop = threading.Event()
    outcomes: dict[str, int] = {}
    errors: list[BaseException] = []

    def served() -> None:
        try:
            i = 0
            while not stop.is_set() and i < 5000:
                i += 1
                k = k1[i % len(k1)]
                other.put(k, value(k, 1 * KiB))
                assert intact(k, other.get(k))
                outcomes["shard1_ok"] = outcomes.get("shard1_ok", 0) + 1
                try:
                    other.is_exist(k0[i % len(k0)])
                    outcomes["shard0_ok"] = outcomes.get("shard0_ok", 0) + 1
                except Busy:
                    outcomes["shard0_busy"] = outcomes.get("shard0_busy", 0) + 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=served, daemon=True)
    t.start()
    try:
        route0 = P.route_for_shard(0)
        payloads = [k.encode() for k in k0]
        statuses: dict[int, int] = {}
        deadline = time.monotonic() + 20
        # Windows of 500 in flight: far beyond the inbox bound (8), and within the
        # master's reply queue per peer (SNDHWM 1000; replies beyond it are dropped,
        # which a flood that outran the master's I/O thread would otherwise hit).
        windows = [payloads[i:i + 500] for i in range(0, len(payloads), 500)] * 3
        for window in windows:
            sent = [flood.send(Op.EXIST_KEY, route0, bk) for bk in window]
            want = set(sent)
            while want and time.monotonic() < deadline:
                req_id, status, _ = flood.recv(10)
                assert req_id in want, f"duplicate or unknown reply {req_id}"
                want.discard(req_id)
                statuses[status] = statuses.get(status, 0) + 1
            assert not want, f"{len(want)} requests never answered"
    finally:
        stop.set()
        t.join(30)
        flood.close()
        ctx.term()
    assert not errors, errors
    assert set(statuses) <= {0, Status.BUSY}, statuses
    assert statuses.get(Status.BUSY, 0) > 0 and statuses.get(0, 0) > 0, statuses
    assert outcomes.get("shard1_ok", 0) > 0, outcomes
    # The client sends a request refused BUSY again (ClientConfig.busy_retry):
    # its calls at the flooded shard were all served.
    assert outcomes.get("shard0_ok", 0) > 0 and "shard0_busy" not in outcomes, outcomes
    s = other.stats()
    assert s["front"]["rejected_busy"] >= statuses[Status.BUSY]
    assert other.check_consistency() == []


def test_client_resends_requests_refused_busy_within_its_timeout(start_master) -> None:
    """BUSY is back-pressure (nothing was done): the sync and async clients send the
    request again after a growing pause until their timeout, then raise Busy (not
    Timeout); with busy_retry=False the first BUSY raises; a call waiting between
    resends does not hold up other threads on the same client.  The BUSY here is
    deterministic: a raw peer holds every staging slot of the shard's multi-page
    session updates (64), so an update's first page is refused until one frees."""
    from kvmaster import AsyncClient
    from kvmaster._sessions import MAX_STAGED_UPDATES

    m = start_master("--shards", "1", "--max-batch", "2")
    keys = ["k1", "k2", "k3"]  # a keep set of two pages
    made: list[Client] = []

    def client(**cfg: Any) -> Client:
        c = Client(ClientConfig(**cfg))
        c.setup(m.addr, 1 * MiB if not made else 0)
        made.append(c)
        return c

    ctx = zmq.Context()
    raw = RawDealer(m.endpoint, "stager", ctx)
    route = P.route_for_shard(0)

    def stage(token: int, final: bool) -> None:
        # One session per token: a client's new keep set of a session replaces its own
        # unfinished one, so holding every slot takes as many sessions.
        st, body = raw.call(Op.UPDATE_KV_SESSION, route, b"other-%d" % token, [b"x"], token,
                            final)
        assert st == 0, body

    try:
        owner = client()
        for k in keys:
            owner.put(k, b"v")
        assert owner.attach_kv_session("s", keys) == [0, 0, 0]
        raw.hello()
        for token in range(1, MAX_STAGED_UPDATES + 1):
            stage(token, False)

        t0 = time.monotonic()
        with pytest.raises(Busy):
            client(busy_retry=False).update_kv_session("s", keys)
        assert time.monotonic() - t0 < 0.5

        t0 = time.monotonic()
        with pytest.raises(Busy):
            client(timeout_s=0.6).update_kv_session("s", keys)
        # retried until about the deadline, minus the room a last resend would need
        assert 0.4 <= time.monotonic() - t0 < 3.0

        patient = client(timeout_s=10)
        result: dict[str, Any] = {}

        def update() -> None:
            t = time.monotonic()
            result["removed"] = patient.update_kv_session("s", keys + ["gone"])
            result["took"] = time.monotonic() - t

        th = threading.Thread(target=update)
        th.start()
        time.sleep(0.3)
        assert th.is_alive()  # still being refused
        # The retrying call lets go of the client between resends: another thread's
        # call on the same client is served meanwhile.
        t = time.monotonic()
        assert patient.is_exist("k1")
        assert time.monotonic() - t < 0.2
        assert th.is_alive()
        stage(1, True)  # a slot frees: the next resend is served
        th.join(10)
        assert result.get("removed") == 0 and result["took"] >= 0.25, result

        async def async_update() -> float:
            ac = AsyncClient(ClientConfig(timeout_s=10))
            await ac.setup(m.addr, 0)
            try:
                t = time.monotonic()
                task = asyncio.ensure_future(ac.update_kv_session("s", keys))
                await asyncio.sleep(0.3)
                assert not task.done()
                await asyncio.get_running_loop().run_in_executor(None, stage, 2, True)
                assert await asyncio.wait_for(task, 10) == 0
                return time.monotonic() - t
            finally:
                await ac.close()

        stage(MAX_STAGED_UPDATES + 1, False)  # all slots taken again
        assert asyncio.run(async_update()) >= 0.25
        assert owner.get_kv_session("s").member_count == 3
        assert owner.stats()["front"]["rejected_busy"] == 0  # these came from the shard
    finally:
        for c in made:
            c.close()
        raw.close()
        ctx.term()


def test_staged_update_pages_of_a_client_that_leaves_free_their_slots(start_master,
                                                                      make_client) -> None:
    """A raw peer stages pages of 64 multi-page session updates (every staging slot of
    the shard) and goes silent.  When the master expires it (--client-ttl), its staged
    pages go with it: others' updates are served at once, not after the staging TTL.
    Back with the same client id, its final page of an old keep set is refused and
    changes nothing.  A client that says BYE frees its slots at once."""
    from kvmaster._sessions import MAX_STAGED_UPDATES

    m = start_master("--shards", "1", "--client-ttl", "0.5")
    owner = make_client(m, segment_bytes=MiB)
    keys = ["k1", "k2", "k3"]
    for k in keys:
        owner.put(k, b"v")
    assert owner.attach_kv_session("s", keys) == [0, 0, 0]
    route = P.route_for_shard(0)
    ctx = zmq.Context()
    quiet = RawDealer(m.endpoint, "quiet-stager", ctx)
    other = RawDealer(m.endpoint, "other", ctx)
    try:
        quiet.hello()
        other.hello()
        assert quiet.call(Op.UPDATE_KV_SESSION, route, b"s", [b"k1"], 1, False) == (0, 1)
        for token in range(2, MAX_STAGED_UPDATES + 1):
            assert quiet.call(Op.UPDATE_KV_SESSION, route, b"held-%d" % token, [b"x"], token,
                              False) == (0, 1)
        assert other.call(Op.UPDATE_KV_SESSION, route, b"s", [b"k1"], 9, False)[0] == Status.BUSY
        assert owner.stats()["staged_updates"] == MAX_STAGED_UPDATES

        t0 = time.monotonic()  # the quiet stager sends nothing more: expired after 0.5 s
        while owner.stats()["staged_updates"] and time.monotonic() - t0 < 5:
            assert other.call(Op.HEARTBEAT, P.MASTER_ROUTE)[0] == 0
            time.sleep(0.05)
        assert time.monotonic() - t0 < 5  # far below the staging TTL (120 s)
        assert owner.stats()["staged_updates"] == 0
        assert owner.stats()["front"]["clients_expired"] >= 1
        assert other.call(Op.UPDATE_KV_SESSION, route, b"s", [b"k1"], 9, False) == (0, 1)

        # Back under the same client id: the old keep set is gone, and its final page
        # must not apply a partial keep set (["k2"] would remove k1 and k3).
        quiet.hello()
        status, body = quiet.call(Op.UPDATE_KV_SESSION, route, b"s", [b"k2"], 1, True)
        assert status == Status.UPDATE_DISCARDED and "discarded" in body
        assert owner.get_kv_session("s").member_count == 3

        # BYE frees a client's slots at once.
        assert other.call(Op.BYE, P.MASTER_ROUTE)[0] == 0
        assert owner.stats()["staged_updates"] == 0
        assert owner.get_kv_session("s").member_count == 3
        assert owner.check_consistency() == []
    finally:
        quiet.close()
        other.close()
        ctx.term()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_update_whose_client_was_expired_between_pages_is_sent_again(
        start_master, make_client, monkeypatch, mode: str) -> None:
    """A client paused past --client-ttl between two pages of a multi-page session
    update (nothing is sent: the sync client's lock is held by the call, the async
    client's event loop is blocked) is expired, and its staged pages go.  Its next
    page gets NOT_REGISTERED, the client re-handshakes and sends that page again,
    which is refused UPDATE_DISCARDED; the client then sends the whole keep set
    again from its first page under a new token, and the call returns the members
    removed, as if nothing had happened (it used to raise InvalidParams)."""
    from kvmaster import AsyncClient
    from kvmaster._core import ClientCore

    m = start_master("--max-batch", "4", "--client-ttl", "1")
    owner = make_client(m, segment_bytes=MiB)
    keys = [f"k{i}" for i in range(12)]
    for i in range(0, 12, 4):
        assert owner.put_batch(keys[i:i + 4], [b"v"] * 4) == [0] * 4
        assert owner.attach_kv_session("S", keys[i:i + 4]) == [0] * 4
    pages: list[tuple[int, bool]] = []  # (token, final) of each page sent
    updater: list[ClientCore] = []
    orig = ClientCore._session

    def paused(self: ClientCore, op: Op, session_id: str, *fields: Any) -> Any:
        if self not in updater or op != Op.UPDATE_KV_SESSION:
            return (yield from orig(self, op, session_id, *fields))
        pages.append((fields[1], fields[2]))
        body = yield from orig(self, op, session_id, *fields)
        if len(pages) == 1:
            time.sleep(2.5)  # no heartbeat meanwhile: the master expires the client
        return body

    monkeypatch.setattr(ClientCore, "_session", paused)
    if mode == "sync":
        u = Client(ClientConfig(timeout_s=10))
        u.setup(m.addr, 0)
        updater.append(u)
        try:
            removed = u.update_kv_session("S", keys[:10])
            reconnects = u.reconnect_count
        finally:
            u.close()
    else:
        async def run() -> tuple[int, int]:
            u = AsyncClient(ClientConfig(timeout_s=10))
            await u.setup(m.addr, 0)
            updater.append(u)
            try:
                return await u.update_kv_session("S", keys[:10]), u.reconnect_count
            finally:
                await u.close()

        removed, reconnects = asyncio.run(run())
    assert removed == 2 and reconnects == 1
    # Page 1, page 2 (refused after the re-handshake), then all three pages again.
    assert len(pages) == 5 and pages[0][0] == pages[1][0] != pages[2][0], pages
    assert [f for _, f in pages] == [False, False, False, False, True]
    assert len({t for t, _ in pages[2:]}) == 1
    assert owner.get_kv_session("S").member_count == 10
    assert sorted(owner.iter_kv_session_keys("S")) == sorted(keys[:10])
    assert owner.stats()["front"]["clients_expired"] >= 1
    assert owner.check_consistency() == []


def test_update_gives_up_after_restarting_its_keep_set_twice(start_master, make_client,
                                                             monkeypatch) -> None:
    """A keep set whose pages are discarded every time (here: the client's newer update
    of the same session, sent between pages, replaces them) is sent again at most
    twice; then UpdateDiscarded (-1905) reaches the caller, with nothing changed."""
    from kvmaster import UpdateDiscarded
    from kvmaster._core import UPDATE_RESTARTS, ClientCore

    m = start_master("--shards", "1", "--max-batch", "2")
    c = make_client(m, segment_bytes=MiB)
    keys = ["k1", "k2", "k3", "k4"]
    for i in (0, 2):
        assert c.put_batch(keys[i:i + 2], [b"v"] * 2) == [0] * 2
        assert c.attach_kv_session("S", keys[i:i + 2]) == [0] * 2
    orig = ClientCore._session
    firsts: list[int] = []

    def replaced(self: ClientCore, op: Op, session_id: str, *fields: Any) -> Any:
        body = yield from orig(self, op, session_id, *fields)
        if op == Op.UPDATE_KV_SESSION and not fields[2] and session_id == "S":
            firsts.append(fields[1])
            # Another keep set of the same session by the same client replaces this one.
            yield from orig(self, op, session_id, [b"k1"], fields[1] + 1, False)
        return body

    monkeypatch.setattr(ClientCore, "_session", replaced)
    with pytest.raises(UpdateDiscarded) as exc:
        c.update_kv_session("S", keys[:3])
    assert exc.value.code == Status.UPDATE_DISCARDED == -1905
    assert len(firsts) == UPDATE_RESTARTS + 1 == 3 and len(set(firsts)) == 3
    monkeypatch.setattr(ClientCore, "_session", orig)
    assert c.get_kv_session("S").member_count == 4
    assert c.update_kv_session("S", keys[:3]) == 1


def test_client_that_never_reads_replies_does_not_block_others_or_grow_the_master(
        start_master, make_client) -> None:
    """A peer pipelines requests (5000 STATS of ~19 KB replies, 20000 EXIST_KEY) and
    never reads a reply.  Other clients keep being served, and the master holds a
    bounded amount for the stalled peer rather than everything it was asked for
    (~95 MB of replies here): at most 256 of its master-level requests are in progress
    (the rest are answered BUSY), and at most about a thousand replies are queued for
    it (the ROUTER's send high-water mark); once its replies are dropped, its requests
    are dropped unhandled for a while (``stalled_dropped``)."""
    m = start_master()
    other = make_client(m, segment_bytes=4 * MiB)
    proc = psutil.Process(m.proc.pid)
    ctx = zmq.Context()
    # The kernel's default receive buffer, not a small fixed SO_RCVBUF: a 4 KiB one
    # (8 KiB charged) overflows on loopback's skb overhead while the peer never reads,
    # and Linux then drops the master's segments whole, ACKs included (BeyondWindow).
    # The peer gets no ACK for its requests and its TCP retransmits in RTO backoff
    # (6.5 s and doubling) with the rest unsent: the master never sees them.  The
    # default buffer (~0.5 MB here) is still nothing beside the ~95 MB asked for.
    stalled = RawDealer(m.endpoint, "stalled", ctx, rcvhwm=1)
    stalled.hello()
    status, body = stalled.call(Op.STATS, P.MASTER_ROUTE)
    reply_bytes = len(_packb(body))
    other.put("warm", value("warm", 4 * KiB))
    rss0 = proc.memory_info().rss
    lat: list[float] = []
    try:
        for i in range(5000):
            stalled.send(Op.STATS, P.MASTER_ROUTE)
            if i % 10 == 0:
                k = f"absent-{i}".encode()
                for _ in range(40):
                    stalled.send(Op.EXIST_KEY, other._route(k), k)
        t_end = time.monotonic() + 60
        n = 0
        while time.monotonic() < t_end and n < 60:
            n += 1
            t0 = time.monotonic()
            k = f"other-{n}"
            other.put(k, value(k, 4 * KiB))
            assert intact(k, other.get(k)) and other.is_exist("warm")
            lat.append(time.monotonic() - t0)
            time.sleep(0.02)
        # Let the master work through everything the stalled peer sent.
        # (Handled, or dropped unhandled once its replies were being dropped; the
        # STATS count includes this loop's own.)
        def read_all() -> bool:
            s = other.stats()
            f = s["front"]
            return s["exist_miss_keys"] + f["stalled_dropped"] + f["op.stats.requests"] \
                >= 25000
        wait_until(read_all, 60, "the master to read the stalled peer's requests", step=0.2)
        assert other.stats()["front"]["stalled_dropped"] > 0
        time.sleep(1.0)
        grown = proc.memory_info().rss - rss0
    finally:
        stalled.close()
        ctx.term()
    assert max(lat) < 10, f"another client's call took {max(lat):.1f} s"
    assert other.check_consistency() == []
    assert grown < 24 * MiB, (f"master RSS grew {grown / MiB:.0f} MiB holding replies "
                              f"(~{reply_bytes} B each) for a peer that never reads")


def test_stopped_client_expires_and_recreates_its_segment_on_return(
        start_master, make_client) -> None:
    """A client stopped (SIGSTOP) past --client-ttl is expired while others keep
    working: its objects go and the master removes its file.  Resumed, it
    re-handshakes on its next call, creates a fresh segment file (the old one is
    gone), and never gets its old objects back."""
    # A TTL well above a loaded machine's scheduling stalls: the child must not be
    # expired before it is stopped.
    m = start_master("--client-ttl", "1.5")
    other = make_client(m, segment_bytes=MiB)
    s = Child("stalled_owner", m.addr)
    try:
        _, seg = s.recv()
        assert intact("mine", other.get("mine"))
        os.kill(s.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        n = 0
        while other.stats()["clients"] != 1:
            assert time.monotonic() - t0 < 10, "stopped client not expired"
            # Others are served meanwhile (in their own segment: a write placed in the
            # stopped client's segment would be erased with it when it expires).
            other.put(f"during-{n}", b"x" * 100,
                      ReplicateConfig(preferred_segments=[other.segment_name]))
            n += 1
        wait_until(lambda: not os.path.exists(shm(seg)), 5, "the stopped client's file to go")
        assert not other.is_exist("mine")
        os.kill(s.pid, signal.SIGCONT)
        s.send("go")
        _, after = s.recv()
        assert after["old"] == "missing"
        assert after["seg"] != seg and after["file"] and after["where"] == after["seg"]
        assert after["reconnects"] >= 1
        assert intact("mine2", other.get("mine2"))
        assert not os.path.exists(shm(seg))
        assert other.check_consistency() == []
        s.send("close")
        assert s.join() == 0
    finally:
        s.cleanup()


def test_stopped_writer_resuming_after_takeover_cannot_corrupt_the_new_value(
        start_master, make_client) -> None:
    """A writer stops (SIGSTOP) half way through its bytes; after the discard timeout
    another writer stores the key.  The first one resumes before the release timeout,
    finishes writing into its old range and tries PUT_END: refused, and the stored
    value is untouched (its range was not reused)."""
    m = start_master("--master-segment-size", str(4 * MiB), "--put-start-discard-timeout",
                     "0.4", "--put-start-release-timeout", "3.0")
    obs = make_client(m, segment_bytes=0)
    size = 256 * KiB
    w = Child("writer", m.addr, 0, "master", ["k"], size, "stall")
    try:
        _, starts, _ = w.recv()
        w.recv()  # half written, about to stop itself
        wait_until(lambda: psutil.Process(w.pid).status() == psutil.STATUS_STOPPED, 5,
                   "the writer to stop")
        new = value("k", size, b"new")
        wait_until(lambda: obs.put("k", new) is None and obs.is_exist("k"), 3,
                   "the key to be taken over")
        assert obs.get("k") == new
        assert obs.query_key("k")["replicas"][0][1] != starts[0][1][0][1]
        os.kill(w.pid, signal.SIGCONT)
        _, end_code = w.recv()
        assert end_code in (Status.OBJECT_NOT_FOUND, Status.ILLEGAL_CLIENT), end_code
        assert obs.get("k") == new
        w.send("close")
        assert w.join() == 0
    finally:
        w.cleanup()
    wait_until(lambda: obs.stats()["allocated_bytes"] == align_up(size), 6,
               "the stale write's range to be released")
    assert obs.get("k") == new
    assert obs.check_consistency() == []


# ------------------------------------------------------------------ racing writers


def test_racing_put_starts_have_exactly_one_winner(start_master, make_client) -> None:
    """Two processes see each key absent, meet at a barrier and PUT_START it at once:
    exactly one gets replicas, the other OBJECT_ALREADY_EXISTS and cannot end the
    winner's write; the stored value is the winner's; no space leaks."""
    m = start_master("--shards", "2")
    obs = make_client(m, segment_bytes=8 * MiB)
    keys = [f"race-{i}" for i in range(30)]
    barrier = CTX.Barrier(2)
    racers = [Child("raw_racer", m.addr, wid, keys, barrier) for wid in (1, 2)]
    try:
        results = [r.recv(60)[1] for r in racers]
    finally:
        for r in racers:
            r.join(10)
            r.cleanup()
    total = 0
    for i, k in enumerate(keys):
        a, b = results[0][i], results[1][i]
        assert sorted((a[1], b[1])) == ["lost", "won"], (a, b)
        winner, loser = (a, b) if a[1] == "won" else (b, a)
        wid = 1 if winner is a else 2
        assert loser[2] == Status.OBJECT_ALREADY_EXISTS
        assert loser[3] in (Status.ILLEGAL_CLIENT, Status.OBJECT_NOT_FOUND)
        assert obs.get(k) == value(k, winner[2], b"w%d" % wid)
        total += align_up(winner[2])
    s = obs.stats()
    assert s["keys"] == len(keys) and s["pending_writes"] == 0
    assert s["allocated_bytes"] == total
    assert obs.check_consistency() == []


def test_racing_puts_and_upserts_store_one_intact_value(start_master, make_client) -> None:
    """Two processes write the same keys at the same moments through put, put_batch,
    upsert and upsert_batch: every call answers success (write-once puts: the key is
    stored; a refused upsert races a newer one), each key holds exactly one writer's
    intact bytes, no crash, and the allocator holds exactly the stored bytes."""
    m = start_master("--shards", "2")
    obs = make_client(m, segment_bytes=8 * MiB)
    keys = [f"both-{i}" for i in range(96)]
    barrier = CTX.Barrier(2)
    racers = [Child("racer", m.addr, wid, keys, 1000 + wid, barrier) for wid in (1, 2)]
    try:
        results = [r.recv(60)[1] for r in racers]
    finally:
        for r in racers:
            r.join(10)
            r.cleanup()
    for res in results:
        assert all(x in (None, 0) for x in res), res
    got = obs.get_batch(keys)
    for k, v in zip(keys, got):
        assert intact(k, v), k
        assert any(v == value(k, len(v), b"w%d" % wid) for wid in (1, 2)), k
    s = obs.stats()
    assert s["keys"] == len(keys) and s["pending_writes"] == 0
    assert s["allocated_bytes"] == sum(align_up(len(v)) for v in got)
    assert obs.check_consistency() == []
