"""SGLang 0.5.23's HiCache Mooncake backend, run unmodified against a real master.

SGLang's own ``hicache_storage.py`` and ``mooncake_store.py`` (``../shared/engines/
sglang``) are loaded under their real module names, with ``mooncake.store`` resolving
to kvmaster's compat shim and the few other SGLang modules they import supplied by
``tests/engines/stubs/sglang`` (our own minimal stand-ins; torch is the real one).

* SGLang's own ``test_mooncake_store.py``, unedited: its five runs (the single
  operation and the four batch configurations of its ``__main__``).
* Each storage layout the backend serves, over host pools of real CPU tensors whose
  pointers the backend hands to the store: MHA page_first and page_first_direct
  (a K and a V object per page), MLA page_first, page_first_direct and layer_first
  (one object per page gathered from one buffer per layer:
  ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``); the hybrid
  pools of the v2 calls (Mamba state, an MLA draft pool in layer_first) with group
  and session ids; the standalone-storage path (``setup_dummy``,
  ``MooncakeHostMemAllocator``); and the layer-wise load of SGLang's Mooncake direct
  linker (``batch_get_session_start``, ``batch_get_into_multi_buffer_ranges`` per
  layer, ``batch_get_session_end``), driven here the way
  ``mooncake_direct_linker.py`` drives it (that file is not in ../shared).
  Every layout writes pages, reads them back into other pages and compares every
  byte, and checks exists.
* Pages SGLang writes are hits for the native :class:`kvmaster.Client` under the
  same key strings.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from kvmaster import Client
from tests.conftest import MasterProcess
from tests.engines.conftest import STUBS, engine_file, load_module

torch = pytest.importorskip("torch", reason="SGLang's files import torch")

SGLANG_STUBS = STUBS / "sglang"
SEGMENT = 64 << 20
TEST_MODULE = "sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store"


def _drop_sglang_modules() -> None:
    for m in [m for m in sys.modules if m in ("sglang", "requests")
              or m.startswith("sglang.")]:
        del sys.modules[m]


@pytest.fixture(scope="module")
def master() -> Iterator[MasterProcess]:
    m = MasterProcess("--shards", "4")
    yield m
    assert m.stop() == 0, getattr(m, "stderr", "")


@pytest.fixture(scope="module")
def sgl(shim, master) -> Iterator[SimpleNamespace]:
    """SGLang's real files loaded over the stand-ins; MOONCAKE_* pointing at the master."""
    env = {"MOONCAKE_MASTER": master.addr, "MOONCAKE_PROTOCOL": "tcp",
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(SEGMENT), "MOONCAKE_DEVICE": ""}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _drop_sglang_modules()
    sys.path.insert(0, str(SGLANG_STUBS))
    try:
        hs = load_module("sglang.srt.mem_cache.hicache_storage",
                         engine_file("sglang/hicache_storage.py"))
        ms = load_module("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store",
                         engine_file("sglang/mooncake_store.py"))
        suite = load_module(TEST_MODULE, engine_file("sglang/test_mooncake_store.py"))
        from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import DevicePoolEntry
        from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        yield SimpleNamespace(hs=hs, ms=ms, suite=suite, MHA=MHATokenToKVPoolHost,
                              MLA=MLATokenToKVPoolHost, Mamba=MambaPoolHost,
                              DevicePoolEntry=DevicePoolEntry, addr=master.addr)
    finally:
        sys.path.remove(str(SGLANG_STUBS))
        _drop_sglang_modules()
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def stores(monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """Every facade store set up during the test, closed after it (SGLang's own
    ``MooncakeStore.close`` leaves that to the binding's destructor)."""
    from kvmaster.compat import MooncakeDistributedStore

    made: list = []
    setup = MooncakeDistributedStore.setup

    def recording(self, *args, **kw):
        made.append(self)
        return setup(self, *args, **kw)

    monkeypatch.setattr(MooncakeDistributedStore, "setup", recording)
    yield made
    for s in made:
        s.close()


def _config(sgl: SimpleNamespace, *, mla: bool, tp_rank: int = 0, tp_size: int = 1,
            **extra) -> object:
    return sgl.hs.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=True, model_name=f"org/model-{uuid.uuid4().hex[:8]}",
        extra_config={"master_server_address": sgl.addr, "protocol": "tcp",
                      "global_segment_size": SEGMENT, "enable_group_semantics": True,
                      **extra})


