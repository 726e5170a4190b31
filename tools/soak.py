"""Bounded soak test of a kvmaster master: N client processes, mixed load, for a while.

Every client process loops at full speed over a random mix of puts, gets, existence
checks, removes, upserts and session calls (attach, tagged writes, pin, unpin,
update, close, get, list) on one shared key space.  Every payload starts with an
8-byte BLAKE2b digest of (key, rest of payload), checked on every read, so a read
that returns another key's bytes, a torn write or reused memory shows as a
corrupted read.  With the embedded master (the default) the clients' segments are
small, so the store runs full and evicts all the time.

The parent samples the master's RSS (psutil, children included) and its counters
every ``--rss-interval`` seconds, and collects per-operation latency histograms
per ``--window`` seconds from the clients.  At the end it runs the master's
consistency check, prints a table (p99 per window, RSS) and writes ``--json``.

Exit status: 0 when there was no corrupted read, no unexpected error, the
consistency check came back empty, every client process finished cleanly and
(with ``--max-rss-growth-mb``) the master's RSS grew less than that after the
warm-up; 1 otherwise; 2 for bad arguments.

Examples::

    python tools/soak.py --clients 8 --duration 600 --json soak.json
    python tools/soak.py --master 127.0.0.1:50051 --master-pid 1234 --duration 60

With ``--replicas 2`` a write asks for one or two replicas (at random), and with
``--rejoin-every N`` each client leaves (BYE: its segment goes, with the objects
and the writes in progress placed in it) and sets up again with a fresh segment
every N operations, so writes of the other clients are dropped mid-copy and reads
race with segments going.

Expected outcomes (not errors): a get or read of a key that is not stored
(evicted, removed, never written, or gone with its segment); a remove refused
because the object has a lease or is being written; a session call on a session
that no longer exists (its last member was evicted); an attach of a key that is
gone; a put refused with NO_AVAILABLE_HANDLE when nothing evictable is left
(reported separately); with ``--rejoin-every``, a write answered
SEGMENT_NOT_FOUND (a segment it was placed in went before its end).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

KiB = 1 << 10
MiB = 1 << 20

#: Latency histogram: bucket i holds latencies in [R**i, R**(i+1)) microseconds.
_R = 2 ** (1 / 8)
_LOG_R = math.log(_R)

#: Operation -> weight in the mix.
MIX = {
    "put_batch": 14, "put": 4, "tagged_put_batch": 6, "upsert": 3, "upsert_batch": 3,
    "get": 10, "get_batch": 24, "get_into": 3, "is_exist": 4, "batch_is_exist": 5,
    "remove": 2, "batch_remove": 2,
    "attach": 4, "pin": 2, "unpin": 2, "update": 1, "close_session": 1, "get_session": 2,
    "list_session": 1,
}

#: Status codes that are expected outcomes, per kind (see the module docstring).
MISS = -704            # OBJECT_NOT_FOUND
HAS_LEASE = -706       # OBJECT_HAS_LEASE
NOT_READY = -703       # REPLICA_IS_NOT_READY
NO_HANDLE = -200       # NO_AVAILABLE_HANDLE
#: Batch ops whose NO_AVAILABLE_HANDLE is a refusal for want of space, not an error.
WRITE_KINDS = ("put_batch", "upsert_batch", "tagged_put_batch")
SESSION_GONE = -1800   # SESSION_NOT_FOUND
SEG_GONE = -101        # SEGMENT_NOT_FOUND


def checksum(key: bytes, body: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(key, digest_size=8)
    h.update(body)
    return h.digest()


def make_value(key: bytes, pool: bytes, size: int, rng: random.Random) -> bytes:
    """``digest(key, body) + body``; the body is a random slice of ``pool``."""
    n = size - 8
    off = rng.randrange(0, len(pool) - n)
    body = pool[off:off + n]
    return checksum(key, body) + body


def verify(key: bytes, data: bytes | memoryview | None) -> bool:
    if data is None or len(data) <= 8:
        return False
    mv = memoryview(data)
    return checksum(key, mv[8:]) == bytes(mv[:8])


# ------------------------------------------------------------------- workers


class Window:
    """What one worker saw in one time window."""

    def __init__(self) -> None:
        self.hist: dict[str, dict[int, int]] = {}
        self.ops: dict[str, int] = {}
        self.expected: dict[str, int] = {}
        self.refused = 0
        self.unexpected: list[str] = []
        self.unexpected_count = 0
        self.corrupt: list[str] = []
        self.corrupt_count = 0
        self.reads_checked = 0

    def lat(self, op: str, seconds: float) -> None:
        us = max(seconds * 1e6, 1.0)
        b = int(math.log(us) / _LOG_R)
        h = self.hist.setdefault(op, {})
        h[b] = h.get(b, 0) + 1
        self.ops[op] = self.ops.get(op, 0) + 1

    def exp(self, kind: str, n: int = 1) -> None:
        if n:
            self.expected[kind] = self.expected.get(kind, 0) + n

    def bad(self, what: str) -> None:
        self.unexpected_count += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(what[:300])

    def corrupted(self, what: str) -> None:
        self.corrupt_count += 1
        if len(self.corrupt) < 20:
            self.corrupt.append(what[:300])

    def to_dict(self) -> dict[str, Any]:
        return {"hist": self.hist, "ops": self.ops, "expected": self.expected,
                "refused": self.refused, "unexpected": self.unexpected,
                "unexpected_count": self.unexpected_count, "corrupt": self.corrupt,
                "corrupt_count": self.corrupt_count, "reads_checked": self.reads_checked}


def worker_main(wid: int, args: dict[str, Any], start: Any, t0_box: Any, leave: Any,
                out: Any) -> None:
    """One client process: set up, report ready, wait for the common start, run the
    mixed loop until ``t0 + duration``, then wait until every client has stopped
    before leaving (a client that leaves takes its segment, and with it the writes
    other clients still have in flight there)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    from kvmaster import Client, ClientConfig, KVMasterError, ReplicateConfig, RequestError
    from kvmaster import errors as E

    rng = random.Random(args["seed"] * 1000 + wid)
    pool = os.urandom(max(args["value_max"] * 2, 1 << 20))
    keys = [f"soak-{i}".encode() for i in range(args["keys"])]
    skeys = [k.decode() for k in keys]
    sessions = [f"sess-{j}" for j in range(args["sessions"])]
    sizes = args["value_sizes"]
    ops = [o for o, wt in args["mix"].items() if wt > 0]
    weights = [args["mix"][o] for o in ops]
    def join() -> Any:
        c = Client(ClientConfig(timeout_s=args["timeout"]))
        c.setup(args["master"], args["segment_mb"] * MiB)
        return c

    c = join()
    rejoin_every = args["rejoin_every"]
    # A write whose segment may go before its end (another client leaving).
    seg_gone = (SEG_GONE,) if rejoin_every else ()
    out.put(("ready", wid, 0))
    if not start.wait(300):
        c.close()
        return
    t0 = t0_box.value
    time.sleep(max(0.0, t0 - time.monotonic()))
    window_s = args["window"]
    deadline = t0 + args["duration"]
    cur = 0
    w = Window()

    def flush(idx: int) -> None:
        out.put(("window", wid, idx, w.to_dict()))

    def pick(n: int) -> list[int]:
        # Hot/cold: half the picks from the first tenth of the key space.
        hot = max(1, len(keys) // 10)
        return [rng.randrange(hot) if rng.random() < 0.5 else rng.randrange(len(keys))
                for _ in range(n)]

    def check_reads(idx: list[int], vals: list[Any]) -> None:
        for i, v in zip(idx, vals):
            if v is None:
                w.exp("miss")
                continue
            w.reads_checked += 1
            if not verify(keys[i], v):
                w.corrupted(f"{skeys[i]}: {len(v)} bytes, digest mismatch")

    def statuses(kind: str, codes: list[int], ok: tuple[int, ...] = (0,),
                 expected: tuple[int, ...] = ()) -> None:
        for code in codes:
            if code in ok:
                continue
            if code == NO_HANDLE and kind in WRITE_KINDS:
                w.refused += 1
            elif code in expected:
                w.exp(f"{kind}:{code}")
            else:
                w.bad(f"{kind}: per-key status {code}")

    n_iter = 0
    while True:
        now = time.monotonic()
        if now >= deadline or n_iter >= args["max_ops"]:
            break
        n_iter += 1
        idx_w = int((now - t0) // window_s)
        if idx_w != cur:
            flush(cur)
            cur, w = idx_w, Window()
        if rejoin_every and n_iter % rejoin_every == 0:
            op, t_op = "rejoin", time.monotonic()
            try:
                c.close()
                c = join()
            except Exception as exc:  # noqa: BLE001
                w.bad(f"rejoin: {exc!r}")
            w.lat(op, time.monotonic() - t_op)
            continue
        op = rng.choices(ops, weights)[0]
        t_op = time.monotonic()
        replicas = rng.randint(1, args["replicas"])
        try:
            if op in ("put_batch", "upsert_batch", "tagged_put_batch"):
                idx = list(dict.fromkeys(pick(rng.randint(1, args["batch"]))))
                vals = [make_value(keys[i], pool, rng.choice(sizes), rng) for i in idx]
                tags = None
                if op == "tagged_put_batch":
                    tags = [[rng.choice(sessions)] for _ in idx]
                cfg = ReplicateConfig(replica_num=replicas, kv_sessions=tags)
                fn = c.upsert_batch if op == "upsert_batch" else c.put_batch
                res = fn([skeys[i] for i in idx], vals, cfg)
                statuses(op, res, expected=seg_gone)
            elif op in ("put", "upsert"):
                (i,) = pick(1)
                v = make_value(keys[i], pool, rng.choice(sizes), rng)
                try:
                    (c.put if op == "put" else c.upsert)(skeys[i], v,
                                                         ReplicateConfig(replica_num=replicas))
                except E.NoAvailableHandle:
                    w.refused += 1
                except E.SegmentNotFound as exc:
                    if not rejoin_every:
                        raise
                    w.exp(f"{op}:{exc.code}")
            elif op == "get":
                (i,) = pick(1)
                try:
                    check_reads([i], [c.get(skeys[i])])
                except E.ObjectNotFound:
                    w.exp("miss")
            elif op == "get_into":
                (i,) = pick(1)
                buf = bytearray(args["value_max"])
                try:
                    n = c.get_into(skeys[i], buf)
                    check_reads([i], [memoryview(buf)[:n]])
                except E.ObjectNotFound:
                    w.exp("miss")
            elif op == "get_batch":
                idx = pick(rng.randint(1, args["batch"] * 2))
                check_reads(idx, c.get_batch([skeys[i] for i in idx]))
            elif op == "is_exist":
                (i,) = pick(1)
                c.is_exist(skeys[i])
            elif op == "batch_is_exist":
                idx = pick(rng.randint(1, args["batch"] * 2))
                statuses(op, c.batch_is_exist([skeys[i] for i in idx]), ok=(0, 1))
            elif op == "remove":
                (i,) = pick(1)
                try:
                    c.remove(skeys[i])
                except (E.ObjectNotFound, E.ObjectHasLease) as exc:
                    w.exp(f"remove:{exc.code}")
                except RequestError as exc:
                    if exc.code != NOT_READY:
                        raise
                    w.exp(f"remove:{exc.code}")
            elif op == "batch_remove":
                idx = list(dict.fromkeys(pick(rng.randint(1, args["batch"]))))
                statuses(op, c.batch_remove([skeys[i] for i in idx]),
                         expected=(MISS, HAS_LEASE, NOT_READY))
            elif op == "attach":
                idx = list(dict.fromkeys(pick(rng.randint(1, args["batch"]))))
                res = c.attach_kv_session(rng.choice(sessions), [skeys[i] for i in idx])
                statuses(op, res, ok=(0, 1), expected=(MISS,))
            elif op in ("pin", "unpin"):
                try:
                    (c.pin_kv_session if op == "pin" else c.unpin_kv_session)(
                        rng.choice(sessions))
                except E.SessionNotFound:
                    w.exp(f"{op}:session_gone")
            elif op == "update":
                keep = [skeys[i] for i in pick(rng.randint(8, 64))]
                c.update_kv_session(rng.choice(sessions), keep)
            elif op == "close_session":
                c.close_kv_session(rng.choice(sessions))
            elif op == "get_session":
                try:
                    c.get_kv_session(rng.choice(sessions))
                except E.SessionNotFound:
                    w.exp("get_session:session_gone")
            elif op == "list_session":
                try:
                    page = c.list_kv_session_keys(rng.choice(sessions), "", 64)
                    if any(not k.startswith("soak-") for k in page.keys):
                        w.bad(f"list_session returned foreign keys {page.keys[:3]}")
                except E.SessionNotFound:
                    w.exp("list_session:session_gone")
        except KVMasterError as exc:
            w.bad(f"{op}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a client bug is an unexpected error too
            w.bad(f"{op}: {type(exc).__name__}: {exc}")
        w.lat(op, time.monotonic() - t_op)
    flush(cur)
    out.put(("finished", wid, n_iter))
    leave.wait(300)
    try:
        c.close()
    except Exception as exc:  # noqa: BLE001
        w = Window()
        w.bad(f"close: {exc!r}")
        flush(cur)
    out.put(("done", wid, n_iter))


# ----------------------------------------------------------------- the parent


def percentile(hist: dict[int, int], q: float) -> float:
    """q-quantile in milliseconds (upper edge of the bucket holding it)."""
    total = sum(hist.values())
    if not total:
        return float("nan")
    rank = q * total
    seen = 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= rank:
            return _R ** (b + 1) / 1000.0
    return _R ** (max(hist) + 1) / 1000.0


def add_window(windows: dict[int, dict[str, Any]], idx: int, wd: dict[str, Any]) -> None:
    """Merge one worker's window into the aggregate of that window."""
    agg = windows.setdefault(idx, {"hist": {}, "ops": {}, "expected": {}, "refused": 0,
                                   "unexpected": [], "unexpected_count": 0, "corrupt": [],
                                   "corrupt_count": 0, "reads_checked": 0})
    for op, h in wd["hist"].items():
        merge_hist(agg["hist"].setdefault(op, {}), h)
    for k in ("ops", "expected"):
        for name, n in wd[k].items():
            agg[k][name] = agg[k].get(name, 0) + n
    for k in ("refused", "unexpected_count", "corrupt_count", "reads_checked"):
        agg[k] += wd[k]
    agg["unexpected"] += wd["unexpected"][:20 - len(agg["unexpected"])]
    agg["corrupt"] += wd["corrupt"][:20 - len(agg["corrupt"])]


def sample(watcher: Any, pid: int | None, t: float) -> dict[str, Any]:
    """One row: master RSS and counters."""
    row: dict[str, Any] = {"t": round(t, 2), "rss": tree_rss(pid) if pid else None}
    try:
        s = watcher.stats()
        row.update(keys=s.get("keys"), allocated=s.get("allocated_bytes"),
                   capacity=s.get("capacity_bytes"), evicted=s.get("evicted_keys"),
                   sessions=s.get("sessions"), memberships=s.get("memberships"),
                   pending=s.get("pending_writes"),
                   busy=s.get("front", {}).get("rejected_busy"))
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        row["stats_error"] = repr(exc)
    return row


def merge_hist(into: dict[int, int], h: dict[Any, int]) -> None:
    for b, n in h.items():
        into[int(b)] = into.get(int(b), 0) + n


def tree_rss(pid: int) -> int | None:
    """RSS of a process and its children (shard processes), in bytes."""
    import psutil

    try:
        p = psutil.Process(pid)
        total = p.memory_info().rss
        for ch in p.children(recursive=True):
            try:
                total += ch.memory_info().rss
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return None


def listening_pid(addr: str) -> int | None:
    import psutil

    host, _, port = addr.rpartition(":")
    if not port.isdigit():
        return None
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == int(port):
                return conn.pid
    except (psutil.Error, OSError):
        return None
    return None


class Embedded:
    """A ``kvmaster master`` subprocess on a free loopback port."""

    def __init__(self, flags: list[str]) -> None:
        import tempfile

        cmd = [sys.executable, "-m", "kvmaster", "master", "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", "-1", "--log-level", "WARNING", *flags]
        # The log goes to a file: a pipe nobody reads could fill up and stall the master.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "listening on" not in line:
            self.proc.kill()
            self.proc.wait(10)
            self.log.seek(0)
            raise RuntimeError(f"master did not start: {line!r} {self.log.read()[-2000:]}")
        self.addr = line.rsplit(" ", 1)[-1].strip().removeprefix("tcp://")
        self.cmd = cmd

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.seek(0)
        err = self.log.read()
        self.log.close()
        return self.proc.returncode, err


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8, help="client processes (default %(default)s)")
    p.add_argument("--duration", type=float, default=600.0,
                   help="seconds of load (default %(default)g)")
    p.add_argument("--json", metavar="FILE", help="write the full report here")
    p.add_argument("--master", metavar="HOST:PORT",
                   help="use a running master (default: start an embedded one)")
    p.add_argument("--master-pid", type=int, help="pid of --master for RSS (default: the "
                   "process listening on its port, if on this host)")
    p.add_argument("--shards", type=int, default=4,
                   help="embedded master's shards (default %(default)s)")
    p.add_argument("--shard-processes", action="store_true",
                   help="embedded master runs its shards in processes")
    p.add_argument("--lease-ms", type=int, default=2000,
                   help="embedded master's --default-kv-lease-ttl (default %(default)s)")
    p.add_argument("--master-flag", action="append", default=[], metavar="FLAG",
                   help="extra flag for the embedded master (repeatable, e.g. "
                        "--master-flag=--eviction-ratio=0.1)")
    p.add_argument("--segment-mb", type=int, default=8,
                   help="segment each client contributes, MiB (default %(default)s: the store runs "
                        "full)")
    p.add_argument("--keys", type=int, default=20000, help="shared key space (default %(default)s)")
    p.add_argument("--sessions", type=int, default=64,
                   help="session ids in use (default %(default)s)")
    p.add_argument("--value-sizes", default="1024,4096,16384,65536",
                   help="payload sizes in bytes, comma-separated (checksum included; "
                        "default %(default)s)")
    p.add_argument("--batch", type=int, default=8,
                   help="largest write batch (reads: twice; default %(default)s)")
    p.add_argument("--replicas", type=int, default=1,
                   help="most replicas a write asks for; each write picks 1..N "
                        "(default %(default)s)")
    p.add_argument("--rejoin-every", type=int, default=0, metavar="N",
                   help="each client leaves and sets up again every N operations; its "
                        "objects leave with it, so most reads then miss (default "
                        "%(default)s: never)")
    p.add_argument("--mix", default="",
                   help="override operation weights, e.g. 'get_batch=50,attach=0' "
                        f"(operations: {', '.join(MIX)})")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="client call timeout, s (default %(default)g)")
    p.add_argument("--window", type=float, default=10.0,
                   help="latency window, s (default %(default)g)")
    p.add_argument("--rss-interval", type=float, default=2.0,
                   help="RSS sampling period, s (default %(default)g)")
    p.add_argument("--warmup", type=float,
                   help="seconds before RSS growth is measured (default: a quarter of "
                        "the duration, at most 60)")
    p.add_argument("--max-rss-growth-mb", type=float,
                   help="fail when the master's RSS grows more than this after the warm-up")
    p.add_argument("--max-ops", type=int, default=10**9, help="cap on operations per client")
    p.add_argument("--seed", type=int, default=1, help="random seed (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    try:
        a.value_sizes = sorted({int(x) for x in a.value_sizes.split(",") if x.strip()})
    except ValueError:
        p.error("--value-sizes: comma-separated integers")
    if not a.value_sizes or a.value_sizes[0] <= 8:
        p.error("--value-sizes: every size must be > 8 (the checksum takes 8 bytes)")
    if a.clients < 1 or a.duration <= 0 or a.keys < 1 or a.sessions < 1 or a.batch < 1 \
            or a.replicas < 1:
        p.error("--clients, --duration, --keys, --sessions, --batch and --replicas must be "
                "positive")
    if a.rejoin_every < 0:
        p.error("--rejoin-every must be 0 (never) or positive")
    if a.window <= 0 or a.rss_interval <= 0:
        p.error("--window and --rss-interval must be positive")
    mix = dict(MIX)
    for item in filter(None, (x.strip() for x in a.mix.split(","))):
        name, _, weight = item.partition("=")
        if name not in MIX or not weight.strip().isdigit():
            p.error(f"--mix: bad item {item!r}")
        mix[name] = int(weight)
    if not any(mix.values()):
        p.error("--mix: every weight is zero")
    a.mix = mix
    if a.warmup is None:
        a.warmup = min(60.0, a.duration / 4)
    return a


def rss_summary(samples: list[dict[str, Any]], warmup: float) -> dict[str, Any]:
    pts = [(s["t"], s["rss"]) for s in samples if s.get("rss")]
    if not pts:
        return {}
    after = [(t, r) for t, r in pts if t >= warmup] or pts[-1:]
    k = max(1, len(after) // 10)
    start = statistics.median(r for _, r in after[:k])
    end = statistics.median(r for _, r in after[-k:])
    slope = 0.0
    if len(after) >= 3:
        ts = [t for t, _ in after]
        rs = [r for _, r in after]
        mt, mr = statistics.fmean(ts), statistics.fmean(rs)
        var = sum((t - mt) ** 2 for t in ts)
        if var > 0:
            slope = sum((t - mt) * (r - mr) for t, r in zip(ts, rs)) / var
    return {"at_start_mb": pts[0][1] / MiB, "after_warmup_mb": start / MiB,
            "at_end_mb": end / MiB, "max_mb": max(r for _, r in pts) / MiB,
            "growth_after_warmup_mb": (end - start) / MiB,
            "slope_after_warmup_mb_per_min": slope * 60 / MiB,
            "samples_after_warmup": len(after)}


def run(a: argparse.Namespace) -> dict[str, Any]:
    from kvmaster import Client

    embedded = None
    if a.master:
        addr = a.master
        pid = a.master_pid or listening_pid(addr)
    else:
        flags = ["--shards", str(a.shards), "--default-kv-lease-ttl", str(a.lease_ms),
                 *a.master_flag]
        if a.shard_processes:
            flags.append("--shard-processes")
        embedded = Embedded(flags)
        addr, pid = embedded.addr, embedded.proc.pid
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    wargs = {"master": addr, "seed": a.seed, "keys": a.keys, "sessions": a.sessions,
             "value_sizes": a.value_sizes, "value_max": max(a.value_sizes), "batch": a.batch,
             "segment_mb": a.segment_mb, "timeout": a.timeout, "window": a.window,
             "duration": a.duration, "max_ops": a.max_ops, "mix": a.mix,
             "replicas": a.replicas, "rejoin_every": a.rejoin_every}
    watcher = Client()
    procs = []
    samples: list[dict[str, Any]] = []
    windows: dict[int, dict[str, Any]] = {}
    done: dict[int, int] = {}
    finished: set[int] = set()
    reported: dict[int, set[int]] = {}
    printed = -1
    report: dict[str, Any] = {}
    try:
        watcher.setup(addr, 0)
        start = ctx.Event()
        leave = ctx.Event()
        t0_box = ctx.Value("d", 0.0)
        for wid in range(a.clients):
            p = ctx.Process(target=worker_main, args=(wid, wargs, start, t0_box, leave, out),
                            daemon=True, name=f"soak-{wid}")
            p.start()
            procs.append(p)
        ready: set[int] = set()
        setup_end = time.monotonic() + 120
        while len(ready) < a.clients and time.monotonic() < setup_end:
            if any(p.exitcode not in (0, None) for p in procs):
                raise RuntimeError("a client process died during setup")
            try:
                msg = out.get(timeout=0.5)
            except queue.Empty:
                continue
            if msg[0] == "ready":
                ready.add(msg[1])
        if len(ready) < a.clients:
            raise RuntimeError(f"only {len(ready)} of {a.clients} clients set up in 120 s")
        # Every worker starts its clock at the same moment.
        t0 = t0_box.value = time.monotonic() + 0.2
        start.set()
        hard_end = t0 + a.duration + max(60.0, a.timeout * 3)
        next_sample = time.monotonic()

        def crashed_now() -> None:
            for wid, p in enumerate(procs):
                if p.exitcode not in (0, None) and wid not in done:
                    done[wid] = -1  # died: counted as failed

        def handle(msg: tuple[Any, ...]) -> None:
            nonlocal printed
            kind = msg[0]
            if kind == "finished":
                finished.add(msg[1])
            elif kind == "done":
                done[msg[1]] = msg[2]
            elif kind == "window":
                add_window(windows, msg[2], msg[3])
                reported.setdefault(msg[2], set()).add(msg[1])
                if not a.quiet:
                    # A window is printed once every client has sent it (or a window late).
                    late = int((time.monotonic() - t0) // a.window) - 2
                    while printed + 1 in windows and (
                            len(reported[printed + 1]) >= a.clients or printed + 1 <= late):
                        printed += 1
                        print(window_line(printed, windows[printed], a, samples),
                              file=sys.stderr, flush=True)

        # Load phase: until every client has stopped (or died, or the hard deadline).
        while len(finished | set(done)) < a.clients and time.monotonic() < hard_end:
            now = time.monotonic()
            if now >= next_sample:
                next_sample = now + a.rss_interval
                samples.append(sample(watcher, pid, now - t0))
            try:
                handle(out.get(timeout=max(0.05, min(0.5, next_sample - time.monotonic()))))
            except queue.Empty:
                crashed_now()
        # The store as the load left it: counters and invariants, before anyone leaves.
        samples.append(sample(watcher, pid, time.monotonic() - t0))
        try:
            final = watcher.stats()
            problems = watcher.check_consistency()
        except Exception as exc:  # noqa: BLE001
            final, problems = {}, [f"could not check: {exc!r}"]
        leave.set()
        leave_end = time.monotonic() + 60
        while len(done) < a.clients and time.monotonic() < leave_end:
            try:
                handle(out.get(timeout=0.5))
            except queue.Empty:
                crashed_now()
        for p in procs:
            p.join(max(1.0, leave_end - time.monotonic()))
        crashed = [p.name for p in procs if p.exitcode != 0]
        if crashed:
            report["crashed"] = crashed
        try:
            after = watcher.stats()
            report["after_clients_left"] = {"clients": after.get("clients"),
                                            "segments": after.get("segments"),
                                            "keys": after.get("keys"),
                                            "allocated_bytes": after.get("allocated_bytes")}
        except Exception as exc:  # noqa: BLE001
            report["after_clients_left"] = {"error": repr(exc)}
    finally:
        watcher.close()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        stop = embedded.stop() if embedded is not None else None
    report.update(build_report(a, addr, windows, samples, final, problems, done))
    if stop is not None:
        report["master_exit"] = {"code": stop[0], "stderr_tail": stop[1][-2000:]}
        if stop[0] != 0:
            report["ok"] = False
    if report.get("crashed"):
        report["ok"] = False
    left = report.get("after_clients_left", {})
    if embedded is not None and (left.get("segments") or left.get("keys")
                                 or left.get("allocated_bytes") or left.get("clients") != 1):
        # Every client said BYE: nothing of theirs may stay behind.
        report["ok"] = False
        report["left_behind"] = left
    return report


def build_report(a: argparse.Namespace, addr: str, windows: dict[int, dict[str, Any]],
                 samples: list[dict[str, Any]], final: dict[str, Any], problems: list[str],
                 done: dict[int, int]) -> dict[str, Any]:
    totals: dict[str, dict[int, int]] = {}
    ops: dict[str, int] = {}
    expected: dict[str, int] = {}
    refused = unexpected = corrupt = reads = 0
    unexpected_ex: list[str] = []
    corrupt_ex: list[str] = []
    per_window = []
    for idx in sorted(windows):
        wd = windows[idx]
        for op, h in wd["hist"].items():
            merge_hist(totals.setdefault(op, {}), h)
        for op, n in wd["ops"].items():
            ops[op] = ops.get(op, 0) + n
        for k, n in wd["expected"].items():
            expected[k] = expected.get(k, 0) + n
        refused += wd["refused"]
        unexpected += wd["unexpected_count"]
        corrupt += wd["corrupt_count"]
        reads += wd["reads_checked"]
        unexpected_ex += wd["unexpected"][:20 - len(unexpected_ex)]
        corrupt_ex += wd["corrupt"][:20 - len(corrupt_ex)]
        t_lo, t_hi = idx * a.window, (idx + 1) * a.window
        rss = [s["rss"] for s in samples if s.get("rss") and t_lo <= s["t"] < t_hi]
        n_ops = sum(wd["ops"].values())
        all_h: dict[int, int] = {}
        for h in wd["hist"].values():
            merge_hist(all_h, h)
        per_window.append({
            "t": t_lo, "ops": n_ops, "ops_per_s": round(n_ops / a.window, 1),
            "p50_ms": round(percentile(all_h, 0.50), 3),
            "p99_ms": round(percentile(all_h, 0.99), 3),
            "p99_ms_by_op": {op: round(percentile(h, 0.99), 3) for op, h in wd["hist"].items()},
            "rss_mb": round(max(rss) / MiB, 1) if rss else None,
            "unexpected": wd["unexpected_count"], "corrupt": wd["corrupt_count"],
        })
    by_op = {op: {"count": ops[op], "p50_ms": round(percentile(h, 0.5), 3),
                  "p99_ms": round(percentile(h, 0.99), 3),
                  "p999_ms": round(percentile(h, 0.999), 3)}
             for op, h in sorted(totals.items())}
    rss = rss_summary(samples, a.warmup)
    finished = sum(1 for n in done.values() if n >= 0)
    ok = corrupt == 0 and unexpected == 0 and not problems and finished == a.clients
    if a.max_rss_growth_mb is not None and rss:
        ok = ok and rss["growth_after_warmup_mb"] <= a.max_rss_growth_mb
    evicted = final.get("evicted_keys", 0)
    return {
        "ok": ok,
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "config": {k: v for k, v in vars(a).items() if k != "json"},
        "master": addr,
        "operations": sum(ops.values()),
        "reads_checked": reads,
        "corrupted_reads": corrupt,
        "corrupted_examples": corrupt_ex,
        "unexpected_errors": unexpected,
        "unexpected_examples": unexpected_ex,
        "expected_outcomes": dict(sorted(expected.items())),
        "puts_refused_no_space": refused,
        "consistency_problems": problems,
        "by_op": by_op,
        "windows": per_window,
        "rss": rss,
        "rss_samples": samples,
        "final_stats": {k: final.get(k) for k in (
            "keys", "allocated_bytes", "capacity_bytes", "evicted_keys", "evicted_bytes",
            "eviction_rounds", "sessions", "pinned_sessions", "memberships", "pending_writes",
            "put_start_discarded", "put_start_released", "alloc_failures", "clients",
            "segments")},
        "evicted_keys": evicted,
        "clients_finished": finished,
    }


def window_line(idx: int, wd: dict[str, Any], a: argparse.Namespace,
                samples: list[dict[str, Any]]) -> str:
    all_h: dict[int, int] = {}
    for h in wd["hist"].values():
        merge_hist(all_h, h)
    t_lo = idx * a.window
    rss = [s["rss"] for s in samples if s.get("rss") and t_lo <= s["t"] < t_lo + a.window]
    n = sum(wd["ops"].values())
    return (f"[soak] t={t_lo:6.0f}s ops/s={n / a.window:8.0f} p50={percentile(all_h, .5):7.2f}ms "
            f"p99={percentile(all_h, .99):7.2f}ms rss={(max(rss) / MiB if rss else 0):6.1f}MiB "
            f"unexpected={wd['unexpected_count']} corrupt={wd['corrupt_count']}")


def table(r: dict[str, Any]) -> str:
    lines = []
    ops = sorted(r["by_op"], key=lambda o: -r["by_op"][o]["count"])
    main = [o for o in ("get_batch", "put_batch", "get", "tagged_put_batch", "attach")
            if o in r["by_op"]]
    lines.append(f"{'t (s)':>7} {'ops/s':>8} {'p50 ms':>8} {'p99 ms':>8} " +
                 " ".join(f"{('p99 ' + o)[:16]:>16}" for o in main) + f" {'RSS MiB':>8}")
    for w in r["windows"]:
        lines.append(f"{w['t']:>7.0f} {w['ops_per_s']:>8.0f} {w['p50_ms']:>8.2f} "
                     f"{w['p99_ms']:>8.2f} " +
                     " ".join(f"{w['p99_ms_by_op'].get(o, float('nan')):>16.2f}" for o in main) +
                     f" {w['rss_mb'] if w['rss_mb'] is not None else float('nan'):>8.1f}")
    lines.append("")
    lines.append(f"{'op':<18} {'count':>10} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9}")
    for o in ops:
        b = r["by_op"][o]
        lines.append(f"{o:<18} {b['count']:>10} {b['p50_ms']:>8.2f} {b['p99_ms']:>8.2f} "
                     f"{b['p999_ms']:>9.2f}")
    rss = r["rss"]
    lines.append("")
    misses = r["expected_outcomes"].get("miss", 0)
    lines.append(f"operations {r['operations']}, keys read and checked {r['reads_checked']} "
                 f"(keys missed {misses}), "
                 f"corrupted {r['corrupted_reads']}, unexpected errors "
                 f"{r['unexpected_errors']}, puts refused (no space) "
                 f"{r['puts_refused_no_space']}, evicted keys {r['evicted_keys']}")
    if rss:
        lines.append(f"master RSS MiB: start {rss['at_start_mb']:.1f}, after warm-up "
                     f"{rss['after_warmup_mb']:.1f}, end {rss['at_end_mb']:.1f}, max "
                     f"{rss['max_mb']:.1f}, growth after warm-up "
                     f"{rss['growth_after_warmup_mb']:+.1f} "
                     f"({rss['slope_after_warmup_mb_per_min']:+.2f} MiB/min)")
    lines.append(f"consistency problems: {len(r['consistency_problems'])}; result: "
                 f"{'OK' if r['ok'] else 'FAILED'}")
    for ex in r["unexpected_examples"][:5] + r["corrupted_examples"][:5]:
        lines.append(f"  e.g. {ex}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        r = run(a)
    except KeyboardInterrupt:
        print("soak: interrupted", file=sys.stderr)
        return 1
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1, default=str)
    print(table(r))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
