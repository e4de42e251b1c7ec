"""What a client sends in each hint mode, through kvkeeper's public dialects only.

* ``none``: a plain OpenAI client.
* ``session``: the ``X-Session-Id`` header on every call.
* ``full``: what a well-integrated agent framework would send: ``X-Agent-Name`` and an
  ``agent_hint`` body field with the session and parent ids and, on calls that end in a tool
  call, ``cache_control.ttl`` = ``ttl_factor`` x the coming pause (capped); a management
  ``evict`` when a session (sub-agent, branch, conversation) finishes; a management ``prefetch``
  ``prefetch_lead`` seconds before a resume that follows a long enough pause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

HintMode = Literal["none", "session", "full"]
HINT_MODES: tuple[HintMode, ...] = ("none", "session", "full")
EditType = Literal["offload", "prefetch", "evict"]
MAX_TTL = 3600.0  # the RFC's bound; kvkeeper rejects more


@dataclass(frozen=True, slots=True)
class HintPolicy:
    """How hints are chosen; times are in run seconds (after time scaling)."""

    mode: HintMode = "none"
    ttl_factor: float = 2.0
    ttl_cap: float = 600.0
    ttl_unknown_pause: float = 60.0  # TTL before a join whose length the client cannot know
    prefetch_lead: float = 1.0
    min_prefetch_pause: float = 3.0
    end_turn_ttl: float = 0.0  # TTL asked on calls that end a turn (0: none); an experiment
    end_turn_from: int = 0  # ... from this step of a session on (0: its first call)
    end_evict: bool = True  # ``evict`` when a session finishes (False: the client never knows)

    def ttl_for(self, pause: float | None) -> float:
        """Retention asked for across a tool pause of ``pause`` seconds (``None``: unknown)."""
        ttl = self.ttl_unknown_pause if pause is None else self.ttl_factor * pause
        return round(min(ttl, self.ttl_cap, MAX_TTL), 3)

    def wants_prefetch(self, pause: float) -> bool:
        return self.mode == "full" and pause >= max(self.min_prefetch_pause, self.prefetch_lead)


@dataclass(frozen=True, slots=True)
class CallHints:
    headers: dict[str, str]
    body: dict[str, Any]


def call_hints(
    policy: HintPolicy,
    *,
    session_id: str,
    parent_id: str | None,
    agent: str | None,
    tool_pause: float | None,
    ends_in_tool_call: bool,
    step: int = 0,
) -> CallHints:
    """Headers and extra body fields for one model call."""
    if policy.mode == "none":
        return CallHints({}, {})
    if policy.mode == "session":
        return CallHints({"X-Session-Id": session_id}, {})
    hint: dict[str, Any] = {"session_id": session_id}
    if parent_id is not None:
        hint["parent_session_id"] = parent_id
    if ends_in_tool_call:
        hint["cache_control"] = {"type": "ephemeral", "ttl": policy.ttl_for(tool_pause)}
    elif policy.end_turn_ttl > 0 and step >= policy.end_turn_from:
        ttl = round(min(policy.end_turn_ttl, MAX_TTL), 3)
        hint["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    headers = {"X-Agent-Name": agent} if agent else {}
    return CallHints(headers, {"agent_hint": hint})


def manage_body(
    model: str, *, session_id: str, parent_id: str | None, edit: EditType
) -> dict[str, Any]:
    """A management request (kvkeeper answers it itself; it never reaches the model)."""
    hint: dict[str, Any] = {
        "session_id": session_id,
        "context_management": {"manage_request": True, "edits": [{"type": edit}]},
    }
    if parent_id is not None:
        hint["parent_session_id"] = parent_id
    return {
        "model": model,
        "messages": [{"role": "user", "content": ""}],
        "max_tokens": 1,
        "agent_hint": hint,
    }
