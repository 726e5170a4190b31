"""Trace replay through a real master and real worker processes (shared memory)."""

from __future__ import annotations

from conftest import TRACES

from kvmaster.tools.loadgen.replay import LoadgenConfig, run_replay
from kvmaster.tools.loadgen.synthetic import synthetic_trace
from kvmaster.tools.loadgen.traces import read_mooncake

CONVERSATION = TRACES / "mooncake" / "conversation_trace.jsonl"


def test_replay_conversation_trace_matches_exact_lru(master) -> None:
    assert CONVERSATION.is_file(), f"trace not found: {CONVERSATION}"
    requests = read_mooncake(CONVERSATION, limit=2000)
    distinct = len({h for r in requests for h in r.hash_ids})
    config = LoadgenConfig(master=master.addr, workers=2, block_bytes=1024,
                           capacity_blocks=4096, progress=False)
    assert config.capacity_blocks < distinct  # capacity below the working set
    result = run_replay(config, requests)
    assert result["requests"] == 2000
    assert result["verification_failures"] == 0
    assert result["put_failures"] == 0
    assert result["evictions"] and result["evictions"] > 0
    assert abs(result["prefix_hit_rate"] - result["reference_lru_hit_rate"]) <= 0.03, result


def test_replay_synthetic_smoke(master) -> None:
    config = LoadgenConfig(master=master.addr, workers=2, block_bytes=512, capacity_blocks=2048,
                           progress=False)
    result = run_replay(config, synthetic_trace(300, seed=1))
    assert result["requests"] == 300
    assert result["verification_failures"] == 0
    assert result["prefix_hit_rate"] > 0
