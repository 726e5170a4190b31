"""Attempts to break the Mooncake facade (kvmaster.compat) with the inputs engines
can hand it: raw addresses, odd sizes, threads sharing a store.  Each test names
the defect it caught; a crash of the store's process is checked in a child so
that a segfault fails the test instead of the run."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvmaster.compat import MooncakeDistributedStore

MiB = 1 << 20
INVALID_PARAMS = -600


@pytest.fixture
def store(make_store):
    return make_store(8 * MiB, 8 * MiB)


def _child(master, body: str) -> subprocess.CompletedProcess:
    """Run ``body`` with ``s`` a set-up store (on ``master``), ``buf``/``p`` a 64-byte
    buffer and its address, in a child process; its stdout is what it prints."""
    code = textwrap.dedent(f"""
        import ctypes
        from kvmaster.compat import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("localhost", "P2PHANDSHAKE", 8 << 20, 8 << 20, "tcp", "",
                       {master.addr!r}) == 0
        buf = ctypes.create_string_buffer(64)
        p = ctypes.addressof(buf)
        assert s.put("k", b"v" * 32) == 0
    """) + textwrap.dedent(body) + "\ns.close()\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


# Defect 1: a null buffer address with a non-zero size crashed the process on reads
# (get_into, batch_get_into: SIGSEGV) and "stored" nothing with success on writes
# (put_from, upsert_from, batch_put_from, batch_upsert_from answered 0, no object).
@pytest.mark.parametrize("call", [
    'print(s.get_into("k", 0, 64))',
    'print(s.batch_get_into(["k"], [0], [64]))',
    'print(s.put_from("n1", 0, 16), s.is_exist("n1"))',
    'print(s.upsert_from("n2", 0, 16), s.is_exist("n2"))',
    'print(s.batch_put_from(["n3"], [0], [16]), s.is_exist("n3"))',
    'print(s.batch_upsert_from(["n4"], [0], [16]), s.is_exist("n4"))',
])
def test_null_address_is_invalid_params_not_a_crash(master, call: str) -> None:
    r = _child(master, call)
    assert r.returncode == 0, f"child died with {r.returncode}: {r.stderr[-2000:]}"
    out = r.stdout.strip()
    assert str(INVALID_PARAMS) in out, out
    assert not out.endswith(" 1"), f"an object was stored from address 0: {out}"


def test_negative_size_is_a_code_not_an_exception(store) -> None:
    buf = ctypes.create_string_buffer(64)
    p = ctypes.addressof(buf)
    assert store.put("k", b"v" * 8) == 0
    assert store.put_from("neg", p, -1) == INVALID_PARAMS
    assert store.upsert_from("neg", p, -1) == INVALID_PARAMS
    assert store.get_into("k", p, -1) == INVALID_PARAMS
    assert store.batch_get_into(["k"], [p], [-1]) == [INVALID_PARAMS]
    assert store.batch_put_from(["neg"], [p], [-5]) == [INVALID_PARAMS]
    assert store.is_exist("neg") == 0


# Defect 2: a store dropped without close() kept its segment in /dev/shm, its
# heartbeat thread and its sockets until the process ended (Mooncake's ~RealClient
# tears down); an engine that makes a store per request or test leaked them all.
def test_a_store_dropped_without_close_releases_its_segment_threads_and_sockets(
        master) -> None:
    import gc
    import threading
    import time
    import weakref

    from tests.conftest import shm_files as shm  # this run's segment files only

    shm0, threads0 = shm(), threading.active_count()
    fds0 = len(os.listdir("/proc/self/fd"))
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 8 * MiB, 8 * MiB, "tcp", "", master.addr) == 0
    assert s.put("dropped", b"x" * 100) == 0
    assert shm() - shm0 and threading.active_count() > threads0
    gone = weakref.ref(s)
    del s
    gc.collect()
    assert gone() is None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (shm() - shm0 or threading.active_count() > threads0):
        time.sleep(0.05)
    assert not shm() - shm0
    assert threading.active_count() <= threads0
    assert len(os.listdir("/proc/self/fd")) <= fds0


def test_close_then_drop_closes_once(master) -> None:
    import gc

    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 8 * MiB, 8 * MiB, "tcp", "", master.addr) == 0
    assert s.close() == 0
    assert "_client_finalizer" not in s.__dict__
    del s
    gc.collect()


# Defect 3: batch_get_into, batch_put_from and batch_upsert_from paired addresses
# and sizes with zip(), so a sizes list longer (or shorter) than buffer_ptrs went
# unnoticed when the shorter one matched the keys: the call read or stored as if
# the lists lined up, where Mooncake answers INVALID_PARAMS at every position.
def test_batch_pointer_calls_refuse_lists_of_different_lengths(store) -> None:
    buf = ctypes.create_string_buffer(64)
    p = ctypes.addressof(buf)
    assert store.put("k", b"v" * 32) == 0
    assert store.batch_get_into(["k"], [p], [64, 64]) == [INVALID_PARAMS]
    assert store.batch_get_into(["k"], [p, p], [64]) == [INVALID_PARAMS]
    assert store.batch_put_from(["a"], [p], [8, 8]) == [INVALID_PARAMS]
    assert store.batch_upsert_from(["b"], [p], [8, 8]) == [INVALID_PARAMS]
    assert store.batch_upsert_from(["b"], [p, p], [8]) == [INVALID_PARAMS]
    assert store.batch_is_exist(["a", "b"]) == [0, 0]
    assert store.batch_get_into(["k"], [p], [64]) == [32]


# Defect 4: a size (or address) of 2**63 or more, which Mooncake's size_t/uintptr_t
# arguments take, escaped as OverflowError from the ranged-session calls,
# put_from_with_metadata and the tensor-from-buffer calls instead of a code; the
# multi-buffer put took an address of 2**63 and crashed the process.
HUGE = 1 << 63


def test_sizes_and_addresses_of_2_63_and_more_are_codes(store) -> None:
    buf = ctypes.create_string_buffer(64)
    p = ctypes.addressof(buf)
    assert store.put("k", b"v" * 32) == 0
    assert store.batch_get_session_start(["k"]) == [0]
    assert store.batch_get_into_multi_buffer_ranges(["k"], [[p]], [[HUGE]], [[0]]) \
        == [INVALID_PARAMS]
    assert store.batch_put_session_start(["s"], [16]) == [0]
    assert store.batch_put_from_multi_buffer_ranges(["s"], [[p]], [[HUGE]], [[0]]) \
        == [INVALID_PARAMS]
    assert store.batch_put_session_revoke(["s"]) == [0]
    assert store.batch_put_from_multi_buffers(["m"], [[HUGE]], [[8]]) == [INVALID_PARAMS]
    assert store.batch_get_into_multi_buffers(["k"], [[p]], [[2 * HUGE - 1]]) \
        == [INVALID_PARAMS]
    assert store.put_from_with_metadata("w", p, p, HUGE, 8) == INVALID_PARAMS
    assert store.put_from_with_metadata("w", p, p, 8, HUGE) == INVALID_PARAMS
    assert store.put_tensor_from("t", p, HUGE) == INVALID_PARAMS
    assert store.upsert_tensor_from("t", p, HUGE) == INVALID_PARAMS
    assert store.batch_put_tensor_from(["t"], [p], [HUGE]) == [INVALID_PARAMS]
    assert store.put_tensor_with_tp_from("t", p, HUGE, tp_size=2) == INVALID_PARAMS
    assert store.get_tensor_with_parallelism_into("k", -1, 64) is None
    assert store.put_from("t", p, HUGE) == INVALID_PARAMS
    assert store.get_into("k", p, HUGE) == INVALID_PARAMS
    assert store.batch_is_exist(["m", "w", "t", "s"]) == [0, 0, 0, 0]


# Defect 5: a write of no bytes answered INVALID_PARAMS where Mooncake's
# RealClient::put_from_internal / upsert_from_internal / put_parts_internal log
# "empty data" and return 0 (nothing is stored).  upsert_parts() with no bytes is
# the same in Mooncake (upsert_parts_internal) but test_compat_tensor asserts
# INVALID_PARAMS for it, so it is left to that file's owner.
def test_empty_pointer_and_parts_writes_answer_0_as_mooncake(store) -> None:
    buf = ctypes.create_string_buffer(8)
    p = ctypes.addressof(buf)
    assert store.put_from("e1", p, 0) == 0
    assert store.put_from("e1", 0, 0) == 0
    assert store.upsert_from("e2", p, 0) == 0
    assert store.put_parts("e3") == 0
    assert store.put_parts("e3", b"", bytearray()) == 0
    assert store.batch_is_exist(["e1", "e2", "e3"]) == [0, 0, 0]
    assert store.put_parts("e5", b"ab", b"") == 0 and store.get("e5") == b"ab"
    assert store.upsert_parts("e5", b"", b"cd") == 0 and store.get("e5") == b"cd"
    not_set_up = MooncakeDistributedStore()
    assert not_set_up.put_from("e6", p, 0) < 0
    assert not_set_up.put_parts("e6") < 0


# Defect 6: addresses and sizes given as numpy or 0-d torch integers (an engine's
# ``tensor.data_ptr() + index * stride`` with a numpy/torch index), which pybind11
# takes for Mooncake's uintptr_t/size_t arguments through __index__, failed: -1
# (INTERNAL_ERROR) from the pointer calls, INVALID_PARAMS from the multi-buffer
# and session calls.
class _Int:
    """An integer type with ``__index__`` only, as numpy's int64 and uint64 are."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def test_numpy_and_torch_integers_are_taken_as_addresses_and_sizes(store) -> None:
    import torch

    buf = ctypes.create_string_buffer(256)
    p = ctypes.addressof(buf)
    ni, ti = _Int, torch.tensor
    assert store.put("k", b"v" * 32) == 0
    assert store.get_into("k", ni(p), ni(64)) == 32
    assert store.batch_get_into(["k"], [ni(p)], [_Int(64)]) == [32]
    assert store.batch_get_into(["k"], [ti(p)], [ti(64)]) == [32]
    ctypes.memmove(p, b"w" * 16, 16)
    assert store.put_from("pf", ni(p), ni(16)) == 0 and store.get("pf") == b"w" * 16
    assert store.batch_put_from(["bp"], [ti(p)], [ti(8)]) == [0]
    assert store.get("bp") == b"w" * 8
    assert store.batch_put_from_multi_buffers(["mb"], [[ni(p), ni(p + 8)]],
                                              [[ni(8), ni(8)]]) == [0]
    assert store.get("mb") == b"w" * 16
    assert store.batch_get_into_multi_buffers(["k"], [[ni(p + 64)]], [[ni(64)]]) == [32]
    assert buf.raw[64:96] == b"v" * 32
    assert store.batch_get_session_start(["k"]) == [0]
    assert store.batch_get_into_multi_buffer_ranges(["k"], [[ni(p + 128)]], [[ni(4)]],
                                                    [[ni(0)]]) == [4]
    assert store.batch_put_session_start(["ps"], [ni(16)]) == [0]
    assert store.batch_put_from_multi_buffer_ranges(["ps"], [[ti(p)]], [[ti(16)]],
                                                    [[ti(0)]]) == [16]
    assert store.batch_put_session_end(["ps"]) == [0] and store.get("ps") == b"w" * 16
    # not integers: refused (pybind11 raises TypeError; the facade answers a code)
    assert store.batch_get_into_multi_buffers(["k"], [[float(p)]], [[64]]) == [INVALID_PARAMS]
    assert store.get_into("k", float(p), 64) < 0


