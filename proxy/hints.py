"""Every hint dialect becomes one :class:`Hint`; hint fields are stripped before the engine.

Dialects, strongest first when they disagree:

* ``agent_hint`` body field, the session-aware KV cache hints RFC's schema: session, parent,
  cache_control, edits;
* headers ``X-Session-Id``, ``X-Parent-Session-Id``, ``X-Agent-Name``, ``X-Cache-TTL``;
* OpenAI ``prompt_cache_key`` (session key) + ``prompt_cache_retention`` (``in_memory``|``24h``);
* Anthropic ``cache_control`` breakpoints on ``tools``/``system``/``messages`` blocks (/v1/messages).

A request with no hint yields ``None`` and its body bytes are forwarded untouched. Any invalid
hint raises :class:`BadRequest` before anything is stored or forwarded.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from proxy import jsonio
from proxy.errors import BadRequest
from proxy.hint_bytes import split_last_agent_hint
from proxy.hint_model import (
    ANTHROPIC_MAX_BREAKPOINTS,
    ANTHROPIC_TTLS,
    LONG_RETENTION_S,
    Edit,
    Hint,
    ParsedRequest,
    Retention,
    check_id,
    invalid_hint,
    pydantic_message,
)
from proxy.hint_schema import RFC_MAX_TTL, AgentHintParams
from proxy.settings import Limits


@dataclass(slots=True)
class _Draft:
    """Accumulates dialect contributions; the first dialect to set a field wins, conflicts fail."""

    limits: Limits
    session_id: str | None = None
    parent: str | None = None
    agent: str | None = None
    ttl: float | None = None
    block_offset: int | None = None
    retention: Retention = "default"
    manage: bool = False
    edits: list[Edit] = field(default_factory=list)
    dialects: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    breakpoint: tuple[str, int] | None = None

    def set_session(self, value: Any, param: str) -> None:
        sid = check_id(value, param, self.limits)
        if self.session_id is not None and self.session_id != sid:
            raise invalid_hint(
                f"{param} conflicts with the session id given by another hint", param
            )
        self.session_id = sid

    def set_parent(self, value: Any, param: str) -> None:
        pid = check_id(value, param, self.limits)
        if self.parent is not None and self.parent != pid:
            raise invalid_hint(f"{param} conflicts with the parent id given by another hint", param)
        self.parent = pid

    def set_ttl(self, ttl: float, param: str) -> None:
        if self.ttl is None:
            self.ttl = ttl

    def finish(self) -> Hint | None:
        if not self.dialects:
            return None
        if self.session_id is None:
            if self.ttl is not None or self.edits or self.manage or self.parent:
                raise invalid_hint(
                    "a session id is required for cache_control, parent links and edits "
                    "(agent_hint.session_id, X-Session-Id or prompt_cache_key)",
                    "agent_hint.session_id",
                )
            return None  # e.g. only X-Agent-Name: nothing to track
        if self.parent == self.session_id:
            raise invalid_hint(
                "parent_session_id must differ from session_id", "agent_hint.parent_session_id"
            )
        if self.manage and not self.edits:
            raise invalid_hint(
                "manage_request needs at least one edit", "agent_hint.context_management.edits"
            )
        if len(self.edits) > self.limits.max_edits:
            raise invalid_hint(
                f"at most {self.limits.max_edits} edits per request",
                "agent_hint.context_management.edits",
            )
        ttl, retain = self.ttl, None
        if ttl is not None and ttl > self.limits.max_ttl_s:
            retain = min(ttl, self.limits.max_retain_s)
            ttl = self.limits.max_ttl_s
            self.notes.append("ttl_capped")
        return Hint(
            session_id=self.session_id,
            parent_session_id=self.parent,
            agent_name=self.agent,
            ttl_s=ttl,
            block_offset=self.block_offset,
            retention=self.retention,
            retain_s=retain,
            manage_request=self.manage,
            edits=tuple(self.edits),
            dialects=tuple(self.dialects),
            notes=tuple(self.notes),
            breakpoint=self.breakpoint,
        )


_PLAIN_HINT_KEYS = frozenset({"session_id", "parent_session_id", "cache_control"})
_PLAIN_CACHE_KEYS = frozenset({"type", "ttl"})


def _plain_hint(raw: dict[str, Any]) -> tuple[str | None, str | None, float | None] | None:
    """The common hint (ids, a plain ephemeral TTL) checked by hand, as ``AgentHintParams``
    would accept it: (session id, parent id, TTL or None without cache_control); None for any
    other shape, which pydantic then validates (and words the error)."""
    if not raw.keys() <= _PLAIN_HINT_KEYS:
        return None
    sid, pid, cc = raw.get("session_id"), raw.get("parent_session_id"), raw.get("cache_control")
    if (sid is not None and type(sid) is not str) or (pid is not None and type(pid) is not str):
        return None
    if cc is None:
        return sid, pid, None
    if type(cc) is not dict or not cc.keys() <= _PLAIN_CACHE_KEYS:
        return None
    ttl = cc.get("ttl", 300.0)
    if cc.get("type", "ephemeral") != "ephemeral" or type(ttl) not in (int, float):
        return None
    if not 0 <= ttl <= RFC_MAX_TTL:  # NaN fails too
        return None
    return sid, pid, float(ttl)


def _agent_hint(draft: _Draft, raw: Any) -> None:
    if not isinstance(raw, dict):
        raise invalid_hint("agent_hint must be an object", "agent_hint")
    if (plain := _plain_hint(raw)) is not None:  # most hints: no pydantic on the hot path
        sid, pid, ttl = plain
        draft.dialects.append("agent_hint")
        if sid is not None:
            draft.set_session(sid, "agent_hint.session_id")
        if pid is not None:
            draft.set_parent(pid, "agent_hint.parent_session_id")
        if ttl is not None:
            draft.ttl, draft.block_offset = ttl, None
        return
    try:
        params = AgentHintParams.model_validate(raw)
    except ValidationError as exc:
        msg, loc = pydantic_message(exc, "agent_hint")
        raise invalid_hint(msg, loc) from exc
    draft.dialects.append("agent_hint")
    if params.session_id is not None:
        draft.set_session(params.session_id, "agent_hint.session_id")
    if params.parent_session_id is not None:
        draft.set_parent(params.parent_session_id, "agent_hint.parent_session_id")
    if params.cache_control is not None:
        draft.ttl = params.cache_control.ttl
        draft.block_offset = params.cache_control.block_offset
    if params.context_management is not None:
        draft.manage = params.context_management.manage_request
        draft.edits = [
            Edit(e.type, e.block_start, e.block_end) for e in params.context_management.edits
        ]


def _headers(draft: _Draft, headers: Mapping[str, str]) -> None:
    used = False
    if (sid := headers.get("X-Session-Id")) is not None:
        draft.set_session(sid, "X-Session-Id")
        used = True
    if (pid := headers.get("X-Parent-Session-Id")) is not None:
        draft.set_parent(pid, "X-Parent-Session-Id")
        used = True
    if (agent := headers.get("X-Agent-Name")) is not None:
        draft.agent = check_id(agent, "X-Agent-Name", draft.limits)
        used = True
    if (ttl_raw := headers.get("X-Cache-TTL")) is not None:
        try:
            ttl = float(ttl_raw)
        except ValueError:
            raise invalid_hint("X-Cache-TTL must be a number of seconds", "X-Cache-TTL") from None
        if not math.isfinite(ttl) or not 0 <= ttl <= RFC_MAX_TTL:
            raise invalid_hint(
                f"X-Cache-TTL must be between 0 and {RFC_MAX_TTL:g} seconds", "X-Cache-TTL"
            )
        draft.set_ttl(ttl, "X-Cache-TTL")
        used = True
    if used:
        draft.dialects.append("headers")


def _openai(draft: _Draft, body: dict[str, Any]) -> None:
    key = body.pop("prompt_cache_key", None)
    retention = body.pop("prompt_cache_retention", None)
    if key is None and retention is None:
        return
    draft.dialects.append("openai")
    if key is not None:
        draft.set_session(key, "prompt_cache_key")
    if retention is not None:
        if retention not in ("in_memory", "24h"):
            raise invalid_hint(
                'prompt_cache_retention must be "in_memory" or "24h"', "prompt_cache_retention"
            )
        draft.set_ttl(
            draft.limits.default_ttl_s if retention == "in_memory" else LONG_RETENTION_S, ""
        )
        if retention == "24h":
            draft.retention = "extended"


def _strip_block_cache_control(
    blocks: Any, section: str, found: list[tuple[str, int, float]]
) -> None:
    if not isinstance(blocks, list):
        return
    for i, block in enumerate(blocks):
        if not isinstance(block, dict):
            continue
        if "cache_control" in block:
            found.append((section, i, _anthropic_ttl(block.pop("cache_control"), section)))
        if section == "messages" and isinstance(block.get("content"), list):
            inner: list[tuple[str, int, float]] = []
            _strip_block_cache_control(block["content"], "content", inner)
            found.extend(("messages", i, ttl) for _, _, ttl in inner)


def _anthropic_ttl(cc: Any, section: str) -> float:
    param = f"{section}.cache_control"
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise invalid_hint('cache_control must be {"type": "ephemeral"}', param)
    unknown = set(cc) - {"type", "ttl"}
    if unknown:
        raise invalid_hint(f"cache_control has unknown fields: {sorted(unknown)}", param)
    ttl = cc.get("ttl", "5m")
    if ttl not in ANTHROPIC_TTLS:
        raise invalid_hint('cache_control.ttl must be "5m" or "1h"', param)
    return ANTHROPIC_TTLS[ttl]


def _anthropic(draft: _Draft, body: dict[str, Any]) -> None:
    found: list[tuple[str, int, float]] = []
    if "cache_control" in body:  # top-level automatic caching: the whole prompt
        found.append(("messages", -1, _anthropic_ttl(body.pop("cache_control"), "body")))
    for section in ("tools", "system", "messages"):
        _strip_block_cache_control(body.get(section), section, found)
    if not found:
        return
    if len(found) > ANTHROPIC_MAX_BREAKPOINTS:
        raise invalid_hint(
            f"at most {ANTHROPIC_MAX_BREAKPOINTS} cache_control breakpoints are allowed",
            "cache_control",
        )
    draft.dialects.append("anthropic")
    order = {"tools": 0, "system": 1, "messages": 2}
    section, index, _ = max(found, key=lambda f: (order[f[0]], f[1] if f[1] >= 0 else 1 << 30))
    draft.breakpoint = (section, index)
    draft.set_ttl(max(ttl for _, _, ttl in found), "")
    if draft.session_id is None:  # no explicit session: the prefix itself names the session
        draft.session_id = "prefix-" + _prefix_digest(body, section, index)


def _prefix_digest(body: dict[str, Any], section: str, index: int) -> str:
    parts: dict[str, Any] = {"model": body.get("model")}
    for name in ("tools", "system", "messages"):
        value = body.get(name)
        if name == section:
            parts[name] = value[: index + 1] if isinstance(value, list) and index >= 0 else value
            break
        parts[name] = value
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


_AGENT_HINT_ONLY = ("agent_hint",)
_COMMON: dict[tuple[str | None, str | None, float | None, int, float], Hint] = {}
_MAX_COMMON = 16_384  # common hints kept (then all are dropped)


def _simple_id(value: str, limits: Limits) -> bool:
    """An id ``check_id`` accepts as it is, checked the quick way (printable ASCII)."""
    return (
        value.isascii()
        and value.isprintable()
        and len(value) <= limits.max_session_id_len
        and bool(value.strip())
    )


def _common_hint(
    route: str, headers: Mapping[str, str], body: dict[str, Any], limits: Limits
) -> Hint | None:
    """Most hinted requests: a plain ``agent_hint`` (``_plain_hint``) with a session id, no
    other dialect, no TTL over the cap. Its hint, the one the draft would finish with (the
    member removed from ``body``); None for anything else, which the draft handles."""
    raw = body.get("agent_hint")
    if (
        type(raw) is not dict
        or route == "/v1/messages"
        or "prompt_cache_key" in body
        or "prompt_cache_retention" in body
        or "X-Session-Id" in headers
        or "X-Parent-Session-Id" in headers
        or "X-Agent-Name" in headers
        or "X-Cache-TTL" in headers
    ):
        return None
    plain = _plain_hint(raw)
    if plain is None:
        return None
    sid, pid, ttl = plain
    # a session's repeats ask the same: its hint, checked and built once (Hint is immutable)
    key = (sid, pid, ttl, limits.max_session_id_len, limits.max_ttl_s)
    hint = _COMMON.get(key)
    if hint is None:
        if sid is None or not _simple_id(sid, limits):
            return None
        if pid is not None and (pid == sid or not _simple_id(pid, limits)):
            return None
        if ttl is not None and ttl > limits.max_ttl_s:
            return None
        if len(_COMMON) >= _MAX_COMMON:
            _COMMON.clear()
        hint = _COMMON[key] = Hint(sid, pid, ttl_s=ttl, dialects=_AGENT_HINT_ONLY)
    del body["agent_hint"]
    return hint


def might_carry_body_hint(raw: bytes) -> bool:
    """Cheap pre-check: a body without these bytes carries no body hint and is never parsed."""
    return b"agent_hint" in raw or b"prompt_cache_" in raw or b"cache_control" in raw


def parse_request(
    route: str, headers: Mapping[str, str], raw: bytes, limits: Limits
) -> ParsedRequest:
    """Extract the hint from one request; raise BadRequest on an invalid hint or body."""
    body: dict[str, Any] | None = None
    fast = True
    marked = might_carry_body_hint(raw)
    if marked and (split := split_last_agent_hint(raw)) is not None:
        value, stripped = split  # a large body, hint last: only the hint is parsed
        draft = _Draft(limits)
        _agent_hint(draft, value)
        _headers(draft, headers)
        return ParsedRequest(hint=draft.finish(), body=stripped, json_body=None)
    if marked:
        try:
            parsed, fast = jsonio.loads_exact(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(
                f"request body is not valid JSON: {exc}", code="invalid_json"
            ) from None
        if not isinstance(parsed, dict):
            raise BadRequest("request body must be a JSON object", code="invalid_json")
        body = parsed
        if (common := _common_hint(route, headers, body, limits)) is not None:
            return ParsedRequest(common, jsonio.dumps(body, fast=fast), body)
        draft = _Draft(limits)
        if "agent_hint" in body:
            _agent_hint(draft, body.pop("agent_hint"))
        _headers(draft, headers)
        _openai(draft, body)
        if route == "/v1/messages":
            _anthropic(draft, body)
    else:
        draft = _Draft(limits)
        _headers(draft, headers)
    hint = draft.finish()
    if body is not None:
        raw = jsonio.dumps(body, fast=fast)
    return ParsedRequest(hint=hint, body=raw, json_body=body)
