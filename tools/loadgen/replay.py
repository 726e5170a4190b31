"""Session-aware trace replay against a kvmaster master with data-parallel worker processes.

Processes.  The dispatcher (the calling process) reads the trace, runs the
:class:`~kvmaster.tools.loadgen.sessions.SessionPlanner` online, and sends
tasks to ``workers`` spawned worker processes, each with its own client and
shared-memory segment of ``ceil(capacity_blocks / workers) * block_bytes``
bytes.  Blocks written by one worker are read by the others through the store.

Order.  Requests are paced by their timestamps scaled by ``speed`` (0 = as
fast as the workers go).  A session's tasks run one at a time, in order: the
next turn of a conversation waits for the previous one to finish (its prompt
contains that turn's answer), and its unpin or close never overtakes it.
Meanwhile nothing later is sent (in-order issue), unless ``reorder`` lets
other sessions' requests overtake it: more throughput at ``--speed 0``, but
sessions then drift apart in trace time and the interleaving (and the hit
rate) departs from the trace's.  At most ``queue_depth`` tasks are in flight
per worker, which keeps the trace clock of the dispatcher close to what the
workers are doing (timers fire in trace time).

Routing (``routing``): ``affinity`` keeps a session on one worker (a new
session goes to the least busy worker), ``round-robin`` and ``random`` spread requests; a session's
unpin and close go to the worker of its last request.

Per request (:func:`process_request`): ``batch_is_exist`` of its keys, then
``get_batch`` of the leading present run, each block checked against its
deterministic payload (which also names the worker that wrote it), then
``put_batch`` of the rest, tagged with the session for full blocks; then the
session calls: attach hits the session does not hold yet, update to the new
keep set if the conversation was truncated, pin.  Workers acknowledge every
task with its outcome; the dispatcher keeps per-request results (hit rate
over trace time), a sampler thread polls the master's counters (pinned keys
over time) and its process (RSS, CPU).  See :func:`run_replay` for the result.
"""

from __future__ import annotations

import contextlib
import cProfile
import importlib
import io
import json
import logging
import math
import multiprocessing as mp
import os
import pstats
import queue
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvmaster._alloc import align_up
from kvmaster.config import MasterConfig
from kvmaster.errors import Busy, LeaseExpired, SessionNotFound

from .monitor import MasterProcess, Sampler, find_listening_pid
from .payload import block_key, block_payload, payload_writer
from .reference import belady_prefix_hit_rate, lru_prefix_hit_rate, policy_prefix_hit_rate
from .sessions import SessionPlanner, SessionPolicy, Task, continued_requests
from .stats import LatencyRecorder, prefill_saved
from .traces import TRACE_FORMATS, Request, load_trace

logger = logging.getLogger(__name__)

__all__ = [
    "CODE_ALREADY_EXISTS",
    "CODE_NO_AVAILABLE_HANDLE",
    "MAX_BATCH",
    "ROUTINGS",
    "LoadgenConfig",
    "LoadgenError",
    "RequestOutcome",
    "embedded_master",
    "format_summary",
    "load_config_trace",
    "process_request",
    "run_replay",
]

#: Largest batch the master accepts; longer key lists are split.
MAX_BATCH = 4096
#: put_batch code for a key that is already stored (not a failure).
CODE_ALREADY_EXISTS = -705
#: put_batch code when the master finds no space (counted as a put failure).
CODE_NO_AVAILABLE_HANDLE = -200
#: Values of ``routing``.
ROUTINGS = ("affinity", "round-robin", "random")

_LISTEN_RE = re.compile(r"listening on tcp://(\S+):(\d+)")
_PROGRESS_INTERVAL_S = 0.2
_POLL_S = 0.1
_MAX_TTL_MS = 86_400_000  # the master's default --max-kv-soft-pin-ttl
_BUSY_RETRIES = 20
_AUDIT_EXAMPLES = 5
_TIME_BUCKETS = 60
_TTL_WARMUP_S = 2.0
#: Longest the dispatcher waits for any one worker answer before giving up.
_STALL_S = 600.0
_TTL_GUESS_RPS = 400.0
_WATERMARK_FLAG = "--eviction-high-watermark-ratio"


class LoadgenError(RuntimeError):
    """A replay could not run (master did not start, a worker failed, ...)."""


