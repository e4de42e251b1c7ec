"""Child processes that never outlive the process that started them.

``die_with_parent()`` is a ``preexec_fn`` for ``subprocess``/``asyncio`` that asks Linux to
SIGKILL the child when its parent goes, however the parent goes (SIGKILL included): the last line
of defence behind the orderly stops, which cannot run when the parent is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "prctl", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_PRCTL = _prctl()  # resolved here: the forked child only calls it


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die (SIGKILL) with this process, or None where the
    platform has no such request (the orderly stops still apply there).

    Linux signals the child when the *thread* that forked it ends, so this is only offered on
    the main thread (which lives as long as the process); elsewhere it is None.
    """
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    prctl, parent = _PRCTL, os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return preexec


def exit_with_parent(parent: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when ``parent`` (the process that started it,
    from its main thread) dies; at once if it already has. False where the platform cannot."""
    if _PRCTL is None:
        return False
    _PRCTL(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def interrupt_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does: the runs unwind and the stacks they
    started are stopped (the default action ends the process with nothing cleaned up)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
