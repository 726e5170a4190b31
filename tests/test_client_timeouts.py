"""Client timeouts against a master that never answers: they fire, and not early."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


SILENT_MASTER_SETUP = textwrap.dedent("""
    import sys, time, zmq
    from kvmaster import Client, ClientConfig
    from kvmaster import errors as E

    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)      # accepts the HELLO, never answers
    silent.bind("tcp://127.0.0.1:0")
    addr = silent.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")
    c = Client(ClientConfig(connect_timeout_s=float(sys.argv[1])))
    t0 = time.monotonic()
    try:
        c.setup(addr, 0)
    except E.Timeout:
        print(f"timeout {time.monotonic() - t0:.3f}")
""")


@pytest.mark.parametrize("connect_timeout_s", [0.002, 0.004, 0.005])
def test_tiny_connect_timeout_raises_instead_of_blocking_forever(connect_timeout_s) -> None:
    # A fresh socket waits forever (RCVTIMEO -1) until the client sets a timeout,
    # however short the first wait is.
    try:
        out = subprocess.run([sys.executable, "-c", SILENT_MASTER_SETUP, str(connect_timeout_s)],
                             capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"setup with connect_timeout_s={connect_timeout_s} blocked for 10 s "
                    "instead of raising Timeout")
    assert out.stdout.startswith("timeout"), out.stderr[-2000:]


@pytest.mark.parametrize("connect_timeout_s", [0.05, 0.3])
def test_connect_timeout_is_not_cut_short(connect_timeout_s) -> None:
    out = subprocess.run([sys.executable, "-c", SILENT_MASTER_SETUP, str(connect_timeout_s)],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.startswith("timeout"), out.stderr[-2000:]
    took = float(out.stdout.split()[1])
    assert connect_timeout_s - 0.002 <= took < connect_timeout_s + 2.0, took
