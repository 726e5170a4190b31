"""The front's reply groups (protocol 1.2), called directly: no sockets, in-process
shards drained by the test, replies taken where the front sends them."""

from __future__ import annotations

import asyncio
import itertools
import time
import msgpack
import pytest

from kvmaster import _front as F
from kvmaster import _registry as R
from kvmaster import master as M
from kvmaster import protocol as P
from kvmaster.config import MasterConfig
from kvmaster.protocol import Op

SHARDS = 2
IDENTITY = b"id-1"
HELLO = [P.PROTOCOL_VERSION[0], P.PROTOCOL_VERSION[1], "c1", "default", "h", "0"]


class Front:
    def __init__(self) -> None:
        self.m = M.Master(MasterConfig(port=0, shards=SHARDS))
        self.sent: list[list[bytes]] = []
        self.m.front.send_message = lambda identity, frames: self.sent.append(list(frames))
        client = R.ClientInfo("c1", IDENTITY, "default", "h", time.monotonic())
        client.multi_reply = True
        self.m.registry.clients[IDENTITY] = client
        self.m.registry.client_ids["c1"] = IDENTITY
        self.ids = itertools.count(1)
        seed = P.tenant_seed("default")
        keys = (f"k{i}".encode() for i in itertools.count())
        #: A key on each shard.
        self.key = {}
        for k in keys:
            self.key.setdefault(P.shard_of(k, seed, SHARDS), k)
            if len(self.key) == SHARDS:
                break

    def message(self, shards: list[int]) -> list[bytes]:
        """One message of EXIST_KEY requests, one per entry of ``shards``."""
        frames = [IDENTITY]
        for s in shards:
            frames += (Op.EXIST_KEY.value, P.route_for_shard(s),
                       msgpack.packb([next(self.ids), self.key[s]], use_bin_type=True))
        return frames

    def drain(self, shard: int) -> None:
        self.m.shards[shard].drain()

    def master_op(self, op: bytes, fields: list) -> None:
        """One master-level request of the client (answered by a task: see ``step``)."""
        self.m.front.dispatch([IDENTITY, op, P.MASTER_ROUTE,
                          msgpack.packb([next(self.ids), *fields], use_bin_type=True)])

    def start_loop(self) -> asyncio.AbstractEventLoop:
        self.loop = self.m._loop = asyncio.new_event_loop()
        return self.loop

    def step(self) -> None:
        """Run the front's ready tasks once."""
        self.loop.run_until_complete(asyncio.sleep(0))

    def settle(self, rounds: int = 5) -> None:
        """Drain every shard and run the front's tasks, ``rounds`` times."""
        for _ in range(rounds):
            for s in range(SHARDS):
                self.drain(s)
            self.step()

    def replies_per_message(self) -> list[int]:
        return [len(frames) // 2 for frames in self.sent]


def test_a_group_is_sent_when_its_last_reply_is_in() -> None:
    f = Front()
    f.m.front.dispatch(f.message([0, 1, 0]))
    assert len(f.m.front.groups) == 1
    f.drain(0)
    assert f.sent == []  # shard 1 has not answered
    f.drain(1)
    assert f.replies_per_message() == [3] and not f.m.front.groups
    assert all(P.decode_reply(p)[1] == 0 for p in f.sent[0][1::2])


def test_an_old_group_is_sent_as_it_is_and_its_late_replies_go_singly() -> None:
    f = Front()
    f.m.front.dispatch(f.message([0, 1]))
    f.drain(0)
    f.m.front.expire_groups(time.monotonic() + F.REPLY_GROUP_MAX_AGE_S / 2)
    assert f.sent == [] and len(f.m.front.groups) == 1  # not old yet
    f.m.front.expire_groups(time.monotonic() + F.REPLY_GROUP_MAX_AGE_S + 1)
    assert f.replies_per_message() == [1] and not f.m.front.groups
    f.drain(1)
    assert f.replies_per_message() == [1, 1]


def test_past_the_bound_on_open_groups_replies_go_singly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "MAX_REPLY_GROUPS", 1)
    f = Front()
    f.m.front.dispatch(f.message([0, 1]))  # the one group allowed
    f.m.front.dispatch(f.message([0, 1]))  # over the bound: not grouped
    assert len(f.m.front.groups) == 1
    f.drain(0)
    f.drain(1)
    assert sorted(f.replies_per_message()) == [1, 1, 2] and not f.m.front.groups


def test_a_client_that_said_1_1_gets_one_reply_per_message() -> None:
    f = Front()
    f.m.registry.clients[IDENTITY].multi_reply = False
    f.m.front.dispatch(f.message([0, 1, 1]))
    assert not f.m.front.groups
    f.drain(0)
    f.drain(1)
    assert f.replies_per_message() == [1, 1, 1]


