"""One deadline per call, and no write left pending by a put that failed.

``ClientConfig.timeout_s`` bounds a whole call: every round trip of it (a put's
start, its segment lookup, its end), the BUSY pauses between resends and taking
the client's lock back after such a pause.  A put whose end gets no answer (or is
not sent, the deadline having passed), or whose start gets none, revokes its
write, so a later put of the key stores a readable value at once instead of being
told it exists.

Real masters on loopback.  To make a put's end fail at a chosen moment, the tests
wrap the client's look-up of the segment it copies into (``_local``, run between
PUT_START and PUT_END by every write path) with a step that stops the master (SIGSTOP) or, with ``--shard-processes``, stops the
key's shard process and fills its inbox through a raw peer, so the front answers
BUSY to everything else sent to that shard until it resumes.  The lock tests hold
the client's lock from the test thread, as the heartbeat thread does while it
re-handshakes with a stalled master.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import psutil
import pytest
import zmq
from conftest import keys_on_shard

from kvmaster import AsyncClient, Busy, Client, ClientConfig, ObjectNotFound, Timeout
from kvmaster import protocol as P
from kvmaster.protocol import Op, Status
from tests.support import wait_until

MiB = 1 << 20
INBOX = 4
_packb = msgpack.Packer(use_bin_type=True).pack


class Raw:
    """A bare DEALER that said HELLO."""

    def __init__(self, endpoint: str, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ids = iter(range(1, 1 << 62))
        assert self.call(Op.HELLO, P.MASTER_ROUTE, *P.PROTOCOL_VERSION, "raw-peer", "default",
                         "h", "0")[0] == 0

    def send(self, op: Op, route: bytes, *fields: Any) -> int:
        req_id = next(self.ids)
        self.sock.send_multipart((op.value, route, _packb([req_id, *fields])))
        return req_id

    def recv(self, timeout: float) -> tuple[int, int, Any] | None:
        if not self.sock.poll(timeout * 1000):
            return None
        return P.decode_reply(self.sock.recv_multipart()[-1])

    def call(self, op: Op, route: bytes, *fields: Any) -> tuple[int, Any]:
        want = self.send(op, route, *fields)
        while True:
            reply = self.recv(10)
            assert reply is not None, "no reply"
            if reply[0] == want:
                return reply[1], reply[2]

    def close(self) -> None:
        self.sock.close(linger=0)


def shard_process(master: Any, index: int) -> psutil.Process:
    """The process of shard ``index`` of a ``--shard-processes`` master (it binds
    ``ipc://<dir>/shard-<index>``)."""
    for p in psutil.Process(master.proc.pid).children(recursive=True):
        try:
            if any(u.laddr and u.laddr.endswith(f"/shard-{index}")
                   for u in p.net_connections(kind="unix")):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no process for shard {index}")


class BlockedShard:
    """Stops one shard process and fills its inbox (``--shard-inbox``) with a raw
    peer's requests, so the front answers BUSY at once to any other request for the
    shard, until :meth:`release`."""

    def __init__(self, master: Any, shard: int, shards: int, ctx: zmq.Context) -> None:
        self.proc = shard_process(master, shard)
        self.raw = Raw(master.endpoint, ctx)
        self.route = P.route_for_shard(shard)
        self.key = keys_on_shard(shard, shards, 1, "filler-")[0].encode()
        self.stopped = False

    def block(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True
        for _ in range(INBOX + 1):
            self.raw.send(Op.EXIST_KEY, self.route, self.key)
        # The last is refused at once: the ones before it fill the inbox.
        reply = self.raw.recv(5)
        assert reply is not None and reply[1] == Status.BUSY, reply

    def release(self) -> None:
        if self.stopped:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.stopped = False
        while self.raw.recv(0.3) is not None:
            pass

    def close(self) -> None:
        self.release()
        self.raw.close()


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def hook_write(c: Any, step: Callable[[], None]) -> None:
    """Run ``step`` once, when the client looks up the segment a put's bytes go to
    (after PUT_START, before the copy and PUT_END; for a batch, the first key's)."""
    look_up = c._local
    done = []

    def local(name: str) -> Any:
        mapping = look_up(name)
        if not done:
            done.append(True)
            step()
        return mapping

    c._local = local


def unhook_write(c: Any) -> None:
    del c._local


def pending_write(c: Client, key: str) -> Any:
    try:
        return c.query_key(key).get("pending_write")
    except ObjectNotFound:
        return None


# ----------------------------------------------------------------- the tests


T = 1.0     # the calls' timeout_s
COPY = 0.5  # how long the hooked copy takes before the end is sent


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_put_whose_end_is_refused_busy_ends_by_its_deadline_and_leaves_no_write_pending(
        start_master, make_client, zctx, kind: str) -> None:
    """The key's shard (a process) stops after PUT_START and its inbox fills, so
    PUT_END is refused BUSY until the call gives up: the call raises Busy by its one
    deadline (it used to give the end a timeout of its own: COPY + T), and its write
    is revoked (the revoke, refused BUSY too at first, is sent again), so once the
    shard runs again a put of the key stores a readable value at once (it used to
    answer success, "already exists", with nothing readable for the discard
    timeout).  The same for put_batch."""
    m = start_master("--shard-processes", "--shards", "2", "--shard-inbox", str(INBOX))
    observer = make_client(m, 0)
    k, b1, b2 = keys_on_shard(1, 2, 3, f"busy-end-{kind}-")
    blocked = BlockedShard(m, 1, 2, zctx)

    def slow_then_blocked() -> None:
        time.sleep(COPY)
        blocked.block()

    def check_no_write_pending(keys: list[str]) -> None:
        for key in keys:
            assert pending_write(observer, key) is None, key

    try:
        if kind == "sync":
            c = make_client(m, 4 * MiB, timeout_s=T)
            hook_write(c, slow_then_blocked)
            t0 = time.monotonic()
            with pytest.raises(Busy):
                c.put(k, b"first" * 100)
            took = time.monotonic() - t0
            unhook_write(c)
            blocked.release()
            assert COPY <= took < T + 0.2, took
            # At once: the next call sends the revoke (refused BUSY before) first.
            assert c.put(k, b"second" * 100) is None
            assert c.get(k) == b"second" * 100
            check_no_write_pending([k])

            hook_write(c, slow_then_blocked)
            t0 = time.monotonic()
            with pytest.raises(Busy):
                c.put_batch([b1, b2], [b"x" * 64, b"y" * 64])
            took = time.monotonic() - t0
            unhook_write(c)
            blocked.release()
            assert COPY <= took < T + 0.2, took
            assert c.put_batch([b1, b2], [b"X" * 64, b"Y" * 64]) == [0, 0]
            assert c.get_batch([b1, b2]) == [b"X" * 64, b"Y" * 64]
            check_no_write_pending([b1, b2])
        else:
            async def main() -> None:
                c = AsyncClient(ClientConfig(timeout_s=T))
                await c.setup(m.addr, 4 * MiB)
                try:
                    for write, keys, first, second in (
                            ("put", [k], [b"first" * 100], [b"second" * 100]),
                            ("put_batch", [b1, b2], [b"x" * 64, b"y" * 64],
                             [b"X" * 64, b"Y" * 64])):
                        hook_write(c, slow_then_blocked)
                        t0 = time.monotonic()
                        with pytest.raises(Busy):
                            if write == "put":
                                await c.put(keys[0], first[0])
                            else:
                                await c.put_batch(keys, first)
                        took = time.monotonic() - t0
                        unhook_write(c)
                        blocked.release()
                        assert COPY <= took < T + 0.2, (write, took)
                        await asyncio.sleep(0.2)  # the revoke's resends reach the shard
                        if write == "put":
                            assert await c.put(keys[0], second[0]) is None
                        else:
                            assert await c.put_batch(keys, second) == [0, 0]
                        assert await c.get_batch(keys) == second
                        check_no_write_pending(keys)
                finally:
                    await c.close()

            asyncio.run(main())
        assert observer.check_consistency() == []
    finally:
        blocked.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("when", ["end-sent", "deadline-before-end"])
def test_put_ends_by_its_deadline_when_the_master_stops_or_the_copy_is_slow(
        start_master, make_client, kind: str, when: str) -> None:
    """``end-sent``: the master stops (SIGSTOP) after the bytes are copied, half way
    through the call's timeout; PUT_END times out at the call's deadline (it used to
    get a timeout of its own: COPY + T).  When the master resumes it applies the end
    and then the revoke, which finds no write: the stored object stays.
    ``deadline-before-end``: the copy outlasts the deadline; the end is not sent
    (it used to be, with a fresh timeout, and the put succeeded late): the put
    raises Timeout and its write is revoked at once."""
    m = start_master()
    observer = make_client(m, 0)
    key = f"stop-{kind}-{when}"
    value = b"v" * 1000

    def step() -> None:
        if when == "end-sent":
            time.sleep(COPY)
            os.kill(m.proc.pid, signal.SIGSTOP)
        else:
            time.sleep(T + 0.1)

    def after(took: float) -> None:
        if when == "end-sent":
            assert COPY <= took < T + 0.2, took
            os.kill(m.proc.pid, signal.SIGCONT)
            # The end is applied (and then the revoke, which finds no write).
            wait_until(lambda: observer.is_exist(key), 5, "the end to be applied")
            assert observer.get(key) == value
        else:
            # Raised by the deadline, not after another timeout_s (the old late end):
            # well under 2 T; a loaded machine has taken T + 0.46 here.
            assert T < took < T + 0.8, took
        wait_until(lambda: pending_write(observer, key) is None, 5, "no write pending")
        if when != "end-sent":
            with pytest.raises(ObjectNotFound):
                observer.get(key)

    try:
        if kind == "sync":
            c = make_client(m, 4 * MiB, timeout_s=T)
            hook_write(c, step)
            t0 = time.monotonic()
            with pytest.raises(Timeout):
                c.put(key, value)
            after(time.monotonic() - t0)
            unhook_write(c)
            if when != "end-sent":
                assert c.put(key, value) is None and c.get(key) == value
        else:
            async def main() -> None:
                c = AsyncClient(ClientConfig(timeout_s=T))
                await c.setup(m.addr, 4 * MiB)
                try:
                    hook_write(c, step)
                    t0 = time.monotonic()
                    with pytest.raises(Timeout):
                        await c.put(key, value)
                    after(time.monotonic() - t0)
                    unhook_write(c)
                    if when != "end-sent":
                        assert await c.put(key, value) is None
                        assert await c.get(key) == value
                finally:
                    await c.close()

            asyncio.run(main())
    finally:
        os.kill(m.proc.pid, signal.SIGCONT)
    assert observer.check_consistency() == []


def _stage_all_slots(m: Any, ctx: zmq.Context) -> Raw:
    """A raw peer holding every staging slot of shard 0's multi-page session updates:
    an update's first page is refused BUSY until one frees (as in test_faults)."""
    from kvmaster._sessions import MAX_STAGED_UPDATES

    raw = Raw(m.endpoint, ctx)
    route = P.route_for_shard(0)
    # One session per slot: a client's newer update of a session replaces its own
    # unfinished one instead of taking a second slot.
    for token in range(1, MAX_STAGED_UPDATES + 1):
        sid = b"other-%d" % token
        assert raw.call(Op.UPDATE_KV_SESSION, route, sid, [b"x"], token, False)[0] == 0
    return raw


def _updating_client(m: Any, make_client: Any, timeout_s: float) -> Client:
    owner = make_client(m, MiB)
    for k in ("k1", "k2", "k3"):
        owner.put(k, b"v")
    assert owner.attach_kv_session("s", ["k1", "k2", "k3"]) == [0, 0, 0]
    return make_client(m, 0, timeout_s=timeout_s)


def test_busy_pause_takes_the_lock_back_by_the_call_deadline(start_master, make_client,
                                                             zctx) -> None:
    """Between BUSY resends a call lets go of the client's lock.  If another thread
    takes it meanwhile (the heartbeat thread re-handshaking with a stalled master
    holds it up to connect_timeout_s; here the test holds it for 2 s), the call takes
    it back by its own deadline or raises Timeout (it used to wait for the lock, then
    raise Busy after 2 s).  The lock stays consistent: the holder releases it, and
    the next call works."""
    m = start_master("--shards", "1", "--max-batch", "2")
    c = _updating_client(m, make_client, 0.8)
    raw = _stage_all_slots(m, zctx)
    outcome: dict[str, Any] = {}

    def update() -> None:
        t = time.monotonic()
        try:
            c.update_kv_session("s", ["k1", "k2", "k3"])
        except Exception as exc:  # noqa: BLE001
            outcome["exc"] = exc
        outcome["took"] = time.monotonic() - t

    try:
        th = threading.Thread(target=update)
        th.start()
        time.sleep(0.15)  # the call is in its BUSY retries
        assert c._lock.acquire(timeout=2)  # taken in one of its pauses
        try:
            th.join(1.5)
            assert not th.is_alive(), "the call waited for the lock past its deadline"
        finally:
            time.sleep(max(0.0, 2.0 - 0.15 - 1.5))
            c._lock.release()
        assert isinstance(outcome.get("exc"), Timeout), outcome
        assert outcome["took"] < 0.8 + 0.2, outcome
        assert c.is_exist("k1")
        assert c._lock.acquire(False)  # free (and ours only once)
        c._lock.release()
        assert not c._lock._is_owned()
    finally:
        raw.close()


class Interrupted(Exception):
    pass


def test_signal_during_a_busy_pause_lock_wait_raises_at_once_and_keeps_the_lock_sane(
        start_master, make_client, zctx) -> None:
    """A signal handler that raises while a call waits, between BUSY resends, for the
    lock another thread holds: the handler's exception reaches the caller at once
    (it used to be held back until the lock came free), the call does not hold the
    lock afterwards, and the client works on."""
    m = start_master("--shards", "1", "--max-batch", "2")
    c = _updating_client(m, make_client, 10.0)
    raw = _stage_all_slots(m, zctx)
    main = threading.get_ident()
    holding = threading.Event()
    call_over = threading.Event()  # no signal once the call is over (or the test failed)

    def holder() -> None:
        time.sleep(0.15)  # the call is in its BUSY retries
        assert c._lock.acquire(timeout=5)  # taken in one of its pauses
        try:
            holding.set()
            time.sleep(0.3)
            if not call_over.is_set():
                signal.pthread_kill(main, signal.SIGUSR1)
            time.sleep(1.5)
        finally:
            c._lock.release()

    def handler(_sig: int, _frame: Any) -> None:
        raise Interrupted("raised by a signal handler")

    old = signal.signal(signal.SIGUSR1, handler)
    th = threading.Thread(target=holder)
    try:
        th.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(Interrupted):
                c.update_kv_session("s", ["k1", "k2", "k3"])
        finally:
            call_over.set()
        took = time.monotonic() - t0
        assert holding.is_set()
        assert took < 1.0, took
        assert not c._lock._is_owned()
        th.join(5)
        assert c.is_exist("k1")
        assert c._lock.acquire(False)
        c._lock.release()
        assert not c._lock._is_owned()
    finally:
        call_over.set()
        th.join(5)  # before the default handler (which ends the process) is back
        signal.signal(signal.SIGUSR1, old)
        raw.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_put_whose_start_times_out_leaves_no_write_pending(start_master, make_client,
                                                           kind: str) -> None:
    """The master is stopped (SIGSTOP) when a put starts: PUT_START times out, but the
    master applies it when it resumes.  The put revoked its write after the timeout
    (the revoke waits in the socket behind the start), so once the master runs
    again another client's put of the key stores a readable value at once (it used
    to be told the key exists, with nothing readable for the discard timeout)."""
    m = start_master()
    other = make_client(m, 4 * MiB)
    keys = [f"start-{kind}-{i}" for i in range(3)]

    def check_free() -> None:
        for k in keys:
            wait_until(lambda k=k: pending_write(other, k) is None, 5, f"no write of {k}")
        assert other.put(keys[0], b"theirs") is None
        assert other.put_batch(keys[1:], [b"x", b"y"]) == [0, 0]
        assert other.get_batch(keys) == [b"theirs", b"x", b"y"]

    if kind == "sync":
        c = make_client(m, 4 * MiB, timeout_s=0.5)
        os.kill(m.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(Timeout):
                c.put(keys[0], b"mine")
            with pytest.raises(Timeout):
                c.put_batch(keys[1:], [b"1", b"2"])
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)
        check_free()
    else:
        async def main() -> None:
            c = AsyncClient(ClientConfig(timeout_s=0.5))
            await c.setup(m.addr, 4 * MiB)
            try:
                os.kill(m.proc.pid, signal.SIGSTOP)
                try:
                    with pytest.raises(Timeout):
                        await c.put(keys[0], b"mine")
                    with pytest.raises(Timeout):
                        await c.put_batch(keys[1:], [b"1", b"2"])
                finally:
                    os.kill(m.proc.pid, signal.SIGCONT)
                check_free()
            finally:
                await c.close()

        asyncio.run(main())
    assert other.check_consistency() == []


def test_revoke_of_a_put_that_could_not_take_the_lock_back_goes_out_later(
        start_master, make_client, zctx) -> None:
    """A put's end is refused BUSY, and in one of its pauses another thread takes the
    client's lock and keeps it past the put's deadline: the put raises Timeout
    without the lock, so it cannot send its revoke; the revoke is queued and goes out
    with the next call, before that call's own requests."""
    m = start_master("--shard-processes", "--shards", "2", "--shard-inbox", str(INBOX))
    observer = make_client(m, 0)
    (k,) = keys_on_shard(1, 2, 1, "lockless-")
    blocked = BlockedShard(m, 1, 2, zctx)
    c = make_client(m, 4 * MiB, timeout_s=T)
    held = threading.Event()
    let_go = threading.Event()

    def holder() -> None:
        assert c._lock.acquire(timeout=5)  # in one of the end's BUSY pauses
        try:
            held.set()
            let_go.wait(10)
        finally:
            c._lock.release()

    def block_and_take_the_lock() -> None:
        blocked.block()
        threading.Thread(target=holder, daemon=True).start()

    try:
        hook_write(c, block_and_take_the_lock)
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            c.put(k, b"first" * 100)
        took = time.monotonic() - t0
        unhook_write(c)
        assert held.is_set() and took < T + 0.2, took
        assert not c._lock._is_owned()
        assert c._parting  # the revoke waits for the lock
        blocked.release()
        let_go.set()
        assert c.put(k, b"second" * 100) is None  # sends the revoke first
        assert c.get(k) == b"second" * 100
        assert pending_write(observer, k) is None
        assert not c._parting
        assert observer.check_consistency() == []
    finally:
        let_go.set()
        blocked.close()


class _LosesFirst:
    """A client socket that loses in transit the first message of each given op (it
    reports the message sent, as a broken connection does): the sync client's module
    send function or the asyncio client's socket."""

    def __init__(self, ops: tuple[bytes, ...]) -> None:
        self.left = list(ops)

    def lose(self, frames: Any) -> bool:
        if frames[0] in self.left:
            self.left.remove(frames[0])
            return True
        return False


class _LossySocket:
    def __init__(self, sock: Any, loss: _LosesFirst) -> None:
        self._sock, self._loss = sock, loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def send_multipart(self, frames: Any, **kw: Any) -> Any:
        if self._loss.lose(frames):
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return self._sock.send_multipart(frames, **kw)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_revoke_lost_with_its_connection_goes_out_again_on_the_next(
        start_master, make_client, monkeypatch, kind: str) -> None:
    """A put's end is lost, so the put times out and revokes its write, and the revoke
    is lost too; then the client's connection is replaced (a re-handshake with the same
    master process).  The revoke, never answered, goes out again on the new
    connection, so the write is not left pending: another client's put of the key
    stores a readable value.  Before, a revoke lost with its connection was not sent
    again: that put answered success ("already exists") with nothing readable until
    the master's discard timeout."""
    from kvmaster import client as client_module

    m = start_master()
    observer = make_client(m, 4 * MiB)
    key = f"lost-revoke-{kind}"
    loss = _LosesFirst((Op.PUT_END.value, Op.PUT_REVOKE.value))
    if kind == "sync":
        send = client_module._send_request

        def lossy_send(sock: Any, frames: Any, endpoint: str) -> None:
            if not loss.lose(frames):
                send(sock, frames, endpoint)

        monkeypatch.setattr(client_module, "_send_request", lossy_send)
        c = make_client(m, 4 * MiB, timeout_s=T)
        with pytest.raises(Timeout):
            c.put(key, b"first" * 100)
        assert not loss.left and c._parting_sent  # both lost; the revoke awaits a reply
        assert pending_write(observer, key) is not None
        with c._lock:
            c._rehandshake()
        c.is_exist("anything")  # a call sends what is due first
    else:
        async def main() -> None:
            c = AsyncClient(ClientConfig(timeout_s=T))
            await c.setup(m.addr, 4 * MiB)
            try:
                c._sock = _LossySocket(c._sock, loss)  # type: ignore[assignment]
                with pytest.raises(Timeout):
                    await c.put(key, b"first" * 100)
                assert not loss.left
                assert pending_write(observer, key) is not None
                await c._rehandshake_shared()
                await asyncio.sleep(0.1)  # the revoke goes out from the event loop
            finally:
                await c.close()
        asyncio.run(main())
    wait_until(lambda: pending_write(observer, key) is None, 5, "the revoke")
    assert observer.put(key, b"second" * 100) is None
    assert observer.get(key) == b"second" * 100
    if kind == "sync":
        c.close()
