"""Eviction against a real master with one shard and a 1 MiB segment holding
sixteen 64 KiB values, so every eviction is deterministic.

Unless a test is about the watermark, the master runs with
``--eviction-high-watermark-ratio 1.0``: eviction then happens only when an
allocation does not fit, one least-recently-used object per missing slot.
Presence is checked with ``query_key``, which does not touch recency.
"""

from __future__ import annotations

import time

import pytest
from conftest import present

from kvmaster import (
    Client,
    InvalidParams,
    NoAvailableHandle,
    ReplicateConfig,
    SoftPinAction,
    Status,
)

KiB = 1 << 10
MiB = 1 << 20
SLOT = 64 * KiB
SLOTS = 16
VALUE = b"v" * SLOT

ONE_SHARD = ("--shards", "1")
EXACT = (*ONE_SHARD, "--eviction-high-watermark-ratio", "1.0")
SOFT = ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE)
HARD = ReplicateConfig(with_hard_pin=True)



def names(prefix: str, n: int, start: int = 0) -> list[str]:
    return [f"{prefix}{i}" for i in range(start, start + n)]


def put_all(c: Client, keys: list[str], config: ReplicateConfig | None = None) -> None:
    for k in keys:
        c.put(k, VALUE, config)


@pytest.fixture
def store(start_master, make_client):
    """Factory: ``store(*master_flags)`` -> a client whose 1 MiB segment is the only one."""

    def make(*flags: str) -> Client:
        m = start_master(*flags)
        return make_client(m, segment_bytes=MiB)

    return make


def test_lru_evicts_oldest_first_and_counts(store) -> None:
    c = store(*EXACT)
    old = names("k", SLOTS)
    put_all(c, old)
    s = c.stats()
    assert (s["keys"], s["evicted_keys"], s["capacity_bytes"]) == (SLOTS, 0, MiB)

    put_all(c, names("n", 4))
    assert present(c, old) == old[4:]
    s = c.stats()
    assert s["keys"] == SLOTS
    assert s["evicted_keys"] == 4 and s["evicted_bytes"] == 4 * SLOT


def test_watermark_eviction_keeps_pace_and_counters_match(store) -> None:
    c = store(*ONE_SHARD)  # default watermark 0.9, eviction ratio 0.05
    keys = names("k", 40)
    for k in keys:
        c.put(k, VALUE)  # every put succeeds: eviction frees space ahead of need
    s = c.stats()
    alive = present(c, keys)
    assert len(alive) == s["keys"] <= int(0.9 * SLOTS)
    assert alive == keys[-len(alive):]  # the newest survive
    assert s["evicted_keys"] == 40 - s["keys"]
    assert s["evicted_bytes"] == s["evicted_keys"] * SLOT
    assert s["allocated_bytes"] == s["keys"] * SLOT


def test_reads_refresh_recency(store) -> None:
    c = store(*EXACT, "--default-kv-lease-ttl", "100")
    old = names("k", SLOTS)
    put_all(c, old)
    c.get("k0")  # read: most recently used (short lease, expired below)
    assert c.is_exist("k1")  # is_exist also counts as a use (and grants no lease)
    time.sleep(0.15)
    assert c.query_key("k0")["lease_ms_left"] == 0
    put_all(c, names("n", 4))
    # The untouched k2..k5 go, although they are newer than k0 and k1.
    assert present(c, old) == ["k0", "k1"] + old[6:]


def test_leased_objects_survive_and_full_of_leases_refuses(store) -> None:
    c = store(*EXACT)  # default lease 10 s outlives the test
    old = names("k", SLOTS)
    put_all(c, old)
    for k in old[:4]:
        c.get(k)
    put_all(c, names("n", 8))
    assert present(c, old) == old[:4] + old[12:]  # leased k0..k3 skipped

    everything = old[:4] + old[12:] + names("n", 8)
    assert c.get_batch(everything) == [VALUE] * SLOTS  # now every object is leased
    with pytest.raises(NoAvailableHandle) as ei:
        c.put("x", VALUE)
    assert ei.value.code == -200
    assert present(c, everything) == everything
    assert c.stats()["evicted_keys"] == 8


def test_soft_pinned_survive_while_ordinary_objects_remain(store) -> None:
    c = store(*EXACT)
    soft, ordinary = names("s", 4), names("o", 12)
    put_all(c, soft, SOFT)
    put_all(c, ordinary)
    assert c.query_key("s0")["soft_pinned"] is True
    put_all(c, names("n", 6))  # evicts ordinary objects, oldest first
    put_all(c, names("p", 6), SOFT)
    assert present(c, soft) == soft
    assert present(c, ordinary) == []
    s = c.stats()
    assert s["soft_pinned_keys"] == 10
    assert s["evicted_keys"] == 12 and s["evicted_soft_pinned_keys"] == 0


