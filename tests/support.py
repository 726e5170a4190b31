"""Helpers the test files share (fixtures stay in conftest.py)."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any


def wait_until(pred: Callable[[], object], timeout: float, what: str,
               step: float = 0.02) -> float:
    """Poll ``pred`` every ``step`` s until it is true; returns the seconds it took.
    Fails (AssertionError naming ``what``) after ``timeout`` s."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)
    return time.monotonic() - t0


def _caller() -> str:
    """``file:line`` of the nearest frame outside zmq and this module."""
    f = sys._getframe(2)
    while f is not None and ("/zmq/" in f.f_code.co_filename
                             or f.f_code.co_filename == __file__):
        f = f.f_back
    return "?" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


class ZmqLeaks:
    """What the tests' own process does with zmq: every context it creates, and every
    context or socket dropped (garbage-collected) without being closed.

    ``install()`` wraps ``zmq.Context.__init__``/``__del__`` and ``zmq.Socket.__init__``/
    ``__del__`` once per process (shadows, which own nothing, are left out).  The
    ``no_leaked_zmq`` fixture reads it around each test: a context made during a test
    and still open after it, or anything dropped unclosed, fails that test."""

    def __init__(self) -> None:
        self.contexts: weakref.WeakSet[Any] = weakref.WeakSet()
        self.made_at: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.made = 0  # contexts and sockets created so far
        self.dropped: list[str] = []

    def install(self) -> None:
        from zmq.sugar import context, socket

        watcher = getattr(context.Context, "_leaks_watcher", None)
        if watcher is self:
            return  # (conftest.py imported a second time, as tests.conftest)
        if watcher is not None:
            raise RuntimeError("zmq is already watched in this process (use support.ZMQ)")
        context.Context._leaks_watcher = self

        def wrap_init(cls: Any, is_context: bool) -> None:
            init = cls.__init__

            def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
                init(obj, *args, **kwargs)
                self.made += 1
                if is_context and not obj._shadow:
                    self.contexts.add(obj)
                    self.made_at[obj] = _caller()
            cls.__init__ = __init__

        def wrap_del(cls: Any, what: str) -> None:
            delete = cls.__del__

            def __del__(obj: Any) -> None:  # noqa: N807
                if not getattr(obj, "_shadow", True) and not obj.closed \
                        and not context._exiting:
                    self.dropped.append(f"{what} dropped unclosed: {obj!r}")
                delete(obj)
            cls.__del__ = __del__

        wrap_init(context.Context, True)
        wrap_init(socket.Socket, False)
        wrap_del(context.Context, "context")
        wrap_del(socket.Socket, "socket")

    @contextlib.contextmanager
    def watch(self, grace_s: float = 2.0) -> Iterator[None]:
        """Raises AssertionError, after the block, if a context made in it is still open
        ``grace_s`` later (closes in progress on other threads get that long), or if
        anything was dropped unclosed meanwhile.  Contexts open before the block (a
        module's fixtures) are not its own; a leaked context is destroyed."""
        exempt = {id(c) for c in self.open_contexts(set())}
        made = self.made
        del self.dropped[:]
        yield
        if self.made == made and not self.dropped:
            return  # the block made no context or socket
        if self.open_contexts(exempt):
            # Only now a full collection (over 0.1 s once torch is loaded, so not after
            # every test): a context held only by garbage cycles goes, and is reported
            # as dropped unclosed; one closing on another thread gets ``grace_s``.
            gc.collect()
            deadline = time.monotonic() + grace_s
            while self.open_contexts(exempt) and time.monotonic() < deadline:
                time.sleep(0.02)
        left = self.open_contexts(exempt)
        problems = [f"context left open, made at {self.made_at.get(c, '?')} "
                    f"({len(c._sockets)} sockets)" for c in left]
        for ctx in left:
            ctx.destroy(linger=0)
        problems += self.dropped
        del self.dropped[:]
        assert not problems, "leaked zmq resources: " + "; ".join(problems)

    def open_contexts(self, exempt: set[int]) -> list[Any]:
        """Contexts not closed, other than those whose id is in ``exempt`` and zmq's
        own process-wide ones (``Context.instance()``, the zero-copy garbage
        collector's)."""
        import zmq
        from zmq.utils import garbage

        own = {id(zmq.Context._instance), id(garbage.gc._context)}
        return [c for c in list(self.contexts)
                if not c.closed and id(c) not in exempt and id(c) not in own]


#: The one watcher of this process (installed by conftest.py).
ZMQ = ZmqLeaks()
