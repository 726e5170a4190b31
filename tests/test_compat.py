"""The Mooncake-compatible facade: setup forms, return codes instead of
exceptions, pointer-based calls with ctypes buffers, and ReplicateConfig."""

from __future__ import annotations

import ctypes
import os
import socket
import time

import pytest

from kvmaster.compat import MooncakeDistributedStore, ReplicateConfig, SoftPinAction

MiB = 1 << 20
OK, INVALID_PARAMS, NOT_FOUND, HAS_LEASE = 0, -600, -704, -706


@pytest.fixture
def stores(master):
    """Factory of set-up stores (Mooncake positional setup); closed after the test."""
    made: list[MooncakeDistributedStore] = []

    def make(segment: int = 16 * MiB) -> MooncakeDistributedStore:
        s = MooncakeDistributedStore()
        rc = s.setup("localhost", "P2PHANDSHAKE", segment, 16 * MiB, "tcp", "", master.addr)
        assert rc == 0
        made.append(s)
        return s

    yield make
    for s in made:
        assert s.close() == 0


@pytest.fixture
def store(stores) -> MooncakeDistributedStore:
    return stores()


def cbuf(data: bytes) -> ctypes.Array:
    return ctypes.create_string_buffer(data, len(data))


def test_setup_forms(master) -> None:
    positional = MooncakeDistributedStore()
    as_dict = MooncakeDistributedStore()
    keywords = MooncakeDistributedStore()
    try:
        assert positional.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                                master.addr) == 0
        assert as_dict.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                              "global_segment_size": 8 << 20, "local_buffer_size": 16 << 20,
                              "protocol": "tcp", "device_name": "",
                              "master_server_address": master.addr}) == 0
        assert keywords.setup(local_hostname="localhost", metadata_server="P2PHANDSHAKE",
                              global_segment_size=0, local_buffer_size=16 << 20,
                              protocol="tcp", rdma_devices="",
                              master_server_addr=master.addr) == 0
        assert positional.client.stats()["segments"] == 2  # the third is consumer-only
        assert as_dict.client.config.global_segment_size == 8 << 20
        assert positional.put("k", b"hello") == 0
        assert as_dict.get("k") == b"hello"
        assert keywords.get("k") == b"hello"
    finally:
        segs = [s.client.segment_name for s in (positional, as_dict) if s._client is not None]
        for s in (positional, as_dict, keywords):
            assert s.close() == 0
    assert segs and not any(os.path.exists(f"/dev/shm/{n}") for n in segs)


def test_return_conventions(store) -> None:
    assert store.put("k", b"v1") == OK
    assert store.put("k", b"v2") == OK  # write-once: succeeds, keeps v1
    assert store.get("k") == b"v1"
    assert store.get("missing") == b""
    assert store.is_exist("k") == 1 and store.is_exist("missing") == 0
    assert store.get_size("k") == 2 and store.get_size("missing") == NOT_FOUND
    assert store.remove("missing") == NOT_FOUND
    assert store.remove("k") == HAS_LEASE  # leased by the get above
    assert store.remove("k", force=True) == OK
    assert store.get("k") == b""
    assert store.put("empty", b"") == INVALID_PARAMS
    assert store.put("bad\x00key", b"v") == INVALID_PARAMS

    assert store.upsert("u", b"old") == OK
    assert store.upsert("u", b"newer") == OK
    assert store.get("u") == b"newer"
    assert store.put_parts("p", b"ab", b"cd", b"e") == OK
    assert store.get("p") == b"abcde"

    assert store.put_batch(["a", "b", "a"], [b"A", b"B", b"X"]) == OK
    assert store.upsert_batch(["b", "c"], [b"B2", b"C"]) == OK
    assert store.get_batch(["a", "missing", "b", "c"]) == [b"A", b"", b"B2", b"C"]
    assert store.batch_is_exist(["a", "missing", "c"]) == [1, 0, 1]
    assert store.put("unread", b"q") == OK
    assert store.batch_remove(["missing", "unread"]) == [NOT_FOUND, OK]
    assert store.batch_remove(["a", "b"]) == [HAS_LEASE, HAS_LEASE]
    assert store.remove_all() == 0  # everything left is leased
    assert store.remove_all(force=True) == 5
    assert store.batch_is_exist(["a", "b", "c", "u", "p"]) == [0] * 5


