"""Write ``protocol/golden_vectors.json``: messages and the exact payload bytes they encode to.

Usage::

    python tools/gen_golden_vectors.py           # (re)write the file
    python tools/gen_golden_vectors.py --check   # exit 1 if the file is stale

Each vector is declared here as a message object (or a reply triple) and its
payload is packed from an explicit wire array built by :func:`wire_of`, which
follows ``protocol/PROTOCOL.md`` rather than calling the codec's encoder, so the
codec test compares two independent derivations.  The generator also checks
the codec against every vector and refuses to write a file the codec disagrees
with.  The output is deterministic: no clocks, no randomness.

JSON conventions: bytes are ``{"hex": "..."}``; a ``ReplicateConfig`` is an
object with its five field names; op codes and route frames are lowercase hex.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import zlib
from pathlib import Path
from typing import Any

import msgpack

from kvmaster import protocol as P
from kvmaster.protocol import Op, ReplicateConfigWire, SoftPinAction, Status

OUT = Path(__file__).resolve().parents[1] / "protocol" / "golden_vectors.json"

#: Routing context of the request vectors: the route frame of each key op is
#: the shard of its key(s) for this tenant and shard count.
TENANT = "default"
SHARD_COUNT = 4

SEG_A = "kvmaster-00112233aabbccdd"
SEG_B = "kvmaster-8899aabbccddeeff"

ASCII_KEY = b"doc/0001"
UNICODE_KEY = "κλειδί/键/🔑".encode()
MAX_KEY = (b"0123456789abcdef" * 256)[: P.KEY_MAX_BYTES]

CONFIG_ALL = ReplicateConfigWire(3, True, SoftPinAction.ENABLE, 60000, (SEG_A, SEG_B))
CONFIG_ENABLE_DEFAULT_TTL = ReplicateConfigWire(1, False, SoftPinAction.ENABLE, None, ())
CONFIG_DISABLE = ReplicateConfigWire(2, False, SoftPinAction.DISABLE, None, (SEG_B,))
CONFIG_HARD = ReplicateConfigWire(1, True, SoftPinAction.PRESERVE, None, ())


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def shard(key: bytes, tenant: str = TENANT, shard_count: int = SHARD_COUNT) -> int:
    """Spec formula, written out: CRC-32 (zlib/IEEE) of tenant || 0x00 || key."""
    return zlib.crc32(tenant.encode("utf-8") + b"\x00" + key) % shard_count


def route(key: bytes) -> str:
    return shard(key).to_bytes(2, "big").hex()


def same_shard_keys(prefix: str, n: int, target: int) -> list[bytes]:
    """The first ``n`` keys ``prefix<i>`` that route to shard ``target``."""
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        k = f"{prefix}{i}".encode()
        if shard(k) == target:
            out.append(k)
        i += 1
    return out


SESSION = b"chat-42"
SESSION_2 = b"chat-43"
UNICODE_SESSION = "会话-β".encode()

BATCH_KEYS = same_shard_keys("batch/", 3, 1)
BATCH_KEYS_2 = same_shard_keys("layer-0/block-", 2, 3)


# ---------------------------------------------------------------- JSON forms

def to_json(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray)):
        return {"hex": bytes(v).hex()}
    if isinstance(v, ReplicateConfigWire):
        return {
            "replica_num": v.replica_num,
            "with_hard_pin": v.with_hard_pin,
            "soft_pin_action": int(v.soft_pin_action),
            "soft_pin_ttl_ms": v.soft_pin_ttl_ms,
            "preferred_segments": list(v.preferred_segments),
        }
    if isinstance(v, (list, tuple)):
        return [to_json(x) for x in v]
    if isinstance(v, dict):
        return {k: to_json(x) for k, x in v.items()}
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return int(v)
    raise TypeError(f"no JSON form for {type(v).__name__}")


def config_wire(c: ReplicateConfigWire) -> list[Any]:
    """ReplicateConfig array, in the field order of PROTOCOL.md."""
    return [c.replica_num, c.with_hard_pin, int(c.soft_pin_action), c.soft_pin_ttl_ms,
            list(c.preferred_segments)]


def wire_of(msg: Any, req_id: int) -> list[Any]:
    """``[req_id, *fields]`` for a request message, built from the spec's field order."""
    out: list[Any] = [req_id]
    fields = dataclasses.fields(msg)
    for f in fields:
        v = getattr(msg, f.name)
        out.append(config_wire(v) if isinstance(v, ReplicateConfigWire) else v)
    # Optional fields (those with a default) left at it at the end (nil, or false for
    # columns) are not sent.
    while len(out) > 1 + msg.N_REQUIRED and out[-1] is fields[len(out) - 2].default:
        out.pop()
    return out


# ------------------------------------------------------------------ requests

def req(name: str, msg: Any, req_id: int, route_hex: str, *, wire: list[Any] | None = None,
        note: str = "") -> dict[str, Any]:
    """One request vector.  ``wire`` overrides the canonical array for decode-only vectors."""
    payload = _pack(wire if wire is not None else wire_of(msg, req_id))
    v: dict[str, Any] = {
        "name": name,
        "op": msg.OP.value.hex(),
        "op_name": msg.OP.name,
        "route": route_hex,
        "req_id": req_id,
        "fields": {f.name: to_json(getattr(msg, f.name)) for f in dataclasses.fields(msg)},
        "payload_hex": payload.hex(),
    }
    if wire is not None:
        v["decode_only"] = True
    if note:
        v["note"] = note
    return v


