"""``kvmaster ctl``: query and administer a running master.

Connects as a consumer-only client (no segment is mounted, so the master's
capacity is untouched), runs one command and says BYE::

    kvmaster ctl --master 127.0.0.1:50051 stats
    kvmaster ctl segments | clients | config [--toml] | check
    kvmaster ctl key KEY [KEY ...]
    kvmaster ctl session ID [--keys] [--limit N]
    kvmaster ctl remove KEY [KEY ...] [--force] [--yes]
    kvmaster ctl remove-all [--force] [--yes]
    kvmaster ctl clean-segments [--tag TAG | --all-tags] [--clients] [--dry-run]

``clean-segments`` works on this host's /dev/shm and talks to no master: it
removes segment files that no live process maps or holds open and lists what it
removed and what it kept, and why (``kvmaster._segment.remove_stale_segments``).

Human tables by default, ``--json`` for scripts.  Keys and sessions are those
of ``--tenant``.  Destructive commands ask for confirmation on stdin unless
``--yes`` is given.  Exit status: 0 done, 1 the master refused or a key was
not found (or the answer was "no"), 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, TextIO

__all__ = ["add_arguments", "human_bytes", "run", "table"]

DEFAULT_MASTER = "127.0.0.1:50051"


# ---------------------------------------------------------------- formatting

def human_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - loop always returns


def percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
          right: Sequence[int] = ()) -> str:
    """Plain aligned columns (stable for ``grep``/``awk``); columns in ``right``
    are right-aligned."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _pairs(rows: Sequence[tuple[str, Any]]) -> str:
    """``name  value`` lines; a value with newlines continues under its first line."""
    width = max((len(k) for k, _ in rows), default=0)
    pad = "\n" + " " * (width + 2)
    return "\n".join(f"{k.ljust(width)}  {str(v).replace(chr(10), pad)}" for k, v in rows)


# ------------------------------------------------------------------ commands

def _stats(client: Any, args: argparse.Namespace, out: TextIO) -> int:
    s = client.stats()
    if args.json:
        _dump(s, out)
        return 0
    cap, used = s.get("capacity_bytes", 0), s.get("allocated_bytes", 0)
    shards = s.get("shards", [])
    front = s.get("front", {})
    rows: list[tuple[str, Any]] = [
        ("master", f"{args.master}  state {s.get('state')}  clients {s.get('clients')}  "
                   f"segments {s.get('segments')}  shards {len(shards)}"),
        ("capacity", f"{human_bytes(cap)}  allocated {human_bytes(used)} ({percent(used, cap)})"),
        ("keys", f"{s.get('keys', 0)}  soft-pinned {s.get('soft_pinned_keys', 0)}  "
                 f"hard-pinned {s.get('hard_pinned_keys', 0)}  "
                 f"pending puts {s.get('pending_writes', 0)}"),
        ("evictions", f"keys {s.get('evicted_keys', 0)}  "
                      f"bytes {human_bytes(s.get('evicted_bytes', 0))}  "
                      f"rounds {s.get('eviction_rounds', 0)}  "
                      f"soft-pinned keys {s.get('evicted_soft_pinned_keys', 0)}  "
                      f"alloc failures {s.get('alloc_failures', 0)}"),
        ("sessions", f"{s.get('sessions', 0)} live  {s.get('pinned_sessions', 0)} pinned  "
                     f"memberships {s.get('memberships', 0)}  "
                     f"created {s.get('sessions_created', 0)}  "
                     f"deleted {s.get('sessions_deleted', 0)}  "
                     f"limit rejections {s.get('session_limit_rejections', 0)}"),
        ("requests", f"{s.get('requests', 0)}  failures {s.get('failures', 0)}  "
                     f"leases granted {s.get('leases_granted', 0)}"),
        ("puts", f"discarded {s.get('put_start_discarded', 0)}  "
                 f"released {s.get('put_start_released', 0)}  "
                 f"erased with segment {s.get('objects_erased_with_segment', 0)}"),
        *([("op log", _oplog_text(s["oplog"]))] if s.get("oplog") else []),
        # The front's non-zero counters, wrapped (there are about thirty).
        ("front", "\n".join(textwrap.wrap("  ".join(f"{k} {v}" for k, v in front.items() if v),
                                           width=88, break_on_hyphens=False)) or "-"),
    ]
    out.write(_pairs(rows) + "\n\n")
    out.write(table(
        ["shard", "keys", "allocated", "capacity", "used", "requests", "failures", "queue",
         "evicted", "sessions"],
        [[sh.get("shard"), sh.get("keys"), human_bytes(sh.get("allocated_bytes")),
          human_bytes(sh.get("capacity_bytes")),
          percent(sh.get("allocated_bytes", 0), sh.get("capacity_bytes", 0)),
          sh.get("requests"), sh.get("failures"), sh.get("inbox_depth"),
          sh.get("evicted_keys"), sh.get("sessions")] for sh in shards],
        right=range(1, 10)) + "\n")
    return 0


