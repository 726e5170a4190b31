"""SGLang HiCache storage backend on kvmaster's native client, with sessions.

SGLang (0.5.23) loads it as a dynamic storage backend; every field of the extra
config below is read by :class:`HiCacheConfig` (docs/engines.md has the whole
command)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvmaster",
        "module_path": "kvmaster.hicache", "class_name": "KvmasterHiCacheStorage",
        "interface_v1": 1, "master_server_address": "127.0.0.1:50051",
        "global_segment_size": "4GB"}'

``interface_v1`` makes SGLang's cache controller call the zero-copy page calls
(``batch_exists``, ``batch_get_v1``, ``batch_set_v1``: the pages' own host-pool
memory is copied straight to and from the segment); without it the controller calls
the older tensor calls (``batch_get`` / ``batch_set`` of flat data pages, and
``batch_exists`` for their hits), which this backend serves too, under keys of their
own.

**Objects.** One object per page and rank, ``<prefix>/<page hash>/<rank>.<layout>.
<dtype>``: the prefix is ``key_prefix`` or the model name; the rank names the part of
the model this worker holds (``tp<r>of<n>`` for an MHA model, whose TP ranks hold
different heads; MLA ranks all hold the same latent KV, so they share one object),
with ``pp`` and attention-CP ranks; the host pool's layout and dtype follow, as a
page's bytes are in that order and type.  Data-parallel workers of one model share every
object: that is what makes a prefix computed by one worker a hit for the others.
A page's object is the concatenation of the runs the host pool's
``get_page_buffer_meta`` names for it, in that order: K then V for an MHA page in
``page_first`` / ``page_first_direct``; each layer's run for ``layer_first`` (MLA,
and MHA too, which SGLang's Mooncake backend refuses).  Writes and reads are one
``batch_put_from_ptrs`` / ``batch_get_into_ptrs`` per call, one copy per run.

**Sessions.** SGLang 0.5.23 passes no session to its storage backends: its
scheduler's ``open_session`` / ``close_session`` stop at the radix cache, and the
controller's calls carry only ``prefix_keys``.  This backend takes the session of a
call from ``extra_info.extra_info["session_id"]`` (the field SGLang's Mooncake
backend reads for its writes) and offers the session events as methods
(:meth:`KvmasterHiCacheStorage.begin_request`, ``end_request``,
``update_session``, ``close_session``) for the code that knows them.  What each
does to the store:

* a write in a session tags its pages with the session (``kv_sessions``);
* a lookup in a session attaches its hits, pages another worker wrote included,
  that this worker has not yet seen in the session (``attach_kv_session``);
* a session is pinned (``pin_kv_session``) from its first page while it has a call
  or request within ``session_grace_s``; the pin is sent again once it is older
  than half the grace, so another worker's unpin heals within that time;
* ``session_grace_s`` after its last call (and with no request begun and not
  ended) this worker unpins it;
* ``update_session(sid, kept_page_hashes)`` keeps only those pages as members (a
  trimmed or rewound context); ``close_session`` closes it in the store.

Calls without a session behave as with no sessions at all.  Store errors never
reach SGLang: a failed page reads as a miss or a failed write, logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvmaster import errors as E
from kvmaster._core import ReplicateConfig
from kvmaster.client import Client
from kvmaster.compat._mooncake_config import parse_size

__all__ = ["HiCacheConfig", "KvmasterHiCacheStorage"]

log = logging.getLogger("kvmaster.hicache")

#: Sessions this backend keeps state for; past it the least recently used one is
#: unpinned (when this worker pinned it) and forgotten (membership stays).
MAX_SESSIONS = 65536
#: Member keys remembered per session (to attach only what is new); past it the
#: set is cleared, so some hits are attached again (idempotent).
MAX_KNOWN_MEMBERS = 65536


@dataclass
class HiCacheConfig:
    """The backend's fields of SGLang's ``--hicache-storage-backend-extra-config``.

    master_server_address: the master's ``host:port`` (or ``etcd://...``).
    global_segment_size: bytes this worker lends the store (int, or a string such
    as "4GB"); 0 makes it a consumer only.
    tenant: the tenant to register as.  key_prefix: replaces the model name in
    object keys ("" keeps it).  session_grace_s: seconds a session stays pinned
    after its last call.  session_pins: see the field.  timeout_s: seconds one
    store call may take.
    """

    master_server_address: str = "127.0.0.1:50051"
    global_segment_size: int = 1 << 30
    tenant: str | None = None
    local_hostname: str | None = None
    key_prefix: str = ""
    session_grace_s: float = 30.0
    #: False: the backend tags and attaches but never pins or unpins by itself (the
    #: caller's own policy pins, as the load generator's does through LoadgenClient).
    session_pins: bool = True
    timeout_s: float | None = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> HiCacheConfig:
        """Reads the fields named above from ``extra`` (other keys, SGLang's own such
        as ``backend_name`` and ``interface_v1``, are left alone).  Raises ValueError
        naming a bad field."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in extra.items() if k in known}
        if "global_segment_size" in kw:
            kw["global_segment_size"] = parse_size(kw["global_segment_size"],
                                                   "global_segment_size")
        cfg = cls(**kw)
        if not isinstance(cfg.session_grace_s, (int, float)) or cfg.session_grace_s <= 0:
            raise ValueError(f"session_grace_s must be a positive number of seconds, "
                             f"got {cfg.session_grace_s!r}")
        return cfg


