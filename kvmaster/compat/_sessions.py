"""KV-session calls of the facade (Mooncake RFC #4518; ``docs/source/design/store/
session-kv.md``).  Control calls return 0 and raise RuntimeError naming the code
on failure, as Mooncake's bindings do; attach returns one code per key."""

from __future__ import annotations

from typing import Any

from kvmaster import errors as E
from kvmaster._core import KvSessionInfo, KvSessionPage
from kvmaster.compat._common import Facade, code_of
from kvmaster.protocol import Status


class SessionOps(Facade):
    def _control(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.client, method)(*args)
        except E.KVMasterError as exc:
            name = Status(exc.code).name if exc.code in Status._value2member_map_ else exc.code
            raise RuntimeError(f"{name} ({exc.code}): {exc.args[0]}") from exc

    def attach_kv_session(self, session_id: str, keys: list[str]) -> list[int]:
        try:
            return self.client.attach_kv_session(session_id, keys)
        except Exception as exc:  # noqa: BLE001
            return [code_of(exc)] * len(keys)

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
