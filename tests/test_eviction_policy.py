"""``--eviction-policy``: plain LRU (Mooncake's) and prefix-aware LRU (kvmaster/_eviction.py).

A prefix hit stops at a request's first missing block, so under pressure a chain must
lose its tail before its head.  The master-facing tests use one shard and a 1 MiB
segment of sixteen 64 KiB slots with ``--eviction-high-watermark-ratio 1.0``: each
allocation that does not fit evicts exactly one object, so the victims are exact.
They run in both master modes (``pytest --shard-processes``).  Presence is checked
with ``query_key``, which is no use of the object.
"""

from __future__ import annotations

import argparse
import time

import msgpack
import pytest
from conftest import present

from kvmaster import Client, ReplicateConfig, SoftPinAction
from kvmaster import protocol as P
from kvmaster._eviction import EVICTION_POLICIES, EvictionOrder, make_order
from kvmaster._shard import HARD_PIN, ClientView, ShardActor
from kvmaster.config import ConfigError, MasterConfig, add_cli_args, from_cli_args
from kvmaster.protocol import Op

KiB = 1 << 10
MiB = 1 << 20
SLOT = 64 * KiB
SLOTS = 16
VALUE = b"v" * SLOT
EXACT = ("--shards", "1", "--eviction-high-watermark-ratio", "1.0")
POLICIES = ("lru", "prefix-lru", "depth-lru")


def names(prefix: str, n: int, start: int = 0) -> list[str]:
    return [f"{prefix}{i}" for i in range(start, start + n)]



def request(c: Client, chain: list[str], config: ReplicateConfig | None = None) -> int:
    """What an engine does for one request: look the chain up, read the prefix hit,
    write the misses.  Returns the prefix hit (blocks)."""
    found = c.batch_is_exist(chain)
    hit = 0
    while hit < len(chain) and found[hit]:
        hit += 1
    hits = [k for k, f in zip(chain, found) if f]
    if hits:
        assert c.get_batch(hits) == [VALUE] * len(hits)
    misses = [k for k, f in zip(chain, found) if not f]
    if misses:
        c.put_batch(misses, [VALUE] * len(misses), config)
    return hit


@pytest.fixture
def store(start_master, make_client):
    def make(policy: str, *flags: str) -> Client:
        m = start_master(*EXACT, "--eviction-policy", policy, *flags)
        return make_client(m, segment_bytes=MiB)

    return make


# ------------------------------------------------------------------ the order alone


def test_orders_take_the_tail_of_a_chain_first_only_with_prefix_lru() -> None:
    objects = {k: object() for k in (b"a", b"b", b"c", b"d", b"e", b"x")}
    lru, pre = make_order("lru", objects), make_order("prefix-lru", objects)
    for order in (lru, pre):
        order.stored([b"x"], "w2")
        order.touch([b"a", b"b", b"c"], "w1")  # a lookup's hits, block 0 first
        order.stored([b"d", b"e"], "w1")  # the misses it wrote: blocks 3 and 4
    assert [lru.pop()[1] for _ in range(6)] == [b"x", b"a", b"b", b"c", b"d", b"e"]
    # Behind the lookup's deepest hit, deeper older; the head goes last.
    assert [pre.pop()[1] for _ in range(6)] == [b"x", b"e", b"d", b"c", b"b", b"a"]
    assert lru.pop() is None and pre.pop() is None
    assert lru.examined == pre.examined == 6


def test_depth_lru_takes_deep_blocks_first_and_the_head_of_the_latest_lookup_last() -> None:
    objects = {k: object() for k in (b"a", b"b", b"c", b"d", b"e", b"x")}
    order = make_order("depth-lru", objects)
    order.stored([b"x"], "w2")  # depth 0, used first
    order.touch([b"a", b"b", b"c"], "w1")  # depths 0, 1, 2
    order.stored([b"d", b"e"], "w1")  # depths 3, 4 (after w1's three hits)
    # Each block of depth counts 4 uses of age: e (4), c (2), d (3), b (1), x, a.
    assert [order.pop()[1] for _ in range(6)] == [b"e", b"c", b"d", b"b", b"x", b"a"]
    assert order.pop() is None and order.examined == 6


