"""Trace replay against a kvmaster master with several client worker processes.

The parent process dispatches requests (request *i* to worker *i % N*) through
one bounded queue per worker, pacing them by their timestamps scaled by
``speed`` (0 = as fast as possible). Each worker owns a client that mounts
``ceil(capacity_blocks / workers) * block_bytes`` bytes of segment and, per
request (see :func:`process_request`): checks which block keys exist, reads the
leading run of existing blocks and verifies them, then writes the remaining
blocks. Workers stream progress counters to the parent (shown with tqdm) and
send their latency histograms at the end; the parent merges them into one
result dict (see :func:`run_replay`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import re
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

from .payload import block_key, block_payload, verify_payload
from .reference import lru_prefix_hit_rate
from .stats import LatencyRecorder
from .traces import Request

logger = logging.getLogger(__name__)

__all__ = [
    "LoadgenConfig",
    "LoadgenError",
    "RequestOutcome",
    "MAX_BATCH",
    "CODE_ALREADY_EXISTS",
    "CODE_NO_AVAILABLE_HANDLE",
    "embedded_master",
    "process_request",
    "run_replay",
    "format_summary",
]

#: Largest batch the master accepts; longer key lists are split.
MAX_BATCH = 4096
#: put_batch code for a key that is already stored (not a failure).
CODE_ALREADY_EXISTS = -705
#: put_batch code when the master finds no space (counted as a put failure).
CODE_NO_AVAILABLE_HANDLE = -200

_LISTEN_RE = re.compile(r"listening on tcp://(\S+):(\d+)")
_PROGRESS_INTERVAL_S = 0.2
_POLL_S = 0.1


class LoadgenError(RuntimeError):
    """A replay could not run (master did not start, a worker failed, ...)."""


@dataclass(frozen=True)
class LoadgenConfig:
    """Settings of a replay; each field is a CLI flag of the same name (``--block-bytes``...).

    ``master``: ``host:port`` of a running master, or ``None`` to start one.
    ``capacity_blocks``: total segment capacity over all workers, in blocks.
    ``speed``: time scaling of the trace timestamps (2.0 = twice as fast);
    0 dispatches as fast as the workers take requests.
    ``namespace``: key prefix; ``None`` = a fresh random one per run, so a run
    never sees blocks of an earlier run on a shared master.
    ``client_factory``: ``"module:callable"`` returning an unconfigured client.
    """

    trace: str | None = None
    master: str | None = None
    workers: int = 2
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
    queue_depth: int = 64
    client_factory: str = "kvmaster:Client"

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

    @property
    def blocks_per_worker(self) -> int:
        """Segment capacity of one worker in blocks (total rounded up to a multiple of workers)."""
        return -(-self.capacity_blocks // self.workers)

    @property
    def segment_bytes(self) -> int:
        """Bytes of segment each worker mounts."""
        return self.blocks_per_worker * self.block_bytes


# --------------------------------------------------------------------------- per request


@dataclass(slots=True)
class RequestOutcome:
    """What one request did (counts in blocks).

    ``existing_prefix``: leading run reported present by ``batch_is_exist``.
    ``prefix``: leading run actually read back and verified (<= existing_prefix).
    ``put_codes``: negative put codes other than "already exists" -> count.
    """

    blocks: int = 0
    existing_prefix: int = 0
    prefix: int = 0
    late_misses: int = 0
    verification_failures: int = 0
    exist_errors: int = 0
    put_blocks: int = 0
    put_failures: int = 0
    put_codes: dict[int, int] = field(default_factory=dict)
    calls: int = 0


def _chunks(items: Sequence[Any], size: int = MAX_BATCH) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


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


def process_request(client: Any, keys: Sequence[str], block_bytes: int,
                    recorder: LatencyRecorder) -> RequestOutcome:
    """Run one request's block traffic on ``client`` and record per-op latencies.

    1. ``batch_is_exist(keys)``: 1 present, 0 absent, negative = error (absent).
    2. ``get_batch`` of the leading present run; ``None`` is a late miss
       (evicted in between), a payload that fails verification is a
       verification failure; the prefix is cut at the first of either.
    3. ``put_batch`` of every key from the cut on (``-705`` already exists is
       fine, any other negative code is a put failure).
    Latencies go to ``recorder`` under ``batch_is_exist``, ``get_batch``,
    ``put_batch`` (one sample per client call) and ``request`` (whole request).
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
        values, calls = _timed_batches(client.get_batch, "get_batch", recorder, head)
        out.calls += calls
        cut = False
        for k, v in zip(head, values):
            if v is None:
                out.late_misses += 1
                cut = True
            elif not verify_payload(k, v):
                out.verification_failures += 1
                cut = True
            elif not cut:
                read += 1
    out.prefix = read

    tail = keys[read:]
    if tail:
        values = [block_payload(k, block_bytes) for k in tail]
        put_codes, calls = _timed_batches(client.put_batch, "put_batch", recorder, tail, values)
        out.calls += calls
        out.put_blocks = len(tail)
        for c in put_codes:
            if c < 0 and c != CODE_ALREADY_EXISTS:
                out.put_failures += 1
                out.put_codes[c] = out.put_codes.get(c, 0) + 1
    recorder.record("request", time.perf_counter() - t0)
    return out


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


