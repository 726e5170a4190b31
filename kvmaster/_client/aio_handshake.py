"""The async client's handshake steps around :meth:`kvmaster.aio.AsyncClient._connect_once`
(:class:`AsyncHandshake`): connecting (with the HA leader search of
:class:`~kvmaster._client.policy.HelloPlan`), mounting and re-mounting the segment
(:func:`~kvmaster._client.policy.remount_pause`), and the one re-handshake that
every task needing one at the same time shares."""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import TYPE_CHECKING, Any

from kvmaster import errors as E
from kvmaster import protocol as P
from kvmaster._client.aio_tasks import retrieve
from kvmaster._client.policy import CLOCK, HelloPlan, remount_pause
from kvmaster._client.records import rehandshake_reason
from kvmaster.protocol import Op

if TYPE_CHECKING:
    from kvmaster.aio import AsyncClient

log = logging.getLogger("kvmaster.aio")


class AsyncHandshake:
    """Connect, mount, re-mount and re-handshake for one
    :class:`~kvmaster.aio.AsyncClient`, through its ``_connect_once``, ``_exchange``
    and ``_rehandshake``."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        #: Held by the re-handshake in progress (made by ``setup``, in the loop).
        self.lock: asyncio.Lock | None = None
        #: The re-handshake in progress, which every call that needs one waits for.
        self.task: asyncio.Future[Any] | None = None

    async def connect(self) -> None:
        """New DEALER socket and HELLO (to the current leader with ``etcd://``, retrying
        while an election settles) within ``connect_timeout_s``."""
        c = self.client
        if not c.ha:
            await c._connect_once()
            return
        plan = HelloPlan(c)
        while True:
            try:
                await c._connect_once(plan.attempt(0.001))  # (none past the end)
                return
            except HelloPlan.RETRY as exc:
                await asyncio.sleep(plan.pause(exc))

    async def mount(self) -> None:
        c = self.client
        seg = c._own_segment()
        if seg is not None:
            await c._exchange([(Op.MOUNT_SEGMENT.value, P.MASTER_ROUTE, c._mount_fields(seg))])
            if c._segment_label:  # (label_segment's, for this new mount)
                try:
                    await c._exchange(c._label_requests(seg.name, c._segment_label))
                except E.KVMasterError as exc:
                    log.warning("segment %s not labelled %r again: %s", seg.name,
                                c._segment_label, exc)

    async def remount(self) -> None:
        """Mount the segment again after a re-handshake; refusals are retried, then the
        segment is replaced by a fresh one (see :meth:`Handshake.remount`)."""
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.mount()
                return
            except E.KVMasterError as exc:
                pause = remount_pause(self.client, exc, attempt)
                if pause is None:
                    raise
                if not pause:
                    break
            await asyncio.sleep(pause)
        self.client._fresh_segment()
        await self.mount()

    async def rehandshake(self, why: BaseException | None = None) -> None:
        """HELLO again, remount, hook (``why``: the error that calls for it)."""
        c = self.client
        assert self.lock is not None
        async with self.lock:
            log.warning("re-handshaking with master %s as client %s: %s", c.endpoint,
                        c.client_id, rehandshake_reason(why))
            await self.connect()
            # No WELCOME until the segment is mounted again: calls starting meanwhile
            # wait for this re-handshake (a put would otherwise find no space on a
            # master that knows no segment yet).  The hook's calls run after it.
            welcome, c.welcome = c.welcome, None
            try:
                await self.remount()
            except (E.TransportError, E.Busy):
                # Unconnected, as in the sync client: the next call or heartbeat does it
                # all again (registered but not mounted, the segment would stay unused).
                raise
            except BaseException:
                c.welcome = welcome  # cancelled (close): registered, so BYE goes out
                raise
            c.welcome = welcome
            c.reconnect_count += 1
            hook = c.on_reconnect
            if hook is not None:
                try:
                    result = hook(c)
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    log.exception("on_reconnect hook failed")

    def shared(self, why: BaseException | None = None) -> asyncio.Future[Any]:
        """The re-handshake in progress, or a new one (``why``: the error that calls
        for it, for the log): calls and the heartbeat that need one at the same time
        share it."""
        task = self.task
        if task is None or task.done():
            task = self.task = asyncio.ensure_future(self.client._rehandshake(why))
            task.add_done_callback(retrieve)
        return task

    def since(self, generation: int, why: BaseException | None = None
              ) -> asyncio.Future[Any] | None:
        """The re-handshake a request sent on connection ``generation`` (the
        ``_generation`` when it was sent) needs after it failed: the one in
        progress; none (None) when one has completed since (each re-handshake replaces
        the socket and fails every request in flight on it, so a task must not start
        another for a failure the last one caused or already repaired); else a new
        one."""
        task = self.task
        if task is not None and not task.done():
            return task
        c = self.client
        if c._generation != generation and c.welcome is not None:
            return None
        return c._rehandshake_shared(why)

    async def reconnected_since(self, generation: int, deadline: float,
                                why: BaseException | None = None) -> None:
        """Return once the client has a connection newer than ``generation`` with a
        WELCOME, waiting for (or starting: see :meth:`since`) the re-handshake until
        ``deadline``; past it raise Timeout (the re-handshake goes on); a failed
        re-handshake raises its error."""
        while True:
            task = self.since(generation, why)
            if task is None:
                return
            await self.wait(deadline, task)
            if self.client.welcome is not None:
                return
            # Another re-handshake began as soon as this one ended: wait for it too.

    async def wait(self, deadline: float, task: asyncio.Future[Any] | None = None) -> None:
        """Wait for a re-handshake (``task``, else the one in progress or a new one)
        until ``deadline``; past it raise Timeout, and the re-handshake goes on.  When
        ``close`` cancels the re-handshake, the waiting calls raise ConnectionLost
        (their own tasks were not cancelled)."""
        c = self.client
        if task is None:
            task = c._rehandshake_shared()
        left = deadline - CLOCK.now()
        if left > 0:
            # (asyncio.wait neither cancels the shared task nor passes its cancellation
            # on: only this call's own cancellation raises CancelledError here.)
            await asyncio.wait((task,), timeout=left)
        if not task.done():
            raise E.Timeout("the call's timeout passed during a re-handshake (it goes on)",
                            op="HELLO", endpoint=c.endpoint)
        if task.cancelled():
            raise E.ConnectionLost("client closed during a re-handshake", op="HELLO",
                                   endpoint=c.endpoint)
        task.result()  # its error, if it failed
