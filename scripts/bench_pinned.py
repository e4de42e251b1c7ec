"""Run one ``kvkeeper bench compare`` with the simulated engines on their own core.

The bench client, kvkeeper and redis run on ``--proxy-cpu``; every ``proxy.cli sim`` child of
the bench is moved to ``--engine-cpu`` as soon as it appears. Optional busy loops
(``python3 -c 'while 1: pass'``) start ``--lead-in`` seconds before the bench on the core
``--busy-on`` names. ``<out>/pinned.log`` gets ``/proc/loadavg`` every 5 s and, per sim/serve/redis
child, its CPU time and the time it waited runnable for a CPU (``/proc/PID/task/*/schedstat``).
Linux only (``os.sched_setaffinity``). ``run_pinned`` is the same for other scripts
(``scripts/bench_defaults.py``). Usage:

    python3 scripts/bench_pinned.py --out DIR --busy 2 --busy-on proxy -- \
        --workload trace --set files=... --targets engine-notier,engine,default
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _descendants(root: int) -> list[int]:
    found: list[int] = []
    todo = [root]
    while todo:
        kids = _children(todo.pop())
        found.extend(kids)
        todo.extend(kids)
    return found


def _is_sim(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"proxy.cli" in argv and b"sim" in argv


def _pin_all(pid: int, cpu: int) -> None:
    """Pin every thread of ``pid`` (threads started before the move keep their own mask)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, {cpu})


def _role(pid: int) -> str | None:
    """``sim``, ``serve`` or ``redis`` for the bench's children worth timing, else None."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if b"proxy.cli" in argv:
        for role in ("sim", "serve"):
            if role.encode() in argv:
                return role
    if argv and b"redis-server" in argv[0]:
        return "redis"
    return None


def _schedstat(pid: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) summed over the threads."""
    on = wait = 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
            on += int(fields[0]) / 1e9
            wait += int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
    return on, wait


def _watch(root: int, cpu: int | None, stop: threading.Event, log: list[str]) -> None:
    """Move the bench's simulators to ``cpu`` as they appear (re-checked every 50 ms; None:
    leave them), and keep each sim/serve/redis child's last CPU and run-queue wait times
    (sampled every 0.5 s)."""
    seen: set[int] = set()
    last: dict[int, tuple[str, float, float, float]] = {}
    n = 0
    while not stop.is_set():
        for pid in _descendants(root):
            if cpu is not None and _is_sim(pid):
                _pin_all(pid, cpu)
                if pid not in seen:
                    seen.add(pid)
                    log.append(f"{time.strftime('%H:%M:%S')} sim {pid} -> cpu {cpu}")
            if n % 10 == 0 and (role := _role(pid)) is not None:
                st = _schedstat(pid)
                if st is not None:
                    first = last[pid][3] if pid in last else time.time()
                    last[pid] = (role, st[0], st[1], first)
        n += 1
        stop.wait(0.05)
    for pid, (role, on, wait, first) in sorted(last.items()):
        log.append(
            f"{role} {pid} from {time.strftime('%H:%M:%S', time.gmtime(first))}: "
            f"cpu {on:.1f} s, waited for a cpu {wait:.1f} s ({wait / max(on, 1e-9):.2f}x)"
        )


def _load_log(path: Path, stop: threading.Event) -> None:
    with path.open("a") as f:
        while not stop.is_set():
            load = Path("/proc/loadavg").read_text().split()[0]
            f.write(f"{time.strftime('%H:%M:%S')} load {load}\n")
            f.flush()
            stop.wait(5.0)


def run_pinned(
    out: Path,
    bench_args: Sequence[str],
    *,
    pin: bool = True,
    proxy_cpu: int = 0,
    engine_cpu: int = 1,
    busy: int = 0,
    busy_on: str = "proxy",
    lead_in: float = 50.0,
    stdout: IO[bytes] | None = None,
) -> int:
    """Run ``bench compare <bench_args> --out <out>``; its exit code. ``pin``: this process and
    so the bench on ``proxy_cpu``, the simulators moved to ``engine_cpu`` (False: no affinity
    set, the load and run-queue waits logged all the same). ``stdout``: the bench's output."""
    out.mkdir(parents=True, exist_ok=True)
    logpath = out / "pinned.log"
    busy_cpu = proxy_cpu if busy_on == "proxy" else engine_cpu
    loops: list[subprocess.Popen[bytes]] = []
    rc = 1
    watcher: threading.Thread | None = None
    stop = threading.Event()
    events: list[str] = []
    loader = threading.Thread(target=_load_log, args=(logpath, stop), daemon=True)
    loader.start()
    try:
        for _ in range(busy):
            p = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
            os.sched_setaffinity(p.pid, {busy_cpu})
            loops.append(p)
        if loops:
            time.sleep(lead_in)
        if pin:
            os.sched_setaffinity(0, {proxy_cpu})  # the bench and its children inherit this
        cmd = [sys.executable, "-m", "proxy.cli", "bench", "compare", *bench_args]
        cmd += ["--out", str(out)]
        with logpath.open("a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} start busy={busy}@cpu{busy_cpu} "
                    f"{'' if pin else 'unpinned '}{' '.join(cmd)}\n")  # fmt: skip
        bench = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT if stdout else None)
        watcher = threading.Thread(
            target=_watch,
            args=(bench.pid, engine_cpu if pin else None, stop, events),
            daemon=True,
        )
        watcher.start()
        rc = bench.wait()
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(timeout=5)
        for p in loops:
            p.kill()
            p.wait()
    with logpath.open("a") as f:
        f.writelines(e + "\n" for e in events)
        f.write(f"{time.strftime('%H:%M:%S')} end rc={rc}\n")
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, required=True, help="bench --out directory")
    ap.add_argument("--proxy-cpu", type=int, default=0)
    ap.add_argument("--engine-cpu", type=int, default=1)
    ap.add_argument("--busy", type=int, default=0, help="busy loops to start")
    ap.add_argument("--busy-on", choices=["proxy", "engine"], default="proxy")
    ap.add_argument("--lead-in", type=float, default=50.0, help="seconds of busy loops first")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench compare args")
    args = ap.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"] if args.bench_args else []
    return run_pinned(
        args.out,
        bench_args,
        proxy_cpu=args.proxy_cpu,
        engine_cpu=args.engine_cpu,
        busy=args.busy,
        busy_on=args.busy_on,
        lead_in=args.lead_in,
    )


if __name__ == "__main__":
    raise SystemExit(main())
