"""The runner against a real OpenAI-compatible HTTP server started in the test (port 0).

The server streams SSE like vLLM: a role chunk, one chunk per generated token, a usage chunk;
it keeps an unbounded prefix cache of 16-token blocks so ``cached_tokens`` is a real figure, and
answers kvkeeper-style management requests itself. It records every request it received.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from loadgen import tokens
from loadgen.metrics import summarize
from loadgen.records import RunResult
from loadgen.runner import RunOptions, Target, run_workload
from loadgen.workloads import build_workload
from loadgen.workloads.hints import HintPolicy

BLOCK = 16
_WORD_ID = {w: i for i, w in enumerate(tokens.VOCAB)}


@dataclass
class FakeEngine:
    """State of the test server: cache of block-chain keys and what it received."""

    delay_per_token: float = 0.0
    seen: set[tuple[int, ...]] = field(default_factory=set)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    manages: list[dict[str, Any]] = field(default_factory=list)
    max_in_flight: int = 0
    in_flight: int = 0
    metrics_text: str = ""

    def tokenize(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            ids: list[int] = []
            for m in body["messages"]:
                ids.append(-1 if m["role"] == "system" else -2 if m["role"] == "user" else -3)
                ids += [_WORD_ID[w] for w in m["content"].split()]
            return ids
        prompt = body["prompt"]
        if isinstance(prompt, list):
            return [int(x) for x in prompt]
        return [_WORD_ID[w] for w in prompt.split()]

    def cached(self, ids: list[int]) -> int:
        """Leading full blocks already seen; then remember every full block of ``ids``."""
        hit, hitting = 0, True
        for end in range(BLOCK, len(ids) + 1, BLOCK):
            key = tuple(ids[:end])
            if hitting and key in self.seen:
                hit = end
            else:
                hitting = False
                self.seen.add(key)
        return hit


ENGINE = web.AppKey("engine", FakeEngine)


async def _completions(request: web.Request) -> web.StreamResponse:
    eng: FakeEngine = request.app[ENGINE]
    body = await request.json()
    hint = body.get("agent_hint") or {}
    if (hint.get("context_management") or {}).get("manage_request"):
        eng.manages.append(body)
        edits = hint["context_management"]["edits"]
        return web.json_response(
            {
                "object": "kvkeeper.management",
                "session_id": hint["session_id"],
                "results": [
                    {"type": e["type"], "status": "applied", "reason": None} for e in edits
                ],
            }
        )
    eng.bodies.append(body)
    eng.headers.append(dict(request.headers))
    eng.in_flight += 1
    eng.max_in_flight = max(eng.max_in_flight, eng.in_flight)
    try:
        ids = eng.tokenize(body)
        cached = eng.cached(ids)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = "messages" in body
        if chat:
            await _send(resp, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(eng.delay_per_token * (len(ids) - cached))
        for _ in range(body["max_tokens"]):
            choice = (
                {"index": 0, "delta": {"content": " the"}} if chat else {"index": 0, "text": " the"}
            )
            await _send(resp, {"choices": [choice]})
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        await _send(resp, {"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        eng.in_flight -= 1


async def _send(resp: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[ENGINE].metrics_text)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    eng = FakeEngine()
    app = web.Application()
    app[ENGINE] = eng
    app.router.add_post("/v1/chat/completions", _completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/metrics", _metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield eng, f"http://127.0.0.1:{port}"
    await runner.cleanup()


_SMALL_MT = {
    "conversations": 6,
    "min_turns": 3,
    "max_turns": 3,
    "arrival_rate": 50.0,
    "think_mean": 0.01,
    "shared_prefix_tokens": 64,
    "context_tokens": 96,
    "user_tokens": 16,
    "output_tokens": 4,
}


async def test_multiturn_chat_measures_hits_and_ttft(engine: tuple[FakeEngine, str]) -> None:
    eng, url = engine
    wl = build_workload("multiturn", _SMALL_MT)
    res = await run_workload(wl, Target(url, "m"), RunOptions(concurrency=4, progress=False))
    s = summarize(res)
    assert s["requests"] == 18 and s["errors"] == 0
    assert all(r.ttft is not None and 0 < r.ttft <= r.latency for r in res.requests)
    # Each turn's prompt extends the previous one of its conversation: from the second turn on,
    # everything up to the last full block of the previous prompt is a hit.
    second = [r for r in res.requests if r.turn > 0]
    assert all(r.cached_tokens >= r.prompt_tokens - 16 - 4 - 16 - 16 for r in second)
    assert s["hit_rate"] is not None and 0.5 < s["hit_rate"] < 1.0
    assert s["recomputed_prompt_tokens"] == s["prompt_tokens"] - s["cached_tokens"]
    assert s["output_tokens"] == 18 * 4
    assert len(res.sessions) == 6 and len(s["ttft"]) == 5
    assert eng.max_in_flight <= 4
    assert all(
        "agent_hint" not in b and "X-Session-Id" not in h
        for b, h in zip(eng.bodies, eng.headers, strict=True)
    )


async def test_full_hints_on_fanout(engine: tuple[FakeEngine, str]) -> None:
    eng, url = engine
    eng.metrics_text = "kvkeeper_touch_recomputed_tokens_total 5\n"
    params = {
        "jobs": 1,
        "workers": 3,
        "build_turns": 2,
        "worker_turns": 2,
        "join_turns": 1,
        "token_scale": 0.01,
        "pause_min": 0.05,
        "pause_cap": 0.2,
    }
    wl = build_workload("fanout", params)
    hints = HintPolicy("full", prefetch_lead=0.02, min_prefetch_pause=0.03)
    res = await run_workload(wl, Target(url, "m", hints), RunOptions(progress=False))
    assert len(res.requests) == 2 + 3 * 2 + 1 and not any(r.error for r in res.requests)
    by_sid = {b["agent_hint"]["session_id"] for b in eng.bodies}
    assert len(by_sid) == 4  # leader + 3 workers
    workers = [b for b in eng.bodies if "parent_session_id" in b["agent_hint"]]
    assert len(workers) == 6 and all(
        b["agent_hint"]["parent_session_id"].endswith("fanout-j0") for b in workers
    )
    tool_calls = [b for b in eng.bodies if "cache_control" in b["agent_hint"]]
    assert len(tool_calls) == 2 + 3  # build turns + non-final worker turns
    assert all(0 < b["agent_hint"]["cache_control"]["ttl"] <= 600 for b in tool_calls)
    assert {h.get("X-Agent-Name") for h in eng.headers} == {"leader", "worker"}
    evicts = [
        m
        for m in eng.manages
        if m["agent_hint"]["context_management"]["edits"][0]["type"] == "evict"
    ]
    assert len(evicts) == 4
    s = summarize(res)
    assert s["manage"]["evict:applied"] == 4
    assert s["retention_recomputed_tokens"] == 0.0  # the counter did not move during the run
    # Workers share the leader's context: their first calls hit it.
    assert min(r.cached_tokens for r in res.requests if r.parent_id and r.turn == 0) > 0


async def test_a_client_that_never_knows_a_session_ended_sends_no_evict(
    engine: tuple[FakeEngine, str],
) -> None:
    """``end_evict=False`` (bench compare --no-end-evict): the same calls and hints, no evict."""
    eng, url = engine
    params = {"jobs": 1, "workers": 2, "build_turns": 1, "worker_turns": 2, "join_turns": 1,
              "token_scale": 0.01, "pause_min": 0.05, "pause_cap": 0.2}  # fmt: skip
    hints = HintPolicy("full", prefetch_lead=0.02, min_prefetch_pause=0.03, end_evict=False)
    res = await run_workload(
        build_workload("fanout", params), Target(url, "m", hints), RunOptions(progress=False)
    )
    assert len(res.requests) == 1 + 2 * 2 + 1 and not any(r.error for r in res.requests)
    assert len({b["agent_hint"]["session_id"] for b in eng.bodies}) == 3
    edits = [m["agent_hint"]["context_management"]["edits"][0]["type"] for m in eng.manages]
    assert "evict" not in edits
    assert "evict:applied" not in summarize(res)["manage"]


async def test_trace_replay_sends_token_ids_and_waits_for_subagents(
    engine: tuple[FakeEngine, str],
) -> None:
    eng, url = engine
    params = {"files": "trace_0274", "token_scale": 1 / 16, "max_requests": 3}
    wl = build_workload("trace", params)
    opts = RunOptions(time_scale=0.0005, progress=False)
    res = await run_workload(wl, Target(url, "m", HintPolicy("session")), opts)
    assert not any(r.error for r in res.requests)
    assert all(isinstance(b["prompt"], list) for b in eng.bodies)
    assert {h["X-Session-Id"].split("-", 1)[1] for h in eng.headers} >= {"trace_0274"}
    main = [r for r in res.requests if r.parent_id is None]
    subs = [r for r in res.requests if r.parent_id is not None]
    assert len(main) == 3 and len(subs) == 48
    for r in res.requests:
        assert r.prompt_tokens == r.expected_prompt_tokens
    # the parent's call after the sub-agents starts after the last of them finished
    after = [r for r in main if r.t_start > min(s.t_start for s in subs)]
    assert after and min(r.t_start for r in after) >= max(s.t_end for s in subs)
    assert summarize(res)["hit_rate"] > 0.5


async def test_result_json_round_trip(engine: tuple[FakeEngine, str], tmp_path: Path) -> None:
    _, url = engine
    wl = build_workload("multiturn", _SMALL_MT | {"conversations": 2})
    res = await run_workload(wl, Target(url, "m"), RunOptions(progress=False, max_sessions=1))
    path = tmp_path / "r.json"
    res.save(path)
    back = RunResult.load(path)
    assert summarize(back) == summarize(res)
    roots = sorted(back.sessions, key=lambda s: s.t_start)
    assert roots[1].t_start >= roots[0].t_end  # max_sessions=1 runs them one after the other


async def _cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loadgen",
        "bench",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    return proc.returncode or 0, out.decode()


async def test_cli_run_report_ceiling(engine: tuple[FakeEngine, str], tmp_path: Path) -> None:
    eng, url = engine
    results = []
    for hints in ("none", "full"):
        out = tmp_path / f"{hints}.json"
        code, text = await _cli(
            "run",
            "--workload",
            "swarm",
            "--set",
            "users=3",
            "--set",
            "max_dispatches=3",
            "--token-scale",
            "0.02",
            "--time-scale",
            "0.01",
            "--target",
            url,
            "--model",
            "m",
            "--hints",
            hints,
            "--out",
            str(out),
            "--no-progress",
        )
        assert code == 0, text
        assert json.loads(text)["errors"] == 0
        results.append(str(out))
    n_calls = len(eng.bodies) // 2
    assert n_calls > 0 and sum("agent_hint" in b for b in eng.bodies) == n_calls
    assert len([m for m in eng.manages if "evict" in json.dumps(m)]) == 3
    code, text = await _cli("report", *results, "--out", str(tmp_path / "rep"))
    assert code == 0, text
    assert "| swarm/none | none |" in text and "| swarm/full | full |" in text
    assert (tmp_path / "rep" / "ttft_cdf.png").stat().st_size > 5000
    code, text = await _cli(
        "ceiling",
        "--set",
        "files=trace_0291",
        "--concurrency",
        "1",
        "--capacity",
        "1.0",
        "--emit-blocks",
        str(tmp_path / "b.jsonl"),
    )
    assert code == 0, text
    row = next(line for line in text.splitlines() if line.startswith("| 1 | 100%"))
    cells = [c.strip() for c in row.split("|")]
    assert cells[5] == cells[6]  # belady == inf when the cache holds the peak working set
    assert sum(1 for _ in (tmp_path / "b.jsonl").open()) == 32
