from __future__ import annotations

from policy.admission import PRIORITY_EPOCH_S, admission_priority


def test_priority_is_the_send_time_in_ms_plus_a_slack_per_uncached_token() -> None:
    t = PRIORITY_EPOCH_S + 100.0
    assert admission_priority(t, 0, 100.0) == 100_000
    assert admission_priority(t, 2_000, 100.0) == 100_200  # 2K tokens: 200 ms of slack
    assert admission_priority(t, -5, 100.0) == 100_000  # an estimate below zero is zero


def test_a_resident_request_passes_a_cold_one_sent_shortly_before_but_not_long_before() -> None:
    t = PRIORITY_EPOCH_S + 1_000.0
    cold = admission_priority(t, 60_000, 10.0)  # 600 ms of slack
    assert admission_priority(t + 0.5, 500, 10.0) < cold
    assert admission_priority(t + 0.7, 500, 10.0) > cold  # sent too late to pass it
    assert admission_priority(t + 5.0, 0, 10.0) > admission_priority(t, 60_000, 0.0)


def test_a_resident_credit_moves_a_partly_resident_request_ahead_of_a_cold_one() -> None:
    t = PRIORITY_EPOCH_S + 10.0
    cold = admission_priority(t, 60_000, 10.0, resident_tokens=0, credit_ms_per_ktok=10.0)
    partly = admission_priority(t, 50_000, 10.0, resident_tokens=40_000, credit_ms_per_ktok=10.0)
    assert partly == admission_priority(t, 10_000, 10.0) < cold
    assert admission_priority(t, 50_000, 10.0, resident_tokens=40_000) == admission_priority(
        t, 50_000, 10.0
    )  # no credit asked: the resident part does not count