def requests() -> list[dict[str, Any]]:
    M = P.OP_TO_TYPE
    T = {op: M[op.value] for op in Op}
    r0 = P.MASTER_ROUTE.hex()
    b1 = f"{shard(BATCH_KEYS[0]):04x}"
    b2 = f"{shard(BATCH_KEYS_2[0]):04x}"
    out = [
        req("hello", T[Op.HELLO](1, 0, "node-7-4242-0f3c9a1b", TENANT, "node-7", "0.1.0"), 1, r0),
        req("hello_unicode_tenant_newer_minor",
            T[Op.HELLO](1, 3, "node-7-4243-77aa01fe", "租户-α", "", ""), 1, r0,
            note="a newer minor is accepted (and logged) by a 1.0 master; empty host_id and "
                 "client_version are allowed"),
        req("heartbeat", T[Op.HEARTBEAT](), 2, r0),
        req("heartbeat_uint64_req_id", T[Op.HEARTBEAT](), (1 << 40) + 5, r0,
            note="req_id above 2^32 packs as msgpack uint64 (0xcf)"),
        req("mount_segment", T[Op.MOUNT_SEGMENT](SEG_A, 16 << 20, "node-7", "shm"), 3, r0),
        req("unmount_segment", T[Op.UNMOUNT_SEGMENT](SEG_A), 4, r0),
        req("bye", T[Op.BYE](), 5, r0),
        req("stats", T[Op.STATS](), 6, r0),
        req("check_consistency", T[Op.CHECK_CONSISTENCY](), 40, r0),
        req("list_clients", T[Op.LIST_CLIENTS](), 60, r0),
        req("list_segments", T[Op.LIST_SEGMENTS](), 61, r0),
        req("get_config", T[Op.GET_CONFIG](), 62, r0),
        req("exist_key", T[Op.EXIST_KEY](ASCII_KEY), 7, route(ASCII_KEY)),
        req("exist_key_max_length_key", T[Op.EXIST_KEY](MAX_KEY), 8, route(MAX_KEY),
            note=f"key of exactly {P.KEY_MAX_BYTES} bytes (bin16)"),
        req("exist_key_unicode_key", T[Op.EXIST_KEY](UNICODE_KEY), 9, route(UNICODE_KEY),
            note="the key is the UTF-8 bytes of 'κλειδί/键/🔑', sent as bin"),
        req("batch_exist_key", T[Op.BATCH_EXIST_KEY](list(BATCH_KEYS)), 10, b1,
            note="all keys of one batch request route to the same shard"),
        req("get_replica_list", T[Op.GET_REPLICA_LIST](ASCII_KEY), 11, route(ASCII_KEY)),
        req("get_replica_list_unicode_key", T[Op.GET_REPLICA_LIST](UNICODE_KEY), 12,
            route(UNICODE_KEY)),
        req("batch_get_replica_list", T[Op.BATCH_GET_REPLICA_LIST](list(BATCH_KEYS_2)), 13, b2),
        req("batch_get_replica_list_columns",
            T[Op.BATCH_GET_REPLICA_LIST](list(BATCH_KEYS_2), True), 65, b2,
            note="protocol 1.1: columns true asks for the columnar reply"),
        req("get_replica_list_with_checksum", T[Op.GET_REPLICA_LIST](ASCII_KEY, True), 80,
            route(ASCII_KEY),
            note="protocol 1.4: with_checksum true asks for the object's checksum (a fourth "
                 "item of the reply)"),
        req("batch_get_replica_list_columns_with_checksum",
            T[Op.BATCH_GET_REPLICA_LIST](list(BATCH_KEYS_2), True, True), 81, b2,
            note="protocol 1.4: with_checksum (after columns) adds the checksums column"),
        req("put_start_default_config", T[Op.PUT_START](ASCII_KEY, 4096, P.DEFAULT_CONFIG), 14,
            route(ASCII_KEY)),
        req("put_start_config_all_fields", T[Op.PUT_START](UNICODE_KEY, 1 << 20, CONFIG_ALL), 15,
            route(UNICODE_KEY),
            note="replica_num 3, hard pin, soft pin ENABLE with a TTL, two preferred segments"),
        req("put_start_max_key_max_size",
            T[Op.PUT_START](MAX_KEY, (1 << 48) - 1, CONFIG_ENABLE_DEFAULT_TTL), 16, route(MAX_KEY),
            note="largest key and largest size; ENABLE with a nil TTL uses the master default"),
        req("put_start_nil_config", T[Op.PUT_START](ASCII_KEY, 4096, P.DEFAULT_CONFIG), 17,
            route(ASCII_KEY), wire=[17, ASCII_KEY, 4096, None],
            note="nil config means the default config; the codec re-encodes it as the full array"),
        req("put_start_short_config",
            T[Op.PUT_START](ASCII_KEY, 4096, ReplicateConfigWire(2)), 18, route(ASCII_KEY),
            wire=[18, ASCII_KEY, 4096, [2]],
            note="omitted trailing config fields take their defaults"),
        req("put_start_extra_trailing_fields",
            T[Op.PUT_START](ASCII_KEY, 4096, P.DEFAULT_CONFIG), 19, route(ASCII_KEY),
            wire=[19, ASCII_KEY, 4096, [1, False, 0, None, [], "future"], None, "future", 7],
            note="extra trailing fields (of a newer minor version) are ignored, in the request "
                 "array (after the optional write_id, nil here) and in the config array"),
        req("put_start_with_write_id",
            T[Op.PUT_START](ASCII_KEY, 4096, P.DEFAULT_CONFIG, 0x5EED0001), 63, route(ASCII_KEY),
            note="optional write_id (every start op): the client's id for this write"),
        req("batch_put_start", T[Op.BATCH_PUT_START](list(BATCH_KEYS), [4096, 1, 65536],
                                                    CONFIG_DISABLE), 20, b1),
        req("batch_put_start_columns",
            T[Op.BATCH_PUT_START](list(BATCH_KEYS), [4096, 1, 65536], ReplicateConfigWire(2),
                                  None, True), 66, b1,
            note="protocol 1.1: columns true (after write_id, nil here) asks for the "
                 "columnar reply; every batch start op and BATCH_GET_REPLICA_LIST take it"),
        req("batch_put_start_group_ids",
            T[Op.BATCH_PUT_START](list(BATCH_KEYS), [4096, 1, 65536], P.DEFAULT_CONFIG,
                                  None, True, [b"page-7", b"page-7", b""]), 68, b1,
            note="protocol 1.3: group_ids (after columns), one per key; an empty id joins "
                 "no group (BATCH_UPSERT_START takes it too)"),
        req("batch_put_start_session_tags",
            T[Op.BATCH_PUT_START](list(BATCH_KEYS), [4096, 1, 65536], P.DEFAULT_CONFIG,
                                  None, True, None, [b"conv-7", b"", b"conv-7"]), 91, b1,
            note="protocol 1.5: session_tags (after group_ids, nil here), one per key; "
                 "empty: none (Mooncake's session_ids; BATCH_UPSERT_START takes it too)"),
        req("put_end", T[Op.PUT_END](ASCII_KEY), 21, route(ASCII_KEY)),
        req("batch_put_end", T[Op.BATCH_PUT_END](list(BATCH_KEYS)), 22, b1),
        req("put_end_of_one_write", T[Op.PUT_END](ASCII_KEY, 0x5EED0001), 67,
            route(ASCII_KEY),
            note="ends only the caller's write whose start gave this write_id; sent again "
                 "after it was applied, answered 0 again"),
        req("batch_put_end_of_one_write",
            T[Op.BATCH_PUT_END](list(BATCH_KEYS), 0x5EED0002), 68, b1),
        req("put_end_with_checksum",
            T[Op.PUT_END](ASCII_KEY, 0x5EED0001, checksum(CHECKSUM_DATA[2][1])), 82,
            route(ASCII_KEY),
            note="protocol 1.4: the xxh3_64 of the value's bytes (here the 'kvmaster' "
                 "vector of the checksums section)"),
        req("batch_put_end_with_checksums",
            T[Op.BATCH_PUT_END](list(BATCH_KEYS), 0x5EED0002,
                                [checksum(CHECKSUM_DATA[0][1]), None, (1 << 64) - 1]), 83, b1,
            note="protocol 1.4: one checksum per key; nil stores that key without one; "
                 "values up to 2^64-1 pack as uint64"),
        req("put_revoke", T[Op.PUT_REVOKE](ASCII_KEY), 23, route(ASCII_KEY)),
        req("batch_put_revoke", T[Op.BATCH_PUT_REVOKE](list(BATCH_KEYS_2)), 24, b2),
        req("put_revoke_of_one_write", T[Op.PUT_REVOKE](ASCII_KEY, 0x5EED0001), 64,
            route(ASCII_KEY),
            note="revokes only the caller's write whose start gave this write_id"),
        req("batch_put_revoke_of_one_write",
            T[Op.BATCH_PUT_REVOKE](list(BATCH_KEYS_2), 0x5EED0002), 65, b2),
        req("upsert_start", T[Op.UPSERT_START](ASCII_KEY, 8192, CONFIG_HARD), 25,
            route(ASCII_KEY)),
        req("batch_upsert_start", T[Op.BATCH_UPSERT_START](list(BATCH_KEYS_2), [100, 200],
                                                          CONFIG_ALL), 26, b2),
        req("remove", T[Op.REMOVE](ASCII_KEY, False), 27, route(ASCII_KEY)),
        req("remove_force_unicode_key", T[Op.REMOVE](UNICODE_KEY, True), 28, route(UNICODE_KEY)),
        req("batch_remove", T[Op.BATCH_REMOVE](list(BATCH_KEYS), True), 29, b1),
        req("remove_all", T[Op.REMOVE_ALL](False), 30, "0002",
            note="sent once to every shard; the route names the shard, not a key"),
        req("remove_by_regex", T[Op.REMOVE_BY_REGEX]("^req-1/blk-[0-9]+$", False), 79, "0001",
            note="sent once to every shard, as remove_all; RE2 syntax, a search"),
        req("get_size", T[Op.GET_SIZE](ASCII_KEY), 31, route(ASCII_KEY)),
        req("query_key", T[Op.QUERY_KEY](UNICODE_KEY), 32, route(UNICODE_KEY)),
        req("replica_clear_all_replicas", T[Op.REPLICA_CLEAR](list(BATCH_KEYS), ""), 70, b1,
            note="one request per shard of the keys; empty segment: whole objects"),
        req("replica_clear_one_segment", T[Op.REPLICA_CLEAR]([ASCII_KEY], "localhost:12345"),
            71, route(ASCII_KEY), note="a segment's name or its label"),
        req("batch_probe_key", T[Op.BATCH_PROBE_KEY](list(BATCH_KEYS)), 72, b1),
        req("drop_corrupt_replicas",
            T[Op.DROP_CORRUPT_REPLICAS](list(BATCH_KEYS[:2]), [[SEG_A, 4096], [SEG_B, 0]],
                                        [checksum(CHECKSUM_DATA[3][1]), 7]), 84, b1,
            note="protocol 1.4: one replica and the checksum it failed per key; keys of the "
                 "shard it is routed to"),
        req("copy_replicas_prepare_copy",
            T[Op.COPY_REPLICAS_PREPARE](ASCII_KEY, [SEG_B, "localhost:10003"], ""), 73,
            route(ASCII_KEY)),
        req("copy_replicas_prepare_move",
            T[Op.COPY_REPLICAS_PREPARE](ASCII_KEY, [SEG_B], SEG_A), 74, route(ASCII_KEY),
            note="a move: one target, the source segment holding a replica"),
        req("copy_replicas_commit", T[Op.COPY_REPLICAS_COMMIT](ASCII_KEY, 0x1234ABCD, True), 75,
            route(ASCII_KEY)),
        req("copy_replicas_commit_abandon",
            T[Op.COPY_REPLICAS_COMMIT](ASCII_KEY, 0x1234ABCD, False), 76, route(ASCII_KEY)),
        req("set_segment_label", T[Op.SET_SEGMENT_LABEL](SEG_A, "localhost:12345"), 77, "0001",
            note="sent once to every shard; the route names the shard"),
        req("segment_labels", T[Op.SEGMENT_LABELS](), 78, "0000",
            note="any shard answers: every shard holds every label"),
        req("attach_kv_session",
            T[Op.ATTACH_KV_SESSION](SESSION, [ASCII_KEY, UNICODE_KEY, BATCH_KEYS[0]]), 41,
            route(SESSION),
            note="routed to the session's home shard; the keys may live on any shard"),
        req("attach_kv_session_unicode_session_id",
            T[Op.ATTACH_KV_SESSION](UNICODE_SESSION, [ASCII_KEY]), 42, route(UNICODE_SESSION)),
        req("set_kv_session_pin", T[Op.SET_KV_SESSION_PIN](SESSION, True), 43, route(SESSION)),
        req("set_kv_session_unpin", T[Op.SET_KV_SESSION_PIN](SESSION, False), 44,
            route(SESSION)),
        req("update_kv_session_first_page",
            T[Op.UPDATE_KV_SESSION](SESSION, [ASCII_KEY, BATCH_KEYS[1]], 0x00C0FFEE12345678,
                                    False), 45, route(SESSION),
            note="non-final page: staged under (client, token) until the final page"),
        req("update_kv_session_final_page",
            T[Op.UPDATE_KV_SESSION](SESSION, [UNICODE_KEY], 0x00C0FFEE12345678, True), 46,
            route(SESSION)),
        req("update_kv_session_numbered_page",
            T[Op.UPDATE_KV_SESSION](SESSION, [UNICODE_KEY], 0x00C0FFEE12345678, True, 1), 46,
            route(SESSION),
            note="optional page index (from 0): taken only after every earlier page of "
                 "the token; otherwise UPDATE_DISCARDED"),
        req("update_kv_session_empty_keep_set",
            T[Op.UPDATE_KV_SESSION](SESSION_2, [], 7, True), 47, route(SESSION_2),
            note="a complete, empty keep set removes every member"),
        req("close_kv_session", T[Op.CLOSE_KV_SESSION](SESSION), 48, route(SESSION)),
        req("get_kv_session", T[Op.GET_KV_SESSION](SESSION), 49, route(SESSION)),
        req("list_kv_session_keys_first_page",
            T[Op.LIST_KV_SESSION_KEYS](SESSION, b"", 1024), 50, route(SESSION),
            note="empty cursor: start from the smallest member"),
        req("list_kv_session_keys_after_cursor",
            T[Op.LIST_KV_SESSION_KEYS](UNICODE_SESSION, UNICODE_KEY, 2), 51,
            route(UNICODE_SESSION)),
        req("put_start_with_kv_sessions",
            T[Op.PUT_START_WITH_KV_SESSIONS](ASCII_KEY, 4096, P.DEFAULT_CONFIG,
                                             [SESSION, SESSION_2]), 52, route(ASCII_KEY),
            note="routed to the key's shard, like PUT_START"),
        req("put_start_with_kv_sessions_config_all_fields",
            T[Op.PUT_START_WITH_KV_SESSIONS](UNICODE_KEY, 1 << 20, CONFIG_ALL, [UNICODE_SESSION]),
            53, route(UNICODE_KEY)),
        req("batch_put_start_with_kv_sessions",
            T[Op.BATCH_PUT_START_WITH_KV_SESSIONS](list(BATCH_KEYS), [4096, 4096, 4096],
                                                   P.DEFAULT_CONFIG,
                                                   [[SESSION], [], [SESSION, SESSION_2]]),
            54, b1, note="one session-id list per key, possibly empty"),
        req("upsert_start_with_kv_sessions",
            T[Op.UPSERT_START_WITH_KV_SESSIONS](UNICODE_KEY, 100, CONFIG_HARD, [SESSION]), 55,
            route(UNICODE_KEY)),
        req("batch_upsert_start_with_kv_sessions",
            T[Op.BATCH_UPSERT_START_WITH_KV_SESSIONS](list(BATCH_KEYS_2), [10, 20],
                                                      CONFIG_DISABLE, [[SESSION_2], [SESSION_2]]),
            56, b2),
    ]
    return out


