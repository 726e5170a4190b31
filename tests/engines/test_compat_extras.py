"""The facade's names beyond objects and tensors: extra segments, safetensors files,
NUMA binding, the allocator addresses, and the tiers kvmaster does not have."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

import kvmaster.compat as compat
from kvmaster import Client
from kvmaster.compat import MooncakeDistributedStore, ReplicateConfig, _common
from kvmaster.compat._segments import MAX_EXTRA_SEGMENTS

MiB = 1 << 20
NOT_SUPPORTED, INVALID_PARAMS, FILE_NOT_FOUND = -1012, -600, -1100


@pytest.fixture
def store(make_store):
    return make_store(8 * MiB, 16 * MiB)


def test_an_extra_segment_takes_writes_and_its_unmount_erases_them(store) -> None:
    r = store.allocate_and_mount_segment(32 * MiB)
    assert r["ret"] == 0 and r["allocated_size"] == 32 * MiB and len(r["segment_ids"]) == 1
    sid = r["segment_ids"][0]
    segs = {s["name"]: s for s in store.client.list_segments()}
    assert sid in segs and segs[sid]["size"] == 32 * MiB
    cfg = ReplicateConfig()
    cfg.preferred_segment = sid
    assert store.put("on-extra", b"x" * 4096, cfg) == 0
    assert store.get_replica_desc("on-extra")[0].get_memory_descriptor() is not None
    assert store.get("on-extra") == b"x" * 4096
    assert store.unmount_and_free_segment([sid]) == 0
    assert sid not in {s["name"] for s in store.client.list_segments()}
    assert store.get("on-extra") == b""  # erased with its segment, as Mooncake's unmount
    assert store.unmount_and_free_segment([sid]) == INVALID_PARAMS  # not ours any more


def test_extra_segments_are_bounded_and_closed_with_the_store(master) -> None:
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", master.addr) == 0
    made = [s.allocate_and_mount_segment(MiB) for _ in range(MAX_EXTRA_SEGMENTS)]
    assert all(r["ret"] == 0 for r in made)
    assert s.allocate_and_mount_segment(MiB)["ret"] == INVALID_PARAMS
    assert s.allocate_and_mount_segment(0)["ret"] == INVALID_PARAMS
    ids = {r["segment_ids"][0] for r in made}
    assert ids <= {x["name"] for x in s.client.list_segments()}
    assert s.close() == 0
    probe = Client()
    probe.setup(master.addr, 0)
    try:
        assert not ids & {x["name"] for x in probe.list_segments()}
    finally:
        probe.close()


def test_tiers_kvmaster_does_not_have_are_refused_or_reported(store) -> None:
    r = store.mount_segment("/mnt/dax0", 64 * MiB)
    assert r == {"ret": NOT_SUPPORTED, "segment_ids": []}
    assert store.unmount_local_disk_segment() == 0
    assert store.get_offload_rpc_read_count() == 0
    nof = compat.MooncakeDistributedNoFRegister()
    assert nof.real_register("nqn", 1) == NOT_SUPPORTED
    assert nof.real_unregister_by_endpoint("ep") == NOT_SUPPORTED
    d = compat.DiskDescriptor()
    assert (d.file_path, d.object_size) == ("", 0)
    assert compat._get_pyclient_from_wrapper(store) is store.client


def test_a_tensor_round_trips_through_a_safetensors_file(store, tmp_path: Path) -> None:
    import torch
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert store.put_tensor("w", t) == 0
    f = tmp_path / "w.safetensors"
    assert store.save_tensor_to_safetensor("w", str(f)) == 0 and f.stat().st_size > 24 * 4
    assert store.save_tensor_to_safetensor("missing", str(tmp_path / "m")) == FILE_NOT_FOUND
    back = store.load_tensor_from_safetensor("w2", str(f))  # not an entry: the first one
    assert torch.equal(back, t) and torch.equal(store.get_tensor("w2"), t)
    assert torch.equal(store.load_tensor_from_safetensor("w", str(f)), t)
    assert store.load_tensor_from_safetensor("x", str(tmp_path / "nope")) is None


def test_numa_binding_and_the_allocator_addresses() -> None:
    before = os.sched_getaffinity(0)
    try:
        compat.bind_to_numa_node(0)
        node0 = Path("/sys/devices/system/node/node0/cpulist")
        if node0.exists():  # Linux with NUMA information: exactly node 0's CPUs
            from kvmaster.compat._module import _cpulist

            assert os.sched_getaffinity(0) == _cpulist(node0.read_text())
        else:
            assert os.sched_getaffinity(0) == before
        compat.bind_to_numa_node(4096)  # no such node: a warning, nothing changed
    finally:
        os.sched_setaffinity(0, before)
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(compat.get_alloc_func_addr())
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t)(compat.get_free_func_addr())
    p = alloc(4096)
    assert p
    ctypes.memset(p, 7, 4096)
    assert ctypes.string_at(p, 4) == b"\x07" * 4
    free(p, 4096)


def test_config_fields_without_a_tier_are_reported_once(caplog) -> None:
    import logging

    from kvmaster.compat import _common

    _common._reported.difference_update({"config-dfs_replica_num",
                                         "config-preferred_nof_segments"})
    cfg = ReplicateConfig()
    with caplog.at_level(logging.WARNING, logger="kvmaster.compat"):
        cfg.dfs_replica_num = 0  # the default: nothing to report
        cfg.dfs_replica_num = 2
        cfg.dfs_replica_num = 3
        cfg.preferred_nof_segments = ["nof-0"]
    lines = [r.getMessage() for r in caplog.records]
    assert sum("dfs_replica_num" in m for m in lines) == 1
    assert sum("preferred_nof_segments" in m for m in lines) == 1
    assert cfg.dfs_replica_num == 3 and cfg.preferred_nof_segments == ["nof-0"]
    for bad in ("2", -1, 1 << 64, 2.0, True):
        with pytest.raises(TypeError):
            cfg.replica_num = bad


def test_register_buffer_refuses_memory_the_cpu_cannot_copy(store) -> None:
    """A device pointer (stand-in: an address range reserved with no access, as CUDA
    reserves its own) is refused with a code, so an engine fails cleanly at set-up
    instead of a segfault at its first save."""
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    reserved = libc.mmap(None, 1 << 21, 0, 0x22, -1, 0)  # PROT_NONE, MAP_PRIVATE|ANONYMOUS
    try:
        assert store.register_buffer(reserved, 1 << 20) == INVALID_PARAMS
    finally:
        libc.munmap(reserved, 1 << 21)
    buf = ctypes.create_string_buffer(1 << 20)
    assert store.register_buffer(ctypes.addressof(buf), 1 << 20) == 0
    assert store.register_buffer(ctypes.addressof(buf), 1 << 40) == INVALID_PARAMS
    assert store.register_buffer(0, 4096) == INVALID_PARAMS
    assert store.unregister_buffer(ctypes.addressof(buf)) == 0


def test_a_store_named_by_an_ip_serves_its_segment_to_other_hosts(master) -> None:
    """local_hostname an IP address (here a second loopback one): the store's segment is
    served by its transfer service there, and a client on another host (another host
    id) reads and writes it through that service; a host name keeps it same-host."""
    from kvmaster import ClientConfig
    from kvmaster.compat._setup import transfer_host_for

    assert transfer_host_for("10.1.2.3", 1) == "10.1.2.3"
    assert transfer_host_for("10.1.2.3:17812", 1) == "10.1.2.3"
    assert transfer_host_for("[fd00::5]:1", 1) == "fd00::5"
    assert transfer_host_for("localhost", 1) == transfer_host_for("127.0.0.1", 1) == ""
    assert transfer_host_for("10.1.2.3", 0) == ""
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.2", "P2PHANDSHAKE", 8 * MiB, 16 * MiB, "tcp", "", master.addr) == 0
    other = Client(ClientConfig(local_hostname="another-host"))
    try:
        seg = {x["name"]: x for x in s.client.list_segments()}[s.client.segment_name]
        assert seg["transport"].startswith("tcp://127.0.0.2:"), seg
        assert s.put("from-store", b"s" * 5000) == 0
        other.setup(master.addr, 0)
        assert other.get("from-store") == b"s" * 5000
        other.put("from-other", b"o" * 3000)
        assert s.get("from-other") == b"o" * 3000
    finally:
        other.close()
        assert s.close() == 0


def test_a_put_session_with_group_ids_and_a_skipped_key_groups_the_rest(store) -> None:
    cfg = ReplicateConfig()
    cfg.group_ids = ["g1", "g1", "g2"]
    assert store.batch_put_session_start(["s1"], [8]) == [0]
    # s1 already has a session: skipped; s2 and s3 start with their own group ids.
    assert store.batch_put_session_start(["s1", "s2", "s3"], [8, 8, 8], cfg) == \
        [INVALID_PARAMS, 0, 0]
    src = ctypes.create_string_buffer(b"abcdefgh", 8)
    p = ctypes.addressof(src)
    assert store.batch_put_from_multi_buffer_ranges(["s1", "s2", "s3"], [[p]] * 3, [[8]] * 3,
                                                    [[0]] * 3) == [8, 8, 8]
    assert store.batch_put_session_end(["s1", "s2", "s3"]) == [0, 0, 0]
    assert store.get_batch(["s1", "s2", "s3"]) == [b"abcdefgh"] * 3


def test_multi_buffer_calls_refuse_buffers_outside_host_memory(store) -> None:
    """A device pointer (stand-in: a reserved range with no access) or a buffer running
    past its mapping fails its own key with -600; the process does not crash and the
    other keys are served."""
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    reserved = libc.mmap(None, 1 << 21, 0, 0x22, -1, 0)
    # The mappings are read once and kept while buffers fall inside them (bad_buffers:
    # memory unmapped after an earlier call is not noticed), and the reserved range may
    # lie where an earlier test had readable memory: start from a fresh read, as a
    # process seeing these buffers for the first time does.
    _common._spans_cache[0] = None
    good = ctypes.create_string_buffer(b"g" * 4096, 4096)
    out = ctypes.create_string_buffer(4096)
    g, o = ctypes.addressof(good), ctypes.addressof(out)
    try:
        assert store.batch_put_from_multi_buffers(
            ["dev", "ok", "past"], [[reserved], [g, g + 2048], [g]],
            [[4096], [2048, 2048], [1 << 40]]) == [INVALID_PARAMS, 0, INVALID_PARAMS]
        assert store.batch_get_into_multi_buffers(
            ["ok", "ok"], [[reserved], [o]], [[4096], [4096]]) == [INVALID_PARAMS, 4096]
        assert out.raw == b"g" * 4096
    finally:
        libc.munmap(reserved, 1 << 21)
