"""Conformance of the codec (``kvmaster.protocol``) with ``protocol/``.

* every golden vector decodes to its fields and re-encodes to its bytes;
* every registered op round-trips, and every ``Op`` has a message type;
* the decoder rejects malformed input with a typed ``ProtocolError`` only;
* routing follows the spec formula;
* the op and status tables of ``PROTOCOL.md`` match the enums and field order.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmaster import protocol as P
from kvmaster.protocol import (
    OP_TO_TYPE,
    Op,
    ProtocolError,
    ReplicateConfigWire,
    SoftPinAction,
    Status,
)

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "protocol" / "PROTOCOL.md"
VECTORS_PATH = REPO / "protocol" / "golden_vectors.json"
GOLDEN = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))

MASTER_OPS = P.MASTER_OPS
SESSION_HOME_OPS = {Op.ATTACH_KV_SESSION, Op.SET_KV_SESSION_PIN, Op.UPDATE_KV_SESSION,
                    Op.CLOSE_KV_SESSION, Op.GET_KV_SESSION, Op.LIST_KV_SESSION_KEYS}

INVALID = Status.INVALID_PARAMS


@pytest.fixture(autouse=True)
def no_leaked_segments() -> None:
    """Overrides the conftest fixture: nothing here creates shared memory, and its
    /dev/shm scan would otherwise see segments of unrelated concurrent runs."""


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ------------------------------------------------------------ JSON <-> values

def to_json(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"hex": v.hex()}
    if isinstance(v, ReplicateConfigWire):
        return {"replica_num": v.replica_num, "with_hard_pin": v.with_hard_pin,
                "soft_pin_action": int(v.soft_pin_action), "soft_pin_ttl_ms": v.soft_pin_ttl_ms,
                "preferred_segments": list(v.preferred_segments)}
    if isinstance(v, (list, tuple)):
        return [to_json(x) for x in v]
    if isinstance(v, dict):
        return {k: to_json(x) for k, x in v.items()}
    return v


def from_json(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"hex"}:
            return bytes.fromhex(v["hex"])
        return {k: from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [from_json(x) for x in v]
    return v


def message_from_json(op: bytes, fields: dict[str, Any]) -> P.Message:
    cls = OP_TO_TYPE[op]
    kw = {}
    for name, value in fields.items():
        if name == "config":
            c = dict(value)
            c["preferred_segments"] = tuple(c["preferred_segments"])
            kw[name] = ReplicateConfigWire(**c)
        else:
            kw[name] = from_json(value)
    return cls(**kw)


def fields_json(msg: P.Message) -> dict[str, Any]:
    return {f.name: to_json(getattr(msg, f.name)) for f in dataclasses.fields(msg)}


def _ids(vectors: list[dict[str, Any]]) -> list[str]:
    return [v["name"] for v in vectors]


# ------------------------------------------------------------- golden vectors

def test_golden_file_matches_generator() -> None:
    """The committed vectors are exactly what tools/gen_golden_vectors.py produces."""
    spec = importlib.util.spec_from_file_location(
        "gen_golden_vectors", REPO / "tools" / "gen_golden_vectors.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = gen.build()
    assert gen.self_check(doc) == []
    assert gen.render(doc) == VECTORS_PATH.read_text(encoding="utf-8"), (
        "protocol/golden_vectors.json is stale: run python tools/gen_golden_vectors.py")


def test_golden_version_is_the_codec_version() -> None:
    assert tuple(GOLDEN["protocol_version"]) == P.PROTOCOL_VERSION


def test_every_op_has_a_request_vector() -> None:
    covered = {bytes.fromhex(v["op"]) for v in GOLDEN["requests"]}
    assert covered == set(OP_TO_TYPE)


@pytest.mark.parametrize("vec", GOLDEN["requests"], ids=_ids(GOLDEN["requests"]))
def test_request_vector_decodes(vec: dict[str, Any]) -> None:
    op = bytes.fromhex(vec["op"])
    assert Op(op).name == vec["op_name"]
    req_id, msg = P.decode_request(op, bytes.fromhex(vec["payload_hex"]))
    assert req_id == vec["req_id"]
    assert type(msg) is OP_TO_TYPE[op]
    assert fields_json(msg) == vec["fields"]
    assert msg == message_from_json(op, vec["fields"])


@pytest.mark.parametrize("vec", GOLDEN["requests"], ids=_ids(GOLDEN["requests"]))
def test_request_vector_encodes(vec: dict[str, Any]) -> None:
    op = bytes.fromhex(vec["op"])
    payload = bytes.fromhex(vec["payload_hex"])
    msg = message_from_json(op, vec["fields"])
    encoded = P.encode_request(msg, vec["req_id"])
    if vec.get("decode_only"):
        # Not the canonical form, but the canonical form must mean the same thing.
        assert encoded != payload
        assert P.decode_request(op, encoded) == (vec["req_id"], msg)
    else:
        assert encoded == payload


@pytest.mark.parametrize("vec", GOLDEN["requests"], ids=_ids(GOLDEN["requests"]))
def test_request_vector_route(vec: dict[str, Any]) -> None:
    op = Op(bytes.fromhex(vec["op"]))
    route = bytes.fromhex(vec["route"])
    ctx = GOLDEN["routing_context"]
    seed, n = P.tenant_seed(ctx["tenant"]), ctx["shard_count"]
    fields = from_json(vec["fields"])
    if op in MASTER_OPS:
        assert route == P.MASTER_ROUTE
        return
    assert len(route) == 2 and int.from_bytes(route, "big") < n
    if op in SESSION_HOME_OPS:
        routed_by = [fields["session_id"]]
    elif "key" in fields:
        routed_by = [fields["key"]]
    else:
        routed_by = fields.get("keys", [])  # REMOVE_ALL: any shard
    for k in routed_by:
        assert P.route_for_shard(P.shard_of(k, seed, n)) == route


@pytest.mark.parametrize("vec", GOLDEN["replies"], ids=_ids(GOLDEN["replies"]))
def test_reply_vector(vec: dict[str, Any]) -> None:
    payload = bytes.fromhex(vec["payload_hex"])
    body = from_json(vec["body"])
    assert P.decode_reply(payload) == (vec["req_id"], vec["status"], body)
    assert P.encode_reply(vec["req_id"], vec["status"], body) == payload
    assert Status(vec["status"]).name == vec["status_name"]
    if vec["status"] != 0:
        assert isinstance(body, str), "an error reply's body is a one-line message"


@pytest.mark.parametrize("vec", GOLDEN["invalid_requests"], ids=_ids(GOLDEN["invalid_requests"]))
def test_invalid_request_vector(vec: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as info:
        P.decode_request(bytes.fromhex(vec["op"]), bytes.fromhex(vec["payload_hex"]))
    assert info.value.status == vec["status"]


@pytest.mark.parametrize("vec", GOLDEN["routing"],
                         ids=[f"{v['tenant']}-{v['key']['hex'][:12]}-{v['shard_count']}"
                              for v in GOLDEN["routing"]])
def test_routing_vector(vec: dict[str, Any]) -> None:
    key = bytes.fromhex(vec["key"]["hex"])
    tenant = vec["tenant"]
    assert zlib.crc32(tenant.encode("utf-8") + b"\x00" + key) == vec["crc32"]
    assert P.shard_of(key, P.tenant_seed(tenant), vec["shard_count"]) == vec["shard"]
    assert P.route_for_shard(vec["shard"]).hex() == vec["route"]


@pytest.mark.parametrize("vec", GOLDEN["checksums"], ids=_ids(GOLDEN["checksums"]))
def test_checksum_vector(vec: dict[str, Any]) -> None:
    """Object checksums (protocol 1.4): the client's xxh3_64 of each vector's bytes."""
    from kvmaster._integrity import checksum, checksum_parts

    data = bytes.fromhex(vec["data"]["hex"])
    assert len(data) == vec["size"]
    assert checksum(data) == vec["xxh3_64"] == int(vec["xxh3_64_hex"], 16)
    half = len(data) // 2  # the value given in parts hashes the same
    assert checksum_parts([data[:half], memoryview(data)[half:]]) == vec["xxh3_64"]


def test_checksum_of_empty_input_is_xxhash_reference_value() -> None:
    empty = next(v for v in GOLDEN["checksums"] if v["size"] == 0)
    assert empty["xxh3_64"] == 0x2D06800538D394C2


def test_routing_formula_and_route_frame() -> None:
    assert P.tenant_seed("acme") == zlib.crc32(b"acme\x00")
    assert P.route_for_shard(0) == b"\x00\x00"
    assert P.route_for_shard(258) == b"\x01\x02"
    assert P.route_for_shard(65535) == b"\xff\xff"
    assert P.MASTER_ROUTE == b""


# ------------------------------------------------------------- registry

def test_every_op_has_a_registered_type() -> None:
    assert set(OP_TO_TYPE) == {op.value for op in Op}
    for op in Op:
        cls = OP_TO_TYPE[op.value]
        assert cls.OP is op
        assert len(op.value) == 1
        assert len(cls.CHECKS) == len(dataclasses.fields(cls))
        # Optional fields (with a default) come after the required ones; so far
        # write_id (nil) of the start, end and revoke ops, columns (false, protocol 1.1)
        # of the batch get and batch start ops, page (nil) of UPDATE_KV_SESSION and
        # group_ids (nil, protocol 1.3) of the plain batch start ops; checksum(s) (nil,
        # protocol 1.4) of the end ops and with_checksum (false, 1.4) of the get ops.
        fields = dataclasses.fields(cls)
        optional = [f.name for f in fields][cls.N_REQUIRED:]
        expected = ["write_id"] if any(w in op.name for w in ("START", "END", "REVOKE")) \
            else []
        if op is Op.UPDATE_KV_SESSION:
            expected.append("page")
        if op.value in P.COLUMN_OPS:
            expected.append("columns")
        if op in (Op.BATCH_PUT_START, Op.BATCH_UPSERT_START):
            expected += ["group_ids", "session_tags"]  # (nil, protocol 1.3 and 1.5)
        if op is Op.PUT_END:
            expected.append("checksum")  # (nil, protocol 1.4)
        if op is Op.BATCH_PUT_END:
            expected.append("checksums")  # (nil, protocol 1.4)
        if op in (Op.GET_REPLICA_LIST, Op.BATCH_GET_REPLICA_LIST):
            expected.append("with_checksum")  # (false, protocol 1.4)
        assert optional == expected
        assert all(f.default is (False if f.name in ("columns", "with_checksum") else None)
                   for f in fields[cls.N_REQUIRED:])
        assert cls.__name__.endswith("Request")


def test_duplicate_op_registration_fails() -> None:
    with pytest.raises(RuntimeError, match="duplicate op code"):
        @P._register(Op.HEARTBEAT)
        class Again(P.Message):
            pass
    assert OP_TO_TYPE[Op.HEARTBEAT.value].__name__ == "HeartbeatRequest"


# --------------------------------------------------- round trip of every op

_key = st.binary(min_size=1, max_size=40).filter(lambda b: b"\x00" not in b) | st.just(
    b"k" * P.KEY_MAX_BYTES)
_keys = st.lists(_key, max_size=5)
_text = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
                max_size=30)
_size = st.integers(1, (1 << 48) - 1)
_u64 = st.integers(0, (1 << 64) - 1)


@st.composite
def _config(draw: Any) -> ReplicateConfigWire:
    action = draw(st.sampled_from(list(SoftPinAction)))
    ttl = draw(st.none() | st.integers(1, 1 << 40)) if action == SoftPinAction.ENABLE else None
    return ReplicateConfigWire(draw(st.integers(1, 64)), draw(st.booleans()), int(action), ttl,
                               tuple(draw(st.lists(_text, max_size=3))))


FIELD_STRATEGIES: dict[str, Any] = {
    "protocol_major": st.integers(0, 255),
    "protocol_minor": st.integers(0, 255),
    "client_id": _text.filter(bool),
    "tenant": _text.filter(bool),
    "host_id": _text,
    "client_version": _text,
    "name": _text.filter(bool),
    "transport": _text,
    "key": _key,
    "keys": _keys,
    "keep_keys": _keys,
    "session_id": _key,
    "sessions": _keys,
    "kv_sessions": st.lists(_keys, max_size=4),
    "size": _size,
    "sizes": st.lists(_size, max_size=5),
    "config": _config(),
    "force": st.booleans(),
    "pinned": st.booleans(),
    "final": st.booleans(),
    "token": st.integers(0, (1 << 63) - 1),
    "cursor": st.just(b"") | _key,
    "limit": st.integers(1, 1 << 20),
    "write_id": st.none() | st.integers(1, (1 << 63) - 1),
    "page": st.none() | st.integers(0, (1 << 31) - 1),
    "columns": st.booleans(),
    "segment": _text,
    "targets": st.lists(_text, max_size=3),
    "source": _text,
    "done": st.booleans(),
    "label": _text,
    "pattern": _text.filter(bool),
    "group_ids": st.none() | st.lists(st.just(b"") | _key, max_size=5),
    "session_tags": st.none() | st.lists(st.just(b"") | _key, max_size=5),
    "checksum": st.none() | _u64,
    "checksums": st.none() | st.lists(st.none() | _u64, max_size=5),
    "with_checksum": st.booleans(),
    "replicas": st.lists(st.tuples(_text.filter(bool), st.integers(0, (1 << 63) - 1)).map(list),
                         max_size=5),
    "expected_checksums": st.lists(_u64, max_size=5),
}


def test_field_strategies_cover_every_field() -> None:
    names = {f.name for cls in OP_TO_TYPE.values() for f in dataclasses.fields(cls)}
    assert names <= set(FIELD_STRATEGIES), f"add strategies for {names - set(FIELD_STRATEGIES)}"


@st.composite
def _message(draw: Any) -> P.Message:
    cls = draw(st.sampled_from(sorted(OP_TO_TYPE.values(), key=lambda c: c.OP.value)))
    return cls(**{f.name: draw(FIELD_STRATEGIES[f.name]) for f in dataclasses.fields(cls)})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=_message(), req_id=st.integers(0, (1 << 63) - 1))
def test_round_trip_random_messages(msg: P.Message, req_id: int) -> None:
    payload = P.encode_request(msg, req_id)
    assert P.decode_request(msg.OP.value, payload) == (req_id, msg)


@pytest.mark.parametrize("op", list(Op), ids=[op.name for op in Op])
def test_round_trip_each_op(op: Op) -> None:
    vec = next(v for v in GOLDEN["requests"] if v["op"] == op.value.hex())
    msg = message_from_json(op.value, vec["fields"])
    assert P.decode_request(op.value, P.encode_request(msg, 12345)) == (12345, msg)


# ---------------------------------------------------------------- decoder errors

@pytest.mark.parametrize("op", [b"\x00", b"\x7f", b"\xff", b"", b"\x10\x10", b"\x01\x00"])
def test_unknown_op_is_unsupported(op: bytes) -> None:
    for payload in (pack([1]), b"\xc1", b""):  # the payload is not even looked at
        with pytest.raises(ProtocolError) as info:
            P.decode_request(op, payload)
        assert info.value.status == Status.UNSUPPORTED


@pytest.mark.parametrize("op", [op for op in Op if OP_TO_TYPE[op.value].CHECKS],
                         ids=lambda op: op.name)
def test_missing_trailing_field(op: Op) -> None:
    vec = next(v for v in GOLDEN["requests"] if v["op"] == op.value.hex())
    wire = msgpack.unpackb(bytes.fromhex(vec["payload_hex"]))
    n = OP_TO_TYPE[op.value].N_REQUIRED
    for keep in range(n):  # req_id plus 0..n-1 fields
        with pytest.raises(ProtocolError) as info:
            P.decode_request(op.value, pack(wire[:1 + keep]))
        assert info.value.status == INVALID


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.name)
def test_extra_trailing_fields_are_ignored(op: Op) -> None:
    vec = next(v for v in GOLDEN["requests"] if v["op"] == op.value.hex()
               and not v.get("decode_only"))
    wire = msgpack.unpackb(bytes.fromhex(vec["payload_hex"]))
    plain = P.decode_request(op.value, pack(wire))
    # Optional fields left out at the end are sent as nil first.
    wire += [None] * (1 + len(OP_TO_TYPE[op.value].CHECKS) - len(wire))
    assert P.decode_request(op.value, pack([*wire, "newer", [1, 2], None])) == plain


@pytest.mark.parametrize("payload", [
    pack({"req_id": 1}), pack([]), pack(1), pack("x"), pack(None), pack(b"\x92\x01"),
    pack([-1]), pack([1 << 63]), pack([True]), pack([1.0]), pack(["1"]), pack([None]),
], ids=["map", "empty-array", "int", "str", "nil", "bin", "negative-req-id", "req-id-2^63",
        "bool-req-id", "float-req-id", "str-req-id", "nil-req-id"])
def test_bad_envelope(payload: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        P.decode_request(Op.HEARTBEAT.value, payload)
    assert info.value.status == INVALID


@pytest.mark.parametrize("payload", [
    b"\xc1", b"\x92\x01", b"\x91\x01\x01", b"", b"\xdd\xff\xff\xff\xff", b"\x92\x01\xc4\x05ab",
    pack(["x" * ((1 << 20) + 1)]), pack([1, b"k" * ((1 << 20) + 1)]),
], ids=["never-used-byte", "truncated", "trailing-bytes", "empty", "huge-array-header",
        "truncated-bin", "str-over-1MiB", "bin-over-1MiB"])
def test_not_msgpack(payload: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        P.decode_request(Op.EXIST_KEY.value, payload)
    assert info.value.status == INVALID
    assert P.peek_req_id(payload) == 0


def test_peek_req_id() -> None:
    """Error replies carry the request's id when the payload reveals it, else 0."""
    assert P.peek_req_id(pack([42, "anything"])) == 42
    assert P.peek_req_id(pack([42])) == 42
    assert P.peek_req_id(pack([-1, b"k"])) == 0
    assert P.peek_req_id(pack({"a": 1})) == 0
    assert P.peek_req_id(pack([])) == 0
    assert P.peek_req_id(b"\xc1") == 0


