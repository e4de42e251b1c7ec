"""Children tied to their parent: the launcher passes the command through unchanged, and a child
outlives neither a parent killed with SIGKILL nor one that never forked it from its main thread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from proxy.children import tied_to_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_launcher_runs_the_command_with_its_arguments_and_exit_status() -> None:
    argv = tied_to_parent(["sh", "-c", 'printf "%s|" "$@"; exit 3', "sh", "a b", "-c"])
    assert argv[0] == sys.executable
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (3, "a b|-c|")


def test_off_the_main_thread_the_command_is_left_alone() -> None:
    seen: list[list[str]] = []
    worker = threading.Thread(target=lambda: seen.append(tied_to_parent(["true"])))
    worker.start()
    worker.join(10)
    assert seen == [["true"]]


def test_the_child_dies_when_its_parent_is_killed() -> None:
    code = (
        "import subprocess, sys, time\n"
        "from proxy.children import tied_to_parent\n"
        "p = subprocess.Popen(tied_to_parent(['sleep', '600']))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while (
            b"sleep" not in Path(f"/proc/{child}/cmdline").read_bytes()
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)  # the launcher has exec'd into the command
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(child)
    finally:
        parent.kill()
        parent.wait(timeout=10)
        if "child" in locals() and _alive(child):
            os.kill(child, signal.SIGKILL)
