"""Read token usage out of a response without changing a byte of it.

Understands the usage shapes of OpenAI chat/completions (``prompt_tokens_details.cached_tokens``),
the Responses API (``input_tokens_details.cached_tokens``) and Anthropic messages
(``input_tokens`` + ``cache_read_input_tokens`` + ``cache_creation_input_tokens``), in JSON bodies
and in SSE streams. Only lines that mention ``"usage"`` are parsed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import orjson

from proxy import jsonio
from proxy.store import Usage

_MAX_JSON_BODY = 8 * 1024 * 1024  # non-stream bodies larger than this are not inspected
# OpenAI-style routes whose streams carry usage only when asked (stream_options.include_usage)
USAGE_OPTIONAL_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
_INCLUDE_USAGE = b'"stream_options":{"include_usage":true},'
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')


def ask_for_usage(route: str, body: bytes, parsed: dict[str, Any] | None) -> bytes | None:
    """A streamed chat/completions request that did not ask for usage, with
    ``stream_options.include_usage`` added (so its session's counters can be kept), else None.

    The option goes in as bytes after the opening brace: the rest of the body is sent as the
    client wrote it. Requests that set ``stream_options`` themselves are left alone. The relay
    then drops the one extra usage chunk (:class:`UsageSniffer` ``strip_usage``), so the client
    receives what the engine would have sent it without the option."""
    if route not in USAGE_OPTIONAL_ROUTES or (found := _STREAM_TRUE.search(body)) is None:
        return None
    if b'"stream_options"' in body:
        return None
    if parsed is None and _outermost(body, found.start(), found.end()):
        parsed = {"stream": True}  # the one "stream" member, of the outermost object
    if parsed is None:  # "stream": true may be a nested key: only the top level counts
        try:  # orjson alone: the values are only looked at, never written back
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            try:
                parsed = jsonio.loads(body)
            except ValueError:
                return None
    if not isinstance(parsed, dict) or parsed.get("stream") is not True:
        return None
    start = body.find(b"{")
    if start < 0 or not body[start + 1 :].strip().startswith(b'"'):
        return None
    return body[: start + 1] + _INCLUDE_USAGE + body[start + 1 :]


def _outermost(body: bytes, start: int, end: int) -> bool:
    """Whether the member at ``body[start:end]`` (an unescaped ``"stream"`` key: a member of
    some object) is the only ``"stream"`` and belongs to the outermost object, seen from the
    bytes alone: no ``{`` or ``[`` before it but the body's first (nothing can have opened a
    nested value), or no ``}`` or ``]`` after it but the body's last (nothing can close one).
    False when unsure; the caller then parses the body."""
    if body.count(b'"stream"') != 1 or body[start - 1 : start] == b"\\":
        return False  # a duplicate key (the last one wins), or the quote may be escaped
    head = body.lstrip()
    if not head.startswith(b"{") or not body.rstrip().endswith(b"}"):
        return False
    if body.count(b"{", 0, start) == 1 and body.find(b"[", 0, start) < 0:
        return True
    return body.count(b"}", end) == 1 and body.find(b"]", end) < 0


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


_TERMINAL = b'"finish_reason":"'  # a chunk that ends a choice (vLLM's compact JSON)
_FINGERPRINT = re.compile(rb',"system_fingerprint":("(?:[^"\\]|\\.)*")')


def _stamp(event: bytes, fingerprint: bytes) -> bytes:
    """A terminal chunk as vLLM sends it without include_usage: the fingerprint last."""
    if _TERMINAL not in event or b'"system_fingerprint"' in event or not event.endswith(b"}"):
        return event
    return event[:-1] + b',"system_fingerprint":' + fingerprint + b"}"


def _usage_kind(event: bytes) -> str | None:
    """Whether an SSE event carries usage: ``only`` (no choices: the include_usage chunk),
    ``with_choices`` (usage on a content chunk), or None."""
    if b'"usage"' not in event or not event.startswith(b"data:"):
        return None
    try:
        data = jsonio.loads(event[5:])
    except ValueError:
        return None
    if not isinstance(data, dict) or not data.get("usage"):
        return None
    return "only" if data.get("choices") == [] else "with_choices"


class UsageSniffer:
    """Feed it the response chunks as they pass; ask for ``usage`` at the end."""

    def __init__(self, content_type: str, content_encoding: str | None) -> None:
        self.sse = content_type.startswith("text/event-stream")
        self.enabled = not content_encoding or content_encoding == "identity"
        self._buf = bytearray()
        self.usage: Usage | None = None
        self.response_id: str | None = None  # a Responses API answer's id (its stored id)
        # drop the usage-only chunk kvkeeper asked for (``ask_for_usage``) from what is relayed
        self.strip_usage = False
        self._held = bytearray()  # relayed bytes held until their SSE event is complete
        self._tail: list[bytes] = []  # events from the first terminal chunk on (see relay)
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

    def relay(self, chunk: bytes) -> bytes:
        """Feed a chunk; returns the bytes to send to the client: the chunk itself, or with
        ``strip_usage`` the complete events in it as the engine sends them without the option.

        vLLM moves ``system_fingerprint`` from a stream's terminal chunks (``finish_reason``
        set) to the usage chunk when asked for usage; so from the first terminal chunk on the
        events are held until the usage chunk, whose fingerprint goes back on them."""
        self.feed(chunk)
        if not self.strip_usage:
            return chunk
        self._held += chunk
        end = self._held.rfind(b"\n\n")
        if end < 0:
            return b""
        complete = bytes(self._held[: end + 2])
        del self._held[: end + 2]
        if not self._tail and b'"usage"' not in complete and _TERMINAL not in complete:
            return complete
        out = bytearray()
        for event in complete.split(b"\n\n")[:-1]:
            kind = _usage_kind(event) if self.strip_usage else None
            if not self.strip_usage:
                out += event + b"\n\n"
            elif kind == "with_choices":
                # usage on every chunk: the engine sends it unasked (vLLM's
                # --enable-force-include-usage), so the client gets it too: nothing to strip
                out += self._flush_tail() + event + b"\n\n"
                self.strip_usage = False
            elif kind == "only":
                found = _FINGERPRINT.search(event)
                for held in self._tail:
                    out += (_stamp(held, found.group(1)) if found else held) + b"\n\n"
                self._tail.clear()
                self.strip_usage = False  # the one extra chunk is gone: the rest passes on
            elif self._tail or _TERMINAL in event:
                self._tail.append(event)
            else:
                out += event + b"\n\n"
        if not self.strip_usage:
            out += self.relay_rest()
        return bytes(out)

    def relay_rest(self) -> bytes:
        """What :meth:`relay` still holds when the body ends (or stops being filtered)."""
        rest = self._flush_tail() + bytes(self._held)
        self._held.clear()
        return rest

    def _flush_tail(self) -> bytes:
        tail = b"".join(e + b"\n\n" for e in self._tail)
        self._tail.clear()
        return tail

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