K = b"doc/0001"
_BAD_FIELDS: list[tuple[str, Op, list[Any]]] = [
    # int
    ("int-as-bool", Op.PUT_START, [1, K, True, None]),
    ("int-as-float", Op.PUT_START, [1, K, 4096.0, None]),
    ("int-as-str", Op.PUT_START, [1, K, "4096", None]),
    ("int-negative", Op.MOUNT_SEGMENT, [1, "seg", -5, "", "shm"]),
    ("int-zero-size", Op.PUT_START, [1, K, 0, None]),
    ("int-above-range", Op.PUT_START, [1, K, 1 << 48, None]),
    ("int-hello-major-256", Op.HELLO, [1, 256, 0, "c", "t", "", ""]),
    ("int-limit-zero", Op.LIST_KV_SESSION_KEYS, [1, K, b"", 0]),
    ("int-limit-too-big", Op.LIST_KV_SESSION_KEYS, [1, K, b"", (1 << 20) + 1]),
    ("int-token-nil", Op.UPDATE_KV_SESSION, [1, K, [], None, True]),
    # bool
    ("bool-as-int", Op.REMOVE, [1, K, 1]),
    ("bool-as-nil", Op.REMOVE_ALL, [1, None]),
    ("bool-as-str", Op.SET_KV_SESSION_PIN, [1, K, "true"]),
    # str
    ("str-as-bin", Op.HELLO, [1, 1, 0, b"client", "t", "", ""]),
    ("str-empty-required", Op.HELLO, [1, 1, 0, "client", "", "", ""]),
    ("str-with-nul", Op.HELLO, [1, 1, 0, "cli\x00ent", "t", "", ""]),
    ("str-too-long", Op.HELLO, [1, 1, 0, "c" * 129, "t", "", ""]),
    ("str-segment-name-empty", Op.UNMOUNT_SEGMENT, [1, ""]),
    ("str-segment-name-256", Op.UNMOUNT_SEGMENT, [1, "s" * 256]),
    ("str-transport-513", Op.MOUNT_SEGMENT, [1, "seg", 1 << 20, "", "t" * 513]),
    # key
    ("key-as-str", Op.EXIST_KEY, [1, "doc/0001"]),
    ("key-as-int", Op.EXIST_KEY, [1, 7]),
    ("key-empty", Op.EXIST_KEY, [1, b""]),
    ("key-with-nul", Op.GET_REPLICA_LIST, [1, b"doc\x00"]),
    ("key-oversize", Op.PUT_END, [1, b"k" * (P.KEY_MAX_BYTES + 1)]),
    ("session-id-with-nul", Op.GET_KV_SESSION, [1, b"\x00"]),
    # key lists
    ("keys-as-bin", Op.BATCH_EXIST_KEY, [1, K]),
    ("keys-element-str", Op.BATCH_REMOVE, [1, [K, "k2"], False]),
    ("keys-element-empty", Op.BATCH_PUT_END, [1, [K, b""]]),
    ("keys-element-nul", Op.ATTACH_KV_SESSION, [1, K, [b"a\x00b"]]),
    ("keys-element-oversize", Op.BATCH_GET_REPLICA_LIST, [1, [b"k" * (P.KEY_MAX_BYTES + 1)]]),
    ("keys-nested", Op.PUT_START_WITH_KV_SESSIONS, [1, K, 1, None, [[K]]]),
    ("tag-lists-flat", Op.BATCH_PUT_START_WITH_KV_SESSIONS, [1, [K], [1], None, [K]]),
    ("tag-lists-not-list", Op.BATCH_UPSERT_START_WITH_KV_SESSIONS, [1, [K], [1], None, K]),
    # sizes
    ("sizes-as-int", Op.BATCH_PUT_START, [1, [K], 4096, None]),
    ("sizes-zero", Op.BATCH_PUT_START, [1, [K], [0], None]),
    ("sizes-bool", Op.BATCH_UPSERT_START, [1, [K], [True], None]),
    ("sizes-2^48", Op.BATCH_UPSERT_START, [1, [K], [1 << 48], None]),
    ("sizes-float", Op.BATCH_PUT_START, [1, [K, K], [4096, 4096.0], None]),
    ("sizes-bool-after-int", Op.BATCH_PUT_START, [1, [K, K], [1, True], None]),
    ("sizes-mixed-zero", Op.BATCH_PUT_START, [1, [K, K], [4096, 0], None]),
    ("sizes-mixed-2^48", Op.BATCH_PUT_START, [1, [K, K], [4096, 1 << 48], None]),
    # cursor
    ("cursor-as-str", Op.LIST_KV_SESSION_KEYS, [1, K, "", 10]),
    ("cursor-oversize", Op.LIST_KV_SESSION_KEYS, [1, K, b"c" * (P.KEY_MAX_BYTES + 1), 10]),
    # config
    ("config-as-map", Op.PUT_START, [1, K, 1, {"replica_num": 1}]),
    ("config-as-int", Op.PUT_START, [1, K, 1, 1]),
    ("config-empty", Op.PUT_START, [1, K, 1, []]),
    ("config-17-items", Op.PUT_START, [1, K, 1, [1, False, 0, None, []] + [None] * 12]),
    ("config-replica-num-0", Op.UPSERT_START, [1, K, 1, [0]]),
    ("config-replica-num-65", Op.UPSERT_START, [1, K, 1, [65]]),
    ("config-hard-pin-int", Op.PUT_START, [1, K, 1, [1, 0]]),
    ("config-action-3", Op.PUT_START, [1, K, 1, [1, False, 3]]),
    ("config-action-negative", Op.PUT_START, [1, K, 1, [1, False, -1]]),
    ("config-ttl-str", Op.PUT_START, [1, K, 1, [1, False, 1, "60000"]]),
    ("config-ttl-zero", Op.PUT_START, [1, K, 1, [1, False, 1, 0]]),
    ("config-preferred-not-list", Op.PUT_START, [1, K, 1, [1, False, 0, None, "seg"]]),
    ("config-preferred-bin", Op.BATCH_PUT_START, [1, [K], [1], [1, False, 0, None, [b"s"]]]),
    ("config-preferred-nul", Op.PUT_START, [1, K, 1, [1, False, 0, None, ["s\x00"]]]),
    # checksums (1.4)
    ("checksum-negative", Op.PUT_END, [1, K, 1, -1]),
    ("checksum-as-float", Op.PUT_END, [1, K, 1, 7.0]),
    ("checksum-as-bin", Op.PUT_END, [1, K, 1, b"\x01" * 8]),
    ("checksums-not-list", Op.BATCH_PUT_END, [1, [K], 1, 7]),
    ("checksums-element-str", Op.BATCH_PUT_END, [1, [K], 1, ["7"]]),
    ("checksums-element-negative", Op.BATCH_PUT_END, [1, [K, K], 1, [None, -1]]),
    ("checksums-element-bool", Op.BATCH_PUT_END, [1, [K], 1, [True]]),
    ("with-checksum-as-int", Op.GET_REPLICA_LIST, [1, K, 1]),
    ("with-checksum-as-str", Op.BATCH_GET_REPLICA_LIST, [1, [K], True, "yes"]),
    ("drop-replica-not-pair", Op.DROP_CORRUPT_REPLICAS, [1, [K], [["seg"]], [7]]),
    ("drop-replica-offset-negative", Op.DROP_CORRUPT_REPLICAS, [1, [K], [["seg", -1]], [7]]),
    ("drop-replica-segment-empty", Op.DROP_CORRUPT_REPLICAS, [1, [K], [["", 0]], [7]]),
    ("drop-expected-nil", Op.DROP_CORRUPT_REPLICAS, [1, [K], [["seg", 0]], [None]]),
    ("drop-expected-missing", Op.DROP_CORRUPT_REPLICAS, [1, [K], [["seg", 0]]]),
]


