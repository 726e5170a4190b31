"""One benchmark scenario against one running master; writes JSON to ``--out``.

Run as a script by :mod:`kvmaster.tools.bench.store_bench`:

* ``--system kvmaster`` under the project's interpreter (imports kvmaster),
* ``--system mooncake`` under the Mooncake venv's interpreter (imports
  ``mooncake.store``; kvmaster is not importable there),
* ``--system zmqecho`` under the project's interpreter (raw pyzmq DEALER),
* ``--system tcpecho``: a plain TCP socket client (no ZeroMQ).

The scenario code below is the same for both stores; only ``open_store``
differs.  Timing and /proc helpers come from ``_timing.py``, loaded by path.

Scenarios: ``single`` (put / is_exist / get / remove, one call at a time),
``batch`` (put_batch / batch_is_exist / get_batch / batch_remove(force) for
each batch size), ``memory`` (master RSS and CPU for N small objects),
``echo`` (round trips against an echo server from ``_echo.py``), ``compat``
(Mooncake's own API on both systems: kvmaster through ``kvmaster.compat``,
Mooncake through ``mooncake.store``; ``batch_is_exist`` of 1,024 keys and
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` of 64 keys of
2 MiB, each key gathered from and scattered to ``--mb-parts`` registered buffers,
as vLLM's connector saves and loads its KV blocks).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _load_timing() -> Any:
    path = Path(__file__).resolve().with_name("_timing.py")
    spec = importlib.util.spec_from_file_location("_kvbench_timing", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


T = _load_timing()

SEGMENT = 256 << 20
#: The compat scenario's segment: room for its multi-buffer rounds (64 x 2 MiB each).
COMPAT_SEGMENT = 1 << 30
LOCAL_BUFFER = 64 << 20


# ------------------------------------------------------------------ stores

#: Objects of this process kept alive for the run (the peer segment's owner).
_KEEP: list[Any] = []

#: kvmaster client modes (``--client``): checksums on (the defaults) or off (neither
#: written nor verified); ``peer``: the objects go to a segment another client owns
#: (read and written with pread/pwrite, as a reader of a peer's segment does), not the
#: benchmark client's own (copied through its mapping).
CLIENT_MODES = ("default", "nocsum", "peer", "peer-nocsum")


def open_store(system: str, addr: str, mode: str = "default") -> Any:
    if system == "kvmaster":
        from kvmaster import Client, ClientConfig

        sums = "nocsum" not in mode
        c = Client(ClientConfig(verify_checksums=sums, write_checksums=sums))
        if mode.startswith("peer"):
            owner = Client()  # (this process, another client: its segment is a peer's)
            owner.setup(addr, SEGMENT)
            _KEEP.append(owner)
            c.setup(addr, 0)
        else:
            c.setup(addr, SEGMENT)
        return c
    if system == "mooncake":
        from mooncake.store import MooncakeDistributedStore

        s = MooncakeDistributedStore()
        rc = s.setup("127.0.0.1", "P2PHANDSHAKE", SEGMENT, LOCAL_BUFFER, "tcp", "", addr)
        if rc != 0:
            raise RuntimeError(f"Mooncake setup failed rc={rc}")
        return s
    raise ValueError(f"unknown store system {system!r}")


# Result predicates that hold for both clients: kvmaster returns None and
# raises on failure, Mooncake returns 0 / a negative code.
def ok_status(r: Any, _item: Any = None) -> bool:
    return r is None or (type(r) is int and r == 0)


def ok_batch_status(r: Any, _keys: Any = None) -> bool:
    if type(r) is int:
        return r == 0
    return all(x == 0 for x in r)


def ok_exists(r: Any, _item: Any = None) -> bool:
    return r == 1


def open_compat(system: str, addr: str, segment: int) -> Any:
    """Mooncake's ``MooncakeDistributedStore`` API: kvmaster's facade or Mooncake's own."""
    if system == "kvmaster":
        from kvmaster.compat import MooncakeDistributedStore
    else:
        from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment, LOCAL_BUFFER, "tcp", "", addr)
    if rc != 0:
        raise RuntimeError(f"{system} compat setup failed rc={rc}")
    return s


