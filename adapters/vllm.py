"""The vLLM adapter: HTTP (forwarding, /tokenize, touch, /metrics) plus KV-event wiring.

Every aiohttp failure becomes an ``AdapterError`` in one place, ``map_errors``. The aiohttp
``ClientSession`` is the proxy's and is shared by all adapters; this module never closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from adapters import wire
from adapters.base import (
    AdapterError,
    BlockChain,
    CacheConfig,
    EngineMetrics,
    EngineRejected,
    EngineUnavailable,
    EventSink,
    TouchResult,
    Unsupported,
    forward_headers,
)
from adapters.block_hash import BlockHasher, common_blocks, event_id
from adapters.kv_events import KVEventSubscriber, endpoint_for_host
from adapters.prom import engine_metrics_from, parse_engine_text

CHAT_ROUTE = "/v1/chat/completions"
COMPLETION_ROUTE = "/v1/completions"
PRIORITY_HEADER = "X-Vllm-Priority"  # vLLM >= 0.32: a request's scheduling priority
# Chat-request fields that change the prompt's token ids (vLLM's /tokenize chat form takes them).
_CHAT_PROMPT_KEYS = (
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
)
# Request fields a touch must drop: they would stream, sample more than one token, or fail
# beside max_tokens=1.
_TOUCH_DROP = ("stream", "stream_options", "max_completion_tokens", "min_tokens", "n", "best_of")
# RFC 9110 hop-by-hop headers plus those aiohttp recomputes; never forwarded either way.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_JSON_TIMEOUT = aiohttp.ClientTimeout(total=60, sock_connect=5)
_TOUCH_TIMEOUT = aiohttp.ClientTimeout(total=600, sock_connect=5)
_STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=600)


@contextlib.asynccontextmanager
async def map_errors(engine: str, what: str) -> AsyncIterator[None]:
    """The one place aiohttp and decoding failures become ``AdapterError``s."""
    try:
        yield
    except AdapterError:
        raise
    except aiohttp.ClientResponseError as exc:
        raise EngineRejected(exc.status, f"{engine} {what}: {exc.message}") from exc
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        raise EngineUnavailable(f"{engine} {what}: {exc!r}") from exc
    except (ValueError, KeyError, TypeError) as exc:  # malformed JSON or shape
        raise AdapterError(f"{engine} {what}: unexpected answer: {exc!r}") from exc


def tokenize_body(route: str, body: Mapping[str, Any], model: str | None) -> dict[str, Any]:
    """The ``/tokenize`` request that yields the token ids ``body`` on ``route`` will hash."""
    name = body.get("model") or model
    if route == CHAT_ROUTE:
        out = {k: body[k] for k in _CHAT_PROMPT_KEYS if k in body}
        out.setdefault("add_generation_prompt", True)
        return {"model": name, **out}
    if route == COMPLETION_ROUTE:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise Unsupported("only a single string prompt can be tokenized")
        return {"model": name, "prompt": prompt, "add_special_tokens": True}
    raise Unsupported(f"cannot tokenize requests for {route}")


def touch_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a recorded request that computes its prompt and generates one token."""
    out = {k: v for k, v in body.items() if k not in _TOUCH_DROP}
    out["max_tokens"] = 1
    return out


def _usage_result(answer: Any, seconds: float) -> TouchResult:
    """Prompt and cached tokens of an answer in any proxied dialect (OpenAI chat/completions,
    Responses, Anthropic messages)."""
    usage = answer.get("usage") if isinstance(answer, Mapping) else None
    if not isinstance(usage, Mapping):
        return TouchResult(0, 0, seconds)
    if "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details") or {}
        return TouchResult(
            int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0), seconds
        )
    if "input_tokens_details" in usage:
        details = usage.get("input_tokens_details") or {}
        return TouchResult(
            int(usage.get("input_tokens") or 0), int(details.get("cached_tokens") or 0), seconds
        )
    read = int(usage.get("cache_read_input_tokens") or 0)
    created = int(usage.get("cache_creation_input_tokens") or 0)
    return TouchResult(int(usage.get("input_tokens") or 0) + read + created, read, seconds)


@dataclass(frozen=True, slots=True)
class EventEndpoints:
    """Where an engine publishes its KV events (connectable addresses)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def event_endpoints_from(
    sources: Mapping[str, Any], host: str, rank: int = 0
) -> EventEndpoints | None:
    """Parse a ``GET /kv_event_sources`` answer; None when events are off or not ZMQ."""
    config = sources.get(str(rank))
    if not isinstance(config, Mapping) or not config.get("enable_kv_cache_events"):
        return None
    if config.get("publisher", "zmq") != "zmq" or not config.get("endpoint"):
        return None
    replay = config.get("replay_endpoint")
    return EventEndpoints(
        endpoint=endpoint_for_host(str(config["endpoint"]), host),
        replay_endpoint=endpoint_for_host(str(replay), host) if replay else None,
        topic=str(config.get("topic") or ""),
    )


async def discover_event_endpoint(
    session: aiohttp.ClientSession, base_url: str, *, rank: int = 0
) -> EventEndpoints | None:
    """Ask an engine where its KV events are (``GET /kv_event_sources``); None if it won't say."""
    host = urlsplit(base_url).hostname or "127.0.0.1"
    async with (
        map_errors(base_url, "kv_event_sources"),
        session.get(f"{base_url.rstrip('/')}/kv_event_sources", timeout=_JSON_TIMEOUT) as resp,
    ):
        if resp.status == 404:
            return None  # engine too old to serve the route
        if resp.status >= 400:
            raise EngineRejected(resp.status, (await resp.text())[:300])
        return event_endpoints_from(await resp.json(content_type=None), host, rank)