def test_soft_pinned_evicted_after_ordinary_least_recently_used_first(store) -> None:
    """Mooncake's probe: soft-pinned keys, then ordinary keys (with eviction), then a
    flood of soft-pinned keys: the ordinary keys go first, then the soft-pinned keys,
    oldest first (the first batch goes before the flood's keys)."""
    c = store(*EXACT)
    soft, ordinary, flood = names("s", 4), names("o", 20), names("p", 16)
    put_all(c, soft, SOFT)
    put_all(c, ordinary)  # 8 ordinary keys are evicted on the way
    assert present(c, soft) == soft
    assert present(c, ordinary) == ordinary[8:]

    put_all(c, flood[:12], SOFT)  # the remaining 12 ordinary keys go
    assert present(c, ordinary) == []
    assert present(c, soft + flood) == soft + flood[:12]
    assert c.stats()["evicted_soft_pinned_keys"] == 0

    # Only soft-pinned objects remain: the least recently used go first.
    put_all(c, flood[12:14], SOFT)
    assert present(c, soft + flood[:14]) == soft[2:] + flood[:14]
    assert c.is_exist("s2")  # a use: s3 is now the least recently used
    put_all(c, flood[14:15], SOFT)
    assert present(c, soft + flood[:15]) == ["s2"] + flood[:15]
    s = c.stats()
    assert s["evicted_soft_pinned_keys"] == 3 and s["evicted_keys"] == 23


def test_soft_pinned_never_evicted_when_disallowed(store) -> None:
    c = store(*EXACT, "--no-allow-evict-soft-pinned-objects")
    soft, ordinary, flood = names("s", 4), names("o", 12), names("p", 12)
    put_all(c, soft, SOFT)
    put_all(c, ordinary)
    put_all(c, flood, SOFT)  # the ordinary objects go
    assert present(c, ordinary) == []
    with pytest.raises(NoAvailableHandle):
        c.put("p-extra", VALUE, SOFT)
    with pytest.raises(NoAvailableHandle):
        c.put("o-extra", VALUE)
    assert present(c, soft + flood) == soft + flood
    s = c.stats()
    assert s["evicted_soft_pinned_keys"] == 0 and s["soft_pinned_keys"] == SLOTS


def test_hard_pinned_never_evicted(store) -> None:
    c = store(*EXACT)  # soft-pinned eviction allowed: irrelevant to hard pins
    hard, ordinary, flood = names("h", 4), names("o", 12), names("q", 12)
    put_all(c, hard, HARD)
    put_all(c, ordinary)
    assert c.query_key("h0")["hard_pinned"] is True
    put_all(c, flood, HARD)
    assert present(c, ordinary) == []
    for cfg in (HARD, SOFT, None):
        with pytest.raises(NoAvailableHandle) as ei:
            c.put("extra", VALUE, cfg)
        assert ei.value.code == Status.NO_AVAILABLE_HANDLE
    assert c.put_batch(["b1", "b2"], [VALUE, VALUE]) == [Status.NO_AVAILABLE_HANDLE] * 2
    assert present(c, hard + flood) == hard + flood
    s = c.stats()
    assert s["hard_pinned_keys"] == SLOTS and s["evicted_keys"] == 12
    # Removing a hard-pinned object makes room again.
    c.remove("h0")
    c.put("extra", VALUE)
    assert c.get("extra") == VALUE


def test_soft_pin_ttl_expiry_makes_objects_ordinary(store) -> None:
    c = store(*EXACT, "--default-kv-soft-pin-ttl", "300")
    long_pin = ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=60_000)
    short, long_, ordinary = names("s", 2), names("l", 2), names("o", 12)
    put_all(c, short, SOFT)  # default TTL: 300 ms
    put_all(c, long_, long_pin)  # the request's TTL overrides the default
    put_all(c, ordinary)
    assert c.query_key("s0")["soft_pinned"] is True
    time.sleep(0.35)
    assert c.query_key("s0")["soft_pinned"] is False
    assert c.query_key("l0")["soft_pinned"] is True
    put_all(c, names("n", 3))
    # The expired pins are plain old objects now, evicted first; l0/l1 stay pinned.
    assert present(c, short + long_ + ordinary) == long_ + ordinary[1:]
    assert c.stats()["evicted_soft_pinned_keys"] == 0


def test_soft_pin_ttl_above_max_is_rejected(store) -> None:
    c = store(*ONE_SHARD, "--max-kv-soft-pin-ttl", "1000")
    too_long = ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=1001)
    with pytest.raises(InvalidParams):
        c.put("k", b"v", too_long)
    assert not c.is_exist("k")
    assert c.put_batch(["a", "b"], [b"1", b"2"], too_long) == [Status.INVALID_PARAMS] * 2
    assert c.batch_is_exist(["a", "b"]) == [0, 0]
    # A TTL is meaningful only with ENABLE.
    with pytest.raises(InvalidParams):
        c.put("k", b"v", ReplicateConfig(soft_pin_ttl_ms=500))
    at_max = ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE, soft_pin_ttl_ms=1000)
    c.put("k", b"v", at_max)
    assert c.query_key("k")["soft_pinned"] is True
    s = c.stats()
    assert s["keys"] == 1 and s["pending_writes"] == 0 and s["allocated_bytes"] == 64


def test_put_larger_than_any_segment_evicts_nothing(store) -> None:
    """A put that cannot fit even in an empty segment is refused with -200 and must
    not throw out the objects that are there."""
    c = store(*EXACT)
    keys = names("k", 10)
    put_all(c, keys)
    with pytest.raises(NoAvailableHandle):
        c.put("too-big", b"x" * (2 * MiB))
    assert present(c, keys) == keys
    assert c.stats()["evicted_keys"] == 0
