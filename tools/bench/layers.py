"""Where one is_exist's latency goes, layer by layer, on one machine state.

``python -m kvmaster.tools.bench.layers [--rounds 3] [--n 5000] [--pin] [--ipc]
[--waits -1,2,20,poll,fd]``

Starts a lean echo server (``_echo.py --mode uvloop --lean``) and a fresh master,
then one client process measures, round after round (interleaved, so every layer
sees the same machine state), the p50 of:

* ``echo``: a lean DEALER round trip to the echo server (the transport floor);
* ``raw heartbeat``: a HEARTBEAT frame to the master over the client's socket
  (front only, no shard);
* ``raw is_exist``: an EXIST_KEY frame (front and one shard, no client library);
* ``client is_exist``: ``Client.is_exist`` (adds the client library);
* with ``--waits``, ``raw is_exist`` again for each way of waiting for the reply
  (a blocking receive with a given RCVTIMEO, ``zmq_poll`` then a non-blocking
  receive, or EVENTS and ``select.poll`` on the socket's FD as the client does).

With ``--pin`` every process runs on CPU 0 (``taskset -c 0``), like the store
benchmark's pinned tables; with ``--ipc`` the master also binds a Unix socket
and the client and echo use ipc.  The differences between the rows attribute the
latency to the front, the shard and the client library.  Prints a markdown table
of medians over rounds (µs).  To compare two checkouts, run it twice with
``PYTHONPATH`` pointing at each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .store_bench import _read_line

HERE = Path(__file__).resolve().parent
ROWS = ("echo", "raw heartbeat", "raw is_exist", "client is_exist")
LABELS = {"echo": "echo (lean I/O, uvloop server, TCP)",
          "raw heartbeat": "raw heartbeat (front only)",
          "raw is_exist": "raw is_exist (front and one shard)",
          "client is_exist": "client is_exist (Client.is_exist)"}

_WORKER = r"""
import json, sys, time, msgpack
from kvmaster import Client, protocol as P
from kvmaster._frames import recv_frames, send_frames
import zmq

master, echo, n, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
waits = [w for w in sys.argv[5].split(",") if w]
c = Client()
c.setup(master, 16 << 20)
keys = [f"k{i}" for i in range(256)]
c.put_batch(keys, [b"v" * 64] * 256)
bkeys = [k.encode() for k in keys]
w = c.welcome
routes = [P.route_for_shard(P.shard_of(k, w.seed, w.shard_count)) for k in bkeys]
sock = c._sock
ctx = zmq.Context()
es = ctx.socket(zmq.DEALER)
es.connect(echo)
exist, hb = P.Op.EXIST_KEY.value, P.Op.HEARTBEAT.value
frames = (exist, routes[0], b"x" * 20)

