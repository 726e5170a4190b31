"""Mooncake-compatible facade: switch an engine's integration by changing its import.

``from kvmaster.compat import MooncakeDistributedStore, ReplicateConfig, SoftPinAction``
gives the method names, argument order and return conventions of
``mooncake.store`` (``mooncake-integration/store/store_py.cpp``): calls return
0 or a negative error code instead of raising, ``get`` returns ``b""`` on a
miss, ``is_exist`` returns 1/0, batch calls return one code per position, and
``setup`` takes Mooncake's positional arguments, the last being the master
address ``host:port``.  Pointer-based calls (``get_into``, ``put_from``, ...)
take a raw address and a size, as Mooncake's do.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

from kvmaster import errors as E
from kvmaster._core import ClientConfig, KvSessionInfo, KvSessionPage
from kvmaster._core import ReplicateConfig as _NativeConfig
from kvmaster.client import Client
from kvmaster.protocol import SoftPinAction, Status

__all__ = ["BufferHandle", "KvSessionInfo", "KvSessionPage", "MooncakeDistributedStore",
           "ReplicateConfig", "SoftPinAction"]

log = logging.getLogger(__name__)


class ReplicateConfig(_NativeConfig):
    """Mooncake's ``ReplicateConfig`` (mutable, default-constructed, attributes set after)."""

    def __init__(self) -> None:
        super().__init__()
        self.preferred_segment = ""
        self.kv_sessions = None

    def to_wire(self) -> list[Any]:
        pref = list(self.preferred_segments or ())
        if self.preferred_segment:
            pref.insert(0, self.preferred_segment)
        return [self.replica_num, self.with_hard_pin, int(self.soft_pin_action),
                self.soft_pin_ttl_ms, pref]


class BufferHandle:
    """Result of ``get_buffer``: a private copy of the object's bytes."""

    def __init__(self, data: bytearray) -> None:
        self._data = data
        self._c = (ctypes.c_char * len(data)).from_buffer(data) if data else None

    def ptr(self) -> int:
        return ctypes.addressof(self._c) if self._c is not None else 0

    def size(self) -> int:
        return len(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self._data)

    def tobytes(self) -> bytes:
        return bytes(self._data)