def _oplog_text(o: dict[str, Any]) -> str:
    """The --ha-oplog line of ``ctl stats`` (a leader's writer: a standby answers no
    STATS; its lag is on its metrics page, ``master_oplog_lag_seconds``)."""
    line = (f"{o.get('role')}  records {o.get('oplog_records', 0)}  "
            f"bytes {human_bytes(o.get('oplog_bytes', 0))}  "
            f"pending {o.get('pending_records', 0)}  retries {o.get('oplog_retries', 0)}  "
            f"adopted at promotion {o.get('adopted_objects', 0)} "
            f"(log read in {o.get('catch_up_s', 0):.3f} s)")
    for sb in o.get("standbys") or []:
        age = sb.get("snapshot_age_s")
        line += (f"\nstandby {sb.get('endpoint')}  behind {sb.get('behind_batches')} batches  "
                 f"caught up {sb.get('lag_s', 0):.2f} s ago  snapshot "
                 + ("none" if age is None else f"{age:.0f} s old"))
    return line


def _segments(client: Any, args: argparse.Namespace, out: TextIO) -> int:
    segs = client.list_segments()
    if args.json:
        _dump(segs, out)
        return 0
    out.write(table(
        ["name", "owner", "host", "transport", "size", "usable", "allocated", "used"],
        [[s["name"], s["owner"], s["host_id"], s["transport"], human_bytes(s["size"]),
          human_bytes(s["usable"]), human_bytes(s["allocated"]),
          percent(s["allocated"], s["usable"])] for s in segs],
        right=(4, 5, 6, 7)) + "\n")
    out.write(f"{len(segs)} segment(s)\n")
    return 0


def _clients(client: Any, args: argparse.Namespace, out: TextIO) -> int:
    clients = client.list_clients()
    if args.json:
        _dump(clients, out)
        return 0
    out.write(table(
        ["client", "tenant", "host", "idle", "segments"],
        [[c["client_id"], c["tenant"], c["host_id"],
          f"{c['idle_ms'] / 1000:.1f}s" + (" suspected" if c.get("suspected") else ""),
          ",".join(c["segments"]) or "-"] for c in clients], right=(3,)) + "\n")
    out.write(f"{len(clients)} client(s)\n")
    return 0


def _key(client: Any, args: argparse.Namespace, out: TextIO) -> int:
    from kvmaster.errors import ObjectNotFound

    results: list[dict[str, Any]] = []
    for key in args.keys:
        try:
            results.append({"key": key, "found": True, **client.query_key(key)})
        except ObjectNotFound:
            results.append({"key": key, "found": False})
    if args.json:
        _dump(results if len(results) > 1 else results[0], out)
    else:
        blocks = []
        for r in results:
            if not r["found"]:
                blocks.append(_pairs([("key", r["key"]), ("state", "not found")]))
                continue
            rows: list[tuple[str, Any]] = [("key", r["key"]), ("state", r.get("state"))]
            if "size" in r:
                rows += [
                    ("size", f"{human_bytes(r['size'])} ({r['size']} bytes)"),
                    ("replicas", ", ".join(f"{seg}@{off}" for seg, off in r.get("replicas", []))),
                    ("lease", f"{r['lease_ms_left'] / 1000:.1f} s left"
                     if r.get("lease_ms_left") else "none"),
                    ("soft pin", "yes" if r.get("soft_pinned") else "no"),
                    ("hard pin", "yes" if r.get("hard_pinned") else "no"),
                    ("sessions", ", ".join(_text(x) for x in r.get("sessions", [])) or "-"),
                ]
                if r.get("session_tag"):
                    rows.append(("session tag", _text(r["session_tag"])))
            pw = r.get("pending_write")
            if pw:
                rows.append(("pending put", f"client {pw['client_id']}  "
                                            f"size {pw['size']}  age {pw['age_ms']} ms"))
            blocks.append(_pairs(rows))
        out.write("\n\n".join(blocks) + "\n")
    return 0 if all(r["found"] for r in results) else 1


