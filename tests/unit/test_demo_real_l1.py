"""``kvkeeper demo --real``'s LMCache L1: as large as the engine's KV pool (the simulator demo's
tier), from the model's own geometry."""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.demo_real import pool_l1_gb

# SmolLM2-135M, the model `kvkeeper engine` serves: 30 layers, 3 KV heads of 64
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576, "head_dim": 64}  # fmt: skip


def _model(tmp_path: Path, config: dict[str, int]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_l1_holds_the_pool_and_no_more(tmp_path: Path) -> None:
    model = _model(tmp_path, SMOLLM2)
    # 129 blocks x 32 tokens x K and V x 30 layers x 3 heads x 64 x 2 bytes = 95.1 MB
    assert pool_l1_gb(129, model, "bfloat16") == "0.09"
    assert pool_l1_gb(129, model, "float32") == "0.18"  # four bytes a value
    assert float(pool_l1_gb(1290, model, "bfloat16")) == 0.89  # ten times the pool, rounded up


def test_head_dim_and_kv_heads_default_as_transformers_does(tmp_path: Path) -> None:
    # no head_dim: hidden / heads; no num_key_value_heads: every head has its own K and V
    plain = {"num_hidden_layers": 30, "num_attention_heads": 9, "hidden_size": 576}
    assert pool_l1_gb(129, _model(tmp_path, plain), "bfloat16") == "0.27"