# ------------------------------------------------------------------- replies

def rep(name: str, op: Op | bytes, req_id: int, status: int, body: Any,
        note: str = "") -> dict[str, Any]:
    status = int(status)
    code = op.value if isinstance(op, Op) else op
    v: dict[str, Any] = {
        "name": name,
        "op": code.hex(),
        "op_name": op.name if isinstance(op, Op) else None,
        "req_id": req_id,
        "status": status,
        "status_name": Status(status).name,
        "body": to_json(body),
        "payload_hex": _pack([req_id, status, body]).hex(),
    }
    if note:
        v["note"] = note
    return v


def replies() -> list[dict[str, Any]]:
    S = Status
    welcome = {
        "master_version": "0.1.0",
        "protocol": list(P.PROTOCOL_VERSION),
        "shard_count": SHARD_COUNT,
        "tenant": TENANT,
        "lease_ttl_ms": 10000,
        "client_ttl_ms": 10000,
        "put_start_release_timeout_ms": 600000,
        "limits": {"max_batch": 4096, "max_key_bytes": P.KEY_MAX_BYTES,
                   "kv_session_max_batch": 4096, "kv_sessions": True},
        "master_host_id": "node-1",
        "master_instance": "5f0c2a9e41d7b836",
        "batch_any_shard": True,
    }
    share = (16 << 20) // SHARD_COUNT
    desc = [4096, 10000, [[SEG_A, 64], [SEG_B, share + 128]]]
    stats = {
        "state": "running", "clients": 2, "segments": 2,
        "front": {"rejected_busy": 0, "rejected_unregistered": 1, "malformed": 0,
                  "reply_dropped": 0, "clients_expired": 0, "hello": 3},
        "total": {"keys": 10, "pending_writes": 1},
        "shards": [{"shard": 0, "keys": 4, "pending_writes": 0},
                   {"shard": 1, "keys": 6, "pending_writes": 1}],
    }
    return [
        rep("welcome", Op.HELLO, 1, 0, welcome),
        rep("hello_version_mismatch", Op.HELLO, 1, S.VERSION_MISMATCH,
            "protocol 2.0 not supported; master speaks 1.x"),
        rep("heartbeat_ok", Op.HEARTBEAT, 2, 0, 0),
        rep("mount_segment_ok", Op.MOUNT_SEGMENT, 3, 0, 16 << 20,
            note="body: usable bytes (sum of the per-shard shares)"),
        rep("mount_segment_exists", Op.MOUNT_SEGMENT, 3, S.SEGMENT_ALREADY_EXISTS,
            f"segment {SEG_A} is already mounted"),
        rep("unmount_segment_ok", Op.UNMOUNT_SEGMENT, 4, 0, 3,
            note="body: objects erased because their last replica was on the segment"),
        rep("bye_ok", Op.BYE, 5, 0, 0),
        rep("stats_ok", Op.STATS, 6, 0, stats,
            note="abridged; the real body carries more counters"),
        rep("exist_key_yes", Op.EXIST_KEY, 7, 0, 1),
        rep("batch_exist_key", Op.BATCH_EXIST_KEY, 10, 0, [1, 0, 1]),
        rep("get_replica_list_ok", Op.GET_REPLICA_LIST, 11, 0, desc,
            note="[size, lease_ttl_ms, [[segment, offset], ...]]"),
        rep("get_replica_list_not_found", Op.GET_REPLICA_LIST, 12, S.OBJECT_NOT_FOUND,
            "object not found"),
        rep("batch_get_replica_list_mixed", Op.BATCH_GET_REPLICA_LIST, 13, 0,
            [desc, S.OBJECT_NOT_FOUND]),
        rep("batch_get_replica_list_columns_mixed", Op.BATCH_GET_REPLICA_LIST, 65, 0,
            P.replica_columns([desc, S.OBJECT_NOT_FOUND], True),
            note="[segments, first, offsets, more, sizes, lease_ttl_ms]"),
        rep("get_replica_list_with_checksum_ok", Op.GET_REPLICA_LIST, 80, 0,
            [*desc, checksum(CHECKSUM_DATA[2][1])],
            note="[size, lease_ttl_ms, replicas, checksum]: asked with with_checksum (1.4)"),
        rep("get_replica_list_with_checksum_none", Op.GET_REPLICA_LIST, 80, 0, [*desc, None],
            note="an object stored without a checksum: nil (read unverified)"),
        rep("batch_get_replica_list_columns_with_checksum", Op.BATCH_GET_REPLICA_LIST, 81, 0,
            P.replica_columns([[*desc, checksum(CHECKSUM_DATA[2][1])], S.OBJECT_NOT_FOUND,
                               [4096, 10000, [[SEG_B, 0]], None]], True),
            note="[segments, first, offsets, more, sizes, lease_ttl_ms, checksums]: per key "
                 "the checksum, nil for a missing key or an object without one"),
        rep("put_start_ok", Op.PUT_START, 14, 0, [[SEG_A, 4096]]),
        rep("put_start_three_replicas", Op.PUT_START, 15, 0,
            [[SEG_A, 8192], [SEG_B, share + 64], ["kvmaster-0f0f0f0f0f0f0f0f", 0]]),
        rep("put_start_exists", Op.PUT_START, 14, S.OBJECT_ALREADY_EXISTS,
            "object already exists or is being written"),
        rep("put_start_no_space", Op.PUT_START, 16, S.NO_AVAILABLE_HANDLE,
            "no space: insufficient segment capacity after eviction"),
        rep("batch_put_start_mixed", Op.BATCH_PUT_START, 20, 0,
            [[[SEG_A, 0]], S.OBJECT_ALREADY_EXISTS, S.NO_AVAILABLE_HANDLE]),
        rep("batch_put_start_columns_mixed", Op.BATCH_PUT_START, 66, 0,
            P.replica_columns([[[SEG_A, 0], [SEG_B, 0]], S.OBJECT_ALREADY_EXISTS,
                               [[SEG_B, 4096], [SEG_A, 8192]]], False),
            note="[segments, first, offsets, more]: first is a segment index or the key's "
                 "status; more holds [position, further replicas] for keys with several"),
        rep("put_end_ok", Op.PUT_END, 21, 0, 0),
        rep("put_end_other_writer", Op.PUT_END, 21, S.ILLEGAL_CLIENT,
            "another client started this write"),
        rep("batch_put_end_mixed", Op.BATCH_PUT_END, 22, 0,
            [0, S.OBJECT_NOT_FOUND, S.ILLEGAL_CLIENT]),
        rep("put_end_segment_unmounted", Op.PUT_END, 21, S.SEGMENT_NOT_FOUND,
            f"segment {SEG_A} holding this write was unmounted (its owner left); the write "
            "is dropped: start it again"),
        rep("batch_put_end_segment_unmounted", Op.BATCH_PUT_END, 22, 0,
            [0, S.SEGMENT_NOT_FOUND]),
        rep("put_revoke_ok", Op.PUT_REVOKE, 23, 0, 0),
        rep("batch_put_revoke_mixed", Op.BATCH_PUT_REVOKE, 24, 0, [0, S.OBJECT_NOT_FOUND]),
        rep("upsert_start_ok", Op.UPSERT_START, 25, 0, [[SEG_B, 1024]]),
        rep("batch_upsert_start_mixed", Op.BATCH_UPSERT_START, 26, 0,
            [[[SEG_A, 128], [SEG_B, 4096]], S.INVALID_PARAMS]),
        rep("remove_ok", Op.REMOVE, 27, 0, 0),
        rep("remove_leased", Op.REMOVE, 27, S.OBJECT_HAS_LEASE,
            "object has a read lease (use force)"),
        rep("batch_remove_mixed", Op.BATCH_REMOVE, 29, 0,
            [0, S.OBJECT_HAS_LEASE, S.REPLICA_IS_NOT_READY, S.OBJECT_NOT_FOUND]),
        rep("remove_all_ok", Op.REMOVE_ALL, 30, 0, 12),
        rep("remove_by_regex_ok", Op.REMOVE_BY_REGEX, 79, 0, 3),
        rep("remove_by_regex_bad_pattern", Op.REMOVE_BY_REGEX, 79, S.INVALID_PARAMS,
            "invalid regex (RE2 syntax, no backreferences or lookaround): invalid escape"),
        rep("get_size_ok", Op.GET_SIZE, 31, 0, 4096),
        rep("query_key_complete", Op.QUERY_KEY, 32, 0,
            {"state": "COMPLETE", "size": 4096, "replicas": [[SEG_A, 64]], "lease_ms_left": 8120,
             "soft_pinned": False, "hard_pinned": True}),
        rep("query_key_with_checksum", Op.QUERY_KEY, 32, 0,
            {"state": "COMPLETE", "size": 8, "replicas": [[SEG_A, 64]], "lease_ms_left": 0,
             "soft_pinned": False, "hard_pinned": False, "sessions": [],
             "checksum": checksum(CHECKSUM_DATA[2][1])},
            note="protocol 1.4: checksum, when its writer sent one"),
        rep("query_key_processing", Op.QUERY_KEY, 32, 0,
            {"state": "PROCESSING",
             "pending_write": {"client_id": "node-7-4242-0f3c9a1b", "size": 4096, "age_ms": 15}}),
        rep("replica_clear_ok", Op.REPLICA_CLEAR, 70, 0, [BATCH_KEYS[0], BATCH_KEYS[2]]),
        rep("batch_probe_key_ok", Op.BATCH_PROBE_KEY, 72, 0, [1, 0, 1]),
        rep("drop_corrupt_replicas_mixed", Op.DROP_CORRUPT_REPLICAS, 84, 0,
            [0, S.OBJECT_NOT_FOUND],
            note="0: dropped (the object went with its last replica); OBJECT_NOT_FOUND: no "
                 "such object, replica or checksum any more"),
        rep("copy_replicas_prepare_ok", Op.COPY_REPLICAS_PREPARE, 73, 0,
            [4096, 10000, [[SEG_A, 64]], [[SEG_B, 8192]], 0x1234ABCD]),
        rep("copy_replicas_prepare_unknown_segment", Op.COPY_REPLICAS_PREPARE, 73,
            S.INVALID_PARAMS, "unknown target segment 'localhost:10003'"),
        rep("copy_replicas_commit_ok", Op.COPY_REPLICAS_COMMIT, 75, 0, 0),
        rep("set_segment_label_ok", Op.SET_SEGMENT_LABEL, 77, 0, 0),
        rep("segment_labels_ok", Op.SEGMENT_LABELS, 78, 0, {SEG_A: "localhost:12345"}),
        rep("check_consistency_ok", Op.CHECK_CONSISTENCY, 40, 0, []),
        rep("list_clients_ok", Op.LIST_CLIENTS, 60, 0,
            [{"client_id": "node-7-4242-0f3c9a1b", "tenant": "default", "host_id": "node-7",
              "idle_ms": 120, "segments": [SEG_A]}]),
        rep("list_segments_ok", Op.LIST_SEGMENTS, 61, 0,
            [{"name": SEG_A, "owner": "node-7-4242-0f3c9a1b", "size": 16 << 20,
              "usable": 16 << 20, "host_id": "node-7", "transport": "shm",
              "allocated": 8192}]),
        rep("check_consistency_problems", Op.CHECK_CONSISTENCY, 40, 0,
            ["shard 1: used counter 4160 drifted"]),
        rep("attach_kv_session_mixed", Op.ATTACH_KV_SESSION, 41, 0,
            [0, S.OBJECT_NOT_FOUND, S.SESSION_LIMIT_EXCEEDED]),
        rep("set_kv_session_pin_ok", Op.SET_KV_SESSION_PIN, 43, 0, 0),
        rep("set_kv_session_pin_not_found", Op.SET_KV_SESSION_PIN, 43, S.SESSION_NOT_FOUND,
            "session not found (register KV first)"),
        rep("update_kv_session_staged", Op.UPDATE_KV_SESSION, 45, 0, 2,
            note="non-final page: keys staged so far"),
        rep("update_kv_session_final", Op.UPDATE_KV_SESSION, 46, 0, 1,
            note="final page: members removed"),
        rep("update_kv_session_discarded", Op.UPDATE_KV_SESSION, 47, S.UPDATE_DISCARDED,
            "the earlier pages of this keep set were discarded (expired, replaced by a newer "
            "update of the session, or the client left); nothing changed; send the keep set "
            "again from its first page with a new token",
            note="a page whose earlier pages are gone: send the keep set again, new token"),
        rep("close_kv_session_ok", Op.CLOSE_KV_SESSION, 48, 0, 0),
        rep("get_kv_session_ok", Op.GET_KV_SESSION, 49, 0, [SESSION, True, 17],
            note="[session_id, pinned, member_count]"),
        rep("get_kv_session_not_found", Op.GET_KV_SESSION, 49, S.SESSION_NOT_FOUND,
            "session not found"),
        rep("list_kv_session_keys_more", Op.LIST_KV_SESSION_KEYS, 50, 0,
            [[BATCH_KEYS[0], BATCH_KEYS[1]], BATCH_KEYS[1]],
            note="[keys, next_cursor]: more members follow next_cursor"),
        rep("list_kv_session_keys_done", Op.LIST_KV_SESSION_KEYS, 51, 0, [[ASCII_KEY], b""],
            note="empty next_cursor: this was the last page"),
        rep("put_start_with_kv_sessions_ok", Op.PUT_START_WITH_KV_SESSIONS, 52, 0,
            [[SEG_A, 12288]]),
        rep("put_start_with_kv_sessions_refused", Op.PUT_START_WITH_KV_SESSIONS, 52,
            S.SESSION_LIMIT_EXCEEDED, "session limit exceeded"),
        rep("batch_put_start_with_kv_sessions_mixed", Op.BATCH_PUT_START_WITH_KV_SESSIONS, 54, 0,
            [[[SEG_B, 0]], S.OBJECT_ALREADY_EXISTS, S.SESSION_LIMIT_EXCEEDED]),
        rep("sessions_disabled", Op.GET_KV_SESSION, 49, S.UNSUPPORTED,
            "sessions are disabled on this master"),
        rep("not_registered", Op.EXIST_KEY, 7, S.NOT_REGISTERED,
            "send HELLO before other requests"),
        rep("busy", Op.GET_REPLICA_LIST, 11, S.BUSY, "shard inbox full, retry later"),
        rep("shutting_down", Op.PUT_START, 14, S.SHUTTING_DOWN, "master is shutting down"),
        rep("wrong_shard", Op.EXIST_KEY, 7, S.INVALID_PARAMS, "key routed to the wrong shard"),
        rep("unparseable_payload", Op.EXIST_KEY, 0, S.INVALID_PARAMS,
            "payload is not valid msgpack: FormatError",
            note="req_id 0: the payload could not be parsed far enough to read one"),
        rep("unknown_op", b"\x7f", 9, S.UNSUPPORTED, "unknown op 7f",
            note="the op frame of a reply echoes the request's, even an unknown one"),
        rep("internal_error", Op.STATS, 6, S.INTERNAL_ERROR, "internal error: KeyError"),
    ]


