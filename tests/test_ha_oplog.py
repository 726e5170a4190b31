"""Hot standby (``--ha-oplog``) with a real etcd: a promoted standby serves the objects the
old leader held, with their exact bytes, once their segments are mounted again."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from kvmaster import Client, ClientConfig, ObjectNotFound, ReplicateConfig
from kvmaster._oplog import OpLogFollower, ShardReplica, batch_key
from kvmaster.ha import EtcdGateway
from kvmaster.protocol import Op
from tests.conftest import Etcd
from tests.test_ha import _wait_leader, _wait_leader_change


def _flags(etcd: Etcd, cluster: str, *more: str) -> tuple[str, ...]:
    return ("--ha", "--ha-oplog", "--etcd-endpoints", etcd.url, "--cluster-id", cluster,
            "--ha-lease-ttl", "2", "--shards", "2", *more)


def _addr(etcd: Etcd, cluster: str) -> str:
    return f"etcd://{etcd.url.removeprefix('http://')}/{cluster}"


def _value(key: str, n: int = 3000) -> bytes:
    seed = key.encode() + b"|"
    return (seed * (n // len(seed) + 1))[:n]


def _leader_of(masters: list[Any], etcd: Etcd, cluster: str) -> Any:
    ep = _wait_leader(etcd, cluster)
    return next(m for m in masters if m.endpoint == ep)


def test_a_promoted_standby_serves_the_old_leaders_objects(etcd, start_master) -> None:
    masters = [start_master(*_flags(etcd, "o1")) for _ in range(2)]
    leader = _leader_of(masters, etcd, "o1")
    c = Client(ClientConfig(timeout_s=2.0, connect_timeout_s=10.0))
    c.setup(_addr(etcd, "o1"), 4 << 20)
    try:
        keys = [f"k{i}" for i in range(300)]
        for k in keys:
            c.put(k, _value(k))
        removed = keys[::7]
        for k in removed:
            c.remove(k)
        time.sleep(0.3)  # several --ha-oplog-delay-ms: every record is in etcd
        old = leader.endpoint
        os.kill(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait()
        new = _wait_leader_change(etcd, "o1", old)
        assert new != old
        kept = [k for k in keys if k not in removed]
        got = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                got[kept[0]] = c.get(kept[0])
                break
            except Exception:  # noqa: BLE001 - the failover: retried until the deadline
                time.sleep(0.2)
        assert got, "the new leader never served the first key"
        for k in kept:
            assert c.get(k) == _value(k), k
        for k in removed:
            with pytest.raises(ObjectNotFound):
                c.get(k)
        # New writes land in the space the adopted objects do not use.
        for i in range(100):
            c.put(f"new{i}", _value(f"new{i}"))
        for k in kept:
            assert c.get(k) == _value(k), k
        for i in range(100):
            assert c.get(f"new{i}") == _value(f"new{i}")
    finally:
        c.close()


def test_the_log_replays_puts_frees_removals_and_unmounts() -> None:
    """ShardReplica alone: what each record kind does to the replica."""
    import msgpack

    rep = ShardReplica(0)

    def batch(table: list[str], recs: list[Any]) -> bytes:
        return msgpack.packb([1, time.time(), table, recs], use_bin_type=True)

    rep.apply(batch(["s1", "s2"], [["M", 0, 1 << 20, None], ["M", 1, 1 << 20, None],
                                   ["P", b"a", 100, [[0, 0]], 7, 0],
                                   ["P", b"b", 100, [[0, 128], [1, 0]], 8, 1],
                                   ["P", b"c", 100, [[1, 128]], 9, 0]]))
    assert set(rep.objects) == {b"a", b"b", b"c"}
    # A freed run covering a's range drops a alone.
    rep.apply(batch(["s1"], [["F", 0, 0, 128]]))
    assert set(rep.objects) == {b"b", b"c"}
    # An upsert of c moves it; the free of its old range later leaves the new one.
    rep.apply(batch(["s1", "s2"], [["P", b"c", 50, [[0, 512]], 10, 0], ["F", 1, 128, 128]]))
    assert rep.objects[b"c"][1] == [("s1", 512)]
    # Unmounting s2 takes b's replica there only.
    rep.apply(batch(["s2"], [["U", 0]]))
    assert rep.objects[b"b"][1] == [("s1", 128)]
    rep.apply(batch([], [["D", b"b"]]))
    assert set(rep.objects) == {b"c"}
    # A segment mounted again with another size loses its objects.
    rep.apply(batch(["s1"], [["M", 0, 2 << 20, None]]))
    assert rep.objects == {}
    assert rep.seq == 6


def test_a_gap_in_the_log_is_refused(etcd) -> None:
    import base64

    import msgpack

    gw = EtcdGateway([etcd.url])
    value = msgpack.packb([1, time.time(), [], []], use_bin_type=True)
    for seq in (0, 2):
        gw._post("kv/put", {"key": base64.b64encode(batch_key("g", 0, seq).encode()).decode(),
                            "value": base64.b64encode(value).decode()})
    f = OpLogFollower(gw, "g", 1)
    with pytest.raises(ValueError, match="gap"):
        f.poll()


# ------------------------------------------------------------- under load

#: What a crash may lose (kvmaster/_oplog.py): the records not yet in etcd, written at
#: most --ha-oplog-delay-ms (10 ms) plus one etcd write after the change.  Bounded here
#: generously for a loaded 2-core machine.
LOSS_WINDOW_S = 1.0
#: A put acknowledged up to this long after the kill was sent may still be the old
#: leader's answer (it was in flight, or held until its lease was renewed); a new
#: leader answers only once the old one's lease has lapsed (about 5/6 of the TTL, 2 s).
OLD_LEADER_REPLY_S = 0.5


def _load_worker(addr: str, idx: int, stop: Any, done: Any, kill_wall: Any,
                 out: Any) -> None:
    """Writes, reads and removes its own keys until ``stop``; every read is checked.
    Then checks every key it knows the state of and reports to ``out``."""
    import random as _random

    from kvmaster import Client as _Client
    from kvmaster import ClientConfig as _Config
    from kvmaster import ObjectNotFound as _NF

    rnd = _random.Random(idx)
    c = _Client(_Config(timeout_s=1.0, connect_timeout_s=15.0))
    c.setup(addr, 32 << 20)
    present: dict[str, float] = {}  # key -> wall time its put was acknowledged
    removed: dict[str, float] = {}  # key -> wall time its removal was acknowledged
    unsure: set[str] = set()  # an op whose outcome is unknown (an error): not checked
    bad: list[str] = []
    n = 0
    errors = 0
    try:
        while not stop.is_set():
            r = rnd.random()
            try:
                if r < 0.6 or not present:
                    key = f"w{idx}-{n}"
                    n += 1
                    try:
                        c.put(key, _value(key, 1000 + n * 7919 % 3000))
                    except Exception:
                        unsure.add(key)
                        raise
                    present[key] = time.time()
                elif r < 0.9:
                    key = rnd.choice(list(present))
                    try:
                        got = c.get(key)
                    except _NF:
                        continue  # (checked at the end: lost or not)
                    if got != _value(key, len(got)) or len(got) != 1000 + (
                            int(key.split("-")[1]) + 1) * 7919 % 3000:
                        bad.append(key)
                else:
                    key = rnd.choice(list(present))
                    del present[key]
                    try:
                        c.remove(key)
                    except Exception:
                        unsure.add(key)
                        raise
                    removed[key] = time.time()
            except Exception:  # noqa: BLE001 - the failover: counted, outcome unsure
                errors += 1
                time.sleep(0.05)
        kill = kill_wall.value
        lost_late: list[float] = []  # acknowledged before the kill by this much, s
        lost_after: list[str] = []  # acknowledged after the kill: never lost
        back: list[float] = []  # removals that came back: removed before the kill by, s
        checked = 0
        for key, acked in present.items():
            if key in unsure:
                continue
            try:
                got = c.get(key)
            except _NF:
                if acked < kill + OLD_LEADER_REPLY_S:  # (answered by the old leader)
                    lost_late.append(kill - acked)
                else:
                    lost_after.append(f"{key} (acknowledged {acked - kill:.3f} s after the kill)")
                continue
            checked += 1
            if got != _value(key, 1000 + (int(key.split("-")[1]) + 1) * 7919 % 3000):
                bad.append(key)
        for key, acked in removed.items():
            if key in unsure:
                continue
            try:
                got = c.get(key)
            except _NF:
                continue
            back.append(kill - acked)
            if got != _value(key, len(got)):
                bad.append(key)
        out.put({"idx": idx, "checked": checked, "bad": bad, "lost_late": lost_late,
                 "lost_after": lost_after, "back": back, "errors": errors,
                 "puts": n, "removed": len(removed)})
        done.wait(60)
    finally:
        c.close()


@pytest.mark.parametrize("scenario", ["leader-killed", "standby-killed-first",
                                      "etcd-paused", "standby-started-late"])
def test_acknowledged_objects_survive_a_leader_kill_under_load(etcd, start_master,
                                                               scenario: str) -> None:
    """Three client processes put, get and remove; the leader is SIGKILLed: every object
    whose put was acknowledged and not removed is readable with its exact bytes
    afterwards, except puts acknowledged within LOSS_WINDOW_S before the kill (counted);
    no read ever returns other bytes."""
    cluster = f"load-{scenario}"
    late = scenario == "standby-started-late"
    # Late: a leader and one standby, which snapshots often and trims the log behind
    # (so the late standby starts from a snapshot), killed before the leader.
    flags = _flags(etcd, cluster, *(("--ha-oplog-snapshot-records", "1000") if late else ()))
    masters = [start_master(*flags) for _ in range(2 if late else 3)]
    leader = _leader_of(masters, etcd, cluster)
    ctx = mp.get_context("spawn")
    stop, done = ctx.Event(), ctx.Event()
    kill_wall = ctx.Value("d", 0.0)
    out = ctx.Queue()
    workers = [ctx.Process(target=_load_worker,
                           args=(_addr(etcd, cluster), i, stop, done, kill_wall, out))
               for i in range(3)]
    for w in workers:
        w.start()
    try:
        time.sleep(3.0)
        if scenario == "standby-killed-first":
            standby = next(m for m in masters if m is not leader)
            standby.kill()
            time.sleep(1.0)
        elif scenario == "etcd-paused":
            os.kill(etcd.proc.pid, signal.SIGSTOP)
            time.sleep(0.8)
            os.kill(etcd.proc.pid, signal.SIGCONT)
            time.sleep(1.0)
        elif late:
            gw = EtcdGateway([etcd.url])
            deadline = time.monotonic() + 15
            while _count(gw, f"/kvmaster/{cluster}/oplog-snapshot/") < 4 \
                    and time.monotonic() < deadline:
                time.sleep(0.2)  # (both shards snapshotted: a head and a chunk each)
            newcomer = start_master(*flags)
            masters.append(newcomer)
            time.sleep(2.0)  # (it reads the newest snapshots and the log after them)
            assert _metrics(newcomer)["master_oplog_snapshots_loaded"] >= 1
            next(m for m in masters if m is not leader and m is not newcomer).kill()
        kill_wall.value = time.time()
        os.kill(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait()
        assert leader.proc.returncode == -signal.SIGKILL, "the leader had stopped before the kill"
        _wait_leader_change(etcd, cluster, leader.endpoint)
        time.sleep(3.0)
        stop.set()
        reports = [out.get(timeout=120) for _ in workers]
    finally:
        stop.set()
        done.set()
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    checked = sum(r["checked"] for r in reports)
    lost = [d for r in reports for d in r["lost_late"]]
    back = [d for r in reports for d in r["back"]]
    print(f"{scenario}: {checked} objects checked, {len(lost)} lost "
          f"(acknowledged from {max(lost, default=0):.3f} s before the kill to "
          f"{-min(lost, default=0):.3f} s after it, by the old leader), "
          f"{len(back)} removals came back, puts {sum(r['puts'] for r in reports)}, "
          f"errors {sum(r['errors'] for r in reports)}")
    assert not [k for r in reports for k in r["bad"]], "a read returned other bytes"
    assert not [k for r in reports for k in r["lost_after"]]
    assert checked > 300, reports
    assert all(d <= LOSS_WINDOW_S for d in lost), sorted(lost)[-5:]
    assert all(d <= LOSS_WINDOW_S for d in back), sorted(back)[-5:]
    assert len(lost) <= 0.05 * checked, (len(lost), checked)


def _count(gw: EtcdGateway, prefix: str) -> int:
    import base64

    out = gw._post("kv/range", {
        "key": base64.b64encode(prefix.encode()).decode(),
        "range_end": base64.b64encode((prefix[:-1] + chr(ord(prefix[-1]) + 1)).encode()).decode(),
        "count_only": True})
    return int(out.get("count", 0))


def test_a_standby_snapshots_and_trims_the_log_and_a_late_one_starts_from_it(
        etcd, start_master) -> None:
    cluster = "snap"
    flags = _flags(etcd, cluster, "--ha-oplog-snapshot-records", "500",
                   "--ha-oplog-max-batch", "64")
    first = start_master(*flags)
    leader = _leader_of([first], etcd, cluster)
    standby = start_master(*flags)
    gw = EtcdGateway([etcd.url])
    c = Client(ClientConfig(timeout_s=2.0, connect_timeout_s=15.0))
    c.setup(_addr(etcd, cluster), 16 << 20)
    try:
        keys = [f"s{i}" for i in range(3000)]
        for i in range(0, len(keys), 50):
            assert c.put_batch(keys[i:i + 50], [_value(k, 500) for k in keys[i:i + 50]]) \
                == [0] * 50
        for k in keys[:300]:
            c.remove(k)
        # The standby snapshots each shard and trims the log behind it.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _count(gw, f"/kvmaster/{cluster}/oplog-snapshot/") \
                < 2 + 2:  # (two heads, a chunk each at least)
            time.sleep(0.1)
        assert _count(gw, f"/kvmaster/{cluster}/oplog-snapshot/") >= 4
        # Trimmed: the first batches of each shard are gone, and fewer are left than
        # were written.
        written = c.stats()["oplog"]["oplog_batches"]
        left = _count(gw, f"/kvmaster/{cluster}/oplog/")
        assert left < written, (left, written)
        for shard in (0, 1):
            assert _count(gw, batch_key(cluster, shard, 0)) == 0
        # The standby's metrics page tells its lag and its snapshots.
        deadline = time.monotonic() + 10
        while True:  # (it follows the log a poll behind)
            page = _metrics(standby)
            if page["master_oplog_replica_objects"] == 2700 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert page["master_oplog_replica_objects"] == 2700
        assert page["master_oplog_snapshots_written"] >= 2
        assert page["master_oplog_lag_seconds"] < 5
        # The leader tells each standby's lag (ctl stats; metrics by standby).
        deadline = time.monotonic() + 10
        while True:
            ctl = subprocess.run([sys.executable, "-m", "kvmaster", "ctl", "--master",
                                  leader.addr, "stats"], capture_output=True, text=True,
                                 timeout=30, check=True)
            if f"standby {standby.endpoint}  behind 0 batches" in ctl.stdout \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert f"standby {standby.endpoint}  behind 0 batches" in ctl.stdout, ctl.stdout
        late = start_master(*flags)
        time.sleep(1.0)  # (it loads the snapshots, then follows the log)
        standby.kill()
        os.kill(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait()
        assert _wait_leader_change(etcd, cluster, leader.endpoint, timeout=20) == late.endpoint
        deadline = time.monotonic() + 20
        while True:
            try:
                assert c.get(keys[-1]) == _value(keys[-1], 500)
                break
            except (AssertionError, Exception):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for k in keys[300:]:
            assert c.get(k) == _value(k, 500), k
        for k in keys[:300]:
            with pytest.raises(ObjectNotFound):
                c.get(k)
        page = _metrics(late)
        assert page["master_oplog_adopted_objects"] == 2700
        assert page["master_oplog_records_written"] >= 1  # (the re-mount, at least)
        ctl = subprocess.run([sys.executable, "-m", "kvmaster", "ctl", "--master",
                              late.addr, "stats"], capture_output=True, text=True, timeout=30)
        assert ctl.returncode == 0, ctl.stderr
        assert "op log" in ctl.stdout and "leader" in ctl.stdout, ctl.stdout
        assert "adopted at promotion 2700" in ctl.stdout, ctl.stdout
        assert f"standby {late.endpoint}" not in ctl.stdout, ctl.stdout  # (it leads)
    finally:
        c.close()


def _metrics(m: Any) -> dict[str, float]:
    """The master's /metrics page as name -> value (unlabelled series)."""
    import urllib.request

    if not hasattr(m, "metrics_url"):
        line = m.proc.stdout.readline()
        assert "metrics on" in line, line
        m.metrics_url = line.rsplit(" ", 1)[-1].strip()
    text = urllib.request.urlopen(f"{m.metrics_url}/metrics", timeout=5).read().decode()
    out = {}
    for row in text.splitlines():
        if row and not row.startswith("#") and "{" not in row:
            name, _, value = row.partition(" ")
            out[name] = float(value)
    return out


