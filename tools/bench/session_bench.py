"""KV-session operations, kvmaster vs a Redis emulation with sets, in one run.

``python -m kvmaster.tools.bench.session_bench [--quick] [--runs N] [--json FILE]
[--md FILE] [--pin] [--wait-load L --wait-max S] [--profile OP]``

The driver (this process) starts, for every run and every phase, a fresh
kvmaster master (``python -m kvmaster master --port 0 --metrics-port -1``,
the default layout: one shard) and a throw-away redis-server (the Redis anchor's
``start_redis.sh``), and runs this same file as a worker in a child process
against each: kvmaster's worker under this interpreter, Redis's under the
Redis venv's interpreter (redis-py + hiredis).  Both workers time with the
same helpers (``_timing.py``, loaded by path) and return JSON.  The order of
the two systems alternates from run to run; tables give the median over runs.

Redis data model (as in the anchor): ``s:<sid>:m`` = SET of the session's
block keys, ``r:<blk>`` = SET of the sessions holding the block,
``s:<sid>:pin`` = "1".  Block keys are ``blk:<16 hex>`` (20 B) in both
systems, session ids ``sess:<6 digits>``.  kvmaster's objects are written
first (put_batch of 64 B values, 4096 per call; untimed).

Operations (full sizes; ``--quick`` shrinks them):

* attach: 64 sessions x 1024 keys, session i holds blocks [512 i, 512 i + 1024)
  (50 % overlap with its neighbour).  kvmaster: one ``attach_kv_session``.
  Redis: one pipeline, SADD s:m <1024> + 1024 x SADD r:<blk> sid.
* pin / unpin of a 100,000-member session: 2000 of each.  kvmaster:
  ``pin_kv_session`` / ``unpin_kv_session``; Redis: SET / DEL s:pin.
* update keeping half of a 100,000-member session (5 per run, each on a freshly
  attached session).  kvmaster: ``update_kv_session(sid, keep)`` with the 50,000
  kept keys.  Redis: SREM of the removed half from s:m plus one SREM r:<blk> per
  removed key, pipelines of 4096 commands; "client knows" (the client already
  has the member list) and "server-authoritative" (SMEMBERS first).
* close a 100,000-member session (5 per run).  kvmaster: ``close_kv_session``.
  Redis: DEL s:m s:pin plus one SREM r:<blk> per member, pipelines of 4096;
  same two variants.
* list 1,000,000 members.  kvmaster: ``list_kv_session_keys`` pages of 4096
  (the session is attached, untimed, to the objects of the ``disjoint`` memory
  layout after its measurement); Redis: SSCAN COUNT 4096 over a 1,000,000-member
  SET (members de-duplicated client-side, as SSCAN may repeat them).
* memory per membership, 1,000,000 memberships in two layouts: ``disjoint`` =
  10 sessions x 100,000 keys, each key in one session; ``overlap`` = 1000
  sessions x 1000 keys with 50 % neighbour overlap, each key in two sessions.
  kvmaster: master RSS (psutil, process and children) after the attaches minus
  RSS after writing the objects (so the objects themselves are not counted).
  Redis: ``INFO memory`` used_memory delta for the forward and reverse sets.

Rates are per key: memberships attached / removed / listed per second; for pin
and unpin (O(1) in both systems) members covered per second = members x calls/s.
Server CPU (master process tree / redis-server, from /proc schedstat) and client
CPU are recorded around the timed regions (once around a loop of short calls).
Every timed loop is bounded by a count and by a deadline.  For every phase the
share of all CPUs used by other processes is recorded (the machine is shared);
``--wait-load L --wait-max S`` first waits, bounded, for a quiet machine.
``--from-json FILE`` prints the tables of an earlier run again.

``--profile OP`` (attach, pin, update, close, list) instead runs one kvmaster
master and profiles it only while that operation runs: with cProfile (the
master runs under a small wrapper that switches the profiler on and off on
SIGUSR1/SIGUSR2; ``--profile-clock cpu`` charges CPU time of the event loop
thread, ``wall`` wall time) or, with ``--py-spy PATH``, by sampling the
unmodified master with py-spy, reporting self and inclusive sample shares.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import platform
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The anchors (../shared/anchors next to the repository; KVMASTER_SHARED overrides)
# and their venvs (the anchors' install.sh defaults; MC_VENV / REDIS_VENV override).
SHARED = Path(os.environ.get("KVMASTER_SHARED")
              or Path(__file__).resolve().parents[2].parent / "shared")
REDIS_ANCHOR = SHARED / "anchors" / "redis"
REDIS_PYTHON = Path(os.environ.get("REDIS_VENV", "/tmp/redisvenv")) / "bin" / "python"

_spec = importlib.util.spec_from_file_location("_sb_timing", HERE / "_timing.py")
T = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(T)  # type: ignore[union-attr]

pc = time.perf_counter
VALUE_BYTES = 64
BATCH = 4096
DEADLINE_S = 120.0  # cap of every timed loop

FULL = {
    "attach_sessions": 64, "attach_keys": 1024,
    "big": 100_000, "pin_ops": 2000, "update_reps": 5, "close_reps": 5,
    "list_members": 1_000_000, "list_reps": 3,
    "mem_disjoint": (10, 100_000), "mem_overlap": (1000, 1000),
}
QUICK = {
    "attach_sessions": 8, "attach_keys": 1024,
    "big": 10_000, "pin_ops": 200, "update_reps": 2, "close_reps": 2,
    "list_members": 40_000, "list_reps": 2,
    "mem_disjoint": (4, 10_000), "mem_overlap": (40, 1000),
}


# ------------------------------------------------------------------ shared

def blk(i: int) -> str:
    """20-byte hash-like block key (non-integer, so no Redis intset)."""
    return "blk:%016x" % (i * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF)


def sname(i: int) -> str:
    return f"sess:{i:06d}"


# key ranges (block indices) of the data sets
ATTACH_BASE = 0
BIG_BASE = 50_000_000


def attach_keys(size: dict[str, Any], sid: int) -> list[str]:
    n = size["attach_keys"]
    return [blk(ATTACH_BASE + j) for j in range(sid * (n // 2), sid * (n // 2) + n)]


def layout(kind: str, size: dict[str, Any]) -> tuple[list[list[int]], int]:
    """Sessions of a memory layout as lists of block indices; and the object count."""
    nsess, per = size["mem_" + kind]
    if kind == "disjoint":
        return [list(range(s * per, (s + 1) * per)) for s in range(nsess)], nsess * per
    step = per // 2
    return [list(range(s * step, s * step + per)) for s in range(nsess)], (nsess - 1) * step + per


class Region:
    """Accumulates wall, client CPU and server CPU over timed regions; GC is off inside."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.lat: list[float] = []
        self.client_cpu = 0.0
        self.server_cpu = 0.0
        self._in_loop = False

    @contextlib.contextmanager
    def loop(self) -> Iterator[Region]:
        """CPU measured once around many short calls (reading /proc per call would
        charge the servers' background work during the reads to the calls)."""
        gc.disable()
        self._in_loop = True
        s0, c0 = T.proc_cpu_s(self.server_pid), time.process_time()
        try:
            yield self
        finally:
            c1, s1 = time.process_time(), T.proc_cpu_s(self.server_pid)
            self._in_loop = False
            gc.enable()
            self.client_cpu += c1 - c0
            self.server_cpu += s1 - s0

    def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, timed."""
        if self._in_loop:
            t0 = pc()
            try:
                return fn(*args)
            finally:
                self.lat.append(pc() - t0)
        gc.disable()
        s0 = T.proc_cpu_s(self.server_pid)
        c0 = time.process_time()
        t0 = pc()
        try:
            out = fn(*args)
        finally:
            t1 = pc()
            c1 = time.process_time()
            s1 = T.proc_cpu_s(self.server_pid)
            gc.enable()
        self.lat.append(t1 - t0)
        self.client_cpu += c1 - c0
        self.server_cpu += s1 - s0
        return out

    def summary(self, units_per_call: float) -> dict[str, Any]:
        s = sorted(self.lat)
        n = len(s)
        wall = sum(s)
        units = units_per_call * n
        return {
            "calls": n, "units": units,
            "p50_ms": T.percentile(s, 0.5) * 1e3, "p99_ms": T.percentile(s, 0.99) * 1e3,
            "rate": units / wall if wall > 0 else float("nan"),
            "rate_p50": units_per_call / T.percentile(s, 0.5) if n else float("nan"),
            "server_cpu_us_per_unit": 1e6 * self.server_cpu / units if units else float("nan"),
            "client_cpu_us_per_unit": 1e6 * self.client_cpu / units if units else float("nan"),
        }


def bounded(items: Any, deadline_s: float = DEADLINE_S) -> Any:
    """Yield from items until the deadline passes (the loops are also count-bounded)."""
    stop = pc() + deadline_s
    for it in items:
        yield it
        if pc() > stop:
            print(f"  (deadline {deadline_s:.0f} s reached, loop cut short)", file=sys.stderr)
            return


def _rss_tree(pid: int) -> int:
    import psutil

    p = psutil.Process(pid)
    total = p.memory_info().rss
    for ch in p.children(recursive=True):
        try:
            total += ch.memory_info().rss
        except psutil.Error:
            continue
    return total


def _profile_signal(pid: int, sig: int, ack: Path, poke: Any) -> None:
    """Ask the master to start/stop its profiler and wait (bounded) for the ack file."""
    if ack.exists():
        ack.unlink()
    os.kill(pid, sig)
    for _ in range(200):
        poke()  # a request wakes the event loop so the handler runs
        if ack.exists():
            return
        time.sleep(0.02)
    raise RuntimeError("the master did not acknowledge the profiler signal")


# ---------------------------------------------------------- kvmaster worker

class KvWorker:
    def __init__(self, addr: str, pid: int, objects_hint: int) -> None:
        from kvmaster import Client

        self.pid = pid
        self.c = Client()
        seg = max(64 << 20, objects_hint * VALUE_BYTES * 3)
        self.c.setup(addr, seg)
        self.value = b"v" * VALUE_BYTES

    def close(self) -> None:
        self.c.close()

    def write_objects(self, idx: Any) -> None:
        keys = [blk(i) for i in idx]
        for i in range(0, len(keys), BATCH):
            chunk = keys[i:i + BATCH]
            res = self.c.put_batch(chunk, [self.value] * len(chunk))
            bad = [r for r in res if r != 0]
            if bad:
                raise RuntimeError(f"put_batch failed: {bad[:4]}")

    def attach_all(self, sid: str, keys: list[str]) -> None:
        for i in range(0, len(keys), BATCH):
            res = self.c.attach_kv_session(sid, keys[i:i + BATCH])
            if any(res):
                raise RuntimeError(f"attach failed: {[r for r in res if r][:4]}")

    def ops(self, size: dict[str, Any], only: str = "", prof: Any = None) -> dict[str, Any]:
        from kvmaster import SessionNotFound

        c = self.c
        res: dict[str, Any] = {}
        na, nk, big = size["attach_sessions"], size["attach_keys"], size["big"]
        self.write_objects(range(ATTACH_BASE, ATTACH_BASE + (na + 1) * (nk // 2)))
        self.write_objects(range(BIG_BASE, BIG_BASE + big))
        bigkeys = [blk(BIG_BASE + i) for i in range(big)]
        keep = bigkeys[::2]

        def timed(name: str) -> bool:
            return not only or only == name

        def start(name: str) -> None:
            if prof is not None and only == name:
                prof(True)

        def stop(name: str) -> None:
            if prof is not None and only == name:
                prof(False)

        if timed("attach"):
            reg = Region(self.pid)
            start("attach")
            keysets = [attach_keys(size, s) for s in range(na)]
            with reg.loop():
                for s in bounded(range(na)):
                    r = reg.run(c.attach_kv_session, sname(s), keysets[s])
                    if any(r):
                        raise RuntimeError("attach refused")
            stop("attach")
            res["attach"] = reg.summary(nk)
            if c.get_kv_session(sname(0)).member_count != nk:
                raise RuntimeError("attach: wrong member count")

        if timed("pin"):
            sid = "pin:000000"
            self.attach_all(sid, bigkeys)
            # reference: one O(1) request to the session's home shard, no walk
            reg = Region(self.pid)
            with reg.loop():
                for _ in bounded(range(size["pin_ops"])):
                    reg.run(c.get_kv_session, sid)
            res["get"] = reg.summary(big)
            res["get"]["ops_s"] = len(reg.lat) / sum(reg.lat)
            for op in ("pin", "unpin"):
                fn = c.pin_kv_session if op == "pin" else c.unpin_kv_session
                reg = Region(self.pid)
                start("pin")
                with reg.loop():
                    for _ in bounded(range(size["pin_ops"])):
                        reg.run(fn, sid)
                stop("pin")
                res[op] = reg.summary(big)
                res[op]["ops_s"] = len(reg.lat) / sum(reg.lat)
                if c.get_kv_session(sid).pinned != (op == "pin"):
                    raise RuntimeError(f"{op}: wrong pin state")
            c.close_kv_session(sid)

        if timed("update"):
            reg = Region(self.pid)
            for r in bounded(range(size["update_reps"])):
                sid = f"upd:{r:06d}"
                self.attach_all(sid, bigkeys)
                start("update")
                removed = reg.run(c.update_kv_session, sid, keep)
                stop("update")
                if removed != big - len(keep) or c.get_kv_session(sid).member_count != len(keep):
                    raise RuntimeError(f"update removed {removed}")
                c.close_kv_session(sid)
            res["update"] = reg.summary(big - len(keep))

        if timed("close"):
            reg = Region(self.pid)
            for r in bounded(range(size["close_reps"])):
                sid = f"cls:{r:06d}"
                self.attach_all(sid, bigkeys)
                c.pin_kv_session(sid)
                start("close")
                reg.run(c.close_kv_session, sid)
                stop("close")
                try:
                    c.get_kv_session(sid)
                except SessionNotFound:
                    pass
                else:
                    raise RuntimeError("close: session still there")
            res["close"] = reg.summary(big)
        return res

    def mem(self, size: dict[str, Any], kind: str, with_list: bool, only: str = "",
            prof: Any = None) -> dict[str, Any]:
        res: dict[str, Any] = {}
        sessions, nobj = layout(kind, size)
        nlist = size["list_members"] if with_list else 0
        if only != "list":
            r_empty = self._settled_rss()
            self.write_objects(range(nobj))
            r_obj = self._settled_rss()
            memberships = 0
            for s, idx in enumerate(sessions):
                self.attach_all(sname(s), [blk(i) for i in idx])
                memberships += len(idx)
            r_att = self._settled_rss()
            res["mem_" + kind] = {
                "sessions": len(sessions), "objects": nobj, "memberships": memberships,
                "rss_empty": r_empty, "rss_objects": r_obj, "rss_attached": r_att,
                "bytes_per_object": (r_obj - r_empty) / nobj,
                "bytes_per_membership": (r_att - r_obj) / memberships,
            }
        if nlist:
            # the list session reuses the layout's objects (written above), untimed
            have = nobj if only != "list" else 0
            if nlist > have:
                self.write_objects(range(have, nlist))
            sid = "list:000000"
            self.attach_all(sid, [blk(i) for i in range(nlist)])
            c = self.c
            max_calls = 2 * (nlist // BATCH) + 10

            def enumerate_all() -> int:
                cursor, out, calls = "", [], 0
                while calls < max_calls:
                    p = c.list_kv_session_keys(sid, cursor, BATCH)
                    out.extend(p.keys)
                    calls += 1
                    cursor = p.next_cursor
                    if not cursor:
                        break
                enumerate_all.calls = calls  # type: ignore[attr-defined]
                return len(out)

            reg = Region(self.pid)
            for _ in bounded(range(size["list_reps"])):
                if prof is not None and only == "list":
                    prof(True)
                n = reg.run(enumerate_all)
                if prof is not None and only == "list":
                    prof(False)
                if n != nlist:
                    raise RuntimeError(f"list returned {n} of {nlist}")
            res["list"] = reg.summary(nlist)
            res["list"]["pages"] = enumerate_all.calls  # type: ignore[attr-defined]
        return res

    def _settled_rss(self) -> int:
        time.sleep(0.5)
        return _rss_tree(self.pid)


# ------------------------------------------------------------- Redis worker

class RedisWorker:
    def __init__(self, port: int, pid: int) -> None:
        import redis

        self.pid = pid
        self.r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=120)
        self.r.flushall(asynchronous=False)

    def close(self) -> None:
        self.r.close()

    def attach_pipe(self, sid: str, keys: list[str]) -> None:
        """SADD s:m <keys> + per-key SADD r:<k> sid, pipelines of <= BATCH+1 commands."""
        for i in range(0, len(keys), BATCH):
            chunk = keys[i:i + BATCH]
            p = self.r.pipeline(transaction=False)
            p.sadd(f"s:{sid}:m", *chunk)
            for k in chunk:
                p.sadd("r:" + k, sid)
            p.execute()

    def _srem_pipe(self, sid: str, members: list[Any], forward: bool, delete: bool) -> None:
        """Remove members: [DEL s:m s:pin] + [SREM s:m <chunk>] + per-key SREM r:<k> sid."""
        r = self.r
        fwd = f"s:{sid}:m"
        for i in range(0, max(len(members), 1), BATCH):
            chunk = members[i:i + BATCH]
            p = r.pipeline(transaction=False)
            if delete and i == 0:
                p.delete(fwd, f"s:{sid}:pin")
            if forward and chunk:
                p.srem(fwd, *chunk)
            for k in chunk:
                p.srem((b"r:" if type(k) is bytes else "r:") + k, sid)
            p.execute()

    def _update_fetch(self, sid: str, keep: set[bytes]) -> None:
        """Server-authoritative update: SMEMBERS, diff, then remove."""
        cur = self.r.smembers(f"s:{sid}:m")
        self._srem_pipe(sid, [k for k in cur if k not in keep], True, False)

    def _close_fetch(self, sid: str) -> None:
        """Server-authoritative close: SMEMBERS, then DEL + reverse SREMs."""
        self._srem_pipe(sid, list(self.r.smembers(f"s:{sid}:m")), False, True)

    def ops(self, size: dict[str, Any]) -> dict[str, Any]:
        r = self.r
        res: dict[str, Any] = {}
        na, nk, big = size["attach_sessions"], size["attach_keys"], size["big"]
        bigkeys = [blk(BIG_BASE + i) for i in range(big)]
        keep = bigkeys[::2]
        keep_set = set(keep)
        removed_known = [k for k in bigkeys if k not in keep_set]
        keep_bytes = {k.encode() for k in keep}

        reg = Region(self.pid)
        keysets = [attach_keys(size, s) for s in range(na)]
        with reg.loop():
            for s in bounded(range(na)):
                reg.run(self.attach_pipe, sname(s), keysets[s])
        res["attach"] = reg.summary(nk)
        if r.scard(f"s:{sname(0)}:m") != nk or r.scard("r:" + attach_keys(size, 1)[0]) != 2:
            raise RuntimeError("attach: wrong cardinality")

        sid = "pin:000000"
        self.attach_pipe(sid, bigkeys)
        reg = Region(self.pid)
        with reg.loop():
            for _ in bounded(range(size["pin_ops"])):
                reg.run(r.scard, f"s:{sid}:m")
        res["get"] = reg.summary(big)
        res["get"]["ops_s"] = len(reg.lat) / sum(reg.lat)
        for op in ("pin", "unpin"):
            reg = Region(self.pid)
            pk = f"s:{sid}:pin"
            with reg.loop():
                for _ in bounded(range(size["pin_ops"])):
                    if op == "pin":
                        reg.run(r.set, pk, 1)
                    else:
                        reg.run(r.delete, pk)
            res[op] = reg.summary(big)
            res[op]["ops_s"] = len(reg.lat) / sum(reg.lat)
            if bool(r.exists(pk)) != (op == "pin"):
                raise RuntimeError(f"{op}: wrong state")
        self._srem_pipe(sid, bigkeys, False, True)

        # update, client knows the current members
        reg = Region(self.pid)
        for rep in bounded(range(size["update_reps"])):
            sid = f"upd:{rep:06d}"
            self.attach_pipe(sid, bigkeys)
            reg.run(self._srem_pipe, sid, removed_known, True, False)
            if r.scard(f"s:{sid}:m") != len(keep):
                raise RuntimeError("update(known): wrong cardinality")
            self._srem_pipe(sid, keep, False, True)
        res["update_known"] = reg.summary(len(removed_known))

        # update, server-authoritative: SMEMBERS first
        reg = Region(self.pid)
        for rep in bounded(range(size["update_reps"])):
            sid = f"upd:{rep:06d}"
            self.attach_pipe(sid, bigkeys)
            reg.run(self._update_fetch, sid, keep_bytes)
            if r.scard(f"s:{sid}:m") != len(keep):
                raise RuntimeError("update(fetch): wrong cardinality")
            self._srem_pipe(sid, keep, False, True)
        res["update_fetch"] = reg.summary(len(removed_known))

        for variant in ("known", "fetch"):
            reg = Region(self.pid)
            for rep in bounded(range(size["close_reps"])):
                sid = f"cls:{rep:06d}"
                self.attach_pipe(sid, bigkeys)
                r.set(f"s:{sid}:pin", 1)
                if variant == "known":
                    reg.run(self._srem_pipe, sid, bigkeys, False, True)
                else:
                    reg.run(self._close_fetch, sid)
                if r.exists(f"s:{sid}:m", f"s:{sid}:pin") or r.exists("r:" + bigkeys[0]):
                    raise RuntimeError("close: leftovers")
            res["close_" + variant] = reg.summary(big)
        if r.dbsize() != na * nk // 2 + nk // 2 + na:
            # forward sets of the attach sessions + their reverse sets must be all that is left
            raise RuntimeError(f"unexpected leftover keys: {r.dbsize()}")
        r.flushall(asynchronous=False)
        return res

    def _used(self) -> int:
        time.sleep(0.2)
        return int(self.r.info("memory")["used_memory"])

    def mem(self, size: dict[str, Any], kind: str, with_list: bool) -> dict[str, Any]:
        r = self.r
        res: dict[str, Any] = {}
        sessions, nobj = layout(kind, size)
        r.flushall(asynchronous=False)
        m0 = self._used()
        memberships = 0
        for s, idx in enumerate(sessions):
            self.attach_pipe(sname(s), [blk(i) for i in idx])
            memberships += len(idx)
        m1 = self._used()
        enc = r.object("encoding", f"s:{sname(0)}:m")
        res["mem_" + kind] = {
            "sessions": len(sessions), "objects": nobj, "memberships": memberships,
            "used_memory_delta": m1 - m0, "bytes_per_membership": (m1 - m0) / memberships,
            "encoding": enc.decode() if isinstance(enc, bytes) else str(enc),
        }
        r.flushall(asynchronous=False)
        nlist = size["list_members"] if with_list else 0
        if nlist:
            bigset = "s:list:000000:m"
            for i in range(0, nlist, 8192):
                r.sadd(bigset, *[blk(j) for j in range(i, min(nlist, i + 8192))])
            if r.scard(bigset) != nlist:
                raise RuntimeError("list set: wrong cardinality")
            max_calls = 10 * (nlist // BATCH) + 10

            def enumerate_all() -> int:
                cur, seen, calls = 0, set(), 0
                while calls < max_calls:
                    cur, chunk = r.sscan(bigset, cur, count=BATCH)
                    seen.update(chunk)
                    calls += 1
                    if cur == 0:
                        break
                enumerate_all.calls = calls  # type: ignore[attr-defined]
                return len(seen)

            reg = Region(self.pid)
            for _ in bounded(range(size["list_reps"])):
                n = reg.run(enumerate_all)
                if n != nlist:
                    raise RuntimeError(f"SSCAN returned {n} of {nlist}")
            res["list"] = reg.summary(nlist)
            res["list"]["pages"] = enumerate_all.calls  # type: ignore[attr-defined]
            r.flushall(asynchronous=False)
        return res


def worker_main(args: argparse.Namespace) -> int:
    size = dict(QUICK if args.quick else FULL)
    out: dict[str, Any]
    if args.worker == "kvmaster":
        hint = {"ops": (size["attach_sessions"] + 1) * size["attach_keys"] // 2 + size["big"],
                "mem": max(layout(args.layout, size)[1], size["list_members"] * args.with_list)}
        w = KvWorker(args.addr, args.server_pid, hint[args.phase])
        prof = None
        if args.py_spy:
            spy: list[subprocess.Popen[bytes]] = []

            windows = iter(range(1, 10_000))

            def prof(on: bool) -> None:
                if on:  # one output file per profiled window: <out>.1, <out>.2, ...
                    out = f"{args.py_spy_out}.{next(windows)}"
                    spy.append(subprocess.Popen(
                        [args.py_spy, "record", "--pid", str(args.server_pid), "--rate", "1000",
                         "--nonblocking", "--format", "raw", "--output", out],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL))
                    time.sleep(1.0)  # let it attach
                else:
                    p = spy.pop()
                    p.send_signal(signal.SIGINT)
                    try:
                        p.wait(60)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait(10)
        elif args.profile_ack:
            ack = Path(args.profile_ack)

            def prof(on: bool) -> None:
                _profile_signal(args.server_pid, signal.SIGUSR1 if on else signal.SIGUSR2,
                                ack, lambda: w.c.batch_is_exist(["x"]))
        try:
            if args.phase == "ops":
                out = w.ops(size, args.only, prof)
            else:
                out = w.mem(size, args.layout, bool(args.with_list), args.only, prof)
        finally:
            w.close()
    else:
        w = RedisWorker(args.port, args.server_pid)
        try:
            out = (w.ops(size) if args.phase == "ops"
                   else w.mem(size, args.layout, bool(args.with_list)))
        finally:
            w.close()
    Path(args.out).write_text(json.dumps(out))
    return 0


# ------------------------------------------------------------------ driver

def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    stop = time.monotonic() + timeout
    try:
        while b"\n" not in buf:
            left = stop - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            ch = os.read(proc.stdout.fileno(), 4096)
            if not ch:
                break
            buf += ch
    finally:
        sel.close()
    return buf.decode(errors="replace")


def _pin_prefix(pin: bool) -> list[str]:
    return ["taskset", "-c", "0"] if pin else []


class KvServer:
    def __init__(self, pin: bool, workdir: Path, profile_out: str = "", ack: str = "") -> None:
        self.pin = pin
        self.workdir = workdir
        self.profile_out = profile_out
        self.ack = ack
        self.prof_clock = "cpu"
        self.proc: subprocess.Popen[bytes] | None = None
        self.addr = ""

    def start(self) -> None:
        margs = ["master", "--port", "0", "--metrics-port", "-1", "--log-level", "WARNING"]
        if self.profile_out:
            cmd = [sys.executable, str(HERE / "session_bench.py"), "--serve-master",
                   "--prof-out", self.profile_out, "--prof-ack", self.ack,
                   "--prof-clock", self.prof_clock, "--", *margs]
        else:
            cmd = [sys.executable, "-m", "kvmaster", *margs]
        with open(self.workdir / "master.log", "ab") as log:
            self.proc = subprocess.Popen(_pin_prefix(self.pin) + cmd, stdout=subprocess.PIPE,
                                         stderr=log, stdin=subprocess.DEVNULL)
        line = _read_line(self.proc, 60.0)
        marker = "kvmaster master listening on "
        if marker not in line:
            self.stop()
            raise RuntimeError(f"master did not start: {line!r}; see {self.workdir}/master.log")
        self.addr = line.split(marker, 1)[1].split()[0].removeprefix("tcp://")

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def stop(self) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if p.stdout is not None:
            p.stdout.close()
        self.proc = None


class RedisServer:
    def __init__(self, pin: bool, workdir: Path) -> None:
        self.pin = pin
        self.state = workdir / "redis"
        self.port = 0
        self.pid = 0
        self.version = ""

    def start(self) -> None:
        env = {**os.environ, "STATE_DIR": str(self.state)}
        self.state.mkdir(parents=True, exist_ok=True)
        log = self.state / "start.out"
        # Output to a file: the server inherits the script's stdout and outlives it.
        with open(log, "wb") as f:
            rc = subprocess.run([str(REDIS_ANCHOR / "start_redis.sh")], env=env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=60, check=False).returncode
        out = log.read_text(errors="replace")
        if (self.state / "redis.pid").exists():
            self.pid = int((self.state / "redis.pid").read_text())
        if rc != 0:
            self.stop()
            raise RuntimeError(f"start_redis.sh failed: {out}")
        self.pid = int((self.state / "redis.pid").read_text())
        self.port = int((self.state / "redis.port").read_text())
        self.version = out.split("v=", 1)[1].split()[0] if "v=" in out else ""
        if self.pin:
            subprocess.run(["taskset", "-a", "-p", "-c", "0", str(self.pid)], check=True,
                           capture_output=True, timeout=10)

    def stop(self) -> None:
        if not self.pid:
            return
        env = {**os.environ, "STATE_DIR": str(self.state)}
        subprocess.run([str(REDIS_ANCHOR / "stop_redis.sh")], env=env, capture_output=True,
                       timeout=60, check=False)
        self.pid = 0


# interference: CPU used by processes other than ours during a phase
def _busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2]) / T.CLK_TCK  # user + nice + system


class Foreign:
    """CPU used by other processes: all busy CPU minus this process, its live
    descendants (master, worker), its reaped children (the worker once it has
    exited) and the extra pids (redis-server, not our descendant); each pid once."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def _ours(self) -> float:
        seen: set[int] = set()
        for p in [os.getpid(), *self.pids]:
            if p:
                seen.update(T.proc_tree(p))
        live = 0.0
        for p in seen:
            try:
                live += T._ticks_one(p)
            except OSError:
                continue
        t = os.times()
        return live + t.children_user + t.children_system

    def __enter__(self) -> Foreign:  # noqa: PYI034
        self.b0, self.o0, self.t0 = _busy_s(), self._ours(), pc()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = pc() - self.t0
        other = (_busy_s() - self.b0) - (self._ours() - self.o0)
        self.share = max(0.0, other) / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0


