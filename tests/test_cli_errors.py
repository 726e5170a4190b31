"""The command lines refuse a mistyped flag in one line under the subcommand's own
usage, and ``kvmaster top`` without a terminal says to use ``--once``.  Real processes,
no master needed (nothing is reached before the arguments are read)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("words,prog", [
    (["master", "--shardz", "2"], "kvmaster master"),
    (["top", "--intervall", "1"], "kvmaster top"),
    (["ctl", "stats", "--jsn"], "kvmaster ctl stats"),
    (["ctl", "--tymeout=1", "stats"], "kvmaster ctl stats"),
    (["keygen", "/tmp/never-made", "--tennant", "t"], "kvmaster keygen"),
])
def test_a_mistyped_flag_names_the_subcommand(words: list[str], prog: str) -> None:
    r = _run(sys.executable, "-m", "kvmaster", *words)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    bad = next(w for w in words if w.startswith("--"))
    assert lines[-1].startswith(f"{prog}: error: unrecognized arguments: {bad}"), r.stderr
    assert lines[0].startswith(f"usage: {prog} "), r.stderr  # its own usage, not the top's


def test_the_load_generator_names_its_subcommand_too() -> None:
    r = _run(sys.executable, "-m", "kvmaster.tools.loadgen", "reference", "/tmp/none",
             "--capacity-blockz", "9")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(
        "kvmaster-loadgen reference: error: unrecognized arguments: --capacity-blockz"), \
        r.stderr


def test_top_without_a_terminal_says_to_use_once() -> None:
    r = _run(sys.executable, "-m", "kvmaster", "top", "--master", "127.0.0.1:1")
    assert r.returncode == 2
    assert r.stderr.strip() == ("kvmaster top: standard output is not a terminal: use "
                                "--once to print one frame")