@pytest.mark.parametrize(("op", "wire"), [(op, wire) for _, op, wire in _BAD_FIELDS],
                         ids=[name for name, _, _ in _BAD_FIELDS])
def test_wrong_field(op: Op, wire: list[Any]) -> None:
    with pytest.raises(ProtocolError) as info:
        P.decode_request(op.value, pack(wire))
    assert info.value.status == INVALID


@pytest.mark.parametrize("action", [SoftPinAction.PRESERVE, SoftPinAction.DISABLE])
def test_soft_pin_ttl_requires_enable(action: SoftPinAction) -> None:
    for op in (Op.PUT_START, Op.UPSERT_START):
        with pytest.raises(ProtocolError, match="ENABLE"):
            P.decode_request(op.value, pack([1, K, 1, [1, False, int(action), 1000, []]]))
    _, msg = P.decode_request(Op.PUT_START.value, pack([1, K, 1, [1, False, 1, 1000, []]]))
    assert msg.config.soft_pin_action == SoftPinAction.ENABLE
    assert msg.config.soft_pin_ttl_ms == 1000


def test_key_bounds() -> None:
    longest = b"\xff" * P.KEY_MAX_BYTES
    assert P.decode_request(Op.EXIST_KEY.value, pack([1, longest]))[1].key == longest
    for bad in (b"", longest + b"\xff", b"a\x00", b"\x00"):
        with pytest.raises(ProtocolError):
            P.decode_request(Op.EXIST_KEY.value, pack([1, bad]))


