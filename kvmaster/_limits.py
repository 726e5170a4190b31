"""The front's per-tenant and per-key limits: registrations counted by tenant and by
CURVE key, and rate limits on the requests that walk a whole shard.

* ``--tenant-max-clients`` and ``--max-clients-per-key``: a HELLO that would register
  one client more than either allows is refused ``TENANT_QUOTA_EXCEEDED`` (-1700), so
  one tenant or one key cannot take every ``--max-clients`` slot.
* MOUNT_SEGMENT and UNMOUNT_SEGMENT of a tenant (each makes every shard take or drop a
  share, and an unmount of a segment holding objects walks every shard's objects) pass a
  token bucket of :data:`WALK_RATE` per second with bursts of :data:`WALK_BURST`; past it
  they are answered ``BUSY`` and the client retries.  The admin tenant is not limited.
* CHECK_CONSISTENCY (a walk of every object of every shard) is the admin tenant's alone
  (others get ``ILLEGAL_CLIENT``), one at a time (``BUSY`` while one runs).
* ``--tenant-max-requests-per-s``: every request of a tenant other than the admin one
  passes that tenant's token bucket (:class:`RequestShaper`).  A message past it is not
  refused but *parked*, in arrival order, and dispatched when the bucket refills, so a
  tenant that pipelines requests as fast as the master answers them waits for its own
  replies and leaves the master's time to the others; a refusal would cost the master
  nearly what an answer does, and a client resending BUSY at once would make it so.
  At most :data:`PARKED_MESSAGES` messages and :data:`PARKED_BYTES` bytes are parked per
  tenant, and :data:`PARKED_TOTAL_MESSAGES` / :data:`PARKED_TOTAL_BYTES` over all
  tenants; past any of them, a new message is dropped unanswered (counted as
  ``rate_dropped``; its calls time out), as a reply past a peer's queue is: only a peer
  with thousands of requests in flight meets it, and an answer per message would let a
  peer that never reads keep the master busy refusing.  A message parked longer than
  :data:`PARKED_MAX_AGE_S` is dropped unanswered too (``rate_expired``): its caller has
  given up on it.  When the master stops (or loses its lease) every parked message is
  dispatched at once, and so answered ``SHUTTING_DOWN`` (PROTOCOL.md §10), as far as
  the peer's reply queue takes them (past it, like any reply past a full queue,
  dropped: the caller's deadline ends the call).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from enum import Enum
from typing import Any

__all__ = ["PARKED_BYTES", "PARKED_MAX_AGE_S", "PARKED_MESSAGES", "PARKED_TOTAL_BYTES",
           "PARKED_TOTAL_MESSAGES", "WALK_BURST", "WALK_RATE", "Admission",
           "ClientCounts", "RequestShaper", "TokenBuckets"]

#: Mounts and unmounts one tenant may send per second, and in one burst.
WALK_RATE = 20.0
WALK_BURST = 64
#: Tenants whose buckets are kept (the least recently used forgotten past it: a full
#: bucket again, which only a tenant unheard of for a while gets).
MAX_BUCKETS = 4096
#: Messages, and bytes of their frames, one tenant may have parked by its request rate.
PARKED_MESSAGES = 4096
PARKED_BYTES = 64 << 20
#: The same over all tenants (so many tenants' parkings cannot add up without bound).
PARKED_TOTAL_MESSAGES = 65536
PARKED_TOTAL_BYTES = 256 << 20
#: Seconds a message may stay parked before it is dropped (longer than any client's
#: deadline: kvmaster's default is 10 s).
PARKED_MAX_AGE_S = 30.0


class TokenBuckets:
    """One token bucket per name: ``rate`` tokens per second, at most ``burst``."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()

    def take(self, name: str, now: float) -> bool:
        """Take a token of ``name``'s bucket at monotonic time ``now``; False if empty."""
        b = self._buckets.get(name)
        if b is None:
            b = self._buckets[name] = [self.burst, now]
            if len(self._buckets) > MAX_BUCKETS:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(name)
            b[0] = min(self.burst, b[0] + (now - b[1]) * self.rate)
            b[1] = now
        if b[0] < 1.0:
            return False
        b[0] -= 1.0
        return True


