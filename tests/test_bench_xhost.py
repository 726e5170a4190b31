"""``bench xhost`` runs end to end between two namespace hosts (a tiny run; its figures
are BENCHMARKS.md's "Cross-host transfer")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from netns import netns_unusable_reason, run_ip

REPO = Path(__file__).resolve().parents[1]


def test_xhost_bench_tiny_run_has_every_row(tmp_path: Path) -> None:
    reason = netns_unusable_reason()
    if reason is not None:
        pytest.skip(f"the bench runs its hosts in network namespaces and {reason}")
    out = tmp_path / "xhost.json"
    md = tmp_path / "xhost.md"
    r = subprocess.run([sys.executable, "-m", "kvmaster.tools.bench", "xhost", "--runs", "1",
                        "--sizes-mib", "1", "--streams", "1,2", "--budget-mib", "8",
                        "--no-iperf3", "--json", str(out), "--md", str(md)],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["rows"]) == {f"{1 << 20}/{n}/{op}" for n in (1, 2) for op in ("get", "put")}
    for row in res["rows"].values():
        assert len(row["transfer"]) == 1 and row["transfer"][0] > 0
        assert len(row["floor"]) == 1 and row["floor"][0] > 0
        assert row["bytes"] == 8 << 20  # whole blocks of the budget, all streams together
    # every get stream's last block and every put stream's first and last, read back
    assert res["wrong_bytes"] == []
    assert res["nproc"] and res["commit"]
    text = md.read_text()
    assert text.count("| 1 MiB |") == 4 and "Machine:" in text
    left = [ns for ns in run_ip("netns", "list").split() if ns.endswith(f"-{res['tag']}")]
    assert not left, f"namespaces left behind: {left}"
