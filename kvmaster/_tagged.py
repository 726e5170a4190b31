"""Tagged writes: write starts that register their keys in KV sessions.

A tagged start (``PUT_START_WITH_KV_SESSIONS`` and its batch and upsert forms) admits
its writes as a plain start does, then walks to the sessions' homes
(``add_members``) and answers once they have answered: a write whose registration a
home refuses is undone and answered SESSION_LIMIT_EXCEEDED; one dropped with its
segment meanwhile is answered SEGMENT_NOT_FOUND.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmaster import _sessions
from kvmaster import protocol as P
from kvmaster._records import DEFERRED, START_ERRORS, StatusError, add_ref, has_ref, ref_count
from kvmaster._sessions import owner_of
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster._records import ClientView
    from kvmaster._sessions import Sessions
    from kvmaster._shard import ShardActor

__all__ = ["TaggedWrites"]


class TaggedWrites:
    """The tagged-start handlers of one shard (``ShardActor.tagged``), run by its actor;
    the writes are the shard's, the session records its :class:`Sessions`'."""

    __slots__ = ("config", "counters", "sessions", "shard", "shard_count")

    def __init__(self, shard: ShardActor, sessions: Sessions) -> None:
        self.shard = shard
        self.sessions = sessions
        self.config = shard.config
        self.counters = shard.counters
        self.shard_count = shard.shard_count

    def _tagged_start(self, client: ClientView, keys: list[bytes], sizes: list[int],
                      config: P.ReplicateConfigWire, tags: list[list[bytes]], now: float,
                      upsert: bool, single: bool, write_id: int | None = None) -> Any:
        """Admit writes (named ``write_id`` by their client, if given), register their
        sessions at the homes, then answer."""
        if not self.config.enable_kv_sessions:
            raise StatusError(Status.UNSUPPORTED, "sessions are disabled on this master")
        if len(tags) != len(keys):
            raise StatusError(Status.INVALID_PARAMS, "kv_sessions must have one list per key")
        limit = self.config.kv_session_max_per_object
        prefix = client.prefix
        stags: list[list[bytes]] = []
        over: set[int] = set()
        for i, ids in enumerate(tags):
            uniq = list(dict.fromkeys(ids))
            if len(uniq) > limit:
                if single:
                    raise StatusError(Status.SESSION_LIMIT_EXCEEDED, f"{len(uniq)} sessions for "
                                      f"one key exceed kv_session_max_per_object={limit}")
                over.add(i)
                uniq = []
            stags.append(uniq if prefix is None else [prefix + s for s in uniq])
        cks = self.shard._ckeys(client, keys)
        if any(stags):
            self.shard.walks.check_room()
        results: list[Any]
        if over or single:
            results = [Status.SESSION_LIMIT_EXCEEDED if i in over
                       else self.shard.starts.start_one(client, ck, size, config, now, upsert, write_id)
                       for i, (ck, size) in enumerate(zip(cks, sizes))]
        else:  # (the batch admitted as an untagged one is, in one pass where it can be)
            results = self.shard.starts.start_each(client, cks, sizes, config, now, upsert, write_id)
        if over:
            self.counters["session_limit_rejections"] += len(over)
        # Per key: the sessions to register (those the target does not have yet).  A
        # (key, session) pair repeated in the batch is registered by its first position.
        wanted: dict[int, list[bytes]] = {}
        # Position -> the write it started: a write dropped with a segment while the
        # sessions register is answered SEGMENT_NOT_FOUND (see ``done``).
        admitted: dict[int, Any] = {i: self.shard.writes[ck] for i, (ck, r) in
                                    enumerate(zip(cks, results)) if type(r) is list}
        pair_owner: dict[tuple[bytes, bytes], int] = {}
        adding: dict[bytes, int] = {}  # key -> sessions earlier positions register
        for i, (ck, r, sids) in enumerate(zip(cks, results, stags)):
            if not sids:
                continue
            if type(r) is not list and r != Status.OBJECT_ALREADY_EXISTS:
                continue  # rejected write: registers nothing
            target = self.shard.objects.get(ck) or self.shard.writes.get(ck)
            if target is None:
                continue
            new = [s for s in sids
                   if not has_ref(target.sessions, s) and (ck, s) not in pair_owner]
            if not new:
                continue
            if ref_count(target.sessions) + adding.get(ck, 0) + len(new) > limit:
                self.counters["session_limit_rejections"] += 1
                self.shard.writers.reject_write(client, ck, r)
                results[i] = Status.SESSION_LIMIT_EXCEEDED
                continue
            adding[ck] = adding.get(ck, 0) + len(new)
            wanted[i] = new
            for s in new:
                pair_owner[(ck, s)] = i
            if type(r) is list:
                admitted[i].settled = False  # answered (or refused) when registered
        if not wanted:
            body = self._finish_start(results, single, now)
            if type(body) is not list:
                raise StatusError(body, START_ERRORS.get(body, "session limit exceeded"))
            return body
        n = self.shard_count
        by_home: dict[int, list[tuple[int, bytes]]] = {}
        for i, sids in wanted.items():
            for s in sids:
                by_home.setdefault(owner_of(s, n), []).append((i, s))
        homes = list(by_home)
        requests = [(h, "add_members", ([(s, cks[i]) for i, s in by_home[h]],)) for h in homes]
        reply = self.shard._deferred_reply()

        def done(answers: dict[int, list[Any]]) -> None:
            accepted: dict[int, list[bytes]] = {}
            refused: set[int] = set()
            for pos, h in enumerate(homes):
                for (i, s), code in zip(by_home[h], answers[pos]):
                    if code == 0:
                        accepted.setdefault(i, []).append(s)
                    else:
                        refused.add(i)
            for i in wanted:
                ck = cks[i]
                ok = accepted.get(i, [])
                target = self.shard.objects.get(ck) or self.shard.writes.get(ck)
                dropped = self.shard.writers.dropped_meanwhile(ck, admitted.get(i))
                if i in refused or target is None or dropped:
                    for s in ok:
                        self.sessions.removed_out.setdefault(owner_of(s, n), []).append((s, ck))
                    if i in refused:
                        if not dropped:  # (else the key's write is another one now)
                            self.shard.writers.reject_write(client, ck, results[i])
                        results[i] = Status.SESSION_LIMIT_EXCEEDED
                    elif type(results[i]) is list:
                        # The write was dropped meanwhile (its segment went): its space
                        # must not be written.
                        results[i] = Status.SEGMENT_NOT_FOUND
                    continue
                if type(results[i]) is list:
                    pw = self.shard.writes.get(ck)
                    if pw is not None:
                        pw.settled = True
                for s in ok:
                    target.sessions = add_ref(target.sessions, s)
            for i, mine in admitted.items():  # positions that registered nothing
                if i not in wanted and type(results[i]) is list \
                        and self.shard.writers.dropped_meanwhile(cks[i], mine):
                    results[i] = Status.SEGMENT_NOT_FOUND
            self.sessions.flush_removed()
            # (the sessions' clock: the fuzz harness replaces it)
            body = self._finish_start(results, single, _sessions._now())
            if type(body) is not list:
                reply(START_ERRORS.get(body, "session limit exceeded"), body)
            else:
                reply(body)

        self.shard.walks.start(requests, done)
        return DEFERRED

    def _finish_start(self, results: list[Any], single: bool, now: float) -> Any:
        """Batch: the per-key results.  Single: the replicas, or the failing status (int)."""
        self.shard.eviction.check_watermark(now)
        return results[0] if single else results

    def handle_put_start_with_kv_sessions(self, client: ClientView, msg: Any,
                                          now: float) -> Any:
        return self._tagged_start(client, [msg.key], [msg.size], msg.config, [msg.sessions],
                                  now, False, True, msg.write_id)

    def handle_upsert_start_with_kv_sessions(self, client: ClientView, msg: Any,
                                             now: float) -> Any:
        return self._tagged_start(client, [msg.key], [msg.size], msg.config, [msg.sessions],
                                  now, True, True, msg.write_id)

    def _tagged_batch(self, client: ClientView, msg: Any, now: float,
                      upsert: bool) -> Any:
        if len(msg.keys) != len(msg.sizes):
            raise StatusError(Status.INVALID_PARAMS, "keys and sizes differ in length")
        return self._tagged_start(client, msg.keys, msg.sizes, msg.config, msg.kv_sessions, now,
                                  upsert, False, msg.write_id)

    def handle_batch_put_start_with_kv_sessions(self, client: ClientView, msg: Any,
                                                now: float) -> Any:
        return self._tagged_batch(client, msg, now, False)

    def handle_batch_upsert_start_with_kv_sessions(self, client: ClientView,
                                                   msg: Any, now: float) -> Any:
        return self._tagged_batch(client, msg, now, True)