# ------------------------------------------------------------ invalid inputs

def bad(name: str, op: bytes, payload: bytes, status: Status) -> dict[str, Any]:
    return {"name": name, "op": op.hex(), "payload_hex": payload.hex(), "status": int(status),
            "status_name": status.name}


def invalid_requests() -> list[dict[str, Any]]:
    S = Status.INVALID_PARAMS
    ex, ps = Op.EXIST_KEY.value, Op.PUT_START.value
    k = ASCII_KEY
    return [
        bad("unknown_op", b"\x7f", _pack([1]), Status.UNSUPPORTED),
        bad("unknown_op_garbage_payload", b"\x00", b"\xc1", Status.UNSUPPORTED),
        bad("empty_op_frame", b"", _pack([1]), Status.UNSUPPORTED),
        bad("two_byte_op_frame", b"\x10\x10", _pack([1, k]), Status.UNSUPPORTED),
        bad("not_msgpack", ex, b"\xc1", S),
        bad("truncated_msgpack", ex, _pack([7, k])[:-2], S),
        bad("trailing_bytes_after_payload", ex, _pack([7, k]) + b"\x00", S),
        bad("payload_is_a_map", ex, _pack({"req_id": 7, "key": k}), S),
        bad("payload_is_empty_array", ex, _pack([]), S),
        bad("negative_req_id", ex, _pack([-1, k]), S),
        bad("req_id_2_63", ex, _pack([1 << 63, k]), S),
        bad("missing_field", ex, _pack([7]), S),
        bad("key_as_str", ex, _pack([7, "doc/0001"]), S),
        bad("empty_key", ex, _pack([7, b""]), S),
        bad("key_with_nul", ex, _pack([7, b"doc\x000001"]), S),
        bad("key_too_long", ex, _pack([7, b"k" * (P.KEY_MAX_BYTES + 1)]), S),
        bad("batch_keys_not_array", Op.BATCH_EXIST_KEY.value, _pack([10, k]), S),
        bad("size_zero", ps, _pack([14, k, 0, None]), S),
        bad("size_2_48", ps, _pack([14, k, 1 << 48, None]), S),
        bad("size_as_float", ps, _pack([14, k, 4096.0, None]), S),
        bad("batch_size_zero", Op.BATCH_PUT_START.value, _pack([20, [k], [0], None]), S),
        bad("config_not_array", ps, _pack([14, k, 4096, {"replica_num": 1}]), S),
        bad("config_empty_array", ps, _pack([14, k, 4096, []]), S),
        bad("config_replica_num_zero", ps, _pack([14, k, 4096, [0]]), S),
        bad("config_replica_num_65", ps, _pack([14, k, 4096, [65]]), S),
        bad("config_hard_pin_as_int", ps, _pack([14, k, 4096, [1, 1]]), S),
        bad("config_soft_pin_action_3", ps, _pack([14, k, 4096, [1, False, 3]]), S),
        bad("config_ttl_with_preserve", ps, _pack([14, k, 4096, [1, False, 0, 1000, []]]), S),
        bad("config_ttl_with_disable", ps, _pack([14, k, 4096, [1, False, 2, 1000, []]]), S),
        bad("config_ttl_zero", ps, _pack([14, k, 4096, [1, False, 1, 0, []]]), S),
        bad("config_preferred_not_strings", ps, _pack([14, k, 4096, [1, False, 0, None, [b"a"]]]),
            S),
        bad("force_as_int", Op.REMOVE.value, _pack([27, k, 1]), S),
        bad("write_id_zero", ps, _pack([14, k, 4096, None, 0]), S),
        bad("write_id_as_bytes", Op.PUT_REVOKE.value, _pack([23, k, b"\x01"]), S),
        bad("hello_empty_client_id", Op.HELLO.value, _pack([1, 1, 0, "", TENANT, "", ""]), S),
        bad("hello_tenant_with_nul", Op.HELLO.value, _pack([1, 1, 0, "c", "a\x00b", "", ""]), S),
        bad("hello_major_256", Op.HELLO.value, _pack([1, 256, 0, "c", TENANT, "", ""]), S),
        bad("mount_size_zero", Op.MOUNT_SEGMENT.value, _pack([3, SEG_A, 0, "", "shm"]), S),
        bad("mount_size_over_2_48", Op.MOUNT_SEGMENT.value,
            _pack([3, SEG_A, (1 << 48) + 1, "", "shm"]), S),
        bad("session_id_empty", Op.GET_KV_SESSION.value, _pack([49, b""]), S),
        bad("session_id_as_str", Op.GET_KV_SESSION.value, _pack([49, "chat-42"]), S),
        bad("pin_flag_as_int", Op.SET_KV_SESSION_PIN.value, _pack([43, SESSION, 1]), S),
        bad("update_token_negative", Op.UPDATE_KV_SESSION.value,
            _pack([45, SESSION, [k], -1, True]), S),
        bad("update_final_missing", Op.UPDATE_KV_SESSION.value, _pack([45, SESSION, [k], 1]), S),
        bad("update_page_negative", Op.UPDATE_KV_SESSION.value,
            _pack([45, SESSION, [k], 1, True, -1]), S),
        bad("list_cursor_with_nul", Op.LIST_KV_SESSION_KEYS.value,
            _pack([50, SESSION, b"a\x00", 10]), S),
        bad("list_cursor_as_nil", Op.LIST_KV_SESSION_KEYS.value, _pack([50, SESSION, None, 10]),
            S),
        bad("list_limit_zero", Op.LIST_KV_SESSION_KEYS.value, _pack([50, SESSION, b"", 0]), S),
        bad("list_limit_2_20_plus_1", Op.LIST_KV_SESSION_KEYS.value,
            _pack([50, SESSION, b"", (1 << 20) + 1]), S),
        bad("tagged_put_sessions_missing", Op.PUT_START_WITH_KV_SESSIONS.value,
            _pack([52, k, 4096, None]), S),
        bad("tagged_put_session_id_empty", Op.PUT_START_WITH_KV_SESSIONS.value,
            _pack([52, k, 4096, None, [b""]]), S),
        bad("tagged_batch_flat_session_list", Op.BATCH_PUT_START_WITH_KV_SESSIONS.value,
            _pack([54, [k], [4096], None, [SESSION]]), S),
        bad("put_end_checksum_as_float", Op.PUT_END.value, _pack([21, k, 1, 7.0]), S),
        bad("put_end_checksum_negative", Op.PUT_END.value, _pack([21, k, 1, -1]), S),
        bad("batch_put_end_checksums_not_list", Op.BATCH_PUT_END.value,
            _pack([22, [k], 1, 7]), S),
        bad("get_replica_list_with_checksum_as_int", Op.GET_REPLICA_LIST.value,
            _pack([11, k, 1]), S),
        bad("drop_corrupt_replicas_expected_nil", Op.DROP_CORRUPT_REPLICAS.value,
            _pack([84, [k], [[SEG_A, 0]], [None]]), S),
    ]