def _pages(pool, first_page: int, n: int) -> torch.Tensor:
    return torch.arange(first_page * pool.page_size, (first_page + n) * pool.page_size)


# ------------------------------------------------------- SGLang's own test file

SUITE_RUNS = {
    "single_operation": None,
    "batch_mha_tp1": dict(is_mla_model=False, tp_rank=0, tp_size=1),
    "batch_mla_tp1": dict(is_mla_model=True, tp_rank=0, tp_size=1),
    "batch_mha_tp4_rank1": dict(is_mla_model=False, tp_rank=1, tp_size=4),
    "batch_mla_tp8_rank3": dict(is_mla_model=True, tp_rank=3, tp_size=8),
}


@pytest.mark.parametrize("run", list(SUITE_RUNS))
def test_sglang_own_suite(sgl, stores, run: str) -> None:
    """The five runs of SGLang's ``test_mooncake_store.py`` ``__main__``, unedited."""
    t = sgl.suite
    cfg = SUITE_RUNS[run]
    if cfg is None:
        t.test_single_operation()
    else:
        t.test_batch_operation(t.make_hicache_storage_config(**cfg))
    assert stores, "the test set up no store"


# ------------------------------------------------------------------- layouts

LAYOUTS = [("mha", "page_first"), ("mha", "page_first_direct"), ("mla", "page_first"),
           ("mla", "page_first_direct"), ("mla", "layer_first")]


def _pool(sgl, model: str, layout: str, pages: int = 16, page_size: int = 4,
          layers: int = 6, allocator=None):
    if model == "mha":
        pool = sgl.MHA(pages * page_size, page_size, layers, head_num=2, head_dim=32,
                       dtype=torch.bfloat16, layout=layout, allocator=allocator)
    else:
        pool = sgl.MLA(pages * page_size, page_size, layers, kv_cache_dim=96,
                       dtype=torch.bfloat16, layout=layout, allocator=allocator)
    pool.fill_random(hash((model, layout)) & 0xFFFF)
    return pool


def _roundtrip_v1(store, pool, n: int) -> list[str]:
    """batch_set_v1 pages [0, n), batch_get_v1 them into pages [n, 2n); every byte
    compared; returns the page keys."""
    keys = [f"page-{uuid.uuid4().hex}" for _ in range(n)]
    assert store.batch_exists(keys) == 0
    assert all(store.batch_set_v1(keys, _pages(pool, 0, n)))
    assert store.batch_exists(keys) == n
    assert all(store.batch_set_v1(keys, _pages(pool, 0, n)))  # all exist: nothing written
    before = [pool.page_bytes((n + i) * pool.page_size) for i in range(n)]
    assert all(store.batch_get_v1(keys, _pages(pool, n, n)))
    for i in range(n):
        src = pool.page_bytes(i * pool.page_size)
        got = pool.page_bytes((n + i) * pool.page_size)
        assert got == src, f"page {i} differs after the round trip"
        assert got != before[i]
    return keys


