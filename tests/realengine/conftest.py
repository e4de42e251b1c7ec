"""The real engine for the ``realengine`` suite: one vLLM-on-CPU server per test session.

``vllm_engine`` starts it with a 200-block pool of 32-token blocks, KV events (and replay) on free
ports, ``PYTHONHASHSEED=0`` and dev mode, and kills it at session end. Every test starts from an
empty prefix cache (``POST /reset_prefix_cache``, autouse).

``KVKEEPER_REALENGINE_URL=http://127.0.0.1:8100`` attaches to an engine already started with
``kvkeeper engine up`` instead (fast iteration); events and geometry are then discovered.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from adapters.prom import cache_config_from, parse_text
from adapters.vllm import event_endpoints_from
from proxy.engine_cli import (
    SERVED_NAME,
    EngineError,
    EngineSpec,
    engine_home,
    ensure_engine_installed,
    run_dir,
    start_engine,
    stop_engine,
    wait_ready,
)

START_TIMEOUT = float(os.environ.get("KVKEEPER_ENGINE_START_TIMEOUT", "420"))


@dataclass(frozen=True, slots=True)
class VLLMEngine:
    """What tests need to know about the running engine."""

    url: str
    events_endpoint: str
    replay_endpoint: str | None
    num_blocks: int
    block_size: int
    model: str
    hash_seed: str
    hf_dir: Path
    log_path: Path | None


def _free_ports(n: int) -> list[int]:
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _attach(url: str) -> VLLMEngine:
    """Describe an engine someone else started (discovering events and geometry)."""
    with urllib.request.urlopen(f"{url}/kv_event_sources", timeout=10) as resp:
        found = event_endpoints_from(json.loads(resp.read()), "127.0.0.1")
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        config = cache_config_from(parse_text(resp.read().decode()))
    assert found is not None, "the engine publishes no KV events"
    assert config is not None, "the engine exposes no vllm:cache_config_info"
    return VLLMEngine(
        url=url,
        events_endpoint=found.endpoint,
        replay_endpoint=found.replay_endpoint,
        num_blocks=config.num_blocks or 0,
        block_size=config.block_size,
        model=SERVED_NAME,
        hash_seed="0",
        hf_dir=engine_home() / "model",
        log_path=None,
    )


@pytest.fixture(scope="session")
def vllm_engine() -> Iterator[VLLMEngine]:
    """A real vLLM server (started once per test session)."""
    attach = os.environ.get("KVKEEPER_REALENGINE_URL")
    if attach:
        yield _attach(attach.rstrip("/"))
        return
    try:
        python, model_dir = ensure_engine_installed()
    except EngineError as exc:
        pytest.fail(f"engine venv/model setup failed: {exc}")
    port, events_port, replay_port = _free_ports(3)
    spec = EngineSpec(port=port, num_blocks=200, events_port=events_port, replay_port=replay_port)
    proc = start_engine(spec, python, model_dir)
    try:
        wait_ready(spec, proc, START_TIMEOUT)
    except EngineError as exc:
        pytest.fail(f"vLLM did not start: {exc}")
    try:
        yield VLLMEngine(
            url=spec.url,
            events_endpoint=spec.events_endpoint or "",
            replay_endpoint=spec.replay_endpoint,
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            model=SERVED_NAME,
            hash_seed=spec.hash_seed,
            hf_dir=model_dir,
            log_path=run_dir(port)[1],
        )
    finally:
        stop_engine(port)


@pytest.fixture(autouse=True)
def _clean_prefix_cache(vllm_engine: VLLMEngine) -> None:
    """Each test starts with an empty prefix cache."""
    req = urllib.request.Request(f"{vllm_engine.url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
