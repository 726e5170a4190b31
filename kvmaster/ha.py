"""High availability through etcd: leader election and leader discovery.

Several masters run with ``--ha --etcd-endpoints ... --cluster-id C``.  Each
asks etcd for a lease and tries to create the key ``/kvmaster/C/leader``
(holding its client endpoint) under that lease in one transaction; the one
that succeeds leads and keeps the lease alive, the others stand by (they
answer every request with UNAVAILABLE_IN_CURRENT_STATUS and poll the key).
When the leader dies its lease lapses after ``--ha-lease-ttl`` seconds, etcd
deletes the key, and the next standby to win the transaction leads.  A leader
that cannot renew its lease stops serving at once (it may no longer be the
only leader).

Clients given ``etcd://host:port[,host:port...]/C`` as the master address read
the key to find the leader, and read it again whenever they reconnect.

etcd is reached through its JSON gateway (``/v3/...`` over HTTP), with the
standard library only.  Like Mooncake's HA mode
(``mooncake-store/src/ha_helper.cpp``, master view key with a lease), a new
leader starts with empty metadata, unless the masters run with ``--ha-oplog``: then
standbys follow the leader's op log in etcd (kvmaster/_oplog.py), as Mooncake's
``--enable_oplog`` does, and the promoted one serves the old leader's objects.  See
HA.md for what a failover loses.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

__all__ = ["EtcdError", "EtcdGateway", "EtcdRefused", "LeaderElection", "leader_key",
           "parse_etcd_address",
           "resolve_leader"]

log = logging.getLogger(__name__)


class EtcdError(OSError):
    """etcd could not be reached or refused the request."""


class EtcdRefused(EtcdError):
    """etcd answered the request with an HTTP client error (4xx), at every member tried
    (the others unreachable or refusing too): sending it again would not help (a request
    over etcd's size limit, say)."""


def leader_key(cluster_id: str) -> str:
    return f"/kvmaster/{cluster_id}/leader"


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


class EtcdGateway:
    """Minimal client of etcd's v3 JSON gateway: leases, transactions, reads."""

    def __init__(self, endpoints: list[str], timeout_s: float = 2.0,
                 deadline: float | None = None) -> None:
        """``timeout_s``: per HTTP request; ``deadline`` (``time.monotonic()``), if
        given: no request is sent after it, and none waits past it."""
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = [e if "://" in e else f"http://{e}" for e in endpoints]
        self.timeout_s = timeout_s
        self.deadline = deadline

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        last: Exception | None = None
        refused: EtcdRefused | None = None
        for ep in list(self.endpoints):
            timeout = self.timeout_s
            if self.deadline is not None:
                timeout = min(timeout, self.deadline - time.monotonic())
                if timeout <= 0.001:
                    if last is None:
                        raise EtcdError("no time left to ask etcd")
                    break
            req = urllib.request.Request(f"{ep}/v3/{path}", data=data,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    return json.loads(resp.read() or b"{}")
            except urllib.error.HTTPError as exc:
                if 400 <= exc.code < 500:  # (another member may still take it)
                    detail = exc.read(300).decode(errors="replace").strip()
                    refused = EtcdRefused(f"etcd at {ep} refused the request: HTTP {exc.code} "
                                          f"{detail}")
                last = exc
                self.endpoints.append(self.endpoints.pop(0))
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last = exc
                # Try the next endpoint first next time.
                self.endpoints.append(self.endpoints.pop(0))
        if refused is not None:
            raise refused
        raise EtcdError(f"etcd unreachable at {', '.join(self.endpoints)}: {last}")

    def grant(self, ttl_s: int) -> int:
        return int(self._post("lease/grant", {"TTL": ttl_s})["ID"])

    def keepalive(self, lease_id: int) -> int:
        """Renew; returns the remaining TTL (0 or less: the lease is gone)."""
        out = self._post("lease/keepalive", {"ID": lease_id})
        return int(out.get("result", {}).get("TTL", 0))

    def revoke(self, lease_id: int) -> None:
        self._post("lease/revoke", {"ID": lease_id})

    def create(self, key: str, value: str, lease_id: int) -> bool:
        """Put ``key`` under ``lease_id`` only if it does not exist; True if this call
        created it, or an earlier one did (the key is held by this lease: that call's
        answer was lost, say after the request's timeout, and the transaction was
        sent again)."""
        out = self._post("kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE",
                         "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value),
                                         "lease": str(lease_id)}}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        })
        if out.get("succeeded"):
            return True
        for response in out.get("responses") or []:
            kvs = (response.get("response_range") or {}).get("kvs") or []
            if kvs and int(kvs[0].get("lease", 0)) == lease_id:
                return True
        return False

    def get(self, key: str) -> str | None:
        value = self.get_bytes(key)
        return None if value is None else value.decode()

    def get_bytes(self, key: str) -> bytes | None:
        """The value of ``key``, or None if it does not exist."""
        out = self._post("kv/range", {"key": _b64(key)})
        kvs = out.get("kvs") or []
        return _unb64(kvs[0]["value"]) if kvs else None

    def delete_if(self, key: str, value: str, lease_id: int) -> None:
        """Delete ``key`` if it still holds ``value`` under ``lease_id`` (a leader
        stepping down; not a new master at the same address, whose key holds the same
        value under its own lease: the request may be sent again after its answer was
        lost)."""
        self._post("kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "VALUE",
                         "value": _b64(value)},
                        {"key": _b64(key), "result": "EQUAL", "target": "LEASE",
                         "lease": str(lease_id)}],
            "success": [{"request_delete_range": {"key": _b64(key)}}],
        })