# ------------------------------------------------ one shard actor, a real op log


class _LoggedShard:
    """One shard actor (tests/test_shard_unit.py's harness) whose op log is a real
    OpLogWriter on a real etcd, fenced by a real leader key."""

    def __init__(self, etcd: Etcd, cluster: str) -> None:
        import asyncio

        from kvmaster._oplog import OpLogWriter
        from kvmaster._shard_oplog import ShardLog
        from kvmaster.ha import leader_key
        from tests.test_shard_unit import Harness

        self.loop = asyncio.new_event_loop()
        self.h = Harness(1, eviction_high_watermark_ratio=1.0)
        self.shard = self.h.shards[0]
        gw = EtcdGateway([etcd.url])
        lease = gw.grant(30)
        assert gw.create(leader_key(cluster), "me", lease)
        self.fenced: list[str] = []
        self.writer = OpLogWriter(gw, cluster, lease, [0], self.loop,
                                  on_durable=lambda i, seq: self.shard.log.durable(seq),
                                  on_fenced=self.fenced.append, delay_s=0.01)
        self.shard.log = ShardLog(self.shard, self.writer)
        self.follower = OpLogFollower(gw, cluster, 1)

    def settle(self) -> None:
        """Let the writer's batches reach etcd and their durable callbacks run, then
        handle what they put back in the inbox."""
        self.loop.run_until_complete(__import__("asyncio").sleep(0.3))
        self.h.run()

    def send(self, op: Op, key_for_route: bytes, *fields: Any) -> int:
        """Deliver a request and handle it; -> its id (its reply may come later)."""
        import msgpack

        h = self.h
        h.req += 1
        payload = msgpack.packb([h.req, *fields], use_bin_type=True)
        assert self.shard.deliver((op.value, payload, h.client))
        h.run()
        return h.req

    def close(self) -> None:
        self.writer.stop()
        self.loop.close()