@pytest.mark.parametrize("model,layout", LAYOUTS, ids=[f"{m}-{l}" for m, l in LAYOUTS])
def test_layout_roundtrip(sgl, stores, master, model: str, layout: str) -> None:
    store = sgl.ms.MooncakeStore(_config(sgl, mla=model == "mla"))
    pool = _pool(sgl, model, layout)
    store.register_mem_pool_host(pool)
    keys = _roundtrip_v1(store, pool, 5)
    # Partly there: batch_set_v1 writes only the missing pages, batch_exists counts the
    # leading run.
    more = keys[:2] + [f"page-{uuid.uuid4().hex}"]
    assert all(store.batch_set_v1(more, _pages(pool, 5, 3)))
    assert store.batch_exists(more) == 3
    assert store.batch_exists(keys[:1] + [f"absent-{uuid.uuid4().hex}"] + keys[1:]) == 1
    stats = store.get_stats()
    assert stats.backup_pgs and stats.prefetch_pgs

    # The same objects through the single-key and v0 batch calls, which take the
    # pointers as given: a list per object for a gathered (multi-buffer) one.
    ptrs, sizes = pool.get_page_buffer_meta(_pages(pool, 10, 1))
    if layout == "layer_first":
        ptrs, sizes = [ptrs], [sizes]
    dst, dst_sizes = pool.get_page_buffer_meta(_pages(pool, 11, 1))
    if layout == "layer_first":
        dst, dst_sizes = [dst], [dst_sizes]
    k = f"single-{uuid.uuid4().hex}"
    one = [f"{k}-{j}" for j in range(len(ptrs))]
    assert store.batch_set(one, target_locations=ptrs, target_sizes=sizes)
    assert all(store.exists(x) for x in one)
    assert store.set(one[0], target_location=ptrs[0], target_sizes=sizes[0])  # exists
    assert store.batch_get(one, target_locations=dst, target_sizes=dst_sizes) == \
        len(one) // (1 if model == "mla" else 2)
    assert pool.page_bytes(11 * pool.page_size) == pool.page_bytes(10 * pool.page_size)
    assert store.get(one[0], target_location=dst[0], target_sizes=dst_sizes[0])
    assert not store.get(f"absent-{k}", target_location=dst[0], target_sizes=dst_sizes[0])

    # Cross-engine: SGLang's object keys are hits for the native client, same bytes.
    key_strs, _, _ = store._batch_preprocess(store._tag_keys(keys), _pages(pool, 0, 5))
    native = Client()
    native.setup(master.addr, 0)
    try:
        assert native.batch_is_exist(key_strs) == [1] * len(key_strs)
        objs = [b for i in range(5) for b in pool.page_bytes(i * pool.page_size)]
        assert native.get_batch(key_strs) == objs
    finally:
        native.close()


def test_mha_layer_first_refused(sgl, stores) -> None:
    """SGLang's backend serves MHA layer_first by no layout (it raises, as upstream)."""
    store = sgl.ms.MooncakeStore(_config(sgl, mla=False))
    pool = _pool(sgl, "mha", "layer_first")
    store.register_mem_pool_host(pool)
    with pytest.raises(RuntimeError, match="layer_first multi-buffer"):
        store.batch_set_v1(["k"], _pages(pool, 0, 1))


# -------------------------------------------------------------- hybrid pools

def test_hybrid_pools_v2(sgl, stores) -> None:
    """An MLA KV pool with a Mamba state pool and an MLA draft pool in layer_first
    (gathered objects next to plain ones in one v2 call), written with group ids and
    a session id, read back into other slots, every byte compared."""
    hs = sgl.hs
    store = sgl.ms.MooncakeStore(_config(sgl, mla=True))
    assert store._can_use_group_semantics() and store._supports_session_ids
    kv = _pool(sgl, "mla", "page_first")
    mamba = sgl.Mamba(16, 3, temporal_elems=40, conv_elems=[24, 8])
    mamba.fill_random(7)
    draft = _pool(sgl, "mla", "layer_first", layers=2)
    store.register_mem_pool_host(kv)
    store.register_mem_host_pool_v2(kv, hs.PoolName.KV)
    store.register_mem_host_pool_v2(mamba, hs.PoolName.MAMBA)
    store.register_mem_host_pool_v2(draft, hs.PoolName.DRAFT)
    n = 4
    keys = [f"hy-{uuid.uuid4().hex}" for _ in range(n)]
    assert all(store.batch_set_v1(keys, _pages(kv, 0, n)))

    def transfers(first: int) -> list:
        return [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=keys,
                                host_indices=torch.arange(first, first + n)),
                hs.PoolTransfer(name=hs.PoolName.DRAFT, keys=keys,
                                host_indices=_pages(draft, first, n))]

    info = hs.HiCacheStorageExtraInfo(extra_info={"session_id": "sess-1"})
    res = store.batch_set_v2(transfers(0), info)
    assert res == {hs.PoolName.MAMBA: [True] * n, hs.PoolName.DRAFT: [True] * n}
    hit = store.batch_exists_v2(keys, [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=keys[-1:],
                                                       hit_policy=hs.PoolHitPolicy.TRAILING_PAGES),
                                       hs.PoolTransfer(name=hs.PoolName.DRAFT, keys=keys)])
    assert hit.kv_hit_pages == n and hit.restorable_prefix_pages == list(range(1, n + 1))
    res = store.batch_get_v2(transfers(n))
    assert res == {hs.PoolName.MAMBA: [True] * n, hs.PoolName.DRAFT: [True] * n}
    for i in range(n):
        assert mamba.page_bytes(n + i) == mamba.page_bytes(i)
        assert draft.page_bytes((n + i) * draft.page_size) == \
            draft.page_bytes(i * draft.page_size)


