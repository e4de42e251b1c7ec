#!/usr/bin/env bash
# Start / stop the local LMCache multi-process stack: `lmcache coordinator` + `lmcache server`.
#
#   deploy/local/lmcache-stack.sh start|stop|status
#
# vLLM attaches to it with
#   --kv-transfer-config '{"kv_connector":"LMCacheMPConnector","kv_role":"kv_both",
#     "kv_connector_extra_config":{"lmcache.mp.host":"tcp://127.0.0.1","lmcache.mp.port":<MP port>}}'
# Settings (environment; defaults in brackets):
#   KVKEEPER_HOME [~/.cache/kvkeeper]   LMCACHE_RUN_DIR [$KVKEEPER_HOME/lmcache/run]: pids, logs
#   LMCACHE_L2_DIR [$LMCACHE_RUN_DIR/l2]   LMCACHE_HOST [127.0.0.1]   LMCACHE_L1_GB [1]
#   LMCACHE_COORD_PORT [9300]  LMCACHE_MP_PORT [9200]  LMCACHE_HTTP_PORT [9280]
#   LMCACHE_PROM_PORT [9290]   LMCACHE_READY_TIMEOUT_S [120]
#   LMCACHE_L2_ADAPTER [a file L2 in $LMCACHE_L2_DIR]: an --l2-adapter JSON, or "none" (L1 only)
# Flags that matter on CPU: `--supported-transfer-mode auto` (else vLLM hangs at start-up) and
# `--eviction-policy` (required with `--shm-name`).
set -euo pipefail

KVKEEPER_HOME="${KVKEEPER_HOME:-$HOME/.cache/kvkeeper}"
LMC_VENV="$KVKEEPER_HOME/lmcache/venv"
RUN_DIR="${LMCACHE_RUN_DIR:-$KVKEEPER_HOME/lmcache/run}"
L2_DIR="${LMCACHE_L2_DIR:-$RUN_DIR/l2}"
HOST="${LMCACHE_HOST:-127.0.0.1}"
COORD_PORT="${LMCACHE_COORD_PORT:-9300}"
MP_PORT="${LMCACHE_MP_PORT:-9200}"
HTTP_PORT="${LMCACHE_HTTP_PORT:-9280}"
PROM_PORT="${LMCACHE_PROM_PORT:-9290}"
L1_GB="${LMCACHE_L1_GB:-1}"
READY_TIMEOUT_S="${LMCACHE_READY_TIMEOUT_S:-120}"
CHUNK_SIZE=256
export LMCACHE_DISABLE_BANNER=1 PYTHONHASHSEED="${PYTHONHASHSEED:-0}"

log() { printf '[lmcache-stack] %s\n' "$*" >&2; }

alive() {  # $1 = name; true when its pid file names a live process
  local pid
  pid="$(cat "$RUN_DIR/$1.pid" 2>/dev/null)" || return 1
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null
}

launch() {  # $1 = name, rest = command; own session so stop can end the whole group
  local name="$1"; shift
  if alive "$name"; then log "$name already running (pid $(cat "$RUN_DIR/$name.pid"))"; return 0; fi
  setsid "$@" >"$RUN_DIR/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN_DIR/$name.pid"
  log "$name started (pid $!, log $RUN_DIR/$name.log)"
}

wait_http() {  # $1 = name, $2 = url, $3 = grep pattern the body must hold
  local deadline=$((SECONDS + READY_TIMEOUT_S))
  until curl -fsS --max-time 2 "$2" 2>/dev/null | grep -q "$3"; do
    alive "$1" || { log "$1 exited during start-up:"; tail -n 20 "$RUN_DIR/$1.log" >&2; return 1; }
    (( SECONDS < deadline )) || { log "$1 not ready after ${READY_TIMEOUT_S}s ($2)"; return 1; }
    sleep 0.5
  done
}

start() {
  [[ -x "$LMC_VENV/bin/lmcache" ]] || { log "no LMCache venv: run deploy/local/lmcache-install.sh"; exit 1; }
  mkdir -p "$RUN_DIR" "$L2_DIR"
  launch coordinator "$LMC_VENV/bin/lmcache" coordinator --host "$HOST" --port "$COORD_PORT" \
    --chunk-size "$CHUNK_SIZE"
  wait_http coordinator "http://$HOST:$COORD_PORT/healthz" healthy
  # L2: a file store under $L2_DIR, or LMCACHE_L2_ADAPTER (an adapter JSON, or "none": L1 only)
  local L2=(--l2-adapter "{\"type\":\"fs\",\"base_path\":\"$L2_DIR\"}")
  if [[ "${LMCACHE_L2_ADAPTER:-}" == none ]]; then L2=()
  elif [[ -n "${LMCACHE_L2_ADAPTER:-}" ]]; then L2=(--l2-adapter "$LMCACHE_L2_ADAPTER"); fi
  # --l1-init-size-gb takes whole GB only: a fractional L1 (tests) is allocated up front instead
  local L1_INIT=(--l1-init-size-gb "$L1_GB")
  [[ "$L1_GB" =~ ^[0-9]+$ ]] || L1_INIT=(--no-l1-use-lazy)
  launch server "$LMC_VENV/bin/lmcache" server --host "$HOST" --port "$MP_PORT" \
    --http-host "$HOST" --http-port "$HTTP_PORT" --prometheus-port "$PROM_PORT" \
    --l1-size-gb "$L1_GB" "${L1_INIT[@]}" --chunk-size "$CHUNK_SIZE" \
    --eviction-policy LRU --supported-transfer-mode auto --shm-name "lmc_shm_$MP_PORT" \
    "${L2[@]}" \
    --coordinator-url "http://$HOST:$COORD_PORT" --coordinator-advertise-ip "$HOST" \
    --coordinator-event-reporting
  wait_http server "http://$HOST:$HTTP_PORT/healthcheck" healthy
  # The server is only useful once the coordinator knows it (lookups, deletes go through it).
  wait_http server "http://$HOST:$COORD_PORT/instances" "\"http_port\":$HTTP_PORT"
  log "ready: coordinator http://$HOST:$COORD_PORT  server http://$HOST:$HTTP_PORT  mp tcp://$HOST:$MP_PORT"
}

stop_one() {  # $1 = name: TERM the process group, KILL after 15 s
  local pid
  pid="$(cat "$RUN_DIR/$1.pid" 2>/dev/null)" || return 0
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then
      log "$1 ignored TERM; killing"
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    fi
    log "$1 stopped (pid $pid)"
  fi
  rm -f "$RUN_DIR/$1.pid"
}

stop() {
  stop_one server
  stop_one coordinator
  # The server names its L1 pool after --shm-name; a killed server leaves it behind.
  rm -f "/dev/shm/lmcache_l1_pool_lmc_shm_$MP_PORT" "/dev/shm/lmc_shm_$MP_PORT"
}

status() {
  local rc=0 name
  for name in coordinator server; do
    if alive "$name"; then echo "$name: running (pid $(cat "$RUN_DIR/$name.pid"))"
    else echo "$name: stopped"; rc=3; fi
  done
  return "$rc"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
