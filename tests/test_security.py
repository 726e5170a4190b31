"""Security: CURVE authentication and encryption, tenants bound to keys, and
owner-only shared memory.

* ``kvmaster keygen`` writes the master's key pair and client key pairs; secret
  files are mode 0600, and a client's public certificate (the file the master
  reads) carries the tenant it is bound to.
* A master started with ``--curve-dir`` accepts clients holding an allowed key
  and refuses (no WELCOME: the handshake fails) clients without CURVE, with an
  unknown key, or expecting another server key.
* The tenant of a CURVE client is the tenant of its key, whatever HELLO claims,
  and a registration belongs to the key that made it.
* The traffic is encrypted: a TCP tap between client and master sees none of
  the keys, session ids or client ids that it sees in plaintext without CURVE.
* Segment files in /dev/shm are created 0600 (also under umask 0), and the
  master never deletes a file in /dev/shm that it was merely told about.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from kvmaster import Client, ClientConfig, Timeout, auth
from kvmaster import protocol as P
from kvmaster.protocol import Op, Status

REPO = Path(__file__).resolve().parents[1]


def keygen(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmaster", "keygen", str(directory), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def mode(p: Path | str) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    for name, tenant in (("alice", "tenant-a"), ("bob", "tenant-b")):
        r = keygen(d, "--client", name, "--tenant", tenant)
        assert r.returncode == 0, r.stderr
    return d


def curve_client(m: Any, keydir: Path, name: str, tenant: str = "default",
                 segment: int = 1 << 20, timeout: float = 5.0) -> Client:
    c = Client(ClientConfig(connect_timeout_s=timeout, timeout_s=timeout))
    c.setup(m.addr, segment, tenant, curve_dir=str(keydir), curve_client=name)
    return c


def assert_no_welcome(m: Any, **setup: str) -> None:
    """A client set up with these CURVE settings gets no WELCOME (Timeout)."""
    c = Client(ClientConfig(connect_timeout_s=1.0))
    try:
        with pytest.raises(Timeout):
            c.setup(m.addr, 0, **setup)
    finally:
        c.close()


class CurveDealer:
    """A raw DEALER holding a client key (or none), with a chosen routing id."""

    def __init__(self, endpoint: str, keydir: Path | None, name: str | None,
                 routing_id: bytes | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if keydir is not None and name is not None:
            pub, sec, server = auth.client_keys(keydir, name)
            self.sock.curve_publickey, self.sock.curve_secretkey = pub, sec
            self.sock.curve_serverkey = server
        self.sock.connect(endpoint)
        self.n = 0

    def ask(self, op: Op, fields: list[Any], rte: bytes = b"",
            timeout: float = 3.0) -> tuple[int, Any] | None:
        self.n += 1
        self.sock.send_multipart([op.value, rte, msgpack.packb([self.n, *fields],
                                                               use_bin_type=True)])
        if not self.sock.poll(timeout * 1000):
            return None
        _, status, body = P.decode_reply(self.sock.recv_multipart()[1])
        return status, body

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


# ---------------------------------------------------------------------------
# keygen


def test_keygen_files_and_modes(tmp_path: Path) -> None:
    d = tmp_path / "k"
    old = os.umask(0o022)
    try:
        r = keygen(d, "--client", "alice", "--tenant", "tenant-a")
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr
    files = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}
    assert files == {"master.key", "master.key_secret", "clients/alice.key",
                     "clients/alice.key_secret"}
    assert sorted(r.stdout.split()) == sorted(str(d / f) for f in files)
    for secret in ("master.key_secret", "clients/alice.key_secret"):
        assert mode(d / secret) == 0o600, secret
    for public in ("master.key", "clients/alice.key"):
        assert mode(d / public) & 0o022 == 0, public  # nobody else may change them
    master_pub = (d / "master.key").read_bytes()
    # A second client keeps the master's pair; a name is used once; bad names refused.
    assert keygen(d, "--client", "bob", "--tenant", "tenant-b").returncode == 0
    assert (d / "master.key").read_bytes() == master_pub
    dup = keygen(d, "--client", "alice", "--tenant", "tenant-x")
    assert dup.returncode == 2 and "exists" in dup.stderr
    for bad in (("--client", "../evil"), ("--client", "a/b"), ("--client", "a b"),
                ("--client", "x", "--tenant", ""), ("--client", "x", "--tenant", " default"),
                ("--client", "x", "--tenant", "default "), ("--client", "x", "--tenant", "a\"b")):
        r = keygen(d, *bad)
        assert r.returncode == 2, (bad, r.stdout, r.stderr)
    assert not (tmp_path / "evil.key").exists()
    # The secret keys load; the public ones hold no secret.
    pub, sec, server = auth.client_keys(d, "alice")
    assert len(pub) == len(sec) == len(server) == 40
    assert b"secret-key" not in (d / "clients" / "alice.key").read_bytes()
    assert b"secret-key" not in (d / "master.key").read_bytes()


@pytest.mark.parametrize("tenant", ["tenant-a", "租户-α", "default"])
def test_keygen_binds_the_tenant_in_the_public_certificate(tmp_path: Path, tenant: str) -> None:
    """The master learns a client's tenant from the client's public certificate in
    ``DIR/clients`` (it never sees the client's secret file).  keygen must write the
    tenant there so that ``auth.allowed_tenants`` maps the key to it."""
    d = tmp_path / "k"
    assert keygen(d, "--client", "c1", "--tenant", tenant).returncode == 0
    pub, _, _ = auth.client_keys(d, "c1")
    assert auth.allowed_tenants(d) == {pub.decode(): tenant}


# ---------------------------------------------------------------------------
# Authentication


def test_curve_master_accepts_keyed_clients_and_refuses_others(start_master, keys: Path,
                                                                 tmp_path: Path) -> None:
    m = start_master("--shards", "2", "--curve-dir", str(keys))
    alice = curve_client(m, keys, "alice")
    try:
        assert alice.get_config()["curve"] is True
        alice.put("k", b"v")
        assert alice.get("k") == b"v"
        # No CURVE at all: the handshake never completes, so no WELCOME.
        assert_no_welcome(m)
        # A well-formed key the master does not list.
        other = tmp_path / "other"
        assert keygen(other, "--client", "mallory", "--tenant", "tenant-a").returncode == 0
        (other / "master.key").write_bytes((keys / "master.key").read_bytes())
        assert_no_welcome(m, curve_dir=str(other), curve_client="mallory")
        # An allowed client key, but expecting another server key (a man in the middle's).
        assert keygen(tmp_path / "mitm").returncode == 0
        fake = tmp_path / "fake"
        (fake / "clients").mkdir(parents=True)
        for f in ("alice.key", "alice.key_secret"):
            (fake / "clients" / f).write_bytes((keys / "clients" / f).read_bytes())
        (fake / "master.key").write_bytes((tmp_path / "mitm" / "master.key").read_bytes())
        assert_no_welcome(m, curve_dir=str(fake), curve_client="alice")
        # Raw DEALERs: nothing comes back without a valid key, and the master lives on.
        for keydir, name in ((None, None), (other, "mallory")):
            d = CurveDealer(m.endpoint, keydir, name)
            try:
                assert d.ask(Op.HELLO, [1, 0, "raw", "default", "h", "0"], timeout=1.0) is None
            finally:
                d.close()
        assert m.proc.poll() is None
        assert alice.get("k") == b"v"
    finally:
        alice.close()


def test_curve_tenant_comes_from_the_key(start_master, keys: Path) -> None:
    """alice's key is bound to tenant-a and bob's to tenant-b.  Each claims the other's
    tenant in HELLO; each still lands in its key's tenant and cannot see the other's data."""
    m = start_master("--shards", "2", "--curve-dir", str(keys))
    alice = curve_client(m, keys, "alice", tenant="tenant-b")
    bob = curve_client(m, keys, "bob", tenant="tenant-a")
    try:
        mine = [c for c in alice.list_clients() if c["client_id"] == alice.client_id]
        assert [c["tenant"] for c in mine] == ["tenant-a"], alice.list_clients()
        mine = [c for c in bob.list_clients() if c["client_id"] == bob.client_id]
        assert [c["tenant"] for c in mine] == ["tenant-b"], bob.list_clients()
        alice.put("only-alice", b"a")
        assert bob.is_exist("only-alice") is False
    finally:
        alice.close()
        bob.close()


def test_curve_key_without_a_tenant_is_refused(start_master, keys: Path) -> None:
    """protocol/PROTOCOL.md section 22: a listed key whose certificate names no tenant
    is answered ILLEGAL_CLIENT at HELLO; it must not fall into some tenant (least of
    all ``default``, the default admin tenant)."""
    cert = keys / "clients" / "alice.key"
    lines = [ln for ln in cert.read_text().splitlines() if not ln.strip().startswith("tenant")]
    cert.write_text("\n".join(lines) + "\n")
    m = start_master("--shards", "2", "--curve-dir", str(keys))
    d = CurveDealer(m.endpoint, keys, "alice")
    try:
        r = d.ask(Op.HELLO, [1, 0, "no-tenant", "default", "h", "0"])
        assert r is not None, "no reply"
        status, body = r
        assert status == Status.ILLEGAL_CLIENT, (
            f"a key without a tenant was registered (tenant {body.get('tenant')!r})"
            if isinstance(body, dict) else body)
    finally:
        d.close()


def test_curve_registration_belongs_to_the_key_that_made_it(start_master, keys: Path) -> None:
    """The master keys registrations by the DEALER routing id, which a client chooses.
    After alice's connection drops (before her registration expires), bob connecting
    with alice's routing id must not be served as alice: her tenant, segments and
    writes stay hers."""
    m = start_master("--shards", "2", "--curve-dir", str(keys))
    rid = b"victim-" + secrets.token_hex(4).encode()
    a = CurveDealer(m.endpoint, keys, "alice", rid)
    try:
        r = a.ask(Op.HELLO, [1, 0, "alice-raw", "tenant-a", "h", "0"])
        assert r is not None and r[0] == 0, r
    finally:
        a.close()
    time.sleep(0.3)  # the master notices the disconnect and frees the routing id
    b = None
    try:
        for _ in range(20):  # bounded: the id is free once the old pipe is gone
            b = CurveDealer(m.endpoint, keys, "bob", rid)
            r = b.ask(Op.HEARTBEAT, [], timeout=0.5)
            if r is not None:
                break
            b.close()
            b = None
        assert r is not None, "bob's connection with the reused routing id never got a reply"
        assert r[0] == Status.NOT_REGISTERED, (
            f"bob's key was served with alice's registration (status {r[0]})")
    finally:
        if b is not None:
            b.close()


# ---------------------------------------------------------------------------
# Encryption


class TcpTap:
    """A loopback TCP proxy that records every byte in both directions."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(8)
        self.addr = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.up = bytearray()  # client -> master
        self.down = bytearray()  # master -> client
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        pairs: dict[socket.socket, tuple[socket.socket, bytearray]] = {}
        deadline = time.monotonic() + 60
        while not self.stop.is_set() and time.monotonic() < deadline:
            ready, _, _ = select.select([self.lsock, *pairs], [], [], 0.05)
            for s in ready:
                if s is self.lsock:
                    client, _ = self.lsock.accept()
                    upstream = socket.create_connection(self.target)
                    pairs[client] = (upstream, self.up)
                    pairs[upstream] = (client, self.down)
                    continue
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                peer, log = pairs[s]
                if not data:
                    for x in (s, peer):
                        pairs.pop(x, None)
                        x.close()
                    continue
                log += data
                peer.sendall(data)
        for s in pairs:
            s.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.lsock.close()


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext-control", "curve"])
def test_traffic_is_encrypted(start_master, keys: Path, curve: bool) -> None:
    flags = ("--curve-dir", str(keys)) if curve else ()
    m = start_master("--shards", "2", *flags)
    tap = TcpTap(m.addr)
    marker = secrets.token_hex(6)
    key, session = f"KEY-MARKER-{marker}", f"SESSION-MARKER-{marker}"
    c = Client(ClientConfig(connect_timeout_s=5.0))
    try:
        c.setup(tap.addr, 1 << 20, f"TENANT-MARKER-{marker}",
                **({"curve_dir": str(keys), "curve_client": "alice"} if curve else {}))
        c.put(key, b"value")
        assert c.attach_kv_session(session, [key]) == [0]
        assert c.list_kv_session_keys(session).keys == [key]
        assert c.get(key) == b"value"
        client_id = c.client_id
    finally:
        c.close()
        tap.close()
    wire = bytes(tap.up) + bytes(tap.down)
    assert len(wire) > 500, "the tap saw no traffic"
    plain = [s for s in (key, session, client_id, "TENANT-MARKER") if s.encode() in wire]
    if curve:
        assert tap.up[:10].startswith(b"\xff") and b"CURVE" in bytes(tap.up[:64])
        assert plain == [], f"readable on the wire under CURVE: {plain}"
    else:
        assert b"NULL" in bytes(tap.up[:64])
        assert plain == [key, session, client_id, "TENANT-MARKER"]


# ---------------------------------------------------------------------------
# Shared memory


def test_segment_files_are_owner_only(start_master) -> None:
    """Client and master segments are 0600 even when the umask would allow more."""
    old = os.umask(0)
    try:
        m = start_master("--shards", "2", "--master-segment-size", str(1 << 20))
        c = Client()
        try:
            c.setup(m.addr, 1 << 20)
            assert c.segment_name is not None
            path = f"/dev/shm/{c.segment_name}"
            assert mode(path) == 0o600, oct(mode(path))
            assert os.stat(path).st_uid == os.getuid()
            own = [s["name"] for s in c.list_segments() if s["owner"] != c.client_id]
            assert len(own) == 1, c.list_segments()  # the master's own segment
            assert mode(f"/dev/shm/{own[0]}") == 0o600, oct(mode(f"/dev/shm/{own[0]}"))
        finally:
            c.close()
    finally:
        os.umask(old)


def test_expired_client_cannot_make_the_master_delete_other_files(start_master) -> None:
    """A client mounts a "segment" named after a file in /dev/shm that it did not create
    (another program's, or another tenant's), says it is on the master's host, and goes
    silent.  The mount is refused (not a kvmaster segment name of its owner), and
    expiring the client does not delete that file."""
    victim = Path(f"/dev/shm/kvsec-victim-{os.getpid()}-{secrets.token_hex(3)}")
    victim.write_bytes(b"precious")
    try:
        m = start_master("--shards", "2", "--client-ttl", "0.4")
        d = CurveDealer(m.endpoint, None, None)
        try:
            r = d.ask(Op.HELLO, [1, 0, "squatter", "default", socket.gethostname(), "0"])
            assert r is not None and r[0] == 0
            r = d.ask(Op.MOUNT_SEGMENT, [victim.name, 1 << 20, socket.gethostname(), "shm"])
            assert r is not None and r[0] == Status.INVALID_PARAMS, r
            assert "kvmaster-" in r[1] and "\n" not in r[1], r
        finally:
            d.close()
        watcher = Client(ClientConfig(connect_timeout_s=5.0))
        try:
            watcher.setup(m.addr, 0)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(
                    s["name"] == victim.name for s in watcher.list_segments()):
                time.sleep(0.1)
            assert not any(s["name"] == victim.name for s in watcher.list_segments())
        finally:
            watcher.close()
        assert victim.exists(), "the master deleted a /dev/shm file named by a client"
        assert victim.read_bytes() == b"precious"
    finally:
        with contextlib.suppress(FileNotFoundError):
            victim.unlink()


# ---------------------------------------------------------------------------
# The cross-host data path (transfer services)


def _read_via_transfer(endpoint: str, name: str, offset: int, size: int,
                       curve: tuple[bytes, bytes, bytes] | None) -> bytes | None:
    """Ask a segment's transfer service for a range; -> the bytes, or None if refused."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = curve
    s.connect(endpoint)
    try:
        s.send_multipart([b"R", name.encode(), offset.to_bytes(8, "big"), size.to_bytes(8, "big")])
        if not s.poll(1500):
            return None
        reply = s.recv_multipart()
        return reply[1] if reply[0] == b"\x00" else None
    finally:
        s.close(linger=0)
        ctx.term()


def test_curve_transfer_service_refuses_unknown_keys(start_master, keys: Path) -> None:
    """With CURVE on, a client's transfer service (which serves its segment to other
    hosts) must accept only keys the master allows.  A peer holding a key pair of
    its own, knowing only the owner's public key (a public certificate), must not
    read the owner's objects."""
    m = start_master("--shards", "2", "--curve-dir", str(keys))
    alice = curve_client(m, keys, "alice")
    try:
        alice.put("secret", b"TOP-SECRET-BYTES")
        name, offset = alice.query_key("secret")["replicas"][0]
        endpoint = next(s["transport"] for s in alice.list_segments() if s["name"] == name)
        if not endpoint.startswith("tcp://"):
            return  # no transfer service: nothing is exposed
        stranger_pub, stranger_sec = zmq.curve_keypair()
        alice_pub = auth.client_keys(keys, "alice")[0]
        got = _read_via_transfer(endpoint, name, offset, 16,
                                 (stranger_pub, stranger_sec, alice_pub))
        assert got is None, f"an unknown key read {got!r} from alice's segment"
    finally:
        alice.close()


def test_segment_bytes_are_not_served_to_anyone_by_default(start_master) -> None:
    """Segment files are 0600 so that other users cannot read them.  A client's default
    configuration must not serve the same bytes to any process that can open a TCP
    connection (another user on the host) without authentication."""
    m = start_master("--shards", "2")
    c = Client()
    try:
        c.setup(m.addr, 1 << 20)
        c.put("private", b"PRIVATE-BYTES-16")
        name, offset = c.query_key("private")["replicas"][0]
        endpoint = next(s["transport"] for s in c.list_segments() if s["name"] == name)
        if not endpoint.startswith("tcp://"):
            return
        got = _read_via_transfer(endpoint, name, offset, 16, None)
        assert got is None, f"an unauthenticated TCP peer read {got!r} from a 0600 segment"
    finally:
        c.close()