class ClientCounts:
    """Registered clients per tenant and per CURVE key (None: no key)."""

    def __init__(self) -> None:
        self.by_tenant: dict[str, int] = {}
        self.by_key: dict[str, int] = {}

    def add(self, tenant: str, key: str | None) -> None:
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
        if key is not None:
            self.by_key[key] = self.by_key.get(key, 0) + 1

    def remove(self, tenant: str, key: str | None) -> None:
        for d, k in ((self.by_tenant, tenant), (self.by_key, key)):
            if k is None:
                continue
            left = d.get(k, 0) - 1
            if left > 0:
                d[k] = left
            else:
                d.pop(k, None)

    def refusal(self, tenant: str, key: str | None, tenant_max: int, key_max: int
                ) -> str | None:
        """Why one more client of ``tenant`` (and ``key``) may not register, or None."""
        if tenant_max and self.by_tenant.get(tenant, 0) >= tenant_max:
            return f"tenant {tenant!r} has {tenant_max} clients (--tenant-max-clients)"
        if key is not None and self.by_key.get(key, 0) >= key_max:
            return f"this key has {key_max} clients (--max-clients-per-key)"
        return None


class Admission(Enum):
    """What :meth:`RequestShaper.admit` decided for one message."""

    NOW = 0  #: dispatch it now
    PARKED = 1  #: kept; :meth:`RequestShaper.due` hands it back when its turn comes
    FULL = 2  #: the tenant's parking is full: drop the message