def chunks(seq: list[Any], n: int) -> list[list[Any]]:
    return [seq[i:i + n] for i in range(0, len(seq), n)]


# --------------------------------------------------------------- scenarios

def scenario_single(store: Any, a: argparse.Namespace) -> dict[str, Any]:
    n, pid, dl = a.n, a.master_pid, a.deadline
    val = os.urandom(4096)
    tag = f"r{a.run_id}"
    # Untimed warm-up: connections, transfer paths, allocator first touches.
    warm = [f"{tag}_w_{i}" for i in range(200)]
    for k in warm:
        store.put(k, val)
        store.is_exist(k)
        store.get(k)
    keys = [f"{tag}_a_{i}" for i in range(n)]
    res: dict[str, Any] = {}

    with T.CpuMeter(pid) as m:
        raw = T.time_each(lambda k: store.put(k, val), keys, dl, ok_status)
    res["put_4KiB"] = T.add_cpu(T.latency_summary(raw), m, raw["calls"], "op")
    keys = keys[:raw["calls"]]

    with T.CpuMeter(pid) as m:
        raw = T.time_each(store.is_exist, keys, dl, ok_exists)
    res["is_exist_hit"] = T.add_cpu(T.latency_summary(raw), m, raw["calls"], "op")

    with T.CpuMeter(pid) as m:
        raw = T.time_each(store.get, keys, dl, lambda r, _k: len(r) == 4096)
    res["get_4KiB"] = T.add_cpu(T.latency_summary(raw), m, raw["calls"], "op")

    # remove: keys written but never read, so neither system holds a lease on
    # them and a plain (non-forced) remove succeeds on both.
    rkeys = [f"{tag}_b_{i}" for i in range(n)]
    for part in chunks(rkeys, 250):
        store.put_batch(part, [val] * len(part))
    with T.CpuMeter(pid) as m:
        raw = T.time_each(store.remove, rkeys, dl, ok_status)
    res["remove"] = T.add_cpu(T.latency_summary(raw), m, raw["calls"], "op")
    return res


