"""Tenants cannot reach each other's space, and no client or tenant can exhaust the
master: placement and eviction stay within the tenant (kvmaster/_tenancy.py), tenant
quotas (capacity, writes in progress, clients, sessions), the per-peer reply queue in
bytes, and the limits on whole-store walks (kvmaster/_limits.py).

Real master processes on loopback; tenants named in HELLO (``plain``) or bound to CURVE
keys (the client-count test), raw DEALER peers for what a well-behaved client never
sends.
"""

from __future__ import annotations

import itertools
import signal
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conftest import MasterProcess

from kvmaster import (Client, ClientConfig, ReplicateConfig, TenantQuotaExceeded, auth)
from kvmaster import protocol as P
from kvmaster.errors import RequestError
from kvmaster.protocol import Op, Status

MiB = 1 << 20


class Peer:
    """A raw DEALER of one tenant (HELLO names it; with ``keydir``, a CURVE key binds it)."""

    def __init__(self, endpoint: str, tenant: str, client_id: str,
                 keydir: Path | None = None, key: str | None = None,
                 hello: bool = True) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keydir is not None:
            pub, sec, server = auth.client_keys(keydir, key)
            self.sock.curve_publickey, self.sock.curve_secretkey = pub, sec
            self.sock.curve_serverkey = server
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)
        self.hello_status = None
        if hello:
            self.hello_status, body = self.ask(Op.HELLO, b"", [1, 3, client_id, tenant, "h", "0"])
            if self.hello_status == 0:
                self.seed = P.tenant_seed(body["tenant"])
                self.shards = body["shard_count"]

    def send(self, op: Op, rte: bytes, fields: list[Any]) -> None:
        self.sock.send_multipart([op.value, rte, msgpack.packb([next(self.ids), *fields],
                                                               use_bin_type=True)])

    def ask(self, op: Op, rte: bytes, fields: list[Any], timeout_ms: int = 10000
            ) -> tuple[int, Any]:
        self.send(op, rte, fields)
        assert self.sock.poll(timeout_ms), f"no reply to {op.name}"
        _, status, body = P.decode_reply(self.sock.recv_multipart()[1])
        return status, body

    def route(self, key: bytes) -> bytes:
        return P.route_for_shard(P.shard_of(key, self.seed, self.shards))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def segments_of(c: Client, key: str) -> set[str]:
    return {r[0] for r in c.query_key(key)["replicas"]}


@pytest.fixture
def master_of(request):
    made: list[MasterProcess] = []

    def start(*flags: str) -> MasterProcess:
        m = MasterProcess("--log-level", "WARNING", *flags)
        made.append(m)
        return m

    yield start
    for m in made:
        assert m.stop() == 0, getattr(m, "stderr", "")[-3000:]


