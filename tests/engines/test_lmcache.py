"""LMCache 0.5.6's Mooncake connector and lookup client, run unmodified against a
real master through the ``mooncake`` shim.

The engine's files (``../shared/engines/lmcache/mooncakestore_connector.py`` and
``mooncake_lookup_client.py``) are loaded under their real module names
(``lmcache.v1.storage_backend.connector.mooncakestore_connector``,
``lmcache.v1.lookup_client.mooncake_lookup_client``); the rest of LMCache they
import comes from ``tests/engines/stubs/lmcache`` (our own stand-ins: memory
objects are slices of one real torch CPU buffer).  The connector is driven as
LMCache's ``RemoteBackend`` drives it: its coroutines run on an event loop in a
thread of their own (``asyncio.run_coroutine_threadsafe(...).result()``), and a
put's memory objects are released after the put completes.

Its three modes, as the connector picks them:

* default (``save_chunk_meta`` true): ``put_parts(key, header, bytes)`` per chunk,
  read back with ``batch_get_buffer``;
* zero-copy (``extra_config["save_chunk_meta"] = False``): ``batch_put_from`` and
  ``batch_get_into`` on pointers into the registered CPU buffer;
* ``mooncake_prefer_local_alloc``: the default mode with
  ``ReplicateConfig.preferred_segment = store.get_hostname()``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from kvmaster import Client
from kvmaster.compat import BufferHandle, MooncakeDistributedStore
from engines.conftest import STUBS, engine_file, load_module

LMC_STUBS = STUBS / "lmcache"
CONNECTOR = "lmcache.v1.storage_backend.connector.mooncakestore_connector"
LOOKUP = "lmcache.v1.lookup_client.mooncake_lookup_client"

LAYERS, CHUNK, HEADS, HEAD_SIZE = 4, 16, 4, 32
DTYPE = torch.float16
#: Bytes of one full chunk: [2, layers, tokens, heads * head_size] float16.
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * HEAD_SIZE * 2
MiB = 1 << 20


@pytest.fixture(scope="module")
def lmc(shim) -> Iterator[SimpleNamespace]:
    """The engine's two modules and the stub modules they use."""
    sys.path.insert(0, str(LMC_STUBS))
    try:
        conn = load_module(CONNECTOR, engine_file("lmcache/mooncakestore_connector.py"))
        look = load_module(LOOKUP, engine_file("lmcache/mooncake_lookup_client.py"))
        from lmcache.v1 import config, memory_management, metadata, protocol, token_database
        from lmcache.v1.storage_backend import local_cpu_backend
        yield SimpleNamespace(conn=conn, look=look, config=config, mm=memory_management,
                              metadata=metadata, protocol=protocol, tdb=token_database,
                              backend=local_cpu_backend)
    finally:
        sys.path.remove(str(LMC_STUBS))
        for m in [m for m in sys.modules if m == "lmcache" or m.startswith("lmcache.")]:
            del sys.modules[m]


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """LMCache's connector loop: an event loop running in its own thread."""
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, name="lmcache-loop", daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(10)
    lp.close()


def drive(lp: asyncio.AbstractEventLoop, coro, timeout: float = 30.0):
    return asyncio.run_coroutine_threadsafe(coro, lp).result(timeout)


@pytest.fixture
def errors(caplog) -> Iterator[list[logging.LogRecord]]:
    """ERROR records from LMCache's modules and from kvmaster's facade (checked empty
    by each test that expects a clean run)."""
    caplog.set_level(logging.INFO)

    def pick() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno >= logging.ERROR
                and r.name.split(".")[0] in ("lmcache", "kvmaster")]

    yield pick