def test_a_freed_range_is_reused_only_once_its_record_is_durable(etcd) -> None:
    t = _LoggedShard(etcd, "held")
    try:
        h, shard = t.h, t.shard
        h.mount("seg", 4 * 4096)
        for k in (b"a", b"b", b"c", b"d"):
            assert h.put(k, 4096) == 0
        assert h.call(Op.REMOVE, b"a", b"a", True)[0] == 0
        seg = shard.segments["seg"]
        # Not durable yet: the space is still allocated; a put that needs it waits.
        assert seg.alloc.used == 4 * 4096 and shard.log.held_bytes == 4096
        req = t.send(Op.PUT_START, b"e", b"e", 4096, None)
        assert req not in h.replies and shard.counters["starts_parked_for_oplog"] == 1
        assert not shard.check_consistency()
        t.settle()
        assert h.replies.pop(req)[0] == 0  # (in a's range, given back)
        assert h.call(Op.PUT_END, b"e", b"e")[0] == 0
        assert shard.log.held_bytes == 0 and seg.alloc.used == 4 * 4096
        assert set(shard.objects) == {b"b", b"c", b"d", b"e"}
        assert not shard.check_consistency()
        t.settle()
        # What a standby rebuilds from the log: b, c, d and e where the shard has them.
        t.follower.poll()
        rep = t.follower.replicas[0]
        want = {ck: [o.size, [(s.name, off) for s, off in o.replicas()], o.checksum,
                     o.flags] for ck, o in shard.objects.items()}
        assert rep.objects == want
        assert not t.fenced
    finally:
        t.close()


