#!/usr/bin/env bash
# The whole test suite on a fresh machine, set-up included (this is what CI runs via .ci/run):
#   1. redis-server from the distribution (apt) when missing,
#   2. kvkeeper with its dev extras into the current Python,
#   3. the local vLLM-on-CPU engine venv + model and the LMCache venv (idempotent, cached),
#   4. pytest over tests/ (unit, integration, realengine). "No tests collected" (exit 5) fails.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not realengine"`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v redis-server >/dev/null 2>&1; then
    echo "== installing redis-server (apt)"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server
fi
if ! command -v chromium >/dev/null 2>&1; then  # the console's browser tests (Playwright drives it)
    echo "== installing chromium (apt)"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
fi

echo "== installing kvkeeper[dev]"
python3 -m pip install -q --disable-pip-version-check -e ".[dev]"

if [ "${KVKEEPER_SKIP_ENGINE:-0}" != "1" ]; then
    echo "== local vLLM CPU engine (venv + model; cached after the first run)"
    bash deploy/local/engine-setup.sh
    echo "== LMCache multi-process stack (venv; cached after the first run)"
    bash deploy/local/lmcache-install.sh
fi

echo "== pytest"
set +e
python3 -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit "$rc"
