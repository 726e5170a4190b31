"""Bad master addresses stay in kvmaster's exception tree: every address that cannot
name a master (no port, a bad port, an unknown scheme, an unresolvable host) makes
setup raise InvalidParams with one line of text, at once and before anything is
connected; the compat facade returns INVALID_PARAMS (-600); ``kvmaster ctl``,
``kvmaster top`` and ``kvmaster-loadgen`` print that one line, no traceback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from kvmaster import Client
from kvmaster import errors as E
from kvmaster.aio import AsyncClient
from kvmaster.cli import main as kvmaster_main
from kvmaster.compat import MooncakeDistributedStore

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]

#: (address, words its error names)
BAD = [
    ("127.0.0.1", "no port"),
    ("tcp://127.0.0.1", "no port"),
    ("", "no port"),
    ("127.0.0.1:", "not a number"),
    ("127.0.0.1:abc", "not a number"),
    ("127.0.0.1:0", "outside 1-65535"),
    ("127.0.0.1:65536", "outside 1-65535"),
    (":50051", "no host"),
    ("[nothex]:50051", "not an IPv6 address"),
    ("http://127.0.0.1:50051", "scheme"),
    ("grpc://127.0.0.1:50051", "scheme"),
    ("ipc://", "socket path"),
    ("etcd://", "etcd://host:port"),
    ("etcd://127.0.0.1:2379", "etcd://host:port"),
    ("etcd://127.0.0.1/cluster", "no port"),
    ("no-such-host.invalid:50051", "does not resolve"),
]


@pytest.mark.parametrize(("addr", "why"), BAD)
def test_native_setup_raises_invalid_params(addr: str, why: str) -> None:
    c = Client()
    started = time.monotonic()
    with pytest.raises(E.InvalidParams) as info:
        c.setup(addr, 1 << 20)
    assert time.monotonic() - started < 2  # no connect attempt, no HELLO timeout
    text = str(info.value)
    assert "\n" not in text and why in text and repr(addr) in text
    assert info.value.code == E.InvalidParams.code and info.value.op == "setup"
    assert c.segment_name is None  # nothing was mounted
    c.close()


def test_non_str_address_raises_invalid_params() -> None:
    with pytest.raises(E.InvalidParams, match="must be a str"):
        Client().setup(50051, 0)  # type: ignore[arg-type]


def test_async_setup_raises_invalid_params() -> None:
    async def go() -> None:
        c = AsyncClient()
        with pytest.raises(E.InvalidParams, match="no port"):
            await c.setup("127.0.0.1", 0)
        await c.close()

    asyncio.run(go())


@pytest.mark.parametrize("addr", ["127.0.0.1", "http://127.0.0.1:5", "127.0.0.1:99999"])
def test_compat_setup_returns_invalid_params(addr: str) -> None:
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", addr)
    assert rc == -600
    assert store.close() == 0


def test_good_addresses_still_connect(master) -> None:
    port = master.addr.rsplit(":", 1)[1]
    for addr in (master.addr, f"tcp://{master.addr}", f"localhost:{port}"):
        c = Client()
        c.setup(addr, 0)
        assert c.batch_is_exist(["x"]) == [0]
        c.close()


@pytest.mark.parametrize("cmd", [["ctl", "--master", "{a}", "stats"],
                                 ["top", "--master", "{a}", "--once"]])
@pytest.mark.parametrize("addr", ["127.0.0.1", "http://127.0.0.1:5", "127.0.0.1:70000"])
def test_ctl_and_top_print_one_line(cmd: list[str], addr: str, capsys) -> None:
    code = kvmaster_main([c.format(a=addr) for c in cmd])
    _, err = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "INVALID_PARAMS (-600)" in err and repr(addr) in err


def test_loadgen_prints_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "tools.loadgen", "synthetic", "--master",
                        "127.0.0.1", "--requests", "5", "--workers", "1"],
                       check=False, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no port" in r.stderr and "INVALID_PARAMS" in r.stderr


def test_a_resolver_that_does_not_answer_does_not_hold_setup(monkeypatch) -> None:
    import socket

    from kvmaster._client import records

    monkeypatch.setattr(records, "RESOLVE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: time.sleep(3))
    started = time.monotonic()
    records.check_master_address("slow-resolver.example:50051")  # says nothing: no error
    assert time.monotonic() - started < 1.5
