"""Unit tests of the load generator's pure parts (no master needed).

The real traces are read from ``../shared/traces`` relative to the repository
root; tests that need them fail with a clear message when that folder is absent.
"""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest

from kvmaster.tools.loadgen import cli
from kvmaster.tools.loadgen.payload import block_key, block_payload, verify_payload
from kvmaster.tools.loadgen.reference import (
    belady_prefix_hit_rate,
    lru_prefix_hit_rate,
    unbounded_prefix_hit_rate,
)
from kvmaster.tools.loadgen.replay import (
    CODE_ALREADY_EXISTS,
    CODE_NO_AVAILABLE_HANDLE,
    LoadgenConfig,
    process_request,
    run_replay,
)
from kvmaster.tools.loadgen.stats import LatencyRecorder, bucket_us
from kvmaster.tools.loadgen.synthetic import synthetic_trace
from kvmaster.tools.loadgen.traces import Request, read_mooncake

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
CONVERSATION = TRACES / "mooncake" / "conversation_trace.jsonl"

def _require_traces() -> None:
    assert CONVERSATION.is_file(), f"trace not found: {CONVERSATION} (../shared/traces)"


needs_traces = pytest.mark.usefixtures("traces_present")


@pytest.fixture
def traces_present() -> None:
    _require_traces()


def reqs(*chains: list[int]) -> list[Request]:
    """Requests with the given hash_id lists, 1 ms apart."""
    return [Request(float(i), 512 * len(c), 1, list(c)) for i, c in enumerate(chains)]


@pytest.fixture(scope="module")
def conversation_head() -> list[Request]:
    return read_mooncake(CONVERSATION, limit=1500)


# --------------------------------------------------------------------------- traces


@needs_traces
def test_read_mooncake_first_100_lines() -> None:
    rs = read_mooncake(CONVERSATION, limit=100)
    assert len(rs) == 100
    first = rs[0]
    assert first == Request(0.0, 6758, 500, list(range(14)))
    assert first.session is None
    for r in rs:
        assert r.hash_ids[0] == 0
        assert len(r.hash_ids) == math.ceil(r.input_length / 512)
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(rs, rs[1:]))


def test_read_mooncake_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    good = '{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n'
    cases = {
        "json": '{"timestamp": 6, "input_length": ',
        "missing": '{"timestamp": 6, "input_length": 1, "output_length": 1}',
        "ids": '{"timestamp": 6, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}',
        "length": '{"timestamp": 6, "input_length": 1.5, "output_length": 1, "hash_ids": []}',
        "array": "[1, 2, 3]",
    }
    for name, bad in cases.items():
        path = tmp_path / f"bad-{name}.jsonl"
        path.write_text(good + "\n" + bad + "\n" + good)
        with pytest.raises(ValueError, match=rf"bad-{name}\.jsonl:3: malformed"):
            read_mooncake(path)
        # A limit that stops before the bad line reads fine.
        assert len(read_mooncake(path, limit=1)) == 1


def test_read_mooncake_blank_lines_and_limit(tmp_path: Path) -> None:
    line = '{"timestamp": %d, "input_length": 10, "output_length": 2, "hash_ids": [%d]}\n'
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line % (i, i) for i in range(5)) + "\n\n")
    rs = read_mooncake(path)
    assert [r.hash_ids for r in rs] == [[i] for i in range(5)]
    assert read_mooncake(path, limit=0) == []
    assert len(read_mooncake(path, limit=3)) == 3


# --------------------------------------------------------------------------- references


def test_lru_hand_computed() -> None:
    # capacity 3, cache listed oldest -> newest after each request:
    # [1,2]: prefix 0 -> 1 2 | [1,3]: prefix 1 -> 2 1 3 | [1,2,4]: prefix 2, 3 evicted
    # -> 1 2 4 | [1,3]: prefix 1, 2 evicted -> 4 1 3 | [1,2]: prefix 1, 4 evicted -> 3 1 2
    r = lru_prefix_hit_rate(reqs([1, 2], [1, 3], [1, 2, 4], [1, 3], [1, 2]), 3)
    assert (r.requests, r.blocks, r.prefix_hits, r.block_hits, r.evictions) == (5, 11, 5, 5, 3)
    assert r.hit_rate == pytest.approx(5 / 11)