# ----------------------------------------------------------------- checksums

#: Object checksums (protocol 1.4): xxh3_64 with seed 0 over the value's bytes.  The
#: lengths cross the algorithm's internal boundaries (0, 1-3, 4-8, 9-16, 17-128,
#: 129-240, > 240 bytes, > one 1 KiB stripe block).
CHECKSUM_DATA: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("one_byte", b"\x00"),
    ("kvmaster", b"kvmaster"),
    ("16_bytes", bytes(range(16))),
    ("100_bytes", bytes(range(100))),
    ("240_bytes", bytes(range(240))),
    ("4096_bytes", bytes(range(256)) * 16),
]
#: XXH3_64bits of the empty input with seed 0, as xxHash's own test suite has it.
XXH3_64_OF_EMPTY = 0x2D06800538D394C2


def checksum(data: bytes) -> int:
    import xxhash  # (the client's dependency; the codec itself needs none)

    return xxhash.xxh3_64_intdigest(data)


def checksums() -> list[dict[str, Any]]:
    if checksum(b"") != XXH3_64_OF_EMPTY:
        raise SystemExit("xxhash's xxh3_64 of b'' is not the reference value")
    return [{"name": name, "data": {"hex": data.hex()}, "size": len(data),
             "xxh3_64": checksum(data), "xxh3_64_hex": f"{checksum(data):016x}"}
            for name, data in CHECKSUM_DATA]


