"""The hand-checked common agent_hint gives what pydantic's AgentHintParams gives, and leaves
every other shape to it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from multidict import CIMultiDict

from proxy import hints
from proxy.errors import BadRequest
from proxy.hint_model import Hint
from proxy.hint_schema import AgentHintParams
from proxy.hints import _plain_hint
from proxy.settings import Limits

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


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
REQUESTS: list[tuple[str, dict[str, str], dict[str, Any]]] = [
    ("/v1/chat/completions", {}, {**BODY, "agent_hint": {"session_id": "s1"}}),
    (
        "/v1/chat/completions",
        {},
        {**BODY, "agent_hint": {"session_id": "s1", "cache_control": {"ttl": 300}}},
    ),
    ("/v1/completions", {}, {"agent_hint": {"session_id": "s1", "parent_session_id": "p"}, **BODY}),
    (
        "/v1/chat/completions",
        {},
        {**BODY, "agent_hint": {"session_id": "s", "parent_session_id": "s"}},
    ),
    (
        "/v1/chat/completions",
        {},
        {**BODY, "agent_hint": {"session_id": "s1", "cache_control": {"ttl": 3600}}},
    ),
    ("/v1/chat/completions", {}, {**BODY, "agent_hint": {"session_id": " "}}),
    ("/v1/chat/completions", {}, {**BODY, "agent_hint": {"session_id": "x" * 300}}),
    ("/v1/chat/completions", {}, {**BODY, "agent_hint": {"session_id": "s\u00e9"}}),
    ("/v1/chat/completions", {}, {**BODY, "agent_hint": {"session_id": "a\tb"}}),
    ("/v1/chat/completions", {}, {**BODY, "agent_hint": {"parent_session_id": "p"}}),
    (
        "/v1/chat/completions",
        {},
        {**BODY, "agent_hint": {"session_id": "s1"}, "prompt_cache_key": "k"},
    ),
    ("/v1/chat/completions", {"X-Session-Id": "s1"}, {**BODY, "agent_hint": {"session_id": "s1"}}),
    ("/v1/chat/completions", {"X-Agent-Name": "a"}, {**BODY, "agent_hint": {"session_id": "s1"}}),
    ("/v1/chat/completions", {"X-Cache-TTL": "60"}, {**BODY, "agent_hint": {"session_id": "s1"}}),
    ("/v1/messages", {}, {**BODY, "agent_hint": {"session_id": "s1"}}),
    ("/v1/chat/completions", {}, {**BODY, "agent_hint": "s1"}),
]


@pytest.mark.parametrize(("route", "headers", "body"), REQUESTS)
def test_common_hint_parses_as_the_draft_does(
    route: str, headers: dict[str, str], body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The common hinted request's shortcut (``_common_hint``) gives the request the general
    path gives it: the same hint, body and parsed body, or the same error."""
    raw = json.dumps(body).encode()
    limits = Limits()

    def parse() -> Any:
        try:
            return hints.parse_request(route, CIMultiDict(headers), raw, limits)
        except BadRequest as exc:
            return ("error", str(exc), exc.param)

    quick = parse()
    monkeypatch.setattr(hints, "_common_hint", lambda *_: None)
    assert parse() == quick


def test_common_hint_takes_the_plain_agent_hint() -> None:
    body = {**BODY, "agent_hint": {"session_id": "s1", "cache_control": {"ttl": 300}}}
    hint = hints._common_hint("/v1/chat/completions", CIMultiDict(), body, Limits())
    assert hint == Hint("s1", ttl_s=300.0, dialects=("agent_hint",))
    assert body == BODY  # the member removed