def test_a_write_after_a_lookup_without_hits_goes_to_the_recent_end_back_to_front() -> None:
    objects = {k: object() for k in (b"old", b"a", b"b", b"n0", b"n1")}
    pre = make_order("prefix-lru", objects)
    pre.touch([b"a", b"b"], "w")
    pre.stored([b"old"], "other")  # another writer without a lookup: the recent end
    pre.touch([], "w")  # w's next lookup found nothing here
    pre.stored([b"n0", b"n1"], "w")
    assert [pre.pop()[1] for _ in range(5)] == [b"b", b"a", b"old", b"n1", b"n0"]


def test_an_anchor_whose_hits_were_evicted_is_not_used() -> None:
    objects = {k: object() for k in (b"a", b"z", b"w0")}
    pre = make_order("prefix-lru", objects)
    pre.touch([b"a"], "w")
    pre.stored([b"z"], "v")
    assert pre.pop()[1] == b"a"  # the anchor's hit is gone
    pre.stored([b"w0"], "w")  # so the write is recent, not older than everything
    assert [pre.pop()[1] for _ in range(2)] == [b"z", b"w0"]


def test_held_objects_come_back_at_their_place() -> None:
    objects = {k: object() for k in (b"k0", b"k1", b"k2", b"k3")}
    order = EvictionOrder(objects)
    order.touch([b"k0", b"k1", b"k2", b"k3"])
    s0, k0, _ = order.pop()
    order.hold(k0, s0, until=5.0)  # leased until t=5
    s1, k1, _ = order.pop()
    order.hold_soft(k1, s1, 0.0, [b"sess"], evictable=False)  # a pinned session's member
    order.expire(4.0)
    assert order.pop()[1] == b"k2"
    order.expire(5.0)  # the lease ended: k0 is the oldest again
    order.unpinned(b"sess")  # and k1 next
    assert [order.pop()[1] for _ in range(3)] == [b"k0", b"k1", b"k3"]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_order("fifo", {})
    assert set(POLICIES) == set(EVICTION_POLICIES)
    parser = argparse.ArgumentParser()
    add_cli_args(MasterConfig, parser)
    assert from_cli_args(MasterConfig, parser.parse_args([])).eviction_policy == "depth-lru"
    got = from_cli_args(MasterConfig, parser.parse_args(["--eviction-policy", "prefix-lru"]))
    assert got.eviction_policy == "prefix-lru"
    with pytest.raises(ConfigError, match="eviction-policy"):
        from_cli_args(MasterConfig, parser.parse_args(["--eviction-policy", "fifo"]))


# ------------------------------------------------------------- one shard actor


