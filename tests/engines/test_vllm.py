"""vLLM 0.33.0's Mooncake store set-up, and its MooncakeStoreConnector worker's save
and load calls, against a real master through the ``mooncake`` shim.

Set-up: ``../shared/engines/vllm/mooncake_store.py`` (vLLM's
``vllm/distributed/mooncake_store.py``) is loaded unmodified as
``vllm.distributed.mooncake_store``; the parent packages and the ``regex`` module it
imports come from ``tests/engines/stubs/vllm``.  ``MooncakeStoreConfig.load_from_config``
reads ``MOONCAKE_CONFIG_PATH`` and ``setup_mooncake_store(store, config,
local_hostname)`` sets up ``mooncake.store.MooncakeDistributedStore``.

Save and load: the worker's module is not among the engines' files, so its calls are
written here from what vLLM 0.33.0's wheel does (not copied), in
``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py`` and
``.../store/data.py``:

* ``MooncakeStoreWorker.__init__``: ``setup_mooncake_store``, then one
  ``ReplicateConfig()`` for every put;
* ``MooncakeStoreWorker.register_kv_caches``: ``register_buffer(storage.data_ptr(),
  storage.nbytes())`` once per KV cache storage (a non-zero code is logged, not fatal);
  ``RankLocalStoreLayout.register_kv_caches``: one region per layer whose block
  dimension spans its storage, ``block_len = storage.nbytes() // num_blocks``;
* ``RankLocalStoreLayout.key_for`` / ``PoolKey.build_prefix``: the key
  ``<model>@tp_rank:<tp>@pcp<pcp>@dcp<dcp>@pp_rank:<pp>@group:<g>@<block hash hex>``;
* ``RankLocalStoreLayout.prepare_values``: per key, one address per layer region
  (``base + block_id * block_len``) and one size per region (``block_len`` times the
  blocks in the chunk);
* ``KVCacheStoreSendingThread._handle_request`` (save): ``batch_is_exist(keys)``; the
  keys whose state is not 1 go to ``batch_put_from_multi_buffers(keys, addrs, sizes,
  replicate_config)``; a value < 0 is a failed key;
* ``KVCacheStoreRecvingThread._handle_request`` (load):
  ``batch_get_into_multi_buffers(keys, addrs, sizes)``; a value < 0 is a failed key
  (its blocks are reported as load errors), otherwise the bytes read;
* ``MooncakeStoreWorker.lookup``: ``batch_is_exist`` over a prompt's keys, the hit
  prefix counted up to the first state that is not 1.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from engines.conftest import STUBS, engine_file, load_module

VLLM_STUBS = STUBS / "vllm"
MiB = 1 << 20
OBJECT_NOT_FOUND = -704

NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE, LAYERS = 32, 16, 4, 32, 3
MODEL = "Qwen/Qwen3-0.6B"



def new_store():
    """``mooncake.store.MooncakeDistributedStore()``, as vLLM imports it (the shim)."""
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore()


@pytest.fixture(scope="module")
def vms(shim) -> Iterator[ModuleType]:
    """``vllm.distributed.mooncake_store``, the engine's file."""
    sys.path.insert(0, str(VLLM_STUBS))
    try:
        yield load_module("vllm.distributed.mooncake_store",
                          engine_file("vllm/mooncake_store.py"))
    finally:
        sys.path.remove(str(VLLM_STUBS))
        for m in [m for m in sys.modules
                  if m in ("vllm", "regex") or m.startswith("vllm.")]:
            del sys.modules[m]


@pytest.fixture
def store_config(vms, master, tmp_path, monkeypatch):
    """Factory: write a Mooncake JSON config, point MOONCAKE_CONFIG_PATH at it and load
    it as vLLM does."""
    def make(**over):
        cfg = {"metadata_server": "P2PHANDSHAKE", "master_server_address": master.addr,
               "protocol": "tcp", "device_name": "", "global_segment_size": "32MB",
               "local_buffer_size": "16MB", **over}
        path = tmp_path / f"mooncake-{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(cfg))
        monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
        return vms.MooncakeStoreConfig.load_from_config()
    return make


def block_hashes(tokens: list[int]) -> list[bytes]:
    """One hash per full block, chained over the prefix (vLLM's BlockHash is bytes)."""
    out, prev = [], b""
    for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
        prev = hashlib.sha256(prev + repr(tokens[i:i + BLOCK]).encode()).digest()
        out.append(prev)
    return out