def _run_worker(cmd: list[str], out: Path, pin: bool, timeout: float) -> dict[str, Any]:
    if out.exists():
        out.unlink()
    proc = subprocess.run(_pin_prefix(pin) + cmd, timeout=timeout, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed ({proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def _phases(quick: bool) -> list[tuple[str, str, int]]:
    """(phase, layout, with_list)."""
    return [("ops", "", 0), ("mem", "disjoint", 1), ("mem", "overlap", 0)]


def run_system(system: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"foreign_cpu_share": 0.0}
    me = str(HERE / "session_bench.py")
    timeout = 900 if args.quick else 3600
    redis_srv = None
    if system == "redis":
        redis_srv = RedisServer(args.pin, work)
        redis_srv.start()
        res["server_version"] = redis_srv.version
    try:
        for phase, lay, with_list in _phases(args.quick):
            out = work / f"{system}-{phase}-{lay}.json"
            common = ["--worker", system, "--phase", phase, "--out", str(out),
                      *(["--quick"] if args.quick else []),
                      *(["--layout", lay, "--with-list", str(with_list)] if lay else [])]
            if system == "kvmaster":
                srv = KvServer(args.pin, work)
                srv.start()
                try:
                    cmd = [sys.executable, me, *common, "--addr", srv.addr,
                           "--server-pid", str(srv.pid)]
                    with Foreign([]) as fg:
                        part = _run_worker(cmd, out, args.pin, timeout)
                finally:
                    srv.stop()
            else:
                assert redis_srv is not None
                cmd = [str(REDIS_PYTHON), me, *common, "--port", str(redis_srv.port),
                       "--server-pid", str(redis_srv.pid)]
                with Foreign([redis_srv.pid]) as fg:
                    part = _run_worker(cmd, out, args.pin, timeout)
            res.update(part)
            res["foreign_cpu_share"] = max(res["foreign_cpu_share"], fg.share)
            print(f"    {system} {phase} {lay} done (other processes used "
                  f"{100 * fg.share:.0f} % of the CPUs)", file=sys.stderr, flush=True)
    finally:
        if redis_srv is not None:
            redis_srv.stop()
    return res


# metric rows: (row id, label, kvmaster path, redis path(s), unit)
ROWS = [
    ("attach", "attach 1024 keys", "attach", ["attach"], "memberships/s"),
    ("pin", "pin (100k-member session)", "pin", ["pin"], "members/s"),
    ("unpin", "unpin (100k-member session)", "unpin", ["unpin"], "members/s"),
    ("update", "update keep half of 100k", "update", ["update_known", "update_fetch"],
     "removed/s"),
    ("close", "close 100k-member session", "close", ["close_known", "close_fetch"],
     "memberships/s"),
    ("list", "list 1M members, pages of 4096", "list", ["list"], "members/s"),
    ("get", "reference: get_kv_session (one request, no walk)", "get", ["get"], "members/s"),
]


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over runs of every numeric leaf (dicts one level deep)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        vals = [r.get(key) for r in runs]
        if isinstance(vals[0], dict):
            out[key] = T.median_of_runs(vals)
            for f in vals[0]:
                nums = [v.get(f) for v in vals]
                if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in nums):
                    out[key][f + "_min"] = min(nums)
                    out[key][f + "_max"] = max(nums)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = {"med": T.median(vals), "max": max(vals)}
        else:
            out[key] = vals[0]
    return out


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "-"
    if x >= 100_000:
        return f"{x:,.0f}"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _rate_cell(m: dict[str, Any], nruns: int, div: float = 1.0) -> str:
    cell = _fmt(m["rate"] / div)
    if nruns > 1:
        cell += f" [{_fmt(m['rate_min'] / div)}–{_fmt(m['rate_max'] / div)}]"
    return cell


def tables(agg: dict[str, Any], nruns: int, size: dict[str, Any]) -> str:
    kv, rd = agg["kvmaster"], agg["redis"]
    lines = []
    big = f"{size['big']:,}"
    lines.append(f"Sizes: attach {size['attach_sessions']} sessions x {size['attach_keys']} keys; "
                 f"pin/update/close on {big}-member sessions; list {size['list_members']:,} "
                 f"members.  Cells: median of {nruns} run(s) [min–max].")
    lines.append("")
    lines.append("| operation | kvmaster rate | kvmaster p50 | Redis variant | Redis rate | "
                 "Redis p50 | kvmaster/Redis | best/best | unit |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for rid, label, kpath, rpaths, unit in ROWS:
        if rid == "list":
            label = f"list {size['list_members']:,} members, pages of {BATCH}"
        else:
            label = label.replace("100k", f"{size['big'] // 1000}k")
        k = kv.get(kpath)
        for j, rp in enumerate(rpaths):
            r = rd.get(rp)
            if k is None or r is None:
                continue
            variant = {"update_known": "client knows members",
                       "update_fetch": "server-authoritative (SMEMBERS first)",
                       "close_known": "client knows members",
                       "close_fetch": "server-authoritative (SMEMBERS first)",
                       "attach": "pipeline SADD + per-key SADD",
                       "pin": "SET s:pin", "unpin": "DEL s:pin",
                       "list": f"SSCAN COUNT {BATCH}", "get": "SCARD s:m"}[rp]
            ratio = k["rate"] / r["rate"]
            best = k.get("rate_max", k["rate"]) / r.get("rate_max", r["rate"])
            # O(1) operations: show calls/s (members/s = calls/s x session size)
            div = size["big"] if rid in ("pin", "unpin", "get") else 1.0
            if div != 1.0:
                unit = f"calls/s (x {size['big']:,} = members/s)"
            lines.append(
                f"| {label if j == 0 else '″'} | {_rate_cell(k, nruns, div)} | "
                f"{_fmt(k['p50_ms'])} ms | {variant} | {_rate_cell(r, nruns, div)} | "
                f"{_fmt(r['p50_ms'])} ms | **{ratio:.2f}** | {best:.2f} | {unit} |")
    lines.append("")
    lines.append("CPU per key (median over runs): server = master process tree / redis-server, "
                 "client = the worker process; CPU ratio = Redis (server + client) / kvmaster "
                 "(server + client), > 1 means kvmaster spends less CPU per key.")
    lines.append("")
    lines.append("| operation | kvmaster server µs/key | kvmaster client µs/key | Redis variant | "
                 "Redis server µs/key | Redis client µs/key | server CPU ratio | CPU ratio |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for rid, label, kpath, rpaths, unit in ROWS:
        k = kv.get(kpath)
        for j, rp in enumerate(rpaths):
            r = rd.get(rp)
            if k is None or r is None:
                continue
            ks, kc = k["server_cpu_us_per_unit"], k["client_cpu_us_per_unit"]
            rs_, rc = r["server_cpu_us_per_unit"], r["client_cpu_us_per_unit"]
            per = 1.0
            if rid in ("pin", "unpin", "get"):  # per call, not per member
                per = size["big"]
            u = "µs/call" if per != 1.0 else ""
            lines.append(f"| {rid if j == 0 else '″'} | {ks * per:.3f}{u and ' ' + u} | "
                         f"{kc * per:.3f} | {rp} | {rs_ * per:.3f} | {rc * per:.3f} | "
                         f"{rs_ / ks:.2f} | {(rs_ + rc) / (ks + kc):.2f} |")
    lines.append("")
    lines.append("| memory layout | memberships | kvmaster B/membership (RSS delta) | "
                 "kvmaster B/object (objects alone) | Redis B/membership (used_memory delta, "
                 "forward + reverse sets) | kvmaster/Redis | goal ≤ 120 B |")
    lines.append("|---|---|---|---|---|---|---|")
    for kind in ("disjoint", "overlap"):
        k, r = kv.get("mem_" + kind), rd.get("mem_" + kind)
        if k is None or r is None:
            continue
        nsess, nmem = int(k["sessions"]), int(k["memberships"])
        what = (f"{nsess:,} sessions x {nmem // nsess:,} keys, "
                + ("each key in 1 session" if kind == "disjoint"
                   else "50 % neighbour overlap, most keys in 2 sessions"))
        bpm = k["bytes_per_membership"]
        rng = (f" [{k['bytes_per_membership_min']:.0f}–{k['bytes_per_membership_max']:.0f}]"
               if nruns > 1 else "")
        lines.append(f"| {kind}: {what} | {nmem:,} | {bpm:.0f}{rng} | "
                     f"{k['bytes_per_object']:.0f} | {r['bytes_per_membership']:.0f} | "
                     f"{bpm / r['bytes_per_membership']:.2f} | "
                     f"{'met' if bpm <= 120 else 'NOT met'} |")
    lines.append("")
    lines.append("Goal (kvmaster at least as fast per key as Redis, against the faster Redis "
                 "variant):")
    for rid, label, kpath, rpaths, unit in ROWS:
        k = kv.get(kpath)
        rs = [rd[p]["rate"] for p in rpaths if p in rd]
        if k is None or not rs or rid == "get":
            continue
        best = max(rs)
        lines.append(f"- {rid}: {k['rate'] / best:.2f}x  "
                     f"({'met' if k['rate'] >= best else 'NOT met'} on the median run)")
    return "\n".join(lines)


def wait_quiet(load: float, max_wait: float) -> tuple[bool, float]:
    """Poll the 1-minute load average (bounded); True if it went below ``load``."""
    stop = time.monotonic() + max_wait
    while True:
        la = os.getloadavg()[0]
        if la < load:
            return True, la
        if time.monotonic() >= stop:
            return False, la
        time.sleep(min(15.0, max(0.0, stop - time.monotonic())) or 0.1)


def render(data: dict[str, Any]) -> str:
    meta, agg, per_run = data["meta"], data["median"], data["runs"]
    text = tables(agg, int(meta["runs"]), meta["sizes"])
    fg = max(r["foreign_cpu_share"] for v in per_run.values() for r in v)
    text += (f"\n\nLargest share of all CPUs used by other processes during a phase: "
             f"{100 * fg:.0f} %.  Load average at start {meta['loadavg_start'][0]:.2f}, "
             f"at end {meta['loadavg_end'][0]:.2f}.")
    return text


def driver_main(args: argparse.Namespace) -> int:
    if args.profile:
        return profile_main(args)
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())))
        return 0
    if not REDIS_PYTHON.exists():
        print(f"{REDIS_PYTHON} missing: run {REDIS_ANCHOR}/install.sh", file=sys.stderr)
        return 2
    size = QUICK if args.quick else FULL
    meta: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick, "runs": args.runs,
        "pin": args.pin, "python": platform.python_version(), "nproc": os.cpu_count(),
        "sizes": {k: v for k, v in size.items()},
    }
    if args.wait_load > 0:
        quiet, la = wait_quiet(args.wait_load, args.wait_max)
        meta["waited_for_quiet"] = {"reached": quiet, "load1": la, "threshold": args.wait_load}
        print(f"load average {la:.2f} ({'quiet' if quiet else 'never below'} "
              f"{args.wait_load})", file=sys.stderr)
    meta["loadavg_start"] = os.getloadavg()
    from kvmaster.tools.bench.store_bench import tree_commit

    tree = tree_commit()
    if tree is not None:
        meta["commit"], meta["kvmaster_dirty"] = tree
    per_run: dict[str, list[dict[str, Any]]] = {"kvmaster": [], "redis": []}
    with tempfile.TemporaryDirectory(prefix="sessbench-") as tmp:
        work = Path(tmp)
        for run in range(args.runs):
            order = ("kvmaster", "redis") if run % 2 == 0 else ("redis", "kvmaster")
            for system in order:
                print(f"run {run + 1}/{args.runs}: {system}", file=sys.stderr, flush=True)
                t0 = pc()
                res = run_system(system, args, work)
                res["wall_s"] = pc() - t0
                res["loadavg_after"] = os.getloadavg()[0]
                per_run[system].append(res)
    meta["loadavg_end"] = os.getloadavg()
    agg = {s: _aggregate(v) for s, v in per_run.items()}
    data = {"meta": meta, "median": agg, "runs": per_run}
    text = render(data)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


