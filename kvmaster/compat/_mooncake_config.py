"""``MooncakeConfig``: Mooncake's set-up parameters from a JSON file or the
environment (Mooncake ``mooncake-wheel/mooncake/mooncake_config.py``), and the size
parser that it shares with the facade's ``setup``.

Sizes follow Mooncake's ``try_string_to_byte_size`` (``mooncake-store/include/
utils.h``): an int is a byte count; a string is a non-negative number (decimal,
an exponent, or a C hex float like ``0x10``) optionally followed, after blanks, by
one of ``B``, ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB`` (any case; binary
multiples, 1 KB = 1024 B), the product truncated to whole bytes: ``"16MB"``,
``"16 mb"``, ``"3.2GB"``, ``"1e6"``.  ``"infinite"`` is 2^64 - 1.  Anything else
(``"50%"``, ``"-1"``, ``"16 MiB"``, ``""``) is refused: Mooncake has no relative
sizes, and its ``setup`` with a config dict returns INVALID_PARAMS for them, as
``MooncakeConfig`` raises ValueError.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvmaster.compat")

__all__ = ["DEFAULT_GLOBAL_SEGMENT_SIZE", "DEFAULT_LOCAL_BUFFER_SIZE", "MooncakeConfig",
           "parse_bool", "parse_size"]

#: MooncakeConfig's defaults (mooncake_config.py): 3.125 GiB and 1 GiB.
DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200
DEFAULT_LOCAL_BUFFER_SIZE = 1073741824

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}
# What C's strtod takes as a number at the start of a string (std::stod), less
# inf/nan, which no size is.
_NUMBER = re.compile(r"[+-]?(?:0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)"
                     r"(?:[pP][+-]?\d+)?|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)")
_U64_MAX = (1 << 64) - 1


def parse_size(value: Any, what: str = "size") -> int:
    """Bytes for a size given as an int or a string (see the module docstring).
    Raises ValueError naming ``what`` for anything else, a negative number among
    them; a bool is refused too (``True`` is no size)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid {what}: {value!r} (a bool)")  # noqa: TRY004 - as Mooncake
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid {what}: {value} (negative)")
        return value
    if isinstance(value, float):
        if not 0 <= value < float("inf"):  # (False for NaN too)
            raise ValueError(f"invalid {what}: {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(  # noqa: TRY004 - Mooncake's parser raises ValueError
            f"invalid {what}: {value!r} (use an int or a string like '16MB')")
    s = value.strip(" \t\r\n")
    if s == "infinite":
        return _U64_MAX
    m = _NUMBER.match(s)
    if not m:
        raise ValueError(f"invalid {what}: {value!r} (use bytes or a number with B, KB, MB, "
                         f"GB or TB, e.g. '16MB' or '3.2 GB')")
    text = m.group()
    number = float.fromhex(text) if "x" in text.lower() else float(text)
    unit = s[m.end():].lstrip(" \t\r\n").upper()
    if number < 0 or unit not in _UNITS:
        raise ValueError(f"invalid {what}: {value!r} (use bytes or a number with B, KB, MB, "
                         f"GB or TB, e.g. '16MB' or '3.2 GB'; no percentages)")
    return min(int(number * _UNITS[unit]), _U64_MAX)


