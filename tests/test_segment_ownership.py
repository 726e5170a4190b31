"""Segment names bound to their owners, and mounts that prove what they claim.

Real masters on loopback, real clients, real shared memory.  The attackers are raw
DEALERs (a modified client) run as another Unix user (uid 65534, nobody) in a child
process where the scenario needs one (those tests skip when not root):

* after a master restart a client mounts another client's segment name before its
  owner re-mounts it: refused ILLEGAL_CLIENT (the name carries the owner's
  fingerprint: of its CURVE key, or of its client id), the owner's re-mount succeeds,
  and the squatter's expiry leaves the owner's file alone;
* an expired client's file is unlinked only while it is still the file it mounted;
* a symlink or a hard link under a segment name, and a same-host name without the
  ``kvmaster-`` form, are refused by the master; a client never maps a symlink;
* sizes are bounded: a 2^63-1 mount is refused and STATS keeps working with 64
  segments of 2^48 bytes; a remote mount over ``--max-remote-segment-size`` is
  refused, and a transfer service serving less than its mount claimed is not used;
* with CURVE a transfer service must be the mounting key's;
* a refused re-mount is retried, logged at WARNING with its status and counted, and
  the client then takes a fresh name.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from kvmaster import Client, ClientConfig, KVMasterError, ReplicateConfig, auth
from kvmaster import protocol as P
from kvmaster._mounts import MAX_TOTAL_MOUNTED, MountProof, admit_mount
from kvmaster._segment import Segment, SegmentFileError, new_segment_name, owner_fingerprint
from kvmaster.config import MasterConfig
from kvmaster.protocol import Op, Status
from tests.support import wait_until

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534
HOST = socket.gethostname()
MiB = 1 << 20

as_root = pytest.mark.skipif(os.geteuid() != 0,
                             reason="needs root to run the attacker as uid 65534 (nobody)")


def shm(name: str) -> Path:
    return Path("/dev/shm") / name


class Raw:
    """A raw DEALER in this process, with a client key (or none)."""

    def __init__(self, endpoint: str, curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = curve
        self.sock.connect(endpoint)
        self.n = 0

    def ask(self, op: Op, fields: list[Any]) -> tuple[int, Any]:
        self.n += 1
        self.sock.send_multipart([op.value, b"", msgpack.packb([self.n, *fields],
                                                               use_bin_type=True)])
        assert self.sock.poll(10_000), f"no reply to {op.name}"
        _, status, body = P.decode_reply(self.sock.recv_multipart()[1])
        return status, body

    def hello(self, client_id: str, tenant: str = "default") -> None:
        status, body = self.ask(Op.HELLO, [*P.PROTOCOL_VERSION, client_id, tenant, HOST, "0"])
        assert status == 0, body

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


#: The attacker: a raw client run as nobody.  stdin: {"endpoint", "curve": [pub, sec,
#: server] or null, "client_id", "create": size or 0, "requests": [[op hex, fields]]};
#: "$SEG" in a request's fields stands for the segment it created (its own name).
#: It exits without BYE (it goes silent) and prints the replies as JSON.
ATTACKER = r"""
import json, os, sys
import msgpack, zmq
from kvmaster import protocol as P
from kvmaster._segment import Segment, _madvise, new_segment_name, owner_fingerprint
_madvise()
# Everything is imported: from here on this process is nobody (the interpreter may
# live where nobody could start it).
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
a = json.load(sys.stdin)
seg = ""
if a["create"]:
    ident = a["curve"][0] if a["curve"] else a["client_id"]
    s = Segment.create(a["create"], new_segment_name(owner_fingerprint(ident)))
    seg = s.name
    s.close(unlink=False)
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
if a["curve"]:
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = (
        k.encode() for k in a["curve"])
sock.connect(a["endpoint"])
out = {"segment": seg, "replies": []}
for i, (op, fields) in enumerate(a["requests"], 1):
    fields = [seg if f == "$SEG" else f for f in fields]
    sock.send_multipart([bytes.fromhex(op), b"", msgpack.packb([i, *fields])])
    if not sock.poll(10000):
        out["replies"].append(None)
        break
    _, status, body = P.decode_reply(sock.recv_multipart()[1])
    out["replies"].append([status, body])
