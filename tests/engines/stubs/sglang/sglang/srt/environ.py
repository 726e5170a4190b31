"""Stand-in for ``sglang.srt.environ``: the ``envs`` fields the HiCache storage
files read, with SGLang 0.5.23's defaults; each reads ``os.environ`` when asked."""

from __future__ import annotations

import os
from typing import Any


class _Env:
    def __init__(self, name: str, kind: type, default: Any) -> None:
        self.name = name
        self.kind = kind
        self.default = default

    def is_set(self) -> bool:
        return self.name in os.environ

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        if self.kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return self.kind(raw)


_FIELDS = {
    "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": (str, None),
    "MOONCAKE_MASTER": (str, None),
    "MOONCAKE_CLIENT": (str, None),
    "MOONCAKE_LOCAL_HOSTNAME": (str, "localhost"),
    "MOONCAKE_TE_META_DATA_SERVER": (str, "P2PHANDSHAKE"),
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": (str, "4gb"),
    "MOONCAKE_PROTOCOL": (str, "rdma"),
    "MOONCAKE_DEVICE": (str, ""),
    "MOONCAKE_MASTER_METRICS_PORT": (int, 9003),
    "MOONCAKE_CHECK_SERVER": (bool, False),
    "MOONCAKE_STANDALONE_STORAGE": (bool, False),
    "MOONCAKE_ENABLE_SSD_OFFLOAD": (bool, False),
    "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": (str, None),
    "MOONCAKE_TENANT_ID": (str, "default"),
    "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": (str, None),
    "SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE": (bool, False),
    "SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL": (float, 5.0),
    "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY": (float, None),
    "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": (float, None),
}


class _Envs:
    def __getattr__(self, name: str) -> _Env:
        if name not in _FIELDS:
            raise AttributeError(f"envs.{name} is not in the test stand-in")
        kind, default = _FIELDS[name]
        return _Env(name, kind, default)


envs = _Envs()