def scenario_batch(store: Any, a: argparse.Namespace) -> dict[str, Any]:
    pid, dl = a.master_pid, a.deadline
    val = os.urandom(4096)
    res: dict[str, Any] = {}
    for bs in a.batch_sizes:
        nb = max(1, a.batch_keys // bs)
        batches = [[f"r{a.run_id}_B{bs}_{b}_{i}" for i in range(bs)] for b in range(nb)]
        vals = [val] * bs
        # Untimed warm-up batch (separate keys).
        wkeys = [f"r{a.run_id}_B{bs}_warm_{i}" for i in range(bs)]
        store.put_batch(wkeys, vals)
        store.batch_is_exist(wkeys)
        store.get_batch(wkeys)
        store.batch_remove(wkeys, True)

        def run(name: str, fn: Any, ok: Any) -> None:
            nonlocal batches
            c0 = time.thread_time()
            with T.CpuMeter(pid) as m:
                raw = T.time_each(fn, batches, dl, ok)
            client_cpu = time.thread_time() - c0
            nkeys = raw["calls"] * bs
            s = T.latency_summary(raw, units=nkeys)
            out = {"keys": nkeys, "keys_s": s["units_s"], "batch_p50_us": s["p50_us"],
                   "batch_p99_us": s["p99_us"], "errors": s["errors"],
                   # (the CPU of the thread making the calls, which does all of the
                   # client's work in them: less swayed by other work on the machine than
                   # keys/s; not counted: a segment's fault-in thread, the heartbeat)
                   "client_cpu_us_per_key": 1e6 * client_cpu / nkeys if nkeys else float("nan")}
            res[f"{bs}/{name}"] = T.add_cpu(out, m, nkeys, "key")
            batches = batches[:raw["calls"]]

        run("put_batch", lambda ks: store.put_batch(ks, vals), ok_batch_status)
        run("batch_is_exist", store.batch_is_exist, lambda r, ks: all(x == 1 for x in r))
        run("get_batch", store.get_batch,
            lambda r, ks: all(x is not None and len(x) == 4096 for x in r))
        run("batch_remove_force", lambda ks: store.batch_remove(ks, True), ok_batch_status)
    return res


def scenario_compat(store: Any, a: argparse.Namespace) -> dict[str, Any]:
    """batch_is_exist of 1,024 keys; multi-buffer put and get of ``--mb-keys`` keys of
    ``--mb-block`` bytes in ``--mb-parts`` buffers each (fresh keys per round, as many
    rounds as the segment holds, removed untimed at the end; the first round's bytes
    are checked)."""
    import ctypes

    pid, dl = a.master_pid, a.deadline
    res: dict[str, Any] = {}
    val = os.urandom(4096)
    keys = [f"r{a.run_id}_cx_{i}" for i in range(1024)]
    for part in chunks(keys, 256):
        store.put_batch(part, [val] * len(part))
    reps = [keys] * max(1, a.batch_keys // 1024)
    store.batch_is_exist(keys)  # warm
    with T.CpuMeter(pid) as m:
        raw = T.time_each(store.batch_is_exist, reps, dl, lambda r, ks: all(x == 1 for x in r))
    n = raw["calls"] * 1024
    s = T.latency_summary(raw, units=n)
    res["1024/batch_is_exist"] = T.add_cpu(
        {"keys": n, "keys_s": s["units_s"], "batch_p50_us": s["p50_us"],
         "batch_p99_us": s["p99_us"], "errors": s["errors"]}, m, n, "key")
    store.batch_remove(keys, True)

    nk, block, parts = a.mb_keys, a.mb_block, a.mb_parts
    part = block // parts
    total = nk * block
    src = ctypes.create_string_buffer(os.urandom(1 << 20) * (total >> 20), total)
    dst = ctypes.create_string_buffer(total)
    sp, dp = ctypes.addressof(src), ctypes.addressof(dst)
    for ptr in (sp, dp):
        rc = store.register_buffer(ptr, total)
        if rc != 0:
            raise RuntimeError(f"register_buffer failed rc={rc}")
    ptrs_in = [[sp + i * block + j * part for j in range(parts)] for i in range(nk)]
    ptrs_out = [[dp + i * block + j * part for j in range(parts)] for i in range(nk)]
    sizes = [[part] * parts for _ in range(nk)]
    # Every round writes fresh keys and nothing is removed until the end: a force
    # remove of a key just read frees its space only when the read's lease ends on
    # kvmaster (a reader may still be copying), at once on Mooncake, so removing in
    # between would measure that difference instead of the calls.
    rounds = max(2, min(a.mb_rounds, int(COMPAT_SEGMENT * 0.85) // total))
    written: list[str] = []
    lat: dict[str, list[float]] = {"put": [], "get": []}
    errors = {"put": 0, "get": 0}
    cpu: dict[str, float] = {"put": 0.0, "get": 0.0}
    started = T.perf()
    for r in range(rounds):
        ks = [f"r{a.run_id}_mb{r}_{i}" for i in range(nk)]
        c0 = T.proc_cpu_s(pid) if pid else 0.0
        t0 = T.perf()
        rcs = store.batch_put_from_multi_buffers(ks, ptrs_in, sizes)
        t1 = T.perf()
        c1 = T.proc_cpu_s(pid) if pid else 0.0
        got = store.batch_get_into_multi_buffers(ks, ptrs_out, sizes)
        t2 = T.perf()
        c2 = T.proc_cpu_s(pid) if pid else 0.0
        lat["put"].append((t1 - t0) * 1e6)
        lat["get"].append((t2 - t1) * 1e6)
        cpu["put"] += c1 - c0
        cpu["get"] += c2 - c1
        errors["put"] += sum(1 for x in rcs if x != 0)
        errors["get"] += sum(1 for x in got if x != block)
        if r == 0 and ctypes.string_at(dp, total) != ctypes.string_at(sp, total):
            errors["get"] += 1
        ctypes.memset(dp, 0, total)
        written += ks
        if T.perf() - started > dl:
            break
    for part_keys in chunks(written, 256):
        store.batch_remove(part_keys, True)
    for ptr in (sp, dp):
        store.unregister_buffer(ptr)
    for op, name in (("put", "batch_put_from_multi_buffers"),
                     ("get", "batch_get_into_multi_buffers")):
        raw = {"lat_us": lat[op], "elapsed_s": sum(lat[op]) / 1e6, "calls": len(lat[op]),
               "errors": errors[op]}
        n = raw["calls"] * nk
        s = T.latency_summary(raw, units=n)
        res[f"{nk}x{block >> 20}MiB/{name}"] = {
            "keys": n, "keys_s": s["units_s"], "batch_p50_us": s["p50_us"],
            "batch_p99_us": s["p99_us"], "errors": s["errors"],
            "gb_s": round(n * block / raw["elapsed_s"] / 1e9, 2) if raw["elapsed_s"] else 0.0,
            "master_cpu_us_per_key": round(cpu[op] / n * 1e6, 2) if n else 0.0}
    return res


def scenario_memory(store: Any, a: argparse.Namespace) -> dict[str, Any]:
    pid = a.master_pid
    n, bs = a.mem_objects, 1000
    val = os.urandom(256)
    vals = [val] * bs
    time.sleep(0.5)
    rss0 = T.proc_rss_bytes(pid)
    cpu0 = T.proc_cpu_ticks_s(pid)
    t0 = T.perf()
    stop_at = t0 + a.deadline * 4
    errors = stored = 0
    for b in range(0, n, bs):
        keys = [f"mem_{i}" for i in range(b, min(n, b + bs))]
        r = store.put_batch(keys, vals[:len(keys)])
        if not ok_batch_status(r):
            errors += 1
        stored += len(keys)
        if T.perf() > stop_at:
            break
    elapsed = T.perf() - t0
    cpu = T.proc_cpu_ticks_s(pid) - cpu0
    time.sleep(0.5)
    rss1 = T.proc_rss_bytes(pid)
    # Spot check that the objects are there.
    probe = [f"mem_{i}" for i in range(0, stored, max(1, stored // 1000))]
    present = sum(1 for x in store.batch_is_exist(probe) if x == 1)
    return {"memory": {
        "objects": stored,
        "value_bytes": 256,
        "rss_before_bytes": rss0,
        "rss_after_bytes": rss1,
        "bytes_per_object": (rss1 - rss0) / stored if stored else float("nan"),
        "insert_keys_s": stored / elapsed if elapsed > 0 else float("nan"),
        "master_cpu_s": cpu,
        "master_cpu_us_per_key": 1e6 * cpu / stored if stored else float("nan"),
        "batch_errors": errors,
        "probe_present_frac": present / len(probe) if probe else float("nan"),
    }}


def scenario_tcp_echo(a: argparse.Namespace) -> dict[str, Any]:
    import socket

    host, port = a.addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"\x10\x00\x01" + b"r0_a_1234".ljust(20, b".")

    def rt(_i: int) -> bool:
        sock.sendall(msg)
        got = 0
        while got < len(msg):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("echo server closed")
            got += len(chunk)
        return got == len(msg)

    for i in range(500):
        rt(i)
    with T.CpuMeter(a.master_pid) as m:
        raw = T.time_each(rt, range(a.n), a.deadline, lambda r, _i: r is True)
    out = T.add_cpu(T.latency_summary(raw), m, raw["calls"], "op")
    sock.close()
    return {"echo": out}


def scenario_echo(a: argparse.Namespace) -> dict[str, Any]:
    if a.system == "tcpecho":
        return scenario_tcp_echo(a)
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{a.addr}")
    # Frames shaped like an is_exist request: op, 2-byte route, ~20-byte payload.
    op, route, payload = b"\x10", b"\x00\x01", b"r0_a_1234".ljust(20, b".")
    # Like kvmaster's client: a blocking receive bounded by RCVTIMEO (no poll call).
    sock.setsockopt(zmq.RCVTIMEO, 5000)

    if a.system == "zmqlean":
        from kvmaster._frames import recv_frames as recv, send_frames as send
    else:
        def send(s: Any, frames: Any) -> None:
            s.send_multipart(frames)

        def recv(s: Any) -> list[bytes]:
            return s.recv_multipart()

    def rt(_i: int) -> bool:
        send(sock, (op, route, payload))
        try:
            return len(recv(sock)) == 3
        except zmq.Again:
            raise TimeoutError("echo server silent") from None

    for i in range(500):
        rt(i)
    with T.CpuMeter(a.master_pid) as m:
        raw = T.time_each(rt, range(a.n), a.deadline, lambda r, _i: r is True)
    out = T.add_cpu(T.latency_summary(raw), m, raw["calls"], "op")
    sock.close(0)
    ctx.term()
    return {"echo": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", required=True,
                   choices=["kvmaster", "mooncake", "zmqecho", "zmqlean", "tcpecho"])
    p.add_argument("--scenario", required=True, choices=["single", "batch", "memory", "echo",
                                                            "compat"])
    p.add_argument("--addr", required=True, help="host:port of the master")
    p.add_argument("--master-pid", type=int, default=0)
    p.add_argument("--run-id", type=int, default=0)
    p.add_argument("--n", type=int, default=5000, help="calls per single-op phase")
    p.add_argument("--batch-keys", type=int, default=16384, help="keys per batch phase")
    p.add_argument("--batch-sizes", default="64,1024")
    p.add_argument("--mem-objects", type=int, default=100_000)
    p.add_argument("--mb-keys", type=int, default=64, help="compat: keys per multi-buffer call")
    p.add_argument("--mb-block", type=int, default=2 << 20, help="compat: bytes per key")
    p.add_argument("--mb-parts", type=int, default=2, help="compat: buffers per key")
    p.add_argument("--mb-rounds", type=int, default=20, help="compat: multi-buffer rounds")
    p.add_argument("--deadline", type=float, default=30.0, help="wall-clock cap per phase, s")
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--client", default="default", choices=CLIENT_MODES,
                   help="kvmaster: checksums on or off, own segment or a peer's")
    a = p.parse_args(argv)
    a.batch_sizes = [int(x) for x in a.batch_sizes.split(",") if x]
    meta = {"system": a.system, "scenario": a.scenario, "client": a.client,
            "python": sys.version.split()[0],
            "pid": os.getpid(), "cpus_allowed": T.proc_status(os.getpid(), "Cpus_allowed_list")}
    t0 = T.perf()
    if a.scenario == "echo":
        res = scenario_echo(a)
    elif a.scenario == "compat":
        store = open_compat(a.system, a.addr, COMPAT_SEGMENT)
        try:
            res = scenario_compat(store, a)
        finally:
            store.close()
    else:
        store = open_store(a.system, a.addr, a.client)
        try:
            res = {"single": scenario_single, "batch": scenario_batch,
                   "memory": scenario_memory}[a.scenario](store, a)
        finally:
            store.close()
            for c in _KEEP:
                c.close()
    meta["wall_s"] = T.perf() - t0
    Path(a.out).write_text(json.dumps({"meta": meta, "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
