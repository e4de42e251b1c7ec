from __future__ import annotations

from policy.admission import PRIORITY_EPOCH_S, admission_priority, admission_slack_ms


def _due(t: float, uncached: float, per_ktok: float) -> int:
    return admission_priority(t, admission_slack_ms(uncached, per_ktok))


def test_priority_is_the_send_time_in_ms_plus_a_slack_per_uncached_token() -> None:
    t = PRIORITY_EPOCH_S + 100.0
    assert _due(t, 0, 100.0) == 100_000
    assert _due(t, 2_000, 100.0) == 100_200  # 2K tokens: 200 ms of slack
    assert _due(t, -5, 100.0) == 100_000  # an estimate below zero is zero


def test_a_resident_request_passes_a_cold_one_sent_shortly_before_but_not_long_before() -> None:
    t = PRIORITY_EPOCH_S + 1_000.0
    cold = _due(t, 60_000, 10.0)  # 600 ms of slack
    assert _due(t + 0.5, 500, 10.0) < cold
    assert _due(t + 0.7, 500, 10.0) > cold  # sent too late to pass it
    assert _due(t + 5.0, 0, 10.0) > _due(t, 60_000, 0.0)