sock.close(0)
ctx.term()
print(json.dumps(out))
"""


def attack(endpoint: str, client_id: str, requests: list[tuple[Op, list[Any]]],
           curve: tuple[bytes, bytes, bytes] | None = None, create: int = 0,
           tenant: str = "default") -> dict[str, Any]:
    """Run the attacker as uid 65534 (it drops root itself once its modules are
    loaded): HELLO as ``client_id``, then ``requests``."""
    reqs = [(Op.HELLO.value.hex(), [*P.PROTOCOL_VERSION, client_id, tenant, HOST, "0"])]
    reqs += [(op.value.hex(), fields) for op, fields in requests]
    arg = {"endpoint": endpoint, "client_id": client_id, "create": create, "requests": reqs,
           "curve": [k.decode() for k in curve] if curve else None}
    r = subprocess.run([sys.executable, "-c", ATTACKER], input=json.dumps(arg),
                       capture_output=True, text=True, timeout=60, cwd="/",
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["replies"][0][0] == 0, out
    return out


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    for name, tenant in (("owner", "tenant-o"), ("mallory", "tenant-m"), ("ally", "tenant-m"),
                         ("watch", "default")):
        auth.keygen(d, name, tenant)
    return d


def make_client(m: Any, keydir: Path | None, name: str, size: int = 2 * MiB,
                **kw: Any) -> Client:
    cfg = ClientConfig(connect_timeout_s=5.0, timeout_s=5.0, reconnect_max_backoff_s=1.0,
                       **({"curve_dir": str(keydir), "curve_client": name} if keydir else {}),
                       **kw)
    c = Client(cfg)
    c.setup(m.addr, size)
    return c


def front(m: Any, keydir: Path | None) -> dict[str, int]:
    """The master's front counters (STATS, by a watcher of its own)."""
    r = Raw(m.endpoint, auth.client_keys(keydir, "watch") if keydir else None)
    try:
        r.hello("watcher")
        status, body = r.ask(Op.STATS, [])
        assert status == 0, body
        return body["front"]
    finally:
        r.close()


def restart(start_master, m: Any, *flags: str) -> Any:
    port = m.addr.rsplit(":", 1)[1]
    assert m.stop() == 0, m.stderr
    m2 = start_master("--port", port, *flags)
    assert m2.addr == m.addr
    return m2


# --------------------------------------------------------------- squatting


@as_root
@pytest.mark.parametrize("mode", ["plain", "curve"])
def test_squatting_after_a_restart_is_refused_and_the_owner_remounts(
        start_master, keys, mode) -> None:
    """The master restarts; before the owner re-handshakes (its lock is held, so its
    heartbeat waits), a client of another Unix user mounts the owner's segment name,
    as a same-host file and as a remote segment: both refused ILLEGAL_CLIENT.  The
    squatter goes silent and is expired; the owner's file is still there, and the
    owner's re-mount of the same name succeeds at the first attempt."""
    keydir = keys if mode == "curve" else None
    flags = ("--client-ttl", "1.0", *(("--curve-dir", str(keys)) if keydir else ()))
    m = start_master(*flags)
    owner = make_client(m, keydir, "owner")
    try:
        seg = owner.segment_name
        owner.put("before", b"b" * 4096)
        with owner._lock:
            m = restart(start_master, m, *flags)
            out = attack(m.endpoint, "squatter", [
                (Op.MOUNT_SEGMENT, [seg, 2 * MiB, HOST, "shm"]),
                (Op.MOUNT_SEGMENT, [seg, 2 * MiB, "elsewhere", ""]),
            ], curve=auth.client_keys(keys, "mallory") if keydir else None)
            for status, text in out["replies"][1:]:
                assert status == Status.ILLEGAL_CLIENT, out
                assert "another owner" in text and "\n" not in text, text
            wait_until(lambda: front(m, keydir)["clients_expired"] >= 1, 15,
                       "the squatter to expire")
            assert shm(seg).exists(), "the squatter's expiry removed the owner's file"
        wait_until(lambda: owner.reconnect_count >= 1, 15, "the owner to re-handshake")
        assert owner.segment_name == seg and owner.mount_refusals == 0
        listed = {s["name"]: s for s in owner.list_segments()}
        assert listed[seg]["owner"] == owner.client_id
        owner.put("after", b"a" * 4096, ReplicateConfig(preferred_segments=[seg]))
        assert owner.get("after") == b"a" * 4096
        assert shm(seg).exists()
    finally:
        owner.close()