class Worker:
    """One vLLM worker (TP rank ``tp_rank``): its store, its KV caches (one CPU tensor
    per layer, ``[num_blocks, 2, block_size, heads, head_size]``) and the worker's
    save/load/lookup calls."""

    def __init__(self, vms: ModuleType, config, tp_rank: int = 0, seed: int = 0) -> None:
        from mooncake.store import ReplicateConfig

        self.store = new_store()
        vms.setup_mooncake_store(self.store, config, "127.0.0.1")
        self.replicate_config = ReplicateConfig()
        self.prefix = f"{MODEL}@tp_rank:{tp_rank}@pcp0@dcp0@pp_rank:0@group:0"
        g = torch.Generator().manual_seed(seed)
        self.caches = [torch.randn(NUM_BLOCKS, 2, BLOCK, HEADS, HEAD_SIZE, generator=g)
                       .to(torch.float16) for _ in range(LAYERS)]
        self.bases: list[int] = []
        self.block_lens: list[int] = []

    def register_kv_caches(self) -> list[int]:
        codes, seen = [], set()
        for cache in self.caches:
            storage = cache.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            codes.append(self.store.register_buffer(storage.data_ptr(), storage.nbytes()))
            assert cache.stride(0) * cache.element_size() * NUM_BLOCKS == storage.nbytes()
            self.bases.append(storage.data_ptr())
            self.block_lens.append(storage.nbytes() // NUM_BLOCKS)
        return codes

    def key_for(self, block_hash: bytes) -> str:
        return f"{self.prefix}@{block_hash.hex()}"

    def prepare_values(self, block_ids: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        addrs = [[b + bid * n for b, n in zip(self.bases, self.block_lens)] for bid in block_ids]
        sizes = [list(self.block_lens) for _ in block_ids]
        return addrs, sizes

    def save(self, hashes: list[bytes], block_ids: list[int]) -> tuple[list[str], list[int]]:
        """The sending thread's calls: -> (keys put, their results)."""
        keys = [self.key_for(h) for h in hashes]
        states = self.store.batch_is_exist(keys)
        missing = [i for i, s in enumerate(states) if s != 1]
        if not missing:
            return [], []
        keys = [keys[i] for i in missing]
        addrs, sizes = self.prepare_values([block_ids[i] for i in missing])
        res = self.store.batch_put_from_multi_buffers(keys, addrs, sizes,
                                                      self.replicate_config)
        return keys, res

    def load(self, hashes: list[bytes], block_ids: list[int]) -> list[int]:
        """The receiving thread's call: bytes read per key, or a negative code."""
        keys = [self.key_for(h) for h in hashes]
        addrs, sizes = self.prepare_values(block_ids)
        return self.store.batch_get_into_multi_buffers(keys, addrs, sizes)

    def lookup(self, hashes: list[bytes]) -> int:
        """Tokens covered by the stored prefix of a prompt's blocks."""
        n = 0
        for s in self.store.batch_is_exist([self.key_for(h) for h in hashes]):
            if s != 1:
                break
            n += 1
        return n * BLOCK

    def block_bytes(self, bid: int) -> bytes:
        return b"".join(c[bid].numpy().tobytes() for c in self.caches)


@pytest.fixture
def workers(vms, store_config) -> Iterator:
    made: list[Worker] = []

    def make(tp_rank: int = 0, seed: int = 0, **over) -> Worker:
        w = Worker(vms, store_config(**over), tp_rank, seed)
        made.append(w)
        return w

    yield make
    for w in made:
        assert w.store.close() == 0


def test_config_and_setup(vms, store_config, make_client, master) -> None:
    """The JSON config is parsed as vLLM does (sizes with units, defaults) and
    ``setup_mooncake_store`` mounts the rank's segment; a ``tenant_id`` reaches
    ``setup`` as a keyword and keeps the tenant's keys apart."""
    cfg = store_config()
    assert (cfg.global_segment_size, cfg.local_buffer_size) == (32 * MiB, 16 * MiB)
    assert (cfg.mode, cfg.tenant_id, cfg.protocol) == ("embedded", "default", "tcp")
    store = new_store()
    vms.setup_mooncake_store(store, cfg, "127.0.0.1")
    tstore = new_store()
    cstore = new_store()
    try:
        assert store.client.segment_name is not None
        native = make_client(master)
        assert store.client.segment_name in str(native.list_segments())
        assert store.put("k", b"v" * 100) == 0 and native.get("k") == b"v" * 100

        tcfg = store_config(tenant_id="  team-a ", global_segment_size=16 * MiB)
        assert tcfg.tenant_id == "team-a" and tcfg.global_segment_size == 16 * MiB
        vms.setup_mooncake_store(tstore, tcfg, "127.0.0.1")
        assert tstore.get("k") == b""  # another tenant's key
        assert tstore.put("k", b"tenant") == 0 and tstore.get("k") == b"tenant"
        assert native.get("k") == b"v" * 100  # the default tenant's own
        assert make_client(master, tenant="team-a").get("k") == b"tenant"

        # standalone-store mode: the rank contributes no segment and still reads.
        ccfg = store_config(mode="standalone-store", global_segment_size=0)
        vms.setup_mooncake_store(cstore, ccfg, "127.0.0.1")
        assert cstore.get("k") == b"v" * 100
        assert cstore.put("k2", b"w" * 10) == 0 and native.get("k2") == b"w" * 10
    finally:
        for s in (cstore, tstore, store):
            assert s.close() == 0


def test_setup_failure_raises(vms, store_config) -> None:
    """A set-up that fails returns a non-zero code, which vLLM turns into its
    RuntimeError."""
    cfg = store_config(master_server_address="not-an-address")
    with pytest.raises(RuntimeError, match="Initialize MooncakeDistributedStore failed"):
        vms.setup_mooncake_store(new_store(), cfg, "127.0.0.1")


def test_save_then_load(workers, make_client, master) -> None:
    """A prefill worker saves a prompt's blocks; a decode worker (its own store and
    KV caches) looks them up and loads them into other block ids: every byte of every
    layer arrives; a second save of the same blocks is deduplicated; a missing key
    fails on its own."""
    prefill, decode = workers(seed=1), workers(seed=2)
    assert prefill.register_kv_caches() == [0] * LAYERS
    assert decode.register_kv_caches() == [0] * LAYERS
    tokens = list(range(100, 100 + 6 * BLOCK))
    hashes = block_hashes(tokens)
    src_ids = [3, 7, 1, 30, 12, 5]
    dst_ids = [20, 21, 2, 9, 0, 31]
    block_size = sum(prefill.block_lens)

    assert decode.lookup(hashes) == 0
    keys, res = prefill.save(hashes[:4], src_ids[:4])
    assert len(keys) == 4 and res == [0] * 4
    assert keys[0] == f"{MODEL}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{hashes[0].hex()}"
    keys, res = prefill.save(hashes, src_ids)  # the first four exist already
    assert keys == [prefill.key_for(h) for h in hashes[4:]] and res == [0, 0]
    assert prefill.save(hashes, src_ids) == ([], [])
    assert decode.lookup(hashes) == 6 * BLOCK

    before = [decode.block_bytes(b) for b in range(NUM_BLOCKS)]
    assert decode.load(hashes, dst_ids) == [block_size] * 6
    for s, d in zip(src_ids, dst_ids):
        assert decode.block_bytes(d) == prefill.block_bytes(s)
    untouched = set(range(NUM_BLOCKS)) - set(dst_ids)
    assert all(decode.block_bytes(b) == before[b] for b in untouched)

    # The stored object is the layers' blocks end to end (the native client sees it so).
    native = make_client(master)
    assert native.get(prefill.key_for(hashes[2])) == prefill.block_bytes(src_ids[2])

    other = block_hashes(list(range(5000, 5000 + 2 * BLOCK)))
    res = decode.load([hashes[0], other[0], hashes[1]], [4, 6, 8])
    assert res[0] == res[2] == block_size and res[1] == OBJECT_NOT_FOUND
    assert decode.block_bytes(4) == prefill.block_bytes(src_ids[0])
    assert decode.block_bytes(8) == prefill.block_bytes(src_ids[1])
    assert decode.block_bytes(6) == before[6]


def test_tp_ranks_and_native_client(workers, make_client, master) -> None:
    """Two TP ranks save the same block hashes under their own key prefixes; the
    native client's put of a block under a rank's key is a hit that loads."""
    r0, r1 = workers(tp_rank=0, seed=3), workers(tp_rank=1, seed=4)
    for w in (r0, r1):
        assert w.register_kv_caches() == [0] * LAYERS
    hashes = block_hashes(list(range(7, 7 + 2 * BLOCK)))
    assert r0.save(hashes, [0, 1])[1] == [0, 0]
    assert r1.lookup(hashes) == 0  # rank 1's keys are its own
    assert r1.save(hashes, [2, 3])[1] == [0, 0]
    assert r0.load(hashes, [10, 11]) == [sum(r0.block_lens)] * 2
    assert r0.block_bytes(10) == r0.block_bytes(0)

    native = make_client(master)
    h = block_hashes(list(range(900, 900 + BLOCK)))
    payload = r1.block_bytes(5)
    native.put(r0.key_for(h[0]), payload)
    assert r0.lookup(h) == BLOCK
    assert r0.load(h, [12]) == [len(payload)]
    assert r0.block_bytes(12) == payload
