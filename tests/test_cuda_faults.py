"""Faults and edge cases of the CUDA data plane (kvmaster/_device.py, _cuda.py and the
compat facade's routing), found by attacking it: zero-size parts, mismatched lists,
repeated keys, per-key config lists, checksums of staged reads, writes left open after
a fence expiry or a copy error, ranged calls and close() racing device copies (in child
processes, whose crash would be a segfault), CudaRuntime's ctypes use with a fake
``libcudart``, and host registrations that must not outlive their mapping.  The CUDA
runtime is the stand-in of tests/cuda_standin.py (no GPU here) unless a test says
otherwise."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator

import pytest

from kvmaster import Client
from kvmaster import _cuda, _device, _fence
from kvmaster import errors as E
from kvmaster.compat import MooncakeDistributedStore
from kvmaster.compat import ReplicateConfig as MCConfig
from tests.test_cuda import client, master, standin  # noqa: F401 - the fixtures




@pytest.fixture
def store(master) -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                   master.addr) == 0
    yield s
    s.close()


def _key(tag: str) -> str:
    return f"{tag}-{os.urandom(6).hex()}"


def _put_dev(standin, client, value: bytes) -> str:
    src = standin.alloc(len(value))
    standin.write(src, value)
    k = _key("v")
    assert client.batch_put_from_device([k], [[src]], [[len(value)]]) == [0]
    return k


def _still_open(client: Client, key: str, n: int) -> bool:
    """Whether a write of ``key`` is still open on the master (leaked)."""
    p = client.batch_put_start([key], [n])
    st = p.status[0]
    if p.open():
        client.batch_put_revoke(p, p.open())
    return st != 0


# ------------------------------------------------------------- wrong bytes


def test_get_zero_size_leading_part_copies_the_bytes(standin, client) -> None:
    value = os.urandom(4096)
    k = _put_dev(standin, client, value)
    dst = standin.alloc(4096)
    got = client.batch_get_into_device([k], [[dst, dst]], [[0, 4096]])
    assert got == [4096]
    assert standin.read(dst, 4096) == value, "reported 4096 bytes read, none copied"


def test_compat_get_zero_size_middle_part(standin, client, store) -> None:
    value = os.urandom(4096)
    k = _put_dev(standin, client, value)
    dst = standin.alloc(4096)
    got = store.batch_get_into_multi_buffers([k], [[dst, dst + 1000, dst + 1000]],
                                             [[1000, 0, 3096]])
    assert got == [4096]
    assert standin.read(dst, 4096) == value


def test_host_get_into_ptrs_zero_size_part_with_checksums(client) -> None:
    """(pre-existing host path, same loop) a zero-size part => false CHECKSUM_MISMATCH."""
    value = os.urandom(4096)
    k = _key("h")
    assert client.put(k, value) in (None, 0)
    buf = ctypes.create_string_buffer(4096)
    a = ctypes.addressof(buf)
    assert client.batch_get_into_ptrs([k], [[a, a]], [[0, 4096]]) == [4096]
    assert buf.raw == value


def test_device_put_mismatched_part_lists(standin, client) -> None:
    src = standin.alloc(100)
    standin.write(src, b"a" * 100)
    k = _key("mm")
    got = client.batch_put_from_device([k], [[src]], [[100, 100]])
    assert got == [-600], f"stored {client.get_size(k)} bytes, half never written: {got}"


def test_staged_read_checks_the_checksum(standin, client, monkeypatch) -> None:
    value = os.urandom(4096)
    k = _put_dev(standin, client, value)
    leases = client.batch_get_leases([k])
    name, off = leases.replicas[0][0]
    view, _addr, _probe = client._local_address(name)
    view[off] ^= 0xFF  # corrupt the stored replica
    dst = standin.alloc(4096)
    monkeypatch.setattr(_device, "_mapped", lambda c, rt, n: None)  # a replica elsewhere
    staged = client.batch_get_into_device([k], [[dst]], [[4096]])
    assert staged == [-801], f"staged read returned {staged} with corrupt bytes"


# ------------------------------------------------------------- leaked writes


def test_fence_expired_before_copies_revokes(standin, client, monkeypatch) -> None:
    src = standin.alloc(4096)
    standin.write(src, os.urandom(4096))
    k = _key("fence")

    def expired(self):
        raise E.LeaseExpired("test: fence passed", op="t")

    monkeypatch.setattr(_fence.WriteFence, "limit", expired)
    with pytest.raises(E.LeaseExpired):
        client.batch_put_from_device([k], [[src]], [[4096]])
    monkeypatch.undo()
    assert not _still_open(client, k, 4096), "the started write was never revoked"


def test_non_cuda_error_in_copies_revokes(standin, client, monkeypatch) -> None:
    src = standin.alloc(4096)
    k = _key("argerr")

    def boom(copies):
        raise ctypes.ArgumentError("argument 1: TypeError: wrong type")

    monkeypatch.setattr(standin, "copy_batch", boom)
    with pytest.raises(ctypes.ArgumentError):
        client.batch_put_from_device([k], [[src]], [[4096]])
    monkeypatch.undo()
    assert not _still_open(client, k, 4096), "the started write was never revoked"


def test_cuda_error_revokes(standin, client, monkeypatch) -> None:
    src = standin.alloc(4096)
    k = _key("cudaerr")

    def boom(copies):
        raise _cuda.CudaError("cudaMemcpyAsync failed: error 1")

    monkeypatch.setattr(standin, "copy_batch", boom)
    with pytest.raises(_cuda.CudaError):
        client.batch_put_from_device([k], [[src]], [[4096]])
    monkeypatch.undo()
    assert not _still_open(client, k, 4096)


# ------------------------------------------------------------- compat routing


def test_compat_duplicate_device_keys(standin, store) -> None:
    dev = standin.alloc(8192)
    standin.write(dev, os.urandom(8192))
    a, b = _key("dup"), _key("dup")
    got = store.batch_put_from_multi_buffers([a, a, b], [[dev], [dev + 4096], [dev]],
                                             [[4096], [4096], [4096]])
    host = ctypes.create_string_buffer(os.urandom(4096), 4096)
    h = ctypes.addressof(host)
    c, d = _key("duph"), _key("duph")
    want = store.batch_put_from_multi_buffers([c, c, d], [[h], [h], [h]],
                                              [[4096], [4096], [4096]])
    assert got == want, f"device {got} vs host {want}"


def test_compat_kv_sessions_survive_routing(standin, store) -> None:
    dev = standin.alloc(4096)
    standin.write(dev, os.urandom(4096))
    host = ctypes.create_string_buffer(os.urandom(4096), 4096)
    h = ctypes.addressof(host)
    cfg = MCConfig()
    cfg.kv_sessions = [["s1"], ["s1"]]
    ks = [_key("kvs"), _key("kvs")]
    want = store.batch_put_from_multi_buffers([_key("kvsh"), _key("kvsh")], [[h], [h]],
                                              [[4096], [4096]], cfg)
    got = store.batch_put_from_multi_buffers(ks, [[h], [dev]], [[4096], [4096]], cfg)
    assert got == want, f"mixed {got} vs host-only {want}"


def test_compat_group_ids_bad_length_is_a_code(standin, store) -> None:
    dev = standin.alloc(4096)
    cfg = MCConfig()
    cfg.group_ids = []
    r = store.put_from(_key("g"), dev, 4096, cfg)  # must not raise
    assert isinstance(r, int) and r < 0


def test_compat_numpy_ints_device(standin, store) -> None:
    np = pytest.importorskip("numpy")
    dev = standin.alloc(4096)
    value = os.urandom(4096)
    standin.write(dev, value)
    k = _key("np")
    assert store.put_from(k, np.int64(dev), np.int64(4096)) == 0
    out = standin.alloc(4096)
    assert store.get_into(k, np.int64(out), np.int64(4096)) == 4096
    assert standin.read(out, 4096) == value


def test_compat_dup_key_first_position_wins(standin, store, client) -> None:
    """A repeated key is written from its first position (batch_put_from_ptrs)."""
    dev = standin.alloc(4096)
    dv = os.urandom(4096)
    standin.write(dev, dv)
    host = ctypes.create_string_buffer(os.urandom(4096), 4096)
    k = _key("order")
    assert store.batch_put_from_multi_buffers([k, k], [[dev], [ctypes.addressof(host)]],
                                              [[4096], [4096]]) == [0, 0]
    assert store.get(k) == dv, "stored the second (host) position's bytes"


@pytest.mark.parametrize("which", ["get", "put"])
def test_ranged_calls_with_device_pointers_do_not_crash(which) -> None:
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, os.path.join(here, "cuda_ranged_child.py"), which],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-300:]


# ------------------------------------------------------------- CudaRuntime via a fake lib


class _Fn:
    def __init__(self, fn):
        self.fn = fn
        self.argtypes = None
        self.restype = None
        self.calls = 0

    def __call__(self, *a):
        self.calls += 1
        return self.fn(*a)


class FakeLib:
    def __init__(self, memcpy_err=0, sync_err=0):
        self.last = 0
        self.synced = []

        def count(p):
            p._obj.value = 1
            return 0

        self._n = 0

        def stream_create(p):
            self._n += 1
            p._obj.value = 0x1000 * self._n
            return 0

        def memcpy(dst, src, n, kind, stream):
            if memcpy_err:
                self.last = memcpy_err
            return memcpy_err

        def sync(stream):
            self.synced.append(stream)
            return sync_err

        def get_last():
            e, self.last = self.last, 0
            return e

        self.cudaGetErrorString = _Fn(lambda e: b"fake")
        self.cudaGetDeviceCount = _Fn(count)
        self.cudaStreamCreate = _Fn(stream_create)
        self.cudaMemcpyAsync = _Fn(memcpy)
        self.cudaStreamSynchronize = _Fn(sync)
        self.cudaGetLastError = _Fn(get_last)
        self.cudaHostRegister = _Fn(lambda p, n, f: 0)
        self.cudaHostUnregister = _Fn(lambda p: 0)
        self.cudaPointerGetAttributes = _Fn(lambda a, p: 0)


def test_cudart_struct_layout() -> None:
    # CUDA 11+: enum type; int device; void* devicePointer; void* hostPointer
    assert ctypes.sizeof(_cuda._Attributes) == 24
    assert _cuda._Attributes.devicePointer.offset == 8


def test_copy_batch_error_syncs_all_and_clears_last_error() -> None:
    lib = FakeLib(memcpy_err=1)
    rt = _cuda.CudaRuntime(lib)
    with pytest.raises(_cuda.CudaError):
        rt.copy_batch([(1, 2, 3)] * 10)
    assert len(lib.synced) == _cuda.STREAMS
    assert lib.last == 0, "a failed cudaMemcpyAsync left CUDA's last error set " \
        "(the next torch cudaGetLastError check raises it)"


def test_copy_batch_sync_error_all_streams() -> None:
    lib = FakeLib(sync_err=700)
    rt = _cuda.CudaRuntime(lib)
    with pytest.raises(_cuda.CudaError):
        rt.copy_batch([(1, 2, 3)] * 10)
    assert len(lib.synced) == _cuda.STREAMS


# ------------------------------------------------------------- what should hold


def test_threads_device_put_get(standin, client) -> None:
    import threading
    errs = []

    def work(t):
        try:
            for n in range(15):
                v = os.urandom(3000 + t * 7 + n)
                src = standin.alloc(len(v)); standin.write(src, v)
                k = _key(f"thr{t}")
                assert client.batch_put_from_device([k], [[src]], [[len(v)]]) == [0]
                dst = standin.alloc(len(v) + 100)
                assert client.batch_get_into_device([k], [[dst]], [[len(v) + 100]]) == [len(v)]
                assert standin.read(dst, len(v)) == v
        except BaseException as e:  # noqa
            errs.append(repr(e))

    ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    [t.start() for t in ts]; [t.join() for t in ts]
    assert not errs, errs[:3]


def test_get_lease_expiry_reported(standin, client, monkeypatch) -> None:
    k = _put_dev(standin, client, os.urandom(4096))
    dst = standin.alloc(4096)
    real = standin.copy_batch
    import time
    def slow(c):
        real(c)
        monkeypatch.setattr(_fence, "clock", lambda: time.monotonic() + 1e6)
    monkeypatch.setattr(standin, "copy_batch", slow)
    assert client.batch_get_into_device([k], [[dst]], [[4096]]) == [-707]


def test_put_fence_after_copies_revokes(standin, client, monkeypatch) -> None:
    src = standin.alloc(4096)
    k = _key("late")
    real = standin.copy_batch
    import time
    def slow(c):
        real(c)
        monkeypatch.setattr(_fence, "clock", lambda: time.monotonic() + 1e6)
    monkeypatch.setattr(standin, "copy_batch", slow)
    with pytest.raises(E.LeaseExpired):
        client.batch_put_from_device([k], [[src]], [[4096]])
    monkeypatch.undo()
    assert not _still_open(client, k, 4096)
    assert client.batch_is_exist([k])[0] in (0, False)


def test_mixed_position_and_bigger_smaller_buffers(standin, store, client) -> None:
    dev = standin.alloc(8192)
    v = os.urandom(4096); standin.write(dev, v)
    host = ctypes.create_string_buffer(64)
    ks = [_key("mix"), _key("mix")]
    got = store.batch_put_from_multi_buffers(ks, [[dev, ctypes.addressof(host)], [dev]],
                                             [[64, 64], [4096]])
    assert got == [-600, 0]
    out = standin.alloc(8192)
    assert store.batch_get_into_multi_buffers(ks[1:], [[out]], [[8192]]) == [4096]
    assert standin.read(out, 4096) == v
    assert store.batch_get_into_multi_buffers(ks[1:], [[out]], [[4095]]) == [-600]


def test_segment_registration_outlives_the_mapping(master) -> None:
    """A closed client's segment stays cudaHostRegister'ed (pinned, never
    unregistered); a later mapping at the same address is then taken as registered
    and never registered itself (real CUDA: stale pinned pages / DMA to old pages)."""
    lib = FakeLib()
    regs = []
    lib.cudaHostRegister = _Fn(lambda p, n, f: regs.append((p, n)) or 0)
    lib.cudaMemcpyAsync = _Fn(lambda d, s, n, k, st: ctypes.memmove(d, s, n) and 0)
    rt = _cuda.CudaRuntime(lib)
    rt.kind = lambda p: _cuda.PointerKind.DEVICE
    _cuda.use_runtime(rt)
    try:
        src = ctypes.create_string_buffer(os.urandom(4096), 4096)
        addrs = []
        for _ in range(3):
            c = Client()
            c.setup(master.addr, 16 << 20)
            assert c.batch_put_from_device([_key("reg")], [[ctypes.addressof(src)]],
                                           [[4096]]) == [0]
            seg = next(iter(rt._registered))
            addrs.append(seg)
            c.close()
        assert lib.cudaHostUnregister.calls > 0, \
            f"never unregistered; registered={rt._registered}, cudaHostRegister calls={regs}"
    finally:
        _cuda.reset()


def test_close_during_device_copies_does_not_crash() -> None:
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, os.path.join(here, "cuda_close_race.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-300:]