def test_a_write_that_needs_eviction_waits_for_the_freed_space(etcd) -> None:
    t = _LoggedShard(etcd, "evict")
    try:
        h, shard = t.h, t.shard
        h.mount("seg", 8 * 4096)
        for i in range(8):
            assert h.put(b"o%d" % i, 4096) == 0
        # Full: the start evicts the oldest object, whose space is held until its
        # record is durable, and waits for it rather than evicting more.
        req = t.send(Op.BATCH_PUT_START, b"new", [b"new"], [4096], None)
        assert req not in h.replies and len(shard.objects) == 7
        t.settle()
        assert h.replies.pop(req)[0] == 0 and len(shard.objects) == 7
        assert not shard.check_consistency()
        # A batch of keys stored already takes no space: answered at once.
        req = t.send(Op.BATCH_PUT_START, b"o7", [b"o7"], [4096], None)
        assert h.replies.pop(req)[0] == 0
        assert shard.counters["starts_parked_for_oplog"] == 1
    finally:
        t.close()


def test_adoption_reserves_ranges_and_a_later_write_of_the_key_wins() -> None:
    from kvmaster._shard_oplog import Adoption
    from tests.test_shard_unit import Harness

    rep = ShardReplica(0)
    rep.segments = {"seg": (1 << 20, None), "other": (1 << 20, None)}
    rep.objects = {b"a": [100, [("seg", 0)], 11, 0], b"b": [100, [("seg", 128)], 12, 1],
                   b"c": [100, [("other", 0)], 13, 0]}
    h = Harness(1)
    shard = h.shards[0]
    shard.adoption = Adoption(rep, deadline=1e18)
    # A write of b since the promotion, in a segment of the new leader: it has the last word.
    h.mount("fresh", 1 << 20)
    assert h.put(b"b", 50) == 0
    h.mount("seg", 1 << 20)
    assert set(shard.objects) == {b"a", b"b"}
    assert shard.objects[b"a"].checksum == 11 and shard.objects[b"a"].seg.name == "seg"
    assert shard.objects[b"b"].size == 50 and shard.objects[b"b"].seg.name == "fresh"
    assert shard.adoption.status()["dropped"] == 1
    assert not shard.check_consistency()
    # a's range is not handed out again.
    seg = shard.segments["seg"]
    assert seg.alloc.used == 128
    for i in range(8):
        st, body = h.call(Op.PUT_START, b"x%d" % i, b"x%d" % i, 100,
                          [1, False, 0, None, ["seg"]])
        assert st == 0 and body[0] == ["seg", body[0][1]] and body[0][1] != 0
    # "other" comes back with another size: its object is dropped.
    h.mount("other", 2 << 20)
    assert b"c" not in shard.objects
    assert shard.adoption.status()["dropped"] == 2


