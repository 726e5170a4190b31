"""Big blocks on one host: put and get of MiB-sized values against the machine's copy floor.

``python -m kvmaster.tools.bench blocks [--sizes-mib 1,4,16] [--rounds 9] [--batch 4]``

Real KV blocks are MiBs (a 512-token block of an 8B model is about 64 MiB, SGLang's
64-token pages about 8 MiB).  One real master and clients of this process; for each
block size, rounds of (fresh keys each round, then removed):

* ``put`` (bytes in) and ``get`` (bytes out) of one block;
* ``put_from`` / ``get_into`` of one block from and into the caller's preallocated buffer;
* ``batch_put_from`` / ``batch_get_into`` of ``--batch`` blocks, one buffer each;

with the blocks in the client's own segment and in a peer's (another client's segment on
this host, mapped or read with ``pread``), checksums on (the default: xxh3_64 written at
put end, verified on read) and off (``write_checksums``/``verify_checksums`` False).

The floor, measured in the same run, block size by block size, once per round: one
thread's ``memmove`` (``ctypes.memmove``, glibc's ``memcpy``) of each of ``--batch`` source
blocks into its own preallocated, already faulted-in buffer, timed together.  Each figure is GB/s (10^9 bytes per second) of
the median round, with the ratio to the floor's median of the same size (goal: 0.8 or
more); the JSON has every round.  The *ceiling* is the ratio the op would reach with its
copy at the floor and nothing else but its master round trips (two for a put: start and
end; one for a get), each an ``is_exist`` round trip measured in the same round: what the
messaging floor leaves to a block of that size.

Copies per direction (what the bytes go through, in order):

* put/put_from/batch_put_from into a segment of this host: the caller's buffer -> the
  segment, one copy (``memmove`` in fenced blocks of ``FENCE_BLOCK``, kvmaster/_fence.py),
  and one read pass of the caller's bytes for the checksum (off: none);
* get into a new ``bytes``: segment -> bytes, one copy; get_into/batch_get_into: segment ->
  the caller's buffer, one copy; and one read pass of the copied bytes to verify the
  checksum (off: none).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
#: The master's read lease in the benchmark, ms (``--lease-ms``).
LEASE_MS = 1000
OPS = ("put", "get", "put_from", "get_into", "batch_put_from", "batch_get_into")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mib", default="1,4,16", help="block sizes, MiB, comma-separated")
    p.add_argument("--rounds", type=int, default=9, help="rounds per size (the first of each "
                                                          "size warms up and is not counted)")
    p.add_argument("--batch", type=int, default=4, help="blocks per batch call")
    p.add_argument("--checksums", default="on,off", help="on, off or on,off")
    p.add_argument("--where", default="own,peer", help="own, peer or own,peer: whose segment")
    p.add_argument("--lease-ms", type=int, default=LEASE_MS,
                   help="the master's read lease, ms: longer than any read of the run (a "
                        "late read with checksums off fails -707); each round waits it out")
    p.add_argument("--json", default="", help="write every round here")
    p.add_argument("--md", default="", help="write the markdown table here")


def _buffer(n: int) -> bytearray:
    b = bytearray(os.urandom(min(n, 1 << 16)) * (n // min(n, 1 << 16) + 1))[:n]
    return b


def _addr(b: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b))


def floor_gbs(src: list[bytearray], dst: list[bytearray]) -> float:
    """GB/s of one thread's memmoves of each ``src[i]`` into ``dst[i]`` in turn (what a
    batch of ``len(src)`` blocks copies), timed together."""
    pairs = [(_addr(d), _addr(s), len(s)) for s, d in zip(src, dst)]
    t = time.perf_counter()
    for d, s, n in pairs:
        ctypes.memmove(d, s, n)
    return sum(n for _, _, n in pairs) / (time.perf_counter() - t) / 1e9


def round_trip_s(client: Any, n: int = 200) -> float:
    """Median seconds of one master round trip: ``is_exist`` of a missing key."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        client.is_exist("blocks-bench-no-such-key")
        times.append(time.perf_counter() - t)
    return statistics.median(times)


#: Master round trips of each op: a put's start and end; a get's replica list (a
#: batch call sends one of each for all its keys).
TRIPS = {"put": 2, "put_from": 2, "batch_put_from": 2, "get": 1, "get_into": 1,
         "batch_get_into": 1}


