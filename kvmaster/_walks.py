"""Cross-shard walks: one shard's operations that span other shards.

A walk posts one message per ``(shard, method, args)`` request to the other shards'
inboxes, each with ``(reply_shard, walk id, position)`` appended; each shard answers
with a ``walk_reply`` message to the initiator, and the walk's ``done`` runs once every
answer is in.  No actor waits while holding another's state: each step is one message
handled to completion.  Messages between two actors arrive in the order sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvmaster._records import StatusError
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster._shard import ShardActor

__all__ = ["MAX_OPEN_WALKS", "Walk", "Walks"]

#: Most walks one shard keeps open; beyond it requests that would walk answer BUSY.
MAX_OPEN_WALKS = 4096


class Walk:
    """An open cross-shard operation: answers still expected and what to do at the end."""

    __slots__ = ("done", "pending", "results")

    def __init__(self, pending: int, done: Callable[[dict[int, list[Any]]], None]) -> None:
        self.pending = pending
        self.results: dict[int, list[Any]] = {}
        self.done = done


class Walks:
    """The walks one shard has opened (``open``: walk id -> :class:`Walk`).  Run by
    the shard's actor, like all of its state.  ``before`` runs ahead of each walk's
    posts (the shard sends its queued session-removal notices first, so that a home
    never sees a registration before the removal that preceded it)."""

    __slots__ = ("_seq", "before", "open", "shard")

    def __init__(self, shard: ShardActor, before: Callable[[], None]) -> None:
        self.shard = shard
        self.before = before
        self.open: dict[int, Walk] = {}
        self._seq = 0

    def start(self, requests: list[tuple[int, str, tuple[Any, ...]]],
              done: Callable[[dict[int, list[Any]]], None]) -> None:
        """Post ``(shard, method, args)`` messages; ``done(results)`` runs when all
        answered.  ``results`` maps request position -> the answer."""
        self.before()
        self._seq += 1
        wid = self._seq
        if not requests:
            done({})
            return
        self.open[wid] = Walk(len(requests), done)
        shard = self.shard
        shard.counters["session_walk_pages"] += len(requests)
        peers, index = shard.peers, shard.index
        for pos, (target, name, args) in enumerate(requests):
            peers[target].post(name, (*args, index, wid, pos))

    def reply(self, wid: int, pos: int, result: Any) -> None:
        """One answer to walk ``wid`` (the ``walk_reply`` message)."""
        walk = self.open.get(wid)
        if walk is None:
            return
        walk.results[pos] = result
        walk.pending -= 1
        if walk.pending == 0:
            del self.open[wid]
            walk.done(walk.results)

    def answer(self, reply_shard: int, wid: int, pos: int, result: Any) -> None:
        """Answer the walk that asked this shard (at position ``pos``)."""
        self.shard.peers[reply_shard].post("walk_reply", (wid, pos, result))

    def __len__(self) -> int:
        return len(self.open)

    def full(self) -> bool:
        return len(self.open) >= MAX_OPEN_WALKS

    def check_room(self) -> None:
        """Raise BUSY when this shard has as many walks open as it keeps."""
        if len(self.open) >= MAX_OPEN_WALKS:
            raise StatusError(Status.BUSY, "too many session operations in progress")
