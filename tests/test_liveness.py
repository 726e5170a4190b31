"""Client and master liveness: expiry of a killed client, clean close, the
master's own segment, shutdown, and re-handshake after a master restart."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

import pytest

from kvmaster import (
    AsyncClient,
    Client,
    ClientConfig,
    ConnectionLost,
    ObjectNotFound,
    ReplicateConfig,
    ShuttingDown,
    Timeout,
)
from tests.support import wait_until

MiB = 1 << 20


def shm_path(name: str) -> str:
    return os.path.join("/dev/shm", name)


def _owner_main(conn: Any, addr: str, keys: list[str]) -> None:
    """Put ``keys`` into this process's own segment, report, then idle until killed."""
    c = Client()
    try:
        c.setup(addr, 4 * MiB)
        own = ReplicateConfig(preferred_segments=[c.segment_name])
        for k in keys:
            c.put(k, k.encode() * 1000, own)
        conn.send(("ok", c.segment_name))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("err", repr(exc)))
        c.close()
        return
    conn.poll(60)  # the parent kills us long before this
    c.close()


def test_killed_client_is_expired_and_its_segment_removed(start_master, make_client) -> None:
    m = start_master("--client-ttl", "0.5")
    other = make_client(m, segment_bytes=4 * MiB)
    keys = [f"victim-{i}" for i in range(5)]

    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_owner_main, args=(child_end, m.addr, keys), daemon=True)
    proc.start()
    child_end.close()
    try:
        assert parent_end.poll(30), "owner process did not report"
        status, seg = parent_end.recv()
        assert status == "ok", seg
        assert os.path.exists(shm_path(seg))
        for k in keys:
            assert other.query_key(k)["replicas"][0][0] == seg
        assert other.get("victim-0") == b"victim-0" * 1000
        assert other.stats()["clients"] == 2

        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        took = wait_until(lambda: not other.is_exist("victim-0"), 5, "the client to expire")
        assert took < 4
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent_end.close()

    assert other.batch_is_exist(keys) == [0] * len(keys)
    with pytest.raises(ObjectNotFound):
        other.get("victim-1")
    wait_until(lambda: not os.path.exists(shm_path(seg)), 5, "the master to unlink the segment")
    s = other.stats()
    assert s["clients"] == 1 and s["segments"] == 1 and s["front"]["clients_expired"] == 1
    assert s["keys"] == 0

    # The store keeps working for everyone else.
    other.put("after", b"a" * 5000)
    assert other.get("after") == b"a" * 5000
    late = make_client(m, segment_bytes=0)
    assert late.get("after") == b"a" * 5000


def test_idle_client_is_kept_alive_by_heartbeats(start_master, make_client) -> None:
    m = start_master("--client-ttl", "0.5")
    idle = make_client(m, segment_bytes=MiB)
    idle.put("k", b"v" * 100, ReplicateConfig(preferred_segments=[idle.segment_name]))
    time.sleep(1.2)  # more than twice the TTL without a request of its own
    watcher = make_client(m, segment_bytes=0)
    assert watcher.is_exist("k")
    s = watcher.stats()
    assert s["front"]["clients_expired"] == 0 and s["clients"] == 2
    assert idle.reconnect_count == 0


def test_clean_close_unmounts_and_removes_segment_file(master, make_client) -> None:
    owner = Client()
    owner.setup(master.addr, 4 * MiB)
    try:
        seg = owner.segment_name
        assert seg and os.path.exists(shm_path(seg))
        owner.put("k", b"x" * 4096, ReplicateConfig(preferred_segments=[seg]))
        reader = make_client(master, segment_bytes=0)
        assert reader.get("k") == b"x" * 4096
        assert reader.stats()["segments"] == 1
    finally:
        owner.close()
    assert not os.path.exists(shm_path(seg))
    assert owner.segment_name is None
    s = reader.stats()
    assert s["segments"] == 0 and s["clients"] == 1 and s["keys"] == 0
    assert not reader.is_exist("k")
    owner.close()  # closing twice is harmless


