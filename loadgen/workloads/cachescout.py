"""``cachescout``: the setting of CacheScout's evaluation, small and congested.

Six agents under one supervisor (LangGraph-supervisor style): every user session alternates a
supervisor call (which picks the next agent, LLM-selected routing) with a call of the agent it
picked, until the supervisor ends the session. Routing is Markov-like: the next agent depends on
the one that just ran, through a seeded transition table whose rows have one dominant successor
(``top_prob``: in CacheScout's setting the next agent is mostly predictable). Every agent's prompt
starts with its fixed context: system prompt, tool definitions and few-shot examples (three
system segments), then the session's task and history. Blocks are 16 tokens, and with the
defaults the largest request is ~93 blocks, the footprint CacheScout's capacity sweep starts
from; run it against a pool of 100-200 blocks (``kvkeeper bench compare --num-blocks``), where
the pool holds one or two requests' worth and anchors compete with each other.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from loadgen.workloads.base import (
    Call,
    Role,
    Segment,
    SessionScript,
    Workload,
    pareto_pause,
    scaled,
    sized,
)

BLOCK_TOKENS = 16
AGENTS = ("supervisor", "researcher", "coder", "analyst", "writer", "reviewer")


@dataclass(frozen=True, slots=True)
class CacheScoutParams:
    seed: int = 0
    users: int = 60  # user sessions
    arrival_rate: float = 0.5  # user sessions per second (Poisson)
    system_min: int = 100  # per agent, drawn uniformly in [min, max]
    system_max: int = 200
    tools_min: int = 150
    tools_max: int = 300
    fewshot_min: int = 150
    fewshot_max: int = 300
    task_tokens: int = 64  # the user's request
    route_tokens: int = 16  # the supervisor's routing decision, appended to the history
    output_tokens: int = 40  # an agent's answer
    tool_result_tokens: int = 96  # appended after every agent call
    min_dispatches: int = 2
    max_calls_per_dispatch: int = 2  # an agent's calls per dispatch (tool calls in between)
    max_dispatches: int = 10
    top_prob: float = 0.8  # probability of each row's dominant successor
    end_prob: float = 0.2  # after min_dispatches: chance the supervisor ends the session
    pause_alpha: float = 1.5  # Pareto tool pauses after agent calls
    pause_min: float = 0.5
    pause_cap: float = 10.0
    token_scale: float = 1.0


def transition_table(rng: random.Random, n: int, top_prob: float) -> list[list[float]]:
    """Row ``i`` (agent ``i`` just ran, 0 = session start): next agent among ``1..n-1``. The
    dominant successors form one seeded cycle through every agent (so all of them run), each
    with ``top_prob``; the rest of a row is spread evenly over the other agents."""
    cycle = list(range(1, n))
    rng.shuffle(cycle)
    top = {cycle[k]: cycle[(k + 1) % len(cycle)] for k in range(len(cycle))}
    top[0] = cycle[0]
    rows: list[list[float]] = []
    for i in range(n):
        others = [j for j in range(1, n) if j != i]
        rest = (1.0 - top_prob) / max(1, len(others) - 1)
        row = [0.0] * n
        for j in others:
            row[j] = top_prob if j == top[i] else rest
        rows.append(row)
    return rows


def build(p: CacheScoutParams) -> Workload:
    if not 0 < p.top_prob <= 1 or not 0 <= p.end_prob <= 1:
        raise ValueError("cachescout: top_prob must be in (0, 1] and end_prob in [0, 1]")
    if not 1 <= p.min_dispatches <= p.max_dispatches:
        raise ValueError("cachescout: need 1 <= min_dispatches <= max_dispatches")
    rng = random.Random(p.seed)
    anchors: dict[str, tuple[Segment, ...]] = {}
    for name in AGENTS:
        parts = (
            ("system", p.system_min, p.system_max),
            ("tools", p.tools_min, p.tools_max),
            ("fewshot", p.fewshot_min, p.fewshot_max),
        )
        anchors[name] = tuple(
            sized(
                f"shared/anchor/{name}/{part}",
                scaled(rng.randint(lo, hi), p.token_scale),
                role="system",
                block_tokens=BLOCK_TOKENS,
            )
            for part, lo, hi in parts
        )
    table = transition_table(rng, len(AGENTS), p.top_prob)
    t = 0.0
    sessions = []
    for u in range(p.users):
        t += rng.expovariate(p.arrival_rate) if u else 0.0
        sessions.append(_session(p, rng, f"cs-u{u}", t, anchors, table))
    return Workload(
        "cachescout", tuple(sessions), block_tokens=BLOCK_TOKENS, api="chat", params=asdict(p)
    )


def _session(
    p: CacheScoutParams,
    rng: random.Random,
    sid: str,
    start: float,
    anchors: dict[str, tuple[Segment, ...]],
    table: list[list[float]],
) -> SessionScript:
    def seg(key: str, n: int, role: Role = "user") -> Segment:
        return sized(key, scaled(n, p.token_scale), role=role, block_tokens=BLOCK_TOKENS)

    task = seg(f"{sid}/task", p.task_tokens)
    board = [task]  # the supervisor's view: the task, its routing turns and the agents' answers
    views: dict[str, list[Segment]] = {}  # each agent's own view: the task and its own turns
    calls: list[Call] = []
    prev, think, dispatches = 0, 0.0, 0
    while True:
        route = scaled(p.route_tokens, p.token_scale)
        sup_prompt = (*anchors["supervisor"], *board)
        calls.append(Call(sup_prompt, route, think=think, stop="tool_use", agent="supervisor"))
        handoff = seg(f"{sid}/r{dispatches}", p.route_tokens, "assistant")
        board.append(handoff)
        think = 0.0
        if dispatches >= p.max_dispatches or (
            dispatches >= p.min_dispatches and rng.random() < p.end_prob
        ):
            break
        prev = rng.choices(range(len(AGENTS)), weights=table[prev])[0]
        agent = AGENTS[prev]
        view = views.setdefault(agent, [task])
        view.append(handoff)
        for k in range(rng.randint(1, p.max_calls_per_dispatch)):
            out = scaled(p.output_tokens, p.token_scale)
            call = Call((*anchors[agent], *view), out, think=think, stop="tool_use", agent=agent)
            calls.append(call)
            view.append(seg(f"{sid}/o{dispatches}.{k}", p.output_tokens, "assistant"))
            view.append(seg(f"{sid}/t{dispatches}.{k}", p.tool_result_tokens))
            think = pareto_pause(rng, p.pause_alpha, p.pause_min, p.pause_cap)
        board.append(seg(f"{sid}/a{dispatches}", p.output_tokens, "assistant"))
        dispatches += 1
    last = calls[-1]
    calls[-1] = Call(last.prompt, last.max_tokens, last.think, "end_turn", last.agent)
    return SessionScript(sid, tuple(calls), start=start, agent="supervisor")