def test_after_an_adoption_the_log_says_what_the_new_leader_holds(etcd) -> None:
    """Keys not adopted when their segment came back (written again since the promotion,
    a write of them in progress, removed while waiting) are recorded so, so that a
    standby of the new leader never believes their old ranges are theirs."""
    import copy

    from kvmaster._shard_oplog import Adoption

    t = _LoggedShard(etcd, "after")
    try:
        h, shard = t.h, t.shard
        rep = ShardReplica(0)
        rep.segments = {"seg": (1 << 20, None)}
        rep.objects = {k: [100, [("seg", i * 128)], 10 + i, 0]
                       for i, k in enumerate((b"a", b"b", b"c", b"d"))}
        # The standby of the new leader starts where the old log ended (same replica).
        follower = t.follower
        follower.replicas[0] = copy.deepcopy(rep)
        follower.replicas[0]._at = {"seg": {i * 128: k for i, k in
                                            enumerate((b"a", b"b", b"c", b"d"))}}
        shard.adoption = Adoption(rep, deadline=1e18)
        h.mount("fresh", 1 << 20)
        assert h.put(b"b", 50) == 0  # written again since the promotion
        assert h.call(Op.REMOVE, b"c", b"c", False)[0] == 0  # removed while waiting
        st, _ = h.call(Op.PUT_START, b"d", b"d", 100, [1, False, 0, None, ["fresh"]])
        assert st == 0  # a write of d in progress when seg comes back
        h.mount("seg", 1 << 20)
        assert set(shard.objects) == {b"a", b"b"}
        assert h.call(Op.PUT_REVOKE, b"d", b"d")[0] == 0
        assert not shard.check_consistency()
        t.settle()
        follower.poll()
        got = follower.replicas[0].objects
        want = {ck: [o.size, [(s.name, off) for s, off in o.replicas()], o.checksum,
                     o.flags] for ck, o in shard.objects.items()}
        assert got == want
        assert got[b"a"][1] == [("seg", 0)] and got[b"b"][1][0][0] == "fresh"
    finally:
        t.close()