def _worker_main(wid: int, config: LoadgenConfig, master_addr: str, namespace: str,
                 in_q: Any, out_q: Any, log_level: int) -> None:
    """Worker process body. Messages to the parent are tuples ``(kind, wid, ...)``.

    Ctrl-C is left to the parent, which then sends "close"; SIGTERM exits
    quietly, still closing the client (which unmounts the segment).
    """
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s worker{wid} %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    client = None
    try:
        client = _make_client(config.client_factory)
        client.setup(master_server_addr=master_addr,
                     global_segment_size=config.segment_bytes, tenant=config.tenant)
        stats0 = _safe_stats(client) if wid == 0 else (None, None)
        out_q.put(("ready", wid, stats0))
        recorder = LatencyRecorder()
        totals: dict[str, Any] = {
            "requests": 0, "blocks": 0, "existing_prefix": 0, "prefix": 0, "late_misses": 0,
            "verification_failures": 0, "exist_errors": 0, "put_blocks": 0, "put_failures": 0,
            "put_codes": {}, "calls": 0,
        }
        pending = [0, 0, 0]  # requests, blocks, prefix since the last progress message
        last_flush = time.monotonic()
        while True:
            item = in_q.get()
            if isinstance(item, str):
                if item == "end":
                    out_q.put(("progress", wid, *pending))
                    pending = [0, 0, 0]
                    out_q.put(("done", wid, totals, recorder.to_dict()))
                elif item == "stats":
                    out_q.put(("stats", wid, _safe_stats(client)))
                elif item == "close":
                    break
                continue
            _, hash_ids = item
            keys = [block_key(namespace, h) for h in hash_ids]
            res = process_request(client, keys, config.block_bytes, recorder)
            totals["requests"] += 1
            for name in ("blocks", "existing_prefix", "prefix", "late_misses",
                         "verification_failures", "exist_errors", "put_blocks", "put_failures",
                         "calls"):
                totals[name] += getattr(res, name)
            for code, n in res.put_codes.items():
                totals["put_codes"][code] = totals["put_codes"].get(code, 0) + n
            pending[0] += 1
            pending[1] += res.blocks
            pending[2] += res.prefix
            now = time.monotonic()
            if now - last_flush >= _PROGRESS_INTERVAL_S:
                out_q.put(("progress", wid, *pending))
                pending = [0, 0, 0]
                last_flush = now
    except SystemExit:
        logger.info("worker %d stopped by signal", wid)
    except BaseException:  # noqa: BLE001 - the parent re-raises it
        out_q.put(("error", wid, traceback.format_exc()))
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()


# --------------------------------------------------------------------------- embedded master


@contextlib.contextmanager
def embedded_master(shards: int = 4, timeout_s: float = 30.0) -> Iterator[str]:
    """Run ``python -m kvmaster master --port 0`` and yield its ``host:port``.

    The address is read from the ``kvmaster master listening on tcp://HOST:PORT``
    line of its stdout. Its stderr is forwarded to this module's logger (debug
    level; lines mentioning WARNING, ERROR, CRITICAL or Traceback at warning
    level). On exit the master gets SIGTERM and is waited for (killed after 10 s).
    """
    cmd = [sys.executable, "-m", "kvmaster", "master", "--port", "0", "--shards", str(shards)]
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
        yield addr
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


# --------------------------------------------------------------------------- parent side