class Engine:
    """One LMCache worker's pieces: config, metadata, CPU backend, connector."""

    def __init__(self, lmc: SimpleNamespace, lp: asyncio.AbstractEventLoop, master_addr: str,
                 mode: str = "default", segment: int = 32 * MiB) -> None:
        extra: dict[str, object] = {
            "mooncake_local_hostname": "localhost",
            "mooncake_metadata_server": "P2PHANDSHAKE",
            "mooncake_global_segment_size": str(segment),
            "mooncake_local_buffer_size": str(16 * MiB),
            "mooncake_protocol": "tcp",
            "mooncake_master_server_address": master_addr,
            # LMCache's default is 1 s per put; CI shares 2 cores among many tests.
            "transfer_timeout": 20,
        }
        if "zero_copy" in mode:
            extra["save_chunk_meta"] = False
        if "prefer_local" in mode:
            extra["mooncake_prefer_local_alloc"] = True
        self.lmc, self.lp = lmc, lp
        self.config = lmc.config.LMCacheEngineConfig(chunk_size=CHUNK, extra_config=extra)
        self.metadata = lmc.metadata.LMCacheMetadata("test/model-7b", 1, 0, DTYPE,
                                                     (LAYERS, 2, CHUNK, HEADS, HEAD_SIZE))
        self.backend = lmc.backend.LocalCPUBackend(self.config, self.metadata, 16 * MiB)
        self.db = lmc.tdb.ChunkedTokenDatabase(self.config, self.metadata)
        self.conn = lmc.conn.MooncakestoreConnector(lp, self.backend, self.config)
        assert isinstance(self.conn.store, MooncakeDistributedStore)
        assert self.conn.store.client is not None  # set-up succeeded (LMCache ignores the code)

    @property
    def allocator(self):
        return self.backend.memory_allocator.pin_allocator

    def chunks(self, tokens: list[int], seed: int = 0):
        """``(keys, memory objects, expected bytes)`` of a prompt's KV chunks."""
        keys, objs, want = [], [], []
        for start, end, key in self.db.process_tokens(tokens):
            shapes = self.metadata.get_shapes(end - start)
            obj = self.backend.allocate(shapes, [DTYPE], self.lmc.mm.MemoryFormat.KV_2LTD)
            assert obj is not None
            g = torch.Generator().manual_seed(seed * 1000 + start)
            obj.tensor.copy_(torch.randn(shapes[0], generator=g, dtype=torch.float32).to(DTYPE))
            keys.append(key)
            objs.append(obj)
            want.append(obj.byte_array.tobytes())
        return keys, objs, want

    def put(self, keys, objs) -> None:
        """RemoteBackend's batched put: the connector's batched_put on its loop, then
        the objects released."""
        assert self.conn.support_batched_put()
        drive(self.lp, self.conn.batched_put(keys, objs))
        for o in objs:
            o.ref_count_down()

    def get(self, keys) -> list:
        assert self.conn.support_batched_get()
        return drive(self.lp, self.conn.batched_get(keys))

    def contains(self, keys) -> int:
        assert self.conn.support_batched_async_contains()
        return drive(self.lp, self.conn.batched_async_contains("lookup-1", keys))

    def close(self) -> None:
        drive(self.lp, self.conn.close())


