"""The workload model: sessions of calls and sub-agent spawns over named token blocks.

A :class:`Workload` is pure data, built deterministically from a seed; the runner plays it against
an engine and the ceiling calculator plays it offline. Content is described by :class:`Segment` s
of logical blocks whose tokens come from :mod:`loadgen.tokens`, so prompts that name the same
blocks in the same order share a token prefix.

Namespace convention: a namespace starting with ``shared/`` holds content that several
conversations share on purpose (agent anchors, a common system prompt); every other namespace is
private to one conversation (the ceiling's lane model renames private namespaces when it splits
a conversation).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from loadgen.tokens import Piece

Role = Literal["system", "user", "assistant"]
Stop = Literal["tool_use", "end_turn"]
Api = Literal["chat", "completions", "completions-ids"]
SHARED_PREFIX = "shared/"


@dataclass(frozen=True, slots=True)
class Segment:
    """Consecutive logical blocks of one namespace; one chat message when rendered as chat."""

    namespace: str
    ids: Sequence[int]
    block_tokens: int
    last_tokens: int | None = None  # length of the final block when it is partial
    role: Role = "user"

    @property
    def n_tokens(self) -> int:
        if not self.ids:
            return 0
        last = self.block_tokens if self.last_tokens is None else self.last_tokens
        return (len(self.ids) - 1) * self.block_tokens + last

    def pieces(self) -> Iterator[Piece]:
        ns, bt, n = self.namespace, self.block_tokens, len(self.ids)
        for i, block_id in enumerate(self.ids):
            size = self.last_tokens if (i == n - 1 and self.last_tokens is not None) else bt
            yield (ns, block_id, size)


def sized(namespace: str, n_tokens: int, *, role: Role = "user", block_tokens: int = 32) -> Segment:
    """A segment of ``n_tokens`` tokens cut into ``block_tokens`` blocks numbered from 0."""
    n_tokens = max(1, n_tokens)
    full, rest = divmod(n_tokens, block_tokens)
    count = full + (1 if rest else 0)
    return Segment(namespace, range(count), block_tokens, rest or None, role)


@dataclass(frozen=True, slots=True)
class Call:
    """One model call. ``think`` is the pause after the session's previous call finished (or,
    for the first call, after the session started); ``stop`` says whether the call ends in a
    tool call (the session comes back after a tool pause) or ends the turn."""

    prompt: tuple[Segment, ...]
    max_tokens: int
    think: float = 0.0
    stop: Stop = "end_turn"
    agent: str | None = None
    api_time: float | None = None  # recorded service time, used by the offline ceiling
    # due time after the session's start (trace replays: the recorded arrival); set, it replaces
    # ``think`` as the schedule, and the call still waits for the session's previous one
    at: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(s.n_tokens for s in self.prompt)

    def pieces(self) -> Iterator[Piece]:
        for seg in self.prompt:
            yield from seg.pieces()


@dataclass(frozen=True, slots=True)
class Spawn:
    """Start child sessions (sub-agents, workers) when the previous call has finished; with
    ``wait`` the parent's next call also waits until all of them are done."""

    children: tuple[SessionScript, ...]
    wait: bool = True


Step = Call | Spawn


@dataclass(frozen=True, slots=True)
class SessionScript:
    """A session: steps in order. ``start`` is the offset from the run start for a root session
    and the delay after the spawning call finished for a child."""

    session_id: str
    steps: tuple[Step, ...]
    start: float = 0.0
    agent: str | None = None

    def calls(self) -> Iterator[Call]:
        """Every call of this session and its descendants."""
        for step in self.steps:
            if isinstance(step, Call):
                yield step
            else:
                for child in step.children:
                    yield from child.calls()


@dataclass(frozen=True, slots=True)
class Workload:
    """A deterministic workload: root sessions plus what produced them."""

    name: str
    sessions: tuple[SessionScript, ...]
    block_tokens: int = 32  # block size the ceiling calculator hashes prompts with
    api: Api = "chat"  # request form the runner uses unless told otherwise
    params: Mapping[str, Any] = field(default_factory=dict)

    def calls(self) -> Iterator[Call]:
        for s in self.sessions:
            yield from s.calls()

    def n_calls(self) -> int:
        return sum(1 for _ in self.calls())


def next_pause(steps: Sequence[Step], index: int) -> float | None:
    """The pause after call ``steps[index]`` before the session's next call, if it is known
    (``None`` when a spawn follows, whose length the client cannot know, or at the end)."""
    if index + 1 < len(steps):
        nxt = steps[index + 1]
        if isinstance(nxt, Call):
            return nxt.think
    return None


def scaled(n_tokens: float, token_scale: float) -> int:
    """A token count under ``token_scale``, at least one token."""
    return max(1, round(n_tokens * token_scale))


def pareto_pause(rng: Any, alpha: float, minimum: float, cap: float) -> float:
    """A heavy-tailed pause (Pareto with shape ``alpha`` and scale ``minimum``), capped."""
    return float(min(cap, minimum * rng.paretovariate(alpha)))
