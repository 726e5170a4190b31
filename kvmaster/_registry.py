"""The master's registry of clients and their segments.

:class:`Registry` owns the registered clients (:class:`ClientInfo`, by DEALER identity
and by client id) and the mounted segments (:class:`SegmentRecord`), and answers the
master-level ops (HELLO/WELCOME, HEARTBEAT, MOUNT/UNMOUNT, BYE, STATS, LIST_*,
GET_CONFIG, CHECK_CONSISTENCY) that the front (kvmaster/_front.py) hands it; it
expires silent clients and removes segment files their dead owners left.  It talks
to the shards only by internal messages, through the master (kvmaster/master.py).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import stat
import time
from typing import Any

from kvmaster import __version__
from kvmaster import protocol as P
from kvmaster._front import MasterState
from kvmaster._limits import WALK_BURST, WALK_RATE, ClientCounts, TokenBuckets
from kvmaster._mounts import MountProof, admit_mount
from kvmaster._records import ClientView
from kvmaster._segment import (
    NAME_PREFIX,
    SHM_DIR,
    name_fingerprint,
    remove_stale_segments,
    segment_tag,
    unlink_segment,
)
from kvmaster.config import MasterConfig
from kvmaster.protocol import Op, ProtocolError, Status

# (the master's logger: --log-levels names it so for every line of the registry)
log = logging.getLogger("kvmaster.master")

#: The owner of the master's own segment (--master-segment-size).
MASTER_CLIENT = "master"


#: Master-level op -> its (requests, failures) counters (HELLO has "hello").
FRONT_OP_COUNTERS = {op.value: (f"op.{op.name.lower()}.requests", f"op.{op.name.lower()}.failures")
                      for op in P.MASTER_OPS if op is not Op.HELLO}



def _file_id(name: str) -> tuple[int, int, int] | None:
    """Identity ``(st_dev, st_ino, st_uid)`` of a same-host segment file, if it is a
    regular kvmaster segment file (``lstat``: a symlink is none)."""
    if "/" in name or not name.startswith(NAME_PREFIX):
        return None
    try:
        st = os.lstat(os.path.join(SHM_DIR, name))
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_uid) if stat.S_ISREG(st.st_mode) else None


def _owners_file(rec: SegmentRecord, client_id: str) -> bool:
    """Whether ``/dev/shm/<rec.name>`` may be unlinked for the expired client
    ``client_id``: the record is that client's mount of a file on this host, the name
    still carries the fingerprint the mount proved, and the name still holds the file
    (same device, inode and owning uid) that was mounted."""
    return (rec.file_id is not None and rec.owner == client_id
            and bool(rec.fingerprint) and name_fingerprint(rec.name) == rec.fingerprint
            and _file_id(rec.name) == rec.file_id)



class ClientInfo:
    """A registered client, keyed by its DEALER identity."""

    __slots__ = ("client_id", "identity", "tenant", "host_id", "view", "last_seen", "segments",
                 "user_id", "front_ops", "multi_reply", "suspected")

    def __init__(self, client_id: str, identity: bytes, tenant: str, host: str, now: float) -> None:
        self.client_id = client_id
        self.identity = identity
        self.tenant = tenant
        self.host_id = host
        self.view = ClientView(client_id, tenant, identity)
        self.last_seen = now
        self.segments: set[str] = set()
        self.user_id: str | None = None
        self.front_ops = 0  # master-level requests of this client being answered
        #: Its HELLO said protocol 1.2 or later: a reply message may carry several replies.
        self.multi_reply = False
        #: Silent past --client-ttl, within --client-suspicion-ttl: its segments take no
        #: new writes (the shards were told), its objects stay.
        self.suspected = False


class SegmentRecord:
    """A mounted segment and what its mount proved (kvmaster._mounts): ``owner`` the
    client id, ``key`` the CURVE key that mounted it (None without CURVE),
    ``fingerprint`` the owner fingerprint its name carries, ``file_id``."""

    __slots__ = ("name", "owner", "size", "usable", "host_id", "transport", "file_id", "key",
                 "fingerprint")

    def __init__(self, name: str, owner: str, size: int, host: str, transport: str) -> None:
        self.name = name
        self.owner = owner
        self.size = size
        self.usable = 0
        self.host_id = host
        self.transport = transport
        # (st_dev, st_ino, st_uid) of /dev/shm/<name> when it was mounted on this host:
        # the master unlinks an expired client's file only if it is still that file.
        self.file_id: tuple[int, int, int] | None = None
        self.key: str | None = None
        self.fingerprint = ""

    def same_mount(self, owner: str, key: str | None, msg: Any,
                   file_id: tuple[int, int, int] | None) -> bool:
        """Whether a mount of this name by ``owner`` (authenticated with ``key``) is
        this one again (a re-mount after reconnecting): same owner, key, size, host,
        transport and file."""
        return (self.owner == owner and self.key == key and self.size == msg.size
                and self.host_id == msg.host_id and self.transport == msg.transport
                and self.file_id == file_id)


#: Looks for segment files of dead masters while some are still in use: the first
#: again after STALE_SEGMENT_RECHECK_S seconds, each later one after twice the last
#: pause, at most STALE_SEGMENT_RECHECK_MAX_S, until STALE_SEGMENT_RECHECK_FOR_S
#: after the start (then ``kvmaster ctl clean-segments`` is left to remove them).
#: Clients of the dead master drop their mappings when they re-handshake with a
#: new master, usually within seconds.
STALE_SEGMENT_RECHECK_S = 2.0
STALE_SEGMENT_RECHECK_MAX_S = 900.0
STALE_SEGMENT_RECHECK_FOR_S = 86400.0

#: Master-level requests (MOUNT_SEGMENT, STATS, ...) being answered at once: per
#: client and in all.  Beyond either, the request is answered BUSY.
FRONT_OPS_PER_CLIENT = 256
FRONT_OPS_MAX = 4096


async def sweep_stale_segments(loop: asyncio.AbstractEventLoop) -> None:
    """Remove the segment files that masters of this host (same KVMASTER_SEGMENT_TAG,
    user and pid namespace) left when they died: never one whose master is alive or
    that any process maps or holds open.  While some are still mapped (clients of the
    dead master that have not re-handshaken yet, or that never will), look again
    after STALE_SEGMENT_RECHECK_S seconds, doubling the pause up to
    STALE_SEGMENT_RECHECK_MAX_S, until STALE_SEGMENT_RECHECK_FOR_S after the first
    look (each look reads every process's maps and open files in /proc)."""
    told: set[str] = set()
    pause = STALE_SEGMENT_RECHECK_S
    give_up = time.monotonic() + STALE_SEGMENT_RECHECK_FOR_S
    while True:
        try:
            report = await loop.run_in_executor(
                None, remove_stale_segments, segment_tag())
        except Exception:  # noqa: BLE001 - a failed look must not stop the master
            log.exception("[master] looking for segment files of dead masters failed")
            return
        for name in report["removed"]:
            log.warning("[master] removed segment file of a dead master name=%s", name)
        waiting = [k for k in report["kept"] if k["reason"].startswith(("mapped", "locked"))]
        for k in waiting:
            if k["name"] not in told:
                told.add(k["name"])
                log.info("[master] segment file of a dead master kept while in use "
                         "name=%s: %s", k["name"], k["reason"])
        if not waiting:
            return
        if time.monotonic() + pause > give_up:
            log.warning("[master] segment files of dead masters still in use after %.0f s; "
                        "no longer looking (kvmaster ctl clean-segments removes them once "
                        "unused): %s", STALE_SEGMENT_RECHECK_FOR_S,
                        " ".join(sorted(k["name"] for k in waiting)))
            return
        await asyncio.sleep(pause)
        pause = min(pause * 2, STALE_SEGMENT_RECHECK_MAX_S)


class Registry:
    """Clients and segments of the master; runs on the master's event loop thread.

    ``master`` (kvmaster/master.py) holds the lifecycle (state, loop, shards, the CURVE
    authenticator, the HA election); ``front`` (set by the master) sends the replies
    and knows the message being handled (``now``, ``user_id``)."""

    def __init__(self, master: Any, config: MasterConfig, counters: dict[str, int]) -> None:
        self.master = master
        self.config = config
        self.counters = counters
        self.front: Any = None
        self.clients: dict[bytes, ClientInfo] = {}
        self.client_ids: dict[str, bytes] = {}
        self.segments: dict[str, SegmentRecord] = {}
        #: Tasks answering master-level requests (each holds its result until sent).
        self.tasks: set[asyncio.Task] = set()
        #: With CURVE: z85 client key -> its tenant (kvmaster/auth.py).
        self.tenant_of_key: dict[str, str] = {}
        self._client_counts = ClientCounts()
        self._walk_buckets = TokenBuckets(WALK_RATE, WALK_BURST)
        self._checking = False
        self._shared_tenants = frozenset(
            t.strip() for t in config.shared_tenants.split(",") if t.strip())
        #: Master-level ops answered by a task (HELLO and HEARTBEAT are answered at once).
        self._handlers = {
            Op.MOUNT_SEGMENT.value: self._mount,
            Op.UNMOUNT_SEGMENT.value: self._unmount,
            Op.BYE.value: self._bye,
            Op.STATS.value: self.stats,
            Op.CHECK_CONSISTENCY.value: self._check,
            Op.LIST_CLIENTS.value: self._list_clients,
            Op.LIST_SEGMENTS.value: self._list_segments,
            Op.GET_CONFIG.value: self._get_config,
        }

    def handle_master_op(self, identity: bytes, op: bytes, payload: bytes) -> None:
        names = FRONT_OP_COUNTERS.get(op)
        if names is not None:
            self.counters[names[0]] += 1
        try:
            req_id, msg = P.decode_request(op, payload)
        except ProtocolError as exc:
            self.counters["malformed"] += 1
            self._count_failure(op)
            self.front.reject(identity, op, payload, exc.status, str(exc))
            return
        if self.master.state is not MasterState.RUNNING:
            self.front.reject_state(identity, op, req_id)
            return
        if op == Op.HELLO.value:
            status, body = self.hello(identity, msg)
            if status:
                self._count_failure(op)
            self.front.send_reply(identity, op, P.encode_reply(req_id, status, body))
            return
        client = self.clients.get(identity)
        if client is not None and self.master._auth is not None \
                and client.user_id != self.front.user_id:
            client = None
        if client is None:
            self.counters["rejected_unregistered"] += 1
            self.front.send_reply(identity, op, P.encode_reply(
                req_id, Status.NOT_REGISTERED, "send HELLO before other requests"))
            return
        client.last_seen = self.front.now
        if op == Op.HEARTBEAT.value:
            self.front.send_reply(identity, op, P.encode_reply(req_id, 0, 0))
            return
        handler = self._handlers.get(op)
        if handler is None:
            self.front.send_reply(identity, op, P.encode_reply(
                req_id, Status.UNSUPPORTED, f"op {op.hex()} needs a route frame (shard index)"))
            return
        # Master-level requests are answered by tasks that hold their results until
        # sent: bound them per client and in all, so a peer that pipelines thousands
        # (and never reads) costs bounded memory.
        if client.front_ops >= FRONT_OPS_PER_CLIENT or len(self.tasks) >= FRONT_OPS_MAX:
            self.counters["rejected_busy"] += 1
            self.front.send_reply(identity, op, P.encode_reply(
                req_id, Status.BUSY, "too many master-level requests in progress, retry later"))
            return
        refusal = self._walk_refusal(client, op)
        if refusal is not None:
            self._count_failure(op)
            self.front.send_reply(identity, op, P.encode_reply(req_id, *refusal))
            return
        client.front_ops += 1
        task = self.master._loop.create_task(
            self._answer(identity, op, req_id, handler(client, msg)))
        self.tasks.add(task)

        def done(t: asyncio.Task, client: ClientInfo = client) -> None:
            self.tasks.discard(t)
            client.front_ops -= 1

        task.add_done_callback(done)

    def _count_failure(self, op: bytes) -> None:
        names = FRONT_OP_COUNTERS.get(op)
        if names is not None:
            self.counters[names[1]] += 1

    async def _answer(self, identity: bytes, op: bytes, req_id: int, coro: Any) -> None:
        try:
            status, body = await coro
        except Exception as exc:  # noqa: BLE001
            log.exception("[master] op=%s failed", op.hex())
            status, body = Status.INTERNAL_ERROR, f"internal error: {type(exc).__name__}"
        if status:
            self._count_failure(op)
        self.front.send_reply(identity, op, P.encode_reply(req_id, status, body))
        self.front.schedule_recheck()

    def hello(self, identity: bytes, msg: Any) -> tuple[int, Any]:
        self.counters["hello"] += 1
        if msg.protocol_major != P.PROTOCOL_VERSION[0]:
            return Status.VERSION_MISMATCH, (
                f"protocol {msg.protocol_major}.{msg.protocol_minor} not supported; "
                f"master speaks {P.PROTOCOL_VERSION[0]}.x")
        if msg.protocol_minor != P.PROTOCOL_VERSION[1]:
            log.info("[master] client %s speaks protocol minor %d (master %d)",
                     msg.client_id, msg.protocol_minor, P.PROTOCOL_VERSION[1])
        tenant = msg.tenant
        if self.master._auth is not None:
            tenant = self.tenant_of_key.get(self.front.user_id or "", "")
            if not tenant:
                return Status.ILLEGAL_CLIENT, "client key has no tenant on this master"
        old_identity = self.client_ids.get(msg.client_id)
        if identity in self.clients:
            # HELLO again on a registered connection: the registration stands as it is,
            # for the key that made it.
            if self.master._auth is not None \
                    and self.clients[identity].user_id != self.front.user_id:
                return Status.ILLEGAL_CLIENT, "routing id registered under another key"
        elif old_identity is not None and old_identity != identity:
            # The same client reconnected on a new socket: move its registration.
            old = self.clients[old_identity]
            if self.master._auth is not None and old.user_id != self.front.user_id:
                return Status.ILLEGAL_CLIENT, "client id registered under another key"
            if old.tenant != tenant:
                return Status.ILLEGAL_CLIENT, "a client cannot change tenant on reconnect"
            del self.clients[old_identity]
            self._shard_forget(old_identity)
            old.identity = identity
            old.view = ClientView(old.client_id, old.tenant, identity)
            self._shard_register(old)
            self.clients[identity] = old
            self.client_ids[msg.client_id] = identity
        elif identity not in self.clients:
            if len(self.clients) >= self.config.max_clients:
                return Status.UNAVAILABLE_IN_CURRENT_STATUS, (
                    f"client limit reached (max_clients={self.config.max_clients})")
            if tenant != self.config.admin_tenant:
                why = self._client_counts.refusal(tenant, self.front.user_id,
                                                  self.config.tenant_max_clients,
                                                  self.config.max_clients_per_key)
                if why is not None:
                    return Status.TENANT_QUOTA_EXCEEDED, why
            self.clients[identity] = ClientInfo(msg.client_id, identity, tenant,
                                                msg.host_id, self.front.now)
            self.clients[identity].user_id = self.front.user_id
            self._client_counts.add(tenant, self.front.user_id)
            self.client_ids[msg.client_id] = identity
            self._shard_register(self.clients[identity])
        client = self.clients[identity]
        client.last_seen = self.front.now
        client.multi_reply = msg.protocol_minor >= 2
        return 0, {
            "master_version": __version__,
            "protocol": list(P.PROTOCOL_VERSION),
            "shard_count": len(self.master.shards),
            "tenant": client.tenant,
            "lease_ttl_ms": self.config.default_kv_lease_ttl,
            "client_ttl_ms": int(self.config.client_ttl * 1000),
            "put_start_release_timeout_ms": int(self.config.put_start_release_timeout * 1000),
            "limits": {"max_batch": self.config.max_batch, "max_key_bytes": P.KEY_MAX_BYTES,
                       "kv_session_max_batch": self.config.kv_session_max_batch,
                       "kv_sessions": self.config.enable_kv_sessions,
                       # (memberships only where sessions are served: tags otherwise)
                       "session_tags_as_kv_sessions": self.config.session_tags_as_kv_sessions
                       and self.config.enable_kv_sessions},
            "master_host_id": self.master.host_id,
            "master_instance": self.master.instance,
            # In-process shards forward a batch's other keys to their owners through
            # their inboxes; shard processes would pay an ipc hop each.
            "batch_any_shard": not self.master.shard_set.remote,
            **({"reply_trust_ms": int(self.master._election.trust_s * 1000)}
               if self.master._election is not None else {}),
        }

    def _shard_register(self, client: ClientInfo) -> None:
        self.master.shard_set.register_client(client.identity, client.client_id, client.tenant)

    def _shard_forget(self, identity: bytes) -> None:
        self.master.shard_set.forget_client(identity)


    async def _mount(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        if self.clients.get(client.identity) is not client:
            # A BYE (or expiry) pipelined ahead of this MOUNT already forgot the client.
            return Status.NOT_REGISTERED, "client is no longer registered"
        key = client.user_id if self.master._auth is not None else None
        existing = self.segments.get(msg.name)
        proof = admit_mount(msg, client.client_id, key, self.master.host_id, self.config,
                            sum(r.size for r in self.segments.values() if r is not existing))
        if not isinstance(proof, MountProof):
            # Another owner's name or service is worth an operator's look.
            log.log(logging.WARNING if proof[0] == Status.ILLEGAL_CLIENT else logging.INFO,
                    "[master] mount refused segment=%s client=%s: %s", msg.name,
                    client.client_id, proof[1])
            return proof
        if existing is not None:
            if existing.same_mount(client.client_id, key, msg, proof.file_id):
                client.segments.add(msg.name)  # a re-mount after reconnecting: idempotent
                return 0, existing.usable
            return Status.SEGMENT_ALREADY_EXISTS, (
                f"segment {msg.name} is already mounted"
                + (" (by this client, with another size, host, transport or file)"
                   if existing.owner == client.client_id else ""))
        if len(client.segments) >= self.config.max_segments_per_client:
            return Status.INVALID_PARAMS, (
                f"segment limit reached (max_segments_per_client={self.config.max_segments_per_client})")
        if msg.size < 4096 * len(self.master.shards):
            return Status.INVALID_PARAMS, (
                f"segment size must be at least {4096 * len(self.master.shards)} bytes")
        rec = SegmentRecord(msg.name, client.client_id, msg.size, msg.host_id, msg.transport)
        rec.file_id, rec.key, rec.fingerprint = proof.file_id, proof.key, proof.fingerprint
        self.segments[msg.name] = rec
        client.segments.add(msg.name)
        # Placement stays within the tenant (kvmaster/_tenancy.py): the segment holds its
        # tenant's writes only, or every tenant's for a --shared-tenants tenant.
        shared = client.tenant in self._shared_tenants
        rec.usable = sum(await self.master.ask_all("mount_segment", msg.name, client.client_id,
                                                    msg.size, None if shared else client.tenant))
        if self.clients.get(client.identity) is not client:
            client.segments.discard(msg.name)
            if self.segments.get(msg.name) is rec:  # else its leaving unmounted it already,
                await self._drop_segment(msg.name)  # and the name may be mounted anew
            return Status.NOT_REGISTERED, "client left while its segment was being mounted"
        log.info("[master] mounted segment=%s client=%s size=%d", msg.name, client.client_id, msg.size)
        return 0, rec.usable

    async def _drop_segment(self, name: str) -> int:
        self.segments.pop(name, None)
        return sum(await self.master.ask_all("unmount_segment", name))

    async def _unmount(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        rec = self.segments.get(msg.name)
        # The client's own mounts only (not a name another client, or the master, holds
        # under the same client id), and with CURVE only from the key that mounted it.
        if rec is None or rec.owner != client.client_id or msg.name not in client.segments \
                or rec.key != (client.user_id if self.master._auth is not None else None):
            return Status.SEGMENT_NOT_FOUND, f"segment {msg.name} is not mounted by this client"
        client.segments.discard(msg.name)
        return 0, await self._drop_segment(msg.name)

    def _bye(self, client: ClientInfo, msg: Any) -> Any:
        """Forget the client now, as the BYE is read: what the connection sends next (in
        the same message or later) finds it unregistered, and a HELLO that follows
        registers it anew instead of being undone by the BYE.  -> the coroutine that
        answers once the shards have unmounted its segments (unlike the other
        handlers, not a coroutine function: its first part must not wait for the
        task to start)."""
        futures = self.forget_now(client, unlink=False)

        async def answer() -> tuple[int, Any]:
            await asyncio.gather(*futures)
            return 0, 0

        return answer()

    async def forget(self, client: ClientInfo, unlink: bool) -> int:
        """Unmount a client's segments and drop its registration; -> objects erased."""
        return sum(await asyncio.gather(*self.forget_now(client, unlink)))

    def forget_now(self, client: ClientInfo, unlink: bool) -> list[asyncio.Future]:
        """Everything of :meth:`forget` that is done at once: the client's registration
        goes, and every shard is told to drop its staged session updates and to
        unmount its segments, in that order; -> futures of the shards' counts of
        objects erased.  Nothing waits in between, so a request the same connection
        sends next (a new HELLO, a MOUNT of the same segment) is handled after all of
        it, on every shard.  A client already forgotten is left alone (its connection
        may be registered anew, under the same identity and client id)."""
        if self.clients.get(client.identity) is not client:
            return []
        del self.clients[client.identity]
        self._client_counts.remove(client.tenant, client.user_id)
        self._shard_forget(client.identity)
        if self.client_ids.get(client.client_id) == client.identity:
            del self.client_ids[client.client_id]
        names = sorted(client.segments)
        client.segments.clear()
        for shard in self.master.shards:
            shard.post("client_gone", (client.client_id,))
        if unlink:
            for name in names:
                rec = self.segments.get(name)
                if rec is not None and _owners_file(rec, client.client_id) \
                        and unlink_segment(name):
                    log.info("[master] unlinked segment file of expired client name=%s", name)
        futures: list[asyncio.Future] = []
        for name in names:
            self.segments.pop(name, None)
            futures += self.master.post_all("unmount_segment", name)
        return futures

    async def stats(self, client: ClientInfo | None, msg: Any) -> tuple[int, Any]:
        shards = await self.master.ask_all("stats")
        total: dict[str, Any] = {}
        for s in shards:
            for k, v in s.items():
                if k != "shard":
                    total[k] = total.get(k, 0) + v
        out = {"state": self.master.state.value, "clients": len(self.clients),
               "segments": len(self.segments), "front": dict(self.counters),
               "total": total, "shards": shards}
        if self.master._standby is not None:
            out["oplog"] = self.master._standby.status()
        return 0, out

    async def _list_clients(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        now = time.monotonic()
        admin = client.tenant == self.config.admin_tenant
        return 0, [{"client_id": c.client_id, "tenant": c.tenant, "host_id": c.host_id,
                    "idle_ms": int((now - c.last_seen) * 1000), "segments": sorted(c.segments),
                    "suspected": c.suspected}
                   for c in self.clients.values() if admin or c.tenant == client.tenant]

    async def _list_segments(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        allocated: dict[str, int] = {}
        for per_shard in await self.master.ask_all("segment_usage"):
            for name, used in per_shard.items():
                allocated[name] = allocated.get(name, 0) + used
        return 0, [{"name": r.name, "owner": r.owner, "size": r.size, "usable": r.usable,
                    "host_id": r.host_id, "transport": r.transport,
                    "allocated": allocated.get(r.name, 0)} for r in self.segments.values()]

    async def _get_config(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        import dataclasses

        cfg = dataclasses.asdict(self.config)
        cfg.pop("curve_dir", None)
        cfg["curve"] = bool(self.config.curve_dir)
        return 0, cfg

    def _walk_refusal(self, client: ClientInfo, op: bytes) -> tuple[Status, str] | None:
        """Why a request that walks the shards may not run now (kvmaster/_limits.py)."""
        admin = client.tenant == self.config.admin_tenant
        if op == Op.CHECK_CONSISTENCY.value:
            if not admin:
                return Status.ILLEGAL_CLIENT, "CHECK_CONSISTENCY is for the admin tenant only"
            if self._checking:
                return Status.BUSY, "a consistency check is running, retry later"
        elif op in (Op.MOUNT_SEGMENT.value, Op.UNMOUNT_SEGMENT.value) and not admin:
            if not self._walk_buckets.take(client.tenant, self.front.now):
                self.counters["rejected_busy"] += 1
                return Status.BUSY, (f"tenant {client.tenant!r} sends more than {WALK_RATE:g} "
                                     f"mounts and unmounts per second, retry later")
        return None

    async def _check(self, client: ClientInfo, msg: Any) -> tuple[int, Any]:
        self._checking = True
        try:
            return 0, await self.master.check_consistency()
        finally:
            self._checking = False

    async def expire_clients(self, now: float) -> None:
        """Forget the clients silent for more than ``--client-ttl`` at ``now``
        (``time.monotonic()``), one after another; with ``--client-suspicion-ttl``, a
        client silent past ``--client-ttl`` is first suspected (no new writes on its
        segments, its objects kept and readable), forgotten only once silent past both,
        and active again (its segments take writes again) once heard from.  A client
        with a message parked by its tenant's request rate is waiting on the master, not
        silent (a client blocked in a call sends no HEARTBEAT): it is kept until the
        message is handled or dropped (at most PARKED_MAX_AGE_S)."""
        ttl = self.config.client_ttl
        grace = self.config.client_suspicion_ttl
        parked = self.front.parked_peers
        if grace > 0:
            for c in list(self.clients.values()):
                silent = now - c.last_seen > ttl and c.identity not in parked
                if silent and not c.suspected and now - c.last_seen <= ttl + grace:
                    self._suspect(c, True)
                elif c.suspected and not silent:
                    self._suspect(c, False)
        for client in [c for c in self.clients.values()
                       if now - c.last_seen > ttl + grace and c.identity not in parked]:
            # Forgetting one waits on the shards: meanwhile the next may have left (BYE)
            # or shown it is alive (a request, a HELLO from a new socket).
            if self.clients.get(client.identity) is not client \
                    or time.monotonic() - client.last_seen <= ttl + grace \
                    or client.identity in parked:
                continue
            self.counters["clients_expired"] += 1
            log.warning("[master] client expired client=%s segments=%d",
                        client.client_id, len(client.segments))
            await self.forget(client, unlink=True)

    def _suspect(self, client: ClientInfo, on: bool) -> None:
        """Mark ``client`` suspected (``on``) or active again, and tell every shard to
        stop or resume placing writes on its segments."""
        client.suspected = on
        if on:
            self.counters["clients_suspected"] += 1
            log.warning("[master] client suspected (silent for more than %.1f s; its "
                        "objects stay, no new writes on its segments) client=%s segments=%d",
                        self.config.client_ttl, client.client_id, len(client.segments))
        else:
            self.counters["clients_recovered"] += 1
            log.warning("[master] suspected client heard from again client=%s",
                        client.client_id)
        if client.segments:
            self.master.post_all("suspect_segments", sorted(client.segments), on)

    def remove_orphan_files(self) -> None:
        """Segment files on this host whose owner died before it expired: nobody maps
        them any more (a live owner always maps its own segment)."""
        ours = {os.path.join(SHM_DIR, r.name): r for r in self.segments.values()
                if r.file_id is not None and r.owner != MASTER_CLIENT}
        if not ours:
            return
        mapped: set[str] = set()
        for maps in glob.glob("/proc/[0-9]*/maps"):
            try:
                with open(maps) as f:
                    mapped.update(line.rsplit(None, 1)[-1] for line in f if SHM_DIR in line)
            except OSError:
                continue
        for path, rec in ours.items():
            if path not in mapped and _file_id(rec.name) == rec.file_id and \
                    unlink_segment(rec.name):
                log.info("[master] removed segment file of a dead client name=%s", rec.name)
