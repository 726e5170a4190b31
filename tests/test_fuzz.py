"""Fuzzing a real master over a raw DEALER socket, plus the in-process harness.

Hypothesis sends the master random and mutated messages, one at a time, from a
connection that sent a valid HELLO and from one that did not:

* random frame lists (any number of frames, any bytes);
* structure-aware mutations of the valid requests in
  ``protocol/golden_vectors.json``: a field, the request id, or an item inside
  a list replaced by a value of another type (huge and negative ints, floats,
  NaN, unicode with NUL, over-long bin, nested arrays and maps, ext types),
  fields dropped or appended, lists grown past the batch limit, the op code
  swapped for another one, the route frame replaced;
* byte-level mutations of those payloads and hand-made pathological payloads
  (deep nesting, huge declared lengths, truncation).

Every message of one or more frames must get exactly one reply, on the
request's op frame (the first byte of it, or ``ff``, for a wrong frame
count), whose payload is ``[req_id, status, body]`` with a known status, the
request's id when it could be read (0 otherwise), and a one-line str body
for a failure; a message with a frame over the master's request frame bound gets
none (the socket drops it with the connection, PROTOCOL.md section 2).
``INTERNAL_ERROR`` (an exception inside the master) fails.
After each run the master process is alive, ``check_consistency()`` is empty
and a new client stores and reads an object.

Examples are derandomized (the same on every run) and not shrunk against the
real master (set ``KVMASTER_FUZZ_SHRINK=1`` to shrink a failure).

The in-process, coverage-guided harness is ``tools/fuzz_master.py`` (atheris);
a fixed batch of random inputs runs here as a smoke test, and each finding it
made has a deterministic regression test against a real master at the end.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conftest import MasterProcess
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from kvmaster import Client, ReplicateConfig, Status
from kvmaster import protocol as P
from kvmaster.config import MasterConfig
from kvmaster.master import max_request_bytes
from kvmaster.protocol import Op

REPO = Path(__file__).resolve().parents[1]
VECTORS = json.loads((REPO / "protocol" / "golden_vectors.json").read_text())
SHARDS = 3
MAX_BATCH = 16
SEED = P.tenant_seed("default")
KNOWN_STATUSES = set(Status._value2member_map_)
#: How long a reply may take.  Generous: examples of megabytes (2^20-item arrays) are
#: decoded and refused by a master that shares two cores with the rest of the suite.
REPLY_TIMEOUT_S = 15.0
#: The master's request frame bound (PROTOCOL.md section 2): a message with a larger
#: frame is dropped by the socket with its connection, unanswered.
FRAME_BOUND = max_request_bytes(MasterConfig(max_batch=MAX_BATCH,
                                             kv_session_max_batch=MAX_BATCH))

PHASES = (Phase.explicit, Phase.generate) + (
    (Phase.shrink,) if os.environ.get("KVMASTER_FUZZ_SHRINK") else ())


def fuzz_settings(n: int) -> settings:
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    phases=PHASES, suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------------------
# Golden requests, decoded


def _from_json(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"hex"}:
        return bytes.fromhex(v["hex"])
    return v


GOLDEN: list[tuple[bytes, list[Any]]] = []
for _vec in VECTORS["requests"]:
    _payload = msgpack.unpackb(bytes.fromhex(_vec["payload_hex"]), raw=False)
    GOLDEN.append((bytes.fromhex(_vec["op"]), _payload))
OPS = sorted({op.value for op in Op}) + [b"\x00", b"\x0b", b"\x2f", b"\x3a", b"\x7f", b"\xff"]


def route_for(op: bytes, payload: list[Any], rnd: random.Random) -> bytes:
    """The right route frame for ``payload`` on this test's master (tenant default)."""
    if op < b"\x10":
        return b""
    first = payload[1] if len(payload) > 1 else None
    if type(first) is list:
        first = first[0] if first else None
    if type(first) is bytes:
        return P.route_for_shard(P.shard_of(first, SEED, SHARDS))
    return P.route_for_shard(rnd.randrange(SHARDS))


# ---------------------------------------------------------------------------
# Strategies