def _put_batch(gw: EtcdGateway, cid: str, seq: int, table: list[str], recs: list[Any]) -> None:
    """Write batch ``seq`` of shard 0 as a leader would (without the fence)."""
    import base64

    import msgpack

    value = msgpack.packb([1, time.time(), table, recs], use_bin_type=True)
    gw._post("kv/put", {"key": base64.b64encode(batch_key(cid, 0, seq).encode()).decode(),
                        "value": base64.b64encode(value).decode()})


def test_a_follower_behind_a_snapshot_of_an_idle_log_catches_up_from_it(etcd) -> None:
    """A follower whose next batches were trimmed behind another's snapshot, with no
    batch written since, still finds the snapshot (at the latest when it catches up to
    lead), instead of taking the log's end for where it stands."""
    cid = "stale"
    gw = EtcdGateway([etcd.url])
    a = OpLogFollower(gw, cid, 1, snapshot_records=1)
    b = OpLogFollower(gw, cid, 1, snapshot_records=1)
    _put_batch(gw, cid, 0, ["s1"], [["M", 0, 1 << 20, None], ["P", b"a", 100, [[0, 0]], 7, 0]])
    a.poll()
    b.poll()
    _put_batch(gw, cid, 1, ["s1"], [["F", 0, 0, 128]])
    a.poll()
    a.write_snapshot(a.replicas[0])  # snapshot at 2; batches 0 and 1 trimmed
    reps = b.catch_up()
    assert reps[0].seq == 2 and b"a" not in reps[0].objects