@as_root
def test_an_expired_clients_file_is_unlinked_only_while_it_is_the_mounted_one(
        start_master) -> None:
    """Two clients of another Unix user mount segment files of their own and go silent.
    One file is replaced (same name, another inode and owner) before the expiry: the
    master leaves the replacement alone, and unlinks the other client's own file."""
    m = start_master("--client-ttl", "1.0")
    mount = [(Op.MOUNT_SEGMENT, ["$SEG", 2 * MiB, HOST, "shm"])]
    kept = attack(m.endpoint, "gone-1", mount, create=2 * MiB)
    dropped = attack(m.endpoint, "gone-2", mount, create=2 * MiB)
    for out in (kept, dropped):
        assert out["replies"][1][0] == 0, out
        assert os.stat(shm(out["segment"])).st_uid == NOBODY
    replaced = shm(kept["segment"])
    tmp = replaced.with_name(replaced.name + ".tmp")
    try:
        tmp.write_bytes(b"another file")
        os.replace(tmp, replaced)
        wait_until(lambda: front(m, None)["clients_expired"] >= 2, 15, "both to expire")
        wait_until(lambda: not shm(dropped["segment"]).exists(), 5,
                   "the unchanged file to be unlinked")
        assert replaced.read_bytes() == b"another file"
    finally:
        for p in (tmp, replaced, shm(dropped["segment"])):
            p.unlink(missing_ok=True)


# ------------------------------------------------------------------ aliases


@as_root
def test_symlink_and_hard_link_aliases_and_unprefixed_names_are_refused(
        start_master, make_client) -> None:
    """A client of another Unix user aliases the victim's segment file under names of
    its own: a symlink without the kvmaster- form, a symlink under a segment name with
    its own fingerprint, and (made by root, as protected_hardlinks keeps nobody from
    it) a hard link; and mounts a regular file without the kvmaster- form.  The master
    refuses each same-host mount (INVALID_PARAMS, one line), and a client never maps
    a symlink."""
    m = start_master()
    victim = make_client(m, 2 * MiB)
    fp = owner_fingerprint("mallory")
    names = {"alias": f"kvsec-alias-{os.getpid()}",
             "prefixed": new_segment_name(fp),
             "hard": new_segment_name(fp),
             "plain": f"kvsec-plain-{os.getpid()}"}
    target = shm(victim.segment_name)
    try:
        os.symlink(target, shm(names["alias"]))
        os.symlink(target, shm(names["prefixed"]))
        os.link(target, shm(names["hard"]))
        shm(names["plain"]).write_bytes(b"\0" * (2 * MiB))
        for what in ("alias", "prefixed", "plain"):  # (the hard link is the victim's inode)
            os.lchown(shm(names[what]), NOBODY, NOBODY)
        out = attack(m.endpoint, "mallory",
                     [(Op.MOUNT_SEGMENT, [n, 2 * MiB, HOST, "shm"]) for n in names.values()])
        for (what, name), (status, text) in zip(names.items(), out["replies"][1:]):
            assert status == Status.INVALID_PARAMS, (what, status, text)
            assert "\n" not in text and name in text, (what, text)
        texts = [r[1] for r in out["replies"][1:]]
        assert "regular file" in texts[1] and "2 links" in texts[2], texts
        assert [s["name"] for s in victim.list_segments()] == [victim.segment_name]
        with pytest.raises(SegmentFileError, match="symlink"):
            Segment.attach(names["prefixed"])
        with pytest.raises(SegmentFileError, match="links"):
            Segment.attach(names["hard"])
    finally:
        for n in names.values():
            shm(n).unlink(missing_ok=True)


