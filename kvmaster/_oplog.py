"""The HA operation log (``--ha-oplog``): the leader's shards record their object metadata
changes in etcd, and standbys keep a replica of it, so a promoted standby serves the
cached objects at once instead of starting empty (HA.md, "Hot standby").

One log per shard: batches of records under ``/kvmaster/<cluster>/oplog/<shard>/<seq>``
(``shard`` 4 digits, ``seq`` 16 hex digits, from 0 without gaps).  A batch is the
msgpack array ``[1, wall time (s), segment names, records]``; records name a segment by
its index in the batch's table.  Records (first element the kind):

=====  ==================================  ===================================================
kind   fields                              meaning
=====  ==================================  ===================================================
``M``  segment, size, tenant (or None)     segment mounted (its shard share: size // shards)
``U``  segment                             segment unmounted: its objects are gone
``P``  key, size, [[segment, offset]...],  object stored (or its replicas changed), COMPLETE;
       checksum (or None), flags           replaces what the key held
``S``  key, size, segment, offset,         ``P`` of an object with one replica
       checksum, flags
``F``  segment, offset, length             range freed: every object at an offset in it is gone
``D``  key                                 object removed (its range is freed later, when its
                                           read lease ends)
=====  ==================================  ===================================================

The rule that keeps readers off reused space: **a freed range is given back to the
allocator only once the batch holding its ``F`` record is in etcd** (the shard holds it
until then: :meth:`kvmaster._shard.ShardActor.oplog_durable`).  A standby that
replays the log therefore never points a reader at space that holds another object's
bytes.  Each write to etcd is a transaction that succeeds only while the leader key is
held by this master's lease, so a deposed leader can add nothing once a standby has
won the key and read the log to its end.

What a crash can lose: the records of the batches not yet in etcd, at most
``--ha-oplog-delay-ms`` plus one etcd write of changes: puts answered in that window
are misses after the failover (never other bytes), removals answered in it come back
as their old objects (whose space was not reused: its ``F`` was not durable).
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack

from kvmaster._alloc import ALIGN
from kvmaster.ha import EtcdError, EtcdGateway, EtcdRefused, _b64, _unb64, leader_key

__all__ = ["OPLOG_VERSION", "OpLogFollower", "OpLogWriter", "ShardReplica", "oplog_prefix"]

log = logging.getLogger(__name__)

OPLOG_VERSION = 1
#: Most bytes of batches in one etcd transaction (etcd refuses requests over 1.5 MiB by
#: default; base64 and JSON add a third).
TXN_BYTES = 768 * 1024
#: Most puts in one transaction (etcd's default --max-txn-ops is 128).
TXN_OPS = 100
#: Most bytes of keys (plus RECORD_BYTES per record) in one batch: a batch of long keys
#: is cut sooner, so that each stays well under etcd's request limit once encoded.
BATCH_BYTES = 512 * 1024
#: What a record costs beyond its key, about (msgpack, before base64).
RECORD_BYTES = 32
#: Longest freed range, in ALIGN steps, that a standby walks offset by offset (longer:
#: a scan of the segment's objects).
FREE_WALK_STEPS = 1 << 16
#: Objects per snapshot chunk (about 100 bytes each with a 40-byte key: ~200 KiB).
SNAPSHOT_CHUNK = 2000


def oplog_prefix(cluster_id: str) -> str:
    return f"/kvmaster/{cluster_id}/oplog/"


def batch_key(cluster_id: str, shard: int, seq: int) -> str:
    return f"{oplog_prefix(cluster_id)}{shard:04d}/{seq:016x}"


def snapshot_head_key(cluster_id: str, shard: int) -> str:
    return f"/kvmaster/{cluster_id}/oplog-snapshot/{shard:04d}/head"


def snapshot_chunk_key(cluster_id: str, shard: int, seq: int, writer: str, chunk: int) -> str:
    return f"{_snapshot_dir(cluster_id, shard, seq, writer)}{chunk:08d}"


def _snapshot_dir(cluster_id: str, shard: int, seq: int, writer: str) -> str:
    """Each snapshot's chunks under a directory of its own writer's (two masters may
    snapshot the same batch at once: neither overwrites or deletes the other's)."""
    return f"/kvmaster/{cluster_id}/oplog-snapshot/{shard:04d}/{seq:016x}-{writer}/"


def standby_prefix(cluster_id: str) -> str:
    """Where each standby says how far it has read (a key under its election lease)."""
    return f"/kvmaster/{cluster_id}/oplog-standby/"


#: How often a standby publishes its progress, and the leader reads the standbys', s.
STANDBY_REPORT_S = 1.0


def _prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class OpLogWriter:
    """The leader side: each shard's records, batched and written to etcd in order.

    :meth:`record` and :meth:`segment` are called on the event loop that owns the shards
    (no lock: batches are cut there, by :meth:`flush`); one thread writes them, in
    order, one transaction per flush (or more past TXN_BYTES/TXN_OPS), each conditioned
    on the leader key's lease.  ``on_durable(shard, seq)`` runs on the loop once batch
    ``seq`` of ``shard`` is in etcd; ``on_fenced(reason)`` once a write is refused
    because this master no longer holds the key, or once more than ``max_pending``
    records wait, once its writes have failed for longer than ``fail_limit_s`` (the
    lease TTL), or once etcd refuses one outright (etcd too slow, away or unwilling:
    the standbys can no longer follow, so the leader steps down rather than acknowledge
    writes it cannot log).

    Bounds: a batch holds at most ``max_batch`` records (cut at once when full); a flush
    runs at most ``delay_s`` after the first record of a batch.
    """

    def __init__(self, gateway: EtcdGateway, cluster_id: str, lease_id: int,
                 first_seq: list[int], loop: Any,
                 on_durable: Callable[[int, int], None], on_fenced: Callable[[str], None],
                 delay_s: float = 0.01, max_batch: int = 2048,
                 max_pending: int = 1_000_000, fail_limit_s: float = 5.0) -> None:
        self.gw = gateway
        self.cluster_id = cluster_id
        self.lease_id = lease_id
        self.loop = loop
        self.on_durable = on_durable
        self.on_fenced = on_fenced
        self.delay_s = delay_s
        self.max_batch = max_batch
        self.max_pending = max_pending
        #: most bytes of one batch, about (BATCH_BYTES)
        self.batch_bytes = BATCH_BYTES
        #: How long writes may keep failing (etcd away) before the leader steps down, s.
        self.fail_limit_s = fail_limit_s
        n = len(first_seq)
        #: The batch being formed, per shard: its number, records, segment table.
        self.seq = list(first_seq)
        self._recs: list[list[Any]] = [[] for _ in range(n)]
        self._segs: list[dict[str, int]] = [{} for _ in range(n)]
        #: bytes of the open batch of each shard, about (its keys' and RECORD_BYTES each)
        self._bytes = [0] * n
        self._timer: Any = None
        self._queue: queue.Queue[list[tuple[int, int, str, bytes, int]] | None] = queue.Queue()
        #: Records handed to the thread and not yet durable (loop side count).
        self.pending = 0
        self.fenced = False
        self.counters = {"oplog_batches": 0, "oplog_records": 0, "oplog_bytes": 0,
                         "oplog_txns": 0, "oplog_retries": 0}
        #: The standbys' last reports (``HotStandby.status``), read on the thread.
        self.standbys: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvmaster-oplog")
        self._thread.start()

    # ------------------------------------------------------------ loop side

    def segment(self, shard: int, name: str) -> int:
        """The index of segment ``name`` in the table of ``shard``'s open batch."""
        table = self._segs[shard]
        i = table.get(name)
        if i is None:
            i = table[name] = len(table)
        return i

    def table(self, shard: int) -> dict[str, int]:
        """The segment table of ``shard``'s open batch (name -> index; a caller adding
        names to it appends their records with :meth:`extend` before any other call)."""
        return self._segs[shard]

    def extend(self, shard: int, recs: list[Any] | tuple[Any, ...], nbytes: int = 0) -> int:
        """:meth:`record` of each of ``recs`` at once (``nbytes``: their keys' bytes, if
        the caller knows them; else counted here); returns the batch's number.  A batch
        is cut once it holds ``max_batch`` records or BATCH_BYTES (it may exceed them by
        these records: a caller appends at most half of either at once, since their
        segment indices are those of the open batch's :meth:`table`)."""
        if not nbytes:
            nbytes = sum(len(r[1]) for r in recs if type(r[1]) is bytes)
        mine = self._recs[shard]
        mine.extend(recs)
        size = self._bytes[shard] = self._bytes[shard] + nbytes + RECORD_BYTES * len(recs)
        seq = self.seq[shard]
        if len(mine) >= self.max_batch or size >= self.batch_bytes:
            self.flush()
        elif self._timer is None:
            self._timer = self.loop.call_later(self.delay_s, self.flush)
        return seq

    def record(self, shard: int, rec: Any) -> int:
        """Add ``rec`` (segments as :meth:`segment` indices) to ``shard``'s open batch;
        returns that batch's number (``on_durable`` reports it)."""
        return self.extend(shard, (rec,))

    def flush(self) -> None:
        """Cut every open batch and hand them to the writing thread."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.fenced:
            return
        group: list[tuple[int, int, str, bytes, int]] = []
        now = time.time()
        for shard, recs in enumerate(self._recs):
            if not recs:
                continue
            table = self._segs[shard]
            value = msgpack.packb([OPLOG_VERSION, now, list(table), recs], use_bin_type=True)
            seq = self.seq[shard]
            group.append((shard, seq, batch_key(self.cluster_id, shard, seq), value, len(recs)))
            self.seq[shard] = seq + 1
            self.pending += len(recs)
            self._recs[shard] = []
            self._segs[shard] = {}
            self._bytes[shard] = 0
        if not group:
            return
        if self.pending > self.max_pending:
            self._fence(f"{self.pending} op-log records not yet in etcd "
                        f"(--ha-oplog-max-pending={self.max_pending})")
            return
        self._queue.put(group)

    def pending_records(self) -> int:
        return self.pending + sum(map(len, self._recs))

    def _durable(self, done: list[tuple[int, int, int]]) -> None:
        for shard, seq, n in done:
            self.pending -= n
            self.on_durable(shard, seq)

    def _fence(self, reason: str) -> None:
        if not self.fenced:
            self.fenced = True
            log.error("[ha] op log stopped: %s", reason)
            self.on_fenced(reason)

    def drain(self, timeout_s: float) -> bool:
        """Write what is batched and wait, up to ``timeout_s``, until etcd has it all (a
        clean stop, before the leader key is given up); True if it does."""
        self.flush()
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline and not self.fenced:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def stop(self) -> None:
        """Stop the thread (what it has not written is dropped: the caller is stopping)."""
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=5)

    # ---------------------------------------------------------- thread side

    def _run(self) -> None:
        lkey = _b64(leader_key(self.cluster_id).encode())
        read_at = 0.0
        while not self._stop.is_set():
            if time.monotonic() - read_at >= STANDBY_REPORT_S:
                read_at = time.monotonic()
                self._read_standbys()
            try:
                group = self._queue.get(timeout=STANDBY_REPORT_S)
            except queue.Empty:
                continue
            if group is None:
                return
            try:
                self._write(group, lkey)
            finally:
                self._queue.task_done()

    def _read_standbys(self) -> None:
        """What each standby last said of its progress (for STATS, ctl and metrics)."""
        prefix = standby_prefix(self.cluster_id)
        try:
            out = self.gw._post("kv/range", {"key": _b64(prefix.encode()),
                                             "range_end": _b64(_prefix_end(prefix).encode())})
        except EtcdError:
            return
        found = []
        for kv in out.get("kvs") or []:
            try:
                found.append(json.loads(_unb64(kv["value"])))
            except ValueError:
                continue
        self.standbys = found

    def _write(self, group: list[tuple[int, int, str, bytes, int]], lkey: str) -> None:
        """Write one flush's batches, in order, retrying etcd errors until stopped."""
        if self.fenced:
            return
        i = 0
        while i < len(group) and not self._stop.is_set():
            part: list[tuple[int, int, str, bytes, int]] = []
            size = 0
            while i < len(group) and len(part) < TXN_OPS and \
                    (not part or size + len(group[i][3]) <= TXN_BYTES):
                part.append(group[i])
                size += len(group[i][3])
                i += 1
            body = {
                "compare": [{"key": lkey, "result": "EQUAL", "target": "LEASE",
                             "lease": str(self.lease_id)}],
                "success": [{"request_put": {"key": _b64(k.encode()), "value": _b64(v)}}
                            for _, _, k, v, _ in part],
            }
            delay = 0.05
            failing_since = 0.0
            while not self._stop.is_set():
                try:
                    out = self.gw._post("kv/txn", body)
                    break
                except EtcdRefused as exc:  # (not worth a retry: too large, say)
                    self.loop.call_soon_threadsafe(
                        self._fence, f"etcd refused an op-log write: {exc}")
                    return
                except EtcdError as exc:
                    now = time.monotonic()
                    failing_since = failing_since or now
                    if now - failing_since > self.fail_limit_s:
                        # Acknowledged writes would pile up unlogged: step down.
                        self.loop.call_soon_threadsafe(
                            self._fence, f"op-log writes failed for {now - failing_since:.1f} s"
                            f" (past the lease TTL, {self.fail_limit_s:g} s): {exc}")
                        return
                    self.counters["oplog_retries"] += 1
                    log.warning("[ha] op log write failed, retrying: %s", exc)
                    self._stop.wait(delay)
                    delay = min(1.0, delay * 2)
            else:
                return
            if not out.get("succeeded"):
                self.loop.call_soon_threadsafe(
                    self._fence, "the leader key is no longer held by this master's lease")
                return
            c = self.counters
            c["oplog_txns"] += 1
            c["oplog_batches"] += len(part)
            c["oplog_records"] += sum(p[4] for p in part)
            c["oplog_bytes"] += size
            self.loop.call_soon_threadsafe(self._durable,
                                           [(s, q, n) for s, q, _, _, n in part])


class ShardReplica:
    """A standby's copy of one shard's objects, rebuilt from that shard's log.

    ``objects``: stored key -> ``[size, [(segment, offset), ...], checksum, flags]``;
    ``segments``: segment -> ``(size, tenant)`` as mounted; ``seq``: the next batch to
    apply.  Applying a batch is O(its records), a freed range O(the objects in it) plus a step
    per ALIGN bytes that held none.
    """

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.seq = 0
        self.objects: dict[bytes, list[Any]] = {}
        self.segments: dict[str, tuple[int, str | None]] = {}
        #: segment -> offset -> key: where each replica starts
        self._at: dict[str, dict[int, bytes]] = {}
        self.last_wall = 0.0
        self.records_since_snapshot = 0

    def _drop(self, ck: bytes) -> None:
        obj = self.objects.pop(ck, None)
        if obj is not None:
            for name, off in obj[1]:
                at = self._at.get(name)
                if at is not None and at.get(off) == ck:
                    del at[off]

    def apply(self, batch: bytes) -> None:
        version, wall, table, recs = msgpack.unpackb(batch, raw=False,
                                                     strict_map_key=False, use_list=True)
        if version != OPLOG_VERSION:
            raise ValueError(f"op-log batch version {version} (this master reads "
                             f"{OPLOG_VERSION})")
        objects, at_of = self.objects, self._at
        for rec in recs:
            kind = rec[0]
            if kind == "P":
                _, ck, size, reps, checksum, flags = rec
                self._drop(ck)
                replicas = [(table[s], off) for s, off in reps]
                objects[ck] = [size, replicas, checksum, flags]
                for name, off in replicas:
                    at = at_of.get(name)
                    if at is None:
                        at = at_of[name] = {}
                    was = at.get(off)
                    if was is not None:
                        self._drop(was)  # (what a record puts at an offset is what is there)
                    at[off] = ck
            elif kind == "S":  # (P with one replica)
                _, ck, size, s, off, checksum, flags = rec
                self._drop(ck)
                name = table[s]
                objects[ck] = [size, [(name, off)], checksum, flags]
                at = at_of.get(name)
                if at is None:
                    at = at_of[name] = {}
                was = at.get(off)
                if was is not None:
                    self._drop(was)
                at[off] = ck
            elif kind == "F":
                _, s, off, length = rec
                at = at_of.get(table[s])
                if at:
                    self._free(at, off, off + length)
            elif kind == "D":
                self._drop(rec[1])
            elif kind == "M":
                _, s, size, tenant = rec
                name = table[s]
                old = self.segments.get(name)
                if old is not None and old[0] != size:
                    self._unmount(name)
                self.segments[name] = (size, tenant)
            elif kind == "U":
                self._unmount(table[rec[1]])
                self.segments.pop(table[rec[1]], None)
            else:
                raise ValueError(f"unknown op-log record kind {kind!r}")
        self.seq += 1
        self.last_wall = wall
        self.records_since_snapshot += len(recs)

    # --------------------------------------------------------------- snapshots

    def snapshot_chunks(self, chunk_objects: int = SNAPSHOT_CHUNK) -> list[bytes]:
        """The objects as msgpack chunks of at most ``chunk_objects`` each:
        ``[version, segment names, [[key, size, [[segment, offset]...], checksum,
        flags], ...]]``."""
        out: list[bytes] = []
        items = list(self.objects.items())
        for i in range(0, len(items), chunk_objects):
            table: dict[str, int] = {}
            rows = []
            for ck, (size, reps, checksum, flags) in items[i:i + chunk_objects]:
                rows.append([ck, size, [[table.setdefault(n, len(table)), o] for n, o in reps],
                             checksum, flags])
            out.append(msgpack.packb([OPLOG_VERSION, list(table), rows], use_bin_type=True))
        return out

    def snapshot_head(self, chunks: int, writer: str) -> bytes:
        return msgpack.packb({"v": OPLOG_VERSION, "seq": self.seq, "chunks": chunks,
                              "writer": writer,
                              "objects": len(self.objects), "wall": self.last_wall,
                              "segments": [[n, sz, t] for n, (sz, t) in self.segments.items()]},
                             use_bin_type=True)

    def load_snapshot(self, head: dict[str, Any], chunks: list[bytes]) -> None:
        """Replace this replica by a snapshot: its head and its chunks, in order."""
        if head.get("v") != OPLOG_VERSION:
            raise ValueError(f"op-log snapshot version {head.get('v')}")
        self.objects.clear()
        self._at.clear()
        self.segments = {n: (sz, t) for n, sz, t in head["segments"]}
        for chunk in chunks:
            _, table, rows = msgpack.unpackb(chunk, raw=False, use_list=True)
            for ck, size, reps, checksum, flags in rows:
                replicas = [(table[si], off) for si, off in reps]
                self.objects[ck] = [size, replicas, checksum, flags]
                for name, off in replicas:
                    at = self._at.get(name)
                    if at is None:
                        at = self._at[name] = {}
                    at[off] = ck
        self.seq = head["seq"]
        self.last_wall = head.get("wall", 0.0)
        self.records_since_snapshot = 0

    def _free(self, at: dict[int, bytes], off: int, end: int) -> None:
        """Drop every object with a replica starting in ``[off, end)`` of one segment
        (``at``).  The objects of a freed run lie next to each other, so the walk jumps
        from one to the next and steps by ALIGN only over what held no object (a write
        that never ended); a range longer than FREE_WALK_STEPS steps scans the segment's
        objects instead."""
        if (end - off) // ALIGN > FREE_WALK_STEPS:
            for o in [o for o in at if off <= o < end]:
                ck = at.get(o)
                if ck is not None:
                    self._drop(ck)
            return
        objects = self.objects
        o = off
        while o < end:
            ck = at.get(o)
            if ck is None:
                o += ALIGN
                continue
            o += (objects[ck][0] + ALIGN - 1) & ~(ALIGN - 1)
            self._drop(ck)

    def _unmount(self, name: str) -> None:
        at = self._at.pop(name, None)
        if not at:
            return
        for ck in set(at.values()):
            obj = self.objects.get(ck)
            if obj is None:
                continue
            rest = [(n, o) for n, o in obj[1] if n != name]
            if rest:
                obj[1] = rest
            else:
                del self.objects[ck]


class OpLogFollower:
    """A standby's reader of every shard's log: polls etcd every ``poll_s`` on a thread
    and applies what is new to one :class:`ShardReplica` per shard.  :meth:`catch_up`
    reads to the end (a promoted standby, before serving)."""

    def __init__(self, gateway: EtcdGateway, cluster_id: str, shard_count: int,
                 poll_s: float = 0.05, page: int = 256,
                 snapshot_records: int = 0) -> None:
        """``snapshot_records``: write a shard's snapshot (and trim its log behind it) once
        that many records were applied since its last one and at least as many as it
        has objects, so snapshots cost O(1) per record (0: never)."""
        self.gw = gateway
        self.cluster_id = cluster_id
        self.replicas = [ShardReplica(i) for i in range(shard_count)]
        self.poll_s = poll_s
        self.page = page
        self.snapshot_records = snapshot_records
        #: names this follower's snapshot chunks (unique per process start)
        self.writer_id = secrets.token_hex(6)
        self._head_checked = 0.0
        #: () -> (this master's endpoint, its election lease or 0): where and under
        #: which lease to publish progress (None: not published)
        self.reporter: Callable[[], tuple[str, int]] | None = None
        self._reported = 0.0
        self.snapshots_written = 0
        self.snapshots_loaded = 0
        #: wall time of the newest snapshot this follower wrote or loaded (0: none)
        self.snapshot_wall = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: monotonic time of the last poll that found every log at its end (0: never)
        self.caught_up_at = 0.0
        self.error: str | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kvmaster-oplog-follower")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _report(self) -> None:
        """Publish how far this standby has read, under its election lease (the key goes
        with the standby)."""
        if self.reporter is None or time.monotonic() - self._reported < STANDBY_REPORT_S:
            return
        endpoint, lease = self.reporter()
        if not lease:
            return
        self._reported = time.monotonic()
        value = json.dumps({"endpoint": endpoint,
                            "applied_batches": sum(r.seq for r in self.replicas),
                            "caught_up_wall": time.time() - (time.monotonic()
                                                             - self.caught_up_at),
                            "snapshot_wall": self.snapshot_wall})
        key = standby_prefix(self.cluster_id) + endpoint
        self.gw._post("kv/put", {"key": _b64(key.encode()), "value": _b64(value.encode()),
                                 "lease": str(lease)})

    def unreport(self) -> None:
        """Delete this master's progress report (it leads now)."""
        if self.reporter is None:
            return
        endpoint, _ = self.reporter()
        key = standby_prefix(self.cluster_id) + endpoint
        self.gw._post("kv/deleterange", {"key": _b64(key.encode())})

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
                self._report()
                if self.snapshot_records:
                    for rep in self.replicas:
                        if self._stop.is_set():
                            break
                        if rep.records_since_snapshot >= max(self.snapshot_records,
                                                             len(rep.objects)):
                            with self._lock:
                                self.write_snapshot(rep)
            except EtcdError as exc:
                log.warning("[ha] op log: %s", exc)
            except ValueError as exc:
                self.error = str(exc)
                log.error("[ha] op log cannot be followed: %s", exc)
                return
            self._stop.wait(self.poll_s)

    def poll(self, check_heads: bool = False) -> int:
        """One pass over every shard's log; returns the batches applied (0: at the end).
        A log found at its end is also checked against its snapshot head (its batches
        from here on may have been trimmed behind a snapshot while the leader wrote
        nothing new): always with ``check_heads``, else at most once a second."""
        with self._lock:
            now = time.monotonic()
            if now - self._head_checked >= 1.0:
                check_heads = True
                self._head_checked = now
            got = 0
            for rep in self.replicas:
                while True:
                    n = self._read(rep, check_heads)
                    got += n
                    if n < self.page:
                        break
            self.caught_up_at = time.monotonic()  # (each pass reads to the end)
            return got

    def _read(self, rep: ShardReplica, check_head: bool = False) -> int:
        start = batch_key(self.cluster_id, rep.shard, rep.seq)
        end = _prefix_end(f"{oplog_prefix(self.cluster_id)}{rep.shard:04d}/")
        out = self.gw._post("kv/range", {"key": _b64(start.encode()),
                                         "range_end": _b64(end.encode()),
                                         "limit": str(self.page)})
        kvs = out.get("kvs") or []
        behind = (kvs and int(_unb64(kvs[0]["key"]).decode().rsplit("/", 1)[1], 16)
                  != rep.seq) or (not kvs and check_head)
        # The batches from rep.seq on were trimmed behind a snapshot (or this is a new
        # follower): start from the newest snapshot.
        if behind and self.load_snapshot(rep):
            return self.page  # (read on from the snapshot's end)
        for kv in kvs:
            key = _unb64(kv["key"]).decode()
            seq = int(key.rsplit("/", 1)[1], 16)
            if seq != rep.seq:
                raise ValueError(f"op log of shard {rep.shard} has a gap: batch {seq} "
                                 f"after {rep.seq - 1}")
            rep.apply(_unb64(kv["value"]))
        return len(kvs)

    def load_snapshot(self, rep: ShardReplica) -> bool:
        """Load ``rep``'s newest snapshot if it is ahead of ``rep``; True if loaded."""
        for _ in range(5):  # (a newer snapshot may replace it while it is read)
            raw = self.gw.get_bytes(snapshot_head_key(self.cluster_id, rep.shard))
            if raw is None:
                return False
            head = msgpack.unpackb(raw, raw=False)
            if head["seq"] <= rep.seq:
                return False
            chunks = [self.gw.get_bytes(snapshot_chunk_key(self.cluster_id, rep.shard, head["seq"],
                                                   head["writer"], i))
                      for i in range(head["chunks"])]
            if any(c is None for c in chunks):
                continue
            rep.load_snapshot(head, [c for c in chunks if c is not None])
            self.snapshots_loaded += 1
            self.snapshot_wall = max(self.snapshot_wall, head.get("wall", 0.0))
            log.info("[ha] op log of shard %d: snapshot at batch %d loaded (%d objects)",
                     rep.shard, rep.seq, len(rep.objects))
            return True
        raise EtcdError(f"the snapshot of shard {rep.shard} kept changing while read")

    def write_snapshot(self, rep: ShardReplica) -> None:
        """Write ``rep`` as the snapshot of its shard at its batch ``seq`` (chunks, then
        the head, in a transaction that succeeds only if the head is still the one read:
        snapshots only move forward), then trim the log and the older snapshot behind
        it.  Any master may write one: each is a pure function of the log."""
        cid, shard, seq, me = self.cluster_id, rep.shard, rep.seq, self.writer_id
        hkey = snapshot_head_key(cid, shard)
        out = self.gw._post("kv/range", {"key": _b64(hkey.encode())})
        kvs = out.get("kvs") or []
        old = msgpack.unpackb(_unb64(kvs[0]["value"]), raw=False) if kvs else None
        if old is not None and old["seq"] >= seq:
            rep.records_since_snapshot = 0
            return
        chunks = rep.snapshot_chunks()
        for i, chunk in enumerate(chunks):
            self.gw._post("kv/put", {
                "key": _b64(snapshot_chunk_key(cid, shard, seq, me, i).encode()),
                "value": _b64(chunk)})
        guard = ({"key": _b64(hkey.encode()), "result": "EQUAL", "target": "MOD",
                  "mod_revision": kvs[0]["mod_revision"]} if kvs else
                 {"key": _b64(hkey.encode()), "result": "EQUAL", "target": "CREATE",
                  "create_revision": "0"})
        done = self.gw._post("kv/txn", {
            "compare": [guard],
            "success": [{"request_put": {"key": _b64(hkey.encode()),
                                         "value": _b64(rep.snapshot_head(len(chunks), me))}}]})
        if not done.get("succeeded"):  # another master's came first: drop ours
            d = _snapshot_dir(cid, shard, seq, me)
            self.gw._post("kv/deleterange", {"key": _b64(d.encode()),
                                             "range_end": _b64(_prefix_end(d).encode())})
            return
        # Behind the head: the log batches before seq, and the older snapshot.
        first = f"{oplog_prefix(cid)}{shard:04d}/"
        self.gw._post("kv/deleterange", {
            "key": _b64(first.encode()),
            "range_end": _b64(batch_key(cid, shard, seq).encode())})
        if old is not None:
            d = _snapshot_dir(cid, shard, old["seq"], old["writer"])
            self.gw._post("kv/deleterange", {"key": _b64(d.encode()),
                                             "range_end": _b64(_prefix_end(d).encode())})
        rep.records_since_snapshot = 0
        self.snapshots_written += 1
        self.snapshot_wall = max(self.snapshot_wall, rep.last_wall)
        log.info("[ha] op log of shard %d: snapshot at batch %d written (%d objects, "
                 "%d chunks); the log before it trimmed", shard, seq, len(rep.objects),
                 len(chunks))

    def catch_up(self) -> list[ShardReplica]:
        """Read every log to its end and stop following; -> the replicas."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.error is not None:
            raise ValueError(self.error)
        self.poll(check_heads=True)
        return self.replicas

    def status(self) -> dict[str, Any]:
        return {"applied_batches": sum(r.seq for r in self.replicas),
                "objects": sum(len(r.objects) for r in self.replicas),
                "snapshots_written": self.snapshots_written,
                "snapshots_loaded": self.snapshots_loaded,
                "snapshot_age_s": (max(0.0, time.time() - self.snapshot_wall)
                                   if self.snapshot_wall else None),
                "caught_up_age_s": (time.monotonic() - self.caught_up_at
                                    if self.caught_up_at else None),
                "last_batch_wall": max((r.last_wall for r in self.replicas), default=0.0)}


def _meta_key(cluster_id: str) -> str:
    return f"/kvmaster/{cluster_id}/oplog-meta"


class HotStandby:
    """The front's side of ``--ha-oplog``: follows the log while standing by, reads it to
    the end once elected, then hands each shard its :class:`Adoption` and its
    :class:`~kvmaster._shard_oplog.ShardLog` (:meth:`promote`).

    The log's shape is fixed by its first leader (``/kvmaster/<cluster>/oplog-meta``:
    version and shard count): a master with another ``--shards`` refuses to lead it.
    """

    def __init__(self, config: Any, loop: Any) -> None:
        self.config = config
        self.loop = loop
        endpoints = [e.strip() for e in config.etcd_endpoints.split(",") if e.strip()]
        self.gw = EtcdGateway(endpoints, timeout_s=max(0.5, config.ha_lease_ttl / 3))
        self.follower = OpLogFollower(self.gw, config.cluster_id, config.shard_count,
                                      snapshot_records=config.ha_oplog_snapshot_records)
        self.writer: OpLogWriter | None = None
        self.caught_up_s = 0.0
        self.adopted = 0

    def start(self, reporter: Callable[[], tuple[str, int]] | None = None) -> None:
        """Follow the log; ``reporter``: see OpLogFollower.reporter."""
        self.follower.reporter = reporter
        self.follower.start()

    def elected(self, still_leader: Callable[[], bool], done: Callable[[str | None], None]) -> None:
        """Once elected (any thread): read the log to its end on a thread of its own
        (the election thread keeps the lease alive meanwhile), then ``done(None)`` on
        the loop, or ``done(reason)`` when this master must not lead the log."""
        def run() -> None:
            started = time.monotonic()
            while still_leader():
                try:
                    reason = self._check_meta()
                    if reason is None:
                        self.follower.catch_up()
                        self.follower.unreport()  # (a leader is no standby)
                    break
                except EtcdError as exc:
                    log.warning("[ha] op log catch-up: %s; retrying", exc)
                    time.sleep(0.1)
                except ValueError as exc:
                    reason = str(exc)
                    break
            else:
                return
            self.caught_up_s = time.monotonic() - started
            self.loop.call_soon_threadsafe(done, reason)

        threading.Thread(target=run, daemon=True, name="kvmaster-oplog-catch-up").start()

    def _check_meta(self) -> str | None:
        key = _meta_key(self.config.cluster_id)
        mine = json.dumps({"version": OPLOG_VERSION, "shards": self.config.shard_count})
        self.gw._post("kv/txn", {
            "compare": [{"key": _b64(key.encode()), "result": "EQUAL", "target": "CREATE",
                         "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key.encode()), "value": _b64(mine.encode())}}],
        })
        got = self.gw.get(key)
        if got is None:
            raise EtcdError("the op log's meta key vanished")
        meta = json.loads(got)
        if meta != json.loads(mine):
            return (f"the op log of cluster {self.config.cluster_id!r} was written by masters "
                    f"with {meta} and this one has {json.loads(mine)} (same --shards needed)")
        return None

    def promote(self, shards: list[Any], lease_id: int,
                on_fenced: Callable[[str], None]) -> None:
        """On the loop, before serving: adopt the replicated objects, start logging."""
        cfg = self.config
        replicas = self.follower.replicas
        now = time.monotonic()
        self.writer = OpLogWriter(
            self.gw, cfg.cluster_id, lease_id, [r.seq for r in replicas], self.loop,
            on_durable=lambda i, seq: shards[i].log.durable(seq), on_fenced=on_fenced,
            delay_s=cfg.ha_oplog_delay_ms / 1000.0, max_batch=cfg.ha_oplog_max_batch,
            max_pending=cfg.ha_oplog_max_pending, fail_limit_s=float(cfg.ha_lease_ttl))
        from kvmaster._shard_oplog import Adoption, ShardLog

        for shard, rep in zip(shards, replicas):
            if rep.objects:
                shard.adoption = Adoption(rep, now + cfg.ha_remount_grace)
                self.adopted += len(rep.objects)
            shard.log = ShardLog(shard, self.writer)
        # The adoptions hold the objects now; the follower's indexes go.
        self.follower.replicas = [ShardReplica(r.shard) for r in replicas]
        log.info("[ha] op log read to its end in %.3f s: %d objects in %d batches wait for "
                 "their segments (grace %.3g s)", self.caught_up_s, self.adopted,
                 sum(r.seq for r in replicas), cfg.ha_remount_grace)

    def drain(self, timeout_s: float) -> None:
        """A clean stop of the leader: its last records to etcd (see OpLogWriter.drain)."""
        if self.writer is not None and not self.writer.drain(timeout_s):
            log.warning("[ha] op log: %d records not in etcd at the stop",
                        self.writer.pending_records())

    def stop(self) -> None:
        self.follower.stop()
        if self.writer is not None:
            self.writer.stop()

    def status(self) -> dict[str, Any]:
        """For STATS and the metrics: the follower's state, or the writer's."""
        if self.writer is None:
            out = {"role": "standby", **self.follower.status()}
            last = out.get("last_batch_wall") or 0.0
            out["lag_s"] = max(0.0, time.time() - last) if last else None
            return out
        w = self.writer
        head, now = sum(w.seq), time.time()
        me = self.follower.reporter()[0] if self.follower.reporter is not None else None
        standbys = [{"endpoint": r.get("endpoint"),
                     "behind_batches": max(0, head - int(r.get("applied_batches", 0))),
                     "lag_s": max(0.0, now - float(r.get("caught_up_wall", now))),
                     "snapshot_age_s": (max(0.0, now - float(r["snapshot_wall"]))
                                        if r.get("snapshot_wall") else None)}
                    for r in w.standbys if r.get("endpoint") != me]
        return {"role": "leader", "pending_records": w.pending_records(),
                "standbys": standbys,
                "adopted_objects": self.adopted, "catch_up_s": self.caught_up_s,
                **w.counters}
