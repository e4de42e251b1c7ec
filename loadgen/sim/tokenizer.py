"""A deterministic, reversible tokenizer and a stable ChatML-style chat template.

Text is split GPT-style into words with their leading space, punctuation and whitespace runs
(~4 characters per token on English); each piece's UTF-8 bytes become one id per up-to-4-byte
slice (``id = 16 + int.from_bytes(slice)``), so decoding is exact for text without NUL bytes.
Ids 0-15 are special tokens.

The chat template renders each message on its own (``<|im_start|>role\\n content <|im_end|>\\n``)
and concatenates the ids, so two conversations that share their first messages share a token
prefix exactly — the property prefix caching needs and the proxy relies on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_ID = 0
IM_START_ID = 1
IM_END_ID = 2
_OFFSET = 16
_NEWLINE = 16 + ord("\n")
_PIECE = re.compile(r" ?[^\W_]+| ?[^\s\w]|_+|\s+?(?=\S)|\s+")


class SimTokenizer:
    """Stateless; safe to share."""

    vocab_size = 2**32 + _OFFSET

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in _PIECE.findall(text):
            data = piece.encode("utf-8")
            for i in range(0, len(data), 4):
                out.append(_OFFSET + int.from_bytes(data[i : i + 4], "big"))
        return out

    def decode(self, token_ids: Iterable[int]) -> str:
        parts: list[bytes] = []
        for tid in token_ids:
            if tid < _OFFSET:
                parts.append(SPECIALS[tid].encode() if tid < len(SPECIALS) else b"")
                continue
            value = tid - _OFFSET
            parts.append(value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big"))
        return b"".join(parts).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of a conversation; a shared message prefix gives a shared id prefix."""
        ids: list[int] = []
        if tools:
            ids += self._turn("tools", json.dumps(list(tools), sort_keys=True))
        for message in messages:
            ids += self._turn(str(message.get("role", "user")), content_text(message))
        if add_generation_prompt:
            ids += [IM_START_ID, *self.encode("assistant"), _NEWLINE]
        return ids

    def _turn(self, role: str, text: str) -> list[int]:
        return [IM_START_ID, *self.encode(role), _NEWLINE, *self.encode(text), IM_END_ID, _NEWLINE]


def content_text(message: Mapping[str, Any]) -> str:
    """Flatten OpenAI / Anthropic message content (string or parts) to one string."""
    content = message.get("content")
    text = _parts_text(content)
    calls = message.get("tool_calls")
    if calls:
        text += json.dumps(calls, sort_keys=True)
    return text


def _parts_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(part) for part in content)
    return json.dumps(content, sort_keys=True)


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        return json.dumps(part, sort_keys=True)
    kind = part.get("type")
    if kind == "text":
        return str(part.get("text", ""))
    if kind == "tool_result":
        return _parts_text(part.get("content"))
    # tool_use, images and anything else: a stable rendering without cache_control noise
    return json.dumps({k: v for k, v in part.items() if k != "cache_control"}, sort_keys=True)
