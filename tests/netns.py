"""Test hosts made of network namespaces, and processes run inside them.

:class:`Topology` builds, with ``ip`` from iproute2 (needs root), one switch
namespace holding a bridge and one namespace per host, each host joined to the
bridge by a veth pair and given an address in a private /24.  Nothing is made
in the root namespace and no host has a default route, so no packet of the
test can leave these namespaces.  :meth:`Topology.destroy` deletes every
namespace it made (the veth pairs and the bridge go with them).

:class:`NsProcess` is a subprocess (usually ``ip netns exec <ns> python ...``)
whose stdout lines are read by a thread, so every wait on it has a deadline.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]


class NetnsError(RuntimeError):
    """An ``ip`` command failed, or namespaces cannot be made here."""


def netns_unusable_reason() -> str | None:
    """Why this process cannot make network namespaces, or None if it can."""
    if os.geteuid() != 0:
        return f"needs root to create network namespaces (euid is {os.geteuid()})"
    if shutil.which("ip") is None:
        return "needs `ip` from iproute2 on PATH"
    probe = f"kvm-probe-{os.getpid()}"
    try:
        run_ip("netns", "add", probe)
    except NetnsError as exc:
        return f"`ip netns add` does not work here: {exc}"
    try:
        run_ip("netns", "delete", probe)
    except NetnsError as exc:
        return f"`ip netns delete` does not work here: {exc}"
    return None


def run_ip(*args: str, timeout: float = 10.0) -> str:
    """Run ``ip <args>``; returns stdout, raises NetnsError on failure or timeout."""
    try:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`ip {' '.join(args)}` did not finish within {timeout} s") from None
    if r.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


class Topology:
    """Hosts on one bridge: ``hosts`` maps a short name to its last address byte.

    Host ``h`` lives in namespace ``kvm-<h>-<tag>`` with interface ``eth0`` at
    ``<prefix>.<byte>/24``; the bridge ``br0`` and the other ends of the veth
    pairs (``port-<h>``) live in ``kvm-s-<tag>``.
    """

    def __init__(self, tag: str, hosts: dict[str, int], prefix: str = "10.77.0") -> None:
        self.tag = tag
        self.prefix = prefix
        self.hosts = dict(hosts)
        self.switch = f"kvm-s-{tag}"
        self.made: list[str] = []  # namespaces created, in order

    def ns(self, host: str) -> str:
        return f"kvm-{host}-{self.tag}"

    def addr(self, host: str) -> str:
        return f"{self.prefix}.{self.hosts[host]}"

    def create(self) -> None:
        sw = self.switch
        self._add_ns(sw)
        run_ip("-n", sw, "link", "set", "lo", "up")
        run_ip("-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0",
               "forward_delay", "0")
        run_ip("-n", sw, "link", "set", "br0", "up")
        for host in self.hosts:
            ns = self.ns(host)
            port = f"port-{host}"
            self._add_ns(ns)
            run_ip("-n", ns, "link", "set", "lo", "up")
            # Both ends are born inside namespaces: nothing appears in the root namespace.
            run_ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                   "netns", ns)
            run_ip("-n", sw, "link", "set", port, "master", "br0")
            run_ip("-n", sw, "link", "set", port, "up")
            run_ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            run_ip("-n", ns, "link", "set", "eth0", "up")

    def _add_ns(self, name: str) -> None:
        run_ip("netns", "add", name)
        self.made.append(name)

    def set_link(self, host: str, up: bool) -> None:
        """Bring the host's own interface up or down (its cable, as the host sees it)."""
        run_ip("-n", self.ns(host), "link", "set", "eth0", "up" if up else "down")

    def exec_argv(self, host: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def destroy(self) -> list[str]:
        """Delete every namespace this topology made; returns the errors (empty: all gone)."""
        errors: list[str] = []
        for name in reversed(self.made):
            try:
                run_ip("netns", "delete", name)
            except NetnsError as exc:
                errors.append(str(exc))
        self.made.clear()
        left = set(run_ip("netns", "list").split()) & {self.switch, *map(self.ns, self.hosts)}
        if left:
            errors.append(f"namespaces still present: {sorted(left)}")
        return errors


#: /proc/net/tcp state numbers
TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
              6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
              11: "CLOSING"}