NASTY_INTS = [0, -1, 1, 63, 64, 4096, 4097, (1 << 20) + 1, (1 << 48) - 1, 1 << 48, (1 << 63) - 1,
              1 << 63, (1 << 64) - 1, -(1 << 63)]
NASTY_STRS = ["", "\x00", "a\x00b", "租户-α", "\U0001f511", "x" * 300, "k0", "default", "\u202e"]
NASTY_BINS = [b"", b"\x00", b"k\x00", b"x" * 4096, b"x" * 4097, b"\xff" * 9, b"k1"]

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.sampled_from(NASTY_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24), st.sampled_from(NASTY_STRS),
    st.binary(max_size=24), st.sampled_from(NASTY_BINS),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6)),
)
junk = st.recursive(
    scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=5),
                           st.dictionaries(st.text(max_size=4), kids, max_size=3),
                           st.dictionaries(st.integers(-3, 3), kids, min_size=1, max_size=2)),
    max_leaves=10)


@st.composite
def mutated_golden(draw: Any) -> list[bytes]:
    """A golden request with one to three structural mutations, correctly routed or not."""
    op, payload = draw(st.sampled_from(GOLDEN))
    payload = list(payload)
    rnd = random.Random(draw(st.integers(0, 1 << 30)))
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.integers(0, 7))
        if what == 0 and len(payload) > 1:  # a field of another type
            payload[draw(st.integers(1, len(payload) - 1))] = draw(junk)
        elif what == 1 and payload:  # the request id (unless every field was dropped)
            payload[0] = draw(st.one_of(junk, st.sampled_from(NASTY_INTS)))
        elif what == 2:  # fields dropped
            payload = payload[:draw(st.integers(0, len(payload)))]
        elif what == 3:  # fields appended
            payload += draw(st.lists(junk, min_size=1, max_size=3))
        elif what == 4:  # inside a list: replace an item, or grow past the batch limit
            lists = [i for i, v in enumerate(payload) if type(v) is list]
            if lists:
                i = draw(st.sampled_from(lists))
                inner = list(payload[i])
                if inner and draw(st.booleans()):
                    inner[draw(st.integers(0, len(inner) - 1))] = draw(junk)
                else:
                    inner = (inner or [b"k1"]) * draw(st.sampled_from([0, MAX_BATCH + 1, 700]))
                payload[i] = inner
        elif what == 5:  # another op for this payload
            op = draw(st.sampled_from(OPS))
        elif what == 6 and len(payload) > 1:  # nasty value of a plausible type
            i = draw(st.integers(1, len(payload) - 1))
            v = payload[i]
            pool = (NASTY_INTS if type(v) is int else NASTY_STRS if type(v) is str
                    else NASTY_BINS if type(v) is bytes else [None, [], [[]], {}])
            payload[i] = draw(st.sampled_from(pool))
        else:  # a list of many keys, some bad, for batch-shaped ops
            payload.append(draw(st.lists(st.sampled_from(NASTY_BINS), max_size=40)))
    try:
        body = msgpack.packb(payload, use_bin_type=True)
    except (ValueError, OverflowError, TypeError):
        body = msgpack.packb(payload[:1], use_bin_type=True)
    rte = draw(st.one_of(
        st.just(route_for(op, payload, rnd)), st.just(route_for(op, payload, rnd)),
        st.sampled_from([b"", b"\x00", b"\x00\x00\x00", b"\xff\xff",
                         P.route_for_shard(SHARDS), P.route_for_shard(0),
                         P.route_for_shard(SHARDS - 1)])))
    return [op, rte, body]


@st.composite
def byte_mutated_golden(draw: Any) -> list[bytes]:
    """A golden request whose payload bytes are flipped, cut, or spliced."""
    op, payload = draw(st.sampled_from(GOLDEN))
    data = bytearray(msgpack.packb(payload, use_bin_type=True))
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        what = draw(st.integers(0, 3))
        if what == 0:
            data[i] = draw(st.integers(0, 255))
        elif what == 1:
            del data[i:i + draw(st.integers(1, 8))]
        elif what == 2:
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            data = data[:i]
    return [op, route_for(op, payload, random.Random(0)), bytes(data)]


