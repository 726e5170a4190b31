"""HTTP endpoint for operators: ``/metrics`` (Prometheus text), ``/health``, ``/ready``.

:class:`MetricsServer` runs a small HTTP server in its own thread
(``kvmaster-metrics``).  It never reads master or shard state directly: for
every request it schedules ``master.snapshot()`` on the master's event loop
with :func:`asyncio.run_coroutine_threadsafe` and waits at most
``timeout_s``.  The snapshot is gathered by message (each shard answers a
``stats`` message from its inbox, in turn with client requests), so a scrape
sees every shard's own counters without locks.  A snapshot that does not come
back in time answers 503: a stuck loop shows up as a failed scrape and a
failed ``/health``.

Metric names follow ``mooncake_master``'s where the concept is the same
(``master_key_count``, ``master_evicted_key_count``, ...), so dashboards built
for it keep working.  Mooncake exposes a few counters without the ``_total``
suffix; they keep their exact names here and are typed ``untyped`` because
the Prometheus client library adds ``_total`` to anything typed counter.

:func:`metric_families` turns one snapshot into metric families; it is a pure
function, tested on its own.  Counter fields that shards do not count yet are
rendered as soon as they appear in the snapshot under the flat names
documented next to :data:`OP_FIELD` and :data:`HISTOGRAMS`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from kvmaster import __version__
from kvmaster._limits import PARKED_MAX_AGE_S

__all__ = ["MetricsServer", "SnapshotUnavailable", "metric_families"]

log = logging.getLogger(__name__)

#: Longest wait for a snapshot before a request is answered 503.
SNAPSHOT_TIMEOUT_S = 2.0

# (stats field, metric name, help).  Gauges of the whole master: sums over shards.
_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("keys", "master_key_count", "Keys of complete objects"),
    ("soft_pinned_keys", "master_soft_pin_key_count",
     "Keys soft-pinned now, by a TTL pin or a pinned session"),
    ("hard_pinned_keys", "master_hard_pin_key_count", "Hard-pinned keys (never evicted)"),
    ("pending_writes", "master_pending_put_count",
     "Puts started and not yet ended, revoked or released"),
    ("given_up_writes", "master_given_up_put_count",
     "Puts given up on (taken over, released, dropped with a segment) whose space is "
     "held until their writer ends, revokes or leaves"),
    ("allocated_bytes", "master_allocated_bytes",
     "Bytes allocated across all segments (replicas, in-flight and given-up puts, frees "
     "deferred by leases)"),
    ("capacity_bytes", "master_total_capacity_bytes", "Capacity across all mounted segments"),
    ("soft_pinned_bytes", "master_soft_pin_bytes", "Bytes of soft-pinned objects"),
    ("hard_pinned_bytes", "master_hard_pin_bytes", "Bytes of hard-pinned objects"),
    ("sessions", "master_kv_session_count", "Live KV sessions"),
    ("pinned_sessions", "master_pinned_kv_session_count", "Pinned KV sessions"),
    ("memberships", "master_kv_session_membership_count",
     "Session-object associations (sum of session sizes)"),
    ("open_walks", "master_kv_session_open_walk_count",
     "Cross-shard session operations waiting for other shards"),
)

# Counters of the whole master: sums over shards.  A name without ``_total`` is
# Mooncake's exact name and is exposed untyped (see the module docstring).
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("alloc_failures", "master_put_start_alloc_failures_total",
     "PutStart keys refused for lack of space after eviction"),
    ("evicted_keys", "master_evicted_key_count", "Keys evicted (counter)"),
    ("evicted_bytes", "master_evicted_size_bytes", "Bytes of evicted objects (counter)"),
    ("eviction_rounds", "master_successful_evictions_total", "Eviction rounds that freed space"),
    ("eviction_attempts", "master_attempted_evictions_total", "Eviction rounds started"),
    ("evicted_soft_pinned_keys", "master_evicted_soft_pin_key_count",
     "Soft-pinned keys evicted because nothing else was left (counter)"),
    ("put_start_discarded", "master_put_start_discard_cnt",
     "Unfinished puts taken over by another writer after the discard timeout (counter)"),
    ("put_start_released", "master_put_start_release_cnt",
     "Unfinished puts dropped at the release timeout; their space is freed when their "
     "writer ends, revokes or leaves (counter)"),
    ("leases_granted", "master_leases_granted_total", "Read leases granted or renewed"),
    ("session_tagged_writes", "master_session_tagged_writes_total",
     "Writes started with a session tag (Mooncake's ReplicateConfig.session_ids)"),
    ("objects_erased_with_segment", "master_segment_erased_keys_total",
     "Keys erased because their last replica's segment was unmounted"),
    ("writes_dropped_with_segment", "master_segment_dropped_puts_total",
     "Unfinished puts dropped because a segment holding a replica was unmounted"),
    ("writes_dropped_with_writer", "master_writer_gone_dropped_puts_total",
     "Unfinished puts dropped, their space freed, because their writer said BYE or "
     "was expired"),
    ("stranded_writes_freed_with_writer", "master_writer_gone_freed_given_up_puts_total",
     "Puts given up on earlier (taken over, released, dropped with a segment) whose "
     "space was freed because their writer said BYE or was expired"),
    ("write_limit_rejections", "master_put_start_write_limit_rejections_total",
     "PutStart keys refused because their client held --max-writes-per-client writes"),
    ("corrupt_replicas_dropped", "master_corrupt_replicas_dropped_total",
     "Replicas dropped because a reader found their bytes not matching the object's "
     "checksum (DROP_CORRUPT_REPLICAS)"),
    ("sessions_created", "master_kv_sessions_created_total", "KV sessions created"),
    ("sessions_deleted", "master_kv_sessions_deleted_total", "KV sessions deleted"),
    ("session_walk_pages", "master_kv_session_walk_pages_total",
     "Messages sent to other shards by cross-shard session operations"),
    ("session_limit_rejections", "master_kv_session_limit_rejections_total",
     "Session operations refused by a session limit"),
    ("memberships_added", "master_kv_session_memberships_added_total",
     "Session-object associations added"),
    ("memberships_removed", "master_kv_session_memberships_removed_total",
     "Session-object associations removed"),
    ("groups_created", "master_key_groups_created_total",
     "Key groups (ReplicateConfig.group_ids) created at their home shard"),
    ("groups_deleted", "master_key_groups_deleted_total", "Key groups dropped when empty"),
    ("group_evicted_keys", "master_key_group_evicted_keys_total",
     "Keys evicted because another member of their group was evicted"),
    ("group_limit_rejections", "master_key_group_limit_rejections_total",
     "Grouped writes refused GROUP_LIMIT_EXCEEDED"),
    ("group_lease_messages", "master_key_group_lease_messages_total",
     "Messages telling a group's home that a member was leased (coalesced)"),
)

# Counters of the front (ROUTER owner).
_FRONT_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("rejected_busy", "master_busy_rejections_total", "Requests the front answered BUSY (a full shard inbox, or too many master-level requests in progress)"),
    ("rate_parked", "master_rate_parked_messages_total",
     "Request messages parked by their tenant's request rate (--tenant-max-requests-per-s)"),
    ("rate_dropped", "master_rate_dropped_messages_total",
     "Request messages dropped unanswered: their tenant, or all tenants, had the most "
     "messages or bytes parked"),
    ("rate_expired", "master_rate_expired_messages_total",
     f"Parked request messages dropped unanswered after {PARKED_MAX_AGE_S:g} s parked"),
    ("stalled_dropped", "master_stalled_peer_drops_total",
     "Requests dropped unhandled: the peer's last reply was dropped under 0.1 s before"),
    ("rejected_unregistered", "master_unregistered_rejections_total",
     "Requests refused because the sender had not said HELLO"),
    ("malformed", "master_malformed_requests_total", "Malformed or undecodable requests"),
    ("reply_dropped", "master_dropped_replies_total",
     "Replies that could not be sent (peer gone or its queue full)"),
    ("clients_expired", "master_expired_clients_total",
     "Clients expired after client_ttl (and client_suspicion_ttl) without a request or "
     "heartbeat"),
    ("clients_suspected", "master_suspected_clients_total",
     "Clients silent past client_ttl that were suspected (client_suspicion_ttl > 0)"),
    ("clients_recovered", "master_recovered_clients_total",
     "Suspected clients heard from again before client_suspicion_ttl ran out"),
    ("hello", "master_hello_requests_total", "HELLO handshakes"),
    ("multi_request_messages", "master_multi_request_messages_total",
     "Messages that carried several requests (protocol 1.2)"),
)

# --ha-oplog (kvmaster/_oplog.py): STATS "oplog", a standby's follower or the leader's writer.
_OPLOG_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("applied_batches", "master_oplog_applied_batches",
     "Standby: op-log batches applied (over all shards, snapshots included)"),
    ("objects", "master_oplog_replica_objects", "Standby: objects in its replica of the op log"),
    ("caught_up_age_s", "master_oplog_lag_seconds",
     "Standby: seconds since it last read every shard's op log to its end"),
    ("snapshot_age_s", "master_oplog_snapshot_age_seconds",
     "Standby: age of the newest op-log snapshot it wrote or loaded (by the leader's clock)"),
    ("snapshots_written", "master_oplog_snapshots_written",
     "Standby: op-log snapshots it wrote (each trims the log behind it)"),
    ("snapshots_loaded", "master_oplog_snapshots_loaded",
     "Standby: op-log snapshots it started from (new, or behind a trim)"),
    ("pending_records", "master_oplog_pending_records",
     "Leader: op-log records not yet in etcd (frees wait for them)"),
    ("oplog_records", "master_oplog_records_written", "Leader: op-log records written to etcd"),
    ("oplog_bytes", "master_oplog_bytes_written", "Leader: op-log bytes written to etcd"),
    ("oplog_retries", "master_oplog_write_retries", "Leader: op-log writes retried (etcd errors)"),
    ("adopted_objects", "master_oplog_adopted_objects",
     "Leader: objects taken over from the op log at its promotion"),
)

# Per-shard series, label ``shard``.
_SHARD_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("keys", "master_shard_key_count", "Keys of complete objects per shard"),
    ("allocated_bytes", "master_shard_allocated_bytes", "Bytes allocated per shard"),
    ("capacity_bytes", "master_shard_capacity_bytes", "Capacity of the shard's segment shares"),
    ("inbox_depth", "master_shard_queue_depth",
     "Messages waiting in the shard's inbox when it answered the snapshot"),
    ("sessions", "master_shard_kv_session_count", "Live KV sessions whose home is the shard"),
)
_SHARD_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("requests", "master_shard_requests_total", "Client requests handled per shard"),
    ("failures", "master_shard_failures_total",
     "Client requests per shard answered with a non-zero status"),
    ("evicted_keys", "master_shard_evicted_keys_total", "Keys evicted per shard"),
)

#: Per-op counters, as flat stats fields ``op.<op name>.<kind>`` (op name in lower
#: case, e.g. ``op.batch_put_start.items``), counted by shards and the front and
#: summed here: ``master_<op name>_<kind>_total`` as in Mooncake
#: (``master_put_start_requests_total``, ``master_batch_put_start_items_total``).
OP_FIELD = "op."
_OP_KINDS = {
    "requests": "Requests of this op received",
    "failures": "Requests of this op answered with a non-zero status",
    "items": "Keys in requests of this batch op",
    "failed_items": "Keys of this batch op answered with a negative code (for a batch "
                    "start, OBJECT_ALREADY_EXISTS too: a client counts it as success)",
    "partial_successes": "Requests of this batch op with some keys failed and some not",
}

# Key lookups by result: stats field -> (op, result) labels of master_lookup_keys_total.
_LOOKUPS = {
    "get_hit_keys": ("get", "hit"), "get_miss_keys": ("get", "miss"),
    "exist_hit_keys": ("exist", "hit"), "exist_miss_keys": ("exist", "miss"),
}

#: Per-shard histograms: stats field prefix -> (metric, help, unit scale).  A shard
#: counts, per bucket, the observations with value <= the bucket's bound and
#: above the previous bound (not cumulative), as ``<prefix><bound>`` and
#: ``<prefix>inf``, with the sum of observed values as ``<prefix>sum``.
HISTOGRAMS: dict[str, tuple[str, str, float]] = {
    "service_us.": ("master_shard_service_seconds",
                    "Time a shard spent on one client request (decode, handle, encode)", 1e-6),
    "queue_depth.": ("master_shard_queue_depth_observed",
                     "Inbox depth seen each time a shard starts draining its inbox", 1.0),
}


class SnapshotUnavailable(RuntimeError):
    """The master's loop did not answer a snapshot in time (or is gone)."""


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _counter(name: str, doc: str, labels: Iterable[str] = ()) -> Metric:
    if name.endswith("_total"):
        return CounterMetricFamily(name, doc, labels=list(labels))
    return UnknownMetricFamily(name, doc, labels=list(labels))