class RequestShaper:
    """Per-tenant request rate: ``rate`` requests per second with bursts of ``burst``,
    messages past it parked in arrival order (bounded: :data:`PARKED_MESSAGES`,
    :data:`PARKED_BYTES` per tenant, :data:`PARKED_TOTAL_MESSAGES`,
    :data:`PARKED_TOTAL_BYTES` over all; a message parked for ``max_age_s`` is dropped).

    A message of ``n`` requests (protocol 1.2) takes ``n`` tokens; it is admitted once
    the bucket holds them all (or is full, for a message of more than ``burst``), and
    takes all ``n``: a message of more than ``burst`` leaves the bucket in debt, so the
    tenant's next messages wait its share.  A tenant with messages parked has every new
    message parked behind them, so its requests keep their order.  Tenants' buckets
    are kept for the :data:`MAX_BUCKETS` most recently heard (a tenant forgotten comes
    back with a full bucket); a tenant with parked messages is never forgotten.
    """

    def __init__(self, rate: float, burst: int, max_age_s: float = PARKED_MAX_AGE_S
                 ) -> None:
        if rate <= 0 or burst < 1 or max_age_s <= 0:
            raise ValueError(f"rate must be > 0, burst >= 1 and max_age_s > 0, got "
                             f"{rate}, {burst}, {max_age_s}")
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_age_s = float(max_age_s)
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()
        #: tenant -> parked (item, bytes, tokens, parked at); tenants in the order they
        #: were parked
        self._parked: OrderedDict[str, deque[tuple[Any, int, int, float]]] = OrderedDict()
        self._parked_bytes: dict[str, int] = {}
        self.parked_total = 0  #: messages parked now, over all tenants
        self.parked_total_bytes = 0  #: their bytes
        self.parked_count = 0  #: messages ever parked
        self.full_count = 0  #: messages dropped at a full parking
        self.expired_count = 0  #: messages dropped after max_age_s parked

    def _refill(self, tenant: str, now: float) -> list[float]:
        b = self._buckets.get(tenant)
        if b is None:
            b = self._buckets[tenant] = [self.burst, now]
            if len(self._buckets) > MAX_BUCKETS:
                for old in self._buckets:
                    if old != tenant and old not in self._parked:
                        del self._buckets[old]
                        break
        else:
            self._buckets.move_to_end(tenant)
            b[0] = min(self.burst, b[0] + (now - b[1]) * self.rate)
            b[1] = now
        return b

    def admit(self, tenant: str, item: Any, size: int, requests: int, now: float
              ) -> Admission:
        """Decide for one message (``item``, what :meth:`due` hands back; ``size``
        bytes) of ``requests`` requests from ``tenant`` at monotonic time ``now``."""
        need = min(float(requests), self.burst)
        queue = self._parked.get(tenant)
        if queue is None:
            b = self._refill(tenant, now)
            if b[0] >= need:
                b[0] -= requests
                return Admission.NOW
        if ((queue is not None and (len(queue) >= PARKED_MESSAGES
                                    or self._parked_bytes[tenant] + size > PARKED_BYTES))
                or self.parked_total >= PARKED_TOTAL_MESSAGES
                or self.parked_total_bytes + size > PARKED_TOTAL_BYTES):
            self.full_count += 1
            return Admission.FULL
        if queue is None:
            queue = self._parked[tenant] = deque()
            self._parked_bytes[tenant] = 0
        queue.append((item, size, requests, now))
        self._parked_bytes[tenant] += size
        self.parked_total += 1
        self.parked_total_bytes += size
        self.parked_count += 1
        return Admission.PARKED

    def due(self, now: float, limit: int = 64, expired: list[Any] | None = None
            ) -> list[Any]:
        """At most ``limit`` parked messages (their items) whose tokens are in at
        ``now``, taken from the tenants in turn (one message each per round), oldest
        first within a tenant.  (A small ``limit`` keeps a tenant's refilled burst from
        being dispatched at once, ahead of the others' requests read meanwhile.)
        Messages parked for ``max_age_s`` or more are dropped on the way, counted in
        :attr:`expired_count` (their items added to ``expired`` when given)."""
        out: list[Any] = []
        oldest = now - self.max_age_s
        progress = True
        while self._parked and progress and len(out) < limit:
            progress = False
            for tenant in list(self._parked):
                queue = self._parked[tenant]
                while queue and queue[0][3] <= oldest:
                    item = self._take(tenant, queue)
                    self.expired_count += 1
                    if expired is not None:
                        expired.append(item)
                if not queue:
                    self._forget(tenant)
                    continue
                requests = queue[0][2]
                b = self._refill(tenant, now)
                need = min(float(requests), self.burst)
                if b[0] < need:
                    continue
                b[0] -= requests
                out.append(self._take(tenant, queue))
                progress = True
                if not queue:
                    self._forget(tenant)
                if len(out) >= limit:
                    break
        return out

    def drain(self) -> list[Any]:
        """Every parked message (their items), in arrival order within a tenant,
        whatever the rate: for a master that stops, so that each is answered."""
        out: list[Any] = []
        for tenant in list(self._parked):
            queue = self._parked[tenant]
            while queue:
                out.append(self._take(tenant, queue))
            self._forget(tenant)
        return out

    def _take(self, tenant: str, queue: deque[tuple[Any, int, int, float]]) -> Any:
        item, size, _, _ = queue.popleft()
        self._parked_bytes[tenant] -= size
        self.parked_total -= 1
        self.parked_total_bytes -= size
        return item

    def _forget(self, tenant: str) -> None:
        del self._parked[tenant]
        del self._parked_bytes[tenant]

    def next_due(self, now: float) -> float | None:
        """Seconds from ``now`` until a parked message's tokens are in; None if none is
        parked."""
        if not self._parked:
            return None
        wait = None
        for tenant, queue in self._parked.items():
            b = self._buckets[tenant]
            need = min(float(queue[0][2]), self.burst)
            have = min(self.burst, b[0] + (now - b[1]) * self.rate)
            w = max(0.0, min((need - have) / self.rate,
                             queue[0][3] + self.max_age_s - now))
            wait = w if wait is None else min(wait, w)
        return wait