def test_two_standbys_snapshotting_the_same_batch_leave_one_readable_snapshot(etcd) -> None:
    cid = "twosnap"
    gw = EtcdGateway([etcd.url])
    for seq in range(3):
        _put_batch(gw, cid, seq, ["s1"], [["M", 0, 1 << 20, None]] * (seq == 0) +
                   [["P", b"k%d-%d" % (seq, i), 100, [[0, (seq * 10 + i) * 128]], i, 0]
                    for i in range(10)])
    a = OpLogFollower(gw, cid, 1, snapshot_records=1)
    b = OpLogFollower(EtcdGateway([etcd.url]), cid, 1, snapshot_records=1)
    a.poll()
    b.poll()
    real = b.gw._post
    interleaved: list[int] = []

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        out = real(path, body)
        if path == "kv/range" and not interleaved:  # b has read the head: a writes first
            interleaved.append(1)
            a.write_snapshot(a.replicas[0])
        return out

    b.gw._post = post  # type: ignore[method-assign]
    b.write_snapshot(b.replicas[0])
    assert interleaved and a.snapshots_written == 1 and b.snapshots_written == 0
    late = OpLogFollower(gw, cid, 1)
    late.poll(check_heads=True)
    assert late.replicas[0].seq == 3 and late.replicas[0].objects == a.replicas[0].objects
    assert len(late.replicas[0].objects) == 30


