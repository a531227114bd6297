"""The restart policy of the server's child processes (mmserve.server.restart_policy): exponential backoff,
a reset after a healthy run, and giving up on a crash loop."""

from __future__ import annotations

import pytest

from mmserve.server.restart_policy import RestartBackoff, RestartPolicy


def test_delays_double_up_to_the_cap_while_the_child_keeps_dying_slowly():
    backoff = RestartBackoff(RestartPolicy())
    delays = []
    now = 0.0
    for _ in range(10):  # one exit every 25 s, each after a short healthy run: never 5 within 60 s
        delays.append(backoff.exited(now))
        backoff.healthy(now + 5)
        now += 25
    assert delays == [0.5, 1, 2, 4, 8, 16, 30, 30, 30, 30]


def test_a_long_healthy_run_starts_the_backoff_over():
    backoff = RestartBackoff(RestartPolicy())
    assert [backoff.exited(t) for t in (0, 20, 40)] == [0.5, 1, 2]
    backoff.healthy(41)
    assert backoff.exited(41 + 60) == 0.5  # healthy for the whole window: a new story
    backoff.healthy(102)
    assert backoff.exited(110) == 1  # healthy for 8 s only: the same story goes on


def test_a_crash_loop_is_given_up_and_only_a_crash_loop():
    backoff = RestartBackoff(RestartPolicy(max_exits=5, window_s=60))
    assert [backoff.exited(t) for t in (0, 1, 3, 6)] == [0.5, 1, 2, 4]
    assert backoff.exited(11) is None  # the fifth exit within 60 s
    spread = RestartBackoff(RestartPolicy(max_exits=5, window_s=60))
    assert None not in [spread.exited(t) for t in range(0, 400, 16)]  # at most 4 exits in any 60 s


def test_a_policy_that_cannot_work_is_refused():
    for bad in ({"first_delay_s": 0}, {"first_delay_s": 60, "max_delay_s": 30}, {"max_exits": 0}):
        with pytest.raises(ValueError):
            RestartPolicy(**bad)