PATHOLOGICAL = [
    b"\x91" * 5000 + b"\xc0",  # 5000 nested arrays
    b"\x81\xa1a" * 3000 + b"\xc0",  # 3000 nested maps
    b"\xdd\xff\xff\xff\xff",  # array 32 claiming 4 G items
    b"\xdf\xff\xff\xff\xff",  # map 32 claiming 4 G entries
    b"\xc6\x7f\xff\xff\xff",  # bin 32 claiming 2 GiB
    b"\xdb\x7f\xff\xff\xff",  # str 32 claiming 2 GiB
    b"\x92\x01\xc6\x00\x20\x00\x00" + b"x" * 64,  # bin 32 of 2 MiB, truncated
    b"\x92\x01\xd9\x02\xff\xfe",  # invalid UTF-8 in a str
    b"\x92\x01\xc1",  # reserved byte 0xc1
    b"\x92\x01\xd4\xff\x00",  # fixext 1 with type -1 (timestamp, malformed)
    b"\x92\x01\xd6\xff\x00\x00\x00\x01",  # a valid timestamp ext
    msgpack.packb([1, [b"k"] * (1 << 20)], use_bin_type=True),  # 2^20 keys
    msgpack.packb([1, [b"k"] * ((1 << 20) + 1)], use_bin_type=True),  # over the item limit
    msgpack.packb([2, {str(i): i for i in range(1025)}], use_bin_type=True),  # map over 1024
    msgpack.packb([3] + [b"k"] * 50000, use_bin_type=True),  # 50000 trailing fields
]

pathological = st.builds(lambda op, payload, rte: [op, rte, payload],
                         st.sampled_from(OPS), st.sampled_from(PATHOLOGICAL),
                         st.sampled_from([b"", P.route_for_shard(0), P.route_for_shard(1)]))
raw_frames = st.lists(st.binary(max_size=40), min_size=1, max_size=7)
# Several requests in one message (protocol 1.2).
glued = st.lists(st.one_of(mutated_golden(), byte_mutated_golden(), pathological),
                 min_size=2, max_size=4).map(lambda ms: [f for m in ms for f in m])


class Frames(list):
    """A message's frames, shown short: a failing example may hold tens of MB."""

    def __repr__(self) -> str:
        return f"Frames({[(f[:40], len(f)) for f in self]!r})"


messages = st.one_of(mutated_golden(), mutated_golden(), byte_mutated_golden(), pathological,
                     raw_frames, glued).map(Frames)
#: A message with a frame one byte over the bound, then a valid one the next example sends
#: on the connection the DEALER makes anew.
OVER_BOUND = Frames([Op.PUT_START.value, P.route_for_shard(0), b"\x00" * (FRAME_BOUND + 1)])


# ---------------------------------------------------------------------------
# The checker


def expected_req_id(payload: bytes) -> int:
    """What the spec says an error reply carries: the first item if it is an int in
    [0, 2^63), read within the decoding limits; else 0."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True,
                              max_array_len=1 << 20, max_map_len=1024,
                              max_str_len=1 << 20, max_bin_len=1 << 20)
    except Exception:  # noqa: BLE001 - any undecodable payload
        return 0
    if type(obj) is list and obj and type(obj[0]) is int and 0 <= obj[0] < 1 << 63:
        return obj[0]
    return 0


class Peer:
    """A raw DEALER connection to the master."""

    def __init__(self, endpoint: str, client_id: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.client_id = client_id
        self.ids = itertools.count(1)

    def exchange(self, frames: list[bytes]) -> list[bytes]:
        self.sock.send_multipart(frames)
        assert self.sock.poll(REPLY_TIMEOUT_S * 1000), (
            f"no reply within {REPLY_TIMEOUT_S} s to {[f[:40] for f in frames]}")
        return self.sock.recv_multipart()

    def ask(self, op: Op, fields: list[Any], rte: bytes = b"") -> tuple[int, Any]:
        frames = self.exchange([op.value, rte, msgpack.packb([next(self.ids), *fields],
                                                             use_bin_type=True)])
        _, status, body = P.decode_reply(frames[1])
        return status, body

    def hello(self, tenant: str = "default") -> tuple[int, Any]:
        return self.ask(Op.HELLO, [1, P.PROTOCOL_VERSION[1], self.client_id, tenant,
                                   "fuzz-host", "0"])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def codec_status(op: bytes, payload: bytes) -> int:
    """The status the codec gives a payload: 0 if it decodes, else its error's status."""
    try:
        P.decode_request(op, payload)
    except P.ProtocolError as exc:
        return exc.status
    return 0


