"""The operators' HTTP endpoint: /metrics scraped with prometheus_client's parser while a
loadgen run is going, checked against what the run did; /health and /ready; 503 when the
master's loop does not answer; one registry per server."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmaster._alloc import ALIGN
from kvmaster.metrics import MetricsServer, metric_families
from kvmaster.tools.loadgen.replay import LoadgenConfig, run_replay
from kvmaster.tools.loadgen.synthetic import synthetic_trace


def metrics_url(master: Any) -> str:
    """The ``kvmaster metrics on URL`` line the master prints after ``listening on``."""
    if getattr(master, "metrics_url", None):
        return master.metrics_url
    # The first readline may already have buffered this line, so no select() on the pipe.
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(master.proc.stdout.readline()),
                              daemon=True)
    reader.start()
    reader.join(10)
    assert box, "master printed no metrics line"
    line = box[0]
    assert line.startswith("kvmaster metrics on http://"), line
    master.metrics_url = line.rsplit(" ", 1)[-1].strip()
    return master.metrics_url


def http(url: str, method: str = "GET") -> tuple[int, str, str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


class Scrape:
    """One parsed /metrics page."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for fam in text_string_to_metric_families(text):
            self.types[fam.name] = fam.type
            for s in fam.samples:
                self.samples[s.name, tuple(sorted(s.labels.items()))] = s.value

    def value(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        assert key in self.samples, f"no sample {name}{labels or ''}"
        return self.samples[key]

    def sum(self, name: str) -> float:
        found = [v for (n, _), v in self.samples.items() if n == name]
        assert found, f"no sample {name}"
        return sum(found)


def scrape(url: str) -> Scrape:
    status, ctype, body = http(url + "/metrics")
    assert status == 200, body
    assert ctype.startswith("text/plain"), ctype
    return Scrape(body)


# --------------------------------------------------------------- live master

def test_metrics_match_a_loadgen_run(master) -> None:
    url = metrics_url(master)
    before = scrape(url)
    assert before.value("master_state", state="running") == 1
    assert before.value("master_key_count") == 0
    # Mooncake's names and types: counters it exposes without _total keep their exact name.
    assert before.types["master_evicted_key_count"] == "unknown"
    assert before.types["master_put_start_alloc_failures"] == "counter"
    assert before.types["master_total_capacity_bytes"] == "gauge"

    config = LoadgenConfig(master=master.addr, workers=2, block_bytes=512, capacity_blocks=2048,
                           progress=False)
    result: dict[str, Any] = {}
    errors: list[BaseException] = []

    def replay() -> None:
        try:
            result.update(run_replay(config, synthetic_trace(1200, seed=3)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    thread = threading.Thread(target=replay, name="loadgen")
    thread.start()
    during: list[Scrape] = []
    while thread.is_alive():
        during.append(scrape(url))
        time.sleep(0.05)
    thread.join()
    if errors:
        raise errors[0]
    after = scrape(url)
    assert result["requests"] == 1200 and result["verification_failures"] == 0

    # Scrapes taken while both workers had their segments mounted see both of them.
    share = (config.segment_bytes // 4) & ~(ALIGN - 1)
    mounted = [s for s in during if s.value("master_mounted_segment_count") == 2]
    assert len(mounted) >= 3, f"only {len(mounted)} of {len(during)} scrapes during the run"
    for s in mounted:
        assert s.value("master_total_capacity_bytes") == 2 * 4 * share
        assert s.value("master_active_clients") >= 2
        assert s.value("master_allocated_bytes") <= s.value("master_total_capacity_bytes")
        assert s.value("master_key_count") <= config.capacity_blocks
        assert s.sum("master_shard_capacity_bytes") == s.value("master_total_capacity_bytes")
        assert s.sum("master_shard_key_count") == s.value("master_key_count")
    assert max(s.value("master_key_count") for s in mounted) > 0
    # Counters never go back, scrape after scrape.
    series = [before, *during, after]
    for name in ("master_shard_requests_total", "master_evicted_key_count",
                 "master_leases_granted_total", "master_kv_sessions_created_total",
                 "master_hello_requests_total"):
        values = [s.sum(name) for s in series]
        assert values == sorted(values), (name, values)

    def delta(name: str) -> float:
        return after.sum(name) - before.sum(name)

    # Against what the run did.
    assert result["evictions"] > 0, "the run should overflow the store"
    assert delta("master_evicted_key_count") == result["evictions"]
    assert delta("master_evicted_size_bytes") == result["evicted_bytes"]
    assert delta("master_evicted_size_bytes") == result["evictions"] * config.block_bytes
    assert delta("master_evicted_soft_pin_key_count") == result["evicted_pinned"]
    assert delta("master_successful_evictions_total") > 0
    assert delta("master_put_start_alloc_failures_total") == \
        result["put_error_codes"].get("-200", 0)
    # Every block the workers read got a lease (is_exist grants none by default).
    assert delta("master_leases_granted_total") == \
        result["existing_prefix_blocks"] - result["late_misses"]
    sessions = result["sessions"]["master"]
    assert delta("master_kv_sessions_created_total") == sessions["sessions_created"] > 0
    assert delta("master_kv_sessions_deleted_total") == sessions["sessions_deleted"]
    assert delta("master_kv_session_memberships_added_total") == sessions["memberships_added"]
    assert delta("master_kv_session_memberships_removed_total") == \
        sessions["memberships_removed"]
    # Each client call is at least one request to a shard (a put is a start and an end).
    calls = {op: h["count"] for op, h in result["latency_histograms"].items()}
    routed = sum(n * (2 if op == "put_batch" else 1) for op, n in calls.items() if op != "request")
    assert delta("master_shard_requests_total") >= routed
    assert delta("master_shard_failures_total") <= delta("master_shard_requests_total")
    # The workers closed: their segments are gone and every object either was evicted or
    # went with its segment.
    assert after.value("master_mounted_segment_count") == 0
    assert after.value("master_key_count") == 0
    assert after.value("master_allocated_bytes") == 0
    stored = delta("master_evicted_key_count") + delta("master_segment_erased_keys_total")
    assert 0 < stored <= result["put_blocks"] - result["put_failures"]
    assert after.value("master_kv_session_count") == sessions["live_at_end"] == 0
    assert after.value("master_metrics_snapshot_seconds") < 2.0
    assert after.value("process_resident_memory_bytes") > 0


def test_health_ready_and_unknown_paths(master, make_client) -> None:
    url = metrics_url(master)
    status, ctype, body = http(url + "/health")
    assert status == 200 and ctype == "application/json" and '"state": "running"' in body
    status, _, body = http(url + "/ready")
    assert status == 503 and "no segment mounted" in body
    client = make_client(master, segment_bytes=1 << 20)
    status, _, body = http(url + "/ready")
    assert status == 200 and '"segments": 1' in body
    assert http(url + "/ready", "HEAD")[0] == 200
    assert http(url + "/metrics?name[]=master_key_count")[0] == 200
    status, _, body = http(url + "/nope")
    assert status == 404 and "/metrics" in body
    client.close()
    assert http(url + "/ready")[0] == 503


# ------------------------------------------------------------ unit (no master)

class FakeMaster:
    """Stands in for ``Master``: a loop in a thread and a snapshot coroutine."""

    def __init__(self, keys: int, delay_s: float = 0.0) -> None:
        self.keys = keys
        self.delay_s = delay_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def snapshot(self) -> dict[str, Any]:
        await asyncio.sleep(self.delay_s)
        return {"state": "running", "clients": 1, "segments": 1, "front": {},
                "total": {"keys": self.keys}, "shards": [{"shard": 0, "keys": self.keys}]}

    def stop(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


@pytest.fixture
def fake_server() -> Iterator:
    made: list[tuple[FakeMaster, MetricsServer]] = []

    def make(keys: int, delay_s: float = 0.0, timeout_s: float = 2.0) -> tuple[Any, str]:
        m = FakeMaster(keys, delay_s)
        server = MetricsServer(m, m.loop, "127.0.0.1", 0, timeout_s=timeout_s)
        made.append((m, server))
        return m, server.start()

    yield make
    for m, server in made:
        server.stop()
        if not m.loop.is_closed():
            m.stop()


def test_each_server_has_its_own_registry(fake_server) -> None:
    _, url_a = fake_server(keys=3)
    _, url_b = fake_server(keys=7)
    assert scrape(url_a).value("master_key_count") == 3
    assert scrape(url_b).value("master_key_count") == 7
    assert scrape(url_a).value("master_shard_key_count", shard="0") == 3


def test_a_loop_that_does_not_answer_is_a_503(fake_server) -> None:
    m, url = fake_server(keys=1, delay_s=30.0, timeout_s=0.2)
    t0 = time.monotonic()
    status, _, body = http(url + "/metrics")
    assert status == 503 and "did not answer a snapshot within 0.2 s" in body
    assert time.monotonic() - t0 < 5
    assert http(url + "/health")[0] == 503
    assert http(url + "/ready")[0] == 503
    m.stop()  # the loop is gone: still an answer, never a hang
    status, _, body = http(url + "/health")
    assert status == 503 and "not running" in body


def test_metric_families_render_fields_as_they_appear() -> None:
    """Per-op, lookup and histogram fields are rendered once shards report them."""
    from prometheus_client import CollectorRegistry, generate_latest

    snap = {
        "state": "draining", "clients": 2, "segments": 1,
        "front": {"hello": 3, "op.mount_segment.requests": 1, "op.hello.requests": 99},
        "total": {"keys": 5, "evicted_keys": 2, "op.put_start.requests": 4,
                  "op.put_start.failures": 1, "op.batch_put_start.items": 9,
                  "op.batch_put_start.failed_items": 2, "get_hit_keys": 3, "get_miss_keys": 1},
        "shards": [{"shard": 0, "keys": 5, "requests": 9, "inbox_depth": 2,
                    "service_us.10": 3, "service_us.100": 2, "service_us.inf": 1,
                    "service_us.sum": 500}],
    }

    class Collector:
        def collect(self) -> list:
            return metric_families(snap)

    registry = CollectorRegistry()
    registry.register(Collector())
    s = Scrape(generate_latest(registry).decode())
    assert s.value("master_state", state="draining") == 1
    assert s.value("master_state", state="running") == 0
    assert s.value("master_put_start_requests_total") == 4
    assert s.value("master_put_start_failures_total") == 1
    assert s.value("master_batch_put_start_items_total") == 9
    assert s.value("master_batch_put_start_failed_items_total") == 2
    assert s.value("master_mount_segment_requests_total") == 1
    assert s.value("master_hello_requests_total") == 3  # a fixed name is never duplicated
    assert s.value("master_lookup_keys_total", op="get", result="hit") == 3
    assert s.value("master_lookup_keys_total", op="get", result="miss") == 1
    assert s.value("master_shard_queue_depth", shard="0") == 2
    assert s.types["master_shard_service_seconds"] == "histogram"
    assert s.value("master_shard_service_seconds_bucket", le="1e-05", shard="0") == 3
    assert s.value("master_shard_service_seconds_bucket", le="0.0001", shard="0") == 5
    assert s.value("master_shard_service_seconds_bucket", le="+Inf", shard="0") == 6
    assert s.value("master_shard_service_seconds_count", shard="0") == 6
    assert s.value("master_shard_service_seconds_sum", shard="0") == pytest.approx(0.0005)
    # A field the master does not report is absent, not zero.
    assert ("master_soft_pin_bytes", ()) not in s.samples


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_a_slow_loris_neither_grows_the_master_nor_keeps_the_endpoint(master) -> None:
    """Silent connections take at most MAX_CONNECTIONS threads, each cut off after
    CONNECTION_TIMEOUT_S; the rest are closed at once, and scrapes work again after."""
    import socket
    from urllib.parse import urlparse

    from kvmaster.metrics import CONNECTION_TIMEOUT_S, MAX_CONNECTIONS

    url = metrics_url(master)
    assert http(url + "/health")[0] == 200
    base = _threads(master.proc.pid)
    u = urlparse(url)
    socks = []
    try:
        for _ in range(200):
            s = socket.create_connection((u.hostname, u.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
            socks.append(s)
        time.sleep(0.5)
        grown = _threads(master.proc.pid) - base
        assert grown <= MAX_CONNECTIONS + 2, grown
        closed = 0
        for s in socks:
            s.settimeout(0.05)
            try:
                closed += s.recv(1) == b""
            except (TimeoutError, socket.timeout):
                pass
            except ConnectionResetError:
                closed += 1
        assert closed >= len(socks) - MAX_CONNECTIONS - 2, closed
        deadline = time.monotonic() + CONNECTION_TIMEOUT_S + 10
        status = 0
        while time.monotonic() < deadline:
            try:
                status = http(url + "/health")[0]
            except (OSError, urllib.error.URLError):
                status = 0
            if status == 200:
                break
            time.sleep(0.5)
        assert status == 200
    finally:
        for s in socks:
            s.close()
