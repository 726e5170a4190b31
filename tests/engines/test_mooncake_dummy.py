"""Dummy clients (``setup_dummy``): Mooncake's ``test_dummy_client.py`` run as
Mooncake's ``scripts/run_tests.sh`` runs it, and the pieces it rests on.

Mooncake starts ``mooncake_master --default_kv_lease_ttl=500``, then ``mooncake_client``
(a real client serving dummy clients on 127.0.0.1:50052, the address the test file
hard-codes), then ``DEFAULT_KV_LEASE_TTL=500 python test_dummy_client.py``.  Here the
master is kvmaster's, the real client ``python -m kvmaster.compat.mooncake_client``
(with a 512 MB segment instead of mooncake_client's 4 GB default: the test stores a
few MB), and ``mooncake.store`` the compat shim."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.engines.conftest import engine_file

#: Tests of the file that cannot apply here, with why.  Nothing else may be skipped.
NEEDS_CUDA = {
    "test_dummy_cuda_ipc_put_tensor_waits_for_current_stream":
        "CUDA IPC stream readiness: needs a CUDA GPU and a CUDA build of PyTorch",
    "test_dummy_cuda_ipc_batch_put_tensor_waits_for_current_stream":
        "CUDA IPC stream readiness: needs a CUDA GPU and a CUDA build of PyTorch",
}
CUDA_SKIPS = ("PyTorch does not have CUDA support", "CUDA is not available",
              "torch.cuda._sleep is not available")
REAL_CLIENT_PORT = 50052


def _port_free(port: int) -> bool:
    """Nothing listens on ``port`` (connections of an earlier run in TIME_WAIT do not
    count: the real client binds with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def start_real_client(master_addr: str, port: int = REAL_CLIENT_PORT,
                      *flags: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmaster.compat.mooncake_client",
         f"--master_server_address={master_addr}", f"--port={port}",
         "--global_segment_size=512 MB", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if "listening on" not in line:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"the real client did not start: {line!r} {err[-2000:]}")
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the real client did not stop within 15 s of SIGTERM")


def test_dummy_client_file_as_mooncake_runs_it(start_master, shim) -> None:
    path = engine_file("mooncake/test_dummy_client.py")
    if not _port_free(REAL_CLIENT_PORT):
        pytest.fail(f"port {REAL_CLIENT_PORT} is taken: test_dummy_client.py hard-codes its "
                    f"real client at 127.0.0.1:{REAL_CLIENT_PORT}")
    m = start_master("--default-kv-lease-ttl", "500")
    real = start_real_client(m.addr)
    try:
        env = {**os.environ, "MC_METADATA_SERVER": "http://127.0.0.1:8080/metadata",
               "DEFAULT_KV_LEASE_TTL": "500"}
        r = subprocess.run([sys.executable, path.name], cwd=path.parent, env=env,
                           check=False, capture_output=True, text=True, timeout=300)
    finally:
        stop(real)
    out = r.stderr
    names = set(re.findall(r"^    def (test\w+)\(self", path.read_text(), re.MULTILINE))
    results = dict(re.findall(
        r"^(test\w+) \([\w.]+\)\n?(?:[^\n]*?) \.\.\. (ok|skipped '[^']*'|FAIL|ERROR)", out,
        re.MULTILINE))
    assert r.returncode == 0, out[-6000:]
    assert set(results) == names, (sorted(names - set(results)), out[-3000:])
    for name, result in results.items():
        if name in NEEDS_CUDA:
            assert result == "ok" or any(s in result for s in CUDA_SKIPS), (name, result)
        else:
            assert result == "ok", (name, result, out[-3000:])
    assert sum(1 for v in results.values() if v == "ok") >= len(names) - len(NEEDS_CUDA)


# ---------------------------------------------------------------- the pieces


@pytest.fixture
def real_store(master):
    from kvmaster.compat import MooncakeDistributedStore
    from kvmaster.compat._dummy import RealClientService

    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "",
                       master.addr) == 0
    service = RealClientService(store, "127.0.0.1", 0)
    yield store, service
    service.close()
    store.close()


