"""The local CPU engine's dtype: bf16 only where the CPU computes it natively."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.engine_cli import EngineSpec, engine_dtype

AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_float32_where_bf16_would_be_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVKEEPER_ENGINE_DTYPE", raising=False)
    assert engine_dtype(AVX2_EPYC) == "float32"
    assert engine_dtype(SAPPHIRE_RAPIDS) == "bfloat16"


def test_the_environment_overrides_and_reaches_the_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVKEEPER_ENGINE_DTYPE", "bfloat16")
    assert engine_dtype(AVX2_EPYC) == "bfloat16"
    cmd = EngineSpec(port=8123).command(Path("py"), Path("m"))
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
