"""The cache ceilings a comparison measures against, and the Belady oracle of a run.

Every ceiling is computed on the same capacity as the engines' pool: on the ceiling tool's own
timeline (``planned``) and on the arrival order a target really saw (``realized``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from loadgen import ceiling, tokens
from loadgen.records import RequestRecord, RunResult
from loadgen.runner import RunOptions
from loadgen.sim.belady import oracle_document
from loadgen.sim.kv_manager import BlockHashCache
from loadgen.sim.kv_manager import Sequence as SimSequence
from loadgen.workloads.base import Call, SessionScript, Spawn, Workload


def write_oracle(path: Path, workload: Workload, result: RunResult, hash_seed: str) -> int:
    """Write the Belady oracle of ``result``'s sends (block hashes exactly as the engine
    computes them from the token ids the runner sends); returns how many blocks it lists."""
    bt = workload.block_tokens
    chains = ceiling.BlockChains(bt)
    hasher = BlockHashCache(bt, hash_seed)
    known: dict[int, bytes] = {}  # the ceiling's block key -> the engine's block hash

    def uses() -> Iterator[tuple[float, list[bytes]]]:
        for rec, call in sent_calls(workload, result):
            pieces = list(call.pieces())
            keys = chains.keys(pieces)
            seq = SimSequence("oracle", tokens.render_ids(pieces))
            for key in keys:
                if key not in known:
                    break
                seq.block_hashes.append(known[key])
            hasher.update(seq)  # hashes only the blocks after the known prefix
            known.update(zip(keys, seq.block_hashes, strict=False))
            yield rec.t_start, seq.block_hashes

    doc = oracle_document(uses(), bt, hash_seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return len(doc["blocks"])


def arrival_of(workload: Workload, options: RunOptions) -> tuple[ceiling.Arrival, int]:
    """The ceiling's arrival model matching how the runner starts root sessions."""
    if options.max_sessions > 0:
        return "slots", options.max_sessions
    return "open", 0


def largest_request_blocks(workload: Workload) -> int:
    """Blocks the largest call needs (prompt + output): an engine refuses a smaller pool."""
    bt = workload.block_tokens
    return max((-(-(c.prompt_tokens + c.max_tokens) // bt) for c in workload.calls()), default=1)


def planned_ceilings(
    workload: Workload,
    options: RunOptions,
    frac: float | None,
    capacity: int | None,
    floor: int = 1,
) -> dict[str, Any]:
    """Peak working set and inf/Belady/LRU at the pool's capacity on the tool's own timeline;
    a share of the working set below ``floor`` blocks is raised to it (``raised_to_fit``)."""
    arrival, n = arrival_of(workload, options)
    replay = ceiling.layout(workload, arrival, n)
    peak = ceiling.peak_working_set(replay)
    cap = capacity if capacity is not None else max(floor, round((frac or 1.0) * peak))
    raised = capacity is None and cap > round((frac or 1.0) * peak)
    rates = replay_rates(replay, cap)
    return {"arrival": arrival, "n": n, "peak_ws": peak, "raised_to_fit": raised, **rates}


def replay_rates(replay: ceiling.Replay, capacity: int) -> dict[str, Any]:
    total = max(1, replay.total_tokens)
    bt = replay.block_tokens
    rates: dict[str, Any] = {"C": capacity, "inf": bt * ceiling.infinite_hits(replay) / total}
    for policy in ceiling.POLICIES:
        res = ceiling.simulate(replay, capacity, policy)
        rates[policy] = bt * res.hit_blocks / total
        rates["no_room"] = bt * res.no_room_blocks / total
    return rates


def _scripts(sessions: Sequence[SessionScript]) -> Iterator[SessionScript]:
    for s in sessions:
        yield s
        for step in s.steps:
            if isinstance(step, Spawn):
                yield from _scripts(step.children)


def sent_calls(workload: Workload, result: RunResult) -> Iterator[tuple[RequestRecord, Call]]:
    """Each request of the run with the workload call it sent."""
    by_id = {s.session_id: s for s in _scripts(workload.sessions)}
    for rec in result.requests:
        script = by_id[rec.session_id.split("-", 1)[1]]
        call = script.steps[rec.turn]
        assert isinstance(call, Call)
        yield rec, call


def realized_replay(
    workload: Workload, result: RunResult, *, from_first_token: bool = False
) -> ceiling.Replay:
    """The calls as the run really timed them (start, end), as a ceiling replay.

    ``from_first_token``: each call looks its prefix up and holds its blocks from its first
    token instead of from when it was sent. The engine does that at admission, which is
    earlier (the prefill runs in between), so this timeline shows what eviction order could
    win once the wait in the engine's queue is taken as given: a waiting request holds no
    blocks, and the ``realized`` ceilings, which pin them from the send time, count as won
    what the wait loses."""
    chains = ceiling.BlockChains(workload.block_tokens)
    reqs = []
    for rec, call in sent_calls(workload, result):
        start = rec.t_start + (rec.ttft or 0.0) if from_first_token else rec.t_start
        reqs.append(
            ceiling.Req(
                min(start, rec.t_end), rec.t_end, chains.keys(call.pieces()), call.prompt_tokens
            )
        )
    return ceiling.Replay(reqs, workload.block_tokens)


def gap_closed(hit: float, lru: float, belady: float) -> float | None:
    """The share of the LRU-to-Belady gap ``hit`` closes; None where there is no gap."""
    gap = belady - lru
    return (hit - lru) / gap if gap > 1e-9 else None