# Defect 7: get_batch / batch_get_buffer / batch_get_tensor answered a miss at every
# position when the values together did not fit in local_buffer_size, where
# Mooncake's batch_get_buffer_internal allocates per key and misses only the keys
# whose buffer cannot be allocated.
def test_a_batch_larger_than_the_local_buffer_misses_only_what_does_not_fit(master) -> None:
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 8 * MiB, 8192, "tcp", "", master.addr) == 0
    try:
        buf = ctypes.create_string_buffer(b"".join(bytes([65 + i]) * 3000 for i in range(3)))
        p = ctypes.addressof(buf)
        assert s.batch_put_from(["a", "b", "c"], [p, p + 3000, p + 6000], [3000] * 3) \
            == [0, 0, 0]
        got = s.get_batch(["a", "b", "c"])
        assert got == [b"A" * 3000, b"B" * 3000, b""]
        handles = s.batch_get_buffer(["a", "nokey", "b", "c"])
        assert [h if h is None else bytes(h) for h in handles] \
            == [b"A" * 3000, None, b"B" * 3000, None]
        assert s.get_batch(["c"]) == [b"C" * 3000]
    finally:
        assert s.close() == 0


# ----------------------------------------------------------------- the shim
# Defect 8: ``uninstall`` removed every file named as one of the shim's (and all of
# __pycache__) once __init__.py had the marker, so a file the shim did not write
# (a hand-edited mooncake_config.py, another module's bytecode) went with it,
# where the docstring says only what install wrote is removed.


