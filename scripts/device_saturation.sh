#!/usr/bin/env bash
# Issue 29's saturation run on the 16-core device machine (Python 3.12, no network), in the repo
# root there: installs the carried .whl/ (scripts/device_bundle.sh builds it) into /tmp/site, then
# runs bench_proxy_overhead.py --saturate with every part pinned to its own cores. The device call:
#   run(command="bash scripts/device_saturation.sh", carry=[".whl"], timeout_s=570)
# writes env.txt, saturation.json, saturation.log and serverlogs.txt under $OUT (~6 min).
# QUICK=1: 6 s windows and workers 1,6 (~3 min). SAT_* variables override each setting; on fewer
# than 16 cores the pinning is left out. NO_WHL=1 skips the install (a dry run elsewhere).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/results/device}
mkdir -p "$OUT"
if [ "${QUICK:-0}" = 1 ]; then seconds=6 workers=1,6; else seconds=10 workers=1,3,6; fi
SAT_C=${SAT_C:-256}
SAT_SECONDS=${SAT_SECONDS:-$seconds}
SAT_WARMUP=${SAT_WARMUP:-1}
SAT_ROUNDS=${SAT_ROUNDS:-3}
SAT_LOAD_PROCS=${SAT_LOAD_PROCS:-5}
SAT_UPSTREAM_PROCS=${SAT_UPSTREAM_PROCS:-4}
SAT_WORKERS=${SAT_WORKERS:-$workers}
SAT_PIN=${SAT_PIN:-proxy=0-5,upstream=6-9,redis=10,load=11-15}
SAT_TIMEOUT=${SAT_TIMEOUT:-500}  # the bench gets SIGINT then; its JSON holds the rounds done
SAT_LOG_DIR=${SAT_LOG_DIR:-/tmp/benchlogs}
SITE=${SAT_SITE:-/tmp/site}  # where the wheels go
read -r -a extra <<<"${SAT_EXTRA:-}"  # more bench flags, e.g. SAT_EXTRA="--only kvkeeper+hints"

args=(--sat-c "$SAT_C" --seconds "$SAT_SECONDS" --warmup "$SAT_WARMUP" --rounds "$SAT_ROUNDS"
  --load-procs "$SAT_LOAD_PROCS" --upstream-procs "$SAT_UPSTREAM_PROCS")
[ "$(nproc)" -ge 16 ] && [ -n "$SAT_PIN" ] && args+=(--pin "$SAT_PIN")

if [ "${NO_WHL:-0}" != 1 ]; then
  chmod +x .whl/bin/* || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH=$SITE:$PWD PATH=$SITE/bin:$PWD/.whl/bin:$PATH
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1

{
  date -u
  nproc
  python3 -V
  command -v python3 redis-server vllm-router
  redis-server --version
  python3 -c 'import proxy.cli,aiohttp,uvloop,vllm_router_rs,pydantic
print("aiohttp",aiohttp.__version__,"uvloop",uvloop.__version__,"pydantic",pydantic.VERSION)'
} 2>&1 | tee "$OUT/env.txt" || exit 1

mkdir -p "$SAT_LOG_DIR"
rm -f "$SAT_LOG_DIR"/*.log
echo "bench_proxy_overhead.py --saturate ${args[*]} --workers $SAT_WORKERS ${extra[*]}"
timeout -s INT "$SAT_TIMEOUT" python3 scripts/bench_proxy_overhead.py --saturate "${args[@]}" \
  --workers "$SAT_WORKERS" "${extra[@]}" --log-dir "$SAT_LOG_DIR" --out "$OUT/saturation.json" \
  2>&1 | tee "$OUT/saturation.log"
rc=$?
tail -n 25 "$SAT_LOG_DIR"/*.log >"$OUT/serverlogs.txt" 2>&1
date -u
exit "$rc"
