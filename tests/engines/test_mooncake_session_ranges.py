"""Mooncake's ``mooncake-store/tests/e2e/session_ranges_tcp_e2e.py`` (ranged put and
get sessions over multi-buffer ranges), run unmodified against a real master.

Mooncake runs it as ``PYTHONPATH=build/mooncake-integration MOONCAKE_PROTOCOL=tcp
MOONCAKE_MASTER=host:port MOONCAKE_TE_META_DATA_SERVER=P2PHANDSHAKE python3
session_ranges_tcp_e2e.py``: the file imports the binding as a top-level ``store``
module.  Here the folder on ``PYTHONPATH`` is the compat shim's ``mooncake`` package,
whose ``store.py`` is kvmaster's facade, and the master is a kvmaster master.  The
file exits 0 and prints ``session_ranges_tcp_e2e PASSED`` when every step answered
as Mooncake's does (a put session written layer by layer, ended, read back layer by
layer through a get session, every byte compared; a second put session revoked)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvmaster.compat import ReplicateConfig
from tests.engines.conftest import engine_file

E2E = "mooncake/session_ranges_tcp_e2e.py"


def _run(shim: Path, master_addr: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(shim / "mooncake"), MOONCAKE_PROTOCOL="tcp",
               MOONCAKE_MASTER=master_addr, MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE",
               **extra)
    return subprocess.run([sys.executable, str(engine_file(E2E))], env=env, text=True,
                          capture_output=True, timeout=60)


@pytest.mark.parametrize("shape", [
    {},  # the file's defaults: 3 keys, 4 layers of 4 KiB
    {"E2E_NUM_KEYS": "32", "E2E_NUM_LAYERS": "16", "E2E_PAGE_SIZE": "65536",
     "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(128 << 20)},
], ids=["defaults", "32keys-16layers-64KiB"])
def test_session_ranges_e2e(shim, master, shape: dict[str, str]) -> None:
    proc = _run(shim, master.addr, **shape)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "session_ranges_tcp_e2e PASSED" in proc.stdout, out[-4000:]
    assert "setup_ret 0" in proc.stdout
    assert "batch_put_session_revoke [0]" in proc.stdout


# ----------------------------------------- the facade's calls, edge by edge

INVALID, NOT_FOUND, EXISTS, LEASE_EXPIRED = -600, -704, -705, -707


def _buf(n: int, fill: int = 0):
    b = (ctypes.c_char * n)()
    ctypes.memset(b, fill, n)
    return b, ctypes.addressof(b)


@pytest.fixture
def store(master):
    from kvmaster.compat import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", master.addr) == 0
    yield s
    s.close()


def test_multi_buffer_bad_input(store) -> None:
    src, p = _buf(4096, 7)
    assert store.batch_put_from_multi_buffers(["a", "b"], [[p]], [[16]]) == [INVALID] * 2
    assert store.batch_put_from_multi_buffers(["a"], [[p, p]], [[16]]) == [INVALID]
    assert store.batch_put_from_multi_buffers(["a"], [[0]], [[16]]) == [INVALID]  # null
    assert store.batch_put_from_multi_buffers(["a"], [[p]], [[-1]]) == [INVALID]
    assert store.batch_put_from_multi_buffers(["a"], [["x"]], [[1]]) == [INVALID]
    assert store.batch_put_from_multi_buffers(["a", "e"], [[p, p + 8], []],
                                              [[8, 8], []]) == [0, INVALID]  # empty value
    assert store.get("a") == bytes(src[:16])
    dst, q = _buf(64)
    assert store.batch_get_into_multi_buffers(["a", "nope"], [[q, q + 10], [q]],
                                              [[10, 10], [10]]) == [16, NOT_FOUND]
    assert bytes(dst[:16]) == bytes(src[:16]) and dst[16:20] == b"\0" * 4
    assert store.batch_get_into_multi_buffers(["a"], [[q]], [[15]]) == [INVALID]  # too small
    assert store.batch_get_into_multi_buffer_ranges(["a"], [[q]], [[4]], [[0]]) == [INVALID]
    # Repeated keys in one put: written once, each position answers that write.
    assert store.batch_put_from_multi_buffers(["r", "r"], [[p], [p + 1]], [[4], [4]]) == [0, 0]
    assert store.get("r") == bytes(src[:4])
    cfg = ReplicateConfig()
    cfg.group_ids = ["g"]
    assert store.batch_put_from_multi_buffers(["x", "y"], [[p], [p]], [[4], [4]],
                                              cfg) == [INVALID] * 2
    cfg.group_ids, cfg.session_ids = ["g1", "g2"], ["s", "s"]
    assert store.batch_put_from_multi_buffers(["x", "y"], [[p], [p]], [[4], [4]], cfg) == [0, 0]


def test_put_session_edges(store) -> None:
    src, p = _buf(1 << 16, 5)
    for i in range(len(src)):
        src[i] = i % 251
    assert store.put("stored", b"v") == 0
    assert store.batch_put_session_start(["k", "k", "stored"], [64, 64, 8]) == \
        [0, INVALID, EXISTS]
    assert store.batch_put_session_start(["k"], [64]) == [INVALID]  # has a session
    assert store.batch_put_session_start(["z"], [0]) == [INVALID]
    assert store.batch_put_session_start(["z", "w"], [8]) == [INVALID, INVALID]
    assert store.is_exist("k") == 0
    # Ranges: two halves in either order, one past the end refused.
    assert store.batch_put_from_multi_buffer_ranges(["k"], [[p + 32]], [[32]], [[32]]) == [32]
    assert store.batch_put_from_multi_buffer_ranges(["k"], [[p]], [[33]], [[32]]) == [INVALID]
    assert store.batch_put_from_multi_buffer_ranges(["k", "none"], [[p]] * 2, [[32]] * 2,
                                                    [[0]] * 2) == [32, INVALID]
    assert store.is_exist("k") == 0  # nothing readable before the end
    assert store.batch_put_session_end(["k", "none"]) == [0, INVALID]
    assert store.get("k") == bytes(src[:64])
    assert store.batch_put_session_end(["k"]) == [INVALID]
    assert store.batch_put_from_multi_buffer_ranges(["k"], [[p]], [[8]], [[0]]) == [INVALID]
    # Revoke: nothing stored, the key can be written again.
    assert store.batch_put_session_start(["v"], [16]) == [0]
    assert store.batch_put_from_multi_buffer_ranges(["v"], [[p]], [[16]], [[0]]) == [16]
    assert store.batch_put_session_revoke(["v", "none"]) == [0, INVALID]
    assert store.is_exist("v") == 0
    assert store.batch_put_session_end(["v"]) == [INVALID]
    assert store.batch_put_session_start(["v"], [16]) == [0]
    assert store.batch_put_session_end(["v"]) == [0]
    assert store.batch_put_session_start([], []) == []


def test_put_session_written_from_another_thread(store) -> None:
    """A session started in one thread, its layers written by another (as the direct
    linker's offload thread does), ended in the first: every layer stored."""
    layers, page = 64, 4096
    src, p = _buf(layers * page)
    for i in range(0, len(src), page):
        src[i] = (i // page) % 256
    assert store.batch_put_session_start(["t"], [layers * page]) == [0]
    got: list[int] = []

    def writer() -> None:
        for layer in range(layers):
            got.extend(store.batch_put_from_multi_buffer_ranges(
                ["t"], [[p + layer * page]], [[page]], [[layer * page]]))

    t = threading.Thread(target=writer)
    t.start()
    t.join()
    assert store.batch_put_session_end(["t"]) == [0]
    assert got == [page] * layers
    assert store.get("t") == bytes(src)


def test_get_session_lease_expiry(start_master) -> None:
    from kvmaster.compat import MooncakeDistributedStore

    m = start_master("--default-kv-lease-ttl", "200")
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", m.addr) == 0
    try:
        assert s.put("g", bytes(range(64))) == 0
        dst, q = _buf(64)
        assert s.batch_get_session_start(["g", "g"]) == [0, 0]
        assert s.batch_get_into_multi_buffer_ranges(["g"], [[q, q + 8]], [[8, 8]],
                                                    [[56, 0]]) == [16]
        assert bytes(dst[:16]) == bytes(range(56, 64)) + bytes(range(8))
        assert s.batch_get_into_multi_buffer_ranges(["g"], [[q]], [[8]], [[57]]) == [INVALID]
        time.sleep(0.3)
        assert s.batch_get_into_multi_buffer_ranges(["g"], [[q]], [[8]], [[0]]) == \
            [LEASE_EXPIRED]
        # The session was dropped; a new one reads again.
        assert s.batch_get_into_multi_buffer_ranges(["g"], [[q]], [[8]], [[0]]) == [INVALID]
        assert s.batch_get_session_start(["g"]) == [0]
        assert s.batch_get_into_multi_buffer_ranges(["g"], [[q]], [[8]], [[8]]) == [8]
        assert s.batch_get_session_end(["g", "never"]) == 0
        assert s.batch_get_session_start([]) == []
    finally:
        s.close()


def test_native_calls_through_the_transfer_service(master) -> None:
    """The native client's gathered, scattered and ranged calls when the segment is
    reached through its owner's transfer service (force_transfer), not mapped."""
    from kvmaster import Client
    from kvmaster._core import ClientConfig

    owner = Client(ClientConfig(master_server_addr=master.addr, global_segment_size=16 << 20,
                                transfer_host="127.0.0.1"))
    owner.setup()
    far = Client(ClientConfig(master_server_addr=master.addr, force_transfer=True))
    far.setup()
    try:
        src, p = _buf(4096)
        for i in range(4096):
            src[i] = i % 253
        assert far.batch_put_from_ptrs(["a", "b"], [[p, p + 100], [p + 7]],
                                       [[100, 300], [9]]) == [0, 0]
        assert far.batch_put_from_parts(["c"], [[b"xy", bytearray(b"z")]]) == [0]
        assert owner.get("a") == bytes(src[:400]) and owner.get("c") == b"xyz"
        dst, q = _buf(4096)
        assert far.batch_get_into_ptrs(["a", "b", "n"], [[q, q + 1000], [q + 2000], [q]],
                                       [[50, 400], [9], [1]]) == [400, 9, NOT_FOUND]
        assert bytes(dst[:50]) + bytes(dst[1000:1350]) == bytes(src[:400])
        bufs = [bytearray(10), bytearray(390)]
        assert far.batch_get_into_parts(["a"], [bufs]) == [400]
        assert bytes(bufs[0] + bufs[1]) == bytes(src[:400])
        pending = far.batch_put_start(["s"], [20])
        assert pending.status == [0]
        assert far.batch_write_ranges(pending, [0], [[(10, b"b" * 10), (0, b"a" * 10)]]) == [20]
        assert far.batch_put_end(pending, [0]) == [0]
        leases = far.batch_get_leases(["s", "n"])
        out = bytearray(5)
        assert far.batch_read_ranges(leases, [0, 1], [[(8, out)], [(0, out)]]) == [5, NOT_FOUND]
        assert bytes(out) == b"aabbb" and owner.get("s") == b"a" * 10 + b"b" * 10
    finally:
        far.close()
        owner.close()
