"""A large body's last-member ``agent_hint`` cut out at the byte level (proxy/hint_bytes.py):
the same hint and the same request as parsing the whole body, the client's other bytes kept."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import BadRequest
from proxy.hint_bytes import MIN_BYTES, split_last_agent_hint
from proxy.hints import parse_request
from proxy.settings import Limits

PROMPT = list(range(1000, 1000 + MIN_BYTES // 5))  # token ids: a body over MIN_BYTES
HINT = {"session_id": "s1", "parent_session_id": "p", "cache_control": {"type": "ephemeral"}}


def _raw(body: dict[str, Any], **dump: Any) -> bytes:
    return json.dumps(body, **dump).encode()


@pytest.mark.parametrize(
    "dump", [{}, {"separators": (",", ":")}, {"indent": 2}, {"ensure_ascii": False}]
)
def test_the_byte_path_gives_what_parsing_gives(dump: dict[str, Any]) -> None:
    body = {"model": "m", "prompt": PROMPT, "stream": True, "user": 'é{["x"]}'}
    last = _raw({**body, "agent_hint": HINT}, **dump)
    first = _raw({"agent_hint": HINT, **body}, **dump)  # not last: the whole body is parsed
    split = split_last_agent_hint(last)
    assert split is not None and split[0] == HINT
    assert split_last_agent_hint(first) is None
    fast = parse_request("/v1/completions", {"X-Agent-Name": "a"}, last, Limits())
    slow = parse_request("/v1/completions", {"X-Agent-Name": "a"}, first, Limits())
    assert fast.hint == slow.hint and fast.hint is not None
    assert fast.json_body is None and slow.json_body is not None
    assert json.loads(fast.body) == slow.json_body == body
    # every byte but the hint's member is the client's own
    cut = last.rfind(b",", 0, last.find(b'"agent_hint"'))
    assert fast.body == last[:cut] + last[last.rstrip().rfind(b"}") :]


@pytest.mark.parametrize(
    "raw",
    [
        # small bodies: parsing costs less than it saves
        _raw({"prompt": [1, 2], "agent_hint": HINT}),
        # nested: the hint of an inner object is not the request's
        _raw({"prompt": PROMPT, "meta": {"x": 1, "agent_hint": HINT}}),
        # other hint dialects in the body, a second agent_hint, a non-object body
        _raw({"prompt": PROMPT, "prompt_cache_key": "k", "agent_hint": HINT}),
        _raw({"prompt": PROMPT, "m": [{"cache_control": {}}], "agent_hint": HINT}),
        _raw({"prompt": PROMPT, "agent_hint": HINT})[:-1] + b', "agent_hint": {}}',
        _raw([PROMPT, {"x": 1, "agent_hint": HINT}]),
        # "agent_hint" only inside a string value
        _raw({"prompt": PROMPT, "text": 'a,"agent_hint":{}'}),
    ],
)
def test_other_shapes_are_left_to_the_parser(raw: bytes) -> None:
    assert split_last_agent_hint(raw) is None


def test_a_bad_hint_is_refused_as_before() -> None:
    raw = _raw({"prompt": PROMPT, "agent_hint": {"session_id": ""}})
    assert split_last_agent_hint(raw) is not None
    with pytest.raises(BadRequest, match=r"agent_hint\.session_id"):
        parse_request("/v1/completions", {}, raw, Limits())
    broken = _raw({"prompt": PROMPT, "agent_hint": HINT})[:-3] + b"}"  # the hint's JSON cut
    assert split_last_agent_hint(broken) is None
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_request("/v1/completions", {}, broken, Limits())
