"""remove_by_regex (Mooncake RemoveByRegex): a search over the caller's tenant's keys on
every shard with RE2, leases kept unless forced, bad patterns refused with a code."""

from __future__ import annotations

import pytest

from kvmaster import errors as E
from kvmaster.compat import MooncakeDistributedStore


def test_a_pattern_removes_what_it_finds_in_this_tenant_only(master, make_client) -> None:
    a = make_client(master)
    b = make_client(master, tenant="other")
    keys = [f"req-{i}/blk-{j}" for i in range(4) for j in range(8)]
    a.put_batch(keys, [b"v"] * len(keys))
    b.put_batch(keys, [b"w"] * len(keys))
    a.get("req-1/blk-0")  # leased by this read
    assert a.remove_by_regex(r"req-1/") == 7  # a search: no anchor needed; the lease stays
    assert a.batch_is_exist([f"req-1/blk-{j}" for j in range(8)]) == [1] + [0] * 7
    assert a.remove_by_regex(r"^req-1/", force=True) == 1
    assert a.remove_by_regex(r"blk-[0-3]$") == 12
    assert a.remove_by_regex("nothing") == 0
    assert sum(a.batch_is_exist(keys)) == 12
    assert sum(b.batch_is_exist(keys)) == len(keys)  # the other tenant's keys untouched


def test_bad_patterns_are_refused_and_no_pattern_is_slow(master, make_client) -> None:
    c = make_client(master)
    for bad in (r"(a)\1", r"(?=a)", "(", "", "x" * 5000):
        with pytest.raises(E.InvalidParams):
            c.remove_by_regex(bad)
    c.put("a" * 4000, b"v")
    # Exponential for a backtracking engine on this key, linear for RE2.
    assert c.remove_by_regex(r"(a+)+$b") == 0
    assert c.remove_by_regex(r"(a|aa)+$") == 1


def test_the_facade_answers_counts_and_codes(master) -> None:
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 8 << 20, 16 << 20, "tcp", "", master.addr) == 0
    try:
        assert s.put_batch(["x1", "x2", "y1"], [b"1", b"2", b"3"]) == 0
        assert s.remove_by_regex("^x") == 2
        assert s.remove_by_regex(r"(x)\1") == -600
        assert s.get("y1") == b"3"
    finally:
        s.close()
