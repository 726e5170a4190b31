"""Process configuration: one frozen dataclass per process, one CLI flag per field.

``MasterConfig.add_cli_args`` derives every flag from the dataclass fields
(``eviction_ratio`` -> ``--eviction-ratio``) with defaults read from the
dataclass, so the two never drift apart.  Defaults follow ``mooncake_master``'s
gflags where the concept is the same.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["MasterConfig", "add_cli_args", "from_cli_args"]

T = TypeVar("T")


def _opt(help_text: str, lo: float | None = None, hi: float | None = None, **kw: Any) -> Any:
    meta = {"help": help_text, "lo": lo, "hi": hi}
    return field(metadata=meta, **kw)


@dataclass(frozen=True)
class MasterConfig:
    """Configuration of ``kvmaster master``."""

    host: str = _opt("address the ROUTER socket binds to", default="127.0.0.1")
    port: int = _opt("TCP port of the ROUTER socket (0 = any free port, printed)", 0, 65535,
                     default=50051)
    shards: int = _opt("number of shard actors", 1, 256, default=4)
    shard_processes: bool = _opt(
        "run each shard actor in its own process, connected to the front over ipc sockets",
        default=False)
    eviction_high_watermark_ratio: float = _opt(
        "used/capacity ratio of a shard above which it evicts", 0.0, 1.0, default=0.90)
    eviction_ratio: float = _opt(
        "fraction of a shard's capacity freed by one watermark eviction", 0.0, 1.0, default=0.05)
    default_kv_lease_ttl: int = _opt("read lease granted by get, in ms", 1, None, default=10000)
    default_kv_soft_pin_ttl: int = _opt("soft pin length when a write enables it without a TTL, ms",
                                        1, None, default=1800000)
    max_kv_soft_pin_ttl: int = _opt("largest soft_pin_ttl_ms a write may ask for, ms", 1, None,
                                    default=86400000)
    allow_evict_soft_pinned_objects: bool = _opt(
        "evict soft-pinned objects once no ordinary object is left", default=True)
    exist_grants_lease: bool = _opt(
        "is_exist grants a read lease, as Mooncake's master does", default=False)
    client_ttl: float = _opt("seconds without a request or heartbeat before a client is "
                             "expired and its segments unmounted", 0.1, None, default=10.0)
    put_start_discard_timeout: float = _opt(
        "seconds after which another writer may take over an unfinished put", 0.0, None,
        default=30.0)
    put_start_release_timeout: float = _opt(
        "seconds after which the space of an unfinished put is freed", 0.0, None, default=600.0)
    master_segment_size: int = _opt(
        "bytes of shared memory the master mounts as its own segment (0 = none)", 0, None,
        default=0)
    max_batch: int = _opt("most keys in one batch request", 1, 1 << 20, default=4096)
    max_clients: int = _opt("most registered clients; HELLO beyond it is refused", 1, None,
                            default=4096)
    max_segments_per_client: int = _opt("most segments one client may mount", 1, None, default=64)
    shard_inbox: int = _opt("bound of each shard's inbox; a full inbox answers BUSY", 1, None,
                            default=8192)
    enable_kv_sessions: bool = _opt(
        "serve the session ops; off answers them UNSUPPORTED", default=True)
    kv_session_max_sessions: int = _opt(
        "most live sessions; each shard holds at most its share (ceil(max / shards))", 1, None,
        default=100000)
    kv_session_max_members: int = _opt(
        "most members of one session, and most keys in one complete update keep set", 1, None,
        default=1000000)
    kv_session_max_per_object: int = _opt("most sessions one object belongs to", 1, None,
                                          default=100000)
    kv_session_max_batch: int = _opt("most keys in one attach, and largest list page", 1, None,
                                     default=4096)
    curve_dir: str = _opt(
        "key directory from `kvmaster keygen`: turns on CURVE authentication and encryption; "
        "a client's tenant comes from its key (empty = off)", default="")
    metrics_port: int = _opt(
        "HTTP port for /metrics (Prometheus), /health and /ready (0 = any free port, "
        "printed; -1 = off)", -1, 65535, default=9003)
    metrics_host: str = _opt("address the metrics HTTP server binds to", default="127.0.0.1")
    admin_tenant: str = _opt(
        "tenant whose clients see every tenant in LIST_CLIENTS and STATS", default="default")
    log_level: str = _opt("logging level", default="INFO")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_cli_args(cls: type, parser: argparse.ArgumentParser) -> None:
    """Add one flag per field of the dataclass ``cls`` to ``parser``."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        default = f.default
        if f.type in ("bool", bool):
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction,
                                default=default, help=meta.get("help", ""))
            continue
        typ = {"int": int, "float": float, "str": str}.get(str(f.type), str)
        parser.add_argument(_flag(f.name), type=typ, default=default,
                            help=f"{meta.get('help', '')} (default: {default})")


def from_cli_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build ``cls`` from parsed args, validating each field's range.

    Raises ValueError naming the flag and the allowed range.
    """
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        v = getattr(args, f.name)
        lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
        if lo is not None and v < lo or hi is not None and v > hi:
            raise ValueError(f"{_flag(f.name)}={v} is out of range [{lo}, {hi if hi is not None else 'inf'}]")
        values[f.name] = v
    return cls(**values)
