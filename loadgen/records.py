"""What a run recorded: every request, management call and session as the client saw it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One model call as the client saw it; times in seconds from the run start."""

    session_id: str
    parent_id: str | None
    agent: str | None
    turn: int
    t_sched: float
    t_start: float
    t_end: float = 0.0
    ttft: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    expected_prompt_tokens: int = 0
    stop: str = "end_turn"
    status: int = 0
    error: str | None = None
    response_id: str | None = None  # the engine's id of the answer (the simulator's names it)
    # the simulator only (usage.sim_engine_ttft_s / sim_speed): the engine's own wall seconds
    # from arrival to first token, and how many times faster than its profile it ran
    engine_ttft: float | None = None
    engine_speed: float = 1.0

    @property
    def latency(self) -> float:
        return self.t_end - self.t_start


@dataclass(slots=True)
class ManageRecord:
    session_id: str
    edit: str
    t_start: float
    t_end: float
    status: int
    results: list[dict[str, Any]]
    error: str | None = None


@dataclass(slots=True)
class SessionRecord:
    session_id: str
    parent_id: str | None
    t_start: float
    t_end: float


@dataclass(slots=True)
class RunResult:
    workload: str
    params: dict[str, Any]
    target: dict[str, Any]
    options: dict[str, Any]
    started_at: float  # unix time
    duration: float
    requests: list[RequestRecord]
    manages: list[ManageRecord]
    sessions: list[SessionRecord]
    kvkeeper: dict[str, float] | None = None  # counter deltas over the run, when readable
    label: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RunResult:
        return cls(
            **{k: v for k, v in doc.items() if k not in ("requests", "manages", "sessions")},
            requests=[RequestRecord(**r) for r in doc["requests"]],
            manages=[ManageRecord(**m) for m in doc.get("manages", [])],
            sessions=[SessionRecord(**s) for s in doc.get("sessions", [])],
        )

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> RunResult:
        return cls.from_json(json.loads(Path(path).read_text()))
