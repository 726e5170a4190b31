"""Scale-out benchmark: shard processes, client processes, data path vs Redis.

``python -m kvmaster.tools.bench.scale_bench [--quick] [--runs N] [--groups ...]
[--json out.json] [--md out.md] [--profile]``

Groups (all in one run, each cell the median over ``--runs``):

* ``scale``: kvmaster with ``--shard-processes --shards N`` (N = 1, 2, 4) and the
  in-process default, put_batch and batch_is_exist of 1024 keys (4 KiB values),
  driven by 1, 2 and 4 client processes (each with its own Client and segment);
  aggregate keys/s.  The CPU time of the front and of every shard process is read
  from /proc (schedstat) around each phase, giving CPU µs per key for each; the
  model projects throughput on a machine with enough cores as
  ``min(keys/front CPU, min over shards of keys/shard CPU)``.
* ``ops``: is_exist, put 4 KiB, get 4 KiB, remove, batch_remove(64) with 1, 2
  and 4 client processes against kvmaster (default master) and the Mooncake
  master (the anchor's wheel); aggregate ops/s.
* ``data``: same-host put_batch / get_batch (and batch_get_into) of 64 blocks of
  4 KiB and 64 KiB, kvmaster's shared-memory path vs Redis pipelined SET / GET
  (64 commands per pipeline, redis-py with hiredis); MB/s.

Every client is a separate process running this file as a script with
``--worker`` (under the Mooncake or Redis venv's interpreter for those
systems, so the worker side imports only the standard library at module
level).  Workers prepare a phase, report ready, and all start on one GO line
from the driver; the aggregate rate is total units over (last end - first
start) on the system-wide monotonic clock.  Every timed loop is bounded by a
count and by ``--deadline`` seconds.

``--profile`` adds a py-spy (``--subprocesses``) sample of the front and the
shard processes of ``--shard-processes --shards 2`` under a batch_is_exist(1024)
load from one client process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SELF = Path(__file__).resolve()
# The anchors (../shared/anchors next to the repository; KVMASTER_SHARED overrides)
# and their venvs (the anchors' install.sh defaults; MC_VENV / REDIS_VENV override).
SHARED = Path(os.environ.get("KVMASTER_SHARED")
              or Path(__file__).resolve().parents[2].parent / "shared")
MC_PYTHON = Path(os.environ.get("MC_VENV", "/tmp/mcvenv")) / "bin" / "python"
REDIS_PYTHON = Path(os.environ.get("REDIS_VENV", "/tmp/redisvenv")) / "bin" / "python"
REDIS_ANCHOR = SHARED / "anchors" / "redis"
PY_SPY_CANDIDATES = ("/tmp/pyspy-venv/bin/py-spy", "py-spy")
WAITS = ("select", "poll", "Poller.poll", "_PollLikeSelector.select", "EpollSelector.select",
         "Runner.run")  # Runner.run as leaf: inside uvloop's C loop (mostly epoll_wait)

SEGMENT = 256 << 20
LOCAL_BUFFER = 64 << 20
perf = time.perf_counter  # CLOCK_MONOTONIC: comparable across processes on Linux


# =================================================================== worker side
# Standard library only at module level: this part runs under three interpreters.

def _open(system: str, addr: str) -> Any:
    if system == "kvmaster":
        from kvmaster import Client

        c = Client()
        c.setup(addr, SEGMENT)
        return c
    if system == "mooncake":
        from mooncake.store import MooncakeDistributedStore

        s = MooncakeDistributedStore()
        rc = s.setup("127.0.0.1", "P2PHANDSHAKE", SEGMENT, LOCAL_BUFFER, "tcp", "", addr)
        if rc != 0:
            raise RuntimeError(f"Mooncake setup failed rc={rc}")
        return s
    if system == "redis":
        import redis

        host, port = addr.rsplit(":", 1)
        r = redis.Redis(host=host, port=int(port))
        r.ping()
        return r
    raise ValueError(system)


def _ok_status(r: Any) -> bool:
    return r is None or (type(r) is int and r == 0)


def _ok_batch(r: Any) -> bool:
    return r == 0 if type(r) is int else all(x == 0 for x in r)


def _chunks(seq: list[Any], n: int) -> list[list[Any]]:
    return [seq[i:i + n] for i in range(0, len(seq), n)]


def _timed(fn: Any, items: list[Any], max_calls: int, deadline_s: float, ok: Any) -> dict[str, Any]:
    """Call fn over items (cycling) up to max_calls or deadline_s; no per-call timing
    beyond the clock read needed for the deadline."""
    n_items = len(items)
    calls = errors = 0
    first_error = ""
    cpu0 = time.process_time()
    t0 = perf()
    stop_at = t0 + deadline_s
    while calls < max_calls:
        try:
            r = fn(items[calls % n_items])
            if not ok(r):
                errors += 1
                first_error = first_error or f"unexpected result: {str(r)[:160]}"
        except Exception as e:  # noqa: BLE001 - an error is a data point
            errors += 1
            first_error = first_error or repr(e)[:200]
        calls += 1
        if perf() > stop_at:
            break
    t1 = perf()
    return {"t0": t0, "t1": t1, "calls": calls, "errors": errors, "first_error": first_error,
            "client_cpu_s": time.process_time() - cpu0}


def _phases_scale(store: Any, a: argparse.Namespace) -> Any:
    val = os.urandom(4096)
    bs = 1024
    tag = f"w{a.wid}"
    warm = [f"{tag}_warm_{i}" for i in range(bs)]
    store.put_batch(warm, [val] * bs)
    store.batch_is_exist(warm)
    batches = [[f"{tag}_{b}_{i}" for i in range(bs)] for b in range(a.batches)]
    vals = [val] * bs
    put = lambda ks: store.put_batch(ks, vals)  # noqa: E731
    r = yield "put_batch", put, batches, len(batches), bs, _ok_batch
    batches = batches[:max(1, r["calls"])]
    yield ("batch_is_exist", store.batch_is_exist, batches, a.calls, bs,
           lambda res: all(x == 1 for x in res))


#: The ops group's operations, in order (the ``_64`` ones are batches of 64 keys).
OPS_GROUP = ("is_exist", "put_4KiB", "get_4KiB", "remove", "put_batch_64", "batch_is_exist_64",
             "get_batch_64", "batch_remove_64")


def _phases_ops(store: Any, a: argparse.Namespace) -> Any:
    val = os.urandom(4096)
    tag = f"w{a.wid}"
    for i in range(100):  # warm-up: connections, transfer paths
        store.put(f"{tag}_warm_{i}", val)
        store.get(f"{tag}_warm_{i}")
    keys = [f"{tag}_a_{i}" for i in range(a.n)]
    r = yield "put_4KiB", (lambda k: store.put(k, val)), keys, len(keys), 1, _ok_status
    keys = keys[:max(1, r["calls"])]
    yield "is_exist", store.is_exist, keys, len(keys), 1, (lambda x: x == 1 or x is True)
    yield "get_4KiB", store.get, keys, len(keys), 1, (lambda x: x is not None and len(x) == 4096)
    # remove: keys written but never read (no lease on either system)
    rkeys = [f"{tag}_r_{i}" for i in range(a.n)]
    for part in _chunks(rkeys, 256):
        store.put_batch(part, [val] * len(part))
    yield "remove", store.remove, rkeys, len(rkeys), 1, _ok_status
    # batched metadata ops of 64 keys: write, look up, read (4 KiB values)
    vals = [val] * 64
    pb = _chunks([f"{tag}_p_{i}" for i in range(max(64, a.n * 4 // 64 * 64))], 64)
    r = yield "put_batch_64", (lambda ks: store.put_batch(ks, vals)), pb, len(pb), 64, _ok_batch
    pb = pb[:max(1, r["calls"])]
    yield ("batch_is_exist_64", store.batch_is_exist, pb, len(pb), 64,
           lambda res: all(x == 1 for x in res))
    yield ("get_batch_64", store.get_batch, pb, len(pb), 64,
           lambda res: all(x is not None and len(x) == 4096 for x in res))
    bkeys = [f"{tag}_b_{i}" for i in range(a.n * 4)]
    for part in _chunks(bkeys, 256):
        store.put_batch(part, [val] * len(part))
    bb = _chunks(bkeys, 64)
    yield "batch_remove_64", (lambda ks: store.batch_remove(ks, True)), bb, len(bb), 64, _ok_batch


def _phases_data(store: Any, a: argparse.Namespace) -> Any:
    bs = 64
    for size in (4096, 65536):
        label = f"{size // 1024}KiB"
        nkeys = min(a.data_keys, (a.data_mib << 20) // size)
        keys = [f"w{a.wid}_d{label}_{i}" for i in range(nkeys)]
        batches = _chunks(keys, bs)
        val = os.urandom(size)
        vals = [val] * bs
        if a.system == "redis":
            def rput(ks: list[str]) -> Any:
                p = store.pipeline(transaction=False)
                for k in ks:
                    p.set(k, val)
                return p.execute()

            def rget(ks: list[str]) -> Any:
                p = store.pipeline(transaction=False)
                for k in ks:
                    p.get(k)
                return p.execute()

            put_fn, get_fn = rput, rget
            ok_put = lambda r: all(x is True for x in r)  # noqa: E731
        else:
            put_fn = lambda ks: store.put_batch(ks, vals)  # noqa: E731
            get_fn = store.get_batch
            ok_put = _ok_batch
        ok_get = lambda r: all(x is not None and len(x) == size for x in r)  # noqa: E731
        r = yield f"put_{label}", put_fn, batches, len(batches), bs * size, ok_put
        batches = batches[:max(1, r["calls"])]
        yield f"get_{label}", get_fn, batches, a.calls, bs * size, ok_get
        if a.system == "kvmaster":
            bufs = [bytearray(size) for _ in range(bs)]
            yield (f"get_into_{label}", lambda ks: store.batch_get_into(ks, bufs), batches,
                   a.calls, bs * size, lambda r: all(x == size for x in r))
        if a.system == "redis":
            for part in _chunks(keys, 512):
                store.delete(*part)
        else:
            for part in batches:
                store.batch_remove(part, True)


def worker_main(a: argparse.Namespace) -> int:
    attempts = 0
    while True:  # bounded: a failed setup is retried at most twice
        attempts += 1
        try:
            store = _open(a.system, a.addr)
            break
        except Exception as e:  # noqa: BLE001
            print(f"setup attempt {attempts} failed: {e!r}", file=sys.stderr, flush=True)
            if attempts >= 3:
                raise
            time.sleep(0.2 * attempts)
    gen = {"scale": _phases_scale, "ops": _phases_ops, "data": _phases_data}[a.group](store, a)
    out = sys.stdout
    try:
        step = next(gen)
        while True:
            name, fn, items, max_calls, units_per_call, ok = step
            out.write(json.dumps({"ready": name}) + "\n")
            out.flush()
            if sys.stdin.readline().strip() != "GO":
                return 3
            r = _timed(fn, items, max_calls, a.deadline, ok)
            r["phase"] = name
            r["setup_retries"] = attempts - 1
            r["units"] = r["calls"] * units_per_call
            out.write(json.dumps({"result": r}) + "\n")
            out.flush()
            try:
                step = gen.send(r)
            except StopIteration:
                break
        # Close only when every worker is done: closing unmounts this worker's segment,
        # which erases the objects other workers placed in it.
        out.write(json.dumps({"done": True}) + "\n")
        out.flush()
        sys.stdin.readline()  # EOF once the driver has heard "done" from all workers
    finally:
        try:
            store.close()
        except Exception:  # noqa: BLE001
            pass
    return 0


# =================================================================== driver side

def _thread_cpu_ns(pid: int) -> dict[str, int]:
    """CPU ns of each thread of one process (not its children), by thread id."""
    out: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except (OSError, ValueError):
            continue
    return out


def _cpu_ns(pid: int) -> int:
    """CPU ns of all threads of one process (not its children)."""
    return sum(_thread_cpu_ns(pid).values())


def _busiest_thread_s(before: dict[str, int], after: dict[str, int]) -> float:
    """CPU seconds of the busiest thread between two :func:`_thread_cpu_ns` readings."""
    return max((ns - before.get(tid, 0) for tid, ns in after.items()), default=0) / 1e9


def _shard_pids(front: int) -> list[int]:
    """Shard processes of a master: its children started by multiprocessing's spawn."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != front:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if b"spawn_main" in cmd:
            out.append(int(name))
    return sorted(out)


