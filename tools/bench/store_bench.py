"""``store``: store operations, kvmaster vs the Mooncake Store master, in one run
(the command line of every benchmark: :mod:`kvmaster.tools.bench.cli`).

``python -m kvmaster.tools.bench store [--quick] [--runs N] [--pin [on|off|both]]
[--json out.json] [--md out.md]``

The driver (this process) never touches a store itself.  For every run and
every scenario group it starts a fresh master of each system, runs
``worker.py`` against it in a child process (kvmaster's under this
interpreter, Mooncake's under the Mooncake venv's interpreter), stops the
master and collects the worker's JSON.  The order of the two systems
alternates from run to run.  Each cell of the tables is the median over runs.

Groups: ``single`` (1 client, one call at a time: put 4 KiB, is_exist hit,
get 4 KiB, remove), ``batch`` (1 client, 4 KiB values, batch sizes 64 and
1024), ``memory`` (master RSS and CPU for 100,000 objects of 256 B inserted
with put_batch of 1000), and ``echo`` (raw pyzmq DEALER->ROUTER round trip,
a floor for single-op latency; not a store).

With ``--pin`` the master (all its threads, via ``taskset`` at exec) and the
worker run on CPU 0, like the anchor's pinned runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import selectors
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import _timing as T

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
ECHO = HERE / "_echo.py"
# The anchors (../shared/anchors next to the repository; KVMASTER_SHARED overrides)
# and their venvs (the anchors' install.sh defaults; MC_VENV / REDIS_VENV override).
SHARED = Path(os.environ.get("KVMASTER_SHARED")
              or Path(__file__).resolve().parents[2].parent / "shared")
MC_ANCHOR_DIR = SHARED / "anchors" / "mooncake"
MC_PYTHON = Path(os.environ.get("MC_VENV", "/tmp/mcvenv")) / "bin" / "python"

SYSTEMS = ("kvmaster", "mooncake")
LABEL = {"kvmaster": "kvmaster", "mooncake": "Mooncake", "kvmaster-ipc": "kvmaster (ipc)"}
#: Also run in the single group: kvmaster's client over the master's ipc endpoint.
SINGLE_EXTRA = ("kvmaster-ipc",)
#: With ``--integrity``, also run in the batch group: kvmaster's client with checksums
#: off, and both with the objects in a peer's segment (another client's, read and
#: written with pread/pwrite) instead of the benchmark client's own.
INTEGRITY_EXTRA = ("kvmaster-nocsum", "kvmaster-peer", "kvmaster-peer-nocsum")
INTEGRITY_LABEL = {"kvmaster": "own segment, checksums on",
                   "kvmaster-nocsum": "own segment, checksums off",
                   "kvmaster-peer": "peer's segment, checksums on",
                   "kvmaster-peer-nocsum": "peer's segment, checksums off"}
ECHOES = ("zmqecho-blocking", "zmqecho-uvloop", "zmqlean-blocking", "zmqlean-uvloop",
          "tcpecho-blocking")
ECHO_LABEL = {"zmqecho-blocking": "pyzmq ROUTER, blocking loop",
              "zmqecho-uvloop": "pyzmq ROUTER on uvloop (add_reader)",
              "zmqlean-blocking": "pyzmq, lean frame I/O both sides, blocking loop",
              "zmqlean-uvloop": "pyzmq, lean frame I/O both sides, uvloop (as kvmaster)",
              "tcpecho-blocking": "plain TCP socket, blocking (no ZeroMQ)"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin_prefix(pin: bool) -> list[str]:
    return ["taskset", "-c", "0"] if pin else []


# ----------------------------------------------------------------- masters

class Master:
    """A master (or echo server) process started fresh and stopped by its pid."""

    def __init__(self, kind: str, pin: bool, workdir: Path, extra: list[str] | None = None) -> None:
        self.kind = kind
        self.pin = pin
        self.workdir = workdir
        self.extra = extra or []
        self.pid = 0
        self.addr = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._env: dict[str, str] = {}

    def __enter__(self) -> Master:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.kind == "mooncake":
            self._start_mooncake(timeout)
            return
        if self.kind in ("kvmaster", "kvmaster-ipc", *INTEGRITY_EXTRA):
            cmd = [sys.executable, "-m", "kvmaster", "master", "--port", "0", *self.extra]
            if self.kind == "kvmaster-ipc":
                cmd += ["--ipc-path", str(self.workdir / "master.sock")]
            marker = "kvmaster master listening on "
        else:  # zmqecho-<mode>, zmqlean-<mode> or tcpecho-blocking
            mode = self.kind.split("-", 1)[1] if self.kind.startswith("zmq") else "tcp"
            cmd = [sys.executable, str(ECHO), "--mode", mode]
            if self.kind.startswith("zmqlean"):
                cmd.append("--lean")
            marker = "echo listening on "
        log = open(self.workdir / f"{self.kind}.log", "wb")
        self._proc = subprocess.Popen(_pin_prefix(self.pin) + cmd, stdout=subprocess.PIPE,
                                      stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        self.pid = self._proc.pid
        line = _read_line(self._proc, timeout)
        if marker not in line:
            self.stop()
            raise RuntimeError(f"{self.kind} did not start (stdout {line!r}); "
                               f"see {self.workdir / (self.kind + '.log')}")
        self.addr = line.split(marker, 1)[1].strip().removeprefix("tcp://")
        if self.kind == "kvmaster-ipc":
            self.addr = f"ipc://{self.workdir / 'master.sock'}"

    def _start_mooncake(self, timeout: float) -> None:
        rpc = _free_port()
        env = dict(os.environ, MC_RUN_DIR=str(self.workdir), MC_RPC_PORT=str(rpc),
                   MC_METRICS_PORT=str(_free_port()), MC_VENV=str(MC_PYTHON.parent.parent))
        self._env = env
        r = subprocess.run(_pin_prefix(self.pin) + ["bash", str(MC_ANCHOR_DIR / "start_master.sh"),
                                                    *self.extra],
                           env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"Mooncake master did not start: {r.stdout} {r.stderr}")
        self.pid = int((self.workdir / "master.pid").read_text().strip())
        self.addr = f"127.0.0.1:{rpc}"

    def stop(self, timeout: float = 15.0) -> None:
        if self.kind == "mooncake":
            if self._env:
                subprocess.run(["bash", str(MC_ANCHOR_DIR / "stop_master.sh")], env=self._env,
                               capture_output=True, timeout=timeout)
                self._env = {}
            return
        p = self._proc
        if p is None:
            return
        self._proc = None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if p.stdout is not None:
            p.stdout.close()

    def cpus_allowed(self) -> str:
        try:
            return T.proc_status(self.pid, "Cpus_allowed_list")
        except OSError:
            return "?"


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """First stdout line of ``proc``, waiting at most ``timeout`` seconds."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + timeout
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
    finally:
        sel.close()
    return buf.decode(errors="replace").split("\n", 1)[0]