def tcp_sockets(topo: Topology, host: str, remote_ip: str) -> list[dict[str, Any]]:
    """The host's IPv4 TCP sockets to ``remote_ip`` (orphans of closed sockets included):
    state, bytes not yet acknowledged (``unacked``) and, if the retransmission timer
    runs, the seconds until it fires (``timer_s``)."""
    try:
        r = subprocess.run(topo.exec_argv(host, "cat", "/proc/net/tcp"), capture_output=True,
                           text=True, timeout=10)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"reading /proc/net/tcp in {topo.ns(host)} timed out") from None
    if r.returncode != 0:
        raise NetnsError(f"reading /proc/net/tcp in {topo.ns(host)}: {r.stderr.strip()}")
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for line in r.stdout.splitlines()[1:]:
        f = line.split()
        rem_hex = f[2].split(":")[0]
        rem = ".".join(str(b) for b in int(rem_hex, 16).to_bytes(4, sys.byteorder))
        if rem != remote_ip:
            continue
        timer, when = f[5].split(":")
        out.append({"state": TCP_STATES.get(int(f[3], 16), f[3]),
                    "unacked": int(f[4].split(":")[0], 16),
                    "timer_s": int(when, 16) / tick if int(timer, 16) == 1 else None})
    return out


def tcp_probe_script(targets: list[tuple[str, int]], timeout_s: float) -> str:
    """Python source that tries a TCP connect to each target and prints, as JSON, one of
    "open", "refused" (the host answered: reachable) or the error per target."""
    return (
        "import json, socket\n"
        f"out = []\n"
        f"for host, port in {targets!r}:\n"
        "    try:\n"
        f"        socket.create_connection((host, port), timeout={timeout_s!r}).close()\n"
        "        out.append('open')\n"
        "    except ConnectionRefusedError:\n"
        "        out.append('refused')\n"
        "    except OSError as exc:\n"
        "        out.append(f'{type(exc).__name__}: {exc}')\n"
        "print(json.dumps(out))\n"
    )


class ProcessFailed(AssertionError):
    """A test subprocess did not answer in time, exited, or reported an exception."""


class NsProcess:
    """A subprocess with line-oriented stdout read by a thread (bounded waits)."""

    def __init__(self, name: str, argv: list[str], stderr_path: Path) -> None:
        self.name = name
        self.stderr_path = stderr_path
        self._stderr: IO[str] = open(stderr_path, "w")
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True, cwd=REPO, env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"reader-{name}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self._lines.put(line)
        except (OSError, ValueError):
            pass
        self._lines.put(None)

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def readline(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise ProcessFailed(f"{self.name}: no output within {timeout} s; stderr:\n"
                                f"{self.stderr_tail()}") from None
        if line is None:
            self._lines.put(None)  # stays at EOF
            raise ProcessFailed(f"{self.name}: exited (status {self.proc.poll()}); stderr:\n"
                                f"{self.stderr_tail()}")
        return line

    def call(self, cmd: str, timeout: float, **args: Any) -> Any:
        """Send one agent command; its result, or ProcessFailed."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise ProcessFailed(f"{self.name}: stdin closed; stderr:\n{self.stderr_tail()}") \
                from None
        reply = json.loads(self.readline(timeout))
        if "exception" in reply:
            raise ProcessFailed(f"{self.name}: {cmd} raised {reply['exception']}\n"
                                f"{reply.get('traceback', '')}")
        return reply["result"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self, timeout: float) -> int | None:
        """SIGTERM, wait up to ``timeout``; SIGKILL after that.  Returns the exit status
        if the process ended on SIGTERM (None if it had to be killed)."""
        status: int | None = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                status = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        else:
            status = self.proc.returncode
        self.release()
        return status

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.release()

    def wait(self, timeout: float) -> int:
        """Wait for exit; kills it (and raises ProcessFailed) after ``timeout``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ProcessFailed(f"{self.name}: did not exit within {timeout} s; stderr:\n"
                                f"{self.stderr_tail()}") from None

    def release(self) -> None:
        """Close the pipes of an exited process."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self._reader.join(timeout=5)  # the process is gone: its stdout is at EOF
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()
        if not self._stderr.closed:
            self._stderr.close()
