"""kvmaster._frames: the lean multipart helpers keep pyzmq's semantics."""

from __future__ import annotations

import time

import pytest
import zmq

from kvmaster._frames import NOBLOCK, readable, recv_frames, send_frames


@pytest.fixture
def pair():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


def _wait_readable(sock: zmq.Socket) -> None:
    deadline = time.monotonic() + 5
    while not readable(sock):
        assert time.monotonic() < deadline, "message never arrived"
        sock.poll(50)


def test_round_trip_keeps_frames_and_boundaries(pair) -> None:
    router, dealer = pair
    assert not readable(router)
    send_frames(dealer, (b"\x01", b"", b"x" * 70_000))
    send_frames(dealer, [b"only"])
    _wait_readable(router)
    first = recv_frames(router, NOBLOCK)
    identity = first[0]
    assert first[1:] == [b"\x01", b"", b"x" * 70_000]
    assert recv_frames(router) == [identity, b"only"]
    send_frames(router, (identity, b"a", b"b"), NOBLOCK)
    _wait_readable(dealer)
    assert recv_frames(dealer) == [b"a", b"b"]


def test_empty_socket_raises_again_like_pyzmq(pair) -> None:
    router, dealer = pair
    with pytest.raises(zmq.Again):
        recv_frames(router, NOBLOCK)
    dealer.setsockopt(zmq.RCVTIMEO, 20)
    with pytest.raises(zmq.Again):
        recv_frames(dealer)


def test_unroutable_identity_raises_with_router_mandatory(pair) -> None:
    router, _ = pair
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    with pytest.raises(zmq.ZMQError):
        send_frames(router, (b"nobody", b"x"), NOBLOCK)


def test_send_frames_rejects_a_bad_frame_before_sending_any() -> None:
    # As send_multipart: a half-sent message would swallow the next one.
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        with pytest.raises(TypeError):
            send_frames(dealer, (b"op", "not bytes", b"payload"))
        send_frames(dealer, (b"next", b"message"))
        router.setsockopt(zmq.RCVTIMEO, 5000)
        frames = recv_frames(router)
        assert frames[1:] == [b"next", b"message"]
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_interrupted_send_ends_the_message_it_left_open(pair, monkeypatch) -> None:
    """pyzmq runs Python signal handlers after queuing each frame; a handler that
    raises (KeyboardInterrupt) used to leave the message open, and the next request's
    frames were glued onto it.  send_frames now ends it with an empty frame."""
    import kvmaster._frames as F

    router, dealer = pair
    real = F._send
    calls = {"n": 0}

    def interrupted(sock, frame, flags):
        real(sock, frame, flags)  # the frame is queued, then the "handler" raises
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(F, "_send", interrupted)
    with pytest.raises(KeyboardInterrupt):
        send_frames(dealer, (b"op", b"route", b"payload"))
    monkeypatch.setattr(F, "_send", real)
    send_frames(dealer, (b"op2", b"route2", b"payload2"))
    _wait_readable(router)
    broken = recv_frames(router, NOBLOCK)
    assert broken[1:] == [b"op", b"route", b""]  # ended early: refused as malformed
    _wait_readable(router)
    assert recv_frames(router, NOBLOCK)[1:] == [b"op2", b"route2", b"payload2"]


@pytest.mark.parametrize("head", [b"r", b"r\x00\x07"], ids=["to a shard", "from a shard"])
@pytest.mark.parametrize("identity", [b"", b"id-1", b"x" * 255])
def test_shard_process_envelopes_round_trip(head: bytes, identity: bytes) -> None:
    """kvmaster._shardproc's one-frame envelope: what the front or a shard process
    packs, the other side unpacks, for every identity length that fits."""
    from kvmaster._shardproc import fits_envelope, pack_envelope, unpack_envelope

    assert fits_envelope(identity, b"\x11") and not fits_envelope(b"x" * 256, b"\x11")
    for group in (0, 1, (1 << 64) - 1):
        frame = pack_envelope(head, group, identity, b"\x11", b"\x92\x05\xa1k")
        assert frame[:len(head)] == head
        assert unpack_envelope(frame, len(head)) == (identity, b"\x11", b"\x92\x05\xa1k", group)
