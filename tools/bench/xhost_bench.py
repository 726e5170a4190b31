"""Cross-host blocks: the transfer service against a plain TCP stream between the same hosts.

``python -m kvmaster.tools.bench xhost [--sizes-mib 1,16] [--streams 1,4] [--runs 3]``

Three network namespaces joined by a bridge (as in tests/test_multihost.py, needs root
and ``ip``): the master on host M, one client on host A that owns a segment and serves
it through its transfer service (kvmaster/transfer.py), and on host B ``max(--streams)``
client processes with no segment, so every byte they move crosses to A's service.  A
stream is one B process with its own client, hence its own connection to A's service:
processes rather than threads, because threads sharing one client would take turns on
its connection to A (one request at a time) and B's copies would share one GIL (A's
service is one thread whatever the number of streams).

Each row is a block size, a number of streams and a direction: ``get`` (B's
``get_into`` of a block stored in A's segment into a preallocated buffer, bytes A ->
B) or ``put`` (B's ``put_from`` of a block into A's segment, fresh keys, removed
after the row, bytes B -> A).  A row moves ``--budget-mib`` (split among the
streams, whole blocks), all streams starting together; its rate is the bytes over the
time from the first start to the last end.

The floor, measured in the same run between the same two namespaces: the same bytes,
block by block, over plain TCP connections, one per stream (a Python ``sendall`` /
``recv_into`` loop; A's end a thread per connection), in the same direction; and
``iperf3`` (same streams, both directions) when it is on PATH.  Each row reports the
medians over ``--runs`` of the transfer and floor GB/s (10^9 bytes/s), their ratio
(goal: 0.7 or more) and the run-by-run values; the JSON has every run, the machine and
the commit.  Bytes are checked: each get stream compares its last block with the
value stored, each put stream reads back its first and last block.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from ._timing import cpu_model

MiB = 1 << 20
HOSTS = {"m": 1, "a": 2, "b": 3}  # <prefix>.<n>: master, host A, host B
CALL_S = 120.0  # longest wait for one worker command (a row moves at most a few GiB)
GOAL = 0.7
REPO = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mib", default="1,16", help="block sizes, MiB, comma-separated")
    p.add_argument("--streams", default="1,4", help="stream counts, comma-separated")
    p.add_argument("--runs", type=int, default=3, help="runs of every row; medians reported")
    p.add_argument("--budget-mib", type=int, default=256,
                   help="bytes each row moves, MiB (split among its streams)")
    p.add_argument("--checksums", choices=["off", "on"], default="off",
                   help="object checksums (xxh3_64 written by put, verified by get): off "
                        "measures the transport alone")
    p.add_argument("--prefix", default="10.79.0", help="the hosts' /24 (private, no route out)")
    p.add_argument("--no-iperf3", action="store_true", help="skip iperf3 even if installed")
    p.add_argument("--json", default="", help="write every run here")
    p.add_argument("--md", default="", help="write the markdown table here")


# --------------------------------------------------------------- hosts and processes


def _ip(*args: str) -> str:
    try:
        r = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"`ip {' '.join(args)}`: {exc}") from None
    if r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r.stdout


class Hosts:
    """Namespaces ``kvx-<h>-<tag>`` on a bridge in ``kvx-s-<tag>``; nothing in the root
    namespace, no default route.  :meth:`destroy` deletes every namespace made."""

    def __init__(self, tag: str, prefix: str) -> None:
        self.tag, self.prefix = tag, prefix
        self.made: list[str] = []

    def ns(self, h: str) -> str:
        return f"kvx-{h}-{self.tag}"

    def addr(self, h: str) -> str:
        return f"{self.prefix}.{HOSTS[h]}"

    def create(self) -> None:
        sw = f"kvx-s-{self.tag}"
        _ip("netns", "add", sw)
        self.made.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0",
            "forward_delay", "0")
        _ip("-n", sw, "link", "set", "br0", "up")
        for h in HOSTS:
            ns = self.ns(h)
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", sw, "link", "add", f"port-{h}", "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", sw, "link", "set", f"port-{h}", "master", "br0")
            _ip("-n", sw, "link", "set", f"port-{h}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(h)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def argv(self, h: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(h), *argv]

    def destroy(self) -> None:
        for name in reversed(self.made):
            try:
                _ip("netns", "delete", name)
            except RuntimeError as exc:
                print(f"xhost: {exc}", file=sys.stderr)
        self.made.clear()


class Proc:
    """A subprocess whose stdout lines a thread reads, so every wait has a deadline."""

    def __init__(self, name: str, argv: list[str], stderr: Path) -> None:
        self.name = name
        self.stderr = stderr
        self._err: IO[str] = open(stderr, "w")  # noqa: SIM115 - closed by stop()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self._err, text=True, env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def readline(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        if not line:
            tail = self.stderr.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name}: no answer within {timeout} s "
                               f"(exit {self.p.poll()}); stderr:\n{tail}")
        return line

    def send(self, cmd: str, **args: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.p.stdin.flush()

    def answer(self, timeout: float = CALL_S) -> Any:
        reply = json.loads(self.readline(timeout))
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}\n{reply.get('traceback', '')}")
        return reply["result"]

    def call(self, cmd: str, timeout: float = CALL_S, **args: Any) -> Any:
        self.send(cmd, **args)
        return self.answer(timeout)

    def stop(self, abort: bool = False) -> None:
        """``close`` (the process ends its command first), or with ``abort`` SIGTERM at
        once; either way the client closes (A's segment file goes); SIGKILL after 5 s."""
        if self.p.poll() is None and not abort:
            try:
                self.send("close")
                self.p.wait(timeout=10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=5)
        self._err.close()


# --------------------------------------------------------------- measuring


def _together(workers: list[Proc], cmd: str, **args: Any) -> dict[str, Any]:
    """Run ``cmd`` on every worker, all starting at one instant; aggregate GB/s."""
    start_at = time.monotonic() + 0.3
    for i, w in enumerate(workers):
        w.send(cmd, start_at=start_at, **{k: (v(i) if callable(v) else v)
                                          for k, v in args.items()})
    res = [w.answer() for w in workers]
    t0, t1 = min(r["t0"] for r in res), max(r["t1"] for r in res)
    return {"gbs": sum(r["bytes"] for r in res) / (t1 - t0) / 1e9,
            "ok": all(r["ok"] for r in res), "bytes": sum(r["bytes"] for r in res)}


def _iperf3(hosts: Hosts, streams: int, op: str, work: Path) -> float:
    """iperf3's GB/s between A and B, ``streams`` parallel streams, 2 s; get: A sends."""
    port = "5299"
    srv = subprocess.Popen(hosts.argv("a", "iperf3", "-s", "-1", "-p", port,
                                      "-B", hosts.addr("a")),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        argv = ["iperf3", "-c", hosts.addr("a"), "-p", port, "-t", "2", "-P", str(streams),
                "-J", *(["-R"] if op == "get" else [])]
        r = subprocess.run(hosts.argv("b", *argv), check=False, capture_output=True,
                           text=True, timeout=30)
        out = json.loads(r.stdout)
        return out["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
    finally:
        if srv.poll() is None:
            srv.terminate()
        srv.wait(timeout=10)


def machine() -> dict[str, Any]:
    model = cpu_model()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False,
                                capture_output=True, text=True, cwd=REPO,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return {"nproc": os.cpu_count(), "cpu": model, "commit": commit}


def run(a: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(x) * MiB for x in a.sizes_mib.split(",") if x]
    streams = [int(x) for x in a.streams.split(",") if x]
    budget = a.budget_mib * MiB
    nb = max(streams)
    iperf = None if a.no_iperf3 else shutil.which("iperf3")
    # A put row holds its whole budget until its removes; the segment is split among the
    # master's shards, so it holds a row's budget in any one of them, plus the get objects.
    seg = 4 * budget + 2 * nb * sum(sizes) + 64 * MiB
    res: dict[str, Any] = {**machine(), "sizes": sizes, "streams": streams, "budget": budget,
                           "runs": a.runs, "checksums": a.checksums,
                           "streams_are": "processes", "segment": seg,
                           "iperf3": iperf or "not installed", "tag": str(os.getpid()),
                           "rows": {}}
    work = Path(tempfile.mkdtemp(prefix="kvbench-xhost-"))
    hosts = Hosts(f"{os.getpid()}", a.prefix)
    procs: list[Proc] = []
    aborted = False
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        hosts.create()
        master = Proc("master", hosts.argv("m", sys.executable, "-m", "kvmaster", "master",
                                           "--host", hosts.addr("m"), "--port", "0",
                                           "--metrics-port", "-1"), work / "master.err")
        procs.append(master)
        line = master.readline(30)
        if "listening on" not in line:
            raise RuntimeError(f"master: {line!r}")
        maddr = line.rsplit(" ", 1)[-1].strip().removeprefix("tcp://")
        worker = [sys.executable, str(Path(__file__).resolve().with_name("_xhost_worker.py")),
                  "--role"]
        pa = Proc("client@a", hosts.argv("a", *worker, "a"), work / "a.err")
        procs.append(pa)
        pbs = [Proc(f"client@b{i}", hosts.argv("b", *worker, "b"), work / f"b{i}.err")
               for i in range(nb)]
        procs += pbs
        for p in procs[1:]:
            p.readline(30)  # ready
        check = a.checksums == "on"
        sa = pa.call("setup", CALL_S + 300, master=maddr, host="host-a",
                     transfer_host=hosts.addr("a"), segment=seg, checksums=check,
                     max_block=max(sizes))
        res["populate_s"] = sa["populate_s"]
        for p in pbs:
            p.call("setup", master=maddr, host="host-b", transfer_host=hosts.addr("b"),
                   segment=0, checksums=check, max_block=max(sizes))
        pa.call("store", items=[[f"g-{s}-{i}", s] for s in sizes for i in range(nb)])
        bad: list[str] = []
        for r in range(a.runs):
            for size in sizes:
                for n in streams:
                    count = max(1, budget // (size * n))
                    for op in ("get", "put"):
                        row = res["rows"].setdefault(f"{size}/{n}/{op}", {
                            "transfer": [], "floor": [], "iperf3": []})
                        for what in (("floor", "transfer") if r % 2 == 0
                                     else ("transfer", "floor")):
                            if what == "transfer":
                                m = _together(pbs[:n], "transfer", op=op, size=size,
                                              count=count, segment=sa["segment"],
                                              key=(lambda i, s=size, o=op, rr=r, nn=n:
                                                   f"g-{s}-{i}" if o == "get"
                                                   else f"p-{s}-{nn}-{rr}-{i}"))
                            else:
                                m = _together(pbs[:n], "tcp", op=op, host=hosts.addr("a"),
                                              port=sa["floor_port"], size=size, count=count)
                            row[what].append(m["gbs"])
                            row.setdefault("bytes", m["bytes"])
                            if not m["ok"]:
                                bad.append(f"{what} {size // MiB} MiB x{n} {op} run {r}")
                        if iperf and size == sizes[0]:
                            row["iperf3"].append(_iperf3(hosts, n, op, work))
        res["wrong_bytes"] = bad
        if bad:
            raise RuntimeError(f"wrong bytes read back: {bad}")
    except BaseException:
        aborted = True
        raise
    finally:
        for p in reversed(procs):
            p.stop(aborted)
        hosts.destroy()
        signal.signal(signal.SIGTERM, old)
        shutil.rmtree(work, ignore_errors=True)
    return res


def table(res: dict[str, Any]) -> list[str]:
    lines = [("| block | streams | direction | transfer GB/s | floor GB/s | ratio | "
              f"within {GOAL} | transfer per run | floor per run |"),
             "|---|---:|---|---:|---:|---:|---|---|---|"]
    for name, row in res["rows"].items():
        size, n, op = name.split("/")
        t, f = statistics.median(row["transfer"]), statistics.median(row["floor"])
        per_t = ", ".join(f"{x:.2f}" for x in row["transfer"])
        per_f = ", ".join(f"{x:.2f}" for x in row["floor"])
        lines.append(f"| {int(size) // MiB} MiB | {n} | {op} | {t:.2f} | {f:.2f} | "
                     f"{t / f:.2f} | {'yes' if t / f >= GOAL else 'NO'} | {per_t} | {per_f} |")
    iperf = [(k, v["iperf3"]) for k, v in res["rows"].items() if v["iperf3"]]
    lines.append("")
    if iperf:
        lines.append("iperf3 GB/s (median): " + ", ".join(
            f"{k.split('/')[1]} streams {k.split('/')[2]} {statistics.median(v):.2f}"
            for k, v in iperf))
    else:
        lines.append(f"iperf3: {res['iperf3']}.")
    lines.append(f"Floor: plain TCP, one connection per stream, a Python sendall/recv_into "
                 f"loop of the same blocks.  Streams are B client processes.  Checksums "
                 f"{res['checksums']}; {res['budget'] // MiB} MiB a row; {res['runs']} runs.  "
                 f"Machine: {res['nproc']} CPUs, {res['cpu']}; commit {res['commit']}.")
    return lines


def cmd_xhost(a: argparse.Namespace) -> int:
    res = run(a)
    md = "\n".join(table(res))
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    if a.md:
        Path(a.md).write_text(md + "\n")
    return 0