def test_key_list_bounds() -> None:
    """A key list is checked on the fast path (payload bins bounded by KEY_MAX_BYTES) and,
    for a payload over that bound, on the general one: same verdicts, and the error names
    the field either way."""
    longest = b"\xff" * P.KEY_MAX_BYTES
    keys = [b"k1", longest, b"k2"]
    assert P.decode_request(Op.BATCH_EXIST_KEY.value, pack([1, keys]))[1].keys == keys
    sizes = [1, 4096, (1 << 48) - 1]
    _, msg = P.decode_request(Op.BATCH_PUT_START.value, pack([1, keys, sizes, None]))
    assert msg.sizes == sizes
    for bad in ([b"k1", longest + b"\xff"], [b"k1", b""], [b"k1", b"a\x00"], [b"k1", "k2"],
                [b"k1", 5], [b"k1", [b"k2"]]):
        with pytest.raises(ProtocolError, match="keep_keys: each key must be") as info:
            P.decode_request(Op.UPDATE_KV_SESSION.value, pack([1, K, bad, 0, True]))
        assert info.value.status == INVALID
    # A session id over the bound in a payload whose key list is fine: named too.
    with pytest.raises(ProtocolError, match="session_id"):
        P.decode_request(Op.ATTACH_KV_SESSION.value, pack([1, longest + b"\xff", [b"k1"]]))


