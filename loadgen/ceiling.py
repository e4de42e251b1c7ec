"""Cache ceilings of a workload: the prefix-hit rate an engine could reach at best.

The workload is played offline (no engine): each call occupies the server for its recorded
``api_time`` (traces) or a service-time model, sessions keep their think times, sub-agents run
as in the runner. Prompts become chains of ``block_tokens`` blocks (a block is named by its
whole prefix, as in vLLM). A shared cache of ``C`` blocks is then replayed under

* ``inf``: an infinite cache, the physical ceiling;
* ``lru``: vLLM's policy: blocks of running requests are pinned; a finished request's blocks
  join the free queue tail, its last block first; eviction takes the queue head;
* ``belady``: optimal offline eviction (MIN): evict the free block whose next use is farthest
  in the future (never-used-again first; deepest first among equals, which keeps every cached
  chain prefix-closed).

Hits are prefix hits (leading resident blocks); the rate is hit tokens / prompt tokens over all
calls, sub-agents included. Running requests' blocks that do not fit in ``C`` are computed but
not cached ("no room": lost to every policy).

Arrival models: ``lanes`` (root sessions in a
seeded shuffled order laid end to end on one tape, cut into ``N`` lanes played at once; a
conversation cut by a lane boundary continues in the next lane under fresh private
namespaces), ``slots`` (at most ``N`` root sessions open; the next starts when one ends, like
the runner's ``max_sessions``) and ``open`` (every root at its own start offset). ``C`` is
given as a share of the peak working set ``W`` (the most blocks that are live at once, from
their first arrival to the end of their last use), so with ``C >= W`` Belady equals ``inf``.
"""

from __future__ import annotations

import heapq
import random
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from loadgen.tokens import Piece
from loadgen.workloads.base import SHARED_PREFIX, Call, SessionScript, Spawn, Workload

Arrival = Literal["lanes", "slots", "open"]
Policy = Literal["lru", "belady"]
POLICIES: tuple[Policy, ...] = ("lru", "belady")
_NEVER = 1 << 62


def default_service(call: Call) -> float:
    """Service time of a call without a recorded one: 0.5 s + 20 ms per output token."""
    return call.api_time if call.api_time is not None else 0.5 + 0.02 * call.max_tokens


# --- offline play ------------------------------------------------------------------------------
@dataclass(slots=True)
class TimedCall:
    arrival: float  # relative to the root session's start
    finish: float
    call: Call
    step: int  # index of the root's top-level step this call belongs to


@dataclass(slots=True)
class Timeline:
    """One root session played alone from t=0."""

    start: float  # the root's own start offset
    calls: list[TimedCall]
    step_starts: list[float]
    duration: float


def play(script: SessionScript, service: Callable[[Call], float] = default_service) -> Timeline:
    tl = Timeline(script.start, [], [], 0.0)
    tl.duration = _play(script, 0.0, service, tl, top=True)
    return tl


def _play(
    script: SessionScript, start: float, service: Callable[[Call], float], tl: Timeline, top: bool
) -> float:
    """Schedule one session from ``start`` (same rules as the runner); returns its end."""
    done, join, background_end = start, None, start
    step = len(tl.step_starts) - 1
    for s in script.steps:
        if isinstance(s, Spawn):
            if top:
                tl.step_starts.append(done)
                step += 1
            ends = [_play(c, done + c.start, service, tl, top=False) for c in s.children]
            if s.wait:
                join = max([join if join is not None else done, *ends])
            else:
                background_end = max([background_end, *ends])
            continue
        arrival = done + s.think if s.at is None else max(done, start + s.at)
        if join is not None:
            arrival, join = max(arrival, join), None
        if top:
            tl.step_starts.append(arrival)
            step += 1
        done = arrival + max(service(s), 1e-3)
        tl.calls.append(TimedCall(arrival, done, s, step))
    return max(done, join if join is not None else done, background_end)


