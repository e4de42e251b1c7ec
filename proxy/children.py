"""Child processes that never outlive the process that started them.

``tied_to_parent(argv)`` runs a command through a tiny launcher that asks Linux to SIGKILL it when
its parent goes, however the parent goes (SIGKILL included): the last line of defence behind the
orderly stops, which cannot run when the parent is killed. The request is made in the launcher,
after ``exec`` of a fresh interpreter, not in a ``preexec_fn``: running Python between fork and
exec can deadlock the child, and the parent with it, when other threads held a lock at the fork.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# argv: parent pid, signal, command...; the death signal survives the exec into the command
_LAUNCHER = (
    "import ctypes,os,sys\n"
    "ctypes.CDLL(None).prctl(1, int(sys.argv[2]), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


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


_PRCTL = _prctl()


def tied_to_parent(argv: Sequence[str], sig: int = signal.SIGKILL) -> list[str]:
    """``argv`` wrapped so the child gets ``sig`` when this process dies; ``argv`` unchanged where
    the platform has no such request (the orderly stops still apply there).

    Linux signals the child when the *thread* that forked it ends, so this is only offered on
    the main thread (which lives as long as the process); elsewhere ``argv`` is unchanged.
    """
    if (
        _PRCTL is None
        or not sys.executable
        or threading.current_thread() is not threading.main_thread()
    ):
        return list(argv)
    launcher = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), str(int(sig))]
    return [*launcher, *argv]


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
