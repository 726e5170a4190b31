"""``kvmaster ctl`` against a live master: tables, --json, confirmation of destructive
commands, config as a file."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from kvmaster import ReplicateConfig
from kvmaster.cli import main
from kvmaster.config import MasterConfig, load_toml


def ctl(master, *args: str, stdin: str | None = None, monkeypatch=None,
        capsys=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["ctl", "--master", master.addr, *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def run(master, monkeypatch, capsys):
    def run(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
        return ctl(master, *args, stdin=stdin, monkeypatch=monkeypatch, capsys=capsys)
    return run


def test_stats_segments_clients(master, make_client, run) -> None:
    c = make_client(master, segment_bytes=1 << 20)
    for i in range(10):
        c.put(f"k{i}", b"x" * 1000)
    code, out, _ = run("stats", "--json")
    stats = json.loads(out)
    assert code == 0 and stats["keys"] == 10 and stats["segments"] == 1
    assert stats["capacity_bytes"] == 1 << 20 and len(stats["shards"]) == 4
    assert stats["allocated_bytes"] == 10 * 1024  # 1000 B rounded up to the 64 B alignment
    code, out, _ = run("stats")
    assert code == 0
    assert "keys       10  soft-pinned 0" in out
    assert "capacity   1.0 MiB  allocated 10.0 KiB (1.0%)" in out
    header = next(line for line in out.splitlines() if line.startswith("shard"))
    assert header.split() == ["shard", "keys", "allocated", "capacity", "used", "requests",
                              "failures", "queue", "evicted", "sessions"]
    rows = out.splitlines()[out.splitlines().index(header) + 1:]
    assert sum(int(r.split()[1]) for r in rows) == 10

    code, out, _ = run("segments", "--json")
    (seg,) = json.loads(out)
    assert (seg["name"], seg["size"], seg["allocated"]) == (c.segment_name, 1 << 20, 10 * 1024)
    code, out, _ = run("segments")
    assert c.segment_name in out and "1 segment(s)" in out

    code, out, _ = run("clients", "--json")
    ids = {x["client_id"]: x for x in json.loads(out)}
    assert c.client_id in ids and ids[c.client_id]["segments"] == [c.segment_name]
    assert len(ids) == 2  # the data client and ctl's own consumer-only client
    code, out, _ = run("clients")
    assert c.client_id in out and "2 client(s)" in out


def test_key_and_session(master, make_client, run) -> None:
    c = make_client(master)
    c.put("blk-1", b"a" * 4096, ReplicateConfig(kv_sessions=[["conv-7"]]))
    c.put("blk-2", b"b" * 100, ReplicateConfig(kv_sessions=[["conv-7"]]))
    c.pin_kv_session("conv-7")
    code, out, _ = run("key", "blk-1", "--json")
    info = json.loads(out)
    assert code == 0 and info["found"] and info["state"] == "COMPLETE"
    assert info["size"] == 4096 and info["replicas"][0][0] == c.segment_name
    assert info["soft_pinned"] is True and info["sessions"] == ["conv-7"]
    assert info["lease_ms_left"] == 0
    c.get("blk-1")
    code, out, _ = run("key", "blk-1", "missing")
    assert code == 1  # one of the keys is not there
    assert "size      4.0 KiB (4096 bytes)" in out and "soft pin  yes" in out
    assert "sessions  conv-7" in out and "lease     " in out and "s left" in out
    assert "missing" in out and "not found" in out

    code, out, _ = run("session", "conv-7", "--keys", "--json")
    assert code == 0
    assert json.loads(out) == {"session_id": "conv-7", "pinned": True, "member_count": 2,
                               "keys": ["blk-1", "blk-2"], "truncated": False}
    code, out, _ = run("session", "conv-7", "--keys", "--limit", "1")
    assert code == 0 and "members  2" in out and "blk-1" in out and "blk-2" not in out
    assert "first 1 of 2 keys" in out
    code, _, err = run("session", "nobody")
    assert code == 1 and "SESSION_NOT_FOUND" in err


def test_destructive_commands_ask_first(master, make_client, run) -> None:
    c = make_client(master)
    for k in ("a", "b", "c", "d"):
        c.put(k, b"v")
    code, _, err = run("remove", "a", stdin="n\n")
    assert code == 1 and "Remove key 'a'" in err and "aborted" in err
    assert c.is_exist("a")
    code, _, err = run("remove", "a", stdin="")  # no answer (stdin closed): nothing happens
    assert code == 1 and "--yes" in err and c.is_exist("a")
    code, out, _ = run("remove", "a", "zzz", stdin="y\n")
    assert code == 1  # zzz was not there
    assert out.split() == ["key", "result", "a", "removed", "zzz", "OBJECT_NOT_FOUND"]
    assert not c.batch_is_exist(["a"])[0]
    c.get("b")  # a lease: only --force removes it
    code, out, _ = run("remove", "b", "--yes", "--json")
    assert code == 1 and json.loads(out)["results"][0]["status"] == "OBJECT_HAS_LEASE"
    code, out, _ = run("remove", "b", "--yes")  # the table says how to get past a lease
    assert code == 1 and "OBJECT_HAS_LEASE" in out and "--force" in out
    code, out, _ = run("remove", "b", "--yes", "--force", "--json")
    assert code == 0 and json.loads(out)["removed"] == 1

    code, _, err = run("remove-all", stdin="no\n")
    assert code == 1 and "EVERY object of tenant 'default'" in err
    assert c.batch_is_exist(["c", "d"]) == [1, 1]
    code, out, _ = run("remove-all", "-y")
    assert code == 0 and out.startswith("removed 2 object(s)")
    assert c.batch_is_exist(["c", "d"]) == [0, 0]


def test_config_as_a_file_and_check(master, run, tmp_path: Path) -> None:
    code, out, _ = run("config", "--json")
    cfg = json.loads(out)
    assert code == 0 and cfg["shards"] == 4 and cfg["metrics_port"] == 0
    code, out, _ = run("config")
    assert "--eviction-high-watermark-ratio    0.9" in out
    code, out, _ = run("config", "--toml")
    f = tmp_path / "from-master.toml"
    f.write_text(out)
    loaded = load_toml(MasterConfig, f)
    assert loaded["shards"] == 4 and loaded["metrics_port"] == 0 and "curve_dir" not in loaded
    assert {k: v for k, v in cfg.items() if k in loaded} == loaded
    code, out, _ = run("check")
    assert code == 0 and out == "consistent\n"


def test_entry_point_options_after_the_command_and_unreachable_master(master) -> None:
    r = subprocess.run([sys.executable, "-m", "kvmaster", "ctl", "stats", "--json",
                        "--master", master.addr], capture_output=True, text=True, cwd=REPO,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "running"
    r = subprocess.run([sys.executable, "-m", "kvmaster", "ctl", "--master", "127.0.0.1:9",
                        "--timeout", "0.3", "stats"], capture_output=True, text=True, cwd=REPO,
                       timeout=30)
    assert r.returncode == 1 and "no WELCOME" in r.stderr