# --- block chains --------------------------------------------------------------------------------
class BlockChains:
    """Names every full block of a prompt by its whole prefix, as small integers."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[tuple[Any, ...], int] = {}

    def keys(self, pieces: Iterable[Piece]) -> list[int]:
        size, ids, out = self.block_tokens, self._ids, []
        parent, buf, fill = 0, [], 0
        for ns, bid, n in pieces:
            if fill == 0 and n == size:  # the common case: one logical block = one block
                parent = ids.setdefault((parent, ns, bid), len(ids) + 1)
                out.append(parent)
                continue
            pos = 0
            while pos < n:
                take = min(size - fill, n - pos)
                buf.append((ns, bid, pos, pos + take))
                fill += take
                pos += take
                if fill == size:
                    parent = ids.setdefault((parent, *buf), len(ids) + 1)
                    out.append(parent)
                    buf, fill = [], 0
        return out


# --- replay layout -------------------------------------------------------------------------------
@dataclass(slots=True)
class Req:
    arrival: float
    finish: float
    keys: list[int]
    tokens: int
    seq: int = 0


@dataclass(slots=True)
class Replay:
    reqs: list[Req]  # in arrival order; seq is the index
    block_tokens: int
    cuts: int = 0
    total_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.reqs.sort(key=lambda r: (r.arrival, r.seq))
        for i, r in enumerate(self.reqs):
            r.seq = i
        self.total_tokens = sum(r.tokens for r in self.reqs)


def layout(
    workload: Workload,
    arrival: Arrival,
    n: int = 0,
    *,
    seed: int = 0,
    service: Callable[[Call], float] = default_service,
) -> Replay:
    """Lay the workload's root sessions out in time under an arrival model."""
    chains = BlockChains(workload.block_tokens)
    timelines = [play(s, service) for s in workload.sessions]
    if arrival == "lanes":
        return _lanes(timelines, n, seed, chains)
    starts = _slot_starts(timelines, n) if arrival == "slots" else [t.start for t in timelines]
    reqs = [
        _req(tc, start, chains, None)
        for tl, start in zip(timelines, starts, strict=True)
        for tc in tl.calls
    ]
    return Replay(_numbered(reqs), workload.block_tokens)


def _numbered(reqs: list[Req]) -> list[Req]:
    for i, r in enumerate(reqs):
        r.seq = i
    return reqs


def _req(tc: TimedCall, shift: float, chains: BlockChains, part: int | None) -> Req:
    pieces: Iterable[Piece] = tc.call.pieces()
    if part:
        pieces = (
            (ns if ns.startswith(SHARED_PREFIX) else f"{ns}#{part}", b, k) for ns, b, k in pieces
        )
    return Req(tc.arrival + shift, tc.finish + shift, chains.keys(pieces), tc.call.prompt_tokens)


def _slot_starts(timelines: Sequence[Timeline], n: int) -> list[float]:
    free = [0.0] * max(1, n)
    starts = []
    for tl in timelines:
        start = max(tl.start, heapq.heappop(free))
        starts.append(start)
        heapq.heappush(free, start + tl.duration)
    return starts


