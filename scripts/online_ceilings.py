"""Online eviction orders on a workload, replayed offline: how much of the gap between LRU and
Belady an engine, or kvkeeper driving one from outside, could close without knowing the future.

The workload is laid out as ``kvkeeper bench ceiling --arrival open`` lays it out (each call
holds its blocks from arrival to finish, ``loadgen.ceiling.default_service``) and replayed three
ways, each against LRU and Belady on the pool alone (``--pool`` x the peak working set):

1. eviction orders on the pool, and on one cache as large as pool and tier together;
2. the pool under LRU plus an LMCache-shaped tier (written through, LRU) where finished turns
   are pinned for a window (kvkeeper's tier pins);
3. a window of conversations kept on the pool by touches, with pins for what the pool drops,
   and what the touches would recompute.

Online orders see only what a request carries (its session, its turn number, the time, its
prompt) and what earlier requests did; "clairvoyant" rows and Belady know the future.

    python scripts/online_ceilings.py --set duration=600 --set every=4 --set scale=0.25
    python scripts/online_ceilings.py --set start=600 --set duration=600 --set every=4 \
      --set scale=0.25
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.ceiling import BlockChains, default_service, peak_working_set, play
from loadgen.ceiling import Replay as CeilingReplay
from loadgen.ceiling import Req as CeilingReq
from loadgen.workloads import build_workload, parse_overrides
from loadgen.workloads.base import Workload

_NEVER = math.inf


@dataclass(slots=True)
class Turn:
    arrival: float
    finish: float
    keys: list[int]
    tokens: int
    conv: int  # the root session's index
    turn: int  # 1 for a conversation's first call
    seq: int = 0
    returns_at: float = _NEVER  # the conversation's next arrival (clairvoyant rows only)


def layout(workload: Workload) -> list[Turn]:
    """Every call at its open-arrival time, in arrival order, with its conversation."""
    chains = BlockChains(workload.block_tokens)
    turns: list[Turn] = []
    for conv, script in enumerate(workload.sessions):
        tl = play(script, default_service)
        for n, tc in enumerate(tl.calls, 1):
            keys = chains.keys(tc.call.pieces())
            turns.append(
                Turn(tl.start + tc.arrival, tl.start + tc.finish, keys, tc.call.prompt_tokens,
                     conv, n)
            )  # fmt: skip
    turns.sort(key=lambda t: t.arrival)
    last: dict[int, Turn] = {}
    for i, t in enumerate(turns):
        t.seq = i
        if t.conv in last:
            last[t.conv].returns_at = t.arrival
        last[t.conv] = t
    return turns


# --- learned statistics (from the past only) ---------------------------------------------------
BIN = 5.0  # seconds per bin of the gap histogram
HORIZON = 900.0  # gaps longer than this count as never returning


@dataclass(slots=True)
class Stats:
    """What arrivals so far taught: how often a conversation at turn k comes back, and after
    how long. Priors keep the first minutes from deciding on a handful of samples."""

    prior_gaps: Sequence[float] = (30.0, 60.0, 120.0, 240.0)
    prior_p: float = 0.25
    prior_weight: float = 4.0
    open_turns: dict[int, tuple[int, float]] = field(default_factory=dict)  # conv -> (k, t)
    reached: dict[int, float] = field(default_factory=dict)  # k -> conversations seen at k
    continued: dict[int, float] = field(default_factory=dict)  # k -> of those, came back
    gaps: list[float] = field(default_factory=list)
    _index: dict[int, list[float]] = field(default_factory=dict)
    _dirty: bool = True

    def observe(self, t: Turn) -> None:
        prev = self.open_turns.get(t.conv)
        if prev is not None:
            k, at = prev
            self.continued[k] = self.continued.get(k, 0.0) + 1
            self.gaps.append(t.arrival - at)
            self._dirty = True
        self.reached[t.turn] = self.reached.get(t.turn, 0.0) + 1
        self.open_turns[t.conv] = (t.turn, t.arrival)

    def p_return(self, k: int, now: float) -> float:
        """Share of conversations at turn ``k`` (pooled 3+) that came back; turns whose
        conversation is younger than the horizon count in part (by the gaps' CDF)."""
        ks = [k] if k < 3 else [j for j in self.reached if j >= 3]
        reached = sum(self.reached.get(j, 0.0) for j in ks)
        cont = sum(self.continued.get(j, 0.0) for j in ks)
        return (cont + self.prior_p * self.prior_weight) / (reached + self.prior_weight)

    def index(self, k: int, now: float) -> list[float]:
        """Per age bin, the best hit rate per block-second holding on from that age can still
        earn (a Gittins-style index: max over stop ages T of P(return in (a, T]) / E[time held])."""
        if self._dirty:
            self._index.clear()
            self._dirty = False
        key = min(k, 3)
        if key not in self._index:
            self._index[key] = _gittins(self.p_return(key, now), [*self.prior_gaps, *self.gaps])
        return self._index[key]


def _gittins(p: float, gaps: Sequence[float]) -> list[float]:
    n_bins = int(HORIZON / BIN)
    hist = [0.0] * n_bins
    for g in gaps:
        if g < HORIZON:
            hist[int(g / BIN)] += 1
    total = max(1.0, sum(hist))
    f = [p * h / total for h in hist]  # P(return in bin i)
    out = [0.0] * n_bins
    for a in range(n_bins):
        alive = 1.0 - sum(f[:a])
        if alive <= 0:
            continue
        best, got, held, surv = 0.0, 0.0, 0.0, alive
        for t in range(a, n_bins):
            got += f[t]
            held += BIN * (surv - f[t] / 2)
            surv -= f[t]
            if held > 0:
                best = max(best, got / held)
        out[a] = best
    return out


# --- free-block orders --------------------------------------------------------------------------
class Evictor:
    """The evictable (free, cached) blocks in some order."""

    def __len__(self) -> int:
        raise NotImplementedError

    def release(self, b: int, pos: int, t: Turn, now: float) -> None:
        raise NotImplementedError

    def unfree(self, b: int) -> bool:
        raise NotImplementedError

    def evict(self, now: float) -> None:
        raise NotImplementedError

    def observe(self, t: Turn) -> None:
        """A request arrived (learning hook)."""


class Lru(Evictor):
    def __init__(self) -> None:
        self.q: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.q)

    def release(self, b: int, pos: int, t: Turn, now: float) -> None:
        self.q[b] = None

    def unfree(self, b: int) -> bool:
        return self.q.pop(b, 0) is None

    def evict(self, now: float) -> None:
        self.q.popitem(last=False)


