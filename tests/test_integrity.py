"""Integrity: no wrong byte reaches a reader silently (RELIABILITY.md "Integrity").

Real master processes, real client processes, real shared memory.  A segment's owner
runs in its own process (:class:`Owner`) and does to its file what a buggy or hostile
owner could, behind the master's back: overwrite ranges of it, or shrink it.  Readers
must then get ChecksumMismatch (-801) or TRANSFER_FAIL (-800), never the wrong bytes,
and never die of SIGBUS; the corrupt replica is dropped on the master.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq

from kvmaster import AsyncClient, Client, ClientConfig, ReplicateConfig
from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._integrity import checksum
from kvmaster.protocol import Op, Status
from tests.support import wait_until

CTX = mp.get_context("spawn")
KiB, MiB = 1 << 10, 1 << 20
MISMATCH = int(Status.CHECKSUM_MISMATCH)
TRANSFER_FAIL = int(Status.TRANSFER_FAIL)


def value(tag: str, n: int) -> bytes:
    """``n`` bytes that differ from key to key."""
    seed = tag.encode() * (n // max(1, len(tag)) + 1)
    return bytes((b + i) & 0xFF for i, b in enumerate(seed[:n]))


def flipped(data: bytes) -> bytes:
    return bytes(b ^ 0xA5 for b in data)


def replicas_of(c: Client, key: str) -> list[list[Any]]:
    return c.query_key(key)["replicas"]


def gone(c: Client, key: str) -> bool:
    try:
        c.query_key(key)
    except E.ObjectNotFound:
        return True
    return False


# ------------------------------------------------------------- child processes


def _owner_main(conn: Any, addr: str, seg_bytes: int) -> None:
    """A client contributing a segment; on command it overwrites ranges of its own file
    or shrinks it (``pwrite``/``ftruncate`` on the file: behind the master's back)."""
    c = Client(ClientConfig(timeout_s=5.0))
    c.setup(addr, seg_bytes)
    path = f"/dev/shm/{c.segment_name}"
    conn.send(("ready", c.segment_name))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "overwrite":
                for off, data in args[0]:
                    fd = os.open(path, os.O_WRONLY)
                    try:
                        os.pwrite(fd, data, off)
                    finally:
                        os.close(fd)
                conn.send(("ok",))
            elif cmd == "truncate":
                os.truncate(path, args[0])
                conn.send(("ok",))
            elif cmd == "close":
                return
    finally:
        c.close()


def _reader_main(conn: Any, addr: str, keys: list[str], values: list[bytes]) -> None:
    """A client without a segment that, on command, reads ``keys`` every way it can
    (whatever the segment holding them has become) and reports per way what it got:
    "ok" (the right bytes), "WRONG" (wrong bytes returned as if good), or a status."""
    c = Client(ClientConfig(timeout_s=5.0))
    c.setup(addr, 0)
    conn.send(("ready",))
    conn.recv()
    report: dict[str, list[Any]] = {}

    def one(name: str, fn: Callable[[], Any], check: Callable[[Any], bool]) -> None:
        try:
            got = fn()
        except E.KVMasterError as exc:
            report.setdefault(name, []).append(int(exc.code))
            return
        report.setdefault(name, []).append("ok" if check(got) else "WRONG")

    for k, v in zip(keys, values):
        one("get", lambda k=k: c.get(k), lambda got, v=v: got == v)
        buf = bytearray(len(v))
        one("get_into", lambda k=k, buf=buf: c.get_into(k, buf),
            lambda got, v=v, buf=buf: bytes(buf) == v)
    def batch(name: str, fn: Callable[[], list[Any]], held: Callable[[int], bytes]) -> None:
        """A batch read: per position its status, or whether its buffer is right."""
        try:
            got = fn()
        except E.KVMasterError as exc:  # the batch as a whole
            report[name] = [int(exc.code)]
            return
        report[name] = [int(g) if g < 0 else "ok" if held(i) == values[i] else "WRONG"
                        for i, g in enumerate(got)]

    bufs = [bytearray(len(v)) for v in values]
    batch("batch_get_into", lambda: c.batch_get_into(keys, bufs), lambda i: bytes(bufs[i]))
    raw = [ctypes.create_string_buffer(len(v)) for v in values]
    batch("batch_get_into_ptrs",
          lambda: c.batch_get_into_ptrs(keys, [[ctypes.addressof(b)] for b in raw],
                                        [[len(v)] for v in values]), lambda i: raw[i].raw)
    one("get_batch", lambda: c.get_batch(keys),
        lambda got: all(g is None or g == v for g, v in zip(got, values)))
    # A write that goes to the shrunk segment: a pwrite past its end extends the file.
    one("put", lambda: c.put("after-shrink", b"w" * 4096), lambda got: got is None)
    one("get_after_put", lambda: c.get("after-shrink"), lambda got: got == b"w" * 4096)
    conn.send(("report", report))
    c.close()


def _child_main(conn: Any, role: str, args: tuple[Any, ...]) -> None:
    try:
        {"owner": _owner_main, "reader": _reader_main}[role](conn, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        try:
            conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
        except OSError:
            pass


class Child:
    """A spawned process running ``_<role>_main(conn, *args)``."""

    def __init__(self, role: str, *args: Any) -> None:
        self.conn, end = CTX.Pipe()
        self.proc = CTX.Process(target=_child_main, args=(end, role, args), daemon=True)
        self.proc.start()
        end.close()

    def recv(self, timeout: float = 30.0) -> Any:
        assert self.conn.poll(timeout), f"child {self.proc.pid} did not report in {timeout} s"
        msg = self.conn.recv()
        if msg[0] == "error":
            raise AssertionError(f"child {self.proc.pid} failed: {msg[1]}")
        return msg

    def ask(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self.recv()

    def stop(self) -> int | None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close",))
            except OSError:
                pass
            self.proc.join(20)
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(10)
        self.conn.close()
        return self.proc.exitcode


class Owner(Child):
    """A client process whose segment receives the objects (the writer and readers of
    the tests contribute none)."""

    def __init__(self, addr: str, seg_bytes: int = 16 * MiB) -> None:
        super().__init__("owner", addr, seg_bytes)
        _, self.segment = self.recv()

    def overwrite(self, ranges: list[tuple[int, bytes]]) -> None:
        assert self.ask("overwrite", ranges) == ("ok",)

    def truncate(self, size: int) -> None:
        assert self.ask("truncate", size) == ("ok",)


@pytest.fixture
def world(start_master, make_client):
    """A master, an owner process holding the only segment, a writer and a reader (both
    in this process, without segments of their own)."""
    m = start_master("--shards", "2")
    owners: list[Owner] = []

    def owner(seg_bytes: int = 16 * MiB) -> Owner:
        o = Owner(m.addr, seg_bytes)
        owners.append(o)
        return o

    o = owner()
    writer = make_client(m, segment_bytes=0)
    reader = make_client(m, segment_bytes=0)
    yield m, o, writer, reader, owner
    assert reader.check_consistency() == []
    for o in owners:
        assert o.stop() == 0


def corrupt(owner: Owner, c: Client, key: str, v: bytes) -> list[Any]:
    """Overwrite the (first) replica of ``key`` in ``owner``'s file with other bytes of
    the same length; -> that replica."""
    (seg, off), *_ = [r for r in replicas_of(c, key) if r[0] == owner.segment]
    owner.overwrite([(off, flipped(v))])
    return [seg, off]


# ------------------------------------------------------------------ (a) overwrite

READS = ["get", "get_buffer", "get_into", "get_batch", "batch_get_into",
         "batch_get_into_parts", "batch_get_into_ptrs", "async_get", "async_get_batch"]


def _read(reader: Client, m: Any, how: str, keys: list[str], sizes: list[int]) -> list[Any]:
    """Read ``keys`` with ``how``; per key: the bytes, or a negative status (a single
    key's exception as its code; get_batch's None as -801 is not assumed: None)."""
    def single(fn: Callable[[str], Any]) -> list[Any]:
        out = []
        for k in keys:
            try:
                out.append(bytes(fn(k)))
            except E.KVMasterError as exc:
                out.append(int(exc.code))
        return out

    if how == "get":
        return single(reader.get)
    if how == "get_buffer":
        return single(reader.get_buffer)
    if how == "get_into":
        def into(k: str) -> bytes:
            buf = bytearray(sizes[keys.index(k)])
            reader.get_into(k, buf)
            return bytes(buf)
        return single(into)
    if how == "get_batch":
        return reader.get_batch(keys)
    if how == "batch_get_into":
        bufs = [bytearray(n) for n in sizes]
        got = reader.batch_get_into(keys, bufs)
        return [bytes(b) if g >= 0 else int(g) for g, b in zip(got, bufs)]
    if how == "batch_get_into_parts":
        parts = [[bytearray(n // 3), bytearray(n - n // 3)] for n in sizes]
        got = reader.batch_get_into_parts(keys, parts)
        return [b"".join(p) if g >= 0 else int(g) for g, p in zip(got, parts)]
    if how == "batch_get_into_ptrs":
        raw = [ctypes.create_string_buffer(n) for n in sizes]
        got = reader.batch_get_into_ptrs(keys, [[ctypes.addressof(b)] for b in raw],
                                         [[n] for n in sizes])
        return [b.raw if g >= 0 else int(g) for g, b in zip(got, raw)]

    async def run() -> list[Any]:
        a = AsyncClient()
        await a.setup(m.addr, 0)
        try:
            if how == "async_get_batch":
                return await a.get_batch(keys)
            out: list[Any] = []
            for k in keys:
                try:
                    out.append(await a.get(k))
                except E.KVMasterError as exc:
                    out.append(int(exc.code))
            return out
        finally:
            await a.close()

    return asyncio.run(run())


@pytest.mark.parametrize("how", READS)
def test_a_replica_its_owner_overwrote_is_never_returned_and_is_dropped(world, how) -> None:
    """Objects in the owner's segment, some of them overwritten by the owner: every
    whole-object read gives the right bytes for the others and ChecksumMismatch (-801;
    get_batch: None) for those, and their replica is gone from the master afterwards."""
    m, owner, writer, reader, _ = world
    keys = [f"{how}-{i}" for i in range(24)]
    sizes = [4 * KiB if i % 3 else 64 * KiB + 7 for i in range(len(keys))]
    values = [value(k, n) for k, n in zip(keys, sizes)]
    assert writer.put_batch(keys[:20], values[:20]) == [0] * 20
    for k, v in zip(keys[20:], values[20:]):
        writer.put(k, v)
    assert all(replicas_of(reader, k)[0][0] == owner.segment for k in keys)
    assert all(reader.query_key(k)["checksum"] == checksum(v) for k, v in zip(keys, values))
    bad = {3, 8, 21}
    for i in bad:
        corrupt(owner, reader, keys[i], values[i])

    got = _read(reader, m, how, keys, sizes)
    for i, (g, v) in enumerate(zip(got, values)):
        if i in bad:
            assert g in (MISMATCH, None), f"{keys[i]}: the overwritten bytes were returned"
            if how != "get_batch" and how != "async_get_batch":
                assert g == MISMATCH
        else:
            assert g == v, keys[i]
    if not how.startswith("async"):
        assert reader.checksum_mismatches == len(bad)
        assert reader.checksum_failures == len(bad)
    # The drops were sent before the call returned (and are applied before this
    # client's later requests to those shards); another client sees them soon after.
    wait_until(lambda: all(gone(reader, keys[i]) for i in bad), 10, "the corrupt replicas "
               "to be dropped")
    assert not any(gone(reader, keys[i]) for i in range(len(keys)) if i not in bad)
    assert reader.stats()["corrupt_replicas_dropped"] == len(bad)
    # The key can be written again, and then reads back.
    writer.put(keys[3], values[3])
    assert reader.get(keys[3]) == values[3]


def test_a_read_falls_back_to_a_good_replica_and_drops_the_bad_one(world) -> None:
    """Two replicas on two owners' segments, one of them overwritten: reads return the
    other's bytes, and the master keeps only the good replica."""
    m, first, writer, reader, owner = world
    second = owner()
    v = value("twice", 200 * KiB)
    writer.put("twice", v, ReplicateConfig(replica_num=2))
    w = [value(f"b{i}", 4 * KiB) for i in range(8)]
    keys = [f"b{i}" for i in range(8)]
    assert writer.put_batch(keys, w, ReplicateConfig(replica_num=2)) == [0] * 8
    assert sorted(r[0] for r in replicas_of(reader, "twice")) == \
        sorted([first.segment, second.segment])
    by_segment = {first.segment: first, second.segment: second}
    # The replica a read tries first (the first listed) is the one overwritten.
    bad = {k: replicas_of(reader, k)[0] for k in ("twice", "b5")}
    for k, data in (("twice", v), ("b5", w[5])):
        by_segment[bad[k][0]].overwrite([(bad[k][1], flipped(data))])
    assert reader.get("twice") == v
    assert reader.get_batch(keys) == w
    assert reader.checksum_mismatches == 2 and reader.checksum_failures == 0
    wait_until(lambda: len(replicas_of(reader, "twice")) == 1
               and len(replicas_of(reader, "b5")) == 1, 10, "the bad replicas to be dropped")
    for k in ("twice", "b5"):
        assert replicas_of(reader, k)[0] != bad[k]
    assert reader.get("twice") == v and reader.get("b5") == w[5]
    assert reader.checksum_mismatches == 2  # nothing bad is left to find


def test_a_writer_that_resumes_late_into_reused_space_is_caught(start_master, make_client
                                                                ) -> None:
    """The stale-writer attack: a write is started and never ended, its writer leaves
    (the master frees the range then) and another object is stored there; then the
    first writer's late copy lands (what the fence leaves: one block in flight).  The other object's reader gets ChecksumMismatch, not the
    late bytes."""
    m = start_master("--shards", "1", "--put-start-discard-timeout", "0.2",
                     "--put-start-release-timeout", "0.5")
    owner = Owner(m.addr, 1 * MiB)
    try:
        stale = make_client(m, segment_bytes=0)
        writer = make_client(m, segment_bytes=0)
        reader = make_client(m, segment_bytes=0)
        size = 256 * KiB
        bk = b"abandoned"
        (seg, off_stale), = stale._call(Op.PUT_START.value, stale._route(bk), [bk, size, None])
        # Its space is held while its writer is registered (write fencing); the writer
        # leaves (as an expiry would), and the range is free for the next write.
        stale.close()
        victims = [f"victim-{i}" for i in range(4)]
        vals = [value(k, size) for k in victims]
        assert writer.put_batch(victims, vals) == [0] * 4
        (hit,) = [k for k in victims
                  if replicas_of(reader, k)[0] == [seg, off_stale]]  # the reused range
        owner.overwrite([(off_stale, b"\xdd" * size)])  # the stale writer's late copy
        with pytest.raises(E.ChecksumMismatch):
            reader.get(hit)
        wait_until(lambda: gone(reader, hit), 10, "the overwritten replica to be dropped")
        assert [reader.get(k) for k in victims if k != hit] == \
            [v for k, v in zip(victims, vals) if k != hit]
    finally:
        assert owner.stop() == 0


# ------------------------------------------------------------------ (b) truncation


def test_a_segment_shrunk_by_its_owner_cannot_kill_a_reader(world) -> None:
    """The owner truncates its segment file under objects another process reads: the
    reader gets TRANSFER_FAIL (-800) or ChecksumMismatch (-801) for them, never wrong
    bytes, and does not die (a copy through a mapping past the file's end would raise
    SIGBUS); a write into the shrunk segment does not kill its writer either; the
    master keeps serving."""
    m, owner, writer, reader, _ = world
    keys = [f"t{i}" for i in range(16)]
    vals = [value(k, 16 * KiB) for k in keys]
    assert writer.put_batch(keys, vals) == [0] * 16
    child = Child("reader", m.addr, keys, vals)
    try:
        assert child.recv() == ("ready",)
        owner.truncate(0)
        child.conn.send(("read",))
        _, report = child.recv()
        child.proc.join(20)
        assert child.proc.exitcode == 0, f"the reader died (exit {child.proc.exitcode})"
    finally:
        child.stop()
    for how in ("get", "get_into", "batch_get_into", "get_batch", "batch_get_into_ptrs"):
        outcomes = report[how]
        assert "WRONG" not in outcomes, (how, outcomes)
        assert set(outcomes) <= {TRANSFER_FAIL, MISMATCH}, (how, outcomes)
    # A write placed in the shrunk file is refused by the writer, which checks a
    # peer's file is at least its mounted size (TRANSFER_FAIL); it does not die.
    assert report["put"] == [TRANSFER_FAIL], report["put"]
    # The master serves on: a segment that works, writes and reads in it.
    fresh = Owner(m.addr)
    try:
        writer.put("later", b"x" * 8192, ReplicateConfig(preferred_segments=[fresh.segment]))
        assert reader.get("later") == b"x" * 8192
    finally:
        assert fresh.stop() == 0


# ------------------------------------------------------- (c) older clients, (d) flags


class Raw13:
    """A client of protocol 1.3 on the wire: no checksum field, no flag, no drop op."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ids = iter(range(1, 1 << 30))
        st, w = self.call(Op.HELLO, b"", 1, 3, "raw-1.3", "default", os.uname().nodename, "0")
        assert st == 0, w
        self.shards = w["shard_count"]
        self.seed = P.tenant_seed("default")

    def call(self, op: Op, route: bytes, *fields: Any) -> tuple[int, Any]:
        req_id = next(self.ids)
        self.sock.send_multipart([op.value, route, msgpack.packb([req_id, *fields],
                                                                 use_bin_type=True)])
        assert self.sock.poll(10_000), "no reply"
        _, status, body = P.decode_reply(self.sock.recv_multipart()[-1])
        return status, body

    def route(self, key: bytes) -> bytes:
        return P.route_for_shard(P.shard_of(key, self.seed, self.shards))

    def close(self) -> None:
        self.call(Op.BYE, b"")
        self.sock.close(linger=0)
        self.ctx.term()


def test_writers_of_protocol_1_3_store_objects_that_read_fine(world) -> None:
    """A 1.3 writer's PUT_END / BATCH_PUT_END carry no checksum: its objects have none,
    read back fine (unverified), and a 1.3 reader gets the 1.3 reply shapes also for
    objects that have one."""
    m, owner, writer, reader, _ = world
    old = Raw13(m.endpoint)
    try:
        data = value("old", 10 * KiB)
        bk = b"old-single"
        st, reps = old.call(Op.PUT_START, old.route(bk), bk, len(data), None)
        assert st == 0
        (seg, off), = reps
        assert seg == owner.segment
        owner.overwrite([(off, data)])  # (the old writer's copy into the segment)
        assert old.call(Op.PUT_END, old.route(bk), bk) == (0, 0)
        assert "checksum" not in reader.query_key("old-single")
        assert reader.get("old-single") == data
        assert reader.get_batch(["old-single"]) == [data]
        # A batch end without checksums, in the 1.3 form.
        keys = [k for k in (f"old-{i}".encode() for i in range(40))
                if old.route(k) == old.route(b"old-0")][:4]
        vals = [value(k.decode(), 4 * KiB) for k in keys]
        st, body = old.call(Op.BATCH_PUT_START, old.route(keys[0]), keys, [4096] * len(keys),
                            None, 7)
        assert st == 0 and all(type(r) is list for r in body)
        owner.overwrite([(r[0][1], v) for r, v in zip(body, vals)])
        assert old.call(Op.BATCH_PUT_END, old.route(keys[0]), keys, 7) == (0, [0] * len(keys))
        assert reader.get_batch([k.decode() for k in keys]) == vals
        assert reader.checksum_mismatches == 0
        # A 1.3 reader of an object that has a checksum: the 1.3 shapes.
        writer.put("new", b"n" * 5000)
        st, desc = old.call(Op.GET_REPLICA_LIST, old.route(b"new"), b"new")
        assert st == 0 and len(desc) == 3 and desc[0] == 5000
        st, items = old.call(Op.BATCH_GET_REPLICA_LIST, old.route(b"new"), [b"new"])
        assert st == 0 and len(items[0]) == 3
        st, cols = old.call(Op.BATCH_GET_REPLICA_LIST, old.route(b"new"), [b"new"], True)
        assert st == 0 and len(cols) == 6
    finally:
        old.close()


def test_with_write_checksums_off_objects_are_stored_without_one(world) -> None:
    """``ClientConfig(write_checksums=False)``: the writer sends none (every put form);
    readers read its objects unverified."""
    m, owner, _, reader, _ = world
    w = Client(ClientConfig(write_checksums=False))
    w.setup(m.addr, 0)
    try:
        w.put("p", b"p" * 3000)
        w.put_parts("pp", b"a" * 100, b"b" * 200)
        assert w.put_batch(["b0", "b1"], [b"0" * 700, b"1" * 800]) == [0, 0]
        src = ctypes.create_string_buffer(b"z" * 900, 900)
        assert w.batch_put_from_ptrs(["ptr"], [[ctypes.addressof(src)]], [[900]]) == [0]
        pending = w.batch_put_start(["split"], [600])
        assert w.batch_write_ranges(pending, [0], [[(0, b"s" * 600)]]) == [600]
        assert w.batch_put_end(pending, [0]) == [0]
        for k in ("p", "pp", "b0", "b1", "ptr", "split"):
            assert "checksum" not in reader.query_key(k), k
        assert reader.get("pp") == b"a" * 100 + b"b" * 200
        assert reader.get_batch(["b0", "split"]) == [b"0" * 700, b"s" * 600]
    finally:
        w.close()


def test_every_put_form_stores_the_checksum_of_its_value(world) -> None:
    """With the defaults, each put form sends the xxh3_64 of the bytes it wrote."""
    m, owner, writer, reader, _ = world
    writer.put("p", b"p" * 3000)
    writer.upsert("p", b"q" * 3100)
    writer.put_parts("pp", b"a" * 100, b"b" * 200)
    assert writer.put_batch(["b0", "b1"], [b"0" * 700, b"1" * 800]) == [0, 0]
    assert writer.batch_put_from_parts(["bp"], [[b"x" * 10, b"y" * 20]]) == [0]
    src = ctypes.create_string_buffer(b"z" * 900, 900)
    assert writer.batch_put_from_ptrs(["ptr"], [[ctypes.addressof(src)]], [[900]]) == [0]
    pending = writer.batch_put_start(["split"], [600])
    assert writer.batch_write_ranges(pending, [0], [[(300, b"t" * 300), (0, b"s" * 300)]]) \
        == [600]
    assert writer.batch_put_end(pending, [0]) == [0]
    want = {"p": b"q" * 3100, "pp": b"a" * 100 + b"b" * 200, "b0": b"0" * 700,
            "b1": b"1" * 800, "bp": b"x" * 10 + b"y" * 20, "ptr": b"z" * 900,
            "split": b"s" * 300 + b"t" * 300}
    for k, v in want.items():
        assert reader.query_key(k)["checksum"] == checksum(v), k
        assert reader.get(k) == v


def test_with_verify_checksums_off_nothing_is_checked_or_dropped(world) -> None:
    """``ClientConfig(verify_checksums=False)``: the reader does not check (it returns
    what the replica holds, as it did before checksums) and drops nothing; a checking
    reader still finds the replica corrupt."""
    m, owner, writer, reader, _ = world
    v = value("unchecked", 8 * KiB)
    writer.put("unchecked", v)
    corrupt(owner, reader, "unchecked", v)
    blind = Client(ClientConfig(verify_checksums=False))
    blind.setup(m.addr, 0)
    try:
        assert blind.get("unchecked") == flipped(v)
        assert blind.get_batch(["unchecked"]) == [flipped(v)]
        assert blind.checksum_mismatches == 0 and not gone(blind, "unchecked")
        assert blind.stats()["corrupt_replicas_dropped"] == 0
    finally:
        blind.close()
    with pytest.raises(E.ChecksumMismatch):
        reader.get("unchecked")


def test_a_drop_names_the_replica_and_the_checksum_it_failed(world) -> None:
    """DROP_CORRUPT_REPLICAS takes a replica out only while the object still has it and
    still carries the checksum the reader compared against; anything else answers
    OBJECT_NOT_FOUND and changes nothing."""
    m, owner, writer, reader, _ = world
    writer.put("k", b"k" * 4096)
    (seg, off), = replicas_of(reader, "k")
    want = reader.query_key("k")["checksum"]
    route = reader._route(b"k")

    def drop(replica: list[Any], expected: int) -> Any:
        return reader._call(Op.DROP_CORRUPT_REPLICAS.value, route, [[b"k"], [replica],
                                                                    [expected]])

    assert drop([seg, off], want ^ 1) == [Status.OBJECT_NOT_FOUND]  # replaced meanwhile
    assert drop([seg, off + 64], want) == [Status.OBJECT_NOT_FOUND]  # not its replica
    assert drop(["kvmaster-0000000000000000", off], want) == [Status.OBJECT_NOT_FOUND]
    assert replicas_of(reader, "k") == [[seg, off]]
    with pytest.raises(E.InvalidParams):
        reader._call(Op.DROP_CORRUPT_REPLICAS.value, route, [[b"k"], [], [want]])
    # Another tenant's client names the same key: its own (absent) object, not this one.
    stranger = Client()
    stranger.setup(m.addr, 0, "other-tenant")
    try:
        assert stranger._call(Op.DROP_CORRUPT_REPLICAS.value, stranger._route(b"k"),
                              [[b"k"], [[seg, off]], [want]]) == [Status.OBJECT_NOT_FOUND]
    finally:
        stranger.close()
    assert replicas_of(reader, "k") == [[seg, off]]
    assert drop([seg, off], want) == [0]
    assert gone(reader, "k")
    assert drop([seg, off], want) == [Status.OBJECT_NOT_FOUND]


# ---------------------------------------------------------- the segment's copies


def test_a_segment_unlinked_while_it_is_opened_is_gone_not_a_bad_file(monkeypatch) -> None:
    """Its owner unlinks a segment between a peer's open and the peer's check of the
    file (0 links then): FileNotFoundError, so a write placed there is answered
    SEGMENT_NOT_FOUND like one whose file was already gone, not TRANSFER_FAIL."""
    from kvmaster import _segment
    from kvmaster._core import _write_failure
    from kvmaster._segment import Segment

    own = Segment.create(1 * MiB)
    real_fstat = os.fstat

    def fstat_after_unlink(fd: int) -> os.stat_result:
        os.unlink(_segment._path(own.name))
        return real_fstat(fd)

    monkeypatch.setattr(_segment.os, "fstat", fstat_after_unlink)
    with pytest.raises(FileNotFoundError) as got:
        Segment.attach(own.name)
    monkeypatch.undo()
    assert _write_failure(got.value) == Status.SEGMENT_NOT_FOUND
    own.close(unlink=False)


def test_a_peers_segment_is_copied_with_pread_and_pwrite() -> None:
    """Segment.attach maps nothing: its reads past the end of a file its owner shrank
    raise SegmentShrunk (an OSError), its writes there extend the file; write_each puts
    adjacent ranges in one pwritev, a gap under 64 bytes (an allocation's padding)
    written with zeros, and leaves other bytes alone."""
    from kvmaster._segment import Segment, SegmentShrunk

    own = Segment.create(1 * MiB)
    peer = Segment.attach(own.name)
    try:
        with open("/proc/self/maps") as f:
            assert sum(own.name in line for line in f) == 1  # the creator's mapping only
        own.buf[:] = b"\x01" * MiB
        items = [(i * 128, value(f"v{i}", 100)) for i in range(20)] + \
            [(8192, b"a" * 64), (8192 + 64, b"b" * 64), (20000, b"c" * 7)]
        peer.write_each(items)
        for off, data in items:
            assert own.read(off, len(data)) == data
        assert own.read(100, 28) == bytes(28)  # the padding between two adjacent values
        assert own.read(20007, 9) == b"\x01" * 9  # after the last range: untouched
        peer.write(30000, [b"x"] * 2000)  # more parts than one pwritev takes
        assert own.read(30000, 2000) == b"x" * 2000
        buf = bytearray(100)
        peer.read_into(0, buf)
        assert bytes(buf) == items[0][1] and peer.read(128, 100) == items[1][1]
        os.truncate(f"/dev/shm/{own.name}", 4096)
        with pytest.raises(SegmentShrunk):
            peer.read(8192, 64)
        with pytest.raises(SegmentShrunk):
            peer.read_into(4000, bytearray(200))
        peer.write(65536, [b"late"])  # extends the file again
        assert os.path.getsize(f"/dev/shm/{own.name}") == 65540
        assert peer.read(65536, 4) == b"late"
    finally:
        peer.close()
        own.close()
