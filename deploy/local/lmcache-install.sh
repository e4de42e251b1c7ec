#!/usr/bin/env bash
# Install LMCache 0.5.6 for the local CPU stack (its coordinator + MP server, and the vLLM connector).
#
#   deploy/local/lmcache-install.sh [venv|connector|all]   (default: all)
#
# venv:      its own venv for the `lmcache coordinator` / `lmcache server` processes at
#            $KVKEEPER_HOME/lmcache/venv (torch 2.13.0 CPU first so pip does not pull a CUDA torch).
# connector: the LMCacheMPConnector inside the vLLM engine venv ($KVKEEPER_HOME/engine/venv),
#            --no-deps so vLLM's own pins (numpy, protobuf, prometheus-client) are left alone.
# Idempotent: each step is skipped when its marker import already works.
set -euo pipefail

KVKEEPER_HOME="${KVKEEPER_HOME:-$HOME/.cache/kvkeeper}"
LMCACHE_VERSION="0.5.6"
TORCH_VERSION="2.13.0"
LMC_DIR="$KVKEEPER_HOME/lmcache"
LMC_VENV="$LMC_DIR/venv"
ENGINE_VENV="${KVKEEPER_ENGINE_VENV:-$KVKEEPER_HOME/engine/venv}"
PYTHON="${PYTHON:-python3.11}"

log() { printf '[lmcache-install] %s\n' "$*" >&2; }

has_lmcache() {  # $1 = python; true when the pinned lmcache is importable there
  "$1" - <<PY 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("lmcache") == "$LMCACHE_VERSION" else 1)
PY
}

install_venv() {
  mkdir -p "$LMC_DIR"
  if [[ -x "$LMC_VENV/bin/lmcache" ]] && has_lmcache "$LMC_VENV/bin/python"; then
    log "LMCache venv ready: $LMC_VENV"
    return 0
  fi
  [[ -x "$LMC_VENV/bin/python" ]] || "$PYTHON" -m venv "$LMC_VENV"
  "$LMC_VENV/bin/pip" install --quiet --upgrade pip wheel
  log "installing torch==$TORCH_VERSION into $LMC_VENV"
  "$LMC_VENV/bin/pip" install "torch==$TORCH_VERSION"
  log "installing lmcache==$LMCACHE_VERSION into $LMC_VENV"
  "$LMC_VENV/bin/pip" install "lmcache==$LMCACHE_VERSION"
  LMCACHE_DISABLE_BANNER=1 "$LMC_VENV/bin/python" -c "import lmcache" >/dev/null
  log "LMCache venv ready: $LMC_VENV"
}

wait_engine_venv() {
  # The engine venv is built by another script; touching it mid-install would race pip.
  local ilog="$KVKEEPER_HOME/engine/install.log" waited=0 limit="${LMCACHE_ENGINE_WAIT_S:-1800}"
  while [[ -f "$ilog" ]] && ! tail -n 3 "$ilog" | grep -q DONE; do
    (( waited >= limit )) && { log "engine venv install not DONE after ${limit}s: $ilog"; return 1; }
    (( waited % 60 == 0 )) && log "waiting for the engine venv install ($ilog)"
    sleep 5; waited=$((waited + 5))
  done
  [[ -x "$ENGINE_VENV/bin/python" ]] || { log "no engine venv at $ENGINE_VENV"; return 1; }
}

install_connector() {
  wait_engine_venv
  # engine-setup.sh holds this lock while it pips into the same venv.
  exec 8>"$KVKEEPER_HOME/engine/.setup.lock"
  flock -w "${LMCACHE_ENGINE_WAIT_S:-1800}" 8 || { log "engine venv lock busy"; return 1; }
  if has_lmcache "$ENGINE_VENV/bin/python"; then
    log "connector ready in $ENGINE_VENV"
    return 0
  fi
  log "installing the LMCache connector into $ENGINE_VENV (--no-deps)"
  "$ENGINE_VENV/bin/pip" install --no-deps "lmcache==$LMCACHE_VERSION" \
    aiofile aiofiles nvtx sortedcontainers redis
  # The module vLLM's LMCacheMPConnector imports; fails loudly if a dependency is missing.
  LMCACHE_DISABLE_BANNER=1 "$ENGINE_VENV/bin/python" -c \
    "import lmcache.integration.vllm.vllm_multi_process_adapter" >/dev/null
  log "connector ready in $ENGINE_VENV"
}

case "${1:-all}" in
  venv) install_venv ;;
  connector) install_connector ;;
  all) install_venv; install_connector ;;
  *) echo "usage: $0 [venv|connector|all]" >&2; exit 2 ;;
esac