def test_lru_lookup_before_fill() -> None:
    # [1,2,3] -> 1 2 3 | [9]: 1 evicted -> 2 3 9 | [1,2,3]: prefix 0, but 2 and 3 are
    # hits refreshed before 1 is inserted, so 9 (not 2) is evicted -> 2 3 1 | [1,2,3]: 3.
    r = lru_prefix_hit_rate(reqs([1, 2, 3], [9], [1, 2, 3], [1, 2, 3]), 3)
    assert (r.prefix_hits, r.block_hits, r.evictions) == (3, 5, 2)


def test_request_longer_than_cache() -> None:
    r = lru_prefix_hit_rate(reqs([1, 2, 3, 4], [1, 2, 3, 4]), 2)
    assert r.prefix_hits == 0 and r.evictions == 4
    assert lru_prefix_hit_rate(reqs([1], [1]), 0).prefix_hits == 0
    assert belady_prefix_hit_rate(reqs([1], [1]), 0).prefix_hits == 0
    # Belady keeps what is used next: the two leading blocks.
    assert belady_prefix_hit_rate(reqs([1, 2, 3, 4], [1, 2, 3, 4]), 2).prefix_hits == 2


def test_unbounded_hand_computed() -> None:
    r = unbounded_prefix_hit_rate(reqs([1, 2], [1, 2, 3], [4, 2], [1, 5]))
    assert (r.blocks, r.prefix_hits, r.block_hits) == (9, 3, 4)
    assert r.capacity_blocks is None


def test_empty_trace() -> None:
    for r in (lru_prefix_hit_rate([], 4), belady_prefix_hit_rate([], 4),
              unbounded_prefix_hit_rate([])):
        assert r.blocks == 0 and r.hit_rate == 0.0
    with pytest.raises(ValueError):
        lru_prefix_hit_rate([], -1)


@needs_traces
def test_belady_between_lru_and_unbounded(conversation_head: list[Request]) -> None:
    unb = unbounded_prefix_hit_rate(conversation_head)
    previous = -1.0
    for cap in (64, 512, 2048, 8192):
        lru = lru_prefix_hit_rate(conversation_head, cap)
        bel = belady_prefix_hit_rate(conversation_head, cap)
        assert lru.hit_rate <= bel.hit_rate <= unb.hit_rate
        assert bel.prefix_hits == bel.block_hits  # prefix-chained trace: OPT stays prefix-closed
        assert bel.hit_rate >= previous  # more capacity never hurts OPT
        previous = bel.hit_rate
    assert belady_prefix_hit_rate(conversation_head, 64).hit_rate < unb.hit_rate


def random_chained_trace(rng: random.Random, n_requests: int) -> list[Request]:
    """Tiny prefix-chained trace: each request extends a random existing chain."""
    chains: list[list[int]] = [[]]
    next_id = 0
    out = []
    for _ in range(n_requests):
        base = rng.choice(chains)
        keep = base[:rng.randint(0, len(base))]
        new = rng.randint(0 if keep else 1, 2)
        chain = keep + list(range(next_id, next_id + new))
        next_id += new
        chains.append(chain)
        out.append(chain)
    return reqs(*out)


def brute_force_best_prefix_hits(requests: list[Request], capacity: int) -> int:
    """Max prefix hits over every eviction choice (victim among cached + new block)."""
    chains = tuple(tuple(r.hash_ids) for r in requests)

    @lru_cache(maxsize=None)
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(chains):
            return 0
        ids = chains[i]
        prefix = 0
        for h in ids:
            if h not in cache:
                break
            prefix += 1
        misses = tuple(dict.fromkeys(h for h in ids if h not in cache))
        return prefix + fill(i, 0, misses, cache)

    @lru_cache(maxsize=None)
    def fill(i: int, j: int, misses: tuple[int, ...], cache: frozenset[int]) -> int:
        if j == len(misses):
            return best(i + 1, cache)
        grown = cache | {misses[j]}
        if len(grown) <= capacity:
            return fill(i, j + 1, misses, grown)
        return max(fill(i, j + 1, misses, grown - {v}) for v in grown)

    return best(0, frozenset())


def test_belady_equals_brute_force_on_tiny_traces() -> None:
    rng = random.Random(7)
    for _ in range(150):
        trace = random_chained_trace(rng, rng.randint(2, 7))
        for cap in (1, 2, 3):
            bel = belady_prefix_hit_rate(trace, cap)
            assert bel.prefix_hits == brute_force_best_prefix_hits(trace, cap), (trace, cap)
            assert bel.prefix_hits >= lru_prefix_hit_rate(trace, cap).prefix_hits


# --------------------------------------------------------------------------- payloads