def _add(metric: Metric, labels: list[str], value: float) -> None:
    metric.add_metric(labels, value)  # type: ignore[attr-defined]


def _op_families(fields: dict[str, Any]) -> Iterator[Metric]:
    sums: dict[tuple[str, str], float] = {}
    for k, v in fields.items():
        if not k.startswith(OP_FIELD) or _number(v) is None:
            continue
        op, _, kind = k[len(OP_FIELD):].rpartition(".")
        if kind in _OP_KINDS and op.replace("_", "").isalnum() and op.islower():
            sums[op, kind] = sums.get((op, kind), 0.0) + float(v)
    for (op, kind), v in sorted(sums.items()):
        m = CounterMetricFamily(f"master_{op}_{kind}_total", f"{_OP_KINDS[kind]} ({op})")
        m.add_metric([], v)
        yield m


def _bucket_bound(tail: str) -> float | None:
    if tail == "inf":
        return float("inf")
    try:
        return float(tail)
    except ValueError:
        return None


def _histogram_family(prefix: str, shards: list[dict[str, Any]]) -> Metric | None:
    metric, doc, scale = HISTOGRAMS[prefix]
    fam: HistogramMetricFamily | None = None
    for i, s in enumerate(shards):
        counts: list[tuple[float, float]] = []
        for k, v in s.items():
            if k.startswith(prefix) and _number(v) is not None:
                bound = _bucket_bound(k[len(prefix):])
                if bound is not None:
                    counts.append((bound, float(v)))
        if not counts:
            continue
        counts.sort()
        if counts[-1][0] != float("inf"):
            counts.append((float("inf"), 0.0))
        buckets, running = [], 0.0
        for bound, n in counts:
            running += n
            buckets.append(("+Inf" if bound == float("inf") else f"{bound * scale:.9g}", running))
        if fam is None:
            fam = HistogramMetricFamily(metric, doc, labels=["shard"])
        fam.add_metric([str(s.get("shard", i))], buckets,
                       (_number(s.get(prefix + "sum")) or 0.0) * scale)
    return fam