class _Pump:
    """Parent-side reader of worker messages; updates counters and the progress bar."""

    def __init__(self, out_q: Any, procs: list[Any], bar: tqdm | None = None) -> None:
        self.out_q = out_q
        self.procs = procs
        self.bar = bar
        self.ready: dict[int, tuple[dict | None, str | None]] = {}
        self.done: dict[int, tuple[dict, dict]] = {}
        self.stats: dict[int, tuple[dict | None, str | None]] = {}
        self.requests = 0
        self.blocks = 0
        self.prefix = 0
        self.t0 = time.perf_counter()

    def _handle(self, msg: tuple) -> None:
        kind, wid = msg[0], msg[1]
        if kind == "progress":
            _, _, n_req, n_blocks, n_prefix = msg
            self.requests += n_req
            self.blocks += n_blocks
            self.prefix += n_prefix
            if n_req and self.bar is not None:
                elapsed = max(time.perf_counter() - self.t0, 1e-9)
                self.bar.set_postfix(hit=f"{self.prefix / max(self.blocks, 1):.1%}",
                                     rps=f"{self.requests / elapsed:.0f}", refresh=False)
                self.bar.update(n_req)
        elif kind == "ready":
            self.ready[wid] = msg[2]
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
        try:
            msg = self.out_q.get(timeout=timeout) if timeout > 0 else self.out_q.get_nowait()
        except queue.Empty:
            self.check_alive()
            return
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

    def put(self, q: Any, item: object) -> None:
        """Blocking put on a bounded worker queue that keeps reading worker messages."""
        while True:
            try:
                q.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                self.poll(0)
                self.check_alive()


def _stop_workers(procs: list[Any], in_qs: list[Any]) -> None:
    """Ask every worker to close its client and exit; terminate stragglers after 10 s."""
    for q in in_qs:
        for _ in range(10_000):  # on an early stop, drop queued requests to make room
            try:
                q.put_nowait("close")
                break
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    q.get_nowait()
            except (ValueError, OSError):
                break
    deadline = time.monotonic() + 10.0
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