def _lanes(timelines: list[Timeline], n: int, seed: int, chains: BlockChains) -> Replay:
    order = list(range(len(timelines)))
    random.Random(seed).shuffle(order)
    lane_len = sum(timelines[i].duration for i in order) / max(1, n)
    reqs: list[Req] = []
    tape, cuts = 0.0, 0
    for i in order:
        tl = timelines[i]
        lanes = [min(n - 1, int((tape + s) // lane_len)) for s in tl.step_starts]
        first = lanes[0] if lanes else 0
        cuts += len({lane for lane in lanes if lane != first})
        for tc in tl.calls:
            lane = lanes[tc.step]
            reqs.append(_req(tc, tape - lane * lane_len, chains, lane - first))
        tape += tl.duration
    return Replay(_numbered(reqs), chains.block_tokens, cuts)


# --- cache replays -------------------------------------------------------------------------------
def _events(replay: Replay) -> list[tuple[float, int, int]]:
    """(time, kind, seq): completions (0) before arrivals (1) at equal times."""
    ev = [(r.arrival, 1, r.seq) for r in replay.reqs] + [(r.finish, 0, r.seq) for r in replay.reqs]
    ev.sort()
    return ev


def infinite_hits(replay: Replay) -> int:
    """Prefix-hit blocks with an infinite cache (a block exists from its first arrival)."""
    seen: set[int] = set()
    hits = 0
    for r in replay.reqs:
        k = 0
        for b in r.keys:
            if b not in seen:
                break
            k += 1
        hits += k
        seen.update(r.keys)
    return hits


def peak_working_set(replay: Replay) -> int:
    """Most blocks live at once: from first arrival to the finish of the last request using it."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for r in replay.reqs:
        for b in r.keys:
            first.setdefault(b, r.arrival)
            if last.get(b, -1.0) < r.finish:
                last[b] = r.finish
    deltas = [(t, 1, 1) for t in first.values()] + [(t, 0, -1) for t in last.values()]
    deltas.sort()
    cur = peak = 0
    for _, _, d in deltas:
        cur += d
        peak = max(peak, cur)
    return peak


@dataclass(slots=True)
class SimResult:
    hit_blocks: int
    no_room_blocks: int
    hits_by_class: dict[str, int] = field(default_factory=dict)  # with ``simulate(classify=)``


class _Cache:
    """Pinned blocks (refcounts) plus an evictable set ordered by the policy."""

    def __init__(self, capacity: int, policy: Policy, replay: Replay) -> None:
        self.capacity, self.policy = capacity, policy
        self.ref: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.heap: list[tuple[int, int, int, int]] = []  # (-next use, -position, version, block)
        self.version: dict[int, int] = {}  # free block -> its live heap entry
        self.stamp = 0
        self.uses: dict[int, list[int]] = {}
        if policy == "belady":
            for r in replay.reqs:
                for b in r.keys:
                    self.uses.setdefault(b, []).append(r.seq)

    def free_count(self) -> int:
        return len(self.lru) if self.policy == "lru" else len(self.version)

    def unfree(self, b: int) -> bool:
        """Take ``b`` out of the evictable set if it is there."""
        if self.policy == "lru":
            if b in self.lru:
                del self.lru[b]
                return True
            return False
        return self.version.pop(b, None) is not None

    def release(self, b: int, pos: int, now_seq: int) -> None:
        if self.policy == "lru":
            self.lru[b] = None
            return
        uses = self.uses[b]
        i = bisect_right(uses, now_seq)
        nxt = uses[i] if i < len(uses) else _NEVER
        self.stamp += 1
        self.version[b] = self.stamp
        heapq.heappush(self.heap, (-nxt, -pos, self.stamp, b))

    def evict(self, m: int) -> None:
        for _ in range(m):
            if self.policy == "lru":
                self.lru.popitem(last=False)
                continue
            while True:
                _, _, stamp, b = heapq.heappop(self.heap)
                if self.version.get(b) == stamp:
                    del self.version[b]
                    break


def simulate(
    replay: Replay,
    capacity: int,
    policy: Policy,
    classify: Callable[[int], str] | None = None,
) -> SimResult:
    """Replay against ``capacity`` blocks under ``policy``; ``classify`` (block key -> class)
    also counts the hit blocks per class."""
    cache = _Cache(capacity, policy, replay)
    by_class: dict[str, int] = {}
    ref = cache.ref
    held: dict[int, list[int]] = {}  # seq -> positions of the blocks it holds
    hits = no_room = 0
    latest = -1  # seq of the latest arrival
    for _, kind, seq in _events(replay):
        r = replay.reqs[seq]
        if kind == 0:
            for pos in reversed(held.pop(seq)):
                b = r.keys[pos]
                c = ref[b] - 1
                if c:
                    ref[b] = c
                else:
                    del ref[b]
                    cache.release(b, pos, latest)
            continue
        latest = seq
        holds: list[int] = []
        new: list[int] = []
        leading = True
        for pos, b in enumerate(r.keys):
            count = ref.get(b)
            if count is not None:
                ref[b] = count + 1
            elif cache.unfree(b):
                ref[b] = 1
            else:
                new.append(pos)
                leading = False
                continue
            holds.append(pos)
            hits += leading
            if leading and classify is not None:
                cls = classify(b)
                by_class[cls] = by_class.get(cls, 0) + 1
        room = capacity - len(ref) - cache.free_count()
        if len(new) > room:
            cache.evict(min(len(new) - room, cache.free_count()))
            room = capacity - len(ref) - cache.free_count()
        fit = max(0, min(len(new), room))
        for pos in new[:fit]:
            ref[r.keys[pos]] = 1
        no_room += len(new) - fit
        holds.extend(new[:fit])
        holds.sort()  # release order is prompt order reversed (resident blocks may follow a miss)
        held[seq] = holds
    return SimResult(hits, no_room, by_class)


# --- driver --------------------------------------------------------------------------------------
def ceilings(
    workload: Workload,
    *,
    arrival: Arrival = "lanes",
    concurrency: Sequence[int] = (8,),
    capacities: Sequence[float] = (0.25, 0.5),
    policies: Sequence[Policy] = POLICIES,
    seed: int = 0,
    service: Callable[[Call], float] = default_service,
) -> list[dict[str, Any]]:
    """One result per concurrency level: inf rate, peak working set and a row per capacity."""
    levels = list(concurrency) if arrival != "open" else [0]
    out = []
    for n in levels:
        replay = layout(workload, arrival, n, seed=seed, service=service)
        total = max(1, replay.total_tokens)
        bt = replay.block_tokens
        peak = peak_working_set(replay)
        level: dict[str, Any] = {
            "n": n,
            "arrival": arrival,
            "requests": len(replay.reqs),
            "tokens": replay.total_tokens,
            "peak_ws": peak,
            "cuts": replay.cuts,
            "block_tokens": bt,
            "inf": bt * infinite_hits(replay) / total,
            "rows": [],
        }
        for frac in capacities:
            cap = max(1, round(frac * peak))
            row: dict[str, Any] = {"frac": frac, "C": cap, "rates": {}, "no_room": 0.0}
            for policy in policies:
                res = simulate(replay, cap, policy)
                row["rates"][policy] = bt * res.hit_blocks / total
                row["no_room"] = bt * res.no_room_blocks / total
            level["rows"].append(row)
        out.append(level)
    return out


def render_markdown(results: Sequence[dict[str, Any]], title: str = "") -> str:
    """The ceilings as a Markdown table."""
    present = {p for lv in results for row in lv["rows"] for p in row["rates"]}
    policies = [p for p in POLICIES if p in present]
    head = ["N", "C/W", "C blocks", *policies, "inf", "no room"]
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lv in results:
        for row in lv["rows"]:
            rates = [
                f"{100 * row['rates'][p]:.1f}%" if p in row["rates"] else "-" for p in policies
            ]
            cells = [
                str(lv["n"] or "open"),
                f"{100 * row['frac']:.0f}%",
                str(row["C"]),
                *rates,
                f"{100 * lv['inf']:.1f}%",
                f"{100 * row['no_room']:.1f}%",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| N | peak working set (blocks) | block tokens | requests | prompt tokens | lane cuts |",
        "|---|---|---|---|---|---|",
    ]
    for lv in results:
        lines.append(
            f"| {lv['n'] or 'open'} | {lv['peak_ws']} | {lv['block_tokens']} | "
            f"{lv['requests']} | {lv['tokens']} | {lv['cuts']} |"
        )
    return "\n".join(lines)
