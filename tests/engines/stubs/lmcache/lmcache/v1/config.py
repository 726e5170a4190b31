"""``lmcache.v1.config.LMCacheEngineConfig``: the fields the connector reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LMCacheEngineConfig:
    chunk_size: int = 256
    extra_config: dict[str, Any] | None = field(default_factory=dict)
    use_layerwise: bool = False
    enable_blending: bool = False
    save_unfull_chunk: bool = True
