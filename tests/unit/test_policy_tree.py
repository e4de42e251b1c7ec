"""Parent/child rules: protection of ended parents, free order, releasable blocks."""

from __future__ import annotations

import pytest

from policy.tree import (
    TreeNode,
    children_index,
    free_order,
    post_order,
    protection_deadlines,
    releasable_blocks,
    release_on_end,
)


def tree() -> dict[str, TreeNode]:
    nodes = [
        TreeNode("R", None, live=False, ttl_until=500.0),
        TreeNode("A", "R", live=True, ttl_until=300.0),
        TreeNode("B", "R", live=False, ttl_until=400.0),
        TreeNode("A1", "A", live=True, ttl_until=800.0),
        TreeNode("B1", "B", live=False, ttl_until=900.0),
    ]
    return {n.session_id: n for n in nodes}


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        # R ended but A/A1 are live: protected up to min(own 500, latest live 800).
        (100.0, {"R": 500.0, "A": 300.0, "A1": 800.0}),
        (450.0, {"R": 500.0, "A1": 800.0}),
        (600.0, {"A1": 800.0}),
        (900.0, {}),
    ],
)
def test_protection_deadlines(now: float, expected: dict[str, float]) -> None:
    assert protection_deadlines(tree(), now) == expected


def test_ended_parent_bounded_by_live_children_deadline() -> None:
    nodes = {
        "P": TreeNode("P", None, live=False, ttl_until=1000.0),
        "C": TreeNode("C", "P", live=True, ttl_until=200.0),
    }
    assert protection_deadlines(nodes, 100.0) == {"P": 200.0, "C": 200.0}


def test_free_order_is_children_first_post_order() -> None:
    assert free_order(tree(), "R") == ["A1", "A", "B1", "B", "R"]
    assert post_order(tree(), "B") == ["B1", "B"]
    assert free_order(tree(), "missing") == []
    assert children_index(tree()) == {"R": ["A", "B"], "A": ["A1"], "B": ["B1"]}


def test_cycles_and_deep_chains_are_safe() -> None:
    cyc = {
        "X": TreeNode("X", "Y", live=True, ttl_until=50.0),
        "Y": TreeNode("Y", "X", live=False, ttl_until=70.0),
    }
    assert post_order(cyc, "X") == ["Y", "X"]
    assert protection_deadlines(cyc, 0.0)["X"] == 50.0  # bad input: answered, not looping
    chain = {
        f"n{i}": TreeNode(f"n{i}", f"n{i - 1}" if i else None, live=i == 9999, ttl_until=10.0)
        for i in range(10000)
    }
    order = post_order(chain, "n0")
    assert order[0] == "n9999"
    assert order[-1] == "n0"
    assert len(protection_deadlines(chain, 0.0)) == 10000


@pytest.mark.parametrize(
    ("ended", "held", "expected"),
    [
        ((1, 2, 3, 3, 4), [(2,), (4, 5)], (1, 3)),
        ((1, 2), [], (1, 2)),
        ((1, 2), [(1, 2)], ()),
        ((), [(1,)], ()),
    ],
)
def test_releasable_blocks(
    ended: tuple[int, ...], held: list[tuple[int, ...]], expected: tuple[int, ...]
) -> None:
    assert releasable_blocks(ended, held) == expected


def family(p_live: bool, c1_live: bool) -> dict[str, TreeNode]:
    nodes = [
        TreeNode("P", None, p_live, 1000.0, (1, 2, 3)),
        TreeNode("C1", "P", c1_live, 1000.0, (1, 2, 3, 4, 5)),
        TreeNode("C2", "P", True, 1000.0, (1, 2, 3, 6, 7)),
    ]
    return {n.session_id: n for n in nodes}


@pytest.mark.parametrize(
    ("p_live", "c1_live", "ended", "expected"),
    [
        (True, True, "C2", (6, 7)),  # shared prefix stays with the parent and sibling
        (False, True, "C2", (6, 7)),  # ended parent still protected by live C1
        (False, False, "C2", (1, 2, 3, 6, 7)),  # last one out: nothing else holds the prefix
        (False, True, "P", ()),  # parent stays protected while a child is live
        (True, True, "missing", ()),
    ],
)
def test_release_on_end(p_live: bool, c1_live: bool, ended: str, expected: tuple[int, ...]) -> None:
    assert release_on_end(family(p_live, c1_live), ended, now=0.0) == expected
