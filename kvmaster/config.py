"""Process configuration: one frozen dataclass per process, one CLI flag per field.

``MasterConfig.add_cli_args`` derives every flag from the dataclass fields
(``eviction_ratio`` -> ``--eviction-ratio``) with defaults read from the
dataclass, so the two never drift apart.  Defaults follow ``mooncake_master``'s
gflags where the concept is the same.

A TOML file can hold the same settings: its keys are exactly the flag names
without the dashes (``eviction-ratio = 0.1``).  :func:`load_toml` checks each
key's name, type and range and :func:`apply_config_file` turns the file into
parser defaults, so flags given on the command line still win.
:func:`to_toml` writes a config back in that form (``--print-config``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["LOG_LEVELS", "ConfigError", "MasterConfig", "add_cli_args", "apply_config_file",
           "from_cli_args", "load_toml", "parse_log_levels", "to_toml"]

T = TypeVar("T")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(ValueError):
    """A configuration value (flag or file key) that is unknown, mistyped or out of range."""


def _opt(help_text: str, lo: float | None = None, hi: float | None = None,
         choices: tuple[str, ...] | None = None, **kw: Any) -> Any:
    meta = {"help": help_text, "lo": lo, "hi": hi, "choices": choices}
    return field(metadata=meta, **kw)


@dataclass(frozen=True)
class MasterConfig:
    """Configuration of ``kvmaster master``."""

    host: str = _opt("address the ROUTER socket binds to", default="127.0.0.1")
    port: int = _opt("TCP port of the ROUTER socket (0 = any free port, printed)", 0, 65535,
                     default=50051)
    ipc_path: str = _opt(
        "also bind the ROUTER socket to ipc://PATH, a Unix socket for clients on this host "
        "(they connect to 'ipc://PATH': Client.setup's address, or master_server_addr in the "
        "compat API; a single op takes 17-32 µs "
        "less than over TCP loopback); a stale socket file at PATH is replaced, but not a "
        "live master's socket or any other file; @NAME is Linux's abstract namespace", default="")
    shards: int = _opt(
        "number of shard actors (0 = 1 in one process, where more only add cross-shard "
        "forwarding, or 4 with --shard-processes)", 0, 256, default=0)
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
    eviction_policy: str = _opt(
        "which evictable object goes first: lru (Mooncake's: least recently used, a call's "
        "keys used in order), prefix-lru (a call's keys are a prefix chain: its tail goes "
        "before its head, a write lands behind the writer's last hits) or depth-lru (a "
        "call's keys used back to front, each made older by 4 uses per block of chain "
        "depth); pins and leases decide first in each",
        choices=("lru", "prefix-lru", "depth-lru"), default="depth-lru")
    session_tags_as_kv_sessions: bool = _opt(
        "make a write's session tag (Mooncake's ReplicateConfig.session_ids) a membership "
        "of that session, so engines that only tag get sessions without code changes "
        "(a write tagged so carries no group ids)", default=False)
    exist_grants_lease: bool = _opt(
        "is_exist grants a read lease, as Mooncake's master does", default=False)
    client_ttl: float = _opt("seconds without a request or heartbeat before a client is "
                             "expired and its segments unmounted (with "
                             "--client-suspicion-ttl: suspected)", 0.1, None, default=10.0)
    client_suspicion_ttl: float = _opt(
        "seconds a client silent past --client-ttl is suspected before it is expired: its "
        "objects stay readable and no new write is placed on its segments; a suspected "
        "client heard from again is active again, with everything it held (as Mooncake's "
        "client_suspicion_ttl_sec); 0 expires it at --client-ttl", 0.0, None, default=0.0)
    put_start_discard_timeout: float = _opt(
        "seconds after which another writer may take over an unfinished put", 0.0, None,
        default=30.0)
    put_start_release_timeout: float = _opt(
        "seconds after which an unfinished put is dropped (its key freed); its space stays "
        "allocated until its writer ends or revokes it, or leaves or is expired", 0.0, None,
        default=600.0)
    max_writes_per_client: int = _opt(
        "most write records one client holds: its writes in progress plus those the master "
        "gave up on (taken over, released, dropped with a segment) whose space stays "
        "allocated until the client ends or revokes them, or leaves; each shard holds at "
        "most its share (ceil(max / shards)), and a start beyond it answers "
        "NO_AVAILABLE_HANDLE", 1, None, default=1 << 18)
    master_segment_size: int = _opt(
        "bytes of shared memory the master mounts as its own segment (0 = none)", 0, None,
        default=0)
    clean_stale_segments: bool = _opt(
        "at start-up, remove the --master-segment-size files that masters of this host "
        "left when they died (same KVMASTER_SEGMENT_TAG, user and pid namespace); never "
        "one whose master is alive or that a live process maps or holds open (while some "
        "are, looked at again after 2 s, then after pauses doubling up to 15 min, for a "
        "day)", default=True)
    max_batch: int = _opt("most keys in one batch request", 1, 1 << 20, default=4096)
    max_clients: int = _opt("most registered clients; HELLO beyond it is refused", 1, None,
                            default=4096)
    max_segments_per_client: int = _opt("most segments one client may mount", 1, None, default=64)
    max_reply_bytes_per_peer: int = _opt(
        "reply bytes queued for one client that does not read them (its socket's queue: "
        "this over 64 KiB messages, at least 256; a batch reply of --max-batch keys may be "
        "larger); past it its replies are dropped and counted (reply_dropped), its calls "
        "time out, the master does not grow", 1 << 20, None,
        default=64 << 20)
    max_segment_size: int = _opt(
        "largest segment a client may mount, bytes (MOUNT_SEGMENT beyond it is refused "
        "INVALID_PARAMS; the protocol allows at most 2^48)", 4096, 1 << 48, default=1 << 48)
    max_remote_segment_size: int = _opt(
        "largest segment a client may mount on a host other than the master's, bytes: the "
        "master cannot see such a segment, so its size is taken on trust up to this "
        "(beyond it INVALID_PARAMS)", 4096, 1 << 48, default=64 << 30)
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
    kv_session_update_staging_ttl: float = _opt(
        "seconds an unfinished multi-page session update (UPDATE_KV_SESSION pages before the "
        "final one) stays staged on its session's home shard after its last page; each shard "
        "stages at most 64 (then BUSY), and a client's are dropped when it leaves or expires",
        0.1, None, default=120.0)
    max_groups_per_shard: int = _opt(
        "most key groups (ReplicateConfig.group_ids) whose home is one shard; a write that "
        "would create one more is refused GROUP_LIMIT_EXCEEDED", 1, None, default=65536)
    curve_dir: str = _opt(
        "key directory from `kvmaster keygen`: turns on CURVE authentication and encryption; "
        "a client's tenant comes from its key (empty = off)", default="")
    ha: bool = _opt("high availability: elect a leader through etcd; standbys answer "
                    "UNAVAILABLE_IN_CURRENT_STATUS until elected", default=False)
    etcd_endpoints: str = _opt("comma-separated etcd client URLs (with --ha)",
                               default="http://127.0.0.1:2379")
    cluster_id: str = _opt("name of the HA cluster: the leader key is /kvmaster/<id>/leader",
                           default="kvmaster_cluster")
    ha_lease_ttl: int = _opt("seconds of the leader's etcd lease: how long a dead leader "
                             "keeps the key", 1, 3600, default=5)
    ha_oplog: bool = _opt(
        "with --ha, a hot standby: the leader writes its object metadata changes to an "
        "op log in etcd, standbys follow it, and a promoted standby serves the objects once "
        "their segments are mounted again (HA.md; not with --shard-processes)", default=False)
    ha_oplog_delay_ms: float = _opt(
        "longest wait, ms, before the leader writes the op-log records it has to etcd "
        "(what a crash of the leader can lose: HA.md)", 0.1, 10_000, default=10.0)
    ha_oplog_max_batch: int = _opt(
        "most records in one op-log batch of a shard (a full batch is written at once)",
        1, 100_000, default=2048)
    ha_oplog_max_pending: int = _opt(
        "most op-log records the leader holds before etcd has them; past it the leader "
        "steps down (exit status 3), since standbys could no longer follow it",
        1000, None, default=1_000_000)
    ha_oplog_snapshot_records: int = _opt(
        "a standby writes a shard's snapshot to etcd, and trims the op log behind it, once "
        "it has applied this many records of it since the last one and at least as many "
        "as the shard has objects (0 = never: the log grows until trimmed by another "
        "master)", 0, None, default=200_000)
    ha_remount_grace: float = _opt(
        "seconds a promoted standby waits for a segment of the op log to be mounted again "
        "before it drops that segment's objects", 0.1, 86_400, default=30.0)
    advertise_address: str = _opt(
        "endpoint clients should use for this master (default: the bound endpoint)", default="")
    metrics_port: int = _opt(
        "HTTP port for /metrics (Prometheus), /health and /ready (0 = any free port, "
        "printed; -1 = off)", -1, 65535, default=9003)
    metrics_host: str = _opt("address the metrics HTTP server binds to", default="127.0.0.1")
    admin_tenant: str = _opt(
        "tenant whose clients see every tenant in LIST_CLIENTS and STATS, and alone may ask "
        "for CHECK_CONSISTENCY; it has no tenant quota", default="default")
    shared_tenants: str = _opt(
        "comma-separated tenants whose segments hold every tenant's writes, as the master's "
        "own segment does (empty = none: a write goes only to its own tenant's segments and "
        "the master's)", default="")
    tenant_quota_bytes: int = _opt(
        "most bytes one tenant's objects and writes in progress may hold (every replica; "
        "each shard enforces ceil(quota / shards)); a write past it evicts the tenant's own "
        "least recent objects, or is refused TENANT_QUOTA_EXCEEDED (0 = no quota)", 0, None,
        default=0)
    tenant_max_writes: int = _opt(
        "most writes in progress of one tenant (each shard enforces ceil(max / shards)); "
        "past it a start is refused TENANT_QUOTA_EXCEEDED (0 = no limit)", 0, None, default=0)
    tenant_max_clients: int = _opt(
        "most registered clients of one tenant; HELLO beyond it is refused "
        "TENANT_QUOTA_EXCEEDED (0 = --max-clients)", 0, None, default=0)
    tenant_max_requests_per_s: float = _opt(
        "most requests per second of one tenant other than the admin one, in bursts of "
        "a quarter of it (at least 64); requests past it are parked in arrival order and "
        "served as the rate allows (4,096 messages or 64 MiB parked per tenant, 65,536 or "
        "256 MiB in all, 30 s at most; past that, dropped unanswered) (0 = no limit)",
        0, None, default=0.0)
    max_clients_per_key: int = _opt(
        "with --curve-dir, most registered clients of one CURVE key; HELLO beyond it is "
        "refused TENANT_QUOTA_EXCEEDED", 1, None, default=256)
    tenant_max_sessions: int = _opt(
        "most live sessions of one tenant (each shard holds at most ceil(max / shards)); "
        "past it a new session is refused TENANT_QUOTA_EXCEEDED (0 = --kv-session-max-sessions)",
        0, None, default=0)
    gc_threshold: int = _opt(
        "allocations between two collections of the garbage collector's youngest generation "
        "(Python's gc.set_threshold; its default is 700, at which a master storing 1024-key "
        "put batches spends about a fifth of its time in the collector); 0 = Python's "
        "setting (and no freezing of start-up objects)", 0, 2**31 - 1, default=10000)
    log_level: str = _opt("logging level of every kvmaster logger", choices=LOG_LEVELS,
                          default="INFO")
    log_format: str = _opt("log line format: text, or json (one JSON object per line)",
                           choices=("text", "json"), default="text")
    log_levels: str = _opt(
        "per-logger levels overriding --log-level, e.g. "
        "'kvmaster._shard=DEBUG,kvmaster.metrics=WARNING' (empty = none)", default="")

    def __post_init__(self) -> None:
        if self.ha_oplog and not self.ha:
            raise ConfigError("--ha-oplog needs --ha (the op log lives in the election's etcd)")
        if self.ha_oplog and self.shard_processes:
            raise ConfigError("--ha-oplog does not run with --shard-processes yet")

    @property
    def shard_count(self) -> int:
        """Shards the master runs: ``shards``, or for 0 (the default) 1 in one process
        and 4 with ``shard_processes``.  In one process every shard actor runs on the
        same thread, so more shards add no parallelism, only the forwarding of batches
        between them (BENCHMARKS.md).  ``shards`` itself stays 0, so a written config
        (``--print-config``) keeps choosing by mode."""
        if self.shards:
            return self.shards
        return 4 if self.shard_processes else 1


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _key(name: str) -> str:
    """Config file key of a field: its flag without the dashes."""
    return name.replace("_", "-")


def _type_name(f: dataclasses.Field[Any]) -> str:
    return str(f.type.__name__ if isinstance(f.type, type) else f.type)


def _range_text(lo: float | None, hi: float | None) -> str:
    return f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"


def _check(f: dataclasses.Field[Any], v: Any, where: str) -> Any:
    """Validate one value of field ``f``; ``where`` names it in the error
    (``--shards`` or ``key 'shards'``).  Returns the normalised value."""
    meta = f.metadata
    lo, hi, choices = meta.get("lo"), meta.get("hi"), meta.get("choices")
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{where}={v} must be a finite number in {_range_text(lo, hi)}")
    if lo is not None and v < lo or hi is not None and v > hi:
        raise ConfigError(f"{where}={v} is out of range {_range_text(lo, hi)}")
    if choices is not None:
        if choices is LOG_LEVELS:
            v = v.upper()
        if v not in choices:
            raise ConfigError(f"{where}={v!r} is not one of {', '.join(choices)}")
    if f.name == "log_levels":
        try:
            parse_log_levels(v)
        except ValueError as exc:
            raise ConfigError(f"{where}={v!r}: {exc}") from None
    return v


def parse_log_levels(text: str) -> dict[str, str]:
    """``"kvmaster._shard=DEBUG, kvmaster.metrics=warning"`` -> ``{logger: LEVEL}``."""
    out: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, level = item.partition("=")
        name, level = name.strip(), level.strip().upper()
        if not sep or not name:
            raise ValueError(f"expected LOGGER=LEVEL, got {item!r}")
        if level not in LOG_LEVELS:
            raise ValueError(f"level of {name} must be one of {', '.join(LOG_LEVELS)}, "
                             f"got {level!r}")
        out[name] = level
    return out


def add_cli_args(cls: type, parser: argparse.ArgumentParser) -> None:
    """Add one flag per field of the dataclass ``cls`` to ``parser``."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        default = f.default
        if _type_name(f) == "bool":
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction,
                                default=default, help=meta.get("help", ""))
            continue
        typ = {"int": int, "float": float, "str": str}.get(_type_name(f), str)
        shown = "none" if default == "" else default
        parser.add_argument(_flag(f.name), type=typ, default=default,
                            help=f"{meta.get('help', '')} (default: {shown})")


