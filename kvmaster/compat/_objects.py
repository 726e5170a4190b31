"""Object calls of the facade: put, get, upsert, exist, size, remove, and their
batch and pointer forms (Mooncake ``store_py.cpp``: ``put``, ``put_batch``,
``put_from``, ``batch_put_from``, ``upsert*``, ``get``, ``get_batch``,
``get_into``, ``batch_get_into``, ``is_exist``, ``batch_is_exist``,
``get_size``, ``remove``, ``batch_remove``, ``remove_all``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmaster import errors as E
from kvmaster import _cuda
from kvmaster.compat._common import Facade, bad_buffers, code_of, host_memory, log, view
from kvmaster.compat._config import ReplicateConfig


def _views(ptrs: Sequence[int], sizes: Sequence[int]) -> list[memoryview]:
    """One view per (address, size); InvalidParams when the two lists differ in
    length (Mooncake checks keys, buffers and sizes have one length)."""
    if len(ptrs) != len(sizes):
        raise E.InvalidParams(f"{len(ptrs)} buffer addresses for {len(sizes)} sizes",
                              op="batch")
    return [view(p, s) for p, s in zip(ptrs, sizes)]


def _bad_single(ptrs: Sequence[Any], sizes: Sequence[Any], refuse: str = "") -> set[int]:
    """Positions whose one buffer is not host memory of this process (nothing when
    the arguments are not int lists: the call reports those as usual).  With
    ``refuse`` (a call that serves host memory only), a log line says so."""
    try:
        bad = bad_buffers([[int(p)] for p in ptrs], [[int(n)] for n in sizes])
    except (TypeError, ValueError):
        return set()
    if bad and refuse:
        log.error("%s: %d buffers are not host memory of this process (it copies with "
                  "the CPU): refused", refuse, len(bad))
    return bad


def _empty(store: Facade, parts: Sequence[Any]) -> bool:
    """Whether a set-up store is given parts that are all buffers of no bytes."""
    if store._client is None:
        return False
    try:
        return sum(memoryview(p).nbytes for p in parts) == 0
    except TypeError:
        return False  # not a buffer: the native call refuses it


class ObjectOps(Facade):
    """Writes return 0 or a negative code; reads return ``b""`` (or a negative code
    for the pointer forms) on a miss; batch calls return one result per position."""

    # --------------------------------------------------------------- writes

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._run("put", key, value, config)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """0 without a write when the parts hold no bytes (Mooncake
        ``RealClient::put_parts_internal``: "empty data" is logged, 0 returned)."""
        if _empty(self, parts):
            return 0
        return self._run("put_parts", key, *parts, config=config)

    def put_batch(self, keys: list[str], values: list[Any],
                  config: ReplicateConfig | None = None) -> int:
        try:
            return self._first_error(self.client.put_batch(keys, values, config))
        except Exception as exc:  # noqa: BLE001
            return code_of(exc)

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._run("upsert", key, value, config)

    def upsert_batch(self, keys: list[str], values: list[Any],
                     config: ReplicateConfig | None = None) -> int:
        try:
            return self._first_error(self.client.upsert_batch(keys, values, config))
        except Exception as exc:  # noqa: BLE001
            return code_of(exc)

    def _object_from(self, method: str, key: str, buffer_ptr: int, size: int,
                     config: ReplicateConfig | None) -> int:
        try:
            buf = view(buffer_ptr, size)
        except Exception as exc:  # noqa: BLE001 - a bad address or size is a code
            return code_of(exc)
        if size == 0 and self._client is not None:
            return 0  # Mooncake ``put_from_internal``: empty data is logged, 0 returned
        return self._run(method, key, buf, config)

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        """As Mooncake's; a CUDA device buffer is copied by CUDA (kvmaster/_cuda.py), a
        buffer that is neither host nor device memory refused INVALID_PARAMS."""
        bad = _bad_single([buffer_ptr], [size])
        if bad:
            return self._with_device(bad, [key], [[int(buffer_ptr)]], [[int(size)]], config,
                                     True)[0]
        return self._object_from("put_from", key, buffer_ptr, size, config)

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        """As Mooncake's, from host memory only (INVALID_PARAMS otherwise)."""
        if _bad_single([buffer_ptr], [size], "upsert_from"):
            return -600
        return self._object_from("upsert_from", key, buffer_ptr, size, config)

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """As Mooncake's; device buffers as :meth:`put_from`."""
        bad = _bad_single(buffer_ptrs, sizes)
        if bad and len(keys) == len(buffer_ptrs) == len(sizes):
            return self._with_device(bad, keys, [[int(p)] for p in buffer_ptrs],
                                     [[int(n)] for n in sizes], config, True)
        try:
            return self.client.batch_put_from(
                keys, _views(buffer_ptrs, sizes), config)
        except Exception as exc:  # noqa: BLE001
            return [code_of(exc)] * len(keys)

    def batch_upsert_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        """As Mooncake's, from host memory only (INVALID_PARAMS for every key otherwise)."""
        if _bad_single(buffer_ptrs, sizes, "batch_upsert_from"):
            return [-600] * len(keys)
        try:
            return self.client.upsert_batch(
                keys, _views(buffer_ptrs, sizes), config)
        except Exception as exc:  # noqa: BLE001
            return [code_of(exc)] * len(keys)

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

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """As Mooncake's; a CUDA device buffer is filled by CUDA (kvmaster/_cuda.py)."""
        bad = _bad_single([buffer_ptr], [size])
        if bad:
            return self._with_device(bad, [key], [[int(buffer_ptr)]], [[int(size)]], None,
                                     False)[0]
        try:
            return self.client.get_into(key, view(buffer_ptr, size))
        except Exception as exc:  # noqa: BLE001
            return code_of(exc)

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int],
                       sizes: list[int]) -> list[int]:
        """As Mooncake's; device buffers as :meth:`get_into`."""
        bad = _bad_single(buffer_ptrs, sizes)
        if bad and len(keys) == len(buffer_ptrs) == len(sizes):
            return self._with_device(bad, keys, [[int(p)] for p in buffer_ptrs],
                                     [[int(n)] for n in sizes], None, False)
        try:
            return self.client.batch_get_into(
                keys, _views(buffer_ptrs, sizes))
        except Exception as exc:  # noqa: BLE001
            return [code_of(exc)] * len(keys)

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """0 for ``size`` bytes of this process's readable and writable host memory at
        ``buffer_ptr``, or of CUDA device memory (the multi-buffer calls copy it with
        CUDA: kvmaster/_cuda.py); INVALID_PARAMS (-600) and a log line otherwise: a
        freed or made-up address, a range past its mapping, a device pointer with no
        CUDA runtime loaded.  (Mooncake registers the memory with its transfer
        engine; kvmaster needs no registration to copy host memory.)"""
        try:
            ptr, n = int(buffer_ptr), int(size)
        except (TypeError, ValueError):
            return -600
        if not host_memory(ptr, n):
            device, refused = _cuda.classify([0], [[ptr]], [[n]])
            if device:
                return 0
            log.error("register_buffer(%#x, %d): %s", ptr, n, refused[0])
            return -600
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return 0

    def is_exist(self, key: str) -> int:
        try:
            return int(self.client.is_exist(key))
        except Exception as exc:  # noqa: BLE001
            return code_of(exc)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self._per_key("batch_is_exist", len(keys), keys)

    def get_size(self, key: str) -> int:
        try:
            return self.client.get_size(key)
        except Exception as exc:  # noqa: BLE001
            return code_of(exc)

    # -------------------------------------------------------------- removal

    def remove(self, key: str, force: bool = False) -> int:
        return self._run("remove", key, force)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return self._per_key("batch_remove", len(keys), keys, force)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove the objects whose keys the pattern matches anywhere -> how many, or a
        negative code (INVALID_PARAMS for a pattern kvmaster's RE2 refuses: RE2 has
        Mooncake's ECMAScript syntax except backreferences and lookaround, and runs in
        linear time)."""
        try:
            return self.client.remove_by_regex(regex_pattern, force)
        except Exception as exc:  # noqa: BLE001
            return code_of(exc)

    def remove_all(self, force: bool = False) -> int:
        try:
            return self.client.remove_all(force)
        except Exception as exc:  # noqa: BLE001
            return code_of(exc)
