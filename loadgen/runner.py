"""Play a workload against an OpenAI-compatible endpoint and record what every request saw.

``await run_workload(workload, Target(base_url, model, hints), options)`` returns a
:class:`RunResult`. Each session runs as one task: it sleeps through its think times (scaled by
``time_scale``), sends its calls in order, starts child sessions at their launch delay and waits
for them where the workload says so. At most ``concurrency`` model requests are in flight, and
with ``max_sessions`` at most that many root sessions are open (the next starts when one ends).

Every model call is streamed (``stream: true``, ``stream_options.include_usage``), so one request
gives the client-side TTFT (first chunk carrying text), the end-to-end latency and the usage
(``prompt_tokens``, ``prompt_tokens_details.cached_tokens``). Failed requests are recorded with
their error and the session goes on. When the target is kvkeeper, its retention counters are
read from ``/metrics`` before and after the run.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from loadgen import tokens
from loadgen.metrics import KVKEEPER_COUNTERS, counter_delta, parse_counters
from loadgen.records import ManageRecord, RequestRecord, RunResult, SessionRecord
from loadgen.workloads.base import Api, Call, Segment, SessionScript, Spawn, Workload, next_pause
from loadgen.workloads.hints import EditType, HintPolicy, call_hints, manage_body

if TYPE_CHECKING:
    from tqdm import tqdm


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go. ``base_url`` ends before ``/v1`` or with it (both accepted)."""

    base_url: str
    model: str
    hints: HintPolicy = field(default_factory=HintPolicy)
    api: Api | None = None  # None: the workload's own choice
    api_key: str | None = None

    @property
    def v1(self) -> str:
        url = self.base_url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    @property
    def root(self) -> str:
        return self.v1[: -len("/v1")]


@dataclass(frozen=True, slots=True)
class RunOptions:
    concurrency: int = 32  # model requests in flight
    max_sessions: int = 0  # open root sessions (0: every root starts at its own time)
    time_scale: float = 1.0  # multiplies think times, launch delays and start offsets
    progress: bool = True
    request_timeout: float = 900.0
    ignore_eos: bool = True  # generate exactly max_tokens (vLLM and the simulator honour it)
    run_tag: str = ""  # prefix of session ids sent to the server (default: random)


async def run_workload(
    workload: Workload, target: Target, options: RunOptions | None = None, *, label: str = ""
) -> RunResult:
    """Play ``workload`` against ``target``; never raises for failed requests (they are recorded)."""
    opts = options or RunOptions()
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout)
    connector = aiohttp.TCPConnector(limit=opts.concurrency + 16)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as http:
        before = await _kvkeeper_counters(http, target)
        player = _Player(workload, target, opts, http)
        started = time.time()
        if opts.progress:  # the bench extra's progress bar, imported only when drawn
            from tqdm import tqdm

            with tqdm(total=workload.n_calls(), unit="req") as bar:
                player.bar = bar
                await player.play_all()
        else:
            await player.play_all()
        duration = player.now()
        after = await _kvkeeper_counters(http, target)
    return RunResult(
        workload=workload.name,
        params=dict(workload.params),
        target={
            "base_url": target.base_url,
            "model": target.model,
            "hints": asdict(target.hints),
            "api": player.api,
        },
        options=asdict(opts),
        started_at=started,
        duration=duration,
        requests=player.requests,
        manages=player.manages,
        sessions=player.sessions,
        kvkeeper=counter_delta(before, after),
        label=label or f"{workload.name}/{target.hints.mode}",
    )


async def _kvkeeper_counters(http: aiohttp.ClientSession, target: Target) -> dict[str, float]:
    """kvkeeper's retention counters, or ``{}`` when the target does not expose them."""
    try:
        async with http.get(target.root + "/metrics") as resp:
            if resp.status != 200:
                return {}
            return parse_counters(await resp.text(), KVKEEPER_COUNTERS)
    except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
        return {}