def test_master_segment_serves_consumer_only_clients(start_master) -> None:
    m = start_master("--master-segment-size", "8388608")
    writer, reader = Client(), Client()
    writer.setup(m.addr, 0)
    reader.setup(m.addr, 0)
    try:
        assert writer.segment_name is None
        s = writer.stats()
        assert s["segments"] == 1 and s["capacity_bytes"] > 0
        v = os.urandom(MiB)
        writer.put("k", v)
        seg = writer.query_key("k")["replicas"][0][0]
        assert os.path.exists(shm_path(seg))
        assert reader.get("k") == v
        assert writer.put_batch(["a", "b"], [b"1" * 10, b"2" * 20]) == [0, 0]
        assert reader.get_batch(["a", "b", "c"]) == [b"1" * 10, b"2" * 20, None]
    finally:
        writer.close()
        reader.close()
    assert m.stop() == 0
    assert not os.path.exists(shm_path(seg))  # the master unlinks its own segment


def test_sigterm_exits_cleanly_and_requests_fail_fast(start_master) -> None:
    """The call in flight when the master drains and stops ends at once, answered
    SHUTTING_DOWN or with its connection closed, not after its timeout (5 s)."""
    m = start_master()
    c = Client(ClientConfig(connect_timeout_s=0.5))
    c.setup(m.addr, MiB, timeout_s=5.0)
    stopped_at = [0.0]
    errors: list[BaseException] = []
    calls = [0]

    def hammer() -> None:
        try:
            while True:
                c.is_exist("k")
                calls[0] += 1
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    try:
        c.put("k", b"v")
        t = threading.Thread(target=hammer, daemon=True)
        t.start()
        wait_until(lambda: calls[0] > 20, 5, "requests to flow")
        stopped_at[0] = time.monotonic()
        m.proc.send_signal(signal.SIGTERM)
        m.proc.wait(timeout=10)
        assert m.stop() == 0, m.stderr
        assert "stopped" in m.stderr
        t.join(timeout=10)
        assert not t.is_alive(), "a request hung after the master stopped"
        assert len(errors) == 1 and isinstance(errors[0], (ShuttingDown, ConnectionLost)), errors
        assert time.monotonic() - stopped_at[0] < 3.0

        # After the master is gone: an error within the timeout, never a hang.
        t0 = time.monotonic()
        with pytest.raises((Timeout, ShuttingDown, ConnectionLost)):
            c.put("k2", b"v")
        assert time.monotonic() - t0 < 5.0 + 2.0
    finally:
        c.close()


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_a_call_waiting_when_the_master_dies_ends_at_once(start_master, aio) -> None:
    """A call waiting for its reply when the master dies (SIGKILL of a stopped master,
    so the call cannot have been answered) raises ConnectionLost as soon as the
    connection closes, not after its 20 s timeout; the client then serves a master
    restarted on the same endpoint."""
    m = start_master()
    port = m.addr.rsplit(":", 1)[1]
    cfg = ClientConfig(timeout_s=20.0, connect_timeout_s=2.0)
    outcome: list[Any] = []

    async def run_async() -> None:
        c = AsyncClient(cfg)
        await c.setup(m.addr, MiB)
        try:
            await c.put("k", b"v")
            m.proc.send_signal(signal.SIGSTOP)
            call = asyncio.ensure_future(c.is_exist("k"))
            await asyncio.sleep(0.3)
            killed = time.monotonic()
            m.proc.kill()
            try:
                await call
                outcome.append(("answered", 0.0))
            except ConnectionLost as exc:
                outcome.append((exc, time.monotonic() - killed))
            m.stop()
            start_master("--port", port)
            assert await c.is_exist("k") is False  # a fresh master starts empty
            await c.put("k2", b"v")
        finally:
            await c.close()

    if aio:
        asyncio.run(run_async())
    else:
        c = Client(cfg)
        c.setup(m.addr, MiB)
        try:
            c.put("k", b"v")
            m.proc.send_signal(signal.SIGSTOP)

            def call() -> None:
                try:
                    c.is_exist("k")
                    outcome.append(("answered", 0.0))
                except ConnectionLost as exc:
                    outcome.append((exc, time.monotonic() - killed[0]))

            killed = [0.0]
            t = threading.Thread(target=call, daemon=True)
            t.start()
            time.sleep(0.3)
            killed[0] = time.monotonic()
            m.proc.kill()
            t.join(timeout=10)
            assert not t.is_alive(), "the call waited on"
            m.stop()
            start_master("--port", port)
            assert c.is_exist("k") is False
            c.put("k2", b"v")
        finally:
            c.close()
    (what, took), = outcome
    assert isinstance(what, ConnectionLost) and "may or may not" in str(what), outcome
    assert took < 2.0, took


