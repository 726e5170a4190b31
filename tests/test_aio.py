"""The asyncio client against a real master: same operations, many in flight."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvmaster import AsyncClient, ObjectNotFound, ReplicateConfig
from kvmaster.protocol import Status


def test_async_client_operations(master) -> None:
    async def main() -> None:
        c = AsyncClient()
        await c.setup(master.addr, 8 << 20)
        try:
            await c.put("a", b"x" * 1000)
            assert await c.get("a") == b"x" * 1000
            assert await c.is_exist("a") and not await c.is_exist("b")
            keys = [f"k{i}" for i in range(200)]
            assert await c.put_batch(keys, [k.encode() * 10 for k in keys]) == [0] * 200
            # many calls in flight on one connection
            got = await asyncio.gather(*(c.get(k) for k in keys))
            assert got == [k.encode() * 10 for k in keys]
            assert await c.batch_is_exist(keys + ["nope"]) == [1] * 200 + [0]
            await c.put("t", b"tagged", ReplicateConfig(kv_sessions=[["s1"]]))
            await c.pin_kv_session("s1")
            info = await c.get_kv_session("s1")
            assert info.pinned and info.member_count == 1
            assert [k async for k in c.iter_kv_session_keys("s1")] == ["t"]
            await c.remove("a", force=True)
            with pytest.raises(ObjectNotFound):
                await c.get("a")
            assert await c.check_consistency() == []
        finally:
            await c.close()

    asyncio.run(main())


@pytest.mark.parametrize("multi", [True, False], ids=["one-message", "message-each"])
def test_async_calls_of_several_requests(master, multi) -> None:
    """As the sync client: a call's requests go in one message to a 1.2 master."""
    async def main() -> int:
        async with AsyncClient() as c:
            await c.setup(master.addr, 8 << 20)
            assert c.welcome.multi
            c.welcome.multi = multi
            c.welcome.any_shard = False  # split batches by shard
            before = (await c.stats())["front"]["multi_request_messages"]
            keys = [f"am-{i}" for i in range(40)]
            vals = [k.encode() * 20 for k in keys]
            assert await c.put_batch(keys, vals) == [0] * 40
            assert await c.get_batch(keys) == vals
            assert await c.batch_is_exist(keys) == [1] * 40
            assert await c.remove_all(force=True) == 40
            return (await c.stats())["front"]["multi_request_messages"] - before

    # put_batch (start, end), get, is_exist, remove_all
    assert asyncio.run(main()) == (5 if multi else 0)


def test_async_client_on_uvloop(master) -> None:
    import uvloop

    async def main() -> tuple[bytes, int]:
        async with AsyncClient() as c:
            await c.setup(master.addr, 1 << 20)
            await c.put("u", b"on uvloop")
            return await c.get("u"), len(await c.list_segments())

    assert uvloop.run(main()) == (b"on uvloop", 1)


def test_async_send_interrupted_half_way_does_not_glue_the_next_request(master) -> None:
    """pyzmq runs Python signal handlers after queuing each frame; an exception from one
    (here injected after the second frame) used to leave the request half sent, and the
    next one was glued onto it and refused as malformed."""

    class Watchdog(Exception):
        pass

    async def main() -> None:
        c = AsyncClient()
        await c.setup(master.addr, 0)
        try:
            shadow = c._sock._shadow_sock
            real = shadow.send
            sent = {"n": 0}

            def interrupted(data, flags=0, **kw):
                r = real(data, flags, **kw)
                sent["n"] += 1
                if sent["n"] == 2:
                    raise Watchdog("raised by a signal handler")
                return r

            shadow.send = interrupted
            with pytest.raises(Watchdog):
                await c.is_exist("k")
            del shadow.send  # back to the class's method
            assert await c.is_exist("k") is False  # not glued onto the half-sent request
            assert sent["n"] == 3  # two frames of the request, then the empty end frame
        finally:
            await c.close()

    asyncio.run(main())


def test_a_burst_of_reads_on_a_fresh_client_shares_one_segment_lookup(master, client) -> None:
    """A fresh AsyncClient knows no segment yet: 4000 concurrent gets (more than the
    master's 256 master-level requests in progress per client) used to send one
    LIST_SEGMENTS each, and without BUSY retries about half were refused."""
    from kvmaster import ClientConfig

    keys = [f"burst-{i}" for i in range(4000)]
    assert client.put_batch(keys, [k.encode() for k in keys]) == [0] * len(keys)

    async def main() -> list:
        c = AsyncClient(ClientConfig(busy_retry=False))
        await c.setup(master.addr, 0)
        try:
            return await asyncio.gather(*(c.get(k) for k in keys))
        finally:
            await c.close()

    assert asyncio.run(main()) == [k.encode() for k in keys]