class Redis:
    def __init__(self, workdir: Path) -> None:
        self.env = dict(os.environ, STATE_DIR=str(workdir))
        self.workdir = workdir
        self.pid = 0
        self.addr = ""

    def __enter__(self) -> Redis:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "start.out", "wb") as out:
            r = subprocess.run(["bash", str(REDIS_ANCHOR / "start_redis.sh")], env=self.env,
                               stdout=out, stderr=subprocess.STDOUT, timeout=30)
        if r.returncode != 0:
            raise RuntimeError("redis did not start: " + (self.workdir / "start.out").read_text())
        self.pid = int((self.workdir / "redis.pid").read_text())
        self.addr = "127.0.0.1:" + (self.workdir / "redis.port").read_text().strip()
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["bash", str(REDIS_ANCHOR / "stop_redis.sh")], env=self.env,
                       capture_output=True, timeout=30)


def _python_for(system: str) -> str:
    return {"mooncake": str(MC_PYTHON), "redis": str(REDIS_PYTHON)}.get(system, sys.executable)


def run_cell(system: str, group: str, addr: str, front_pid: int, nclients: int,
             cfg: argparse.Namespace, logdir: Path, before_go: Any = None) -> dict[str, Any]:
    """Start nclients workers, run every phase in lockstep; per phase: aggregate
    rate and CPU of the front / each shard process."""
    shard_pids = _shard_pids(front_pid) if system == "kvmaster" else []
    procs = []
    logdir.mkdir(parents=True, exist_ok=True)
    for w in range(nclients):
        cmd = [_python_for(system), str(SELF), "--worker", "--system", system, "--group", group,
               "--addr", addr, "--wid", str(w), "--deadline", str(cfg.deadline),
               "--n", str(cfg.n), "--batches", str(cfg.batches), "--calls", str(cfg.calls),
               "--data-keys", str(cfg.data_keys), "--data-mib", str(cfg.data_mib)]
        err = open(logdir / f"{system}-{group}-c{nclients}-w{w}.log", "wb")
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=err, text=True, cwd=str(logdir)))
        err.close()
    phases: dict[str, Any] = {}
    deadline = time.monotonic() + cfg.worker_timeout

    def read(p: subprocess.Popen[str]) -> dict[str, Any]:
        assert p.stdout is not None
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited early (rc={p.poll()}); logs in {logdir}")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        raise TimeoutError("worker timeout")

    try:
        while True:
            msgs = [read(p) for p in procs]
            if all("done" in m for m in msgs):
                break
            name = msgs[0]["ready"]
            if before_go is not None:
                before_go(name)
            t_front, t_sh = _thread_cpu_ns(front_pid), [_thread_cpu_ns(s) for s in shard_pids]
            c_front, c_sh = sum(t_front.values()), [sum(t.values()) for t in t_sh]
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("GO\n")
                p.stdin.flush()
            res = [read(p)["result"] for p in procs]
            t_front2, t_sh2 = _thread_cpu_ns(front_pid), [_thread_cpu_ns(s) for s in shard_pids]
            front_s = (sum(t_front2.values()) - c_front) / 1e9
            shard_s = [(sum(t2.values()) - c) / 1e9 for t2, c in zip(t_sh2, c_sh)]
            # Busiest thread of each process (the Python thread or libzmq's I/O thread).
            front_t = _busiest_thread_s(t_front, t_front2)
            shard_t = [_busiest_thread_s(t1, t2) for t1, t2 in zip(t_sh, t_sh2)]
            units = sum(r["units"] for r in res)
            calls = sum(r["calls"] for r in res)
            span = max(r["t1"] for r in res) - min(r["t0"] for r in res)
            row = {"units": units, "calls": calls, "span_s": span,
                   "units_s": units / span if span > 0 else float("nan"),
                   "calls_s": calls / span if span > 0 else float("nan"),
                   "errors": sum(r["errors"] for r in res),
                   "setup_retries": sum(r.get("setup_retries", 0) for r in res),
                   "first_error": next((r["first_error"] for r in res if r.get("first_error")), ""),
                   "front_cpu_us_per_unit": 1e6 * front_s / units if units else float("nan"),
                   "front_cpu_pct": 100 * front_s / span if span > 0 else float("nan"),
                   "client_cpu_us_per_unit":
                       1e6 * sum(r["client_cpu_s"] for r in res) / units if units else float("nan")}
            if shard_pids:
                row["shard_cpu_us_per_unit"] = 1e6 * sum(shard_s) / units if units else float("nan")
                row["max_shard_cpu_us_per_unit"] = (1e6 * max(shard_s) / units
                                                    if units else float("nan"))
                row["shard_cpu_pct_each"] = [round(100 * s / span, 1) for s in shard_s]
                # enough-cores projection: every process gets its own core
                caps = [units / front_s if front_s > 0 else float("inf")]
                caps += [units / s for s in shard_s if s > 0]
                row["model_units_s"] = min(caps)
                row["model_front_cap"] = caps[0]
                row["model_shard_cap"] = min(caps[1:]) if len(caps) > 1 else float("nan")
                # enough-cores projection, per thread: every thread gets its own core
                caps = [units / front_t if front_t > 0 else float("inf")]
                caps += [units / s for s in shard_t if s > 0]
                row["model_thread_units_s"] = min(caps)
                row["model_thread_front_cap"] = caps[0]
                row["model_thread_shard_cap"] = min(caps[1:]) if len(caps) > 1 else float("nan")
                row["front_busiest_thread_cpu_us_per_unit"] = (1e6 * front_t / units
                                                               if units else float("nan"))
                row["max_shard_busiest_thread_cpu_us_per_unit"] = (
                    1e6 * max(shard_t) / units if units else float("nan"))
            elif system == "kvmaster":
                row["model_units_s"] = units / front_s if front_s > 0 else float("nan")
                row["model_thread_units_s"] = units / front_t if front_t > 0 else float("nan")
                row["model_thread_front_cap"] = row["model_thread_units_s"]
                row["front_busiest_thread_cpu_us_per_unit"] = (1e6 * front_t / units
                                                               if units else float("nan"))
            phases[name] = row
    finally:
        for p in procs:
            try:
                if p.stdin:
                    p.stdin.close()
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            if p.stdout:
                p.stdout.close()
    return phases


