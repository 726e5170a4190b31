"""``kvmaster top``: a live terminal view of a running master.

Polls the master's STATS as a consumer-only client every ``--interval``
seconds and redraws, with rates computed from successive snapshots:
capacity and allocation, hit/miss, evictions, pinned keys and bytes,
sessions, and per-shard load (requests/s, queue depth, evictions/s).  ``q``
or Ctrl-C quits; ``--once`` prints a single frame (rates over one interval)
and exits, for scripts and bug reports.

:func:`build_view` (snapshots -> numbers) and :func:`render` (numbers ->
rich renderable) are pure, so they are tested without a terminal.

Fields a master does not report are shown as ``-``, never as zero.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator
from typing import Any

from kvmaster.ctl import DEFAULT_MASTER, human_bytes

__all__ = ["add_arguments", "build_view", "render", "run"]

# Counter fields turned into per-second rates (whole master).
_RATE_FIELDS = ("requests", "failures", "evicted_keys", "evicted_bytes", "alloc_failures",
                "leases_granted", "sessions_created", "sessions_deleted",
                "session_limit_rejections", "get_hit_keys", "get_miss_keys", "exist_hit_keys",
                "exist_miss_keys", "evicted_soft_pinned_keys")
_SHARD_RATE_FIELDS = ("requests", "failures", "evicted_keys")
_FRONT_RATE_FIELDS = ("rejected_busy", "reply_dropped")


def _rate(cur: dict[str, Any], prev: dict[str, Any] | None, field: str, dt: float
          ) -> float | None:
    if prev is None or dt <= 0 or field not in cur or field not in prev:
        return None
    return max(0.0, (cur[field] - prev[field]) / dt)


def _ratio(hit: Any, miss: Any) -> float | None:
    if hit is None or miss is None or hit + miss == 0:
        return None
    return hit / (hit + miss)


def build_view(cur: dict[str, Any], prev: dict[str, Any] | None, dt: float) -> dict[str, Any]:
    """Numbers to show from the current and previous ``Client.stats()`` results,
    ``dt`` seconds apart (``prev`` None: no rates yet)."""
    rates = {f: _rate(cur, prev, f, dt) for f in _RATE_FIELDS}
    front, pfront = cur.get("front", {}), (prev or {}).get("front")
    prev_shards = {s.get("shard"): s for s in (prev or {}).get("shards", [])}
    shards = []
    for s in cur.get("shards", []):
        p = prev_shards.get(s.get("shard")) if prev is not None else None
        shards.append({**s, **{f"{f}_per_s": _rate(s, p, f, dt) for f in _SHARD_RATE_FIELDS}})
    hit_rates = {}
    for op in ("get", "exist"):
        hit, miss = cur.get(f"{op}_hit_keys"), cur.get(f"{op}_miss_keys")
        hit_rates[op] = {
            "total": _ratio(hit, miss),
            "interval": _ratio(rates.get(f"{op}_hit_keys"), rates.get(f"{op}_miss_keys")),
            "hits_per_s": rates.get(f"{op}_hit_keys"),
            "misses_per_s": rates.get(f"{op}_miss_keys"),
        }
    return {
        "state": cur.get("state"), "clients": cur.get("clients"),
        "segments": cur.get("segments"), "shard_count": len(shards),
        "capacity_bytes": cur.get("capacity_bytes"), "allocated_bytes": cur.get("allocated_bytes"),
        "keys": cur.get("keys"), "pending_writes": cur.get("pending_writes"),
        "soft_pinned_keys": cur.get("soft_pinned_keys"),
        "hard_pinned_keys": cur.get("hard_pinned_keys"),
        "soft_pinned_bytes": cur.get("soft_pinned_bytes"),
        "hard_pinned_bytes": cur.get("hard_pinned_bytes"),
        "evicted_keys": cur.get("evicted_keys"), "evicted_bytes": cur.get("evicted_bytes"),
        "evicted_soft_pinned_keys": cur.get("evicted_soft_pinned_keys"),
        "alloc_failures": cur.get("alloc_failures"),
        "sessions": cur.get("sessions"), "pinned_sessions": cur.get("pinned_sessions"),
        "memberships": cur.get("memberships"),
        "session_limit_rejections": cur.get("session_limit_rejections"),
        "rates": rates, "hit_rates": hit_rates, "shards": shards,
        "front": front,
        "front_rates": {f: _rate(front, pfront, f, dt) for f in _FRONT_RATE_FIELDS},
        "interval_s": dt if prev is not None else None,
    }


def _n(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}"
    return f"{v:,}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _bar(frac: float | None, width: int = 30) -> str:
    if frac is None:
        return "[" + " " * width + "]"
    filled = max(0, min(width, round(frac * width)))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def render(view: dict[str, Any], master: str, error: str | None = None,
           interactive: bool = True) -> Any:
    """A rich renderable of one frame."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    rates = view["rates"]
    cap, used = view.get("capacity_bytes"), view.get("allocated_bytes")
    frac = used / cap if cap and used is not None else None
    header = Text.assemble(
        ("kvmaster top ", "bold"), f"{master}  ",
        ("state ", "dim"), (str(view.get("state") or "-"),
                            "green" if view.get("state") == "running" else "yellow"),
        ("  clients ", "dim"), _n(view.get("clients")),
        ("  segments ", "dim"), _n(view.get("segments")),
        ("  shards ", "dim"), _n(view.get("shard_count")),
        ("  ", ""), time.strftime("%H:%M:%S"),
        ("  rates over ", "dim"),
        ("-" if view.get("interval_s") is None else f"{view['interval_s']:.1f}s"),
    )
    parts: list[Any] = [header]
    if error:
        parts.append(Text(f"master unreachable: {error}", style="bold red"))

    class Grid:
        """Label/value rows; values are plain text (no markup: a bar is ``[##..]``)."""

        def __init__(self) -> None:
            self.table = Table.grid(padding=(0, 1))
            self.table.add_column(style="dim", no_wrap=True)
            self.table.add_column(no_wrap=True)

        def add_row(self, label: str, value: str) -> None:
            self.table.add_row(label, Text(value))

    grid = Grid

    capacity = grid()
    capacity.add_row("used", f"{_bar(frac)} {_pct(frac)}")
    capacity.add_row("allocated", f"{human_bytes(used)} of {human_bytes(cap)}")
    capacity.add_row("keys", f"{_n(view.get('keys'))}  pending puts "
                             f"{_n(view.get('pending_writes'))}")
    capacity.add_row("soft-pinned", f"keys {_n(view.get('soft_pinned_keys'))}  "
                                    f"bytes {_bytes_or_dash(view.get('soft_pinned_bytes'))}")
    capacity.add_row("hard-pinned", f"keys {_n(view.get('hard_pinned_keys'))}  "
                                    f"bytes {_bytes_or_dash(view.get('hard_pinned_bytes'))}")

    traffic = grid()
    traffic.add_row("requests/s", f"{_n(rates.get('requests'))}  failures/s "
                                  f"{_n(rates.get('failures'))}")
    for op, label in (("get", "get hit"), ("exist", "exist hit")):
        h = view["hit_rates"][op]
        traffic.add_row(label, f"{_pct(h['interval'])} now  {_pct(h['total'])} overall  "
                               f"misses/s {_n(h['misses_per_s'])}")
    traffic.add_row("leases/s", _n(rates.get("leases_granted")))
    fr = view["front_rates"]
    traffic.add_row("busy/s", f"{_n(fr.get('rejected_busy'))}  dropped replies/s "
                              f"{_n(fr.get('reply_dropped'))}")

    evictions = grid()
    evictions.add_row("keys/s", f"{_n(rates.get('evicted_keys'))}  total "
                                f"{_n(view.get('evicted_keys'))}")
    evictions.add_row("bytes/s", f"{_bytes_or_dash(rates.get('evicted_bytes'))}  total "
                                 f"{_bytes_or_dash(view.get('evicted_bytes'))}")
    evictions.add_row("soft-pinned", f"keys {_n(view.get('evicted_soft_pinned_keys'))}")
    evictions.add_row("alloc fail", f"{_n(view.get('alloc_failures'))}  per s "
                                    f"{_n(rates.get('alloc_failures'))}")

    sessions = grid()
    sessions.add_row("live", f"{_n(view.get('sessions'))}  pinned "
                             f"{_n(view.get('pinned_sessions'))}")
    sessions.add_row("memberships", _n(view.get("memberships")))
    sessions.add_row("created/s", f"{_n(rates.get('sessions_created'))}  deleted/s "
                                  f"{_n(rates.get('sessions_deleted'))}")
    sessions.add_row("limit rejects", _n(view.get("session_limit_rejections")))

    panels = Table.grid(padding=(0, 1), expand=False)
    for _ in range(2):
        panels.add_column()
    panels.add_row(Panel(capacity.table, title="capacity", title_align="left"),
                   Panel(traffic.table, title="traffic", title_align="left"))
    panels.add_row(Panel(evictions.table, title="evictions", title_align="left"),
                   Panel(sessions.table, title="sessions", title_align="left"))
    parts.append(panels)

    shards = Table(title=None, box=None, header_style="bold", pad_edge=False)
    for name in ("shard", "keys", "allocated", "used", "req/s", "fail/s", "queue", "evict/s",
                 "sessions"):
        shards.add_column(name, justify="left" if name == "shard" else "right", no_wrap=True)
    for s in view["shards"]:
        cap_s, used_s = s.get("capacity_bytes"), s.get("allocated_bytes")
        shards.add_row(
            str(s.get("shard")), _n(s.get("keys")), human_bytes(used_s),
            _pct(used_s / cap_s if cap_s else None), _n(s.get("requests_per_s")),
            _n(s.get("failures_per_s")), _n(s.get("inbox_depth")),
            _n(s.get("evicted_keys_per_s")), _n(s.get("sessions")))
    parts.append(Panel(shards, title="shards", title_align="left", expand=False))
    if interactive:
        parts.append(Text("q or Ctrl-C quits", style="dim"))
    return Group(*parts)


