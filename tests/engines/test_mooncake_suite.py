"""Mooncake's own Python store tests, run unmodified against a real kvmaster master.

Each file of ``../shared/engines/mooncake`` runs in its own interpreter, loaded by
unittest's loader and run by its text runner at verbosity 2: what ``python -m
unittest -v`` and the files' ``__main__`` blocks do (without ``failfast``, so every
test reports), plus leaving out the excluded tests by id, which the command line
cannot.  ``mooncake.store`` resolves to kvmaster's compat shim.  The master is
started with the settings the files assume (their lease TTL is read from
``DEFAULT_KV_LEASE_TTL`` and must equal the master's), the environment names its
address the way each file reads it, and every test's outcome is collected from the
runner, so a failure names its test.

A Mooncake test that cannot apply to kvmaster is listed in :data:`EXCLUDED` with the
reason, and left out by name; every other test must pass (a skip counts as a
failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DEFAULT_LAYOUT
from engines.conftest import engine_file

#: The master's read lease in ms: the files sleep this long before each remove, so it
#: is short; DEFAULT_KV_LEASE_TTL tells them the same value (Mooncake's master default
#: is 5000 ms, which the files assume when the variable is unset).  No other master
#: setting matters to them: their writes stay far below the eviction watermark (at most
#: 0.8 GB into a 3.2 GB segment), none of them waits for a soft pin to end, and the
#: replication tests need only as many segments as their stores mount.
LEASE_TTL_MS = 200

#: file -> {test id (module.Class.test): why it cannot apply to kvmaster}.
EXCLUDED: dict[str, dict[str, str]] = {
    "test_distributed_object_store.py": {},
    "test_replicated_distributed_object_store.py": {},
    "test_upsert_api.py": {},
}

#: Run inside the child: load the module's tests, drop the excluded ones by id (failing
#: when one is not there, so a renamed test is noticed), run them with unittest's text
#: runner at verbosity 2 and write each test's outcome to a JSON file.
RUNNER = r"""
import faulthandler, json, sys, unittest
module, excluded, out = sys.argv[1], set(json.loads(sys.argv[2])), sys.argv[3]
faulthandler.dump_traceback_later(float(sys.argv[4]), exit=True)  # a hang shows where
suite = unittest.defaultTestLoader.loadTestsFromName(module)
def flat(s):
    for t in s:
        if isinstance(t, unittest.TestSuite):
            yield from flat(t)
        else:
            yield t
tests = list(flat(suite))
ids = {t.id() for t in tests}
missing = sorted(excluded - ids)
if missing:
    sys.exit(f"excluded tests not in {module}: {missing}")
kept = unittest.TestSuite(t for t in tests if t.id() not in excluded)
class Result(unittest.TextTestResult):
    outcomes = {}
    def _set(self, test, status, detail=""):
        self.outcomes[test.id()] = [status, detail]
    def addSuccess(self, test):
        super().addSuccess(test); self._set(test, "ok")
    def addFailure(self, test, err):
        super().addFailure(test, err); self._set(test, "FAIL", self._exc_info_to_string(err, test))
    def addError(self, test, err):
        super().addError(test, err); self._set(test, "ERROR", self._exc_info_to_string(err, test))
    def addSkip(self, test, reason):
        super().addSkip(test, reason); self._set(test, "skipped", reason)
    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err); self._set(test, "expected failure")
    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test); self._set(test, "unexpected success")
runner = unittest.TextTestRunner(verbosity=2, resultclass=Result, stream=sys.stdout)
res = runner.run(kept)
with open(out, "w") as f:
    json.dump({"outcomes": Result.outcomes, "collected": sorted(ids),
               "run": res.testsRun}, f)
"""


def _env(master_addr: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        # test_distributed_object_store.py, test_replicated_distributed_object_store.py
        "MASTER_SERVER": master_addr,
        "DEFAULT_KV_LEASE_TTL": str(LEASE_TTL_MS),
        "PROTOCOL": "tcp",
        "LOCAL_HOSTNAME": "localhost",
        "MC_METADATA_SERVER": "P2PHANDSHAKE",
        # test_upsert_api.py
        "MOONCAKE_MASTER": master_addr,
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
        "MOONCAKE_LOCAL_HOSTNAME": "localhost",
        "PYTHONDONTWRITEBYTECODE": "1",  # nothing written next to the engines' files
    })
    return env


def run_suite(path: Path, master_addr: str, out: Path, timeout: float = 120) -> dict:
    """Run one Mooncake file's tests in a child interpreter; its outcomes as a dict."""
    excluded = EXCLUDED[path.name]
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, path.stem, json.dumps(sorted(excluded)), str(out),
         str(timeout - 10)],
        cwd=path.parent, env=_env(master_addr), capture_output=True, text=True,
        timeout=timeout)
    log = proc.stdout + proc.stderr
    assert out.exists(), f"{path.name}: the runner wrote no results (rc {proc.returncode})\n" \
                         f"{log[-12000:]}"
    res = json.loads(out.read_text())
    res["log"] = log
    return res


def _master_state(m) -> str:
    """The master's counters and the end of its log, for a run that went wrong (a
    Mooncake test whose worker thread failed waits on its barrier for good)."""
    from kvmaster import Client

    c = Client()
    try:
        c.setup(m.addr, 0)
        st = c.stats()
        counters = {k: v for k, v in st.items()
                    if isinstance(v, (int, float)) and v and ("evict" in k or "fail" in k
                                                              or "objects" in k
                                                              or "used" in k)}
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        counters = {"stats failed": repr(exc)}
    finally:
        c.close()
    m.stop()
    return f"master counters: {counters}\nmaster log (end):\n{getattr(m, 'stderr', '')[-3000:]}"


@pytest.mark.parametrize("name", sorted(EXCLUDED))
def test_mooncake_file(name, shim, start_master, tmp_path):
    """Every test of the file passes against kvmaster, but the ones :data:`EXCLUDED`
    names with their reasons."""
    path = engine_file(f"mooncake/{name}")
    # One master with its own default layout, as a deployment runs it (Mooncake's is one
    # process too): the whole segment is one shard's, so no shard runs out of space
    # before the segment does.
    m = start_master(DEFAULT_LAYOUT, "--default-kv-lease-ttl", str(LEASE_TTL_MS))
    try:
        res = run_suite(path, m.addr, tmp_path / "results.json")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_master_state(m)}") from None
    outcomes = res["outcomes"]
    excluded = set(EXCLUDED[name])
    expected = set(res["collected"]) - excluded
    assert set(outcomes) == expected, (
        f"{name}: ran {len(outcomes)} of {len(expected)}; not reported: "
        f"{sorted(expected - set(outcomes))}\n{res['log'][-4000:]}")
    bad = {t: o for t, o in outcomes.items() if o[0] != "ok"}
    report = "\n".join(f"{t}: {o[0]}\n{o[1][-1500:]}" for t, o in sorted(bad.items()))
    assert not bad, (f"{name}: {len(bad)} of {len(outcomes)} failed:\n"
                     f"{sorted(bad)}\n{report}")