def _session(client: Any, args: argparse.Namespace, out: TextIO) -> int:
    info = client.get_kv_session(args.session_id)
    keys: list[str] = []
    truncated = False
    if args.keys:
        for k in client.iter_kv_session_keys(args.session_id, page=min(args.limit, 4096)):
            if len(keys) >= args.limit:
                truncated = True
                break
            keys.append(k)
    if args.json:
        body: dict[str, Any] = dataclasses.asdict(info)
        if args.keys:
            body.update(keys=keys, truncated=truncated)
        _dump(body, out)
        return 0
    out.write(_pairs([("session", info.session_id), ("pinned", "yes" if info.pinned else "no"),
                      ("members", info.member_count)]) + "\n")
    if args.keys:
        out.write("\n".join(keys) + ("\n" if keys else ""))
        if truncated:
            out.write(f"... first {len(keys)} of {info.member_count} keys (raise --limit)\n")
    return 0


def _remove(client: Any, args: argparse.Namespace, out: TextIO) -> int:
    from kvmaster.protocol import Status

    keys = list(dict.fromkeys(args.keys))
    what = f"{len(keys)} key(s)" if len(keys) > 1 else f"key {keys[0]!r}"
    if not _confirm(args, f"Remove {what} of tenant {args.tenant!r} from {args.master}"
                          f"{' (force: even if leased)' if args.force else ''}?"):
        return 1
    codes = client.batch_remove(keys, force=args.force)
    results = [{"key": k, "code": int(c), "status": _status_name(Status, c)}
               for k, c in zip(keys, codes)]
    if args.json:
        _dump({"removed": sum(1 for r in results if r["code"] == 0), "results": results}, out)
    else:
        out.write(table(["key", "result"],
                        [[r["key"], "removed" if r["code"] == 0 else r["status"]]
                         for r in results]) + "\n")
        if any(r["code"] == Status.OBJECT_HAS_LEASE for r in results):
            out.write("(OBJECT_HAS_LEASE: a reader holds a lease on it; --force removes it "
                      "anyway)\n")
    return 0 if all(r["code"] == 0 for r in results) else 1


def _remove_all(client: Any, args: argparse.Namespace, out: TextIO) -> int:
    if not _confirm(args, f"Remove EVERY object of tenant {args.tenant!r} from {args.master}"
                          f"{' including leased ones' if args.force else ''}? "
                          f"This cannot be undone."):
        return 1
    n = client.remove_all(force=args.force)
    if args.json:
        _dump({"removed": n}, out)
    else:
        note = "" if args.force else " (objects with a read lease stay; --force removes them)"
        out.write(f"removed {n} object(s){note}\n")
    return 0


def _config(client: Any, args: argparse.Namespace, out: TextIO) -> int:
    cfg = client.get_config()
    if args.toml:
        out.write(config_toml(cfg))
        return 0
    if args.json:
        _dump(cfg, out)
        return 0
    from kvmaster.config import MasterConfig

    known = {f.name for f in dataclasses.fields(MasterConfig)}
    out.write(table(["flag", "value"],
                    [["--" + k.replace("_", "-") if k in known else k, json.dumps(v)]
                     for k, v in cfg.items()]) + "\n")
    return 0


