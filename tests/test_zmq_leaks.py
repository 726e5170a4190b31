"""The leak check every test runs under (``tests/support.py`` ``ZmqLeaks``): it fails
on a context left open and on a context or socket dropped unclosed, and passes clean
code and contexts that were open before."""

from __future__ import annotations

import gc
import warnings

import pytest
import zmq

from tests.support import ZMQ


def test_a_context_left_open_fails_and_is_destroyed() -> None:
    kept = []
    with pytest.raises(AssertionError, match="context left open"):
        with ZMQ.watch(grace_s=0.1):
            ctx = zmq.Context()
            kept += [ctx, ctx.socket(zmq.DEALER)]
    assert kept[0].closed


def test_a_socket_dropped_unclosed_fails() -> None:
    ctx = zmq.Context()
    try:
        with pytest.raises(AssertionError, match="socket dropped unclosed"):
            with ZMQ.watch(grace_s=0.1), warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                sock = ctx.socket(zmq.PAIR)
                del sock
                gc.collect()
    finally:
        ctx.destroy(linger=0)


def test_closed_resources_and_older_contexts_pass() -> None:
    older = zmq.Context()
    try:
        with ZMQ.watch(grace_s=0.1):
            older.socket(zmq.DEALER).close()
            with zmq.Context() as ctx:
                ctx.socket(zmq.ROUTER).close(linger=0)
    finally:
        older.term()
