"""Malformed and hostile input over a raw DEALER socket.

Every bad message gets a reply with the right status and a one-line message
(never silence, never a crash), and afterwards the master serves a normal
client as before with no state changed.
"""

from __future__ import annotations

import collections
import itertools
import os
from typing import Any

import msgpack
import pytest
import zmq

from kvmaster import InvalidParams, Status
from kvmaster import protocol as P
from kvmaster.protocol import Op

SHARDS = 4
MAX_BATCH = 16
SEED = P.tenant_seed("default")


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def shard(key: bytes) -> int:
    return P.shard_of(key, SEED, SHARDS)


def route(key: bytes) -> bytes:
    return P.route_for_shard(shard(key))


def keys_on_shard(index: int, n: int) -> list[bytes]:
    gen = (f"k{i}".encode() for i in itertools.count())
    return list(itertools.islice((k for k in gen if shard(k) == index), n))


class Raw:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ids = itertools.count(100)
        self.stash: collections.deque[tuple[bytes, bytes]] = collections.deque()
        #: Replies per message received, in order (protocol 1.2 allows several).
        self.messages: list[int] = []

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def reply(self, timeout: float = 5) -> tuple[bytes, int, int, Any]:
        """-> (op frame, req_id, status, body); fails if nothing arrives in time."""
        if not self.stash:
            assert self.sock.poll(timeout * 1000), "no reply: the master went silent"
            frames = self.sock.recv_multipart()
            assert len(frames) >= 2 and not len(frames) & 1, frames
            self.messages.append(len(frames) // 2)
            self.stash.extend(zip(frames[::2], frames[1::2]))
        op, payload = self.stash.popleft()
        req_id, status, body = P.decode_reply(payload)
        return op, req_id, status, body

    def ask(self, op: bytes, rte: bytes, fields: list[Any] | None = None,
            payload: bytes | None = None) -> tuple[int, int, Any]:
        """Send one request; -> (req_id echoed, status, body)."""
        if payload is None:
            payload = packb([next(self.ids), *(fields or [])])
        self.send(op, rte, payload)
        rop, req_id, status, body = self.reply()
        assert rop == op
        return req_id, status, body

    def hello(self, major: int = P.PROTOCOL_VERSION[0], client_id: str = "raw",
              minor: int = P.PROTOCOL_VERSION[1]) -> tuple[int, Any]:
        _, status, body = self.ask(Op.HELLO.value, P.MASTER_ROUTE,
                                   [major, minor, client_id, "default", "h", "0"])
        return status, body

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def refused(result: tuple[int, int, Any], status: int) -> None:
    """The reply has ``status`` and a one-line, non-empty message."""
    _, got, body = result
    assert got == status, (got, body)
    assert isinstance(body, str) and body and "\n" not in body, body


@pytest.fixture
def setup(start_master, make_client):
    m = start_master("--shards", str(SHARDS), "--max-batch", str(MAX_BATCH))
    c = make_client(m, segment_bytes=16 << 20)
    values = {f"good-{i}": os.urandom(1000 + i) for i in range(12)}
    assert c.put_batch(list(values), list(values.values())) == [0] * 12
    before = c.stats()
    raws: list[Raw] = []

    def raw() -> Raw:
        r = Raw(m.endpoint)
        raws.append(r)
        return r

    yield m, c, raw
    for r in raws:
        r.close()
    # Nothing the bad input did changed the store, and it still serves.
    after = c.stats()
    for k in ("keys", "allocated_bytes", "pending_writes", "segments", "evicted_keys"):
        assert after[k] == before[k], k
    assert c.get_batch(list(values)) == list(values.values())
    v = os.urandom(1 << 20)
    c.put("after-bad-input", v)
    assert c.get("after-bad-input") == v
    c.remove("after-bad-input", force=True)


def test_malformed_frame_counts(setup) -> None:
    _, _, raw = setup
    r = raw()
    payload = packb([7])
    for frames in ([Op.STATS.value], [Op.STATS.value, payload],
                   [Op.STATS.value, b"", payload, b"extra"],
                   [b"\x10", b"\x00\x00", payload, b"", b""], [b""]):
        r.send(*frames)
        _, _, status, body = r.reply()
        assert status == Status.INVALID_PARAMS, frames
        assert isinstance(body, str) and "frames" in body and "\n" not in body


def test_several_requests_in_one_message(setup) -> None:
    """Protocol 1.2: ``[op, route, payload]`` repeated in one message.  Each request is
    handled as if alone (a bad one is refused without touching the others) and
    answered by its own reply; the replies of the routed requests the shards took
    come back in one message, to a client whose HELLO said 1.2 (one message each
    to a 1.1 client); more than 64 in one message are all refused, and the master
    keeps serving."""
    _, c, raw = setup
    r = raw()
    status, welcome = r.hello()
    assert status == 0 and tuple(welcome["protocol"]) >= (1, 2)
    good = [f"good-{i}".encode() for i in range(12)]
    before = c.stats()["front"]
    frames: list[bytes] = []
    want: dict[int, tuple[bytes, int, Any]] = {}

    def add(op: bytes, rte: bytes, fields: list[Any], status: int, body: Any = None) -> None:
        req_id = next(r.ids)
        frames.extend((op, rte, packb([req_id, *fields])))
        want[req_id] = (op, status, body)

    for k in good[:4]:
        add(Op.EXIST_KEY.value, route(k), [k], 0, True)
    add(Op.EXIST_KEY.value, route(b"nope"), [b"nope"], 0, False)
    add(Op.EXIST_KEY.value, P.route_for_shard(SHARDS), [good[0]], Status.INVALID_PARAMS)
    add(b"\x7f", b"", [1], Status.UNSUPPORTED)
    add(Op.BATCH_EXIST_KEY.value, route(good[5]), [[good[5]]], 0, [1])
    add(Op.GET_CONFIG.value, P.MASTER_ROUTE, [], 0)
    r.messages.clear()
    r.send(*frames)
    got = {}
    for _ in want:
        rop, req_id, status, body = r.reply()
        got[req_id] = (rop, status, body)
    assert set(got) == set(want)
    # six routed requests in one reply message; the bad route, the unknown op and
    # GET_CONFIG (answered by the front) one by one
    assert sorted(r.messages) == [1, 1, 1, 6], r.messages
    for req_id, (op, status, body) in want.items():
        assert got[req_id][:2] == (op, status), (req_id, got[req_id])
        if status:
            assert isinstance(got[req_id][2], str) and "\n" not in got[req_id][2]
        elif body is not None:
            assert bool(got[req_id][2]) == body if isinstance(body, bool) else got[req_id][2] == body

    def many(n: int) -> list[bytes]:
        out: list[bytes] = []
        for i in range(n):
            k = good[i % len(good)]
            out += (Op.EXIST_KEY.value, route(k), packb([next(r.ids), k]))
        return out

    r.messages.clear()
    r.send(*many(P.MAX_REQUESTS_PER_MESSAGE))
    replies = [r.reply() for _ in range(P.MAX_REQUESTS_PER_MESSAGE)]
    assert [(rep[2], bool(rep[3])) for rep in replies] == [(0, True)] * P.MAX_REQUESTS_PER_MESSAGE
    assert r.messages == [P.MAX_REQUESTS_PER_MESSAGE]
    over = P.MAX_REQUESTS_PER_MESSAGE + 1
    r.send(*many(over))
    # one answer for the whole message: a reply per request would let a message of
    # millions of empty frames cost as many replies
    _, _, status, body = r.reply()
    assert status == Status.INVALID_PARAMS and "at most 64 requests" in body
    assert not r.sock.poll(200), "one reply for the refused message, no more"
    # A client that said 1.1 may send several requests but gets one reply per message.
    old = raw()
    assert old.hello(client_id="raw-1.1", minor=1)[0] == 0
    old.messages.clear()
    old.send(*[f for k in good[:3]
               for f in (Op.EXIST_KEY.value, route(k), packb([next(old.ids), k]))])
    assert [old.reply()[2] for _ in range(3)] == [0, 0, 0] and old.messages == [1, 1, 1]
    # So does a 1.2 client whose message says HELLO 1.1 before its requests.
    r.messages.clear()
    hello = packb([next(r.ids), 1, 1, "raw", "default", "h", "0"])
    r.send(Op.HELLO.value, b"", hello,
           *[f for k in good[:3] for f in (Op.EXIST_KEY.value, route(k), packb([next(r.ids), k]))])
    assert [r.reply()[2] for _ in range(4)] == [0] * 4 and r.messages == [1, 1, 1, 1]
    front = c.stats()["front"]
    # The 65-request message counts as malformed, not as carrying several requests;
    # so do the bad route and the unknown op of the first message.
    assert front["multi_request_messages"] - before["multi_request_messages"] == 4
    assert front["malformed"] - before["malformed"] == 3


def test_requests_after_bye_find_the_client_gone_and_a_new_hello_stands(setup) -> None:
    """BYE takes effect when the master reads it: a request the connection sends after
    it (in the same message or the next) is NOT_REGISTERED, and a HELLO after it
    registers the connection anew, which the BYE's unmounting, still going on, does
    not undo; the same segment can be mounted again at once."""
    _, c, raw = setup
    r = raw()
    assert r.hello()[0] == 0
    seg = f"kvm-bye-{os.getpid()}"
    mount = [seg, 1 << 20, "another-host", ""]
    assert r.ask(Op.MOUNT_SEGMENT.value, P.MASTER_ROUTE, mount)[1] == 0
    key = b"good-0"
    hello = [P.PROTOCOL_VERSION[0], P.PROTOCOL_VERSION[1], "raw", "default", "h", "0"]
    sent: dict[int, bytes] = {}

    def request(op: bytes, rte: bytes, fields: list[Any]) -> list[bytes]:
        req_id = next(r.ids)
        sent[req_id] = op
        return [op, rte, packb([req_id, *fields])]

    def replies() -> list[tuple[bytes, int, Any]]:
        got = {}
        for _ in range(len(sent)):
            op, req_id, status, body = r.reply()
            got[req_id] = (op, status, body)
        out = [got[i] for i in sorted(sent)]
        sent.clear()
        return out

    # In one message: BYE, a request, HELLO, the request again, the segment again.
    r.send(*request(Op.BYE.value, P.MASTER_ROUTE, []),
           *request(Op.EXIST_KEY.value, route(key), [key]),
           *request(Op.HELLO.value, P.MASTER_ROUTE, hello),
           *request(Op.EXIST_KEY.value, route(key), [key]),
           *request(Op.MOUNT_SEGMENT.value, P.MASTER_ROUTE, mount))
    bye, before_hello, hello_r, after_hello, remount = replies()
    assert bye[1] == 0
    assert before_hello[1] == Status.NOT_REGISTERED, before_hello
    assert hello_r[1] == 0 and after_hello[1:] == (0, True), (hello_r, after_hello)
    assert remount[1] == 0, remount
    # The registration and the new mount stand once the BYE's work is done.
    assert r.ask(Op.EXIST_KEY.value, route(key), [key])[1:] == (0, True)
    segs = [s for s in c.list_segments() if s["name"] == seg]
    assert len(segs) == 1 and segs[0]["owner"] == "raw", segs
    # The same in separate messages sent without waiting for any reply.
    for op, rte, fields in ((Op.BYE.value, P.MASTER_ROUTE, []),
                            (Op.HELLO.value, P.MASTER_ROUTE, hello),
                            (Op.EXIST_KEY.value, route(key), [key])):
        r.send(*request(op, rte, fields))
    assert [rep[1] for rep in replies()] == [0, 0, 0]
    assert r.ask(Op.EXIST_KEY.value, route(key), [key])[1:] == (0, True)
    # The BYE unmounted the segment; the fixture checks the store is as it was.
    assert not [s for s in c.list_segments() if s["name"] == seg]
    assert r.ask(Op.BYE.value, P.MASTER_ROUTE, [])[1] == 0


def test_a_reply_is_not_held_behind_a_slow_request(start_master, make_client) -> None:
    """A fast request's reply goes out before a slow request read with it is done (a
    shard process sends the replies it holds before any request that is not short:
    here a REMOVE_ALL scanning 200,000 objects of another tenant)."""
    m = start_master("--shards", "1", "--max-batch", "50000")
    c = make_client(m, segment_bytes=32 << 20)
    keys = [f"k{i}" for i in range(200_000)]
    for i in range(0, len(keys), 50_000):
        assert c.put_batch(keys[i:i + 50_000], [b"x"] * 50_000) == [0] * 50_000
    r = Raw(m.endpoint)
    try:
        _, status, _ = r.ask(Op.HELLO.value, P.MASTER_ROUTE, [1, 1, "slow", "other", "h", "0"])
        assert status == 0
        rte = P.route_for_shard(0)
        for _ in range(3):
            # one message, read in one pass: the shard gets both in one envelope message
            r.send(Op.EXIST_KEY.value, rte, packb([next(r.ids), b"k1"]),
                   Op.REMOVE_ALL.value, rte, packb([next(r.ids), False]))
            op, _, status, _ = r.reply()
            assert (op, status) == (Op.EXIST_KEY.value, 0)
            assert not r.sock.poll(5), "the fast reply came with the slow one"
            op, _, status, body = r.reply(30)
            assert (op, status, body) == (Op.REMOVE_ALL.value, 0, 0)
    finally:
        r.close()


def test_empty_and_unknown_ops(setup) -> None:
    _, _, raw = setup
    r = raw()
    refused(r.ask(b"", b"", [1]), Status.UNSUPPORTED)
    refused(r.ask(b"\x7f", b"", [1]), Status.UNSUPPORTED)
    refused(r.ask(b"\x10\x10", b"", [1]), Status.UNSUPPORTED)  # op frames are one byte
    assert r.hello()[0] == 0
    refused(r.ask(b"\x7f", P.route_for_shard(0), [1]), Status.UNSUPPORTED)
    refused(r.ask(b"", P.route_for_shard(1), [1]), Status.UNSUPPORTED)
    # A shard op without a route, a master op with one.
    refused(r.ask(Op.EXIST_KEY.value, b"", [b"good-1"]), Status.UNSUPPORTED)
    refused(r.ask(Op.STATS.value, P.route_for_shard(0), []), Status.UNSUPPORTED)


def test_requests_before_hello_are_not_registered(setup) -> None:
    _, _, raw = setup
    r = raw()
    for op, rte, fields in ((Op.STATS, b"", []), (Op.HEARTBEAT, b"", []),
                            (Op.MOUNT_SEGMENT, b"", ["kvmaster-x", 1 << 20, "h", "shm"]),
                            (Op.EXIST_KEY, route(b"good-1"), [b"good-1"]),
                            (Op.REMOVE, route(b"good-1"), [b"good-1", True]),
                            (Op.REMOVE_ALL, P.route_for_shard(0), [True])):
        req_id, status, body = r.ask(op.value, rte, fields)
        refused((req_id, status, body), Status.NOT_REGISTERED)
        assert req_id >= 100  # the request id is echoed
    # Even an undecodable payload on a shard route gets an answer.
    refused(r.ask(Op.EXIST_KEY.value, P.route_for_shard(0), payload=b"\xc1"),
            Status.NOT_REGISTERED)


def test_wrong_protocol_major(setup) -> None:
    _, _, raw = setup
    r = raw()
    status, body = r.hello(major=P.PROTOCOL_VERSION[0] + 1)
    assert status == Status.VERSION_MISMATCH
    assert isinstance(body, str) and "protocol" in body and "\n" not in body
    status, _ = r.hello(major=0)
    assert status == Status.VERSION_MISMATCH
    # A refused HELLO registers nothing.
    refused(r.ask(Op.STATS.value, b"", []), Status.NOT_REGISTERED)


def test_non_msgpack_payloads(setup) -> None:
    _, _, raw = setup
    r = raw()
    for payload in (b"", b"\xc1", b"\x93\x01", b"not msgpack at all", os.urandom(64),
                    b"\xdb\xff\xff\xff\xff" + b"x" * 10):
        refused(r.ask(Op.HELLO.value, b"", payload=payload), Status.INVALID_PARAMS)
    assert r.hello()[0] == 0
    big = packb([1, b"x" * (2 << 20)])  # beyond the decoder's bounds
    for payload in (b"\xc1", b"\x92\x01", os.urandom(100), big):
        refused(r.ask(Op.EXIST_KEY.value, P.route_for_shard(0), payload=payload),
                Status.INVALID_PARAMS)
        refused(r.ask(Op.STATS.value, b"", payload=payload), Status.INVALID_PARAMS)


def test_wrong_field_types(setup) -> None:
    _, _, raw = setup
    r = raw()
    # HELLO itself: wrong types, missing fields, NUL in strings.
    hello = Op.HELLO.value
    refused(r.ask(hello, b"", [1, 0, 42, "default", "h", "0"]), Status.INVALID_PARAMS)
    refused(r.ask(hello, b"", [1, 0, "c"]), Status.INVALID_PARAMS)
    refused(r.ask(hello, b"", [1, 0, "c", "ten\x00ant", "h", "0"]), Status.INVALID_PARAMS)
    refused(r.ask(hello, b"", ["1", 0, "c", "default", "h", "0"]), Status.INVALID_PARAMS)
    assert r.hello()[0] == 0

    k = b"good-1"
    rk = route(k)
    cases: list[tuple[Op, list[Any]]] = [
        (Op.EXIST_KEY, ["good-1"]),  # str, not bin
        (Op.EXIST_KEY, [None]),
        (Op.EXIST_KEY, []),  # missing field
        (Op.GET_REPLICA_LIST, [[k]]),
        (Op.REMOVE, [k, 1]),  # int, not bool
        (Op.REMOVE, [k]),
        (Op.PUT_START, [b"new", "10", None]),
        (Op.PUT_START, [b"new", 0, None]),
        (Op.PUT_START, [b"new", -5, None]),
        (Op.PUT_START, [b"new", 1 << 50, None]),
        (Op.PUT_START, [b"new", 10, "config"]),
        (Op.PUT_START, [b"new", 10, [0]]),  # replica_num 0
        (Op.PUT_START, [b"new", 10, [1, "yes"]]),
        (Op.PUT_START, [b"new", 10, [1, False, 7]]),  # no such soft pin action
        (Op.PUT_START, [b"new", 10, [1, False, 0, 1000]]),  # TTL without ENABLE
        (Op.PUT_START, [b"new", 10, [1, False, 1, 0]]),
        (Op.PUT_START, [b"new", 10, [1, False, 0, None, "seg"]]),
        (Op.BATCH_EXIST_KEY, [k]),  # not a list
        (Op.BATCH_EXIST_KEY, [[k, "s"]]),
        (Op.BATCH_PUT_START, [[k], [10, 20], None]),  # lengths differ
        (Op.BATCH_PUT_START, [[k], [0], None]),
        (Op.BATCH_REMOVE, [[k], "true"]),
        (Op.REMOVE_ALL, [1]),
    ]
    for op, fields in cases:
        refused(r.ask(op.value, rk, fields), Status.INVALID_PARAMS)
    # Payload shapes: not an array, empty, bad request id.
    for payload in (packb({"req": 1}), packb([]), packb([-1, k]), packb(["1", k]),
                    packb([1 << 64 - 1, k]), packb(7)):
        refused(r.ask(Op.EXIST_KEY.value, rk, payload=payload), Status.INVALID_PARAMS)
    req_id, status, _ = r.ask(Op.EXIST_KEY.value, rk, payload=packb([4242]))
    assert (req_id, status) == (4242, Status.INVALID_PARAMS)  # decodable id is echoed
    refused(r.ask(Op.MOUNT_SEGMENT.value, b"", ["kvmaster-x", "big", "h", "shm"]),
            Status.INVALID_PARAMS)
    refused(r.ask(Op.MOUNT_SEGMENT.value, b"", ["", 1 << 20, "h", "shm"]), Status.INVALID_PARAMS)


def test_bad_keys(setup) -> None:
    _, c, raw = setup
    r = raw()
    assert r.hello()[0] == 0
    for key in (b"x" * 4097, b"nul\x00key", b"\x00", b""):
        rk = P.route_for_shard(shard(key))
        refused(r.ask(Op.EXIST_KEY.value, rk, [key]), Status.INVALID_PARAMS)
        refused(r.ask(Op.PUT_START.value, rk, [key, 10, None]), Status.INVALID_PARAMS)
        refused(r.ask(Op.BATCH_REMOVE.value, rk, [[key], True]), Status.INVALID_PARAMS)
    # The same through the client API.
    for key in ("x" * 4097, "nul\x00key", ""):
        with pytest.raises(InvalidParams):
            c.put(key, b"v")
        with pytest.raises(InvalidParams):
            c.get(key)
    # A key of exactly the limit is fine.
    longest = "y" * 4096
    c.put(longest, b"v")
    assert c.is_exist(longest) and c.get_size(longest) == 1  # (no lease, unlike get)
    c.remove(longest)


def test_batch_over_max_batch(setup) -> None:
    _, c, raw = setup
    r = raw()
    assert r.hello()[0] == 0
    ks = keys_on_shard(0, MAX_BATCH + 1)
    rk = P.route_for_shard(0)
    _, status, body = r.ask(Op.BATCH_EXIST_KEY.value, rk, [ks[:MAX_BATCH]])
    assert status == 0 and body == [0] * MAX_BATCH
    for op, fields in ((Op.BATCH_EXIST_KEY, [ks]), (Op.BATCH_GET_REPLICA_LIST, [ks]),
                       (Op.BATCH_REMOVE, [ks, True]),
                       (Op.BATCH_PUT_START, [ks, [10] * len(ks), None]),
                       (Op.BATCH_PUT_END, [ks]), (Op.BATCH_PUT_REVOKE, [ks])):
        refused(r.ask(op.value, rk, fields), Status.INVALID_PARAMS)
    with pytest.raises(InvalidParams):
        c.batch_is_exist([k.decode() for k in ks])
    with pytest.raises(InvalidParams):
        c.put_batch([k.decode() for k in ks], [b"v"] * len(ks))


def test_bad_routes(setup) -> None:
    _, _, raw = setup
    r = raw()
    status, welcome = r.hello()
    assert status == 0
    k = b"good-3"
    for rte in (P.route_for_shard(SHARDS), P.route_for_shard(0xFFFF), b"\x00", b"\x00\x00\x00"):
        refused(r.ask(Op.EXIST_KEY.value, rte, [k]), Status.INVALID_PARAMS)
    home = shard(k)
    wrong = P.route_for_shard((home + 1) % SHARDS)
    elsewhere = keys_on_shard((home + 2) % SHARDS, 1)[0]
    wrong_keys = keys_on_shard((home + 1) % SHARDS, 3) + [k]  # one stray key in a batch
    misrouted = [(Op.EXIST_KEY, [k]), (Op.GET_REPLICA_LIST, [k]), (Op.REMOVE, [k, True]),
                 (Op.PUT_START, [elsewhere, 10, None]), (Op.GET_SIZE, [k])]
    batches = [(Op.BATCH_EXIST_KEY, [[k]]), (Op.BATCH_GET_REPLICA_LIST, [wrong_keys])]
    if welcome.get("batch_any_shard"):
        # Any-shard batches: the stray key is answered by its owner, in position.
        _, status, body = r.ask(Op.BATCH_EXIST_KEY.value, wrong, [wrong_keys])
        assert (status, body) == (0, [0, 0, 0, 1])
        _, status, body = r.ask(Op.BATCH_GET_REPLICA_LIST.value, wrong, [wrong_keys])
        assert status == 0 and body[:3] == [Status.OBJECT_NOT_FOUND] * 3
        assert body[3][0] == 1003
        # ... but per-key lists must still match the keys
        refused(r.ask(Op.BATCH_PUT_START.value, wrong, [wrong_keys, [10], None]),
                Status.INVALID_PARAMS)
    else:
        misrouted += batches
    for op, fields in misrouted:
        refused(r.ask(op.value, wrong, fields), Status.INVALID_PARAMS)
    # The right route works.
    _, status, body = r.ask(Op.EXIST_KEY.value, route(k), [k])
    assert (status, body) == (0, 1)