def test_an_array_longer_than_its_payload_is_refused_at_its_header() -> None:
    """A few KiB declaring arrays of 2^20 items are refused without msgpack allocating
    any of them (each item takes a byte at least, so they cannot be complete)."""
    import struct
    import tracemalloc

    payload = b"\x92\x01" + (b"\xdd" + struct.pack(">I", 1 << 20)) * 1000
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as info:
            P.decode_request(Op.BATCH_EXIST_KEY.value, payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.status == INVALID and "not valid msgpack" in str(info.value)
    assert peak < 1 << 20, peak  # one list of 2^20 items alone would be 8 MiB
    with pytest.raises(ProtocolError):
        P.unpack_payload(payload)


def test_config_defaults() -> None:
    """nil and short arrays fill in defaults; the default config is the dataclass default."""
    for wire in (None, [1], [1, False], [1, False, 0], [1, False, 0, None],
                 [1, False, 0, None, []]):
        _, msg = P.decode_request(Op.PUT_START.value, pack([1, K, 1, wire]))
        assert msg.config == ReplicateConfigWire()
    _, msg = P.decode_request(Op.PUT_START.value, pack([1, K, 1, [2, True]]))
    assert msg.config == ReplicateConfigWire(2, True)


def test_reply_errors() -> None:
    for payload in (pack([1, 0]), pack([1, 0, 0, 0]), pack({"a": 1}), pack([1, "0", None]),
                    pack(["1", 0, None]), pack([1, 0.0, None]), b"\xc1", b""):
        with pytest.raises(ProtocolError):
            P.decode_reply(payload)


def test_encode_reply_status_enum_packs_as_int() -> None:
    assert P.encode_reply(3, Status.OBJECT_NOT_FOUND, "x") == pack([3, -704, "x"])
    assert P.encode_reply(3, 0, [Status.OBJECT_NOT_FOUND]) == pack([3, 0, [-704]])


# ------------------------------------------------------------ property tests

_leaf = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
         | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8)
         | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4))
         | st.sampled_from([b"doc/0001", b"", b"a\x00b", 0, 1, -704, 1 << 48]))