def run_replay(config: LoadgenConfig, requests: Sequence[Request]) -> dict:
    """Replay ``requests`` (already limited) as configured and return the result dict.

    Keys: ``config``, ``master``, ``namespace``, ``requests``, ``blocks``,
    ``prefix_hit_blocks``, ``prefix_hit_rate``, ``reference_lru_hit_rate`` and
    ``reference_capacity_blocks`` (exact LRU of the same requests at the mounted
    capacity), ``requests_per_s``, ``blocks_per_s``, ``ops_per_s`` (client calls),
    ``latency_us`` (op -> count/mean/min/max/p50/p99/p999, µs), ``evictions``
    and ``evicted_bytes`` (master counters' change over the run, ``None`` if
    ``stats()`` failed), ``verification_failures``, ``put_failures``,
    ``put_error_codes``, ``late_misses``, ``exist_errors``, ``wall_s``.
    Also writes it to ``config.json_path`` when set.
    """
    config.validate()
    namespace = config.namespace or f"lg-{uuid.uuid4().hex[:12]}"
    capacity = config.blocks_per_worker * config.workers
    ref = lru_prefix_hit_rate(requests, capacity)
    log_level = logging.getLogger().getEffectiveLevel()
    ctx = mp.get_context("spawn")

    with contextlib.ExitStack() as stack:
        if config.master:
            master_addr = config.master
        else:
            master_addr = stack.enter_context(embedded_master())
        out_q = ctx.Queue()
        in_qs = [ctx.Queue(maxsize=config.queue_depth) for _ in range(config.workers)]
        procs = [
            ctx.Process(target=_worker_main, name=f"loadgen-worker-{i}", daemon=True,
                        args=(i, config, master_addr, namespace, in_qs[i], out_q, log_level))
            for i in range(config.workers)
        ]
        for p in procs:
            p.start()
        stack.callback(_stop_workers, procs, in_qs)
        pump = _Pump(out_q, procs)
        pump.wait_until(lambda: len(pump.ready) == config.workers, "workers to set up", 120.0)
        logger.info("%d workers ready (segment %d bytes each), namespace %s",
                    config.workers, config.segment_bytes, namespace)
        bar = pump.bar = stack.enter_context(
            tqdm(total=len(requests), unit="req", desc="replay", dynamic_ncols=True,
                 disable=True if not config.progress else None))

        lag = LatencyRecorder()
        t0 = time.perf_counter()
        pump.t0 = t0
        ts0 = requests[0].timestamp_ms if requests else 0.0
        for i, req in enumerate(requests):
            if config.speed > 0:
                due = t0 + (req.timestamp_ms - ts0) / 1000.0 / config.speed
                while (now := time.perf_counter()) < due:
                    pump.poll(min(due - now, _POLL_S))
                lag.record("dispatch_lag", max(0.0, time.perf_counter() - due))
            pump.put(in_qs[i % config.workers], (i, req.hash_ids))
            pump.poll(0)
        for q in in_qs:
            pump.put(q, "end")
        pump.wait_until(lambda: len(pump.done) == config.workers, "workers to finish")
        wall_s = time.perf_counter() - t0
        bar.refresh()

        pump.put(in_qs[0], "stats")
        pump.wait_until(lambda: 0 in pump.stats, "master stats", 60.0)
        stats0, err0 = pump.ready[0]
        stats1, err1 = pump.stats[0]

    totals: dict[str, Any] = {}
    put_codes: dict[int, int] = {}
    for wid in sorted(pump.done):
        t, _ = pump.done[wid]
        for k, v in t.items():
            if k == "put_codes":
                for code, n in v.items():
                    put_codes[int(code)] = put_codes.get(int(code), 0) + n
            else:
                totals[k] = totals.get(k, 0) + v
    latency = LatencyRecorder.merged(rec for _, rec in pump.done.values())
    blocks = totals.get("blocks", 0)
    prefix = totals.get("prefix", 0)
    n_req = totals.get("requests", 0)
    if n_req != len(requests):
        raise LoadgenError(f"workers processed {n_req} requests, {len(requests)} were sent")
    cfg = asdict(config)
    result: dict[str, Any] = {
        "config": cfg,
        "master": master_addr,
        "embedded_master": not config.master,
        "namespace": namespace,
        "requests": n_req,
        "blocks": blocks,
        "prefix_hit_blocks": prefix,
        "prefix_hit_rate": prefix / blocks if blocks else 0.0,
        "existing_prefix_blocks": totals.get("existing_prefix", 0),
        "reference_lru_hit_rate": ref.hit_rate,
        "reference_capacity_blocks": capacity,
        "segment_bytes_per_worker": config.segment_bytes,
        "requests_per_s": n_req / wall_s if wall_s > 0 else None,
        "blocks_per_s": blocks / wall_s if wall_s > 0 else None,
        "ops_per_s": totals.get("calls", 0) / wall_s if wall_s > 0 else None,
        "latency_us": latency.summary(),
        "evictions": _delta(stats1, stats0, "evicted_keys"),
        "evicted_bytes": _delta(stats1, stats0, "evicted_bytes"),
        "stats_error": err1 or err0,
        "verification_failures": totals.get("verification_failures", 0),
        "put_failures": totals.get("put_failures", 0),
        "put_error_codes": {str(k): v for k, v in sorted(put_codes.items())},
        "put_blocks": totals.get("put_blocks", 0),
        "late_misses": totals.get("late_misses", 0),
        "exist_errors": totals.get("exist_errors", 0),
        "wall_s": wall_s,
    }
    if config.speed > 0:
        result["dispatch_lag_us"] = lag.summary().get("dispatch_lag")
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

    lines = [
        f"requests          {result['requests']:>12,}    blocks        {result['blocks']:>12,}",
        f"prefix hit rate   {result['prefix_hit_rate']:>12.2%}    exact LRU     "
        f"{result['reference_lru_hit_rate']:>12.2%}  "
        f"({result['reference_capacity_blocks']:,} blocks)",
        f"req/s             {num(result['requests_per_s'], '>12,.1f')}    client ops/s  "
        f"{num(result['ops_per_s'], '>12,.1f')}",
        f"wall              {result['wall_s']:>11.2f}s    evictions     "
        f"{num(result['evictions'], '>12,')}",
        f"late misses       {result['late_misses']:>12,}    put failures  "
        f"{result['put_failures']:>12,}",
        f"verify failures   {result['verification_failures']:>12,}    exist errors  "
        f"{result['exist_errors']:>12,}",
        "",
        f"{'op':<16}{'count':>10}{'p50 us':>10}{'p99 us':>10}{'p999 us':>10}{'max us':>12}",
    ]
    for op, s in result["latency_us"].items():
        lines.append(f"{op:<16}{s['count']:>10,}{num(s['p50_us'], '>10,')}"
                     f"{num(s['p99_us'], '>10,')}{num(s['p999_us'], '>10,')}"
                     f"{num(s['max_us'], '>12,.0f')}")
    if result.get("stats_error"):
        lines.append(f"master stats unavailable: {result['stats_error']}")
    return "\n".join(lines)