class VLLMAdapter:
    """An unmodified vLLM server seen through HTTP and its KV-event stream."""

    priority_header: str | None = PRIORITY_HEADER
    priority_field = "priority"
    hop_by_hop = HOP_BY_HOP
    health_routes: tuple[str, ...] = (
        "/health",
        "/v1/models",
    )  # /v1/models: an OpenAI server without /health

    def __init__(
        self,
        name: str,
        base_url: str,
        session: aiohttp.ClientSession,
        *,
        model: str | None = None,
        cache: CacheConfig | None = None,
        events: EventEndpoints | None = None,
        touch_priority: Callable[[], int] | None = None,
    ) -> None:
        self.name = name
        # touches and warm-ups carry this admission priority while ``prioritized`` (the engine
        # runs --scheduling-policy priority: read from it, or configured)
        self.touch_priority = touch_priority
        self.prioritized = touch_priority is not None
        self.scheduling_policy: str | None = None  # as the engine reported it
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.cache = cache or CacheConfig()
        self.events = events
        self._session = session

    @property
    def hasher(self) -> BlockHasher:
        return BlockHasher(block_size=self.cache.block_size, hash_seed=self.cache.hash_seed)

    def hash_blocks(self, token_ids: Sequence[int], *, cache_salt: Any = None) -> list[int]:
        return self.hasher.block_ids(token_ids, cache_salt=cache_salt)

    def tokenizable(self, route: str) -> bool:
        return route in (CHAT_ROUTE, COMPLETION_ROUTE)

    @property
    def has_events(self) -> bool:
        return self.events is not None

    def url(self, path: str) -> str:
        return f"{self.base_url}/{path.lstrip('/')}"

    # forwarding ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def open(
        self,
        method: str,
        path: str,
        *,
        data: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send a request upstream and hand back the response with its body unread.

        Failures up to the response headers raise ``EngineUnavailable``; any status is returned
        as is (the proxy passes it through). Read the body with ``iter_body``.
        """
        async with map_errors(self.name, path):
            resp = await self._session.request(
                method,
                self.url(path),
                data=data,
                headers=forward_headers(headers or {}, HOP_BY_HOP),
                params=params,
                timeout=_STREAM_TIMEOUT,
            )
        try:
            yield resp
        finally:
            resp.release()

    async def iter_body(self, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The response body as it arrives; upstream read failures map to ``AdapterError``."""
        chunks = resp.content.iter_any().__aiter__()
        while True:
            async with map_errors(self.name, "read body"):
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    return
            yield chunk

    async def _request_json(
        self,
        method: str,
        path: str,
        payload: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        timeout = _TOUCH_TIMEOUT if path.startswith("/v1/") else _JSON_TIMEOUT
        async with (
            map_errors(self.name, path),
            self._session.request(
                method,
                self.url(path),
                data=None if payload is None else wire.dumps(payload),
                headers={**wire.HEADERS, **(headers or {})} if payload is not None else headers,
                timeout=timeout,
            ) as resp,
        ):
            raw = await resp.read()
            if resp.status >= 400:
                raise EngineRejected(resp.status, raw[:300].decode(errors="replace"))
            return wire.loads(raw) if raw else None

    # EngineAdapter ------------------------------------------------------------------------
    async def health(self) -> bool:
        try:
            async with self._session.get(self.url("/health"), timeout=_JSON_TIMEOUT) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            return False

    async def hash_chain_async(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: Any = None,
        previous: BlockChain | None = None,
    ) -> BlockChain:
        hasher, reuse = self.hasher, []
        if previous is not None and (previous.scheme, previous.cache_salt) == (hasher, cache_salt):
            n = common_blocks(previous.tokens, token_ids, hasher.block_size, len(previous.links))
            reuse = list(previous.links[:n])
        digests = await hasher.digests_async(token_ids, cache_salt=cache_salt, reuse=reuse)
        return BlockChain(token_ids, cache_salt, [event_id(d) for d in digests], digests, hasher)

    async def tokenize(self, route: str, body: dict[str, Any]) -> list[int]:
        """Token ids for ``body`` on ``route``, exactly as the engine will hash them."""
        prompt = body.get("prompt")
        # token-id prompts are used verbatim (checked by type at C speed: a prompt is 100K ids)
        if (
            route == COMPLETION_ROUTE
            and isinstance(prompt, list)
            and set(map(type, prompt)) <= {int}
        ):
            return list(prompt)
        answer = await self._request_json(
            "POST", "/tokenize", tokenize_body(route, body, self.model)
        )
        await asyncio.sleep(0)  # decoded: its checks after the event loop's other work
        return list(map(int, answer["tokens"]))

    async def block_ids(self, route: str, body: dict[str, Any]) -> list[int]:
        """KV-event ids of the full blocks ``body`` will occupy (``cache_salt`` honoured)."""
        tokens = await self.tokenize(route, body)
        return self.hasher.block_ids(tokens, cache_salt=body.get("cache_salt"))

    async def touch(self, route: str, body: dict[str, Any]) -> TouchResult:
        """Re-send a recorded request generating one token: moves its prefix to LRU's safe end.
        Anthropic /v1/messages and /v1/responses are touched on their own route."""
        payload = touch_body(body)
        if route == "/v1/responses":
            del payload["max_tokens"]
            payload["max_output_tokens"] = 1
        elif not self.tokenizable(route):
            payload.pop("stream_options", None)
        if self.model is not None:
            payload.setdefault("model", self.model)
        headers = None
        if self.touch_priority is not None and self.prioritized:
            headers = {PRIORITY_HEADER: str(self.touch_priority())}
        started = time.monotonic()
        answer = await self._request_json("POST", route, payload, headers)
        return _usage_result(answer, time.monotonic() - started)

    async def warm(self, route: str, body: dict[str, Any]) -> TouchResult:
        """Prefetch: the same one-token request, sent ahead of a resume (recompute or load)."""
        return await self.touch(route, body)

    async def touch_tokens(
        self, token_ids: list[int], *, cache_salt: str | None = None
    ) -> TouchResult:
        """Touch a prefix known only by its token ids (a completions request over the ids)."""
        body: dict[str, Any] = {"prompt": token_ids}
        if cache_salt:
            body["cache_salt"] = cache_salt
        return await self.touch(COMPLETION_ROUTE, body)

    async def metrics(self) -> EngineMetrics:
        async with (
            map_errors(self.name, "/metrics"),
            self._session.get(self.url("/metrics"), timeout=_JSON_TIMEOUT) as resp,
        ):
            text = await resp.text()
            if resp.status >= 400:
                raise EngineRejected(resp.status, text[:300])
            return engine_metrics_from(parse_engine_text(text), hash_seed=self.cache.hash_seed)

    # discovery and control ----------------------------------------------------------------
    async def discover(self, *, cache: bool) -> None:
        """The KV-event endpoint (unless configured) and, with ``cache``, the cache geometry."""
        if cache:
            await self.discover_cache_config()
        await self.discover_events()

    async def discover_cache_config(self) -> CacheConfig:
        """Adopt the block size, pool size and hash algorithm the engine reports."""
        found = (await self.metrics()).cache_config
        if found is not None:
            self.cache = replace(found, hash_seed=self.cache.hash_seed)
        return self.cache

    async def discover_scheduling_policy(self) -> str | None:
        """The engine's waiting-queue order (``fcfs`` or ``priority``) from vLLM's dev-mode
        ``GET /server_info`` (``VLLM_SERVER_DEV_MODE=1``, as ``kvkeeper engine`` runs it); None
        when the engine does not say (the route is off, or an older vLLM)."""
        async with (
            map_errors(self.name, "/server_info"),
            self._session.get(
                self.url("/server_info"),
                params={"config_format": "json"},
                timeout=_JSON_TIMEOUT,
            ) as resp,
        ):
            if resp.status >= 400:
                return None
            answer = await resp.json(content_type=None)
        config = answer.get("vllm_config") if isinstance(answer, dict) else None
        sched = config.get("scheduler_config") if isinstance(config, dict) else None
        policy = sched.get("policy") if isinstance(sched, dict) else None
        self.scheduling_policy = policy if policy in ("fcfs", "priority") else None
        return self.scheduling_policy

    async def discover_events(self) -> EventEndpoints | None:
        """Learn the KV-event endpoint from the engine unless one was configured."""
        if self.events is None:
            self.events = await discover_event_endpoint(self._session, self.base_url)
        return self.events

    def subscribe(self, sink: EventSink, *, token_ids: bool = False) -> KVEventSubscriber:
        """A started subscriber feeding ``sink`` (usually a ``ResidencyIndex``); ``token_ids``:
        decode each stored block's token ids too (kvkeeper's index needs only the hashes)."""
        if self.events is None:
            raise Unsupported(f"{self.name}: no KV-event endpoint known")
        sub = KVEventSubscriber(
            self.events.endpoint,
            sink,
            replay_endpoint=self.events.replay_endpoint,
            topic=self.events.topic,
            token_ids=token_ids,
        )
        sub.start()
        return sub

    async def reset_prefix_cache(self, *, reset_running: bool = False) -> None:
        """``POST /reset_prefix_cache`` (needs ``VLLM_SERVER_DEV_MODE=1`` on the engine)."""
        params = "?reset_running_requests=true" if reset_running else ""
        await self._request_json("POST", f"/reset_prefix_cache{params}")