def _bytes_or_dash(v: float | None) -> str:
    return "-" if v is None else human_bytes(v)


def _sleep_wait(t: float) -> str:
    time.sleep(t)
    return ""


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """Single-key input from a terminal stdin (cbreak mode, restored on exit);
    yields a function ``wait(seconds) -> key or ""``."""
    fd = sys.stdin.fileno() if sys.stdin is not None else -1
    if fd < 0 or not os.isatty(fd):
        yield _sleep_wait
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def wait(t: float) -> str:
        ready, _, _ = select.select([fd], [], [], max(0.0, t))
        return os.read(fd, 32).decode(errors="replace") if ready else ""

    try:
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", default=DEFAULT_MASTER, metavar="HOST:PORT",
                        help=f"master address (default: {DEFAULT_MASTER})")
    parser.add_argument("--tenant", default="default", help="tenant to connect as (default: default)")
    parser.add_argument("--interval", type=float, default=1.0, metavar="S",
                        help="seconds between refreshes (default: 1)")
    parser.add_argument("--once", action="store_true",
                        help="print one frame (rates over one interval) and exit")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="S",
                        help="seconds to wait for each snapshot (default: 2)")
    parser.add_argument("--curve-dir", default="", metavar="DIR",
                        help="key directory from `kvmaster keygen` when the master uses CURVE")
    parser.add_argument("--curve-client", default="", metavar="NAME",
                        help="client key name in DIR/clients")