def check_one(peer: Peer, frames: list[bytes], registered: bool) -> tuple[int, Any]:
    """Send one message; assert the reply follows the spec; -> (status, body) (of the
    first request, for a message of several; ``(None, None)`` for a message with a
    frame over the master's bound, which must get no reply)."""
    if any(len(f) > FRAME_BOUND for f in frames):
        peer.sock.send_multipart(frames)
        assert not peer.sock.poll(1000), f"a reply to a frame over {FRAME_BOUND} bytes"
        return None, None  # (the DEALER reconnects by itself, as a new peer)
    if len(frames) > 3 and len(frames) % 3 == 0:
        return check_several(peer, frames, registered)
    return check_reply(frames, peer.exchange(frames), registered)


def check_several(peer: Peer, frames: list[bytes], registered: bool) -> tuple[int, Any]:
    """A message of several requests (protocol 1.2): one reply per request, each as
    if the request had come alone.  Replies are matched to requests by op frame and
    req_id; a request whose pair is not unique, or that follows a HELLO or BYE of
    the same message (registration may have changed), gets the checks that do not
    depend on what came before it.  Replies may come several to a message."""
    triples = [frames[i:i + 3] for i in range(0, len(frames), 3)]
    peer.sock.send_multipart(frames)
    replies = []
    while len(replies) < len(triples):
        assert peer.sock.poll(REPLY_TIMEOUT_S * 1000), (
            f"{len(replies)} replies of {len(triples)} within {REPLY_TIMEOUT_S} s")
        message = peer.sock.recv_multipart()
        # The replies to the routed requests may come in one message (protocol 1.2).
        assert message and not len(message) & 1, f"reply message of {len(message)} frames"
        replies += [message[i:i + 2] for i in range(0, len(message), 2)]
    assert len(replies) == len(triples), f"{len(replies)} replies to {len(triples)} requests"
    known = len(triples)
    for i, t in enumerate(triples):
        if t[0] in (Op.HELLO.value, Op.BYE.value):
            known = i + 1
            break
    by_pair: dict[tuple[bytes, int], list[int]] = {}
    for i, t in enumerate(triples):
        by_pair.setdefault((t[0], expected_req_id(t[2])), []).append(i)
    shared = {i for v in by_pair.values() if len(v) > 1 for i in v}
    first: tuple[int, Any] | None = None
    for reply in replies:
        assert len(reply) == 2, f"reply of {len(reply)} frames"
        obj = msgpack.unpackb(reply[1], raw=False, strict_map_key=False)
        assert type(obj) is list and len(obj) == 3 and type(obj[0]) is int, obj
        slots = by_pair.get((reply[0], obj[0]))
        assert slots, f"reply {reply[0]!r}/{obj[0]} matches no request of the message"
        i = slots.pop()
        got = check_reply(triples[i], reply,
                          registered if i not in shared and i < known else None)
        if i == 0:
            first = got
    assert not peer.sock.poll(50), "more replies than requests"
    assert first is not None
    return first