# ------------------------------------------------------------------ workers

def run_worker(system: str, scenario: str, master: Master, run_id: int, cfg: argparse.Namespace,
               workdir: Path, client: str = "default") -> dict[str, Any]:
    python = str(MC_PYTHON) if system == "mooncake" else sys.executable
    out = workdir / f"{system}-{scenario}-{run_id}.json"
    log = workdir / f"{system}-{scenario}-{run_id}.log"
    cmd = _pin_prefix(cfg.pinned) + [
        python, str(WORKER), "--system", system, "--scenario", scenario,
        "--addr", master.addr, "--master-pid", str(master.pid), "--run-id", str(run_id),
        "--n", str(cfg.n), "--batch-keys", str(cfg.batch_keys),
        "--batch-sizes", ",".join(map(str, cfg.batch_sizes)),
        "--mem-objects", str(cfg.mem_objects), "--deadline", str(cfg.deadline), "--out", str(out)]
    if client != "default":
        cmd += ["--client", client]
    with open(log, "wb") as lf:
        r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           timeout=cfg.worker_timeout, cwd=str(workdir))
    if r.returncode != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"worker {system}/{scenario} failed (rc={r.returncode}):\n{tail}")
    data = json.loads(out.read_text())
    data["meta"]["master_cpus_allowed"] = master.cpus_allowed()
    return data


# --------------------------------------------------------------- orchestration