_obj = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=4) | st.binary(max_size=4), inner, max_size=3),
    max_leaves=12)
# Arrays that start like a request, so the field checkers see random values.
_near_request = st.builds(lambda rid, rest: [rid, *rest],
                          st.integers(0, 10), st.lists(_obj, max_size=6))
_op = st.sampled_from(sorted(OP_TO_TYPE)) | st.binary(max_size=2)


def _decode_or_protocol_error(op: bytes, payload: bytes) -> None:
    try:
        req_id, msg = P.decode_request(op, payload)
    except ProtocolError as exc:
        assert isinstance(exc.status, Status)
        return
    assert type(msg) is OP_TO_TYPE[op]
    assert 0 <= req_id < 1 << 63


@settings(max_examples=300, deadline=None)
@given(op=_op, payload=st.binary(max_size=64))
def test_random_bytes_decode_or_protocol_error(op: bytes, payload: bytes) -> None:
    _decode_or_protocol_error(op, payload)
    try:
        P.decode_reply(payload)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=_op, obj=_obj | _near_request)
def test_random_msgpack_decode_or_protocol_error(op: bytes, obj: Any) -> None:
    payload = pack(obj)
    _decode_or_protocol_error(op, payload)
    try:
        P.decode_reply(payload)
    except ProtocolError:
        pass


