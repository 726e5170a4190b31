"""Configuration files (TOML keys = CLI flags, flags override), --print-config,
validation messages, and logging (levels, JSON lines, a quiet hot path)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from kvmaster.config import (
    ConfigError,
    MasterConfig,
    add_cli_args,
    apply_config_file,
    from_cli_args,
    load_toml,
    to_toml,
)
from kvmaster.logging_setup import configure_logging


def parse(argv: list[str], config_file: Path | None = None) -> MasterConfig:
    """What ``kvmaster master [--config FILE] ARGV`` builds."""
    parser = argparse.ArgumentParser()
    add_cli_args(MasterConfig, parser)
    if config_file is not None:
        apply_config_file(MasterConfig, parser, config_file)
    return from_cli_args(MasterConfig, parser.parse_args(argv))


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "master.toml"
    p.write_text(text)
    return p


def run_cli(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmaster", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout)


def test_file_keys_are_the_flags_and_flags_override_them(tmp_path: Path) -> None:
    f = write(tmp_path, 'shards = 8\neviction-ratio = 0.25\nexist-grants-lease = true\n'
                       'client-ttl = 3\nadmin-tenant = "ops"\nlog-format = "json"\n')
    cfg = parse([], f)
    assert (cfg.shards, cfg.eviction_ratio, cfg.exist_grants_lease, cfg.client_ttl,
            cfg.admin_tenant, cfg.log_format) == (8, 0.25, True, 3.0, "ops", "json")
    assert isinstance(cfg.client_ttl, float)
    cfg = parse(["--shards", "2", "--no-exist-grants-lease"], f)
    assert (cfg.shards, cfg.exist_grants_lease, cfg.eviction_ratio) == (2, False, 0.25)
    assert parse([]).shards == MasterConfig().shards  # no file: the dataclass defaults


@pytest.mark.parametrize(("text", "message"), [
    ("shards = -1", "key 'shards'=-1 is out of range [0, 256]"),
    ("eviction-ratio = 1.5", "key 'eviction-ratio'=1.5 is out of range [0.0, 1.0]"),
    ("metrics-port = 70000", "key 'metrics-port'=70000 is out of range [-1, 65535]"),
    ("shards = 2.5", "key 'shards' must be an integer, got float 2.5"),
    ('shards = "4"', "key 'shards' must be an integer, got str '4'"),
    ("enable-kv-sessions = 1", "key 'enable-kv-sessions' must be a boolean (true/false)"),
    ("port = true", "key 'port' must be an integer, got bool True"),
    ('log-format = "xml"', "key 'log-format'='xml' is not one of text, json"),
    ('log-level = "LOUD"', "key 'log-level'='LOUD' is not one of DEBUG, INFO"),
    ('log-levels = "kvmaster.master"', "expected LOGGER=LEVEL"),
    ("eviction_ratio = 0.1", "unknown key 'eviction_ratio' (did you mean 'eviction-ratio'?)"),
    ("--shards = 2", "unknown key '--shards' (write it without dashes: 'shards')"),
    ("no-such-flag = 1", "unknown key 'no-such-flag'"),
    ("shards = ", "not valid TOML"),
])
def test_file_errors_name_the_key_and_the_allowed_values(tmp_path: Path, text: str,
                                                         message: str) -> None:
    f = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as exc:
        load_toml(MasterConfig, f)
    assert message in str(exc.value)
    assert str(f) in str(exc.value)


def test_flag_errors_name_the_flag_and_range() -> None:
    with pytest.raises(ConfigError, match=r"--shards=300 is out of range \[0, 256\]"):
        parse(["--shards", "300"])
    with pytest.raises(ConfigError, match=r"--gc-threshold=2147483648 is out of range"):
        parse(["--gc-threshold", str(2**31)])  # gc.set_threshold takes a C int
    with pytest.raises(ConfigError, match=r"--log-format='yaml' is not one of text, json"):
        parse(["--log-format", "yaml"])
    with pytest.raises(ConfigError, match=r"--client-ttl=inf must be a finite number"):
        parse(["--client-ttl", "inf"])
    assert parse(["--log-level", "debug"]).log_level == "DEBUG"


def test_to_toml_reads_back_to_the_same_config(tmp_path: Path) -> None:
    cfg = MasterConfig(shards=16, eviction_ratio=1e-05, host="0.0.0.0", curve_dir='a "b"\\c',
                       allow_evict_soft_pinned_objects=False, log_levels="kvmaster._shard=DEBUG")
    f = write(tmp_path, to_toml(cfg))
    assert MasterConfig(**load_toml(MasterConfig, f)) == cfg
    # Every field is in the file: it documents the whole configuration.
    assert len(load_toml(MasterConfig, f)) == len(dataclasses.fields(MasterConfig))


def test_print_config_and_config_errors_on_the_command_line(tmp_path: Path) -> None:
    f = write(tmp_path, "shards = 8\nport = 6000\n")
    r = run_cli("master", "--config", str(f), "--port", "7000", "--print-config")
    assert r.returncode == 0, r.stderr
    printed = write(tmp_path, r.stdout)
    assert load_toml(MasterConfig, printed) == {
        **dataclasses.asdict(MasterConfig()), "shards": 8, "port": 7000}
    bad = write(tmp_path, "kv-session-max-batch = 0\n")
    r = run_cli("master", "--config", str(bad))
    assert r.returncode == 2
    assert "key 'kv-session-max-batch'=0 is out of range [1, inf]" in r.stderr
    r = run_cli("master", "--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and "cannot read" in r.stderr


# ------------------------------------------------------------------ logging

@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    for name in ("kvmaster.test_a", "kvmaster.test_b"):
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_json_lines_and_per_logger_levels(restore_logging) -> None:
    out = io.StringIO()
    configure_logging("WARNING", "json", "kvmaster.test_a=DEBUG", stream=out)
    a, b = logging.getLogger("kvmaster.test_a"), logging.getLogger("kvmaster.test_b")
    a.debug("[shard %d] expired sessions count=%d", 3, 2)
    b.info("hidden: below WARNING")
    b.warning("shown", extra={"client": "w-1"})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        b.exception("failed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["msg"] for r in lines] == ["[shard 3] expired sessions count=2", "shown", "failed"]
    assert lines[0]["level"] == "DEBUG" and lines[0]["logger"] == "kvmaster.test_a"
    assert lines[0]["ts"].endswith("Z")
    assert lines[1]["client"] == "w-1"
    assert "RuntimeError: boom" in lines[2]["exc"]
    # Configuring again replaces the handler instead of doubling every line.
    out2 = io.StringIO()
    configure_logging("INFO", "text", stream=out2)
    b.warning("once")
    assert out2.getvalue().count("once") == 1 and "once" not in out.getvalue()


def test_master_logs_json_lines(start_master) -> None:
    m = start_master("--log-format", "json", "--log-levels", "kvmaster.metrics=WARNING")
    m.stop()
    lines = [json.loads(line) for line in m.stderr.splitlines() if line.strip()]
    msgs = [r["msg"] for r in lines]
    assert any(x.startswith("[master] listening") for x in msgs), msgs
    assert any(x == "[master] stopped" for x in msgs), msgs
    assert not any(r["logger"] == "kvmaster.metrics" for r in lines)  # at WARNING


# Per-message paths: a debug or info call there must sit under an isEnabledFor guard.
_HOT = {
    "kvmaster/master.py": {"_on_readable", "_dispatch", "_send_reply", "_reject",
                           "_handle_master_op"},
    "kvmaster/_shard.py": {"deliver", "post", "drain", "handle", "_ckey", "_ckeys",
                           "_start_one"},
    "kvmaster/_sessions.py": set(),
    "kvmaster/_placement.py": {"allocate", "try_allocate", "free"},
    "kvmaster/_eviction.py": {"evict"},
    "kvmaster/_reads.py": {"lease"},
    "kvmaster/_starts.py": {"start_one"},
    "kvmaster/_ends.py": {"end_one"},
    "kvmaster/_removals.py": set(),
    "kvmaster/_tagged.py": set(),
}


def _unguarded_calls(fn: ast.AST) -> list[int]:
    guarded: set[int] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and "isEnabledFor" in ast.unparse(node.test):
            guarded.update(id(n) for n in ast.walk(node))
    return [node.lineno for node in ast.walk(fn)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("debug", "info")
            and isinstance(node.func.value, ast.Name) and node.func.value.id in ("log", "logger")
            and id(node) not in guarded]


def test_no_unguarded_debug_or_info_logging_in_the_per_message_path() -> None:
    bad = []
    for rel, names in _HOT.items():
        tree = ast.parse((REPO / rel).read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    fn.name in names or fn.name.startswith("handle_")):
                bad += [f"{rel}:{line} ({fn.name})" for line in _unguarded_calls(fn)]
    assert not bad, f"debug/info log calls on a per-message path without isEnabledFor: {bad}"


def test_default_shard_count_depends_on_the_mode() -> None:
    """shards = 0 (the default): one shard in one process, four with shard processes;
    an explicit count wins in both modes.  A written config keeps 0, so it goes on
    choosing by mode when it is loaded with the other mode."""
    assert parse([]).shard_count == 1
    assert parse(["--shard-processes"]).shard_count == 4
    assert parse(["--shards", "3"]).shard_count == 3
    assert parse(["--shards", "2", "--shard-processes"]).shard_count == 2
    assert MasterConfig(shards=0, shard_processes=True).shard_count == 4
    assert "shards = 0" in to_toml(parse([]))


def test_written_default_config_keeps_choosing_shards_by_mode(tmp_path: Path) -> None:
    f = tmp_path / "master.toml"
    f.write_text(to_toml(parse([])))
    assert parse([], f).shard_count == 1
    assert parse(["--shard-processes"], f).shard_count == 4