def _median_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from . import _timing as T

    return T.median_of_runs(rows)


KV_CONFIGS = {"in-process": [], "sp1": ["--shard-processes", "--shards", "1"],
              "sp2": ["--shard-processes", "--shards", "2"],
              "sp4": ["--shard-processes", "--shards", "4"]}


def _wait_load(cfg: argparse.Namespace) -> list[float]:
    deadline = time.monotonic() + cfg.wait_load_s
    while os.getloadavg()[0] >= cfg.load_below and time.monotonic() < deadline:
        print(f"load {os.getloadavg()[0]:.2f} >= {cfg.load_below}; waiting", file=sys.stderr,
              flush=True)
        time.sleep(min(15.0, max(0.1, deadline - time.monotonic())))
    return [round(x, 2) for x in os.getloadavg()]


def bench(cfg: argparse.Namespace, root: Path) -> dict[str, Any]:
    from .store_bench import Master

    by_run: dict[str, dict[int, dict[str, Any]]] = {}  # cell -> run -> row
    loads: list[list[float]] = []

    failures: list[str] = []

    def cell(system: str, group: str, srv: Any, nc: int, wd: Path) -> dict[str, Any]:
        try:
            with srv as m:
                return run_cell(system, group, m.addr, m.pid, nc, cfg, wd)
        except Exception as e:  # noqa: BLE001 - one failed cell must not lose the run
            tails = []
            for f in sorted(wd.glob("*-w*.log")):
                t = f.read_text(errors="replace").strip().splitlines()
                if t:
                    tails.append(f"{f.name}: {t[-1]}")
            msg = f"{group}/{system}/c{nc} in {wd.parent.name}: {e}; " + " | ".join(tails)
            failures.append(msg)
            print("FAILED " + msg, file=sys.stderr, flush=True)
            return {}

    def add(key: tuple[str, ...], phases: dict[str, Any]) -> None:
        for ph, row in phases.items():
            by_run.setdefault("|".join((*key, ph)), {})[run] = row

    for run in range(cfg.runs):
        loads.append(_wait_load(cfg))
        if "scale" in cfg.groups:
            names = list(KV_CONFIGS) if run % 2 == 0 else list(KV_CONFIGS)[::-1]
            for name in names:
                for nc in cfg.clients:
                    wd = root / f"run{run}" / f"scale-{name}-c{nc}"
                    ph = cell("kvmaster", "scale", Master("kvmaster", False, wd, KV_CONFIGS[name]),
                              nc, wd)
                    add(("scale", name, str(nc)), ph)
                    _log(run, f"scale {name} c{nc}", ph)
        if "ops" in cfg.groups:
            systems = ["kvmaster", "mooncake"] if run % 2 == 0 else ["mooncake", "kvmaster"]
            for system in systems:
                for nc in cfg.clients:
                    wd = root / f"run{run}" / f"ops-{system}-c{nc}"
                    ph = cell(system, "ops", Master(system, False, wd), nc, wd)
                    add(("ops", system, str(nc)), ph)
                    _log(run, f"ops {system} c{nc}", ph)
        if "data" in cfg.groups:
            systems = ["kvmaster", "redis"] if run % 2 == 0 else ["redis", "kvmaster"]
            for system in systems:
                for nc in cfg.data_clients:
                    wd = root / f"run{run}" / f"data-{system}-c{nc}"
                    srv: Any = (Master("kvmaster", False, wd) if system == "kvmaster"
                                else Redis(wd))
                    ph = cell(system, "data", srv, nc, wd)
                    add(("data", system, str(nc)), ph)
                    _log(run, f"data {system} c{nc}", ph)
    loads.append([round(x, 2) for x in os.getloadavg()])
    raw = {k: list(rows.values()) for k, rows in by_run.items()}  # (in run order)
    med = {k: _median_rows(v) for k, v in raw.items()}
    return {"raw": raw, "median": med, "paired": _paired(by_run), "loadavg": loads,
            "failures": failures}