# ------------------------------------------------------------- the spec text

def _spec_rows(section: str) -> list[list[str]]:
    text = SPEC.read_text(encoding="utf-8")
    start = text.index(section)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_spec_op_table_matches_the_codec() -> None:
    rows = [r for r in _spec_rows("<!-- op-table -->") if r[0].startswith("`0x")]
    seen = {}
    for code, name, route, fields, *_ in rows:
        op = Op(bytes.fromhex(code.strip("`")[2:]))
        assert name.strip("`") == op.name
        assert (route == "master") == (op in MASTER_OPS), op.name
        cls = OP_TO_TYPE[op.value]
        assert re.findall(r"`(\w+)`", fields) == [f.name for f in dataclasses.fields(cls)], op.name
        seen[op] = True
    assert set(seen) == set(Op)


def test_spec_status_table_matches_the_codec() -> None:
    rows = [r for r in _spec_rows("<!-- status-table -->") if re.fullmatch(r"-?\d+", r[0])]
    table = {int(r[0]): r[1].strip("`") for r in rows}
    assert table == {s.value: s.name for s in Status}


@given(st.integers(1, 8).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n - 1), max_size=200))))
def test_positions_by_shard_partitions_positions_in_order(case: tuple[int, list[int]]) -> None:
    n, owner = case
    groups = P.positions_by_shard(owner, n)
    assert len(groups) == n
    for s, idx in enumerate(groups):
        assert idx == [i for i, o in enumerate(owner) if o == s]


