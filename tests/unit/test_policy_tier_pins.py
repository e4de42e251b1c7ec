"""policy.tier_pins: which protected sessions the offload tier pins."""

from __future__ import annotations

from policy import PinCandidate, pin_budget, plan_pins


def test_budget_is_the_share_of_the_capacity() -> None:
    assert pin_budget(25, 0.5) == 12
    assert pin_budget(25, 1.0) == 25
    assert pin_budget(25, 0.0) == 0
    assert pin_budget(0, 0.5) == 0


def test_soonest_protection_end_first_and_what_does_not_fit_is_skipped() -> None:
    cands = [
        PinCandidate("late", 4, next_use_s=300),
        PinCandidate("soon-big", 9, next_use_s=10),
        PinCandidate("soon-small", 3, next_use_s=20),
        PinCandidate("mid-big", 5, next_use_s=60),
    ]
    # budget 12: soon-big (9), soon-small (3) fill it; mid-big and late do not fit
    assert plan_pins(cands, 25, 0.5) == ["soon-big", "soon-small"]
    # budget 15: mid-big (5) does not fit after 12, the smaller late one (4) still does not
    assert plan_pins(cands, 30, 0.5) == ["soon-big", "soon-small"]
    assert plan_pins(cands, 32, 0.5) == ["soon-big", "soon-small", "late"]  # 16: late fits


def test_ties_keep_what_is_pinned_then_prefer_larger() -> None:
    a = PinCandidate("a", 6, next_use_s=30)
    b = PinCandidate("b", 6, next_use_s=30, pinned=True)
    assert plan_pins([a, b], 12, 0.5) == ["b"]  # no churn between equals
    c = PinCandidate("c", 2, next_use_s=30)
    assert plan_pins([c, a], 16, 0.5) == ["a", "c"]


def test_sessions_without_a_complete_chunk_are_never_pinned() -> None:
    assert plan_pins([PinCandidate("tiny", 0, next_use_s=1)], 100, 1.0) == []


def test_the_pin_ledger_record_round_trips() -> None:
    from proxy.tiers import _Pin, decode_pin, encode_pin

    pin = _Pin(1764650000.25, [0, 1, 2**32 - 1, 49_000], "tenant-salt", 3, 768)
    assert decode_pin(encode_pin(pin)) == pin
    unsalted = _Pin(1.0, list(range(600)), None, 2, 0)
    assert decode_pin(encode_pin(unsalted)) == unsalted
    assert decode_pin(b"not json\n\x00\x00") is None
    assert decode_pin(b'{"version": 1}\n') is None  # fields missing