def parse_etcd_address(addr: str) -> tuple[list[str], str] | None:
    """``etcd://h1:p1,h2:p2/cluster`` -> (endpoints, cluster id); None if not etcd."""
    if not addr.startswith("etcd://"):
        return None
    rest = addr[len("etcd://"):]
    hosts, _, cluster = rest.partition("/")
    if not hosts or not cluster:
        raise ValueError(f"etcd address must look like etcd://host:port/cluster_id: {addr!r}")
    return [f"http://{h}" for h in hosts.split(",") if h], cluster


def resolve_leader(addr: str, timeout_s: float) -> str:
    """The leader's endpoint for an ``etcd://`` address, waiting up to ``timeout_s``
    while an election is under way.  Raises EtcdError."""
    parsed = parse_etcd_address(addr)
    assert parsed is not None
    endpoints, cluster = parsed
    deadline = time.monotonic() + timeout_s
    gw = EtcdGateway(endpoints, timeout_s=2.0, deadline=deadline)
    while True:
        try:
            leader = gw.get(leader_key(cluster))
        except EtcdError:
            leader = None
            if time.monotonic() >= deadline:
                raise
        if leader:
            return leader
        if time.monotonic() >= deadline:
            raise EtcdError(f"no leader for cluster {cluster!r} within {timeout_s:.3g} s")
        time.sleep(max(0.0, min(0.05, deadline - time.monotonic())))


#: The longest ``LeaderElection.trust_s``, s: a third of the TTL, but no more, so that a
#: clean stop (which waits that long before giving the lease up) stays short.
MAX_TRUST_S = 2.0