def test_pointer_apis(store) -> None:
    v = os.urandom(100_000)
    src = cbuf(v)
    assert store.register_buffer(ctypes.addressof(src), len(v)) == 0
    assert store.put_from("k", ctypes.addressof(src), len(v)) == OK
    assert store.get_size("k") == len(v)

    dst = ctypes.create_string_buffer(len(v) + 10)
    assert store.register_buffer(ctypes.addressof(dst), len(dst)) == 0
    assert store.get_into("k", ctypes.addressof(dst), len(dst)) == len(v)
    assert dst.raw[:len(v)] == v
    assert store.get_into("k", ctypes.addressof(dst), len(v) - 1) == INVALID_PARAMS
    assert store.get_into("missing", ctypes.addressof(dst), len(dst)) == NOT_FOUND
    assert store.unregister_buffer(ctypes.addressof(dst)) == 0

    keys = ["b0", "b1", "b2"]
    vals = [os.urandom(n) for n in (10, 5000, 70_000)]
    bufs = [cbuf(x) for x in vals]
    assert store.batch_put_from(keys, [ctypes.addressof(b) for b in bufs],
                                [len(x) for x in vals]) == [OK] * 3
    outs = [ctypes.create_string_buffer(len(x)) for x in vals] + [ctypes.create_string_buffer(8)]
    res = store.batch_get_into(keys + ["missing"], [ctypes.addressof(b) for b in outs],
                               [len(b) for b in outs])
    assert res == [len(x) for x in vals] + [NOT_FOUND]
    assert [o.raw for o in outs[:3]] == vals

    handle = store.get_buffer("b1")
    assert handle is not None and handle.size() == len(vals[1]) == len(handle)
    assert ctypes.string_at(handle.ptr(), handle.size()) == vals[1]
    assert bytes(memoryview(handle.tobytes())) == vals[1]
    assert store.get_buffer("missing") is None

    new = cbuf(b"replacement")
    assert store.upsert_from("k", ctypes.addressof(new), len(new)) == OK
    assert store.get("k") == b"replacement"
    assert store.batch_upsert_from(["b0"], [ctypes.addressof(new)], [len(new)]) == [OK]
    assert store.get("b0") == b"replacement"


def test_replicate_config_attributes(stores) -> None:
    a, b = stores(), stores()
    cfg = ReplicateConfig()
    assert (cfg.replica_num, cfg.with_hard_pin) == (1, False)
    cfg.soft_pin_action = SoftPinAction.ENABLE
    cfg.with_hard_pin = True
    cfg.replica_num = 1
    assert a.put("pinned", b"x" * 100, cfg) == OK
    q = a.client.query_key("pinned")
    assert q["hard_pinned"] is True and q["soft_pinned"] is True

    cfg = ReplicateConfig()
    cfg.preferred_segment = b.client.segment_name
    assert a.put("there", b"y" * 100, cfg) == OK
    assert [seg for seg, _ in a.client.query_key("there")["replicas"]] == [b.client.segment_name]

    cfg = ReplicateConfig()
    cfg.replica_num = 2
    assert a.put("twice", b"z" * 100, cfg) == OK
    segs = {seg for seg, _ in a.client.query_key("twice")["replicas"]}
    assert segs == {a.client.segment_name, b.client.segment_name}

    cfg = ReplicateConfig()
    cfg.soft_pin_action = SoftPinAction.ENABLE
    cfg.soft_pin_ttl_ms = 86_400_001  # above the master's --max-kv-soft-pin-ttl
    assert a.put("too-long", b"t", cfg) == INVALID_PARAMS
    assert set(SoftPinAction) == {SoftPinAction.PRESERVE, SoftPinAction.ENABLE,
                                  SoftPinAction.DISABLE}


def test_setup_against_dead_address(master) -> None:
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = MooncakeDistributedStore()
    t0 = time.monotonic()
    rc = store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                     f"127.0.0.1:{port}")
    assert rc < 0
    assert time.monotonic() - t0 < 8
    assert store.close() == 0


def test_calls_without_setup_return_codes() -> None:
    """Like Mooncake's store, a store that is not set up answers with error codes
    (and b"" / None for reads) rather than raising."""
    store = MooncakeDistributedStore()
    buf = ctypes.create_string_buffer(8)
    assert store.get("k") == b""
    assert store.get_buffer("k") is None
    assert store.is_exist("k") < 0
    assert store.get_size("k") < 0
    assert store.get_into("k", ctypes.addressof(buf), 8) < 0
    assert store.batch_is_exist(["k"])[0] < 0
    assert store.put("k", b"v") < 0
    assert store.upsert("k", b"v") < 0
    assert store.put_from("k", ctypes.addressof(buf), 8) < 0
    assert store.remove("k") < 0
    assert store.close() == 0
