"""Session tags (protocol 1.5; Mooncake 0.3.14's ``ReplicateConfig.session_ids``): one
tag per object, kept with it and shown by QUERY_KEY and ``kvmaster ctl key``, no
membership and no pin; with ``--session-tags-as-kv-sessions`` a membership instead.
Real masters on loopback."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import uuid

import pytest

from kvmaster import Client, ReplicateConfig
from kvmaster import errors as E
from kvmaster.compat import MooncakeDistributedStore
from kvmaster.compat import ReplicateConfig as MooncakeConfig
from tests.conftest import REPO, MasterProcess


@pytest.fixture
def client(start_master):
    m = start_master()
    c = Client()
    c.setup(m.addr, 8 << 20)
    yield m, c
    c.close()


def _k(n: int) -> list[str]:
    return [f"tag-{uuid.uuid4().hex[:10]}" for _ in range(n)]


def test_a_tag_is_kept_with_its_object_and_changes_nothing_else(client) -> None:
    m, c = client
    keys = _k(4)
    cfg = ReplicateConfig(session_tags=["conv-7", "", "conv-8", "conv-7"])
    assert c.put_batch(keys, [b"v" * 100] * 4, cfg) == [0] * 4
    got = [c.query_key(k).get("session_tag") for k in keys]
    assert got == ["conv-7", None, "conv-8", "conv-7"]
    info = c.query_key(keys[0])
    assert info["sessions"] == [] and not info["soft_pinned"]
    with pytest.raises(E.SessionNotFound):  # a tag is no membership
        c.get_kv_session("conv-7")
    assert c.stats()["session_tagged_writes"] == 3
    # The object stored first keeps its tag; an upsert's write brings its own.
    assert c.put_batch(keys[:1], [b"w" * 100], ReplicateConfig(session_tags=["other"])) == [0]
    assert c.query_key(keys[0])["session_tag"] == "conv-7"
    assert c.upsert_batch(keys[:1], [b"u" * 100], ReplicateConfig(session_tags=["new"])) == [0]
    assert c.query_key(keys[0])["session_tag"] == "new"
    # Single-key writes, writes from pointers, grouped writes and repeated keys carry it.
    c.put(keys[1] + "-one", b"x", ReplicateConfig(session_tags=["s1"]))
    buf = ctypes.create_string_buffer(b"abc", 3)
    assert c.batch_put_from_ptrs([keys[1] + "-p"], [[ctypes.addressof(buf)]], [[3]],
                                 ReplicateConfig(session_tags=["s2"])) == [0]
    assert c.put_batch([keys[1] + "-g"] * 2, [b"1", b"2"],
                       ReplicateConfig(session_tags=["s3", "s4"], group_ids=["G", "G"])) == [0, 0]
    assert [c.query_key(keys[1] + s)["session_tag"] for s in ("-one", "-p", "-g")] == \
        ["s1", "s2", "s3"]
    out = subprocess.run([sys.executable, "-m", "kvmaster", "ctl", "--master", m.addr, "key",
                          keys[2]], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0 and "session tag" in out.stdout and "conv-8" in out.stdout, out


def test_bad_tags_are_refused_before_anything_is_written(client) -> None:
    _, c = client
    keys = _k(2)
    with pytest.raises(E.InvalidParams, match="session tags"):
        c.put_batch(keys, [b"a", b"b"], ReplicateConfig(session_tags=["only-one"]))
    with pytest.raises(E.InvalidParams, match="at most"):
        c.put_batch(keys[:1], [b"a"], ReplicateConfig(session_tags=["x" * 5000]))
    assert c.batch_is_exist(keys) == [0, 0]


def test_the_master_flag_makes_tags_memberships(start_master) -> None:
    m = start_master("--session-tags-as-kv-sessions")
    c = Client()
    c.setup(m.addr, 8 << 20)
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 8 << 20, 8 << 20, "tcp", "", m.addr) == 0
    try:
        keys = _k(3)
        assert c.put_batch(keys, [b"v"] * 3, ReplicateConfig(session_tags=["s-a", "", "s-a"])) \
            == [0] * 3
        assert c.get_kv_session("s-a").member_count == 2
        assert "session_tag" not in c.query_key(keys[0])
        # Mooncake's own name, through the facade (SGLang's Mooncake backend sets it).
        cfg = MooncakeConfig()
        cfg.session_ids = ["s-b", "s-b"]
        buf = ctypes.create_string_buffer(b"x" * 64, 64)
        assert store.batch_put_from(_k(2), [ctypes.addressof(buf)] * 2, [64, 64], cfg) == [0, 0]
        assert c.get_kv_session("s-b").member_count == 2
    finally:
        store.close()
        c.close()


def test_the_facade_keeps_mooncakes_meaning_by_default(client) -> None:
    m, c = client
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 8 << 20, 8 << 20, "tcp", "", m.addr) == 0
    try:
        cfg = MooncakeConfig()
        keys = _k(2)
        cfg.session_ids = ["sglang-session", ""]
        assert store.put_batch(keys, [b"a" * 8, b"b" * 8], cfg) == 0
        assert [c.query_key(k).get("session_tag") for k in keys] == ["sglang-session", None]
    finally:
        store.close()


def test_a_raw_request_with_tags_of_another_length_is_refused() -> None:
    """The wire check, on a raw DEALER peer: INVALID_PARAMS, and the master serves on."""
    from kvmaster import protocol as P
    from tests.test_bad_input import Raw

    m = MasterProcess("--shards", "1")
    try:
        r = Raw(m.endpoint)
        assert r.hello()[0] == 0
        _, status, _ = r.ask(P.Op.BATCH_PUT_START.value, P.route_for_shard(0),
                             [[b"k1", b"k2"], [1, 1], None, 1, True, None, [b"t"]])
        assert status == P.Status.INVALID_PARAMS
        r.close()
        c = Client()
        c.setup(m.addr, 8 << 20)
        assert c.put_batch(["k1"], [b"v"], ReplicateConfig(session_tags=["t"])) == [0]
        c.close()
    finally:
        assert m.stop() == 0


def test_a_refused_start_does_not_retag_the_write_in_progress() -> None:
    """A raw batch repeating a key: its later position is refused (as the spec says)
    and leaves the first position's tag; the counter counts writes started."""
    from kvmaster import protocol as P
    from tests.test_bad_input import Raw

    m = MasterProcess("--shards", "1", "--master-segment-size", str(1 << 20))
    try:
        r = Raw(m.endpoint)
        assert r.hello()[0] == 0
        route = P.route_for_shard(0)
        _, st, _ = r.ask(P.Op.BATCH_PUT_START.value, route,
                         [[b"k", b"k"], [1, 1], None, 7, True, None, [b"first", b"second"]])
        assert st == 0
        _, st, _ = r.ask(P.Op.BATCH_PUT_START.value, route,
                         [[b"k"], [1], None, None, True, None, [b"third"]])
        assert st == 0  # (per key: OBJECT_ALREADY_EXISTS, a write is in progress)
        _, st, _ = r.ask(P.Op.BATCH_PUT_END.value, route, [[b"k"], 7])
        assert st == 0
        r.close()
        c = Client()
        c.setup(m.addr, 0)
        try:
            assert c.query_key("k")["session_tag"] == "first"
            assert c.stats()["session_tagged_writes"] == 1
        finally:
            c.close()
    finally:
        assert m.stop() == 0


def test_repeated_keys_with_empty_tags_and_the_flag_without_sessions(start_master) -> None:
    m = start_master("--session-tags-as-kv-sessions", "--no-enable-kv-sessions")
    c = Client()
    c.setup(m.addr, 8 << 20)
    try:
        k = _k(2)
        assert c.put_batch([k[0], k[0], k[1]], [b"a", b"b", b"c"],
                           ReplicateConfig(session_tags=["", "", ""])) == [0, 0, 0]
        # Sessions are off: the master does not ask for memberships, the tags stay tags.
        assert c.put_batch(k[1:] + ["t-" + k[0]], [b"c", b"d"],
                           ReplicateConfig(session_tags=["s", "s"])) == [0, 0]
        assert c.query_key("t-" + k[0])["session_tag"] == "s"
    finally:
        c.close()
