"""The command line: `kvkeeper serve` validates settings clearly; `kvkeeper sessions` and
`kvkeeper engines` drive the admin API of a live proxy (real kvkeeper, simulator, redis-server)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.keys import SessionKey
from tests.helpers.redis_server import RedisServer
from tests.integration.proxy_fixtures import ADMIN, proxy_stack
from tests.integration.retention_fixtures import prompt, sim_stack, wait_for

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
        code, out = await cli("show", "lead", "--json")
        assert code == 0 and json.loads(out)["tree"]["children"][0]["session_id"] == "w1"
        code, out = await cli("free", "lead", "--tree")
        assert code == 0 and out.strip().startswith("freed:") and out.strip().endswith("lead")
        assert await asyncio.to_thread(main, [*base, "show", "lead"]) == 1
        assert "404: no session 'lead'" in capsys.readouterr().err
        assert (
            await asyncio.to_thread(main, ["sessions", "--url", url, "--token", "x", "list"]) == 1
        )
        assert "401" in capsys.readouterr().err


Cli = Callable[..., Awaitable[tuple[int, str, str]]]


def _cli(url: str, capsys: pytest.CaptureFixture[str], token: str = ADMIN) -> Cli:
    async def cli(*args: str) -> tuple[int, str, str]:
        argv = [args[0], "--url", url, "--token", token, *args[1:]]
        code = await asyncio.to_thread(main, argv)
        got = capsys.readouterr()
        return code, got.out, got.err

    return cli


async def test_sessions_list_empty_pages_and_json_anywhere(
    redis_server: RedisServer, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        cli = _cli(str(st.client.make_url("/")).rstrip("/"), capsys)
        code, out, _ = await cli("sessions", "list")  # a fresh deployment: no crash
        assert code == 0 and out.strip() == "no sessions"
        code, out, _ = await cli("sessions", "list", "--json")
        assert code == 0 and json.loads(out) == {"object": "list", "data": [], "next_cursor": None}

        for i in range(7):
            hint = {"session_id": f"s{i}"}
            resp = await st.client.post("/v1/chat/completions", json={**CHAT, "agent_hint": hint})
            await resp.read()
        code, out, err = await cli("sessions", "list", "--limit", "3")
        lines = out.splitlines()
        assert code == 0 and lines[0].split()[:3] == ["SESSION", "TENANT", "STATE"]
        assert len(lines) == 4 and all(line.split()[1] == "default" for line in lines[1:])
        cursor = re.search(r"--cursor (\S+)", err)
        assert cursor and "--all" in err and "3 shown" in err  # not silently truncated
        code, out, err = await cli("sessions", "list", "--limit", "3", "--cursor", cursor[1])
        assert len(out.splitlines()) == 4 and "--cursor" in err
        code, out, err = await cli("sessions", "list", "--limit", "3", "--all")
        assert code == 0 and len(out.splitlines()) == 8 and "7 sessions" in err
        ids = {line.split()[0] for line in out.splitlines()[1:]}
        assert ids == {f"s{i}" for i in range(7)}

        # --json before the action, after it, and before the command: the same document
        docs = []
        for argv in (
            ["sessions", "--json", "list", "--all"],
            ["sessions", "list", "--all", "--json"],
        ):
            code, out, _ = await cli(*argv)
            docs.append(json.loads(out))
        code = await asyncio.to_thread(
            main, ["--json", "sessions", "--url", str(st.client.make_url("/")).rstrip("/"),
                   "--token", ADMIN, "list", "--all"],
        )  # fmt: skip
        docs.append(json.loads(capsys.readouterr().out))
        assert docs[0] == docs[1] == docs[2] and len(docs[0]["data"]) == 7
        code, _, err = await cli("sessions", "list", "--limit", "0")
        assert code == 1 and "400" in err and "limit" in err
        code, _, err = await cli("sessions", "show", "nope")
        assert code == 1 and "404" in err


async def test_show_operations_and_engines_against_the_simulator(
    redis_server: RedisServer, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with sim_stack(redis_server.url, namespace, cpu_blocks=1000) as st:
        await st.complete(prompt(1), {"session_id": "lead", "cache_control": {"ttl": 300}})
        await st.complete(prompt(2), {"session_id": "w1", "parent_session_id": "lead"})
        await st.complete(prompt(3), {"session_id": "w2", "parent_session_id": "lead"})
        retention = st.runtime().retention

        async def known() -> bool:
            return len(await retention.blocks.blocks_of(SessionKey("default", "lead"))) == 63

        assert await wait_for(known)
        cli = _cli(str(st.proxy.make_url("/")).rstrip("/"), capsys)

        code, out, _ = await cli("sessions", "show", "lead")
        assert code == 0
        assert re.search(r"^created +\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", out, re.M), out
        assert "state      protected" in out and "tenant default" in out
        tree = out.split("\ntree\n", 1)[1].splitlines()
        assert tree[:3] == ["  lead [protected]", "  ├─ w1 [idle]", "  └─ w2 [idle]"]
        assert "residency  63 blocks" in out, out
        name = st.sim.url.removeprefix("http://")
        row = next(line.split() for line in out.splitlines() if line.startswith(f"  {name}"))
        assert re.search(r"ENGINE +GPU_PREFIX_BLOCKS +CPU_PREFIX_BLOCKS", out)
        assert row[1:] == ["63", "56"]  # all of it on the GPU; 7 256-token chunks in the tier

        code, out, _ = await cli("sessions", "offload", "lead")
        assert code == 0 and out.startswith("offload lead: applied") and "stored_tokens=1792" in out
        code, out, _ = await cli("sessions", "show", "lead")
        assert "state      offloaded" in out and "tree\n  lead [offloaded]" in out
        code, out, _ = await cli("sessions", "prefetch", "lead", "--blocks", "0:10")
        assert code == 0 and out.startswith("prefetch lead: applied")
        code, out, _ = await cli("sessions", "pin", "w1", "--ttl", "120")
        assert code == 0 and out.startswith("pin w1: applied")
        code, out, _ = await cli("sessions", "list", "--state", "protected")
        assert [line.split()[0] for line in out.splitlines()[1:]] == ["w1"]
        code, out, _ = await cli("sessions", "evict", "w1", "--blocks", "0:64")
        assert code == 3 and "rejected" in out and "range_out_of_bounds" in out
        code, _, err = await cli("sessions", "evict", "w1", "--blocks", "3")
        assert code == 2 and "START:END" in err
        code, out, _ = await cli("sessions", "evict", "w1", "--json")
        assert code == 0 and json.loads(out)["status"] == "applied"

        code, out, _ = await cli("engines")
        header, row_line = out.splitlines()[:2]
        assert header.split()[:4] == ["ENGINE", "URL", "HEALTHY", "INFLIGHT"]
        cells = row_line.split()
        assert cells[:3] == [name, st.sim.url, "yes"] and (cells[5], cells[7]) == ("yes", "events")
        assert header.split()[6] == "HASH"
        assert re.search(r"GPU=\d+", row_line) and "chunks=" in row_line
        code, out, _ = await cli("engines", "--json")
        assert json.loads(out)["data"][0]["retention"]["offload_tier"] is True
        code, _, err = await _cli(str(st.proxy.make_url("/")).rstrip("/"), capsys, "bad")("engines")
        assert code == 1 and "401" in err


def test_help_texts_name_defaults_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("kvkeeper ")
    for argv, needle in (
        (["sessions", "list", "--help"], "(default: 50; 500 with --all)"),
        (["sessions", "pin", "--help"], "(default: the session's TTL)"),
        (["engines", "--help"], "(default: $KVKEEPER_URL or http://127.0.0.1:8000)"),
        (["engine", "up", "--help"], "KV pool size in blocks (default: 200)"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert needle in " ".join(capsys.readouterr().out.split())
    # a help that names its default in words gets no second, empty one from the formatter
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    sim_help = " ".join(capsys.readouterr().out.split())
    assert "(default: vLLM's LRU)" in sim_help and "(default: )" not in sim_help
    assert "(default: 0)" in sim_help  # the other options keep theirs
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "anchor" not in capsys.readouterr().out  # the name of a retired feature


def test_engines_table_shows_the_hash_check_and_tier_pins() -> None:
    from proxy.sessions_format import engine_rows

    row = {
        "name": "e0",
        "url": "http://e0:8000",
        "healthy": True,
        "inflight": 2,
        "models": ["m"],
        "events": "tcp://e0:5557",
        "hash_check": {"status": "mismatch", "detail": "0 of 4 blocks", "checked_at": 1.0},
        "retention": {
            "mode": "feedback",
            "horizon_s": None,
            "resident_blocks": {},
            "tier_pinned": {"sessions": 3, "chunks": 21, "capacity_chunks": None},
            "overhead": {"credit_tokens": 812.4},
        },
    }
    lines = engine_rows([row, {**row, "name": "e1", "hash_check": None}], 0.0).splitlines()
    assert lines[1].split()[:9] == ["e0", "http://e0:8000", "yes", "2", "m", "yes", "mismatch",
                                    "feedback", "-"]  # fmt: skip
    assert "sessions=3 chunks=21" in lines[1] and "capacity" not in lines[1] and "812" in lines[1]
    assert lines[2].split()[6] == "-"
