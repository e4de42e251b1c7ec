"""JSON for the adapters' own requests and answers, with orjson.

Touches, tokenize answers, tier lookups and pins carry whole prompts as token-id lists (100K
integers for a long agent context). The standard library encodes and decodes those on the
proxy's event loop several times slower than orjson, and that time is taken from the requests
the proxy is forwarding. Integers orjson cannot hold (beyond 64 bits) fall back to ``json``.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

HEADERS = {"Content-Type": "application/json"}


def dumps(body: Any) -> bytes:
    try:
        return orjson.dumps(body)
    except TypeError:  # an integer wider than 64 bits
        return json.dumps(body).encode()


def loads(raw: bytes | str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:  # NaN / Infinity literals and the like
        return json.loads(raw)
