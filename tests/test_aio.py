"""The asyncio client against a real master: same operations, many in flight."""

from __future__ import annotations

import asyncio

import pytest

from kvmaster import AsyncClient, ObjectNotFound, ReplicateConfig


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
