"""Find the live processes a test started, by identity rather than by name across the machine:
a marker in their environment (children inherit it), or, for redis-server (which writes its
title over its environment), its socket under the test's own temporary folder."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

MARK_VAR = "KVKEEPER_TEST_MARK"


@dataclass(frozen=True)
class Mark:
    folder: Path  # TMPDIR of the processes started: embedded Redis sockets land under it
    value: str = field(default_factory=lambda: uuid.uuid4().hex)

    def env(self) -> dict[str, str]:
        return {MARK_VAR: self.value, "TMPDIR": str(self.folder)}


def marked(mark: Mark) -> dict[int, str]:
    """pid -> command line of every live (not zombie) process of ``mark``."""
    needle = f"{MARK_VAR}={mark.value}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ours = str(mark.folder) in cmd and "redis-server" in cmd
            if not ours and needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            found[int(entry.name)] = cmd.strip()
    return found


def redis_servers(mark: Mark) -> dict[int, str]:
    return {pid: cmd for pid, cmd in marked(mark).items() if "redis-server" in cmd}


def wait_for(mark: Mark, *, redis_only: bool, gone: bool, timeout_s: float) -> dict[int, str]:
    """Poll until the marked processes are all gone (``gone``) or one is up; returns the last
    look (non-empty after a timeout waiting for ``gone``: the leftovers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = redis_servers(mark) if redis_only else marked(mark)
        if bool(now) != gone or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def kill_marked(mark: Mark) -> None:
    """SIGKILL whatever a (failed) test left behind."""
    for pid in marked(mark):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
