"""The HA op log (``--ha-oplog``): what it costs the leader, etcd and the standby, and how
long a failover takes with it.

``python -m kvmaster.tools.bench oplog [--objects 100000,1000000] [--rounds 6]``

Starts its own etcd (the ``etcd`` binary, Debian package etcd-server) and masters with
``--ha --ha-lease-ttl 2 --shards 2`` on loopback; one client in this process.

* **Put throughput** (A/B, same run): rounds of ``--batches`` ``put_batch`` calls of 1,024
  keys of ``--value-bytes`` each, alternating between a leader with ``--ha-oplog`` and one
  without (each alone in its cluster, so both pay for the election the same way);
  keys/s of the median round, and the ratio; the master's and etcd's CPU per key (from
  ``/proc``), since on one small machine etcd's work competes with the master's.
* **Per object**, for each ``--objects`` N (a leader and one standby with ``--ha-oplog``,
  N objects put in batches of 1,024): the op-log bytes the leader wrote per object (its
  ``oplog_bytes``, msgpack before base64), etcd's database growth per object, and the
  standby's resident memory growth per object once it has applied all of them.
* **Failover** at N objects: the leader is SIGKILLed while the client reads one key in a
  loop; the time from the last reply of the old leader to the first read of an object
  stored before the kill that the new leader answers (the lease TTL, the election, the
  new leader's read of the log's tail, the client's re-handshake and re-mount, and the
  adoption of the objects of its segment), and the new leader's own figures: seconds to
  read the log to its end, objects adopted.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

from ..local_etcd import LocalEtcd
from ._timing import proc_cpu_s, proc_rss_bytes

TTL = 2
SHARDS = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--objects", default="100000,1000000",
                   help="object counts of the per-object and failover runs, comma-separated")
    p.add_argument("--rounds", type=int, default=6, help="A/B rounds of the put run")
    p.add_argument("--batches", type=int, default=40, help="1,024-key batches per round")
    p.add_argument("--value-bytes", type=int, default=64, help="bytes per value")
    p.add_argument("--key-bytes", type=int, default=64,
                   help="bytes per key (64: an engine's hex prefix hash)")
    p.add_argument("--json", default="", help="also write the results here")


def _etcd() -> LocalEtcd:
    # (room for a million objects' log, snapshots and history)
    return LocalEtcd(("--quota-backend-bytes", str(8 << 30)))


class _Master:
    def __init__(self, etcd: LocalEtcd, cluster: str, oplog: bool) -> None:
        cmd = [sys.executable, "-m", "kvmaster", "master", "--port", "0", "--metrics-port",
               "-1", "--ha", "--etcd-endpoints", etcd.url, "--cluster-id", cluster,
               "--ha-lease-ttl", str(TTL), "--shards", str(SHARDS), "--log-level", "WARNING"]
        if oplog:
            cmd.append("--ha-oplog")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "listening on" not in line:
            raise RuntimeError(f"master did not start: {line!r}")
        self.endpoint = line.rsplit(" ", 1)[-1].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _leader(etcd: LocalEtcd, cluster: str, timeout: float = 20) -> str:
    key = base64.b64encode(f"/kvmaster/{cluster}/leader".encode()).decode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"{etcd.url}/v3/kv/range",
                                     data=json.dumps({"key": key}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            kvs = json.loads(r.read()).get("kvs") or []
        if kvs:
            return base64.b64decode(kvs[0]["value"]).decode()
        time.sleep(0.05)
    raise RuntimeError(f"no leader in cluster {cluster}")


def _client(etcd: LocalEtcd, cluster: str, segment: int) -> Any:
    from kvmaster import Client, ClientConfig

    c = Client(ClientConfig(timeout_s=1.0, connect_timeout_s=30.0))
    c.setup(f"etcd://{etcd.url.removeprefix('http://')}/{cluster}", segment)
    return c


#: Bytes per key (``--key-bytes``).
KEY_BYTES = 64


def _key(prefix: str, j: int) -> str:
    return f"{prefix}{j:0{max(1, KEY_BYTES - len(prefix))}d}"


def _fill(c: Any, n: int, value: bytes, prefix: str) -> float:
    t0 = time.perf_counter()
    for i in range(0, n, 1024):
        keys = [_key(prefix, j) for j in range(i, min(n, i + 1024))]
        got = c.put_batch(keys, [value] * len(keys))
        if any(got):
            raise RuntimeError(f"put_batch failed: {sorted(set(got))}")
    return time.perf_counter() - t0


def put_ab(etcd: LocalEtcd, a: argparse.Namespace) -> dict[str, Any]:
    value = os.urandom(a.value_bytes)
    out: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}  # master CPU µs per key
    etcd_cpu: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(a.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            cluster = f"ab-{mode}-{r}"
            m = _Master(etcd, cluster, mode == "on")
            try:
                _leader(etcd, cluster)
                c = _client(etcd, cluster, 64 << 20)
                try:
                    _fill(c, 4096, value, "warm")
                    n = a.batches * 1024
                    m0, e0 = proc_cpu_s(m.proc.pid), proc_cpu_s(etcd.proc.pid)
                    out[mode].append(n / _fill(c, n, value, "k"))
                    time.sleep(0.1)  # (the last records' etcd writes)
                    cpu[mode].append((proc_cpu_s(m.proc.pid) - m0) / n * 1e6)
                    etcd_cpu[mode].append((proc_cpu_s(etcd.proc.pid) - e0) / n * 1e6)
                finally:
                    c.close()
            finally:
                m.stop()
    med = {k: statistics.median(v) for k, v in out.items()}
    return {"rounds": out, "median_keys_s": med, "ratio_on_off": med["on"] / med["off"],
            "master_cpu_us_per_key": {k: statistics.median(v) for k, v in cpu.items()},
            "etcd_cpu_us_per_key": {k: statistics.median(v) for k, v in etcd_cpu.items()}}


def per_object_and_failover(etcd: LocalEtcd, n: int, a: argparse.Namespace) -> dict[str, Any]:
    cluster = f"fo-{n}"
    value = os.urandom(a.value_bytes)
    first = _Master(etcd, cluster, True)
    _leader(etcd, cluster)
    standby = _Master(etcd, cluster, True)
    time.sleep(1.0)
    db0 = etcd.db_size()
    rss0 = proc_rss_bytes(standby.proc.pid)
    seg = max(64 << 20, n * (((a.value_bytes + 63) // 64) * 64) * 2 + (16 << 20))
    c = _client(etcd, cluster, seg)
    try:
        fill_s = _fill(c, n, value, "o")
        stats = c.stats()
        while stats.get("oplog", {}).get("pending_records"):  # (its last etcd writes)
            time.sleep(0.05)
            stats = c.stats()
        log_bytes = stats.get("oplog", {}).get("oplog_bytes", 0)
        # The standby has applied everything once its resident set stops growing.
        last, steady = -1, 0
        while steady < 5:
            time.sleep(0.5)
            rss = proc_rss_bytes(standby.proc.pid)
            steady = steady + 1 if rss == last else 0
            last = rss
        db1 = etcd.db_size()
        # Failover: read one stored key in a loop, kill the leader.
        probe = _key("o", 0)
        assert c.get(probe) == value
        last_ok = time.monotonic()
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        killed = time.monotonic()
        failed = 0
        while True:
            try:
                got = c.get(probe)
                if got == value:
                    break
            except Exception:  # noqa: BLE001 - the failover under way: counted
                failed += 1
            if time.monotonic() - killed > 120:
                raise RuntimeError("no reply from a new leader within 120 s")
        back = time.monotonic()
        new = c.stats().get("oplog", {})
        # Every object is there (a sample, checked byte for byte).
        for i in random.Random(1).sample(range(n), min(n, 2000)):
            if c.get(_key("o", i)) != value:
                raise RuntimeError(f"object {_key('o', i)} lost or changed after the failover")
        return {"objects": n, "fill_s": fill_s, "oplog_bytes_per_object": log_bytes / n,
                "etcd_db_bytes_per_object": (db1 - db0) / n,
                "standby_rss_bytes_per_object": (last - rss0) / n,
                "failover_s": back - last_ok, "kill_to_reply_s": back - killed,
                "failed_reads": failed,
                "new_leader_catch_up_s": new.get("catch_up_s"),
                "adopted_objects": new.get("adopted_objects")}
    finally:
        c.close()
        first.stop()
        standby.stop()


def cmd_oplog(a: argparse.Namespace) -> int:
    global KEY_BYTES
    KEY_BYTES = a.key_bytes
    etcd = _etcd()
    try:
        res: dict[str, Any] = {"put": put_ab(etcd, a), "scale": []}
        p = res["put"]
        print(f"put_batch of 1,024 x {a.value_bytes} B, keys/s (median of {a.rounds} rounds): "
              f"op log off {p['median_keys_s']['off']:,.0f}, on {p['median_keys_s']['on']:,.0f}"
              f", ratio {p['ratio_on_off']:.2f}; master CPU per key "
              f"{p['master_cpu_us_per_key']['off']:.2f} -> {p['master_cpu_us_per_key']['on']:.2f} µs, "
              f"etcd CPU per key {p['etcd_cpu_us_per_key']['off']:.2f} -> "
              f"{p['etcd_cpu_us_per_key']['on']:.2f} µs", flush=True)
        print("| objects | op-log bytes/object | etcd db bytes/object | standby RSS "
              "bytes/object | failover (last reply -> first read of an old object) | "
              "kill -> reply | new leader's log catch-up | adopted |", flush=True)
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
        for n in [int(x) for x in a.objects.split(",") if x]:
            r = per_object_and_failover(etcd, n, a)
            res["scale"].append(r)
            print(f"| {n:,} | {r['oplog_bytes_per_object']:.1f} | "
                  f"{r['etcd_db_bytes_per_object']:.1f} | "
                  f"{r['standby_rss_bytes_per_object']:.0f} | {r['failover_s']:.2f} s | "
                  f"{r['kill_to_reply_s']:.2f} s | {r['new_leader_catch_up_s']:.3f} s | "
                  f"{r['adopted_objects']:,} |", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
    finally:
        etcd.stop()
    return 0
