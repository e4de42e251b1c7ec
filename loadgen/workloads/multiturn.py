"""``multiturn``: chat conversations in the shape of vLLM's multi-turn benchmark.

Every conversation starts with a common prefix (a system prompt all share), then its own context
(a document), then a growing history of user/assistant turns separated by exponential think
times. Conversations arrive at ``arrival_rate``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from loadgen.workloads.base import Call, Segment, SessionScript, Workload, scaled, sized


@dataclass(frozen=True, slots=True)
class MultiturnParams:
    seed: int = 0
    conversations: int = 16
    arrival_rate: float = 1.0  # conversations per second (Poisson)
    min_turns: int = 3
    max_turns: int = 8
    shared_prefix_tokens: int = 1000
    context_tokens: int = 2000  # per conversation
    user_tokens: int = 120
    output_tokens: int = 120
    think_mean: float = 5.0  # seconds, exponential
    token_scale: float = 1.0


def build(p: MultiturnParams) -> Workload:
    rng = random.Random(p.seed)
    common = sized(
        "shared/multiturn/system", scaled(p.shared_prefix_tokens, p.token_scale), role="system"
    )
    sessions = []
    t = 0.0
    for c in range(p.conversations):
        t += rng.expovariate(p.arrival_rate) if c else 0.0
        sessions.append(_conversation(p, rng, f"mt-c{c}", t, common))
    return Workload("multiturn", tuple(sessions), api="chat", params=asdict(p))


def _conversation(
    p: MultiturnParams, rng: random.Random, sid: str, start: float, common: Segment
) -> SessionScript:
    out = scaled(p.output_tokens, p.token_scale)
    ctx = [common, sized(f"{sid}/context", scaled(p.context_tokens, p.token_scale))]
    calls = []
    turns = rng.randint(p.min_turns, p.max_turns)
    for k in range(turns):
        ctx.append(sized(f"{sid}/u{k}", scaled(p.user_tokens, p.token_scale)))
        think = 0.0 if k == 0 else rng.expovariate(1.0 / p.think_mean)
        calls.append(Call(tuple(ctx), out, think=think, stop="end_turn", agent="chat"))
        ctx.append(sized(f"{sid}/a{k}", out, role="assistant"))
    return SessionScript(sid, tuple(calls), start=start, agent="chat")