class _Player:
    """Runs the sessions of one workload; collects the records."""

    def __init__(
        self, workload: Workload, target: Target, opts: RunOptions, http: aiohttp.ClientSession
    ) -> None:
        self.workload, self.target, self.opts, self.http = workload, target, opts, http
        self.api: Api = target.api or workload.api
        self.tag = opts.run_tag or uuid.uuid4().hex[:8]
        self.in_flight = asyncio.Semaphore(opts.concurrency)
        self.slots = asyncio.Semaphore(opts.max_sessions) if opts.max_sessions > 0 else None
        self.t0 = asyncio.get_running_loop().time()
        self.requests: list[RequestRecord] = []
        self.manages: list[ManageRecord] = []
        self.sessions: list[SessionRecord] = []
        self.side_tasks: set[asyncio.Task[None]] = set()
        self.bar: tqdm[Any] | None = None

    def now(self) -> float:
        return asyncio.get_running_loop().time() - self.t0

    async def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            await asyncio.sleep(delay)

    async def play_all(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for script in self.workload.sessions:
                    group.create_task(self._root(script))
        finally:
            for task in self.side_tasks:
                task.cancel()
            await asyncio.gather(*self.side_tasks, return_exceptions=True)

    async def _root(self, script: SessionScript) -> None:
        await self.sleep_until(script.start * self.opts.time_scale)
        if self.slots is None:
            await self._session(script, None)
            return
        async with self.slots:
            await self._session(script, None)

    async def _child(self, script: SessionScript, parent: str, spawned_at: float) -> None:
        await self.sleep_until(spawned_at + script.start * self.opts.time_scale)
        await self._session(script, parent)

    async def _session(self, script: SessionScript, parent: str | None) -> None:
        sid = f"{self.tag}-{script.session_id}"
        record = SessionRecord(sid, parent, self.now(), 0.0)
        self.sessions.append(record)
        ts = self.opts.time_scale
        begun = done = self.now()  # when the previous call finished
        waited: list[asyncio.Task[None]] = []
        background: list[asyncio.Task[None]] = []
        for i, step in enumerate(script.steps):
            if isinstance(step, Spawn):
                tasks = [asyncio.create_task(self._child(c, sid, done)) for c in step.children]
                (waited if step.wait else background).extend(tasks)
                continue
            target_t = (
                done + step.think * ts if step.at is None else max(done, begun + step.at * ts)
            )
            if i and self.target.hints.wants_prefetch(target_t - done):
                self._side(
                    self._prefetch_at(target_t - self.target.hints.prefetch_lead, sid, parent)
                )
            if waited:
                await asyncio.gather(*waited)
                waited = []
            await self.sleep_until(target_t)
            pause = next_pause(script.steps, i)
            await self._call(sid, parent, step, i, target_t, None if pause is None else pause * ts)
            done = self.now()
        await asyncio.gather(*waited, *background)
        if self.target.hints.mode == "full" and self.target.hints.end_evict:
            await self._manage(sid, parent, "evict")
        record.t_end = self.now()

    def _side(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self.side_tasks.add(task)
        task.add_done_callback(self.side_tasks.discard)

    async def _prefetch_at(self, t: float, sid: str, parent: str | None) -> None:
        await self.sleep_until(t)
        await self._manage(sid, parent, "prefetch")

    async def _call(
        self,
        sid: str,
        parent: str | None,
        call: Call,
        turn: int,
        t_sched: float,
        pause: float | None,
    ) -> None:
        hints = call_hints(
            self.target.hints,
            session_id=sid,
            parent_id=parent,
            agent=call.agent,
            tool_pause=pause,
            ends_in_tool_call=call.stop == "tool_use",
            step=turn,
        )
        path, body = self._body(call)
        body.update(hints.body)
        rec = RequestRecord(
            sid,
            parent,
            call.agent,
            turn,
            t_sched,
            0.0,
            expected_prompt_tokens=call.prompt_tokens,
            stop=call.stop,
        )
        async with self.in_flight:
            rec.t_start = self.now()
            try:
                await self._stream(path, body, hints.headers, rec)
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}"[:300]
            rec.t_end = self.now()
        self.requests.append(rec)
        if self.bar is not None:
            self.bar.update(1)

    def _body(self, call: Call) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.target.model,
            "max_tokens": call.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.opts.ignore_eos:
            body["ignore_eos"] = True
        if self.api == "chat":
            body["messages"] = render_messages(call.prompt)
            return "/chat/completions", body
        if self.api == "completions-ids":
            body["prompt"] = tokens.render_ids(call.pieces())
        else:
            body["prompt"] = tokens.render_text(call.pieces())
        return "/completions", body

    async def _stream(
        self, path: str, body: dict[str, Any], headers: dict[str, str], rec: RequestRecord
    ) -> None:
        async with self.http.post(self.target.v1 + path, json=body, headers=headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                _apply_chunk(json.loads(data), rec, self.now())
        if rec.ttft is None and rec.completion_tokens:  # output decoded to no text
            rec.ttft = self.now() - rec.t_start

    async def _manage(self, sid: str, parent: str | None, edit: EditType) -> None:
        body = manage_body(self.target.model, session_id=sid, parent_id=parent, edit=edit)
        rec = ManageRecord(sid, edit, self.now(), 0.0, 0, [])
        try:
            async with self.http.post(self.target.v1 + "/chat/completions", json=body) as resp:
                rec.status = resp.status
                doc = await resp.json(content_type=None)
                if isinstance(doc, dict) and isinstance(doc.get("results"), list):
                    rec.results = doc["results"]
                elif resp.status != 200:
                    rec.error = f"HTTP {resp.status}"
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        rec.t_end = self.now()
        self.manages.append(rec)


def _apply_chunk(chunk: dict[str, Any], rec: RequestRecord, now: float) -> None:
    """Fold one SSE chunk into the record: first text -> TTFT; usage -> token counts."""
    if rec.response_id is None and isinstance(chunk.get("id"), str):
        rec.response_id = chunk["id"]
    if rec.ttft is None:
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
                rec.ttft = now - rec.t_start
                break
    usage = chunk.get("usage")
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)
        engine_s, speed = usage.get("sim_engine_ttft_s"), usage.get("sim_speed")
        if isinstance(engine_s, int | float) and isinstance(speed, int | float) and speed > 0:
            rec.engine_ttft, rec.engine_speed = float(engine_s), float(speed)


def render_messages(prompt: tuple[Segment, ...]) -> list[dict[str, str]]:
    """Chat messages of a prompt: consecutive segments of one role form one message."""
    messages: list[dict[str, str]] = []
    for seg in prompt:
        text = tokens.render_text(seg.pieces())
        if messages and messages[-1]["role"] == seg.role:
            messages[-1]["content"] += " " + text
        else:
            messages.append({"role": seg.role, "content": text})
    return messages


def run_sync(workload: Workload, target: Target, options: RunOptions | None = None) -> RunResult:
    """Blocking wrapper for scripts and the CLI."""
    return asyncio.run(run_workload(workload, target, options))
