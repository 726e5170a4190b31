"""A throw-away single-node etcd on loopback, for the HA tests and benchmarks.

``LocalEtcd()`` starts the ``etcd`` binary (Debian package etcd-server) with its data in a
temporary directory, on a random free port pair (retried if taken), and waits for its
``/health``; ``url`` is its client URL, ``proc`` its process, ``stop()`` ends it and removes
the directory.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import tempfile
import time
import urllib.request

__all__ = ["LocalEtcd"]


class LocalEtcd:
    """One etcd member on 127.0.0.1; ``extra``: more flags for it."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        binary = shutil.which("etcd")
        if not binary:
            raise RuntimeError("etcd not installed (Debian package etcd-server; "
                               "scripts/test.sh installs it)")
        self.dir = tempfile.mkdtemp(prefix="kvmaster-etcd-")
        for _ in range(10):
            port = random.randint(20000, 45000)
            self.url = f"http://127.0.0.1:{port}"
            self.proc = subprocess.Popen(
                [binary, "--data-dir", f"{self.dir}/data", "--name", "t",
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", f"http://127.0.0.1:{port + 1}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{port + 1}",
                 "--initial-cluster", f"t=http://127.0.0.1:{port + 1}", *extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    urllib.request.urlopen(f"{self.url}/health", timeout=0.5).read()
                    return
                except OSError:
                    time.sleep(0.1)
            self.proc.kill()
            self.proc.wait()
            shutil.rmtree(f"{self.dir}/data", ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        raise RuntimeError("could not start etcd")

    def db_size(self) -> int:
        """Bytes of etcd's database file (history included, until it compacts)."""
        req = urllib.request.Request(f"{self.url}/v3/maintenance/status", data=b"{}",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(json.loads(r.read())["dbSize"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