@dataclass
class _Session:
    """This worker's view of one session."""

    last_use: float
    #: time.monotonic() of this worker's last pin; None when it holds no pin.
    pinned_at: float | None = None
    #: Requests begun and not ended (begin_request / end_request).
    running: int = 0
    #: Object keys this worker knows to be members.
    members: set[str] = field(default_factory=set)
    #: False until a page was associated (a pin before that is SESSION_NOT_FOUND).
    exists: bool = False


class KvmasterHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """``HiCacheStorage`` on one :class:`kvmaster.Client` (module docstring).

    ``storage_config``: SGLang's ``HiCacheStorageConfig``; its ``extra_config`` is
    read by :meth:`HiCacheConfig.from_extra_config`.  ``kwargs`` (what SGLang's
    factory passes to a dynamic backend) is accepted and unused.  Raises
    ValueError for a configuration it does not serve (split heads, decode context
    parallelism), and the client's errors when the master cannot be reached.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None,
                 *, client: Client | None = None) -> None:
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError("kvmaster's HiCache backend does not serve split heads "
                             "(should_split_heads)")
        if getattr(storage_config, "dcp_size", 1) != 1:
            raise ValueError("kvmaster's HiCache backend does not serve decode context "
                             "parallelism (dcp_size > 1)")
        self.storage_config = storage_config
        self.config = HiCacheConfig.from_extra_config(storage_config.extra_config)
        prefix = self.config.key_prefix or "-".join(
            (storage_config.model_name or "model").split("/"))
        cp = (f".cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}"
              if storage_config.attn_cp_size > 1 else "")
        if storage_config.is_mla_model:
            rank = f"mla.pp{storage_config.pp_rank}of{storage_config.pp_size}{cp}"
        else:
            rank = (f"tp{storage_config.tp_rank}of{storage_config.tp_size}"
                    f".pp{storage_config.pp_rank}of{storage_config.pp_size}{cp}")
        self._prefix = f"{prefix}/"
        self._rank = f"/{rank}"
        self._suffix = self._rank
        #: Without interface_v1 SGLang's controller writes and reads flat tensor pages
        #: (batch_set / batch_get) and asks batch_exists for them: their own keys.
        self._flat = not (storage_config.extra_config or {}).get("interface_v1")
        self.mem_pool_host: Any = None
        self.enable_storage_metrics = bool(storage_config.enable_storage_metrics)
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []
        self._page_bytes = 0
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        #: Pinned sessions forgotten at MAX_SESSIONS, for the sweeper to unpin.
        self._forgotten: list[str] = []
        #: Counts of what the session mapping did (session calls per request).
        self.session_calls: dict[str, int] = dict.fromkeys(
            ("tag", "attach", "pin", "unpin", "update", "close"), 0)
        self.client = client if client is not None else Client()
        if client is None:
            self.client.setup(self.config.master_server_address,
                              self.config.global_segment_size, self.config.tenant,
                              local_hostname=self.config.local_hostname,
                              timeout_s=self.config.timeout_s)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, daemon=True,
                                         name="kvmaster-hicache-sessions")
        self._sweeper.start()

    # ------------------------------------------------------------- keys, pages

    def object_keys(self, page_hashes: Sequence[str], flat: bool = False) -> list[str]:
        """The store keys of pages (``flat``: of the tensor calls' flat pages)."""
        suffix = self._suffix + (".flat" if flat else "")
        return [f"{self._prefix}{h}{suffix}" for h in page_hashes]

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV host pool whose pages ``batch_get_v1`` / ``batch_set_v1`` address."""
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            raise ValueError("kvmaster's HiCache backend serves host pools with a KV "
                             "buffer (MHA and MLA models), not logical anchors")
        self._page_bytes = mem_pool_host.get_ksize_per_token() * mem_pool_host.page_size
        # A page's bytes are in its pool's layout and dtype: workers that differ in
        # either never read each other's objects.
        layout = getattr(mem_pool_host, "layout", None)
        dtype = str(getattr(mem_pool_host, "dtype", "")).removeprefix("torch.")
        self._suffix = self._rank + (f".{layout}.{dtype}" if layout else "")

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Only the KV pool is served; another pool (Mamba, SWA, DeepSeek V4, draft)
        raises ValueError, so SGLang fails at attach rather than missing silently."""
        if str(host_pool_name) != "kv":
            raise ValueError(f"kvmaster's HiCache backend serves the KV pool only, "
                             f"not {host_pool_name!s}")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _page_runs(self, n: int, host_indices: Any) -> tuple[list[list[int]], list[list[int]]]:
        """Per page, the (pointers, sizes) of its runs in the host pool."""
        pool = self.mem_pool_host
        if pool is None:
            raise RuntimeError("register_mem_pool_host was not called")
        if len(host_indices) != n * pool.page_size:
            raise ValueError(f"{len(host_indices)} host indices for {n} pages of "
                             f"{pool.page_size} tokens")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        if n == 0 or len(ptrs) % n or len(ptrs) != len(sizes):
            raise ValueError(f"the host pool named {len(ptrs)} runs for {n} pages")
        per = len(ptrs) // n
        return ([list(ptrs[i:i + per]) for i in range(0, len(ptrs), per)],
                [list(sizes[i:i + per]) for i in range(0, len(sizes), per)])

    # -------------------------------------------------------- zero-copy calls

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Pages of ``keys`` (page hashes, a prefix chain) stored from the first:
        the length of the leading run.  In a session the hits are attached."""
        return self._exists(self.object_keys(keys, self._flat), extra_info)

    def _exists(self, objs: list[str], extra_info: Any) -> int:
        if not objs:
            return 0
        try:
            found = self.client.batch_is_exist(objs)
        except E.KVMasterError as exc:
            log.warning("batch_is_exist of %d pages failed: %s", len(objs), exc)
            return 0
        hits = next((i for i, f in enumerate(found) if f != 1), len(found))
        sid = self.session_of(extra_info)
        if sid is not None:
            self._attach(sid, objs[:hits])
        return hits

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Reads pages into the host pool at ``host_indices`` (``len(keys)`` pages);
        True per page read whole."""
        if not keys:
            return []
        ptrs, sizes = self._page_runs(len(keys), host_indices)
        t0 = time.perf_counter()
        try:
            got = self.client.batch_get_into_ptrs(self.object_keys(keys), ptrs, sizes)
        except E.KVMasterError as exc:
            log.warning("batch_get_into_ptrs of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        self._note(self.prefetch_pgs, self.prefetch_bandwidth, len(keys), t0)
        self._use(self.session_of(extra_info))
        return [g == sum(s) for g, s in zip(got, sizes)]

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Writes pages from the host pool at ``host_indices``; a page already stored
        is not copied again (and is tagged, in a session).  True per page stored."""
        if not keys:
            return []
        ptrs, sizes = self._page_runs(len(keys), host_indices)
        return self._put(self.object_keys(keys), ptrs, sizes, extra_info)

    def _put(self, objs: list[str], ptrs: list[list[int]], sizes: list[list[int]],
             extra_info: Any) -> list[bool]:
        sid = self.session_of(extra_info)
        # (one tag list per distinct key: a key given twice is written once)
        config = ReplicateConfig(kv_sessions=[[sid]] * len(set(objs))) if sid else None
        t0 = time.perf_counter()
        try:
            out = self.client.batch_put_from_ptrs(objs, ptrs, sizes, config)
        except E.KVMasterError as exc:
            log.warning("batch_put_from_ptrs of %d pages failed: %s", len(objs), exc)
            return [False] * len(objs)
        self._note(self.backup_pgs, self.backup_bandwidth, len(objs), t0)
        ok = [s == 0 for s in out]
        if sid is not None:
            self._tagged(sid, [k for k, good in zip(objs, ok) if good])
        return ok

    # ----------------------------------------------- tensor calls (generic path)

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> Any:
        """One flat page into ``target_location`` (a contiguous CPU tensor); the
        tensor, or None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        """Flat pages (SGLang's generic path) into the tensors ``target_locations``;
        per key the tensor filled, or None."""
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("batch_get takes one target tensor per key")
        ptrs = [[t.data_ptr()] for t in target_locations]
        sizes = [[t.numel() * t.element_size()] for t in target_locations]
        try:
            got = self.client.batch_get_into_ptrs(self.object_keys(keys, True), ptrs, sizes)
        except E.KVMasterError as exc:
            log.warning("batch_get_into_ptrs of %d pages failed: %s", len(keys), exc)
            return [None] * len(keys)
        return [t if g == s[0] else None for t, g, s in zip(target_locations, got, sizes)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """One flat page (a contiguous CPU tensor); True when stored."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Flat pages ``values`` (contiguous CPU tensors); True when all are stored."""
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set takes one tensor per key")
        values = [v.contiguous() for v in values]  # (kept alive through the copy)
        ptrs = [[v.data_ptr()] for v in values]
        sizes = [[v.numel() * v.element_size()] for v in values]
        return all(self._put(self.object_keys(keys, True), ptrs, sizes, None))

    def exists(self, key: str) -> bool:
        """Whether the page ``key`` is stored (the flat page without ``interface_v1``)."""
        return self._exists(self.object_keys([key], self._flat), None) == 1

    # ------------------------------------------------------------ sessions

    @staticmethod
    def session_of(extra_info: Any) -> str | None:
        """The session of a call: ``extra_info.extra_info["session_id"]``, or None."""
        extra = getattr(extra_info, "extra_info", None)
        sid = extra.get("session_id") if isinstance(extra, dict) else None
        return str(sid) if sid else None

    def _session(self, sid: str, now: float) -> _Session:
        """Caller holds the lock."""
        s = self._sessions.get(sid)
        if s is None:
            s = self._sessions[sid] = _Session(now)
            if len(self._sessions) > MAX_SESSIONS:
                old_sid, old = self._sessions.popitem(last=False)
                if old.pinned_at is not None:
                    self._forgotten.append(old_sid)  # (unpinned by the sweeper)
        else:
            s.last_use = now
            self._sessions.move_to_end(sid)
        return s

    def _use(self, sid: str | None) -> None:
        """A call in ``sid`` with no new page: the session is in use (re-pinned when
        its pin is old)."""
        if sid is None:
            return
        with self._lock:
            s = self._session(sid, time.monotonic())
            due = s.exists and self._pin_due(s)
        if due:
            self._pin(sid)

    def _pin_due(self, s: _Session) -> bool:
        if not self.config.session_pins:
            return False
        return s.pinned_at is None or \
            time.monotonic() - s.pinned_at > self.config.session_grace_s / 2

    def _attach(self, sid: str, objs: list[str]) -> None:
        with self._lock:
            s = self._session(sid, time.monotonic())
            new = [k for k in objs if k not in s.members]
        if new:
            try:
                out = self.client.attach_kv_session(sid, new)
            except E.KVMasterError as exc:
                log.warning("attach_kv_session(%s) of %d pages failed: %s", sid, len(new), exc)
                out = []
            self._count("attach")
            self._tagged(sid, [k for k, st in zip(new, out) if st == 0], count=False)
        else:
            self._use(sid)

    def _tagged(self, sid: str, objs: list[str], count: bool = True) -> None:
        """``objs`` are now members of ``sid``: remember them, pin when due."""
        if count and objs:
            self._count("tag")
        with self._lock:
            s = self._session(sid, time.monotonic())
            if len(s.members) + len(objs) > MAX_KNOWN_MEMBERS:
                s.members.clear()
            s.members.update(objs)
            s.exists = s.exists or bool(objs)
            due = s.exists and self._pin_due(s)
        if due:
            self._pin(sid)

    def _count(self, call: str) -> None:
        with self._lock:
            self.session_calls[call] += 1

    def _pin(self, sid: str) -> None:
        try:
            self.client.pin_kv_session(sid)
        except E.SessionNotFound:
            return
        except E.KVMasterError as exc:
            log.warning("pin_kv_session(%s) failed: %s", sid, exc)
            return
        self._count("pin")
        with self._lock:
            s = self._sessions.get(sid)
            if s is not None:
                s.pinned_at = time.monotonic()
                s.exists = True  # (a pin answered: the session has pages)

    def _unpin(self, sid: str) -> bool:
        """True when the session is unpinned (or gone); False: tried again later."""
        try:
            self.client.unpin_kv_session(sid)
        except E.SessionNotFound:
            return True
        except E.KVMasterError as exc:
            log.warning("unpin_kv_session(%s) failed: %s", sid, exc)
            return False
        self._count("unpin")
        return True

    def begin_request(self, session_id: str) -> None:
        """A request of ``session_id`` runs on this worker: the session stays pinned
        until :meth:`end_request`, however long its calls are apart."""
        with self._lock:
            s = self._session(session_id, time.monotonic())
            s.running += 1
            due = self._pin_due(s)  # (a session this worker has not seen may exist)
        if due:
            self._pin(session_id)

    def end_request(self, session_id: str) -> None:
        """The request ended; the session is unpinned ``session_grace_s`` from now
        unless a call or request of it comes first."""
        with self._lock:
            s = self._session(session_id, time.monotonic())
            s.running = max(0, s.running - 1)

    def update_session(self, session_id: str, kept_page_hashes: Sequence[str]) -> int:
        """The session's context was trimmed or rewound to ``kept_page_hashes``: its
        other pages stop being members (their data stays).  Returns the number of
        members removed (0 for an unknown session)."""
        keep = self.object_keys(kept_page_hashes)
        try:
            removed = int(self.client.update_kv_session(session_id, keep) or 0)
        except E.KVMasterError as exc:
            log.warning("update_kv_session(%s) failed: %s", session_id, exc)
            return 0
        self._count("update")
        with self._lock:
            s = self._sessions.get(session_id)
            if s is not None:
                s.members &= set(keep)
        return removed

    def close_session(self, session_id: str) -> None:
        """The session ended: closed in the store (memberships and pin dropped, data
        kept) and forgotten here.  When the store cannot be reached it is logged and
        the session kept, so the sweeper unpins it after the grace."""
        try:
            self.client.close_kv_session(session_id)
        except E.KVMasterError as exc:
            log.warning("close_kv_session(%s) failed: %s", session_id, exc)
            with self._lock:
                s = self._sessions.get(session_id)
                if s is not None:
                    s.running = 0
            return
        with self._lock:
            self._sessions.pop(session_id, None)
        self._count("close")

    def _sweep_loop(self) -> None:
        tick = min(1.0, self.config.session_grace_s / 4)
        while not self._stop.wait(tick):
            self.sweep()

    def sweep(self) -> list[str]:
        """Unpins the sessions idle for ``session_grace_s``, and pins again the ones in
        use (a request running, or a call within the grace) whose pin is older than
        half the grace, so another worker's unpin heals while no call comes (a
        request decoding).  An unpin that failed is tried at the next sweep.  The
        background thread calls this; returns the ids unpinned."""
        now = time.monotonic()
        grace = self.config.session_grace_s
        with self._lock:
            idle = [sid for sid, s in self._sessions.items()
                    if s.pinned_at is not None and not s.running
                    and now - s.last_use > grace]
            for sid in idle:
                self._sessions[sid].pinned_at = None
            forgotten, self._forgotten = self._forgotten, []
            repin = [sid for sid, s in self._sessions.items()
                     if s.pinned_at is not None and (s.running or now - s.last_use <= grace)
                     and self._pin_due(s)]
        done: list[str] = []
        failed: list[str] = []
        for sid in idle + forgotten:
            (done if self._unpin(sid) else failed).append(sid)
        if failed:
            with self._lock:
                for sid in failed:
                    s = self._sessions.get(sid)
                    if s is None:
                        self._forgotten.append(sid)
                    elif s.pinned_at is None:
                        s.pinned_at = now - grace  # (still pinned: unpinned when idle)
        for sid in repin:
            self._pin(sid)
        return done

    # ------------------------------------------------------------- the rest

    def _note(self, pages: list[int], bandwidth: list[float], n: int, t0: float) -> None:
        if self.enable_storage_metrics:
            dt = max(time.perf_counter() - t0, 1e-9)
            pages.append(n)
            bandwidth.append(n * self._page_bytes / dt / (1 << 30))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the pages moved since the last call (GiB/s
        per call), or None when storage metrics are off."""
        if not self.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import (  # type: ignore[import-not-found]
            StorageMetrics,
        )
        m = StorageMetrics()
        for mine, theirs in ((self.prefetch_pgs, m.prefetch_pgs),
                             (self.backup_pgs, m.backup_pgs),
                             (self.prefetch_bandwidth, m.prefetch_bandwidth),
                             (self.backup_bandwidth, m.backup_bandwidth)):
            theirs.extend(mine)
            mine.clear()
        return m

    def clear(self) -> None:
        """Nothing: the store is shared by every worker, and one worker does not
        clear it (remove keys through the native client)."""

    def close(self) -> None:
        """Unpins the sessions this worker pinned, stops the sweeper, closes the
        client (its segment is unmounted; objects in it are lost)."""
        self._stop.set()
        self._sweeper.join(timeout=2)
        with self._lock:
            pinned = [sid for sid, s in self._sessions.items() if s.pinned_at is not None]
            pinned += self._forgotten
            self._sessions.clear()
            self._forgotten = []
        for sid in pinned:
            self._unpin(sid)
        self.client.close()


# ------------------------------------------------------------ load generator

class _BytePool:
    """A host pool of ``pages`` pages of ``page_bytes`` bytes, one token a page, in
    the shape the backend reads of SGLang's (``page_size``, ``kv_buffer``,
    ``get_ksize_per_token``, ``get_page_buffer_meta``)."""

    page_size = 1

    def __init__(self, page_bytes: int, pages: int) -> None:
        import ctypes

        self.page_bytes, self.pages = page_bytes, pages
        self.kv_buffer = (ctypes.c_char * (page_bytes * pages))()
        self.base = ctypes.addressof(self.kv_buffer)

    def get_ksize_per_token(self) -> int:
        return self.page_bytes

    def get_page_buffer_meta(self, indices: Sequence[int]) -> tuple[list[int], list[int]]:
        return ([self.base + i * self.page_bytes for i in indices],
                [self.page_bytes] * len(indices))

    def view(self, page: int) -> memoryview:
        return memoryview(self.kv_buffer).cast("B")[page * self.page_bytes:
                                                    (page + 1) * self.page_bytes]


class LoadgenClient:
    """The load generator's client (``kvmaster-loadgen --client-factory
    kvmaster.hicache:LoadgenClient``) made of the backend's storage calls, called as
    HiCache's controller calls them: ``batch_is_exist`` is ``batch_exists`` over the
    page list (the leading run answered 1, the rest 0), ``get_batch`` is
    ``batch_get_v1`` of the hits into host pages, ``put_batch`` is ``batch_set_v1``
    of the misses from host pages (the keys a write tags with a session in that
    session's call, the others without).  The replay's own session policy pins: the
    backend runs with ``session_pins`` off, and the session calls go to its client
    with the keys mapped to the backend's object keys.  Needs SGLang's
    ``hicache_storage`` importable.  A failed page write reads ``TRANSFER_FAIL``
    (-800): the backend reports success per page only."""

    def __init__(self, model: str = "loadgen/model") -> None:
        self.model = model
        self.backend: KvmasterHiCacheStorage | None = None
        self._pool: _BytePool | None = None
        #: Bytes of a block (the first write's, or the first read's object).
        self._size: int | None = None
        self._lock = threading.Lock()

    def setup(self, master_server_addr: str, global_segment_size: int,
              tenant: str | None = None) -> None:
        from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
            HiCacheStorageConfig as Config,
        )

        cfg = Config(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                     attn_cp_size=1, is_mla_model=True, enable_storage_metrics=False,
                     is_page_first_layout=True, model_name=self.model,
                     extra_config={"master_server_address": master_server_addr,
                                   "global_segment_size": global_segment_size,
                                   "tenant": tenant, "session_pins": False,
                                   "interface_v1": 1})
        self.backend = KvmasterHiCacheStorage(cfg)

    def _backend(self) -> KvmasterHiCacheStorage:
        if self.backend is None:
            raise RuntimeError("setup was not called")
        return self.backend

    def _pages(self, values: Sequence[Any] | None, n: int, size: int) -> _BytePool:
        """Caller holds the lock: a pool of at least ``n`` pages of ``size`` bytes."""
        if self._pool is None or self._pool.page_bytes != size or self._pool.pages < n:
            self._pool = _BytePool(size, max(n, 64))
            self._backend().register_mem_pool_host(self._pool)
        if values is not None:
            for i, v in enumerate(values):
                self._pool.view(i)[:] = v
        return self._pool

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        hits = self._backend().batch_exists(list(keys))
        return [1] * hits + [0] * (len(keys) - hits)

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        b = self._backend()
        if not keys:
            return []
        if self._size is None:  # (the replay's blocks are all one size)
            try:
                self._size = int(b.client.get_size(b.object_keys(keys[:1])[0]))
            except E.ObjectNotFound:
                return [None] * len(keys)
        size = self._size
        with self._lock:
            pool = self._pages(None, len(keys), size)
            ok = b.batch_get_v1(list(keys), range(len(keys)))
            return [bytes(pool.view(i)) if good else None for i, good in enumerate(ok)]

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> list[int]:
        from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
            HiCacheStorageExtraInfo as Info,
        )

        if not keys:
            return []
        b = self._backend()
        tags = list(config.kv_sessions or []) if config is not None else []
        tags += [[]] * (len(keys) - len(tags))
        out: list[int] = []
        self._size = self._size or len(values[0])
        with self._lock:
            pool = self._pages(values, len(keys), len(values[0]))
            start = 0
            while start < len(keys):  # runs of keys with the same tag
                end = start + 1
                while end < len(keys) and tags[end] == tags[start]:
                    end += 1
                sid = tags[start][0] if tags[start] else None
                info = Info(extra_info={"session_id": sid}) if sid else None
                ok = b.batch_set_v1(list(keys[start:end]), range(start, end), info)
                out += [0 if good else -800 for good in ok]
                start = end
        del pool
        return out

    def attach_kv_session(self, session_id: str, keys: Sequence[str]) -> list[int]:
        b = self._backend()
        return list(b.client.attach_kv_session(session_id, b.object_keys(keys)))

    def update_kv_session(self, session_id: str, keep_keys: Sequence[str]) -> int:
        return self._backend().update_session(session_id, list(keep_keys))

    def pin_kv_session(self, session_id: str) -> None:
        self._backend().client.pin_kv_session(session_id)

    def unpin_kv_session(self, session_id: str) -> None:
        self._backend().client.unpin_kv_session(session_id)

    def close_kv_session(self, session_id: str) -> None:
        self._backend().close_session(session_id)

    def get_kv_session(self, session_id: str) -> Any:
        return self._backend().client.get_kv_session(session_id)

    def stats(self) -> Any:
        return self._backend().client.stats()

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None
