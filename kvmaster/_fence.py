"""Write fencing on the client: a write's bytes are copied only while the master still
holds the write's space for this client.

The master gives up on a write in three ways (protocol/PROTOCOL.md section 12):
another writer takes its key over after ``--put-start-discard-timeout``, it is dropped
at ``--put-start-release-timeout``, or a segment holding one of its replicas is
unmounted.  In each case its space stays allocated (quarantined) while its writer is
registered, until the writer ends or revokes it.  Only when the writer leaves (BYE) or
is expired (no request for ``--client-ttl``) is the space freed, at once, and then
possibly given to another object.  So a writer must not copy once its registration
may have lapsed.  A :class:`WriteFence` says when that is:

* **liveness**: the master refreshes a client's liveness when it reads one of its
  requests, and expires it only after ``client_ttl`` without one.  A request this
  client sent at ``t`` (its monotonic clock) that was answered with success was read
  after ``t``, so the client cannot be expired before ``t + client_ttl``.  The client
  keeps the send time of the latest request answered with success
  (:attr:`~kvmaster._core.ClientCore._heard`), so a write may be copied until
  ``_heard + client_ttl - margin``.  While a call copies, the client sends nothing
  (the sync client holds its lock, the asyncio client blocks its loop), so that is at
  the latest the send of the write's start plus the TTL.
* **release**: ``put_start_release_timeout_ms`` of the WELCOME after the send of the
  write's start, less the margin: the master drops the write then (its end would
  fail), though it keeps its space while the writer is registered.
* **connection**: a re-handshake since the start (``_generation`` changed) may follow
  an expiry, which dropped the write: nothing more is copied.

The copy loops ask :meth:`WriteFence.limit` once per call and compare the clock with it
before each block they copy: one value, or :data:`FENCE_BLOCK` bytes of a larger one.
Past the limit they stop, revoke what is open and raise ``LeaseExpired`` (-707).  What
is left: a writer stopped (SIGSTOP, a VM pause) in the middle of a block, or between
the check and the block, copies the rest of that block when it resumes, perhaps into
space the master freed at its expiry and gave away: at most one block per copying
thread.  Object checksums detect such a block at read time (RELIABILITY.md, "Write
fencing").
"""

from __future__ import annotations

import time
from typing import Any

from kvmaster import errors as E

_monotonic = time.monotonic
#: The clock the copy loops read before each block (``time.monotonic``; a test may wrap
#: it to stop its process exactly at a block boundary).
clock = time.monotonic

#: Most bytes a copy loop copies between two checks of the fence (a larger value is
#: copied in blocks of this size).
FENCE_BLOCK = 4 << 20
#: Longest margin kept before a fence limit, s (a quarter of the window when that is
#: shorter): room for the block being copied at the limit, a master that stamps
#: liveness at the start of a read batch, and clock rates.
FENCE_MARGIN_S = 0.5


def margin(window_s: float) -> float:
    """The margin before the end of a window of ``window_s`` seconds."""
    return min(FENCE_MARGIN_S, window_s / 4)


class WriteFence:
    """The fence of the writes one call started: ``sent_at`` is the monotonic time
    before their start was sent.  Taken right after the start's answer (so a
    re-handshake during the start's own round is not held against it)."""

    __slots__ = ("_core", "_generation", "_until", "_op")

    def __init__(self, core: Any, sent_at: float, op: str) -> None:
        self._core = core
        self._generation = core._generation
        self._op = op
        w = core.welcome
        release = getattr(w, "release_s", None)
        self._until = float("inf") if release is None else sent_at + release - margin(release)

    def limit(self) -> float:
        """The monotonic time after which no block may be started.  Raises LeaseExpired
        when it has passed already, or the client re-handshook since the start."""
        core = self._core
        w = core.welcome
        if w is None or core._generation != self._generation:
            raise E.LeaseExpired(
                "the client re-registered with the master since this write started (it may "
                "have been expired, and its writes dropped): nothing more was copied, the "
                "write is revoked; write again", op=self._op)
        ttl = w.client_ttl_ms / 1000
        limit = min(self._until, core._heard + ttl - margin(ttl))
        if _monotonic() > limit:
            raise self.expired()
        return limit

    def expired(self) -> E.LeaseExpired:
        """The error of a copy stopped at the limit."""
        if _monotonic() > self._until:
            why = "the master's --put-start-release-timeout for it"
        else:
            why = ("the time the master may have expired this client (--client-ttl since "
                   "its last request answered), freeing the write's space")
        return E.LeaseExpired(f"the write outlived {why}: nothing more was copied, the write "
                              "is revoked; write again", op=self._op)