def _paired(by_run: dict[str, dict[int, dict[str, Any]]]) -> dict[str, dict[str, list[float]]]:
    """sp4's modelled keys/s over sp1's, run by run: ``"<clients>|<op>" -> {model key:
    [ratio of each run that has both cells]}``.  Within a run the two cells are minutes
    apart, so the ratio does not move with the VM's slower and faster phases the way a
    ratio of medians over the whole series can."""
    out: dict[str, dict[str, list[float]]] = {}
    for cell, sp4 in by_run.items():
        group, name, nc, op = cell.split("|", 3)
        if group != "scale" or name != "sp4":
            continue
        sp1 = by_run.get(f"scale|sp1|{nc}|{op}", {})
        for key in ("model_units_s", "model_thread_units_s"):
            out.setdefault(f"{nc}|{op}", {})[key] = [
                sp4[r][key] / sp1[r][key] for r in sorted(sp4)
                if r in sp1 and sp4[r].get(key) and sp1[r].get(key)]
    return out


def paired_line(paired: dict[str, dict[str, list[float]]], nc: str, op: str, key: str) -> str:
    """'2.10x, 1.85x, 2.31x (median 2.10x; >= 1.6x in 3 of 3 runs)', or '' without runs."""
    from .store_bench import ratio_line

    ratios = paired.get(f"{nc}|{op}", {}).get(key) or []
    return ratio_line(ratios, 1.6) if ratios else ""


