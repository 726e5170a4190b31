"""Model-based test of KV sessions against one real master.

Hypothesis interleaves writes (single and batch, put and upsert, tagged or
not), attach, pin, unpin, update, close, remove and filler writes that push a
small segment into eviction, all through one client of one master started for
the test function.  After every step the master is compared with a plain
in-memory model of the semantics:

* which pool keys exist (eviction makes this unpredictable, so existence is
  read from the master with ``batch_is_exist`` and the model follows it, but
  only write steps may make keys vanish, and never a member of a pinned
  session: the master runs with ``--no-allow-evict-soft-pinned-objects``);
* which sessions exist, with exactly the model's members (listed page by page)
  and pin flag; a session without members does not exist (SessionNotFound);
  a session re-created after vanishing is unpinned;
* a write refused for lack of space leaves no ordinary object on its shard;
* ``check_consistency()`` is empty.

The master runs with a high watermark of 1.0, so eviction happens only inside
write steps (when an allocation does not fit), never in the background.

Examples are derandomized (the same on every run).  Shrinking a failure against
a real master can take minutes, so it is off unless ``KVMASTER_MODEL_SHRINK=1``
is set: a failure is reported as the full step sequence that found it.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvmaster import (
    Client,
    NoAvailableHandle,
    ObjectNotFound,
    ReplicateConfig,
    SessionNotFound,
    Status,
)
from kvmaster import protocol as P

KiB = 1 << 10
MiB = 1 << 20
SHARDS = 2
SLOT = 64 * KiB
SLOTS_PER_SHARD = 4
VALUE = b"m" * SLOT
N_KEYS = 10
N_SESSIONS = 3

MASTER_FLAGS = ("--shards", str(SHARDS), "--eviction-high-watermark-ratio", "1.0",
                "--no-allow-evict-soft-pinned-objects")
SEED = P.tenant_seed(P.DEFAULT_TENANT)

_examples = itertools.count()
_PHASES = (Phase.explicit, Phase.reuse, Phase.generate) + (
    (Phase.shrink,) if os.environ.get("KVMASTER_MODEL_SHRINK") == "1" else ())
#: How often the interesting situations came up (checked at the end: the run must
#: have reached them, or it proves little).
SEEN: Counter[str] = Counter()


def event(what: str) -> None:
    SEEN[what] += 1

key_ix = st.integers(0, N_KEYS - 1)
sid_ix = st.integers(0, N_SESSIONS - 1)
tag_ixs = st.lists(sid_ix, max_size=3)  # duplicates allowed: they count once


def shard(key: str) -> int:
    return P.shard_of(key.encode(), SEED, SHARDS)


class SessionMachine(RuleBasedStateMachine):
    """The model: ``exists`` (pool keys), ``sessions`` (id -> members), ``pinned``."""

    client: Client  # set by the test before running

    def __init__(self) -> None:
        super().__init__()
        self.c = type(self).client
        ns = f"x{next(_examples)}/"
        self.keys = [f"{ns}k{i}" for i in range(N_KEYS)]
        self.sids = [f"{ns}s{i}" for i in range(N_SESSIONS)]
        self.ns = ns
        self.exists: set[str] = set()
        self.sessions: dict[str, set[str]] = {}
        self.pinned: set[str] = set()
        self.fillers: list[str] = []
        self.vanished_sids: set[str] = set()

    # ---------------------------------------------------------------- model ops

    def _add(self, sid: str, key: str) -> None:
        if sid not in self.sessions:
            if sid in self.vanished_sids:
                event("session re-created after vanishing")
            self.sessions[sid] = set()
            self.pinned.discard(sid)  # a new session starts unpinned
        self.sessions[sid].add(key)

    def _drop_key(self, key: str, sids: Any = None) -> None:
        for sid in list(self.sessions if sids is None else sids):
            mem = self.sessions.get(sid)
            if mem is None:
                continue
            mem.discard(key)
            if not mem:
                self._delete(sid)

    def _delete(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        self.pinned.discard(sid)
        self.vanished_sids.add(sid)

    def _pinned_members(self) -> set[str]:
        return {k for s in self.pinned for k in self.sessions.get(s, ())}

    def _sessions_of(self, key: str) -> set[str]:
        return {s for s, mem in self.sessions.items() if key in mem}

    # ------------------------------------------------------------------- steps

    def _write_step(self, keys: list[str], tag_lists: list[list[str]], upsert: bool,
                    batch: bool, send_empty: bool = False) -> None:
        c = self.c
        before_exists = set(self.exists)
        before_sessions = {k: self._sessions_of(k) for k in keys}
        pinned_members = self._pinned_members()
        evicted0 = c.stats()["evicted_keys"]
        config = (ReplicateConfig(kv_sessions=tag_lists) if any(tag_lists) or send_empty
                  else None)
        if batch:
            fn = c.upsert_batch if upsert else c.put_batch
            results = fn(keys, [VALUE] * len(keys), config)
        else:
            try:
                (c.upsert if upsert else c.put)(keys[0], VALUE, config)
                results = [0]
            except NoAvailableHandle:
                results = [int(Status.NO_AVAILABLE_HANDLE)]
        assert all(r in (0, Status.NO_AVAILABLE_HANDLE) for r in results), results
        for key, tl, r in zip(keys, tag_lists, results):
            if r == 0:
                self.exists.add(key)
                for sid in tl:
                    self._add(sid, key)
        evicted = c.stats()["evicted_keys"] - evicted0
        self._follow_evictions(pinned_members, may_evict=True)
        if evicted:
            event("write step evicted")
            # A key that existed and was written again in this step may have had its
            # old object evicted by this very step: then its old-only memberships are
            # gone.  Read which case happened from a session it was only in before.
            for key, tl in zip(keys, tag_lists):
                old_only = before_sessions[key] - set(tl)
                if key in before_exists and key in self.exists and old_only:
                    probe = sorted(old_only)[0]
                    try:
                        still = key in self.c.iter_kv_session_keys(probe)
                    except SessionNotFound:
                        still = False
                    if not still:
                        event("write evicted the old version of a key it rewrote")
                        self._drop_key(key, old_only)
        else:
            assert self.exists >= before_exists, "objects vanished without eviction"
        if not batch and results[0] == Status.NO_AVAILABLE_HANDLE:
            self._check_full_of_pinned(shard(keys[0]))

    def _follow_evictions(self, pinned_members: set[str], may_evict: bool) -> None:
        truth = {k for k, e in zip(self.keys, self.c.batch_is_exist(self.keys)) if e == 1}
        assert truth <= self.exists, f"objects the model does not know: {truth - self.exists}"
        gone = self.exists - truth
        if not gone:
            return
        assert may_evict, f"objects vanished outside a write step: {sorted(gone)}"
        assert not gone & pinned_members, \
            f"members of pinned sessions evicted: {sorted(gone & pinned_members)}"
        event("pool keys evicted")
        for key in gone:
            self.exists.discard(key)
            self._drop_key(key)

    def _check_full_of_pinned(self, s: int) -> None:
        """A single write refused for space: no ordinary object may be left on its shard."""
        event("write refused: shard full of pinned objects")
        fillers = [f for f in self.fillers if shard(f) == s]
        alive = [f for f, e in zip(fillers, self.c.batch_is_exist(fillers) if fillers else [])
                 if e == 1]
        assert not alive, f"write refused while ordinary fillers exist: {alive[:4]}"
        ordinary = [k for k in self.exists if shard(k) == s and k not in self._pinned_members()]
        assert not ordinary, f"write refused while ordinary objects exist: {ordinary}"

    @initialize()
    def start(self) -> None:
        assert self.c.batch_is_exist(self.keys) == [0] * N_KEYS

    @rule(k=key_ix, t=tag_ixs, upsert=st.booleans(), send_empty=st.booleans())
    def write_one(self, k: int, t: list[int], upsert: bool, send_empty: bool) -> None:
        """put / upsert of one key; untagged as no config or as kv_sessions=[[]]."""
        tl = [self.sids[i] for i in t]
        self._write_step([self.keys[k]], [tl], upsert, batch=False, send_empty=send_empty)

    @rule(k=key_ix, s=sid_ix)
    def write_and_pin(self, k: int, s: int) -> None:
        """The common pattern: tag a write, then pin its session."""
        self._write_step([self.keys[k]], [[self.sids[s]]], False, batch=False)
        self.pin(s)

    @rule(data=st.data(), upsert=st.booleans(), send_empty=st.booleans())
    def write_batch(self, data: st.DataObject, upsert: bool, send_empty: bool) -> None:
        ks = data.draw(st.lists(key_ix, min_size=1, max_size=4, unique=True))
        tls = [[self.sids[i] for i in data.draw(tag_ixs)] for _ in ks]
        self._write_step([self.keys[k] for k in ks], tls, upsert, batch=True,
                         send_empty=send_empty)

    @rule(n=st.integers(1, 6))
    def fill(self, n: int) -> None:
        """Untagged filler objects: pressure that forces eviction."""
        pinned_members = self._pinned_members()
        for _ in range(n):
            name = f"{self.ns}f{len(self.fillers)}"
            try:
                self.c.put(name, VALUE)
            except NoAvailableHandle:
                self._follow_evictions(pinned_members, may_evict=True)
                self._check_full_of_pinned(shard(name))
                continue
            self.fillers.append(name)
        self._follow_evictions(pinned_members, may_evict=True)

    @rule(s=sid_ix, ks=st.lists(key_ix, max_size=4))
    def attach(self, s: int, ks: list[int]) -> None:
        sid = self.sids[s]
        keys = [self.keys[k] for k in ks]
        got = self.c.attach_kv_session(sid, keys)
        assert got == [0 if k in self.exists else Status.OBJECT_NOT_FOUND for k in keys]
        for k in keys:
            if k in self.exists:
                self._add(sid, k)

    @rule(s=sid_ix)
    def pin(self, s: int) -> None:
        sid = self.sids[s]
        if sid in self.sessions:
            event("pin")
            self.c.pin_kv_session(sid)
            self.pinned.add(sid)
        else:
            with pytest.raises(SessionNotFound):
                self.c.pin_kv_session(sid)

    @rule(s=sid_ix)
    def unpin(self, s: int) -> None:
        sid = self.sids[s]
        if sid in self.sessions:
            self.c.unpin_kv_session(sid)
            self.pinned.discard(sid)
        else:
            with pytest.raises(SessionNotFound):
                self.c.unpin_kv_session(sid)

    @rule(s=sid_ix, keep=st.lists(key_ix, max_size=N_KEYS))
    def update(self, s: int, keep: list[int]) -> None:
        sid = self.sids[s]
        keep_keys = [self.keys[k] for k in keep]
        mem = self.sessions.get(sid, set())
        drop = mem - set(keep_keys)
        assert self.c.update_kv_session(sid, keep_keys) == len(drop)
        if sid in self.sessions:
            mem -= drop
            if not mem:
                self._delete(sid)

    @rule(s=sid_ix)
    def close(self, s: int) -> None:
        sid = self.sids[s]
        self.c.close_kv_session(sid)
        if sid in self.sessions:
            self._delete(sid)

    @rule(k=key_ix)
    def remove(self, k: int) -> None:
        key = self.keys[k]
        if key in self.exists:
            self.c.remove(key, force=True)
            self.exists.discard(key)
            self._drop_key(key)
        else:
            with pytest.raises(ObjectNotFound):
                self.c.remove(key, force=True)

    @precondition(lambda self: bool(self.fillers))
    @rule()
    def drop_fillers(self) -> None:
        self.c.batch_remove(self.fillers, force=True)
        self.fillers = []

    # ------------------------------------------------------------- invariants

    @invariant()
    def matches_master(self) -> None:
        c = self.c
        self._follow_evictions(set(), may_evict=False)
        for sid in self.sids:
            mem = self.sessions.get(sid)
            if mem is None:
                with pytest.raises(SessionNotFound):
                    c.get_kv_session(sid)
                continue
            assert mem, "the model keeps no empty session"
            assert mem <= self.exists, "every member exists"
            got = c.get_kv_session(sid)
            assert (got.member_count, got.pinned) == (len(mem), sid in self.pinned), sid
            assert list(c.iter_kv_session_keys(sid, 3)) == sorted(mem)
        assert c.check_consistency() == []

    def teardown(self) -> None:
        c = self.c
        for sid in self.sids:
            c.close_kv_session(sid)
        c.remove_all(force=True)
        s = c.stats()
        assert (s["sessions"], s["pinned_sessions"], s["keys"]) == (0, 0, 0)
        assert c.check_consistency() == []


def test_session_semantics_match_the_model(start_master, make_client) -> None:
    m = start_master(*MASTER_FLAGS)
    c = make_client(m, segment_bytes=SHARDS * SLOTS_PER_SHARD * SLOT)
    assert c.stats()["capacity_bytes"] == SHARDS * SLOTS_PER_SHARD * SLOT
    SessionMachine.client = c
    SEEN.clear()
    run_state_machine_as_test(
        SessionMachine,
        settings=settings(max_examples=100, stateful_step_count=40, deadline=None,
                          derandomize=True, database=None, print_blob=False,
                          phases=_PHASES, report_multiple_bugs=False,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.filter_too_much]),
    )
    print(dict(SEEN))
    # "write evicted the old version of a key it rewrote" is reported but not required:
    # whether a rewrite meets its own old version at the LRU head depends on read-lease
    # timing, which the derandomized examples do not control.
    for what in ("pool keys evicted", "write refused: shard full of pinned objects",
                 "session re-created after vanishing", "pin"):
        assert SEEN[what] > 0, f"the run never reached: {what}"