def test_a_request_refused_busy_is_answered_at_once_and_not_awaited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    f = Front()
    for shard in f.m.shards:
        monkeypatch.setattr(shard, "inbox_limit", 1)
    f.m.front.dispatch(f.message([0, 0, 1]))  # the second request finds shard 0's inbox full
    assert len(f.sent) == 1 and P.decode_reply(f.sent[0][1])[1] == P.Status.BUSY
    f.drain(0)
    f.drain(1)
    assert f.replies_per_message() == [1, 2] and not f.m.front.groups


def test_a_mount_that_ends_after_its_client_left_leaves_a_new_mount_of_the_name_alone() -> None:
    """MOUNT read, BYE read while the shards mount, HELLO and the same MOUNT again: the
    first mount, finding its client gone, must not unmount the second."""
    f = Front()
    loop = f.start_loop()
    try:
        f.master_op(Op.MOUNT_SEGMENT.value, ["seg-a", 1 << 20, "another-host", ""])
        f.step()  # the first mount is waiting for the shards
        f.master_op(Op.BYE.value, [])
        f.master_op(Op.HELLO.value, HELLO)
        f.master_op(Op.MOUNT_SEGMENT.value, ["seg-a", 1 << 20, "another-host", ""])
        f.step()  # the second mount is waiting too
        f.settle()
        assert not f.m.registry.tasks
        statuses = [P.decode_reply(frames[1])[1] for frames in f.sent]
        # mount 1: NOT_REGISTERED (its client left), BYE, HELLO, mount 2: OK
        assert sorted(statuses) == sorted([P.Status.NOT_REGISTERED, 0, 0, 0]), statuses
        assert f.m.registry.segments["seg-a"].owner == "c1"
        assert "seg-a" in f.m.registry.clients[IDENTITY].segments
        assert all("seg-a" in shard.segments for shard in f.m.shards)
    finally:
        loop.close()


def test_forgetting_a_client_that_left_and_came_back_leaves_the_new_registration_alone() -> None:
    """Expiry picks a client, then waits on another; meanwhile the client says BYE and
    HELLO again on the same connection.  Forgetting the old registration afterwards must
    not touch the new one (its client id, its staged session updates)."""
    f = Front()
    loop = f.start_loop()

    def gone_posts() -> int:
        return sum(1 for s in f.m.shards for env in s.inbox if env[0] == "client_gone")

    try:
        old = f.m.registry.clients[IDENTITY]  # picked by the expiry loop
        f.master_op(Op.BYE.value, [])
        f.master_op(Op.HELLO.value, HELLO)
        new = f.m.registry.clients[IDENTITY]
        assert new is not old and gone_posts() == SHARDS  # the BYE's
        assert f.m.registry.forget_now(old, unlink=True) == []
        assert f.m.registry.clients[IDENTITY] is new and f.m.registry.client_ids["c1"] == IDENTITY
        assert gone_posts() == SHARDS
        f.settle(3)  # let the BYE be answered
        assert not f.m.registry.tasks
    finally:
        loop.close()


def test_expiry_spares_a_client_that_spoke_while_another_was_being_forgotten() -> None:
    """The expiry loop picks every silent client, then forgets them one after another,
    waiting on the shards each time; one that sends a request meanwhile is alive and
    must stay registered, with its segment."""
    f = Front()
    loop = f.start_loop()
    other = b"id-2"
    late = R.ClientInfo("c2", other, "default", "h", time.monotonic())
    late.multi_reply = True
    f.m.registry.clients[other] = late
    f.m.registry.client_ids["c2"] = other
    try:
        f.master_op(Op.MOUNT_SEGMENT.value, ["seg-a", 1 << 20, "another-host", ""])
        f.settle()
        ttl = f.m.config.client_ttl
        for c in f.m.registry.clients.values():
            c.last_seen -= ttl + 1  # both silent past the TTL
        expiry = loop.create_task(f.m.registry.expire_clients(time.monotonic()))
        f.step()  # c1 (with a segment) is being forgotten: its unmount waits on the shards
        assert IDENTITY not in f.m.registry.clients and expiry.done() is False
        f.m.front.dispatch([other, Op.EXIST_KEY.value, P.route_for_shard(0),
                       msgpack.packb([next(f.ids), b"k"], use_bin_type=True)])
        f.settle()
        assert expiry.done()
        assert f.m.registry.clients.get(other) is late and f.m.registry.client_ids["c2"] == other
        assert f.m.counters["clients_expired"] == 1
    finally:
        loop.close()
