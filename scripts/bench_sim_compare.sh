#!/usr/bin/env bash
# Every simulator figure of BENCHMARKS.md ("Simulator: kvkeeper bench compare"), in one command:
#   bash scripts/bench_sim_compare.sh [OUT_DIR]        (default results/sim_compare; ~85 min on 2 cores)
# Each `kvkeeper bench compare` starts a fresh simulator per target (h100-llama8b timing), and
# kvkeeper (with its own redis-server) or vllm-router in front, as subprocesses.
# ONLY=trace-n8-p25,swarm-p50 runs a subset of the settings; REPEATS=3 plays each comparison three
# times (mean and range per figure); TARGETS=engine,none,full (one replica) and
# R2_TARGETS=none,full,round-robin,vllm-router (two replicas) run fewer targets.
# Targets run only when named, e.g. TARGETS=engine,engine-belady,full+priority: the same engine
# evicting by Belady's rule from the first target's sends, and cache-aware admission order.
# BASE=engine-notier measures `vs base` and gap closed against that target (default: engine).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-results/sim_compare}
ONLY=${ONLY:-}
REPEATS=${REPEATS:-1}
TARGETS=${TARGETS:-}
R2_TARGETS=${R2_TARGETS:-}
BASE=${BASE:-}

# The trace subset: the 16 Claude Code traces whose full prompts stay under ~131K tokens, first
# 10 top-level calls of each (their sub-agents included), think times capped at 60 s, then all
# pauses x0.1 with the simulator 10x faster, so the timeline keeps its shape.
TRACES=trace_0099,trace_0150,trace_0247,trace_0260,trace_0263,trace_0274,trace_0291,trace_0398,trace_0461,trace_0534,trace_0591,trace_0602,trace_0669,trace_0692,trace_0711,trace_0732
TRACE=(--workload trace --set "files=$TRACES" --set max_requests=10 --set max_think=60
       --profile h100-llama8b --speed 10 --time-scale 0.1 --retention tick_s=0.1)
SWARM=(--workload swarm --profile h100-llama8b --speed 2 --time-scale 0.5 --retention tick_s=0.1)
FANOUT=(--workload fanout --set jobs=8 --profile h100-llama8b --speed 2 --time-scale 0.5 --retention tick_s=0.1)

run() {  # NAME ARGS...
    local name=$1; shift
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 0; fi
    echo "== $name"
    local targets=$TARGETS
    if [[ " $* " == *" --replicas "* ]]; then targets=$R2_TARGETS; fi
    python -m proxy.cli bench compare "$@" ${targets:+--targets "$targets"} --repeats "$REPEATS" \
        ${BASE:+--base "$BASE"} --out "$OUT/$name" --no-progress
}

run trace-n8-p25  "${TRACE[@]}" --max-sessions 8  --pool-frac 0.25
run trace-n8-p50  "${TRACE[@]}" --max-sessions 8  --pool-frac 0.5
run trace-n16-p25 "${TRACE[@]}" --max-sessions 16 --pool-frac 0.25
run trace-n16-p50 "${TRACE[@]}" --max-sessions 16 --pool-frac 0.5
run swarm-p50     "${SWARM[@]}"  --pool-frac 0.5
run fanout-p50    "${FANOUT[@]}" --pool-frac 0.5
run swarm-r2-p50  "${SWARM[@]}"  --pool-frac 0.5 --replicas 2
run trace-r2-n16-p50 "${TRACE[@]}" --max-sessions 16 --pool-frac 0.5 --replicas 2
# with an LMCache-shaped CPU tier as large as the pool (write-through, LRU; kvkeeper prefetches
# through it): the ceilings stay those of the pool alone. TARGETS=engine,engine-notier,full,full+pins
# adds the engine without the tier and kvkeeper pinning protected sessions in it
run trace-n8-p25-tier  "${TRACE[@]}" --max-sessions 8  --pool-frac 0.25 --cpu-blocks 1920
run trace-n8-p50-tier  "${TRACE[@]}" --max-sessions 8  --pool-frac 0.5  --cpu-blocks 3839
run trace-n16-p25-tier "${TRACE[@]}" --max-sessions 16 --pool-frac 0.25 --cpu-blocks 2344
run trace-n16-p50-tier "${TRACE[@]}" --max-sessions 16 --pool-frac 0.5  --cpu-blocks 4687
run swarm-p50-tier     "${SWARM[@]}" --pool-frac 0.5 --cpu-blocks 1057
run fanout-p50-tier    "${FANOUT[@]}" --pool-frac 0.5 --cpu-blocks 1102
# the congested trace settings and the swarm with a tier twice the pool
run trace-n8-p25-tier2x  "${TRACE[@]}" --max-sessions 8  --pool-frac 0.25 --cpu-blocks 3840
run trace-n16-p25-tier2x "${TRACE[@]}" --max-sessions 16 --pool-frac 0.25 --cpu-blocks 4688
run swarm-p50-tier2x     "${SWARM[@]}" --pool-frac 0.5 --cpu-blocks 2114
# the same with LMCache MP's two levels: an L1 as large as the pool that stays LRU, written
# through to an L2 as large again whose eviction pins protect, loads from it 4x an L1 load
run swarm-p50-tier-l2  "${SWARM[@]}" --pool-frac 0.5 --cpu-blocks 1057 --cpu-l2-blocks 1057
run trace-n16-p50-tier-l2 "${TRACE[@]}" --max-sessions 16 --pool-frac 0.5 --cpu-blocks 4687 --cpu-l2-blocks 4687