def metric_families(snap: dict[str, Any]) -> list[Metric]:
    """Metric families of one ``Master.snapshot()`` result."""
    total: dict[str, Any] = snap.get("total", {})
    shards: list[dict[str, Any]] = snap.get("shards", [])
    front: dict[str, Any] = snap.get("front", {})
    out: list[Metric] = []

    info = GaugeMetricFamily("master_info", "Constant 1, labelled with the master's version",
                             labels=["version"])
    info.add_metric([__version__], 1)
    out.append(info)
    state = GaugeMetricFamily("master_state", "1 for the master's current state",
                              labels=["state"])
    for name in ("standby", "running", "draining", "stopped"):
        state.add_metric([name], 1.0 if snap.get("state") == name else 0.0)
    out.append(state)
    for field, name, doc in (("clients", "master_active_clients", "Registered clients"),
                             ("segments", "master_mounted_segment_count", "Mounted segments")):
        if _number(snap.get(field)) is not None:
            out.append(GaugeMetricFamily(name, doc, value=snap[field]))
    out.append(GaugeMetricFamily("master_shard_count", "Shard actors", value=len(shards)))
    oplog = snap.get("oplog") or {}
    for field, name, doc in _OPLOG_GAUGES:
        if _number(oplog.get(field)) is not None:
            out.append(GaugeMetricFamily(name, doc, value=oplog[field]))
    standbys = oplog.get("standbys") or []
    for field, name, doc in (
            ("lag_s", "master_oplog_standby_lag_seconds",
             "Leader: seconds since each standby last read the op log to its end"),
            ("behind_batches", "master_oplog_standby_behind_batches",
             "Leader: op-log batches each standby has not applied yet")):
        rows = [(str(sb.get("endpoint")), sb[field]) for sb in standbys
                if _number(sb.get(field)) is not None]
        if rows:
            fam = GaugeMetricFamily(name, doc, labels=["standby"])
            for label, v in rows:
                fam.add_metric([label], v)
            out.append(fam)

    for field, name, doc in _GAUGES:
        if _number(total.get(field)) is not None:
            out.append(GaugeMetricFamily(name, doc, value=total[field]))
    for fields, table in ((total, _COUNTERS), (front, _FRONT_COUNTERS)):
        for field, name, doc in table:
            if _number(fields.get(field)) is not None:
                m = _counter(name, doc)
                _add(m, [], fields[field])
                out.append(m)

    lookups = [(labels, total[f]) for f, labels in _LOOKUPS.items()
               if _number(total.get(f)) is not None]
    if lookups:
        m = CounterMetricFamily("master_lookup_keys_total",
                                "Keys looked up by get (replica list) and exist, by result",
                                labels=["op", "result"])
        for labels, v in lookups:
            m.add_metric(list(labels), v)
        out.append(m)
    merged_ops = dict(total)
    for k, v in front.items():
        if k.startswith(OP_FIELD) and _number(v) is not None:
            merged_ops[k] = (_number(merged_ops.get(k)) or 0.0) + float(v)
    # A per-op name never replaces one above (the front's HELLO count, say).
    taken = {m.name for m in out}
    out.extend(m for m in _op_families(merged_ops) if m.name not in taken)

    for table, make in ((_SHARD_GAUGES, GaugeMetricFamily), (_SHARD_COUNTERS, None)):
        for field, name, doc in table:
            rows = [(str(s.get("shard", i)), s[field]) for i, s in enumerate(shards)
                    if _number(s.get(field)) is not None]
            if not rows:
                continue
            fam_s: Any = (make(name, doc, labels=["shard"]) if make
                          else _counter(name, doc, ["shard"]))
            for shard, v in rows:
                _add(fam_s, [shard], v)
            out.append(fam_s)
    for prefix in HISTOGRAMS:
        hist = _histogram_family(prefix, shards)
        if hist is not None:
            out.append(hist)
    if _number(snap.get("_snapshot_s")) is not None:
        out.append(GaugeMetricFamily(
            "master_metrics_snapshot_seconds",
            "Time this scrape waited for every shard's stats (grows with loop load)",
            value=snap["_snapshot_s"]))
    return out


