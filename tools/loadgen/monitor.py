"""Watching the master during a replay: its process (RSS, CPU) and its counters over time.

:class:`MasterProcess` reads ``/proc`` through psutil for a master on this
host (its pid is known for an embedded master, given with ``--master-pid``,
or found as the owner of the listening port).  :class:`Sampler` is a thread
in the dispatcher process with its own consumer-only client (no segment) that
calls ``stats()`` every ``interval_s`` and records one row per call, tagged
with the dispatcher's trace clock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

logger = logging.getLogger(__name__)

__all__ = ["MasterProcess", "Sampler", "find_listening_pid"]

_LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def find_listening_pid(addr: str) -> int | None:
    """Pid of the process listening on ``host:port`` of this host, or ``None``."""
    host, _, port = addr.rpartition(":")
    if host not in _LOOPBACK or not port.isdigit():
        return None
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == int(port) and c.pid:
            return c.pid
    return None


class MasterProcess:
    """RSS and CPU time of the master process; every read returns ``None`` once it is gone."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self._proc: psutil.Process | None = None
        if pid is not None:
            try:
                self._proc = psutil.Process(pid)
            except psutil.Error:
                logger.warning("master pid %s not found; no RSS/CPU figures", pid)
        self.peak_rss = 0

    def sample(self) -> tuple[int | None, float | None]:
        """``(rss_bytes, cpu_seconds)`` (user + system) now."""
        if self._proc is None:
            return None, None
        try:
            with self._proc.oneshot():
                rss = self._proc.memory_info().rss
                t = self._proc.cpu_times()
        except psutil.Error:
            return None, None
        self.peak_rss = max(self.peak_rss, rss)
        return rss, t.user + t.system


class Sampler(threading.Thread):
    """Background ``stats()`` poller (see the module docstring); runs in its own thread.

    ``clock()`` returns the dispatcher's ``(trace_ms, requests_done, blocks,
    prefix_hits, planned_pinned_blocks)`` when sampled.  Rows keep the counters the plots need (the
    master may serve its pinned-key gauges from a cache a few seconds old).
    """

    FIELDS = ("keys", "soft_pinned_keys", "soft_pinned_bytes", "evicted_keys",
              "evicted_soft_pinned_keys", "sessions", "pinned_sessions", "memberships",
              "allocated_bytes")

    def __init__(self, client: Any, master: MasterProcess, interval_s: float,
                 clock: Callable[[], tuple[float, int, int, int, int]]) -> None:
        super().__init__(name="loadgen-sampler", daemon=True)
        self.client = client
        self.master = master
        self.interval_s = interval_s
        self.clock = clock
        self.rows: list[dict[str, Any]] = []
        self.errors = 0
        self._stop_evt = threading.Event()
        self._t0 = time.perf_counter()

    def sample_once(self) -> None:
        trace_ms, done, blocks, hits, planned_pinned = self.clock()
        row: dict[str, Any] = {"wall_s": round(time.perf_counter() - self._t0, 3),
                               "trace_s": round(trace_ms / 1000.0, 3), "requests": done,
                               "blocks": blocks, "prefix_hits": hits,
                               "planned_pinned_blocks": planned_pinned}
        try:
            stats = self.client.stats()
        except Exception as exc:  # noqa: BLE001 - a missed sample is not fatal
            self.errors += 1
            logger.debug("stats() failed: %s", exc)
            stats = {}
        for f in self.FIELDS:
            v = stats.get(f)
            row[f] = v if isinstance(v, int) else None
        row["master_rss"], row["master_cpu_s"] = self.master.sample()
        self.rows.append(row)

    def run(self) -> None:
        while not self._stop_evt.wait(self.interval_s):
            self.sample_once()

    def stop(self, final_sample: bool = True) -> None:
        """Stop, join, take a last sample (unless the run failed) and close the client."""
        self._stop_evt.set()
        if self.is_alive():
            self.join(timeout=30)
        if final_sample:
            self.sample_once()
        with contextlib.suppress(Exception):
            self.client.close()
