"""The ``lifecycle`` retention policy, Poisson conversation arrivals, the effective
capacity the references use, and the prefill tokens and TTFT saved per request.

Planner and model tests use small hand-made traces (no master); one replay runs
through a real master on loopback to check the effective capacity against what the
master really keeps.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import TRACES

from kvmaster.tools.loadgen import cli
from kvmaster.tools.loadgen.compare import compare_table
from kvmaster.tools.loadgen.reference import lru_prefix_hit_rate, policy_prefix_hit_rate
from kvmaster.tools.loadgen.replay import LoadgenConfig, run_replay
from kvmaster.tools.loadgen.sessions import SessionPlanner, SessionPolicy, Task
from kvmaster.tools.loadgen.stats import prefill_saved
from kvmaster.tools.loadgen.traces import (
    Request,
    load_trace,
    poisson_arrivals,
    read_kvcache_tester,
)

KVTESTER = TRACES / "kv-cache-tester"
CONVERSATION = TRACES / "mooncake" / "conversation_trace.jsonl"


def req(t_s: float, ids: list[int], session: str, stop: str | None = "tool_use",
        parent: str | None = None, last: bool = False) -> Request:
    """A request of 64-token blocks, all full."""
    return Request(t_s * 1000.0, 64 * len(ids), 10, list(ids), session, block_tokens=64,
                   parent_session=parent, last_in_session=last, stop=stop)


def kinds(tasks: list[Task]) -> list[tuple[str, float]]:
    return [(t.kind, t.t_ms) for t in tasks]


# --------------------------------------------------------------------------- planner


def test_lifecycle_pins_after_tool_use_and_unpins_a_grace_after_end_turn() -> None:
    pol = SessionPolicy("lifecycle", idle_s=100, end_idle_s=1000, grace_s=5)
    planner = SessionPlanner(pol)
    [first] = planner.request(0, req(0, [1, 2], "c", stop="tool_use"))
    assert first.pin is True and planner.pinned_blocks == 2
    # A tool call is expected back within the tool bound (idle_s): no unpin before it.
    assert planner.advance(99_999) == []
    [second] = planner.request(1, req(30, [1, 2, 3], "c", stop="end_turn"))
    assert second.pin is True and second.member_prefix == 2 and not second.trim
    # The turn ended: unpinned exactly the grace later, not at the tool bound.
    assert planner.advance(34_999) == []
    unpin = planner.advance(35_000)
    assert kinds(unpin) == [("unpin", 35_000)] and unpin[0].session == first.session
    assert planner.pinned_blocks == 0
    # The person comes back with a tool-calling turn: pinned again from its first reply.
    [third] = planner.request(2, req(400, [1, 2, 3, 4], "c", stop="tool_use"))
    assert third.pin is True and planner.pinned_blocks == 4
    assert planner.advance(499_999) == []
    assert kinds(planner.advance(500_000)) == [("unpin", 500_000)]  # tool bound ran out
    assert planner.counters["pins"] == 2 and planner.counters["unpins"] == 2


def test_lifecycle_zero_grace_unpins_with_the_request_itself() -> None:
    planner = SessionPlanner(SessionPolicy("lifecycle", idle_s=100, grace_s=0))
    [a] = planner.request(0, req(0, [1, 2], "c", stop="tool_use"))
    [b] = planner.request(1, req(1, [1, 2, 3], "c", stop="end_turn"))
    [c] = planner.request(2, req(2, [1, 2, 3, 4], "c", stop="end_turn"))
    assert (a.pin, b.pin, c.pin) == (True, False, None)
    assert planner.advance(1_000_000) == [] or all(
        t.kind == "close" for t in planner.advance(1_000_000))
    assert planner.pinned_blocks == 0


def test_lifecycle_keeps_the_parent_pinned_while_its_sub_agent_runs() -> None:
    pol = SessionPolicy("lifecycle", idle_s=50, end_idle_s=10_000, grace_s=5)
    planner = SessionPlanner(pol)
    [p0] = planner.request(0, req(0, [1, 2, 3], "main", stop="tool_use"))
    [s0] = planner.request(1, req(10, [50, 51], "main/a1", parent="main"))
    assert s0.session != p0.session
    # The parent's tool bound (50 s) passes while the sub-agent works: no unpin.
    assert planner.advance(59_000) == []
    planner.request(2, req(59, [50, 51, 52], "main/a1"))
    assert planner.advance(100_000) == []
    sub_end = planner.request(3, req(120, [50, 51, 52, 53], "main/a1", stop="end_turn",
                                     last=True))
    assert [t.kind for t in sub_end] == ["request", "close"]
    # The sub-agent's result is back: the parent's bound starts again at 120 s.
    assert planner.advance(169_999) == []
    unpin = planner.advance(170_000)
    assert kinds(unpin) == [("unpin", 170_000)] and unpin[0].session == p0.session
    assert planner.counters["parent_pins"] == 0  # it was pinned already (tool_use)


def test_lifecycle_pins_a_parent_that_ended_its_turn_when_a_sub_agent_starts() -> None:
    pol = SessionPolicy("lifecycle", idle_s=50, end_idle_s=10_000, grace_s=5)
    planner = SessionPlanner(pol)
    [p0] = planner.request(0, req(0, [1, 2, 3], "main", stop="end_turn"))
    assert kinds(planner.advance(5_000)) == [("unpin", 5_000)]
    assert planner.pinned_blocks == 0
    tasks = planner.request(1, req(20, [50, 51], "main/a1", parent="main", stop="end_turn",
                                   last=True))
    # pin the waiting parent first, then the sub-agent's request, then its close
    assert [(t.kind, t.session == p0.session) for t in tasks] == [
        ("pin", True), ("request", False), ("close", False)]
    assert planner.counters["parent_pins"] == 1
    assert planner.pinned_blocks == 3  # the parent's blocks (the sub-agent closed)
    assert kinds(planner.advance(70_000)) == [("unpin", 70_000)]


def test_lifecycle_updates_the_session_on_a_compaction_and_closes_at_the_end() -> None:
    pol = SessionPolicy("lifecycle", idle_s=100, grace_s=5)
    trace = [req(0, [1, 2, 3, 4], "c"),
             req(5, [1, 2, 3, 4, 5, 6], "c"),
             # compaction: a short summary after the shared system prompt (block 1)
             req(10, [1, 90, 91], "c"),
             req(15, [1, 90, 91, 92], "c", stop="end_turn", last=True)]
    tasks = SessionPlanner(pol).plan(trace)
    reqs = [t for t in tasks if t.kind == "request"]
    assert [t.trim for t in reqs] == [False, False, True, False]
    assert (reqs[2].member_prefix, reqs[2].tag_blocks) == (1, 3)
    assert [t.kind for t in tasks][-1] == "close" and sum(t.kind == "close" for t in tasks) == 1
    assert [t.pin for t in reqs] == [True, True, True, True]


def test_lifecycle_model_keeps_tool_calls_and_waiting_parents() -> None:
    # Six blocks of cache.  A calls a tool; B ends its turn; P ends its turn, then its
    # sub-agent starts (P waits on it).  Two one-shot conversations then fill the cache.
    # Exact LRU loses all three; lifecycle keeps A's and P's blocks pinned and lets
    # B's go after its grace.
    trace = [req(0, [1, 2], "A", stop="tool_use"),
             req(0.5, [10, 11], "B", stop="end_turn"),
             req(0.7, [30], "P", stop="end_turn"),
             req(5, [40], "P/s", parent="P", stop="tool_use"),
             req(10, [20, 21], "F1", stop="end_turn", last=True),
             req(11, [22, 23], "F2", stop="end_turn", last=True),
             req(20, [1, 2, 3], "A", stop="end_turn", last=True),
             req(21, [10, 11, 12], "B", stop="end_turn", last=True),
             req(22, [30, 31], "P", stop="end_turn", last=True)]
    pol = SessionPolicy("lifecycle", idle_s=100, end_idle_s=1000, grace_s=1)
    lru = lru_prefix_hit_rate(trace, 6)
    life = policy_prefix_hit_rate(trace, 6, pol)
    assert lru.prefix_hits == 0
    assert life.prefix_hits == 3  # A's two blocks and P's one; B's were evicted
    planner = SessionPlanner(pol)
    planner.plan(trace)
    assert planner.counters["parent_pins"] == 1


def test_lifecycle_needs_session_calls_and_a_valid_grace() -> None:
    with pytest.raises(ValueError):
        SessionPolicy("lifecycle", sessions=False).validate()
    with pytest.raises(ValueError):
        SessionPolicy("lifecycle", grace_s=-1).validate()
    cfg = cli.config_from_args(cli.build_parser().parse_args(
        ["replay", "t.json", "--retention", "lifecycle", "--end-turn-grace-s", "2.5",
         "--arrival-rate", "0.25", "--prefill-tokens-per-s", "20000"]))
    assert (cfg.retention, cfg.end_turn_grace_s, cfg.arrival_rate,
            cfg.prefill_tokens_per_s) == ("lifecycle", 2.5, 0.25, 20000.0)
    assert cfg.session_policy().grace_s == 2.5
    with pytest.raises(ValueError):
        replace(cfg, arrival_rate=0.0).validate()


def test_real_kvcache_tester_stop_reasons_are_read() -> None:
    trace = load_trace(str(KVTESTER / "trace_0277.json"))
    stops = {r.stop for r in trace}
    assert {"tool_use", "end_turn"} <= stops
    assert all(r.stop == "end_turn" for r in trace if r.last_in_session and r.parent_session)


# --------------------------------------------------------------------------- arrivals


def test_poisson_arrivals_reproducible_with_the_right_mean() -> None:
    a = poisson_arrivals(20_000, 0.5, seed=7)
    assert a == poisson_arrivals(20_000, 0.5, seed=7)
    assert a[:100] == poisson_arrivals(100, 0.5, seed=7)
    assert a != poisson_arrivals(20_000, 0.5, seed=8)
    gaps = [y - x for x, y in zip([0.0, *a], a)]
    assert all(g > 0 for g in gaps)
    # mean 1/R = 2 s; the standard error of the mean of 20,000 gaps is 2/sqrt(20000) = 0.014
    assert statistics.fmean(gaps) == pytest.approx(2.0, abs=0.06)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(2.0, abs=0.1)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


def test_arrival_rate_places_conversations_and_keeps_their_think_times(tmp_path: Path) -> None:
    doc = {"id": "conv", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 200, "out": 5, "hash_ids": [1, 2, 3], "stop": "tool_use"},
        {"t": 7.0, "type": "n", "in": 300, "out": 5, "hash_ids": [1, 2, 3, 4],
         "stop": "end_turn"}]}
    paths = []
    for i in range(3):
        p = tmp_path / f"c{i}.json"
        p.write_text(json.dumps({**doc, "id": f"conv{i}"}))
        paths.append(p)
    starts = poisson_arrivals(3, 0.1, seed=3)
    trace = read_kvcache_tester(paths, arrival_rate=0.1, seed=3)
    for i, start in enumerate(starts):
        mine = [r for r in trace if r.session == f"conv{i}"]
        assert [r.timestamp_ms for r in mine] == pytest.approx(
            [start * 1000.0, (start + 7.0) * 1000.0])
        assert [r.stop for r in mine] == ["tool_use", "end_turn"]
    assert trace == read_kvcache_tester(paths, arrival_rate=0.1, seed=3)
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(trace, trace[1:]))
    with pytest.raises(ValueError, match="arrival rate"):
        load_trace(str(CONVERSATION), arrival_rate=1.0)


# --------------------------------------------------------------------------- capacity


def test_effective_capacity_is_segments_times_the_high_watermark() -> None:
    cfg = LoadgenConfig(capacity_blocks=1000, workers=8, block_bytes=4096)
    assert (cfg.stated_capacity_blocks, cfg.high_watermark) == (1000, 0.9)
    assert cfg.effective_capacity_blocks == 900
    assert replace(cfg, capacity_blocks=1001).stated_capacity_blocks == 1008
    assert replace(cfg, master_watermark=0.95).effective_capacity_blocks == 950
    assert replace(cfg, master_watermark=1.0).effective_capacity_blocks == 1000
    for args in ("--eviction-high-watermark-ratio 0.8", "--eviction-high-watermark-ratio=0.8",
                 "--eviction-policy depth-lru --eviction-high-watermark-ratio 0.8"):
        assert replace(cfg, master_args=args).effective_capacity_blocks == 800, args
    # 100-byte blocks take 128 bytes each (64-byte allocation units): 8 segments of
    # 12,500 bytes hold 781 of them, 703 below the watermark
    assert replace(cfg, block_bytes=100).effective_capacity_blocks == 703
    with pytest.raises(ValueError):
        replace(cfg, master_args="--eviction-high-watermark-ratio 1.5").validate()


def test_replay_references_use_the_capacity_the_master_keeps(start_master) -> None:
    # A read lease of 1 ms: leased blocks cannot be evicted, and at full speed a longer
    # lease would hold much of this small cache past the watermark.  One worker: writes
    # in flight are not evictable either, and eight workers' 1,400-block writes would
    # not fit at once.
    master = start_master("--default-kv-lease-ttl", "1")
    requests = load_trace(str(KVTESTER / "trace_0277.json"))  # a main thread, 4 sub-agents
    assert max(len(r.hash_ids) for r in requests) < 1700
    config = LoadgenConfig(master=master.addr, workers=1, block_bytes=256,
                           capacity_blocks=2000, retention="lifecycle", progress=False,
                           sample_interval_s=0.02, prefill_tokens_per_s=5000.0)
    res = run_replay(config, requests)
    assert (res["stated_capacity_blocks"], res["effective_capacity_blocks"]) == (2000, 1800)
    assert res["reference_capacity_blocks"] == 1800
    assert res["references"]["lru"] == lru_prefix_hit_rate(requests, 1800).to_dict()
    # The master holds at most the effective capacity, and it fills up to it.
    keys = [row["keys"] for row in res["timeline"] if row.get("keys") is not None]
    assert res["evictions"] > 0 and 1600 <= max(keys) <= 1800, max(keys)
    ps = res["prefill_saved"]
    assert ps["requests"] == len(requests) and 0 < ps["saved_tokens"] <= (
        res["prefix_hit_blocks"] * 64)
    assert ps["ttft_saved_ms"]["p50"] == pytest.approx(
        ps["tokens_per_request"]["p50"] / 5000.0 * 1000.0)
    s = res["sessions"]
    assert s["planned"]["created"] == 5 and s["close_calls"] == 5 and s["left_behind"] == 0
    # every reply is followed by a pin (a tool call, or the grace after a sub-agent's end)
    assert s["pin_calls"] == len(requests) and res["verification_failures"] == 0


def test_replay_pins_a_waiting_parent_on_the_master(start_master, make_client,
                                                   tmp_path: Path) -> None:
    # The parent ends its turn (unpinned after the 5 s grace), then starts a sub-agent
    # 30 s later: the replay pins the parent again, and the master agrees (audit).
    doc = {"id": "conv", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 640, "out": 5, "hash_ids": list(range(10)),
         "stop": "end_turn"},
        {"t": 30.0, "type": "subagent", "agent_id": "a1", "requests": [
            {"t": 0.0, "type": "n", "in": 384, "out": 5, "hash_ids": list(range(100, 106)),
             "stop": "tool_use"},
            {"t": 5.0, "type": "n", "in": 576, "out": 5, "hash_ids": list(range(100, 109)),
             "stop": "end_turn"}]},
        {"t": 60.0, "type": "n", "in": 768, "out": 5, "hash_ids": list(range(12)),
         "stop": "tool_use"}]}
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(doc))
    master = start_master("--default-kv-lease-ttl", "500")
    requests = load_trace(str(path))
    config = LoadgenConfig(master=master.addr, workers=2, block_bytes=256,
                           capacity_blocks=4000, retention="lifecycle", progress=False,
                           audit_sessions=True)
    res = run_replay(config, requests)
    s = res["sessions"]
    assert s["planned"]["parent_pins"] == 1 and s["planned"]["created"] == 2
    # 4 request pins (every reply: tool call or grace) + the parent's pin task
    assert s["pin_calls"] == 5 and s["unpin_calls"] == 1 and s["close_calls"] == 2
    assert s["audit_checks"] >= 8 and s["audit_failures"] == 0, s["audit_examples"]
    assert s["left_behind"] == 0 and res["verification_failures"] == 0
    # the parent's third turn found its first turn's ten blocks
    assert res["prefix_hit_blocks"] >= 10 + 6
    assert make_client(master, segment_bytes=0).stats()["pinned_sessions"] == 0


# --------------------------------------------------------------------------- tokens saved


def test_prefill_saved_hand_computed() -> None:
    # hits of 10, 10 and 2 blocks of 64 tokens; the last prompt has only 100 tokens
    out = prefill_saved([1000, 640, 100], [640, 640, 128], 10_000.0)
    assert out["saved_tokens"] == 1380 and out["input_tokens"] == 1740
    assert out["saved_fraction"] == pytest.approx(1380 / 1740)
    assert out["tokens_per_request"] == {"mean": 460.0, "p50": 640, "p99": 640}
    assert out["ttft_saved_ms"] == pytest.approx({"mean": 46.0, "p50": 64.0, "p99": 64.0})
    assert out["ttft_saved_s_total"] == pytest.approx(0.138)
    many = prefill_saved([64] * 100, [0] * 98 + [64, 64], 1000.0)
    assert many["tokens_per_request"]["p50"] == 0 and many["tokens_per_request"]["p99"] == 64
    assert prefill_saved([], [], 1.0)["tokens_per_request"]["p99"] == 0.0
    with pytest.raises(ValueError):
        prefill_saved([1], [1, 2], 1.0)
    with pytest.raises(ValueError):
        prefill_saved([1], [1], 0.0)


def test_compare_table_gives_tokens_and_ttft_saved() -> None:
    row = {"policy": "lifecycle", "capacity": "0.05", "capacity_blocks": 1000,
           "effective_capacity_blocks": 900, "hit_rate": 0.30, "model_hit_rate": 0.31,
           "lru_hit_rate": 0.28, "belady_hit_rate": 0.36, "cross_worker_hit_fraction": 0.5,
           "evictions": 10, "evicted_pinned": 2, "requests_per_s": 100.0,
           "p99_us": {"request": 2500}, "verification_failures": 0,
           "saved_tokens_per_request": {"mean": 500.0, "p50": 640, "p99": 12_800},
           "ttft_saved_ms": {"mean": 50.0, "p50": 64.0, "p99": 1280.0}}
    table = compare_table({"runs": [row]})
    assert "| 0.05 (1,000 / 900) | lifecycle |" in table
    assert "| 640 / 12,800 | 64 / 1,280 |" in table
