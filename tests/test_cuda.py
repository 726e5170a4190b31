"""Device memory in the client data plane (kvmaster/_cuda.py, kvmaster/_device.py).

Where no GPU exists the CUDA runtime is the stand-in of ``tests/cuda_standin.py``
(device allocations the CPU cannot touch: a CPU copy from one would crash the
process), named in each test that uses it; the last test runs on a real GPU and
skips, saying so, where there is none."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator

import pytest

from kvmaster import Client
from kvmaster import _cuda, _device
from kvmaster.compat import MooncakeDistributedStore
from tests.conftest import MasterProcess
from tests.cuda_standin import CudaStandIn


@pytest.fixture(scope="module")
def master() -> Iterator[MasterProcess]:
    m = MasterProcess("--shards", "2")
    yield m
    assert m.stop() == 0, getattr(m, "stderr", "")


@pytest.fixture
def standin() -> Iterator[CudaStandIn]:
    """The CUDA stand-in as the process's runtime (no GPU here)."""
    rt = CudaStandIn()
    _cuda.use_runtime(rt)
    yield rt
    _cuda.reset()
    rt.close()


@pytest.fixture
def client(master) -> Iterator[Client]:
    c = Client()
    c.setup(master.addr, 16 << 20)
    yield c
    c.close()


def _host(data: bytes) -> tuple[int, ctypes.Array]:
    buf = ctypes.create_string_buffer(data, len(data))
    return ctypes.addressof(buf), buf


def test_pointers_are_classified_with_their_reason(standin) -> None:
    """CUDA stand-in: device memory, a freed device pointer, a position mixing host
    and device buffers; and with no runtime at all."""
    dev = standin.alloc(4096)
    gone = standin.alloc(4096)
    standin.free(gone)
    host, _keep = _host(b"x" * 64)
    device, refused = _cuda.classify([0, 1, 2], [[dev, dev + 2048], [gone], [dev, host]],
                                     [[2048, 2048], [64], [64, 64]])
    assert device == {0}
    assert refused == {1: _cuda.NOT_DEVICE, 2: _cuda.MIXED}
    _cuda.use_runtime(None)
    assert _cuda.classify([0], [[dev]], [[64]]) == (set(), {0: _cuda.NO_CUDA})


def test_native_client_writes_from_and_reads_into_device_memory(standin, client) -> None:
    """CUDA stand-in: two keys gathered from two device buffers each, read back by the
    CPU path and scattered into other device buffers; one CUDA batch per call, and
    the mapped segment page-locked."""
    values = [os.urandom(3000) + os.urandom(1096), os.urandom(4096)]
    src = [standin.alloc(4096) for _ in values]
    for addr, v in zip(src, values):
        standin.write(addr, v)
    keys = [f"dev-{os.urandom(6).hex()}" for _ in values]
    ptrs = [[a, a + 3000] for a in src]
    sizes = [[3000, 1096]] * 2
    assert client.batch_put_from_device(keys, ptrs, sizes) == [0, 0]
    assert standin.batches == 1 and standin.registered
    assert client.get_batch(keys) == values
    assert client.batch_put_from_device(keys, ptrs, sizes) == [0, 0]  # there already
    dst = [standin.alloc(8192) for _ in values]
    got = client.batch_get_into_device(keys + ["absent"], [[d, d + 100] for d in dst] + [[dst[0]]],
                                       [[100, 8000]] * 2 + [[64]])
    assert got[:2] == [4096, 4096] and got[2] < 0
    assert [standin.read(d, 4096) for d in dst] == values
    small = standin.alloc(64)
    assert client.batch_get_into_device(keys[:1], [[small]], [[64]]) == [-600]


def test_a_replica_not_mapped_here_goes_through_host_staging(standin, client,
                                                             monkeypatch) -> None:
    """CUDA stand-in: as for a replica on another host, the bytes go device -> host
    staging -> ranged write, and ranged read -> host staging -> device."""
    monkeypatch.setattr(_device, "_mapped", lambda c, rt, name: None)
    value = os.urandom(5000)
    src = standin.alloc(5000)
    standin.write(src, value)
    key = f"staged-{os.urandom(6).hex()}"
    assert client.batch_put_from_device([key], [[src]], [[5000]]) == [0]
    assert client.get_batch([key]) == [value]
    dst = standin.alloc(5000)
    assert client.batch_get_into_device([key], [[dst]], [[5000]]) == [5000]
    assert standin.read(dst, 5000) == value


