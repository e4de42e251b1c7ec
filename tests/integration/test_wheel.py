"""kvkeeper as users install it: the wheel built from the sources, installed non-editable into a
fresh virtual environment, serving a hinted request against the simulator with a real Redis.

These are the image's build steps too (deploy/Dockerfile): build the wheel without
dependencies, install it without the bench extra. The editable install the other tests use
would hide a file missing from the wheel (the Redis Lua scripts once were)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import IO

import httpx
import pytest
import yaml

from loadgen.sim import SimConfig, run_simulator_process
from loadgen.stack import TargetError, free_port, kvkeeper_config, wait_http
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "proxy", "adapters", "policy", "loadgen")
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
# the venv must see the wheel, not the checkout: no PYTHONPATH, run outside the repository
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run(argv: list[str], cwd: Path, timeout: float = 180) -> str:
    done = subprocess.run(
        argv, cwd=cwd, env=CLEAN_ENV, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{argv}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def build_wheel(out: Path) -> Path:
    """``pip wheel --no-deps`` on a copy of the sources (no stale build/ of the checkout)."""
    src = out / "src"
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, src / name)
    wheels = out / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-q",
          "--wheel-dir", str(wheels), str(src)], out)  # fmt: skip
    (wheel,) = wheels.glob("kvkeeper-*.whl")
    return wheel


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the wheel installed (its dependencies come from the system site)."""
    root = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(root)
    env = root / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(env)], root)
    _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir",
          "--force-reinstall", "--no-deps", str(wheel)], root)  # fmt: skip
    return env


def test_the_wheel_is_what_the_venv_imports(venv: Path) -> None:
    code = "import proxy, loadgen; print(proxy.__file__); print(loadgen.__file__)"
    for path in _run([str(venv / "bin" / "python"), "-c", code], venv).split():
        assert Path(path).is_relative_to(venv), path
    site = Path(_run([str(venv / "bin" / "python"), "-c", code], venv).split()[0]).parents[1]
    assert sorted(p.name for p in (site / "proxy" / "lua").glob("*.lua")) == sorted(
        p.name for p in (REPO / "proxy" / "lua").glob("*.lua")
    )
    assert len(list((site / "loadgen" / "traces" / "claude-code").glob("*.json.xz"))) == 48
    if (REPO / "proxy" / "ui").is_dir():
        assert {p.name for p in (REPO / "proxy" / "ui").iterdir()} <= {
            p.name for p in (site / "proxy" / "ui").iterdir()
        }


def test_version_comes_from_the_package_metadata(venv: Path) -> None:
    assert _run([str(venv / "bin" / "kvkeeper"), "--version"], venv).strip() == (
        f"kvkeeper {VERSION}"
    )


def _write_config(path: Path, doc: dict[str, object]) -> IO[bytes]:
    """Write kvkeeper's YAML config; returns the log file its process writes to."""
    path.write_text(yaml.safe_dump(doc))
    return path.with_suffix(".log").open("wb")


def _tail(log: Path) -> str:
    return log.read_text()[-3000:]


async def test_installed_kvkeeper_serves_a_hinted_request(venv: Path, tmp_path: Path) -> None:
    redis = RedisServer().start()
    config = tmp_path / "kvkeeper.yaml"
    try:
        async with run_simulator_process(SimConfig(profile="cpu-smollm2", speed=20.0)) as sim:
            port = free_port()
            doc = kvkeeper_config(
                [sim], port=port, redis_url=redis.url, model="sim", retention={}, offload=False
            )
            with _write_config(config, doc) as log:
                proc = await asyncio.create_subprocess_exec(
                    str(venv / "bin" / "kvkeeper"), "serve", "--config", str(config),
                    cwd=tmp_path, env=CLEAN_ENV, stdout=log, stderr=asyncio.subprocess.STDOUT,
                )  # fmt: skip
            try:
                await _hinted_request(f"http://127.0.0.1:{port}", proc, config.with_suffix(".log"))
            finally:
                if proc.returncode is None:
                    proc.terminate()
                await asyncio.wait_for(proc.wait(), 15)
    finally:
        redis.stop()


async def _hinted_request(url: str, proc: asyncio.subprocess.Process, log: Path) -> None:
    try:
        await wait_http(url + "/readyz", proc, timeout_s=60)
    except TargetError as e:
        pytest.fail(f"{e}: {_tail(log)}")
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"model": "sim", "max_tokens": 4,
                  "messages": [{"role": "user", "content": "hello"}]},
            headers={"X-Session-Id": "wheel-1", "X-Cache-TTL": "60"},
        )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.headers["X-KVKeeper-Hint"] == "accepted"
    assert r.json()["choices"][0]["message"]["content"]


def test_the_image_builds_and_installs_the_same_way() -> None:
    """deploy/Dockerfile: the wheel built like build_wheel, installed without the bench extra,
    and no source tree copied into the final image."""
    text = (REPO / "deploy" / "Dockerfile").read_text()
    build, final = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert re.search(r"pip wheel .*--no-deps .*--wheel-dir /wheels \.", build)
    assert all(f"COPY {name} {name}" in build for name in SOURCES[2:])
    assert re.search(r"pip install .*/wheels/kvkeeper-\*\.whl", final)
    assert "[bench]" not in final and not re.search(r"^COPY (?!--from)", final, flags=re.M)
