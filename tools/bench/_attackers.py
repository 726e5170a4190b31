"""The attackers of ``python -m kvmaster.tools.bench attack``: each runs in its own
process (multiprocessing spawn), as a tenant of its own, against a running master.

One attacker per attack (:data:`ATTACKS`).  :func:`attacker_main` is the process's
entry point: it prepares the attack (untimed: e.g. the big session of the
reader that never reads, or the connections of the client-slot attack), says
``ready`` on its pipe, waits for ``go`` with a number of seconds, attacks for that
long, cleans up and sends back a map of what it did (counts by op and status).

The raw attackers speak the wire directly through :class:`Peer` (a DEALER:
frames ``[op, route, msgpack([req_id, *fields])]``, protocol/PROTOCOL.md) and keep
``depth`` requests in flight with :func:`drive`; the capacity attacker uses
ordinary clients.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator
from typing import Any

import msgpack
import zmq

from kvmaster import protocol as P
from kvmaster.protocol import Op, Status

__all__ = ["ATTACKS", "CONTROLS", "Peer", "attacker_main", "drive"]

MiB = 1 << 20
#: Attack name -> (attacker tenant, one-line description).
ATTACKS: dict[str, tuple[str, str]] = {
    "mount_unmount": ("atk-mount", "mount/unmount loop, 16 in flight (every other segment "
                                   "holds 16 objects)"),
    "check_consistency": ("atk-check", "CHECK_CONSISTENCY flood from a non-admin tenant, "
                                       "16 in flight"),
    "never_reads": ("atk-reader", "LIST_KV_SESSION_KEYS flood for a big session, replies "
                                  "never read"),
    "capacity": ("atk-fill", "16 writers put_batch into the master's shared segment"),
    "abandoned_writes": ("atk-abandon", "BATCH_PUT_STARTs never ended, 16 in flight, "
                                        "then BYE"),
    "client_slots": ("atk-slots", "as many registered connections as --max-clients allows, "
                                  "refused HELLOs retried"),
}
#: Controls, not in the default run: floods of ordinary requests, for comparison.
CONTROLS: dict[str, tuple[str, str]] = {
    "flood_exist": ("atk-exist", "EXIST_KEY of a missing key, 16 in flight, replies read "
                                 "(a busy but ordinary client)"),
    "flood_heartbeat": ("atk-beat", "HEARTBEAT, 16 in flight, replies read"),
}

Lane = Generator[tuple[Op, bytes, list[Any]], tuple[int, Any], None]


def status_name(code: int) -> str:
    try:
        return Status(code).name
    except ValueError:
        return str(code)


class Peer:
    """A raw DEALER registered (HELLO) as ``client_id`` of ``tenant``."""

    def __init__(self, ctx: zmq.Context, endpoint: str, tenant: str, client_id: str,
                 hello: bool = True, timeout_ms: int = 10000) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = endpoint
        self.tenant = tenant
        self.client_id = client_id
        self.ids = itertools.count(1)
        self.hello_status: int | None = None
        self.seed = P.tenant_seed(tenant)
        self.shards = 1
        self.sock.connect(endpoint)
        if hello:
            self.hello_status, body = self.ask(Op.HELLO, P.MASTER_ROUTE, self.hello_fields(),
                                               timeout_ms)
            self.welcomed(self.hello_status, body)

    def hello_fields(self) -> list[Any]:
        major, minor = P.PROTOCOL_VERSION
        return [major, minor, self.client_id, self.tenant, "attacker-host", "0"]

    def welcomed(self, status: int, body: Any) -> None:
        self.hello_status = status
        if status == 0:
            self.seed = P.tenant_seed(body["tenant"])
            self.shards = body["shard_count"]

    def send(self, op: Op, route: bytes, fields: list[Any], flags: int = 0) -> int:
        rid = next(self.ids)
        self.sock.send_multipart([op.value, route, msgpack.packb([rid, *fields],
                                                                 use_bin_type=True)], flags)
        return rid

    def recv(self) -> tuple[int, int, Any]:
        """-> ``(req_id, status, body)`` of the next reply (blocking)."""
        return P.decode_reply(self.sock.recv_multipart()[-1])

    def ask(self, op: Op, route: bytes, fields: list[Any], timeout_ms: int = 10000
            ) -> tuple[int, Any]:
        rid = self.send(op, route, fields)
        end = time.monotonic() + timeout_ms / 1000
        while True:
            left = int((end - time.monotonic()) * 1000)
            if left <= 0 or not self.sock.poll(left):
                raise TimeoutError(f"no reply to {op.name} within {timeout_ms} ms")
            got, status, body = self.recv()
            if got == rid:
                return status, body

    def shard_of(self, key: bytes) -> int:
        return P.shard_of(key, self.seed, self.shards)

    def keys_on_shard(self, prefix: str, n: int, shard: int = 0) -> list[bytes]:
        """``n`` fresh keys ``prefix-<i>`` that all hash to ``shard``."""
        out: list[bytes] = []
        for i in itertools.count():
            k = f"{prefix}-{i}".encode()
            if self.shard_of(k) == shard:
                out.append(k)
                if len(out) == n:
                    return out
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.sock.close(linger=0)


def drive(peer: Peer, make_lane: Callable[[], Lane], depth: int, deadline: float,
          counts: Counter[str]) -> None:
    """Keep ``depth`` lanes going on ``peer`` until ``deadline`` (``time.monotonic()``).

    A lane is a generator yielding ``(op, route, fields)`` and receiving the reply
    ``(status, body)``; each lane has one request in flight.  A finished lane is
    replaced by a new one from ``make_lane``.  ``counts["OP STATUS"]`` counts replies."""
    lanes: dict[int, tuple[Lane, Op]] = {}

    def launch(lane: Lane, req: tuple[Op, bytes, list[Any]]) -> None:
        lanes[peer.send(*req)] = (lane, req[0])

    for _ in range(depth):
        lane = make_lane()
        launch(lane, next(lane))
    while lanes:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        if not peer.sock.poll(max(1, int(min(left, 0.2) * 1000))):
            continue
        rid, status, body = peer.recv()
        entry = lanes.pop(rid, None)
        if entry is None:
            continue
        lane, op = entry
        counts[f"{op.name} {status_name(status)}"] += 1
        try:
            req = lane.send((status, body))
        except StopIteration:
            lane = make_lane()
            req = next(lane)
        launch(lane, req)


def _per_key(counts: Counter[str], op: str, status: int, body: Any) -> None:
    """Count a batch reply's per-key results (a list of replicas or a status per key)."""
    if status != 0 or type(body) is not list:
        counts[f"{op} keys {status_name(status)}"] += 1
        return
    for item in body:
        counts[f"{op} keys {status_name(item) if type(item) is int else 'OK'}"] += 1