# ---------------------------------------------------------- standalone storage

@pytest.fixture
def real_client(master) -> Iterator[str]:
    """kvmaster's ``mooncake_client`` (the standalone real client) on a free port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmaster.compat.mooncake_client",
         f"--master_server_address={master.addr}", "--host=127.0.0.1", f"--port={port}",
         f"--global_segment_size={SEGMENT}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if "listening on" not in line:
            proc.kill()
            pytest.fail(f"mooncake_client did not start: {line!r} {proc.stderr.read()[-2000:]}")
        yield line.rsplit(" ", 1)[-1].strip()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f:
                f.close()


def test_standalone_storage(sgl, stores, real_client) -> None:
    """standalone_storage: host pools from MooncakeHostTensorAllocator, the store set up
    with setup_dummy(required bytes, local buffer, client_server_address) against a
    real client process; pages written and read back through it."""
    store_cfg = _config(sgl, mla=True, standalone_storage=True,
                        client_server_address=real_client)
    pool = _pool(sgl, "mla", "layer_first", allocator=sgl.ms.MooncakeHostTensorAllocator())
    store = sgl.ms.MooncakeStore(store_cfg, mem_pool=pool)
    store.register_mem_pool_host(pool)
    _roundtrip_v1(store, pool, 4)


# ------------------------------------------------------- direct linker load

def test_direct_linker_layer_wise_load(sgl, stores) -> None:
    """The direct linker's offload (batch_set_v2 of packed per-layer pages) and its
    layer-wise load: one get session, a ranged read per layer into per-layer rows,
    the session ended; then the rows compared byte for byte."""
    hs = sgl.hs
    layers, rows, row = 5, 8, 3 * 256
    src = [torch.randint(0, 256, (rows, row), dtype=torch.uint8) for _ in range(layers)]
    dst = [torch.zeros((rows, row), dtype=torch.uint8) for _ in range(layers)]
    page_size = 2
    entry = sgl.DevicePoolEntry(name=hs.PoolName.KV, buffers=src, page_size=page_size)
    target = sgl.DevicePoolEntry(name=hs.PoolName.KV, buffers=dst, page_size=page_size)
    store = sgl.ms.MooncakeStore(_config(sgl, mla=True), mem_pool=None)

    class Group:  # the linker's pool group: no physical KV anchor
        kv_buffer = None

    store.mem_pool_host = Group()
    store.registered_pools = {hs.PoolName.KV: entry}
    store.mla_suffix = store.mha_suffix = "cp0_pp0"
    keys = [f"lk-{uuid.uuid4().hex}" for _ in range(4)]
    pages = torch.arange(0, 4 * page_size)
    res = store.batch_set_v2([hs.PoolTransfer(name=hs.PoolName.KV, keys=keys,
                                              host_indices=pages)])
    assert res == {hs.PoolName.KV: [True] * 4}

    # The load, as mooncake_direct_linker.py's load_layer_wise issues it.
    names, _ = store._get_hybrid_page_component_keys(keys, hs.PoolTransfer(name=hs.PoolName.KV))
    names = store._tag_keys(names)
    rows_to = torch.arange(4 * page_size, 8 * page_size)
    locations = target.prepare_locations(rows_to)
    mc = store.store
    assert mc.batch_get_session_start(names) == [0] * len(names)
    try:
        for layer in range(layers):
            ptrs, sizes, offsets = target.get_prepared_layer_range_meta(locations, layer)
            got = mc.batch_get_into_multi_buffer_ranges(names, ptrs, sizes, offsets)
            assert got == [sum(s) for s in sizes], f"layer {layer}: {got}"
    finally:
        assert mc.batch_get_session_end(names) == 0
    for layer in range(layers):
        assert torch.equal(dst[layer][4:8], src[layer][0:4]), f"layer {layer} differs"
        assert not dst[layer][:4].any()
    # After the end the keys have no session: a ranged read is refused.
    ptrs, sizes, offsets = target.get_prepared_layer_range_meta(locations[:1], 0)
    assert mc.batch_get_into_multi_buffer_ranges(names[:1], ptrs, sizes, offsets) == [-600]
    assert mc.batch_get_session_start([f"absent-{uuid.uuid4().hex}"]) == [-704]
