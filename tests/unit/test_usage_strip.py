"""Asking a stream for usage and dropping the extra chunk again (proxy/usage.py)."""

from __future__ import annotations

import json

from proxy.usage import UsageSniffer, ask_for_usage

CHAT = "/v1/chat/completions"


def test_ask_for_usage_only_for_top_level_streams_without_options() -> None:
    body = b'{"model":"m","stream":true,"messages":[]}'
    asked = ask_for_usage(CHAT, body, None)
    assert asked is not None and json.loads(asked) == {
        **json.loads(body),
        "stream_options": {"include_usage": True},
    }
    assert asked.endswith(body[1:])  # the client's bytes follow unchanged
    assert ask_for_usage("/v1/completions", b' {"stream": true, "prompt": "x"}', None)
    # not streamed, streamed only in a nested object, options of its own, other routes
    assert ask_for_usage(CHAT, b'{"model":"m","messages":[]}', None) is None
    nested = b'{"model":"m","tools":[{"stream":true}],"messages":[]}'
    assert ask_for_usage(CHAT, nested, None) is None
    own = b'{"stream":true,"stream_options":{"include_usage":false},"messages":[]}'
    assert ask_for_usage(CHAT, own, None) is None
    assert ask_for_usage("/v1/messages", body, None) is None
    # told from the bytes alone where they say it (the body is not parsed), else parsed
    ids = b'"prompt":[' + b",".join(b"%d" % i for i in range(2000)) + b"]"
    for shape in (b'{"stream":true,' + ids + b"}", b'{"model":"m",' + ids + b', "stream" : true}'):
        assert json.loads(ask_for_usage("/v1/completions", shape, None) or b"")["stream_options"]
    for shape in (
        b'{"a":{"b":1},' + ids + b',"x":{"stream":true},"y":[1]}',  # nested, both sides
        b'{"stream":true,' + ids + b',"stream":false}',  # a duplicate key: the last one wins
        b'{"k\\"stream": true,' + ids + b"}",  # the key is k"stream
        b'{"stream":true,' + ids + b',"s":"stream"}',  # "stream" also a value: parsed
    ):
        got = ask_for_usage("/v1/completions", shape, None)
        assert (got is not None) == (json.loads(shape).get("stream") is True), shape[:40]
    assert ask_for_usage("/v1/responses", body, None) is None


def _stream(with_usage: bool) -> bytes:
    chunks = [
        {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "usage"}}]},
    ]
    if with_usage:
        usage = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
                 "prompt_tokens_details": {"cached_tokens": 32}}  # fmt: skip
        chunks.append({"id": "c", "choices": [], "usage": usage})
    out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return out + b"data: [DONE]\n\n"


def test_strip_usage_chunk_whatever_the_chunking() -> None:
    engine, client = _stream(True), _stream(False)
    for size in (1, 3, 7, 64, len(engine)):
        sniffer = UsageSniffer("text/event-stream", None)
        sniffer.strip_usage = True
        out = (
            b"".join(sniffer.relay(engine[i : i + size]) for i in range(0, len(engine), size))
            + sniffer.relay_rest()
        )
        assert out == client, size
        usage = sniffer.finish()
        assert usage is not None and (usage.prompt_tokens, usage.cached_tokens) == (40, 32)


def test_without_strip_everything_passes() -> None:
    engine = _stream(True)
    sniffer = UsageSniffer("text/event-stream", None)
    assert sniffer.relay(engine) == engine and sniffer.relay_rest() == b""


def _vllm(with_usage: bool, n: int = 1) -> bytes:
    """A stream in vLLM's compact bytes: the fingerprint rides on the terminal chunks without
    include_usage and on the usage chunk with it (vLLM >= 0.32)."""
    fp = '"system_fingerprint":"vllm-0.32.0-1a2b3c4d"'
    head = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"smol",'
    lines = []
    for i in range(n):
        lines.append(head + f'"choices":[{{"index":{i},"delta":{{"content":"hi"}}}}]}}')
    for i in range(n):
        end = head + f'"choices":[{{"index":{i},"delta":{{}},"finish_reason":"stop"}}]'
        lines.append(end + ("}" if with_usage else "," + fp + "}"))
    if with_usage:
        usage = '"usage":{"prompt_tokens":9,"total_tokens":11,"completion_tokens":2}'
        lines.append(head + '"choices":[],' + usage + "," + fp + "}")
    return b"".join(f"data: {line}\n\n".encode() for line in lines) + b"data: [DONE]\n\n"


def test_fingerprint_goes_back_on_the_terminal_chunks() -> None:
    for n in (1, 2):
        engine, client = _vllm(True, n), _vllm(False, n)
        for size in (1, 5, 50, len(engine)):
            sniffer = UsageSniffer("text/event-stream", None)
            sniffer.strip_usage = True
            out = b"".join(sniffer.relay(engine[i : i + size]) for i in range(0, len(engine), size))
            assert out + sniffer.relay_rest() == client, (n, size)
            usage = sniffer.finish()
            assert usage is not None and usage.prompt_tokens == 9


def test_an_engine_that_sends_usage_unasked_is_relayed_as_is() -> None:
    """vLLM --enable-force-include-usage: usage on every chunk and the usage chunk, whatever the
    client asked; the client gets all of it."""
    chunk = '{"id":"c","choices":[{"index":0,"delta":{"content":"a"}}],"usage":{"prompt_tokens":9}}'
    end = '{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":9}}'
    usage = '{"id":"c","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}'
    engine = b"".join(f"data: {c}\n\n".encode() for c in (chunk, end, usage, "[DONE]"))
    for size in (1, 9, len(engine)):
        sniffer = UsageSniffer("text/event-stream", None)
        sniffer.strip_usage = True
        out = b"".join(sniffer.relay(engine[i : i + size]) for i in range(0, len(engine), size))
        assert out + sniffer.relay_rest() == engine, size