@as_root
def test_an_alias_claimed_on_another_host_never_lands_writes_in_the_victims_file(
        start_master) -> None:
    """The master cannot see files on other hosts: a client of another user mounts a
    symlink to the victim's file, claiming the victim's host (not the master's).  The
    victim's writes placed there fail (TRANSFER_FAIL: a symlink is not mapped) instead
    of landing on its own older objects."""
    m = start_master("--shards", "1")
    victim = Client(ClientConfig(local_hostname="host-x", timeout_s=5.0))
    victim.setup(m.addr, 2 * MiB)
    alias = shm(new_segment_name(owner_fingerprint("mallory")))
    try:
        old = bytes(range(256)) * 16
        victim.put("old", old)
        os.symlink(shm(victim.segment_name), alias)
        os.lchown(alias, NOBODY, NOBODY)
        out = attack(m.endpoint, "mallory",
                     [(Op.MOUNT_SEGMENT, [alias.name, 2 * MiB, "host-x", "shm"])])
        assert out["replies"][1][0] == 0, out  # another host: the master cannot tell
        with pytest.raises(KVMasterError) as exc:
            victim.put("new", b"\xff" * 4096, ReplicateConfig(preferred_segments=[alias.name]))
        assert exc.value.code == Status.TRANSFER_FAIL and "symlink" in str(exc.value)
        assert victim.get("old") == old
    finally:
        alias.unlink(missing_ok=True)
        victim.close()


# -------------------------------------------------------------------- sizes


def test_huge_mounts_are_refused_and_stats_keeps_working(start_master) -> None:
    """64 mounts of 2^63-1 bytes are refused at decoding (sizes are at most 2^48);
    64 remote segments of 2^48 bytes each (allowed by the flag) add up and STATS
    answers with their sum."""
    m = start_master("--shards", "2", "--max-remote-segment-size", str(1 << 48))
    r = Raw(m.endpoint)
    try:
        r.hello("big")
        fp = owner_fingerprint("big")
        for i in range(64):
            status, text = r.ask(Op.MOUNT_SEGMENT, [f"big-{i}.owner-{fp}", (1 << 63) - 1,
                                                    "elsewhere", ""])
            assert status == Status.INVALID_PARAMS and "size" in text, text
        status, body = r.ask(Op.STATS, [])
        assert status == 0 and body["segments"] == 0, body
        for i in range(64):
            status, usable = r.ask(Op.MOUNT_SEGMENT, [f"big-{i}.owner-{fp}", 1 << 48,
                                                      "elsewhere", ""])
            assert status == 0 and usable == 1 << 48, usable
        status, body = r.ask(Op.STATS, [])
        assert status == 0, body
        assert body["segments"] == 64 and body["total"]["capacity_bytes"] == 64 << 48, body["total"]
    finally:
        r.close()


