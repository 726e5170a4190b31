"""Batches whose keys may belong to any shard (``ANY_SHARD_OPS``, in-process masters
with ``any_shard``): the receiving shard handles its own part and forwards each other
shard's part to it as a walk step (``batch_part``), then merges the results by
position into one reply.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvmaster import protocol as P
from kvmaster._records import DEFERRED, StatusError
from kvmaster._shard_oplog import START_OPS
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster._records import ClientView
    from kvmaster._shard import ShardActor

log = logging.getLogger("kvmaster._shard")  # (the shard's log, as before the move)

__all__ = ["PER_KEY_FIELDS", "AnyShardBatches", "per_key"]

#: The per-key lists of a batch request, split with its keys.
PER_KEY_FIELDS = ("keys", "sizes", "checksums")
_GET_OP = P.Op.BATCH_GET_REPLICA_LIST.value


def per_key(op: bytes, body: Any) -> Any:
    """A batch handler's result in the per-key form (a columnar tuple converted)."""
    if type(body) is tuple:
        return P.replica_items(body, op == _GET_OP)
    return body


class AnyShardBatches:
    """The any-shard batch splitting of one shard (``ShardActor.any_shard_batches``),
    run by its actor."""

    __slots__ = ("shard",)

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard

    def handle_owned(self, handler: Callable[..., Any], client: ClientView, msg: Any,
                     now: float) -> Any:
        """Run a batch handler on keys known to be this shard's (``_ckeys`` skips
        hashing them again)."""
        shard = self.shard
        shard._owned_keys = msg.keys
        try:
            return handler(client, msg, now)
        finally:
            shard._owned_keys = None

    def part(self, op: bytes, client: ClientView, msg: Any, now: float,
             reply_shard: int, wid: int, pos: int) -> None:
        """Internal (``batch_part``): this shard's part of an any-shard batch; answers
        the walk with the per-key results, or a status for the whole part."""
        shard = self.shard
        oplog = shard.log
        if oplog is not None and op in START_OPS and oplog.park(
                ("batch_part", (op, client, msg, now, reply_shard, wid, pos), None), id(msg),
                op, client, msg, time.monotonic()):
            return  # (handled again once the held space is given back)
        try:
            result: Any = per_key(op, self.handle_owned(shard.handlers[op], client, msg, now))
        except StatusError as exc:
            result = int(exc.status)
        except Exception:  # noqa: BLE001 - a bug must not kill the shard or the walk
            log.exception("[shard %d] batch part op=%s failed", shard.index, op.hex())
            result = int(Status.INTERNAL_ERROR)
        shard.walks.answer(reply_shard, wid, pos, result)

    def run(self, op: bytes, handler: Callable[..., Any], client: ClientView,
                         msg: Any, now: float) -> Any:
        """A batch whose keys may belong to any shard: this shard's part is handled
        here, every other shard's part is posted to it (a walk), and one reply merges
        the results by position.  This shard's part runs first: if it is refused as a
        whole, so is the request (nothing has been forwarded yet).  A forwarded part
        refused as a whole answers its status at each of its positions.  Raises
        INVALID_PARAMS when per-key lists differ in length or exceed ``max_batch``."""
        keys = msg.keys
        n = self.shard.shard_count
        if n == 1:
            return self.handle_owned(handler, client, msg, now)
        owner = P.shards_of(keys, client.seed, n)
        mine = self.shard.index
        if owner.count(mine) == len(owner):
            return self.handle_owned(handler, client, msg, now)
        # (A per-key field left out is None.)
        listed = [f for f in PER_KEY_FIELDS if type(getattr(msg, f, None)) is list]
        for f in listed[1:]:
            if len(getattr(msg, f)) != len(keys):
                raise StatusError(Status.INVALID_PARAMS, f"{f} and keys differ in length")
        self.shard._check_batch_len(keys)
        self.shard.walks.check_room()
        parts: dict[int, tuple[list[int], Any]] = {}
        fields = [(f, getattr(msg, f)) for f in listed]
        for s, idx in enumerate(P.positions_by_shard(owner, n)):
            if idx:
                sub = {f: [vals[i] for i in idx] for f, vals in fields}
                parts[s] = (idx, dataclasses.replace(msg, **sub))
        out: list[Any] = [None] * len(keys)
        if mine in parts:
            idx, sub = parts.pop(mine)
            for i, r in zip(idx, per_key(op, self.handle_owned(handler, client, sub, now))):
                out[i] = r
        remote = list(parts)
        respond = self.shard._deferred_reply()

        def done(results: dict[int, Any]) -> None:
            for pos, s in enumerate(remote):
                idx = parts[s][0]
                body = results[pos]
                if type(body) is int:
                    for i in idx:
                        out[i] = body
                else:
                    for i, r in zip(idx, body):
                        out[i] = r
            respond(out)

        self.shard.walks.start([(s, "batch_part", (op, client, parts[s][1], now)) for s in remote], done)
        return DEFERRED

    def own_positions(self, op: bytes, client: ClientView,
                       msg: Any) -> Callable[[], list[int]] | None:
        """For a batch that may hold any shard's keys (in one process): a function giving
        the positions of this shard's keys; None for any other request."""
        n = self.shard.shard_count
        if not (self.shard.any_shard and n > 1 and op in P.ANY_SHARD_OPS):
            return None
        mine = self.shard.index
        return lambda: [i for i, o in enumerate(P.shards_of(msg.keys, client.seed, n))
                        if o == mine]
