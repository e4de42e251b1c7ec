"""``kvkeeper engine up|down|status``: a local vLLM-on-CPU engine for development and tests.

``deploy/local/engine-setup.sh`` creates the engine venv and the converted model once; this
module starts ``python -m vllm.entrypoints.openai.api_server`` from that venv in its own process
group (vLLM forks an engine-core process), records its PID, waits for ``/health`` within a
bounded time and stops it by PID. The test suite's ``vllm_engine`` fixture uses the same calls.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SETUP_SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "local" / "engine-setup.sh"
SERVED_NAME = "smol"


class EngineError(RuntimeError):
    """The local engine could not be set up, started or stopped."""


def engine_home() -> Path:
    """``${KVKEEPER_HOME:-~/.cache/kvkeeper}/engine``."""
    base = os.environ.get("KVKEEPER_HOME") or str(Path.home() / ".cache" / "kvkeeper")
    return Path(base) / "engine"


# CPU flags with native bf16 matmuls; without them vLLM's CPU backend emulates bf16, several
# times slower than float32
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def engine_dtype(cpuinfo: str | None = None) -> str:
    """``KVKEEPER_ENGINE_DTYPE``, else ``bfloat16`` where the CPU computes it natively and
    ``float32`` where it does not (``cpuinfo``: the text of /proc/cpuinfo, read when None).
    Block hashes and cached-token counts do not depend on it; speed and KV bytes do."""
    if chosen := os.environ.get("KVKEEPER_ENGINE_DTYPE"):
        return chosen
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "bfloat16"  # not Linux: vLLM's own default for this model
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split()}
    return "bfloat16" if flags & BF16_FLAGS else "float32"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def ensure_engine_installed(timeout: float = 3600.0) -> tuple[Path, Path]:
    """Run the idempotent setup script; return (venv python, model dir)."""
    if not SETUP_SCRIPT.is_file():
        raise EngineError(f"setup script not found: {SETUP_SCRIPT}")
    done = subprocess.run(
        ["bash", str(SETUP_SCRIPT)], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise EngineError(f"engine setup failed ({done.returncode}):\n{done.stderr[-4000:]}")
    found = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return Path(found["python"]), Path(found["model"])


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """How to start one engine: ports, KV pool size, events endpoints."""

    port: int = 8100
    num_blocks: int = 200
    block_size: int = 32
    events_port: int | None = 5557
    replay_port: int | None = None
    hash_seed: str = "0"
    max_model_len: int = 4096
    dtype: str = field(default_factory=engine_dtype)
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        return None if self.events_port is None else f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"

    def command(self, python: Path, model_dir: Path) -> list[str]:
        cmd = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(self.max_model_len), "--dtype", self.dtype,
            "--block-size", str(self.block_size), "--num-gpu-blocks-override", str(self.num_blocks),
            "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if self.events_port is not None:
            events: dict[str, object] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.events_port}",
                "topic": "kv",
            }
            if self.replay_port is not None:
                events["replay_endpoint"] = f"tcp://*:{self.replay_port}"
            cmd += ["--kv-events-config", json.dumps(events)]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONHASHSEED=self.hash_seed,  # fixes NONE_HASH, so block hashes are predictable
            VLLM_SERVER_DEV_MODE="1",  # serves POST /reset_prefix_cache
            VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
        )
        env.update(self.extra_env)
        return env


def run_dir(port: int) -> tuple[Path, Path]:
    """PID file and log file of the engine on ``port``."""
    folder = engine_home() / "run"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"engine-{port}.pid", folder / f"engine-{port}.log"


def log_tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_engine(spec: EngineSpec, python: Path, model_dir: Path) -> subprocess.Popen[bytes]:
    """Start the server detached in its own process group; write its PID file."""
    pid_file, log = run_dir(spec.port)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            spec.command(python, model_dir),
            env=spec.env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    pid_file.write_text(str(proc.pid))
    return proc


def wait_ready(spec: EngineSpec, proc: subprocess.Popen[bytes], timeout: float) -> float:
    """Block until ``/health`` answers; seconds taken. Stops the engine and raises on failure."""
    _, log = run_dir(spec.port)
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise EngineError(
                f"engine exited with {proc.returncode} during start-up; log {log}:\n"
                + log_tail(log)
            )
        if healthy(spec.url):
            return time.monotonic() - started
        time.sleep(1.0)
    stop_engine(spec.port)
    raise EngineError(f"engine not ready after {timeout:.0f}s; log {log}:\n{log_tail(log)}")


def read_pid(port: int) -> int | None:
    pid_file, _ = run_dir(port)
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def stop_engine(port: int, grace: float = 20.0) -> bool:
    """SIGTERM the engine's process group, SIGKILL after ``grace`` s; False if none ran."""
    pid_file, _ = run_dir(port)
    pid = read_pid(port)
    if pid is None:
        pid_file.unlink(missing_ok=True)
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if _reap(pid):
                break
            time.sleep(0.25)
        else:
            os.killpg(pid, signal.SIGKILL)
            _reap(pid, wait=True)
    except ProcessLookupError:
        pass
    pid_file.unlink(missing_ok=True)
    return True