def test_puts_under_memory_pressure_wait_for_the_log_instead_of_failing(etcd,
                                                                      start_master) -> None:
    """A full cache with --ha-oplog: writes whose space eviction frees wait an etcd write
    for it (their starts are parked), and succeed as without the op log."""
    m = start_master(*_flags(etcd, "pressure"))
    _wait_leader(etcd, "pressure")
    c = Client(ClientConfig(timeout_s=5.0, connect_timeout_s=10.0))
    c.setup(_addr(etcd, "pressure"), 1 << 20)
    try:
        failed = 0
        for b in range(200):
            keys = [f"p{b}-{i}" for i in range(16)]
            got = c.put_batch(keys, [_value(k, 8000) for k in keys])
            failed += sum(1 for r in got if r)
        for i in range(300):
            try:
                c.put(f"one{i}", _value(f"one{i}", 8000))
            except Exception:  # noqa: BLE001 - counted
                failed += 1
        stats = c.stats()
        print(f"under pressure: {failed} of 3,500 writes failed, "
              f"{stats['starts_parked_for_oplog']} starts waited for the log, "
              f"{stats['evicted_keys']} keys evicted")
        assert failed == 0
        assert stats["starts_parked_for_oplog"] > 0 and stats["evicted_keys"] > 3000
        assert c.check_consistency() == []
    finally:
        c.close()
    assert m.proc.poll() is None


def test_a_clean_stop_right_after_writes_hands_every_object_over(etcd, start_master) -> None:
    masters = [start_master(*_flags(etcd, "clean", "--ha-oplog-delay-ms", "500"))
               for _ in range(2)]
    leader = _leader_of(masters, etcd, "clean")
    c = Client(ClientConfig(timeout_s=2.0, connect_timeout_s=15.0))
    c.setup(_addr(etcd, "clean"), 8 << 20)
    try:
        keys = [f"c{i}" for i in range(512)]
        assert c.put_batch(keys, [_value(k, 1000) for k in keys]) == [0] * 512
        # Stopped at once: the records still wait for their 500 ms flush.
        assert leader.stop() == 0
        _wait_leader_change(etcd, "clean", leader.endpoint)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert c.get(keys[0]) == _value(keys[0], 1000)
                break
            except Exception:  # the handover: retried until the deadline
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert [c.get(k) for k in keys] == [_value(k, 1000) for k in keys]
    finally:
        c.close()


def _kill_leader(masters: list[Any], etcd: Etcd, cluster: str) -> str:
    ep = _wait_leader(etcd, cluster)
    m = next(m for m in masters if m.endpoint == ep)
    os.kill(m.proc.pid, signal.SIGKILL)
    m.proc.wait()
    masters.remove(m)
    return _wait_leader_change(etcd, cluster, ep)


def _retry(fn: Any, timeout: float = 20.0) -> Any:
    """``fn()`` until it answers (a failover under way), at most ``timeout`` s; a miss
    is an answer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except ObjectNotFound:
            raise
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.parametrize("checksums", [True, False])
def test_a_second_failover_keeps_what_the_second_leader_held(etcd, start_master,
                                                             checksums: bool) -> None:
    """X is stored, then the leader killed; on the second leader a write of X is in
    progress when X's segment comes back (so X is not adopted), then revoked, and Y lands
    in X's old range; the second leader killed: the third serves Y, and never X with Y's
    bytes (checksums on or off)."""
    cluster = f"twice{int(checksums)}"
    masters = [start_master(*_flags(etcd, cluster, "--shards", "1")) for _ in range(3)]
    _wait_leader(etcd, cluster)
    a = Client(ClientConfig(timeout_s=2.0, connect_timeout_s=10.0, write_checksums=checksums))
    a.setup(_addr(etcd, cluster), 1 << 20)
    b = None
    try:
        a.put("X", b"X" * 3000)
        time.sleep(1.5)
        _kill_leader(masters, etcd, cluster)
        b = Client(ClientConfig(timeout_s=2.0, connect_timeout_s=20.0))
        _retry(lambda: b.setup(_addr(etcd, cluster), 1 << 20))
        pending = _retry(lambda: b.batch_put_start(["X"], [3000]))
        assert pending.status == [0]
        _retry(lambda: a.is_exist("Y"))  # a's segment is mounted again
        b.batch_put_revoke(pending, [0])
        b.close()
        b = None
        with pytest.raises(ObjectNotFound):
            a.get("X")
        a.put("Y", b"Y" * 4000, ReplicateConfig(preferred_segments=[a.segment_name]))
        time.sleep(1.5)
        _kill_leader(masters, etcd, cluster)
        assert _retry(lambda: a.get("Y")) == b"Y" * 4000
        with pytest.raises(ObjectNotFound):
            a.get("X")
        assert a.check_consistency() == []
    finally:
        if b is not None:
            b.close()
        a.close()
