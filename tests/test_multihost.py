"""Several hosts for real: the master and two clients each in their own network
namespace, joined by a bridge (see tests/netns.py; the clients are driven through
tests/multihost_agent.py).

Host A contributes a segment and serves it through its transfer service on its
own address; host B contributes none, so every byte B reads or writes crosses
the (virtual) network to A.  Then A's link is cut, twice:

* right after B read from A, so B's connection to A is up, B puts an object: the
  put fails within B's timeout and is revoked.  Once the link is back and that
  space is handed out again, the bytes B's kernel still held for A must not land
  in the new objects;
* while B loops over large gets and puts, and long enough for A's own heartbeat
  and reconnect to fail: B's calls fail within its timeout with a clean kvmaster
  error and never return wrong bytes, the master keeps answering B, and once the
  link is back B reads again at once, A works again and every object is intact.

Needs root (CI runs as root); without it the test fails and says why.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvmaster.protocol import HEARTBEAT_LIVENESS
from netns import (
    NetnsError,
    NsProcess,
    Topology,
    netns_unusable_reason,
    tcp_probe_script,
    tcp_sockets,
)

HOSTS = {"m": 1, "a": 2, "b": 3}  # 10.77.0.<n>: master, host A, host B
TIMEOUT_S = 2.0  # B's timeout_s (master requests and transfers)
A_TIMEOUT_S = 1.0  # A's timeout_s and connect_timeout_s
CLIENT_TTL_S = 16.0  # the master's --client-ttl
# How long A's link stays down in the second cut: an idle client's next heartbeat is due
# CLIENT_TTL_S / HEARTBEAT_LIVENESS after its last request (checked once a second); it
# fails, and so does the handshake tried next (A_TIMEOUT_S each).  The cut ends well
# before the master could expire A (CLIENT_TTL_S).
CUT_S = CLIENT_TTL_S / HEARTBEAT_LIVENESS + 1 + 2 * A_TIMEOUT_S + 1.5
A_RECOVERY_S = 2 * A_TIMEOUT_S + 3  # A is expected to work again within this after the cut
SEGMENT = 64 << 20  # A's segment (16 MiB per shard with the default 4 shards)
SIZES = [4 << 10, 4097, 64 << 10, 1 << 20, (3 << 20) + 1, 4 << 20]
CMD_S = 15.0  # longest wait for one agent command that moves a few objects
LOOP_PUT = 64 << 10  # size of B's puts into A's segment while the link is cut
AGENT = str(Path(__file__).with_name("multihost_agent.py"))


def _fail_unless_netns() -> None:
    reason = netns_unusable_reason()
    if reason is not None:
        pytest.fail(f"the multi-host test runs its hosts in network namespaces and {reason}; "
                    "run it as root with iproute2 installed", pytrace=False)


def _wait_for(what: str, pred: Callable[[], Any], timeout: float, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def _clean_error(ev: dict[str, Any]) -> bool:
    """A kvmaster exception: TRANSFER_FAIL (-800) or a Timeout."""
    return ev.get("kvmaster") is True and (ev.get("code") == -800 or ev.get("error") == "Timeout")


def _served(agent: NsProcess, expected: int) -> int:
    """Wait until the agent's transfer service has served ``expected`` requests (it counts
    a request just after answering it) and check it served no more."""
    _wait_for(f"{expected} transfer requests served",
              lambda: agent.call("info", CMD_S)["served"] >= expected, 5.0)
    served = agent.call("info", CMD_S)["served"]
    assert served == expected, (served, expected)
    return served


def _bad(items: list[list[Any]], results: list[dict[str, Any]]) -> list[Any]:
    return [(it, r) for it, r in zip(items, results) if r.get("ok") is not True]


def test_put_on_one_host_get_on_another_and_link_cut(tmp_path: Path) -> None:
    _fail_unless_netns()
    t_start = time.monotonic()
    topo = Topology(str(os.getpid()), HOSTS)
    procs: dict[str, NsProcess] = {}
    segments: list[str] = []
    problems: list[str] = []  # failures found that do not stop the rest of the test
    try:
        topo.create()
        m_addr, a_addr, b_addr = (topo.addr(h) for h in ("m", "a", "b"))

        master = procs["master"] = NsProcess(
            "master", topo.exec_argv("m", sys.executable, "-m", "kvmaster", "master",
                                     "--host", m_addr, "--port", "0", "--metrics-port", "-1",
                                     "--client-ttl", str(CLIENT_TTL_S)),
            tmp_path / "master.stderr")
        line = master.readline(20)
        assert "listening on" in line, (line, master.stderr_tail())
        endpoint = line.rsplit(" ", 1)[-1].strip()
        assert endpoint.startswith(f"tcp://{m_addr}:"), endpoint
        master_addr = endpoint.removeprefix("tcp://")
        m_port = int(master_addr.rsplit(":", 1)[1])

        # Connectivity: A and B reach the master's port, and every host reaches the
        # others (a connect to a closed port is refused: the host answered).
        for host, targets in (("a", [(m_addr, m_port), (b_addr, 9)]),
                              ("b", [(m_addr, m_port), (a_addr, 9)]),
                              ("m", [(a_addr, 9), (b_addr, 9)])):
            probe = NsProcess(f"probe@{host}",
                              topo.exec_argv(host, sys.executable, "-c",
                                             tcp_probe_script(targets, 3.0)),
                              tmp_path / f"probe-{host}.stderr")
            try:
                result = probe.readline(15).strip()
                probe.wait(10)
            finally:
                probe.terminate(5)
            expected = '["open", "refused"]' if host != "m" else '["refused", "refused"]'
            assert result == expected, f"{host} -> {targets}: {result}"

        for host in ("a", "b"):
            p = procs[host] = NsProcess(f"client@{host}",
                                        topo.exec_argv(host, sys.executable, AGENT),
                                        tmp_path / f"client-{host}.stderr")
            assert '"ready"' in p.readline(20), p.stderr_tail()
        a, b = procs["a"], procs["b"]
        sa = a.call("setup", 20, master=master_addr, host="host-a", transfer_host=a_addr,
                    segment=SEGMENT, timeout_s=A_TIMEOUT_S)
        segments.append(sa["segment"])
        sb = b.call("setup", 20, master=master_addr, host="host-b", transfer_host=b_addr,
                    segment=0, timeout_s=TIMEOUT_S)
        assert sb["segment"] is None
        assert sa["endpoint"].startswith(f"tcp://{a_addr}:"), sa
        listed = {s["name"]: s for s in b.call("segments", CMD_S)}
        assert set(listed) == {sa["segment"]}, listed
        assert listed[sa["segment"]]["host_id"] == "host-a"
        assert listed[sa["segment"]]["transport"] == sa["endpoint"]

        # ---- put on A (into its own segment, through its mapping), get on B
        items = [[f"obj-{i}-{n}", n] for i, n in enumerate(SIZES)]
        assert not _bad(items, a.call("put", CMD_S, items=items))
        served0 = a.call("info", CMD_S)["served"]
        got = b.call("get", CMD_S, items=items)
        assert not _bad(items, got), got
        assert [r["len"] for r in got] == SIZES
        # every byte came through A's transfer service, one request per object after
        # the size check of B's first use ...
        _served(a, served0 + 1 + len(items))
        binfo = b.call("info", CMD_S)
        # ... and B never mapped A's file (the namespaces share /dev/shm: it could have)
        assert binfo["mapped"] == [] and binfo["maps"] == [], binfo
        assert binfo["peers"] == [sa["endpoint"]], binfo

        # ---- B (no segment) writes into A's segment; A reads from its own mapping
        b_items = [[f"from-b-{i}-{n}", n] for i, n in enumerate(SIZES)]
        served1 = a.call("info", CMD_S)["served"]
        assert not _bad(b_items, b.call("put", CMD_S, items=b_items))
        served2 = _served(a, served1 + len(b_items))
        assert not _bad(b_items, a.call("get", CMD_S, items=b_items))
        assert a.call("info", CMD_S)["served"] == served2  # local reads: no transfer
        assert not _bad(b_items, b.call("get", CMD_S, items=b_items))

        # ---- a write B gives up on must not land later.  B's connection to A is up
        # (it just read); with A's link cut, B's put of "lost" goes into that connection,
        # times out, and B revokes it: the master may hand its space out again, while
        # B's kernel still holds the bytes for A (the socket was closed, not the TCP
        # connection).  Bring the link back when no retransmission is about to fire,
        # fill the space at once, then let those bytes arrive: they must not land in
        # the new objects.
        assert not _bad(items[:1], b.call("get", CMD_S, items=items[:1]))
        # A's last request before the cut: its next heartbeat is due after the link is back
        assert not _bad(items[:1], a.call("get", CMD_S, items=items[:1]))
        topo.set_link("a", up=False)
        (lost,) = b.call("put", CMD_S, items=[["lost", LOOP_PUT]])
        assert "error" in lost and lost["s"] <= TIMEOUT_S + 1.0, lost
        if not _clean_error(lost):
            problems.append(f"put through a cut link: not a kvmaster TRANSFER_FAIL (-800) or "
                            f"Timeout but {lost}")

        def quiet() -> bool:
            timers = [s["timer_s"] for s in tcp_sockets(topo, "b", a_addr)
                      if s["timer_s"] is not None]
            return all(t >= 0.5 for t in timers)

        try:
            _wait_for("B's retransmission timers to be quiet", quiet, 3.0, 0.02)
        except AssertionError:
            print("\nno quiet moment to bring the link back")  # the check is then weaker
        topo.set_link("a", up=True)
        refill = [[f"refill-{i}", LOOP_PUT] for i in range(32)]
        assert not _bad(refill, b.call("put", CMD_S, items=refill)), \
            "B cannot write into A's segment after the link is back"
        _wait_for("B's connections to A to deliver what they hold",
                  lambda: not any(s["unacked"] or s["state"] == "FIN_WAIT1"
                                  for s in tcp_sockets(topo, "b", a_addr)),
                  15.0, 0.1)
        late = _bad(refill, b.call("get", CMD_S, items=refill))
        if late:
            problems.append(
                f"{len(late)} of {len(refill)} objects stored after the link came back hold "
                "other bytes: the put B timed out on and revoked during the cut was delivered "
                f"late into space the master had handed out again: {late[:2]}")
        (r,) = b.call("get", CMD_S, items=[["lost", LOOP_PUT]])
        assert "error" in r and r["kvmaster"], r  # OBJECT_NOT_FOUND (or still pending)

        # ---- cut A's link while B loops: a get of a large object, then a put into
        # A's segment, again and again.  The link stays down for CUT_S: long enough for
        # A's heartbeat and its attempt to reconnect to fail too, short of A's expiry.
        big = [it for it in items + b_items if it[1] >= 1 << 20]
        b.call("loop_start", CMD_S, items=big, put_every=1, put_size=LOOP_PUT,
               put_prefix="loop-put-")
        _wait_for("B's loop to get going",
                  lambda: b.call("progress", CMD_S).get("get_ok", 0) >= 4, 20)
        # A's last request before the cut (A_RECOVERY_S covers its return after the first)
        _wait_for("A to talk to the master after the first cut",
                  lambda: a.call("get", CMD_S, items=items[:1])[0].get("ok") is True,
                  A_RECOVERY_S, 0.1)
        t_cut = time.monotonic()
        topo.set_link("a", up=False)
        # A get and a put must fail; each ends within the timeout, so this is bounded.
        _wait_for("a get and a put of B to fail after the cut",
                  lambda: {"get_fail", "put_fail"} <= set(b.call("progress", CMD_S)),
                  4 * TIMEOUT_S + 5)
        time.sleep(max(0.0, t_cut + CUT_S - time.monotonic()))
        stopped = b.call("loop_stop", CMD_S + 10, join_s=2 * TIMEOUT_S + 2)
        assert stopped["stopped"], f"B's loop hangs: {stopped}"
        # The link is still down: the master answers B at once.
        stats = b.call("stats", CMD_S)
        assert stats["s"] < 1.0 and stats["segments"] == 1 and stats["clients"] == 2, stats
        events = stopped["events"]
        calls = [e for e in events if e["op"] in ("get", "put")]
        failed = [e for e in calls if "error" in e]

        wrong = [e for e in calls if "error" not in e and e["ok"] is not True]
        assert not wrong, f"wrong bytes returned: {wrong}"
        assert all(e["t1"] >= t_cut for e in failed), "a call failed before the cut"
        unclean = [e for e in failed if not _clean_error(e)]
        if unclean:
            problems.append("calls during the cut failed with something other than a "
                            f"kvmaster TRANSFER_FAIL (-800) or Timeout: {unclean}")
        slow = [e for e in failed if e["t1"] - e["t0"] > TIMEOUT_S + 1.0]
        assert not slow, f"failed calls took longer than the timeout: {slow}"
        # After every failure the master answered B at once.
        stats_ev = [e for e in events if e["op"] == "stats"]
        assert len(stats_ev) == len(failed), events
        assert all(e.get("ok") is True and e["t1"] - e["t0"] < 1.0 for e in stats_ev), stats_ev
        stored = [[e["key"], e["size"]] for e in calls if e["op"] == "put" and e.get("ok") is True]
        revoked = [[e["key"], e["size"]] for e in failed if e["op"] == "put"]

        # ---- bring the link back.  A has lost its WELCOME meanwhile (its heartbeat
        # failed, then its handshake); do it between two of A's handshakes (its heartbeat
        # thread is waiting, or sending a heartbeat behind the unanswered HELLO), so the
        # queued HELLO is what reaches the master.
        def between_handshakes() -> bool:
            ai = a.call("info", CMD_S)
            return not ai["welcomed"] and not ai["handshaking"]

        try:
            _wait_for("A to be between two handshakes", between_handshakes, 3.0, 0.02)
        except AssertionError:
            print("\nA was not between two handshakes")  # the A check is then weaker
        topo.set_link("a", up=True)
        t_up = time.monotonic()
        _wait_for("B to read again after the link is back",
                  lambda: b.call("get", CMD_S, items=big[:1])[0].get("ok") is True,
                  2 * TIMEOUT_S + 2, 0.05)
        recovered_s = time.monotonic() - t_up

        # ---- everything stored is intact, read from B; what B revoked is gone
        everything = items + b_items + stored + refill
        got = b.call("get", CMD_S, items=everything)
        assert all(r.get("ok") is True or it in refill for it, r in zip(everything, got)), \
            _bad(everything, got)
        for r in b.call("get", CMD_S, items=revoked):
            assert "error" in r and r["kvmaster"], r  # OBJECT_NOT_FOUND (or still pending)
        listed = {s["name"]: s for s in b.call("segments", CMD_S)}
        assert listed[sa["segment"]]["transport"] == sa["endpoint"], listed
        stats = b.call("stats", CMD_S)
        assert stats["segments"] == 1 and stats["clients"] == 2, stats
        assert stats["keys"] == len(everything), stats

        # ---- A itself is back: it talks to the master again and reads its objects
        a_back: float | None = None
        last_a: dict[str, Any] = {}
        deadline = time.monotonic() + A_RECOVERY_S
        while a_back is None and time.monotonic() < deadline:
            last_a = a.call("get", CMD_S, items=items[:1])[0]
            if last_a.get("ok") is True:
                a_back = time.monotonic() - t_up
            else:
                time.sleep(0.1)
        if a_back is None:
            problems.append(
                f"A still cannot use the master {time.monotonic() - t_up:.1f} s after its link "
                f"came back (its heartbeat's reconnect failed during the cut): {last_a}")
        else:
            others = items + b_items + stored
            assert not _bad(others, a.call("get", CMD_S, items=others))

        for name in ("b", "a"):
            assert procs[name].call("close", CMD_S) == "closed"
            assert procs[name].wait(10) == 0, procs[name].stderr_tail()
        assert master.terminate(15) == 0, master.stderr_tail()
        print(f"\nmulti-host: {len(calls)} calls in B's loop, {len(failed)} failed during "
              f"the cut ({t_up - t_cut:.1f} s); after the link came back B read again in "
              f"{recovered_s:.2f} s, A in {a_back and round(a_back, 2)} s; "
              f"{time.monotonic() - t_start:.1f} s in all")
        assert not problems, "\n".join(problems)
    finally:
        for name in ("b", "a", "master"):
            p = procs.get(name)
            if p is not None:
                p.terminate(10)  # no-op for a process that already exited
        for name in segments:  # a killed client leaves its segment file behind
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
        try:
            errors = topo.destroy()
        except NetnsError as exc:
            errors = [str(exc)]
        if errors and sys.exc_info()[0] is None:
            raise AssertionError(f"network namespaces not cleaned up: {errors}")