def test_async_tasks_share_one_rehandshake_after_a_master_restart(start_master, caplog) -> None:
    """Eight tasks of one AsyncClient keep calling while the master restarts on its port.
    Their requests reach the new master together and are refused NOT_REGISTERED; the
    first starts a re-handshake and the others wait for it (or, when it completed after
    they sent, send again on the new connection): one re-handshake in all.  Callers see
    only errors of the gap (Timeout, ConnectionLost, ShuttingDown) and every task's
    calls succeed again."""
    import time

    from kvmaster import ClientConfig, ConnectionLost, ShuttingDown, Timeout

    first = start_master()
    port = first.addr.rsplit(":", 1)[1]
    errors: list[BaseException] = []
    done: list[tuple[int, float]] = []

    async def main() -> None:
        c = AsyncClient(ClientConfig(timeout_s=1.0, connect_timeout_s=2.0))
        await c.setup(first.addr, 4 << 20)
        try:
            await run(c)
        finally:
            await c.close()

    async def run(c: AsyncClient) -> None:
        stop = asyncio.Event()

        async def worker(wid: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                keys = [f"w{wid}-{(i + j) % 20}" for j in range(4)]
                t0 = time.monotonic()
                try:
                    if i % 2:
                        statuses = await c.put_batch(keys, [b"v" * 32] * 4)
                        if statuses != [0] * 4:
                            # A draining master answers a batch per key: gap errors too.
                            assert set(statuses) <= {0, Status.SHUTTING_DOWN}, statuses
                            raise ShuttingDown("a draining master refused keys of a batch",
                                               code=Status.SHUTTING_DOWN)
                    else:
                        assert all(r in (0, 1) for r in await c.batch_is_exist(keys))
                    done.append((wid, t0))
                except Exception as exc:  # noqa: BLE001 - checked below
                    errors.append(exc)
                    await asyncio.sleep(0.01)

        tasks = [asyncio.ensure_future(worker(k)) for k in range(8)]
        try:
            await asyncio.sleep(0.5)
            assert {w for w, _ in done} == set(range(8))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, first.stop) == 0
            restarted = time.monotonic()
            await loop.run_in_executor(None, start_master, "--port", port)
            deadline = restarted + 15
            while time.monotonic() < deadline and \
                    {w for w, t0 in done if t0 > restarted} != set(range(8)):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert {w for w, t0 in done if t0 > restarted} == set(range(8)), errors[-5:]
        odd = [repr(e) for e in errors if type(e) not in (Timeout, ConnectionLost, ShuttingDown)]
        assert not odd, odd[:5]
        assert c.reconnect_count == 1, c.reconnect_count
        # Its log line names the reason: a call's or the heartbeat's NOT_REGISTERED.
        lines = [r.getMessage() for r in caplog.records if "re-handshaking" in r.getMessage()]
        assert lines == [f"re-handshaking with master {c.endpoint} as client {c.client_id}: "
                         "the master does not know this client (a restart, or it expired "
                         "the client)"], lines

    with caplog.at_level(logging.WARNING, logger="kvmaster.aio"):
        asyncio.run(main())


@pytest.mark.parametrize("when", ["under_way", "completed"])
def test_a_round_failed_by_another_tasks_rehandshake_is_sent_again_on_its_connection(
        when: str) -> None:
    """With HA, a task's round fails because another task's re-handshake replaced the
    connection under it.  Whether that re-handshake is still under way (no WELCOME yet)
    or already completed when the failure is handled, the round waits for it (starts
    none of its own) and is sent again on the new connection, the layout being the
    one its requests were built for: no RoutingChanged (the layout used to be read
    after the failure, as none), no second re-handshake (which would fail the
    requests in flight on the new connection)."""
    import time

    from kvmaster import ClientConfig, ConnectionLost
    from kvmaster.protocol import Op

    welcome = {"shard_count": 2, "tenant": "default", "lease_ttl_ms": 1000,
               "client_ttl_ms": 3000, "limits": {"max_batch": 8}, "master_instance": "a"}

    async def main() -> None:
        c = AsyncClient(ClientConfig(master_server_addr="etcd://127.0.0.1:9/c", timeout_s=2.0))
        c._configure()
        c._welcomed(welcome)
        rehandshakes: list[int] = []
        sent: list[int] = []  # connection generation of each send

        async def rehandshake(why: BaseException | None = None) -> None:
            rehandshakes.append(1)
            c.welcome = None
            await asyncio.sleep(0.05)
            c._welcomed({**welcome, "master_instance": "b"})  # same layout

        async def exchange(reqs: object, timeout_s: object = None, tolerant: bool = False,
                           deadline: object = None, phases: object = None) -> list[str]:
            sent.append(c._generation)
            if len(sent) > 1:
                return ["answer"]
            other = c._rehandshake_shared()  # another task's, replacing this connection
            if when == "completed":
                await other
            else:
                await asyncio.sleep(0.01)  # it has dropped the connection and the WELCOME
                assert c.welcome is None and not other.done()
            raise ConnectionLost("connection replaced during the call")

        c._rehandshake = rehandshake  # type: ignore[method-assign]
        c._exchange = exchange  # type: ignore[method-assign]
        reqs = [(Op.EXIST_KEY.value, c._route(b"k"), [b"k"])]
        assert await c._round(reqs, time.monotonic() + 2.0) == ["answer"]
        assert sent == [1, 2] and rehandshakes == [1]

    asyncio.run(main())