def check_reply(frames: list[bytes], reply: list[bytes], registered: bool | None
                ) -> tuple[int, Any]:
    """Assert ``reply`` is the spec's answer to the message ``frames``; with
    ``registered`` None (not known) only what holds either way."""
    assert len(reply) == 2, f"reply of {len(reply)} frames"
    op_expected = frames[0] if len(frames) == 3 else (frames[0][:1] or b"\xff")
    assert reply[0] == op_expected, (reply[0], frames[0])
    obj = msgpack.unpackb(reply[1], raw=False, strict_map_key=False)
    assert type(obj) is list and len(obj) == 3, obj
    req_id, status, body = obj
    assert type(req_id) is int and type(status) is int, obj
    assert status in KNOWN_STATUSES, f"unknown status {status}"
    shown = [f[:60] for f in frames]
    assert status != Status.INTERNAL_ERROR, f"INTERNAL_ERROR for {shown}: {body}"
    payload = frames[2] if len(frames) == 3 else (frames[-1] if len(frames) >= 2 else b"")
    assert req_id == expected_req_id(payload), (req_id, shown, body)
    if status:
        assert type(body) is str and body and "\n" not in body, body
    if registered is None:
        return status, body
    # Order of checks (section 17).
    if len(frames) != 3:
        assert status == Status.INVALID_PARAMS, (shown, status, body)
        return status, body
    op, rte, _ = frames
    if rte:  # routed: registration first, then the route, then the op and payload
        if not registered:
            assert status == Status.NOT_REGISTERED, (shown, status, body)
        elif len(rte) != 2 or int.from_bytes(rte, "big") >= SHARDS:
            assert status == Status.INVALID_PARAMS, (shown, status, body)
        elif codec_status(op, payload):
            assert status == codec_status(op, payload), (shown, status, body)
        elif op < b"\x10":
            assert status == Status.UNSUPPORTED, (shown, status, body)
    else:  # master-level: payload first, then registration
        expected = codec_status(op, payload)
        if expected:
            assert status == expected, (shown, status, body)
        elif op == Op.HELLO.value:
            pass
        elif not registered:
            assert status == Status.NOT_REGISTERED, (shown, status, body)
        elif op >= b"\x10":
            assert status == Status.UNSUPPORTED, (shown, status, body)
    return status, body


# ---------------------------------------------------------------------------
# Fixtures


class FuzzEnv:
    def __init__(self, master: MasterProcess, client: Client) -> None:
        self.master = master
        self.client = client
        self.registered = Peer(master.endpoint, "fuzz-registered")
        self.anonymous = Peer(master.endpoint, "fuzz-anonymous")
        assert self.registered.hello()[0] == 0

    def ensure_registered(self) -> None:
        status, _ = self.registered.ask(Op.HEARTBEAT, [])
        if status == Status.NOT_REGISTERED:
            assert self.registered.hello()[0] == 0

    def ensure_anonymous(self) -> None:
        status, _ = self.anonymous.ask(Op.HEARTBEAT, [])
        if status != Status.NOT_REGISTERED:
            assert self.anonymous.ask(Op.BYE, [])[0] == 0

    def assert_healthy(self) -> None:
        assert self.master.proc.poll() is None, "the master process died"
        assert self.client.check_consistency() == []
        with Client() as fresh:
            fresh.setup(self.master.addr, 4 << 20)
            value = os.urandom(5000)
            key = f"after-fuzz-{time.monotonic_ns()}"
            fresh.put(key, value, ReplicateConfig(preferred_segments=[fresh.segment_name]))
            assert fresh.get(key) == value
            fresh.remove(key, force=True)
        assert self.client.check_consistency() == []

    def close(self) -> None:
        for p in (self.registered, self.anonymous):
            try:
                p.ask(Op.BYE, [])
            finally:
                p.close()


@pytest.fixture(scope="module")
def fuzz_env(request):
    extra = ("--shard-processes",) if request.config.getoption("--shard-processes",
                                                                default=False) else ()
    m = MasterProcess(*extra, "--shards", str(SHARDS), "--max-batch", str(MAX_BATCH),
                      "--kv-session-max-batch", str(MAX_BATCH), "--log-level", "WARNING")
    c = Client()
    env = None
    try:
        c.setup(m.addr, 32 << 20)
        keys = [f"k{i}" for i in range(24)]
        for part in (keys[:12], keys[12:]):
            assert c.put_batch(part, [os.urandom(300 + len(k)) for k in part]) == [0] * 12
        assert c.attach_kv_session("s1", keys[:8]) == [0] * 8
        c.pin_kv_session("s1")
        env = FuzzEnv(m, c)
        yield env
    finally:
        if env is not None:
            env.close()
        c.close()
        assert m.stop() == 0, getattr(m, "stderr", "")[-3000:]
        assert "Traceback" not in getattr(m, "stderr", ""), m.stderr[-3000:]


# ---------------------------------------------------------------------------
# Hypothesis against a real master