@pytest.fixture
def engines(lmc, loop, master, monkeypatch) -> Iterator:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    made: list[Engine] = []

    def make(mode: str = "default", **kw) -> Engine:
        e = Engine(lmc, loop, master.addr, mode, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def check_hits(eng: Engine, keys, got, want) -> int:
    """Every result a hit with the written bytes, shape and dtype; released after."""
    hits = 0
    for key, obj, data in zip(keys, got, want, strict=True):
        assert obj is not None, f"miss for {key.to_string()}"
        assert obj.byte_array.tobytes() == data
        assert obj.get_size() == len(data)
        tokens = len(data) // (CHUNK_BYTES // CHUNK)
        assert obj.meta.shape == torch.Size([2, LAYERS, tokens, HEADS * HEAD_SIZE])
        assert obj.tensor.dtype == DTYPE
        obj.ref_count_down()
        hits += 1
    return hits


PROMPT = list(range(1000, 1000 + 5 * CHUNK + 7))  # 5 full chunks and one of 7 tokens


@pytest.mark.parametrize("mode", ["default", "zero_copy"])
def test_put_then_get(engines, errors, mode) -> None:
    eng = engines(mode)
    assert eng.conn.save_chunk_meta is (mode == "default")
    assert eng.conn.registered_buffer_ptr == eng.allocator.buffer.data_ptr()
    keys, objs, want = eng.chunks(PROMPT)
    assert len(keys) == 6 and len(want[-1]) == 7 * CHUNK_BYTES // CHUNK
    assert eng.contains(keys) == 0
    eng.put(keys, objs)
    assert eng.allocator.live == 0  # the put released what it was given

    assert eng.contains(keys) == len(keys)
    assert all(drive(eng.lp, eng.conn.exists(k)) for k in keys)
    assert all(eng.conn.exists_sync(k) for k in keys)
    got = eng.get(keys)
    assert check_hits(eng, keys, got, want) == len(keys)
    assert eng.allocator.live == 0 and eng.allocator.used == 0

    # The bytes stored under each key, as Mooncake would hold them.
    header = eng.conn.remote_metadata_bytes if mode == "default" else 0
    for k, data in zip(keys, want):
        assert eng.conn.store.get_size(k.to_string()) == header + len(data)
    assert errors() == []


@pytest.mark.parametrize("mode", ["default", "zero_copy"])
def test_misses_and_prefix(engines, errors, mode) -> None:
    eng = engines(mode)
    keys, objs, want = eng.chunks(PROMPT, seed=3)
    eng.put(keys[:2] + keys[3:], objs[:2] + objs[3:])  # chunk 2 never written
    objs[2].ref_count_down()
    assert eng.contains(keys) == 2  # the prefix stops at the first miss

    got = eng.get(keys)
    assert got[2] is None
    assert check_hits(eng, keys[:2] + keys[3:], got[:2] + got[3:], want[:2] + want[3:]) == 5
    assert eng.allocator.live == 0  # the miss's buffer was given back too

    other = [eng.db.make_key(h) for h in (1, 2, 3)]
    assert eng.get(other) == [None] * 3
    assert eng.get([]) == []
    assert eng.allocator.live == 0
    assert errors() == []


@pytest.mark.parametrize("mode", ["default", "zero_copy"])
def test_puts_in_flight(engines, errors, mode) -> None:
    """RemoteBackend submits batched puts without waiting (a done callback releases
    the objects), so several run at once in the loop's worker threads on one store;
    then the gets of all of them, also submitted together."""
    eng = engines(mode)
    prompts = [[p] * (3 * CHUNK + p) for p in range(1, 7)]
    batches = [eng.chunks(p, seed=40 + i) for i, p in enumerate(prompts)]
    futures = []
    for keys, objs, _ in batches:
        f = asyncio.run_coroutine_threadsafe(eng.conn.batched_put(keys, objs), eng.lp)
        f.add_done_callback(lambda _f, objs=objs: [o.ref_count_down() for o in objs])
        futures.append(f)
    for f in futures:
        f.result(30)
    gets = [asyncio.run_coroutine_threadsafe(eng.conn.batched_get(keys), eng.lp)
            for keys, _, _ in batches]
    hits = sum(check_hits(eng, keys, g.result(30), want)
               for (keys, _, want), g in zip(batches, gets))
    assert hits == sum(len(k) for k, _, _ in batches) == 24
    assert eng.allocator.live == 0
    assert errors() == []


def test_two_workers_share_chunks(engines, errors) -> None:
    """A chunk written by one worker is a hit for another (different CPU backend,
    different store client), in both modes' formats kept apart by mode."""
    writer, reader = engines("default"), engines("default")
    keys, objs, want = writer.chunks(PROMPT, seed=5)
    writer.put(keys, objs)
    assert reader.contains(keys) == len(keys)
    assert check_hits(reader, keys, reader.get(keys), want) == len(keys)

    zwriter, zreader = engines("zero_copy"), engines("zero_copy")
    zkeys, zobjs, zwant = zwriter.chunks(list(range(7, 7 + 3 * CHUNK)), seed=6)
    zwriter.put(zkeys, zobjs)
    assert check_hits(zreader, zkeys, zreader.get(zkeys), zwant) == 3
    assert errors() == []


def test_prefer_local_alloc(engines, errors, master, make_client) -> None:
    """``mooncake_prefer_local_alloc`` sets ``ReplicateConfig.preferred_segment`` to
    ``get_hostname()``: the zero-copy puts (``batch_put_from`` with that config) land in
    the connector's own segment although another client offers more free space.  The
    default mode's ``put_parts`` passes no config (LMCache 0.5.6 as it is), so there the
    master picks the segment with the most free space, as without the option."""
    big = make_client(master, segment_bytes=64 * MiB)
    eng = engines("prefer_local_zero_copy", segment=16 * MiB)
    hostname = eng.conn.store.get_hostname()  # Mooncake's name: local_hostname:port
    assert hostname.startswith("localhost:")
    assert eng.conn.replica_config.preferred_segment == hostname
    mine = eng.conn.store.client.segment_name  # the kvmaster segment behind that name
    keys, objs, want = eng.chunks(PROMPT, seed=9)
    eng.put(keys, objs)
    for k in keys:
        assert {r[0] for r in big.query_key(k.to_string())["replicas"]} == {mine}
    assert check_hits(eng, keys, eng.get(keys), want) == len(keys)

    for mode in ("zero_copy", "prefer_local"):
        other = engines(mode, segment=16 * MiB)
        okeys, oobjs, owant = other.chunks([len(mode)] * CHUNK, seed=10)
        other.put(okeys, oobjs)
        assert {r[0] for r in big.query_key(okeys[0].to_string())["replicas"]} == \
            {big.segment_name}
        assert check_hits(other, okeys, other.get(okeys), owant) == 1
    assert errors() == []


def test_lookup_client(engines, errors, lmc, master) -> None:
    """MooncakeLookupClient (a consumer-only store, segment 0) reports the tokens
    covered by the stored prefix of a prompt's chunks."""
    eng = engines("default")
    keys, objs, _ = eng.chunks(PROMPT, seed=11)
    eng.put(keys, objs)
    lc = lmc.look.MooncakeLookupClient(eng.config, eng.metadata, master.addr)
    try:
        assert lc.supports_producer_reuse()
        assert lc.lookup(PROMPT) == len(PROMPT)
        assert lc.lookup(torch.tensor(PROMPT)) == len(PROMPT)
        assert lc.lookup(PROMPT[:3 * CHUNK]) == 3 * CHUNK
        diverged = PROMPT[:2 * CHUNK] + [7] * (3 * CHUNK)
        assert lc.lookup(diverged) == 2 * CHUNK
        assert lc.lookup([1, 2, 3] * CHUNK) == 0
        assert lc.store.remove(keys[3].to_string()) == 0
        assert lc.lookup(PROMPT) == 3 * CHUNK
    finally:
        lc.close()
        lc.store.close()
    assert errors() == []


def test_native_client_and_lmcache_share_keys(engines, errors, lmc, master,
                                              make_client) -> None:
    """The native ``kvmaster.Client`` and LMCache's connector address the same
    objects by the same key bytes (``CacheEngineKey.to_string()``): LMCache's
    zero-copy chunks are plain KV bytes and its default-mode chunks are LMCache's
    metadata header followed by them, in both directions."""
    native: Client = make_client(master)
    zc = engines("zero_copy")
    dflt = engines("default")
    hdr_len = dflt.conn.remote_metadata_bytes
    RemoteMetadata = lmc.protocol.RemoteMetadata

    # native -> LMCache (zero-copy): raw bytes under LMCache's key strings.
    keys, objs, want = zc.chunks(PROMPT, seed=21)
    for o in objs:
        o.ref_count_down()
    assert native.put_batch([k.to_string() for k in keys], want) == [0] * len(keys)
    assert zc.contains(keys) == len(keys)
    assert check_hits(zc, keys, zc.get(keys), want) == len(keys)

    # native -> LMCache (default): header + bytes.
    keys2, objs2, want2 = dflt.chunks([4] * (2 * CHUNK), seed=22)  # keys not yet used
    for k, o, data in zip(keys2, objs2, want2):
        hdr = RemoteMetadata(len(data), o.get_shapes(), o.get_dtypes(),
                             o.get_memory_format()).serialize()
        assert len(hdr) == hdr_len
        native.put(k.to_string(), hdr + data)
        o.ref_count_down()
    assert check_hits(dflt, keys2, dflt.get(keys2), want2) == 2

    # LMCache -> native, both formats.
    keys3, objs3, want3 = zc.chunks([9] * (2 * CHUNK), seed=23)
    zc.put(keys3, objs3)
    assert native.get_batch([k.to_string() for k in keys3]) == want3
    keys4, objs4, want4 = dflt.chunks([8] * (CHUNK + 3), seed=24)
    shapes4 = [o.get_shapes() for o in objs4]
    dflt.put(keys4, objs4)
    for k, data, shapes in zip(keys4, want4, shapes4):
        stored = native.get(k.to_string())
        meta = RemoteMetadata.deserialize(stored[:hdr_len])
        assert (meta.length, meta.shapes, meta.dtypes) == (len(data), shapes, [DTYPE])
        assert stored[hdr_len:] == data
    assert errors() == []


def test_batch_get_buffer_and_info(master) -> None:
    """The facade calls the default mode reads through: ``batch_get_buffer`` (a
    BufferHandle per key, None where missing, the buffer protocol for
    ``memoryview``/``torch.frombuffer``) and ``get_buffer_info`` ((address, size),
    (0, 0) on a miss)."""
    import ctypes

    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "",
                       master.addr) == 0
    try:
        vals = [bytes(range(256)) * 4, b"y", b"x" * 70_000]
        assert store.put_batch(["a", "e", "c"], vals) == 0
        hs = store.batch_get_buffer(["a", "missing", "e", "c"])
        assert hs[1] is None
        for h, v in zip([hs[0], hs[2], hs[3]], vals):
            assert h.size() == len(h) == len(v)
            assert bytes(memoryview(h)) == v
            assert ctypes.string_at(h.ptr(), h.size()) == v
        assert BufferHandle(b"").ptr() == 0 and BufferHandle(b"").size() == 0
        t = torch.frombuffer(hs[0], dtype=torch.uint8, offset=256, count=256)
        assert t.tolist() == list(range(256))
        with pytest.raises(BufferError):
            hs[0].append(1)  # fixed size: ptr() stays valid
        assert store.batch_get_buffer([]) == []
        with pytest.raises(TypeError):
            store.batch_get_buffer("a")
        with pytest.raises(TypeError):
            store.batch_get_buffer(["a", 7])
        over = store.batch_get_buffer(["a"] * 5000)  # past the master's max_batch (4096)
        assert len(over) == 5000 and set(over) == {None}
        ptr, size = store.get_buffer_info("c")
        assert size == len(vals[2]) and ctypes.string_at(ptr, size) == vals[2]
        assert store.get_buffer_info("missing") == (0, 0)
    finally:
        store.close()
    closed = MooncakeDistributedStore()
    assert closed.batch_get_buffer(["a"]) == [None]
    assert closed.get_buffer_info("a") == (0, 0)