@pytest.mark.parametrize("mode", ["plain", "curve"])
def test_a_remote_mount_over_the_cap_is_refused(start_master, keys, mode) -> None:
    """A made-up 1 TiB segment on another host is over --max-remote-segment-size's
    default (64 GiB), and a smaller flag refuses less; the same size on the master's
    host is bounded by --max-segment-size."""
    curve = auth.client_keys(keys, "mallory") if mode == "curve" else None
    m = start_master("--max-segment-size", str(1 << 40),
                     *(("--curve-dir", str(keys)) if curve else ()))
    m2 = start_master("--max-remote-segment-size", str(8 * MiB),
                      *(("--curve-dir", str(keys)) if curve else ()))
    fp = owner_fingerprint(curve[0].decode() if curve else "mallory")
    name = f"kvmaster-{'ab' * 8}.owner-{fp}"
    for master, size, refused in ((m, 1 << 40, True), (m, 64 << 30, False),
                                  (m2, 16 * MiB, True), (m2, 8 * MiB, False)):
        r = Raw(master.endpoint, curve)
        try:
            r.hello("mallory")
            status, text = r.ask(Op.MOUNT_SEGMENT, [name, size, "elsewhere", ""])
            if refused:
                assert status == Status.INVALID_PARAMS, text
                assert "--max-remote-segment-size" in text and "\n" not in text, text
            else:
                assert status == 0, text
                assert r.ask(Op.UNMOUNT_SEGMENT, [name])[0] == 0
            if master is m:
                status, text = r.ask(Op.MOUNT_SEGMENT, [name, (1 << 40) + 1, HOST, "shm"])
                assert status == Status.INVALID_PARAMS and "--max-segment-size" in text, text
        finally:
            r.close()


def test_a_transfer_service_serving_less_than_its_mount_is_not_used(start_master, keys) -> None:
    """With CURVE, a client mounts its 2 MiB segment claiming 32 MiB; another host's
    client asks the service for its size before the first transfer and refuses it
    (TRANSFER_FAIL), writing nothing past the served segment."""
    m = start_master("--curve-dir", str(keys), "--shards", "1")
    liar = Client(ClientConfig(local_hostname="host-a", transfer_host="127.0.0.1",
                               curve_dir=str(keys), curve_client="mallory", timeout_s=5.0))
    real = liar._mount_fields
    liar._mount_fields = lambda seg: [*real(seg)[:1], 32 * MiB, *real(seg)[2:]]
    liar.setup(m.addr, 2 * MiB)
    writer = make_client(m, keys, "ally", 0, local_hostname="host-b")  # mallory's tenant
    try:
        assert {s["name"]: s["size"] for s in writer.list_segments()} == \
            {liar.segment_name: 32 * MiB}
        with pytest.raises(KVMasterError) as exc:
            writer.put("k", b"x" * 4096)
        assert exc.value.code == Status.TRANSFER_FAIL and "serves 2097152" in str(exc.value)
        assert liar._service.served == 1  # the size question only
    finally:
        writer.close()
        liar.close()


def test_with_curve_a_transfer_service_must_be_the_mounting_keys(start_master, keys) -> None:
    """A remote mount naming another key's transfer service, or a service without a
    key, is refused ILLEGAL_CLIENT; the mounting key's own is taken.  A name without
    an owner fingerprint is refused too."""
    m = start_master("--curve-dir", str(keys))
    curve = auth.client_keys(keys, "mallory")
    mine, theirs = curve[0].decode(), auth.client_keys(keys, "owner")[0].decode()
    name = new_segment_name(owner_fingerprint(mine))
    r = Raw(m.endpoint, curve)
    try:
        r.hello("mallory")
        for transport, want in ((f"tcp://127.0.0.1:9#curve={theirs}", Status.ILLEGAL_CLIENT),
                                ("tcp://127.0.0.1:9", Status.ILLEGAL_CLIENT),
                                (f"tcp://127.0.0.1:9#curve={mine}", 0)):
            status, text = r.ask(Op.MOUNT_SEGMENT, [name, 4 * MiB, "elsewhere", transport])
            assert status == want, (transport, text)
        status, text = r.ask(Op.MOUNT_SEGMENT, ["kvmaster-0123456789abcdef", 4 * MiB,
                                                "elsewhere", ""])
        assert status == Status.ILLEGAL_CLIENT and ".owner-" in text, text
    finally:
        r.close()


def test_admission_bounds_the_sum_of_mounted_sizes() -> None:
    """The front's admission refuses a mount that would take all mounted segments past
    2^62 bytes, so sums of sizes never overflow (checked on the rule itself: reaching
    2^62 takes 16384 mounts of 2^48)."""
    cfg = MasterConfig(max_remote_segment_size=1 << 48)
    msg = P.MountSegmentRequest(f"x.owner-{owner_fingerprint('c')}", 1 << 48, "elsewhere", "")
    assert isinstance(admit_mount(msg, "c", None, HOST, cfg, MAX_TOTAL_MOUNTED - (1 << 48)),
                      MountProof)
    status, text = admit_mount(msg, "c", None, HOST, cfg, MAX_TOTAL_MOUNTED - (1 << 48) + 1)
    assert status == Status.INVALID_PARAMS and "in all" in text


