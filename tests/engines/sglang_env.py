"""SGLang's own ``hicache_storage.py`` (``../shared/engines/sglang``) loaded under its
real module name over the harness's stand-ins (``tests/engines/stubs/sglang``), for
the tests of :mod:`kvmaster.hicache` and the worker processes they start.

``load()`` puts the stand-ins first on ``sys.path``, loads the file and returns the
module; ``unload()`` removes every ``sglang`` module, the stand-ins' path and
``kvmaster.hicache`` (which subclasses the loaded ``HiCacheStorage``)."""

from __future__ import annotations

import ctypes
import hashlib
import sys
from types import ModuleType
from typing import Any

from tests.engines.conftest import STUBS, engine_file, load_module

SGLANG_STUBS = STUBS / "sglang"
MODULE = "sglang.srt.mem_cache.hicache_storage"


def unload() -> None:
    for m in [m for m in sys.modules if m in ("sglang", "requests", "kvmaster.hicache")
              or m.startswith("sglang.")]:
        del sys.modules[m]
    while str(SGLANG_STUBS) in sys.path:
        sys.path.remove(str(SGLANG_STUBS))


def load() -> ModuleType:
    unload()
    sys.path.insert(0, str(SGLANG_STUBS))
    return load_module(MODULE, engine_file("sglang/hicache_storage.py"))


def storage_config(hs: ModuleType, addr: str, *, mla: bool = False, tp_rank: int = 0,
                   tp_size: int = 1, model: str = "org/model", **extra: Any) -> Any:
    """SGLang's HiCacheStorageConfig for one worker, the backend's fields in its
    extra config (as SGLang's ``--hicache-storage-backend-extra-config`` sets them)."""
    return hs.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=True, model_name=model,
        extra_config={"backend_name": "kvmaster", "module_path": "kvmaster.hicache",
                      "class_name": "KvmasterHiCacheStorage", "interface_v1": 1,
                      "master_server_address": addr, "global_segment_size": "16MB",
                      **extra})


def pool(model: str, layout: str, pages: int = 32, page_size: int = 4,
         layers: int = 3) -> Any:
    """A stand-in host pool (real CPU tensors) of ``pages`` pages."""
    import torch

    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    if model == "mha":
        return MHATokenToKVPoolHost(pages * page_size, page_size, layers, head_num=2,
                                    head_dim=16, dtype=torch.bfloat16, layout=layout)
    return MLATokenToKVPoolHost(pages * page_size, page_size, layers, kv_cache_dim=48,
                                dtype=torch.bfloat16, layout=layout)


def slots(p: Any, first_page: int, n: int) -> Any:
    """The host indices of pages [first_page, first_page + n) of pool ``p``."""
    import torch

    return torch.arange(first_page * p.page_size, (first_page + n) * p.page_size)


def fill_page(p: Any, page: int, page_hash: str) -> None:
    """Writes into page ``page`` of ``p`` the bytes :func:`page_content` gives
    ``page_hash`` (every run of the page, in the pool's order)."""
    ptrs, sizes = p.get_page_buffer_meta(slots(p, page, 1))
    data = page_content(page_hash, sum(sizes))
    pos = 0
    for ptr, n in zip(ptrs, sizes):
        ctypes.memmove(ptr, data[pos:pos + n], n)
        pos += n


def read_page(p: Any, page: int) -> bytes:
    ptrs, sizes = p.get_page_buffer_meta(slots(p, page, 1))
    return b"".join(ctypes.string_at(ptr, n) for ptr, n in zip(ptrs, sizes))


def page_content(page_hash: str, size: int) -> bytes:
    """``size`` bytes that only ``page_hash`` gives."""
    seed = hashlib.sha256(page_hash.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]
