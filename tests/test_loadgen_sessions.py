"""Unit tests of the load generator's session planner, kv-cache-tester reader, policy
model and writer-tagged payloads (no master needed).

Tests that read the real traces fail with a clear message when ../shared/traces is
missing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvmaster.tools.loadgen import cli
from kvmaster.tools.loadgen.compare import CompareConfig, compare_table
from kvmaster.tools.loadgen.memclient import MemoryClient
from kvmaster.tools.loadgen.payload import block_payload, payload_writer, verify_payload
from kvmaster.tools.loadgen.reference import (
    belady_prefix_hit_rate,
    lru_prefix_hit_rate,
    policy_prefix_hit_rate,
)
from kvmaster.tools.loadgen.replay import LoadgenConfig, run_replay
from kvmaster.tools.loadgen.sessions import (
    SessionPlanner,
    SessionPolicy,
    continued_requests,
)
from kvmaster.tools.loadgen.traces import (
    Request,
    load_trace,
    namespaced_id,
    read_kvcache_tester,
    read_mooncake,
)

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
CONVERSATION = TRACES / "mooncake" / "conversation_trace.jsonl"
KVTESTER = TRACES / "kv-cache-tester"


def need(path: Path) -> Path:
    assert path.exists(), f"trace not found: {path} (expected ../shared/traces next to the repo)"
    return path


def req(t_s: float, ids: list[int], tokens: int | None = None, session: str | None = None,
        last: bool = False) -> Request:
    """A 512-token-block request at ``t_s`` seconds; full blocks = len(ids) unless ``tokens``."""
    n = 512 * len(ids) if tokens is None else tokens
    return Request(t_s * 1000.0, n, 10, list(ids), session, last_in_session=last)


# --------------------------------------------------------------------------- planner


def test_inferred_continuation_rollback_and_shared_prefix() -> None:
    trace = [
        req(0, [0, 1, 2], tokens=3 * 512),    # A starts; full blocks 0,1,2
        req(1, [0, 5], tokens=600),           # shares only block 0 (not created by A): new
        req(2, [0, 1, 2, 3, 4], tokens=4 * 512 + 100),  # continues A (all of A's full blocks)
        req(3, [0, 1, 2, 9], tokens=4 * 512),  # rollback to A's first turn: same session, trim
        req(4, [0, 5, 7], tokens=3 * 512),     # B's only full block is 0, shared: no parent
    ]
    planner = SessionPlanner(SessionPolicy("session-pin", idle_s=100, pin_min_turns=2))
    tasks = planner.plan(trace)
    reqs = [t for t in tasks if t.kind == "request"]
    sid = [t.session for t in reqs]
    assert sid[0] == sid[2] == sid[3]
    assert len({sid[0], sid[1], sid[4]}) == 3
    # turn 2 of A: members so far 0,1,2 -> prefix 3 held, 4 full blocks to tag, pinned
    assert (reqs[2].member_prefix, reqs[2].tag_blocks, reqs[2].trim, reqs[2].pin) == (3, 4, False,
                                                                                      True)
    # rollback: keep set 0,1,2,9 drops block 3 -> trim
    assert (reqs[3].member_prefix, reqs[3].tag_blocks, reqs[3].trim) == (3, 4, True)
    assert reqs[0].pin is None and reqs[1].pin is None  # first turns are not pinned
    assert planner.counters["linked"] == 2 and planner.counters["trims"] == 1
    closes = [t for t in tasks if t.kind == "close"]
    assert sorted(t.session for t in closes) == sorted(set(sid))  # all closed at the end


def test_timers_run_in_trace_time() -> None:
    pol = SessionPolicy("session-pin", idle_s=10, end_idle_s=50, pin_min_turns=1)
    planner = SessionPlanner(pol)
    assert [t.kind for t in planner.request(0, req(0, [1, 2]))] == ["request"]
    assert planner.advance(9_999) == []
    unpin = planner.advance(10_000)
    assert [(t.kind, t.t_ms) for t in unpin] == [("unpin", 10_000)]
    # activity postpones the close; a late request of the same chain after the
    # close starts a new session
    assert [t.kind for t in planner.advance(49_999)] == []
    close = planner.advance(50_000)
    assert [t.kind for t in close] == ["close"]
    again = planner.request(1, req(60, [1, 2, 3]))
    assert again[0].session != close[0].session
    assert planner.counters == {"created": 2, "closed": 1, "pins": 2, "unpins": 1,
                                "trims": 0, "linked": 0, "max_live": 1, "parent_pins": 0}


def test_explicit_sessions_close_at_their_last_request() -> None:
    trace = [req(0, [1, 2], session="conv"), req(1, [50, 51], session="conv/agent",
                                                    last=True),
             req(2, [1, 2, 3], session="conv", last=True)]
    tasks = SessionPlanner(SessionPolicy()).plan(trace)
    assert [t.kind for t in tasks] == ["request", "request", "close", "request", "close"]
    assert tasks[0].session == tasks[3].session != tasks[1].session
    assert tasks[3].member_prefix == 2


def test_oracle_pins_exactly_the_continued_requests() -> None:
    trace = [req(0, [1, 2]), req(1, [7, 8]), req(2, [1, 2, 3])]
    pol = SessionPolicy("session-oracle")
    cont = continued_requests(trace, pol)
    assert cont == {0}
    reqs = [t for t in SessionPlanner(pol, continued=cont).plan(trace) if t.kind == "request"]
    # pinned while it will come back, unpinned at its last turn; never pinned: no call
    assert [t.pin for t in reqs] == [True, None, False]


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        SessionPolicy("session-pin", sessions=False).validate()
    with pytest.raises(ValueError):
        SessionPolicy("sometimes").validate()
    with pytest.raises(ValueError):
        SessionPolicy(idle_s=0).validate()
    SessionPolicy("ttl-pin", sessions=False).validate()
    with pytest.raises(ValueError):
        SessionPlanner(SessionPolicy("session-oracle"))


# --------------------------------------------------------------------------- policy model


def test_model_none_is_exact_lru_and_oracle_beats_it() -> None:
    requests = read_mooncake(need(CONVERSATION), limit=3000)
    for cap in (500, 3000):
        lru = lru_prefix_hit_rate(requests, cap)
        none = policy_prefix_hit_rate(requests, cap, SessionPolicy("none"))
        assert (none.prefix_hits, none.evictions) == (lru.prefix_hits, lru.evictions)
        oracle = policy_prefix_hit_rate(requests, cap, SessionPolicy("session-oracle"))
        belady = belady_prefix_hit_rate(requests, cap)
        assert lru.hit_rate < oracle.hit_rate <= belady.hit_rate


def test_model_session_pin_keeps_a_pinned_conversation() -> None:
    # Conversation A (blocks 1-3) comes back after one-shot requests that would push
    # it out of a 6-block LRU; pinned, it survives.
    trace = [req(0, [1, 2, 3]), req(1, [1, 2, 3, 4]),
             req(2, [10, 11]), req(3, [12, 13]), req(4, [14, 15]),
             req(5, [1, 2, 3, 4, 5])]
    lru = lru_prefix_hit_rate(trace, 6)
    pinned = policy_prefix_hit_rate(trace, 6, SessionPolicy("session-pin", idle_s=100,
                                                            pin_min_turns=2))
    assert lru.prefix_hits == 3 and pinned.prefix_hits == 7
    # Unpinned after 1 s of idle trace time, it is evicted like under LRU.
    short = policy_prefix_hit_rate(trace, 6, SessionPolicy("session-pin", idle_s=1,
                                                           pin_min_turns=2))
    assert short.prefix_hits == lru.prefix_hits
    # A TTL pin of 100 s on every write keeps the one-shot blocks as well.
    ttl = policy_prefix_hit_rate(trace, 6, SessionPolicy("ttl-pin", idle_s=100))
    assert ttl.prefix_hits == lru.prefix_hits


# --------------------------------------------------------------------------- traces


def test_kvcache_tester_reader_namespaces_and_nests(tmp_path: Path) -> None:
    doc = {"id": "conv", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 200, "out": 5, "hash_ids": [1, 2, 3]},
        {"t": 10.0, "type": "subagent", "agent_id": "a1", "requests": [
            {"t": 1.0, "type": "n", "in": 130, "out": 5, "hash_ids": [7, 8]},
            {"t": 2.0, "type": "subagent", "agent_id": "a2", "requests": [
                {"t": 0.5, "type": "s", "in": 64, "out": 1, "hash_ids": [9]}]},
            {"t": 4.0, "type": "n", "in": 200, "out": 5, "hash_ids": [7, 8, 10]}]},
        {"t": 20.0, "type": "n", "in": 300, "out": 5, "hash_ids": [1, 2, 3, 4]},
    ]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(doc))
    b.write_text(json.dumps({**doc, "id": "other"}))
    trace = read_kvcache_tester([a, b], stagger_s=100.0)
    assert len(trace) == 10
    first = [r for r in trace if r.hash_ids and r.hash_ids[0] == namespaced_id(0, 1)]
    assert [r.timestamp_ms for r in first] == [0.0, 20_000.0]
    sub = [r for r in trace if r.session == "conv/a1"]
    assert [r.timestamp_ms for r in sub] == [11_000.0, 14_000.0]
    assert sub[1].last_in_session and not sub[0].last_in_session
    nested = [r for r in trace if r.session == "conv/a1/a2"]
    assert nested[0].timestamp_ms == 12_500.0 and nested[0].parent_session == "conv/a1"
    assert {r.hash_ids[0] >> 40 for r in trace} == {1, 2}  # ids kept apart per file
    assert trace[-1].timestamp_ms == 120_000.0 and trace[-1].session == "other"
    assert first[0].full_blocks == 3 and first[0].block_tokens == 64
    assert load_trace(f"{a}", limit=2) == trace[:2]
    with pytest.raises(ValueError, match="mix"):
        load_trace(f"{a}:{CONVERSATION}")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"requests": [{"t": 0, "type": "n", "hash_ids": [1]}]}))
    with pytest.raises(ValueError, match="bad.json"):
        read_kvcache_tester([bad])


def test_real_kvcache_tester_files() -> None:
    files = [need(KVTESTER / f) for f in ("trace_0277.json", "trace_0291.json")]
    trace = load_trace(":".join(str(f) for f in files))
    sessions = {r.session for r in trace}
    assert len(sessions) == 8  # 2 main threads + 6 sub-agents
    assert sum(r.last_in_session for r in trace) == 8
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(trace, trace[1:]))
    tasks = SessionPlanner(SessionPolicy()).plan(trace)
    assert sum(t.kind == "close" for t in tasks) == 8


# --------------------------------------------------------------------------- payloads, CLI


def test_payload_names_its_writer() -> None:
    for n in (8, 24, 100, 4096):
        data = block_payload("ns-7", n, writer=5)
        assert payload_writer("ns-7", data) == 5 and verify_payload("ns-7", data)
        if n > 8:  # eight bytes hold only the length and writer
            assert payload_writer("ns-8", data) is None
        assert payload_writer("ns-7", block_payload("ns-7", n)) == 0
        for pos in {n - 1, 6, 7} if n > 8 else {n - 1 - 2}:  # writer field bytes: 6, 7
            flipped = bytearray(data)
            flipped[pos] ^= 1
            assert payload_writer("ns-7", bytes(flipped)) is None
    assert payload_writer("k", block_payload("k", 5, writer=3)) == 0  # too short to carry it
    with pytest.raises(ValueError):
        block_payload("k", 64, writer=1 << 16)


def test_cli_session_flags_and_several_traces() -> None:
    parser = cli.build_parser()
    cfg = cli.config_from_args(parser.parse_args(
        ["replay", "a.json", "b.json", "--retention", "session-pin", "--idle-s", "30",
         "--routing", "round-robin", "--workers", "8", "--no-sessions", "--master-watermark",
         "1.0", "--master-lease-ms", "200", "--audit-sessions"]))
    assert cfg.trace == "a.json:b.json" and cfg.retention == "session-pin"
    assert (cfg.idle_s, cfg.routing, cfg.sessions, cfg.master_watermark,
            cfg.master_lease_ms, cfg.audit_sessions) == (30.0, "round-robin", False, 1.0,
                                                         200, True)
    with pytest.raises(ValueError):
        cfg.validate()  # session-pin without session calls
    with pytest.raises(ValueError):
        LoadgenConfig(routing="sticky").validate()
    args = parser.parse_args(["compare", "t.jsonl", "--policies", "none,session-pin",
                              "--capacities", "0.1,5000"])
    from kvmaster.tools.loadgen.compare import compare_config_from_args

    cc = compare_config_from_args(args)
    assert cc.policy_list() == ["none", "session-pin"]
    assert cc.capacity_list(1000) == [("0.1", 100), ("5000", 5000)]
    with pytest.raises(ValueError):
        CompareConfig(policies="none,lfu").policy_list()


def test_reference_cli_prints_the_policy_model(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ref.json"
    assert cli.main(["reference", str(need(CONVERSATION)), "--limit", "1000",
                     "--capacity-blocks", "1000", "--retention", "session-pin",
                     "--json", str(out)]) == 0
    assert "model:session-pin" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"lru", "belady", "unbounded", "model:session-pin"}


def test_compare_table_gap_column() -> None:
    row = {"policy": "session-pin", "capacity": "0.1", "capacity_blocks": 100,
           "hit_rate": 0.30, "model_hit_rate": 0.31, "lru_hit_rate": 0.28,
           "belady_hit_rate": 0.36, "cross_worker_hit_fraction": 0.5, "evictions": 10,
           "evicted_pinned": 2, "requests_per_s": 100.0, "p99_us": {"request": 2500},
           "verification_failures": 0}
    table = compare_table({"runs": [row], "oracle_model": {"0.1": 0.35}})
    assert "| 25% |" in table and "30.00%" in table and "35.00%" in table


# --------------------------------------------------------------------------- dispatcher order

LOG_ENV = "KVMASTER_LOADGEN_TEST_LOG"


class LoggingClient(MemoryClient):
    """MemoryClient that appends every session-related call to the file named by LOG_ENV
    (one line per call: monotonic ns, pid, call, session), from any worker process."""

    def _log(self, call: str, session: str) -> None:
        with open(os.environ[LOG_ENV], "a", encoding="utf-8") as fh:
            fh.write(f"{time.monotonic_ns()} {os.getpid()} {call} {session}\n")

    def put_batch(self, keys, values, config=None):  # type: ignore[no-untyped-def]
        tags = getattr(config, "kv_sessions", None)
        if tags and tags[0]:
            self._log("put", tags[0][0])
        return super().put_batch(keys, values, config)

    def attach_kv_session(self, session_id, keys):  # type: ignore[no-untyped-def]
        self._log("attach", session_id)
        return super().attach_kv_session(session_id, keys)

    def pin_kv_session(self, session_id):  # type: ignore[no-untyped-def]
        self._log("pin", session_id)

    def unpin_kv_session(self, session_id):  # type: ignore[no-untyped-def]
        self._log("unpin", session_id)

    def close_kv_session(self, session_id):  # type: ignore[no-untyped-def]
        self._log("close", session_id)


def test_session_calls_stay_in_order_across_workers(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "calls.log"
    monkeypatch.setenv(LOG_ENV, str(log))
    requests = read_mooncake(need(CONVERSATION), limit=400)
    config = LoadgenConfig(master="mem:0", client_factory=f"{__name__}:LoggingClient",
                           workers=4, routing="round-robin", retention="session-pin",
                           pin_min_turns=1, idle_s=15.0, end_idle_s=40.0, block_bytes=64,
                           capacity_blocks=100_000, progress=False, references=False)
    result = run_replay(config, requests)
    assert result["requests"] == 400 and result["verification_failures"] == 0
    events: dict[str, list[tuple[int, int, str]]] = {}
    for line in log.read_text().splitlines():
        t, pid, call, sid = line.split()
        events.setdefault(sid, []).append((int(t), int(pid), call))
    planned = result["sessions"]["planned"]
    assert len(events) == planned["created"]
    workers_used = set()
    for sid, ev in events.items():
        calls = [c for _, _, c in sorted(ev)]
        assert calls[-1] == "close" and calls.count("close") == 1, (sid, calls)
        # every request of a session ends with its pin (pin_min_turns=1), so an unpin
        # always follows a pin and a pin never directly follows an unpin's request
        for prev, nxt in zip(calls, calls[1:]):
            assert not (prev == "unpin" and nxt == "unpin"), (sid, calls)
        workers_used.update(pid for _, pid, _ in ev)
    assert len(workers_used) == 4
    assert sum(c == "unpin" for ev in events.values() for _, _, c in ev) == planned["unpins"] > 0


def test_planned_pinned_blocks_follow_pins_trims_and_closes() -> None:
    pol = SessionPolicy("session-pin", idle_s=10, end_idle_s=100, pin_min_turns=1)
    planner = SessionPlanner(pol)
    planner.request(0, req(0, [1, 2, 3]))
    assert planner.pinned_blocks == 3
    planner.request(1, req(1, [1, 2, 3, 4]))        # continues: one more block
    planner.request(2, req(2, [1, 7, 8]))           # another session sharing block 1
    assert planner.pinned_blocks == 6
    planner.advance(11_500)                          # first session unpinned at 11 s
    assert planner.pinned_blocks == 3
    planner.finish()
    assert planner.pinned_blocks == 0