def _log(run: int, what: str, ph: dict[str, Any]) -> None:
    parts = ", ".join(f"{k} {v['units_s']:,.0f}/s" for k, v in ph.items())
    print(f"[run {run + 1}] {what}: {parts} (load {os.getloadavg()[0]:.2f})", file=sys.stderr,
          flush=True)


# ------------------------------------------------------------------ tables

def _n(x: Any, nd: int = 1) -> str:
    if not isinstance(x, (int, float)) or x != x or x in (float("inf"), float("-inf")):
        return "n/a"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{nd}f}"


def _r(a: Any, b: Any) -> str:
    try:
        return f"{a / b:.2f}x" if b and a == a and b == b else "n/a"
    except TypeError:
        return "n/a"


def _projection(g: Any, nc: str, key: str, cells: Any) -> list[str]:
    """Rows of a projection table: op, master, ``cells(row, modelled)``, the modelled
    keys/s (``key``), its ratio to sp1's and the goal's verdict for sp4."""
    out = []
    for op in ("put_batch", "batch_is_exist"):
        base = g("scale", "sp1", nc, op).get(key)
        for name in KV_CONFIGS:
            row = g("scale", name, nc, op)
            m = row.get(key)
            goal = ""
            if name == "sp4" and isinstance(m, float) and base:
                goal = "met" if m / base >= 1.6 else "not met"
            out.append("| " + " | ".join([op, name, *cells(row, m), _n(m), _r(m, base), goal])
                       + " |")
    return out


