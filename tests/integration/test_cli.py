"""The command line: `kvkeeper serve` validates settings clearly; `kvkeeper sessions` drives the
admin API of a live proxy."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.cli import main
from tests.helpers.redis_server import RedisServer
from tests.integration.proxy_fixtures import ADMIN, proxy_stack

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", *args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "at least one engine is required"),
        (("--engine", "localhost:8000"), "engine url must look like http://host:port"),
        (("--engine", "http://a:1", "--redis", "mysql://x"), "redis url must be"),
        (
            (
                "--engine",
                "http://a:1",
                "--engine-events",
                "tcp://a:2",
                "--engine-events",
                "tcp://a:3",
            ),
            "more --engine-events",
        ),
        (("--engine", "http://a:1", "--engine-events", "http://a:2"), "tcp://host:port"),
        (("--engine", "http://a:1", "--config", "/nonexistent.yaml"), "does not exist"),
    ],
)
def test_serve_rejects_bad_settings_clearly(args: tuple[str, ...], message: str) -> None:
    done = _serve(*args)
    assert done.returncode == 2
    assert message in done.stderr and "kvkeeper serve: error:" in done.stderr


def test_serve_rejects_bad_env_and_yaml(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "KVKEEPER_RETENTION__BUDGET_SHARE": "3"}
    done = _serve("--engine", "http://a:1", env=env)
    assert done.returncode == 2 and "retention.budget_share" in done.stderr
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("engines: [{url: 'http://a:1'}]\nlimits: {max_ttl_s: -5}\n")
    done = _serve("--config", str(cfg))
    assert done.returncode == 2 and "limits.max_ttl_s" in done.stderr


async def test_sessions_cli_lists_shows_and_frees(
    redis_server: RedisServer, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        for sid, parent in (("lead", None), ("w1", "lead"), ("w2", "lead")):
            hint = {"session_id": sid, **({"parent_session_id": parent} if parent else {})}
            resp = await st.client.post("/v1/chat/completions", json={**CHAT, "agent_hint": hint})
            await resp.read()
        url = str(st.client.make_url("/")).rstrip("/")
        base = ["sessions", "--url", url, "--token", ADMIN]

        async def cli(*args: str) -> tuple[int, str]:
            code = await asyncio.to_thread(main, [*base, *args])
            return code, capsys.readouterr().out

        code, out = await cli("list", "--parent", "lead")
        rows = [line.split()[0] for line in out.splitlines()[1:]]
        assert code == 0 and rows == ["w1", "w2"]
        code, out = await cli("show", "lead")
        assert code == 0 and '"children": [' in out and '"w1"' in out
        code, out = await cli("free", "lead", "--tree")
        assert code == 0 and out.strip().startswith("freed:") and out.strip().endswith("lead")
        with pytest.raises(SystemExit, match="404"):
            await asyncio.to_thread(main, [*base, "show", "lead"])
        with pytest.raises(SystemExit, match="401"):
            await asyncio.to_thread(main, ["sessions", "--url", url, "--token", "wrong", "list"])
