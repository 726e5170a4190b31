"""Mooncake's ``mooncake-store/tests/e2e/session_ranges_tcp_e2e.py`` (ranged put and
get sessions over multi-buffer ranges), run unmodified against a real master.

Mooncake runs it as ``PYTHONPATH=build/mooncake-integration MOONCAKE_PROTOCOL=tcp
MOONCAKE_MASTER=host:port MOONCAKE_TE_META_DATA_SERVER=P2PHANDSHAKE python3
session_ranges_tcp_e2e.py``: the file imports the binding as a top-level ``store``
module.  Here the folder on ``PYTHONPATH`` is the compat shim's ``mooncake`` package,
whose ``store.py`` is kvmaster's facade, and the master is a kvmaster master.  The
file exits 0 and prints ``session_ranges_tcp_e2e PASSED`` when every step answered
as Mooncake's does (a put session written layer by layer, ended, read back layer by
layer through a get session, every byte compared; a second put session revoked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.conftest import engine_file

E2E = "mooncake/session_ranges_tcp_e2e.py"


def _run(shim: Path, master_addr: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(shim / "mooncake"), MOONCAKE_PROTOCOL="tcp",
               MOONCAKE_MASTER=master_addr, MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE",
               **extra)
    return subprocess.run([sys.executable, str(engine_file(E2E))], env=env, text=True,
                          capture_output=True, timeout=60)


@pytest.mark.parametrize("shape", [
    {},  # the file's defaults: 3 keys, 4 layers of 4 KiB
    {"E2E_NUM_KEYS": "32", "E2E_NUM_LAYERS": "16", "E2E_PAGE_SIZE": "65536",
     "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(128 << 20)},
], ids=["defaults", "32keys-16layers-64KiB"])
def test_session_ranges_e2e(shim, master, shape: dict[str, str]) -> None:
    proc = _run(shim, master.addr, **shape)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "session_ranges_tcp_e2e PASSED" in proc.stdout, out[-4000:]
    assert "setup_ret 0" in proc.stdout
    assert "batch_put_session_revoke [0]" in proc.stdout
