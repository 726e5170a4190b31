"""``python -m kvmaster.tools.bench attack``: a well-behaved client's latency while
another tenant attacks the master, against quiet phases of the same run.

``python -m kvmaster.tools.bench attack [--quick] [--attack-s S] [--quiet-s S]
[--attacks a,b,...] [--pin] [--master-args FLAGS] [--json out.json] [--md out.md]``

One real master (``python -m kvmaster master --port 0``, with
``--master-segment-size 64 MiB --tenant-quota-bytes 16 MiB --max-clients 256
--tenant-max-clients 64 --tenant-max-requests-per-s 8000`` unless ``--master-args``
replaces them; the rate is above the victim's own demand, 7,000-7,400 request units per
second at its full speed on a quiet 2-vCPU machine) serves the whole run.
The *victim* runs in this process as tenant ``victim`` with a segment of its own
(its writes prefer it), or, for the capacity attack, as tenant ``victim-shared`` with
no segment (its writes go to the master's shared segment, next to the attacker's).
Its workload, in a closed loop: put of a fresh 4 KiB key, get of it, get_batch of 64
keys it wrote at the start (values checked): one *iteration*; then a forced remove of
the put key (so its footprint stays constant; timed as its own op, not part of the
iteration).  Each phase also starts with three
set-ups of a new client of the victim's tenant (setup time: HELLO and MOUNT_SEGMENT)
and their closes (UNMOUNT_SEGMENT and BYE), timed: master-level requests.

Each attack (``_attackers.ATTACKS``) runs in its own process (multiprocessing
spawn), as a tenant of its own: mount/unmount loop, CHECK_CONSISTENCY flood, a
reader that never reads, capacity (16 writers into the shared segment), abandoned
writes then BYE, client slots; and, for comparison, a control that is no attack:
``flood_exist``, a tenant sending EXIST_KEY with 16 in flight and reading every reply
(what any busy client may do).  Phases alternate quiet, attack, quiet, ... so drift
shows; an attack's ratio is its p50 (p99) over the mean p50 (p99) of the quiet phases
just before and after it (same victim).  Goal: within 2x.  For the capacity attack
the victim's hit rate of 256 objects it wrote before any attack is given after each
of its phases.  At the end the master must still run and an admin client's
CHECK_CONSISTENCY must find nothing.

With ``--pin`` the master and the victim run on CPU 0 and the attacker on CPU 1
(the attacker's own CPU use then does not slow the victim directly).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from . import _timing as T
from ._attackers import ATTACKS, CONTROLS, attacker_main
from .store_bench import Master, code_version, machine_busy, machine_notes

MiB = 1 << 20
MASTER_FLAGS = ["--master-segment-size", str(64 * MiB), "--tenant-quota-bytes", str(16 * MiB),
                "--max-clients", "256", "--tenant-max-clients", "64",
                "--tenant-max-requests-per-s", "8000"]
OPS = ("iteration", "put", "get", "get_batch", "remove")
BATCH = 64
EARLY = 256
VALUE = 4096


# ------------------------------------------------------------------- victim

class Victim:
    """The well-behaved client: tenant ``victim`` (own segment) and ``victim-shared``
    (no segment), each with the 64 keys its get_batch reads."""

    def __init__(self, addr: str, segment: int) -> None:
        from kvmaster import Client, ReplicateConfig

        self.addr = addr
        self.segment = segment
        self.value = os.urandom(VALUE)
        self.own = Client()
        self.own.setup(addr, segment, "victim")
        self.shared = Client()
        self.shared.setup(addr, 0, "victim-shared")
        self.cfg = {"own": ReplicateConfig(preferred_segments=[self.own.segment_name]),
                    "shared": None}
        self.batch = [f"batch-{i}" for i in range(BATCH)]
        self.early = [f"early-{i}" for i in range(EARLY)]
        for mode, c in (("own", self.own), ("shared", self.shared)):
            codes = c.put_batch(self.batch, [self.value] * BATCH, self.cfg[mode])
            if codes != [0] * BATCH:
                raise RuntimeError(f"victim ({mode}) could not write its batch keys: {codes}")
        codes = self.shared.put_batch(self.early, [self.value] * EARLY)
        if codes != [0] * EARLY:
            raise RuntimeError(f"victim could not write its early objects: {codes}")
        self.seq = 0

    def client(self, mode: str) -> Any:
        return self.own if mode == "own" else self.shared

    def hit_rate(self) -> float:
        return sum(self.shared.batch_is_exist(self.early)) / EARLY

    def setup_times(self, n: int, errors: Counter[str]) -> tuple[list[float], list[float]]:
        """ms of ``n`` set-ups of a new client of tenant ``victim`` (HELLO, MOUNT_SEGMENT)
        and of its close (UNMOUNT_SEGMENT, BYE)."""
        from kvmaster import Client

        setups, closes = [], []
        for _ in range(n):
            c = Client()
            t0 = time.perf_counter()
            try:
                c.setup(self.addr, self.segment, "victim")
                setups.append((time.perf_counter() - t0) * 1000)
            except Exception as exc:  # noqa: BLE001 - an error is a data point
                errors[f"setup {_err(exc)}"] += 1
            t0 = time.perf_counter()
            c.close()
            closes.append((time.perf_counter() - t0) * 1000)
        return setups, closes

    def measure(self, mode: str, seconds: float) -> dict[str, Any]:
        """The workload for ``seconds``: raw latencies in µs per op, errors by kind."""
        c, cfg, value, batch = self.client(mode), self.cfg[mode], self.value, self.batch
        lat: dict[str, list[float]] = {op: [] for op in OPS}
        errors: Counter[str] = Counter()
        pc = time.perf_counter
        end = pc() + seconds
        start = pc()
        while pc() < end:
            self.seq += 1
            key = f"v{self.seq}"
            t0 = pc()
            try:
                c.put(key, value, cfg)
            except Exception as exc:  # noqa: BLE001
                errors[f"put {_err(exc)}"] += 1
            t1 = pc()
            try:
                if c.get(key) != value:
                    errors["get wrong value"] += 1
            except Exception as exc:  # noqa: BLE001
                errors[f"get {_err(exc)}"] += 1
            t2 = pc()
            try:
                got = c.get_batch(batch)
                bad = sum(v != value for v in got)
                if bad:
                    errors["get_batch missing or wrong values"] += bad
            except Exception as exc:  # noqa: BLE001
                errors[f"get_batch {_err(exc)}"] += 1
            t3 = pc()
            lat["put"].append((t1 - t0) * 1e6)
            lat["get"].append((t2 - t1) * 1e6)
            lat["get_batch"].append((t3 - t2) * 1e6)
            lat["iteration"].append((t3 - t0) * 1e6)
            try:
                c.remove(key, True)
            except Exception:  # noqa: BLE001 - not in the iteration; a failed put has no key
                pass
            lat["remove"].append((pc() - t3) * 1e6)
        return {"lat_us": lat, "elapsed_s": pc() - start, "errors": errors}

    def close(self) -> None:
        self.own.close()
        self.shared.close()


def _err(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return f"{type(exc).__name__}({code})" if code is not None else type(exc).__name__


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op, vals in raw["lat_us"].items():
        s = sorted(vals)
        out[op] = {"calls": len(s), "p50_ms": T.percentile(s, 0.5) / 1000,
                   "p99_ms": T.percentile(s, 0.99) / 1000,
                   "mean_ms": sum(s) / len(s) / 1000 if s else float("nan")}
    n = len(raw["lat_us"]["iteration"])
    out["iterations_s"] = n / raw["elapsed_s"] if raw["elapsed_s"] > 0 else float("nan")
    return out


# ------------------------------------------------------------------ phases

def schedule(attacks: list[str]) -> list[tuple[str | None, str]]:
    """``(attack or None for quiet, victim mode)`` in order: quiet phases around every
    attack (own segment), then the capacity attack between two shared-segment quiets."""
    own = [a for a in attacks if a != "capacity"]
    out: list[tuple[str | None, str]] = []
    if own:
        out.append((None, "own"))
        for a in own:
            out += [(a, "own"), (None, "own")]
    if "capacity" in attacks:
        out += [(None, "shared"), ("capacity", "shared"), (None, "shared")]
    return out


def run_phase(victim: Victim, master: Master, attack: str | None, mode: str,
              a: argparse.Namespace) -> dict[str, Any]:
    seconds = a.attack_s if attack else a.quiet_s
    rec: dict[str, Any] = {"attack": attack, "victim": mode, "seconds": seconds}
    proc = conn = None
    if attack:
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        opts = {"depth": a.depth, "reader_keys": a.reader_keys,
                "reader_requests": a.reader_requests, "writers": a.writers,
                "abandon_size": a.abandon_size, "bye_before_s": min(1.0, seconds / 3),
                "max_clients": a.attack_clients, "cpus": [1] if a.pin else None}
        endpoint = "tcp://" + master.addr
        proc = ctx.Process(target=attacker_main, args=(attack, endpoint, opts, child),
                           daemon=True)
        proc.start()
        child.close()
        if not conn.poll(a.prepare_timeout):
            rec["attacker"] = {"error": f"not ready within {a.prepare_timeout} s"}
        else:
            msg, body = conn.recv()
            if msg != "ready":
                rec["attacker"] = body
            else:
                conn.send(("go", a.ramp_s + seconds))
                time.sleep(a.ramp_s)
    errors: Counter[str] = Counter()
    with T.CpuMeter(master.pid) as meter:
        rec["setup_ms"], rec["close_ms"] = victim.setup_times(3, errors)
        raw = victim.measure(mode, seconds)
    errors.update(raw["errors"])
    rec["summary"] = summarize(raw)
    rec["errors"] = dict(errors)
    rec["master_cpu_pct"] = 100 * meter.cpu / meter.wall if meter.wall else float("nan")
    if proc is not None and conn is not None:
        if "attacker" not in rec:
            if conn.poll(seconds + 120):
                rec["attacker"] = conn.recv()[1]
            else:
                rec["attacker"] = {"error": "no result within 120 s of the phase's end"}
        proc.join(15)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        conn.close()
    if mode == "shared":
        rec["hit_rate_after"] = victim.hit_rate()
    rec["master_rss_mib"] = T.proc_rss_bytes(master.pid) / MiB
    rec["master_alive"] = master._proc is not None and master._proc.poll() is None
    return rec


def ratios(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per attack phase: its figures over the mean of the quiet phases around it."""
    rows = []
    for i, ph in enumerate(phases):
        if not ph["attack"]:
            continue
        quiet = [phases[j] for j in (i - 1, i + 1)
                 if 0 <= j < len(phases) and not phases[j]["attack"]]
        row: dict[str, Any] = {"attack": ph["attack"], "victim": ph["victim"], "ops": {}}
        for op in OPS:
            q50 = statistics.fmean(q["summary"][op]["p50_ms"] for q in quiet)
            q99 = statistics.fmean(q["summary"][op]["p99_ms"] for q in quiet)
            a50, a99 = ph["summary"][op]["p50_ms"], ph["summary"][op]["p99_ms"]
            row["ops"][op] = {"quiet_p50_ms": q50, "attack_p50_ms": a50, "p50_ratio": a50 / q50,
                              "quiet_p99_ms": q99, "attack_p99_ms": a99, "p99_ratio": a99 / q99}
        for what in ("setup", "close"):
            qs = [t for q in quiet for t in q[f"{what}_ms"]]
            row[f"{what}_ms_quiet"] = statistics.median(qs) if qs else float("nan")
            row[f"{what}_ms_attack"] = (statistics.median(ph[f"{what}_ms"]) if ph[f"{what}_ms"]
                                        else float("nan"))
            row[f"{what}_ms_attack_max"] = max(ph[f"{what}_ms"], default=float("nan"))
        row["victim_errors"] = sum(ph["errors"].values())
        it = row["ops"]["iteration"]
        row["within_2x"] = it["p50_ratio"] <= 2 and it["p99_ratio"] <= 2
        row["attacker"] = ph.get("attacker", {})
        if ph["victim"] == "shared":
            row["hit_rate_before"] = phases[i - 1].get("hit_rate_after")
            row["hit_rate_after"] = ph.get("hit_rate_after")
        rows.append(row)
    return rows


