"""Parent/child session rules: protection of parents, free-tree order, releasable blocks.

- A live session is protected until its own ``ttl_until``. A session that has ended stays
  protected while any descendant is live (children share its prefix), but never beyond its own
  TTL nor beyond the latest deadline among its live descendants.
- Freeing a tree goes children before parents, depth-first post-order, siblings by id, so a
  parent's shared prefix is released last.
- When a session ends, only its blocks that no other still-held session uses may be released;
  shared blocks stay.

Pure: ``now`` is an argument; cycles in bad input are tolerated (each node visited once).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TreeNode:
    """One session of a tree: ``live`` = not ended yet; ``block_ids`` = its prefix's blocks."""

    session_id: str
    parent_id: str | None
    live: bool
    ttl_until: float
    block_ids: tuple[int, ...] = ()


def children_index(nodes: Mapping[str, TreeNode]) -> dict[str, list[str]]:
    """parent id -> its children's ids (sorted), for parents present in ``nodes``."""
    index: dict[str, list[str]] = {}
    for node in nodes.values():
        if node.parent_id is not None and node.parent_id in nodes:
            index.setdefault(node.parent_id, []).append(node.session_id)
    for kids in index.values():
        kids.sort()
    return index


def post_order(nodes: Mapping[str, TreeNode], root_id: str) -> list[str]:
    """Depth-first post-order from ``root_id``: every child before its parent (iterative)."""
    if root_id not in nodes:
        return []
    kids = children_index(nodes)
    order: list[str] = []
    seen = {root_id}
    stack: list[tuple[str, int]] = [(root_id, 0)]
    while stack:
        sid, i = stack[-1]
        children = kids.get(sid, [])
        while i < len(children) and children[i] in seen:
            i += 1
        if i < len(children):
            stack[-1] = (sid, i + 1)
            seen.add(children[i])
            stack.append((children[i], 0))
        else:
            stack.pop()
            order.append(sid)
    return order


def free_order(nodes: Mapping[str, TreeNode], root_id: str) -> list[str]:
    """The order in which to free the tree rooted at ``root_id`` (children first)."""
    return post_order(nodes, root_id)


def protection_deadlines(nodes: Mapping[str, TreeNode], now: float) -> dict[str, float]:
    """session id -> protected-until, for every session protected at ``now`` (module rules).

    O(n): one post-order pass per root computes each subtree's latest live deadline.
    """
    kids = children_index(nodes)
    live_until: dict[str, float] = {}  # latest deadline of live sessions in the subtree
    roots = [n.session_id for n in nodes.values() if n.parent_id not in nodes]
    visited: set[str] = set()
    for root in sorted(roots) + sorted(nodes):  # the second pass catches cycles without roots
        if root in visited:
            continue
        for sid in post_order(nodes, root):
            visited.add(sid)
            node = nodes[sid]
            own = node.ttl_until if node.live else float("-inf")
            below = max((live_until.get(k, float("-inf")) for k in kids.get(sid, [])), default=own)
            live_until[sid] = max(own, below)
    deadlines: dict[str, float] = {}
    for sid, node in nodes.items():
        until = node.ttl_until if node.live else min(node.ttl_until, live_until[sid])
        if until > now:
            deadlines[sid] = until
    return deadlines


def releasable_blocks(
    ended_blocks: Sequence[int], held: Iterable[Sequence[int]]
) -> tuple[int, ...]:
    """Blocks of an ended session that no held session uses, in order, each once."""
    still_held: set[int] = set()
    for blocks in held:
        still_held.update(blocks)
    out: list[int] = []
    for b in ended_blocks:
        if b not in still_held:
            still_held.add(b)  # also dedupes repeats within the ended session
            out.append(b)
    return tuple(out)


def release_on_end(nodes: Mapping[str, TreeNode], ended_id: str, now: float) -> tuple[int, ...]:
    """Blocks freed when ``ended_id`` ends: those not used by any session still protected.

    Nothing is freed while the ended session itself stays protected (a live descendant holds
    it); it is then released later, through the same call or :func:`free_order`. ``nodes``
    should hold the ended session's tree (or every live session, to also respect prefixes
    shared across trees). The ended node itself may be given as live or not.
    """
    ended = nodes.get(ended_id)
    if ended is None:
        return ()
    as_ended = TreeNode(ended_id, ended.parent_id, False, ended.ttl_until, ended.block_ids)
    marked = {**nodes, ended_id: as_ended}
    protected = protection_deadlines(marked, now)
    if ended_id in protected:
        return ()
    held = (marked[sid].block_ids for sid in protected if sid != ended_id)
    return releasable_blocks(ended.block_ids, held)