def parse_bool(value: Any) -> bool:
    """A config boolean given as a bool, a number or text (true/false, yes/no, on/off,
    1/0, enable/disable; "" and None are False).  Raises ValueError otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if value is None:
        return False
    s = str(value).strip().lower()
    if s in ("", "false", "0", "no", "off", "disable"):
        return False
    if s in ("true", "1", "yes", "on", "enable"):
        return True
    raise ValueError(f"Invalid boolean value: {value!r}")


#: Protocols Mooncake names (its Transfer Engine and Store); others are passed on
#: with a warning, as Mooncake does.
KNOWN_PROTOCOLS = frozenset({"tcp", "rdma", "efa", "nvmeof", "nvlink", "musa", "nvlink_intra",
                             "hip", "barex", "cxl", "ascend", "ub", "ubshmem", "maca",
                             "sunrise_link", "rpc_only"})
_REQUIRED = ("local_hostname", "metadata_server", "master_server_address")


@dataclass
class MooncakeConfig:
    """Mooncake's client configuration, with its fields, defaults and checks.

    ``global_segment_size`` and ``local_buffer_size`` are bytes (``from_file`` and
    ``load_from_env`` also take sizes as strings); ``protocol`` is lower-cased, and
    one Mooncake does not name is logged, not refused.  Raises ValueError for an
    empty protocol, a negative size or an empty ``local_hostname``,
    ``metadata_server`` or ``master_server_address``.  :meth:`setup_args` gives the
    positional arguments of ``MooncakeDistributedStore.setup``."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str | None
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(f"Invalid protocol: {self.protocol!r}. Protocol must be a "
                             f"non-empty string, e.g. 'tcp' or 'rdma'.")
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in KNOWN_PROTOCOLS:
            log.warning("Unrecognised protocol %r; passing it through unchanged. Known "
                        "protocols are: %s.", self.protocol, ", ".join(sorted(KNOWN_PROTOCOLS)))
        for name in ("global_segment_size", "local_buffer_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"Invalid {name}: {getattr(self, name)}. Size must be "
                                 f"non-negative.")
        for name in _REQUIRED:
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"Config field {name!r} must be a non-empty string, got {v!r}.")

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        """Read a JSON object with the fields' names (``local_hostname``,
        ``metadata_server`` and ``master_server_address`` are required; the sizes
        default to 3.125 GiB and 1 GiB).  Raises ValueError, OSError, and
        json.JSONDecodeError (a ValueError)."""
        with open(file_path, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError(f"{file_path}: the config must be a JSON object")  # noqa: TRY004
        for name in _REQUIRED:
            if name not in config:
                raise ValueError(f"Missing required config field: {name}")
        path = config.get("ssd_offload_path")
        tenant = config.get("tenant_id")
        return MooncakeConfig(
            local_hostname=config["local_hostname"],
            metadata_server=config["metadata_server"],
            global_segment_size=parse_size(config.get("global_segment_size",
                                                      DEFAULT_GLOBAL_SEGMENT_SIZE),
                                           "global_segment_size"),
            local_buffer_size=parse_size(config.get("local_buffer_size",
                                                    DEFAULT_LOCAL_BUFFER_SIZE),
                                         "local_buffer_size"),
            protocol=config.get("protocol", "tcp"),
            device_name=config.get("device_name", ""),
            master_server_address=config["master_server_address"],
            enable_ssd_offload=parse_bool(config.get("enable_ssd_offload", False)),
            ssd_offload_path=str(path) if path is not None else "",
            tenant_id=str(tenant) if tenant is not None else "default",
            enable_client_http_server=parse_bool(config.get("enable_client_http_server",
                                                            False)),
            client_http_port=int(config.get("client_http_port", 9300)),
        )

    @staticmethod
    def load_from_env() -> MooncakeConfig:
        """``from_file($MOONCAKE_CONFIG_PATH)``, else the MOONCAKE_* variables
        (MOONCAKE_MASTER required; MOONCAKE_LOCAL_HOSTNAME, MOONCAKE_TE_META_DATA_SERVER,
        MOONCAKE_GLOBAL_SEGMENT_SIZE, MOONCAKE_LOCAL_BUFFER_SIZE, MOONCAKE_PROTOCOL,
        MOONCAKE_DEVICE, MOONCAKE_OFFLOAD_ENABLED, MOONCAKE_OFFLOAD_FILE_STORAGE_PATH,
        MOONCAKE_TENANT_ID, MOONCAKE_ENABLE_CLIENT_HTTP_SERVER,
        MOONCAKE_CLIENT_HTTP_PORT).  Raises ValueError when neither is set."""
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path is not None:
            return MooncakeConfig.from_file(path)
        master = os.getenv("MOONCAKE_MASTER")
        if not master:
            raise ValueError("Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor "
                             "'MOONCAKE_MASTER' is set.")
        env = os.getenv
        return MooncakeConfig(
            local_hostname=env("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=env("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=parse_size(env("MOONCAKE_GLOBAL_SEGMENT_SIZE",
                                               DEFAULT_GLOBAL_SEGMENT_SIZE),
                                           "MOONCAKE_GLOBAL_SEGMENT_SIZE"),
            local_buffer_size=parse_size(env("MOONCAKE_LOCAL_BUFFER_SIZE",
                                             DEFAULT_LOCAL_BUFFER_SIZE),
                                         "MOONCAKE_LOCAL_BUFFER_SIZE"),
            protocol=env("MOONCAKE_PROTOCOL", "tcp"),
            device_name=env("MOONCAKE_DEVICE", ""),
            master_server_address=master,
            enable_ssd_offload=parse_bool(env("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=env("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=env("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=parse_bool(env("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER",
                                                     "false")),
            client_http_port=int(env("MOONCAKE_CLIENT_HTTP_PORT", "9300")),
        )

    def setup_args(self) -> tuple[Any, ...]:
        """The positional arguments of ``MooncakeDistributedStore.setup`` for this
        config (the first seven)."""
        return (self.local_hostname, self.metadata_server, self.global_segment_size,
                self.local_buffer_size, self.protocol, self.device_name or "",
                self.master_server_address)
