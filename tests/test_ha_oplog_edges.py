"""Edges of the HA op log (``--ha-oplog``) on shard actors with a real etcd: batches of
long keys, starts that wait for held space when their batch spans shards, adopted
objects with two replicas under tenant quotas, and a standby that loses its lease while
it reads the log to its end."""

from __future__ import annotations

import time
from typing import Any

import msgpack

from kvmaster._oplog import ShardReplica
from kvmaster._shard_oplog import Adoption
from kvmaster.protocol import Op
from tests.test_ha_oplog import _LoggedShard
from tests.test_shard_unit import Harness


def test_adopting_a_two_replica_object_keeps_tenant_bytes_counted() -> None:
    """An object the log says has replicas on two segments is adopted on the first
    segment's return, then gains its second replica in place: with tenant quotas on,
    the tenant's counted bytes must follow (CountedObjects.recount)."""
    rep = ShardReplica(0)
    rep.segments = {"s1": (1 << 20, None), "s2": (1 << 20, None)}
    rep.objects = {b"a": [4096, [("s1", 0), ("s2", 0)], 11, 0]}
    h = Harness(1, tenant_quota_bytes=1 << 30)
    shard = h.shards[0]
    shard.adoption = Adoption(rep, deadline=1e18)
    h.mount("s1", 1 << 20)
    h.mount("s2", 1 << 20)
    assert len(shard.objects[b"a"].replicas()) == 2
    assert not shard.check_consistency(), shard.check_consistency()


def test_removing_an_adopted_two_replica_object_leaves_no_negative_count() -> None:
    rep = ShardReplica(0)
    rep.segments = {"s1": (1 << 20, None), "s2": (1 << 20, None)}
    rep.objects = {b"a": [4096, [("s1", 0), ("s2", 0)], 11, 0],
                   b"b": [4096, [("s1", 8192)], 12, 0]}
    h = Harness(1, tenant_quota_bytes=1 << 30)
    shard = h.shards[0]
    shard.adoption = Adoption(rep, deadline=1e18)
    h.mount("s1", 1 << 20)
    h.mount("s2", 1 << 20)
    assert h.call(Op.REMOVE, b"a", b"a", True)[0] == 0
    # b alone is left: its charge is what the tenant holds.
    from kvmaster._tenancy import charge
    real = charge(b"b", shard.objects[b"b"])
    assert shard.tenant_bytes.get(b"", 0) == real, (shard.tenant_bytes, real)


# ------------------------------------------------ two shard actors, a real op log


class _LoggedShards:
    """Two shard actors (in-process, any-shard batches as master.py sets them), each
    with its ShardLog on one real OpLogWriter."""

    def __init__(self, etcd: Any, cluster: str, n: int = 2, **cfg: Any) -> None:
        import asyncio

        from kvmaster._oplog import OpLogFollower, OpLogWriter
        from kvmaster._shard_oplog import ShardLog
        from kvmaster.ha import EtcdGateway, leader_key

        self.loop = asyncio.new_event_loop()
        cfg.setdefault("eviction_high_watermark_ratio", 1.0)
        self.h = Harness(n, **cfg)
        for s in self.h.shards:
            s.any_shard = True
        gw = EtcdGateway([etcd.url])
        lease = gw.grant(30)
        assert gw.create(leader_key(cluster), "me", lease)
        self.fenced: list[str] = []
        shards = self.h.shards
        self.writer = OpLogWriter(gw, cluster, lease, [0] * n, self.loop,
                                  on_durable=lambda i, seq: shards[i].log.durable(seq),
                                  on_fenced=self.fenced.append, delay_s=0.01)
        for s in shards:
            s.log = ShardLog(s, self.writer)
        self.follower = OpLogFollower(gw, cluster, n)

    def settle(self) -> None:
        import asyncio
        self.loop.run_until_complete(asyncio.sleep(0.3))
        self.h.run()

    def send(self, op: Op, route_key: bytes, *fields: Any) -> int:
        from kvmaster import protocol as P
        h = self.h
        h.req += 1
        payload = msgpack.packb([h.req, *fields], use_bin_type=True)
        s = P.shard_of(route_key, h.client.seed, len(h.shards))
        assert h.shards[s].deliver((op.value, payload, h.client))
        h.run()
        return h.req

    def close(self) -> None:
        self.writer.stop()
        self.loop.close()


def _keys_on(h: Harness, shard: int, n: int, tag: bytes) -> list[bytes]:
    from kvmaster import protocol as P
    out, i = [], 0
    while len(out) < n:
        k = tag + b"%d" % i
        if P.shard_of(k, h.client.seed, len(h.shards)) == shard:
            out.append(k)
        i += 1
    return out


def test_a_batch_for_another_shard_does_not_evict_the_receiving_shards_objects(etcd) -> None:
    """A batch put start is delivered to its first key's shard (batch_any_shard).  Its
    first key is stored already on shard 0 (it takes no space), the others belong to
    shard 1, which has room for all of them.  Nothing on shard 0 needs to go."""
    t = _LoggedShards(etcd, "anyshard")
    try:
        h = t.h
        s0 = h.shards[0]
        h.mount("seg", 2 * 8 * 4096)  # each shard: 8 x 4 KiB
        mine = _keys_on(h, 0, 8, b"old")
        for k in mine:
            assert h.put(k, 4096) == 0
        assert len(s0.objects) == 8  # shard 0 full, shard 1 empty
        t.settle()
        theirs = _keys_on(h, 1, 4, b"new")
        batch = [mine[0], *theirs]
        req = t.send(Op.BATCH_PUT_START, batch[0], batch, [4096] * len(batch), None)
        t.settle()
        assert h.replies.pop(req)[0] == 0
        assert s0.counters["evicted_keys"] == 0, (
            f"shard 0 evicted {s0.counters['evicted_keys']} objects for keys of shard 1; "
            f"parked {s0.counters['starts_parked_for_oplog']}")
    finally:
        t.close()