def test_compat_multi_buffer_calls_serve_device_pointers(standin, master) -> None:
    """CUDA stand-in: vLLM's calls (register_buffer, batch_put_from_multi_buffers,
    batch_get_into_multi_buffers) with one host, one device and one freed position
    in a call: the freed one is refused -600, the others served, bytes checked."""
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                       master.addr) == 0
    try:
        dev = standin.alloc(1 << 16)
        gone = standin.alloc(4096)
        standin.free(gone)
        assert store.register_buffer(dev, 1 << 16) == 0
        assert store.register_buffer(gone, 4096) == -600
        host_value, dev_value = os.urandom(2048), os.urandom(4096)
        host, _keep = _host(host_value)
        standin.write(dev, dev_value)
        keys = [f"mb-{os.urandom(6).hex()}" for _ in range(3)]
        ptrs = [[host], [dev, dev + 1024], [gone]]
        sizes = [[2048], [1024, 3072], [4096]]
        assert store.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0, 0, -600]
        out_host, _keep2 = _host(b"\0" * 2048)
        out_dev = dev + 8192
        got = store.batch_get_into_multi_buffers(keys, [[out_host], [out_dev], [gone]],
                                                 [[2048], [4096], [4096]])
        assert got == [2048, 4096, -600]
        assert ctypes.string_at(out_host, 2048) == host_value
        assert standin.read(out_dev, 4096) == dev_value
        # No CUDA runtime: device pointers are refused with the reason, never copied.
        _cuda.use_runtime(None)
        assert store.register_buffer(dev, 4096) == -600
        assert store.batch_put_from_multi_buffers([keys[0] + "x"], [[dev]], [[64]]) == [-600]
    finally:
        store.close()


def test_on_a_real_gpu(master) -> None:
    """A real CUDA device: torch's CUDA tensors written and read through both paths."""
    torch = pytest.importorskip("torch", reason="torch provides the device memory here")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine (the stand-in tests above cover the "
                    "code paths; tools/gpu_check.py measures on a GPU machine)")
    _cuda.reset()
    assert _cuda.runtime() is not None, "torch sees a GPU but libcudart did not load"
    c = Client()
    c.setup(master.addr, 64 << 20)
    try:
        src = torch.randint(0, 256, (4, 1 << 20), dtype=torch.uint8, device="cuda")
        keys = [f"gpu-{os.urandom(6).hex()}" for _ in range(4)]
        assert c.batch_put_from_device(keys, [[t.data_ptr()] for t in src],
                                       [[1 << 20]] * 4) == [0] * 4
        dst = torch.zeros_like(src)
        assert c.batch_get_into_device(keys, [[t.data_ptr()] for t in dst],
                                       [[1 << 20]] * 4) == [1 << 20] * 4
        assert torch.equal(src, dst)
        assert c.get_batch(keys[:1]) == [bytes(src[0].cpu().numpy())]
    finally:
        c.close()
        _cuda.reset()


def test_device_buffers_in_the_single_buffer_calls(standin, master) -> None:
    """CUDA stand-in: put_from / get_into / batch_put_from / batch_get_into with device
    pointers are copied by CUDA; upserts from device memory are refused, not run."""
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                       master.addr) == 0
    try:
        a, b = standin.alloc(4096), standin.alloc(4096)
        va, vb = os.urandom(4096), os.urandom(4096)
        standin.write(a, va)
        standin.write(b, vb)
        k = [f"one-{os.urandom(6).hex()}" for _ in range(3)]
        assert store.put_from(k[0], a, 4096) == 0
        assert store.batch_put_from(k[1:], [a, b], [4096, 4096]) == [0, 0]
        assert store.get(k[0]) == va and store.get(k[2]) == vb
        out = standin.alloc(3 * 4096)
        assert store.get_into(k[0], out, 4096) == 4096
        assert store.batch_get_into(k[1:], [out + 4096, out + 8192], [4096, 4096]) == [4096] * 2
        assert standin.read(out, 3 * 4096) == va + va + vb
        assert store.upsert_from(k[0], a, 4096) == -600
        assert store.batch_upsert_from(k[:1], [a], [4096]) == [-600]
    finally:
        store.close()


def test_gpu_check_runs_its_flow_without_a_gpu() -> None:
    """tools/gpu_check.py --dry-run-cpu: host memory taken for device memory, so the
    script that measures on a GPU machine is known to run before it gets one."""
    import subprocess
    import sys

    from tests.conftest import REPO

    out = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--dry-run-cpu",
                          "--layers", "2", "--blocks", "8", "--block-bytes", "16384",
                          "--runs", "1"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "verification failures: 0" in out.stdout
    assert out.stdout.count("host registration") == 4
