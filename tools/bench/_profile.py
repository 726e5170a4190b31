"""Where kvmaster's master spends its time under a steady client load.

``python -m kvmaster.tools.bench profile [--seconds S] [--profiler cprofile|py-spy|both|none]``

For each workload (``is_exist``: one key per call; ``batch_is_exist_1024``:
1024 keys per call) a fresh master is started, 16,384 small objects are
stored, and this process drives the workload for ``--seconds`` (bounded by
time and by a call count) while the master is profiled:

* ``cprofile``: the master runs under ``python -m cProfile -o FILE``; the
  profile is written when SIGTERM stops it.  Exact call counts, but the
  tracing overhead inflates functions that are called very often.
* ``py-spy``: ``py-spy record --pid`` samples the unmodified master
  (``--nonblocking``, ``--function``); self and total sample shares are
  computed from the raw collapsed stacks.  Needs py-spy installed
  (e.g. in its own venv) and passed with ``--py-spy``.
* ``none``: no profiler, only the rate and the master's CPU per key (an A/B of
  two versions: run it with each on ``PYTHONPATH``).

``put_batch_evicting_1024`` puts 1,024 fresh 4 KiB values per call into a 64 MiB
segment, so that once it is full every call makes the master evict (its
watermark): the steady state of a cache under memory pressure.
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from . import _timing as T
from .store_bench import _pin_prefix, _read_line

PRELOAD = 16_384
WORKLOADS = ("is_exist", "batch_is_exist_1024", "get_batch_1024", "put_batch_1024",
             "put_batch_evicting_1024")
MAX_CALLS = 5_000_000


def _start(cmd: list[str], pin: bool, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with open(log, "wb") as lf:
        proc = subprocess.Popen(_pin_prefix(pin) + cmd, stdout=subprocess.PIPE, stderr=lf,
                                stdin=subprocess.DEVNULL)
    marker = "kvmaster master listening on "
    line = _read_line(proc, 30.0)
    if marker not in line:
        proc.kill()
        proc.wait(5)
        raise RuntimeError(f"master did not start: {line!r}; see {log}")
    return proc, line.split(marker, 1)[1].strip().removeprefix("tcp://")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()


def _top(stats: pstats.Stats, n: int) -> str:
    buf = io.StringIO()
    stats.stream = buf  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(n)
    text = buf.getvalue()
    return (text[text.find("   ncalls"):] if "   ncalls" in text else text).rstrip()


def _drive(addr: str, workload: str, seconds: float, pid: int,
           during: Any = None, client_profile: int = 0) -> dict[str, Any]:
    """Preload, then run the workload; ``during()`` is called right before the
    timed loop (to start a sampler) and must return a finisher or None.  With
    ``client_profile`` the client side of the loop is profiled too (top N)."""
    import cProfile

    from kvmaster import Client

    c = Client()
    c.setup(addr, 64 << 20)
    try:
        keys = [f"prof_{i}" for i in range(PRELOAD)]
        val = b"v" * 64
        for i in range(0, PRELOAD, 1024):
            c.put_batch(keys[i:i + 1024], [val] * 1024)
        batches = [keys[i:i + 1024] for i in range(0, PRELOAD, 1024)]
        per = 1024
        if workload == "is_exist":
            fn, items, per = c.is_exist, keys, 1
        elif workload == "batch_is_exist_1024":
            fn, items = c.batch_is_exist, batches
        elif workload == "get_batch_1024":
            fn, items = c.get_batch, batches
        elif workload == "put_batch_1024":
            # Fresh keys each call; each batch is removed again right away so the
            # segment never fills (the profile holds batch_remove too).
            fresh = [[f"prof_new_{i}" for i in range(j, j + 1024)]
                     for j in range(0, PRELOAD, 1024)]
            vals = [val] * 1024

            def fn(ks: list[str]) -> None:
                c.put_batch(ks, vals)
                c.batch_remove(ks, force=True)

            items = fresh
        elif workload == "put_batch_evicting_1024":
            block = os.urandom(4096)
            blocks = [block] * 1024
            calls_made = itertools.count()

            def fn(_: Any) -> None:
                n = next(calls_made)
                c.put_batch([f"prof_ev_{n}_{i}" for i in range(1024)], blocks)

            items = [None]
        else:
            raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
        finish = during() if during else None
        calls = 0
        n_items = len(items)
        prof = cProfile.Profile() if client_profile else None
        with T.CpuMeter(pid) as m:
            stop_at = T.perf() + seconds
            if prof is not None:
                prof.enable()
            while calls < MAX_CALLS and T.perf() < stop_at:
                fn(items[calls % n_items])
                calls += 1
            if prof is not None:
                prof.disable()
        if finish is not None:
            finish()
        client_top = _top(pstats.Stats(prof), client_profile) if prof is not None else ""
        return {"client_top": client_top, "calls": calls, "keys_s": calls * per / m.wall,
                "calls_s": calls / m.wall,
                "master_cpu_pct": 100 * m.cpu / m.wall,
                "master_cpu_us_per_call": 1e6 * m.cpu / calls if calls else float("nan"),
                "master_cpu_us_per_key": 1e6 * m.cpu / (calls * per) if calls else float("nan"),
                "evicted_keys": c.stats().get("evicted_keys", 0)}
    finally:
        c.close()


def _cprofile(workload: str, a: argparse.Namespace, out: Path) -> str:
    prof = out / f"master-{workload}.prof"
    proc, addr = _start([sys.executable, "-m", "cProfile", "-o", str(prof),
                         "-m", "kvmaster", "master", "--port", "0"], a.pin,
                        out / f"master-{workload}-cprofile.log")
    try:
        load = _drive(addr, workload, a.seconds, proc.pid,
                      client_profile=a.top if a.client else 0)
    finally:
        _stop(proc)
    text = (f"#### cProfile, {workload}: {load['calls']:,} calls, {load['keys_s']:,.0f} keys/s "
            f"under the profiler, master CPU {load['master_cpu_pct']:.0f}% "
            f"({load['master_cpu_us_per_call']:.1f} µs/call)\n\nMaster, by own time:\n\n```\n"
            f"{_top(pstats.Stats(str(prof)), a.top)}\n```\n")
    if load["client_top"]:
        text += f"\nClient (same run), by own time:\n\n```\n{load['client_top']}\n```\n"
    return text


def _pyspy(workload: str, a: argparse.Namespace, out: Path) -> str:
    exe = shutil.which(a.py_spy) or a.py_spy
    if not os.path.exists(exe):
        return f"#### py-spy, {workload}: py-spy not found ({a.py_spy}); skipped\n"
    raw = out / f"master-{workload}.pyspy.txt"
    proc, addr = _start([sys.executable, "-m", "kvmaster", "master", "--port", "0"], a.pin,
                        out / f"master-{workload}-pyspy.log")
    spy: list[subprocess.Popen[bytes]] = []

    def during() -> Any:
        spy.append(subprocess.Popen(
            [exe, "record", "--pid", str(proc.pid), "--duration", str(int(a.seconds)),
             "--rate", "500", "--nonblocking", "--function", "--format", "raw",
             "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)  # let py-spy attach before the load starts
        return lambda: spy[0].wait(a.seconds + 30)

    try:
        load = _drive(addr, workload, a.seconds, proc.pid, during)
    finally:
        for s in spy:
            if s.poll() is None:
                s.terminate()
                s.wait(10)
        _stop(proc)
    if not raw.exists():
        return f"#### py-spy, {workload}: no output (attach failed?)\n"
    self_c: Counter[str] = Counter()
    total_c: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        cnt = int(n)
        frames = [f for f in stack.split(";") if not f.startswith("process ")
                  and not f.startswith("thread ")]
        if not frames:
            continue
        samples += cnt
        self_c[frames[-1]] += cnt
        for f in set(frames):
            total_c[f] += cnt
    lines = [f"#### py-spy, {workload}: {samples:,} active samples at 500 Hz, "
             f"{load['keys_s']:,.0f} keys/s while sampled, master CPU "
             f"{load['master_cpu_pct']:.0f}% ({load['master_cpu_us_per_call']:.1f} µs/call)", "",
             "| self % | total % | function (file) |", "|---|---|---|"]
    for f, cnt in self_c.most_common(a.top):
        lines.append(f"| {100 * cnt / samples:.1f} | {100 * total_c[f] / samples:.1f} | `{f}` |")
    lines += ["", "Largest inclusive shares:", "", "| total % | function |", "|---|---|"]
    for f, cnt in total_c.most_common(a.top):
        lines.append(f"| {100 * cnt / samples:.1f} | `{f}` |")
    return "\n".join(lines) + "\n"


def _unprofiled(workload: str, a: argparse.Namespace, out: Path) -> str:
    proc, addr = _start([sys.executable, "-m", "kvmaster", "master", "--port", "0"], a.pin,
                        out / f"master-{workload}-plain.log")
    try:
        load = _drive(addr, workload, a.seconds, proc.pid)
    finally:
        _stop(proc)
    return (f"#### unprofiled, {workload}: {load['keys_s']:,.0f} keys/s, master CPU "
            f"{load['master_cpu_pct']:.0f}% ({load['master_cpu_us_per_key']:.2f} µs/key), "
            f"{load['evicted_keys']:,} keys evicted\n")


def run(a: argparse.Namespace) -> int:
    out = Path(a.out_dir) if a.out_dir else Path(tempfile.mkdtemp(prefix="kvprof-"))
    out.mkdir(parents=True, exist_ok=True)
    if a.pin:
        os.sched_setaffinity(0, {0})
    sections = [f"Load average at start: {os.getloadavg()}", ""]
    for workload in [w for w in a.workloads.split(",") if w]:
        if a.profiler in ("cprofile", "both"):
            sections.append(_cprofile(workload, a, out))
        if a.profiler in ("py-spy", "both"):
            sections.append(_pyspy(workload, a, out))
        if a.profiler == "none":
            sections.append(_unprofiled(workload, a, out))
    print("\n".join(sections))
    if a.profiler != "none":
        print(f"(raw profiles in {out})", file=sys.stderr)
    elif not a.out_dir:
        shutil.rmtree(out, ignore_errors=True)  # only the masters' logs
    return 0
