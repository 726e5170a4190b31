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
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["WALK_BURST", "WALK_RATE", "ClientCounts", "TokenBuckets"]

#: Mounts and unmounts one tenant may send per second, and in one burst.
WALK_RATE = 20.0
WALK_BURST = 64
#: Tenants whose buckets are kept (the least recently used forgotten past it: a full
#: bucket again, which only a tenant unheard of for a while gets).
MAX_BUCKETS = 4096


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