class _RestartingRouter:
    """A raw ROUTER peer standing in for a master on loopback, deterministic where a
    real master's timing is not: it answers the first ``busy`` routed requests BUSY,
    then, right after the last, closes its socket and binds a new one on the same port
    (a restart: it knows no client, answers NOT_REGISTERED until HELLO, then EXIST_KEY
    with 1)."""

    def __init__(self, busy: int) -> None:
        import uuid

        import zmq

        from kvmaster import protocol as P

        self.ctx = zmq.Context()
        self.busy = busy
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stopping = False
        self.restarted = False
        self.P, self.zmq, self.uuid = P, zmq, uuid
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _welcome(self, instance: str) -> dict:
        P = self.P
        return {"master_version": "x", "protocol": list(P.PROTOCOL_VERSION), "shard_count": 1,
                "tenant": "default", "lease_ttl_ms": 5000, "client_ttl_ms": 10000,
                "limits": {"max_batch": 1024, "max_key_bytes": 4096,
                           "kv_session_max_batch": 1024, "kv_sessions": True},
                "master_host_id": "elsewhere", "master_instance": instance,
                "batch_any_shard": True}

    def _serve(self) -> None:
        P, zmq = self.P, self.zmq
        known: set[bytes] = set()
        instance = self.uuid.uuid4().hex
        busy = self.busy
        while not self.stopping:
            if not self.sock.poll(50):
                continue
            ident, op, _, payload = self.sock.recv_multipart()
            req_id = P.peek_req_id(payload)

            def answer(status: int, body: Any) -> None:
                self.sock.send_multipart([ident, op, P.encode_reply(req_id, status, body)])

            if op == P.Op.HELLO.value:
                known.add(ident)
                answer(0, self._welcome(instance))
            elif ident not in known:
                answer(P.Status.NOT_REGISTERED, "send HELLO before other requests")
            elif op in (P.Op.HEARTBEAT.value, P.Op.BYE.value):
                answer(0, 0)
            elif busy:
                busy -= 1
                answer(P.Status.BUSY, "shard inbox full, retry later")
                if not busy and not self.restarted:
                    self.sock.close(linger=2000)  # the BUSY goes out, then the connection closes
                    self.sock = self.ctx.socket(zmq.ROUTER)
                    for _ in range(400):
                        try:
                            self.sock.bind(f"tcp://127.0.0.1:{self.port}")
                            break
                        except zmq.ZMQError:
                            time.sleep(0.005)
                    known, instance, self.restarted = set(), self.uuid.uuid4().hex, True
            else:
                answer(0, 1)

    def close(self) -> None:
        self.stopping = True
        self.thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_a_busy_resend_after_the_master_restarted_in_the_pause_reaches_the_new_master(
        aio: bool) -> None:
    """The master answers BUSY and restarts during the client's pause: the resend goes
    to the new master (NOT_REGISTERED, a re-handshake, the call again), not failed with
    ConnectionLost for the close that came before it."""
    fake = _RestartingRouter(busy=6)
    cfg = ClientConfig(timeout_s=5.0)
    addr = f"127.0.0.1:{fake.port}"
    try:
        if aio:
            async def main() -> bool:
                a = AsyncClient(cfg)
                await a.setup(addr, 0)
                try:
                    return await a.is_exist("k")
                finally:
                    await a.close()

            assert asyncio.run(main()) is True
        else:
            c = Client(cfg)
            c.setup(addr, 0)
            try:
                assert c.is_exist("k") is True
                assert c.reconnect_count == 1
            finally:
                c.close()
        assert fake.restarted
    finally:
        fake.close()


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_every_connection_of_a_client_sees_its_handshake(start_master, aio: bool) -> None:
    """The monitor is attached before the connect: made after, it missed the handshake
    of a connection that finished first (2 in 500 sync connections, 8 in 300 async ones
    on loopback), and then ignored that connection's close (a call in flight when the
    master died waited out its timeout)."""
    m = start_master()
    n = 200
    if aio:
        async def main() -> int:
            a = AsyncClient(ClientConfig())
            await a.setup(m.addr, 0)
            unseen = 0
            try:
                for _ in range(n):
                    await a._connect_once()
                    a._check_monitor()
                    unseen += not a._link.linked
            finally:
                await a.close()
            return unseen

        assert asyncio.run(main()) == 0
        return
    c = Client(ClientConfig())
    c.setup(m.addr, 0)
    unseen = 0
    try:
        for _ in range(n):
            with c._lock:
                c._connect_once(5.0)
                c._disconnected()
                unseen += not c._link.linked
    finally:
        c.close()
    assert unseen == 0


