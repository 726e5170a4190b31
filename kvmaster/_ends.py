"""Write ends of one shard: PUT_END and PUT_REVOKE, single and batch.

An end makes the write's object readable (COMPLETE), replacing what was stored under
its key; a revoke frees the write.  An end or revoke of a write the shard no longer
has is answered by what became of it (see :meth:`WriteEnds.no_write`): dropped with
a segment, released, or ended before (an end sent again).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from typing import TYPE_CHECKING, Any, cast

from kvmaster._records import HARD_PIN, StatusError, add_ref, iter_sessions
from kvmaster._tenancy import CountedWrites
from kvmaster.protocol import SoftPinAction, Status

if TYPE_CHECKING:
    from kvmaster._records import ClientView
    from kvmaster._shard import ShardActor

__all__ = ["WriteEnds"]


class WriteEnds:
    """The write-end and revoke handlers of one shard (``ShardActor.ends``), run by its
    actor; the writes, objects and the record of lost and ended writes are the shard's."""

    __slots__ = ("shard",)

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard

    def no_write(self, client: ClientView, ck: bytes, write_id: int | None = None) -> int:
        """Status of an end or revoke that finds no write of ``ck`` in progress:
        SEGMENT_NOT_FOUND when this client's write was dropped because a segment
        holding a replica of it was unmounted (its owner left, was expired, or
        unmounted it), else OBJECT_NOT_FOUND.

        Mooncake's ``MasterService::PutEnd`` (``mooncake-store/src/master_service.cpp``)
        answers OK in that case without completing the object (its replicas on the
        unmounted segment are skipped and stay PROCESSING until the discard timeout);
        here the caller learns that the write is lost and can start it again."""
        lost = self._lost_write(client, ck, write_id)
        return Status.OBJECT_NOT_FOUND if lost is None else _dropped_status(lost)

    def _lost_write(self, client: ClientView, ck: bytes, write_id: int | None
                    ) -> tuple[str, str | None, float, int | None] | None:
        """The last write of ``ck`` dropped before its end (:attr:`lost_writes`) if it
        is this client's write ``write_id`` (for a start that named none, one that
        named none)."""
        lost = self.shard.lost_writes.get(ck) if self.shard.lost_writes else None
        if lost is None or lost[0] != client.client_id or lost[3] != write_id:
            return None
        return lost

    def end_one(self, client: ClientView, ck: bytes, now: float,
                 write_id: int | None = None, note: bool = True,
                 checksum: int | None = None) -> int:
        """End the caller's write in progress of ``ck``: the object is COMPLETE.

        With ``write_id`` only the write its start named so: an end sent again after
        an earlier end naming the write stored it (its answer lost) answers 0 again,
        while the object it stored is the key's (``ObjectMeta.writer``, ``write_id``),
        and after that while this shard remembers the write as ended
        (:attr:`recent_ends`: its object evicted, removed or replaced meanwhile; the put
        did store it).  A write of the key by the same client under another id is left
        alone (OBJECT_NOT_FOUND), so an end sent again cannot complete a later write
        before its bytes are in.  Another client's write: ILLEGAL_CLIENT.

        The record is per write, with the keys whose first end failed (a batch's
        keys dropped before their end, or never started), answered again as then; a
        key that first end did not name is answered 0 only if it holds neither an
        object nor a write in progress, and no record says its write was dropped
        (:attr:`lost_writes`).  ``note``: remember the write as ended here when it
        stores the object (a batch does so once, after all its keys).  ``checksum``: the
        writer's checksum of the value, kept with the object (an end sent again after the
        object was stored changes nothing)."""
        if self.shard.writers.stranded and ck in self.shard.writers.stranded:
            self.shard.writers.writer_done(client.client_id, ck, write_id)
        pw = self.shard.writes.get(ck)
        if pw is None or (write_id is not None and (pw.write_id != write_id
                                                    or pw.writer != client.client_id)):
            if write_id is not None:
                obj = self.shard.objects.get(ck)
                if obj is not None and obj.write_id == write_id \
                        and obj.writer == client.client_id:
                    return 0
                ended = self.shard.recent_ends.get(client.client_id)
                if ended is not None and write_id in ended:
                    failed = ended[write_id]
                    if failed is not None and ck in failed:
                        return failed[ck]  # as its first end was answered
                else:
                    ended = None
                lost = self._lost_write(client, ck, write_id)
                if lost is not None:  # this key's write never ended
                    return _dropped_status(lost)
                if ended is not None and pw is None and obj is None:
                    return 0  # it ended here; its object has gone since
            if pw is None:
                return self.no_write(client, ck, write_id)
            if pw.writer == client.client_id:
                return Status.OBJECT_NOT_FOUND
        if pw.writer != client.client_id:
            return Status.ILLEGAL_CLIENT
        del self.shard.writes[ck]
        self.shard.writers.unheld(pw.writer)
        cfg = pw.config
        assert cfg is not None, "a write in progress keeps its config until it ends"
        old = self.shard.objects.get(ck)
        softpin = 0.0
        if cfg.soft_pin_action == SoftPinAction.ENABLE:
            ttl = cfg.soft_pin_ttl_ms or self.shard.config.default_kv_soft_pin_ttl
            softpin = now + ttl / 1000.0
        elif cfg.soft_pin_action == SoftPinAction.PRESERVE and old is not None and old.softpin > now:
            softpin = old.softpin
        flags = HARD_PIN if cfg.with_hard_pin else 0
        sessions = pw.sessions
        if old is not None:
            self.shard.placement.free_object(old, now)
            if old.flags & HARD_PIN:
                flags |= HARD_PIN
            # An upsert keeps the old object's memberships.
            for sck in iter_sessions(old.sessions):
                sessions = add_ref(sessions, sck)
            if old.sessions is not None and self.shard.groups.active:
                sessions = self.shard.groups.carry(ck, pw.sessions, sessions)  # (leaves the old group)
        # The write's record is the object's from now on; what only the write needed
        # goes (a single put's config and start time would stay alive per object).
        pw.softpin, pw.flags, pw.sessions = softpin, flags, sessions
        pw.config, pw.started, pw.checksum = None, 0.0, checksum
        self.shard.objects[ck] = pw
        if self.shard.log is not None:
            self.shard.log.put(ck, pw)
        self.shard._stored(client, (ck,))
        if note and pw.write_id is not None:
            self.shard._note_end(pw.writer, pw.write_id)
        return 0

    def handle_put_end(self, client: ClientView, msg: Any, now: float) -> int:
        ck = self.shard._ckey(client, msg.key)
        r = self.end_one(client, ck, now, msg.write_id, checksum=msg.checksum)
        if r:  # (end_one's nonzero answers are Status members already)
            raise StatusError(Status(r), self._end_error_text(ck, r))
        return 0

    def _end_error_text(self, ck: bytes, status: int) -> str:
        if status == Status.SEGMENT_NOT_FOUND:
            lost = self.shard.lost_writes.get(ck)
            segment = f"segment {lost[1]}" if lost is not None and lost[1] else "a segment"
            return (f"{segment} holding this write was unmounted (its owner left); the "
                    "write is dropped: start it again")
        if status == Status.OBJECT_NOT_FOUND:
            return "no write of this client in progress for the key"
        return "another client started this write"

    def handle_batch_put_end(self, client: ClientView, msg: Any, now: float) -> list[int]:
        """:meth:`_end_one` per key, inlined for a first write without a soft pin."""
        writes, objects = self.shard.writes, self.shard.objects
        cid = client.client_id
        wid = msg.write_id
        cks = self.shard._ckeys(client, msg.keys)
        sums = msg.checksums
        if sums is None:
            sums = repeat(None, len(cks))
        elif len(sums) != len(cks):
            raise StatusError(Status.INVALID_PARAMS, "checksums and keys differ in length")
        enable = SoftPinAction.ENABLE
        out: list[int] = []
        append = out.append
        stored = False
        failed: dict[bytes, int] | None = None
        done: list[bytes] = []
        # With tenant quotas the maps count (kvmaster/_tenancy.py): a write that becomes
        # its object keeps its bytes, so the plain moves below skip the counting and
        # the writes count drops once for the batch.
        counted = type(writes) is CountedWrites
        # (unbound, taking the map, when counted; the map's own methods otherwise)
        drop: Callable[..., None] = dict.__delitem__ if counted else writes.__delitem__
        keep: Callable[..., None] = dict.__setitem__ if counted else objects.__setitem__
        for ck, checksum in zip(cks, sums):
            pw = writes.get(ck)
            # (a write in progress keeps its config, never None: the ignores below
            # spare a check per key)
            if (pw is None or pw.writer != cid or ck in objects
                    or pw.config.soft_pin_action == enable  # type: ignore[union-attr]
                    or pw.write_id != wid):
                r = self.end_one(client, ck, now, wid, note=False, checksum=checksum)
                append(r)
                if r:
                    if failed is None:
                        failed = {}
                    failed[ck] = r
                else:
                    stored = True
                continue
            if counted:
                drop(writes, ck)
            else:
                drop(ck)
            if pw.config.with_hard_pin:  # type: ignore[union-attr]
                pw.flags = HARD_PIN
            pw.config = None  # (its start time is the batch's, shared)
            pw.checksum = checksum
            if counted:
                keep(objects, ck, pw)
            else:
                keep(ck, pw)
            done.append(ck)
            append(0)
            stored = True
        if counted and done:
            cast(CountedWrites, writes).settled(client.prefix or b"", len(done))
        if self.shard.log is not None and done:
            self.shard.log.puts(done)
        self.shard._stored(client, done)
        if done:
            self.shard.writers.unheld(cid, len(done))
        if stored and wid is not None:
            self.shard._note_end(cid, wid, failed)
        return out

    def revoke_one(self, client: ClientView, ck: bytes, write_id: int | None = None) -> int:
        """Revoke the caller's write in progress of ``ck``; with ``write_id`` only the
        write its start named so.  A COMPLETE object is never touched (a revoke whose
        PUT_END was applied, its reply lost, finds no write), nor another client's
        write; and with ``write_id``, nor a write of the same client started after the
        one meant (say an upsert by another of its threads, admitted once the first
        write had ended): its space would be freed while it is being written."""
        if self.shard.writers.stranded and ck in self.shard.writers.stranded:
            self.shard.writers.writer_done(client.client_id, ck, write_id)
        pw = self.shard.writes.get(ck)
        if pw is None:
            return self.no_write(client, ck, write_id)
        if pw.writer != client.client_id:
            return Status.ILLEGAL_CLIENT
        if write_id is not None and pw.write_id != write_id:
            return Status.OBJECT_NOT_FOUND  # not the write this revoke is about
        del self.shard.writes[ck]
        self.shard.writers.unheld(pw.writer)
        for seg, off in pw.replicas():
            self.shard.placement.free(seg, off, pw.size)
        self.shard.sessions.unregister(ck, pw.sessions)
        if pw.write_id is not None:
            ended = self.shard.recent_ends.get(client.client_id)
            if ended is not None and pw.write_id in ended:  # a key of an ended batch
                self.shard._note_end(client.client_id, pw.write_id, {ck: Status.OBJECT_NOT_FOUND})
        return 0

    def handle_put_revoke(self, client: ClientView, msg: Any, now: float) -> int:
        ck = self.shard._ckey(client, msg.key)
        r = self.revoke_one(client, ck, msg.write_id)
        if r:  # (revoke_one's nonzero answers are Status members already)
            raise StatusError(Status(r), self._end_error_text(ck, r))
        return 0

    def handle_batch_put_revoke(self, client: ClientView, msg: Any, now: float) -> list[int]:
        write_id = msg.write_id
        return [self.revoke_one(client, ck, write_id) for ck in self.shard._ckeys(client, msg.keys)]

    # --------------------------------------------------------------- removal


def _dropped_status(lost: tuple[str, str | None, float, int | None]) -> int:
    """The answer to an end or revoke of a write dropped before its end (a
    :attr:`ShardActor.lost_writes` record): SEGMENT_NOT_FOUND when a segment holding it
    was unmounted, OBJECT_NOT_FOUND when it was released or taken over."""
    return Status.SEGMENT_NOT_FOUND if lost[1] is not None else Status.OBJECT_NOT_FOUND