# ----------------------------------------------------------------- attackers


class Attacker:
    """An attack: :meth:`prepare` (untimed), :meth:`run` for the measured window,
    :meth:`close`; :attr:`counts` and :attr:`notes` go back to the driver."""

    def __init__(self, endpoint: str, tenant: str, opts: dict[str, Any]) -> None:
        self.endpoint = endpoint
        self.tenant = tenant
        self.opts = opts
        self.depth = int(opts.get("depth", 16))
        self.ctx = zmq.Context()
        self.counts: Counter[str] = Counter()
        self.notes: dict[str, Any] = {}
        self.peers: list[Peer] = []

    def peer(self, client_id: str, **kw: Any) -> Peer:
        p = Peer(self.ctx, self.endpoint, self.tenant, f"{client_id}-{os.getpid()}", **kw)
        self.peers.append(p)
        return p

    def prepare(self) -> None:
        pass

    def run(self, deadline: float) -> None:
        raise NotImplementedError

    def close(self) -> None:
        for p in self.peers:
            if p.hello_status == 0:
                try:
                    p.ask(Op.BYE, P.MASTER_ROUTE, [], 5000)
                except (TimeoutError, zmq.ZMQError):
                    pass
            p.close()
        self.ctx.term()


class MountUnmount(Attacker):
    """Mount a 1 MiB segment of a made-up remote host, put 16 objects in every other
    one (BATCH_PUT_START preferring it, then BATCH_PUT_END), unmount it; again; each
    refused BUSY (the tenant's rate limit) sent again at once."""

    def run(self, deadline: float) -> None:
        p = self.peer("mounter")
        names = itertools.count()
        pid = os.getpid()

        def lane() -> Lane:
            i = next(names)
            name = f"atk-seg-{pid}-{i}"
            while True:
                st, _ = yield (Op.MOUNT_SEGMENT, P.MASTER_ROUTE,
                               [name, MiB, "elsewhere", "tcp://10.255.0.1:1"])
                if st == 0:
                    break
                if st != Status.BUSY:
                    return
            if i % 2:
                keys = p.keys_on_shard(f"obj-{i}", 16)
                route = P.route_for_shard(0)
                cfg = [1, False, 0, None, [name]]
                st, body = yield (Op.BATCH_PUT_START, route, [keys, [4096] * 16, cfg, None])
                _per_key(self.counts, "BATCH_PUT_START", st, body)
                st, body = yield (Op.BATCH_PUT_END, route, [keys, None])
            while True:
                st, _ = yield (Op.UNMOUNT_SEGMENT, P.MASTER_ROUTE, [name])
                if st != Status.BUSY:
                    return

        drive(p, lane, self.depth, deadline, self.counts)