@pytest.fixture
def clients():
    made: list[Client] = []

    def make(m: MasterProcess, size: int, tenant: str, **kw: Any) -> Client:
        c = Client(ClientConfig(connect_timeout_s=5.0))
        c.setup(m.addr, size, tenant, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# ---------------------------------------------------------------- placement


def test_writes_never_land_in_another_tenants_segment(master_of, clients) -> None:
    """A's segments (its real one and a made-up remote one of 4 GiB, far larger than
    any other) never receive B's writes: B writes to its own segment, or else to the
    master's shared one, or fails; never into A's space."""
    m = master_of("--shards", "2", "--master-segment-size", str(8 * MiB))
    a = clients(m, 16 * MiB, "tenant-a")
    fake = Peer(m.endpoint, "tenant-a", "a-fake")
    assert fake.ask(Op.MOUNT_SEGMENT, b"", ["a-fake-remote", 4 << 30, "other-host",
                                            "tcp://10.9.9.9:1"])[0] == 0
    b_alone = clients(m, 0, "tenant-b")  # no segment: only the master's is open to it
    b = clients(m, 16 * MiB, "tenant-c")
    a_segs = {"a-fake-remote", a.segment_name}
    master_seg = [s["name"] for s in a.list_segments()
                  if s["name"] not in a_segs | {b.segment_name}]
    assert len(master_seg) == 1
    for i in range(50):
        b_alone.put(f"k{i}", b"b" * 1000)
        b.put(f"k{i}", b"c" * 1000)
        assert segments_of(b_alone, f"k{i}") == set(master_seg)
        assert segments_of(b, f"k{i}") == {b.segment_name}
        assert b_alone.get(f"k{i}") == b"b" * 1000 and b.get(f"k{i}") == b"c" * 1000
    # Preferring another tenant's segment does not put a write there either.
    b.put("pref", b"x" * 100, ReplicateConfig(preferred_segments=[a.segment_name]))
    assert segments_of(b, "pref") == {b.segment_name}
    fake.close()


def test_a_tenant_without_a_segment_of_its_own_gets_no_space_of_others(
        master_of, clients) -> None:
    m = master_of("--shards", "2")  # no master segment: nothing is shared
    a = clients(m, 16 * MiB, "tenant-a")
    b = clients(m, 0, "tenant-b")
    with pytest.raises(RequestError) as e:
        b.put("k", b"v" * 100)
    assert e.value.code == Status.NO_AVAILABLE_HANDLE
    a.put("k", b"v" * 100)
    assert a.get("k") == b"v" * 100


def test_shared_tenants_segments_hold_every_tenants_writes(master_of, clients) -> None:
    m = master_of("--shards", "2", "--shared-tenants", "pool")
    pool = clients(m, 16 * MiB, "pool")
    b = clients(m, 0, "tenant-b")
    b.put("k", b"v" * 100)
    assert segments_of(b, "k") == {pool.segment_name}


def test_a_tenant_writing_hard_never_evicts_another_tenants_objects(
        master_of, clients) -> None:
    """Eviction stays within the tenant: A's writes fill and churn its own segment; B's
    objects, in its own segment, all stay."""
    m = master_of("--shards", "2")
    a = clients(m, 4 * MiB, "tenant-a")
    b = clients(m, 4 * MiB, "tenant-b")
    kept = [f"b{i}" for i in range(200)]
    assert b.put_batch(kept, [b"B" * 4096] * 200) == [0] * 200
    for r in range(6):  # A writes about 3x its segment
        ks = [f"a{r}-{i}" for i in range(200)]
        assert a.put_batch(ks, [b"A" * 4096] * 200) == [0] * 200
    assert a.stats()["evicted_keys"] > 0
    assert b.batch_is_exist(kept) == [1] * 200
    assert all(v == b"B" * 4096 for v in b.get_batch(kept))


# ------------------------------------------------------------------- quotas


def test_capacity_quota_keeps_a_tenant_to_its_share_of_the_shared_segment(
        master_of, clients) -> None:
    """Two tenants share the master's segment; A writes far more than its quota and
    its writes evict its own objects; B still has its room and keeps what it wrote."""
    m = master_of("--shards", "2", "--master-segment-size", str(16 * MiB),
                  "--tenant-quota-bytes", str(6 * MiB))
    a = clients(m, 0, "tenant-a")
    b = clients(m, 0, "tenant-b")
    mine = [f"b{i}" for i in range(256)]
    assert b.put_batch(mine, [b"B" * 16384] * 256) == [0] * 256  # 4 MiB
    for r in range(8):  # 32 MiB in all
        ks = [f"a{r}-{i}" for i in range(256)]
        assert a.put_batch(ks, [b"A" * 16384] * 256) == [0] * 256
    assert b.batch_is_exist(mine) == [1] * 256
    assert sum(a.batch_is_exist([f"a7-{i}" for i in range(256)])) == 256
    assert sum(a.batch_is_exist([f"a0-{i}" for i in range(256)])) == 0  # its own went


def test_hard_pins_count_in_the_quota_and_past_it_a_write_is_refused(
        master_of, clients) -> None:
    m = master_of("--shards", "1", "--master-segment-size", str(16 * MiB),
                  "--tenant-quota-bytes", str(2 * MiB))
    a = clients(m, 0, "tenant-a")
    b = clients(m, 0, "tenant-b")
    pin = ReplicateConfig(with_hard_pin=True)
    # Each object counts its 16 KiB, its key and the record's 512 B: 124 fit 2 MiB.
    ks = [f"p{i}" for i in range(124)]
    assert a.put_batch(ks, [b"P" * 16384] * 124, pin) == [0] * 124
    with pytest.raises(TenantQuotaExceeded):
        a.put("one-more", b"x" * 16384)
    # The other tenant is not locked out of the shared segment.
    ks = [f"b{i}" for i in range(120)]  # (within its own quota)
    assert b.put_batch(ks, [b"B" * 16384] * 120) == [0] * 120
    assert a.stats()["tenant_quota_refusals"] >= 1


def test_writes_in_progress_quota(master_of, clients) -> None:
    m = master_of("--shards", "1", "--master-segment-size", str(16 * MiB),
                  "--tenant-max-writes", "32")
    a = Peer(m.endpoint, "tenant-a", "a-raw")
    b = clients(m, 0, "tenant-b")
    codes = [a.ask(Op.PUT_START, a.route(f"k{i}".encode()), [f"k{i}".encode(), 4096, None])[0]
             for i in range(40)]
    assert codes[:32] == [0] * 32
    assert set(codes[32:]) == {Status.TENANT_QUOTA_EXCEEDED}
    assert b.put_batch([f"b{i}" for i in range(32)], [b"b" * 4096] * 32) == [0] * 32
    a.ask(Op.BYE, b"", [])
    a.close()


def test_one_key_or_tenant_cannot_take_every_client_slot(master_of, tmp_path) -> None:
    keydir = tmp_path / "keys"
    auth.keygen(keydir, "alice", "tenant-a")
    auth.keygen(keydir, "bob", "tenant-b")
    m = master_of("--curve-dir", str(keydir), "--max-clients", "64",
                  "--max-clients-per-key", "8")
    peers = [Peer(m.endpoint, "x", f"a{i}", keydir, "alice") for i in range(12)]
    assert [p.hello_status for p in peers] == [0] * 8 + [Status.TENANT_QUOTA_EXCEEDED] * 4
    bob = Peer(m.endpoint, "x", "b0", keydir, "bob")
    assert bob.hello_status == 0
    for p in [*peers, bob]:
        p.close()


def test_tenant_max_clients(master_of) -> None:
    m = master_of("--max-clients", "64", "--tenant-max-clients", "4")
    peers = [Peer(m.endpoint, "tenant-a", f"a{i}") for i in range(6)]
    assert [p.hello_status for p in peers] == [0] * 4 + [Status.TENANT_QUOTA_EXCEEDED] * 2
    other = Peer(m.endpoint, "tenant-b", "b0")
    assert other.hello_status == 0
    # A slot freed by a BYE is usable again.
    peers[0].ask(Op.BYE, b"", [])
    again = Peer(m.endpoint, "tenant-a", "a-again")
    assert again.hello_status == 0
    for p in [*peers, other, again]:
        p.close()


def test_one_tenant_cannot_take_every_session(master_of, clients) -> None:
    m = master_of("--shards", "2", "--master-segment-size", str(8 * MiB),
                  "--kv-session-max-sessions", "400", "--tenant-max-sessions", "100")
    a = clients(m, 0, "tenant-a")
    b = clients(m, 0, "tenant-b")
    a.put("k", b"v")
    b.put("k", b"v")
    codes = []
    for i in range(200):
        try:
            codes.append(a.attach_kv_session(f"s{i}", ["k"])[0])
        except RequestError as e:
            codes.append(e.code)
    assert codes.count(0) <= 100 and codes.count(0) >= 90  # (each shard: its half)
    assert set(codes) - {0} == {Status.TENANT_QUOTA_EXCEEDED}
    assert [b.attach_kv_session(f"s{i}", ["k"])[0] for i in range(50)] == [0] * 50


# ------------------------------------------------------- the master's memory


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_client_that_never_reads_does_not_grow_the_master(master_of, clients) -> None:
    """3,000 LIST_KV_SESSION_KEYS requests for a session of 4,096 4-KiB keys from a peer
    that reads no reply: before, each 16 MiB reply was queued (192 took the master to
    3.2 GiB); now pages end at 64 KiB and the peer's queue holds 1,024 messages, so the
    master grows by about 64 MiB at most, drops the rest, and serves a well-behaved
    client meanwhile."""
    m = master_of("--shards", "1", "--master-segment-size", str(64 * MiB))
    writer = clients(m, 0, "tenant-a")
    keys = [("k" * 4000) + f"{i:05d}" for i in range(4096)]
    for i in range(0, 4096, 512):
        part = keys[i:i + 512]
        assert writer.put_batch(part, [b"v"] * 512) == [0] * 512
        assert writer.attach_kv_session("big", part) == [0] * 512
    hog = Peer(m.endpoint, "tenant-a", "hog")
    hog.sock.setsockopt(zmq.RCVBUF, 4096)  # (its kernel buffer holds little)
    hog.sock.setsockopt(zmq.RCVHWM, 1)
    before = _rss(m.proc.pid)
    for _ in range(3000):
        hog.send(Op.LIST_KV_SESSION_KEYS, hog.route(b"big"), [b"big", b"", 4096])
    good = clients(m, 0, "tenant-b")
    deadline = time.monotonic() + 30
    for i in range(20):
        good.put(f"g{i}", b"x" * 100)
        assert good.get(f"g{i}") == b"x" * 100
    while time.monotonic() < deadline and writer.stats()["front"]["reply_dropped"] == 0:
        time.sleep(0.2)
    grown = _rss(m.proc.pid) - before
    assert grown < 256 * MiB, f"master grew {grown / MiB:.0f} MiB"
    assert writer.stats()["front"]["reply_dropped"] > 0
    hog.close()


# --------------------------------------------------------- whole-store walks


def test_check_consistency_is_for_the_admin_tenant(master_of, clients) -> None:
    m = master_of()
    admin = clients(m, 4 * MiB, "default")
    other = clients(m, 4 * MiB, "tenant-a")
    assert admin.check_consistency() == []
    with pytest.raises(RequestError) as e:
        other.check_consistency()
    assert e.value.code == Status.ILLEGAL_CLIENT


def test_a_mount_unmount_loop_is_rate_limited(master_of) -> None:
    m = master_of("--shards", "2")
    p = Peer(m.endpoint, "tenant-a", "looper")
    codes = []
    for i in range(100):
        name = f"loop-{i}"
        codes.append(p.ask(Op.MOUNT_SEGMENT, b"", [name, 1 << 20, "elsewhere", "tcp://x:1"])[0])
        codes.append(p.ask(Op.UNMOUNT_SEGMENT, b"", [name])[0])
    assert Status.BUSY in codes
    assert codes[:64] == [0] * 64  # the burst
    p.close()


def test_unmounting_an_empty_segment_does_not_walk_the_objects() -> None:
    """The shard skips the walk of its objects for a segment nothing is allocated in."""
    from kvmaster._shard import ShardActor
    from kvmaster.config import MasterConfig

    shard = ShardActor(0, 1, MasterConfig(), lambda *a: None)
    shard.mount_segment("full", "c", 1 << 20)
    shard.objects = _Exploding(shard.objects)
    shard.mount_segment("empty", "c", 1 << 20)
    assert shard.unmount_segment("empty") == 0


class _Exploding(dict):
    def items(self):  # type: ignore[override]
        raise AssertionError("the objects were walked")



def test_a_huge_request_frame_is_dropped_at_the_socket(master_of, clients) -> None:
    """A 200 MiB frame exceeds the socket's bound (twice a full batch of the largest
    keys): libzmq drops it with its connection; the master keeps serving."""
    m = master_of()
    good = clients(m, 4 * MiB, "default")
    p = Peer(m.endpoint, "tenant-a", "huge")
    p.sock.send_multipart([Op.BATCH_EXIST_KEY.value, P.route_for_shard(0),
                           b"\x00" * (200 * MiB)])
    for i in range(20):
        good.put(f"k{i}", b"v" * 100)
        assert good.get(f"k{i}") == b"v" * 100
    assert m.proc.poll() is None
    assert not p.sock.poll(1000)  # never decoded, so never answered
    p.close()


def test_a_quota_caps_the_objects_a_tenant_keeps_per_byte(master_of, clients) -> None:
    """1-byte objects with 4 KB keys: each record costs the master its key and 512 B,
    charged to the tenant's quota, so a tenant keeps at most quota / 4.6 KB of them
    (its own least recent go first), whatever their payload."""
    m = master_of("--shards", "1", "--master-segment-size", str(64 * MiB),
                  "--tenant-quota-bytes", str(MiB))
    a = clients(m, 0, "tenant-a")
    for r in range(10):  # (a batch's own writes cannot make room for each other)
        ks = [f"{r}-{i}-" + "k" * 4000 for i in range(100)]
        assert a.put_batch(ks, [b"x"] * 100) == [0] * 100
    kept = a.stats()["keys"]
    assert 150 <= kept <= MiB // (4000 + 512)


# ------------------------------------------------------------- request rate


def test_request_shaper_parks_in_order_and_shares_turns() -> None:
    """The shaper's decisions at given times (kvmaster/_limits.py): a burst passes,
    what follows is parked in order and handed back as tokens come in, tenants in turn,
    and a full parking drops."""
    from kvmaster import _limits as L

    s = L.RequestShaper(rate=10.0, burst=4)
    assert [s.admit("a", i, 10, 1, 0.0) for i in range(4)] == [L.Admission.NOW] * 4
    assert s.admit("a", "a4", 10, 1, 0.0) is L.Admission.PARKED
    assert s.admit("a", "a5", 10, 1, 0.0) is L.Admission.PARKED
    assert s.admit("b", "b0", 10, 1, 0.0) is L.Admission.NOW  # (its own bucket)
    for i in range(4):
        s.admit("b", f"b{i + 1}", 10, 1, 0.0)
    assert s.parked_total == 3 and s.next_due(0.0) == pytest.approx(0.1)
    assert s.due(0.05) == []
    assert s.due(0.1) == ["a4", "b4"]  # one token each: the tenants take turns
    assert s.due(0.3) == ["a5"]  # (the second token of a, none left for it)
    # With a parked, a new message of a is parked behind, even with tokens in.
    s.admit("a", "a6", 10, 1, 0.3)
    assert s.admit("a", "a7", 10, 1, 10.0) is L.Admission.PARKED
    assert s.due(10.0) == ["a6", "a7"] and s.parked_total == 0
    # A message of 3 requests takes 3 tokens; one of 100 waits for a full bucket and
    # takes all 100: the bucket's debt (96) makes the next message wait its share.
    assert s.admit("c", "c0", 10, 100, 0.0) is L.Admission.NOW
    assert s.admit("c", "c1", 10, 3, 0.0) is L.Admission.PARKED
    assert s.next_due(0.0) == pytest.approx(9.9)
    assert s.due(0.3) == [] and s.due(9.8) == [] and s.due(10.0) == ["c1"]
    # A full parking drops, and is counted.
    t = L.RequestShaper(rate=1.0, burst=1)
    t.admit("d", "d0", 1, 1, 0.0)
    verdicts = [t.admit("d", i, 1, 1, 0.0) for i in range(L.PARKED_MESSAGES + 3)]
    assert verdicts.count(L.Admission.PARKED) == L.PARKED_MESSAGES
    assert verdicts[-3:] == [L.Admission.FULL] * 3 and t.full_count == 3
    assert t.admit("e", "big", L.PARKED_BYTES + 1, 1, 0.0) is L.Admission.NOW
    t.admit("e", "e1", 1, 1, 0.0)
    assert t.admit("e", "e2", L.PARKED_BYTES, 1, 0.0) is L.Admission.FULL


def test_request_shaper_bounds_over_all_tenants_age_and_drain() -> None:
    """The parking is bounded over all tenants too, a message parked past its maximum
    age is dropped (counted), and a stopping master takes every parked message at once
    (kvmaster/_limits.py)."""
    from kvmaster import _limits as L

    s = L.RequestShaper(rate=1.0, burst=1, max_age_s=5.0)
    parked = 0
    tenant = 0
    while parked < L.PARKED_TOTAL_MESSAGES:
        s.admit(f"t{tenant}", "first", 1, 1, 0.0)  # (its burst)
        for _ in range(min(L.PARKED_MESSAGES, L.PARKED_TOTAL_MESSAGES - parked)):
            assert s.admit(f"t{tenant}", parked, 1, 1, 0.0) is L.Admission.PARKED
            parked += 1
        tenant += 1
    assert s.parked_total == L.PARKED_TOTAL_MESSAGES
    s.admit("fresh", "burst", 1, 1, 0.0)
    assert s.admit("fresh", "over", 1, 1, 0.0) is L.Admission.FULL  # (its own is empty)
    assert len(s.drain()) == L.PARKED_TOTAL_MESSAGES and s.parked_total == 0
    assert s.parked_total_bytes == 0 and s.due(1.0) == []
    # Bytes over all tenants.
    b = L.RequestShaper(rate=1.0, burst=1)
    big = L.PARKED_BYTES
    for i in range(L.PARKED_TOTAL_BYTES // big):
        b.admit(f"b{i}", "burst", 1, 1, 0.0)
        assert b.admit(f"b{i}", i, big, 1, 0.0) is L.Admission.PARKED
    b.admit("last", "burst", 1, 1, 0.0)
    assert b.admit("last", "x", 1, 1, 0.0) is L.Admission.FULL
    # Age: dropped when its turn comes after max_age_s, the next one still served.
    a = L.RequestShaper(rate=0.1, burst=1, max_age_s=5.0)
    a.admit("a", "a0", 1, 1, 0.0)
    a.admit("a", "a1", 1, 1, 0.0)
    a.admit("a", "a2", 1, 1, 4.0)
    assert a.next_due(0.0) == pytest.approx(5.0)  # (its age, before its tokens at 10)
    assert a.due(5.0) == [] and a.expired_count == 1 and a.parked_total == 1
    assert a.due(8.0) == [] and a.parked_total == 1
    assert a.due(9.0) == [] and a.expired_count == 2 and a.parked_total == 0
    a.admit("a", "a3", 1, 1, 9.5)
    assert a.due(10.0) == ["a3"]


def test_request_shaper_keeps_a_new_tenants_bucket_when_every_other_has_parked() -> None:
    """With MAX_BUCKETS tenants all holding parked messages, a new tenant's bucket is
    kept (none can be forgotten), so it is shaped like any other."""
    from kvmaster import _limits as L

    s = L.RequestShaper(rate=1.0, burst=1)
    for i in range(L.MAX_BUCKETS):
        s.admit(f"t{i}", "burst", 1, 1, 0.0)
        assert s.admit(f"t{i}", "parked", 1, 1, 0.0) is L.Admission.PARKED
    verdicts = [s.admit("new", i, 1, 1, 0.0) for i in range(100)]
    assert verdicts[0] is L.Admission.NOW
    assert verdicts[1:] == [L.Admission.PARKED] * 99


def test_batch_len_reads_headers_alone_and_never_raises() -> None:
    """A batch's key count from the msgpack headers; 0 for anything shorter or else."""
    from kvmaster._front import _batch_len

    assert _batch_len(msgpack.packb([7, [b"k"] * 40])) == 40
    assert _batch_len(msgpack.packb([300, [b"k"] * 70000])) == 70000
    assert _batch_len(msgpack.packb([1, b"k"])) == 0
    for raw in (b"", b"\x91", b"\xdc\x00\x01", b"\xdd\x00\x00\x00", b"\xdd\x00\x00\x00\x01",
                b"\x92\xcd", b"\x92\xcd\x00", b"\x92\x01\xdc", b"\x92\x01\xdd\x00"):
        assert _batch_len(raw) >= 0, raw
    for n in range(0, 12):
        assert _batch_len(msgpack.packb([5, [b"k"] * 300])[:n]) >= 0


def recv_replies(peer: Peer, want: int, timeout_ms: int) -> list[tuple[int, int]]:
    """(request id, status) of up to ``want`` replies (grouped or not)."""
    got: list[tuple[int, int]] = []
    while len(got) < want and peer.sock.poll(timeout_ms):
        frames = peer.sock.recv_multipart()
        for i in range(1, len(frames), 2):
            req_id, status, _ = P.decode_reply(frames[i])
            got.append((req_id, status))
    return got


def test_a_stopping_master_answers_the_parked_messages(master_of) -> None:
    """SIGTERM while a tenant has requests parked by its rate: every one is answered,
    the ones still parked SHUTTING_DOWN (PROTOCOL.md §10), none lost."""
    m = master_of("--tenant-max-requests-per-s", "20")
    p = Peer(m.endpoint, "tenant-a", "parked")
    assert p.hello_status == 0
    for i in range(300):
        p.send(Op.EXIST_KEY, p.route(f"k{i}".encode()), [f"k{i}".encode()])
    served = recv_replies(p, 64, 5000)  # (the burst)
    assert len(served) == 64
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=15) == 0
    got = served + recv_replies(p, 300 - 64, 5000)
    assert sorted(r for r, _ in got) == list(range(2, 302))
    statuses = [s for _, s in got]
    assert statuses.count(Status.SHUTTING_DOWN) > 150, statuses
    assert set(statuses) <= {0, Status.OBJECT_NOT_FOUND, Status.SHUTTING_DOWN}
    p.close()


def test_a_client_blocked_on_a_parked_request_is_not_expired(master_of, clients) -> None:
    """A client's call waits parked behind its tenant's other requests for longer than
    --client-ttl (the client sends no HEARTBEAT while blocked in a call): it is not
    expired, and its object is still there when the call is answered."""
    m = master_of("--tenant-max-requests-per-s", "50", "--client-ttl", "1")
    c = clients(m, 1 * MiB, "tenant-b")
    c.put("x", b"kept")
    p = Peer(m.endpoint, "tenant-b", "pipeliner")
    for i in range(300):  # (about 4.7 s of the tenant's rate past its burst)
        p.send(Op.EXIST_KEY, p.route(f"k{i}".encode()), [f"k{i}".encode()])
    burst = recv_replies(p, 64, 5000)  # (the rest are read and parked by now)
    time.sleep(0.2)
    t0 = time.monotonic()
    assert c.get("x") == b"kept"
    assert time.monotonic() - t0 > 1.5  # (it did wait, past the client TTL)
    assert c.stats()["front"]["clients_expired"] == 0
    assert len(burst) + len(recv_replies(p, 300 - len(burst), 5000)) == 300
    p.close()


def test_a_malformed_message_is_refused_at_once_not_parked(master_of) -> None:
    """A message of more requests than one message may carry gets its one
    INVALID_PARAMS reply at once, ahead of the tenant's parked requests."""
    m = master_of("--tenant-max-requests-per-s", "20")
    p = Peer(m.endpoint, "tenant-a", "bad")
    for i in range(100):
        p.send(Op.EXIST_KEY, p.route(f"k{i}".encode()), [f"k{i}".encode()])
    too_many = P.MAX_REQUESTS_PER_MESSAGE + 1
    bad_id = 1000
    p.sock.send_multipart([Op.EXIST_KEY.value, p.route(b"x"),
                           msgpack.packb([bad_id, b"x"])] * too_many)
    got = recv_replies(p, 66, 5000)  # the burst of 64, then the refusal
    assert (bad_id, Status.INVALID_PARAMS) in got, got[-3:]
    assert len(got) <= 70  # (the parked ones come at 20 per second after)
    assert len(recv_replies(p, 101 - len(got), 10000)) + len(got) == 101
    p.close()


def test_a_client_whose_heartbeats_are_parked_is_not_expired(master_of, clients) -> None:
    """With messages of 64 requests at 64 per second, a tenant's next message is parked
    for a second, longer than --client-ttl: its HEARTBEATs parked behind them still keep
    it registered (it is seen when its messages are read)."""
    m = master_of("--tenant-max-requests-per-s", "64", "--client-ttl", "0.4")
    admin = clients(m, 0, "default")
    p = Peer(m.endpoint, "tenant-a", "slow")
    assert p.hello_status == 0
    for j in range(4):
        frames: list[bytes] = []
        for i in range(64):
            key = f"k{j}-{i}".encode()
            frames += [Op.EXIST_KEY.value, p.route(key),
                       msgpack.packb([next(p.ids), key], use_bin_type=True)]
        p.sock.send_multipart(frames)
    end = time.monotonic() + 3.2
    while time.monotonic() < end:
        p.send(Op.HEARTBEAT, b"", [])
        time.sleep(0.1)
    got = recv_replies(p, 256 + 32, 5000)
    statuses = [s for _, s in got]
    assert len(got) >= 256 and Status.NOT_REGISTERED not in statuses, statuses
    assert admin.stats()["front"]["clients_expired"] == 0
    status, _ = p.ask(Op.EXIST_KEY, p.route(b"k"), [b"k"], timeout_ms=10000)
    assert status in (0, Status.OBJECT_NOT_FOUND)  # (still registered)
    p.close()


def test_a_tenant_over_its_request_rate_waits_and_loses_nothing(master_of, clients) -> None:
    """--tenant-max-requests-per-s 400 (bursts of 100): a peer pipelining 600 requests
    gets all 600 answers, in order, later than its burst allows; the admin tenant is
    not shaped; nothing is dropped."""
    m = master_of("--tenant-max-requests-per-s", "400")
    admin = clients(m, 0, "default")
    p = Peer(m.endpoint, "tenant-a", "pipeliner")
    assert p.hello_status == 0
    t0 = time.monotonic()
    for i in range(600):
        p.send(Op.EXIST_KEY, p.route(f"k{i}".encode()), [f"k{i}".encode()])
    ids = []
    for _ in range(600):
        assert p.sock.poll(10000), f"{len(ids)} replies of 600"
        req_id, status, _ = P.decode_reply(p.sock.recv_multipart()[1])
        assert status in (0, Status.OBJECT_NOT_FOUND), status
        ids.append(req_id)
    took = time.monotonic() - t0
    assert sorted(ids) == list(range(2, 602))  # (1 was the HELLO)
    front = admin.stats()["front"]
    assert front["rate_parked"] > 0 and front["rate_dropped"] == 0
    # 500 requests past the burst at 400/s: at least about 1.2 s (a lower bound: the
    # shaper's own arithmetic, not a speed goal).
    assert took > 1.0, took
    parked = front["rate_parked"]
    for i in range(300):
        admin.is_exist(f"k{i}")
    assert admin.stats()["front"]["rate_parked"] == parked  # the admin tenant is not shaped
    p.close()


def test_a_peer_whose_replies_are_dropped_is_not_served_until_it_reads(master_of,
                                                                       clients) -> None:
    """A peer that never reads its replies: once one is dropped (its queue is full) its
    requests are dropped unhandled (``stalled_dropped``) instead of answered into the
    full queue, while another tenant is served; once it reads again, it is answered."""
    m = master_of("--shards", "1", "--master-segment-size", str(64 * MiB),
                  "--max-reply-bytes-per-peer", str(16 * MiB))
    writer = clients(m, 0, "tenant-a")
    keys = [("k" * 4000) + f"{i:05d}" for i in range(512)]
    assert writer.put_batch(keys, [b"v"] * 512) == [0] * 512
    assert writer.attach_kv_session("big", keys) == [0] * 512
    hog = Peer(m.endpoint, "tenant-a", "hog")  # (its queues hold about 1,300 replies)
    for _ in range(5000):
        hog.send(Op.LIST_KV_SESSION_KEYS, hog.route(b"big"), [b"big", b"", 4096])
    good = clients(m, 0, "tenant-b")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and good.stats()["front"]["stalled_dropped"] == 0:
        good.put("g", b"x" * 100)
        assert good.get("g") == b"x" * 100
    front = good.stats()["front"]
    assert front["reply_dropped"] > 0 and front["stalled_dropped"] > 0
    # It reads again: what was queued for it, then answers to new requests.
    got = 0
    while hog.sock.poll(1000):
        hog.sock.recv_multipart()
        got += 1
    assert 0 < got < 5000
    time.sleep(0.2)  # (past STALLED_PEER_S)
    answered = False
    for _ in range(3):  # the first may be the probe whose reply came before the drain
        status, _ = hog.ask(Op.HEARTBEAT, b"", [], timeout_ms=3000)
        answered = status == 0
        if answered:
            break
    assert answered
    hog.close()