class LeaderElection:
    """Campaigns for leadership on a daemon thread.

    ``on_elected()`` runs once when this master becomes leader; ``on_lost()`` when it
    can no longer renew its lease; ``on_renewed()`` (optional) after each renewal.  All
    are called from the election thread (the master hands them to its event loop).
    """

    def __init__(self, endpoints: list[str], cluster_id: str, advertise: str, ttl_s: int,
                 on_elected: Callable[[], None], on_lost: Callable[[], None]) -> None:
        self.gw = EtcdGateway(endpoints, timeout_s=max(0.5, ttl_s / 3))
        self.key = leader_key(cluster_id)
        self.advertise = advertise
        self.ttl_s = ttl_s
        self.on_elected = on_elected
        self.on_lost = on_lost
        self.is_leader = False
        #: ``time.monotonic()`` until which our lease is surely alive in etcd: the send
        #: time of the last grant or renewal that succeeded, plus the TTL, less a
        #: margin.  Past it another master may lead, so the master refuses requests
        #: (a leader paused longer than the TTL, e.g. SIGSTOP or a VM freeze, must not
        #: answer what queued up meanwhile before this thread notices).
        self.valid_until = 0.0
        #: How long after its request a client still trusts a reply that gives out
        #: space or replica locations (WELCOME ``reply_trust_ms``), s: a third of the
        #: TTL, at most MAX_TRUST_S.  The master sends replies only while
        #: ``valid_until`` is at least that far ahead (it holds them meanwhile and asks
        #: for a renewal: :meth:`renew_now`), so such a reply, received within it, comes
        #: from a leader whose lease outlives its receipt (HA.md, "Fencing").
        self.trust_s = min(ttl_s / 3, MAX_TRUST_S)
        #: What ``valid_until`` keeps short of the TTL, s: time for a client to use a
        #: reply it trusted (a copy into the space it gives out) before the lease can
        #: run out.
        self.margin_s = min(0.5, ttl_s / 10)
        self.on_renewed: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvmaster-election")
        self._lease = 0

    def start(self) -> None:
        self._thread.start()

    def renew_now(self) -> None:
        """Renew the lease now rather than at the next interval (thread-safe)."""
        self._wake.set()

    def _run(self) -> None:
        poll = min(0.2, self.ttl_s / 10)
        margin = self.margin_s
        fresh = 0.0  # send time of the last grant or renewal of the lease that succeeded
        while not self._stop.is_set():
            try:
                if not self._lease:
                    sent = time.monotonic()
                    self._lease = self.gw.grant(self.ttl_s)
                    fresh = sent
                if self.gw.create(self.key, self.advertise, self._lease):
                    self.valid_until = fresh + self.ttl_s - margin
                    break
                # Keep our (unused) lease alive so it is ready when the key frees up.
                sent = time.monotonic()
                if self.gw.keepalive(self._lease) <= 0:
                    self._lease = 0
                else:
                    fresh = sent
            except EtcdError as exc:
                log.warning("[ha] etcd: %s", exc)
                if self._lease and time.monotonic() - fresh > self.ttl_s:
                    # Not kept alive for a TTL (etcd was away): the lease has lapsed,
                    # and etcd refuses it (not found) in every request; take a new one.
                    self._lease = 0
            self._stop.wait(poll)
        if self._stop.is_set():
            return
        self.is_leader = True
        log.info("[ha] elected leader key=%s endpoint=%s", self.key, self.advertise)
        self.on_elected()
        # Renewed every sixth of the TTL (or at once when the master asks): the master
        # sends replies only while the lease is surely alive for trust_s more.
        interval = self.ttl_s / 6
        last_ok = time.monotonic()
        while True:
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                sent = time.monotonic()
                if self.gw.keepalive(self._lease) > 0:
                    last_ok = time.monotonic()
                    self.valid_until = sent + self.ttl_s - margin
                    if self.on_renewed is not None:
                        self.on_renewed()
                    continue
                log.error("[ha] lease expired: stepping down")
            except EtcdError as exc:
                if time.monotonic() - last_ok < self.ttl_s - interval:
                    log.warning("[ha] keepalive failed, retrying: %s", exc)
                    continue
                log.error("[ha] cannot renew the lease: stepping down (%s)", exc)
            self.is_leader = False
            self.on_lost()
            return

    def stop(self) -> None:
        """Stop campaigning; a leader gives the key up at once (no TTL wait; the master
        first lets the replies it sent go stale: ``Master._close``)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if self._lease:
            if self.is_leader:
                try:
                    self.gw.delete_if(self.key, self.advertise, self._lease)
                except EtcdError:
                    pass  # the revoke below deletes the key too
            try:
                self.gw.revoke(self._lease)
            except EtcdError:
                pass  # the lease lapses after its TTL
