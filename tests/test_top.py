"""``kvmaster top``: rates from successive snapshots, ``--once``, and the live view
driven through a pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

from conftest import REPO
from rich.console import Console

from kvmaster.top import build_view, render

ANSI = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[=>78]")


def snap(requests: int, evicted: int, shard_requests: tuple[int, int], **extra) -> dict:
    return {"state": "running", "clients": 2, "segments": 1, "keys": 10, "capacity_bytes": 4096,
            "allocated_bytes": 1024, "requests": requests, "failures": 0,
            "evicted_keys": evicted, "evicted_bytes": evicted * 100,
            "front": {"rejected_busy": 0, "reply_dropped": 0},
            "shards": [{"shard": i, "requests": r, "failures": 0, "evicted_keys": 0, "keys": 5,
                        "capacity_bytes": 2048, "allocated_bytes": 512, "inbox_depth": i}
                       for i, r in enumerate(shard_requests)], **extra}


def test_rates_come_from_successive_snapshots() -> None:
    first = build_view(snap(100, 5, (60, 40)), None, 0.0)
    assert first["rates"]["requests"] is None and first["interval_s"] is None
    view = build_view(snap(300, 9, (160, 80)), snap(100, 5, (60, 40)), 2.0)
    assert view["rates"]["requests"] == 100.0
    assert view["rates"]["evicted_keys"] == 2.0 and view["rates"]["evicted_bytes"] == 200.0
    assert [s["requests_per_s"] for s in view["shards"]] == [50.0, 20.0]
    assert view["front_rates"]["rejected_busy"] == 0.0
    # Hit/miss needs lookup counters; a master without them shows "-", not 0 %.
    assert view["hit_rates"]["get"] == {"total": None, "interval": None, "hits_per_s": None,
                                        "misses_per_s": None}
    with_lookups = build_view(snap(1, 0, (1, 0), get_hit_keys=30, get_miss_keys=10),
                              snap(0, 0, (0, 0), get_hit_keys=10, get_miss_keys=0), 1.0)
    assert with_lookups["hit_rates"]["get"]["total"] == 0.75
    assert with_lookups["hit_rates"]["get"]["interval"] == 20 / 30
    console = Console(width=120, record=True, force_terminal=False)
    console.print(render(view, "127.0.0.1:1"))
    text = console.export_text()
    assert "requests/s 100.0" in text and "get hit    - now  - overall" in text
    assert "[#######" in text and "25.0%" in text  # 1024 of 4096 allocated


def test_once_prints_one_frame(master, make_client) -> None:
    c = make_client(master, segment_bytes=1 << 20)
    for i in range(5):
        c.put(f"k{i}", b"x" * 1000)
    r = subprocess.run([sys.executable, "-m", "kvmaster", "top", "--master", master.addr,
                        "--once", "--interval", "0.2"], capture_output=True, text=True,
                       cwd=REPO, timeout=30)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"kvmaster top {master.addr}" in out and "state running" in out
    assert re.search(r"keys\s+5\s+pending puts 0", out), out
    assert "5.0 KiB of 1.0 MiB" in out
    assert "rates over 0.2s" in out or "rates over 0.3s" in out
    assert len(re.findall(r"│ [0-3] ", out)) == 4  # one row per shard
    assert "\x1b[" not in out  # not a terminal: plain text


def _read_some(fd: int, buf: bytearray, wait: float) -> None:
    """Append what the terminal has within ``wait`` seconds to ``buf``."""
    ready, _, _ = select.select([fd], [], [], wait)
    if ready:
        try:
            buf += os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            pass


def _read_until(fd: int, pattern: str, buf: bytearray, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = ANSI.sub(b"", bytes(buf)).decode(errors="replace")
        if re.search(pattern, text):
            return text
        left = deadline - time.monotonic()
        assert left > 0, f"{pattern!r} not seen in:\n{text[-3000:]}"
        _read_some(fd, buf, min(left, 0.5))


def _exit_status(proc: subprocess.Popen, fd: int, buf: bytearray, timeout: float = 10.0) -> int:
    """Wait for the child to exit while reading its terminal, as a terminal does (a
    child writing to a full pty would block); fails with the screen's tail."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        left = deadline - time.monotonic()
        assert left > 0, ("kvmaster top did not exit; terminal tail:\n"
                          + ANSI.sub(b"", bytes(buf)).decode(errors="replace")[-2000:])
        _read_some(fd, buf, min(left, 0.1))
    return proc.returncode


def _drain(fd: int, buf: bytearray, timeout: float = 5.0) -> None:
    """Read what the exited child left in the terminal (until EIO or quiet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            return
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk


def _spawn_in_pty(*args: str) -> tuple[subprocess.Popen, int]:
    master_fd, slave_fd = pty.openpty()
    fcntl.ioctl(slave_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 130, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "130", "LINES": "40"}
    # As a shell starts a foreground job: Ctrl-C not ignored, even when this test runs
    # in the background (there SIGINT is ignored, and an ignored signal stays ignored
    # across exec; a handled one is reset to the default).
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvmaster", "top", *args],
                                stdin=slave_fd, stdout=slave_fd, stderr=slave_fd, cwd=REPO,
                                env=env, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, old)
    os.close(slave_fd)
    return proc, master_fd


def test_live_view_in_a_terminal(master, make_client) -> None:
    c = make_client(master, segment_bytes=1 << 20)
    for i in range(5):
        c.put(f"k{i}", b"x" * 1000)
    proc, fd = _spawn_in_pty("--master", master.addr, "--interval", "0.2")
    buf = bytearray()
    try:
        _read_until(fd, r"keys\s+5\s+pending puts", buf)
        assert b"\x1b[?1049h" in buf  # drawn on the alternate screen, like top
        for i in range(5, 12):
            c.put(f"k{i}", b"x" * 1000)
        text = _read_until(fd, r"keys\s+12\s+pending puts", buf)  # redrawn with new numbers
        assert "shards" in text and "requests/s" in text and "q or Ctrl-C quits" in text
        os.write(fd, b"q")
        assert _exit_status(proc, fd, buf) == 0
        _drain(fd, buf)
        assert b"\x1b[?1049l" in buf  # the alternate screen was left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(fd)


def test_live_view_stops_on_ctrl_c(master) -> None:
    proc, fd = _spawn_in_pty("--master", master.addr, "--interval", "0.2")
    buf = bytearray()
    try:
        _read_until(fd, r"state running", buf)
        proc.send_signal(signal.SIGINT)
        assert _exit_status(proc, fd, buf) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(fd)
