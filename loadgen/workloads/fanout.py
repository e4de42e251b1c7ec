"""``fanout``: fan-out / join.

A leader builds a long context over a few tool-paused turns, then spawns ``workers`` sub-agents
that share that whole context as a prefix, each adding its own instruction and running several
tool-paused turns; the leader waits for all of them, appends their results and continues. Jobs
arrive at ``arrival_rate``. The shared context is the prefix worth protecting while workers run;
each worker's private branch is dead once it finishes (what an ``evict`` hint says).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from loadgen.workloads.base import (
    Call,
    Segment,
    SessionScript,
    Spawn,
    Step,
    Stop,
    Workload,
    pareto_pause,
    scaled,
    sized,
)


@dataclass(frozen=True, slots=True)
class FanoutParams:
    seed: int = 0
    jobs: int = 4
    arrival_rate: float = 0.1  # jobs per second (Poisson)
    system_tokens: int = 2000  # the leader's anchor, shared by all jobs
    context_tokens: int = 12000  # what the leader reads before fanning out
    build_turns: int = 3
    workers: int = 4
    worker_task_tokens: int = 200
    worker_turns: int = 3
    tool_result_tokens: int = 400
    output_tokens: int = 128
    join_turns: int = 2
    pause_alpha: float = 1.5
    pause_min: float = 1.0
    pause_cap: float = 60.0
    token_scale: float = 1.0


def build(p: FanoutParams) -> Workload:
    rng = random.Random(p.seed)
    system = sized("shared/fanout/system", scaled(p.system_tokens, p.token_scale), role="system")
    sessions = []
    t = 0.0
    for j in range(p.jobs):
        t += rng.expovariate(p.arrival_rate) if j else 0.0
        sessions.append(_job(p, rng, f"fanout-j{j}", t, system))
    return Workload("fanout", tuple(sessions), api="chat", params=asdict(p))


def _job(
    p: FanoutParams, rng: random.Random, sid: str, start: float, system: Segment
) -> SessionScript:
    out = scaled(p.output_tokens, p.token_scale)
    ctx: list[Segment] = [system, sized(f"{sid}/task", scaled(300, p.token_scale))]
    steps: list[Step] = []
    chunk = scaled(p.context_tokens / max(1, p.build_turns), p.token_scale)
    think = 0.0
    for k in range(p.build_turns):
        steps.append(Call(tuple(ctx), out, think=think, stop="tool_use", agent="leader"))
        ctx += [sized(f"{sid}/b{k}/out", out, role="assistant"), sized(f"{sid}/b{k}/read", chunk)]
        think = pareto_pause(rng, p.pause_alpha, p.pause_min, p.pause_cap)
    workers = tuple(_worker(p, rng, f"{sid}-w{w}", tuple(ctx)) for w in range(p.workers))
    steps.append(Spawn(workers, wait=True))
    ctx += [sized(f"{sid}-w{w}/result", out) for w in range(p.workers)]
    for k in range(p.join_turns):
        stop: Stop = "tool_use" if k < p.join_turns - 1 else "end_turn"
        think = 0.0 if k == 0 else pareto_pause(rng, p.pause_alpha, p.pause_min, p.pause_cap)
        steps.append(Call(tuple(ctx), out, think=think, stop=stop, agent="leader"))
        ctx += [sized(f"{sid}/j{k}/out", out, role="assistant"), sized(f"{sid}/j{k}/tool", out)]
    return SessionScript(sid, tuple(steps), start=start, agent="leader")


def _worker(
    p: FanoutParams, rng: random.Random, sid: str, shared: tuple[Segment, ...]
) -> SessionScript:
    out = scaled(p.output_tokens, p.token_scale)
    ctx = [*shared, sized(f"{sid}/task", scaled(p.worker_task_tokens, p.token_scale))]
    calls = []
    think = rng.uniform(0.1, 1.0)  # spawn delay
    for k in range(p.worker_turns):
        stop: Stop = "tool_use" if k < p.worker_turns - 1 else "end_turn"
        calls.append(Call(tuple(ctx), out, think=think, stop=stop, agent="worker"))
        tool = scaled(p.tool_result_tokens, p.token_scale)
        ctx += [sized(f"{sid}/t{k}/out", out, role="assistant"), sized(f"{sid}/t{k}/tool", tool)]
        think = pareto_pause(rng, p.pause_alpha, p.pause_min, p.pause_cap)
    return SessionScript(sid, tuple(calls), agent="worker")