def from_cli_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build ``cls`` from parsed args, validating each field's range and choices.

    Raises ConfigError (a ValueError) naming the flag and the allowed range.
    """
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        values[f.name] = _check(f, getattr(args, f.name), _flag(f.name))
    return cls(**values)


def load_toml(cls: type, path: str | Path) -> dict[str, Any]:
    """Read a TOML config file for ``cls``: ``{field name: value}`` of the keys it sets.

    Keys are the flag names without the dashes; every key is checked for its
    name, type and range.  Raises ConfigError naming the file and the key.
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    fields = {_key(f.name): f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, v in data.items():
        f = fields.get(key)
        if f is None:
            hint = ""
            if key.replace("_", "-") in fields:
                hint = f" (did you mean {key.replace('_', '-')!r}?)"
            elif key.lstrip("-") in fields:
                hint = f" (write it without dashes: {key.lstrip('-')!r})"
            raise ConfigError(f"config file {path}: unknown key {key!r}{hint}; keys are the "
                              f"flags of `kvmaster master --help` without the leading dashes")
        where = f"config file {path}: key {key!r}"
        want = _type_name(f)
        if want == "bool":
            ok = isinstance(v, bool)
        elif want == "int":
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif want == "float":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            v = float(v) if ok else v
        else:
            ok = isinstance(v, str)
        if not ok:
            toml_type = {"bool": "a boolean (true/false)", "int": "an integer",
                         "float": "a number", "str": "a string"}[want]
            raise ConfigError(f"{where} must be {toml_type}, got {type(v).__name__} {v!r}")
        values[f.name] = _check(f, v, where)
    return values


def apply_config_file(cls: type, parser: argparse.ArgumentParser, path: str | Path) -> None:
    """Make the values of a config file the defaults of ``parser`` (so flags override
    them).  Raises ConfigError."""
    parser.set_defaults(**load_toml(cls, path))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    # JSON string escapes are valid TOML basic-string escapes.
    return json.dumps(str(v), ensure_ascii=False)


def to_toml(config: Any) -> str:
    """The config as a TOML file that :func:`load_toml` reads back to the same values,
    one commented key per field."""
    lines = []
    for f in dataclasses.fields(config):
        lines.append(f"# {f.metadata.get('help', '')}")
        lines.append(f"{_key(f.name)} = {_toml_value(getattr(config, f.name))}")
    return "\n".join(lines) + "\n"