@pytest.fixture
def sglang_store(shim, master, monkeypatch) -> Iterator[object]:
    """SGLang 0.5.23's HiCache ``MooncakeStore`` (``../shared/engines/sglang``, over
    ``tests/engines/stubs/sglang``), an MLA config (one object per page), no host pool."""
    sgl_stubs = STUBS / "sglang"
    for k, v in {"MOONCAKE_MASTER": master.addr, "MOONCAKE_PROTOCOL": "tcp",
                 "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(16 * MiB), "MOONCAKE_DEVICE": ""}.items():
        monkeypatch.setenv(k, v)

    def drop() -> None:
        for m in [m for m in sys.modules
                  if m in ("sglang", "requests") or m.startswith("sglang.")]:
            del sys.modules[m]

    drop()
    sys.path.insert(0, str(sgl_stubs))
    store = None
    try:
        hs = load_module("sglang.srt.mem_cache.hicache_storage",
                         engine_file("sglang/hicache_storage.py"))
        ms = load_module("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store",
                         engine_file("sglang/mooncake_store.py"))
        cfg = hs.HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
            model_name="test/model-7b",
            extra_config={"master_server_address": master.addr, "protocol": "tcp",
                          "global_segment_size": 16 * MiB})
        store = ms.MooncakeStore(cfg)
        yield store
    finally:
        if store is not None:
            store.store.close()  # SGLang leaves that to the binding's destructor
        sys.path.remove(str(sgl_stubs))
        drop()