def test_fuzz_registered_connection(fuzz_env: FuzzEnv) -> None:
    @fuzz_settings(500)
    @given(frames=messages)
    @example(frames=OVER_BOUND)
    def run(frames: list[bytes]) -> None:
        fuzz_env.ensure_registered()
        check_one(fuzz_env.registered, frames, registered=True)
        assert fuzz_env.master.proc.poll() is None

    run()
    fuzz_env.assert_healthy()


def test_fuzz_connection_without_hello(fuzz_env: FuzzEnv) -> None:
    @fuzz_settings(250)
    @given(frames=messages)
    @example(frames=OVER_BOUND)
    def run(frames: list[bytes]) -> None:
        fuzz_env.ensure_anonymous()
        status, body = check_one(fuzz_env.anonymous, frames, registered=False)
        # Without HELLO nothing but HELLO itself may succeed.
        if status == 0:  # (of the first request, in a message of several)
            assert frames[0] == Op.HELLO.value and len(frames) % 3 == 0, (frames, body)

    run()
    fuzz_env.assert_healthy()


def test_fuzz_unicode_everywhere(fuzz_env: FuzzEnv) -> None:
    """Unicode text (any code point but surrogates) in every str field of HELLO and
    MOUNT, and its UTF-8 as keys and session ids: replies are well formed and bin
    keys of any bytes round-trip through the key ops."""
    peer = fuzz_env.registered

    @fuzz_settings(120)
    @given(text=st.text(min_size=0, max_size=40), field=st.integers(0, 5))
    def run(text: str, field: int) -> None:
        fuzz_env.ensure_registered()
        hello = [1, 0, "fuzz-unicode", "default", "h", "0"]
        hello[2 + field % 4] = text
        other = Peer(fuzz_env.master.endpoint, "unused")
        try:
            st_hello, body = check_one(other, [Op.HELLO.value, b"", msgpack.packb(
                [7, *hello], use_bin_type=True)], registered=False)
            ok = text and "\x00" not in text if field % 4 in (0, 1) else "\x00" not in text
            limits = (128, 256, 256, 64)[field % 4]
            if not ok or len(text) > limits:
                assert st_hello == Status.INVALID_PARAMS, (text, body)
            else:
                assert st_hello == 0, (text, body)
                assert body["tenant"] == hello[3]
                check_one(other, [Op.BYE.value, b"", msgpack.packb([8])], registered=True)
        finally:
            other.close()
        key = text.encode()
        rte = P.route_for_shard(P.shard_of(key, SEED, SHARDS))
        status, body = check_one(peer, [Op.EXIST_KEY.value, rte,
                                        msgpack.packb([9, key], use_bin_type=True)], True)
        if key and b"\x00" not in key:
            assert (status, body) == (0, 0)
        else:
            assert status == Status.INVALID_PARAMS
        status, _ = check_one(peer, [Op.GET_KV_SESSION.value, rte,
                                     msgpack.packb([10, key], use_bin_type=True)], True)
        assert status == (Status.SESSION_NOT_FOUND if key and b"\x00" not in key
                          else Status.INVALID_PARAMS)

    run()
    fuzz_env.assert_healthy()


def test_fuzz_master_still_serves_and_is_consistent(fuzz_env: FuzzEnv) -> None:
    fuzz_env.assert_healthy()
    c = fuzz_env.client
    assert c.stats()["state"] == "running"


# ---------------------------------------------------------------------------
# The in-process harness (tools/fuzz_master.py), as a smoke test


def test_in_process_harness_random_inputs() -> None:
    """400 fixed random inputs through the in-process harness (front + shards, fake
    clock): no exception, one well-formed reply per message, consistent state."""
    from kvmaster.tools import fuzz_master as F

    rng = random.Random(20240601)
    t0 = time.monotonic()
    try:
        for i in range(400):
            data = rng.randbytes(rng.randint(0, 800))
            try:
                F.run_input(data)
            except Exception as exc:
                raise AssertionError(f"input {i} ({data.hex()}) failed: {exc}") from exc
            assert time.monotonic() - t0 < 30, "harness too slow"
    finally:
        F.release()
    # The fake clock and the harness's logger set-up must not outlive it.
    from kvmaster import _sessions, _shard

    assert _shard._monotonic is time.monotonic and _sessions._now is not F.clock
    assert logging.getLogger("kvmaster").propagate