def bench_mode(cfg: argparse.Namespace, pinned: bool, root: Path) -> dict[str, Any]:
    """All runs of all groups for one pinning mode; raw per-run results.

    Before each (run, group) the machine is checked for other work (see
    ``--wait-quiet``); both systems of a group then run back to back.
    """
    cfg.pinned = pinned
    mode = "pinned" if pinned else "unpinned"
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    loads: list[list[float]] = []
    busy: dict[str, list[float]] = {}
    for run in range(cfg.runs):
        loads.append([round(x, 2) for x in os.getloadavg()])
        order = SYSTEMS if run % 2 == 0 else SYSTEMS[::-1]
        for group in cfg.groups:
            busy.setdefault(group, []).append(round(wait_quiet(cfg), 3))
            systems = (ECHOES if group == "echo" else
                       order + SINGLE_EXTRA if group == "single" else
                       order + INTEGRITY_EXTRA if group == "batch" and cfg.integrity else order)
            systems = tuple(s for s in systems if s != "mooncake" or not cfg.no_anchor)
            for system in systems:
                wd = root / mode / f"run{run}" / f"{group}-{system}"
                t0 = time.monotonic()
                extra = cfg.kv_args if system.startswith("kvmaster") else None
                with Master(system, pinned, wd, extra) as m:
                    worker_sys = system.split("-", 1)[0]
                    client = system.split("-", 1)[1] if system in INTEGRITY_EXTRA else "default"
                    data = run_worker(worker_sys, group, m, run, cfg, wd, client)
                data["meta"]["loadavg_after"] = list(os.getloadavg())
                raw.setdefault(group, {}).setdefault(system, []).append(data)
                label = LABEL.get(system, system)
                print(f"[{mode}] run {run + 1}/{cfg.runs} {group:<6} {label:<16}"
                      f" {time.monotonic() - t0:5.1f}s  load {os.getloadavg()[0]:.2f}",
                      file=sys.stderr, flush=True)
    loads.append([round(x, 2) for x in os.getloadavg()])
    return {"raw": raw, "loadavg": loads, "busy_before": busy}


