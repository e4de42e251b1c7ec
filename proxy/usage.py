"""Read token usage out of a response without changing a byte of it.

Understands the usage shapes of OpenAI chat/completions (``prompt_tokens_details.cached_tokens``),
the Responses API (``input_tokens_details.cached_tokens``) and Anthropic messages
(``input_tokens`` + ``cache_read_input_tokens`` + ``cache_creation_input_tokens``), in JSON bodies
and in SSE streams. Only lines that mention ``"usage"`` are parsed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from proxy import jsonio
from proxy.store import Usage

_MAX_JSON_BODY = 8 * 1024 * 1024  # non-stream bodies larger than this are not inspected


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def normalize(usage: Any) -> Usage | None:
    """One usage object of any dialect -> Usage (prompt tokens include cached ones)."""
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage:  # OpenAI chat / completions
        details = usage.get("prompt_tokens_details") or {}
        return Usage(
            prompt_tokens=_int(usage.get("prompt_tokens")),
            cached_tokens=_int(details.get("cached_tokens")) if isinstance(details, dict) else 0,
            completion_tokens=_int(usage.get("completion_tokens")),
        )
    if "input_tokens_details" in usage:  # Responses API
        details = usage.get("input_tokens_details") or {}
        return Usage(
            prompt_tokens=_int(usage.get("input_tokens")),
            cached_tokens=_int(details.get("cached_tokens")) if isinstance(details, dict) else 0,
            completion_tokens=_int(usage.get("output_tokens")),
        )
    if "input_tokens" in usage or "output_tokens" in usage:  # Anthropic messages
        read = _int(usage.get("cache_read_input_tokens"))
        created = _int(usage.get("cache_creation_input_tokens"))
        return Usage(
            prompt_tokens=_int(usage.get("input_tokens")) + read + created,
            cached_tokens=read,
            completion_tokens=_int(usage.get("output_tokens")),
        )
    return None


def _merge(old: Usage | None, new: Usage) -> Usage:
    """Anthropic streams split usage: input in message_start, output in message_delta."""
    if old is None:
        return new
    return Usage(
        prompt_tokens=new.prompt_tokens or old.prompt_tokens,
        cached_tokens=new.cached_tokens or old.cached_tokens,
        completion_tokens=new.completion_tokens or old.completion_tokens,
    )


def _find_usage(event: Any) -> Any:
    if not isinstance(event, dict):
        return None
    if "usage" in event:
        return event["usage"]
    for key in ("message", "response"):  # anthropic message_start, responses response.completed
        inner = event.get(key)
        if isinstance(inner, dict) and "usage" in inner:
            return inner["usage"]
    return None


class UsageSniffer:
    """Feed it the response chunks as they pass; ask for ``usage`` at the end."""

    def __init__(self, content_type: str, content_encoding: str | None) -> None:
        self.sse = content_type.startswith("text/event-stream")
        self.enabled = not content_encoding or content_encoding == "identity"
        self._buf = bytearray()
        self.usage: Usage | None = None
        self.response_id: str | None = None  # a Responses API answer's id (its stored id)
        self.first_byte_at: float | None = None
        self.on_first_byte: list[Callable[[], None]] = []  # called once, at the first byte

    def mark_first_byte(self) -> None:
        """The engine's first body byte reached the proxy (once per response)."""
        if self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()
            for hook in self.on_first_byte:
                hook()

    def feed(self, chunk: bytes) -> None:
        if not self.enabled:
            return
        if not self.sse:
            if len(self._buf) + len(chunk) <= _MAX_JSON_BODY:
                self._buf += chunk
            else:
                self.enabled = False
            return
        self._buf += chunk
        end = self._buf.rfind(b"\n")
        if end < 0:
            return
        complete = bytes(self._buf[: end + 1])
        del self._buf[: end + 1]
        if b'"usage"' in complete:
            for line in complete.split(b"\n"):
                if line.startswith(b"data:") and b'"usage"' in line:
                    self._take(line[5:])

    def _take(self, payload: bytes) -> None:
        try:
            event = jsonio.loads(payload)
        except ValueError:
            return
        if isinstance(event, dict):
            self._response_id(event)
        found = normalize(_find_usage(event))
        if found is not None:
            self.usage = _merge(self.usage, found)

    def _response_id(self, event: dict[str, Any]) -> None:
        """A Responses body (``object: response``) or stream event (``response.completed``)."""
        inner = event.get("response")
        found = inner if isinstance(inner, dict) else event
        if found.get("object") == "response" and isinstance(found.get("id"), str):
            self.response_id = found["id"]

    def finish(self) -> Usage | None:
        if self.enabled and not self.sse and self._buf:
            self._take(bytes(self._buf))
        elif self.enabled and self.sse and self._buf.startswith(b"data:"):
            self._take(bytes(self._buf[5:]))
        self._buf.clear()
        return self.usage