@dataclass(frozen=True)
class LoadgenConfig:
    """Settings of a replay; each field is a CLI flag of the same name (``--block-bytes``...).

    ``trace``: trace path(s), several joined by ``os.pathsep`` (see
    :func:`~kvmaster.tools.loadgen.traces.load_trace`); ``trace_format``,
    ``stagger_s`` (start offset between kv-cache-tester conversations) or
    ``arrival_rate`` (kv-cache-tester conversations per trace second, Poisson
    arrivals drawn with ``seed``; ``None`` = staggered starts) select how it is
    read.
    ``master``: ``host:port`` of a running master, or ``None`` to start one with
    ``master_shards`` shards (0: the master's default) and, if set, ``--eviction-high-watermark-ratio
    master_watermark``, ``--default-kv-lease-ttl master_lease_ms`` and the
    extra flags ``master_args`` (one string, split like a shell).
    ``master_pid``: for RSS/CPU of a running master (found from the port when
    on this host).
    ``capacity_blocks``: total segment capacity over all workers, in blocks.
    ``speed``: time scaling of the trace timestamps (2.0 = twice as fast);
    0 dispatches as fast as the workers take tasks.
    ``queue_depth``: tasks in flight per worker.  ``reorder``: let requests of
    other sessions overtake one that waits for its session's previous task.
    ``routing``: see :data:`ROUTINGS`.  ``retention``, ``sessions``, ``idle_s``,
    ``end_idle_s``, ``pin_min_turns``, ``end_turn_grace_s``: the session policy
    (trace seconds), see :mod:`~kvmaster.tools.loadgen.sessions`.  ``audit_sessions``: check every
    pin, unpin and close with ``get_kv_session``.
    ``namespace``: key prefix; ``None`` = a fresh random one per run, so a run
    never sees blocks of an earlier run on a shared master.
    ``client_factory``: ``"module:callable"`` returning an unconfigured client.
    ``references``: also compute Belady and the policy model (exact LRU always).
    ``sample_interval_s``: wall seconds between samples of the master's counters.
    ``profile_dir``: run the dispatcher and the workers under cProfile, write there.
    ``prefill_tokens_per_s``: prefill throughput the TTFT saved by prefix hits is
    computed at (see :func:`~kvmaster.tools.loadgen.stats.prefill_saved`).
    """

    trace: str | None = None
    master: str | None = None
    workers: int = 8
    block_bytes: int = 4096
    capacity_blocks: int = 4096
    speed: float = 0.0
    limit: int | None = None
    json_path: str | None = None
    progress: bool = True
    seed: int = 0
    requests: int = 2000
    namespace: str | None = None
    tenant: str = "default"
    queue_depth: int = 2
    reorder: bool = False
    client_factory: str = "kvmaster:Client"
    trace_format: str = "auto"
    stagger_s: float = 60.0
    routing: str = "affinity"
    retention: str = "none"
    sessions: bool = True
    idle_s: float = 450.0
    end_idle_s: float = 1800.0
    pin_min_turns: int = 2
    audit_sessions: bool = False
    master_shards: int = 0
    master_watermark: float | None = None
    master_lease_ms: int | None = None
    master_args: str = ""
    master_pid: int | None = None
    references: bool = True
    sample_interval_s: float = 0.5
    profile_dir: str | None = None
    end_turn_grace_s: float = 5.0
    arrival_rate: float | None = None
    prefill_tokens_per_s: float = 10_000.0

    def validate(self) -> None:
        """Raise ``ValueError`` for out-of-range settings."""
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {self.block_bytes}")
        if self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if not (self.speed >= 0.0 and math.isfinite(self.speed)):
            raise ValueError(f"speed must be a finite number >= 0, got {self.speed}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"limit must be >= 0, got {self.limit}")
        if self.requests < 0:
            raise ValueError(f"requests must be >= 0, got {self.requests}")
        if self.queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {self.queue_depth}")
        if ":" not in self.client_factory:
            raise ValueError("client_factory must be 'module:callable', "
                             f"got {self.client_factory!r}")
        if self.trace_format not in TRACE_FORMATS:
            raise ValueError(f"trace_format must be one of {', '.join(TRACE_FORMATS)}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, "
                             f"got {self.routing!r}")
        if not (self.stagger_s >= 0 and math.isfinite(self.stagger_s)):
            raise ValueError(f"stagger_s must be a finite number >= 0, got {self.stagger_s}")
        if self.master_shards < 0:
            raise ValueError(f"master_shards must be >= 0 (0 = the master's default), "
                             f"got {self.master_shards}")
        if self.master_watermark is not None and not 0.0 < self.master_watermark <= 1.0:
            raise ValueError(f"master_watermark must be in (0, 1], got {self.master_watermark}")
        if self.master_lease_ms is not None and self.master_lease_ms < 1:
            raise ValueError(f"master_lease_ms must be >= 1, got {self.master_lease_ms}")
        shlex.split(self.master_args)
        if not (self.sample_interval_s > 0 and math.isfinite(self.sample_interval_s)):
            raise ValueError(f"sample_interval_s must be > 0, got {self.sample_interval_s}")
        if self.arrival_rate is not None and not (
                self.arrival_rate > 0 and math.isfinite(self.arrival_rate)):
            raise ValueError(f"arrival_rate must be a finite number > 0, got {self.arrival_rate}")
        if not (self.prefill_tokens_per_s > 0 and math.isfinite(self.prefill_tokens_per_s)):
            raise ValueError("prefill_tokens_per_s must be a finite number > 0, "
                             f"got {self.prefill_tokens_per_s}")
        _ = self.high_watermark  # raises on a malformed ratio in master_args
        self.session_policy().validate()

    def session_policy(self) -> SessionPolicy:
        """The :class:`SessionPolicy` these settings describe."""
        return SessionPolicy(retention=self.retention, idle_s=self.idle_s,
                             end_idle_s=self.end_idle_s, pin_min_turns=self.pin_min_turns,
                             sessions=self.sessions, grace_s=self.end_turn_grace_s)

    @property
    def blocks_per_worker(self) -> int:
        """Segment capacity of one worker in blocks (total rounded up to a multiple of workers)."""
        return -(-self.capacity_blocks // self.workers)

    @property
    def segment_bytes(self) -> int:
        """Bytes of segment each worker mounts."""
        return self.blocks_per_worker * self.block_bytes

    @property
    def high_watermark(self) -> float:
        """The master's ``--eviction-high-watermark-ratio``: ``master_watermark``, else the
        flag in ``master_args``, else the master's default.  For a running master
        (``master``) only ``master_watermark`` can state it."""
        if self.master_watermark is not None:
            return self.master_watermark
        args = shlex.split(self.master_args)
        for i, arg in enumerate(args):
            name, eq, value = arg.partition("=")
            if name != _WATERMARK_FLAG:
                continue
            if not eq:
                if i + 1 == len(args):
                    raise ValueError(f"{_WATERMARK_FLAG} in master_args has no value")
                value = args[i + 1]
            ratio = float(value)
            if not 0.0 < ratio <= 1.0:
                raise ValueError(f"{_WATERMARK_FLAG} must be in (0, 1], got {value}")
            return ratio
        return MasterConfig().eviction_high_watermark_ratio

    @property
    def stated_capacity_blocks(self) -> int:
        """Blocks the workers' segments hold together (``capacity_blocks`` rounded up to a
        multiple of ``workers``)."""
        return self.blocks_per_worker * self.workers

    @property
    def effective_capacity_blocks(self) -> int:
        """Blocks the master keeps at most: it evicts once a shard's used bytes pass
        ``high_watermark`` of its capacity (down to the ratio less ``--eviction-ratio``),
        and it stores each block in whole allocation units.  ``floor(high_watermark *
        segments' bytes / aligned block bytes)``."""
        aligned = align_up(self.block_bytes)
        total = self.segment_bytes * self.workers
        # The small epsilon keeps 0.9 * 1000 from flooring to 899.
        return min(self.stated_capacity_blocks,
                   math.floor(self.high_watermark * total / aligned + 1e-9))


def load_config_trace(config: LoadgenConfig) -> list[Request]:
    """The requests ``config`` names (``trace``, ``trace_format``, ``limit``, ``stagger_s``,
    ``arrival_rate`` with ``seed``); see :func:`~kvmaster.tools.loadgen.traces.load_trace`."""
    if config.trace is None:
        raise ValueError("no trace given")
    return load_trace(config.trace, config.trace_format, config.limit, config.stagger_s,
                      config.arrival_rate, config.seed)


# --------------------------------------------------------------------------- per request


@dataclass(slots=True)
class RequestOutcome:
    """What one request did (counts in blocks).

    ``existing_prefix``: leading run reported present by ``batch_is_exist``.
    ``prefix``: leading run actually read back and verified (<= existing_prefix).
    ``cross_worker``: blocks of ``prefix`` whose payload another writer wrote.
    ``put_codes``: negative put codes other than "already exists" -> count.
    ``lease_expired``: reads discarded because they outlived their lease.
    Session calls: ``tagged`` keys written with the session, ``attached`` keys
    (``attach_failures`` refused), ``updates``, ``pins``/``unpins``,
    ``session_missing`` (pin or unpin of a session the master no longer had).
    """

    blocks: int = 0
    lease_expired: int = 0
    existing_prefix: int = 0
    prefix: int = 0
    late_misses: int = 0
    verification_failures: int = 0
    exist_errors: int = 0
    put_blocks: int = 0
    put_failures: int = 0
    put_codes: dict[int, int] = field(default_factory=dict)
    calls: int = 0
    cross_worker: int = 0
    tagged: int = 0
    attached: int = 0
    attach_failures: int = 0
    updates: int = 0
    pins: int = 0
    unpins: int = 0
    session_missing: int = 0


def _timed_batches(client_call: Callable[..., list], op: str, recorder: LatencyRecorder,
                   *columns: Sequence[Any]) -> tuple[list, int]:
    """Call ``client_call`` on chunks of ``columns`` (zipped), recording each call's latency."""
    out: list = []
    calls = 0
    n = len(columns[0])
    for start in range(0, n, MAX_BATCH):
        args = [c[start:start + MAX_BATCH] for c in columns]
        t = time.perf_counter()
        res = client_call(*args)
        recorder.record(op, time.perf_counter() - t)
        calls += 1
        if len(res) != len(args[0]):
            raise LoadgenError(f"{op} returned {len(res)} results for {len(args[0])} keys")
        out.extend(res)
    return out, calls


def _session_call(recorder: LatencyRecorder, op: str, fn: Callable[..., Any],
                  *args: Any) -> Any:
    """A session call timed under ``op``; ``Busy`` (too many walks open) is retried."""
    for attempt in range(_BUSY_RETRIES):
        t = time.perf_counter()
        try:
            res = fn(*args)
        except Busy:
            if attempt + 1 == _BUSY_RETRIES:
                raise
            time.sleep(0.001 * (attempt + 1))
            continue
        finally:
            recorder.record(op, time.perf_counter() - t)
        return res
    raise AssertionError("unreachable")


@dataclass(slots=True)
class Timings:
    """Seconds a worker spent outside client calls (the tool's own work)."""

    payload_s: float = 0.0
    verify_s: float = 0.0


def process_request(client: Any, keys: Sequence[str], block_bytes: int,
                    recorder: LatencyRecorder, *, session: str | None = None,
                    member_prefix: int = 0, tag_blocks: int = 0, trim: bool = False,
                    pin: bool | None = None, writer: int = 0, ttl_ms: int | None = None,
                    timings: Timings | None = None) -> RequestOutcome:
    """Run one request's block traffic (and session calls) on ``client``.

    1. ``batch_is_exist(keys)``: 1 present, 0 absent, negative = error (absent).
    2. ``get_batch`` of the leading present run; ``None`` is a late miss
       (evicted in between), a payload that fails verification is a
       verification failure; the prefix is cut at the first of either.  A
       verified block written by a writer other than ``writer`` is a
       cross-worker hit.
    3. ``put_batch`` of every key from the cut on (``-705`` already exists is
       fine, any other negative code is a put failure); payloads carry
       ``writer``.  With a ``session``, keys before ``tag_blocks`` are tagged
       with it; with ``ttl_ms``, every write is soft-pinned for that long.
    4. With a ``session``: attach the read keys in ``[member_prefix,
       tag_blocks)``, then update membership to ``keys[:tag_blocks]`` if
       ``trim``, then pin (``pin`` True) or unpin (False).
    Latencies go to ``recorder`` under ``batch_is_exist``, ``get_batch``,
    ``put_batch``, ``attach``, ``update``, ``pin``, ``unpin`` (one sample per
    client call) and ``request`` (whole request).
    """
    t0 = time.perf_counter()
    out = RequestOutcome(blocks=len(keys))
    if not keys:
        recorder.record("request", time.perf_counter() - t0)
        return out
    codes, calls = _timed_batches(client.batch_is_exist, "batch_is_exist", recorder, keys)
    out.calls += calls
    existing = 0
    for c in codes:
        if c != 1:
            break
        existing += 1
    out.existing_prefix = existing
    out.exist_errors = sum(1 for c in codes if c < 0)

    read = 0
    if existing:
        head = keys[:existing]
        try:
            values, calls = _timed_batches(client.get_batch, "get_batch", recorder, head)
        except LeaseExpired:
            # The read took longer than the master's lease: its bytes are not
            # trusted; count the blocks as late misses and write them again.
            values, calls = [None] * len(head), 1
            out.lease_expired += 1
        out.calls += calls
        tv = time.perf_counter()
        cut = False
        for k, v in zip(head, values):
            if v is None:
                out.late_misses += 1
                cut = True
                continue
            w = payload_writer(k, v)
            if w is None:
                out.verification_failures += 1
                cut = True
            elif not cut:
                read += 1
                if w != writer:
                    out.cross_worker += 1
        if timings is not None:
            timings.verify_s += time.perf_counter() - tv
    out.prefix = read

    tail = keys[read:]
    if tail:
        tp = time.perf_counter()
        values = [block_payload(k, block_bytes, writer) for k in tail]
        if timings is not None:
            timings.payload_s += time.perf_counter() - tp
        n_tag = max(0, min(tag_blocks, len(keys)) - read) if session is not None else 0
        out.put_blocks = len(tail)
        for start in range(0, len(tail), MAX_BATCH):
            ks = tail[start:start + MAX_BATCH]
            config = _write_config(session, n_tag - start, len(ks), ttl_ms)
            t = time.perf_counter()
            put_codes = (client.put_batch(ks, values[start:start + MAX_BATCH], config)
                         if config is not None else
                         client.put_batch(ks, values[start:start + MAX_BATCH]))
            recorder.record("put_batch", time.perf_counter() - t)
            out.calls += 1
            if len(put_codes) != len(ks):
                raise LoadgenError(f"put_batch returned {len(put_codes)} results for "
                                   f"{len(ks)} keys")
            for i, c in enumerate(put_codes):
                if c < 0 and c != CODE_ALREADY_EXISTS:
                    out.put_failures += 1
                    out.put_codes[c] = out.put_codes.get(c, 0) + 1
                elif start + i < n_tag:
                    out.tagged += 1

    if session is not None:
        _session_calls(client, keys, recorder, out, session, member_prefix,
                       min(tag_blocks, len(keys)), trim, pin)
    recorder.record("request", time.perf_counter() - t0)
    return out


def _write_config(session: str | None, n_tag: int, n: int, ttl_ms: int | None) -> Any:
    """ReplicateConfig of one put_batch chunk: session tags for its first ``n_tag``
    keys, a soft-pin TTL; ``None`` when neither applies (a plain put)."""
    n_tag = max(0, min(n_tag, n))
    if not n_tag and ttl_ms is None:
        return None
    from kvmaster import ReplicateConfig, SoftPinAction

    cfg = ReplicateConfig()
    if n_tag:
        cfg.kv_sessions = [[session]] * n_tag + [[]] * (n - n_tag)
    if ttl_ms is not None:
        cfg.soft_pin_action = SoftPinAction.ENABLE
        cfg.soft_pin_ttl_ms = ttl_ms
    return cfg


def _session_calls(client: Any, keys: Sequence[str], recorder: LatencyRecorder,
                   out: RequestOutcome, session: str, member_prefix: int, tag_blocks: int,
                   trim: bool, pin: bool | None) -> None:
    attach = keys[member_prefix:min(out.prefix, tag_blocks)]
    for start in range(0, len(attach), MAX_BATCH):
        chunk = list(attach[start:start + MAX_BATCH])
        codes = _session_call(recorder, "attach", client.attach_kv_session, session, chunk)
        out.calls += 1
        for c in codes:
            if c == 0:
                out.attached += 1
            else:
                out.attach_failures += 1
    if trim:
        _session_call(recorder, "update", client.update_kv_session, session,
                      list(keys[:tag_blocks]))
        out.calls += 1
        out.updates += 1
    if pin is not None:
        try:
            if pin:
                _session_call(recorder, "pin", client.pin_kv_session, session)
                out.pins += 1
            else:
                _session_call(recorder, "unpin", client.unpin_kv_session, session)
                out.unpins += 1
        except SessionNotFound:
            # Every member was evicted (or the keep set was empty): the master
            # dropped the session and its pin; the next tagged write recreates it.
            out.session_missing += 1
        out.calls += 1


# --------------------------------------------------------------------------- worker process


def _make_client(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory()


def _safe_stats(client: Any) -> tuple[dict | None, str | None]:
    try:
        stats = client.stats()
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return None, f"{type(exc).__name__}: {exc}"
    return dict(stats), None


_TOTAL_FIELDS = ("blocks", "existing_prefix", "prefix", "late_misses", "verification_failures",
                 "exist_errors", "put_blocks", "put_failures", "calls", "cross_worker",
                 "tagged", "attached", "attach_failures", "updates", "pins", "unpins",
                 "session_missing", "lease_expired")


class _WorkerState:
    """Everything one worker process owns: its client, counters and histograms."""

    def __init__(self, wid: int, config: LoadgenConfig, namespace: str, client: Any) -> None:
        self.wid = wid
        self.config = config
        self.namespace = namespace
        self.client = client
        self.writer = wid + 1  # 0 means "unnamed" in payloads
        self.sessions_on = config.sessions and hasattr(client, "attach_kv_session")
        self.recorder = LatencyRecorder()
        self.timings = Timings()
        self.totals: dict[str, Any] = dict.fromkeys(_TOTAL_FIELDS, 0)
        self.totals.update(requests=0, put_codes={}, closes=0, audit_checks=0,
                           audit_failures=0, audit_examples=[], busy_s=0.0, idle_s=0.0)

    # ------------------------------------------------------------- audit

    def _audit(self, session: str, expect: str) -> None:
        """Ask the master about ``session``: ``pinned``, ``unpinned`` or ``gone``."""
        t = self.totals
        t["audit_checks"] += 1
        try:
            info = self.client.get_kv_session(session)
            state = f"pinned={info.pinned} members={info.member_count}"
            ok = ((expect == "pinned" and info.pinned and info.member_count > 0)
                  or (expect == "unpinned" and not info.pinned))
        except SessionNotFound:
            state = "not found"
            ok = expect != "pinned"
        if not ok:
            t["audit_failures"] += 1
            if len(t["audit_examples"]) < _AUDIT_EXAMPLES:
                t["audit_examples"].append(f"{session}: expected {expect}, master says {state}")

    # ------------------------------------------------------------- tasks

    def run(self, item: tuple) -> Any:
        kind = item[0]
        if kind == "r":
            return self._request(item)
        _, _, session = item[:3]
        if kind == "p":
            if self.sessions_on:
                try:
                    _session_call(self.recorder, "pin", self.client.pin_kv_session, session)
                    self.totals["pins"] += 1
                except SessionNotFound:
                    self.totals["session_missing"] += 1
                else:
                    if self.config.audit_sessions:
                        self._audit(session, "pinned")
            return None
        if kind == "u":
            if self.sessions_on:
                try:
                    _session_call(self.recorder, "unpin", self.client.unpin_kv_session, session)
                    self.totals["unpins"] += 1
                except SessionNotFound:
                    self.totals["session_missing"] += 1
                if self.config.audit_sessions:
                    self._audit(session, "unpinned")
            return None
        if kind == "c":
            if self.sessions_on:
                _session_call(self.recorder, "close", self.client.close_kv_session, session)
                self.totals["closes"] += 1
                if self.config.audit_sessions:
                    self._audit(session, "gone")
            return None
        if kind == "g":
            return self._left_behind(item[2])
        raise LoadgenError(f"unknown task kind {kind!r}")

    def _left_behind(self, sessions: list[str]) -> list[str]:
        left = []
        for sid in sessions:
            try:
                self.client.get_kv_session(sid)
            except SessionNotFound:
                continue
            left.append(sid)
        return left

    def _request(self, item: tuple) -> tuple[int, int, int]:
        _, _, session, hash_ids, member_prefix, tag_blocks, trim, pin, ttl_ms = item
        ns = self.namespace
        keys = [block_key(ns, h) for h in hash_ids]
        sessions_on = self.sessions_on
        res = process_request(
            self.client, keys, self.config.block_bytes, self.recorder,
            session=session if sessions_on else None, member_prefix=member_prefix,
            tag_blocks=tag_blocks, trim=trim, pin=pin, writer=self.writer, ttl_ms=ttl_ms,
            timings=self.timings)
        t = self.totals
        t["requests"] += 1
        for name in _TOTAL_FIELDS:
            t[name] += getattr(res, name)
        for code, n in res.put_codes.items():
            t["put_codes"][code] = t["put_codes"].get(code, 0) + n
        if sessions_on and self.config.audit_sessions and res.pins:
            self._audit(session, "pinned")
        return res.blocks, res.prefix, res.cross_worker

    def done_message(self) -> tuple:
        t = dict(self.totals)
        t["payload_s"] = self.timings.payload_s
        t["verify_s"] = self.timings.verify_s
        return ("done", self.wid, t, self.recorder.to_dict())


def _worker_main(wid: int, config: LoadgenConfig, master_addr: str, namespace: str,
                 in_q: Any, out_q: Any, log_level: int) -> None:
    """Worker process body. Messages to the parent are tuples ``(kind, wid, ...)``.

    Tasks arrive as tuples (``r`` request, ``p`` pin, ``u`` unpin, ``c`` close, ``g``
    sessions-left check), each acknowledged with ``("ack", wid, seq, result)``;
    strings are controls (``end``, ``stats``, ``close``).  Ctrl-C is left to the
    parent, which then sends "close"; SIGTERM exits quietly, still closing the
    client (which unmounts the segment).
    """
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s worker{wid} %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    client = None
    profiler = cProfile.Profile() if config.profile_dir else None
    try:
        client = _make_client(config.client_factory)
        client.setup(master_server_addr=master_addr,
                     global_segment_size=config.segment_bytes, tenant=config.tenant)
        state = _WorkerState(wid, config, namespace, client)
        if config.sessions and not state.sessions_on:
            logger.warning("client %s has no session calls; replaying without them",
                           config.client_factory)
        stats0 = _safe_stats(client) if wid == 0 else (None, None)
        out_q.put(("ready", wid, stats0, state.sessions_on))
        if profiler is not None:
            profiler.enable()
        totals = state.totals
        perf = time.perf_counter
        parent = os.getppid()
        while True:
            t_wait = perf()
            try:
                item = in_q.get(timeout=1.0)
            except queue.Empty:
                totals["idle_s"] += perf() - t_wait
                if os.getppid() != parent:
                    logger.warning("worker %d: dispatcher is gone, exiting", wid)
                    break
                continue
            t_start = perf()
            totals["idle_s"] += t_start - t_wait
            if isinstance(item, str):
                if item == "end":
                    if profiler is not None:
                        profiler.disable()
                        _dump_profile(profiler, config.profile_dir, f"worker-{wid}")
                        profiler = None
                    out_q.put(state.done_message())
                elif item == "stats":
                    out_q.put(("stats", wid, _safe_stats(client)))
                elif item == "close":
                    break
                continue
            result = state.run(item)
            totals["busy_s"] += perf() - t_start
            out_q.put(("ack", wid, item[1], result))
    except SystemExit:
        logger.info("worker %d stopped by signal", wid)
    except BaseException:  # noqa: BLE001 - the parent re-raises it
        out_q.put(("error", wid, traceback.format_exc()))
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()


def _dump_profile(profiler: cProfile.Profile, directory: str | None, name: str) -> None:
    """Write ``name.prof`` and a text summary ``name.txt`` (top 25 by own time)."""
    if not directory:
        return
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(d / f"{name}.prof")
    buf = io.StringIO()
    st = pstats.Stats(profiler, stream=buf)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(25)
    (d / f"{name}.txt").write_text(buf.getvalue(), encoding="utf-8")


# --------------------------------------------------------------------------- embedded master


@contextlib.contextmanager
def embedded_master(shards: int = 0, timeout_s: float = 30.0,
                    extra_args: Sequence[str] = ()) -> Iterator[tuple[str, int]]:
    """Run ``python -m kvmaster master --port 0 --shards SHARDS`` (0 = the master's
    default) and yield ``(host:port, pid)``.

    The address is read from the ``kvmaster master listening on tcp://HOST:PORT``
    line of its stdout. Its stderr is forwarded to this module's logger (debug
    level; lines mentioning WARNING, ERROR, CRITICAL or Traceback at warning
    level). On exit the master gets SIGTERM and is waited for (killed after 10 s).
    """
    # No metrics HTTP server: its fixed default port would clash between
    # concurrent masters (``extra_args`` may turn it back on).
    cmd = [sys.executable, "-m", "kvmaster", "master", "--port", "0", "--shards", str(shards),
           "--metrics-port", "-1", *extra_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    found: queue.Queue[str | None] = queue.Queue()
    err_tail: deque[str] = deque(maxlen=20)

    def pump_stdout() -> None:
        assert proc.stdout is not None
        announced = False
        for line in proc.stdout:
            line = line.rstrip("\n")
            m = None if announced else _LISTEN_RE.search(line)
            if m:
                announced = True
                found.put(f"{m.group(1)}:{m.group(2)}")
            logger.debug("master stdout: %s", line)
        if not announced:
            found.put(None)

    def pump_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.rstrip("\n")
            err_tail.append(line)
            loud = any(w in line for w in ("WARNING", "ERROR", "CRITICAL", "Traceback"))
            logger.log(logging.WARNING if loud else logging.DEBUG, "master: %s", line)

    readers = [threading.Thread(target=f, name=f"master-{f.__name__}", daemon=True)
               for f in (pump_stdout, pump_stderr)]
    for t in readers:
        t.start()
    try:
        try:
            addr = found.get(timeout=timeout_s)
        except queue.Empty:
            raise LoadgenError(f"master did not announce its address within {timeout_s:.0f} s "
                               f"({' '.join(cmd)})") from None
        if addr is None:
            code = proc.wait()
            for t in readers:
                t.join(timeout=5)
            tail = "\n".join(err_tail)
            raise LoadgenError(f"master exited with code {code} before listening "
                               f"({' '.join(cmd)}); stderr ends with:\n{tail}")
        logger.info("embedded master pid %d at %s", proc.pid, addr)
        yield addr, proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("master pid %d ignored SIGTERM, killing it", proc.pid)
                proc.kill()
                proc.wait()
        for t in readers:
            t.join(timeout=5)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
        if proc.returncode not in (0, -signal.SIGTERM):
            logger.warning("embedded master exited with code %s", proc.returncode)


# --------------------------------------------------------------------------- dispatcher


class _Dispatcher:
    """Parent side: routes tasks to workers, keeps per-session order, reads worker messages.

    Owned by the thread that calls :func:`run_replay`; the sampler thread only
    reads :meth:`clock`.
    """

    def __init__(self, config: LoadgenConfig, out_q: Any, in_qs: list[Any],
                 procs: list[Any], n_requests: int, span_ms: float) -> None:
        self.config = config
        self.out_q = out_q
        self.in_qs = in_qs
        self.procs = procs
        self.n_workers = len(in_qs)
        self.n_requests = n_requests
        self.planner: SessionPlanner | None = None
        self.bar: tqdm | None = None
        self.ready: dict[int, tuple] = {}
        self.done: dict[int, tuple[dict, dict]] = {}
        self.stats: dict[int, tuple[dict | None, str | None]] = {}
        # per request: worker, blocks, prefix hits, cross-worker hits (-1 = not done)
        self.req_worker = [-1] * n_requests
        self.req_blocks = [0] * n_requests
        self.req_prefix = [0] * n_requests
        self.req_cross = [0] * n_requests
        self.requests_done = 0
        self.blocks_done = 0
        self.prefix_done = 0
        self.cross_done = 0
        self.left_behind: list[str] = []
        self.gone_checks_pending = 0
        # routing and ordering
        self.inflight = [0] * self.n_workers
        self.tasks: dict[int, tuple[str, int, int]] = {}  # seq -> (session, worker, index)
        self.busy: set[str] = set()
        self.pending: dict[str, deque[Task]] = {}
        self.runnable: deque[str] = deque()
        self.worker_of: dict[str, int] = {}
        self.next_session_worker = 0
        self.rr = 0
        self.rng = random.Random(config.seed)
        self.seq = 0
        # clocks
        self.trace_ms = 0.0
        self.ts0 = 0.0
        self.span_ms = span_ms
        self.t0 = time.perf_counter()
        self.wait_s = 0.0
        self.last_bar = 0.0
        self.last_alive_check = 0.0
        self.lag = LatencyRecorder()

    # ------------------------------------------------------------- messages

    def clock(self) -> tuple[float, int, int, int, int]:
        pinned = self.planner.pinned_blocks if self.planner is not None else 0
        return (self.trace_ms - self.ts0, self.requests_done, self.blocks_done,
                self.prefix_done, pinned)

    def _handle(self, msg: tuple) -> None:
        kind, wid = msg[0], msg[1]
        if kind == "ack":
            _, _, seq, result = msg
            session, w, index = self.tasks.pop(seq)
            self.inflight[w] -= 1
            self.busy.discard(session)
            if self.pending.get(session):
                self.runnable.append(session)
            if index >= 0:
                blocks, prefix, cross = result
                self.req_worker[index] = w
                self.req_blocks[index] = blocks
                self.req_prefix[index] = prefix
                self.req_cross[index] = cross
                self.requests_done += 1
                self.blocks_done += blocks
                self.prefix_done += prefix
                self.cross_done += cross
                if self.bar is not None:
                    self.bar.update(1)
                    now = time.perf_counter()
                    if now - self.last_bar >= _PROGRESS_INTERVAL_S:
                        self.last_bar = now
                        self.bar.set_postfix(
                            hit=f"{self.prefix_done / max(self.blocks_done, 1):.1%}",
                            xw=f"{self.cross_done / max(self.prefix_done, 1):.0%}",
                            rps=f"{self.requests_done / max(now - self.t0, 1e-9):.0f}",
                            refresh=False)
            elif result:
                self.left_behind.extend(result)
        elif kind == "ready":
            self.ready[wid] = msg[2:]
        elif kind == "done":
            self.done[wid] = (msg[2], msg[3])
        elif kind == "stats":
            self.stats[wid] = msg[2]
        elif kind == "error":
            raise LoadgenError(f"worker {wid} failed:\n{msg[2]}")
        else:
            raise LoadgenError(f"unknown message from worker {wid}: {kind!r}")

    def poll(self, timeout: float) -> None:
        """Handle all queued messages, waiting up to ``timeout`` s for the first."""
        t = time.perf_counter()
        try:
            msg = self.out_q.get(timeout=timeout) if timeout > 0 else self.out_q.get_nowait()
        except queue.Empty:
            now = time.perf_counter()
            self.wait_s += now - t
            if now - self.last_alive_check >= _POLL_S:
                self.last_alive_check = now
                self.check_alive()
            return
        self.wait_s += time.perf_counter() - t
        self._handle(msg)
        while True:
            try:
                msg = self.out_q.get_nowait()
            except queue.Empty:
                return
            self._handle(msg)

    def check_alive(self) -> None:
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                # Drain what it may have said before dying (an error report).
                with contextlib.suppress(queue.Empty):
                    while True:
                        self._handle(self.out_q.get(timeout=0.2))
                raise LoadgenError(f"worker {i} exited unexpectedly with code {p.exitcode}")

    def wait_until(self, cond: Callable[[], bool], what: str,
                   timeout_s: float | None = None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not cond():
            if deadline is not None and time.monotonic() > deadline:
                raise LoadgenError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            self.poll(_POLL_S)
            self.run_runnable()

    # ------------------------------------------------------------- routing

    def _route(self, task: Task) -> int:
        s = task.session
        home = self.worker_of.get(s)
        if task.kind != "request" and home is not None:
            return home
        routing = self.config.routing
        if routing == "affinity":
            if home is None:
                # New session: the least busy worker, ties broken round robin.
                start = self.next_session_worker
                home = min(range(self.n_workers),
                           key=lambda k: (self.inflight[k], (k - start) % self.n_workers))
                self.next_session_worker = home + 1
            w = home
        elif routing == "round-robin":
            w = self.rr % self.n_workers
            self.rr += 1
        else:
            w = self.rng.randrange(self.n_workers)
        self.worker_of[s] = w
        return w

    def _ttl_ms(self) -> int | None:
        """Soft-pin TTL of a write under ttl-pin: ``idle_s`` of trace time in wall ms."""
        cfg = self.config
        if cfg.retention != "ttl-pin":
            return None
        if cfg.speed > 0:
            rate = cfg.speed
        else:
            # Trace ms per wall ms: measured once the run has settled, before that
            # a guess of _TTL_GUESS_RPS requests per second over the whole trace.
            elapsed_s = time.perf_counter() - self.t0
            if elapsed_s >= _TTL_WARMUP_S and self.trace_ms > self.ts0:
                rate = (self.trace_ms - self.ts0) / (elapsed_s * 1000.0)
            else:
                rate = self.span_ms / max(self.n_requests / _TTL_GUESS_RPS * 1000.0, 1.0)
        return int(min(max(cfg.idle_s * 1000.0 / max(rate, 1e-6), 1.0), _MAX_TTL_MS))

    def _send(self, task: Task) -> None:
        """Hand ``task`` to its worker (waiting for a free slot); marks its session busy."""
        w = self._route(task)
        self._wait_slot(w)
        self.seq += 1
        seq = self.seq
        if task.kind == "request":
            item: tuple = ("r", seq, task.session, task.hash_ids, task.member_prefix,
                           task.tag_blocks, task.trim, task.pin, self._ttl_ms())
        else:
            item = ({"pin": "p", "unpin": "u"}.get(task.kind, "c"), seq, task.session)
        self.tasks[seq] = (task.session, w, task.index)
        self.inflight[w] += 1
        self.busy.add(task.session)
        self.in_qs[w].put(item)

    def _wait_slot(self, w: int) -> None:
        """Wait until worker ``w`` has fewer than ``queue_depth`` tasks in flight."""
        deadline = time.monotonic() + _STALL_S
        while self.inflight[w] >= self.config.queue_depth:
            if time.monotonic() > deadline:
                raise LoadgenError(f"worker {w} answered nothing for {_STALL_S:.0f} s")
            self.poll(_POLL_S)

    def submit(self, task: Task) -> None:
        """Send now, or queue behind the session's task in flight."""
        s = task.session
        if s in self.busy or self.pending.get(s):
            self.pending.setdefault(s, deque()).append(task)
        else:
            self._send(task)

    def run_runnable(self) -> None:
        """Send the next task of every session whose previous task has finished."""
        while self.runnable:
            s = self.runnable.popleft()
            q = self.pending.get(s)
            if s in self.busy or not q:
                continue
            task = q.popleft()
            if not q:
                del self.pending[s]
            self._send(task)

    def idle(self) -> bool:
        return not self.tasks and not self.pending

    def check_left_behind(self, sessions: list[str]) -> None:
        """Ask the workers (in chunks) which of ``sessions`` the master still has."""
        chunk = max(1, -(-len(sessions) // self.n_workers))
        for i in range(0, len(sessions), chunk):
            w = (i // chunk) % self.n_workers
            self._wait_slot(w)
            self.seq += 1
            self.tasks[self.seq] = ("", w, -1)
            self.inflight[w] += 1
            self.in_qs[w].put(("g", self.seq, sessions[i:i + chunk]))
        self.wait_until(lambda: not self.tasks, "the sessions-left check", 300.0)


def _stop_workers(procs: list[Any], in_qs: list[Any]) -> None:
    """Ask every worker to close its client and exit; terminate stragglers after 30 s."""
    for q in in_qs:
        for _ in range(10_000):  # on an early stop, drop queued tasks to make room
            try:
                q.put_nowait("close")
                break
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    q.get_nowait()
            except (ValueError, OSError):
                break
    deadline = time.monotonic() + 30.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            logger.warning("worker %s did not stop, terminating it", p.name)
            p.terminate()
            p.join(timeout=5)
    for q in in_qs:
        q.cancel_join_thread()
        q.close()


def _delta(end: dict | None, start: dict | None, name: str) -> int | None:
    if end is None or start is None:
        return None
    a, b = end.get(name), start.get(name)
    if not isinstance(a, int) or not isinstance(b, int):
        return None
    return a - b


def _references(config: LoadgenConfig, requests: Sequence[Request], capacity: int
                ) -> dict[str, Any]:
    out = {"lru": lru_prefix_hit_rate(requests, capacity).to_dict()}
    if config.references:
        out["belady"] = belady_prefix_hit_rate(requests, capacity).to_dict()
        policy = config.session_policy()
        if policy.retention != "none":
            out["model"] = policy_prefix_hit_rate(requests, capacity, policy).to_dict()
    return out


def _time_buckets(requests: Sequence[Request], d: _Dispatcher) -> list[dict[str, Any]]:
    """Prefix hit rate per slice of trace time (``_TIME_BUCKETS`` equal slices)."""
    if not requests:
        return []
    ts0 = requests[0].timestamp_ms
    span = max(requests[-1].timestamp_ms - ts0, 1.0)
    n = _TIME_BUCKETS
    blocks = [0] * n
    hits = [0] * n
    reqs = [0] * n
    for i, r in enumerate(requests):
        b = min(n - 1, int((r.timestamp_ms - ts0) / span * n))
        blocks[b] += d.req_blocks[i]
        hits[b] += d.req_prefix[i]
        reqs[b] += 1
    return [{"t_s": round((k + 1) * span / n / 1000.0, 3), "requests": reqs[k],
             "blocks": blocks[k], "prefix_hits": hits[k],
             "hit_rate": hits[k] / blocks[k] if blocks[k] else None} for k in range(n)]


def run_replay(config: LoadgenConfig, requests: Sequence[Request]) -> dict:
    """Replay ``requests`` (already limited) as configured and return the result dict.

    Keys: ``config``, ``master``, ``namespace``, ``requests``, ``blocks``,
    ``prefix_hit_blocks``, ``prefix_hit_rate``, ``per_worker`` (requests, blocks,
    hits, hit rate, cross-worker hits of each worker), ``cross_worker_hit_blocks``
    (hits served from blocks another worker wrote), ``references`` (``lru``,
    and with ``config.references`` ``belady`` and the policy ``model``, all at
    the effective capacity), ``reference_lru_hit_rate``,
    ``reference_capacity_blocks`` (= ``effective_capacity_blocks``, see
    :attr:`LoadgenConfig.effective_capacity_blocks`; ``stated_capacity_blocks``
    and ``high_watermark`` beside it), ``prefill_saved`` (tokens and TTFT saved
    per request, see :func:`~kvmaster.tools.loadgen.stats.prefill_saved`),
    ``requests_per_s``, ``blocks_per_s``,
    ``ops_per_s`` (client calls), ``latency_us`` (op -> count/mean/min/max/
    p50/p99/p999, µs) and ``latency_histograms`` (mergeable buckets),
    ``evictions``, ``evicted_bytes``, ``evicted_pinned`` (master counters' change
    over the run, ``None`` if ``stats()`` failed), ``master_process`` (pid,
    RSS, CPU seconds and utilisation), ``sessions`` (planned and executed
    session calls, the audit, ``left_behind`` after the final closes),
    ``timeline`` (samples of the master's counters), ``hit_rate_by_time``,
    ``profile`` (where the dispatcher's and workers' time went),
    ``verification_failures``, ``put_failures``, ``put_error_codes``,
    ``late_misses``, ``exist_errors``, ``wall_s``.
    Also writes it to ``config.json_path`` when set.
    """
    config.validate()
    policy = config.session_policy()
    namespace = config.namespace or f"lg-{uuid.uuid4().hex[:12]}"
    # Like with like: the references get the capacity the master keeps, not the
    # segments' size (it evicts from the high watermark on).
    capacity = config.effective_capacity_blocks
    if policy.retention == "lifecycle" and not any(r.stop for r in requests):
        logger.warning("retention lifecycle: the trace has no stop reasons; every reply "
                       "counts as the end of a turn (pinned for %.1f s only)",
                       policy.grace_s)
    t_ref = time.perf_counter()
    references = _references(config, requests, capacity)
    continued = (continued_requests(requests, policy)
                 if policy.retention == "session-oracle" else None)
    ref_s = time.perf_counter() - t_ref
    planner = SessionPlanner(policy, prefix=f"{namespace}-s", continued=continued)
    log_level = logging.getLogger().getEffectiveLevel()
    ctx = mp.get_context("spawn")
    profiler = cProfile.Profile() if config.profile_dir else None
    span_ms = requests[-1].timestamp_ms - requests[0].timestamp_ms if requests else 0.0

    with contextlib.ExitStack() as stack:
        master_pid = config.master_pid
        if config.master:
            master_addr = config.master
            if master_pid is None:
                master_pid = find_listening_pid(master_addr)
        else:
            extra = []
            if config.master_watermark is not None:
                extra += ["--eviction-high-watermark-ratio", str(config.master_watermark)]
            if config.master_lease_ms is not None:
                extra += ["--default-kv-lease-ttl", str(config.master_lease_ms)]
            extra += shlex.split(config.master_args)
            master_addr, master_pid = stack.enter_context(
                embedded_master(config.master_shards, extra_args=extra))
        master_proc = MasterProcess(master_pid)
        out_q = ctx.Queue()
        in_qs = [ctx.Queue() for _ in range(config.workers)]
        procs = [
            ctx.Process(target=_worker_main, name=f"loadgen-worker-{i}", daemon=True,
                        args=(i, config, master_addr, namespace, in_qs[i], out_q, log_level))
            for i in range(config.workers)
        ]
        for p in procs:
            p.start()
        stack.callback(_stop_workers, procs, in_qs)
        d = _Dispatcher(config, out_q, in_qs, procs, len(requests), span_ms)
        d.planner = planner
        d.wait_until(lambda: len(d.ready) == config.workers, "workers to set up", 120.0)
        sessions_on = all(r[1] for r in d.ready.values())
        if not sessions_on and policy.retention in ("session-pin", "session-oracle",
                                                    "lifecycle"):
            raise LoadgenError(f"retention {policy.retention} needs session calls, which the "
                               f"client {config.client_factory} does not have")
        logger.info("%d workers ready (segment %d bytes each), namespace %s",
                    config.workers, config.segment_bytes, namespace)
        monitor_client = _make_client(config.client_factory)
        monitor_client.setup(master_server_addr=master_addr, global_segment_size=0,
                             tenant=config.tenant)
        sampler = Sampler(monitor_client, master_proc, config.sample_interval_s, d.clock)
        bar = d.bar = stack.enter_context(
            tqdm(total=len(requests), unit="req", desc="replay", dynamic_ncols=True,
                 disable=True if not config.progress else None))

        t0 = time.perf_counter()
        d.t0 = t0
        d.wait_s = 0.0  # count the dispatcher's waiting from the first request on
        ts0 = requests[0].timestamp_ms if requests else 0.0
        d.ts0 = d.trace_ms = ts0
        rss0, cpu0 = master_proc.sample()
        sampler.sample_once()
        sampler.start()
        finished = False
        try:
            if profiler is not None:
                profiler.enable()
            for i, req in enumerate(requests):
                if config.speed > 0:
                    due = t0 + (req.timestamp_ms - ts0) / 1000.0 / config.speed
                    while (now := time.perf_counter()) < due:
                        d.trace_ms = ts0 + (now - t0) * 1000.0 * config.speed
                        for task in planner.advance(d.trace_ms):
                            d.submit(task)
                        d.poll(min(due - now, _POLL_S))
                        d.run_runnable()
                    d.lag.record("dispatch_lag", max(0.0, time.perf_counter() - due))
                d.trace_ms = max(d.trace_ms, req.timestamp_ms)
                for task in planner.advance(req.timestamp_ms):
                    d.submit(task)
                for task in planner.request(i, req):
                    d.submit(task)
                d.poll(0)
                d.run_runnable()
                if d.pending and not config.reorder:
                    # In-order issue: nothing overtakes a request that waits for
                    # its session's previous task, so sessions keep the trace's
                    # interleaving.
                    d.wait_until(lambda: not d.pending, "a session's previous task",
                                 _STALL_S)
            for task in planner.finish():
                d.submit(task)
            d.wait_until(d.idle, "the last tasks", _STALL_S)
            if profiler is not None:
                profiler.disable()
            wall_s = time.perf_counter() - t0
            rss1, cpu1 = master_proc.sample()
            finished = True
        finally:
            sampler.stop(final_sample=finished)
        bar.refresh()

        planned = dict(planner.counters)
        last = sampler.rows[-1] if sampler.rows else {}
        # No session at all on the master: none of ours is left; otherwise ask
        # about each of ours (the master may be shared with other runs).
        if sessions_on and config.sessions and last.get("sessions") != 0:
            d.check_left_behind(planner.session_ids)
        for q in in_qs:
            q.put("end")
        d.wait_until(lambda: len(d.done) == config.workers, "workers to finish", 300.0)
        in_qs[0].put("stats")
        d.wait_until(lambda: 0 in d.stats, "master stats", 60.0)
        stats0, err0 = d.ready[0][0]
        stats1, err1 = d.stats[0]
    if profiler is not None:
        _dump_profile(profiler, config.profile_dir, "dispatcher")

    return _result(config, requests, d, planner, planned, sessions_on, namespace, master_addr,
                   capacity, references, ref_s, wall_s, stats0, stats1, err0 or err1,
                   master_proc, (rss0, cpu0), (rss1, cpu1), sampler)


def _result(config: LoadgenConfig, requests: Sequence[Request], d: _Dispatcher,
            planner: SessionPlanner, planned: dict[str, int], sessions_on: bool, namespace: str,
            master_addr: str, capacity: int, references: dict[str, Any], ref_s: float,
            wall_s: float, stats0: dict | None, stats1: dict | None, stats_error: str | None,
            master_proc: MasterProcess, start: tuple, end: tuple, sampler: Sampler) -> dict:
    totals: dict[str, Any] = {}
    put_codes: dict[int, int] = {}
    audit_examples: list[str] = []
    for wid in sorted(d.done):
        t, _ = d.done[wid]
        for k, v in t.items():
            if k == "put_codes":
                for code, n in v.items():
                    put_codes[int(code)] = put_codes.get(int(code), 0) + n
            elif k == "audit_examples":
                audit_examples.extend(v)
            else:
                totals[k] = totals.get(k, 0) + v
    latency = LatencyRecorder.merged(rec for _, rec in d.done.values())
    blocks = totals.get("blocks", 0)
    prefix = totals.get("prefix", 0)
    n_req = totals.get("requests", 0)
    saved = prefill_saved([r.input_length for r in requests],
                          [h * r.block_tokens for h, r in zip(d.req_prefix, requests)],
                          config.prefill_tokens_per_s)
    if n_req != len(requests):
        raise LoadgenError(f"workers processed {n_req} requests, {len(requests)} were sent")
    per_worker = []
    for wid in sorted(d.done):
        t, _ = d.done[wid]
        per_worker.append({
            "worker": wid, "requests": t["requests"], "blocks": t["blocks"],
            "prefix_hit_blocks": t["prefix"],
            "hit_rate": t["prefix"] / t["blocks"] if t["blocks"] else None,
            "cross_worker_hit_blocks": t["cross_worker"],
            "busy_s": round(t["busy_s"], 3), "idle_s": round(t["idle_s"], 3)})
    rss0, cpu0 = start
    rss1, cpu1 = end
    cpu_s = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    ops_time = {op: round(s["sum_us"] / 1e6, 3)
                for op, s in latency.to_dict().items() if op != "request"}
    busy = totals.get("busy_s", 0.0)
    master_sessions = {
        name: _delta(stats1, stats0, name)
        for name in ("sessions_created", "sessions_deleted", "memberships_added",
                     "memberships_removed")}
    master_sessions["live_at_end"] = stats1.get("sessions") if stats1 else None
    result: dict[str, Any] = {
        "config": asdict(config),
        "master": master_addr,
        "embedded_master": not config.master,
        "namespace": namespace,
        "requests": n_req,
        "blocks": blocks,
        "prefix_hit_blocks": prefix,
        "prefix_hit_rate": prefix / blocks if blocks else 0.0,
        "existing_prefix_blocks": totals.get("existing_prefix", 0),
        "cross_worker_hit_blocks": totals.get("cross_worker", 0),
        "cross_worker_hit_fraction": totals.get("cross_worker", 0) / prefix if prefix else 0.0,
        "per_worker": per_worker,
        "references": references,
        "reference_lru_hit_rate": references["lru"]["hit_rate"],
        "reference_capacity_blocks": capacity,
        "stated_capacity_blocks": config.stated_capacity_blocks,
        "effective_capacity_blocks": capacity,
        "high_watermark": config.high_watermark,
        "prefill_saved": saved,
        "segment_bytes_per_worker": config.segment_bytes,
        "requests_per_s": n_req / wall_s if wall_s > 0 else None,
        "blocks_per_s": blocks / wall_s if wall_s > 0 else None,
        "ops_per_s": totals.get("calls", 0) / wall_s if wall_s > 0 else None,
        "latency_us": latency.summary(),
        "latency_histograms": latency.to_dict(),
        "evictions": _delta(stats1, stats0, "evicted_keys"),
        "evicted_bytes": _delta(stats1, stats0, "evicted_bytes"),
        "evicted_pinned": _delta(stats1, stats0, "evicted_soft_pinned_keys"),
        "stats_error": stats_error,
        "master_process": {
            "pid": master_proc.pid, "rss_bytes_start": rss0, "rss_bytes_end": rss1,
            "rss_bytes_peak": master_proc.peak_rss or None, "cpu_s": cpu_s,
            "cpu_utilization": cpu_s / wall_s if cpu_s is not None and wall_s > 0 else None},
        "sessions": {
            "calls": sessions_on and config.sessions,
            "retention": config.retention,
            "planned": planned,
            "tagged_keys": totals.get("tagged", 0),
            "attached_keys": totals.get("attached", 0),
            "attach_failures": totals.get("attach_failures", 0),
            "updates": totals.get("updates", 0),
            "pin_calls": totals.get("pins", 0),
            "unpin_calls": totals.get("unpins", 0),
            "close_calls": totals.get("closes", 0),
            "missing_on_pin_or_unpin": totals.get("session_missing", 0),
            "audit_checks": totals.get("audit_checks", 0),
            "audit_failures": totals.get("audit_failures", 0),
            "audit_examples": audit_examples,
            "left_behind": len(d.left_behind),
            "left_behind_examples": d.left_behind[:10],
            "ids_sample": planner.session_ids[:50],
            "master": master_sessions,
        },
        "timeline": sampler.rows,
        "hit_rate_by_time": _time_buckets(requests, d),
        "profile": {
            "references_s": round(ref_s, 3),
            "dispatcher_wait_s": round(d.wait_s, 3),
            "dispatcher_busy_s": round(max(wall_s - d.wait_s, 0.0), 3),
            "worker_busy_s": round(busy, 3),
            "worker_idle_s": round(totals.get("idle_s", 0.0), 3),
            "worker_client_calls_s": ops_time,
            "worker_payload_s": round(totals.get("payload_s", 0.0), 3),
            "worker_verify_s": round(totals.get("verify_s", 0.0), 3),
            "worker_utilization": busy / (wall_s * config.workers) if wall_s > 0 else None,
            "profile_dir": config.profile_dir,
        },
        "verification_failures": totals.get("verification_failures", 0),
        "put_failures": totals.get("put_failures", 0),
        "put_error_codes": {str(k): v for k, v in sorted(put_codes.items())},
        "put_blocks": totals.get("put_blocks", 0),
        "late_misses": totals.get("late_misses", 0),
        "lease_expired_reads": totals.get("lease_expired", 0),
        "exist_errors": totals.get("exist_errors", 0),
        "wall_s": wall_s,
    }
    if config.speed > 0:
        result["dispatch_lag_us"] = d.lag.summary().get("dispatch_lag")
    if config.json_path:
        path = Path(config.json_path)
        if path.parent != Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        logger.info("wrote %s", path)
    return result


def format_summary(result: dict) -> str:
    """Human-readable table of a :func:`run_replay` result."""

    def num(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    refs = result.get("references", {})
    ref_line = "  ".join(f"{name} {r['hit_rate']:.2%}" for name, r in refs.items())
    mp_ = result.get("master_process", {})
    rss = mp_.get("rss_bytes_peak")
    s = result.get("sessions", {})
    cfg = result["config"]
    stated = result.get("stated_capacity_blocks")
    lines = [
        f"requests          {result['requests']:>12,}    blocks        {result['blocks']:>12,}",
        f"capacity          {num(stated, '>12,')}    effective     "
        f"{result['reference_capacity_blocks']:>12,}    (blocks; high watermark "
        f"{num(result.get('high_watermark'), '.2f')})",
        f"prefix hit rate   {result['prefix_hit_rate']:>12.2%}    references    {ref_line}  "
        f"(at {result['reference_capacity_blocks']:,} blocks)",
        f"workers           {cfg['workers']:>12}    routing       {cfg['routing']:>12}    "
        f"retention {cfg['retention']}",
        f"cross-worker hits {result.get('cross_worker_hit_fraction', 0.0):>12.1%}    "
        f"per worker    " + " ".join(
            f"{w['hit_rate']:.1%}" if w['hit_rate'] is not None else "n/a"
            for w in result.get("per_worker", [])),
        f"req/s             {num(result['requests_per_s'], '>12,.1f')}    client ops/s  "
        f"{num(result['ops_per_s'], '>12,.1f')}",
        f"wall              {result['wall_s']:>10.2f} s    evictions     "
        f"{num(result['evictions'], '>12,')}    of pinned {num(result.get('evicted_pinned'), ',')}",
        f"late misses       {result['late_misses']:>12,}    put failures  "
        f"{result['put_failures']:>12,}    of {result.get('put_blocks', 0):,} blocks written",
        f"verify failures   {result['verification_failures']:>12,}    exist errors  "
        f"{result['exist_errors']:>12,}",
        f"master RSS peak   {num(rss / 2**20 if rss else None, '>10,.1f')} MB   master CPU    "
        f"{num(mp_.get('cpu_s'), '>11,.1f')} s ({num(mp_.get('cpu_utilization'), '.0%')} "
        "of wall)",
    ]
    ps = result.get("prefill_saved")
    if ps:
        tok, ttft = ps["tokens_per_request"], ps["ttft_saved_ms"]
        lines.append(
            f"prefill saved     {ps['saved_fraction']:>12.2%}    tokens/req    "
            f"p50 {tok['p50']:,.0f}  p99 {tok['p99']:,.0f}  mean {tok['mean']:,.0f}")
        lines.append(
            f"TTFT saved        {'':>12}    at {ps['prefill_tokens_per_s']:,.0f} tok/s  "
            f"p50 {ttft['p50']:,.0f} ms  p99 {ttft['p99']:,.0f} ms  mean {ttft['mean']:,.0f} ms")
    if s.get("calls"):
        p = s["planned"]
        lines.append(
            f"sessions          {p['created']:>12,}    pins {s['pin_calls']:,}  unpins "
            f"{s['unpin_calls']:,}  updates {s['updates']:,}  closes {s['close_calls']:,}  "
            f"attached {s['attached_keys']:,}  left behind {s['left_behind']:,}")
        if s.get("audit_checks"):
            lines.append(f"session audit     {s['audit_checks']:>12,} checks, "
                         f"{s['audit_failures']:,} failed")
    lines += [
        "",
        f"{'op':<16}{'count':>10}{'p50 us':>10}{'p99 us':>10}{'p999 us':>10}{'max us':>12}",
    ]
    for op, st in result["latency_us"].items():
        lines.append(f"{op:<16}{st['count']:>10,}{num(st['p50_us'], '>10,')}"
                     f"{num(st['p99_us'], '>10,')}{num(st['p999_us'], '>10,')}"
                     f"{num(st['max_us'], '>12,.0f')}")
    if result.get("stats_error"):
        lines.append(f"master stats unavailable: {result['stats_error']}")
    return "\n".join(lines)