def machine_busy(window_s: float = 2.0) -> float:
    """Fraction of all CPUs busy over ``window_s`` (from /proc/stat), while this
    tool itself is idle: a measure of what else is running."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals), idle

    t0, i0 = sample()
    time.sleep(window_s)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / (t1 - t0) if t1 > t0 else 0.0


def wait_quiet(cfg: argparse.Namespace) -> float:
    """Wait until other processes use under ``cfg.quiet_busy`` of the machine,
    at most ``cfg.wait_quiet`` seconds this time and ``cfg.wait_total`` seconds
    over the whole command; returns the last busy fraction seen."""
    if not hasattr(cfg, "_wait_left"):
        cfg._wait_left = cfg.wait_total
    busy = machine_busy()
    deadline = time.monotonic() + min(cfg.wait_quiet, cfg._wait_left)
    t0 = time.monotonic()
    while busy >= cfg.quiet_busy and time.monotonic() < deadline:
        print(f"machine {busy:.0%} busy with other work; waiting", file=sys.stderr, flush=True)
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
        busy = machine_busy()
    cfg._wait_left = max(0.0, cfg._wait_left - (time.monotonic() - t0))
    return busy


def aggregate(raw: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """group -> system -> row -> median-of-runs summary."""
    agg: dict[str, Any] = {}
    for group, by_sys in raw.items():
        for system, runs in by_sys.items():
            rows = runs[0]["results"].keys()
            agg.setdefault(group, {})[system] = {
                row: T.median_of_runs([r["results"][row] for r in runs]) for row in rows}
    return agg


# ------------------------------------------------------------------ markdown

def _num(x: Any, nd: int = 1) -> str:
    if not isinstance(x, (int, float)) or x != x:
        return "n/a"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{nd}f}"


def _ratio(a: Any, b: Any) -> str:
    try:
        return f"{a / b:.2f}x" if b else "n/a"
    except TypeError:
        return "n/a"


def _cells(kv: dict[str, Any], mc: dict[str, Any], field: str, nd: int = 1) -> list[str]:
    a, b = kv.get(field), mc.get(field)
    return [_num(a, nd), _num(b, nd), _ratio(a, b)]


def run_ratios(group: dict[str, list[dict[str, Any]]], field: str = "keys_s"
               ) -> dict[str, list[float]]:
    """kvmaster's ``field`` over Mooncake's per row, run by run (the two systems of a run
    run back to back, seconds apart, so a slower or faster phase of the VM that lasts
    longer than that moves both): ``row -> [ratio of each run]``."""
    out: dict[str, list[float]] = {}
    for kv, mc in zip(group.get("kvmaster", []), group.get("mooncake", [])):
        for row, r in (kv.get("results") or {}).items():
            x, y = r.get(field), ((mc.get("results") or {}).get(row) or {}).get(field)
            if x and y:
                out.setdefault(row, []).append(x / y)
    return out


def ratio_line(ratios: list[float], need: float) -> str:
    """'2.10x, 1.85x, 2.31x (median 2.10x; >= 2x in 2 of 3 runs)'."""
    met = sum(r >= need for r in ratios)
    return (", ".join(f"{r:.2f}x" for r in ratios) + f" (median {statistics.median(ratios):.2f}x;"
            f" >= {need:g}x in {met} of {len(ratios)} runs)")


def tables(agg: dict[str, Any], title: str) -> str:
    out = [f"### {title}", ""]
    if "single" in agg:
        kvs, mcs = agg["single"]["kvmaster"], agg["single"]["mooncake"]
        out += ["Single-op, 1 client, one call at a time. Latency ratio = kvmaster/Mooncake "
                "(<1 = kvmaster faster); ops/s ratio >1 = kvmaster faster.", "",
                "| op | p50 µs kvmaster | p50 µs Mooncake | p50 ratio | p99 µs kvmaster | "
                "p99 µs Mooncake | p99 ratio | ops/s kvmaster | ops/s Mooncake | ops/s ratio | "
                "master CPU µs/op kvmaster | master CPU µs/op Mooncake |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for op in kvs:
            kv, mc = kvs[op], mcs.get(op, {})
            out.append("| " + " | ".join([op, *_cells(kv, mc, "p50_us"), *_cells(kv, mc, "p99_us"),
                                          *_cells(kv, mc, "ops_s"),
                                          _num(kv.get("master_cpu_us_per_op")),
                                          _num(mc.get("master_cpu_us_per_op"))]) + " |")
        errs = {s: sum(int(r.get("errors", 0)) for r in agg["single"][s].values()) for s in SYSTEMS}
        out += ["", f"Errors (median-run sum): kvmaster {errs['kvmaster']}, "
                    f"Mooncake {errs['mooncake']}.", ""]
        ipc = agg["single"].get("kvmaster-ipc")
        if ipc:
            out += ["The same ops with kvmaster's client connected to the master's ipc endpoint "
                    "(`--ipc-path`, a Unix socket; Mooncake's master has TCP only).", "",
                    "| op | p50 µs kvmaster (ipc) | p50 µs Mooncake | p50 ratio | "
                    "p99 µs kvmaster (ipc) | p99 µs Mooncake | p99 ratio |",
                    "|---|---|---|---|---|---|---|"]
            for op in ipc:
                kv, mc = ipc[op], mcs.get(op, {})
                out.append("| " + " | ".join([op, *_cells(kv, mc, "p50_us"),
                                              *_cells(kv, mc, "p99_us")]) + " |")
            out.append("")
    if "batch" in agg:
        kvs, mcs = agg["batch"]["kvmaster"], agg["batch"]["mooncake"]
        out += ["Batch ops, 1 client, 4 KiB values. keys/s ratio >1 = kvmaster faster.", "",
                "| batch | op | keys/s kvmaster | keys/s Mooncake | keys/s ratio | "
                "batch p50 µs kvmaster | batch p50 µs Mooncake | p50 ratio | "
                "master CPU µs/key kvmaster | master CPU µs/key Mooncake |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for row in kvs:
            kv, mc = kvs[row], mcs.get(row, {})
            bs, op = row.split("/", 1)
            out.append("| " + " | ".join([bs, op, *_cells(kv, mc, "keys_s"),
                                          *_cells(kv, mc, "batch_p50_us"),
                                          _num(kv.get("master_cpu_us_per_key"), 2),
                                          _num(mc.get("master_cpu_us_per_key"), 2)]) + " |")
        errs = {s: sum(int(r.get("errors", 0)) for r in agg["batch"][s].values()) for s in SYSTEMS}
        out += ["", f"Errors: kvmaster {errs['kvmaster']}, Mooncake {errs['mooncake']}.", ""]
    if "compat" in agg:
        kvs, mcs = agg["compat"]["kvmaster"], agg["compat"]["mooncake"]
        out += ["Mooncake's API on both systems (kvmaster through `kvmaster.compat`, "
                "Mooncake through `mooncake.store`), 1 client. Multi-buffer rows: each key "
                "gathered from and scattered to registered buffers, as vLLM's connector "
                "saves and loads. keys/s ratio >1 = kvmaster faster.", "",
                "| batch | op | keys/s kvmaster | keys/s Mooncake | keys/s ratio | "
                "GB/s kvmaster | GB/s Mooncake | batch p50 µs kvmaster | "
                "batch p50 µs Mooncake | p50 ratio |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for row in kvs:
            kv, mc = kvs[row], mcs.get(row, {})
            bs, op = row.split("/", 1)
            out.append("| " + " | ".join([bs, op, *_cells(kv, mc, "keys_s"),
                                          _num(kv.get("gb_s"), 2), _num(mc.get("gb_s"), 2),
                                          *_cells(kv, mc, "batch_p50_us")]) + " |")
        errs = {s: sum(int(r.get("errors", 0)) for r in agg["compat"][s].values())
                for s in SYSTEMS}
        out += ["", f"Errors: kvmaster {errs['kvmaster']}, Mooncake {errs['mooncake']}.", ""]
    if "memory" in agg:
        kv, mc = agg["memory"]["kvmaster"]["memory"], agg["memory"]["mooncake"]["memory"]
        mib = 1 << 20
        out += [f"Master memory and CPU for {int(kv['objects']):,} objects of 256 B "
                "(put_batch of 1000, fresh master, 256 MiB segment). Ratio <1 = kvmaster "
                "leaner, except keys/s.", "",
                "| measure | kvmaster | Mooncake | ratio |", "|---|---|---|---|",
                "| master RSS before, MiB | " + " | ".join(
                    [_num(kv["rss_before_bytes"] / mib), _num(mc["rss_before_bytes"] / mib),
                     _ratio(kv["rss_before_bytes"], mc["rss_before_bytes"])]) + " |",
                "| master RSS after, MiB | " + " | ".join(
                    [_num(kv["rss_after_bytes"] / mib), _num(mc["rss_after_bytes"] / mib),
                     _ratio(kv["rss_after_bytes"], mc["rss_after_bytes"])]) + " |",
                "| **master bytes per object** | " + " | ".join(
                    _cells(kv, mc, "bytes_per_object", 0)) + " |",
                "| master CPU µs per key inserted (utime+stime) | " + " | ".join(
                    _cells(kv, mc, "master_cpu_us_per_key", 2)) + " |",
                "| insert keys/s (client view) | " + " | ".join(
                    _cells(kv, mc, "insert_keys_s")) + " |",
                "", f"Batch errors: kvmaster {kv['batch_errors']:.0f}, Mooncake "
                    f"{mc['batch_errors']:.0f}; objects present afterwards (1,000-key probe): "
                    f"kvmaster {kv['probe_present_frac']:.0%}, Mooncake "
                    f"{mc['probe_present_frac']:.0%}.", ""]
    if "echo" in agg:
        out += ["Transport floor: echo round trip of an is_exist-sized message from a Python "
                "client, same pinning. pyzmq: DEALER client (3 frames, ~20 B payload, send "
                "and a blocking recv bounded by RCVTIMEO, like kvmaster's client) against a ROUTER echo server, either a plain "
                "blocking loop or the ROUTER FD on a uvloop event loop as in kvmaster's master. "
                "The pyzmq rows use send_multipart/recv_multipart on both sides; the lean rows "
                "use kvmaster._frames on both sides, as kvmaster's client and master do. "
                "The plain-TCP row has no ZeroMQ (one send, one recv per side).", "",
                "| echo server | p50 µs | p99 µs | round trips/s | server CPU µs/round trip |"
                + (" share of kvmaster is_exist p50 |" if "single" in agg else ""),
                "|---|---|---|---|---|" + ("---|" if "single" in agg else "")]
        kv_exist = agg.get("single", {}).get("kvmaster", {}).get("is_exist_hit", {}).get("p50_us")
        for system, rows in agg["echo"].items():
            e = rows["echo"]
            cells = [ECHO_LABEL.get(system, system), _num(e["p50_us"]), _num(e["p99_us"]),
                     _num(e["ops_s"]), _num(e["master_cpu_us_per_op"])]
            if "single" in agg:
                cells.append(f"{e['p50_us'] / kv_exist:.0%}" if kv_exist else "n/a")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def tree_commit() -> tuple[str, bool] | None:
    """``(short commit, kvmaster/ has local edits)`` of the kvmaster tree being measured
    (the one ``import kvmaster`` finds, e.g. another checkout on ``PYTHONPATH``, not this
    tool's); None when git cannot tell."""
    import kvmaster

    root = Path(kvmaster.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "kvmaster"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head, bool(dirty)


def code_version() -> str:
    """:func:`tree_commit` as text: the commit, marked if kvmaster/ has local edits."""
    tree = tree_commit()
    if tree is None:
        return "unknown"
    head, dirty = tree
    return f"{head or 'unknown'}{' + uncommitted changes in kvmaster/' if dirty else ''}"


def machine_notes() -> str:
    model = T.cpu_model() or "?"
    total = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                total = f"{int(line.split()[1]) / (1 << 20):.0f} GiB"
    except OSError:
        pass
    return (f"{os.cpu_count()} vCPU {model}, {total} RAM, kernel {platform.release()}, "
            f"Python {platform.python_version()}")


# ---------------------------------------------------------------- commands

def integrity_table(agg: dict[str, Any]) -> str:
    """The batch rows of kvmaster with checksums on and off, own segment and a peer's
    (``--integrity``): keys/s, and the client's CPU µs per key (the calling thread's
    user + system time: less swayed by other work on the machine), with their ratios
    to own segment, checksums off."""
    batch = agg.get("batch", {})
    if not all(s in batch for s in INTEGRITY_LABEL):
        return ""
    base = batch["kvmaster-nocsum"]
    others = [s for s in INTEGRITY_LABEL if s != "kvmaster-nocsum"]
    out = ["Integrity A/B (kvmaster only), 1 client, 4 KiB values: the batch rows with "
           "checksums on and off, the objects in the benchmark client's own segment "
           "(copies through its mapping) or in a peer's (another client's segment: "
           "pread/pwrite). Ratios to own segment, checksums off (the code before "
           "checksums copied a peer's segment through a mapping as it does its own).", ""]
    for field, what, nd in (("keys_s", "keys/s", 1), ("client_cpu_us_per_key",
                                                       "client CPU µs/key", 2)):
        out += ["| batch | op | " + " | ".join(f"{what} {INTEGRITY_LABEL[s]}"
                                               for s in INTEGRITY_LABEL)
                + " | " + " | ".join(f"ratio {INTEGRITY_LABEL[s]}" for s in others) + " |",
                "|---|---|" + "---|" * (len(INTEGRITY_LABEL) + len(others))]
        for row in base:
            bs, op = row.split("/", 1)
            cells = [_num(batch[s].get(row, {}).get(field), nd) for s in INTEGRITY_LABEL]
            ratios = [_ratio(batch[s].get(row, {}).get(field), base[row].get(field))
                      for s in others]
            out.append("| " + " | ".join([bs, op, *cells, *ratios]) + " |")
        out.append("")
    return "\n".join(out)


def integrity_run_ratios(batch: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Checksums on over off, client CPU µs per key, run by run (the four systems of a
    run ran back to back), own segment and a peer's."""
    out: list[str] = []
    for on, off, where in (("kvmaster", "kvmaster-nocsum", "own segment"),
                           ("kvmaster-peer", "kvmaster-peer-nocsum", "peer's segment")):
        if len(batch.get(on, [])) < 2 or on not in batch or off not in batch:
            continue
        for row in batch[on][0]["results"]:
            f = "client_cpu_us_per_key"
            rs = [x["results"][row][f] / y["results"][row][f]
                  for x, y in zip(batch[on], batch[off])
                  if x["results"].get(row, {}).get(f) and y["results"].get(row, {}).get(f)]
            if rs:
                out.append(f"* {where}, {row}, checksums on / off: "
                           + ", ".join(f"{r:.2f}x" for r in rs)
                           + f" (median {statistics.median(rs):.2f}x)")
    return (["Client CPU µs/key with checksums on / off, run by run:", "", *out, ""]) \
        if out else []


def cmd_store(a: argparse.Namespace) -> int:
    if not a.no_anchor and not MC_PYTHON.exists():
        print(f"{MC_PYTHON} not found; run {MC_ANCHOR_DIR / 'install.sh'}", file=sys.stderr)
        return 2
    a.n = a.n or (1000 if a.quick else 5000)
    a.batch_keys = a.batch_keys or (4096 if a.quick else 16384)
    a.mem_objects = a.mem_objects or (20_000 if a.quick else 100_000)
    a.batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    a.groups = [g for g in a.groups.split(",") if g]
    a.kv_args = shlex.split(a.kvmaster_args)
    modes = {"off": [False], "on": [True], "both": [False, True]}[a.pin]
    root = Path(tempfile.mkdtemp(prefix="kvbench-"))
    # SIGTERM unwinds like an exception, so masters and workers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report: dict[str, Any] = {
        "command": " ".join(["python -m kvmaster.tools.bench", *sys.argv[1:]]),
        "machine": machine_notes(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "kvmaster_code": code_version(),
        "params": {"runs": a.runs, "n": a.n, "batch_keys": a.batch_keys,
                   "batch_sizes": a.batch_sizes, "mem_objects": a.mem_objects,
                   "deadline_s": a.deadline, "kvmaster_args": a.kv_args}, "modes": {}}
    md = [f"Command: `{report['command']}`  ", f"Machine: {report['machine']}  ",
          f"kvmaster code: {report['kvmaster_code']}  ",
          f"Started {report['started']}; median of {a.runs} runs per cell; "
          f"single-op n={a.n}/op/run, batch {a.batch_keys} keys/op/run."
          + (f" kvmaster master flags: `{shlex.join(a.kv_args)}`." if a.kv_args else ""), ""]
    try:
        for pinned in modes:
            name = "pinned" if pinned else "unpinned"
            res = bench_mode(a, pinned, root)
            agg = aggregate(res["raw"])
            report["modes"][name] = {"median": agg, "loadavg": res["loadavg"],
                                     "busy_before": res["busy_before"], "runs": res["raw"]}
            title = ("Pinned: master and client on CPU 0 (taskset -c 0)" if pinned
                     else "Unpinned: default scheduling on 2 vCPUs")
            md.append(tables(agg, title) if not a.no_anchor else f"### {title}\n")
            if a.integrity:
                md.append(integrity_table(agg))
                md += integrity_run_ratios(res["raw"].get("batch", {}))
            if len(res["raw"].get("batch", {}).get("kvmaster", [])) > 1 and not a.no_anchor:
                md += ["keys/s ratio run by run (kvmaster and Mooncake back to back in each "
                       "run):", ""]
                md += [f"* {row}: {ratio_line(rs, 2.0)}"
                       for row, rs in run_ratios(res["raw"]["batch"]).items()] + [""]
            if len(res["raw"].get("compat", {}).get("kvmaster", [])) > 1:
                md += ["compat keys/s ratio run by run:", ""]
                md += [f"* {row}: {ratio_line(rs, 1.0)}"
                       for row, rs in run_ratios(res["raw"]["compat"]).items()] + [""]
            busy = "; ".join(f"{g} " + ", ".join(f"{b:.0%}" for b in bs)
                             for g, bs in res["busy_before"].items())
            md.append(f"Other work on the machine just before each group of each run (share of "
                      f"both vCPUs busy in a 2 s sample of /proc/stat, runs in order): {busy}. "
                      f"Load average (1/5/15 min) before each run and at the end: "
                      f"{res['loadavg']}.\n")
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    text = "\n".join(md)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    if a.md:
        Path(a.md).write_text(text + "\n")
    return 0
