"""Timing, percentile and /proc helpers shared by every benchmark worker.

Standard library only: the Mooncake worker runs under a different interpreter
(the anchor's venv) that does not have kvmaster installed, and loads this file
by path.  Both systems are therefore timed by exactly the same code.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")
perf = time.perf_counter


# ---------------------------------------------------------------- machine

def cpu_model() -> str:
    """The first ``model name`` of /proc/cpuinfo, "" where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# ------------------------------------------------------------------ stats

def percentile(sorted_vals: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (``q`` in [0, 1])."""
    if not sorted_vals:
        return float("nan")
    idx = int(round(q * (len(sorted_vals) - 1)))
    return sorted_vals[max(0, min(len(sorted_vals) - 1, idx))]


def median(values: Sequence[float]) -> float:
    vals = [v for v in values if isinstance(v, (int, float)) and v == v]
    return float(statistics.median(vals)) if vals else float("nan")


def median_of_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise median of a list of flat dicts with numeric values."""
    if not runs:
        return {}
    out: dict[str, Any] = {}
    for key in runs[0]:
        vals = [r.get(key) for r in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = median(vals)
        else:
            out[key] = vals[0]
    out["runs"] = len(runs)
    return out


# ------------------------------------------------------------------- /proc

def proc_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (a master may run helper processes)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _ticks_one(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_cpu_ticks_s(pid: int) -> float:
    """utime + stime (from /proc/<pid>/stat, all threads) of a process and its
    live descendants, in seconds."""
    total = 0.0
    for p in proc_tree(pid):
        try:
            total += _ticks_one(p)
        except OSError:
            continue
    return total


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of all live threads of a process and its descendants with ns
    resolution (schedstat); falls back to utime+stime without schedstat."""
    total = 0
    try:
        for p in proc_tree(pid):
            try:
                tids = os.listdir(f"/proc/{p}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
                except (FileNotFoundError, ProcessLookupError):
                    continue
        return total / 1e9
    except OSError:
        return proc_cpu_ticks_s(pid)


def proc_status(pid: int, field: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
    return ""


def proc_rss_bytes(pid: int) -> int:
    """VmRSS of a process plus its live descendants, in bytes (-1 if unknown)."""
    total = 0
    for p in proc_tree(pid):
        try:
            v = proc_status(p, "VmRSS")
        except OSError:
            continue
        total += int(v.split()[0]) * 1024 if v else 0
    return total or -1


class CpuMeter:
    """Master CPU seconds and wall seconds spent inside a ``with`` block."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.cpu = float("nan")
        self.wall = float("nan")

    def __enter__(self) -> CpuMeter:
        self._c0 = proc_cpu_s(self.pid) if self.pid else float("nan")
        self._t0 = perf()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = perf() - self._t0
        self.cpu = (proc_cpu_s(self.pid) if self.pid else float("nan")) - self._c0


# ------------------------------------------------------------------ loops

def time_each(fn: Callable[[Any], Any], items: Sequence[Any], deadline_s: float,
              ok: Callable[[Any, Any], bool] | None = None) -> dict[str, Any]:
    """Call ``fn(item)`` for each item, timing every call.

    Bounded by ``len(items)`` and by ``deadline_s`` of wall time.  Exceptions
    count as errors (the loop goes on).  Returns the raw latencies (µs), the
    elapsed seconds, the number of calls and of errors.
    """
    lat: list[float] = []
    errors = 0
    pc = perf
    start = pc()
    stop_at = start + deadline_s
    for item in items:
        t0 = pc()
        try:
            r = fn(item)
            failed = ok is not None and not ok(r, item)
        except Exception:  # noqa: BLE001 - an error is a data point, not a crash
            failed = True
        t1 = pc()
        lat.append((t1 - t0) * 1e6)
        errors += failed
        if t1 > stop_at:
            break
    return {"lat_us": lat, "elapsed_s": pc() - start, "calls": len(lat), "errors": errors}


def latency_summary(raw: dict[str, Any], units: int | None = None) -> dict[str, Any]:
    """p50/p99/mean of the per-call latencies, calls/s and (if given) units/s."""
    s = sorted(raw["lat_us"])
    n = len(s)
    el = raw["elapsed_s"]
    out = {
        "calls": n,
        "p50_us": percentile(s, 0.50),
        "p99_us": percentile(s, 0.99),
        "mean_us": sum(s) / n if n else float("nan"),
        "ops_s": n / el if el > 0 else float("nan"),
        "errors": raw["errors"],
    }
    if units is not None:
        out["units"] = units
        out["units_s"] = units / el if el > 0 else float("nan")
    return out


def add_cpu(summary: dict[str, Any], meter: CpuMeter, per: int, name: str) -> dict[str, Any]:
    """Attach master CPU %% and master CPU µs per ``name`` to a summary."""
    summary["master_cpu_pct"] = (100.0 * meter.cpu / meter.wall) if meter.wall else float("nan")
    summary[f"master_cpu_us_per_{name}"] = (1e6 * meter.cpu / per) if per else float("nan")
    return summary