def test_sglang_and_lmcache_share_keys(engines, errors, sglang_store) -> None:
    """SGLang's zero-copy ``batch_set`` / ``batch_get`` / ``exists`` take the key
    strings as given (no suffix or prefix), so with LMCache's key strings a page SGLang
    writes from its host memory is a hit for LMCache's zero-copy connector, and a chunk
    LMCache writes is a hit that SGLang loads: same key bytes, same payload bytes.
    (SGLang's own page keys, ``<hash>_<tp>_<pp>_k`` and the like, never equal
    LMCache's ``model@world@worker@hash@dtype``.)"""
    eng = engines("zero_copy")
    keys, objs, want = eng.chunks(PROMPT[:3 * CHUNK], seed=31)
    host = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in want]
    for o in objs:
        o.ref_count_down()
    strs = [k.to_string() for k in keys]
    assert sglang_store.batch_set(strs, target_locations=[t.data_ptr() for t in host],
                                  target_sizes=[t.numel() for t in host])
    assert all(sglang_store.exists(s) for s in strs)
    assert eng.contains(keys) == 3
    assert check_hits(eng, keys, eng.get(keys), want) == 3

    keys2, objs2, want2 = eng.chunks([3] * (2 * CHUNK), seed=32)
    eng.put(keys2, objs2)
    dst = [torch.zeros(len(d), dtype=torch.uint8) for d in want2]
    strs2 = [k.to_string() for k in keys2]
    assert sglang_store.batch_get(strs2, target_locations=[t.data_ptr() for t in dst],
                                  target_sizes=[t.numel() for t in dst]) == 2
    assert [t.numpy().tobytes() for t in dst] == want2
    assert errors() == []