class CheckFlood(Attacker):
    """CHECK_CONSISTENCY as fast as the master answers, ``depth`` in flight."""

    def run(self, deadline: float) -> None:
        p = self.peer("checker")

        def lane() -> Lane:
            while True:
                yield (Op.CHECK_CONSISTENCY, P.MASTER_ROUTE, [])

        drive(p, lane, self.depth, deadline, self.counts)


class NeverReads(Attacker):
    """A session of ``reader_keys`` keys of ~4 KB (written with an ordinary client of
    the tenant, 1-byte values), then LIST_KV_SESSION_KEYS of 4,096 keys sent without
    ever reading a reply (a 4 KiB kernel receive buffer, RCVHWM 1): as fast as the
    socket takes them, at most ``reader_requests`` (0: no limit)."""

    def prepare(self) -> None:
        from kvmaster import Client

        n = int(self.opts.get("reader_keys", 3000))
        c = Client()
        c.setup(self.endpoint.removeprefix("tcp://"), 0, self.tenant)
        try:
            keys = [("k" * 4000) + f"{i:05d}" for i in range(n)]
            for i in range(0, n, 512):
                part = keys[i:i + 512]
                codes = c.put_batch(part, [b"v"] * len(part))
                self.counts["put_batch keys OK"] += codes.count(0)
                c.attach_kv_session("big", part)
            self.notes["session_keys"] = n
        finally:
            c.close()
        self.hog = self.peer("hog")
        self.hog.sock.setsockopt(zmq.RCVBUF, 4096)
        self.hog.sock.setsockopt(zmq.RCVHWM, 1)

    def run(self, deadline: float) -> None:
        hog = self.hog
        route = P.route_for_shard(hog.shard_of(b"big"))
        cap = int(self.opts.get("reader_requests", 0))
        sent = 0
        t0 = time.monotonic()
        while time.monotonic() < deadline and (not cap or sent < cap):
            try:
                hog.send(Op.LIST_KV_SESSION_KEYS, route, [b"big", b"", 4096], zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                time.sleep(0.001)
        self.notes["sends_s"] = round(time.monotonic() - t0, 2)
        self.counts["LIST_KV_SESSION_KEYS sent"] = sent
        left = deadline - time.monotonic()
        if left > 0:
            time.sleep(left)  # holding the socket, never reading


class Capacity(Attacker):
    """``writers`` threads, each an ordinary client of the tenant with no segment of its
    own (so its writes go to the master's shared segment), writing fresh keys with
    put_batch of 64 x 16 KiB as fast as the master takes them."""

    def prepare(self) -> None:
        from kvmaster import Client

        self.clients = []
        for _ in range(int(self.opts.get("writers", 16))):
            c = Client()
            c.setup(self.endpoint.removeprefix("tcp://"), 0, self.tenant)
            self.clients.append(c)

    def run(self, deadline: float) -> None:
        value = os.urandom(16384)
        lock = threading.Lock()

        def writer(w: int, c: Any) -> None:
            local: Counter[str] = Counter()
            for r in itertools.count():
                if time.monotonic() >= deadline:
                    break
                keys = [f"w{w}-{r}-{i}" for i in range(64)]
                try:
                    codes = c.put_batch(keys, [value] * 64)
                except Exception as exc:  # noqa: BLE001 - an error is counted
                    local[f"put_batch raised {type(exc).__name__}"] += 1
                    continue
                for code in codes:
                    local[f"put_batch keys {status_name(code)}"] += 1
            with lock:
                self.counts.update(local)

        threads = [threading.Thread(target=writer, args=(i, c), daemon=True)
                   for i, c in enumerate(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def close(self) -> None:
        for c in self.clients:
            c.close()
        super().close()


class AbandonedWrites(Attacker):
    """BATCH_PUT_START of 64 keys of ``abandon_size`` bytes, ``depth`` in flight, never
    ended, until ``bye_before_s`` before the end; then BYE (its time is noted)."""

    def run(self, deadline: float) -> None:
        p = self.peer("abandoner")
        size = int(self.opts.get("abandon_size", 64))
        route = P.route_for_shard(0)
        batches = itertools.count()

        def lane() -> Lane:
            keys = p.keys_on_shard(f"ab-{next(batches)}", 64)
            st, body = yield (Op.BATCH_PUT_START, route, [keys, [size] * 64, None, None])
            _per_key(self.counts, "BATCH_PUT_START", st, body)

        bye_at = deadline - float(self.opts.get("bye_before_s", 1.0))
        drive(p, lane, self.depth, bye_at, self.counts)
        t0 = time.monotonic()
        st, _ = p.ask(Op.BYE, P.MASTER_ROUTE, [], 30000)
        self.notes["bye_ms"] = round((time.monotonic() - t0) * 1000, 1)
        self.counts[f"BYE {status_name(st)}"] += 1
        p.hello_status = None  # (said already)
        left = deadline - time.monotonic()
        if left > 0:
            time.sleep(left)


class ClientSlots(Attacker):
    """Up to ``max_clients`` connections, each HELLO'd once (prepare); during the run
    the refused ones send HELLO again (``depth`` at a time) and the registered ones
    heartbeat every second."""

    def prepare(self) -> None:
        n = int(self.opts.get("max_clients", 256))
        for i in range(n):
            p = self.peer(f"slot{i}")
            self.counts[f"HELLO {status_name(p.hello_status or 0)} (prepare)"] += 1
        self.notes["registered"] = sum(p.hello_status == 0 for p in self.peers)

    def run(self, deadline: float) -> None:
        refused = [p for p in self.peers if p.hello_status != 0]
        ok = [p for p in self.peers if p.hello_status == 0]
        poller = zmq.Poller()
        for p in self.peers:
            poller.register(p.sock, zmq.POLLIN)
        by_sock = {p.sock: p for p in self.peers}
        waiting: dict[Peer, int] = {}
        todo = itertools.cycle(refused) if refused else None
        next_beat = 0.0
        while time.monotonic() < deadline:
            now = time.monotonic()
            if now >= next_beat:
                for p in ok:
                    p.send(Op.HEARTBEAT, P.MASTER_ROUTE, [])
                next_beat = now + 1.0
            while todo is not None and len(waiting) < min(self.depth, len(refused)):
                p = next(todo)
                if p not in waiting:
                    waiting[p] = p.send(Op.HELLO, P.MASTER_ROUTE, p.hello_fields())
            for sock, _ in poller.poll(100):
                p = by_sock[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    rid, status, body = P.decode_reply(frames[-1])
                    if waiting.get(p) == rid:
                        del waiting[p]
                        self.counts[f"HELLO {status_name(status)}"] += 1
                        if status == 0:  # (a slot freed elsewhere: keep it)
                            p.welcomed(status, body)
                            ok.append(p)
                            refused.remove(p)
                            todo = itertools.cycle(refused) if refused else None
        self.notes["registered_at_end"] = len(ok)


class Flood(Attacker):
    """One request over and over, ``depth`` in flight, replies read: EXIST_KEY of a
    missing key (``flood_exist``) or HEARTBEAT (``flood_heartbeat``)."""

    def run(self, deadline: float) -> None:
        p = self.peer("flooder")
        if self.opts.get("kind") == "flood_heartbeat":
            req = (Op.HEARTBEAT, P.MASTER_ROUTE, [])
        else:
            key = p.keys_on_shard("missing", 1)[0]
            req = (Op.EXIST_KEY, P.route_for_shard(0), [key])

        def lane() -> Lane:
            while True:
                yield req

        drive(p, lane, self.depth, deadline, self.counts)


KINDS: dict[str, type[Attacker]] = {
    "flood_exist": Flood, "flood_heartbeat": Flood,
    "mount_unmount": MountUnmount, "check_consistency": CheckFlood, "never_reads": NeverReads,
    "capacity": Capacity, "abandoned_writes": AbandonedWrites, "client_slots": ClientSlots,
}


def attacker_main(kind: str, endpoint: str, opts: dict[str, Any], conn: Any) -> None:
    """Process entry point (see the module docstring): ``conn`` is a pipe end."""
    if opts.get("cpus"):
        os.sched_setaffinity(0, set(opts["cpus"]))
    tenant = {**ATTACKS, **CONTROLS}[kind][0]
    atk = KINDS[kind](endpoint, tenant, {**opts, "kind": kind})
    result: dict[str, Any] = {"kind": kind, "tenant": tenant}
    try:
        t0 = time.monotonic()
        atk.prepare()
        result["prepare_s"] = round(time.monotonic() - t0, 2)
        conn.send(("ready", None))
        msg, seconds = conn.recv()
        if msg == "go":
            start = time.monotonic()
            atk.run(start + float(seconds))
            result["ran_s"] = round(time.monotonic() - start, 2)
    except Exception as exc:  # noqa: BLE001 - reported to the driver
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            atk.close()
        except Exception as exc:  # noqa: BLE001
            result.setdefault("error", f"close: {type(exc).__name__}: {exc}")
        result["counts"] = dict(sorted(atk.counts.items()))
        result["notes"] = atk.notes
        conn.send(("done", result))
