"""A large body's ``agent_hint`` found and cut out at the byte level, without parsing the body.

Parsing a 100K-token prompt and writing it back costs milliseconds on every hinted request;
the hint itself is a few hundred bytes. When ``agent_hint`` is the body's last member (where a
client that adds it to its request dict puts it) and the body holds no other hint marker, the
hint is parsed alone and the body is sent with that member's bytes removed, every other byte
as the client wrote it. Anything else returns None and the caller parses the whole body.
"""

from __future__ import annotations

import re
from typing import Any

from proxy import jsonio

# below this size parsing the whole body costs less than it is worth skipping
MIN_BYTES = 32 * 1024
_KEY = b'"agent_hint"'
_OTHER_MARKERS = (b"prompt_cache_", b"cache_control")
_WS = b" \t\r\n"
_MEMBER = re.compile(rb',[ \t\r\n]*"agent_hint"[ \t\r\n]*:')


def split_last_agent_hint(raw: bytes) -> tuple[Any, bytes] | None:
    """(the hint's value, the body without its member), or None: not this shape.

    In valid JSON an unescaped ``,"agent_hint":`` is an object member (inside a string the
    quote would be escaped), and it is the outermost object's last one when its value runs
    exactly to the body's closing brace: a nested member would leave that object's own brace
    after the value, and the value would not parse."""
    if len(raw) < MIN_BYTES or raw.count(_KEY) != 1:
        return None
    body = raw.rstrip(_WS)
    if not body.endswith(b"}") or not raw.lstrip(_WS).startswith(b"{"):
        return None
    key = body.rfind(_KEY)
    comma = body.rfind(b",", 0, key)
    member = _MEMBER.match(body, comma) if comma >= 0 else None
    if member is None or member.start() != comma:
        return None
    try:
        value = jsonio.loads(body[member.end() : -1])
    except (ValueError, UnicodeDecodeError):
        return None
    stripped = raw[:comma] + raw[len(body) - 1 :]
    if any(marker in stripped for marker in _OTHER_MARKERS):
        return None  # other body hints (OpenAI, Anthropic): the whole body is parsed
    return value, stripped
