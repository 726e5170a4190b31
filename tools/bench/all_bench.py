"""All three benchmarks in one command, and one summary of ratios against the anchors.

``python -m kvmaster.tools.bench all [--quick] [--runs N] [--pin [off|on|both]]
[--out DIR] [--only store,scale,sessions] [--store-args ARGS] [--scale-args ARGS]
[--session-args ARGS]``

Runs, one after the other and each as its own process, the store benchmark
(``bench store``: kvmaster vs the Mooncake master), the scale-out benchmark
(``bench.scale_bench``: shard processes, client processes vs Mooncake, data
path vs Redis) and the session benchmark (``bench.session_bench``: sessions vs
Redis sets).  ``--quick`` and ``--runs`` go to all three; ``--pin`` goes to the
store tool as given and to the session tool as ``--pin`` (for ``on`` and
``both``); the scale tool has no pinning.  ``--store-args`` / ``--scale-args`` /
``--session-args`` are appended to that tool's command line (shell-style
quoting; a later option wins, e.g. ``--scale-args "--groups data"``).

Each tool writes ``DIR/<tool>.json`` and ``DIR/<tool>.md`` (tool = store, scale,
sessions); its stdout goes to ``DIR/<tool>.out`` and its stderr (progress) to
the console and ``DIR/<tool>.err``.  ``DIR`` defaults to a new directory under
/tmp, printed at the start.  A tool that fails does not stop the others.

The summary is read back from the three JSON files: one row per (scenario, op)
with kvmaster's figure, the anchor's figure from the same run, the ratio
kvmaster / anchor, and the goal where one applies:

* store, batch group: keys/s at least 2x Mooncake's (every op and batch size);
* store, single group: p50 no worse than Mooncake's (ratio <= 1);
* scale, data group: get of 64 KiB blocks (get_batch and batch_get_into vs
  pipelined GET) at least 3x Redis's MB/s;
* scale, scale group: modelled throughput of 4 shard processes at least 1.6x
  that of one (the tool's projections, with its largest client count: one core
  per master process, and one core per thread of each);
* sessions: the tool's own goals (rate at least that of the faster Redis
  variant; at most 120 B per membership).

Other rows (put vs SET, ops vs Mooncake, memory per object) show the ratio
without a goal.  A missing anchor figure or a tool that produced no JSON is
stated in the row.  The summary is printed and written to ``DIR/summary.md``
and ``DIR/summary.json``.  ``--from-dir DIR`` rebuilds it from the JSON files
already in DIR without running anything.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOOLS = ("store", "scale", "sessions")
MODULE = {"store": ["kvmaster.tools.bench", "store"], "scale": ["kvmaster.tools.bench.scale_bench"],
          "sessions": ["kvmaster.tools.bench.session_bench"]}
STATUS_FILE = "runs.json"  # per tool: command, exit code, seconds, last error line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="pass --quick to every tool")
    p.add_argument("--runs", type=int, default=None, help="pass --runs N to every tool "
                   "(default: each tool's own default)")
    p.add_argument("--pin", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                   help="store: --pin as given; sessions: --pin for on/both; scale: no pinning")
    p.add_argument("--out", default="", help="directory for the JSON / markdown files "
                   "(default: a new one under /tmp)")
    p.add_argument("--only", default=",".join(TOOLS), help="comma list of store,scale,sessions")
    p.add_argument("--store-args", default="", help="extra arguments for the store tool")
    p.add_argument("--scale-args", default="", help="extra arguments for scale_bench")
    p.add_argument("--session-args", default="", help="extra arguments for session_bench")
    p.add_argument("--from-dir", default="", metavar="DIR",
                   help="only rebuild the summary from the JSON files in DIR")


# ------------------------------------------------------------------ running

def tool_command(tool: str, a: argparse.Namespace, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", *MODULE[tool], "--json", str(out / f"{tool}.json"),
           "--md", str(out / f"{tool}.md")]
    if a.quick:
        cmd.append("--quick")
    if a.runs is not None:
        cmd += ["--runs", str(a.runs)]
    if tool == "store" and a.pin != "off":
        cmd += ["--pin", a.pin]
    if tool == "sessions" and a.pin != "off":
        cmd.append("--pin")
    extra = {"store": a.store_args, "scale": a.scale_args, "sessions": a.session_args}[tool]
    return cmd + shlex.split(extra)


def run_tool(cmd: list[str], out: Path, name: str) -> tuple[int, str]:
    """Run one tool; its stderr is copied to the console and DIR/<name>.err.
    Returns (exit code, last stderr line)."""
    last = ""
    with open(out / f"{name}.out", "wb") as so, open(out / f"{name}.err", "w") as se:
        # The tool gets its own session, so a Ctrl-C reaches it once, forwarded below, and
        # not its masters and workers in the middle of their cleanup.  SIGINT is reset to the
        # default in it (it is ignored, and inherited, when this command runs in the
        # background of a script) so that Python makes it a KeyboardInterrupt: the forwarding
        # relies on that, as only the store tool handles SIGTERM.
        proc = subprocess.Popen(cmd, stdout=so, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True, errors="replace", start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                se.write(line)
                se.flush()
                sys.stderr.write(f"  [{name}] {line}")
                sys.stderr.flush()
                last = line.strip() or last
            return proc.wait(), last
        finally:
            if proc.poll() is None:  # we are being interrupted: let the tool clean up
                for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                    proc.send_signal(sig)
                    try:
                        proc.wait(wait)
                        break
                    except subprocess.TimeoutExpired:
                        continue


def cmd_all(a: argparse.Namespace) -> int:
    only = [t for t in a.only.split(",") if t]
    bad = [t for t in only if t not in TOOLS]
    if bad:
        print(f"--only: unknown tool(s) {bad}; choose from {','.join(TOOLS)}", file=sys.stderr)
        return 2
    if a.from_dir:
        text, _ = write_summary(Path(a.from_dir), only)
        print(text)
        return 0
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="kvbench-all-"))
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    print(f"results directory: {out}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the running tool
    status: dict[str, Any] = {}
    t_all = time.monotonic()
    for tool in only:
        cmd = tool_command(tool, a, out)
        (out / f"{tool}.json").unlink(missing_ok=True)  # never summarise a stale file
        print(f"== {tool}: {shlex.join(cmd)}", flush=True)
        t0 = time.monotonic()
        try:
            rc, last = run_tool(cmd, out, tool)
        except KeyboardInterrupt:
            print(f"interrupted during {tool}; files so far in {out}", file=sys.stderr)
            return 130
        secs = time.monotonic() - t0
        status[tool] = {"command": shlex.join(cmd), "rc": rc, "seconds": round(secs, 1),
                        "last_stderr": last}
        (out / STATUS_FILE).write_text(json.dumps(status, indent=1))
        print(f"== {tool}: exit {rc} after {secs:.0f} s"
              + ("" if rc == 0 else f"; see {out / (tool + '.err')}"), flush=True)
    text, _ = write_summary(out, only)
    print(text)
    print(f"\nall: {time.monotonic() - t_all:.0f} s; files in {out}")
    return 0 if all(s["rc"] == 0 for s in status.values()) else 1


# ------------------------------------------------------------------ summary

def _num(x: Any) -> str:
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def _fin(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def row(scenario: str, op: str, unit: str, kv: Any, anchor: str, av: Any, goal: str = "",
        need: float | None = None, lower_better: bool = False, note: str = "") -> dict[str, Any]:
    """One summary row; ``need`` is the required ratio (kvmaster / anchor) for the goal."""
    kv, av = _fin(kv), _fin(av)
    ratio = kv / av if kv is not None and av else None
    verdict = ""
    if kv is None:
        verdict = note or "no kvmaster figure"
    elif av is None:
        verdict = note or f"anchor unavailable ({anchor})"
    elif need is not None and ratio is not None:
        verdict = "met" if (ratio <= need if lower_better else ratio >= need) else "NOT met"
    return {"scenario": scenario, "op": op, "unit": unit, "kvmaster": kv, "anchor": anchor,
            "anchor_value": av, "ratio": ratio, "goal": goal, "verdict": verdict}


def missing(scenario: str, goal: str, why: str) -> dict[str, Any]:
    return {"scenario": scenario, "op": "(all)", "unit": "", "kvmaster": None, "anchor": "",
            "anchor_value": None, "ratio": None, "goal": goal, "verdict": why}


def store_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    modes = data.get("modes", {})
    for mode, res in modes.items():
        med = res.get("median", {})
        tag = f" [{mode}]" if len(modes) > 1 or mode == "pinned" else ""
        if "single" in med:
            kv, mc = med["single"].get("kvmaster", {}), med["single"].get("mooncake", {})
            for op, r in kv.items():
                rows.append(row(f"store single{tag}", op, "p50 µs", r.get("p50_us"), "Mooncake",
                                mc.get(op, {}).get("p50_us"), "<= 1x (p50 no worse)", 1.0,
                                lower_better=True))
            for op, r in med["single"].get("kvmaster-ipc", {}).items():
                rows.append(row(f"store single{tag}", f"{op} (ipc)", "p50 µs", r.get("p50_us"),
                                "Mooncake", mc.get(op, {}).get("p50_us"),
                                "<= 1x (p50 no worse)", 1.0, lower_better=True))
        else:
            rows.append(missing(f"store single{tag}", "<= 1x (p50 no worse)", "group not run"))
        if "batch" in med:
            kv, mc = med["batch"].get("kvmaster", {}), med["batch"].get("mooncake", {})
            for op, r in kv.items():
                rows.append(row(f"store batch{tag}", op, "keys/s", r.get("keys_s"), "Mooncake",
                                mc.get(op, {}).get("keys_s"), ">= 2x", 2.0))
        else:
            rows.append(missing(f"store batch{tag}", ">= 2x", "group not run"))
        if "memory" in med:
            kv = med["memory"].get("kvmaster", {}).get("memory", {})
            mc = med["memory"].get("mooncake", {}).get("memory", {})
            rows.append(row(f"store memory{tag}", "master bytes/object", "B",
                            kv.get("bytes_per_object"), "Mooncake", mc.get("bytes_per_object")))
    return rows


def _clients(med: dict[str, Any], group: str, system: str) -> list[int]:
    return sorted({int(k.split("|")[2]) for k in med if k.startswith(f"{group}|{system}|")})


def scale_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    from .scale_bench import OPS_GROUP

    med = data.get("median", {})
    rows = []
    ncs = sorted(set(_clients(med, "scale", "sp1")) | set(_clients(med, "scale", "sp4")))
    if ncs:
        nc = str(ncs[-1])  # the tool's projection uses its largest client count
        for op in ("put_batch", "batch_is_exist"):
            rows.append(row(f"scale sp4 vs sp1, modelled, {nc} clients", op, "keys/s",
                            med.get(f"scale|sp4|{nc}|{op}", {}).get("model_units_s"), "sp1",
                            med.get(f"scale|sp1|{nc}|{op}", {}).get("model_units_s"),
                            ">= 1.6x", 1.6))
        for op in ("put_batch", "batch_is_exist"):
            rows.append(row(f"scale sp4 vs sp1, modelled per thread, {nc} clients", op,
                            "keys/s",
                            med.get(f"scale|sp4|{nc}|{op}", {}).get("model_thread_units_s"),
                            "sp1",
                            med.get(f"scale|sp1|{nc}|{op}", {}).get("model_thread_units_s"),
                            ">= 1.6x", 1.6))
    else:
        rows.append(missing("scale sp4 vs sp1, modelled", ">= 1.6x", "scale group not run"))
    for nc in _clients(med, "ops", "kvmaster"):
        for op in OPS_GROUP:
            kv = med.get(f"ops|kvmaster|{nc}|{op}")
            if kv is None:
                continue
            batch = op.endswith("_64")
            rows.append(row(f"scale ops, {nc} clients", op, "keys/s" if batch else "ops/s",
                            kv.get("units_s"), "Mooncake",
                            med.get(f"ops|mooncake|{nc}|{op}", {}).get("units_s"),
                            ">= 2x" if batch else "", 2.0 if batch else None))
    ncs = sorted(set(_clients(med, "data", "kvmaster")) | set(_clients(med, "data", "redis")))
    for nc in ncs:
        for size in ("64KiB", "4KiB"):
            for op, name in (("get", "get_batch vs GET"), ("get_into", "batch_get_into vs GET"),
                             ("put", "put_batch vs SET")):
                kv = med.get(f"data|kvmaster|{nc}|{op}_{size}", {})
                rd = med.get(f"data|redis|{nc}|{'put' if op == 'put' else 'get'}_{size}", {})
                if not kv and not rd:
                    continue
                goal = size == "64KiB" and op != "put"
                rows.append(row(f"scale data {size}, {nc} client(s)", name, "MB/s",
                                kv.get("units_s", math.nan) / 1e6, "Redis",
                                rd.get("units_s", math.nan) / 1e6,
                                ">= 3x" if goal else "", 3.0 if goal else None))
    if not ncs:
        rows.append(missing("scale data 64KiB", ">= 3x", "data group not run"))
    return rows


def session_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    from .session_bench import ROWS

    kv, rd = data["median"].get("kvmaster", {}), data["median"].get("redis", {})
    big = data.get("meta", {}).get("sizes", {}).get("big", 1)
    rows = []
    for rid, label, kpath, rpaths, unit in ROWS:
        if kpath not in kv:
            continue
        rates = {rp: rd[rp]["rate"] for rp in rpaths if rp in rd}
        # The tool's goal is against the faster Redis variant; with a variant missing that
        # is unknown, so the goal sits on the missing variant's row (undecided).
        best = (max(rates, key=rates.get) if len(rates) == len(rpaths)  # type: ignore[arg-type]
                else next(rp for rp in rpaths if rp not in rates))
        div = big if rid in ("pin", "unpin", "get") else 1  # O(1) ops: calls/s, as the tool
        if div != 1:
            unit = "calls/s"
        for rp in rpaths:
            goal = rid != "get" and rp == best  # the tool's goal: the faster Redis variant
            rows.append(row("sessions", f"{rid} (Redis {rp})", unit, kv[kpath]["rate"] / div,
                            "Redis", rates[rp] / div if rp in rates else None,
                            ">= 1x faster Redis variant" if goal else "", 1.0 if goal else None))
    for kind in ("disjoint", "overlap"):
        k, r = kv.get("mem_" + kind), rd.get("mem_" + kind)
        if k is None:
            continue
        x = row("sessions memory", f"{kind} B/membership", "B", k.get("bytes_per_membership"),
                "Redis", (r or {}).get("bytes_per_membership"), "<= 120 B")
        b = x["kvmaster"]
        if b is not None:  # absolute goal: stands without the anchor figure
            x["verdict"] = ("met" if b <= 120 else "NOT met") + (
                "" if x["anchor_value"] is not None else "; anchor unavailable (Redis)")
        rows.append(x)
    if not rows:
        rows.append(missing("sessions", "", "no kvmaster results in the JSON"))
    return rows


BUILD = {"store": store_rows, "scale": scale_rows, "sessions": session_rows}
EXPECTED = {"store": [("store single", "<= 1x (p50 no worse)"), ("store batch", ">= 2x")],
            "scale": [("scale sp4 vs sp1, modelled", ">= 1.6x"), ("scale data 64KiB", ">= 3x")],
            "sessions": [("sessions", "tool's goals")]}


def _store_run_notes(data: dict[str, Any]) -> list[str]:
    """store_bench's batch keys/s ratios run by run, per pinning mode."""
    from .store_bench import ratio_line, run_ratios

    out = []
    modes = data.get("modes", {})
    for mode, res in modes.items():
        batch = (res.get("runs") or {}).get("batch") or {}
        if len(batch.get("kvmaster", [])) < 2:
            continue
        tag = f" [{mode}]" if len(modes) > 1 or mode == "pinned" else ""
        out += [f"store batch{tag} {row}, run by run: {ratio_line(rs, 2.0)}"
                for row, rs in run_ratios(batch).items()]
    return out


