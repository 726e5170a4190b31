from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvmaster import Client, ObjectHasLease, ObjectNotFound


def test_put_get_remove(client) -> None:
    client.put("k", b"v" * 100)
    assert client.get("k") == b"v" * 100
    assert client.is_exist("k")
    with pytest.raises(ObjectHasLease):
        client.remove("k")
    client.remove("k", force=True)
    with pytest.raises(ObjectNotFound):
        client.get("k")


def test_default_layout_serves_objects_batches_and_sessions(request, start_master,
                                                          make_client) -> None:
    """The master's own default layout: one shard in one process, four with shard
    processes; every kind of call works on it."""
    from conftest import DEFAULT_LAYOUT

    m = start_master(DEFAULT_LAYOUT)
    c = make_client(m)
    in_process = not request.config.getoption("--shard-processes")
    assert c.shard_count == (1 if in_process else 4)
    keys = [f"d{i}" for i in range(300)]
    vals = [bytes([i % 251]) * (100 + i) for i in range(300)]
    assert c.put_batch(keys, vals) == [0] * 300
    assert c.batch_is_exist(keys + ["nope"]) == [1] * 300 + [0]
    assert c.get_batch(keys) == vals
    c.attach_kv_session("s", keys[:200])
    assert c.update_kv_session("s", keys[:50]) == 150
    assert sorted(c.iter_kv_session_keys("s", page=16)) == sorted(keys[:50])
    c.close_kv_session("s")
    assert c.batch_remove(keys, True) == [0] * 300
    assert c.check_consistency() == []


