"""Observability and loud configuration: /metrics as Prometheus parses it, the access log, JSON
logs, Redis and engine state logged and exported, one-line start-up errors."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.logs import FIELDS, JsonFormatter, TextFormatter, configure_logging
from tests.helpers.fake_engine import FakeEngine, serve_fake
from tests.helpers.redis_server import RedisServer, free_port
from tests.integration.proxy_fixtures import Stack, proxy_stack

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "the secret prompt " * 8}]}


async def _samples(st: Stack) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = await (await st.client.get("/metrics")).text()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


async def _until(st: Stack, name: str, labels: dict[str, str], value: float) -> None:
    for _ in range(100):
        found = (await _samples(st)).get(name, [])
        if any(lab == labels and v == value for lab, v in found):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name}{labels} never reached {value}: {found}")


async def test_metrics_parse_with_process_build_up_gauges_and_ttft_by_engine(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace, n_engines=2) as st:
        for _ in range(2):
            resp = await st.client.post("/v1/chat/completions", json=CHAT)
            assert resp.status == 200
            await resp.read()
        await _until(st, "kvkeeper_redis_up", {}, 1.0)
        for e in st.engines:
            name = e.url.removeprefix("http://")
            await _until(st, "kvkeeper_engine_up", {"engine": name}, 1.0)
        samples = await _samples(st)
        inflight = {lab["engine"]: v for lab, v in samples["kvkeeper_inflight_requests"]}
        assert inflight == {e.url.removeprefix("http://"): 0.0 for e in st.engines}
        for name in ("process_cpu_seconds_total", "process_resident_memory_bytes"):
            assert samples[name][0][1] > 0
        assert samples["process_start_time_seconds"][0][1] > 1e9
        (build,) = samples["kvkeeper_build_info"]
        assert build[1] == 1.0 and build[0]["version"] and build[0]["python"]
        served = {e.url.removeprefix("http://") for e in st.engines if e.received}
        ttft = {
            lab["engine"]
            for lab, v in samples["kvkeeper_ttft_seconds_count"]
            if lab["route"] == "/v1/chat/completions" and v > 0
        }
        assert ttft == served and served


async def test_access_log_line_per_request_honours_request_id_and_hides_the_prompt(
    redis_server: RedisServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvkeeper.access")
    async with proxy_stack(redis_server.url, namespace) as st:
        body = {**CHAT, "agent_hint": {"session_id": "s1"}}
        resp = await st.client.post(
            "/v1/chat/completions", json=body, headers={"X-Request-Id": "client-77"}
        )
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "client-77"
        await resp.read()
        bad = await st.client.post(
            "/v1/chat/completions", json={**CHAT, "agent_hint": {"session_id": 5}}
        )
        assert bad.status == 400 and len(bad.headers["X-Request-Id"]) == 32
    records = [r for r in caplog.records if r.name == "kvkeeper.access"]
    assert len(records) == 2
    ok, err = (getattr(r, FIELDS) for r in records)
    engine = st.engine.url.removeprefix("http://")
    assert ok["request_id"] == "client-77" and ok["status"] == 200
    assert ok["route"] == "/v1/chat/completions" and ok["method"] == "POST"
    assert ok["tenant"] == "default" and ok["engine"] == engine and ok["hint"] == "accepted"
    assert ok["prompt_tokens"] > 0 and ok["cached_tokens"] == 0 and ok["ttft_ms"] >= 0
    assert err["status"] == 400 and err["request_id"] == bad.headers["X-Request-Id"]
    line = TextFormatter().format(records[0])
    assert (
        "kvkeeper.access: request request_id=client-77" in line
        and "status=200" in line
        and "hint=accepted" in line
    )
    assert "secret" not in line and "secret" not in json.dumps(ok)
    assert 'hint="accepted; note=x"' in TextFormatter().format(
        logging.makeLogRecord({"msg": "request", FIELDS: {"hint": "accepted; note=x"}})
    )


def test_json_formatter_one_object_per_line_with_fields() -> None:
    record = logging.LogRecord("kvkeeper.access", logging.INFO, __file__, 1, "x=%s", ("y",), None)
    setattr(record, FIELDS, {"request_id": "r1", "status": 200})
    line = JsonFormatter().format(record)
    assert "\n" not in line
    out = json.loads(line)
    assert out["msg"] == "x=y" and out["level"] == "INFO" and out["logger"] == "kvkeeper.access"
    assert out["request_id"] == "r1" and out["status"] == 200 and out["ts"].endswith("Z")


async def test_redis_unreachable_at_start_is_logged_and_exported(
    namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvkeeper.watch")
    dead = f"redis://127.0.0.1:{free_port()}/0"
    async with proxy_stack(dead, namespace) as st:
        await _until(st, "kvkeeper_redis_up", {}, 0.0)
        engine = st.engine.url.removeprefix("http://")
        await _until(st, "kvkeeper_engine_up", {"engine": engine}, 1.0)
    text = caplog.text
    assert f"redis at {dead} is unreachable" in text and "store_unavailable" in text
    assert f"engine {engine} at {st.engine.url} is up" in text


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_port_in_use_is_one_line_without_traceback(redis_server: RedisServer) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _serve(
            "--host", "127.0.0.1", "--port", str(port), "--engine", "http://127.0.0.1:9",
            "--redis", redis_server.url,
        )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("kvkeeper serve")]
    assert lines == [
        f"kvkeeper serve: error: cannot listen on http://127.0.0.1:{port}: address already in "
        "use (another process listens on that port)"
    ], done.stderr
    assert "listening" not in done.stdout


async def test_redis_url_naming_something_else_fails_open_with_a_reason(
    namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvkeeper.watch")
    async with serve_fake(FakeEngine(name="not-redis")) as http_server:
        wrong = http_server.url.replace("http://", "redis://") + "/0"
        async with proxy_stack(wrong, namespace) as st:
            await _until(st, "kvkeeper_redis_up", {}, 0.0)
            body = {**CHAT, "agent_hint": {"session_id": "s"}}
            resp = await st.client.post("/v1/chat/completions", json=body)
            assert resp.status == 200
            assert resp.headers["X-KVKeeper-Hint"] == "rejected; reason=store_unavailable"
    lines = [r.getMessage() for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(lines) == 1 and "InvalidResponse" in lines[0], lines


def test_access_log_can_be_turned_off() -> None:
    access = logging.getLogger("kvkeeper.access")
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging("INFO", "json", access_log=False)
        assert not access.isEnabledFor(logging.INFO) and access.isEnabledFor(logging.WARNING)
        configure_logging("INFO", "json")
        assert access.isEnabledFor(logging.INFO)
        assert isinstance(root.handlers[0].formatter, JsonFormatter)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        access.setLevel(logging.NOTSET)


async def test_serve_log_format_json_writes_access_lines_as_json(redis_server: RedisServer) -> None:
    async with serve_fake(FakeEngine()) as engine:
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--engine", engine.url, "--redis", redis_server.url,
            "--log-format", "json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert b"kvkeeper listening" in line
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json=CHAT,
                    headers={"X-Request-Id": "json-1"},
                ) as resp,
            ):
                assert resp.status == 200
                await resp.read()
        finally:
            proc.terminate()
            _, err = await asyncio.wait_for(proc.communicate(), 30)
    records = [json.loads(ln) for ln in err.decode().splitlines() if ln.startswith("{")]
    assert records and all({"ts", "level", "logger", "msg"} <= r.keys() for r in records)
    (access,) = [r for r in records if r["logger"] == "kvkeeper.access"]
    assert access["request_id"] == "json-1" and access["status"] == 200
    assert access["route"] == "/v1/chat/completions" and access["prompt_tokens"] > 0
    assert any(r["logger"] == "kvkeeper.watch" and "is up" in r["msg"] for r in records)
