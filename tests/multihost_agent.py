"""A client process for the multi-host test, run inside a network namespace.

It reads one JSON command per line on stdin and answers one JSON line on
stdout, so the test (in the root namespace) drives a real :class:`Client`
on "another host" step by step, with a bounded wait on every answer.

Values are never shipped over the pipe: every value is :func:`payload` of its
key and size, which both sides compute, and readers report whether the bytes
they got are exactly that.

Commands (``{"cmd": ..., ...}``):

``setup``      master, host, transfer_host, segment, timeout_s -> segment name, endpoint
``info``       segment name, transfer requests served, segments this process mapped,
               whether the client holds a WELCOME and whether it is inside a handshake
``put``        items [[key, size], ...] -> one outcome per item
``get``        items [[key, size], ...] -> one outcome per item ("ok", "mismatch", error)
``stats``      the master's stats (keys, segments, clients) and how long the call took
``segments``   LIST_SEGMENTS
``loop_start`` gets (and, every ``put_every`` gets, a put of a fresh key) in a thread
``progress``   counts of the running loop (never touches the client)
``loop_stop``  stop the loop, join it (bounded) and return every recorded call
``close``      close the client and exit
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import traceback
from typing import Any

from kvmaster import Client, ClientConfig, KVMasterError

_cache: dict[tuple[str, int], bytes] = {}
_CACHE_BYTES = 32 << 20


def payload(key: str, size: int) -> bytes:
    """The value stored under ``key``: deterministic bytes of ``size`` (same in every process)."""
    k = (key, size)
    data = _cache.get(k)
    if data is None:
        data = random.Random(f"{key}/{size}").randbytes(size)
        if sum(map(len, _cache.values())) + size <= _CACHE_BYTES:
            _cache[k] = data
    return data


def outcome(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "kvmaster": isinstance(exc, KVMasterError),
            "code": getattr(exc, "code", None), "message": str(exc)[:300]}


def mapped_segment_files() -> list[str]:
    """Segment files this process maps or holds open (a peer's segment is read through
    a descriptor, not mapped)."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/kvmaster-" in line:
                out.add(line.split(None, 5)[-1].strip().removesuffix(" (deleted)"))
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/kvmaster-"):
            out.add(target.removesuffix(" (deleted)"))
    return sorted(out)


