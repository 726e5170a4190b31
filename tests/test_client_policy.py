"""The clients' retry and round policy (kvmaster/_client/policy.py), on a fake clock:
no master, no socket, no sleeping."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvmaster import errors as E
from kvmaster._client import policy
from kvmaster._client.policy import Clock, HelloPlan, RoundPlan
from kvmaster._client.records import (
    BUSY_FIRST_PAUSE_S,
    BUSY_MAX_PAUSE_S,
    PARTING_RETRY_S,
    SPACE_OPS,
    Tolerant,
)
from kvmaster._client.sync_tasks import PartingQueue
from kvmaster.protocol import Op, Status


@pytest.fixture(autouse=True)
def no_leaked_segments() -> None:
    """Overrides the conftest fixture: nothing here creates shared memory."""


class FakeClock(Clock):
    """A clock that moves only when told; the jitter is the longest pause."""

    __slots__ = ("t",)

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def jitter(self, pause: float) -> float:
        return pause


class FakeCore:
    """What the policy reads of a client."""

    def __init__(self, *, ha: bool = False, timeout_s: float = 2.0, trust: float | None = None,
                 connect_timeout_s: float = 5.0) -> None:
        self.ha = ha
        self.config = SimpleNamespace(timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
        self.endpoint = "tcp://test:1"
        self.layout: tuple[Any, ...] | None = (4, 7, False, False)
        self.trust = trust
        self._generation = 1
        self.welcome: Any = object()
        self._master_instance: str | None = "m1"

    def _routing(self) -> Any:
        return self.layout

    def _trust(self, reqs: list[Any]) -> float | None:
        return self.trust if any(op in SPACE_OPS for op, _, _ in reqs) else None

    def _stale(self, trust: float) -> E.Timeout:
        return E.Timeout(f"late ({trust})", endpoint=self.endpoint)

    def _check_routing(self, before: Any) -> None:
        if self.layout != before:
            raise E.ConnectionLost("layout", endpoint=self.endpoint)

    def _hello_gave_up(self, exc: BaseException, started: float) -> BaseException:
        return E.Timeout(f"gave up after {started}", op="HELLO", endpoint=self.endpoint)


PUT = [(Op.PUT_START.value, b"r", [])]
EXIST = [(Op.EXIST_KEY.value, b"r", [])]


def test_a_round_keeps_a_failover_reserve_only_with_ha() -> None:
    clock = FakeClock()
    assert RoundPlan(FakeCore(), EXIST, clock.t + 2.0, clock).wait == clock.t + 2.0
    ha = RoundPlan(FakeCore(ha=True), EXIST, clock.t + 2.0, clock)
    assert ha.wait == pytest.approx(clock.t + 1.5)  # a quarter of the timeout
    long = RoundPlan(FakeCore(ha=True, timeout_s=10.0), EXIST, clock.t + 10.0, clock)
    assert long.wait == pytest.approx(clock.t + 9.0)  # at most HA_ATTEMPT_S
    late = RoundPlan(FakeCore(ha=True), EXIST, clock.t + 0.1, clock)
    assert late.wait == clock.t + 0.1  # no room left for one: the whole deadline


def test_a_late_reply_giving_out_space_is_not_trusted() -> None:
    clock = FakeClock()
    core = FakeCore(ha=True, trust=0.5)
    assert RoundPlan(core, EXIST, clock.t + 2, clock).phases is None  # no space: no limit
    plan = RoundPlan(core, PUT, clock.t + 2, clock)
    assert plan.phases == [] and not plan.trusted()  # no phase timed: nothing to trust
    plan.phases.append(0.4)
    assert plan.trusted()
    plan.phases.append(0.6)
    assert not plan.trusted()
    assert plan.still_leads([0.1]) and not plan.still_leads([0.7])
    assert not plan.still_leads([0.1], lambda: True)  # the link closed meanwhile
    core._generation += 1  # reconnected meanwhile: another connection proves nothing
    assert not plan.still_leads([0.1])
    plan.again()
    plan.phases.append(0.6)  # type: ignore[union-attr]
    with pytest.raises(E.Timeout, match="late"):
        plan.check_again()


def test_which_failures_a_rehandshake_mends() -> None:
    clock = FakeClock()
    plain = RoundPlan(FakeCore(), EXIST, clock.t + 2, clock)
    ha = RoundPlan(FakeCore(ha=True), Tolerant(EXIST), clock.t + 2, clock)
    assert ha.tolerant and not plain.tolerant
    registered = E.error_for(Status.NOT_REGISTERED, "who?")
    stopping = E.error_for(Status.SHUTTING_DOWN, "bye")
    silent = E.Timeout("no reply")
    for plan in (plain, ha):
        assert plan.mended_by_rehandshake(registered)
        assert not plan.mended_by_rehandshake(E.InvalidParams("no"))
    assert not plain.mended_by_rehandshake(stopping) and ha.mended_by_rehandshake(stopping)
    assert not plain.mended_by_rehandshake(silent) and ha.mended_by_rehandshake(silent)
    assert not ha.mended_by_rehandshake(silent, may_wait=False)  # the lock was lost
    clock.t += 2
    assert not ha.mended_by_rehandshake(silent)  # past the deadline
    assert ha.mended_by_rehandshake(registered)


def test_a_round_sent_again_needs_its_layout() -> None:
    core = FakeCore()
    plan = RoundPlan(core, EXIST, 102.0, FakeClock())
    plan.again()
    core.layout = (8, 7, False, False)
    with pytest.raises(E.ConnectionLost):
        plan.again()


def test_a_resend_after_a_busy_pause_goes_only_to_the_same_master() -> None:
    core = FakeCore()
    old, new = object(), object()
    layout = core._routing()
    assert policy.resend_allowed(core, layout, "m1", old, old) is old
    assert policy.resend_allowed(core, layout, "m1", old, new) is new
    with pytest.raises(E.ConnectionLost, match="closed"):
        policy.resend_allowed(core, layout, "m1", old, None)
    core._master_instance = "m2"
    with pytest.raises(E.ConnectionLost, match="master changed"):
        policy.resend_allowed(core, layout, "m1", old, new)
    core.welcome = None
    with pytest.raises(E.ConnectionLost, match="lost"):
        policy.resend_allowed(core, layout, "m1", old, new)


def test_busy_pauses_double_up_to_their_cap() -> None:
    pauses = [BUSY_FIRST_PAUSE_S]
    while pauses[-1] < BUSY_MAX_PAUSE_S:
        pauses.append(policy.next_pause(pauses[-1]))
    assert pauses[:3] == [0.001, 0.002, 0.004]
    assert policy.next_pause(pauses[-1]) == BUSY_MAX_PAUSE_S


def test_a_revoke_is_tried_again_until_its_time_is_up() -> None:
    clock = FakeClock(0.0)
    assert policy.part_again(0.0, 0.001, 1.0, clock) == (1.001, 0.002)
    assert policy.part_again(0.0, 0.05, PARTING_RETRY_S - 0.01, clock) is None
    parts = PartingQueue(clock)
    req = (Op.PUT_REVOKE.value, b"r", [])
    parts.sent[7] = (req, 0.0, 0.001, 0.5)
    parts.reply(7, Status.NOT_REGISTERED)  # waits for the next WELCOME
    assert 7 in parts.sent and not parts.queue
    parts.reply(7, Status.BUSY)
    assert list(parts.queue) == [(0.501, req, 0.0, 0.002)] and not parts.sent
    parts.sent[8] = (req, 0.0, 0.002, 1.0)
    clock.t = 2.0
    parts.new_connection(same_master=True)
    assert list(parts.queue)[-1] == (2.0, req, 0.0, 0.002)
    parts.new_connection(same_master=False)
    assert not parts


def test_an_ha_connect_tries_short_attempts_until_its_end() -> None:
    clock = FakeClock(0.0)
    plan = HelloPlan(FakeCore(ha=True, connect_timeout_s=3.0), None, clock)
    assert plan.attempt() == 1.0
    assert plan.pause(E.Timeout("x", op="HELLO")) == 0.05
    clock.t = 2.5
    assert plan.attempt() == pytest.approx(0.5)
    clock.t = 2.96
    with pytest.raises(E.Timeout, match="gave up after 0.0"):
        plan.pause(E.Timeout("x", op="HELLO"))
    cut = HelloPlan(FakeCore(ha=True), 1.5, FakeClock(1.0))
    assert cut.left() == pytest.approx(0.5)  # the call's deadline comes first


def test_the_heartbeat_paces_itself_by_the_client_ttl() -> None:
    assert policy.beat_interval(None) == 1.0
    assert policy.beat_interval(SimpleNamespace(client_ttl_ms=3000)) == pytest.approx(
        3.0 / policy.P.HEARTBEAT_LIVENESS)
    assert policy.beat_timeout(10.0, 0.2) == 0.5 and policy.beat_timeout(0.3, 2.0) == 0.3
    assert policy.beat_backoff(0.1, 5.0) == 0.2 and policy.beat_backoff(4.0, 5.0) == 5.0
