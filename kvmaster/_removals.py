"""Removals of one shard: REMOVE (single and batch), REMOVE_ALL and REMOVE_BY_REGEX.

An object with a read lease is removed only with ``force``, and its space is freed
when the lease ends; an object being written is not removed (REPLICA_IS_NOT_READY).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from kvmaster._alloc import ALIGN
from kvmaster._records import FreeRuns, StatusError
from kvmaster._tenancy import OBJECT_OVERHEAD, CountedObjects
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster._records import ClientView
    from kvmaster._shard import ShardActor

__all__ = ["REGEX_CACHE_MAX", "Removals"]


class Removals:
    """The removal handlers of one shard (``ShardActor.removals``), run by its actor;
    the objects are the shard's."""

    __slots__ = ("shard",)

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard

    def remove_one(self, ck: bytes, force: bool, now: float) -> int:
        obj = self.shard.objects.get(ck)
        if obj is None:
            if ck in self.shard.writes:
                return Status.REPLICA_IS_NOT_READY
            if self.shard.adoption is not None and self.shard.adoption.forget(ck):
                if self.shard.log is not None:
                    self.shard.log.removed(ck)  # (taken over from the op log, not back yet)
                return 0
            return Status.OBJECT_NOT_FOUND
        if obj.lease > now and not force:
            return Status.OBJECT_HAS_LEASE
        del self.shard.objects[ck]
        if self.shard.log is not None and obj.lease > now:
            self.shard.log.removed(ck)  # (its space is freed when the lease ends)
        self.shard.placement.free_object(obj, now)
        self.shard.sessions.unregister(ck, obj.sessions)
        return 0

    def handle_remove(self, client: ClientView, msg: Any, now: float) -> int:
        r = self.remove_one(self.shard._ckey(client, msg.key), msg.force, now)
        if r:
            st = Status(r)  # (remove_one's nonzero answers are Status members already)
            raise StatusError(st, _REMOVE_ERRORS[st])
        return 0

    def handle_batch_remove(self, client: ClientView, msg: Any, now: float) -> list[int]:
        """:meth:`remove_one` per key, inlined for an object with one replica, whose
        range is freed with the ranges next to it (:class:`FreeRuns`)."""
        objects = self.shard.objects
        get = objects.get
        force = msg.force
        out: list[int] = []
        append = out.append
        runs = FreeRuns(self.shard)
        free = runs.add
        try:
            # Counted maps (tenant quotas): the plain delete, the bytes dropped once.
            counted = type(objects) is CountedObjects
            ddel = dict.__delitem__
            gone = 0
            for ck in self.shard._ckeys(client, msg.keys):
                obj = get(ck)
                if obj is None or obj.more or (not force and obj.lease > now):
                    append(self.remove_one(ck, force, now))
                    continue
                if counted:
                    ddel(objects, ck)
                    gone += ((obj.size + ALIGN - 1) & ~(ALIGN - 1)) + len(ck) + OBJECT_OVERHEAD
                else:
                    del objects[ck]
                if obj.lease > now and self.shard.log is not None:
                    self.shard.log.removed(ck)
                free(obj.seg, obj.off, obj.size, obj.lease if obj.lease > now else 0.0)
                if obj.sessions is not None:
                    self.shard.sessions.unregister(ck, obj.sessions)
                append(0)
        finally:
            runs.flush()
            if counted and gone:
                cast(CountedObjects, objects).released(client.prefix or b"", gone)
        return out

    def handle_remove_all(self, client: ClientView, msg: Any, now: float) -> int:
        prefix = client.prefix
        if prefix is None:
            mine = [ck for ck in self.shard.objects if b"\x00" not in ck]
        else:
            mine = [ck for ck in self.shard.objects if ck.startswith(prefix)]
        return sum(1 for ck in mine if self.remove_one(ck, msg.force, now) == 0)

    def handle_remove_by_regex(self, client: ClientView, msg: Any, now: float) -> int:
        """:meth:`handle_remove_all` for the keys the RE2 pattern matches anywhere (a
        search: Mooncake ``MasterService::RemoveByRegex``).  RE2 runs in time linear
        in the key, so no pattern can stall the shard beyond one pass over the
        tenant's keys."""
        pattern = _compiled_regex(msg.pattern)
        search = pattern.search
        prefix = client.prefix
        if prefix is None:
            mine = [ck for ck in self.shard.objects if b"\x00" not in ck and search(ck)]
        else:
            cut = len(prefix)
            mine = [ck for ck in self.shard.objects if ck.startswith(prefix) and search(ck[cut:])]
        return sum(1 for ck in mine if self.remove_one(ck, msg.force, now) == 0)


_REGEX_CACHE: dict[str, Any] = {}
#: Compiled patterns kept per process (the oldest goes beyond it).
REGEX_CACHE_MAX = 64


def _compiled_regex(pattern: str) -> Any:
    """The RE2 program of ``pattern`` (bytes mode, so keys are matched as the bytes
    they are); StatusError INVALID_PARAMS when RE2 refuses it."""
    got = _REGEX_CACHE.get(pattern)
    if got is None:
        import re2  # type: ignore[import-untyped]  # (RE2's binding ships no type hints)

        try:
            got = re2.compile(pattern.encode())
        except re2.error as exc:
            raise StatusError(Status.INVALID_PARAMS,
                              f"invalid regex (RE2 syntax, no backreferences or "
                              f"lookaround): {exc}") from None
        if len(_REGEX_CACHE) >= REGEX_CACHE_MAX:
            del _REGEX_CACHE[next(iter(_REGEX_CACHE))]
        _REGEX_CACHE[pattern] = got
    return got

_REMOVE_ERRORS = {
    Status.OBJECT_NOT_FOUND: "object not found",
    Status.OBJECT_HAS_LEASE: "object has a read lease (use force)",
    Status.REPLICA_IS_NOT_READY: "object is being written",
}