class Agent:
    def __init__(self) -> None:
        self.client: Client | None = None
        self.loop_thread: threading.Thread | None = None
        self.loop_stop = threading.Event()
        self.events: list[dict[str, Any]] = []
        self.counts: dict[str, int] = {}
        self.handshaking = False

    # ------------------------------------------------------------ commands

    def setup(self, master: str, host: str, transfer_host: str, segment: int,
              timeout_s: float) -> dict[str, Any]:
        c = Client(ClientConfig(local_hostname=host, transfer_host=transfer_host,
                                timeout_s=timeout_s, connect_timeout_s=timeout_s))
        c.setup(master, segment)
        # Observe (only) when the client is inside a handshake: the test brings a cut
        # link back at a chosen moment of the client's reconnect cycle.
        connect_once = c._connect_once

        def traced(*args: Any, **kwargs: Any) -> None:
            self.handshaking = True
            try:
                connect_once(*args, **kwargs)
            finally:
                self.handshaking = False

        c._connect_once = traced  # type: ignore[method-assign]
        self.client = c
        return {"segment": c.segment_name,
                "endpoint": c._service.endpoint if c._service is not None else ""}

    def info(self) -> dict[str, Any]:
        c = self._c()
        return {"segment": c.segment_name,
                "served": c._service.served if c._service is not None else 0,
                "mapped": sorted(c._mapped), "maps": mapped_segment_files(),
                "peers": sorted(c._peers), "reconnects": c.reconnect_count,
                "welcomed": c.welcome is not None, "handshaking": self.handshaking}

    def put(self, items: list[list[Any]]) -> list[Any]:
        c = self._c()
        out: list[Any] = []
        for key, size in items:
            t0 = time.monotonic()
            try:
                c.put(key, payload(key, size))
                out.append({"ok": True, "s": time.monotonic() - t0})
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out.append({**outcome(exc), "s": time.monotonic() - t0})
        return out

    def get(self, items: list[list[Any]]) -> list[Any]:
        c = self._c()
        out: list[Any] = []
        for key, size in items:
            t0 = time.monotonic()
            try:
                data = c.get(key)
                out.append({"ok": data == payload(key, size), "len": len(data),
                            "s": time.monotonic() - t0})
            except Exception as exc:  # noqa: BLE001
                out.append({**outcome(exc), "s": time.monotonic() - t0})
        return out

    def stats(self) -> dict[str, Any]:
        t0 = time.monotonic()
        s = self._c().stats()
        return {"keys": s["keys"], "segments": s["segments"], "clients": s["clients"],
                "s": time.monotonic() - t0}

    def segments(self) -> list[Any]:
        return self._c().list_segments()

    def loop_start(self, items: list[list[Any]], put_every: int, put_size: int,
                   put_prefix: str) -> dict[str, Any]:
        assert self.loop_thread is None
        self.loop_stop.clear()
        self.events = []
        self.counts = {}
        self.loop_thread = threading.Thread(target=self._loop, daemon=True,
                                            args=(items, put_every, put_size, put_prefix))
        self.loop_thread.start()
        return {"started": True}

    def progress(self) -> dict[str, int]:
        return dict(self.counts)

    def loop_stop_(self, join_s: float) -> dict[str, Any]:
        self.loop_stop.set()
        t = self.loop_thread
        if t is not None:
            t.join(join_s)
            if t.is_alive():
                return {"stopped": False, "events": self.events[-20:]}
        self.loop_thread = None
        return {"stopped": True, "events": self.events}

    # ----------------------------------------------------------- the loop

    def _record(self, ev: dict[str, Any]) -> None:
        """Keep the event and count it as ``<op>_ok``, ``<op>_fail`` or ``<op>_wrong``."""
        self.events.append(ev)
        kind = "fail" if "error" in ev else "ok" if ev["ok"] is True else "wrong"
        name = f"{ev['op']}_{kind}"
        self.counts[name] = self.counts.get(name, 0) + 1

    def _loop(self, items: list[list[Any]], put_every: int, put_size: int,
              put_prefix: str) -> None:
        c = self._c()
        n = 0
        while not self.loop_stop.is_set():
            key, size = items[n % len(items)]
            n += 1
            t0 = time.monotonic()
            try:
                data = c.get(key)
                ev: dict[str, Any] = {"op": "get", "key": key, "ok": data == payload(key, size)}
            except Exception as exc:  # noqa: BLE001
                ev = {"op": "get", "key": key, **outcome(exc)}
            ev.update(t0=t0, t1=time.monotonic())
            self._record(ev)
            if "error" in ev:
                self._after_failure()
            if put_every and n % put_every == 0:
                pkey = f"{put_prefix}{n}"
                t0 = time.monotonic()
                try:
                    c.put(pkey, payload(pkey, put_size))
                    ev = {"op": "put", "key": pkey, "size": put_size, "ok": True}
                except Exception as exc:  # noqa: BLE001
                    ev = {"op": "put", "key": pkey, "size": put_size, **outcome(exc)}
                ev.update(t0=t0, t1=time.monotonic())
                self._record(ev)
                if "error" in ev:
                    self._after_failure()

    def _after_failure(self) -> None:
        """The master must still answer at once after a failed transfer."""
        t0 = time.monotonic()
        try:
            self._c().stats()
            ev: dict[str, Any] = {"op": "stats", "ok": True}
        except Exception as exc:  # noqa: BLE001
            ev = {"op": "stats", **outcome(exc)}
        ev.update(t0=t0, t1=time.monotonic())
        self.events.append(ev)

    def _c(self) -> Client:
        if self.client is None:
            raise RuntimeError("setup first")
        return self.client


def main() -> None:
    agent = Agent()
    handlers = {"setup": agent.setup, "info": agent.info, "put": agent.put, "get": agent.get,
                "stats": agent.stats, "segments": agent.segments,
                "loop_start": agent.loop_start, "progress": agent.progress,
                "loop_stop": agent.loop_stop_}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "close":
            agent.loop_stop.set()
            if agent.loop_thread is not None:
                agent.loop_thread.join(10)
            if agent.client is not None:
                agent.client.close()
            print(json.dumps({"result": "closed"}), flush=True)
            return
        try:
            reply: dict[str, Any] = {"result": handlers[cmd](**msg)}
        except Exception as exc:  # noqa: BLE001 - the test decides
            reply = {"exception": outcome(exc), "traceback": traceback.format_exc()[-3000:]}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