def test_block_key_format() -> None:
    assert block_key("ns", 255) == "ns-ff"
    assert block_key("lg-1", 0) == "lg-1-0"


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 23, 24, 25, 64, 100, 4096, 65536])
def test_payload_deterministic_and_verifiable(nbytes: int) -> None:
    a = block_payload("ns-1", nbytes)
    assert isinstance(a, bytes) and len(a) == nbytes
    assert a == block_payload("ns-1", nbytes)
    assert verify_payload("ns-1", a)
    assert verify_payload("ns-1", bytearray(a)) and verify_payload("ns-1", memoryview(a))
    if nbytes:
        assert not verify_payload("ns-2", a) or nbytes <= 8
        flipped = bytearray(a)
        flipped[nbytes // 2] ^= 0x01
        assert not verify_payload("ns-1", bytes(flipped))
    if nbytes > 8:
        assert not verify_payload("ns-1", a[:-1])  # truncated: the stamped length differs
        assert not verify_payload("ns-1", a + b"\0")


def test_payloads_of_different_keys_share_no_64_byte_chunk() -> None:
    a, b = block_payload("ns-1", 4096), block_payload("ns-2", 4096)
    assert a[8:24] != b[8:24]
    assert all(a[i:i + 64] != b[i:i + 64] for i in range(0, 4096, 64))


# --------------------------------------------------------------------------- stats


def test_bucket_rounding() -> None:
    assert [bucket_us(v) for v in (0, 0.4, 1.6, 999.4)] == [0, 0, 2, 999]
    assert bucket_us(1234) == 1230 and bucket_us(1235) == 1240
    assert bucket_us(56789) == 56800 and bucket_us(999_999) == 1_000_000
    assert bucket_us(12_345_678) == 12_300_000


def test_percentiles_on_known_data() -> None:
    rec = LatencyRecorder()
    values = list(range(1, 1001))
    random.Random(1).shuffle(values)
    for v in values:
        rec.record("get_batch", v / 1e6)
    s = rec.summary()["get_batch"]
    assert (s["count"], s["p50_us"], s["p99_us"], s["p999_us"]) == (1000, 500, 990, 999)
    assert s["min_us"] == pytest.approx(1.0) and s["max_us"] == pytest.approx(1000.0)
    assert s["mean_us"] == pytest.approx(500.5)
    assert rec.percentile("get_batch", 0.0) == 1 and rec.percentile("get_batch", 1.0) == 1000
    assert rec.percentile("missing", 0.5) is None

    big = LatencyRecorder()
    for v in (1000, 2000, 3000, 4000, 123_456):
        big.record_us("put_batch", v)
    assert big.percentile("put_batch", 0.5) == 3000
    assert big.percentile("put_batch", 0.99) == 123_000
    top = LatencyRecorder()
    top.record_us("x", 22_274)  # bucket 22,300 is above the largest sample: clamped
    assert top.percentile("x", 0.999) == 22_274


def test_merge_of_worker_dicts() -> None:
    rng = random.Random(3)
    samples = [(rng.choice(["a", "b"]), rng.expovariate(1 / 800.0)) for _ in range(3000)]
    whole = LatencyRecorder()
    parts = [LatencyRecorder() for _ in range(3)]
    for i, (op, v) in enumerate(samples):
        whole.record_us(op, v)
        parts[i % 3].record_us(op, v)
    # Worker recorders come back as plain dicts, possibly through JSON.
    dicts = [json.loads(json.dumps(p.to_dict())) for p in parts]
    merged = LatencyRecorder.merged(dicts)
    assert merged.summary().keys() == {"a", "b"}
    for op in ("a", "b"):
        m, w = merged.summary()[op], whole.summary()[op]
        assert m["count"] == w["count"]
        for key in ("p50_us", "p99_us", "p999_us", "min_us", "max_us"):
            assert m[key] == w[key]
        assert m["mean_us"] == pytest.approx(w["mean_us"], abs=0.11)
    json.dumps(merged.summary())
    empty = LatencyRecorder.from_dict(json.loads(json.dumps(LatencyRecorder().to_dict())))
    assert empty.summary() == {}


# --------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_and_shaped() -> None:
    a = synthetic_trace(3000, seed=11)
    assert a == synthetic_trace(3000, seed=11)
    assert a != synthetic_trace(3000, seed=12)
    assert synthetic_trace(100, seed=11) == a[:100]
    assert len(a) == 3000 and a[0].timestamp_ms == 0.0
    assert all(x.timestamp_ms <= y.timestamp_ms for x, y in zip(a, a[1:]))
    predecessor: dict[int, int | None] = {}
    last_turn: dict[str, Request] = {}
    extended = 0
    for r in a:
        assert r.hash_ids[:2] == [0, 1]  # shared system prompt
        assert len(r.hash_ids) == math.ceil(r.input_length / 512)
        prev = None
        for h in r.hash_ids:  # prefix-chained: one predecessor per id
            assert predecessor.setdefault(h, prev) == prev
            prev = h
        assert r.session is not None
        before = last_turn.get(r.session)
        if before is not None:
            full = before.input_length // 512
            assert r.hash_ids[:full] == before.hash_ids[:full]
            assert r.input_length > before.input_length
            extended += 1
        last_turn[r.session] = r
    sessions = len(last_turn)
    # Many single-turn conversations, some multi-turn ones (the first ~15 minutes
    # of the default workload: later turns of early conversations are included).
    assert 0.6 * len(a) < sessions < 0.92 * len(a)
    assert extended == len(a) - sessions
    assert 0 < unbounded_prefix_hit_rate(a).hit_rate < 1


# --------------------------------------------------------------------------- config / CLI


def test_cli_defaults_come_from_config() -> None:
    parser = cli.build_parser()
    cfg = cli.config_from_args(parser.parse_args(["replay", "t.jsonl"]))
    assert cfg == LoadgenConfig(trace="t.jsonl")
    cfg = cli.config_from_args(parser.parse_args(
        ["synthetic", "--requests", "50", "--workers", "3", "--speed", "2.5", "--no-progress",
         "--json", "out.json", "--master", "h:1", "--block-bytes", "8192"]))
    assert (cfg.requests, cfg.workers, cfg.speed, cfg.progress, cfg.json_path, cfg.master,
            cfg.block_bytes) == (50, 3, 2.5, False, "out.json", "h:1", 8192)
    assert LoadgenConfig(capacity_blocks=4097, workers=2, block_bytes=10).segment_bytes == 20490
    with pytest.raises(ValueError):
        LoadgenConfig(workers=0).validate()


def test_cli_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 512 * len(c), "output_length": 1,
                    "hash_ids": c}) + "\n"
        for i, c in enumerate([[1, 2], [1, 3], [1, 2, 4], [1, 3], [1, 2]])))
    out_json = tmp_path / "ref.json"
    assert cli.main(["reference", str(trace), "--capacity-blocks", "3",
                     "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "lru" in text and "belady" in text and "unbounded" in text
    doc = json.loads(out_json.read_text())
    assert doc["results"]["lru"]["prefix_hits"] == 5
    assert doc["results"]["unbounded"]["prefix_hits"] == 7
    assert cli.main(["reference", str(tmp_path / "missing.jsonl")]) == 1


# --------------------------------------------------------------------------- replay logic


class FakeClient:
    """In-memory stand-in for kvmaster.Client: LRU over bytes of ``global_segment_size``.

    ``batch_is_exist`` does not touch recency, ``get_batch`` does, ``put_batch``
    of a stored key returns -705 without touching it.
    """

    def __init__(self) -> None:
        self.store: OrderedDict[str, bytes] = OrderedDict()
        self.capacity = 0
        self.used = 0
        self.evicted_keys = 0
        self.evicted_bytes = 0

    def setup(self, master_server_addr: str, global_segment_size: int,
              tenant: str = "default") -> None:
        self.capacity = global_segment_size

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        assert len(keys) <= 4096
        return [1 if k in self.store else 0 for k in keys]

    def get_batch(self, keys: list[str]) -> list[bytes | None]:
        assert len(keys) <= 4096
        out = []
        for k in keys:
            v = self.store.get(k)
            if v is not None:
                self.store.move_to_end(k)
            out.append(v)
        return out

    def put_batch(self, keys: list[str], values: list[bytes], config: object = None) -> list[int]:
        assert len(keys) == len(values) <= 4096
        codes = []
        for k, v in zip(keys, values):
            if k in self.store:
                codes.append(CODE_ALREADY_EXISTS)
                continue
            if len(v) > self.capacity:
                codes.append(CODE_NO_AVAILABLE_HANDLE)
                continue
            while self.used + len(v) > self.capacity:
                _, old = self.store.popitem(last=False)
                self.used -= len(old)
                self.evicted_keys += 1
                self.evicted_bytes += len(old)
            self.store[k] = v
            self.used += len(v)
            codes.append(0)
        return codes

    def stats(self) -> dict:
        return {"evicted_keys": self.evicted_keys, "evicted_bytes": self.evicted_bytes}

    def close(self) -> None:
        self.store.clear()


class ScriptedClient(FakeClient):
    """FakeClient whose reads and writes can be made to misbehave per key."""

    def __init__(self, vanish: set[str], corrupt: set[str], refuse: set[str]) -> None:
        super().__init__()
        self.capacity = 1 << 30
        self.vanish, self.corrupt, self.refuse = vanish, corrupt, refuse

    def get_batch(self, keys: list[str]) -> list[bytes | None]:
        vals = super().get_batch(keys)
        return [None if k in self.vanish else (v[:-1] + b"?" if k in self.corrupt else v)
                for k, v in zip(keys, vals)]

    def put_batch(self, keys: list[str], values: list[bytes], config: object = None) -> list[int]:
        codes = super().put_batch(keys, values)
        return [CODE_NO_AVAILABLE_HANDLE if k in self.refuse else c for k, c in zip(keys, codes)]


def test_process_request_counts() -> None:
    keys = [block_key("t", h) for h in range(6)]
    client = ScriptedClient(vanish={keys[2]}, corrupt={keys[3]}, refuse={keys[5]})
    rec = LatencyRecorder()
    first = process_request(client, keys[:4], 64, rec)
    assert (first.existing_prefix, first.prefix, first.put_blocks) == (0, 0, 4)
    assert first.put_failures == 0
    out = process_request(client, keys, 64, rec)
    # 0..3 exist; 2 vanished (late miss), 3 corrupt; prefix cut at 2; 2..5 put again:
    # 2 and 3 already exist (-705, fine), 4 ok, 5 refused.
    assert out.blocks == 6 and out.existing_prefix == 4 and out.prefix == 2
    assert out.late_misses == 1 and out.verification_failures == 1
    assert out.put_blocks == 4 and out.put_failures == 1
    assert out.put_codes == {CODE_NO_AVAILABLE_HANDLE: 1}
    assert rec.count("batch_is_exist") == 2 and rec.count("get_batch") == 1
    assert rec.count("put_batch") == 2 and rec.count("request") == 2


def test_process_request_splits_large_batches() -> None:
    client = FakeClient()
    client.setup("x:1", 1 << 30)
    keys = [block_key("big", h) for h in range(5000)]
    rec = LatencyRecorder()
    assert process_request(client, keys, 8, rec).put_blocks == 5000
    again = process_request(client, keys, 8, rec)
    assert again.prefix == 5000 and again.put_blocks == 0
    assert rec.count("batch_is_exist") == 4 and rec.count("get_batch") == 2
    assert rec.count("put_batch") == 2


def test_run_replay_with_fake_client(tmp_path: Path) -> None:
    trace = synthetic_trace(300, seed=5)
    # The fake store evicts only when full: a high watermark of 1.0.
    base = LoadgenConfig(master="fake:0", workers=1, block_bytes=64, progress=False,
                         client_factory=f"{__name__}:FakeClient", master_watermark=1.0)
    # Unbounded store: exactly the unbounded reference.
    big = run_replay(replace(base, capacity_blocks=10**6, json_path=str(tmp_path / "r.json")),
                     trace)
    assert big["requests"] == 300 and big["blocks"] == sum(len(r.hash_ids) for r in trace)
    assert big["prefix_hit_rate"] == pytest.approx(unbounded_prefix_hit_rate(trace).hit_rate)
    assert big["evictions"] == 0 and big["verification_failures"] == 0
    assert big["late_misses"] == 0 and big["put_failures"] == 0
    assert set(big["latency_us"]) == {"batch_is_exist", "get_batch", "put_batch", "request"}
    assert json.loads((tmp_path / "r.json").read_text())["requests"] == 300
    # Small LRU store: close to the exact LRU reference at the same capacity.
    small = run_replay(replace(base, capacity_blocks=500), trace)
    assert small["reference_capacity_blocks"] == 500 and small["evictions"] > 0
    assert small["prefix_hit_rate"] == pytest.approx(small["reference_lru_hit_rate"], abs=0.02)
    # Two workers (separate fake stores): every request is processed once.
    two = run_replay(replace(base, workers=2, speed=1000.0), trace)
    assert two["requests"] == 300 and two["blocks"] == big["blocks"]
    assert two["dispatch_lag_us"]["count"] == 300