# ---------------------------------------------------------------- markdown

def _f(x: Any, nd: int = 2) -> str:
    if not isinstance(x, (int, float)) or x != x:
        return "n/a"
    return f"{x:,.{nd}f}"


def attacker_text(res: dict[str, Any]) -> str:
    """The attacker's outcome in a few words (its largest counts, its notes)."""
    if not res:
        return ""
    parts = [f"{k}: {v:,}" for k, v in sorted((res.get("counts") or {}).items(),
                                               key=lambda kv: -kv[1])[:4]]
    parts += [f"{k} {v}" for k, v in (res.get("notes") or {}).items()]
    if res.get("error"):
        parts.append(f"ERROR {res['error']}")
    return "; ".join(parts)


def markdown(report: dict[str, Any]) -> str:
    rows, phases = report["rows"], report["phases"]
    pinning = ("master and victim on CPU 0, attacker on CPU 1" if report["pinned"]
               else "unpinned")
    load = [round(x, 2) for x in report["loadavg_before"]], \
        [round(x, 2) for x in report["loadavg_after"]]
    out = [f"Command: `{report['command']}`  ", f"Machine: {report['machine']}  ",
           f"kvmaster code: {report['kvmaster_code']}  ",
           f"Started {report['started']}; {report['seconds']:.0f} s in all; master flags "
           f"`{shlex.join(report['master_flags'])}`; attack phases {report['attack_s']} s, "
           f"quiet {report['quiet_s']} s; {pinning}.  ",
           f"Other work before the run: {report['busy_before']:.0%} of the CPUs busy (1 s "
           f"sample), load average {load[0]}; at the end {load[1]}.", "",
           "Victim iteration = put 4 KiB + get + get_batch of 64 (ms). Ratio = attack / mean of "
           "the quiet phases before and after it. Goal: within 2x. Setup and close: median "
           "of three new clients per phase (max of the attack phase's three).", "",
           "| attack | victim segment | quiet p50 | attack p50 | p50 ratio | quiet p99 | "
           "attack p99 | p99 ratio | within 2x | victim errors | new client setup ms quiet / "
           "attack (max) | its close ms quiet / attack (max) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        it = r["ops"]["iteration"]
        out.append("| " + " | ".join([
            r["attack"], r["victim"], _f(it["quiet_p50_ms"]), _f(it["attack_p50_ms"]),
            f"{it['p50_ratio']:.2f}x", _f(it["quiet_p99_ms"]), _f(it["attack_p99_ms"]),
            f"{it['p99_ratio']:.2f}x", "yes" if r["within_2x"] else "NO",
            str(r["victim_errors"]),
            *(f"{_f(r[w + '_ms_quiet'], 0)} / {_f(r[w + '_ms_attack'], 0)} "
              f"({_f(r[w + '_ms_attack_max'], 0)})" for w in ("setup", "close"))]) + " |")
    out += ["", "Per op (p50 / p99 ms, ratio):", "",
            "| attack | op | quiet p50 | attack p50 | ratio | quiet p99 | attack p99 | ratio |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for op in OPS[1:]:
            o = r["ops"][op]
            out.append(f"| {r['attack']} | {op} | {_f(o['quiet_p50_ms'], 3)} | "
                       f"{_f(o['attack_p50_ms'], 3)} | {o['p50_ratio']:.2f}x | "
                       f"{_f(o['quiet_p99_ms'], 3)} | {_f(o['attack_p99_ms'], 3)} | "
                       f"{o['p99_ratio']:.2f}x |")
    out += ["", "What each attacker did (largest counts):", ""]
    for r in rows:
        extra = ""
        if r["victim"] == "shared":
            extra = (f" Victim's hit rate of its {EARLY} earlier objects: "
                     f"{_f(r.get('hit_rate_before'), 3)} before, "
                     f"{_f(r.get('hit_rate_after'), 3)} after.")
        out.append(f"* {r['attack']} ({ {**ATTACKS, **CONTROLS}[r['attack']][1]}): "
                   f"{attacker_text(r['attacker'])}.{extra}")
    out += ["", "Phases in order (victim iteration ms; master CPU and RSS):", "",
            "| # | phase | victim | p50 | p99 | mean | iterations/s | victim errors | "
            "master CPU % | master RSS MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, ph in enumerate(phases):
        s = ph["summary"]
        errs = ", ".join(f"{k} {v}" for k, v in ph["errors"].items()) or "0"
        out.append(f"| {i} | {ph['attack'] or 'quiet'} | {ph['victim']} | "
                   f"{_f(s['iteration']['p50_ms'])} | {_f(s['iteration']['p99_ms'])} | "
                   f"{_f(s['iteration']['mean_ms'])} | "
                   f"{_f(s['iterations_s'], 0)} | {errs} | {_f(ph['master_cpu_pct'], 0)} | "
                   f"{_f(ph['master_rss_mib'], 0)} |")
    end = report["end"]
    out += ["", f"At the end: master running {end['master_alive']}; CHECK_CONSISTENCY "
                f"(admin tenant) problems: {end['consistency']}.", ""]
    return "\n".join(out)


# ----------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="short phases (1 s attack, 0.6 s quiet), a small session, no "
                        "control: ~30 s")
    p.add_argument("--attack-s", type=float, default=0.0, help="seconds per attack phase "
                   "(default 6, --quick 1)")
    p.add_argument("--quiet-s", type=float, default=0.0, help="seconds per quiet phase "
                   "(default 5, --quick 0.6)")
    p.add_argument("--ramp-s", type=float, default=-1.0,
                   help="seconds between an attacker's start and the victim's window "
                        "(default 0.3, --quick 0.1)")
    p.add_argument("--attacks", default="",
                   help="comma list of " + ", ".join(ATTACKS) + "; or the controls "
                        + ", ".join(CONTROLS) + " (floods of ordinary requests); default: "
                        "every attack and flood_exist (--quick: the attacks only)")
    p.add_argument("--pin", action="store_true",
                   help="master and victim on CPU 0, attacker on CPU 1")
    p.add_argument("--master-args", default=shlex.join(MASTER_FLAGS), metavar="FLAGS",
                   help="the master's flags (--port 0 --metrics-port -1 are added)")
    p.add_argument("--victim-segment-mib", type=int, default=32)
    p.add_argument("--depth", type=int, default=16, help="requests a raw attacker keeps in "
                   "flight")
    p.add_argument("--writers", type=int, default=16, help="capacity attack: writer threads")
    p.add_argument("--reader-keys", type=int, default=0,
                   help="never-reads attack: keys of ~4 KB in its session (default 3000, "
                        "--quick 300)")
    p.add_argument("--reader-requests", type=int, default=0,
                   help="never-reads attack: most requests sent (0: as many as the socket "
                        "takes during the phase)")
    p.add_argument("--abandon-size", type=int, default=64,
                   help="abandoned-writes attack: bytes of each write")
    p.add_argument("--attack-clients", type=int, default=256,
                   help="client-slots attack: connections opened (the master's --max-clients)")
    p.add_argument("--prepare-timeout", type=float, default=120.0)
    p.add_argument("--json", default="", help="write all results here")
    p.add_argument("--md", default="", help="write the markdown tables here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (master log)")


def cmd_attack(a: argparse.Namespace) -> int:
    a.attack_s = a.attack_s or (1.0 if a.quick else 6.0)
    a.quiet_s = a.quiet_s or (0.6 if a.quick else 5.0)
    a.ramp_s = a.ramp_s if a.ramp_s >= 0 else (0.1 if a.quick else 0.3)
    a.reader_keys = a.reader_keys or (300 if a.quick else 3000)
    a.attacks = a.attacks or ",".join(ATTACKS if a.quick else [*ATTACKS, "flood_exist"])
    attacks = [x for x in a.attacks.split(",") if x]
    unknown = [x for x in attacks if x not in ATTACKS and x not in CONTROLS]
    if unknown:
        print(f"unknown attacks {unknown}; known: {', '.join([*ATTACKS, *CONTROLS])}",
              file=sys.stderr)
        return 2
    flags = shlex.split(a.master_args) + ["--metrics-port", "-1", "--log-level", "WARNING"]
    root = Path(tempfile.mkdtemp(prefix="kvattack-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report: dict[str, Any] = {
        "command": " ".join(["python -m kvmaster.tools.bench", *sys.argv[1:]]),
        "machine": machine_notes(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "kvmaster_code": code_version(), "master_flags": flags, "attack_s": a.attack_s,
        "quiet_s": a.quiet_s, "pinned": a.pin, "loadavg_before": list(os.getloadavg()),
        "busy_before": machine_busy(1.0)}
    t_start = time.monotonic()
    if a.pin:
        os.sched_setaffinity(0, {0})
    phases: list[dict[str, Any]] = []
    try:
        with Master("kvmaster", a.pin, root, flags) as master:
            victim = Victim(master.addr, a.victim_segment_mib * MiB)
            try:
                for attack, mode in schedule(attacks):
                    ph = run_phase(victim, master, attack, mode, a)
                    phases.append(ph)
                    it = ph["summary"]["iteration"]
                    print(f"phase {len(phases)}: {attack or 'quiet':<18} {mode:<6} p50 "
                          f"{it['p50_ms']:.2f} ms p99 {it['p99_ms']:.2f} ms, errors "
                          f"{sum(ph['errors'].values())}, load {os.getloadavg()[0]:.2f}",
                          file=sys.stderr, flush=True)
                    if not ph["master_alive"]:
                        break
                report["end"] = end_check(master)
            finally:
                victim.close()
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    report["phases"] = phases
    report["rows"] = ratios(phases)
    report["loadavg_after"] = list(os.getloadavg())
    report["seconds"] = time.monotonic() - t_start
    text = markdown(report)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1, default=str))
    if a.md:
        Path(a.md).write_text(text + "\n")
    return 0 if report["end"]["master_alive"] else 1


def end_check(master: Master) -> dict[str, Any]:
    """Is the master still running, and does the admin tenant's CHECK_CONSISTENCY pass?"""
    from kvmaster import Client

    alive = master._proc is not None and master._proc.poll() is None
    out: dict[str, Any] = {"master_alive": alive, "consistency": "not run"}
    if alive:
        admin = Client()
        try:
            admin.setup(master.addr, 0)
            problems = admin.check_consistency()
            out["consistency"] = problems or "none"
            st = admin.stats()
            out["stats"] = {k: st.get(k) for k in ("clients", "segments", "keys",
                                                   "pending_writes", "tenant_quota_refusals",
                                                   "evicted_keys")}
            out["front"] = st.get("front")
        except Exception as exc:  # noqa: BLE001 - reported
            out["consistency"] = f"failed: {_err(exc)} {exc}"
        finally:
            admin.close()
    return out
