"""Every dialect parses into one Hint; every RFC validation rule rejects with a clear message."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy import jsonio
from proxy.errors import BadRequest
from proxy.hint_model import Edit
from proxy.hints import parse_request
from proxy.settings import Limits

LIMITS = Limits()
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    route: str = "/v1/chat/completions",
    limits: Limits = LIMITS,
):  # type: ignore[no-untyped-def]
    return parse_request(route, headers or {}, json.dumps(body).encode(), limits)


def test_plain_request_is_not_parsed_and_bytes_are_unchanged() -> None:
    raw = b'{"model":"m",  "messages":[]}'
    out = parse_request("/v1/chat/completions", {}, raw, LIMITS)
    assert out.hint is None and out.body is raw and out.json_body is None


def test_agent_hint_full_schema() -> None:
    body = {
        **CHAT,
        "agent_hint": {
            "session_id": "worker-7",
            "parent_session_id": "orchestrator-1",
            "cache_control": {"type": "ephemeral", "ttl": 300, "block_offset": 4},
            "context_management": {
                "edits": [{"type": "offload"}, {"type": "evict", "block_start": 1, "block_end": 3}]
            },
        },
    }
    out = parse(body)
    h = out.hint
    assert h is not None
    assert (h.session_id, h.parent_session_id, h.ttl_s, h.block_offset) == (
        "worker-7",
        "orchestrator-1",
        300.0,
        4,
    )
    assert h.edits == (Edit("offload"), Edit("evict", 1, 3))
    assert h.dialects == ("agent_hint",) and not h.manage_request
    assert "agent_hint" not in json.loads(out.body)
    assert json.loads(out.body) == CHAT


def test_agent_hint_ttl_default_is_rfc_300() -> None:
    h = parse({**CHAT, "agent_hint": {"session_id": "s", "cache_control": {}}}).hint
    assert h is not None and h.ttl_s == 300.0


def test_headers_dialect() -> None:
    out = parse(
        CHAT,
        {
            "X-Session-Id": "s1",
            "X-Parent-Session-Id": "p1",
            "X-Agent-Name": "planner",
            "X-Cache-TTL": "120",
        },
    )
    h = out.hint
    assert h is not None and (h.session_id, h.parent_session_id, h.agent_name, h.ttl_s) == (
        "s1",
        "p1",
        "planner",
        120.0,
    )
    assert h.dialects == ("headers",)


def test_openai_dialect_and_retention_classes() -> None:
    out = parse({**CHAT, "prompt_cache_key": "conv-9", "prompt_cache_retention": "in_memory"})
    assert (
        out.hint is not None
        and out.hint.session_id == "conv-9"
        and out.hint.ttl_s == LIMITS.default_ttl_s
    )
    assert out.hint.retention == "default"
    assert json.loads(out.body) == CHAT
    long = parse({**CHAT, "prompt_cache_key": "conv-9", "prompt_cache_retention": "24h"}).hint
    # the GPU keeps it for its cap; the rest of the day is kept in the offload tier
    assert long is not None and long.retention == "extended" and long.ttl_s == 3600.0
    assert long.retain_s == 24 * 3600.0 and out.hint.retain_s is None
    only_key = parse({**CHAT, "prompt_cache_key": "k"}).hint
    assert only_key is not None and only_key.ttl_s is None


def test_anthropic_cache_control_breakpoints_are_stripped() -> None:
    body = {
        "model": "m",
        "max_tokens": 10,
        "system": [
            {"type": "text", "text": "sys", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}],
            },
            {"role": "user", "content": "b"},
        ],
    }
    out = parse(body, route="/v1/messages")
    h = out.hint
    assert h is not None and h.dialects == ("anthropic",)
    assert h.ttl_s == 3600.0  # the longest breakpoint TTL
    assert h.breakpoint == ("messages", 0)
    assert h.session_id.startswith("prefix-")
    assert b"cache_control" not in out.body
    # same prefix, different tail -> same derived session
    body2 = json.loads(json.dumps(body))
    body2["messages"][1]["content"] = "different tail"
    h2 = parse(body2, route="/v1/messages").hint
    assert h2 is not None and h2.session_id == h.session_id


def test_anthropic_cache_control_on_chat_route_is_left_alone() -> None:
    body = {
        **CHAT,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
            }
        ],
    }
    out = parse(body)
    assert out.hint is None and json.loads(out.body) == body


def test_header_and_body_session_must_agree() -> None:
    with pytest.raises(BadRequest, match="conflicts"):
        parse({**CHAT, "agent_hint": {"session_id": "a"}}, {"X-Session-Id": "b"})
    h = parse(
        {**CHAT, "agent_hint": {"session_id": "a", "cache_control": {"ttl": 10}}},
        {"X-Session-Id": "a", "X-Cache-TTL": "99"},
    ).hint
    assert h is not None and h.ttl_s == 10.0  # agent_hint wins over the header TTL
    assert h.dialects == ("agent_hint", "headers")


def test_ttl_above_configured_cap_is_capped_and_noted() -> None:
    h = parse(
        {**CHAT, "agent_hint": {"session_id": "s", "cache_control": {"ttl": 3000}}},
        limits=Limits(max_ttl_s=600, default_ttl_s=60),
    ).hint
    assert h is not None and h.ttl_s == 600 and h.notes == ("ttl_capped",)
    assert h.retain_s == 3000  # beyond the GPU's cap: asked of the offload tier
    capped = parse(
        {**CHAT, "prompt_cache_key": "k", "prompt_cache_retention": "24h"},
        limits=Limits(max_ttl_s=600, max_retain_s=7200),
    ).hint
    assert capped is not None and (capped.ttl_s, capped.retain_s) == (600, 7200)


def test_manage_request() -> None:
    h = parse(
        {
            **CHAT,
            "agent_hint": {
                "session_id": "s",
                "context_management": {"manage_request": True, "edits": [{"type": "prefetch"}]},
            },
        }
    ).hint
    assert h is not None and h.manage_request and h.edits == (Edit("prefetch"),)


BAD: list[tuple[str, dict[str, Any], dict[str, str], str]] = [
    (
        "ttl above 3600",
        {"agent_hint": {"session_id": "s", "cache_control": {"ttl": 3601}}},
        {},
        "less than or equal to 3600",
    ),
    (
        "negative ttl",
        {"agent_hint": {"session_id": "s", "cache_control": {"ttl": -1}}},
        {},
        "greater than or equal to 0",
    ),
    (
        "ttl as string",
        {"agent_hint": {"session_id": "s", "cache_control": {"ttl": "300"}}},
        {},
        "agent_hint.cache_control.ttl",
    ),
    (
        "ttl as bool",
        {"agent_hint": {"session_id": "s", "cache_control": {"ttl": True}}},
        {},
        "agent_hint.cache_control.ttl",
    ),
    (
        "cache type",
        {"agent_hint": {"session_id": "s", "cache_control": {"type": "persistent"}}},
        {},
        "ephemeral",
    ),
    (
        "negative block_offset",
        {"agent_hint": {"session_id": "s", "cache_control": {"block_offset": -2}}},
        {},
        "block_offset",
    ),
    (
        "start without end",
        {
            "agent_hint": {
                "session_id": "s",
                "context_management": {"edits": [{"type": "evict", "block_start": 2}]},
            }
        },
        {},
        "supplied together",
    ),
    (
        "end without start",
        {
            "agent_hint": {
                "session_id": "s",
                "context_management": {"edits": [{"type": "evict", "block_end": 2}]},
            }
        },
        {},
        "supplied together",
    ),
    (
        "empty range",
        {
            "agent_hint": {
                "session_id": "s",
                "context_management": {
                    "edits": [{"type": "evict", "block_start": 3, "block_end": 3}]
                },
            }
        },
        {},
        "less than block_end",
    ),
    (
        "reversed range",
        {
            "agent_hint": {
                "session_id": "s",
                "context_management": {
                    "edits": [{"type": "evict", "block_start": 5, "block_end": 1}]
                },
            }
        },
        {},
        "less than block_end",
    ),
    (
        "negative block_start",
        {
            "agent_hint": {
                "session_id": "s",
                "context_management": {
                    "edits": [{"type": "evict", "block_start": -1, "block_end": 1}]
                },
            }
        },
        {},
        "block_start",
    ),
    (
        "unknown edit type",
        {
            "agent_hint": {
                "session_id": "s",
                "context_management": {"edits": [{"type": "compress"}]},
            }
        },
        {},
        "edits.0.type",
    ),
    (
        "unknown field",
        {"agent_hint": {"session_id": "s", "priority": 3}},
        {},
        "agent_hint.priority",
    ),
    ("hint not an object", {"agent_hint": "s1"}, {}, "must be an object"),
    ("empty session id", {"agent_hint": {"session_id": ""}}, {}, "non-empty"),
    (
        "session id with control chars",
        {"agent_hint": {"session_id": "a\nb"}},
        {},
        "control characters",
    ),
    ("session id too long", {"agent_hint": {"session_id": "x" * 300}}, {}, "longer than"),
    (
        "parent equals session",
        {"agent_hint": {"session_id": "s", "parent_session_id": "s"}},
        {},
        "must differ",
    ),
    (
        "ttl without session",
        {"agent_hint": {"cache_control": {"ttl": 10}}},
        {},
        "session id is required",
    ),
    (
        "edits without session",
        {"agent_hint": {"context_management": {"edits": [{"type": "evict"}]}}},
        {},
        "session id is required",
    ),
    (
        "manage without edits",
        {"agent_hint": {"session_id": "s", "context_management": {"manage_request": True}}},
        {},
        "at least one edit",
    ),
    (
        "too many edits",
        {
            "agent_hint": {
                "session_id": "s",
                "context_management": {"edits": [{"type": "evict"}] * 17},
            }
        },
        {},
        "at most 16 edits",
    ),
    ("header ttl not a number", {}, {"X-Session-Id": "s", "X-Cache-TTL": "soon"}, "X-Cache-TTL"),
    (
        "header ttl out of range",
        {},
        {"X-Session-Id": "s", "X-Cache-TTL": "7200"},
        "between 0 and 3600",
    ),
    ("header ttl nan", {}, {"X-Session-Id": "s", "X-Cache-TTL": "nan"}, "between 0 and 3600"),
    ("header ttl without session", {}, {"X-Cache-TTL": "10"}, "session id is required"),
    (
        "bad retention",
        {"prompt_cache_key": "k", "prompt_cache_retention": "forever"},
        {},
        "in_memory",
    ),
    ("bad cache key", {"prompt_cache_key": 12}, {}, "prompt_cache_key"),
]


@pytest.mark.parametrize(
    ("body_extra", "headers", "message"), [c[1:] for c in BAD], ids=[c[0] for c in BAD]
)
def test_invalid_hints_are_rejected(
    body_extra: dict[str, Any], headers: dict[str, str], message: str
) -> None:
    with pytest.raises(BadRequest) as info:
        parse({**CHAT, **body_extra}, headers)
    assert message in info.value.message
    assert info.value.status == 400 and info.value.code == "invalid_hint"


@pytest.mark.parametrize(
    "cc",
    [
        {"type": "persistent"},
        {"type": "ephemeral", "ttl": "10m"},
        {"type": "ephemeral", "extra": 1},
        "yes",
    ],
)
def test_invalid_anthropic_cache_control(cc: Any) -> None:
    body = {
        "model": "m",
        "system": [{"type": "text", "text": "s", "cache_control": cc}],
        "messages": [],
    }
    with pytest.raises(BadRequest):
        parse(body, route="/v1/messages")


def test_more_than_four_anthropic_breakpoints() -> None:
    blocks = [
        {"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}} for i in range(5)
    ]
    with pytest.raises(BadRequest, match="at most 4"):
        parse({"model": "m", "system": blocks, "messages": []}, route="/v1/messages")


def test_invalid_json_with_hint_marker() -> None:
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_request("/v1/chat/completions", {}, b'{"agent_hint": ', LIMITS)


@pytest.mark.parametrize(
    ("raw", "forwarded"),
    [
        # orjson would read the wide integer as a float and NaN not at all: the stdlib path keeps them
        (
            b'{"seed":123456789012345678901234,"agent_hint":{"session_id":"a"}}',
            b'{"seed":123456789012345678901234}',
        ),
        (b'{"temperature":NaN,"agent_hint":{"session_id":"a"}}', b'{"temperature":NaN}'),
        (
            '{"content":"caf\u00e9 \u2603","agent_hint":{"session_id":"a"}}'.encode(),
            '{"content":"caf\u00e9 \u2603"}'.encode(),
        ),
        (
            b'{"x":[1.5,1e-07,true,null],"agent_hint":{"session_id":"a"}}',
            b'{"x":[1.5,1e-07,true,null]}',
        ),
    ],
)
def test_stripped_body_keeps_every_value(raw: bytes, forwarded: bytes) -> None:
    parsed = parse_request("/v1/chat/completions", {}, raw, Limits())
    assert parsed.hint is not None and parsed.hint.session_id == "a"
    # byte-exact up to float spelling (orjson writes 1e-7 where json writes 1e-07)
    assert parsed.body.replace(b"1e-7", b"1e-07") == forwarded


@pytest.mark.parametrize(
    ("raw", "long_run"),
    [
        (b'{"seed":123456789012345678}', False),  # 18 digits: fits 64 bits, orjson reads it
        (b'{"seed":1234567890123456789}', True),  # 19 digits: might not
        (b'{"seed":-9223372036854775809}', True),
        (b'{"t":"12345678 90123456789012"}', False),  # a space breaks the run
        (b'{"t":"\xc3\xa91234567890123456789\xe2\x98\x83"}', True),  # inside a UTF-8 string too
        (b"", False),
    ],
)
def test_long_digit_run(raw: bytes, long_run: bool) -> None:
    assert jsonio.has_long_digit_run(raw) is long_run
    if raw:
        value, fast = jsonio.loads_exact(raw)
        assert fast is not long_run
        assert value == json.loads(raw)  # the same value either way, wide integers included


@pytest.mark.parametrize(
    ("raw", "headers"),
    [
        (b'{"agent_hint":{"session_id":"evil\\ud800"}}', {}),
        (b'{"prompt_cache_key":"evil\\udc00"}', {}),
        (b'{"model":"m"}', {"X-Session-Id": "evil\udcff"}),  # undecodable header bytes
        (b'{"model":"m"}', {"X-Session-Id": "s", "X-Agent-Name": "a\udcc3"}),
        (b'{"model":"m"}', {"X-Session-Id": "s", "X-Parent-Session-Id": "p\ud800"}),
    ],
)
def test_ids_that_are_not_utf8_text_are_rejected(raw: bytes, headers: dict[str, str]) -> None:
    with pytest.raises(BadRequest, match="valid UTF-8") as err:
        parse_request("/v1/chat/completions", headers, raw, LIMITS)
    assert err.value.code == "invalid_hint"


def test_deep_json_is_a_bad_request_and_a_surrogate_elsewhere_is_kept() -> None:
    deep = b'{"agent_hint":{"session_id":"s"},"x":' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_request("/v1/chat/completions", {}, deep, LIMITS)
    raw = b'{"content":"a\\ud800b","agent_hint":{"session_id":"s"}}'
    parsed = parse_request("/v1/chat/completions", {}, raw, LIMITS)
    assert parsed.body == b'{"content":"a\\ud800b"}'
