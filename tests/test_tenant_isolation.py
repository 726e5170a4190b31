"""Tenant isolation, op by op, for two tenants on one master.

Every test runs twice: with tenants named in HELLO (``plain``), and with CURVE
keys made by ``kvmaster keygen`` bound to the tenants (``curve``), where each
client claims the *other* tenant in HELLO, so isolation must come from the key.

Covered: keys (put/get/is_exist/get_size/query_key, batch forms, remove,
batch_remove, remove_all, upsert), writes in progress of another tenant
(raw PUT_START/PUT_END/PUT_REVOKE), sessions (attach of another tenant's key,
the same session id in two tenants: get/list/pin/update/close/tagged writes
independent), and the operator views: LIST_CLIENTS is per tenant (but see the
admin tenant), STATS and LIST_SEGMENTS are global (documented, not filtered:
see RELIABILITY.md "Security").
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conftest import MasterProcess

from kvmaster import Client, ClientConfig, ObjectNotFound, ReplicateConfig, SessionNotFound, auth
from kvmaster import protocol as P
from kvmaster.protocol import Op, Status

SHARDS = 3
TENANT_A, TENANT_B = "tenant-a", "tenant-b"


class RawPeer:
    """A raw DEALER of one tenant (HELLO claims it, or a CURVE key binds it)."""

    def __init__(self, endpoint: str, tenant: str, keydir: Path | None, key: str | None,
                 client_id: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keydir is not None:
            pub, sec, server = auth.client_keys(keydir, key)
            self.sock.curve_publickey, self.sock.curve_secretkey = pub, sec
            self.sock.curve_serverkey = server
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)
        status, welcome = self.ask(Op.HELLO, b"", [1, 0, client_id, tenant, "h", "0"])
        assert status == 0, welcome
        self.tenant = welcome["tenant"]
        self.seed = P.tenant_seed(self.tenant)

    def ask(self, op: Op, rte: bytes, fields: list[Any]) -> tuple[int, Any]:
        self.sock.send_multipart([op.value, rte, msgpack.packb([next(self.ids), *fields],
                                                               use_bin_type=True)])
        assert self.sock.poll(5000), "no reply"
        _, status, body = P.decode_reply(self.sock.recv_multipart()[1])
        return status, body

    def route(self, key: bytes) -> bytes:
        return P.route_for_shard(P.shard_of(key, self.seed, SHARDS))

    def close(self) -> None:
        try:
            self.ask(Op.BYE, b"", [])
        finally:
            self.sock.close(linger=0)
            self.ctx.term()


class World:
    def __init__(self, mode: str, master: MasterProcess, a: Client, b: Client,
                 keydir: Path | None) -> None:
        self.mode = mode
        self.master = master
        self.a = a
        self.b = b
        self.keydir = keydir

    def raw(self, which: str, client_id: str) -> RawPeer:
        key = {"a": "alice", "b": "bob"}[which]
        tenant = {"a": TENANT_A, "b": TENANT_B}[which]
        return RawPeer(self.master.endpoint, tenant, self.keydir, key if self.keydir else None,
                       client_id)


@pytest.fixture(scope="module", params=["plain", "curve"])
def world(request, tmp_path_factory):
    extra = ("--shard-processes",) if request.config.getoption("--shard-processes",
                                                                default=False) else ()
    keydir = None
    flags: tuple[str, ...] = ("--shards", str(SHARDS), "--log-level", "WARNING")
    if request.param == "curve":
        keydir = tmp_path_factory.mktemp("keys")
        auth.keygen(keydir, "alice", TENANT_A)
        auth.keygen(keydir, "bob", TENANT_B)
        auth.keygen(keydir, "root", "default")  # the admin tenant (consistency checks)
        flags += ("--curve-dir", str(keydir))
    m = MasterProcess(*extra, *flags)
    a, b = Client(ClientConfig(connect_timeout_s=5.0)), Client(ClientConfig(connect_timeout_s=5.0))
    try:
        if keydir is None:
            a.setup(m.addr, 8 << 20, TENANT_A)
            b.setup(m.addr, 8 << 20, TENANT_B)
        else:  # each claims the other's tenant: the key decides
            a.setup(m.addr, 8 << 20, TENANT_B, curve_dir=str(keydir), curve_client="alice")
            b.setup(m.addr, 8 << 20, TENANT_A, curve_dir=str(keydir), curve_client="bob")
        yield World(request.param, m, a, b, keydir)
        admin = Client(ClientConfig(connect_timeout_s=5.0))
        admin.setup(m.addr, 0, "default", **({} if keydir is None else
                                              {"curve_dir": str(keydir), "curve_client": "root"}))
        try:
            assert admin.check_consistency() == []
        finally:
            admin.close()
    finally:
        a.close()
        b.close()
        assert m.stop() == 0, getattr(m, "stderr", "")[-3000:]


def names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


# ---------------------------------------------------------------------------
# Tenant binding


def test_each_client_is_registered_in_its_own_tenant(world: World) -> None:
    for c, tenant in ((world.a, TENANT_A), (world.b, TENANT_B)):
        me = [x for x in c.list_clients() if x["client_id"] == c.client_id]
        assert [x["tenant"] for x in me] == [tenant]


# ---------------------------------------------------------------------------
# Keys


def test_put_get_exist_size_query(world: World) -> None:
    a, b = world.a, world.b
    key = "iso-single"
    a.put(key, b"from-a")
    assert a.is_exist(key) and a.get(key) == b"from-a" and a.get_size(key) == 6
    assert b.is_exist(key) is False
    with pytest.raises(ObjectNotFound):
        b.get(key)
    with pytest.raises(ObjectNotFound):
        b.get_size(key)
    with pytest.raises(ObjectNotFound):
        b.query_key(key)
    buf = bytearray(16)
    with pytest.raises(ObjectNotFound):
        b.get_into(key, buf)
    # The same key in the other tenant is another object.
    b.put(key, b"from-b, longer")
    assert b.get(key) == b"from-b, longer" and a.get(key) == b"from-a"
    assert a.query_key(key)["size"] == 6 and b.query_key(key)["size"] == 14
    a.remove(key, force=True)
    assert b.get(key) == b"from-b, longer"
    b.remove(key, force=True)


def test_batch_ops(world: World) -> None:
    a, b = world.a, world.b
    keys = names("iso-batch", 12)
    values = [os.urandom(100 + i) for i in range(12)]
    assert a.put_batch(keys, values) == [0] * 12
    assert b.batch_is_exist(keys) == [0] * 12
    assert b.get_batch(keys) == [None] * 12
    assert b.batch_get_into(keys, [bytearray(200) for _ in keys]) == [Status.OBJECT_NOT_FOUND] * 12
    assert b.batch_remove(keys, force=True) == [Status.OBJECT_NOT_FOUND] * 12
    assert a.get_batch(keys) == values
    other = [os.urandom(50) for _ in keys]
    assert b.put_batch(keys, other) == [0] * 12  # not OBJECT_ALREADY_EXISTS: b's own objects
    assert b.get_batch(keys) == other and a.get_batch(keys) == values
    assert a.batch_remove(keys, force=True) == [0] * 12
    assert b.get_batch(keys) == other
    assert b.batch_remove(keys, force=True) == [0] * 12


def test_remove_and_remove_all(world: World) -> None:
    a, b = world.a, world.b
    ka, kb = names("iso-ra-a", 5), names("iso-ra-b", 3)
    assert a.put_batch(ka, [b"a"] * 5) == [0] * 5
    assert b.put_batch(kb, [b"b"] * 3) == [0] * 3
    with pytest.raises(ObjectNotFound):
        b.remove(ka[0], force=True)
    assert b.remove_all(force=True) == 3
    assert a.batch_is_exist(ka) == [1] * 5
    assert b.batch_is_exist(kb) == [0] * 3
    assert a.remove_all(force=True) == 5
    assert a.batch_is_exist(ka) == [0] * 5


def test_upsert(world: World) -> None:
    a, b = world.a, world.b
    key = "iso-upsert"
    a.put(key, b"a-1")
    b.upsert(key, b"b-1")
    assert a.get(key) == b"a-1" and b.get(key) == b"b-1"
    a.upsert(key, b"a-2")
    assert a.get(key) == b"a-2" and b.get(key) == b"b-1"
    assert b.upsert_batch([key], [b"b-2"]) == [0]
    assert a.get(key) == b"a-2" and b.get(key) == b"b-2"
    a.remove(key, force=True)
    b.remove(key, force=True)


def test_writes_in_progress(world: World) -> None:
    """A write in progress in one tenant neither blocks nor is visible to the other,
    and the other cannot end or revoke it."""
    ra, rb = world.raw("a", "iso-raw-a"), world.raw("b", "iso-raw-b")
    try:
        key = b"iso-pending"
        status, replicas = ra.ask(Op.PUT_START, ra.route(key), [key, 100, None])
        assert status == 0 and replicas
        assert rb.ask(Op.QUERY_KEY, rb.route(key), [key])[0] == Status.OBJECT_NOT_FOUND
        assert rb.ask(Op.PUT_END, rb.route(key), [key])[0] == Status.OBJECT_NOT_FOUND
        assert rb.ask(Op.PUT_REVOKE, rb.route(key), [key])[0] == Status.OBJECT_NOT_FOUND
        assert rb.ask(Op.REMOVE, rb.route(key), [key, True])[0] == Status.OBJECT_NOT_FOUND
        status, body = rb.ask(Op.BATCH_PUT_REVOKE, rb.route(key), [[key]])
        assert (status, body) == (0, [Status.OBJECT_NOT_FOUND])
        # b can write the same key at the same time: a different object.
        status, replicas_b = rb.ask(Op.PUT_START, rb.route(key), [key, 100, None])
        assert status == 0 and replicas_b, replicas_b
        assert rb.ask(Op.PUT_REVOKE, rb.route(key), [key]) == (0, 0)
        # a's write is still there, and still a's to end.
        status, info = ra.ask(Op.QUERY_KEY, ra.route(key), [key])
        assert status == 0 and info["state"] == "PROCESSING"
        assert info["pending_write"]["client_id"] == "iso-raw-a"
        assert ra.ask(Op.PUT_REVOKE, ra.route(key), [key]) == (0, 0)
    finally:
        ra.close()
        rb.close()


# ---------------------------------------------------------------------------
# Sessions


def test_attach_another_tenants_key(world: World) -> None:
    a, b = world.a, world.b
    a.put("iso-attach-key", b"a")
    assert b.attach_kv_session("iso-attach", ["iso-attach-key"]) == [Status.OBJECT_NOT_FOUND]
    with pytest.raises(SessionNotFound):
        b.get_kv_session("iso-attach")
    assert a.attach_kv_session("iso-attach", ["iso-attach-key"]) == [0]
    assert a.query_key("iso-attach-key")["sessions"] == [b"iso-attach"]
    a.remove("iso-attach-key", force=True)


def test_same_session_id_in_two_tenants(world: World) -> None:
    a, b = world.a, world.b
    sid = "iso-session"
    ka, kb = names("iso-s-a", 4), names("iso-s-b", 2)
    assert a.put_batch(ka, [b"a"] * 4) == [0] * 4
    assert b.put_batch(kb, [b"b"] * 2) == [0] * 2
    assert a.attach_kv_session(sid, ka) == [0] * 4
    # b does not see a's session ...
    with pytest.raises(SessionNotFound):
        b.get_kv_session(sid)
    with pytest.raises(SessionNotFound):
        b.list_kv_session_keys(sid)
    with pytest.raises(SessionNotFound):
        b.pin_kv_session(sid)
    assert b.update_kv_session(sid, []) == 0  # no session of b: nothing removed
    b.close_kv_session(sid)  # idempotent no-op for b
    assert a.get_kv_session(sid).member_count == 4
    # ... and has its own under the same id.
    assert b.attach_kv_session(sid, kb) == [0, 0]
    b.pin_kv_session(sid)
    assert b.get_kv_session(sid).pinned is True
    assert a.get_kv_session(sid).pinned is False
    assert sorted(a.list_kv_session_keys(sid).keys) == sorted(ka)
    assert sorted(b.list_kv_session_keys(sid).keys) == sorted(kb)
    # A tagged write in b grows only b's session.
    b.put("iso-s-b-tagged", b"t", ReplicateConfig(kv_sessions=[[sid]]))
    assert b.get_kv_session(sid).member_count == 3
    assert a.get_kv_session(sid).member_count == 4
    assert b.query_key("iso-s-b-tagged")["sessions"] == [sid.encode()]
    # Updates and closes are per tenant.
    assert a.update_kv_session(sid, ka[:1]) == 3
    assert b.get_kv_session(sid).member_count == 3
    b.close_kv_session(sid)
    with pytest.raises(SessionNotFound):
        b.get_kv_session(sid)
    info = a.get_kv_session(sid)
    assert (info.member_count, info.pinned) == (1, False)
    assert a.list_kv_session_keys(sid).keys == ka[:1]
    a.close_kv_session(sid)
    assert a.remove_all(force=True) == 4 and b.remove_all(force=True) == 3


def test_removing_objects_in_one_tenant_leaves_the_others_sessions(world: World) -> None:
    a, b = world.a, world.b
    sid, key = "iso-rm-session", "iso-rm-key"
    a.put(key, b"a")
    b.put(key, b"b")
    assert a.attach_kv_session(sid, [key]) == [0]
    assert b.attach_kv_session(sid, [key]) == [0]
    a.remove(key, force=True)
    with pytest.raises(SessionNotFound):  # a's session lost its last member
        a.get_kv_session(sid)
    assert b.get_kv_session(sid).member_count == 1
    assert b.list_kv_session_keys(sid).keys == [key]
    b.remove(key, force=True)


# ---------------------------------------------------------------------------
# Operator views


def test_list_clients_is_per_tenant(world: World) -> None:
    for c, tenant in ((world.a, TENANT_A), (world.b, TENANT_B)):
        listed = c.list_clients()
        assert {x["tenant"] for x in listed} == {tenant}, listed


def test_stats_and_segment_views_are_global(world: World) -> None:
    """Documents what the operator views show to an ordinary tenant: STATS counts
    every tenant's keys, sessions and clients, and LIST_SEGMENTS lists every
    segment with its owner's client id (neither is filtered by tenant).  Key names
    and session ids of another tenant never appear."""
    a, b = world.a, world.b
    base = a.stats()["keys"]
    assert b.put_batch(names("iso-stats", 5), [b"x"] * 5) == [0] * 5
    try:
        sa, sb = a.stats(), b.stats()
        assert sa["keys"] == base + 5 and sb["keys"] == sa["keys"]  # global counters
        assert sa["clients"] >= 2
        segments = {s["owner"] for s in a.list_segments()}
        assert b.client_id in segments  # b's segment and client id, seen by a
        text = repr(sa) + repr(a.list_segments()) + repr(a.list_clients())
        assert "iso-stats" not in text
    finally:
        assert b.batch_remove(names("iso-stats", 5), force=True) == [0] * 5