def test_re_handshakes_while_the_master_is_stopped_never_stall_the_client(start_master) -> None:
    """Re-handshakes while the master is stopped close sockets whose connections are up
    or still in their handshake.  A socket's monitor must be stopped before its PAIR
    end closes: libzmq sends monitor events with a blocking send, and one with nobody
    to take it blocked the context's I/O thread for good, so that no request of the
    client reached the master again (test_client_recovers_when_a_stopped_master_resumes
    failed about one run in five)."""
    m = start_master("--client-ttl", "60")
    c = Client(ClientConfig(timeout_s=2.0, connect_timeout_s=0.2))
    c.setup(m.addr, 0)
    try:
        for _ in range(8):
            m.proc.send_signal(signal.SIGSTOP)
            try:
                for _ in range(3):
                    with c._lock, pytest.raises(Timeout):
                        c._connect_once(0.2)  # a new socket each time; no WELCOME
            finally:
                m.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: _served(c), 5, "the client to be served again", step=0.05)
    finally:
        c.close()


def _served(c: Client) -> bool:
    try:
        c.stats()
        return True
    except (Timeout, ConnectionLost):
        return False


def test_client_rehandshakes_after_master_restart(start_master, caplog) -> None:
    first = start_master()
    port = first.addr.rsplit(":", 1)[1]
    hooks: list[int] = []
    c = Client(ClientConfig(connect_timeout_s=2.0))
    c.setup(first.addr, MiB, timeout_s=3.0,
            on_reconnect=lambda cl: hooks.append(cl.reconnect_count))
    try:
        c.put("before", b"x" * 100)
        assert first.stop() == 0

        second = start_master("--port", port)
        assert second.addr == first.addr
        with caplog.at_level(logging.WARNING, logger="kvmaster.client"):
            s = c.stats()  # the new master does not know us: HELLO again, remount, hook
        assert hooks == [1] and c.reconnect_count == 1
        # The log line names the reason.
        assert [r.getMessage() for r in caplog.records if "re-handshaking" in r.getMessage()] \
            == [f"re-handshaking with master {c.endpoint} as client {c.client_id}: the master "
                "does not know this client (a restart, or it expired the client)"]
        assert s["clients"] == 1 and s["segments"] == 1
        with pytest.raises(ObjectNotFound):
            c.get("before")  # a fresh master starts empty
        c.put("after", b"y" * 100)
        assert c.get("after") == b"y" * 100
        assert c.query_key("after")["replicas"][0][0] == c.segment_name
    finally:
        c.close()


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_calls_after_a_restart_with_another_shard_count_are_routed_anew(start_master,
                                                                         aio: bool) -> None:
    # Requests built for 4 shards would be refused (wrong shard, or a route beyond
    # the new count): the client builds the call again after the re-handshake.
    first = start_master("--shards", "4")
    port = first.addr.rsplit(":", 1)[1]
    keys = [f"k{i}" for i in range(40)]

    def layouts() -> list[Any]:
        return [("16", lambda c: c.is_exist("k7")), ("1", lambda c: c.put_batch(keys, [b"v"] * 40)),
                ("3", lambda c: c.get_batch(keys))]

    if not aio:
        c = Client(ClientConfig(connect_timeout_s=2.0))
        c.setup(first.addr, MiB, timeout_s=3.0)
        try:
            c.put("k7", b"x")
            m = first
            results = []
            for shards, call in layouts():
                assert m.stop() == 0
                m = start_master("--port", port, "--shards", shards)
                results.append(call(c))
            assert results[0] is False  # a fresh master
            assert results[1] == [0] * 40
            assert results[2] == [None] * 40  # that master was fresh too
            assert c.reconnect_count == 3
        finally:
            c.close()
        return

    async def main() -> None:
        c = AsyncClient(ClientConfig(connect_timeout_s=2.0))
        await c.setup(first.addr, MiB, timeout_s=3.0)
        try:
            m = first
            for shards, _ in layouts():
                assert m.stop() == 0
                m = start_master("--port", port, "--shards", shards)
                assert await c.put_batch(keys, [b"v"] * 40) == [0] * 40
                assert await c.get_batch(keys) == [b"v"] * 40
        finally:
            await c.close()

    asyncio.run(main())


