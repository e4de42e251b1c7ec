"""``scripts/bench_proxy_overhead.py --saturate``: the pin syntax, how clients are split over
load processes, how their reports add up, the issue's ratios, and one real load process
(``--load-worker``) against the script's own upstream, through its ready/window protocol."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_proxy_overhead.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_proxy_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_parse_pin_roles_ranges_and_continuations() -> None:
    pins = bench.parse_pin("proxy=0-5,upstream=6-9,redis=10,load=11-13,15")
    assert pins == {
        "proxy": {0, 1, 2, 3, 4, 5},
        "upstream": {6, 7, 8, 9},
        "redis": {10},
        "load": {11, 12, 13, 15},
    }
    assert bench.parse_pin("") == {}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("engine=0-3", "unknown role"),
        ("proxy=0,proxy=1", "given twice"),
        ("0-3,proxy=4", "before any role"),
        ("proxy=3-1", "bad CPU range"),
        ("proxy=a", "bad CPU range"),
    ],
)
def test_parse_pin_rejects_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bench.parse_pin(spec)


def test_split_clients_even_and_never_empty() -> None:
    assert bench.split_clients(256, 5) == [52, 51, 51, 51, 51]
    assert bench.split_clients(3, 8) == [1, 1, 1]  # no load process without a client
    assert bench.split_clients(7, 0) == [7]


def test_aggregate_adds_processes_and_pools_latencies() -> None:
    parts = [
        {"lat_us": [1000, 2000, 3000], "errors": 0, "cpu_s": 1.0, "late_s": 0.0},
        {"lat_us": [4000] * 7, "errors": 2, "cpu_s": 0.5, "late_s": 0.02},
    ]
    row = bench.aggregate(parts, 2.0)
    assert row["requests"] == 10
    assert row["errors"] == 2
    assert row["rps"] == pytest.approx(5.0)
    assert row["p50_ms"] == pytest.approx(4.0)
    assert row["load_cores"] == pytest.approx(0.75)
    assert row["load_busiest_proc"] == pytest.approx(0.5)
    assert row["load_late_s"] == pytest.approx(0.02)
    empty = bench.aggregate([{"lat_us": [], "errors": 5, "cpu_s": 0.1, "late_s": 0.0}], 1.0)
    assert empty["rps"] == 0 and empty["p99_ms"] is None and empty["errors"] == 5


def _row(rps: float, cpu: float | None = None) -> dict[str, Any]:
    return {"rps": rps, "proxy_cpu_us_per_req": cpu}


def test_summarize_takes_medians_and_sums_errors() -> None:
    rounds = [
        {**_row(100.0, 50.0), "errors": 1},
        {**_row(300.0, 70.0), "errors": 0},
        {**_row(200.0, 60.0), "errors": 2},
    ]
    out = bench.summarize(rounds)
    assert out["rps"] == 200.0 and out["proxy_cpu_us_per_req"] == 60.0
    assert out["errors"] == 3 and out["rps_rounds"] == [100.0, 300.0, 200.0]
    assert out["redis_cpu_us_per_req"] is None  # absent in every round


def test_saturation_ratios_are_the_issues_figures() -> None:
    row = {
        "direct": _row(60000.0),
        "vllm-router": _row(30000.0, 100.0),
        "vllm-router rr": _row(40000.0, 50.0),
        "kvkeeper": _row(2500.0, 240.0),
        "kvkeeper+hints": _row(2000.0, 300.0),
        "kvkeeper w6": _row(13500.0, 250.0),
        "kvkeeper+hints w6": _row(10800.0, 110.0),
    }
    r = bench.saturation_ratios(row, [1, 6])
    assert r["hinted_rps_w6"] == 10800.0
    assert r["hinted_scaling_w1_to_w6_of_linear"] == pytest.approx(10800 / (6 * 2000))
    assert r["unhinted_scaling_w1_to_w6_of_linear"] == pytest.approx(13500 / (6 * 2500))
    assert r["hinted_cpu_w6_over_router_cache_aware"] == pytest.approx(1.1)
    assert r["hinted_cpu_w1_over_router_cache_aware"] == pytest.approx(3.0)
    assert r["hinted_cpu_over_unhinted_w6"] == pytest.approx(110 / 250)
    assert r["direct_rps_over_hinted_w6"] == pytest.approx(60000 / 10800)
    no_router = bench.saturation_ratios({k: v for k, v in row.items() if "router" not in k}, [1, 6])
    assert no_router["hinted_cpu_w6_over_router_cache_aware"] is None


def test_hinted_bodies_one_per_session() -> None:
    bodies = [json.loads(b) for b in bench.request_bodies(True, 3, 0)]
    assert [b["agent_hint"]["session_id"] for b in bodies] == ["s0", "s1", "s2"]
    assert bodies[0]["messages"] == bench.BODY["messages"]
    (plain,) = bench.request_bodies(False, 3, 100)
    assert "agent_hint" not in json.loads(plain)


async def test_load_worker_process_measures_its_window() -> None:
    seen: list[bytes] = []
    app = bench.upstream_app()

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "POST":
            seen.append(await request.read())
        response: web.StreamResponse = await handler(request)
        return response

    app.middlewares.append(record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    cfg = {
        "url": f"http://127.0.0.1:{port}/v1/chat/completions",
        "clients": 4,
        "hinted": True,
        "sessions": 5,
        "prompt_chars": 0,
        "offset": 0,
    }

    def drive() -> tuple[str, str]:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--load-worker", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            ready = proc.stdout.readline().strip()
            t_start = time.time() + 0.3
            proc.stdin.write(f"{t_start} {t_start + 0.5}\n")
            proc.stdin.close()
            out = proc.stdout.read()
            proc.wait(timeout=20)
            return ready, out
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    try:
        async with asyncio.timeout(30):
            ready, out = await asyncio.to_thread(drive)
    finally:
        await runner.cleanup()
    assert ready == "ready"
    report = json.loads(out.strip().splitlines()[-1])
    assert report["errors"] == 0
    assert 0 < len(report["lat_us"]) < len(seen)  # the warm-up's requests are not counted
    assert all(x > 0 for x in report["lat_us"])
    assert 0 < report["cpu_s"] < 1.0
    sessions = {json.loads(b)["agent_hint"]["session_id"] for b in seen}
    assert sessions == {"s0", "s1", "s2", "s3", "s4"}