def _paired_lines(paired: dict[str, dict[str, list[float]]], nc: str, key: str) -> list[str]:
    found = [(op, paired_line(paired, nc, op, key)) for op in ("put_batch", "batch_is_exist")]
    lines = [f"* {op}: {line}" for op, line in found if line]
    return ["", "sp4 / sp1 modelled, run by run (both cells of a run minutes apart):", "",
            *lines] if lines else []


def tables(med: dict[str, Any], cfg: argparse.Namespace,
           paired: dict[str, dict[str, list[float]]] | None = None) -> str:
    out: list[str] = []
    g = lambda *k: med.get("|".join(k), {})  # noqa: E731
    if "scale" in cfg.groups:
        out += ["### Shard processes: batch of 1024 keys, 4 KiB values, measured on this machine",
                "", "Aggregate keys/s over all client processes (median of runs). "
                "CPU µs per key from /proc schedstat of the front and of each shard process. "
                "`spN` = `--shard-processes --shards N`; `in-process` = default master "
                "(one shard actor in the front's event loop).", "",
                "| op | master | clients | keys/s | vs sp1 same clients | errors "
                "| front CPU µs/key "
                "| shards CPU µs/key (sum) | busiest shard CPU µs/key | client CPU µs/key |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for op in ("put_batch", "batch_is_exist"):
            for name in KV_CONFIGS:
                for nc in cfg.clients:
                    row = g("scale", name, str(nc), op)
                    base = g("scale", "sp1", str(nc), op)
                    out.append("| " + " | ".join([
                        op, name, str(nc), _n(row.get("units_s")),
                        _r(row.get("units_s"), base.get("units_s")), _n(row.get("errors"), 0),
                        _n(row.get("front_cpu_us_per_unit"), 2),
                        _n(row.get("shard_cpu_us_per_unit"), 2),
                        _n(row.get("max_shard_cpu_us_per_unit"), 2),
                        _n(row.get("client_cpu_us_per_unit"), 2)]) + " |")
        out += ["", "### Shard processes: projection for a machine with enough cores", "",
                "Model: each master process on its own core, clients not the limit. "
                "Capacity = min(keys / front CPU, min over shards of keys / shard CPU), "
                "from the CPU per key measured above with the most client processes "
                f"({max(cfg.clients)}). Not a measurement.", "",
                "| op | master | front cap keys/s | busiest-shard cap keys/s | modelled keys/s "
                "| modelled vs sp1 | goal (sp4 >= 1.6x sp1) |", "|---|---|---|---|---|---|---|"]
        nc = str(max(cfg.clients))
        out += _projection(g, nc, "model_units_s", lambda row, m: [
            _n(row.get("model_front_cap", m)), _n(row.get("model_shard_cap"))])
        out += _paired_lines(paired or {}, nc, "model_units_s")
        out += ["", "Model per thread: each thread of a master process on its own core (the "
                "front and every shard process run a Python thread and libzmq's I/O thread, "
                "which work in parallel; the busiest thread of each process is its limit). "
                "Capacity = min(keys / CPU of the front's busiest thread, min over shards of "
                "keys / CPU of the shard's busiest thread), same runs as above. Not a "
                "measurement; it assumes the two threads of a process overlap perfectly.", "",
                "| op | master | front busiest thread µs/key | busiest shard thread µs/key "
                "| front cap keys/s | busiest-shard cap keys/s | modelled keys/s "
                "| modelled vs sp1 | goal (sp4 >= 1.6x sp1) |",
                "|---|---|---|---|---|---|---|---|---|"]
        out += _projection(g, nc, "model_thread_units_s", lambda row, m: [
            _n(row.get("front_busiest_thread_cpu_us_per_unit"), 3),
            _n(row.get("max_shard_busiest_thread_cpu_us_per_unit"), 3),
            _n(row.get("model_thread_front_cap", m)), _n(row.get("model_thread_shard_cap"))])
        out += _paired_lines(paired or {}, nc, "model_thread_units_s")
        out.append("")
    if "ops" in cfg.groups:
        out += ["### Client processes: kvmaster vs Mooncake master", "",
                "Aggregate ops/s over all client processes (keys/s for the batch ops of 64 "
                "keys), "
                "one call at a time per process, 4 KiB values. Ratio > 1 = kvmaster faster.", "",
                "| op | clients | kvmaster ops/s | Mooncake ops/s | ratio | kvmaster master CPU "
                "µs/op | Mooncake master CPU µs/op | errors kv / mc |",
                "|---|---|---|---|---|---|---|---|"]
        for op in OPS_GROUP:
            for nc in cfg.clients:
                kv, mc = g("ops", "kvmaster", str(nc), op), g("ops", "mooncake", str(nc), op)
                out.append("| " + " | ".join([
                    op, str(nc), _n(kv.get("units_s")), _n(mc.get("units_s")),
                    _r(kv.get("units_s"), mc.get("units_s")),
                    _n(kv.get("front_cpu_us_per_unit"), 2), _n(mc.get("front_cpu_us_per_unit"), 2),
                    f"{_n(kv.get('errors'), 0)} / {_n(mc.get('errors'), 0)}"]) + " |")
        out.append("")
    if "data" in cfg.groups:
        out += ["### Data path: same host, 64 blocks per batch / pipeline", "",
                "MB/s (10^6 B) of values moved, aggregate over client processes. kvmaster: "
                "put_batch / get_batch (bytes objects) / batch_get_into (preallocated "
                "buffers) over shared memory; Redis: pipelined SET / GET, redis-py + hiredis, "
                "64 commands per pipeline. Ratio = kvmaster / Redis.", "",
                "| op | block | clients | kvmaster MB/s | Redis MB/s | ratio | errors kv / redis |",
                "|---|---|---|---|---|---|---|"]
        for nc in cfg.data_clients:
            for label in ("4KiB", "64KiB"):
                for op, rop in (("put", "put"), ("get", "get"), ("get_into", "get")):
                    kv = g("data", "kvmaster", str(nc), f"{op}_{label}")
                    rd = g("data", "redis", str(nc), f"{rop}_{label}")
                    a, b = kv.get("units_s"), rd.get("units_s")
                    a = a / 1e6 if isinstance(a, float) else a
                    b = b / 1e6 if isinstance(b, float) else b
                    name = {"put": "put_batch vs SET", "get": "get_batch vs GET",
                            "get_into": "batch_get_into vs GET"}[op]
                    out.append("| " + " | ".join([
                        name, label, str(nc), _n(a), _n(b), _r(a, b),
                        f"{_n(kv.get('errors'), 0)} / {_n(rd.get('errors'), 0)}"]) + " |")
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------ profile

def profile(cfg: argparse.Namespace, root: Path) -> str:
    """py-spy over the front and its shard processes (--shard-processes --shards 2)
    while one client process runs batch_is_exist(1024)."""
    import re
    import shutil
    from collections import Counter

    from .store_bench import Master

    exe = next((p for p in PY_SPY_CANDIDATES if shutil.which(p) or os.path.exists(p)), "")
    if not exe:
        return "py-spy not found; profile skipped\n"
    wd = root / "profile"
    rawf = wd / "pyspy.txt"
    secs = max(3, int(cfg.profile_seconds))
    with Master("kvmaster", False, wd, ["--shard-processes", "--shards", "2"]) as m:
        shard_pids = set(_shard_pids(m.pid))
        spy: list[subprocess.Popen[bytes]] = []

        def start_spy(phase: str) -> None:
            if phase != "batch_is_exist" or spy:
                return
            spy.append(subprocess.Popen(
                [exe, "record", "--pid", str(m.pid), "--subprocesses", "--duration", str(secs),
                 "--rate", "200", "--function", "--format", "raw", "-o", str(rawf)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.0)  # let py-spy attach to the front and its children

        try:
            c = argparse.Namespace(**vars(cfg))
            c.deadline, c.calls, c.batches = secs, 1_000_000, 16
            ph = run_cell("kvmaster", "scale", m.addr, m.pid, 1, c, wd, start_spy)
            for sp in spy:
                sp.wait(secs + 30)
        finally:
            for sp in spy:
                if sp.poll() is None:
                    sp.terminate()
                    sp.wait(10)
    if not rawf.exists():
        return "py-spy produced no output; profile skipped\n"
    by_role: dict[str, Counter[str]] = {"front": Counter(), "shard": Counter()}
    tot: dict[str, int] = {"front": 0, "shard": 0}
    waiting: dict[str, int] = {"front": 0, "shard": 0}
    for line in rawf.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit() or not stack:
            continue
        frames = stack.split(";")
        role = "front"
        procs = [f for f in frames if f.startswith("process ")]  # nested: parent first
        if procs:
            mt = re.match(r"process (\d+)", procs[-1])
            role = "shard" if mt and int(mt.group(1)) in shard_pids else "front"
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        if frames[-1].split(" ", 1)[0].endswith(WAITS):
            waiting[role] += int(n)  # blocked in a poll: idle, not work
            continue
        by_role[role][frames[-1]] += int(n)
        tot[role] += int(n)
    rate = ph.get("batch_is_exist", {}).get("units_s", float("nan"))
    lines = [f"py-spy (200 Hz; pauses the process per sample) over {secs} s of "
             f"batch_is_exist(1024) from one "
             f"client process, `--shard-processes --shards 2`: {rate:,.0f} keys/s while sampled; "
             f"samples doing work: front {tot['front']:,}, shards (both) {tot['shard']:,}; "
             f"samples blocked in select/poll or in uvloop's C loop (not counted below): "
             f"front {waiting['front']:,}, "
             f"shards {waiting['shard']:,}.", ""]
    for role in ("front", "shard"):
        lines += [f"{role} — top functions by own samples:", "",
                  "| own % | function (file:line) |", "|---|---|"]
        for f, cnt in by_role[role].most_common(cfg.profile_top):
            lines.append(f"| {100 * cnt / max(1, tot[role]):.1f} | `{f}` |")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmaster.tools.bench.scale_bench",
                                description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", default="kvmaster", help=argparse.SUPPRESS)
    p.add_argument("--group", default="scale", help=argparse.SUPPRESS)
    p.add_argument("--addr", default="", help=argparse.SUPPRESS)
    p.add_argument("--wid", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="smaller counts, shorter phases")
    p.add_argument("--runs", type=int, default=3, help="runs per cell; medians are reported")
    p.add_argument("--groups", default="scale,ops,data", help="comma list of scale,ops,data")
    p.add_argument("--clients", default="1,2,4", help="client process counts (scale, ops)")
    p.add_argument("--data-clients", default="1", help="client process counts (data)")
    p.add_argument("--deadline", type=float, default=0.0, help="wall cap per timed phase, s")
    p.add_argument("--n", type=int, default=0, help="ops per client process per single-op phase")
    p.add_argument("--batches", type=int, default=0, help="put_batch calls (1024 keys) per client")
    p.add_argument("--calls", type=int, default=0, help="cap on calls of repeated read phases")
    p.add_argument("--data-keys", type=int, default=0, help="keys per block size (data group)")
    p.add_argument("--data-mib", type=int, default=64, help="cap on MiB written per block size")
    p.add_argument("--worker-timeout", type=float, default=300.0)
    p.add_argument("--load-below", type=float, default=1.5,
                   help="wait before each run for the 1-min load average to drop below this")
    p.add_argument("--wait-load-s", type=float, default=0.0, help="... for at most this long")
    p.add_argument("--profile", action="store_true", help="add a py-spy profile of the batch case")
    p.add_argument("--profile-seconds", type=float, default=5.0)
    p.add_argument("--profile-top", type=int, default=12)
    p.add_argument("--json", default="")
    p.add_argument("--md", default="")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    a = p.parse_args(argv)
    q = a.quick
    a.deadline = a.deadline or (2.0 if q else 4.0)
    a.n = a.n or (1000 if q else 3000)
    a.batches = a.batches or (8 if q else 16)
    a.calls = a.calls or (300 if q else 2000)
    a.data_keys = a.data_keys or (512 if q else 1024)
    if a.worker:
        return worker_main(a)

    import shutil
    import tempfile

    from .store_bench import code_version, machine_notes

    a.groups = [x for x in a.groups.split(",") if x]
    a.clients = [int(x) for x in a.clients.split(",") if x]
    a.data_clients = [int(x) for x in a.data_clients.split(",") if x]
    root = Path(tempfile.mkdtemp(prefix="kvscale-"))
    cmd = " ".join(["python -m kvmaster.tools.bench.scale_bench", *sys.argv[1:]])
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        res = bench(a, root)
        prof = ""
        if a.profile:
            try:
                prof = profile(a, root)
            except Exception as e:  # noqa: BLE001 - keep the measurements
                prof = f"profile failed: {e!r}\n"
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    md = [f"Command: `{cmd}`  ", f"Machine: {machine_notes()}  ",
          f"kvmaster code: {code_version()}  ",
          f"Started {started}; median of {a.runs} runs; phases capped at {a.deadline:g} s; "
          f"single ops {a.n}/client; put_batch {a.batches} x 1024 keys/client.  ",
          f"Load average (1/5/15 min) before each run and at the end: {res['loadavg']}", "",
          tables(res["median"], a, res["paired"])]
    retries = {k: v.get("setup_retries") for k, v in res["median"].items()
               if v.get("setup_retries")}
    if retries:
        md += [f"Client setups retried (median per cell; first phase of each cell): {retries}", ""]
    errs = {k: [r.get("first_error") for r in v if r.get("first_error")]
            for k, v in res["raw"].items()}
    errs = {k: v for k, v in errs.items() if v}
    if errs:
        md += ["Error samples (first failing call of a phase, per run that had errors):", ""]
        md += [f"* `{k}`: {v}" for k, v in errs.items()] + [""]
    if res["failures"]:
        md += ["Failed cells (left out of the medians):", ""]
        md += [f"* {f}" for f in res["failures"]] + [""]
    if prof:
        md += ["### Profile of the batch case", "", prof]
    text = "\n".join(md)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps({"command": cmd, "started": started, **res,
                                            "profile": prof}, indent=1))
    if a.md:
        Path(a.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
