"""A stored tensor to and from a safetensors file (Mooncake ``store_py.cpp``
``save_tensor_to_safetensor``, ``load_tensor_from_safetensor``), through the
``safetensors`` package, imported when called."""

from __future__ import annotations

from typing import Any

from kvmaster.compat._common import Facade, log

#: Mooncake's codes (``mooncake-store/include/types.h`` ``ErrorCode``).
INVALID_PARAMS = -600
FILE_NOT_FOUND = -1100


class SafetensorOps(Facade):
    def save_tensor_to_safetensor(self, key: str, file_name: str | None = None) -> int:
        """Write the tensor at ``key`` to ``file_name`` (default: the key) as a
        safetensors file whose one entry is named ``key`` -> 0; FILE_NOT_FOUND (-1100)
        when the key holds no tensor, INVALID_PARAMS (-600) when the file cannot be
        written or safetensors is not installed."""
        tensor = self.get_tensor(key)  # type: ignore[attr-defined]
        if tensor is None:
            log.error("save_tensor_to_safetensor: no tensor at key %r", key)
            return FILE_NOT_FOUND
        try:
            from safetensors.torch import save_file

            save_file({key: tensor.contiguous()}, key if file_name is None else file_name)
        except Exception as exc:  # noqa: BLE001 - Mooncake answers a code
            log.error("save_tensor_to_safetensor failed: %s", exc)
            return INVALID_PARAMS
        return 0

    def load_tensor_from_safetensor(self, key: str | None = None, file_name: str = "") -> Any:
        """Read a safetensors file and store one of its tensors at ``key`` (default:
        the file name) -> the tensor, or None.  The entry named ``key`` is taken, or
        the first entry (logged) when there is none of that name."""
        try:
            from safetensors.torch import load_file

            loaded = load_file(file_name)
        except Exception as exc:  # noqa: BLE001
            log.error("load_tensor_from_safetensor(%r) failed: %s", file_name, exc)
            return None
        if not loaded:
            log.error("load_tensor_from_safetensor: no tensors in %r", file_name)
            return None
        target = file_name if key is None else key
        entry = target if target in loaded else next(iter(loaded))
        if key is not None and entry != target:
            log.warning("load_tensor_from_safetensor: %r not in %r; storing its first entry %r",
                        target, file_name, entry)
        tensor = loaded[entry]
        rc = self.put_tensor(target, tensor)  # type: ignore[attr-defined]
        if rc != 0:
            log.error("load_tensor_from_safetensor: storing %r failed rc=%d", target, rc)
            return None
        return tensor
