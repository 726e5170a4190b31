"""Key groups (Mooncake ``ReplicateConfig.group_ids``, kvmaster/_groups.py) against a
real master with four shards (or one, for the per-shard bound), in-process or with
``--shard-processes``.

Each shard holds a quarter of a 4 MiB segment: sixteen 64 KiB slots.  With
``--eviction-high-watermark-ratio 1.0`` a shard evicts only when a write does not fit,
one least-recently-used object per missing slot, so filling one shard evicts exactly
its oldest object; the rest of that object's group, on the other shards, must follow
(by messages between shards: polled for).  Presence is checked with ``query_key``,
which neither touches recency nor grants a lease.
"""

from __future__ import annotations

import time

import pytest
from conftest import present

from kvmaster import Client, ReplicateConfig, Status
from tests.conftest import keys_on_shard

KiB = 1 << 10
MiB = 1 << 20
SLOT = 64 * KiB
SLOTS = 16  # per shard
VALUE = b"g" * SLOT
SHARDS = 4
EXACT = ("--shards", str(SHARDS), "--eviction-high-watermark-ratio", "1.0")
LIMIT = -1906  # GROUP_LIMIT_EXCEEDED



def wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def one_per_shard(prefix: str) -> list[str]:
    """A key of each shard, shard 0's first."""
    return [keys_on_shard(s, SHARDS, 1, prefix)[0] for s in range(SHARDS)]


def put_group(c: Client, keys: list[str], group: str, value: bytes = VALUE) -> list[int]:
    return c.put_batch(keys, [value] * len(keys), ReplicateConfig(group_ids=[group] * len(keys)))


def fill_shard0(c: Client, n: int, prefix: str = "fill") -> None:
    for k in keys_on_shard(0, SHARDS, n, prefix):
        c.put(k, VALUE)


@pytest.fixture
def store(start_master, make_client):
    m = start_master(*EXACT)
    return make_client(m, segment_bytes=SHARDS * SLOTS * SLOT)


def test_group_members_on_other_shards_are_evicted_with_the_evicted_one(store: Client) -> None:
    members = one_per_shard("page-a/")
    assert put_group(store, members, "page-a") == [0] * SHARDS
    controls = [keys_on_shard(s, SHARDS, 1, "ctl/")[0] for s in range(1, SHARDS)]
    for k in controls:
        store.put(k, VALUE)
    # Shard 0 holds its member and fifteen more: the sixteenth evicts the member (oldest).
    fill_shard0(store, SLOTS)
    assert present(store, members[:1]) == []
    assert wait_for(lambda: present(store, members) == []), present(store, members)
    assert present(store, controls) == controls  # ungrouped keys of those shards stay
    st = store.stats()
    assert st["group_evicted_keys"] == SHARDS - 1
    assert wait_for(lambda: store.stats()["groups_deleted"] == 1)
    assert store.check_consistency() == []


def test_a_lease_on_one_member_leases_the_others(store: Client) -> None:
    members = one_per_shard("page-b/")
    assert put_group(store, members, "page-b") == [0] * SHARDS
    assert all(store.query_key(k)["lease_ms_left"] == 0 for k in members)
    assert store.get(members[2]) == VALUE  # a read lease on shard 2's member
    assert wait_for(lambda: all(store.query_key(k)["lease_ms_left"] > 0 for k in members))
    # Shard 0's member is leased now: filling shard 0 evicts fillers, not it.
    fill_shard0(store, SLOTS + 4)
    assert present(store, members) == members
    assert store.stats()["group_evicted_keys"] == 0


def test_a_batch_read_of_a_group_sends_one_lease_per_group(store: Client) -> None:
    keys = [k for s in range(SHARDS) for k in keys_on_shard(s, SHARDS, 4, "page-c/")]
    assert put_group(store, keys, "page-c", b"x" * 1024) == [0] * len(keys)
    before = store.stats()["group_lease_messages"]
    for _ in range(3):
        assert store.get_batch(keys) == [b"x" * 1024] * len(keys)
    # One message per member shard at most, however many members and reads.
    assert store.stats()["group_lease_messages"] - before <= SHARDS