# ------------------------------------------------------------------- routing

def routing() -> list[dict[str, Any]]:
    cases = [
        ("default", b"doc/0001", 1), ("default", b"doc/0001", 4), ("default", b"doc/0001", 7),
        ("default", b"a", 2), ("default", b"a", 256), ("default", b"\xff\xfe\x01", 16),
        ("acme", b"doc/0001", 4), ("acme", b"doc/0001", 256), ("acme", b"doc/0001", 65535),
        ("租户-α", UNICODE_KEY, 4), ("租户-α", UNICODE_KEY, 13), ("t", MAX_KEY, 8),
        ("default", MAX_KEY, 256),
    ] + [("default", k, SHARD_COUNT) for k in BATCH_KEYS + BATCH_KEYS_2]
    out = []
    for tenant, key, n in cases:
        crc = zlib.crc32(tenant.encode() + b"\x00" + key)
        out.append({"tenant": tenant, "key": {"hex": key.hex()}, "shard_count": n,
                    "crc32": crc, "shard": crc % n,
                    "route": (crc % n).to_bytes(2, "big").hex()})
    return out


# -------------------------------------------------------------------- driver

def build() -> dict[str, Any]:
    return {
        "description": "kvmaster wire protocol golden vectors; see PROTOCOL.md",
        "protocol_version": list(P.PROTOCOL_VERSION),
        "generator": "tools/gen_golden_vectors.py",
        "conventions": {
            "bytes": "bytes values are {\"hex\": lowercase hex}",
            "op": "op frame, hex (1 byte)",
            "route": "route frame, hex (empty for master-level ops, else 2-byte big-endian shard)",
            "payload_hex": "payload frame, hex: shortest msgpack encoding (bin for bytes, str "
                           "for text); a decoder must accept any valid encoding",
            "decode_only": "a valid non-canonical payload: decodes to the fields, but the "
                           "canonical encoding of those fields differs",
            "routing_context": "request routes are for the tenant and shard_count below",
            "checksums": "object checksums (protocol 1.4, section 24): xxh3_64, seed 0, of "
                         "the bytes in data; xxh3_64 as an unsigned integer (also in hex)",
        },
        "routing_context": {"tenant": TENANT, "shard_count": SHARD_COUNT},
        "requests": requests(),
        "replies": replies(),
        "invalid_requests": invalid_requests(),
        "routing": routing(),
        "checksums": checksums(),
    }