def p50(fn):
    for i in range(300):
        fn(i)
    lat = []
    for i in range(n):
        t = time.perf_counter_ns()
        fn(i)
        lat.append(time.perf_counter_ns() - t)
    lat.sort()
    return lat[len(lat) // 2] / 1000

def echo_rt(i):
    send_frames(es, frames)
    recv_frames(es)

def recv(s):
    while True:  # the client's socket has a short RCVTIMEO (its first wait)
        try:
            return recv_frames(s)
        except zmq.Again:
            pass

def raw_hb(i):
    send_frames(sock, (hb, P.MASTER_ROUTE, msgpack.packb([i + 1])))
    recv(sock)

def raw_exist(i):
    send_frames(sock, (exist, routes[i & 255], msgpack.packb([i + 1, bkeys[i & 255]])))
    recv(sock)

def raw_exist_poll(i):
    send_frames(sock, (exist, routes[i & 255], msgpack.packb([i + 1, bkeys[i & 255]])))
    while not (zmq.zmq_poll([(sock, zmq.POLLIN)], 10000) and recv_frames(sock, zmq.NOBLOCK)):
        pass

import select
from kvmaster._frames import readable
fd_poller = select.poll()
fd_poller.register(sock.getsockopt(zmq.FD), select.POLLIN)

def raw_exist_fd(i):
    send_frames(sock, (exist, routes[i & 255], msgpack.packb([i + 1, bkeys[i & 255]])))
    while not readable(sock):
        fd_poller.poll(10000)
    recv_frames(sock, zmq.NOBLOCK)

def client_exist(i):
    c.is_exist(keys[i & 255])

def with_rcvtimeo(ms):
    def measure(_fn):
        sock.setsockopt(zmq.RCVTIMEO, ms)
        try:
            return p50(raw_exist)
        finally:
            sock.setsockopt(zmq.RCVTIMEO, kept)
    return measure

kept = sock.getsockopt(zmq.RCVTIMEO)
layers = [("echo", echo_rt, p50), ("raw heartbeat", raw_hb, p50), ("raw is_exist", raw_exist, p50),
          ("client is_exist", client_exist, p50)]
for w in waits:
    layers.append((f"raw is_exist, wait {w}", raw_exist_poll, p50) if w == "poll" else
                  (f"raw is_exist, wait {w}", raw_exist_fd, p50) if w == "fd" else
                  (f"raw is_exist, wait {w}", raw_exist, with_rcvtimeo(int(w))))
out = {name: [] for name, _, _ in layers}
with c._lock:  # keep the heartbeat thread off the socket while raw frames are in flight
    for _ in range(rounds):
        for name, fn, measure in layers:
            out[name].append(measure(fn))
es.close(0)
ctx.term()
c.close()
print(json.dumps(out))
"""


def _start(cmd: list[str], marker: str) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = _read_line(proc, 30.0)
    if marker not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{cmd[:4]} did not start: {line!r}")
    return proc, line.split(marker, 1)[1].strip()


def run(a: argparse.Namespace) -> dict[str, list[float]]:
    pin = ["taskset", "-c", "0"] if a.pin else []
    tmp = Path(tempfile.mkdtemp(prefix="kvlayers-"))
    master_cmd = pin + [sys.executable, "-m", "kvmaster", "master", "--port", "0",
                        "--metrics-port", "-1"]
    if a.ipc:
        master_cmd += ["--ipc-path", str(tmp / "master.sock")]
    procs = []
    try:
        m, endpoint = _start(master_cmd, "kvmaster master listening on ")
        procs.append(m)
        e, echo_ep = _start(pin + [sys.executable, str(HERE / "_echo.py"), "--mode", "uvloop",
                                   "--lean"], "echo listening on ")
        procs.append(e)
        if a.ipc:
            endpoint = f"ipc://{tmp / 'master.sock'}"
            # The echo server binds TCP only; its floor over ipc is not measured here.
        r = subprocess.run(pin + [sys.executable, "-c", _WORKER, endpoint, echo_ep, str(a.n),
                                  str(a.rounds), a.waits], capture_output=True, text=True,
                           timeout=600)
        if r.returncode:
            raise RuntimeError(f"worker failed: {r.stderr[-2000:]}")
        return json.loads(r.stdout)
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
            if p.stdout:
                p.stdout.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmaster.tools.bench.layers",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    p.add_argument("--n", type=int, default=5000, help="calls per layer per round")
    p.add_argument("--pin", action="store_true", help="every process on CPU 0")
    p.add_argument("--ipc", action="store_true",
                   help="master also on ipc; the client uses it (echo stays on TCP)")
    p.add_argument("--waits", default="", metavar="LIST",
                   help="extra raw is_exist rows, one per way of waiting for the reply: "
                        "a number is a blocking receive with that RCVTIMEO (ms; -1 = none), "
                        "'poll' is zmq_poll then a non-blocking receive, 'fd' is EVENTS and "
                        "select.poll on the socket's FD as the client does "
                        "(e.g. -1,2,20,poll,fd)")
    a = p.parse_args(argv)
    t0 = time.strftime("%Y-%m-%d %H:%M:%S")
    res = run(a)
    print(f"Layers of one is_exist ({'pinned' if a.pin else 'unpinned'}"
          f"{', client over ipc' if a.ipc else ''}), started {t0}, "
          f"median of {a.rounds} interleaved rounds of {a.n} calls, p50 µs"
          f"{' (the echo stays on TCP, so the next row can be lower)' if a.ipc else ''}:\n")
    print("| layer | p50 µs | added over the row above |")
    print("|---|---|---|")
    prev = None
    for name in ROWS:
        v = statistics.median(res[name])
        print(f"| {LABELS[name]} | {v:.1f} | {'' if prev is None else f'{v - prev:+.1f}'} |")
        prev = v
    extra = [name for name in res if name not in ROWS]
    if extra:
        base = statistics.median(res["raw is_exist"])
        print("\nWays of waiting for the reply (raw is_exist; the client checks EVENTS, "
              "then polls the socket's FD):\n")
        print("| wait | p50 µs | vs raw is_exist |")
        print("|---|---|---|")
        for name in extra:
            v = statistics.median(res[name])
            label = name.split("wait ", 1)[1]
            label = ("zmq_poll, then a non-blocking receive" if label == "poll" else
                     "EVENTS, select.poll on the socket's FD, non-blocking receive "
                     "(as Client)" if label == "fd" else
                     f"blocking receive, RCVTIMEO {label} ms")
            print(f"| {label} | {v:.1f} | {v - base:+.1f} |")
    print(f"\nPer round: {json.dumps({k: [round(x, 1) for x in v] for k, v in res.items()})}")
    print(f"Load average at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