class _Actor:
    """One shard actor called directly: a deterministic clock for leases and pins."""

    def __init__(self, **cfg) -> None:
        self.replies: dict[int, tuple[int, object]] = {}
        self.config = MasterConfig(shards=1, eviction_high_watermark_ratio=1.0, **cfg)
        self.shard = ShardActor(0, 1, self.config, self._reply)
        self.shard.mount_segment("seg", "c1", SLOTS * SLOT)
        self.client = ClientView("c1", "default", b"id-1")
        self.req = 0

    def _reply(self, identity, op, payload, group) -> None:
        req_id, status, body = P.decode_reply(payload)
        self.replies[req_id] = (status, body)

    def call(self, op: Op, *fields) -> tuple[int, object]:
        self.req += 1
        payload = msgpack.packb([self.req, *fields], use_bin_type=True)
        assert self.shard.deliver((op.value, payload, self.client))
        self.shard.drain()
        return self.replies.pop(self.req)

    def put(self, key: bytes, cfg: list | None = None) -> int:
        st, _ = self.call(Op.PUT_START, key, SLOT, cfg)
        return st or self.call(Op.PUT_END, key)[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_examines_each_pinned_or_leased_object_once_not_every_round(
        policy: str) -> None:
    a = _Actor(eviction_policy=policy, default_kv_lease_ttl=60_000)
    shard = a.shard
    held = [f"h{i}".encode() for i in range(12)]
    for k in held:
        assert a.put(k) == 0
    for k in held[:4]:
        shard.objects[k].softpin = 1e18  # soft-pinned (TTL) for the whole test
    for k in held[4:8]:
        assert a.call(Op.GET_REPLICA_LIST, k)[0] == 0  # leased for a minute
    for k in held[8:]:
        shard.objects[k].flags |= HARD_PIN
    rounds = 200
    for i in range(rounds):  # 4 free slots: every put from the 5th evicts one object
        assert a.put(f"n{i}".encode()) == 0
    c = shard.counters
    assert c["evicted_keys"] == c["eviction_rounds"] == rounds - 4
    assert c["evicted_soft_pinned_keys"] == 0
    assert all(k in shard.objects for k in held)
    # A held object is examined once, when it first comes up (prefix-lru may never
    # reach the last leased one: the writes land behind it); then only victims.
    assert c["evicted_keys"] <= c["eviction_examined_keys"] <= c["evicted_keys"] + len(held)
    assert not shard.check_consistency()


@pytest.mark.parametrize("policy", POLICIES)
def test_actor_soft_pinned_go_last_and_an_ended_lease_comes_back_at_its_place(
        policy: str) -> None:
    a = _Actor(eviction_policy=policy)
    shard = a.shard
    keys = [f"k{i}".encode() for i in range(SLOTS)]
    for k in keys:
        assert a.put(k) == 0
    for k in keys[:-1]:
        shard.objects[k].softpin = 1e18
    leased = keys[-1]
    shard.objects[leased].lease = 1e18  # (set here: a read would also be a use)
    assert a.put(b"n0") == 0  # nothing ordinary: the least recent soft-pinned goes
    assert keys[0] not in shard.objects and shard.counters["evicted_soft_pinned_keys"] == 1
    assert a.put(b"n1") == 0  # n0 is ordinary: it goes, no other soft-pinned one
    assert b"n0" not in shard.objects and keys[1] in shard.objects
    # The lease ends: the object is back at its place, older than n1.
    shard.objects[leased].lease = 0.0
    shard.tenancy.order(b"").expire(float("inf"))
    assert a.put(b"n2") == 0
    assert leased not in shard.objects and b"n1" in shard.objects
    assert shard.counters["evicted_keys"] == 3
    assert not shard.check_consistency()


# -------------------------------------------------------------- a real master


@pytest.mark.parametrize("policy", POLICIES)
def test_under_pressure_a_chain_keeps_its_head_only_with_prefix_lru(store, policy) -> None:
    c = store(policy, "--default-kv-lease-ttl", "20")  # (reads lease their keys)
    chain = names("c", SLOTS)
    assert request(c, chain[:12]) == 0  # first turn: 12 blocks written
    assert request(c, chain) == 12  # next turn: 12 hit, 4 more written; the cache is full
    time.sleep(0.05)
    assert request(c, names("o", 4)) == 0  # another conversation needs 4 slots
    alive = present(c, chain)
    if policy == "lru":
        assert alive == chain[4:]  # Mooncake's LRU: the head went first, prefix hit 0
        assert request(c, chain) == 0
    elif policy == "prefix-lru":
        assert alive == chain[:12]  # the tail went; the whole first turn still hits
        assert request(c, chain) == 12
    else:  # depth-lru: the four deepest by depth and age (c15, c11, c14, c10)
        assert alive == chain[:10] + chain[12:14]
        assert request(c, chain) == 10
    assert c.stats()["evicted_keys"] >= 4


@pytest.mark.parametrize("policy", POLICIES)
def test_pins_and_leases_decide_before_the_order(store, policy) -> None:
    c = store(policy, "--default-kv-lease-ttl", "60000")
    chain = names("c", 10)
    request(c, chain)
    hard = names("h", 2)
    c.put_batch(hard, [VALUE] * 2, ReplicateConfig(with_hard_pin=True))
    soft = names("s", 2)
    c.put_batch(soft, [VALUE] * 2, ReplicateConfig(soft_pin_action=SoftPinAction.ENABLE))
    leased = names("l", 2)
    c.put_batch(leased, [VALUE] * 2)
    assert c.get_batch(leased) == [VALUE] * 2  # a minute's lease
    # 16 slots full.  The chain's blocks are the only ordinary objects.
    request(c, names("o", 10))
    kept = hard + soft + leased
    assert present(c, kept) == kept
    s = c.stats()
    assert s["evicted_soft_pinned_keys"] == 0
    assert len(present(c, chain)) == 0  # all ten ordinary blocks went (10 slots needed)
    # Ordinary objects left are the o* ones; two more slots take o* first, never a pin.
    c.put_batch(names("p", 2), [VALUE] * 2)
    assert present(c, kept) == kept
    assert c.stats()["eviction_examined_keys"] <= c.stats()["evicted_keys"] + len(kept)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pinned_session_holds_its_chain_and_unpinning_returns_it(store, policy) -> None:
    c = store(policy, "--default-kv-lease-ttl", "20")
    chain = names("c", 8)
    tag = ReplicateConfig(kv_sessions=[["chat"]] * 8)
    c.put_batch(chain, [VALUE] * 8, tag)
    c.pin_kv_session("chat")
    c.put_batch(names("o", 8), [VALUE] * 8)  # full
    request(c, names("p", 8))  # 8 slots: all from the unpinned o*
    time.sleep(0.05)  # (the p* reads' leases end)
    assert present(c, chain) == chain
    assert present(c, names("o", 8)) == []
    c.unpin_kv_session("chat")
    time.sleep(0.05)  # (the unpin reaches every shard)
    request(c, names("q", 4))  # the chain is back at its place, older than p*
    alive = present(c, chain)
    assert len(alive) == 4
    assert alive == (chain[4:] if policy == "lru" else chain[:4])


# ------------------------------------------------------- the reference simulation


def test_simulated_orders_lru_matches_the_exact_lru_and_prefix_lru_keeps_heads() -> None:
    from kvmaster.tools.loadgen.reference import (
        ORDER_POLICIES,
        lru_prefix_hit_rate,
        order_prefix_hit_rate,
    )
    from kvmaster.tools.loadgen.synthetic import synthetic_trace
    from kvmaster.tools.loadgen.traces import Request

    trace = synthetic_trace(300, 7)
    distinct = len({h for r in trace for h in r.hash_ids})
    for cap in (distinct // 20, distinct // 5):
        exact = lru_prefix_hit_rate(trace, cap)
        sim = order_prefix_hit_rate(trace, cap, "lru")
        assert (sim.prefix_hits, sim.block_hits, sim.evictions) == (
            exact.prefix_hits, exact.block_hits, exact.evictions)
        for name in ORDER_POLICIES:  # none is above the bound of an unbounded cache
            assert 0 <= order_prefix_hit_rate(trace, cap, name).hit_rate <= 1
    # The master-facing scenario above: two turns of a chain, another request, the chain.
    a = list(range(16))

    def req(ids: list[int]) -> Request:
        return Request(0.0, 512 * len(ids), 1, ids)

    turns = [req(a[:12]), req(a), req([100, 101, 102, 103]), req(a)]
    assert order_prefix_hit_rate(turns, 16, "lru").prefix_hits == 12 + 0
    assert order_prefix_hit_rate(turns, 16, "prefix-lru").prefix_hits == 12 + 12
    assert order_prefix_hit_rate(turns, 16, "depth-lru-4").prefix_hits == 12 + 10  # (master's)
