"""``lmcache.utils.CacheEngineKey``: one chunk's key and its string form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: dtype names used in the key string.
DTYPE_NAMES = {torch.float16: "half", torch.bfloat16: "bfloat16", torch.float32: "float",
               torch.float64: "double", torch.uint8: "uint8", torch.int8: "int8"}

TAG_PREFIX = "lmcache.tag."


@dataclass
class CacheEngineKey:
    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int | bytes
    dtype: torch.dtype
    request_configs: dict[str, Any] | None = field(default_factory=dict)

    @property
    def chunk_hash_hex(self) -> str:
        h = self.chunk_hash
        return h.hex() if isinstance(h, bytes) else format(h, "x")

    def to_string(self) -> str:
        """``model@world_size@worker_id@<hash hex>@<dtype>`` then ``@name%value`` per
        ``lmcache.tag.<name>`` request config."""
        parts = [self.model_name, str(self.world_size), str(self.worker_id),
                 self.chunk_hash_hex, DTYPE_NAMES[self.dtype]]
        for k, v in (self.request_configs or {}).items():
            if k.startswith(TAG_PREFIX):
                parts.append(f"{k[len(TAG_PREFIX):]}%{v}")
        return "@".join(parts)

    def __hash__(self) -> int:
        return hash(self.to_string())