def _view(ptr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def _code(exc: BaseException) -> int:
    if isinstance(exc, E.KVMasterError):
        return int(exc.code)
    return int(Status.INTERNAL_ERROR)


class MooncakeDistributedStore:
    """Drop-in for ``mooncake.store.MooncakeDistributedStore`` backed by kvmaster."""

    def __init__(self) -> None:
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        """The native client (raises its own exceptions)."""
        if self._client is None:
            raise RuntimeError("setup() has not succeeded")
        return self._client

    def setup(self, local_hostname: Any = "", metadata_server: str = "P2PHANDSHAKE",
              global_segment_size: int = 16 << 20, local_buffer_size: int = 16 << 20,
              protocol: str = "shm", rdma_devices: str = "",
              master_server_addr: str = "127.0.0.1:50051", engine: object = None,
              *args: Any, tenant_id: str = "default", **kwargs: Any) -> int:
        """Mooncake's positional setup, or a dict as the only argument.

        ``local_hostname`` (an address for Mooncake's transfer engine, often
        "localhost"), ``metadata_server``, ``local_buffer_size``, ``protocol`` and
        ``rdma_devices`` are accepted and ignored: the host identity that decides
        whether a segment is mapped directly is the machine's hostname.  Returns 0
        or a negative code.
        """
        if isinstance(local_hostname, dict):
            d = local_hostname
            local_hostname = d.get("local_hostname", "")
            global_segment_size = int(d.get("global_segment_size", global_segment_size))
            master_server_addr = d.get("master_server_addr", d.get("master_server_address",
                                                                   master_server_addr))
            tenant_id = d.get("tenant_id", tenant_id)
        client = Client(ClientConfig(master_server_addr=master_server_addr,
                                     global_segment_size=int(global_segment_size),
                                     tenant=tenant_id))
        try:
            client.setup()
        except Exception as exc:  # noqa: BLE001 - Mooncake reports failures as codes
            log.error("setup failed: %s", exc)
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass
            return _code(exc)
        self._client = client
        return 0

    def close(self) -> int:
        if self._client is not None:
            self._client.close()
            self._client = None
        return 0

    # ------------------------------------------------------------- helpers

    def _run(self, method: str, *args: Any, **kw: Any) -> int:
        try:
            getattr(self.client, method)(*args, **kw)
            return 0
        except Exception as exc:  # noqa: BLE001
            return _code(exc)

    @staticmethod
    def _first_error(codes: list[int]) -> int:
        return next((c for c in codes if c < 0), 0)

    # --------------------------------------------------------------- writes

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._run("put", key, value, config)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._run("put_parts", key, *parts, config=config)

    def put_batch(self, keys: list[str], values: list[Any],
                  config: ReplicateConfig | None = None) -> int:
        try:
            return self._first_error(self.client.put_batch(keys, values, config))
        except Exception as exc:  # noqa: BLE001
            return _code(exc)

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._run("upsert", key, value, config)

    def upsert_batch(self, keys: list[str], values: list[Any],
                     config: ReplicateConfig | None = None) -> int:
        try:
            return self._first_error(self.client.upsert_batch(keys, values, config))
        except Exception as exc:  # noqa: BLE001
            return _code(exc)

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        return self._run("put_from", key, _view(buffer_ptr, size), config)

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        return self._run("upsert_from", key, _view(buffer_ptr, size), config)

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        try:
            return self.client.batch_put_from(
                keys, [_view(p, s) for p, s in zip(buffer_ptrs, sizes)], config)
        except Exception as exc:  # noqa: BLE001
            return [_code(exc)] * len(keys)

    def batch_upsert_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        try:
            return self.client.upsert_batch(
                keys, [_view(p, s) for p, s in zip(buffer_ptrs, sizes)], config)
        except Exception as exc:  # noqa: BLE001
            return [_code(exc)] * len(keys)

    # ---------------------------------------------------------------- reads

    def get(self, key: str) -> bytes:
        try:
            return self.client.get(key)
        except Exception:  # noqa: BLE001 - Mooncake returns empty bytes on any failure
            return b""

    def get_batch(self, keys: list[str]) -> list[bytes]:
        try:
            return [v if v is not None else b"" for v in self.client.get_batch(keys)]
        except Exception:  # noqa: BLE001
            return [b""] * len(keys)

    def get_buffer(self, key: str) -> BufferHandle | None:
        try:
            return BufferHandle(bytearray(self.client.get_buffer(key)))
        except Exception:  # noqa: BLE001
            return None

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        try:
            return self.client.get_into(key, _view(buffer_ptr, size))
        except Exception as exc:  # noqa: BLE001
            return _code(exc)

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int],
                       sizes: list[int]) -> list[int]:
        try:
            return self.client.batch_get_into(
                keys, [_view(p, s) for p, s in zip(buffer_ptrs, sizes)])
        except Exception as exc:  # noqa: BLE001
            return [_code(exc)] * len(keys)

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return 0

    def is_exist(self, key: str) -> int:
        try:
            return int(self.client.is_exist(key))
        except Exception as exc:  # noqa: BLE001
            return _code(exc)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        try:
            return self.client.batch_is_exist(keys)
        except Exception as exc:  # noqa: BLE001
            return [_code(exc)] * len(keys)

    def get_size(self, key: str) -> int:
        try:
            return self.client.get_size(key)
        except Exception as exc:  # noqa: BLE001
            return _code(exc)

    # -------------------------------------------------------------- removal

    def remove(self, key: str, force: bool = False) -> int:
        return self._run("remove", key, force)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        try:
            return self.client.batch_remove(keys, force)
        except Exception as exc:  # noqa: BLE001
            return [_code(exc)] * len(keys)

    def remove_all(self, force: bool = False) -> int:
        try:
            return self.client.remove_all(force)
        except Exception as exc:  # noqa: BLE001
            return _code(exc)

    # ------------------------------------------------------------- sessions
    # Control calls return 0 and raise RuntimeError naming the code on failure,
    # as Mooncake's bindings do; attach returns one code per key.

    def _control(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.client, method)(*args)
        except E.KVMasterError as exc:
            raise RuntimeError(f"{Status(exc.code).name if exc.code in Status._value2member_map_ else exc.code} "
                               f"({exc.code}): {exc.args[0]}") from exc

    def attach_kv_session(self, session_id: str, keys: list[str]) -> list[int]:
        try:
            return self.client.attach_kv_session(session_id, keys)
        except Exception as exc:  # noqa: BLE001
            return [_code(exc)] * len(keys)

    def pin_kv_session(self, session_id: str) -> int:
        self._control("pin_kv_session", session_id)
        return 0

    def unpin_kv_session(self, session_id: str) -> int:
        self._control("unpin_kv_session", session_id)
        return 0

    def update_kv_session(self, session_id: str, keep_keys: list[str]) -> int:
        self._control("update_kv_session", session_id, keep_keys)
        return 0

    def close_kv_session(self, session_id: str) -> int:
        self._control("close_kv_session", session_id)
        return 0

    def get_kv_session(self, session_id: str) -> KvSessionInfo:
        return self._control("get_kv_session", session_id)

    def list_kv_session_keys(self, session_id: str, cursor: str = "",
                             limit: int = 1024) -> KvSessionPage:
        return self._control("list_kv_session_keys", session_id, cursor, limit)