# ---------------------------------------------------------------- profiling

def serve_master(args: argparse.Namespace) -> int:
    """A kvmaster master whose event loop thread is profiled between SIGUSR1 and SIGUSR2."""
    import cProfile

    # CPU time of the event loop thread (where every in-process shard runs): time
    # the thread spends preempted by other processes is not charged to a function.
    prof = cProfile.Profile(time.thread_time) if args.prof_clock == "cpu" else cProfile.Profile()
    ack = Path(args.prof_ack)

    def on(*_: object) -> None:
        prof.enable()
        ack.write_text("on")

    def off(*_: object) -> None:
        prof.disable()
        prof.dump_stats(args.prof_out)
        ack.write_text("off")

    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGUSR2, off)
    from kvmaster.cli import main as cli_main

    return cli_main(args.rest)


def spy_report(path: Path, top: int) -> str:
    """Self and inclusive sample shares per function from py-spy's raw (collapsed) output."""
    from collections import Counter

    def func(frame: str) -> tuple[str, str]:
        # "name (path/file.py:line)" -> ("name (file.py)", "name (file.py:line)")
        name, _, where = frame.partition(" (")
        where = where.rstrip(")").rsplit("/", 1)[-1]
        return f"{name} ({where.rsplit(':', 1)[0]})", f"{name} ({where})"

    self_f: Counter[str] = Counter()
    self_l: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    text = "\n".join(p.read_text(errors="replace")
                     for p in sorted(path.parent.glob(path.name + ".*")))
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [func(f) for f in stack.split(";")]
        self_f[frames[-1][0]] += n
        self_l[frames[-1][1]] += n
        for f in {f for f, _ in frames}:
            incl[f] += n
    if not total:
        return "py-spy recorded no samples"
    out = [f"{total} samples of the master's Python threads (idle samples excluded)"]
    for title, ctr in (("self, by function", self_f), ("self, by line", self_l),
                       ("inclusive, by function", incl)):
        out += ["", f"{'%':>6}   {title}"]
        out += [f"{100 * n / total:6.1f}   {f}" for f, n in ctr.most_common(top)]
    return "\n".join(out)


