"""The one value every hint dialect maps to (:class:`Hint`), and the checks dialects share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from proxy.errors import BadRequest
from proxy.hint_schema import EditType
from proxy.settings import Limits

LONG_RETENTION_S = 24 * 3600.0  # prompt_cache_retention "24h"
ANTHROPIC_TTLS = {"5m": 300.0, "1h": 3600.0}
ANTHROPIC_MAX_BREAKPOINTS = 4
Retention = Literal["default", "extended"]


# --- the one value every dialect maps to ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Edit:
    type: EditType
    block_start: int | None = None
    block_end: int | None = None


@dataclass(frozen=True, slots=True)
class Hint:
    """What the client told kvkeeper about this request, whatever dialect it used."""

    session_id: str
    parent_session_id: str | None = None
    agent_name: str | None = None
    ttl_s: float | None = None  # None: no protection asked; 0: stop protecting
    block_offset: int | None = None
    retention: Retention = "default"
    # retention asked for beyond the GPU's cap (limits.max_ttl_s), up to limits.max_retain_s:
    # kept in the engine's offload tier (proxy/longterm.py)
    retain_s: float | None = None
    manage_request: bool = False
    edits: tuple[Edit, ...] = ()
    dialects: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())  # e.g. "ttl_capped"
    # Anthropic: the last cache_control breakpoint, (section, index), bounding the protected prefix
    breakpoint: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A request after hint extraction: the hint (or None) and the bytes to send upstream."""

    hint: Hint | None
    body: bytes
    json_body: dict[str, Any] | None  # parsed body when it had to be parsed, else None


def invalid_hint(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param, code="invalid_hint")


def check_id(value: Any, param: str, limits: Limits) -> str:
    if not isinstance(value, str) or not value.strip():
        raise invalid_hint(f"{param} must be a non-empty string", param)
    if len(value) > limits.max_session_id_len:
        raise invalid_hint(f"{param} is longer than {limits.max_session_id_len} characters", param)
    if value.isascii() and value.isprintable():  # most ids: no control characters, UTF-8
        return value
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise invalid_hint(f"{param} must not contain control characters", param)
    try:  # a lone surrogate ("\\ud800" in JSON, undecodable header bytes) has no UTF-8 form
        value.encode()
    except UnicodeEncodeError:
        raise invalid_hint(f"{param} must be valid UTF-8 text", param) from None
    return value


def pydantic_message(exc: ValidationError, prefix: str) -> tuple[str, str]:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in (prefix, *first["loc"]))
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return f"{loc}: {msg}", loc
