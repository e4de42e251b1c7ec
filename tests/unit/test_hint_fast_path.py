"""The hand-checked common agent_hint gives what pydantic's AgentHintParams gives, and leaves
every other shape to it."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.hint_schema import AgentHintParams
from proxy.hints import _plain_hint

CASES: list[Any] = [
    {"session_id": "s1"},
    {"session_id": "s1", "parent_session_id": "p"},
    {"session_id": "s1", "cache_control": {"type": "ephemeral", "ttl": 300}},
    {"session_id": "s1", "cache_control": {"ttl": 0.5}},
    {"session_id": "s1", "cache_control": {}},
    {"session_id": "s1", "cache_control": None},
    {"session_id": None},
    {},
    {"session_id": "s1", "cache_control": {"type": "persistent", "ttl": 3}},
    {"session_id": "s1", "cache_control": {"ttl": True}},
    {"session_id": "s1", "cache_control": {"ttl": "300"}},
    {"session_id": "s1", "cache_control": {"ttl": -1}},
    {"session_id": "s1", "cache_control": {"ttl": 3601}},
    {"session_id": "s1", "cache_control": {"ttl": float("nan")}},
    {"session_id": "s1", "cache_control": {"ttl": 5, "block_offset": 2}},
    {"session_id": 7},
    {"session_id": "s1", "extra": 1},
    {"session_id": "s1", "cache_control": []},
]


@pytest.mark.parametrize("raw", CASES)
def test_plain_hint_agrees_with_the_model(raw: dict[str, Any]) -> None:
    plain = _plain_hint(raw)
    try:
        params = AgentHintParams.model_validate(raw)
    except ValueError:
        assert plain is None  # what the model rejects is left to it
        return
    if plain is None:  # a shape the fast path leaves to the model
        return
    cc = params.cache_control
    assert plain == (params.session_id, params.parent_session_id, cc.ttl if cc else None)
    assert cc is None or cc.block_offset is None