# ---------------------------------------------------------------------------
# Regression tests for what the fuzzers found


def test_fuzz_finding_hello_on_registered_connection_keeps_its_registration(
        start_master) -> None:
    """Spec section 10: HELLO again on a registered connection is answered with the
    existing registration (a changed client id or tenant is ignored).  A HELLO naming
    another live client's id must not move that client onto this connection, change
    this connection's tenant, or orphan this connection's own registration."""
    m = start_master("--shards", "2")
    a, b = Peer(m.endpoint, "client-a"), Peer(m.endpoint, "client-b")
    try:
        assert a.hello("tenant-a")[0] == 0
        assert b.hello("tenant-b")[0] == 0
        seg = f"kvmaster-fuzzfind{os.getpid():08x}"[:25]
        assert b.ask(Op.MOUNT_SEGMENT, [seg, 1 << 20, "fuzz-host", "shm"])[0] == 0
        # b says HELLO again, naming a's client id and tenant.
        status, body = b.ask(Op.HELLO, [1, 0, "client-a", "tenant-a", "h", "0"])
        assert status == 0
        assert body["tenant"] == "tenant-b", "a registered connection changed its tenant"
        # a is still registered as itself.
        assert a.ask(Op.HEARTBEAT, [])[0] == 0
        # b's registration (and its segment) is still b's: BYE unmounts it.
        assert b.ask(Op.BYE, [])[0] == 0
        status, segments = a.ask(Op.LIST_SEGMENTS, [])
        assert status == 0 and seg not in [s["name"] for s in segments], segments
        # client-b can register again from a new connection (and gets an answer).
        b2 = Peer(m.endpoint, "client-b")
        try:
            assert b2.hello("tenant-b")[0] == 0
        finally:
            b2.close()
    finally:
        a.close()
        b.close()


def test_fuzz_finding_bye_pipelined_with_mount_leaves_no_segment(start_master) -> None:
    """A client that pipelines BYE and MOUNT_SEGMENT (both in flight at once, which
    section 2 allows) must not leave a segment mounted for a client the master has
    forgotten: nobody could ever unmount it, and writes would keep being placed in it."""
    m = start_master("--shards", "2")
    watcher = Peer(m.endpoint, "watcher")
    try:
        assert watcher.hello()[0] == 0
        for attempt in range(5):
            p = Peer(m.endpoint, f"pipeliner-{attempt}")
            try:
                assert p.hello()[0] == 0
                seg = f"kvmaster-pipe{attempt:02d}{os.getpid():08x}"
                p.sock.send_multipart([Op.BYE.value, b"", msgpack.packb([50])])
                p.sock.send_multipart([Op.MOUNT_SEGMENT.value, b"", msgpack.packb(
                    [51, seg, 1 << 20, "fuzz-host", "shm"], use_bin_type=True)])
                replies = {}
                for _ in range(2):
                    assert p.sock.poll(5000)
                    rid, status, _ = P.decode_reply(p.sock.recv_multipart()[1])
                    replies[rid] = status
                assert replies[50] == 0
            finally:
                p.close()
            status, segments = watcher.ask(Op.LIST_SEGMENTS, [])
            assert status == 0
            orphans = [s for s in segments if s["name"] == seg]
            assert not orphans, (f"attempt {attempt}: segment mounted for a client that said "
                                 f"BYE (MOUNT answered {replies[51]}): {orphans}")
    finally:
        watcher.close()


def test_fuzz_finding_repeated_key_in_tagged_batch_keeps_sessions_consistent(
        start_master, make_client) -> None:
    """A key repeated in one tagged batch write, where a later position's session
    registration is refused: the refusal must not undo the membership the first
    position was granted (the object would name a session that does not exist)."""
    m = start_master("--shards", "2", "--kv-session-max-members", "1")
    c = make_client(m, segment_bytes=4 << 20)
    c.put("other", b"o")
    assert c.attach_kv_session("full", ["other"]) == [0]  # "full" has its one member
    # Raw, as a client that sends repeats would (the Python client sends a key once).
    body = c._call(Op.BATCH_PUT_START_WITH_KV_SESSIONS.value, c._route(b"k"),
                   [[b"k", b"k"], [2, 2], None, [[b"s"], [b"s", b"full"]]])
    assert type(body[0]) is list  # started
    assert c._call(Op.BATCH_PUT_END.value, c._route(b"k"), [[b"k"]]) == [0]
    results = [0, body[1]]
    assert results == [0, Status.SESSION_LIMIT_EXCEEDED]
    assert c.check_consistency() == []
    # The object and the session agree about the membership granted to position 0.
    assert c.query_key("k")["sessions"] == [b"s"]
    assert c.get_kv_session("s").member_count == 1