def test_ipc_endpoint_serves_clients_on_this_host(start_master, make_client, tmp_path) -> None:
    path = tmp_path / "master.sock"
    m = start_master("--ipc-path", str(path))
    assert path.is_socket()
    over_tcp = make_client(m)
    over_ipc = Client()
    over_ipc.setup(f"ipc://{path}", 4 << 20)
    try:
        over_ipc.put("via-ipc", b"i" * 5000)
        over_tcp.put("via-tcp", b"t" * 10)
        assert over_tcp.get("via-ipc") == b"i" * 5000
        assert over_ipc.get("via-tcp") == b"t" * 10
        assert over_ipc.batch_is_exist(["via-ipc", "via-tcp", "absent"]) == [1, 1, 0]
    finally:
        over_ipc.close()
    assert m.stop() == 0
    assert not path.exists(), "the master left its ipc socket file behind"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_start_up_stops_the_master_cleanly(sig) -> None:
    """A stop signal while the master is still starting (here: while it maps a 2 GiB
    master segment) is neither lost (SIGINT was ignored until a second one) nor fatal
    (SIGTERM killed it and left the segment file): start-up finishes, the master drains,
    exits 0 and removes its file."""
    size = 2 << 30
    shm = "/dev/shm"
    before = set(os.listdir(shm))
    proc = subprocess.Popen([sys.executable, "-m", "kvmaster", "master", "--port", "0",
                             "--metrics-port", "-1", "--master-segment-size", str(size)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ours: list[str] = []
        deadline = time.monotonic() + 60
        while not ours and time.monotonic() < deadline and proc.poll() is None:
            for name in set(os.listdir(shm)) - before:
                try:
                    if name.startswith("kvmaster-") and os.stat(f"{shm}/{name}").st_size == size:
                        ours.append(name)  # created and sized: the master is mapping it
                except FileNotFoundError:
                    pass
            time.sleep(0.002)
        assert ours, "the master segment never appeared"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert "listening on" in out
    assert not os.path.exists(f"{shm}/{ours[0]}"), "the master segment file was left behind"


@pytest.mark.parametrize("flags", [["--ipc-path", "/nonexistent-dir/kvmaster.sock"],
                                   ["--ipc-path", "*"],
                                   ["--ipc-path", __file__],
                                   ["--host", "192.0.2.1"]],
                         ids=["ipc-no-such-dir", "ipc-wildcard", "ipc-path-is-a-regular-file",
                              "tcp-address-not-here"])
def test_bind_failure_is_one_line_and_status_2(flags: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "kvmaster", "master", "--port", "0",
                        "--metrics-port", "-1", *flags], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvmaster master: cannot bind "), r.stderr


def test_ipc_path_of_a_live_master_is_refused_and_a_stale_one_reused(start_master,
                                                                     tmp_path) -> None:
    path = tmp_path / "master.sock"
    first = start_master("--ipc-path", str(path))
    r = subprocess.run([sys.executable, "-m", "kvmaster", "master", "--port", "0",
                        "--metrics-port", "-1", "--ipc-path", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "another process is listening" in r.stderr, r.stderr
    c = Client()
    c.setup(f"ipc://{path}", 1 << 20)  # still the first master's
    try:
        c.put("k", b"v")
    finally:
        c.close()
    first.kill()  # SIGKILL: the socket file stays behind
    assert path.is_socket()
    second = start_master("--ipc-path", str(path))
    c = Client()
    c.setup(f"ipc://{path}", 0)
    try:
        assert not c.is_exist("k")  # a fresh master
    finally:
        c.close()
    assert second.stop() == 0
    assert not path.exists()


def test_ipc_abstract_name_serves_and_leaves_no_file(start_master) -> None:
    name = f"@kvmaster-test-{os.getpid()}"
    m = start_master("--ipc-path", name)
    c = Client()
    c.setup(f"ipc://{name}", 1 << 20)
    try:
        c.put("k", b"abstract")
        assert c.get("k") == b"abstract"
    finally:
        c.close()
    assert m.stop() == 0


def test_segment_tag_names_this_run_s_files(monkeypatch) -> None:
    from kvmaster._segment import SEGMENT_TAG_ENV, new_segment_name

    monkeypatch.setenv(SEGMENT_TAG_ENV, "blue_2")
    name = new_segment_name()
    assert name.startswith("kvmaster-blue_2-") and len(name) == len("kvmaster-blue_2-") + 16
    monkeypatch.setenv(SEGMENT_TAG_ENV, "Bad/Tag")
    with pytest.raises(ValueError, match="KVMASTER_SEGMENT_TAG"):
        new_segment_name()
    monkeypatch.delenv(SEGMENT_TAG_ENV)
    assert len(new_segment_name()) == len("kvmaster-") + 16
    r = subprocess.run([sys.executable, "-m", "kvmaster", "master", "--port", "0",
                        "--metrics-port", "-1", "--master-segment-size", str(16 << 20)],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **{SEGMENT_TAG_ENV: "blue-green"}))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().startswith("kvmaster master: KVMASTER_SEGMENT_TAG='blue-green'"), r.stderr


SETUP_FAILS = textwrap.dedent("""
    import os, sys
    from kvmaster import Client, ClientConfig, InvalidParams
    try:
        Client(ClientConfig(connect_timeout_s=1)).setup(sys.argv[1], int(sys.argv[2]))
    except InvalidParams as exc:
        print("InvalidParams", exc)
    except Exception as exc:
        print(type(exc).__name__, exc)
""")


@pytest.mark.parametrize("addr,size,tag,want", [
    ("tcp://127.0.0.1:abc", 0, "", ""),            # connect refuses the address
    ("127.0.0.1:1", 1 << 20, "Bad-Tag", "InvalidParams"),
], ids=["bad-address", "bad-segment-tag"])
def test_setup_that_fails_half_way_raises_instead_of_hanging(addr, size, tag, want) -> None:
    # A DEALER whose connect failed was left open, and close()'s context term()
    # waited for it for ever.
    env = dict(os.environ)
    if tag:
        env["KVMASTER_SEGMENT_TAG"] = tag
    try:
        out = subprocess.run([sys.executable, "-c", SETUP_FAILS, addr, str(size)], env=env,
                             capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("setup hung instead of raising")
    assert out.stdout.strip(), out.stderr[-2000:]
    if want:
        assert out.stdout.startswith(want) and "KVMASTER_SEGMENT_TAG" in out.stdout, out.stdout


def test_gc_tuning_sets_the_threshold_and_zero_leaves_python_s_settings() -> None:
    """``tune_gc`` (run by ``kvmaster master`` and each shard process, not by
    ``run_master``) sets the youngest generation's threshold and freezes what start-up
    left; 0 leaves Python's settings alone, freezing nothing."""
    code = textwrap.dedent("""
        import gc, sys
        from kvmaster._process import tune_gc
        before = gc.get_threshold()
        tune_gc(0)
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
        tune_gc(12345)
        assert gc.get_threshold() == (12345, *before[1:]), gc.get_threshold()
        assert gc.get_freeze_count() > 0
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
