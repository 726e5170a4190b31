"""Cross-host data path: clients that say they are on different hosts move bytes
through each other's transfer services instead of mapping the segment files."""

from __future__ import annotations

import pytest

from kvmaster import Client, ClientConfig, KVMasterError


def _client(master, host: str, size: int, **kw) -> Client:
    c = Client(ClientConfig(local_hostname=host, transfer_host="127.0.0.1", **kw))
    c.setup(master.addr, size)
    return c


def test_put_on_one_host_get_on_another(master) -> None:
    a = _client(master, "host-a", 8 << 20)
    b = _client(master, "host-b", 0)
    try:
        payload = bytes(range(256)) * 4096  # 1 MiB
        a.put("k", payload)
        assert b.get("k") == payload
        # The read went through a's transfer service, after the size check of the first use.
        assert a._service.served == 2
        assert a.segment_name not in b._mapped  # b never mapped a's file
        # b writes into a's segment (the only one) through the network as well
        b.put("from-b", b"written remotely" * 100)
        assert a.get("from-b") == b"written remotely" * 100
        assert b.get_batch(["k", "from-b", "none"]) == [payload, b"written remotely" * 100, None]
        buf = bytearray(len(payload))
        assert b.get_into("k", buf) == len(payload) and buf == payload
    finally:
        b.close()
        a.close()


def test_force_transfer_on_the_same_host(master) -> None:
    a = _client(master, "same", 4 << 20)
    b = _client(master, "same", 0, force_transfer=True)
    try:
        a.put("x", b"y" * 5000)
        assert b.get("x") == b"y" * 5000
        assert a._service.served >= 1
    finally:
        b.close()
        a.close()


def test_peer_gone_mid_transfer_fails_cleanly(master) -> None:
    a = _client(master, "host-a", 4 << 20)
    b = _client(master, "host-b", 0, timeout_s=1.0)
    try:
        a.put("k", b"z" * 10000)
        assert b.get("k") == b"z" * 10000
        a._service.close()  # the link to a's host is cut
        with pytest.raises(KVMasterError) as exc:
            b.get("k")
        assert exc.value.code == -800  # TRANSFER_FAIL, after the transfer timeout
        assert b.stats()["keys"] == 1  # the master still serves b
    finally:
        b.close()
        a.close()


def test_cross_host_transfer_with_curve(start_master, tmp_path) -> None:
    from kvmaster.auth import keygen

    keys = tmp_path / "keys"
    keygen(keys, "a", "t1")
    keygen(keys, "b", "t1")
    m = start_master("--curve-dir", str(keys))
    a = Client(ClientConfig(local_hostname="host-a", transfer_host="127.0.0.1",
                            curve_dir=str(keys), curve_client="a"))
    a.setup(m.addr, 4 << 20)
    b = Client(ClientConfig(local_hostname="host-b", curve_dir=str(keys), curve_client="b"))
    b.setup(m.addr, 0)
    try:
        a.put("k", b"encrypted in transit" * 50)
        assert b.get("k") == b"encrypted in transit" * 50
        assert a._service.served == 2  # the size check of the first use, then the read
    finally:
        b.close()
        a.close()
