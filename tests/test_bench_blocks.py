"""``bench blocks`` runs end to end (a small run; its figures are BENCHMARKS.md's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_blocks_bench_small_run_has_every_row(tmp_path: Path) -> None:
    out = tmp_path / "blocks.json"
    md = tmp_path / "blocks.md"
    r = subprocess.run([sys.executable, "-m", "kvmaster.tools.bench", "blocks", "--sizes-mib",
                        "1", "--rounds", "2", "--batch", "2", "--lease-ms", "200",
                        "--json", str(out), "--md", str(md)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = res["ops"][str(1 << 20)]
    ops = ("put", "get", "put_from", "get_into", "batch_put_from", "batch_get_into")
    assert set(rows) == {f"{w}/{v}/{op}" for w in ("own", "peer") for v in ("on", "off")
                         for op in ops}
    assert all(len(v) == 1 and v[0] > 0 for v in rows.values())
    assert len(res["floor"][str(1 << 20)]) == 1 and res["floor"][str(1 << 20)][0] > 0
    text = md.read_text()
    assert text.count("| 1 MiB |") == 24 and "Ceiling:" in text