_KEYISH = st.one_of(
    st.binary(min_size=0, max_size=8), st.sampled_from([b"\x00", b"k\x00", b"x" * P.KEY_MAX_BYTES,
                                                        b"x" * (P.KEY_MAX_BYTES + 1)]),
    st.text(max_size=4), st.integers(-2, 2), st.none(), st.booleans(),
    st.lists(st.binary(min_size=1, max_size=3), max_size=2))
_SIZEISH = st.one_of(st.integers(-2, 1 << 49), st.sampled_from([4096, 1, (1 << 48) - 1, 1 << 48]),
                     st.floats(allow_nan=False), st.booleans(), st.none(), st.binary(max_size=2))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keys=st.one_of(st.lists(_KEYISH, max_size=6), _KEYISH),
       sizes=st.one_of(st.lists(_SIZEISH, max_size=6),
                       st.lists(st.sampled_from([4096, 4096.0, True, 0]), min_size=1, max_size=6)))
def test_bounded_decode_agrees_with_the_general_one(keys: Any, sizes: Any) -> None:
    """The decode path for payloads whose bins are within KEY_MAX_BYTES accepts and refuses
    exactly what the general path does, with the same error text."""
    payload = pack([1, keys, sizes, None])

    def verdict(use_bounded: bool) -> Any:
        cls = P.OP_TO_TYPE[Op.BATCH_PUT_START.value]
        checks = cls.BOUNDED_CHECKS if use_bounded else cls.CHECKS
        obj = P.unpack_payload(payload)
        try:
            return ("ok", [c(v) for c, v in zip(checks, obj[1:])])
        except ProtocolError as exc:
            return ("error", str(exc))

    # The bounded checks are only used on payloads that unpack within the key bound.
    try:
        P._unpack_request(payload)
    except ValueError:
        return
    assert verdict(True) == verdict(False)
    try:
        _, msg = P.decode_request(Op.BATCH_PUT_START.value, payload)
        got = ("ok", [msg.keys, msg.sizes, msg.config])
    except ProtocolError as exc:
        got = ("error", str(exc))
    assert got == verdict(False)
