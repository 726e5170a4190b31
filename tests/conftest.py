"""Fixtures: a real master process on loopback (port 0, endpoint read back) and
real clients with shared-memory segments.  Every test fails if it leaves
segment files behind in /dev/shm, or zmq contexts or sockets of its own process open
or dropped unclosed."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmaster import Client
from kvmaster import protocol as P
from kvmaster._segment import SEGMENT_TAG_ENV
from kvmaster.tools.local_etcd import LocalEtcd
from tests.support import ZMQ

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"


class MasterProcess:
    """A ``kvmaster master`` subprocess bound to 127.0.0.1 on a free port."""

    def __init__(self, *flags: str) -> None:
        cmd = [sys.executable, "-m", "kvmaster", "master", "--port", "0", "--metrics-port", "0",
               *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=REPO)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "listening on" not in line:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=5)
            raise RuntimeError(f"master did not start: {line!r} {err[-2000:]}")
        self.endpoint = line.rsplit(" ", 1)[-1].strip()
        self.addr = self.endpoint.removeprefix("tcp://")

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("master did not stop within the timeout after SIGTERM")
        if self.proc.stdout:
            self.proc.stdout.close()
        if self.proc.stderr:
            self.stderr = self.proc.stderr.read()
            self.proc.stderr.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f:
                f.close()


# Segment files of this test run carry its own tag (inherited by every master and
# client process the tests start), so another run on the same machine is neither
# blamed for a leak nor has its files removed.
_RUN_TAG = f"t{os.getpid()}"
os.environ[SEGMENT_TAG_ENV] = _RUN_TAG


def shm_files() -> set[str]:
    return set(glob.glob(f"/dev/shm/kvmaster-{_RUN_TAG}-*"))


def mapped_shm_files() -> set[str]:
    """Segment files some live process still maps (so not leaked: their owner is alive,
    e.g. another test run on the same machine)."""
    out: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                out.update(line.split(None, 5)[-1].strip() for line in f
                           if f"/dev/shm/kvmaster-{_RUN_TAG}-" in line)
        except OSError:
            continue
    return {p.removesuffix(" (deleted)") for p in out}


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    before = shm_files()
    yield
    deadline = time.monotonic() + 5
    leaked = shm_files() - before - mapped_shm_files()
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = shm_files() - before - mapped_shm_files()
    for f in leaked:
        try:
            os.unlink(f)
        except FileNotFoundError:
            pass
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"


ZMQ.install()


@pytest.fixture(autouse=True)
def no_leaked_zmq() -> Iterator[None]:
    """Fails a test that leaves a zmq context it created open, or that drops a context
    or socket without closing it (``ZmqLeaks.watch``)."""
    with ZMQ.watch():
        yield


#: Shards of a test master that does not choose (see ``start_master``).
TEST_SHARDS = "4"
#: A flag for ``start_master`` only: start the master with its own default layout.
DEFAULT_LAYOUT = "<default layout>"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shard-processes", action="store_true",
                     help="start every master with --shard-processes (actors in processes)")


@pytest.fixture
def start_master(request: pytest.FixtureRequest) -> Iterator:
    """Factory: ``start_master("--shards", "2", ...)`` -> MasterProcess; stopped after the test
    (a clean SIGTERM exit with status 0 is asserted).

    A master started without ``--shards`` gets :data:`TEST_SHARDS` shards, so the tests
    cover the cross-shard paths (batches forwarded between in-process shards, session
    walks) although a master's own default in one process is a single shard;
    ``start_master(DEFAULT_LAYOUT)`` keeps the master's default."""
    started: list[MasterProcess] = []

    extra = ("--shard-processes",) if request.config.getoption("--shard-processes") else ()

    def start(*flags: str) -> MasterProcess:
        if DEFAULT_LAYOUT in flags:
            flags = tuple(f for f in flags if f != DEFAULT_LAYOUT)
        elif "--shards" not in flags and not any(f.startswith("--shards=") for f in flags):
            flags = ("--shards", TEST_SHARDS, *flags)
        m = MasterProcess(*extra, *flags)
        started.append(m)
        return m

    yield start
    for m in started:
        if m.proc.poll() is None:
            assert m.stop() == 0, getattr(m, "stderr", "")
        else:  # killed by the test: just release its pipes
            for f in (m.proc.stdout, m.proc.stderr):
                if f and not f.closed:
                    f.close()


@pytest.fixture
def master(start_master) -> MasterProcess:
    return start_master()


@pytest.fixture
def make_client() -> Iterator:
    """Factory: ``make_client(master, segment_bytes=..., tenant=...)`` -> set-up Client."""
    made: list[Client] = []

    def make(m: MasterProcess, segment_bytes: int = 16 << 20, tenant: str = "default",
             **kw) -> Client:
        c = Client()
        c.setup(m.addr, segment_bytes, tenant, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def client(master, make_client) -> Client:
    return make_client(master)


def keys_on_shard(shard: int, shards: int, n: int, prefix: str) -> list[str]:
    """``n`` keys ``prefix<i>`` that the default tenant routes to ``shard`` of ``shards``."""
    seed = P.tenant_seed("default")
    out: list[str] = []
    i = 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if P.shard_of(k.encode(), seed, shards) == shard:
            out.append(k)
        i += 1
    return out


def present(c: Client, keys) -> list[str]:
    """The keys of ``keys`` that exist, found with QUERY_KEY (no lease, no touch of
    their recency)."""
    from kvmaster.errors import ObjectNotFound

    out = []
    for k in keys:
        try:
            c.query_key(k)
        except ObjectNotFound:
            continue
        out.append(k)
    return out


#: A throw-away etcd on loopback (kvmaster/tools/local_etcd.py), for the HA tests.
Etcd = LocalEtcd


@pytest.fixture
def etcd() -> Iterator[Etcd]:
    e = Etcd()
    yield e
    e.stop()