def test_a_member_evicted_while_its_group_is_leased_takes_no_other(store: Client) -> None:
    others = one_per_shard("page-d/")[1:]
    assert put_group(store, others, "page-d") == [0] * len(others)
    assert store.get(others[0]) == VALUE  # the group's lease
    assert wait_for(lambda: all(store.query_key(k)["lease_ms_left"] > 0 for k in others))
    # A member joining after the lease is not leased itself: pressure takes it, and the
    # home, seeing the group leased, leaves the others alone.
    late = keys_on_shard(0, SHARDS, 1, "page-d-late/")
    assert put_group(store, late, "page-d") == [0]
    fill_shard0(store, SLOTS)
    assert present(store, late) == []
    assert wait_for(lambda: store.stats()["group_evictions_skipped_leased"] >= 1)
    assert present(store, others) == others


def test_hard_pinned_member_stays_when_its_group_is_evicted(store: Client) -> None:
    a, b = one_per_shard("page-e/")[:2]
    assert put_group(store, [a], "page-e") == [0]
    pinned = ReplicateConfig(with_hard_pin=True, group_ids=["page-e"])
    assert store.put_batch([b], [VALUE], pinned) == [0]
    fill_shard0(store, SLOTS)
    assert present(store, [a]) == []
    assert wait_for(lambda: store.stats()["group_members_removed"] >= 1)
    time.sleep(0.1)
    assert present(store, [b]) == [b]


def test_remove_and_overwrite_leave_the_group(store: Client) -> None:
    a, b, c = one_per_shard("page-f/")[:3]
    assert put_group(store, [a, b, c], "page-f") == [0, 0, 0]
    store.remove(a)
    store.upsert(c, VALUE)  # an upsert without the group leaves it
    assert wait_for(lambda: store.stats()["group_members_removed"] == 2)
    store.put(a, VALUE)  # a again, in no group
    # b alone is the group now; evicting ... b is not on shard 0, so evict via its own
    # shard: fill shard 1.
    for k in keys_on_shard(1, SHARDS, SLOTS, "fill1/"):
        store.put(k, VALUE)
    assert present(store, [b]) == []
    time.sleep(0.2)
    assert present(store, [a, c]) == [a, c]
    assert store.stats()["group_evicted_keys"] == 0
    assert wait_for(lambda: store.stats()["groups_deleted"] == 1)
    assert store.check_consistency() == []


def test_members_per_group_bound(start_master, make_client) -> None:
    m = start_master("--shards", str(SHARDS))
    c = make_client(m, segment_bytes=16 * MiB)
    keys = [f"big/{i}" for i in range(257)]
    got = c.put_batch(keys, [b"y" * 256] * len(keys), ReplicateConfig(group_ids=["big"] * 257))
    assert got.count(0) == 256 and got.count(LIMIT) == 1, sorted(set(got))
    refused = keys[got.index(LIMIT)]
    assert present(c, [refused]) == []
    assert int(Status.GROUP_LIMIT_EXCEEDED) == LIMIT
    # A key in no group, or in another group, is not refused.
    assert c.put_batch(["big/x", "big/y"], [b"y", b"y"],
                       ReplicateConfig(group_ids=["", "other"])) == [0, 0]


def test_groups_per_shard_bound(start_master, make_client) -> None:
    m = start_master("--shards", "1", "--max-groups-per-shard", "2")
    c = make_client(m)
    cfg = ReplicateConfig(group_ids=["g1", "g2", "g3", "g1"])
    assert c.put_batch(["k1", "k2", "k3", "k4"], [b"v"] * 4, cfg) == [0, 0, LIMIT, 0]
    assert present(c, ["k1", "k2", "k3", "k4"]) == ["k1", "k2", "k4"]
    c.remove("k2")  # g2 is empty now and dropped: room for g3
    assert wait_for(lambda: c.stats()["groups_deleted"] == 1)
    assert c.put_batch(["k3"], [b"v"], ReplicateConfig(group_ids=["g3"])) == [0]