def test_fuzz_finding_attach_of_a_missing_key_racing_a_tagged_write(start_master) -> None:
    """ATTACH_KV_SESSION(s, [k]) for a key that does not exist yet, pipelined with a
    tagged PUT_START of k into s (section 2 allows both in flight).  Whatever order the
    shards see them in, the session's members and the object's session refs must
    agree afterwards: the attach's undo of its own (refused) association must not
    take away the association the tagged write was granted."""
    m = start_master("--shards", "2")
    p = Peer(m.endpoint, "racer")
    try:
        assert p.hello()[0] == 0
        assert p.ask(Op.MOUNT_SEGMENT, [f"kvmaster-race{os.getpid():012x}"[:25], 1 << 20,
                                        "fuzz-host", "shm"])[0] == 0
        on_0 = [k for k in (b"race-%d" % i for i in range(200))
                if P.shard_of(k, SEED, 2) == 0]
        sid, keys = on_0[0], on_0[1:11]
        rte = P.route_for_shard(0)
        for n, key in enumerate(keys):
            p.sock.send_multipart([Op.ATTACH_KV_SESSION.value, rte,
                                   msgpack.packb([100 + n, sid, [key]], use_bin_type=True)])
            p.sock.send_multipart([Op.PUT_START_WITH_KV_SESSIONS.value, rte, msgpack.packb(
                [200 + n, key, 100, None, [sid]], use_bin_type=True)])
            got = {}
            for _ in range(2):
                assert p.sock.poll(5000)
                rid, status, body = P.decode_reply(p.sock.recv_multipart()[1])
                got[rid] = (status, body)
            assert got[200 + n][0] == 0, got
            status, problems = p.ask(Op.CHECK_CONSISTENCY, [])
            assert (status, problems) == (0, []), f"attempt {n}: {problems}"
            status, info = p.ask(Op.QUERY_KEY, [key], rte)
            assert status == 0 and info["state"] == "PROCESSING"
    finally:
        p.ask(Op.BYE, [])
        p.close()


def test_fuzz_finding_refused_takeover_of_an_abandoned_tagged_write(start_master) -> None:
    """A tagged write is abandoned (older than --put-start-discard-timeout); the next
    PUT_START of its key is refused (soft_pin_ttl_ms above --max-kv-soft-pin-ttl).
    The refused start must leave sessions and objects consistent: the abandoned
    write's session memberships may not stay at the session's home when the write
    itself is gone."""
    m = start_master("--shards", "2", "--put-start-discard-timeout", "0",
                     "--max-kv-soft-pin-ttl", "1000")
    p = Peer(m.endpoint, "taker")
    try:
        assert p.hello()[0] == 0
        assert p.ask(Op.MOUNT_SEGMENT, [f"kvmaster-take{os.getpid():012x}"[:25], 1 << 20,
                                        "fuzz-host", "shm"])[0] == 0
        key, sid = b"abandoned", b"abandoned-session"
        rte = P.route_for_shard(P.shard_of(key, SEED, 2))
        status, _ = p.ask(Op.PUT_START_WITH_KV_SESSIONS, [key, 100, None, [sid]], rte)
        assert status == 0
        status, body = p.ask(Op.PUT_START, [key, 100, [1, False, 1, 10 ** 6]], rte)
        assert status == Status.INVALID_PARAMS and "soft_pin_ttl_ms" in body, body
        status, problems = p.ask(Op.CHECK_CONSISTENCY, [])
        assert (status, problems) == (0, [])
    finally:
        p.ask(Op.BYE, [])
        p.close()