def _paired_notes(data: dict[str, Any]) -> list[str]:
    """scale_bench's sp4 / sp1 ratios run by run, at its largest client count."""
    from .scale_bench import paired_line

    paired = data.get("paired") or {}
    ncs = sorted({int(k.split("|")[0]) for k in paired})
    if not ncs:
        return []
    nc = str(ncs[-1])
    out = []
    for key, what in (("model_units_s", "modelled"), ("model_thread_units_s",
                                                      "modelled per thread")):
        for op in ("put_batch", "batch_is_exist"):
            line = paired_line(paired, nc, op, key)
            if line:
                out.append(f"scale sp4 vs sp1, {what}, {nc} clients, {op}, run by run: {line}")
    return out


def summarize(out: Path, only: list[str]) -> dict[str, Any]:
    status = {}
    if (out / STATUS_FILE).exists():
        status = json.loads((out / STATUS_FILE).read_text())
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for tool in only:
        f = out / f"{tool}.json"
        st = status.get(tool, {})
        why = ""
        if not f.exists():
            why = (f"no results: {tool} tool exited {st['rc']} ({st.get('last_stderr', '')[:120]})"
                   if st else f"no results: {f.name} not found")
        else:
            try:
                data = json.loads(f.read_text())
                rows += BUILD[tool](data)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                why = f"unreadable {f.name}: {e!r}"
            else:
                if tool == "scale":
                    notes += _paired_notes(data)
                elif tool == "store":
                    notes += _store_run_notes(data)
                for fail in data.get("failures", []):  # scale_bench: cells left out
                    notes.append(f"{tool}: failed cell: {fail[:300]}")
                if st.get("rc"):
                    notes.append(f"{tool}: exited {st['rc']} after writing its JSON")
        if why:
            rows += [missing(sc, goal, why) for sc, goal in EXPECTED[tool]]
            notes.append(f"{tool}: {why}")
    return {"dir": str(out), "tools": status, "rows": rows, "notes": notes}


