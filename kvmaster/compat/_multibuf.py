"""Multi-buffer, ranged and ranged-write-session calls of the facade (Mooncake
``mooncake-integration/store/store_py.cpp``: ``batch_put_from_multi_buffers``,
``batch_get_into_multi_buffers``, ``batch_get_session_start``,
``batch_get_into_multi_buffer_ranges``, ``batch_get_session_end``,
``batch_put_session_start``, ``batch_put_from_multi_buffer_ranges``,
``batch_put_session_end``, ``batch_put_session_revoke``; their behaviour is
``mooncake-store/src/real_client.cpp``'s ``RealClient`` methods of the same names).

Every call takes raw host addresses and sizes in bytes, one list of buffers per key,
and returns one int per key (``batch_get_session_end`` one int).  A key's bytes go
between the segment and its buffers in one copy per buffer (no intermediate bytes
object; the one-call forms ``memmove`` straight between the caller's addresses and
a segment mapped on this host: the native ``batch_put_from_ptrs`` and
``batch_get_into_ptrs``).  Mooncake's binding has no ranged-read snapshot pair
beyond the get session.

Sessions are kept in this object, per key, as Mooncake's ``RealClient`` keeps them:

* a get session (``batch_get_session_start``) holds the read lease the master gave
  its key (``--default-kv-lease-ttl``, 10 s by default): ranged reads use the replica
  found at the start without asking the master again, and answer LEASE_EXPIRED
  (-707) once the lease has ended, dropping the session, as Mooncake does;
* a put session (``batch_put_session_start``) is a write started on the master (its
  space given out, nothing readable) whose bytes ranged writes copy straight into
  the segment (the native client's split put: ``batch_put_start``,
  ``batch_write_ranges``, ``batch_put_end`` / ``batch_put_revoke``); ``_end``
  makes it readable, ``_revoke`` drops it.  A session neither ended nor revoked is
  dropped by the master after its ``--put-start-discard-timeout``.  The revoke is
  sent without waiting for its answer (applied before anything this client sends
  to the same shard afterwards), so it answers 0 per key it had a session for.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

from kvmaster._core import PendingPuts, ReadLeases
from kvmaster.compat._common import (MAX_VIEW, Facade, bad_buffers, code_of, index_lists, log,
                                     view)
from kvmaster.compat._config import ReplicateConfig
from kvmaster.protocol import Status

_INVALID = int(Status.INVALID_PARAMS)
_INT_ONLY = frozenset((int,))
#: Most buffers one call takes, over all its keys (a bound against runaway lists).
MAX_BUFFERS = 1 << 20


def _valid(keys: Any, ptrs: Any, sizes: Any, offsets: Any = None) -> bool:
    """Whether the per-key lists line up (Mooncake's ``BuildNestedSlicesFromBuffers``;
    else every key INVALID_PARAMS): as many pointer, size (and offset) lists as keys,
    each key's of one length, all ints in ``[0, MAX_VIEW]``, no null address with a
    non-zero size, at most MAX_BUFFERS in all."""
    n = len(keys) if isinstance(keys, (list, tuple)) else -1
    if n < 0 or not isinstance(ptrs, Sequence) or not isinstance(sizes, Sequence) \
            or len(ptrs) != n or len(sizes) != n \
            or (offsets is not None and (not isinstance(offsets, Sequence)
                                         or len(offsets) != n)):
        return False
    total = 0
    ints = _INT_ONLY
    for k in range(n):
        lists = (ptrs[k], sizes[k]) if offsets is None else (ptrs[k], sizes[k], offsets[k])
        m = -1
        for seq in lists:
            if not isinstance(seq, Sequence) or isinstance(seq, (str, bytes)) \
                    or (m >= 0 and len(seq) != m):
                return False
            m = len(seq)
            if m and (not set(map(type, seq)) <= ints or min(seq) < 0
                      or max(seq) > MAX_VIEW):
                return False
        if m and min(ptrs[k]) == 0 and any(s and not p for p, s in zip(ptrs[k], sizes[k])):
            return False  # a null address with bytes to copy
        total += m
        if total > MAX_BUFFERS:
            return False
    return True


def _nested(keys: Sequence[str], ptrs: Any, sizes: Any,
            offsets: Any) -> list[list[tuple[int, int, int]]] | None:
    """Per key ``[(ptr, size, offset), ...]``, or None when the lists do not line up."""
    ptrs, sizes, offsets = index_lists(ptrs), index_lists(sizes), index_lists(offsets)
    if not _valid(keys, ptrs, sizes, offsets):
        return None
    return [list(zip(p, s, o)) for p, s, o in zip(ptrs, sizes, offsets)]


def _refuse_not_host(call: str, nested: list[list[tuple[int, int, int]]]) -> set[int]:
    """Positions of a ranged call whose buffers are not host memory (copied with the
    CPU, a device pointer would crash the process): refused with a log line."""
    bad = bad_buffers([[p for p, _, _ in it] for it in nested],
                      [[s for _, s, _ in it] for it in nested])
    if bad:
        log.error("%s: %d keys refused: their buffers are not host memory of this process "
                  "(ranged calls copy with the CPU)", call, len(bad))
    return bad


class MultiBufferOps(Facade):
    """Calls whose keys each have several buffers (or byte ranges of their value)."""

    def _sessions(self) -> tuple[threading.Condition, dict[str, Any], dict[str, Any]]:
        """(lock, put sessions key -> [PendingPuts, position, writes in flight],
        get sessions key -> (ReadLeases, position)) of this store."""
        d = self.__dict__
        state = d.get("_multibuf_sessions")
        if state is None:
            state = d.setdefault("_multibuf_sessions", (threading.Condition(), {}, {}))
        return state

    # ------------------------------------------------------------ one call

    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Write-once put of each key's value, gathered from its buffers in order
        (``all_buffer_ptrs[i]`` addresses, ``all_sizes[i]`` bytes each): 0 per key
        stored (or there already), else a negative code; every key INVALID_PARAMS
        when the lists do not line up.  ``config.group_ids`` / ``session_ids`` are
        accepted (see :class:`ReplicateConfig`)."""
        all_buffer_ptrs, all_sizes = index_lists(all_buffer_ptrs), index_lists(all_sizes)
        if not _valid(keys, all_buffer_ptrs, all_sizes):
            return [_INVALID] * (len(keys) if hasattr(keys, "__len__") else 0)
        if config is not None and config.group_ids is not None \
                and len(config.group_ids) != len(keys):
            return [_INVALID] * len(keys)
        bad = bad_buffers(all_buffer_ptrs, all_sizes)
        if bad:
            return self._with_device(bad, keys, all_buffer_ptrs, all_sizes, config, True)
        try:
            return list(self.client.batch_put_from_ptrs(keys, all_buffer_ptrs, all_sizes,
                                                        config))
        except Exception as exc:  # noqa: BLE001 - Mooncake reports failures as codes
            return [code_of(exc)] * len(keys)

    def batch_get_into_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Read each key's value into its buffers in order (scattered; buffers past
        its end untouched): the value's size in bytes per key, or a negative code
        (OBJECT_NOT_FOUND; INVALID_PARAMS when the buffers together are smaller than
        the value, or the lists do not line up).  ``prefer_alloc_in_same_node`` is
        accepted."""
        all_buffer_ptrs, all_sizes = index_lists(all_buffer_ptrs), index_lists(all_sizes)
        if not _valid(keys, all_buffer_ptrs, all_sizes):
            return [_INVALID] * (len(keys) if hasattr(keys, "__len__") else 0)
        bad = bad_buffers(all_buffer_ptrs, all_sizes)
        if bad:
            return self._with_device(bad, keys, all_buffer_ptrs, all_sizes, None, False)
        try:
            return list(self.client.batch_get_into_ptrs(keys, all_buffer_ptrs, all_sizes))
        except Exception as exc:  # noqa: BLE001
            return [code_of(exc)] * len(keys)

    # ----------------------------------------------------------- get sessions

    def batch_get_session_start(self, keys: list[str]) -> list[int]:
        """Look ``keys`` up once and keep their replicas and read leases for
        :meth:`batch_get_into_multi_buffer_ranges`: 0 per key, else its negative
        code (OBJECT_NOT_FOUND) and no session; ``[]`` for no keys.  A key's earlier
        session is replaced."""
        if not keys:
            return []
        lock, _, gets = self._sessions()
        try:
            leases = self.client.batch_get_leases(keys)
        except Exception as exc:  # noqa: BLE001
            with lock:
                for k in keys:
                    gets.pop(k, None)
            return [code_of(exc)] * len(keys)
        out = []
        with lock:
            for i, k in enumerate(keys):
                st = leases.status[i]
                if st < 0:
                    gets.pop(k, None)
                else:
                    gets[k] = (leases, i)
                out.append(int(st))
        return out

    def batch_get_into_multi_buffer_ranges(self, keys: list[str],
                                           all_buffer_ptrs: list[list[int]],
                                           all_sizes: list[list[int]],
                                           all_src_offsets: list[list[int]]) -> list[int]:
        """Copy byte ranges of session keys' values: buffer ``j`` of key ``i`` gets
        ``all_sizes[i][j]`` bytes from ``all_src_offsets[i][j]``.  Per key the bytes
        copied (the sum of its sizes), or a negative code: INVALID_PARAMS for a key
        with no get session, a range past the value's end, or lists that do not line
        up; LEASE_EXPIRED once the session's lease has ended (the session is
        dropped).  Asks the master nothing."""
        nested = _nested(keys, all_buffer_ptrs, all_sizes, all_src_offsets)
        if nested is None:
            return [_INVALID] * (len(keys) if hasattr(keys, "__len__") else 0)
        lock, _, gets = self._sessions()
        out = [_INVALID] * len(keys)
        bad = _refuse_not_host("batch_get_into_multi_buffer_ranges", nested)
        # One native call per ReadLeases the keys' sessions came from (usually one).
        batches: dict[int, tuple[ReadLeases, list[int], list[int], list[Any]]] = {}
        with lock:
            for i, k in enumerate(keys):
                got = gets.get(k)
                if got is None or i in bad:
                    continue
                leases, pos = got
                b = batches.setdefault(id(leases), (leases, [], [], []))
                b[1].append(i)
                b[2].append(pos)
                b[3].append([(o, view(p, s)) for p, s, o in nested[i]])
        expired = []
        for leases, where, positions, ranges in batches.values():
            try:
                got = self.client.batch_read_ranges(leases, positions, ranges)
            except Exception as exc:  # noqa: BLE001
                got = [code_of(exc)] * len(positions)
            for i, r in zip(where, got):
                out[i] = int(r)
                if r == Status.LEASE_EXPIRED:
                    expired.append(keys[i])
        if expired:
            with lock:
                for k in expired:
                    gets.pop(k, None)
        return out

    def batch_get_session_end(self, keys: list[str]) -> int:
        """Drop the get sessions of ``keys`` (those without one are ignored): 0."""
        lock, _, gets = self._sessions()
        with lock:
            for k in keys:
                gets.pop(k, None)
        return 0

    # ----------------------------------------------------------- put sessions

    def batch_put_session_start(self, keys: list[str], sizes: list[int],
                                config: ReplicateConfig | None = None) -> list[int]:
        """Start writes of ``keys`` (``sizes`` bytes each) whose bytes come from
        :meth:`batch_put_from_multi_buffer_ranges`: 0 per key, else a negative code
        (INVALID_PARAMS for a key that has a put session already, or given twice;
        OBJECT_ALREADY_EXISTS for one stored or being written).  Every key
        INVALID_PARAMS when the lengths differ (``keys``, ``sizes``,
        ``config.group_ids``)."""
        n = len(keys)
        if len(sizes) != n or (config is not None and config.group_ids is not None
                               and len(config.group_ids) != n):
            return [_INVALID] * n
        fixed = index_lists([sizes])  # numpy/torch integers, as pybind11 takes them
        sizes = sizes if fixed is None else fixed[0]
        if not all(type(s) is int and s > 0 for s in sizes):
            return [_INVALID if type(s) is not int or s <= 0 else 0 for s in sizes] \
                if n else []
        lock, puts, _ = self._sessions()
        out = [0] * n
        start: list[int] = []
        seen: set[str] = set()
        with lock:
            for i, k in enumerate(keys):
                if k in puts or k in seen:
                    out[i] = _INVALID
                    continue
                seen.add(k)
                start.append(i)
                puts[k] = None  # reserved while the start is under way
        if not start:
            return out
        sent = config
        if config is not None and config.group_ids is not None and len(start) != n:
            sent = copy.copy(config)  # the group ids of the keys sent, in their order
            sent.group_ids = [config.group_ids[i] for i in start]
        try:
            pending = self.client.batch_put_start([keys[i] for i in start],
                                                  [sizes[i] for i in start], sent)
        except Exception as exc:  # noqa: BLE001
            with lock:
                for i in start:
                    puts.pop(keys[i], None)
            code = code_of(exc)
            for i in start:
                out[i] = code
            return out
        with lock:
            for j, i in enumerate(start):
                st = int(pending.status[j])
                if st < 0:
                    puts.pop(keys[i], None)
                    out[i] = st
                else:
                    puts[keys[i]] = [pending, j, 0]
        return out

    def _take(self, keys: Sequence[str], nested: list[Any] | None = None,
              skip: set[int] | frozenset[int] = frozenset()
              ) -> dict[int, tuple[PendingPuts, list[int], list[int], list[Any]]]:
        """Group keys with a put session by their PendingPuts (lock held):
        id -> (pending, indices in keys, positions in pending, nested[i] each); the
        positions in ``skip`` are left out (refused by the caller)."""
        _, puts, _ = self._sessions()
        batches: dict[int, tuple[PendingPuts, list[int], list[int], list[Any]]] = {}
        for i, k in enumerate(keys):
            s = puts.get(k) if i not in skip else None
            if not s:
                continue
            b = batches.setdefault(id(s[0]), (s[0], [], [], []))
            b[1].append(i)
            b[2].append(s[1])
            b[3].append(nested[i] if nested is not None else None)
        return batches

    def batch_put_from_multi_buffer_ranges(self, keys: list[str],
                                           all_buffer_ptrs: list[list[int]],
                                           all_sizes: list[list[int]],
                                           all_dst_offsets: list[list[int]]) -> list[int]:
        """Copy buffers into put-session keys' values: buffer ``j`` of key ``i``
        (``all_sizes[i][j]`` bytes) goes to byte ``all_dst_offsets[i][j]`` of the
        value.  Per key the bytes copied (the sum of its sizes), or a negative code:
        INVALID_PARAMS for a key with no open put session, a range past the size
        given at the start, or lists that do not line up; TRANSFER_FAIL.  Asks the
        master nothing."""
        nested = _nested(keys, all_buffer_ptrs, all_sizes, all_dst_offsets)
        if nested is None:
            return [_INVALID] * (len(keys) if hasattr(keys, "__len__") else 0)
        lock, puts, _ = self._sessions()
        out = [_INVALID] * len(keys)
        bad = _refuse_not_host("batch_put_from_multi_buffer_ranges", nested)
        with lock:
            batches = self._take(keys, nested, bad)
            for _, where, _, _ in batches.values():
                for i in where:
                    puts[keys[i]][2] += 1  # in flight: end and revoke wait for it
        try:
            for pending, where, positions, items in batches.values():
                ranges = [[(o, view(p, s)) for p, s, o in it] for it in items]
                try:
                    got = self.client.batch_write_ranges(pending, positions, ranges)
                except Exception as exc:  # noqa: BLE001
                    got = [code_of(exc)] * len(positions)
                for i, r in zip(where, got):
                    out[i] = int(r)
        finally:
            with lock:
                for _, where, _, _ in batches.values():
                    for i in where:
                        s = puts.get(keys[i])
                        if s:
                            s[2] -= 1
                lock.notify_all()
        return out

    def _finish(self, keys: list[str], method: str) -> list[int]:
        """End or revoke the put sessions of ``keys`` (after their writes in flight)."""
        lock, puts, _ = self._sessions()
        out = [_INVALID] * len(keys)
        with lock:
            lock.wait_for(lambda: all(not puts.get(k) or puts[k][2] == 0 for k in keys))
            batches = self._take(keys)
            for _, where, _, _ in batches.values():
                for i in where:  # sealed: no more ranged writes
                    puts[keys[i]] = None
        for pending, where, positions, _ in batches.values():
            try:
                got = getattr(self.client, method)(pending, positions)
            except Exception as exc:  # noqa: BLE001
                got = [code_of(exc)] * len(positions)
            with lock:
                for i, pos, r in zip(where, positions, got):
                    out[i] = int(r)
                    if pending.replicas[pos] is not None:  # still open: keep for a retry
                        puts[keys[i]] = [pending, pos, 0]
                    else:
                        puts.pop(keys[i], None)
        return out

    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        """Complete put sessions (their values become readable): 0 per key, else a
        negative code (INVALID_PARAMS for a key with no put session).  Waits for
        ranged writes of the keys still in flight in other threads."""
        return self._finish(keys, "batch_put_end")

    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        """Drop put sessions (nothing is stored): 0 per key, INVALID_PARAMS for a
        key with no put session.  Waits for ranged writes still in flight."""
        return self._finish(keys, "batch_put_revoke")