@pytest.mark.parametrize("batch", [False, True], ids=["put", "put_batch"])
def test_a_put_whose_master_restarted_between_start_and_end_is_connection_lost(
        start_master, batch: bool) -> None:
    """The master restarts while a put copies its bytes: the end, sent again to the new
    master after the re-handshake, finds no write there. The put raises ConnectionLost
    (nothing stored; write again), not a per-key OBJECT_NOT_FOUND or ObjectNotFound."""
    first = start_master()
    port = first.addr.rsplit(":", 1)[1]
    c = Client(ClientConfig(connect_timeout_s=2.0))
    c.setup(first.addr, MiB, timeout_s=5.0)
    real = {"local": c._local, "view": c._local_seg}  # (the batch put's lookup)
    restarted: list[Any] = []

    def restart_first(name: str) -> Any:  # called between the start's reply and the end
        if not restarted:
            assert first.stop() == 0
            restarted.append(start_master("--port", port))
        return real["view" if batch else "local"](name)

    try:
        c.put("warm", b"w" * 100)
        if batch:
            c._local_seg = restart_first  # type: ignore[method-assign]
            with pytest.raises(ConnectionLost, match="between the start and the end"):
                c.put_batch(["a", "b"], [b"x" * 100] * 2)
        else:
            c._local = restart_first  # type: ignore[method-assign]
            with pytest.raises(ConnectionLost, match="between the start and the end"):
                c.put("a", b"x" * 100)
        assert c.reconnect_count == 1
        c._local, c._local_seg = real["local"], real["view"]  # type: ignore[method-assign]
        assert c.put_batch(["a", "b"], [b"y" * 100] * 2) == [0, 0]
        assert c.get_batch(["a", "b"]) == [b"y" * 100] * 2
    finally:
        c.close()


def test_a_put_whose_master_restarted_before_its_copy_writes_nothing(start_master) -> None:
    """The master restarts after a put_batch's start, while the client looks its
    segments up: the ranges the old master gave may be other keys' on the new one, so
    the client copies nothing and raises ConnectionLost; its own earlier bytes stay."""
    first = start_master()
    port = first.addr.rsplit(":", 1)[1]
    c = Client(ClientConfig(connect_timeout_s=2.0))
    c.setup(first.addr, MiB, timeout_s=5.0)
    real_know = c._know
    restarted: list[Any] = []

    def know_after_restart(replicas: Any) -> Any:
        if not restarted:
            assert first.stop() == 0
            restarted.append(start_master("--port", port))
            c._seg_info.clear()  # so that the look-up asks the (new) master
        return real_know(replicas)

    try:
        c.put("warm", b"w" * 100)
        view = c._local_view(c.segment_name)
        before = bytes(view)
        c._know = know_after_restart  # type: ignore[method-assign]
        with pytest.raises(ConnectionLost, match="between the start and the end"):
            c.put_batch(["a", "b"], [b"x" * 100] * 2)
        assert bytes(view) == before  # nothing was copied
        c._know = real_know  # type: ignore[method-assign]
        assert c.put_batch(["a", "b"], [b"y" * 100] * 2) == [0, 0]
        assert c.get_batch(["a", "b"]) == [b"y" * 100] * 2
    finally:
        c.close()