class Belady(Evictor):
    def __init__(self, turns: Sequence[Turn]) -> None:
        self.uses: dict[int, list[int]] = {}
        for t in turns:
            for b in t.keys:
                self.uses.setdefault(b, []).append(t.seq)
        self.heap: list[tuple[float, int, int, int]] = []
        self.live: dict[int, int] = {}
        self.stamp = 0
        self.latest = -1

    def __len__(self) -> int:
        return len(self.live)

    def observe(self, t: Turn) -> None:
        self.latest = t.seq

    def release(self, b: int, pos: int, t: Turn, now: float) -> None:
        uses = self.uses[b]
        i = bisect_right(uses, self.latest)
        nxt = uses[i] if i < len(uses) else _NEVER
        self.stamp += 1
        self.live[b] = self.stamp
        heapq.heappush(self.heap, (-nxt, -pos, self.stamp, b))

    def unfree(self, b: int) -> bool:
        return self.live.pop(b, None) is not None

    def evict(self, now: float) -> None:
        while True:
            _, _, stamp, b = heapq.heappop(self.heap)
            if self.live.get(b) == stamp:
                del self.live[b]
                return


class TwoQ(Evictor):
    """Segmented LRU: blocks used again after their first release are protected, up to
    ``share`` of the free blocks; eviction takes the probation segment's head first."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.seen: set[int] = set()
        self.prob: OrderedDict[int, None] = OrderedDict()
        self.prot: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.prob) + len(self.prot)

    def release(self, b: int, pos: int, t: Turn, now: float) -> None:
        if b in self.seen:
            self.prot[b] = None
            limit = self.share * len(self)
            while len(self.prot) > limit:
                old, _ = self.prot.popitem(last=False)
                self.prob[old] = None
        else:
            self.seen.add(b)
            self.prob[b] = None

    def unfree(self, b: int) -> bool:
        return self.prob.pop(b, 0) is None or self.prot.pop(b, 0) is None

    def evict(self, now: float) -> None:
        (self.prob or self.prot).popitem(last=False)


Score = Callable[["ConvState", float], float]  # higher: kept longer


@dataclass(slots=True)
class ConvState:
    conv: int
    turn: int
    released: float
    returns_at: float
    blocks: dict[int, int] = field(default_factory=dict)  # free block -> prompt position


class ByConversation(Evictor):
    """Free blocks grouped by the conversation that released them last; eviction takes the
    deepest free block of the conversation with the lowest score."""

    def __init__(self, score: Score, stats: Stats | None = None) -> None:
        self.score = score
        self.stats = stats
        self.convs: dict[int, ConvState] = {}
        self.owner: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.owner)

    def observe(self, t: Turn) -> None:
        if self.stats is not None:
            self.stats.observe(t)

    def release(self, b: int, pos: int, t: Turn, now: float) -> None:
        st = self.convs.get(t.conv)
        if st is None:
            st = self.convs[t.conv] = ConvState(t.conv, t.turn, now, t.returns_at)
        st.turn, st.released, st.returns_at = t.turn, now, t.returns_at
        st.blocks[b] = pos
        self.owner[b] = t.conv

    def unfree(self, b: int) -> bool:
        conv = self.owner.pop(b, None)
        if conv is None:
            return False
        st = self.convs[conv]
        del st.blocks[b]
        if not st.blocks:
            del self.convs[conv]
        return True

    def evict(self, now: float) -> None:
        st = min(self.convs.values(), key=lambda s: (self.score(s, now), -s.released))
        b = max(st.blocks, key=st.blocks.__getitem__)
        self.unfree(b)


def lru_conv(s: ConvState, now: float) -> float:
    return s.released


def window(ttl: float, long_ttl: float | None = None) -> Score:
    """Keep a conversation ``ttl`` seconds after its turn (``long_ttl`` from its second turn
    on): expired ones go first, oldest first; among the rest the newest goes first, so the
    pool keeps a subset for the whole window instead of everything for a few seconds."""

    def score(s: ConvState, now: float) -> float:
        limit = long_ttl if (long_ttl is not None and s.turn >= 2) else ttl
        age = now - s.released
        return s.released - 1e9 if age > limit else 1e6 - s.released + (1e7 if s.turn >= 2 else 0)

    return score


def turns_then_lru(s: ConvState, now: float) -> float:
    return min(s.turn, 3) * 1e6 + s.released


def learned_window(stats: Stats) -> Score:
    """The window rule with the window learned online: the median return gap seen so far
    (60 s before any), twice that from a conversation's second turn on."""
    cache: dict[int, float] = {}

    def score(s: ConvState, now: float) -> float:
        n = len(stats.gaps)
        if n not in cache:
            gaps = sorted(stats.gaps)
            cache.clear()
            cache[n] = gaps[n // 2] if gaps else 60.0
        return window(cache[n], 2 * cache[n])(s, now)

    return score


def gittins(stats: Stats) -> Score:
    def score(s: ConvState, now: float) -> float:
        idx = stats.index(s.turn, now)
        a = int((now - s.released) / BIN)
        return idx[a] if a < len(idx) else 0.0

    return score


def oracle_which(s: ConvState, now: float) -> float:
    """Knows whether the conversation returns (not when): returners kept, LRU among each."""
    return (1e7 if s.returns_at < _NEVER else 0.0) + s.released


# --- replay --------------------------------------------------------------------------------------
def _release(t: Turn, holds: list[int], ref: dict[int, int], ev: Evictor, now: float) -> None:
    """A finished turn drops its references; blocks nobody else holds go to the evictor."""
    for pos in reversed(holds):
        b = t.keys[pos]
        if ref[b] > 1:
            ref[b] -= 1
        else:
            del ref[b]
            ev.release(b, pos, t, now)


def simulate(turns: Sequence[Turn], capacity: int, ev: Evictor) -> int:
    """Prefix-hit blocks of the replay (same rules as ``loadgen.ceiling.simulate``)."""
    events = sorted([(t.arrival, 1, t.seq) for t in turns] + [(t.finish, 0, t.seq) for t in turns])
    ref: dict[int, int] = {}
    held: dict[int, list[int]] = {}
    hits = 0
    for now, kind, seq in events:
        t = turns[seq]
        if kind == 0:
            _release(t, held.pop(seq), ref, ev, now)
            continue
        ev.observe(t)
        holds: list[int] = []
        new: list[int] = []
        leading = True
        for pos, b in enumerate(t.keys):
            if b in ref:
                ref[b] += 1
            elif ev.unfree(b):
                ref[b] = 1
            else:
                new.append(pos)
                leading = False
                continue
            holds.append(pos)
            hits += leading
        room = capacity - len(ref) - len(ev)
        while len(new) > room and len(ev):
            ev.evict(now)
            room += 1
        fit = max(0, min(len(new), room))
        for pos in new[:fit]:
            ref[t.keys[pos]] = 1
        holds.extend(new[:fit])
        holds.sort()
        held[seq] = holds
    return hits


@dataclass(slots=True)
class PinRule:
    """Which finished turns kvkeeper pins in the tier, and for how long."""

    ttl: float  # seconds a turn's prefix stays pinned after it finished
    long_ttl: float  # the same from a conversation's second turn on
    min_turn: int = 1  # pin only turns at least this far into their conversation
    share: float = 1.0  # of the tier's capacity pins may hold; a turn that does not fit waits
    later_first: bool = False  # a later turn may displace the newest first-turn pins


def simulate_tiered(
    turns: Sequence[Turn], gpu: int, tier: int, rule: PinRule | None, evict_ended: bool = False
) -> int:
    """GPU LRU of ``gpu`` blocks plus a written-through LRU tier of ``tier`` blocks (LMCache's
    shape) in which ``rule`` pins finished turns' prompts; a block the tier holds is a hit.
    ``evict_ended``: a conversation's last turn deletes its blocks from the tier when it ends
    (the load generator's ``evict``, sent because it knows that turn is the last; the block
    every conversation shares is kept)."""
    events = sorted([(t.arrival, 1, t.seq) for t in turns] + [(t.finish, 0, t.seq) for t in turns])
    ref: dict[int, int] = {}
    free: OrderedDict[int, None] = OrderedDict()
    stored: OrderedDict[int, None] = OrderedDict()
    pin_count: dict[int, int] = {}
    pins: OrderedDict[int, tuple[float, list[int]]] = OrderedDict()  # conv -> (expiry, blocks)
    budget = int(tier * rule.share) if rule else 0
    tier_pinned: set[int] = set()
    turn_of: dict[int, int] = {}
    held: dict[int, list[int]] = {}
    hits = 0

    def unpin(conv: int) -> None:
        for b in pins.pop(conv)[1]:
            pin_count[b] -= 1
            if not pin_count[b]:
                del pin_count[b]
                tier_pinned.discard(b)

    def store(b: int) -> None:
        stored[b] = None
        stored.move_to_end(b)
        if len(stored) > tier:
            for old in stored:
                if old not in tier_pinned:
                    del stored[old]
                    break
            else:
                del stored[b]  # all pinned: the new block is not kept

    for now, kind, seq in events:
        t = turns[seq]
        if rule is not None:
            for conv in [c for c, (exp, _) in pins.items() if exp < now]:
                unpin(conv)
        if kind == 0:
            for pos in reversed(held.pop(seq)):
                b = t.keys[pos]
                if ref[b] > 1:
                    ref[b] -= 1
                else:
                    del ref[b]
                    free[b] = None
            if evict_ended and t.returns_at == _NEVER:
                for b in t.keys[1:]:
                    if b not in ref:
                        stored.pop(b, None)
            if rule is not None and t.turn >= rule.min_turn and t.keys:
                if t.conv in pins:
                    unpin(t.conv)
                need = len(set(t.keys) - set(pin_count))
                if rule.later_first and t.turn >= 2:
                    firsts = [c for c in reversed(pins) if turn_of[c] < 2]
                    while firsts and len(pin_count) + need > budget:
                        unpin(firsts.pop(0))
                if len(pin_count) + need <= budget:
                    ttl = rule.long_ttl if t.turn >= 2 else rule.ttl
                    pins[t.conv] = (now + ttl, list(t.keys))
                    turn_of[t.conv] = t.turn
                    for b in t.keys:
                        pin_count[b] = pin_count.get(b, 0) + 1
                        if b in stored and len(tier_pinned) < budget:
                            tier_pinned.add(b)
            continue
        if rule is not None and t.conv in pins:
            unpin(t.conv)  # resumed: its new turn pins the new version at its end
        holds: list[int] = []
        new: list[int] = []
        leading = True
        for pos, b in enumerate(t.keys):
            if b in ref:
                ref[b] += 1
            elif b in free:
                del free[b]
                ref[b] = 1
            else:
                if leading and b in stored:
                    stored.move_to_end(b)
                    hits += 1
                    new.append(pos)
                    holds.append(-1)  # loaded from the tier: counted, allocated below
                    continue
                new.append(pos)
                leading = False
                continue
            holds.append(pos)
            hits += leading
        holds = [p for p in holds if p >= 0]
        room = gpu - len(ref) - len(free)
        while len(new) > room and free:
            free.popitem(last=False)
            room += 1
        fit = max(0, min(len(new), room))
        for pos in new[:fit]:
            ref[t.keys[pos]] = 1
        for pos in new:
            store(t.keys[pos])  # written through once computed (or loaded: refreshed)
        holds.extend(new[:fit])
        holds.sort()
        held[seq] = holds
    return hits


@dataclass(slots=True)
class KeptResult:
    hit_blocks: int
    kept_s: float  # conversation-seconds held on the GPU beyond the LRU horizon (touches)
    tail_tokens: int  # tokens a touch of each kept turn recomputes (its partial last block)
    lru_ages: list[float]  # release-to-eviction ages of the blocks evicted (the LRU horizon)


def simulate_kept(
    turns: Sequence[Turn],
    gpu: int,
    tier: int,
    ttl: float,
    long_ttl: float,
    share: float,
    gpu_keep: bool = True,
    block: int = 128,
    horizon: float = 0.0,
) -> KeptResult:
    """The window rule on the GPU (touches keep conversations inside their window, newest
    unkept first), plus an LMCache-shaped tier where blocks the GPU evicts from a conversation
    still inside its window are pinned (within ``share`` of the tier) until the window ends or
    the conversation resumes; ``share`` 0: a plain write-through LRU tier."""
    ev = ByConversation(window(ttl, long_ttl) if gpu_keep else lru_conv)
    kept_since: dict[int, float] = {}  # conversation -> when its turn ended (kept since)
    kept_s, tail_tokens, ages = 0.0, 0, []
    events = sorted([(t.arrival, 1, t.seq) for t in turns] + [(t.finish, 0, t.seq) for t in turns])
    ref: dict[int, int] = {}
    stored: OrderedDict[int, None] = OrderedDict()
    pinned: dict[int, tuple[int, float]] = {}  # block -> (conversation, expiry)
    room_pins = int(share * tier)
    held: dict[int, list[int]] = {}
    last_turn: dict[int, Turn] = {}
    hits = 0

    def store(b: int) -> None:
        stored[b] = None
        stored.move_to_end(b)
        if len(stored) > tier:
            for old in stored:
                if old not in pinned:
                    del stored[old]
                    return

    for now, kind, seq in events:
        t = turns[seq]
        for b in [b for b, (_, exp) in pinned.items() if exp < now]:
            del pinned[b]
        if kind == 0:
            last_turn[t.conv] = t
            kept_since[t.conv] = now
            tail_tokens += (t.tokens - block * len(t.keys)) or block
            _release(t, held.pop(seq), ref, ev, now)
            continue
        for b in [b for b, (c, _) in pinned.items() if c == t.conv]:
            del pinned[b]
        if t.conv in kept_since:
            kept_s += max(0.0, now - kept_since.pop(t.conv) - horizon)
        ev.observe(t)
        holds: list[int] = []
        new: list[int] = []
        leading = True
        for pos, b in enumerate(t.keys):
            if b in ref:
                ref[b] += 1
            elif ev.unfree(b):
                ref[b] = 1
            else:
                if leading and b in stored:
                    stored.move_to_end(b)
                    hits += 1
                else:
                    leading = False
                new.append(pos)
                continue
            holds.append(pos)
            hits += leading
        room = gpu - len(ref) - len(ev)
        while len(new) > room and len(ev):
            st = min(ev.convs.values(), key=lambda s: (ev.score(s, now), -s.released))
            b = max(st.blocks, key=st.blocks.__getitem__)
            ev.unfree(b)
            room += 1
            ages.append(now - st.released)
            if st.conv in kept_since:
                kept_s += max(0.0, now - kept_since.pop(st.conv) - horizon)
            prev = last_turn.get(st.conv)
            limit = long_ttl if st.turn >= 2 else ttl
            if (
                prev is not None and now - st.released < limit and b in stored
                and len(pinned) < room_pins
            ):  # fmt: skip
                pinned[b] = (st.conv, st.released + limit)
        fit = max(0, min(len(new), room))
        for pos in new[:fit]:
            ref[t.keys[pos]] = 1
        for pos in new:
            store(t.keys[pos])
        holds.extend(new[:fit])
        holds.sort()
        held[seq] = holds
    end = turns[-1].finish if turns else 0.0
    kept_s += sum(max(0.0, min(end, s + long_ttl) - s - horizon) for s in kept_since.values())
    return KeptResult(hits, kept_s, tail_tokens, ages)


def _window_factory(ttl: float, long_ttl: float | None) -> Callable[[], Evictor]:
    return lambda: ByConversation(window(ttl, long_ttl))


def _learned(make_score: Callable[[Stats], Score]) -> Callable[[], Evictor]:
    def make() -> Evictor:
        stats = Stats()
        return ByConversation(make_score(stats), stats)

    return make


def policies(turns: Sequence[Turn]) -> dict[str, Callable[[], Evictor]]:
    """Every eviction order replayed: name -> a fresh evictor."""
    out: dict[str, Callable[[], Evictor]] = {
        "LRU (vLLM)": Lru,
        "2Q / segmented LRU, 50% protected": lambda: TwoQ(0.5),
        "2Q / segmented LRU, 80% protected": lambda: TwoQ(0.8),
        "turn count, then LRU (LFU on conversation prefixes)": lambda: ByConversation(
            turns_then_lru
        ),
    }
    for ttl in (60.0, 120.0, 240.0):
        out[f"window {ttl:.0f} s (MRU inside it)"] = _window_factory(ttl, None)
        out[f"window {ttl:.0f} s, later turns {2 * ttl:.0f} s and first"] = _window_factory(
            ttl, 2 * ttl
        )
    out["window = median return gap so far, later turns 2x and first (learned)"] = _learned(
        learned_window
    )
    out["Gittins-style return index (learned)"] = _learned(gittins)
    out["clairvoyant: which conversations return (not when)"] = lambda: ByConversation(oracle_which)
    out["Belady"] = lambda: Belady(turns)
    return out


def _closed(rate: float, lru: float, bel: float) -> str:
    return f"{100 * (rate - lru) / (bel - lru):.0f}%" if bel > lru else "-"


def report(turns: Sequence[Turn], gpu: int, tier: int, total: int, bt: int) -> None:
    """The three tables: eviction orders on the pool and on one cache as large as pool and
    tier together; pins at turn end in an LMCache-shaped tier; the window kept by touches."""
    lru = bt * simulate(turns, gpu, Lru()) / total
    bel = bt * simulate(turns, gpu, Belady(turns)) / total
    print(
        f"Pool {gpu} blocks, tier {tier}; gap closed = (rate - LRU) / (Belady - LRU) on the "
        f"pool alone: LRU {100 * lru:.1f}%, Belady {100 * bel:.1f}%\n"
    )
    print(
        f"| eviction order | pool ({gpu}) | gap closed | one cache of {gpu + tier} | "
        "gap closed |\n|---|---|---|---|---|"
    )
    for name, make in policies(turns).items():
        a = bt * simulate(turns, gpu, make()) / total
        b = bt * simulate(turns, gpu + tier, make()) / total
        print(
            f"| {name} | {100 * a:.1f}% | {_closed(a, lru, bel)} | {100 * b:.1f}% | "
            f"{_closed(b, lru, bel)} |"
        )

    rules: dict[str, PinRule | None] = {"no pins (plain LMCache)": None}
    for ttl in (60.0, 90.0, 120.0, 180.0):
        for share in (0.5, 0.8, 1.0):
            for mt, later in ((1, False), (1, True), (2, False)):
                what = "later turns displace first turns" if later else f"turns >= {mt}"
                rules[f"{ttl:.0f} s / later turns {2 * ttl:.0f} s, {what}, share {share}"] = (
                    PinRule(ttl, 2 * ttl, mt, share=share, later_first=later)
                )
    print("\n| GPU LRU + tier pins at turn end (kept oldest when full) | hit rate | gap closed |")
    print("|---|---|---|")
    for name, rule in rules.items():
        rate = bt * simulate_tiered(turns, gpu, tier, rule) / total
        print(f"| {name} | {100 * rate:.1f}% | {_closed(rate, lru, bel)} |")
    rate = bt * simulate_tiered(turns, gpu, tier, None, evict_ended=True) / total
    print(
        f"| clairvoyant: no pins, the tier deletes a conversation at its last turn (the load "
        f"generator's evict) | {100 * rate:.1f}% | {_closed(rate, lru, bel)} |"
    )

    base = simulate_kept(turns, gpu, tier, 0.0, 0.0, 0.0, gpu_keep=False, block=bt)
    horizon = sorted(base.lru_ages)[len(base.lru_ages) // 2] if base.lru_ages else 0.0
    print(f"\nLRU horizon (median release-to-eviction age on the pool): {horizon:.1f} s")
    print(
        "| window kept on the GPU by touches | tier | hit rate | gap closed | touches "
        "(every 0.5 x horizon) | their recompute / prompt tokens |\n|---|---|---|---|---|---|"
    )
    for ttl in (60.0, 90.0, 120.0, 180.0):
        for share in (0.0, 1.0):
            res = simulate_kept(turns, gpu, tier, ttl, 2 * ttl, share, block=bt, horizon=horizon)
            rate = bt * res.hit_blocks / total
            touches = res.kept_s / (0.5 * horizon) if horizon else 0.0
            per_touch = res.tail_tokens / max(1, len(turns))
            print(
                f"| {ttl:.0f} s / later turns {2 * ttl:.0f} s | "
                f"{'pins for what the GPU drops' if share else 'plain LRU'} | "
                f"{100 * rate:.1f}% | {_closed(rate, lru, bel)} | {touches:.0f} | "
                f"{100 * touches * per_touch / total:.1f}% |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--workload", default="mooncake")
    ap.add_argument("--set", action="append", default=[], help="workload parameter key=value")
    ap.add_argument("--pool", type=float, default=0.5, help="pool blocks as a share of peak W")
    ap.add_argument("--tier", type=int, default=0, help="tier blocks (0: as many as the pool)")
    args = ap.parse_args()
    workload = build_workload(args.workload, parse_overrides(args.set))
    turns = layout(workload)
    replay = CeilingReplay(
        [CeilingReq(t.arrival, t.finish, t.keys, t.tokens, t.seq) for t in turns],
        workload.block_tokens,
    )
    gpu = max(1, round(args.pool * peak_working_set(replay)))
    total = max(1, sum(t.tokens for t in turns))
    print(f"{args.workload} {dict(workload.params)}: {len(turns)} requests")
    report(turns, gpu, args.tier or gpu, total, workload.block_tokens)


if __name__ == "__main__":
    main()
