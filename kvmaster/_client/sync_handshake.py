"""The sync client's handshake steps around :meth:`kvmaster.Client._connect_once`:
re-handshaking, connecting (with the HA leader search of :class:`~kvmaster._client.policy.HelloPlan`),
mounting the contributed segment, and re-mounting it after a re-handshake
(:func:`~kvmaster._client.policy.remount_pause`) (:class:`Handshake`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.policy import CLOCK, HelloPlan, remount_pause
from kvmaster._client.records import rehandshake_reason
from kvmaster.protocol import Op

if TYPE_CHECKING:
    from kvmaster.client import Client

log = logging.getLogger("kvmaster.client")


class Handshake:
    """Connect, mount and re-mount for one :class:`~kvmaster.Client`, through its
    ``_connect_once`` and ``_exchange`` (with the client's lock held)."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def rehandshake(self, deadline: float | None = None,
                    why: BaseException | None = None) -> None:
        """HELLO again, remount, hook: the master does not know us (restart or expiry),
        or (HA) did not answer, is stopping, or sent a reply too late to trust; ``why``
        is that error (None: an earlier re-handshake did not finish).  Within a call,
        HELLO and mount end by the call's ``deadline``; a mount that fails for want of
        an answer leaves the client unconnected (``welcome`` None), so that the next
        call or the heartbeat thread does it all again."""
        c = self.client
        if deadline is not None and CLOCK.now() >= deadline:
            raise E.Timeout("the call's timeout passed before the client could re-handshake",
                            op="HELLO", endpoint=c.endpoint)
        log.warning("re-handshaking with master %s as client %s: %s", c.endpoint,
                    c.client_id, rehandshake_reason(why))
        self.connect(deadline)
        try:
            self.remount(deadline)
        except (E.TransportError, E.Busy):
            c.welcome = None
            raise
        c.reconnect_count += 1
        hook = c.on_reconnect
        if hook is not None:
            try:
                hook(c)
            except Exception:
                log.exception("on_reconnect hook failed")

    def connect(self, deadline: float | None = None) -> None:
        """New DEALER socket and HELLO (to the current leader with ``etcd://``, retrying
        while an election settles) within ``connect_timeout_s`` and, when given,
        ``deadline`` (``time.monotonic()``); raises on refusal or timeout."""
        c = self.client
        plan = HelloPlan(c, deadline)
        if not c.ha:
            c._connect_once(plan.left())
            return
        while True:
            try:
                c._connect_once(plan.attempt())
                return
            except HelloPlan.RETRY as exc:
                time.sleep(plan.pause(exc))

    def mount(self, deadline: float | None = None) -> None:
        """Mount the contributed segment (none: nothing), labelled again as
        ``label_segment`` last asked."""
        c = self.client
        seg = c._own_segment()
        if seg is not None:
            c._exchange([(Op.MOUNT_SEGMENT.value, P.MASTER_ROUTE, c._mount_fields(seg))],
                        deadline=deadline)
            if c._segment_label:  # (label_segment's, for this new mount)
                try:
                    c._exchange(c._label_requests(seg.name, c._segment_label),
                                deadline=deadline)
                except E.KVMasterError as exc:
                    log.warning("segment %s not labelled %r again: %s", seg.name,
                                c._segment_label, exc)

    def remount(self, deadline: float | None = None) -> None:
        """Mount the segment again after a re-handshake.  A refusal is retried
        MOUNT_ATTEMPTS times with growing pauses (each logged and counted: see
        :meth:`Connection._mount_refused`), then the segment is replaced by a fresh one
        under a new name, mounted once; a refusal of that one is raised (the client
        stays registered, contributing no segment, until its next re-handshake).
        Pauses end by ``deadline``: a refusal that leaves no room for the next attempt
        is raised."""
        attempt = 0
        while True:
            attempt += 1
            try:
                self.mount(deadline)
                return
            except E.KVMasterError as exc:
                pause = remount_pause(self.client, exc, attempt, deadline)
                if pause is None:
                    raise
                if not pause:
                    break
            time.sleep(pause)
        self.client._fresh_segment()
        self.mount(deadline)
