"""Write operations: ``put``, ``upsert`` and their batch forms, one start/copy/end
protocol for all (:class:`WriteOps`; Mooncake's ``Put``/``BatchPut``, real_client.cpp).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvmaster import _fence
from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.dataplane import DataPlane, _copy_blocks, _fenced_write, _fenced_write_each
from kvmaster._client.records import (
    _LOST_WRITE,
    _TAGGED,
    NoWait,
    OpGen,
    ReplicateConfig,
    Tolerant,
    _at,
    _b,
    _byte_values,
    _columns_replicas,
    _group_ids_wire,
    _Mappings,
    _monotonic,
    _session_tags_wire,
    _write_failure,
    operation,
    unanswered,
)
from kvmaster._fence import WriteFence
from kvmaster._integrity import OVERLAP_MIN, checksum_later, settle
from kvmaster._integrity import checksum as _checksum
from kvmaster._segment import RAW_COPY_MIN
from kvmaster.protocol import Op, Status
from kvmaster.transfer import TransferError

log = logging.getLogger(__name__)


class WriteOps(DataPlane):
    """``put``/``upsert`` of one key and of a batch (start, copy, end; revoke on failure)."""

    # ----------------------------------------------------------------- puts

    def _put(self, op_start: Op, key: str, parts: Sequence[Any],
             config: ReplicateConfig | None) -> OpGen:
        """PUT_START, copy the bytes, PUT_END.

        A write the master admitted is not left pending by a live client (a
        pending write makes other puts of the key answer success for
        ``--put-start-discard-timeout`` while nothing is readable): when a later
        step fails (the segment lookup, the copy, or an end that got no answer:
        ``Timeout``, ``Busy`` to the end, ``ConnectionLost``, a signal handler's
        exception; or the call's deadline passed before the end, which is then not
        sent), or the start itself got no answer (it may be applied later), the
        client sends PUT_REVOKE naming the write (the ``write_id`` its start gave)
        and raises the original error.

        The revoke is not waited for (:class:`NoWait`), so the call still ends at
        its deadline; waiting would not help either: the master takes a
        connection's requests to a shard in order, so the revoke is applied before
        anything this client sends to that shard afterwards (a retry of the put
        included), and a stopped master applies it when it resumes.  It cannot
        remove a stored object (an end applied although its reply was lost),
        another client's write, or a later write of the key by this client (another
        thread's or task's, started once this one had ended).  A revoke the master
        refuses BUSY (the flood that made the end fail, say) is sent again (see
        :class:`NoWait`), and so is one that could not be queued or whose
        connection was replaced before its reply came; other replies are skipped
        like late ones.  One that a closed client could not send, or still refused
        after PARTING_RETRY_S, leaves the write to the discard timeout.  Not
        revoked: a write whose bytes
        went to a transfer service that failed (they may still land; the master
        frees the range after its timeouts).
        """
        parts = _byte_values(parts, op_start.name)
        size = sum(map(len, parts))
        if size <= 0:
            raise E.InvalidParams("value must not be empty", op=op_start.name)
        bkey = _b(key)
        route = self._route(bkey)
        fields: list[Any] = [bkey, size, config.to_wire() if config is not None else None]
        tags = config.kv_sessions if config is not None else None
        if tags:
            if len(tags) != 1:
                raise E.InvalidParams("kv_sessions must hold exactly one list for a single key",
                                      op=op_start.name)
            op_start = _TAGGED[op_start]
            fields.append([_b(t) for t in tags[0]])
        else:
            gids = _group_ids_wire(config, 1, op_start.name)
            if gids is not None or _session_tags_wire(config, 1, op_start.name) is not None:
                # a grouped or session-tagged write: a batch of one (only batches carry them)
                (st,) = yield from self._write_batch(
                    Op.BATCH_UPSERT_START if op_start is Op.UPSERT_START
                    else Op.BATCH_PUT_START, [key],
                    [parts[0] if len(parts) == 1 else b"".join(parts)], config, None, gids)
                if st < 0:
                    raise E.error_for(st, f"{op_start.name} of {key!r} failed", op=op_start.name)
                return None
        write_id = next(self._write_ids)
        fields.append(write_id)
        revoke = NoWait([(Op.PUT_REVOKE.value, route, [bkey, write_id])])
        sent_at = _monotonic()
        try:
            (replicas,) = yield [(op_start.value, route, fields)]
        except E.ObjectAlreadyExists:
            return None  # write-once: the object is (being) stored already
        except GeneratorExit:
            raise
        except BaseException as exc:
            if unanswered(exc, 1):
                yield revoke  # the start may still be applied (its reply was lost)
            raise
        # From here on the write is pending on the master: whatever fails, it is
        # revoked (see the docstring) unless its bytes may still be landing.
        started_on = self._master_instance
        fence = WriteFence(self, sent_at, op_start.name)
        hashing: tuple[Callable[[], int], ...] = ()
        value_sum = None
        try:
            yield from self._know(replicas)
            if self._master_instance != started_on:
                raise self._write_lost(op_start)  # its ranges may be another key's now
            if self.config.write_checksums:  # (hashed while copied)
                hashing = (checksum_later(parts),)
            self._write(replicas, parts, fence, fence.limit())
            if hashing:
                value_sum = hashing[0]()
        except TransferError as exc:
            settle(hashing)
            # Bytes already handed to the network may still land after a give-up, so
            # the range is not revoked (and reused) at once: the master frees it after
            # its put-start discard/release timeouts.
            raise E.KVMasterError(f"write of {key!r} failed: {exc}",
                                  code=Status.TRANSFER_FAIL, op=op_start.name) from exc
        except GeneratorExit:
            settle(hashing)
            raise
        except BaseException as exc:
            settle(hashing)  # (before the call returns: it reads the caller's value)
            yield revoke
            if isinstance(exc, FileNotFoundError):  # (see _write_failure)
                raise E.SegmentNotFound(f"write of {key!r} lost with its segment: {exc}",
                                        op=op_start.name) from exc
            if isinstance(exc, (OSError, ValueError)):
                raise E.KVMasterError(f"write of {key!r} failed: {exc}",
                                      code=Status.TRANSFER_FAIL, op=op_start.name) from exc
            raise
        end = [bkey, write_id, value_sum] if self.config.write_checksums \
            else [bkey, write_id]
        try:
            yield [(Op.PUT_END.value, route, end)]
        except GeneratorExit:
            raise
        except BaseException as exc:
            if self._master_instance != started_on and isinstance(
                    exc, (E.ObjectNotFound, E.SegmentNotFound)):
                raise self._write_lost(op_start) from None
            if unanswered(exc, 1):
                yield revoke
            raise
        return None

    def _write_lost(self, op: Op) -> E.ConnectionLost:
        """A put whose master process changed after its start (an HA failover or a
        restart): before the copy, its bytes are not written (the new master may have
        given those ranges to other keys); after it, the end was sent again to the new
        master, which never saw the write.  Nothing is stored."""
        return E.ConnectionLost("the master changed between the start and the end of this "
                                "write (failover or restart): nothing was stored; write again",
                                op=op.name, endpoint=self.endpoint)

    @operation
    def put(self, key: str, value: bytes | bytearray | memoryview,
            config: ReplicateConfig | None = None) -> OpGen[None]:
        """Store ``value`` under ``key`` unless it exists (write-once; a second put
        succeeds without replacing).  Raises NoAvailableHandle, InvalidParams."""
        return (yield from self._put(Op.PUT_START, key, (value,), config))

    @operation
    def put_parts(self, key: str, *parts: bytes | bytearray | memoryview,
                  config: ReplicateConfig | None = None) -> OpGen[None]:
        """Like :meth:`put` with the value given as consecutive parts (no join copy)."""
        return (yield from self._put(Op.PUT_START, key, parts, config))

    @operation
    def put_from(self, key: str, buffer: Any, config: ReplicateConfig | None = None) -> OpGen[None]:
        """Like :meth:`put` from any buffer-protocol object (numpy array, mmap, ...)."""
        return (yield from self._put(Op.PUT_START, key, (buffer,), config))

    @operation
    def upsert(self, key: str, value: bytes | bytearray | memoryview,
               config: ReplicateConfig | None = None) -> OpGen[None]:
        """Store ``value``, replacing an existing object (readers holding a lease
        keep reading the old bytes until it ends).  When another write of the key is
        in progress, the master refuses the upsert (OBJECT_ALREADY_EXISTS) and it
        returns without storing its value (its sessions do tag the key): it is
        taken as done just before that write, whose value then replaces it (if that
        write is revoked instead, the key keeps what it held)."""
        return (yield from self._put(Op.UPSERT_START, key, (value,), config))

    @operation
    def upsert_from(self, key: str, buffer: Any, config: ReplicateConfig | None = None) -> OpGen[None]:
        """Like :meth:`upsert` from any buffer-protocol object."""
        return (yield from self._put(Op.UPSERT_START, key, (buffer,), config))

    @operation
    def upsert_parts(self, key: str, *parts: bytes | bytearray | memoryview,
                     config: ReplicateConfig | None = None) -> OpGen[None]:
        """Like :meth:`upsert` with the value given as consecutive parts (no join copy)."""
        return (yield from self._put(Op.UPSERT_START, key, parts, config))

    def _tag_plan(self, config: Any, n: int, op: str, kv: Any
                  ) -> tuple[list[bytes] | None, list[list[str]] | None]:
        """A write's session tags (``ReplicateConfig.session_tags``): ``(tags to send,
        None)``, or ``(None, kv_sessions lists)`` for a master that takes them as
        memberships (``--session-tags-as-kv-sessions``); ``(None, None)`` when there are
        none, the write has ``kv``-sessions already (those carry no tags) or the master
        is older than 1.5 (the tags are then dropped, said once in the log)."""
        stags = _session_tags_wire(config, n, op)
        if stags is None or kv:
            return None, None
        w = self._welcome()
        if w.tags_as_sessions:
            return None, [[t.decode()] if t else [] for t in stags]
        if not w.tags:
            if not self._tags_dropped:
                self._tags_dropped = True
                log.warning("the master is older than protocol 1.5: session tags are dropped")
            return None, None
        return stags, None

    def _write_batch(self, op_start: Op, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None,
                     tags: Sequence[Sequence[Any]] | None = None,
                     gids: list[bytes] | None = None,
                     stags: list[bytes] | None = None) -> OpGen:
        """A batch of puts or upserts; ``tags``: the sessions per key, when given
        instead of ``config.kv_sessions``; ``gids``: the group per key (as sent), when
        given instead of ``config.group_ids``; ``stags``: the session tags (as sent),
        when given instead of ``config.session_tags``."""
        if len(keys) != len(values):
            raise E.InvalidParams("keys and values differ in length", op=op_start.name)
        values = _byte_values(values, op_start.name)
        sizes = list(map(len, values))
        if sizes and min(sizes) <= 0:
            bad = [i for i, s in enumerate(sizes) if s <= 0]
            raise E.InvalidParams(f"empty values at positions {bad[:8]}", op=op_start.name)
        if tags is None and config is not None:
            tags = config.kv_sessions
        if stags is None and not tags:
            stags, as_kv = self._tag_plan(config, len(keys), op_start.name, tags)
            if as_kv is not None:
                tags = as_kv
        stags = stags or None  # ([] from _write_once_per_key: none, already decided)
        if gids is None and not tags:
            gids = _group_ids_wire(config, len(keys), op_start.name)
        gids = gids or None
        # Tagged and grouped writes go to each key's shard (their walks start there).
        bkeys, groups = self._group(keys, None if tags or gids or stags else op_start)
        if not bkeys:
            return []
        cfg = config.to_wire() if config is not None else None
        btags: list[list[bytes]] | None = None
        if tags:
            if len(tags) != len(keys):
                raise E.InvalidParams(f"kv_sessions has {len(tags)} lists for {len(keys)} keys",
                                      op=op_start.name)
            btags = [[_b(t) for t in ts] for ts in tags]
        if len(set(bkeys)) < len(bkeys):
            return (yield from self._write_once_per_key(op_start, keys, values, bkeys, btags,
                                                        config, gids, stags))
        if btags is not None:
            op_start = _TAGGED[op_start]
        results: list[int] = [0] * len(bkeys)
        shards = list(groups)
        write_id = next(self._write_ids)
        columns = self._welcome().columns
        tail = [write_id, True] if columns else [write_id]
        if (gids is not None or stags is not None) and not columns:
            tail.append(False)

        def revoke(which: dict[int, list[int]]) -> NoWait:
            return NoWait(self._fan(Op.BATCH_PUT_REVOKE, {
                s: [_at(bkeys, idx), write_id] for s, idx in which.items() if idx}))

        sent_at = _monotonic()
        try:
            # Tolerant: a shard that refuses its whole request must not strand the
            # writes the other shards already started.
            starts = yield Tolerant(
                (op_start.value, P.route_for_shard(s),
                 [_at(bkeys, groups[s]), _at(sizes, groups[s]), cfg,
                  *([_at(btags, groups[s])] if btags is not None else []), *tail,
                  *([_at(gids, groups[s])] if gids is not None else
                    [None] if stags is not None else []),
                  *([_at(stags, groups[s])] if stags is not None else [])])
                for s in shards)
        except GeneratorExit:
            raise
        except BaseException as exc:
            lost = unanswered(exc, len(shards))
            if lost:  # those starts may still be applied (their replies were lost)
                yield revoke({shards[j]: groups[shards[j]] for j in lost})
            raise
        # Writes pending on the master (shard -> positions): whatever fails from here
        # on, they are revoked (see _put).
        started_on = self._master_instance
        if not columns:  # a 1.0 master answers per key
            starts = [P.replica_columns(b, False) if type(b) is list else b for b in starts]
        pending: dict[int, list[int]] = {}
        for s, body in zip(shards, starts):
            if type(body) is list:
                idx = [i for i, f in zip(groups[s], body[1]) if f >= 0]
                if idx:
                    pending[s] = idx

        ends: dict[int, list[int]] = {}
        revokes: dict[int, list[int]] = {}
        views = _Mappings(self._local_seg)
        failed: E.RequestError | None = None
        fence = WriteFence(self, sent_at, op_start.name)
        clock = _fence.clock  # (read before each block: see kvmaster._fence)
        later: dict[int, Callable[[], int]] = {}  # position -> its hash, taken meanwhile
        try:
            yield from self._know(r for body in starts if type(body) is list
                                  for r in _columns_replicas(body))
            if self._master_instance != started_on:
                raise self._write_lost(op_start)  # its ranges may be other keys' now
            # Past the fence's limit the loop stops (LeaseExpired), and every write it
            # started is revoked (below).
            limit = fence.limit()
            if self.config.write_checksums and max(sizes, default=0) >= OVERLAP_MIN:
                later = {i: checksum_later((values[i],)) for idx in pending.values()
                         for i in idx if sizes[i] >= OVERLAP_MIN}  # hashed while copied
            exists = Status.OBJECT_ALREADY_EXISTS
            for s, body in zip(shards, starts):
                if isinstance(body, E.RequestError):
                    failed = failed or body
                    for i in groups[s]:
                        results[i] = body.code
                    continue
                names, first, offsets, more = body[:4]
                further = dict(more) if more else None
                idx = groups[s]
                if further is None and len(names) == 1 and min(first, default=-1) == 0:
                    # Every key started, with one replica, all in one segment: when it
                    # is on this host, straight into it (a mapping of this client's own,
                    # pwrite into a peer's).
                    seg = views[names[0]]
                    if seg is not None:
                        try:
                            if seg.owner:
                                view = seg.buf
                                for i, off in zip(idx, offsets):
                                    n = sizes[i]
                                    if n >= RAW_COPY_MIN:
                                        _copy_blocks(view, off, values[i], n, fence, limit)
                                        continue
                                    if clock() > limit:
                                        raise fence.expired()
                                    view[off:off + n] = values[i]
                            else:  # (adjacent ranges in one pwritev per block)
                                _fenced_write_each(seg, [(off, values[i]) for i, off
                                                         in zip(idx, offsets)], fence, limit)
                        except (OSError, ValueError):  # closed or full: the loop below says why
                            pass
                        else:
                            ends[s] = idx
                            continue
                for pos, (i, f, off) in enumerate(zip(idx, first, offsets)):
                    if f < 0:
                        results[i] = 0 if f == exists else f
                        continue
                    name = names[f]
                    if further is None or pos not in further:
                        # one replica: straight into it when it is here
                        seg = views[name]
                        if seg is not None:
                            try:
                                _fenced_write(seg, off, (values[i],), fence, limit)
                            except (OSError, ValueError):  # the general path says why
                                pass
                            else:
                                ends.setdefault(s, []).append(i)
                                continue
                        r = [[name, off]]
                    else:
                        r = [[name, off], *further[pos]]
                    try:
                        self._write(r, (values[i],), fence, limit)
                    except TransferError:
                        results[i] = Status.TRANSFER_FAIL  # not revoked: see _put
                        pending[s].remove(i)
                        continue
                    except E.LeaseExpired:
                        raise
                    except (OSError, ValueError, E.KVMasterError) as exc:
                        results[i] = _write_failure(exc)
                        revokes.setdefault(s, []).append(i)
                        continue
                    ends.setdefault(s, []).append(i)
        except GeneratorExit:
            settle(later.values())
            raise
        except BaseException:
            settle(later.values())  # (before the call returns: they read the caller's values)
            yield revoke(pending)
            raise
        hashed = {i: result() for i, result in later.items()}  # (all, failed ones too)
        if revokes:
            yield revoke(revokes)
        if ends:
            end_shards = list(ends)
            sums = self.config.write_checksums
            try:
                done = yield self._fan(Op.BATCH_PUT_END, {
                    s: [_at(bkeys, ends[s]), write_id,
                        *([[hashed[i] if i in hashed else _checksum(values[i])
                            for i in ends[s]]] if sums else [])]
                    for s in end_shards})
            except GeneratorExit:
                raise
            except BaseException as exc:
                lost = unanswered(exc, len(end_shards))
                if lost:
                    yield revoke({end_shards[j]: ends[end_shards[j]] for j in lost})
                raise
            if self._master_instance != started_on and any(
                    r in _LOST_WRITE for body in done for r in body):
                raise self._write_lost(op_start)
            for s, body in zip(end_shards, done):
                for i, r in zip(ends[s], body):
                    results[i] = r
        if failed is not None and failed.code in (Status.INVALID_PARAMS, Status.UNSUPPORTED):
            raise failed  # a malformed request is the caller's bug, not a per-key outcome
        return results

    @operation
    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> OpGen[list[int]]:
        """Write-once puts; one status per position (0 = stored or already there).  A
        key given more than once is written once, from its first position; each of
        its positions gets that write's status (:meth:`_write_once_per_key`)."""
        return (yield from self._write_batch(Op.BATCH_PUT_START, keys, values, config))

    @operation
    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any],
                       config: ReplicateConfig | None = None) -> OpGen[list[int]]:
        """:meth:`put_batch` from buffer-protocol objects."""
        return (yield from self._write_batch(Op.BATCH_PUT_START, keys, buffers, config))

    @operation
    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None = None) -> OpGen[list[int]]:
        """Upserts; one status per position (0: stored, or refused because a write of
        the key was in progress, which replaces it: see :meth:`upsert`).  A key given
        more than once is written once, with the value and sessions of its last
        position; each of its positions gets that write's status
        (:meth:`_write_once_per_key`)."""
        return (yield from self._write_batch(Op.BATCH_UPSERT_START, keys, values, config))

    def _write_once_per_key(self, op_start: Op, keys: Sequence[str], values: Sequence[Any],
                            bkeys: list[bytes], btags: list[list[bytes]] | None,
                            config: ReplicateConfig | None,
                            gids: list[bytes] | None = None,
                            stags: list[bytes] | None = None) -> OpGen:
        """A batch (checked whole by :meth:`_write_batch`) that repeats keys: each key is
        written once, from one of its positions, with that position's value and
        sessions: the first for a put (write-once: the first write is the one kept),
        the last for an upsert (each replaces the one before); every position of the
        key answers that write's status.  Sent as they are, the later positions would
        be refused by the first one's write in progress (OBJECT_ALREADY_EXISTS) and
        answered 0 whatever became of that write."""
        if op_start is Op.BATCH_UPSERT_START:
            chosen = {k: i for i, k in enumerate(bkeys)}  # the last position of each key
        else:
            chosen = {}
            for i, k in enumerate(bkeys):
                chosen.setdefault(k, i)
        keep = sorted(chosen.values())
        got = yield from self._write_batch(
            op_start, [keys[i] for i in keep], [values[i] for i in keep], config,
            None if btags is None else [btags[i] for i in keep],
            # ([]: none; config's per-key lists are of the whole batch, not these keys)
            [] if gids is None else [gids[i] for i in keep],
            [] if stags is None else [stags[i] for i in keep])
        by_key = {bkeys[i]: r for i, r in zip(keep, got)}
        return [by_key[k] for k in bkeys]
