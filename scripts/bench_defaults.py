"""BENCHMARKS.md section 1 in one command: kvkeeper's defaults against vanilla vLLM and plain
LMCache on every setting, several rounds, then ``summary.md`` / ``summary.json`` / ``summary.png``.

    python scripts/bench_defaults.py --out DIR [--rounds N] [--only traces-a,swarm,...] \\
        [--pinned/--no-pinned] [--busy N --busy-on proxy|engine] \\
        [--targets engine-notier,engine,default] [-- EXTRA BENCH ARGS]
    python scripts/bench_defaults.py --summarize DIR

Settings (``loadgen/defaults_bench.py``): traces-a, traces-b, traces-c, swarm, fanout,
mooncake-w1, mooncake-w2. Each round plays every setting once; even rounds play the settings in
reverse order, and the targets after the first in reverse (as ``bench compare --repeats``).
One ``bench compare`` per setting and round, its ``--out`` ``DIR/<setting>/r<k>/``, its output
in ``DIR/<setting>/r<k>.log``; a round whose ``compare.json`` is already there is not run again
(so a larger ``--rounds`` on the same DIR adds rounds). Pinned (the default, with two CPUs or
more): the bench, kvkeeper and Redis on CPU 0, every simulator on CPU 1
(``scripts/bench_pinned.py``); ``--busy N`` adds N busy loops on the core ``--busy-on`` names,
started 50 s before each bench, for rounds under load. ``EXTRA BENCH ARGS`` go to every bench after the setting's own,
e.g. ``-- --set jobs=2`` for a short check.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_pinned import run_pinned  # scripts/, this file's directory

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's loadgen, and the benches' (PYTHONPATH below)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

from loadgen.defaults_bench import (  # noqa: E402
    DEFAULT_TARGETS,
    DEFAULTS,
    SETTINGS,
    VANILLA,
    bench_args,
    setting_order,
    write_summary,
)


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def _commit() -> str:
    """This checkout's commit, ``+changes`` when tracked files differ from it."""
    git = ["git", "-C", str(ROOT)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="results directory")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every setting (default 3)")
    ap.add_argument("--only", default="", help=f"comma list of settings: {', '.join(SETTINGS)}")
    ap.add_argument(
        "--pinned",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="simulators on CPU 1, the rest on CPU 0 (default; needs two CPUs)",
    )
    ap.add_argument("--busy", type=int, default=0, help="busy loops beside every bench")
    ap.add_argument("--busy-on", choices=["proxy", "engine"], default="proxy",
                    help="the core the busy loops run on (pinned; default: the proxy's)")  # fmt: skip
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="bench targets")
    ap.add_argument("--summarize", type=Path, metavar="DIR", help="only write DIR's summary")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="-- then extra bench compare args")
    args = ap.parse_args()
    if args.summarize is None and args.out is None:
        ap.error("give --out DIR (or --summarize DIR)")
    args.extra = [a for a in args.extra if a != "--"]
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(SETTINGS)
    if unknown := [n for n in names if n not in SETTINGS]:
        ap.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    args.names = names
    args.target_list = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.target_list[:1] != [VANILLA] or DEFAULTS not in args.target_list:
        ap.error(f"--targets must start with {VANILLA} (the base) and include {DEFAULTS}")
    return args


def _summarize(root: Path) -> None:
    settings = write_summary(root)
    print((root / "summary.md").read_text())
    _say(f"{len(settings)} settings: {root / 'summary.md'}, summary.json, summary.png")


def main() -> int:
    args = _parse()
    if args.summarize is not None:
        _summarize(args.summarize)
        return 0
    root: Path = args.out
    root.mkdir(parents=True, exist_ok=True)
    pinned = args.pinned and len(os.sched_getaffinity(0)) >= 2
    if args.pinned and not pinned:
        _say("one CPU only: running unpinned")
    plan = [(k, n) for k in range(1, args.rounds + 1) for n in setting_order(args.names, k)]
    failed = 0
    t_all = time.monotonic()
    for i, (k, name) in enumerate(plan, 1):
        out = root / name / f"r{k}"
        head = f"round {k}/{args.rounds} {name} ({i}/{len(plan)})"
        if (out / "compare.json").exists():
            _say(f"{head}: already there, skipped")
            continue
        cmd = bench_args(SETTINGS[name], args.target_list, k, [*args.extra, "--no-progress"])
        busy = f", {args.busy} busy loops on the {args.busy_on}'s core" if args.busy else ""
        _say(f"{head}: start{' (pinned)' if pinned else ''}{busy}")
        t0 = time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        (out / "commit").write_text(_commit() + "\n")
        with (root / name / f"r{k}.log").open("ab") as log:
            rc = run_pinned(out, cmd, pin=pinned, busy=args.busy, busy_on=args.busy_on, stdout=log)
        failed += rc != 0
        status = "done" if rc == 0 else f"exit {rc} (see {out}.log)"
        _say(f"{head}: {status} in {_clock(time.monotonic() - t0)}, "
             f"{_clock(time.monotonic() - t_all)} so far")  # fmt: skip
    _summarize(root)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
