"""Set-up that does not stall the process: mounting a multi-GiB segment returns at
once and never holds the GIL for long (the pages are allocated and faulted in by a
thread whose system calls release it), and a segment larger than /dev/shm's free
space fails setup at once with InvalidParams naming what to change."""

from __future__ import annotations

import threading
import time

import pytest

from kvmaster import Client
from kvmaster import errors as E
from kvmaster._segment import SHM_DIR, Segment, shm_free_bytes

GiB = 1 << 30


class Ticker:
    """A thread that sleeps 5 ms at a time and records the longest gap between its
    wake-ups: a call holding the GIL for a second shows up as a one-second gap."""

    def __init__(self) -> None:
        self.gap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            self.gap = max(self.gap, now - last)
            last = now

    def __enter__(self) -> Ticker:
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _room_for(size: int) -> None:
    free = shm_free_bytes()
    if free is None or free < size + GiB:
        # Not hardware: a host whose /dev/shm cannot hold the segment cannot run this.
        pytest.skip(f"{SHM_DIR} has {free} bytes free, too little for a {size}-byte segment")


def test_setup_of_a_4gib_segment_does_not_stall_other_threads(start_master) -> None:
    size = 4 * GiB
    _room_for(size)
    # Another client of this process with a short TTL: a setup holding the GIL for
    # seconds starved its heartbeat and the master expired it.
    master = start_master("--client-ttl", "2000")
    other = Client()
    other.setup(master.addr, 0)
    c = Client()
    try:
        with Ticker() as ticker:
            started = time.monotonic()
            c.setup(master.addr, size)
            took = time.monotonic() - started
            # The old code (MAP_POPULATE) took 3-6 s here with the GIL held throughout.
            c.put("k", b"v" * 4096)
            assert c.get("k") == b"v" * 4096
        assert took < 1.5, f"setup of a 4 GiB segment took {took:.2f} s"
        assert ticker.gap < 1.0, f"another thread was stopped for {ticker.gap:.2f} s"
        seg = c._segment
        assert seg is not None and seg.size == size
        # The background allocation finishes, and the written bytes are still there.
        assert seg.wait_populated(120)
        assert c.get("k") == b"v" * 4096
        assert other.batch_is_exist(["k"]) == [1]
        assert other.reconnect_count == 0  # never expired, never re-handshaken
    finally:
        c.close()
        other.close()


def test_attach_of_a_large_segment_returns_at_once() -> None:
    size = 2 * GiB
    _room_for(size)
    owner = Segment.create(size)
    try:
        owner.buf[size - 5:] = b"tail!"
        with Ticker() as ticker:
            started = time.monotonic()
            peer = Segment.attach(owner.name)
            took = time.monotonic() - started
        try:
            assert bytes(peer.buf[size - 5:]) == b"tail!"
            assert took < 0.5 and ticker.gap < 1.0, (took, ticker.gap)
        finally:
            peer.close()  # stops its fault-in thread before unmapping
    finally:
        owner.close()


def test_segment_bigger_than_free_shm_fails_setup_at_once(master) -> None:
    free = shm_free_bytes()
    assert free is not None
    size = free + GiB
    c = Client()
    started = time.monotonic()
    with pytest.raises(E.InvalidParams) as info:
        c.setup(master.addr, size)
    assert time.monotonic() - started < 5
    text = str(info.value)
    assert "\n" not in text
    assert SHM_DIR in text and "--shm-size" in text and "global_segment_size" in text
    assert c.segment_name is None


def test_compat_setup_returns_the_code_for_a_too_small_shm(master) -> None:
    from kvmaster.compat import MooncakeDistributedStore

    free = shm_free_bytes()
    assert free is not None
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", free + GiB, 0, "tcp", "", master.addr)
    assert rc == int(E.InvalidParams.code)
    assert store.close() == 0


def test_small_segment_is_allocated_before_setup_returns(master) -> None:
    c = Client()
    try:
        c.setup(master.addr, 16 << 20)
        seg = c._segment
        assert seg is not None and seg.wait_populated(0)
    finally:
        c.close()


def test_a_64mib_shm_refuses_the_default_segment(monkeypatch) -> None:
    """A container's default /dev/shm (64 MiB) and an engine's 3.2 GiB segment."""
    from kvmaster import _segment

    class Small:
        f_bavail, f_frsize = 16384, 4096  # 64 MiB

    monkeypatch.setattr(_segment.os, "statvfs", lambda path: Small)
    with pytest.raises(E.InvalidParams, match=r"64\.0 MiB free .* 3\.1 GiB"):
        Segment.create(3355443200)
    c = Client()
    with pytest.raises(E.InvalidParams, match="--shm-size"):
        c.setup("127.0.0.1:1", 3355443200)  # refused before any connect
    c.close()


def test_enospc_while_allocating(monkeypatch, caplog) -> None:
    """/dev/shm filled by someone else between the check and the allocation: a small
    segment fails create() with InvalidParams (and leaves no file); a large one logs
    the failure from its background thread."""
    import errno
    import logging

    from kvmaster import _segment

    def full(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_segment.os, "posix_fallocate", full)
    with pytest.raises(E.InvalidParams, match="--shm-size"):
        Segment.create(1 << 20)  # (the autouse leak check sees a file left behind)
    with caplog.at_level(logging.ERROR, "kvmaster._segment"):
        seg = Segment.create(_segment.POPULATE_CHUNK * 2)
        try:
            assert seg.wait_populated(30)
            assert seg._populate is not None and seg._populate.error is not None
        finally:
            seg.close()
    assert "could not allocate" in caplog.text


def test_a_master_segment_too_big_for_dev_shm_is_one_line_and_status_2() -> None:
    import subprocess
    import sys

    too_big = shm_free_bytes() + (1 << 40)
    r = subprocess.run([sys.executable, "-m", "kvmaster", "master", "--port", "0",
                        "--metrics-port", "0", "--master-segment-size", str(too_big)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvmaster master:")]
    assert len(lines) == 1 and "--master-segment-size" in lines[0], r.stderr