def run(a: argparse.Namespace) -> dict[str, Any]:
    from kvmaster import Client, ClientConfig, ReplicateConfig

    from .store_bench import Master

    sizes = [int(x) * MiB for x in a.sizes_mib.split(",") if x]
    modes = [m for m in a.checksums.split(",") if m]
    wheres = [w for w in a.where.split(",") if w]
    k = a.batch
    # A round writes 2 + k blocks per client into each segment it measures; the peer's
    # takes both clients' (its space comes back a lease after the round's removes).
    seg = max(256 * MiB, 2 * (2 + k) * max(sizes) + 64 * MiB)
    work = Path(tempfile.mkdtemp(prefix="kvbench-blocks-"))
    res: dict[str, Any] = {"sizes": sizes, "batch": k, "rounds": a.rounds, "floor": {},
                           "ops": {}}
    # A read lease longer than any read here (a late read with checksums off fails
    # -707); the rounds wait it out, so that the removed blocks' space is free again.
    lease_ms = a.lease_ms
    with Master("kvmaster", False, work, ["--default-kv-lease-ttl", str(lease_ms)]) as m:
        clients: dict[str, Any] = {}
        try:
            for v in modes:
                c = clients[v] = Client(ClientConfig(verify_checksums=v == "on",
                                                     write_checksums=v == "on"))
                c.setup(m.addr, seg)
            peer = clients["peer"] = Client()
            peer.setup(m.addr, seg)
            for size in sizes:
                src = [_buffer(size) for _ in range(k)]
                dst = [bytearray(size) for _ in range(k)]
                for b in dst:
                    ctypes.memset(_addr(b), 1, size)  # faulted in before any timing
                floors: list[float] = []
                rtts: list[float] = []
                rows: dict[str, list[float]] = {}
                for r in range(a.rounds):
                    floors.append(floor_gbs(src, dst))
                    rtts.append(round_trip_s(clients[modes[0]]))
                    for where in wheres if r % 2 == 0 else wheres[::-1]:
                        for v in modes if r % 4 < 2 else modes[::-1]:
                            c = clients[v]
                            target = c.segment_name if where == "own" else peer.segment_name
                            cfg = ReplicateConfig(preferred_segments=[target])
                            one = f"b-{size}-{r}-{where}-{v}"
                            keys = [f"{one}-{i}" for i in range(k)]
                            value = bytes(src[0])
                            for op in OPS:
                                key = f"{one}-{op}"
                                if op == "put":
                                    t = time.perf_counter()
                                    c.put(key, value, cfg)
                                elif op == "put_from":
                                    t = time.perf_counter()
                                    c.put_from(key, src[0], cfg)
                                elif op == "batch_put_from":
                                    t = time.perf_counter()
                                    got = c.batch_put_from(keys, src, cfg)
                                    if any(got):
                                        raise RuntimeError(f"batch_put_from answered {got}")
                                elif op == "get":
                                    t = time.perf_counter()
                                    out = c.get(f"{one}-put")
                                    el = time.perf_counter() - t
                                    if out != value:
                                        raise RuntimeError("get read wrong bytes")
                                elif op == "get_into":
                                    t = time.perf_counter()
                                    c.get_into(f"{one}-put_from", dst[0])
                                    el = time.perf_counter() - t
                                    if dst[0] != src[0]:
                                        raise RuntimeError("get_into read wrong bytes")
                                else:
                                    t = time.perf_counter()
                                    got = c.batch_get_into(keys, dst)
                                    el = time.perf_counter() - t
                                    if got != [size] * k:
                                        raise RuntimeError(f"batch_get_into answered {got}")
                                    if dst != src:
                                        raise RuntimeError("batch_get_into read wrong bytes")
                                if not op.startswith(("get", "batch_get")):
                                    el = time.perf_counter() - t
                                n = size * (k if op.startswith("batch") else 1)
                                if r:
                                    rows.setdefault(f"{where}/{v}/{op}", []).append(n / el / 1e9)
                            c.batch_remove([f"{one}-put", f"{one}-put_from", *keys], True)
                    time.sleep(lease_ms / 1000 + 0.05)  # (the removed blocks' leases end)
                res["floor"][str(size)] = floors[1:]
                res.setdefault("rtt_s", {})[str(size)] = rtts[1:]
                res["ops"][str(size)] = rows
        finally:
            for c in clients.values():
                c.close()
    shutil.rmtree(work, ignore_errors=True)
    return res


def table(res: dict[str, Any]) -> list[str]:
    """Markdown: one row per size, where, checksums and op: median GB/s, ratio to the
    median floor of that size, and the rounds' ratios."""
    lines = ["| block | segment | checksums | op | GB/s (median) | floor GB/s | ratio | "
             "within 0.8 | ceiling | ratio per round |",
             "|---|---|---|---|---:|---:|---:|---|---:|---|"]
    for size in res["sizes"]:
        floors = res["floor"][str(size)]
        fl = statistics.median(floors)
        rtt = statistics.median(res["rtt_s"][str(size)])
        for name, vals in res["ops"][str(size)].items():
            where, v, op = name.split("/")
            med = statistics.median(vals)
            n = size * (res["batch"] if op.startswith("batch") else 1)
            copy_s = n / (fl * 1e9)
            ceiling = copy_s / (copy_s + TRIPS[op] * rtt)
            per = ", ".join(f"{x / f:.2f}" for x, f in zip(vals, floors))
            lines.append(f"| {size // MiB} MiB | {where} | {v} | {op} | {med:.2f} | {fl:.2f} | "
                         f"{med / fl:.2f} | {'yes' if med / fl >= 0.8 else 'NO'} | "
                         f"{ceiling:.2f} | {per} |")
    rtts = {s: statistics.median(v) * 1e6 for s, v in res["rtt_s"].items()}
    lines.append("")
    lines.append("Ceiling: the ratio the op would reach if its copy ran at the floor and it "
                 "cost nothing but its master round trips (is_exist p50, µs, by block size: "
                 + ", ".join(f"{int(s) // MiB} MiB {u:.0f}" for s, u in rtts.items()) + ").")
    return lines


def cmd_blocks(a: argparse.Namespace) -> int:
    res = run(a)
    try:
        import subprocess

        res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True,
                                       cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        res["commit"] = ""
    md = "\n".join(table(res))
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    if a.md:
        Path(a.md).write_text(md + "\n")
    return 0
