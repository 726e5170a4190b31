"""``lmcache.v1.token_database.ChunkedTokenDatabase``: a prompt cut into chunks of
``chunk_size`` tokens (the last one possibly shorter), each keyed by a hash chained
over every token before its end (so a key names a whole prefix)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata


class ChunkedTokenDatabase:
    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheMetadata) -> None:
        self.config = config
        self.metadata = metadata
        self.chunk_size = config.chunk_size

    @staticmethod
    def chain_hash(prev: int, tokens: list[int]) -> int:
        h = hashlib.blake2b(prev.to_bytes(8, "little"), digest_size=8)
        h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
        return int.from_bytes(h.digest(), "little")

    def make_key(self, chunk_hash: int) -> CacheEngineKey:
        m = self.metadata
        return CacheEngineKey(m.model_name, m.world_size, m.worker_id, chunk_hash, m.kv_dtype)

    def process_tokens(self, tokens: torch.Tensor | list[int]
                       ) -> Iterator[tuple[int, int, CacheEngineKey]]:
        """``(start, end, key)`` per chunk, in order."""
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        prev = 0
        for start in range(0, len(ids), self.chunk_size):
            end = min(start + self.chunk_size, len(ids))
            if end - start < self.chunk_size and not self.config.save_unfull_chunk:
                return
            prev = self.chain_hash(prev, ids[start:end])
            yield start, end, self.make_key(prev)