def self_check(doc: dict[str, Any]) -> list[str]:
    """Disagreements between the vectors and the codec (empty when all is well)."""
    problems = []
    for v in doc["requests"]:
        payload = bytes.fromhex(v["payload_hex"])
        req_id, msg = P.decode_request(bytes.fromhex(v["op"]), payload)
        if req_id != v["req_id"] or {f.name: to_json(getattr(msg, f.name))
                                     for f in dataclasses.fields(msg)} != v["fields"]:
            problems.append(f"request {v['name']}: codec decodes to different fields")
        if not v.get("decode_only") and P.encode_request(msg, req_id) != payload:
            problems.append(f"request {v['name']}: codec encodes different bytes")
    for v in doc["replies"]:
        if P.decode_reply(bytes.fromhex(v["payload_hex"]))[:2] != (v["req_id"], v["status"]):
            problems.append(f"reply {v['name']}: codec decodes differently")
    for v in doc["invalid_requests"]:
        try:
            P.decode_request(bytes.fromhex(v["op"]), bytes.fromhex(v["payload_hex"]))
        except P.ProtocolError as exc:
            if exc.status != v["status"]:
                problems.append(f"invalid {v['name']}: status {exc.status} != {v['status']}")
        else:
            problems.append(f"invalid {v['name']}: codec accepted it")
    for v in doc["routing"]:
        key = bytes.fromhex(v["key"]["hex"])
        if P.shard_of(key, P.tenant_seed(v["tenant"]), v["shard_count"]) != v["shard"]:
            problems.append(f"routing {v['tenant']!r}/{v['key']['hex'][:16]}: shard_of differs")
    from kvmaster._integrity import checksum as client_checksum  # noqa: PLC0415

    for v in doc["checksums"]:
        if client_checksum(bytes.fromhex(v["data"]["hex"])) != v["xxh3_64"]:
            problems.append(f"checksum {v['name']}: the client's checksum differs")
    covered = {v["op"] for v in doc["requests"]}
    missing = [op.name for op in Op if op.value.hex() not in covered]
    if missing:
        problems.append(f"ops without a request vector: {missing}")
    return problems


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is not up to date")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    doc = build()
    problems = self_check(doc)
    if problems:
        print("codec disagrees with the vectors:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    text = render(doc)
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale; run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}: {len(doc['requests'])} requests, {len(doc['replies'])} replies, "
          f"{len(doc['invalid_requests'])} invalid requests, {len(doc['routing'])} routing cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