# -------------------------------------------------------------- re-mounting


def test_a_refused_remount_is_retried_reported_and_given_a_fresh_name(
        start_master, keys, caplog) -> None:
    """Another client of the owner's own key (the same principal: it may) mounts the
    owner's name after a restart, first.  The owner's re-mount is refused
    SEGMENT_ALREADY_EXISTS; it is tried MOUNT_ATTEMPTS times, each refusal logged at
    WARNING with its status and counted, then the owner takes a fresh name, mounted,
    and serves again.  The old name's file is the owner's to remove."""
    from kvmaster._core import MOUNT_ATTEMPTS

    flags = ("--curve-dir", str(keys))
    m = start_master(*flags)
    owner = make_client(m, keys, "owner")
    twin = None
    try:
        seg = owner.segment_name
        caplog.set_level(logging.WARNING, logger="kvmaster")
        with owner._lock:
            m = restart(start_master, m, *flags)
            twin = Raw(m.endpoint, auth.client_keys(keys, "owner"))
            twin.hello("twin", "tenant-o")
            assert twin.ask(Op.MOUNT_SEGMENT, [seg, 2 * MiB, HOST, "shm"])[0] == 0
        wait_until(lambda: owner.reconnect_count >= 1, 20, "the owner to re-handshake")
        assert owner.mount_refusals == MOUNT_ATTEMPTS
        assert owner.segment_name != seg and not shm(seg).exists()
        refusals = [r for r in caplog.records if "refused the re-mount" in r.getMessage()]
        assert len(refusals) == MOUNT_ATTEMPTS
        assert all(r.levelno == logging.WARNING and "SEGMENT_ALREADY_EXISTS (-102)"
                   in r.getMessage() for r in refusals)
        assert not [r for r in caplog.records if "heartbeat failed" in r.getMessage()]
        names = {s["name"] for s in owner.list_segments()}
        assert names == {seg, owner.segment_name}
        owner.put("k", b"v" * 4096, ReplicateConfig(preferred_segments=[owner.segment_name]))
        assert owner.get("k") == b"v" * 4096
    finally:
        if twin is not None:
            twin.close()
        owner.close()


def test_a_remount_refused_to_the_end_leaves_a_working_client(start_master, caplog) -> None:
    """The master comes back with a --max-segment-size below the owner's segment: every
    re-mount is refused INVALID_PARAMS, the fresh name's too.  The client says so (a
    WARNING per refusal, no "heartbeat failed"), counts them, and keeps serving calls
    without a segment of its own."""
    from kvmaster._core import MOUNT_ATTEMPTS

    m = start_master()
    owner = make_client(m, None, "owner", 4 * MiB)
    caplog.set_level(logging.WARNING, logger="kvmaster")
    try:
        with owner._lock:
            m = restart(start_master, m, "--max-segment-size", str(2 * MiB),
                        "--master-segment-size", str(4 * MiB))
        wait_until(lambda: owner.mount_refusals >= MOUNT_ATTEMPTS, 20, "the refusals")
        wait_until(lambda: any("incomplete" in r.getMessage() for r in caplog.records), 10,
                   "the heartbeat to report the failed re-handshake")
        refusals = [r for r in caplog.records if "refused the re-mount" in r.getMessage()]
        assert refusals and all("INVALID_PARAMS (-600)" in r.getMessage() for r in refusals)
        assert not [r for r in caplog.records if "heartbeat failed" in r.getMessage()]
        owner.put("k", b"w" * 4096)  # placed on the master's own segment
        assert owner.get("k") == b"w" * 4096
    finally:
        owner.close()
