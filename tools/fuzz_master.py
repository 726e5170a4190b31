"""Coverage-guided fuzzing of the master, in-process: the front and its shard actors
driven directly, no sockets, a fake clock.

Each fuzz input is read as a small program: a master configuration, then up to
``MAX_STEPS`` steps.  A step is a structured request (any op, fields drawn from
small pools of keys, session ids, sizes and configs so that inputs collide,
with occasional wrong types, bad routes and out-of-range values), a byte-level
mutation of one, a raw message of random frames, a burst of requests handled
together (so cross-shard walks interleave), a clock jump with a shard tick, or
a client expiry.  Messages enter through :meth:`Master._dispatch` exactly as the
ROUTER would hand them over; replies are captured instead of sent.

Checked after every step:

* no exception escapes the front, a shard, an internal message or a task;
* every message gets exactly one reply ``[req_id, status, body]`` on the
  request's op frame; a failure's body is a one-line str; ``INTERNAL_ERROR``
  (an exception caught inside the master) is a finding;
* a successful batch reply has one item per key.

Checked at the end of every input: the master's own ``check_consistency`` is
empty, plus cross-layer invariants (every shard holds exactly the front's
segments, every stored key and session lives on its owning shard, capacity and
usage add up, the front's client and segment registries agree).

Usage::

    python tools/fuzz_master.py -max_total_time=300 [CORPUS_DIR]   # atheris/libFuzzer
    python tools/fuzz_master.py --random 2000 [--seed 1]           # no atheris needed
    python tools/fuzz_master.py --replay crash-FILE ...            # re-run saved inputs

The ``--random`` mode feeds uniformly random inputs and is what the test suite
runs as a smoke test (``tests/test_fuzz.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import sys
import time
from typing import Any

import msgpack

# Modules whose coverage guides the fuzzer are imported inside instrument() below
# when atheris is in use, so they are imported lazily here.
P: Any = None
Op: Any = None
Status: Any = None
Master: Any = None
MasterConfig: Any = None
_shard_mod: Any = None
_sessions_mod: Any = None
_alloc_mod: Any = None

MAX_STEPS = 32
#: Set KVMASTER_FUZZ_TRACE=1 to print every message and reply (for replaying a finding).
TRACE = bool(os.environ.get("KVMASTER_FUZZ_TRACE"))
#: Comma-separated known findings to steer around so a run can look for others:
#: ``hello-takeover`` (a registered connection's HELLO naming another live client_id),
#: ``bye-race`` (BYE pipelined with other master-level ops of the same client),
#: ``dup-tagged-key`` (a key repeated within one tagged batch write),
#: ``attach-race`` (ATTACH_KV_SESSION in flight together with other session writes),
#: ``ttl-takeover`` (soft_pin_ttl_ms above the maximum, refused after a takeover).
AVOID = set(filter(None, os.environ.get("KVMASTER_FUZZ_AVOID", "").split(",")))
MAX_SETTLE_ROUNDS = 10_000


def _import_targets() -> None:
    global P, Op, Status, Master, MasterConfig, _shard_mod, _sessions_mod, _alloc_mod
    from kvmaster import _alloc as alloc_mod
    from kvmaster import _sessions as sessions_mod
    from kvmaster import _shard as shard_mod
    from kvmaster import protocol as proto
    from kvmaster.config import MasterConfig as config_cls
    from kvmaster.master import Master as master_cls

    P, Op, Status = proto, proto.Op, proto.Status
    Master, MasterConfig = master_cls, config_cls
    _shard_mod, _sessions_mod, _alloc_mod = shard_mod, sessions_mod, alloc_mod


class Finding(AssertionError):
    """A property of the master was violated by an input."""


# ---------------------------------------------------------------------------
# Input decoding


class Provider:
    """Deterministic reader of fuzz bytes; returns the low end when exhausted."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        b = self.data[self.pos]
        self.pos += 1
        return b

    def int(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        span = hi - lo
        if span <= 0:
            return lo
        v = 0
        n = 0
        while (1 << (8 * n)) <= span:
            v = (v << 8) | self.byte()
            n += 1
        return lo + v % (span + 1)

    def chance(self, in_256: int) -> bool:
        return self.byte() < in_256

    def pick(self, seq: Any) -> Any:
        return seq[self.int(0, len(seq) - 1)]

    def raw(self, max_len: int) -> bytes:
        n = self.int(0, max_len)
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return bytes(out)


# ---------------------------------------------------------------------------
# Value pools


SIZES_OK = (1, 63, 64, 65, 1000, 4096, 5000, 20000, 65536, (1 << 48) - 1)
JUNK = (None, True, False, 0, -1, 1 << 63, (1 << 64) - 1, -(1 << 63), 2 ** 48, 0.5,
        float("nan"), "", "x", "\x00", "k0", b"", b"\x00", b"k\x00", b"x" * 4097, [], [[]],
        {}, {"a": 1}, [b"k0", "k1"], msgpack.ExtType(5, b"x"))
TENANTS = ("default", "t1", "t2")
SEG_NAMES = ("g0", "g1", "g2", "g3")


class World:
    """One master (front + shards) on a private event loop, with captured replies."""

    def __init__(self, loop: asyncio.AbstractEventLoop, p: Provider) -> None:
        self.loop = loop
        self.p = p
        shards = p.int(1, 4)
        self.config = MasterConfig(
            port=0, shards=shards, max_batch=p.pick((1, 4, 8)),
            kv_session_max_batch=p.pick((1, 4, 8)),
            kv_session_max_members=p.pick((1, 3, 6, 100)),
            kv_session_max_per_object=p.pick((1, 2, 3, 100)),
            kv_session_max_sessions=p.pick((1, 4, 100)),
            max_segments_per_client=p.pick((1, 2, 3)),
            shard_inbox=p.pick((1, 4, 64)),
            enable_kv_sessions=not p.chance(24),
            exist_grants_lease=p.chance(64),
            allow_evict_soft_pinned_objects=not p.chance(64),
            eviction_high_watermark_ratio=p.pick((0.5, 0.9, 1.0)),
            eviction_ratio=p.pick((0.0, 0.05, 0.5)),
            max_kv_soft_pin_ttl=p.pick((1, 100_000, 86_400_000)),
            max_clients=p.pick((1, 2, 16)),
        )
        self.m = Master(self.config)
        self.m._loop = loop
        self.shard_count = shards
        self.replies: list[tuple[bytes, bytes, bytes]] = []
        # Replies are taken where the front sends them, after its reply groups.
        self.m.front.send_message = self._capture
        self.req = 0
        self.expect_len: dict[int, int] = {}
        # Keys pooled per (tenant, shard) so batches can be routed correctly.
        self.key_pool: dict[tuple[str, int], list[bytes]] = {}
        for t in TENANTS:
            seed = P.tenant_seed(t)
            for i in range(24):
                k = b"k%d" % i
                self.key_pool.setdefault((t, P.shard_of(k, seed, shards)), []).append(k)
        self.all_keys = [b"k%d" % i for i in range(24)]
        self.sids = [b"s%d" % i for i in range(5)]
        # Peers: (identity, client_id, tenant); the last one starts unregistered.
        self.peers = [(b"p0", "c0", "default"), (b"p1", "c1", "t1"), (b"p2", "c2", "default")]

    # -------------------------------------------------------------- plumbing

    def _capture(self, identity: bytes, frames: Any) -> None:
        if TRACE:
            _trace("<-", [identity, *frames])
        for i in range(0, len(frames), 2):  # [op, payload], once or more (protocol 1.2)
            self.replies.append((identity, frames[i], frames[i + 1]))

    def settle(self) -> None:
        """Run shards and master tasks until nothing is left to do."""
        m = self.m
        for _ in range(MAX_SETTLE_ROUNDS):
            busy = False
            for s in m.shards:
                if s.inbox:
                    s.drain()
                    busy = True
            if m.registry.tasks or busy:
                self.loop.run_until_complete(asyncio.sleep(0))
                continue
            return
        raise Finding("master did not settle: shard messages or tasks keep coming")

    def run_coro(self, coro: Any) -> Any:
        task = self.loop.create_task(coro)
        for _ in range(MAX_SETTLE_ROUNDS):
            for s in self.m.shards:
                if s.inbox:
                    s.drain()
            self.loop.run_until_complete(asyncio.sleep(0))
            if task.done():
                return task.result()
        raise Finding("internal coroutine never finished")

    def seed_of(self, identity: bytes) -> int:
        c = self.m.registry.clients.get(identity)
        return P.tenant_seed(c.tenant if c is not None else "default")

    def tenant_of(self, identity: bytes) -> str:
        c = self.m.registry.clients.get(identity)
        return c.tenant if c is not None else "default"

    def route_for(self, identity: bytes, key: Any) -> bytes:
        if type(key) is bytes:
            return P.route_for_shard(P.shard_of(key, self.seed_of(identity), self.shard_count))
        return P.route_for_shard(self.p.int(0, self.shard_count - 1))

    def send(self, frames: list[bytes]) -> list[tuple[bytes, bytes]]:
        """Hand one message to the front -> the (identity, op frame) of the reply it owes."""
        if TRACE:
            _trace("->", frames)
        self.m.front.dispatch(frames)
        if len(frames) < 2:
            return []
        if len(frames) % 3 == 1:  # one request, or several (protocol 1.2): a reply each
            return [(frames[0], frames[i]) for i in range(1, len(frames), 3)]
        return [(frames[0], frames[1][:1] or b"\xff")]

    # ----------------------------------------------------------- generators

    def value(self, kind: str, identity: bytes, shard: int) -> Any:
        p = self.p
        if p.chance(10):
            return p.pick(JUNK)
        if kind == "key":
            pool = self.key_pool.get((self.tenant_of(identity), shard)) or self.all_keys
            return p.pick(pool) if not p.chance(16) else p.pick(self.all_keys)
        if kind == "keys":
            pool = self.key_pool.get((self.tenant_of(identity), shard)) or self.all_keys
            return [p.pick(pool) for _ in range(p.int(0, 9))]
        if kind == "anykeys":
            return [p.pick(self.all_keys) for _ in range(p.int(0, 9))]
        if kind == "size":
            return p.pick(SIZES_OK) if not p.chance(16) else p.pick((0, -5, 1 << 48, "1"))
        if kind == "sizes":
            return [p.pick(SIZES_OK[:8]) for _ in range(p.int(0, 9))]
        if kind == "bool":
            return p.chance(128)
        if kind == "sid":
            return p.pick(self.sids)
        if kind == "sids":
            return [p.pick(self.sids) for _ in range(p.int(0, 4))]
        if kind == "tags":
            return [[p.pick(self.sids) for _ in range(p.int(0, 3))] for _ in range(p.int(0, 9))]
        if kind == "token":
            return p.pick((0, 1, 2, (1 << 63) - 1))
        if kind == "cursor":
            return p.pick((b"", b"k1", b"k5", b"k9", b"zz"))
        if kind == "limit":
            return p.pick((1, 2, 4, 8, 9, 1 << 20))
        if kind == "config":
            if p.chance(96):
                return None
            ttl = p.pick((None, None, 1, 1000, 10 ** 9))
            if "ttl-takeover" in AVOID and ttl is not None:
                ttl = min(ttl, self.config.max_kv_soft_pin_ttl)
            cfg: list[Any] = [p.pick((1, 2, 3, 64, 0, 65)), p.chance(64),
                              p.pick((0, 1, 2, 3)), ttl,
                              [p.pick(SEG_NAMES) for _ in range(p.int(0, 3))]]
            return cfg[:p.int(1, 5)] if p.chance(64) else cfg
        if kind == "segname":
            return p.pick(SEG_NAMES)
        if kind == "segsize":
            return p.pick((4096 * self.shard_count, 8192 * self.shard_count, 1 << 16, 1 << 20,
                           1, 1 << 62))
        if kind == "tenant":
            return p.pick(TENANTS)
        if kind == "client_id":
            return p.pick(("c0", "c1", "c2", "c3"))
        if kind == "major":
            return p.pick((1, 1, 1, 0, 2))
        if kind == "text":
            return p.pick(("", "h", "shm", "\u79df"))
        return p.pick(JUNK)

    FIELD_KINDS = {
        "key": "key", "keys": "keys", "keep_keys": "anykeys", "size": "size", "sizes": "sizes",
        "config": "config", "force": "bool", "pinned": "bool", "final": "bool",
        "session_id": "sid", "sessions": "sids", "kv_sessions": "tags", "token": "token",
        "cursor": "cursor", "limit": "limit", "name": "segname", "tenant": "tenant",
        "client_id": "client_id", "protocol_major": "major", "protocol_minor": "token",
        "host_id": "text", "client_version": "text", "transport": "text",
        "write_id": "token", "columns": "bool", "with_checksum": "bool", "checksum": "token",
    }

    def request(self, identity: bytes) -> tuple[list[bytes], Any]:
        """A structured request -> (frames, expected batch length or None; for a
        columnar reply (``columns`` true, protocol 1.1) ``("columns", length)``)."""
        p = self.p
        op = p.pick(list(P.OP_TO_TYPE))
        cls = P.OP_TO_TYPE[op]
        names = [f.name for f in dataclasses.fields(cls)]
        master_level = op < b"\x10"
        shard = p.int(0, self.shard_count - 1)
        kinds = [self.FIELD_KINDS.get(n, "junk") for n in names]
        if op == Op.MOUNT_SEGMENT.value:
            kinds[1] = "segsize"
        fields = [self.value(k, identity, shard) for k in kinds]
        if "sizes" in names and type(fields[0]) is list and p.chance(200):
            fields[names.index("sizes")] = [p.pick(SIZES_OK[:8]) for _ in fields[0]]
        if "kv_sessions" in names and type(fields[0]) is list and p.chance(200):
            fields[names.index("kv_sessions")] = [
                [p.pick(self.sids) for _ in range(p.int(0, 2))] for _ in fields[0]]
        if "dup-tagged-key" in AVOID and op in (Op.BATCH_PUT_START_WITH_KV_SESSIONS.value,
                                                Op.BATCH_UPSERT_START_WITH_KV_SESSIONS.value) \
                and fields and type(fields[0]) is list:
            first = [i for i, k in enumerate(fields[0]) if k not in fields[0][:i]]
            fields = [[f[i] for i in first if i < len(f)] if type(f) is list else f
                      for f in fields]
        if op == Op.HELLO.value and p.chance(160):
            fields[0], fields[1] = 1, 0
        if op == Op.HELLO.value and "hello-takeover" in AVOID and identity in self.m.registry.clients \
                and len(fields) > 2:
            fields[2] = self.m.registry.clients[identity].client_id
        if p.chance(8):
            fields = fields[:p.int(0, len(fields))]
        elif p.chance(8):
            fields.append(p.pick(JUNK))
        self.req += 1
        req_id = self.req if not p.chance(6) else p.pick((0, -1, 1 << 63, "x", None))
        payload = msgpack.packb([req_id, *fields], use_bin_type=True)
        # Route: the right one mostly; sometimes any shard, a bad frame or none.
        if master_level:
            route = b""
        elif names and names[0] in ("key", "session_id"):
            route = self.route_for(identity, fields[0] if fields else None)
        else:  # batches draw their keys from this shard's pool; REMOVE_ALL: any shard
            route = P.route_for_shard(shard)
        r = p.byte()
        if r < 8:
            route = p.pick((b"", b"\x00", b"\x00\x00\x00", b"\xff\xff",
                            P.route_for_shard(self.shard_count)))
        elif r < 20 and not master_level:
            route = P.route_for_shard(p.int(0, self.shard_count - 1))
        expect = None
        # REPLICA_CLEAR answers the keys it cleared, not one item per key.
        if (names and fields and names[0] == "keys" and type(fields[0]) is list
                and type(req_id) is int and req_id > 0 and op != Op.REPLICA_CLEAR.value):
            expect = len(fields[0])
            if op in P.COLUMN_OPS and len(fields) >= len(names) \
                    and fields[names.index("columns")] is True:
                expect = ("columns", expect)
        if op == Op.ATTACH_KV_SESSION.value and len(fields) > 1 and type(fields[1]) is list \
                and type(req_id) is int and req_id > 0:
            expect = len(fields[1])
        return [identity, op, route, payload], expect

    # ---------------------------------------------------------------- steps

    def start(self) -> None:
        """Register two peers of different tenants and mount a small segment each."""
        p = self.p
        for identity, cid, tenant in self.peers[:2]:
            self._setup_frames(identity, cid, tenant, p)
        self.settle()
        self.check_replies(self.take_replies(), self._setup_owed(self.peers[:2]))

    def _setup_frames(self, identity: bytes, cid: str, tenant: str, p: Provider) -> None:
        self.req += 1
        self.send([identity, Op.HELLO.value, b"", msgpack.packb(
            [self.req, 1, p.pick((0, P.PROTOCOL_VERSION[1])), cid, tenant, "h", "0"],
            use_bin_type=True)])
        self.req += 1
        size = p.pick((4096, 8192, 16384, 65536)) * self.shard_count
        self.send([identity, Op.MOUNT_SEGMENT.value, b"", msgpack.packb(
            [self.req, SEG_NAMES[int(identity[-1:]) % 4], size, "h", "shm"], use_bin_type=True)])

    @staticmethod
    def _setup_owed(peers: list[tuple[bytes, str, str]]) -> list[tuple[bytes, bytes]]:
        return [(i, op) for i, _, _ in peers for op in (Op.HELLO.value, Op.MOUNT_SEGMENT.value)]

    def take_replies(self) -> list[tuple[bytes, bytes, bytes]]:
        out, self.replies = self.replies, []
        return out

    def step(self) -> None:
        p = self.p
        kind = p.int(0, 15)
        identity = self.peers[p.int(0, 2)][0]
        owed: list[tuple[bytes, bytes]] = []
        expects: dict[int, Any] = {}
        if kind <= 8:
            frames, expect = self.request(identity)
            owed += self.send(frames)
            if expect is not None:
                expects[self.req] = expect
        elif kind == 9:
            frames, _ = self.request(identity)
            payload = bytearray(frames[3])
            for _ in range(p.int(1, 4)):
                if not payload:
                    break
                i = p.int(0, len(payload) - 1)
                what = p.int(0, 2)
                if what == 0:
                    payload[i] = p.byte()
                elif what == 1:
                    del payload[i]
                else:
                    payload.insert(i, p.byte())
            frames[3] = bytes(payload)
            owed += self.send(frames)
        elif kind == 10:
            frames = [identity] + [p.raw(12) for _ in range(p.int(0, 5))]
            owed += self.send(frames)
        elif kind in (11, 12):
            # Several requests; one peer's may go in one message (protocol 1.2).
            glued = [identity] if p.chance(96) else None
            for _ in range(p.int(2, 5)):
                frames, expect = self.request(identity if glued else self.peers[p.int(0, 2)][0])
                if "bye-race" in AVOID and frames[1] == Op.BYE.value:
                    frames[1] = Op.HEARTBEAT.value
                if "attach-race" in AVOID and frames[1] == Op.ATTACH_KV_SESSION.value:
                    frames[1] = Op.GET_KV_SESSION.value
                    expect = None
                if glued:
                    glued += frames[1:]
                else:
                    owed += self.send(frames)
                if expect is not None:
                    expects[self.req] = expect
            if glued:
                owed += self.send(glued)
        elif kind == 13:
            dt = p.pick((0.001, 1.0, 10.5, 31.0, 601.0))
            if TRACE:
                print(f"-- clock +{dt} s, tick", file=sys.stderr)
            clock.advance(dt)
            for s in self.m.shards:
                s.post("tick", ())
        elif kind == 14:
            client = self.m.registry.clients.get(identity)
            if client is not None:
                if TRACE:
                    print(f"-- expire {identity!r} ({client.client_id})", file=sys.stderr)
                self.run_coro(self.m.registry.forget(client, unlink=False))
        else:
            identity, cid, tenant = self.peers[p.int(0, 2)]
            cid = p.pick((cid, "c0", "c3"))
            if "hello-takeover" in AVOID and identity in self.m.registry.clients:
                cid = self.m.registry.clients[identity].client_id
            self._setup_frames(identity, cid, p.pick((tenant, "t2")), p)
            owed += self._setup_owed([(identity, cid, tenant)])
        self.settle()
        if self.m.front.groups:
            raise Finding(f"reply groups left open with the shards idle: {self.m.front.groups}"[:300])
        self.check_replies(self.take_replies(), owed, expects)

    # --------------------------------------------------------------- checks

    def check_replies(self, replies: list[tuple[bytes, bytes, bytes]],
                      owed: list[tuple[bytes, bytes]],
                      expects: dict[int, Any] | None = None) -> None:
        got = sorted((i, op) for i, op, _ in replies)
        if got != sorted(owed):
            raise Finding(f"replies {got} do not match the messages sent {sorted(owed)}"[:400])
        for identity, op, payload in replies:
            try:
                obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            except Exception as exc:  # noqa: BLE001
                raise Finding(f"reply payload does not decode: {exc!r}") from None
            if type(obj) is not list or len(obj) != 3 or type(obj[0]) is not int \
                    or type(obj[1]) is not int:
                raise Finding(f"reply is not [req_id, status, body]: {obj!r}"[:300])
            req_id, status, body = obj
            if status == Status.INTERNAL_ERROR:
                raise Finding(f"INTERNAL_ERROR on op {op.hex()}: {body!r}")
            if status not in Status._value2member_map_:
                raise Finding(f"unknown status {status}")
            if status and (type(body) is not str or not body or "\n" in body):
                raise Finding(f"status {status} with body {body!r}")
            want = expects.get(req_id) if expects else None
            if not status and type(want) is tuple:  # columnar: per-key arrays of that length
                n = want[1]
                get = op == Op.BATCH_GET_REPLICA_LIST.value
                # (a get asked with_checksum, protocol 1.4, has a 7th column of n items)
                if type(body) is not list or len(body) not in ((6, 7) if get else (4,)) \
                        or any(len(body[c]) != n for c in ((1, 2, 4) if get else (1, 2))) \
                        or (len(body) == 7 and len(body[6]) != n):
                    raise Finding(f"columnar reply {body!r} for {n} keys (op {op.hex()})"[:300])
                if P.replica_columns(P.replica_items(body, get), get)[1:3] != body[1:3]:
                    raise Finding(f"columnar reply does not round-trip (op {op.hex()})")
            elif not status and want is not None and type(body) is list and len(body) != want:
                raise Finding(f"batch reply of {len(body)} items for {want} keys "
                              f"(op {op.hex()})")
        if errors:
            raise Finding(f"master logged an error: {errors[0]}")

    def check_state(self) -> None:
        m = self.m
        problems = list(self.run_coro(m.check_consistency()))
        names = set(m.registry.segments)
        n = self.shard_count
        owner_of = _sessions_mod.owner_of
        for s in m.shards:
            if set(s.segments) != names:
                problems.append(f"shard {s.index} segments {sorted(s.segments)} != front "
                                f"{sorted(names)}")
            if s.capacity != sum(g.alloc.size for g in s.segments.values()):
                problems.append(f"shard {s.index} capacity drifted")
            if s.used > s.capacity:
                problems.append(f"shard {s.index} used {s.used} > capacity {s.capacity}")
            for ck, obj in s.objects.items():
                if owner_of(ck, n) != s.index:
                    problems.append(f"object {ck!r} on shard {s.index}, owner {owner_of(ck, n)}")
                for seg, _ in obj.replicas():
                    if s.segments.get(seg.name) is not seg:
                        problems.append(f"object {ck!r} has a replica on unmounted {seg.name}")
            for ck, pw in s.writes.items():
                if owner_of(ck, n) != s.index:
                    problems.append(f"write {ck!r} on shard {s.index}")
                for seg, _ in pw.replicas():
                    if s.segments.get(seg.name) is not seg:
                        problems.append(f"write {ck!r} has a replica on unmounted {seg.name}")
            for sck, rec in s.sessions.items():
                if owner_of(sck, n) != s.index:
                    problems.append(f"session {sck!r} on shard {s.index}")
                if not rec.members:
                    problems.append(f"session {sck!r} has no members but exists")
            if s.walks:
                problems.append(f"shard {s.index} has {len(s.walks)} walks open when idle")
        for ident, c in m.registry.clients.items():
            if c.identity != ident or m.registry.client_ids.get(c.client_id) != ident:
                problems.append(f"client registry disagrees for {c.client_id}")
            for name in c.segments:
                rec = m.registry.segments.get(name)
                if rec is None or rec.owner != c.client_id:
                    problems.append(f"client {c.client_id} lists segment {name} it does not own")
        if len(m.registry.client_ids) != len(m.registry.clients):
            problems.append("client_ids and clients differ in size")
        for name, rec in m.registry.segments.items():
            c = m.registry.clients.get(m.registry.client_ids.get(rec.owner, b""))
            if c is None or name not in c.segments:
                problems.append(f"segment {name} owned by unregistered {rec.owner}")
        if problems:
            raise Finding("; ".join(problems[:5]))


def _trace(direction: str, frames: list[bytes]) -> None:
    shown = []
    for f in frames[:3]:
        shown.append(f.hex() if len(f) <= 2 else repr(f)[:40])
    if len(frames) > 3:
        try:
            shown.append(repr(msgpack.unpackb(frames[-1], raw=False, strict_map_key=False))[:300])
        except Exception:  # noqa: BLE001
            shown.append(repr(frames[-1])[:80])
    print(direction, *shown, file=sys.stderr)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


clock = FakeClock()
errors: list[str] = []
_loop: asyncio.AbstractEventLoop | None = None


class _ErrorLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        errors.append(f"{record.name}: {record.getMessage()}")


_saved: tuple[Any, ...] | None = None  # what _prepare changed, for release()


def _prepare() -> asyncio.AbstractEventLoop:
    global _loop, _saved
    if P is None:
        _import_targets()
    if _loop is None:
        log = logging.getLogger("kvmaster")
        _saved = (_shard_mod._monotonic, _sessions_mod._now, list(log.handlers), log.propagate,
                  log.level)
        _shard_mod._monotonic = clock
        _sessions_mod._now = clock
        log.addHandler(_ErrorLog(level=logging.ERROR))
        log.propagate = False
        log.setLevel(logging.ERROR)
        _loop = asyncio.new_event_loop()

        def on_loop_error(loop: Any, ctx: dict) -> None:
            errors.append(f"event loop: {ctx.get('message')} {ctx.get('exception')!r}")

        _loop.set_exception_handler(on_loop_error)
    return _loop


def release() -> None:
    """Undo what the first :func:`run_input` changed in this process (the fake clock in
    the shard and session modules, the ``kvmaster`` logger) and close its event loop,
    so that code run afterwards in the same process (a test suite) sees neither."""
    global _loop, _saved
    if _loop is None or _saved is None:
        return
    log = logging.getLogger("kvmaster")
    _shard_mod._monotonic, _sessions_mod._now, handlers, log.propagate, level = _saved
    log.handlers[:] = handlers
    log.setLevel(level)
    _loop.close()
    _loop = _saved = None


def run_input(data: bytes) -> None:
    """Run one fuzz input; raises Finding (or any exception) on a violation."""
    loop = _prepare()
    errors.clear()
    clock.now = 1000.0
    p = Provider(data)
    w = World(loop, p)
    w.start()
    for _ in range(p.int(1, MAX_STEPS)):
        if p.remaining() <= 0:
            break
        w.step()
    w.check_state()
    if errors:
        raise Finding(f"master logged an error: {errors[0]}")


def _main(argv: list[str]) -> int:
    if "--replay" in argv:
        files = argv[argv.index("--replay") + 1:]
        for f in files:
            with open(f, "rb") as fh:
                run_input(fh.read())
            print(f"{f}: ok")
        return 0
    if "--random" in argv:
        n = int(argv[argv.index("--random") + 1])
        seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 1
        rng = random.Random(seed)
        t0 = time.monotonic()
        for i in range(n):
            data = rng.randbytes(rng.randint(0, 600))
            try:
                run_input(data)
            except Exception:
                path = f"crash-random-{seed}-{i}"
                with open(path, "wb") as fh:
                    fh.write(data)
                print(f"input {i} failed; saved as {path}", file=sys.stderr)
                raise
        print(f"{n} random inputs ok in {time.monotonic() - t0:.1f} s")
        return 0
    import atheris

    with atheris.instrument_imports(include=["kvmaster"]):
        _import_targets()
    atheris.Setup(argv, run_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