def test_dummy_shares_the_real_clients_segment(real_store) -> None:
    from kvmaster.compat import MooncakeDistributedStore

    real, service = real_store
    dummy = MooncakeDistributedStore()
    assert dummy.setup_dummy(64 << 20, 16 << 20, service.address) == 0
    try:
        assert dummy.get_hostname() == ""  # as Mooncake's dummy client
        assert dummy.client.segment_name is None  # no segment of its own
        assert dummy.put("from-dummy", b"x" * 1000) == 0
        assert real.get("from-dummy") == b"x" * 1000
        replicas = dummy.client.query_key("from-dummy")
        assert real.client.segment_name in str(replicas)
        assert dummy.health_check() == 0
        # A zero-copy read into memory of the pool, registered first as Mooncake needs.
        ptr = dummy.alloc_from_mem_pool(4096)
        assert ptr and dummy.register_buffer(ptr, 4096) == 0
        assert dummy.get_into("from-dummy", ptr, 4096) == 1000
        assert ctypes.string_at(ptr, 1000) == b"x" * 1000
        assert dummy.unregister_buffer(ptr) == 0
    finally:
        assert dummy.close() == 0
    assert dummy.health_check() == 1


def test_dummy_health_follows_the_real_client(real_store) -> None:
    from kvmaster.compat import MooncakeDistributedStore

    _, service = real_store
    dummy = MooncakeDistributedStore()
    assert dummy.setup_dummy(0, 0, service.address) == 0
    try:
        assert dummy.health_check() == 0
        service.close()
        assert dummy.health_check() == 2
    finally:
        dummy.close()


def test_setup_dummy_without_a_real_client_fails(caplog) -> None:
    from kvmaster.compat import MooncakeDistributedStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dummy = MooncakeDistributedStore()
    with caplog.at_level(logging.ERROR, "kvmaster.compat"):
        started = time.monotonic()
        assert dummy.setup_dummy(0, 16 << 20, f"127.0.0.1:{port}") == -1
        assert time.monotonic() - started < 5
    assert "no real client" in caplog.text
    assert dummy.setup_dummy(0, 16 << 20, "127.0.0.1") == -1  # no port
    assert dummy.health_check() == 1
    with pytest.raises(TypeError):
        dummy.setup_dummy("16MB", 0, f"127.0.0.1:{port}")
    assert dummy.close() == 0


def test_setup_dummy_refuses_a_real_client_on_another_host(real_store, monkeypatch,
                                                           caplog) -> None:
    from kvmaster.compat import MooncakeDistributedStore, _dummy

    _, service = real_store
    info = service.info
    monkeypatch.setattr(service, "info", lambda: {**info(), "host_id": "elsewhere"})
    dummy = MooncakeDistributedStore()
    with caplog.at_level(logging.ERROR, "kvmaster.compat"):
        assert dummy.setup_dummy(0, 0, service.address) == -1
    assert "not this one" in caplog.text
    assert _dummy.query_real_client(service.address, "nonsense") == {
        "error": "unknown op 'nonsense'"}


def test_real_client_service_before_setup_says_so() -> None:
    from kvmaster.compat import MooncakeDistributedStore
    from kvmaster.compat._dummy import RealClientService, query_real_client

    store = MooncakeDistributedStore()
    service = RealClientService(store, "0.0.0.0", 0)  # a wildcard is bound to loopback
    try:
        assert service.address.startswith("127.0.0.1:")
        assert "error" in query_real_client(service.address)
        assert MooncakeDistributedStore().setup_dummy(0, 0, service.address) == -1
    finally:
        service.close()


def test_host_mem_allocator(shim) -> None:
    from mooncake.store import MooncakeHostMemAllocator

    a = MooncakeHostMemAllocator()
    p = a.alloc(1 << 20)
    q = a.alloc(4096)
    assert p and q and p != q
    ctypes.memset(p, 7, 1 << 20)
    assert ctypes.string_at(p + (1 << 20) - 3, 3) == b"\x07" * 3
    assert a.free(p) == 0
    assert a.free(p) == -1  # already freed
    assert a.free(12345) == -1
    assert a.free(q) == 0
    with pytest.raises(RuntimeError):
        a.alloc(0)


def test_mooncake_client_flags_and_a_taken_port(master) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvmaster.compat.mooncake_client",
                            f"--master_server_address={master.addr}", f"--port={port}",
                            "--global_segment_size=16MB"],
                           check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot serve" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "kvmaster.compat.mooncake_client",
                        "--global_segment_size=50%"], check=False, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "no percentages" in r.stderr