def run(args: argparse.Namespace) -> int:
    """Run ``kvmaster top``; returns the exit status."""
    from rich.console import Console
    from rich.live import Live

    from kvmaster.client import Client, ClientConfig
    from kvmaster.errors import KVMasterError

    if args.interval < 0 or (args.interval == 0 and not args.once):
        print("kvmaster top: --interval must be > 0", file=sys.stderr)
        return 2
    if not args.once and not sys.stdout.isatty():
        print("kvmaster top: standard output is not a terminal: use --once to print one "
              "frame", file=sys.stderr)
        return 2
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 120))
    client = Client(ClientConfig(timeout_s=args.timeout, connect_timeout_s=args.timeout))
    try:
        client.setup(args.master, 0, args.tenant, curve_dir=args.curve_dir or None,
                     curve_client=args.curve_client or None)
    except KVMasterError as exc:
        print(f"kvmaster top: {exc}", file=sys.stderr)
        client.close()
        return 1
    try:
        if args.once:
            return _once(client, args, console)
        return _live(client, args, console, Live)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def _once(client: Any, args: argparse.Namespace, console: Any) -> int:
    from kvmaster.errors import KVMasterError

    try:
        prev, t_prev = None, 0.0
        if args.interval > 0:
            prev, t_prev = client.stats(), time.monotonic()
            time.sleep(args.interval)
        cur = client.stats()
    except KVMasterError as exc:
        print(f"kvmaster top: {exc}", file=sys.stderr)
        return 1
    console.print(render(build_view(cur, prev, time.monotonic() - t_prev), args.master,
                         interactive=False))
    return 0


def _live(client: Any, args: argparse.Namespace, console: Any, live_cls: Any) -> int:
    from kvmaster.errors import KVMasterError

    prev: dict[str, Any] | None = None
    t_prev = 0.0
    view: dict[str, Any] | None = None
    with _keys() as wait, live_cls(console=console, screen=True, auto_refresh=False,
                                   transient=False) as live:
        while True:
            t0 = time.monotonic()
            error = None
            try:
                cur = client.stats()
                now = time.monotonic()
                view = build_view(cur, prev, now - t_prev)
                prev, t_prev = cur, now
            except KVMasterError as exc:
                error = str(exc)
            if view is not None:
                live.update(render(view, args.master, error), refresh=True)
            else:
                from rich.text import Text

                live.update(Text(f"kvmaster top {args.master}: waiting for the master: {error}"),
                            refresh=True)
            deadline = t0 + args.interval
            while (left := deadline - time.monotonic()) > 0:
                if "q" in wait(left).lower():
                    return 0
