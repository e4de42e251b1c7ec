"""``swarm``: a supervisor dispatching to specialised agents (the CacheScout setting).

Every agent has a fixed anchor (system prompt + tool definitions) that starts each of its calls,
so anchors are reused across all user sessions. A user session starts at the supervisor; each
dispatch runs the chosen agent for one to ``max_calls_per_dispatch`` tool-paused calls; the next
agent comes from a seeded first-order Markov transition table (a few strong successors per row,
plus an ``end`` state). A call's prompt is ``anchor(agent) + task + history so far``, so the same
agent called again in a session also hits its session context. Tool pauses are Pareto-distributed.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from loadgen.workloads.base import (
    Call,
    Segment,
    SessionScript,
    Workload,
    pareto_pause,
    scaled,
    sized,
)

AGENT_NAMES = (
    "supervisor",
    "planner",
    "researcher",
    "coder",
    "tester",
    "reviewer",
    "writer",
    "ops",
)


@dataclass(frozen=True, slots=True)
class SwarmParams:
    seed: int = 0
    users: int = 24  # user sessions
    agents: int = 6  # specialised agents besides the supervisor (at most 7)
    arrival_rate: float = 0.5  # user sessions per second (Poisson)
    anchor_min: int = 2000  # anchor tokens per agent, drawn uniformly in [min, max]
    anchor_max: int = 8000
    task_tokens: int = 300  # the user's request
    tool_result_tokens: int = 200  # appended to the history after every tool call
    output_tokens: int = 96
    min_dispatches: int = 3
    max_dispatches: int = 10
    max_calls_per_dispatch: int = 3
    pause_alpha: float = 1.5  # Pareto shape of tool pauses (smaller = heavier tail)
    pause_min: float = 1.0
    pause_cap: float = 120.0
    token_scale: float = 1.0


def transition_table(rng: random.Random, n_agents: int) -> list[list[float]]:
    """Row ``i``: probabilities of the next agent (1..n, index 0 unused) or ``end`` (last)."""
    rows: list[list[float]] = []
    for _ in range(n_agents + 1):
        weights = [0.0] + [0.05] * n_agents + [0.1]
        for succ in rng.sample(range(1, n_agents + 1), k=min(2, n_agents)):
            weights[succ] += rng.uniform(0.6, 1.2)
        total = sum(weights)
        rows.append([w / total for w in weights])
    return rows


def build(p: SwarmParams) -> Workload:
    if not 1 <= p.agents < len(AGENT_NAMES):
        raise ValueError(f"swarm: agents must be in 1..{len(AGENT_NAMES) - 1}")
    rng = random.Random(p.seed)
    names = AGENT_NAMES[: p.agents + 1]
    anchors = {
        name: sized(
            f"shared/anchor/{name}",
            scaled(rng.randint(p.anchor_min, p.anchor_max), p.token_scale),
            role="system",
        )
        for name in names
    }
    table = transition_table(rng, p.agents)
    t = 0.0
    sessions = []
    for u in range(p.users):
        t += rng.expovariate(p.arrival_rate) if u else 0.0
        sessions.append(_user_session(p, rng, f"swarm-u{u}", t, names, anchors, table))
    return Workload("swarm", tuple(sessions), api="chat", params=asdict(p))


def _user_session(
    p: SwarmParams,
    rng: random.Random,
    sid: str,
    start: float,
    names: tuple[str, ...],
    anchors: dict[str, Segment],
    table: list[list[float]],
) -> SessionScript:
    history = [sized(f"{sid}/task", scaled(p.task_tokens, p.token_scale))]
    calls: list[Call] = []
    agent = 0  # the supervisor opens every session
    dispatches = rng.randint(p.min_dispatches, p.max_dispatches)
    think = 0.0
    for d in range(dispatches):
        n_calls = 1 if agent == 0 else rng.randint(1, p.max_calls_per_dispatch)
        for _ in range(n_calls):
            out = scaled(p.output_tokens, p.token_scale)
            prompt = (anchors[names[agent]], *history)
            calls.append(Call(prompt, out, think=think, stop="tool_use", agent=names[agent]))
            key = f"{sid}/h{len(calls)}"
            history.append(sized(f"{key}/out", out, role="assistant"))
            history.append(sized(f"{key}/tool", scaled(p.tool_result_tokens, p.token_scale)))
            think = pareto_pause(rng, p.pause_alpha, p.pause_min, p.pause_cap)
        if d >= p.min_dispatches - 1:
            nxt = rng.choices(range(len(table[agent])), weights=table[agent])[0]
            if nxt == len(table[agent]) - 1:
                break
        else:
            nxt = rng.choices(range(1, len(names)), weights=table[agent][1:-1])[0]
        agent = nxt
    last = calls[-1]
    calls[-1] = Call(last.prompt, last.max_tokens, last.think, "end_turn", last.agent)
    return SessionScript(sid, tuple(calls), start=start, agent="supervisor")