def test_a_batch_of_long_keys_reaches_etcd(etcd) -> None:
    """One client batch of 500 keys of 4000 bytes (KEY_MAX_BYTES is 4096) would make an
    op-log batch of about 2 MB, over etcd's default request limit (1.5 MiB): batches are
    cut by bytes too, so the records reach etcd and a standby follows them."""

    t = _LoggedShard(etcd, "longkeys")
    try:
        h, shard = t.h, t.shard
        h.mount("seg", 1 << 20)
        keys = [b"%04d" % i + b"k" * 3996 for i in range(500)]
        st, _ = h.call(Op.BATCH_PUT_START, keys[0], keys, [64] * len(keys), None)
        assert st == 0
        st, _ = h.call(Op.BATCH_PUT_END, keys[0], keys)
        assert st == 0 and len(shard.objects) == 500
        for _ in range(10):
            t.settle()
        t.follower.poll()
        rep = t.follower.replicas[0]
        assert len(rep.objects) == 500, (
            f"standby has {len(rep.objects)} objects; writer retries "
            f"{t.writer.counters['oplog_retries']}, pending {t.writer.pending}")
    finally:
        t.close()


def test_a_forwarded_batch_part_waits_for_held_space_like_a_direct_start(etcd) -> None:
    """Shard 1 is full; one of its objects was just removed (its range held until the
    F record is durable).  A batch start for one key of shard 1 sent to shard 1 waits
    for the held space and succeeds; so does the same key in a batch whose first key
    belongs to shard 0 (delivered to shard 0, the part forwarded to shard 1)."""
    t = _LoggedShards(etcd, "fwd")
    try:
        h = t.h
        s1 = h.shards[1]
        h.mount("seg", 2 * 8 * 4096)
        full = _keys_on(h, 1, 8, b"full")
        for k in full:
            assert h.put(k, 4096) == 0
        t.settle()
        # direct: parked, then answered 0
        assert h.call(Op.REMOVE, full[0], full[0], True)[0] == 0
        k1 = _keys_on(h, 1, 2, b"direct")
        req = t.send(Op.BATCH_PUT_START, k1[0], [k1[0]], [4096], None)
        t.settle()
        st, body = h.replies.pop(req)
        assert st == 0 and type(body[0]) is list, body  # (replicas)
        # forwarded: shard 0 has room, shard 1's key needs the held space
        assert h.call(Op.REMOVE, full[1], full[1], True)[0] == 0
        a = _keys_on(h, 0, 1, b"first")[0]
        b = _keys_on(h, 1, 1, b"second")[0]
        req = t.send(Op.BATCH_PUT_START, a, [a, b], [4096, 4096], None)
        t.settle()
        st, body = h.replies.pop(req)
        assert st == 0
        assert type(body[1]) is list, (
            f"forwarded part refused with {body[1]}; s1 alloc_held_by_oplog="
            f"{s1.counters['alloc_held_by_oplog']}")
    finally:
        t.close()


def test_a_standby_that_loses_its_lease_during_catch_up_does_not_stay_a_zombie(etcd) -> None:
    """--ha-oplog: between winning the key and serving, the standby reads the log to its
    end on a thread (HotStandby.elected) while its state is still STANDBY.  If etcd is
    away long enough that the lease lapses meanwhile, LeaderElection calls on_lost and
    its thread ends (kvmaster/ha.py: no new campaign), and the catch-up stopped its
    follower: the master stops (exit status 3) rather than stay a standby that neither
    follows nor campaigns."""
    import os
    import signal

    from kvmaster.config import MasterConfig
    from kvmaster.ha import LeaderElection
    from kvmaster.master import Master, MasterState

    m = Master(MasterConfig(port=0, metrics_port=-1, shards=1, ha=True, ha_oplog=True,
                            etcd_endpoints=etcd.url, cluster_id="zombie", ha_lease_ttl=2))
    elected = []
    lost = []
    # What master._start_election wires: on_elected starts the catch-up (here: it does
    # not finish, as while etcd is away), on_lost -> _lose_leadership.
    e = LeaderElection([etcd.url], "zombie", "me", 2, on_elected=lambda: elected.append(1),
                       on_lost=lambda: lost.append(1))
    m._election = e
    e.start()
    try:
        deadline = time.monotonic() + 10
        while not elected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert elected
        os.kill(etcd.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while not lost and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            os.kill(etcd.proc.pid, signal.SIGCONT)
        assert lost
        m._lose_leadership()  # (on the loop)
        time.sleep(3)
        assert not e._thread.is_alive() and not e.is_leader  # never campaigns again
        assert m.state is not MasterState.STANDBY, (
            f"state {m.state}, exit_code {m.exit_code}: neither leading, following nor "
            "stopping")
    finally:
        e._stop.set()
