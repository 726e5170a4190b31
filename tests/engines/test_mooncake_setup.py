"""The facade's set-up family against Mooncake's binding (store_py.cpp ``setup``,
``init_all``, ``get_hostname``, ``health_check``, ``close``; real_client.cpp
``setup_real`` / ``setup_internal``), ``MooncakeConfig``, and the set-up tests of
Mooncake's own ``test_distributed_object_store.py`` run against a real master."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys

import pytest

from kvmaster.compat import MooncakeConfig, MooncakeDistributedStore, _setup
from kvmaster.compat._mooncake_config import parse_size
from tests.engines.conftest import engine_file

MiB = 1 << 20
BAD_PARAMS = -600


@pytest.fixture
def store():
    s = MooncakeDistributedStore()
    yield s
    assert s.close() == 0


def args(master, gss: int = 16 * MiB, lbs: int = 16 * MiB, protocol: str = "tcp",
         device: str = "") -> tuple:
    return ("localhost", "P2PHANDSHAKE", gss, lbs, protocol, device, master.addr)


# ------------------------------------------------------------------ forms


def test_positional_keyword_and_dict_forms(master) -> None:
    stores = [MooncakeDistributedStore() for _ in range(4)]
    try:
        assert stores[0].setup(*args(master)) == 0
        assert stores[1].setup(local_hostname="localhost", metadata_server="P2PHANDSHAKE",
                               global_segment_size=0, local_buffer_size=MiB, protocol="tcp",
                               rdma_devices="", master_server_addr=master.addr,
                               tenant_id="default") == 0
        assert stores[2].setup({"local_hostname": "localhost",
                                "metadata_server": "P2PHANDSHAKE",
                                "global_segment_size": "8MB", "local_buffer_size": "16 MB",
                                "protocol": "tcp", "rdma_devices": "",
                                "master_server_addr": master.addr}) == 0
        assert stores[3].setup(config={"local_hostname": "localhost",
                                       "metadata_server": "P2PHANDSHAKE",
                                       "global_segment_size": 3.5 * MiB,
                                       "master_server_addr": master.addr}) == 0
        assert stores[1].client.segment_name is None  # 0: consumer only
        assert stores[2].client.config.global_segment_size == 8 * MiB
        assert stores[2].client.local_buffer_size == 16 * MiB
        assert stores[3].client.config.global_segment_size == int(3.5 * MiB)
        assert stores[3].client.local_buffer_size == 16 * MiB  # Mooncake's default
        assert stores[0].put("k", b"v") == 0
        assert stores[2].get("k") == b"v"
    finally:
        for s in stores:
            assert s.close() == 0


def test_setup_arguments_pybind_refuses(master, store) -> None:
    with pytest.raises(TypeError, match="incompatible"):
        store.setup("localhost", "P2PHANDSHAKE", 16 * MiB)  # the first seven are required
    with pytest.raises(TypeError, match="no_such_flag"):  # SGLang looks for the name
        store.setup(*args(master), no_such_flag=True)
    with pytest.raises(TypeError, match="config-dict form"):
        store.setup("localhost", "P2PHANDSHAKE", "16MB", MiB, "tcp", "", master.addr)
    with pytest.raises(TypeError):
        store.setup("localhost", "P2PHANDSHAKE", 16.0 * MiB, MiB, "tcp", "", master.addr)
    with pytest.raises(TypeError):
        store.setup("localhost", "P2PHANDSHAKE", -1, MiB, "tcp", "", master.addr)
    with pytest.raises(TypeError):
        store.setup(None, "P2PHANDSHAKE", MiB, MiB, "tcp", "", master.addr)
    assert store.health_check() == 1


@pytest.mark.parametrize(("change", "why"), [
    ({"global_segment_size": "50%"}, "no percentages"),
    ({"global_segment_size": "16 MiB"}, "invalid global_segment_size"),
    ({"global_segment_size": "-1"}, "invalid global_segment_size"),
    ({"global_segment_size": True}, "invalid global_segment_size"),  # str(True)
    ({"global_segment_size": 512}, "must be 0 or at least 1024"),
    ({"local_buffer_size": "2TB"}, "must be 0 or between"),
    ({"local_hostname": ""}, "missing required config: local_hostname"),
    ({"metadata_server": ""}, "missing required config: metadata_server"),
    ({"client_http_port": "x"}, "invalid literal"),
    ({"protocol": "carrier-pigeon"}, "not one Mooncake installs"),
    ({"master_server_addr": "127.0.0.1"}, "no port"),
])
def test_dict_setup_refusals(master, store, caplog, change: dict, why: str) -> None:
    config = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
              "global_segment_size": "1MB", "master_server_addr": master.addr, **change}
    with caplog.at_level(logging.ERROR, "kvmaster.compat"):
        assert store.setup(config) == BAD_PARAMS
    assert why in caplog.text
    assert store.health_check() == 1


def test_unserved_settings_are_reported_once(master, caplog) -> None:
    _setup_reported = ("setup-protocol-rdma", "setup-rdma-devices", "setup-ssd", "setup-http",
                       "setup-engine")
    from kvmaster.compat import _common

    for key in _setup_reported:
        _common._reported.discard(key)
    stores = [MooncakeDistributedStore() for _ in range(2)]
    try:
        with caplog.at_level(logging.WARNING, "kvmaster.compat"):
            for s in stores:
                assert s.setup("localhost", "P2PHANDSHAKE", MiB, MiB, "RDMA", "mlx5_0",
                               master.addr, object(), True, "/nvme/x", "default", True,
                               9301) == 0
        text = caplog.text
        for words in ("protocol 'rdma' is not served", "RDMA devices 'mlx5_0'",
                      "SSD offload is not served", "HTTP server (port 9301)",
                      "Transfer Engine"):
            assert text.count(words) == 1, (words, text)
        assert stores[0].put("k", b"v") == 0 and stores[1].get("k") == b"v"
    finally:
        for s in stores:
            s.close()


# ----------------------------------------------------------- local buffer


def test_zero_local_buffer_fails_copying_calls_not_zero_copy(master, store) -> None:
    assert store.setup(*args(master, lbs=0)) == 0
    assert store.put("k", b"data") == BAD_PARAMS
    assert store.is_exist("k") == 0
    assert store.put_batch(["a", "b"], [b"1", b"2"]) == BAD_PARAMS
    buf = ctypes.create_string_buffer(b"zero-copy", 9)
    assert store.put_from("z", ctypes.addressof(buf), 9) == 0
    out = ctypes.create_string_buffer(16)
    assert store.get_into("z", ctypes.addressof(out), 16) == 9
    assert out.raw[:9] == b"zero-copy"
    assert store.get("z") == b""  # a copy through the (empty) local buffer


def test_local_buffer_bounds_one_calls_bytes(master, store) -> None:
    assert store.setup(*args(master, lbs=4096)) == 0
    assert store.put("small", b"s" * 4096) == 0
    assert store.put("big", b"b" * 4097) == BAD_PARAMS
    assert store.is_exist("big") == 0
    assert store.get("small") == b"s" * 4096
    buf = ctypes.create_string_buffer(8192)
    assert store.put_from("big", ctypes.addressof(buf), 8192) == 0
    assert store.get("big") == b""  # 8 KiB do not fit in a 4 KiB local buffer
    assert store.get_batch(["small"]) == [b"s" * 4096]


# ------------------------------------------------- hostname, health, close


def test_get_hostname_names_the_store(master) -> None:
    a, b, c = (MooncakeDistributedStore() for _ in range(3))
    try:
        assert a.get_hostname() == ""
        assert a.setup(*args(master)) == 0
        assert b.setup(*args(master)) == 0
        host, port = a.get_hostname().split(":")
        assert host == "localhost" and 12300 <= int(port) <= 14300
        assert a.get_hostname() != b.get_hostname()
        assert c.setup("node7:17000", "P2PHANDSHAKE", MiB, MiB, "tcp", "", master.addr) == 0
        assert c.get_hostname() == "node7:17000"
        # The name is the segment's label on the master: other stores see it.
        assert b.client.segment_labels()[a.client.segment_name] == a.get_hostname()
        # A name another mounted segment has is not taken: the segment's own name is.
        d = MooncakeDistributedStore()
        assert d.setup("node7:17000", "P2PHANDSHAKE", MiB, MiB, "tcp", "", master.addr) == 0
        assert d.get_hostname() == d.client.segment_name
        assert d.close() == 0
        assert _setup.segment_name_for(a.get_hostname()) == a.client.segment_name
        assert _setup.segment_name_for("elsewhere:1") == "elsewhere:1"
    finally:
        name = a.get_hostname()
        for s in (a, b, c):
            assert s.close() == 0
    assert a.get_hostname() == "" and _setup.segment_name_for(name) == name


def test_health_check_and_close(start_master) -> None:
    m = start_master("--client-ttl", "2000")
    s = MooncakeDistributedStore()
    assert s.health_check() == 1
    assert s.setup(*args(m)) == 0
    assert s.health_check() == 0
    m.kill()
    deadline = __import__("time").monotonic() + 10
    while s.health_check() == 0 and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.1)
    assert s.health_check() == 2
    assert s.close() == 0
    assert s.close() == 0  # idempotent
    assert s.health_check() == 1
    assert s.put("k", b"v") < 0  # closed: a code, not a crash


def test_setup_twice_replaces_the_client(master, store) -> None:
    assert store.setup(*args(master)) == 0
    first = store.client.segment_name
    assert store.put("k", b"v") == 0
    assert store.setup(*args(master)) == 0
    assert store.client.segment_name != first
    assert not os.path.exists(f"/dev/shm/{first}")
    assert store.get("k") == b""  # it went with the first client's segment


def test_init_all(master, store, monkeypatch) -> None:
    monkeypatch.setattr(_setup, "DEFAULT_MASTER", master.addr)
    assert store.init_all("tcp", "", 4 * MiB) == 0
    assert store.get_hostname() == "localhost:12345"
    assert store.client.config.global_segment_size == 4 * MiB
    assert store.init_all("tcp", "") == BAD_PARAMS  # already initialised


# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize(("text", "size"), [
    (0, 0), (16 * MiB, 16 * MiB), ("16777216", 16 * MiB), ("16MB", 16 * MiB),
    ("16 mb", 16 * MiB), (" 16M ", 16 * MiB), ("3.2GB", int(3.2 * (1 << 30))),
    ("1.5 k", 1536), ("1e3", 1000), ("2T", 2 << 40), ("7b", 7), ("0x10", 16),
    ("infinite", (1 << 64) - 1), (1.9, 1),
])
def test_parse_size(text, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["50%", "", "  ", "MB", "-1", -1, "16 MiB", "1.5PB", None,
                                  True, "nan", "inf", [16]])
def test_parse_size_refuses(text) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


# ------------------------------------------------------------ MooncakeConfig


def test_mooncake_config_from_file(tmp_path) -> None:
    p = tmp_path / "mc.json"
    p.write_text(json.dumps({"local_hostname": "node1", "metadata_server": "P2PHANDSHAKE",
                             "global_segment_size": "3.2GB", "local_buffer_size": 1024,
                             "protocol": "RDMA", "device_name": "mlx5_0",
                             "master_server_address": "10.0.0.1:50051",
                             "enable_ssd_offload": "yes", "tenant_id": 7}))
    c = MooncakeConfig.from_file(str(p))
    assert c.global_segment_size == int(3.2 * (1 << 30)) and c.local_buffer_size == 1024
    assert c.protocol == "rdma" and c.device_name == "mlx5_0"
    assert c.enable_ssd_offload is True and c.tenant_id == "7" and c.client_http_port == 9300
    assert c.setup_args() == ("node1", "P2PHANDSHAKE", int(3.2 * (1 << 30)), 1024, "rdma",
                              "mlx5_0", "10.0.0.1:50051")
    p.write_text(json.dumps({"local_hostname": "n", "metadata_server": "m"}))
    with pytest.raises(ValueError, match="master_server_address"):
        MooncakeConfig.from_file(str(p))
    p.write_text(json.dumps({"local_hostname": "n", "metadata_server": "m",
                             "master_server_address": "a:1", "global_segment_size": "50%"}))
    with pytest.raises(ValueError, match="no percentages"):
        MooncakeConfig.from_file(str(p))
    p.write_text(json.dumps({"local_hostname": "n", "metadata_server": "m",
                             "master_server_address": "a:1"}))
    c = MooncakeConfig.from_file(str(p))
    assert (c.global_segment_size, c.local_buffer_size) == (3355443200, 1073741824)


def test_mooncake_config_load_from_env(monkeypatch, tmp_path) -> None:
    for k in list(os.environ):
        if k.startswith("MOONCAKE_"):
            monkeypatch.delenv(k)
    with pytest.raises(ValueError, match="MOONCAKE_MASTER"):
        MooncakeConfig.load_from_env()
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1gb")
    monkeypatch.setenv("MOONCAKE_OFFLOAD_ENABLED", "off")
    c = MooncakeConfig.load_from_env()
    assert (c.local_hostname, c.metadata_server, c.protocol) == ("localhost", "P2PHANDSHAKE",
                                                                 "tcp")
    assert c.global_segment_size == 1 << 30 and c.local_buffer_size == 1073741824
    assert c.enable_ssd_offload is False
    monkeypatch.setenv("MOONCAKE_OFFLOAD_ENABLED", "perhaps")
    with pytest.raises(ValueError, match="boolean"):
        MooncakeConfig.load_from_env()
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"local_hostname": "x", "metadata_server": "y",
                             "master_server_address": "z:1"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(p))
    assert MooncakeConfig.load_from_env().local_hostname == "x"


def test_mooncake_config_checks() -> None:
    with pytest.raises(ValueError, match="protocol"):
        MooncakeConfig("h", "m", 1, 1, " ", "", "a:1")
    with pytest.raises(ValueError, match="non-negative"):
        MooncakeConfig("h", "m", -1, 1, "tcp", "", "a:1")
    with pytest.raises(ValueError, match="local_hostname"):
        MooncakeConfig("", "m", 1, 1, "tcp", "", "a:1")


def test_shim_serves_mooncake_config(shim) -> None:
    from mooncake.mooncake_config import MooncakeConfig as Shimmed
    from mooncake.store import MooncakeHostMemAllocator

    assert Shimmed is MooncakeConfig
    assert MooncakeHostMemAllocator.__module__ == "kvmaster.compat._dummy"


def test_config_drives_setup(master, store) -> None:
    c = MooncakeConfig("localhost", "P2PHANDSHAKE", 2 * MiB, MiB, "tcp", "", master.addr)
    assert store.setup(*c.setup_args()) == 0
    assert store.put("k", b"v") == 0


# ------------------------------------- Mooncake's own set-up tests, as it runs them


# In the order unittest runs the whole file (classes and methods by name): a store
# left set up by an earlier class (TestZeroLocalBufferSize never closes its own) would
# take test_client_tear_down's object, which must go with its writer's segment.
SETUP_TESTS = ["TestConfigDictSetup",
               "TestDistributedObjectStoreSingleStore.test_basic_get_hostname",
               "TestDistributedObjectStoreSingleStore.test_client_tear_down",
               "TestZeroLocalBufferSize"]


def test_mooncakes_setup_tests(start_master, shim) -> None:
    path = engine_file("mooncake/test_distributed_object_store.py")
    m = start_master("--default-kv-lease-ttl", "500")
    env = {**os.environ, "MASTER_SERVER": m.addr, "DEFAULT_KV_LEASE_TTL": "500",
           "MC_METADATA_SERVER": "http://127.0.0.1:8080/metadata"}
    r = subprocess.run([sys.executable, "-m", "unittest", "-v",
                        *(f"test_distributed_object_store.{t}" for t in SETUP_TESTS)],
                       cwd=path.parent, env=env, check=False, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Ran 5 tests" in r.stderr and "skipped" not in r.stderr, r.stderr[-2000:]
