"""The attack benchmark (``python -m kvmaster.tools.bench attack``) end to end in its
quick mode: a real master, the victim in the tool's process, each attacker in its own
process.  It checks the tool produces a row per attack and that the master came
through; the figures themselves are the benchmark's (BENCHMARKS.md), not asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from kvmaster.tools.bench._attackers import ATTACKS

REPO = Path(__file__).resolve().parents[1]


def test_attack_bench_quick_has_a_row_per_attack(tmp_path: Path) -> None:
    out, md = tmp_path / "attack.json", tmp_path / "attack.md"
    r = subprocess.run([sys.executable, "-m", "kvmaster.tools.bench", "attack", "--quick",
                        "--json", str(out), "--md", str(md)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {row["attack"]: row for row in report["rows"]}
    assert set(ATTACKS) <= set(rows), sorted(rows)
    for name, row in rows.items():
        it = row["ops"]["iteration"]
        for field in ("quiet_p50_ms", "attack_p50_ms", "p50_ratio", "quiet_p99_ms",
                      "attack_p99_ms", "p99_ratio"):
            assert math.isfinite(it[field]) and it[field] > 0, (name, field, it)
        assert not row["attacker"].get("error"), (name, row["attacker"])
        assert row["attacker"]["counts"], name  # the attacker did something
    # The well-behaved client's own calls never failed, whatever the attack.
    for ph in report["phases"]:
        workload = {k: v for k, v in ph["errors"].items() if not k.startswith("setup")}
        assert not workload, (ph["attack"], ph["errors"])
    assert rows["capacity"]["hit_rate_after"] is not None
    assert report["end"]["master_alive"] is True
    assert report["end"]["consistency"] == "none"
    text = md.read_text()
    for name in ATTACKS:
        assert f"| {name} |" in text