def profile_main(args: argparse.Namespace) -> int:
    import io
    import pstats

    op = args.profile
    spy = args.py_spy
    with tempfile.TemporaryDirectory(prefix="sessprof-") as tmp:
        work = Path(tmp)
        pout = str(args.profile_out or work / (f"{op}.prof" if not spy else f"{op}.pyspy.txt"))
        ack = str(work / "ack")
        srv = KvServer(False, work, "" if spy else pout, ack)
        srv.prof_clock = args.profile_clock
        srv.start()
        try:
            me = str(HERE / "session_bench.py")
            out = work / "prof.json"
            phase = ["--phase", "mem", "--layout", "disjoint", "--with-list", "1"] \
                if op == "list" else ["--phase", "ops"]
            cmd = [sys.executable, me, "--worker", "kvmaster", *phase, "--only", op,
                   "--out", str(out), "--addr", srv.addr, "--server-pid", str(srv.pid),
                   *(["--py-spy", spy, "--py-spy-out", pout] if spy else
                     ["--profile-ack", ack]),
                   *(["--quick"] if args.quick else [])]
            res = _run_worker(cmd, out, False, 3600)
        finally:
            srv.stop()
        r = res.get(op, {})
        how = "py-spy (sampling)" if spy else f"cProfile ({args.profile_clock} clock)"
        print(f"{op} under {how}: {r.get('calls')} calls, "
              f"rate {_fmt(r.get('rate', 0))} keys/s (profiling overhead included), "
              f"p50 {_fmt(r.get('p50_ms', 0))} ms")
        if spy:
            print(spy_report(Path(pout), args.profile_top))
            return 0
        st = pstats.Stats(pout)
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            st.stream = buf  # type: ignore[attr-defined]
            st.sort_stats(order).print_stats(args.profile_top)
            text = buf.getvalue()
            print(f"\n--- sorted by {order} ---")
            print(text[text.find("   ncalls"):].rstrip() if "   ncalls" in text else text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--serve-master":
        ap = argparse.ArgumentParser()
        ap.add_argument("--serve-master", action="store_true")
        ap.add_argument("--prof-out", required=True)
        ap.add_argument("--prof-ack", required=True)
        ap.add_argument("--prof-clock", default="cpu")
        cut = argv.index("--")
        a = ap.parse_args(argv[:cut])
        a.rest = argv[cut + 1:]
        return serve_master(a)
    ap = argparse.ArgumentParser(prog="python -m kvmaster.tools.bench.session_bench",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test, seconds)")
    ap.add_argument("--runs", type=int, default=3, help="runs per system; median reported")
    ap.add_argument("--json", help="write per-run and median results here")
    ap.add_argument("--md", help="write the markdown tables here")
    ap.add_argument("--from-json", help="only print the tables of an earlier --json file")
    ap.add_argument("--pin", action="store_true",
                    help="servers and workers on CPU 0 (taskset), like the anchor's pinned run")
    ap.add_argument("--wait-load", type=float, default=0.0,
                    help="before starting, wait until the 1-min load average is below this")
    ap.add_argument("--wait-max", type=float, default=1200.0,
                    help="longest wait for --wait-load, seconds (then run anyway)")
    ap.add_argument("--profile", choices=("attach", "pin", "update", "close", "list"),
                    help="profile kvmaster's master (cProfile) during this operation only")
    ap.add_argument("--profile-out", help="keep the .prof file here")
    ap.add_argument("--profile-top", type=int, default=25)
    ap.add_argument("--py-spy", default="",
                    help="path of a py-spy binary: sample the master with it instead of cProfile")
    ap.add_argument("--py-spy-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--profile-clock", choices=("cpu", "wall"), default="cpu",
                    help="cProfile timer: CPU time of the master's event loop thread "
                         "(default; preemption by other processes is not counted) or wall")
    # worker mode (internal)
    ap.add_argument("--worker", choices=("kvmaster", "redis"), help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=("ops", "mem"), help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="disjoint", help=argparse.SUPPRESS)
    ap.add_argument("--with-list", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--only", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--profile-ack", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.runs < 1 or args.runs > 50:
        ap.error("--runs must be in 1..50")
    if args.worker:
        return worker_main(args)
    return driver_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
