"""policy.due: the due sessions are a prefix of the due order; walking them is all it costs."""

from __future__ import annotations

import random

from policy.due import DueOrder


def test_due_walks_only_the_due_prefix_however_many_idle_keys_there_are() -> None:
    examined = []
    for n in (100, 1_000, 10_000):
        order: DueOrder[str] = DueOrder()
        for i in range(n):  # idle: last active at 1,000 s plus up to 100 s
            order.set(f"idle{i}", 1_000.0 + random.random() * 100)
        for i in range(3):  # three came due
            order.set(f"due{i}", 10.0 + i)
        assert order.due(lambda pos: pos + 500.0 <= 600.0) == ["due0", "due1", "due2"]
        examined.append(order.examined)
        assert len(order) == n + 3
    assert examined == [4, 4, 4]  # the due ones and the first one not due


def test_moved_dropped_and_re_added_keys_are_reported_once_at_their_position() -> None:
    order: DueOrder[str] = DueOrder()
    order.set("a", 1.0)
    order.set("b", 2.0)
    order.set("c", 3.0)
    order.set("a", 10.0)  # touched: no longer due
    order.discard("b")
    order.set("b", 2.0)  # dropped and back at the same position: one entry still
    order.discard("c")
    assert order.due(lambda pos: pos <= 5.0) == ["b"]
    assert order.due(lambda pos: pos <= 5.0) == ["b"]  # due() leaves the order as it was
    assert order.due(lambda pos: True) == ["b", "a"]
    assert "c" not in order and len(order) == 2


def test_compaction_keeps_the_order() -> None:
    order: DueOrder[int] = DueOrder()
    for round_ in range(5):
        for k in range(1_000):
            order.set(k, float(round_ * 1_000 + (k * 7919) % 1_000))
    assert len(order._heap) <= 2 * len(order) + 1024
    due = order.due(lambda pos: pos < 4_010.0)
    assert due == sorted(due, key=lambda k: (k * 7919) % 1_000) and len(due) == 10