def config_toml(cfg: dict[str, Any]) -> str:
    """A master's GET_CONFIG answer as a file for ``kvmaster master --config``."""
    from kvmaster.config import MasterConfig, to_toml

    known = {f.name for f in dataclasses.fields(MasterConfig)}
    config = MasterConfig(**{k: v for k, v in cfg.items() if k in known})
    head = "# from a running master (kvmaster ctl config --toml)\n"
    if cfg.get("curve"):
        head += "# CURVE is on there; set curve-dir to the key directory\n"
    return head + "\n".join(line for line in to_toml(config).splitlines()
                            if not line.startswith(("curve-dir", "# key directory"))) + "\n"


def _clean_segments(args: argparse.Namespace, out: TextIO) -> int:
    """``clean-segments``: remove this host's segment files that dead processes left.

    By default only masters' own segments (``--master-segment-size``) whose master is
    dead; ``--clients`` also clients' segments not modified for ``--min-age`` seconds.
    Files of the tag in KVMASTER_SEGMENT_TAG (or ``--tag``; ``--all-tags`` for every
    tag).  A file some live process maps or holds open is never removed."""
    from kvmaster._segment import remove_stale_segments, segment_tag

    try:
        tag = None if args.all_tags else (args.tag if args.tag is not None else segment_tag())
    except ValueError as exc:
        print(f"kvmaster ctl clean-segments: {exc}", file=sys.stderr)
        return 2
    if args.min_age < 0:
        print("kvmaster ctl clean-segments: --min-age must be at least 0", file=sys.stderr)
        return 2
    report = remove_stale_segments(tag, masters_only=not args.clients, min_age=args.min_age,
                                   dry_run=args.dry_run)
    if args.json:
        _dump({"dry_run": args.dry_run, **report}, out)
        return 0
    verb = "would be removed" if args.dry_run else "removed"
    rows = [[name, "would remove" if args.dry_run else "removed", ""]
            for name in report["removed"]]
    rows += [[k["name"], "kept", k["reason"]] for k in report["kept"]]
    if rows:
        out.write(table(["file", "action", "why kept"], rows) + "\n")
    out.write(f"{len(report['removed'])} file(s) {verb}, {len(report['kept'])} kept\n")
    return 0


def _check(client: Any, args: argparse.Namespace, out: TextIO) -> int:
    problems = client.check_consistency()
    if args.json:
        _dump({"consistent": not problems, "problems": problems}, out)
    elif problems:
        out.write("\n".join(problems) + f"\n{len(problems)} problem(s)\n")
    else:
        out.write("consistent\n")
    return 1 if problems else 0


# ------------------------------------------------------------------- helpers

