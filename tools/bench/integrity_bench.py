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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,65536,524288,2097152")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",") if x]
    hashes = bench_hashes(sizes, a.repeat)
    copies = bench_copies(a.repeat)
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
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hashes": hashes, "copies": copies}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