def _shim_cli(*args: str, path: list[Path] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path or [])
    return subprocess.run([sys.executable, "-m", "kvmaster", "compat-shim", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def _fake_real_mooncake(site: Path) -> Path:
    """A stand-in for a real Mooncake install: a package without the marker."""
    pkg = site / "mooncake"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Mooncake public Python package."""\n')
    (pkg / "store.so").write_bytes(b"")
    return pkg


def test_shim_install_status_uninstall_round_trip(tmp_path: Path) -> None:
    target = tmp_path / "t"
    r = _shim_cli("install", "--target", str(target))
    assert r.returncode == 0, r.stderr
    assert _shim_cli("status", path=[target]).stdout.strip() \
        == f"kvmaster compat shim at {target / 'mooncake'} (loaded)"
    # --target is looked in even when it is not on sys.path, and says so.
    assert _shim_cli("status", "--target", str(target)).stdout.strip() \
        == f"kvmaster compat shim at {(target / 'mooncake').resolve()} (not on sys.path)"
    r = subprocess.run([sys.executable, "-c", "import mooncake.store as m, "
                        "mooncake.mooncake_config as c; print(m.MooncakeDistributedStore, "
                        "c.MooncakeConfig)"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(target)}, timeout=60)
    assert "kvmaster.compat" in r.stdout, r.stderr
    assert _shim_cli("uninstall", "--target", str(target)).returncode == 0
    assert not (target / "mooncake").exists()
    assert _shim_cli("uninstall", "--target", str(target)).stdout.startswith("no mooncake shim")


def test_shim_refuses_a_real_mooncake_and_shadows_only_when_told(tmp_path: Path) -> None:
    real = _fake_real_mooncake(tmp_path / "real")
    before = sorted(p.name for p in real.iterdir())
    # over it, or removing it: refused, whatever --shadow says
    for args in (("install", "--target", str(real.parent)),
                 ("install", "--target", str(real.parent), "--shadow"),
                 ("uninstall", "--target", str(real.parent))):
        r = _shim_cli(*args)
        assert r.returncode == 1 and "real mooncake" in r.stderr
    assert sorted(p.name for p in real.iterdir()) == before
    # beside it on sys.path: refused unless --shadow
    shim_dir = tmp_path / "shim"
    r = _shim_cli("install", "--target", str(shim_dir), path=[real.parent])
    assert r.returncode == 1 and str(real) in r.stderr and not shim_dir.exists()
    assert _shim_cli("install", "--target", str(shim_dir), "--shadow",
                     path=[real.parent]).returncode == 0
    assert _shim_cli("status", path=[shim_dir, real.parent]).stdout.startswith(
        "kvmaster compat shim")
    assert _shim_cli("status", path=[real.parent, shim_dir]).stdout.startswith(
        "real mooncake")
    r = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True,
                       text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": f"{shim_dir}{os.pathsep}{real.parent}"})
    assert r.returncode == 0 and f"a real mooncake at {real} is shadowed" in r.stderr


def test_shim_uninstall_removes_only_what_it_wrote(tmp_path: Path) -> None:
    target = tmp_path / "t"
    assert _shim_cli("install", "--target", str(target)).returncode == 0
    pkg = target / "mooncake"
    tag = sys.implementation.cache_tag
    (pkg / "__pycache__").mkdir(exist_ok=True)
    for stem in ("__init__", "store", "mooncake_config", "mine"):  # as imports leave them
        (pkg / "__pycache__" / f"{stem}.{tag}.pyc").write_bytes(b"x")
    (pkg / "mooncake_config.py").write_text("# my own config module\nX = 1\n")
    (pkg / "extra.py").write_text("Y = 2\n")
    assert _shim_cli("uninstall", "--target", str(target)).returncode == 0
    assert sorted(p.name for p in pkg.iterdir()) == ["__pycache__", "extra.py",
                                                     "mooncake_config.py"]
    assert (pkg / "mooncake_config.py").read_text().startswith("# my own config module")
    assert sorted(p.name for p in (pkg / "__pycache__").iterdir()) \
        == [f"mine.{tag}.pyc", f"mooncake_config.{tag}.pyc"]


# --------------------------------------------------- threads sharing a store
# Not a defect found: threads sharing one store, upserting and reading the same keys
# through every read path, each read is one whole value of its own key.
def test_threads_sharing_a_store_read_whole_values_of_their_own_keys(store) -> None:
    import random
    import threading

    errors: list[tuple] = []

    def ok(key: str, got: bytes) -> bool:
        head = key.encode() + b":"
        return got.startswith(head) and len(set(got[len(head):])) == 1

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        buf = ctypes.create_string_buffer(8192)
        p = ctypes.addressof(buf)
        for _ in range(80):
            k = f"c{rnd.randrange(8)}"
            v = k.encode() + b":" + bytes([rnd.randrange(256)]) * rnd.choice((100, 2048, 4000))
            op = rnd.randrange(5)
            if op == 0:
                if store.upsert(k, v) != 0:
                    errors.append(("upsert", k))
            elif op == 1:
                ctypes.memmove(p, v, len(v))
                if store.upsert_from(k, p, len(v)) != 0:
                    errors.append(("upsert_from", k))
            elif op == 2:
                n = store.get_into(k, p, 8192)
                if n > 0 and not ok(k, ctypes.string_at(p, n)):
                    errors.append(("get_into", k))
            elif op == 3:
                keys = [f"c{rnd.randrange(8)}" for _ in range(3)]
                bufs = [ctypes.create_string_buffer(4096) for _ in keys]
                got = store.batch_get_into_multi_buffers(
                    keys, [[ctypes.addressof(b)] for b in bufs], [[4096]] * 3)
                for kk, b, n in zip(keys, bufs, got):
                    if n > 0 and not ok(kk, b.raw[:n]):
                        errors.append(("multi", kk))
            else:
                g = store.get(k)
                if g and not ok(k, g):
                    errors.append(("get", k))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


# Defect 9: put_from_with_metadata with size 0 stored the metadata alone as the
# object (and refused a null data address), where Mooncake's
# RealClient::put_from_with_metadata returns 0 for size 0 and stores nothing.
def test_put_from_with_metadata_of_no_data_stores_nothing(store) -> None:
    meta = ctypes.create_string_buffer(b"M" * 8, 8)
    data = ctypes.create_string_buffer(b"D" * 8, 8)
    assert store.put_from_with_metadata("m0", ctypes.addressof(data), ctypes.addressof(meta),
                                        0, 8) == 0
    assert store.put_from_with_metadata("m1", 0, ctypes.addressof(meta), 0, 8) == 0
    assert store.batch_is_exist(["m0", "m1"]) == [0, 0]
    assert store.put_from_with_metadata("m2", ctypes.addressof(data), ctypes.addressof(meta),
                                        8, 8) == 0
    assert store.get("m2") == b"M" * 8 + b"D" * 8
