"""The write records one shard keeps per writer: how many it holds (writes in
progress and given-up ones, bounded by ``--max-writes-per-client``), and the writes
given up on (dropped with a segment, taken over, released) whose space stays
allocated until their writer is done with them or leaves (:class:`StrandedWrite`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmaster._records import StrandedWrite

if TYPE_CHECKING:
    from kvmaster._records import ClientView, ObjectMeta, SegmentShare
    from kvmaster._shard import ShardActor

__all__ = ["WriterRecords"]


class WriterRecords:
    """Per-writer write records of one shard (``ShardActor.writers``), run by its actor:
    ``held`` (client_id -> write records held here), ``stranded`` (stored key -> the
    given-up writes of it) and ``stranded_by`` (client_id -> the keys with such writes
    of it)."""

    __slots__ = ("held", "shard", "stranded", "stranded_by")

    def __init__(self, shard: ShardActor) -> None:
        self.shard = shard
        self.held: dict[str, int] = {}
        self.stranded: dict[bytes, list[StrandedWrite]] = {}
        self.stranded_by: dict[str, set[bytes]] = {}

    def unheld(self, writer: str, n: int = 1) -> None:
        """``n`` write records of ``writer`` left this shard (ended, revoked, freed)."""
        left = self.held.get(writer, 0) - n
        if left > 0:
            self.held[writer] = left
        else:
            self.held.pop(writer, None)

    def dropped_meanwhile(self, ck: bytes, mine: Any) -> bool:
        """Whether ``mine``, the write a tagged start admitted for ``ck`` (None: none),
        was dropped with a segment while its sessions registered (for an upsert the old
        object is still there).  If so, the writer is not told where it was placed
        (SEGMENT_NOT_FOUND), so what is left of it is freed now."""
        if mine is None or self.shard.writes.get(ck) is mine:
            return False
        for sw in list(self.stranded.get(ck, ())):
            if sw.record is mine:
                self.drop_stranded(ck, sw)
        return True

    def reject_write(self, client: ClientView, ck: bytes, start_result: Any) -> None:
        """Undo a just-admitted write (its registration was refused)."""
        if type(start_result) is list:
            pw = self.shard.writes.pop(ck, None)
            if pw is not None:
                self.unheld(pw.writer)
                for seg, off in pw.replicas():
                    self.shard.placement.free(seg, off, pw.size)
                self.shard.sessions.unregister(ck, pw.sessions)

    def strand(self, ck: bytes, pw: ObjectMeta, replicas: list[tuple[SegmentShare, int]]
                ) -> None:
        """Keep ``replicas``, what is left of ``pw`` (the write of ``ck``, no longer in
        :attr:`ShardActor.writes`: dropped with a segment holding another replica of it, taken
        over, or released), allocated until its writer is done with them or leaves
        (:class:`StrandedWrite`).  Freeing them earlier let the next write take the
        range while the writer, not yet told (or stopped and resumed), still copied its
        bytes into it: another key's bytes under a key being read.  The record stays
        counted in the writer's :attr:`held`."""
        # The dropped write keeps no reference to an unmounted segment (its share and
        # allocator would stay in memory while the record is kept).
        pw.keep(replicas)
        self.stranded.setdefault(ck, []).append(StrandedWrite(pw))
        self.stranded_by.setdefault(pw.writer, set()).add(ck)

    def drop_stranded(self, ck: bytes, sw: StrandedWrite) -> None:
        rec, sw.record = sw.record, None
        assert rec is not None, "a stranded write in the lists is not yet freed"
        for seg, off in rec.replicas():
            self.shard.placement.free(seg, off, rec.size)  # (nothing if that segment went too)
        left = [w for w in self.stranded.get(ck, ()) if w is not sw]
        if left:
            self.stranded[ck] = left
        else:
            self.stranded.pop(ck, None)
        writer = rec.writer
        self.unheld(writer)
        if not any(w.record is not None and w.record.writer == writer for w in left):
            keys = self.stranded_by.get(writer)
            if keys is not None:
                keys.discard(ck)
                if not keys:
                    del self.stranded_by[writer]

    def writer_done(self, client_id: str, ck: bytes, write_id: int | None) -> None:
        """The writer of a given-up write of ``ck`` ended or revoked it (an end or revoke
        naming it: its ``write_id``, or any of the client's when it names none): it
        copies into that write's ranges no more, so they are freed.  An end or revoke
        naming none while the client has a write of ``ck`` in progress is that write's
        (as :meth:`kvmaster._ends.WriteEnds.end_one` takes it): the given-up one's
        ranges stay held."""
        if write_id is None:
            pw = self.shard.writes.get(ck)
            if pw is not None and pw.writer == client_id:
                return
        for sw in list(self.stranded.get(ck, ())):
            rec = sw.record
            assert rec is not None, "a stranded write in the lists is not yet freed"
            if rec.writer == client_id and (write_id is None or rec.write_id == write_id):
                self.drop_stranded(ck, sw)

    def drop_writes_of(self, client_id: str) -> None:
        """The writer ``client_id`` left (BYE) or was expired: its writes in progress are
        dropped and their space freed, and so is the space of its given-up writes.  An
        expired writer may be a stopped one that resumes later: it checks before each
        block it copies whether its registration may have lapsed (the write fence of
        :mod:`kvmaster._fence`) and stops, so at most the block it was copying when it
        stopped lands after this (RELIABILITY.md, "Write fencing")."""
        writes = self.shard.writes
        mine = [ck for ck, pw in writes.items() if pw.writer == client_id]
        for ck in mine:
            pw = writes.pop(ck)
            for seg, off in pw.replicas():
                self.shard.placement.free(seg, off, pw.size)
            self.shard.sessions.unregister(ck, pw.sessions)
        self.shard.counters["writes_dropped_with_writer"] += len(mine)
        keys = self.stranded_by.pop(client_id, None)
        freed = 0
        for ck in keys or ():
            for sw in list(self.stranded.get(ck, ())):
                rec = sw.record
                assert rec is not None, "a stranded write in the lists is not yet freed"
                if rec.writer == client_id:
                    self.drop_stranded(ck, sw)
                    freed += 1
        self.shard.counters["stranded_writes_freed_with_writer"] += freed
        self.held.pop(client_id, None)