def test_bad_group_ids_are_refused(store: Client) -> None:
    from kvmaster import InvalidParams

    with pytest.raises(InvalidParams):
        store.put_batch(["a", "b"], [b"v", b"v"], ReplicateConfig(group_ids=["g"]))
    with pytest.raises(InvalidParams):
        store.put_batch(["a"], [b"v"], ReplicateConfig(group_ids=["g\x00"]))
    assert present(store, ["a", "b"]) == []


def test_single_key_writes_join_their_group(store: Client) -> None:
    a, b = one_per_shard("page-g/")[:2]
    store.put(a, VALUE, ReplicateConfig(group_ids=["page-g"]))
    store.upsert(b, VALUE, ReplicateConfig(group_ids=["page-g"]))
    assert store.stats()["group_members_added"] == 2
    fill_shard0(store, SLOTS)
    assert present(store, [a]) == []
    assert wait_for(lambda: present(store, [b]) == [])


def test_compat_config_group_ids_reach_the_master(start_master) -> None:
    """The facade's ReplicateConfig (Mooncake's attributes) carries group_ids through
    put_batch and batch_put_from to the master: the keys form one group."""
    from kvmaster.compat import MooncakeDistributedStore, ReplicateConfig as MooncakeConfig

    m = start_master(*EXACT)
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", SHARDS * SLOTS * SLOT, 16 * MiB, "tcp", "",
                       m.addr) == 0
    try:
        members = one_per_shard("page-h/")
        cfg = MooncakeConfig()
        cfg.group_ids = ["page-h"] * len(members)
        assert store.put_batch(members, [VALUE] * len(members), cfg) == 0
        native = store.client
        assert native.stats()["group_members_added"] == len(members)
        cfg.group_ids = ["page-h"]  # a length that does not match is refused
        assert store.put_batch(["x", "y"], [b"v", b"v"], cfg) == Status.INVALID_PARAMS
        fill_shard0(native, SLOTS)
        assert wait_for(lambda: present(native, members) == []), present(native, members)
    finally:
        store.close()


def test_groups_and_sessions_do_not_mix_up(store: Client) -> None:
    """A group rides with an object's session refs: sessions neither see nor count it."""
    a, b = one_per_shard("page-i/")[:2]
    assert put_group(store, [a, b], "page-i") == [0, 0]
    assert store.attach_kv_session("s", [a]) == [0]
    assert store.query_key(a)["sessions"] == [b"s"]
    assert store.query_key(b)["sessions"] == []
    assert store.get_kv_session("s").member_count == 1
    store.close_kv_session("s")
    assert store.check_consistency() == []
    # The group is intact after the session went: evicting a evicts b.
    fill_shard0(store, SLOTS)
    assert wait_for(lambda: present(store, [a, b]) == [])


def test_the_group_lease_is_granted_again_after_a_lease_period(start_master, make_client
                                                               ) -> None:
    m = start_master(*EXACT, "--default-kv-lease-ttl", "300")
    c = make_client(m, segment_bytes=SHARDS * SLOTS * SLOT)
    members = one_per_shard("page-j/")
    assert put_group(c, members, "page-j", b"z") == [0] * SHARDS
    for _ in range(2):
        assert c.get(members[1]) == b"z"
        assert wait_for(lambda: all(c.query_key(k)["lease_ms_left"] > 0 for k in members))
        assert wait_for(lambda: all(c.query_key(k)["lease_ms_left"] == 0 for k in members))
    assert c.stats()["group_lease_messages"] == 2
