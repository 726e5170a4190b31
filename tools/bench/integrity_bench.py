"""Micro-benchmarks behind the object checksums and the peer-segment copies
(RELIABILITY.md "Integrity"): no master, no client, one process.

``python -m kvmaster.tools.bench.integrity_bench [--sizes 4096,65536,...] [--json out]``

* ``hashes``: µs per value and GB/s of the candidate checksums over random values of
  each size: xxh3_64 (the ``xxhash`` package, what the client uses), CRC-32C (the
  ``crc32c`` and ``google-crc32c`` packages, measured only when installed: neither is a
  dependency) and zlib's CRC-32 (for scale).  Best of ``--repeat`` rounds.
* ``copies``: µs per 4 KiB value of a 1,024-value batch copied out of a segment file
  through a mapping (``memoryview.tobytes``, what the client did for a peer's segment
  before) and with ``os.pread`` on a descriptor (what it does now), into fresh bytes and
  into a preallocated buffer (``preadv``), and the ``fstat`` a size check would add.
* ``client`` (``--client-rounds N``, default 60; 0 skips it): a real master and clients
  of this process, checksums on and off side by side: rounds of put_batch, get_batch
  and batch_remove(force) of 1,024 fresh 4 KiB keys by a client with the defaults and
  one with ``write_checksums``/``verify_checksums`` off, alternating call by call, into
  the client's own segment and into a peer's (a third client's).  Per call the wall
  time and the calling thread's CPU time; the minimum over rounds is the figure for the
  A/B (other work on the machine only ever adds to it).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any


def _best(fn: Callable[[], Any], repeat: int, inner: int) -> float:
    """Best seconds per call of ``fn`` over ``repeat`` rounds of ``inner`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def hash_functions() -> dict[str, Callable[[Any], int]]:
    import xxhash

    out: dict[str, Callable[[Any], int]] = {"xxh3_64": xxhash.xxh3_64_intdigest}
    try:
        import crc32c

        out["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        out["google_crc32c"] = google_crc32c.value
    except ImportError:
        pass
    out["zlib.crc32"] = zlib.crc32
    return out


def bench_hashes(sizes: list[int], repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in sizes:
        data = os.urandom(size)
        inner = max(5, (32 << 20) // size)
        row = {}
        for name, fn in hash_functions().items():
            s = _best(lambda fn=fn: fn(data), repeat, inner)
            row[name] = {"us": s * 1e6, "gb_s": size / s / 1e9}
        out[str(size)] = row
    return out


def bench_copies(repeat: int, n: int = 1024, size: int = 4096) -> dict[str, Any]:
    fd, path = tempfile.mkstemp(prefix="kvmaster-bench-", dir="/dev/shm")
    try:
        total = n * size * 2
        os.ftruncate(fd, total)
        os.pwrite(fd, os.urandom(total), 0)
        mm = mmap.mmap(fd, total)
        buf = memoryview(mm)
        offs = [i * size * 2 for i in range(n)]
        dsts = [bytearray(size) for _ in offs]
        pread, preadv, fstat = os.pread, os.preadv, os.fstat

        def mm_bytes() -> None:
            for o in offs:
                buf[o:o + size].tobytes()

        def pread_bytes() -> None:
            for o in offs:
                pread(fd, size, o)

        def mm_into() -> None:
            for o, d in zip(offs, dsts):
                d[:] = buf[o:o + size]

        def preadv_into() -> None:
            for o, d in zip(offs, dsts):
                preadv(fd, [d], o)

        def fstats() -> None:
            for _ in offs:
                fstat(fd)

        out = {name: _best(fn, repeat, 5) * 1e6 / n for name, fn in (
            ("mmap_tobytes", mm_bytes), ("pread", pread_bytes), ("mmap_into", mm_into),
            ("preadv_into", preadv_into), ("fstat", fstats))}
        buf.release()
        mm.close()
        return {"us_per_value": out, "values": n, "value_bytes": size}
    finally:
        os.close(fd)
        os.unlink(path)


def bench_client(rounds: int, n: int = 1024, size: int = 4096) -> dict[str, Any]:
    """See the module docstring; -> ``{"own"|"peer": {"on"|"off": {op: {"wall_us":
    [...], "cpu_us": [...]}}}}``, µs per key per round."""
    import shutil
    import tempfile as tf
    from pathlib import Path

    from kvmaster import Client, ClientConfig, ReplicateConfig

    from .store_bench import Master

    work = Path(tf.mkdtemp(prefix="kvbench-integrity-"))
    seg = 128 << 20
    out: dict[str, Any] = {w: {v: {op: {"wall_us": [], "cpu_us": []} for op in
                                   ("put_batch", "get_batch", "batch_remove")}
                               for v in ("on", "off")} for w in ("own", "peer")}
    # Short leases: a removed batch's leased ranges are freed soon after.
    with Master("kvmaster", False, work, ["--default-kv-lease-ttl", "50"]) as m:
        clients = {}
        try:
            for v in ("on", "off"):
                c = clients[v] = Client(ClientConfig(verify_checksums=v == "on",
                                                     write_checksums=v == "on"))
                c.setup(m.addr, seg)
            owner = clients["owner"] = Client()
            owner.setup(m.addr, seg)
            value = os.urandom(size)
            vals = [value] * n
            for r in range(rounds):
                for where in ("own", "peer") if r % 2 == 0 else ("peer", "own"):
                    for v in ("on", "off") if r % 4 < 2 else ("off", "on"):
                        c = clients[v]
                        target = c.segment_name if where == "own" else owner.segment_name
                        cfg = ReplicateConfig(preferred_segments=[target])
                        keys = [f"{where}-{v}-{r}-{i}" for i in range(n)]
                        for op, call in (("put_batch", lambda: c.put_batch(keys, vals, cfg)),
                                         ("get_batch", lambda: c.get_batch(keys)),
                                         ("batch_remove", lambda: c.batch_remove(keys, True))):
                            c0, t0 = time.thread_time(), time.perf_counter()
                            got = call()
                            t1, c1 = time.perf_counter(), time.thread_time()
                            if op == "get_batch" and any(g != value for g in got):
                                raise RuntimeError(f"{where}/{v}: get_batch read wrong bytes")
                            if op == "put_batch" and any(got):
                                raise RuntimeError(f"{where}/{v}: put_batch answered {got[:4]}")
                            rec = out[where][v][op]
                            if r:  # (the first round warms up)
                                rec["wall_us"].append((t1 - t0) * 1e6 / n)
                                rec["cpu_us"].append((c1 - c0) * 1e6 / n)
        finally:
            for c in clients.values():
                c.close()
    shutil.rmtree(work, ignore_errors=True)
    return out


def _client_table(res: dict[str, Any]) -> list[str]:
    import statistics as st

    lines = ["| segment | op | wall µs/key off (min / median) | on (min / median) | "
             "on/off (min) | client CPU µs/key off (min / median) | on (min / median) | "
             "on/off (min) |", "|---|---|---|---|---|---|---|---|"]
    for where, by_v in res.items():
        for op in by_v["on"]:
            cells = []
            for f in ("wall_us", "cpu_us"):
                off, on = by_v["off"][op][f], by_v["on"][op][f]
                cells += [f"{min(off):.2f} / {st.median(off):.2f}",
                          f"{min(on):.2f} / {st.median(on):.2f}", f"{min(on) / min(off):.2f}x"]
            lines.append(f"| {where} | {op} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,65536,524288,2097152")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--client-rounds", type=int, default=60,
                    help="rounds of the client A/B (0: skip it)")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",") if x]
    hashes = bench_hashes(sizes, a.repeat)
    copies = bench_copies(a.repeat)
    client = bench_client(a.client_rounds) if a.client_rounds > 1 else None
    names = list(next(iter(hashes.values())))
    print("| value | " + " | ".join(f"{n} µs (GB/s)" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for size, row in hashes.items():
        print(f"| {int(size) // 1024} KiB | " + " | ".join(
            f"{row[n]['us']:.2f} ({row[n]['gb_s']:.1f})" for n in names) + " |")
    print()
    print(f"Copies of {copies['values']} values of {copies['value_bytes']} B from a segment "
          "file, µs per value: " + ", ".join(f"{k} {v:.2f}"
                                             for k, v in copies["us_per_value"].items()))
    if client is not None:
        print()
        print(f"Client A/B, checksums on and off, {a.client_rounds - 1} rounds of 1,024 keys "
              "of 4 KiB (after one warm-up round):")
        print()
        print("\n".join(_client_table(client)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hashes": hashes, "copies": copies, "client": client}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