def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _status_name(status_cls: Any, code: int) -> str:
    try:
        return status_cls(code).name
    except ValueError:
        return str(code)


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, dict):
        return {_text(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _dump(obj: Any, out: TextIO) -> None:
    out.write(json.dumps(_jsonable(obj), indent=2, sort_keys=False) + "\n")


def _confirm(args: argparse.Namespace, question: str) -> bool:
    """True with ``--yes``; otherwise ask on stderr and read one line of stdin."""
    if args.yes:
        return True
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline()
    if answer.strip().lower() in ("y", "yes"):
        return True
    sys.stderr.write("aborted: nothing removed" + ("" if answer else " (no answer on stdin; "
                                                   "pass --yes to skip the question)") + "\n")
    return False


_COMMANDS: dict[str, Callable[[Any, argparse.Namespace, TextIO], int]] = {
    "stats": _stats, "segments": _segments, "clients": _clients, "key": _key,
    "session": _session, "remove": _remove, "remove-all": _remove_all, "config": _config,
    "check": _check,
}


def _add_connection_args(p: argparse.ArgumentParser, suppress: bool) -> None:
    """Options valid before and after the command (``ctl --json stats`` and
    ``ctl stats --json``); the copies after it default to SUPPRESS so they do not
    overwrite values given before it."""
    def d(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    p.add_argument("--master", default=d(DEFAULT_MASTER), metavar="HOST:PORT",
                   help=f"master address (default: {DEFAULT_MASTER})")
    p.add_argument("--tenant", default=d("default"),
                   help="tenant whose keys and sessions are addressed (default: default)")
    p.add_argument("--json", action="store_true", default=d(False),
                   help="print JSON instead of tables")
    p.add_argument("--timeout", type=float, default=d(5.0), metavar="S",
                   help="seconds to wait for the master (default: 5)")
    p.add_argument("--curve-dir", default=d(""), metavar="DIR",
                   help="key directory from `kvmaster keygen` when the master uses CURVE")
    p.add_argument("--curve-client", default=d(""), metavar="NAME",
                   help="client key name in DIR/clients")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define ``kvmaster ctl``'s options and commands on ``parser``."""
    _add_connection_args(parser, suppress=False)
    sub = parser.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")

    def cmd(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        _add_connection_args(p, suppress=True)
        return p

    cmd("stats", "counters and gauges: totals, front, per shard")
    cmd("segments", "mounted segments with size and allocated bytes")
    cmd("clients", "registered clients (every tenant's for the admin tenant)")
    p = cmd("key", "replicas, lease, pins and sessions of keys (does not touch them)")
    p.add_argument("keys", nargs="+", metavar="KEY")
    p = cmd("session", "a KV session: pinned, member count and, with --keys, its members")
    p.add_argument("session_id", metavar="ID")
    p.add_argument("--keys", action="store_true", help="list member keys")
    p.add_argument("--limit", type=int, default=1000, help="most keys to list (default: 1000)")
    for name, text in (("remove", "remove keys (asks first unless --yes)"),
                       ("remove-all", "remove every object of the tenant (asks first unless "
                                      "--yes)")):
        p = cmd(name, text)
        if name == "remove":
            p.add_argument("keys", nargs="+", metavar="KEY")
        p.add_argument("--force", action="store_true", help="remove even objects with a lease")
        p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p = cmd("config", "the master's configuration (every flag's value)")
    p.add_argument("--toml", action="store_true",
                   help="print it as a file for `kvmaster master --config`")
    cmd("check", "the master's invariant check (walks every object; slow on big stores)")
    p = cmd("clean-segments", "remove this host's segment files that dead masters (and, with "
                              "--clients, dead clients) left in /dev/shm; never one a live "
                              "process maps or holds open (needs no master)")
    p.add_argument("--tag", default=None,
                   help="KVMASTER_SEGMENT_TAG of the files ('' = untagged; default: this "
                        "process's KVMASTER_SEGMENT_TAG)")
    p.add_argument("--all-tags", action="store_true", help="files of every tag")
    p.add_argument("--clients", action="store_true",
                   help="also clients' segments that nothing maps (processes in other pid "
                        "namespaces sharing /dev/shm are not seen: do not use it there)")
    p.add_argument("--min-age", type=float, default=60.0, metavar="S",
                   help="with --clients: only files not modified for S seconds (default: 60)")
    p.add_argument("--dry-run", action="store_true", help="list what would go; remove nothing")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the parsed ``kvmaster ctl`` command; returns the exit status."""
    from kvmaster.client import Client, ClientConfig
    from kvmaster.errors import KVMasterError

    out = out if out is not None else sys.stdout
    if args.ctl_command == "clean-segments":
        return _clean_segments(args, out)
    if getattr(args, "limit", 1) < 1:
        print("kvmaster ctl: --limit must be at least 1", file=sys.stderr)
        return 2
    client = Client(ClientConfig(timeout_s=args.timeout, connect_timeout_s=args.timeout))
    try:
        client.setup(args.master, 0, args.tenant, curve_dir=args.curve_dir or None,
                     curve_client=args.curve_client or None)
        return _COMMANDS[args.ctl_command](client, args, out)
    except KVMasterError as exc:
        print(f"kvmaster ctl {args.ctl_command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`kvmaster ctl ... | head`): stop quietly, as cat does.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0
    except (OSError, ValueError) as exc:
        print(f"kvmaster ctl {args.ctl_command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