def render(summary: dict[str, Any]) -> str:
    lines = [f"## Summary: kvmaster vs anchors, same run ({summary['dir']})", "",
             "Ratio = kvmaster / anchor (for p50 latency lower is better, elsewhere higher).", "",
             "| scenario | op | unit | kvmaster | anchor | anchor value | ratio | goal | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "n/a"
        lines.append("| " + " | ".join([r["scenario"], r["op"], r["unit"], _num(r["kvmaster"]),
                                         r["anchor"], _num(r["anchor_value"]), ratio, r["goal"],
                                         r["verdict"]]) + " |")
    goals = [r for r in summary["rows"] if r["goal"]]
    met = sum(r["verdict"].startswith("met") for r in goals)
    lines += ["", f"Goal rows: {len(goals)}; met {met}, NOT met "
                  f"{sum(r['verdict'].startswith('NOT') for r in goals)}, undecided "
                  f"{len(goals) - met - sum(r['verdict'].startswith('NOT') for r in goals)}."]
    for tool, st in summary["tools"].items():
        lines.append(f"- {tool}: exit {st['rc']}, {st['seconds']:.0f} s: `{st['command']}`")
    lines += [f"- {n}" for n in summary["notes"]]
    return "\n".join(lines)


def write_summary(out: Path, only: list[str]) -> tuple[str, dict[str, Any]]:
    s = summarize(out, only)
    text = render(s)
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(s, indent=1))
    return text, s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmaster.tools.bench all", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return cmd_all(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