class _MasterCollector:
    """prometheus_client collector over ``fetch()`` (one snapshot per collect)."""

    def __init__(self, fetch: Callable[[], dict[str, Any]]) -> None:
        self._fetch = fetch

    def describe(self) -> list[Metric]:
        # Nothing to check against other collectors, and a scrape must not run
        # at registration time.
        return []

    def collect(self) -> Iterator[Metric]:
        yield from metric_families(self._fetch())


#: Connections the metrics endpoint serves at once; one more is closed unanswered.
MAX_CONNECTIONS = 16
#: Seconds a connection may take to send its request line and headers (and to
#: read the answer): a slow or silent peer is cut off then.
CONNECTION_TIMEOUT_S = 5.0


class _BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with at most ``MAX_CONNECTIONS`` request threads: a
    connection over the bound is closed at once (counted in ``refused``)."""

    daemon_threads = True

    def __init__(self, *args: Any, max_connections: int = MAX_CONNECTIONS, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsServer:
    """HTTP server for ``/metrics``, ``/health`` and ``/ready`` of one master.

    Runs a ``ThreadingHTTPServer`` in the thread ``kvmaster-metrics`` (plus one
    thread per connection, at most :data:`MAX_CONNECTIONS`: another connection is
    closed unanswered, and a connection silent for :data:`CONNECTION_TIMEOUT_S`
    is closed); reads master state only through ``master.snapshot()`` scheduled
    on ``loop``.  Each server has its own registry, so several masters in one
    process (tests) never share series.
    """

    def __init__(self, master: Any, loop: asyncio.AbstractEventLoop, host: str, port: int,
                 timeout_s: float = SNAPSHOT_TIMEOUT_S) -> None:
        self.master = master
        self.loop = loop
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_MasterCollector(self.snapshot))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def snapshot(self) -> dict[str, Any]:
        """The master's stats, waited for at most ``timeout_s``.  Called from HTTP
        threads, never from the loop.  Raises SnapshotUnavailable."""
        t0 = time.perf_counter()
        if self.loop.is_closed():
            raise SnapshotUnavailable("master loop not running: it is closed")
        coro = self.master.snapshot()
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError as exc:  # closed in between: the master is stopping
            coro.close()
            raise SnapshotUnavailable(f"master loop not running: {exc}") from None
        try:
            snap = dict(fut.result(timeout=self.timeout_s))
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise SnapshotUnavailable(
                f"master did not answer a snapshot within {self.timeout_s:g} s") from None
        except concurrent.futures.CancelledError:
            raise SnapshotUnavailable("snapshot cancelled: the master is stopping") from None
        except Exception as exc:  # noqa: BLE001 - any failure is a failed scrape
            log.warning("[metrics] snapshot failed: %r", exc)
            raise SnapshotUnavailable(f"snapshot failed: {type(exc).__name__}: {exc}") from None
        snap["_snapshot_s"] = time.perf_counter() - t0
        return snap

    def start(self) -> str:
        """Bind and serve in a thread; returns ``http://host:port``.  Raises OSError."""
        server = _BoundedHTTPServer((self.host, self.port), _handler_class(self))
        self._server = server
        # A short poll interval keeps shutdown (and so the master's stop) quick.
        self._thread = threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True,
                                        name="kvmaster-metrics")
        self._thread.start()
        host, port = str(server.server_address[0]), int(server.server_address[1])
        log.info("[metrics] serving url=http://%s:%d", host, port)
        return f"http://{host}:{port}"

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # ------------------------------------------------------------ endpoints

    def render_metrics(self) -> tuple[int, str, bytes]:
        try:
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        except SnapshotUnavailable as exc:
            return 503, "text/plain; charset=utf-8", f"{exc}\n".encode()

    def health(self) -> tuple[int, str, bytes]:
        """200 while the process is up and its loop answers a snapshot."""
        try:
            snap = self.snapshot()
        except SnapshotUnavailable as exc:
            return _json(503, {"status": "unavailable", "reason": str(exc)})
        return _json(200, {"status": "ok", "state": snap.get("state"),
                           "snapshot_ms": round(snap["_snapshot_s"] * 1000, 3)})

    def ready(self) -> tuple[int, str, bytes]:
        """200 when the master is RUNNING and at least one segment is mounted."""
        try:
            snap = self.snapshot()
        except SnapshotUnavailable as exc:
            return _json(503, {"ready": False, "reason": str(exc)})
        state, segments = snap.get("state"), snap.get("segments", 0)
        if state != "running":
            return _json(503, {"ready": False, "reason": f"master is {state}",
                               "segments": segments})
        if not segments:
            return _json(503, {"ready": False, "reason": "no segment mounted", "segments": 0})
        return _json(200, {"ready": True, "state": state, "segments": segments})


def _json(status: int, body: dict[str, Any]) -> tuple[int, str, bytes]:
    return status, "application/json", (json.dumps(body) + "\n").encode()


def _handler_class(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
        "/metrics": server.render_metrics, "/health": server.health, "/ready": server.ready}

    class Handler(BaseHTTPRequestHandler):
        server_version = f"kvmaster/{__version__}"
        timeout = CONNECTION_TIMEOUT_S  # socket timeout: a slow-loris peer is cut off

        def _respond(self, head_only: bool) -> None:
            route = routes.get(self.path.split("?", 1)[0].rstrip("/") or "/")
            if route is None:
                status, ctype, body = 404, "text/plain; charset=utf-8", \
                    b"not found; endpoints: /metrics /health /ready\n"
            else:
                status, ctype, body = route()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if not head_only:
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._respond(False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._respond(True)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            if log.isEnabledFor(logging.DEBUG):
                log.debug("[metrics] %s %s", self.address_string(), format % args)

    return Handler