def _reap(pid: int, *, wait: bool = False) -> bool:
    """True once ``pid`` is gone (reaping it if it is our child)."""
    try:
        done, _ = os.waitpid(pid, 0 if wait else os.WNOHANG)
        if done == pid:
            return True
    except ChildProcessError:
        pass  # not our child: fall back to probing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# CLI ---------------------------------------------------------------------------------------


def _up(args: argparse.Namespace) -> int:
    spec = EngineSpec(
        port=args.port,
        num_blocks=args.num_blocks,
        events_port=None if args.events_port == 0 else args.events_port,
        replay_port=args.replay_port or None,
        hash_seed=args.hash_seed,
    )
    if read_pid(spec.port) is not None and healthy(spec.url):
        print(f"engine already running at {spec.url} (pid {read_pid(spec.port)})")
        return 0
    try:
        python, model_dir = ensure_engine_installed()
        proc = start_engine(spec, python, model_dir)
        took = wait_ready(spec, proc, args.timeout)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"engine ready at {spec.url} in {took:.0f}s (pid {proc.pid})")
    print(f"model={SERVED_NAME} blocks={spec.num_blocks}x{spec.block_size}")
    if spec.events_endpoint:
        print(f"events={spec.events_endpoint} replay={spec.replay_endpoint}")
    return 0


def _down(args: argparse.Namespace) -> int:
    stopped = stop_engine(args.port)
    print("engine stopped" if stopped else f"no engine recorded on port {args.port}")
    return 0


def _status(args: argparse.Namespace) -> int:
    pid = read_pid(args.port)
    url = f"http://127.0.0.1:{args.port}"
    state = "healthy" if healthy(url) else "not answering"
    print(f"pid={pid or '-'} url={url} {state} log={run_dir(args.port)[1]}")
    return 0 if pid is not None and state == "healthy" else 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``engine up|down|status``."""
    parser = subparsers.add_parser("engine", help="local vLLM-on-CPU engine (dev and tests)")
    sub = parser.add_subparsers(dest="engine_command", metavar="ACTION", required=True)
    defaults = argparse.ArgumentDefaultsHelpFormatter  # every option's help names its default
    up = sub.add_parser(
        "up", help="install once, start, wait until ready", formatter_class=defaults
    )
    up.add_argument("--port", type=int, default=8100, help="HTTP port")
    up.add_argument("--num-blocks", type=int, default=200, help="KV pool size in blocks")
    up.add_argument("--events-port", type=int, default=5557, help="ZMQ PUB port; 0 disables")
    up.add_argument("--replay-port", type=int, default=0, help="ZMQ replay port; 0 disables")
    up.add_argument("--hash-seed", default="0", help="PYTHONHASHSEED of the engine")
    up.add_argument("--timeout", type=float, default=360.0, help="start-up limit in seconds")
    up.set_defaults(func=_up)
    for name, func, text in (
        ("down", _down, "stop by PID"),
        ("status", _status, "is it up (any engine kvkeeper routes to: `kvkeeper engines`)"),
    ):
        p = sub.add_parser(name, help=text, formatter_class=defaults)
        p.add_argument("--port", type=int, default=8100, help="its HTTP port")
        p.set_defaults(func=func)
