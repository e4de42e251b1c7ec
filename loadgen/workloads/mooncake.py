"""``mooncake``: replay of the Mooncake FAST'25 request traces (``loadgen/traces/mooncake``).

Each JSONL line is one request: ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``, one id per 512-token block (remapped prefix hashes: equal ids are a shared
prefix). Requests keep their arrival times (the runner's ``time_scale`` scales them); a prompt is
one token block per hash id (the same tokens for the same id, :mod:`loadgen.tokens`), the last
one cut so the prompt has ``input_length`` tokens; ``output_length`` is ``max_tokens``.

Conversations, for kvkeeper's session hints, come from the prefix structure: a request whose
ids start with every complete block of an earlier request (all its ids but a partial last one),
more than the first block that every request shares, continues that request's conversation.
A conversation is one root session whose calls are due at their recorded times and never
start before the previous turn has finished.

``start``/``duration`` cut a window (seconds from the file's first request), ``every`` keeps one
conversation in N, ``max_requests`` caps the calls, ``scale`` multiplies every length (block
size included) so the trace fits a small engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from loadgen.workloads.base import Call, Segment, SessionScript, Workload, scaled
from loadgen.workloads.trace import MOONCAKE_BLOCK, open_trace

SHIPPED = Path(__file__).resolve().parent.parent / "traces" / "mooncake"
DEFAULT_TRACE = SHIPPED / "conversation_1200s-2400s.jsonl.xz"


@dataclass(frozen=True, slots=True)
class MooncakeParams:
    path: str = ""  # a Mooncake JSONL file, plain, .xz or .gz ("": the shipped excerpt)
    start: float = 0.0  # window start, seconds after the file's first request
    duration: float = 0.0  # window length in seconds (0: to the end)
    every: int = 1  # keep one conversation in this many
    max_requests: int = 0  # keep the first N requests that remain (0: all)
    scale: float = 1.0  # multiplies input, output and block lengths


@dataclass(frozen=True, slots=True)
class Request:
    """One trace line; ``t`` in seconds."""

    t: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def complete_blocks(self) -> tuple[int, ...]:
        """The ids of the full 512-token blocks (a partial last block's id is left out)."""
        if self.input_length >= MOONCAKE_BLOCK * len(self.hash_ids):
            return self.hash_ids
        return self.hash_ids[:-1]


def read_requests(path: Path) -> list[Request]:
    """Every request of a Mooncake JSONL file, in arrival order; bad lines raise ValueError."""
    out: list[Request] = []
    with open_trace(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                out.append(_parse(line, f"{path.name} line {n}"))
    out.sort(key=lambda r: r.t)  # stable: lines with equal timestamps keep their order
    return out


def _parse(line: str, where: str) -> Request:
    try:
        rec = json.loads(line)
        ids = tuple(int(i) for i in rec["hash_ids"])
        req = Request(
            float(rec["timestamp"]) / 1000.0,
            int(rec["input_length"]),
            int(rec["output_length"]),
            ids,
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"mooncake: {where}: not a trace record ({exc!r})") from None
    if req.input_length < 1 or req.output_length < 0:
        raise ValueError(f"mooncake: {where}: input_length must be >= 1, output_length >= 0")
    if len(ids) > -(-req.input_length // MOONCAKE_BLOCK):
        raise ValueError(f"mooncake: {where}: more hash_ids than 512-token blocks")
    return req


def conversations(requests: Sequence[Request]) -> list[int]:
    """The conversation number of each request (numbered by first appearance): a request
    continues the conversation of the earlier request whose complete blocks are the longest
    prefix of its ids, when that prefix is more than one block."""
    owner: dict[tuple[int, ...], int] = {}  # complete blocks of a request -> its conversation
    out: list[int] = []
    n_convs = 0
    for r in requests:
        conv = next(
            (owner[r.hash_ids[:k]] for k in range(len(r.hash_ids), 1, -1)
             if r.hash_ids[:k] in owner),
            None,
        )  # fmt: skip
        if conv is None:
            conv, n_convs = n_convs, n_convs + 1
        out.append(conv)
        if len(done := r.complete_blocks()) > 1:
            owner[done] = conv
    return out


def select(requests: Sequence[Request], p: MooncakeParams) -> list[tuple[int, Request]]:
    """The window's requests with their conversations, thinned and capped as ``p`` says."""
    if p.every < 1 or p.max_requests < 0 or p.start < 0 or p.duration < 0 or p.scale <= 0:
        raise ValueError("mooncake: every >= 1, max_requests/start/duration >= 0, scale > 0")
    t0 = requests[0].t + p.start if requests else 0.0
    window = [r for r in requests if r.t >= t0 and (p.duration == 0 or r.t < t0 + p.duration)]
    kept = [(c, r) for c, r in zip(conversations(window), window, strict=True) if c % p.every == 0]
    return kept[: p.max_requests] if p.max_requests else kept


def build(p: MooncakeParams) -> Workload:
    path = Path(p.path) if p.path else DEFAULT_TRACE
    if not path.is_file():
        raise ValueError(f"mooncake: no such trace file: {path}")
    kept = select(read_requests(path), p)
    if not kept:
        raise ValueError(f"mooncake: no requests in {path.name} under {p}")
    ns = "shared/mooncake/" + path.name.split(".")[0]
    block = scaled(MOONCAKE_BLOCK, p.scale)
    t0 = kept[0][1].t
    by_conv: dict[int, list[tuple[int, Request]]] = {}
    for key, (conv, r) in enumerate(kept):
        by_conv.setdefault(conv, []).append((key, r))
    sessions = []
    for n, reqs in enumerate(by_conv.values()):
        first = prev = reqs[0][1].t
        calls = []
        for key, r in reqs:
            calls.append(_call(r, key, ns, block, p.scale, think=r.t - prev, at=r.t - first))
            prev = r.t
        sessions.append(
            SessionScript(f"mc-{n}", tuple(calls), start=first - t0, agent="conversation")
        )
    return Workload(
        "mooncake", tuple(sessions), block_tokens=block, api="completions-ids", params=asdict(p)
    )


def _call(
    r: Request, key: int, ns: str, block: int, scale: float, *, think: float, at: float
) -> Call:
    n_in = scaled(r.input_length, scale)
    if r.hash_ids:
        last = min(max(n_in - block * (len(r.hash_ids) - 1), 1), block)
        seg = Segment(ns, r.hash_ids, block, None if last == block else last)
    else:  # shorter than any hashed block: content of its own
        seg = Segment(f"{ns}/unhashed", [key], n_in)
    out = scaled(r.output_length, scale)
    return Call((seg,), out, think=think, stop="end_turn", agent="conversation", at=at)
